// Expert-tile epilogue straight from the wgmma accumulators, one warp at a time. Staged: a warp's 16 rows
// go through a private 16 x 64 (2 KB) shared-memory buffer per 64 output columns, so that the global
// stores are 16 bytes per lane and whole 128-byte rows, while no block-wide barrier is needed and the
// pipeline stages stay free for the next tile's loads; the buffer's 16-byte chunks are XOR-swizzled by
// row, so the fragment writes (8 rows x 4 lanes) and the row reads (8 lanes per row) are conflict-free.
// Direct: each lane stores its 4-byte pairs where the fragment holds them, which needs no registers
// beside the accumulators (the saved pre-activations, gelu's intermediate rows).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>
#include "common/pipeline.cuh"
#include "common/ptx.cuh"
#include "moe/activation.cuh"
#include "moe/tile_config.cuh"

namespace flashdmoe {

template <typename Element>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The calling warp's rows of a 128-row wgmma tile (two warpgroups of 64 rows, warps of 16).
__device__ __forceinline__ int warp_tile_row0() {
  const int warp = threadIdx.x >> 5;
  return (warp >> 2) * 64 + (warp & 3) * 16;
}

// Stores the warp's 16 rows of kGroups x 8 columns through its staging buffer: packed[2j + half] is the
// lane's pair of columns 8j + 2 (lane % 4) + {0, 1} in row lane / 4 + 8 half (the wgmma fragment layout),
// packed beforehand so that the accumulators they came from die before the stores need registers. out
// points at the warp's first row, column 0 (row stride ld elements). Rows from `rows` on and 64-column
// chunks from `cols` on are not stored (cols is a multiple of 64).
template <typename Element, int kGroups>
__device__ __forceinline__ void store_warp_rows(char* staging, const uint32_t (&packed)[2 * kGroups], Element* out,
                                                size_t ld, int rows, int cols) {
  static_assert(kGroups % 8 == 0, "whole 64-column chunks");
  if (rows <= 0) return;
  const int lane = threadIdx.x & 31;
  const int frag_row = lane >> 2;
  // The buffer is 128-byte aligned, so chunk j of a row lives at (row address) ^ (j << 4) once the
  // row's own swizzle is folded into the base: one base address per direction.
  const uint32_t buffer = ptx::smem_addr(staging);
  const uint32_t write_base = buffer + frag_row * 128 + (frag_row << 4) + (lane & 3) * 4;
  const int read_row = lane >> 3, read_chunk = lane & 7;
  const uint32_t read_base = buffer + read_row * 128 + ((read_chunk ^ read_row) << 4);  // rows 4i + read_row
  Element* dst = out + read_row * ld + read_chunk * 8;
#pragma unroll
  for (int c = 0; c < kGroups / 8; ++c) {
    if (c * 64 >= cols) break;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<uint32_t*>(staging + (((write_base + half * 8 * 128) ^ (jj << 4)) - buffer)) =
            packed[2 * (c * 8 + jj) + half];
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // Row 4i + read_row: its swizzle differs from read_row's by (4i & 7) in the chunk index.
      const uint4 v =
          *reinterpret_cast<const uint4*>(staging + (((read_base + i * 4 * 128) ^ (((4 * i) & 7) << 4)) - buffer));
      if (4 * i + read_row < rows) *reinterpret_cast<uint4*>(dst + (4 * i) * ld + c * 64) = v;
    }
    __syncwarp();
  }
}

// Stores the warp's 16 rows of kGroups x 8 columns straight from the fragment layout (pair(j, half): the
// lane's columns 8j + 2 (lane % 4) + {0, 1} of row lane / 4 + 8 half), 4 bytes per lane and store: no
// staging registers. out points at the warp's first row, column 0; rows from `rows` on and groups from
// `cols` on are not stored.
template <typename Element, int kGroups, typename Pair>
__device__ __forceinline__ void store_warp_fragments(Pair&& pair, Element* out, size_t ld, int rows, int cols) {
  const int lane = threadIdx.x & 31;
  const int row = lane >> 2;
  Element* at = out + row * ld + 2 * (lane & 3);
  const bool lo = row < rows, hi = row + 8 < rows;
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    if (j * 8 >= cols) break;
    const uint32_t a = pair(j, 0), b = pair(j, 1);
    if (lo) *reinterpret_cast<uint32_t*>(at + j * 8) = a;
    if (hi) *reinterpret_cast<uint32_t*>(at + 8 * ld + j * 8) = b;
  }
}

