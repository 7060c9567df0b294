// Launch template of the persistent kernel: grid from the occupancy API, cooperative launch so that a
// grid that cannot be co-resident is refused instead of deadlocking.
#pragma once
#include <algorithm>
#include <type_traits>
#include <mutex>
#include <stdexcept>
#include <vector>
#include <string>
#include <cudaTypedefs.h>
#include "moe/launch.h"
#include "moe/moe_forward.cuh"
#include "moe/tma_boxes.cuh"

namespace flashdmoe {

inline void throw_on_cuda_error(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

struct ResidentGrid {
  int blocks_per_sm;
  int sms;
};

// Occupancy of (kernel, device, shared memory bytes), asked once and remembered: these driver queries
// cost tens of microseconds, too much for every forward.
inline ResidentGrid resident_grid(const void* kernel, int device, int smem_bytes, int block_threads) {
  struct Entry {
    const void* kernel;
    int device, smem_bytes;
    ResidentGrid grid;
  };
  struct Limit {  // the kernel's dynamic shared memory limit: only ever raised, so cached grids stay valid
    const void* kernel;
    int device, smem_bytes;
  };
  static std::mutex mutex;
  static std::vector<Entry> known;
  static std::vector<Limit> limits;
  std::lock_guard<std::mutex> lock(mutex);
  for (const Entry& e : known)
    if (e.kernel == kernel && e.device == device && e.smem_bytes == smem_bytes) return e.grid;
  Limit* limit = nullptr;
  for (Limit& l : limits)
    if (l.kernel == kernel && l.device == device) limit = &l;
  if (limit == nullptr) {
    limits.push_back({kernel, device, 0});
    limit = &limits.back();
  }
  int sms = 0, smem_optin = 0;
  throw_on_cuda_error(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  throw_on_cuda_error(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                      "shared memory limit");
  if (smem_bytes > smem_optin)
    throw std::invalid_argument("the fused kernel needs " + std::to_string(smem_bytes) +
                                " bytes of shared memory per block for these experts/top_k; the GPU allows " +
                                std::to_string(smem_optin));
  if (smem_bytes > limit->smem_bytes) {
    throw_on_cuda_error(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
                        "cudaFuncSetAttribute");
    limit->smem_bytes = smem_bytes;
  }
  int blocks_per_sm = 0;
  throw_on_cuda_error(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, block_threads, smem_bytes),
                      "occupancy query");
  if (blocks_per_sm < 1)
    throw std::runtime_error("the fused kernel cannot be resident on this GPU (0 blocks per SM with " +
                             std::to_string(smem_bytes) + " bytes of shared memory)");
  known.push_back({kernel, device, smem_bytes, {blocks_per_sm, sms}});
  return known.back().grid;
}

// One rank's kernel parameters from its arguments and workspace.
inline MoEParams rank_params(const ForwardArgs& a, const RankArgs& r) {
  const std::string shape_error = check_shapes(r.tokens, a.hidden, a.ffn, a.experts, a.top_k, a.world_size);
  if (!shape_error.empty()) throw std::invalid_argument(shape_error);
  const WorkspaceLayout ws =
      workspace_layout(r.tokens, a.hidden, a.ffn, a.experts, a.top_k, a.dtype, a.world_size, a.stream_rows);
  if (r.workspace_bytes < ws.total_bytes)
    throw std::invalid_argument("rank " + std::to_string(r.rank) + ": workspace holds " +
                                std::to_string(r.workspace_bytes) + " bytes, needs " + std::to_string(ws.total_bytes));
  const int local_experts = a.experts / a.world_size;
  if (static_cast<long long>(r.tokens) * std::min(a.top_k, local_experts) > a.stream_rows)
    throw std::invalid_argument("rank " + std::to_string(r.rank) + ": " + std::to_string(r.tokens) +
                                " tokens do not fit stream_rows=" + std::to_string(a.stream_rows));
  if (r.rank < 0 || r.rank >= a.world_size) throw std::invalid_argument("rank out of range");

  char* base = static_cast<char*>(r.workspace);
  MoEParams p{};
  p.tokens = r.tokens; p.hidden = a.hidden; p.ffn = a.ffn; p.experts = a.experts; p.top_k = a.top_k;
  p.w1_cols = a.activation == Activation::Swiglu ? 2 * a.ffn : a.ffn;
  p.capacity = r.capacity < r.tokens ? r.capacity : r.tokens;
  p.activation = a.activation;
  p.normalize_topk = a.normalize_topk;
  p.rank = r.rank; p.world_size = a.world_size; p.local_experts = local_experts;
  p.stream_rows = a.stream_rows;
  p.sequence = a.sequence;
  p.silent = r.silent;
  for (int q = 0; q < a.world_size; ++q) {
    if (a.world_size == 1) {
      p.peers[q] = {base + ws.own_recv, base + ws.own_comb, reinterpret_cast<uint32_t*>(base + ws.own_signals)};
    } else {
      if (!r.peer_recv[q] || !r.peer_comb[q] || !r.peer_signals[q])
        throw std::invalid_argument("rank " + std::to_string(r.rank) + ": missing buffers of peer " + std::to_string(q));
      p.peers[q] = {r.peer_recv[q], r.peer_comb[q], r.peer_signals[q]};
    }
  }
  p.x = r.x; p.router = a.router; p.w1 = r.w1; p.w2 = r.w2; p.y = r.y;
  p.topk_expert = r.topk_expert; p.topk_weight = r.topk_weight; p.topk_row = r.topk_row;
  p.expert_counts = r.expert_counts;
  p.barrier_counter = reinterpret_cast<uint32_t*>(base + ws.barrier_counter);
  p.task_counter = reinterpret_cast<uint32_t*>(base + ws.task_counter);
  p.error_word = reinterpret_cast<unsigned long long*>(base + ws.error_word);
  p.status_flags = reinterpret_cast<uint32_t*>(base + ws.status_flags);
  p.phase_clock = reinterpret_cast<unsigned long long*>(base + ws.phase_clock);
  p.traffic = reinterpret_cast<unsigned long long*>(base + ws.traffic);
  p.result_rows_done = reinterpret_cast<uint32_t*>(base + ws.result_rows_done);
  p.row_tile_done = reinterpret_cast<uint32_t*>(base + ws.row_tile_done);
  p.slot_in_tile = reinterpret_cast<int*>(base + ws.slot_in_tile);
  p.tile_expert_count = reinterpret_cast<int*>(base + ws.tile_expert_count);
  p.tile_expert_offset = reinterpret_cast<int*>(base + ws.tile_expert_offset);
  p.expert_kept = reinterpret_cast<int*>(base + ws.expert_kept);
  p.intermediate = base + ws.intermediate;
  p.saved_pre = r.saved_pre;
  if (p.saved_pre != nullptr && (a.world_size != 1 || a.num_ranks != 1))
    throw std::invalid_argument("saved_pre: a team's rows are numbered by owner, so only one rank saves pre-activations");
  p.gate_partial = reinterpret_cast<float*>(base + ws.gate_partial);
  p.gate_arrivals = reinterpret_cast<uint32_t*>(base + ws.gate_arrivals);
  p.gate_tiles = ws.gate_tiles;
  p.gate_splits = 1;  // set once the grid is known
  p.max_row_tiles = ws.max_row_tiles;
  p.timeout_ns = a.timeout_ns;
  p.debug_withhold_phase = a.debug_withhold_phase;
  return p;
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (the module does not link libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    throw_on_cuda_error(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found),
                        "cuTensorMapEncodeTiled lookup");
    if (found != cudaDriverEntryPointSuccess || fn == nullptr)
      throw std::runtime_error("the CUDA driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12 and Hopper)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A row-major tensor of box.rank dims (innermost first), 2-byte elements, read in 128-byte-swizzled boxes.
inline CUtensorMap make_tensor_map(const void* base, const uint64_t* dims, const TmaBox& box, DType dtype,
                                   const char* what) {
  CUtensorMap map{};
  const int rank = box.rank;
  uint64_t strides[4];
  uint64_t stride = kTmaElementBytes;
  for (int d = 0; d + 1 < rank; ++d) {
    stride *= dims[d];
    strides[d] = stride;
  }
  const uint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult status = tensor_map_encoder()(
      &map, dtype == DType::BFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, rank,
      const_cast<void*>(base), dims, strides, box.dims, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS)
    throw std::runtime_error(std::string("cuTensorMapEncodeTiled failed for ") + what + " (CUresult " +
                             std::to_string(static_cast<int>(status)) + ")");
  return map;
}

// row_box: the variant's A row box (expert_row_box(Variant::kRowBoxRows)).
inline void make_expert_tensor_maps(const ForwardArgs& a, MoEParams& p, const TmaBox& row_box) {
  const uint64_t L = p.local_experts, H = p.hidden, I = p.ffn, cols = p.w1_cols;
  // Rows of the receive and the intermediate buffer: every row this rank's experts can take.
  const uint64_t rows_in = p.world_size == 1 ? static_cast<uint64_t>(p.tokens) * p.top_k
                                             : static_cast<uint64_t>(p.world_size) * p.stream_rows;
  const uint64_t w1_dims[3] = {cols, H, L}, w2_dims[3] = {H, I, L};
  const uint64_t recv_dims[2] = {H, rows_in > 0 ? rows_in : 1};
  const uint64_t mid_dims[2] = {I, rows_in > 0 ? rows_in : 1};
  p.maps.w1 = make_tensor_map(p.w1, w1_dims, kWeightPanelBox, a.dtype, "w1");
  p.maps.w2 = make_tensor_map(p.w2, w2_dims, kWeightPanelBox, a.dtype, "w2");
  p.maps.recv = make_tensor_map(p.peers[p.rank].recv, recv_dims, row_box, a.dtype, "the receive buffer");
  p.maps.intermediate = make_tensor_map(p.intermediate, mid_dims, row_box, a.dtype, "the intermediate buffer");
  // With no tokens the map is never read; it still needs a valid base.
  const uint64_t x_dims[2] = {H, p.tokens > 0 ? static_cast<uint64_t>(p.tokens) : 1};
  // The router box holds only the experts there are (E < 128 would otherwise load zero-filled rows).
  const uint64_t router_dims[2] = {H, static_cast<uint64_t>(p.experts)};
  p.maps.gate_x = make_tensor_map(p.tokens > 0 ? p.x : p.intermediate, x_dims, kGateTokenBox, a.dtype, "x (gate)");
  p.maps.router = make_tensor_map(p.router, router_dims, gate_router_box(p.experts), a.dtype, "the router");
}

template <typename Element, typename Variant>
LaunchInfo launch_forward_variant(const ForwardArgs& a, cudaStream_t stream) {
  if (a.num_ranks < 1 || a.num_ranks > kMaxRanks || a.num_ranks > a.world_size)
    throw std::invalid_argument("num_ranks=" + std::to_string(a.num_ranks) + " must be in [1, min(world_size, " +
                                std::to_string(kMaxRanks) + ")]");
  LaunchParams launch{};
  launch.ranks = a.num_ranks;
  for (int i = 0; i < a.num_ranks; ++i) {
    launch.rank[i] = rank_params(a, a.ranks[i]);
    if constexpr (Variant::kUseTma) make_expert_tensor_maps(a, launch.rank[i], expert_row_box(Variant::kRowBoxRows));
  }

  const SmemLayout smem = make_smem_layout(a.experts, a.top_k, expert_scratch_bytes<Variant>(), a.world_size);
  // Forwards that save pre-activations for the backward run the variant's training instance (16-bit
  // inputs only: float32's TF32 pre-activations would fall short of its backward's accuracy).
  auto kernel = moe_forward_kernel<Element, Variant>;
  if (a.ranks[0].saved_pre != nullptr) {
    if constexpr (std::is_same_v<Element, float>)
      throw std::invalid_argument("saved_pre: float32 (TF32) forwards do not save pre-activations");
    else
      kernel = moe_forward_kernel<Element, SavingPre<Variant>>;
  }
  int device = 0;
  throw_on_cuda_error(cudaGetDevice(&device), "cudaGetDevice");
  const ResidentGrid resident =
      resident_grid(reinterpret_cast<const void*>(kernel), device, smem.total_bytes, Variant::kBlockThreads);
  int grid = resident.blocks_per_sm * resident.sms;
  if (a.grid_percent > 0 && a.grid_percent < 100) grid = std::max(1, grid * a.grid_percent / 100);
  if (a.max_blocks > 0 && a.max_blocks < grid) grid = a.max_blocks;
  const int blocks_per_rank = grid / a.num_ranks;
  if (blocks_per_rank < 1)
    throw std::invalid_argument("a grid of " + std::to_string(grid) + " blocks cannot hold " +
                                std::to_string(a.num_ranks) + " ranks");
  grid = blocks_per_rank * a.num_ranks;
  for (int i = 0; i < a.num_ranks; ++i) {
    launch.rank[i].first_block = i * blocks_per_rank;
    launch.rank[i].blocks = blocks_per_rank;
    launch.rank[i].gate_splits =
        a.gate_split ? gate_splits_for(launch.rank[i].tokens, launch.rank[i].gate_tiles, a.hidden, a.experts,
                                       blocks_per_rank)
                     : 1;
  }

  for (int i = 0; i < a.num_ranks; ++i) {
    const RankArgs& r = a.ranks[i];
    const WorkspaceLayout ws =
        workspace_layout(r.tokens, a.hidden, a.ffn, a.experts, a.top_k, a.dtype, a.world_size, a.stream_rows);
    throw_on_cuda_error(cudaMemsetAsync(r.workspace, 0, ws.sync_bytes, stream), "zeroing sync words");
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(Variant::kBlockThreads);
  config.dynamicSmemBytes = smem.total_bytes;
  config.stream = stream;
  cudaLaunchAttribute cooperative{};
  cooperative.id = cudaLaunchAttributeCooperative;  // refused if the grid cannot be co-resident
  cooperative.val.cooperative = 1;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  throw_on_cuda_error(cudaLaunchKernelEx(&config, kernel, launch), "launching moe_forward_kernel");
  return {grid, resident.blocks_per_sm, smem.total_bytes};
}

template <typename Element, typename Variant>
KernelAttributes kernel_attributes_variant() {
  cudaFuncAttributes attr{};
  throw_on_cuda_error(cudaFuncGetAttributes(&attr, moe_forward_kernel<Element, Variant>), "cudaFuncGetAttributes");
  return {attr.numRegs, static_cast<int>(attr.localSizeBytes), attr.maxThreadsPerBlock,
          static_cast<int>(attr.sharedSizeBytes)};
}

}  // namespace flashdmoe
