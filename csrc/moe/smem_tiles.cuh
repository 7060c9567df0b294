// The shared-memory tile layout of K-major operands, whether cp.async or TMA fills it: 64-element
// (128-byte) rows whose 16-byte chunks are XOR-swizzled by the row index. ldmatrix reads of 8 rows hit
// 8 bank groups, and the layout is exactly wgmma's 128-byte-swizzle K-major canonical layout (on a
// 1024-byte base), which TMA's 128-byte swizzle writes.
#pragma once
#include "common/ptx.cuh"

namespace flashdmoe {

__device__ __forceinline__ uint32_t k_major_offset(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}

// Elements in one 16-byte chunk, and in one 128-byte K slab row (64 for 2-byte inputs, 32 for fp32).
template <typename Element>
constexpr int kChunkElements = 16 / static_cast<int>(sizeof(Element));
template <typename Element>
constexpr int kSlabDepth = 128 / static_cast<int>(sizeof(Element));

// One K slab (128 bytes deep) of ROWS gathered rows (row pointers; nullptr rows are zero-filled) by
// THREADS threads. `fallback` is any valid address: a zero-filling cp.async still needs one.
template <int ROWS, int THREADS, typename Element>
__device__ __forceinline__ void load_k_major_rows(uint32_t dst, const Element* const* rows, int k0,
                                                  const Element* fallback) {
  constexpr int kChunks = ROWS * 8;
  for (int i = threadIdx.x; i < kChunks; i += THREADS) {
    const int row = i >> 3, chunk = i & 7;
    const Element* src = rows[row];
    const bool valid = src != nullptr;
    ptx::cp_async_16(dst + k_major_offset(row, chunk), valid ? src + k0 + chunk * kChunkElements<Element> : fallback,
                     valid);
  }
}

}  // namespace flashdmoe
