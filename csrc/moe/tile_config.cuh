// Tile shapes of every phase in one place (runtime problem sizes, compile-time tiles).
#pragma once

namespace flashdmoe {

constexpr int kThreads = 256;  // 8 warps per block

// Gate: 32 tokens x 128 experts per router-GEMM tile, K slabs of 64.
constexpr int kGateTileM = 32;
constexpr int kGateTileN = 128;
constexpr int kGateStages = 3;
constexpr int kGatePipelineBytes = kGateStages * (kGateTileM + kGateTileN) * 64 * 2;

// Expert FFN GEMMs: 128 rows x 128 columns, K slabs of 64.
constexpr int kExpertTileM = 128;
constexpr int kExpertTileN = 128;
constexpr int kExpertStageBytes = (kExpertTileM + kExpertTileN) * 64 * 2;

// Expert GEMM variants, chosen at launch (benchmarks compare them): the MMA instruction family, the
// cp.async pipeline depth, and the blocks per SM the register budget is cut for.
enum class ExpertMma : int { Wgmma = 0, MmaSync = 1 };
template <ExpertMma kMma, int kStagesArg, int kBlocksPerSm>
struct ExpertVariant {
  static constexpr bool kUseWgmma = kMma == ExpertMma::Wgmma;
  static constexpr int kStages = kStagesArg;
  static constexpr int kMinBlocksPerSm = kBlocksPerSm;
  static constexpr int kPipelineBytes = kStages * kExpertStageBytes;
};
// Variant ids as the host passes them (flashdmoe/cuda_backend.py EXPERT_VARIANTS).
using WgmmaThreeStages = ExpertVariant<ExpertMma::Wgmma, 3, 2>;    // 0: default
using WgmmaFourStages = ExpertVariant<ExpertMma::Wgmma, 4, 1>;     // 1
using WgmmaSixStages = ExpertVariant<ExpertMma::Wgmma, 6, 1>;      // 2
using MmaSyncThreeStages = ExpertVariant<ExpertMma::MmaSync, 3, 2>;  // 3
constexpr int kEpilogueStride = kExpertTileN + 4;  // fp32 staging row, padded against bank conflicts
constexpr int kEpilogueStageBytes = kExpertTileM * kEpilogueStride * 4;

// Shape constraints checked on the host (and named in the error message).
constexpr int kHiddenMultiple = 64;
constexpr int kFfnMultiple = 64;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;

}  // namespace flashdmoe
