"""``PdkvConnector``: vLLM's KV connector backed by pdkv.

Load it with::

    --kv-transfer-config '{"kv_connector": "PdkvConnector",
                           "kv_connector_module_path": "pdkv_vllm",
                           "kv_role": "kv_producer",            # or "kv_consumer"
                           "kv_connector_extra_config": {"node": "p0", "certs": "/etc/pdkv/certs",
                                                         "peers": ["d0"], "listen": "10.0.0.5:7100"}}'

How a request crosses (decode reads, "READ mode"):

1. **Prefill scheduler** (``request_finished_all_groups``): vLLM finished the prompt (capped at
   ``max_tokens``); pdkv builds the *offer* from vLLM's per-group block ids: each group trimmed to
   the blocks holding the tokens the decoder does not recompute, window groups clipped to the
   last token's window, anchored at absolute positions, so lookahead tails on either leg never
   shift anything. The blocks stay allocated (delayed free) and the offer, with the prefill
   workers' node names, control addresses and incarnations, becomes ``kv_transfer_params``.
2. **Prefill worker**: announces the hand-off (a lease starts).
3. **Decode scheduler** (``get_num_new_matched_tokens`` / ``update_state_after_alloc``): the
   decoder will recompute the last prompt token, so N-1 tokens are external and loaded
   asynchronously; pdkv builds the *need* from the decode blocks and pairs it with the offer by
   absolute position. A position one side lacks is an error, never a shift.
4. **Decode worker**: connects to the prefill worker (QUIC, mutual TLS), claims the hand-off (its
   blocks' generations), READs the blocks one-sided through shared memory straight into its KV
   tensors, checks the generations again and releases the hand-off. Any failure (unreachable,
   restarted, lease lapsed, block freed under the READ) is reported as a failed receive: vLLM
   recomputes the prompt, it never decodes from that KV. Decode worker (stage s, rank r) reads
   each of its layers from the prefill stage holding it (stage s when both legs run one PP size;
   matched by layer name): rank r's blocks whole when both legs run one TP size, else the KV
   heads it holds from every prefill rank holding them (``pdkv_core::heads``), each such hand-off
   claimed as one of its readers.
5. **Prefill worker**: on release (or lease expiry) bumps the blocks' generations, then reports the
   request finished so vLLM frees them.

Loads are asynchronous (vLLM's ``WAITING_FOR_REMOTE_KVS``): vLLM 0.33 can recompute a failed
load for every KV layout only through ``failed_recving``, which it honours for asynchronous
loads; block-level failures of synchronous loads are refused for models with several KV groups.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus

from . import ExchangeError, Layout, need, offer, pair
from . import memory
from ._native import KvAgent, LoadError
from .stats import PdkvPromMetrics, PdkvStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("pdkv_vllm")

#: The key under which pdkv's part of ``kv_transfer_params`` travels.
PARAMS_KEY = "pdkv"

#: Longest lease, wait or timeout a setting may name: a day (as pdkv's cluster.toml). Longer
#: ones are unit slips, and deadlines this far out stay clear of overflow.
MAX_TIME_LIMIT_MS = 86_400_000

#: Most live hand-offs a prefill worker may be set to track (each is a small table entry).
MAX_HANDOFFS = 1 << 20

#: Most loads a decode worker may be set to run at once (each is a thread).
MAX_LOAD_THREADS = 256
#: Most ranks and stages a leg of the other role may be set to run.
MAX_PEER_TP = 1024
MAX_PEER_PP = 256
#: Most tokens a DCP rank's turn may be set to hold (within any block size).
MAX_DCP_INTERLEAVE = 1 << 20


class ConnectorConfigError(ValueError):
    """The connector cannot work with this vLLM configuration; the message says why."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``, checked."""

    node: str
    certs: str
    peers: tuple[str, ...]
    listen: str
    data_listen: str | None
    advertise: str | None
    data_advertise: str | None
    read_engine: str
    mori_host: str | None
    mori_port: int
    lease_ms: int
    claim_wait_ms: int
    connect_timeout_ms: int
    request_timeout_ms: int
    read_timeout_ms: int
    max_handoffs: int
    load_threads: int
    rank: int | None
    pp_rank: int | None
    peer_tp: int | None
    peer_pp: int | None
    peer_dcp: int | None
    peer_dcp_interleave: int | None

    KNOWN = {
        "node", "certs", "peers", "listen", "data_listen", "advertise", "data_advertise", "read_engine", "mori_host", "mori_port", "lease_ms", "claim_wait_ms", "connect_timeout_ms",
        "request_timeout_ms", "read_timeout_ms", "max_handoffs", "load_threads", "rank", "pp_rank", "peer_tp",
        "peer_pp", "peer_dcp", "peer_dcp_interleave",
    }

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> "Settings":
        unknown = set(extra) - cls.KNOWN
        if unknown:
            raise ConnectorConfigError(
                f"kv_connector_extra_config: unknown keys {sorted(unknown)}; known: {sorted(cls.KNOWN)}"
            )
        for key in ("node", "certs"):
            if not isinstance(extra.get(key), str) or not extra[key]:
                raise ConnectorConfigError(f"kv_connector_extra_config.{key} is required (a string)")
        peers = extra.get("peers", [])
        if not isinstance(peers, (list, tuple)) or not all(isinstance(p, str) for p in peers):
            raise ConnectorConfigError("kv_connector_extra_config.peers must be a list of node names")

        def positive(key: str, default: int, most: int) -> int:
            value = extra.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= most:
                raise ConnectorConfigError(
                    f"kv_connector_extra_config.{key} must be an integer in 1..={most}, not {value!r}"
                )
            return value

        read_engine = extra.get("read_engine", "auto")
        if read_engine not in ("auto", "shm", "net", "mori"):
            raise ConnectorConfigError(
                "kv_connector_extra_config.read_engine must be \"auto\", \"shm\", \"net\" or \"mori\", "
                f"not {read_engine!r}"
            )
        mori_host = extra.get("mori_host")
        if mori_host is not None and not isinstance(mori_host, str):
            raise ConnectorConfigError(f"kv_connector_extra_config.mori_host must be a host address, not {mori_host!r}")
        mori_port = extra.get("mori_port", 0)
        if isinstance(mori_port, bool) or not isinstance(mori_port, int) or not 0 <= mori_port < 65536:
            raise ConnectorConfigError(f"kv_connector_extra_config.mori_port must be a port, not {mori_port!r}")
        data_listen = extra.get("data_listen")
        advertise, data_advertise = extra.get("advertise"), extra.get("data_advertise")
        for key, value in (
            ("listen", extra.get("listen", "127.0.0.1:0")),
            ("data_listen", data_listen),
            ("advertise", advertise),
            ("data_advertise", data_advertise),
        ):
            if value is not None and (not isinstance(value, str) or not value.rpartition(":")[2].isdigit()):
                raise ConnectorConfigError(f"kv_connector_extra_config.{key} must be \"host:port\", not {value!r}")
        rank, pp_rank = extra.get("rank"), extra.get("pp_rank")
        for key, value in (("rank", rank), ("pp_rank", pp_rank)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConnectorConfigError(f"kv_connector_extra_config.{key} must be >= 0, not {value!r}")
        return cls(
            node=extra["node"],
            certs=extra["certs"],
            peers=tuple(peers),
            listen=str(extra.get("listen", "127.0.0.1:0")),
            data_listen=data_listen,
            advertise=advertise,
            data_advertise=data_advertise,
            read_engine=read_engine,
            mori_host=mori_host,
            mori_port=mori_port,
            lease_ms=positive("lease_ms", 30_000, MAX_TIME_LIMIT_MS),
            claim_wait_ms=positive("claim_wait_ms", 5_000, MAX_TIME_LIMIT_MS),
            connect_timeout_ms=positive("connect_timeout_ms", 5_000, MAX_TIME_LIMIT_MS),
            request_timeout_ms=positive("request_timeout_ms", 5_000, MAX_TIME_LIMIT_MS),
            read_timeout_ms=positive("read_timeout_ms", 30_000, MAX_TIME_LIMIT_MS),
            max_handoffs=positive("max_handoffs", 4096, MAX_HANDOFFS),
            load_threads=positive("load_threads", 4, MAX_LOAD_THREADS),
            rank=rank,
            pp_rank=pp_rank,
            peer_tp=None if extra.get("peer_tp") is None else positive("peer_tp", 1, MAX_PEER_TP),
            peer_pp=None if extra.get("peer_pp") is None else positive("peer_pp", 1, MAX_PEER_PP),
            peer_dcp=None if extra.get("peer_dcp") is None else positive("peer_dcp", 1, MAX_PEER_TP),
            peer_dcp_interleave=(
                None
                if extra.get("peer_dcp_interleave") is None
                else positive("peer_dcp_interleave", 1, MAX_DCP_INTERLEAVE)
            ),
        )


def kv_groups(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> list[dict]:
    """pdkv's description of vLLM's KV-cache groups; refuses what pdkv cannot pair."""
    parallel = vllm_config.parallel_config
    dcp = parallel.decode_context_parallel_size
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if pcp != 1:
        # PCP interleaves tokens over pcp * dcp ranks (vLLM's total CP world); pdkv's split of a
        # block over ranks knows DCP only.
        raise ConnectorConfigError(
            f"prefill_context_parallel_size {pcp}: pdkv pairs legs without prefill context parallelism"
        )
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not group.enable_kv_transfer:
            raise ConnectorConfigError(f"KV group {index} is not transferable; pdkv transfers every group")
        if isinstance(spec, MambaSpec):
            # Either mode keeps speculative scratch blocks (num_speculative_blocks) after the
            # running state; pdkv reads the running state only.
            if spec.mamba_cache_mode == "align":
                # Prefix caching: a position-indexed list, the running state after t tokens at
                # position (t - 1) // block_size, earlier positions cached checkpoints or null.
                groups.append({"kind": "mamba_align", "block_size": spec.block_size})
            elif spec.mamba_cache_mode == "none":
                # One state, first in the list.
                groups.append({"kind": "mamba"})
            else:
                raise ConnectorConfigError(
                    f"KV group {index}: mamba_cache_mode {spec.mamba_cache_mode!r} is not one pdkv "
                    "pairs (\"none\" or \"align\")"
                )
        elif isinstance(spec, SlidingWindowSpec):
            groups.append(
                {
                    "kind": "sliding_window",
                    "block_size": spec.block_size,
                    "window": spec.sliding_window,
                    "dcp": dcp if spec.dcp_sharded else 1,
                }
            )
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            # Llama 4's local layers: a token attends within its chunk of attention_chunk_size
            # tokens; vLLM nulls the blocks of earlier chunks as a window's.
            groups.append(
                {
                    "kind": "chunked_local",
                    "block_size": spec.block_size,
                    "chunk": spec.attention_chunk_size,
                    "dcp": dcp if getattr(spec, "dcp_sharded", False) else 1,
                }
            )
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            # A window layer the hybrid allocator did not separate is allocated (and read) in full.
            groups.append(
                {"kind": "full", "block_size": spec.block_size, "dcp": dcp if spec.dcp_sharded else 1}
            )
        else:
            raise ConnectorConfigError(
                f"KV group {index}: {type(spec).__name__} is not a KV layout pdkv pairs "
                "(full attention, sliding window, chunked local attention, mamba with "
                "mamba_cache_mode \"none\" or \"align\")"
            )
    return groups


@dataclasses.dataclass
class PdkvHandshake(KVConnectorHandshakeMetadata):
    """What a prefill worker tells its scheduler so decode workers can reach it."""

    node: str
    address: str | None
    incarnation: int
    rank: int
    pp_rank: int = 0


@dataclasses.dataclass
class LoadSpec:
    """One request's READ, as the decode scheduler planned it."""

    remote_request: str
    workers: list[dict]
    pairs: list[list[tuple[int, int, int, int]]]
    # Spreads heads every prefill rank replicates (MLA, TP beyond the KV heads) over the prefill
    # ranks, request by request; the same on every decode rank.
    rotation: int = 0
    # How the prefill leg splits a block's tokens over its DCP ranks: (size, interleave).
    prefill_dcp: tuple[int, int] = (1, 1)


@dataclasses.dataclass
class ReleaseSpec:
    """A hand-off the decoder gives back unread: it needs none of its KV."""

    remote_request: str
    workers: list[dict]


@dataclasses.dataclass
class PdkvMetadata(KVConnectorMetadata):
    """Scheduler to worker, per step."""

    announce: dict[str, list[list[int]]] = dataclasses.field(default_factory=dict)
    loads: dict[str, LoadSpec] = dataclasses.field(default_factory=dict)
    failed: set[str] = dataclasses.field(default_factory=set)
    releases: dict[str, ReleaseSpec] = dataclasses.field(default_factory=dict)


def prompt_digest(request: "Request", token_ids: "list[int] | None" = None) -> str | None:
    """What binds KV to the prompt it was computed for: SHA-256 over the prompt's token ids (each
    a little-endian u32) and everything else vLLM lets change a prompt's KV (its LoRA adapter,
    cache salt and multimodal inputs). None for a prompt given as embeddings: its KV is never
    handed off."""
    ids = request.prompt_token_ids if token_ids is None else token_ids
    if ids is None:
        return None
    digest = hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids))
    lora = getattr(request, "lora_request", None)
    extras = {
        "lora": getattr(lora, "lora_name", None),
        "cache_salt": getattr(request, "cache_salt", None),
        "mm": [getattr(feature, "identifier", None) for feature in getattr(request, "mm_features", None) or []],
    }
    digest.update(json.dumps(extras, sort_keys=True).encode())
    return digest.hexdigest()


