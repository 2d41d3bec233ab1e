"""KV-cache layout policy and allocation (seed gap 2, solved by design).

Each attention layer declares a `KVCacheSpec` (`mrv2.kv_spec`): the parts it stores per token
(GQA: K and V; MLA: latent and rope key), each `num_heads x head_dim`. The
allocator cuts every layer's tensors as views from ONE raw byte allocation:

- layout "joint": one tensor per layer, [num_blocks, block_size, sum of part widths];
  each part is a strided view of it.
- layout "split": one contiguous tensor per part per layer,
  [num_blocks, block_size, num_heads, head_dim]; the parts of a layer are split
  by byte ratio, as kernels that want separate K and V caches expect.

Every tensor base address is aligned to `alignment` bytes (the platform's
default, 2 MiB when a KV transfer is configured).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mrv2.config import KVLayout
from mrv2.kv_spec import KVCacheSpec, KVPartRegion, KVRegions, LayerKVCache, placement_in


@dataclass
class KVCache:
    """All layers' caches and the raw allocation they are views of.

    The allocation is zeroed once, when it is made (this commits the memory, as vLLM's
    does): backends that read whole blocks multiply masked-out slots by zero, and an
    uninitialised NaN would survive that. Nothing is zeroed per step.
    """

    layers: list[LayerKVCache]
    raw: torch.Tensor
    num_blocks: int
    block_size: int
    alignment: int

    def regions(self) -> KVRegions:
        """Base address, size, alignment and every layer's per-part offsets and strides, from the one
        raw allocation (what a KV-transfer engine registers to move blocks)."""
        start = self.raw.data_ptr()
        base = start + (-start % self.alignment)  # where the first tensor starts: the region is aligned
        parts = []
        for i, layer in enumerate(self.layers):
            for name, view in layer.parts.items():  # [num_blocks, block_size, heads, dim], heads x dim dense
                item = view.element_size()
                parts.append(KVPartRegion(i, name, view.data_ptr() - base, view.stride(0) * item,
                                          view.stride(1) * item, view.shape[2] * view.shape[3] * item))
        return KVRegions(base, start + self.raw.numel() - base, self.alignment, self.num_blocks, self.block_size,
                         tuple(parts))


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _tensor_sizes(spec: KVCacheSpec, layout: KVLayout, num_blocks: int, block_size: int) -> list[int]:
    per_part = [num_blocks * block_size * p.width * spec.dtype.itemsize for p in spec.parts]
    return [sum(per_part)] if layout == "joint" else per_part


def kv_cache_bytes(specs: list[KVCacheSpec], layout: KVLayout, num_blocks: int, block_size: int,
                   alignment: int) -> int:
    """Bytes of the raw allocation for `num_blocks` blocks, alignment padding included."""
    total = sum(_align(n, alignment) for s in specs for n in _tensor_sizes(s, layout, num_blocks, block_size))
    return total + alignment  # slack to align the base address itself


def num_blocks_for_budget(specs: list[KVCacheSpec], layout: KVLayout, block_size: int, alignment: int,
                          budget_bytes: int) -> int:
    """The largest number of blocks whose cache fits in `budget_bytes`."""
    bytes_per_block = sum(s.bytes_per_token for s in specs) * block_size
    num_tensors = sum(len(_tensor_sizes(s, layout, 1, block_size)) for s in specs)
    num_blocks = max(0, (budget_bytes - (num_tensors + 1) * alignment) // bytes_per_block)
    while num_blocks > 0 and kv_cache_bytes(specs, layout, num_blocks, block_size, alignment) > budget_bytes:
        num_blocks -= 1
    return num_blocks


def allocate_kv_cache(specs: list[KVCacheSpec], layout: KVLayout, num_blocks: int, block_size: int,
                      alignment: int, device: torch.device,
                      allocate: Callable[[int], torch.Tensor] | None = None) -> KVCache:
    """Allocate one zeroed raw buffer (`allocate(nbytes)`, uint8 on `device`; torch.zeros if not given)
    and cut every layer's (aligned) views from it."""
    if num_blocks < 2:
        raise ValueError(f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a positive power of two, got {alignment}")
    nbytes = kv_cache_bytes(specs, layout, num_blocks, block_size, alignment)
    raw = torch.zeros(nbytes, dtype=torch.uint8, device=device) if allocate is None else allocate(nbytes)
    offset = -raw.data_ptr() % alignment
    layers = []
    for spec in specs:
        sizes = _tensor_sizes(spec, layout, num_blocks, block_size)
        chunks = []
        for n in sizes:
            chunks.append(raw[offset:offset + n].view(spec.dtype))
            offset += _align(n, alignment)
        if layout == "joint":
            joint = chunks[0].view(num_blocks, block_size, spec.width)
            views, col = {}, 0
            for p in spec.parts:
                views[p.name] = joint[:, :, col:col + p.width].unflatten(-1, (p.num_heads, p.head_dim))
                col += p.width
        else:
            views, joint = {p.name: c.view(num_blocks, block_size, p.num_heads, p.head_dim)
                            for p, c in zip(spec.parts, chunks)}, None
        layers.append(LayerKVCache(views, joint, raw, {name: placement_in(raw, v) for name, v in views.items()}))
    return KVCache(layers=layers, raw=raw, num_blocks=num_blocks, block_size=block_size, alignment=alignment)
