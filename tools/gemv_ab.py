"""The block GEMV of a git revision against the working tree's, in one process (alternating rounds).

Both versions of `mrv2/platforms/cpu_kernels/gguf_gemv.cpp` (each with the .inc files of its
revision) are built under op namespaces of their own; each round runs 30 layers' Q4_1 GEMVs of
the default model's shapes (one row of bf16 x, weights packed by `BlockGemv`) with every
layer's weights (read from memory, "stream") or one layer's 30 times (in cache, "hot"), and the
default model's Q8_0 LM head (49152 x 576, fp32 logits, "lm_head"), the two versions in turn,
their order alternating. Prints the median new/old time ratio of each.

    python tools/gemv_ab.py [REV] [--threads N] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from kernel_versions import alternate, build, sources_at, working_sources

from mrv2.layers.quantization import BlockGemv, QuantizedWeight
from mrv2.platforms import CpuPlatform
from mrv2.platforms.cpu import GEMV_ISAS

MAIN = "gguf_gemv.cpp"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def q4_weight(n: int, k: int, isa: int) -> BlockGemv:
    """A random Q4_1 [n, k] weight in the block GEMV's layout."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = (torch.rand(n, k // 32) * 0.01).half()
    mins = (torch.rand(n, k // 32) * -0.01).half()
    return BlockGemv(QuantizedWeight("Q4_1", codes, scales, mins), isa)


def q8_weight(n: int, k: int, isa: int) -> BlockGemv:
    """A random Q8_0 [n, k] weight in the block GEMV's layout."""
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return BlockGemv(QuantizedWeight("Q8_0", codes, (torch.rand(n, k // 32) * 0.01).half()), isa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", nargs="?", default="HEAD~1")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isa = CpuPlatform().gemv_isa()
    if not isa:
        raise SystemExit("this CPU has no block GEMV (it needs AVX2, FMA and F16C)")
    with tempfile.TemporaryDirectory() as tmp:
        build("gemv_old", MAIN, sources_at(args.rev, MAIN), "mrv2_gguf", Path(tmp) / "old")
        build("gemv_new", MAIN, working_sources(MAIN), "mrv2_gguf", Path(tmp) / "new")
    ops = {"old": torch.ops.gemv_old.q4_gemv, "new": torch.ops.gemv_new.q4_gemv}
    head_ops = {"old": torch.ops.gemv_old.q8_gemv, "new": torch.ops.gemv_new.q8_gemv}
    torch.manual_seed(0)
    layers = [{s: q4_weight(*shape, isa) for s, shape in SHAPES.items()} for _ in range(30)]
    head = q8_weight(49152, 576, isa)
    xs = {k: torch.randn(1, k).bfloat16() for k in (576, 1536)}

    def gemv(op, x: torch.Tensor, w: BlockGemv) -> torch.Tensor:
        return op(x, w.codes, w.scales, w.mins, isa, None)

    for s, (_, k) in SHAPES.items():
        w = layers[0][s]
        old, new = (ops[v](xs[k], w.codes, w.scales, w.mins, isa, torch.float32) for v in ("old", "new"))
        if not torch.equal(old, new):
            diff = ((new - old).abs().max() / old.abs().max()).item()
            print(f"{s}: the two versions' results differ, by up to {diff:.2g} of the largest (fp32) output")
    old, new = (head_ops[v](xs[576], head.codes, head.scales, isa, torch.float32) for v in ("old", "new"))
    if not torch.equal(old, new):
        diff = ((new - old).abs().max() / old.abs().max()).item()
        print(f"lm_head: the two versions' results differ, by up to {diff:.2g} of the largest (fp32) output")

    def layer_steps(weights):
        def step(name: str) -> None:
            for w in weights:
                for s, (_, k) in SHAPES.items():
                    gemv(ops[name], xs[k], w[s])
        return step

    def head_step(name: str) -> None:
        head_ops[name](xs[576], head.codes, head.scales, isa, torch.float32)

    for mode, step in (("stream", layer_steps(layers)), ("hot", layer_steps(layers[:1] * 30)), ("lm_head", head_step)):
        took = alternate(step, args.rounds, calls=10)
        ratios = [new / old for old, new in zip(took["old"], took["new"])]
        times = took["old"]
        print(f"{mode} ({GEMV_ISAS[isa]}): new/old {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
              f"old {statistics.median(times) * 1e3:.2f} ms a step's {'LM head' if mode == 'lm_head' else 'GEMVs'}, "
              f"{args.threads} threads")


if __name__ == "__main__":
    main()
