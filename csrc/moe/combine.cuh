// Combine: y[t] = sum_j w[t,j] * result(t,j), summed in fp32 in choice order j = 0..k-1 (a gather,
// never floating-point atomics: the output is bitwise reproducible). result(t,j) is row(t,j) of this
// rank's comb buffer, region [owner of the chosen expert]. Dropped choices add zero.
#pragma once
#include "common/tma.cuh"
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

// One warp's share of a token's combine: columns c0 + u * 256 + lane * 8 (u < kParts) of y[token], from
// the token's k choices (lane j holds choice j's row and weight, k <= 32), kGroup choices' loads in flight
// before any is summed. The sum is in choice order whatever kParts and kGroup are, so every shape of the
// loop gives the same bits. `loads_issued()` runs once the first group's loads are in flight.
template <typename Element, int kParts, int kGroup, typename Hook>
__device__ __forceinline__ void combine_chunk(const MoEParams& p, const Element* comb, Element* y, int token, int c0,
                                              int my_row, float my_weight, Hook&& loads_issued) {
  const int H = p.hidden, k = p.top_k, lane = threadIdx.x & 31;
  int c[kParts];
#pragma unroll
  for (int u = 0; u < kParts; ++u) c[u] = c0 + u * 32 * 8 + lane * 8;
  float acc[kParts][8];
#pragma unroll
  for (int u = 0; u < kParts; ++u)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
  for (int j0 = 0; j0 < k; j0 += kGroup) {
    int row[kGroup];
    float w[kGroup];
#pragma unroll
    for (int q = 0; q < kGroup; ++q) {
      const int j = min(j0 + q, k - 1);
      row[q] = __shfl_sync(0xffffffffu, my_row, j);
      w[q] = __shfl_sync(0xffffffffu, my_weight, j);
      if (j0 + q >= k) row[q] = -1;
    }
    Pack8<Element> raw[kGroup][kParts];
#pragma unroll
    for (int q = 0; q < kGroup; ++q) {
      if (row[q] < 0) continue;
      const Element* src = comb + static_cast<size_t>(row[q]) * H;
#pragma unroll
      for (int u = 0; u < kParts; ++u)
        if (c[u] < H) raw[q][u] = load_pack8_cg(src + c[u]);
    }
    if (j0 == 0) loads_issued();
#pragma unroll
    for (int q = 0; q < kGroup; ++q) {
      if (row[q] < 0) continue;
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

// The rank's tokens over every warp of the rank, one warp per (token, chunk of columns). A warp's next
// item's routing is loaded while this item's rows are, so an item costs one round trip to memory, not
// two; with kPrefetchNext its rows are also asked of L2 then (a hint: the same loads, the same bits), which
// doubles the bytes the warp has in flight without holding more registers.
template <typename Element, int kParts, int kGroup, bool kPrefetchNext>
__device__ __forceinline__ void combine_token_chunks(const MoEParams& p) {
  const int H = p.hidden, k = p.top_k;
  const int lane = threadIdx.x & 31;
  const int warps = p.blocks * (kThreads / 32);
  const Element* comb = static_cast<const Element*>(p.peers[p.rank].comb);
  Element* y = static_cast<Element*>(p.y);
  constexpr int kChunkColumns = kParts * 32 * 8;
  const int chunks = (H + kChunkColumns - 1) / kChunkColumns;
  const long long items = static_cast<long long>(p.tokens) * chunks;
  // Lane j: choice j's row in this rank's comb buffer (its owner's region) and its weight; -1 if dropped.
  auto routing_of = [&](long long item, int& row, float& weight) {
    const size_t first = static_cast<size_t>(item / chunks) * k;
    row = lane < k ? __ldcg(p.topk_row + first + lane) : -1;
    const int expert = lane < k ? __ldcg(p.topk_expert + first + lane) : 0;
    weight = lane < k ? __ldcg(p.topk_weight + first + lane) : 0.f;
    if (row >= 0) row += (expert / p.local_experts) * p.stream_rows;
  };
  long long item = block_in_rank(p) * (kThreads / 32) + (threadIdx.x >> 5);
  int my_row = -1;
  float my_weight = 0.f;
  if (item < items) routing_of(item, my_row, my_weight);
  for (; item < items; item += warps) {
    const long long next = item + warps;
    int next_row = -1;
    float next_weight = 0.f;
    if (next < items) routing_of(next, next_row, next_weight);
    const int c0 = static_cast<int>(item % chunks) * kChunkColumns;
    combine_chunk<Element, kParts, kGroup>(p, comb, y, static_cast<int>(item / chunks), c0, my_row, my_weight, [&] {
      if (kPrefetchNext && next_row >= 0) {
        const int next_c0 = static_cast<int>(next % chunks) * kChunkColumns;
        tma::prefetch_l2(comb + static_cast<size_t>(next_row) * H + next_c0,
                         static_cast<uint32_t>(min(kChunkColumns, H - next_c0) * sizeof(Element)));
      }
    });
    my_row = next_row;
    my_weight = next_weight;
  }
}

// Large batches: each lane keeps 64 bytes of each of two choices in flight (the combine is bound by the
// bytes in flight per SM). Small batches, whose few (token, chunk) items would leave most warps idle and
// each chain k / 2 round trips to L2 (decode: ~4 µs of a one-token forward), take 256 columns per warp
// and all of a token's choices at once (up to 8; 4 in float32).
template <typename Element>
__device__ void combine_tokens(const MoEParams& p) {
  constexpr int kParts = 8 / static_cast<int>(sizeof(Element));  // 4 for 16-bit inputs, 2 for fp32
  const int warps = p.blocks * (kThreads / 32);
  const long long wide_items = static_cast<long long>(p.tokens) * ((p.hidden + kParts * 256 - 1) / (kParts * 256));
  constexpr int kSmallGroup = sizeof(Element) == 4 ? 4 : 8;  // 16 or 32 bytes per choice in flight per lane
  if (wide_items < warps)
    combine_token_chunks<Element, 1, kSmallGroup, false>(p);
  else
    combine_token_chunks<Element, kParts, 2, true>(p);
}

}  // namespace flashdmoe