// The accumulators as they are into the saved pre-activations ([rows, I], or [rows, 2I] for swiglu: the
// tile's gate groups at out_col0, its up groups at I + out_col0), for a backward that then needs no GEMM1.
// Straight from the fragment: the accumulators stay live for the activation after it, and through the
// staging buffer ptxas spilled them under the 168-register cap.
template <typename Element, int BN, typename Gemm>
__device__ __forceinline__ void save_pre_warp(const MoEParams& p, const Gemm& gemm, int packed_row0, int rows,
                                              int out_col0) {
  const int row0 = warp_tile_row0();
  const bool gated = p.activation == Activation::Swiglu;
  const size_t ld = gated ? 2 * static_cast<size_t>(p.ffn) : p.ffn;
  Element* out = static_cast<Element*>(p.saved_pre) + static_cast<size_t>(packed_row0 + row0) * ld + out_col0;
  const int cols = p.ffn - out_col0;
  auto groups_from = [&](auto first) {  // (a constant first group: register arrays take constant indices only)
    return [&gemm](int j, int h) {
      constexpr int kFirst = decltype(first)::value;
      return pack_pair<Element>(gemm.acc[(kFirst + j) * 4 + h * 2], gemm.acc[(kFirst + j) * 4 + h * 2 + 1]);
    };
  };
  if (gated) {
    store_warp_fragments<Element, BN / 16>(groups_from(std::integral_constant<int, 0>{}), out, ld, rows - row0, cols);
    store_warp_fragments<Element, BN / 16>(groups_from(std::integral_constant<int, BN / 16>{}), out + p.ffn, ld,
                                           rows - row0, cols);
  } else {
    store_warp_fragments<Element, BN / 8>(groups_from(std::integral_constant<int, 0>{}), out, ld, rows - row0, cols);
  }
}

