// In-place KV-cache updates on XLA's CUDA stream. The caches are aliased
// input->output (input_output_aliases on donated arrays), so the kernels write
// straight into the existing cache buffers. The write and the block copy are
// dtype-agnostic 16-byte copies (FP8 caches included): a cache slot row
// (Hkv * D elements) and a cache block are contiguous. RopeAndCache makes the
// rows it writes: rotary embeddings applied where the cache is written.
// CopyOutsideGraphs moves a step's input bytes to where XLA's CUDA graphs read them.
#include <type_traits>

#include "common.h"

namespace jaxserve {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;  // independent 16-byte loads per thread in flight
constexpr int kRopeWarps = 4;   // heads a CTA of RopeAndCacheKernel

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

struct RopeParams {
  const void* qkv;                    // [T, (Hq + 2 Hkv) D]: q's heads, then k's, then v's
  void* q;                            // [T, Hq, D]
  void* k_cache;                      // [slots, Hkv, D]
  void* v_cache;
  const int32_t* positions;           // [T]
  const int32_t* slots;               // [T]; outside [0, num_slots): no cache write
  const float* inv_freq;              // [D / 2]
  const void* q_norm;                 // [D] RMSNorm weights of q's and k's heads, or null
  const void* k_norm;
  const float* k_scale;               // [Hkv], FP8 caches
  const float* v_scale;
  int64_t num_slots;
  int q_heads, kv_heads;
  float eps;
};

template <typename T>
__device__ __forceinline__ float Rounded(float x) {  // x rounded to T, as XLA rounds each op's result
  return static_cast<float>(Elem<T>::Store(x));
}

// A cache element: x itself, or over an e4m3 cache x / scale clipped to e4m3's range (it has no infinity).
template <typename C>
__device__ __forceinline__ C CacheValue(float x, float scale) {
  if constexpr (std::is_same_v<C, __nv_fp8_e4m3>) {
    __nv_fp8_e4m3 out;
    out.__x = __nv_cvt_float_to_fp8(fminf(fmaxf(x / scale, -kFp8Max), kFp8Max), __NV_SATFINITE, __NV_E4M3);
    return out;
  } else {
    return Elem<C>::Store(x);
  }
}

// grid (T, heads / kRopeWarps), a warp a head of token t's fused q/k/v row. q and k heads: RMS-normed over D where
// the model norms them, rotated (HF's rotate-half: element i pairs with i + D / 2), rounded to T; q's written to
// `q` (over an FP8 cache times k_scale, as the kernels then read stored k unscaled), k's to the cache. v's to the
// cache as they are. Lane l holds elements l E .. l E + E - 1 of each half. The arithmetic is the XLA ops' it
// replaces (custom_calls.rope_and_cache_reference): f32, each op's result rounded to T where theirs is.
template <typename T, typename C, int kD>
__global__ void __launch_bounds__(kRopeWarps * 32) RopeAndCacheKernel(RopeParams p) {
  constexpr int kHalf = kD / 2, kE = kD / 64;
  const int lane = threadIdx.x % 32, head = blockIdx.y * kRopeWarps + threadIdx.x / 32, t = blockIdx.x;
  if (head >= p.q_heads + 2 * p.kv_heads) return;
  const bool is_q = head < p.q_heads, is_v = head >= p.q_heads + p.kv_heads;
  const int kv_head = is_q ? head * p.kv_heads / p.q_heads : head - p.q_heads - (is_v ? p.kv_heads : 0);
  const int64_t slot = p.slots[t];
  const bool cached = slot >= 0 && slot < p.num_slots;
  if (!is_q && !cached) return;
  const T* row = static_cast<const T*>(p.qkv) + (static_cast<int64_t>(t) * (p.q_heads + 2 * p.kv_heads) + head) * kD;
  float a[kE], b[kE];
#pragma unroll
  for (int j = 0; j < kE; ++j) {
    a[j] = static_cast<float>(row[lane * kE + j]);
    b[j] = static_cast<float>(row[kHalf + lane * kE + j]);
  }
  if (!is_v) {
    const T* norm = static_cast<const T*>(is_q ? p.q_norm : p.k_norm);
    if (norm) {
      float squares = 0.f;
#pragma unroll
      for (int j = 0; j < kE; ++j) squares += a[j] * a[j] + b[j] * b[j];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
      const float inv = rsqrtf(squares / kD + p.eps);
#pragma unroll
      for (int j = 0; j < kE; ++j) {
        a[j] = Rounded<T>(static_cast<float>(norm[lane * kE + j]) * Rounded<T>(a[j] * inv));
        b[j] = Rounded<T>(static_cast<float>(norm[kHalf + lane * kE + j]) * Rounded<T>(b[j] * inv));
      }
    }
    const float position = static_cast<float>(p.positions[t]);
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      float sin, cos;
      sincosf(position * p.inv_freq[lane * kE + j], &sin, &cos);
      const float x1 = a[j], x2 = b[j];
      a[j] = Rounded<T>(x1 * cos - x2 * sin);
      b[j] = Rounded<T>(x2 * cos + x1 * sin);
    }
  }
  if (is_q) {
    constexpr bool scaled = std::is_same_v<C, __nv_fp8_e4m3>;
    const float scale = scaled ? p.k_scale[kv_head] : 1.f;
    T* q = static_cast<T*>(p.q) + (static_cast<int64_t>(t) * p.q_heads + head) * kD;
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      q[lane * kE + j] = Elem<T>::Store(scaled ? a[j] * scale : a[j]);
      q[kHalf + lane * kE + j] = Elem<T>::Store(scaled ? b[j] * scale : b[j]);
    }
    return;
  }
  const float scale = std::is_same_v<C, __nv_fp8_e4m3> ? (is_v ? p.v_scale : p.k_scale)[kv_head] : 1.f;
  C* cache = static_cast<C*>(is_v ? p.v_cache : p.k_cache) + (slot * p.kv_heads + kv_head) * kD;
