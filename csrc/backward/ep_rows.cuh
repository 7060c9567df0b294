// The backward's row exchange across the ranks of a team: one kernel, three directions.
//
//   to owners:  each kept choice (t, j) of this rank writes x[t] into its expert owner's recv buffer and
//               dy[t] into the owner's comb buffer, and the combine weight into the owner's row words, at
//               the row's place in the owner's expert-major order (local expert 0's rows of every source
//               in rank order, then expert 1's, ...), so the owner's grouped GEMMs read them as they lie.
//               The owner knows its counts from the forward; it computes where each source's rows go and
//               writes that into the source's place words before it lets the source write.
//   back:       each row this rank's experts took (packed order) writes its dx row into the source's
//               comb region [this rank] at the choice's stream row (the forward's numbering), and the
//               combine weight's gradient into the source's row words.
//   sum:        this rank's float32 share of a gradient (the router's) into every peer's comb region
//               [this rank]; then every rank sums the P shares in rank order (the same bits on every rank).
//
// Stores into peer memory (NVLink / same-GPU pointers of the team's peer table), then one flag per
// destination carrying the backward's sequence number, exactly as the forward publishes. A peer without
// a pointer (another node) is reached through NVSHMEM puts instead: the kernel is a template on its
// publication policy (EpStores here; EpPuts in csrc/nvshmem/ep_rows_puts.cuh, the NVSHMEM build only),
// which stages what goes to such a peer in this rank's own symmetric memory and puts it after a grid
// barrier (see EpStage for where).
//
// Before writing into a peer, a rank waits for that peer's "free" flag of the same sequence: the peer raises it at the
// start of its own launch of this direction, once its stream has finished reading what the buffer held
// (and, going to the owners, once it has written the source's place words). Every wait is bounded (the
// watchdog; KernelTimeout names the phase and the peer). A launch that failed leaves its error in the
// rank's abort words; the backward's later launches of the same sequence then stop at once with that
// error instead of waiting out the watchdog again, since the host no longer waits between them.
#pragma once
#include "common/ptx.cuh"
#include "common/sync.cuh"
#include "moe/params.cuh"

namespace flashdmoe {

enum EpBackwardPhase : uint32_t {
  kPhaseEpFreeToOwners = 14,   // waiting for an expert owner to free its staging for this rank's rows
  kPhaseEpRowsOut = 15,        // grid barrier after this rank's rows to the owners were written
  kPhaseEpRowsIn = 16,         // waiting for a source's rows (dy, x, weights)
  kPhaseEpFreeToSources = 17,  // waiting for a source to free its staging for the dx rows
  kPhaseEpGradsOut = 18,       // grid barrier after this rank's dx rows were written
  kPhaseEpGradsIn = 19,        // waiting for an owner's dx rows and weight gradients
  kPhaseEpFreeToSum = 20,      // waiting for a peer to free its staging for this rank's share of the sum
  kPhaseEpSharesOut = 21,      // grid barrier after this rank's share was written
  kPhaseEpSharesIn = 22,       // waiting for a peer's share
};

enum class EpDirection : int { ToOwners = 0, BackToSources = 1, SumOverRanks = 2 };
constexpr int kEpDirections = 3;

// The backward's words in a rank's signal buffer, after the forward's signal_words(P, L):
//   free[dir][peer], ready[dir][peer]   6P flags (three directions; sequence numbers, never cleared)
//   abort[3]                            sequence, low and high half of the error word of a failed launch
//   count                               the rank's backward exchanges so far: the launch to the owners takes
//                                       count + 1 as its sequence number and stores it back, the two later
//                                       directions read it, so a CUDA graph's replays number as eager calls
//   place[owner][local]                 written by the owner: this rank's rows for that local expert go to
//                                       the owner's packed row (place + stream row), a signed int32
//   row_word[P * stream_rows]           one 32-bit word per row: the combine weight on the way to the owner
//                                       (at the packed row), the weight's gradient on the way back (at
//                                       owner * stream_rows + stream row; f32 bits)
struct EpSignalLayout {
  int world, local_experts, stream_rows;

