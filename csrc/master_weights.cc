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

}  // namespace

// Branch-free, so that the compiler vectorises it (O3 here only: the rest of the library keeps
// -O2); in place it writes every element back, which costs less than a branch per element.
__attribute__((optimize("O3"))) void follow_bfloat16_weight(const float* master,
                                                            const uint16_t* weight, float* out,
                                                            size_t count) {
  const uint32_t* master_bits = reinterpret_cast<const uint32_t*>(master);
  // Threads only where each gets a few hundred kilobytes: below that, starting them costs more.
  const int64_t n = static_cast<int64_t>(count);
#pragma omp parallel for simd if (n >= kParallelFrom) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = master_bits[i];
    const uint32_t rounded =
        (bits & 0x7fffffffu) > 0x7f800000u ? ((bits >> 16) | 0x0040u) << 16
                                           : ((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16) << 16;
    const uint32_t seen_bits = static_cast<uint32_t>(weight[i]) << 16;
    float written, seen, value = master[i];
    std::memcpy(&written, &rounded, sizeof written);
    std::memcpy(&seen, &seen_bits, sizeof seen);
    // Compared as floats, as MXNet's comparison did: -0 equals +0, NaN equals nothing.  A
    // denormal master also matches a zero weight: the AVX512-BF16 instruction oneDNN's casts
    // use (vcvtneps2bf16) flushes denormals to zero.
    const bool kept = written == seen || (seen == 0.0f && std::fabs(value) < kSmallestNormal);
    out[i] = kept ? value : seen;
  }
}

}  // namespace mxamp
