// mxamp's own convolution on oneDNN 3 (see onednn_conv.h).
//
// Each distinct convolution (shape, attributes, data type) gets its oneDNN primitives once,
// kept for the life of the process.  The primitives choose their own memory layouts
// (format "any"); MXNet's arrays are plain, so an argument whose chosen layout differs is
// reordered through MXNet's temporary space on the way in (inputs) or out (outputs).
//
// The weight gradient of a 1x1 bfloat16 convolution with channels last is a matrix product,
// and runs as one: oneDNN 3.2's matmul computes it 1.1x to 2.9x faster than its convolution
// backward-weights kernels on ResNet-50's 1x1 layers (AMX, 2 threads; 1.0x to 1.3x with
// AVX512-BF16 alone).  Strided, it first gathers the data the kernel sees.  A bias's gradient,
// which the convolution kernel sums on the way, is then the output gradient's per-channel sum
// in bfloat16_batch_norm.h's loops (where they run).
//
// Where the weight gradient is small (at most 64 x 256), the matmul runs over row blocks of
// whole images, a batch of up to 16, into float32 partial sums that mxamp adds and rounds once.
// oneDNN 3.2's matmul splits a 64 x 64 or 64 x 128 product over 2 threads whatever the team:
// ResNet-50's 64 x 64 layer at 56 x 56 ran on 2 of 16, over 16 blocks on all 16.  At 2
// threads, batch 16, the blocks are faster too (AMX Xeon, oneDNN's verbose log): 64 x 64
// 1.72 against 0.82 ms, ResNet-50's 56 x 56 layers 22.3 against 18.0 ms a step.  Larger
// gradients came out slower over blocks (784 x 512 x 2048: 2.7 against 1.9 ms), and run whole.
// Capped to AVX512-BF16 (no AMX) the blocks took 5-9% less time than the whole product.
//
// The data gradient of a strided 1x1 bfloat16 convolution with channels last is a matrix
// product too, at the positions the kernel reads: a matmul into a dense buffer, then spread
// over the data's positions with zeros between (scatter_to_read_positions).  oneDNN 3.2's
// strided backward-data kernel took 1.3x to 2.2x as long on ResNet-50's strided 1x1 layers
// (AMX, 2 threads, batch 16, caches flushed), and a matmul writing the strided positions
// itself runs without AMX (gemm:jit), 2x to 4x slower.
#include "onednn_conv.h"
#include "bfloat16_batch_norm.h"
#include "master_weights.h"
#include "onednn_runtime.h"
#include "vector_isa.h"

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace mxamp {
namespace {

using dnnl::memory;

memory::desc any_desc(const memory::dims& dims, memory::data_type type) {
  return memory::desc(dims, type, memory::format_tag::any);
}

// One array argument of a primitive: where it lives in MXNet and in the layout oneDNN chose.
struct Argument {
  int onednn_arg;           // DNNL_ARG_SRC, ...
  int slot;                 // index of the caller's pointer
  bool is_output;
  memory::desc user;        // MXNet's plain layout, or a view of it (strided, transposed)
  memory::desc chosen;      // the primitive's layout
  bool reordered;           // user != chosen: converted through scratch memory
  memory::desc staged;      // chosen's bytes with user's dimensions, what the reorder writes
  dnnl::reorder convert;    // user -> chosen for inputs, chosen -> user for outputs
  size_t offset;            // of the chosen-layout copy in the scratch memory
};

// One oneDNN primitive with its arguments and the scratch memory it needs per call.
class Step {
 public:
  Step(dnnl::primitive primitive, const dnnl::primitive_desc_base& pd,
       const std::vector<std::pair<int, int>>& inputs,
       const std::vector<std::pair<int, int>>& outputs,
       const std::unordered_map<int, memory::desc>& user_layouts)
      : primitive_(std::move(primitive)), impl_(pd.impl_info_str()),
        is_matmul_(pd.get_kind() == dnnl::primitive::kind::matmul) {
    if (is_matmul_) impl_ = "matmul " + impl_;
    auto add = [&](int arg, int slot, bool is_output) {
      Argument a;
      a.onednn_arg = arg;
      a.slot = slot;
      a.is_output = is_output;
      a.user = user_layouts.at(arg);
      a.chosen = pd.query_md(dnnl::query::exec_arg_md, arg);
      a.reordered = a.user != a.chosen;
      a.offset = 0;
      if (a.reordered) {
        // A strided view of the data (N, spatial..., C) gathered into a matmul's (M, C).
        a.staged = a.user.get_dims() == a.chosen.get_dims() ? a.chosen
                                                             : a.chosen.reshape(a.user.get_dims());
        a.convert = is_output ? dnnl::reorder(dnnl::reorder::primitive_desc(
                                    cpu_engine(), a.staged, cpu_engine(), a.user))
                              : dnnl::reorder(dnnl::reorder::primitive_desc(
                                    cpu_engine(), a.user, cpu_engine(), a.staged));
        a.offset = bytes_;
        bytes_ += aligned(a.chosen.get_size());
      }
      arguments_.push_back(a);
    };
    for (const auto& in : inputs) add(in.first, in.second, false);
    for (const auto& out : outputs) add(out.first, out.second, true);
    scratchpad_ = pd.scratchpad_desc();
    scratchpad_offset_ = bytes_;
    bytes_ += aligned(scratchpad_.get_size());
  }

  size_t scratch_bytes() const { return bytes_; }
  const std::string& impl() const { return impl_; }
  bool is_matmul() const { return is_matmul_; }
  int reorders() const {
    int count = 0;
    for (const auto& a : arguments_) count += a.reordered;
    return count;
  }

  // `slots`: the caller's pointers; `scratch`: scratch_bytes() bytes, 64-byte aligned.
  void run(void* const* slots, char* scratch) const {
    dnnl::engine& engine = cpu_engine();
    dnnl::stream& stream = thread_stream();
    std::unordered_map<int, memory> args;
    std::vector<std::pair<const Argument*, memory>> pending_outputs;
    for (const auto& a : arguments_) {
      memory user(a.user, engine, slots[a.slot]);
      if (!a.reordered) {
        args.emplace(a.onednn_arg, user);
        continue;
      }
      memory staged(a.staged, engine, scratch + a.offset);
      if (a.is_output) {
        pending_outputs.emplace_back(&a, user);
      } else {
        a.convert.execute(stream, user, staged);
      }
      args.emplace(a.onednn_arg, memory(a.chosen, engine, scratch + a.offset));
    }
    if (scratchpad_.get_size() > 0) {
      args.emplace(DNNL_ARG_SCRATCHPAD, memory(scratchpad_, engine, scratch + scratchpad_offset_));
    }
    primitive_.execute(stream, args);
    for (auto& out : pending_outputs) {
      memory staged(out.first->staged, engine, args.at(out.first->onednn_arg).get_data_handle());
      out.first->convert.execute(stream, staged, out.second);
    }
    stream.wait();
  }

 private:
  dnnl::primitive primitive_;
  std::string impl_;
  bool is_matmul_;
  std::vector<Argument> arguments_;
  memory::desc scratchpad_;
  size_t scratchpad_offset_ = 0;
  size_t bytes_ = 0;
};

// How many output positions the batch has: the rows of a channels-last output (N, spatial...,
// O) seen as a matrix.
int64_t output_rows(const ConvSpec& spec) {
  const std::vector<int64_t> out_shape = spec.output_shape();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < out_shape.size(); ++i) rows *= out_shape[i];
  return rows;
}

// Slots of the caller's pointers (ForwardArrays / BackwardArrays, in order).
enum ForwardSlot { kFwdData, kFwdWeight, kFwdBias, kFwdOutput };
// kBwdReadPositionsGrad: the data gradient at the positions a strided 1x1 kernel reads, dense,
// in scratch memory (see the top of this file).
// kBwdWeightPartials: the weight gradient's float32 partial sums over row blocks, in scratch
// memory (see the top of this file).
enum BackwardSlot { kBwdOutputGrad, kBwdData, kBwdWeight, kBwdDataGrad, kBwdWeightGrad,
                    kBwdBiasGrad, kBwdReadPositionsGrad, kBwdWeightPartials };

// The most weight-gradient elements a matmul computes over row blocks, and the most blocks.
constexpr int64_t kBlockedWeightGradMost = 64 * 256;
constexpr int64_t kMostRowBlocks = 16;

// The primitives of one convolution; backward ones are made on the first backward call.
class Convolution {
 public:
  explicit Convolution(const ConvSpec& spec) : spec_(spec) {
    const memory::data_type type = onednn_type(spec.dtype_flag);
    const size_t spatial = spec.kernel.size();
    // oneDNN names dimensions N, C, spatial... whatever the layout in memory.
    memory::dims data = {spec.data_shape[0], spec.channels()};
    memory::dims output = {spec.data_shape[0], spec.num_filter};
    const std::vector<int64_t> out_shape = spec.output_shape();
    for (size_t i = 0; i < spatial; ++i) {
      data.push_back(spec.spatial_size(i));
      output.push_back(out_shape[spec.channels_last ? i + 1 : i + 2]);
    }
    memory::dims weight = {spec.num_filter, spec.channels() / spec.num_group};
    if (spec.num_group > 1) {
      // oneDNN's grouped weights (G, O/G, I/G, ...) are MXNet's (O, I/G, ...) in the same bytes.
      weight = {spec.num_group, spec.num_filter / spec.num_group,
                spec.channels() / spec.num_group};
    }
    weight.insert(weight.end(), spec.kernel.begin(), spec.kernel.end());
    for (size_t i = 0; i < spatial; ++i) {
      strides_.push_back(spec.stride[i]);
      dilates_.push_back(spec.dilate[i] - 1);  // oneDNN counts the holes, MXNet the spacing
      padding_.push_back(spec.pad[i]);
    }
    const bool last = spec.channels_last;
    plain_ = {{DNNL_ARG_SRC, activation_desc(data, type, last)},
              {DNNL_ARG_DIFF_SRC, activation_desc(data, type, last)},
              {DNNL_ARG_WEIGHTS, plain_desc(weight, type)},
              {DNNL_ARG_DIFF_WEIGHTS, plain_desc(weight, type)},
              {DNNL_ARG_BIAS, plain_desc({spec.num_filter}, type)},
              {DNNL_ARG_DIFF_BIAS, plain_desc({spec.num_filter}, type)},
              {DNNL_ARG_DST, activation_desc(output, type, last)},
              {DNNL_ARG_DIFF_DST, activation_desc(output, type, last)}};
    // bfloat16 channels last: the kernels take the data and output in MXNet's layout.  With
    // AMX, oneDNN 3.2 chooses that layout itself; with AVX512-BF16 alone it chooses blocked
    // kernels whose reorders cost more than they gain (ResNet-50's layers forward and
    // backward, reorders included: 1.0x to 1.4x faster in MXNet's layout).
    const bool plain_activations = last && spec.dtype_flag == kFlagBFloat16;
    any_data_ = plain_activations ? activation_desc(data, type, true) : any_desc(data, type);
    any_weight_ = any_desc(weight, type);
    any_output_ = plain_activations ? activation_desc(output, type, true) : any_desc(output, type);
    bias_ = spec.no_bias ? memory::desc() : plain_desc({spec.num_filter}, type);

    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    forward_pd_ = dnnl::convolution_forward::primitive_desc(
        cpu_engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
        any_data_, any_weight_, bias_, any_output_, strides_, dilates_, padding_, padding_, attr);
    std::vector<std::pair<int, int>> inputs = {{DNNL_ARG_SRC, kFwdData},
                                               {DNNL_ARG_WEIGHTS, kFwdWeight}};
    if (!spec.no_bias) inputs.emplace_back(DNNL_ARG_BIAS, kFwdBias);
    forward_.reset(new Step(dnnl::convolution_forward(forward_pd_), forward_pd_, inputs, {{DNNL_ARG_DST, kFwdOutput}}, plain_));
  }

  const Step& forward() const { return *forward_; }

  // Both backward steps, made once (the caller holds the cache lock).  Kept only when both
  // are made: a throw leaves none, and the next call tries again.
  void make_backward() {
    if (backward_data_) return;
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    std::unique_ptr<Step> data = matmul_backward_data(attr);
    if (!data) {
      dnnl::convolution_backward_data::primitive_desc data_pd(
          cpu_engine(), dnnl::algorithm::convolution_direct, any_data_, any_weight_, any_output_,
          strides_, dilates_, padding_, padding_, forward_pd_, attr);
      data.reset(new Step(dnnl::convolution_backward_data(data_pd), data_pd,
                          {{DNNL_ARG_DIFF_DST, kBwdOutputGrad}, {DNNL_ARG_WEIGHTS, kBwdWeight}},
                          {{DNNL_ARG_DIFF_SRC, kBwdDataGrad}}, plain_));
    }
    const int64_t blocks = row_blocks(spec_.data_shape[0], spec_.num_filter * spec_.channels());
    std::unique_ptr<Step> weights = matmul_backward_weights(attr, blocks);
    if (!weights) {
      dnnl::convolution_backward_weights::primitive_desc weights_pd(
          cpu_engine(), dnnl::algorithm::convolution_direct, any_data_, any_weight_, bias_,
          any_output_, strides_, dilates_, padding_, padding_, forward_pd_, attr);
      std::vector<std::pair<int, int>> outputs = {{DNNL_ARG_DIFF_WEIGHTS, kBwdWeightGrad}};
      if (!spec_.no_bias) outputs.emplace_back(DNNL_ARG_DIFF_BIAS, kBwdBiasGrad);
      weights.reset(new Step(dnnl::convolution_backward_weights(weights_pd), weights_pd,
                             {{DNNL_ARG_SRC, kBwdData}, {DNNL_ARG_DIFF_DST, kBwdOutputGrad}},
                             outputs, plain_));
    }
    bias_summed_ = !spec_.no_bias && weights->is_matmul();
    data_scattered_ = data->is_matmul();
    weight_row_blocks_ = weights->is_matmul() ? blocks : 1;
    backward_data_ = std::move(data);
    backward_weights_ = std::move(weights);
  }

  // Whether the bias gradient is left to the caller, as the output gradient's per-channel sum:
  // the matmul computes the weight gradient only.
  bool bias_summed() const { return bias_summed_; }

  // Whether backward_data() writes the gradient at the read positions only
  // (kBwdReadPositionsGrad), for scatter_to_read_positions to spread.
  bool data_scattered() const { return data_scattered_; }

  // Over how many row blocks backward_weights() computes the weight gradient: above 1, it
  // writes their float32 partial sums (kBwdWeightPartials) for sum_weight_partials to add.
  int64_t weight_row_blocks() const { return weight_row_blocks_; }

  const Step& backward_data() const { return *backward_data_; }
  const Step& backward_weights() const { return *backward_weights_; }

 private:
  // The weight gradient as the matmul described at the top of this file, where that applies:
  // d weight (O, C) = d output^T (O, M) x data (M, C), over the M = N x output positions.
  // matmul's "weights" argument is the convolution's data, gathered first when strided.
  // Over `blocks` row blocks (row_blocks) into float32 partial sums when above 1.  Null
  // elsewhere, and where oneDNN cannot describe the gather or has no such matmul.
  std::unique_ptr<Step> matmul_backward_weights(const dnnl::primitive_attr& attr,
                                                int64_t blocks) const {
    if (!is_pointwise_bfloat16() || (!spec_.no_bias && !bfloat16_batch_norm_runs_here()))
      return nullptr;
    const memory::data_type type = onednn_type(spec_.dtype_flag);
    const std::vector<int64_t> out_shape = spec_.output_shape();  // N, spatial..., O
    const memory::dim filters = spec_.num_filter, channels = spec_.channels();
    const memory::dim rows = output_rows(spec_);
    const memory::desc output_grad({filters, rows}, type, memory::dims{1, filters});
    const memory::desc gathered({rows, channels}, type, memory::dims{channels, 1});
    const memory::desc weight_grad({filters, channels}, type, memory::dims{channels, 1});
    try {
      // Unstrided, the data is `gathered` already; strided, a view of it: (N, output
      // positions..., C), every stride-th position.  oneDNN takes a dimension's stride to cover
      // the next dimension's count times its stride: a size the stride does not divide (17 by
      // 2: 9 positions, the last at 16) cannot be described, though it lies within the data.
      const memory::desc data = strided() ? strided_data_view(out_shape, type) : gathered;
      if (blocks > 1) {
        // The same product over `blocks` batches of whole images' rows, into float32.
        const memory::dim block_rows = rows / blocks;
        const memory::desc output_grads({blocks, filters, block_rows}, type,
                                        memory::dims{block_rows * filters, 1, filters});
        const memory::desc gathered_blocks({blocks, block_rows, channels}, type,
                                           memory::dims{block_rows * channels, channels, 1});
        const memory::desc partials({blocks, filters, channels}, memory::data_type::f32,
                                    memory::dims{filters * channels, channels, 1});
        return matmul_step({output_grads, output_grads, kBwdOutputGrad},
                           {gathered_blocks, strided() ? data : gathered_blocks, kBwdData},
                           {partials, partials, kBwdWeightPartials}, attr);
      }
      return matmul_step({output_grad, output_grad, kBwdOutputGrad},
                         {gathered, data, kBwdData}, {weight_grad, weight_grad, kBwdWeightGrad},
                         attr);
    } catch (const dnnl::error&) {
      return nullptr;  // the convolution's own backward-weights kernel serves
    }
  }

  // How many row blocks a 1x1 weight gradient's matmul runs over: the most images per block
  // that leave at most kMostRowBlocks blocks of whole images, for a gradient of `elements`
  // up to kBlockedWeightGradMost; 1 (whole) otherwise.  Fixed by the shape, not by the team's
  // size, so that mxamp adds the same partial sums whatever the thread count.
  static int64_t row_blocks(int64_t images, int64_t elements) {
    if (elements > kBlockedWeightGradMost) return 1;
    for (int64_t blocks = std::min(images, kMostRowBlocks); blocks > 1; --blocks)
      if (images % blocks == 0) return blocks;
    return 1;
  }

  // The data gradient as the matmul described at the top of this file, for a strided 1x1
  // convolution: d data at the read positions (M, C) = d output (M, O) x weight (O, C), with
  // MXNet's weight (O, C, 1...) as it is.  Null elsewhere, and where oneDNN has no such matmul.
  std::unique_ptr<Step> matmul_backward_data(const dnnl::primitive_attr& attr) const {
    if (!is_pointwise_bfloat16() || !strided()) return nullptr;
    const memory::data_type type = onednn_type(spec_.dtype_flag);
    const memory::dim filters = spec_.num_filter, channels = spec_.channels();
    const memory::dim rows = output_rows(spec_);
    const memory::desc output_grad({rows, filters}, type, memory::dims{filters, 1});
    const memory::desc weight({filters, channels}, type, memory::dims{channels, 1});
    const memory::desc read_grad({rows, channels}, type, memory::dims{channels, 1});
    try {
      return matmul_step({output_grad, output_grad, kBwdOutputGrad},
                         {weight, weight, kBwdWeight},
                         {read_grad, read_grad, kBwdReadPositionsGrad}, attr);
    } catch (const dnnl::error&) {
      return nullptr;  // the convolution's own backward-data kernel serves
    }
  }

  // One matmul argument: its layout for the matmul, the caller's layout of the same values
  // (a strided view is gathered into the first), and the slot of the caller's pointer.
  struct MatmulArgument {
    memory::desc layout, user;
    int slot;
  };

  // dst = src x weights as a Step; throws dnnl::error where oneDNN has no such matmul.
  static std::unique_ptr<Step> matmul_step(const MatmulArgument& src,
                                           const MatmulArgument& weights,
                                           const MatmulArgument& dst,
                                           const dnnl::primitive_attr& attr) {
    dnnl::matmul::primitive_desc pd(cpu_engine(), src.layout, weights.layout, dst.layout, attr);
    return std::unique_ptr<Step>(new Step(
        dnnl::matmul(pd), pd, {{DNNL_ARG_SRC, src.slot}, {DNNL_ARG_WEIGHTS, weights.slot}},
        {{DNNL_ARG_DST, dst.slot}},
        {{DNNL_ARG_SRC, src.user}, {DNNL_ARG_WEIGHTS, weights.user}, {DNNL_ARG_DST, dst.user}}));
  }

  // A 1x1 bfloat16 convolution on channels-last data without padding or groups: the shape of
  // the matmuls above.  Measured for bfloat16 only: in float32 the weight gradient's matmul is
  // as often slower as faster.
  bool is_pointwise_bfloat16() const {
    if (spec_.dtype_flag != kFlagBFloat16 || !spec_.channels_last || spec_.num_group != 1)
      return false;
    for (size_t i = 0; i < spec_.kernel.size(); ++i)
      if (spec_.kernel[i] != 1 || spec_.pad[i] != 0) return false;
    return true;
  }

  bool strided() const {
    return std::any_of(spec_.stride.begin(), spec_.stride.end(),
                       [](int64_t s) { return s != 1; });
  }

  // The channels-last data at the positions a 1x1 kernel of spec_'s strides reads, as
  // (N, output positions..., C) with strides into the data.  Throws dnnl::error where oneDNN
  // cannot describe it.
  memory::desc strided_data_view(const std::vector<int64_t>& out_shape,
                                 memory::data_type type) const {
    const size_t spatial = spec_.kernel.size();
    memory::dims dims(spatial + 2), steps(spatial + 2);
    memory::dim step = spec_.channels();
    dims[spatial + 1] = spec_.channels();
    steps[spatial + 1] = 1;
    for (size_t i = spatial; i-- > 0;) {
      dims[i + 1] = out_shape[i + 1];
      steps[i + 1] = step * spec_.stride[i];
      step *= spec_.spatial_size(i);
    }
    dims[0] = out_shape[0];
    steps[0] = step;
    return memory::desc(dims, type, steps);
  }

  ConvSpec spec_;
  memory::dims strides_, dilates_, padding_;
  std::unordered_map<int, memory::desc> plain_;
  memory::desc any_data_, any_weight_, any_output_, bias_;
  dnnl::convolution_forward::primitive_desc forward_pd_;
  std::unique_ptr<Step> forward_, backward_data_, backward_weights_;
  bool bias_summed_ = false, data_scattered_ = false;
  int64_t weight_row_blocks_ = 1;
};

// Adds `blocks` float32 partial weight gradients of `elements` each and rounds the sums to
// bfloat16 in `weight_grad`.
void sum_weight_partials(int64_t blocks, int64_t elements, const float* partials,
                         uint16_t* weight_grad) {
#pragma omp parallel for schedule(static) if (blocks * elements >= kParallelFrom)
  for (int64_t i = 0; i < elements; ++i) {
    float sum = partials[i];
    for (int64_t b = 1; b < blocks; ++b) sum += partials[b * elements + i];
    weight_grad[i] = round_to_bfloat16(sum);
  }
}

// Spreads `read_grad`, the data gradient at the positions a strided 1x1 kernel reads
// ((N, output positions..., C), dense), over `data_grad` (N, data positions..., C): each read
// position's row copied, every other position zero.
void scatter_to_read_positions(const ConvSpec& spec, const char* read_grad, char* data_grad) {
  const size_t spatial = spec.kernel.size();
  const std::vector<int64_t> out_shape = spec.output_shape();  // N, spatial..., O
  const size_t row = static_cast<size_t>(spec.channels()) * element_bytes(spec.dtype_flag);
  // Lines: the data's rows along its last spatial dimension.
  const int64_t width = spec.spatial_size(spatial - 1), step = spec.stride[spatial - 1];
  const size_t line_bytes = static_cast<size_t>(width) * row;
  const size_t read_line_bytes = static_cast<size_t>(out_shape[spatial]) * row;
  int64_t lines = spec.data_shape[0];
  for (size_t i = 0; i + 1 < spatial; ++i) lines *= spec.spatial_size(i);
#pragma omp parallel for schedule(static) if (lines * width * spec.channels() >= kParallelFrom)
  for (int64_t line = 0; line < lines; ++line) {
    char* out = data_grad + static_cast<size_t>(line) * line_bytes;
    // The line's coordinates, innermost first: read where each is a multiple of its stride.
    int64_t rest = line, read_line = 0, scale = 1;
    bool read = true;
    for (size_t i = spatial - 1; i-- > 0;) {
      const int64_t at = rest % spec.spatial_size(i);
      rest /= spec.spatial_size(i);
      read = read && at % spec.stride[i] == 0;
      read_line += at / spec.stride[i] * scale;
      scale *= out_shape[i + 1];
    }
    if (!read) {
      std::memset(out, 0, line_bytes);
      continue;
    }
    const char* in = read_grad + static_cast<size_t>(read_line + rest * scale) * read_line_bytes;
    for (int64_t x = 0; x < width; x += step) {
      std::memcpy(out + x * row, in + x / step * row, row);
      const int64_t gap = std::min(step - 1, width - x - 1);  // zeros up to the next read
      if (gap > 0) std::memset(out + (x + 1) * row, 0, gap * row);
    }
  }
}

// The key of a spec in the cache: every field, flattened.
std::vector<int64_t> cache_key(const ConvSpec& spec) {
  std::vector<int64_t> key;
  key.reserve(5 + spec.data_shape.size() + 4 * spec.kernel.size());
  key.push_back(spec.dtype_flag);
  key.push_back(spec.num_filter);
  key.push_back(spec.num_group);
  key.push_back(spec.no_bias);
  key.push_back(spec.channels_last);
  key.push_back(static_cast<int64_t>(spec.data_shape.size()));
  for (const auto* part : {&spec.data_shape, &spec.kernel, &spec.stride, &spec.dilate, &spec.pad})
    key.insert(key.end(), part->begin(), part->end());
  return key;
}

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : key) h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    return h;
  }
};

