// Block tile GEMM on Hopper warpgroup MMA fed by TMA, warp-specialised: 128 x BN tile (BN = 128 or 256),
// two consumer warpgroups of 64 rows each issuing wgmma.m64nBNk16 from shared memory. A producer warp
// (the block's threads past the kThreads workers; lane 0 issues) loads each 64-deep K slab of A (up to
// 128 contiguous rows in ROW_BOX-row boxes, K-major) and B ([K, N] weights as MN-major 64-column panels) into one of STAGES
// shared-memory stages and arms the stage's "full" mbarrier with the byte count; the consumers wait on
// it, run wgmma, and release the stage on its "empty" mbarrier. No block-wide barrier inside the K
// loop, so loads run up to STAGES slabs ahead. TMA's 128-byte swizzle is the one wgmma's descriptors
// expect. The backward's GEMMs use the same tile with other operand layouts (kMajorA / kMajorB): A
// MN-major (a [K][M] tensor, two 64-column panels, one per warpgroup) for its weight gradients, B
// K-major (a [N][K] tensor, BN rows of 128 bytes) for its row GEMMs through the transposed weights.
#pragma once
#include "common/pipeline.cuh"
#include "common/ptx.cuh"
#include "common/sync.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "moe/tma_boxes.cuh"

namespace flashdmoe {

// Which dimension is contiguous in a shared-memory operand: K (rows of 64 K elements, 128 bytes each)
// or M / N (64-element panels of 64 K rows).
enum class Major { K, MN };

// kCluster = 2: the stage ring is shared with the peer block of a two-block cluster (StagePipeline).
template <typename Element, int BN, int STAGES, int ROW_BOX, Major kMajorA = Major::K, Major kMajorB = Major::MN,
          int kCluster = 1>
struct TmaTileGemm {
  using Pipeline = StagePipeline<STAGES, kCluster>;
  using State = PipelineState<STAGES>;
  static constexpr int kBlockM = 128, kBlockN = BN, kBlockK = 64;
  static constexpr int kPanels = BN / 64;  // MN-major B is stored as 64-column panels
  static constexpr int kAccumulators = BN / 2;
  static constexpr int kStageBytesA = kBlockM * kBlockK * 2;
  static constexpr int kStageBytesB = kBlockK * kBlockN * 2;
  static constexpr int kPanelBytes = kBlockK * 64 * 2;  // one 64-column B panel: 64 K rows x 128 bytes
  static constexpr int kPipelineBytes = STAGES * (kStageBytesA + kStageBytesB);
  static constexpr uint32_t kAtomBytes = 1024;  // 8 rows x 128 bytes: the swizzle repeat
  // A stage is filled by `a_boxes` A row boxes (as many as the tile has rows for) and kPanels weight
  // panel boxes (in a cluster, half of them loaded by the peer): its expect_tx byte count. A rows past those boxes keep stale data: they feed only
  // accumulator rows past the tile's rows, which are never stored (a wgmma row of D reads only its own
  // row of A), or the warpgroup that has none of the tile's rows and skips its wgmma.
  static constexpr TmaBox kRowBox = expert_row_box(ROW_BOX);
  __host__ __device__ static constexpr uint32_t stage_tx_bytes(int a_boxes) {
    return a_boxes * kRowBox.bytes() + kPanels * kWeightPanelBox.bytes();
  }
  static_assert(kRowBox.dims[0] == kBlockK && kBlockM % kRowBox.dims[1] == 0 &&
                kBlockM / kRowBox.dims[1] * kRowBox.bytes() == kStageBytesA, "an A stage is whole row boxes");
  static_assert(kWeightPanelBox.dims[0] * kPanels == kBlockN && kWeightPanelBox.dims[1] == kBlockK &&
                kWeightPanelBox.bytes() == kPanelBytes && kPanels * kPanelBytes == kStageBytesB,
                "a B stage is kPanels weight panel boxes");

  // Accumulator j*4+v of a thread: warpgroup rows 64*wg + 16*(warp%4) + lane/4 (+8 for v >= 2),
  // column 8*j + 2*(lane%4) + (v & 1).
  float acc[kAccumulators];

