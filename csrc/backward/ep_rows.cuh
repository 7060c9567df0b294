// The backward's row exchange across the ranks of a team: one kernel, two directions.
//
//   to owners:  each kept choice (t, j) of this rank writes x[t] into its expert owner's recv region
//               [this rank] and dy[t] into the owner's comb region [this rank], at the choice's stream
//               row (the forward's numbering, so the owner finds its rows grouped by local expert), and
//               the combine weight into the owner's row words; the per-(source, local expert) counts
//               go first.
//   back:       each row this rank's experts took (packed order) writes its dx row into the source's
//               comb region [this rank] at the same stream row, and the combine weight's gradient into
//               the source's row words.
//   sum:        this rank's float32 share of a gradient (the router's) into every peer's comb region
//               [this rank]; then every rank sums the P shares in rank order (the same bits on every rank).
//
// Stores into peer memory (NVLink / same-GPU pointers of the team's peer table), then one flag per
// destination carrying the backward's sequence number, exactly as the forward publishes. Before writing
// into a peer, a rank waits for that peer's "free" flag of the same sequence: the peer raises it at the
// start of its own launch of this direction, once its stream has finished reading what the region held.
// Every wait is bounded (the watchdog; KernelTimeout names the phase and the peer).
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
//   count[src][local]                   P*L rows src sent this rank for each local expert
//   row_word[src][stream_rows]          one 32-bit word per stream row: the combine weight on the way
//                                       to the owner, the weight's gradient on the way back (f32 bits)
struct EpSignalLayout {
  int world, local_experts, stream_rows;

  __host__ __device__ int base() const { return signal_words(world, local_experts); }
  __host__ __device__ int free_flag(EpDirection dir, int peer) const {
    return base() + 2 * static_cast<int>(dir) * world + peer;
  }
  __host__ __device__ int ready_flag(EpDirection dir, int peer) const {
    return base() + (2 * static_cast<int>(dir) + 1) * world + peer;
  }
  __host__ __device__ int count(int src, int local) const {
    return base() + 2 * kEpDirections * world + src * local_experts + local;
  }
  __host__ __device__ int64_t row_word(int src, int row) const {
    return base() + 2 * kEpDirections * world + world * local_experts + static_cast<int64_t>(src) * stream_rows + row;
  }
  __host__ __device__ int64_t total_words() const { return row_word(world, 0); }
};

struct EpRowsParams {
  EpDirection direction;
  int rank, world_size, local_experts, stream_rows;
  int row_bytes;  // H * element size, a multiple of 16
  uint32_t sequence;
  bool silent;    // debug: publish no flag (peers must time out, not hang)
  PeerBuffers peers[kMaxRanks];

