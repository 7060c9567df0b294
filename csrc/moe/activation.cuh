// Expert activations, evaluated in fp32 on the GEMM1 accumulators.
#pragma once
#include "moe/params.cuh"

namespace flashdmoe {

// The logistic function from the hardware exp2 and reciprocal (__expf, __fdividef): a few ulp of fp32,
// far below the 16-bit rounding of what it feeds, in a third of the instructions of expf and an IEEE
// division; the activation is a tenth of an expert tile's time (docs/perf-notes.md). Past v < -87 the
// divisor exceeds 2^126 and the result is 0, as the exact value rounds to in every storage format.
__device__ __forceinline__ float sigmoid(float v) { return __fdividef(1.f, 1.f + __expf(-v)); }
__device__ __forceinline__ float silu(float v) { return v * sigmoid(v); }

// For swiglu the caller passes the gate value; the up value multiplies afterwards.
__device__ __forceinline__ float activate(Activation kind, float v) {
  switch (kind) {
    case Activation::Relu: return fmaxf(v, 0.f);
    case Activation::Gelu: return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));  // exact erf form
    default: return silu(v);  // Silu and the gate of Swiglu
  }
}

}  // namespace flashdmoe

namespace flashdmoe {

// d act / d v for the non-gated activations and the gate of swiglu (silu's slope), as the reference
// differentiates them: relu's slope is 0 at 0, gelu is the exact erf form.
__device__ __forceinline__ float activation_slope(Activation kind, float v) {
  switch (kind) {
    case Activation::Relu: return v > 0.f ? 1.f : 0.f;
    case Activation::Gelu: {
      const float cdf = 0.5f * (1.f + erff(v * 0.70710678118654752f));
      const float pdf = 0.39894228040143268f * expf(-0.5f * v * v);
      return cdf + v * pdf;
    }
    default: {
      const float sig = sigmoid(v);
      return sig * (1.f + v * (1.f - sig));
    }
  }
}

// The activation and its slope from one erf / one logistic (the backward's epilogue needs both): the
// same expressions as activate and activation_slope, so the same values.
struct ValueAndSlope {
  float value, slope;
};
__device__ __forceinline__ ValueAndSlope activation_value_and_slope(Activation kind, float v) {
  switch (kind) {
    case Activation::Relu: return {fmaxf(v, 0.f), v > 0.f ? 1.f : 0.f};
    case Activation::Gelu: {
      const float erf_term = erff(v * 0.70710678118654752f);
      const float pdf = 0.39894228040143268f * expf(-0.5f * v * v);
      return {0.5f * v * (1.f + erf_term), 0.5f * (1.f + erf_term) + v * pdf};
    }
    default: {
      const float sig = sigmoid(v);
      return {v * sig, sig * (1.f + v * (1.f - sig))};
    }
  }
}

}  // namespace flashdmoe
