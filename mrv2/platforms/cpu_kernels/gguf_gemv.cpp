// Matrix-vector products on GGUF block weights for small batches (a few rows) on x86 CPUs:
// integer dot products of the weight codes with the activations quantized to int16 per
// 32-value block (a finer step than bf16's rounding), scaled per block in fp32.
//
// A weight [N, K] keeps GGUF's blocks of 32 weights along K, one fp16 scale (and min) each:
// - q4: codes uint8 [N, K / 2], byte j of a block holding weight j in its low nibble and
//   weight j + 16 in its high one (GGUF's Q4_0/Q4_1 order); weight = d * q + m;
// - q8: codes int8 [N, K]; weight = d * q, with one scale a block, or two (`sub_blocks`: one per 16
//   weights, as GGUF's Q6_K has, held as q - 32).
// Weights are read from memory once per call whatever the rows of x: a few rows a pass, over
// tiles of weight rows kept in cache. Output rows are split over the intra-op threads.
// `isa` is the instruction set the caller found in the CPU's flags: 2 for AVX512-VNNI
// (vpdpwssd on 256-bit registers for a few rows of x; one row of x, the batch-1 decode step,
// on 512-bit kernels: vpdpbusd over Q4 and Q8 codes and x's codes as bytes), 1 for AVX2.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

#include "prefetch.inc"

// A thread reads its weight rows in order, a few hundred bytes a row, with a few instructions per
// 64 bytes, where the hardware prefetchers fall behind; the kernels touch the lines ahead of them.
// The multi-row kernels (gguf_dot.inc), a weight row at a time: the row's lines kRowPrefetchBytes on,
// into L1, and the scales of as many rows on. Measured on the default model's Q8_0 LM head (49152 x
// 576, one row of x, 2 vCPU Sapphire Rapids): 1.1-1.4 ms against 1.8-2.1 without.
constexpr int64_t kRowPrefetchBytes = 2048;

// The single-row AVX-512 kernels, which spend fewer instructions a byte: the line kLinePrefetchBytes
// on as each 64 bytes of codes are loaded (`prefetch_streamed`: into L2 on AMD CPUs, L1 elsewhere),
// and a group of rows at a time their scales as far ahead. On a 2 vCPU Zen 4, 8192 bytes ahead into
// L2, a line at a time, against 2048 into L1 a group of rows at a time: the default model's 30 layers
// of GEMVs from memory in 0.70-0.81x the time (`tools/gemv_ab.py`), batch-1 decode 1.21x on that
// model and 1.28x on a Q4_K_M Llama (`mrv2 bench throughput`, medians of 3 alternating pairs). A
// one-off script streaming Q4_K and Q6_K weights measured the level as what matters: 29-47 GB/s into
// L2, 21-26 with 8192 bytes into L1, 17-27 before. Sapphire Rapids keeps its 2048 bytes into L1, now
// a line at a time.
inline const int64_t kLinePrefetchBytes = kPrefetchIntoL2 ? 8192 : 2048;

// Weight rows of `row_bytes` the scales are prefetched ahead by: those `bytes_ahead` of codes ahead.
inline int64_t rows_ahead(int64_t row_bytes, int64_t bytes_ahead = kRowPrefetchBytes) {
  return (bytes_ahead + row_bytes - 1) / row_bytes;
}

// Touches `count` scales from `d16_ahead` (and as many mins from `m16_ahead`), into L1 or as
// `prefetch_streamed` does (`streamed`). Past the end of the weights it touches nothing that faults.
inline void prefetch_scales(const uint16_t* d16_ahead, const uint16_t* m16_ahead, int64_t count, bool streamed) {
  for (int64_t i = 0; i < count * 2; i += 64) {
    for (const uint16_t* p : {d16_ahead, m16_ahead}) {
      if (p == nullptr) continue;
      const char* line = reinterpret_cast<const char*>(p) + i;
      streamed ? prefetch_streamed(line) : _mm_prefetch(line, _MM_HINT_T0);
    }
  }
}

