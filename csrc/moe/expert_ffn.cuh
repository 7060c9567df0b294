// Expert FFN tasks: GEMM1 (+ activation) per (row tile, intermediate column tile) into the intermediate
// buffer, GEMM2 per (row tile, hidden column tile) into the per-row expert output. Tasks are taken
// from a device queue; GEMM2 tiles start as soon as their row tile's GEMM1 tiles are all published.
#pragma once
#include <type_traits>
#include "common/sync.cuh"
#include "moe/activation.cuh"
#include "moe/routing.cuh"
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

template <typename Element, typename Variant>
__device__ void gemm1_tile(const MoEParams& p, int row_tile, int col_tile, int expert, int seg_row0, int rows,
                           char* smem, const Element** a_rows) {
  const int H = p.hidden, I = p.ffn;
  const Element* x = static_cast<const Element*>(p.x);
  if (threadIdx.x < kExpertTileM)
    a_rows[threadIdx.x] = threadIdx.x < rows
                              ? x + static_cast<size_t>(__ldcg(p.row_token + seg_row0 + threadIdx.x)) * H
                              : nullptr;
  __syncthreads();
  constexpr int kTileN = Variant::kTileN;
  const bool swiglu = p.activation == Activation::Swiglu;
  const int out_cols = gemm1_output_columns<Variant>(p);
  const int out_col0 = col_tile * out_cols;
  const int col_lo = out_col0;
  const int col_hi = swiglu ? I + out_col0 : out_col0 + kTileN / 2;
  const int lo_end = I, hi_end = swiglu ? 2 * I : I;
  const Element* w1 = static_cast<const Element*>(p.w1) + static_cast<size_t>(expert) * H * p.w1_cols;

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
}

template <typename Element, typename Variant>
__device__ bool gemm2_tile(const MoEParams& p, int row_tile, int col_tile, int expert, int seg_row0, int rows,
                           char* smem, const Element** a_rows) {
  __shared__ int inputs_ready;
  const int H = p.hidden, I = p.ffn;
  if (threadIdx.x == 0)
    inputs_ready = wait_at_least(p.row_tile_done + row_tile, gemm1_column_tiles<Variant>(p), p, kPhaseIntermediate, 0);
  const Element* hidden = static_cast<const Element*>(p.intermediate);
  if (threadIdx.x < kExpertTileM)
    a_rows[threadIdx.x] = threadIdx.x < rows ? hidden + static_cast<size_t>(seg_row0 + threadIdx.x) * I : nullptr;
  __syncthreads();
  if (!inputs_ready) return false;
  constexpr int kTileN = Variant::kTileN;
  const int col0 = col_tile * kTileN;
  const Element* w2 = static_cast<const Element*>(p.w2) + static_cast<size_t>(expert) * I * H;

  using Gemm = ExpertGemm<Element, Variant>;
  Gemm gemm;
  gemm.run(smem, I / 64, [&](uint32_t a_dst, uint32_t b_dst, int k0) {
    Gemm::template load_rows<kExpertTileM>(a_dst, a_rows, k0, hidden);
    Gemm::load_b_n_major(b_dst, w2, H, k0, col0, H, col0 + kTileN / 2, H);
  });
  const float* staged = stage_accumulators<Variant>(gemm, smem);

  Element* out = static_cast<Element*>(p.expert_out);
  constexpr int kChunksPerRow = kTileN / 8;
  for (int i = threadIdx.x; i < rows * kChunksPerRow; i += kThreads) {
    const int r = i / kChunksPerRow, c = (i % kChunksPerRow) * 8;
    if (col0 + c >= H) continue;
    const float* src = staged + r * Variant::kEpilogueStride + c;
    Pack8<Element> pack;
#pragma unroll
    for (int v = 0; v < 8; ++v) pack.v[v] = static_cast<Element>(src[v]);
    *reinterpret_cast<Pack8<Element>*>(out + static_cast<size_t>(seg_row0 + r) * H + col0 + c) = pack;
  }
  __syncthreads();
  return true;
}

// Drain the task queue: every GEMM1 task precedes every GEMM2 task, so a GEMM2 wait never blocks a
// GEMM1 tile that has not been taken yet (no deadlock with all blocks resident).
template <typename Element, typename Variant>
__device__ bool run_expert_tasks(const MoEParams& p, const RoutingTables& t, char* smem, const Element** a_rows) {
  __shared__ int next_task;
  const int row_tiles = t.tile_start[p.experts];
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
    const int local = second ? task - tasks1 : task;
    const int col_tiles = second ? tiles2 : tiles1;
    const int row_tile = local / col_tiles, col_tile = local % col_tiles;
    const int expert = expert_of_row_tile(t, p.experts, row_tile);
    const int m0 = (row_tile - t.tile_start[expert]) * kExpertTileM;
    const int rows = min(kExpertTileM, t.kept[expert] - m0);
    const int seg_row0 = t.seg_start[expert] + m0;
    if (!second) {
      gemm1_tile<Element, Variant>(p, row_tile, col_tile, expert, seg_row0, rows, smem, a_rows);
    } else if (!gemm2_tile<Element, Variant>(p, row_tile, col_tile, expert, seg_row0, rows, smem, a_rows)) {
      return false;
    }
  }
}

}  // namespace flashdmoe
