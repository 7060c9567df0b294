// Combine: y[t] = sum_j w[t,j] * result(t,j), summed in fp32 in choice order j = 0..k-1 (a gather,
// never floating-point atomics: the output is bitwise reproducible). result(t,j) is row(t,j) of this
// rank's comb buffer, region [owner of the chosen expert]. Dropped choices add zero.
#pragma once
#include "common/pipeline.cuh"
#include "common/tma.cuh"
#include "moe/expert_ffn.cuh"

namespace flashdmoe {

constexpr int kCombinePart = 32 * 8;  // columns a warp sums per step: 8 per lane

// Bounded wait for every peer's results-done flag. The worker threads call it.
__device__ inline bool wait_for_results(const MoEParams& p) {
  bool ok = true;
  if (threadIdx.x < p.world_size && static_cast<int>(threadIdx.x) != p.rank) {
    const uint32_t* flag = p.peers[p.rank].signals + signal_results_done(p.world_size, p.local_experts, threadIdx.x);
    ok = wait_at_least<Scope::System>(flag, forward_sequence(p), p, kPhasePeerResults, threadIdx.x);
  }
  return sync_workers_and(ok);
}

// One warp's share of a token's combine: columns c0 + lane * 8 (256 in all) of y[token], from the token's
// k choices (lane j holds choice j's row and weight, k <= 32), kGroup choices' loads in flight before any
// is summed. The sum is in choice order whatever kGroup is, so the bits are the same as the staged path's.
// No lane-divergent branch sits between a group's loads (with one, the compiler converted each choice's
// values before it issued the next choice's loads, one choice in flight): a dropped choice (row -1) loads
// row 0 and leaves the sum as it was, a column past H loads column 0 and is never stored; only the choices
// past k are skipped, warp-uniformly. `loads_issued()` runs once the first group's loads are issued,
// before anything waits for them.
template <typename Element, int kGroup, typename Hook>
__device__ __forceinline__ void combine_chunk(const MoEParams& p, const Element* comb, Element* y, int token, int c0,
                                              int my_row, float my_weight, Hook&& loads_issued) {
  const int H = p.hidden, k = p.top_k, lane = threadIdx.x & 31;
  const int c = c0 + lane * 8;
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.f;
  for (int j0 = 0; j0 < k; j0 += kGroup) {
    int row[kGroup];
    float w[kGroup];
#pragma unroll
    for (int q = 0; q < kGroup; ++q) {
      const int j = min(j0 + q, k - 1);
      row[q] = __shfl_sync(0xffffffffu, my_row, j);
      w[q] = __shfl_sync(0xffffffffu, my_weight, j);
    }
    Pack8<Element> raw[kGroup];
#pragma unroll
    for (int q = 0; q < kGroup; ++q) {
      if (j0 + q >= k) break;
      const Element* src = comb + static_cast<size_t>(max(row[q], 0)) * H;
      raw[q] = load_pack8_cg(src + (c < H ? c : 0));
    }
    if (j0 == 0) loads_issued();
#pragma unroll
    for (int q = 0; q < kGroup; ++q) {
      if (j0 + q >= k) break;
      const bool kept = row[q] >= 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float sum = fmaf(w[q], static_cast<float>(raw[q].v[i]), acc[i]);
        acc[i] = kept ? sum : acc[i];
      }
    }
  }
  if (c >= H) return;
  Pack8<Element> pack;
#pragma unroll
  for (int i = 0; i < 8; ++i) pack.v[i] = static_cast<Element>(acc[i]);
  *reinterpret_cast<Pack8<Element>*>(y + static_cast<size_t>(token) * H + c) = pack;
}

// One item of the combine as lane j holds it: the token, the first column, and choice j's stream row to
// its owner (-1 if dropped), expert and combine weight.
struct CombineItem {
  int token, c0, row, expert;
  float weight;
};

// The choice's row in this rank's comb buffer (its owner's region), or -1 if dropped.
__device__ __forceinline__ int comb_row(const MoEParams& p, const CombineItem& it) {
  return it.row >= 0 ? it.row + (it.expert / p.local_experts) * p.stream_rows : -1;
}

// A warp's items: (token, chunk of `columns`) pairs `warps` apart over the rank's tokens, stepped without
// a division (a 64-bit one is a call, which waits for every load in flight).
struct WarpItems {
  int token, chunk, chunks, columns, step_tokens, step_chunks;

