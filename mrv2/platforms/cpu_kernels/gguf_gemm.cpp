// Matrix products on GGUF block weights for batches of rows: the weights stay Q4 or Q8_0 in memory, and
// each 16-column by 32-row tile of them is dequantized to bf16 in cache, exactly as a dense bf16 copy of
// the dequantized weights holds them, then multiplied with the activations, summing in fp32: by the AMX
// tile unit on CPUs with AMX (Intel Sapphire Rapids and later, `*_gemm_amx`), by AVX512-BF16 dot
// products elsewhere (`*_gemm_bf16`; where AVX512-VNNI is there too, as on AMD Zen 4, the platform picks the
// integer products of `gguf_gemm_vnni.cpp` over the same tiles).
//
// A dense bf16 copy streams four times the bytes of Q4 weights from memory on every step; here the
// tiles are dequantized once per call, whatever the rows, and reused by every row of x.
//
// Weights are laid out for the tiles at load (`mrv2.layers.quantization.GemmTiles`): for each tile
// of 16 output columns n and 32 input features k, 16 rows r holding the pairs (k = 2r, 2r + 1) of
// every column, as AMX's bf16 B operand and vdpbf16ps take them:
// - q4: [N / 16, K / 32, 16 r, 16 j] bytes, byte j holding the codes of lanes j (low nibble) and
//   j + 16 (high) of the tile row, whose lane 2n + p is q(n, 2r + p); weight = d * q + m;
// - q8: [N / 16, K / 32, 16 r, 16 n, 2] int8 codes q(n, 2r), q(n, 2r + 1); weight = d * q;
// with fp16 scales d (and mins m) [N / 16, K / 32, 16 n]; q8 with two scales a block (Q6_K's 16-weight
// sub-blocks): [N / 16, K / 32, 2, 16 n], the first for tile rows 0-7, the second for rows 8-15.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kTileM = 16;  // rows of x a tile multiplies

// Linux lets a process use AMX's tile data only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); the permission holds for every thread of the process.
bool request_amx() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

#include "gemm_tiles.inc"

// Tiles 0-3: fp32 sums of two row tiles by two column tiles; 4-5: row tiles of x; 6-7: weight tiles.
// Every tile is 16 rows of 64 bytes.
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// A column tile's 16 per-column values (fp16) as two vectors of 16 fp32 lanes, each value twice:
// [v0, v0, v1, v1, ..., v7, v7] and [v8, v8, ..., v15, v15], the order of a tile row's 32 weights.
inline void column_pairs(const uint16_t* v16, __m512& lo, __m512& hi) {
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v16)));
  const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i second = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  lo = _mm512_permutexvar_ps(first, v);
  hi = _mm512_permutexvar_ps(second, v);
}

// 32 weights (as fp32, in tile-row order) to the bf16 tile row at `dst`, rounded to nearest even as a
// dense bf16 copy is. d * q is exact in fp32 (an fp16 times a small integer), so the fused multiply-add
// rounds as the dequantization's multiply then add does.
inline void store_row(uint16_t* dst, __m512 w_lo, __m512 w_hi) {
  _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w_hi, w_lo)));
}

// One weight tile (16 columns x 32 features) into `dst` as AMX's B operand: 16 rows of 32 bf16. `sub`: scales a
// column (2: tile rows 0-7, features 0..15, take the first 16 of `d16`, rows 8-15 the next 16).
template <bool kQ4>
inline void dequantize_tile(const uint8_t* codes, const uint16_t* d16, const uint16_t* m16, uint16_t* dst,
                            int64_t sub) {
  constexpr int64_t kCodeBytes = kQ4 ? kTileElems / 2 : kTileElems;
  prefetch_tiles_ahead(codes, kCodeBytes, d16, m16);
  __m512 d_lo, d_hi, m_lo = _mm512_setzero_ps(), m_hi = _mm512_setzero_ps();
  column_pairs(d16, d_lo, d_hi);
  if constexpr (kQ4) column_pairs(m16, m_lo, m_hi);
  for (int64_t r = 0; r < 16; ++r) {
    if (!kQ4 && sub == 2 && r == 8) column_pairs(d16 + kTileN, d_lo, d_hi);
    __m512 w_lo, w_hi;
    if constexpr (kQ4) {
      // Byte j holds lane j's code in its low nibble and lane j + 16's in its high one: widened to
      // 32 bits, a mask and a shift give both halves of the row, no shuffles across lanes.
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * r)));
      w_lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F)));
      w_hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
      w_lo = _mm512_fmadd_ps(w_lo, d_lo, m_lo);
      w_hi = _mm512_fmadd_ps(w_hi, d_hi, m_hi);
    } else {
      const auto* q = reinterpret_cast<const __m128i*>(codes + 32 * r);
      w_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d_lo);
      w_hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d_hi);
    }
    store_row(dst + 32 * r, w_lo, w_hi);
  }
}

