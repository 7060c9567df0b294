// Expert FFN tasks on this rank's local experts: GEMM1 (+ activation) per (row tile, intermediate column
// tile) into the intermediate buffer, GEMM2 per (row tile, hidden column tile) straight into the comb
// buffer of each row's source rank. Tasks come from a device queue; a GEMM1 tile starts once the peers
// whose rows it reads have published them, a GEMM2 tile once its row tile's GEMM1 tiles are all done.
// This file: what every schedule shares, and the schedule of the mma.sync variant (all threads load with
// cp.async, one task at a time); the TMA variant's schedule is moe/expert_pipeline.cuh.
#pragma once
#include "common/sync.cuh"
#include "common/tile_order.cuh"
#include "moe/activation.cuh"
#include "comm/peer_transport.cuh"
#include "moe/tile_gemm.cuh"

namespace flashdmoe {

// The mma.sync variant's tile GEMM: 8 warps as 2 x 4, a cp.async pipeline.
template <typename Element, typename Variant>
using ExpertGemm = TileGemm<Element, kExpertTileM, Variant::kTileN, 2, 4, Variant::kStages, /*B_K_CONTIGUOUS=*/false>;

template <typename Variant>
__host__ __device__ constexpr int expert_scratch_bytes() {
  return Variant::kScratchBytes;
}

// Eight elements moved as one vector (16 bytes for 2-byte inputs, two 16-byte halves for fp32).
template <typename Element>
struct alignas(8 * sizeof(Element)) Pack8 {
  Element v[8];
};
// Eight elements from global memory through L2 only (rows other blocks wrote in this launch).
template <typename Element>
__device__ __forceinline__ Pack8<Element> load_pack8_cg(const Element* src) {
  Pack8<Element> out;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(out) / 16); ++i)
    reinterpret_cast<int4*>(&out)[i] = __ldcg(reinterpret_cast<const int4*>(src) + i);
  return out;
}

// GEMM1 output columns per tile: swiglu tiles hold N/2 gate + N/2 up columns and produce N/2.
template <typename Variant>
__device__ __forceinline__ int gemm1_output_columns(const MoEParams& p) {
  return p.activation == Activation::Swiglu ? Variant::kTileN / 2 : Variant::kTileN;
}
template <typename Variant>
__device__ __forceinline__ int gemm1_column_tiles(const MoEParams& p) {
  const int cols = gemm1_output_columns<Variant>(p);
  return (p.ffn + cols - 1) / cols;
}
template <typename Variant>
__device__ __forceinline__ int gemm2_column_tiles(const MoEParams& p) {
  return (p.hidden + Variant::kTileN - 1) / Variant::kTileN;
}

// The two GEMMs of an expert FFN: Gemm1 = rows x W1 (+ activation) into the intermediate buffer,
// Gemm2 = intermediate rows x W2 into the rows' source's comb buffer.
enum class FfnGemm : int { Gemm1, Gemm2 };

// A task of the queue: every GEMM1 task (row tile x intermediate column tile) comes before every GEMM2
// task (row tile x hidden column tile).
struct ExpertTask {
  FfnGemm gemm;
  int row_tile, col_tile;
  int local;  // the local expert whose rows the row tile holds
};
// The queue's shape for a number of row tiles. A task covers kClusterBlocks row tiles (one per block of
// a cluster; row tiles come paired by expert then: build_dest_tables' pair_tiles).
struct TaskCounts {
  int row_units;  // row tiles / kClusterBlocks
  int tasks1;     // GEMM1 tasks (they come first)
  int tiles1;     // GEMM1 column tiles per row tile (a GEMM2 tile waits for all of them)
  int tiles2;     // GEMM2 column tiles per row tile
  int total;      // all tasks
};
template <typename Variant>
__device__ __forceinline__ TaskCounts task_counts(const MoEParams& p, int row_tiles) {
  TaskCounts counts;
  counts.row_units = row_tiles / Variant::kClusterBlocks;
  counts.tiles1 = gemm1_column_tiles<Variant>(p);
  counts.tiles2 = gemm2_column_tiles<Variant>(p);
  counts.tasks1 = counts.row_units * counts.tiles1;
  counts.total = counts.tasks1 + counts.row_units * counts.tiles2;
  return counts;
}
// Within each GEMM the row tiles are taken in groups that never straddle two experts (segment_group,
// common/tile_order.cuh): expert l's units are its tiles over all sources, tile_start[l * P] to
// tile_start[(l + 1) * P], divided by the cluster size (build_dest_tables pairs an expert's tiles for
// clusters). `member` of a cluster of `cluster` blocks takes row tile member of the task's unit.
__device__ __forceinline__ ExpertTask decode_task(const MoEParams& p, const DestTables& tables, int task,
                                                  const TaskCounts& counts, int member = 0, int cluster = 1) {
  ExpertTask job;
  job.gemm = task >= counts.tasks1 ? FfnGemm::Gemm2 : FfnGemm::Gemm1;
  const int index = job.gemm == FfnGemm::Gemm2 ? task - counts.tasks1 : task;
  const int col_tiles = job.gemm == FfnGemm::Gemm2 ? counts.tiles2 : counts.tiles1;
  const TileGroup group =
      segment_group(index / col_tiles, tables.tile_start, p.local_experts, p.world_size, cluster);
  const TileCoord tile = grouped_tile(index, col_tiles, group);
  job.local = group.segment;
  job.row_tile = tile.row * cluster + member;
  job.col_tile = tile.col;
  return job;
}

