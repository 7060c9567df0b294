// The expert backward of one rank as one persistent kernel: from the forward's routing and saved
// pre-activations, every expert GEMM of the backward on wgmma fed by TMA, with the element-wise step
// between them in the first GEMM's epilogue.
//
//   1. counts:  kept rows per expert (integer atomics), grid barrier, per-block tables (prefix sums);
//   2. gather:  dy's and x's rows by expert into padded row buffers (each expert's rows start at a
//               multiple of 64, the gap zero), the combine weights beside them; grid barrier;
//   3. tasks, taken from one queue in this order (a task waits only for earlier ones):
//      g   tiles (row tile x I columns):   g = dy_rows W2_e^T; epilogue: h = act(pre), wh = w h,
//                                          dpre = w g act'(pre), partial <g, h> per row;
//      dx  tiles (row tile x H columns):   dx_rows = dpre W1_e^T, once the row tile's g tiles are done;
//                                          the row's dweight = sum of its partials, in column order;
//      dW2 tiles (I x H per expert):       wh^T dy_rows over the expert's rows,
//      dW1 tiles (H x w1_cols per expert): x_rows^T dpre, once the expert's g tiles are done.
// No float atomics: every output element is written once, every sum runs in a fixed order.
#pragma once
#include "backward/fused_params.cuh"
#include "common/pipeline.cuh"
#include "common/sync.cuh"
#include "common/tile_order.cuh"
#include "common/tma.cuh"
#include "moe/activation.cuh"
#include "moe/epilogue.cuh"
#include "moe/tile_gemm_tma.cuh"

namespace flashdmoe {

template <typename Element, int BN>
struct FusedBackwardConfig {
  static constexpr int kTileN = BN;
  static constexpr int kStages = 4;  // of 16 KB of A and BN x 128 bytes of B
  // Row GEMMs (g, dx): A K-major row boxes, B the transposed weights (K-major). Weight gradients: both
  // operands MN-major (the row buffers read across their rows).
  using RowGemm = TmaTileGemm<Element, BN, kStages, 64, Major::K, Major::K>;
  using WeightGemm = TmaTileGemm<Element, BN, kStages, 64, Major::MN, Major::MN>;
  static constexpr int kBoxBytes = 64 * 64 * 2;  // every operand box: 64 x 64 two-byte elements
  static constexpr int kPanels = BN / 64;
  static constexpr int kPipelineBytes = RowGemm::kPipelineBytes;
  static_assert(WeightGemm::kPipelineBytes == kPipelineBytes, "one stage ring for every GEMM kind");
  static constexpr int kStagingOffset = kPipelineBytes;
  static constexpr int kSmemBytes = kPipelineBytes + (kThreads / 32) * kWarpStagingBytes;
  // + a producer warpgroup (one lane issues the loads): whole warpgroups, so that registers can move to
  // the consumers (168 each at launch; 40 for the producer, 232 for the consumers in the task loop).
  static constexpr int kBlockThreads = kThreads + 128;
  static constexpr int kLaunchRegisters = 168, kProducerRegisters = 40, kConsumerRegisters = 232;
  static_assert(128 * kProducerRegisters + kThreads * kConsumerRegisters <= kBlockThreads * kLaunchRegisters &&
                    kBlockThreads * kLaunchRegisters <= 65536,
                "the registers the block holds at launch cover it before and after the move");
};

// Per-block tables over experts (E + 1 entries each): kept rows' packed start, padded start, first row tile.
struct ExpertTables {
  int* start;
  int* padded_start;
  int* tile_start;
};

struct BackwardRowTile {
  int expert;
  int padded_row0;  // first row in the padded row buffers
  int packed_row0;  // first row in the forward's packed numbering (pre, dx_rows)
  int rows;         // 1..128
};

__device__ __forceinline__ BackwardRowTile backward_row_tile(const ExpertTables& t, int experts, int row_tile) {
  // The last expert whose first tile is at or before row_tile (an expert without rows shares its
  // first tile index with the next one, so the last such expert is the one that holds the tile).
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t.tile_start[mid] <= row_tile) lo = mid;
    else hi = mid - 1;
  }
  const int local = (row_tile - t.tile_start[lo]) * kExpertTileM;
  const int kept = t.start[lo + 1] - t.start[lo];
  return {lo, t.padded_start[lo] + local, t.start[lo] + local, min(kExpertTileM, kept - local)};
}

