// mxamp's own layer normalisation on oneDNN 3 (see onednn_layer_norm.h).
//
// The data is viewed as (rows, channels), MXNet's layout; each distinct spec gets its
// primitives once, kept for the life of the process.
#include "onednn_layer_norm.h"

#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "onednn_runtime.h"

namespace mxamp {
namespace {

using dnnl::memory;

const dnnl::normalization_flags kFlags =
    dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;

class LayerNorm {
 public:
  explicit LayerNorm(const LayerNormSpec& spec) {
    const memory::data_type type = onednn_type(spec.dtype_flag);
    data_ = plain_desc({spec.rows, spec.channels}, type);
    statistics_ = plain_desc({spec.rows}, memory::data_type::f32);
    channel_ = plain_desc({spec.channels}, memory::data_type::f32);
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    forward_pd_ = dnnl::layer_normalization_forward::primitive_desc(
        cpu_engine(), dnnl::prop_kind::forward_training, data_, data_, statistics_, spec.eps,
        kFlags, attr);
    forward_ = dnnl::layer_normalization_forward(forward_pd_);
    backward_pd_ = dnnl::layer_normalization_backward::primitive_desc(
        cpu_engine(), dnnl::prop_kind::backward, data_, data_, data_, statistics_, spec.eps,
        kFlags, forward_pd_, attr);
    backward_ = dnnl::layer_normalization_backward(backward_pd_);
  }

  void forward(const void* data, const float* gamma, const float* beta, void* output,
               float* mean, float* variance, const Scratch& scratch) const {
    dnnl::engine& engine = cpu_engine();
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, memory(data_, engine, const_cast<void*>(data))},
        {DNNL_ARG_SCALE, memory(channel_, engine, const_cast<float*>(gamma))},
        {DNNL_ARG_SHIFT, memory(channel_, engine, const_cast<float*>(beta))},
        {DNNL_ARG_DST, memory(data_, engine, output)},
        {DNNL_ARG_MEAN, memory(statistics_, engine, mean)},
        {DNNL_ARG_VARIANCE, memory(statistics_, engine, variance)}};
    run(forward_, forward_pd_.scratchpad_desc(), scratch, &args);
  }

  void backward(const void* output_grad, const void* data, const float* gamma,
                const float* beta, const float* mean, const float* variance, void* data_grad, float* gamma_grad,
                float* beta_grad, const Scratch& scratch) const {
    dnnl::engine& engine = cpu_engine();
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, memory(data_, engine, const_cast<void*>(data))},
        {DNNL_ARG_DIFF_DST, memory(data_, engine, const_cast<void*>(output_grad))},
        {DNNL_ARG_MEAN, memory(statistics_, engine, const_cast<float*>(mean))},
        {DNNL_ARG_VARIANCE, memory(statistics_, engine, const_cast<float*>(variance))},
        {DNNL_ARG_SCALE, memory(channel_, engine, const_cast<float*>(gamma))},
        // Unread by the gradient, but oneDNN 3.2 counts it among use_shift's inputs.
        {DNNL_ARG_SHIFT, memory(channel_, engine, const_cast<float*>(beta))},
        {DNNL_ARG_DIFF_SRC, memory(data_, engine, data_grad)},
        {DNNL_ARG_DIFF_SCALE, memory(channel_, engine, gamma_grad)},
        {DNNL_ARG_DIFF_SHIFT, memory(channel_, engine, beta_grad)}};
    run(backward_, backward_pd_.scratchpad_desc(), scratch, &args);
  }

 private:
  static void run(const dnnl::primitive& primitive, const memory::desc& pad,
                  const Scratch& scratch, std::unordered_map<int, memory>* args) {
    if (pad.get_size() != 0)
      args->emplace(DNNL_ARG_SCRATCHPAD,
                    memory(pad, cpu_engine(), scratch_memory(scratch, pad.get_size())));
    primitive.execute(thread_stream(), *args);
    thread_stream().wait();
  }

  memory::desc data_, statistics_, channel_;
  dnnl::layer_normalization_forward::primitive_desc forward_pd_;
  dnnl::layer_normalization_forward forward_;
  dnnl::layer_normalization_backward::primitive_desc backward_pd_;
  dnnl::layer_normalization_backward backward_;
};

std::string describe(const LayerNormSpec& spec) {
  return std::string(dtype_name(spec.dtype_flag)) + " layer normalisation of " +
         std::to_string(spec.rows) + " rows of " + std::to_string(spec.channels) + " (eps " +
         std::to_string(spec.eps) + ")";
}

std::mutex cache_mutex;
std::unordered_map<std::string, std::unique_ptr<LayerNorm>> cache;

const LayerNorm& primitives(const LayerNormSpec& spec) {
  if (spec.rows <= 0 || spec.channels <= 0)
    throw std::invalid_argument("the data's shape must be known and positive");
  if (spec.dtype_flag != kFlagFloat32 && spec.dtype_flag != kFlagBFloat16)
    throw std::invalid_argument("mxamp's layer normalisation takes float32 or bfloat16 data");
  // The key holds eps exactly (std::to_string rounds to 6 decimals).
  uint32_t eps_bits = 0;
  std::memcpy(&eps_bits, &spec.eps, sizeof eps_bits);
  const std::string key = describe(spec) + "/" + std::to_string(eps_bits);
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto found = cache.find(key);
  if (found == cache.end()) {
    try {
      found = cache.emplace(key, std::unique_ptr<LayerNorm>(new LayerNorm(spec))).first;
    } catch (const dnnl::error& e) {
      throw std::runtime_error("oneDNN " + onednn_version() + " has no kernel for the " +
                               describe(spec) + " on this CPU (" + onednn_cpu_isa() +
                               "): " + e.what());
    }
  }
  return *found->second;
}

}  // namespace

void layer_norm_forward(const LayerNormSpec& spec, const void* data, const float* gamma,
                        const float* beta, void* output, float* mean, float* variance,
                        const Scratch& scratch) {
  primitives(spec).forward(data, gamma, beta, output, mean, variance, scratch);
}

void layer_norm_backward(const LayerNormSpec& spec, const void* output_grad, const void* data,
                         const float* gamma, const float* beta, const float* mean, const float* variance,
                         void* data_grad, float* gamma_grad, float* beta_grad,
                         const Scratch& scratch) {
  primitives(spec).backward(output_grad, data, gamma, beta, mean, variance, data_grad, gamma_grad,
                            beta_grad, scratch);
}

}  // namespace mxamp
