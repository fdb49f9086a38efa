// y_i = x W_i on the CPU for a decode step's few rows of x, W_i f32 [k, n_i] as the model stores a linear's kernel
// (flax's [in, out]): such a step is bound by reading the weights, and XLA's matrix-vector product reads them at
// 11-37 GB/s by shape where the CPU streams ~22. Each thread takes whole rows of W (a slice of the contraction),
// read as kStreams streams at once, and adds x[r, j] W[j, :] into an f32 row of partial sums kept in L1; the
// slices' partial sums are added in slice order after, so the result does not depend on which thread ran which
// slice.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve {
namespace {

namespace ffi = xla::ffi;

constexpr int kMaxRows = 4;        // rows of x a call takes
constexpr int kStreams = 8;        // rows of W one pass over the partial sums adds, each from its own stream
constexpr int64_t kMinSliceRows = 16;   // rows of W a slice holds at least

struct Weight {
  const float* w;  // [k, n]
  float* y;        // [m, n]
  int64_t n, column;   // its columns' place in a slice's partial sums
};

// partial [m, columns] += x[:, rows] W[rows, :] for one weight: R rows of W in one pass over the partial sums.
template <int M, int R>
void AddRows(const float* x, int64_t k, const Weight& wt, const int64_t (&rows)[kStreams], float* partial,
             int64_t columns) {
  const int64_t n = wt.n;
  const float* w[R];
  __m256 xs[M][R];
  for (int i = 0; i < R; ++i) {
    w[i] = wt.w + rows[i] * n;
    for (int r = 0; r < M; ++r) xs[r][i] = _mm256_set1_ps(x[r * k + rows[i]]);
  }
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    __m256 v[R];
    for (int i = 0; i < R; ++i) v[i] = _mm256_loadu_ps(w[i] + c);
    for (int r = 0; r < M; ++r) {
      float* p = partial + r * columns + wt.column + c;
      __m256 s = _mm256_loadu_ps(p);
      for (int i = 0; i < R; ++i) s = _mm256_fmadd_ps(xs[r][i], v[i], s);
      _mm256_storeu_ps(p, s);
    }
  }
  for (; c < n; ++c)
    for (int r = 0; r < M; ++r)
      for (int i = 0; i < R; ++i) partial[r * columns + wt.column + c] += x[r * k + rows[i]] * w[i][c];
}

// partial += x[:, j0:j1] W[j0:j1, :] for one weight. The slice is read as kStreams streams at once, each an equal
// part of it front to back: one stream a core reads at ~8 GB/s here, several keep more lines in flight.
template <int M>
void AddSlice(const float* x, int64_t k, const Weight& wt, int64_t j0, int64_t j1, float* partial, int64_t columns) {
  const int64_t part = (j1 - j0 + kStreams - 1) / kStreams;
  for (int64_t t = 0; t < part; ++t) {
    int64_t rows[kStreams];
    int live = 0;
    for (int i = 0; i < kStreams; ++i)
      if (j0 + i * part + t < j1) rows[live++] = j0 + i * part + t;
    switch (live) {
      case 8: AddRows<M, 8>(x, k, wt, rows, partial, columns); break;
      case 7: AddRows<M, 7>(x, k, wt, rows, partial, columns); break;
      case 6: AddRows<M, 6>(x, k, wt, rows, partial, columns); break;
      case 5: AddRows<M, 5>(x, k, wt, rows, partial, columns); break;
      case 4: AddRows<M, 4>(x, k, wt, rows, partial, columns); break;
      case 3: AddRows<M, 3>(x, k, wt, rows, partial, columns); break;
      case 2: AddRows<M, 2>(x, k, wt, rows, partial, columns); break;
      case 1: AddRows<M, 1>(x, k, wt, rows, partial, columns); break;
      default: break;
    }
  }
}

template <int M>
void AddSlices(const float* x, int64_t k, const std::vector<Weight>& weights, int64_t columns, int64_t slice_rows,
               float* partials, int64_t begin, int64_t end) {
  float* partial = partials + begin / slice_rows * M * columns;
  std::fill(partial, partial + M * columns, 0.0f);
  for (const Weight& wt : weights) AddSlice<M>(x, k, wt, begin, end, partial, columns);
}

ffi::Error F32Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] < 1 || xd[0] > kMaxRows || ws.size() == 0 || ws.size() != ys.size())
    return ffi::Error::InvalidArgument("f32_matmul: need x [1 to 4, k] and one output a weight");
  const int64_t m = xd[0], k = xd[1];
  std::vector<Weight> weights;
  int64_t columns = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("f32_matmul: weights and outputs f32");
    const auto wd = w->dimensions();
    if (wd.size() != 2 || wd[0] != k || (*y)->element_count() != static_cast<size_t>(m * wd[1]))
      return ffi::Error::InvalidArgument("f32_matmul: each w must be [k, n] with y [m, n]");
    weights.push_back({w->typed_data(), (*y)->typed_data(), wd[1], columns});
    columns += wd[1];
  }
  const int64_t slice_rows = ChunkSize(pool, k, kMinSliceRows), slices = (k + slice_rows - 1) / slice_rows;
  // each slice zeroes its own sums before adding: no zeroed allocation
  const std::unique_ptr<float[]> partials(new float[slices * m * columns]);
  const auto add = m == 1 ? AddSlices<1> : m == 2 ? AddSlices<2> : m == 3 ? AddSlices<3> : AddSlices<4>;
  ParallelFor(pool, k, kMinSliceRows, [&](int64_t begin, int64_t end) {
    add(x.typed_data(), k, weights, columns, slice_rows, partials.get(), begin, end);
  });
  for (const Weight& wt : weights) {
    for (int64_t r = 0; r < m; ++r) {
      float* y = wt.y + r * wt.n;
      const float* first = partials.get() + r * columns + wt.column;
      std::copy(first, first + wt.n, y);
      for (int64_t s = 1; s < slices; ++s) {
        const float* p = first + s * m * columns;
        for (int64_t c = 0; c < wt.n; ++c) y[c] += p[c];
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveF32Matmul, jaxserve::F32Matmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
