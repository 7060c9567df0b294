// Gate phase: router GEMM on tensor cores for a tile of tokens, fp32 softmax, top-k with ties to the
// lower expert index, and the tile's per-expert counts and in-tile ranks (which become slots once the
// tile offsets are known). Deterministic: no atomics decide an order.
// The router GEMM's K slabs come through a cp.async pipeline issued by the worker threads, or, in the
// TMA variant, from the producer warp (two TMA boxes per slab into an mbarrier ring): issuing cp.async
// costs the workers more time per slab than the tensor-core work itself (scripts/gate_probe.cu), and the
// producer runs ahead into the next tile while the workers do softmax and top-k.
#pragma once
#include <climits>
#include "common/pipeline.cuh"
#include "common/sync.cuh"
#include "moe/routing.cuh"
#include "moe/smem_layout.cuh"
#include "moe/tile_gemm.cuh"
#include "moe/tma_boxes.cuh"

namespace flashdmoe {

template <typename Element, int STAGES>
using GateGemm = TileGemm<Element, kGateTileM, kGateTileN, 1, 8, STAGES, /*B_K_CONTIGUOUS=*/true>;

// Decode on one rank: a batch of at most one token per worker warp is routed and dispatched by the block
// that finishes its gate tile (dispatch.cuh route_gate_tile), so the gate's grid barrier is the last before
// the experts. At one token the offsets pass and the dispatch were two more barriers and a chain of round
// trips to memory for a few rows.
__device__ __forceinline__ bool routes_in_gate(const MoEParams& p) {
  return p.world_size == 1 && p.tokens >= 1 && p.tokens <= kThreads / 32;
}

// K slabs of a whole gate tile, and the first slab of split `split` of a tile.
template <typename Element>
__device__ __forceinline__ int gate_slabs(const MoEParams& p) { return p.hidden / kSlabDepth<Element>; }
template <typename Element>
__device__ __forceinline__ int split_begin(const MoEParams& p, int split) {
  return split * gate_slabs<Element>(p) / p.gate_splits;
}

// Where the gate's K slabs come from: the workers' own cp.async copies, or the producer warp's TMA boxes
// through a stage pipeline (TMA feed only; `at` is this thread's position in it, kept across tiles).
template <int STAGES>
struct GateFeed {
  StagePipeline<STAGES>* pipe;
  PipelineState<STAGES> at;
};

// Router GEMM of one gate tile over K slabs [k_begin, k_end): store(row, expert, partial logit) for
// every row of the tile (rows past the batch hold zeros) and every expert, 128 experts at a time.
template <typename Element, int STAGES, bool kTma, typename Store>
__device__ void router_gemm(const MoEParams& p, int tile, int k_begin, int k_end, char* smem, const SmemLayout& layout,
                            GateFeed<STAGES>& feed, Store&& store) {
  using Gemm = GateGemm<Element, STAGES>;
  const int E = p.experts, H = p.hidden;
  const int first_token = tile * kGateTileM;
  const int tile_tokens = min(kGateTileM, p.tokens - first_token);
  const Element** a_rows = reinterpret_cast<const Element**>(smem + layout.row_ptrs_offset);
  const Element** b_rows = a_rows + kExpertTileM;
  const Element* x = static_cast<const Element*>(p.x);
  const Element* router = static_cast<const Element*>(p.router);
  if (!kTma && threadIdx.x < kGateTileM)
    a_rows[threadIdx.x] =
        threadIdx.x < tile_tokens ? x + static_cast<size_t>(first_token + threadIdx.x) * H : nullptr;
  for (int e0 = 0; e0 < E; e0 += kGateTileN) {
    Gemm gemm;
    if constexpr (kTma) {
      const uint32_t base = ptx::smem_addr(smem);
      const bool lane0 = (threadIdx.x & 31) == 0;
      // A warp whose 16 expert columns are all past E only paces the ring: with few experts most warps'
      // ldmatrix traffic and MMAs would be for columns that are never stored.
      const bool has_experts = e0 + (threadIdx.x >> 5) * Gemm::kWarpN < E;
      gemm.zero_acc();
      for (int kt = k_begin; kt < k_end; ++kt, feed.at.advance()) {
        feed.pipe->consumer_wait(feed.at, p);  // a failure is in the error word
        const uint32_t s = feed.at.index();
        if (has_experts)
          gemm.mma_stage(base + s * Gemm::kStageBytesA, base + STAGES * Gemm::kStageBytesA + s * Gemm::kStageBytesB);
        __syncwarp();
        if (lane0) feed.pipe->consumer_release(feed.at);
      }
    } else {
      if (threadIdx.x < kGateTileN)
        b_rows[threadIdx.x] = e0 + threadIdx.x < E ? router + static_cast<size_t>(e0 + threadIdx.x) * H : nullptr;
      sync_workers();
      const int k_offset = k_begin * Gemm::kBlockK;
      gemm.run(smem, k_end - k_begin, [&](uint32_t a_dst, uint32_t b_dst, int k0) {
        Gemm::template load_rows<kGateTileM>(a_dst, a_rows, k_offset + k0, x);
        Gemm::template load_rows<kGateTileN>(b_dst, b_rows, k_offset + k0, router);
      });
    }
    gemm.for_each_acc([&](int row, int col, float v) {
      if (e0 + col < E) store(row, e0 + col, v);
    });
  }
  sync_workers();
}

// The producer warp's side of router_gemm (lane 0 issues): per slab, a 32-token box of x and a box of
// up to 128 router rows (rows past T or E are zero-filled and still count as bytes). Stage rows past
// the router box keep stale data: they only feed logit columns >= E, which are never stored.
template <typename Element, int STAGES>
__device__ bool router_loads(const MoEParams& p, int tile, int k_begin, int k_end, char* smem, GateFeed<STAGES>& feed) {
  using Gemm = GateGemm<Element, STAGES>;
  static_assert(kGateTokenBox.dims[1] == kGateTileM && kGateTokenBox.bytes() == Gemm::kStageBytesA,
                "a gate A stage is one token box");
  static_assert(gate_router_box(kMaxExperts).dims[1] == kGateTileN &&
                gate_router_box(kMaxExperts).bytes() == Gemm::kStageBytesB, "a gate B stage holds a router box");
  const uint32_t base = ptx::smem_addr(smem);
  for (int e0 = 0; e0 < p.experts; e0 += kGateTileN) {
    for (int kt = k_begin; kt < k_end; ++kt, feed.at.advance()) {
      if (!feed.pipe->producer_acquire(feed.at, p)) return false;
      const uint32_t s = feed.at.index();
      const uint32_t full = feed.pipe->producer_commit(feed.at, kGateTokenBox.bytes() + gate_router_box_bytes(p.experts));
      tma::load_2d(base + s * Gemm::kStageBytesA, &p.maps.gate_x, full, kt * 64, tile * kGateTileM);
      tma::load_2d(base + STAGES * Gemm::kStageBytesA + s * Gemm::kStageBytesB, &p.maps.router, full, kt * 64, e0);
    }
  }
  return true;
}

template <int STAGES>
__device__ __forceinline__ float* gate_logits(char* smem) {
  return reinterpret_cast<float*>(smem + gate_pipeline_bytes(STAGES));
}

// Softmax and top-k of token rows by groups of G lanes (G = 32: a warp per row, for a few rows; G = 8: four
// rows per warp, so that a full tile's 32 rows run at once instead of four after another on each warp).
// Lane g of a group reads experts g, g + G, ... The row's sum is formed in the tree of a 32-lane butterfly
// over per-lane partials of experts e = L mod 32 (the first levels inside each lane, the rest by shuffles),
// and max and argmax do not depend on order: every G gives the same bits. Ties go to the lower expert.
// A chosen expert's probability is overwritten with -inf, which excludes it from the next rounds.
// Not inlined: one copy per G instead of one per caller and pipeline depth, and the training
// instance's registers elsewhere stay as they were. What it needs of the parameters comes by value in
// `out` (through a reference it loaded them from the parameter space by generic loads).
// Every loop stays rolled (`unroll 1`): a block runs this once per tile, at decode once per launch, with
// its instructions not yet in the SM's cache, and fetching them cost more than the loops' overhead
// (unrolled, the copy for G = 32 was 19.5 KB of SASS, 7.2 KB rolled; docs/perf-notes.md, "Instruction
// fetch in the decode forward").
struct GateRows {
  int experts, top_k;
  bool normalize;
  int* topk_expert;    // [T, k]
  float* topk_weight;  // [T, k]
  uint32_t* status_flags;
};
template <int G>
static __device__ __noinline__ void softmax_topk_rows(const GateRows out, float* logits, int stride, int first_token,
                                                     int tile_tokens, int* choice, float* weight) {
  constexpr int kLanesPerG = 32 / G;  // a lane's partials of the butterfly
  constexpr int kGroups = kThreads / G;
  const int E = out.experts, k = out.top_k;
  const int g = threadIdx.x & (G - 1), group = threadIdx.x / G;
  // Every group of a warp takes the same number of rounds (the shuffles are warp-wide); a group past the
  // tile's rows computes on whatever its row of the buffer holds (zeros, or a split tile's stale rows),
  // within its own lanes, and stores nothing.
  for (int base = 0; base < tile_tokens; base += kGroups) {
    const int row = base + group;
    const bool valid = row < tile_tokens;
    float* prob = logits + row * stride;  // rows past the tile's tokens stay in the buffer's 32
    float max_logit = -INFINITY;
    bool finite = true;
#pragma unroll 1
    for (int e = g; e < E; e += G) {
      const float v = prob[e];
      finite &= isfinite(v);
      max_logit = fmaxf(max_logit, v);
    }
#pragma unroll
    for (int offset = G / 2; offset > 0; offset >>= 1)
      max_logit = fmaxf(max_logit, __shfl_xor_sync(0xffffffffu, max_logit, offset));
    if (valid && !finite) atomicOr(out.status_flags, kStatusNonFiniteLogits);
    float part[kLanesPerG];
#pragma unroll
    for (int u = 0; u < kLanesPerG; ++u) part[u] = 0.f;
#pragma unroll 1
    for (int e0 = 0; e0 < E; e0 += 32) {
#pragma unroll
      for (int u = 0; u < kLanesPerG; ++u) {
        const int e = e0 + u * G + g;
        if (e < E) {
          const float ex = expf(prob[e] - max_logit);
          if (valid) prob[e] = ex;
          part[u] += ex;
        }
      }
    }
    // Butterfly levels 16 .. G inside the lane (partials u and u ^ (offset / G) are lanes L and L ^ offset).
#pragma unroll
    for (int offset = 16; offset >= G; offset >>= 1) {
      float next[kLanesPerG];
#pragma unroll
      for (int u = 0; u < kLanesPerG; ++u) next[u] = part[u] + part[u ^ (offset / G)];
#pragma unroll
      for (int u = 0; u < kLanesPerG; ++u) part[u] = next[u];
    }
    float sum = part[0];
#pragma unroll
    for (int offset = G / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (valid)
#pragma unroll 1
      for (int e = g; e < E; e += G) prob[e] = prob[e] / sum;

    float chosen_sum = 0.f;
#pragma unroll 1
    for (int j = 0; j < k; ++j) {
      float best = -INFINITY;
      int best_expert = INT_MAX;
#pragma unroll 1
      for (int e = g; e < E; e += G) {
        const float v = prob[e];
        if (v > best) {  // ascending e: strict '>' keeps the lower index
          best = v;
          best_expert = e;
        }
      }
#pragma unroll
      for (int offset = G / 2; offset > 0; offset >>= 1) {
        const float other_value = __shfl_xor_sync(0xffffffffu, best, offset);
        const int other_index = __shfl_xor_sync(0xffffffffu, best_expert, offset);
        if (other_value > best || (other_value == best && other_index < best_expert)) {
          best = other_value;
          best_expert = other_index;
        }
      }
      if (best_expert >= E) best_expert = j;  // only with non-finite logits, which the host reports
      if (valid && (best_expert & (G - 1)) == g) prob[best_expert] = -INFINITY;
      chosen_sum += best;
      if (valid && g == 0) {
        choice[row * k + j] = best_expert;
        weight[row * k + j] = best;
        out.topk_expert[static_cast<size_t>(first_token + row) * k + j] = best_expert;
      }
    }
    __syncwarp();  // the group's lane 0 wrote the weights
    if (valid)
#pragma unroll 1
      for (int j = g; j < k; j += G) {
        const float w = weight[row * k + j];
        out.topk_weight[static_cast<size_t>(first_token + row) * k + j] = out.normalize ? w / chosen_sum : w;
      }
  }
}

// Softmax, top-k and the tile's counts from the tile's full logits in shared memory; a tile the gate routes
// (routes_in_gate) also leaves its counts, choices and their ranks in shared memory (RoutedTile).
template <int STAGES>
__device__ void finish_gate_tile(const MoEParams& p, int tile, char* smem) {
  const int E = p.experts, k = p.top_k;
  const int first_token = tile * kGateTileM;
  const int tile_tokens = min(kGateTileM, p.tokens - first_token);
  const int stride = gate_logits_stride(E);
  float* logits = gate_logits<STAGES>(smem);
  int* choice = reinterpret_cast<int*>(smem + gate_pipeline_bytes(STAGES) + round_up16(kGateTileM * stride * 4));
  float* weight = reinterpret_cast<float*>(choice) + round_up16(kGateTileM * k * 4) / 4;
  const GateRows out{E, k, p.normalize_topk, p.topk_expert, p.topk_weight, p.status_flags};
  if (tile_tokens > kThreads / 32)
    softmax_topk_rows<8>(out, logits, stride, first_token, tile_tokens, choice, weight);
  else
    softmax_topk_rows<32>(out, logits, stride, first_token, tile_tokens, choice, weight);
  sync_workers();

  // ---- per-expert counts of this tile, and each choice's rank among them (token order) ----
  // A token chooses an expert at most once, so the tile's choices of expert e are the set bits of a
  // 32-bit mask over its rows: count = popc(mask), a choice's rank = the bits of the rows before its own.
  // (The logits are read no more: the masks go where they were.)
  // The loops stay rolled: the function is inlined four times, and unrolled copies cost code size
  // (instruction-cache misses at decode) for trip counts that are one or two.
  static_assert(kGateTileM <= 32, "a gate tile's rows fit a 32-bit mask");
  uint32_t* rows_of = reinterpret_cast<uint32_t*>(logits);
#pragma unroll 1
  for (int expert = threadIdx.x; expert < E; expert += kThreads) rows_of[expert] = 0;
  sync_workers();
  const int pairs = tile_tokens * k;
#pragma unroll 1
  for (int pair = threadIdx.x; pair < pairs; pair += kThreads) atomicOr(rows_of + choice[pair], 1u << (pair / k));
  sync_workers();
  // Routed: the gate's stages are done with (one tile, one item per block: gate_splits_for).
  const RoutedTile routed = routes_in_gate(p) ? routed_tile(smem, E, k) : RoutedTile{};
#pragma unroll 1
  for (int pair = threadIdx.x; pair < pairs; pair += kThreads) {
    const int expert = choice[pair];
    const int rank = __popc(rows_of[expert] & ((1u << (pair / k)) - 1u));
    p.slot_in_tile[static_cast<size_t>(first_token) * k + pair] = rank;
    if (routed.count != nullptr) {
      routed.expert[pair] = expert;
      routed.slot[pair] = rank;
    }
  }
#pragma unroll 1
  for (int expert = threadIdx.x; expert < E; expert += kThreads) {
    const int count = __popc(rows_of[expert]);
    p.tile_expert_count[static_cast<size_t>(tile) * E + expert] = count;
    if (routed.count != nullptr) routed.count[expert] = count;
  }
  sync_workers();  // smem is reused by the next tile
}

// A whole tile on one block.
template <typename Element, int STAGES, bool kTma>
__device__ void gate_tile(const MoEParams& p, int tile, char* smem, const SmemLayout& layout, GateFeed<STAGES>& feed) {
  float* logits = gate_logits<STAGES>(smem);
  const int stride = gate_logits_stride(p.experts);
  router_gemm<Element, STAGES, kTma>(p, tile, 0, gate_slabs<Element>(p), smem, layout, feed,
                               [&](int row, int expert, float v) { logits[row * stride + expert] = v; });
  finish_gate_tile<STAGES>(p, tile, smem);
}

// The split tile's logits (rows x E, into `logits` with row stride `stride`) from the splits' partials
// at `first`. A split's partials for the tile's rows are rows * E consecutive floats, 16-byte aligned
// (the workspace region is, and a split's are 32 * E floats apart): summed four at a time, four splits'
// loads in flight, each element in split order (the scalar tail sums the same way). Not inlined: the
// kernel's register allocation elsewhere (the training instance's epilogue) stays as it was. Its loops
// stay rolled for the reason softmax_topk_rows gives (11.6 KB of SASS unrolled, 3.6 KB rolled).
static __device__ __noinline__ void sum_gate_partials(const float* first, int splits, int rows, int E, float* logits,
                                                      int stride) {
  const size_t split_stride = static_cast<size_t>(kGateTileM) * E;
  const int count = rows * E;
  constexpr int kBatch = 4;
  auto to_logits = [&](int i, float v) { logits[(i / E) * stride + i % E] = v; };
#pragma unroll 1
  for (int q = threadIdx.x; q < count / 4; q += kThreads) {
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    int s = 0;
#pragma unroll 1
    for (; s + kBatch <= splits; s += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) v[j] = __ldcg(reinterpret_cast<const float4*>(first + (s + j) * split_stride) + q);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        sum.x += v[j].x;
        sum.y += v[j].y;
        sum.z += v[j].z;
        sum.w += v[j].w;
      }
    }
#pragma unroll 1
    for (; s < splits; ++s) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(first + s * split_stride) + q);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    to_logits(4 * q, sum.x);
    to_logits(4 * q + 1, sum.y);
    to_logits(4 * q + 2, sum.z);
    to_logits(4 * q + 3, sum.w);
  }
  for (int i = count / 4 * 4 + threadIdx.x; i < count; i += kThreads) {
    float sum = 0.f;
#pragma unroll 1
    for (int s = 0; s < splits; ++s) sum += __ldcg(first + s * split_stride + i);
    to_logits(i, sum);
  }
}