std::mutex cache_mutex;
std::unordered_map<std::vector<int64_t>, std::unique_ptr<Convolution>, KeyHash> cache;

std::string describe_spec(const ConvSpec& spec) {
  std::ostringstream out;
  auto tuple = [&](const std::vector<int64_t>& v) {
    out << "(";
    for (size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
    out << ")";
  };
  out << dtype_name(spec.dtype_flag) << " data ";
  tuple(spec.data_shape);
  out << " kernel ";
  tuple(spec.kernel);
  out << " stride ";
  tuple(spec.stride);
  out << " dilate ";
  tuple(spec.dilate);
  out << " pad ";
  tuple(spec.pad);
  out << " num_filter " << spec.num_filter << " num_group " << spec.num_group;
  if (spec.channels_last) out << " channels last";
  return out.str();
}

// The cached primitives of `spec`, made on first use; with_backward: backward ones too.
Convolution& primitives(const ConvSpec& spec, bool with_backward) {
  std::vector<int64_t> key = cache_key(spec);
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto found = cache.find(key);
  try {
    if (found == cache.end()) {
      spec.validate();
      found = cache.emplace(std::move(key), std::unique_ptr<Convolution>(new Convolution(spec)))
                  .first;
    }
    if (with_backward) found->second->make_backward();
  } catch (const dnnl::error& e) {
    throw std::runtime_error("oneDNN " + onednn_version() + " has no " +
                             std::string(with_backward ? "backward " : "forward ") +
                             "kernel for the " + describe_spec(spec) + " convolution on this CPU (" +
                             onednn_cpu_isa() + "): " + e.what());
  }
  return *found->second;
}

}  // namespace

