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
// loop gives the same bits. No lane-divergent branch sits between a group's loads (with one, the compiler
// converted each choice's values before it issued the next choice's loads, one choice in flight): a
// dropped choice (row -1) loads row 0 and leaves the sum as it was, a column past H loads column 0 and is
// never stored; only the choices past k are skipped, warp-uniformly. `loads_issued()` runs once the
// first group's loads are issued, before anything waits for them.
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
    }
    Pack8<Element> raw[kGroup][kParts];
#pragma unroll
    for (int q = 0; q < kGroup; ++q) {
      if (j0 + q >= k) break;
      const Element* src = comb + static_cast<size_t>(max(row[q], 0)) * H;
#pragma unroll
      for (int u = 0; u < kParts; ++u) raw[q][u] = load_pack8_cg(src + (c[u] < H ? c[u] : 0));
    }
    if (j0 == 0) loads_issued();
#pragma unroll
    for (int q = 0; q < kGroup; ++q) {
      if (j0 + q >= k) break;
      const bool kept = row[q] >= 0;
#pragma unroll
      for (int u = 0; u < kParts; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float sum = fmaf(w[q], static_cast<float>(raw[q][u].v[i]), acc[u][i]);
          acc[u][i] = kept ? sum : acc[u][i];
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

// One item of the combine as lane j holds it: the token, the first column, and choice j's stream row to
// its owner (-1 if dropped), expert and combine weight.
struct CombineItem {
  int token, c0, row, expert;
  float weight;
};

// The rank's tokens over every warp of the rank, one warp per (token, chunk of columns). A warp's routing
// runs two items ahead: after this item's rows it loads the routing of the item after next, so an item
// waits for one round trip to memory, not two; and with kPrefetchNext, before this item's rows, it asks
// L2 for the next item's rows (whose routing came with the previous item's rows), so that they are on
// their way a whole item early (a hint: the same loads, the same bits; more bytes in flight without
// more registers).
template <typename Element, int kParts, int kGroup, bool kPrefetchNext>
__device__ __forceinline__ void combine_token_chunks(const MoEParams& p) {
  const int H = p.hidden, k = p.top_k;
  const int lane = threadIdx.x & 31;
  const int warps = p.blocks * (kThreads / 32);
  const Element* comb = static_cast<const Element*>(p.peers[p.rank].comb);
  Element* y = static_cast<Element*>(p.y);
  constexpr int kChunkColumns = kParts * 32 * 8;
  const int chunks = (H + kChunkColumns - 1) / kChunkColumns;
  // A warp's items are (token, chunk) pairs `warps` apart, stepped without a division (a 64-bit one is a
  // call, which waits for every load in flight).
  const int step_tokens = warps / chunks, step_chunks = warps % chunks;
  const int first = block_in_rank(p) * (kThreads / 32) + (threadIdx.x >> 5);
  int token = first / chunks, chunk = first % chunks;
  auto take_item = [&]() {  // the next of this warp's items; advances (token, chunk)
    CombineItem it{token, chunk * kChunkColumns, -1, 0, 0.f};
    const size_t at = static_cast<size_t>(token) * k;
    if (token < p.tokens && lane < k) {
      it.row = __ldcg(p.topk_row + at + lane);
      it.expert = __ldcg(p.topk_expert + at + lane);
      it.weight = __ldcg(p.topk_weight + at + lane);
    }
    chunk += step_chunks;
    token += step_tokens;
    if (chunk >= chunks) {
      chunk -= chunks;
      ++token;
    }
    return it;
  };
  // The choice's row in this rank's comb buffer: its owner's region.
  auto comb_row = [&](const CombineItem& it) {
    return it.row >= 0 ? it.row + (it.expert / p.local_experts) * p.stream_rows : -1;
  };
  CombineItem mine = take_item();
  CombineItem next = take_item();
  while (mine.token < p.tokens) {
    if (kPrefetchNext && next.token < p.tokens) {
      const int row = comb_row(next);
      if (row >= 0)
        tma::prefetch_l2(comb + static_cast<size_t>(row) * H + next.c0,
                         static_cast<uint32_t>(min(kChunkColumns, H - next.c0) * sizeof(Element)));
    }
    CombineItem later;
    combine_chunk<Element, kParts, kGroup>(p, comb, y, mine.token, mine.c0, comb_row(mine), mine.weight, [&] {
      asm volatile("" ::: "memory");  // issued after this item's rows: a wait for either then waits for both
      later = take_item();
    });
    mine = next;
    next = later;
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
  constexpr int kWideGroup = 2;                               // choices in flight per lane, large batches
  // The L2 prefetch of the next item's rows only where an item is one group (k <= kWideGroup): with k = 8 an item
  // already chains four groups of loads, and the prefetch's 8 rows per item made the phase slower
  // (0.146 -> 0.176 ms on 8192/2048/768/128/8, docs/perf-notes.md).
  if (wide_items < warps)
    combine_token_chunks<Element, 1, kSmallGroup, false>(p);
  else if (p.top_k <= kWideGroup)
    combine_token_chunks<Element, kParts, kWideGroup, true>(p);
  else
    combine_token_chunks<Element, kParts, kWideGroup, false>(p);
}

}  // namespace flashdmoe
