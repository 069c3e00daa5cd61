// MXNet 1.9.1 extension library (mx.library.load) registering mxamp's native operators.
//
// Registers fourteen operators.  "_mxamp_follow_weight" (master_weights.h): inputs (FP32 master,
// bfloat16 weight), output the master that follows the weight; no attributes, no gradient.
// "_mxamp_convolution", with the attributes of MXNet's Convolution
// (kernel, stride, dilate, pad, num_filter, num_group, no_bias; layout NCW/NCHW/NCDHW only;
// workspace, cudnn_tune and cudnn_off accepted and ignored) and channels_last (data and output
// (N, spatial..., C); the weight stays (O, I/group, kernel...)) and data_gradient (False: the
// gradient leaves the data's gradient unwritten, for a graph where nothing reads it), and its
// gradient "_backward__mxamp_convolution", whose inputs MXNet fixes as (output gradient, data,
// weight, [bias], output) and whose outputs are the gradients of (data, weight, [bias]).
// "_mxamp_batch_norm" (onednn_batch_norm.h), with the attributes of MXNet's BatchNorm (eps,
// momentum, fix_gamma, use_global_stats, axis: 1 or the last; act_type=relu for a fused ReLU
// on the output; residual=True for a sixth input added before it; copies=k for k further
// outputs, each a copy of the output for one more reader; output_mean_var and cudnn_off
// accepted and ignored): inputs (data, gamma, beta, moving_mean, moving_var[, residual]), the
// moving statistics mutated; outputs (output, batch mean, batch variance[, copies...][, the
// fused ReLU's workspace, uint8 (bytes,), with act_type=relu and no residual]), always training
// mode unless use_global_stats, since the ABI does not say whether MXNet is training.
// Its gradient's inputs are (the outputs' gradients, the inputs, the outputs), its outputs the
// gradients of the inputs (the moving statistics' are 0).
// "_mxamp_fan_out" (fan_out.h), attribute num_outputs (2 or more): one input (float32 or
// bfloat16), num_outputs copies of it; its gradient's inputs are (num_outputs output gradients,
// the input, the outputs), its output their sum.
// "_mxamp_sgd_step" (master_weights.h): one SGD step on the FP32 master copy of a bfloat16
// weight, attributes lr, wd, momentum, rescale_grad, clip_gradient (negative: none) and follow;
// inputs (weight, gradient, master[, momentum when momentum != 0]), the master and the momentum
// mutated; output the new bfloat16 weight; no gradient.
// "_mxamp_adam_step" (master_weights.h): one Adam step likewise, attributes lr, wd, beta1,
// beta2, epsilon, rescale_grad, clip_gradient (negative: none) and follow; inputs (weight,
// gradient, master, mean, variance), the last three mutated; output the new bfloat16 weight.
// "_mxamp_move_channels" (move_channels.h), attribute to (last: (N, C, spatial...) into
// (N, spatial..., C); first: back): one input (float32 or bfloat16), the moved array; its
// gradient's inputs are (output gradient, input, output), its output the gradient moved back.
// "_mxamp_pooling" (onednn_pooling.h), with the attributes of MXNet's Pooling (kernel, stride,
// pad, pool_type max or avg, global_pool, count_include_pad; pooling_convention 'valid' (any
// under global_pool) and layout NCW/NCHW/NCDHW only; cudnn_off accepted and ignored) and
// channels_last: one input, the data; outputs the pooled data and, for max pooling, the
// workspace its gradient reads (uint8, (bytes,)).  Its gradient's inputs are (the outputs' gradients, data, the outputs), its output
// the data's gradient.
// "_mxamp_clip" (clip.h), with the attributes of MXNet's clip (a_min, a_max): one input
// (float32 or bfloat16), the clipped array; its gradient's inputs are (output gradient, input,
// output), its output the input's gradient.
// "_mxamp_selfatt_qk" and "_mxamp_selfatt_valatt" (onednn_attention.h), attribute heads, as
// MXNet's _contrib_interleaved_matmul_selfatt_qk / _valatt: inputs (projection) and
// (projection, attention), float32 or bfloat16 (qk's scores float32 either way); their
// gradients' inputs are (output gradient,
// inputs, output), their outputs the inputs' gradients.
// "_mxamp_layer_norm" (onednn_layer_norm.h), with the attributes of MXNet's LayerNorm (axis: the
// last; eps; output_mean_var False): inputs (data, gamma, beta), outputs (output, mean,
// variance), data and output float32 or bfloat16, the rest float32; its gradient's inputs are
// (the outputs' gradients, the inputs, the outputs), its outputs the inputs' gradients.
// "_mxamp_masked_softmax" (masked_softmax.h), with the attributes of MXNet's softmax with
// use_length=True that it computes (axis: the last only; no temperature, no dtype): inputs
// (data, float32; length, int32 or int64, of the data's shape without its last axis), output
// the softmax over the first `length` values of each row, 0 beyond; its gradient's inputs are
// (output gradient, data, length, output), its outputs the gradients of (data, length), the
// length's zero, as MXNet's.
// "_mxamp_dropout" (dropout.h), with the attributes of MXNet's Dropout (p; mode training or
// always, both dropping; axes empty; cudnn_off accepted and ignored), always dropping, since the
// ABI does not say whether MXNet is training: one input (float32 or bfloat16), outputs the
// dropped-out array and its mask (uint8, (bytes,), one bit a value).  Each call draws its
// seed from MXNet's CPU random states (mx.random.seed sets them).  Its gradient's inputs are
// (the 2 outputs' gradients, the input, the outputs), its output the input's gradient.
//
// The extension ABI (MX_LIBRARY_VERSION 11) is implemented here directly, on raw pointers:
// see mxnet_lib_api_v11.h for why MXNet's lib_api.cc is not compiled in.  What the ABI does not
// carry: MXNet's write request (kWriteTo / kAddTo / kNullOp) never reaches an extension, so the
// gradients are always written, never added (grad_req='add' is not honoured), and a gradient
// MXNet does not want is computed anyway unless MXNet passes no array for it.
//
// Besides the ABI, three C functions for mxamp.kernels.operators (ctypes): the oneDNN
// version, its instruction set on this CPU, and the kernels a given convolution runs.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "clip.h"
#include "dropout.h"
#include "fan_out.h"
#include "masked_softmax.h"
#include "master_weights.h"
#include "move_channels.h"
#include "onednn_attention.h"
#include "onednn_batch_norm.h"
#include "onednn_layer_norm.h"
#include "mxnet_lib_api_v11.h"
#include "onednn_conv.h"
#include "onednn_pooling.h"

namespace {

using mxamp::ConvSpec;

constexpr const char* kConvOpName = "_mxamp_convolution";
constexpr const char* kFollowOpName = "_mxamp_follow_weight";
constexpr const char* kBatchNormOpName = "_mxamp_batch_norm";
constexpr const char* kFanOutOpName = "_mxamp_fan_out";
constexpr const char* kMoveChannelsOpName = "_mxamp_move_channels";
constexpr const char* kPoolingOpName = "_mxamp_pooling";
constexpr const char* kSgdStepOpName = "_mxamp_sgd_step";
constexpr const char* kAdamStepOpName = "_mxamp_adam_step";
constexpr const char* kClipOpName = "_mxamp_clip";
constexpr const char* kSelfAttQkOpName = "_mxamp_selfatt_qk";
constexpr const char* kSelfAttValAttOpName = "_mxamp_selfatt_valatt";
constexpr const char* kLayerNormOpName = "_mxamp_layer_norm";
constexpr const char* kMaskedSoftmaxOpName = "_mxamp_masked_softmax";
constexpr const char* kDropoutOpName = "_mxamp_dropout";
constexpr int kFlagUInt8 = 3;  // mshadow's type flag of uint8: workspaces, dropout's mask

// The message of the last failure on this thread, read by MXNet through _msgSize/_msgGet right
// after the failing call.
thread_local std::string last_error;

int fail(const std::string& message) {
  last_error = message;
  return 0;
}

// "(3, 3)", "[3,3]", "3" or "(3,)" -> {3, 3} / {3}.
std::vector<int64_t> parse_tuple(const std::string& key, const std::string& text) {
  std::vector<int64_t> values;
  const char* p = text.c_str();
  while (*p) {
    if (*p == '(' || *p == ')' || *p == '[' || *p == ']' || *p == ',' || *p == ' ') {
      ++p;
      continue;
    }
    char* end = nullptr;
    long long value = std::strtoll(p, &end, 10);
    if (end == p) throw std::invalid_argument(key + "=" + text + " is not a tuple of integers");
    values.push_back(value);
    p = end;
  }
  return values;
}

int64_t parse_int(const std::string& key, const std::string& text) {
  char* end = nullptr;
  long long value = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0')
    throw std::invalid_argument(key + "=" + text + " is not an integer");
  return value;
}

bool parse_bool(const std::string& key, const std::string& text) {
  if (text == "True" || text == "true" || text == "1") return true;
  if (text == "False" || text == "false" || text == "0") return false;
  throw std::invalid_argument(key + "=" + text + " is not a boolean");
}

// The operator's attributes, before the data shape is known.
struct Attributes {
  std::vector<int64_t> kernel, stride, dilate, pad;
  int64_t num_filter = 0;
  int64_t num_group = 1;
  bool no_bias = false;
  bool channels_last = false;
  bool data_gradient = true;

  int num_inputs() const { return no_bias ? 2 : 3; }

  // The spec for data of `shape` and type `dtype_flag`; MXNet's defaults fill what is unset.
  ConvSpec spec(const int64_t* shape, int ndim, int dtype_flag) const {
    ConvSpec s;
    s.data_shape.assign(shape, shape + ndim);
    const size_t spatial = kernel.size();
    s.kernel = kernel;
    s.stride = stride.empty() ? std::vector<int64_t>(spatial, 1) : stride;
    s.dilate = dilate.empty() ? std::vector<int64_t>(spatial, 1) : dilate;
    s.pad = pad.empty() ? std::vector<int64_t>(spatial, 0) : pad;
    s.num_filter = num_filter;
    s.num_group = num_group;
    s.no_bias = no_bias;
    s.channels_last = channels_last;
    s.dtype_flag = dtype_flag;
    s.validate();
    return s;
  }
};

Attributes parse_attributes(const char* const* keys, const char* const* vals, int num) {
  Attributes a;
  bool has_kernel = false, has_num_filter = false;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;  // MXNet's own annotations (__profiler_scope__...)
    if (key == "kernel") {
      a.kernel = parse_tuple(key, value);
      has_kernel = true;
    } else if (key == "stride") {
      a.stride = parse_tuple(key, value);
    } else if (key == "dilate") {
      a.dilate = parse_tuple(key, value);
    } else if (key == "pad") {
      a.pad = parse_tuple(key, value);
    } else if (key == "num_filter") {
      a.num_filter = parse_int(key, value);
      has_num_filter = true;
    } else if (key == "num_group") {
      a.num_group = parse_int(key, value);
    } else if (key == "no_bias") {
      a.no_bias = parse_bool(key, value);
    } else if (key == "channels_last") {
      a.channels_last = parse_bool(key, value);
    } else if (key == "data_gradient") {
      a.data_gradient = parse_bool(key, value);
    } else if (key == "layout") {
      if (value != "None" && value != "NCW" && value != "NCHW" && value != "NCDHW")
        throw std::invalid_argument("layout=" + value +
                                    ": mxamp's convolution takes NCW, NCHW or NCDHW only");
    } else if (key != "workspace" && key != "cudnn_tune" && key != "cudnn_off") {
      throw std::invalid_argument("unknown attribute " + key + "=" + value);
    }
  }
  if (!has_kernel || !has_num_filter)
    throw std::invalid_argument("kernel and num_filter are required");
  const size_t spatial = a.kernel.size();
  if (spatial < 1 || spatial > 3) throw std::invalid_argument("kernel must have 1 to 3 dimensions");
  for (const auto* part : {&a.stride, &a.dilate, &a.pad}) {
    if (!part->empty() && part->size() != spatial)
      throw std::invalid_argument("stride, dilate and pad must have as many dimensions as kernel");
  }
  return a;
}

// Every pointer of one _opCallFCompute call that the operators use.
struct Call {
  const char* const* keys;
  const char* const* vals;
  int num;
  const int64_t** inshapes;
  int* indims;
  void** indata;
  int* intypes;
  int num_in;
  const int64_t** outshapes;
  int* outdims;
  void** outdata;
  int num_out;
  mxamp::Scratch scratch;
  void* rng_cpu_states;  // MXNet's RandGenerator<cpu, float>::GetStates(): std::mt19937[1024]
};

void check_same_shape(const char* what, const int64_t* shape, int ndim,
                      const std::vector<int64_t>& expected) {
  if (static_cast<size_t>(ndim) == expected.size() &&
      std::equal(expected.begin(), expected.end(), shape))
    return;
  std::string got, want;
  for (int i = 0; i < ndim; ++i) got += (i ? ", " : "") + std::to_string(shape[i]);
  for (size_t i = 0; i < expected.size(); ++i) want += (i ? ", " : "") + std::to_string(expected[i]);
  throw std::invalid_argument(std::string(what) + " has shape (" + got + "), expected (" + want +
                              ")");
}