def speculative_fields(vllm_config: "VllmConfig") -> dict | None:
    """What of a speculative config changes the KV a leg keeps, as NIXL compares it: an EAGLE/MTP
    drafter's layers have KV of their own (their method, model, revision, KV dtype and the target
    layers whose hidden states feed it). The number of draft tokens is not among them: it
    changes only a leg's lookahead slots, which the exchange trims, so legs may differ in it.
    None without a KV-keeping drafter."""
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is None or not speculative.use_eagle():
        return None
    draft = speculative.draft_model_config
    auxiliary = getattr(getattr(draft, "hf_config", None), "eagle_aux_hidden_state_layer_ids", None)
    return {
        "method": speculative.method,
        "model": getattr(draft, "model", None),
        "revision": getattr(draft, "revision", None),
        "parallel_drafting": getattr(speculative, "parallel_drafting", None),
        "kv_cache_dtype": str(getattr(speculative, "kv_cache_dtype", None) or vllm_config.cache_config.cache_dtype),
        "auxiliary_layer_ids": list(auxiliary) if auxiliary is not None else None,
    }


def dcp_split(vllm_config: "VllmConfig") -> dict:
    """How this leg splits a scheduler block's tokens over its DCP ranks: ``{"size": dcp,
    "interleave": I}``, runs of ``I`` tokens to each DCP rank in turn (vLLM's
    ``cp_kv_cache_interleave_size``). Travels with every offer, so a decode leg of another split
    reads each token from the prefill rank holding it."""
    parallel = vllm_config.parallel_config
    dcp = parallel.decode_context_parallel_size
    return {"size": dcp, "interleave": getattr(parallel, "cp_kv_cache_interleave_size", 1) if dcp > 1 else 1}


