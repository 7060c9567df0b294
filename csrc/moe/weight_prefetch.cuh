// Small batches: GEMM1's first weight slabs asked of L2 while the offsets and the dispatch run.
// A decode forward's expert phase streams the hit experts' weights from HBM, and between the gate and
// the expert phase (offsets, dispatch, two grid barriers) HBM idles. Once the gate is done the routing
// is known, so the producer warps, idle in those phases, ask L2 for the first K slabs of every GEMM1
// task's weight panels (kt-major: slab 0 of every task, then slab 1, ...; up to a byte budget), and the
// tasks' first TMA loads then hit L2. Hints only: nothing waits for them and the results' bits do not
// depend on them. One rank only (a team's owner also takes its peers' rows, whose counts are not known
// here).
#pragma once
#include "common/tma.cuh"
#include "moe/expert_pipeline.cuh"

namespace flashdmoe {

// The calling warp (all 32 lanes) issues its block's share of the prefetches.
template <typename Element, typename Variant>
__device__ void prefetch_gemm1_weights(const MoEParams& p) {
  if (p.l2_prefetch_bytes == 0 || p.world_size != 1) return;
  const int lane = threadIdx.x & 31;
  const int E = p.experts;
  // Lane l's bit i: expert 32 i + l has rows (E <= 1024).
  uint32_t mine = 0;
  for (int i = 0; 32 * i + lane < E; ++i) {
    int count = 0;
    for (int tile = 0; tile < p.gate_tiles; ++tile) count += __ldcg(p.tile_expert_count + tile * E + 32 * i + lane);
    if (count > 0) mine |= 1u << i;
  }
  // Lane i: the hit mask of experts [32 i, 32 i + 32) and the hits before them.
  const int chunks = (E + 31) / 32;
  uint32_t chunk_mask = 0;
  for (int i = 0; i < chunks; ++i) {
    const uint32_t m = __ballot_sync(0xffffffffu, (mine >> i) & 1u);
    if (lane == i) chunk_mask = m;
  }
  const int chunk_hits = __popc(chunk_mask);
  int before = chunk_hits;  // inclusive scan, then exclusive
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, before, offset);
    if (lane >= offset) before += v;
  }
  const int hits = __shfl_sync(0xffffffffu, before, 31);
  before -= chunk_hits;
  if (hits == 0) return;

  using Gemm = TmaTileGemm<Element, Variant::kTileN, Variant::kStages, Variant::kRowBoxRows>;
  constexpr int kPanels = Gemm::kPanels;
  constexpr int kPanelColumns = static_cast<int>(kWeightPanelColumns);
  const int col_tiles = gemm1_column_tiles<Variant>(p);
  const int slabs = task_k_tiles(p, FfnGemm::Gemm1);
  const long long per_slab = static_cast<long long>(hits) * col_tiles;  // units of one K slab
  const long long units = min(per_slab * slabs, static_cast<long long>(p.l2_prefetch_bytes) / Gemm::kStageBytesB);
  // Every lane runs every round (the shuffles need the whole warp); a lane past the units issues nothing.
  for (long long first = block_in_rank(p); first < units; first += 32LL * p.blocks) {
    const long long u = first + static_cast<long long>(lane) * p.blocks;
    const long long v = u < units ? u : first;
    const int kt = static_cast<int>(v / per_slab);
    const int rest = static_cast<int>(v % per_slab);
    const int hit = rest / col_tiles, col_tile = rest % col_tiles;
    // The expert of the hit-th hit: its chunk (the last whose hits before it are <= hit and that has
    // hits), then its bit in the chunk.
    int chunk = 0;
    for (int i = 0; i < chunks; ++i) {
      const int b = __shfl_sync(0xffffffffu, before, i);
      const uint32_t m = __shfl_sync(0xffffffffu, chunk_mask, i);
      if (m != 0 && b <= hit) chunk = i;
    }
    const uint32_t mask = __shfl_sync(0xffffffffu, chunk_mask, chunk);
    const int nth = hit - __shfl_sync(0xffffffffu, before, chunk);
    if (u >= units) continue;
    uint32_t m = mask;
    for (int j = 0; j < nth; ++j) m &= m - 1;
    const int expert = 32 * chunk + (__ffs(m) - 1);
    const WeightColumns cols = weight_columns<Variant>(p, FfnGemm::Gemm1, col_tile);
#pragma unroll
    for (int panel = 0; panel < kPanels; ++panel) {
      const int col = panel < kPanels / 2 ? cols.lo + panel * kPanelColumns : cols.hi + (panel - kPanels / 2) * kPanelColumns;
      tma::prefetch_l2_3d(&p.maps.w1, col, kt * static_cast<int>(kTmaSlabK), expert);
    }
  }
}

}  // namespace flashdmoe
