// mxamp's own batch normalisation on oneDNN 3 (see onednn_batch_norm.h).
//
// Each distinct spec gets its primitives once, kept for the life of the process (none where
// bfloat16_batch_norm.h's loops serve it).  oneDNN reads and writes MXNet's arrays where they
// are: data and output in their plain layout, gamma, beta and the statistics as float32 vectors;
// nothing is reordered.
#include "onednn_batch_norm.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "bfloat16_batch_norm.h"
#include "fan_out.h"
#include "onednn_runtime.h"

namespace mxamp {
namespace {

using dnnl::memory;

class BatchNorm {
 public:
  explicit BatchNorm(const BatchNormSpec& spec)
      : spec_(spec), loops_(spec.dtype_flag == kFlagBFloat16 && spec.channels_last &&
                            !spec.use_global_stats && bfloat16_batch_norm_runs_here()) {
    // The loops' view of channels-last data; its size, in values, in either layout.
    rows_.channels = spec.channels();
    rows_.rows = 1;
    for (int64_t d : spec.data_shape) rows_.rows *= d;
    rows_.rows /= rows_.channels;
    if (loops_) return;
    memory::dims dims = {spec.data_shape[0], spec.channels()};
    const size_t spatial = spec.data_shape.size() - 2;
    for (size_t i = 0; i < spatial; ++i)
      dims.push_back(spec.data_shape[spec.channels_last ? i + 1 : i + 2]);
    data_ = activation_desc(dims, onednn_type(spec.dtype_flag), spec.channels_last);
    vector_ = memory::desc({spec.channels()}, memory::data_type::f32, memory::format_tag::a);
    flags_ = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
    if (spec.use_global_stats) flags_ |= dnnl::normalization_flags::use_global_stats;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    // The fused ReLU, forward and backward: the forward's workspace (a bit per value on the jit
    // kernels) is an output MXNet keeps for the backward pass, which saves the backward a pass
    // of its own over the gradient (measured on ResNet-50: 48 such passes, 30 ms a step).
    if (spec.relu_workspace()) flags_ |= dnnl::normalization_flags::fuse_norm_relu;
    // Training, also under global statistics: only a training forward writes the workspace.
    forward_pd_ = dnnl::batch_normalization_forward::primitive_desc(
        cpu_engine(),
        spec.use_global_stats && !spec.relu_workspace() ? dnnl::prop_kind::forward_inference
                                                        : dnnl::prop_kind::forward_training,
        data_, data_, spec.eps, flags_, attr);
    forward_ = dnnl::batch_normalization_forward(forward_pd_);
    if (spec.residual) {
      // The residual is added to the output in place, the ReLU as the sum's post-op: one more
      // pass, which MXNet's addition and ReLU took two of.
      dnnl::primitive_attr sum_attr;
      sum_attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      if (spec.relu) {
        dnnl::post_ops relu;
        relu.append_eltwise(dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
        sum_attr.set_post_ops(relu);
      }
      residual_pd_ = dnnl::binary::primitive_desc(cpu_engine(), dnnl::algorithm::binary_add, data_,
                                                  data_, data_, sum_attr);
      residual_ = dnnl::binary(residual_pd_);
    }
  }

  size_t workspace_bytes() const {
    if (!spec_.relu_workspace()) return 0;
    return loops_ ? bfloat16_batch_norm_mask_bytes(rows_) : forward_pd_.workspace_desc().get_size();
  }

  void make_backward() {
    if (has_backward_ || loops_) return;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    // The gradient of a global-statistics forward is one of training's: oneDNN derives it from
    // a training forward descriptor with the same flags.
    auto hint = dnnl::batch_normalization_forward::primitive_desc(
        cpu_engine(), dnnl::prop_kind::forward_training, data_, data_, spec_.eps, flags_);
    backward_pd_ = dnnl::batch_normalization_backward::primitive_desc(
        cpu_engine(), dnnl::prop_kind::backward, data_, data_, data_, spec_.eps, flags_, hint,
        attr);
    backward_ = dnnl::batch_normalization_backward(backward_pd_);
    has_backward_ = true;
  }

  // `spec`: the call's, which may differ from the one the primitives were made for in
  // momentum and fix_gamma (arguments, not primitive parameters).
  void forward(const BatchNormSpec& spec, const BatchNormForwardArrays& a,
               const Scratch& scratch) const {
    const int64_t channels = spec.channels();
    if (loops_) {
      const float* gamma = gamma_or_ones(spec, a.gamma, scratch_memory(scratch, channels * 4));
      bfloat16_batch_norm_forward(
          rows_, {static_cast<const uint16_t*>(a.data), static_cast<const uint16_t*>(a.residual),
                  gamma, a.beta, spec_.eps, spec_.relu, static_cast<uint16_t*>(a.output), a.mean,
                  a.variance, static_cast<uint16_t*>(a.workspace)});
      return;
    }
    const size_t scratchpad = std::max(
        forward_pd_.scratchpad_desc().get_size(),
        spec_.residual ? residual_pd_.scratchpad_desc().get_size() : size_t(0));
    char* space = scratch_memory(scratch, aligned(scratchpad) + aligned(channels * 4));
    const float* gamma = gamma_or_ones(spec, a.gamma, space + aligned(scratchpad));
    dnnl::engine& engine = cpu_engine();
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, memory(data_, engine, const_cast<void*>(a.data))},
        {DNNL_ARG_DST, memory(data_, engine, a.output)},
        {DNNL_ARG_SCALE, memory(vector_, engine, const_cast<float*>(gamma))},
        {DNNL_ARG_SHIFT, memory(vector_, engine, const_cast<float*>(a.beta))},
        {DNNL_ARG_SCRATCHPAD, memory(forward_pd_.scratchpad_desc(), engine, space)}};
    if (spec_.use_global_stats) {
      std::copy(a.moving_mean, a.moving_mean + channels, a.mean);
      std::copy(a.moving_var, a.moving_var + channels, a.variance);
    }
    args.emplace(DNNL_ARG_MEAN, memory(vector_, engine, a.mean));
    args.emplace(DNNL_ARG_VARIANCE, memory(vector_, engine, a.variance));
    if (spec_.relu_workspace())
      args.emplace(DNNL_ARG_WORKSPACE, memory(forward_pd_.workspace_desc(), engine, a.workspace));
    forward_.execute(thread_stream(), args);
    if (spec_.residual) {
      residual_.execute(
          thread_stream(),
          {{DNNL_ARG_SRC_0, memory(data_, engine, a.output)},
           {DNNL_ARG_SRC_1, memory(data_, engine, const_cast<void*>(a.residual))},
           {DNNL_ARG_DST, memory(data_, engine, a.output)},
           {DNNL_ARG_SCRATCHPAD, memory(residual_pd_.scratchpad_desc(), engine, space)}});
    }
    thread_stream().wait();
  }

