// Matrix products on GGUF block weights for batches of rows in integers, with AVX512-VNNI (AMD Zen 4; Intel
// CPUs where AMX's tile data is not granted): the weight codes times the bf16 activations quantized to int8 per
// 32-value block (scale max |x| / 127, as llama.cpp's Q8 activations), each block's integer sums scaled once
// in fp32 by the weight block's scale and x's (and a Q4 block's min times x's exact block sum).
//
// `vpdpbusd` multiplies 64 pairs of bytes an instruction where `vdpbf16ps` multiplies 32 pairs of bf16, and on a
// Zen 4 each retires one a cycle a core; per block of 32 features, 16 columns and a row, this kernel issues 8 of
// them and 4 fp32 operations (the block's scaling) against the bf16 GEMM's 16 dot products. Measured on a 2 vCPU
// Zen 4: one layer's 64 x 3072 x 576 product in cache, one thread, 134-138 against 100-105 G multiply-adds a
// second (the bf16 GEMM is at 88% of its peak, this one at 60% of `vpdpbusd`'s: the scaling, unpacking and
// x's quantization); the default model's 30 layers and Q8_0 LM head from memory at 64 rows, 27.8 + 7.7 ms
// against 34.5 + 10.2. Its results are those of int8 activations, as llama.cpp's: the bf16 GEMM's are finer.
//
// Weights stay in the bf16 GEMM's tile layout (`GemmTiles`, engine "bf16"; see `gguf_gemm.cpp`). Each unit of
// work (a pair of 16-column tiles) first unpacks its tiles into cache as `vpdpbusd` takes them: for each block
// of 32 features, 8 groups of four, each 16 columns by 4 unsigned bytes (byte (g, n, i) the code of column n,
// feature 4g + i: a Q4 code 0..15, a Q8 code plus 128), the block's scales (and mins) as fp32 beside them. Q8
// codes may have two scales a block (Q6_K's 16-weight sub-blocks): groups 0-3 are summed under the first, 4-7
// under the second.
// x's codes are signed: a Q8_0 block's sum of (q + 128) * c starts at -128 times the block's sum of x's codes c.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")

#include "gemm_tiles.inc"

constexpr int64_t kGroupBytes = 64;                // 16 columns x 4 features
constexpr int64_t kBlockBytes = 8 * kGroupBytes;  // a block of 32 features, unpacked
constexpr int64_t kPassRows = 12;                 // rows a pass serves: 12 int32 and 12 fp32 sums in registers

// x [rows, K] as the products take it, in panels of `per` rows (a pass's; the last panel may hold fewer): per
// panel and block of 32 features, the rows' int8 codes four features at a time ([8 groups, per, 4] bytes), so
// that one pointer serves every row of a pass; and per panel, block and row, the scale (max |x| / 127), the
// exact sum of the block's values (what a Q4 block's min multiplies) and -128 times the sums of its codes, its
// first 16 and its last 16 (where a Q8 block's sums start: both for one scale a block, each for one of two).
struct QuantizedX {
  int64_t K, kt, per;
  int32_t* codes;  // four codes each
  float* scale;
  float* sum;
  int32_t* offset;  // two a block

  // Over buffers of the calling thread's, kept from call to call (fresh ones of a few hundred KB would be
  // mapped and faulted in on every call).
  QuantizedX(int64_t rows, int64_t K_, int64_t per_) : K(K_), kt(K_ / kTileK), per(per_) {
    thread_local std::vector<int32_t> ints;
    thread_local std::vector<float> floats;
    const int64_t panel_rows = (rows + per - 1) / per * per, blocks = panel_rows * kt;
    ints.resize(std::max<size_t>(ints.size(), panel_rows * K / 4 + 2 * blocks));
    floats.resize(std::max<size_t>(floats.size(), 2 * blocks));
    codes = ints.data();
    offset = codes + panel_rows * K / 4;
    scale = floats.data();
    sum = scale + blocks;
  }

  // Where row r's block b is, in `codes` (its first group) and in the per-block arrays.
  int64_t group0(int64_t r, int64_t b) const { return ((r / per * kt + b) * 8) * per + r % per; }
  int64_t block(int64_t r, int64_t b) const { return (r / per * kt + b) * per + r % per; }

