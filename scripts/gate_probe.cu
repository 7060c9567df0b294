// Probe: where does the gate's router GEMM spend its time? Runs the gate's K loop alone (the kernel's
// TileGemm, cp.async pipeline, rows through pointer tables) over T tokens for a few tile shapes, stage
// counts and grid sizes, and prints microseconds per kernel and per K slab. A development probe.
// Build: nvcc -std=c++17 -arch=sm_90a -O3 -I csrc -o /tmp/gate_probe scripts/gate_probe.cu
#include <cuda_bf16.h>
#include <cstdio>
#include <algorithm>
#include <vector>
#include "moe/tile_gemm.cuh"

using namespace flashdmoe;
using bf16 = __nv_bfloat16;

template <int BM, int WARPS_M, int STAGES, bool MMA>
__global__ void __launch_bounds__(256, 1) gate_loop(const bf16* x, const bf16* router, int T, int H, int E, float* sink) {
  extern __shared__ __align__(1024) char smem[];
  __shared__ const bf16* a_rows[BM];
  __shared__ const bf16* b_rows[128];
  using Gemm = TileGemm<bf16, BM, 128, WARPS_M, 8 / WARPS_M, STAGES, true>;
  const int tiles = (T + BM - 1) / BM;
  float keep = 0.f;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    if (threadIdx.x < BM) a_rows[threadIdx.x] = tile * BM + threadIdx.x < T ? x + size_t(tile * BM + threadIdx.x) * H : nullptr;
    if (threadIdx.x < 128) b_rows[threadIdx.x] = threadIdx.x < E ? router + size_t(threadIdx.x) * H : nullptr;
    __syncthreads();
    Gemm gemm;
    if constexpr (MMA) {
      gemm.run(smem, H / 64, [&](uint32_t a, uint32_t b, int k0) {
        Gemm::template load_rows<BM>(a, a_rows, k0, x);
        Gemm::template load_rows<128>(b, b_rows, k0, router);
      });
      gemm.for_each_acc([&](int, int, float v) { keep += v; });
    } else {  // the same copies, no tensor-core work
      const uint32_t base = ptx::smem_addr(smem);
      for (int kt = 0; kt < H / 64; ++kt) {
        const int s = kt % STAGES;
        Gemm::template load_rows<BM>(base + s * Gemm::kStageBytesA, a_rows, kt * 64, x);
        Gemm::template load_rows<128>(base + STAGES * Gemm::kStageBytesA + s * Gemm::kStageBytesB, b_rows, kt * 64, router);
        ptx::cp_async_commit();
        ptx::cp_async_wait<STAGES - 2>();
        __syncthreads();
      }
      ptx::cp_async_wait<0>();
    }
    __syncthreads();
  }
  if (keep == 12345.f) sink[0] = keep;
}

template <int BM, int WARPS_M, int STAGES, bool MMA>
void run(const char* name, const bf16* x, const bf16* r, int T, int H, int E, int blocks, float* sink) {
  using Gemm = TileGemm<bf16, BM, 128, WARPS_M, 8 / WARPS_M, STAGES, true>;
  const int smem = Gemm::kPipelineBytes;
  cudaFuncSetAttribute(gate_loop<BM, WARPS_M, STAGES, MMA>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    cudaEventRecord(a);
    gate_loop<BM, WARPS_M, STAGES, MMA><<<blocks, 256, smem>>>(x, r, T, H, E, sink);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float t;
    cudaEventElapsedTime(&t, a, b);
    if (i >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const int tiles = (T + BM - 1) / BM;
  const int per_block = (tiles + blocks - 1) / blocks;
  const double us = ms[ms.size() / 2] * 1e3;
  printf("%-28s T=%6d H=%5d E=%4d blocks=%4d tile=%3d stages=%d  %8.1f us  %6.3f us/slab  err=%s\n", name, T, H, E,
         blocks, BM, STAGES, us, us / (per_block * (H / 64)), cudaGetErrorString(cudaGetLastError()));
}

int main() {
  const int Tmax = 16384, Hmax = 4096, Emax = 128;
  bf16 *x, *r;
  float* sink;
  cudaMalloc(&x, size_t(Tmax) * Hmax * 2);
  cudaMalloc(&r, size_t(Emax) * Hmax * 2);
  cudaMalloc(&sink, 4);
  cudaMemset(x, 0, size_t(Tmax) * Hmax * 2);
  cudaMemset(r, 0, size_t(Emax) * Hmax * 2);
  run<32, 1, 8, true>("tile32 8st (kernel's)", x, r, 8192, 2048, 32, 132, sink);
  run<32, 1, 4, true>("tile32 4st", x, r, 8192, 2048, 32, 132, sink);
  run<32, 1, 8, false>("tile32 8st copies only", x, r, 8192, 2048, 32, 132, sink);
  run<32, 1, 8, true>("tile32 8st E=128", x, r, 8192, 2048, 128, 132, sink);
  run<64, 2, 6, true>("tile64 6st", x, r, 8192, 2048, 32, 132, sink);
  run<128, 4, 4, true>("tile128 4st", x, r, 8192, 2048, 32, 132, sink);
  run<32, 1, 8, true>("tile32 8st one block", x, r, 32, 2048, 32, 1, sink);
  run<32, 1, 8, true>("tile32 8st small", x, r, 128, 4096, 64, 132, sink);
  run<32, 1, 8, true>("tile32 8st 16384/4096/128", x, r, 16384, 4096, 128, 132, sink);
  run<128, 4, 4, true>("tile128 4st 16384/4096/128", x, r, 16384, 4096, 128, 132, sink);
  return 0;
}
