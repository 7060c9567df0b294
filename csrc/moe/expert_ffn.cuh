// Expert FFN tasks on this rank's local experts: GEMM1 (+ activation) per (row tile, intermediate column
// tile) into the intermediate buffer, GEMM2 per (row tile, hidden column tile) straight into the comb
// buffer of each row's source rank. Tasks come from a device queue; a GEMM1 tile starts once the peers
// whose rows it reads have published them, a GEMM2 tile once its row tile's GEMM1 tiles are all done.
#pragma once
#include <type_traits>
#include "common/sync.cuh"
#include "moe/activation.cuh"
#include "moe/dispatch.cuh"
#include "moe/tile_gemm.cuh"
#include "moe/tile_gemm_wgmma.cuh"

namespace flashdmoe {

// Hopper wgmma tiles, or the mma.sync tiles (kept as the portable comparison point).
template <typename Element, typename Variant>
using ExpertGemm = std::conditional_t<
    Variant::kUseWgmma, WgmmaTileGemm<Element, Variant::kTileN, Variant::kStages>,
    TileGemm<Element, kExpertTileM, Variant::kTileN, 2, 4, Variant::kStages, /*B_K_CONTIGUOUS=*/false>>;

template <typename Variant>
__host__ __device__ constexpr int expert_scratch_bytes() {
  return Variant::kPipelineBytes > Variant::kEpilogueBytes ? Variant::kPipelineBytes : Variant::kEpilogueBytes;
}

template <typename Element>
struct Pack8 {  // eight elements, one 16-byte store
  Element v[8];
};

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

// Stage the accumulators as fp32 rows in shared memory so the epilogue can pair columns and store
// 16 bytes per thread.
template <typename Variant, typename Gemm>
__device__ __forceinline__ float* stage_accumulators(const Gemm& gemm, char* smem) {
  float* staged = reinterpret_cast<float*>(smem);
  gemm.for_each_acc([&](int row, int col, float v) { staged[row * Variant::kEpilogueStride + col] = v; });
  __syncthreads();
  return staged;
}

// Per-block state of the current expert tile (static shared memory).
struct TileSources {
  uint32_t remote_mask;             // peers whose rows this tile reads / whose results it writes
  uint32_t ready_seen;              // peers whose rows-ready flag this block already saw
  int rows_of[kMaxRanks];           // rows of the tile from each source
};

// Thread i < rows: source of packed row m0 + i of local expert `local`; tallies rows per source.
__device__ __forceinline__ SourceRow tile_row_source(const MoEParams& p, const DestTables& t, TileSources& ts,
                                                     int local, int m0, int i) {
  const SourceRow sr = source_of_row(p, t, local, m0 + i);
  atomicAdd(&ts.rows_of[sr.src], 1);
  if (sr.src != p.rank) atomicOr(&ts.remote_mask, 1u << sr.src);
  return sr;
}

__device__ __forceinline__ void reset_tile_sources(TileSources& ts) {
  if (threadIdx.x < kMaxRanks) ts.rows_of[threadIdx.x] = 0;
  if (threadIdx.x == 0) ts.remote_mask = 0;
}

template <typename Element, typename Variant>
__device__ bool gemm1_tile(const MoEParams& p, const DestTables& t, TileSources& ts, int row_tile, int col_tile,
                           int local, int m0, int seg_row0, int rows, char* smem, const Element** a_rows) {
  __shared__ int inputs_ready;
  const int H = p.hidden, I = p.ffn;
  const Element* x = static_cast<const Element*>(p.x);
  const Element* recv = static_cast<const Element*>(p.peers[p.rank].recv);
  reset_tile_sources(ts);
  __syncthreads();
  if (threadIdx.x < kExpertTileM) {
    const Element* row = nullptr;
    if (threadIdx.x < rows) {
      const SourceRow sr = tile_row_source(p, t, ts, local, m0, threadIdx.x);
      row = sr.src == p.rank ? x + static_cast<size_t>(__ldcg(p.row_token + sr.stream_row)) * H
                             : recv + (static_cast<size_t>(sr.src) * p.stream_rows + sr.stream_row) * H;
    }
    a_rows[threadIdx.x] = row;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool ok = true;
    for (uint32_t pending = ts.remote_mask & ~ts.ready_seen; ok && pending; pending &= pending - 1) {
      const int src = __ffs(pending) - 1;
      const uint32_t* flag = p.peers[p.rank].signals + signal_rows_ready(p.world_size, p.local_experts, src);
      ok = wait_at_least<Scope::System>(flag, p.sequence, p, kPhasePeerRows, src);
      if (ok) ts.ready_seen |= 1u << src;
    }
    inputs_ready = ok;
  }
  __syncthreads();
  if (!inputs_ready) return false;
  constexpr int kTileN = Variant::kTileN;
  const bool swiglu = p.activation == Activation::Swiglu;
  const int out_cols = gemm1_output_columns<Variant>(p);
  const int out_col0 = col_tile * out_cols;
  const int col_lo = out_col0;
  const int col_hi = swiglu ? I + out_col0 : out_col0 + kTileN / 2;
  const int lo_end = I, hi_end = swiglu ? 2 * I : I;
  const Element* w1 = static_cast<const Element*>(p.w1) + static_cast<size_t>(local) * H * p.w1_cols;

  using Gemm = ExpertGemm<Element, Variant>;
  Gemm gemm;
  gemm.run(smem, H / 64, [&](uint32_t a_dst, uint32_t b_dst, int k0) {
    Gemm::template load_rows<kExpertTileM>(a_dst, a_rows, k0, x);
    Gemm::load_b_n_major(b_dst, w1, p.w1_cols, k0, col_lo, lo_end, col_hi, hi_end);
  });
  const float* staged = stage_accumulators<Variant>(gemm, smem);

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
    *reinterpret_cast<Pack8<Element>*>(out + static_cast<size_t>(seg_row0 + r) * I + out_col0 + c) = pack;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    ptx::red_release_add_gpu(p.row_tile_done + row_tile, 1);
  }
  return true;
}

