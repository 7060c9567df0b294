// Block tile GEMM on Hopper warpgroup MMA fed by TMA, warp-specialised: 128 x BN tile (BN = 128 or 256),
// two consumer warpgroups of 64 rows each issuing wgmma.m64nBNk16 from shared memory. A producer warp
// (the block's threads past the kThreads workers; lane 0 issues) loads each 64-deep K slab of A (128
// contiguous rows, K-major) and B ([K, N] weights as MN-major 64-column panels) into one of STAGES
// shared-memory stages and arms the stage's "full" mbarrier with the byte count; the consumers wait on
// it, run wgmma, and release the stage on its "empty" mbarrier. No block-wide barrier inside the K
// loop, so loads run up to STAGES slabs ahead. TMA's 128-byte swizzle is the one wgmma's descriptors
// expect.
#pragma once
#include "common/ptx.cuh"
#include "common/sync.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "moe/tma_boxes.cuh"

namespace flashdmoe {

template <int STAGES>
struct TmaPipelineBarriers {
  uint64_t full[STAGES];
  uint64_t empty[STAGES];
};

// Bounded mbarrier wait (the watchdog covers the pipeline too).
__device__ __forceinline__ bool wait_pipeline(uint32_t bar, uint32_t parity, const MoEParams& p) {
  auto ready = [&] { return tma::try_wait_parity(bar, parity); };
  if (ready()) return true;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (ready()) return true;
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
struct TmaTileGemm {
  using Barriers = TmaPipelineBarriers<STAGES>;
  static constexpr int kBlockM = 128, kBlockN = BN, kBlockK = 64;
  static constexpr int kPanels = BN / 64;  // MN-major B is stored as 64-column panels
  static constexpr int kAccumulators = BN / 2;
  static constexpr int kStageBytesA = kBlockM * kBlockK * 2;
  static constexpr int kStageBytesB = kBlockK * kBlockN * 2;
  static constexpr int kPanelBytes = kBlockK * 64 * 2;  // one 64-column B panel: 64 K rows x 128 bytes
  static constexpr int kPipelineBytes = STAGES * (kStageBytesA + kStageBytesB);
  static constexpr uint32_t kAtomBytes = 1024;  // 8 rows x 128 bytes: the swizzle repeat
  // A stage is filled by one A box and kPanels weight panel boxes: its expect_tx byte count.
  static constexpr uint32_t kStageTxBytes = kExpertRowBox.bytes() + kPanels * kWeightPanelBox.bytes();
  static_assert(kExpertRowBox.dims[0] == kBlockK && kExpertRowBox.dims[1] == kBlockM &&
                kExpertRowBox.bytes() == kStageBytesA, "an A stage is one row box");
  static_assert(kWeightPanelBox.dims[0] * kPanels == kBlockN && kWeightPanelBox.dims[1] == kBlockK &&
                kWeightPanelBox.bytes() == kPanelBytes && kPanels * kPanelBytes == kStageBytesB,
                "a B stage is kPanels weight panel boxes");

  // Accumulator j*4+v of a thread: warpgroup rows 64*wg + 16*(warp%4) + lane/4 (+8 for v >= 2),
  // column 8*j + 2*(lane%4) + (v & 1).
  float acc[kAccumulators];

  __device__ static uint32_t a_stage(uint32_t base, int s) { return base + s * kStageBytesA; }
  __device__ static uint32_t b_stage(uint32_t base, int s) { return base + STAGES * kStageBytesA + s * kStageBytesB; }

  // Thread 0 of the block, once per launch, before any use (followed by a block-wide barrier).
  __device__ static void init_barriers(Barriers& bars) {
    for (int s = 0; s < STAGES; ++s) {
      tma::mbarrier_init(ptx::smem_addr(&bars.full[s]), 1);  // the producer's arrive + bytes
      tma::mbarrier_init(ptx::smem_addr(&bars.empty[s]), kThreads / 32);  // per consumer warp
    }
    tma::fence_barrier_init();
  }

  // Issue one 64-deep K slab (4 wgmma) as one commit group; does not wait for it.
  __device__ void issue_stage(uint32_t a_base, uint32_t b_base) {
    const int warpgroup = threadIdx.x >> 7;
    const uint32_t a_rows = a_base + warpgroup * 64 * 128;
    wgmma::fence_operands(acc);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      // K-major A: the next 16 K elements are 32 bytes further inside the swizzled row.
      const uint64_t desc_a = wgmma::smem_descriptor(a_rows + kk * 32, 16, kAtomBytes);
      // MN-major B: 16 K rows further; panels kPanelBytes apart; 8-row groups 1024 bytes apart.
      const uint64_t desc_b = wgmma::smem_descriptor(b_base + kk * 16 * 128, kPanelBytes, kAtomBytes);
      wgmma::wgmma_m64nNk16<BN, Element>(acc, desc_a, desc_b);
    }
    wgmma::commit_group();
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
      tma::arrive_expect_tx(full, kStageTxBytes);
      load(a_stage(base, s), b_stage(base, s), kt * kBlockK, full);
    }
    return true;
  }

  // Consumer warpgroups: wgmma on each stage as it fills; a stage is released once the next slab's
  // wgmma were issued and the previous ones retired (wait_group 1). After a failed wait (watchdog) the
  // loop still runs to the end on whatever the stages hold, without waiting: no early exit between
  // wgmma issue and retirement, which would make the compiler serialise the pipeline.
  // A warpgroup whose 64 rows are all past the tile's rows (`active` false) only paces the ring: it waits
  // for each stage and releases it at once, leaving the tensor cores to the other warpgroup.
  __device__ bool consume(char* smem, Barriers& bars, uint32_t slab, int k_tiles, const MoEParams& p,
                          bool active = true) {
    const uint32_t base = ptx::smem_addr(smem);
    const bool lane0 = (threadIdx.x & 31) == 0;
    bool ok = true;
    auto release = [&](uint32_t s) { tma::arrive(ptx::smem_addr(&bars.empty[s])); };
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) acc[i] = 0.f;
    if (!active) {
      for (int kt = 0; kt < k_tiles; ++kt) {
        const uint32_t it = slab + kt, s = it % STAGES, use = it / STAGES;
        ok = ok && wait_pipeline(ptx::smem_addr(&bars.full[s]), use & 1, p);
        __syncwarp();
        if (lane0) release(s);
      }
      return ok;
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      const uint32_t it = slab + kt, s = it % STAGES, use = it / STAGES;
      ok = ok && wait_pipeline(ptx::smem_addr(&bars.full[s]), use & 1, p);
      issue_stage(a_stage(base, s), b_stage(base, s));
      wgmma::wait_group<1>();
      __syncwarp();
      if (kt > 0 && lane0) release((it - 1) % STAGES);
    }
    wgmma::wait_group<0>();
    wgmma::fence_operands(acc);
    __syncwarp();
    if (k_tiles > 0 && lane0) release((slab + k_tiles - 1) % STAGES);
    return ok;
  }
};

}  // namespace flashdmoe
