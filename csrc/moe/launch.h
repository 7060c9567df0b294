// Host-side entry points of the fused forward: shape checks, workspace layout and the cooperative
// launch. Plain C++ (no kernels) so the pybind11 module can include it.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>
#include <string>
#include "moe/params.cuh"

namespace flashdmoe {

enum class DType : int { BFloat16 = 0, Float16 = 1 };

struct ForwardArgs {
  const void* x;
  const void* router;
  const void* w1;
  const void* w2;
  void* y;
  int* topk_expert;
  float* topk_weight;
  int* topk_row;
  int* expert_counts;
  void* workspace;
  size_t workspace_bytes;
  int tokens, hidden, ffn, experts, top_k;
  DType dtype;
  Activation activation;
  bool normalize_topk;
  int capacity;  // rows kept per expert; >= tokens means dropless
  uint64_t timeout_ns;
  int debug_withhold_phase;
  int expert_variant;  // tile_config.cuh: 0 wgmma 128x128/3 stages, 1 wgmma 128x128/4, 2 wgmma 128x256/4, 3 mma.sync 128x128/3
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
std::string check_shapes(int tokens, int hidden, int ffn, int experts, int top_k);
WorkspaceLayout workspace_layout(int tokens, int hidden, int ffn, int experts, int top_k, DType dtype);
// Zeroes the sync words and launches the persistent kernel on `stream` (throws std::runtime_error).
LaunchInfo launch_forward(const ForwardArgs& args, cudaStream_t stream);
KernelAttributes kernel_attributes(DType dtype, int expert_variant);

template <typename Element>
LaunchInfo launch_forward_typed(const ForwardArgs& args, cudaStream_t stream);
template <typename Element>
KernelAttributes kernel_attributes_typed(int expert_variant);

}  // namespace flashdmoe
