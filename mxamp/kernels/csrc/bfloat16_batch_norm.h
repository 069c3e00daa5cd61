// Training-mode batch normalisation of bfloat16 channels-last data, in AVX-512 loops of mxamp's own.
//
// Owns the arithmetic onednn_batch_norm.cc hands over for bfloat16 data whose channels are the
// last dimension, normalised with its batch statistics, on CPUs with AVX-512 (every CPU that
// computes bfloat16 has it).  oneDNN 3.2's kernel for that case reads the data three times in the
// forward pass and twice with the gradient in the backward pass, at about 18 GB/s in a ResNet-50
// step (2 threads, Xeon with AMX), and a residual sum takes it a pass of its own.  These loops
// read the data once for both statistics and once for the output, into which the residual sum
// and the ReLU fold, and twice with the gradient, near the memory's speed: in that step the
// BatchNorms took 71 ms forward and 100 backward, against 93 and 121.  The arithmetic is
// oneDNN's: float32 sums, the variance from the squares of the deviations from the mean (never
// the mean of the squares less the squared mean), the biased batch variance, rounding to
// nearest even.  Knows nothing of MXNet or oneDNN.
#ifndef MXAMP_BFLOAT16_BATCH_NORM_H_
#define MXAMP_BFLOAT16_BATCH_NORM_H_

#include <cstddef>
#include <cstdint>

namespace mxamp {

// Whether the loops run on this CPU (AVX-512F, BW, VL and DQ).
bool bfloat16_batch_norm_runs_here();

// The data as `rows` rows of `channels` values (every dimension but the last, and the last).
struct ChannelRows {
  int64_t rows;
  int64_t channels;
};

// Bytes of the ReLU mask a forward with a ReLU writes: a bit per value, 16 channels a uint16.
size_t bfloat16_batch_norm_mask_bytes(const ChannelRows& shape);

struct Bfloat16BatchNormForward {
  const uint16_t* data;
  const uint16_t* residual;  // added to the output before the ReLU; null without
  const float* gamma;
  const float* beta;
  float eps;
  bool relu;
  uint16_t* output;
  float* mean;               // the batch's
  float* variance;           // the batch's, biased (as oneDNN and MXNet's BatchNorm give it)
  uint16_t* relu_mask;       // where the output is positive, for the gradient; null to skip
};

struct Bfloat16BatchNormBackward {
  const uint16_t* output_grad;  // the gradient of the output (after a ReLU's: see relu_mask)
  const uint16_t* relu_mask;    // the forward's: the gradient taken where set; null: all of it
  const uint16_t* data;
  const float* gamma;
  const float* mean;            // the forward's
  const float* variance;
  float eps;
  uint16_t* data_grad;
  float* gamma_grad;
  float* beta_grad;
};

// On the calling thread's OpenMP team.  Call only where bfloat16_batch_norm_runs_here().
void bfloat16_batch_norm_forward(const ChannelRows& shape, const Bfloat16BatchNormForward& a);
void bfloat16_batch_norm_backward(const ChannelRows& shape, const Bfloat16BatchNormBackward& a);

// sums[c]: the sum over the rows of channel c, in float32 per chunk of rows, then in double.
// The same loops' per-channel sum, which onednn_conv.cc takes for a bias gradient.
void bfloat16_channel_sums(const ChannelRows& shape, const uint16_t* data, double* sums);

}  // namespace mxamp

#endif  // MXAMP_BFLOAT16_BATCH_NORM_H_
