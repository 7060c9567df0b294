// The backward's routing side: the packed row table from the forward's routing, and the router's logit
// gradient through the top-k renormalisation and the softmax, each in one launch.
#include <climits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include "backward/expert_grad.h"
#include "backward/router_math.cuh"
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

template <typename Element>
__global__ void __launch_bounds__(32 * kTokensPerBlock)
    router_grad_kernel(const float* __restrict__ logits, const int* __restrict__ expert,
                       const int* __restrict__ row_of_choice, const float* __restrict__ dweight_row,
                       Element* __restrict__ dlogits, int64_t tokens, int top_k, int experts, bool normalize_topk) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock + (threadIdx.x >> 5);
  if (token >= tokens) return;
  Element* out = dlogits + token * experts;
  backward::token_logit_grad(logits + token * experts, experts, top_k, expert + token * top_k,
                             row_of_choice + token * top_k, dweight_row, INT64_MAX, normalize_topk,
                             [&](int e, float v) { out[e] = static_cast<Element>(v); });
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
