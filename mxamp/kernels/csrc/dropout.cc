// Dropout in training, and its gradient, on counter-based random bits (see dropout.h).
#include "dropout.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "fan_out.h"
#include "master_weights.h"
#include "vector_isa.h"

namespace mxamp {
namespace {

// Philox4x32-10's constants (Salmon et al., SC 2011, and their Random123 library).
constexpr uint32_t kMultiplier0 = 0xD2511F53u;
constexpr uint32_t kMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u;  // the key's increment per round
constexpr uint32_t kWeyl1 = 0xBB67AE85u;
constexpr int kRounds = 10;

// Values per group: the four words of sixteen consecutive blocks, one AVX-512 vector a word.
constexpr int64_t kGroup = 64;
// Values whose words are generated at once, into a buffer that stays in the L1 cache; a multiple
// of kGroup, and kChunk (vector_isa.h) a multiple of it, so that every tile starts a group.
constexpr int64_t kTile = 1024;
static_assert(kTile % kGroup == 0 && kChunk % kTile == 0, "tiles must start groups");
static_assert(kTile % 8 == 0, "tiles must start bytes of the mask");

// The words of `groups` groups from group `first_group`, as dropout.h numbers them:
// out[64 g + 16 k + l] is word k of block 16 (first_group + g) + l.
typedef void (*Generator)(uint64_t first_group, int64_t groups, uint64_t seed, uint32_t* out);

MXAMP_ANY_X86 void words_plain(uint64_t first_group, int64_t groups, uint64_t seed,
                               uint32_t* out) {
  for (int64_t g = 0; g < groups; ++g) {
    for (uint32_t l = 0; l < 16; ++l) {
      const uint64_t block = (first_group + g) * 16 + l;
      uint32_t c0 = static_cast<uint32_t>(block), c1 = static_cast<uint32_t>(block >> 32);
      uint32_t c2 = 0, c3 = 0;
      uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
      for (int r = 0; r < kRounds; ++r) {
        const uint64_t p0 = static_cast<uint64_t>(kMultiplier0) * c0;
        const uint64_t p1 = static_cast<uint64_t>(kMultiplier1) * c2;
        const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
        const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
        c1 = static_cast<uint32_t>(p1);
        c3 = static_cast<uint32_t>(p0);
        c0 = n0;
        c2 = n2;
        k0 += kWeyl0;
        k1 += kWeyl1;
      }
      uint32_t* words = out + g * kGroup + l;
      words[0] = c0;
      words[16] = c1;
      words[32] = c2;
      words[48] = c3;
    }
  }
}

// The high and low halves of the 64-bit products a * m of sixteen 32-bit lanes.  (The zero-masked
// forms with every lane set are the plain instructions; GCC 12's plain intrinsics start from an
// undefined vector that -Wall takes for an uninitialised one.)
MXAMP_AVX512_INLINE void multiply_high_low(__m512i a, __m512i m, __m512i* high, __m512i* low) {
  constexpr __mmask8 kAll = 0xFF;
  const __m512i even = _mm512_maskz_mul_epu32(kAll, a, m);  // lanes 0, 2, ... as 64-bit products
  const __m512i odd = _mm512_maskz_mul_epu32(kAll, _mm512_maskz_srli_epi64(kAll, a, 32), m);
  *high = _mm512_mask_blend_epi32(0xAAAA, _mm512_maskz_srli_epi64(kAll, even, 32), odd);
  *low = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_maskz_slli_epi64(kAll, odd, 32));
}

MXAMP_AVX512 void words_avx512(uint64_t first_group, int64_t groups, uint64_t seed,
                               uint32_t* out) {
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(kMultiplier0));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(kMultiplier1));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t g = 0; g < groups; ++g) {
    // A group's first block is a multiple of 16: adding the lane never carries into c1.
    const uint64_t block = (first_group + g) * 16;
    __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(block)), lane);
    __m512i c1 = _mm512_set1_epi32(static_cast<int>(block >> 32));
    __m512i c2 = _mm512_setzero_si512(), c3 = _mm512_setzero_si512();
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int r = 0; r < kRounds; ++r) {
      __m512i high0, low0, high1, low1;
      multiply_high_low(c0, m0, &high0, &low0);
      multiply_high_low(c2, m1, &high1, &low1);
      c0 = _mm512_xor_si512(_mm512_xor_si512(high1, c1), _mm512_set1_epi32(static_cast<int>(k0)));
      c2 = _mm512_xor_si512(_mm512_xor_si512(high0, c3), _mm512_set1_epi32(static_cast<int>(k1)));
      c1 = low1;
      c3 = low0;
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    uint32_t* words = out + g * kGroup;
    _mm512_storeu_si512(words, c0);
    _mm512_storeu_si512(words + 16, c1);
    _mm512_storeu_si512(words + 32, c2);
    _mm512_storeu_si512(words + 48, c3);
  }
}

// The mask bits of n values (bit j & 7 of byte j >> 3 set where value j is kept, the bits past n
// clear) from their words, and the keep bytes (1 or 0) of n values from their mask bits.
typedef void (*Packer)(const uint32_t* words, uint32_t threshold, int64_t n, uint8_t* bits);
typedef void (*Unpacker)(const uint8_t* bits, int64_t n, uint8_t* keep);

