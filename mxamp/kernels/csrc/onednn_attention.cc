// mxamp's own self-attention products on oneDNN 3 (see onednn_attention.h).
//
// Each product is one oneDNN matmul over (batch, heads) whose operands are strided views of
// MXNet's arrays: the query, key and value of head h of sample b start at (b * heads + h) * 3 *
// head_dim in each row of the projection, and a row holds batch * heads * 3 * head_dim values.
// Each distinct spec gets its primitives once, kept for the life of the process.
#include "onednn_attention.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "master_weights.h"
#include "onednn_runtime.h"

namespace mxamp {
namespace {

using dnnl::memory;

enum Part { kQuery = 0, kKey = 1, kValue = 2 };

class Attention {
 public:
  explicit Attention(const AttentionSpec& spec) : spec_(spec) {
    const memory::data_type type = onednn_type(spec.dtype_flag);
    const memory::dim S = spec.sequence, B = spec.batch, H = spec.heads, D = spec.head_dim;
    const memory::dim row = B * H * 3 * D;  // one position's projections, every sample and head
    // A head's query, key or value, (B, H, S, D), and its transpose, (B, H, D, S).
    const memory::desc part(memory::dims{B, H, S, D}, type, memory::dims{H * 3 * D, 3 * D, row, 1});
    const memory::desc part_t(memory::dims{B, H, D, S}, type,
                              memory::dims{H * 3 * D, 3 * D, 1, row});
    const memory::desc scores(memory::dims{B, H, S, S}, type, memory::format_tag::abcd);
    const memory::desc scores_t(memory::dims{B, H, S, S}, type, memory::format_tag::abdc);
    const memory::desc output(memory::dims{B, H, S, D}, type, memory::dims{H * D, D, B * H * D, 1});
    // The scores leave in float32 whatever the operands: softmax reads them in float32, and
    // a bfloat16 rounding of them would shift its weights by up to 2**-8 of a score.
    const memory::desc scores32(memory::dims{B, H, S, S}, memory::data_type::f32,
                                memory::format_tag::abcd);
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    qk_ = make(part, part_t, scores32, scale);        // q k^T
    dq_ = make(scores, part, part, scale);           // dS k
    dk_ = make(scores_t, part, part, scale);         // dS^T q
    valatt_ = make(scores, part, output, 1.0f);      // A v
    dattention_ = make(output, part_t, scores, 1.0f);  // dY v^T
    dv_ = make(scores_t, output, part, 1.0f);        // A^T dY
  }

  void qk(const void* qkv, float* scores, const Scratch& scratch) const {
    run(qk_, part(qkv, kQuery), part(qkv, kKey), scores, scratch);
  }

  // `scores_grad` is float32, as the scores; in bfloat16 it is rounded once (nearest even, as
  // a cast rounds) for the two products.
  void qk_backward(const float* scores_grad, const void* qkv, void* qkv_grad,
                   const Scratch& scratch) const {
    std::unique_ptr<uint16_t[]> rounded;
    const void* grad = scores_grad;
    if (spec_.dtype_flag == kFlagBFloat16) {
      const int64_t count = spec_.batch * spec_.heads * spec_.sequence * spec_.sequence;
      rounded.reset(new uint16_t[count]);
      uint16_t* out = rounded.get();
#pragma omp parallel for simd
      for (int64_t i = 0; i < count; ++i) out[i] = round_to_bfloat16(scores_grad[i]);
      grad = out;
    }
    run(dq_, grad, part(qkv, kKey), part(qkv_grad, kQuery), scratch);
    run(dk_, grad, part(qkv, kQuery), part(qkv_grad, kKey), scratch);
    zero_part(qkv_grad, kValue);
  }

  void valatt(const void* qkv, const void* attention, void* output,
              const Scratch& scratch) const {
    run(valatt_, attention, part(qkv, kValue), output, scratch);
  }

  void valatt_backward(const void* output_grad, const void* qkv, const void* attention,
                       void* qkv_grad, void* attention_grad, const Scratch& scratch) const {
    run(dattention_, output_grad, part(qkv, kValue), attention_grad, scratch);
    run(dv_, attention, output_grad, part(qkv_grad, kValue), scratch);
    zero_part(qkv_grad, kQuery);
    zero_part(qkv_grad, kKey);
  }

 private:
  struct Product {
    dnnl::matmul::primitive_desc pd;
    dnnl::matmul primitive;
  };

  static Product make(const memory::desc& a, const memory::desc& b, const memory::desc& c,
                      float scale) {
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (scale != 1.0f) {
      // Scaled in float32, on the accumulated product, before it is rounded.
      dnnl::post_ops ops;
      ops.append_eltwise(dnnl::algorithm::eltwise_linear, scale, 0.0f);
      attr.set_post_ops(ops);
    }
    dnnl::matmul::primitive_desc pd(cpu_engine(), a, b, c, attr);
    return Product{pd, dnnl::matmul(pd)};
  }

  // Where part `which` of the head-interleaved projection starts.
  const void* part(const void* qkv, Part which) const {
    return static_cast<const char*>(qkv) + which * spec_.head_dim * element_bytes(spec_.dtype_flag);
  }
  void* part(void* qkv, Part which) const {
    return static_cast<char*>(qkv) + which * spec_.head_dim * element_bytes(spec_.dtype_flag);
  }