enum class BackwardTaskKind : int { G, Dx, Dw2, Dw1 };

struct BackwardTask {
  BackwardTaskKind kind;
  int row_tile;  // G, Dx
  int expert;    // Dw2, Dw1
  int m0, n0;    // output tile origin (m0: rows of dW for Dw2 / Dw1)
};

struct BackwardTaskCounts {
  int g_cols, dx_cols;            // column tiles of g (I) and dx (H)
  int dw2_m, dw2_n, dw1_m, dw1_n; // tiles of one expert's dW2 [I, H] and dW1 [H, w1_cols]
  int g_tasks, dx_tasks, per_expert, total;
};

template <int BN>
__device__ __forceinline__ BackwardTaskCounts backward_task_counts(const BackwardParams& p, int row_tiles) {
  BackwardTaskCounts c;
  c.g_cols = (p.ffn + BN - 1) / BN;
  c.dx_cols = (p.hidden + BN - 1) / BN;
  c.dw2_m = p.need_dw2 ? (p.ffn + kExpertTileM - 1) / kExpertTileM : 0;
  c.dw2_n = (p.hidden + BN - 1) / BN;
  c.dw1_m = p.need_dw1 ? (p.hidden + kExpertTileM - 1) / kExpertTileM : 0;
  c.dw1_n = (p.w1_cols + BN - 1) / BN;
  c.g_tasks = row_tiles * c.g_cols;
  c.dx_tasks = p.need_dx ? row_tiles * c.dx_cols : 0;
  c.per_expert = c.dw2_m * c.dw2_n + c.dw1_m * c.dw1_n;
  c.total = c.g_tasks + c.dx_tasks + p.experts * c.per_expert;
  return c;
}

// Each GEMM's tiles in grouped order (common/tile_order.cuh): row tiles x column tiles for g and dx, in
// groups that never straddle two experts (segment_group over tile_start), m tiles x n tiles of each
// expert's dW2 and dW1.
template <int BN>
__device__ __forceinline__ BackwardTask decode_backward_task(int id, const BackwardTaskCounts& c, const int* tile_start,
                                                             int experts) {
  if (id < c.g_tasks) {
    const TileCoord t = grouped_tile(id, c.g_cols, segment_group(id / c.g_cols, tile_start, experts));
    return {BackwardTaskKind::G, t.row, 0, 0, t.col * BN};
  }
  id -= c.g_tasks;
  if (id < c.dx_tasks) {
    const TileCoord t = grouped_tile(id, c.dx_cols, segment_group(id / c.dx_cols, tile_start, experts));
    return {BackwardTaskKind::Dx, t.row, 0, 0, t.col * BN};
  }
  id -= c.dx_tasks;
  const int expert = id / c.per_expert;
  int r = id % c.per_expert;
  if (r < c.dw2_m * c.dw2_n) {
    const TileCoord t = grouped_tile(r, c.dw2_m, c.dw2_n);
    return {BackwardTaskKind::Dw2, 0, expert, t.row * kExpertTileM, t.col * BN};
  }
  const TileCoord t = grouped_tile(r - c.dw2_m * c.dw2_n, c.dw1_m, c.dw1_n);
  return {BackwardTaskKind::Dw1, 0, expert, t.row * kExpertTileM, t.col * BN};
}

// ---- 1. counts and tables ----

