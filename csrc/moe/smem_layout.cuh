// Dynamic shared memory of the persistent kernel: one scratch area reused by every phase, the routing
// tables that live from dispatch to the end, and the per-row source pointers of the current tile.
#pragma once
#include "moe/tile_config.cuh"

namespace flashdmoe {

struct SmemLayout {
  int scratch_bytes;
  int tables_offset;    // destination tables (routing.cuh DestTables): P*(L+1) + 2*(E+1) int32
  int row_ptrs_offset;  // A-row pointers [kExpertTileM], then gate B-row / expert output-row pointers [128]
  int total_bytes;
};

__host__ __device__ inline int round_up16(int v) { return (v + 15) / 16 * 16; }

__host__ __device__ inline int gate_logits_stride(int experts) { return experts + 4; }

// expert_scratch_bytes: the variant's pipeline and its epilogue staging (tile_config.cuh kScratchBytes).
__host__ __device__ inline SmemLayout make_smem_layout(int experts, int top_k, int expert_scratch_bytes,
                                                       int world_size) {
  const int gate = gate_pipeline_bytes(gate_stages(experts)) + round_up16(kGateTileM * gate_logits_stride(experts) * 4) +
                   round_up16(kGateTileM * top_k * 4) * 2;
  int scratch = expert_scratch_bytes;
  if (gate > scratch) scratch = gate;
  if (experts * 4 > scratch) scratch = experts * 4;  // the source-side stream offsets during dispatch
  const int local_experts = experts / world_size;
  SmemLayout l{};
  l.scratch_bytes = round_up16(scratch);
  l.tables_offset = l.scratch_bytes;
  // DestTables (routing.cuh): stream_start [P][L+1], seg_start and tile_start [P*L+1] each.
  l.row_ptrs_offset = l.tables_offset + round_up16((world_size * (local_experts + 1) + 2 * (experts + 1)) * 4);
  l.total_bytes = l.row_ptrs_offset + (kExpertTileM + kGateTileN) * 8 + 1024;  // + alignment slack
  return l;
}

}  // namespace flashdmoe
