// FP32 master weights following their bfloat16 weights (see master_weights.h).
//
// mxamp.optimizer.follow_weight did this with five MXNet elementwise passes (narrow the master,
// widen it back, widen the weight, compare, select): about 46 bytes of memory traffic per value.
// One vectorised pass, on the caller's OpenMP threads, reads 6 bytes per value and writes 4.
#include "master_weights.h"

#include <cmath>
#include <cstring>

#include "vector_isa.h"

namespace mxamp {
namespace {

constexpr float kSmallestNormal = 1.17549435e-38f;  // FLT_MIN

// `master`, or `weight` (bfloat16 bits) widened where it no longer holds `master` rounded.
// Branch-free and inline, so that the loops calling it vectorise.
inline float followed(float master, uint16_t weight) {
  uint32_t bits;
  std::memcpy(&bits, &master, sizeof bits);
  const uint32_t rounded =
      (bits & 0x7fffffffu) > 0x7f800000u ? ((bits >> 16) | 0x0040u) << 16
                                         : ((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16) << 16;
  const float seen = widen_bfloat16(weight);
  float written;
  std::memcpy(&written, &rounded, sizeof written);
  // Compared as floats, as MXNet's comparison did: -0 equals +0, NaN equals nothing.  A
  // denormal master also matches a zero weight: the AVX512-BF16 instruction oneDNN's casts
  // use (vcvtneps2bf16) flushes denormals to zero.
  const bool kept = written == seen || (seen == 0.0f && std::fabs(master) < kSmallestNormal);
  return kept ? master : seen;
}

MXAMP_LOOP_BODY void follow_range(const float* master, const uint16_t* weight, float* out,
                                  int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) out[i] = followed(master[i], weight[i]);
}

MXAMP_AVX512 void follow_chunk_avx512(const float* master, const uint16_t* weight, float* out,
                                      int64_t begin, int64_t end) {
  follow_range(master, weight, out, begin, end);
}

MXAMP_ANY_X86 void follow_chunk(const float* master, const uint16_t* weight, float* out,
                                int64_t begin, int64_t end) {
  follow_range(master, weight, out, begin, end);
}

}  // namespace

// Vectorised, with AVX-512 where the CPU has it (vector_isa.h); in place it writes every element
// back, which costs less than a branch per element.
void follow_bfloat16_weight(const float* master, const uint16_t* weight, float* out,
                            size_t count) {
  const bool wide = has_avx512();
  for_chunks(static_cast<int64_t>(count), [&](int64_t begin, int64_t end) {
    if (wide) {
      follow_chunk_avx512(master, weight, out, begin, end);
    } else {
      follow_chunk(master, weight, out, begin, end);
    }
  });
}

namespace {

// `value` narrowed as amp_cast narrows on CPUs that compute bfloat16 (vcvtneps2bf16): nearest
// even, NaN kept, denormals flushed to a zero of their sign.  round_to_bfloat16's arithmetic,
// written with selects only so that the loop calling it vectorises.
inline uint16_t narrow_as_amp_cast(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint32_t rounded = (bits & 0x7fffffffu) > 0x7f800000u
                               ? (bits >> 16) | 0x0040u
                               : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t flushed = (bits >> 16) & 0x8000u;
  return static_cast<uint16_t>(std::fabs(value) < kSmallestNormal ? flushed : rounded);
}

// The whole SGD step, one loop per combination of the step's switches, so that each loop is
// free of branches and vectorises.  The update's expression is multi_sgd_mom_update's, operand
// for operand, so that float32 rounds it the same way (the library is built without
// -ffast-math and without FMA: no contraction either).
template <bool kFollow, bool kClipped, bool kMomentum>
MXAMP_LOOP_BODY void sgd_step_range(const SgdStep& step, const uint16_t* weight,
                                    const uint16_t* grad, float* master, float* momentum,
                                    uint16_t* new_weight, int64_t begin, int64_t end) {
  const float lr = step.lr, wd = step.wd, mu = step.momentum, rescale = step.rescale_grad,
              clip = step.clip_gradient;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float w = kFollow ? followed(master[i], weight[i]) : master[i];
    const float g = widen_bfloat16(grad[i]);
    float mom = kMomentum ? momentum[i] : 0.0f;
    if (kClipped) {
      float scaled = rescale * g;
      scaled = scaled > clip ? clip : (scaled < -clip ? -clip : scaled);
      mom = mu * mom - lr * wd * w - lr * scaled;
    } else {
      mom = mu * mom - lr * wd * w - lr * rescale * g;
    }
    if (kMomentum) momentum[i] = mom;
    master[i] = w + mom;
    new_weight[i] = narrow_as_amp_cast(w + mom);
  }
}

template <bool kFollow, bool kClipped, bool kMomentum>
MXAMP_AVX512 void sgd_step_chunk_avx512(const SgdStep& step, const uint16_t* weight,
                                        const uint16_t* grad, float* master, float* momentum,
                                        uint16_t* new_weight, int64_t begin, int64_t end) {
  sgd_step_range<kFollow, kClipped, kMomentum>(step, weight, grad, master, momentum, new_weight,
                                               begin, end);
}

template <bool kFollow, bool kClipped, bool kMomentum>
MXAMP_ANY_X86 void sgd_step_chunk(const SgdStep& step, const uint16_t* weight,
                                  const uint16_t* grad, float* master, float* momentum,
                                  uint16_t* new_weight, int64_t begin, int64_t end) {
  sgd_step_range<kFollow, kClipped, kMomentum>(step, weight, grad, master, momentum, new_weight,
                                               begin, end);
}

template <bool kFollow, bool kClipped, bool kMomentum>
void sgd_step_loop(const SgdStep& step, const uint16_t* weight, const uint16_t* grad,
                   float* master, float* momentum, uint16_t* new_weight, int64_t n) {
  const bool wide = has_avx512();
  for_chunks(n, [&](int64_t begin, int64_t end) {
    if (wide) {
      sgd_step_chunk_avx512<kFollow, kClipped, kMomentum>(step, weight, grad, master, momentum,
                                                          new_weight, begin, end);
    } else {
      sgd_step_chunk<kFollow, kClipped, kMomentum>(step, weight, grad, master, momentum,
                                                   new_weight, begin, end);
    }
  });
}

}  // namespace