// Also marks every choice dropped in the row table (the gather fills in the kept ones): a launch that
// stops at a barrier (the watchdog) leaves a table the router's and dx's kernels read in bounds.
__device__ __forceinline__ void count_kept_rows(const BackwardParams& p) {
  const int64_t choices = static_cast<int64_t>(p.tokens) * p.top_k;
  const int64_t stride = static_cast<int64_t>(p.blocks) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < choices; c += stride) {
    const int e = p.topk_expert[c], r = p.topk_row[c];
    p.row_of_choice[c] = -1;
    if (r >= 0 && r < choices && e >= 0 && e < p.experts) atomicAdd(p.kept_count + e, 1u);
  }
}

// Every block builds the same tables from the counts (exclusive prefix sums over experts, four experts
// per thread, then a warp scan and a scan of the warp totals). All threads of the block.
__device__ void build_expert_tables(const BackwardParams& p, const ExpertTables& t) {
  __shared__ int warp_total[kThreads / 32][3];
  const int E = p.experts;
  const int first = threadIdx.x * 4;
  int own[3] = {0, 0, 0};  // kept rows, padded rows, row tiles of this thread's experts
  int n[4] = {0, 0, 0, 0};
  if (threadIdx.x < kThreads) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (first + i < E) n[i] = static_cast<int>(ptx::load_acquire_gpu(p.kept_count + first + i));
      own[0] += n[i];
      own[1] += (n[i] + kBackwardRowAlign - 1) / kBackwardRowAlign * kBackwardRowAlign;
      own[2] += (n[i] + kExpertTileM - 1) / kExpertTileM;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive[3] = {own[0], own[1], own[2]};
#pragma unroll
  for (int d = 1; d < 32; d <<= 1)
#pragma unroll
    for (int v = 0; v < 3; ++v) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive[v], d);
      if (lane >= d) inclusive[v] += up;
    }
  if (lane == 31 && warp < kThreads / 32)
    for (int v = 0; v < 3; ++v) warp_total[warp][v] = inclusive[v];
  __syncthreads();
  if (threadIdx.x < kThreads) {
    int before[3];
    for (int v = 0; v < 3; ++v) {
      before[v] = inclusive[v] - own[v];
      for (int w = 0; w < warp; ++w) before[v] += warp_total[w][v];
    }
    for (int i = 0; i < 4 && first + i < E; ++i) {
      t.start[first + i] = before[0];
      t.padded_start[first + i] = before[1];
      t.tile_start[first + i] = before[2];
      before[0] += n[i];
      before[1] += (n[i] + kBackwardRowAlign - 1) / kBackwardRowAlign * kBackwardRowAlign;
      before[2] += (n[i] + kExpertTileM - 1) / kExpertTileM;
    }
    if (first < E && first + 4 >= E) {  // the thread holding the last expert closes the tables
      t.start[E] = before[0];
      t.padded_start[E] = before[1];
      t.tile_start[E] = before[2];
    }
  }
  __syncthreads();
}

// ---- 2. gather ----

// dy's row (and x's, when x_dst is not null) of one choice, 16 bytes per lane and piece, four pieces of
// each row in flight before any store: one load at a time would wait a memory latency per piece (a
// store may alias the next load), about 150 us over the rows of the 8192-token, k = 2 shape by count.
template <typename Element>
__device__ __forceinline__ void copy_rows(Element* dy_dst, const Element* dy_src, Element* x_dst, const Element* x_src,
                                          int hidden, int lane) {
  constexpr int kPieces = 4, kStride = 32 * 8;
  for (int col0 = lane * 8; col0 < hidden; col0 += kStride * kPieces) {
    uint4 dy_piece[kPieces], x_piece[kPieces];
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int col = col0 + i * kStride;
      if (col < hidden) {
        dy_piece[i] = __ldg(reinterpret_cast<const uint4*>(dy_src + col));
        if (x_dst != nullptr) x_piece[i] = __ldg(reinterpret_cast<const uint4*>(x_src + col));
      }
    }
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int col = col0 + i * kStride;
      if (col < hidden) {
        *reinterpret_cast<uint4*>(dy_dst + col) = dy_piece[i];
        if (x_dst != nullptr) *reinterpret_cast<uint4*>(x_dst + col) = x_piece[i];
      }
    }
  }
}
template <typename Element>
__device__ __forceinline__ void zero_row(Element* dst, int hidden, int lane) {
  for (int col = lane * 8; col < hidden; col += 32 * 8) *reinterpret_cast<uint4*>(dst + col) = make_uint4(0, 0, 0, 0);
}

