// Bounded waits and the grid barrier. Every spin in the kernel goes through `wait_at_least`, so a
// missing signal ends in an error word the host turns into flashdmoe.KernelTimeout, never a hang.
// They take any kernel's parameters (`Params`: the forward's MoEParams, the backward's BackwardParams)
// that name the same watchdog and sync fields: error_word, timeout_ns, rank, first_block, blocks,
// barrier_counter, debug_withhold_phase, exit_counter, sync_words, sync_words_count, status_host.
#pragma once
#include "common/ptx.cuh"
#include "moe/params.cuh"
#include "moe/tile_config.cuh"

namespace flashdmoe {

template <typename Params>
__device__ __forceinline__ void report_timeout(const Params& p, uint32_t phase, uint32_t peer) {
  const unsigned long long word = static_cast<unsigned long long>(kErrorTimeout) |
                                  (static_cast<unsigned long long>(phase & 0xff) << 8) |
                                  (static_cast<unsigned long long>(peer & 0xffff) << 16) |
                                  (static_cast<unsigned long long>(blockIdx.x) << 32);
  atomicCAS(p.error_word, 0ull, word);  // first failure wins; later ones are consequences
}

// The block's worker threads (the first kThreads) run every phase but the expert GEMMs; a variant with a
// producer warp (TMA) adds threads that meet the workers only at block-wide barriers. Named barrier 1
// synchronises the workers alone.
__device__ __forceinline__ void sync_workers() { asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory"); }
__device__ __forceinline__ bool sync_workers_and(bool value) {
  int all;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.s32 q, %1, 0;\n bar.red.and.pred p, 1, %2, q;\n selp.s32 %0, 1, 0, p;\n}\n"
      : "=r"(all) : "r"(static_cast<int>(value)), "n"(kThreads) : "memory");
  return all != 0;
}

// The workers' warpgroups: a tile counter that each of them signals gets one arrival from each.
constexpr uint32_t kWorkerWarpgroups = kThreads / 128;

// Named barriers 2 and 3: the calling worker's warpgroup alone (128 threads). The expert tiles' two
// consumer warpgroups meet only through the stage ring, so that one can run the next tile's MMAs while
// the other is still in its epilogue.
__device__ __forceinline__ int warpgroup_barrier() { return 2 + (static_cast<int>(threadIdx.x) >> 7); }
__device__ __forceinline__ void sync_warpgroup() {
  asm volatile("bar.sync %0, 128;\n" ::"r"(warpgroup_barrier()) : "memory");
}
__device__ __forceinline__ bool sync_warpgroup_and(bool value) {
  int all;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.s32 q, %1, 0;\n bar.red.and.pred p, %2, 128, q;\n selp.s32 %0, 1, 0, p;\n}\n"
      : "=r"(all) : "r"(static_cast<int>(value)), "r"(warpgroup_barrier()) : "memory");
  return all != 0;
}

// How many of a tile's `rows` the calling worker's warpgroup (64 tile rows) holds (none when <= 0), and
// whether it holds any: tiles of at most 64 rows (an expert's last, partial tile) run on one warpgroup
// at the tensor cores' full rate.
__device__ __forceinline__ int warpgroup_rows(int rows) {
  return min(64, rows - (static_cast<int>(threadIdx.x) >> 7) * 64);
}
__device__ __forceinline__ bool warpgroup_has_rows(int rows) { return (threadIdx.x >> 7) * 64 < rows; }

// This block's index among its rank's blocks (an emulated launch runs several ranks side by side).
template <typename Params>
__device__ __forceinline__ int block_in_rank(const Params& p) { return static_cast<int>(blockIdx.x) - p.first_block; }

enum class Scope { Gpu, System };

// Called by one thread. Returns false if the watchdog fired here or another block already failed.
// Scope::System for flags that peers write (acquire at system scope).
template <Scope kScope = Scope::Gpu, typename Params>
__device__ __forceinline__ bool wait_at_least(const uint32_t* counter, uint32_t target, const Params& p,
                                              uint32_t phase, uint32_t peer) {
  auto load = [&]() {
    return kScope == Scope::Gpu ? ptx::load_acquire_gpu(counter) : ptx::load_acquire_sys(counter);
  };
  if (load() >= target) return true;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (load() >= target) return true;
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

// Barrier of one rank's blocks over a counter zeroed before the launch: the n-th barrier waits for
// n * blocks arrivals, so no reset is needed inside the launch. All threads of the block call it.
template <typename Params>
__device__ __forceinline__ bool grid_barrier(const Params& p, uint32_t phase, uint32_t ordinal) {
  __shared__ int barrier_ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool withheld = p.debug_withhold_phase == static_cast<int>(phase) && block_in_rank(p) == 0;
    bool ok = !withheld;
    if (ok) {
      __threadfence();
      ptx::red_release_add_gpu(p.barrier_counter, 1);
      ok = wait_at_least(p.barrier_counter, ordinal * p.blocks, p, phase, p.rank);
    }
    barrier_ok = ok;
  }
  __syncthreads();
  return barrier_ok != 0;
}

// Every block of a rank ends here, whatever phase it left at (all threads of the block). The rank's
// last block writes the status block into the host slot (pinned memory, system scope), then the slot's
// completion word (kStatusDone), and zeroes the sync words, the status block and the exit counter
// included, for the next launch: this replaces a memset before every launch, and a status copy and a
// CUDA event after it. Safe because only this rank's own blocks write its sync words (peers write the
// team buffers' signals, which carry sequence numbers and are never reset), and all of them have
// counted themselves out. A launch that times out still reaches this in every block (every wait is
// bounded by the watchdog), so the reset runs after a failure too. `last` runs on thread 0 of the last
// block before anything is copied or reset (the launch's error word is still set). Not inlined: as a call
// it adds no register pressure to the phases before it (fewer spills in mma.sync). Returns whether this
// block was the rank's last.
struct NothingLast {
  __device__ void operator()() const {}
};
template <typename Params, typename Last = NothingLast>
static __device__ __noinline__ bool finish_launch(const Params& p, Last last = {}) {
  __shared__ int last_block;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's status and counter writes before its exit count
    last_block = atomicAdd(p.exit_counter, 1u) == static_cast<uint32_t>(p.blocks - 1);
    if (last_block) __threadfence();
  }
  __syncthreads();
  if (!last_block) return false;
  if (threadIdx.x == 0) last();
  constexpr int kStatusWords = static_cast<int>(kStatusBytes / 4);
  static_assert(kStatusWords <= 32, "one warp copies the status block");
  constexpr int kDoneWord = static_cast<int>(kStatusDone / 4);
  if (threadIdx.x < kStatusWords && threadIdx.x != kDoneWord && p.status_host != nullptr) {
    // Volatile: the words were written by atomics of other SMs, at L2.
    const uint32_t word = reinterpret_cast<volatile const uint32_t*>(p.sync_words)[threadIdx.x];
    static_cast<volatile uint32_t*>(p.status_host)[threadIdx.x] = word;
    __threadfence_system();
  }
  __syncthreads();
  // The host polls this word instead of an event: released at system scope after every status word.
  if (threadIdx.x == 0 && p.status_host != nullptr)
    ptx::store_release_sys(static_cast<uint32_t*>(p.status_host) + kDoneWord, 1u);
  for (int i = threadIdx.x; i < p.sync_words_count; i += blockDim.x) p.sync_words[i] = 0u;
  return true;
}

}  // namespace flashdmoe
