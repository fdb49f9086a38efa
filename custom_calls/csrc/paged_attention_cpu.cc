// Ragged paged attention on the CPU: every token of a mixed batch of prefills and decodes attends its sequence's
// keys through the block table with an online softmax, a block at a time, in f32 (pallas_kernels' reference
// semantics). A token walks only the keys it sees (its causal and window range) where they lie in the cache; the
// pure-JAX reference gathers a few blocks per loop trip into fresh arrays for every token, which on a CPU cost
// ~15x the bytes it reads. A work item is one token and one kv head: each key is widened to f32 once for the q heads
// of its group. Any index read from the inputs is clamped, so malformed metadata never reads outside the buffers.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve {
namespace {

namespace ffi = xla::ffi;

constexpr int64_t kLanes = 8;
constexpr int64_t kCacheLine = 64;
// Key reads (keys x kv heads) below which a call stays on its thread: a batch-1 decode's few hundred take
// microseconds, less than waking the pool.
constexpr int64_t kMinParallelKeyReads = 2048;
// Keys a work item walks at most: a long context's keys are shared out over the threads in spans this long.
constexpr int64_t kSpanKeys = 256;

// A cache's elements widened to f32, eight at a time (head_dim is a multiple of 8).
struct F32Cache {
  using T = float;
  static __m256 Load(const T* p) { return _mm256_loadu_ps(p); }
};
struct Bf16Cache {
  using T = uint16_t;
  static __m256 Load(const T* p) {
    const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
  }
};
struct F16Cache {
  using T = uint16_t;
  static __m256 Load(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 15, mantissa = b & 7;
      float magnitude = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6)
                                      : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 15 && mantissa == 7) magnitude = std::numeric_limits<float>::quiet_NaN();
      value[b] = b & 128 ? -magnitude : magnitude;
    }
  }
};
const E4m3Table kE4m3;

struct Fp8Cache {  // e4m3fn, or its bits as uint8 (how the engine keeps an fp8 cache on a CPU)
  using T = uint8_t;
  static __m256 Load(const T* p) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_i32gather_ps(kE4m3.value, bytes, 4);
  }
};

inline float Sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The horizontal sums of eight vectors, in order, as one vector.
inline __m256 Sum8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// e^x to f32 rounding (relative error ~1e-7: Cephes' expf polynomial after x = n ln 2 + r, |r| <= ln 2 / 2);
// inputs below -87.3 give ~e^-87.3, not 0 (the softmax only takes scores minus their running max).
inline __m256 Exp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  }
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

struct Token {
  int64_t seq = -1, position = -1;  // seq -1: padding, its output rows zeros
};

struct Problem {
  const float* q;          // [tokens, kv_heads * group, head_dim]
  const void* k;           // [num_blocks, block_size, kv_heads, head_dim]
  const void* v;
  const int32_t* tables;   // [seqs, table_width]
  float* out;              // as q
  int64_t num_blocks, block_size, kv_heads, group, head_dim, table_width;
  float sm_scale, soft_cap;  // soft_cap 0: none
  int64_t window;            // 0: none
  std::vector<Token> tokens;

  int64_t FirstKey(const Token& t) const { return window > 0 ? std::max<int64_t>(0, t.position - window + 1) : 0; }
  // a q head's scores of a block, padded to whole vectors
  int64_t ScoreWidth() const { return (block_size + kLanes - 1) / kLanes * kLanes; }
  // AttendSpan's: scores, alpha, and a block's rows widened
  int64_t ScratchFloats() const { return group * (ScoreWidth() + 1) + block_size * head_dim; }
};

// Where each token sits: its sequence (the live ones are cu_q_lens[i]..cu_q_lens[i + 1] of the first num_seqs) and
// its position (the sequence's kv_len - q_len + index). Bounds from the inputs are clamped to the arrays.
std::vector<Token> LocateTokens(const int32_t* cu_q_lens, const int32_t* kv_lens, int64_t seqs, int64_t num_seqs,
                                int64_t num_tokens) {
  std::vector<Token> tokens(num_tokens);
  for (int64_t s = 0; s < std::clamp<int64_t>(num_seqs, 0, seqs); ++s) {
    const int64_t begin = std::clamp<int64_t>(cu_q_lens[s], 0, num_tokens);
    const int64_t end = std::clamp<int64_t>(cu_q_lens[s + 1], begin, num_tokens);
    for (int64_t t = begin; t < end; ++t) {
      if (tokens[t].seq < 0) tokens[t] = {s, kv_lens[s] - (end - begin) + (t - begin)};
    }
  }
  return tokens;
}

