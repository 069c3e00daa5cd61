// Elementwise loops compiled twice, for any x86-64 CPU and for AVX-512, run on what the CPU has.
//
// Owns that choice for mxamp's own elementwise and row-wise kernels (fan_out.cc,
// master_weights.cc, clip.cc, dropout.cc, bfloat16_batch_norm.cc, masked_softmax.cc).  Every CPU that computes bfloat16 has AVX-512 (avx512_core and up),
// and on data in the cache their bfloat16 loops are bound by arithmetic: compiled for any x86-64
// CPU (SSE2, 4 floats a vector) they take about twice as long.  GCC 12's target_clones cannot
// name ISA extensions, only CPU models, so a kernel is written as:
//
//   * a loop body over [begin, end), MXAMP_LOOP_BODY (always inlined, "#pragma omp simd"), with
//     no OpenMP region of its own (one would be compiled for any CPU);
//   * two wrappers calling it, one plain and one MXAMP_AVX512;
//   * for_chunks, calling the wrapper has_avx512() picks on each kChunk-value chunk (or
//     for_row_chunks, on chunks of whole rows, for a kernel that works a row at a time).
//
// bfloat16_batch_norm.cc's loops have no plain twin: they are called only where has_avx512(),
// and oneDNN's kernels serve everywhere else.
#ifndef MXAMP_VECTOR_ISA_H_
#define MXAMP_VECTOR_ISA_H_

#include <cstdint>

// fp-contract=off: AVX-512F has fused multiply-adds, which GCC would otherwise contract a * b + c
// into (one rounding where MXNet's kernels round twice).
#define MXAMP_LOOP_BODY __attribute__((always_inline, optimize("O3", "fp-contract=off"))) inline
#define MXAMP_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), optimize("O3", "fp-contract=off")))
#define MXAMP_ANY_X86 __attribute__((optimize("O3", "fp-contract=off")))
// A helper written in AVX-512 intrinsics, inlined into MXAMP_AVX512 functions only
// (bfloat16_batch_norm.cc, whose loops are intrinsics, fused multiply-adds included).
#define MXAMP_AVX512_INLINE \
  __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq"))) inline

namespace mxamp {

// Values per call of a wrapper: small enough to share among threads, large enough that the
// call costs nothing.
constexpr int64_t kChunk = 1 << 14;

// Threads only where each gets a few hundred kilobytes: below that, starting them costs more.
constexpr int64_t kParallelFrom = 1 << 16;

// Whether this CPU and its operating system run AVX-512 (libgcc's check reads both).
inline bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

// chunk(begin, end) over [0, n), kChunk values at a time, on the calling thread's OpenMP team.
template <typename Chunk>
void for_chunks(int64_t n, const Chunk& chunk) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for if (n >= kParallelFrom) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk;
    chunk(begin, n - begin < kChunk ? n : begin + kChunk);
  }
}

// chunk(begin, end) over the rows [0, rows) of `columns` values each, about kChunk values (at
// least one row) at a time, on the calling thread's OpenMP team.
template <typename Chunk>
void for_row_chunks(int64_t rows, int64_t columns, const Chunk& chunk) {
  const int64_t per_chunk = columns >= kChunk ? 1 : kChunk / (columns > 0 ? columns : 1);
  const int64_t chunks = (rows + per_chunk - 1) / per_chunk;
#pragma omp parallel for if (rows * columns >= kParallelFrom) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * per_chunk;
    chunk(begin, rows - begin < per_chunk ? rows : begin + per_chunk);
  }
}

}  // namespace mxamp

#endif  // MXAMP_VECTOR_ISA_H_
