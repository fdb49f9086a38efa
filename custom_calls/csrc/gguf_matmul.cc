// y = x W^T on the CPU with W kept in a GGUF block format (Q4_1 or Q8_0, as llama.cpp stores them): a decode step
// is bound by reading weights, and these blocks are 5.0 (Q4_1) or 8.5 (Q8_0) bits a weight against f32's 32.
// Each block is widened to f32 in registers and multiplied with x in f32, so the result is the f32 dot of x and the
// dequantized weights, up to the order of the sum. Rows of W are split over XLA's intra-op threads. Steps of many
// rows take W dequantized whole (GgufDequantize) into XLA's GEMM instead.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve {
namespace {

namespace ffi = xla::ffi;

constexpr int kBlock = 32;      // weights a block
constexpr int kRowTile = 4;     // rows of x one pass over a weight row serves
constexpr int kScaleGroup = 8;  // blocks whose scales (and offsets) are widened together: one vector's lanes
constexpr int64_t kMinChunkRows = 8;   // weight rows a chunk of a thread's work holds at least
// How far ahead of the block being multiplied its row's bytes are prefetched. A row is a few hundred bytes, too
// short a stream for some CPUs' hardware prefetchers: on a Sapphire Rapids core a Q4_1 block took 12.2 ns from
// memory against 3.0 ns from cache; 512 bytes ahead 6.3 ns, 1 KiB 4.0, 2 and 4 KiB 3.5-3.8 (one thread). The
// embedded model's GEMVs back to back on two threads, weights on 2 MiB pages: 10.3-10.7 ms at 2 KiB, 9.3-10.0 at 8.
constexpr int kPrefetchBytes = 8192;

// GGML type ids (ggml.h), the attribute naming the block format.
enum BlockType : int32_t { kQ4_1 = 3, kQ8_0 = 8 };

// The two f16 at the start of n consecutive blocks (kScaleGroup at most; zeros past n) as f32: scales and, for
// Q4_1, offsets. One gather and conversion a group instead of a conversion and a broadcast a block, which compete
// with the widening for a port (a group's halves stored one by one and loaded as a vector stall the load instead).
template <int kBytes>
void Halves(const uint8_t* first, int n, __m256* d, __m256* m) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes);
  const __m256i words = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(first),
                                                    _mm256_mullo_epi32(lanes, _mm256_set1_epi32(kBytes)), mask, 1);
  // [d0..3 m0..3 | d4..7 m4..7] as 16-bit, then [d0..7 | m0..7]
  const __m256i packed = _mm256_packus_epi32(_mm256_and_si256(words, _mm256_set1_epi32(0xffff)),
                                             _mm256_srli_epi32(words, 16));
  const __m256i halves = _mm256_permute4x64_epi64(packed, 0xd8);
  *d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  *m = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}

inline float Sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// A block's 32 weights without scale (and offset) as four vectors of eight floats, in order.
struct Q4_1 {
  static constexpr int kBytes = 20;  // half d, half m, 16 bytes of nibbles: q[j] low, q[j + 16] high
  static constexpr bool kOffset = true;
  // Bytes widened straight from memory (vpmovzxbd's load form) and split into nibbles in 32-bit lanes: shuffles
  // share one port, so the fewer of them, the faster a block (4 here against 6 with the nibbles split first).
  static void Widen(const uint8_t* b, __m256 q[4]) {
    const __m256i lo8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 4)));
    const __m256i hi8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 12)));
    const __m256i mask = _mm256_set1_epi32(0x0f);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo8, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi8, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo8, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi8, 4));
  }
};

