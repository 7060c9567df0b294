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

// The exact (erf) GELU, v * Phi(v), written as 0.5 v + |v| (0.5 - q) with q = Phi(-|v|) = 2^p(t):
// t = min(|v|, kGeluTailClamp), p a degree-7 polynomial fit to log2 Phi(-t) (scripts/fit_gelu_cdf.py).
// One clamp, seven FFMA, one MUFU.EX2 and three more instructions per value, where erff took about 25
// (both its branches, selected per lane), with the tensor cores idle meanwhile: the activation was an
// eighth of a gelu expert phase (docs/perf-notes.md). The fit's error in Phi is 6.5e-8 at most, plus
// ex2.approx's 2^-22 relative: Phi to fp32 rounding, as erff gave it, and q keeps its relative accuracy
// far into the tail, where 1 + erff(v / sqrt 2) cancels. Past the clamp q is 1.1e-19.
// tests/test_numerics.py checks the coefficients against float64.
constexpr float kGeluTailClamp = 9.f;

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Phi(-|v|), the standard normal's tail beyond |v|.
__device__ __forceinline__ float normal_tail(float v) {
  const float t = fminf(fabsf(v), kGeluTailClamp);
  // log2 Phi(-t), coefficients highest order first
  float p = 8.470474313e-06f;
  p = fmaf(p, t, -5.390611841e-05f);
  p = fmaf(p, t, -4.212289059e-04f);
  p = fmaf(p, t, 7.389262319e-03f);
  p = fmaf(p, t, -5.269110575e-02f);
  p = fmaf(p, t, -4.591531456e-01f);
  p = fmaf(p, t, -1.151110888e+00f);
  p = fmaf(p, t, -9.999998808e-01f);
  return exp2_approx(p);
}

// +inf gives +inf, -inf NaN (as torch's erf form), NaN NaN.
__device__ __forceinline__ float gelu_from_tail(float v, float tail) { return fmaf(fabsf(v), 0.5f - tail, 0.5f * v); }
__device__ __forceinline__ float gelu(float v) { return gelu_from_tail(v, normal_tail(v)); }

// d GELU / dv = Phi(v) + v phi(v), Phi from the same tail as the value.
__device__ __forceinline__ float gelu_slope_from_tail(float v, float tail) {
  const float cdf = 0.5f + copysignf(0.5f - tail, v);
  const float pdf = 0.39894228040143268f * exp2_approx(-0.72134752044448170f * v * v);  // exp(-v^2 / 2)
  return fmaf(v, pdf, cdf);
}

// For swiglu the caller passes the gate value; the up value multiplies afterwards.
__device__ __forceinline__ float activate(Activation kind, float v) {
  switch (kind) {
    case Activation::Relu: return fmaxf(v, 0.f);
    case Activation::Gelu: return gelu(v);
    default: return silu(v);  // Silu and the gate of Swiglu
  }
}

}  // namespace flashdmoe

namespace flashdmoe {

// d act / d v for the non-gated activations and the gate of swiglu (silu's slope), as the reference
// differentiates them: relu's slope is 0 at 0, gelu is the exact erf form (to fp32 rounding, above).
__device__ __forceinline__ float activation_slope(Activation kind, float v) {
  switch (kind) {
    case Activation::Relu: return v > 0.f ? 1.f : 0.f;
    case Activation::Gelu: return gelu_slope_from_tail(v, normal_tail(v));
    default: {
      const float sig = sigmoid(v);
      return sig * (1.f + v * (1.f - sig));
    }
  }
}

// The activation and its slope from one normal tail / one logistic (the backward's epilogue needs both): the
// same expressions as activate and activation_slope, so the same values.
struct ValueAndSlope {
  float value, slope;
};
__device__ __forceinline__ ValueAndSlope activation_value_and_slope(Activation kind, float v) {
  switch (kind) {
    case Activation::Relu: return {fmaxf(v, 0.f), v > 0.f ? 1.f : 0.f};
    case Activation::Gelu: {
      const float tail = normal_tail(v);
      return {gelu_from_tail(v, tail), gelu_slope_from_tail(v, tail)};
    }
    default: {
      const float sig = sigmoid(v);
      return {v * sig, sig * (1.f + v * (1.f - sig))};
    }
  }
}

}  // namespace flashdmoe
