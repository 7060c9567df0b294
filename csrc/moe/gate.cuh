// Gate phase: router GEMM on tensor cores for a tile of tokens, fp32 softmax, top-k with ties to the
// lower expert index, and the tile's per-expert counts and in-tile ranks (which become slots once the
// tile offsets are known). Deterministic: no atomics decide an order.
#pragma once
#include <climits>
#include "common/sync.cuh"
#include "moe/smem_layout.cuh"
#include "moe/tile_gemm.cuh"

namespace flashdmoe {

template <typename Element, int STAGES>
using GateGemm = TileGemm<Element, kGateTileM, kGateTileN, 1, 8, STAGES, /*B_K_CONTIGUOUS=*/true>;

__device__ __forceinline__ void warp_argmax(float& value, int& index) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_value = __shfl_xor_sync(0xffffffffu, value, offset);
    const int other_index = __shfl_xor_sync(0xffffffffu, index, offset);
    if (other_value > value || (other_value == value && other_index < index)) {
      value = other_value;
      index = other_index;
    }
  }
}

template <typename Element, int STAGES>
__device__ void gate_tile(const MoEParams& p, int tile, char* smem, const SmemLayout& layout) {
  constexpr int kGatePipelineBytes = gate_pipeline_bytes(STAGES);
  const int E = p.experts, k = p.top_k, H = p.hidden;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int first_token = tile * kGateTileM;
  const int tile_tokens = min(kGateTileM, p.tokens - first_token);
  const int stride = gate_logits_stride(E);
  float* logits = reinterpret_cast<float*>(smem + kGatePipelineBytes);
  int* choice = reinterpret_cast<int*>(smem + kGatePipelineBytes + round_up16(kGateTileM * stride * 4));
  const Element** a_rows = reinterpret_cast<const Element**>(smem + layout.row_ptrs_offset);
  const Element** b_rows = a_rows + kExpertTileM;
  const Element* x = static_cast<const Element*>(p.x);
  const Element* router = static_cast<const Element*>(p.router);

  // ---- logits = x_tile @ router^T, 128 experts at a time ----
  if (threadIdx.x < kGateTileM)
    a_rows[threadIdx.x] =
        threadIdx.x < tile_tokens ? x + static_cast<size_t>(first_token + threadIdx.x) * H : nullptr;
  for (int e0 = 0; e0 < E; e0 += kGateTileN) {
    if (threadIdx.x < kGateTileN)
      b_rows[threadIdx.x] = e0 + threadIdx.x < E ? router + static_cast<size_t>(e0 + threadIdx.x) * H : nullptr;
    sync_workers();
    GateGemm<Element, STAGES> gemm;
    gemm.run(smem, H / 64, [&](uint32_t a_dst, uint32_t b_dst, int k0) {
      GateGemm<Element, STAGES>::template load_rows<kGateTileM>(a_dst, a_rows, k0, x);
      GateGemm<Element, STAGES>::template load_rows<kGateTileN>(b_dst, b_rows, k0, router);
    });
    gemm.for_each_acc([&](int row, int col, float v) {
      if (e0 + col < E) logits[row * stride + e0 + col] = v;
    });
  }
  sync_workers();

  // ---- softmax + top-k: one warp per token ----
  for (int row = warp; row < tile_tokens; row += kThreads / 32) {
    float* prob = logits + row * stride;
    float max_logit = -INFINITY;
    bool finite = true;
    for (int e = lane; e < E; e += 32) {
      const float v = prob[e];
      finite &= isfinite(v);
      max_logit = fmaxf(max_logit, v);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      max_logit = fmaxf(max_logit, __shfl_xor_sync(0xffffffffu, max_logit, offset));
    if (!__all_sync(0xffffffffu, finite) && lane == 0) atomicOr(p.status_flags, kStatusNonFiniteLogits);
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) {
      const float ex = expf(prob[e] - max_logit);
      prob[e] = ex;
      sum += ex;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    for (int e = lane; e < E; e += 32) prob[e] = prob[e] / sum;

    uint32_t taken = 0;  // bit i: expert lane + 32 i already chosen (E <= 1024)
    float chosen_sum = 0.f;
    const int token = first_token + row;
    for (int j = 0; j < k; ++j) {
      float best = -INFINITY;
      int best_expert = INT_MAX;
      for (int e = lane, i = 0; e < E; e += 32, ++i)
        if (!((taken >> i) & 1u) && prob[e] > best) {  // ascending e: strict '>' keeps the lower index
          best = prob[e];
          best_expert = e;
        }
      warp_argmax(best, best_expert);
      if (best_expert >= E) best_expert = j;  // only with non-finite logits, which the host reports
      if ((best_expert & 31) == lane) taken |= 1u << (best_expert >> 5);
      chosen_sum += best;
      if (lane == 0) {
        choice[row * k + j] = best_expert;
        p.topk_expert[static_cast<size_t>(token) * k + j] = best_expert;
        p.topk_weight[static_cast<size_t>(token) * k + j] = best;  // normalised below
      }
    }
    __syncwarp();  // lane 0's weight stores are read back by the other lanes
    if (p.normalize_topk && lane < k) {
      const size_t at = static_cast<size_t>(token) * k + lane;
      p.topk_weight[at] = p.topk_weight[at] / chosen_sum;
    }
  }
  sync_workers();

  // ---- per-expert counts of this tile, and each choice's rank among them (token order) ----
  const int pairs = tile_tokens * k;
  for (int pair = threadIdx.x; pair < pairs; pair += kThreads) {
    const int expert = choice[pair];
    const int token_row = pair / k;
    int rank = 0;
    for (int q = 0; q < token_row * k; ++q) rank += choice[q] == expert;
    p.slot_in_tile[static_cast<size_t>(first_token) * k + pair] = rank;
  }
  for (int expert = threadIdx.x; expert < E; expert += kThreads) {
    int count = 0;
    for (int q = 0; q < pairs; ++q) count += choice[q] == expert;
    p.tile_expert_count[static_cast<size_t>(tile) * E + expert] = count;
  }
  sync_workers();  // smem is reused by the next tile
}

}  // namespace flashdmoe

namespace flashdmoe {

// The rank's gate tiles, on the worker threads, with the pipeline depth that fits the experts' logits.
template <typename Element>
__device__ void gate_tiles(const MoEParams& p, char* smem, const SmemLayout& layout) {
  if (gate_stages(p.experts) == kGateStagesDeep) {
    for (int tile = block_in_rank(p); tile < p.gate_tiles; tile += p.blocks)
      gate_tile<Element, kGateStagesDeep>(p, tile, smem, layout);
  } else {
    for (int tile = block_in_rank(p); tile < p.gate_tiles; tile += p.blocks)
      gate_tile<Element, kGateStagesShallow>(p, tile, smem, layout);
  }
}

}  // namespace flashdmoe