  __device__ __forceinline__ WarpItems(const MoEParams& p, int chunk_columns) : columns(chunk_columns) {
    const int warps = p.blocks * (kThreads / 32);
    chunks = (p.hidden + columns - 1) / columns;
    step_tokens = warps / chunks;
    step_chunks = warps % chunks;
    const int first = block_in_rank(p) * (kThreads / 32) + (threadIdx.x >> 5);
    token = first / chunks;
    chunk = first % chunks;
  }
  // The next item, its routing loaded (lanes < k; past the last token, no loads: token >= p.tokens).
  __device__ __forceinline__ CombineItem take(const MoEParams& p) {
    const int k = p.top_k, lane = threadIdx.x & 31;
    CombineItem it{token, chunk * columns, -1, 0, 0.f};
    if (token < p.tokens && lane < k) {
      const size_t at = static_cast<size_t>(token) * k + lane;
      it.row = __ldcg(p.topk_row + at);
      it.expert = __ldcg(p.topk_expert + at);
      it.weight = __ldcg(p.topk_weight + at);
    }
    chunk += step_chunks;
    token += step_tokens;
    if (chunk >= chunks) {
      chunk -= chunks;
      ++token;
    }
    return it;
  }
};

// The rank's tokens over every warp of the rank, one warp per (token, 256 columns), from registers. A warp's
// routing runs two items ahead: after this item's rows it loads the routing of the item after next, so an
// item waits for one round trip to memory, not two.
template <typename Element, int kGroup>
__device__ __forceinline__ void combine_token_chunks(const MoEParams& p) {
  const Element* comb = static_cast<const Element*>(p.peers[p.rank].comb);
  Element* y = static_cast<Element*>(p.y);
  WarpItems items(p, kCombinePart);
  CombineItem mine = items.take(p);
  CombineItem next = items.take(p);
  while (mine.token < p.tokens) {
    CombineItem later;
    combine_chunk<Element, kGroup>(p, comb, y, mine.token, mine.c0, comb_row(p, mine), mine.weight, [&] {
      asm volatile("" ::: "memory");  // issued after this item's rows: a wait for either then waits for both
      later = items.take(p);
    });
    mine = next;
    next = later;
  }
}

// ---- large batches: result rows staged in shared memory by bulk copies ----
// Each worker warp runs a ring of kCombineDepth stages in the block's scratch (free once the expert phase is
// done). A stage holds one item's rows (its kept choices, each the item's columns of one result row), put
// there by the async proxy (one bulk copy per kept choice, issued by lane j for choice j), and beside them
// the item's token, first column, kept mask and weights. A warp then holds up to four items' rows in flight
// (~190 KB per SM) without registers for them, and an item's k rows arrive in one round trip where the
// register loads it replaced chained k / 2. On an H100 it runs at the dispatch's rate (the HBM's), where the
// register loads were 15% slower with k = 8 and 0-10% with k = 2 (docs/perf-notes.md). The sum is the
// same as combine_chunk's (fmaf in choice order, dropped choices skipped), so the bits are too.
constexpr int kCombineDepth = 4;

// A warp's ring: kCombineDepth mbarriers, then the stages' headers from kCombineMetaOffset, then the
// stages themselves from stages_offset (128-byte aligned, as the bulk copies' destinations want 16).
constexpr int kCombineMetaOffset = (8 * kCombineDepth + 15) / 16 * 16;

struct CombineStages {
  int parts;          // kCombinePart-column steps per item (the last item of a token may need fewer)
  int meta_stride;    // bytes of a stage's header: token, first column, kept mask, pad, then k weights
  int stages_offset;  // where the stages start in the ring
  int stage_bytes;    // k result rows x parts * kCombinePart columns
  int warp_bytes;     // one warp's ring: barriers, headers, stages
};

// The stages' sizes for this shape in `scratch_bytes` of shared memory, or false where k rows of even one
// part do not fit a stage of every warp's ring (the caller then combines from registers).
template <typename Element>
__device__ __forceinline__ bool combine_stages(const MoEParams& p, int scratch_bytes, CombineStages& g) {
  const int k = p.top_k;
  g.meta_stride = round_up16(16 + 4 * k);
  g.warp_bytes = scratch_bytes / (kThreads / 32) / 128 * 128;
  g.stages_offset = (kCombineMetaOffset + kCombineDepth * g.meta_stride + 127) / 128 * 128;
  const int stage_max = (g.warp_bytes - g.stages_offset) / kCombineDepth / 16 * 16;
  const int part_bytes = k * kCombinePart * static_cast<int>(sizeof(Element));
  const int max_parts = stage_max / part_bytes;
  if (max_parts < 1) return false;
  const int all_parts = (p.hidden + kCombinePart - 1) / kCombinePart;
  const int chunks = (all_parts + max_parts - 1) / max_parts;  // items per token
  g.parts = (all_parts + chunks - 1) / chunks;                 // spread evenly over the token's items
  g.stage_bytes = g.parts * part_bytes;
  return true;
}