// A task's B tile, as two halves of kTileN / 2 weight columns: the swiglu GEMM1's gate columns from `lo`
// and its up columns from `hi`, else consecutive columns (hi = lo + kTileN / 2). Columns at or past a
// half's end are zero (cp.async) or past the tensor (TMA zero-fills) or computed and dropped by the
// epilogue (a swiglu gate half running into the up columns).
struct WeightColumns {
  int lo, lo_end, hi, hi_end;
};
template <typename Variant>
__device__ __forceinline__ WeightColumns weight_columns(const MoEParams& p, FfnGemm gemm, int col_tile) {
  constexpr int kHalf = Variant::kTileN / 2;
  if (gemm == FfnGemm::Gemm2) {
    const int col0 = col_tile * Variant::kTileN;
    return {col0, p.hidden, col0 + kHalf, p.hidden};
  }
  const bool swiglu = p.activation == Activation::Swiglu;
  const int I = p.ffn, out_col0 = col_tile * gemm1_output_columns<Variant>(p);
  return {out_col0, I, swiglu ? I + out_col0 : out_col0 + kHalf, swiglu ? 2 * I : I};
}
// A task's first A row: in the receive buffer (GEMM1, the source's region) or the intermediate (GEMM2).
__device__ __forceinline__ int a_first_row(const MoEParams& p, const RowTile& tile, FfnGemm gemm) {
  return gemm == FfnGemm::Gemm1 ? tile.src * p.stream_rows + tile.stream_row0 : tile.packed_row0;
}

// Stage the accumulators as fp32 rows in shared memory so the epilogue can pair columns and store
// 16 bytes per thread.
template <typename Variant, typename Gemm>
__device__ __forceinline__ float* stage_accumulators(const Gemm& gemm, char* smem) {
  float* staged = reinterpret_cast<float*>(smem);
  gemm.for_each_acc_pair([&](int row, int col, float2 v) {
    *reinterpret_cast<float2*>(staged + row * Variant::kEpilogueStride + col) = v;
  });
  __syncthreads();
  return staged;
}

// GEMM1 epilogue from the staged fp32 tile: activation (swiglu pairs column c with c + N/2), 16-byte
// stores of `rows` rows into the intermediate buffer from packed row `packed_row0`, columns from out_col0.
template <typename Element, typename Variant>
__device__ __forceinline__ void store_gemm1_rows(const MoEParams& p, const float* staged, int packed_row0, int rows,
                                                 int out_col0, int out_cols, bool swiglu, int I) {
  constexpr int kTileN = Variant::kTileN;
  Element* out = static_cast<Element*>(p.intermediate);
  const int chunks_per_row = out_cols / 8;
  for (int i = threadIdx.x; i < rows * chunks_per_row; i += kThreads) {
    const int r = i / chunks_per_row, c = (i % chunks_per_row) * 8;
    if (out_col0 + c >= I) continue;
    const float* src = staged + r * Variant::kEpilogueStride + c;
    Pack8<Element> pack;
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      const float h = swiglu ? silu(src[v]) * src[v + kTileN / 2] : activate(p.activation, src[v]);
      pack.v[v] = static_cast<Element>(h);
    }
    *reinterpret_cast<Pack8<Element>*>(out + static_cast<size_t>(packed_row0 + r) * I + out_col0 + c) = pack;
    if constexpr (Variant::kSavePre) {  // the pre-activations as they are (swiglu: gate at c, up at I + c)
      Element* saved = static_cast<Element*>(p.saved_pre) + static_cast<size_t>(packed_row0 + r) * (swiglu ? 2 * I : I);
      Pack8<Element> pre;
#pragma unroll
      for (int v = 0; v < 8; ++v) pre.v[v] = static_cast<Element>(src[v]);
      *reinterpret_cast<Pack8<Element>*>(saved + out_col0 + c) = pre;
      if (swiglu) {
#pragma unroll
        for (int v = 0; v < 8; ++v) pre.v[v] = static_cast<Element>(src[v + kTileN / 2]);
        *reinterpret_cast<Pack8<Element>*>(saved + I + out_col0 + c) = pre;
      }
    }
  }
}