// One warp per choice: its dy (and x) row to its padded row; then the padding rows zeroed. Also the
// checked row table for the router's and dx's kernels.
template <typename Element>
__device__ void gather_rows(const BackwardParams& p, const ExpertTables& t) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(p.blocks) * (blockDim.x / 32);
  const int64_t first_warp = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  const int64_t choices = static_cast<int64_t>(p.tokens) * p.top_k;
  const int H = p.hidden;
  const Element* x = static_cast<const Element*>(p.x);
  const Element* dy = static_cast<const Element*>(p.dy);
  Element* x_rows = static_cast<Element*>(p.x_rows);
  Element* dy_rows = static_cast<Element*>(p.dy_rows);
  for (int64_t c = first_warp; c < choices; c += warps) {
    const int e = p.topk_expert[c], r = p.topk_row[c];
    const bool kept = r >= 0 && e >= 0 && e < p.experts && r >= t.start[e] && r < t.start[e + 1];
    if (lane == 0) p.row_of_choice[c] = kept ? r : -1;
    if (!kept) continue;
    const int64_t padded = t.padded_start[e] + (r - t.start[e]);
    const int64_t token = c / p.top_k;
    copy_rows(dy_rows + padded * H, dy + token * H, p.need_dw1 ? x_rows + padded * H : nullptr, x + token * H, H, lane);
    if (lane == 0) p.w_pad[padded] = p.topk_weight[c];
  }
  const int64_t pad_slots = static_cast<int64_t>(p.experts) * (kBackwardRowAlign - 1);
  for (int64_t s = first_warp; s < pad_slots; s += warps) {
    const int e = static_cast<int>(s / (kBackwardRowAlign - 1));
    const int64_t padded = t.padded_start[e] + (t.start[e + 1] - t.start[e]) + s % (kBackwardRowAlign - 1);
    if (padded >= t.padded_start[e + 1]) continue;
    zero_row(dy_rows + padded * H, H, lane);
    if (p.need_dw1) zero_row(x_rows + padded * H, H, lane);
    if (lane == 0) p.w_pad[padded] = 0.f;
  }
}

// ---- 3. tasks ----

// g tile epilogue (one warp, its 16 rows): the element-wise step of the backward on the fp32 g
// accumulators and the saved pre-activations, wh and dpre out through the warp's staging buffer, and
// the partial <g, h> of each row over the tile's columns. Rows past the tile's up to the next multiple
// of 64 get zeros (the weight gradients' K slabs read them); rows beyond belong to the next expert.
template <typename Element, int BN, Activation kKind, typename Gemm>
__device__ __forceinline__ void g_epilogue_warp(const BackwardParams& p, const Gemm& gemm, char* staging,
                                                const BackwardRowTile& tile, int n0, int col_tile, int g_cols) {
  constexpr bool kGated = kKind == Activation::Swiglu;
  const int lane = threadIdx.x & 31;
  const int row0 = warp_tile_row0();
  const int write_rows = (tile.rows + kBackwardRowAlign - 1) / kBackwardRowAlign * kBackwardRowAlign - row0;
  if (write_rows <= 0) return;
  const int I = p.ffn, ld = p.w1_cols;
  const Element* pre = static_cast<const Element*>(p.pre);
  bool valid[2];
  float w[2];
  const Element* pre_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + (lane >> 2) + 8 * h;
    valid[h] = r < tile.rows;
    w[h] = valid[h] ? __ldcg(p.w_pad + tile.padded_row0 + r) : 0.f;
    pre_row[h] = pre + static_cast<int64_t>(tile.packed_row0 + (valid[h] ? r : 0)) * ld;
  }
  float dot[2] = {0.f, 0.f};
  Element* wh_out = static_cast<Element*>(p.wh) + static_cast<int64_t>(tile.padded_row0 + row0) * I + n0;
  Element* dpre_out = static_cast<Element*>(p.dpre) + static_cast<int64_t>(tile.padded_row0 + row0) * ld + n0;
  auto unpack = [](uint32_t bits, float& lo, float& hi) {
    if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
      lo = f.x, hi = f.y;
    } else {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&bits));
      lo = f.x, hi = f.y;
    }
  };
