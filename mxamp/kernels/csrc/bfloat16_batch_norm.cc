// Training-mode batch normalisation of bfloat16 channels-last data (see bfloat16_batch_norm.h).
//
// Each pass splits the rows into one contiguous range per thread, the same ranges in every pass,
// so that a thread finds in its cache what it read in the pass before.  Each range is read in
// chunks of kChunkBytes, which stay in the core's cache while they are read again:
//
//   * the forward's statistics read the data once from memory: per chunk, the mean, then the
//     squares of the deviations from it (a second read, from the cache), merged into the running
//     count, mean and sum of squares in double (Chan, Golub and LeVeque's pairwise update).  As
//     accurate as two passes over the whole batch, at the cost of one;
//   * per-channel sums run in float32 registers, up to 16 vectors of 16 channels at a time, over
//     one chunk, then join a double: float32 holds the rounding of a chunk's additions only.
//
// Written in AVX-512 intrinsics: a block of channels summed in registers is what a compiler does
// not make of a loop over a row's channels, whose sums stay in memory (3.5 ms against 0.95 for
// both statistics of 16x56x56x256 values, 2 threads, Xeon with AMX).
#include "bfloat16_batch_norm.h"

// GCC 12's AVX-512 intrinsics initialise their undefined operands from themselves, which its
// -Wmaybe-uninitialized reports at every inlined use (GCC bug 105593, fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vector_isa.h"

namespace mxamp {
namespace {

// A chunk: 64 KB of data, or 64 rows where those hold more (256 KB at 2048 channels), so that
// the per-chunk work on each channel costs little beside the rows'.  The fewer rows a float32 sum
// takes, the less it rounds: over 2048 rows the variance of values 125 standard deviations
// from 0 lost 2.4e-5 of itself, over 512 rows 4e-6.
constexpr int64_t kChunkBytes = 1 << 16;
constexpr int64_t kChunkMinRows = 64;

int64_t chunk_rows(int64_t channels) {
  return std::max(kChunkMinRows,
                  kChunkBytes / (channels * static_cast<int64_t>(sizeof(uint16_t))));
}

int64_t vectors_per_row(int64_t channels) { return (channels + 15) / 16; }

// The lanes of the vector starting at `channel` that hold channels of the row.
__mmask16 lanes(int64_t channels, int64_t channel) {
  const int64_t left = channels - channel;
  return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
}

MXAMP_AVX512_INLINE __m512 load(const uint16_t* p, __mmask16 lanes) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Rounded to bfloat16 as round_to_bfloat16 (master_weights.h) rounds: nearest, ties to even, NaN
// kept NaN.
MXAMP_AVX512_INLINE __m256i to_bfloat16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16),
                                 _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(rounded);
}

// What a reduction sums per channel: the data; the squares of its deviations from the mean; or
// the gradient (first) and the gradient times the deviation (second).
enum class Sum { kData, kSquaredDeviation, kGradient };

struct Reduction {
  const uint16_t* data;
  const float* mean;       // kSquaredDeviation, kGradient
  const uint16_t* grad;    // kGradient
  const uint16_t* mask;    // kGradient: null, or the ReLU mask
  int64_t channels;
};

// Adds `rows` values of mean `part_mean` whose squared deviations from it sum to `part_squares`
// to `count` values of mean `mean` and squared deviations `squares` (Chan, Golub and LeVeque).
inline void merge_moments(int64_t count, double& mean, double& squares, int64_t rows,
                          double part_mean, double part_squares) {
  const double total = static_cast<double>(count + rows);
  const double delta = part_mean - mean;
  mean += delta * static_cast<double>(rows) / total;
  squares += part_squares + delta * delta * static_cast<double>(count) * rows / total;
}

