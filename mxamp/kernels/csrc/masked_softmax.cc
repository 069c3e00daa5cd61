// Softmax over the last axis with a length per row, and its gradient (see masked_softmax.h).
//
// MXNet's formula, operation for operation in float32 (MXNet's accumulation type for float32
// data unless MXNET_SAFE_ACCUMULATION is set), but summed in vector lanes rather than left to
// right, and with an exp of its own: GCC vectorises std::exp only under -ffast-math (glibc's
// vector variants are declared for it alone).
#include "masked_softmax.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "vector_isa.h"

namespace mxamp {
namespace {

// exp(x) for x <= 0 (the softmax's values less their maximum) as Cephes' expf (S. Moshier)
// computes it, written to vectorise: x = n ln 2 + r with n an integer and |r| <= ln 2 / 2 (ln 2
// in two parts, Cody and Waite's, the first exact times any n here), exp(r) by a degree-7
// polynomial, then times 2^n.  Within 1 unit in the last place of exp for every float32 from
// -104 to 0, subnormal results included (checked against exp in double over all of them); 0
// below -104, where float32's exp rounds to 0, and at -infinity; NaN for NaN.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;
// 1.5 * 2^23: y + kRounder is y rounded to an integer, for |y| < 2^22, held in its low
// significand bits, and minus kRounder that integer as a float (the loops are compiled without
// fp-contract and without reassociation, so it is not folded).
constexpr float kRounder = 12582912.0f;
constexpr int32_t kRounderBits = 0x4b400000;
constexpr float kZeroBelow = -104.0f;

// 2^n, for -126 <= n <= 127.
MXAMP_LOOP_BODY float power_of_two(int32_t n) {
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// max(x, -104), NaN kept: exp(-104) computes to 0, as float32's exp rounds there.  A blend of
// bits: the same choice written `x < kZeroBelow ? kZeroBelow : x` becomes a branch that GCC
// then folds apart (the exp of the constant computed at compile time), and the plain twin's
// loop does not vectorise.
MXAMP_LOOP_BODY float at_least_zero_below(float x) {
  uint32_t bits, bound;
  std::memcpy(&bits, &x, sizeof bits);
  std::memcpy(&bound, &kZeroBelow, sizeof bound);
  const uint32_t below = 0u - static_cast<uint32_t>(x < kZeroBelow);
  const uint32_t chosen = (bound & below) | (bits & ~below);
  float value;
  std::memcpy(&value, &chosen, sizeof value);
  return value;
}

MXAMP_LOOP_BODY float exp_float32(float x) {
  const float a = at_least_zero_below(x);
  const float rounded = a * kLog2e + kRounder;
  const float n = rounded - kRounder;
  const float r = (a - n * kLn2High) - n * kLn2Low;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  // n read from the bits of `rounded`, not converted (a conversion of a NaN is undefined in
  // C++, and its guard kept GCC from vectorising the plain twin).  2^n in two factors, each a
  // normal number: a result below 2^-126 rounds once, to its subnormal.  (NaN: k is any number,
  // the product NaN.)
  int32_t k;
  std::memcpy(&k, &rounded, sizeof k);
  k -= kRounderBits;
  const int32_t half = k / 2;
  return e * power_of_two(half) * power_of_two(k - half);
}

// The row's length, within [0, columns].
template <typename Length>
MXAMP_LOOP_BODY int64_t valid_columns(const Length* length, int64_t row, int64_t columns) {
  const int64_t n = static_cast<int64_t>(length[row]);
  return n < 0 ? 0 : (n > columns ? columns : n);
}

template <typename Length>
MXAMP_LOOP_BODY void forward_rows(const float* data, const Length* length, float* output,
                                  int64_t columns, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const int64_t n = valid_columns(length, row, columns);
    const float* x = data + row * columns;
    float* y = output + row * columns;
    if (n > 0) {
      // A NaN among the values makes the sum, and so the whole row, NaN here as in MXNet,
      // whichever maximum it leaves.
      float largest = x[0];
#pragma omp simd reduction(max : largest)
      for (int64_t j = 1; j < n; ++j) largest = x[j] > largest ? x[j] : largest;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        const float e = exp_float32(x[j] - largest);
        y[j] = e;
        sum += e;
      }
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) y[j] = y[j] / sum;
    }
#pragma omp simd
    for (int64_t j = n; j < columns; ++j) y[j] = 0.0f;
  }
}

