// An array clipped to [a_min, a_max], and its gradient (see clip.h).
#include "clip.h"

#include <cstdint>

#include "master_weights.h"
#include "vector_isa.h"

namespace mxamp {
namespace {

// Written as selects on every value (no branch), so that the loops vectorise; compared in
// float32, as MXNet compares a bfloat16 value with its float bounds.
MXAMP_LOOP_BODY void clip_float32(const float* in, float* out, float a_min, float a_max,
                                  int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float x = in[i];
    out[i] = x > a_max ? a_max : (x < a_min ? a_min : x);
  }
}

MXAMP_LOOP_BODY void clip_bfloat16(const uint16_t* in, uint16_t* out, float a_min, float a_max,
                                   int64_t begin, int64_t end) {
  const uint16_t low = round_to_bfloat16(a_min), high = round_to_bfloat16(a_max);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const uint16_t bits = in[i];
    const float x = widen_bfloat16(bits);
    out[i] = x > a_max ? high : (x < a_min ? low : bits);
  }
}

MXAMP_LOOP_BODY void gradient_float32(const float* grad, const float* data, float* out,
                                      float a_min, float a_max, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float x = data[i];
    out[i] = x < a_min || x > a_max ? 0.0f : grad[i];
  }
}

MXAMP_LOOP_BODY void gradient_bfloat16(const uint16_t* grad, const uint16_t* data, uint16_t* out,
                                       float a_min, float a_max, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float x = widen_bfloat16(data[i]);
    out[i] = x < a_min || x > a_max ? uint16_t(0) : grad[i];
  }
}

// One chunk of either pass: the gradient when `grad` is not null.
MXAMP_LOOP_BODY void clip_typed(const void* grad, const void* data, void* out, float a_min,
                                float a_max, bool bfloat16, int64_t begin, int64_t end) {
  if (bfloat16 && grad) {
    gradient_bfloat16(static_cast<const uint16_t*>(grad), static_cast<const uint16_t*>(data),
                      static_cast<uint16_t*>(out), a_min, a_max, begin, end);
  } else if (bfloat16) {
    clip_bfloat16(static_cast<const uint16_t*>(data), static_cast<uint16_t*>(out), a_min, a_max,
                  begin, end);
  } else if (grad) {
    gradient_float32(static_cast<const float*>(grad), static_cast<const float*>(data),
                     static_cast<float*>(out), a_min, a_max, begin, end);
  } else {
    clip_float32(static_cast<const float*>(data), static_cast<float*>(out), a_min, a_max, begin,
                 end);
  }
}

MXAMP_AVX512 void clip_chunk_avx512(const void* grad, const void* data, void* out, float a_min,
                                    float a_max, bool bfloat16, int64_t begin, int64_t end) {
  clip_typed(grad, data, out, a_min, a_max, bfloat16, begin, end);
}

MXAMP_ANY_X86 void clip_chunk(const void* grad, const void* data, void* out, float a_min,
                              float a_max, bool bfloat16, int64_t begin, int64_t end) {
  clip_typed(grad, data, out, a_min, a_max, bfloat16, begin, end);
}

void clip_any(const void* grad, const void* data, void* out, size_t size, float a_min,
              float a_max, bool bfloat16) {
  const bool wide = has_avx512();
  for_chunks(static_cast<int64_t>(size), [&](int64_t begin, int64_t end) {
    if (wide) {
      clip_chunk_avx512(grad, data, out, a_min, a_max, bfloat16, begin, end);
    } else {
      clip_chunk(grad, data, out, a_min, a_max, bfloat16, begin, end);
    }
  });
}

}  // namespace

void clip_values(const void* in, void* out, size_t size, float a_min, float a_max,
                 bool bfloat16) {
  clip_any(nullptr, in, out, size, a_min, a_max, bfloat16);
}

void clip_gradient(const void* grad, const void* data, void* out, size_t size, float a_min,
                   float a_max, bool bfloat16) {
  clip_any(grad, data, out, size, a_min, a_max, bfloat16);
}

}  // namespace mxamp
