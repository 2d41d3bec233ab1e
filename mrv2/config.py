"""Engine configuration: frozen dataclasses, validated at construction.

`EngineConfig` is what the engine, scheduler and runner are built from. Fields that
depend on the loaded checkpoint (for example `max_model_len` when left unset) are
resolved once by `EngineConfig.resolve` and never change afterwards.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Literal

KVLayout = Literal["joint", "split"]

MiB = 1 << 20
GiB = 1 << 30
KV_TRANSFER_ALIGNMENT = 2 * MiB


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and in which precision.

    `model` is an HF checkpoint folder, a `.gguf` file, or None for the embedded
    default model. `dtype` is "auto", "float32", "bfloat16" or "float16"; "auto"
    picks float32 on CPUs without native bf16 support. `quantization` says what
    becomes of a GGUF file's quantized tensors: "auto" keeps them quantized where the
    platform has a fast kernel for them (int4 kernels for small batches, plus a dense
    copy for larger ones if it fits a quarter of free memory), "gguf" keeps them
    quantized without a dense copy, None (or "none") dequantizes them. `int8_activations` lets the
    kernels for batches of rows on kept-quantized weights quantize the activations to int8 per
    32-value block where that is faster (AVX512-VNNI; AVX2 for float32 activations), as llama.cpp
    does, and vLLM's GGUF kernels (Q8_1 activations) and CPU int4 kernels (IPEX's lowp_mode INT8):
    False keeps bf16 (or float32) activations, finer and slower. `batch_invariant`
    makes a request's logits bitwise independent of the batch it runs in (batch size,
    chunking, preemption, cache hits) at a cost in speed: matmuls in fixed row tiles,
    attention in fixed-shape tiles over max_model_len keys, dense weights
    (`mrv2.layers.batch_invariant`, `mrv2.attention.batch_invariant`). `attention_backend`
    names a registered attention backend (`mrv2.attention.registry`) instead of the platform's
    choice, as vLLM's `--attention-backend`.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    quantization: str | None = "auto"
    int8_activations: bool = True
    batch_invariant: bool = False
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if self.batch_invariant and self.attention_backend is not None:
            raise ValueError("batch_invariant=True chooses its own attention backend; drop attention_backend")
        if self.quantization not in ("auto", "gguf", "none", None):
            raise ValueError(f"quantization must be 'auto', 'gguf' or None, got {self.quantization!r}")
        if self.quantization == "none":  # the CLI's spelling of None
            object.__setattr__(self, "quantization", None)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class QuantPolicy:
    """How quantized weights run on this platform and dtype.

    `int4_max_rows`: batches of at most this many rows use the int4 kernel (0: no fast
    int4 kernel here, weights are dequantized). `dense_budget`: bytes a dense copy of the
    quantized weights may take, for larger batches, where dense GEMMs are faster; the
    copy is kept only if all of it fits (0: never). `gemv_isa`: the instruction set of the
    platform's own block GEMV for those batches (the platform's numbering; 0: torch's int4 kernel).
    `gemm_isa`: batches of more than `int4_max_rows` rows run on the platform's block GEMM over
    the same quantized weights, in the platform's numbering of its instruction sets (0: none;
    no dense copy otherwise; `GemmTiles.takes` says which activations' dtype each takes).
    """

    int4_max_rows: int = 0
    dense_budget: int = 0
    gemv_isa: int = 0
    gemm_isa: int = 0

    @property
    def uses_int4(self) -> bool:
        return self.int4_max_rows > 0


@dataclass(frozen=True)
class DenseGemvPolicy:
    """Dense float32 weights (linear layers and the LM head) run batches of at most `max_rows` rows on
    the platform's own GEMV kernel, in its instruction set `isa` (the platform's numbering); larger ones
    through oneDNN on the same plain weights where `onednn_above` (CPUs whose torch GEMMs, MKL's, are
    slow), else through torch. With `row_stream`, one row reads each weight row front to back (the kernel's
    layout for CPUs where that streams faster; see `cpu_kernels/dense_gemv.cpp`)."""

    isa: int
    max_rows: int
    onednn_above: bool = False
    row_stream: bool = False

    def __post_init__(self) -> None:
        if self.isa <= 0 or self.max_rows <= 0:
            raise ValueError(f"a dense GEMV needs an instruction set and rows, got isa={self.isa}, "
                             f"max_rows={self.max_rows}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, memory budget, layout and alignment.

    The budget is `kv_cache_memory` bytes when set, else `memory_fraction` of the
    device memory that is free after the model is loaded and a profile run done.
    `layout` is "joint" (K and V of a layer in one tensor) or "split" (K and V as
    separate contiguous tensors). `kv_transfer` marks the cache for registration
    with a KV transfer engine, which forces 2 MiB base-address alignment.
    `enable_prefix_caching` lets requests share the KV blocks of a common prefix.
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    memory_fraction: float = 0.5
    layout: KVLayout = "joint"
    kv_transfer: bool = False
    alignment: int | None = None  # None: the platform's default
    enable_prefix_caching: bool = True

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
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names: `method` proposes up to
    `num_speculative_tokens` draft tokens per request and step, which the target model
    verifies in one forward (exactly: the output equals the output without drafts).

    - "ngram" (prompt lookup): the drafts are the tokens that followed the latest earlier
      occurrence of the request's last n tokens in its own prompt and output, for the
      longest n in [`prompt_lookup_min`, `prompt_lookup_max`] that occurs;
    - "draft_model": a smaller model of any supported architecture at `model`, sharing
      the target's tokenizer, drafts greedily with its own KV cache;
    - "eagle" / "eagle3": an Eagle or Eagle-3 head at `model` drafts from the target's
      hidden states;
    - "mtp": DeepSeek-V3's multi-token-prediction layer, from the target's own
      checkpoint (or `model`).

    Model-based drafters keep their KV cache in the target's blocks (same block ids).
    `draft_sampling` "greedy" (the default, as vLLM's Eagle) drafts the drafter's argmax:
    greedy and seeded outputs stay token for token those without drafts. "probabilistic"
    draws a random request's drafts from the drafter's distribution and verifies them with
    the probabilistic rejection sampler: more accepted drafts at high temperatures, the same
    output distribution, but not the same draws.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_sampling: str = "greedy"

    METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
    MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
    NEEDS_MODEL_PATH = ("draft_model", "eagle", "eagle3")  # mtp reads the target's own checkpoint

    def __post_init__(self) -> None:
        if self.method not in self.METHODS:
            raise ValueError(f"speculative_config method must be one of {list(self.METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (lo, hi)) or not 1 <= lo <= hi:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config model must be a path, got {self.model!r}")
        if self.method in self.NEEDS_MODEL_PATH and self.model is None:
            raise ValueError(f"speculative_config method {self.method!r} needs a 'model' (a checkpoint folder)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config method 'ngram' takes no 'model'")
        if self.draft_sampling not in ("greedy", "probabilistic"):
            raise ValueError(f"speculative_config draft_sampling must be 'greedy' or 'probabilistic', "
                             f"got {self.draft_sampling!r}")
        if self.draft_sampling == "probabilistic" and not self.uses_model:
            raise ValueError("speculative_config draft_sampling 'probabilistic' needs a model-based method "
                             "(n-gram drafts are single tokens)")

    @property
    def uses_model(self) -> bool:
        """Whether a drafter model runs on the device after each step (every method but n-gram)."""
        return self.method in self.MODEL_METHODS

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From `LLM(speculative_config={...})` or `--speculative-config JSON`; unknown keys are errors."""
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        return _from_option_dict(cls, d, "speculative_config")