// GEMM1 epilogue: activation of the accumulators (swiglu: gate column group j times up group j + BN/16,
// both held by the same lane), into the intermediate rows; first the pre-activations in a training
// instance (kSavePre).
template <typename Element, int BN, bool kSavePre, typename Gemm>
__device__ __forceinline__ void gemm1_epilogue_warp(const MoEParams& p, const Gemm& gemm, char* staging,
                                                    int packed_row0, int rows, int out_col0) {
  if constexpr (kSavePre) save_pre_warp<Element, BN>(p, gemm, packed_row0, rows, out_col0);
  const int row0 = warp_tile_row0();
  Element* out = static_cast<Element*>(p.intermediate) + static_cast<size_t>(packed_row0 + row0) * p.ffn + out_col0;
  const int cols = p.ffn - out_col0;
  auto pack = [&](auto&& f, auto& packed, int groups) {
#pragma unroll
    for (int j = 0; j < groups; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_pair<Element>(f(j, h, 0), f(j, h, 1));
  };
  auto acc = [&](int j, int h, int v) { return gemm.acc[j * 4 + h * 2 + v]; };
  if (p.activation == Activation::Swiglu) {
    uint32_t packed[BN / 8];
    pack([&](int j, int h, int v) { return silu(acc(j, h, v)) * acc(j + BN / 16, h, v); }, packed, BN / 16);
    store_warp_rows<Element, BN / 16>(staging, packed, out, p.ffn, rows - row0, cols);
    return;
  }
  if (p.activation == Activation::Gelu) {
    // Straight from the fragment, as the pre-activations are: 1-3% faster than the staged 16-byte stores
    // (whose 64 packed values beside the accumulators spilled) on the gelu shapes measured, and 2% slower
    // with relu and swiglu, whose activations take a few instructions (docs/perf-notes.md, "Direct
    // fragment stores"); silu stays with the staged stores, unmeasured.
    store_warp_fragments<Element, BN / 8>(
        [&](int j, int h) { return pack_pair<Element>(activate(Activation::Gelu, acc(j, h, 0)),
                                                      activate(Activation::Gelu, acc(j, h, 1))); },
        out, p.ffn, rows - row0, cols);
    return;
  }
  uint32_t packed[BN / 4];
  if (p.activation == Activation::Relu)
    pack([&](int j, int h, int v) { return fmaxf(acc(j, h, v), 0.f); }, packed, BN / 8);
  else
    pack([&](int j, int h, int v) { return silu(acc(j, h, v)); }, packed, BN / 8);
  store_warp_rows<Element, BN / 8>(staging, packed, out, p.ffn, rows - row0, cols);
}

// GEMM1 epilogue of a tile of at most 16 rows, all of them warp 0's: spread over every worker (false
// when the other warpgroup did not come: a failure elsewhere). Warp 0 puts
// its fp32 accumulators into the block's staging (the eight warps' buffers together: 16 rows x BN floats),
// then each worker thread takes (row, 8 output columns) items: the activation, and one 16-byte store.
// The same values as gemm1_epilogue_warp, which would leave the activation of the whole tile to one warp
// while seven wait (decode and small batches, where experts get a few rows each). Float pairs are
// XOR-swizzled by row in groups of four (conflict-light fragment writes, contiguous 32-byte reads).
template <typename Element, int BN, bool kSavePre, typename Gemm>
__device__ __forceinline__ bool gemm1_epilogue_small(const MoEParams& p, const Gemm& gemm, char* block_staging,
                                                     int packed_row0, int rows, int out_col0, uint32_t& met) {
  static_assert(16 * BN * 4 <= (kThreads / 32) * kWarpStagingBytes, "16 rows of fp32 fit the warps' buffers");
  if constexpr (kSavePre) save_pre_warp<Element, BN>(p, gemm, packed_row0, rows, out_col0);
  float2* staged = reinterpret_cast<float2*>(block_staging);
  constexpr int kPairsPerRow = BN / 2;
  auto at = [](int row, int pair) { return row * kPairsPerRow + (pair ^ ((row & 7) << 2)); };
  if (!WorkerMeeting::meet(met, p)) return false;  // every warp is done with its own buffer
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        staged[at((lane >> 2) + 8 * h, 4 * j + (lane & 3))] = make_float2(gemm.acc[j * 4 + h * 2], gemm.acc[j * 4 + h * 2 + 1]);
  }
  if (!WorkerMeeting::meet(met, p)) return false;
  const bool gated = p.activation == Activation::Swiglu;
  const int chunks = (gated ? BN / 2 : BN) / 8;  // 8 output columns each
  const int cols = p.ffn - out_col0;
  Element* out = static_cast<Element*>(p.intermediate) + static_cast<size_t>(packed_row0) * p.ffn + out_col0;
  for (int item = threadIdx.x; item < rows * chunks; item += kThreads) {
    const int row = item / chunks, chunk = item % chunks;
    if (chunk * 8 >= cols) continue;
    float v[8];
    const float4* x = reinterpret_cast<const float4*>(staged + at(row, 4 * chunk));
    *reinterpret_cast<float4*>(v) = x[0];
    *reinterpret_cast<float4*>(v + 4) = x[1];
    if (gated) {
      float u[8];
      const float4* y = reinterpret_cast<const float4*>(staged + at(row, 4 * chunk + BN / 4));
      *reinterpret_cast<float4*>(u) = y[0];
      *reinterpret_cast<float4*>(u + 4) = y[1];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = silu(v[i]) * u[i];
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        v[i] = p.activation == Activation::Relu ? fmaxf(v[i], 0.f)
             : p.activation == Activation::Gelu ? activate(Activation::Gelu, v[i])
                                                : silu(v[i]);
    }
    uint4 packed;
    packed.x = pack_pair<Element>(v[0], v[1]);
    packed.y = pack_pair<Element>(v[2], v[3]);
    packed.z = pack_pair<Element>(v[4], v[5]);
    packed.w = pack_pair<Element>(v[6], v[7]);
    *reinterpret_cast<uint4*>(out + static_cast<size_t>(row) * p.ffn + chunk * 8) = packed;
  }
  return true;
}

// GEMM2 epilogue: the accumulators as they are, into `out` (the tile's first result row, column col0).
template <typename Element, int BN, typename Gemm>
__device__ __forceinline__ void gemm2_epilogue_warp(const Gemm& gemm, char* staging, Element* out, int H, int rows,
                                                    int col0) {
  const int row0 = warp_tile_row0();
  uint32_t packed[BN / 4];
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) packed[2 * j + h] = pack_pair<Element>(gemm.acc[j * 4 + h * 2], gemm.acc[j * 4 + h * 2 + 1]);
  store_warp_rows<Element, BN / 8>(staging, packed, out + static_cast<size_t>(row0) * H + col0, H, rows - row0, H - col0);
}

}  // namespace flashdmoe
