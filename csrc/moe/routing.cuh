// From per-tile counts to rows. Source side: per-expert prefix sums over gate tiles (capacity applied
// in token order) and each expert's offset inside the row stream to its owner rank. Destination side:
// the rows every source sends each local expert, as (local expert, source) segments cut into row tiles.
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

// A warp's 256 values, eight per lane in lane-major order (lane l holds elements 8l .. 8l + 7): each
// becomes its exclusive prefix sum over the 256; returns their total. One warp scan where a scan per 32
// values was eight (their code, run once per block, is most of what a one-token forward fetches here).
__device__ __forceinline__ int warp_exclusive_scan8(int (&v)[8]) {
  int run = 0;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int x = v[u];
    v[u] = run;
    run += x;
  }
  const int inclusive = warp_inclusive_scan(run);
#pragma unroll
  for (int u = 0; u < 8; ++u) v[u] += inclusive - run;
  return __shfl_sync(0xffffffffu, inclusive, 31);
}

// A warp's exclusive prefix sums of n values, 256 per pass, all of a pass loaded before any is scanned
// (one round trip to memory per pass where a load per 32 values scanned was one each):
// store(i, sum of the values before i) for every i < n; returns the sum of all n. Called by the whole warp.
template <typename Load, typename Store>
__device__ __forceinline__ int warp_exclusive_scan_n(int n, const Load& load, const Store& store) {
  const int lane = threadIdx.x & 31;
  int carry = 0;
  for (int first = 0; first < n; first += 256) {
    int v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = first + lane * 8 + u;
      v[u] = i < n ? load(i) : 0;
    }
    const int total = warp_exclusive_scan8(v);
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = first + lane * 8 + u;
      if (i < n) store(i, carry + v[u]);
    }
    carry += total;
  }
  return carry;
}

// One warp per expert across the rank's blocks: exclusive prefix of the expert's count over gate tiles
// (a load round trip per 256 tiles: 16 in a row at 16384 tokens when it was one per 32).
__device__ inline void scan_tile_counts(const MoEParams& p) {
  const int lane = threadIdx.x & 31;
  const int warps = p.blocks * (kThreads / 32);
  for (int expert = block_in_rank(p) * (kThreads / 32) + (threadIdx.x >> 5); expert < p.experts; expert += warps) {
    const int carry = warp_exclusive_scan_n(
        p.gate_tiles,
        [&](int tile) { return __ldcg(p.tile_expert_count + static_cast<size_t>(tile) * p.experts + expert); },
        [&](int tile, int offset) { p.tile_expert_offset[static_cast<size_t>(tile) * p.experts + expert] = offset; });
    if (lane == 0) {
      p.expert_counts[expert] = carry;
      p.expert_kept[expert] = min(carry, p.capacity);
    }
  }
}

// ---- source side ----

// A gate tile that its block routes (gate.cuh routes_in_gate), in the gate's pipeline stages once the
// tile's loads are consumed: the tile's per-expert counts (then, scanned, each expert's stream offset),
// and per choice (token-major, as topk_expert) its expert and its rank among that expert's choices.
struct RoutedTile {
  int* count;   // [E]
  int* expert;  // [tokens * k]
  int* slot;    // [tokens * k]
};
__device__ __forceinline__ RoutedTile routed_tile(char* smem, int experts, int top_k) {
  static_assert(4 * (kMaxExperts + 2 * (kThreads / 32) * kMaxTopK) <= gate_pipeline_bytes(kGateStagesShallow),
                "a routed tile fits the gate's stages");
  int* base = reinterpret_cast<int*>(smem);
  return {base, base + experts, base + experts + (kThreads / 32) * top_k};
}

// stream_offset[e] (shared, [E]): where expert e's rows start in the stream to its owner e / L, whose
// rows are ordered by local expert then token. Warp 0 first copies every kept count into place (eight
// loads per lane in flight: one round trip to L2 for up to 256 experts, where a load per 32 experts
// scanned was one each), then scans each owner's L experts in shared memory.
__device__ inline void build_stream_offsets(const MoEParams& p, int* stream_offset) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x, L = p.local_experts, E = p.experts;
    constexpr int kLoads = 8;
    for (int base = 0; base < E; base += 32 * kLoads) {
      int kept[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int e = base + u * 32 + lane;
        kept[u] = e < E ? __ldcg(p.expert_kept + e) : 0;
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int e = base + u * 32 + lane;
        if (e < E) stream_offset[e] = kept[u];
      }
    }
    __syncwarp();
    for (int owner = 0; owner < p.world_size; ++owner) {
      int before = 0;
      for (int base = 0; base < L; base += 32) {
        const int local = base + lane;
        const int kept = local < L ? stream_offset[owner * L + local] : 0;
        const int inclusive = warp_inclusive_scan(kept);
        if (local < L) stream_offset[owner * L + local] = before + inclusive - kept;
        before += __shfl_sync(0xffffffffu, inclusive, 31);
      }
    }
  }
  sync_workers();
}

// The row of choice `pair` in the stream to its expert's owner, or -1 if capacity dropped it.
__device__ __forceinline__ int stream_row_of(const MoEParams& p, const int* stream_offset, size_t pair, int expert) {
  const int token = static_cast<int>(pair / p.top_k);
  const int slot = __ldcg(p.tile_expert_offset + static_cast<size_t>(token / kGateTileM) * p.experts + expert) +
                   __ldcg(p.slot_in_tile + pair);
  return slot < p.capacity ? stream_offset[expert] + slot : -1;
}

// ---- destination side ----

