"""`mrv2 bench serve`: load an OpenAI-compatible server and measure what its clients see.

Requests go through the official `openai` client as streamed completions (so every
token's arrival is timed) at a fixed concurrency or arriving at a Poisson rate, with
random token-id prompts of `--input-len` (seeded) or the prompts of a file, each
generating exactly `--output-len` tokens (`ignore_eos`). Per load level it reports
request throughput, output tok/s and TTFT / TPOT / ITL percentiles, writes them as
JSON and draws latency against load (PNG). Without `--url` it starts `mrv2 serve`
with the engine options given, on a free loopback port, and stops it afterwards.

`--pd` measures prefill/decode disaggregation side by side: the same load against one
instance, then against a prefill instance and a decode instance (ShmConnector, the same
engine options each) behind `mrv2 proxy`, with the ratios of throughput and TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="a running server (default: start `mrv2 serve` with the engine options)")
    p.add_argument("--api-key", default="none")
    p.add_argument("--served-model", default=None, help="the model name to send (default: the server's first)")
    p.add_argument("--concurrency", default="1,8,32",
                   help="comma-separated load levels: requests in flight at once (one run each)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests/s arriving as a Poisson process instead (still capped by the concurrency)")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per load level (default: 4 x concurrency, "
                                                                  "at least 8)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dataset", default=None, help="a file with one prompt a line (text) instead of random tokens")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot", default=None, help="write a PNG of latency against load here")
    p.add_argument("--pd", action="store_true",
                   help="also run prefill + decode instances behind `mrv2 proxy` and compare with one instance")


@dataclass
class RequestResult:
    """What one client saw: when tokens arrived, and how many there were."""

    start: float
    token_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.start


# Random prompt ids stay below this: every supported tokenizer has at least 32000 tokens.
_RANDOM_ID_LIMIT = 32000


def _prompts(args: argparse.Namespace, n: int) -> list[Any]:
    if args.dataset:
        with open(args.dataset, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise ValueError(f"--dataset {args.dataset}: no prompts")
        return [lines[i % len(lines)] for i in range(n)]
    rng = np.random.default_rng(args.bench_seed)
    return [rng.integers(100, _RANDOM_ID_LIMIT, args.input_len).tolist() for _ in range(n)]


async def _one(client, model: str, prompt: Any, output_len: int) -> RequestResult:
    result = RequestResult(time.perf_counter())
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=output_len, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                result.token_times.append(time.perf_counter())
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - reported per request, the run goes on
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_load(url: str, api_key: str, model: str, prompts: list[Any], output_len: int, concurrency: int,
                   request_rate: float | None, seed: int) -> tuple[list[RequestResult], float]:
    """All `prompts` through the server at this load; the results and the wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    rng = np.random.default_rng(seed)

    async def gated(prompt: Any) -> RequestResult:
        async with gate:
            return await _one(client, model, prompt, output_len)

    try:
        t0 = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(gated(prompt)))
            if request_rate is not None:
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0
    finally:
        await client.close()