// GEMM2 epilogue from the staged fp32 tile: 16-byte stores of `rows` result rows to `out` (row stride H),
// columns from col0.
template <typename Element, typename Variant>
__device__ __forceinline__ void store_gemm2_rows(const float* staged, Element* out, int rows, int col0, int H) {
  constexpr int kChunksPerRow = Variant::kTileN / 8;
  for (int i = threadIdx.x; i < rows * kChunksPerRow; i += kThreads) {
    const int r = i / kChunksPerRow, c = (i % kChunksPerRow) * 8;
    if (col0 + c >= H) continue;
    const float* src = staged + r * Variant::kEpilogueStride + c;
    Pack8<Element> pack;
#pragma unroll
    for (int v = 0; v < 8; ++v) pack.v[v] = static_cast<Element>(src[v]);
    *reinterpret_cast<Pack8<Element>*>(out + static_cast<size_t>(r) * H + col0 + c) = pack;
  }
}

// Results-done accounting after a GEMM2 tile (one thread): the tile wrote `rows` result rows of
// `cols` columns for source `src`; the tile that completes a source's rows over all column tiles
// publishes its results-done flag. Rows for this rank itself need no flag (its own barrier orders them).
template <typename Element, typename Variant>
__device__ __forceinline__ void account_results(const MoEParams& p, const DestTables& tables, int src, int rows, int cols) {
  if (src == p.rank) return;
  __threadfence_system();
  atomicAdd(p.traffic + 1, static_cast<unsigned long long>(rows) * cols * sizeof(Element));
  const uint32_t expected = static_cast<uint32_t>(tables.stream_start[src * (p.local_experts + 1) + p.local_experts]) *
                            static_cast<uint32_t>(gemm2_column_tiles<Variant>(p));
  if (atomicAdd(p.result_rows_done + src, static_cast<uint32_t>(rows)) + rows == expected)
    peer_transport_t<Variant>::template publish_results_done<Element>(p, src);
}

// Once per block and source: wait (bounded) until the source's rows for this rank are in place.
__device__ __forceinline__ bool wait_rows_ready(const MoEParams& p, int src, uint32_t& ready_seen) {
  if (src == p.rank || (ready_seen >> src) & 1u) return true;
  const uint32_t* flag = p.peers[p.rank].signals + signal_rows_ready(p.world_size, p.local_experts, src);
  if (!wait_at_least<Scope::System>(flag, forward_sequence(p), p, kPhasePeerRows, src)) return false;
  ready_seen |= 1u << src;
  return true;
}

template <typename Element>
__device__ __forceinline__ const Element* recv_row(const MoEParams& p, int src, int stream_row) {
  return static_cast<const Element*>(p.peers[p.rank].recv) +
         (static_cast<size_t>(src) * p.stream_rows + stream_row) * p.hidden;
}
template <typename Element>
__device__ __forceinline__ Element* comb_row(const MoEParams& p, int src, int stream_row) {
  return static_cast<Element*>(p.peers[src].comb) + (static_cast<size_t>(p.rank) * p.stream_rows + stream_row) * p.hidden;
}

template <typename Element, typename Variant>
__device__ bool gemm1_tile(const MoEParams& p, const RowTile& tile, int row_tile, int col_tile, uint32_t& ready_seen,
                           char* smem, const Element** a_rows) {
  __shared__ int inputs_ready;
  const int H = p.hidden, I = p.ffn, rows = tile.rows;
  if (threadIdx.x == 0) inputs_ready = wait_rows_ready(p, tile.src, ready_seen);
  if (threadIdx.x < kExpertTileM)
    a_rows[threadIdx.x] = threadIdx.x < rows ? recv_row<Element>(p, tile.src, tile.stream_row0 + threadIdx.x) : nullptr;
  __syncthreads();
  if (!inputs_ready) return false;
  const bool swiglu = p.activation == Activation::Swiglu;
  const int out_cols = gemm1_output_columns<Variant>(p);
  const WeightColumns cols = weight_columns<Variant>(p, FfnGemm::Gemm1, col_tile);
  const Element* w1 = static_cast<const Element*>(p.w1) + static_cast<size_t>(tile.local) * H * p.w1_cols;
  const Element* fallback = static_cast<const Element*>(p.x);

  using Gemm = ExpertGemm<Element, Variant>;
  Gemm gemm;
  gemm.run(smem, H / Gemm::kBlockK, [&](uint32_t a_dst, uint32_t b_dst, int k0) {
    Gemm::template load_rows<kExpertTileM>(a_dst, a_rows, k0, fallback);
    Gemm::load_b_n_major(b_dst, w1, p.w1_cols, k0, cols.lo, cols.lo_end, cols.hi, cols.hi_end);
  });
  const float* staged = stage_accumulators<Variant>(gemm, smem);

  store_gemm1_rows<Element, Variant>(p, staged, tile.packed_row0, rows, cols.lo, out_cols, swiglu, I);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    ptx::red_release_add_gpu(p.row_tile_done + row_tile, 1);
  }
  return true;
}

