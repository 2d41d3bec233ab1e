"""`mrv2 bench prefix`: a shared-prefix workload with prefix caching on and off, side by side.

`--num-requests` prompts share a `--prefix-len`-token prefix (random ids, seeded) and
each adds `--suffix-len` distinct tokens; all arrive at once and generate
`--output-len` tokens (greedy, `ignore_eos`). Each engine runs in a spawned process
of its own, the two take turns `--repeat` times, every run from an empty prefix
cache (so the first request always computes the prefix), and the medians and
pair-by-pair ratios of end-to-end throughput and time to first token are reported.
Greedy outputs must be the same either way in float32 (checked); in bf16 the count
of identical ones is reported (other batch shapes round differently).
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3, help="timed runs per engine, taken in turns")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this JSON file")


def workload(num: int, prefix_len: int, suffix_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(100, min(vocab, 30000), prefix_len).tolist()
    return [prefix + rng.integers(100, min(vocab, 30000), suffix_len).tolist() for _ in range(num)]


def summarize(runs: list, num_tokens: int) -> dict:
    ttft = [statistics.median(r.ttft) for r in runs]
    return {"output_tok_s": [num_tokens / r.seconds for r in runs], "seconds": [r.seconds for r in runs],
            "ttft_median_s": ttft, "ttft_p90_s": [float(np.percentile(r.ttft, 90)) for r in runs]}


def run(args: argparse.Namespace) -> int:
    from mrv2 import SamplingParams
    from mrv2.bench.engines import IsolatedEngine
    from mrv2.engine.arg_utils import engine_kwargs

    if min(args.num_requests, args.prefix_len, args.suffix_len, args.output_len, args.repeat) < 1:
        raise ValueError("--num-requests, --prefix-len, --suffix-len, --output-len and --repeat must be positive")
    kwargs = engine_kwargs(args)
    need = args.prefix_len + args.suffix_len + args.output_len
    kwargs["max_model_len"] = max(kwargs.get("max_model_len") or 0, need)
    engines = {}
    try:
        for name, caching in (("caching on", True), ("caching off", False)):
            engines[name] = IsolatedEngine(kwargs | {"enable_prefix_caching": caching})
        info = engines["caching on"].info
        prompts = workload(args.num_requests, args.prefix_len, args.suffix_len, info.vocab_size, args.bench_seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for engine in engines.values():  # warm-up: first-call costs out of the timed runs
            engine.timed_stream(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))
        runs: dict[str, list] = {name: [] for name in engines}
        for _ in range(args.repeat):
            for name, engine in engines.items():
                runs[name].append(engine.timed_stream(prompts, params))
    finally:
        for engine in engines.values():
            engine.close()
    same = sum(a == b for a, b in zip(runs["caching on"][0].token_ids, runs["caching off"][0].token_ids))
    if same < args.num_requests and "float32" in info.dtype:  # exact mode: any difference is a bug
        raise RuntimeError(f"greedy outputs differ with prefix caching on and off ({same}/{args.num_requests} same)")
    num_tokens = args.num_requests * args.output_len
    results = {name: summarize(r, num_tokens) for name, r in runs.items()}
    on, off = results["caching on"], results["caching off"]
    pairs = [a / b for a, b in zip(on["output_tok_s"], off["output_tok_s"])]
    ttft_pairs = [b / a for a, b in zip(on["ttft_median_s"], off["ttft_median_s"])]
    print(f"workload: {args.num_requests} requests x ({args.prefix_len} shared + {args.suffix_len} own prompt "
          f"tokens) -> {args.output_len} output tokens, greedy, {info.dtype}, {info.threads} threads, "
          f"median of {args.repeat}")
    for name, r in results.items():
        print(f"{name:12s}: {statistics.median(r['output_tok_s']):8.1f} output tok/s  "
              f"{statistics.median(r['seconds']):7.2f} s  TTFT median {1e3 * statistics.median(r['ttft_median_s']):8.1f} ms"
              f"  p90 {1e3 * statistics.median(r['ttft_p90_s']):8.1f} ms")
    print(f"caching on / off: throughput {statistics.median(pairs):.2f}x (pairs {', '.join(f'{p:.2f}' for p in pairs)}), "
          f"median TTFT {statistics.median(ttft_pairs):.2f}x faster; identical greedy outputs {same}/{args.num_requests}"
          + ("" if "float32" in info.dtype else " (bf16 rounds differently for other batch shapes)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": {k: getattr(args, k) for k in ("num_requests", "prefix_len", "suffix_len",
                                                              "output_len", "repeat")} | {"dtype": info.dtype},
                       "results": results, "throughput_ratio_pairs": pairs, "ttft_speedup_pairs": ttft_pairs,
                       "identical_outputs": same},
                      f, indent=2)
    return 0