// acc[0, kTile * 8) = alpha * acc + sum over keys j < n of weights[j] * values[j], acc in registers.
template <int kTile>
inline void AccumulateTile(const float* weights, __m256 alpha, const float* values, int64_t stride, int64_t n,
                           float* acc) {
  __m256 x[kTile];
  for (int i = 0; i < kTile; ++i) x[i] = _mm256_mul_ps(alpha, _mm256_loadu_ps(acc + i * kLanes));
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_set1_ps(weights[j]);
    for (int i = 0; i < kTile; ++i) x[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(values + j * stride + i * kLanes), x[i]);
  }
  for (int i = 0; i < kTile; ++i) _mm256_storeu_ps(acc + i * kLanes, x[i]);
}

// acc[0, D) = alpha * acc + sum over keys j < n of weights[j] * values[j], four vectors of acc at a time.
inline void AccumulateValues(const float* weights, float alpha, const float* values, int64_t stride, int64_t n,
                             int64_t D, float* acc) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t d = 0;
  for (; d + 4 * kLanes <= D; d += 4 * kLanes) AccumulateTile<4>(weights, a, values + d, stride, n, acc + d);
  for (; d < D; d += kLanes) AccumulateTile<1>(weights, a, values + d, stride, n, acc + d);
}

// Rows [0, n) of one kv head in a block as f32 rows `stride` floats apart: an f32 cache's rows where they lie,
// any other cache's widened into scratch ([n, head_dim]).
template <typename C>
const float* Rows(const typename C::T* first, int64_t n, int64_t cache_stride, int64_t D, float* scratch,
                  int64_t& stride) {
  if constexpr (std::is_same_v<typename C::T, float>) {
    stride = cache_stride;
    return first;
  } else {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t d = 0; d < D; d += kLanes) {
        _mm256_storeu_ps(scratch + j * D + d, C::Load(first + j * cache_stride + d));
      }
    }
    stride = D;
    return scratch;
  }
}

// q . k for eight keys (rows j0..j0+7 of `keys`, the last repeated past n) as one vector.
inline __m256 Dots8(const float* q, const float* keys, int64_t stride, int64_t j0, int64_t n, int64_t D) {
  __m256 acc[kLanes];
  const float* row[kLanes];
  for (int i = 0; i < kLanes; ++i) acc[i] = _mm256_setzero_ps(), row[i] = keys + std::min(j0 + i, n - 1) * stride;
  for (int64_t d = 0; d < D; d += kLanes) {
    const __m256 x = _mm256_loadu_ps(q + d);
    for (int i = 0; i < kLanes; ++i) acc[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(row[i] + d), acc[i]);
  }
  return Sum8(acc);
}

// Block `block`'s rows of kv head h, K and V, into the cache hierarchy while the block before it is worked on: a
// token's blocks lie anywhere in the cache, and a kv head's rows are a few hundred bytes each, kv_heads apart.
template <typename T>
void Prefetch(const Problem& p, int64_t block, int64_t h) {
  const int64_t row_bytes = p.head_dim * sizeof(T);
  for (const void* cache : {p.k, p.v}) {
    const char* row = static_cast<const char*>(cache) + (block * p.block_size * p.kv_heads + h) * row_bytes;
    for (int64_t j = 0; j < p.block_size; ++j, row += p.kv_heads * row_bytes) {
      for (int64_t line = 0; line < row_bytes; line += kCacheLine) _mm_prefetch(row + line, _MM_HINT_T1);
    }
  }
}

// The online softmax's state of a token's q heads of one kv head over a span of keys: each q head's running max m,
// its sum of e^(score - m) l, and its acc of values weighted so [head_dim]. out = acc / l once every key is in.
struct SoftmaxState {
  float *m, *l, *acc;  // [G], [G], [G, D]
};

