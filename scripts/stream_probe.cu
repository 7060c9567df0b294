// Probe: how fast can B blocks stream cold weights from HBM, by three kinds of load? The decode forward's
// expert phase (T = 1) reads 48 MB of GEMM1 weights at ~25 GB/s per block through 64 x 64 TMA boxes; this
// times the same bytes read (1) by plain 16-byte loads, U in flight per thread, (2) by 1D bulk copies
// (cp.async.bulk) of contiguous chunks into a shared-memory ring, (3) by the kernel's 3D weight-panel boxes
// ([E, H, 2I] bf16, 64 columns x 64 rows, 128-byte swizzle) into a ring. Each repetition reads another
// region of a large buffer (L2 cold). Prints GB/s in all and per block. Then the floor of the one-token
// forward: an empty kernel timed the same way (what the events and the launch cost) and plain loads on
// every SM of the other sizes that forward streams (w2 alone, w1 and w2: 25 and 75 MB). A development probe.
// Build: nvcc -std=c++17 -arch=sm_90a -O3 -I csrc -o /tmp/stream_probe scripts/stream_probe.cu
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>
#include "common/host_launch.h"
#include "common/tma.cuh"

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

constexpr size_t kRegion = 48ull << 20;  // Qwen3-30B-A3B's GEMM1 weights of 8 experts: 8 x 2048 x 1536 x 2
constexpr size_t kStride = 80ull << 20;  // regions this far apart: room for the 75 MB read of w1 and w2
constexpr int kRegions = 40;

__global__ void empty_kernel(unsigned* sink) {
  if (threadIdx.x == 1024) *sink = 0;
}

template <int U>
__global__ void __launch_bounds__(256, 1) ldg_stream(const uint4* base, size_t bytes, unsigned* sink) {
  const size_t per_block = bytes / gridDim.x / 16;
  const uint4* p = base + blockIdx.x * per_block;
  uint32_t acc = 0;
  for (size_t i = threadIdx.x; i < per_block; i += 256 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * 256 < per_block ? __ldg(p + i + u * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

__device__ __forceinline__ void wait_parity(uint32_t bar, uint32_t parity) {
  while (!flashdmoe::tma::try_wait_parity(bar, parity)) {
  }
}
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// One producer thread (thread 256) fills a ring of S stages of C bytes; 256 consumers read each stage.
template <int S, int C, bool kBoxes>
__global__ void __launch_bounds__(288, 1) ring_stream(const char* base, size_t bytes, const __grid_constant__ CUtensorMap map,
                                                      int experts, int rows, int cols, unsigned* sink) {
  extern __shared__ __align__(1024) char raw[];
  char* smem = raw + ((1024 - (reinterpret_cast<uintptr_t>(raw) & 1023)) & 1023);
  __shared__ __align__(8) uint64_t full[S], empty[S];
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      flashdmoe::tma::mbarrier_init(static_cast<uint32_t>(__cvta_generic_to_shared(&full[s])), 1);
      flashdmoe::tma::mbarrier_init(static_cast<uint32_t>(__cvta_generic_to_shared(&empty[s])), 8);
    }
    flashdmoe::tma::fence_barrier_init();
  }
  __syncthreads();
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // Units of C bytes: contiguous chunks, or (expert, 128-column tile, 64-row slab) as two 64 x 64 boxes.
  const int col_tiles = cols / 128, slabs = rows / 64;
  const long long units = kBoxes ? static_cast<long long>(experts) * col_tiles * slabs : static_cast<long long>(bytes / C);
  // Boxes: a block takes whole (expert, column tile) tasks, slab by slab, as the kernel does.
  const long long tasks = kBoxes ? static_cast<long long>(experts) * col_tiles : units;
  const long long first = tasks * blockIdx.x / gridDim.x, last = tasks * (blockIdx.x + 1) / gridDim.x;
  const long long my_units = kBoxes ? (last - first) * slabs : last - first;
  if (threadIdx.x == 256) {
    for (long long u = 0; u < my_units; ++u) {
      const int s = static_cast<int>(u % S);
      const uint32_t phase = static_cast<uint32_t>((u / S) & 1);
      if (u >= S) wait_parity(static_cast<uint32_t>(__cvta_generic_to_shared(&empty[s])), phase ^ 1);
      const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&full[s]));
      flashdmoe::tma::arrive_expect_tx(bar, C);
      if constexpr (kBoxes) {
        const long long task = first + u / slabs;
        const int slab = static_cast<int>(u % slabs);
        const int expert = static_cast<int>(task / col_tiles), col = static_cast<int>(task % col_tiles) * 128;
        flashdmoe::tma::load_3d(sbase + s * C, &map, bar, col, slab * 64, expert);
        flashdmoe::tma::load_3d(sbase + s * C + 8192, &map, bar, col + 64, slab * 64, expert);
      } else {
        bulk_load(sbase + s * C, base + (first + u) * C, C, bar);
      }
    }
  } else if (threadIdx.x < 256) {
    uint32_t acc = 0;
    for (long long u = 0; u < my_units; ++u) {
      const int s = static_cast<int>(u % S);
      wait_parity(static_cast<uint32_t>(__cvta_generic_to_shared(&full[s])), static_cast<uint32_t>((u / S) & 1));
      const uint4* v = reinterpret_cast<const uint4*>(smem + s * C);
      for (int i = threadIdx.x; i < C / 16; i += 256) acc ^= v[i].x ^ v[i].w;
      __syncwarp();
      if ((threadIdx.x & 31) == 0) flashdmoe::tma::arrive(static_cast<uint32_t>(__cvta_generic_to_shared(&empty[s])));
    }
    if (acc == 0x12345678u) *sink = acc;
  }
}