// out[:, column tiles [t0, t1)] for x [M, K] (M a multiple of 16; the first `rows` are real). Two
// column tiles at a time, all K of them dequantized into one half of `scratch` while the tile unit
// multiplies the previous pair's (in the other half) by two row tiles of x at a time: the vector
// units dequantize between the tile multiplications, which run on a unit of their own (measured on
// Sapphire Rapids, this hides only about a third of the dequantization: the two mostly take turns).
template <bool kQ4, typename Out>
void gemm_columns(const at::BFloat16* x, int64_t M, int64_t rows, int64_t K, const uint8_t* codes,
                  const uint16_t* d16, const uint16_t* m16, int64_t sub, Out* out, int64_t N, int64_t t0, int64_t t1,
                  ColumnPairs pairs, uint16_t* scratch) {
  constexpr int64_t kTileBytes = kQ4 ? kTileElems / 2 : kTileElems;
  const int64_t kt = K / kTileK, x_stride = K * static_cast<int64_t>(sizeof(at::BFloat16));
  const int64_t half = 2 * kt * kTileElems;
  auto dequantize = [&](int64_t t, int64_t j, uint16_t* dst) {
    const int64_t tile = pairs.tile(t, j, kt);
    dequantize_tile<kQ4>(codes + tile * kTileBytes, d16 + tile * kTileN * sub, kQ4 ? m16 + tile * kTileN : nullptr,
                         dst + j * kTileElems, sub);
  };
  auto tiles_of = [&](int64_t t) { return t < t1 ? (pairs.two(t, t1) ? 2 : 1) * kt : 0; };
  for (int64_t j = 0; j < tiles_of(t0); ++j) dequantize(t0, j, scratch);
  alignas(64) float sums[4][kTileM * kTileN];
  configure_tiles();
  const int64_t steps = (M + 2 * kTileM - 1) / (2 * kTileM) * kt;  // tile-unit steps of a pair
  for (int64_t t = t0, pass = 0; t < t1; t += pairs.step(), ++pass) {
    const bool two_cols = pairs.two(t, t1);
    const uint16_t* b0 = scratch + (pass % 2) * half;
    const uint16_t* b1 = b0 + kt * kTileElems;
    uint16_t* next = scratch + (1 - pass % 2) * half;
    const int64_t todo = tiles_of(t + pairs.step());
    int64_t done = 0, owed = 0;  // the next pair's tiles dequantized; those owed, in 1 / steps of a tile
    for (int64_t m = 0; m < M; m += 2 * kTileM) {
      const bool two_rows = m + kTileM < M;
      const at::BFloat16* a0 = x + m * K;
      const at::BFloat16* a1 = a0 + kTileM * K;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < kt; ++k) {
        _tile_loadd(4, a0 + k * kTileK, x_stride);
        _tile_loadd(6, b0 + k * kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_rows) {
          _tile_loadd(5, a1 + k * kTileK, x_stride);
          _tile_dpbf16ps(2, 5, 6);
        }
        if (two_cols) {
          _tile_loadd(7, b1 + k * kTileElems, 64);
          _tile_dpbf16ps(1, 4, 7);
          if (two_rows) _tile_dpbf16ps(3, 5, 7);
        }
        for (owed += todo; owed >= steps; owed -= steps) dequantize(t + pairs.step(), done++, next);
      }
      _tile_stored(0, sums[0], 64);
      _tile_stored(1, sums[1], 64);
      _tile_stored(2, sums[2], 64);
      _tile_stored(3, sums[3], 64);
      const int64_t n = t * kTileN;
      const int64_t r0 = std::clamp<int64_t>(rows - m, 0, kTileM), r1 = std::clamp<int64_t>(rows - m - kTileM, 0, kTileM);
      if (pairs.gated) {
        store_gated(sums[0], sums[1], r0, out, N, m, n);
        if (two_rows) store_gated(sums[2], sums[3], r1, out, N, m + kTileM, n);
        continue;
      }
      store_sums(sums[0], r0, out, N, m, n);
      if (two_cols) store_sums(sums[1], r0, out, N, m, n + kTileN);
      if (two_rows) {
        store_sums(sums[2], r1, out, N, m + kTileM, n);
        if (two_cols) store_sums(sums[3], r1, out, N, m + kTileM, n + kTileN);
      }
    }
  }
  _tile_release();
}