def valid_dcp_split(split: Any) -> tuple[int, int] | None:
    """``(size, interleave)`` from an offer's ``dcp`` entry (absent: no DCP), None if malformed."""
    if split is None:
        return (1, 1)
    if not isinstance(split, dict):
        return None
    values = (split.get("size"), split.get("interleave"))
    if any(isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 1 << 31 for value in values):
        return None
    return values


def state_layouts(kv_cache_config: "KVCacheConfig") -> list[dict]:
    """How each recurrent-state (mamba) group lays its state out in a block: the shapes and
    dtypes of its tensors, as vLLM sizes them. A page is read whole, so both legs must agree:
    vLLM grows a convolution state by one column per speculative token
    (``conv_kernel - 1 + num_speculative_tokens``), so legs speculating ``k`` tokens apart lay
    the same state out differently, and a page read across them would be another state."""
    layouts = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            layouts.append(
                {"shapes": [list(shape) for shape in spec.shapes], "dtypes": [str(dtype) for dtype in spec.dtypes]}
            )
    return layouts


def model_fields(vllm_config: "VllmConfig", groups: list[dict], states: list[dict] | None = None) -> dict:
    """What a decoder's KV must share with the prefill's to be read at all: the served model's
    name and architecture, its shapes, the KV dtype, pdkv's view of the KV groups (kinds, block
    sizes, windows), a drafter's KV-relevant config and the parallel
    layout (TP and DCP may differ where only attention KV is exchanged, see :func:`reshardable`;
    PP may differ: a decode worker reads each layer from the prefill stage holding it). Equal on two legs serving the same model the same way. It travels in every ``kv_transfer_params`` beside its digest (the decode scheduler
    refuses another model's offer before allocating anything) and in every worker's handshake
    (a decode worker and a prefill worker that differ refuse each other before a byte moves:
    the load fails and vLLM recomputes); either refusal names each differing field with both
    values."""
    model = vllm_config.model_config
    text = model.hf_text_config
    served = model.served_model_name
    parallel = vllm_config.parallel_config
    fields = {
        "served_model_name": served[0] if isinstance(served, (list, tuple)) else served,
        "architectures": list(getattr(model.hf_config, "architectures", None) or []),
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "layers": getattr(text, "num_hidden_layers", None),
        "hidden_size": getattr(text, "hidden_size", None),
        # The KV heads a rank's pages split by heads: MLA's latent is one head every rank holds
        # whole, whatever the model's attention heads (vLLM's total for it names those).
        "kv_heads": 1 if getattr(model, "use_mla", False) else model.get_total_num_kv_heads(),
        "head_size": model.get_head_size(),
        # A group as the exchange pairs it: a scheduler block of block_size * dcp tokens, however
        # a leg splits it over its DCP ranks.
        "groups": [
            {key: value for key, value in dict(group, block_size=group["block_size"] * group.get("dcp", 1)).items() if key != "dcp"}
            if "block_size" in group
            else group
            for group in groups
        ],
        "speculative": speculative_fields(vllm_config),
    }
    if states:
        # A recurrent state's page is read as it lies: its layout must match (see state_layouts).
        fields["mamba_states"] = states
    # Attention KV is resharded between legs of different TP or DCP sizes (each decode rank
    # reads the heads and tokens it holds from the prefill ranks holding them); a recurrent state
    # is not: there both sizes must match.
    if not reshardable(groups):
        fields["tensor_parallel_size"] = parallel.tensor_parallel_size
        fields["decode_context_parallel_size"] = parallel.decode_context_parallel_size
    # Plain JSON values: the fields travel in kv_transfer_params through HTTP.
    return json.loads(json.dumps(fields, default=str))