// One K range of a split tile: partial logits to the workspace; the tile's last block to arrive sums
// the partials in split order (the same sum whichever block is last) and finishes the tile. Returns
// whether this block finished it.
// Only the tile's token rows are written and summed: a decode tile of one token over 32 splits would
// otherwise have its last block alone read 32 x 32 padding-row partials (512 KB with E = 128), which
// cost more than the split saved.
template <typename Element, int STAGES, bool kTma>
__device__ bool gate_split_item(const MoEParams& p, int item, char* smem, const SmemLayout& layout,
                                GateFeed<STAGES>& feed) {
  __shared__ int last_to_arrive;
  const int E = p.experts, splits = p.gate_splits;
  const int tile = item / splits, split = item % splits;
  const int tile_tokens = min(kGateTileM, p.tokens - tile * kGateTileM);
  float* partial = p.gate_partial + static_cast<size_t>(item) * kGateTileM * E;
  router_gemm<Element, STAGES, kTma>(p, tile, split_begin<Element>(p, split), split_begin<Element>(p, split + 1), smem,
                                     layout, feed, [&](int row, int expert, float v) {
                                       if (row < tile_tokens) partial[row * E + expert] = v;
                                     });
  // Every writer fences its own partials (not only the arriving thread: the stores come from all
  // workers), and every reader fences after learning it is last.
  __threadfence();
  sync_workers();
  if (threadIdx.x == 0) last_to_arrive = atomicAdd(p.gate_arrivals + tile, 1u) == static_cast<uint32_t>(splits - 1);
  sync_workers();
  if (!last_to_arrive) return false;
  __threadfence();
  sum_gate_partials(p.gate_partial + static_cast<size_t>(tile) * splits * kGateTileM * E, splits, tile_tokens, E,
                    gate_logits<STAGES>(smem), gate_logits_stride(E));
  sync_workers();
  finish_gate_tile<STAGES>(p, tile, smem);
  return true;
}

