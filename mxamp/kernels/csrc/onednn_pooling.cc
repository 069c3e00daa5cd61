// mxamp's own pooling on oneDNN 3 (see onednn_pooling.h).
//
// Each distinct spec gets its primitives once, kept for the life of the process.  oneDNN reads
// and writes MXNet's arrays where they are, in their plain layout; nothing is reordered.
#include "onednn_pooling.h"

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "onednn_runtime.h"

namespace mxamp {
namespace {

using dnnl::memory;

class Pooling {
 public:
  explicit Pooling(const PoolingSpec& spec) : spec_(spec) {
    const memory::data_type type = onednn_type(spec.dtype_flag);
    const std::vector<int64_t> out_shape = spec.output_shape();
    memory::dims data = {spec.data_shape[0], spec.channels()};
    memory::dims output = {spec.data_shape[0], spec.channels()};
    memory::dims strides, kernel, dilation, padding;
    for (size_t i = 0; i < spec.kernel.size(); ++i) {
      data.push_back(spec.spatial_size(i));
      output.push_back(out_shape[spec.channels_last ? i + 1 : i + 2]);
      strides.push_back(spec.stride[i]);
      kernel.push_back(spec.kernel[i]);
      dilation.push_back(0);
      padding.push_back(spec.pad[i]);
    }
    data_ = activation_desc(data, type, spec.channels_last);
    output_ = activation_desc(output, type, spec.channels_last);
    algorithm_ = spec.max ? dnnl::algorithm::pooling_max
                 : spec.count_include_pad ? dnnl::algorithm::pooling_avg_include_padding
                                          : dnnl::algorithm::pooling_avg_exclude_padding;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    // Always training: the extension ABI does not say whether MXNet is, and only a training
    // forward writes the workspace max pooling's gradient needs.
    forward_pd_ = dnnl::pooling_forward::primitive_desc(
        cpu_engine(), dnnl::prop_kind::forward_training, algorithm_, data_, output_, strides,
        kernel, dilation, padding, padding, attr);
    forward_ = dnnl::pooling_forward(forward_pd_);
    strides_ = strides;
    kernel_ = kernel;
    dilation_ = dilation;
    padding_ = padding;
  }

  size_t workspace_bytes() const { return spec_.max ? forward_pd_.workspace_desc().get_size() : 0; }

  void make_backward() {
    if (has_backward_) return;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    backward_pd_ = dnnl::pooling_backward::primitive_desc(
        cpu_engine(), algorithm_, data_, output_, strides_, kernel_, dilation_, padding_,
        padding_, forward_pd_, attr);
    backward_ = dnnl::pooling_backward(backward_pd_);
    has_backward_ = true;
  }

  void forward(const void* data, void* output, void* workspace, const Scratch& scratch) const {
    dnnl::engine& engine = cpu_engine();
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, memory(data_, engine, const_cast<void*>(data))},
        {DNNL_ARG_DST, memory(output_, engine, output)}};
    add_scratchpad(forward_pd_.scratchpad_desc(), scratch, &args);
    if (spec_.max) args.emplace(DNNL_ARG_WORKSPACE,
                                memory(forward_pd_.workspace_desc(), engine, workspace));
    forward_.execute(thread_stream(), args);
    thread_stream().wait();
  }

  void backward(const void* output_grad, const void* workspace, void* data_grad,
                const Scratch& scratch) const {
    dnnl::engine& engine = cpu_engine();
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_DIFF_DST, memory(output_, engine, const_cast<void*>(output_grad))},
        {DNNL_ARG_DIFF_SRC, memory(data_, engine, data_grad)}};
    add_scratchpad(backward_pd_.scratchpad_desc(), scratch, &args);
    if (spec_.max) args.emplace(DNNL_ARG_WORKSPACE, memory(forward_pd_.workspace_desc(), engine,
                                                           const_cast<void*>(workspace)));
    backward_.execute(thread_stream(), args);
    thread_stream().wait();
  }

 private:
  static void add_scratchpad(const memory::desc& desc, const Scratch& scratch,
                             std::unordered_map<int, memory>* args) {
    if (desc.get_size() == 0) return;
    args->emplace(DNNL_ARG_SCRATCHPAD,
                  memory(desc, cpu_engine(), scratch_memory(scratch, desc.get_size())));
  }

  PoolingSpec spec_;
  memory::desc data_, output_;
  memory::dims strides_, kernel_, dilation_, padding_;
  dnnl::algorithm algorithm_;
  dnnl::pooling_forward::primitive_desc forward_pd_;
  dnnl::pooling_forward forward_;
  dnnl::pooling_backward::primitive_desc backward_pd_;
  dnnl::pooling_backward backward_;
  bool has_backward_ = false;
};

