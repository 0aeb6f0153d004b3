"""pdkv for vLLM: pdkv's block exchange over vLLM's per-group block ids.

The exchange is pdkv's, in Rust (`pdkv_vllm._native`): every group's list is trimmed to the
blocks holding the tokens the decode leg does not recompute, window groups are clipped to the
last prompt token's window, and lists are anchored at absolute block positions, so a lookahead
tail on either leg can never shift the decoder's window. A position one leg needs and the other
lacks is an ``ExchangeError``, never a silent shift.

Offers and needs are plain dicts (JSON-serialisable, for ``kv_transfer_params``).
"""

from __future__ import annotations

import json
from typing import NamedTuple, Sequence

from . import _native
from ._native import (
    AgentConfigError,
    ExchangeError,
    HandoffEnded,
    IncompatibleModel,
    KvAgent,
    LoadError,
    PeerUnreachable,
    StaleKv,
    write_cluster_certs,
)

__all__ = [
    "AgentConfigError",
    "BlockPair",
    "ExchangeError",
    "HandoffEnded",
    "IncompatibleModel",
    "KvAgent",
    "Layout",
    "LoadError",
    "PdkvConnector",
    "PeerUnreachable",
    "StaleKv",
    "need",
    "offer",
    "pair",
    "write_cluster_certs",
]


def __getattr__(name: str):
    # vLLM loads the connector by name from this package; importing it pulls in vLLM and torch,
    # which the exchange alone does not need.
    if name == "PdkvConnector":
        from .connector import PdkvConnector

        return PdkvConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class BlockPair(NamedTuple):
    """One READ unit: the prefill block at ``remote_position`` lands in the decode block at
    ``local_position`` (equal under anchored pairing)."""

    remote_position: int
    local_position: int
    remote_block: int
    local_block: int


class Layout:
    """A model's KV layout: groups as vLLM's ``KVCacheConfig`` describes them.

    ``groups`` holds one dict per KV-cache group: ``{"kind": "full", "block_size": 16}``,
    ``{"kind": "sliding_window", "block_size": 16, "window": 4096}``, ``{"kind": "mamba"}``, ``{"kind": "mamba_align", "block_size": 16}``,
    each with an optional ``"dcp"`` (decode context parallel factor, default 1).
    """

    def __init__(self, groups: Sequence[dict], layer_groups: Sequence[int] | None = None):
        self.groups = [dict(group) for group in groups]
        self._native = _native.Layout(
            json.dumps(self.groups), None if layer_groups is None else list(layer_groups)
        )

    @property
    def num_groups(self) -> int:
        return self._native.num_groups()

    def needed_positions(self, group: int, num_prompt_tokens: int) -> range:
        """Block positions of ``group`` the decode leg reads for an N-token prompt."""
        start, end = self._native.needed_positions(group, num_prompt_tokens)
        return range(start, end)

    def compat_hash(self) -> int:
        return self._native.compat_hash()


def offer(layout: Layout, num_prompt_tokens: int, prefill_blocks: Sequence[Sequence[int]]) -> dict:
    """The prefill leg's offer from its per-group block ids (position-indexed, tails included)."""
    return json.loads(_native.offer(layout._native, num_prompt_tokens, [list(b) for b in prefill_blocks]))


def need(
    layout: Layout,
    num_prompt_tokens: int,
    decode_blocks: Sequence[Sequence[int]],
    cached_blocks: Sequence[int] = (),
) -> dict:
    """The decode leg's need; ``cached_blocks[g]`` leading positions of group g are local hits."""
    return json.loads(
        _native.need(
            layout._native, num_prompt_tokens, [list(b) for b in decode_blocks], list(cached_blocks)
        )
    )


def pair(layout: Layout, offer: dict, need: dict) -> list[list[BlockPair]]:
    """Pairs an offer with a need by absolute position, per group in ascending order."""
    pairs = _native.pair(layout._native, json.dumps(offer), json.dumps(need))
    return [[BlockPair(*p) for p in group] for group in pairs]