#pragma unroll
  for (int c = 0; c < BN / 64; ++c) {
    if (n0 + c * 64 >= I) break;
    uint32_t out_wh[16], out_dpre[16], out_dup[kGated ? 16 : 1];
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
      const int col = n0 + c * 64 + jj * 8 + 2 * (lane & 3);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float x[2] = {0.f, 0.f}, u[2] = {0.f, 0.f};
        if (valid[h]) {
          unpack(*reinterpret_cast<const uint32_t*>(pre_row[h] + col), x[0], x[1]);
          if constexpr (kGated) unpack(*reinterpret_cast<const uint32_t*>(pre_row[h] + I + col), u[0], u[1]);
        }
        float wh[2], dp[2], du[2];
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          const float g = gemm.acc[(c * 8 + jj) * 4 + h * 2 + v];
          float act;
          const ValueAndSlope f = activation_value_and_slope(kKind, x[v]);  // swiglu: silu of the gate
          if constexpr (kGated) {
            act = f.value * u[v];
            dp[v] = w[h] * g * u[v] * f.slope;
            du[v] = w[h] * g * f.value;
          } else {
            act = f.value;
            dp[v] = w[h] * g * f.slope;
          }
          dot[h] += g * act;
          wh[v] = w[h] * act;
        }
        out_wh[2 * jj + h] = pack_pair<Element>(wh[0], wh[1]);
        out_dpre[2 * jj + h] = pack_pair<Element>(dp[0], dp[1]);
        if constexpr (kGated) out_dup[2 * jj + h] = pack_pair<Element>(du[0], du[1]);
      }
    }
    store_warp_rows<Element, 8>(staging, out_wh, wh_out + c * 64, I, write_rows, 64);
    store_warp_rows<Element, 8>(staging, out_dpre, dpre_out + c * 64, ld, write_rows, 64);
    if constexpr (kGated) store_warp_rows<Element, 8>(staging, out_dup, dpre_out + I + c * 64, ld, write_rows, 64);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], 1);
    dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], 2);
    const int r = row0 + (lane >> 2) + 8 * h;
    if ((lane & 3) == 0 && valid[h]) p.dweight_part[static_cast<int64_t>(tile.padded_row0 + r) * g_cols + col_tile] = dot[h];
  }
}

template <typename Element, int BN, typename Gemm>
__device__ __forceinline__ void g_epilogue(const BackwardParams& p, const Gemm& gemm, char* staging,
                                           const BackwardRowTile& tile, int n0, int col_tile, int g_cols) {
  switch (p.activation) {
    case Activation::Relu: g_epilogue_warp<Element, BN, Activation::Relu>(p, gemm, staging, tile, n0, col_tile, g_cols); break;
    case Activation::Gelu: g_epilogue_warp<Element, BN, Activation::Gelu>(p, gemm, staging, tile, n0, col_tile, g_cols); break;
    case Activation::Silu: g_epilogue_warp<Element, BN, Activation::Silu>(p, gemm, staging, tile, n0, col_tile, g_cols); break;
    default: g_epilogue_warp<Element, BN, Activation::Swiglu>(p, gemm, staging, tile, n0, col_tile, g_cols);
  }
}

