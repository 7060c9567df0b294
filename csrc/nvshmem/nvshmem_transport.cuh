// NvshmemTransport: peers without a load/store path are reached through NVSHMEM's device API; peers with
// one keep P2PTransport's stores (a team may mix both: "auto"). Only flashdmoe_nvshmem compiles this.
//
// The host marks an NVSHMEM peer q in the peer table with this rank's own `signals` pointer (never a
// mapping's address) and points its `recv` / `comb` entries at this rank's own symmetric buffers
// (flashdmoe.parallel.nvshmem_transport.kernel_peer_table), so the kernel's unchanged stores stage the data
// locally, in regions whose later contents are not needed yet:
//   rows for q      -> own comb region [q] (q's results for this rank arrive there only after q got the rows)
//   results for q   -> own recv region [q] (q's input rows there are dead once GEMM1 of their tile is done,
//                      which GEMM2 of the tile waits for)
// Each region is laid out as the peer's destination region, so one contiguous range per (peer, phase)
// moves it, only routed rows travel, each block of the rank putting its slice after the phase's grid
// barrier (NVSHMEM copies a put to a peer it reaches by load/store with the calling threads), then a
// grid barrier before the flags. The counts and flags are single 32-bit words (nvshmem_uint32_p /
// nvshmem_uint32_atomic_set) set after the data is complete (nvshmem_quiet; nvshmem_fence for the counts), so the waits of
// the receiving rank (bounded loads of its own signal words, sequence numbers, watchdog) are the same for
// both transports. Symmetric addresses are this rank's own buffers (peers[rank]), as NVSHMEM requires.
// The bytes of each put also go into the NVSHMEM traffic words (kTrafficNvshmemDispatch / Combine); the
// totals already count them, as the staging stores are addressed to the peer's entry.
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>
#include "comm/peer_transport.cuh"
#include "nvshmem/peer_words.cuh"

namespace flashdmoe {

struct NvshmemTransport {
  __device__ __forceinline__ static bool via_nvshmem(const MoEParams& p, int peer) {
    return peer_words::by_puts(p, peer);
  }
  __device__ __forceinline__ static uint32_t* own_signal(const MoEParams& p, int index) {
    return peer_words::own(p, index);
  }
  template <typename Element>
  __device__ __forceinline__ static char* own_region(void* buffer, const MoEParams& p, int region) {
    return static_cast<char*>(buffer) + static_cast<size_t>(region) * p.stream_rows * p.hidden * sizeof(Element);
  }
  // Rows this rank sends `owner` (its kept choices of owner's experts), as the stream is dense from row 0.
  __device__ __forceinline__ static size_t rows_to(const MoEParams& p, int owner) {
    size_t rows = 0;
    for (int local = 0; local < p.local_experts; ++local) rows += __ldcg(p.expert_kept + owner * p.local_experts + local);
    return rows;
  }
  // Rows `src` sent this rank: the counts it published into this rank's signal words.
  __device__ __forceinline__ static size_t rows_from(const MoEParams& p, int src) {
    size_t rows = 0;
    for (int local = 0; local < p.local_experts; ++local)
      rows += __ldcg(own_signal(p, signal_count(p.local_experts, src, local)));
    return rows;
  }

  // Worker threads of every block (as publish_counts).
  template <typename Element>
  __device__ static void publish_counts(const MoEParams& p) {
    if (block_in_rank(p) != 0 || p.silent || p.world_size == 1) return;
    const int P = p.world_size, L = p.local_experts;
    for (int i = threadIdx.x; i < P * L; i += kThreads) {
      const int owner = i / L, local = i % L;
      if (via_nvshmem(p, owner)) continue;  // our own experts' counts too (dispatch.cuh publish_counts)
      p.peers[owner].signals[signal_count(L, p.rank, local)] = static_cast<uint32_t>(__ldcg(p.expert_kept + i));
    }
    sync_workers();
    if (threadIdx.x != 0) return;
    __threadfence_system();
    for (int owner = 0; owner < P; ++owner) {
      if (owner == p.rank) continue;
      if (via_nvshmem(p, owner)) {
        for (int local = 0; local < L; ++local)
          nvshmem_uint32_p(own_signal(p, signal_count(L, p.rank, local)),
                           static_cast<uint32_t>(__ldcg(p.expert_kept + owner * L + local)), owner);
        nvshmem_fence();  // the counts land before their flag
      }
      peer_words::raise(p, owner, signal_counts_flag(P, L, p.rank), forward_sequence(p));
    }
  }

