// Block tile GEMM on Hopper warpgroup MMA: 128 x BN tile (BN = 128 or 256), two warpgroups of 64 rows
// each issuing wgmma.m64nBNk16 from shared memory. A (gathered rows, K-major) and B ([K, N] weights, loaded as
// MN-major 64-column panels) are 128-byte swizzled as wgmma's descriptors expect; a cp.async pipeline
// fills the stages. Same interface as TileGemm (run / for_each_acc / loaders), so the expert tasks can
// use either.
#pragma once
#include "common/ptx.cuh"
#include "common/sync.cuh"
#include "common/wgmma.cuh"
#include "moe/smem_tiles.cuh"

namespace flashdmoe {

template <typename Element, int BN, int STAGES>
struct WgmmaTileGemm {
  static constexpr int kBlockM = 128, kBlockN = BN, kBlockK = 64;
  static constexpr int kPanels = BN / 64;  // MN-major B is stored as 64-column panels
  static constexpr int kAccumulators = BN / 2;
  static constexpr int kThreads = 256;
  static constexpr int kStageBytesA = kBlockM * kBlockK * 2;
  static constexpr int kStageBytesB = kBlockK * kBlockN * 2;
  static constexpr int kPanelBytes = kBlockK * 64 * 2;  // one 64-column B panel: 64 K rows x 128 bytes
  static constexpr int kPipelineBytes = STAGES * (kStageBytesA + kStageBytesB);
  static constexpr uint32_t kAtomBytes = 1024;  // 8 rows x 128 bytes: the swizzle repeat

  float acc[kAccumulators];

  // B: column panel (0/1), K row, chunk within the panel's 128-byte row (MN-major SW128).
  __device__ static uint32_t b_offset(int panel, int k, int chunk) {
    return panel * kPanelBytes + k * 128 + ((chunk ^ (k & 7)) << 4);
  }

  template <int ROWS>
  __device__ static void load_rows(uint32_t dst, const Element* const* rows, int k0, const Element* fallback) {
    load_k_major_rows<ROWS, kThreads>(dst, rows, k0, fallback);
  }
  // The first BN/2 tile columns start at col_lo, the second BN/2 at col_hi (the two halves of a swiglu
  // W1, or simply consecutive columns); columns at or past the limits are zero.
  __device__ static void load_b_n_major(uint32_t dst, const Element* b, int ldb, int k0, int col_lo, int lo_end,
                                        int col_hi, int hi_end) {
    constexpr int kChunksPerRow = BN / 8;
    constexpr int kChunks = kBlockK * kChunksPerRow;
    for (int i = threadIdx.x; i < kChunks; i += kThreads) {
      const int k = i / kChunksPerRow, panel = (i % kChunksPerRow) >> 3, chunk = i & 7;
      const bool low = panel < kPanels / 2;
      const int col = (low ? col_lo + panel * 64 : col_hi + (panel - kPanels / 2) * 64) + chunk * 8;
      const bool valid = col < (low ? lo_end : hi_end);
      const Element* src = b + static_cast<size_t>(k0 + k) * ldb + (valid ? col : 0);
      ptx::cp_async_16(dst + b_offset(panel, k, chunk), src, valid);
    }
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

  // Slab kt's wgmma run while the copies of a later slab are issued. A stage is refilled only once every
  // warpgroup's wgmma on it completed. With 4+ stages one barrier per slab suffices: at slab kt's barrier
  // every warpgroup has passed wait_group<1> of slab kt-1, so slab kt-2's stage is free, and the refill
  // targets it (prefetch distance STAGES-2). With fewer stages a second barrier frees slab kt-1's stage
  // (prefetch distance STAGES-1).
  template <typename LoadStage>
  __device__ void run(char* smem, int k_tiles, LoadStage&& load_stage) {
    constexpr bool kOneBarrier = STAGES >= 4;
    constexpr int kAhead = kOneBarrier ? STAGES - 2 : STAGES - 1;  // slabs in flight before the first wgmma
    const uint32_t base = ptx::smem_addr(smem);  // caller guarantees 1024-byte alignment
    auto a_stage = [&](int s) { return base + s * kStageBytesA; };
    auto b_stage = [&](int s) { return base + STAGES * kStageBytesA + s * kStageBytesB; };
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) acc[i] = 0.f;
#pragma unroll
    for (int s = 0; s < kAhead; ++s) {
      if (s < k_tiles) load_stage(a_stage(s), b_stage(s), s * kBlockK);
      ptx::cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      ptx::cp_async_wait<kAhead - 1>();    // slab kt has landed (this thread's copies)
      wgmma::fence_proxy_async_shared();  // ... and is visible to the async proxy (wgmma)
      sync_workers();
      issue_stage(a_stage(kt % STAGES), b_stage(kt % STAGES));
      wgmma::wait_group<1>();  // slab kt-1 done in this warpgroup
      if constexpr (!kOneBarrier) sync_workers();  // ... and in the other one
      const int next = kt + kAhead;
      if (next < k_tiles) load_stage(a_stage(next % STAGES), b_stage(next % STAGES), next * kBlockK);
      ptx::cp_async_commit();
    }
    wgmma::wait_group<0>();
    wgmma::fence_operands(acc);
    ptx::cp_async_wait<0>();
    sync_workers();
  }

  // The accumulators as (row, col, col + 1) pairs: visit(row, col, float2).
  template <typename Visit>
  __device__ void for_each_acc_pair(Visit&& visit) const {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (warp >> 2) * 64 + (warp & 3) * 16 + (lane >> 2);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        visit(row0 + h * 8, j * 8 + ((lane & 3) << 1), make_float2(acc[j * 4 + 2 * h], acc[j * 4 + 2 * h + 1]));
  }

  // Accumulator j*4+v of a thread: warpgroup rows 64*wg + 16*(warp%4) + lane/4 (+8 for v >= 2),
  // column 8*j + 2*(lane%4) + (v & 1).
  template <typename Visit>
  __device__ void for_each_acc(Visit&& visit) const {
    for_each_acc_pair([&](int row, int col, float2 v) {
      visit(row, col, v.x);
      visit(row, col + 1, v.y);
    });
  }
};

}  // namespace flashdmoe
