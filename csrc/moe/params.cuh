// Runtime shapes, pointers and the workspace layout shared by the host launcher and the kernel.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstddef>
#include <cstdint>
#include "moe/tile_config.cuh"

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
  kPhasePeerCounts = 6,    // waiting for a peer's per-expert row counts
  kPhasePeerRows = 7,      // an expert GEMM1 tile waiting for a peer's dispatched rows
  kPhasePeerResults = 8,   // the combine waiting for a peer's expert results
  kPhaseTilePipeline = 9,  // an expert tile's TMA pipeline (a stage that never filled or drained)
  // 10-22: the backward (backward/fused_params.cuh, backward/ep_rows.cuh)
  kPhaseRelayFree = 23,       // a source waiting for its relay to free the region of its previous batch
  kPhaseRelayIn = 24,         // a relay waiting for a source's batch of rows
  kPhaseRelayForwarded = 25,  // grid barrier after a relay stored its batches' rows into the owners' buffers
  kPhaseCombineCopy = 26,     // the combine's copy of result rows into shared memory (a stage that never filled)
};

// Most ranks in one team (and virtual ranks in one emulated launch): the size of the peer table.
constexpr int kMaxRanks = 8;

// One peer's symmetric buffers, as this rank addresses them (NVLink / same-GPU pointers, or the other
// virtual ranks' buffers in an emulated launch).
//   recv    [P][stream_rows][H]  rows sources dispatched to the peer, one region per source
//   comb    [P][stream_rows][H]  results for the peer's tokens, one region per rank that computed them
//   signals [P*L + 5P] u32       counts from each source, then counts / rows-ready / results-done flags,
//                                and the relays' batch-in / batch-free flags (hierarchical exchange)
struct PeerBuffers {
  void* recv;
  void* comb;
  uint32_t* signals;
};

// Signal word indices. Flags hold the sequence number of the forward that wrote them: they increase
// by one per forward, so they never need clearing and a wait is `flag >= sequence`.
__host__ __device__ __forceinline__ int signal_count(int local_experts, int src, int local) {
  return src * local_experts + local;
}
__host__ __device__ __forceinline__ int signal_counts_flag(int world, int local_experts, int src) {
  return world * local_experts + src;
}
__host__ __device__ __forceinline__ int signal_rows_ready(int world, int local_experts, int src) {
  return world * local_experts + world + src;
}
__host__ __device__ __forceinline__ int signal_results_done(int world, int local_experts, int dst) {
  return world * local_experts + 2 * world + dst;
}
// The hierarchical exchange (RelayParams): at a relay, source src's batch has landed; at a source, its
// relay `relay` has forwarded the source's last batch (the relay's incoming region is free again).
__host__ __device__ __forceinline__ int signal_relay_in(int world, int local_experts, int src) {
  return world * local_experts + 3 * world + src;
}
__host__ __device__ __forceinline__ int signal_relay_free(int world, int local_experts, int relay) {
  return world * local_experts + 4 * world + relay;
}
__host__ __device__ __forceinline__ int signal_words(int world, int local_experts) {
  return world * local_experts + 5 * world;
}

// Error word (uint64): bits 0-7 kind, 8-15 phase, 16-31 peer rank, 32-63 block id.
// kErrorSequence: a team rank's forwards used up the 31-bit sequence numbers (its flags would wrap).
// kErrorTeamFailed: the rank ran nothing because an earlier launch of its team failed; bits 32-63 hold
// the rank's TeamRankWords::failed (that forward's number, or a backward's with kTeamFailedInBackward)
// instead of a block id.
enum ErrorKind : uint32_t { kErrorNone = 0, kErrorTimeout = 1, kErrorSequence = 2, kErrorTeamFailed = 3 };
// A team rank's words in device memory the team owns, zero when it is made. `forwards`: its forwards so
// far; a launch takes forwards + 1 as its sequence number and the rank's last block stores it back, so a
// CUDA graph's replays advance it as eager launches do. `failed`: the number of the rank's first forward
// or backward exchange that failed (0: none). It stays set: every later launch of the rank, forward or
// exchange, reads it and runs nothing, publishing nothing, so its peers stop on their watchdog. Stream
// order alone then keeps a launch off buffers a failed one left in an unknown state, and the host need not
// wait for one launch to queue the next.
struct TeamRankWords {
  uint32_t forwards;
  uint32_t failed;
};
// TeamRankWords::failed of a rank whose backward exchange failed: that backward's sequence number with this
// bit set (a forward's number is below 2^31).
constexpr uint32_t kTeamFailedInBackward = 1u << 31;
// Status flags word (uint32), not fatal: reported after the launch.
enum StatusFlag : uint32_t { kStatusNonFiniteLogits = 1u };
// Phase clock slots: 0 start, 1..4 after grid barriers 1..4 (block 0's view), 5 last block's exit.
constexpr int kPhaseClockSlots = 6;
// Traffic words (u64, bytes of rows and results sent to other ranks). The totals count every transport;
// the NVSHMEM pair is the part of them that went through NVSHMEM puts (only NvshmemTransport adds to it,
// P2PTransport leaves it 0).
enum TrafficWord : int {
  kTrafficDispatch = 0,
  kTrafficCombine = 1,
  kTrafficNvshmemDispatch = 2,
  kTrafficNvshmemCombine = 3,
  kTrafficWords = 4
};

