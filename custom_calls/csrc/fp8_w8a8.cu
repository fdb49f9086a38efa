// W8A8 linears of many-row steps, without XLA's fusions around the GEMM:
//  - Fp8QuantizeRows: bf16 x [N, K], or silu(x) * up, or RMSNorm(x) -> e4m3 [N, K] and an f32 scale a row,
//    amax / 448, in one read of the input (XLA took a reduction and a conversion, each reading the input, and a
//    kernel or two for the SiLU product or the norm in front of them).
//  - Fp8ScaledMm: y [N, M] = (xq [N, K] . w [M, K]^T) * x_scale [N] * w_scale [M] in bf16, one cuBLASLt FP8 GEMM
//    with both scale vectors in its epilogue (outer-vector scaling, cuBLAS 12.9+ on sm_90+): XLA's FP8 GEMM takes
//    scalar scales only, so it wrote an f32 product that a fusion then read, scaled and rounded.
//  - Fp8Mm: the f32 product xq . w^T alone, for the scales to follow in a fusion: cuBLASLt has one algorithm for
//    outer-vector scales (a 128 x 128 tile, no split of K), too few CTAs for a deep weight under few rows (the MLP's
//    down projection), where the unscaled GEMM's split-K kernels are faster. A custom call, unlike XLA's own cuBLASLt
//    GEMM, stays inside the step's CUDA graph.
#include <algorithm>
#include <cfloat>
#include <map>
#include <tuple>

#include "common.h"

#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
#define JAXSERVE_HAS_CUBLASLT 1
#else
#define JAXSERVE_HAS_CUBLASLT 0
#endif

