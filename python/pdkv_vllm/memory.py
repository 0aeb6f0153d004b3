"""KV memory a same-host peer can READ: tensors over memfds.

pdkv's shared-memory READ engine maps a prefill worker's memory through ``/proc/<pid>/fd``, so
the KV tensors must live in memfds, not in private heap memory. ``shared_tensor`` allocates one;
``allocate_kv_caches`` lays out a whole ``KVCacheConfig`` the way vLLM's model runner does (one
allocation per ``KVCacheTensor``, each layer a view at ``offset + l * layer_stride``), for CPU
workers and for tests. The connector finds the memfd behind any tensor with ``find``.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedAllocation:
    """One memfd-backed allocation: its descriptor, size and base address."""

    fd: int
    size: int
    base: int
    tensor: torch.Tensor
    mapping: mmap.mmap


_lock = threading.Lock()
_bases: list[int] = []
_allocations: dict[int, SharedAllocation] = {}


def shared_tensor(nbytes: int, name: str = "pdkv-kv") -> torch.Tensor:
    """A zeroed 1-D ``uint8`` tensor of ``nbytes`` in a fresh memfd (kept until ``release``)."""
    if nbytes <= 0:
        raise ValueError(f"a shared allocation needs a positive size, not {nbytes}")
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    allocation = SharedAllocation(fd, nbytes, tensor.data_ptr(), tensor, mapping)
    with _lock:
        bisect.insort(_bases, allocation.base)
        _allocations[allocation.base] = allocation
    return tensor


def find(address: int) -> SharedAllocation | None:
    """The shared allocation holding ``address``, if any."""
    with _lock:
        index = bisect.bisect_right(_bases, address) - 1
        if index < 0:
            return None
        allocation = _allocations[_bases[index]]
    return allocation if address < allocation.base + allocation.size else None


def release(tensor: torch.Tensor) -> None:
    """Forgets the allocation ``tensor`` starts (its memory lives while views of it do)."""
    with _lock:
        allocation = _allocations.pop(tensor.data_ptr(), None)
        if allocation is not None:
            _bases.remove(allocation.base)
    if allocation is not None:
        os.close(allocation.fd)


def allocate_kv_caches(kv_cache_config, views) -> dict[str, object]:
    """KV caches for ``kv_cache_config`` in shared memory, as vLLM's model runner lays them out.

    ``views(layer_name, raw)`` turns a layer's raw bytes (``num_blocks`` pages) into what the
    model sees: one tensor, or a list of tensors (mamba states). Returns layer name to caches.
    """
    caches: dict[str, object] = {}
    for index, placement in enumerate(kv_cache_config.kv_cache_tensors):
        backing = shared_tensor(placement.size, f"pdkv-kv-{index}")
        for position, layer in enumerate(placement.layers):
            start = placement.offset + position * placement.layer_stride
            length = placement.block_stride * kv_cache_config.num_blocks
            if start + length > placement.size:
                raise ValueError(
                    f"layer {layer}: {kv_cache_config.num_blocks} blocks of "
                    f"{placement.block_stride} bytes at {start} overflow a {placement.size}-byte "
                    "allocation"
                )
            caches[layer] = views(layer, backing[start : start + length])
    return caches