template <typename Element>
__device__ void combine_staged(const MoEParams& p, char* smem, const CombineStages& g) {
  const int H = p.hidden, k = p.top_k, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int columns = g.parts * kCombinePart;  // an item's columns (fewer in a token's last item if H ends there)
  const Element* comb = static_cast<const Element*>(p.peers[p.rank].comb);
  Element* y = static_cast<Element*>(p.y);
  char* ring = smem + warp * g.warp_bytes;
  const uint32_t bars = ptx::smem_addr(ring);
  char* meta = ring + kCombineMetaOffset;
  const uint32_t stages = bars + g.stages_offset;
  char* stage_ptr = ring + g.stages_offset;
  if (lane == 0) {
    for (int s = 0; s < kCombineDepth; ++s) tma::mbarrier_init(bars + 8 * s, 1);
    tma::fence_barrier_init();
  }
  tma::fence_proxy_async_global();  // the copies (async proxy) read results other blocks and peers stored
  __syncwarp();

  // This warp's items; the next one to issue is taken (its routing loaded) an item ahead.
  WarpItems items(p, columns);
  CombineItem next = items.take(p);
  auto issue = [&](int s) {  // `next` into stage s, then the item after it taken
    const int from = comb_row(p, next);
    const bool kept = lane < k && from >= 0;
    const uint32_t mask = __ballot_sync(0xffffffffu, kept);
    const uint32_t bytes = static_cast<uint32_t>((min(H, next.c0 + columns) - next.c0) * sizeof(Element));
    int* head = reinterpret_cast<int*>(meta + s * g.meta_stride);
    if (lane < k) reinterpret_cast<float*>(head + 4)[lane] = next.weight;
    if (lane == 0) {
      head[0] = next.token;
      head[1] = next.c0;
      head[2] = static_cast<int>(mask);
      tma::arrive_expect_tx(bars + 8 * s, __popc(mask) * bytes);
    }
    __syncwarp();
    if (kept)
      tma::copy_1d(stages + s * g.stage_bytes + lane * columns * static_cast<int>(sizeof(Element)),
                   comb + static_cast<size_t>(from) * H + next.c0, bytes, bars + 8 * s);
    next = items.take(p);
  };

  int in_ring = 0;
  for (int s = 0; s < kCombineDepth && next.token < p.tokens; ++s, ++in_ring) issue(s);
  PipelineState<kCombineDepth> at{};
  for (; in_ring > 0; --in_ring) {
    const int s = static_cast<int>(at.index());
    // Warp-uniform: a lane that gave up (the watchdog) takes the whole warp out.
    if (!__all_sync(0xffffffffu, wait_pipeline(bars + 8 * s, at.phase(), p, kPhaseCombineCopy))) return;
    const int* head = reinterpret_cast<const int*>(meta + s * g.meta_stride);
    const float* weights = reinterpret_cast<const float*>(head + 4);
    const int t = head[0], c0 = head[1];
    const uint32_t mask = static_cast<uint32_t>(head[2]);
    const char* rows = stage_ptr + s * g.stage_bytes;
    for (int u = 0; u < g.parts; ++u) {
      const int c = u * kCombinePart + lane * 8;  // column within the item
      if (c0 + c >= H) break;
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.f;
      for (int j = 0; j < k; ++j) {
        if (!((mask >> j) & 1u)) continue;
        const float w = weights[j];
        const Pack8<Element> v =
            *reinterpret_cast<const Pack8<Element>*>(rows + (static_cast<size_t>(j) * columns + c) * sizeof(Element));
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, static_cast<float>(v.v[i]), acc[i]);
      }
      Pack8<Element> pack;
#pragma unroll
      for (int i = 0; i < 8; ++i) pack.v[i] = static_cast<Element>(acc[i]);
      *reinterpret_cast<Pack8<Element>*>(y + static_cast<size_t>(t) * H + c0 + c) = pack;
    }
    __syncwarp();  // every lane is done reading the stage before it is filled again
    if (next.token < p.tokens) {
      issue(s);
      ++in_ring;
    }
    at.advance();
  }
}

// Small batches, whose few (token, chunk) items would leave most warps idle and each chain k / 2 round trips
// to L2 (decode: ~4 us of a one-token forward), take 256 columns per warp and all of a token's choices at
// once from registers (up to 8; 4 in float32). Large batches stage their rows in shared memory
// (combine_staged) where a stage holds k rows of 256 columns, else (k too large for the scratch) take the
// small batches' path too. A copy that never landed sets the error word (the watchdog) and ends the warp's share.
template <typename Element>
__device__ void combine_tokens(const MoEParams& p, char* smem, int scratch_bytes) {
  const int warps = p.blocks * (kThreads / 32);
  const long long wide_items = static_cast<long long>(p.tokens) * ((p.hidden + 4 * 256 - 1) / (4 * 256));
  constexpr int kSmallGroup = sizeof(Element) == 4 ? 4 : 8;  // 16 or 32 bytes per choice in flight per lane
  CombineStages stages;
  if (wide_items >= warps && combine_stages<Element>(p, scratch_bytes, stages))
    combine_staged<Element>(p, smem, stages);
  else
    combine_token_chunks<Element, kSmallGroup>(p);
}

}  // namespace flashdmoe
