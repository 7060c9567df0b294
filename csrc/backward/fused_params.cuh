// Parameters and workspace of the fused expert backward of one rank (backward/fused_backward.cuh).
#pragma once
#include <cuda.h>
#include <cstddef>
#include <cstdint>
#include "moe/params.cuh"

namespace flashdmoe {

// Phases named in the backward's timeout reports, after the forward's (flashdmoe/cuda_backend.py
// PHASE_NAMES).
enum BackwardPhase : uint32_t {
  kPhaseBackwardCounts = 10,   // grid barrier after the kept rows of every expert were counted
  kPhaseBackwardGather = 11,   // grid barrier after dy's and x's rows were gathered by expert
  kPhaseBackwardRowTile = 12,  // a dx tile waiting for its row tile's g tiles
  kPhaseBackwardExpert = 13,   // a weight-gradient tile waiting for its expert's g tiles
};

// Each expert's rows start at a multiple of this in the backward's own row buffers, the gap zero: the
// weight gradients run over whole 64-row K slabs of one expert.
constexpr int kBackwardRowAlign = 64;
// Width of every GEMM's tiles in the backward (128 columns lost on every shape measured, docs/perf-notes.md).
constexpr int kBackwardTileN = 256;

// Rows of the backward's row buffers for T*k choices over E experts: every expert's rows padded.
__host__ __device__ constexpr int64_t backward_padded_rows(int64_t choices, int experts) {
  return choices + static_cast<int64_t>(experts) * (kBackwardRowAlign - 1);
}

// TMA descriptors, all in 64 x 64 boxes (128-byte swizzled): the weights as the forward encodes them
// (w1 [E][H][w1_cols], w2 [E][I][H]), read K-major as the transposed weights; the row buffers
// [padded rows][cols], read K-major as row GEMM operands and MN-major as weight-gradient operands.
struct BackwardTensorMaps {
  CUtensorMap w1, w2, dy_rows, x_rows, wh, dpre;
};

struct BackwardParams {
  BackwardTensorMaps maps;
  int tokens, hidden, ffn, w1_cols, experts, top_k;
  Activation activation;
  bool need_dx, need_dw1, need_dw2;

  // Inputs: x, dy [T, H]; pre [kept rows, w1_cols] by packed row (the forward's numbering: kept choices
  // by expert, token order within one); the forward's routing [T, k]: expert (i32), row (i32, -1 dropped),
  // weight (f32, the combine weight).
  const void* x;
  const void* dy;
  const void* pre;
  const int* topk_expert;
  const int* topk_row;
  const float* topk_weight;

  // Outputs: dw1 like w1, dw2 like w2; dx_rows [kept rows, H] (each kept row's dx, packed numbering);
  // dweight_row [kept rows] f32 (the combine weight's gradient); row_of_choice [T, k] i32 (the row, -1
  // where dropped or out of range: the routing of a failed forward is only read in bounds).
  void* dw1;
  void* dw2;
  void* dx_rows;
  float* dweight_row;
  int* row_of_choice;

  // Scratch by padded row (backward_padded_rows): dy's and x's rows, w * act(pre), dpre, the combine
  // weight, and the partial sums of dweight per g column tile.
  void* dy_rows;
  void* x_rows;
  void* wh;
  void* dpre;
  float* w_pad;
  float* dweight_part;

  // Sync words (zero at launch; the last block's exit zeroes them again): the status block first, as
  // the forward's (kStatus*), then the counters.
  unsigned long long* error_word;
  unsigned long long* phase_clock;
  uint32_t* barrier_counter;
  uint32_t* task_counter;
  uint32_t* exit_counter;
  uint32_t* kept_count;     // [E] kept rows per expert
  uint32_t* expert_done;    // [E] g tiles finished per expert
  uint32_t* row_tile_done;  // [max_row_tiles] g tiles finished per row tile
  uint32_t* sync_words;
  int sync_words_count;
  void* status_host;  // pinned host slot of the status block (UVA address), or null

  int rank, first_block, blocks;
  uint64_t timeout_ns;
  int debug_withhold_phase;
};

// The backward's sync words, offsets from the start of its sync buffer.
struct BackwardSyncLayout {
  size_t barrier_counter, task_counter, exit_counter, kept_count, expert_done, row_tile_done;
  size_t sync_bytes;
  int max_row_tiles;
};

// Row tiles of 128 rows, each within one expert: at most choices / 128 + E of them.
inline BackwardSyncLayout make_backward_sync_layout(int64_t choices, int experts) {
  BackwardSyncLayout l{};
  l.max_row_tiles = static_cast<int>((choices + 127) / 128) + experts;
  size_t at = kStatusBytes;
  auto take = [&](size_t bytes) { size_t here = at; at = (at + bytes + 127) / 128 * 128; return here; };
  l.barrier_counter = take(4);
  l.task_counter = take(4);
  l.exit_counter = take(4);
  l.kept_count = take(4 * static_cast<size_t>(experts));
  l.expert_done = take(4 * static_cast<size_t>(experts));
  l.row_tile_done = take(4 * static_cast<size_t>(l.max_row_tiles));
  l.sync_bytes = at;
  return l;
}

// The scratch buffer's pieces (offsets), for T*k choices.
struct BackwardScratchLayout {
  size_t dy_rows, x_rows, wh, dpre, w_pad, dweight_part, row_of_choice;
  size_t total_bytes;
  int64_t padded_rows;
  int g_col_tiles;
};

inline BackwardScratchLayout make_backward_scratch_layout(int64_t choices, int hidden, int ffn, int w1_cols,
                                                          int experts, int element_bytes) {
  BackwardScratchLayout l{};
  l.padded_rows = backward_padded_rows(choices, experts);
  l.g_col_tiles = (ffn + kBackwardTileN - 1) / kBackwardTileN;
  const size_t rows = static_cast<size_t>(l.padded_rows);
  size_t at = 0;
  auto take = [&](size_t bytes) { size_t here = at; at = (at + bytes + 127) / 128 * 128; return here; };
  l.dy_rows = take(rows * hidden * element_bytes);
  l.x_rows = take(rows * hidden * element_bytes);
  l.wh = take(rows * ffn * element_bytes);
  l.dpre = take(rows * w1_cols * element_bytes);
  l.w_pad = take(rows * 4);
  l.dweight_part = take(rows * l.g_col_tiles * 4);
  l.row_of_choice = take(static_cast<size_t>(choices) * 4);
  l.total_bytes = at;
  return l;
}

}  // namespace flashdmoe
