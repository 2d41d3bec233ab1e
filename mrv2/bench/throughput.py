"""`mrv2 bench throughput`: N prompts x M output tokens, optionally against a baseline.

Prompts are random token ids of a fixed length (seeded), generation is greedy with
`ignore_eos`, so every engine does exactly the same work. Each batch size of
`--batch-sizes` is one workload (all its prompts submitted at once).

- `--compare hf,llama.cpp,vllm` (any of them): the same workload through transformers
  `generate` (fp32, one batch without padding) and through llama.cpp on the same GGUF
  with the same threads (`llama-cpp-python`, the optional `llama` extra; skipped with a
  message when it is not installed), both in this process, and through vLLM in the
  engine's dtype, in vLLM's own environment (`--vllm-python`, see `mrv2.bench.vllm_peer`;
  skipped with a message when none is named); mrv2 in a process of its own. Every engine
  stays loaded and the timed runs take turns (the order alternates every repeat), so a
  ratio is the median of per-pair ratios of runs seconds apart. A table of output tok/s and
  mrv2's ratio over each engine per batch size, and with `--plot` a PNG of the same.
- `--compare async`: two engines, async scheduling on and off, each in a process of
  its own (in one process their thread pools would contend for the cores), timed in
  turn (the order alternates every repeat) on each workload; the ratio is the median
  of the per-pair ratios. Each side also reports the share of wall time its host thread
  spent waiting for the device (serially on the CPU that is all device work; with
  async scheduling only the time blocked on sampled ids).
- `--compare tp`: the same, between `--tensor-parallel-size N` (2 when not given) and one
  rank, with the same engine options otherwise.
- `--compare attention`: the same, between the CPU's attention backends that read KV blocks in place
  for decode: `cpp-paged` (mrv2's C++ kernel, the default) and `inductor-paged` (compiled by Inductor).
- `--compare graphs`: the same, between the engine's graph settings (by default on the CPU,
  compiled pieces for the steps that run int4 weights) and `enforce_eager=True`.
- `--structured json`: one engine, every request once unconstrained and once constrained to
  a JSON schema long enough to stay open for the whole output (structured output's
  grammar masks on every step), in turn; the ratio is the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _tp_pair(kwargs: dict) -> list[tuple[str, dict]]:
    n = max(kwargs.get("tensor_parallel_size") or 1, 2)
    return [(f"tp{n}", {"tensor_parallel_size": n}), ("tp1", {"tensor_parallel_size": 1})]


# --structured json: an object whose array needs more items than any output holds, so the grammar constrains
# every token of the run (a schema that closes early would leave only EOS masks afterwards).
BENCH_SCHEMA = {"type": "object", "required": ["items"], "additionalProperties": False,
                "properties": {"items": {"type": "array", "minItems": 1000,
                                         "items": {"type": "object", "required": ["id", "name"],
                                                   "additionalProperties": False,
                                                   "properties": {"id": {"type": "integer"},
                                                                  "name": {"type": "string", "maxLength": 16}}}}}}

# mrv2 against itself with one option changed: (name, options) of the two engines, the first the ratio's numerator.
SELF_PAIRS = {"async": lambda kwargs: [("async", {"async_scheduling": True}), ("serial", {"async_scheduling": False})],
              "tp": _tp_pair,
              # decode attention in place: mrv2's C++ kernel (the CPU's default) vs Inductor's
              "attention": lambda kwargs: [("cpp-paged", {"attention_backend": "cpp-paged"}),
                                           ("inductor-paged", {"attention_backend": "inductor-paged"})],
              "graphs": lambda kwargs: [("graphs", {}), ("eager", {"enforce_eager": True})]}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated batch sizes, each its own workload (default: --num-prompts)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--compare", default=None,
                   help="comma-separated: hf (transformers generate), llama.cpp (llama-cpp-python on the same GGUF), "
                        "vllm (vLLM in the environment --vllm-python names); "
                        "or async alone (async scheduling on vs off), tp alone (--tensor-parallel-size vs 1), "
                        "attention alone (decode attention in place vs gathered), or graphs alone (graph settings "
                        "vs eager)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs of each engine (the median is reported)")
    p.add_argument("--structured", choices=["json"], default=None,
                   help="time every workload unconstrained and constrained to a JSON schema, side by side")
    p.add_argument("--vllm-python", default=None,
                   help="--compare vllm: the python of vLLM's own environment (default: $MRV2_VLLM_PYTHON)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--plot", default=None, help="also draw output tok/s against batch size per engine to this PNG")


PEERS = ("hf", "llama.cpp", "vllm")


def _compared(args: argparse.Namespace) -> list[str]:
    """The engines of `--compare`, validated."""
    if not args.compare:
        return []
    names = [c.strip() for c in args.compare.split(",")]
    unknown = [c for c in names if c not in (*PEERS, *SELF_PAIRS)]
    if unknown:
        raise ValueError(f"--compare: unknown engine {unknown[0]!r}; choose from {', '.join((*PEERS, *SELF_PAIRS))}")
    if any(n in SELF_PAIRS for n in names) and len(names) > 1:
        raise ValueError(f"--compare {names[0] if names[0] in SELF_PAIRS else names[1]} compares mrv2 with "
                         f"itself; it does not combine with other engines")
    return names


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


def run(args: argparse.Namespace) -> int:
    from mrv2 import LLM
    from mrv2.bench.engines import IsolatedEngine, LocalEngine
    from mrv2.engine.arg_utils import engine_kwargs

    sizes = _batch_sizes(args)
    compare = _compared(args)
    if "vllm" in compare:
        from mrv2.bench.vllm_peer import find_python

        find_python(args.vllm_python)  # a bad path fails before any engine loads
    kwargs = engine_kwargs(args)
    if compare and compare[0] in SELF_PAIRS:
        engines = {name: IsolatedEngine(kwargs | options) for name, options in SELF_PAIRS[compare[0]](kwargs)}
    elif args.structured:
        if compare:
            raise ValueError("--structured compares mrv2 with itself; drop --compare")
        from mrv2.bench.engines import ConstrainedEngine
        from mrv2.sampling_params import StructuredOutputsParams

        plain = LocalEngine(LLM(**kwargs))
        engines = {"structured": ConstrainedEngine(plain, StructuredOutputsParams(json=BENCH_SCHEMA)),
                   "unconstrained": plain}
    elif compare:
        # The peers run in this process; mrv2 in its own, so that their thread pools never meet
        # (an engine's OpenMP team beside transformers' measured 30.9 instead of 47.9 tok/s at batch 1).
        engines = {"mrv2": IsolatedEngine(kwargs)}
    else:
        engines = {"mrv2": LocalEngine(LLM(**kwargs))}
    try:
        return _measure(args, sizes, compare, engines)
    finally:
        for engine in engines.values():
            engine.close()


def _measure(args: argparse.Namespace, sizes: list[int], compare: list[str], engines: dict) -> int:
    """Time `engines` (and the peers of `compare`) on each batch size; print, and write JSON / plot."""
    from mrv2 import SamplingParams
    from mrv2.bench import report

    info = next(iter(engines.values())).info
    threads = info.threads
    peers = {"hf": HfPeer(info.model_path, threads) if "hf" in compare else None,
             "llama.cpp": _llama_cpp_peer(args, threads) if "llama.cpp" in compare else None,
             "vllm": _vllm_peer(args, info) if "vllm" in compare else None}
    peers = {name: peer for name, peer in peers.items() if peer is not None}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    workload = (f"batch {', '.join(map(str, sizes))} x {args.input_len} input tokens -> {args.output_len} "
                f"output tokens, greedy, {info.dtype}, {threads} threads, device {info.device}, "
                f"median of {args.repeat}")
    print(f"workload: {workload}")

    results: dict[str, dict] = {}
    for b in sizes:
        prompts = _prompts(info.vocab_size, info.special_ids, b, args.input_len, args.seed)
        total_out = b * args.output_len
        for engine in engines.values():  # warm-up
            engine.timed_generate(prompts[: min(4, b)], SamplingParams(temperature=0.0, max_tokens=4))
        for peer in peers.values():
            peer.generate(prompts[: min(4, b)], 4)
        runs = {name: [] for name in engines}
        peer_runs: dict[str, list[tuple[float, list[list[int]]]]] = {name: [] for name in peers}
        for rep in range(args.repeat):  # every engine in turn, the order alternating
            order = [*engines, *peers] if rep % 2 == 0 else [*reversed(peers), *reversed(engines)]
            for name in order:
                if name in engines:
                    runs[name].append(engines[name].timed_generate(prompts, params))
                else:
                    peer_runs[name].append(peers[name].generate(prompts, args.output_len))
        result: dict = {}
        for name, samples in runs.items():
            t = float(np.median([r.seconds for r in samples]))
            result[name] = {"seconds": t, "output_tok_s": total_out / t,
                            "host_wait_share": float(np.median([r.host_wait_share for r in samples])),
                            "async_scheduling": engines[name].info.async_scheduling}
            print(f"batch {b:3d} {name:9s}: {total_out / t:8.1f} output tok/s  total {t:6.2f} s  "
                  f"host waits for the device {100 * result[name]['host_wait_share']:5.1f}% of the time")
        if len(engines) == 2:  # mrv2 against itself, one option changed
            first, second = engines
            pair_ratios = [s.seconds / a.seconds for a, s in zip(runs[first], runs[second])]
            ratio = float(np.median(pair_ratios))
            same = sum(x == y for x, y in zip(runs[first][-1].token_ids, runs[second][-1].token_ids))
            result[f"ratio_{first}_over_{second}"] = ratio
            result["pair_ratios"] = pair_ratios
            result["identical_completions"] = same
            where = "each engine in its own process; " if compare else ""
            print(f"batch {b:3d} ratio {first}/{second} throughput: {ratio:.3f}x (median of {args.repeat} pairs, "
                  f"{where}identical greedy completions: {same}/{b})")
        ours = runs["mrv2"][-1].token_ids if "mrv2" in runs else []
        for name, samples in peer_runs.items():
            t = float(np.median([s for s, _ in samples]))
            pair_ratios = [s / r.seconds for (s, _), r in zip(samples, runs["mrv2"])]
            peer_result = result[name] = {
                "seconds": t, "output_tok_s": total_out / t, "pair_ratios": pair_ratios,
                "ratio_mrv2_over_peer": float(np.median(pair_ratios)),
                "identical_completions": sum(a == p for a, p in zip(ours, samples[-1][1]))}
            print(f"batch {b:3d} {name:9s}: {peer_result['output_tok_s']:8.1f} output tok/s  total "
                  f"{t:6.2f} s  ratio mrv2/{name}: {peer_result['ratio_mrv2_over_peer']:.2f}x (median of "
                  f"{len(pair_ratios)} pairs; {min(pair_ratios):.2f}-{max(pair_ratios):.2f})  (identical greedy "
                  f"completions: {peer_result['identical_completions']}/{b})")
        results[str(b)] = result
    for peer in peers.values():
        peer.close()
    if len(engines) + len(peers) > 1:
        print()
        print(report.table(results, "mrv2" if "mrv2" in engines else next(iter(engines))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": workload, "results": results}, f, indent=2)
    if args.plot:
        report.plot(results, args.plot, f"mrv2 bench throughput: {workload}")
        print(f"plot written to {args.plot}")
    return 0


def _llama_cpp_peer(args: argparse.Namespace, threads: int):
    """The llama.cpp peer on the model's GGUF, or None (with the reason printed) when it cannot run."""
    from mrv2.bench import llama_cpp
    from mrv2.loader.resolve import gguf_source

    if not llama_cpp.available():
        print(llama_cpp.MISSING)
        return None
    gguf = gguf_source(args.model)
    if gguf is None:
        print(f"llama.cpp comparison skipped: {args.model} is an HF checkpoint folder; llama.cpp needs a .gguf file")
        return None
    print(f"llama.cpp: {gguf.name}, {threads} threads (llama-cpp-python)")
    return llama_cpp.LlamaCppPeer(gguf, threads)


def _vllm_peer(args: argparse.Namespace, info):
    """The vLLM peer on the engine's checkpoint folder and dtype, or None (with the reason printed)."""
    from mrv2.bench import vllm_peer

    python = vllm_peer.find_python(args.vllm_python)
    if python is None:
        print(vllm_peer.MISSING)
        return None
    max_model_len = max(256, args.input_len + args.output_len + 16)
    dtype = str(info.dtype).removeprefix("torch.")  # vLLM names dtypes as strings
    print(f"vllm: {python}, {info.model_path}, {dtype}, {info.threads} threads")
    return vllm_peer.VllmPeer(python, info.model_path, dtype, info.threads, max_model_len)


class HfPeer:
    """transformers `generate` in fp32 (one batch, no padding): the reference engine as a peer."""

    def __init__(self, model_path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.threads = threads
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        """(seconds, greedy output ids per prompt)."""
        torch = self._torch
        torch.set_num_threads(self.threads)  # an async engine leaves this (the host) thread one
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                      min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            seconds = time.perf_counter() - t0
        return seconds, out[:, ids.shape[1]:].tolist()

    def close(self) -> None:
        """Drop the model."""
        self.model = None