  // This block's share of one contiguous put: [begin, end) of `bytes`, in 16-byte pieces.
  __device__ __forceinline__ static void block_slice(const MoEParams& p, size_t bytes, size_t& begin, size_t& end) {
    const size_t pieces = bytes / 16, per_block = (pieces + p.blocks - 1) / p.blocks;
    begin = min(pieces, per_block * block_in_rank(p)) * 16;
    end = min(pieces, per_block * (block_in_rank(p) + 1)) * 16;
    if (block_in_rank(p) == p.blocks - 1) end = bytes;
  }

  // Every thread of every block: each NVSHMEM peer's staged region [from `staging`, region `peer`] into
  // the peer's `buffer` region [rank], each block putting its slice (block-wide puts: NVSHMEM moves P2P
  // bytes with the calling threads, so one thread or warp would crawl), completed by every thread
  // (quiet), then a grid barrier; the caller then raises the flags. `rows_of(peer)` sizes each put.
  template <typename Element, typename RowsOf>
  __device__ static bool put_regions(const MoEParams& p, void* buffer, void* staging, RowsOf rows_of,
                                     int traffic_word, uint32_t phase, uint32_t ordinal) {
    if (!p.silent) {
      for (int peer = 0; peer < p.world_size; ++peer) {
        if (!via_nvshmem(p, peer)) continue;
        const size_t bytes = rows_of(peer) * p.hidden * sizeof(Element);
        size_t begin, end;
        block_slice(p, bytes, begin, end);
        if (end > begin)
          nvshmemx_putmem_nbi_block(own_region<Element>(buffer, p, p.rank) + begin,
                                    own_region<Element>(staging, p, peer) + begin, end - begin, peer);
        if (block_in_rank(p) == 0 && threadIdx.x == 0 && bytes)
          atomicAdd(p.traffic + traffic_word, static_cast<unsigned long long>(bytes));
      }
      nvshmem_quiet();  // this thread's part delivered before the barrier, so before any flag
    }
    return grid_barrier(p, phase, ordinal);
  }

  // The grid barriers publish_rows_ready runs: the puts', and with relays the forwarded batches'.
  __device__ __forceinline__ static uint32_t rows_barriers(const MoEParams& p) {
    return p.relay.ranks_per_node > 0 ? 2 : 1;
  }
  static constexpr bool kRelays = true;
  // Its instances serve teams: the one-rank decode routing (gate.cuh routes_in_gate) is not compiled in.
  static constexpr bool kRoutesInGate = false;

  // ---- the hierarchical exchange (MoEParams::relay) ----
  __device__ __forceinline__ static int nodes(const MoEParams& p) { return p.world_size / p.relay.ranks_per_node; }
  __device__ __forceinline__ static int node_of(const MoEParams& p, int rank) { return rank / p.relay.ranks_per_node; }
  // This rank's relay on node b (the rank with its index there), and the source on node a a relay serves.
  __device__ __forceinline__ static int same_index_on(const MoEParams& p, int node) {
    return node * p.relay.ranks_per_node + p.rank % p.relay.ranks_per_node;
  }
  // Rows for `owner` travel in a batch through a relay (another node), not by the owner's own put.
  __device__ __forceinline__ static bool relayed(const MoEParams& p, int owner) {
    return p.relay.ranks_per_node > 0 && node_of(p, owner) != node_of(p, p.rank);
  }

  // Thread 0 of each block: bounded waits, each node's relay (or source) in turn; block-uniform answer.
  template <typename Wait>
  __device__ static bool each_other_node(const MoEParams& p, Wait&& wait) {
    __shared__ int all_ok;
    if (threadIdx.x == 0) {
      bool ok = true;
      for (int b = 0; b < nodes(p) && ok; ++b)
        if (b != node_of(p, p.rank)) ok = wait(b);
      all_ok = ok;
    }
    __syncthreads();
    return all_ok != 0;
  }