// K slabs of a weight-gradient task: the expert's padded rows (at least one slab is handed over even
// for an expert without rows, so that the producer never runs ahead of the task ring; it loads nothing).
__device__ __forceinline__ int expert_slabs(const ExpertTables& t, int expert) {
  return (t.padded_start[expert + 1] - t.padded_start[expert]) / static_cast<int>(kTmaSlabK);
}

// The producer warp's lane 0: takes tasks, waits for their inputs, hands them over in order and streams
// their K slabs.
template <typename Element, typename Config>
__device__ bool produce_backward(const BackwardParams& p, const ExpertTables& t, char* smem,
                                 StagePipeline<Config::kStages>& stages, TaskRing<Config::kStages>& ring,
                                 const BackwardTaskCounts& counts) {
  using Gemm = typename Config::RowGemm;
  constexpr int kBox = Config::kBoxBytes;
  typename Gemm::State stage{};
  typename TaskRing<Config::kStages>::State slot{};
  for (;; slot.advance()) {
    const int id = static_cast<int>(atomicAdd(p.task_counter, 1u));
    if (id >= counts.total) {
      ring.hand_over(slot, kTaskEnd);
      return true;
    }
    const BackwardTask task = decode_backward_task<Config::kTileN>(id, counts, t.tile_start, p.experts);
    bool ready = true;
    if (task.kind == BackwardTaskKind::Dx) {
      ready = wait_at_least(p.row_tile_done + task.row_tile, counts.g_cols * kWorkerWarpgroups, p,
                            kPhaseBackwardRowTile, p.rank);
    } else if (task.kind != BackwardTaskKind::G) {
      const uint32_t tiles = t.tile_start[task.expert + 1] - t.tile_start[task.expert];
      ready = wait_at_least(p.expert_done + task.expert, tiles * counts.g_cols * kWorkerWarpgroups, p,
                            kPhaseBackwardExpert, p.rank);
    }
    tma::fence_proxy_async_global();  // the TMA loads below read rows other blocks stored
    ring.hand_over(slot, ready ? id : kTaskAbort);
    if (!ready) return false;
    bool ok;
    if (task.kind == BackwardTaskKind::G || task.kind == BackwardTaskKind::Dx) {
      const BackwardRowTile tile = backward_row_tile(t, p.experts, task.row_tile);
      const bool g = task.kind == BackwardTaskKind::G;
      const int a_boxes = tile.rows > 64 ? 2 : 1;
      const CUtensorMap* a_map = g ? &p.maps.dy_rows : &p.maps.dpre;
      const CUtensorMap* b_map = g ? &p.maps.w2 : &p.maps.w1;
      const int k_tiles = (g ? p.hidden : p.w1_cols) / static_cast<int>(kTmaSlabK);
      ok = Gemm::produce(smem, stages, stage, k_tiles, (a_boxes + Config::kPanels) * kBox, p,
                         [&](uint32_t a_dst, uint32_t b_dst, int k0, uint32_t bar) {
                           for (int b = 0; b < a_boxes; ++b) tma::load_2d(a_dst + b * kBox, a_map, bar, k0, tile.padded_row0 + 64 * b);
#pragma unroll
                           for (int panel = 0; panel < Config::kPanels; ++panel)
                             tma::load_3d(b_dst + panel * kBox, b_map, bar, k0, task.n0 + 64 * panel, tile.expert);
                         });
    } else {
      const bool dw2 = task.kind == BackwardTaskKind::Dw2;
      const int m_extent = dw2 ? p.ffn : p.hidden;
      const int a_boxes = m_extent - task.m0 > 64 ? 2 : 1;
      const CUtensorMap* a_map = dw2 ? &p.maps.wh : &p.maps.x_rows;
      const CUtensorMap* b_map = dw2 ? &p.maps.dy_rows : &p.maps.dpre;
      const int slabs = expert_slabs(t, task.expert);
      const int row0 = t.padded_start[task.expert];
      if (slabs == 0) {  // one empty slab: no loads, the arrival alone completes the stage
        ok = Gemm::produce(smem, stages, stage, 1, 0u, p, [](uint32_t, uint32_t, int, uint32_t) {});
      } else {
        ok = Gemm::produce(smem, stages, stage, slabs, (a_boxes + Config::kPanels) * kBox, p,
                           [&](uint32_t a_dst, uint32_t b_dst, int k0, uint32_t bar) {
                             for (int b = 0; b < a_boxes; ++b) tma::load_2d(a_dst + b * kBox, a_map, bar, task.m0 + 64 * b, row0 + k0);
#pragma unroll
                             for (int panel = 0; panel < Config::kPanels; ++panel)
                               tma::load_2d(b_dst + panel * kBox, b_map, bar, task.n0 + 64 * panel, row0 + k0);
                           });
      }
    }
    if (!ok) return false;
  }
}

