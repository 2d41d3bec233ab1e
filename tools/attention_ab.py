"""The paged decode attention kernel of a git revision against the working tree's, in one process.

Both versions of `mrv2/platforms/cpu_kernels/paged_attention.cpp` (with the .inc files of its
revision) are built under op namespaces of their own; each round runs one decode step's attention
of the default model's shapes (30 layers, 9 query / 3 KV heads of 64, bf16, the engine's joint
K|V layout in blocks of 16 tokens) for a batch of requests whose blocks lie in random order, every
layer's cache its own ("memory") or one layer's blocks for every request ("cache"), the two
versions in turn, their order alternating. Prints the median time a layer of each and checks that
both give the same output.

    python tools/attention_ab.py [REV] [--batch B] [--keys N] [--isa 1|2] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from kernel_versions import alternate, build, sources_at, working_sources

from mrv2.platforms import CpuPlatform
from mrv2.platforms.cpu import ATTENTION_ISAS

MAIN = "paged_attention.cpp"
LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", nargs="?", default="HEAD~1")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--keys", type=int, default=96, help="cached tokens a request")
    parser.add_argument("--isa", type=int, default=CpuPlatform().attention_isa())
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if not args.isa:
        raise SystemExit("this CPU has no paged decode attention kernel (it needs AVX2, FMA and F16C)")
    with tempfile.TemporaryDirectory() as tmp:
        build("attention_old", MAIN, sources_at(args.rev, MAIN), "mrv2", Path(tmp) / "old")
        build("attention_new", MAIN, working_sources(MAIN), "mrv2", Path(tmp) / "new")
    ops = {"old": torch.ops.attention_old.paged_decode_attention, "new": torch.ops.attention_new.paged_decode_attention}
    torch.manual_seed(0)
    per_request = -(-args.keys // BLOCK)
    num_blocks = per_request * args.batch + 1
    caches = []
    for _ in range(LAYERS):
        joint = torch.randn(num_blocks, BLOCK, 2 * KV_HEADS * DIM).bfloat16()
        caches.append((joint[..., :KV_HEADS * DIM].unflatten(-1, (KV_HEADS, DIM)),
                       joint[..., KV_HEADS * DIM:].unflatten(-1, (KV_HEADS, DIM))))
    tables = torch.randperm(num_blocks)[:args.batch * per_request].view(args.batch, per_request).int()
    query = torch.randn(args.batch, HEADS, DIM).bfloat16()
    seq_lens = torch.full((args.batch,), args.keys, dtype=torch.int32)
    k, v = caches[0]
    old, new = (ops[name](query, k, v, tables, seq_lens, DIM ** -0.5, args.isa) for name in ("old", "new"))
    if not torch.equal(old, new):
        print(f"the two versions' outputs differ, by up to {(new.float() - old.float()).abs().max().item():.2g}")
    for mode in ("memory", "cache"):
        layers = caches if mode == "memory" else caches[:1] * LAYERS
        table = tables if mode == "memory" else tables[:1].expand(args.batch, per_request).contiguous()
        def step(name: str) -> None:
            for k, v in layers:
                ops[name](query, k, v, table, seq_lens, DIM ** -0.5, args.isa)

        took = alternate(step, args.rounds)
        old_us, new_us = (statistics.median(took[name]) / LAYERS * 1e6 for name in ("old", "new"))
        print(f"{mode} ({ATTENTION_ISAS[args.isa]}, batch {args.batch}, {args.keys} keys): old {old_us:.0f} us a layer, "
              f"new {new_us:.0f} ({old_us / new_us:.2f}x), {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
