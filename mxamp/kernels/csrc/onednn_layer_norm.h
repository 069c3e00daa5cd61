// mxamp's own layer normalisation on oneDNN 3: what it computes and how it is called.
//
// Owns MXNet's LayerNorm over the last axis (its default, and every transformer's), forward
// in training and its gradient, on oneDNN 3's layer_normalization: data and output float32 or
// bfloat16, gamma, beta and the statistics float32.  MXNet 1.9.1's own CPU gradient is a
// generic loop, many times slower (docs/policy.rst, "Transformers under bfloat16").  Knows
// nothing of MXNet's extension ABI: mxnet_extension.cc adapts it.
#ifndef MXAMP_ONEDNN_LAYER_NORM_H_
#define MXAMP_ONEDNN_LAYER_NORM_H_

#include <cstdint>

#include "onednn_conv.h"

namespace mxamp {

struct LayerNormSpec {
  int64_t rows = 0;      // the product of every dimension but the last
  int64_t channels = 0;  // the last dimension, normalised over
  float eps = 1e-5f;
  int dtype_flag = kFlagFloat32;  // of the data and the output
};

// output = (data - mean) / sqrt(variance + eps) * gamma + beta, per row; writes the row's mean
// and variance (float32, `rows` each) for the gradient.
void layer_norm_forward(const LayerNormSpec& spec, const void* data, const float* gamma,
                        const float* beta, void* output, float* mean, float* variance,
                        const Scratch& scratch);
void layer_norm_backward(const LayerNormSpec& spec, const void* output_grad, const void* data,
                         const float* gamma, const float* beta, const float* mean, const float* variance,
                         void* data_grad, float* gamma_grad, float* beta_grad,
                         const Scratch& scratch);

}  // namespace mxamp

#endif  // MXAMP_ONEDNN_LAYER_NORM_H_