def reshardable(groups: list[dict]) -> bool:
    """Whether legs of different tensor-parallel or DCP sizes can exchange this layout's KV:
    attention groups only (heads and tokens; a recurrent state is neither)."""
    return all(group["kind"] in ("full", "sliding_window", "chunked_local") for group in groups)


def page_order(kv_cache_config: "KVCacheConfig", kv_caches: dict[str, Any]) -> str | None:
    """How an attention block orders its heads and tokens in memory, read off the strides of a
    layer's ``[blocks, heads, tokens, content]`` view: ``"heads_outer"`` (vLLM's ``..HNC``
    layouts) or ``"tokens_outer"`` (``..NHC``); None without such a view. An MLA layer's
    ``[blocks, tokens, latent]`` page is one head, in either order."""
    for group in kv_cache_config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, MambaSpec):
            continue
        for layer in group.layer_names:
            tensor = _tensor_of(kv_caches.get(layer))
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 4:
                return "heads_outer" if tensor.stride(1) > tensor.stride(2) else "tokens_outer"
            if isinstance(group.kv_cache_spec, MLAAttentionSpec) and isinstance(tensor, torch.Tensor) and tensor.dim() == 3:
                return "tokens_outer"
    return None


def model_identity(fields: dict) -> str:
    """The digest of :func:`model_fields`: the cheap equality every decode request checks."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


def identity_differences(theirs: Any, ours: dict) -> str:
    """Which of :func:`model_fields` differ between the prefill's (``theirs``, from a router:
    anything may arrive) and this leg's, each with both values; the digests when the prefill
    sent no fields."""
    if not isinstance(theirs, dict):
        return "the prefill sent no model fields"
    # Through JSON both ways, so a tuple here and a list there are not a difference.
    ours = json.loads(json.dumps(ours, default=str))
    differing = [
        f"{key}: prefill {json.dumps(theirs.get(key), default=str)}, this leg {json.dumps(ours.get(key), default=str)}"
        for key in sorted(set(theirs) | set(ours))
        if theirs.get(key) != ours.get(key)
    ]
    return "; ".join(differing) if differing else "the fields agree but the digests differ"


class PdkvConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector backed by pdkv (see the module documentation)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_role == "kv_producer":
            self.leg = "prefill"
        elif transfer.kv_role == "kv_consumer":
            self.leg = "decode"
        else:
            raise ConnectorConfigError(
                f"kv_role {transfer.kv_role!r}: a pdkv leg is a kv_producer (prefill) or a kv_consumer (decode)"
            )
        self.settings = Settings.parse(dict(transfer.kv_connector_extra_config or {}))
        if self.leg == "decode" and role == KVConnectorRole.SCHEDULER and transfer.kv_load_failure_policy != "recompute":
            logger.warning(
                "kv_load_failure_policy is %r: a request whose KV cannot be loaded fails instead of "
                "being recomputed (it is never decoded from bad KV either way); set \"recompute\"",
                transfer.kv_load_failure_policy,
            )
        self.groups = kv_groups(vllm_config, kv_cache_config)
        self.layout = Layout(self.groups)
        # Not the layers holding KV: a pipeline-parallel leg's scheduler sees its first stage's
        # only (vLLM builds it from worker 0's config); workers match layers by name instead.
        self.model_fields = model_fields(vllm_config, self.groups, state_layouts(kv_cache_config))
        self.dcp = dcp_split(vllm_config)
        self.model_identity = model_identity(self.model_fields)
        self._scheduler = _SchedulerSide(self) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _WorkerSide(self) if role == KVConnectorRole.WORKER else None

    # Scheduler side.

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta()

    def on_new_request(self, request: "Request") -> None:
        self._scheduler.on_new_request(request)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        # pdkv restores every group of the request (attention, window and state).
        return tuple(range(len(self.groups)))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler.set_handshake({(0, rank): meta for rank, meta in metadata.items()})

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        # Every pipeline stage's workers: a decode stage reads the prefill stage holding its layers.
        self._scheduler.set_handshake(metadata)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler.update_connector_output(connector_output)

    # Worker side.

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.handshake()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: a request runs only after its whole load finished.
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # The decode side READs; the prefill side writes nothing per layer.
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self._worker.results()
        return results.finished_sending or None, results.finished_recving or None

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()

    # Stats (vLLM aggregates them and exports them on its /metrics: pdkv_vllm.stats).

    def get_kv_connector_stats(self) -> PdkvStats | None:
        side = self._worker if self._worker is not None else self._scheduler
        return side.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdkvStats:
        return PdkvStats(data=data) if data is not None else PdkvStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> PdkvPromMetrics:
        return PdkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def malformed(ours: Any) -> str | None:
    """What is wrong with pdkv's part of a decode request's ``kv_transfer_params``, if anything
    (they come from a router: anything may arrive)."""
    if not isinstance(ours, dict):
        return f"is {type(ours).__name__}, not an object"
    expected = {"request": str, "num_prompt_tokens": int, "prompt": str, "model": str, "offer": dict, "workers": list}
    for key, kind in expected.items():
        if not isinstance(ours.get(key), kind) or isinstance(ours.get(key), bool):
            return f"has no {kind.__name__} {key!r}"
    for index, worker in enumerate(ours["workers"]):
        if not isinstance(worker, dict) or not isinstance(worker.get("node"), str):
            return f"workers[{index}] names no node"
        if not isinstance(worker.get("incarnation"), int) or not 0 <= worker["incarnation"] < 1 << 64:
            return f"workers[{index}] has no incarnation"
        if worker.get("address") is not None and not isinstance(worker["address"], str):
            return f"workers[{index}].address is not a string"
        pp = worker.get("pp", 0)
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 0:
            return f"workers[{index}].pp is not a pipeline stage"
    if valid_dcp_split(ours.get("dcp")) is None:
        return "dcp is not {\"size\": n, \"interleave\": n} of positive sizes"
    return None


class _SchedulerSide:
    """The connector in vLLM's scheduler process: pairs blocks, never touches memory."""

    def __init__(self, connector: PdkvConnector):
        self.connector = connector
        self.layout = connector.layout
        self.is_prefill = connector.leg == "prefill"
        # With a window or a recurrent state the prefill must stop at N-1: the decoder
        # recomputes token N-1 from the window (or the state) as it stood before that token, and
        # vLLM frees window blocks (and advances the state) past what the next token needs.
        self.stops_before_last = any(group["kind"] != "full" for group in connector.groups)
        self.workers: list[dict] = []
        self.to_announce: dict[str, list[list[int]]] = {}
        self.to_load: dict[str, LoadSpec] = {}
        self.to_release: dict[str, ReleaseSpec] = {}
        self.failed: set[str] = set()
        self.local_hits: dict[str, int] = {}
        self.recomputes_failed_loads = (
            connector._vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
        )
        self.stats = PdkvStats()
        self.loads_planned = 0

    def set_handshake(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Every worker of this leg, keyed by (pipeline stage, tensor-parallel rank), in that order."""
        self.workers = [
            {"node": meta.node, "address": meta.address, "incarnation": meta.incarnation, "pp": pp_rank}
            for (pp_rank, _), meta in sorted(metadata.items())
        ]

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """vLLM's per-step summary of every worker's transfers (a request once, whatever its
        rank count): a failed load is a request vLLM recomputes, under the recompute policy."""
        failed = getattr(output, "failed_recving", None)
        if not self.is_prefill and self.recomputes_failed_loads and failed:
            self.stats.count("recomputed_requests", len(failed))

    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        if not (self.is_prefill and params and params.get("do_remote_decode")):
            return
        if "pdkv_num_prompt_tokens" in params:
            return  # seen before (a preempted request comes back)
        params["pdkv_num_prompt_tokens"] = request.num_prompt_tokens
        # Bound to the whole prompt, before its last token is dropped below.
        params["pdkv_prompt_digest"] = prompt_digest(request)
        if self.stops_before_last and request.num_prompt_tokens > 1 and request.prompt_token_ids is not None:
            request.prompt_token_ids.pop()
            request._all_token_ids.pop()
            request.num_prompt_tokens -= 1
            request.max_tokens = 1

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if self.is_prefill:
            return 0, False
        params = request.kv_transfer_params or {}
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return 0, False
        ours = params.get(PARAMS_KEY)
        refusal = self.refusal(request, ours)
        if refusal is not None:
            # Nothing is read and nothing offered for another prompt or model reaches this leg's
            # blocks or prefix cache: the prompt is computed here. The offer's lease ends it.
            logger.error("request %s: kv_transfer_params.%s %s; computing the prompt here", request.request_id, PARAMS_KEY, refusal)
            params["do_remote_prefill"] = False
            self.stats.count("refused_offers")
            self.stats.count("recomputed_requests")
            return 0, False
        self.local_hits[request.request_id] = num_computed_tokens
        # The decoder recomputes token N-1 itself (pdkv reads tokens 0 ..= N-2). With nothing to
        # read (N = 1, or a local prefix hit covering N-1 tokens) there is no load: vLLM refuses
        # an asynchronous load of 0 tokens, and update_state_after_alloc gives the hand-off back.
        wanted = ours["num_prompt_tokens"] - 1 - num_computed_tokens
        if wanted <= 0:
            return 0, False
        return wanted, True

    def refusal(self, request: "Request", ours: Any) -> str | None:
        """Why this decode request must not read the KV its ``kv_transfer_params`` offer, if it
        must not: malformed, or computed for another model or another prompt."""
        problem = malformed(ours)
        if problem is not None:
            return problem
        if ours["model"] != self.connector.model_identity:
            return (
                "were made by a prefill serving another model or KV layout ("
                f"{identity_differences(ours.get('model_fields'), self.connector.model_fields)})"
            )
        n = ours["num_prompt_tokens"]
        if n != request.num_prompt_tokens:
            return f"were computed for {n} prompt tokens, this request has {request.num_prompt_tokens}"
        if ours["prompt"] != prompt_digest(request):
            return "were computed for another prompt (its digest differs from this prompt's)"
        return None

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        params = request.kv_transfer_params or {}
        if self.is_prefill or not params.get("do_remote_prefill"):
            return
        # One transfer per request, even if the request comes back after a failed load.
        params["do_remote_prefill"] = False
        ours = params.get(PARAMS_KEY)
        request_id = request.request_id
        if malformed(ours) is not None:
            return
        if num_external_tokens == 0:
            # Nothing to read (see get_num_new_matched_tokens): the prefill may free it now.
            self.local_hits.pop(request_id, None)
            self.give_back(request_id, ours)
            return
        hits = self.local_hits.pop(request_id, 0)
        cached = [
            0 if group["kind"] == "mamba" else hits // (group["block_size"] * group.get("dcp", 1))
            for group in self.connector.groups
        ]
        try:
            wanted = need(self.layout, ours["num_prompt_tokens"], blocks.get_block_ids(), cached)
            pairs = pair(self.layout, ours["offer"], wanted)
        except (ExchangeError, KeyError, TypeError, ValueError) as error:
            logger.error("request %s: pdkv refuses to pair its blocks (%s); recomputing", request_id, error)
            self.failed.add(request_id)
            return
        self.to_load[request_id] = LoadSpec(
            remote_request=ours["request"],
            workers=list(ours["workers"]),
            pairs=[[tuple(p) for p in group] for group in pairs],
            rotation=self.loads_planned,
            prefill_dcp=valid_dcp_split(ours.get("dcp")),
        )
        self.loads_planned += 1

    def take_stats(self) -> PdkvStats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def give_back(self, request_id: str, ours: dict) -> None:
        """Asks the workers to release an offer this leg reads nothing of. An offer of no blocks
        (a one-token prompt) was never announced: there is nothing to release."""
        groups = ours["offer"].get("groups")
        if isinstance(groups, list) and any(isinstance(group, dict) and group.get("blocks") for group in groups):
            self.to_release[request_id] = ReleaseSpec(ours["request"], list(ours["workers"]))

    def build_connector_meta(self) -> PdkvMetadata:
        meta = PdkvMetadata(
            announce=self.to_announce, loads=self.to_load, failed=self.failed, releases=self.to_release
        )
        self.to_announce, self.to_load, self.failed, self.to_release = {}, {}, set(), {}
        return meta

    def request_finished(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self.local_hits.pop(request_id, None)
        params = request.kv_transfer_params
        if not self.is_prefill:
            # Ended before it was scheduled (aborted while waiting): nobody reads the offer.
            if isinstance(params, dict) and params.get("do_remote_prefill") and self.refusal(request, params.get(PARAMS_KEY)) is None:
                params["do_remote_prefill"] = False
                self.give_back(request_id, params[PARAMS_KEY])
            return False, None
        if not params or not params.get("do_remote_decode"):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # aborted or stopped: nothing to hand off
        if not self.workers:
            logger.error("request %s: no prefill worker handshake known; not handing off", request_id)
            return False, None
        n = params.get("pdkv_num_prompt_tokens", request.num_prompt_tokens)
        digest = params.get("pdkv_prompt_digest")
        if digest is None:
            logger.error("request %s: its prompt has no token ids to bind KV to; not handing off", request_id)
            return False, None
        try:
            offered = offer(self.layout, n, [list(group) for group in block_ids])
        except ExchangeError as error:
            logger.error("request %s: pdkv refuses to offer its blocks (%s)", request_id, error)
            return False, None
        blocks = [group["blocks"] for group in offered["groups"]]
        transfer = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAMS_KEY: {
                "request": request_id,
                "num_prompt_tokens": n,
                "prompt": digest,
                "model": self.connector.model_identity,
                "model_fields": self.connector.model_fields,
                "offer": offered,
                "workers": self.workers,
                "dcp": self.connector.dcp,
            },
        }
        if not any(blocks):
            return False, transfer
        self.to_announce[request_id] = blocks
        return True, transfer


def _tensor_of(cache) -> torch.Tensor:
    return cache[0] if isinstance(cache, (list, tuple)) else cache


def kv_memory(kv_cache_config: "KVCacheConfig", kv_caches: dict[str, Any]):
    """Where vLLM's KV cache lies, as pdkv registers it: ``(regions, planes)``.

    ``regions`` holds one ``(fd, address, length, device)`` per backing allocation: a memfd
    (``pdkv_vllm.memory``; same-host peers map it), or with ``fd = -1`` plain memory of this
    process (READ over the network) or, with ``device >= 0``, GPU memory (READ by mori).
    ``planes`` holds ``(region, offset, bytes_per_block, group, layer, page_bytes)`` for every
    layer page, in ``kv_cache_tensors`` order, ``layer`` naming the layer (a decode plane is read
    from the prefill plane of the same name, whichever pipeline stage holds it; a packed plane
    names its layers joined by ``|``, one ``page_bytes`` page each), from
    vLLM's own placement: layer ``l`` of block ``b`` at ``offset + l * layer_stride + b *
    block_stride``. A block-outermost layout whose blocks pack every layer's page becomes one plane
    per placement; a layout whose blocks are not contiguous pages is refused."""
    groups = kv_cache_config.kv_cache_groups
    group_of = {layer: index for index, group in enumerate(groups) for layer in group.layer_names}

    def spec_of(layer):
        spec = groups[group_of[layer]].kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        return specs[layer] if specs else spec

    regions: list[tuple[int, int, int, int]] = []
    region_of: dict[int, tuple[int, int]] = {}  # storage address -> (region, offset in region)
    planes = []
    for placement in kv_cache_config.kv_cache_tensors:
        num_blocks_of = getattr(kv_cache_config, "num_blocks_of", None)
        if num_blocks_of is not None and num_blocks_of(placement) != kv_cache_config.num_blocks:
            raise ConnectorConfigError(f"layers {placement.layers}: a second block pool is not transferred by pdkv")
        for layer in placement.layers:
            if layer not in kv_caches:
                raise ConnectorConfigError(f"layer {layer} has no KV cache")
            if layer not in group_of:
                raise ConnectorConfigError(f"layer {layer} is in no KV group")
        first = _tensor_of(kv_caches[placement.layers[0]])
        storage = first.untyped_storage()
        address = storage.data_ptr()
        if address not in region_of:
            allocation = memory.find(address)
            if first.device.type == "cuda":  # ROCm's torch names HIP devices "cuda"
                region_of[address] = (len(regions), 0)
                regions.append((-1, address, storage.nbytes(), first.device.index or 0))
            elif allocation is not None:
                region_of[address] = (len(regions), address - allocation.base)
                regions.append((allocation.fd, 0, 0, -1))
            else:
                region_of[address] = (len(regions), 0)
                regions.append((-1, address, storage.nbytes(), -1))
        region, base = region_of[address]
        block_stride, layer_stride = placement.block_stride, placement.layer_stride
        pages = {spec_of(layer).page_size_bytes for layer in placement.layers}
        layer_groups = {group_of[layer] for layer in placement.layers}
        page = max(pages)
        for index, layer in enumerate(placement.layers):
            tensor = _tensor_of(kv_caches[layer])
            expected = address + placement.offset + index * layer_stride
            if spec_of(layer).has_layer_views and tensor.data_ptr() != expected:
                raise ConnectorConfigError(
                    f"layer {layer}: its KV starts at {tensor.data_ptr():#x}, vLLM's placement "
                    f"says {expected:#x}"
                )
        if block_stride == page:
            for index, layer in enumerate(placement.layers):
                start = base + placement.offset + index * layer_stride
                planes.append((region, start, page, group_of[layer], layer, page))
        elif (
            block_stride > page
            and len(pages) == 1
            and len(layer_groups) == 1
            and layer_stride == page
            and len(placement.layers) * page <= block_stride
        ):
            # Block-outermost: block b packs every layer's page; it travels as one run.
            planes.append(
                (region, base + placement.offset, block_stride, layer_groups.pop(), "|".join(placement.layers), page)
            )
        else:
            raise ConnectorConfigError(
                f"layers {placement.layers}: a block is not one contiguous run of memory (block "
                f"stride {block_stride}, page {page}, layer stride {layer_stride}); pdkv READs "
                "block by block, use a layer- or block-outermost KV layout"
            )
    return regions, planes


class _WorkerSide:
    """The connector in a vLLM worker: owns the pdkv agent, READs on a bounded thread pool."""

    def __init__(self, connector: PdkvConnector):
        self.connector = connector
        self.settings = connector.settings
        self.is_prefill = connector.leg == "prefill"
        self.rank = self._rank()
        self.pp_rank = self._pp_rank()
        self.tp = connector._vllm_config.parallel_config.tensor_parallel_size
        self.pp = connector._vllm_config.parallel_config.pipeline_parallel_size
        self.dcp = (connector.dcp["size"], connector.dcp["interleave"])
        # This worker's place among its leg's workers (stage-major, as the handshake keys them):
        # its node name and ports follow it.
        self.index = self.pp_rank * self.tp + self.rank
        self.order: str | None = None
        self.packed = False
        self.agent: KvAgent | None = None
        self.lock = threading.Lock()
        self.sent: set[str] = set()
        self.done: set[str] = set()
        self.failed: set[str] = set()
        self.pending: dict[str, concurrent.futures.Future] = {}
        self.stats = PdkvStats()
        self.expired_seen = 0
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.settings.load_threads, thread_name_prefix="pdkv-load"
        )

    def _rank(self) -> int:
        if self.settings.rank is not None:
            return self.settings.rank
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_tensor_model_parallel_rank()
        return 0

    def _pp_rank(self) -> int:
        if self.settings.pp_rank is not None:
            return self.settings.pp_rank
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return parallel_state.get_pp_group().rank_in_group
        return 0

    def node(self) -> str:
        return self.settings.node if self.index == 0 else f"{self.settings.node}-{self.index}"

    def register(self, kv_caches: dict[str, Any]) -> None:
        config = self.connector._kv_cache_config
        regions, planes = kv_memory(config, kv_caches)
        # The agent reads and writes this memory in place: keep it alive as long as the agent.
        self.kv_caches = kv_caches
        # Blocks are copied whole between equal ranks and cut by heads between legs of different
        # TP sizes: either way both legs must lay a block out alike, so the handshake compares it.
        self.order = page_order(config, kv_caches)
        self.packed = len(planes) < sum(len(group.layer_names) for group in config.kv_cache_groups)
        fields = dict(self.connector.model_fields, kv_page_order=self.order, kv_block_outermost=self.packed)
        listen = data_listen = advertise = data_advertise = None
        if self.is_prefill:
            listen = self._rank_address(self.settings.listen)
            if self.settings.data_listen is not None:
                data_listen = self._rank_address(self.settings.data_listen)
            if self.settings.advertise is not None:
                advertise = self._rank_address(self.settings.advertise)
            if self.settings.data_advertise is not None:
                data_advertise = self._rank_address(self.settings.data_advertise)
        self.agent = KvAgent(
            self.node(),
            self.connector.leg,
            self.settings.certs,
            self._peer_names(),
            json.dumps(self.connector.groups),
            regions,
            planes,
            config.num_blocks,
            listen=listen,
            data_listen=data_listen,
            advertise=advertise,
            data_advertise=data_advertise,
            read_engine=self.settings.read_engine,
            mori_host=self.settings.mori_host,
            mori_port=self._rank_port(self.settings.mori_port),
            lease_ms=self.settings.lease_ms,
            max_handoffs=self.settings.max_handoffs,
            claim_wait_ms=self.settings.claim_wait_ms,
            connect_timeout_ms=self.settings.connect_timeout_ms,
            request_timeout_ms=self.settings.request_timeout_ms,
            read_timeout_ms=self.settings.read_timeout_ms,
            model_json=json.dumps(fields),
        )

    def _peer_names(self) -> list[str]:
        """The other leg's workers this one talks to: worker i of leg ``peer`` (numbered
        stage-major, ``stage * peer_tp + rank``) is ``peer`` (i = 0) or ``peer-i``. The same rank
        only when the legs' TP sizes and DCP splits match, every rank (``peer_tp`` of them) when
        either differs (``peer_dcp``, ``peer_dcp_interleave``), as each decode rank may read any
        prefill rank; the same stage only when the legs' PP sizes
        match, every stage (``peer_pp`` of them) when they differ, as a decode stage reads each
        of its layers from the prefill stage holding it."""
        peer_tp = self.settings.peer_tp or self.tp
        peer_pp = self.settings.peer_pp or self.pp
        peer_dcp = (self.settings.peer_dcp or self.dcp[0], self.settings.peer_dcp_interleave or self.dcp[1])
        if peer_dcp[0] == 1:
            peer_dcp = (1, 1)  # no DCP: the interleave means nothing
        ranks = [self.rank] if peer_tp == self.tp and peer_dcp == self.dcp else list(range(peer_tp))
        stages = [self.pp_rank] if peer_pp == self.pp else list(range(peer_pp))
        indices = [stage * peer_tp + rank for stage in stages for rank in ranks]
        return [peer if index == 0 else f"{peer}-{index}" for peer in self.settings.peers for index in indices]

    def _rank_port(self, port: int) -> int:
        # Rank r of a fixed port p listens on p + r; port 0 picks a free one per rank.
        return port + self.index if port else 0

    def _rank_address(self, address: str) -> str:
        host, _, port = address.rpartition(":")
        return f"{host}:{self._rank_port(int(port))}"

    def handshake(self) -> PdkvHandshake | None:
        if self.agent is None:
            return None
        return PdkvHandshake(self.agent.node, self.agent.address, self.agent.incarnation, self.rank, self.pp_rank)

    def start(self, meta: PdkvMetadata) -> None:
        if self.agent is None:
            raise RuntimeError("pdkv: start_load_kv before register_kv_caches")
        for request_id, blocks in meta.announce.items():
            try:
                self.agent.announce(request_id, blocks)
            except ValueError as error:
                # Not handed off: free the blocks now; the decoder's claim is refused and it
                # recomputes.
                logger.error("request %s: hand-off refused (%s)", request_id, error)
                with self.lock:
                    self.sent.add(request_id)
        with self.lock:
            for request_id in meta.failed:
                self.failed.add(request_id)
                self.done.add(request_id)
                self.stats.count("failed_loads")
        for request_id, spec in meta.loads.items():
            future = self.pool.submit(self._load, request_id, spec)
            with self.lock:
                self.pending[request_id] = future
        for request_id, spec in meta.releases.items():
            self.pool.submit(self._release, request_id, spec)

    def _load(self, request_id: str, spec: LoadSpec) -> None:
        ok = False
        try:
            stages = self._stages(spec.workers)
            for worker in (worker for stage in stages for worker in stage):
                if not worker.get("address"):
                    raise LoadError(f"prefill worker {worker.get('node')} serves no hand-offs")
            if len(stages) == self.pp:
                # One PP size: stage s holds the layers of stage s.
                reading, stage_readers = [stages[self.pp_rank]], 1
            else:
                # Every decode stage asks every prefill stage for the layers it holds.
                reading, stage_readers = stages, self.pp
            # Every prefill stage runs one TP size (``_stages`` checks it).
            resharded = len(reading[0]) != self.tp or spec.prefill_dcp != self.dcp
            if resharded:
                self._check_reshardable(len(reading[0]), spec.prefill_dcp)
            started = time.monotonic()
            num_bytes, runs = self.agent.load_stages(
                spec.remote_request,
                [[(worker["node"], worker["address"], worker["incarnation"]) for worker in stage] for stage in reading],
                self.connector.model_fields["kv_heads"],
                self.tp,
                self.rank,
                spec.rotation,
                self.order if resharded else None,
                stage_readers,
                spec.pairs,
                self.dcp,
                spec.prefill_dcp,
            )
            with self.lock:
                self.stats.record_load(time.monotonic() - started, num_bytes, runs)
            ok = True
        except LoadError as error:
            logger.warning("request %s: KV not loaded, vLLM recomputes it: %s", request_id, error)
        except Exception:  # a bug must not leave vLLM waiting for a load that never ends
            logger.exception("request %s: KV load crashed, vLLM recomputes it", request_id)
        with self.lock:
            self.pending.pop(request_id, None)
            self.done.add(request_id)
            if not ok:
                self.failed.add(request_id)
                self.stats.count("failed_loads")

    @staticmethod
    def _stages(workers: list[dict]) -> list[list[dict]]:
        """The prefill leg's workers per pipeline stage, in rank order (as its scheduler listed
        them: stage-major)."""
        stages: dict[int, list[dict]] = {}
        for worker in workers:
            stages.setdefault(worker.get("pp", 0), []).append(worker)
        if sorted(stages) != list(range(len(stages))):
            raise LoadError(f"the prefill leg's workers name pipeline stages {sorted(stages)}, not 0 .. n-1")
        sizes = {len(stage) for stage in stages.values()}
        if len(sizes) != 1:
            raise LoadError(f"the prefill leg's pipeline stages run different tensor-parallel sizes {sorted(sizes)}")
        return [stages[stage] for stage in range(len(stages))]

    def _check_reshardable(self, prefill_tp: int, prefill_dcp: tuple[int, int]) -> None:
        """Refuses, before anything is claimed, a load across TP or DCP splits this layout cannot
        take: only attention KV, whose pages order heads and tokens, is resharded."""
        if not reshardable(self.connector.groups):
            raise LoadError(
                f"the prefill leg runs {prefill_tp} tensor-parallel ranks and DCP {prefill_dcp[0]} "
                f"(interleave {prefill_dcp[1]}), this leg {self.tp} and DCP {self.dcp[0]} (interleave "
                f"{self.dcp[1]}): only attention KV is resharded (a recurrent state needs equal splits)"
            )
        if self.order is None:
            raise LoadError(
                "KV is resharded by heads only where a layer's page is [heads, tokens, ...] or "
                "[tokens, heads, ...] (LBHNC, LBNHC, BLHNC, BLNHC)"
            )

    def _release(self, request_id: str, spec: ReleaseSpec) -> None:
        """Gives back a hand-off this leg needs nothing of; when that fails its lease ends it.
        Prefill worker (stage s, rank p)'s falls to decode worker (stage s mod this leg's PP
        size, rank p mod its TP size): the same stage and rank when the legs' sizes match."""
        try:
            for stage, workers in enumerate(self._stages(spec.workers)):
                if stage % self.pp != self.pp_rank:
                    continue
                for index, worker in enumerate(workers):
                    if index % self.tp != self.rank or not worker.get("address"):
                        continue
                    self.agent.release(spec.remote_request, worker["node"], worker["address"], worker["incarnation"])
                    with self.lock:
                        self.stats.count("released_unread")
        except LoadError as error:
            logger.info("request %s: hand-off not given back (%s); its lease will end it", request_id, error)
        except Exception:  # never let a bug escape a pool thread unseen
            logger.exception("request %s: giving back the hand-off crashed; its lease will end it", request_id)

    def take_stats(self) -> PdkvStats | None:
        if self.is_prefill and self.agent is not None:
            expired = self.agent.expired_handoffs()
            with self.lock:
                self.stats.count("expired_handoffs", expired - self.expired_seen)
            self.expired_seen = expired
        with self.lock:
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def results(self) -> KVConnectorTransferResults:
        sending = set(self.agent.finished()) if self.is_prefill and self.agent is not None else set()
        with self.lock:
            sending |= self.sent
            recving, failed = self.done, self.failed
            self.sent, self.done, self.failed = set(), set(), set()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def shutdown(self) -> None:
        # Loads in flight end by their own bounded waits.
        self.pool.shutdown(wait=True, cancel_futures=False)
        agent, self.agent = self.agent, None
        if agent is not None:
            revoked = agent.close()
            if revoked:
                logger.info("shutdown revoked %d hand-offs", len(revoked))
            del agent  # drops its runtime and sockets now, not at the next collection