size_t element_count(const int64_t* shape, int ndim) {
  size_t count = 1;
  for (int i = 0; i < ndim; ++i) count *= static_cast<size_t>(shape[i]);
  return count;
}

// Throws unless `flag` is unknown (negative), float32 or bfloat16: what `op` computes in.
void check_float32_or_bfloat16(int flag, const char* op) {
  if (flag >= 0 && flag != mxamp::kFlagFloat32 && flag != mxamp::kFlagBFloat16)
    throw std::invalid_argument("data type flag " + std::to_string(flag) + ": " + op +
                                " takes float32 or bfloat16");
}

void check_one_type(const int* types, int count) {
  for (int i = 1; i < count; ++i) {
    if (types[i] != types[0])
      throw std::invalid_argument("inputs of different data types (flags " +
                                  std::to_string(types[0]) + " and " + std::to_string(types[i]) +
                                  ")");
  }
}

int compute_forward(const Call& c) {
  const Attributes attributes = parse_attributes(c.keys, c.vals, c.num);
  const int n = attributes.num_inputs();
  if (c.num_in != n || c.num_out != 1)
    throw std::invalid_argument("expected " + std::to_string(n) + " inputs and 1 output");
  check_one_type(c.intypes, n);
  const ConvSpec spec = attributes.spec(c.inshapes[0], c.indims[0], c.intypes[0]);
  check_same_shape("weight", c.inshapes[1], c.indims[1], spec.weight_shape());
  if (!spec.no_bias) check_same_shape("bias", c.inshapes[2], c.indims[2], {spec.num_filter});
  check_same_shape("output", c.outshapes[0], c.outdims[0], spec.output_shape());
  mxamp::ForwardArrays arrays = {c.indata[0], c.indata[1], spec.no_bias ? nullptr : c.indata[2],
                                 c.outdata[0]};
  mxamp::convolution_forward(spec, arrays, c.scratch);
  return 1;
}

int compute_backward(const Call& c) {
  const Attributes attributes = parse_attributes(c.keys, c.vals, c.num);
  const int n = attributes.num_inputs();
  // MXNet's gradient node: inputs (output gradient, forward inputs..., forward output).
  if (c.num_in != n + 2 || c.num_out != n)
    throw std::invalid_argument("expected " + std::to_string(n + 2) + " inputs and " +
                                std::to_string(n) + " outputs");
  check_one_type(c.intypes, n + 1);
  const ConvSpec spec = attributes.spec(c.inshapes[1], c.indims[1], c.intypes[1]);
  check_same_shape("output gradient", c.inshapes[0], c.indims[0], spec.output_shape());
  check_same_shape("weight", c.inshapes[2], c.indims[2], spec.weight_shape());
  mxamp::BackwardArrays arrays = {c.indata[0], c.indata[1], c.indata[2],
                                  attributes.data_gradient ? c.outdata[0] : nullptr,
                                  c.outdata[1], spec.no_bias ? nullptr : c.outdata[2]};
  mxamp::convolution_backward(spec, arrays, c.scratch);
  return 1;
}

int parse_counts(const char* const* keys, const char* const* vals, int num, int* num_in,
                 int* num_out) {
  *num_in = parse_attributes(keys, vals, num).num_inputs();
  *num_out = 1;
  return 1;
}

// Arrays handed to MXNet, which frees them through _opCallFree.
template <typename T>
T* allocate(size_t count) {
  T* p = static_cast<T*>(std::malloc(sizeof(T) * (count ? count : 1)));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

unsigned int* copy_shape(const std::vector<int64_t>& shape) {
  unsigned int* out = allocate<unsigned int>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) out[i] = static_cast<unsigned int>(shape[i]);
  return out;
}

// Shape inference's answer for a list of arrays (the inputs, or the outputs), as MXNet takes it.
void give_shapes(const std::vector<std::vector<int64_t>>& shapes, unsigned int*** out,
                 int** dims) {
  *dims = allocate<int>(shapes.size());
  *out = allocate<unsigned int*>(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    (*dims)[i] = static_cast<int>(shapes[i].size());
    (*out)[i] = copy_shape(shapes[i]);
  }
}

// Weight and bias shapes from the data shape (MXNet gives unknown ones as ndim <= 0), and the
// output shape.
int infer_shape(const char* const* keys, const char* const* vals, int num,
                unsigned int** inshapes, int* indims, int num_in, unsigned int*** mod_inshapes,
                int** mod_indims, unsigned int*** outshapes, int** outdims, int num_out) {
  const Attributes a = parse_attributes(keys, vals, num);
  if (num_in != a.num_inputs() || num_out != 1)
    throw std::invalid_argument("expected " + std::to_string(a.num_inputs()) + " inputs");
  if (indims[0] != static_cast<int>(a.kernel.size()) + 2)
    throw std::invalid_argument(
        "the data shape is unknown or has the wrong number of dimensions; mxamp's "
        "convolution infers the weight shape from it and needs it first");
  std::vector<int64_t> data(inshapes[0], inshapes[0] + indims[0]);
  // The data type changes no shape: float32 stands in for it.
  const ConvSpec spec = a.spec(data.data(), indims[0], mxamp::kFlagFloat32);
  std::vector<std::vector<int64_t>> inputs = {data, spec.weight_shape()};
  if (!spec.no_bias) inputs.push_back({spec.num_filter});
  for (int i = 1; i < num_in; ++i) {
    if (indims[i] > 0) {
      // A partly known shape (a Gluon parameter before deferred initialisation: (64, 0, 1, 1),
      // which MXNet passes with 0 or -1 as unsigned for the unknown sizes) must agree where known.
      std::vector<int64_t> given(inshapes[i], inshapes[i] + indims[i]);
      for (size_t d = 0; d < given.size() && d < inputs[i].size(); ++d)
        if (inshapes[i][d] == 0 || inshapes[i][d] == static_cast<unsigned int>(-1))
          given[d] = inputs[i][d];
      check_same_shape(i == 1 ? "weight" : "bias", given.data(), indims[i], inputs[i]);
    }
  }
  give_shapes(inputs, mod_inshapes, mod_indims);
  give_shapes({spec.output_shape()}, outshapes, outdims);
  return 1;
}

// One data type for data, weight, bias and output, from whichever is known.
int infer_type(const char* const* keys, const char* const* vals, int num, int* intypes,
               int num_in, int* outtypes, int num_out) {
  parse_attributes(keys, vals, num);
  int known = -1;
  for (int i = 0; i < num_in; ++i) {
    if (intypes[i] < 0) continue;
    if (known >= 0 && intypes[i] != known)
      throw std::invalid_argument("inputs of different data types (flags " +
                                  std::to_string(known) + " and " + std::to_string(intypes[i]) +
                                  "): data, weight and bias must share one");
    known = intypes[i];
  }
  if (known >= 0 && known != mxamp::kFlagFloat32 && known != mxamp::kFlagFloat16 &&
      known != mxamp::kFlagBFloat16)
    throw std::invalid_argument("data type flag " + std::to_string(known) +
                                ": mxamp's convolution computes float32, float16 and bfloat16");
  for (int i = 0; i < num_in; ++i) intypes[i] = known;
  for (int i = 0; i < num_out; ++i) outtypes[i] = known;
  return 1;
}

// _mxamp_follow_weight: (master float32, weight bfloat16) -> master float32, same shape.
void check_no_attributes(const char* const* keys, const char* const* vals, int num) {
  for (int i = 0; i < num; ++i) {
    if (std::strncmp(keys[i], "__", 2) != 0)
      throw std::invalid_argument(std::string(kFollowOpName) + " takes no attribute (got " +
                                  keys[i] + "=" + vals[i] + ")");
  }
}

int follow_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                 int* num_out) {
  check_no_attributes(keys, vals, num);
  *num_in = 2;
  *num_out = 1;
  return 1;
}

int follow_infer_shape(const char* const*, const char* const*, int, unsigned int** inshapes,
                       int* indims, int num_in, unsigned int*** mod_inshapes, int** mod_indims,
                       unsigned int*** outshapes, int** outdims, int num_out) {
  if (num_in != 2 || num_out != 1) throw std::invalid_argument("expected 2 inputs and 1 output");
  const int known = indims[0] > 0 ? 0 : indims[1] > 0 ? 1 : -1;
  if (known < 0) throw std::invalid_argument("the shapes of master and weight are unknown");
  const std::vector<int64_t> shape(inshapes[known], inshapes[known] + indims[known]);
  if (indims[1 - known] > 0) {
    const std::vector<int64_t> other(inshapes[1 - known], inshapes[1 - known] + indims[1 - known]);
    check_same_shape(known == 0 ? "weight" : "master", other.data(), indims[1 - known], shape);
  }
  give_shapes({shape, shape}, mod_inshapes, mod_indims);
  give_shapes({shape}, outshapes, outdims);
  return 1;
}

int follow_infer_type(const char* const*, const char* const*, int, int* intypes, int num_in,
                      int* outtypes, int num_out) {
  if (num_in != 2 || num_out != 1) throw std::invalid_argument("expected 2 inputs and 1 output");
  if ((intypes[0] >= 0 && intypes[0] != mxamp::kFlagFloat32) ||
      (intypes[1] >= 0 && intypes[1] != mxamp::kFlagBFloat16))
    throw std::invalid_argument(std::string(kFollowOpName) +
                                " takes a float32 master and a bfloat16 weight (type flags " +
                                std::to_string(intypes[0]) + " and " +
                                std::to_string(intypes[1]) + ")");
  intypes[0] = outtypes[0] = mxamp::kFlagFloat32;
  intypes[1] = mxamp::kFlagBFloat16;
  return 1;
}

int follow_compute(const Call& c) {
  if (c.num_in != 2 || c.num_out != 1) throw std::invalid_argument("expected 2 inputs and 1 output");
  check_no_attributes(c.keys, c.vals, c.num);
  if (c.intypes[0] != mxamp::kFlagFloat32 || c.intypes[1] != mxamp::kFlagBFloat16)
    throw std::invalid_argument("expected a float32 master and a bfloat16 weight");
  const std::vector<int64_t> shape(c.inshapes[0], c.inshapes[0] + c.indims[0]);
  check_same_shape("weight", c.inshapes[1], c.indims[1], shape);
  check_same_shape("output", c.outshapes[0], c.outdims[0], shape);
  mxamp::follow_bfloat16_weight(static_cast<const float*>(c.indata[0]),
                                static_cast<const uint16_t*>(c.indata[1]),
                                static_cast<float*>(c.outdata[0]),
                                element_count(c.inshapes[0], c.indims[0]));
  return 1;
}


float parse_float(const std::string& key, const std::string& text) {
  char* end = nullptr;
  const float value = std::strtof(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0')
    throw std::invalid_argument(key + "=" + text + " is not a number");
  return value;
}

// _mxamp_sgd_step: (weight bfloat16, gradient bfloat16, master float32[, momentum float32]) ->
// the new weight (bfloat16); the master and the momentum updated in place.
mxamp::SgdStep parse_sgd_step(const char* const* keys, const char* const* vals, int num) {
  mxamp::SgdStep step;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    if (key == "lr") {
      step.lr = parse_float(key, value);
    } else if (key == "wd") {
      step.wd = parse_float(key, value);
    } else if (key == "momentum") {
      step.momentum = parse_float(key, value);
    } else if (key == "rescale_grad") {
      step.rescale_grad = parse_float(key, value);
    } else if (key == "clip_gradient") {
      step.clip_gradient = parse_float(key, value);
    } else if (key == "follow") {
      step.follow = parse_bool(key, value);
    } else {
      throw std::invalid_argument("unknown attribute " + key + "=" + value);
    }
  }
  return step;
}

int sgd_step_inputs(const mxamp::SgdStep& step) { return step.momentum != 0.0f ? 4 : 3; }

void check_sgd_step_counts(const mxamp::SgdStep& step, int num_in, int num_out) {
  if (num_in != sgd_step_inputs(step) || num_out != 1)
    throw std::invalid_argument("expected " + std::to_string(sgd_step_inputs(step)) +
                                " inputs (weight, gradient, master[, momentum]) and 1 output");
}

int sgd_step_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                   int* num_out) {
  *num_in = sgd_step_inputs(parse_sgd_step(keys, vals, num));
  *num_out = 1;
  return 1;
}

int sgd_step_infer_shape(const char* const* keys, const char* const* vals, int num,
                         unsigned int** inshapes, int* indims, int num_in,
                         unsigned int*** mod_inshapes, int** mod_indims,
                         unsigned int*** outshapes, int** outdims, int num_out) {
  check_sgd_step_counts(parse_sgd_step(keys, vals, num), num_in, num_out);
  if (indims[0] <= 0) throw std::invalid_argument("the weight's shape is unknown");
  const std::vector<int64_t> shape(inshapes[0], inshapes[0] + indims[0]);
  for (int i = 1; i < num_in; ++i) {
    if (indims[i] > 0)
      check_same_shape("gradient, master and momentum", std::vector<int64_t>(
                           inshapes[i], inshapes[i] + indims[i]).data(), indims[i], shape);
  }
  give_shapes(std::vector<std::vector<int64_t>>(num_in, shape), mod_inshapes, mod_indims);
  give_shapes({shape}, outshapes, outdims);
  return 1;
}

