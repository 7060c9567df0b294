// Tile shapes of every phase in one place (runtime problem sizes, compile-time tiles).
#pragma once

namespace flashdmoe {

constexpr int kThreads = 256;  // 8 warps per block

// Gate: 32 tokens x 128 experts per router-GEMM tile, K slabs of 64.
constexpr int kGateTileM = 32;
constexpr int kGateTileN = 128;
constexpr int kGateStages = 3;
constexpr int kGatePipelineBytes = kGateStages * (kGateTileM + kGateTileN) * 64 * 2;

// Expert FFN GEMMs: 128 rows x 128 columns, K slabs of 64, 3 stages.
constexpr int kExpertTileM = 128;
constexpr int kExpertTileN = 128;
constexpr int kExpertStages = 3;
constexpr int kExpertPipelineBytes = kExpertStages * (kExpertTileM + kExpertTileN) * 64 * 2;
constexpr int kEpilogueStride = kExpertTileN + 4;  // fp32 staging row, padded against bank conflicts
constexpr int kEpilogueStageBytes = kExpertTileM * kEpilogueStride * 4;

// Shape constraints checked on the host (and named in the error message).
constexpr int kHiddenMultiple = 64;
constexpr int kFfnMultiple = 64;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;

}  // namespace flashdmoe
