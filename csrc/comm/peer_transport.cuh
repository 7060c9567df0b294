// How the kernel's signals and staged data reach its peers: a transport policy type, chosen per kernel
// instance through the expert variant (WithTransport<Variant, Transport>). The rows and results are always
// written with the same stores (dispatch.cuh, the GEMM2 epilogues) to the addresses of the peer table;
// the policy owns what happens at each publication point: the counts, rows-ready and results-done flags
// (and, for NVSHMEM peers, the puts of the staged rows and results, with the grid barriers they add).
//
// P2PTransport (every instance of flashdmoe_cuda): the peer table holds NVLink / same-GPU pointers, the
// data is already in the peer when the flag is stored (dispatch.cuh's functions, unchanged).
// NvshmemTransport (flashdmoe_nvshmem only, csrc/nvshmem/nvshmem_transport.cuh): see there.
#pragma once
#include <type_traits>
#include "moe/dispatch.cuh"

namespace flashdmoe {

struct P2PTransport {
  // Whether the transport can relay rows through another node's rank (MoEParams::relay).
  static constexpr bool kRelays = false;
  // Grid barriers publish_rows_ready runs after the dispatch barrier (publish_results runs none).
  __device__ __forceinline__ static uint32_t rows_barriers(const MoEParams&) { return 0; }
  // A one-rank decode batch is routed by its gate (gate.cuh routes_in_gate).
  static constexpr bool kRoutesInGate = true;
  template <typename Element>
  __device__ __forceinline__ static void publish_counts(const MoEParams& p) { flashdmoe::publish_counts(p); }
  // Every thread of every block; false when the launch failed (block-uniform).
  template <typename Element>
  __device__ __forceinline__ static bool publish_rows_ready(const MoEParams& p, uint32_t) {
    flashdmoe::publish_rows_ready(p);
    return true;
  }
  template <typename Element>
  __device__ __forceinline__ static void publish_empty_results(const MoEParams& p, const DestTables& tables) {
    flashdmoe::publish_empty_results(p, tables);
  }
  template <typename Element>
  __device__ __forceinline__ static void publish_results_done(const MoEParams& p, int src) {
    flashdmoe::publish_results_done(p, src);
  }
  // Every thread of every block after the experts barrier: the results already went out tile by tile.
  template <typename Element>
  __device__ __forceinline__ static bool publish_results(const MoEParams&, uint32_t) { return true; }
};

// An expert variant whose kernel instance publishes through `Transport` (every tile parameter inherited).
template <typename Variant, typename Transport>
struct WithTransport : Variant {
  using PeerTransport = Transport;
};

template <typename Variant, typename = void>
struct PeerTransportOf {
  using type = P2PTransport;
};
template <typename Variant>
struct PeerTransportOf<Variant, std::void_t<typename Variant::PeerTransport>> {
  using type = typename Variant::PeerTransport;
};
// The transport of a variant (also through SavingPre<WithTransport<...>>); P2PTransport by default.
template <typename Variant>
using peer_transport_t = typename PeerTransportOf<Variant>::type;

}  // namespace flashdmoe