  // To owners: this rank's tokens and the forward's routing [T, k] (row -1: dropped), and the kept
  // counts by global expert [E] (int32).
  int tokens, top_k;
  const void* x;
  const void* dy;
  const int* topk_expert;
  const int* topk_row;
  const float* topk_weight;
  const int* kept_per_expert;

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

namespace ep_rows {

__device__ __forceinline__ uint32_t phase(const EpRowsParams& p, uint32_t to_owners, uint32_t back, uint32_t sum) {
  return p.direction == EpDirection::ToOwners ? to_owners : p.direction == EpDirection::BackToSources ? back : sum;
}

// Thread `peer` of every block waits for that peer's free flag; true when every peer freed its staging.
__device__ inline bool wait_for_free(const EpRowsParams& p, const EpSignalLayout& layout) {
  bool ok = true;
  const int peer = threadIdx.x;
  if (peer < p.world_size && peer != p.rank) {
    const uint32_t* flag = p.peers[p.rank].signals + layout.free_flag(p.direction, peer);
    ok = wait_at_least<Scope::System>(flag, p.sequence, p,
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

__device__ inline void rows_to_owners(const EpRowsParams& p, const EpSignalLayout& layout) {
  const int lane = threadIdx.x & 31, L = p.local_experts, k = p.top_k;
  const int warps = p.blocks * (kEpRowsThreads / 32);
  const int pieces = p.row_bytes / 16;
  unsigned long long sent = 0;
  // The counts first: the owner sizes its work from them once the ready flag arrives.
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < p.world_size * L; i += kEpRowsThreads) {
      const int owner = i / L, local = i % L;
      p.peers[owner].signals[layout.count(p.rank, local)] = static_cast<uint32_t>(__ldg(p.kept_per_expert + i));
    }
  }
  for (int token = blockIdx.x * (kEpRowsThreads / 32) + (threadIdx.x >> 5); token < p.tokens; token += warps) {
    const size_t first = static_cast<size_t>(token) * k;
    int my_owner = 0, my_row = -1;
    float my_weight = 0.f;
    if (lane < k) {
      const int expert = __ldg(p.topk_expert + first + lane);
      my_row = __ldg(p.topk_row + first + lane);
      my_owner = expert / L;
      // The routing of a failed forward is only ever used in bounds.
      if (my_row >= p.stream_rows || my_owner < 0 || my_owner >= p.world_size) my_row = -1;
      my_weight = __ldg(p.topk_weight + first + lane);
      if (my_row >= 0) {
        p.peers[my_owner].signals[layout.row_word(p.rank, my_row)] = __float_as_uint(my_weight);
        if (my_owner != p.rank) sent += 2ull * p.row_bytes + 4;
      }
    }
    const uint32_t copies = __ballot_sync(0xffffffffu, my_row >= 0);
    const size_t src_offset = static_cast<size_t>(token) * p.row_bytes;
    for (uint32_t rest = copies; rest != 0; rest &= rest - 1) {
      const int j = __ffs(rest) - 1;
      const int row = __shfl_sync(0xffffffffu, my_row, j);
      const int owner = __shfl_sync(0xffffffffu, my_owner, j);
      const size_t dst_offset = (static_cast<size_t>(p.rank) * p.stream_rows + row) * p.row_bytes;
      copy_row(reinterpret_cast<int4*>(static_cast<char*>(p.peers[owner].recv) + dst_offset),
               reinterpret_cast<const int4*>(static_cast<const char*>(p.x) + src_offset), pieces, lane);
      copy_row(reinterpret_cast<int4*>(static_cast<char*>(p.peers[owner].comb) + dst_offset),
               reinterpret_cast<const int4*>(static_cast<const char*>(p.dy) + src_offset), pieces, lane);
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) sent += __shfl_xor_sync(0xffffffffu, sent, offset);
  if (lane == 0 && sent) atomicAdd(p.traffic + kTrafficDispatch, sent);
}

__device__ inline void grads_to_sources(const EpRowsParams& p, const EpSignalLayout& layout) {
  const int lane = threadIdx.x & 31;
  const int warps = p.blocks * (kEpRowsThreads / 32);
  const int pieces = p.row_bytes / 16;
  const int staged = p.world_size * p.stream_rows;
  unsigned long long sent = 0;
  for (int r = blockIdx.x * (kEpRowsThreads / 32) + (threadIdx.x >> 5); r < p.rows; r += warps) {
    const int index = __ldg(p.received + r);
    if (index < 0 || index >= staged) continue;  // never written out of bounds, whatever the table holds
    const int src = index / p.stream_rows, row = index % p.stream_rows;
    if (lane == 0) {
      p.peers[src].signals[layout.row_word(p.rank, row)] = __float_as_uint(__ldg(p.dweight_row + r));
      if (src != p.rank) sent += 4;
    }
    if (p.dx_rows != nullptr) {
      const size_t dst_offset = (static_cast<size_t>(p.rank) * p.stream_rows + row) * p.row_bytes;
      copy_row(reinterpret_cast<int4*>(static_cast<char*>(p.peers[src].comb) + dst_offset),
               reinterpret_cast<const int4*>(static_cast<const char*>(p.dx_rows) + static_cast<size_t>(r) * p.row_bytes),
               pieces, lane);
      if (lane == 0 && src != p.rank) sent += p.row_bytes;
    }
  }
  if (lane == 0 && sent) atomicAdd(p.traffic + kTrafficCombine, sent);
}

// This rank's share into every peer's comb region [this rank] (16-byte pieces, grid-stride).
__device__ inline void share_to_peers(const EpRowsParams& p) {
  const int64_t pieces = p.n / 4;
  const size_t region = static_cast<size_t>(p.stream_rows) * p.row_bytes;
  const float4* src = reinterpret_cast<const float4*>(p.share);
  unsigned long long sent = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kEpRowsThreads + threadIdx.x; i < pieces;
       i += static_cast<int64_t>(p.blocks) * kEpRowsThreads) {
    const float4 v = __ldg(src + i);
    for (int peer = 0; peer < p.world_size; ++peer) {
      if (peer == p.rank) continue;
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
    ok = wait_at_least<Scope::System>(p.peers[p.rank].signals + layout.ready_flag(p.direction, peer), p.sequence, p,
                                      kPhaseEpSharesIn, peer);
  if (!__syncthreads_and(ok)) return;
  const int64_t pieces = p.n / 4;
  const size_t region = static_cast<size_t>(p.stream_rows) * p.row_bytes;
  const char* staging = static_cast<const char*>(p.peers[p.rank].comb);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kEpRowsThreads + threadIdx.x; i < pieces;
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

}  // namespace ep_rows

__global__ void __launch_bounds__(kEpRowsThreads) ep_rows_kernel(const __grid_constant__ EpRowsParams p) {
  const EpSignalLayout layout{p.world_size, p.local_experts, p.stream_rows};
  const bool to_owners = p.direction == EpDirection::ToOwners;
  // Our staging is free for this direction: what it held was read by earlier work on this stream.
  if (blockIdx.x == 0 && threadIdx.x == 0 && !p.silent) {
    __threadfence_system();
    for (int peer = 0; peer < p.world_size; ++peer)
      if (peer != p.rank) ptx::store_release_sys(p.peers[peer].signals + layout.free_flag(p.direction, p.rank), p.sequence);
  }
  const bool summing = p.direction == EpDirection::SumOverRanks;
  if (ep_rows::wait_for_free(p, layout)) {
    if (to_owners)
      ep_rows::rows_to_owners(p, layout);
    else if (summing)
      ep_rows::share_to_peers(p);
    else
      ep_rows::grads_to_sources(p, layout);
    __threadfence_system();  // the rows reach the peers before the ready flag
    const uint32_t barrier_phase = ep_rows::phase(p, kPhaseEpRowsOut, kPhaseEpGradsOut, kPhaseEpSharesOut);
    if (grid_barrier(p, barrier_phase, 1)) {
      if (blockIdx.x == 0 && threadIdx.x == 0 && !p.silent) {
        __threadfence_system();
        for (int peer = 0; peer < p.world_size; ++peer)
          if (peer != p.rank)
            ptx::store_release_sys(p.peers[peer].signals + layout.ready_flag(p.direction, p.rank), p.sequence);
      }
      if (summing) {
        ep_rows::sum_shares(p, layout);
      } else if (blockIdx.x == 0) {
        // The launch ends once every peer's rows are here: the work after it on the stream reads them.
        const int peer = threadIdx.x;
        if (peer < p.world_size && peer != p.rank)
          wait_at_least<Scope::System>(p.peers[p.rank].signals + layout.ready_flag(p.direction, peer), p.sequence, p,
                                       ep_rows::phase(p, kPhaseEpRowsIn, kPhaseEpGradsIn, kPhaseEpSharesIn), peer);
      }
    }
  }
  finish_launch(p);
}

}  // namespace flashdmoe
