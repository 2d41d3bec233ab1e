"""Where platforms put the weights every decode step streams through, and the KV cache."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from mrv2.layers.quantization import BlockGemv, place_in_one_buffer
from mrv2.platforms.cpu import CpuPlatform
from mrv2.platforms.cpu_kernels import load_cpu_kernels
from quant_helpers import quantized

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> str:
    """This process's /proc/self/smaps entry of the mapping that holds `address`."""
    entries = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text())
    for entry in entries:
        start, end = (int(a, 16) for a in entry.split(None, 1)[0].split("-"))
        if start <= address < end:
            return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def test_cpu_weight_storage_is_aligned_to_huge_pages_and_asks_for_them():
    buffer = CpuPlatform().weight_storage(3 << 20)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 << 20 and buffer.is_contiguous()
    assert buffer.storage_offset() == 0  # compiled code takes it as an argument: offsets cost aligned loads
    buffer.fill_(7)  # writable, every byte
    assert int(buffer.sum()) == 7 * (3 << 20)
    if not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("no transparent huge pages on this machine")
    assert buffer.data_ptr() % (2 << 20) == 0
    assert re.search(r"^THPeligible:\s+1$", _mapping_of(buffer.data_ptr()), re.M)


def test_gemvs_placed_in_one_buffer_compute_what_they_did():
    isa = CpuPlatform().gemv_isa()
    if not isa or load_cpu_kernels() is not None:
        pytest.skip("this CPU has no block GEMV")
    gemvs = [BlockGemv(quantized(qtype, n, k, seed=n)[0], isa)
             for qtype, n, k in (("Q4_1", 40, 384), ("Q8_0", 24, 96), ("Q4_0", 16, 64))]
    xs = [torch.randn(3, g.in_features, dtype=torch.bfloat16) for g in gemvs]
    before = [g(x) for g, x in zip(gemvs, xs)]
    nbytes = place_in_one_buffer(gemvs, CpuPlatform().weight_storage)
    held = [t for g in gemvs for t in (g.codes, g.scales, g.mins) if t is not None]
    assert nbytes == sum(-(-t.nbytes // 64) * 64 for t in held)
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    for g, x, y in zip(gemvs, xs, before):
        assert torch.equal(g(x), y)


def _rss_bytes() -> int:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def test_cpu_zeroed_storage_is_zero_and_takes_memory_only_where_written():
    """The KV cache's memory: zero everywhere, without writing it first (the kernel zeroes pages on first
    touch), so a GiB buffer is ready at once and RAM follows the blocks in use."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    before = _rss_bytes()
    buffer = CpuPlatform().zeroed_storage(1 << 30)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 1 << 30 and buffer.storage_offset() == 0
    assert _rss_bytes() - before < 64 << 20
    stride = 1 << 20  # one byte a MiB: every page read is zero
    assert not buffer[::stride].any()
    buffer[: 8 << 20].fill_(1)
    assert int(buffer[: 8 << 20].sum()) == 8 << 20 and not buffer[8 << 20:: stride].any()
    assert _rss_bytes() - before < 128 << 20


@pytest.mark.parametrize("tied", [True, False])
def test_dense_gemv_weights_move_into_one_buffer_in_step_order_and_compute_what_they_did(tiny_checkpoint, tied):
    """float32 weights on the dense GEMV (every linear layer's, the LM head's) move into one buffer from the
    platform's weight storage, layer by layer as a step reads them; a tied LM head stays the embedding's table."""
    from transformers import AutoConfig

    from mrv2.attention import get_attention_backend
    from mrv2.config import DenseGemvPolicy
    from mrv2.layers.linear import Linear
    from mrv2.models.registry import build_model
    from mrv2.platforms.cpu import DENSE_GEMV_ISAS

    platform = CpuPlatform()
    policy, _ = platform.dense_gemv_policy(torch.float32)
    if policy is None:
        pytest.skip("this CPU has no dense GEMV")
    path, hf = tiny_checkpoint("llama", tied=tied)
    model = build_model(AutoConfig.from_pretrained(path), get_attention_backend(platform, "gqa"), torch.float32, 64)
    model.load_weights(hf.state_dict().items())
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.use_dense_gemv(policy) == len(linears) + 1, DENSE_GEMV_ISAS[policy.isa]  # where they are
    ids = torch.tensor([3, 17, 42, 5, 9])
    positions = torch.arange(len(ids))
    with torch.inference_mode():
        before = model.compute_logits(model(ids, positions, None))
    assert model.use_dense_gemv(policy, platform.weight_storage) == len(linears) + 1
    placed = [m.weight for m in linears] + [model.lm_head_weight]
    assert len({w.untyped_storage().data_ptr() for w in placed}) == 1
    starts = [w.data_ptr() for w in placed]
    assert starts == sorted(starts) and all(s % 64 == 0 for s in starts)
    assert (model.embed_tokens.weight is model.lm_head_weight) == tied
    with torch.inference_mode():
        assert torch.equal(model.compute_logits(model(ids, positions, None)), before)