// Touches the lines kRowPrefetchBytes past `row` (of `row_bytes`) and `count` scales (and mins) from
// `d16_ahead` (and `m16_ahead`): those of the row `rows_ahead` on.
inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes, const uint16_t* d16_ahead,
                           const uint16_t* m16_ahead, int64_t count) {
  const char* ahead = reinterpret_cast<const char*>(row) + kRowPrefetchBytes;
  for (int64_t i = 0; i < row_bytes; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
  prefetch_scales(d16_ahead, m16_ahead, count, false);
}

// Rows of x a pass over the weights serves, as many as keep their accumulators in registers:
// 16 ymm registers with AVX2, 32 with AVX-512.
constexpr int64_t kPassRowsAvx2 = 4, kPassRowsAvx512 = 8;
constexpr int64_t kTileRows = 16;  // weight rows every pass reads while they are in cache

// Rows of x's per-block values (scales, sums) are padded with zeros to whole 8-float vectors, so that
// they are converted and multiplied without scalar tails. The weights' scales and mins are stored
// unpadded (every byte of them is read each step), a row right after the previous one, with
// kScaleTail zeros after the last row: the wide loads (8 scales, 16 where a block has two) past a row's
// end read the next row's values (or the tail), which x's zero padding multiplies away.
constexpr int64_t padded_blocks(int64_t blocks) { return (blocks + 7) / 8 * 8; }
constexpr int64_t kScaleTail = 16;

// Rows of x as int16 codes per 32-value block, with each block's scale and exact sum (rows of
// padded_blocks values). Rows the single-row AVX-512 Q4 kernel takes hold their codes as byte
// planes instead (`planes`, see vnni::quantize_x_planes).
struct QuantizedX {
  const int16_t* q;
  const float* d;
  const float* s;
  const uint8_t* planes;
};

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
constexpr bool kVnni = false;
#include "gguf_dot.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
constexpr bool kVnni = true;
#include "gguf_dot.inc"

// _mm512_reduce_add_ps of 8 registers at once, its sums in its order (lane i + lane i + 8, then
// i + 4, then i + 2, then the last two), so each result is bitwise what that row's own reduction
// gives: the registers are transposed as they are added, 25 instructions where 8 reductions take 64.
inline __m256 reduce_add_8(const __m512 (&v)[8]) {
  __m512 t[4];
  for (int i = 0; i < 4; ++i) {  // rows 2i and 2i + 1: [lo + hi of row 2i | lo + hi of row 2i + 1]
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  // Rows 0-3 and 4-7, 4 lanes each (128-bit lane k: row k, or row 4 + k): lane i + lane i + 4.
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88), _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
  // Per 128-bit lane k: [s0 + s2, s0' + s2', s1 + s3, s1' + s3'] of row k (s) and row 4 + k (s').
  const __m512 w = _mm512_add_ps(_mm512_unpacklo_ps(u0, u1), _mm512_unpackhi_ps(u0, u1));
  // (s0 + s2) + (s1 + s3): lane 0 of each 128-bit lane row k, lane 1 row 4 + k.
  const __m512 x = _mm512_add_ps(w, _mm512_shuffle_ps(w, w, 0x4E));
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), x));
}

// Weight rows go kGroupRows at a time through the single-row kernels: a short row (K = 576 is 18
// blocks) spends as much on its scales and final sum as on its blocks, and the rows of a group share
// x's loads and run as independent chains.
constexpr int kGroupRows = 8;

// out[r] = the sum of v[r]'s lanes, in _mm512_reduce_add_ps's order for a group of 8 as for one.
template <int R, typename T>
inline void store_sums(const __m512 (&v)[R], T* out) {
  if constexpr (R == 8) {
    alignas(32) float total[8];
    _mm256_store_ps(total, reduce_add_8(v));
    for (int r = 0; r < R; ++r) out[r] = static_cast<T>(total[r]);
  } else {
    for (int r = 0; r < R; ++r) out[r] = static_cast<T>(_mm512_reduce_add_ps(v[r]));
  }
}

// x's codes as byte planes for the single-row kernels, the int16 code's high byte (signed) and low
// byte (unsigned) apart, in groups of blocks the kernels take a step at a time:
// - Q4, 4 blocks, 256 bytes: 64-byte planes [high bytes of x0..15 | high bytes of x16..31 | low
//   bytes of x0..15 | low bytes of x16..31], each 16 bytes a block (block 4g + k at byte 16k);
// - Q8, 2 blocks, 192 bytes: [high bytes of x0..31 | low bytes of x0..31] (block 2g + k at byte 32k),
//   then 16 int32: -128 times the sums of the high bytes, 4 a 32-bit lane (see dot_row_group_q8).
// Blocks past nb are zeros.
constexpr int64_t plane_group_blocks(bool q4) { return q4 ? 4 : 2; }
constexpr int64_t plane_group_bytes(bool q4) { return q4 ? 256 : 192; }

