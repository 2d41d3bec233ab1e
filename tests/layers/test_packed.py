"""Dense weights prepacked for oneDNN give F.linear's results, and the model packs only what it may."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mrv2 import LLM, SamplingParams
from mrv2.config import QuantPolicy
from mrv2.layers.linear import Linear
from mrv2.layers.packed import packed_linear, packing_available
from mrv2.platforms import CpuPlatform
from quant_helpers import quantized

pytestmark = pytest.mark.skipif(not packing_available(), reason="packing needs torch's oneDNN ops")
needs_bf16 = pytest.mark.skipif(not CpuPlatform().supports_native_bf16(),
                                reason="packed bf16 kernels need a CPU with native bf16")
DTYPES = [pytest.param(torch.bfloat16, 1e-2, marks=needs_bf16), (torch.float32, 1e-5)]


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_linear_equals_f_linear(rows, bias, dtype, tol):
    torch.manual_seed(0)
    layer = Linear(96, [80, 48], bias, dtype)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    weight, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    x = torch.randn(2 * rows, 96, dtype=dtype)[::2]  # strided rows, as slices of a batch are
    assert layer.pack(64) and layer.weight is None and layer.packed is not None
    torch.testing.assert_close(layer(x).float(), F.linear(x, weight, b).float(), atol=tol, rtol=tol)


def test_fp16_and_unpackable_weights_stay_plain():
    fp16 = Linear(32, [16], False, torch.float16)
    assert not fp16.pack(64) and fp16.weight is not None
    kept = Linear(32, [16], False, torch.float32, packable=False)  # MLA's absorbed kv_b_proj
    assert not kept.pack(64) and kept.weight is not None


@needs_bf16
def test_int4_below_the_threshold_and_the_packed_dense_copy_above():
    weight, _ = quantized("Q4_0", 64, 128)
    layer = Linear(128, [64], False, torch.bfloat16)
    layer.load_shard(layer.weight, 0, weight)
    layer.finalize_quantization(QuantPolicy(int4_max_rows=8), keep_dense=True)
    dense = layer.weight.detach().clone()
    assert layer.pack(64)
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    assert torch.equal(layer(x[:8]), layer.int4(x[:8]))
    torch.testing.assert_close(layer(x).float(), F.linear(x, dense).float(), atol=2e-2, rtol=2e-2)


@needs_bf16
@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("deepseek_v3", False)])
def test_bf16_engine_packs_its_linears_and_lm_head_and_matches_plain_weights(tiny_checkpoint, arch, tied):
    path, _ = tiny_checkpoint(arch, tied)
    kwargs = dict(model=str(path), dtype="bfloat16", kv_cache_memory=1 << 22, enforce_eager=True)
    packed = LLM(**kwargs)
    model = packed.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert any(m.packed is not None for m in linears)
    assert all(m.weight is not None for m in linears if not m.packable)  # MLA's kv_b_proj
    assert model.lm_head_packed is not None
    # A tied head keeps the embedding table for lookups; an untied one keeps only its packed form.
    assert (model.lm_head_weight is model.embed_tokens.weight) if tied else model.lm_head_weight is None
    # The same weights unpacked, through F.linear and the chunked LM head: the same logits and greedy tokens.
    plain = LLM(**kwargs)
    plain_model = plain.engine.runner.model
    for m in plain_model.modules():
        if isinstance(m, Linear) and m.packed is not None:
            m.weight, m.packed = torch.nn.Parameter(m.packed.tensor.to_dense(), requires_grad=False), None
    if not tied:
        plain_model.lm_head_weight = torch.nn.Parameter(plain_model.lm_head_packed.to_dense(), requires_grad=False)
    plain_model.lm_head_packed = None
    hidden = torch.randn(64, model.config.hidden_size, dtype=torch.bfloat16)
    chunks = packed.engine.platform.logits_chunk_rows
    assert torch.equal(model.compute_logits(hidden, chunks), plain_model.compute_logits(hidden, chunks))
    prompts = [{"prompt_token_ids": [3, 17, 99, 4, 250]}, {"prompt_token_ids": [8, 9, 10]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out_packed = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    out_plain = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert out_packed == out_plain
    for llm in (packed, plain):
        llm.engine.shutdown()


def test_fp32_engine_packs_or_runs_the_dense_gemv_where_the_platform_says_and_keeps_transformers_tokens(
        tiny_checkpoint):
    """fp32 weights run small batches on mrv2's dense GEMV where its kernels build, larger ones through oneDNN
    on the same plain weights (AMD) or torch (elsewhere); they are packed for oneDNN where the kernels do not
    build on AMD: either way the default engine, its batch-1 decode compiled whole, keeps transformers' tokens."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny_checkpoint("llama", True)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=1 << 22)
    model = llm.engine.runner.model
    packs = llm.engine.platform.packs_fp32()
    gemv, _ = llm.engine.platform.dense_gemv_policy(torch.float32)
    assert all((m.packed is not None) == packs for m in model.modules() if isinstance(m, Linear))
    assert (model.lm_head_packed is not None) == packs
    assert all(m.gemv == gemv for m in model.modules() if isinstance(m, Linear)) and model.lm_head_gemv == gemv
    if gemv is not None:  # the LM head too: one row on the GEMV, more rows than its own through oneDNN or torch
        hidden = torch.randn(gemv.max_rows + 1, model.config.hidden_size)
        want = F.linear(hidden.double(), model.lm_head_weight.double()).float()
        torch.testing.assert_close(model.compute_logits(hidden[:1], 2048), want[:1], atol=1e-5, rtol=1e-5)
        above = packed_linear if gemv.onednn_above else F.linear
        assert torch.equal(model.compute_logits(hidden, None), above(hidden, model.lm_head_weight, None))
    prompt = [3, 17, 99, 4, 250]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    assert list(out[0].outputs[0].token_ids) == ref
    llm.engine.shutdown()


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16), torch.float32])
def test_compiled_code_calls_each_layers_packed_weight_through_one_graph(dtype):
    """Compiled graphs reach packed weights through the custom op; layers of one shape share the graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    layers = []
    for _ in range(2):
        layer = Linear(96, [80], True, dtype)
        layer.weight.data.normal_()
        layer.bias.data.normal_()
        assert layer.pack(64)
        layers.append(layer)

    def block(layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(layer(x * 2))

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, backend=counter, dynamic=False)
    x = torch.randn(5, 96, dtype=dtype)
    for layer in layers:  # a graph that baked one layer's weight in would give the other's result
        assert torch.equal(compiled(layer, x), block(layer, x))
    assert counter.frame_count == 1
