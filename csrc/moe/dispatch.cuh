// Dispatch: every kept choice gets its row in the stream to its expert's owner, and the token's row is
// written there: straight into the owner's receive buffer, region [this rank] (its own buffer for its
// own experts, so that every expert tile reads contiguous rows). Counts go out before the rows (peers
// size their task lists from them), a rows-ready flag after.
#pragma once
#include "common/tma.cuh"
#include "moe/routing.cuh"
#include "moe/smem_tiles.cuh"

namespace flashdmoe {

// Rank-block 0: this rank's kept counts for each peer's experts into the peer's signal words, then the
// counts flag (release, system scope).
__device__ inline void publish_counts(const MoEParams& p) {
  if (block_in_rank(p) != 0 || p.silent || p.world_size == 1) return;
  const int P = p.world_size, L = p.local_experts;
  // Our own experts' counts too, into our own words: with them the words hold every source's counts once
  // the launch ends, which a team's backward reads (flashdmoe/backward/ep_backward.py).
  for (int i = threadIdx.x; i < P * L; i += kThreads) {
    const int owner = i / L, local = i % L;
    p.peers[owner].signals[signal_count(L, p.rank, local)] = static_cast<uint32_t>(__ldcg(p.expert_kept + i));
  }
  sync_workers();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int owner = 0; owner < P; ++owner)
      if (owner != p.rank) ptx::store_release_sys(p.peers[owner].signals + signal_counts_flag(P, L, p.rank), forward_sequence(p));
  }
}

// The hierarchical exchange's batch regions in this rank's relay buffer (RelayParams): the one it sends
// node `node`, and the one it receives from node `node`; a region's row count, records and rows.
__device__ __forceinline__ char* relay_outgoing(const MoEParams& p, int node) {
  return p.relay.buffer + static_cast<size_t>(node) * p.relay.batch_bytes;
}
__device__ __forceinline__ char* relay_incoming(const MoEParams& p, int node) {
  return p.relay.buffer + static_cast<size_t>(p.world_size / p.relay.ranks_per_node + node) * p.relay.batch_bytes;
}
__device__ __forceinline__ uint32_t* batch_count(char* region) { return reinterpret_cast<uint32_t*>(region); }
__device__ __forceinline__ RelayRecord* batch_records(char* region) { return reinterpret_cast<RelayRecord*>(region + kRelayHeaderBytes); }
__device__ __forceinline__ char* batch_rows(const MoEParams& p, char* region) { return region + p.relay.rows_offset; }

// One warp per token: its k rows. The row is read once, 8 x 16 bytes per lane at a time (4 KB in flight
// per warp), and each piece is written to every destination before the next is read. Bytes written to
// peers are counted. With the hierarchical exchange, a row for owners on another node goes once into
// that node's outgoing batch instead (a slot taken by atomic: the batch's order does not matter, each
// row lands where its records say), with the token's k records for that node (kRelays: the NVSHMEM
// build's instances). Worker threads only.
// `route(pair, expert, row)` gives a choice's expert and stream row (lanes < k, one pair each); tokens go
// to warps `first_warp`, `first_warp + warps`, ...
template <typename Element, bool kRelays, typename Route>
__device__ inline void dispatch_rows(const MoEParams& p, int first_warp, int warps, Route&& route) {
  constexpr int kUnroll = 8;
  const int lane = threadIdx.x & 31, H = p.hidden, k = p.top_k, L = p.local_experts;
  const int row_chunks = H / kChunkElements<Element>;
  const Element* x = static_cast<const Element*>(p.x);
  unsigned long long sent = 0;
  for (int token = first_warp; token < p.tokens; token += warps) {
    const size_t first = static_cast<size_t>(token) * k;
    const int4* src = reinterpret_cast<const int4*>(x + static_cast<size_t>(token) * H);
    // The row's first piece is loaded before the routing it does not depend on (at one token a copy is a
    // chain of round trips to memory: the row, the expert, its offset).
    int4 piece[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = u * 32 + lane;
      if (c < row_chunks) piece[u] = __ldg(src + c);
    }
    int my_expert = 0, my_row = -1;
    if (lane < k) {
      route(first + lane, my_expert, my_row);
      p.topk_row[first + lane] = my_row;
    }
    // Lane j's choice is copied unless dropped (counted on the host from expert_counts).
    const bool copy_mine = my_row >= 0;
    uint32_t copies = __ballot_sync(0xffffffffu, copy_mine);
    uint32_t relay_nodes = 0;  // other nodes this token's row goes to as a batch row
    int node_slot = 0;         // lane b: the row's slot in node b's batch
    if (kRelays && p.relay.ranks_per_node > 0) {
      const int G = p.relay.ranks_per_node, node = my_expert / L / G;
      const bool relayed = copy_mine && node != p.rank / G;
      copies &= ~__ballot_sync(0xffffffffu, relayed);
      relay_nodes = __reduce_or_sync(0xffffffffu, relayed ? 1u << node : 0u);
      if ((relay_nodes >> lane) & 1u) node_slot = static_cast<int>(atomicAdd(batch_count(relay_outgoing(p, lane)), 1u));
      for (uint32_t rest = relay_nodes; rest != 0; rest &= rest - 1) {
        const int b = __ffs(rest) - 1;
        const int slot = __shfl_sync(0xffffffffu, node_slot, b);
        if (lane < k)
          batch_records(relay_outgoing(p, b))[static_cast<size_t>(slot) * k + lane] =
              relayed && node == b ? RelayRecord{my_expert / L, my_row} : RelayRecord{-1, -1};
      }
    }
    if (copies == 0 && relay_nodes == 0) continue;
    for (int c0 = 0; c0 < row_chunks; c0 += 32 * kUnroll) {
      if (c0 > 0) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int c = c0 + u * 32 + lane;
          if (c < row_chunks) piece[u] = __ldg(src + c);
        }
      }
      for (uint32_t rest = copies; rest != 0; rest &= rest - 1) {
        const int j = __ffs(rest) - 1;
        const int row = __shfl_sync(0xffffffffu, my_row, j);
        const int owner = __shfl_sync(0xffffffffu, my_expert, j) / L;
        int4* dst = reinterpret_cast<int4*>(static_cast<Element*>(p.peers[owner].recv) +
                                            (static_cast<size_t>(p.rank) * p.stream_rows + row) * H);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int c = c0 + u * 32 + lane;
          if (c < row_chunks) dst[c] = piece[u];
        }
        if (c0 == 0 && owner != p.rank) sent += static_cast<unsigned long long>(H) * sizeof(Element);
      }
      for (uint32_t rest = relay_nodes; rest != 0; rest &= rest - 1) {
        const int b = __ffs(rest) - 1;
        const int slot = __shfl_sync(0xffffffffu, node_slot, b);
        char* region = relay_outgoing(p, b);
        int4* dst = reinterpret_cast<int4*>(batch_rows(p, region) + static_cast<size_t>(slot) * H * sizeof(Element));
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int c = c0 + u * 32 + lane;
          if (c < row_chunks) dst[c] = piece[u];
        }
      }
    }
  }
  if (lane == 0 && sent) atomicAdd(p.traffic, sent);
  tma::fence_proxy_async_global();                // the expert tiles may read these rows with TMA
  if (p.world_size > 1) __threadfence_system();  // rows reach peers before the rows-ready flag
}

