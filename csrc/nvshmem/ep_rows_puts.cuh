// EpPuts: the backward exchange's publication policy in the NVSHMEM build (backward/ep_rows.cuh). A peer
// marked as an NVSHMEM peer in the table (this rank's own signal words in its entry, as for the forward:
// flashdmoe.parallel.nvshmem_transport.kernel_peer_table) gets its data staged in this rank's symmetric memory
// (EpStage) and sent by puts once the stage is complete; its words and flags go through NVSHMEM's atomic
// and scalar puts. Peers with a load/store pointer keep EpStores' stores, so a team may mix both.
//
// The puts are cut in chunks spread over the blocks (NVSHMEM moves a put to a peer it reaches by
// load/store with the calling threads: a run put by one block would crawl), each thread delivers its
// own (nvshmem_quiet in complete()) before the grid barrier that precedes the ready flags. Destinations
// are symmetric addresses: this rank's own buffer at the offset the data takes at the peer.
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>
#include "backward/ep_rows.cuh"
#include "nvshmem/peer_words.cuh"

namespace flashdmoe {

struct EpPuts {
  static constexpr bool kPuts = true;
  static constexpr int kChunkRows = 32;           // rows per block-wide put
  static constexpr size_t kChunkBytes = 64 << 10;  // bytes per block-wide put of the router's share

  __device__ __forceinline__ static bool via_puts(const EpRowsParams& p, int peer) {
    return peer_words::by_puts(p, peer);
  }
  __device__ __forceinline__ static uint32_t* own_signals(const EpRowsParams& p) { return peer_words::own(p, 0); }
  __device__ __forceinline__ static void set_word(const EpRowsParams& p, int peer, int word, uint32_t value) {
    peer_words::set(p, peer, word, value);
  }
  __device__ __forceinline__ static void set_flag(const EpRowsParams& p, int peer, int word, uint32_t value) {
    peer_words::raise(p, peer, word, value);
  }
  __device__ __forceinline__ static void complete() { nvshmem_quiet(); }

  // Chunk `chunk` of run `run` is this block's when (run + chunk) % blocks == block: every block gets a
  // share of every large run, and small runs spread over the blocks.
  __device__ __forceinline__ static bool mine(const EpRowsParams& p, int run, int chunk) {
    return (run + chunk) % p.blocks == block_in_rank(p);
  }

  // This block's chunks of a run of `count` rows: rows from `src` to `dst` and their words from `src_words`
  // to `dst_words` (either pair null: not sent). Returns the bytes put.
  __device__ static unsigned long long put_rows(const EpRowsParams& p, int run, int peer, char* dst, const char* src,
                                                uint32_t* dst_words, const uint32_t* src_words, int count) {
    unsigned long long bytes = 0;
    for (int chunk = 0; chunk * kChunkRows < count; ++chunk) {
      if (!mine(p, run, chunk)) continue;
      const int first = chunk * kChunkRows, rows = min(kChunkRows, count - first);
      const size_t offset = static_cast<size_t>(first) * p.row_bytes, size = static_cast<size_t>(rows) * p.row_bytes;
      if (dst != nullptr) {
        nvshmemx_putmem_nbi_block(dst + offset, src + offset, size, peer);
        bytes += size;
      }
      if (dst_words != nullptr) {
        nvshmemx_putmem_nbi_block(dst_words + first, src_words + first, 4 * static_cast<size_t>(rows), peer);
        bytes += 4 * static_cast<size_t>(rows);
      }
    }
    return bytes;
  }

  // Every thread of every block, the stage complete (after the first grid barrier).
  template <typename Layout>
  __device__ static void put_staged(const EpRowsParams& p, const Layout& layout, const EpStage& stage) {
    const int P = p.world_size, L = p.local_experts, S = p.stream_rows;
    char* own_recv = static_cast<char*>(p.peers[p.rank].recv);
    char* own_comb = static_cast<char*>(p.peers[p.rank].comb);
    unsigned long long bytes = 0;
    int word = kTrafficNvshmemCombine;
    if (p.direction == EpDirection::ToOwners) {
      // Run (owner, local): stage rows [sent, + count) to the owner's packed rows [place + within, + count),
      // x into recv, dy into comb, the weights into its row words.
      word = kTrafficNvshmemDispatch;
      for (int owner = 0; owner < P; ++owner) {
        if (!via_puts(p, owner)) continue;
        const int owner_first = __ldg(p.sent + owner * L);
        for (int local = 0; local < L; ++local) {
          const int start = __ldg(p.sent + owner * L + local), count = __ldg(p.sent + P * L + owner * L + local);
          const int packed = static_cast<int>(__ldcg(own_signals(p) + layout.place(owner, local))) + start - owner_first;
          // Places of an owner that failed, or counts of a failed forward: never put out of bounds.
          if (count <= 0 || packed < 0 || packed + count > P * S || start < 0 || start + count > p.stage_rows) continue;
          const size_t dst = static_cast<size_t>(packed) * p.row_bytes, src = static_cast<size_t>(start) * p.row_bytes;
          const int run = owner * L + local;
          uint32_t* dst_words = own_signals(p) + layout.row_word(0, packed);
          bytes += put_rows(p, run, owner, own_recv + dst, stage.x_rows() + src, dst_words, stage.weights() + start, count);
          bytes += put_rows(p, run, owner, own_comb + dst, stage.dy_rows() + src, nullptr, nullptr, count);
        }
      }
    } else if (p.direction == EpDirection::BackToSources) {
      // Source's region: own recv rows [src * S, + n) and weight gradients to its comb region [rank] and
      // row words [rank].
      for (int src = 0; src < P; ++src) {
        if (!via_puts(p, src)) continue;
        const int count = min(max(__ldg(p.from_rows + src), 0), S);
        const size_t region = static_cast<size_t>(S) * p.row_bytes;
        bytes += put_rows(p, src, src, p.dx_rows == nullptr ? nullptr : own_comb + p.rank * region,
                          own_recv + src * region, own_signals(p) + layout.row_word(p.rank, 0),
                          stage.weight_grads() + static_cast<size_t>(src) * S, count);
      }
    } else {
      // The share (start of own recv) into each peer's comb region [rank].
      const size_t size = static_cast<size_t>(p.n) * 4, region = static_cast<size_t>(S) * p.row_bytes;
      for (int peer = 0; peer < P; ++peer) {
        if (!via_puts(p, peer)) continue;
        for (size_t at = 0, chunk = 0; at < size; at += kChunkBytes, ++chunk) {
          if (!mine(p, peer, static_cast<int>(chunk))) continue;
          const size_t part = min(kChunkBytes, size - at);
          nvshmemx_putmem_nbi_block(own_comb + p.rank * region + at, own_recv + at, part, peer);
          bytes += part;
        }
      }
    }
    if (threadIdx.x == 0 && bytes) atomicAdd(p.traffic + word, bytes);
  }
};

}  // namespace flashdmoe
