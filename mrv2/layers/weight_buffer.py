"""One buffer for the weights a decode step streams, in the order it reads them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

ALIGNMENT = 64  # a cache line: every weight starts on one


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a whole number of ALIGNMENT: what a tensor takes in the buffer."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def into_one_buffer(tensors: Sequence[torch.Tensor], allocate: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` in one uint8 buffer from `allocate` (a platform's `weight_storage`), in sequence order,
    each at a 64-byte boundary: a batch-1 step then reads one stretch of memory front to back, on the pages the
    platform chose (2 MiB ones on the CPU). Returns the copies, same dtypes and shapes."""
    sizes = [aligned(t.nbytes) for t in tensors]
    buffer = allocate(sum(sizes))
    views, at = [], 0
    for t, size in zip(tensors, sizes):
        view = buffer[at:at + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append(view)
        at += size
    return views
