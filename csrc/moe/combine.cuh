// Combine: y[t] = sum_j w[t,j] * result(t,j), summed in fp32 in choice order j = 0..k-1 (a gather,
// never floating-point atomics: the output is bitwise reproducible). result(t,j) is row(t,j) of this
// rank's comb buffer, region [owner of the chosen expert]. Dropped choices add zero.
#pragma once
#include "moe/expert_ffn.cuh"
#include "moe/tile_gemm_tma.cuh"

namespace flashdmoe {

// Bounded wait for every peer's results-done flag. The worker threads call it.
__device__ inline bool wait_for_results(const MoEParams& p) {
  bool ok = true;
  if (threadIdx.x < p.world_size && static_cast<int>(threadIdx.x) != p.rank) {
    const uint32_t* flag = p.peers[p.rank].signals + signal_results_done(p.world_size, p.local_experts, threadIdx.x);
    ok = wait_at_least<Scope::System>(flag, p.sequence, p, kPhasePeerResults, threadIdx.x);
  }
  return sync_workers_and(ok);
}

template <typename Element>
__device__ void combine_tokens(const MoEParams& p) {
  const int H = p.hidden, k = p.top_k;
  const int lane = threadIdx.x & 31;
  const int warps = p.blocks * (kThreads / 32);
  const Element* comb = static_cast<const Element*>(p.peers[p.rank].comb);
  Element* y = static_cast<Element*>(p.y);
  // One warp per (token, chunk of kParts x 256 columns): small batches still spread over every warp of
  // the rank, and each lane keeps 64 bytes of each of two choices in flight (the combine is bound by
  // the bytes in flight per SM).
  constexpr int kParts = 8 / static_cast<int>(sizeof(Element));  // 4 for 16-bit inputs, 2 for fp32
  constexpr int kChunkColumns = kParts * 32 * 8;
  const int chunks = (H + kChunkColumns - 1) / kChunkColumns;
  const long long items = static_cast<long long>(p.tokens) * chunks;
  for (long long item = block_in_rank(p) * (kThreads / 32) + (threadIdx.x >> 5); item < items; item += warps) {
    const int token = static_cast<int>(item / chunks);
    const int c0 = static_cast<int>(item % chunks) * kChunkColumns;
    const size_t first = static_cast<size_t>(token) * k;
    // Lane j holds choice j's row and weight (k <= 32); the loop broadcasts them.
    int my_row = lane < k ? __ldcg(p.topk_row + first + lane) : -1;
    if (my_row >= 0) my_row += (__ldcg(p.topk_expert + first + lane) / p.local_experts) * p.stream_rows;
    const float my_weight = lane < k ? __ldcg(p.topk_weight + first + lane) : 0.f;
    {
      int c[kParts];
#pragma unroll
      for (int u = 0; u < kParts; ++u) c[u] = c0 + u * 32 * 8 + lane * 8;
      float acc[kParts][8];
#pragma unroll
      for (int u = 0; u < kParts; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.f;
      // Two choices per step: both rows' loads are in flight before either is summed (still in
      // choice order, so the sum is the same as one choice at a time).
      for (int j = 0; j < k; j += 2) {
        const bool pair = j + 1 < k;
        const int row[2] = {__shfl_sync(0xffffffffu, my_row, j), __shfl_sync(0xffffffffu, my_row, pair ? j + 1 : j)};
        const float w[2] = {__shfl_sync(0xffffffffu, my_weight, j), __shfl_sync(0xffffffffu, my_weight, pair ? j + 1 : j)};
        const bool use[2] = {row[0] >= 0, pair && row[1] >= 0};
        Pack8<Element> raw[2][kParts];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          if (!use[q]) continue;
          const Element* src = comb + static_cast<size_t>(row[q]) * H;
#pragma unroll
          for (int u = 0; u < kParts; ++u)
            if (c[u] < H) raw[q][u] = load_pack8_cg(src + c[u]);
        }
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          if (!use[q]) continue;
#pragma unroll
          for (int u = 0; u < kParts; ++u) {
            if (c[u] >= H) continue;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[u][i] = fmaf(w[q], static_cast<float>(raw[q][u].v[i]), acc[u][i]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kParts; ++u) {
        if (c[u] >= H) continue;
        Pack8<Element> pack;
#pragma unroll
        for (int i = 0; i < 8; ++i) pack.v[i] = static_cast<Element>(acc[u][i]);
        *reinterpret_cast<Pack8<Element>*>(y + static_cast<size_t>(token) * H + c[u]) = pack;
      }
    }
  }
}

// ---- TMA variants: the producer warp streams the chosen rows into shared memory ----
// The combine is bound by bytes in flight: the workers' own loads keep at most 32 KB per SM in flight
// and stall between items. Here the producer warp's bulk copies fill a ring of stages (192 KB) with
// whole (token, column chunk) items, all k chosen rows at once, and the workers only sum from shared
// memory and store. Same sums in the same order as combine_tokens: the output is bitwise the same.
constexpr int kCombineStages = 8;
constexpr int kCombineStageBytes = 24 * 1024;
constexpr int kCombineRingBytes = kCombineStages * kCombineStageBytes;

// Per stage, beside the rows (in the scratch area after the ring, not in static shared memory, which
// every phase would pay for).
struct CombineStage {
  float weight[kMaxTopK];  // 0 and valid bit clear for a dropped choice
  uint32_t valid;          // bit j: choice j's row is in the stage
};
constexpr int kCombineScratchBytes = kCombineRingBytes + kCombineStages * static_cast<int>(sizeof(CombineStage));
struct CombineRing {
  TmaPipelineBarriers<kCombineStages> bars;
};
__device__ __forceinline__ CombineStage* combine_meta(char* smem) {
  return reinterpret_cast<CombineStage*>(smem + kCombineRingBytes);
}

// Columns per item: all k rows of the chunk fit one stage (>= 64: k * 64 * 2 bytes <= 4 KB).
__device__ __forceinline__ int combine_item_columns(const MoEParams& p, int element_bytes) {
  const int columns = kCombineStageBytes / (p.top_k * element_bytes) / 64 * 64;
  return columns < p.hidden ? columns : p.hidden;
}

// Lane 0 of the producer warp.
template <typename Element>
__device__ bool combine_loads(const MoEParams& p, char* smem, CombineRing& ring) {
  const int H = p.hidden, k = p.top_k;
  const int columns = combine_item_columns(p, sizeof(Element));
  const int chunks = (H + columns - 1) / columns;
  const long long items = static_cast<long long>(p.tokens) * chunks;
  const Element* comb = static_cast<const Element*>(p.peers[p.rank].comb);
  const uint32_t base = ptx::smem_addr(smem);
  tma::fence_proxy_async_global();  // the rows were written by generic stores (GEMM2 epilogues, peers)
  uint32_t n = 0;
  for (long long item = block_in_rank(p); item < items; item += p.blocks, ++n) {
    const uint32_t s = n % kCombineStages, use = n / kCombineStages;
    if (use > 0 && !wait_pipeline(ptx::smem_addr(&ring.bars.empty[s]), (use - 1) & 1, p)) return false;
    const int token = static_cast<int>(item / chunks);
    const int c0 = static_cast<int>(item % chunks) * columns;
    const int width = min(columns, H - c0);
    const size_t first = static_cast<size_t>(token) * k;
    CombineStage& meta = combine_meta(smem)[s];
    uint32_t valid = 0;
    for (int j = 0; j < k; ++j) {
      const bool kept = __ldcg(p.topk_row + first + j) >= 0;
      valid |= static_cast<uint32_t>(kept) << j;
      meta.weight[j] = kept ? __ldcg(p.topk_weight + first + j) : 0.f;
    }
    meta.valid = valid;
    const uint32_t full = ptx::smem_addr(&ring.bars.full[s]);
    tma::arrive_expect_tx(full, static_cast<uint32_t>(__popc(valid)) * width * sizeof(Element));  // releases meta
    for (int j = 0; j < k; ++j) {
      if (!((valid >> j) & 1u)) continue;
      const int row = __ldcg(p.topk_row + first + j) + (__ldcg(p.topk_expert + first + j) / p.local_experts) * p.stream_rows;
      tma::load_1d(base + s * kCombineStageBytes + j * width * sizeof(Element),
                   comb + static_cast<size_t>(row) * H + c0, width * sizeof(Element), full);
    }
  }
  return true;
}

// The workers: y[token, chunk] = sum_j w_j * row_j in choice order, fp32, from the stage.
template <typename Element>
__device__ bool combine_sums(const MoEParams& p, char* smem, CombineRing& ring) {
  const int H = p.hidden, k = p.top_k;
  const int columns = combine_item_columns(p, sizeof(Element));
  const int chunks = (H + columns - 1) / columns;
  const long long items = static_cast<long long>(p.tokens) * chunks;
  Element* y = static_cast<Element*>(p.y);
  bool ok = true;
  uint32_t n = 0;
  for (long long item = block_in_rank(p); item < items; item += p.blocks, ++n) {
    const uint32_t s = n % kCombineStages, use = n / kCombineStages;
    ok = ok && wait_pipeline(ptx::smem_addr(&ring.bars.full[s]), use & 1, p);
    const int token = static_cast<int>(item / chunks);
    const int c0 = static_cast<int>(item % chunks) * columns;
    const int width = min(columns, H - c0);
    const CombineStage& meta = combine_meta(smem)[s];
    const char* stage = smem + s * kCombineStageBytes;
    for (int c = threadIdx.x * 8; c < width; c += kThreads * 8) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.f;
      for (int j = 0; j < k; ++j) {
        if (!((meta.valid >> j) & 1u)) continue;
        const Pack8<Element> v = *reinterpret_cast<const Pack8<Element>*>(stage + (j * width + c) * sizeof(Element));
        const float w = meta.weight[j];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, static_cast<float>(v.v[i]), acc[i]);
      }
      Pack8<Element> out;
#pragma unroll
      for (int i = 0; i < 8; ++i) out.v[i] = static_cast<Element>(acc[i]);
      *reinterpret_cast<Pack8<Element>*>(y + static_cast<size_t>(token) * H + c0 + c) = out;
    }
    __syncwarp();
    if ((threadIdx.x & 31) == 0) tma::arrive(ptx::smem_addr(&ring.bars.empty[s]));
  }
  return ok;
}

// Whole block (workers and producer warp), after the results are in place.
template <typename Element>
__device__ bool combine_tokens_bulk(const MoEParams& p, char* smem) {
  __shared__ CombineRing ring;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kCombineStages; ++s) {
      tma::mbarrier_init(ptx::smem_addr(&ring.bars.full[s]), 1);
      tma::mbarrier_init(ptx::smem_addr(&ring.bars.empty[s]), kThreads / 32);
    }
    tma::fence_barrier_init();
  }
  __syncthreads();
  bool ok = true;
  if (threadIdx.x < kThreads)
    ok = combine_sums<Element>(p, smem, ring);
  else if (threadIdx.x == kThreads)
    ok = combine_loads<Element>(p, smem, ring);
  return __syncthreads_and(ok);
}

}  // namespace flashdmoe