struct Q8_0 {
  static constexpr int kBytes = 34;  // half d, 32 signed bytes
  static constexpr bool kOffset = false;
  static void Widen(const uint8_t* b, __m256 q[4]) {
    for (int i = 0; i < 4; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
  }
};

struct Problem {
  const float* x;       // [m, k]
  const float* x_sums;  // [m, SumsStride(k)]: each block's sum of x (zeros past k's), for Q4_1's offsets
  const uint8_t* w;     // [n, k / 32 * bytes]
  float* y;             // [m, n]
  int64_t m, n, k;
};

// Blocks a row of x_sums holds: k's, then zeros to a whole scale group, so a group's sums load as one vector.
inline int64_t SumsStride(int64_t k) { return (k / kBlock + kScaleGroup - 1) / kScaleGroup * kScaleGroup; }

// y[r0:r0+R, col] for one weight row: each block is widened once and serves R rows of x. (Reading several weight
// rows a pass, to share x's loads, measured slower: the widening, not the loads, bounds it.) Q4_1's offsets
// multiply x's block sums a group at a time.
template <typename B, int R>
void DotRow(const Problem& p, int64_t r0, int64_t col) {
  const int64_t blocks = p.k / kBlock, stride = SumsStride(p.k);
  const uint8_t* row = p.w + col * blocks * B::kBytes;
  __m256 acc[R], offset[R];
  for (int r = 0; r < R; ++r) acc[r] = offset[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < blocks; g += kScaleGroup) {
    const uint8_t* first = row + g * B::kBytes;
    const int n = static_cast<int>(std::min<int64_t>(kScaleGroup, blocks - g));
    alignas(32) float scales[kScaleGroup];
    __m256 d, m;
    Halves<B::kBytes>(first, n, &d, &m);
    _mm256_store_ps(scales, d);
    for (int i = 0; i < n; ++i) {
      const uint8_t* block = first + i * B::kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T0);  // never faults
      __m256 q[4];
      B::Widen(block, q);
      const __m256 scale = _mm256_broadcast_ss(scales + i);
      for (int r = 0; r < R; ++r) {
        const float* x = p.x + (r0 + r) * p.k + (g + i) * kBlock;
        __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
        t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), t);
        t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), t);
        t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), t);
        acc[r] = _mm256_fmadd_ps(scale, t, acc[r]);
      }
    }
    if constexpr (B::kOffset) {
      for (int r = 0; r < R; ++r) {
        offset[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(p.x_sums + (r0 + r) * stride + g), offset[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) p.y[(r0 + r) * p.n + col] = Sum(acc[r]) + (B::kOffset ? Sum(offset[r]) : 0.0f);
}

template <typename B>
void DotColumns(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t col = begin; col < end; ++col) {
    int64_t r = 0;
    for (; r + kRowTile <= p.m; r += kRowTile) DotRow<B, kRowTile>(p, r, col);
    switch (p.m - r) {
      case 3: DotRow<B, 3>(p, r, col); break;
      case 2: DotRow<B, 2>(p, r, col); break;
      case 1: DotRow<B, 1>(p, r, col); break;
      default: break;
    }
  }
}

// W's rows begin..end dequantized into y [n, k].
template <typename B>
void DequantizeRows(const Problem& p, int64_t begin, int64_t end) {
  const int64_t blocks = p.k / kBlock;
  for (int64_t row = begin; row < end; ++row) {
    for (int64_t g = 0; g < blocks; g += kScaleGroup) {
      const uint8_t* first = p.w + (row * blocks + g) * B::kBytes;
      const int n = static_cast<int>(std::min<int64_t>(kScaleGroup, blocks - g));
      alignas(32) float scales[kScaleGroup], offsets[kScaleGroup];
      __m256 d, m;
      Halves<B::kBytes>(first, n, &d, &m);
      _mm256_store_ps(scales, d);
      _mm256_store_ps(offsets, B::kOffset ? m : _mm256_setzero_ps());
      for (int i = 0; i < n; ++i) {
        __m256 q[4];
        B::Widen(first + i * B::kBytes, q);
        const __m256 scale = _mm256_broadcast_ss(scales + i), offset = _mm256_broadcast_ss(offsets + i);
        float* y = p.y + row * p.k + (g + i) * kBlock;
        // rounded twice, as llama.cpp's d * q + m (the build keeps the compiler from fusing them)
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + 8 * j, _mm256_add_ps(_mm256_mul_ps(q[j], scale), offset));
      }
    }
  }
}

