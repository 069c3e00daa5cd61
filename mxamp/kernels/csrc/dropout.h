// Dropout in training, and its gradient: MXNet's Dropout (axes empty) on counter-based random bits.
//
// Owns the arithmetic and the random bits of "_mxamp_dropout" (mxnet_extension.cc registers it),
// which a converted Gluon network's training graph runs in place of MXNet's Dropout.  MXNet
// 1.9.1's CPU Dropout draws every value's uniform number from a std::mt19937 and packs the
// mask bit by bit, a scalar loop whose forward and backward cost several times more than the
// arrays' reading and writing.  Here every value's keep decision is a function of (seed, index)
// alone: the random words of Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random
// numbers: as easy as 1, 2, 3", SC 2011), computed sixteen blocks to an AVX-512 vector, so the
// values depend neither on the thread count nor on the instruction set.  Knows nothing of MXNet:
// the caller draws the seed (from MXNet's random states, once per forward call).
//
// Values, as MXNet's Dropout computes them: keep = 1 - p and scale = 1 / keep in float32; a
// value is kept with probability keep; the output is x * scale where kept and x * 0 elsewhere
// (0, or NaN for an infinite or NaN x, as MXNet's 0 * x * scale); bfloat16 values are widened,
// multiplied in float32 and rounded once to nearest even.  The gradient is dy * scale where
// kept and dy * 0 elsewhere.  keep rounding to 1 in float32 (p = 0): the identity, as MXNet.
// p = 1 drops every value (zeros), where MXNet 1.9.1 writes NaN (0 * x * 1/0).
//
// The mask is the forward's second output and the gradient's input: one bit a value, bit i & 7
// of byte i >> 3 set where value i is kept, as MXNet's Dropout keeps it.  Regenerating the bits
// from the seed in the backward pass would run the generator twice, and it costs about as much
// as the arrays' traffic; a byte a value would cost eight times the memory, and MXNet fills the
// gradient of every output, the mask's too, with zeros before each backward pass (a scalar fill).
#ifndef MXAMP_DROPOUT_H_
#define MXAMP_DROPOUT_H_

#include <cstddef>
#include <cstdint>

namespace mxamp {

// Throws std::invalid_argument unless 0 <= p <= 1 (MXNet's range).
void check_dropout_probability(float p);

// out = dropout(in) and its mask ((size + 7) / 8 bytes, the bits past `size` clear), for `size`
// values: float32, or (`bfloat16`) bfloat16 bits; on the calling thread's OpenMP team, in
// AVX-512 loops where the CPU has them and `wide` (false: the plain loops, for the tests).
void dropout_forward(const void* in, void* out, uint8_t* mask, size_t size, float p,
                     uint64_t seed, bool bfloat16, bool wide = true);

// out = grad * scale where value i's mask bit is set, grad * 0 elsewhere: the gradient of
// dropout_forward's `in`.
void dropout_backward(const void* grad, const uint8_t* mask, void* out, size_t size, float p,
                      bool bfloat16, bool wide = true);

// The random words of values first .. first + count - 1 under `seed`, computed by the AVX-512
// generator (`wide`, where the CPU has it) or the plain one: value i reads word (i >> 4) & 3 of
// Philox4x32-10 keyed (seed's low 32 bits, high 32 bits) at counter (b, b >> 32, 0, 0), where
// b = (i >> 6) * 16 + (i & 15); it is kept when that word is below keep * 2^32.
void dropout_random_words(uint64_t seed, uint64_t first, size_t count, uint32_t* out, bool wide);

}  // namespace mxamp

#endif  // MXAMP_DROPOUT_H_
