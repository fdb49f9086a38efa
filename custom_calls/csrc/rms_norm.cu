// The residual add and the RMS norm after it in one kernel: a decoder layer's sublayer output joins the residual
// stream and the stream is normalised for the next sublayer, where XLA runs an add and a norm (two launches, the
// sum written and read back between them).
#include "common.h"

namespace jaxserve {
namespace {

constexpr int kNormThreads = 256;
constexpr int kNormVecs = 4;  // 16-byte vectors of a row a thread keeps in registers: rows up to 8,192 of bf16
constexpr int kNormWarps = kNormThreads / 32;

template <typename T>
__device__ __forceinline__ Vec16 PackRounded(const float* f) {
  Vec16 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = Elem<T>::Store(f[i]);
  return v;
}

// Block-wide sum of each thread's v, returned to every thread.
__device__ __forceinline__ float BlockSum(float v) {
  __shared__ float warp_sums[kNormWarps];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kNormWarps; ++w) total += warp_sums[w];
  return total;
}

// A CTA a row: sum = x + delta rounded to T (XLA's add), then out = w * T(sum * rsqrt(mean(sum^2) + eps)),
// the mean over the rounded sums in f32, the product of two T values exact in f32 and rounded once.
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    AddRmsNormKernel(const Vec16* x, const Vec16* delta, const Vec16* weight, Vec16* out, Vec16* sum, int row_vecs,
                     float inv_width, float eps) {
  const int64_t base = int64_t{blockIdx.x} * row_vecs;
  Vec16 s[kNormVecs], d[kNormVecs], w[kNormVecs];
#pragma unroll
  for (int c = 0; c < kNormVecs; ++c) {   // every load issued before the first store (sum aliases x)
    const int i = c * kNormThreads + threadIdx.x;
    if (i < row_vecs) s[c] = x[base + i], d[c] = delta[base + i], w[c] = weight[i];
  }
  float squares = 0.0f;
#pragma unroll
  for (int c = 0; c < kNormVecs; ++c) {
    const int i = c * kNormThreads + threadIdx.x;
    if (i >= row_vecs) break;
    float a[8], b[8];
    Elem<T>::ToFloat(s[c], a);
    Elem<T>::ToFloat(d[c], b);
#pragma unroll
    for (int e = 0; e < 8; ++e) a[e] += b[e];
    s[c] = PackRounded<T>(a);
    sum[base + i] = s[c];
    Elem<T>::ToFloat(s[c], a);
#pragma unroll
    for (int e = 0; e < 8; ++e) squares += a[e] * a[e];
  }
  const float r = rsqrtf(BlockSum(squares) * inv_width + eps);
#pragma unroll
  for (int c = 0; c < kNormVecs; ++c) {
    const int i = c * kNormThreads + threadIdx.x;
    if (i >= row_vecs) break;
    float a[8], b[8];
    Elem<T>::ToFloat(s[c], a);
    Elem<T>::ToFloat(w[c], b);
#pragma unroll
    for (int e = 0; e < 8; ++e) a[e] = b[e] * static_cast<float>(Elem<T>::Store(a[e] * r));
    out[base + i] = PackRounded<T>(a);
  }
}

// x, delta [T, H] and weight [H] in bf16 or f16 -> (out, sum) [T, H]; sum aliases x.
ffi::Error AddRmsNorm(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer delta, ffi::AnyBuffer weight,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> sum, float eps) {
  const auto dims = x.dimensions();
  const auto dtype = x.element_type();
  const int64_t rows = dims.size() == 2 ? dims[0] : -1, width = dims.size() == 2 ? dims[1] : 0;
  if ((dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16) || delta.element_type() != dtype ||
      weight.element_type() != dtype)
    return ffi::Error::InvalidArgument("add_rms_norm: x, delta and weight must share one dtype, bf16 or f16");
  if (rows < 0 || width % 8 || width > 8 * kNormVecs * kNormThreads || delta.element_count() != x.element_count() ||
      weight.element_count() != static_cast<size_t>(width) || out->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("add_rms_norm: x and delta [T, H], weight [H], H a multiple of 8 up to 8192");
  if (rows == 0) return ffi::Error::Success();
  auto args = [](const ffi::AnyBuffer& b) { return static_cast<const Vec16*>(b.untyped_data()); };
  auto* o = static_cast<Vec16*>(out->untyped_data());
  auto* s = static_cast<Vec16*>(sum->untyped_data());
  const int row_vecs = static_cast<int>(width / 8);
  if (dtype == ffi::DataType::BF16)
    AddRmsNormKernel<__nv_bfloat16><<<rows, kNormThreads, 0, stream>>>(
        args(x), args(delta), args(weight), o, s, row_vecs, 1.0f / width, eps);
  else
    AddRmsNormKernel<__half><<<rows, kNormThreads, 0, stream>>>(
        args(x), args(delta), args(weight), o, s, row_vecs, 1.0f / width, eps);
  return LaunchStatus("add_rms_norm launch");
}

}  // namespace
}  // namespace jaxserve

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAddRmsNorm, jaxserve::AddRmsNorm,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<float>("eps"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
