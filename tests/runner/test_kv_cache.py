"""KV-cache allocator: alignment, layouts, shapes, and that no two tensors overlap."""

import pytest
import torch

from mrv2.config import KV_TRANSFER_ALIGNMENT, CacheConfig
from mrv2.kv_spec import KVCacheSpec, KVPart
from mrv2.runner.kv_cache import allocate_kv_cache, kv_cache_bytes, num_blocks_for_budget

GQA = KVCacheSpec.gqa(num_kv_heads=3, head_dim=64, v_head_dim=64, dtype=torch.float32)
# Unequal parts, as in MLA (latent + rope key): split is by byte ratio, not in halves.
MLA_LIKE = KVCacheSpec((KVPart("latent", 1, 512), KVPart("rope", 1, 64)), torch.bfloat16)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] that a (possibly strided) view can touch."""
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


@pytest.mark.parametrize("layout", ["joint", "split"])
@pytest.mark.parametrize("alignment", [64, KV_TRANSFER_ALIGNMENT])
def test_alignment_shapes_and_no_overlap(layout, alignment):
    specs = [GQA, GQA, MLA_LIKE]
    cache = allocate_kv_cache(specs, layout, num_blocks=10, block_size=16, alignment=alignment,
                              device=torch.device("cpu"))
    raw_lo, raw_hi = cache.raw.data_ptr(), cache.raw.data_ptr() + cache.raw.numel()
    tensors = []  # the allocation unit of each layout: one per layer (joint) or one per part (split)
    for spec, layer in zip(specs, cache.layers):
        for part in spec.parts:
            view = layer[part.name]
            assert view.shape == (10, 16, part.num_heads, part.head_dim)
            assert view.dtype == spec.dtype
            lo, hi = _extent(view)
            assert raw_lo <= lo and hi <= raw_hi
            if layout == "split":
                assert view.is_contiguous()
                assert lo % alignment == 0
                tensors.append((lo, hi))
        if layout == "joint":
            first = layer[spec.parts[0].name]
            assert first.data_ptr() % alignment == 0
            total = sum(p.width for p in spec.parts) * spec.dtype.itemsize
            tensors.append((first.data_ptr(), first.data_ptr() + 10 * 16 * total))
    tensors.sort()
    for (lo1, hi1), (lo2, hi2) in zip(tensors, tensors[1:]):
        assert hi1 <= lo2, "two KV tensors overlap"


def test_split_by_byte_ratio():
    cache = allocate_kv_cache([MLA_LIKE], "split", num_blocks=4, block_size=16, alignment=64,
                              device=torch.device("cpu"))
    latent, rope = cache.layers[0]["latent"], cache.layers[0]["rope"]
    assert latent.numel() * latent.element_size() == 8 * rope.numel() * rope.element_size()


def test_joint_parts_are_interleaved_per_token():
    cache = allocate_kv_cache([GQA], "joint", num_blocks=2, block_size=4, alignment=64, device=torch.device("cpu"))
    k, v = cache.layers[0]["k"], cache.layers[0]["v"]
    k.zero_()
    v.fill_(1.0)
    # Writing V never touches K: they are disjoint columns of the same rows.
    assert k.abs().sum() == 0 and v.sum() == v.numel()
    assert v.data_ptr() - k.data_ptr() == 3 * 64 * 4


def test_writes_through_views_land_in_raw():
    cache = allocate_kv_cache([GQA], "split", num_blocks=2, block_size=4, alignment=256, device=torch.device("cpu"))
    cache.raw.zero_()
    cache.layers[0]["v"][1, 3] = 7.0
    assert cache.raw.view(torch.uint8).sum() > 0


def test_budget_sizing_fits_and_is_tight():
    budget = 50 * 2**20
    for layout in ("joint", "split"):
        n = num_blocks_for_budget([GQA] * 30, layout, 16, KV_TRANSFER_ALIGNMENT, budget)
        assert kv_cache_bytes([GQA] * 30, layout, n, 16, KV_TRANSFER_ALIGNMENT) <= budget
        assert kv_cache_bytes([GQA] * 30, layout, n + 1, 16, KV_TRANSFER_ALIGNMENT) > budget


def test_transfer_forces_2mib_alignment():
    assert CacheConfig(kv_transfer=True).base_alignment(64) == KV_TRANSFER_ALIGNMENT
    assert CacheConfig().base_alignment(64) == 64
    with pytest.raises(ValueError, match="alignment"):
        CacheConfig(alignment=3)


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        allocate_kv_cache([GQA], "joint", 1, 16, 64, torch.device("cpu"))


@pytest.mark.parametrize("layout", ["joint", "split"])
def test_every_blocks_bytes_are_reachable_from_the_regions(layout):
    """A transfer engine sees only the region numbers: every block of every layer and part, read
    through them from the raw allocation, is exactly what the layer's view holds."""
    specs = [KVCacheSpec.gqa(2, 8, 8, torch.bfloat16),
             KVCacheSpec((KVPart("latent", 1, 16), KVPart("rope", 1, 4)), torch.float32)]
    kv = allocate_kv_cache(specs, layout, 5, 4, KV_TRANSFER_ALIGNMENT, torch.device("cpu"))
    kv.raw.copy_(torch.randint(0, 256, kv.raw.shape, dtype=torch.uint8))
    regions = kv.regions()
    raw_start = kv.raw.data_ptr()
    assert regions.base % KV_TRANSFER_ALIGNMENT == 0 and raw_start <= regions.base
    assert regions.base + regions.size == raw_start + kv.raw.numel() and len(regions.parts) == 4
    assert all(p.offset % KV_TRANSFER_ALIGNMENT == 0 for p in regions.parts if layout == "split")
    flat = kv.raw.numpy()
    for block in range(regions.num_blocks):
        spans = iter(regions.block_bytes(block))
        for part in regions.parts:
            view = kv.layers[part.layer][part.part][block]  # [block_size, heads, dim]
            expected = view.contiguous().view(torch.uint8).numpy().tobytes()
            got = b""
            while len(got) < len(expected):
                address, length = next(spans)
                assert regions.base <= address and address + length <= regions.base + regions.size
                got += flat[address - raw_start:address - raw_start + length].tobytes()
            assert got == expected
        assert next(spans, None) is None
    # A block's spans of one layer and part never overlap another block's.
    first, second = set(regions.block_bytes(0)), set(regions.block_bytes(1))
    assert not {a for a, _ in first} & {a for a, _ in second}
