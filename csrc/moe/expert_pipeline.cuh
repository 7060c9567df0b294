// Expert tasks for the TMA variant, with cross-tile prefetch: the producer warp takes tasks from the
// queue itself, waits for their inputs (a peer's rows, a GEMM1 row tile), and streams their K slabs
// through the stage ring without stopping at tile boundaries; it hands each task to the consumer
// warpgroups through a small ring of task slots (one mbarrier each). The consumers run wgmma and write
// results from registers through per-warp buffers (moe/epilogue.cuh), so the stages are never needed
// for the epilogue and the next tile's loads overlap this tile's epilogue.
// Cluster variants (kClusterBlocks = 2): the two blocks of a cluster run each task together, one row
// tile of the same expert each; each block's producer loads its own rows and half of the task's weight
// panels, multicast into both blocks' stages, so each weight slab is read from L2 once per pair (each SM
// still takes in all of it). The first block takes the tasks from the queue and hands each to the
// second block's producer too.
#pragma once
#include "common/cluster.cuh"
#include "moe/epilogue.cuh"
#include "moe/expert_ffn.cuh"
#include "moe/tile_gemm_tma.cuh"

namespace flashdmoe {

template <typename Variant>
__device__ __forceinline__ char* warp_staging(char* smem) {
  return smem + Variant::kWarpStagingOffset + (threadIdx.x >> 5) * kWarpStagingBytes;
}

// After a TMA tile's K loop (each consumer warpgroup on its own): the results out from registers, then
// what they complete. GEMM1: the row tile's count of finished column tiles, one arrival per warpgroup
// (GEMM2 tiles wait on all of them); GEMM2: the source's result rows, each warpgroup its own 64 (the
// source's results-done flag once all are in; nothing for this rank's own rows).
template <typename Element, typename Variant, typename Gemm>
__device__ __forceinline__ bool finish_tile_tma(const MoEParams& p, const DestTables& tables, const Gemm& gemm, char* smem,
                                                FfnGemm which, const RowTile& tile, int row_tile, int col_tile,
                                                uint32_t& met) {
  constexpr int kTileN = Variant::kTileN;
  if (which == FfnGemm::Gemm1) {
    const int out_col0 = col_tile * gemm1_output_columns<Variant>(p);
    if (tile.rows <= 16 && p.small_tile_epilogue) {
      if (!gemm1_epilogue_small<Element, kTileN, Variant::kSavePre>(p, gemm, smem + Variant::kWarpStagingOffset,
                                                                    tile.packed_row0, tile.rows, out_col0, met))
        return false;
    } else
      gemm1_epilogue_warp<Element, kTileN, Variant::kSavePre>(p, gemm, warp_staging<Variant>(smem), tile.packed_row0,
                                                              tile.rows, out_col0);
    tma::fence_proxy_async_global();  // GEMM2's TMA loads (async proxy) read these rows
    sync_warpgroup();
    if ((threadIdx.x & 127) == 0) {
      __threadfence();
      ptx::red_release_add_gpu(p.row_tile_done + row_tile, 1);
    }
  } else {
    const int col0 = col_tile * kTileN;
    gemm2_epilogue_warp<Element, kTileN>(gemm, warp_staging<Variant>(smem),
                                         comb_row<Element>(p, tile.src, tile.stream_row0), p.hidden, tile.rows, col0);
    const int rows = warpgroup_rows(tile.rows);
    if (tile.src != p.rank && rows > 0) {
      sync_warpgroup();
      if ((threadIdx.x & 127) == 0)
        account_results<Element, Variant>(p, tables, tile.src, rows, min(kTileN, p.hidden - col0));
    }
  }
  return true;
}

// K slabs of a task's GEMM (GEMM1 runs over H, GEMM2 over I).
__device__ __forceinline__ int task_k_tiles(const MoEParams& p, FfnGemm gemm) {
  return (gemm == FfnGemm::Gemm2 ? p.ffn : p.hidden) / static_cast<int>(kTmaSlabK);
}

// The TMA loads of one K slab of a task, one loader per operand. A: the kBoxRows-row boxes that hold
// the task's rows (a_boxes of them, from row a_row), or a full tile's as one 128-row box where the variant
// loads them so (loads_full_tile_box: the boxes land back to back in whole 1 KB swizzle atoms, so the
// shared-memory layout is the same).
template <int kBoxRows>
__device__ __forceinline__ void load_a_slab(uint32_t dst, const MoEParams& p, FfnGemm gemm, int a_row, int a_boxes,
                                            int k0, uint32_t bar) {
  if constexpr (loads_full_tile_box(kBoxRows)) {
    if (a_boxes * kBoxRows == kExpertTileM) {
      tma::load_2d(dst, gemm == FfnGemm::Gemm1 ? &p.maps.recv_full : &p.maps.intermediate_full, bar, k0, a_row);
      return;
    }
  }
  const CUtensorMap* rows = gemm == FfnGemm::Gemm1 ? &p.maps.recv : &p.maps.intermediate;
  for (int box = 0; box < a_boxes; ++box)
    tma::load_2d(dst + box * expert_row_box(kBoxRows).bytes(), rows, bar, k0, a_row + box * kBoxRows);
}
// B: the task's kPanels weight panels of its local expert, the first half from cols.lo, the second from cols.hi.
// In a two-block cluster, block `member` loads half `member` of them into both blocks.
template <int kPanels, int kCluster>
__device__ __forceinline__ void load_b_slab(uint32_t dst, const MoEParams& p, FfnGemm gemm, const WeightColumns& cols,
                                            int local, int k0, uint32_t bar, int member) {
  const CUtensorMap* weights = gemm == FfnGemm::Gemm1 ? &p.maps.w1 : &p.maps.w2;
  constexpr int kPanelColumns = static_cast<int>(kWeightPanelColumns);
  constexpr int kOwn = kPanels / kCluster;
#pragma unroll
  for (int own = 0; own < kOwn; ++own) {
    const int panel = member * kOwn + own;
    const int col = panel < kPanels / 2 ? cols.lo + panel * kPanelColumns : cols.hi + (panel - kPanels / 2) * kPanelColumns;
    if constexpr (kCluster == 1)
      tma::load_3d(dst + panel * kWeightPanelBox.bytes(), weights, bar, col, k0, local);
    else
      cluster::load_3d_multicast(dst + panel * kWeightPanelBox.bytes(), weights, bar, col, k0, local, 0b11);
  }
}

template <typename Element, typename Variant>
using ExpertTmaGemm = TmaTileGemm<Element, Variant::kTileN, Variant::kStages, Variant::kRowBoxRows, Major::K,
                                  Major::MN, Variant::kClusterBlocks>;

// This block's place in its cluster's tasks (0 without clusters).
template <typename Variant>
__device__ __forceinline__ int cluster_member() {
  if constexpr (Variant::kClusterBlocks == 1) return 0;
  else return static_cast<int>(cluster::block_rank());
}

// The barrier a cluster's blocks meet on before the expert phase (each arrives on the other's), so that
// neither loads into the other's stages before the other initialised their barriers. Initialised at the
// kernel's start (cluster_start), before any block of the cluster can arrive on it.
__device__ __forceinline__ uint64_t& cluster_hello() {
  __shared__ uint64_t hello;
  return hello;
}
// Every thread of a cluster variant's blocks, once at the kernel's start.
template <typename Variant>
__device__ __forceinline__ void cluster_start() {
  if constexpr (Variant::kClusterBlocks > 1) {
    if (threadIdx.x == 0) {
      tma::mbarrier_init(ptx::smem_addr(&cluster_hello()), 1);
      tma::fence_barrier_init();
    }
    cluster::sync();
  }
}
// Every thread, once at the kernel's end: no block leaves while the other may still write its shared
// memory (late stage releases).
template <typename Variant>
__device__ __forceinline__ void cluster_end() {
  if constexpr (Variant::kClusterBlocks > 1) cluster::sync();
}

// The producer warp's lane 0: takes tasks from the queue (in a cluster, the second block from the first
// block's hand-over), waits for their inputs, hands them to the consumers in order and streams their K
// slabs. A cluster's empty row tile (rows == 0) waits for nothing and loads no rows, only its half of
// the weights for the other block.
template <typename Element, typename Variant>
__device__ bool produce_tasks(const MoEParams& p, const DestTables& tables, char* smem,
                              typename ExpertTmaGemm<Element, Variant>::Pipeline& stages,
                              TaskRing<Variant::kStages>& ring, TaskRing<Variant::kStages>& handed,
                              const TaskCounts& counts) {
  using Gemm = ExpertTmaGemm<Element, Variant>;
  constexpr int kCluster = Variant::kClusterBlocks;
  const int member = cluster_member<Variant>();
  typename Gemm::State stage{};
  typename TaskRing<Variant::kStages>::State slot{};
  uint32_t ready_seen = 0;
  for (;; slot.advance()) {
    int task;
    if (member == 0) {
      task = static_cast<int>(atomicAdd(p.task_counter, 1u));
      if (task >= counts.total) task = kTaskEnd;
      if constexpr (kCluster == 2) handed.hand_over_remote(slot, task, 1);
    } else {
      task = handed.template take<true>(slot, p);
    }
    if (task < 0) {
      ring.hand_over(slot, task);
      return task == kTaskEnd;
    }
    const ExpertTask job = decode_task(p, tables, task, counts, member, kCluster);
    const RowTile tile = row_tile_of(p, tables, job.row_tile, job.local);
    const bool ready = tile.rows == 0 ||
        (job.gemm == FfnGemm::Gemm2
             ? wait_at_least(p.row_tile_done + job.row_tile, counts.tiles1 * kWorkerWarpgroups, p,
                             kPhaseIntermediate, p.rank)
             : wait_rows_ready(p, tile.src, ready_seen));
    tma::fence_proxy_async_global();
    ring.hand_over(slot, ready ? task : kTaskAbort);
    if (!ready) return false;
    const int k_tiles = task_k_tiles(p, job.gemm);
    const int a_row = a_first_row(p, tile, job.gemm);
    const int a_boxes = tile.rows == 0 ? 0 : expert_row_boxes(tile.rows, Variant::kRowBoxRows);
    const WeightColumns cols = weight_columns<Variant>(p, job.gemm, job.col_tile);
    auto load_slab = [&](uint32_t a_dst, uint32_t b_dst, int k0, uint32_t bar) {
      load_a_slab<Variant::kRowBoxRows>(a_dst, p, job.gemm, a_row, a_boxes, k0, bar);
      load_b_slab<Gemm::kPanels, kCluster>(b_dst, p, job.gemm, cols, tile.local, k0, bar, member);
    };
    // the error word stops the consumers
    if (!Gemm::produce(smem, stages, stage, k_tiles, Gemm::stage_tx_bytes(a_boxes), p, load_slab)) return false;
  }
}

// Consumer warpgroups (the workers): take the handed tasks in order, compute, write from registers. A
// cluster's empty row tile only paces the stage ring (and writes nothing). The two warpgroups do not
// wait for each other between tiles (only the small-tile epilogue, which spreads a tile over both, meets
// them, with the watchdog): one may be up to the ring's depth ahead of the other.
template <typename Element, typename Variant>
__device__ bool consume_tasks(const MoEParams& p, const DestTables& tables, char* smem,
                              typename ExpertTmaGemm<Element, Variant>::Pipeline& stages,
                              TaskRing<Variant::kStages>& ring, const TaskCounts& counts) {
  using Gemm = ExpertTmaGemm<Element, Variant>;
  const int member = cluster_member<Variant>();
  typename Gemm::State stage{};
  uint32_t met = 0;
  for (typename TaskRing<Variant::kStages>::State slot{};; slot.advance()) {
    const int task = ring.take(slot, p);
    if (task < 0) return task == kTaskEnd;
    const ExpertTask job = decode_task(p, tables, task, counts, member, Variant::kClusterBlocks);
    const RowTile tile = row_tile_of(p, tables, job.row_tile, job.local);
    const int k_tiles = task_k_tiles(p, job.gemm);
    Gemm gemm;
    const bool ok = gemm.consume(smem, stages, stage, k_tiles, p, warpgroup_has_rows(tile.rows));
    if (!sync_warpgroup_and(ok)) return false;
    if (tile.rows > 0 &&
        !finish_tile_tma<Element, Variant>(p, tables, gemm, smem, job.gemm, tile, job.row_tile, job.col_tile, met))
      return false;
  }
}

// Thread 0 of a cluster variant's block, its barriers initialised: tells the other block, and waits
// (bounded) until the other block did the same.
template <typename Variant>
__device__ __forceinline__ bool meet_cluster_peer(const MoEParams& p) {
  const uint32_t hello = ptx::smem_addr(&cluster_hello());
  cluster::arrive_remote_release(cluster::map_shared(hello, cluster::block_rank() ^ 1u));
  return wait_pipeline<true>(hello, 0, p);
}

template <typename Element, typename Variant>
__device__ bool run_expert_tasks_prefetch(const MoEParams& p, const DestTables& tables, char* smem) {
  __shared__ typename ExpertTmaGemm<Element, Variant>::Pipeline stages;
  __shared__ TaskRing<Variant::kStages> ring;
  __shared__ TaskRing<Variant::kStages> handed;  // cluster variants: the tasks the first block hands the second
  const TaskCounts counts = task_counts<Variant>(p, tables.tile_start[p.world_size * p.local_experts]);
  bool ok = true;
  if (threadIdx.x == 0) {
    ring.init();
    WorkerMeeting::init();
    if constexpr (Variant::kClusterBlocks > 1) handed.init();
    stages.init(kThreads / 32);  // released by every consumer warp (of both blocks in a cluster)
    if constexpr (Variant::kClusterBlocks > 1) ok = meet_cluster_peer<Variant>(p);
  }
  if (!__syncthreads_and(ok)) return false;
  if (threadIdx.x < kThreads)
    ok = consume_tasks<Element, Variant>(p, tables, smem, stages, ring, counts);
  else if (threadIdx.x == kThreads)
    ok = produce_tasks<Element, Variant>(p, tables, smem, stages, ring, handed, counts);
  return __syncthreads_and(ok);  // a uniform answer: the whole block leaves together
}

}  // namespace flashdmoe
