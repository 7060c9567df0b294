// Tile shapes of every phase in one place (runtime problem sizes, compile-time tiles).
#pragma once

namespace flashdmoe {

constexpr int kThreads = 256;  // 8 warps per block

// Gate: 32 tokens x 128 experts per router-GEMM tile, K slabs of 64.
constexpr int kGateTileM = 32;
constexpr int kGateTileN = 128;
// Gate pipeline depth: deeper when the experts' fp32 logits leave room (E <= 256). With cp.async feeding
// the depth made no difference (0.78 vs 0.77 us per K slab, scripts/gate_probe.cu: issuing the copies is
// the cost); the TMA variant's producer warp uses it to run ahead into the next tile.
constexpr int kGateStagesDeep = 8, kGateStagesShallow = 4;
constexpr int kDeepGateMaxExperts = 256;
__host__ __device__ constexpr int gate_stages(int experts) {
  return experts <= kDeepGateMaxExperts ? kGateStagesDeep : kGateStagesShallow;
}
// Small batches: with fewer gate tiles than blocks, most SMs would idle while a few stream the whole
// router (at T = 1 one block reads a 512 KB router at ~0.65 us per K slab). Each tile's K slabs are then
// split over several blocks (fp32 partial logits of the tile's token rows to the workspace, summed in
// split order by the tile's last block: deterministic). Up to kGateSplitMaxTiles tiles are split, into
// at most gate_split_max_items(E) (tile, K range) items in all. On in every public forward.
constexpr int kGateSplitMaxTiles = 64;
__host__ __device__ constexpr int gate_split_max_items(int experts) { return 256 * 64 / (experts > 64 ? experts : 64); }
// Rows of the gate's router TMA box: the experts there are (rounded up to 8), at most kGateTileN.
__host__ __device__ constexpr int gate_router_rows(int experts) {
  return (experts + 7) / 8 * 8 < kGateTileN ? (experts + 7) / 8 * 8 : kGateTileN;
}
// TMA bytes of one 64-deep K slab of a gate tile over all experts: per 128 experts, a 32-token box of x
// and a router box.
__host__ __device__ constexpr int gate_slab_bytes(int experts) {
  return (experts + kGateTileN - 1) / kGateTileN * (kGateTileM + gate_router_rows(experts)) * 64 * 2;
}
// K ranges per gate tile for a rank of `blocks` blocks and `tokens` tokens, for every E (docs/perf-notes.md,
// "Split gate", has the history of its E >= 512 misrouting). The split count balances a block's share of
// the tile's slabs against the last block's
// sum of every split's partials (tokens x E fp32 each, counted twice: plain loads keep fewer bytes in
// flight than the TMA pipeline): one token takes one slab per split (its partials are 512 B with
// E = 128), a full tile of E = 256 about eight splits (32 KB of partials each).
__host__ __device__ constexpr int gate_splits_for(int tokens, int gate_tiles, int hidden, int experts, int blocks) {
  const int items = blocks < gate_split_max_items(experts) ? blocks : gate_split_max_items(experts);
  if (gate_tiles < 1 || gate_tiles > kGateSplitMaxTiles || 2 * gate_tiles > items) return 1;
  const int slabs = hidden / 64;
  const int most = items / gate_tiles < slabs ? items / gate_tiles : slabs;
  const long long slab_bytes = gate_slab_bytes(experts);
  const long long partial_bytes = 2LL * (tokens < kGateTileM ? tokens : kGateTileM) * experts * 4;
  int best = 1;
  long long best_cost = slabs * slab_bytes;
  for (int splits = 2; splits <= most; ++splits) {
    const long long cost = (slabs + splits - 1) / splits * slab_bytes + splits * partial_bytes;
    if (cost < best_cost) {
      best = splits;
      best_cost = cost;
    }
  }
  return best;
}
// The decode rows of the H200 (132 blocks): Qwen3-30B-A3B's router at T = 1 and 8, DeepSeek-V2-Lite's at
// T = 128 (four tiles), DeepSeek-V3's at T = 32; a large batch stays unsplit.
static_assert(gate_splits_for(1, 1, 2048, 128, 132) == 32 && gate_splits_for(8, 1, 2048, 128, 132) == 8 &&
                  gate_splits_for(128, 4, 4096, 64, 132) == 8 && gate_splits_for(32, 1, 7168, 256, 132) == 8 &&
                  gate_splits_for(4096, 128, 2048, 64, 132) == 1 && gate_splits_for(1, 1, 2048, 512, 132) == 32,
              "gate split counts of the decode rows (and Qwen3-Next's 512-expert router at T = 1)");
__host__ __device__ constexpr int gate_pipeline_bytes(int stages) { return stages * (kGateTileM + kGateTileN) * 64 * 2; }

// Expert FFN GEMMs: 128-row tiles, 128 or 256 columns (per variant), K slabs of 64.
constexpr int kExpertTileM = 128;
// Results staging per worker warp in the TMA variant: 16 rows x 64 two-byte columns (moe/epilogue.cuh).
constexpr int kWarpStagingBytes = 16 * 128;

// Expert GEMM variants, chosen at launch: the MMA instruction family and operand feed, the tile width,
// the pipeline depth, and the blocks per SM the register budget is cut for. Which ones are compiled, for
// which dtypes and under which id is flashdmoe/kernel/expert_variants.py's table alone: the builder generates
// their instances and the id -> instance dispatch (generated/expert_variants.h).
// WgmmaTmaPrefetch (the default): wgmma, operands loaded by TMA from a producer warp (warp-specialised,
// mbarrier pipeline) that streams across tile boundaries (moe/expert_pipeline.cuh).
// MmaSync: mma.sync with all threads loading by cp.async (moe/tile_gemm.cuh); the only path for fp32
// inputs (TF32), and the portable comparison point.
enum class ExpertMma : int { MmaSync = 0, WgmmaTmaPrefetch = 1 };
// kRowBoxRowsArg: rows of the TMA box A is loaded in (TMA variants; a tile loads the boxes holding its
// rows): 64 (one warpgroup's) for full tiles at two requests per slab, 16 for decode tiles of a row or two.
// kClusterArg = 2 (TMA variants): the kernel runs in two-block clusters, and a task is a pair of row tiles
// of one expert, one per block, sharing each weight slab by multicast (moe/expert_pipeline.cuh).
template <ExpertMma kMma, int kTileNArg, int kStagesArg, int kBlocksPerSm, int kRowBoxRowsArg, int kClusterArg = 1>
struct ExpertVariant {
  static constexpr ExpertMma kMmaFamily = kMma;
  static constexpr bool kUseTma = kMma == ExpertMma::WgmmaTmaPrefetch;
  static constexpr int kTileN = kTileNArg;
  static constexpr int kStages = kStagesArg;
  static constexpr int kRowBoxRows = kRowBoxRowsArg;
  static constexpr int kClusterBlocks = kClusterArg;
  static_assert(kClusterBlocks == 1 || (kClusterBlocks == 2 && kMma == ExpertMma::WgmmaTmaPrefetch),
                "two-block clusters share TMA loads: TMA variants only");
  // Whole 8-row swizzle atoms per box (each box lands 1 KB-aligned), whole boxes per tile.
  static_assert(kRowBoxRows % 8 == 0 && kExpertTileM % kRowBoxRows == 0, "A row boxes must tile the 128 rows");
  static constexpr int kMinBlocksPerSm = kBlocksPerSm;
  static constexpr int kBlockThreads = kUseTma ? kThreads + 32 : kThreads;  // + the producer warp
  static constexpr int kPipelineBytes = kStages * (kExpertTileM + kTileN) * 64 * 2;
  // fp32 staging row, padded so that a warp's 8-byte fragment stores (8 rows x 4 column pairs, two
  // phases of 16 lanes) hit every bank once.
  static constexpr int kEpilogueStride = kTileN + 8;
  static constexpr int kEpilogueBytes = kExpertTileM * kEpilogueStride * 4;
  // The TMA variant writes results from registers through a 2 KB buffer per worker warp (moe/epilogue.cuh),
  // placed after the stages so that the next tile's loads need not wait for the epilogue.
  static constexpr int kWarpStagingOffset = kPipelineBytes;
  static constexpr int kScratchBytes = kUseTma ? kPipelineBytes + (kThreads / 32) * kWarpStagingBytes
                                               : (kPipelineBytes > kEpilogueBytes ? kPipelineBytes : kEpilogueBytes);
  static constexpr bool kSavePre = false;
};

// A variant's training instance: its GEMM1 epilogue also writes the pre-activations for the backward
// (MoEParams::saved_pre). A separate instance, so that the inference kernel's registers stay as they are.
template <typename Variant>
struct SavingPre : Variant {
  static constexpr bool kSavePre = true;
};

// Shape constraints checked on the host (and named in the error message).
constexpr int kHiddenMultiple = 64;
constexpr int kFfnMultiple = 64;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;

}  // namespace flashdmoe
