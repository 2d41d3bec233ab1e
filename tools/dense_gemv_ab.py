"""The dense float32 GEMV of a git revision against the working tree's, in one process (alternating rounds).

Both versions of `mrv2/platforms/cpu_kernels/dense_gemv.cpp` are built under op namespaces of their own.
Each round runs the default model's 121 float32 weights (30 layers' QKV 960 x 576, O 576 x 576, gate/up
3072 x 576, down 576 x 1536, then the 49152 x 576 LM head) at `--rows` rows, placed as the engine places
them (one buffer from the platform's weight storage, in step order), the two versions in turn, their
order alternating. Prints the median new/old time ratio, and a plain read of the same bytes for scale.

    python tools/dense_gemv_ab.py [REV] [--rows 1] [--isa 2] [--threads N] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from dense_linear_bench import SHAPES
from kernel_versions import alternate, build, sources_at, working_sources

from mrv2.layers.weight_buffer import into_one_buffer
from mrv2.platforms import CpuPlatform
from mrv2.platforms.cpu import DENSE_GEMV_ISAS

MAIN = "dense_gemv.cpp"


def _call(op, x: torch.Tensor, w: torch.Tensor, isa: int, row_stream: bool) -> torch.Tensor:
    """`op` (either version's dense_gemv), with `row_stream` where its schema takes it."""
    if len(op.default._schema.arguments) > 4:
        return op(x, w, None, isa, row_stream)
    return op(x, w, None, isa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", nargs="?", default="HEAD")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--isa", type=int, default=None, help="1 (AVX2) or 2 (AVX-512); default: the CPU's best")
    parser.add_argument("--row-stream", action=argparse.BooleanOptionalAction, default=None,
                        help="the new version's single-row layout (default: the platform's choice)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    platform = CpuPlatform()
    policy, why = platform.dense_gemv_policy(torch.float32)
    if policy is None:
        raise SystemExit(why)
    isa = args.isa or policy.isa
    row_stream = policy.row_stream if args.row_stream is None else args.row_stream
    with tempfile.TemporaryDirectory() as tmp:
        build("dense_old", MAIN, sources_at(args.rev, MAIN), "mrv2", Path(tmp) / "old")
        build("dense_new", MAIN, working_sources(MAIN), "mrv2", Path(tmp) / "new")
    ops = {"old": torch.ops.dense_old.dense_gemv, "new": torch.ops.dense_new.dense_gemv}
    torch.manual_seed(0)
    shapes = SHAPES * 30 + [(49152, 576)]
    held: list[torch.Tensor] = []  # the buffer the weights are placed in, read whole for scale below

    def allocate(nbytes: int) -> torch.Tensor:
        held.append(platform.weight_storage(nbytes))
        return held[0]

    weights = into_one_buffer([torch.randn(n, k) * 0.02 for n, k in shapes], allocate)
    nbytes = sum(w.nbytes for w in weights)
    buffer = held[0][:held[0].numel() // 4 * 4].view(torch.float32)
    xs = {k: torch.randn(args.rows, k) for k in (576, 1536)}
    worst = 0.0
    for w in weights[:4] + weights[-1:]:
        old, new = (_call(ops[v], xs[w.shape[1]], w, isa, row_stream) for v in ("old", "new"))
        worst = max(worst, ((new - old).abs().max() / old.abs().max()).item())
    print(f"results: new - old within {worst:.2g} of the largest output (fp32 sums, maybe in another order)")

    def step(name: str) -> None:
        for w in weights:
            _call(ops[name], xs[w.shape[1]], w, isa, row_stream)

    took = alternate(step, args.rounds)
    ratios = [new / old for old, new in zip(took["old"], took["new"])]
    old, new = statistics.median(took["old"]), statistics.median(took["new"])
    reads = []
    for _ in range(args.rounds):  # the same bytes, read through torch's sum, for scale
        start = time.perf_counter()
        buffer.sum()
        reads.append(time.perf_counter() - start)
    print(f"{args.rows} row(s), {DENSE_GEMV_ISAS[isa]}, row_stream={row_stream}, {args.threads} threads: "
          f"new/old {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"old {old * 1e3:.2f} ms ({nbytes / old / 1e9:.1f} GB/s), new {new * 1e3:.2f} ms "
          f"({nbytes / new / 1e9:.1f} GB/s); torch's sum of the same bytes {nbytes / statistics.median(reads) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
