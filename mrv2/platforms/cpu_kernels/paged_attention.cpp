// Decode attention over a paged KV cache, reading every key and value in its block (no gathered
// copy): one query token per request, fp32 scores, softmax and sums, for x86 CPUs with AVX2 and FMA.
//
// A task is one request (or, with fewer requests than threads, one KV head of a request): every
// query head scores each cached token's keys (read once, the heads that share a KV head in turn),
// then sums the values weighted by its softmax, with the tokens ahead prefetched (the AVX-512 kernel
// fetches the next task's tokens while it computes instead, `NextRows`). Tasks are split
// over torch's intra-op threads where there is enough work; a single short request runs on the
// calling thread, where a parallel region would cost more than it saves.
//
// `isa` (the caller's choice from the CPU's flags): 1 runs the AVX2 kernel below, 2 the AVX-512 one
// (paged_attention_avx512.inc, which needs AVX512-BF16) for head dims that are multiples of 32
// (values: of 64), the AVX2 one for others.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// torch's vectorized exp (SLEEF, 1 ulp), exported by libtorch_cpu: what ATen's own softmax calls.
extern "C" __m256 Sleef_expf8_u10(__m256);
extern "C" __m512 Sleef_expf16_u10(__m512);

namespace {

#include "prefetch.inc"
#include "vec8.inc"

// Strides (in elements) of a cache [num_blocks, block_size, kv_heads, dim] whose last dim is
// contiguous, and its block count.
struct CacheView {
  int64_t block, token, head, blocks;
};

// Touches the cache lines of `elems` values from `p` ahead of their use: keys and values are
// read a token (a few hundred bytes) at a time from blocks anywhere in memory, too little of a
// stream for the hardware prefetchers, so without this each token waits on DRAM. Into L2 on AMD CPUs
// (prefetch.inc): batch 64 at 96 tokens, one layer of the default model with the cache in memory (2
// vCPU Zen 4), 329 against 450 us a layer into L1 (AVX-512 kernel), 385 against 453 (AVX2).
template <typename T>
inline void prefetch(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < elems * static_cast<int64_t>(sizeof(T)); i += 64) prefetch_streamed(c + i);
}

// Where each of a task's tokens keeps its keys and values (its first KV head): row pointers found
// a block at a time, for the task that runs and for the one after it (`NextRows`).
template <typename T>
struct TokenRows {
  std::vector<const T*> keys, values;
  int64_t len = 0;
  bool fetched = false;  // all in cache already (`NextRows` fetched them): none need fetching ahead

  void fill(const T* k, CacheView ks, const T* v, CacheView vs, const int32_t* table, int64_t block_size,
            int64_t n) {
    len = std::max<int64_t>(n, 0);
    fetched = false;
    keys.resize(len);
    values.resize(len);
    for (int64_t t = 0, j = 0; t < len; ++j) {
      const int64_t b = table[j];
      TORCH_CHECK(b >= 0 && b < ks.blocks, "block ", b, " is outside the cache's ", ks.blocks, " blocks");
      const T* kb = k + b * ks.block;
      const T* vb = v + b * vs.block;
      for (int64_t i = 0; i < block_size && t < len; ++i, ++t) {
        keys[t] = kb + i * ks.token;
        values[t] = vb + i * vs.token;
      }
    }
  }
};

// The next task's keys and values, fetched into cache while this task computes, at an even rate
// over all of it (`start`, then `tick` at each step of its work, `finish`): by the time it starts,
// its tokens are there, no request begins by waiting on memory, and the memory is never idle. A
// task's own tokens fetched a few ahead of their use left the arithmetic and the memory taking
// turns: batch 64 at 96 tokens, with the cache in memory, runs 1.2x faster fetching the next task
// (2 vCPU Sapphire Rapids); fetching it at an even rate through both the scores and the values,
// rather than during the scores only, 244 against 327 us a layer (2 vCPU Zen 4, a cache line at a time;
// a whole token at a time, as now, 222 against 415 us for the kernel before both: `tools/attention_ab.py
// 96c5de9`).
template <typename T>
struct NextRows {
  TokenRows<T>* rows = nullptr;
  int64_t k_span = 0, v_span = 0;
  int64_t fetched = 0;  // the next task's tokens fetched
  int64_t ticks = 1, credit = 0;  // a token is fetched each time credit reaches `ticks` (it gains len a tick)

