"""The warnings converting a Gluon net gives, each once per process.

float16 on a CPU (emulated: FP32 compute between float16 casts), bfloat16 stored
only (a CPU without bfloat16 kernels), bfloat16 with AMX left off, and a bfloat16
graph no layer of which pays for bfloat16 here (`mxamp.cost`): under ``'auto'``
it computes in FP32, asked for bfloat16 it will be slower than FP32.
`mxamp.gluon` calls them when it converts a graph; tests reset the flags.
"""
import warnings

from . import cost, hardware
from .network_state import describe_block

__all__ = ['warn_bfloat16_storage_only', 'warn_bfloat16_without_amx', 'warn_float16_cpu',
           'warn_unpaid']

_warned_float16_cpu = False
_warned_bfloat16_storage_only = False
_warned_bfloat16_without_amx = False
_warned_unpaid = False


def warn_unpaid(block, policy, conversion, converted):
    """Say once when no layer of a bfloat16 graph pays for bfloat16 on this CPU (`mxamp.cost`:
    by its work, alone or in the region it opens, or by its work per value it casts): under
    'auto' the graph computes in FP32, asked for bfloat16 it will be slower than FP32.
    ``converted(params, policy)`` converts the graph under `policy`: asked for bfloat16, once
    more weighing costs, as 'auto' would."""
    global _warned_unpaid
    if _warned_unpaid or policy.dtype != 'bfloat16' or policy.bfloat16_storage_only:
        return
    model = policy.costs or cost.model_for(policy.cpu_class, inference=policy.inference)
    if model is None:
        return
    layers = {node.name: (node.op, conversion.works[node.name]) for node in conversion.nodes
              if node.name in conversion.works}
    if not layers:
        return
    weighed = conversion if policy.costs is not None else converted(
        conversion.lp_params, policy.with_costs(model))
    if weighed.computes_low:
        return
    largest = cost.largest_unpaid(layers, model)
    if largest is not None:
        name, op, work, threshold = largest
        why = ('none of its %d layers does enough work per call for bfloat16 to pay for its '
               'casts on this %s (the largest, %s %r, %.3g MFLOP; bfloat16 pays from %.3g)'
               % (len(layers), hardware.describe_cpu_class(policy.cpu_class), op, name, work,
                  threshold))
    else:
        why = ('its layers that do enough work cast more values than that work pays for on '
               'this %s (FP32 operators or the outputs read them: docs/policy.rst, "Layers too '
               'small for bfloat16")' % hardware.describe_cpu_class(policy.cpu_class))
    _warned_unpaid = True
    if policy.costs is not None:
        text = "mxamp: dtype='auto' computes %s in float32: %s" % (describe_block(block), why)
    else:
        # The model is measured on ladders of layers, not this network: a measurement on
        # the user's machine settles it, where one can time the converted net.
        measure = ('' if policy.inference else
                   '; mxamp.profile(net, *inputs, train=True) times both on this machine')
        text = ("mxamp: %s computes in bfloat16 as asked, but %s: expect it slower than float32 "
                "(dtype='auto' would keep it in float32%s)" % (describe_block(block), why,
                                                               measure))
    warnings.warn(text, RuntimeWarning, stacklevel=hardware.user_stacklevel())


def warn_float16_cpu():
    global _warned_float16_cpu
    if not _warned_float16_cpu:
        _warned_float16_cpu = True
        warnings.warn('mxamp: float16 on a CPU: MXNet 1.9.1 has no float16 convolution, '
                      'fully-connected or GEMM kernels on CPU, so these ops compute in FP32 '
                      'between float16 casts (float16 storage, FP32 accumulation, like '
                      'tensor cores); other ops run in float16', RuntimeWarning,
                      stacklevel=hardware.user_stacklevel())


def warn_bfloat16_storage_only():
    global _warned_bfloat16_storage_only
    if not _warned_bfloat16_storage_only:
        _warned_bfloat16_storage_only = True
        warnings.warn('mxamp: bfloat16 on this %s: parameters are stored in bfloat16 and every '
                      'op computes in FP32 between casts (results within bfloat16 rounding of a '
                      'bfloat16 CPU; for portability and half-size parameters, not for speed, '
                      'and in training not for memory: the FP32 master weights stay beside them)'
                      % hardware.describe_cpu_class(),
                      RuntimeWarning, stacklevel=hardware.user_stacklevel())


def warn_bfloat16_without_amx():
    global _warned_bfloat16_without_amx
    if not _warned_bfloat16_without_amx:
        _warned_bfloat16_without_amx = True
        warnings.warn("mxamp: bfloat16 on this %s trains slower than FP32 (docs/hardware.rst). "
                      "Enable AMX for the fast path, or keep float32 (dtype='auto' does)"
                      % hardware.describe_cpu_class(),
                      RuntimeWarning, stacklevel=hardware.user_stacklevel())
