// mxamp's own pooling on oneDNN 3: what it computes and how it is called.
//
// Owns max and average pooling (forward, and its gradient) on oneDNN 3.x for data whose
// channels are the second dimension (N, C, spatial...) or the last (N, spatial..., C): the layout
// mxamp's channels-last convolutions pass on, where MXNet 1.9.1 has no CPU pooling (its NHWC
// Pooling crashes).  A channels-last region that reaches a network's stem pooling takes the stem
// in with it.  Data in float32 or bfloat16.  Max pooling's gradient reads the forward's
// workspace (where each window's maximum was), an output the caller keeps for the backward
// pass.  Knows nothing of MXNet's extension ABI: mxnet_extension.cc adapts it.
#ifndef MXAMP_ONEDNN_POOLING_H_
#define MXAMP_ONEDNN_POOLING_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "onednn_conv.h"

namespace mxamp {

// One pooling in MXNet's terms (its Pooling operator, pooling_convention 'valid').
struct PoolingSpec {
  std::vector<int64_t> data_shape;  // N, C, spatial... or, channels_last, N, spatial..., C
  std::vector<int64_t> kernel;      // one per spatial dimension
  std::vector<int64_t> stride;
  std::vector<int64_t> pad;         // symmetric
  bool max = true;                  // else average
  bool count_include_pad = true;    // average: padding counts in the divisor (MXNet's default)
  bool channels_last = false;
  int dtype_flag = kFlagFloat32;

  int64_t channels() const { return channels_last ? data_shape.back() : data_shape[1]; }
  int64_t spatial_size(size_t i) const { return data_shape[channels_last ? i + 1 : i + 2]; }
  // Throws std::invalid_argument naming the first inconsistent attribute.
  void validate() const;
  std::vector<int64_t> output_shape() const;
};

// Bytes of the workspace max pooling's forward writes for its gradient; 0 for average pooling.
size_t pooling_workspace_bytes(const PoolingSpec& spec);

// `workspace`: pooling_workspace_bytes(spec) bytes (null for average pooling).
void pooling_forward(const PoolingSpec& spec, const void* data, void* output, void* workspace,
                     const Scratch& scratch);
void pooling_backward(const PoolingSpec& spec, const void* output_grad, const void* workspace,
                      void* data_grad, const Scratch& scratch);

}  // namespace mxamp

#endif  // MXAMP_ONEDNN_POOLING_H_
