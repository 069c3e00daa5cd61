// mxamp's own convolution on oneDNN 3: what it computes and how it is called.
//
// Owns the convolution itself (forward, backward data, backward weights) on oneDNN 3.x for
// MXNet's plain layouts: data and output (N, C, spatial...), or channels last (N, spatial..., C),
// and the weight (O, I/group, kernel...) in either case, in any data type oneDNN
// has convolutions for on the running CPU (float32 everywhere; bfloat16 and float16 where the
// CPU has them).  Knows nothing of MXNet's extension ABI: mxnet_extension.cc adapts it.
#ifndef MXAMP_ONEDNN_CONV_H_
#define MXAMP_ONEDNN_CONV_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mxamp {

// MXNet's type flags (mshadow) of the data types a convolution may compute in.
constexpr int kFlagFloat32 = 0;
constexpr int kFlagFloat16 = 2;
constexpr int kFlagBFloat16 = 12;

// Bytes per value of the data types mxamp's operators take (float32, float16, bfloat16).
inline size_t element_bytes(int dtype_flag) { return dtype_flag == kFlagFloat32 ? 4 : 2; }

// One convolution in MXNet's terms (the attributes of its Convolution operator).
struct ConvSpec {
  std::vector<int64_t> data_shape;  // N, C, then 1 to 3 spatial sizes; N, spatial..., C if
                                    // channels_last
  std::vector<int64_t> kernel;      // one per spatial dimension
  std::vector<int64_t> stride;      // one per spatial dimension
  std::vector<int64_t> dilate;      // MXNet's convention: 1 is a dense kernel
  std::vector<int64_t> pad;         // symmetric, one per spatial dimension
  int64_t num_filter = 0;
  int64_t num_group = 1;
  bool no_bias = false;
  int dtype_flag = kFlagFloat32;
  // Data and output channels last (NWC, NHWC, NDHWC), the layout oneDNN's AMX kernels compute
  // in: a chain of channels-last operators passes arrays with no reorder in between.
  bool channels_last = false;

  int64_t channels() const { return channels_last ? data_shape.back() : data_shape[1]; }
  int64_t spatial_size(size_t i) const { return data_shape[channels_last ? i + 1 : i + 2]; }
  // Throws std::invalid_argument naming the first inconsistent attribute.
  void validate() const;
  std::vector<int64_t> output_shape() const;
  std::vector<int64_t> weight_shape() const;
};

// The arrays of one call, MXNet's plain layouts.  A null gradient pointer: not wanted.
struct ForwardArrays {
  const void* data;
  const void* weight;
  const void* bias;  // null when no_bias
  void* output;
};

struct BackwardArrays {
  const void* output_grad;
  const void* data;
  const void* weight;
  void* data_grad;
  void* weight_grad;
  void* bias_grad;  // null when no_bias
};

// Gives `bytes` of scratch memory, valid until the call returns (MXNet's temporary space).
using Scratch = std::function<void*(size_t bytes)>;

// Throw std::invalid_argument for a bad spec, std::runtime_error when oneDNN has no kernel.
void convolution_forward(const ConvSpec& spec, const ForwardArrays& arrays, const Scratch& scratch);
void convolution_backward(const ConvSpec& spec, const BackwardArrays& arrays,
                          const Scratch& scratch);

// "3.2.0" and the instruction set oneDNN uses on this CPU ("avx2", "avx512_core_amx", ...).
std::string onednn_version();
std::string onednn_cpu_isa();
// The oneDNN implementations one convolution runs ("forward=brg:avx2 ..."), for measuring.
std::string describe_kernels(const ConvSpec& spec);

}  // namespace mxamp

#endif  // MXAMP_ONEDNN_CONV_H_