void sgd_step_bfloat16(const SgdStep& step, const uint16_t* weight, const uint16_t* grad,
                       float* master, float* momentum, uint16_t* new_weight, size_t count) {
  const int64_t n = static_cast<int64_t>(count);
  const bool clipped = step.clip_gradient >= 0.0f, with_momentum = momentum != nullptr;
  auto run = [&](auto loop) { loop(step, weight, grad, master, momentum, new_weight, n); };
  if (step.follow) {
    if (clipped) {
      with_momentum ? run(sgd_step_loop<true, true, true>) : run(sgd_step_loop<true, true, false>);
    } else {
      with_momentum ? run(sgd_step_loop<true, false, true>)
                    : run(sgd_step_loop<true, false, false>);
    }
  } else if (clipped) {
    with_momentum ? run(sgd_step_loop<false, true, true>) : run(sgd_step_loop<false, true, false>);
  } else {
    with_momentum ? run(sgd_step_loop<false, false, true>)
                  : run(sgd_step_loop<false, false, false>);
  }
}

namespace {

// adam_update's expression, operand for operand (see sgd_step_range).
template <bool kFollow, bool kClipped>
MXAMP_LOOP_BODY void adam_step_range(const AdamStep& step, const uint16_t* weight,
                                     const uint16_t* grad, float* master, float* mean,
                                     float* variance, uint16_t* new_weight, int64_t begin,
                                     int64_t end) {
  const float lr = step.lr, wd = step.wd, beta1 = step.beta1, beta2 = step.beta2,
              epsilon = step.epsilon, rescale = step.rescale_grad, clip = step.clip_gradient;
  const float keep1 = 1.f - beta1, keep2 = 1.f - beta2;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float w = kFollow ? followed(master[i], weight[i]) : master[i];
    float g = widen_bfloat16(grad[i]) * rescale + w * wd;
    if (kClipped) g = g > clip ? clip : (g < -clip ? -clip : g);
    const float m = beta1 * mean[i] + keep1 * g;
    const float v = beta2 * variance[i] + keep2 * g * g;
    mean[i] = m;
    variance[i] = v;
    const float updated = w - lr * m / (std::sqrt(v) + epsilon);
    master[i] = updated;
    new_weight[i] = narrow_as_amp_cast(updated);
  }
}

template <bool kFollow, bool kClipped>
MXAMP_AVX512 void adam_step_chunk_avx512(const AdamStep& step, const uint16_t* weight,
                                         const uint16_t* grad, float* master, float* mean,
                                         float* variance, uint16_t* new_weight, int64_t begin,
                                         int64_t end) {
  adam_step_range<kFollow, kClipped>(step, weight, grad, master, mean, variance, new_weight,
                                     begin, end);
}

template <bool kFollow, bool kClipped>
MXAMP_ANY_X86 void adam_step_chunk(const AdamStep& step, const uint16_t* weight,
                                   const uint16_t* grad, float* master, float* mean,
                                   float* variance, uint16_t* new_weight, int64_t begin,
                                   int64_t end) {
  adam_step_range<kFollow, kClipped>(step, weight, grad, master, mean, variance, new_weight,
                                     begin, end);
}

template <bool kFollow, bool kClipped>
void adam_step_loop(const AdamStep& step, const uint16_t* weight, const uint16_t* grad,
                    float* master, float* mean, float* variance, uint16_t* new_weight,
                    int64_t n) {
  const bool wide = has_avx512();
  for_chunks(n, [&](int64_t begin, int64_t end) {
    if (wide) {
      adam_step_chunk_avx512<kFollow, kClipped>(step, weight, grad, master, mean, variance,
                                                new_weight, begin, end);
    } else {
      adam_step_chunk<kFollow, kClipped>(step, weight, grad, master, mean, variance, new_weight,
                                         begin, end);
    }
  });
}

}  // namespace

void adam_step_bfloat16(const AdamStep& step, const uint16_t* weight, const uint16_t* grad,
                        float* master, float* mean, float* variance, uint16_t* new_weight,
                        size_t count) {
  const int64_t n = static_cast<int64_t>(count);
  auto run = [&](auto loop) { loop(step, weight, grad, master, mean, variance, new_weight, n); };
  if (step.follow) {
    step.clip_gradient >= 0.0f ? run(adam_step_loop<true, true>) : run(adam_step_loop<true, false>);
  } else {
    step.clip_gradient >= 0.0f ? run(adam_step_loop<false, true>)
                               : run(adam_step_loop<false, false>);
  }
}

}  // namespace mxamp