void RunParallel(ffi::ThreadPool& pool, const Problem& p, void (*run)(const Problem&, int64_t, int64_t)) {
  ParallelFor(pool, p.n, kMinChunkRows, [&p, run](int64_t begin, int64_t end) { run(p, begin, end); });
}

// y_i = x W_i^T for weights of one block type that read the same x (q, k and v; gate and up): one call, their rows
// split over the threads as one range, so small matrices share the threads' hand-offs.
ffi::Error GgufMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys,
                      int32_t block_type) {
  const auto xd = x.dimensions();
  const bool q4 = block_type == kQ4_1;
  if (!q4 && block_type != kQ8_0) return ffi::Error::InvalidArgument("gguf_matmul: block_type must be Q4_1 or Q8_0");
  if (xd.size() != 2 || ws.size() == 0 || ws.size() != ys.size()) {
    return ffi::Error::InvalidArgument("gguf_matmul: need x [m, k] and one output a weight");
  }
  const int64_t m = xd[0], k = xd[1], bytes = q4 ? Q4_1::kBytes : Q8_0::kBytes;
  std::vector<float> sums(q4 ? m * SumsStride(k) : 0);
  for (int64_t r = 0; q4 && r < m; ++r) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const float* v = x.typed_data() + r * k + b * kBlock;
      sums[r * SumsStride(k) + b] = Sum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                                                      _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24))));
    }
  }
  std::vector<Problem> problems;
  std::vector<int64_t> first_rows{0};   // problem i's rows are [first_rows[i], first_rows[i + 1]) of the range
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::U8>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("gguf_matmul: weights u8, outputs f32");
    const auto wd = w->dimensions();
    if (wd.size() != 2 || k % kBlock || wd[1] != k / kBlock * bytes || (*y)->element_count() != m * wd[0]) {
      return ffi::Error::InvalidArgument("gguf_matmul: each w's rows must hold k / 32 blocks of x's k, y [m, n]");
    }
    problems.push_back({x.typed_data(), sums.data(), w->typed_data(), (*y)->typed_data(), m, wd[0], k});
    first_rows.push_back(first_rows.back() + wd[0]);
  }
  const auto run = q4 ? DotColumns<Q4_1> : DotColumns<Q8_0>;
  ParallelFor(pool, first_rows.back(), kMinChunkRows, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < problems.size(); ++i) {
      const int64_t lo = std::max(begin, first_rows[i]), hi = std::min(end, first_rows[i + 1]);
      if (lo < hi) run(problems[i], lo - first_rows[i], hi - first_rows[i]);
    }
  });
  return ffi::Error::Success();
}

ffi::Error GgufDequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y,
                          int32_t block_type) {
  const auto wd = w.dimensions(), yd = y->dimensions();
  const bool q4 = block_type == kQ4_1;
  if (!q4 && block_type != kQ8_0) {
    return ffi::Error::InvalidArgument("gguf_dequantize: block_type must be Q4_1 or Q8_0");
  }
  if (wd.size() != 2 || yd.size() != 2 || wd[0] != yd[0] || yd[1] % kBlock ||
      wd[1] != yd[1] / kBlock * (q4 ? Q4_1::kBytes : Q8_0::kBytes)) {
    return ffi::Error::InvalidArgument("gguf_dequantize: w's rows must hold k / 32 blocks of y's k");
  }
  const Problem p{nullptr, nullptr, w.typed_data(), y->typed_data(), 0, yd[0], yd[1]};
  RunParallel(pool, p, q4 ? DequantizeRows<Q4_1> : DequantizeRows<Q8_0>);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGgufMatmul, jaxserve::GgufMatmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("block_type"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGgufDequantize, jaxserve::GgufDequantize,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int32_t>("block_type"));
