// The fused backward's second launch (the first is fused_backward.cuh's expert GEMMs): the router's
// gradient and dx, from the combine weights' gradient by packed row and each kept row's dx.
//
// One cooperative launch, 256 threads a block, on the tensor cores (moe/tile_gemm.cuh's mma.sync tiles):
//   1. per 64-token tile: the logits x R^T (float32, the forward gate's arithmetic), then per token the
//      softmax / top-k renormalisation backward (as routing_grad.cu's router_grad) giving dlogits, rounded
//      once to the 16-bit storage format and written twice, by token and by expert (the second is the
//      operand of step 3);
//   2. same tile: dx = the token's kept dx rows summed in choice order (float32), plus dlogits R, rounded
//      once (as combine_grad.cu);
//   -- grid barrier --
//   3. d_router = dlogits^T x by (64 experts x 128 columns) tile, its K range (the tokens) split over
//      `splits` tasks whose float32 partials the tile's last task sums in split order, rounded once.
// Deterministic: every sum in a fixed order, no float atomics. Errors as every persistent kernel's: the
// watchdog bounds the barrier, the last block writes the status block (common/sync.cuh).
#include <climits>
#include "backward/expert_grad.h"
#include "backward/router_math.cuh"
#include "backward/vector.cuh"
#include "common/host_launch.h"
#include "common/sync.cuh"
#include "moe/tile_gemm.cuh"

namespace flashdmoe {
namespace {

constexpr uint32_t kPhaseRouterBackward = 23;  // grid barrier after every token's dlogits were written
constexpr int kTileTokens = 64;                // steps 1-2: tokens per tile (the GEMMs' M)
constexpr int kTileN = 128;                    // logits: experts per GEMM; dx and d_router: columns per tile
constexpr int kTileExperts = 64;               // step 3: experts per d_router tile (its M)
constexpr int kStages = 3;

template <typename Element, bool kBKContiguous>
using RouterGemm = TileGemm<Element, kTileTokens, kTileN, 2, 4, kStages, kBKContiguous>;
static_assert(RouterGemm<__nv_bfloat16, true>::kThreads == kThreads, "one GEMM per block of workers");

struct RouterBackwardParams {
  int tokens, tokens_pad, hidden, experts, experts_pad, top_k, splits, slabs_per_split;
  bool normalize_topk, need_dx, need_router;
  const void* x;              // [T, H]
  const void* router;         // [E, H]
  const int* expert;          // [T, k]
  const int* row_of_choice;   // [T, k] packed row, -1 dropped
  const float* dweight_row;   // [T * k] by packed row
  const void* dx_rows;        // [T * k, H] by packed row
  void* dx;                   // [T, H]
  void* d_router;             // [E, H]
  void* dlogits;              // [tokens_pad, experts_pad] by token, zero past E
  void* dlogits_t;            // [experts_pad, tokens_pad] by expert, zero past T
  float* partial;             // [splits, experts_pad, H] float32 (splits > 1)