// Result rows go straight to their source's comb buffer, region [this rank].
template <typename Element, typename Variant>
__device__ bool gemm2_tile(const MoEParams& p, const DestTables& tables, const RowTile& tile, int row_tile, int col_tile,
                           char* smem, const Element** a_rows) {
  __shared__ int inputs_ready;
  const int H = p.hidden, I = p.ffn, rows = tile.rows;
  if (threadIdx.x == 0)
    inputs_ready = wait_at_least(p.row_tile_done + row_tile, gemm1_column_tiles<Variant>(p), p, kPhaseIntermediate,
                                 p.rank);
  const Element* hidden = static_cast<const Element*>(p.intermediate);
  if (threadIdx.x < kExpertTileM)
    a_rows[threadIdx.x] = threadIdx.x < rows ? hidden + static_cast<size_t>(tile.packed_row0 + threadIdx.x) * I : nullptr;
  __syncthreads();
  if (!inputs_ready) return false;
  const WeightColumns cols = weight_columns<Variant>(p, FfnGemm::Gemm2, col_tile);
  const Element* w2 = static_cast<const Element*>(p.w2) + static_cast<size_t>(tile.local) * I * H;

  using Gemm = ExpertGemm<Element, Variant>;
  Gemm gemm;
  gemm.run(smem, I / Gemm::kBlockK, [&](uint32_t a_dst, uint32_t b_dst, int k0) {
    Gemm::template load_rows<kExpertTileM>(a_dst, a_rows, k0, hidden);
    Gemm::load_b_n_major(b_dst, w2, H, k0, cols.lo, cols.lo_end, cols.hi, cols.hi_end);
  });
  const float* staged = stage_accumulators<Variant>(gemm, smem);

  Element* out = comb_row<Element>(p, tile.src, tile.stream_row0);
  store_gemm2_rows<Element, Variant>(staged, out, rows, cols.lo, H);
  __syncthreads();
  if (threadIdx.x == 0) account_results<Element, Variant>(p, tables, tile.src, rows, min(Variant::kTileN, H - cols.lo));
  return true;
}

// Drain the task queue: every GEMM1 task precedes every GEMM2 task, so a GEMM2 wait never blocks a
// GEMM1 tile that has not been taken yet (no deadlock with all blocks resident). The next task id is
// fetched while the current tile runs (off the critical path); a block's prefetched task is always
// later in queue order than its current one, so the oldest unfinished task is always being run.
template <typename Element, typename Variant>
__device__ bool run_expert_tasks(const MoEParams& p, const DestTables& tables, char* smem, const Element** a_rows) {
  __shared__ int next_task[2];
  uint32_t ready_seen = 0;  // meaningful in the thread that does the waits
  if (threadIdx.x == 0) next_task[0] = static_cast<int>(atomicAdd(p.task_counter, 1u));
  __syncthreads();
  const TaskCounts counts = task_counts<Variant>(p, tables.tile_start[p.world_size * p.local_experts]);
  for (int n = 0;; ++n) {
    const int task = next_task[n & 1];
    if (task >= counts.total) return true;
    // Written here, read after the tile's closing block barrier; slot n & 1 is rewritten only after
    // the next tile's barrier, when every thread has read it.
    if (threadIdx.x == 0) next_task[(n + 1) & 1] = static_cast<int>(atomicAdd(p.task_counter, 1u));
    const ExpertTask job = decode_task(p, tables, task, counts);
    const RowTile tile = row_tile_of(p, tables, job.row_tile, job.local);
    const bool ok = job.gemm == FfnGemm::Gemm2
        ? gemm2_tile<Element, Variant>(p, tables, tile, job.row_tile, job.col_tile, smem, a_rows)
        : gemm1_tile<Element, Variant>(p, tile, job.row_tile, job.col_tile, ready_seen, smem, a_rows);
    if (!ok) return false;
  }
}

}  // namespace flashdmoe