class GraphMode(enum.Enum):
    """What a captured graph holds: nothing (eager), the layers between attention, or all.

    FULL_AND_PIECEWISE captures both: FULL graphs for uniform decode steps, PIECEWISE
    pieces for every other step that fits.
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_AND_PIECEWISE = "full_and_piecewise"


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to `max_size`, and `max_size` itself."""
    if max_size <= 0:
        raise ValueError(f"max_size must be positive, got {max_size}")
    sizes = {s for s in (1, 2, 4) if s <= max_size} | set(range(8, max_size + 1, 8)) | {max_size}
    return sorted(sizes)


def default_seq_len_buckets(max_seq_len: int) -> list[int]:
    """256, 1024, 4096, ... (x4) below `max_seq_len`, then `max_seq_len` itself."""
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    buckets, b = [], 256
    while b < max_seq_len:
        buckets.append(b)
        b *= 4
    return buckets + [max_seq_len]


@dataclass(frozen=True)
class GraphConfig:
    """Graph capture settings.

    `capture_sizes` count requests in FULL mode and tokens in PIECEWISE mode; None
    means `default_capture_sizes(max_capture_size)`. With FULL_AND_PIECEWISE,
    `full_capture_sizes` (if given) are the sizes captured as FULL graphs, and
    `capture_sizes` the PIECEWISE ones. A FULL graph attends over a fixed number of keys
    per request (unless its attention backend reads each request's length on the device),
    so FULL graphs are also captured per bucket of the batch's longest sequence:
    `seq_len_buckets` (rounded up to whole blocks, capped at max_model_len; None means
    `default_seq_len_buckets(max_model_len)`). `compile` runs graphs through torch.compile
    on devices without graph capture (the CPU); None lets the platform choose (the CPU
    compiles PIECEWISE pieces).
    """

    mode: GraphMode = GraphMode.FULL
    capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int = 64
    compile: bool | None = None
    seq_len_buckets: tuple[int, ...] | None = None
    # Tokens per request of the uniform decode steps FULL graphs hold: 1, or 1 + k when
    # every step verifies k draft tokens per request.
    decode_query_len: int = 1
    full_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, GraphMode):
            raise ValueError(f"mode must be a GraphMode, got {self.mode!r}")
        if self.max_capture_size <= 0:
            raise ValueError(f"max_capture_size must be positive, got {self.max_capture_size}")
        if not isinstance(self.decode_query_len, int) or self.decode_query_len <= 0:
            raise ValueError(f"decode_query_len must be a positive integer, got {self.decode_query_len!r}")
        if self.compile and self.mode is GraphMode.NONE:
            raise ValueError("graph compile needs graphs to compile, got mode 'none'")
        if self.full_capture_sizes is not None and self.mode is not GraphMode.FULL_AND_PIECEWISE:
            raise ValueError(f"full_capture_sizes applies to mode 'full_and_piecewise', got {self.mode.value!r}")
        for name in ("capture_sizes", "full_capture_sizes"):
            sizes = getattr(self, name)
            if sizes is None:
                continue
            if not isinstance(sizes, tuple) or not sizes:
                raise ValueError(f"{name} must be a non-empty tuple, got {sizes!r}")
            if any(not isinstance(s, int) or s <= 0 for s in sizes):
                raise ValueError(f"{name} must be positive integers, got {sizes}")
            if len(set(sizes)) != len(sizes):
                raise ValueError(f"{name} must be distinct, got {sizes}")
        buckets = self.seq_len_buckets
        if buckets is not None and (not isinstance(buckets, tuple) or not buckets
                                    or any(not isinstance(b, int) or b <= 0 for b in buckets)):
            raise ValueError(f"seq_len_buckets must be a non-empty tuple of positive integers, got {buckets!r}")

    @property
    def sizes(self) -> list[int]:
        """The capture sizes, ascending."""
        if self.capture_sizes is None:
            return default_capture_sizes(self.max_capture_size)
        return sorted(self.capture_sizes)

    def key_lengths(self, max_model_len: int, block_size: int) -> list[int]:
        """The FULL graphs' key lengths, ascending: buckets in whole blocks, the last one covering max_model_len."""
        def blocks(n: int) -> int:
            return -(-n // block_size) * block_size

        limit = blocks(max_model_len)
        buckets = default_seq_len_buckets(limit) if self.seq_len_buckets is None else self.seq_len_buckets
        return sorted({min(blocks(b), limit) for b in buckets} | {limit})

    def single_modes(self) -> list[GraphConfig]:
        """One config per kind of graph this one captures, in dispatch order (FULL before PIECEWISE)."""
        if self.mode is GraphMode.NONE:
            return []
        if self.mode is not GraphMode.FULL_AND_PIECEWISE:
            return [self]
        full_sizes = self.capture_sizes if self.full_capture_sizes is None else self.full_capture_sizes
        return [replace(self, mode=GraphMode.FULL, capture_sizes=full_sizes, full_capture_sizes=None),
                replace(self, mode=GraphMode.PIECEWISE, full_capture_sizes=None)]


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model spreads over ranks: `tensor_parallel_size` ranks each hold a slice of every
    layer; `distributed_executor_backend` runs them ("mp": one process per rank on this machine,
    "ray": Ray actors; None: mp when there is more than one rank)."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}")

    @property
    def executor_backend(self) -> str | None:
        """The executor that runs the ranks: None for one rank in this process."""
        if self.distributed_executor_backend is None:
            return "mp" if self.tensor_parallel_size > 1 else None
        return self.distributed_executor_backend


