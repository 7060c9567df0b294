// The TMA boxes of the kernel's tensor maps, in one place: the host encodes them (make_expert_tensor_maps,
// moe/launch_template.cuh) and the device arms each stage's mbarrier with their bytes (expect_tx), so
// both sides read the same constants. Every TMA operand has 2-byte elements (fp32 runs without TMA).
#pragma once
#include <cstdint>
#include "moe/tile_config.cuh"

namespace flashdmoe {

constexpr uint32_t kTmaElementBytes = 2;
// K elements per slab: one 128-byte row, the span of TMA's (and wgmma's) 128-byte swizzle.
constexpr uint32_t kTmaSlabK = 64;
constexpr int kTmaBoxRowBytes = kTmaSlabK * kTmaElementBytes;
static_assert(kTmaBoxRowBytes == 128, "a 128B-swizzled box row is 128 bytes");

// A box of `rank` dims, innermost first (dims[0] elements, then rows, then the expert index).
struct TmaBox {
  uint32_t dims[3];
  int rank;
  __host__ __device__ constexpr int bytes() const {
    int n = static_cast<int>(kTmaElementBytes);
    for (int d = 0; d < rank; ++d) n *= static_cast<int>(dims[d]);
    return n;
  }
};

// Expert GEMM A: one K slab of box_rows rows (the variant's ExpertVariant::kRowBoxRows) of the receive
// buffer (GEMM1) or the intermediate (GEMM2). A tile loads only the boxes that hold its rows: a decode
// tile of a few rows streams box_rows x 128 bytes of A per slab beside its weights, not 16 KB.
__host__ __device__ constexpr TmaBox expert_row_box(int box_rows) {
  return {{kTmaSlabK, static_cast<uint32_t>(box_rows), 1}, 2};
}
// Row boxes per K slab of a tile of `rows` rows (at least one: a tile always has a row).
__host__ __device__ constexpr int expert_row_boxes(int rows, int box_rows) {
  return rows <= box_rows ? 1 : (rows + box_rows - 1) / box_rows;
}
// Whether a variant with box_rows-row A boxes also loads a full tile's rows as one kExpertTileM-row box
// (ExpertTensorMaps::recv_full / intermediate_full): one request where two ran, the same bytes and layout.
// The 64-row box variants only: the decode variant's tiles are rarely full, and there the extra branch
// measured 1% slower on a one-token forward.
__host__ __device__ constexpr bool loads_full_tile_box(int box_rows) { return box_rows == 64; }
// Expert GEMM B: one 64-column panel of one K slab of one local expert's weights ([L][K][N]).
constexpr uint32_t kWeightPanelColumns = 64;
constexpr TmaBox kWeightPanelBox{{kWeightPanelColumns, kTmaSlabK, 1}, 3};
// Gate A: one K slab of a kGateTileM-token tile of x.
constexpr TmaBox kGateTokenBox{{kTmaSlabK, kGateTileM, 1}, 2};
// Gate B: one K slab of the router rows of up to kGateTileN experts (only the experts there are).
__host__ __device__ constexpr TmaBox gate_router_box(int experts) {
  return {{kTmaSlabK, static_cast<uint32_t>(gate_router_rows(experts)), 1}, 2};
}
// Its bytes, as the device computes them per launch (no box built at run time).
__host__ __device__ constexpr int gate_router_box_bytes(int experts) { return gate_router_rows(experts) * kTmaBoxRowBytes; }
constexpr bool gate_router_box_bytes_match() {
  for (int experts = 1; experts <= kMaxExperts; ++experts)
    if (gate_router_box_bytes(experts) != gate_router_box(experts).bytes()) return false;
  return true;
}
static_assert(gate_router_box_bytes_match(), "gate_router_box_bytes is the router box's size for every E");

}  // namespace flashdmoe