namespace jaxserve {
namespace {

constexpr int kVecsPerThread = 4;   // 16-byte pieces of a row a thread keeps in registers
constexpr int kMaxQuantizeThreads = 1024;

// Eight bf16 of a 16-byte piece replaced by silu(g) * u of g's and u's.
__device__ __forceinline__ Vec16 SiluMulPiece(const Vec16& g, const Vec16& u) {
  float gf[8], uf[8];
  Elem<__nv_bfloat16>::ToFloat(g, gf);
  Elem<__nv_bfloat16>::ToFloat(u, uf);
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(SiluMul(gf[2 * i], uf[2 * i]),
                                                      SiluMul(gf[2 * i + 1], uf[2 * i + 1]));   // rounded once
    out[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// A row's sum (kMax false) or max over the CTA, every thread given the result.
template <bool kMax>
__device__ __forceinline__ float BlockReduce(float v, float* shared) {
  const auto op = [](float a, float b) { return kMax ? fmaxf(a, b) : a + b; };
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();   // shared may still be read from the reduction before
  if (threadIdx.x % 32 == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < warps ? shared[threadIdx.x] : 0.0f;
  if (warp == 0) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    if (threadIdx.x == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

enum class Input : int32_t { kRows = 0, kSiluProduct = 1, kRmsNorm = 2 };

// Eight bf16 of x's piece through the RMS norm: bf16(x * rms) times the weight's, rounded (RMSNorm's roundings).
__device__ __forceinline__ Vec16 NormPiece(const Vec16& x, const Vec16& weight, float rms) {
  float xf[8], wf[8];
  Elem<__nv_bfloat16>::ToFloat(x, xf);
  Elem<__nv_bfloat16>::ToFloat(weight, wf);
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 y = __floats2bfloat162_rn(xf[2 * i] * rms, xf[2 * i + 1] * rms);
    const float2 yf = __bfloat1622float2(y);
    const __nv_bfloat162 h = __floats2bfloat162_rn(wf[2 * i] * yf.x, wf[2 * i + 1] * yf.y);
    out[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// One CTA a row; thread t holds the row's 16-byte pieces t, t + blockDim.x, ... in registers, all loads issued
// before any is used (a row is read once, with as many bytes in flight as the registers hold). `other` is up
// (kSiluProduct: silu(x) * up) or the norm's weight [K] (kRmsNorm: RMSNorm(x)).
template <Input kInput>
__global__ void __launch_bounds__(kMaxQuantizeThreads)
    QuantizeRowsKernel(const Vec16* x, const Vec16* other, uint2* q, float* scale, int vecs_per_row, float eps) {
  __shared__ float partial[32];
  const size_t base = blockIdx.x * size_t{1} * vecs_per_row;
  Vec16 h[kVecsPerThread], o[kVecsPerThread];
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    h[j] = i < vecs_per_row ? x[base + i] : Vec16{0, 0, 0, 0};
    if constexpr (kInput == Input::kSiluProduct) o[j] = i < vecs_per_row ? other[base + i] : Vec16{0, 0, 0, 0};
    if constexpr (kInput == Input::kRmsNorm) o[j] = i < vecs_per_row ? other[i] : Vec16{0, 0, 0, 0};
  }
  float rms = 0.0f;
  if constexpr (kInput == Input::kRmsNorm) {
    float squares = 0.0f;
#pragma unroll
    for (int j = 0; j < kVecsPerThread; ++j) {
      float f[8];
      Elem<__nv_bfloat16>::ToFloat(h[j], f);
#pragma unroll
      for (int e = 0; e < 8; ++e) squares = fmaf(f[e], f[e], squares);
    }
    rms = rsqrtf(BlockReduce<false>(squares, partial) / (8.0f * vecs_per_row) + eps);
  }
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
    if constexpr (kInput == Input::kSiluProduct) h[j] = SiluMulPiece(h[j], o[j]);
    if constexpr (kInput == Input::kRmsNorm) h[j] = NormPiece(h[j], o[j], rms);
    float f[8];
    Elem<__nv_bfloat16>::ToFloat(h[j], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e]));
  }
  // amax times 1/448 rounded to f32, and its reciprocal, as the reference computes them
  const float s = fmaxf(BlockReduce<true>(amax, partial) * (1.0f / kFp8Max), FLT_MIN), inverse = 1.0f / s;
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
#pragma unroll
  for (int j = 0; j < kVecsPerThread; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i >= vecs_per_row) break;
    float f[8];
    Elem<__nv_bfloat16>::ToFloat(h[j], f);
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = fminf(fmaxf(f[e] * inverse, -kFp8Max), kFp8Max);
      packed[e / 4] |= uint32_t{__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)} << (8 * (e % 4));
    }
    q[base + i] = make_uint2(packed[0], packed[1]);
  }
}

ffi::Error Fp8QuantizeRows(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingArgs args,
                           ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::F32>> scale, int32_t input,
                           float eps) {
  if (x.element_type() != ffi::DataType::BF16 || x.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("fp8_quantize_rows takes bf16 x [N, K]");
  const int64_t n = x.dimensions()[0], k = x.dimensions()[1];
  const int vecs = static_cast<int>(k / 8);
  if (k % 8 || vecs > kVecsPerThread * kMaxQuantizeThreads)
    return ffi::Error::InvalidArgument("fp8_quantize_rows needs K % 8 == 0 and K <= 32768");
  if (q->element_type() != ffi::DataType::F8E4M3FN || q->element_count() != x.element_count() ||
      scale->element_count() != static_cast<size_t>(n))
    return ffi::Error::InvalidArgument("fp8_quantize_rows gives e4m3 q [N, K] and f32 scale [N]");
  const auto kind = static_cast<Input>(input);
  if (kind != Input::kRows && kind != Input::kSiluProduct && kind != Input::kRmsNorm)
    return ffi::Error::InvalidArgument("fp8_quantize_rows: input must be 0 (rows), 1 (silu product), 2 (RMS norm)");
  const size_t other_count = kind == Input::kSiluProduct ? x.element_count() : k;
  if (args.size() != (kind == Input::kRows ? 0 : 1))
    return ffi::Error::InvalidArgument("fp8_quantize_rows: x alone, or x and up [N, K] or the norm's weight [K]");
  const Vec16* other = nullptr;
  if (kind != Input::kRows) {
    auto o = args.get<ffi::AnyBuffer>(0);
    if (!o.has_value() || o->element_type() != ffi::DataType::BF16 || o->element_count() != other_count)
      return ffi::Error::InvalidArgument("fp8_quantize_rows: up [N, K] or the norm's weight [K] must be bf16");
    other = static_cast<const Vec16*>(o->untyped_data());
  }
  if (n == 0) return ffi::Error::Success();
  const int threads = std::min(kMaxQuantizeThreads, CeilDiv(CeilDiv(vecs, kVecsPerThread), 32) * 32);
  auto* xv = static_cast<const Vec16*>(x.untyped_data());
  auto* qv = static_cast<uint2*>(q->untyped_data());
  float* sv = scale->typed_data();
  switch (kind) {
    case Input::kRows:
      QuantizeRowsKernel<Input::kRows><<<n, threads, 0, stream>>>(xv, other, qv, sv, vecs, eps);
      break;
    case Input::kSiluProduct:
      QuantizeRowsKernel<Input::kSiluProduct><<<n, threads, 0, stream>>>(xv, other, qv, sv, vecs, eps);
      break;
    case Input::kRmsNorm:
      QuantizeRowsKernel<Input::kRmsNorm><<<n, threads, 0, stream>>>(xv, other, qv, sv, vecs, eps);
      break;
  }
  return LaunchStatus("fp8_quantize_rows launch");
}

#if JAXSERVE_HAS_CUBLASLT

ffi::Error LtError(const char* what, cublasStatus_t status) {
  return ffi::Error::Internal(std::string("cuBLASLt's FP8 GEMM: ") + what + " failed (cuBLAS status " +
                              std::to_string(static_cast<int>(status)) + ")");
}

// A calling thread's cuBLASLt handle for each device (a handle is not to be used by two threads at once), and the
// algorithm cuBLASLt's heuristic picks for each shape: a step's graphs ask for a few shapes, again at every
// recording. Kept for the thread's life (XLA's threads live as long as the client).
struct LtState {
  std::map<int, cublasLtHandle_t> handles;
  std::map<std::tuple<int, int64_t, int64_t, int64_t, size_t, bool>, cublasLtMatmulAlgo_t> algos;
};

LtState& State() {
  thread_local auto* state = new LtState;   // never destroyed: a handle outliving its context must not be freed
  return *state;
}

// RAII for the descriptors of one call.
struct LtCall {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~LtCall() {
    if (preference) cublasLtMatmulPreferenceDestroy(preference);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// Column-major, as cuBLASLt sees row-major arrays: y^T [M, N] = w [K, M]^T . x [K, N]; A is the weight (its
// scale vector has M elements), B the activations (N). With scales (both or neither) y is their product's bf16,
// without them the f32 product.
ffi::Error LtFp8Gemm(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w, const float* x_scale,
                     const float* w_scale, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> workspace) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const int64_t n = xd[0], m = wd[0], k = xd[1];
  const bool scaled = x_scale != nullptr;
  LtState& state = State();
  cublasLtHandle_t& handle = state.handles[device];
  cublasStatus_t status;
  if (!handle && (status = cublasLtCreate(&handle)) != CUBLAS_STATUS_SUCCESS) {
    handle = nullptr;
    return LtError("cublasLtCreate", status);
  }
  LtCall call;
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  const cublasLtMatmulMatrixScale_t outer = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
  const int8_t fast_accum = 1;   // XLA's FP8 GEMMs accumulate so too
  const void* a_scale = w_scale;
  const void* b_scale = x_scale;
  const size_t workspace_bytes = workspace->size_bytes();
  if ((status = cublasLtMatmulDescCreate(&call.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
      (status = cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa)) ||
      (status = cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb)) ||
      (status = cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum,
                                               sizeof fast_accum)) ||
      (scaled &&
       ((status = cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer,
                                                 sizeof outer)) ||
        (status = cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer,
                                                 sizeof outer)) ||
        (status = cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale,
                                                 sizeof a_scale)) ||
        (status = cublasLtMatmulDescSetAttribute(call.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale,
                                                 sizeof b_scale)))) ||
      (status = cublasLtMatrixLayoutCreate(&call.a, CUDA_R_8F_E4M3, k, m, k)) ||
      (status = cublasLtMatrixLayoutCreate(&call.b, CUDA_R_8F_E4M3, k, n, k)) ||
      (status = cublasLtMatrixLayoutCreate(&call.d, scaled ? CUDA_R_16BF : CUDA_R_32F, m, n, m)))
    return LtError("describing the GEMM", status);
  const auto key = std::make_tuple(device, n, m, k, workspace_bytes, scaled);
  auto found = state.algos.find(key);
  if (found == state.algos.end()) {
    cublasLtMatmulHeuristicResult_t result{};
    int count = 0;
    if ((status = cublasLtMatmulPreferenceCreate(&call.preference)) ||
        (status = cublasLtMatmulPreferenceSetAttribute(call.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                       &workspace_bytes, sizeof workspace_bytes)) ||
        (status = cublasLtMatmulAlgoGetHeuristic(handle, call.desc, call.a, call.b, call.d, call.d, call.preference,
                                                 1, &result, &count)))
      return LtError("cublasLtMatmulAlgoGetHeuristic", status);
    if (count == 0)
      return ffi::Error::Internal(scaled ? "fp8_scaled_mm: cuBLASLt has no FP8 GEMM with outer-vector scales for "
                                           "this shape on this GPU (needs cuBLAS 12.9+ and sm_90+)"
                                         : "fp8_mm: cuBLASLt has no FP8 GEMM for this shape on this GPU (sm_89+)");
    found = state.algos.emplace(key, result.algo).first;
  }
  const cublasLtMatmulAlgo_t algo = found->second;
  const float alpha = 1.0f, beta = 0.0f;
  status = cublasLtMatmul(handle, call.desc, &alpha, w.untyped_data(), call.a, x.untyped_data(), call.b, &beta,
                          y->untyped_data(), call.d, y->untyped_data(), call.d, &algo, workspace->untyped_data(),
                          workspace_bytes, stream);
  return status == CUBLAS_STATUS_SUCCESS ? ffi::Error::Success() : LtError("cublasLtMatmul", status);
}