  // This task does `ticks` steps of work (calls of `tick(1)`).
  void start(int64_t work) { ticks = std::max<int64_t>(work, 1); }

  // Fetches the tokens of `n` steps of work.
  inline void tick(int64_t n) {
    if (rows == nullptr) return;
    for (credit += n * rows->len; credit >= ticks && fetched < rows->len; credit -= ticks) fetch_token();
  }

  // Fetches whatever is left: the next task need fetch none of its tokens.
  void finish() {
    if (rows == nullptr) return;
    while (fetched < rows->len) fetch_token();
    rows->fetched = true;
  }

 private:
  inline void fetch_token() {
    prefetch(rows->keys[fetched], k_span);
    prefetch(rows->values[fetched], v_span);
    ++fetched;
  }
};

constexpr int64_t kAhead = 4;  // tokens prefetched ahead
// Key-heads (tokens x query heads) a group of tasks takes at least. With 2 threads, a batch-1
// request of 9 query heads over 3 KV heads: 128 tokens 12.1 us against 15.0 on one thread, 512
// tokens 38 against 52, 32 tokens 6.2 either way (so it stays on one).
constexpr int64_t kTaskKeyHeads = 1024;

// Scores, softmax and weighted values of one request's query heads (`heads` rows of `q`, `d`
// values each, already scaled; `g` per KV head) over its first `len` tokens; `out` gets
// [heads, dv]. `work` holds heads * (len + dv) floats. A token's keys (or values) of every KV
// head are read together: one short run of memory per token.
template <typename T>
void attend_request(const float* q, int64_t heads, int64_t g, int64_t d, int64_t dv, const TokenRows<T>& rows,
                    CacheView ks, CacheView vs, float* out, float* work) {
  const int64_t kv_heads = heads / g, len = rows.len;
  float* scores = work;             // [heads, len]
  float* acc = work + heads * len;  // [heads, dv]
  auto key = [&](int64_t t) { return rows.keys[t]; };
  auto value = [&](int64_t t) { return rows.values[t]; };
  const int64_t k_span = (kv_heads - 1) * ks.head + d, v_span = (kv_heads - 1) * vs.head + dv;
  for (int64_t t = 0; t < std::min(kAhead, len); ++t) prefetch(key(t), k_span);
  for (int64_t t = 0; t < len; ++t) {
    if (t + kAhead < len) prefetch(key(t + kAhead), k_span);
    const T* kt = key(t);
    for (int64_t h = 0; h < heads; ++h) {
      const T* kp = kt + (h / g) * ks.head;
      const float* qh = q + h * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= d; i += 16) {
        a0 = _mm256_fmadd_ps(load8(qh + i), load8(kp + i), a0);
        a1 = _mm256_fmadd_ps(load8(qh + i + 8), load8(kp + i + 8), a1);
      }
      if (i + 8 <= d) {
        a0 = _mm256_fmadd_ps(load8(qh + i), load8(kp + i), a0);
        i += 8;
      }
      float tail = 0.0f;
      for (; i < d; ++i) tail += qh[i] * static_cast<float>(kp[i]);
      scores[h * len + t] = hsum(_mm256_add_ps(a0, a1)) + tail;
    }
  }
  for (int64_t t = 0; t < std::min(kAhead, len); ++t) prefetch(value(t), v_span);
  std::vector<float> inv_sum(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * len;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    float m = hmax(mv);
    for (; t < len; ++t) m = std::max(m, s[t]);
    const __m256 mb = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    float sum = 0.0f;
    for (t = 0; t + 8 <= len; t += 8) {
      const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(s + t), mb));
      _mm256_storeu_ps(s + t, e);
      sv = _mm256_add_ps(sv, e);
    }
    for (; t < len; ++t) sum += (s[t] = std::exp(s[t] - m));
    inv_sum[h] = 1.0f / (sum + hsum(sv));
  }
  // Weighted values, a head and 64 columns at a time in registers; the first pass brings the
  // values into cache (prefetched ahead), the other heads read them from there.
  for (int64_t h = 0; h < heads; ++h) {
    const float* p = scores + h * len;
    const int64_t off = (h / g) * vs.head;
    float* o = acc + h * dv;
    int64_t c = 0;
    for (; c + 64 <= dv; c += 64) {
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        if (h == 0 && c == 0 && t + kAhead < len) prefetch(value(t + kAhead), v_span);
        const T* vp = value(t) + off + c;
        const __m256 w = _mm256_set1_ps(p[t]);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(w, load8(vp + 8 * j), a[j]);
      }
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + c + 8 * j, a[j]);
    }
    for (; c + 8 <= dv; c += 8) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t t = 0; t < len; ++t) a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), load8(value(t) + off + c), a);
      _mm256_storeu_ps(o + c, a);
    }
    for (; c < dv; ++c) {
      float a = 0.0f;
      for (int64_t t = 0; t < len; ++t) a += p[t] * static_cast<float>(value(t)[off + c]);
      o[c] = a;
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < dv; ++i) out[h * dv + i] = acc[h * dv + i] * inv_sum[h];
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#include "paged_attention_avx512.inc"
#pragma GCC pop_options

