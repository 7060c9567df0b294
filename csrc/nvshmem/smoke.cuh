// The transport module's smoke test: on every PE one warp sends a patterned payload to the next PE with
// put-with-signal, waits (bounded) for its own signal from the previous PE, then checks the payload it
// received. Proves that this module's NVSHMEM device state is bound to the process's NVSHMEM instance.
#pragma once
#include <cstdint>
#include <nvshmem.h>
#include <nvshmemx.h>

namespace flashdmoe::comm {

// result[] slots written by the smoke kernel.
enum SmokeSlot : int {
  kSmokeMyPe = 0,       // nvshmem_my_pe() on the device
  kSmokePes = 1,        // nvshmem_n_pes() on the device
  kSmokeNextIsP2P = 2,  // 1 when nvshmem_ptr gives a load/store path to the next PE (NVLink / same GPU)
  kSmokeArrived = 3,    // 1 when the previous PE's signal arrived before the deadline
  kSmokeMismatches = 4, // 32-bit words of the received payload that differ from the previous PE's pattern
  kSmokeWaitNs = 5,     // %globaltimer nanoseconds spent waiting for the signal
  kSmokeSlots = 6,
};

__device__ __forceinline__ uint32_t smoke_pattern(int pe, uint64_t sequence, uint32_t word) {
  return static_cast<uint32_t>(pe) * 0x01000193u + static_cast<uint32_t>(sequence) * 0x9e3779b9u + word;
}

__device__ __forceinline__ uint64_t smoke_clock_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(ns));
  return ns;
}

// One warp. `send` and `recv` are `words` 32-bit words each, `signal` one 64-bit word, all on the symmetric
// heap. The signal carries `sequence` (> 0), so repeated runs need no reset, as the kernel's flags.
__global__ void smoke_kernel(uint32_t* send, uint32_t* recv, int words, uint64_t* signal, uint64_t sequence,
                             uint64_t timeout_ns, unsigned long long* result) {
  const int me = nvshmem_my_pe(), pes = nvshmem_n_pes();
  const int lane = threadIdx.x & 31;
  if (pes < 1 || me < 0 || me >= pes) {
    // An unbound (zero) device state: a put would read a null peer-base table. Report it instead.
    if (lane == 0) {
      result[kSmokeMyPe] = me;
      result[kSmokePes] = pes;
      for (int slot = kSmokeNextIsP2P; slot < kSmokeSlots; ++slot) result[slot] = 0;
    }
    return;
  }
  const int next = (me + 1) % pes, prev = (me + pes - 1) % pes;
  for (int i = lane; i < words; i += 32) send[i] = smoke_pattern(me, sequence, i);
  __syncwarp();
  nvshmemx_putmem_signal_nbi_warp(recv, send, static_cast<size_t>(words) * sizeof(uint32_t), signal, sequence,
                                  NVSHMEM_SIGNAL_SET, next);
  // Bounded wait, as the kernel's watchdog: nvshmem_signal_wait_until would hang on a missing peer.
  int arrived = 0;
  uint64_t waited = 0;
  if (lane == 0) {
    const uint64_t start = smoke_clock_ns();
    while (!(arrived = nvshmem_signal_fetch(signal) >= sequence)) {
      waited = smoke_clock_ns() - start;
      if (waited > timeout_ns) break;
    }
    waited = smoke_clock_ns() - start;
  }
  arrived = __shfl_sync(0xffffffffu, arrived, 0);
  unsigned mismatches = 0;
  if (arrived)
    for (int i = lane; i < words; i += 32) mismatches += recv[i] != smoke_pattern(prev, sequence, i);
  for (int offset = 16; offset > 0; offset /= 2) mismatches += __shfl_xor_sync(0xffffffffu, mismatches, offset);
  nvshmem_quiet();  // our put is complete before the host reads the result
  if (lane == 0) {
    result[kSmokeMyPe] = me;
    result[kSmokePes] = pes;
    result[kSmokeNextIsP2P] = nvshmem_ptr(recv, next) != nullptr;
    result[kSmokeArrived] = arrived;
    result[kSmokeMismatches] = mismatches;
    result[kSmokeWaitNs] = waited;
  }
}

}  // namespace flashdmoe::comm
