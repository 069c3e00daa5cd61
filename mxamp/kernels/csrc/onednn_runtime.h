// What mxamp's oneDNN operators share: the engine, a stream per thread, MXNet's type flags and
// plain layouts in oneDNN's terms, and MXNet's temporary space aligned for oneDNN.
#ifndef MXAMP_ONEDNN_RUNTIME_H_
#define MXAMP_ONEDNN_RUNTIME_H_

#include <oneapi/dnnl/dnnl.hpp>

#include <cstddef>

#include "onednn_conv.h"

namespace mxamp {

constexpr size_t kAlignment = 64;  // cache line; what oneDNN's own allocations use

inline size_t aligned(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

dnnl::engine& cpu_engine();
// oneDNN streams are not thread-safe; MXNet may run operators on several worker threads.
dnnl::stream& thread_stream();

const char* dtype_name(int flag);
// Throws std::invalid_argument for a flag other than float32, float16 and bfloat16.
dnnl::memory::data_type onednn_type(int flag);

// A dense row-major descriptor: MXNet's layout of an array of these dimensions.
dnnl::memory::desc plain_desc(const dnnl::memory::dims& dims, dnnl::memory::data_type type);
// An array of `dims` in oneDNN's order (N, C, spatial...) as MXNet holds it: in that order, or
// with the channels last (N, spatial..., C).
dnnl::memory::desc activation_desc(const dnnl::memory::dims& dims, dnnl::memory::data_type type,
                                   bool channels_last);

// `bytes` of MXNet's temporary space, 64-byte aligned; null for none.
char* scratch_memory(const Scratch& scratch, size_t bytes);

}  // namespace mxamp

#endif  // MXAMP_ONEDNN_RUNTIME_H_