  __host__ __device__ int base() const { return signal_words(world, local_experts); }
  __host__ __device__ int free_flag(EpDirection dir, int peer) const {
    return base() + 2 * static_cast<int>(dir) * world + peer;
  }
  __host__ __device__ int ready_flag(EpDirection dir, int peer) const {
    return base() + (2 * static_cast<int>(dir) + 1) * world + peer;
  }
  __host__ __device__ int abort_word(int i) const { return base() + 2 * kEpDirections * world + i; }
  __host__ __device__ int sequence_word() const { return abort_word(kAbortWords); }
  __host__ __device__ int place(int owner, int local) const {
    return sequence_word() + 1 + owner * local_experts + local;
  }
  __host__ __device__ int64_t row_word(int src, int row) const {
    return place(world, 0) + static_cast<int64_t>(src) * stream_rows + row;
  }
  static constexpr int kAbortWords = 3;
  __host__ __device__ int64_t total_words() const { return row_word(world, 0); }
};

// Where a rank stages what goes to its NVSHMEM peers (symmetric memory, so the puts can read it):
//   to owners:  the `stage` buffer: x rows [stage_rows, H], dy rows [stage_rows, H], combine weights
//               [stage_rows] (f32 bits), this rank's rows to owner q from row sent_start[q * L] on, in its
//               stream order to q (stage_rows = max tokens * k: every kept choice fits);
//   back:       dx rows in own recv region [source] at the stream row (recv is read by nothing else until
//               the next backward's rows arrive, which wait for this rank's free flag), weight gradients in
//               the stage buffer's last P * stream_rows words, region [source];
//   sum:        the share at the start of own recv (it fits one region).
struct EpStage {
  char* base;
  int rows, world, stream_rows, row_bytes;

  __host__ __device__ char* x_rows() const { return base; }
  __host__ __device__ char* dy_rows() const { return base + static_cast<size_t>(rows) * row_bytes; }
  __host__ __device__ uint32_t* weights() const {
    return reinterpret_cast<uint32_t*>(base + 2 * static_cast<size_t>(rows) * row_bytes);
  }
  __host__ __device__ uint32_t* weight_grads() const { return weights() + rows; }
  __host__ __device__ size_t bytes() const {
    return 2 * static_cast<size_t>(rows) * row_bytes + 4 * (static_cast<size_t>(rows) + static_cast<size_t>(world) * stream_rows);
  }
};

struct EpRowsParams {
  EpDirection direction;
  int rank, world_size, local_experts, stream_rows;
  int row_bytes;  // H * element size, a multiple of 16
  bool silent;    // debug: publish no flag (peers must time out, not hang)
  PeerBuffers peers[kMaxRanks];

  // NVSHMEM peers only (null / 0 without): own staging (EpStage), and the run of this rank's rows to each
  // (owner, local expert): sent[o * L + l] its first stage row, sent[P * L + o * L + l] its rows (to owners);
  // rows each source sent this rank, from_rows[src] (back).
  char* stage;
  int stage_rows;
  const int* sent;
  const int* from_rows;

  // To owners: this rank's tokens and the forward's routing [T, k] (row -1: dropped), and, as an owner,
  // where each source's rows go: place[src][local] (int32 [P, L], packed row = place + stream row).
  int tokens, top_k;
  const void* x;
  const void* dy;
  const int* topk_expert;
  const int* topk_row;
  const float* topk_weight;
  const int* place;

  // Back to sources: `rows` rows this rank's experts took, in packed order; received[r] is the row's
  // index in this rank's [P * stream_rows] staging (source * stream_rows + stream row).
  int rows;
  const int* received;
  const void* dx_rows;        // [rows, H]
  const float* dweight_row;   // [rows]

  // Sum over ranks: n floats (a multiple of 4, n * 4 <= stream_rows * row_bytes) of this rank's share,
  // and where the sum goes.
  int64_t n;
  const float* share;
  float* sum;

  // The rank's words shared with its forwards (moe/params.cuh; null: none): a failed forward or exchange
  // marks it, and every later launch of the rank on the stream then runs nothing.
  TeamRankWords* team_words;

