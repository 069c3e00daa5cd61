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
// master also matches a zero weight, its flushed rounding); elsewhere it keeps its value.
// `out` may be `master` (in place).
void follow_bfloat16_weight(const float* master, const uint16_t* weight, float* out,
                            size_t count);

// One step of MXNet's SGD on the FP32 master copy of a bfloat16 weight, in one pass: the
// arithmetic of multi_sgd_mom_update (multi_sgd_update without momentum) in float32 on the
// master, after follow_bfloat16_weight's (when `follow`), with the gradient widened from
// bfloat16, and the weight written as amp_cast writes it.  mxamp's generic path does the same
// in four MXNet passes (widen the gradient, follow, update, narrow the master).
struct SgdStep {
  float lr = 0.0f;
  float wd = 0.0f;
  float momentum = 0.0f;       // 0: no momentum array
  float rescale_grad = 1.0f;
  float clip_gradient = -1.0f;  // negative: no clipping
  bool follow = true;
};

// `momentum` may be null (step.momentum 0); `master` and `momentum` are updated in place and
// `new_weight` receives the master rounded to bfloat16.
void sgd_step_bfloat16(const SgdStep& step, const uint16_t* weight, const uint16_t* grad,
                       float* master, float* momentum, uint16_t* new_weight, size_t count);

// One step of MXNet's Adam on the FP32 master copy of a bfloat16 weight, in one pass: the
// arithmetic of adam_update in float32 on the master (its mean and variance float32), after
// follow_bfloat16_weight's (when `follow`), with the gradient widened from bfloat16, and the
// weight written as amp_cast writes it.  `lr` is the step's, bias correction included (as
// mx.optimizer.Adam gives adam_update).  mxamp's generic path does the same in four MXNet
// passes; this one reads 18 bytes per value and writes 14, FP32 Adam's 16 and 12.
struct AdamStep {
  float lr = 0.0f;
  float wd = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float epsilon = 1e-8f;
  float rescale_grad = 1.0f;
  float clip_gradient = -1.0f;  // negative: no clipping
  bool follow = true;
};

// `master`, `mean` and `variance` are updated in place and `new_weight` receives the master
// rounded to bfloat16.
void adam_step_bfloat16(const AdamStep& step, const uint16_t* weight, const uint16_t* grad,
                        float* master, float* mean, float* variance, uint16_t* new_weight,
                        size_t count);

// `bits` (bfloat16) as a float32: exact.  Inline, so that loops calling it vectorise.
inline float widen_bfloat16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

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
