// Dynamic shared memory of the persistent kernel: one scratch area reused by every phase, the routing
// tables that live from dispatch to the end, and the per-row source pointers of the current tile.
#pragma once
#include "moe/tile_config.cuh"

namespace flashdmoe {

struct SmemLayout {
  int scratch_bytes;
  int tables_offset;    // seg_start[E+1], tile_start[E+1], kept[E] (int32)
  int row_ptrs_offset;  // A-row pointers [kExpertTileM], gate B-row pointers [kGateTileN]
  int total_bytes;
};

__host__ __device__ inline int round_up16(int v) { return (v + 15) / 16 * 16; }

__host__ __device__ inline int gate_logits_stride(int experts) { return experts + 4; }

// expert_scratch_bytes: the variant's pipeline or epilogue staging, whichever is larger.
__host__ __device__ inline SmemLayout make_smem_layout(int experts, int top_k, int expert_scratch_bytes) {
  const int gate = kGatePipelineBytes + round_up16(kGateTileM * gate_logits_stride(experts) * 4) +
                   round_up16(kGateTileM * top_k * 4) * 2;
  int scratch = expert_scratch_bytes;
  if (gate > scratch) scratch = gate;
  SmemLayout l{};
  l.scratch_bytes = round_up16(scratch);
  l.tables_offset = l.scratch_bytes;
  l.row_ptrs_offset = l.tables_offset + round_up16((3 * experts + 2) * 4);
  l.total_bytes = l.row_ptrs_offset + (kExpertTileM + kGateTileN) * 8 + 1024;  // + alignment slack
  return l;
}

}  // namespace flashdmoe