// One row of x (fp32 or bf16, nb blocks) quantized as `quantize_x` does (the same int16 codes, scales
// and sums), its codes as byte planes.
template <bool kQ4, typename T>
void quantize_x_planes(const T* x, int64_t nb, uint8_t* planes, float* d, float* s) {
  constexpr int64_t kBlocks = plane_group_blocks(kQ4), kBytes = plane_group_bytes(kQ4);
  const int64_t groups = (nb + kBlocks - 1) / kBlocks;
  if (nb % kBlocks) std::fill(planes + (groups - 1) * kBytes, planes + groups * kBytes, uint8_t{0});
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4];
    const __m256 inv = load_block(x + 32 * b, v, d[b], s[b]);
    uint8_t* block = planes + b / kBlocks * kBytes + b % kBlocks * (kQ4 ? 16 : 32);
    for (int i = 0; i < 4; ++i) {  // x8i..x8i+7
      const __m128i c = _mm256_cvtsepi32_epi16(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
      uint8_t* at = kQ4 ? block + i / 2 * 64 + i % 2 * 8 : block + 8 * i;
      _mm_storel_epi64(reinterpret_cast<__m128i*>(at), _mm_cvtepi16_epi8(_mm_srai_epi16(c, 8)));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(at + (kQ4 ? 128 : 64)), _mm_cvtepi16_epi8(c));
    }
  }
  if constexpr (!kQ4) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* group = planes + g * kBytes;
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), _mm512_loadu_si512(group));
      _mm512_storeu_si512(group + 128, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7)));
    }
  }
}

// The rows of one call of `dot_row_q8` (below), R at a time; kSub scales a block (2: one per 16 weights).
template <int R, int kSub, typename T>
void dot_row_group_q8(const QuantizedX& qx, int64_t K, const uint8_t* codes, const uint16_t* d16, T* out,
                      int64_t n0, int64_t n1) {
  const int64_t nb = K / 32, ns = nb * kSub;  // ns: a weight row's scales
  constexpr int64_t kChunk = 16 / kSub;       // blocks whose 16 scales are converted at a time
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  // The scale of each int32 lane (its four products) among a step's: lanes 0-7 block j, 8-15 block j + 1; with
  // two scales a block, lanes 0-3 and 4-7 (its first and last 16 weights) have one each.
  const __m512i lane_blocks = kSub == 1 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                        : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const int64_t pf = kLinePrefetchBytes, ahead = rows_ahead(K, pf) * ns;
  for (int64_t n = n0; n + R <= n1; n += R) {
    const uint8_t* wrow = codes + n * K;
    prefetch_scales(d16 + n * ns + ahead, nullptr, R * ns, true);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += kChunk) {
      const int64_t cb = std::min<int64_t>(kChunk, nb - b0);
      const auto valid = static_cast<__mmask16>((1u << cb) - 1);
      const auto valid_scales = static_cast<__mmask16>((1u << (cb * kSub)) - 1);
      __m512 xd = _mm512_maskz_loadu_ps(valid, qx.d + b0);
      if constexpr (kSub == 2) xd = _mm512_permutexvar_ps(twice, xd);  // x's block scale for each of its halves
      __m512 dd[R];  // the blocks' weight scales times x's
      for (int r = 0; r < R; ++r) {
        const uint16_t* row_scales = d16 + (n + r) * ns + b0 * kSub;
        dd[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid_scales, row_scales)), xd);
      }
      for (int64_t j = 0; j < cb; j += 2) {  // 2 blocks: 64 bytes of codes, 256-bit half k block j + k
        const uint8_t* xp = qx.planes + (b0 + j) / 2 * plane_group_bytes(false);
        const __m512i xh = _mm512_loadu_si512(xp), xl = _mm512_loadu_si512(xp + 64);
        const __m512i high_bias = _mm512_loadu_si512(xp + 128);
        const __m512i lane_scale = _mm512_add_epi32(lane_blocks, _mm512_set1_epi32(static_cast<int>(j * kSub)));
        const bool whole = cb - j >= 2;
        for (int r = 0; r < R; ++r) {
          const uint8_t* w = wrow + r * K + 32 * (b0 + j);
          const __m512i v = whole ? _mm512_loadu_si512(w) : _mm512_zextsi256_si512(load256(w));
          prefetch_streamed(w + pf);
          // q * x = 256 * q * high(x) + low(x) * q, the first as (q + 128) * high(x) less 128 * high(x),
          // the high bytes' sum starting the accumulator.
          const __m512i high = _mm512_dpbusd_epi32(high_bias, _mm512_xor_si512(v, bias), xh);
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(high, 8), xl, v);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lane_scale, dd[r]), acc[r]);
        }
      }
    }
    store_sums(acc, out + n);
  }
}

