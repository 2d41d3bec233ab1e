"""The attention-backend interface.

The runner builds one `CommonAttentionMetadata` per step from its persistent
input buffers; each backend turns it into its own metadata once per step
(`build_metadata`) and then runs every layer with it (`forward`). A backend
declares the KV-cache views it reads (shape and stride order per part). Graph
capture talks to backends only through the three hooks at the bottom; nothing
wraps or patches a device's graph API.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mrv2.config import KVLayout
from mrv2.kv_spec import KVCacheSpec

if TYPE_CHECKING:
    from mrv2.platforms import Platform


@dataclass
class CommonAttentionMetadata:
    """Backend-neutral description of one step's attention work.

    Requests are ordered decodes first: rows [0, num_decodes) have query length 1.
    Device tensors are views of the runner's persistent buffers; the `*_cpu`
    arrays are host mirrors (exact without speculative decoding, upper bounds with it)
    so that backends can size work without reading the device.
    """

    num_reqs: int
    num_tokens: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    block_size: int
    # Graph replay: size work by max_seq_len (fixed per captured descriptor), never by host maxima.
    static_shapes: bool = False


class AttentionBackend(ABC):
    """An attention implementation over a paged KV cache.

    The forward call depends on the attention kind: GQA backends implement
    `forward(query, key, value, cache, metadata, scale)`, MLA backends
    `forward_mla(...)` (see `mrv2.attention.torch_mla`). Models call the one they need.
    """

    name: str
    kind: str = "gqa"  # "gqa" or "mla": which forward the backend implements
    supported_layouts: tuple[KVLayout, ...] = ("joint", "split")
    # Whether a query's output is independent of the batch it runs in (selected by batch_invariant=True).
    batch_invariant: bool = False
    # Whether a decode-only step's attention is one traceable op over device tensors that reads each
    # request's length from `seq_lens`: one FULL graph then serves every sequence length (no key-length
    # buckets), and torch.compile can hold the whole step where a platform compiles graphs.
    compiled_decode_graphs: bool = False

    @classmethod
    def for_platform(cls, platform: Platform) -> AttentionBackend:
        """An instance set up for `platform` (e.g. the instruction set its kernels run there)."""
        return cls()

    def describe(self) -> str:
        """What runs, for the start-up log: the name, and where it picks among kernels, which."""
        return self.name

    @classmethod
    def is_available(cls) -> bool:
        """Whether the backend can run here (e.g. its kernels import); the registry skips it if not."""
        return True

    # -- KV-cache layout (what the allocator in `mrv2.runner.kv_cache` cuts for this backend) --

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Logical shape of one part's view (K, V, MLA latent or rope key), in either layout."""
        return (num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(layout: KVLayout) -> tuple[int, ...]:
        """The view's dims from outermost to innermost in memory.

        Block-major in both layouts: "split" gives each part a contiguous tensor, "joint"
        interleaves a layer's parts per token (a part's view skips the others' columns).
        """
        return (0, 1, 2, 3)

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Per-step metadata shared by all layers."""

    def warm_up(self, num_heads: int, scale: float, cache: Any) -> None:
        """Prepare kernels (e.g. compile them) for layers of `num_heads` query heads and softmax `scale`
        over `cache` (a layer's `LayerKVCache`), once the cache exists, before the first step. Default: nothing."""

    def transient_bytes(self, num_reqs: int, num_tokens: int, max_seq_len: int, spec: KVCacheSpec) -> int:
        """Peak bytes one layer's attention allocates and frees within a step of these sizes.

        Layers run one at a time, so this is per layer, not summed. The runner adds it
        to the memory it reserves for the largest step before sizing the KV cache
        (the profile run attends without a cache, so it cannot see these). Default: none.
        """
        return 0

    # -- graph-capture hooks (called by the graph manager, never by the runner) --
    #
    # Memory a captured graph reads or writes lives as long as that graph: a device
    # graph replays into the very addresses it recorded, so freeing such memory after
    # capture would make replays read and write freed (reused) memory. Memory is saved
    # by sharing, not freeing: e.g. one workspace sized for the largest descriptor
    # (descriptors are captured largest first), allocated once and used by every graph.

    def before_capture(self, descriptor: Any) -> None:
        """Allocate, or reuse, what a graph for `descriptor` needs (e.g. the shared workspace)."""

    def after_capture(self, descriptor: Any) -> None:
        """Drop references that replay does not read (e.g. capture-only host staging).

        Never free or reassign memory the graph for `descriptor` reads or writes.
        """

    def prepare_replay(self, descriptor: Any, metadata: Any) -> None:
        """Update parameters that live outside the graph before a replay."""
