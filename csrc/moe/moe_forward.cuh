// The persistent forward kernel: one launch runs gate -> routing -> dispatch -> expert FFN -> combine.
// All blocks are co-resident (cooperative launch), phases meet at bounded grid barriers, and expert
// GEMM2 tiles follow their GEMM1 row tiles through per-tile counters instead of a barrier.
#pragma once
#include "moe/combine.cuh"
#include "moe/gate.cuh"

namespace flashdmoe {

// Block 0 stamps the phase boundaries (one store per phase) for the per-phase breakdown.
__device__ __forceinline__ void stamp_phase(const MoEParams& p, int slot) {
  if (blockIdx.x == 0 && threadIdx.x == 0) p.phase_clock[slot] = ptx::global_timer_ns();
}

template <typename Element, typename Variant>
__global__ void __launch_bounds__(kThreads, Variant::kMinBlocksPerSm)
    moe_forward_kernel(const __grid_constant__ MoEParams p) {
  extern __shared__ __align__(16) char raw_smem[];
  // wgmma's 128-byte swizzle is computed from absolute shared addresses: align the base to its atom.
  char* smem = raw_smem + ((1024u - (ptx::smem_addr(raw_smem) & 1023u)) & 1023u);
  const SmemLayout layout = make_smem_layout(p.experts, p.top_k, expert_scratch_bytes<Variant>());
  stamp_phase(p, 0);

  // ---- 1. gate: logits, softmax, top-k, per-tile counts ----
  for (int tile = blockIdx.x; tile < p.gate_tiles; tile += gridDim.x) gate_tile<Element>(p, tile, smem, layout);
  if (!grid_barrier(p, kPhaseGateDone, 1)) return;
  stamp_phase(p, 1);

  // ---- 2. per-expert offsets over gate tiles (capacity in token order) ----
  scan_tile_counts(p);
  if (!grid_barrier(p, kPhaseOffsetsDone, 2)) return;
  stamp_phase(p, 2);

  // ---- 3. dispatch: every kept choice gets its row in the expert's segment ----
  const RoutingTables tables = routing_tables(smem, layout, p.experts);
  build_routing_tables(p, tables);
  assign_rows(p, tables);
  if (!grid_barrier(p, kPhaseDispatchDone, 3)) return;
  stamp_phase(p, 3);

  // ---- 4. expert FFN tiles from the task queue ----
  const Element** a_rows = reinterpret_cast<const Element**>(smem + layout.row_ptrs_offset);
  if (!run_expert_tasks<Element, Variant>(p, tables, smem, a_rows)) return;
  if (!grid_barrier(p, kPhaseExpertsDone, 4)) return;
  stamp_phase(p, 4);

  // ---- 5. combine ----
  combine_tokens<Element>(p);
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(p.phase_clock + kPhaseClockSlots - 1, ptx::global_timer_ns());
}

}  // namespace flashdmoe
