// Block tile GEMM fed by TMA, warp-specialised: a producer warp (the block's threads past the kThreads
// workers; lane 0 issues) loads each 64-deep K slab of A (128 contiguous rows) and B (64-column panels)
// into one of STAGES shared-memory stages and arms the stage's "full" mbarrier with the byte count;
// the two consumer warpgroups (the workers) wait on it, run wgmma, and release the stage on its
// "empty" mbarrier. No block-wide barrier inside the K loop, so loads run up to STAGES slabs ahead.
// Stage layouts are exactly WgmmaTileGemm's (TMA's 128-byte swizzle is wgmma's).
#pragma once
#include "common/sync.cuh"
#include "common/tma.cuh"
#include "moe/tile_gemm_wgmma.cuh"

namespace flashdmoe {

template <int STAGES>
struct TmaPipelineBarriers {
  uint64_t full[STAGES];
  uint64_t empty[STAGES];
};

// Bounded mbarrier wait (the watchdog covers the pipeline too).
__device__ __forceinline__ bool wait_pipeline(uint32_t bar, uint32_t parity, const MoEParams& p) {
  if (tma::try_wait_parity(bar, parity)) return true;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (tma::try_wait_parity(bar, parity)) return true;
    if ((spin & 15) == 0) {
      if (ptx::load_relaxed_u64(p.error_word) != 0) return false;
      if (ptx::global_timer_ns() - start > p.timeout_ns) {
        report_timeout(p, kPhaseTilePipeline, p.rank);
        return false;
      }
    }
  }
}

template <typename Element, int BN, int STAGES>
struct TmaTileGemm : WgmmaTileGemm<Element, BN, STAGES> {
  using Base = WgmmaTileGemm<Element, BN, STAGES>;
  using Barriers = TmaPipelineBarriers<STAGES>;
  static constexpr int kStageBytesA = Base::kStageBytesA;
  static constexpr int kStageBytesB = Base::kStageBytesB;
  static constexpr int kPanelBytes = Base::kPanelBytes;
  static constexpr int kPanels = Base::kPanels;

  __device__ static uint32_t a_stage(uint32_t base, int s) { return base + s * kStageBytesA; }
  __device__ static uint32_t b_stage(uint32_t base, int s) { return base + STAGES * kStageBytesA + s * kStageBytesB; }

  // Thread 0 of the block, once per launch, before any use (followed by a block-wide barrier).
  __device__ static void init_barriers(Barriers& bars) {
    for (int s = 0; s < STAGES; ++s) {
      tma::mbarrier_init(ptx::smem_addr(&bars.full[s]), 1);               // the producer's arrive + bytes
      tma::mbarrier_init(ptx::smem_addr(&bars.empty[s]), kThreads / 32);  // one arrive per consumer warp
    }
    tma::fence_barrier_init();
  }

  // Producer lane: slab `slab + kt` goes to stage (slab + kt) % STAGES once the consumers released that
  // stage's previous use. load(a_dst, b_dst, k0, bar) issues the slab's TMA loads. `slab` counts the
  // block's slabs across tiles, identically in every thread.
  template <typename Load>
  __device__ static bool produce(char* smem, Barriers& bars, uint32_t slab, int k_tiles, const MoEParams& p,
                                 Load&& load) {
    const uint32_t base = ptx::smem_addr(smem);
    for (int kt = 0; kt < k_tiles; ++kt) {
      const uint32_t it = slab + kt, s = it % STAGES, use = it / STAGES;
      if (use > 0 && !wait_pipeline(ptx::smem_addr(&bars.empty[s]), (use - 1) & 1, p)) return false;
      const uint32_t full = ptx::smem_addr(&bars.full[s]);
      tma::arrive_expect_tx(full, kStageBytesA + kStageBytesB);
      load(a_stage(base, s), b_stage(base, s), kt * Base::kBlockK, full);
    }
    return true;
  }

  // The whole producer warp: like produce(), but A is `rows` single rows of `rows_map` (row_of[i] is the
  // tensor row of tile row lane + 32 i), each a one-row TMA box into its 128-byte row of the stage (the
  // 128-byte swizzle follows the shared-memory address). Tile rows past `rows` keep stale data; their
  // results are never stored.
  template <typename LoadB>
  __device__ static bool produce_gathered(char* smem, Barriers& bars, uint32_t slab, int k_tiles, const MoEParams& p,
                                          const CUtensorMap* rows_map, const int (&row_of)[4], int rows,
                                          LoadB&& load_b) {
    const uint32_t base = ptx::smem_addr(smem);
    const int lane = threadIdx.x & 31;
    const uint32_t bytes = static_cast<uint32_t>(rows) * 128 + kStageBytesB;
    for (int kt = 0; kt < k_tiles; ++kt) {
      const uint32_t it = slab + kt, s = it % STAGES, use = it / STAGES;
      bool ok = true;
      if (lane == 0 && use > 0) ok = wait_pipeline(ptx::smem_addr(&bars.empty[s]), (use - 1) & 1, p);
      if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
      const uint32_t full = ptx::smem_addr(&bars.full[s]);
      const int k0 = kt * Base::kBlockK;
      if (lane == 0) {
        tma::arrive_expect_tx(full, bytes);
        load_b(b_stage(base, s), k0, full);
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = lane + 32 * i;
        if (r < rows) tma::load_2d(a_stage(base, s) + r * 128, rows_map, full, k0, row_of[i]);
      }
    }
    return true;
  }

  // Consumer warpgroups: wgmma on each stage as it fills; a stage is released once the next slab's
  // wgmma were issued and the previous ones retired (wait_group 1). After a failed wait (watchdog) the
  // loop still runs to the end on whatever the stages hold, without waiting: no early exit between
  // wgmma issue and retirement, which would make the compiler serialise the pipeline.
  __device__ bool consume(char* smem, Barriers& bars, uint32_t slab, int k_tiles, const MoEParams& p) {
    const uint32_t base = ptx::smem_addr(smem);
    const bool lane0 = (threadIdx.x & 31) == 0;
    bool ok = true;
#pragma unroll
    for (int i = 0; i < Base::kAccumulators; ++i) this->acc[i] = 0.f;
    for (int kt = 0; kt < k_tiles; ++kt) {
      const uint32_t it = slab + kt, s = it % STAGES, use = it / STAGES;
      ok = ok && wait_pipeline(ptx::smem_addr(&bars.full[s]), use & 1, p);
      this->issue_stage(a_stage(base, s), b_stage(base, s));
      wgmma::wait_group<1>();
      __syncwarp();
      if (kt > 0 && lane0) tma::arrive(ptx::smem_addr(&bars.empty[(it - 1) % STAGES]));
    }
    wgmma::wait_group<0>();
    wgmma::fence_operands(this->acc);
    __syncwarp();
    if (k_tiles > 0 && lane0) tma::arrive(ptx::smem_addr(&bars.empty[(slab + k_tiles - 1) % STAGES]));
    return ok;
  }
};

}  // namespace flashdmoe
