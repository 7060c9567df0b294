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
    ok = wait_at_least<Scope::System>(flag, p.sequence, p, kPhasePeerResults, threadIdx.x);
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
  // the rank, and each lane keeps kParts independent 16-byte loads per choice in flight (the combine is
  // bound by the bytes in flight per SM).
  constexpr int kParts = 4;
  constexpr int kChunkColumns = kParts * 32 * 8;
  const int chunks = (H + kChunkColumns - 1) / kChunkColumns;
  const long long items = static_cast<long long>(p.tokens) * chunks;
  for (long long item = block_in_rank(p) * (kThreads / 32) + (threadIdx.x >> 5); item < items; item += warps) {
    const int token = static_cast<int>(item / chunks);
    const int c0 = static_cast<int>(item % chunks) * kChunkColumns;
    const size_t first = static_cast<size_t>(token) * k;
    // Lane j holds choice j's row and weight (k <= 32); the loop broadcasts them, so each chunk's k
    // loads are independent and in flight together.
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
      for (int j = 0; j < k; ++j) {
        const int row = __shfl_sync(0xffffffffu, my_row, j);
        const float w = __shfl_sync(0xffffffffu, my_weight, j);
        if (row < 0) continue;
        const Element* src = comb + static_cast<size_t>(row) * H;
        int4 raw[kParts];
#pragma unroll
        for (int u = 0; u < kParts; ++u)
          if (c[u] < H) raw[u] = __ldcg(reinterpret_cast<const int4*>(src + c[u]));
#pragma unroll
        for (int u = 0; u < kParts; ++u) {
          if (c[u] >= H) continue;
          const Element* v = reinterpret_cast<const Element*>(&raw[u]);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[u][i] = fmaf(w, static_cast<float>(v[i]), acc[u][i]);
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
