// Rings of shared-memory stages handed between a producer and consumers through mbarriers, and a
// position in such a ring (in the spirit of CUTLASS's PipelineState): the stage index and the parity
// of the phase its barriers are in on the current pass over the ring. Each side keeps its own position
// and advances it once per stage it fills or drains, so producer and consumers agree without sharing
// anything but the barriers. Every wait is bounded (the watchdog covers the pipelines too).
#pragma once
#include <cstdint>
#include "common/cluster.cuh"
#include "common/ptx.cuh"
#include "common/sync.cuh"
#include "common/tma.cuh"

namespace flashdmoe {

// Held as the number of stages passed (one register: the TMA consumers run at the register limit with
// their accumulators live, and a separate index and phase cost them spills); a value-initialised
// position ({}) is the start of the ring for producer and consumers alike.
template <int kStages>
struct PipelineState {
  uint32_t passed = 0;

  __device__ __forceinline__ uint32_t index() const { return passed % kStages; }
  __device__ __forceinline__ uint32_t phase() const { return (passed / kStages) & 1u; }
  __device__ __forceinline__ void advance() { ++passed; }
};

// Bounded wait for the completion of the barrier's phase of this parity. kClusterAcquire: what the
// arrivals of another block of the cluster released (its remote stores) is acquired too. `phase`: what a
// timeout reports (an expert tile's pipeline unless named).
template <bool kClusterAcquire = false, typename Params>
__device__ __forceinline__ bool wait_pipeline(uint32_t bar, uint32_t parity, const Params& p,
                                              uint32_t phase = kPhaseTilePipeline) {
  auto ready = [&] { return tma::try_wait_parity<kClusterAcquire>(bar, parity); };
  if (ready()) return true;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (ready()) return true;
    if ((spin & 15) == 0) {
      if (ptx::load_relaxed_u64(p.error_word) != 0) return false;
      if (ptx::global_timer_ns() - start > p.timeout_ns) {
        report_timeout(p, phase, p.rank);
        return false;
      }
    }
  }
}

// A ring of kStages stages filled by TMA: "full" completes when the producer arrived and the stage's
// bytes landed, "empty" when every consumer warp released the stage. With kCluster = 2 the two blocks of
// a cluster fill each other's stages too (multicast loads: each block's producer loads half of what both
// read), so a stage is empty only once the consumer warps of both blocks released it: each releases it
// in its own block and in the peer's.
template <int kStages, int kCluster = 1>
struct StagePipeline {
  static_assert(kCluster == 1 || kCluster == 2, "a stage ring is shared by at most two blocks");
  using State = PipelineState<kStages>;
  uint64_t full[kStages];
  uint64_t empty[kStages];

  // Thread 0, once per launch, followed by a block-wide barrier before any use (and, in a cluster, by
  // the handshake that tells the peer its loads may land here).
  __device__ void init(uint32_t consumer_warps) {
    for (int s = 0; s < kStages; ++s) {
      tma::mbarrier_init(ptx::smem_addr(&full[s]), 1);
      tma::mbarrier_init(ptx::smem_addr(&empty[s]), consumer_warps * kCluster);
    }
    tma::fence_barrier_init();
  }
  // Producer: wait until the consumers released the stage's fill of the previous pass. That is the
  // opposite parity: on the first pass it names the phase before a fresh barrier's first, which counts
  // as complete, so the first pass does not wait.
  template <typename Params>
  __device__ __forceinline__ bool producer_acquire(const State& at, const Params& p) {
    return wait_pipeline(ptx::smem_addr(&empty[at.index()]), at.phase() ^ 1u, p);
  }
  // Producer: arrive on the stage's "full" barrier expecting tx_bytes; the returned barrier is the one
  // the stage's TMA loads complete their bytes on.
  __device__ __forceinline__ uint32_t producer_commit(const State& at, uint32_t tx_bytes) {
    const uint32_t bar = ptx::smem_addr(&full[at.index()]);
    tma::arrive_expect_tx(bar, tx_bytes);
    return bar;
  }
  // Consumers: wait until the stage is filled.
  template <typename Params>
  __device__ __forceinline__ bool consumer_wait(const State& at, const Params& p) {
    return wait_pipeline(ptx::smem_addr(&full[at.index()]), at.phase(), p);
  }
  // One lane per consumer warp, once the warp is done reading the stage.
  __device__ __forceinline__ void consumer_release(const State& at) {
    const uint32_t bar = ptx::smem_addr(&empty[at.index()]);
    tma::arrive(bar);
    if constexpr (kCluster == 2) cluster::arrive_remote(cluster::map_shared(bar, cluster::block_rank() ^ 1u));
  }
};

constexpr int kTaskEnd = -1, kTaskAbort = -2;  // task ring entries that are not tasks

// Tasks handed from the producer to the consumers in order, one slot each; a slot's barrier completes
// with the producer's arrival after it wrote the task id. No "empty" barriers: the producer runs at most
// STAGES slabs (>= 1 per task) ahead of the consumers, so it never laps a slot still to be read.
template <int STAGES>
struct TaskRing {
  static constexpr int kSlots = STAGES + 2;
  using State = PipelineState<kSlots>;
  int task[kSlots];
  uint64_t full[kSlots];

  // Thread 0, once per launch (with the stage pipeline's init: a fence and a block barrier follow).
  __device__ void init() {
    for (int s = 0; s < kSlots; ++s) tma::mbarrier_init(ptx::smem_addr(&full[s]), 1);
  }
  // Producer: task id `id` (or kTaskEnd / kTaskAbort) into slot `at`; the arrival releases it to the waiters.
  __device__ __forceinline__ void hand_over(const State& at, int id) {
    task[at.index()] = id;
    tma::arrive(ptx::smem_addr(&full[at.index()]));
  }
  // The same into the ring of block `rank` of the cluster (the peer's producer takes its tasks from it).
  __device__ __forceinline__ void hand_over_remote(const State& at, int id, uint32_t rank) {
    cluster::store_remote(cluster::map_shared(ptx::smem_addr(&task[at.index()]), rank), id);
    cluster::arrive_remote_release(cluster::map_shared(ptx::smem_addr(&full[at.index()]), rank));
  }
  // Consumers: the id handed in slot `at` (kTaskAbort when the wait failed). kFromCluster: handed by
  // another block of the cluster (hand_over_remote).
  template <bool kFromCluster = false, typename Params>
  __device__ __forceinline__ int take(const State& at, const Params& p) {
    return wait_pipeline<kFromCluster>(ptx::smem_addr(&full[at.index()]), at.phase(), p) ? task[at.index()]
                                                                                          : kTaskAbort;
  }
};

// Where the workers' two warpgroups, which otherwise run apart, must meet (the small-tile epilogue spreads
// one warpgroup's rows over both): each warp arrives on an mbarrier and waits on it with the watchdog, so
// that a warpgroup which left after a failure costs the other a reported timeout, never a hang (a named
// barrier cannot be left). `met` counts the calling thread's meetings (its parity is the phase's).
// One per block (a static in shared memory: no address to keep in the consumers' registers).
struct WorkerMeeting {
  __device__ static uint32_t bar() {
    __shared__ uint64_t barrier;
    return ptx::smem_addr(&barrier);
  }
  // Thread 0, once per launch, before the block barrier that publishes the stage rings' barriers.
  __device__ static void init() { tma::mbarrier_init(bar(), kThreads / 32); }
  template <typename Params>
  __device__ static __forceinline__ bool meet(uint32_t& met, const Params& p) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) tma::arrive(bar());
    return wait_pipeline(bar(), met++ & 1u, p);
  }
};

}  // namespace flashdmoe