  // Watchdog and sync words (common/sync.cuh names).
  unsigned long long* error_word;
  unsigned long long* traffic;  // [kTrafficWords]: to owners counts as dispatch, back as combine
  uint32_t* barrier_counter;
  uint32_t* exit_counter;
  uint32_t* sync_words;
  int sync_words_count;
  void* status_host;
  int first_block, blocks;
  uint64_t timeout_ns;
  int debug_withhold_phase;
};

constexpr int kEpRowsThreads = 256;

// The publication policy of the peer-pointer build: every peer has a load/store pointer; flags and words
// are stores into its signal words. (EpPuts, csrc/nvshmem/ep_rows_puts.cuh, has the same members.)
struct EpStores {
  static constexpr bool kPuts = false;
  __device__ __forceinline__ static bool via_puts(const EpRowsParams&, int) { return false; }
  __device__ __forceinline__ static void set_word(const EpRowsParams& p, int peer, int word, uint32_t value) {
    p.peers[peer].signals[word] = value;
  }
  __device__ __forceinline__ static void set_flag(const EpRowsParams& p, int peer, int word, uint32_t value) {
    ptx::store_release_sys(p.peers[peer].signals + word, value);
  }
  // The calling thread's words and puts delivered (nothing to do for stores: the fence that follows).
  __device__ __forceinline__ static void complete() {}
  // Every thread of every block, once the staging is complete: the puts of this direction.
  template <typename Layout>
  __device__ __forceinline__ static void put_staged(const EpRowsParams&, const Layout&, const EpStage&) {}
};

namespace ep_rows {

// This launch's sequence number, set by begin (every block reads the rank's count before its last block
// stores the new one back), read through here by every step.
__device__ __forceinline__ uint32_t& sequence() {
  __shared__ uint32_t number;
  return number;
}

__device__ __forceinline__ uint32_t phase(const EpRowsParams& p, uint32_t to_owners, uint32_t back, uint32_t sum) {
  return p.direction == EpDirection::ToOwners ? to_owners : p.direction == EpDirection::BackToSources ? back : sum;
}

__device__ __forceinline__ EpStage stage_of(const EpRowsParams& p) {
  return EpStage{p.stage, p.stage_rows, p.world_size, p.stream_rows, p.row_bytes};
}

// Thread `peer` of every block waits for that peer's free flag (this rank's own too: it orders the place
// words block 0 wrote before every block's reads); true when every rank freed its staging.
__device__ inline bool wait_for_free(const EpRowsParams& p, const EpSignalLayout& layout) {
  bool ok = true;
  const int peer = threadIdx.x;
  if (peer < p.world_size) {
    const uint32_t* flag = p.peers[p.rank].signals + layout.free_flag(p.direction, peer);
    ok = wait_at_least<Scope::System>(flag, sequence(), p,
                                      phase(p, kPhaseEpFreeToOwners, kPhaseEpFreeToSources, kPhaseEpFreeToSum), peer);
  }
  return __syncthreads_and(ok) != 0;
}

// One warp copies one row of `bytes` bytes (16-byte pieces, four in flight per lane) to `dst`.
__device__ __forceinline__ void copy_row(int4* dst, const int4* src, int pieces, int lane) {
  constexpr int kUnroll = 4;
  for (int c0 = 0; c0 < pieces; c0 += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c < pieces) v[u] = __ldcg(src + c);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c < pieces) dst[c] = v[u];
    }
  }
}

// Block 0, as an owner: each source's place words, then (by the caller) the free flags that release them.
template <typename Publish>
__device__ inline void publish_places(const EpRowsParams& p, const EpSignalLayout& layout) {
  const int L = p.local_experts;
  for (int i = threadIdx.x; i < p.world_size * L; i += kEpRowsThreads) {
    const int src = i / L, local = i % L;
    Publish::set_word(p, src, layout.place(p.rank, local), static_cast<uint32_t>(__ldg(p.place + i)));
  }
}