template <typename Length>
MXAMP_LOOP_BODY void backward_rows(const float* output_grad, const float* output,
                                   const Length* length, float* data_grad, int64_t columns,
                                   int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const int64_t n = valid_columns(length, row, columns);
    const float* dy = output_grad + row * columns;
    const float* y = output + row * columns;
    float* dx = data_grad + row * columns;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < n; ++j) dot += dy[j] * y[j];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) dx[j] = y[j] * (dy[j] - dot);
#pragma omp simd
    for (int64_t j = n; j < columns; ++j) dx[j] = 0.0f;
  }
}

// Rows [begin, end) of either pass: the gradient when `output_grad` is not null, `in` then
// being the forward output.
template <typename Length>
MXAMP_LOOP_BODY void rows_typed(const float* in, const float* output_grad, const Length* length,
                                float* out, int64_t columns, int64_t begin, int64_t end) {
  if (output_grad) {
    backward_rows(output_grad, in, length, out, columns, begin, end);
  } else {
    forward_rows(in, length, out, columns, begin, end);
  }
}

MXAMP_LOOP_BODY void rows_any(const float* in, const float* output_grad, const void* length,
                              bool wide_lengths, float* out, int64_t columns, int64_t begin,
                              int64_t end) {
  if (wide_lengths) {
    rows_typed(in, output_grad, static_cast<const int64_t*>(length), out, columns, begin, end);
  } else {
    rows_typed(in, output_grad, static_cast<const int32_t*>(length), out, columns, begin, end);
  }
}

MXAMP_AVX512 void rows_avx512(const float* in, const float* output_grad, const void* length,
                              bool wide_lengths, float* out, int64_t columns, int64_t begin,
                              int64_t end) {
  rows_any(in, output_grad, length, wide_lengths, out, columns, begin, end);
}

MXAMP_ANY_X86 void rows_plain(const float* in, const float* output_grad, const void* length,
                              bool wide_lengths, float* out, int64_t columns, int64_t begin,
                              int64_t end) {
  rows_any(in, output_grad, length, wide_lengths, out, columns, begin, end);
}

void run(const MaskedSoftmaxSpec& spec, const float* in, const float* output_grad,
         const void* length, float* out) {
  if (spec.length_flag != kFlagInt32 && spec.length_flag != kFlagInt64)
    throw std::invalid_argument("length type flag " + std::to_string(spec.length_flag) +
                                ": the lengths must be int32 or int64, as MXNet's softmax takes");
  if (spec.rows <= 0 || spec.columns <= 0) return;
  const bool wide = has_avx512();
  const bool wide_lengths = spec.length_flag == kFlagInt64;
  for_row_chunks(spec.rows, spec.columns, [&](int64_t begin, int64_t end) {
    if (wide) {
      rows_avx512(in, output_grad, length, wide_lengths, out, spec.columns, begin, end);
    } else {
      rows_plain(in, output_grad, length, wide_lengths, out, spec.columns, begin, end);
    }
  });
}

}  // namespace

void masked_softmax_forward(const MaskedSoftmaxSpec& spec, const float* data, const void* length,
                            float* output) {
  run(spec, data, nullptr, length, output);
}

void masked_softmax_backward(const MaskedSoftmaxSpec& spec, const float* output_grad,
                             const float* output, const void* length, float* data_grad) {
  run(spec, output, output_grad, length, data_grad);
}

}  // namespace mxamp
