"""`mrv2 bench decode`: decode step time with and without the graph path, side by side.

Two engines over the same model, one with `enforce_eager` and one with FULL decode
graphs captured at the measured batch sizes, each timing the median of `--steps`
decode steps at batch 1, 8 and 64 (by default) after a prefill of `--context` tokens.
On the CPU the graph backend re-runs the callable eagerly (torch.compile measured
slower than eager here), so this measures what the graph path costs there: padding
and attention sized for max_model_len. On CUDA it measures CUDA-graph replay.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)


def decode_step_ms(llm, batch: int, context: int, steps: int) -> float:
    """Median wall time of one decode step at `batch` requests of `context` prompt tokens."""
    engine = llm.engine
    from mrv2 import SamplingParams

    rng = np.random.default_rng(0)
    vocab = engine.runner.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for _ in range(batch):
        prompt = rng.integers(3, min(vocab, 30000), context).tolist()
        engine.add_request(engine.make_request({"prompt_token_ids": prompt}, params))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()  # prefill, not timed
    engine.step()  # one warm-up decode
    samples = []
    for _ in range(steps):
        engine.platform.synchronize()
        t0 = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * float(np.median(samples))


def run(args: argparse.Namespace) -> int:
    from mrv2 import LLM
    from mrv2.entrypoints.cli import engine_kwargs

    sizes = [int(s) for s in args.batch_sizes.split(",")]
    kwargs = engine_kwargs(args)
    kwargs.update(max_num_seqs=max(sizes), max_model_len=kwargs["max_model_len"] or args.context + args.steps + 16,
                  enforce_eager=False)
    eager = LLM(**kwargs | {"enforce_eager": True})
    graphed = LLM(**kwargs | {"graph_mode": "full", "graph_capture_sizes": sizes})
    print(f"device {eager.engine.platform.name}, {eager.engine.dtype}, context {args.context}, "
          f"max_model_len {kwargs['max_model_len']}, median of {args.steps} decode steps")
    for b in sizes:
        e, g = decode_step_ms(eager, b, args.context, args.steps), decode_step_ms(graphed, b, args.context, args.steps)
        print(f"batch {b:3d}: eager {e:8.2f} ms   graph path {g:8.2f} ms   graph/eager {g / e:.2f}x")
    return 0