// Each kept choice's x, dy rows and weight: into the owner's packed rows, or for an owner reached by puts
// into this rank's stage at the choice's row of the run to that owner.
template <typename Publish>
__device__ inline void rows_to_owners(const EpRowsParams& p, const EpSignalLayout& layout) {
  const int lane = threadIdx.x & 31, L = p.local_experts, k = p.top_k;
  const int warps = p.blocks * (kEpRowsThreads / 32);
  const int pieces = p.row_bytes / 16;
  const int staged = p.world_size * p.stream_rows;
  const uint32_t* places = p.peers[p.rank].signals;
  const EpStage stage = stage_of(p);
  unsigned long long sent = 0;
  for (int token = block_in_rank(p) * (kEpRowsThreads / 32) + (threadIdx.x >> 5); token < p.tokens; token += warps) {
    const size_t first = static_cast<size_t>(token) * k;
    int my_owner = 0, my_row = -1;  // the destination row: packed at the owner, or in own stage
    bool my_put = false;
    if (lane < k) {
      const int expert = __ldg(p.topk_expert + first + lane);
      const int row = __ldg(p.topk_row + first + lane);
      my_owner = expert / L;
      // The routing of a failed forward, or places from an owner that failed, are only used in bounds.
      if (row >= 0 && row < p.stream_rows && expert >= 0 && my_owner < p.world_size) {
        my_put = Publish::via_puts(p, my_owner);
        if (my_put) {
          my_row = __ldg(p.sent + my_owner * L) + row;
          if (my_row >= p.stage_rows) my_row = -1;
        } else {
          my_row = static_cast<int>(__ldcg(places + layout.place(my_owner, expert - my_owner * L))) + row;
          if (my_row >= staged) my_row = -1;
        }
      }
      if (my_row >= 0) {
        uint32_t* word = my_put ? stage.weights() + my_row : p.peers[my_owner].signals + layout.row_word(0, my_row);
        *word = __float_as_uint(__ldg(p.topk_weight + first + lane));
        if (my_owner != p.rank) sent += 2ull * p.row_bytes + 4;
      }
    }
    const uint32_t copies = __ballot_sync(0xffffffffu, my_row >= 0);
    const size_t src_offset = static_cast<size_t>(token) * p.row_bytes;
    for (uint32_t rest = copies; rest != 0; rest &= rest - 1) {
      const int j = __ffs(rest) - 1;
      const int dst_row = __shfl_sync(0xffffffffu, my_row, j);
      const int owner = __shfl_sync(0xffffffffu, my_owner, j);
      const bool put = __shfl_sync(0xffffffffu, my_put, j);
      const size_t dst_offset = static_cast<size_t>(dst_row) * p.row_bytes;
      char* x_dst = put ? stage.x_rows() : static_cast<char*>(p.peers[owner].recv);
      char* dy_dst = put ? stage.dy_rows() : static_cast<char*>(p.peers[owner].comb);
      copy_row(reinterpret_cast<int4*>(x_dst + dst_offset),
               reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + src_offset), pieces, lane);
      copy_row(reinterpret_cast<int4*>(dy_dst + dst_offset),
               reinterpret_cast<const int4*>(static_cast<const char*>(p.dy) + src_offset), pieces, lane);
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) sent += __shfl_xor_sync(0xffffffffu, sent, offset);
  if (lane == 0 && sent) atomicAdd(p.traffic + kTrafficDispatch, sent);
}