int sgd_step_infer_type(const char* const* keys, const char* const* vals, int num, int* intypes,
                        int num_in, int* outtypes, int num_out) {
  check_sgd_step_counts(parse_sgd_step(keys, vals, num), num_in, num_out);
  const int expected[] = {mxamp::kFlagBFloat16, mxamp::kFlagBFloat16, mxamp::kFlagFloat32,
                          mxamp::kFlagFloat32};
  for (int i = 0; i < num_in; ++i) {
    if (intypes[i] >= 0 && intypes[i] != expected[i])
      throw std::invalid_argument(std::string(kSgdStepOpName) +
                                  " takes a bfloat16 weight and gradient and float32 master and "
                                  "momentum (input " + std::to_string(i) + " has type flag " +
                                  std::to_string(intypes[i]) + ")");
    intypes[i] = expected[i];
  }
  outtypes[0] = mxamp::kFlagBFloat16;
  return 1;
}

int sgd_step_mutate(const char* const* keys, const char* const* vals, int num, int** indices,
                    int* count) {
  const int inputs = sgd_step_inputs(parse_sgd_step(keys, vals, num));
  *count = inputs - 2;   // the master, and the momentum when there is one
  *indices = allocate<int>(*count);
  for (int i = 0; i < *count; ++i) (*indices)[i] = 2 + i;
  return 1;
}

int sgd_step_compute(const Call& c) {
  const mxamp::SgdStep step = parse_sgd_step(c.keys, c.vals, c.num);
  check_sgd_step_counts(step, c.num_in, c.num_out);
  const std::vector<int64_t> shape(c.inshapes[0], c.inshapes[0] + c.indims[0]);
  const int expected[] = {mxamp::kFlagBFloat16, mxamp::kFlagBFloat16, mxamp::kFlagFloat32,
                          mxamp::kFlagFloat32};
  for (int i = 0; i < c.num_in; ++i) {
    check_same_shape("gradient, master and momentum", c.inshapes[i], c.indims[i], shape);
    if (c.intypes[i] != expected[i])
      throw std::invalid_argument("expected a bfloat16 weight and gradient and float32 master "
                                  "and momentum");
  }
  check_same_shape("output", c.outshapes[0], c.outdims[0], shape);
  mxamp::sgd_step_bfloat16(step, static_cast<const uint16_t*>(c.indata[0]),
                           static_cast<const uint16_t*>(c.indata[1]),
                           static_cast<float*>(c.indata[2]),
                           c.num_in == 4 ? static_cast<float*>(c.indata[3]) : nullptr,
                           static_cast<uint16_t*>(c.outdata[0]),
                           element_count(c.inshapes[0], c.indims[0]));
  return 1;
}

// _mxamp_adam_step: (weight bfloat16, gradient bfloat16, master, mean, variance float32) ->
// the new weight (bfloat16); the master, mean and variance mutated.
mxamp::AdamStep parse_adam_step(const char* const* keys, const char* const* vals, int num) {
  mxamp::AdamStep step;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    if (key == "lr") {
      step.lr = parse_float(key, value);
    } else if (key == "wd") {
      step.wd = parse_float(key, value);
    } else if (key == "beta1") {
      step.beta1 = parse_float(key, value);
    } else if (key == "beta2") {
      step.beta2 = parse_float(key, value);
    } else if (key == "epsilon") {
      step.epsilon = parse_float(key, value);
    } else if (key == "rescale_grad") {
      step.rescale_grad = parse_float(key, value);
    } else if (key == "clip_gradient") {
      step.clip_gradient = parse_float(key, value);
    } else if (key == "follow") {
      step.follow = parse_bool(key, value);
    } else {
      throw std::invalid_argument("unknown attribute " + key + "=" + value);
    }
  }
  return step;
}

constexpr int kAdamStepInputs = 5;

void check_adam_step_counts(int num_in, int num_out) {
  if (num_in != kAdamStepInputs || num_out != 1)
    throw std::invalid_argument("expected 5 inputs (weight, gradient, master, mean, variance) "
                                "and 1 output");
}

int adam_step_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                    int* num_out) {
  parse_adam_step(keys, vals, num);
  *num_in = kAdamStepInputs;
  *num_out = 1;
  return 1;
}

int adam_step_infer_shape(const char* const* keys, const char* const* vals, int num,
                          unsigned int** inshapes, int* indims, int num_in,
                          unsigned int*** mod_inshapes, int** mod_indims,
                          unsigned int*** outshapes, int** outdims, int num_out) {
  parse_adam_step(keys, vals, num);
  check_adam_step_counts(num_in, num_out);
  if (indims[0] <= 0) throw std::invalid_argument("the weight's shape is unknown");
  const std::vector<int64_t> shape(inshapes[0], inshapes[0] + indims[0]);
  for (int i = 1; i < num_in; ++i) {
    if (indims[i] > 0)
      check_same_shape("gradient, master, mean and variance", std::vector<int64_t>(
                           inshapes[i], inshapes[i] + indims[i]).data(), indims[i], shape);
  }
  give_shapes(std::vector<std::vector<int64_t>>(num_in, shape), mod_inshapes, mod_indims);
  give_shapes({shape}, outshapes, outdims);
  return 1;
}

int adam_step_infer_type(const char* const* keys, const char* const* vals, int num,
                         int* intypes, int num_in, int* outtypes, int num_out) {
  parse_adam_step(keys, vals, num);
  check_adam_step_counts(num_in, num_out);
  const int expected[] = {mxamp::kFlagBFloat16, mxamp::kFlagBFloat16, mxamp::kFlagFloat32,
                          mxamp::kFlagFloat32, mxamp::kFlagFloat32};
  for (int i = 0; i < num_in; ++i) {
    if (intypes[i] >= 0 && intypes[i] != expected[i])
      throw std::invalid_argument(std::string(kAdamStepOpName) +
                                  " takes a bfloat16 weight and gradient and float32 master, "
                                  "mean and variance (input " + std::to_string(i) +
                                  " has type flag " + std::to_string(intypes[i]) + ")");
    intypes[i] = expected[i];
  }
  outtypes[0] = mxamp::kFlagBFloat16;
  return 1;
}

int adam_step_mutate(const char* const*, const char* const*, int, int** indices, int* count) {
  *count = 3;   // the master, the mean and the variance
  *indices = allocate<int>(*count);
  for (int i = 0; i < *count; ++i) (*indices)[i] = 2 + i;
  return 1;
}

int adam_step_compute(const Call& c) {
  const mxamp::AdamStep step = parse_adam_step(c.keys, c.vals, c.num);
  check_adam_step_counts(c.num_in, c.num_out);
  const std::vector<int64_t> shape(c.inshapes[0], c.inshapes[0] + c.indims[0]);
  for (int i = 1; i < c.num_in; ++i)
    check_same_shape("gradient, master, mean and variance", c.inshapes[i], c.indims[i], shape);
  mxamp::adam_step_bfloat16(step, static_cast<const uint16_t*>(c.indata[0]),
                            static_cast<const uint16_t*>(c.indata[1]),
                            static_cast<float*>(c.indata[2]), static_cast<float*>(c.indata[3]),
                            static_cast<float*>(c.indata[4]),
                            static_cast<uint16_t*>(c.outdata[0]),
                            element_count(shape.data(), c.indims[0]));
  return 1;
}

// _mxamp_batch_norm: the attributes, before the data shape is known.
struct BatchNormAttributes {
  float eps = 1e-3f;
  float momentum = 0.9f;
  bool fix_gamma = true;
  bool use_global_stats = false;
  bool relu = false;
  bool residual = false;
  int copies = 0;  // further outputs, each a copy of the output for one more reader
  int64_t axis = 1;

  int inputs() const { return residual ? 6 : 5; }
  // (output, mean, variance, copies...[, the fused ReLU's workspace])
  bool relu_workspace() const { return relu && !residual; }
  int outputs() const { return 3 + copies + (relu_workspace() ? 1 : 0); }
  int workspace_output() const { return 3 + copies; }

  mxamp::BatchNormSpec spec(const int64_t* shape, int ndim, int dtype_flag) const {
    mxamp::BatchNormSpec s;
    s.data_shape.assign(shape, shape + ndim);
    if (axis != 1 && axis != -1 && axis != ndim - 1)
      throw std::invalid_argument("axis=" + std::to_string(axis) +
                                  ": mxamp's batch normalisation takes the channels second (1) "
                                  "or last (-1)");
    s.channels_last = axis != 1;
    s.dtype_flag = dtype_flag;
    s.eps = eps;
    s.momentum = momentum;
    s.fix_gamma = fix_gamma;
    s.use_global_stats = use_global_stats;
    s.relu = relu;
    s.residual = residual;
    s.validate();
    return s;
  }
};

BatchNormAttributes parse_batch_norm(const char* const* keys, const char* const* vals, int num) {
  BatchNormAttributes a;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    if (key == "eps") {
      a.eps = parse_float(key, value);
    } else if (key == "momentum") {
      a.momentum = parse_float(key, value);
    } else if (key == "fix_gamma") {
      a.fix_gamma = parse_bool(key, value);
    } else if (key == "use_global_stats") {
      a.use_global_stats = parse_bool(key, value);
    } else if (key == "axis") {
      a.axis = parse_int(key, value);
    } else if (key == "residual") {
      a.residual = parse_bool(key, value);
    } else if (key == "copies") {
      a.copies = parse_int(key, value);
      if (a.copies < 0) throw std::invalid_argument("copies=" + value + " is negative");
    } else if (key == "act_type") {
      if (value != "relu")
        throw std::invalid_argument("act_type=" + value + ": only relu is fused");
      a.relu = true;
    } else if (key != "output_mean_var" && key != "cudnn_off") {
      throw std::invalid_argument("unknown attribute " + key + "=" + value);
    }
  }
  return a;
}

// Inputs (data, gamma, beta, moving_mean, moving_var[, residual]); outputs (output, mean,
// variance, copies of the output...).
void check_batch_norm_counts(const BatchNormAttributes& a, int num_in, int num_out) {
  if (num_in != a.inputs() || num_out != a.outputs())
    throw std::invalid_argument("expected " + std::to_string(a.inputs()) + " inputs and " +
                                std::to_string(a.outputs()) + " outputs");
}

int batch_norm_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                     int* num_out) {
  const BatchNormAttributes a = parse_batch_norm(keys, vals, num);
  *num_in = a.inputs();
  *num_out = a.outputs();
  return 1;
}

// The fused ReLU's workspace for data of this shape.  Shape inference does not know the data
// type, and the kernels for each type (oneDNN's; for bfloat16 channels last, mxamp's loops) size
// it their own way: the larger of float32's and bfloat16's (where this CPU has a bfloat16
// kernel).
int64_t relu_workspace_bytes(const BatchNormAttributes& a, const std::vector<int64_t>& data) {
  size_t bytes = mxamp::batch_norm_workspace_bytes(
      a.spec(data.data(), static_cast<int>(data.size()), mxamp::kFlagFloat32));
  try {
    bytes = std::max(bytes, mxamp::batch_norm_workspace_bytes(a.spec(
                                data.data(), static_cast<int>(data.size()), mxamp::kFlagBFloat16)));
  } catch (const std::runtime_error&) {
    // No bfloat16 kernel here: bfloat16 data would fail at its forward call, with the reason.
  }
  return static_cast<int64_t>(bytes);
}

int batch_norm_infer_shape(const char* const* keys, const char* const* vals, int num,
                           unsigned int** inshapes, int* indims, int num_in,
                           unsigned int*** mod_inshapes, int** mod_indims,
                           unsigned int*** outshapes, int** outdims, int num_out) {
  const BatchNormAttributes a = parse_batch_norm(keys, vals, num);
  check_batch_norm_counts(a, num_in, num_out);
  if (indims[0] < 3) throw std::invalid_argument("the data shape is unknown or below 3 dimensions");
  const std::vector<int64_t> data(inshapes[0], inshapes[0] + indims[0]);
  const mxamp::BatchNormSpec spec = a.spec(data.data(), indims[0], mxamp::kFlagFloat32);
  const std::vector<int64_t> vector = {spec.channels()};
  for (int i = 1; i < 5; ++i) {
    if (indims[i] > 0 && !(indims[i] == 1 && (inshapes[i][0] == 0 ||
                                              inshapes[i][0] == static_cast<unsigned int>(-1))))
      check_same_shape("gamma, beta and the moving statistics", std::vector<int64_t>(
                           inshapes[i], inshapes[i] + indims[i]).data(), indims[i], vector);
  }
  if (a.residual && indims[5] > 0)
    check_same_shape("the residual", std::vector<int64_t>(inshapes[5], inshapes[5] + indims[5])
                     .data(), indims[5], data);
  // Inputs (data, 4 statistics vectors[, residual]); outputs (output, mean, variance,
  // copies...[, workspace]).
  std::vector<std::vector<int64_t>> inputs(num_in, vector), outputs(num_out, data);
  inputs[0] = data;
  if (a.residual) inputs[5] = data;
  outputs[1] = outputs[2] = vector;
  if (a.relu_workspace()) outputs[a.workspace_output()] = {relu_workspace_bytes(a, data)};
  give_shapes(inputs, mod_inshapes, mod_indims);
  give_shapes(outputs, outshapes, outdims);
  return 1;
}