// Sums over rows [begin, end) of the kVectors vectors from channel `first_channel`, in float32,
// into first[c] (and second[c]).
template <Sum kSum, int kVectors>
MXAMP_AVX512_INLINE void sum_block(const Reduction& r, int64_t first_channel, int64_t begin,
                                   int64_t end, float* first, float* second) {
  const int64_t channels = r.channels, row_vectors = vectors_per_row(channels);
  __mmask16 in_row[kVectors];
  __m512 mean[kVectors], sum1[kVectors], sum2[kVectors];
  for (int k = 0; k < kVectors; ++k) {
    in_row[k] = lanes(channels, first_channel + 16 * k);
    mean[k] = kSum == Sum::kData
                  ? _mm512_setzero_ps()
                  : _mm512_maskz_loadu_ps(in_row[k], r.mean + first_channel + 16 * k);
    sum1[k] = sum2[k] = _mm512_setzero_ps();
  }
  for (int64_t row = begin; row < end; ++row) {
    const int64_t at = row * channels + first_channel;
#pragma GCC unroll 16
    for (int k = 0; k < kVectors; ++k) {
      const __m512 x = load(r.data + at + 16 * k, in_row[k]);
      if (kSum == Sum::kData) {
        sum1[k] = _mm512_add_ps(sum1[k], x);
      } else if (kSum == Sum::kSquaredDeviation) {
        const __m512 d = _mm512_sub_ps(x, mean[k]);
        sum1[k] = _mm512_fmadd_ps(d, d, sum1[k]);
      } else {
        __mmask16 taken = in_row[k];
        if (r.mask != nullptr) taken &= r.mask[row * row_vectors + first_channel / 16 + k];
        const __m512 g = load(r.grad + at + 16 * k, taken);
        sum1[k] = _mm512_add_ps(sum1[k], g);
        sum2[k] = _mm512_fmadd_ps(g, _mm512_sub_ps(x, mean[k]), sum2[k]);
      }
    }
  }
  for (int k = 0; k < kVectors; ++k) {
    _mm512_mask_storeu_ps(first + first_channel + 16 * k, in_row[k], sum1[k]);
    if (kSum == Sum::kGradient)
      _mm512_mask_storeu_ps(second + first_channel + 16 * k, in_row[k], sum2[k]);
  }
}

// sum_block on a block of `vectors` vectors, at most kVectors: the registers a kind of sum may
// take (two sums and the mean per vector for the gradient's, 3 x 8 of AVX-512's 32).
template <Sum kSum, int kVectors>
struct Block {
  MXAMP_AVX512_INLINE static void sum(int64_t vectors, const Reduction& r, int64_t first_channel,
                                      int64_t begin, int64_t end, float* first, float* second) {
    if (vectors == kVectors) {
      sum_block<kSum, kVectors>(r, first_channel, begin, end, first, second);
    } else {
      Block<kSum, kVectors - 1>::sum(vectors, r, first_channel, begin, end, first, second);
    }
  }
};

template <Sum kSum>
struct Block<kSum, 0> {
  MXAMP_AVX512_INLINE static void sum(int64_t, const Reduction&, int64_t, int64_t, int64_t, float*,
                                      float*) {}
};

// Per-channel sums over rows [begin, end) (one chunk), in float32, into first (and second).
template <Sum kSum>
MXAMP_AVX512_INLINE void sum_chunk(const Reduction& r, int64_t begin, int64_t end, float* first,
                                   float* second) {
  constexpr int kVectors = kSum == Sum::kGradient ? 8 : 16;
  const int64_t row_vectors = vectors_per_row(r.channels);
  for (int64_t v = 0; v < row_vectors; v += kVectors) {
    Block<kSum, kVectors>::sum(std::min<int64_t>(kVectors, row_vectors - v), r, 16 * v, begin, end,
                               first, second);
  }
}

