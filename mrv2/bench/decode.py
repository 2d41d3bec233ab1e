"""`mrv2 bench decode`: decode step time with and without the graph path, side by side.

Engines over the same model, one with `enforce_eager` and one per graph mode (FULL
decode graphs, PIECEWISE segments) captured at the measured batch sizes, each timing
the median of `--steps` decode steps at batch 1, 8 and 64 (by default) after a
prefill of `--context` tokens, interleaved per batch size.
On the CPU, FULL graphs re-run the forward eagerly, so that column is what padding and
attention sized for the key-length bucket cost; PIECEWISE pieces are torch.compile'd there, and
`piecewise-eager` runs them uncompiled, which isolates what compiling buys. On CUDA
the columns are CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


# Engine settings per timed mode (besides eager). piecewise-eager re-runs the pieces
# uncompiled where the device has no graphs: what compiling them buys.
_MODES = {"full": {"graph_mode": "full"}, "piecewise": {"graph_mode": "piecewise"},
          "piecewise-eager": {"graph_mode": "piecewise", "graph_compile": False}}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--modes", default="full,piecewise,piecewise-eager",
                   help=f"graph modes to time against eager: some of {', '.join(_MODES)}")


def decode_step_ms(llm, batch: int, context: int, steps: int) -> float:
    """Median wall time of one decode step at `batch` requests of `context` prompt tokens.

    Requests that finish prefill early decode while the others still prefill, so each
    may generate up to max_model_len; all `batch` must be running in the timed steps
    (else ValueError), and they are aborted afterwards.
    """
    engine = llm.engine
    from mrv2 import SamplingParams

    rng = np.random.default_rng(0)
    vocab = engine.runner.model.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=engine.config.max_model_len - context, ignore_eos=True)
    ids = []
    for _ in range(batch):
        prompt = rng.integers(3, min(vocab, 30000), context).tolist()
        request = engine.make_request({"prompt_token_ids": prompt}, params)
        engine.add_request(request)
        ids.append(request.req_id)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()  # prefill, not timed
    engine.step()  # one warm-up decode
    samples = []
    for _ in range(steps):
        if len(engine.scheduler.running) != batch:
            engine.abort(ids)
            raise ValueError(f"only {len(engine.scheduler.running)} of {batch} requests are running: "
                             f"raise max_model_len, the KV cache size or max_num_batched_tokens")
        engine.platform.synchronize()
        t0 = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - t0)
    engine.abort(ids)
    return 1e3 * float(np.median(samples))


def run(args: argparse.Namespace) -> int:
    from mrv2 import LLM
    from mrv2.engine.arg_utils import engine_kwargs

    sizes = [int(s) for s in args.batch_sizes.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in _MODES for m in modes):
        raise ValueError(f"--modes must list some of {', '.join(_MODES)}, got {args.modes!r}")
    kwargs = engine_kwargs(args)
    # Room for the prefill steps (decodes of early requests share their budget) and the timed steps.
    b = max(sizes)
    prefill = -(-b * args.context // max(args.max_num_batched_tokens - b, 1)) + 1
    kwargs.update(max_num_seqs=b, max_model_len=kwargs["max_model_len"] or args.context + prefill + args.steps + 16,
                  enforce_eager=False)
    # Decode steps have as many tokens as requests, so one list serves both modes.
    engines = {"eager": LLM(**kwargs | {"enforce_eager": True})}
    for mode in modes:
        engines[mode] = LLM(**kwargs | _MODES[mode] | {"graph_capture_sizes": sizes})
    print(f"device {engines['eager'].engine.platform.name}, {engines['eager'].engine.dtype}, context {args.context}, "
          f"max_model_len {kwargs['max_model_len']}, median of {args.steps} decode steps")
    for b in sizes:
        ms = {name: decode_step_ms(llm, b, args.context, args.steps) for name, llm in engines.items()}
        cols = "   ".join(f"{name} {t:8.2f} ms" for name, t in ms.items())
        ratios = "   ".join(f"{m}/eager {ms[m] / ms['eager']:.2f}x" for m in modes)
        print(f"batch {b:3d}: {cols}   {ratios}")
    return 0
