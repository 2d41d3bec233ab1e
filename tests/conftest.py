"""Shared fixtures: the converted default model, its engine, and tiny random checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mrv2.loader import converted_checkpoint, default_gguf_path


def pytest_configure(config):
    """Under pytest-xdist (the default `-n 2`), each worker computes on cores of its own: two
    OpenMP teams sharing every core would stall each other's barriers. The engines a worker
    builds, and the processes it starts, take that worker's cores as the machine's."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2 or len(os.sched_getaffinity(0)) < count:
        return
    import torch

    from mrv2.platforms.cpu import CpuPlatform

    platform = CpuPlatform()
    platform.bind_rank(int(worker.removeprefix("gw")), count)  # a worker's cores, as a rank's
    torch.set_num_threads(platform.compute_threads())


@pytest.fixture(scope="module")
def cpu_kernels():
    """mrv2's C++ kernels, built and loaded for a module of kernel tests (which fail where they do not)."""
    from mrv2.platforms.cpu_kernels import load_cpu_kernels

    failed = load_cpu_kernels()
    assert failed is None, failed


@pytest.fixture(scope="module")
def split_threads():
    """At least two intra-op threads for a module of kernel tests, so that work split over threads is
    tested on a worker pinned to one core too."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def converted_default_model() -> Path:
    """The embedded default model converted once per machine, in the user's real cache."""
    return converted_checkpoint(default_gguf_path())


@pytest.fixture(scope="session")
def hf_default_model(converted_default_model):
    """The transformers reference, loaded from mrv2's converted folder (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(converted_default_model, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_llm():
    """One engine on the default model, shared by the end-to-end tests (each leaves it idle)."""
    from mrv2 import LLM

    return LLM(dtype="float32", max_model_len=1024, max_num_seqs=16, kv_cache_memory=64 << 20)


def make_tiny_checkpoint(path: Path, arch: str, tie_word_embeddings: bool, converted_default: Path,
                         seed: int = 0, **overrides):
    """Save a tiny random-weight HF checkpoint of `arch` (llama, qwen2, qwen3) with a real tokenizer."""
    import torch
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[arch]
    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=tie_word_embeddings,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # differs from hidden / heads, as in real Qwen3 configs
    if arch.startswith("deepseek"):
        # Three layers: one dense first (first_k_dense_replace), two MoE with grouped routing.
        kwargs.update(num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32, q_lora_rank=None,
                      kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                      n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                      routed_scaling_factor=1.5)
        kwargs.update({"norm_topk_prob": True} if arch == "deepseek_v3" else {"topk_method": "group_limited_greedy"})
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # random biases and norms, so every switch is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:  # V3's routing bias: nonzero so that it matters
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted_default / f, path / f)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, converted_default_model):
    """Factory: (arch, tied, **config overrides) -> (folder, HF model), built once per session."""
    cache = {}

    def get(arch: str, tied: bool, **overrides):
        key = (arch, tied, repr(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-{'tied' if tied else 'untied'}")
            cache[key] = (path, make_tiny_checkpoint(path, arch, tied, converted_default_model, **overrides))
        return cache[key]

    return get

