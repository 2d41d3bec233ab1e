"""`mrv2 bench latency`: time to first token and time per output token of one request at a time.

Each run submits one prompt of `--input-len` random token ids (seeded) and generates
`--output-len` tokens greedily with `ignore_eos`; the time to first token runs from
submission to the step that returns the first token, the time per output token is the
mean gap between the following ones. Medians over `--repeat` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5, help="timed runs (the median is reported)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")


def measure(llm, prompt: list[int], output_len: int) -> tuple[float, float]:
    """(seconds to the first token, mean seconds per later token) of one request."""
    from mrv2 import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    request = engine.make_request({"prompt_token_ids": prompt}, params)
    stamps: list[float] = []
    t0 = time.perf_counter()
    engine.add_request(request)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            stamps += [now] * (len(out.outputs[0].token_ids) - len(stamps))
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return stamps[0] - t0, tpot


def run(args: argparse.Namespace) -> int:
    from mrv2 import LLM
    from mrv2.engine.arg_utils import engine_kwargs

    if args.input_len < 1 or args.output_len < 2 or args.repeat < 1:
        raise ValueError("need --input-len >= 1, --output-len >= 2 and --repeat >= 1")
    llm = LLM(**engine_kwargs(args))
    engine = llm.engine
    rng = np.random.default_rng(args.seed)
    special = set(llm.get_tokenizer().all_special_ids)
    allowed = np.array([t for t in range(min(engine.runner.model.config.vocab_size, 32000)) if t not in special])
    prompts = [rng.choice(allowed, size=args.input_len).tolist() for _ in range(args.repeat + 1)]
    measure(llm, prompts[0], 4)  # warm-up
    samples = [measure(llm, p, args.output_len) for p in prompts[1:]]
    ttft = float(np.median([s[0] for s in samples]))
    tpot = float(np.median([s[1] for s in samples]))
    print(f"batch 1, {args.input_len} input -> {args.output_len} output tokens, {engine.dtype}, "
          f"async scheduling {'on' if engine.config.async_scheduling else 'off'}, median of {args.repeat}: "
          f"time to first token {1e3 * ttft:.1f} ms, time per output token {1e3 * tpot:.2f} ms "
          f"({1 / tpot:.1f} tok/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ttft_s": ttft, "tpot_s": tpot, "runs": samples}, f, indent=2)
    return 0
