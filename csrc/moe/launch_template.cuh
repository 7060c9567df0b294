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
#include "common/host_launch.h"
#include "moe/launch.h"
#include "moe/moe_forward.cuh"
#include "moe/tma_boxes.cuh"

namespace flashdmoe {

// A rank's per-call addresses into its prepared parameters: inputs, outputs and the workspace pieces
// (offsets in the prepared layout).
inline void bind_addresses(const PreparedRank& prepared, const void* router, const uintptr_t* address,
                           uint32_t sequence, void* status_host, MoEParams& p) {
  const WorkspaceLayout& ws = prepared.layout;
  char* base = reinterpret_cast<char*>(address[kAddrWorkspace]);
  // The sync words (offsets below ws.sync_bytes) where the caller put them: in the workspace or apart.
  char* sync = address[kAddrSyncWords] != 0 ? reinterpret_cast<char*>(address[kAddrSyncWords]) : base;
  p.sequence = sequence;
  if (p.world_size == 1)
    p.peers[0] = {base + ws.own_recv, base + ws.own_comb, reinterpret_cast<uint32_t*>(base + ws.own_signals)};
  p.x = reinterpret_cast<const void*>(address[kAddrX]);
  p.router = router;
  p.w1 = reinterpret_cast<const void*>(address[kAddrW1]);
  p.w2 = reinterpret_cast<const void*>(address[kAddrW2]);
  p.y = reinterpret_cast<void*>(address[kAddrY]);
  p.topk_expert = reinterpret_cast<int*>(address[kAddrTopkExpert]);
  p.topk_weight = reinterpret_cast<float*>(address[kAddrTopkWeight]);
  p.topk_row = reinterpret_cast<int*>(address[kAddrTopkRow]);
  p.expert_counts = reinterpret_cast<int*>(address[kAddrExpertCounts]);
  p.saved_pre = reinterpret_cast<void*>(address[kAddrSavedPre]);
  p.barrier_counter = reinterpret_cast<uint32_t*>(sync + ws.barrier_counter);
  p.task_counter = reinterpret_cast<uint32_t*>(sync + ws.task_counter);
  p.error_word = reinterpret_cast<unsigned long long*>(sync + ws.error_word);
  p.status_flags = reinterpret_cast<uint32_t*>(sync + ws.status_flags);
  p.phase_clock = reinterpret_cast<unsigned long long*>(sync + ws.phase_clock);
  p.traffic = reinterpret_cast<unsigned long long*>(sync + ws.traffic);
  p.result_rows_done = reinterpret_cast<uint32_t*>(sync + ws.result_rows_done);
  p.row_tile_done = reinterpret_cast<uint32_t*>(sync + ws.row_tile_done);
  p.slot_in_tile = reinterpret_cast<int*>(base + ws.slot_in_tile);
  p.tile_expert_count = reinterpret_cast<int*>(base + ws.tile_expert_count);
  p.tile_expert_offset = reinterpret_cast<int*>(base + ws.tile_expert_offset);
  p.expert_kept = reinterpret_cast<int*>(base + ws.expert_kept);
  p.intermediate = base + ws.intermediate;
  p.gate_partial = reinterpret_cast<float*>(base + ws.gate_partial);
  p.gate_arrivals = reinterpret_cast<uint32_t*>(sync + ws.gate_arrivals);
  p.exit_counter = reinterpret_cast<uint32_t*>(sync + ws.exit_counter);
  p.sync_words = reinterpret_cast<uint32_t*>(sync);
  p.sync_words_count = static_cast<int>(ws.sync_bytes / 4);
  p.status_host = status_host;
}

// The rank's TMA descriptors for the addresses `p` holds, re-encoding only the maps whose base moved
// since the rank's last launch (`prepared.params.maps` is the cache; the caller holds its mutex). Every
// dim is fixed by the plan, so a map's base is its only per-call input. row_box: the variant's A row box
// (expert_row_box(Variant::kRowBoxRows)).
inline void refresh_expert_tensor_maps(const ForwardArgs& a, PreparedRank& prepared, const MoEParams& p,
                                       const TmaBox& row_box) {
  const uint64_t L = p.local_experts, H = p.hidden, I = p.ffn, cols = p.w1_cols;
  // Rows of the receive and the intermediate buffer: every row this rank's experts can take.
  const uint64_t rows_in = p.world_size == 1 ? static_cast<uint64_t>(p.tokens) * p.top_k
                                             : static_cast<uint64_t>(p.world_size) * p.stream_rows;
  ExpertTensorMaps& maps = prepared.params.maps;
  auto refresh = [&](int which, const void* base, CUtensorMap& map, const uint64_t* dims, const TmaBox& box,
                     const char* what) {
    if (prepared.map_base[which] == base) return;
    map = make_tensor_map(base, dims, box, a.dtype, what);
    prepared.map_base[which] = base;
  };
  const uint64_t w1_dims[3] = {cols, H, L}, w2_dims[3] = {H, I, L};
  const uint64_t recv_dims[2] = {H, rows_in > 0 ? rows_in : 1};
  const uint64_t mid_dims[2] = {I, rows_in > 0 ? rows_in : 1};
  // With no tokens the map is never read; it still needs a valid base.
  const uint64_t x_dims[2] = {H, p.tokens > 0 ? static_cast<uint64_t>(p.tokens) : 1};
  // The router box holds only the experts there are (E < 128 would otherwise load zero-filled rows).
  const uint64_t router_dims[2] = {H, static_cast<uint64_t>(p.experts)};
  refresh(PreparedRank::kMapW1, p.w1, maps.w1, w1_dims, kWeightPanelBox, "w1");
  refresh(PreparedRank::kMapW2, p.w2, maps.w2, w2_dims, kWeightPanelBox, "w2");
  refresh(PreparedRank::kMapRecv, p.peers[p.rank].recv, maps.recv, recv_dims, row_box, "the receive buffer");
  refresh(PreparedRank::kMapIntermediate, p.intermediate, maps.intermediate, mid_dims, row_box,
          "the intermediate buffer");
  if (loads_full_tile_box(static_cast<int>(row_box.dims[1]))) {
    refresh(PreparedRank::kMapRecvFull, p.peers[p.rank].recv, maps.recv_full, recv_dims, expert_row_box(kExpertTileM),
            "the receive buffer");
    refresh(PreparedRank::kMapIntermediateFull, p.intermediate, maps.intermediate_full, mid_dims,
            expert_row_box(kExpertTileM), "the intermediate buffer");
  }
  refresh(PreparedRank::kMapGateX, p.tokens > 0 ? p.x : p.intermediate, maps.gate_x, x_dims, kGateTokenBox,
          "x (gate)");
  refresh(PreparedRank::kMapRouter, p.router, maps.router, router_dims, gate_router_box(p.experts), "the router");
}

template <typename Element, typename Variant, int kRankCapacity>
LaunchInfo launch_forward_variant(PreparedLaunch& prepared, const uintptr_t* addresses, uint32_t sequence,
                                  void* status_host, cudaStream_t stream) {
  const ForwardArgs& a = prepared.args;
  if (a.num_ranks > kRankCapacity)
    throw std::invalid_argument("a launch of " + std::to_string(a.num_ranks) + " ranks on a kernel instance for " +
                                std::to_string(kRankCapacity));
  // Forwards that save pre-activations for the backward run the variant's training instance (16-bit
  // inputs, one rank only: float32's TF32 pre-activations would fall short of its backward's accuracy,
  // and a team's rows are numbered by owner).
  auto kernel = moe_forward_kernel<Element, Variant, kRankCapacity>;
  if (addresses[1 + kAddrSavedPre] != 0) {
    if constexpr (std::is_same_v<Element, float>)
      throw std::invalid_argument("saved_pre: float32 (TF32) forwards do not save pre-activations");
    else if constexpr (kRankCapacity != 1)
      throw std::invalid_argument("saved_pre: a team's rows are numbered by owner, so only one rank saves pre-activations");
    else if (a.world_size != 1)
      throw std::invalid_argument("saved_pre: a team's rows are numbered by owner, so only one rank saves pre-activations");
    else
      kernel = moe_forward_kernel<Element, SavingPre<Variant>, kRankCapacity>;
  }
  int device = 0;
  throw_on_cuda_error(cudaGetDevice(&device), "cudaGetDevice");
  const void* router = reinterpret_cast<const void*>(addresses[0]);

  LaunchParams<kRankCapacity> launch;
  launch.ranks = a.num_ranks;
  LaunchInfo info;
  {
    std::lock_guard<std::mutex> lock(prepared.mutex);
    GridChoice& choice = prepared.grid;
    if (choice.kernel != reinterpret_cast<const void*>(kernel) || choice.device != device) {
      const SmemLayout smem = make_smem_layout(a.experts, a.top_k, expert_scratch_bytes<Variant>(), a.world_size);
      const ResidentGrid resident =
          resident_grid(reinterpret_cast<const void*>(kernel), device, smem.total_bytes, Variant::kBlockThreads);
      // A cluster variant's blocks come in clusters, never split between two ranks.
      constexpr int kCluster = Variant::kClusterBlocks;
      int grid = resident.blocks_per_sm * resident.sms;
      if constexpr (kCluster > 1)
        grid = resident_cluster_blocks(reinterpret_cast<const void*>(kernel), grid, Variant::kBlockThreads,
                                       smem.total_bytes, kCluster);
      if (a.grid_percent > 0 && a.grid_percent < 100) grid = std::max(kCluster, grid * a.grid_percent / 100);
      if (a.max_blocks > 0 && a.max_blocks < grid) grid = a.max_blocks;
      const int blocks_per_rank = grid / a.num_ranks / kCluster * kCluster;
      if (blocks_per_rank < 1)
        throw std::invalid_argument("a grid of " + std::to_string(grid) + " blocks cannot hold " +
                                    std::to_string(a.num_ranks) + " ranks" +
                                    (kCluster > 1 ? " in clusters of " + std::to_string(kCluster) + " blocks" : ""));
      for (int i = 0; i < a.num_ranks; ++i) {
        MoEParams& p = prepared.ranks[i].params;
        p.first_block = i * blocks_per_rank;
        p.blocks = blocks_per_rank;
        p.gate_splits =
            a.gate_split ? gate_splits_for(p.tokens, p.gate_tiles, a.hidden, a.experts, blocks_per_rank) : 1;
      }
      choice = {reinterpret_cast<const void*>(kernel), device,
                {blocks_per_rank * a.num_ranks, resident.blocks_per_sm, smem.total_bytes}};
    }
    info = choice.info;
    for (int i = 0; i < a.num_ranks; ++i) {
      PreparedRank& rank = prepared.ranks[i];
      MoEParams& p = launch.rank[i];
      p = rank.params;
      void* rank_status = status_host == nullptr ? nullptr : static_cast<char*>(status_host) + kStatusBytes * i;
      bind_addresses(rank, router, addresses + 1 + kAddressesPerRank * i, sequence, rank_status, p);
      if constexpr (Variant::kUseTma) {
        refresh_expert_tensor_maps(a, rank, p, expert_row_box(Variant::kRowBoxRows));
        p.maps = rank.params.maps;
      }
    }
  }

  // No memset: the sync words are zero (the previous launch's exit reset them, finish_launch).
  launch_cooperative(kernel, info.grid, Variant::kBlockThreads, info.smem_bytes, stream, launch,
                     "launching moe_forward_kernel", Variant::kClusterBlocks);
  return info;
}

template <typename Element, typename Variant>
KernelAttributes kernel_attributes_variant() {
  cudaFuncAttributes attr{};
  throw_on_cuda_error(cudaFuncGetAttributes(&attr, moe_forward_kernel<Element, Variant, 1>), "cudaFuncGetAttributes");
  return {attr.numRegs, static_cast<int>(attr.localSizeBytes), attr.maxThreadsPerBlock,
          static_cast<int>(attr.sharedSizeBytes)};
}

}  // namespace flashdmoe
