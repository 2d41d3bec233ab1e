// Matrix products on GGUF block weights for batches of rows on AVX2 CPUs without native bf16 (AMD Zen 3), in
// integers: the weight codes times the fp32 activations quantized to int8 per 32-value block (scale max |x| /
// 127, as llama.cpp's Q8 activations), each block's integer sums scaled once in fp32 (and a Q4 block's min
// times x's exact block sum).
//
// On such a CPU an fp32 GEMM retires 16 multiply-adds a cycle a core (two 8-lane FMAs) and `vpmaddwd`
// as many (one 16-lane instruction); `vpmaddubsw` multiplies 32 bytes at once. int16 codes, as fine as the
// block GEMV's, would need `vpmaddwd` for every product: that variant measured only 1.11x oneDNN's fp32
// GEMM at 64 rows there, this one 2.19x. On AVX512-VNNI (Zen 4) int16 codes split into two bytes for
// `vpdpbusd` took 1.8x the AVX512-BF16 GEMM's time (`gguf_gemm.cpp`); int8 codes there are `gguf_gemm_vnni.cpp`.
//
// Weights are laid out at load (`mrv2.layers.quantization.GemmTiles`, engine "avx2"): for each strip of 8
// output columns n and block of 32 input features, 8 groups of four features, each 8 columns by 4 codes:
// [N / 8, K / 32, 8 g, 8 n, 4] bytes, byte (g, n, i) = q(n, 4g + i), uint8 for Q4 (weight = d * q + m),
// int8 for Q8_0 and Q6_K (weight = d * q); fp32 scales d (and mins m) [N / 8, K / 32, 8 n], Q6_K's [N / 8,
// K / 32, 2, 8 n] (one for features 0..15 of a block, one for 16..31).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;        // input features of a GGUF block
constexpr int64_t kStrip = 8;         // output columns of a strip: one 8-lane vector of sums
constexpr int64_t kStripBlockBytes = kStrip * kBlock;
constexpr int64_t kChunkRows = 96;    // rows of x whose codes stay in cache while every strip passes them
                                      // (whole panels)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

constexpr int64_t kRows = 6;  // rows a pass over a strip serves (a panel): 2 * 6 accumulators + 3 of 16 ymm

#include "vec8.inc"

// x's int8 codes (scale max |x| / 127 a block) are packed in panels of kRows rows, in the order `strip_rows`
// reads them: for each block and group g of four features, the four codes of every row of the panel:
// [M / kRows, K / 32, 8 g, kRows, 4] bytes (one base pointer for all the rows a pass serves). Each block's
// scale and exact sum (what a Q4 weight block's min multiplies): [M / kRows, K / 32, kRows] floats. A last,
// partial panel keeps the stride of a whole one.
constexpr int64_t kGroupBytes = kRows * 4;

// Rows [r0, r1) of x [M, nb * 32] (row stride ldx) into the panels.
void quantize_x(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t nb, uint8_t* panels, float* d, float* s) {
  // packs then packs again leave four-byte groups in the order 0, 2, 4, 6, 1, 3, 5, 7.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * ldx + kBlock * b;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = load8(xb + 8 * i);
      const int64_t at = (r / kRows * nb + b) * kRows + r % kRows;
      const float mx = block_absmax(v, s[at]);
      d[at] = mx / 127.0f;
      const __m256 inv = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
      __m256i c[4];
      for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      alignas(32) uint8_t codes[kBlock];
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes), _mm256_permutevar8x32_epi32(bytes, order));
      uint8_t* to = panels + (r / kRows * nb + b) * 8 * kGroupBytes + r % kRows * 4;
      for (int g = 0; g < 8; ++g) std::memcpy(to + g * kGroupBytes, codes + 4 * g, 4);
    }
  }
}