// The consumer warpgroups: the handed tasks in order, wgmma, then each kind's epilogue. The two
// warpgroups do not wait for each other between tiles; each signals the g tiles it finished.
template <typename Element, typename Config>
__device__ bool consume_backward(const BackwardParams& p, const ExpertTables& t, char* smem,
                                 StagePipeline<Config::kStages>& stages, TaskRing<Config::kStages>& ring,
                                 const BackwardTaskCounts& counts) {
  constexpr int BN = Config::kTileN;
  typename Config::RowGemm::State stage{};
  char* staging = smem + Config::kStagingOffset + (threadIdx.x >> 5) * kWarpStagingBytes;
  for (typename TaskRing<Config::kStages>::State slot{};; slot.advance()) {
    const int id = ring.take(slot, p);
    if (id < 0) return id == kTaskEnd;
    const BackwardTask task = decode_backward_task<BN>(id, counts, t.tile_start, p.experts);
    if (task.kind == BackwardTaskKind::G) {
      const BackwardRowTile tile = backward_row_tile(t, p.experts, task.row_tile);
      typename Config::RowGemm gemm;
      const int k_tiles = p.hidden / static_cast<int>(kTmaSlabK);
      const bool ok = gemm.consume(smem, stages, stage, k_tiles, p, warpgroup_has_rows(tile.rows));
      if (!sync_warpgroup_and(ok)) return false;
      g_epilogue<Element, BN>(p, gemm, staging, tile, task.n0, task.n0 / BN, counts.g_cols);
      tma::fence_proxy_async_global();  // the dx and dW tiles' TMA loads read wh and dpre
      sync_warpgroup();
      if ((threadIdx.x & 127) == 0) {
        __threadfence();
        ptx::red_release_add_gpu(p.row_tile_done + task.row_tile, 1);
        ptx::red_release_add_gpu(p.expert_done + tile.expert, 1);
      }
    } else if (task.kind == BackwardTaskKind::Dx) {
      const BackwardRowTile tile = backward_row_tile(t, p.experts, task.row_tile);
      typename Config::RowGemm gemm;
      const int k_tiles = p.w1_cols / static_cast<int>(kTmaSlabK);
      const bool ok = gemm.consume(smem, stages, stage, k_tiles, p, warpgroup_has_rows(tile.rows));
      if (!sync_warpgroup_and(ok)) return false;
      Element* dx_rows = static_cast<Element*>(p.dx_rows) + static_cast<int64_t>(tile.packed_row0) * p.hidden;
      gemm2_epilogue_warp<Element, BN>(gemm, staging, dx_rows, p.hidden, tile.rows, task.n0);
      if (task.n0 == 0 && static_cast<int>(threadIdx.x) < tile.rows) {
        // The combine weight's gradient: the row's partials in column-tile order.
        const float* part = p.dweight_part + static_cast<int64_t>(tile.padded_row0 + threadIdx.x) * counts.g_cols;
        float sum = 0.f;
        for (int ct = 0; ct < counts.g_cols; ++ct) sum += __ldcg(part + ct);
        p.dweight_row[tile.packed_row0 + threadIdx.x] = sum;
      }
    } else {
      const bool dw2 = task.kind == BackwardTaskKind::Dw2;
      const int m_extent = dw2 ? p.ffn : p.hidden, n_extent = dw2 ? p.hidden : p.w1_cols;
      const int slabs = expert_slabs(t, task.expert);
      typename Config::WeightGemm gemm;
      const bool active = slabs > 0 && warpgroup_has_rows(m_extent - task.m0);
      const bool ok = gemm.consume(smem, stages, stage, slabs > 0 ? slabs : 1, p, active);
      if (!sync_warpgroup_and(ok)) return false;
      Element* out = static_cast<Element*>(dw2 ? p.dw2 : p.dw1) +
                     (static_cast<int64_t>(task.expert) * m_extent + task.m0) * n_extent;
      gemm2_epilogue_warp<Element, BN>(gemm, staging, out, n_extent, m_extent - task.m0, task.n0);
    }
  }
}