// A rank's status words (error word, phase clock, traffic counters, status flags) lead its workspace in
// one kStatusBytes block, part of the sync words: the rank's last block to exit writes the block into
// the launch's pinned host slot and zeroes the sync words for the next launch (finish_launch,
// common/sync.cuh); the host decodes the slot by these offsets (flashdmoe/kernel/launch_report.py reads them
// from the extension).
constexpr size_t kStatusBytes = 128;
constexpr size_t kStatusErrorWord = 0;                                        // u64
constexpr size_t kStatusPhaseClock = 8;                                       // u64 [kPhaseClockSlots]
constexpr size_t kStatusTraffic = kStatusPhaseClock + 8 * kPhaseClockSlots;   // u64 [2] all transports
constexpr size_t kStatusNvshmemTraffic = kStatusTraffic + 8 * 2;              // u64 [2] of them NVSHMEM puts
constexpr size_t kStatusFlags = kStatusNvshmemTraffic + 8 * 2;                // u32
// u32, host slot only: 1 once the rest of the block is in the slot. The host reads it to know a launch
// finished (no CUDA event per launch) and zeroes it before the slot's next launch; the device-side copy
// of this word is never written.
constexpr size_t kStatusDone = 96;
static_assert(kStatusFlags + 4 <= kStatusDone && kStatusDone + 4 <= kStatusBytes,
              "the status words outgrow their block");
static_assert(kStatusNvshmemTraffic == kStatusTraffic + 8 * kTrafficNvshmemDispatch &&
                  kStatusFlags == kStatusTraffic + 8 * kTrafficWords,
              "the traffic words are one array (MoEParams::traffic)");

// TMA descriptors of the expert GEMM operands (TMA variant only; 128-byte swizzled boxes, moe/tma_boxes.cuh):
// w1 [L][H][w1_cols] and w2 [L][I][H] in weight panel boxes, recv [P*stream_rows][H] and intermediate
// [rows_in][I] in the variant's row boxes and, for the full tiles of 64-row box variants, in kExpertTileM-row
// boxes (recv_full, intermediate_full: one TMA request per slab where two ran). Gate: x in kGateTileM-row boxes,
// the router [E][H] in boxes of up to kGateTileN rows.
struct ExpertTensorMaps {
  CUtensorMap w1, w2, recv, intermediate, recv_full, intermediate_full, gate_x, router;
};

// The hierarchical cross-node exchange of an NVSHMEM team (docs/design.md §8; NvshmemTransport only):
// ranks are node-major, ranks_per_node G to a node, and rank (node a, index i) sends each of its token
// rows once to every other node b that holds one of the token's kept choices, to its relay there
// (b, i), which stores the row into those owners' receive buffers as the source would have. `buffer`:
// this rank's symmetric relay buffer, N = P / G batch regions for the batches it sends (by destination
// node), then N for those it receives (by source node), each `batch_bytes`: a 16-byte header (the
// batch's row count), k records per row (RelayRecord), then from `rows_offset` the rows.
struct RelayRecord {
  int owner;  // the choice's owner rank on the batch's node, or -1 (the choice is elsewhere or dropped)
  int row;    // its row in the owner's receive region [source]
};
// A batch region's header (the row count, padded), and the bytes of its header and `rows` rows' records.
constexpr size_t kRelayHeaderBytes = 16;
__host__ __device__ __forceinline__ size_t relay_record_bytes(int rows, int top_k) {
  return kRelayHeaderBytes + static_cast<size_t>(rows) * top_k * sizeof(RelayRecord);
}
struct RelayParams {
  int ranks_per_node;  // G; 0: every row is put straight to its owner (direct)
  int max_rows;        // rows a batch region holds (the team's max_tokens)
  size_t batch_bytes;
  size_t rows_offset;
  char* buffer;
};