// The block's gate work: whole tiles, or (tile, K range) items when the tiles are split. With TMA the
// producer warp walks the same list issuing the loads; the workers compute. Returns whether this block
// finished a tile (workers; false for the producer warp).
template <typename Element, int STAGES, bool kTma>
__device__ bool gate_all_tiles(const MoEParams& p, char* smem, const SmemLayout& layout) {
  __shared__ StagePipeline<STAGES> pipe;
  const bool producer = threadIdx.x >= kThreads;
  GateFeed<STAGES> feed{kTma ? &pipe : nullptr, {}};
  if constexpr (kTma) {
    if (threadIdx.x == 0) pipe.init(kThreads / 32);  // released by every worker warp
    __syncthreads();
    if (producer) {
      if (threadIdx.x != kThreads) return false;
      if (p.gate_splits > 1) {
        for (int item = block_in_rank(p); item < p.gate_tiles * p.gate_splits; item += p.blocks) {
          const int split = item % p.gate_splits;
          const int first = split_begin<Element>(p, split), end = split_begin<Element>(p, split + 1);
          if (!router_loads<Element, STAGES>(p, item / p.gate_splits, first, end, smem, feed))
            return false;
        }
      } else {
        for (int tile = block_in_rank(p); tile < p.gate_tiles; tile += p.blocks)
          if (!router_loads<Element, STAGES>(p, tile, 0, gate_slabs<Element>(p), smem, feed)) return false;
      }
      return false;
    }
  }
  bool finished = false;
  if (p.gate_splits > 1) {
    for (int item = block_in_rank(p); item < p.gate_tiles * p.gate_splits; item += p.blocks)
      finished |= gate_split_item<Element, STAGES, kTma>(p, item, smem, layout, feed);
  } else {
    for (int tile = block_in_rank(p); tile < p.gate_tiles; tile += p.blocks) {
      gate_tile<Element, STAGES, kTma>(p, tile, smem, layout, feed);
      finished = true;
    }
  }
  return finished;
}

// The rank's gate tiles with the pipeline depth that fits the experts' logits. Every thread of the
// block calls it; without TMA only the workers take part. Returns whether this block finished a tile
// (its workers).
template <typename Element, bool kTma>
__device__ bool gate_tiles(const MoEParams& p, char* smem, const SmemLayout& layout) {
  if (!kTma && threadIdx.x >= kThreads) return false;
  if (gate_stages(p.experts) == kGateStagesDeep)
    return gate_all_tiles<Element, kGateStagesDeep, kTma>(p, smem, layout);
  return gate_all_tiles<Element, kGateStagesShallow, kTma>(p, smem, layout);
}

}  // namespace flashdmoe