template <typename Element, typename Config>
__device__ void backward_block(const BackwardParams& p, char* smem) {
  __shared__ int start[kMaxExperts + 1], padded_start[kMaxExperts + 1], tile_start[kMaxExperts + 1];
  __shared__ StagePipeline<Config::kStages> stages;
  __shared__ TaskRing<Config::kStages> ring;
  const ExpertTables tables{start, padded_start, tile_start};
  if (blockIdx.x == 0 && threadIdx.x == 0) p.phase_clock[0] = ptx::global_timer_ns();

  count_kept_rows(p);
  if (!grid_barrier(p, kPhaseBackwardCounts, 1)) return;
  build_expert_tables(p, tables);
  gather_rows<Element>(p, tables);
  tma::fence_proxy_async_global();  // the gathered rows are read by TMA
  if (!grid_barrier(p, kPhaseBackwardGather, 2)) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) p.phase_clock[1] = ptx::global_timer_ns();

  const BackwardTaskCounts counts = backward_task_counts<Config::kTileN>(p, tables.tile_start[p.experts]);
  if (threadIdx.x == 0) {
    ring.init();
    stages.init(kThreads / 32);
  }
  __syncthreads();
  bool ok = true;
  if (threadIdx.x < kThreads) {
    ptx::increase_registers<Config::kConsumerRegisters>();
    ok = consume_backward<Element, Config>(p, tables, smem, stages, ring, counts);
    ptx::decrease_registers<Config::kLaunchRegisters>();
  } else {
    ptx::decrease_registers<Config::kProducerRegisters>();
    if (threadIdx.x == kThreads) ok = produce_backward<Element, Config>(p, tables, smem, stages, ring, counts);
    __syncwarp();
  }
  __syncthreads_and(ok);
  // The producer warpgroup takes its registers back only past the barrier, which every consumer warp
  // reaches after giving its own back: asked for earlier, its idle warps could retake registers that a
  // consumer warp's increase was still waiting for, and that warp would never reach the consumers' barrier.
  if (threadIdx.x >= kThreads) ptx::increase_registers<Config::kLaunchRegisters>();
  if (blockIdx.x == 0 && threadIdx.x == 0) p.phase_clock[2] = ptx::global_timer_ns();
}

template <typename Element, int BN>
__global__ void __launch_bounds__(FusedBackwardConfig<Element, BN>::kBlockThreads, 1)
    fused_backward_kernel(const __grid_constant__ BackwardParams p) {
  extern __shared__ __align__(1024) char smem[];
  backward_block<Element, FusedBackwardConfig<Element, BN>>(p, smem);
  finish_launch(p);
}

}  // namespace flashdmoe