  void quantize(const at::BFloat16* x, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < kt; ++b) {
        const auto* xb = reinterpret_cast<const __m256i*>(x + r * K + b * kTileK);
        const __m512 v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(xb)), 16));
        const __m512 v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(xb + 1)), 16));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const int64_t at = block(r, b);
        scale[at] = amax / 127.0f;
        sum[at] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        // x times 127 / max |x| (a division, then a product), rounded half to even.
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
        const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        offset[2 * at] = -128 * _mm512_reduce_add_epi32(c0);
        offset[2 * at + 1] = -128 * _mm512_reduce_add_epi32(c1);
        alignas(32) int32_t four[8];  // the block's codes, four to a lane
        _mm_store_si128(reinterpret_cast<__m128i*>(four), _mm512_cvtsepi32_epi8(c0));
        _mm_store_si128(reinterpret_cast<__m128i*>(four + 4), _mm512_cvtsepi32_epi8(c1));
        int32_t* to = codes + group0(r, b);
        for (int g = 0; g < 8; ++g) to[g * per] = four[g];
      }
    }
  }
};

// One weight tile (16 columns x 32 features: `codes` in the tile layout, fp16 scales `d16` and mins `m16`) to
// `dst` (kBlockBytes) and fp32 `d` (16 a scale the block has: kSub) and `m` (16).
template <bool kQ4, int kSub>
inline void unpack_tile(const uint8_t* codes, const uint16_t* d16, const uint16_t* m16, uint8_t* dst, float* d,
                        float* m) {
  prefetch_tiles_ahead(codes, kQ4 ? kTileElems / 2 : kTileElems, d16, m16);
  for (int h = 0; h < kSub; ++h) {
    const auto* half = reinterpret_cast<const __m256i*>(d16 + kTileN * h);
    _mm512_storeu_ps(d + kTileN * h, _mm512_cvtph_ps(_mm256_loadu_si256(half)));
  }
  if constexpr (kQ4) _mm512_storeu_ps(m, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m16))));
  auto* out = reinterpret_cast<__m128i*>(dst);
  for (int g = 0; g < 8; ++g, out += 4) {
    // Tile rows 2g and 2g + 1 hold features 4g, 4g + 1 and 4g + 2, 4g + 3 of each column: their 16-bit units
    // (one column's two codes) interleaved give each column's four codes in one 32-bit lane.
    __m128i lo_a, lo_b, hi_a, hi_b;
    if constexpr (kQ4) {
      // Byte j of a tile row: codes of lane j (low nibble) and j + 16 (high); lane 2n + p is column n's feature p.
      const __m128i nibble = _mm_set1_epi8(0x0F);
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * g));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * g + 16));
      lo_a = _mm_and_si128(a, nibble);
      lo_b = _mm_and_si128(b, nibble);
      hi_a = _mm_and_si128(_mm_srli_epi16(a, 4), nibble);
      hi_b = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
    } else {
      // A tile row: 16 columns' two codes; q + 128 as an unsigned byte is q with its top bit flipped.
      const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
      const auto* row = reinterpret_cast<const __m128i*>(codes + 64 * g);
      lo_a = _mm_xor_si128(_mm_loadu_si128(row), flip);
      hi_a = _mm_xor_si128(_mm_loadu_si128(row + 1), flip);
      lo_b = _mm_xor_si128(_mm_loadu_si128(row + 2), flip);
      hi_b = _mm_xor_si128(_mm_loadu_si128(row + 3), flip);
    }
    _mm_storeu_si128(out, _mm_unpacklo_epi16(lo_a, lo_b));
    _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(lo_a, lo_b));
    _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(hi_a, hi_b));
    _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(hi_a, hi_b));
  }
}

