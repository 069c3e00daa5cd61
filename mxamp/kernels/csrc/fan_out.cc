// One array read by several operators, as one operator (see fan_out.h).
#include "fan_out.h"

#include <algorithm>
#include <cstring>

#include "master_weights.h"
#include "vector_isa.h"

namespace mxamp {
namespace {

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

// The sums run AVX-512 code where the CPU has it (vector_isa.h): on data in the cache the
// bfloat16 ones are bound by arithmetic (a masked sum of two 12.8M-value arrays: 2.6-2.9 ms with
// AVX-512 against 4.8-5.0 ms, Xeon with AMX, 2 threads).

// out[i] = sum of inputs[k][i] over k < count (float32, or bfloat16 bits summed in float32 and
// rounded once), kept where `mask` (same type) is positive when kMasked, for i in [begin, end).
// Each input read unconditionally: a read inside a choice keeps GCC's loop branching.
template <bool kMasked>
MXAMP_LOOP_BODY void sum_float32(const float* const* inputs, int count, const float* mask,
                                 float* out, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float total = inputs[0][i];
    for (int k = 1; k < count; ++k) total += inputs[k][i];
    out[i] = !kMasked || mask[i] > 0.0f ? total : 0.0f;
  }
}

template <bool kMasked>
MXAMP_LOOP_BODY void sum_bfloat16(const uint16_t* const* inputs, int count, const uint16_t* mask,
                                  uint16_t* out, int64_t begin, int64_t end) {
  // One and two inputs (a residual block's input: its body and its shortcut) are the common
  // cases, with loops of their own: the general one does not vectorise.
  if (count == 1) {
    const uint16_t* in = inputs[0];
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const uint16_t value = in[i];
      out[i] = !kMasked || widen_bfloat16(mask[i]) > 0.0f ? value : uint16_t(0);
    }
  } else if (count == 2) {
    const uint16_t* a = inputs[0];
    const uint16_t* b = inputs[1];
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const uint16_t total = round_to_bfloat16(widen_bfloat16(a[i]) + widen_bfloat16(b[i]));
      out[i] = !kMasked || widen_bfloat16(mask[i]) > 0.0f ? total : uint16_t(0);
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      float total = widen_bfloat16(inputs[0][i]);
      for (int k = 1; k < count; ++k) total += widen_bfloat16(inputs[k][i]);
      const uint16_t rounded = round_to_bfloat16(total);
      out[i] = !kMasked || widen_bfloat16(mask[i]) > 0.0f ? rounded : uint16_t(0);
    }
  }
}

template <bool kMasked>
MXAMP_LOOP_BODY void sum_typed(const void* const* inputs, int count, const void* mask, void* out,
                               bool bfloat16, int64_t begin, int64_t end) {
  if (bfloat16) {
    sum_bfloat16<kMasked>(reinterpret_cast<const uint16_t* const*>(inputs), count,
                          static_cast<const uint16_t*>(mask), static_cast<uint16_t*>(out),
                          begin, end);
  } else {
    sum_float32<kMasked>(reinterpret_cast<const float* const*>(inputs), count,
                         static_cast<const float*>(mask), static_cast<float*>(out), begin, end);
  }
}

template <bool kMasked>
MXAMP_AVX512 void sum_chunk_avx512(const void* const* inputs, int count, const void* mask,
                                   void* out, bool bfloat16, int64_t begin, int64_t end) {
  sum_typed<kMasked>(inputs, count, mask, out, bfloat16, begin, end);
}

template <bool kMasked>
MXAMP_ANY_X86 void sum_chunk(const void* const* inputs, int count, const void* mask, void* out,
                             bool bfloat16, int64_t begin, int64_t end) {
  sum_typed<kMasked>(inputs, count, mask, out, bfloat16, begin, end);
}

template <bool kMasked>
void sum_any(const void* const* inputs, int count, const void* mask, void* out, size_t size,
             bool bfloat16) {
  const bool wide = has_avx512();
  for_chunks(static_cast<int64_t>(size), [&](int64_t begin, int64_t end) {
    if (wide) {
      sum_chunk_avx512<kMasked>(inputs, count, mask, out, bfloat16, begin, end);
    } else {
      sum_chunk<kMasked>(inputs, count, mask, out, bfloat16, begin, end);
    }
  });
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
