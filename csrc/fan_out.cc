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

// The sums are compiled twice, for any x86-64 CPU and for AVX-512 (which every CPU that computes
// bfloat16 has), and run on whichever this CPU can: on data in the cache the bfloat16 ones
// are bound by arithmetic, not memory (a masked sum of two 12.8M-value arrays: 2.6-3.0 ms with
// AVX-512 against 4.8-5.3 ms, Xeon with AMX, 2 threads).  GCC 12's target_clones cannot name
// ISA extensions, only CPU models; so one body, inlined into a wrapper per instruction set,
// called per chunk from one OpenMP loop (an OpenMP region of its own in each wrapper would be
// compiled for any CPU).
#define MXAMP_LOOP_BODY __attribute__((always_inline, optimize("O3"))) inline
#define MXAMP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), optimize("O3")))

constexpr int64_t kChunk = 1 << 14;  // values per call of a loop

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
__attribute__((optimize("O3"))) void sum_chunk(const void* const* inputs, int count,
                                               const void* mask, void* out, bool bfloat16,
                                               int64_t begin, int64_t end) {
  sum_typed<kMasked>(inputs, count, mask, out, bfloat16, begin, end);
}

bool has_avx512() {
  // libgcc's check includes the operating system's support for the AVX-512 registers.
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

template <bool kMasked>
void sum_any(const void* const* inputs, int count, const void* mask, void* out, size_t size,
             bool bfloat16) {
  const int64_t n = static_cast<int64_t>(size);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const bool wide = has_avx512();
#pragma omp parallel for if (n >= kParallelFrom) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
    if (wide) {
      sum_chunk_avx512<kMasked>(inputs, count, mask, out, bfloat16, begin, end);
    } else {
      sum_chunk<kMasked>(inputs, count, mask, out, bfloat16, begin, end);
    }
  }
}

#undef MXAMP_LOOP_BODY
#undef MXAMP_AVX512

}  // namespace

void sum_arrays(const void* const* inputs, int count, void* out, size_t size, bool bfloat16) {
  sum_any<false>(inputs, count, nullptr, out, size, bfloat16);
}

void sum_arrays_where_positive(const void* const* inputs, int count, const void* relu_output,
                               void* out, size_t size, bool bfloat16) {
  sum_any<true>(inputs, count, relu_output, out, size, bfloat16);
}

}  // namespace mxamp
