// Block-level tensor-core tile GEMM: a cp.async multi-stage pipeline feeding mma.sync m16n8k16
// (bf16/fp16) or m16n8k8 (fp32 inputs as TF32), fp32 accumulation. A rows are gathered through per-row
// pointers (token rows of x, or rows of the intermediate); B is either N-contiguous ([K, N] expert
// weights) or K-contiguous ([N, K] router). Every K slab is 128 bytes deep: 64 or 32 elements.
#pragma once
#include "common/pipeline.cuh"
#include "common/ptx.cuh"
#include "common/sync.cuh"
#include "moe/smem_tiles.cuh"

namespace flashdmoe {

// Shared-memory tiles are 128 bytes deep in K (smem_tiles.cuh); an N-contiguous B tile is
// swizzled the same way by its K row.
template <typename Element, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, bool B_K_CONTIGUOUS>
struct TileGemm {
  static constexpr bool kTf32 = sizeof(Element) == 4;
  static constexpr int kBlockK = kSlabDepth<Element>;
  static constexpr int kChunk = kChunkElements<Element>;
  static constexpr int kMmaK = kTf32 ? 8 : 16;
  static constexpr int kThreads = WARPS_M * WARPS_N * 32;
  static constexpr int kWarpM = BM / WARPS_M;
  static constexpr int kWarpN = BN / WARPS_N;
  static constexpr int kMmaM = kWarpM / 16;
  static constexpr int kMmaN = kWarpN / 8;
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tile must be a multiple of 16x16");
  static constexpr int kStageBytesA = BM * 128;
  static constexpr int kStageBytesB = BN * 128;
  static constexpr int kPipelineBytes = STAGES * (kStageBytesA + kStageBytesB);
  static constexpr int kChunksPerRowB = BN / kChunk;  // N-contiguous B: 16-byte chunks per K row

  float acc[kMmaM][kMmaN][4];

  __device__ static uint32_t n_major_offset(int k, int chunk) {
    return k * (BN * static_cast<int>(sizeof(Element))) + ((chunk ^ (k & 7)) << 4);
  }

  // ---- loaders (all threads) ----
  template <int ROWS>
  __device__ static void load_rows(uint32_t dst, const Element* const* rows, int k0, const Element* fallback) {
    load_k_major_rows<ROWS, kThreads>(dst, rows, k0, fallback);
  }
  // N-contiguous B: the tile's first BN/2 columns start at col_lo, the second half at col_hi (the two
  // halves of a swiglu W1, or simply consecutive columns); columns at or past the limits are zero.
  __device__ static void load_b_n_major(uint32_t dst, const Element* b, int ldb, int k0, int col_lo, int lo_end,
                                        int col_hi, int hi_end) {
    constexpr int kChunks = kBlockK * kChunksPerRowB;
    constexpr int kHalf = kChunksPerRowB / 2;
    for (int i = threadIdx.x; i < kChunks; i += kThreads) {
      const int k = i / kChunksPerRowB, chunk = i % kChunksPerRowB;
      const bool low = chunk < kHalf;
      const int col = low ? col_lo + chunk * kChunk : col_hi + (chunk - kHalf) * kChunk;
      const bool valid = col < (low ? lo_end : hi_end);
      const Element* src = b + static_cast<size_t>(k0 + k) * ldb + (valid ? col : 0);
      ptx::cp_async_16(dst + n_major_offset(k, chunk), src, valid);
    }
  }

  __device__ void zero_acc() {
#pragma unroll
    for (int i = 0; i < kMmaM; ++i)
#pragma unroll
      for (int j = 0; j < kMmaN; ++j)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;
  }

