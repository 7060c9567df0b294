// Bounded waits and the grid barrier. Every spin in the kernel goes through `wait_at_least`, so a
// missing signal ends in an error word the host turns into flashdmoe.KernelTimeout, never a hang.
#pragma once
#include "common/ptx.cuh"
#include "moe/params.cuh"

namespace flashdmoe {

__device__ __forceinline__ void report_timeout(const MoEParams& p, uint32_t phase, uint32_t peer) {
  const unsigned long long word = static_cast<unsigned long long>(kErrorTimeout) |
                                  (static_cast<unsigned long long>(phase & 0xff) << 8) |
                                  (static_cast<unsigned long long>(peer & 0xffff) << 16) |
                                  (static_cast<unsigned long long>(blockIdx.x) << 32);
  atomicCAS(p.error_word, 0ull, word);  // first failure wins; later ones are consequences
}

// Called by one thread. Returns false if the watchdog fired here or another block already failed.
__device__ __forceinline__ bool wait_at_least(const uint32_t* counter, uint32_t target, const MoEParams& p,
                                              uint32_t phase, uint32_t peer) {
  if (ptx::load_acquire_gpu(counter) >= target) return true;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (ptx::load_acquire_gpu(counter) >= target) return true;
    if ((spin & 31) == 0) {
      if (ptx::load_relaxed_u64(p.error_word) != 0) return false;
      if (ptx::global_timer_ns() - start > p.timeout_ns) {
        report_timeout(p, phase, peer);
        return false;
      }
    }
    __nanosleep(64);
  }
}

// Grid-wide barrier over a counter zeroed before the launch: the n-th barrier waits for n * gridDim.x
// arrivals, so no reset is needed inside the launch. All threads of the block call it.
__device__ __forceinline__ bool grid_barrier(const MoEParams& p, uint32_t phase, uint32_t ordinal) {
  __shared__ int barrier_ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool withheld = p.debug_withhold_phase == static_cast<int>(phase) && blockIdx.x == 0;
    bool ok = !withheld;
    if (ok) {
      __threadfence();
      ptx::red_release_add_gpu(p.barrier_counter, 1);
      ok = wait_at_least(p.barrier_counter, ordinal * gridDim.x, p, phase, 0);
    }
    barrier_ok = ok;
  }
  __syncthreads();
  return barrier_ok != 0;
}

}  // namespace flashdmoe
