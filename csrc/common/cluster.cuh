// Thread block clusters (sm_90) through PTX: the CTA's rank in its cluster, the cluster barrier, and
// access to a peer CTA's shared memory (its address from mapa; stores and mbarrier arrivals there).
#pragma once
#include <cstdint>

namespace flashdmoe::cluster {

__device__ __forceinline__ uint32_t cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// Every thread of every CTA in the cluster arrives, then waits (release / acquire at cluster scope).
__device__ __forceinline__ void sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// The shared::cluster address of `smem_address` (this CTA's shared::cta address) in CTA `cta`.
__device__ __forceinline__ uint32_t map_shared(uint32_t smem_address, uint32_t cta) {
  uint32_t mapped;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(smem_address), "r"(cta));
  return mapped;
}

__device__ __forceinline__ void store_u32(uint32_t cluster_address, uint32_t value) {
  asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(cluster_address), "r"(value) : "memory");
}

// Arrival on an mbarrier in (possibly) another CTA of the cluster; orders this thread's earlier
// writes before it at cluster scope.
__device__ __forceinline__ void arrive(uint32_t cluster_address) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_address) : "memory");
}

}  // namespace flashdmoe::cluster
