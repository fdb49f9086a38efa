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
constexpr int64_t kMinChunkRows = 8;   // weight rows a chunk of a thread's work holds at least
// How far ahead of the block being multiplied its row's bytes are prefetched. A row is a few hundred bytes, too
// short a stream for some CPUs' hardware prefetchers: on a Sapphire Rapids core a Q4_1 block took 12.2 ns from
// memory against 3.0 ns from cache; 512 bytes ahead 6.3 ns, 1 KiB 4.0, 2 and 4 KiB 3.5-3.8 (one thread).
constexpr int kPrefetchBytes = 2048;

// GGML type ids (ggml.h), the attribute naming the block format.
enum BlockType : int32_t { kQ4_1 = 3, kQ8_0 = 8 };

inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
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
  static void Widen(const uint8_t* b, __m256 q[4]) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, mask), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
  static float Scale(const uint8_t* b) { return Half(b); }
  static float Offset(const uint8_t* b) { return Half(b + 2); }
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
  static float Scale(const uint8_t* b) { return Half(b); }
  static float Offset(const uint8_t*) { return 0.0f; }
};

struct Problem {
  const float* x;       // [m, k]
  const float* x_sums;  // [m, k / 32]: each block's sum of x, for Q4_1's offsets
  const uint8_t* w;     // [n, k / 32 * bytes]
  float* y;             // [m, n]
  int64_t m, n, k;
};

// y[r0:r0+R, col] for one weight row: each block is widened once and serves R rows of x. (Reading several weight
// rows a pass, to share x's loads, measured slower: the widening, not the loads, bounds it.)
template <typename B, int R>
void DotRow(const Problem& p, int64_t r0, int64_t col) {
  const int64_t blocks = p.k / kBlock;
  const uint8_t* row = p.w + col * blocks * B::kBytes;
  __m256 acc[R];
  float offset[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), offset[r] = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * B::kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T0);  // never faults
    __m256 q[4];
    B::Widen(block, q);
    const __m256 scale = _mm256_set1_ps(B::Scale(block));
    for (int r = 0; r < R; ++r) {
      const float* x = p.x + (r0 + r) * p.k + b * kBlock;
      __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
      t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), t);
      t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), t);
      t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), t);
      acc[r] = _mm256_fmadd_ps(scale, t, acc[r]);
      if constexpr (B::kOffset) offset[r] += B::Offset(block) * p.x_sums[(r0 + r) * blocks + b];
    }
  }
  for (int r = 0; r < R; ++r) p.y[(r0 + r) * p.n + col] = Sum(acc[r]) + offset[r];
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
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = p.w + (row * blocks + b) * B::kBytes;
      __m256 q[4];
      B::Widen(block, q);
      const __m256 scale = _mm256_set1_ps(B::Scale(block)), offset = _mm256_set1_ps(B::Offset(block));
      float* y = p.y + row * p.k + b * kBlock;
      // rounded twice, as llama.cpp's d * q + m (the build keeps the compiler from fusing them)
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_add_ps(_mm256_mul_ps(q[i], scale), offset));
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
  std::vector<float> sums(q4 ? m * (k / kBlock) : 0);
  for (size_t i = 0; i < sums.size(); ++i) {
    const float* v = x.typed_data() + i * kBlock;
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(v), _mm256_loadu_ps(v + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(v + 16), _mm256_loadu_ps(v + 24)));
    sums[i] = Sum(s);
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
