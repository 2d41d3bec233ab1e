"""Decode attention through a compiled C++ kernel that reads KV blocks in place.

`torch.ops.mrv2.paged_decode_attention` (a platform's kernel: the CPU builds it with its
other kernels, `mrv2.platforms.cpu_kernels`) computes what `paged_decode_attention` in
`mrv2.attention.paged_decode` defines: one query token per request over its cached
tokens, fp32 scores and softmax, each key and value loaded from its block. Prefill groups
stay on the gather + SDPA path of `TorchPagedAttention`. A step of decodes only is one call
per layer (`paged_decode_attention_with_kv`): the step's keys and values into their slots,
then attention, without the separate cache writes and output copies of a mixed step. That
call takes the cache as the allocation every layer's views are cut from and the layer's place
in it, so a compiled FULL graph can hold a whole decode step: the kernel reads each
request's length from `seq_lens`, so one graph serves every sequence length.

One layer of the default model (9 query / 3 KV heads of 64, bf16) on a 2 vCPU Zen 4, this
kernel against the Inductor-compiled one over a joint cache of 20,000 blocks: 0.28 vs 0.64-0.73 ms
at batch 64 and 64 keys, 0.67 vs 1.24-1.62 ms at 160 keys; 33 vs 89 us at batch 1 and 160 keys.
Since it fetches the next request's blocks at an even pace (into L2 on AMD CPUs), 0.17 ms at 64 keys
and 0.40 at 160 (blocks in random order, from memory).
The kernel needs nothing compiled per shape, so nothing warms up. Where the CPU has
AVX512-BF16 the platform runs the kernel's AVX-512 variant (`CpuPlatform.attention_isa`):
sixteen tokens' scores at once, bf16 keys straight into vdpbf16ps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrv2.attention.backend import CommonAttentionMetadata
from mrv2.attention.registry import register_backend
from mrv2.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata
from mrv2.kv_spec import LayerKVCache
from mrv2.platforms import Platform
from mrv2.platforms.cpu import ATTENTION_ISAS


def kernel_loaded() -> bool:
    """Whether a platform loaded `torch.ops.mrv2.paged_decode_attention` into this process."""
    return hasattr(torch.ops.mrv2, "paged_decode_attention")


@dataclass
class DecodeRows:
    """The decode rows' block table and lengths (views of the step's metadata)."""

    block_table: torch.Tensor  # [R, max_blocks] int32
    seq_lens: torch.Tensor  # [R] int32; a padded row (0) gets zeros
    num_rows: int


@register_backend
class CppPagedAttention(TorchPagedAttention):
    """Decode rows through the platform's C++ kernel; prefill groups as in `TorchPagedAttention`."""

    name = "cpp-paged"
    compiled_decode_graphs = True

    def __init__(self, isa: int = 1) -> None:
        super().__init__()
        self.isa = isa  # the platform's numbering (`CpuPlatform.attention_isa`)

    @classmethod
    def for_platform(cls, platform: Platform) -> CppPagedAttention:
        return cls(platform.attention_isa() or 1)

    @classmethod
    def is_available(cls) -> bool:
        return kernel_loaded()

    def describe(self) -> str:
        return f"{self.name} (decode kernel: {ATTENTION_ISAS.get(self.isa, f'isa {self.isa}')})"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache | None,
                metadata: TorchPagedMetadata | None, scale: float) -> torch.Tensor:
        if metadata is None or metadata.prefills or metadata.decode is None:
            return super().forward(query, key, value, cache, metadata, scale)
        g = metadata.decode
        return torch.ops.mrv2.paged_decode_attention_with_kv(query, key, value, cache.raw, cache.placement["k"],
                                                             cache.placement["v"], metadata.slot_mapping,
                                                             g.block_table, g.seq_lens, scale, self.isa)

    def _decode_metadata(self, common: CommonAttentionMetadata) -> DecodeRows:
        nd = common.num_decodes
        return DecodeRows(common.block_table[:nd], common.seq_lens[:nd], nd)

    def _decode(self, query: torch.Tensor, cache: LayerKVCache, g: DecodeRows, scale: float) -> torch.Tensor:
        return torch.ops.mrv2.paged_decode_attention(query[:g.num_rows], cache["k"], cache["v"], g.block_table,
                                                     g.seq_lens, scale, self.isa)