// Rows [m, m + R) of x (m the first row of a panel) against one unpacked column tile (all kt blocks: codes
// `w`, scales `d` (kSub a block: one per 32 / kSub features), mins `mn`), the fp32 sums to `sums` ([R, 16]).
template <int R, bool kQ4, int kSub>
void tile_rows(const QuantizedX& x, int64_t m, const uint8_t* w, const float* d, const float* mn, float* sums) {
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t per = x.per;
  const int32_t* xc = x.codes + x.group0(m, 0);
  const float* xs = x.scale + x.block(m, 0);
  const float* xsum = x.sum + x.block(m, 0);
  const int32_t* xoff = x.offset + 2 * x.block(m, 0);
  for (int64_t b = 0; b < x.kt; ++b, xc += 8 * per, xs += per, xsum += per, xoff += 2 * per) {
    const uint8_t* wb = w + b * kBlockBytes;
#pragma GCC unroll 2
    for (int h = 0; h < kSub; ++h) {  // the groups of four features one scale covers: 8 / kSub of them
      __m512i isum[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int32_t start = kSub == 2 ? xoff[2 * r + h] : xoff[2 * r] + xoff[2 * r + 1];
        isum[r] = kQ4 ? _mm512_setzero_si512() : _mm512_set1_epi32(start);
      }
#pragma GCC unroll 8
      for (int g = h * 8 / kSub; g < (h + 1) * 8 / kSub; ++g) {
        const __m512i wg = _mm512_loadu_si512(wb + g * kGroupBytes);
        const int32_t* xg = xc + g * per;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) isum[r] = _mm512_dpbusd_epi32(isum[r], wg, _mm512_set1_epi32(xg[r]));
      }
      const __m512 db = _mm512_loadu_ps(d + kTileN * (kSub * b + h));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(db, _mm512_set1_ps(xs[r])), acc[r]);
      }
    }
    if constexpr (kQ4) {
      const __m512 mb = _mm512_loadu_ps(mn + 16 * b);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(xsum[r]), acc[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums + 16 * r, acc[r]);
}

template <bool kQ4, int kSub>
void tile_rows_n(int64_t n, const QuantizedX& x, int64_t m, const uint8_t* w, const float* d, const float* mn,
                 float* sums) {
  switch (n) {
#define MRV2_TILE_ROWS(r) \
  case r:                 \
    return tile_rows<r, kQ4, kSub>(x, m, w, d, mn, sums);
    MRV2_TILE_ROWS(1) MRV2_TILE_ROWS(2) MRV2_TILE_ROWS(3) MRV2_TILE_ROWS(4) MRV2_TILE_ROWS(5) MRV2_TILE_ROWS(6)
    MRV2_TILE_ROWS(7) MRV2_TILE_ROWS(8) MRV2_TILE_ROWS(9) MRV2_TILE_ROWS(10) MRV2_TILE_ROWS(11) MRV2_TILE_ROWS(12)
#undef MRV2_TILE_ROWS
    default:
      return;
  }
}

// A column tile unpacked: its blocks' codes, then their scales (room for two a block), then their mins.
struct Unpacked {
  uint8_t* codes;
  float* d;
  float* m;

  Unpacked(uint8_t* base, int64_t kt) : codes(base), d(reinterpret_cast<float*>(base + kt * kBlockBytes)),
                                        m(d + 2 * kt * kTileN) {}
  static int64_t bytes(int64_t kt) { return kt * (kBlockBytes + 3 * kTileN * sizeof(float)); }

  template <bool kQ4, int kSub>
  void fill(const uint8_t* codes_in, const uint16_t* d16, const uint16_t* m16, int64_t tile0, int64_t kt) {
    constexpr int64_t kTileBytes = kQ4 ? kTileElems / 2 : kTileElems;
    for (int64_t b = 0; b < kt; ++b) {
      const int64_t tile = tile0 + b;
      unpack_tile<kQ4, kSub>(codes_in + tile * kTileBytes, d16 + tile * kTileN * kSub,
                             kQ4 ? m16 + tile * kTileN : nullptr, codes + b * kBlockBytes, d + b * kTileN * kSub,
                             m + b * kTileN);
    }
  }
};

