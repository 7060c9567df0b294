// Expert activations, evaluated in fp32 on the GEMM1 accumulators.
#pragma once
#include "moe/params.cuh"

namespace flashdmoe {

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// For swiglu the caller passes the gate value; the up value multiplies afterwards.
__device__ __forceinline__ float activate(Activation kind, float v) {
  switch (kind) {
    case Activation::Relu: return fmaxf(v, 0.f);
    case Activation::Gelu: return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));  // exact erf form
    default: return silu(v);  // Silu and the gate of Swiglu
  }
}

}  // namespace flashdmoe