static CUtensorMap weight_map(const void* base, int experts, int rows, int cols) {
  CUtensorMap map;
  cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows), static_cast<cuuint64_t>(experts)};
  cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2, static_cast<cuuint64_t>(cols) * rows * 2};
  cuuint32_t box[3] = {64, 64, 1}, elem[3] = {1, 1, 1};
  CUresult r = flashdmoe::tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides,
                                      box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { printf("cuTensorMapEncodeTiled: %d\n", r); exit(1); }
  return map;
}

template <typename Launch>
static void time_it(const char* name, int blocks, Launch&& launch, size_t bytes = kRegion) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int rep = 0; rep < 2 * kRegions; ++rep) {
    CHECK(cudaEventRecord(a));
    launch(rep % kRegions);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (rep >= kRegions / 2) ms.push_back(t);  // the first passes warm the code, not the data
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  const double t = ms[ms.size() / 2];
  printf("%-34s blocks %3d  %7.1f us  %6.2f TB/s  %5.1f GB/s per block\n", name, blocks, t * 1e3, bytes / t / 1e9,
         bytes / t / 1e6 / blocks);
}

int main() {
  char* buf;
  unsigned* sink;
  CHECK(cudaMalloc(&buf, kStride * kRegions));
  CHECK(cudaMemset(buf, 1, kStride * kRegions));
  CHECK(cudaMalloc(&sink, 4));
  const int E = 8, H = 2048, C2 = 1536;  // Qwen3-30B-A3B's w1 of 8 hit experts
  std::vector<CUtensorMap> maps;
  for (int r = 0; r < kRegions; ++r) maps.push_back(weight_map(buf + r * kStride, E, H, C2));
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int blocks : {96, sms}) {
    time_it("ldg 16 B, 8 in flight per thread", blocks, [&](int r) {
      ldg_stream<8><<<blocks, 256>>>(reinterpret_cast<const uint4*>(buf + r * kStride), kRegion, sink); });
    time_it("ldg 16 B, 16 in flight per thread", blocks, [&](int r) {
      ldg_stream<16><<<blocks, 256>>>(reinterpret_cast<const uint4*>(buf + r * kStride), kRegion, sink); });
    auto ring = [&](const char* name, auto kernel, int bytes) {
      CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes + 1024));
      time_it(name, blocks, [&](int r) {
        kernel<<<blocks, 288, bytes + 1024>>>(buf + r * kStride, kRegion, maps[r], E, H, C2, sink); });
    };
    ring("bulk 1D, 6 x 16 KB", ring_stream<6, 16384, false>, 6 * 16384);
    ring("bulk 1D, 4 x 32 KB", ring_stream<4, 32768, false>, 4 * 32768);
    ring("bulk 1D, 12 x 16 KB", ring_stream<12, 16384, false>, 12 * 16384);
    ring("TMA 64x64 boxes, 6 x 16 KB", ring_stream<6, 16384, true>, 6 * 16384);
    ring("TMA 64x64 boxes, 12 x 16 KB", ring_stream<12, 16384, true>, 12 * 16384);
  }
  // The one-token forward of that layer reads w1 (kRegion, timed above) and w2 of its 8 experts.
  const size_t w2_bytes = size_t{E} * (C2 / 2) * H * 2;  // [E, I, H] bf16, I = C2 / 2
  time_it("empty kernel (events, launch)", sms, [&](int) { empty_kernel<<<sms, 256>>>(sink); }, 0);
  for (size_t bytes : {w2_bytes, kRegion + w2_bytes}) {
    char name[64];
    snprintf(name, sizeof name, "ldg 16 B x 8, %.1f MB", bytes / 1e6);
    time_it(name, sms, [&](int r) {
      ldg_stream<8><<<sms, 256>>>(reinterpret_cast<const uint4*>(buf + r * kStride), bytes, sink); }, bytes);
  }
  return 0;
}