  unsigned long long* error_word;
  uint32_t* barrier_counter;
  uint32_t* exit_counter;
  uint32_t* tile_done;        // [d_router tiles] splits finished
  uint32_t* sync_words;
  int sync_words_count;
  void* status_host;
  int rank, first_block, blocks;
  uint64_t timeout_ns;
  int debug_withhold_phase;
};

// Shared memory: the GEMM pipeline, then per token tile the float32 logits (reused for dx's staging) and
// dlogits by expert for the transposed store; the GEMMs' row pointers are static.
template <typename Element>
struct RouterSmem {
  static constexpr int kPipeline = RouterGemm<Element, true>::kPipelineBytes > RouterGemm<Element, false>::kPipelineBytes
                                       ? RouterGemm<Element, true>::kPipelineBytes
                                       : RouterGemm<Element, false>::kPipelineBytes;
  static constexpr int logits_stride(int experts) { return experts + 4; }
  static constexpr int kStageStride = kTileN + 4;
  // An odd number of words between rows: the transposed store's reads (one row per lane) hit 32 banks.
  static constexpr int dlogits_stride(int experts) { return (experts + 3) / 4 * 4 + 2; }
  static constexpr int logits_offset() { return kPipeline; }
  static constexpr int logits_bytes(int experts) {
    const int logits = kTileTokens * logits_stride(experts) * 4, stage = kTileTokens * kStageStride * 4;
    return logits > stage ? logits : stage;
  }
  static constexpr int dlogits_offset(int experts) { return logits_offset() + logits_bytes(experts); }
  static constexpr int bytes(int experts) {
    return dlogits_offset(experts) + kTileTokens * dlogits_stride(experts) * static_cast<int>(sizeof(Element));
  }
};

// An N-contiguous B slab of rows [k0, k0 + 64) and columns [col0, col0 + 128) of `b` ([k_end, n_end],
// row stride ldb), zero past either end (the K padding of dlogits and of the token range).
template <typename Gemm, typename Element>
__device__ __forceinline__ void load_b_bounded(uint32_t dst, const Element* b, int ldb, int k0, int k_end, int col0,
                                               int n_end) {
  constexpr int kChunks = Gemm::kBlockK * Gemm::kChunksPerRowB;
  for (int i = threadIdx.x; i < kChunks; i += kThreads) {
    const int k = i / Gemm::kChunksPerRowB, chunk = i % Gemm::kChunksPerRowB;
    const int col = col0 + chunk * Gemm::kChunk;
    const bool valid = k0 + k < k_end && col < n_end;
    const Element* src = valid ? b + static_cast<size_t>(k0 + k) * ldb + col : b;
    ptx::cp_async_16(dst + Gemm::n_major_offset(k, chunk), src, valid);
  }
}

// Step 1 for one token tile: logits into shared memory, then dlogits (one warp per token) into shared
// memory by token and to global memory by token; then the tile's dlogits by expert (zeros past T).
template <typename Element>
__device__ void token_tile_dlogits(const RouterBackwardParams& p, int tile, char* smem, const Element** a_rows,
                                   const Element** b_rows) {
  using Gemm = RouterGemm<Element, true>;
  using Smem = RouterSmem<Element>;
  const int E = p.experts, H = p.hidden, k = p.top_k, t0 = tile * kTileTokens;
  const Element* x = static_cast<const Element*>(p.x);
  const Element* router = static_cast<const Element*>(p.router);
  float* logits = reinterpret_cast<float*>(smem + Smem::logits_offset());
  Element* dl = reinterpret_cast<Element*>(smem + Smem::dlogits_offset(E));
  const int ls = Smem::logits_stride(E), ds = Smem::dlogits_stride(E);
  if (threadIdx.x < kTileTokens)
    a_rows[threadIdx.x] = t0 + static_cast<int>(threadIdx.x) < p.tokens ? x + static_cast<size_t>(t0 + threadIdx.x) * H
                                                                           : nullptr;
  for (int e0 = 0; e0 < E; e0 += kTileN) {
    if (threadIdx.x < kTileN)
      b_rows[threadIdx.x] = e0 + static_cast<int>(threadIdx.x) < E ? router + static_cast<size_t>(e0 + threadIdx.x) * H
                                                                     : nullptr;
    sync_workers();
    Gemm gemm;
    gemm.run(smem, H / Gemm::kBlockK, [&](uint32_t a_dst, uint32_t b_dst, int k0) {
      Gemm::template load_rows<kTileTokens>(a_dst, a_rows, k0, x);
      Gemm::template load_rows<kTileN>(b_dst, b_rows, k0, router);
    });
    gemm.for_each_acc([&](int row, int col, float v) {
      if (e0 + col < E) logits[row * ls + e0 + col] = v;
    });
    sync_workers();  // the row pointers and the pipeline are reused
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  Element* dlogits = static_cast<Element*>(p.dlogits);
  for (int r = warp; r < kTileTokens; r += kThreads / 32) {
    const int token = t0 + r;
    Element* out = dlogits + static_cast<size_t>(token) * p.experts_pad;
    if (token >= p.tokens) {
      for (int e = lane; e < E; e += 32) dl[r * ds + e] = static_cast<Element>(0.f);
      continue;
    }
    backward::token_logit_grad(logits + r * ls, E, k, p.expert + static_cast<size_t>(token) * k,
                               p.row_of_choice + static_cast<size_t>(token) * k, p.dweight_row,
                               static_cast<int64_t>(p.tokens) * k, p.normalize_topk,
                               [&](int e, float v) {
                                 const Element rounded = static_cast<Element>(v);
                                 out[e] = rounded;
                                 dl[r * ds + e] = rounded;
                               });
    for (int e = E + lane; e < p.experts_pad; e += 32) out[e] = static_cast<Element>(0.f);  // K padding
  }
  __threadfence();  // step 2's copies of these rows come after the next block barrier
  sync_workers();
  // By expert: row e of dlogits_t gets the tile's 64 tokens (128 contiguous bytes).
  Element* dlogits_t = static_cast<Element*>(p.dlogits_t);
  for (int i = threadIdx.x; i < E * kTileTokens; i += kThreads) {
    const int e = i / kTileTokens, r = i % kTileTokens;
    dlogits_t[static_cast<size_t>(e) * p.tokens_pad + t0 + r] = dl[r * ds + e];
  }
}

// Step 2 for one token tile: dx = the token's kept dx rows in choice order + dlogits R, by 128 columns.
template <typename Element>
__device__ void token_tile_dx(const RouterBackwardParams& p, int tile, char* smem, const Element** a_rows) {
  using Gemm = RouterGemm<Element, false>;
  using Smem = RouterSmem<Element>;
  const int H = p.hidden, k = p.top_k, t0 = tile * kTileTokens;
  const Element* dlogits = static_cast<const Element*>(p.dlogits);
  const Element* router = static_cast<const Element*>(p.router);
  const Element* dx_rows = static_cast<const Element*>(p.dx_rows);
  Element* dx = static_cast<Element*>(p.dx);
  float* stage = reinterpret_cast<float*>(smem + Smem::logits_offset());
  if (threadIdx.x < kTileTokens)
    a_rows[threadIdx.x] = t0 + static_cast<int>(threadIdx.x) < p.tokens
                              ? dlogits + static_cast<size_t>(t0 + threadIdx.x) * p.experts_pad
                              : nullptr;
  sync_workers();
  for (int n0 = 0; n0 < H; n0 += kTileN) {
    Gemm gemm;
    gemm.run(smem, p.experts_pad / Gemm::kBlockK, [&](uint32_t a_dst, uint32_t b_dst, int k0) {
      Gemm::template load_rows<kTileTokens>(a_dst, a_rows, k0, dlogits);
      load_b_bounded<Gemm>(b_dst, router, H, k0, p.experts, n0, H);
    });
    gemm.for_each_acc_pair([&](int row, int col, float2 v) {
      *reinterpret_cast<float2*>(stage + row * Smem::kStageStride + col) = v;
    });
    sync_workers();
    // 16 pieces of 8 columns per token row.
    for (int i = threadIdx.x; i < kTileTokens * (kTileN / 8); i += kThreads) {
      const int r = i / (kTileN / 8), col = n0 + (i % (kTileN / 8)) * 8, token = t0 + r;
      if (token >= p.tokens || col >= H) continue;
      float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int j = 0; j < k; ++j) {
        const int row = p.row_of_choice[static_cast<size_t>(token) * k + j];
        // dropped by capacity (or out of range: a failed first launch's table)
        if (row < 0 || row >= static_cast<int64_t>(p.tokens) * k) continue;
        float v[8];
        backward::Vec8<Element>::load(dx_rows + static_cast<size_t>(row) * H + col).to_float(v);
#pragma unroll
        for (int q = 0; q < 8; ++q) sum[q] += v[q];
      }
      const float* extra = stage + r * Smem::kStageStride + (col - n0);
#pragma unroll
      for (int q = 0; q < 8; ++q) sum[q] += extra[q];
      backward::Vec8<Element>::from_float(sum).store(dx + static_cast<size_t>(token) * H + col);
    }
    sync_workers();  // the staging is rewritten by the next columns' GEMM
  }
}

// Step 3, one task: d_router tile (64 experts x 128 columns) over split `split`'s tokens. The tile's
// last task to finish sums every split's partial in split order and writes the tile.
template <typename Element>
__device__ void router_grad_task(const RouterBackwardParams& p, int task, char* smem, const Element** a_rows) {
  using Gemm = RouterGemm<Element, false>;
  __shared__ int last_split;
  const int H = p.hidden, E = p.experts;
  const int col_tiles = (H + kTileN - 1) / kTileN;
  const int tile = task / p.splits, split = task % p.splits;
  const int e0 = (tile / col_tiles) * kTileExperts, n0 = (tile % col_tiles) * kTileN;
  const int first_slab = split * p.slabs_per_split;
  const int slabs = min(p.slabs_per_split, p.tokens_pad / Gemm::kBlockK - first_slab);
  const Element* dlogits_t = static_cast<const Element*>(p.dlogits_t);
  const Element* x = static_cast<const Element*>(p.x);
  if (threadIdx.x < kTileExperts)
    a_rows[threadIdx.x] = e0 + static_cast<int>(threadIdx.x) < E
                              ? dlogits_t + static_cast<size_t>(e0 + threadIdx.x) * p.tokens_pad
                              : nullptr;
  sync_workers();
  Gemm gemm;
  const int k_base = first_slab * Gemm::kBlockK;
  gemm.run(smem, max(slabs, 0), [&](uint32_t a_dst, uint32_t b_dst, int k0) {
    Gemm::template load_rows<kTileExperts>(a_dst, a_rows, k_base + k0, dlogits_t);
    load_b_bounded<Gemm>(b_dst, x, H, k_base + k0, p.tokens, n0, H);
  });
  Element* d_router = static_cast<Element*>(p.d_router);
  if (p.splits == 1) {
    gemm.for_each_acc([&](int row, int col, float v) {
      if (e0 + row < E && n0 + col < H) d_router[static_cast<size_t>(e0 + row) * H + n0 + col] = static_cast<Element>(v);
    });
    sync_workers();  // the row pointers are rewritten by the next task
    return;
  }
  float* mine = p.partial + (static_cast<size_t>(split) * p.experts_pad + e0) * H;
  gemm.for_each_acc_pair([&](int row, int col, float2 v) {
    if (n0 + col < H) *reinterpret_cast<float2*>(mine + static_cast<size_t>(row) * H + n0 + col) = v;
  });
  __threadfence();  // every writer's partials before the tile's count
  sync_workers();
  if (threadIdx.x == 0) last_split = atomicAdd(p.tile_done + tile, 1u) == static_cast<uint32_t>(p.splits - 1);
  sync_workers();
  if (last_split) {
    __threadfence();
    for (int i = threadIdx.x; i < kTileExperts * kTileN; i += kThreads) {
      const int row = i / kTileN, col = n0 + i % kTileN;
      if (e0 + row >= E || col >= H) continue;
      const float* at = p.partial + static_cast<size_t>(e0 + row) * H + col;
      float sum = 0.f;
      for (int s = 0; s < p.splits; ++s) sum += __ldcg(at + static_cast<size_t>(s) * p.experts_pad * H);
      d_router[static_cast<size_t>(e0 + row) * H + col] = static_cast<Element>(sum);
    }
  }
  sync_workers();
}

template <typename Element>
__global__ void __launch_bounds__(kThreads, 1) router_backward_kernel(const __grid_constant__ RouterBackwardParams p) {
  extern __shared__ __align__(16) char raw_smem[];
  char* smem = raw_smem + ((128u - (ptx::smem_addr(raw_smem) & 127u)) & 127u);
  __shared__ const Element* a_rows[kTileTokens];
  __shared__ const Element* b_rows[kTileN];
  const int token_tiles = p.tokens_pad / kTileTokens;
  for (int tile = blockIdx.x; tile < token_tiles; tile += p.blocks) {
    token_tile_dlogits<Element>(p, tile, smem, a_rows, b_rows);
    if (p.need_dx) token_tile_dx<Element>(p, tile, smem, a_rows);
  }
  if (p.need_router) {
    __threadfence();  // dlogits_t before the barrier's arrival
    if (grid_barrier(p, kPhaseRouterBackward, 1)) {
      const int tasks = (p.experts_pad / kTileExperts) * ((p.hidden + kTileN - 1) / kTileN) * p.splits;
      for (int task = blockIdx.x; task < tasks; task += p.blocks) router_grad_task<Element>(p, task, smem, a_rows);
    }
  }
  finish_launch(p);
}

struct RouterSync {
  size_t barrier_counter, exit_counter, tile_done, sync_bytes;
  int tiles;
};
RouterSync router_sync_layout(int hidden, int experts_pad) {
  RouterSync l{};
  l.tiles = (experts_pad / kTileExperts) * ((hidden + kTileN - 1) / kTileN);
  size_t at = kStatusBytes;
  auto take = [&](size_t bytes) { size_t here = at; at = (at + bytes + 127) / 128 * 128; return here; };
  l.barrier_counter = take(4);
  l.exit_counter = take(4);
  l.tile_done = take(4 * static_cast<size_t>(l.tiles));
  l.sync_bytes = at;
  return l;
}

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

std::string router_backward_unsupported(int tokens, int hidden, int experts, int top_k) {
  if (hidden <= 0 || hidden % 64) return "H=" + std::to_string(hidden) + " is not a positive multiple of 64";
  if (experts < 1 || experts > kRouterBackwardMaxExperts)
    return "E=" + std::to_string(experts) + " is outside 1.." + std::to_string(kRouterBackwardMaxExperts);
  if (top_k < 1 || top_k > 32 || top_k > experts) return "k=" + std::to_string(top_k) + " is outside 1..min(32, E)";
  if (tokens < 1 || tokens > INT_MAX - kTileTokens) return "T=" + std::to_string(tokens) + " is outside 1..2^31 - 65";
  return "";
}

RouterBackwardLayout router_backward_layout(int tokens, int hidden, int experts, int top_k, int blocks) {
  const std::string why = router_backward_unsupported(tokens, hidden, experts, top_k);
  if (!why.empty()) throw std::invalid_argument("router backward: " + why);
  RouterBackwardLayout l{};
  l.tokens_pad = round_up(tokens, kTileTokens);
  l.experts_pad = round_up(experts, kTileExperts);
  const RouterSync sync = router_sync_layout(hidden, static_cast<int>(l.experts_pad));
  // Enough d_router tasks for two per block, each at least one 64-token slab.
  const int slabs = static_cast<int>(l.tokens_pad / 64);
  const int want = (2 * std::max(blocks, 1) + sync.tiles - 1) / sync.tiles;
  const int splits = std::max(1, std::min(want, slabs));
  l.slabs_per_split = (slabs + splits - 1) / splits;
  l.splits = (slabs + l.slabs_per_split - 1) / l.slabs_per_split;  // no split left empty
  size_t at = 0;
  auto take = [&](size_t bytes) { size_t here = at; at = (at + bytes + 255) / 256 * 256; return here; };
  l.dlogits_offset = take(static_cast<size_t>(l.tokens_pad) * l.experts_pad * 2);
  l.dlogits_t_offset = take(static_cast<size_t>(l.experts_pad) * l.tokens_pad * 2);
  l.partial_offset = take(l.splits > 1 ? static_cast<size_t>(l.splits) * l.experts_pad * hidden * 4 : 0);
  l.scratch_bytes = at;
  l.sync_bytes = sync.sync_bytes;
  return l;
}

LaunchInfo launch_router_backward(const RouterBackwardArgs& a, cudaStream_t stream) {
  const RouterBackwardLayout l = router_backward_layout(a.tokens, a.hidden, a.experts, a.top_k, a.blocks);
  if (!a.need_dx && !a.need_router) throw std::invalid_argument("router backward: neither dx nor d_router is wanted");
  if (a.x == nullptr || a.router == nullptr || a.expert == nullptr || a.row_of_choice == nullptr ||
      a.dweight_row == nullptr || a.sync == nullptr || a.scratch == nullptr || (a.need_dx && (a.dx == nullptr || a.dx_rows == nullptr)) ||
      (a.need_router && a.d_router == nullptr))
    throw std::invalid_argument("router backward: a needed input, output, sync or scratch pointer is null");
  const RouterSync sync = router_sync_layout(a.hidden, static_cast<int>(l.experts_pad));
  RouterBackwardParams p{};
  p.tokens = a.tokens, p.tokens_pad = static_cast<int>(l.tokens_pad), p.hidden = a.hidden, p.experts = a.experts;
  p.experts_pad = static_cast<int>(l.experts_pad), p.top_k = a.top_k, p.splits = l.splits;
  p.slabs_per_split = l.slabs_per_split;
  p.normalize_topk = a.normalize_topk, p.need_dx = a.need_dx, p.need_router = a.need_router;
  p.x = a.x, p.router = a.router, p.expert = a.expert, p.row_of_choice = a.row_of_choice;
  p.dweight_row = a.dweight_row, p.dx_rows = a.dx_rows, p.dx = a.dx, p.d_router = a.d_router;
  char* s = static_cast<char*>(a.scratch);
  p.dlogits = s + l.dlogits_offset;
  p.dlogits_t = s + l.dlogits_t_offset;
  p.partial = reinterpret_cast<float*>(s + l.partial_offset);
  char* w = static_cast<char*>(a.sync);
  p.error_word = reinterpret_cast<unsigned long long*>(w + kStatusErrorWord);
  p.barrier_counter = reinterpret_cast<uint32_t*>(w + sync.barrier_counter);
  p.exit_counter = reinterpret_cast<uint32_t*>(w + sync.exit_counter);
  p.tile_done = reinterpret_cast<uint32_t*>(w + sync.tile_done);
  p.sync_words = reinterpret_cast<uint32_t*>(w);
  p.sync_words_count = static_cast<int>(sync.sync_bytes / 4);
  p.status_host = a.status_host;
  p.rank = 0, p.first_block = 0;
  p.timeout_ns = a.timeout_ns;
  p.debug_withhold_phase = a.debug_withhold_phase;

  LaunchInfo info{};
  backward::visit_half_dtype(a.dtype, [&](auto element) {
    using Element = decltype(element);
    auto kernel = router_backward_kernel<Element>;
    const int smem_bytes = RouterSmem<Element>::bytes(a.experts) + 128;  // + the base's alignment
    int device = 0;
    throw_on_cuda_error(cudaGetDevice(&device), "cudaGetDevice");
    const ResidentGrid resident = resident_grid(reinterpret_cast<const void*>(kernel), device, smem_bytes, kThreads);
    int grid = resident.blocks_per_sm * resident.sms;
    if (a.max_blocks > 0 && a.max_blocks < grid) grid = a.max_blocks;
    p.blocks = grid;
    launch_cooperative(kernel, grid, kThreads, smem_bytes, stream, p, "launching router_backward_kernel");
    info = {grid, resident.blocks_per_sm, smem_bytes};
  });
  return info;
}

}  // namespace flashdmoe
