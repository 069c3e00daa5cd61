// What mxamp's oneDNN operators share (see onednn_runtime.h).
#include "onednn_runtime.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace mxamp {

using dnnl::memory;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(cpu_engine());
  return stream;
}

const char* dtype_name(int flag) {
  switch (flag) {
    case kFlagFloat32: return "float32";
    case kFlagFloat16: return "float16";
    case kFlagBFloat16: return "bfloat16";
    default: return "unsupported";
  }
}

memory::data_type onednn_type(int flag) {
  switch (flag) {
    case kFlagFloat32: return memory::data_type::f32;
    case kFlagFloat16: return memory::data_type::f16;
    case kFlagBFloat16: return memory::data_type::bf16;
    default:
      throw std::invalid_argument("data type flag " + std::to_string(flag) +
                                  ": mxamp's operators compute float32, float16 and bfloat16");
  }
}

memory::desc plain_desc(const memory::dims& dims, memory::data_type type) {
  memory::dims strides(dims.size());
  memory::dim stride = 1;
  for (size_t i = dims.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= dims[i];
  }
  return memory::desc(dims, type, strides);
}

memory::desc activation_desc(const memory::dims& dims, memory::data_type type,
                             bool channels_last) {
  if (!channels_last) return plain_desc(dims, type);
  static const memory::format_tag tags[] = {memory::format_tag::nwc, memory::format_tag::nhwc,
                                            memory::format_tag::ndhwc};
  if (dims.size() < 3 || dims.size() > 5)
    throw std::invalid_argument("channels-last arrays have 3 to 5 dimensions");
  return memory::desc(dims, type, tags[dims.size() - 3]);
}

char* scratch_memory(const Scratch& scratch, size_t bytes) {
  if (bytes == 0) return nullptr;
  // MXNet's temporary space is 64-byte aligned already; ask for slack in case it is not.
  char* raw = static_cast<char*>(scratch(bytes + kAlignment));
  if (raw == nullptr) throw std::runtime_error("MXNet gave no temporary memory");
  uintptr_t address = reinterpret_cast<uintptr_t>(raw);
  return raw + (aligned(address) - address);
}

}  // namespace mxamp