// Each received row's dx row and weight gradient: into its source's comb region [this rank] and row words,
// or for a source reached by puts into own recv region [source] and the stage's weight gradients.
template <typename Publish>
__device__ inline void grads_to_sources(const EpRowsParams& p, const EpSignalLayout& layout) {
  const int lane = threadIdx.x & 31;
  const int warps = p.blocks * (kEpRowsThreads / 32);
  const int pieces = p.row_bytes / 16;
  const int staged = p.world_size * p.stream_rows;
  const EpStage stage = stage_of(p);
  unsigned long long sent = 0;
  for (int r = block_in_rank(p) * (kEpRowsThreads / 32) + (threadIdx.x >> 5); r < p.rows; r += warps) {
    const int index = __ldg(p.received + r);
    if (index < 0 || index >= staged) continue;  // never written out of bounds, whatever the table holds
    const int src = index / p.stream_rows, row = index % p.stream_rows;
    const bool put = Publish::via_puts(p, src);
    if (lane == 0) {
      uint32_t* word = put ? stage.weight_grads() + index : p.peers[src].signals + layout.row_word(p.rank, row);
      *word = __float_as_uint(__ldg(p.dweight_row + r));
      if (src != p.rank) sent += 4;
    }
    if (p.dx_rows != nullptr) {
      char* dst = put ? static_cast<char*>(p.peers[p.rank].recv) + static_cast<size_t>(index) * p.row_bytes
                      : static_cast<char*>(p.peers[src].comb) +
                            (static_cast<size_t>(p.rank) * p.stream_rows + row) * p.row_bytes;
      copy_row(reinterpret_cast<int4*>(dst),
               reinterpret_cast<const int4*>(static_cast<const char*>(p.dx_rows) + static_cast<size_t>(r) * p.row_bytes),
               pieces, lane);
      if (lane == 0 && src != p.rank) sent += p.row_bytes;
    }
  }
  if (lane == 0 && sent) atomicAdd(p.traffic + kTrafficCombine, sent);
}

// This rank's share into every peer's comb region [this rank] (16-byte pieces, grid-stride); once into
// the start of own recv when a peer is reached by puts (put_staged sends it from there).
template <typename Publish>
__device__ inline void share_to_peers(const EpRowsParams& p) {
  const int64_t pieces = p.n / 4;
  const size_t region = static_cast<size_t>(p.stream_rows) * p.row_bytes;
  const float4* src = reinterpret_cast<const float4*>(p.share);
  bool any_put = false;
  for (int peer = 0; peer < p.world_size; ++peer) any_put |= Publish::via_puts(p, peer);
  unsigned long long sent = 0;
  for (int64_t i = static_cast<int64_t>(block_in_rank(p)) * kEpRowsThreads + threadIdx.x; i < pieces;
       i += static_cast<int64_t>(p.blocks) * kEpRowsThreads) {
    const float4 v = __ldg(src + i);
    if (any_put) reinterpret_cast<float4*>(p.peers[p.rank].recv)[i] = v;
    for (int peer = 0; peer < p.world_size; ++peer) {
      if (peer == p.rank) continue;
      if (!Publish::via_puts(p, peer))
        reinterpret_cast<float4*>(static_cast<char*>(p.peers[peer].comb) + p.rank * region)[i] = v;
      sent += 16;
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) sent += __shfl_xor_sync(0xffffffffu, sent, offset);
  if ((threadIdx.x & 31) == 0 && sent) atomicAdd(p.traffic + kTrafficCombine, sent);
}

// Every peer's share has arrived (each block waits: they all read them), then the sum in rank order.
__device__ inline void sum_shares(const EpRowsParams& p, const EpSignalLayout& layout) {
  bool ok = true;
  const int peer = threadIdx.x;
  if (peer < p.world_size && peer != p.rank)
    ok = wait_at_least<Scope::System>(p.peers[p.rank].signals + layout.ready_flag(p.direction, peer), sequence(), p,
                                      kPhaseEpSharesIn, peer);
  if (!__syncthreads_and(ok)) return;
  const int64_t pieces = p.n / 4;
  const size_t region = static_cast<size_t>(p.stream_rows) * p.row_bytes;
  const char* staging = static_cast<const char*>(p.peers[p.rank].comb);
  for (int64_t i = static_cast<int64_t>(block_in_rank(p)) * kEpRowsThreads + threadIdx.x; i < pieces;
       i += static_cast<int64_t>(p.blocks) * kEpRowsThreads) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q = 0; q < p.world_size; ++q) {  // rank order: the same bits on every rank
      const float4 v = q == p.rank ? __ldg(reinterpret_cast<const float4*>(p.share) + i)
                                   : __ldcg(reinterpret_cast<const float4*>(staging + q * region) + i);
      acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
    }
    reinterpret_cast<float4*>(p.sum)[i] = acc;
  }
}