// Why x [N, K] and w [M, K] are no e4m3 GEMM's operands with y [N, M] of y_type (empty when they are).
const char* GemmShapeError(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer y, ffi::DataType y_type) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (x.element_type() != ffi::DataType::F8E4M3FN || w.element_type() != ffi::DataType::F8E4M3FN ||
      xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return "takes e4m3 x [N, K] and w [M, K]";
  if (xd[1] % 16 || wd[0] % 16) return "needs K and M multiples of 16";
  if (y.element_type() != y_type || y.element_count() != static_cast<size_t>(xd[0] * wd[0]))
    return y_type == ffi::DataType::BF16 ? "writes bf16 y [N, M]" : "writes f32 y [N, M]";
  return "";
}

ffi::Error Fp8ScaledMm(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                       ffi::Buffer<ffi::F32> x_scale, ffi::Buffer<ffi::F32> w_scale, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> workspace) {
  if (const char* error = GemmShapeError(x, w, *y, ffi::DataType::BF16); *error)
    return ffi::Error::InvalidArgument(std::string("fp8_scaled_mm ") + error);
  if (x_scale.element_count() != static_cast<size_t>(x.dimensions()[0]) ||
      w_scale.element_count() != static_cast<size_t>(w.dimensions()[0]))
    return ffi::Error::InvalidArgument("fp8_scaled_mm: f32 x_scale [N], w_scale [M]");
  if (x.dimensions()[0] == 0) return ffi::Error::Success();
  return LtFp8Gemm(stream, device, x, w, x_scale.typed_data(), w_scale.typed_data(), y, workspace);
}