// out[n] for Q8 weight rows [n0, n1) and one row of x in byte planes (`quantize_x_planes`), 512 bits
// wide: 2 blocks a step, each 256-bit half one block. Signed codes against x's signed high bytes
// take vpdpbusd as codes + 128 (unsigned) less 128 times the high bytes' sums; x's low bytes
// (unsigned) multiply the codes as they are. 7 instructions per 2 blocks where sign-extending each
// block to int16 for vpmaddwd took 7 a block. Rows go kGroupRows at a time, sharing x's loads, each
// row's result what it would be alone (the same sums in the same order).
template <int kSub, typename T>
void dot_row_q8(const QuantizedX& qx, int64_t K, const uint8_t* codes, const uint16_t* d16, T* out, int64_t n0,
                int64_t n1) {
  const int64_t grouped = n0 + (n1 - n0) / kGroupRows * kGroupRows;
  dot_row_group_q8<kGroupRows, kSub, T>(qx, K, codes, d16, out, n0, grouped);
  dot_row_group_q8<1, kSub, T>(qx, K, codes, d16, out, grouped, n1);
}

// The rows of one call of `dot_row_q4` (below), R at a time.
template <int R, typename T>
void dot_row_group_q4(const QuantizedX& qx, int64_t K, const uint8_t* codes, const uint16_t* d16,
                      const uint16_t* m16, T* out, int64_t n0, int64_t n1) {
  const int64_t nb = K / 32, row_bytes = K / 2;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const __m512i lane_blocks = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t pf = kLinePrefetchBytes, ahead = rows_ahead(row_bytes, pf) * nb;
  for (int64_t n = n0; n + R <= n1; n += R) {
    const uint8_t* wrow = codes + n * row_bytes;
    prefetch_scales(d16 + n * nb + ahead, m16 + n * nb + ahead, R * nb, true);
    // One sum a row: lanes hold blocks' scaled products and, 16 blocks at a time, mins times x's sums.
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
      const int64_t cb = std::min<int64_t>(16, nb - b0);
      const auto valid = static_cast<__mmask16>((1u << cb) - 1);
      const __m512 xd = _mm512_maskz_loadu_ps(valid, qx.d + b0), xs = _mm512_maskz_loadu_ps(valid, qx.s + b0);
      __m512 dd[R];  // the blocks' weight scales times x's
      for (int r = 0; r < R; ++r) {
        const int64_t at = (n + r) * nb + b0;
        dd[r] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, d16 + at)), xd);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, m16 + at)), xs, acc[r]);
      }
      for (int64_t j = 0; j < cb; j += 4) {  // 4 blocks: 64 bytes of codes, 128-bit lane k block j + k
        const uint8_t* xp = qx.planes + (b0 + j) / 4 * plane_group_bytes(true);
        const __m512i xh0 = _mm512_loadu_si512(xp), xh1 = _mm512_loadu_si512(xp + 64);
        const __m512i xl0 = _mm512_loadu_si512(xp + 128), xl1 = _mm512_loadu_si512(xp + 192);
        const __m512i lane_scale = _mm512_add_epi32(lane_blocks, _mm512_set1_epi32(static_cast<int>(j)));
        const bool whole = cb - j >= 4;
        const __mmask64 bytes = whole ? ~__mmask64{0} : (__mmask64{1} << (16 * (cb - j))) - 1;
        for (int r = 0; r < R; ++r) {
          const uint8_t* w = wrow + r * row_bytes + 16 * (b0 + j);
          const __m512i v = whole ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi8(bytes, w);
          prefetch_streamed(w + pf);
          const __m512i q0 = _mm512_and_si512(v, low_nibbles);                         // weights 0..15
          const __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);  // weights 16..31
          // q * x = 256 * q * high(x) + q * low(x): the high bytes signed, the low ones unsigned.
          const __m512i high = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q0, xh0), q1, xh1);
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(high, 8), xl0, q0), xl1, q1);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lane_scale, dd[r]), acc[r]);
        }
      }
    }
    store_sums(acc, out + n);
  }
}

