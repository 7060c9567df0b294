// Expert tasks for the TMA variant, with cross-tile prefetch: the producer warp takes tasks from the
// queue itself, waits for their inputs (a peer's rows, a GEMM1 row tile), and streams their K slabs
// through the stage ring without stopping at tile boundaries; it hands each task to the consumer
// warpgroups through a small ring of task slots (one mbarrier each). The consumers run wgmma and write
// results from registers through per-warp buffers (moe/epilogue.cuh), so the stages are never needed
// for the epilogue and the next tile's loads overlap this tile's epilogue.
#pragma once
#include "moe/epilogue.cuh"
#include "moe/expert_ffn.cuh"
#include "moe/tile_gemm_tma.cuh"

namespace flashdmoe {

// Whether the calling worker's warpgroup (64 tile rows) holds any of the tile's rows: tiles of at most
// 64 rows (an expert's last, partial tile) run on one warpgroup at the tensor cores' full rate.
__device__ __forceinline__ bool warpgroup_has_rows(int rows) { return (threadIdx.x >> 7) * 64 < rows; }

template <typename Variant>
__device__ __forceinline__ char* warp_staging(char* smem) {
  return smem + Variant::kWarpStagingOffset + (threadIdx.x >> 5) * kWarpStagingBytes;
}

// After a TMA tile's K loop (the workers, all of them): the results out from registers, then what they
// complete. GEMM1: the row tile's count of finished column tiles (GEMM2 tiles wait on it); GEMM2: the
// source's result rows (its results-done flag once all are in).
template <typename Element, typename Variant, typename Gemm>
__device__ __forceinline__ void finish_tile_tma(const MoEParams& p, const DestTables& t, const Gemm& gemm, char* smem,
                                                bool second, const RowTile& tile, int row_tile, int col_tile) {
  constexpr int kTileN = Variant::kTileN;
  if (!second) {
    gemm1_epilogue_warp<Element, kTileN>(p, gemm, warp_staging<Variant>(smem), tile.packed_row0, tile.rows,
                                         col_tile * gemm1_output_columns<Variant>(p));
    tma::fence_proxy_async_global();  // GEMM2's TMA loads (async proxy) read these rows
    sync_workers();
    if (threadIdx.x == 0) {
      __threadfence();
      ptx::red_release_add_gpu(p.row_tile_done + row_tile, 1);
    }
  } else {
    const int col0 = col_tile * kTileN;
    gemm2_epilogue_warp<Element, kTileN>(gemm, warp_staging<Variant>(smem),
                                         comb_row<Element>(p, tile.src, tile.stream_row0), p.hidden, tile.rows, col0);
    sync_workers();
    if (threadIdx.x == 0) account_results<Element, Variant>(p, t, tile.src, tile.rows, min(kTileN, p.hidden - col0));
  }
}

// One task as the producer decoded it.
struct ExpertTask {
  int task;  // >= 0: index in the queue; kTaskEnd: queue drained; kTaskAbort: a wait timed out
  bool second;
  int row_tile, col_tile;
};
constexpr int kTaskEnd = -1, kTaskAbort = -2;

template <int STAGES>
struct TaskRing {
  static constexpr int kSlots = STAGES + 2;  // the producer runs at most STAGES slabs (>= 1 per tile) ahead
  int task[kSlots];
  uint64_t full[kSlots];
};

__device__ __forceinline__ ExpertTask decode_task(int task, int tasks1, int tiles1, int tiles2) {
  ExpertTask t;
  t.task = task;
  t.second = task >= tasks1;
  const int index = t.second ? task - tasks1 : task;
  const int col_tiles = t.second ? tiles2 : tiles1;
  t.row_tile = index / col_tiles;
  t.col_tile = index % col_tiles;
  return t;
}

// Counts shared by producer and consumers.
struct TaskCounts {
  int tasks1, tiles1, tiles2, total;
};

// The counts over `row_tiles` row tiles.
template <typename Variant>
__device__ __forceinline__ TaskCounts task_counts(const MoEParams& p, int row_tiles) {
  TaskCounts c;
  c.tiles1 = gemm1_column_tiles<Variant>(p);
  c.tiles2 = gemm2_column_tiles<Variant>(p);
  c.tasks1 = row_tiles * c.tiles1;
  c.total = c.tasks1 + row_tiles * c.tiles2;
  return c;
}

// K slabs of a task's GEMM (GEMM1 runs over H, GEMM2 over I).
__device__ __forceinline__ int task_k_tiles(const MoEParams& p, bool second) {
  return second ? p.ffn / 64 : p.hidden / 64;
}

// Thread 0, once per launch: the stage ring's barriers and the task ring's.
template <typename Gemm, typename Ring>
__device__ __forceinline__ void init_task_pipeline(typename Gemm::Barriers& bars, Ring& ring) {
  Gemm::init_barriers(bars);
  for (int s = 0; s < Ring::kSlots; ++s) tma::mbarrier_init(ptx::smem_addr(&ring.full[s]), 1);
  tma::fence_barrier_init();
}

// Workers: the task id handed in ring slot n, in order (kTaskAbort when the wait failed).
template <typename Ring>
__device__ __forceinline__ int take_task(Ring& ring, int n, const MoEParams& p) {
  const int slot = n % Ring::kSlots;
  const bool handed = wait_pipeline(ptx::smem_addr(&ring.full[slot]), (n / Ring::kSlots) & 1, p);
  return handed ? ring.task[slot] : kTaskAbort;
}

// Producer warp: lane 0 takes tasks, waits for their inputs, hands them over in order and streams their
// slabs (box loads).
template <typename Element, typename Variant>
__device__ bool produce_tasks(const MoEParams& p, const DestTables& t, char* smem,
                              TmaPipelineBarriers<Variant::kStages>& bars, TaskRing<Variant::kStages>& ring,
                              const TaskCounts& c) {
  using Gemm = TmaTileGemm<Element, Variant::kTileN, Variant::kStages>;
  using Ring = TaskRing<Variant::kStages>;
  constexpr int kTileN = Variant::kTileN;
  const bool swiglu = p.activation == Activation::Swiglu;
  const int out_cols1 = swiglu ? kTileN / 2 : kTileN;
  const int lane = threadIdx.x & 31;
  uint32_t slab = 0, ready_seen = 0;
  for (int n = 0;; ++n) {
    int handed = kTaskAbort;
    if (lane == 0) {
      const int slot = n % Ring::kSlots;
      const int task = static_cast<int>(atomicAdd(p.task_counter, 1u));
      handed = task < c.total ? task : kTaskEnd;
      if (handed >= 0) {
        const ExpertTask job = decode_task(task, c.tasks1, c.tiles1, c.tiles2);
        const RowTile tile = row_tile_of(p, t, job.row_tile);
        const bool ready = job.second
            ? wait_at_least(p.row_tile_done + job.row_tile, c.tiles1, p, kPhaseIntermediate, p.rank)
            : wait_rows_ready(p, tile.src, ready_seen);
        tma::fence_proxy_async_global();
        if (!ready) handed = kTaskAbort;
      }
      ring.task[slot] = handed;
      tma::arrive(ptx::smem_addr(&ring.full[slot]));  // release: the slot's task id is visible to waiters
    }
    handed = __shfl_sync(0xffffffffu, handed, 0);
    if (handed < 0) return handed == kTaskEnd;
    const ExpertTask job = decode_task(handed, c.tasks1, c.tiles1, c.tiles2);
    const RowTile tile = row_tile_of(p, t, job.row_tile);
    const int k_tiles = task_k_tiles(p, job.second);
    bool produced = true;
    if (job.second) {
      const int col0 = job.col_tile * kTileN;
      if (lane == 0)
        produced = Gemm::produce(smem, bars, slab, k_tiles, p, [&](uint32_t a_dst, uint32_t b_dst, int k0, uint32_t bar) {
          tma::load_2d(a_dst, &p.maps.intermediate, bar, k0, tile.packed_row0);
#pragma unroll
          for (int panel = 0; panel < Gemm::kPanels; ++panel)
            tma::load_3d(b_dst + panel * Gemm::kPanelBytes, &p.maps.w2, bar, col0 + panel * 64, k0, tile.local);
        });
    } else {
      const int out_col0 = job.col_tile * out_cols1;
      const int col_lo = out_col0, col_hi = swiglu ? p.ffn + out_col0 : out_col0 + kTileN / 2;
      auto load_b = [&](uint32_t b_dst, int k0, uint32_t bar) {
#pragma unroll
        for (int panel = 0; panel < Gemm::kPanels; ++panel) {
          const int col = panel < Gemm::kPanels / 2 ? col_lo + panel * 64 : col_hi + (panel - Gemm::kPanels / 2) * 64;
          tma::load_3d(b_dst + panel * Gemm::kPanelBytes, &p.maps.w1, bar, col, k0, tile.local);
        }
      };
      if (lane == 0) {
        const int a_row = tile.src * p.stream_rows + tile.stream_row0;
        produced = Gemm::produce(smem, bars, slab, k_tiles, p, [&](uint32_t a_dst, uint32_t b_dst, int k0, uint32_t bar) {
          tma::load_2d(a_dst, &p.maps.recv, bar, k0, a_row);
          load_b(b_dst, k0, bar);
        });
      }
    }
    if (!__shfl_sync(0xffffffffu, produced, 0)) return false;  // consumers see the error word in their waits
    slab += k_tiles;
  }
}

// Consumer warpgroups (the workers): take the handed tasks in order, compute, write from registers.
template <typename Element, typename Variant>
__device__ bool consume_tasks(const MoEParams& p, const DestTables& t, char* smem,
                              TmaPipelineBarriers<Variant::kStages>& bars, TaskRing<Variant::kStages>& ring,
                              const TaskCounts& c) {
  using Gemm = TmaTileGemm<Element, Variant::kTileN, Variant::kStages>;
  uint32_t slab = 0;
  for (int n = 0;; ++n) {
    const int task = take_task(ring, n, p);
    if (task < 0) return task == kTaskEnd;
    const ExpertTask job = decode_task(task, c.tasks1, c.tiles1, c.tiles2);
    const RowTile tile = row_tile_of(p, t, job.row_tile);
    const int k_tiles = task_k_tiles(p, job.second);
    Gemm gemm;
    const bool ok = gemm.consume(smem, bars, slab, k_tiles, p, warpgroup_has_rows(tile.rows));
    slab += k_tiles;
    if (!sync_workers_and(ok)) return false;
    finish_tile_tma<Element, Variant>(p, t, gemm, smem, job.second, tile, job.row_tile, job.col_tile);
  }
}

template <typename Element, typename Variant>
__device__ bool run_expert_tasks_prefetch(const MoEParams& p, const DestTables& t, char* smem) {
  using Gemm = TmaTileGemm<Element, Variant::kTileN, Variant::kStages>;
  using Ring = TaskRing<Variant::kStages>;
  __shared__ TmaPipelineBarriers<Variant::kStages> bars;
  __shared__ Ring ring;
  const TaskCounts c = task_counts<Variant>(p, t.tile_start[p.world_size * p.local_experts]);
  if (threadIdx.x == 0) init_task_pipeline<Gemm>(bars, ring);
  __syncthreads();
  bool ok = true;
  if (threadIdx.x >= kThreads) {
    ok = produce_tasks<Element, Variant>(p, t, smem, bars, ring, c);
  } else if (threadIdx.x < kThreads) {
    ok = consume_tasks<Element, Variant>(p, t, smem, bars, ring, c);
  }
  return __syncthreads_and(ok);  // a uniform answer: the whole block leaves together
}

}  // namespace flashdmoe
