// The persistent forward kernel: one launch runs gate -> counts -> dispatch -> expert FFN -> combine
// for every rank it holds (one, or P virtual ranks of an emulated team side by side). A rank's blocks
// meet at bounded barriers; ranks meet only through signal words (counts, rows ready, results done)
// that carry this forward's sequence number, so the same code runs across processes and GPUs.
#pragma once
#include <type_traits>
#include "moe/combine.cuh"
#include "moe/expert_pipeline.cuh"
#include "moe/gate.cuh"

namespace flashdmoe {

// Rank-block 0 stamps the phase boundaries (one store per phase) for the per-phase breakdown.
__device__ __forceinline__ void stamp_phase(const MoEParams& p, int slot) {
  if (block_in_rank(p) == 0 && threadIdx.x == 0) p.phase_clock[slot] = ptx::global_timer_ns();
}

// One rank's forward in one block. A failure (the watchdog) returns early, block-uniformly; the TMA
// variant's producer warp also leaves before the combine.
template <typename Element, typename Variant>
__device__ __forceinline__ void forward_block(const MoEParams& p, char* smem) {
  const SmemLayout layout = make_smem_layout(p.experts, p.top_k, expert_scratch_bytes<Variant>(), p.world_size);
  // Worker threads run every phase; the TMA variant's producer warp joins only the gate and the expert GEMMs.
  const bool worker = threadIdx.x < kThreads;
  using Transport = peer_transport_t<Variant>;  // how counts, rows and results are published to peers
  stamp_phase(p, 0);

  // ---- 1. gate: logits, softmax, top-k, per-tile counts (a decode batch on one rank: routed too) ----
  const bool finished_tile = gate_tiles<Element, Variant::kUseTma>(p, smem, layout);
  const bool routed = Transport::kRoutesInGate && routes_in_gate(p);
  // Only after a clean gate: a stage wait that gave up may leave TMA writes landing over the routed tile.
  if (routed && finished_tile && worker && sync_workers_and(ptx::load_relaxed_u64(p.error_word) == 0))
    route_gate_tile<Element>(p, smem);
  if (!grid_barrier(p, kPhaseGateDone, 1)) return;
  stamp_phase(p, 1);

  if (!routed) {
    // ---- 2. per-expert offsets over gate tiles (capacity in token order); counts to the owners ----
    if (worker) scan_tile_counts(p);
    if (!grid_barrier(p, kPhaseOffsetsDone, 2)) return;
    if (worker) Transport::template publish_counts<Element>(p);
    stamp_phase(p, 2);

    // ---- 3. dispatch: rows into the owners' receive buffers ----
    if (worker) {
      int* stream_offset = reinterpret_cast<int*>(smem);  // [E], in the scratch area (free until the experts)
      build_stream_offsets(p, stream_offset);
      dispatch_rows<Element, Transport::kRelays>(p, stream_offset);
    }
    if (!grid_barrier(p, kPhaseDispatchDone, 3)) return;
  } else {
    stamp_phase(p, 2);
  }
  // The grid barriers' ordinals (the n-th of a rank waits for n * blocks arrivals) from here on: the
  // routed gate ran one barrier where the offsets and the dispatch run three; then the transport's.
  const uint32_t rows_ordinal = routed ? 2 : 4;
  if (!Transport::template publish_rows_ready<Element>(p, rows_ordinal)) return;
  stamp_phase(p, 3);

  // ---- 4. expert FFN tiles from the task queue, rows from every source ----
  const DestTables tables = dest_tables(smem, layout, p);
  if (!build_dest_tables(p, tables, /*pair_tiles=*/Variant::kClusterBlocks == 2)) return;
  Transport::template publish_empty_results<Element>(p, tables);
  const Element** a_rows = reinterpret_cast<const Element**>(smem + layout.row_ptrs_offset);
  if constexpr (Variant::kUseTma) {
    if (!run_expert_tasks_prefetch<Element, Variant>(p, tables, smem)) return;
  } else {
    if (!run_expert_tasks<Element, Variant>(p, tables, smem, a_rows)) return;
  }
  const uint32_t experts_ordinal = (Transport::kRoutesInGate && routes_in_gate(p) ? 2 : 4) + Transport::rows_barriers(p);
  if (!grid_barrier(p, kPhaseExpertsDone, experts_ordinal)) return;
  if (!Transport::template publish_results<Element>(p, experts_ordinal + 1)) return;
  stamp_phase(p, 4);

  // ---- 5. combine, once every peer returned its results ----
  if (!worker) return;
  if (!wait_for_results(p)) return;
  combine_tokens<Element>(p, smem, layout.scratch_bytes);
  sync_workers();
  if (threadIdx.x == 0) atomicMax(p.phase_clock + kPhaseClockSlots - 1, ptx::global_timer_ns());
}

// This block's forward number (block_sequence): the host's, or for a team rank its device count + 1,
// which every block of the rank reads before the rank's last block stores it back (end_forward): stream
// order then hands it to the next launch, eager or a graph's replay. False, with the error word set, when
// the rank must run nothing: its count is used up (every rank of the team stops at the same forward), or
// an earlier forward of the rank failed (TeamRankWords::failed).
__device__ __forceinline__ bool begin_forward(const MoEParams& p) {
  __shared__ bool run;
  if (threadIdx.x == 0) {
    uint32_t sequence = p.sequence, failed = 0;
    if (p.team_words != nullptr) {
      const volatile TeamRankWords* words = p.team_words;
      sequence = words->forwards + 1u;
      failed = words->failed;
    }
    run = failed == 0 && sequence < (1u << 31);
    if (failed != 0)
      atomicCAS(p.error_word, 0ull, static_cast<unsigned long long>(kErrorTeamFailed) |
                                        (static_cast<unsigned long long>(failed) << 32));
    else if (!run)
      atomicCAS(p.error_word, 0ull, static_cast<unsigned long long>(kErrorSequence));
    block_sequence() = sequence;
  }
  __syncthreads();
  return run;
}
// The rank's last block, every other block counted out: store the count back, and mark the rank failed
// if this forward failed (the error word is still this launch's: finish_launch resets it afterwards).
__device__ __forceinline__ void end_forward(const MoEParams& p) {
  volatile TeamRankWords* words = p.team_words;
  if (words == nullptr) return;
  const uint32_t sequence = block_sequence();
  if (sequence < (1u << 31)) words->forwards = sequence;
  if (*reinterpret_cast<volatile const unsigned long long*>(p.error_word) != 0 && words->failed == 0)
    words->failed = sequence;
}

template <typename Element, typename Variant, int kRankCapacity>
__global__ void __launch_bounds__(Variant::kBlockThreads, Variant::kMinBlocksPerSm)
    moe_forward_kernel(const __grid_constant__ LaunchParams<kRankCapacity> launch) {
  static_assert(!std::is_same_v<Element, float> || Variant::kMmaFamily == ExpertMma::MmaSync,
                "fp32 inputs (TF32) run on the mma.sync tiles only: wgmma's TF32 form needs K-major weights");
  extern __shared__ __align__(16) char raw_smem[];
  // wgmma's 128-byte swizzle is computed from absolute shared addresses: align the base to its atom.
  char* smem = raw_smem + ((1024u - (ptx::smem_addr(raw_smem) & 1023u)) & 1023u);
  const MoEParams& p = kRankCapacity == 1 ? launch.rank[0] : launch.rank[blockIdx.x / launch.rank[0].blocks];
  cluster_start<Variant>();
  if (begin_forward(p)) forward_block<Element, Variant>(p, smem);
  // Every early return above lands here: the exit count and the reset must see every block.
  finish_launch(p, [&p] { end_forward(p); });
  cluster_end<Variant>();
}

}  // namespace flashdmoe
