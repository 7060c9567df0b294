// Thread-block clusters (sm_90) through PTX: a block's rank in its cluster, the cluster-wide barrier,
// and the peer block's shared memory (DSMEM): remote mbarrier arrivals, remote stores, and TMA loads
// multicast into every block of the cluster. A remote address is the local one mapped by `mapa`: the
// blocks of a cluster run the same kernel, so a __shared__ object sits at the same offset in each.
#pragma once
#include <cuda.h>
#include <cstdint>

namespace flashdmoe::cluster {

__device__ __forceinline__ uint32_t block_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// Every thread of every block of the cluster: writes before it are visible to the cluster after it.
// Not bounded: call it only where every thread of the cluster is certain to arrive (the kernel's start
// and end, which every path reaches because every wait in between is bounded).
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// The shared address `local` (this block's) in block `rank` of the cluster.
__device__ __forceinline__ uint32_t map_shared(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

// Arrive on an mbarrier of another block of the cluster (address from map_shared), releasing this
// thread's earlier writes (its remote stores included) at cluster scope. The release costs a full memory
// barrier (MEMBAR.ALL.GPU in the SASS): only for arrivals that publish data.
__device__ __forceinline__ void arrive_remote_release(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}
// The same without ordering this thread's memory accesses for the other block: for a stage release,
// where what must precede it (the wgmma reads of the stage) already retired (wgmma.wait_group).
__device__ __forceinline__ void arrive_remote(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}

__device__ __forceinline__ void store_remote(uint32_t remote, int value) {
  asm volatile("st.shared::cluster.s32 [%0], %1;\n" ::"r"(remote), "r"(value) : "memory");
}

// A 3-d TMA box into shared offset `dst` of every block in `mask` (bit r: cluster rank r), each completing
// its bytes on its own barrier at offset `bar`.
__device__ __forceinline__ void load_3d_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                                  int c2, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(mask) : "memory");
}

}  // namespace flashdmoe::cluster
