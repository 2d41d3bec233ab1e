"""mrv2's C++ paged decode attention kernel against the definition it implements.

`paged_decode_attention` (eager: gathered blocks, fp32 softmax) is the reference; the whole
backend against dense float64 attention over every scenario and layout is in test_torch_paged.py.
"""

from __future__ import annotations

import pytest
import torch

from mrv2.attention.cpp_paged import CppPagedAttention, kernel_loaded
from mrv2.attention.paged_decode import paged_decode_attention
from mrv2.attention.registry import get_attention_backend
from mrv2.kv_spec import placement_in
from mrv2.platforms.cpu import CpuPlatform


MACHINE_ISA = CpuPlatform().attention_isa()
# Every kernel this CPU can run: the AVX2 one, and the AVX-512 one where it has AVX512-BF16.
ISAS = [pytest.param(isa, id=f"isa{isa}", marks=pytest.mark.skipif(isa > MACHINE_ISA, reason="needs AVX512-BF16"))
        for isa in (1, 2)]
pytestmark = pytest.mark.usefixtures("split_threads")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if "cpp-paged" not in CpuPlatform().attention_backend_names("gqa"):  # this loads it where it can
        pytest.skip("mrv2's CPU kernels need AVX2, FMA, F16C and a C++ compiler")
    assert kernel_loaded() and CppPagedAttention.is_available()


def _case(rows: int, heads: int, kv_heads: int, dim: int, dim_v: int, block_size: int, max_len: int,
          dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_row = -(-max_len // block_size) + 1
    num_blocks = rows * blocks_per_row + 2
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, dim_v, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:rows * blocks_per_row].view(rows, blocks_per_row).int()
    lens = torch.randint(1, max_len + 1, (rows,), generator=g).int()
    lens[0] = max_len
    q = torch.randn(rows, heads, dim, generator=g).to(dtype)
    return q, k, v, table, lens


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows, heads, kv_heads, dim, dim_v, block_size, max_len", [
    (1, 9, 3, 64, 64, 16, 160),  # the default model at batch 1: its KV heads split over the threads
    (64, 9, 3, 64, 64, 16, 97),  # at batch 64: split over the threads
    (3, 8, 8, 128, 128, 4, 33),  # one query head per KV head
    (2, 16, 2, 64, 128, 16, 200),  # 8 query heads per KV head (two groups of 4 on AVX-512), Dv != D
    (4, 7, 1, 32, 64, 3, 41),  # 7 heads a KV head (4 + 3), a block size that splits the 16-token steps
    (1, 9, 3, 64, 64, 16, 5),  # fewer keys than a 16-token step
    (5, 8, 2, 12, 20, 16, 40),  # head dims that are not multiples of the vector width (AVX2 on either isa)
    (2, 4, 1, 8, 8, 1, 7),  # one token per block
])
def test_the_kernel_computes_the_definition(isa, dtype, tol, rows, heads, kv_heads, dim, dim_v, block_size, max_len):
    q, k, v, table, lens = _case(rows, heads, kv_heads, dim, dim_v, block_size, max_len, dtype)
    got = torch.ops.mrv2.paged_decode_attention(q, k, v, table, lens, dim ** -0.5, isa)
    want = paged_decode_attention(q, k, v, table, lens, dim ** -0.5)
    assert got.dtype == dtype and got.shape == (rows, heads, dim_v)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("isa", ISAS)
