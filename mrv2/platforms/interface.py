"""The device seam: everything the engine needs to know about a device type."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from mrv2.config import DenseGemvPolicy, GraphConfig, GraphMode, QuantPolicy

from mrv2.platforms.device_queue import DeviceQueue, InlineQueue
from mrv2.platforms.graphs import EagerGraphBackend, GraphBackend


class Platform(ABC):
    """One device type. Only `mrv2.platforms` names a device; the rest asks this object."""

    name: str
    device_type: str
    # Default byte alignment of KV-cache base addresses.
    kv_alignment: int = 256
    # Whether a profile run's peak memory can be measured (device allocators keep peak
    # statistics; host RSS cannot be attributed to one forward pass).
    measures_peak_memory: bool = True
    # Vocabulary rows per LM-head GEMM (None: one GEMM).
    logits_chunk_rows: int | None = None
    # Async scheduling when the user does not choose (on where `mrv2 bench throughput` measures it no slower).
    default_async_scheduling: bool = True
    # Logits elements per chunk of rows in Gumbel sampling (None: all rows at once).
    sampling_chunk_elems: int | None = None
    # Upper bound on the KV cache's size when the user gives none (None: free memory decides).
    kv_cache_cap_bytes: int | None = None
    # Attention backend names (see `mrv2.attention.registry`) per attention kind, preferred first.
    # The portable torch backends run everywhere; a device lists its own kernels before them.
    attention_backends: Mapping[str, tuple[str, ...]] = MappingProxyType({"gqa": ("torch",), "mla": ("torch-mla",)})
    # The torch.distributed backend of process groups between ranks on this device type.
    dist_backend: str = "gloo"
    # Whether the ranks of one machine draw on one memory (host RAM) rather than a device each.
    ranks_share_memory: bool = False
    # The Ray resource one rank takes (one per placement-group bundle).
    ray_resource: str = "CPU"
    # Whether ranks on one machine exchange tensors through shared memory (`distributed/shm_exchange.py`).
    shm_collectives: bool = False

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)

    @abstractmethod
    def is_available(self) -> bool: ...

    @abstractmethod
    def supports_native_bf16(self) -> bool: ...

    def resolve_dtype(self, dtype: str, checkpoint_dtype: torch.dtype | None) -> tuple[torch.dtype, str]:
        """A user dtype string as a torch dtype, and why (for the log).

        "auto" follows vLLM: the half-precision dtype wherever the device computes in it
        natively, even for a float32 checkpoint (float32 is the exact reference mode, asked
        for by name), float32 where bf16 would be emulated.
        """
        names = {
            "float32": torch.float32, "fp32": torch.float32,
            "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16, "fp16": torch.float16,
        }
        if dtype != "auto":
            return names[dtype], f"dtype={dtype!r} was asked for"
        if self.supports_native_bf16():
            half = self.half_dtype(checkpoint_dtype)
            return half, (f"dtype='auto': {self.name} computes in {str(half).removeprefix('torch.')} natively "
                          f"(checkpoint {checkpoint_dtype}); dtype='float32' is the exact reference mode")
        return torch.float32, (f"dtype='auto': {self.name} has no native bf16 (emulated bf16 measured 1.5-4.5x "
                               f"slower than float32)")

    def quant_policy(self, dtype: torch.dtype, quantization: str | None, exact: bool = False,
                     int8_activations: bool = True) -> tuple[QuantPolicy, str]:
        """How quantized checkpoint weights run at `dtype`, and why (for the log). `exact`: float32
        asked for by name, the exact reference mode, which dequantizes unless quantization="gguf".
        `int8_activations`: kernels may quantize activations to int8 per block where that is faster.

        The base platform has no quantized kernels: weights are dequantized.
        """
        return QuantPolicy(), f"{self.name} has no weight-only quantized kernels in mrv2"

    def load_quant_kernels(self, policy: QuantPolicy) -> None:
        """Load the kernels `policy` runs into this process (a runner's, which may not be the engine's)."""

    def weight_storage(self, nbytes: int) -> torch.Tensor:
        """One uint8 buffer of `nbytes` on the device for weights every decode step streams through
        (`CausalLM.finalize_quantization` places the block GEMVs' weights in it, and `CausalLM.use_dense_gemv`
        the dense GEMV's, in the order a step reads them)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def zeroed_storage(self, nbytes: int) -> torch.Tensor:
        """One zeroed uint8 buffer of `nbytes` on the device (the KV cache)."""
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    def linear_pack_rows(self, dtype: torch.dtype) -> int | None:
        """Rows to pack dense linear weights for (`layers/packed.py`) at `dtype`, or None to keep
        plain weights (the base platform: no packed kernels)."""
        return None

    def dense_gemv_policy(self, dtype: torch.dtype) -> tuple[DenseGemvPolicy | None, str]:
        """Whether plain dense weights at `dtype` run small batches on the platform's own GEMV, and why
        (the base platform: no such kernel)."""
        return None, "no dense GEMV kernel on this platform"

    def half_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """The half-precision dtype "auto" picks: the checkpoint's own if it is one, else bf16."""
        return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16

    @abstractmethod
    def free_memory(self) -> int:
        """Bytes the engine may still allocate on the device."""

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory measurement."""

    def peak_memory(self) -> int:
        """Peak bytes allocated on the device since `reset_peak_memory`."""
        raise NotImplementedError(f"{self.name} does not measure peak memory")

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op where execution is synchronous)."""

    def pin_memory(self) -> bool:
        """Whether host staging buffers should be pinned for async copies."""
        return False

    def configure_threads(self, host_only: bool = False) -> None:
        """Set host threading for this device type; `host_only`: this thread launches no device work
        (async scheduling, where the device queue has a thread of its own)."""

    def bind_rank(self, rank: int, world_size: int) -> None:
        """Give this process rank `rank`'s share of the machine (its device, or its cores)."""

    def release_rank(self) -> None:
        """Undo `bind_rank` (the engine's process outlives its ranks)."""

    def compute_threads(self) -> int:
        """Host threads the forward computes with (what a CPU peer engine should get to be fair)."""
        return torch.get_num_threads()

    def device_queue(self, async_scheduling: bool) -> DeviceQueue:
        """Where the runner's device work runs (inline: kernel launches are asynchronous already)."""
        return InlineQueue()

    def new_event(self) -> Any | None:
        """An event to record behind a non-blocking device-to-host copy; None where copies are synchronous."""
        return None

    def attention_backend_names(self, kind: str) -> tuple[str, ...]:
        """Registered backend names for attention `kind`, preferred first (the registry takes the first available)."""
        if kind not in self.attention_backends:
            raise ValueError(f"attention kind must be one of {sorted(self.attention_backends)}, got {kind!r}")
        return self.attention_backends[kind]

    def attention_isa(self) -> int:
        """The instruction set the platform's own attention kernel runs here (its numbering; 0: it has none)."""
        return 0

    def graph_backend(self, config: GraphConfig) -> GraphBackend:
        """How this device records and replays forwards for `config` (eager re-runs where it has no graphs)."""
        return EagerGraphBackend()

    def default_graph_config(self, int4_rows: int = 0, packed_buckets: tuple[int, ...] = (),
                             compiled_decode: bool = False) -> GraphConfig:
        """Graph settings when the user gives none: FULL decode graphs where the device captures graphs.

        `int4_rows`: steps up to this many tokens run every linear layer through the int4
        kernel (0: some never do; `CausalLM.int4_rows`). `packed_buckets`: the row counts
        packed dense GEMMs run as, up to the rows they were packed for (empty: weights are plain).
        `compiled_decode`: a decode step can be compiled whole (the attention backend's
        `compiled_decode_graphs`, and nothing outside the model runs between its layers).
        """
        return GraphConfig(mode=GraphMode.FULL)


class AcceleratorPlatform(Platform):
    """A device with a torch.<device_type> module in the CUDA mould (torch.cuda, torch.npu)."""

    @property
    def _module(self):
        return getattr(torch, self.device_type)

    def free_memory(self) -> int:
        free, _total = self._module.mem_get_info()
        return free

    def reset_peak_memory(self) -> None:
        self._module.reset_peak_memory_stats()

    def peak_memory(self) -> int:
        return self._module.max_memory_allocated()

    def synchronize(self) -> None:
        self._module.synchronize()

    def bind_rank(self, rank: int, world_size: int) -> None:
        self._module.set_device(rank)

    def pin_memory(self) -> bool:
        return True

    def new_event(self) -> Any:
        return self._module.Event()

    def graph_backend(self, config: GraphConfig) -> GraphBackend:
        if config.compile:
            raise ValueError(f"graph compile (torch.compile) is for devices without graph capture; "
                             f"{self.name} captures {self.name.upper()} graphs: leave compile unset")
        return self._graph_backend()

    def _graph_backend(self) -> GraphBackend:
        raise NotImplementedError
