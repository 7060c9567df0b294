// Expert tasks on clusters of two blocks (the -cluster2 variant). The cross-tile prefetch schedule
// (expert_pipeline.cuh), with tasks over *pairs* of row tiles: block c of a cluster computes row tile
// 2 * pair + c. When both tiles of a pair belong to one local expert they need the same weight panels,
// so each block's producer loads half of them and multicasts them into both blocks' stages: per block
// and K slab, 16 KB of weights leave L2 instead of 32 KB (plus its own 16 KB of rows). Pairs that
// straddle two experts load everything per block, as the unpaired schedule does.
//
// Lockstep: both blocks run the same tasks (block 0's producer takes them from the queue and writes each
// into both blocks' task rings), the same K slabs, through stage rings whose "empty" barriers count the
// consumer warps of both blocks, since either producer may write into the other's stages.
#pragma once
#include "common/cluster.cuh"
#include "moe/expert_pipeline.cuh"

namespace flashdmoe {

constexpr uint16_t kBothCtas = 0b11;

// This block's share of a pair task.
struct PairShare {
  int row_tile;  // -1: the pair's second tile does not exist (odd number of row tiles)
  RowTile tile;
  bool multicast;  // both tiles exist and belong to one local expert
};

__device__ __forceinline__ PairShare pair_share(const MoEParams& p, const DestTables& t, int pair, int row_tiles,
                                                uint32_t cta) {
  PairShare share{};
  share.row_tile = 2 * pair + static_cast<int>(cta) < row_tiles ? 2 * pair + static_cast<int>(cta) : -1;
  share.multicast = false;
  if (share.row_tile < 0) return share;
  share.tile = row_tile_of(p, t, share.row_tile);
  const int other = 2 * pair + static_cast<int>(cta ^ 1u);
  share.multicast = other < row_tiles && row_tile_of(p, t, other).local == share.tile.local;
  return share;
}

// Lane 0 of the producer warp. Block 0 takes the tasks and hands them to both blocks' rings; each block
// waits for its own tile's inputs and streams its slabs.
template <typename Element, typename Variant>
__device__ bool produce_pair_tasks(const MoEParams& p, const DestTables& t, char* smem,
                                   TmaPipelineBarriers<Variant::kStages>& bars, TaskRing<Variant::kStages>& ring,
                                   const TaskCounts& c, int row_tiles, uint32_t cta) {
  using Gemm = TmaTileGemm<Element, Variant::kTileN, Variant::kStages>;
  using Ring = TaskRing<Variant::kStages>;
  constexpr int kTileN = Variant::kTileN;
  const bool swiglu = p.activation == Activation::Swiglu;
  const int out_cols1 = swiglu ? kTileN / 2 : kTileN;
  const uint32_t peer = cta ^ 1u, base = ptx::smem_addr(smem);
  uint32_t slab = 0, ready_seen = 0;
  for (int n = 0;; ++n) {
    const int slot = n % Ring::kSlots;
    const uint32_t slot_full = ptx::smem_addr(&ring.full[slot]);
    int task;
    if (cta == 0) {
      const int fetched = static_cast<int>(atomicAdd(p.task_counter, 1u));
      task = fetched < c.total ? fetched : kTaskEnd;
      ring.task[slot] = task;
      cluster::store_u32(cluster::map_shared(ptx::smem_addr(&ring.task[slot]), peer), static_cast<uint32_t>(task));
      tma::arrive(slot_full);
      cluster::arrive(cluster::map_shared(slot_full, peer));
    } else {
      if (!wait_pipeline(slot_full, (n / Ring::kSlots) & 1, p, /*cluster_scope=*/true)) return false;
      task = ring.task[slot];
    }
    if (task < 0) return true;
    const ExpertTask job = decode_task(task, c.tasks1, c.tiles1, c.tiles2);  // row_tile = the pair
    const PairShare share = pair_share(p, t, job.row_tile, row_tiles, cta);
    const RowTile& tile = share.tile;
    const int k_tiles = task_k_tiles(p, job.second);
    const bool mine = share.row_tile >= 0;
    if (mine) {
      const bool ready = job.second
          ? wait_at_least(p.row_tile_done + share.row_tile, c.tiles1, p, kPhaseIntermediate, p.rank)
          : wait_rows_ready(p, tile.src, ready_seen);
      if (!ready) return false;  // the error word stops every wait of both blocks
      tma::fence_proxy_async_global();
    }
    // Weight panel `panel` of this task: column and tensor map.
    const int col_lo = job.second ? job.col_tile * kTileN : job.col_tile * out_cols1;
    const int col_hi = job.second ? col_lo + kTileN / 2 : (swiglu ? p.ffn + col_lo : col_lo + kTileN / 2);
    const CUtensorMap* weights = job.second ? &p.maps.w2 : &p.maps.w1;
    const int a_row = job.second ? tile.packed_row0 : tile.src * p.stream_rows + tile.stream_row0;
    const CUtensorMap* rows_map = job.second ? &p.maps.intermediate : &p.maps.recv;
    constexpr int kHalf = Gemm::kPanels / 2;
    for (int kt = 0; kt < k_tiles; ++kt) {
      const uint32_t it = slab + kt, s = it % Variant::kStages, use = it / Variant::kStages;
      if (use > 0 && !wait_pipeline(ptx::smem_addr(&bars.empty[s]), (use - 1) & 1, p)) return false;
      const uint32_t full = ptx::smem_addr(&bars.full[s]);
      tma::arrive_expect_tx(full, mine ? Gemm::kStageBytesA + Gemm::kStageBytesB : 0);
      if (!mine) continue;
      const int k0 = kt * 64;
      const uint32_t b_dst = Gemm::b_stage(base, s);
      tma::load_2d(Gemm::a_stage(base, s), rows_map, full, k0, a_row);
      if (share.multicast) {
        // Block c loads panels [c * kHalf, (c + 1) * kHalf): the gate (c = 0) or up (c = 1) half for swiglu.
#pragma unroll
        for (int h = 0; h < kHalf; ++h) {
          const int panel = static_cast<int>(cta) * kHalf + h;
          const int col = (panel < kHalf ? col_lo : col_hi) + h * 64;
          tma::load_3d_multicast(b_dst + panel * Gemm::kPanelBytes, weights, full, col, k0, tile.local, kBothCtas);
        }
      } else {
#pragma unroll
        for (int panel = 0; panel < Gemm::kPanels; ++panel) {
          const int col = (panel < kHalf ? col_lo + panel * 64 : col_hi + (panel - kHalf) * 64);
          tma::load_3d(b_dst + panel * Gemm::kPanelBytes, weights, full, col, k0, tile.local);
        }
      }
    }
    slab += k_tiles;
  }
}

// The workers: the tasks in ring order; a block whose tile of the pair does not exist only paces the
// stages (its releases still count in both blocks).
template <typename Element, typename Variant>
__device__ bool consume_pair_tasks(const MoEParams& p, const DestTables& t, char* smem,
                                   TmaPipelineBarriers<Variant::kStages>& bars, TaskRing<Variant::kStages>& ring,
                                   const TaskCounts& c, int row_tiles, uint32_t cta) {
  using Gemm = TmaTileGemm<Element, Variant::kTileN, Variant::kStages>;
  uint32_t slab = 0;
  for (int n = 0;; ++n) {
    const int task = take_task(ring, n, p, /*cluster_scope=*/true);
    if (task < 0) return task == kTaskEnd;
    const ExpertTask job = decode_task(task, c.tasks1, c.tiles1, c.tiles2);
    const PairShare share = pair_share(p, t, job.row_tile, row_tiles, cta);
    const int rows = share.row_tile >= 0 ? share.tile.rows : 0;
    const int k_tiles = task_k_tiles(p, job.second);
    Gemm gemm;
    const bool ok = gemm.consume(smem, bars, slab, k_tiles, p, warpgroup_has_rows(rows), false, static_cast<int>(cta ^ 1u));
    slab += k_tiles;
    if (!sync_workers_and(ok)) return false;
    if (rows == 0) continue;
    const RowTile& tile = share.tile;
    finish_tile_tma<Element, Variant>(p, t, gemm, smem, job.second, tile, share.row_tile, job.col_tile);
  }
}

template <typename Element, typename Variant>
__device__ bool run_expert_pair_tasks(const MoEParams& p, const DestTables& t, char* smem) {
  using Gemm = TmaTileGemm<Element, Variant::kTileN, Variant::kStages>;
  using Ring = TaskRing<Variant::kStages>;
  __shared__ TmaPipelineBarriers<Variant::kStages> bars;
  __shared__ Ring ring;
  const uint32_t cta = cluster::cta_rank();
  const int row_tiles = t.tile_start[p.world_size * p.local_experts];
  const TaskCounts c = task_counts<Variant>(p, (row_tiles + 1) / 2);  // tasks over pairs of row tiles
  if (threadIdx.x == 0) init_task_pipeline<Gemm>(bars, ring, /*consumer_ctas=*/2);
  cluster::sync();  // both blocks' barriers exist before either arrives on the other's
  bool ok = true;
  if (threadIdx.x < kThreads)
    ok = consume_pair_tasks<Element, Variant>(p, t, smem, bars, ring, c, row_tiles, cta);
  else if (threadIdx.x == kThreads)
    ok = produce_pair_tasks<Element, Variant>(p, t, smem, bars, ring, c, row_tiles, cta);
  ok = __syncthreads_and(ok);
  cluster::sync();  // neither block leaves while the other may still write into its stages or barriers
  return ok;
}

}  // namespace flashdmoe