  void backward(const BatchNormSpec& spec, const BatchNormBackwardArrays& a,
                const Scratch& scratch) const {
    const int64_t channels = spec.channels();
    const bool relu_after_sum = spec_.relu && spec_.residual;
    const size_t scratchpad = loops_ ? 0 : backward_pd_.scratchpad_desc().get_size();
    const size_t values = static_cast<size_t>(rows_.rows * rows_.channels);
    const size_t bytes = values * element_bytes(spec.dtype_flag);
    const size_t summed = a.copies > 0 && !relu_after_sum ? bytes : 0;
    char* space = scratch_memory(scratch, aligned(scratchpad) + 2 * aligned(channels * 4) +
                                              aligned(summed));
    char* ones = space + aligned(scratchpad);
    float* shift_grad = reinterpret_cast<float*>(ones + aligned(channels * 4));
    const float* gamma = gamma_or_ones(spec, a.gamma, ones);
    // The output's readers' gradients, one per copy, summed as a fan-out sums them.
    std::vector<const void*> grads = {a.output_grad};
    grads.insert(grads.end(), a.copy_grads, a.copy_grads + a.copies);
    const bool bfloat16 = spec.dtype_flag == kFlagBFloat16;
    const void* output_grad = a.output_grad;
    if (relu_after_sum) {
      // The gradient before the ReLU, the summed gradient where the output is positive, else 0,
      // is the residual's too: the sum passes it on unchanged.  Summed and masked in one pass
      // (oneDNN 3.2 fuses neither the sum nor this ReLU into its batch normalisation).
      sum_arrays_where_positive(grads.data(), static_cast<int>(grads.size()), a.output,
                                a.residual_grad, values, bfloat16);
      output_grad = a.residual_grad;
    } else {
      if (a.copies > 0) {
        void* total = ones + 2 * aligned(channels * 4);
        sum_arrays(grads.data(), static_cast<int>(grads.size()), total, values, bfloat16);
        output_grad = total;
      }
      if (spec_.residual) std::memcpy(a.residual_grad, output_grad, bytes);
    }
    float* gamma_grad = a.gamma_grad != nullptr ? a.gamma_grad : shift_grad;
    float* beta_grad = a.beta_grad != nullptr ? a.beta_grad : shift_grad;
    if (loops_) {
      bfloat16_batch_norm_backward(
          rows_, {static_cast<const uint16_t*>(output_grad),
                  static_cast<const uint16_t*>(spec_.relu_workspace() ? a.workspace : nullptr),
                  static_cast<const uint16_t*>(a.data), gamma, a.mean, a.variance, spec_.eps,
                  static_cast<uint16_t*>(a.data_grad), gamma_grad, beta_grad});
    } else {
      backward_onednn(a, output_grad, gamma, gamma_grad, beta_grad, space);
    }
    finish_backward(spec, a);
  }