// In shared memory, built by every block once all counts arrived:
//   stream_start[s * (L+1) + l]: where local expert l's rows start in source s's stream (l = L: its length)
//   seg_start[q], tile_start[q] for segment q = l * P + s (q = L * P: the totals): the segment's first
//   packed row (its rows in the intermediate buffer) and first row tile. A row tile never spans two
//   segments, so its A rows are contiguous in the receive buffer region of one source.
struct DestTables {
  int* stream_start;
  int* seg_start;
  int* tile_start;
};

__host__ __device__ inline int dest_table_ints(int world_size, int local_experts) {
  return world_size * (local_experts + 1) + 2 * (world_size * local_experts + 1);
}

__device__ inline DestTables dest_tables(char* smem, const SmemLayout& layout, const MoEParams& p) {
  int* base = reinterpret_cast<int*>(smem + layout.tables_offset);
  const int streams = p.world_size * (p.local_experts + 1);
  const int segments = p.world_size * p.local_experts + 1;
  return {base, base + streams, base + streams + segments};
}

__device__ __forceinline__ int rows_from(const MoEParams& p, const DestTables& tables, int src, int local) {
  const int* s = tables.stream_start + src * (p.local_experts + 1);
  return s[local + 1] - s[local];
}

// Rows source `src` sends this rank for local expert `local`: from this rank's own counts, or from
// the counts the source published into this rank's signal words.
__device__ __forceinline__ int incoming_count(const MoEParams& p, int src, int local) {
  if (src == p.rank) return __ldcg(p.expert_kept + p.rank * p.local_experts + local);
  return static_cast<int>(__ldcg(p.peers[p.rank].signals + signal_count(p.local_experts, src, local)));
}

// Waits (bounded) for every peer's counts, then builds the tables. Every thread of the block calls it.
// pair_tiles: each local expert's row tiles (over all sources) are made even, by an empty tile after its
// last source's, so that tiles 2i and 2i + 1 always share an expert (two-block cluster tasks).
__device__ inline bool build_dest_tables(const MoEParams& p, const DestTables& tables, bool pair_tiles = false) {
  const int P = p.world_size, L = p.local_experts, stride = L + 1;
  bool ok = true;
  if (threadIdx.x < P && static_cast<int>(threadIdx.x) != p.rank) {
    const uint32_t* flag = p.peers[p.rank].signals + signal_counts_flag(P, L, threadIdx.x);
    ok = wait_at_least<Scope::System>(flag, forward_sequence(p), p, kPhasePeerCounts, threadIdx.x);
  }
  if (!__syncthreads_and(ok)) return false;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // A source's counts scanned 256 at a time (a load round trip each: at one token, one per 32 experts
  // was ~4 µs before any expert task could start).
  for (int src = warp; src < P; src += kThreads / 32) {
    const int before = warp_exclusive_scan_n(
        L, [&](int local) { return incoming_count(p, src, local); },
        [&](int local, int start) { tables.stream_start[src * stride + local] = start; });
    if (lane == 0) tables.stream_start[src * stride + L] = before;
  }
  __syncthreads();
  if (warp == 0) {
    const int segments = P * L;
    int rows_before = 0, tiles_before = 0;
    for (int base = 0; base < segments; base += 32) {
      const int q = base + lane;
      const int rows = q < segments ? rows_from(p, tables, q % P, q / P) : 0;
      int tiles = (rows + kExpertTileM - 1) / kExpertTileM;
      if (pair_tiles && q < segments && q % P == P - 1) {
        int expert_tiles = 0;
        for (int src = 0; src < P; ++src)
          expert_tiles += (rows_from(p, tables, src, q / P) + kExpertTileM - 1) / kExpertTileM;
        tiles += expert_tiles & 1;
      }
      const int rows_incl = warp_inclusive_scan(rows);
      const int tiles_incl = warp_inclusive_scan(tiles);
      if (q < segments) {
        tables.seg_start[q] = rows_before + rows_incl - rows;
        tables.tile_start[q] = tiles_before + tiles_incl - tiles;
      }
      rows_before += __shfl_sync(0xffffffffu, rows_incl, 31);
      tiles_before += __shfl_sync(0xffffffffu, tiles_incl, 31);
    }
    if (lane == 0) {
      tables.seg_start[segments] = rows_before;
      tables.tile_start[segments] = tiles_before;
    }
  }
  __syncthreads();
  return true;
}

// One expert row tile: which segment, where its rows are, how many.
struct RowTile {
  int local, src;
  int rows;         // valid rows (<= kExpertTileM; 0 for the empty tile that pairs an expert's tiles)
  int packed_row0;  // first row in the intermediate buffer
  int stream_row0;  // first row in source src's stream (its region of recv / comb)
};

// `local` is the expert the task's group found (segment_group): only its P sources are searched.
__device__ __forceinline__ RowTile row_tile_of(const MoEParams& p, const DestTables& tables, int row_tile, int local) {
  // invariant: tile_start[lo] <= row_tile < tile_start[hi]
  int lo = local * p.world_size, hi = lo + p.world_size;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tables.tile_start[mid] <= row_tile) lo = mid; else hi = mid;
  }
  RowTile tile;
  tile.local = lo / p.world_size;
  tile.src = lo % p.world_size;
  const int m0 = (row_tile - tables.tile_start[lo]) * kExpertTileM;
  tile.rows = max(0, min(kExpertTileM, tables.seg_start[lo + 1] - tables.seg_start[lo] - m0));
  tile.packed_row0 = tables.seg_start[lo] + m0;
  tile.stream_row0 = tables.stream_start[tile.src * (p.local_experts + 1) + tile.local] + m0;
  return tile;
}

}  // namespace flashdmoe
