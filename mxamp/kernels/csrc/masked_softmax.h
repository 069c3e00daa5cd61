// Softmax over the last axis with a length per row, and its gradient: MXNet's
// softmax(data, length, axis=-1, use_length=True), vectorised.
//
// Owns the arithmetic of "_mxamp_masked_softmax" (mxnet_extension.cc registers it), which a
// converted Gluon network runs in place of MXNet's softmax with a length (the attention weights
// of gluonnlp's BERT).  MXNet 1.9.1 has no oneDNN softmax with a length: it computes it, and its
// gradient, in a scalar loop on a CPU (docs/policy.rst, "Transformers under bfloat16").  Here
// each row is computed in vector loops (vector_isa.h: an AVX-512 twin and a plain one), the
// rows shared among the calling thread's OpenMP team, with MXNet's formula in float32 and an
// exp accurate to 2 units in the last place.  Knows nothing of MXNet.
#ifndef MXAMP_MASKED_SOFTMAX_H_
#define MXAMP_MASKED_SOFTMAX_H_

#include <cstdint>

namespace mxamp {

// mshadow's type flags of the lengths MXNet's softmax takes.
constexpr int kFlagInt32 = 4;
constexpr int kFlagInt64 = 6;

struct MaskedSoftmaxSpec {
  int64_t rows = 0;                // the product of every dimension but the last
  int64_t columns = 0;             // the last dimension, the softmax's axis
  int length_flag = kFlagInt32;    // of the lengths: kFlagInt32 or kFlagInt64
};

// Per row r, with n = length[r] (one length a row, int32 or int64) and m the largest of the
// row's first n values: output[r][j] = exp(data[r][j] - m) / (sum over k < n of
// exp(data[r][k] - m)) for j < n, 0 for j >= n; a row of length 0 is all 0, as MXNet's.  A
// length below 0 or above `columns`, with which MXNet reads and writes outside the row, counts
// as 0 or `columns`.  `output` may be `data`.
void masked_softmax_forward(const MaskedSoftmaxSpec& spec, const float* data, const void* length,
                            float* output);

// The gradient, from the forward output: data_grad[r][j] = output[r][j] * (output_grad[r][j] -
// sum over k < n of output_grad[r][k] * output[r][k]) for j < n, 0 for j >= n, as MXNet's.
void masked_softmax_backward(const MaskedSoftmaxSpec& spec, const float* output_grad,
                             const float* output, const void* length, float* data_grad);

}  // namespace mxamp

#endif  // MXAMP_MASKED_SOFTMAX_H_
