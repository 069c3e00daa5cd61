// An array clipped to [a_min, a_max], and its gradient: MXNet's clip, vectorised.
//
// Owns the arithmetic of "_mxamp_clip" (mxnet_extension.cc registers it), which a converted Gluon
// network runs in place of MXNet's clip (a ReLU6 is clip(x, 0, 6)).  MXNet 1.9.1's clip and its
// gradient are scalar loops on a CPU: MobileNetV2's 35 ReLU6 layers took 557 ms of a 1.05 s
// bfloat16 training step (batch 16, 2 threads, Xeon with AMX).  Knows nothing of MXNet.
#ifndef MXAMP_CLIP_H_
#define MXAMP_CLIP_H_

#include <cstddef>

namespace mxamp {

// out[i] = a_max where in[i] > a_max, a_min where in[i] < a_min, in[i] otherwise (NaN stays NaN,
// -0 stays -0), as MXNet's clip: float32, or (`bfloat16`) bfloat16 bits, the bounds rounded to
// bfloat16 to nearest (MXNet's own bfloat16 kernel truncates them; 0 and 6 are exact either way).
void clip_values(const void* in, void* out, size_t size, float a_min, float a_max, bool bfloat16);

// The gradient: out[i] = grad[i] where a_min <= data[i] <= a_max or data[i] is NaN, 0 elsewhere,
// as MXNet's clip gradient.
void clip_gradient(const void* grad, const void* data, void* out, size_t size, float a_min,
                   float a_max, bool bfloat16);

}  // namespace mxamp

#endif  // MXAMP_CLIP_H_
