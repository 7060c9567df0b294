// The router's logit gradient of one token, shared by routing_grad.cu's router_grad kernel (logits in
// global memory) and router_backward.cu (logits of a token tile in shared memory).
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace flashdmoe::backward {

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

// One warp, one token: p = softmax(l) over `experts` float32 logits; the token's choice j < top_k has
// expert experts_of[j] and combine-weight gradient dweight_row[rows_of[j]] (0 when the row is -1, or not
// below `rows`, dweight_row's length where the caller knows it: a failed launch's table is then only ever
// read in bounds); with
// normalize_topk the weights were p_j / S (S the sum of the chosen p), so dp_j = (dweight_j - sum_i
// dweight_i p_i / S) / S, else dp_j = dweight_j. write(e, p_e * (dP_e - sum_j p_j dp_j)) for every
// e < experts, dP the dp scattered to the chosen experts (a token's experts are distinct).
template <typename Write>
__device__ __forceinline__ void token_logit_grad(const float* l, int experts, int top_k, const int* experts_of,
                                                 const int* rows_of, const float* dweight_row, int64_t rows,
                                                 bool normalize_topk, Write&& write) {
  const int lane = threadIdx.x & 31;
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
    my_expert = min(max(experts_of[lane], 0), experts - 1);
    my_p = expf(l[my_expert] - peak) * inv_total;
    const int r = rows_of[lane];
    my_dweight = r >= 0 && r < rows ? dweight_row[r] : 0.f;
  }
  float my_dp = my_dweight;
  if (normalize_topk) {
    const float chosen = warp_sum(my_p);
    const float mean = warp_sum(my_dweight * (my_p / chosen));
    my_dp = (my_dweight - mean) / chosen;
  }
  const float shift = warp_sum(lane < top_k ? my_p * my_dp : 0.f);
  for (int e0 = 0; e0 < experts; e0 += 32) {
    const int e = e0 + lane;
    float dp = 0.f;
    for (int j = 0; j < top_k; ++j) {
      const int ej = __shfl_sync(0xffffffffu, my_expert, j);
      const float dpj = __shfl_sync(0xffffffffu, my_dp, j);
      if (ej == e) dp = dpj;
    }
    if (e < experts) {
      const float p = expf(l[e] - peak) * inv_total;
      write(e, p * (dp - shift));
    }
  }
}

}  // namespace flashdmoe::backward
