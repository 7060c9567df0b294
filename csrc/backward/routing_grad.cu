// The backward's routing side: the packed row table from the forward's routing, and the router's logit
// gradient through the top-k renormalisation and the softmax, each in one launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "backward/expert_grad.h"
#include "backward/vector.cuh"

namespace flashdmoe {
namespace {

constexpr int kRowThreads = 256;
constexpr int kTokensPerBlock = 8;  // router: one warp per token

__global__ void __launch_bounds__(kRowThreads)
    backward_rows_kernel(const int* __restrict__ expert, const int* __restrict__ row, const float* __restrict__ weight,
                         int64_t choices, int top_k, int experts, int64_t* __restrict__ token_of_row,
                         float* __restrict__ w_row, int* __restrict__ row_of_choice, int* __restrict__ expert_end) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x;
  if (c >= choices) return;
  const int r = row[c], e = expert[c];
  const bool kept = r >= 0 && r < choices && e >= 0 && e < experts;
  row_of_choice[c] = kept ? r : -1;
  if (!kept) return;
  token_of_row[r] = c / top_k;
  w_row[r] = weight[c];
  atomicMax(expert_end + e, r + 1);  // an integer maximum: the same result in any order
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

template <typename Element>
__global__ void __launch_bounds__(32 * kTokensPerBlock)
    router_grad_kernel(const float* __restrict__ logits, const int* __restrict__ expert,
                       const int* __restrict__ row_of_choice, const float* __restrict__ dweight_row,
                       Element* __restrict__ dlogits, int64_t tokens, int top_k, int experts, bool normalize_topk) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock + (threadIdx.x >> 5);
  if (token >= tokens) return;
  const int lane = threadIdx.x & 31;
  const float* l = logits + token * experts;
  float peak = -INFINITY;
  for (int e = lane; e < experts; e += 32) peak = fmaxf(peak, l[e]);
  peak = warp_max(peak);
  float total = 0.f;
  for (int e = lane; e < experts; e += 32) total += expf(l[e] - peak);
  total = warp_sum(total);
  const float inv_total = 1.f / total;
  // Lane j < k holds choice j: its expert, probability and the combine weight's gradient.
  int my_expert = -1;
  float my_p = 0.f, my_dweight = 0.f;
  if (lane < top_k) {
    const int64_t c = token * top_k + lane;
    my_expert = min(max(expert[c], 0), experts - 1);
    my_p = expf(l[my_expert] - peak) * inv_total;
    const int r = row_of_choice[c];
    my_dweight = r >= 0 ? dweight_row[r] : 0.f;
  }
  float my_dp = my_dweight;
  if (normalize_topk) {
    const float chosen = warp_sum(my_p);
    const float mean = warp_sum(my_dweight * (my_p / chosen));
    my_dp = (my_dweight - mean) / chosen;
  }
  const float shift = warp_sum(lane < top_k ? my_p * my_dp : 0.f);
  Element* out = dlogits + token * experts;
  for (int e0 = 0; e0 < experts; e0 += 32) {
    const int e = e0 + lane;
    float dp = 0.f;
    for (int j = 0; j < top_k; ++j) {  // a token's experts are distinct
      const int ej = __shfl_sync(0xffffffffu, my_expert, j);
      const float dpj = __shfl_sync(0xffffffffu, my_dp, j);
      if (ej == e) dp = dpj;
    }
    if (e < experts) {
      const float p = expf(l[e] - peak) * inv_total;
      out[e] = static_cast<Element>(p * (dp - shift));
    }
  }
}

}  // namespace

void launch_backward_rows(const int* expert, const int* row, const float* weight, int64_t choices, int top_k,
                          int experts, int64_t* token_of_row, float* w_row, int* row_of_choice, int* expert_end,
                          cudaStream_t stream) {
  if (top_k < 1 || experts < 1)
    throw std::invalid_argument("top_k and experts must be >= 1 (got " + std::to_string(top_k) + ", " +
                                std::to_string(experts) + ")");
  if (choices <= 0) return;
  const int64_t blocks = (choices + kRowThreads - 1) / kRowThreads;
  if (blocks > 0x7fffffff) throw std::invalid_argument("choices=" + std::to_string(choices) + " is too many");
  backward_rows_kernel<<<static_cast<int>(blocks), kRowThreads, 0, stream>>>(
      expert, row, weight, choices, top_k, experts, token_of_row, w_row, row_of_choice, expert_end);
  backward::check_launch("backward_rows launch");
}

void launch_router_grad(DType dtype, const float* logits, const int* expert, const int* row_of_choice,
                        const float* dweight_row, void* dlogits, int64_t tokens, int top_k, int experts,
                        bool normalize_topk, cudaStream_t stream) {
  if (top_k < 1 || top_k > 32 || top_k > experts)
    throw std::invalid_argument("top_k=" + std::to_string(top_k) + " must be in [1, min(32, E)]");
  if (tokens <= 0) return;
  const int64_t blocks = (tokens + kTokensPerBlock - 1) / kTokensPerBlock;
  if (blocks > 0x7fffffff) throw std::invalid_argument("tokens=" + std::to_string(tokens) + " is too many");
  backward::visit_half_dtype(dtype, [&](auto element) {
    using Element = decltype(element);
    router_grad_kernel<Element><<<static_cast<int>(blocks), 32 * kTokensPerBlock, 0, stream>>>(
        logits, expert, row_of_choice, dweight_row, static_cast<Element*>(dlogits), tokens, top_k, experts,
        normalize_topk);
  });
  backward::check_launch("router_grad launch");
}

}  // namespace flashdmoe