int batch_norm_infer_type(const char* const* keys, const char* const* vals, int num, int* intypes,
                          int num_in, int* outtypes, int num_out) {
  const BatchNormAttributes a = parse_batch_norm(keys, vals, num);
  check_batch_norm_counts(a, num_in, num_out);
  int data = intypes[0] >= 0 ? intypes[0] : outtypes[0];
  if (data < 0 && a.residual) data = intypes[5];
  if (data >= 0 && data != mxamp::kFlagFloat32 && data != mxamp::kFlagBFloat16)
    throw std::invalid_argument("data type flag " + std::to_string(data) +
                                ": mxamp's batch normalisation takes float32 or bfloat16 data");
  for (int i = 1; i < 5; ++i) {
    if (intypes[i] >= 0 && intypes[i] != mxamp::kFlagFloat32)
      throw std::invalid_argument("gamma, beta and the moving statistics must be float32 (type "
                                  "flag " + std::to_string(intypes[i]) + ")");
    intypes[i] = mxamp::kFlagFloat32;
  }
  if (a.residual) {
    if (intypes[5] >= 0 && data >= 0 && intypes[5] != data)
      throw std::invalid_argument("the residual's data type (flag " + std::to_string(intypes[5]) +
                                  ") differs from the data's (" + std::to_string(data) + ")");
    intypes[5] = data;
  }
  intypes[0] = outtypes[0] = data;
  outtypes[1] = outtypes[2] = mxamp::kFlagFloat32;
  for (int i = 3; i < 3 + a.copies; ++i) outtypes[i] = data;
  if (a.relu_workspace()) outtypes[a.workspace_output()] = kFlagUInt8;
  return 1;
}

// The moving statistics are declared mutated by the forward pass, as MXNet's BatchNorm declares
// them, which makes them a graph's auxiliary states; both update them in the backward pass.
int batch_norm_mutate(const char* const*, const char* const*, int, int** indices, int* count) {
  *indices = allocate<int>(2);
  (*indices)[0] = 3;  // moving_mean
  (*indices)[1] = 4;  // moving_var
  *count = 2;
  return 1;
}

// The workspace MXNet allocated from shape inference's size holds the kernel's.
void check_workspace(const int64_t* shape, int ndim, const mxamp::BatchNormSpec& spec) {
  const size_t needed = mxamp::batch_norm_workspace_bytes(spec);
  if (ndim != 1 || shape[0] < static_cast<int64_t>(needed))
    throw std::invalid_argument("the fused ReLU's workspace has " +
                                std::to_string(element_count(shape, ndim)) + " bytes, " +
                                std::to_string(needed) + " needed");
}

int batch_norm_forward(const Call& c) {
  const BatchNormAttributes a = parse_batch_norm(c.keys, c.vals, c.num);
  check_batch_norm_counts(a, c.num_in, c.num_out);
  const mxamp::BatchNormSpec spec = a.spec(c.inshapes[0], c.indims[0], c.intypes[0]);
  const std::vector<int64_t> vector = {spec.channels()};
  for (int i = 1; i < 5; ++i)
    check_same_shape("a statistics input", c.inshapes[i], c.indims[i], vector);
  if (spec.residual) check_same_shape("the residual", c.inshapes[5], c.indims[5], spec.data_shape);
  check_same_shape("output", c.outshapes[0], c.outdims[0], spec.data_shape);
  mxamp::BatchNormForwardArrays arrays = {
      c.indata[0], static_cast<const float*>(c.indata[1]), static_cast<const float*>(c.indata[2]),
      static_cast<const float*>(c.indata[3]), static_cast<const float*>(c.indata[4]),
      spec.residual ? c.indata[5] : nullptr, c.outdata[0],
      static_cast<float*>(c.outdata[1]), static_cast<float*>(c.outdata[2]), nullptr};
  if (a.relu_workspace()) {
    arrays.workspace = c.outdata[a.workspace_output()];
    check_workspace(c.outshapes[a.workspace_output()], c.outdims[a.workspace_output()], spec);
  }
  mxamp::batch_norm_forward(spec, arrays, c.scratch);
  const size_t bytes =
      element_count(c.outshapes[0], c.outdims[0]) * mxamp::element_bytes(spec.dtype_flag);
  for (int i = 3; i < 3 + a.copies; ++i) {
    check_same_shape("a copy of the output", c.outshapes[i], c.outdims[i], spec.data_shape);
    mxamp::copy_bytes(c.outdata[0], c.outdata[i], bytes);
  }
  return 1;
}

int batch_norm_backward(const Call& c) {
  // Inputs: gradients of the m outputs (output, mean, variance, copies...[, workspace]), then
  // the n forward inputs (data, gamma, beta, moving_mean, moving_var[, residual]), then the m
  // outputs.
  const BatchNormAttributes a = parse_batch_norm(c.keys, c.vals, c.num);
  const int n = a.inputs(), m = a.outputs();
  if (c.num_in != 2 * m + n || c.num_out != n)
    throw std::invalid_argument("expected " + std::to_string(2 * m + n) + " inputs and " +
                                std::to_string(n) + " outputs");
  const int input = m, output = m + n;  // where the forward's inputs and outputs start
  const mxamp::BatchNormSpec spec =
      a.spec(c.inshapes[input], c.indims[input], c.intypes[input]);
  for (int i = 0; i < 3 + a.copies; i = i == 0 ? 3 : i + 1)
    check_same_shape("an output gradient", c.inshapes[i], c.indims[i], spec.data_shape);
  std::vector<const void*> copy_grads(c.indata + 3, c.indata + 3 + a.copies);
  const void* workspace = nullptr;
  if (a.relu_workspace()) {
    const int at = output + a.workspace_output();
    check_workspace(c.inshapes[at], c.indims[at], spec);
    workspace = c.indata[at];
  }
  mxamp::BatchNormBackwardArrays arrays = {
      c.indata[0], c.indata[output], workspace, c.indata[input],
      static_cast<const float*>(c.indata[input + 1]),
      static_cast<const float*>(c.indata[output + 1]),
      static_cast<const float*>(c.indata[output + 2]),
      // The moving statistics MXNet passes back are the forward's arrays themselves, which its
      // own BatchNorm updates here too (batch_norm.cc's backward).
      static_cast<float*>(c.indata[input + 3]), static_cast<float*>(c.indata[input + 4]),
      c.outdata[0], static_cast<float*>(c.outdata[1]), static_cast<float*>(c.outdata[2]),
      spec.residual ? c.outdata[5] : nullptr, copy_grads.data(), a.copies};
  mxamp::batch_norm_backward(spec, arrays, c.scratch);
  for (int i = 3; i < 5; ++i) {  // the moving statistics take no gradient
    if (c.outdata[i] != nullptr)
      std::memset(c.outdata[i], 0, sizeof(float) * element_count(c.outshapes[i], c.outdims[i]));
  }
  return 1;
}

// The functions MXNet gets for an operator and passes back on each call, in their real types.
typedef int (*RawParse)(const char* const*, const char* const*, int, int* num_in, int* num_out);
typedef int (*RawInferShape)(const char* const*, const char* const*, int, unsigned int**, int*,
                             int, unsigned int***, int**, unsigned int***, int**, int);
typedef int (*RawInferType)(const char* const*, const char* const*, int, int*, int, int*, int);
typedef int (*RawCompute)(const Call&);
typedef int (*RawInferSType)(const char* const*, const char* const*, int, int* instypes,
                             int num_in, int* outstypes, int num_out);
typedef int (*RawMutate)(const char* const*, const char* const*, int, int** indices, int* count);

// Dense arrays in and out.  MXNet's default for an extension without this function requires
// every input's storage type known as dense, which a graph's auxiliary states (the moving
// statistics) are not yet when it checks.
int dense_storage(const char* const*, const char* const*, int, int* instypes, int num_in,
                  int* outstypes, int num_out) {
  for (int i = 0; i < num_in; ++i) {
    if (instypes[i] > 0) throw std::invalid_argument("mxamp's operators take dense arrays only");
    instypes[i] = 0;  // kDefaultStorage
  }
  for (int i = 0; i < num_out; ++i) outstypes[i] = 0;
  return 1;
}

// _mxamp_fan_out: one array, num_outputs copies; the gradient sums theirs.
int parse_fan_out(const char* const* keys, const char* const* vals, int num) {
  int outputs = 0;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    if (key != "num_outputs")
      throw std::invalid_argument("unknown attribute " + key + "=" + value);
    outputs = parse_int(key, value);
  }
  if (outputs < 2) throw std::invalid_argument("num_outputs must be 2 or more");
  return outputs;
}

int fan_out_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                  int* num_out) {
  *num_in = 1;
  *num_out = parse_fan_out(keys, vals, num);
  return 1;
}

int fan_out_infer_shape(const char* const* keys, const char* const* vals, int num,
                        unsigned int** inshapes, int* indims, int num_in,
                        unsigned int*** mod_inshapes, int** mod_indims,
                        unsigned int*** outshapes, int** outdims, int num_out) {
  if (num_in != 1 || num_out != parse_fan_out(keys, vals, num))
    throw std::invalid_argument("expected 1 input and num_outputs outputs");
  if (indims[0] <= 0) throw std::invalid_argument("the input shape is unknown");
  const std::vector<int64_t> shape(inshapes[0], inshapes[0] + indims[0]);
  give_shapes({shape}, mod_inshapes, mod_indims);
  give_shapes(std::vector<std::vector<int64_t>>(num_out, shape), outshapes, outdims);
  return 1;
}

int fan_out_infer_type(const char* const* keys, const char* const* vals, int num, int* intypes,
                       int num_in, int* outtypes, int num_out) {
  if (num_in != 1 || num_out != parse_fan_out(keys, vals, num))
    throw std::invalid_argument("expected 1 input and num_outputs outputs");
  int known = intypes[0];
  for (int i = 0; i < num_out && known < 0; ++i) known = outtypes[i];
  check_float32_or_bfloat16(known, kFanOutOpName);
  intypes[0] = known;
  for (int i = 0; i < num_out; ++i) outtypes[i] = known;
  return 1;
}

int fan_out_forward(const Call& c) {
  if (c.num_in != 1 || c.num_out != parse_fan_out(c.keys, c.vals, c.num))
    throw std::invalid_argument("expected 1 input and num_outputs outputs");
  const std::vector<int64_t> shape(c.inshapes[0], c.inshapes[0] + c.indims[0]);
  const size_t bytes =
      element_count(c.inshapes[0], c.indims[0]) * mxamp::element_bytes(c.intypes[0]);
  for (int i = 0; i < c.num_out; ++i) {
    check_same_shape("output", c.outshapes[i], c.outdims[i], shape);
    mxamp::copy_bytes(c.indata[0], c.outdata[i], bytes);
  }
  return 1;
}

int fan_out_backward(const Call& c) {
  const int k = parse_fan_out(c.keys, c.vals, c.num);
  if (c.num_in != 2 * k + 1 || c.num_out != 1)
    throw std::invalid_argument("expected " + std::to_string(2 * k + 1) + " inputs and 1 output");
  const std::vector<int64_t> shape(c.outshapes[0], c.outshapes[0] + c.outdims[0]);
  const size_t size = element_count(c.outshapes[0], c.outdims[0]);
  for (int i = 0; i < k; ++i) {
    check_same_shape("output gradient", c.inshapes[i], c.indims[i], shape);
    if (c.intypes[i] != c.intypes[0])
      throw std::invalid_argument("output gradients of different data types");
  }
  if (c.intypes[0] != mxamp::kFlagBFloat16 && c.intypes[0] != mxamp::kFlagFloat32)
    throw std::invalid_argument("data type flag " + std::to_string(c.intypes[0]) +
                                ": float32 or bfloat16 only");
  // The output gradients are the call's first k inputs.
  mxamp::sum_arrays(c.indata, k, c.outdata[0], size, c.intypes[0] == mxamp::kFlagBFloat16);
  return 1;
}

// _mxamp_move_channels: true for to=last, false for to=first.
bool parse_move_channels(const char* const* keys, const char* const* vals, int num) {
  int to_last = -1;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    if (key != "to" || (value != "last" && value != "first"))
      throw std::invalid_argument("unknown attribute " + key + "=" + value +
                                  " (expected to=last or to=first)");
    to_last = value == "last";
  }
  if (to_last < 0) throw std::invalid_argument("attribute to (last or first) is required");
  return to_last == 1;
}

// The shape of `shape` with its channels moved (dimension 1 to the last, or back).
std::vector<int64_t> moved_shape(std::vector<int64_t> shape, bool to_last) {
  if (shape.size() < 3)
    throw std::invalid_argument("expected 3 or more dimensions (N, C, spatial...)");
  if (to_last) {
    std::rotate(shape.begin() + 1, shape.begin() + 2, shape.end());
  } else {
    std::rotate(shape.begin() + 1, shape.end() - 1, shape.end());
  }
  return shape;
}

int move_channels_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                        int* num_out) {
  parse_move_channels(keys, vals, num);
  *num_in = 1;
  *num_out = 1;
  return 1;
}

