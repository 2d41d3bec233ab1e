"""Engine configuration: frozen dataclasses, validated at construction.

`EngineConfig` is what the engine, scheduler and runner are built from. Fields that
depend on the loaded checkpoint (for example `max_model_len` when left unset) are
resolved once by `EngineConfig.resolve` and never change afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

KVLayout = Literal["joint", "split"]

MiB = 1 << 20
GiB = 1 << 30
KV_TRANSFER_ALIGNMENT = 2 * MiB


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and in which precision.

    `model` is an HF checkpoint folder, a `.gguf` file, or None for the embedded
    default model. `dtype` is "auto", "float32", "bfloat16" or "float16"; "auto"
    picks float32 on CPUs without native bf16 support.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, memory budget, layout and alignment.

    The budget is `kv_cache_memory` bytes when set, else `memory_fraction` of the
    device memory that is free after the model is loaded and a profile run done.
    `layout` is "joint" (K and V of a layer in one tensor) or "split" (K and V as
    separate contiguous tensors). `kv_transfer` marks the cache for registration
    with a KV transfer engine, which forces 2 MiB base-address alignment.
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    memory_fraction: float = 0.5
    layout: KVLayout = "joint"
    kv_transfer: bool = False
    alignment: int | None = None  # None: the platform's default

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.layout not in ("joint", "split"):
            raise ValueError(f"layout must be 'joint' or 'split', got {self.layout!r}")
        if self.alignment is not None and (self.alignment <= 0 or self.alignment & (self.alignment - 1)):
            raise ValueError(f"alignment must be a positive power of two, got {self.alignment}")

    def base_alignment(self, platform_default: int) -> int:
        """Byte alignment of every KV tensor's base address."""
        align = self.alignment or platform_default
        return max(align, KV_TRANSFER_ALIGNMENT) if self.kv_transfer else align


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget scheduling limits (vLLM V1 semantics)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enforce_eager: bool = False
    device: str | None = None  # None: the best platform available

    def with_max_model_len(self, max_model_len: int) -> "EngineConfig":
        return replace(self, model=replace(self.model, max_model_len=max_model_len))

    @property
    def max_model_len(self) -> int:
        if self.model.max_model_len is None:
            raise RuntimeError("max_model_len is resolved when the checkpoint is loaded")
        return self.model.max_model_len