  // One K slab from shared memory into the accumulators. A (and a K-contiguous B) come through
  // ldmatrix: for fp32 data a b16 8x8 matrix is an 8x4 tf32 one, which is exactly the m16n8k8
  // fragment, so the addressing is the same as for 16-bit inputs. An N-contiguous fp32 B has no
  // transposing ldmatrix: its two fragment words per MMA are plain 32-bit shared loads.
  // fp32 products: one TF32 MMA for the expert GEMMs (N-contiguous B); three (hi*hi + hi*lo + lo*hi,
  // "3xTF32", fp32-accurate) for the router GEMM (K-contiguous B), so that routing decisions are made
  // on fp32 logits.
  __device__ void mma_stage(uint32_t a_base, uint32_t b_base) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
#pragma unroll
    for (int kk = 0; kk < kBlockK / kMmaK; ++kk) {
      uint32_t a_frag[kMmaM][4];
      uint32_t b_frag[kMmaN][2];
#pragma unroll
      for (int mi = 0; mi < kMmaM; ++mi) {
        const int row = warp_m * kWarpM + mi * 16 + (lane & 15);
        ptx::ldmatrix_x4(a_frag[mi], a_base + k_major_offset(row, kk * 2 + (lane >> 4)));
      }
      if constexpr (kTf32 && !B_K_CONTIGUOUS) {
#pragma unroll
        for (int ni = 0; ni < kMmaN; ++ni) {
          const int n = warp_n * kWarpN + ni * 8 + (lane >> 2);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int k = kk * 8 + (lane & 3) + 4 * h;
            b_frag[ni][h] = ptx::lds_u32(b_base + n_major_offset(k, n / kChunk) + (n % kChunk) * 4);
          }
        }
      } else {
#pragma unroll
        for (int nj = 0; nj < kMmaN / 2; ++nj) {
          uint32_t r[4];
          if constexpr (B_K_CONTIGUOUS) {
            const int n = warp_n * kWarpN + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
            ptx::ldmatrix_x4(r, b_base + k_major_offset(n, kk * 2 + ((lane >> 3) & 1)));
          } else {
            const int k = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
            const int n = warp_n * kWarpN + nj * 16 + ((lane >> 4) << 3);
            ptx::ldmatrix_x4_trans(r, b_base + n_major_offset(k, n >> 3));
          }
          b_frag[2 * nj][0] = r[0];
          b_frag[2 * nj][1] = r[1];
          b_frag[2 * nj + 1][0] = r[2];
          b_frag[2 * nj + 1][1] = r[3];
        }
      }
      if constexpr (kTf32) {
        constexpr bool kSplit = B_K_CONTIGUOUS;
        uint32_t a_lo[kMmaM][4], b_lo[kMmaN][2];
#pragma unroll
        for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const uint32_t hi = ptx::to_tf32(a_frag[mi][v]);
            if constexpr (kSplit) a_lo[mi][v] = ptx::tf32_remainder(a_frag[mi][v], hi);
            a_frag[mi][v] = hi;
          }
#pragma unroll
        for (int ni = 0; ni < kMmaN; ++ni)
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            const uint32_t hi = ptx::to_tf32(b_frag[ni][v]);
            if constexpr (kSplit) b_lo[ni][v] = ptx::tf32_remainder(b_frag[ni][v], hi);
            b_frag[ni][v] = hi;
          }
#pragma unroll
        for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
          for (int ni = 0; ni < kMmaN; ++ni) {
            if constexpr (kSplit) {
              ptx::mma_1688_tf32(acc[mi][ni], a_lo[mi], b_frag[ni][0], b_frag[ni][1]);
              ptx::mma_1688_tf32(acc[mi][ni], a_frag[mi], b_lo[ni][0], b_lo[ni][1]);
            }
            ptx::mma_1688_tf32(acc[mi][ni], a_frag[mi], b_frag[ni][0], b_frag[ni][1]);
          }
      } else {
#pragma unroll
        for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
          for (int ni = 0; ni < kMmaN; ++ni)
            ptx::mma_16816<Element>(acc[mi][ni], a_frag[mi], b_frag[ni][0], b_frag[ni][1]);
      }
    }
  }

  // The pipelined main loop over k_tiles slabs. load_stage(a_dst, b_dst, k0) issues one slab's copies.
  // The stages form a ring that is read at `read` and refilled STAGES - 1 slabs ahead of it at `fill`.
  template <typename LoadStage>
  __device__ void run(char* smem, int k_tiles, LoadStage&& load_stage) {
    const uint32_t base = ptx::smem_addr(smem);
    auto a_stage = [&](int s) { return base + s * kStageBytesA; };
    auto b_stage = [&](int s) { return base + STAGES * kStageBytesA + s * kStageBytesB; };
    zero_acc();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < k_tiles) load_stage(a_stage(s), b_stage(s), s * kBlockK);
      ptx::cp_async_commit();
    }
    PipelineState<STAGES> read{}, fill{STAGES - 1};
    for (int kt = 0; kt < k_tiles; ++kt, read.advance(), fill.advance()) {
      ptx::cp_async_wait<STAGES - 2>();
      sync_workers();  // slab kt visible to all; slab kt-1's buffer is free to overwrite
      const int next = kt + STAGES - 1;
      if (next < k_tiles) load_stage(a_stage(fill.index()), b_stage(fill.index()), next * kBlockK);
      ptx::cp_async_commit();
      mma_stage(a_stage(read.index()), b_stage(read.index()));
    }
    ptx::cp_async_wait<0>();
    sync_workers();  // pipeline buffers may now be reused by the epilogue
  }

  // The accumulators as (row, col, col + 1) pairs: visit(row, col, float2).
  template <typename Visit>
  __device__ void for_each_acc_pair(Visit&& visit) const {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
#pragma unroll
    for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
      for (int ni = 0; ni < kMmaN; ++ni)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          visit(warp_m * kWarpM + mi * 16 + (lane >> 2) + h * 8, warp_n * kWarpN + ni * 8 + ((lane & 3) << 1),
                make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]));
  }

  // Visit every accumulator element with its (row, col) inside the block tile.
  template <typename Visit>
  __device__ void for_each_acc(Visit&& visit) const {
    for_each_acc_pair([&](int row, int col, float2 v) {
      visit(row, col, v.x);
      visit(row, col + 1, v.y);
    });
  }
};

}  // namespace flashdmoe