MXAMP_ANY_X86 void pack_plain(const uint32_t* words, uint32_t threshold, int64_t n,
                              uint8_t* bits) {
  for (int64_t b = 0; 8 * b < n; ++b) {
    unsigned byte = 0;
    for (int64_t k = 0; k < 8 && 8 * b + k < n; ++k)
      byte |= static_cast<unsigned>(words[8 * b + k] < threshold) << k;
    bits[b] = static_cast<uint8_t>(byte);
  }
}

MXAMP_ANY_X86 void unpack_plain(const uint8_t* bits, int64_t n, uint8_t* keep) {
  for (int64_t j = 0; j < n; ++j) keep[j] = (bits[j >> 3] >> (j & 7)) & 1;
}

// Sixteen values a step: their compare is the mask's two bytes (little-endian).
MXAMP_AVX512 void pack_avx512(const uint32_t* words, uint32_t threshold, int64_t n,
                              uint8_t* bits) {
  const __m512i limit = _mm512_set1_epi32(static_cast<int>(threshold));
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t rest = n - j;
    const __mmask16 valid = rest >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << rest) - 1);
    const uint16_t keep = _mm512_mask_cmplt_epu32_mask(valid, _mm512_loadu_si512(words + j),
                                                       limit);
    std::memcpy(bits + j / 8, &keep, rest >= 16 ? 2 : (rest + 7) / 8);
  }
}

// Writes whole steps of sixteen: `keep` has room for n rounded up to 16.
MXAMP_AVX512 void unpack_avx512(const uint8_t* bits, int64_t n, uint8_t* keep) {
  for (int64_t j = 0; j < n; j += 16) {
    uint16_t lanes = 0;
    std::memcpy(&lanes, bits + j / 8, n - j >= 16 ? 2 : (n - j + 7) / 8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(keep + j), _mm_maskz_set1_epi8(lanes, 1));
  }
}

// What each instruction set runs: the generator and the mask's packing.
struct Isa {
  Generator generate;
  Packer pack;
  Unpacker unpack;
};

// One forward call's constants: a value is kept when its word is below `threshold`.
struct Forward {
  const void* in;
  void* out;
  uint8_t* mask;  // one bit a value
  uint64_t seed;
  uint32_t threshold;
  float scale;
  bool bfloat16;
};

// out[j] = in[j] * (scale where kept, else 0) for j < n, from the words of those values.
MXAMP_LOOP_BODY void keep_float32(const float* in, float* out, const uint32_t* words,
                                  uint32_t threshold, float scale, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = in[j] * (words[j] < threshold ? scale : 0.0f);
}

MXAMP_LOOP_BODY void keep_bfloat16(const uint16_t* in, uint16_t* out, const uint32_t* words,
                                   uint32_t threshold, float scale, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j)
    out[j] = round_to_bfloat16(widen_bfloat16(in[j]) * (words[j] < threshold ? scale : 0.0f));
}

// Values [begin, end) of one chunk (begin a multiple of kTile), tile by tile.
MXAMP_LOOP_BODY void forward_tiles(const Forward& f, const Isa& isa, int64_t begin, int64_t end) {
  alignas(64) uint32_t words[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t n = std::min(kTile, end - t);
    isa.generate(static_cast<uint64_t>(t / kGroup), (n + kGroup - 1) / kGroup, f.seed, words);
    isa.pack(words, f.threshold, n, f.mask + t / 8);
    if (f.bfloat16) {
      keep_bfloat16(static_cast<const uint16_t*>(f.in) + t, static_cast<uint16_t*>(f.out) + t,
                    words, f.threshold, f.scale, n);
    } else {
      keep_float32(static_cast<const float*>(f.in) + t, static_cast<float*>(f.out) + t, words,
                   f.threshold, f.scale, n);
    }
  }
}

const Isa kAvx512 = {&words_avx512, &pack_avx512, &unpack_avx512};
const Isa kPlain = {&words_plain, &pack_plain, &unpack_plain};

MXAMP_AVX512 void forward_chunk_avx512(const Forward& f, int64_t begin, int64_t end) {
  forward_tiles(f, kAvx512, begin, end);
}

MXAMP_ANY_X86 void forward_chunk(const Forward& f, int64_t begin, int64_t end) {
  forward_tiles(f, kPlain, begin, end);
}

// One backward call's arrays and scale.
struct Backward {
  const void* grad;
  const uint8_t* mask;  // one bit a value
  void* out;
  float scale;
  bool bfloat16;
};

// out[j] = grad[j] * (scale where keep[j], else 0) for j < n.
MXAMP_LOOP_BODY void gradient_float32(const float* grad, const uint8_t* keep, float* out,
                                      float scale, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = grad[j] * (keep[j] ? scale : 0.0f);
}

MXAMP_LOOP_BODY void gradient_bfloat16(const uint16_t* grad, const uint8_t* keep, uint16_t* out,
                                       float scale, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j)
    out[j] = round_to_bfloat16(widen_bfloat16(grad[j]) * (keep[j] ? scale : 0.0f));
}

