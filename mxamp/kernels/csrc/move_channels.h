// An array's channels moved between the second and the last dimension (2- or 4-byte elements).
//
// Owns the arithmetic of "_mxamp_move_channels" (mxnet_extension.cc registers it), which
// mxamp.channels_last puts on the bfloat16 arrays crossing a channels-last region's border.
// MXNet 1.9.1's transpose corrupts memory on bfloat16 arrays with oneDNN, so the border took
// three passes (a cast to float32, its transpose, a cast back) where one moves the bytes.  Exact:
// values are copied, never converted.  Knows nothing of MXNet.
#ifndef MXAMP_MOVE_CHANNELS_H_
#define MXAMP_MOVE_CHANNELS_H_

#include <cstddef>
#include <cstdint>

namespace mxamp {

// For each of `images`: (channels, positions) -> (positions, channels) when `to_last`, else
// (positions, channels) -> (channels, positions); elements of `element_bytes` (2 or 4).
void move_channels(const void* in, void* out, int64_t images, int64_t channels,
                   int64_t positions, size_t element_bytes, bool to_last);

}  // namespace mxamp

#endif  // MXAMP_MOVE_CHANNELS_H_
