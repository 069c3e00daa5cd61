// One array read by several operators, as one operator: copies out, the gradients summed in.
//
// Owns the arithmetic of "_mxamp_fan_out" (mxnet_extension.cc registers it), which
// mxamp.channels_last puts where an array of a channels-last region has several readers.  MXNet
// sums such an array's gradients with add_n, whose bfloat16 kernel on MXNet's plain layout (what
// mxamp's own operators return) is a scalar loop: 81 ms for 51 million values at 2 threads,
// against 2.5 ms for elemwise_add.  Here each reader gets its own copy, and the gradient is the
// sum of theirs in one vectorised pass.  Knows nothing of MXNet.
#ifndef MXAMP_FAN_OUT_H_
#define MXAMP_FAN_OUT_H_

#include <cstddef>
#include <cstdint>

namespace mxamp {

// `bytes` bytes of `source` into `target`, on the calling thread's OpenMP team.
void copy_bytes(const void* source, void* target, size_t bytes);

// out[i] = sum over k < count of inputs[k][i], for `size` values: float32, or (`bfloat16`)
// bfloat16 bits summed in float32 and rounded once to nearest even (as oneDNN's sum rounds).
void sum_arrays(const void* const* inputs, int count, void* out, size_t size, bool bfloat16);

// The same sum, kept where relu_output[i] > 0 and 0 elsewhere (NaN included): the gradient of
// the sum's readers through the ReLU that wrote relu_output, in one pass instead of two.
void sum_arrays_where_positive(const void* const* inputs, int count, const void* relu_output,
                               void* out, size_t size, bool bfloat16);

}  // namespace mxamp

#endif  // MXAMP_FAN_OUT_H_