// Everything the kernel reads is a runtime value; templates choose only dtype and tile shape.
struct MoEParams {
  ExpertTensorMaps maps;
  // Shapes: T tokens, H hidden, I intermediate, E experts, k choices per token.
  int tokens, hidden, ffn, experts, top_k;
  int w1_cols;           // I, or 2I for swiglu
  int capacity;          // rows kept per expert (== tokens when dropless)
  Activation activation;
  bool normalize_topk;

  // Team: this rank, P ranks of L = E / P experts each; global expert e lives on rank e / L.
  int rank, world_size, local_experts;
  int first_block, blocks;  // this rank's blocks in the launch (P virtual ranks share an emulated one)
  int stream_rows;          // rows of one region of recv / comb
  uint32_t sequence;        // the host's number for this forward (1 for one rank; see team_words)
  TeamRankWords* team_words;  // a team rank's words on the device; null for one rank
  bool silent;              // debug: publish no signals (peers must time out, not hang)
  PeerBuffers peers[kMaxRanks];
  RelayParams relay;        // the hierarchical exchange (zero: direct)

  // Inputs (row-major, contiguous): x [T,H], router [E,H], w1 [L,H,w1_cols], w2 [L,I,H] (this rank's
  // experts).
  const void* x;
  const void* router;
  const void* w1;
  const void* w2;
  // Outputs: y [T,H]; routing saved for backward: expert [T,k] i32, weight [T,k] f32,
  // row [T,k] i32 (row in the stream to the expert's owner, -1 when dropped), counts [E] i32 (routed,
  // pre-capacity).
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
  unsigned long long* traffic;      // [kTrafficWords] bytes sent to peers (TrafficWord)
  uint32_t* result_rows_done;       // [kMaxRanks] result rows finished for each source (x column tiles)
  uint32_t* row_tile_done;  // [max_row_tiles] GEMM1 n-tiles finished per row tile
  int* slot_in_tile;        // [T,k] rank of the choice among its gate tile's choices of that expert
  int* tile_expert_count;   // [gate_tiles, E]
  int* tile_expert_offset;  // [gate_tiles, E] exclusive prefix over gate tiles
  int* expert_kept;         // [E] rows kept after capacity (this rank's tokens)
  void* intermediate;       // [rows_in, I] activation output of every row this rank's experts take, input dtype
  void* saved_pre;          // [rows_in, I or 2I] GEMM1's pre-activations for the backward (null: not saved)

  float* gate_partial;       // [gate_tiles * gate_splits, kGateTileM, E] split gate: partial logits
  uint32_t* gate_arrivals;   // [kGateSplitMaxTiles] split gate: K ranges finished per gate tile
  uint32_t* exit_counter;    // this rank's blocks that finished; the last one resets the sync words
  uint32_t* sync_words;      // the workspace's first sync_words_count words: zero when a launch starts
  int sync_words_count;
  void* status_host;         // pinned host slot of this rank's status block (UVA address), or null
  int gate_tiles;
  int gate_splits;           // K ranges per gate tile (1: a tile on one block)
  bool small_tile_epilogue;  // GEMM1 tiles of <= 16 rows: activation spread over every warp (epilogue.cuh)
  int max_row_tiles;
  uint64_t timeout_ns;
  int debug_withhold_phase;  // > 0: block 0 never arrives at that barrier (tests the watchdog)
};

// This block's forward number: what its flags carry and its waits expect. Set once per block at the
// launch's start (begin_forward_sequence), read through here by every phase.
__device__ __forceinline__ uint32_t& block_sequence() {
  __shared__ uint32_t sequence;
  return sequence;
}
__device__ __forceinline__ uint32_t forward_sequence(const MoEParams&) { return block_sequence(); }

