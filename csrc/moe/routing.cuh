// From per-tile counts to rows: per-expert prefix sums over gate tiles (capacity applied in token
// order), the packed segment of each expert, and each choice's row in it.
#pragma once
#include "common/sync.cuh"
#include "moe/smem_layout.cuh"

namespace flashdmoe {

__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, v, offset);
    if (lane >= offset) v += up;
  }
  return v;
}

// One warp per expert across the grid: exclusive prefix of the expert's count over gate tiles.
__device__ inline void scan_tile_counts(const MoEParams& p) {
  const int lane = threadIdx.x & 31;
  const int warps_in_grid = gridDim.x * (kThreads / 32);
  for (int expert = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5); expert < p.experts; expert += warps_in_grid) {
    int carry = 0;
    for (int base = 0; base < p.gate_tiles; base += 32) {
      const int tile = base + lane;
      const size_t at = static_cast<size_t>(tile) * p.experts + expert;
      const int count = tile < p.gate_tiles ? __ldcg(p.tile_expert_count + at) : 0;
      const int inclusive = warp_inclusive_scan(count);
      if (tile < p.gate_tiles) p.tile_expert_offset[at] = carry + inclusive - count;
      carry += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) {
      p.expert_counts[expert] = carry;
      p.expert_kept[expert] = min(carry, p.capacity);
    }
  }
}

// Every block builds the same tables in shared memory: segment start (rows) and first row tile of each
// expert. Cheap (E <= 1024) and it saves a grid barrier.
struct RoutingTables {
  int* seg_start;   // [E+1]
  int* tile_start;  // [E+1]
  int* kept;        // [E]
};

__device__ inline RoutingTables routing_tables(char* smem, const SmemLayout& layout, int experts) {
  int* base = reinterpret_cast<int*>(smem + layout.tables_offset);
  return {base, base + experts + 1, base + 2 * (experts + 1)};
}

__device__ inline void build_routing_tables(const MoEParams& p, const RoutingTables& t) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int rows_before = 0, tiles_before = 0;
    for (int base = 0; base < p.experts; base += 32) {
      const int expert = base + lane;
      const int kept = expert < p.experts ? __ldcg(p.expert_kept + expert) : 0;
      const int tiles = (kept + kExpertTileM - 1) / kExpertTileM;
      const int rows_incl = warp_inclusive_scan(kept);
      const int tiles_incl = warp_inclusive_scan(tiles);
      if (expert < p.experts) {
        t.kept[expert] = kept;
        t.seg_start[expert] = rows_before + rows_incl - kept;
        t.tile_start[expert] = tiles_before + tiles_incl - tiles;
      }
      rows_before += __shfl_sync(0xffffffffu, rows_incl, 31);
      tiles_before += __shfl_sync(0xffffffffu, tiles_incl, 31);
    }
    if (lane == 0) {
      t.seg_start[p.experts] = rows_before;
      t.tile_start[p.experts] = tiles_before;
    }
  }
  __syncthreads();
}

// Place every kept choice: its row inside the expert's packed segment, and the row's source token.
__device__ inline void assign_rows(const MoEParams& p, const RoutingTables& t) {
  const size_t pairs = static_cast<size_t>(p.tokens) * p.top_k;
  for (size_t pair = static_cast<size_t>(blockIdx.x) * kThreads + threadIdx.x; pair < pairs;
       pair += static_cast<size_t>(gridDim.x) * kThreads) {
    const int token = static_cast<int>(pair / p.top_k);
    const int expert = __ldcg(p.topk_expert + pair);
    const int tile = token / kGateTileM;
    const int slot = __ldcg(p.tile_expert_offset + static_cast<size_t>(tile) * p.experts + expert) +
                     __ldcg(p.slot_in_tile + pair);
    if (slot < p.capacity) {
      const int row = t.seg_start[expert] + slot;
      p.topk_row[pair] = row;
      p.row_token[row] = token;
    } else {
      p.topk_row[pair] = -1;  // dropped by capacity: counted on the host from expert_counts
    }
  }
}

// Row tile -> expert by binary search over tile_start.
__device__ __forceinline__ int expert_of_row_tile(const RoutingTables& t, int experts, int row_tile) {
  int lo = 0, hi = experts;  // invariant: tile_start[lo] <= row_tile < tile_start[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (t.tile_start[mid] <= row_tile) lo = mid; else hi = mid;
  }
  return lo;
}

}  // namespace flashdmoe