// Count, mean and sum of squared deviations per channel of rows [begin, end), chunk by chunk,
// into mean and squares (doubles, `channels` each); `chunk` holds 2 x channels floats.
MXAMP_AVX512 int64_t moments_of_rows(const uint16_t* data, int64_t channels, int64_t begin,
                                     int64_t end, float* chunk, double* mean, double* squares) {
  float* chunk_mean = chunk;
  float* chunk_squares = chunk + channels;
  const int64_t step = chunk_rows(channels);
  int64_t count = 0;
  for (int64_t start = begin; start < end; start += step) {
    const int64_t stop = std::min(end, start + step), rows = stop - start;
    sum_chunk<Sum::kData>({data, nullptr, nullptr, nullptr, channels}, start, stop, chunk_mean,
                          nullptr);
    for (int64_t c = 0; c < channels; ++c) chunk_mean[c] /= static_cast<float>(rows);
    sum_chunk<Sum::kSquaredDeviation>({data, chunk_mean, nullptr, nullptr, channels}, start, stop,
                                      chunk_squares, nullptr);
    for (int64_t c = 0; c < channels; ++c)
      merge_moments(count, mean[c], squares[c], rows, chunk_mean[c], chunk_squares[c]);
    count += rows;
  }
  return count;
}

// Per-channel sums of rows [begin, end), chunk by chunk, added to first (and, for the gradient,
// second): doubles, `channels` each; `chunk` holds 2 x channels floats.
template <Sum kSum>
MXAMP_AVX512 void sums_of_rows(const Reduction& r, int64_t begin, int64_t end, float* chunk,
                               double* first, double* second) {
  const int64_t channels = r.channels, step = chunk_rows(channels);
  for (int64_t start = begin; start < end; start += step) {
    sum_chunk<kSum>(r, start, std::min(end, start + step), chunk, chunk + channels);
    for (int64_t c = 0; c < channels; ++c) {
      first[c] += chunk[c];
      if (kSum == Sum::kGradient) second[c] += chunk[channels + c];
    }
  }
}

// rows(thread, begin, end) on each thread of the calling thread's OpenMP team (one thread below
// kParallelFrom values), with its range of rows: the same ranges in every pass.
template <typename Rows>
void on_thread_rows(const ChannelRows& shape, const Rows& rows) {
#pragma omp parallel if (shape.rows * shape.channels >= kParallelFrom)
  {
    const int64_t thread = omp_get_thread_num(), threads = omp_get_num_threads();
    rows(static_cast<int>(thread), shape.rows * thread / threads,
         shape.rows * (thread + 1) / threads);
  }
}

// The batch's mean and biased variance per channel, into mean and variance.
void batch_moments(const ChannelRows& shape, const uint16_t* data, float* mean, float* variance) {
  const int64_t channels = shape.channels;
  const int most = omp_get_max_threads();
  std::vector<double> moments(static_cast<size_t>(most) * channels * 2, 0.0);
  std::vector<float> chunks(static_cast<size_t>(most) * channels * 2);
  std::vector<int64_t> counts(most, 0);
  on_thread_rows(shape, [&](int thread, int64_t begin, int64_t end) {
    const size_t at = static_cast<size_t>(thread) * channels * 2;
    counts[thread] = moments_of_rows(data, channels, begin, end, &chunks[at], &moments[at],
                                     &moments[at + channels]);
  });
  for (int64_t c = 0; c < channels; ++c) {
    double total_mean = 0.0, total_squares = 0.0;
    int64_t count = 0;
    for (int t = 0; t < most; ++t) {
      const size_t at = static_cast<size_t>(t) * channels * 2;
      if (counts[t] == 0) continue;
      merge_moments(count, total_mean, total_squares, counts[t], moments[at + c],
                    moments[at + channels + c]);
      count += counts[t];
    }
    mean[c] = static_cast<float>(total_mean);
    variance[c] = static_cast<float>(total_squares / static_cast<double>(count));
  }
}