// out[:, column tiles [t0, t1)]: a pair of column tiles at a time, unpacked into `scratch`, then multiplied by
// passes of rows.
template <bool kQ4, int kSub, typename Out>
void gemm_columns(const QuantizedX& x, int64_t rows, const uint8_t* codes, const uint16_t* d16, const uint16_t* m16,
                  Out* out, int64_t N, int64_t t0, int64_t t1, ColumnPairs pairs, uint8_t* scratch) {
  const int64_t kt = x.kt;
  Unpacked first(scratch, kt), second(scratch + Unpacked::bytes(kt), kt);
  const int64_t per = x.per;
  alignas(64) float sums0[kPassRows * kTileN], sums1[kPassRows * kTileN];
  for (int64_t t = t0; t < t1; t += pairs.step()) {
    const bool two_cols = pairs.two(t, t1);
    first.fill<kQ4, kSub>(codes, d16, m16, t * kt, kt);
    if (two_cols) second.fill<kQ4, kSub>(codes, d16, m16, (t + pairs.partner()) * kt, kt);
    const int64_t n = t * kTileN;
    for (int64_t m = 0; m < rows; m += per) {
      const int64_t r = std::min(per, rows - m);
      tile_rows_n<kQ4, kSub>(r, x, m, first.codes, first.d, first.m, sums0);
      if (two_cols) tile_rows_n<kQ4, kSub>(r, x, m, second.codes, second.d, second.m, sums1);
      if (pairs.gated) {
        store_gated(sums0, sums1, r, out, N, m, n);
        continue;
      }
      store_sums(sums0, r, out, N, m, n);
      if (two_cols) store_sums(sums1, r, out, N, m, n + kTileN);
    }
  }
}

template <bool kQ4, int kSub, typename Out>
at::Tensor gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const uint16_t* mins,
                bool gated) {
  const int64_t rows = x.size(0), K = x.size(1), tiles = codes.size(0);
  const ColumnPairs pairs = ColumnPairs::of(tiles, gated);
  const int64_t N = pairs.out_columns(tiles);
  at::Tensor out = at::empty({rows, N}, x.options().dtype(c10::CppTypeToScalarType<Out>::value));
  if (rows == 0) return out;
  // Passes of even size (16 rows: two of 8, not 12 and 4).
  const int64_t passes = (rows + kPassRows - 1) / kPassRows;
  QuantizedX xq(rows, K, (rows + passes - 1) / passes);
  const auto* xp = x.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { xq.quantize(xp, r0, r1); });
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* d16 = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  auto* o = out.data_ptr<Out>();
  at::parallel_for(0, pairs.units(tiles), 1, [&](int64_t p0, int64_t p1) {
    // Kept from call to call: a fresh buffer would be mapped and faulted in on every call.
    thread_local std::vector<uint8_t> scratch;
    scratch.resize(std::max<size_t>(scratch.size(), 2 * Unpacked::bytes(K / kTileK)));
    gemm_columns<kQ4, kSub, Out>(xq, rows, c, d16, mins, o, N, pairs.first(p0, tiles), pairs.first(p1, tiles), pairs,
                           scratch.data());
  });
  return out;
}

#pragma GCC pop_options

at::Tensor q4_gemm_vnni(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, std::optional<at::ScalarType> out_dtype, bool gated) {
  check_tiles(x, codes, scales, kTileElems / 2, at::kByte);
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf && mins.is_contiguous(),
              "mins must be shaped and typed like scales");
  const auto* m16 = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  return fp32_out(out_dtype) ? gemm<true, 1, float>(x, codes, scales, m16, gated)
                             : gemm<true, 1, at::BFloat16>(x, codes, scales, m16, gated);
}

at::Tensor q8_gemm_vnni(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        std::optional<at::ScalarType> out_dtype, bool gated) {
  if (check_tiles(x, codes, scales, kTileElems, at::kChar) == 2) {
    return fp32_out(out_dtype) ? gemm<false, 2, float>(x, codes, scales, nullptr, gated)
                               : gemm<false, 2, at::BFloat16>(x, codes, scales, nullptr, gated);
  }
  return fp32_out(out_dtype) ? gemm<false, 1, float>(x, codes, scales, nullptr, gated)
                             : gemm<false, 1, at::BFloat16>(x, codes, scales, nullptr, gated);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mrv2_gguf, m) {
  m.def("q4_gemm_vnni(Tensor x, Tensor codes, Tensor scales, Tensor mins, ScalarType? out_dtype=None, "
        "bool gated=False) -> Tensor");
  m.def("q8_gemm_vnni(Tensor x, Tensor codes, Tensor scales, ScalarType? out_dtype=None, bool gated=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(mrv2_gguf, CPU, m) {
  m.impl("q4_gemm_vnni", &q4_gemm_vnni);
  m.impl("q8_gemm_vnni", &q8_gemm_vnni);
}
