// Matrix-vector products on dense fp32 weights for a few rows of x: the exact mode's batch-1 decode
// step, whose every linear layer and LM head streams its weights from memory once a step.
//
// A weight [N, K] is row-major, as torch's Linear holds it. Groups of kGroupRows weight rows are
// multiplied with up to a pass's rows of x at a time, accumulators in registers, so a group is read
// from memory once whatever the rows of x (later passes find it in cache). Groups are split over the
// intra-op threads. Each row touches its lines one group ahead (the same place in the next group's
// rows): the hardware prefetchers follow a group's four streams but fall behind. Measured on the
// default model's 120 layer weights and LM head, fp32, one row, 2 vCPU Sapphire Rapids (median of 27
// in-process rounds against F.linear, which calls MKL): 1.15-1.19x one group ahead, 1.06x four, 0.92x
// without (a prefetch of the line being read). On AMD CPUs the lines go to L2 (prefetch.inc): on a 2
// vCPU Zen 4, one row, 15.6 against 21.2 ms into L1, 31 against 37 ms at 16 rows.
// `isa` is the instruction set the caller found in the CPU's flags: 2 for AVX-512F, 1 for AVX2 + FMA.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

#include "prefetch.inc"

constexpr int kGroupRows = 4;
// One row of x with `row_stream` (the caller's choice; the CPU platform asks for it on AMD CPUs): each weight
// row is read front to back, one stream of memory a thread, its lines touched this far ahead. The default
// model's 121 weights at one row, on 2 MiB pages as the engine places them (`tools/dense_gemv_ab.py`, 2 vCPU
// Zen 4, medians of 15 alternating rounds): 0.775x and 0.899x the grouped kernel's time on AVX-512 in two
// runs, 0.911x on AVX2; torch's sum of the same bytes read 55 and 33 GB/s in those runs (the memory the VM
// gets varies by the minute; the grouped kernel stayed near 28-33 GB/s in both). A one-off prototype put 1,
// 1.5 and 3 KiB ahead within the noise of 2, 4 KiB slower, and prefetches into L1 at 0.96x the time only.
constexpr int64_t kLinearAhead = 2048 / sizeof(float);

struct Problem {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t K;
  const float* bias;  // nullptr: none
  float* out;
  int64_t ldo;
};

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

// 16 ymm registers: R * P accumulators, P x loads and a weight's. Passes of 3 rows against 2: the default model's
// 121 weights at 64 rows took 99.7 against 134.2 ms (2 vCPU Zen 4, `tools/dense_linear_bench.py`).
constexpr int kPassRows = 3;

inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Rows [n, n + R) of w against rows [m, m + P) of x.
template <int R, int P>
void dot(const Problem& p, int64_t n, int64_t m, int64_t ahead) {
  const float* w = p.w + n * p.K;
  const float* x = p.x + m * p.ldx;
  __m256 acc[P][R];
  for (int i = 0; i < P; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm256_setzero_ps();
  const int64_t K8 = p.K / 8 * 8;
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[P];
    for (int i = 0; i < P; ++i) xv[i] = _mm256_loadu_ps(x + i * p.ldx + k);
    for (int r = 0; r < R; ++r) {
      if ((k & 15) == 0) prefetch_streamed(w + r * p.K + k + ahead);
      const __m256 wv = _mm256_loadu_ps(w + r * p.K + k);
      for (int i = 0; i < P; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  if (K8 < p.K) {
    alignas(32) int32_t lanes[8];
    for (int j = 0; j < 8; ++j) lanes[j] = K8 + j < p.K ? -1 : 0;
    const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    __m256 xv[P];
    for (int i = 0; i < P; ++i) xv[i] = _mm256_maskload_ps(x + i * p.ldx + K8, mask);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_maskload_ps(w + r * p.K + K8, mask);
      for (int i = 0; i < P; ++i) acc[i][r] = _mm256_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < P; ++i)
    for (int r = 0; r < R; ++r)
      p.out[(m + i) * p.ldo + n + r] = sum8(acc[i][r]) + (p.bias != nullptr ? p.bias[n + r] : 0.0f);
}

// Rows [n0, n1) of w against one row of x, each weight row read front to back (see kLinearAhead).
void single_row(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t K32 = p.K / 32 * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const float* w = p.w + n * p.K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k < K32; k += 32) {
      prefetch_streamed(w + k + kLinearAhead);
      prefetch_streamed(w + k + kLinearAhead + 16);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(p.x + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(p.x + k + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(p.x + k + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(p.x + k + 24), a3);
    }
    float sum = sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < p.K; ++k) sum += w[k] * p.x[k];
    p.out[n] = sum + (p.bias != nullptr ? p.bias[n] : 0.0f);
  }
}

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
namespace avx512 {

constexpr int kPassRows = 4;  // 32 zmm registers

template <int R, int P>
void dot(const Problem& p, int64_t n, int64_t m, int64_t ahead) {
  const float* w = p.w + n * p.K;
  const float* x = p.x + m * p.ldx;
  __m512 acc[P][R];
  for (int i = 0; i < P; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  const int64_t K16 = p.K / 16 * 16;
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 xv[P];
    for (int i = 0; i < P; ++i) xv[i] = _mm512_loadu_ps(x + i * p.ldx + k);
    for (int r = 0; r < R; ++r) {
      prefetch_streamed(w + r * p.K + k + ahead);
      const __m512 wv = _mm512_loadu_ps(w + r * p.K + k);
      for (int i = 0; i < P; ++i) acc[i][r] = _mm512_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  if (K16 < p.K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (p.K - K16)) - 1);
    __m512 xv[P];
    for (int i = 0; i < P; ++i) xv[i] = _mm512_maskz_loadu_ps(mask, x + i * p.ldx + K16);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + r * p.K + K16);
      for (int i = 0; i < P; ++i) acc[i][r] = _mm512_fmadd_ps(wv, xv[i], acc[i][r]);
    }
  }
  for (int i = 0; i < P; ++i)
    for (int r = 0; r < R; ++r)
      p.out[(m + i) * p.ldo + n + r] = _mm512_reduce_add_ps(acc[i][r]) + (p.bias != nullptr ? p.bias[n + r] : 0.0f);
}

void single_row(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t K32 = p.K / 32 * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const float* w = p.w + n * p.K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    int64_t k = 0;
    for (; k < K32; k += 32) {
      prefetch_streamed(w + k + kLinearAhead);
      prefetch_streamed(w + k + kLinearAhead + 16);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(p.x + k), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(p.x + k + 16), a1);
    }
    if (k < p.K) {  // up to 31 features left: one full vector and a masked one, or a masked one
      if (k + 16 <= p.K) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(p.x + k), a0);
        k += 16;
      }
      const __mmask16 mask = static_cast<__mmask16>((1u << (p.K - k)) - 1);
      a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, w + k), _mm512_maskz_loadu_ps(mask, p.x + k), a1);
    }
    p.out[n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + (p.bias != nullptr ? p.bias[n] : 0.0f);
  }
}

}  // namespace avx512
#pragma GCC pop_options