#pragma unroll
  for (int j = 0; j < kE; ++j) {
    cache[lane * kE + j] = CacheValue<C>(a[j], scale);
    cache[kHalf + lane * kE + j] = CacheValue<C>(b[j], scale);
  }
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

// src's bytes into out, a copy on the stream. Registered without the command-buffer trait, so XLA runs it as a
// thunk of its own before the step's CUDA graph: src, a step's inputs just sent, is a new buffer at every step,
// and a graph command reading it would have XLA record the whole graph again; out, in XLA's temp buffer, stays
// where the graph's commands read it.
ffi::Error CopyOutsideGraphs(cudaStream_t stream, ffi::Buffer<ffi::U8> src, ffi::Result<ffi::Buffer<ffi::U8>> out) {
  if (out->size_bytes() != src.size_bytes()) return ffi::Error::InvalidArgument("out must be src's size");
  if (src.size_bytes())
    cudaMemcpyAsync(out->untyped_data(), src.untyped_data(), src.size_bytes(), cudaMemcpyDeviceToDevice, stream);
  return LaunchStatus("copy_outside_graphs");
}

template <typename T, typename C>
void LaunchRope(const RopeParams& p, int tokens, int head_dim, cudaStream_t stream) {
  const dim3 grid(tokens, CeilDiv(p.q_heads + 2 * p.kv_heads, kRopeWarps));
  if (head_dim == 64) RopeAndCacheKernel<T, C, 64><<<grid, kRopeWarps * 32, 0, stream>>>(p);
  if (head_dim == 128) RopeAndCacheKernel<T, C, 128><<<grid, kRopeWarps * 32, 0, stream>>>(p);
  if (head_dim == 256) RopeAndCacheKernel<T, C, 256><<<grid, kRopeWarps * 32, 0, stream>>>(p);
}

template <typename T>
void DispatchRope(const RopeParams& p, bool fp8_cache, int tokens, int head_dim, cudaStream_t stream) {
  if (fp8_cache)
    LaunchRope<T, __nv_fp8_e4m3>(p, tokens, head_dim, stream);
  else
    LaunchRope<T, T>(p, tokens, head_dim, stream);
}