inline __m256i broadcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The first R rows of a panel (codes `panel`, scales and sums `d`, `s`) against one strip of 8 columns (kSub
// scales a block, 2 for Q8 codes with one per 16 features): out[r, 0..8) with row stride ldo.
template <int R, bool kQ4, int kSub>
void strip_rows(const uint8_t* panel, const float* d, const float* s, int64_t nb, const uint8_t* codes,
                const float* scales, const float* mins, float* out, int64_t ldo) {
  static_assert(kSub == 1 || (kSub == 2 && !kQ4), "sub-block scales are for Q8 codes");
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = codes + b * kStripBlockBytes;
    const uint8_t* xb = panel + b * 8 * kGroupBytes;
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int g = 0; g < 8; ++g) {
      if (kSub == 2 && g == 4) {  // the block's first 16 features, under their own scale
        const __m256 dw = _mm256_loadu_ps(scales + kStrip * 2 * b);
        for (int r = 0; r < R; ++r) {
          const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(d[b * kRows + r]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scale, acc[r]);
          sums[r] = _mm256_setzero_si256();
        }
      }
      const __m256i wg = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * g));
      const uint8_t* xg = xb + g * kGroupBytes;
      if constexpr (kQ4) {
        // Two products of codes 0..15 and -127..127 a 16-bit lane, eight such sums a block: |sum| <= 30480.
        for (int r = 0; r < R; ++r) sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(wg, broadcast4(xg + 4 * r)));
      } else {
        // Q8_0 codes are signed: `vpsignb` moves each weight's sign onto x, whose products with |q| widen at once.
        const __m256i wabs = _mm256_abs_epi8(wg);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_sign_epi8(broadcast4(xg + 4 * r), wg);
          sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, x), ones));
        }
      }
    }
    const __m256 dw = _mm256_loadu_ps(scales + kStrip * (kSub * b + kSub - 1));
    __m256 mw;
    if constexpr (kQ4) mw = _mm256_loadu_ps(mins + kStrip * b);
    for (int r = 0; r < R; ++r) {
      const __m256i total = kQ4 ? _mm256_madd_epi16(sums[r], ones) : sums[r];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dw, _mm256_set1_ps(d[b * kRows + r])), acc[r]);
      if constexpr (kQ4) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(s[b * kRows + r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
}

// The first n <= R rows of a panel against one strip.
template <int R, bool kQ4, int kSub>
void tail_rows(int64_t n, const uint8_t* panel, const float* d, const float* s, int64_t nb, const uint8_t* codes,
               const float* scales, const float* mins, float* out, int64_t ldo) {
  if constexpr (R > 1) {
    if (n < R) return tail_rows<R - 1, kQ4, kSub>(n, panel, d, s, nb, codes, scales, mins, out, ldo);
  }
  strip_rows<R, kQ4, kSub>(panel, d, s, nb, codes, scales, mins, out, ldo);
}

// Rows [r0, r1) of x (r0 a multiple of kRows; its panels `panels`, `d`, `s`) against one strip, a panel at a time.
template <bool kQ4, int kSub>
void strip(const uint8_t* panels, const float* d, const float* s, int64_t nb, int64_t r0, int64_t r1,
           const uint8_t* codes, const float* scales, const float* mins, float* out, int64_t ldo) {
  for (int64_t r = r0; r < r1; r += kRows) {
    const int64_t p = r / kRows;
    tail_rows<kRows, kQ4, kSub>(std::min(kRows, r1 - r), panels + p * nb * 8 * kGroupBytes, d + p * nb * kRows,
                          s + p * nb * kRows, nb, codes, scales, mins, out + r * ldo, ldo);
  }
}

// The bytes and floats x's panels take for M rows.
inline int64_t panel_bytes(int64_t M, int64_t nb) { return (M + kRows - 1) / kRows * nb * 8 * kGroupBytes; }
inline int64_t panel_floats(int64_t M, int64_t nb) { return (M + kRows - 1) / kRows * nb * kRows; }

#pragma GCC pop_options

// Returns the scales a block has: 1, or 2 for int8 codes with scales [N / 8, K / 32, 2, 8] (Q6_K's 16-weight
// sub-blocks: features 0..15, then 16..31).
int64_t check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, at::ScalarType code_type,
              std::optional<at::ScalarType> out_dtype, bool gated) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a float32 [M, K] tensor");
  TORCH_CHECK(codes.dim() == 5 && codes.size(2) == 8 && codes.size(3) == kStrip && codes.size(4) == 4 &&
              codes.scalar_type() == code_type && codes.is_contiguous(),
              "codes must be contiguous [N / 8, K / 32, 8, 8, 4] ", code_type == at::kByte ? "uint8" : "int8");
  TORCH_CHECK(codes.size(1) * kBlock == x.size(1), "codes hold K = ", codes.size(1) * kBlock,
              " input features, x has ", x.size(1));
  const bool two = code_type == at::kChar && scales.dim() == 4;
  TORCH_CHECK((scales.dim() == 3 || two) && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
              scales.size(-1) == kStrip && (!two || scales.size(2) == 2) && scales.scalar_type() == at::kFloat &&
              scales.is_contiguous(),
              "scales must be contiguous float32 [N / 8, K / 32, 8]",
              code_type == at::kChar ? " (or [N / 8, K / 32, 2, 8]: two a block)" : "");
  TORCH_CHECK(out_dtype.value_or(at::kFloat) == at::kFloat, "out_dtype must be float32 (x's), got ", *out_dtype);
  TORCH_CHECK(!gated, "the AVX2 block GEMM has no gated product");
  return two ? 2 : 1;
}