int move_channels_infer_shape(const char* const* keys, const char* const* vals, int num,
                              unsigned int** inshapes, int* indims, int num_in,
                              unsigned int*** mod_inshapes, int** mod_indims,
                              unsigned int*** outshapes, int** outdims, int num_out) {
  const bool to_last = parse_move_channels(keys, vals, num);
  if (num_in != 1 || num_out != 1) throw std::invalid_argument("expected 1 input and 1 output");
  if (indims[0] <= 0) throw std::invalid_argument("the input shape is unknown");
  const std::vector<int64_t> shape(inshapes[0], inshapes[0] + indims[0]);
  give_shapes({shape}, mod_inshapes, mod_indims);
  give_shapes({moved_shape(shape, to_last)}, outshapes, outdims);
  return 1;
}

// One input and one output of its type, float32 or bfloat16: the types of `op`.
int infer_one_float_type(int* intypes, int num_in, int* outtypes, int num_out, const char* op) {
  if (num_in != 1 || num_out != 1) throw std::invalid_argument("expected 1 input and 1 output");
  const int known = intypes[0] >= 0 ? intypes[0] : outtypes[0];
  check_float32_or_bfloat16(known, op);
  intypes[0] = outtypes[0] = known;
  return 1;
}

int move_channels_infer_type(const char* const* keys, const char* const* vals, int num,
                             int* intypes, int num_in, int* outtypes, int num_out) {
  parse_move_channels(keys, vals, num);
  return infer_one_float_type(intypes, num_in, outtypes, num_out, kMoveChannelsOpName);
}

// `in` of shape `shape` (the layout the move starts from) moved into `out`.
void run_move_channels(const void* in, void* out, const std::vector<int64_t>& shape, int type,
                       bool to_last) {
  const int64_t images = shape[0];
  const int64_t channels = to_last ? shape[1] : shape.back();
  const int64_t count = static_cast<int64_t>(element_count(shape.data(),
                                                          static_cast<int>(shape.size())));
  if (count == 0) return;
  const int64_t positions = count / (images * channels);
  mxamp::move_channels(in, out, images, channels, positions, mxamp::element_bytes(type),
                       to_last);
}

int move_channels_forward(const Call& c) {
  const bool to_last = parse_move_channels(c.keys, c.vals, c.num);
  if (c.num_in != 1 || c.num_out != 1) throw std::invalid_argument("expected 1 input and 1 output");
  const std::vector<int64_t> shape(c.inshapes[0], c.inshapes[0] + c.indims[0]);
  check_same_shape("output", c.outshapes[0], c.outdims[0], moved_shape(shape, to_last));
  run_move_channels(c.indata[0], c.outdata[0], shape, c.intypes[0], to_last);
  return 1;
}

int move_channels_backward(const Call& c) {
  const bool to_last = parse_move_channels(c.keys, c.vals, c.num);
  // MXNet's gradient node: inputs (output gradient, input, output), output the input's gradient.
  if (c.num_in != 3 || c.num_out != 1)
    throw std::invalid_argument("expected 3 inputs and 1 output");
  const std::vector<int64_t> shape(c.outshapes[0], c.outshapes[0] + c.outdims[0]);
  const std::vector<int64_t> moved = moved_shape(shape, to_last);
  check_same_shape("output gradient", c.inshapes[0], c.indims[0], moved);
  run_move_channels(c.indata[0], c.outdata[0], moved, c.intypes[0], !to_last);
  return 1;
}

// _mxamp_clip: (a_min, a_max), both required, as MXNet's clip.
std::pair<float, float> parse_clip(const char* const* keys, const char* const* vals, int num) {
  bool has_min = false, has_max = false;
  std::pair<float, float> bounds;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    char* end = nullptr;
    const float bound = std::strtof(value.c_str(), &end);
    if (end == value.c_str() || *end != '\0' || (key != "a_min" && key != "a_max"))
      throw std::invalid_argument("unknown attribute " + key + "=" + value +
                                  " (expected a_min and a_max, numbers)");
    (key == "a_min" ? bounds.first : bounds.second) = bound;
    (key == "a_min" ? has_min : has_max) = true;
  }
  if (!has_min || !has_max) throw std::invalid_argument("attributes a_min and a_max are required");
  return bounds;
}

int clip_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
               int* num_out) {
  parse_clip(keys, vals, num);
  *num_in = 1;
  *num_out = 1;
  return 1;
}

int clip_infer_shape(const char* const* keys, const char* const* vals, int num,
                     unsigned int** inshapes, int* indims, int num_in,
                     unsigned int*** mod_inshapes, int** mod_indims, unsigned int*** outshapes,
                     int** outdims, int num_out) {
  parse_clip(keys, vals, num);
  if (num_in != 1 || num_out != 1) throw std::invalid_argument("expected 1 input and 1 output");
  if (indims[0] <= 0) throw std::invalid_argument("the input shape is unknown");
  const std::vector<int64_t> shape(inshapes[0], inshapes[0] + indims[0]);
  give_shapes({shape}, mod_inshapes, mod_indims);
  give_shapes({shape}, outshapes, outdims);
  return 1;
}

int clip_infer_type(const char* const* keys, const char* const* vals, int num, int* intypes,
                    int num_in, int* outtypes, int num_out) {
  parse_clip(keys, vals, num);
  return infer_one_float_type(intypes, num_in, outtypes, num_out, kClipOpName);
}

int clip_forward(const Call& c) {
  const std::pair<float, float> bounds = parse_clip(c.keys, c.vals, c.num);
  if (c.num_in != 1 || c.num_out != 1) throw std::invalid_argument("expected 1 input and 1 output");
  const std::vector<int64_t> shape(c.inshapes[0], c.inshapes[0] + c.indims[0]);
  check_same_shape("output", c.outshapes[0], c.outdims[0], shape);
  check_float32_or_bfloat16(c.intypes[0], kClipOpName);
  mxamp::clip_values(c.indata[0], c.outdata[0], element_count(shape.data(), c.indims[0]),
                     bounds.first, bounds.second, c.intypes[0] == mxamp::kFlagBFloat16);
  return 1;
}

int clip_backward(const Call& c) {
  const std::pair<float, float> bounds = parse_clip(c.keys, c.vals, c.num);
  // MXNet's gradient node: inputs (output gradient, input, output), output the input's gradient.
  if (c.num_in != 3 || c.num_out != 1)
    throw std::invalid_argument("expected 3 inputs and 1 output");
  const std::vector<int64_t> shape(c.outshapes[0], c.outshapes[0] + c.outdims[0]);
  check_same_shape("output gradient", c.inshapes[0], c.indims[0], shape);
  check_same_shape("input", c.inshapes[1], c.indims[1], shape);
  check_float32_or_bfloat16(c.intypes[0], kClipOpName);
  mxamp::clip_gradient(c.indata[0], c.indata[1], c.outdata[0],
                       element_count(shape.data(), c.outdims[0]), bounds.first, bounds.second,
                       c.intypes[0] == mxamp::kFlagBFloat16);
  return 1;
}

// _mxamp_pooling: the attributes, before the data shape is known.
struct PoolingAttributes {
  std::vector<int64_t> kernel, stride, pad;
  bool max = true;
  bool global_pool = false;
  bool count_include_pad = true;
  bool channels_last = false;

  // Max pooling keeps where each maximum was for its gradient: a second output.
  int outputs() const { return max ? 2 : 1; }

  mxamp::PoolingSpec spec(const int64_t* shape, int ndim, int dtype_flag) const {
    mxamp::PoolingSpec s;
    s.data_shape.assign(shape, shape + ndim);
    const size_t spatial = ndim >= 3 ? static_cast<size_t>(ndim - 2) : 0;
    if (global_pool) {
      for (size_t i = 0; i < spatial; ++i) s.kernel.push_back(shape[channels_last ? i + 1 : i + 2]);
      s.stride.assign(spatial, 1);
      s.pad.assign(spatial, 0);
    } else {
      s.kernel = kernel;
      s.stride = stride.empty() ? std::vector<int64_t>(kernel.size(), 1) : stride;
      s.pad = pad.empty() ? std::vector<int64_t>(kernel.size(), 0) : pad;
    }
    s.max = max;
    s.count_include_pad = count_include_pad;
    s.channels_last = channels_last;
    s.dtype_flag = dtype_flag;
    s.validate();
    return s;
  }
};

PoolingAttributes parse_pooling(const char* const* keys, const char* const* vals, int num) {
  PoolingAttributes a;
  std::string convention = "valid";
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    if (key == "kernel") {
      a.kernel = parse_tuple(key, value);
    } else if (key == "stride") {
      a.stride = parse_tuple(key, value);
    } else if (key == "pad") {
      a.pad = parse_tuple(key, value);
    } else if (key == "pool_type") {
      if (value != "max" && value != "avg")
        throw std::invalid_argument("pool_type=" + value + ": mxamp's pooling takes max or avg");
      a.max = value == "max";
    } else if (key == "global_pool") {
      a.global_pool = parse_bool(key, value);
    } else if (key == "count_include_pad") {
      a.count_include_pad = value == "None" || parse_bool(key, value);
    } else if (key == "channels_last") {
      a.channels_last = parse_bool(key, value);
    } else if (key == "pooling_convention") {
      convention = value;
    } else if (key == "layout") {
      if (value != "None" && value != "NCW" && value != "NCHW" && value != "NCDHW")
        throw std::invalid_argument("layout=" + value +
                                    ": mxamp's pooling takes NCW, NCHW or NCDHW only");
    } else if (key != "cudnn_off") {
      throw std::invalid_argument("unknown attribute " + key + "=" + value);
    }
  }
  if (!a.global_pool && a.kernel.empty())
    throw std::invalid_argument("kernel is required unless global_pool");
  // A global pooling has one window, whatever the convention.
  if (!a.global_pool && convention != "valid")
    throw std::invalid_argument("pooling_convention=" + convention +
                                ": mxamp's pooling takes 'valid' only (or global_pool)");
  return a;
}

int pooling_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                  int* num_out) {
  *num_in = 1;
  *num_out = parse_pooling(keys, vals, num).outputs();
  return 1;
}

void check_pooling_counts(const PoolingAttributes& a, int num_in, int num_out) {
  if (num_in != 1 || num_out != a.outputs())
    throw std::invalid_argument("expected 1 input and " + std::to_string(a.outputs()) +
                                " outputs");
}

// The output's shape from the data's; max pooling's workspace as (bytes,).
int pooling_infer_shape(const char* const* keys, const char* const* vals, int num,
                        unsigned int** inshapes, int* indims, int num_in,
                        unsigned int*** mod_inshapes, int** mod_indims,
                        unsigned int*** outshapes, int** outdims, int num_out) {
  const PoolingAttributes a = parse_pooling(keys, vals, num);
  check_pooling_counts(a, num_in, num_out);
  if (indims[0] < 3) throw std::invalid_argument("the data shape is unknown or below 3 dimensions");
  const std::vector<int64_t> data(inshapes[0], inshapes[0] + indims[0]);
  // The data type changes no shape, nor the workspace (where the maxima were): float32 stands in.
  const mxamp::PoolingSpec spec = a.spec(data.data(), indims[0], mxamp::kFlagFloat32);
  std::vector<std::vector<int64_t>> outputs = {spec.output_shape()};
  if (spec.max) outputs.push_back({static_cast<int64_t>(mxamp::pooling_workspace_bytes(spec))});
  give_shapes({data}, mod_inshapes, mod_indims);
  give_shapes(outputs, outshapes, outdims);
  return 1;
}

int pooling_infer_type(const char* const* keys, const char* const* vals, int num, int* intypes,
                       int num_in, int* outtypes, int num_out) {
  const PoolingAttributes a = parse_pooling(keys, vals, num);
  check_pooling_counts(a, num_in, num_out);
  const int known = intypes[0] >= 0 ? intypes[0] : outtypes[0];
  check_float32_or_bfloat16(known, kPoolingOpName);
  intypes[0] = outtypes[0] = known;
  if (a.max) outtypes[1] = kFlagUInt8;
  return 1;
}

int pooling_forward(const Call& c) {
  const PoolingAttributes a = parse_pooling(c.keys, c.vals, c.num);
  check_pooling_counts(a, c.num_in, c.num_out);
  const mxamp::PoolingSpec spec = a.spec(c.inshapes[0], c.indims[0], c.intypes[0]);
  check_same_shape("output", c.outshapes[0], c.outdims[0], spec.output_shape());
  void* workspace = nullptr;
  if (spec.max) {
    check_same_shape("workspace", c.outshapes[1], c.outdims[1],
                     {static_cast<int64_t>(mxamp::pooling_workspace_bytes(spec))});
    workspace = c.outdata[1];
  }
  mxamp::pooling_forward(spec, c.indata[0], c.outdata[0], workspace, c.scratch);
  return 1;
}