// `heads` query heads (`q_head` apart from `src`) into `dst` [heads, d]: bf16 as they are (the
// AVX-512 kernel's vdpbf16ps takes them so, and scales the sums), fp32 times the scale.
template <typename Q, typename T>
void load_query(const T* src, int64_t q_head, int64_t heads, int64_t d, double scale, Q* dst) {
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d; ++i) {
      const T x = src[h * q_head + i];
      dst[h * d + i] = std::is_same_v<Q, float> ? static_cast<Q>(static_cast<float>(x) * static_cast<float>(scale))
                                                : static_cast<Q>(x);
    }
  }
}

template <typename T>
void decode(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t rows, int64_t isa,
            at::Tensor& out) {
  const int64_t heads = query.size(1), d = query.size(2);
  const int64_t kv_heads = k_cache.size(2), dv = v_cache.size(3), g = heads / kv_heads;
  const int64_t block_size = k_cache.size(1);
  const CacheView ks{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.size(0)};
  const CacheView vs{v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.size(0)};
  const T* qp = query.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tp = block_table.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t q_row = query.stride(0), q_head = query.stride(1), t_row = block_table.stride(0);
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max<int64_t>(longest, lp[r]);
  TORCH_CHECK(longest <= block_table.size(1) * block_size, "a sequence of ", longest, " tokens overruns its ",
              block_table.size(1), " blocks of ", block_size);
  // A task is a request, or, with fewer requests than threads, one KV head of a request (its query
  // heads share the keys and values read). Tasks are grouped to about kTaskKeyHeads key-heads: one
  // short request stays on this thread, where a parallel region would cost more than it saves.
  const int64_t split = rows < at::get_num_threads() ? kv_heads : 1, task_kv_heads = kv_heads / split;
  const int64_t task_heads = task_kv_heads * g;
  const int64_t grain = std::max<int64_t>(1, kTaskKeyHeads / std::max<int64_t>(1, longest * task_heads));
  const bool wide = isa == 2 && d % 32 == 0 && dv % 64 == 0;
  using Q = typename QueryOf<T>::type;
  const int64_t k_span = (task_kv_heads - 1) * ks.head + d, v_span = (task_kv_heads - 1) * vs.head + dv;
  at::parallel_for(0, rows * split, grain, [&](int64_t begin, int64_t end) {
    // The query heads as the kernel that runs takes them (QueryOf<T> for the AVX-512 one, fp32 else).
    std::vector<float> q(wide ? 0 : task_heads * d), o(task_heads * dv), work(task_heads * (longest + dv));
    std::vector<Q> q_wide(wide ? task_heads * d : 0);
    // Task `task`'s tokens (its request's, from its first KV head) into `into`.
    auto task_rows = [&](int64_t task, TokenRows<T>& into) {
      const int64_t r = task / split, kv0 = task % split * task_kv_heads;
      into.fill(kp + kv0 * ks.head, ks, vp + kv0 * vs.head, vs, tp + r * t_row, block_size, lp[r]);
    };
    TokenRows<T> current, following;  // this task's tokens and the next one's
    task_rows(begin, current);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / split, h0 = task % split * task_heads;
      T* dst = op + (r * heads + h0) * dv;
      // The AVX-512 kernel fetches the next task's tokens as it goes (the AVX2 one, bound by its
      // arithmetic, ran 0.91-0.98x as fast doing so).
      NextRows<T> next;
      if (task + 1 < end) {
        task_rows(task + 1, following);
        if (wide) next = NextRows<T>{&following, k_span, v_span};
      }
      if (current.len == 0) {  // a padded row: nothing to attend
        std::fill(dst, dst + task_heads * dv, T(0.0f));
      } else {
        const T* query_heads = qp + r * q_row + h0 * q_head;
        if (wide) {
          load_query(query_heads, q_head, task_heads, d, scale, q_wide.data());
          auto run = d == 64 ? attend_request_512<64, T> : d == 128 ? attend_request_512<128, T> : attend_request_512<0, T>;
          run(q_wide.data(), static_cast<float>(scale), task_heads, g, d, dv, current, ks, vs, o.data(), work.data(), next);
        } else {
          load_query(query_heads, q_head, task_heads, d, scale, q.data());
          attend_request(q.data(), task_heads, g, d, dv, current, ks, vs, o.data(), work.data());
        }
        for (int64_t i = 0; i < task_heads * dv; ++i) dst[i] = static_cast<T>(o[i]);
      }
      std::swap(current, following);
    }
  });
}