void ConvSpec::validate() const {
  const size_t spatial = kernel.size();
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(what + " (" + describe_spec(*this) + ")");
  };
  if (spatial < 1 || spatial > 3) fail("kernel must have 1 to 3 dimensions");
  if (data_shape.size() != spatial + 2)
    fail("data must have " + std::to_string(spatial + 2) + " dimensions for a " +
         std::to_string(spatial) + "-D kernel");
  if (stride.size() != spatial || dilate.size() != spatial || pad.size() != spatial)
    fail("stride, dilate and pad must have as many dimensions as kernel");
  onednn_type(dtype_flag);
  for (int64_t d : data_shape)
    if (d <= 0) fail("data shape must be known and positive");
  for (size_t i = 0; i < spatial; ++i) {
    if (kernel[i] <= 0 || stride[i] <= 0 || dilate[i] <= 0 || pad[i] < 0)
      fail("kernel, stride and dilate must be positive and pad non-negative");
  }
  if (num_filter <= 0) fail("num_filter must be positive");
  if (num_group <= 0 || channels() % num_group != 0 || num_filter % num_group != 0)
    fail("num_group must divide both the input channels and num_filter");
  for (int64_t d : output_shape())
    if (d <= 0) fail("the kernel does not fit in the padded data");
}

std::vector<int64_t> ConvSpec::output_shape() const {
  std::vector<int64_t> shape = {data_shape[0]};
  if (!channels_last) shape.push_back(num_filter);
  for (size_t i = 0; i < kernel.size(); ++i) {
    const int64_t extent = dilate[i] * (kernel[i] - 1) + 1;
    shape.push_back((spatial_size(i) + 2 * pad[i] - extent) / stride[i] + 1);
  }
  if (channels_last) shape.push_back(num_filter);
  return shape;
}