int pooling_backward(const Call& c) {
  const PoolingAttributes a = parse_pooling(c.keys, c.vals, c.num);
  // MXNet's gradient node: inputs (the outputs' gradients, data, the outputs); output the data's
  // gradient.
  const int outputs = a.outputs();
  if (c.num_in != 2 * outputs + 1 || c.num_out != 1)
    throw std::invalid_argument("expected " + std::to_string(2 * outputs + 1) +
                                " inputs and 1 output");
  const int data = outputs;
  const mxamp::PoolingSpec spec = a.spec(c.inshapes[data], c.indims[data], c.intypes[data]);
  check_same_shape("output gradient", c.inshapes[0], c.indims[0], spec.output_shape());
  check_same_shape("data gradient", c.outshapes[0], c.outdims[0], spec.data_shape);
  const void* workspace = nullptr;
  if (spec.max) {
    const int at = data + 2;  // after data and the output
    check_same_shape("workspace", c.inshapes[at], c.indims[at],
                     {static_cast<int64_t>(mxamp::pooling_workspace_bytes(spec))});
    workspace = c.indata[at];
  }
  mxamp::pooling_backward(spec, c.indata[0], workspace, c.outdata[0], c.scratch);
  return 1;
}

// _mxamp_selfatt_qk and _mxamp_selfatt_valatt: attribute heads, as MXNet's
// _contrib_interleaved_matmul_selfatt_qk / _valatt.
int64_t parse_heads(const char* const* keys, const char* const* vals, int num) {
  int64_t heads = 0;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    if (key != "heads") throw std::invalid_argument("unknown attribute " + key + "=" + value);
    heads = parse_int(key, value);
  }
  if (heads <= 0) throw std::invalid_argument("attribute heads (positive) is required");
  return heads;
}

// The projection's spec; its shape must be known.
mxamp::AttentionSpec projection_spec(const char* const* keys, const char* const* vals, int num,
                                     const unsigned int* shape, int ndim) {
  if (ndim <= 0) throw std::invalid_argument("the projection's shape is unknown");
  const std::vector<int64_t> dims(shape, shape + ndim);
  return mxamp::AttentionSpec::of_projection(dims.data(), ndim, parse_heads(keys, vals, num),
                                             mxamp::kFlagFloat32);
}

int selfatt_qk_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                     int* num_out) {
  parse_heads(keys, vals, num);
  *num_in = 1;
  *num_out = 1;
  return 1;
}

int selfatt_valatt_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                         int* num_out) {
  parse_heads(keys, vals, num);
  *num_in = 2;
  *num_out = 1;
  return 1;
}

int selfatt_qk_infer_shape(const char* const* keys, const char* const* vals, int num,
                           unsigned int** inshapes, int* indims, int num_in,
                           unsigned int*** mod_inshapes, int** mod_indims,
                           unsigned int*** outshapes, int** outdims, int num_out) {
  if (num_in != 1 || num_out != 1) throw std::invalid_argument("expected 1 input and 1 output");
  const mxamp::AttentionSpec spec = projection_spec(keys, vals, num, inshapes[0], indims[0]);
  give_shapes({spec.projection_shape()}, mod_inshapes, mod_indims);
  give_shapes({spec.scores_shape()}, outshapes, outdims);
  return 1;
}

int selfatt_valatt_infer_shape(const char* const* keys, const char* const* vals, int num,
                               unsigned int** inshapes, int* indims, int num_in,
                               unsigned int*** mod_inshapes, int** mod_indims,
                               unsigned int*** outshapes, int** outdims, int num_out) {
  if (num_in != 2 || num_out != 1) throw std::invalid_argument("expected 2 inputs and 1 output");
  const mxamp::AttentionSpec spec = projection_spec(keys, vals, num, inshapes[0], indims[0]);
  give_shapes({spec.projection_shape(), spec.scores_shape()}, mod_inshapes, mod_indims);
  give_shapes({spec.output_shape()}, outshapes, outdims);
  return 1;
}

// Every input and the output of one type, float32 or bfloat16.
int infer_shared_float_type(int* intypes, int num_in, int* outtypes, int num_out,
                            const char* op) {
  int known = -1;
  for (int i = 0; i < num_in && known < 0; ++i) known = intypes[i];
  if (known < 0) known = outtypes[0];
  check_float32_or_bfloat16(known, op);
  for (int i = 0; i < num_in; ++i) {
    if (intypes[i] >= 0 && intypes[i] != known)
      throw std::invalid_argument("inputs of different data types (flags " +
                                  std::to_string(known) + " and " +
                                  std::to_string(intypes[i]) + ")");
    intypes[i] = known;
  }
  for (int i = 0; i < num_out; ++i) outtypes[i] = known;
  return 1;
}

// The projection float32 or bfloat16; the scores float32 either way.
int selfatt_qk_infer_type(const char* const* keys, const char* const* vals, int num,
                          int* intypes, int num_in, int* outtypes, int num_out) {
  parse_heads(keys, vals, num);
  if (num_in != 1 || num_out != 1) throw std::invalid_argument("expected 1 input and 1 output");
  check_float32_or_bfloat16(intypes[0], kSelfAttQkOpName);
  if (outtypes[0] >= 0 && outtypes[0] != mxamp::kFlagFloat32)
    throw std::invalid_argument("the scores are float32");
  outtypes[0] = mxamp::kFlagFloat32;
  return 1;
}

int selfatt_valatt_infer_type(const char* const* keys, const char* const* vals, int num,
                              int* intypes, int num_in, int* outtypes, int num_out) {
  parse_heads(keys, vals, num);
  return infer_shared_float_type(intypes, num_in, outtypes, num_out, kSelfAttValAttOpName);
}

// The spec of a call whose input `at` is the projection.
mxamp::AttentionSpec call_spec(const Call& c, int at, const char* op) {
  check_float32_or_bfloat16(c.intypes[at], op);
  return mxamp::AttentionSpec::of_projection(c.inshapes[at], c.indims[at],
                                             parse_heads(c.keys, c.vals, c.num), c.intypes[at]);
}

int selfatt_qk_forward(const Call& c) {
  if (c.num_in != 1 || c.num_out != 1) throw std::invalid_argument("expected 1 input and 1 output");
  const mxamp::AttentionSpec spec = call_spec(c, 0, kSelfAttQkOpName);
  check_same_shape("scores", c.outshapes[0], c.outdims[0], spec.scores_shape());
  mxamp::selfatt_qk_forward(spec, c.indata[0], static_cast<float*>(c.outdata[0]), c.scratch);
  return 1;
}

int selfatt_qk_backward(const Call& c) {
  // MXNet's gradient node: inputs (scores' gradient, projection, scores); output the
  // projection's gradient.
  if (c.num_in != 3 || c.num_out != 1) throw std::invalid_argument("expected 3 inputs and 1 output");
  const mxamp::AttentionSpec spec = call_spec(c, 1, kSelfAttQkOpName);
  check_same_shape("scores' gradient", c.inshapes[0], c.indims[0], spec.scores_shape());
  if (c.intypes[0] != mxamp::kFlagFloat32)
    throw std::invalid_argument("the scores' gradient must be float32, as the scores");
  check_same_shape("projection's gradient", c.outshapes[0], c.outdims[0],
                   spec.projection_shape());
  mxamp::selfatt_qk_backward(spec, static_cast<const float*>(c.indata[0]), c.indata[1],
                             c.outdata[0], c.scratch);
  return 1;
}

int selfatt_valatt_forward(const Call& c) {
  if (c.num_in != 2 || c.num_out != 1) throw std::invalid_argument("expected 2 inputs and 1 output");
  const mxamp::AttentionSpec spec = call_spec(c, 0, kSelfAttValAttOpName);
  check_one_type(c.intypes, c.num_in);
  check_same_shape("attention", c.inshapes[1], c.indims[1], spec.scores_shape());
  check_same_shape("output", c.outshapes[0], c.outdims[0], spec.output_shape());
  mxamp::selfatt_valatt_forward(spec, c.indata[0], c.indata[1], c.outdata[0], c.scratch);
  return 1;
}

int selfatt_valatt_backward(const Call& c) {
  // MXNet's gradient node: inputs (output gradient, projection, attention, output); outputs the
  // gradients of (projection, attention).
  if (c.num_in != 4 || c.num_out != 2) throw std::invalid_argument("expected 4 inputs and 2 outputs");
  const mxamp::AttentionSpec spec = call_spec(c, 1, kSelfAttValAttOpName);
  check_one_type(c.intypes, c.num_in);
  check_same_shape("output gradient", c.inshapes[0], c.indims[0], spec.output_shape());
  check_same_shape("attention", c.inshapes[2], c.indims[2], spec.scores_shape());
  mxamp::selfatt_valatt_backward(spec, c.indata[0], c.indata[1], c.indata[2], c.outdata[0],
                                 c.outdata[1], c.scratch);
  return 1;
}

// _mxamp_layer_norm: the attributes of MXNet's LayerNorm (axis: the last only; eps;
// output_mean_var: False only, the mean and variance outputs being the gradient's).
struct LayerNormAttributes {
  int64_t axis = -1;
  float eps = 1e-5f;
};

LayerNormAttributes parse_layer_norm(const char* const* keys, const char* const* vals, int num) {
  LayerNormAttributes a;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    if (key == "axis") {
      a.axis = parse_int(key, value);
    } else if (key == "eps") {
      char* end = nullptr;
      a.eps = std::strtof(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(a.eps >= 0))
        throw std::invalid_argument("eps=" + value + " is not a non-negative number");
    } else if (key == "output_mean_var") {
      if (parse_bool(key, value))
        throw std::invalid_argument("output_mean_var=True: mxamp's layer normalisation keeps "
                                    "its statistics for the gradient");
    } else {
      throw std::invalid_argument("unknown attribute " + key + "=" + value);
    }
  }
  return a;
}

// The spec of data of `shape`; the axis must be its last.
mxamp::LayerNormSpec layer_norm_spec(const LayerNormAttributes& a, const int64_t* shape, int ndim,
                                     int dtype_flag) {
  if (ndim <= 0) throw std::invalid_argument("the data's shape is unknown");
  if (a.axis != -1 && a.axis != ndim - 1)
    throw std::invalid_argument("axis=" + std::to_string(a.axis) +
                                ": mxamp's layer normalisation normalises the last axis only");
  mxamp::LayerNormSpec spec;
  spec.channels = shape[ndim - 1];
  spec.rows = static_cast<int64_t>(element_count(shape, ndim - 1));
  spec.eps = a.eps;
  spec.dtype_flag = dtype_flag;
  return spec;
}

int layer_norm_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                     int* num_out) {
  parse_layer_norm(keys, vals, num);
  *num_in = 3;
  *num_out = 3;
  return 1;
}

int layer_norm_infer_shape(const char* const* keys, const char* const* vals, int num,
                           unsigned int** inshapes, int* indims, int num_in,
                           unsigned int*** mod_inshapes, int** mod_indims,
                           unsigned int*** outshapes, int** outdims, int num_out) {
  const LayerNormAttributes a = parse_layer_norm(keys, vals, num);
  if (num_in != 3 || num_out != 3) throw std::invalid_argument("expected 3 inputs and 3 outputs");
  if (indims[0] <= 0) throw std::invalid_argument("the data's shape is unknown");
  const std::vector<int64_t> data(inshapes[0], inshapes[0] + indims[0]);
  const mxamp::LayerNormSpec spec = layer_norm_spec(a, data.data(), indims[0], 0);
  give_shapes({data, {spec.channels}, {spec.channels}}, mod_inshapes, mod_indims);
  give_shapes({data, {spec.rows}, {spec.rows}}, outshapes, outdims);
  return 1;
}

// Data and output float32 or bfloat16; gamma, beta and the statistics float32.
int layer_norm_infer_type(const char* const* keys, const char* const* vals, int num, int* intypes,
                          int num_in, int* outtypes, int num_out) {
  parse_layer_norm(keys, vals, num);
  if (num_in != 3 || num_out != 3) throw std::invalid_argument("expected 3 inputs and 3 outputs");
  const int known = intypes[0] >= 0 ? intypes[0] : outtypes[0];
  check_float32_or_bfloat16(known, kLayerNormOpName);
  for (int i = 1; i < 3; ++i) {
    if (intypes[i] >= 0 && intypes[i] != mxamp::kFlagFloat32)
      throw std::invalid_argument(std::string(i == 1 ? "gamma" : "beta") + " must be float32");
  }
  intypes[0] = outtypes[0] = known;
  intypes[1] = intypes[2] = outtypes[1] = outtypes[2] = mxamp::kFlagFloat32;
  return 1;
}

int layer_norm_forward(const Call& c) {
  const LayerNormAttributes a = parse_layer_norm(c.keys, c.vals, c.num);
  if (c.num_in != 3 || c.num_out != 3) throw std::invalid_argument("expected 3 inputs and 3 outputs");
  check_float32_or_bfloat16(c.intypes[0], kLayerNormOpName);
  const mxamp::LayerNormSpec spec = layer_norm_spec(a, c.inshapes[0], c.indims[0], c.intypes[0]);
  check_same_shape("gamma", c.inshapes[1], c.indims[1], {spec.channels});
  check_same_shape("beta", c.inshapes[2], c.indims[2], {spec.channels});
  mxamp::layer_norm_forward(spec, c.indata[0], static_cast<const float*>(c.indata[1]),
                            static_cast<const float*>(c.indata[2]), c.outdata[0],
                            static_cast<float*>(c.outdata[1]), static_cast<float*>(c.outdata[2]),
                            c.scratch);
  return 1;
}