// The rank's dispatch, a warp per token over all its blocks, from the routing in global memory.
template <typename Element, bool kRelays>
__device__ inline void dispatch_rows(const MoEParams& p, const int* stream_offset) {
  dispatch_rows<Element, kRelays>(p, block_in_rank(p) * (kThreads / 32) + (threadIdx.x >> 5),
                                  p.blocks * (kThreads / 32), [&](size_t pair, int& expert, int& row) {
                                    expert = __ldcg(p.topk_expert + pair);
                                    row = stream_row_of(p, stream_offset, pair, expert);
                                  });
}

// The offsets pass and the dispatch of a tile routed in the gate (routes_in_gate: one rank, a token per
// worker warp at most), by the block that finished the tile, from what the gate left in shared memory.
// One tile: an expert's offset over tiles is 0, its kept rows the first `capacity` in token order, and
// its stream offset (one owner) the kept rows of the experts before it. Worker threads.
template <typename Element>
__device__ inline void route_gate_tile(const MoEParams& p, char* smem) {
  const RoutedTile tile = routed_tile(smem, p.experts, p.top_k);
  const int E = p.experts;
  for (int expert = threadIdx.x; expert < E; expert += kThreads) {
    const int count = tile.count[expert], kept = min(count, p.capacity);
    p.tile_expert_offset[expert] = 0;
    p.expert_counts[expert] = count;
    p.expert_kept[expert] = kept;
    tile.count[expert] = kept;
  }
  sync_workers();
  if (threadIdx.x < 32)  // in place: each pass loads its counts before it stores any
    warp_exclusive_scan_n(E, [&](int e) { return tile.count[e]; }, [&](int e, int start) { tile.count[e] = start; });
  sync_workers();
  dispatch_rows<Element, false>(p, threadIdx.x >> 5, kThreads / 32, [&](size_t pair, int& expert, int& row) {
    expert = tile.expert[pair];
    const int slot = tile.slot[pair];
    row = slot < p.capacity ? tile.count[expert] + slot : -1;
  });
}

// Rank-block 0, after the rank's dispatch barrier: tell every peer its rows from this rank are in place.
__device__ inline void publish_rows_ready(const MoEParams& p) {
  if (block_in_rank(p) != 0 || threadIdx.x != 0 || p.silent) return;
  const int P = p.world_size, L = p.local_experts;
  __threadfence_system();
  for (int owner = 0; owner < P; ++owner)
    if (owner != p.rank) ptx::store_release_sys(p.peers[owner].signals + signal_rows_ready(P, L, p.rank), forward_sequence(p));
}

// Results-done flag into source `src`'s signal words (this rank finished every result row for it).
__device__ __forceinline__ void publish_results_done(const MoEParams& p, int src) {
  if (p.silent) return;
  __threadfence_system();
  ptx::store_release_sys(p.peers[src].signals + signal_results_done(p.world_size, p.local_experts, p.rank),
                         forward_sequence(p));
}

// Rank-block 0, once the tables exist: sources that sent this rank nothing are done already.
__device__ inline void publish_empty_results(const MoEParams& p, const DestTables& tables) {
  if (block_in_rank(p) != 0 || threadIdx.x != 0) return;
  for (int src = 0; src < p.world_size; ++src)
    if (src != p.rank && tables.stream_start[src * (p.local_experts + 1) + p.local_experts] == 0)
      publish_results_done(p, src);
}

}  // namespace flashdmoe
