"""Dense weights prepacked once into oneDNN's blocked layout (torch's own mkldnn ops).

oneDNN's AMX / AVX-512-BF16 kernels read weights in a blocked layout, while `F.linear`
hands them a plain row-major one on every call. Packed once at load, the default
model's bf16 shapes ran 1.3-1.9x faster at 1 to 64 rows and the same at 2048 on a 2 vCPU
Sapphire Rapids, bit-identical to `F.linear`. fp32 packs where oneDNN beats MKL (AMD
CPUs) and mrv2's dense GEMV is missing, not bit-identical there (see `Platform.linear_pack_rows`);
where the GEMV runs small batches, larger ones call oneDNN on the plain weight
(`onednn_linear`), which measured within 6% of packed at 128 rows and more.

Inductor cannot trace oneDNN's opaque tensors (no fake tensor can stand in for one), so
compiled graphs reach a packed weight through `PackedWeight`: the custom op
`mrv2::packed_linear` takes a small handle tensor, which compiled code passes like any
buffer, and looks the packed tensor up by it at run time. One compiled graph then serves
every layer, as with plain weights, and Inductor fuses the norms and activations between
the GEMMs.

oneDNN builds (JIT-compiles) a primitive per input shape and caches up to 1024 of them,
so a server whose steps have every row count from 1 to 2048 grew by hundreds of MB
(`mrv2 bench soak`). Rows are padded to `padded_rows` buckets (about 50 per weight):
powers of two up to 16 (AMX computes 16-row tiles anyway), multiples of 16 up to 256,
of 64 beyond (at most 6% more work there).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from mrv2.layers.batch_invariant import pad_rows


PACKED_DTYPES = (torch.bfloat16, torch.float32)


def packing_available() -> bool:
    """Whether this torch build has oneDNN's linear packing ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_weight(weight: torch.Tensor, rows_hint: int) -> torch.Tensor:
    """An opaque oneDNN tensor holding `weight` [out, in] blocked for batches of about `rows_hint` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def padded_rows(rows: int) -> int:
    """The row bucket a call of `rows` rows runs as."""
    if rows <= 16:
        return 1 << max(rows - 1, 0).bit_length()
    step = 16 if rows <= 256 else 64
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Every row bucket of calls of 1 to `max_rows` rows."""
    return tuple(sorted({padded_rows(n) for n in range(1, max_rows + 1)}))


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ W^T (+ bias) with a weight from `pack_weight`, or a plain [out, in] one (which
    oneDNN reorders a panel at a time, each call)."""
    rows = x.shape[0]
    out = torch.ops.mkldnn._linear_pointwise(pad_rows(x, padded_rows(rows)), packed, bias, "none", [], "")
    return out if out.shape[0] == rows else out[:rows]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight^T (+ bias) through oneDNN on a plain weight, eagerly and inside compiled
    graphs (whose Inductor lowers oneDNN's linear for constant weights only)."""
    if torch.compiler.is_compiling():
        return torch.ops.mrv2.onednn_linear(x, weight, bias)
    return packed_linear(x, weight, bias)


# Packed tensors by handle; an entry goes when its `PackedWeight` does.
_by_handle: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_handles = itertools.count()


def _packed_linear_by_handle(x: torch.Tensor, handle: torch.Tensor, out_features: int,
                             bias: torch.Tensor | None) -> torch.Tensor:
    return packed_linear(x, _by_handle[int(handle)], bias)


# A plain CPU kernel of a library op: called through the dispatcher it costs about 4 us over the
# oneDNN call, where `torch.library.custom_op`'s wrapper measured 14 (120 calls a decode step).
_lib = torch.library.Library("mrv2", "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor handle, int out_features, Tensor? bias) -> Tensor")
_lib.impl("packed_linear", _packed_linear_by_handle, "CPU")
_lib.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_lib.impl("onednn_linear", packed_linear, "CPU")


@torch.library.register_fake("mrv2::packed_linear")
def _(x: torch.Tensor, handle: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("mrv2::onednn_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class PackedWeight(torch.nn.Module):
    """A dense weight [out, in] packed for oneDNN (`pack_weight`), callable eagerly and inside compiled graphs."""

    def __init__(self, weight: torch.Tensor, rows_hint: int) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.tensor = pack_weight(weight, rows_hint)
        handle = next(_handles)
        _by_handle[handle] = self.tensor
        # A buffer, so that compiled code takes it as an input: layers share one graph.
        self.register_buffer("handle", torch.tensor(handle), persistent=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.mrv2.packed_linear(x, self.handle, self.out_features, bias)
        return packed_linear(x, self.tensor, bias)  # eagerly without the dispatcher's few microseconds
