// mxamp's own batch normalisation on oneDNN 3: what it computes and how it is called.
//
// Owns training-mode batch normalisation (batch statistics, its gradient and, with the gradient
// as MXNet does, the moving statistics' update) and the global-statistics form, on oneDNN 3.x,
// for data whose channels are the second dimension (N, C, spatial...) or the last (N,
// spatial..., C): the layout mxamp's channels-last convolutions pass on, where MXNet 1.9.1's
// BatchNorm runs a scalar loop.  Data in float32 or bfloat16; gamma, beta and the statistics in
// float32, as MXNet keeps them.  bfloat16 channels-last data in training goes to mxamp's own
// AVX-512 loops instead of oneDNN's kernel (bfloat16_batch_norm.h says why); the workspace, the
// copies' gradient sum, fix_gamma and the moving statistics are handled here for both.  Knows
// nothing of MXNet's extension ABI: mxnet_extension.cc adapts it.
#ifndef MXAMP_ONEDNN_BATCH_NORM_H_
#define MXAMP_ONEDNN_BATCH_NORM_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "onednn_conv.h"

namespace mxamp {

// One batch normalisation in MXNet's terms (the attributes of its BatchNorm operator).
struct BatchNormSpec {
  std::vector<int64_t> data_shape;  // 3 to 5 dimensions
  bool channels_last = false;       // channels the last dimension (else the second)
  int dtype_flag = kFlagFloat32;    // of data and output
  float eps = 1e-3f;                // MXNet's defaults
  float momentum = 0.9f;
  bool fix_gamma = true;            // gamma taken as 1, its gradient 0
  bool use_global_stats = false;    // normalise with the moving statistics
  bool relu = false;                // a ReLU on the output
  bool residual = false;            // an array like data added to the output, before the ReLU

  // A ReLU without a residual is fused into the kernel: its forward writes a workspace (where
  // the output is positive; a bit per value) that its gradient reads.  With a residual, the
  // ReLU's gradient is read from the output.
  bool relu_workspace() const { return relu && !residual; }

  int64_t channels() const { return channels_last ? data_shape.back() : data_shape[1]; }
  // Throws std::invalid_argument naming the first inconsistent attribute.
  void validate() const;
};

// MXNet's arrays of one forward call.  mean and variance receive the batch statistics (the
// moving ones under use_global_stats).
struct BatchNormForwardArrays {
  const void* data;
  const float* gamma;
  const float* beta;
  const float* moving_mean;
  const float* moving_var;
  const void* residual;   // null without
  void* output;
  float* mean;
  float* variance;
  void* workspace;        // batch_norm_workspace_bytes(spec) bytes; null unless relu_workspace()
};

// The moving statistics are updated here, in place, unless use_global_stats: where MXNet's
// BatchNorm updates them, so a forward pass without its backward (a loss computed under
// autograd.record and dropped) leaves them as MXNet does.
struct BatchNormBackwardArrays {
  const void* output_grad;
  const void* output;     // the forward's output, for the ReLU's gradient after a residual
  const void* workspace;  // the forward's, under relu_workspace(); else null
  const void* data;
  const float* gamma;
  const float* mean;      // the forward's outputs
  const float* variance;
  float* moving_mean;
  float* moving_var;
  void* data_grad;
  float* gamma_grad;
  float* beta_grad;
  void* residual_grad;   // null without
  // Gradients of copies of the output (written by the caller for other readers), added to
  // output_grad.
  const void* const* copy_grads = nullptr;
  int copies = 0;
};

// Bytes of the workspace of the spec's forward: 0 unless relu_workspace().
size_t batch_norm_workspace_bytes(const BatchNormSpec& spec);

void batch_norm_forward(const BatchNormSpec& spec, const BatchNormForwardArrays& arrays,
                        const Scratch& scratch);
void batch_norm_backward(const BatchNormSpec& spec, const BatchNormBackwardArrays& arrays,
                         const Scratch& scratch);

}  // namespace mxamp

#endif  // MXAMP_ONEDNN_BATCH_NORM_H_