// out[n] for Q4 weight rows [n0, n1) and one row of x in byte planes (`quantize_x_planes`), 512 bits
// wide: 4 blocks a step. A weight code (0..15) times an int16 code of x is summed by vpdpbusd from
// its bytes, four products a 32-bit lane: the code against x's high byte (signed), and x's low byte
// (unsigned) against the code, the first sum shifted up by 8 before the second adds to it. The
// codes unpack with a mask and a shift (64 bytes, 4 blocks: low nibbles are a block's weights 0..15,
// high nibbles 16..31, GGUF's order), and each 128-bit lane sums one block, so its scale is one
// permutation of 16 converted at a time: 11 instructions per 4 blocks where one block a register
// took 4 a block. Rows go kGroupRows at a time, sharing x's loads, each row's result what it would be
// alone (the same sums in the same order).
template <typename T>
void dot_row_q4(const QuantizedX& qx, int64_t K, const uint8_t* codes, const uint16_t* d16, const uint16_t* m16,
                T* out, int64_t n0, int64_t n1) {
  const int64_t grouped = n0 + (n1 - n0) / kGroupRows * kGroupRows;
  dot_row_group_q4<kGroupRows, T>(qx, K, codes, d16, m16, out, n0, grouped);
  dot_row_group_q4<1, T>(qx, K, codes, d16, m16, out, grouped, n1);
}
}  // namespace vnni
#pragma GCC pop_options

void check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t code_cols_per_block,
           at::ScalarType code_type, int64_t isa, int64_t sub_blocks = 1) {
  TORCH_CHECK(isa == 1 || isa == 2, "isa must be 1 (AVX2) or 2 (AVX512-VNNI), got ", isa);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in_features] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "in_features must be a multiple of ", kBlock, ", got ", K);
  TORCH_CHECK(codes.scalar_type() == code_type && codes.is_contiguous() && codes.dim() == 2 &&
                  codes.size(1) == K / kBlock * code_cols_per_block,
              "codes must be contiguous [out_features, ", K / kBlock * code_cols_per_block, "] of ", code_type,
              ", got ", codes.sizes(), " of ", codes.scalar_type());
  const int64_t length = codes.size(0) * (K / kBlock) * sub_blocks + kScaleTail;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 1 &&
                  scales.size(0) == length,
              "scales must be contiguous fp16 [", length, "] (out_features rows of a scale per ", kBlock / sub_blocks,
              " in_features, then ", kScaleTail, " zeros), got ", scales.sizes());
}

