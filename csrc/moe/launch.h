// Host-side entry points of the fused forward: shape checks, workspace layout and the cooperative
// launch. Plain C++ (no kernels) so the pybind11 module can include it.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include <string>
#include <vector>
#include "moe/params.cuh"

namespace flashdmoe {

// Float32 runs the tensor cores in TF32 (mma.sync variant only).
enum class DType : int { BFloat16 = 0, Float16 = 1, Float32 = 2 };

// One rank of the launch: its tokens, experts, outputs, local workspace and the peer table.
struct RankArgs {
  const void* x;   // [T, H]
  const void* w1;  // [L, H, I or 2I]
  const void* w2;  // [L, I, H]
  void* y;         // [T, H]
  int* topk_expert;
  float* topk_weight;
  int* topk_row;
  int* expert_counts;
  void* saved_pre;  // [T*k, I or 2I] GEMM1's pre-activations by packed row, or null (one rank only)
  void* workspace;
  size_t workspace_bytes;
  int tokens;
  int capacity;  // rows kept per expert; >= tokens means dropless
  int rank;
  bool silent;   // debug: publish no signals
  // Symmetric buffers of every rank as this rank addresses them (all null for a single-rank team:
  // its comb region and signal words then come from its workspace).
  void* peer_recv[kMaxRanks];
  void* peer_comb[kMaxRanks];
  uint32_t* peer_signals[kMaxRanks];
};

struct ForwardArgs {
  const void* router;  // [E, H], replicated
  int hidden, ffn, experts, top_k;
  int world_size;   // P; experts / P per rank
  int stream_rows;  // rows per region of recv / comb (max tokens per rank * min(k, L))
  DType dtype;
  Activation activation;
  bool normalize_topk;
  uint32_t sequence;
  uint64_t timeout_ns;
  int debug_withhold_phase;
  int expert_variant;  // tile_config.cuh: 0 TMA-fed wgmma 128x256/4 stages, 1 mma.sync 128x128/3
  int max_blocks;      // 0: the whole resident grid; else at most this many blocks
  bool gate_split;     // small batches split gate tiles over blocks (false: one block per tile)
  int grid_percent;    // 1..100: this share of the resident grid (ranks sharing one GPU under MPS)
  int num_ranks;       // ranks in this launch: P for an emulated team, else 1
  RankArgs ranks[kMaxRanks];
};

struct LaunchInfo {
  int grid;
  int blocks_per_sm;
  int smem_bytes;
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
// Zeroes every rank's sync words and launches the persistent kernel on `stream` (throws std::runtime_error).
LaunchInfo launch_forward(const ForwardArgs& args, cudaStream_t stream);
KernelAttributes kernel_attributes(DType dtype, int expert_variant);

// The expert variants' names in id order (the table in flashdmoe/expert_variants.py, as compiled).
std::vector<std::string> expert_variant_names();

// One (dtype, expert variant) instance, explicitly instantiated in the build folder's generated units.
template <typename Element, typename Variant>
LaunchInfo launch_forward_variant(const ForwardArgs& args, cudaStream_t stream);
template <typename Element, typename Variant>
KernelAttributes kernel_attributes_variant();

}  // namespace flashdmoe
