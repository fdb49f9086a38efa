// The CPU handlers' work split over XLA's intra-op threads.
#ifndef JAXSERVE_CPU_PARALLEL_H_
#define JAXSERVE_CPU_PARALLEL_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Chunks a thread's share is cut into, so that a thread the pool starts late still finds work.
constexpr int64_t kChunksPerThread = 4;

// The size of the chunks ParallelFor cuts [0, n) into: at least min_chunk, about kChunksPerThread a thread.
inline int64_t ChunkSize(xla::ffi::ThreadPool& pool, int64_t n, int64_t min_chunk) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return std::max(min_chunk, (n + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
}

// run(begin, end) over [0, n) in chunks of ChunkSize, taken from a shared counter by the calling thread and
// the pool's; returns when every chunk is done. A task the pool starts late finds no chunk left; the state lives as
// long as its last holder, so a late task never reads freed memory.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, int64_t min_chunk,
                        std::function<void(int64_t, int64_t)> run) {
  struct Work {
    std::function<void(int64_t, int64_t)> run;
    int64_t n, chunk, chunks;
    std::atomic<int64_t> next{0}, done{0};

    void Drain() {
      for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
        run(c * chunk, std::min(n, (c + 1) * chunk));
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto work = std::make_shared<Work>();
  work->run = std::move(run);
  work->n = n;
  work->chunk = ChunkSize(pool, n, min_chunk);
  work->chunks = (n + work->chunk - 1) / work->chunk;
  for (int64_t t = 1; t < std::min(threads, work->chunks); ++t) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->chunks) _mm_pause();
}

}  // namespace jaxserve

#endif  // JAXSERVE_CPU_PARALLEL_H_
