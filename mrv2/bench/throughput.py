"""`mrv2 bench throughput`: N prompts x M output tokens, optionally against a baseline.

Prompts are random token ids of a fixed length (seeded), generation is greedy with
`ignore_eos`, so every engine does exactly the same work. Each batch size of
`--batch-sizes` is one workload (all its prompts submitted at once).

- `--compare hf`: the same workload through transformers `generate` (fp32, one
  batch without padding) in the same process; the ratio of output throughputs.
- `--compare async`: two engines, async scheduling on and off, timed in turn (the
  order alternates every repeat) on each workload; the ratio is the median of the
  per-pair ratios. Each side also reports the share of wall time its host thread
  spent waiting for the device (serially on the CPU that is all device work; with
  async scheduling only the time blocked on sampled ids).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated batch sizes, each its own workload (default: --num-prompts)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--compare", choices=["hf", "async"], default=None,
                   help="hf: also run transformers generate; async: async scheduling on vs off")
    p.add_argument("--repeat", type=int, default=1, help="timed runs of each engine (the median is reported)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")


def _prompts(vocab_size: int, special: set[int], n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.array([t for t in range(min(vocab_size, 32000)) if t not in special])
    return [rng.choice(allowed, size=length).tolist() for _ in range(n)]


def _batch_sizes(args: argparse.Namespace) -> list[int]:
    if args.batch_sizes is None:
        return [args.num_prompts]
    try:
        sizes = [int(s) for s in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    if any(s <= 0 for s in sizes):
        raise ValueError(f"--batch-sizes must be positive, got {args.batch_sizes!r}")
    return sizes


def _timed_generate(llm, inputs, params) -> tuple[float, float, list]:
    """(seconds, host wait share, outputs) of one generate call."""
    timing = llm.engine.runner.timing
    timing.reset()
    t0 = time.perf_counter()
    outputs = llm.generate(inputs, params)
    seconds = time.perf_counter() - t0
    return seconds, timing.wait_share(seconds), outputs


def run(args: argparse.Namespace) -> int:
    import torch

    from mrv2 import LLM, SamplingParams
    from mrv2.engine.arg_utils import engine_kwargs

    sizes = _batch_sizes(args)
    kwargs = engine_kwargs(args)
    if args.compare == "async":
        engines = {"async": LLM(**kwargs | {"async_scheduling": True}),
                   "serial": LLM(**kwargs | {"async_scheduling": False})}
    else:
        llm = LLM(**kwargs)
        engines = {"async" if llm.engine.config.async_scheduling else "serial": llm}
    first = next(iter(engines.values()))
    engine = first.engine
    tokenizer = first.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print(f"workload: batch {', '.join(map(str, sizes))} x {args.input_len} input tokens -> {args.output_len} "
          f"output tokens, greedy, {engine.dtype}, {torch.get_num_threads()} threads, device {engine.platform.name}, "
          f"median of {args.repeat}")

    results: dict[str, dict] = {}
    for b in sizes:
        prompts = _prompts(engine.runner.model.config.vocab_size, set(tokenizer.all_special_ids), b,
                           args.input_len, args.seed)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        total_out = b * args.output_len
        for llm in engines.values():  # warm-up
            llm.generate(inputs[: min(4, b)], SamplingParams(temperature=0.0, max_tokens=4))
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
        outputs = {}
        for rep in range(args.repeat):
            order = list(engines) if rep % 2 == 0 else list(reversed(engines))
            for name in order:
                seconds, wait, outputs[name] = _timed_generate(engines[name], inputs, params)
                runs[name].append((seconds, wait))
        result: dict = {}
        for name, samples in runs.items():
            t = float(np.median([s for s, _ in samples]))
            result[name] = {"seconds": t, "output_tok_s": total_out / t,
                            "host_wait_share": float(np.median([w for _, w in samples]))}
            print(f"batch {b:3d} mrv2 {name:6s}: {total_out / t:8.1f} output tok/s  total {t:6.2f} s  "
                  f"host waits for the device {100 * result[name]['host_wait_share']:5.1f}% of the time")
        if args.compare == "async":
            ratio = float(np.median([s / a for (a, _), (s, _) in zip(runs["async"], runs["serial"])]))
            same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids
                       for x, y in zip(outputs["async"], outputs["serial"]))
            result["ratio_async_over_serial"] = ratio
            result["identical_completions"] = same
            print(f"batch {b:3d} ratio async/serial throughput: {ratio:.3f}x (median of {args.repeat} pairs; "
                  f"identical greedy completions: {same}/{b})")
        if args.compare == "hf":
            result |= _compare_hf(engine.model_path, prompts, outputs[next(iter(engines))], args, total_out,
                                  result[next(iter(engines))]["seconds"])
        results[str(b)] = result
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _compare_hf(model_path, prompts, outputs, args: argparse.Namespace, total_out: int, mrv2_seconds: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # an async engine leaves this thread one
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
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
    print(f"hf:   {total_out / th:8.1f} output tok/s  total {th:6.2f} s")
    print(f"ratio mrv2/hf: {th / mrv2_seconds:.2f}x  (identical greedy completions: {same}/{len(prompts)})")
    return {"hf": {"seconds": th, "output_tok_s": total_out / th}, "ratio": th / mrv2_seconds,
            "identical_completions": same}