// Per-channel sums over all rows into first (and, for the gradient, second).
template <Sum kSum>
void per_channel_sums(const ChannelRows& shape, const Reduction& r, double* first,
                      double* second) {
  const int64_t channels = shape.channels;
  const int most = omp_get_max_threads();
  std::vector<double> sums(static_cast<size_t>(most) * channels * 2, 0.0);
  std::vector<float> chunks(static_cast<size_t>(most) * channels * 2);
  on_thread_rows(shape, [&](int thread, int64_t begin, int64_t end) {
    const size_t at = static_cast<size_t>(thread) * channels * 2;
    sums_of_rows<kSum>(r, begin, end, &chunks[at], &sums[at], &sums[at + channels]);
  });
  for (int64_t c = 0; c < channels; ++c) {
    first[c] = 0.0;
    if (kSum == Sum::kGradient) second[c] = 0.0;
    for (int t = 0; t < most; ++t) {
      const size_t at = static_cast<size_t>(t) * channels * 2 + c;
      first[c] += sums[at];
      if (kSum == Sum::kGradient) second[c] += sums[at + channels];
    }
  }
}

// The forward's output pass over rows [begin, end): (x - mean) * scale + beta, plus the
// residual, through the ReLU, rounded; the mask where the rounded output is positive.
template <bool kResidual, bool kRelu, bool kMask>
MXAMP_AVX512 void normalise_rows(const Bfloat16BatchNormForward& a, int64_t channels,
                                 const float* scale, int64_t begin, int64_t end) {
  const int64_t row_vectors = vectors_per_row(channels);
  for (int64_t row = begin; row < end; ++row) {
    for (int64_t v = 0; v < row_vectors; ++v) {
      const int64_t c = 16 * v, at = row * channels + c;
      const __mmask16 in_row = lanes(channels, c);
      __m512 y =
          _mm512_sub_ps(load(a.data + at, in_row), _mm512_maskz_loadu_ps(in_row, a.mean + c));
      y = _mm512_fmadd_ps(y, _mm512_maskz_loadu_ps(in_row, scale + c),
                          _mm512_maskz_loadu_ps(in_row, a.beta + c));
      if (kResidual) y = _mm512_add_ps(y, load(a.residual + at, in_row));
      if (kRelu) y = _mm512_max_ps(y, _mm512_setzero_ps());  // NaN gives 0, as MXNet's ReLU
      const __m256i rounded = to_bfloat16(y);
      _mm256_mask_storeu_epi16(a.output + at, in_row, rounded);
      if (kMask)
        a.relu_mask[row * row_vectors + v] =
            _mm256_mask_cmpgt_epi16_mask(in_row, rounded, _mm256_setzero_si256());
    }
  }
}

// The backward's data-gradient pass over rows [begin, end): coefficient[0] * g +
// coefficient[1] * (x - mean) + coefficient[2], with g the gradient where the mask is set.
MXAMP_AVX512 void data_grad_rows(const Bfloat16BatchNormBackward& a, int64_t channels,
                                 const float* const* coefficient, int64_t begin, int64_t end) {
  const int64_t row_vectors = vectors_per_row(channels);
  for (int64_t row = begin; row < end; ++row) {
    for (int64_t v = 0; v < row_vectors; ++v) {
      const int64_t c = 16 * v, at = row * channels + c;
      const __mmask16 in_row = lanes(channels, c);
      const __mmask16 taken =
          a.relu_mask != nullptr ? __mmask16(in_row & a.relu_mask[row * row_vectors + v]) : in_row;
      const __m512 g = load(a.output_grad + at, taken);
      const __m512 d =
          _mm512_sub_ps(load(a.data + at, in_row), _mm512_maskz_loadu_ps(in_row, a.mean + c));
      const __m512 dx = _mm512_fmadd_ps(
          g, _mm512_maskz_loadu_ps(in_row, coefficient[0] + c),
          _mm512_fmadd_ps(d, _mm512_maskz_loadu_ps(in_row, coefficient[1] + c),
                          _mm512_maskz_loadu_ps(in_row, coefficient[2] + c)));
      _mm256_mask_storeu_epi16(a.data_grad + at, in_row, to_bfloat16(dx));
    }
  }
}

