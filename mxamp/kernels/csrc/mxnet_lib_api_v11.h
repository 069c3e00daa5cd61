// The C functions MXNet 1.9.1 looks up in an extension library (mx.library.load), as declared by
// the include/mxnet/lib_api.h that its wheel ships (MX_LIBRARY_VERSION 11; Apache-2.0).
//
// Only the declarations: MXNet's own lib_api.cc, which extension libraries usually compile in,
// is not used.  Its tensor wrapper (MXTensor) throws for the bfloat16 type flag 12
// ("Invalid dtype flag") although MXNet passes that flag through, and it rebuilds an attribute
// map and tensor vectors on every call; mxnet_extension.cc implements the functions directly.
//
// Built with -DMXAMP_WITH_MXNET_LIB_API and the installed MXNet's include directory, this header
// takes MXNet's real declarations instead: tests/test_own_conv.py compiles mxnet_extension.cc
// that way, so a definition that strays from MXNet's ABI fails to compile there.
#ifndef MXAMP_MXNET_LIB_API_V11_H_
#define MXAMP_MXNET_LIB_API_V11_H_

#ifdef MXAMP_WITH_MXNET_LIB_API
#include <mxnet/lib_api.h>
#else

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#define MX_LIBRARY_VERSION 11

namespace mxnet {
namespace ext {

enum MXReturnValue {
  MX_FAIL = 0,
  MX_SUCCESS = 1,
};

struct MXTensor;
struct MXContext;
class OpResource;
class CustomStatefulOp;
class CustomOpSelector;
class Graph;

typedef void* (*xpu_malloc_t)(void*, int);
typedef void (*sparse_malloc_t)(void*, int, int, int, void**, int64_t**, int64_t**);
typedef void (*nd_malloc_t)(const void* _ndarray_alloc, const int64_t* shapes, int num_shapes,
                            const char* dev_str, int dev_id, int dtype, const char* name,
                            int isArg, void** data);
typedef MXReturnValue (*fcomp_t)(const std::unordered_map<std::string, std::string>& attributes,
                                 std::vector<MXTensor>* inputs, std::vector<MXTensor>* outputs,
                                 const OpResource& res);
typedef MXReturnValue (*parseAttrs_t)(
    const std::unordered_map<std::string, std::string>& attributes, int* num_inputs,
    int* num_outputs);
typedef MXReturnValue (*inferType_t)(
    const std::unordered_map<std::string, std::string>& attributes, std::vector<int>* in_types,
    std::vector<int>* out_types);
typedef MXReturnValue (*inferSType_t)(
    const std::unordered_map<std::string, std::string>& attributes,
    std::vector<int>* in_storage_types, std::vector<int>* out_storage_types);
typedef MXReturnValue (*inferShape_t)(
    const std::unordered_map<std::string, std::string>& attributes,
    std::vector<std::vector<unsigned int>>* in_shapes,
    std::vector<std::vector<unsigned int>>* out_shapes);
typedef MXReturnValue (*mutateInputs_t)(
    const std::unordered_map<std::string, std::string>& attributes,
    std::vector<int>* input_indices);
typedef MXReturnValue (*createOpState_t)(
    const std::unordered_map<std::string, std::string>& attributes, const MXContext& ctx,
    const std::vector<std::vector<unsigned int>>& in_shapes, const std::vector<int> in_types,
    CustomStatefulOp**);
typedef MXReturnValue (*graphPass_t)(Graph* graph,
                                     const std::unordered_map<std::string, std::string>& options);
typedef MXReturnValue (*supportedOps_t)(
    const Graph* graph, std::vector<int>* ids,
    const std::unordered_map<std::string, std::string>& options);
typedef MXReturnValue (*createSelector_t)(
    const Graph* graph, CustomOpSelector** sel_inst,
    const std::unordered_map<std::string, std::string>& options);
typedef MXReturnValue (*reviewSubgraph_t)(
    const Graph* subgraph, int subgraph_id, bool* accept,
    const std::unordered_map<std::string, std::string>& options,
    std::unordered_map<std::string, std::string>* attrs);

}  // namespace ext
}  // namespace mxnet

#endif  // MXAMP_WITH_MXNET_LIB_API
#endif  // MXAMP_MXNET_LIB_API_V11_H_