 private:
  void backward_onednn(const BatchNormBackwardArrays& a, const void* output_grad,
                       const float* gamma, float* gamma_grad, float* beta_grad,
                       char* space) const {
    dnnl::engine& engine = cpu_engine();
    std::unordered_map<int, memory> args = {
         {DNNL_ARG_SRC, memory(data_, engine, const_cast<void*>(a.data))},
         {DNNL_ARG_DIFF_DST, memory(data_, engine, const_cast<void*>(output_grad))},
         {DNNL_ARG_MEAN, memory(vector_, engine, const_cast<float*>(a.mean))},
         {DNNL_ARG_VARIANCE, memory(vector_, engine, const_cast<float*>(a.variance))},
         {DNNL_ARG_SCALE, memory(vector_, engine, const_cast<float*>(gamma))},
         {DNNL_ARG_DIFF_SRC, memory(data_, engine, a.data_grad)},
         {DNNL_ARG_DIFF_SCALE, memory(vector_, engine, gamma_grad)},
         {DNNL_ARG_DIFF_SHIFT, memory(vector_, engine, beta_grad)},
         {DNNL_ARG_SCRATCHPAD, memory(backward_pd_.scratchpad_desc(), engine, space)}};
    if (spec_.relu_workspace())
      args.emplace(DNNL_ARG_WORKSPACE, memory(forward_pd_.workspace_desc(), engine,
                                              const_cast<void*>(a.workspace)));
    backward_.execute(thread_stream(), args);
    thread_stream().wait();
  }

  // After either kernel: fix_gamma's gradient and the moving statistics.
  static void finish_backward(const BatchNormSpec& spec, const BatchNormBackwardArrays& a) {
    const int64_t channels = spec.channels();
    // fix_gamma: gamma is a constant 1, so its gradient is 0 (as MXNet's BatchNorm gives).
    if (spec.fix_gamma && a.gamma_grad != nullptr)
      std::fill(a.gamma_grad, a.gamma_grad + channels, 0.0f);
    if (!spec.use_global_stats) {
      // MXNet's update, with the biased batch variance, as its BatchNorm does.
      const float keep = spec.momentum, take = 1.0f - spec.momentum;
      for (int64_t c = 0; c < channels; ++c) {
        a.moving_mean[c] = a.moving_mean[c] * keep + a.mean[c] * take;
        a.moving_var[c] = a.moving_var[c] * keep + a.variance[c] * take;
      }
    }
  }