// Result rows go to their source's comb buffer, region [this rank]; when a source's last result row
// (over all column tiles) is written, its results-done flag is published.
template <typename Element, typename Variant>
__device__ bool gemm2_tile(const MoEParams& p, const DestTables& t, TileSources& ts, int row_tile, int col_tile,
                           int local, int m0, int seg_row0, int rows, char* smem, const Element** a_rows) {
  __shared__ int inputs_ready;
  const int H = p.hidden, I = p.ffn;
  Element** out_rows = const_cast<Element**>(a_rows) + kExpertTileM;
  reset_tile_sources(ts);
  if (threadIdx.x == 0)
    inputs_ready = wait_at_least(p.row_tile_done + row_tile, gemm1_column_tiles<Variant>(p), p, kPhaseIntermediate,
                                 p.rank);
  __syncthreads();
  const Element* hidden = static_cast<const Element*>(p.intermediate);
  if (threadIdx.x < kExpertTileM) {
    Element* out = nullptr;
    if (threadIdx.x < rows) {
      const SourceRow sr = tile_row_source(p, t, ts, local, m0, threadIdx.x);
      out = static_cast<Element*>(p.peers[sr.src].comb) + (static_cast<size_t>(p.rank) * p.stream_rows + sr.stream_row) * H;
    }
    a_rows[threadIdx.x] = threadIdx.x < rows ? hidden + static_cast<size_t>(seg_row0 + threadIdx.x) * I : nullptr;
    out_rows[threadIdx.x] = out;
  }
  __syncthreads();
  if (!inputs_ready) return false;
  constexpr int kTileN = Variant::kTileN;
  const int col0 = col_tile * kTileN;
  const Element* w2 = static_cast<const Element*>(p.w2) + static_cast<size_t>(local) * I * H;

  using Gemm = ExpertGemm<Element, Variant>;
  Gemm gemm;
  gemm.run(smem, I / 64, [&](uint32_t a_dst, uint32_t b_dst, int k0) {
    Gemm::template load_rows<kExpertTileM>(a_dst, a_rows, k0, hidden);
    Gemm::load_b_n_major(b_dst, w2, H, k0, col0, H, col0 + kTileN / 2, H);
  });
  const float* staged = stage_accumulators<Variant>(gemm, smem);

  constexpr int kChunksPerRow = kTileN / 8;
  for (int i = threadIdx.x; i < rows * kChunksPerRow; i += kThreads) {
    const int r = i / kChunksPerRow, c = (i % kChunksPerRow) * 8;
    if (col0 + c >= H) continue;
    const float* src = staged + r * Variant::kEpilogueStride + c;
    Pack8<Element> pack;
#pragma unroll
    for (int v = 0; v < 8; ++v) pack.v[v] = static_cast<Element>(src[v]);
    *reinterpret_cast<Pack8<Element>*>(out_rows[r] + col0 + c) = pack;
  }
  __syncthreads();
  if (threadIdx.x == 0 && ts.remote_mask) {
    __threadfence_system();
    const int cols = min(kTileN, H - col0);
    const uint32_t tiles2 = gemm2_column_tiles<Variant>(p);
    for (uint32_t pending = ts.remote_mask; pending; pending &= pending - 1) {
      const int src = __ffs(pending) - 1;
      const uint32_t n = ts.rows_of[src];
      atomicAdd(p.traffic + 1, static_cast<unsigned long long>(n) * cols * sizeof(Element));
      const uint32_t expected = static_cast<uint32_t>(t.stream_start[src * (p.local_experts + 1) + p.local_experts]) * tiles2;
      if (atomicAdd(p.result_rows_done + src, n) + n == expected) publish_results_done(p, src);
    }
  }
  return true;
}