std::vector<int64_t> ConvSpec::weight_shape() const {
  std::vector<int64_t> shape = {num_filter, channels() / num_group};
  shape.insert(shape.end(), kernel.begin(), kernel.end());
  return shape;
}

void convolution_forward(const ConvSpec& spec, const ForwardArrays& arrays,
                         const Scratch& scratch) {
  const Step& step = primitives(spec, false).forward();
  void* slots[] = {const_cast<void*>(arrays.data), const_cast<void*>(arrays.weight),
                   const_cast<void*>(arrays.bias), arrays.output};
  step.run(slots, scratch_memory(scratch, step.scratch_bytes()));
}

void convolution_backward(const ConvSpec& spec, const BackwardArrays& arrays,
                          const Scratch& scratch) {
  const Convolution& conv = primitives(spec, true);
  // One scratch block serves both steps: they run one after the other.  A scattered data
  // gradient is first written at the read positions, at the start of the block; the weight
  // gradient's partial sums too.
  const bool data_wanted = arrays.data_grad != nullptr;
  const bool weights_wanted = arrays.weight_grad != nullptr;
  const size_t read_bytes =
      data_wanted && conv.data_scattered()
          ? aligned(static_cast<size_t>(output_rows(spec) * spec.channels()) *
                    element_bytes(spec.dtype_flag))
          : 0;
  const int64_t blocks = conv.weight_row_blocks();
  const int64_t weight_elements = spec.num_filter * spec.channels();  // 1x1, one group
  const size_t partial_bytes =
      blocks > 1 ? aligned(static_cast<size_t>(blocks * weight_elements) * sizeof(float)) : 0;
  size_t bytes = 0;
  if (data_wanted) bytes = read_bytes + conv.backward_data().scratch_bytes();
  if (weights_wanted)
    bytes = std::max(bytes, partial_bytes + conv.backward_weights().scratch_bytes());
  char* memory = scratch_memory(scratch, bytes);
  void* slots[] = {const_cast<void*>(arrays.output_grad), const_cast<void*>(arrays.data),
                   const_cast<void*>(arrays.weight), arrays.data_grad, arrays.weight_grad,
                   arrays.bias_grad, memory, memory};
  if (data_wanted) {
    conv.backward_data().run(slots, memory + read_bytes);
    if (conv.data_scattered())
      scatter_to_read_positions(spec, memory, static_cast<char*>(arrays.data_grad));
  }
  if (weights_wanted) {
    conv.backward_weights().run(slots, memory + partial_bytes);
    if (blocks > 1)
      sum_weight_partials(blocks, weight_elements, reinterpret_cast<const float*>(memory),
                          static_cast<uint16_t*>(arrays.weight_grad));
  }
  if (weights_wanted && conv.bias_summed() && arrays.bias_grad != nullptr) {
    std::vector<double> sums(spec.num_filter);
    bfloat16_channel_sums({output_rows(spec), spec.num_filter},
                          static_cast<const uint16_t*>(arrays.output_grad), sums.data());
    uint16_t* bias_grad = static_cast<uint16_t*>(arrays.bias_grad);
    for (int64_t o = 0; o < spec.num_filter; ++o)
      bias_grad[o] = round_to_bfloat16(static_cast<float>(sums[o]));
  }
}