int layer_norm_backward(const Call& c) {
  const LayerNormAttributes a = parse_layer_norm(c.keys, c.vals, c.num);
  // MXNet's gradient node: inputs (the 3 outputs' gradients, data, gamma, beta, output, mean,
  // variance); outputs the gradients of (data, gamma, beta).  Nothing reads the statistics:
  // their gradients are zero.
  if (c.num_in != 9 || c.num_out != 3) throw std::invalid_argument("expected 9 inputs and 3 outputs");
  const mxamp::LayerNormSpec spec = layer_norm_spec(a, c.inshapes[3], c.indims[3], c.intypes[3]);
  check_same_shape("output gradient", c.inshapes[0], c.indims[0],
                   std::vector<int64_t>(c.inshapes[3], c.inshapes[3] + c.indims[3]));
  mxamp::layer_norm_backward(spec, c.indata[0], c.indata[3], static_cast<const float*>(c.indata[4]),
                             static_cast<const float*>(c.indata[5]),
                             static_cast<const float*>(c.indata[7]),
                             static_cast<const float*>(c.indata[8]), c.outdata[0],
                             static_cast<float*>(c.outdata[1]), static_cast<float*>(c.outdata[2]),
                             c.scratch);
  return 1;
}

// _mxamp_masked_softmax: axis (the last only: -1, or the last dimension's index).
int64_t parse_masked_softmax(const char* const* keys, const char* const* vals, int num) {
  int64_t axis = -1;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    if (key != "axis")
      throw std::invalid_argument("unknown attribute " + key + "=" + value +
                                  " (mxamp's masked softmax takes axis alone)");
    axis = parse_int(key, value);
  }
  return axis;
}

// The spec of data of `shape` with lengths of type `length_flag`; the axis must be its last.
mxamp::MaskedSoftmaxSpec masked_softmax_spec(int64_t axis, const int64_t* shape, int ndim,
                                             int length_flag) {
  if (ndim <= 0) throw std::invalid_argument("the data's shape is unknown");
  if (axis != -1 && axis != ndim - 1)
    throw std::invalid_argument("axis=" + std::to_string(axis) +
                                ": mxamp's masked softmax computes over the last axis only");
  mxamp::MaskedSoftmaxSpec spec;
  spec.columns = shape[ndim - 1];
  spec.rows = static_cast<int64_t>(element_count(shape, ndim - 1));
  spec.length_flag = length_flag;
  return spec;
}

// The lengths' shape for data of `shape`: the data's without its last axis, (1,) for 1-D data,
// as MXNet's softmax infers it.
std::vector<int64_t> masked_softmax_length_shape(const int64_t* shape, int ndim) {
  if (ndim == 1) return {1};
  return std::vector<int64_t>(shape, shape + ndim - 1);
}

// Throws unless `flag` is unknown (negative), int32 or int64: the lengths MXNet's softmax takes.
void check_length_type(int flag) {
  if (flag >= 0 && flag != mxamp::kFlagInt32 && flag != mxamp::kFlagInt64)
    throw std::invalid_argument("length type flag " + std::to_string(flag) + ": " +
                                kMaskedSoftmaxOpName + " takes int32 or int64 lengths, as "
                                "MXNet's softmax");
}

int masked_softmax_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                         int* num_out) {
  parse_masked_softmax(keys, vals, num);
  *num_in = 2;
  *num_out = 1;
  return 1;
}

int masked_softmax_infer_shape(const char* const* keys, const char* const* vals, int num,
                               unsigned int** inshapes, int* indims, int num_in,
                               unsigned int*** mod_inshapes, int** mod_indims,
                               unsigned int*** outshapes, int** outdims, int num_out) {
  const int64_t axis = parse_masked_softmax(keys, vals, num);
  if (num_in != 2 || num_out != 1) throw std::invalid_argument("expected 2 inputs and 1 output");
  if (indims[0] <= 0) throw std::invalid_argument("the data's shape is unknown");
  const std::vector<int64_t> data(inshapes[0], inshapes[0] + indims[0]);
  masked_softmax_spec(axis, data.data(), indims[0], mxamp::kFlagInt32);
  give_shapes({data, masked_softmax_length_shape(data.data(), indims[0])}, mod_inshapes,
              mod_indims);
  give_shapes({data}, outshapes, outdims);
  return 1;
}

// Data and output float32; the lengths int32 or int64, left as they are.
int masked_softmax_infer_type(const char* const* keys, const char* const* vals, int num,
                              int* intypes, int num_in, int* outtypes, int num_out) {
  parse_masked_softmax(keys, vals, num);
  if (num_in != 2 || num_out != 1) throw std::invalid_argument("expected 2 inputs and 1 output");
  const int known = intypes[0] >= 0 ? intypes[0] : outtypes[0];
  if (known >= 0 && known != mxamp::kFlagFloat32)
    throw std::invalid_argument("data type flag " + std::to_string(known) + ": " +
                                kMaskedSoftmaxOpName + " takes float32 data");
  check_length_type(intypes[1]);
  intypes[0] = outtypes[0] = mxamp::kFlagFloat32;
  return 1;
}

int masked_softmax_forward(const Call& c) {
  const int64_t axis = parse_masked_softmax(c.keys, c.vals, c.num);
  if (c.num_in != 2 || c.num_out != 1) throw std::invalid_argument("expected 2 inputs and 1 output");
  if (c.intypes[0] != mxamp::kFlagFloat32)
    throw std::invalid_argument(std::string(kMaskedSoftmaxOpName) + " takes float32 data");
  check_length_type(c.intypes[1]);
  const mxamp::MaskedSoftmaxSpec spec =
      masked_softmax_spec(axis, c.inshapes[0], c.indims[0], c.intypes[1]);
  check_same_shape("length", c.inshapes[1], c.indims[1],
                   masked_softmax_length_shape(c.inshapes[0], c.indims[0]));
  check_same_shape("output", c.outshapes[0], c.outdims[0],
                   std::vector<int64_t>(c.inshapes[0], c.inshapes[0] + c.indims[0]));
  mxamp::masked_softmax_forward(spec, static_cast<const float*>(c.indata[0]), c.indata[1],
                                static_cast<float*>(c.outdata[0]));
  return 1;
}

int masked_softmax_backward(const Call& c) {
  const int64_t axis = parse_masked_softmax(c.keys, c.vals, c.num);
  // MXNet's gradient node: inputs (output gradient, data, length, output), outputs the
  // gradients of (data, length).
  if (c.num_in != 4 || c.num_out != 2) throw std::invalid_argument("expected 4 inputs and 2 outputs");
  if (c.intypes[0] != mxamp::kFlagFloat32 || c.intypes[3] != mxamp::kFlagFloat32)
    throw std::invalid_argument(std::string(kMaskedSoftmaxOpName) + " takes float32 data");
  check_length_type(c.intypes[2]);
  const mxamp::MaskedSoftmaxSpec spec =
      masked_softmax_spec(axis, c.inshapes[1], c.indims[1], c.intypes[2]);
  const std::vector<int64_t> shape(c.inshapes[1], c.inshapes[1] + c.indims[1]);
  check_same_shape("output gradient", c.inshapes[0], c.indims[0], shape);
  check_same_shape("output", c.inshapes[3], c.indims[3], shape);
  check_same_shape("length", c.inshapes[2], c.indims[2],
                   masked_softmax_length_shape(shape.data(), c.indims[1]));
  mxamp::masked_softmax_backward(spec, static_cast<const float*>(c.indata[0]),
                                 static_cast<const float*>(c.indata[3]), c.indata[2],
                                 static_cast<float*>(c.outdata[0]));
  // The length's gradient: zero, as MXNet's softmax writes it (same type as the length).
  if (c.outdata[1] != nullptr)
    std::memset(c.outdata[1], 0,
                element_count(c.outshapes[1], c.outdims[1]) *
                    (c.intypes[2] == mxamp::kFlagInt64 ? sizeof(int64_t) : sizeof(int32_t)));
  return 1;
}

// _mxamp_dropout: the attributes of MXNet's Dropout (p, default 0.5; mode training or always,
// both dropping here; axes empty: a mask shared along axes is MXNet's alone; cudnn_off ignored).
float parse_dropout(const char* const* keys, const char* const* vals, int num) {
  float p = 0.5f;
  for (int i = 0; i < num; ++i) {
    const std::string key(keys[i]), value(vals[i]);
    if (key.compare(0, 2, "__") == 0) continue;
    if (key == "p") {
      p = parse_float(key, value);
      mxamp::check_dropout_probability(p);
    } else if (key == "mode") {
      if (value != "training" && value != "always")
        throw std::invalid_argument("mode=" + value + ": expected training or always");
    } else if (key == "axes") {
      if (!parse_tuple(key, value).empty())
        throw std::invalid_argument("axes=" + value + ": mxamp's dropout takes no axes");
    } else if (key != "cudnn_off") {
      throw std::invalid_argument("unknown attribute " + key + "=" + value);
    }
  }
  return p;
}

void check_dropout_counts(int num_in, int num_out) {
  if (num_in != 1 || num_out != 2) throw std::invalid_argument("expected 1 input and 2 outputs");
}

int dropout_parse(const char* const* keys, const char* const* vals, int num, int* num_in,
                  int* num_out) {
  parse_dropout(keys, vals, num);
  *num_in = 1;
  *num_out = 2;
  return 1;
}

// The output takes the data's shape; the mask one bit a value, (bytes,).
std::vector<int64_t> dropout_mask_shape(const int64_t* shape, int ndim) {
  return {static_cast<int64_t>((element_count(shape, ndim) + 7) / 8)};
}

int dropout_infer_shape(const char* const* keys, const char* const* vals, int num,
                        unsigned int** inshapes, int* indims, int num_in,
                        unsigned int*** mod_inshapes, int** mod_indims,
                        unsigned int*** outshapes, int** outdims, int num_out) {
  parse_dropout(keys, vals, num);
  check_dropout_counts(num_in, num_out);
  if (indims[0] <= 0) throw std::invalid_argument("the data's shape is unknown");
  const std::vector<int64_t> shape(inshapes[0], inshapes[0] + indims[0]);
  give_shapes({shape}, mod_inshapes, mod_indims);
  give_shapes({shape, dropout_mask_shape(shape.data(), indims[0])}, outshapes, outdims);
  return 1;
}

// Data and output float32 or bfloat16; the mask uint8.
int dropout_infer_type(const char* const* keys, const char* const* vals, int num, int* intypes,
                       int num_in, int* outtypes, int num_out) {
  parse_dropout(keys, vals, num);
  check_dropout_counts(num_in, num_out);
  const int known = intypes[0] >= 0 ? intypes[0] : outtypes[0];
  check_float32_or_bfloat16(known, kDropoutOpName);
  intypes[0] = outtypes[0] = known;
  outtypes[1] = kFlagUInt8;
  return 1;
}

// A seed for one forward call: two draws from the first of MXNet's CPU random states, the
// engines of its parallel random resource, which mx.random.seed reseeds.  The engine runs one
// operator holding that resource at a time.
uint64_t draw_seed(void* rng_cpu_states) {
  if (rng_cpu_states == nullptr) throw std::invalid_argument("MXNet passed no CPU random states");
  std::mt19937& engine = *static_cast<std::mt19937*>(rng_cpu_states);
  const uint64_t high = engine();
  return high << 32 | engine();
}

int dropout_forward(const Call& c) {
  const float p = parse_dropout(c.keys, c.vals, c.num);
  check_dropout_counts(c.num_in, c.num_out);
  check_float32_or_bfloat16(c.intypes[0], kDropoutOpName);
  const std::vector<int64_t> shape(c.inshapes[0], c.inshapes[0] + c.indims[0]);
  check_same_shape("output", c.outshapes[0], c.outdims[0], shape);
  check_same_shape("mask", c.outshapes[1], c.outdims[1],
                   dropout_mask_shape(shape.data(), c.indims[0]));
  mxamp::dropout_forward(c.indata[0], c.outdata[0], static_cast<uint8_t*>(c.outdata[1]),
                         element_count(c.inshapes[0], c.indims[0]), p,
                         draw_seed(c.rng_cpu_states), c.intypes[0] == mxamp::kFlagBFloat16);
  return 1;
}

int dropout_backward(const Call& c) {
  const float p = parse_dropout(c.keys, c.vals, c.num);
  // MXNet's gradient node: inputs (output gradient, mask gradient, data, output, mask); output
  // the data's gradient.  Nothing reads the mask: its gradient is zero.
  if (c.num_in != 5 || c.num_out != 1) throw std::invalid_argument("expected 5 inputs and 1 output");
  check_float32_or_bfloat16(c.intypes[0], kDropoutOpName);
  const std::vector<int64_t> shape(c.outshapes[0], c.outshapes[0] + c.outdims[0]);
  check_same_shape("output gradient", c.inshapes[0], c.indims[0], shape);
  check_same_shape("mask", c.inshapes[4], c.indims[4],
                   dropout_mask_shape(shape.data(), c.outdims[0]));
  if (c.intypes[0] != c.intypes[2] || c.intypes[4] != kFlagUInt8)
    throw std::invalid_argument("the output gradient must have the data's type, the mask uint8");
  mxamp::dropout_backward(c.indata[0], static_cast<const uint8_t*>(c.indata[4]), c.outdata[0],
                          element_count(c.outshapes[0], c.outdims[0]), p,
                          c.intypes[0] == mxamp::kFlagBFloat16);
  return 1;
}

