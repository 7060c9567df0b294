// Runtime shapes, pointers and the workspace layout shared by the host launcher and the kernel.
#pragma once
#include <cstddef>
#include <cstdint>

namespace flashdmoe {

enum class Activation : int { Relu = 0, Gelu = 1, Silu = 2, Swiglu = 3 };

// Phases named in timeout reports; the Python side maps these ids to text (keep in sync with
// flashdmoe/cuda_backend.py PHASE_NAMES).
enum Phase : uint32_t {
  kPhaseGateDone = 1,      // grid barrier after the gate
  kPhaseOffsetsDone = 2,   // grid barrier after the per-expert prefix sums
  kPhaseDispatchDone = 3,  // grid barrier after rows were placed into expert segments
  kPhaseIntermediate = 4,  // an expert GEMM2 tile waiting for its GEMM1 row tile
  kPhaseExpertsDone = 5,   // grid barrier before the combine
};

// Error word (uint64): bits 0-7 kind, 8-15 phase, 16-31 peer rank, 32-63 block id.
enum ErrorKind : uint32_t { kErrorNone = 0, kErrorTimeout = 1 };
// Status flags word (uint32), not fatal: reported after the launch.
enum StatusFlag : uint32_t { kStatusNonFiniteLogits = 1u };
// Phase clock slots: 0 start, 1..4 after grid barriers 1..4 (block 0's view), 5 last block's exit.
constexpr int kPhaseClockSlots = 6;

// Everything the kernel reads is a runtime value; templates choose only dtype and tile shape.
struct MoEParams {
  // Shapes: T tokens, H hidden, I intermediate, E experts, k choices per token.
  int tokens, hidden, ffn, experts, top_k;
  int w1_cols;           // I, or 2I for swiglu
  int capacity;          // rows kept per expert (== tokens when dropless)
  Activation activation;
  bool normalize_topk;

  // Inputs (row-major, contiguous): x [T,H], router [E,H], w1 [E,H,w1_cols], w2 [E,I,H].
  const void* x;
  const void* router;
  const void* w1;
  const void* w2;
  // Outputs: y [T,H]; routing saved for backward: expert [T,k] i32, weight [T,k] f32,
  // row [T,k] i32 (row in the packed expert buffers, -1 when dropped), counts [E] i32 (routed, pre-capacity).
  void* y;
  int* topk_expert;
  float* topk_weight;
  int* topk_row;
  int* expert_counts;

  // Workspace pieces (see WorkspaceLayout).
  uint32_t* barrier_counter;
  uint32_t* task_counter;
  unsigned long long* error_word;
  uint32_t* status_flags;
  unsigned long long* phase_clock;  // [kPhaseClockSlots] %globaltimer at kernel start, after each barrier, at the end
  uint32_t* row_tile_done;  // [max_row_tiles] GEMM1 n-tiles finished per row tile
  int* slot_in_tile;        // [T,k] rank of the choice among its gate tile's choices of that expert
  int* tile_expert_count;   // [gate_tiles, E]
  int* tile_expert_offset;  // [gate_tiles, E] exclusive prefix over gate tiles
  int* expert_kept;         // [E] rows kept after capacity
  int* row_token;           // [T*k] packed row -> token
  void* intermediate;       // [T*k, I] activation output, input dtype
  void* expert_out;         // [T*k, H] expert FFN output per row, input dtype

  int gate_tiles;
  int max_row_tiles;
  uint64_t timeout_ns;
  int debug_withhold_phase;  // > 0: block 0 never arrives at that barrier (tests the watchdog)
};

// One allocation holds all scratch; the first `sync_bytes` are zeroed before every launch.
struct WorkspaceLayout {
  size_t barrier_counter, task_counter, error_word, status_flags, phase_clock, row_tile_done;
  size_t sync_bytes;
  size_t slot_in_tile, tile_expert_count, tile_expert_offset, expert_kept, row_token;
  size_t intermediate, expert_out;
  size_t total_bytes;
  int gate_tiles, max_row_tiles;
};

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

inline WorkspaceLayout make_workspace_layout(int tokens, int hidden, int ffn, int experts, int top_k,
                                             int element_bytes, int gate_tile_rows, int row_tile_rows) {
  WorkspaceLayout l{};
  const size_t rows = static_cast<size_t>(tokens) * top_k;
  l.gate_tiles = (tokens + gate_tile_rows - 1) / gate_tile_rows;
  // Each expert's segment rounds up to whole row tiles: at most rows/tile + E tiles in all.
  l.max_row_tiles = static_cast<int>((rows + row_tile_rows - 1) / row_tile_rows) + experts;
  size_t at = 0;
  auto take = [&](size_t bytes) { size_t here = at; at = align_up(at + bytes, 128); return here; };
  l.barrier_counter = take(4);
  l.task_counter = take(4);
  l.error_word = take(8);
  l.status_flags = take(4);
  l.phase_clock = take(8 * kPhaseClockSlots);
  l.row_tile_done = take(4 * static_cast<size_t>(l.max_row_tiles));
  l.sync_bytes = at;
  l.slot_in_tile = take(4 * rows);
  l.tile_expert_count = take(4 * static_cast<size_t>(l.gate_tiles) * experts);
  l.tile_expert_offset = take(4 * static_cast<size_t>(l.gate_tiles) * experts);
  l.expert_kept = take(4 * static_cast<size_t>(experts));
  l.row_token = take(4 * rows);
  l.intermediate = take(static_cast<size_t>(element_bytes) * rows * ffn);
  l.expert_out = take(static_cast<size_t>(element_bytes) * rows * hidden);
  l.total_bytes = at;
  return l;
}

}  // namespace flashdmoe
