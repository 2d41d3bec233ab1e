"""One rank's view of its tensor-parallel group: who it is, which slice of a layer it holds,
and the two collectives sharded layers need (sum partial outputs, gather vocabulary slices).

A `TensorParallel` is passed to the model when it is built; the single-rank default makes
every collective a no-op, so one code path serves one rank and many.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size` ranks, communicating over `group` (a torch.distributed process group),
    or through `local` (a `ShmExchange`) when every rank is on this machine and the tensor fits."""

    rank: int = 0
    size: int = 1
    group: Any = None
    local: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a process group")

    def split(self, units: int, what: str = "rows") -> tuple[int, int]:
        """This rank's (first unit, count) of `units` equal units (heads, rows).

        With at least as many units as ranks each rank holds units / size of them; with fewer
        (KV heads below the rank count) each unit is replicated on size / units ranks.
        """
        if units >= self.size:
            if units % self.size:
                raise ValueError(f"{units} {what} do not split evenly over tensor_parallel_size={self.size}")
            n = units // self.size
            return self.rank * n, n
        if self.size % units:
            raise ValueError(f"{units} {what} cannot be replicated evenly over tensor_parallel_size={self.size}")
        return self.rank * units // self.size, 1

    def split_heads(self, num_heads: int, num_kv_heads: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's (first, count) of query heads and of KV heads, whole GQA groups together.

        With at least as many KV heads as ranks the groups are spread as evenly as they go
        (3 KV heads over 2 ranks: 1 and 2), so head counts need not divide the rank count;
        with fewer, each KV head is replicated and the query heads split evenly.
        """
        if num_kv_heads < self.size:
            return self.split(num_heads, "attention heads"), self.split(num_kv_heads, "KV heads")
        first = self.rank * num_kv_heads // self.size
        count = (self.rank + 1) * num_kv_heads // self.size - first
        group = num_heads // num_kv_heads
        return (first * group, count * group), (first, count)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (summed in float32, so every rank holds the same bits)."""
        if self.size == 1:
            return x
        if self.local is not None and self.local.fits(x):
            return self.local.exchange(x).sum(dim=0).to(x.dtype)
        acc = x.float() if x.dtype != torch.float32 else x
        self.group.allreduce([acc]).wait()
        return acc if acc is x else acc.to(x.dtype)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x`, concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        if self.local is not None and self.local.fits(x):
            return torch.cat(list(self.local.exchange(x).to(x.dtype)), dim=dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallel()

# The process-group class behind each backend name a platform may give.
_GROUP_CLASSES = {"gloo": "ProcessGroupGloo", "nccl": "ProcessGroupNCCL"}


def new_process_group(backend: str, store: dist.Store, prefix: str, rank: int, size: int,
                      timeout: timedelta) -> Any:
    """A torch.distributed process group of `size` ranks meeting at `store` under `prefix`.

    The group is the engine's own, not torch's global default group, so that several engines
    (and their shutdowns) never interfere in one process.
    """
    if backend not in _GROUP_CLASSES or not hasattr(dist, _GROUP_CLASSES[backend]):
        raise ValueError(f"torch.distributed backend {backend!r} is not available in this torch build")
    return getattr(dist, _GROUP_CLASSES[backend])(dist.PrefixStore(prefix, store), rank, size, timeout)


def broadcast_object(group: Any, obj: Any, rank: int) -> Any:
    """Rank 0's `obj` on every rank of a CPU (gloo) `group`: its pickle's length, then its bytes."""
    if rank == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    group.broadcast([length], dist.BroadcastOptions()).wait()
    if rank != 0:
        data = torch.empty(int(length[0]), dtype=torch.uint8)
    group.broadcast([data], dist.BroadcastOptions()).wait()
    return obj if rank == 0 else pickle.loads(data.numpy().tobytes())
