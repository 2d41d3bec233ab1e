"""`mrv2 bench throughput`: N prompts x M output tokens, optionally against transformers.

Prompts are random token ids of a fixed length (seeded), generation is greedy with
`ignore_eos`, so both engines do exactly the same work. With `--compare hf` the same
workload runs through transformers `generate` (fp32, one padded-free batch) in the
same process, and the ratio of output throughputs is printed.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--compare", choices=["hf"], default=None, help="also run transformers generate")
    p.add_argument("--repeat", type=int, default=1, help="timed runs of each engine (the median is reported)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")


def _prompts(vocab_size: int, special: set[int], n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.array([t for t in range(min(vocab_size, 32000)) if t not in special])
    return [rng.choice(allowed, size=length).tolist() for _ in range(n)]


def run(args: argparse.Namespace) -> int:
    import torch

    from mrv2 import LLM, SamplingParams
    from mrv2.engine.arg_utils import engine_kwargs

    llm = LLM(**engine_kwargs(args))
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    prompts = _prompts(engine.runner.model.config.vocab_size, set(tokenizer.all_special_ids),
                       args.num_prompts, args.input_len, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    total_out = args.num_prompts * args.output_len
    print(f"workload: {args.num_prompts} prompts x {args.input_len} input tokens -> {args.output_len} output "
          f"tokens, greedy, {engine.dtype}, {torch.get_num_threads()} threads, device {engine.platform.name}")

    llm.generate(inputs[: min(4, len(inputs))], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    times, prep_shares, outputs = [], [], None
    for _ in range(args.repeat):
        engine.runner.timing.reset()
        t0 = time.perf_counter()
        outputs = llm.generate(inputs, params)
        times.append(time.perf_counter() - t0)
        prep_shares.append(engine.runner.timing.prep_share())
    t = float(np.median(times))
    result = {"mrv2": {"seconds": t, "output_tok_s": total_out / t, "host_prep_share": float(np.median(prep_shares))}}
    print(f"mrv2: {total_out / t:8.1f} output tok/s  total {t:6.2f} s  host-side input preparation "
          f"{100 * result['mrv2']['host_prep_share']:.1f}% of step time")

    if args.compare == "hf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32).eval()
        ids = torch.tensor(prompts)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            model.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=4, do_sample=False)
            hf_times, hf_out = [], None
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                hf_out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len,
                                        min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
                hf_times.append(time.perf_counter() - t0)
        th = float(np.median(hf_times))
        hf_tokens = hf_out[:, args.input_len:].tolist()
        same = sum(o.outputs[0].token_ids == h for o, h in zip(outputs, hf_tokens))
        result["hf"] = {"seconds": th, "output_tok_s": total_out / th}
        result["ratio"] = th / t
        result["identical_completions"] = same
        print(f"hf:   {total_out / th:8.1f} output tok/s  total {th:6.2f} s")
        print(f"ratio mrv2/hf: {th / t:.2f}x  (identical greedy completions: {same}/{args.num_prompts})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
