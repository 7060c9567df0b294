// dx of the expert path: each token's kept rows of dx summed in choice order, plus the router's term.
#include "backward/expert_grad.h"
#include "backward/vector.cuh"

namespace flashdmoe {
namespace {

using backward::Vec8;

constexpr int kCombineThreads = 256;

// One block per token; each thread owns 8 consecutive columns per step.
template <typename Element>
__global__ void __launch_bounds__(kCombineThreads)
    combine_grad_kernel(const Element* __restrict__ dx_rows, const int* __restrict__ row,
                        const float* __restrict__ extra, Element* __restrict__ dx, int top_k, int hidden) {
  const int64_t token = blockIdx.x;
  const int* choices = row + token * top_k;
  for (int col = threadIdx.x * 8; col < hidden; col += kCombineThreads * 8) {
    float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < top_k; ++j) {
      const int r = choices[j];
      if (r < 0) continue;  // dropped by capacity: no expert term
      float v[8];
      Vec8<Element>::load(dx_rows + static_cast<int64_t>(r) * hidden + col).to_float(v);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum[i] += v[i];
    }
    if (extra != nullptr) {
      const float4* e = reinterpret_cast<const float4*>(extra + token * hidden + col);
      const float4 a = e[0], b = e[1];
      sum[0] += a.x, sum[1] += a.y, sum[2] += a.z, sum[3] += a.w;
      sum[4] += b.x, sum[5] += b.y, sum[6] += b.z, sum[7] += b.w;
    }
    Vec8<Element>::from_float(sum).store(dx + token * hidden + col);
  }
}

}  // namespace

void launch_combine_grad(DType dtype, const void* dx_rows, const int* row, const float* extra, void* dx, int64_t tokens,
                         int top_k, int hidden, cudaStream_t stream) {
  if (hidden <= 0 || hidden % 8 != 0)
    throw std::invalid_argument("hidden H=" + std::to_string(hidden) + " must be a positive multiple of 8");
  if (top_k < 1) throw std::invalid_argument("top_k=" + std::to_string(top_k) + " must be >= 1");
  if (tokens <= 0) return;
  if (tokens > 0x7fffffff) throw std::invalid_argument("tokens=" + std::to_string(tokens) + " is too many for one launch");
  backward::visit_half_dtype(dtype, [&](auto element) {
    using Element = decltype(element);
    combine_grad_kernel<Element><<<static_cast<int>(tokens), kCombineThreads, 0, stream>>>(
        static_cast<const Element*>(dx_rows), row, extra, static_cast<Element*>(dx), top_k, hidden);
  });
  backward::check_launch("combine_grad launch");
}

}  // namespace flashdmoe