ffi::Error Fp8Mm(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                 ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> workspace) {
  if (const char* error = GemmShapeError(x, w, *y, ffi::DataType::F32); *error)
    return ffi::Error::InvalidArgument(std::string("fp8_mm ") + error);
  if (x.dimensions()[0] == 0) return ffi::Error::Success();
  return LtFp8Gemm(stream, device, x, w, nullptr, nullptr, y, workspace);
}

#else

ffi::Error Fp8ScaledMm(cudaStream_t, int32_t, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Buffer<ffi::F32>,
                       ffi::Buffer<ffi::F32>, ffi::Result<ffi::AnyBuffer>, ffi::Result<ffi::AnyBuffer>) {
  return ffi::Error::Internal("fp8_scaled_mm: the library was built without cuBLASLt's header");
}

ffi::Error Fp8Mm(cudaStream_t, int32_t, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>,
                 ffi::Result<ffi::AnyBuffer>) {
  return ffi::Error::Internal("fp8_mm: the library was built without cuBLASLt's header");
}

#endif

}  // namespace
}  // namespace jaxserve

// Whether Fp8ScaledMm and Fp8Mm were built (custom_calls asks before choosing it).
extern "C" int JaxserveHasCublasLt() { return JAXSERVE_HAS_CUBLASLT; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFp8QuantizeRows, jaxserve::Fp8QuantizeRows,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int32_t>("input")
                                  .Attr<float>("eps"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFp8ScaledMm, jaxserve::Fp8ScaledMm,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveFp8Mm, jaxserve::Fp8Mm,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