  // Gradients are written, never added (the extension ABI has no write request): the part no
  // product writes is zero.
  void zero_part(void* qkv_grad, Part which) const {
    const int64_t heads = spec_.sequence * spec_.batch * spec_.heads;
    const size_t bytes = spec_.head_dim * element_bytes(spec_.dtype_flag);
    char* base = static_cast<char*>(part(qkv_grad, which));
#pragma omp parallel for
    for (int64_t i = 0; i < heads; ++i) std::memset(base + i * 3 * bytes, 0, bytes);
  }

  static void run(const Product& product, const void* a, const void* b, void* c,
                  const Scratch& scratch) {
    dnnl::engine& engine = cpu_engine();
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, memory(product.pd.src_desc(), engine, const_cast<void*>(a))},
        {DNNL_ARG_WEIGHTS, memory(product.pd.weights_desc(), engine, const_cast<void*>(b))},
        {DNNL_ARG_DST, memory(product.pd.dst_desc(), engine, c)}};
    const memory::desc pad = product.pd.scratchpad_desc();
    if (pad.get_size() != 0)
      args.emplace(DNNL_ARG_SCRATCHPAD,
                   memory(pad, engine, scratch_memory(scratch, pad.get_size())));
    product.primitive.execute(thread_stream(), args);
    thread_stream().wait();
  }

  AttentionSpec spec_;
  Product qk_, dq_, dk_, valatt_, dattention_, dv_;
};

std::string describe(const AttentionSpec& spec) {
  return std::string(dtype_name(spec.dtype_flag)) + " self-attention of sequence " +
         std::to_string(spec.sequence) + ", batch " + std::to_string(spec.batch) + ", " +
         std::to_string(spec.heads) + " heads of " + std::to_string(spec.head_dim);
}

std::mutex cache_mutex;
std::unordered_map<std::string, std::unique_ptr<Attention>> cache;

const Attention& primitives(const AttentionSpec& spec) {
  const std::string key = describe(spec);  // every field that makes the primitives
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto found = cache.find(key);
  if (found == cache.end()) {
    try {
      found = cache.emplace(key, std::unique_ptr<Attention>(new Attention(spec))).first;
    } catch (const dnnl::error& e) {
      throw std::runtime_error("oneDNN " + onednn_version() + " has no matmul for the " +
                               describe(spec) + " on this CPU (" + onednn_cpu_isa() +
                               "): " + e.what());
    }
  }
  return *found->second;
}

}  // namespace

AttentionSpec AttentionSpec::of_projection(const int64_t* shape, int ndim, int64_t heads,
                                           int dtype_flag) {
  if (ndim != 3) throw std::invalid_argument("the projection must have 3 dimensions "
                                             "(sequence, batch, heads * 3 * head_dim)");
  if (heads <= 0) throw std::invalid_argument("heads must be positive");
  if (shape[2] % (3 * heads) != 0)
    throw std::invalid_argument("the projection's last dimension, " + std::to_string(shape[2]) +
                                ", is not heads * 3 * head_dim for " + std::to_string(heads) +
                                " heads");
  if (dtype_flag != kFlagFloat32 && dtype_flag != kFlagBFloat16)
    throw std::invalid_argument("mxamp's self-attention takes float32 or bfloat16");
  AttentionSpec spec;
  spec.sequence = shape[0];
  spec.batch = shape[1];
  spec.heads = heads;
  spec.head_dim = shape[2] / (3 * heads);
  spec.dtype_flag = dtype_flag;
  if (spec.sequence <= 0 || spec.batch <= 0 || spec.head_dim <= 0)
    throw std::invalid_argument("the projection's shape must be known and positive");
  return spec;
}

std::vector<int64_t> AttentionSpec::projection_shape() const {
  return {sequence, batch, heads * 3 * head_dim};
}

std::vector<int64_t> AttentionSpec::scores_shape() const {
  return {batch * heads, sequence, sequence};
}

std::vector<int64_t> AttentionSpec::output_shape() const {
  return {sequence, batch, heads * head_dim};
}

void selfatt_qk_forward(const AttentionSpec& spec, const void* qkv, float* scores,
                        const Scratch& scratch) {
  primitives(spec).qk(qkv, scores, scratch);
}

void selfatt_qk_backward(const AttentionSpec& spec, const float* scores_grad, const void* qkv,
                         void* qkv_grad, const Scratch& scratch) {
  primitives(spec).qk_backward(scores_grad, qkv, qkv_grad, scratch);
}

void selfatt_valatt_forward(const AttentionSpec& spec, const void* qkv, const void* attention,
                            void* output, const Scratch& scratch) {
  primitives(spec).valatt(qkv, attention, output, scratch);
}

void selfatt_valatt_backward(const AttentionSpec& spec, const void* output_grad,
                             const void* qkv, const void* attention, void* qkv_grad,
                             void* attention_grad, const Scratch& scratch) {
  primitives(spec).valatt_backward(output_grad, qkv, attention, qkv_grad, attention_grad,
                                   scratch);
}

}  // namespace mxamp