  __device__ static uint32_t a_stage(uint32_t base, int s) { return base + s * kStageBytesA; }
  __device__ static uint32_t b_stage(uint32_t base, int s) { return base + STAGES * kStageBytesA + s * kStageBytesB; }

  // Issue one 64-deep K slab (4 wgmma) as one commit group; does not wait for it.
  __device__ void issue_stage(uint32_t a_base, uint32_t b_base) {
    const int warpgroup = threadIdx.x >> 7;
    wgmma::fence_operands(acc);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      // K-major: the next 16 K elements are 32 bytes further inside the swizzled rows (8-row groups
      // 1024 bytes apart). MN-major: 16 K rows further; 64-element panels kPanelBytes apart.
      const uint64_t desc_a =
          kMajorA == Major::K
              ? wgmma::smem_descriptor(a_base + warpgroup * 64 * 128 + kk * 32, 16, kAtomBytes)
              : wgmma::smem_descriptor(a_base + warpgroup * kPanelBytes + kk * 16 * 128, kPanelBytes, kAtomBytes);
      const uint64_t desc_b = kMajorB == Major::K ? wgmma::smem_descriptor(b_base + kk * 32, 16, kAtomBytes)
                                                  : wgmma::smem_descriptor(b_base + kk * 16 * 128, kPanelBytes, kAtomBytes);
      wgmma::Mma<BN, Element, kMajorA == Major::MN, kMajorB == Major::MN>::run(acc, desc_a, desc_b);
    }
    wgmma::commit_group();
  }

  // Producer lane: the tile's k_tiles slabs into the ring from position `at` on (advanced past them),
  // each once the consumers released the stage. load(a_dst, b_dst, k0, bar) issues a slab's TMA loads,
  // tx_bytes of them (stage_tx_bytes).
  template <typename Params, typename Load>
  __device__ static bool produce(char* smem, Pipeline& pipe, State& at, int k_tiles, uint32_t tx_bytes,
                                 const Params& p, Load&& load) {
    const uint32_t base = ptx::smem_addr(smem);
    for (int kt = 0; kt < k_tiles; ++kt, at.advance()) {
      if (!pipe.producer_acquire(at, p)) return false;
      const uint32_t full = pipe.producer_commit(at, tx_bytes);
      load(a_stage(base, at.index()), b_stage(base, at.index()), kt * kBlockK, full);
    }
    return true;
  }

  // Consumer warpgroups: the tile's k_tiles slabs from ring position `at` on (advanced past them);
  // wgmma on each stage as it fills, and a stage is released once the next slab's wgmma were issued and
  // the previous ones retired (wait_group 1). After a failed wait (watchdog) the loop still runs to the
  // end on whatever the stages hold, without waiting: no early exit between wgmma issue and retirement,
  // which would make the compiler serialise the pipeline.
  // A warpgroup whose 64 rows are all past the tile's rows (`active` false) only paces the ring: it waits
  // for each stage and releases it at once, leaving the tensor cores to the other warpgroup.
  template <typename Params>
  __device__ bool consume(char* smem, Pipeline& pipe, State& at, int k_tiles, const Params& p, bool active = true) {
    const uint32_t base = ptx::smem_addr(smem);
    const bool lane0 = (threadIdx.x & 31) == 0;
    bool ok = true;
#pragma unroll
    for (int i = 0; i < kAccumulators; ++i) acc[i] = 0.f;
    if (!active) {
      for (int kt = 0; kt < k_tiles; ++kt, at.advance()) {
        ok = ok && pipe.consumer_wait(at, p);
        __syncwarp();
        if (lane0) pipe.consumer_release(at);
      }
      return ok;
    }
    State retiring = at;  // the stage whose wgmma retire next: one slab behind
    for (int kt = 0; kt < k_tiles; ++kt, at.advance()) {
      ok = ok && pipe.consumer_wait(at, p);
      issue_stage(a_stage(base, at.index()), b_stage(base, at.index()));
      wgmma::wait_group<1>();
      __syncwarp();
      if (kt > 0) {
        if (lane0) pipe.consumer_release(retiring);
        retiring.advance();
      }
    }
    wgmma::wait_group<0>();
    wgmma::fence_operands(acc);
    __syncwarp();
    if (k_tiles > 0 && lane0) pipe.consumer_release(retiring);
    return ok;
  }
};

}  // namespace flashdmoe
