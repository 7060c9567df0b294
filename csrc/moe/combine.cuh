// Combine: y[t] = sum_j w[t,j] * expert_out[row(t,j)], summed in fp32 in choice order j = 0..k-1 (a
// gather, never floating-point atomics: the output is bitwise reproducible). Dropped choices add zero.
#pragma once
#include "moe/expert_ffn.cuh"

namespace flashdmoe {

template <typename Element>
__device__ void combine_tokens(const MoEParams& p) {
  const int H = p.hidden, k = p.top_k;
  const int lane = threadIdx.x & 31;
  const int warps_in_grid = gridDim.x * (kThreads / 32);
  const Element* expert_out = static_cast<const Element*>(p.expert_out);
  Element* y = static_cast<Element*>(p.y);
  for (int token = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5); token < p.tokens; token += warps_in_grid) {
    const size_t first = static_cast<size_t>(token) * k;
    for (int c = lane * 8; c < H; c += 32 * 8) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int j = 0; j < k; ++j) {
        const int row = __ldcg(p.topk_row + first + j);
        if (row < 0) continue;
        const float w = __ldcg(p.topk_weight + first + j);
        const int4 raw = __ldcg(reinterpret_cast<const int4*>(expert_out + static_cast<size_t>(row) * H + c));
        const Element* v = reinterpret_cast<const Element*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, static_cast<float>(v[i]), acc[i]);
      }
      Pack8<Element> pack;
#pragma unroll
      for (int i = 0; i < 8; ++i) pack.v[i] = static_cast<Element>(acc[i]);
      *reinterpret_cast<Pack8<Element>*>(y + static_cast<size_t>(token) * H + c) = pack;
    }
  }
}

}  // namespace flashdmoe