void check_operands(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_table, const at::Tensor& seq_lens, int64_t rows) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [rows, heads, dim] with a contiguous dim");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "k_cache and v_cache must be [num_blocks, block_size, kv_heads, dim] with a contiguous dim");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && query.scalar_type() == v_cache.scalar_type(),
              "query, k_cache and v_cache must share a dtype");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "paged_decode_attention takes float32, bfloat16 or float16, got ", dtype);
  const int64_t kv_heads = k_cache.size(2);
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) && v_cache.size(2) == kv_heads,
              "k_cache and v_cache must have the same blocks, block size and heads");
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query and keys must have the same head dim");
  TORCH_CHECK(kv_heads > 0 && query.size(1) % kv_heads == 0, "query heads (", query.size(1),
              ") must be a multiple of KV heads (", kv_heads, ")");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1 &&
                  block_table.size(0) >= rows,
              "block_table must be int32 [rows, blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous() &&
                  seq_lens.size(0) >= rows,
              "seq_lens must be a contiguous int32 [rows]");
}

void attend(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t rows, int64_t isa,
            at::Tensor& out) {
  TORCH_CHECK(isa == 1 || isa == 2, "isa must be 1 (AVX2) or 2 (AVX-512 with AVX512-BF16), got ", isa);
  const auto dtype = query.scalar_type();
  if (dtype == at::kFloat) {
    decode<float>(query, k_cache, v_cache, block_table, seq_lens, scale, rows, isa, out);
  } else if (dtype == at::kBFloat16) {
    decode<at::BFloat16>(query, k_cache, v_cache, block_table, seq_lens, scale, rows, isa, out);
  } else {
    decode<at::Half>(query, k_cache, v_cache, block_table, seq_lens, scale, rows, isa, out);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                                  int64_t isa) {
  check_operands(query, k_cache, v_cache, block_table, seq_lens, query.size(0));
  at::Tensor out = at::empty({query.size(0), query.size(1), v_cache.size(3)}, query.options());
  attend(query, k_cache, v_cache, block_table, seq_lens, scale, query.size(0), isa, out);
  return out;
}

// Copies row i of `src` ([tokens, heads, dim], dim contiguous) to token slot_mapping[i] of `cache`.
void write_tokens(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t tokens) {
  const int64_t block_size = cache.size(1), heads = cache.size(2), dim = cache.size(3);
  const int64_t capacity = cache.size(0) * block_size, bytes = dim * src.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* from = static_cast<const char*>(src.data_ptr());
  const int64_t es = src.element_size();
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t slot = slots[i];
    TORCH_CHECK(slot >= 0 && slot < capacity, "slot ", slot, " is outside the cache's ", capacity, " slots");
    const int64_t b = slot / block_size, t = slot % block_size;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(dst + (b * cache.stride(0) + t * cache.stride(1) + h * cache.stride(2)) * es,
                  from + (i * src.stride(0) + h * src.stride(1)) * es, bytes);
    }
  }
}

