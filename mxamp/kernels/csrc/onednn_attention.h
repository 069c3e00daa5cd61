// mxamp's own self-attention products on oneDNN 3: what they compute and how they are called.
//
// Owns MXNet's two interleaved self-attention products (src/operator/contrib/transformer.cc),
// forward and gradient, in float32 or bfloat16 (accumulated in float32): MXNet 1.9.1 computes
// them only in float32 on a CPU, so a bfloat16 transformer casts around every one.  Their input
// is the fused projection `qkv`, (sequence, batch, heads * 3 * head_dim), each head's query, key
// and value side by side; oneDNN's matmul reads the three where they lie (strided views), so
// nothing is copied or reordered.
//   qk:     scores (batch * heads, sequence, sequence) = q k^T / sqrt(head_dim), in float32
//           whatever the projection's type (softmax reads them in float32)
//   valatt: output (sequence, batch, heads * head_dim) = attention v, attention the first's shape
// Knows nothing of MXNet's extension ABI: mxnet_extension.cc adapts it.
#ifndef MXAMP_ONEDNN_ATTENTION_H_
#define MXAMP_ONEDNN_ATTENTION_H_

#include <cstdint>
#include <vector>

#include "onednn_conv.h"

namespace mxamp {

struct AttentionSpec {
  int64_t sequence = 0;
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  int dtype_flag = kFlagFloat32;

  // From the projection's shape (sequence, batch, heads * 3 * head_dim); throws
  // std::invalid_argument when the last dimension does not split into heads.
  static AttentionSpec of_projection(const int64_t* shape, int ndim, int64_t heads, int dtype_flag);
  std::vector<int64_t> projection_shape() const;  // (sequence, batch, heads * 3 * head_dim)
  std::vector<int64_t> scores_shape() const;      // (batch * heads, sequence, sequence)
  std::vector<int64_t> output_shape() const;      // (sequence, batch, heads * head_dim)
};

// scores (float32) = q k^T / sqrt(head_dim).
void selfatt_qk_forward(const AttentionSpec& spec, const void* qkv, float* scores,
                        const Scratch& scratch);
// qkv_grad's query and key parts from the scores' gradient (float32); its value part is zeroed.
void selfatt_qk_backward(const AttentionSpec& spec, const float* scores_grad, const void* qkv,
                         void* qkv_grad, const Scratch& scratch);
// output = attention v.
void selfatt_valatt_forward(const AttentionSpec& spec, const void* qkv, const void* attention,
                            void* output, const Scratch& scratch);
// qkv_grad's value part (its query and key parts zeroed) and the attention's gradient.
void selfatt_valatt_backward(const AttentionSpec& spec, const void* output_grad,
                             const void* qkv, const void* attention, void* qkv_grad,
                             void* attention_grad, const Scratch& scratch);

}  // namespace mxamp

#endif  // MXAMP_ONEDNN_ATTENTION_H_
