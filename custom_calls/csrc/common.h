// Shared helpers for jaxserve's CUDA custom calls: vector load -> float
// conversion per element type, and launch-error reporting through XLA FFI.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

namespace ffi = xla::ffi;

// One 16-byte access: the widest load/store a thread can issue.
using Vec16 = uint4;

// Elem<T>::Vec is one load of kPerVec elements of T; ToFloat widens it to f32.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  using Vec = Vec16;
  static constexpr int kPerVec = 4;
  __device__ __forceinline__ static void ToFloat(const Vec16& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static float Store(float x) { return x; }
};

template <>
struct Elem<__nv_bfloat16> {
  using Vec = Vec16;
  static constexpr int kPerVec = 8;
  // bf16 is the top half of an f32: widening is a shift or a mask.
  __device__ __forceinline__ static void ToFloat(const Vec16& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static __nv_bfloat16 Store(float x) { return __float2bfloat16(x); }
};

template <>
struct Elem<__half> {
  using Vec = Vec16;
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static void ToFloat(const Vec16& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = pair.x;
      f[2 * i + 1] = pair.y;
    }
  }
  __device__ __forceinline__ static __half Store(float x) { return __float2half(x); }
};

// FP8 e4m3, a KV cache only (never stored). An 8-byte load gives 8 elements, as a 16-byte bf16 load does: 16
// per lane would double the paged kernel's per-lane registers and overflow its static shared accumulators.
// cvt.f16x2.e4m3x2 (sm_89+; emulated on sm_80) widens two at a time, exactly.
template <>
struct Elem<__nv_fp8_e4m3> {
  using Vec = uint2;
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static void ToFloat(const Vec& v, float* f) {
    const uint32_t w[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const auto two = static_cast<__nv_fp8x2_storage_t>(w[i / 2] >> (16 * (i % 2)));  // elements 2i, 2i + 1
      const float2 pair = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3)));
      f[2 * i] = pair.x;
      f[2 * i + 1] = pair.y;
    }
  }
};

// N contiguous elements of T at src (aligned to a whole Vec), widened into f.
template <typename T, int N>
__device__ __forceinline__ void LoadFloats(const T* src, float* f) {
  static_assert(N % Elem<T>::kPerVec == 0, "N must be a whole number of loads");
#pragma unroll
  for (int i = 0; i < N; i += Elem<T>::kPerVec)
    Elem<T>::ToFloat(*reinterpret_cast<const typename Elem<T>::Vec*>(src + i), f + i);
}

__host__ __device__ constexpr int CeilDiv(int a, int b) { return (a + b - 1) / b; }

constexpr float kFp8Max = 448.0f;  // e4m3fn's largest finite value

// silu(g) * u in f32, to be rounded to bf16 once: what the MLP's product is (XLA's bf16 product, rounded along the
// way, was up to ~1% from it on the H200). The fast exp and division (2 ulp of f32) are far below that rounding;
// the quantize kernel is bound by its arithmetic with the IEEE ones. A large -g makes exp(-g) infinite and the
// product 0, as it should be.
__device__ __forceinline__ float SiluMul(float g, float u) {
  return __fdividef(g, 1.0f + __expf(-g)) * u;
}

// Reports the launch status of the kernels just queued on the stream.
inline ffi::Error LaunchStatus(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

// What a KV cache may hold: f32, bf16, f16, or FP8 e4m3 that the engine quantized.
inline bool IsCacheType(ffi::DataType dtype) {
  return dtype == ffi::DataType::F32 || dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16 ||
         dtype == ffi::DataType::F8E4M3FN;
}

}  // namespace jaxserve