template <bool kResidual, bool kRelu, bool kMask>
void normalise(const ChannelRows& shape, const Bfloat16BatchNormForward& a, const float* scale) {
  on_thread_rows(shape, [&](int, int64_t begin, int64_t end) {
    normalise_rows<kResidual, kRelu, kMask>(a, shape.channels, scale, begin, end);
  });
}

}  // namespace

bool bfloat16_batch_norm_runs_here() { return has_avx512(); }

size_t bfloat16_batch_norm_mask_bytes(const ChannelRows& shape) {
  return static_cast<size_t>(shape.rows * vectors_per_row(shape.channels)) * sizeof(uint16_t);
}

void bfloat16_batch_norm_forward(const ChannelRows& shape, const Bfloat16BatchNormForward& a) {
  const int64_t channels = shape.channels;
  batch_moments(shape, a.data, a.mean, a.variance);
  std::vector<float> scale(channels);
  for (int64_t c = 0; c < channels; ++c) {
    scale[c] = static_cast<float>(a.gamma[c] / std::sqrt(double(a.variance[c]) + a.eps));
  }
  const bool residual = a.residual != nullptr, mask = a.relu_mask != nullptr;
  if (residual && a.relu) {
    normalise<true, true, false>(shape, a, scale.data());
  } else if (residual) {
    normalise<true, false, false>(shape, a, scale.data());
  } else if (a.relu && mask) {
    normalise<false, true, true>(shape, a, scale.data());
  } else if (a.relu) {
    normalise<false, true, false>(shape, a, scale.data());
  } else {
    normalise<false, false, false>(shape, a, scale.data());
  }
}

void bfloat16_batch_norm_backward(const ChannelRows& shape, const Bfloat16BatchNormBackward& a) {
  const int64_t channels = shape.channels;
  const double rows = static_cast<double>(shape.rows);
  std::vector<double> grad_sum(channels), grad_deviation_sum(channels);
  per_channel_sums<Sum::kGradient>(shape,
                                   {a.data, a.mean, a.output_grad, a.relu_mask, channels},
                                   grad_sum.data(), grad_deviation_sum.data());
  // d data = gamma / s * (g - sum(g) / n - (x - mean) / s^2 * sum(g * (x - mean)) / n), with
  // s = sqrt(variance + eps): three coefficients per channel.
  std::vector<float> coefficients(3 * channels);
  float* scale = coefficients.data();
  float* deviation = scale + channels;
  float* offset = deviation + channels;
  for (int64_t c = 0; c < channels; ++c) {
    const double inverse_std = 1.0 / std::sqrt(double(a.variance[c]) + a.eps);
    const double gamma_over_std = a.gamma[c] * inverse_std;
    a.beta_grad[c] = static_cast<float>(grad_sum[c]);
    a.gamma_grad[c] = static_cast<float>(grad_deviation_sum[c] * inverse_std);
    scale[c] = static_cast<float>(gamma_over_std);
    deviation[c] = static_cast<float>(-gamma_over_std * inverse_std * inverse_std *
                                      grad_deviation_sum[c] / rows);
    offset[c] = static_cast<float>(-gamma_over_std * grad_sum[c] / rows);
  }
  const float* const coefficient[3] = {scale, deviation, offset};
  on_thread_rows(shape, [&](int, int64_t begin, int64_t end) {
    data_grad_rows(a, channels, coefficient, begin, end);
  });
}

void bfloat16_channel_sums(const ChannelRows& shape, const uint16_t* data, double* sums) {
  per_channel_sums<Sum::kData>(shape, {data, nullptr, nullptr, nullptr, shape.channels}, sums,
                               nullptr);
}

}  // namespace mxamp
