// The expert backward of one rank as one persistent kernel: from the forward's routing and saved
// pre-activations, every expert GEMM of the backward on wgmma fed by TMA, with the element-wise step
// between them in the first GEMM's epilogue.
//
//   1. counts:  kept rows per expert (integer atomics), grid barrier, per-block tables (prefix sums);
//   2. index:   each expert's rows numbered in a padded order (each expert's rows start at a multiple
//               of 64): the token of each row (-1 in the gaps) and its combine weight; grid barrier;
//   3. tasks, taken from one queue in this order (a task waits only for earlier ones):
//      g   tiles (row tile x I columns):   g = dy_rows W2_e^T; epilogue: h = act(pre), wh = w h,
//                                          dpre = w g act'(pre), partial <g, h> per row;
//      dx  tiles (row tile x H columns):   dx_rows = dpre W1_e^T, once the row tile's g tiles are done;
//                                          the row's dweight = sum of its partials, in column order;
//      dW2 tiles (I x H per expert):       wh^T dy_rows over the expert's rows,
//      dW1 tiles (H x w1_cols per expert): x_rows^T dpre, once the expert's g tiles are done.
// dy_rows and x_rows are never stored: the producer warpgroup copies each stage's rows of dy and x
// straight from the tokens (cp.async, in the swizzle TMA would leave), beside the TMA loads of the
// weights and of the buffers the kernel writes (wh, dpre).
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
  // operands MN-major (the row buffers read across their rows). dy's and x's boxes come by cp.async.
  using RowGemm = TmaTileGemm<Element, BN, kStages, 64, Major::K, Major::K, true>;
  using WeightGemm = TmaTileGemm<Element, BN, kStages, 64, Major::MN, Major::MN, true>;
  static constexpr int kProducerThreads = 128;
  // A stage completes on its TMA bytes, the leader's arrival and one cp.async arrival per producer thread.
  static constexpr uint32_t kStageArrivals = 1 + kProducerThreads;
  static constexpr int kBoxBytes = 64 * 64 * 2;  // every operand box: 64 x 64 two-byte elements
  static_assert(kProducerThreads / 8 * 4 == 64 && kBoxBytes == 64 * 128,
                "copy_box: 8 threads per 128-byte line, 4 lines each, cover one 64-line box");
  static constexpr int kPanels = BN / 64;
  static constexpr int kPipelineBytes = RowGemm::kPipelineBytes;
  static_assert(WeightGemm::kPipelineBytes == kPipelineBytes, "one stage ring for every GEMM kind");
  static constexpr int kStagingOffset = kPipelineBytes;
  static constexpr int kSmemBytes = kPipelineBytes + (kThreads / 32) * kWarpStagingBytes;
  // + a producer warpgroup (its first lane takes the tasks and issues the TMA loads, every lane copies
  // rows): whole warpgroups, so that registers can move to the consumers (168 each at launch; 40 for
  // the producer, 232 for the consumers in the task loop).
  static constexpr int kBlockThreads = kThreads + kProducerThreads;
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

