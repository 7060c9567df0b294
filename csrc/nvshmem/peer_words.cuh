// How a rank reaches one peer's signal words in the NVSHMEM build, shared by the forward's transport
// (nvshmem_transport.cuh) and the backward exchange's (ep_rows_puts.cuh). Both kernels' parameters hold
// the same peer table (`peers[q].signals`, `rank`); the host marks a peer reached by puts with this
// rank's own signal words in its entry (flashdmoe.parallel.nvshmem_transport.kernel_peer_table), so a word for
// such a peer is addressed in this rank's own (symmetric) signals and put, and any other peer's is stored.
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>
#include "common/ptx.cuh"

namespace flashdmoe::peer_words {

template <typename Params>
__device__ __forceinline__ bool by_puts(const Params& p, int peer) {
  return peer != p.rank && p.peers[peer].signals == p.peers[p.rank].signals;
}

template <typename Params>
__device__ __forceinline__ uint32_t* own(const Params& p, int word) {
  return p.peers[p.rank].signals + word;
}

// A plain word (counts, places): ordered by the caller's fence / quiet before the flag that covers it.
template <typename Params>
__device__ __forceinline__ void set(const Params& p, int peer, int word, uint32_t value) {
  if (by_puts(p, peer))
    nvshmem_uint32_p(own(p, word), value, peer);
  else
    p.peers[peer].signals[word] = value;
}

// A flag (a sequence number the peer waits for): after everything it covers is delivered.
template <typename Params>
__device__ __forceinline__ void raise(const Params& p, int peer, int word, uint32_t value) {
  if (by_puts(p, peer))
    nvshmem_uint32_atomic_set(own(p, word), value, peer);
  else
    ptx::store_release_sys(p.peers[peer].signals + word, value);
}

}  // namespace flashdmoe::peer_words