// An RMSNorm weight of q's or k's heads: [D] in qkv's dtype, or [0] for none.
ffi::Error NormWeight(const ffi::AnyBuffer& w, const ffi::AnyBuffer& qkv, int64_t head_dim, const void** out) {
  if (w.element_count() != 0 && (w.element_count() != static_cast<size_t>(head_dim) ||
                                 w.element_type() != qkv.element_type()))
    return ffi::Error::InvalidArgument("rope_and_cache: q_norm and k_norm must be [D] in qkv's dtype, or [0]");
  *out = w.element_count() ? w.untyped_data() : nullptr;
  return ffi::Error::Success();
}

// qkv [T, (Hq + 2 Hkv) D] bf16/f16 -> q [T, Hq, D]; k and v rows into the caches (qkv's dtype or e4m3).
ffi::Error RopeAndCache(cudaStream_t stream, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::AnyBuffer qkv,
                        ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> slot_mapping,
                        ffi::Buffer<ffi::F32> inv_freq, ffi::AnyBuffer q_norm, ffi::AnyBuffer k_norm,
                        ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::AnyBuffer> k_out,
                        ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> q_out, int32_t num_q_heads,
                        float eps) {
  int64_t row_bytes = 0;
  if (ffi::Error err = SlotRowBytes(k_cache, v_cache, &row_bytes); err.failure()) return err;
  const auto kd = k_cache.dimensions(), xd = qkv.dimensions();
  const int64_t kv_heads = kd[2], head_dim = kd[3], tokens = xd.size() == 2 ? xd[0] : -1;
  const auto dtype = qkv.element_type();
  const bool fp8_cache = k_cache.element_type() == ffi::DataType::F8E4M3FN;
  if ((dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) ||
      (!fp8_cache && k_cache.element_type() != dtype))
    return ffi::Error::InvalidArgument("rope_and_cache: qkv must be bf16 or f16 and the caches in its dtype or e4m3");
  if (head_dim != 64 && head_dim != 128 && head_dim != 256)
    return ffi::Error::InvalidArgument("rope_and_cache: D must be 64, 128 or 256");
  if (tokens < 0 || num_q_heads < 1 || xd[1] != (num_q_heads + 2 * kv_heads) * head_dim ||
      positions.element_count() != static_cast<size_t>(tokens) ||
      slot_mapping.element_count() != static_cast<size_t>(tokens) ||
      inv_freq.element_count() != static_cast<size_t>(head_dim / 2) ||
      k_scale.element_count() != static_cast<size_t>(kv_heads) ||
      v_scale.element_count() != static_cast<size_t>(kv_heads) || q_out->element_type() != dtype ||
      q_out->element_count() != static_cast<size_t>(tokens * num_q_heads * head_dim) || num_q_heads % kv_heads)
    return ffi::Error::InvalidArgument("rope_and_cache: qkv [T, (Hq + 2 Hkv) D], positions and slot_mapping [T], "
                                       "inv_freq [D / 2], scales [Hkv], q [T, Hq, D] in qkv's dtype, Hkv | Hq");
  RopeParams p{qkv.untyped_data(), q_out->untyped_data(), k_out->untyped_data(), v_out->untyped_data(),
               positions.typed_data(), slot_mapping.typed_data(), inv_freq.typed_data()};
  if (ffi::Error err = NormWeight(q_norm, qkv, head_dim, &p.q_norm); err.failure()) return err;
  if (ffi::Error err = NormWeight(k_norm, qkv, head_dim, &p.k_norm); err.failure()) return err;
  p.k_scale = k_scale.typed_data();
  p.v_scale = v_scale.typed_data();
  p.num_slots = kd[0] * kd[1];
  p.q_heads = num_q_heads;
  p.kv_heads = kv_heads;
  p.eps = eps;
  if (tokens == 0) return ffi::Error::Success();
  if (dtype == ffi::DataType::BF16)
    DispatchRope<__nv_bfloat16>(p, fp8_cache, tokens, head_dim, stream);
  else
    DispatchRope<__half>(p, fp8_cache, tokens, head_dim, stream);
  return LaunchStatus("rope_and_cache launch");
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRopeAndCache, jaxserve::RopeAndCache,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("num_q_heads")
                                  .Attr<float>("eps"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveCopyOutsideGraphs, jaxserve::CopyOutsideGraphs,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>());