// One registered operator: its name and functions.  No backward: MXNet registers no gradient.
struct Operator {
  const char* name;
  RawParse parse;
  RawInferShape infer_shape;
  RawInferType infer_type;
  mxnet::ext::fcomp_t forward[1];
  mxnet::ext::fcomp_t backward[1];
  int backward_count;
  RawMutate mutate;  // null: mutates no input
};

const char* cpu_only[] = {"cpu"};
Operator operators[] = {
    {kConvOpName, &parse_counts, &infer_shape, &infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&compute_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&compute_backward)}, 1, nullptr},
    {kFollowOpName, &follow_parse, &follow_infer_shape, &follow_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&follow_compute)}, {nullptr}, 0, nullptr},
    {kBatchNormOpName, &batch_norm_parse, &batch_norm_infer_shape, &batch_norm_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&batch_norm_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&batch_norm_backward)}, 1, &batch_norm_mutate},
    {kFanOutOpName, &fan_out_parse, &fan_out_infer_shape, &fan_out_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&fan_out_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&fan_out_backward)}, 1, nullptr},
    {kSgdStepOpName, &sgd_step_parse, &sgd_step_infer_shape, &sgd_step_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&sgd_step_compute)}, {nullptr}, 0, &sgd_step_mutate},
    {kAdamStepOpName, &adam_step_parse, &adam_step_infer_shape, &adam_step_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&adam_step_compute)}, {nullptr}, 0,
     &adam_step_mutate},
    {kMoveChannelsOpName, &move_channels_parse, &move_channels_infer_shape,
     &move_channels_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&move_channels_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&move_channels_backward)}, 1, nullptr},
    {kPoolingOpName, &pooling_parse, &pooling_infer_shape, &pooling_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&pooling_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&pooling_backward)}, 1, nullptr},
    {kClipOpName, &clip_parse, &clip_infer_shape, &clip_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&clip_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&clip_backward)}, 1, nullptr},
    {kSelfAttQkOpName, &selfatt_qk_parse, &selfatt_qk_infer_shape, &selfatt_qk_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&selfatt_qk_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&selfatt_qk_backward)}, 1, nullptr},
    {kSelfAttValAttOpName, &selfatt_valatt_parse, &selfatt_valatt_infer_shape,
     &selfatt_valatt_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&selfatt_valatt_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&selfatt_valatt_backward)}, 1, nullptr},
    {kLayerNormOpName, &layer_norm_parse, &layer_norm_infer_shape, &layer_norm_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&layer_norm_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&layer_norm_backward)}, 1, nullptr},
    {kMaskedSoftmaxOpName, &masked_softmax_parse, &masked_softmax_infer_shape,
     &masked_softmax_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&masked_softmax_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&masked_softmax_backward)}, 1, nullptr},
    {kDropoutOpName, &dropout_parse, &dropout_infer_shape, &dropout_infer_type,
     {reinterpret_cast<mxnet::ext::fcomp_t>(&dropout_forward)},
     {reinterpret_cast<mxnet::ext::fcomp_t>(&dropout_backward)}, 1, nullptr},
};
constexpr int kOperatorCount = sizeof(operators) / sizeof(operators[0]);

}  // namespace

#pragma GCC visibility push(default)
extern "C" {

int _opVersion() { return MX_LIBRARY_VERSION; }

mxnet::ext::MXReturnValue initialize(int version) {
  // 1.9.x only: the ABI (checked by MXNet through _opVersion) is that of 1.9.
  if (version / 100 != 109) {
    last_error = "mxamp's convolution is built for MXNet 1.9, not " + std::to_string(version);
    return mxnet::ext::MX_FAIL;
  }
  return mxnet::ext::MX_SUCCESS;
}

int _msgSize() { return last_error.empty() ? 0 : 1; }

void _msgGet(int, const char** msg) { *msg = last_error.c_str(); }

int _opRegSize() { return kOperatorCount; }

void _opRegGet(int index, const char** name, int* isSGop, const char*** forward_ctx_out,
               mxnet::ext::fcomp_t** forward_fp_out, int* forward_count,
               const char*** backward_ctx_out, mxnet::ext::fcomp_t** backward_fp_out,
               int* backward_count, const char*** create_op_ctx,
               mxnet::ext::createOpState_t** create_op_fp, int* create_op_count,
               mxnet::ext::parseAttrs_t* parse, mxnet::ext::inferType_t* type,
               mxnet::ext::inferSType_t* stype, mxnet::ext::inferShape_t* shape,
               mxnet::ext::mutateInputs_t* mutate) {
  Operator& op = operators[index];
  *name = op.name;
  *isSGop = 0;
  *forward_ctx_out = cpu_only;
  *forward_fp_out = op.forward;
  *forward_count = 1;
  *backward_ctx_out = cpu_only;
  *backward_fp_out = op.backward;
  *backward_count = op.backward_count;
  *create_op_ctx = nullptr;
  *create_op_fp = nullptr;
  *create_op_count = 0;
  *parse = reinterpret_cast<mxnet::ext::parseAttrs_t>(op.parse);
  *type = reinterpret_cast<mxnet::ext::inferType_t>(op.infer_type);
  *shape = reinterpret_cast<mxnet::ext::inferShape_t>(op.infer_shape);
  *stype = reinterpret_cast<mxnet::ext::inferSType_t>(&dense_storage);
  *mutate = reinterpret_cast<mxnet::ext::mutateInputs_t>(op.mutate);
}

void _opCallFree(void* ptr) { std::free(ptr); }

int _opCallParseAttrs(mxnet::ext::parseAttrs_t parseAttrs, const char* const* keys,
                      const char* const* vals, int num, int* num_in, int* num_out) {
  last_error.clear();
  try {
    return reinterpret_cast<RawParse>(parseAttrs)(keys, vals, num, num_in, num_out);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

int _opCallInferShape(mxnet::ext::inferShape_t inferShape, const char* const* keys,
                      const char* const* vals, int num, unsigned int** inshapes, int* indims,
                      int num_in, unsigned int*** mod_inshapes, int** mod_indims,
                      unsigned int*** outshapes, int** outdims, int num_out) {
  last_error.clear();
  try {
    return reinterpret_cast<RawInferShape>(inferShape)(keys, vals, num, inshapes, indims, num_in,
                                                       mod_inshapes, mod_indims, outshapes,
                                                       outdims, num_out);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

int _opCallInferType(mxnet::ext::inferType_t inferType, const char* const* keys,
                     const char* const* vals, int num, int* intypes, int num_in, int* outtypes,
                     int num_out) {
  last_error.clear();
  try {
    return reinterpret_cast<RawInferType>(inferType)(keys, vals, num, intypes, num_in, outtypes,
                                                     num_out);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}
int _opCallInferSType(mxnet::ext::inferSType_t inferSType, const char* const* keys,
                      const char* const* vals, int num, int* instypes, int num_in, int* outstypes,
                      int num_out) {
  last_error.clear();
  try {
    return reinterpret_cast<RawInferSType>(inferSType)(keys, vals, num, instypes, num_in,
                                                       outstypes, num_out);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

int _opCallFCompute(mxnet::ext::fcomp_t fcomp, const char* const* keys, const char* const* vals,
                    int num, const int64_t** inshapes, int* indims, void** indata, int* intypes,
                    size_t*, const char** indev_type, int*, int num_in,
                    const int64_t** outshapes, int* outdims, void** outdata, int*, size_t*,
                    const char**, int*, int num_out, mxnet::ext::xpu_malloc_t cpu_malloc,
                    void* cpu_alloc, mxnet::ext::xpu_malloc_t, void*, void*,
                    mxnet::ext::sparse_malloc_t, void*, int* instypes, int*, void**, void**,
                    void**, void**, int64_t*, int64_t*, int64_t*, int64_t*, void* rng_cpu_states,
                    void*) {
  last_error.clear();
  try {
    for (int i = 0; i < num_in; ++i) {
      if (std::strcmp(indev_type[i], "cpu") != 0 || instypes[i] != 0)
        throw std::invalid_argument("mxamp's operators take dense CPU arrays only");
    }
    Call call = {keys, vals, num, inshapes, indims, indata, intypes, num_in,
                 outshapes, outdims, outdata, num_out,
                 [cpu_malloc, cpu_alloc](size_t bytes) -> void* {
                   if (bytes > static_cast<size_t>(INT32_MAX))
                     throw std::runtime_error("needs " + std::to_string(bytes) +
                                              " bytes of temporary memory; MXNet gives at most "
                                              "2 GiB to an extension");
                   return cpu_malloc(cpu_alloc, static_cast<int>(bytes));
                 },
                 rng_cpu_states};
    return reinterpret_cast<RawCompute>(fcomp)(call);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

int _opCallMutateInputs(mxnet::ext::mutateInputs_t mutate, const char* const* keys,
                        const char* const* vals, int num, int** indices, int* count) {
  last_error.clear();
  try {
    return reinterpret_cast<RawMutate>(mutate)(keys, vals, num, indices, count);
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

int _opCallCreateOpState(mxnet::ext::createOpState_t, const char* const*, const char* const*, int,
                         const char*, int, unsigned int**, int*, int, const int*, void**) {
  return fail("mxamp's operators are stateless");
}

void _opCallDestroyOpState(void*) {}

int _opCallFStatefulCompute(int, void*, const int64_t**, int*, void**, int*, size_t*,
                            const char**, int*, int, const int64_t**, int*, void**, int*, size_t*,
                            const char**, int*, int, mxnet::ext::xpu_malloc_t, void*,
                            mxnet::ext::xpu_malloc_t, void*, void*, mxnet::ext::sparse_malloc_t,
                            void*, int*, int*, void**, void**, void**, void**, int64_t*, int64_t*,
                            int64_t*, int64_t*, void*, void*) {
  return fail("mxamp's operators are stateless");
}

// No partitioners and no graph passes; MXNet looks these up all the same.
int _partRegSize() { return 0; }
int _partRegGetCount(int, const char**) { return 0; }
void _partRegGet(int, int, const char**, mxnet::ext::supportedOps_t*,
                 mxnet::ext::createSelector_t*, mxnet::ext::reviewSubgraph_t*, const char**) {}
int _partCallSupportedOps(mxnet::ext::supportedOps_t, const char*, int, int*, const char* const*,
                          const char* const*, int) {
  return 0;
}
int _partCallCreateSelector(mxnet::ext::createSelector_t, const char*, void**,
                            const char* const*, const char* const*, int) {
  return 0;
}
void _partCallSelect(void*, int, int*) {}
void _partCallSelectInput(void*, int, int, int*) {}
void _partCallSelectOutput(void*, int, int, int*) {}
void _partCallFilter(void*, int*, int, int**, int*) {}
void _partCallReset(void*) {}
int _partCallReviewSubgraph(mxnet::ext::reviewSubgraph_t, const char*, int, int*,
                            const char* const*, const char* const*, int, char***, char***, int*,
                            const char* const*, int, void* const*, const int64_t* const*,
                            const int*, const int*, const size_t*, const char* const*, const int*,
                            const char* const*, int, void* const*, const int64_t* const*,
                            const int*, const int*, const size_t*, const char* const*,
                            const int*) {
  return 0;
}
int _passRegSize() { return 0; }
void _passRegGet(int, mxnet::ext::graphPass_t*, const char**) {}
int _passCallGraphPass(mxnet::ext::graphPass_t, const char*, char**, const char* const*,
                       const char* const*, int, const char*, const char* const*, int,
                       void* const*, const int64_t* const*, const int*, const int*,
                       const size_t*, const char* const*, const int*, const char* const*, int,
                       void* const*, const int64_t* const*, const int*, const int*,
                       const size_t*, const char* const*, const int*, mxnet::ext::nd_malloc_t,
                       const void*) {
  return 0;
}

// For mxamp.kernels.operators (ctypes).  Strings live until the next call on the same thread.
const char* mxamp_own_conv_onednn_version() {
  static const std::string version = mxamp::onednn_version();
  return version.c_str();
}

const char* mxamp_own_conv_cpu_isa() {
  static const std::string isa = mxamp::onednn_cpu_isa();
  return isa.c_str();
}

// The kernels of one convolution (attributes as MXNet passes them), or null: see the last error.
const char* mxamp_own_conv_kernels(const char* const* keys, const char* const* vals, int num,
                                   const int64_t* data_shape, int ndim, int dtype_flag) {
  thread_local std::string text;
  last_error.clear();
  try {
    text = mxamp::describe_kernels(parse_attributes(keys, vals, num).spec(data_shape, ndim,
                                                                          dtype_flag));
    return text.c_str();
  } catch (const std::exception& e) {
    fail(e.what());
    return nullptr;
  }
}

const char* mxamp_own_conv_last_error() { return last_error.c_str(); }

}  // extern "C"
#pragma GCC visibility pop
