"""The block GEMV of a git revision against the working tree's, in one process (alternating rounds).

Both versions of `mrv2/platforms/cpu_kernels/gguf_gemv.cpp` are built under op namespaces of
their own; each round runs 30 layers' Q4 GEMVs of the default model's shapes (one row of bf16
x) with every layer's weights (read from memory, "stream") or one layer's 30 times (in cache,
"hot"), the two versions in turn, their order alternating. Prints the median new/old time ratio.

    python tools/gemv_ab.py [REV] [--threads N] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "mrv2/platforms/cpu_kernels"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def build(name: str, source: str, folder: Path) -> None:
    """Build `source` (gguf_gemv.cpp's text) with its ops under namespace `name`."""
    source = source.replace("TORCH_LIBRARY(mrv2_gguf,", f"TORCH_LIBRARY({name},")
    source = source.replace("TORCH_LIBRARY_IMPL(mrv2_gguf,", f"TORCH_LIBRARY_IMPL({name},")
    (folder / f"{name}.cpp").write_text(source)
    load(name=f"{name}_ext", sources=[str(folder / f"{name}.cpp")], extra_cflags=["-O3", "-fopenmp", f"-I{KERNELS}"],
         extra_ldflags=["-fopenmp"], is_python_module=False)


def q4_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nb = k // 32
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scales = torch.cat([torch.rand(n * nb) * 0.01, torch.zeros(8)]).half()
    mins = torch.cat([torch.rand(n * nb) * -0.01, torch.zeros(8)]).half()
    return codes, scales, mins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", nargs="?", default="HEAD~1")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    old = subprocess.run(["git", "show", f"{args.rev}:mrv2/platforms/cpu_kernels/gguf_gemv.cpp"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        build("gemv_old", old, Path(tmp))
        build("gemv_new", (KERNELS / "gguf_gemv.cpp").read_text(), Path(tmp))
    ops = {"old": torch.ops.gemv_old.q4_gemv, "new": torch.ops.gemv_new.q4_gemv}
    torch.manual_seed(0)
    layers = [{s: q4_weight(*shape) for s, shape in SHAPES.items()} for _ in range(30)]
    xs = {k: torch.randn(1, k).bfloat16() for k in (576, 1536)}
    for s, (_, k) in SHAPES.items():
        if not torch.equal(ops["old"](xs[k], *layers[0][s], 2, None), ops["new"](xs[k], *layers[0][s], 2, None)):
            print(f"{s}: the two versions' results differ")

    def step(op, weights) -> None:
        for w in weights:
            for s, (_, k) in SHAPES.items():
                op(xs[k], *w[s], 2, None)

    for mode, weights in (("stream", layers), ("hot", layers[:1] * 30)):
        ratios, times = [], []
        for r in range(args.rounds):
            took = {}
            for name in ("old", "new") if r % 2 else ("new", "old"):
                start = time.perf_counter()
                for _ in range(10):
                    step(ops[name], weights)
                took[name] = (time.perf_counter() - start) / 10
            ratios.append(took["new"] / took["old"])
            times.append(took["old"])
        print(f"{mode}: new/old {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
              f"old {statistics.median(times) * 1e3:.2f} ms a step's GEMVs, {args.threads} threads")


if __name__ == "__main__":
    main()
