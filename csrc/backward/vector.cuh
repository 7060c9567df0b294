// Eight half-precision elements as one 16-byte vector, converted to and from float32, and the
// (dtype, activation) visitors the backward's launchers dispatch through.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdexcept>
#include <string>
#include <type_traits>
#include "moe/launch.h"

namespace flashdmoe::backward {

template <typename Element>
struct Vec8 {
  static_assert(sizeof(Element) == 2, "half-precision storage");
  uint4 bits;

  __device__ __forceinline__ static Vec8 load(const Element* src) { return {*reinterpret_cast<const uint4*>(src)}; }
  __device__ __forceinline__ void store(Element* dst) const { *reinterpret_cast<uint4*>(dst) = bits; }

  __device__ __forceinline__ void to_float(float (&out)[8]) const {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(&bits);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(words + i));
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
      } else {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(words + i));
        out[2 * i] = f.x, out[2 * i + 1] = f.y;
      }
    }
  }
  __device__ __forceinline__ static Vec8 from_float(const float (&in)[8]) {
    Vec8 v;
    uint32_t* words = reinterpret_cast<uint32_t*>(&v.bits);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
      } else {
        const __half2 pair = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&pair);
      }
    }
    return v;
  }
};

// f(Element{}) for a half-precision dtype code; float32 has no element-wise backward kernel.
template <typename F>
void visit_half_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::BFloat16: f(__nv_bfloat16{}); return;
    case DType::Float16: f(__half{}); return;
    default:
      throw std::invalid_argument("dtype code " + std::to_string(static_cast<int>(dtype)) +
                                  ": the backward's element-wise kernels take bfloat16 (0) or float16 (1)");
  }
}

template <Activation kKind>
using ActivationTag = std::integral_constant<Activation, kKind>;

template <typename F>
void visit_activation(Activation activation, F&& f) {
  switch (activation) {
    case Activation::Relu: f(ActivationTag<Activation::Relu>{}); return;
    case Activation::Gelu: f(ActivationTag<Activation::Gelu>{}); return;
    case Activation::Silu: f(ActivationTag<Activation::Silu>{}); return;
    case Activation::Swiglu: f(ActivationTag<Activation::Swiglu>{}); return;
  }
  throw std::invalid_argument("activation code " + std::to_string(static_cast<int>(activation)) + " is not 0..3");
}

inline void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

}  // namespace flashdmoe::backward
