// Host helpers every persistent kernel's launcher shares: CUDA errors as exceptions, the resident grid
// of a kernel (asked once per kernel, device and shared memory size) and TMA descriptors.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <algorithm>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>
#include "moe/launch.h"
#include "moe/tma_boxes.cuh"

namespace flashdmoe {

inline void throw_on_cuda_error(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

struct ResidentGrid {
  int blocks_per_sm;
  int sms;
};

// Occupancy of (kernel, device, shared memory bytes), asked once and remembered: these driver queries
// cost tens of microseconds, too much for every forward.
inline ResidentGrid resident_grid(const void* kernel, int device, int smem_bytes, int block_threads) {
  struct Entry {
    const void* kernel;
    int device, smem_bytes;
    ResidentGrid grid;
  };
  struct Limit {  // the kernel's dynamic shared memory limit: only ever raised, so cached grids stay valid
    const void* kernel;
    int device, smem_bytes;
  };
  static std::mutex mutex;
  static std::vector<Entry> known;
  static std::vector<Limit> limits;
  std::lock_guard<std::mutex> lock(mutex);
  for (const Entry& e : known)
    if (e.kernel == kernel && e.device == device && e.smem_bytes == smem_bytes) return e.grid;
  Limit* limit = nullptr;
  for (Limit& l : limits)
    if (l.kernel == kernel && l.device == device) limit = &l;
  if (limit == nullptr) {
    limits.push_back({kernel, device, 0});
    limit = &limits.back();
  }
  int sms = 0, smem_optin = 0;
  throw_on_cuda_error(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  throw_on_cuda_error(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                      "shared memory limit");
  if (smem_bytes > smem_optin)
    throw std::invalid_argument("the kernel needs " + std::to_string(smem_bytes) +
                                " bytes of shared memory per block for these experts/top_k; the GPU allows " +
                                std::to_string(smem_optin));
  if (smem_bytes > limit->smem_bytes) {
    throw_on_cuda_error(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
                        "cudaFuncSetAttribute");
    limit->smem_bytes = smem_bytes;
  }
  int blocks_per_sm = 0;
  throw_on_cuda_error(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, block_threads, smem_bytes),
                      "occupancy query");
  if (blocks_per_sm < 1)
    throw std::runtime_error("the kernel cannot be resident on this GPU (0 blocks per SM with " +
                             std::to_string(smem_bytes) + " bytes of shared memory)");
  known.push_back({kernel, device, smem_bytes, {blocks_per_sm, sms}});
  return known.back().grid;
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (the module does not link libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    throw_on_cuda_error(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found),
                        "cuTensorMapEncodeTiled lookup");
    if (found != cudaDriverEntryPointSuccess || fn == nullptr)
      throw std::runtime_error("the CUDA driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12 and Hopper)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A row-major tensor of box.rank dims (innermost first), 2-byte elements, read in 128-byte-swizzled boxes.
inline CUtensorMap make_tensor_map(const void* base, const uint64_t* dims, const TmaBox& box, DType dtype,
                                   const char* what) {
  CUtensorMap map{};
  const int rank = box.rank;
  uint64_t strides[4];
  uint64_t stride = kTmaElementBytes;
  for (int d = 0; d + 1 < rank; ++d) {
    stride *= dims[d];
    strides[d] = stride;
  }
  const uint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult status = tensor_map_encoder()(
      &map, dtype == DType::BFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, rank,
      const_cast<void*>(base), dims, strides, box.dims, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS)
    throw std::runtime_error(std::string("cuTensorMapEncodeTiled failed for ") + what + " (CUresult " +
                             std::to_string(static_cast<int>(status)) + ")");
  return map;
}

// Blocks of `kernel` that can be resident at once in clusters of cluster_blocks (a multiple of it, at most
// `blocks`): clusters need their blocks on SMs of one GPC, which the per-SM occupancy does not count.
inline int resident_cluster_blocks(const void* kernel, int blocks, int block_threads, int smem_bytes,
                                   int cluster_blocks) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks / cluster_blocks * cluster_blocks);
  config.blockDim = dim3(block_threads);
  config.dynamicSmemBytes = smem_bytes;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster_blocks;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  throw_on_cuda_error(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config), "cluster occupancy query");
  if (clusters < 1)
    throw std::runtime_error("the kernel cannot be resident in clusters of " + std::to_string(cluster_blocks) +
                             " blocks on this GPU");
  return std::min(blocks / cluster_blocks, clusters) * cluster_blocks;
}

// A cooperative launch of a persistent kernel: refused (an error, not a deadlock) if the grid cannot be
// co-resident, which the grid barriers need. cluster_blocks > 1 launches clusters of that many blocks
// (the grid a multiple of it).
template <typename Kernel, typename Argument>
void launch_cooperative(Kernel kernel, int grid, int block_threads, int smem_bytes, cudaStream_t stream,
                        const Argument& argument, const char* what, int cluster_blocks = 1) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block_threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeCooperative;
  attributes[0].val.cooperative = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = cluster_blocks;
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  config.attrs = attributes;
  config.numAttrs = cluster_blocks > 1 ? 2 : 1;
  // A driver that refuses cooperative clusters gets the clusters alone: the grid was sized from the
  // cluster occupancy (resident_cluster_blocks), so it is co-resident all the same. Asked once.
  static std::atomic<int> cooperative_clusters{-1};
  if (cluster_blocks > 1 && cooperative_clusters.load() == 0) {
    config.attrs = attributes + 1;
    config.numAttrs = 1;
  }
  cudaError_t status = cudaLaunchKernelEx(&config, kernel, argument);
  if (cluster_blocks > 1 && cooperative_clusters.load() == -1) {
    if (status == cudaErrorInvalidValue || status == cudaErrorNotSupported ||
        status == cudaErrorInvalidConfiguration) {
      (void)cudaGetLastError();
      config.attrs = attributes + 1;
      config.numAttrs = 1;
      status = cudaLaunchKernelEx(&config, kernel, argument);
      if (status == cudaSuccess) cooperative_clusters.store(0);
    } else if (status == cudaSuccess) {
      cooperative_clusters.store(1);
    }
  }
  throw_on_cuda_error(status, what);
}

}  // namespace flashdmoe
