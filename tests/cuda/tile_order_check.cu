// Host check of common/tile_order.cuh (tests/test_tile_order.py compiles and runs it): over random cuts
// of the row tiles into segments (experts, some empty, read with a stride and a divisor as the forward's
// tables are), the grouped order visits every (row, column) tile exactly once, and no group straddles
// two segments or holds more than kTileGroupRows rows, and each group names the segment it lies in.
// Prints "ok" or what failed; argv[1]: the seed.
#include <cstdio>
#include <cstdlib>
#include <set>
#include <utility>
#include <vector>

#include "common/tile_order.cuh"

using namespace flashdmoe;

int main(int argc, char** argv) {
  srand(argc > 1 ? static_cast<unsigned>(atoi(argv[1])) : 1u);
  for (int trial = 0; trial < 2000; ++trial) {
    const int segments = 1 + rand() % 40, stride = 1 + rand() % 3, divisor = 1 + rand() % 2, cols = 1 + rand() % 20;
    std::vector<int> starts((segments + 1) * stride, -1);
    int rows = 0;
    for (int i = 0; i <= segments; ++i) {
      starts[i * stride] = rows * divisor;
      if (i < segments && rand() % 4 != 0) rows += rand() % 20;
    }
    std::set<std::pair<int, int>> seen;
    for (int index = 0; index < rows * cols; ++index) {
      const TileGroup group = segment_group(index / cols, starts.data(), segments, stride, divisor);
      const TileCoord tile = grouped_tile(index, cols, group);
      if (group.rows < 1 || group.rows > kTileGroupRows || tile.row < group.first ||
          tile.row >= group.first + group.rows || tile.col < 0 || tile.col >= cols) {
        printf("trial %d index %d: tile (%d, %d) outside its group [%d, +%d)\n", trial, index, tile.row, tile.col,
               group.first, group.rows);
        return 1;
      }
      int segment = -1;
      for (int i = 0; i < segments; ++i)
        if (starts[i * stride] / divisor <= group.first && group.first < starts[(i + 1) * stride] / divisor) segment = i;
      if (segment < 0 || group.first + group.rows > starts[(segment + 1) * stride] / divisor) {
        printf("trial %d: group [%d, +%d) straddles a segment boundary\n", trial, group.first, group.rows);
        return 1;
      }
      if (group.segment != segment) {  // the forward's row_tile_of searches only this segment's sources
        printf("trial %d: group [%d, +%d) names segment %d, lies in %d\n", trial, group.first, group.rows,
               group.segment, segment);
        return 1;
      }
      seen.insert({tile.row, tile.col});
    }
    if (static_cast<int>(seen.size()) != rows * cols) {
      printf("trial %d: %zu distinct tiles of %d\n", trial, seen.size(), rows * cols);
      return 1;
    }
  }
  // Uniform groups (the overload the backward's weight gradients use) are the same bijection.
  for (int rows = 1; rows < 30; ++rows)
    for (int cols = 1; cols < 12; ++cols) {
      std::set<std::pair<int, int>> seen;
      for (int index = 0; index < rows * cols; ++index) {
        const TileCoord tile = grouped_tile(index, rows, cols);
        seen.insert({tile.row, tile.col});
      }
      if (static_cast<int>(seen.size()) != rows * cols) {
        printf("uniform groups, %d x %d: not every tile once\n", rows, cols);
        return 1;
      }
    }
  printf("ok\n");
  return 0;
}