// R rows of x ([., K] bf16) by one or two column tiles over all of K, from dequantized tiles b0 and b1
// (kt tiles each, in feature order): per pair of features, each row's two x values broadcast to every
// lane and one vdpbf16ps per column tile, 2R accumulators held in registers (R <= 12 of 32).
template <int R, typename Out>
inline void dot_rows(const at::BFloat16* x, int64_t K, int64_t kt, const uint16_t* b0, const uint16_t* b1,
                     bool two_cols, bool gated, Out* out, int64_t N, int64_t m, int64_t n) {
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    acc0[i] = _mm512_setzero_ps();
    acc1[i] = _mm512_setzero_ps();
  }
  const auto* pairs = reinterpret_cast<const int32_t*>(x + m * K);  // x's features two at a time
  const int64_t row_pairs = K / 2;
  for (int64_t p = 0; p < kt * 16; ++p) {  // tile row p % 16 of tile p / 16 holds feature pair p
    const auto v0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b0 + 32 * p));
    const auto v1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b1 + 32 * p));
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const auto a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pairs[i * row_pairs + p]));
      acc0[i] = _mm512_dpbf16_ps(acc0[i], a, v0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], a, v1);
    }
  }
  alignas(64) float sums[16], ups[16];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    _mm512_store_ps(sums, acc0[i]);
    if (gated) {
      _mm512_store_ps(ups, acc1[i]);
      store_gated(sums, ups, 1, out, N, m + i, n);
      continue;
    }
    store_sums(sums, 1, out, N, m + i, n);
    if (two_cols) {
      _mm512_store_ps(sums, acc1[i]);
      store_sums(sums, 1, out, N, m + i, n + kTileN);
    }
  }
}

constexpr int64_t kDotRows = 12;  // rows of x a dot_rows pass takes at most: 24 accumulators

// out[:, column tiles [t0, t1)] for x [rows, K] with AVX512-BF16 dot products: a pair of column tiles at a
// time, all K of them dequantized into `scratch` (the vector units do both, so there is nothing to
// overlap), then multiplied by blocks of rows.
template <bool kQ4, typename Out>
void gemm_columns_bf16(const at::BFloat16* x, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* d16,
                       const uint16_t* m16, int64_t sub, Out* out, int64_t N, int64_t t0, int64_t t1, ColumnPairs pairs,
                       uint16_t* scratch) {
  constexpr int64_t kTileBytes = kQ4 ? kTileElems / 2 : kTileElems;
  const int64_t kt = K / kTileK;
  // Row blocks of even size (16 rows: two of 8, not 12 and 4).
  const int64_t blocks = (rows + kDotRows - 1) / kDotRows, per = (rows + blocks - 1) / blocks;
  for (int64_t t = t0; t < t1; t += pairs.step()) {
    const bool two_cols = pairs.two(t, t1);
    for (int64_t j = 0; j < (two_cols ? 2 : 1) * kt; ++j) {
      const int64_t tile = pairs.tile(t, j, kt);
      dequantize_tile<kQ4>(codes + tile * kTileBytes, d16 + tile * kTileN * sub, kQ4 ? m16 + tile * kTileN : nullptr,
                           scratch + j * kTileElems, sub);
    }
    const uint16_t* b1 = two_cols ? scratch + kt * kTileElems : scratch;
    for (int64_t m = 0; m < rows; m += per) {
      switch (std::min(per, rows - m)) {
#define MRV2_DOT_ROWS(r) \
  case r:                \
    dot_rows<r>(x, K, kt, scratch, b1, two_cols, pairs.gated, out, N, m, t * kTileN); \
    break;
        MRV2_DOT_ROWS(1) MRV2_DOT_ROWS(2) MRV2_DOT_ROWS(3) MRV2_DOT_ROWS(4) MRV2_DOT_ROWS(5) MRV2_DOT_ROWS(6)
        MRV2_DOT_ROWS(7) MRV2_DOT_ROWS(8) MRV2_DOT_ROWS(9) MRV2_DOT_ROWS(10) MRV2_DOT_ROWS(11) MRV2_DOT_ROWS(12)
#undef MRV2_DOT_ROWS
        default:
          break;
      }
    }
  }
}

#pragma GCC pop_options

// The scales a tile's column has (see check_tiles).
int64_t check(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t tile_bytes,
              at::ScalarType code_type, bool amx) {
  TORCH_CHECK(!amx || request_amx(), "this CPU or kernel gives no AMX tile data to the process");
  return check_tiles(x, codes, scales, tile_bytes, code_type);
}

