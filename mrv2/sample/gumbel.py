"""Stateless, seeded Gumbel-max sampling.

The noise for row b and vocab index v is a pure function of (seeds[b], positions[b], v):
a counter-based integer hash, so a seeded request draws the same token whatever else
is in the batch, in whatever row, on whatever step, with no generator state to carry.
Every op is an elementwise torch op on the input's device; nothing syncs with the host.
"""

from __future__ import annotations

import torch

# Hash constants as signed integers: torch has no uint32/uint64 arithmetic, and signed
# multiplication wraps around like unsigned on the low bits.
_M64_1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 finalizer
_M64_2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN64 = 0x9E3779B97F4A7C15 - (1 << 64)
_M32_1 = 0x85EBCA6B - (1 << 32)  # murmur3 fmix32
_M32_2 = 0xC2B2AE35 - (1 << 32)
_GOLDEN32 = 0x9E3779B1 - (1 << 32)

# u = 0.5 + s * _U_SCALE for the top 24 hash bits read as a signed s in [-2**23, 2**23):
# about (s + 2**23 + 0.5) / 2**24, i.e. 2**24 evenly spaced values strictly inside (0, 1).
# The scale (just under 2**-24) is exact in float32 and keeps the largest u below 1.
_U_SCALE = 2.0**-24 - 2.0**-48


def _shr64(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = z ^ _shr64(z, 30)
    z = z * _M64_1
    z = z ^ _shr64(z, 27)
    z = z * _M64_2
    return z ^ _shr64(z, 31)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int32 [B] key per (seed, position): the only per-row input of the noise."""
    z = _mix64(seeds.long() ^ _mix64(positions.long() + _GOLDEN64)) & 0xFFFFFFFF
    return ((z ^ 0x80000000) - 0x80000000).to(torch.int32)  # reinterpret the low 32 bits


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """In place: murmur3's fmix32 without its last xorshift, whose only job is to mix
    the high bits into the low ones; callers keep the high 24 bits. `tmp` is scratch."""
    for shift, mul in ((16, _M32_1), (13, _M32_2)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp.bitwise_and_((1 << (32 - shift)) - 1)  # logical shift: torch's >> is arithmetic
        x.bitwise_xor_(tmp)
        x.mul_(mul)
    return x


def _to_uniform(x: torch.Tensor, half: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """float32 u in (0, 1) from the top 24 bits of int32 hashes; `half` is a 0-dim 0.5."""
    return torch.add(half, x.bitwise_right_shift_(8), alpha=_U_SCALE, out=out)


def _vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(vocab_size, dtype=torch.int32, device=device).mul_(_GOLDEN32)


class _Scratch:
    """Buffers for one chunk of rows, reused across chunks: fresh large allocations
    cost page faults on CPU that rival the arithmetic."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.bits = torch.empty(rows, vocab_size, dtype=torch.int32, device=device)
        self.tmp = torch.empty_like(self.bits)
        self.out = torch.empty(rows, vocab_size, dtype=torch.float32, device=device)
        self.half = torch.full((), 0.5, dtype=torch.float32, device=device)

    def uniform(self, keys: torch.Tensor, vhash: torch.Tensor) -> torch.Tensor:
        """u in (0, 1), float32 [rows, V], in `self.out`."""
        n = keys.shape[0]
        x, tmp, u = self.bits[:n], self.tmp[:n], self.out[:n]
        torch.bitwise_xor(keys[:, None], vhash[None, :], out=x)
        return _to_uniform(_mix32_(x, tmp), self.half, u)

    def log_exponential(self, keys: torch.Tensor, vhash: torch.Tensor) -> torch.Tensor:
        """log(-log(u)), i.e. minus the Gumbel noise, in `self.out`."""
        return self.uniform(keys, vhash).log_().neg_().log_()


def uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [B, V] uniforms strictly inside (0, 1) that the noise is built from."""
    keys = row_keys(seeds, positions)
    scratch = _Scratch(keys.shape[0], vocab_size, keys.device)
    return scratch.uniform(keys, _vocab_hash(vocab_size, keys.device))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise float32 [B, V]: -log(-log(u))."""
    keys = row_keys(seeds, positions)
    scratch = _Scratch(keys.shape[0], vocab_size, keys.device)
    return scratch.log_exponential(keys, _vocab_hash(vocab_size, keys.device)).neg_()


def gumbel_sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    temperature: torch.Tensor | None = None,
    chunk_elems: int | None = None,
) -> torch.Tensor:
    """argmax(logits / temperature + gumbel) per row, as int64 [B].

    -inf logits never win. `temperature` (float32 [B], > 0) is optional so that callers
    who have already scaled the logits skip a pass. `chunk_elems` (the platform's
    `sampling_chunk_elems`) runs chunks of rows of about that many elements, which keeps
    the ~15 elementwise passes in cache and reuses one set of buffers; None runs all
    rows at once (one launch per op). The draws are the same either way.
    """
    num_rows, vocab_size = logits.shape
    keys = row_keys(seeds, positions)
    vhash = _vocab_hash(vocab_size, logits.device)
    step = max(1, chunk_elems // vocab_size) if chunk_elems else max(num_rows, 1)
    scratch = _Scratch(min(step, num_rows), vocab_size, logits.device)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    for start in range(0, num_rows, step):
        rows = slice(start, start + step)
        # argmax(logits/T - log E) == argmin(log E - logits/T)
        score = scratch.log_exponential(keys[rows], vhash)
        if temperature is None:
            score.sub_(logits[rows])
        else:
            score.addcdiv_(logits[rows], temperature[rows, None], value=-1.0)
        torch.argmin(score, dim=-1, out=out[rows])
    return out