  // Every thread of every block: this rank's batch for each other node (count, records, rows) into its
  // relay's incoming region [this node], this block's slices of the two contiguous ranges.
  template <typename Element>
  __device__ static void put_batches(const MoEParams& p) {
    const size_t row_bytes = static_cast<size_t>(p.hidden) * sizeof(Element);
    for (int b = 0; b < nodes(p); ++b) {
      if (b == node_of(p, p.rank)) continue;
      char* out = relay_outgoing(p, b);
      char* in = relay_incoming(p, node_of(p, p.rank));  // the same offsets in the relay's buffer
      const uint32_t rows = __ldcg(batch_count(out));
      const size_t record_bytes = relay_record_bytes(static_cast<int>(rows), p.top_k);
      const size_t total = record_bytes + rows * row_bytes;
      size_t begin, end;
      block_slice(p, record_bytes, begin, end);
      const int relay = same_index_on(p, b);
      if (end > begin) nvshmemx_putmem_nbi_block(in + begin, out + begin, end - begin, relay);
      block_slice(p, rows * row_bytes, begin, end);
      if (end > begin)
        nvshmemx_putmem_nbi_block(batch_rows(p, in) + begin, batch_rows(p, out) + begin, end - begin, relay);
      if (block_in_rank(p) == 0 && threadIdx.x == 0) {
        atomicAdd(p.traffic + kTrafficDispatch, static_cast<unsigned long long>(total));
        atomicAdd(p.traffic + kTrafficNvshmemDispatch, static_cast<unsigned long long>(total));
      }
    }
  }

  // Every worker of every block, at a relay: each other node's source batch (its sources with this rank's
  // index there) stored row by row into the owners on this node, region [source], at each record's row;
  // a warp per batch row. The rows then sit where the source's own stores would have put them.
  template <typename Element>
  __device__ static void forward_batches(const MoEParams& p) {
    const int H = p.hidden, k = p.top_k, lane = threadIdx.x & 31;
    const int row_chunks = H / kChunkElements<Element>;
    const int warps = p.blocks * (kThreads / 32);
    unsigned long long sent = 0;
    for (int a = 0; a < nodes(p); ++a) {
      if (a == node_of(p, p.rank)) continue;
      const int src = same_index_on(p, a);
      char* in = relay_incoming(p, a);
      const int rows = static_cast<int>(*reinterpret_cast<volatile uint32_t*>(batch_count(in)));
      const RelayRecord* records = batch_records(in);
      for (int slot = block_in_rank(p) * (kThreads / 32) + (threadIdx.x >> 5); slot < rows; slot += warps) {
        RelayRecord mine{-1, -1};
        if (lane < k) {
          const int2 raw = __ldcv(reinterpret_cast<const int2*>(records) + static_cast<size_t>(slot) * k + lane);
          mine = RelayRecord{raw.x, raw.y};
        }
        const uint32_t targets = __ballot_sync(0xffffffffu, mine.owner >= 0);
        const int4* from = reinterpret_cast<const int4*>(batch_rows(p, in) + static_cast<size_t>(slot) * H * sizeof(Element));
        for (uint32_t rest = targets; rest != 0; rest &= rest - 1) {
          const int j = __ffs(rest) - 1;
          const int owner = __shfl_sync(0xffffffffu, mine.owner, j);
          const int row = __shfl_sync(0xffffffffu, mine.row, j);
          int4* to = reinterpret_cast<int4*>(static_cast<Element*>(p.peers[owner].recv) +
                                             (static_cast<size_t>(src) * p.stream_rows + row) * H);
          for (int c = lane; c < row_chunks; c += 32) to[c] = __ldcv(from + c);
          if (owner != p.rank) sent += static_cast<unsigned long long>(H) * sizeof(Element);
        }
      }
    }
    if (lane == 0 && sent) atomicAdd(p.traffic + kTrafficDispatch, sent);
    tma::fence_proxy_async_global();  // the owners' expert tiles read these rows with TMA
    __threadfence_system();
  }