// Token t's keys [first, last] of kv head h into st, a block at a time. scratch: ScratchFloats() floats.
template <typename C>
void AttendSpan(const Problem& p, int64_t t, int64_t h, int64_t first, int64_t last, float* scratch,
                SoftmaxState st) {
  using T = typename C::T;
  const int64_t D = p.head_dim, G = p.group, bs = p.block_size, width = p.ScoreWidth();
  const int64_t row = (t * p.kv_heads + h) * G * D;  // q head h * G + g reads kv head h
  float *scores = scratch, *alpha = scores + G * width, *widened = alpha + G;
  float *acc = st.acc, *m = st.m, *l = st.l;
  std::fill(acc, acc + G * D, 0.0f);
  std::fill(m, m + G, -std::numeric_limits<float>::infinity());
  std::fill(l, l + G, 0.0f);
  const float* q = p.q + row;
  const int32_t* table = p.tables + p.tokens[t].seq * p.table_width;
  const int64_t cache_stride = p.kv_heads * D;
  const auto block_id = [&](int64_t b) {
    return std::clamp<int64_t>(table[std::min(b, p.table_width - 1)], 0, p.num_blocks - 1);
  };
  for (int64_t b = first / bs; b <= last / bs; ++b) {
    const int64_t block = block_id(b);
    if (b < last / bs) Prefetch<T>(p, block_id(b + 1), h);
    const int64_t k0 = std::max(first, b * bs), n = std::min(last + 1, (b + 1) * bs) - k0;
    const int64_t base = ((block * bs + k0 - b * bs) * p.kv_heads + h) * D;  // key k0's row of kv head h
    int64_t stride;
    const float* keys = Rows<C>(static_cast<const T*>(p.k) + base, n, cache_stride, D, widened, stride);
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores + g * width;
      for (int64_t j = 0; j < n; j += kLanes) {
        _mm256_storeu_ps(s + j, _mm256_mul_ps(Dots8(q + g * D, keys, stride, j, n, D), _mm256_set1_ps(p.sm_scale)));
      }
      if (p.soft_cap > 0.0f) {
        for (int64_t j = 0; j < n; ++j) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
      }
      // the online softmax: what came before rescaled to the new running max
      const float m_new = std::max(m[g], *std::max_element(s, s + n));
      alpha[g] = std::exp(m[g] - m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; j += kLanes) {
        const __m256 live = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        const __m256 e = _mm256_and_ps(live, Exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m_new))));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
      }
      l[g] = l[g] * alpha[g] + Sum(sum);
      m[g] = m_new;
    }
    const float* values = Rows<C>(static_cast<const T*>(p.v) + base, n, cache_stride, D, widened, stride);
    for (int64_t g = 0; g < G; ++g) AccumulateValues(scores + g * width, alpha[g], values, stride, n, D, acc + g * D);
  }
}

// A work item: token t's keys [first, last] of kv head h.
struct Span {
  int64_t t, h, first, last;
};

// Token t's output rows of kv head h's q heads from its spans' states: each rescaled to the largest max, summed.
void Merge(const Problem& p, int64_t t, int64_t h, const std::vector<SoftmaxState>& spans) {
  const int64_t D = p.head_dim, G = p.group;
  float* out = p.out + (t * p.kv_heads + h) * G * D;
  std::fill(out, out + G * D, 0.0f);   // a padding token's stays so
  for (int64_t g = 0; g < G && !spans.empty(); ++g) {
    float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
    for (const SoftmaxState& s : spans) m = std::max(m, s.m[g]);
    for (const SoftmaxState& s : spans) {
      const float scale = std::exp(s.m[g] - m);
      l += scale * s.l[g];
      for (int64_t d = 0; d < D; d += kLanes) {
        _mm256_storeu_ps(out + g * D + d, _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_loadu_ps(s.acc + g * D + d),
                                                          _mm256_loadu_ps(out + g * D + d)));
      }
    }
    for (int64_t d = 0; d < D; d += kLanes) {
      _mm256_storeu_ps(out + g * D + d, _mm256_mul_ps(_mm256_set1_ps(1.0f / l), _mm256_loadu_ps(out + g * D + d)));
    }
  }
}

