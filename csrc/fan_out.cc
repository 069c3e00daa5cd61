// One array read by several operators, as one operator (see fan_out.h).
#include "fan_out.h"

#include <algorithm>
#include <cstring>

#include "master_weights.h"

namespace mxamp {
namespace {

// Threads only where each gets a few hundred kilobytes: below that, starting them costs more.
constexpr int64_t kParallelFrom = 1 << 16;
constexpr int64_t kCopyChunk = 1 << 18;  // bytes per copied chunk

}  // namespace

void copy_bytes(const void* source, void* target, size_t bytes) {
  const char* from = static_cast<const char*>(source);
  char* to = static_cast<char*>(target);
  const int64_t chunks = (static_cast<int64_t>(bytes) + kCopyChunk - 1) / kCopyChunk;
#pragma omp parallel for if (chunks > 1) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const size_t begin = static_cast<size_t>(c * kCopyChunk);
    std::memcpy(to + begin, from + begin, std::min(bytes - begin, static_cast<size_t>(kCopyChunk)));
  }
}

namespace {

// O3 here only (the rest of the library keeps -O2), so that the compiler vectorises the loops.
// Each sum is kept where `mask` (a ReLU's output, same type) is positive, or everywhere when
// `mask` is null; a template per case keeps the loops branch-free.
template <bool kMasked>
__attribute__((optimize("O3"))) void sum_float32(const float* const* inputs, int count,
                                                 const float* mask, float* out, size_t size) {
  const int64_t n = static_cast<int64_t>(size);
#pragma omp parallel for simd if (n >= kParallelFrom) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float total = inputs[0][i];
    for (int k = 1; k < count; ++k) total += inputs[k][i];
    out[i] = !kMasked || mask[i] > 0.0f ? total : 0.0f;
  }
}

// Two inputs (a residual block's input: its body and its shortcut) are the common case, with a
// loop of its own: the general one does not vectorise.
template <bool kMasked>
__attribute__((optimize("O3"))) void sum_two_bfloat16(const uint16_t* a, const uint16_t* b,
                                                      const uint16_t* mask, uint16_t* out,
                                                      int64_t n) {
#pragma omp parallel for simd if (n >= kParallelFrom) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t total = round_to_bfloat16(widen_bfloat16(a[i]) + widen_bfloat16(b[i]));
    out[i] = !kMasked || widen_bfloat16(mask[i]) > 0.0f ? total : uint16_t(0);
  }
}

// One input: the mask alone (a ReLU's gradient), a copy without it.
template <bool kMasked>
__attribute__((optimize("O3"))) void mask_bfloat16(const uint16_t* in, const uint16_t* mask,
                                                   uint16_t* out, int64_t n) {
#pragma omp parallel for simd if (n >= kParallelFrom) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t value = in[i];  // read unconditionally, or the loop keeps its branch
    out[i] = !kMasked || widen_bfloat16(mask[i]) > 0.0f ? value : uint16_t(0);
  }
}

template <bool kMasked>
__attribute__((optimize("O3"))) void sum_bfloat16(const uint16_t* const* inputs, int count,
                                                  const uint16_t* mask, uint16_t* out,
                                                  size_t size) {
  const int64_t n = static_cast<int64_t>(size);
  if (count == 1) return mask_bfloat16<kMasked>(inputs[0], mask, out, n);
  if (count == 2) return sum_two_bfloat16<kMasked>(inputs[0], inputs[1], mask, out, n);
#pragma omp parallel for if (n >= kParallelFrom) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float total = widen_bfloat16(inputs[0][i]);
    for (int k = 1; k < count; ++k) total += widen_bfloat16(inputs[k][i]);
    out[i] = !kMasked || widen_bfloat16(mask[i]) > 0.0f ? round_to_bfloat16(total) : uint16_t(0);
  }
}

template <bool kMasked>
void sum_any(const void* const* inputs, int count, const void* mask, void* out, size_t size,
             bool bfloat16) {
  if (bfloat16) {
    sum_bfloat16<kMasked>(reinterpret_cast<const uint16_t* const*>(inputs), count,
                          static_cast<const uint16_t*>(mask), static_cast<uint16_t*>(out), size);
  } else {
    sum_float32<kMasked>(reinterpret_cast<const float* const*>(inputs), count,
                         static_cast<const float*>(mask), static_cast<float*>(out), size);
  }
}

}  // namespace

void sum_arrays(const void* const* inputs, int count, void* out, size_t size, bool bfloat16) {
  sum_any<false>(inputs, count, nullptr, out, size, bfloat16);
}

void sum_arrays_where_positive(const void* const* inputs, int count, const void* relu_output,
                               void* out, size_t size, bool bfloat16) {
  sum_any<true>(inputs, count, relu_output, out, size, bfloat16);
}

}  // namespace mxamp