  // Every thread of every block, after the rank's dispatch barrier (the staged rows and batches are
  // complete). Direct: each NVSHMEM owner's staged rows (own comb region [q]) into its recv region
  // [rank], then its rows-ready flag. Hierarchical: an owner on another node gets this rank's rows from
  // this rank's relay there instead: the batches go out, and then this rank, as a relay, stores the
  // batches it received and raises the rows-ready flags of their sources at the owners on its node.
  template <typename Element>
  __device__ static bool publish_rows_ready(const MoEParams& p, uint32_t ordinal) {
    const int P = p.world_size, L = p.local_experts;
    const bool relays = p.relay.ranks_per_node > 0;
    const uint32_t sequence = forward_sequence(p);
    // A relay's region for this rank is free once it stored the previous batch (sequence - 1).
    if (relays && !p.silent && !each_other_node(p, [&](int b) {
          const int relay = same_index_on(p, b);
          return wait_at_least<Scope::System>(own_signal(p, signal_relay_free(P, L, relay)), sequence - 1, p,
                                              kPhaseRelayFree, relay);
        }))
      return false;
    if (relays && !p.silent) put_batches<Element>(p);
    auto rows_of = [&](int owner) { return relayed(p, owner) ? 0 : rows_to(p, owner); };
    if (!put_regions<Element>(p, p.peers[p.rank].recv, p.peers[p.rank].comb, rows_of, kTrafficNvshmemDispatch,
                              kPhaseDispatchDone, ordinal))
      return false;
    if (block_in_rank(p) == 0 && threadIdx.x == 0 && !p.silent) {
      __threadfence_system();
      for (int owner = 0; owner < P; ++owner)
        if (owner != p.rank && !relayed(p, owner)) peer_words::raise(p, owner, signal_rows_ready(P, L, p.rank), sequence);
      if (relays)
        for (int b = 0; b < nodes(p); ++b)
          if (b != node_of(p, p.rank)) {
            *batch_count(relay_outgoing(p, b)) = 0;  // put and delivered (quiet, barrier): the next forward's count
            peer_words::raise(p, same_index_on(p, b), signal_relay_in(P, L, p.rank), sequence);
          }
    }
    // As a relay: every other node's batch for this rank, stored into the owners here.
    if (relays && !each_other_node(p, [&](int a) {
          const int src = same_index_on(p, a);
          return wait_at_least<Scope::System>(own_signal(p, signal_relay_in(P, L, src)), sequence, p,
                                              kPhaseRelayIn, src);
        }))
      return false;
    if (!relays) return true;
    if (threadIdx.x < kThreads) forward_batches<Element>(p);
    if (!grid_barrier(p, kPhaseRelayForwarded, ordinal + 1)) return false;
    if (block_in_rank(p) != 0 || threadIdx.x != 0 || p.silent) return true;
    __threadfence_system();
    for (int a = 0; a < nodes(p); ++a) {
      if (a == node_of(p, p.rank)) continue;
      const int src = same_index_on(p, a);
      for (int owner = node_of(p, p.rank) * p.relay.ranks_per_node, last = owner + p.relay.ranks_per_node;
           owner < last; ++owner) {
        if (owner == p.rank)
          ptx::store_release_sys(own_signal(p, signal_rows_ready(P, L, src)), sequence);
        else
          peer_words::raise(p, owner, signal_rows_ready(P, L, src), sequence);
      }
      peer_words::raise(p, src, signal_relay_free(P, L, p.rank), sequence);
    }
    return true;
  }

  // One thread, as a tile completes `src`'s results: a peer-pointer source gets its flag now; an
  // NVSHMEM source gets its results in one block-wide put per block after the experts (publish_results).
  template <typename Element>
  __device__ static void publish_results_done(const MoEParams& p, int src) {
    if (!via_nvshmem(p, src)) flashdmoe::publish_results_done(p, src);
  }

  template <typename Element>
  __device__ static void publish_empty_results(const MoEParams& p, const DestTables& tables) {
    if (block_in_rank(p) != 0 || threadIdx.x != 0) return;
    for (int src = 0; src < p.world_size; ++src)
      if (src != p.rank && !via_nvshmem(p, src) && tables.stream_start[src * (p.local_experts + 1) + p.local_experts] == 0)
        flashdmoe::publish_results_done(p, src);
  }

  // Every thread of every block, after the experts barrier (every result is staged): the staged results
  // (own recv region [src]) into each NVSHMEM source's comb region [rank], then its results-done flag.
  // Complete, not only ordered (quiet): the staging region is reused by this rank's next forward.
  template <typename Element>
  __device__ static bool publish_results(const MoEParams& p, uint32_t ordinal) {
    auto rows_of = [&](int src) { return rows_from(p, src); };
    if (!put_regions<Element>(p, p.peers[p.rank].comb, p.peers[p.rank].recv, rows_of, kTrafficNvshmemCombine,
                              kPhaseExpertsDone, ordinal))
      return false;
    if (block_in_rank(p) != 0 || threadIdx.x != 0 || p.silent) return true;
    for (int src = 0; src < p.world_size; ++src)
      if (via_nvshmem(p, src))
        peer_words::raise(p, src, signal_results_done(p.world_size, p.local_experts, p.rank), forward_sequence(p));
    return true;
  }
};

}  // namespace flashdmoe