// Drain the task queue: every GEMM1 task precedes every GEMM2 task, so a GEMM2 wait never blocks a
// GEMM1 tile that has not been taken yet (no deadlock with all blocks resident).
template <typename Element, typename Variant>
__device__ bool run_expert_tasks(const MoEParams& p, const DestTables& t, char* smem, const Element** a_rows) {
  __shared__ int next_task;
  __shared__ TileSources sources;
  if (threadIdx.x == 0) sources.ready_seen = 0;
  const int L = p.local_experts;
  const int row_tiles = t.tile_start[L];
  const int tiles1 = gemm1_column_tiles<Variant>(p), tiles2 = gemm2_column_tiles<Variant>(p);
  const int tasks1 = row_tiles * tiles1;
  const int total = tasks1 + row_tiles * tiles2;
  for (;;) {
    if (threadIdx.x == 0) next_task = static_cast<int>(atomicAdd(p.task_counter, 1u));
    __syncthreads();
    const int task = next_task;
    __syncthreads();  // everyone has read next_task before thread 0 may overwrite it
    if (task >= total) return true;
    const bool second = task >= tasks1;
    const int index = second ? task - tasks1 : task;
    const int col_tiles = second ? tiles2 : tiles1;
    const int row_tile = index / col_tiles, col_tile = index % col_tiles;
    const int local = local_expert_of_row_tile(t, L, row_tile);
    const int m0 = (row_tile - t.tile_start[local]) * kExpertTileM;
    const int rows = min(kExpertTileM, t.seg_start[local + 1] - t.seg_start[local] - m0);
    const int seg_row0 = t.seg_start[local] + m0;
    const bool ok = second
        ? gemm2_tile<Element, Variant>(p, t, sources, row_tile, col_tile, local, m0, seg_row0, rows, smem, a_rows)
        : gemm1_tile<Element, Variant>(p, t, sources, row_tile, col_tile, local, m0, seg_row0, rows, smem, a_rows);
    if (!ok) return false;
  }
}

}  // namespace flashdmoe
