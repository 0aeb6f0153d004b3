"""KV memory a same-host peer can READ: tensors over memfds.

pdkv's shared-memory READ engine maps a prefill worker's memory through ``/proc/<pid>/fd``, so
KV read that way must live in a memfd (KV in plain memory is READ over the network instead).
``shared_tensor`` allocates one; ``allocate_kv_caches`` lays out a whole ``KVCacheConfig`` the way
vLLM's worker does (one backing allocation, each layer a view at ``offset + l * layer_stride``),
for CPU workers and tests. The connector finds the memfd behind any tensor with ``find``.
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


def allocate_kv_caches(kv_cache_config, layout, kernel_block_sizes=None) -> dict[str, torch.Tensor]:
    """vLLM's KV caches for ``kv_cache_config`` in one shared-memory allocation.

    The same as vLLM's worker-side ``allocate_kv_cache`` (one backing allocation; every
    ``KVCacheTensor`` places its layers in it; groups overlay one another), with the backing
    allocation in a memfd so a same-host decode worker can READ it through shared memory.
    ``layout`` is a ``vllm.v1.kv_cache_layout.KVCacheLayout``.
    """
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    tensors = kv_cache_config.kv_cache_tensors
    if not tensors:
        return {}
    sizes = {tensor.size for tensor in tensors}
    if len(sizes) != 1:
        raise ValueError(f"KV cache tensors must share one backing allocation, sizes are {sorted(sizes)}")
    raw = shared_tensor(sizes.pop(), "pdkv-kv").view(torch.int8)
    caches: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        layer = tensor.layers[0]
        group_id, group = next(
            (index, group)
            for index, group in enumerate(kv_cache_config.kv_cache_groups)
            if layer in group.layer_names
        )
        spec = group.kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        if specs:
            spec = specs[layer]
        if not spec.has_layer_views:
            caches.update((name, raw) for name in tensor.layers)
            continue
        kernel_block_size = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[group_id]
        views = create_kv_cache_views(
            raw,
            spec,
            kv_cache_config.num_blocks_of(tensor),
            layout,
            tensor,
            kernel_block_size=kernel_block_size,
        )
        caches.update(zip(tensor.layers, views))
    return caches
