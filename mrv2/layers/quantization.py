"""Weight-only quantized matmuls for GGUF block formats (Q4_0, Q4_1, Q4_K, Q6_K, Q8_0).

`QuantizedWeight` holds a weight as GGUF stores it: integer codes and one scale (and,
for Q4_1 and Q4_K, one min) per block of 32 weights along the input dimension (Q6_K: one
scale per 16 weights). `Int4Matmul`
multiplies by it through `torch._weight_int4pack_mm_for_cpu`, whose groups dequantize
as `(q - 8) * scale + zero`:

- Q4_0, `d * (q - 8)`: scale d, zero 0;
- Q4_1, `d * q + m`: scale d, zero m + 8d;
- Q4_K, super-blocks of 256 whose eight 32-weight sub-blocks dequantize as
  `(d * sc) * q - dmin * m` (6-bit sc and m): held as Q4_1 is, with scale d * sc and min
  -dmin * m per 32 weights (fp32: a half times a 6-bit integer is exact there);
- Q8_0, `d * q` with q in [-127, 127]: q = 16 * hi + lo (hi in [-8, 7], lo in [0, 15]),
  two int4 matmuls, one with codes hi + 8 and scale 16d, one with codes lo, scale d and
  zero 8d, summed. Same bytes as int8, and exact, unlike a per-channel int8 requantization.
- Q6_K, super-blocks of 256 whose sixteen 16-weight sub-blocks dequantize as `(d * sc) * (q - 32)`
  (8-bit sc, 6-bit q): held as int8 codes q - 32 with scale d * sc per 16 weights (exact in fp32). torch's
  kernel takes groups of 32 or more, so Q6_K runs on the block kernels only (else it is dequantized).

Scales and zeros are held in the activations' dtype, so effective weights equal the
GGUF dequantization up to that dtype's rounding of the scales.

`BlockGemv` runs every one of these types on the platform's own block kernels
(`torch.ops.mrv2_gguf`, loaded by the platform), which keep GGUF's blocks and fp16 scales as
they are (Q4_K's per-32 scales and mins and Q6_K's per-16 scales rounded to fp16, 2^-11 of each
at most; Q6_K as Q8_0 with two scales a block; one pass over the weights for Q8_0) and sum
integer products with the activations quantized to int16 per block (a finer step than bf16).
Where the policy names a `gemm_isa`, batches of more rows run on the block GEMM over a second
layout of the same codes (`GemmTiles`): on AMX and AVX512-BF16, bf16 activations times each tile
dequantized to bf16 in cache, as a dense bf16 copy holds it, summed in fp32; on AVX2 CPUs without
native bf16, integer products with the float32 activations quantized to int8 per block,
as llama.cpp's are (coarser than bf16's rounding: see the README's perplexities).
`quantized_matmul` picks one of the two for a weight and a `QuantPolicy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mrv2.config import QuantPolicy
from mrv2.layers.weight_buffer import aligned, into_one_buffer

GGUF_BLOCK = 32
QUANT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0")
WITH_MINS = ("Q4_1", "Q4_K")  # types whose 32-weight groups have a min as well as a scale
INT8_CODES = ("Q6_K", "Q8_0")  # types held as int8 codes, one a byte (the others: 4-bit codes)
SUB_BLOCKS = {"Q6_K": 2}  # scales per 32-weight block where there is more than one (Q6_K: one per 16 weights)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight in GGUF blocks: `codes` [N, K] (uint8 0..15 for Q4, int8 for Q8_0 and Q6_K's q - 32),
    `scales` [N, K / 32 * sub_blocks] and `mins` (Q4_1 and Q4_K only) [N, K / 32]."""

    qtype: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.qtype not in QUANT_TYPES:
            raise ValueError(f"unsupported quantized type {self.qtype!r} (supported: {', '.join(QUANT_TYPES)})")
        n, k = self.codes.shape
        if k % GGUF_BLOCK or tuple(self.scales.shape) != (n, k // GGUF_BLOCK * self.sub_blocks):
            raise ValueError(f"{self.qtype} codes {tuple(self.codes.shape)} need scales of shape "
                             f"({n}, {k // GGUF_BLOCK * self.sub_blocks}), got {tuple(self.scales.shape)}")
        if (self.mins is not None) != (self.qtype in WITH_MINS):
            raise ValueError(f"{self.qtype} {'needs' if self.qtype in WITH_MINS else 'has no'} mins")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def sub_blocks(self) -> int:
        """Scales per 32-weight block: 2 for Q6_K's 16-weight sub-blocks, else 1."""
        return SUB_BLOCKS.get(self.qtype, 1)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weight (or its `rows`) in `dtype`, computed in fp32 as `gguf.quants.dequantize` does."""
        codes, scales, mins = self.codes, self.scales, self.mins
        if rows is not None:
            codes, scales = codes[rows], scales[rows]
            mins = mins[rows] if mins is not None else None
        q = codes.float().unflatten(-1, (-1, GGUF_BLOCK // self.sub_blocks))
        if self.qtype == "Q4_0":
            q = q - 8
        w = q * scales.float()[..., None]
        if mins is not None:
            w = w + mins.float()[..., None]
        return w.flatten(-2).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedWeight":
        """Rows (dim 0) or whole 32-weight blocks of columns (dim 1): one rank's slice under tensor parallelism."""
        if dim == 0:
            mins = self.mins[start:start + length] if self.mins is not None else None
            return QuantizedWeight(self.qtype, self.codes[start:start + length], self.scales[start:start + length], mins)
        columns = column_spans(self.qtype, start, length)
        mins = self.mins[:, columns["mins"]] if self.mins is not None else None
        return QuantizedWeight(self.qtype, self.codes[:, start:start + length], self.scales[:, columns["scales"]], mins)

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack weights of one type by rows (the shards of a fused projection)."""
        qtypes = {p.qtype for p in parts}
        if len(qtypes) != 1:
            raise ValueError(f"cannot stack weights of different types {sorted(qtypes)}")
        mins = torch.cat([p.mins for p in parts]) if parts[0].mins is not None else None
        return QuantizedWeight(parts[0].qtype, torch.cat([p.codes for p in parts]),
                               torch.cat([p.scales for p in parts]), mins)


def column_spans(qtype: str, start: int, length: int) -> dict[str, slice]:
    """The columns of "scales" and "mins" that hold weight columns [start, start + length), which must be whole
    32-weight blocks (Q6_K's scales: two a block)."""
    if start % GGUF_BLOCK or length % GGUF_BLOCK:
        raise ValueError(f"a {qtype} weight splits by columns only at {GGUF_BLOCK}-weight blocks, "
                         f"not at [{start}, {start + length})")
    first, end, per_block = start // GGUF_BLOCK, (start + length) // GGUF_BLOCK, SUB_BLOCKS.get(qtype, 1)
    return {"scales": slice(first * per_block, end * per_block), "mins": slice(first, end)}


def int4_kernel_supports(weight: QuantizedWeight) -> bool:
    """Weights torch's int4 CPU kernel packs: one scale per 32 weights (its smallest group), whole groups along K,
    N a multiple of its 16-row tiles."""
    n, k = weight.shape
    return weight.sub_blocks == 1 and k % GGUF_BLOCK == 0 and n % 16 == 0


class Int4Matmul:
    """x @ W^T for a `QuantizedWeight`, on torch's int4 CPU kernel; x [M, K] in the kernel's dtype."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        if not int4_kernel_supports(weight):
            raise ValueError(f"torch's int4 kernel cannot take a {weight.qtype} weight of shape {tuple(weight.shape)}")
        d = weight.scales.float()
        if weight.qtype == "Q8_0":
            c = weight.codes.int()
            packs = [(torch.div(c, 16, rounding_mode="floor") + 8, 16 * d, torch.zeros_like(d)),
                     (c & 15, d, 8 * d)]
        elif weight.qtype in WITH_MINS:
            packs = [(weight.codes.int(), d, weight.mins.float() + 8 * d)]
        else:
            packs = [(weight.codes.int(), d, torch.zeros_like(d))]
        self.out_features, self.in_features = weight.shape
        self._packs = [(torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1),
                        torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous())
                       for codes, scale, zero in packs]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W^T, in `out_dtype` where given (else x's dtype)."""
        x2 = x.reshape(-1, self.in_features)
        out = None
        for packed, scales_zeros in self._packs:
            y = torch._weight_int4pack_mm_for_cpu(x2, packed, GGUF_BLOCK, scales_zeros)
            out = y if out is None else out.add_(y)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if out_dtype is None else out.to(out_dtype)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() + s.numel() * s.element_size() for p, s in self._packs)


@dataclass(frozen=True)
class GemmTiles:
    """A Q4 or Q8_0 weight laid out for the block GEMM of `engine` (the platform's `gemm_isa` numbers them, see
    `ENGINES`), which takes activations of `dtype`.

    "amx", "bf16" (`cpu_kernels/gguf_gemm.cpp`) and "vnni" (`cpu_kernels/gguf_gemm_vnni.cpp`), bf16
    activations: per tile of 16 output columns by 32 input features, 16 rows of bf16 pairs (features 2r,
    2r + 1 of each column), multiplied on AMX or with AVX512-BF16 dot products, or unpacked to bytes for
    AVX512-VNNI integer products with the activations quantized to int8 per block. A tile row's lane
    2n + p is feature 2r + p of column n. `codes`: Q4
    [N / 16, K / 32, 16, 16] bytes (byte j: lane j in the low nibble, lane j + 16 in the high one), Q8_0
    [N / 16, K / 32, 16, 32] int8 (Q8_0, Q6_K), lane by lane; `scales` (and `mins`) fp16 [N / 16, K / 32, 16],
    Q6_K's [N / 16, K / 32, 2, 16] (features 0..15 of the block, then 16..31).

    "avx2" (`cpu_kernels/gguf_gemm_avx2.cpp`, float32 activations, quantized to int8 per block): per
    strip of 8 output columns and block of 32 features, 8 groups of 4 features: `codes` [N / 8, K / 32, 8, 8,
    4], byte (g, n, i) the code of column n, feature 4g + i (uint8 for Q4, int8 for Q8_0 and Q6_K); `scales`
    (and `mins`) float32 [N / 8, K / 32, 8], Q6_K's [N / 8, K / 32, 2, 8].
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    engine: str

    ENGINES = {1: "bf16", 2: "amx", 3: "avx2", 4: "vnni"}  # the platform's gemm_isa numbering
    # what each engine takes
    ACTIVATIONS = {"bf16": torch.bfloat16, "amx": torch.bfloat16, "avx2": torch.float32, "vnni": torch.bfloat16}

    @staticmethod
    def supports(weight: QuantizedWeight) -> bool:
        n, k = weight.shape
        return n % 16 == 0 and k % GGUF_BLOCK == 0

    @staticmethod
    def takes(gemm_isa: int, dtype: torch.dtype) -> bool:
        """Whether the block GEMM of `gemm_isa` takes activations of `dtype`."""
        return GemmTiles.ACTIVATIONS.get(GemmTiles.ENGINES.get(gemm_isa)) == dtype

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype these tiles' engine takes."""
        return self.ACTIVATIONS[self.engine]

    @classmethod
    def of(cls, weight: QuantizedWeight, mins: torch.Tensor | None, gemm_isa: int) -> GemmTiles:
        """Tiles of `weight` (codes [N, K], q in 0..15 or int8) with its per-block `mins` (None for int8 codes), for
        the block GEMM of `gemm_isa`."""
        engine = cls.ENGINES[gemm_isa]
        n, k = weight.shape

        def per_column_group(t: torch.Tensor, columns: int, dtype: torch.dtype) -> torch.Tensor:
            """[N, K / 32 * s] -> [N / columns, K / 32, (s,) columns]."""
            s = t.shape[1] // (k // 32)
            grouped = t.to(dtype).view(n // columns, columns, k // 32, s).permute(0, 2, 3, 1)
            return (grouped if s > 1 else grouped.squeeze(2)).contiguous()

        if engine == "avx2":
            groups = weight.codes.view(n // 8, 8, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # [strip, block, g, n, i]
            codes = groups.to(torch.int8 if mins is None else torch.uint8).contiguous()
            return cls(codes, per_column_group(weight.scales, 8, torch.float32),
                       None if mins is None else per_column_group(mins, 8, torch.float32), engine)
        pairs = weight.codes.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)  # [tile n, tile k, r, n, pair]
        lanes = pairs.reshape(n // 16, k // 32, 16, 32)  # a tile row: lane 2n + p is feature 2r + p of column n
        if mins is None:
            tiled = lanes.to(torch.int8)
        else:
            q = lanes.to(torch.uint8)
            tiled = q[..., :16] | (q[..., 16:] << 4)

        return cls(tiled.contiguous(), per_column_group(weight.scales, 16, torch.float16),
                   None if mins is None else per_column_group(mins, 16, torch.float16), engine)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, gated: bool = False) -> torch.Tensor:
        """x @ W^T (x as the engine `takes`) in x's dtype (bf16: rounded once), or float32 sums as they are where
        `out_dtype` says so. `gated` (where `gates()`): silu(first half of the columns) * second half instead
        (SwiGLU on a stacked gate/up weight), from the same sums (bf16 out: each half rounded to bf16 first, as
        the unfused product is)."""
        if self.mins is None:
            q8 = getattr(torch.ops.mrv2_gguf, f"q8_gemm_{self.engine}")
            return q8(x, self.codes, self.scales, out_dtype, gated)
        q4 = getattr(torch.ops.mrv2_gguf, f"q4_gemm_{self.engine}")
        return q4(x, self.codes, self.scales, self.mins, out_dtype, gated)

    def gates(self) -> bool:
        """Whether a gated product fits: an engine that has one, and columns that split into two halves of
        whole tiles."""
        return self.engine != "avx2" and self.codes.shape[0] % 2 == 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)


class BlockGemv:
    """x @ W^T for a `QuantizedWeight` on the platform's block GEMV (`gemv_isa` names its instruction set);
    batches of more than `gemv_rows` rows on its block GEMM where `gemm_isa` (the platform's numbering: 2 AMX,
    1 AVX512-BF16 dot products, both for bf16 activations; 3 AVX2 integer products, for float32; 0 none).

    Codes keep GGUF's layout (Q4: two a byte, weight j and j + 16 of a block in one byte; Q8_0 and Q6_K one
    int8 a byte); scales and mins are fp16, as GGUF stores them (Q4_0 as Q4_1 with min -8d, exact in fp16), flat:
    row after row (Q6_K's two a block), then `SCALE_TAIL` zeros (the kernel's last wide load of a row reads
    past it).
    """

    def __init__(self, weight: QuantizedWeight, isa: int, gemm_isa: int = 0, gemv_rows: int = 0) -> None:
        if not block_gemv_supports(weight):
            raise ValueError(f"{weight.qtype} weight of shape {tuple(weight.shape)} is not one the block GEMV takes")
        self.isa = isa
        self.out_features, self.in_features = weight.shape
        n, k = weight.shape
        self.scales = _flat_halves(weight.scales)
        self.sub_blocks = weight.sub_blocks
        if weight.qtype in INT8_CODES:
            self.codes = weight.codes.to(torch.int8).contiguous()
            self.mins = None
            mins = None
        else:
            blocks = weight.codes.to(torch.uint8).view(n, k // GGUF_BLOCK, GGUF_BLOCK)
            self.codes = (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, k // 2).contiguous()
            mins = -8 * weight.scales.float() if weight.qtype == "Q4_0" else weight.mins
            self.mins = _flat_halves(mins)
        self.gemv_rows = gemv_rows
        self.tiles = GemmTiles.of(weight, mins, gemm_isa) if gemm_isa and GemmTiles.supports(weight) else None

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W^T, in `out_dtype` where given (x's dtype or float32; else x's dtype): the kernels write
        float32 themselves, unrounded."""
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self._on_tiles(x2):
            y = self.tiles(x2, out_dtype)
        elif self.mins is None:
            y = torch.ops.mrv2_gguf.q8_gemv(x2, self.codes, self.scales, self.isa, out_dtype, self.sub_blocks)
        else:
            y = torch.ops.mrv2_gguf.q4_gemv(x2, self.codes, self.scales, self.mins, self.isa, out_dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x @ W_gate^T) * (x @ W_up^T) for W = [W_gate; W_up], in one pass where the batch runs on the block
        GEMM (see `GemmTiles`); None where it does not (the caller multiplies and activates)."""
        x2 = x.reshape(-1, self.in_features).contiguous()
        if not self._on_tiles(x2) or not self.tiles.gates():
            return None
        return self.tiles(x2, gated=True).view(*x.shape[:-1], self.out_features // 2)

    def _on_tiles(self, x2: torch.Tensor) -> bool:
        return self.tiles is not None and x2.shape[0] > self.gemv_rows and x2.dtype == self.tiles.dtype

    @property
    def nbytes(self) -> int:
        tensors = (self.codes, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + (self.tiles.nbytes if self.tiles else 0)


def place_in_one_buffer(gemvs: list[BlockGemv], allocate: Callable[[int], torch.Tensor]) -> int:
    """Move the GEMV weights of `gemvs` (codes, scales, mins; not the GEMM tiles, which only larger batches
    read) into one buffer from `allocate`, in list order (see `into_one_buffer`). Returns the buffer's bytes."""
    held = [(g, name) for g in gemvs for name in ("codes", "scales", "mins") if getattr(g, name) is not None]
    views = into_one_buffer([getattr(g, name) for g, name in held], allocate)
    for (g, name), view in zip(held, views):
        setattr(g, name, view)
    return sum(aligned(v.nbytes) for v in views)


SCALE_TAIL = 16  # kScaleTail in cpu_kernels/gguf_gemv.cpp


def _flat_halves(t: torch.Tensor) -> torch.Tensor:
    """Per-block values [N, K / 32] as the kernel takes them: fp16, flat, then SCALE_TAIL zeros."""
    return torch.nn.functional.pad(t.to(torch.float16).flatten(), (0, SCALE_TAIL)).contiguous()


def _fp16_holds(t: torch.Tensor) -> bool:
    """Every value finite in fp16 and either exact there or normal (rounded to 11 significant bits, a relative
    error of 2^-11 at most; the kernel's loads past a row's end rely on finite values)."""
    f = t.float()
    half = f.to(torch.float16).float()
    normal = f.abs() >= torch.finfo(torch.float16).tiny  # fp16's smallest normal number, 2^-14
    return bool(torch.isfinite(half).all()) and bool(((half == f) | normal).all())


def block_gemv_supports(weight: QuantizedWeight) -> bool:
    """Whether `BlockGemv` holds `weight`: whole blocks, and scales (and mins) fp16 holds (see `_fp16_holds`).
    GGUF stores Q4_0, Q4_1 and Q8_0's as fp16, so those are exact; Q4_K's d * sc and dmin * m and Q6_K's d * sc,
    exact in fp32, are rounded to fp16 (torch's int4 kernel, the alternative for Q4_K, holds them in the
    activations' dtype: bf16 rounds to 2^-8)."""
    if weight.shape[1] % GGUF_BLOCK or not _fp16_holds(weight.scales):
        return False
    if weight.qtype == "Q4_0":
        return _fp16_holds(-8 * weight.scales.float())
    return weight.mins is None or _fp16_holds(weight.mins)


@dataclass(frozen=True)
class StackedMatmul:
    """x @ W^T for a weight stacked by rows from runs of different GGUF types (a fused projection whose shards the
    file quantized differently, as Q4_K_M's Q4_K queries and keys beside Q6_K values): each run on its own kernel,
    the outputs side by side."""

    parts: tuple[Int4Matmul | BlockGemv, ...]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.cat([part(x, out_dtype) for part in self.parts], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


QuantizedMatmul = Int4Matmul | BlockGemv | StackedMatmul


def block_gemvs(matmul: QuantizedMatmul | None) -> list[BlockGemv]:
    """The block GEMVs `matmul` runs on (none for torch's int4 kernel)."""
    parts = matmul.parts if isinstance(matmul, StackedMatmul) else (matmul,)
    return [part for part in parts if isinstance(part, BlockGemv)]


def stacked_matmul(shards: list[QuantizedWeight], dtype: torch.dtype,
                   policy: QuantPolicy) -> QuantizedMatmul | None:
    """The policy's kernels for `shards` stacked by rows: one for each run of shards of one type (see
    `quantized_matmul`); None where any run has none (the weight is dequantized)."""
    runs: list[list[QuantizedWeight]] = []
    for shard in shards:
        if runs and runs[-1][0].qtype == shard.qtype:
            runs[-1].append(shard)
        else:
            runs.append([shard])
    parts = [quantized_matmul(QuantizedWeight.cat(run), dtype, policy) for run in runs]
    if any(part is None for part in parts):
        return None
    return parts[0] if len(parts) == 1 else StackedMatmul(tuple(parts))


def quantized_matmul(weight: QuantizedWeight, dtype: torch.dtype, policy: QuantPolicy) -> Int4Matmul | BlockGemv | None:
    """The policy's kernel for `weight`: the block GEMV where it holds the weight (see `block_gemv_supports`),
    else torch's int4 kernel where it takes the weight; None: neither (the weight is dequantized)."""
    if not policy.uses_int4:
        return None
    if policy.gemv_isa and block_gemv_supports(weight):
        gemm_isa = policy.gemm_isa if GemmTiles.takes(policy.gemm_isa, dtype) else 0
        return BlockGemv(weight, policy.gemv_isa, gemm_isa, policy.int4_max_rows)
    if int4_kernel_supports(weight):
        return Int4Matmul(weight, dtype)
    return None
