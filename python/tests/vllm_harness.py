"""A P/D harness around vLLM's real v1 ``Scheduler`` on CPU, with ``PdkvConnector`` on both legs.

Each leg is a real ``Scheduler`` (its own ``KVCacheManager`` and block pool, the connector's
scheduler side loaded by name through ``kv_connector_module_path``) plus the connector's worker
side over CPU KV tensors in shared memory. The harness plays the model runner: it binds the
connector metadata, starts loads, "computes" KV by writing position-tagged values into the blocks
vLLM assigned, samples a token when a prompt is done, and hands the connector's transfer results
back to the scheduler. No model weights, no GPU: only a hand-written ``config.json``.

Tags come from the definition, not from pdkv: token ``t`` of a layer plane holds
``tag(seed, plane, t)`` in every word of its slot, a mamba state holds ``tag(seed, plane,
tokens_seen)``. The checks recompute them independently.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from pdkv_vllm import memory  # noqa: E402
from pdkv_vllm.connector import PdkvConnector  # noqa: E402
from pdkv_vllm.stats import PdkvStats  # noqa: E402

MAX_MODEL_LEN = 2048
BLOCK = 16
MASK = (1 << 31) - 1


def tag(seed: int, plane: int, position: int, head: int = 0) -> int:
    """The value a leg writes for token (or state length) ``position`` of ``plane``, in KV head
    ``head`` (the model's head number, whichever rank holds it)."""
    return (seed * 1_000_003 + plane * 10_007 + position * 31 + head * 7_919 + 7) & MASK


def global_head(kv_heads: int | None, tp: int, rank: int, local: int) -> int:
    """The model's KV head that local head ``local`` of TP rank ``rank`` holds, as vLLM shards
    them: contiguous ranges when ``tp <= kv_heads``, each head replicated on ``tp / kv_heads``
    consecutive ranks beyond. Without ``kv_heads`` (legs of equal TP) every rank numbers its own."""
    if kv_heads is None:
        return local
    if tp <= kv_heads:
        return rank * (kv_heads // tp) + local
    return rank // (tp // kv_heads)


# Layouts: groups as (kind, block_size, window or chunk) with layer names; the DCP layout runs
# two ranks.
LAYOUTS = {
    "full": {"groups": [("full", BLOCK, None)], "layers": [["f0", "f1"]], "dcp": 1},
    "full+window": {
        "groups": [("full", BLOCK, None), ("sliding_window", BLOCK, 48)],
        "layers": [["f0", "f1"], ["s0", "s1"]],
        "dcp": 1,
    },
    "full+window+mamba": {
        "groups": [("full", BLOCK, None), ("sliding_window", BLOCK, 40), ("mamba", None, None)],
        "layers": [["f0"], ["s0"], ["m0"]],
        "dcp": 1,
    },
    # Llama 4's chunked local attention: a token attends within its chunk of 48 tokens (three
    # blocks; vLLM requires whole blocks), beside full attention.
    "full+chunked": {
        "groups": [("full", BLOCK, None), ("chunked_local", BLOCK, 3 * BLOCK)],
        "layers": [["f0", "f1"], ["c0", "c1"]],
        "dcp": 1,
    },
    "dcp2": {"groups": [("full", BLOCK, None)], "layers": [["f0", "f1"]], "dcp": 2},
    # Scheduler blocks of BLOCK tokens split over DCP ranks otherwise than "full" (one rank holds
    # a block whole) and "dcp2" (blocks of 2 * BLOCK): per-rank blocks of BLOCK / dcp tokens,
    # single tokens or runs of `interleave` to each DCP rank in turn.
    "dcp2-split": {"groups": [("full", BLOCK // 2, None)], "layers": [["f0", "f1"]], "dcp": 2},
    "dcp2-split-runs": {"groups": [("full", BLOCK // 2, None)], "layers": [["f0", "f1"]], "dcp": 2, "interleave": BLOCK // 2},
    "dcp4-split-pairs": {"groups": [("full", BLOCK // 4, None)], "layers": [["f0", "f1"]], "dcp": 4, "interleave": 2},
    # A draft model's attention layer has KV of its own, beside the target's: one more layer.
    "full+draft": {"groups": [("full", BLOCK, None)], "layers": [["f0", "f1", "draft.f0"]], "dcp": 1},
    # Speculative decoding: the mamba group keeps 2 scratch blocks after its state.
    "full+mamba+spec": {
        "groups": [("full", BLOCK, None), ("mamba", None, None)],
        "layers": [["f0"], ["m0"]],
        "dcp": 1,
        "speculative_blocks": 2,
    },
    # Mamba prefix caching (mamba_cache_mode "align", which needs prefix caching): the state
    # group is position-indexed like attention, with 1 scratch block after the running state.
    "full+window+mamba-align": {
        "groups": [("full", BLOCK, None), ("sliding_window", BLOCK, 40), ("mamba_align", BLOCK, None)],
        "layers": [["f0"], ["s0"], ["m0"]],
        "dcp": 1,
        "speculative_blocks": 1,
    },
    # Three layers per group, so pipeline stages of 2 and 3 split them at different layers.
    "deep": {
        "groups": [("full", BLOCK, None), ("sliding_window", BLOCK, 40)],
        "layers": [["f0", "f1", "f2"], ["s0", "s1", "s2"]],
        "dcp": 1,
    },
}

#: The layouts every sweep runs ("deep" is for pipeline stages).
SWEPT = [name for name in LAYOUTS if name != "deep" and "-split" not in name]


def dcp_holder(offset: int, dcp: int, interleave: int) -> tuple[int, int]:
    """``(DCP rank, slot)`` holding token ``offset`` of a scheduler block, as vLLM's
    ``compute_slot_mapping`` places it: runs of ``interleave`` tokens to each DCP rank in turn."""
    rank = (offset // interleave) % dcp
    return rank, (offset // (dcp * interleave)) * interleave + offset % interleave


def dcp_token(slot: int, share: int, dcp: int, interleave: int) -> int:
    """The offset in its scheduler block of the token slot ``slot`` of DCP rank ``share`` holds
    (the inverse of :func:`dcp_holder`)."""
    return (slot // interleave) * interleave * dcp + share * interleave + slot % interleave


def first_attended(kind: str, size: int | None, n: int) -> int:
    """The first token the last of ``n`` prompt tokens attends to, by definition: ``size`` is a
    window group's window (the last W tokens, itself among them) or a chunked group's chunk (its
    own chunk of C tokens, from C * floor((n - 1) / C)); every earlier token otherwise."""
    if kind == "sliding_window":
        return max(0, n - size)
    if kind == "chunked_local":
        return (n - 1) // size * size
    return 0


def is_state(kind: str) -> bool:
    return kind in ("mamba", "mamba_align")


def aligned(layout: str) -> bool:
    """Whether the layout runs vLLM's mamba prefix caching (mamba_cache_mode "align")."""
    return any(kind == "mamba_align" for kind, _, _ in LAYOUTS[layout]["groups"])

HEADS, HEAD = 2, 8  # per token: K and V of 2 heads x 8 floats = 32 words


def mamba_shapes(speculative_blocks: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """A mamba layer's state (a convolution state and a temporal state), as vLLM sizes it: the
    convolution state keeps one more column per speculative token (``conv_kernel - 1 + k``)."""
    return (4, 6 + speculative_blocks), (3, 5)


def model_dir(root: Path, kv_heads: int | None = None) -> str:
    """A directory holding only a hand-written config.json (no weights, no tokenizer)."""
    path = root / ("model" if kv_heads is None else f"model-{kv_heads}-kv-heads")
    path.mkdir(exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 8,
        # DCP 2 needs more TP ranks than KV heads.
        "num_key_value_heads": 1 if kv_heads is None else kv_heads,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "max_position_embeddings": MAX_MODEL_LEN,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def speculative(root: Path, k: int) -> SpeculativeConfig:
    """A draft model proposing ``k`` tokens a step (the same hand-written config): vLLM reserves
    ``k`` lookahead slots per request, as for EAGLE/MTP."""
    model = ModelConfig(model=model_dir(root), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float32")
    return SpeculativeConfig(
        model=model_dir(root),
        method="draft_model",
        num_speculative_tokens=k,
        target_model_config=model,
        target_parallel_config=ParallelConfig(),
    )


BLOCK_OUTERMOST = ("BLHNC", "BLNHC")


def stage_layers(layers: list[str], stage: int, pp: int) -> list[str]:
    """The layers of a group pipeline stage ``stage`` of ``pp`` holds: a contiguous share, as
    vLLM splits a model's layers over stages."""
    share = layers[stage * len(layers) // pp : (stage + 1) * len(layers) // pp]
    assert share, f"{len(layers)} layers cannot fill {pp} stages"
    return share


def kv_cache_config(
    layout: str,
    num_blocks: int,
    kv_layout: str = "LBHNC",
    speculative_blocks: int | None = None,
    heads: int = HEADS,
    stage: tuple[int, int] = (0, 1),
) -> KVCacheConfig:
    """A hand-built ``KVCacheConfig`` as vLLM 0.33 builds them: one backing allocation, one
    ``KVCacheTensor`` per group placing its layers, groups overlaid at the same offsets (equal
    page sizes; a block id belongs to one group at a time). ``kv_layout`` decides whether layers
    (``LB..``) or blocks (``BL..``) are outermost."""
    spec = dict(LAYOUTS[layout])
    # A pipeline stage's worker holds its stage's layers of every group (the scheduler: all).
    spec["layers"] = [stage_layers(layers, *stage) for layers in spec["layers"]]
    groups, specs = [], []
    attention_page = None
    for (kind, block_size, window), layers in zip(spec["groups"], spec["layers"]):
        if kind == "full":
            kv = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=HEAD, dtype=torch.float32)
        elif kind == "sliding_window":
            kv = SlidingWindowSpec(
                block_size=block_size, num_kv_heads=heads, head_size=HEAD, dtype=torch.float32, sliding_window=window
            )
        elif kind == "chunked_local":
            kv = ChunkedLocalAttentionSpec(
                block_size=block_size,
                num_kv_heads=heads,
                head_size=HEAD,
                dtype=torch.float32,
                attention_chunk_size=window,
            )
        else:
            scratch = spec.get("speculative_blocks", 0) if speculative_blocks is None else speculative_blocks
            kv = MambaSpec(
                block_size=MAX_MODEL_LEN if kind == "mamba" else block_size,
                shapes=mamba_shapes(scratch),
                dtypes=(torch.int32, torch.int32),
                page_size_padded=attention_page,
                mamba_cache_mode="align" if kind == "mamba_align" else "none",
                num_speculative_blocks=scratch,
            )
        if not is_state(kind):
            attention_page = kv.page_size_bytes
        groups.append(KVCacheGroupSpec(list(layers), kv))
        specs.append(kv)
    page = specs[0].page_size_bytes
    assert all(kv.page_size_bytes == page for kv in specs), "overlaid groups need one page size"
    most = max(len(layers) for layers in spec["layers"])
    size = most * num_blocks * page
    tensors = []
    for layers in spec["layers"]:
        if kv_layout in BLOCK_OUTERMOST:
            strides = {"layer_stride": page, "block_stride": most * page}
        elif kv_layout == "LHBNC":  # heads outside blocks: a block is HEADS separate pieces
            strides = {"layer_stride": num_blocks * page, "block_stride": page // heads}
        else:
            strides = {"layer_stride": num_blocks * page, "block_stride": page}
        tensors.append(KVCacheTensor(size=size, layers=list(layers), offset=0, **strides))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)


@dataclasses.dataclass
class Plane:
    """One layer's cache as the harness model writes it: ``view[block, slot]`` is a token's
    slot (attention, ``[blocks, block_size, heads, words]``), ``view[block]`` a page; a mamba
    layer's ``view[block]`` is its state."""

    index: int
    group: int
    kind: str
    view: torch.Tensor


def allocate(config: KVCacheConfig, kv_layout: str, alloc: str, numbers: dict[str, int] | None = None):
    """KV caches as a vLLM worker allocates them: in shared memory (``pdkv_vllm.memory``, READ
    through shared memory or the network), or with vLLM's own ``allocate_kv_cache`` (plain
    memory: network only). Returns the caches and the harness's planes, in layer order, each
    numbered by ``numbers`` (a layer's place in the whole model; default: in this config)."""
    layout = KVCacheLayout[kv_layout]
    if alloc == "memfd":
        caches = memory.allocate_kv_caches(config, layout)
    else:
        caches = allocate_kv_cache(config, torch.device("cpu"), layout)
    group_of = {layer: index for index, group in enumerate(config.kv_cache_groups) for layer in group.layer_names}
    planes = []
    for placement in config.kv_cache_tensors:
        for layer in placement.layers:
            group = group_of[layer]
            cache = caches[layer]
            if isinstance(config.kv_cache_groups[group].kv_cache_spec, MambaSpec):
                number = len(planes) if numbers is None else numbers[layer]
                planes.append(Plane(number, group, "mamba", cache.view(torch.int32)))
            else:  # [B, H, N, C] -> [B, N, H, C]: a block's token slots
                number = len(planes) if numbers is None else numbers[layer]
                planes.append(Plane(number, group, "attention", cache.view(torch.int32).permute(0, 2, 1, 3)))
    return caches, planes


class Leg:
    """One leg: vLLM's scheduler with the connector, and its workers (one per DCP rank)."""

    def __init__(
        self,
        root: Path,
        role: str,
        node: str,
        peers: list[str],
        layout: str,
        num_blocks: int = 96,
        lookahead: int = 0,
        speculative_tokens: int | None = None,
        extra: dict | None = None,
        prefix_caching: bool = False,
        kv_layout: str = "LBHNC",
        alloc: str = "memfd",
        tp: int | None = None,
        kv_heads: int | None = None,
        pp: int = 1,
    ):
        self.layout = layout
        self.role = role
        self.spec = LAYOUTS[layout]
        dcp = self.spec["dcp"]
        self.interleave = self.spec.get("interleave", 1)
        # TP ranks (the DCP layout's ranks are its TP ranks too); each holds its share of the
        # model's KV heads, or HEADS of its own when the test does not model heads.
        self.tp = tp or dcp
        self.pp = pp
        self.kv_heads = kv_heads
        heads = HEADS if kv_heads is None else max(1, kv_heads // self.tp)
        # A speculative config (a draft model proposing k tokens) sets vLLM's own lookahead and
        # mamba scratch blocks (one per draft token), as vLLM sizes them.
        # The scheduler's config is worker 0's (vLLM's generate_scheduler_kv_cache_config): with
        # pipeline stages it names the first stage's layers only.
        self.config = kv_cache_config(layout, num_blocks, kv_layout, speculative_tokens, heads, (0, pp))
        settings = {"node": node, "certs": str(root / "certs"), "peers": peers}
        settings.update(extra or {})
        vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=model_dir(root, kv_heads), skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float32"
            ),
            cache_config=CacheConfig(
                block_size=BLOCK,
                # vLLM derives the mamba mode from prefix caching: align needs it on.
                enable_prefix_caching=prefix_caching or aligned(layout),
                mamba_cache_mode="align" if aligned(layout) else "none",
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=16,
                max_num_batched_tokens=MAX_MODEL_LEN,
                max_model_len=MAX_MODEL_LEN,
                is_encoder_decoder=False,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tp,
                pipeline_parallel_size=pp,
                decode_context_parallel_size=dcp,
                cp_kv_cache_interleave_size=self.interleave,
            ),
            device_config=DeviceConfig("cpu"),
            speculative_config=None if speculative_tokens is None else speculative(root, speculative_tokens),
            kv_transfer_config=KVTransferConfig(
                kv_connector="PdkvConnector",
                kv_connector_module_path="pdkv_vllm",
                kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                kv_connector_extra_config=settings,
                kv_load_failure_policy="recompute",
            ),
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.vllm_config = vllm_config
        block_size, hash_block_size = resolve_kv_cache_block_sizes(self.config, vllm_config)
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=self.config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            hash_block_size=hash_block_size,
        )
        if speculative_tokens is None:
            self.scheduler.num_lookahead_tokens = lookahead
        else:
            assert self.scheduler.num_lookahead_tokens == speculative_tokens, "vLLM reserves k draft slots"
        # vLLM takes the scheduler side's stats every step; keep a running sum, as its metrics do.
        self.scheduler_stats = PdkvStats()
        take_stats = self.scheduler.connector.get_kv_connector_stats

        def taken():
            stats = take_stats()
            if stats is not None:
                self.scheduler_stats.aggregate(stats)
            return stats

        self.scheduler.connector.get_kv_connector_stats = taken
        # As vLLM's engine core does whenever a KV connector is configured.
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(hash_block_size, hash_fn, vllm_config.num_hash_lookahead_tokens)
        # Workers stage-major, as vLLM ranks them: (pp rank, tp rank) of each, its planes numbered
        # by their layer's place in the whole model.
        whole = kv_cache_config(layout, num_blocks, kv_layout, speculative_tokens, heads)
        numbers = {layer: number for number, layer in enumerate(
            layer for placement in whole.kv_cache_tensors for layer in placement.layers
        )}
        self.workers, self.planes, self.ranks = [], [], []
        for stage in range(pp):
            stage_config = kv_cache_config(layout, num_blocks, kv_layout, speculative_tokens, heads, (stage, pp))
            for rank in range(self.tp):
                worker_settings = dict(settings, rank=rank, pp_rank=stage)
                vllm_config.kv_transfer_config.kv_connector_extra_config = worker_settings
                worker = PdkvConnector(vllm_config, KVConnectorRole.WORKER, stage_config)
                caches, planes = allocate(stage_config, kv_layout, alloc, numbers)
                worker.register_kv_caches(caches)
                self.workers.append(worker)
                self.planes.append(planes)
                self.ranks.append((stage, rank))
        vllm_config.kv_transfer_config.kv_connector_extra_config = settings
        # As vLLM's engine core does: every worker's handshake, keyed by (pp rank, tp rank).
        self.scheduler.connector.set_xfer_handshake_metadata_pp_aware(
            {place: worker.get_handshake_metadata() for place, worker in zip(self.ranks, self.workers)}
        )
        self.finished: dict[str, object] = {}
        self.loaded: set[str] = set()
        self.failed_loads: set[str] = set()
        self.seeds: dict[str, int] = {}
        self.on_loaded = None
        self.counts_sending: dict[str, int] = {}
        self.counts_recving: dict[str, int] = {}
        self.failing: set[str] = set()
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}

    # The model.

    def block_tokens(self, group: int) -> int:
        kind, block_size, _ = self.spec["groups"][group]
        return MAX_MODEL_LEN if kind == "mamba" else block_size * self.spec["dcp"]

    def state_position(self, group: int, tokens: int) -> int:
        """Where the running state after ``tokens`` tokens lies in the group's block list, as
        vLLM's model runner keeps it: first (mamba_cache_mode "none"), or at ``(tokens - 1) //
        block_size`` ("align", ``preprocess_mamba``)."""
        kind, block_size, _ = self.spec["groups"][group]
        return 0 if kind == "mamba" else (tokens - 1) // block_size

    def write_kv(self, request_id: str, first: int, end: int) -> None:
        """Computes tokens ``first .. end`` of a request: tags their slots in every layer."""
        self.computed[request_id] = self.computed.get(request_id, 0) + end - first
        seed = self.seeds[request_id]
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        dcp = self.spec["dcp"]
        for (_, rank), planes in zip(self.ranks, self.planes):
            for plane in planes:
                ids = block_ids[plane.group]
                if plane.kind == "mamba":
                    plane.view[ids[self.state_position(plane.group, end)]].fill_(tag(seed, plane.index, end))
                    continue
                slots, heads = plane.view.shape[1], plane.view.shape[2]
                for token in range(first, end):
                    share, slot = dcp_holder(token % (slots * dcp), dcp, self.interleave)
                    if share != rank % dcp:
                        continue
                    block = ids[token // (slots * dcp)]
                    if block == 0:
                        continue  # outside a window: vLLM gave it no block
                    for local in range(heads):
                        head = global_head(self.kv_heads, self.tp, rank, local)
                        plane.view[block, slot, local].fill_(tag(seed, plane.index, token, head))

    def step(self) -> list:
        """One engine step; returns the outputs of requests that finished in it."""
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
        sampled, ids = [], []
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            done = request.num_computed_tokens  # already advanced by schedule()
            if done - count < request.num_prompt_tokens:
                self.write_kv(request_id, done - count, min(done, request.num_prompt_tokens))
            ids.append(request_id)
            sampled.append([17] if done >= request.num_tokens else [])
        sending, recving, failed = self.collect(output.finished_req_ids)
        for worker in self.workers:
            worker.clear_connector_metadata()
        for request_id in recving - failed:
            self.loaded.add(request_id)
            if self.on_loaded is not None:
                self.on_loaded(request_id)
        self.failed_loads |= failed
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={request_id: index for index, request_id in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, failed_recving=failed
            ),
        )
        outputs = self.scheduler.update_from_output(output, runner)
        finished = []
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finished[out.request_id] = out
                    finished.append(out)
        return finished

    def collect(self, finished_req_ids):
        """Every rank's transfer results, aggregated as vLLM's output aggregator does: a request
        is done once all ranks reported it, failed if any rank failed it."""
        world = len(self.workers)
        for worker in self.workers:
            results = worker.get_transfer_results(finished_req_ids)
            for request_id in results.finished_sending:
                self.counts_sending[request_id] = self.counts_sending.get(request_id, 0) + 1
            for request_id in results.finished_recving:
                self.counts_recving[request_id] = self.counts_recving.get(request_id, 0) + 1
            self.failing |= results.failed_recving
        sending = {r for r, count in self.counts_sending.items() if count == world}
        recving = {r for r, count in self.counts_recving.items() if count == world}
        for request_id in sending:
            del self.counts_sending[request_id]
        for request_id in recving:
            del self.counts_recving[request_id]
        failed = self.failing & recving
        self.failing -= recving
        return sending, recving, failed

    def add(self, request_id: str, prompt: list[int], max_tokens: int, params: dict, seed: int) -> None:
        self.seeds[request_id] = seed
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params})
        request = Request(request_id, list(prompt), sampling, None, block_hasher=self.block_hasher)
        self.scheduler.add_request(request)

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()


def record_pages(leg: Leg, rid: str, n: int) -> dict:
    """The bytes a prefill leg wrote for request ``rid``, per tensor-parallel rank, plane (its
    layer's place in the whole model, whichever stage holds it) and needed position."""
    ids = leg.scheduler.kv_cache_manager.get_block_ids(rid)
    pages = {}
    for (_, rank), planes in zip(leg.ranks, leg.planes):
        for plane in planes:
            kind, _, window = leg.spec["groups"][plane.group]
            block_tokens = leg.block_tokens(plane.group)
            if kind == "mamba":
                positions = [0]
            elif kind == "mamba_align":
                positions = [leg.state_position(plane.group, n - 1)] if n >= 2 else []
            else:
                first = first_attended(kind, window, n)
                positions = sorted({token // block_tokens for token in range(first, n - 1)})
            pages[rank, plane.index] = {p: plane.view[ids[plane.group][p]].clone() for p in positions}
    return pages


def run_prefill(leg: Leg, rid: str, prompt: list[int], seed: int, n: int, budget: int = 400):
    """Prefills ``rid`` on ``leg`` to its first token; returns its transfer params and pages."""
    leg.add(rid, prompt, 1, {"do_remote_decode": True}, seed)
    for _ in range(budget):
        leg.step()
        if rid in leg.finished:
            return leg.finished[rid].kv_transfer_params, record_pages(leg, rid, n)
    raise AssertionError(f"prefill of {rid} did not finish in {budget} steps")


def leg_state(leg: Leg) -> dict:
    return {
        "requests": sorted(leg.scheduler.requests),
        "free": leg.num_free_blocks(),
        "handoffs": sum(worker._worker.agent.live_handoffs() for worker in leg.workers),
    }


def enter_network_namespace(name: str) -> None:
    """Moves this (still single-purpose) process's main thread into network namespace ``name``;
    threads and sockets it creates afterwards live there."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def serve_prefill(
    conn, root: str, layout: str, node: str, peers: list[str], extra: dict | None, netns: str | None = None
) -> None:
    """A prefill leg in its own process (in network namespace ``netns`` if given): prefills what
    it is asked to and steps on its own (so it announces, expires and frees hand-offs) until told
    to exit or killed."""
    if netns is not None:
        enter_network_namespace(netns)
    leg = Leg(Path(root), "prefill", node, peers, layout, extra=extra)
    conn.send(("ready", os.getpid()))
    while True:
        if conn.poll(0.002):
            command, *args = conn.recv()
            if command == "prefill":
                conn.send(run_prefill(leg, *args))
            elif command == "state":
                conn.send(leg_state(leg))
            elif command == "exit":
                leg.shutdown()
                conn.send("bye")
                return
        elif leg.scheduler.requests:
            leg.step()