// The kernel's argument: every rank this launch runs (P virtual ranks for an emulated team, else one).
// Rank i owns blocks [rank[i].first_block, + rank[i].blocks); all ranks get the same number of blocks.
// Sized by the launch (kCapacity 1 for one rank, kMaxRanks for an emulated team): the driver copies the
// whole struct into every launch, and a rank's parameters are ~1.3 KB.
template <int kCapacity>
struct LaunchParams {
  static constexpr int kRankCapacity = kCapacity;
  int ranks;
  MoEParams rank[kCapacity];
};

// One allocation holds a rank's local scratch; the first `sync_bytes` (the status block included) are
// zero when a launch starts: zeroed once when the workspace is allocated, then by every launch's exit.
// A single-rank team also keeps its recv / comb regions and (unused) signal words here (`own_*`, else
// 0 bytes).
struct WorkspaceLayout {
  size_t barrier_counter, task_counter, error_word, status_flags, phase_clock, traffic, result_rows_done,
      row_tile_done, gate_arrivals, exit_counter;
  size_t sync_bytes;
  size_t gate_partial, slot_in_tile, tile_expert_count, tile_expert_offset, expert_kept;
  size_t intermediate, own_recv, own_comb, own_signals;
  size_t total_bytes;
  int gate_tiles, max_row_tiles;
};

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// rows_in: the most rows this rank's experts can take (P * stream_rows; T * k for one rank).
inline WorkspaceLayout make_workspace_layout(int tokens, int hidden, int ffn, int experts, int top_k,
                                             int element_bytes, int gate_tile_rows, int row_tile_rows,
                                             int world_size, int stream_rows) {
  WorkspaceLayout l{};
  const size_t rows = static_cast<size_t>(tokens) * top_k;
  const int local_experts = experts / world_size;
  const size_t rows_in = world_size == 1 ? rows : static_cast<size_t>(world_size) * stream_rows;
  l.gate_tiles = (tokens + gate_tile_rows - 1) / gate_tile_rows;
  // Each (source, local expert) segment rounds up to whole row tiles, and a cluster variant pads each
  // local expert's tiles to an even count: at most rows_in/tile + P*L + L tiles in all.
  l.max_row_tiles = static_cast<int>((rows_in + row_tile_rows - 1) / row_tile_rows) + world_size * local_experts +
                    local_experts;
  l.error_word = kStatusErrorWord;
  l.phase_clock = kStatusPhaseClock;
  l.traffic = kStatusTraffic;
  l.status_flags = kStatusFlags;
  size_t at = kStatusBytes;
  auto take = [&](size_t bytes) { size_t here = at; at = align_up(at + bytes, 128); return here; };
  l.barrier_counter = take(4);
  l.task_counter = take(4);
  l.result_rows_done = take(4 * kMaxRanks);
  l.row_tile_done = take(4 * static_cast<size_t>(l.max_row_tiles));
  l.gate_arrivals = take(4 * kGateSplitMaxTiles);
  l.exit_counter = take(4);
  l.sync_bytes = at;
  l.gate_partial = take(l.gate_tiles <= kGateSplitMaxTiles
                            ? 4 * static_cast<size_t>(gate_split_max_items(experts)) * gate_tile_rows * experts
                            : 0);
  l.slot_in_tile = take(4 * rows);
  l.tile_expert_count = take(4 * static_cast<size_t>(l.gate_tiles) * experts);
  l.tile_expert_offset = take(4 * static_cast<size_t>(l.gate_tiles) * experts);
  l.expert_kept = take(4 * static_cast<size_t>(experts));
  l.intermediate = take(static_cast<size_t>(element_bytes) * rows_in * ffn);
  const bool own = world_size == 1;
  l.own_recv = take(own ? static_cast<size_t>(element_bytes) * rows * hidden : 0);
  l.own_comb = take(own ? static_cast<size_t>(element_bytes) * rows * hidden : 0);
  l.own_signals = take(own ? 4 * static_cast<size_t>(signal_words(1, experts)) : 0);
  l.total_bytes = at;
  return l;
}

}  // namespace flashdmoe
