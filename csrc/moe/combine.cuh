// Combine: y[t] = sum_j w[t,j] * result(t,j), summed in fp32 in choice order j = 0..k-1 (a gather,
// never floating-point atomics: the output is bitwise reproducible). result(t,j) is row(t,j) of this
// rank's comb buffer, region [owner of the chosen expert]. Dropped choices add zero.
#pragma once
#include "moe/expert_ffn.cuh"

namespace flashdmoe {

// Bounded wait for every peer's results-done flag. The worker threads call it.
__device__ inline bool wait_for_results(const MoEParams& p) {
  bool ok = true;
  if (threadIdx.x < p.world_size && static_cast<int>(threadIdx.x) != p.rank) {
    const uint32_t* flag = p.peers[p.rank].signals + signal_results_done(p.world_size, p.local_experts, threadIdx.x);
    ok = wait_at_least<Scope::System>(flag, forward_sequence(p), p, kPhasePeerResults, threadIdx.x);
  }
  return sync_workers_and(ok);
}

template <typename Element>
__device__ void combine_tokens(const MoEParams& p) {
  const int H = p.hidden, k = p.top_k;
  const int lane = threadIdx.x & 31;
  const int warps = p.blocks * (kThreads / 32);
  const Element* comb = static_cast<const Element*>(p.peers[p.rank].comb);
  Element* y = static_cast<Element*>(p.y);
  // One warp per (token, chunk of kParts x 256 columns): small batches still spread over every warp of
  // the rank, and each lane keeps 64 bytes of each of two choices in flight (the combine is bound by
  // the bytes in flight per SM).
  constexpr int kParts = 8 / static_cast<int>(sizeof(Element));  // 4 for 16-bit inputs, 2 for fp32
  constexpr int kChunkColumns = kParts * 32 * 8;
  const int chunks = (H + kChunkColumns - 1) / kChunkColumns;
  const long long items = static_cast<long long>(p.tokens) * chunks;
  for (long long item = block_in_rank(p) * (kThreads / 32) + (threadIdx.x >> 5); item < items; item += warps) {
    const int token = static_cast<int>(item / chunks);
    const int c0 = static_cast<int>(item % chunks) * kChunkColumns;
    const size_t first = static_cast<size_t>(token) * k;
    // Lane j holds choice j's row and weight (k <= 32); the loop broadcasts them.
    int my_row = lane < k ? __ldcg(p.topk_row + first + lane) : -1;
    if (my_row >= 0) my_row += (__ldcg(p.topk_expert + first + lane) / p.local_experts) * p.stream_rows;
    const float my_weight = lane < k ? __ldcg(p.topk_weight + first + lane) : 0.f;
    {
      int c[kParts];
#pragma unroll
      for (int u = 0; u < kParts; ++u) c[u] = c0 + u * 32 * 8 + lane * 8;
      float acc[kParts][8];
#pragma unroll
      for (int u = 0; u < kParts; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
      // Two choices per step: both rows' loads are in flight before either is summed (still in
      // choice order, so the sum is the same as one choice at a time).
      for (int j = 0; j < k; j += 2) {
        const bool pair = j + 1 < k;
        const int row[2] = {__shfl_sync(0xffffffffu, my_row, j), __shfl_sync(0xffffffffu, my_row, pair ? j + 1 : j)};
        const float w[2] = {__shfl_sync(0xffffffffu, my_weight, j), __shfl_sync(0xffffffffu, my_weight, pair ? j + 1 : j)};
        const bool use[2] = {row[0] >= 0, pair && row[1] >= 0};
        Pack8<Element> raw[2][kParts];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          if (!use[q]) continue;
          const Element* src = comb + static_cast<size_t>(row[q]) * H;
#pragma unroll
          for (int u = 0; u < kParts; ++u)
            if (c[u] < H) raw[q][u] = load_pack8_cg(src + c[u]);
        }
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          if (!use[q]) continue;
#pragma unroll
          for (int u = 0; u < kParts; ++u) {
            if (c[u] >= H) continue;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[u][i] = fmaf(w[q], static_cast<float>(raw[q][u].v[i]), acc[u][i]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kParts; ++u) {
        if (c[u] >= H) continue;
        Pack8<Element> pack;
#pragma unroll
        for (int i = 0; i < 8; ++i) pack.v[i] = static_cast<Element>(acc[u][i]);
        *reinterpret_cast<Pack8<Element>*>(y + static_cast<size_t>(token) * H + c[u]) = pack;
      }
    }
  }
}

}  // namespace flashdmoe
