// An array's channels moved between the second and the last dimension (see move_channels.h).
#include "move_channels.h"

#include <algorithm>
#include <stdexcept>

#include "vector_isa.h"

namespace mxamp {
namespace {

// Tiles of kTile x kTile elements: a 2-byte tile and its transpose take 8 KB each, in the L1.
constexpr int64_t kTile = 64;

// Each image's (rows, cols) matrix into (cols, rows), a tile at a time, tiles over the team.
template <typename T>
void transpose_images(const T* in, T* out, int64_t images, int64_t rows, int64_t cols) {
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
  const int64_t tiles = images * row_tiles * col_tiles;
  const int64_t matrix = rows * cols;
#pragma omp parallel for schedule(static) if (images * matrix >= kParallelFrom)
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t image = t / (row_tiles * col_tiles), within = t % (row_tiles * col_tiles);
    const int64_t r0 = within / col_tiles * kTile, c0 = within % col_tiles * kTile;
    const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
    const T* source = in + image * matrix;
    T* target = out + image * matrix;
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = r0; r < r1; ++r) target[c * rows + r] = source[r * cols + c];
  }
}

}  // namespace

void move_channels(const void* in, void* out, int64_t images, int64_t channels,
                   int64_t positions, size_t element_bytes, bool to_last) {
  const int64_t rows = to_last ? channels : positions, cols = to_last ? positions : channels;
  if (element_bytes == 2) {
    transpose_images(static_cast<const uint16_t*>(in), static_cast<uint16_t*>(out), images,
                     rows, cols);
  } else if (element_bytes == 4) {
    transpose_images(static_cast<const uint32_t*>(in), static_cast<uint32_t*>(out), images,
                     rows, cols);
  } else {
    throw std::invalid_argument("move_channels: elements of 2 or 4 bytes only");
  }
}

}  // namespace mxamp
