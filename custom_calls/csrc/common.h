// Shared helpers for jaxserve's CUDA custom calls: 16-byte vector <-> float
// conversion per element type, and launch-error reporting through XLA FFI.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

namespace ffi = xla::ffi;

// One 16-byte access: the widest load/store a thread can issue.
using Vec16 = uint4;

template <typename T>
struct Elem;

template <>
struct Elem<float> {
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

__host__ __device__ constexpr int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// Reports the launch status of the kernels just queued on the stream.
inline ffi::Error LaunchStatus(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

inline bool IsFloatType(ffi::DataType dtype) {
  return dtype == ffi::DataType::F32 || dtype == ffi::DataType::BF16 || dtype == ffi::DataType::F16;
}

}  // namespace jaxserve