// The launch's number (sequence()): the rank's count + 1 going to the owners, the count itself in the two
// directions queued after that launch. False, with the error word set, when the numbers are used up (the
// flags would wrap; every rank of the team stops at the same backward).
__device__ inline bool begin(const EpRowsParams& p, const EpSignalLayout& layout) {
  __shared__ bool run;
  if (threadIdx.x == 0) {
    const uint32_t count = reinterpret_cast<volatile const uint32_t*>(p.peers[p.rank].signals)[layout.sequence_word()];
    const uint32_t number = count + (p.direction == EpDirection::ToOwners ? 1u : 0u);
    run = number < (1u << 31);
    if (!run && block_in_rank(p) == 0)
      atomicCAS(p.error_word, 0ull,
                static_cast<unsigned long long>(kErrorSequence) |
                    (static_cast<unsigned long long>(phase(p, kPhaseEpFreeToOwners, kPhaseEpFreeToSources,
                                                           kPhaseEpFreeToSum)) << 8));
    sequence() = number;
  }
  __syncthreads();
  return run;
}

// True when an earlier launch of this backward failed: its error becomes this launch's, and nothing runs.
__device__ inline bool aborted(const EpRowsParams& p, const EpSignalLayout& layout) {
  const uint32_t* own = p.peers[p.rank].signals;
  if (ptx::load_acquire_gpu(own + layout.abort_word(0)) != sequence()) return false;
  if (block_in_rank(p) == 0 && threadIdx.x == 0) {
    const unsigned long long word = static_cast<unsigned long long>(own[layout.abort_word(1)]) |
                                    (static_cast<unsigned long long>(own[layout.abort_word(2)]) << 32);
    atomicCAS(p.error_word, 0ull, word);
  }
  return true;
}

// True when an earlier forward or backward of the rank failed (TeamRankWords::failed): this launch runs
// nothing and says whose failure stopped it, as a forward does (moe_forward.cuh, begin_forward).
__device__ inline bool team_failed(const EpRowsParams& p) {
  if (p.team_words == nullptr) return false;
  const uint32_t failed = static_cast<const volatile TeamRankWords*>(p.team_words)->failed;
  if (failed == 0) return false;
  if (block_in_rank(p) == 0 && threadIdx.x == 0)
    atomicCAS(p.error_word, 0ull, static_cast<unsigned long long>(kErrorTeamFailed) |
                                      (static_cast<unsigned long long>(failed) << 32));
  return true;
}

// The rank's last block: a failed launch marks the rank, so that its later launches run nothing (the
// forward's end_forward marks it the same way, with the forward's number; an exchange's number has the top
// bit set). The error word is still this launch's: finish_launch resets it afterwards.
__device__ inline void mark_failed(const EpRowsParams& p) {
  volatile TeamRankWords* words = p.team_words;
  if (words == nullptr) return;
  if (*reinterpret_cast<volatile const unsigned long long*>(p.error_word) != 0 && words->failed == 0)
    words->failed = kTeamFailedInBackward | min(sequence(), kTeamFailedInBackward - 1u);
}

// The rank's last block of a launch to the owners: the count this backward's later launches read.
__device__ inline void store_count(const EpRowsParams& p, const EpSignalLayout& layout) {
  if (p.direction == EpDirection::ToOwners && sequence() < (1u << 31))
    reinterpret_cast<volatile uint32_t*>(p.peers[p.rank].signals)[layout.sequence_word()] = sequence();
}

// This launch failed: leave its error for the backward's later launches (see aborted).
__device__ inline void leave_abort(const EpRowsParams& p, const EpSignalLayout& layout) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  const unsigned long long word = ptx::load_relaxed_u64(p.error_word);
  if (word == 0) return;
  uint32_t* own = p.peers[p.rank].signals;
  own[layout.abort_word(1)] = static_cast<uint32_t>(word);
  own[layout.abort_word(2)] = static_cast<uint32_t>(word >> 32);
  __threadfence();
  ptx::store_release_sys(own + layout.abort_word(0), sequence());
}

}  // namespace ep_rows