// Weight rows [n, n + R) against every row of x, a pass of up to the instruction set's rows at a
// time; each row's lines `ahead` floats on are prefetched (0: none).
template <int R>
void rows_against_x(const Problem& p, int64_t n, int64_t M, int64_t ahead, int64_t isa) {
  const int64_t pass_rows = isa == 2 ? avx512::kPassRows : avx2::kPassRows;
  for (int64_t m = 0; m < M; m += pass_rows) {
    const int64_t rows = std::min(pass_rows, M - m);
    if (isa == 2) {
      switch (rows) {
        case 1: avx512::dot<R, 1>(p, n, m, ahead); break;
        case 2: avx512::dot<R, 2>(p, n, m, ahead); break;
        case 3: avx512::dot<R, 3>(p, n, m, ahead); break;
        default: avx512::dot<R, 4>(p, n, m, ahead); break;
      }
    } else if (rows == 1) {
      avx2::dot<R, 1>(p, n, m, ahead);
    } else if (rows == 2) {
      avx2::dot<R, 2>(p, n, m, ahead);
    } else {
      avx2::dot<R, 3>(p, n, m, ahead);
    }
  }
}

at::Tensor dense_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      int64_t isa, bool row_stream) {
  TORCH_CHECK(isa == 1 || isa == 2, "isa must be 1 (AVX2) or 2 (AVX-512), got ", isa);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a float32 [M, K] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
              weight.size(1) == x.size(1), "weight must be a contiguous float32 [N, K] tensor, K = x's columns");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                bias->is_contiguous(), "bias must be a contiguous float32 [N] tensor");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor xr = x.stride(1) == 1 ? x : x.contiguous();
  const Problem p{xr.data_ptr<float>(), xr.stride(0), weight.data_ptr<float>(), K,
                  bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), N};
  if (M == 1 && row_stream) {
    const int64_t rows_grain = std::max<int64_t>(1, (int64_t{1} << 16) / K);
    at::parallel_for(0, N, rows_grain, [&](int64_t n0, int64_t n1) {
      if (isa == 2) {
        avx512::single_row(p, n0, n1);
      } else {
        avx2::single_row(p, n0, n1);
      }
    });
    return out;
  }
  const int64_t groups = N / kGroupRows;
  // About 64K weights a task: smaller pieces cost more in scheduling than they save.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (kGroupRows * K));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t ahead = g + 1 < groups ? kGroupRows * K : 0;  // the next group's rows, inside the weight
      rows_against_x<kGroupRows>(p, g * kGroupRows, M, ahead, isa);
    }
  });
  for (int64_t n = groups * kGroupRows; n < N; ++n) rows_against_x<1>(p, n, M, 0, isa);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mrv2, m) {
  m.def("dense_gemv(Tensor x, Tensor weight, Tensor? bias, int isa, bool row_stream=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(mrv2, CPU, m) { m.impl("dense_gemv", &dense_gemv); }
