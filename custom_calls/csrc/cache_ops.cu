// In-place KV-cache updates on XLA's CUDA stream. The caches are aliased
// input->output (input_output_aliases on donated arrays), so the kernels write
// straight into the existing cache buffers. Both are dtype-agnostic 16-byte
// copies (FP8 caches included): a cache slot row (Hkv * D elements) and a
// cache block are contiguous.
#include "common.h"

namespace jaxserve {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;  // independent 16-byte loads per thread in flight

// Copies n 16-byte vectors from src to dst with kCopyUnroll loads in flight.
__device__ __forceinline__ void CopyVectors(Vec16* dst, const Vec16* src, int64_t n) {
  for (int64_t base = threadIdx.x; base < n; base += int64_t{kCopyThreads} * kCopyUnroll) {
    Vec16 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * kCopyThreads;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = base + u * kCopyThreads;
      if (i < n) dst[i] = v[u];
    }
  }
}

// grid (T, 2): token t's new K (y = 0) or V (y = 1) row into its slot.
// Slots outside [0, num_slots) are skipped (padding tokens use -1).
__global__ void __launch_bounds__(kCopyThreads)
    ReshapeAndCacheKernel(Vec16* k_cache, Vec16* v_cache, const Vec16* k, const Vec16* v,
                          const int32_t* slot_mapping, int64_t num_slots, int64_t row_vecs) {
  const int64_t slot = slot_mapping[blockIdx.x];
  if (slot < 0 || slot >= num_slots) return;
  Vec16* cache = blockIdx.y == 0 ? k_cache : v_cache;
  const Vec16* rows = blockIdx.y == 0 ? k : v;
  CopyVectors(cache + slot * row_vecs, rows + blockIdx.x * row_vecs, row_vecs);
}

// grid (N, 2): cache block src[i] -> dst[i] in K (y = 0) or V (y = 1).
// Pairs with an id outside [0, num_blocks) are skipped.
__global__ void __launch_bounds__(kCopyThreads)
    CopyBlocksKernel(Vec16* k_cache, Vec16* v_cache, const int32_t* src, const int32_t* dst,
                     int64_t num_blocks, int64_t block_vecs) {
  const int64_t from = src[blockIdx.x], to = dst[blockIdx.x];
  if (from < 0 || from >= num_blocks || to < 0 || to >= num_blocks) return;
  Vec16* cache = blockIdx.y == 0 ? k_cache : v_cache;
  CopyVectors(cache + to * block_vecs, cache + from * block_vecs, block_vecs);
}

// Bytes per cache slot row, checked to be a whole number of 16-byte vectors.
ffi::Error SlotRowBytes(const ffi::AnyBuffer& k_cache, const ffi::AnyBuffer& v_cache, int64_t* row_bytes) {
  const auto kd = k_cache.dimensions();
  if (kd.size() != 4 || v_cache.dimensions().size() != 4 || k_cache.element_count() != v_cache.element_count() ||
      k_cache.element_type() != v_cache.element_type() || !IsCacheType(k_cache.element_type()))
    return ffi::Error::InvalidArgument(
        "k_cache and v_cache must match: [num_blocks, block_size, Hkv, D] of f32/bf16/f16/f8e4m3fn");
  *row_bytes = kd[2] * kd[3] * ffi::ByteWidth(k_cache.element_type());
  if (*row_bytes % sizeof(Vec16) != 0)
    return ffi::Error::InvalidArgument("Hkv * D * itemsize must be a multiple of 16 bytes");
  return ffi::Error::Success();
}

// kv [2, T, Hkv, D]: the new K rows, then the V rows (one operand: XLA computes both in one fusion).
ffi::Error ReshapeAndCache(cudaStream_t stream, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer kv,
                           ffi::Buffer<ffi::S32> slot_mapping, ffi::Result<ffi::AnyBuffer> k_out,
                           ffi::Result<ffi::AnyBuffer> v_out) {
  int64_t row_bytes = 0;
  if (ffi::Error err = SlotRowBytes(k_cache, v_cache, &row_bytes); err.failure()) return err;
  const int64_t tokens = slot_mapping.element_count();
  if (kv.element_type() != k_cache.element_type() || kv.size_bytes() != static_cast<size_t>(2 * tokens * row_bytes))
    return ffi::Error::InvalidArgument("kv must be [2, T, Hkv, D] in the cache dtype, T = len(slot_mapping)");
  if (tokens == 0) return ffi::Error::Success();
  const auto kd = k_cache.dimensions();
  const int64_t row_vecs = row_bytes / sizeof(Vec16);
  const Vec16* k = static_cast<const Vec16*>(kv.untyped_data());
  ReshapeAndCacheKernel<<<dim3(tokens, 2), kCopyThreads, 0, stream>>>(
      static_cast<Vec16*>(k_out->untyped_data()), static_cast<Vec16*>(v_out->untyped_data()), k, k + tokens * row_vecs,
      slot_mapping.typed_data(), kd[0] * kd[1], row_vecs);
  return LaunchStatus("reshape_and_cache launch");
}

ffi::Error CopyBlocks(cudaStream_t stream, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                      ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::AnyBuffer> k_out,
                      ffi::Result<ffi::AnyBuffer> v_out) {
  int64_t row_bytes = 0;
  if (ffi::Error err = SlotRowBytes(k_cache, v_cache, &row_bytes); err.failure()) return err;
  const int64_t pairs = src.element_count();
  if (dst.element_count() != static_cast<size_t>(pairs))
    return ffi::Error::InvalidArgument("src and dst must have the same length");
  if (pairs == 0) return ffi::Error::Success();
  const auto kd = k_cache.dimensions();
  CopyBlocksKernel<<<dim3(pairs, 2), kCopyThreads, 0, stream>>>(
      static_cast<Vec16*>(k_out->untyped_data()), static_cast<Vec16*>(v_out->untyped_data()), src.typed_data(),
      dst.typed_data(), kd[0], kd[1] * row_bytes / sizeof(Vec16));
  return LaunchStatus("copy_blocks launch");
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveReshapeAndCache, jaxserve::ReshapeAndCache,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCopyBlocks, jaxserve::CopyBlocks,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