std::string onednn_version() {
  const dnnl_version_t* v = dnnl_version();
  return std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
         std::to_string(v->patch);
}

std::string onednn_cpu_isa() {
  switch (dnnl::get_effective_cpu_isa()) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2_vnni_2: return "avx2_vnni_2";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16: return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_fp16: return "avx512_core_fp16";
    case dnnl::cpu_isa::avx512_core_amx: return "avx512_core_amx";
    case dnnl::cpu_isa::avx512_core_amx_fp16: return "avx512_core_amx_fp16";
    default: return "unknown";
  }
}

std::string describe_kernels(const ConvSpec& spec) {
  Convolution& conv = primitives(spec, true);
  std::ostringstream out;
  auto step = [&](const char* name, const Step& s) {
    out << name << "=" << s.impl() << " (" << s.reorders() << " reorders) ";
  };
  step("forward", conv.forward());
  step("backward_data", conv.backward_data());
  step("backward_weights", conv.backward_weights());
  if (conv.weight_row_blocks() > 1)
    out << "over " << conv.weight_row_blocks() << " row blocks, mxamp sums ";
  if (conv.bias_summed()) out << "backward_bias=mxamp channel sums ";
  std::string text = out.str();
  text.pop_back();
  return text;
}

}  // namespace mxamp
