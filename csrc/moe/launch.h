// Host-side entry points of the fused forward: shape checks, workspace layout and the cooperative
// launch. Plain C++ (no kernels) so the pybind11 module can include it.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>
#include "moe/params.cuh"

namespace flashdmoe {

// Float32 runs the tensor cores in TF32 (mma.sync variant only).
enum class DType : int { BFloat16 = 0, Float16 = 1, Float32 = 2 };

// One rank of the launch: its tokens, the size of its local workspace and the peer table (its per-call
// addresses come with each launch: CallAddress).
struct RankArgs {
  size_t workspace_bytes;
  int tokens;
  int capacity;  // rows kept per expert; >= tokens means dropless
  int rank;
  bool silent;   // debug: publish no signals
  TeamRankWords* team_words;  // a team rank's words (moe/params.cuh); null: one rank, the host's number
  // Symmetric buffers of every rank as this rank addresses them (all null for a single-rank team:
  // its comb region and signal words then come from its workspace).
  void* peer_recv[kMaxRanks];
  void* peer_comb[kMaxRanks];
  uint32_t* peer_signals[kMaxRanks];
  RelayParams relay;  // the hierarchical exchange (moe/params.cuh); zero: direct
};

struct ForwardArgs {
  int hidden, ffn, experts, top_k;
  int world_size;   // P; experts / P per rank
  int stream_rows;  // rows per region of recv / comb (max tokens per rank * min(k, L))
  DType dtype;
  Activation activation;
  bool normalize_topk;
  uint64_t timeout_ns;
  int debug_withhold_phase;
  int expert_variant;  // tile_config.cuh: 0 TMA-fed wgmma 128x256/4 stages, 1 mma.sync 128x128/3
  int max_blocks;      // 0: the whole resident grid; else at most this many blocks
  bool gate_split;     // small batches split gate tiles over blocks (false: one block per tile)
  bool small_tile_epilogue;  // GEMM1 tiles of <= 16 rows spread their epilogue over every warp
  int grid_percent;    // 1..100: this share of the resident grid (ranks sharing one GPU under MPS)
  int num_ranks;       // ranks in this launch: P for an emulated team, else 1
  RankArgs ranks[kMaxRanks];
};

struct LaunchInfo {
  int grid;
  int blocks_per_sm;
  int smem_bytes;
};

// Per-call addresses of one rank, in this order (after the router [E, H], which leads the list): x [T, H],
// w1 [L, H, I or 2I], w2 [L, I, H], y [T, H], the routing outputs, saved_pre ([T*k, I or 2I] GEMM1's
// pre-activations by packed row, or 0; one rank only), the rank's workspace, and where its sync words are:
// 0 for the workspace's first `sync_bytes`, else `sync_bytes` of their own (a launch captured in a CUDA
// graph keeps zeroed sync words for the graph's life, while its scratch comes from the graph's pool).
enum CallAddress : int {
  kAddrX, kAddrW1, kAddrW2, kAddrY, kAddrTopkExpert, kAddrTopkWeight, kAddrTopkRow, kAddrExpertCounts,
  kAddrSavedPre, kAddrWorkspace, kAddrSyncWords, kAddressesPerRank
};

// One rank of a prepared launch: its parameters with every per-call address null (the workspace pieces
// as offsets from a null base) and its workspace layout. `params.maps` caches the rank's TMA
// descriptors, `map_base` the base address each was encoded for: a launch re-encodes only the maps whose
// base moved (x's gate map, usually; weights, router and workspace stay put).
struct PreparedRank {
  enum MapIndex : int {
    kMapW1, kMapW2, kMapRecv, kMapIntermediate, kMapRecvFull, kMapIntermediateFull, kMapGateX, kMapRouter, kMapCount
  };
  MoEParams params;
  WorkspaceLayout layout;
  const void* map_base[kMapCount];
};

// The grid of a prepared launch for one (kernel instance, device); the ranks' block ranges and gate
// splits that follow from it are in their prepared parameters.
struct GridChoice {
  const void* kernel;
  int device;
  LaunchInfo info;
};

// A launch checked and laid out once per plan (shape rules, workspace layout, peer table): a forward
// then fills in addresses only. Not copyable (the mutex): the launch runs without the GIL, and two
// threads may launch one plan at once.
struct PreparedLaunch {
  ForwardArgs args;
  PreparedRank ranks[kMaxRanks];
  GridChoice grid{};
  std::mutex mutex;  // guards the TMA caches (`ranks[].params.maps`, `map_base`) and `grid`
};

struct KernelAttributes {
  int registers;
  int local_bytes;
  int max_threads_per_block;
  int static_smem_bytes;
};

// Empty when the shapes are supported, else a message naming the violated constraint.
std::string check_shapes(int tokens, int hidden, int ffn, int experts, int top_k, int world_size);
WorkspaceLayout workspace_layout(int tokens, int hidden, int ffn, int experts, int top_k, DType dtype, int world_size,
                                 int stream_rows);
// Checks `prepared.args` (shapes, workspace sizes, team buffers) and lays out every rank's parameters;
// throws std::invalid_argument naming what is wrong. No CUDA call.
void prepare_launch(PreparedLaunch& prepared);
// One forward of a prepared launch: `addresses` holds the router, then kAddressesPerRank per rank. One
// CUDA call: the cooperative launch on `stream` (throws std::runtime_error / std::invalid_argument).
// Every rank's sync words must be zero (a new workspace: zeroed once; after a launch: reset by its
// exit). The kernel writes rank i's status block at `status_host` + i * kStatusBytes (pinned host
// memory, addressed through UVA; null: nowhere).
LaunchInfo launch_prepared(PreparedLaunch& prepared, const uintptr_t* addresses, uint32_t sequence,
                           void* status_host, cudaStream_t stream);
KernelAttributes kernel_attributes(DType dtype, int expert_variant);

// The expert variants' names in id order (the table in flashdmoe/kernel/expert_variants.py, as compiled).
std::vector<std::string> expert_variant_names();

// One (dtype, expert variant, rank capacity) instance, explicitly instantiated in the build folder's
// generated units: capacity 1 for a launch of one rank, kMaxRanks for an emulated team's.
template <typename Element, typename Variant, int kRankCapacity>
LaunchInfo launch_forward_variant(PreparedLaunch& prepared, const uintptr_t* addresses, uint32_t sequence,
                                  void* status_host, cudaStream_t stream);
template <typename Element, typename Variant>
KernelAttributes kernel_attributes_variant();

}  // namespace flashdmoe
