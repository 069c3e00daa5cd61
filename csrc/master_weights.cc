// FP32 master weights following their bfloat16 weights (see master_weights.h).
//
// mxamp.optimizer.follow_weight did this with five MXNet elementwise passes (narrow the master,
// widen it back, widen the weight, compare, select): about 46 bytes of memory traffic per value.
// One vectorised pass, on the caller's OpenMP threads, reads 6 bytes per value and writes 4.
#include "master_weights.h"

#include <cmath>
#include <cstring>

namespace mxamp {
namespace {

constexpr float kSmallestNormal = 1.17549435e-38f;  // FLT_MIN
constexpr int64_t kParallelFrom = 1 << 16;

// `master`, or `weight` (bfloat16 bits) widened where it no longer holds `master` rounded.
// Branch-free and inline, so that the loops calling it vectorise.
inline float followed(float master, uint16_t weight) {
  uint32_t bits;
  std::memcpy(&bits, &master, sizeof bits);
  const uint32_t rounded =
      (bits & 0x7fffffffu) > 0x7f800000u ? ((bits >> 16) | 0x0040u) << 16
                                         : ((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16) << 16;
  const uint32_t seen_bits = static_cast<uint32_t>(weight) << 16;
  float written, seen;
  std::memcpy(&written, &rounded, sizeof written);
  std::memcpy(&seen, &seen_bits, sizeof seen);
  // Compared as floats, as MXNet's comparison did: -0 equals +0, NaN equals nothing.  A
  // denormal master also matches a zero weight: the AVX512-BF16 instruction oneDNN's casts
  // use (vcvtneps2bf16) flushes denormals to zero.
  const bool kept = written == seen || (seen == 0.0f && std::fabs(master) < kSmallestNormal);
  return kept ? master : seen;
}

}  // namespace

// Vectorised (O3 here only: the rest of the library keeps -O2); in place it writes every element
// back, which costs less than a branch per element.
__attribute__((optimize("O3"))) void follow_bfloat16_weight(const float* master,
                                                            const uint16_t* weight, float* out,
                                                            size_t count) {
  // Threads only where each gets a few hundred kilobytes: below that, starting them costs more.
  const int64_t n = static_cast<int64_t>(count);
#pragma omp parallel for simd if (n >= kParallelFrom) schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = followed(master[i], weight[i]);
}

// The same branch-free loop for the whole SGD step.  The update's expression is
// multi_sgd_mom_update's, operand for operand, so that float32 rounds it the same way (the
// library is built without -ffast-math and without FMA: no contraction either).
__attribute__((optimize("O3"))) void sgd_step_bfloat16(const SgdStep& step,
                                                      const uint16_t* weight,
                                                      const uint16_t* grad, float* master,
                                                      float* momentum, uint16_t* new_weight,
                                                      size_t count) {
  const float lr = step.lr, wd = step.wd, mu = step.momentum, rescale = step.rescale_grad,
              clip = step.clip_gradient;
  const bool follow = step.follow, clipped = clip >= 0.0f, has_momentum = momentum != nullptr;
  const int64_t n = static_cast<int64_t>(count);
#pragma omp parallel for simd if (n >= kParallelFrom) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float w = follow ? followed(master[i], weight[i]) : master[i];
    const uint32_t grad_bits = static_cast<uint32_t>(grad[i]) << 16;
    float g;
    std::memcpy(&g, &grad_bits, sizeof g);
    float mom = has_momentum ? momentum[i] : 0.0f;
    if (clipped) {
      float scaled = rescale * g;
      scaled = scaled > clip ? clip : (scaled < -clip ? -clip : scaled);
      mom = mu * mom - lr * wd * w - lr * scaled;
    } else {
      mom = mu * mom - lr * wd * w - lr * rescale * g;
    }
    if (has_momentum) momentum[i] = mom;
    w = w + mom;
    master[i] = w;
    // As amp_cast writes bfloat16 on CPUs that compute it (vcvtneps2bf16): nearest even,
    // denormals flushed to a zero of their sign.
    uint32_t w_bits;
    std::memcpy(&w_bits, &w, sizeof w_bits);
    const uint16_t narrowed = round_to_bfloat16(w);
    new_weight[i] = std::fabs(w) < kSmallestNormal ? static_cast<uint16_t>((w_bits >> 16) & 0x8000u)
                                                   : narrowed;
  }
}

}  // namespace mxamp