// Each GEMM's tiles in grouped order (common/tile_order.cuh): row tiles x column tiles for g and dx,
// m tiles x n tiles of each expert's dW2 and dW1.
template <int BN>
__device__ __forceinline__ BackwardTask decode_backward_task(int id, const BackwardTaskCounts& c, int row_tiles) {
  if (id < c.g_tasks) {
    const TileCoord t = grouped_tile(id, row_tiles, c.g_cols);
    return {BackwardTaskKind::G, t.row, 0, 0, t.col * BN};
  }
  id -= c.g_tasks;
  if (id < c.dx_tasks) {
    const TileCoord t = grouped_tile(id, row_tiles, c.dx_cols);
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

// ---- 2. index ----

// One thread per choice: its token and combine weight at its padded row; then the gaps marked (token
// -1, weight 0). Also the checked row table for the router's and dx's kernels.
__device__ void index_rows(const BackwardParams& p, const ExpertTables& t) {
  const int64_t threads = static_cast<int64_t>(p.blocks) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t choices = static_cast<int64_t>(p.tokens) * p.top_k;
  for (int64_t c = first; c < choices; c += threads) {
    const int e = p.topk_expert[c], r = p.topk_row[c];
    const bool kept = r >= 0 && e >= 0 && e < p.experts && r >= t.start[e] && r < t.start[e + 1];
    p.row_of_choice[c] = kept ? r : -1;
    if (!kept) continue;
    const int64_t padded = t.padded_start[e] + (r - t.start[e]);
    p.row_token[padded] = static_cast<int>(c / p.top_k);
    p.w_pad[padded] = p.topk_weight[c];
  }
  const int64_t gap_rows = static_cast<int64_t>(p.experts) * (kBackwardRowAlign - 1);
  for (int64_t s = first; s < gap_rows; s += threads) {
    const int e = static_cast<int>(s / (kBackwardRowAlign - 1));
    const int64_t padded = t.padded_start[e] + (t.start[e + 1] - t.start[e]) + s % (kBackwardRowAlign - 1);
    if (padded >= t.padded_start[e + 1]) continue;
    p.row_token[padded] = -1;
    p.w_pad[padded] = 0.f;
  }
}

// The lines of one 64 x 64 operand box a producer thread copies: lines t/8 + 16 j (j < 4), its 16-byte
// chunk t % 8 of each, t the thread's index in the producer warpgroup; token[j] is line j's token, or
// -1 for a line of zeros.
struct BoxLines {
  int token[4];
};

// A box of `rows` ([T, H] row-major: dy or x) into shared memory at `dst`, laid out as TMA leaves a
// {64, 64} box with the 128-byte swizzle (line i at 128 i, its chunk c at position c ^ (i % 8));
// columns [col, col + 64). Zeros where a line has no token or the columns lie past H.
template <typename Element>
__device__ __forceinline__ void copy_box(uint32_t dst, const Element* rows, int hidden, int col, const BoxLines& lines) {
  const int t = static_cast<int>(threadIdx.x) - kThreads;
  const int chunk = t & 7, line0 = t >> 3;
  const uint32_t at = dst + line0 * 128 + ((chunk ^ (line0 & 7)) << 4);  // (line0 + 16 j) % 8 == line0 % 8
  const bool in_columns = col < hidden;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const bool valid = in_columns && lines.token[j] >= 0;
    const Element* from = valid ? rows + static_cast<int64_t>(lines.token[j]) * hidden + col + chunk * 8 : rows;
    ptx::cp_async_16(at + j * 16 * 128, from, valid);
  }
}

// The tokens of a box's lines for this thread: padded rows [row0, row0 + 64) of which the first `rows`
// are real (the rest zeros).
__device__ __forceinline__ BoxLines box_lines(const BackwardParams& p, int row0, int rows) {
  const int line0 = (static_cast<int>(threadIdx.x) - kThreads) >> 3;
  BoxLines lines;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int line = line0 + 16 * j;
    // A plain load: the table was written before the grid barrier, whose acquire orders it; every slab
    // after the first finds it in L1.
    lines.token[j] = line < rows ? p.row_token[row0 + line] : -1;
  }
  return lines;
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

// A g tile's epilogue reads the tile's saved pre-activations (its rows, its columns; both halves for
// swiglu) once the K loop is done: the producer threads ask L2 for them as the task starts, one row each.
__device__ __forceinline__ void prefetch_pre(const BackwardParams& p, const BackwardRowTile& tile, int n0, int width) {
  const int t = static_cast<int>(threadIdx.x) - kThreads;
  if (t >= tile.rows) return;
  const uint32_t bytes = static_cast<uint32_t>(min(width, p.ffn - n0)) * 2;
  const char* row = static_cast<const char*>(p.pre) + (static_cast<int64_t>(tile.packed_row0 + t) * p.w1_cols + n0) * 2;
  ptx::prefetch_l2(row, bytes);
  if (p.activation == Activation::Swiglu) ptx::prefetch_l2(row + static_cast<int64_t>(p.ffn) * 2, bytes);
}

// The producer warpgroup. Its leader (first lane) takes tasks, waits for their inputs and hands them
// over in order; for each K slab it waits until the consumers released the stage, arms the stage with
// the bytes of its TMA loads and issues them. Every thread then copies its lines of the slab's row
// boxes (dy's, x's) and arrives on the stage once they landed. The leader's verdicts (task ready, stage
// free) reach the group through named barrier 2, so the group leaves the loop together.
template <typename Element, typename Config>
__device__ bool produce_backward(const BackwardParams& p, const ExpertTables& t, char* smem,
                                 StagePipeline<Config::kStages>& stages, TaskRing<Config::kStages>& ring,
                                 const BackwardTaskCounts& counts) {
  using Gemm = typename Config::RowGemm;
  constexpr int kBox = Config::kBoxBytes;
  __shared__ int handed;  // the leader's task id, read by the group past the next named barrier
  const bool leader = threadIdx.x == kThreads;
  const uint32_t base = ptx::smem_addr(smem);
  const Element* dy = static_cast<const Element*>(p.dy);
  const Element* x = static_cast<const Element*>(p.x);
  typename Gemm::State stage{};
  typename TaskRing<Config::kStages>::State slot{};
  // k_tiles slabs: loads(a, b, k0, bar) issues the leader's TMA loads (tma_bytes of them), rows(a, b, kt)
  // every thread's copies.
  auto stream = [&](int k_tiles, uint32_t tma_bytes, auto&& loads, auto&& rows) {
    for (int kt = 0; kt < k_tiles; ++kt, stage.advance()) {
      const bool stage_free = !leader || stages.producer_acquire(stage, p);
      if (!sync_producers_and(stage_free)) return false;
      const uint32_t full = ptx::smem_addr(&stages.full[stage.index()]);
      const uint32_t a = Gemm::a_stage(base, stage.index()), b = Gemm::b_stage(base, stage.index());
      if (leader) {
        tma::arrive_expect_tx(full, tma_bytes);
        loads(a, b, kt * static_cast<int>(kTmaSlabK), full);
      }
      rows(a, b, kt);
      ptx::cp_async_arrive_noinc(full);
    }
    return true;
  };
  for (;; slot.advance()) {
    bool ready = true;
    if (leader) {
      const int id = static_cast<int>(atomicAdd(p.task_counter, 1u));
      if (id < counts.total) {
        const BackwardTask task = decode_backward_task<Config::kTileN>(id, counts, t.tile_start[p.experts]);
        if (task.kind == BackwardTaskKind::Dx) {
          ready = wait_at_least(p.row_tile_done + task.row_tile, counts.g_cols, p, kPhaseBackwardRowTile, p.rank);
        } else if (task.kind != BackwardTaskKind::G) {
          const uint32_t tiles = t.tile_start[task.expert + 1] - t.tile_start[task.expert];
          ready = wait_at_least(p.expert_done + task.expert, tiles * counts.g_cols, p, kPhaseBackwardExpert, p.rank);
        }
        tma::fence_proxy_async_global();  // the TMA loads below read wh and dpre, which other blocks stored
      }
      handed = id;
      ring.hand_over(slot, id >= counts.total ? kTaskEnd : ready ? id : kTaskAbort);
    }
    ready = sync_producers_and(ready);
    const int id = handed;
    if (id >= counts.total) return true;
    if (!ready) return false;
    const BackwardTask task = decode_backward_task<Config::kTileN>(id, counts, t.tile_start[p.experts]);
    bool ok;
    if (task.kind == BackwardTaskKind::G || task.kind == BackwardTaskKind::Dx) {
      const BackwardRowTile tile = backward_row_tile(t, p.experts, task.row_tile);
      const bool g = task.kind == BackwardTaskKind::G;
      const int a_boxes = tile.rows > 64 ? 2 : 1;
      const CUtensorMap* b_map = g ? &p.maps.w2 : &p.maps.w1;
      const int k_tiles = (g ? p.hidden : p.w1_cols) / static_cast<int>(kTmaSlabK);
      auto weights = [&](uint32_t a_dst, uint32_t b_dst, int k0, uint32_t bar) {
        if (!g)
          for (int box = 0; box < a_boxes; ++box) tma::load_2d(a_dst + box * kBox, &p.maps.dpre, bar, k0, tile.padded_row0 + 64 * box);
#pragma unroll
        for (int panel = 0; panel < Config::kPanels; ++panel)
          tma::load_3d(b_dst + panel * kBox, b_map, bar, k0, task.n0 + 64 * panel, tile.expert);
      };
      if (g) {  // A: dy's rows of the tile (their tokens looked up again each slab: fewer live registers)
        prefetch_pre(p, tile, task.n0, Config::kTileN);
        ok = stream(k_tiles, Config::kPanels * kBox, weights, [&](uint32_t a_dst, uint32_t, int kt) {
          const int k0 = kt * static_cast<int>(kTmaSlabK);
          for (int box = 0; box < a_boxes; ++box)
            copy_box(a_dst + box * kBox, dy, p.hidden, k0, box_lines(p, tile.padded_row0 + 64 * box, tile.rows - 64 * box));
        });
      } else {
        ok = stream(k_tiles, (a_boxes + Config::kPanels) * kBox, weights, [](uint32_t, uint32_t, int) {});
      }
    } else {
      const bool dw2 = task.kind == BackwardTaskKind::Dw2;
      const int m_extent = dw2 ? p.ffn : p.hidden;
      const int a_boxes = m_extent - task.m0 > 64 ? 2 : 1;
      const int slabs = expert_slabs(t, task.expert);
      const int row0 = t.padded_start[task.expert];
      if (slabs == 0) {  // one empty slab: no loads, the arrivals alone complete the stage
        ok = stream(1, 0u, [](uint32_t, uint32_t, int, uint32_t) {}, [](uint32_t, uint32_t, int) {});
      } else if (dw2) {  // A: wh by TMA; B: dy's rows of the slab, one box per 64-column panel
        ok = stream(slabs, a_boxes * kBox,
                    [&](uint32_t a_dst, uint32_t, int k0, uint32_t bar) {
                      for (int box = 0; box < a_boxes; ++box)
                        tma::load_2d(a_dst + box * kBox, &p.maps.wh, bar, task.m0 + 64 * box, row0 + k0);
                    },
                    [&](uint32_t, uint32_t b_dst, int kt) {
                      const BoxLines lines = box_lines(p, row0 + kt * static_cast<int>(kTmaSlabK), 64);
#pragma unroll
                      for (int panel = 0; panel < Config::kPanels; ++panel)
                        copy_box(b_dst + panel * kBox, dy, p.hidden, task.n0 + 64 * panel, lines);
                    });
      } else {  // A: x's rows of the slab; B: dpre by TMA
        ok = stream(slabs, Config::kPanels * kBox,
                    [&](uint32_t, uint32_t b_dst, int k0, uint32_t bar) {
#pragma unroll
                      for (int panel = 0; panel < Config::kPanels; ++panel)
                        tma::load_2d(b_dst + panel * kBox, &p.maps.dpre, bar, task.n0 + 64 * panel, row0 + k0);
                    },
                    [&](uint32_t a_dst, uint32_t, int kt) {
                      const BoxLines lines = box_lines(p, row0 + kt * static_cast<int>(kTmaSlabK), 64);
                      for (int box = 0; box < a_boxes; ++box) copy_box(a_dst + box * kBox, x, p.hidden, task.m0 + 64 * box, lines);
                    });
      }
    }
    if (!ok) return false;
  }
}

// The consumer warpgroups: the handed tasks in order, wgmma, then each kind's epilogue.
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
    const BackwardTask task = decode_backward_task<BN>(id, counts, t.tile_start[p.experts]);
    if (task.kind == BackwardTaskKind::G) {
      const BackwardRowTile tile = backward_row_tile(t, p.experts, task.row_tile);
      typename Config::RowGemm gemm;
      const int k_tiles = p.hidden / static_cast<int>(kTmaSlabK);
      const bool ok = gemm.consume(smem, stages, stage, k_tiles, p, (threadIdx.x >> 7) * 64 < tile.rows);
      if (!sync_workers_and(ok)) return false;
      g_epilogue<Element, BN>(p, gemm, staging, tile, task.n0, task.n0 / BN, counts.g_cols);
      tma::fence_proxy_async_global();  // the dx and dW tiles' TMA loads read wh and dpre
      sync_workers();
      if (threadIdx.x == 0) {
        __threadfence();
        ptx::red_release_add_gpu(p.row_tile_done + task.row_tile, 1);
        ptx::red_release_add_gpu(p.expert_done + tile.expert, 1);
      }
    } else if (task.kind == BackwardTaskKind::Dx) {
      const BackwardRowTile tile = backward_row_tile(t, p.experts, task.row_tile);
      typename Config::RowGemm gemm;
      const int k_tiles = p.w1_cols / static_cast<int>(kTmaSlabK);
      const bool ok = gemm.consume(smem, stages, stage, k_tiles, p, (threadIdx.x >> 7) * 64 < tile.rows);
      if (!sync_workers_and(ok)) return false;
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
      const bool active = slabs > 0 && (threadIdx.x >> 7) * 64 < m_extent - task.m0;
      const bool ok = gemm.consume(smem, stages, stage, slabs > 0 ? slabs : 1, p, active);
      if (!sync_workers_and(ok)) return false;
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
  index_rows(p, tables);
  if (!grid_barrier(p, kPhaseBackwardGather, 2)) return;
  if (blockIdx.x == 0 && threadIdx.x == 0) p.phase_clock[1] = ptx::global_timer_ns();

  const BackwardTaskCounts counts = backward_task_counts<Config::kTileN>(p, tables.tile_start[p.experts]);
  if (threadIdx.x == 0) {
    ring.init();
    stages.init(kThreads / 32, Config::kStageArrivals);
  }
  __syncthreads();
  bool ok = true;
  if (threadIdx.x < kThreads) {
    ptx::increase_registers<Config::kConsumerRegisters>();
    ok = consume_backward<Element, Config>(p, tables, smem, stages, ring, counts);
    ptx::decrease_registers<Config::kLaunchRegisters>();
  } else {
    ptx::decrease_registers<Config::kProducerRegisters>();
    ok = produce_backward<Element, Config>(p, tables, smem, stages, ring, counts);
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