def _from_option_dict(cls: type, d: Any, name: str) -> Any:
    """`cls(**d)` for the dict a user gave as option `name` (Python or JSON); unknown keys are errors."""
    if not isinstance(d, dict):
        raise ValueError(f"{name} must be a dict, got {type(d).__name__}")
    known = set(cls.__dataclass_fields__)
    if unknown := sorted(set(d) - known):
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")
    return cls(**d)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar",)


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (vLLM's names): a producer computes prompts' KV and hands it
    to a consumer, which decodes. `kv_connector` names the connector moving the KV
    (`mrv2.distributed.kv_transfer`), `kv_connector_extra_config` holds its options."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_connector must name a connector, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a dict")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, d: "dict | KVTransferConfig | None") -> "KVTransferConfig | None":
        if d is None or isinstance(d, KVTransferConfig):
            return d
        if isinstance(d, dict) and "kv_connector" not in d:
            raise ValueError("kv_transfer_config needs 'kv_connector'")
        return _from_option_dict(cls, d, "kv_transfer_config")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # None: the platform's default (FULL graphs where the platform captures graphs, eager on CPU).
    graph: GraphConfig | None = None
    enforce_eager: bool = False  # as in vLLM: no graphs at all, whatever `graph` says
    device: str | None = None  # None: the best platform available
    # Overlap scheduling and input preparation of step N+1 with step N's compute
    # (vLLM's async_scheduling). None: the platform's default.
    async_scheduling: bool | None = None
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer: KVTransferConfig | None = None
    # Compiles structured outputs' grammars and fills their token bitmasks.
    structured_outputs_backend: str = "xgrammar"

    def __post_init__(self) -> None:
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, "
                             f"got {self.structured_outputs_backend!r}")
        if self.parallel.tensor_parallel_size > 1 and self.speculative is not None and self.speculative.uses_model:
            raise ValueError(f"speculative decoding with {self.speculative.method!r} does not run with "
                             f"tensor_parallel_size > 1 yet (its drafter is not sharded); 'ngram' does")
        if self.model.batch_invariant and self.graph is not None and self.graph.compile:
            raise ValueError("batch_invariant=True runs piecewise graphs uncompiled: torch.compile generates its "
                             "own kernels, whose rounding differs from the eager steps'; drop graph_compile")

    def graph_config(self, platform_default: GraphConfig) -> GraphConfig:
        """The graphs to capture: `graph` or the platform's default; FULL graphs hold verify steps when
        speculating; batch-invariant runs never compile pieces."""
        graph = self.graph or platform_default
        if self.speculative is not None and self.speculative.uses_model and graph.decode_query_len == 1:
            # A drafter gives every decoding request k drafts: verify steps (the last token and the
            # drafts) are the uniform decode steps.
            graph = replace(graph, decode_query_len=1 + self.speculative.num_speculative_tokens)
        if self.model.batch_invariant and graph.mode in (GraphMode.PIECEWISE, GraphMode.FULL_AND_PIECEWISE):
            graph = replace(graph, compile=False)
        return graph

    def with_max_model_len(self, max_model_len: int) -> "EngineConfig":
        return replace(self, model=replace(self.model, max_model_len=max_model_len))

    @property
    def max_model_len(self) -> int:
        if self.model.max_model_len is None:
            raise RuntimeError("max_model_len is resolved when the checkpoint is loaded")
        return self.model.max_model_len