// x of type T, out of type O (T, or float: logits need not round to bf16 on their way to fp32); kSub scales a
// block of Q8 codes.
template <bool kQ4, int kSub, typename T, typename O>
at::Tensor gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const uint16_t* mins,
                int64_t isa) {
  const int64_t rows = x.size(0), K = x.size(1), N = codes.size(0), nb = K / kBlock;
  const int64_t nbp = padded_blocks(nb);
  const int64_t pass_rows = isa == 2 ? kPassRowsAvx512 : kPassRowsAvx2;
  // The last row, where it is alone in its pass, goes to a single-row AVX-512 kernel: its codes as
  // byte planes.
  const bool planes_row = isa == 2 && rows % pass_rows == 1;
  const int64_t int16_rows = rows - planes_row;
  std::vector<int16_t> q(int16_rows * K);
  const int64_t groups = (nb + vnni::plane_group_blocks(kQ4) - 1) / vnni::plane_group_blocks(kQ4);
  std::vector<uint8_t> planes(planes_row ? groups * vnni::plane_group_bytes(kQ4) : 0);
  std::vector<float> d(rows * nbp), s(rows * nbp);
  const T* xp = x.data_ptr<T>();
  if (isa == 2) {
    vnni::quantize_x(xp, int16_rows, nb, q.data(), d.data(), s.data());
    if (planes_row) {
      vnni::quantize_x_planes<kQ4>(xp + int16_rows * K, nb, planes.data(), d.data() + int16_rows * nbp,
                              s.data() + int16_rows * nbp);
    }
  } else {
    avx2::quantize_x(xp, rows, nb, q.data(), d.data(), s.data());
  }
  at::Tensor out = at::empty({rows, N}, x.options().dtype(c10::CppTypeToScalarType<O>::value));
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* d16 = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  // About 64K weights a task: smaller pieces cost more in scheduling than they save.
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 16) / K);
  O* o = out.data_ptr<O>();
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    // Tiles of kTileRows weight rows stay in cache while every pass of rows of
    // x reads them: large batches read the weights from memory once too.
    for (int64_t t0 = n0; t0 < n1; t0 += kTileRows) {
      const int64_t t1 = std::min(t0 + kTileRows, n1);
      for (int64_t r0 = 0; r0 < rows; r0 += pass_rows) {
        const QuantizedX qx{q.data() + r0 * K, d.data() + r0 * nbp, s.data() + r0 * nbp, planes.data()};
        O* orow = o + r0 * N;
        const int64_t m = std::min(pass_rows, rows - r0);
#define ROWS(M, ISA) ISA::dot_rows<M, kQ4, kSub, O>(qx, K, c, d16, mins, orow, N, t0, t1)
        if (isa == 2) {
          switch (m) {
            case 1:
              if constexpr (kQ4) {
                vnni::dot_row_q4<O>(qx, K, c, d16, mins, orow, t0, t1);
              } else {
                vnni::dot_row_q8<kSub, O>(qx, K, c, d16, orow, t0, t1);
              }
              break;
            case 2: ROWS(2, vnni); break;
            case 3: ROWS(3, vnni); break;
            case 4: ROWS(4, vnni); break;
            case 5: ROWS(5, vnni); break;
            case 6: ROWS(6, vnni); break;
            case 7: ROWS(7, vnni); break;
            default: ROWS(8, vnni); break;
          }
        } else {
          switch (m) {
            case 1: ROWS(1, avx2); break;
            case 2: ROWS(2, avx2); break;
            case 3: ROWS(3, avx2); break;
            default: ROWS(4, avx2); break;
          }
        }
#undef ROWS
      }
    }
  });
  return out;
}

template <bool kQ4, int kSub = 1>
at::Tensor gemv_to(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const uint16_t* mins,
                   int64_t isa, std::optional<at::ScalarType> out_dtype) {
  const at::ScalarType out = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(out == x.scalar_type() || out == at::kFloat, "out_dtype must be x's dtype or float32, got ", out);
  if (x.scalar_type() == at::kFloat) return gemv<kQ4, kSub, float, float>(x, codes, scales, mins, isa);
  return out == at::kFloat ? gemv<kQ4, kSub, at::BFloat16, float>(x, codes, scales, mins, isa)
                           : gemv<kQ4, kSub, at::BFloat16, at::BFloat16>(x, codes, scales, mins, isa);
}

at::Tensor q4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                   int64_t isa, std::optional<at::ScalarType> out_dtype) {
  check(x, codes, scales, kBlock / 2, at::kByte, isa);
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf && mins.is_contiguous(),
              "mins must be shaped and typed like scales");
  return gemv_to<true>(x, codes, scales, reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()), isa, out_dtype);
}

at::Tensor q8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t isa,
                   std::optional<at::ScalarType> out_dtype, int64_t sub_blocks) {
  TORCH_CHECK(sub_blocks == 1 || sub_blocks == 2, "sub_blocks (scales a 32-weight block) must be 1 or 2, got ",
              sub_blocks);
  check(x, codes, scales, kBlock, at::kChar, isa, sub_blocks);
  return sub_blocks == 2 ? gemv_to<false, 2>(x, codes, scales, nullptr, isa, out_dtype)
                         : gemv_to<false, 1>(x, codes, scales, nullptr, isa, out_dtype);
}

}  // namespace

TORCH_LIBRARY(mrv2_gguf, m) {
  m.def("q4_gemv(Tensor x, Tensor codes, Tensor scales, Tensor mins, int isa, ScalarType? out_dtype=None) -> Tensor");
  // sub_blocks: scales a 32-weight block (2: one per 16 weights, Q6_K's).
  m.def("q8_gemv(Tensor x, Tensor codes, Tensor scales, int isa, ScalarType? out_dtype=None, int sub_blocks=1) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(mrv2_gguf, CPU, m) {
  m.impl("q4_gemv", &q4_gemv);
  m.impl("q8_gemv", &q8_gemv);
}