// Part `name` of a layer's cache as a tensor over `raw`, the byte allocation every layer's views are
// cut from: `view` is [byte offset, num_blocks, block_size, heads, dim, block stride, token stride,
// head stride] (strides in elements of `dtype`; the dim is contiguous).
at::Tensor cache_view(const at::Tensor& raw, c10::IntArrayRef view, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(view.size() == 8, name, " must be [byte offset, 4 sizes, 3 strides], got ", view.size(), " values");
  const int64_t es = c10::elementSize(dtype), offset = view[0];
  TORCH_CHECK(offset >= 0 && offset % es == 0, name, "'s byte offset ", offset, " is not a multiple of ", es);
  int64_t last = view[4] - 1;  // the last element's index past the offset
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(view[1 + i] > 0 && view[5 + i] >= 0, name, " has an empty size or a negative stride");
    last += (view[1 + i] - 1) * view[5 + i];
  }
  TORCH_CHECK(view[4] > 0 && offset + (last + 1) * es <= raw.numel(), name, " reaches past the cache's ",
              raw.numel(), " bytes");
  return at::from_blob(static_cast<uint8_t*>(raw.data_ptr()) + offset, {view[1], view[2], view[3], view[4]},
                       {view[5], view[6], view[7], 1}, raw.options().dtype(dtype));
}

// A decode-only step's attention call: the new keys and values into their slots, then attention of
// the first seq_lens.size(0) queries (one per request); further rows (graph padding) are zeros. The
// caches are given as the allocation they are views of (`kv_cache`, uint8) and where each lies in it:
// the one tensor every layer writes, where views would alias one another, which torch.compile cannot
// trace writes to.
at::Tensor paged_decode_attention_with_kv(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                          at::Tensor kv_cache, c10::IntArrayRef k_view, c10::IntArrayRef v_view,
                                          const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                          const at::Tensor& seq_lens, double scale, int64_t isa) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kByte && kv_cache.dim() == 1 && kv_cache.is_contiguous(),
              "kv_cache must be the contiguous uint8 allocation the layers' views are cut from");
  at::Tensor k_cache = cache_view(kv_cache, k_view, query.scalar_type(), "k_view");
  at::Tensor v_cache = cache_view(kv_cache, v_view, query.scalar_type(), "v_view");
  const int64_t rows = seq_lens.size(0), tokens = slot_mapping.size(0);
  TORCH_CHECK(rows <= query.size(0), "more requests (", rows, ") than queries (", query.size(0), ")");
  check_operands(query, k_cache, v_cache, block_table, seq_lens, rows);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 [tokens]");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.size(0) >= tokens && value.size(0) >= tokens &&
                  key.sizes().slice(1) == k_cache.sizes().slice(2) && value.sizes().slice(1) == v_cache.sizes().slice(2) &&
                  key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be [tokens, kv_heads, dim] like the caches' tokens, with a contiguous dim");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "key and value must have the query's dtype");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  write_tokens(key, k_cache, slots, tokens);
  write_tokens(value, v_cache, slots, tokens);
  at::Tensor out = at::empty({query.size(0), query.size(1), v_cache.size(3)}, query.options());
  attend(query, k_cache, v_cache, block_table, seq_lens, scale, rows, isa, out);
  if (rows < query.size(0)) out.narrow(0, rows, query.size(0) - rows).zero_();
  return out;
}

}  // namespace

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(mrv2, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, int isa=1) -> Tensor");
  m.def("paged_decode_attention_with_kv(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
        "int[] k_view, int[] v_view, Tensor slot_mapping, Tensor block_table, Tensor seq_lens, float scale, int isa=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(mrv2, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_with_kv", &paged_decode_attention_with_kv);
}
