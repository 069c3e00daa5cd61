// FP32 master weights following their bfloat16 weights, in one pass (see master_weights.cc).
//
// Owns the arithmetic of mxamp.optimizer.follow_weight: wherever a bfloat16 weight no longer
// holds its FP32 master copy rounded to nearest even, the master restarts from the weight.
// Knows nothing of MXNet: mxnet_extension.cc registers it as "_mxamp_follow_weight".
#ifndef MXAMP_MASTER_WEIGHTS_H_
#define MXAMP_MASTER_WEIGHTS_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mxamp {

// `master[i]` (float32) becomes the value of `weight[i]` (bfloat16 bits) wherever `weight[i]`
// differs, as a float, from `master[i]` rounded to bfloat16 (nearest, ties to even; a denormal
// master also matches a zero weight, its flushed rounding); elsewhere it keeps its value.  `out` may be `master` (in place: only the restarted elements are written).
void follow_bfloat16_weight(const float* master, const uint16_t* weight, float* out,
                            size_t count);

// `value` rounded to bfloat16 (nearest, ties to even; NaN stays NaN), as oneDNN rounds.  Inline,
// so that loops calling it vectorise.
inline uint16_t round_to_bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t ties_to_even = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + ties_to_even) >> 16);
}

}  // namespace mxamp

#endif  // MXAMP_MASTER_WEIGHTS_H_