// Every (token, kv head)'s keys cut into spans of at most kSpanKeys (at multiples of it), so one long decode is
// shared out over the threads too (flash-decoding's split), then each token's spans merged.
template <typename C>
void Attend(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t G = p.group, D = p.head_dim, state_floats = 2 * G + G * D;
  std::vector<Span> spans;
  for (int64_t t = 0; t < static_cast<int64_t>(p.tokens.size()); ++t) {
    const Token& token = p.tokens[t];
    if (token.seq < 0 || token.position < 0) continue;
    const int64_t first = p.FirstKey(token), last = std::min(token.position, p.table_width * p.block_size - 1);
    for (int64_t k = first; k <= last; k = (k / kSpanKeys + 1) * kSpanKeys) {
      for (int64_t h = 0; h < p.kv_heads; ++h) {   // a span's kv heads in turn: the keys' lines are read once
        spans.push_back({t, h, k, std::min(last, (k / kSpanKeys + 1) * kSpanKeys - 1)});
      }
    }
  }
  std::vector<float> states(spans.size() * state_floats);
  const auto state_of = [&](int64_t i) {   // span i's
    float* at = states.data() + i * state_floats;
    return SoftmaxState{at, at + G, at + 2 * G};
  };
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(p.ScratchFloats());
    for (int64_t i = begin; i < end; ++i) {
      const Span& s = spans[i];
      AttendSpan<C>(p, s.t, s.h, s.first, s.last, scratch.data(), state_of(i));
    }
  };
  int64_t key_reads = 0;
  for (const Span& s : spans) key_reads += s.last - s.first + 1;
  if (key_reads < kMinParallelKeyReads) {
    run(0, static_cast<int64_t>(spans.size()));
  } else {
    ParallelFor(pool, static_cast<int64_t>(spans.size()), 1, run);
  }
  std::vector<std::vector<SoftmaxState>> by_item(p.tokens.size() * p.kv_heads);
  for (size_t i = 0; i < spans.size(); ++i) by_item[spans[i].t * p.kv_heads + spans[i].h].push_back(state_of(i));
  for (int64_t i = 0; i < static_cast<int64_t>(by_item.size()); ++i) {
    Merge(p, i / p.kv_heads, i % p.kv_heads, by_item[i]);
  }
}

ffi::Error RaggedPagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> kv_lens,
                                ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> num_seqs,
                                ffi::ResultBuffer<ffi::F32> out, float sm_scale, int32_t sliding_window,
                                float soft_cap) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: need q [T, Hq, D], caches [N, bs, Hkv, D] and "
                                       "block tables [S, W]");
  }
  if (k.element_type() != v.element_type() || v.dimensions().size() != 4 ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin())) {
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: k and v caches must match");
  }
  const int64_t seqs = td[0];
  if (kd[3] != qd[2] || qd[2] % kLanes || kd[2] == 0 || qd[1] % kd[2] || kd[0] == 0 || td[1] == 0 ||
      cu_q_lens.element_count() != seqs + 1 || kv_lens.element_count() != seqs || num_seqs.element_count() != 1) {
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: shapes disagree (head_dim a multiple of 8, q "
                                       "heads a multiple of kv heads, cu_q_lens [S + 1], kv_lens [S], num_seqs [1])");
  }
  Problem p{q.typed_data(), k.untyped_data(), v.untyped_data(), tables.typed_data(), out->typed_data(),
            kd[0], kd[1], kd[2], qd[1] / kd[2], kd[3], td[1], sm_scale, soft_cap, std::max(0, sliding_window),
            LocateTokens(cu_q_lens.typed_data(), kv_lens.typed_data(), seqs, num_seqs.typed_data()[0], qd[0])};
  switch (k.element_type()) {
    case ffi::F32: Attend<F32Cache>(pool, p); break;
    case ffi::BF16: Attend<Bf16Cache>(pool, p); break;
    case ffi::F16: Attend<F16Cache>(pool, p); break;
    case ffi::U8:
    case ffi::F8E4M3FN: Attend<Fp8Cache>(pool, p); break;
    default:
      return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: the cache must be f32, bf16, f16, "
                                         "float8_e4m3fn or its bits (uint8)");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttentionCpu, jaxserve::RaggedPagedAttention,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap"));
