"""`mrv2 bench soak`: many short requests with random aborts; memory and blocks at start and end.

`--requests` requests arrive as earlier ones end, at most `--concurrency` at a time,
each a short prompt (half of them open with one of a few shared prefixes, so the
prefix cache fills, hits and evicts), a random output length, greedy or seeded
sampling, sometimes n = 2; `--abort-fraction` of them are aborted a random number of
steps after they arrive. Resident memory is sampled after a warm-up of
`--warmup` requests (allocator pools and caches filled) and then every tenth of the
run. At the end every request must have ended exactly once and every KV block, cache
reference and slot must be back; the command fails otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=32, help="requests in the engine at most")
    p.add_argument("--prompt-len", default="4,48", help="min,max prompt tokens")
    p.add_argument("--output-len", default="1,16", help="min,max output tokens")
    p.add_argument("--abort-fraction", type=float, default=0.2)
    p.add_argument("--warmup", type=int, default=200, help="requests before the start sample of resident memory")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this JSON file")


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _range(text: str, name: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--{name} must be 'min,max', got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--{name} needs 1 <= min <= max, got {text!r}")
    return lo, hi


class _Workload:
    """The stream of requests: prompts, sampling parameters and abort times, from one seed."""

    def __init__(self, args: argparse.Namespace, prompt_len: tuple[int, int], output_len: tuple[int, int],
                 vocab: int) -> None:
        self.rng = np.random.default_rng(args.bench_seed)
        self.prompt_len, self.output_len = prompt_len, output_len
        self.abort_fraction = args.abort_fraction
        self.vocab = min(vocab, 30000)
        self.prefixes = [self.rng.integers(100, self.vocab, n).tolist() for n in (16, 32, 48)]

    def next(self, seed: int):
        from mrv2 import SamplingParams
        from mrv2.sampling_params import RequestOutputKind

        rng = self.rng
        prompt = rng.integers(100, self.vocab, int(rng.integers(self.prompt_len[0], self.prompt_len[1] + 1))).tolist()
        if rng.random() < 0.5:
            prompt = self.prefixes[int(rng.integers(len(self.prefixes)))] + prompt
        greedy = rng.random() < 0.5
        params = SamplingParams(n=2 if rng.random() < 0.1 else 1, temperature=0.0 if greedy else 0.8,
                                seed=None if greedy else seed, ignore_eos=True,
                                max_tokens=int(rng.integers(self.output_len[0], self.output_len[1] + 1)),
                                output_kind=RequestOutputKind.FINAL_ONLY)
        abort_after = int(rng.integers(0, 12)) if rng.random() < self.abort_fraction else None
        return prompt, params, abort_after


def run(args: argparse.Namespace) -> int:
    from mrv2 import LLM
    from mrv2.engine.arg_utils import engine_kwargs

    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.warmup < args.requests \
            or not 0 <= args.abort_fraction <= 1:
        raise ValueError("--requests and --concurrency must be positive, 0 <= --warmup < --requests, "
                         "--abort-fraction in [0, 1]")
    prompt_len, output_len = _range(args.prompt_len, "prompt-len"), _range(args.output_len, "output-len")
    llm = LLM(**engine_kwargs(args))
    engine = llm.engine
    work = _Workload(args, prompt_len, output_len, engine.runner.model.config.vocab_size)
    pool = engine.scheduler.block_pool
    live: dict[str, int | None] = {}  # request id -> step at which to abort it (None: runs to the end)
    ended: dict[str, int] = {}
    aborted, started, step = 0, 0, 0
    samples: list[tuple[int, int]] = []  # (requests started, resident bytes)
    every = max(1, (args.requests - args.warmup) // 10)
    t0 = time.perf_counter()
    tokens = 0
    while started < args.requests or live:
        while started < args.requests and len(live) < args.concurrency:
            if started == args.warmup or (started > args.warmup and (started - args.warmup) % every == 0):
                samples.append((started, resident_bytes()))
            prompt, params, abort_after = work.next(seed=started)
            request = engine.make_request({"prompt_token_ids": prompt}, params)
            engine.add_request(request)
            live[request.req_id] = None if abort_after is None else step + abort_after
            started += 1
        due = [rid for rid, at in live.items() if at is not None and at <= step]
        if due:
            engine.abort(due)
            for rid in due:
                ended[rid] = ended.get(rid, 0) + 1
                del live[rid]
            aborted += len(due)
        for out in engine.step():
            if out.finished:
                ended[out.request_id] = ended.get(out.request_id, 0) + 1
                tokens += sum(len(c.token_ids) for c in out.outputs)
                live.pop(out.request_id, None)
        step += 1
    while engine.has_unfinished_requests():  # launched steps of aborted requests drain
        engine.step()
    engine.step()  # the runner releases the last slots
    seconds = time.perf_counter() - t0
    samples.append((started, resident_bytes()))
    start_rss, end_rss = samples[0][1], samples[-1][1]
    free, usable = pool.num_free_blocks, pool.num_usable_blocks
    problems = []
    if len(ended) != args.requests or any(c != 1 for c in ended.values()):
        problems.append(f"{len(ended)} of {args.requests} requests ended, "
                        f"{sum(c != 1 for c in ended.values())} more than once")
    if not pool.is_whole() or any(c != 0 for c in pool.ref_cnt[1:]):
        problems.append(f"{usable - free} KV blocks not back")
    if engine.runner.states.num_free_slots != engine.runner.max_num_reqs or engine.scheduler.requests:
        problems.append("request slots or scheduler records left behind")
    kv = engine.scheduler.kv_cache_manager
    hit_rate = kv.num_hit_tokens / max(kv.num_queried_tokens, 1)
    mib = 2 ** 20
    print(f"soak: {args.requests} requests ({aborted} aborted) in {seconds:.1f} s, {tokens} output tokens, "
          f"{engine.scheduler.num_preemptions} preemptions, prefix-cache hit rate {100 * hit_rate:.1f}%, "
          f"{str(engine.dtype).removeprefix('torch.')}")
    print("resident memory (MiB) after " + ", ".join(f"{n}: {b / mib:.1f}" for n, b in samples))
    print(f"resident memory start {start_rss / mib:.1f} MiB -> end {end_rss / mib:.1f} MiB "
          f"({(end_rss - start_rss) / mib:+.1f} MiB); KV blocks free at the end: {free} of {usable}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": args.requests, "aborted": aborted, "seconds": seconds, "output_tokens": tokens,
                       "rss_samples": samples, "rss_start": start_rss, "rss_end": end_rss, "blocks_free": free,
                       "blocks_usable": usable, "preemptions": engine.scheduler.num_preemptions,
                       "prefix_hit_rate": hit_rate, "problems": problems}, f, indent=2)
    for p in problems:
        print(f"FAILED: {p}")
    return 1 if problems else 0
