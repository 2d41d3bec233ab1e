"""`mrv2 bench mla`: MLA cache footprint and decode step time, absorbed vs up-projected.

Builds a random-weight DeepSeek-V3 checkpoint from a config preset (nothing is
downloaded), prints the KV bytes per token per layer against the equivalent
multi-head (GQA) layout, then times decode steps of the same batch with the absorbed
decode path (queries in latent space, the default) and the up-projected one (every
request's latents expanded through kv_b_proj each step), side by side in one run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

PRESETS = {
    # the tests' tiny config
    "tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                 v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2),
    # DeepSeek-V2-Lite's attention shapes, few layers and experts
    "small": dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=352, num_hidden_layers=4,
                  num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                  topk_group=2),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request before decoding")
    p.add_argument("--steps", type=int, default=10, help="timed decode steps per path")


def _checkpoint(preset: str, folder: Path) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from mrv2.loader import resolve_model_path

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=4096, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=8192,
                           bos_token_id=1, eos_token_id=2, pad_token_id=2, **PRESETS[preset])
    DeepseekV3ForCausalLM(cfg).save_pretrained(folder)
    default = resolve_model_path(None)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default / f, folder / f)


def run(args: argparse.Namespace) -> int:
    from mrv2 import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="mrv2-bench-mla-"))
    try:
        _checkpoint(args.preset, folder)
        llm = LLM(model=str(folder), max_num_seqs=args.batch, max_model_len=args.context + 4 * args.steps + 8,
                  kv_cache_memory=1 << 30, device=args.device)
        engine = llm.engine
        c = engine.runner.model.config
        itemsize = engine.dtype.itemsize
        mla = engine.runner.kv_cache_specs()[0].bytes_per_token
        gqa = c.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * itemsize
        print(f"preset {args.preset}: {c.num_heads} heads, kv_lora_rank {c.kv_lora_rank}, "
              f"qk_rope_head_dim {c.qk_rope_head_dim}, {engine.dtype}")
        print(f"KV bytes per token per layer: MLA {mla} (kv_lora_rank + qk_rope_head_dim) vs equivalent "
              f"multi-head layout {gqa} (heads x (qk_head_dim + v_head_dim)): {gqa / mla:.1f}x smaller")

        backend = engine.runner.attn_backend
        rng = np.random.default_rng(0)
        times = {}
        for absorbed in (True, False):
            backend.decode_absorbed = absorbed
            params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
            for _ in range(args.batch):
                prompt = rng.integers(3, c.vocab_size, args.context).tolist()
                engine.add_request(engine.make_request({"prompt_token_ids": prompt}, params))
            while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) \
                    or engine.scheduler.waiting:
                engine.step()  # prefill (and one warm-up decode), not timed
            samples = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                engine.step()
                samples.append(time.perf_counter() - t0)
            while engine.has_unfinished_requests():
                engine.step()
            times[absorbed] = float(np.median(samples))
        print(f"decode step, batch {args.batch}, context {args.context}: absorbed {1e3 * times[True]:.2f} ms, "
              f"up-projected {1e3 * times[False]:.2f} ms (median of {args.steps}; "
              f"up-projected / absorbed = {times[False] / times[True]:.2f}x)")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0