def summarize(results: list[RequestResult], wall: float) -> dict[str, Any]:
    """Throughput and latency percentiles (milliseconds) of one load level."""
    ok = [r for r in results if r.error is None and r.token_times]
    ttft = [r.ttft for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]

    def pct(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        return {f"p{p}": 1e3 * float(np.percentile(values, p)) for p in PERCENTILES} | {
            "mean": 1e3 * float(np.mean(values))}

    output_tokens = sum(r.output_tokens for r in ok)
    return {"requests": len(results), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:3], "duration_s": wall,
            "request_throughput": len(ok) / wall, "output_tok_s": output_tokens / wall,
            "ttft_ms": pct(ttft), "tpot_ms": pct(tpot), "itl_ms": pct(itl)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options given to this command, as `mrv2 serve` arguments."""
    from mrv2.engine.arg_utils import engine_kwargs

    argv = []
    for key, value in engine_kwargs(args).items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):  # store_true and BooleanOptionalAction options
            argv += [flag] if value else ([] if key == "enforce_eager" else ["--no-" + flag[2:]])
        elif key == "graph_capture_sizes":
            argv += [flag, ",".join(map(str, value))]
        elif isinstance(value, dict):  # --speculative-config
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


class ServerProcess:
    """`mrv2 serve SERVE_ARGS` (or another serving `command`, such as `proxy`) in a child process on a
    free loopback port; `url` once /health answers.

    Its output (stdout and stderr) goes to a temporary file, read by `output()`.
    """

    def __init__(self, serve_args: list[str], start_timeout: float = 600.0, command: str = "serve") -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "mrv2.entrypoints.cli", command, "--port", str(self.port), *serve_args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(f"mrv2 {command} exited: {self.output()[-2000:]}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=1).status == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise ValueError(f"mrv2 {command} did not become healthy within {start_timeout:.0f} s")

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it (killed after 30 s); the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _server_model(url: str, api_key: str) -> str:
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())["data"][0]["id"]


def plot(levels: dict[str, dict[str, Any]], path: str, title: str) -> None:
    """TTFT, TPOT and ITL medians and p99 against the load level."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    loads = [int(k) for k in levels]
    for metric, style in (("ttft_ms", "o"), ("tpot_ms", "s"), ("itl_ms", "^")):
        for p, line in (("p50", "-"), ("p99", "--")):
            values = [levels[k][metric].get(p) for k in levels]
            if all(v is not None for v in values):
                ax.plot(loads, values, line, marker=style, label=f"{metric[:-3].upper()} {p}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(loads, labels=[str(x) for x in loads])
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("milliseconds")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


PD_ROLES = ("kv_producer", "kv_consumer")  # the prefill instance, then the decode one


class PDDeployment:
    """A prefill and a decode instance (ShmConnector) with the given engine options, behind `mrv2 proxy`."""

    def __init__(self, engine_argv: list[str]) -> None:
        self.servers: list[ServerProcess] = []
        try:
            for role in PD_ROLES:
                config = json.dumps({"kv_connector": "ShmConnector", "kv_role": role})
                self.servers.append(ServerProcess(engine_argv + ["--kv-transfer-config", config]))
            self.servers.append(ServerProcess(["--prefill", self.servers[0].url, "--decode", self.servers[1].url],
                                              command="proxy"))
        except BaseException:
            self.stop()
            raise
        self.url = self.servers[-1].url

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


def _measure(url: str, args: argparse.Namespace, levels: list[int], label: str) -> tuple[str, dict[str, Any]]:
    model = args.served_model or _server_model(url, args.api_key)
    results: dict[str, dict[str, Any]] = {}
    for level in levels:
        n = args.num_prompts or max(8, 4 * level)
        prompts = _prompts(args, n)
        asyncio.run(run_load(url, args.api_key, model, prompts[:min(n, level)], args.output_len, level,
                             None, args.bench_seed))  # warm-up
        requests, wall = asyncio.run(run_load(url, args.api_key, model, prompts, args.output_len, level,
                                              args.request_rate, args.bench_seed))
        summary = results[str(level)] = summarize(requests, wall)
        print(f"{label}concurrency {level:3d}: {summary['request_throughput']:.2f} req/s  "
              f"{summary['output_tok_s']:.1f} output tok/s  "
              + "  ".join(f"{m.split('_')[0].upper()} p50/p90/p99 "
                          + "/".join(f"{summary[m][f'p{p}']:.1f}" for p in PERCENTILES) + " ms"
                          for m in ("ttft_ms", "tpot_ms", "itl_ms") if summary[m])
              + (f"  FAILED {summary['failed']}: {summary['errors']}" if summary["failed"] else ""),
              flush=True)
    return model, results


def run(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must list positive integers, got {args.concurrency!r}")
    if args.pd and args.url:
        raise ValueError("--pd starts its own instances: drop --url")
    server = None if args.url else ServerProcess(_engine_argv(args))
    try:
        model, results = _measure(args.url or server.url, args, levels, "one instance " if args.pd else "")
    finally:
        if server is not None:
            server.stop()
    pd_results = None
    if args.pd:
        pd = PDDeployment(_engine_argv(args))
        try:
            _, pd_results = _measure(pd.url, args, levels, "prefill+decode ")
        finally:
            pd.stop()
        for level in map(str, levels):
            one, two = results[level], pd_results[level]
            if one["ttft_ms"] and two["ttft_ms"]:
                print(f"concurrency {level:>3}: prefill+decode / one instance: output tok/s "
                      f"{two['output_tok_s'] / one['output_tok_s']:.2f}x, TTFT p50 "
                      f"{two['ttft_ms']['p50'] / one['ttft_ms']['p50']:.2f}x", flush=True)
    setup = {"url": args.url or "local mrv2 serve", "model": model, "input_len": args.input_len,
             "output_len": args.output_len, "dataset": args.dataset, "request_rate": args.request_rate}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "levels": results} | ({"pd_levels": pd_results} if pd_results else {}),
                      f, indent=2)
    if args.plot:
        plot(results, args.plot, f"{model}: {args.input_len} -> {args.output_len} tokens")
    everything = list(results.values()) + list((pd_results or {}).values())
    return 0 if all(r["failed"] == 0 for r in everything) else 1