// The ranks one launch runs: one (a process of a team), or every rank of an emulated team side by side,
// rank i on blocks [i * blocks, (i + 1) * blocks) (all resident at once: a cooperative launch), so that
// the flags between them are waited for within the launch.
template <int kRankCapacity>
struct EpRowsLaunch {
  EpRowsParams rank[kRankCapacity];
};

// One rank's part of a launch, in one block of it.
template <typename Publish>
__device__ void ep_rows_block(const EpRowsParams& p) {
  const EpSignalLayout layout{p.world_size, p.local_experts, p.stream_rows};
  const auto last = [&p, &layout] {
    ep_rows::store_count(p, layout);
    ep_rows::mark_failed(p);
  };
  if (!ep_rows::begin(p, layout) || ep_rows::aborted(p, layout) || ep_rows::team_failed(p)) {
    finish_launch(p, last);
    return;
  }
  const bool to_owners = p.direction == EpDirection::ToOwners;
  // Our staging is free for this direction: what it held was read by earlier work on this stream.
  if (block_in_rank(p) == 0) {
    if (to_owners) ep_rows::publish_places<Publish>(p, layout);
    Publish::complete();  // the place words delivered before the flags that release them
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      for (int peer = 0; peer < p.world_size; ++peer)
        if (peer == p.rank || !p.silent)
          Publish::set_flag(p, peer, layout.free_flag(p.direction, p.rank), ep_rows::sequence());
    }
  }
  const bool summing = p.direction == EpDirection::SumOverRanks;
  if (ep_rows::wait_for_free(p, layout)) {
    if (to_owners)
      ep_rows::rows_to_owners<Publish>(p, layout);
    else if (summing)
      ep_rows::share_to_peers<Publish>(p);
    else
      ep_rows::grads_to_sources<Publish>(p, layout);
    __threadfence_system();  // the rows reach the peers before the ready flag
    const uint32_t barrier_phase = ep_rows::phase(p, kPhaseEpRowsOut, kPhaseEpGradsOut, kPhaseEpSharesOut);
    bool written = grid_barrier(p, barrier_phase, 1);
    if constexpr (Publish::kPuts) {
      // The stage is complete: its puts (each block a share, delivered by each thread), then every block's.
      if (written) {
        if (!p.silent) Publish::put_staged(p, layout, ep_rows::stage_of(p));
        Publish::complete();
        written = grid_barrier(p, barrier_phase, 2);
      }
    }
    if (written) {
      if (block_in_rank(p) == 0 && threadIdx.x == 0 && !p.silent) {
        __threadfence_system();
        for (int peer = 0; peer < p.world_size; ++peer)
          if (peer != p.rank) Publish::set_flag(p, peer, layout.ready_flag(p.direction, p.rank), ep_rows::sequence());
      }
      if (summing) {
        ep_rows::sum_shares(p, layout);
      } else if (block_in_rank(p) == 0) {
        // The launch ends once every peer's rows are here: the work after it on the stream reads them.
        const int peer = threadIdx.x;
        if (peer < p.world_size && peer != p.rank)
          wait_at_least<Scope::System>(p.peers[p.rank].signals + layout.ready_flag(p.direction, peer),
                                       ep_rows::sequence(), p,
                                       ep_rows::phase(p, kPhaseEpRowsIn, kPhaseEpGradsIn, kPhaseEpSharesIn), peer);
      }
    }
  }
  ep_rows::leave_abort(p, layout);
  finish_launch(p, last);
}

template <typename Publish, int kRankCapacity>
__global__ void __launch_bounds__(kEpRowsThreads, 2) ep_rows_kernel(const __grid_constant__ EpRowsLaunch<kRankCapacity> launch) {
  ep_rows_block<Publish>(kRankCapacity == 1 ? launch.rank[0] : launch.rank[blockIdx.x / launch.rank[0].blocks]);
}

}  // namespace flashdmoe