MXAMP_LOOP_BODY void backward_tiles(const Backward& b, const Isa& isa, int64_t begin,
                                    int64_t end) {
  alignas(64) uint8_t keep[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t n = std::min(kTile, end - t);
    isa.unpack(b.mask + t / 8, n, keep);
    if (b.bfloat16) {
      gradient_bfloat16(static_cast<const uint16_t*>(b.grad) + t, keep,
                        static_cast<uint16_t*>(b.out) + t, b.scale, n);
    } else {
      gradient_float32(static_cast<const float*>(b.grad) + t, keep,
                       static_cast<float*>(b.out) + t, b.scale, n);
    }
  }
}

MXAMP_AVX512 void backward_chunk_avx512(const Backward& b, int64_t begin, int64_t end) {
  backward_tiles(b, kAvx512, begin, end);
}

MXAMP_ANY_X86 void backward_chunk(const Backward& b, int64_t begin, int64_t end) {
  backward_tiles(b, kPlain, begin, end);
}

// MXNet's keep probability and scale, in float32 as its Dropout computes them.
float keep_probability(float p) { return 1.0f - p; }

float scale_of(float keep) { return keep < 1.0f ? 1.0f / keep : 1.0f; }

}  // namespace

void check_dropout_probability(float p) {
  if (!(p >= 0.0f && p <= 1.0f))
    throw std::invalid_argument("p=" + std::to_string(p) + ": dropout takes 0 <= p <= 1");
}

void dropout_forward(const void* in, void* out, uint8_t* mask, size_t size, float p,
                     uint64_t seed, bool bfloat16, bool wide) {
  check_dropout_probability(p);
  const float keep = keep_probability(p);
  const int64_t n = static_cast<int64_t>(size);
  if (!(keep < 1.0f)) {  // MXNet's passthrough: the identity, every value kept
    copy_bytes(in, out, size * (bfloat16 ? 2 : 4));
    std::memset(mask, 0xFF, size / 8);
    if (size % 8) mask[size / 8] = static_cast<uint8_t>((1u << (size % 8)) - 1);
    return;
  }
  // keep * 2^32 is below 2^32 and, for keep >= 2^-9, an integer: the threshold makes the
  // probability of keeping a value exactly keep.
  const Forward f = {in, out, mask, seed,
                     static_cast<uint32_t>(static_cast<double>(keep) * 4294967296.0),
                     scale_of(keep), bfloat16};
  wide = wide && has_avx512();
  for_chunks(n, [&](int64_t begin, int64_t end) {
    if (wide) {
      forward_chunk_avx512(f, begin, end);
    } else {
      forward_chunk(f, begin, end);
    }
  });
}

void dropout_backward(const void* grad, const uint8_t* mask, void* out, size_t size, float p,
                      bool bfloat16, bool wide) {
  check_dropout_probability(p);
  const Backward b = {grad, mask, out, scale_of(keep_probability(p)), bfloat16};
  wide = wide && has_avx512();
  for_chunks(static_cast<int64_t>(size), [&](int64_t begin, int64_t end) {
    if (wide) {
      backward_chunk_avx512(b, begin, end);
    } else {
      backward_chunk(b, begin, end);
    }
  });
}

void dropout_random_words(uint64_t seed, uint64_t first, size_t count, uint32_t* out,
                          bool wide) {
  const Generator generate = wide && has_avx512() ? &words_avx512 : &words_plain;
  alignas(64) uint32_t group[kGroup];
  for (size_t i = 0; i < count;) {
    const uint64_t value = first + i;
    generate(value / kGroup, 1, seed, group);
    const size_t n = std::min<size_t>(count - i, kGroup - value % kGroup);
    std::memcpy(out + i, group + value % kGroup, n * sizeof(uint32_t));
    i += n;
  }
}

}  // namespace mxamp

// For the tests (ctypes), which compare the plain loops with the AVX-512 ones on a CPU that runs
// both: the random words the forward pass compares, and a forward and backward pass, from either.
extern "C" __attribute__((visibility("default"))) void mxamp_dropout_random_words(
    uint64_t seed, uint64_t first, uint64_t count, uint32_t* out, int wide) {
  mxamp::dropout_random_words(seed, first, static_cast<size_t>(count), out, wide != 0);
}

extern "C" __attribute__((visibility("default"))) const char* mxamp_dropout_forward_backward(
    const void* in, void* out, uint8_t* mask, const void* grad, void* grad_out, uint64_t size,
    float p, uint64_t seed, int bfloat16, int wide) {
  try {
    mxamp::dropout_forward(in, out, mask, static_cast<size_t>(size), p, seed, bfloat16 != 0,
                           wide != 0);
    mxamp::dropout_backward(grad, mask, grad_out, static_cast<size_t>(size), p, bfloat16 != 0,
                            wide != 0);
  } catch (const std::exception& e) {
    thread_local std::string error;
    error = e.what();
    return error.c_str();
  }
  return nullptr;
}
