// FP32 master weights following their bfloat16 weights, in one pass (see master_weights.cc).
//
// Owns the arithmetic of mxamp.optimizer.follow_weight: wherever a bfloat16 weight no longer
// holds its FP32 master copy rounded to nearest even, the master restarts from the weight.
// Knows nothing of MXNet: mxnet_extension.cc registers it as "_mxamp_follow_weight".
#ifndef MXAMP_MASTER_WEIGHTS_H_
#define MXAMP_MASTER_WEIGHTS_H_

#include <cstddef>
#include <cstdint>

namespace mxamp {

// `master[i]` (float32) becomes the value of `weight[i]` (bfloat16 bits) wherever `weight[i]`
// differs, as a float, from `master[i]` rounded to bfloat16 (nearest, ties to even; a denormal
// master also matches a zero weight, its flushed rounding); elsewhere it keeps its value.  `out` may be `master` (in place: only the restarted elements are written).
void follow_bfloat16_weight(const float* master, const uint16_t* weight, float* out,
                            size_t count);

// `value` rounded to bfloat16 (nearest, ties to even; NaN stays NaN), as oneDNN rounds.
uint16_t round_to_bfloat16(float value);

}  // namespace mxamp

#endif  // MXAMP_MASTER_WEIGHTS_H_
