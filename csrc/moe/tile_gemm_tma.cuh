// Block tile GEMM fed by TMA, warp-specialised: a producer warp (the block's threads past the kThreads
// workers; lane 0 issues) loads each 64-deep K slab of A (128 contiguous rows) and B (64-column panels)
// into one of STAGES shared-memory stages and arms the stage's "full" mbarrier with the byte count;
// the two consumer warpgroups (the workers) wait on it, run wgmma, and release the stage on its
// "empty" mbarrier. No block-wide barrier inside the K loop, so loads run up to STAGES slabs ahead.
// Stage layouts are exactly WgmmaTileGemm's (TMA's 128-byte swizzle is wgmma's).
#pragma once
#include "common/cluster.cuh"
#include "common/sync.cuh"
#include "common/tma.cuh"
#include "moe/tile_gemm_wgmma.cuh"

namespace flashdmoe {

template <int STAGES>
struct TmaPipelineBarriers {
  uint64_t full[STAGES];
  uint64_t empty[STAGES];
};

// Bounded mbarrier wait (the watchdog covers the pipeline too). cluster_scope: the phase was completed
// by another CTA's arrivals that release data this thread reads (acquire at cluster scope).
__device__ __forceinline__ bool wait_pipeline(uint32_t bar, uint32_t parity, const MoEParams& p,
                                              bool cluster_scope = false) {
  auto ready = [&] { return cluster_scope ? tma::try_wait_parity<true>(bar, parity) : tma::try_wait_parity(bar, parity); };
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
  // consumer_ctas: CTAs whose consumers release each stage (2 in the cluster schedule).
  __device__ static void init_barriers(Barriers& bars, int consumer_ctas = 1) {
    for (int s = 0; s < STAGES; ++s) {
      tma::mbarrier_init(ptx::smem_addr(&bars.full[s]), 1);  // the producer's arrive + bytes
      tma::mbarrier_init(ptx::smem_addr(&bars.empty[s]), consumer_ctas * kThreads / 32);  // per consumer warp
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

  // The whole producer warp: like produce(), but A is `rows` single rows of `x` (row_of[i] is the token of
  // tile row lane + 32 i), gathered with 16-byte cp.async into the stage's 128-byte-swizzled rows (one
  // warp instruction moves 512 bytes, where one-row TMA boxes cost a TMA request per 128 bytes). Each
  // lane ties its copies to the stage's full mbarrier; lane 0's counted arrival comes after them and
  // carries B's TMA bytes. The copies are generic-proxy writes: the consumers fence before their wgmma
  // read them (consume(..., generic_a = true)). Tile rows past `rows` keep stale data; their results
  // are never stored.
  template <typename LoadB>
  __device__ static bool produce_gathered(char* smem, Barriers& bars, uint32_t slab, int k_tiles, const MoEParams& p,
                                          const Element* x, const int (&row_of)[4], int rows, LoadB&& load_b) {
    const uint32_t base = ptx::smem_addr(smem);
    const int lane = threadIdx.x & 31;
    for (int kt = 0; kt < k_tiles; ++kt) {
      const uint32_t it = slab + kt, s = it % STAGES, use = it / STAGES;
      bool ok = true;
      if (lane == 0 && use > 0) ok = wait_pipeline(ptx::smem_addr(&bars.empty[s]), (use - 1) & 1, p);
      if (!__shfl_sync(0xffffffffu, ok, 0)) return false;
      const uint32_t full = ptx::smem_addr(&bars.full[s]);
      const int k0 = kt * Base::kBlockK;
      // One lane per row (lane + 32 i), eight 16-byte copies each. Eight lanes per row (whole 128-byte
      // segments per instruction, the row's token by shuffle) measured slower: 0.94 vs 0.62 ms expert
      // phase on the paper shape; the producer's instruction count is the cost, not sector efficiency.
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = lane + 32 * i;
        if (r >= rows) continue;
        const Element* src = x + static_cast<size_t>(row_of[i]) * p.hidden + k0;
        const uint32_t dst = a_stage(base, s) + r * 128;
#pragma unroll
        for (int chunk = 0; chunk < 8; ++chunk) ptx::cp_async_16(dst + ((chunk ^ (r & 7)) << 4), src + chunk * 8, true);
      }
      tma::cp_async_arrive(full);
      __syncwarp();
      if (lane == 0) {
        tma::arrive_expect_tx(full, kStageBytesB);
        load_b(b_stage(base, s), k0, full);
      }
    }
    return true;
  }

  // Consumer warpgroups: wgmma on each stage as it fills; a stage is released once the next slab's
  // wgmma were issued and the previous ones retired (wait_group 1). After a failed wait (watchdog) the
  // loop still runs to the end on whatever the stages hold, without waiting: no early exit between
  // wgmma issue and retirement, which would make the compiler serialise the pipeline.
  // A warpgroup whose 64 rows are all past the tile's rows (`active` false) only paces the ring: it waits
  // for each stage and releases it at once, leaving the tensor cores to the other warpgroup.
  // generic_a: A was written by cp.async (produce_gathered), not TMA.
  // peer_cta >= 0 (cluster schedule): the stages are also written by that CTA's producer (multicast), so
  // each release goes to its empty barrier too.
  __device__ bool consume(char* smem, Barriers& bars, uint32_t slab, int k_tiles, const MoEParams& p,
                          bool active = true, bool generic_a = false, int peer_cta = -1) {
    const uint32_t base = ptx::smem_addr(smem);
    const bool lane0 = (threadIdx.x & 31) == 0;
    bool ok = true;
    auto release = [&](uint32_t s) {
      const uint32_t empty = ptx::smem_addr(&bars.empty[s]);
      tma::arrive(empty);
      if (peer_cta >= 0) cluster::arrive(cluster::map_shared(empty, peer_cta));
    };
#pragma unroll
    for (int i = 0; i < Base::kAccumulators; ++i) this->acc[i] = 0.f;
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
      if (generic_a) wgmma::fence_proxy_async_shared();  // cp.async rows, read by wgmma (async proxy)
      this->issue_stage(a_stage(base, s), b_stage(base, s));
      wgmma::wait_group<1>();
      __syncwarp();
      if (kt > 0 && lane0) release((it - 1) % STAGES);
    }
    wgmma::wait_group<0>();
    wgmma::fence_operands(this->acc);
    __syncwarp();
    if (k_tiles > 0 && lane0) release((slab + k_tiles - 1) % STAGES);
    return ok;
  }
};

}  // namespace flashdmoe
