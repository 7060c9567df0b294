// The order a persistent kernel takes the output tiles of one GEMM in: row tiles in groups of
// kTileGroupRows, and inside a group the column tile varies slowest. The tasks in flight at one time
// then read a few B panels, each fetched from HBM once and shared through L2 by the group's row tiles,
// and the group's A rows stay in L2 over its column tiles. Row-major order had every block on a
// different panel: with few experts and wide layers (E = 8, I = 14336) each task re-read its 2-7 MB
// panel from HBM. The expert GEMMs cut their row tiles by expert first (segment_group): an expert's
// panels are its own, and a group straddling two experts left the cut-off tiles to re-read them a wave
// later (DeepSeek-V3's layer read 35.9 GB from DRAM where 25.7 GB do).
#pragma once

namespace flashdmoe {

constexpr int kTileGroupRows = 8;

struct TileCoord {
  int row, col;
};

// Rows [first, first + rows) of a group, all in segment `segment` (0 where the rows are not cut into segments).
struct TileGroup {
  int first, rows;
  int segment = 0;
};

// The index-th tile of a grid of `cols` column tiles whose rows are cut into groups, each group's tiles
// taken column by column: `group` is the group of row index / cols (every group spans all columns, so the
// tiles before a group are its first row times cols).
__host__ __device__ __forceinline__ TileCoord grouped_tile(int index, int cols, TileGroup group) {
  const int in_group = index - group.first * cols;
  return {group.first + in_group % group.rows, in_group / group.rows};
}

// The group of row `row` when the rows are cut into segments and each segment into groups of
// kTileGroupRows from its first row, so that no group straddles two segments: segment i's rows start at
// starts[i * stride] / divisor (i = 0..segments, the last entry being the end; empty segments repeat
// their start).
__host__ __device__ __forceinline__ TileGroup segment_group(int row, const int* starts, int segments, int stride = 1,
                                                            int divisor = 1) {
  int lo = 0, hi = segments;  // invariant: starts[lo * stride] <= row * divisor < starts[hi * stride]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (starts[mid * stride] <= row * divisor) lo = mid; else hi = mid;
  }
  const int first = starts[lo * stride] / divisor, end = starts[(lo + 1) * stride] / divisor;
  const int group = first + (row - first) / kTileGroupRows * kTileGroupRows;
  return {group, end - group < kTileGroupRows ? end - group : kTileGroupRows, lo};
}

// The index-th tile of a rows x cols grid of tiles (0 <= index < rows * cols), rows in groups of
// kTileGroupRows from row 0.
__host__ __device__ __forceinline__ TileCoord grouped_tile(int index, int rows, int cols) {
  const int first_row = index / (kTileGroupRows * cols) * kTileGroupRows;
  const int group_rows = rows - first_row < kTileGroupRows ? rows - first_row : kTileGroupRows;
  return grouped_tile(index, cols, TileGroup{first_row, group_rows});
}

}  // namespace flashdmoe
