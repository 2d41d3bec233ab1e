"""Device check: mrv2 on an accelerator against transformers on the same device.

Run from the repository root (`python tools/gpu_check.py --device cuda`). Builds
random-weight checkpoints locally (a tiny Llama, tiny DeepSeek-V2/V3, and a Llama with
SmolLM2-135M's exact shapes: the real weights cannot travel to a lent machine), then for
each, eager, with FULL decode graphs, PIECEWISE graphs and both: greedy tokens from mrv2
vs transformers, fp32; and decode step times of each at batch 1, 8 and 64 for the
SmolLM2-shaped model. For the tiny Llama, speculative decoding with the model drafting
for itself (draft_model, k = 3) in each mode: transformers' tokens, every greedy draft
accepted (a replayed drafter graph that drafts wrong shows as a rejection), and the
drafter's graph replays. An engine that fails to build or run is reported and counted, and
the check goes on. Needs only torch, transformers, safetensors and numpy; the tokenizer
files come from `--tokenizer DIR`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mrv2 import LLM, SamplingParams  # noqa: E402
from mrv2.bench.decode import decode_step_ms  # noqa: E402
from mrv2.config import default_capture_sizes  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
MODES = {"eager": {"enforce_eager": True}, "full": {"graph_mode": "full"}, "piecewise": {"graph_mode": "piecewise"},
         "full+pw": {"graph_mode": "full_and_piecewise"}}
DEEPSEEK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=512)


def build(kind: str, folder: Path, tokenizer: Path):
    import transformers as tf

    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "smollm2-shaped": (tf.LlamaConfig, tf.LlamaForCausalLM),
           "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
           "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM)}[kind]
    kw = {"llama": TINY, "smollm2-shaped": SMOLLM2}.get(kind, DEEPSEEK)
    torch.manual_seed(0)
    model = cls[1](cls[0](**kw, bos_token_id=1, eos_token_id=2, pad_token_id=2)).eval()
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / f, folder / f)
    return model


def hf_greedy(model, prompt, n, device):
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_speculation(folder: Path, device: str, prompts: list[list[int]], refs: list[list[int]]) -> int:
    """Self-drafting in every graph mode; returns the number of failures."""
    failures = 0
    for name, kw in MODES.items():
        try:
            llm = LLM(model=str(folder), device=device, dtype="float32", max_model_len=512, max_num_seqs=64,
                      kv_cache_memory=2 << 30, speculative_config={"method": "draft_model", "model": str(folder),
                                                                   "num_speculative_tokens": 3}, **kw)
            outs = llm.generate([{"prompt_token_ids": q} for q in prompts],
                                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        except Exception as e:
            print(f"{'spec llama':15s} {name:9s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            failures += 1
            continue
        same = sum(o.outputs[0].token_ids == r for o, r in zip(outs, refs))
        stats = llm.engine.scheduler.spec_stats
        drafter_graphs = llm.engine.runner.drafter.graphs
        replays = drafter_graphs.replays if drafter_graphs is not None else 0
        ok = same == len(prompts) and stats.num_accepted_tokens == stats.num_draft_tokens > 0
        failures += not ok
        print(f"{'spec llama':15s} {name:9s} greedy tokens equal to transformers: {same}/{len(prompts)}; drafts "
              f"accepted {stats.num_accepted_tokens}/{stats.num_draft_tokens}; drafter graph replays: {replays}")
    return failures


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokenizer", type=Path, required=True)
    args = p.parse_args()
    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    root = Path(tempfile.mkdtemp())
    failures = 0
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 33, 70)]
    for kind in ("llama", "deepseek_v2", "deepseek_v3", "smollm2-shaped"):
        folder = root / kind
        hf = build(kind, folder, args.tokenizer).to(args.device)
        with torch.no_grad():
            refs = [hf_greedy(hf, q, 24, args.device) for q in prompts]
        engines = {}
        for name, kw in MODES.items():
            try:
                # 128-token chunks and capture sizes up to 128: prefill chunks and mixed steps replay
                # pieces too (FULL sizes stop at max_num_seqs).
                llm = LLM(model=str(folder), device=args.device, dtype="float32", max_num_batched_tokens=128,
                          max_model_len=512, max_num_seqs=64, kv_cache_memory=2 << 30,
                          graph_capture_sizes=None if "enforce_eager" in kw else default_capture_sizes(128), **kw)
                outs = llm.generate([{"prompt_token_ids": q} for q in prompts],
                                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            except Exception as e:  # report and go on: one failing mode should not hide the others
                failures += 1
                print(f"{kind:15s} {name:9s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            engines[name] = llm
            same = sum(o.outputs[0].token_ids == r for o, r in zip(outs, refs))
            whole = llm.engine.scheduler.block_pool.is_whole()
            replays = llm.engine.runner.graphs.num_replays if llm.engine.runner.graphs else 0
            failures += same != len(prompts) or not whole
            print(f"{kind:15s} {name:9s} greedy tokens equal to transformers: {same}/{len(prompts)}; "
                  f"block pool whole: {whole}; graph replays: {replays}")
        if kind == "llama":
            failures += check_speculation(folder, args.device, prompts, refs)
        if kind == "smollm2-shaped" and "eager" in engines:
            for batch in (1, 8, 64):
                try:
                    ms = {n: decode_step_ms(llm, batch, 128, 20) for n, llm in engines.items()}
                except Exception as e:
                    failures += 1
                    print(f"  decode step, batch {batch:2d}: FAILED: {type(e).__name__}: {e}")
                    continue
                cols = ", ".join(f"{n} {t:.2f} ms" for n, t in ms.items())
                ratios = ", ".join(f"eager/{n} {ms['eager'] / t:.2f}x" for n, t in ms.items() if n != "eager")
                print(f"  decode step, batch {batch:2d}, context 128: {cols} ({ratios})")
        del engines, hf
    print("FAIL" if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
