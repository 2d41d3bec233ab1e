"""The CPU platform: the reference. Execution is synchronous, memory is host RAM."""

from __future__ import annotations

import mmap
import os
import platform
from functools import lru_cache
from types import MappingProxyType

import torch

from mrv2.config import DenseGemvPolicy, GiB, GraphConfig, GraphMode, QuantPolicy
from mrv2.platforms.cpu_kernels import SOURCE_FILES, load_cpu_kernels
from mrv2.platforms.device_queue import DeviceQueue, InlineQueue, WorkerThreadQueue
from mrv2.platforms.graphs import CompiledGraphBackend, EagerGraphBackend, GraphBackend
from mrv2.platforms.interface import Platform


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    return info


GEMV_ISAS = {1: "AVX2", 2: "AVX512-VNNI"}  # CpuPlatform.gemv_isa's numbering, as the kernels take it
ATTENTION_ISAS = {1: "AVX2", 2: "AVX-512 with AVX512-BF16"}  # CpuPlatform.attention_isa's numbering
GEMM_ISAS = {1: "AVX512-BF16", 2: "AMX", 3: "AVX2 int8", 4: "AVX512-VNNI int8"}  # CpuPlatform.gemm_isa's numbering
DENSE_GEMV_ISAS = {1: "AVX2", 2: "AVX-512"}  # CpuPlatform.dense_gemv_policy's numbering


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class CpuPlatform(Platform):
    """Host CPU with torch's own kernels."""

    name = "cpu"
    device_type = "cpu"
    kv_alignment = 64  # a cache line
    measures_peak_memory = False
    # A plain 49152 x 576 LM head measured 13% (64 rows) to 30% (8 rows) faster in 2048-row
    # GEMMs than in one, whose weight panel spills the caches. A packed head (bf16) is one call.
    logits_chunk_rows = 2048
    # Chunks of rows keep sampling's ~15 elementwise passes in cache (the fastest measured
    # at V = 49152 on 2 cores).
    sampling_chunk_elems = 1 << 19
    # Host RAM is shared with everything else on the machine: unless told otherwise, the
    # cache takes at most this much (vLLM's CPU default is 4 GiB as well).
    kv_cache_cap_bytes = 4 * GiB
    # The host's work (scheduling, input preparation, outputs) needs a core the compute threads
    # use too, and hands the GIL to and from a worker thread: on 2 cores the serial loop measured
    # 1.08x, 1.03x and 1.04x async's tok/s at batch 1, 16 and 64 (`mrv2 bench throughput --compare
    # async`, median of 9 pairs).
    default_async_scheduling = False
    ranks_share_memory = True
    # Tensors live in host RAM already; the exchange needs x86's store ordering.
    shm_collectives = platform.machine() in ("x86_64", "AMD64")
    # Decode attention reads KV blocks in place: through mrv2's C++ kernel (`cpu_kernels/
    # paged_attention.cpp`, 2-2.6x the Inductor-compiled one per layer at batch 64) where it loads, else
    # compiled by Inductor (`mrv2.attention.paged_decode`: 2-3x the gather + SDPA path); the gather
    # path where no C++ compiler is found.
    attention_backends = MappingProxyType({"gqa": ("cpp-paged", "inductor-paged", "torch"), "mla": ("torch-mla",)})

    def weight_storage(self, nbytes: int) -> torch.Tensor:
        """Memory backed by 2 MiB pages (transparent huge pages, asked for with madvise) where the kernel
        offers them. A batch-1 step streams ~95 MB of weights: with 4 KiB pages that is ~24,000 TLB misses
        and as many restarts of the hardware prefetchers, which stop at 4 KiB page boundaries. The
        default model's 120 layer GEMVs and its LM head, back to back: 5.87 ms a step on 2 MiB pages
        against 6.2 ms on 4 KiB ones (2 vCPU Sapphire Rapids, median of 8 rounds). The same 121 GEMVs on
        float32 weights (538 MB): 4 KiB / 2 MiB pages took 1.04x, 1.05x and 1.09x the time (2 vCPU Zen 4,
        medians of 20 alternating pairs in three runs)."""
        return _anonymous_pages(nbytes, huge_pages=True)

    def zeroed_storage(self, nbytes: int) -> torch.Tensor:
        """Anonymous memory, which the kernel zeroes a page at a time where it is first touched: a 4 GiB
        KV cache is ready at once (torch.zeros wrote it all before the engine started: 12 s on a 2 vCPU
        VM), and RAM is taken as blocks are used. On 4 KiB pages: a new block touches a few KiB in each
        layer's region, and a huge page there would be a 2 MiB zeroing (and compaction) each time."""
        return _anonymous_pages(nbytes, huge_pages=False)

    def is_available(self) -> bool:
        return True

    def attention_backend_names(self, kind: str) -> tuple[str, ...]:
        names = super().attention_backend_names(kind)
        if "cpp-paged" in names and self.kernels_missing() is not None:
            return tuple(n for n in names if n != "cpp-paged")  # the kernel needs AVX2, FMA, F16C and a compiler
        return names

    def __init__(self, flags: frozenset[str] | None = None, vendor: str | None = None) -> None:
        # The CPU's feature flags and vendor (/proc/cpuinfo); tests pass others to exercise each branch.
        self.flags = frozenset(_cpuinfo().get("flags", "").split() if flags is None else flags)
        self.vendor = _cpuinfo().get("vendor_id", "") if vendor is None else vendor

    def supports_native_bf16(self) -> bool:
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    # torch's int4 CPU kernel against bf16 dense GEMMs (2 cores, Zen 4, the default model's
    # shapes, summed over one layer): 109 vs 234 us at 1 row, 185 vs 270 at 4, 344 vs 328
    # at 8 with weights in cache (from DRAM int4 reads a quarter of the bytes), 2.2x slower
    # at 64 rows. In fp32 the kernel is not vectorized (8 ms for a 3072 x 576 weight).
    int4_max_rows = 8
    # Where native bf16 also prepacks the dense copy (`linear_pack_rows`), dense GEMMs win
    # earlier: on a 2 vCPU Sapphire Rapids, one layer's four GEMMs in cache took int4 / packed
    # 162 / 167 us at 1 row, 245 / 147 at 4, 446 / 154 at 5 (the int4 kernel's cost steps up
    # past 4 rows), 450 / 155 at 8; whole decode steps, weights from DRAM, int4 / dense: 24.5
    # / 41.0 ms at batch 1, 22.4 / 42.4 at 2, 47.5 / 41.0 at 8.
    int4_max_rows_packed = 4

    def quant_policy(self, dtype: torch.dtype, quantization: str | None, exact: bool = False,
                     int8_activations: bool = True) -> tuple[QuantPolicy, str]:
        if quantization is None:
            return QuantPolicy(), "quantization=None was asked for"
        if exact and dtype == torch.float32 and quantization == "auto":
            return QuantPolicy(), "dtype='float32' is the exact reference mode (quantization='gguf' keeps them)"
        if dtype not in (torch.bfloat16, torch.float32):
            return QuantPolicy(), f"no quantized kernels for {str(dtype).removeprefix('torch.')} activations"
        budget = self.free_memory() // 4 if quantization == "auto" else 0
        rows = self.int4_max_rows_packed if self.supports_native_bf16() else self.int4_max_rows
        dense = ("dense GEMMs above when a copy fits a quarter of free memory" if budget else
                 "and above (quantization='gguf': no dense copy)")
        isa = self.gemv_isa()
        failed = self.kernels_missing()
        gemm = self.gemm_isa(dtype, int8_activations) if failed is None else 0
        if gemm:
            rows = {2: self.int4_max_rows_amx, 1: self.int4_max_rows_bf16_gemm, 3: self.int4_max_rows_avx2_gemm,
                    4: self.int4_max_rows_vnni_gemm}[gemm]
            how = ("integer products, the activations quantized to int8 per block" if gemm in (3, 4) else
                   "weights dequantized a tile at a time in cache")
            return QuantPolicy(rows, 0, isa, gemm_isa=gemm), (
                f"mrv2's GGUF block GEMV ({GEMV_ISAS[isa]}) for {_up_to_rows(rows)}, its block GEMM "
                f"({GEMM_ISAS[gemm]}) for more ({how}: no dense copy)")
        if failed is None:
            return QuantPolicy(rows, budget, isa), (
                f"mrv2's GGUF block GEMV ({GEMV_ISAS[isa]}) for {_up_to_rows(rows)} (faster than dense GEMMs there), "
                + dense)
        # torch's int4 kernel is vectorized for bf16 activations only (8 ms for a 3072 x 576
        # weight in fp32).
        if dtype != torch.bfloat16 or not {"avx2", "avx512f"} & self.flags:
            return QuantPolicy(), f"no fast quantized kernel for this CPU and dtype (mrv2's GGUF block GEMV: {failed})"
        return QuantPolicy(rows, budget), (
            f"torch's int4 kernel (mrv2's GGUF block GEMV: {failed}) for {_up_to_rows(rows)} (faster than dense "
            f"GEMMs there), " + dense)

    # mrv2's block GEMV (`cpu_kernels/gguf_gemv.cpp`) multiplies the weight codes with the
    # activations quantized to int16 per 32-value block: one layer of the default model at 1 row
    # (2 cores, Zen 4, weights from DRAM) took 113 us against 131 for torch's int4 kernel, its
    # Q8_0 LM head 0.9 ms against 2.0 (two int4 passes there).
    def gemv_isa(self) -> int:
        """The block GEMV's instruction set on this CPU: 2 AVX512-VNNI, 1 AVX2, 0 none (torch's int4 kernel)."""
        if not {"avx2", "fma", "f16c"} <= self.flags:
            return 0
        return 2 if {"avx512_vnni", "avx512vl", "avx512bw"} <= self.flags else 1

    # The AVX-512 decode attention kernel (`cpu_kernels/paged_attention_avx512.inc`) against the
    # AVX2 one, one layer of the default model (2 vCPU Sapphire Rapids, the engine's joint layout,
    # blocks from DRAM): bf16 61 vs 94 us at batch 1 and 1024 keys, 174 vs 268 at 4 x 1024; fp32 93
    # vs 153 at 1 x 1024; with the blocks in cache, 64 requests of 33-160 keys, 176 vs 365 us.
    def attention_isa(self) -> int:
        """The paged decode attention kernel's instruction set: 2 AVX-512 with AVX512-BF16, 1 AVX2, 0 none."""
        if not self.gemv_isa():
            return 0
        return 2 if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= self.flags else 1

    # mrv2's block GEMM (`cpu_kernels/gguf_gemm.cpp`) on AMX against dense bf16 GEMMs on weights prepacked
    # for oneDNN (2 vCPU Sapphire Rapids, the default model's 30 layers of linears, weights from memory):
    # 7.6 / 6.9 / 8.0 / 10.9 / 17.2 ms against 15.4 / 14.0 / 16.6 / 19.0 / 24.6 at 5 / 16 / 32 / 64 / 128
    # rows: Q4 weights stream a quarter of the bytes, and each tile is dequantized once per call. Its cost
    # hardly grows below 16 rows (7.4-7.7 ms at 1-8), where the block GEMV's does: 5.3 ms at 1 row, 11.8
    # at 2, 12.3 at 4. So the GEMV serves single rows only.
    int4_max_rows_amx = 1
    # The same GEMM with AVX512-BF16 dot products (2 vCPU Zen 4, same 30 layers): 6.2 / 6.4 / 8.3 / 11.6 /
    # 36.9 ms against dense 15.8 / 14.2 / 17.6 / 16.3 / 45.2 at 2 / 4 / 8 / 16 / 64 rows; against the
    # block GEMV 5.5 / 5.6 / 6.1 / 6.0 ms vs 5.2 / 5.1 / 6.6 / 7.7 at 1 / 2 / 3 / 4 rows.
    int4_max_rows_bf16_gemm = 2
    # The same tiles unpacked to bytes for AVX512-VNNI integer products, the activations quantized to int8 per
    # block (`cpu_kernels/gguf_gemm_vnni.cpp`; 2 vCPU Zen 4, same 30 layers and the Q8_0 LM head, 9 alternating
    # rounds): 6.1 / 6.4 / 6.9 / 7.3 / 9.8 / 13.5 / 34.8 ms against the block GEMV's 5.4 / 5.6 / 6.9 / 8.0 / 14.0
    # / 29.4 / 97.2 and the bf16 GEMM's 7.3 / 7.3 / 7.6 / 8.1 / 10.7 / 15.2 / 43.7 at 1 / 2 / 3 / 4 / 8 / 16 / 64
    # rows. So it takes batches from 3 rows on.
    int4_max_rows_vnni_gemm = 2

    def has_amx(self) -> bool:
        """Whether the CPU has AMX with bf16 tiles (and AVX-512-BF16 for the dequantization)."""
        return {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx512vl"} <= self.flags

    # The AVX2 block GEMM (`cpu_kernels/gguf_gemm_avx2.cpp`, activations quantized to int8 per block) against the
    # block GEMV, the default model's 30 layers and Q8_0 LM head (2 vCPU Zen 3, float32, 9 alternating rounds):
    # 9.9 / 11.7 / 17.7 / 22.4 ms against 7.2 / 11.1 / 29.1 / 41.2 at 1 / 4 / 8 / 16 rows.
    int4_max_rows_avx2_gemm = 4

    def gemm_isa(self, dtype: torch.dtype = torch.bfloat16, int8_activations: bool = True) -> int:
        """The block GEMM's instruction set for batches of `dtype` in this process. bf16: 2 AMX (where the OS also
        grants the tile data), 4 AVX512-VNNI integer products (activations quantized to int8 per block), 1
        AVX512-BF16 dot products where there is no VNNI; float32 on CPUs without native bf16 (where it is
        dtype="auto"'s): 3 AVX2 integer products (elsewhere float32 keeps the block GEMV, whose int16 codes are
        finer); 0 none (dense GEMMs on a dequantized copy there). Without `int8_activations`, neither integer GEMM:
        bf16 on the dot products, float32 on the GEMV and a dense copy."""
        if self.kernels_missing() is not None:
            return 0
        if dtype == torch.float32:
            return 0 if self.supports_native_bf16() or not int8_activations else 3
        if dtype != torch.bfloat16:
            return 0
        if self.has_amx() and torch.ops.mrv2_gguf.amx_ready():
            return 2
        # Every CPU with AMX has AVX512-BF16 and VNNI: where its tiles are not granted, the integer products run.
        if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= self.flags:
            return 0
        return 4 if "avx512_vnni" in self.flags and int8_activations else 1

    def kernels_missing(self) -> str | None:
        """Why mrv2's C++ kernels (`cpu_kernels/`) cannot run in this process; None: they are loaded."""
        if not self.gemv_isa():
            return "the CPU lacks AVX2, FMA or F16C"
        return load_cpu_kernels()

    def load_quant_kernels(self, policy: QuantPolicy) -> None:
        if policy.gemv_isa and (failed := load_cpu_kernels()) is not None:
            raise RuntimeError(f"the GGUF block GEMV kernels did not load in this process: {failed}")

    # Dense bf16 GEMMs on weights prepacked for oneDNN against `F.linear` (2 cores, Sapphire
    # Rapids, the default model's four layer shapes summed): 672 vs 893 us at 64 rows, 1.3-1.9x
    # at 1-16 rows, even at 2048, packed for 64 rows. Compiled graphs call them through a
    # custom op (`mrv2.layers.packed.PackedWeight`).
    linear_pack_rows_hint = 64

    def linear_pack_rows(self, dtype: torch.dtype) -> int | None:
        if not (dtype == torch.bfloat16 and self.supports_native_bf16()
                or dtype == torch.float32 and self.packs_fp32()):
            return None
        return self.linear_pack_rows_hint

    # torch's fp32 `F.linear` calls MKL, whose GEMMs run a slower code path on AMD CPUs: the
    # default model's 30 layers of linears (2 cores, Zen 4) took 48 / 88 / 73 / 100 / 200 ms
    # plain against 31 / 34 / 22 / 37 / 114 ms packed for oneDNN at 1 / 2 / 4 / 16 / 64 rows.
    # Packed fp32 is not bit-identical to `F.linear` (about 1e-6 relative); the exact mode's
    # promise is transformers' greedy tokens and close logits, which its tests check. Zen 3
    # (AVX2) is taken by the same cause, unmeasured; Intel CPUs keep MKL, unmeasured there.
    def slow_mkl_fp32(self) -> bool:
        """Whether torch's fp32 GEMMs (MKL's) take a slow path on this CPU (AMD CPUs): its fp32 dense weights
        run through oneDNN instead, packed (`packs_fp32`) or beside mrv2's dense GEMV (`dense_gemv_policy`)."""
        return self.vendor == "AuthenticAMD"

    def streams_gemv_rows(self) -> bool:
        """Whether the dense GEMV reads each weight row front to back at one row of x (`DenseGemvPolicy.row_stream`):
        on AMD CPUs, where that streams faster than the four-row groups tuned on Sapphire Rapids (measured in
        `cpu_kernels/dense_gemv.cpp`; Intel CPUs unmeasured with it)."""
        return self.vendor == "AuthenticAMD"

    def packs_fp32(self) -> bool:
        """Whether fp32 dense weights are prepacked for oneDNN: where MKL's fp32 GEMMs are slow, when mrv2's
        dense GEMV (which reads plain weights, and keeps them so) cannot run."""
        return self.slow_mkl_fp32() and self.kernels_missing() is not None

    # mrv2's dense fp32 GEMV (`cpu_kernels/dense_gemv.cpp`) against `F.linear` (MKL), the default model's
    # 120 layer weights and its LM head from memory (2 vCPU Sapphire Rapids, medians of 27 in-process
    # rounds): 26.9 / 31.4 / 28.2 / 34.7 / 60.5 / 91.3 / 152.5 ms against 32.1 / 35.2 / 51.5 / 63.4 / 82.6 /
    # 96.5 / 124.4 at 1 / 2 / 4 / 8 / 16 / 32 / 64 rows: the weights stream once a call, where MKL's
    # small-row GEMMs read them at 8-17 GB/s. Past 32 rows the multiplications, not the bytes, bound it.
    dense_gemv_max_rows = 16
    # On AMD CPUs larger batches run through oneDNN on the plain weights (MKL is slow there, see
    # `slow_mkl_fp32`). The same 120 weights and LM head (`tools/dense_linear_bench.py`, 2 vCPU Zen 4, the
    # GEMV prefetching into L2): AVX-512 GEMV 19.2 / 31.7 / 101.2 / 191.3 ms against oneDNN on plain
    # weights 29.9 / 52.3 / 113.5 / 189.2 (on packed ones 28.8 / 37.8 / 94.7 / 170.0, MKL 46.9 / 79.9 /
    # 141.6 / 241.7) at 1 / 16 / 64 / 128 rows; the AVX2 GEMV (passes of 3 rows) 15.7 / 32.4 / 102.3 /
    # 191.4 in another run, where oneDNN plain took 26.9 / 48.6 / 111.6 / 187.2 (Zen 3 itself unmeasured).
    # One plain copy serves both, where a packed one is slow at one row.
    dense_gemv_max_rows_amd = 64

    def dense_gemv_policy(self, dtype: torch.dtype) -> tuple[DenseGemvPolicy | None, str]:
        if dtype != torch.float32:
            return None, f"no dense GEMV for {str(dtype).removeprefix('torch.')} weights"
        if (failed := self.kernels_missing()) is not None:
            return None, f"mrv2's dense GEMV: {failed}"
        isa = 2 if "avx512f" in self.flags else 1
        slow_mkl = self.slow_mkl_fp32()
        onednn = slow_mkl and torch.backends.mkldnn.is_available()
        rows = self.dense_gemv_max_rows_amd if slow_mkl else self.dense_gemv_max_rows
        return DenseGemvPolicy(isa, rows, onednn_above=onednn, row_stream=self.streams_gemv_rows()), (
            f"mrv2's dense GEMV ({DENSE_GEMV_ISAS[isa]}) for {_up_to_rows(rows)}, "
            + ("oneDNN on the same plain weights for more (MKL's fp32 GEMMs are slow on AMD CPUs)" if onednn
               else "torch's GEMMs for more"))

    def half_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        # bf16 whatever the checkpoint: CPUs with native bf16 have no fast fp16 GEMMs.
        return torch.bfloat16

    def free_memory(self) -> int:
        try:
            return _meminfo("MemAvailable")
        except (OSError, KeyError):
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def configure_threads(self, host_only: bool = False) -> None:
        # One intra-op thread per core; torch's default may count SMT siblings. With async
        # scheduling the worker thread computes with every core and the host thread with one:
        # a second OpenMP team would make libgomp throttle its spin-waits (more OpenMP threads
        # than cores), which measured 46 ms instead of 34 ms per token at batch 1.
        n = 1 if host_only else self.compute_threads()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        # Subnormal floats take a microcode slow path on x86 (tens of times slower).
        torch.set_flush_denormal(True)

    def compute_threads(self) -> int:
        return len(os.sched_getaffinity(0))

    def bind_rank(self, rank: int, world_size: int) -> None:
        # Each rank computes on its own cores: two OpenMP teams on shared cores would stall each
        # other's collectives. With fewer cores than ranks, ranks share them.
        cores = sorted(os.sched_getaffinity(0))
        self._unbound_cores = cores
        per = max(1, len(cores) // world_size)
        start = (rank * per) % len(cores)
        os.sched_setaffinity(0, cores[start:start + per])

    def release_rank(self) -> None:
        if (cores := getattr(self, "_unbound_cores", None)) is not None:
            os.sched_setaffinity(0, cores)
            self._unbound_cores = None

    def device_queue(self, async_scheduling: bool) -> DeviceQueue:
        # CPU ops run synchronously: a worker thread stands in for the stream, so the host
        # can schedule and prepare the next step while this one computes.
        return WorkerThreadQueue(self.configure_threads) if async_scheduling else InlineQueue(synchronous=True)

    def graph_backend(self, config: GraphConfig) -> GraphBackend:
        # Piecewise on the CPU only pays compiled: uncompiled pieces are eager plus copies
        # (`mrv2 bench decode` times both). FULL graphs compile where asked (the default's whole
        # decode steps do), else re-run eagerly. A FULL graph calls a whole decoder's kernels, some
        # 400 a step for the default model, from C++ rather than Inductor's Python wrapper: batch-1
        # decode steps of the default model took 0.94x the time (median of 7 alternating pairs, 2
        # vCPU Sapphire Rapids). Pieces keep the Python one: the C++ one measured no faster at
        # batches 16 and 64.
        if not self._compiles(config):
            return EagerGraphBackend()
        return CompiledGraphBackend(cpp_wrapper=config.mode is GraphMode.FULL, kernel_sources=SOURCE_FILES)

    @staticmethod
    def _compiles(config: GraphConfig) -> bool:
        return config.mode is GraphMode.PIECEWISE if config.compile is None else config.compile

    # Steps of a few tokens on int4 weights are mostly per-op overhead (about 1,500 small ops a
    # token): compiled pieces fuse the norms, rotary and SwiGLU around the int4 matmuls. Where
    # the dense copy is packed, steps up to the packing's rows are compiled as well, in the
    # packed GEMMs' row buckets (a step pads to the bucket its GEMMs pad to anyway): at batch
    # 64 on a 2 vCPU Zen 4, in-process pairs of the default model (64 output tokens) ran
    # 1.15x and 1.19x the eager steps' tok/s (medians of 7). Where a decode step compiles whole
    # (`compiled_decode`), a decode of one request runs as one compiled FULL graph, without the
    # Python between pieces and attention calls (see `full_decode_max_reqs`), dense models' too:
    # the default model in float32 (2 vCPU Sapphire Rapids) took 25.6 ms a batch-1 decode step
    # compiled against 33.4 eager, whose norms, rotary and gathers are some 1,500 small ops.
    def default_graph_config(self, int4_rows: int = 0, packed_buckets: tuple[int, ...] = (),
                             compiled_decode: bool = False) -> GraphConfig:
        full = tuple(1 << i for i in range(self.full_decode_max_reqs.bit_length()))
        if int4_rows < 1:
            if compiled_decode:
                return GraphConfig(mode=GraphMode.FULL, capture_sizes=full, compile=True)
            # With no graph to save launch overhead, padded static shapes only cost: run eagerly.
            return GraphConfig(mode=GraphMode.NONE)
        sizes = [1 << i for i in range(int4_rows.bit_length())]
        full = tuple(n for n in full if n <= int4_rows)
        sizes += [n for n in packed_buckets if n > sizes[-1]]
        if compiled_decode and full:
            return GraphConfig(mode=GraphMode.FULL_AND_PIECEWISE, capture_sizes=tuple(sizes),
                               full_capture_sizes=full, compile=True)
        return GraphConfig(mode=GraphMode.PIECEWISE, capture_sizes=tuple(sizes), compile=True)

    # Decode steps of up to this many requests run as compiled FULL graphs by default. They save
    # per-layer Python, a fixed cost a step: on a 2 vCPU Zen 4, in-process pairs of decode steps
    # of the default model ran 0.85x the piecewise steps' time at batch 1. But each size traces
    # and compiles every layer at start-up: 7.7 s a size with Inductor's cache warm, about 25 s
    # cold, against 4.5 s for all eight piecewise sizes. Batch 1, the latency case, is worth it.
    full_decode_max_reqs = 1


def _up_to_rows(rows: int) -> str:
    return f"up to {rows} row" + ("" if rows == 1 else "s")


def _anonymous_pages(nbytes: int, huge_pages: bool) -> torch.Tensor:
    """`nbytes` of private anonymous memory (zero until written), 2 MiB aligned, on transparent huge pages
    where asked and the kernel offers them (else on 4 KiB ones); plain zeroed memory where mmap or madvise
    is missing."""
    huge = 2 << 20
    try:
        # Private: anonymous shared memory is shmem, whose huge pages are a separate (usually off) setting.
        buf = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE if huge_pages else mmap.MADV_NOHUGEPAGE)
    except (AttributeError, OSError, ValueError):  # no MADV_HUGEPAGE here (not Linux, or no THP)
        return torch.zeros(nbytes, dtype=torch.uint8)
    start = -torch.frombuffer(buf, dtype=torch.uint8).data_ptr() % huge
    # A tensor of its own storage (offset 0; it keeps `buf` alive): with the KV cache a view at an offset
    # into a larger one, the batch-1 FULL graph Inductor compiled for it ran at 0.85x the speed.
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)
