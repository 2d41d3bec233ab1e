"""Float32 dense linears of the default model's shapes on each path the CPU platform may choose.

Each round runs the 30 layers' four linears (QKV 960 x 576, O 576 x 576, gate/up 3072 x 576, down
576 x 1536) and the LM head (49152 x 576), every weight its own (read from memory), at each row count:
mrv2's dense GEMV (`cpu_kernels/dense_gemv.cpp`, each instruction set the CPU runs), oneDNN on the
plain weights, oneDNN on weights packed for it, and `F.linear` (MKL). Prints the median time of each.
What `CpuPlatform.dense_gemv_policy` picks is read from such a table.

    python tools/dense_linear_bench.py [--rows 1,4,16,64] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mrv2.layers.packed import pack_weight, packed_linear
from mrv2.platforms import CpuPlatform
from mrv2.platforms.cpu import DENSE_GEMV_ISAS
from mrv2.platforms.cpu_kernels import load_cpu_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    platform = CpuPlatform()
    torch.set_num_threads(platform.compute_threads())
    isas = [isa for isa, flag in ((1, "avx2"), (2, "avx512f")) if flag in platform.flags]
    if platform.kernels_missing() is not None or load_cpu_kernels() is not None:
        isas = []
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(30) for n, k in SHAPES] + [torch.randn(49152, 576) * 0.02]
    packed = [pack_weight(w, 64) for w in weights]
    paths = {f"GEMV {DENSE_GEMV_ISAS[isa]}": (lambda isa: lambda x, i: torch.ops.mrv2.dense_gemv(x, weights[i], None, isa))(isa)
             for isa in isas}
    paths["oneDNN plain"] = lambda x, i: packed_linear(x, weights[i], None)
    paths["oneDNN packed"] = lambda x, i: packed_linear(x, packed[i], None)
    paths["F.linear"] = lambda x, i: F.linear(x, weights[i])
    print(f"{torch.get_num_threads()} threads; ms for the 120 layer weights and the LM head (medians of {args.rounds})")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        took: dict[str, list[float]] = {name: [] for name in paths}
        for r in range(args.rounds):
            for name, call in (paths.items() if r % 2 else reversed(paths.items())):
                start = time.perf_counter()
                for i, w in enumerate(weights):
                    call(xs[w.shape[1]], i)
                took[name].append((time.perf_counter() - start) * 1e3)
        print(f"{rows:5d} rows: " + ", ".join(f"{name} {statistics.median(t):.1f}" for name, t in took.items()))


if __name__ == "__main__":
    main()