  // gamma, or `space` filled with ones under fix_gamma.
  static const float* gamma_or_ones(const BatchNormSpec& spec, const float* gamma, char* space) {
    if (!spec.fix_gamma) return gamma;
    float* ones = reinterpret_cast<float*>(space);
    std::fill(ones, ones + spec.channels(), 1.0f);
    return ones;
  }

  BatchNormSpec spec_;
  // bfloat16_batch_norm.h's loops serve the spec: no oneDNN primitive is made.
  bool loops_;
  ChannelRows rows_;
  memory::desc data_, vector_;
  dnnl::normalization_flags flags_;
  dnnl::batch_normalization_forward::primitive_desc forward_pd_;
  dnnl::batch_normalization_forward forward_;
  dnnl::batch_normalization_backward::primitive_desc backward_pd_;
  dnnl::batch_normalization_backward backward_;
  dnnl::binary::primitive_desc residual_pd_;
  dnnl::binary residual_;
  bool has_backward_ = false;
};

std::string describe(const BatchNormSpec& spec) {
  std::string shape;
  for (size_t i = 0; i < spec.data_shape.size(); ++i)
    shape += (i ? ", " : "") + std::to_string(spec.data_shape[i]);
  return std::string(dtype_name(spec.dtype_flag)) + " data (" + shape + ")" +
         (spec.channels_last ? " channels last" : "") +
         (spec.use_global_stats ? " with global statistics" : "") +
         (spec.residual ? " plus a residual" : "") + (spec.relu ? " and a ReLU" : "");
}

std::mutex cache_mutex;
std::unordered_map<std::string, std::unique_ptr<BatchNorm>> cache;

BatchNorm& primitives(const BatchNormSpec& spec, bool with_backward) {
  // Every field that makes the primitives; momentum and fix_gamma only change the arguments.
  const std::string key = describe(spec) + " eps " + std::to_string(spec.eps);
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto found = cache.find(key);
  try {
    if (found == cache.end()) {
      spec.validate();
      found = cache.emplace(key, std::unique_ptr<BatchNorm>(new BatchNorm(spec))).first;
    }
    if (with_backward) found->second->make_backward();
  } catch (const dnnl::error& e) {
    throw std::runtime_error("oneDNN " + onednn_version() + " has no " +
                             std::string(with_backward ? "backward " : "forward ") +
                             "batch normalisation kernel for " + describe(spec) +
                             " on this CPU (" + onednn_cpu_isa() + "): " + e.what());
  }
  return *found->second;
}

}  // namespace

void BatchNormSpec::validate() const {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(what + " (" + describe(*this) + ")");
  };
  if (data_shape.size() < 3 || data_shape.size() > 5) fail("data must have 3 to 5 dimensions");
  for (int64_t d : data_shape)
    if (d <= 0) fail("data shape must be known and positive");
  if (dtype_flag != kFlagFloat32 && dtype_flag != kFlagBFloat16)
    fail("mxamp's batch normalisation takes float32 or bfloat16 data");
  if (!(eps > 0.0f)) fail("eps must be positive");
}

size_t batch_norm_workspace_bytes(const BatchNormSpec& spec) {
  return primitives(spec, false).workspace_bytes();
}

void batch_norm_forward(const BatchNormSpec& spec, const BatchNormForwardArrays& arrays,
                        const Scratch& scratch) {
  primitives(spec, false).forward(spec, arrays, scratch);
}

void batch_norm_backward(const BatchNormSpec& spec, const BatchNormBackwardArrays& arrays,
                         const Scratch& scratch) {
  primitives(spec, true).backward(spec, arrays, scratch);
}

}  // namespace mxamp