std::string describe(const PoolingSpec& spec) {
  auto tuple = [](const std::vector<int64_t>& v) {
    std::string text = "(";
    for (size_t i = 0; i < v.size(); ++i) text += (i ? ", " : "") + std::to_string(v[i]);
    return text + ")";
  };
  return std::string(dtype_name(spec.dtype_flag)) + (spec.max ? " max" : " average") +
         " pooling of data " + tuple(spec.data_shape) +
         (spec.channels_last ? " channels last" : "") +
         " kernel " + tuple(spec.kernel) + " stride " + tuple(spec.stride) + " pad " +
         tuple(spec.pad) + (!spec.max && !spec.count_include_pad ? " padding not counted" : "");
}

std::mutex cache_mutex;
std::unordered_map<std::string, std::unique_ptr<Pooling>> cache;

Pooling& primitives(const PoolingSpec& spec, bool with_backward) {
  const std::string key = describe(spec);  // every field that makes the primitives
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto found = cache.find(key);
  try {
    if (found == cache.end()) {
      spec.validate();
      found = cache.emplace(key, std::unique_ptr<Pooling>(new Pooling(spec))).first;
    }
    if (with_backward) found->second->make_backward();
  } catch (const dnnl::error& e) {
    throw std::runtime_error("oneDNN " + onednn_version() + " has no " +
                             std::string(with_backward ? "backward " : "forward ") +
                             "kernel for the " + describe(spec) + " on this CPU (" +
                             onednn_cpu_isa() + "): " + e.what());
  }
  return *found->second;
}

}  // namespace

void PoolingSpec::validate() const {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(what + " (" + describe(*this) + ")");
  };
  const size_t spatial = kernel.size();
  if (spatial < 1 || spatial > 3) fail("kernel must have 1 to 3 dimensions");
  if (data_shape.size() != spatial + 2)
    fail("data must have " + std::to_string(spatial + 2) + " dimensions for a " +
         std::to_string(spatial) + "-D kernel");
  if (stride.size() != spatial || pad.size() != spatial)
    fail("stride and pad must have as many dimensions as kernel");
  if (dtype_flag != kFlagFloat32 && dtype_flag != kFlagBFloat16)
    fail("mxamp's pooling takes float32 or bfloat16 data");
  for (int64_t d : data_shape)
    if (d <= 0) fail("data shape must be known and positive");
  for (size_t i = 0; i < spatial; ++i) {
    if (kernel[i] <= 0 || stride[i] <= 0 || pad[i] < 0)
      fail("kernel and stride must be positive and pad non-negative");
    // oneDNN, like MXNet, refuses a window that lies wholly in the padding.
    if (pad[i] >= kernel[i]) fail("pad must be smaller than kernel");
  }
  for (int64_t d : output_shape())
    if (d <= 0) fail("the kernel does not fit in the padded data");
}

std::vector<int64_t> PoolingSpec::output_shape() const {
  // MXNet's 'valid' convention: windows wholly inside the padded data.
  std::vector<int64_t> shape = {data_shape[0]};
  if (!channels_last) shape.push_back(channels());
  for (size_t i = 0; i < kernel.size(); ++i)
    shape.push_back((spatial_size(i) + 2 * pad[i] - kernel[i]) / stride[i] + 1);
  if (channels_last) shape.push_back(channels());
  return shape;
}

size_t pooling_workspace_bytes(const PoolingSpec& spec) {
  return primitives(spec, false).workspace_bytes();
}

void pooling_forward(const PoolingSpec& spec, const void* data, void* output, void* workspace,
                     const Scratch& scratch) {
  primitives(spec, false).forward(data, output, workspace, scratch);
}

void pooling_backward(const PoolingSpec& spec, const void* output_grad, const void* workspace,
                      void* data_grad, const Scratch& scratch) {
  primitives(spec, true).backward(output_grad, workspace, data_grad, scratch);
}

}  // namespace mxamp