template <bool kQ4, int kSub>
at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const float* mins) {
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, strips = codes.size(0), N = strips * kStrip;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M > 0 && N > 0) {
    std::vector<uint8_t> panels(panel_bytes(M, nb));
    const int64_t floats = panel_floats(M, nb);
    std::vector<float> d(floats), s(floats);
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      quantize_x(x.data_ptr<float>(), x.stride(0), r0, r1, nb, panels.data(), d.data(), s.data());
    });
    const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
    const float* sc = scales.data_ptr<float>();
    float* o = out.data_ptr<float>();
    // Units of work: a strip of columns against a chunk of rows, chunk by chunk, so that the threads
    // pass over the same rows' codes while they are in cache.
    const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
    at::parallel_for(0, chunks * strips, 1, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u / strips * kChunkRows, st = u % strips, r1 = std::min(r0 + kChunkRows, M);
        const uint8_t* w = c + st * nb * kStripBlockBytes;
        const float* m = mins != nullptr ? mins + st * nb * kStrip : nullptr;
        strip<kQ4, kSub>(panels.data(), d.data(), s.data(), nb, r0, r1, w, sc + st * nb * kStrip * kSub, m,
                         o + st * kStrip, N);
      }
    });
  }
  return out;
}

at::Tensor q4_gemm_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                        std::optional<at::ScalarType> out_dtype, bool gated) {
  check(x, codes, scales, at::kByte, out_dtype, gated);
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kFloat && mins.is_contiguous(),
              "mins must be shaped and typed like scales");
  return gemm<true, 1>(x, codes, scales, mins.data_ptr<float>());
}

at::Tensor q8_gemm_avx2(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        std::optional<at::ScalarType> out_dtype, bool gated) {
  return check(x, codes, scales, at::kChar, out_dtype, gated) == 2 ? gemm<false, 2>(x, codes, scales, nullptr)
                                                                   : gemm<false, 1>(x, codes, scales, nullptr);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mrv2_gguf, m) {
  m.def("q4_gemm_avx2(Tensor x, Tensor codes, Tensor scales, Tensor mins, ScalarType? out_dtype=None, "
        "bool gated=False) -> Tensor");
  m.def("q8_gemm_avx2(Tensor x, Tensor codes, Tensor scales, ScalarType? out_dtype=None, bool gated=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(mrv2_gguf, CPU, m) {
  m.impl("q4_gemm_avx2", &q4_gemm_avx2);
  m.impl("q8_gemm_avx2", &q8_gemm_avx2);
}