template <bool kQ4, typename Out>
at::Tensor gemm(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales, const uint16_t* mins,
                int64_t sub, bool amx, bool gated) {
  const int64_t rows = x_in.size(0), K = x_in.size(1), tiles = codes.size(0);
  const ColumnPairs pairs = ColumnPairs::of(tiles, gated);
  const int64_t N = pairs.out_columns(tiles);
  // AMX multiplies whole tiles of 16 rows: zeros below the real rows.
  const int64_t M = amx ? (rows + kTileM - 1) / kTileM * kTileM : rows;
  at::Tensor x = x_in;
  if (M != rows) {
    x = at::zeros({M, K}, x_in.options());
    x.narrow(0, 0, rows).copy_(x_in);
  }
  at::Tensor out = at::empty({rows, N}, x_in.options().dtype(c10::CppTypeToScalarType<Out>::value));
  if (rows == 0) return out;
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  const auto* d16 = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  auto* o = out.data_ptr<Out>();
  // Pairs of column tiles are the unit of work: each dequantizes its weights once.
  at::parallel_for(0, pairs.units(tiles), 1, [&](int64_t p0, int64_t p1) {
    // A column pair's tiles (AMX: two halves, one dequantized while the other is multiplied), written
    // before they are read; kept from call to call (a fresh buffer of a few hundred KB is mapped and
    // faulted in on every call).
    thread_local std::vector<uint16_t> scratch;
    scratch.resize(std::max<size_t>(scratch.size(), 4 * (K / kTileK) * kTileElems));
    const int64_t t0 = pairs.first(p0, tiles), t1 = pairs.first(p1, tiles);
    if (amx) {
      gemm_columns<kQ4, Out>(xp, M, rows, K, c, d16, mins, sub, o, N, t0, t1, pairs, scratch.data());
    } else {
      gemm_columns_bf16<kQ4, Out>(xp, rows, K, c, d16, mins, sub, o, N, t0, t1, pairs, scratch.data());
    }
  });
  return out;
}

at::Tensor q4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                   std::optional<at::ScalarType> out_dtype, bool gated, bool amx) {
  check(x, codes, scales, kTileElems / 2, at::kByte, amx);
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.scalar_type() == at::kHalf && mins.is_contiguous(),
              "mins must be shaped and typed like scales");
  const auto* m16 = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  return fp32_out(out_dtype) ? gemm<true, float>(x, codes, scales, m16, 1, amx, gated)
                             : gemm<true, at::BFloat16>(x, codes, scales, m16, 1, amx, gated);
}

at::Tensor q8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   std::optional<at::ScalarType> out_dtype, bool gated, bool amx) {
  const int64_t sub = check(x, codes, scales, kTileElems, at::kChar, amx);
  return fp32_out(out_dtype) ? gemm<false, float>(x, codes, scales, nullptr, sub, amx, gated)
                             : gemm<false, at::BFloat16>(x, codes, scales, nullptr, sub, amx, gated);
}

at::Tensor q4_gemm_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                       std::optional<at::ScalarType> out_dtype, bool gated) {
  return q4_gemm(x, codes, scales, mins, out_dtype, gated, true);
}
at::Tensor q8_gemm_amx(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       std::optional<at::ScalarType> out_dtype, bool gated) {
  return q8_gemm(x, codes, scales, out_dtype, gated, true);
}
at::Tensor q4_gemm_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, std::optional<at::ScalarType> out_dtype, bool gated) {
  return q4_gemm(x, codes, scales, mins, out_dtype, gated, false);
}
at::Tensor q8_gemm_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        std::optional<at::ScalarType> out_dtype, bool gated) {
  return q8_gemm(x, codes, scales, out_dtype, gated, false);
}

bool amx_ready() { return request_amx(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(mrv2_gguf, m) {
  // gated: SwiGLU of the product's two halves of columns (gates, then the values they gate), see ColumnPairs.
  m.def("q4_gemm_amx(Tensor x, Tensor codes, Tensor scales, Tensor mins, ScalarType? out_dtype=None, "
        "bool gated=False) -> Tensor");
  m.def("q8_gemm_amx(Tensor x, Tensor codes, Tensor scales, ScalarType? out_dtype=None, bool gated=False) -> Tensor");
  m.def("q4_gemm_bf16(Tensor x, Tensor codes, Tensor scales, Tensor mins, ScalarType? out_dtype=None, "
        "bool gated=False) -> Tensor");
  m.def("q8_gemm_bf16(Tensor x, Tensor codes, Tensor scales, ScalarType? out_dtype=None, bool gated=False) -> Tensor");
  m.def("amx_ready() -> bool", &amx_ready);
}

TORCH_LIBRARY_IMPL(mrv2_gguf, CPU, m) {
  m.impl("q4_gemm_amx", &q4_gemm_amx);
  m.impl("q8_gemm_amx", &q8_gemm_amx);
  m.impl("q4_gemm_bf16", &q4_gemm_bf16);
  m.impl("q8_gemm_bf16", &q8_gemm_bf16);
}