def test_views_of_one_cache_and_strided_queries_read_the_right_values(isa):
    # The joint layout: K and V are views of one tensor; queries come out of a fused projection.
    q, k, v, table, lens = _case(4, 8, 2, 64, 64, 16, 50, torch.float32)
    joint = torch.cat([k, v], dim=-1)
    qkv = torch.cat([q, torch.randn(4, 4, 64)], dim=1)
    got = torch.ops.mrv2.paged_decode_attention(qkv[:, :8], joint[..., :64], joint[..., 64:], table, lens, 0.125, isa)
    torch.testing.assert_close(got, paged_decode_attention(q, k, v, table, lens, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_rows_past_the_batch_and_padded_rows(isa):
    q, k, v, table, lens = _case(3, 4, 2, 64, 64, 4, 20, torch.float32)
    lens[1] = 0  # a padded row attends nothing: zeros
    longer_table = torch.cat([table, table], dim=0)  # the runner's tables hold every slot's row
    got = torch.ops.mrv2.paged_decode_attention(q, k, v, longer_table, lens, 0.125, isa)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    keep = [0, 2]
    torch.testing.assert_close(got[keep], paged_decode_attention(q[keep], k, v, table[keep], lens[keep], 0.125))


@pytest.mark.parametrize("change, match", [
    (dict(table=lambda t: t.long()), "block_table must be int32"),
    (dict(lens=lambda s: s + 1000), "overruns its"),
    (dict(table=lambda t: t + 1000), "outside the cache's"),
    (dict(q=lambda q: q.double(), k=lambda k: k.double(), v=lambda v: v.double()), "float32, bfloat16 or float16"),
    (dict(q=lambda q: q[:, :3]), "must be a multiple of KV heads"),
    (dict(v=lambda v: v.bfloat16()), "must share a dtype"),
])
def test_bad_operands_name_the_problem(change, match):
    q, k, v, table, lens = _case(2, 4, 2, 16, 16, 4, 10, torch.float32)
    q = change.get("q", lambda x: x)(q)
    k = change.get("k", lambda x: x)(k)
    v = change.get("v", lambda x: x)(v)
    table = change.get("table", lambda x: x)(table)
    lens = change.get("lens", lambda x: x)(lens)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.mrv2.paged_decode_attention(q, k, v, table, lens, 0.25)


def _in_one_allocation(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V copied side by side per token into one byte allocation, as the joint layout cuts them:
    (the allocation, the K view, the V view)."""
    joint = torch.cat([k, v], dim=-1)
    raw = torch.zeros(joint.numel() * joint.element_size() + 64, dtype=torch.uint8)
    cut = raw[64:].view(joint.dtype).view(joint.shape)  # an offset past 0: the placement carries it
    cut.copy_(joint)
    return raw, cut[..., :k.shape[-1]], cut[..., k.shape[-1]:]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("d", [16, 64])
def test_a_decode_step_writes_its_keys_and_values_then_attends(isa, d):
    q, k, v, table, lens = _case(3, 4, 2, d, d, 4, 20, torch.float32)
    raw, k_view, v_view = _in_one_allocation(k, v)
    new_k, new_v = torch.randn(3, 2, d), torch.randn(3, 2, d)
    slots = torch.stack([table[r, (n - 1) // 4].long() * 4 + (n - 1) % 4 for r, n in enumerate(lens.tolist())])
    want_k, want_v = k.clone(), v.clone()
    want_k.flatten(0, 1)[slots] = new_k
    want_v.flatten(0, 1)[slots] = new_v
    padded = torch.cat([q, torch.full((2, 4, d), float("nan"))])  # graph padding rows: zeros out
    at_k, at_v = placement_in(raw, k_view), placement_in(raw, v_view)
    got = torch.ops.mrv2.paged_decode_attention_with_kv(padded, new_k, new_v, raw, at_k, at_v, slots, table, lens,
                                                        0.25, isa)
    assert torch.equal(k_view, want_k) and torch.equal(v_view, want_v)
    torch.testing.assert_close(got[:3], paged_decode_attention(q, want_k, want_v, table, lens, 0.25))
    assert torch.equal(got[3:], torch.zeros(2, 4, d))
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.mrv2.paged_decode_attention_with_kv(q, new_k, new_v, raw, at_k, at_v, slots + 10 ** 6, table, lens,
                                                      0.25)


@pytest.mark.parametrize("change, match", [
    (dict(raw=lambda r: r[:-8]), "reaches past the cache"),
    (dict(raw=lambda r: r.view(torch.float32)), "contiguous uint8 allocation"),
    (dict(k_view=lambda p: [p[0] + 2] + p[1:]), "not a multiple of 4"),
    (dict(k_view=lambda p: p[:5]), "must be \\[byte offset"),
])
def test_a_bad_placement_in_the_allocation_names_the_problem(change, match):
    q, k, v, table, lens = _case(2, 4, 2, 16, 16, 4, 10, torch.float32)
    raw, k_view, v_view = _in_one_allocation(k, v)
    args = dict(raw=raw, k_view=placement_in(raw, k_view), v_view=placement_in(raw, v_view))
    args = {name: change.get(name, lambda x: x)(x) for name, x in args.items()}
    slots = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.mrv2.paged_decode_attention_with_kv(q, k[:2, 0], v[:2, 0], args["raw"], args["k_view"],
                                                      args["v_view"], slots, table, lens, 0.25)


def test_a_cpu_without_avx2_keeps_inductors_kernel():
    names = CpuPlatform(flags=frozenset({"sse4_2"})).attention_backend_names("gqa")
    assert names[0] == "inductor-paged" and "cpp-paged" not in names


def test_an_unknown_instruction_set_is_refused():
    q, k, v, table, lens = _case(2, 4, 2, 64, 64, 4, 10, torch.float32)
    with pytest.raises(RuntimeError, match="isa must be 1"):
        torch.ops.mrv2.paged_decode_attention(q, k, v, table, lens, 0.125, 3)


AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}


@pytest.mark.parametrize("flags, isa, kernel", [
    (AVX2, 1, "AVX2"),  # an AVX2-only Zen 3
    (AVX512, 1, "AVX2"),  # AVX-512 without bf16 dot products (Ice Lake): the AVX2 kernel
    (AVX512 | {"avx512_bf16", "amx_bf16"}, 2, "AVX-512 with AVX512-BF16"),  # Sapphire Rapids
    (AVX512 | {"avx512_bf16"}, 2, "AVX-512 with AVX512-BF16"),  # Zen 4
])
def test_the_backend_runs_the_kernel_the_cpus_flags_allow(flags, isa, kernel):
    platform = CpuPlatform(flags=frozenset(flags))
    assert platform.attention_isa() == isa
    backend = get_attention_backend(platform, "gqa")
    assert isinstance(backend, CppPagedAttention) and backend.isa == isa
    assert backend.describe() == f"cpp-paged (decode kernel: {kernel})"  # what the runner logs
