"""What a converted Gluon block reads of each call's arguments, and the calls no graph takes.

A converted block (`mxamp.gluon`) checks every call before running its CachedOp: its
inputs' shapes (a batch large enough for a layer kept in FP32 to pay), dtypes (low-precision
inputs are read as FP32), device type, and whether autograd records a graph its inputs are
in.  On a small network these reads are a visible share of a call, so each is made once,
through MXNet's C calls where its Python properties would build objects
(docs/performance.rst, "Beyond image classifiers").  A call passing other values than
arrays, which no graph takes, runs the block's code in FP32 (`forward_in_float32`).

MXNet internals relied on (MXNet 1.9.1), each named where it is used below: the C calls
``MXNDArrayGetShapeEx``, ``MXNDArrayGetDType`` and ``MXAutogradGetSymbol``, the context
``HybridBlock.forward`` sets around ``_call_cached_op``, ``_flatten``'s refusal of values
other than arrays and None, and ``HybridBlock._reg_params`` and ``hybrid_forward``.
"""
import ctypes
from typing import Any, Iterable, Iterator

import mxnet as mx
from mxnet import autograd
from mxnet.base import _LIB, SymbolHandle, check_call, mx_int
from mxnet.gluon.block import _regroup

from . import dtypes
from .dtypes import LOW_PRECISION, cast, name_of_array

__all__ = ['CallArrays', 'device_type_of', 'flat', 'float32_inputs', 'forward_in_float32',
           'graph_takes', 'inputs_take_gradients', 'run_cached_op']


def device_type_of(args):
    """The device type of the first NDArray among `args` (nested lists flattened); None
    without one."""
    for arg in flat(args):
        if isinstance(arg, mx.nd.NDArray):
            return arg.context.device_type
    return None


class CallArrays(object):
    """The NDArrays among a call's arguments, with what a converted block checks at every
    call read once: their ``shapes``, their ``device_type`` (None without arrays) and
    whether any is ``low_precision`` (float16 or bfloat16).

    MXNet 1.9.1: shapes and dtypes are read through the C calls behind ``NDArray.shape`` and
    ``.dtype`` (``MXNDArrayGetShapeEx``, ``MXNDArrayGetDType``), without the objects those
    properties build; the device type is the current context's, which
    ``HybridBlock.forward`` sets to the inputs' one context (it refuses several) around
    ``_call_cached_op``, as a converted block's own forward does.  On a small network,
    reading these through the properties was most of a converted block's cost per call
    (docs/performance.rst).
    """
    __slots__ = ('shapes', 'device_type', 'low_precision', 'device')

    def __init__(self, args):
        self._read(_arrays_of(args), None)
        self.device_type = mx.context.current_context().device_type if self.shapes else None
        self.device = None

    @classmethod
    def of_plain_call(cls, args):
        """The arrays of a call whose arguments are all dense NDArrays on one device (the
        call `run_cached_op` runs), with that ``device`` as MXNet's ``(device_typeid,
        device_id)``; None for any other call.  The device is read through
        ``MXNDArrayGetContext``, the C call behind ``NDArray.context``."""
        for arg in args:
            if type(arg) is not mx.nd.NDArray:
                return None
        arrays = cls.__new__(cls)
        devices = set()
        arrays._read(args, devices)
        if len(devices) != 1:
            return None
        arrays.device = devices.pop()
        arrays.device_type = mx.Context.devtype2str[arrays.device[0]]
        return arrays

    def _read(self, arrays, devices):
        shapes = []
        low = False
        byref = ctypes.byref
        for array in arrays:
            handle = array.handle
            ndim, dims, flag = mx_int(), _SHAPE_DATA(), ctypes.c_int()
            check_call(_LIB.MXNDArrayGetShapeEx(handle, byref(ndim), byref(dims)))
            shapes.append(tuple(dims[:ndim.value]) if ndim.value >= 0 else None)
            check_call(_LIB.MXNDArrayGetDType(handle, byref(flag)))
            low = low or flag.value in _LOW_PRECISION_FLAGS
            if devices is not None:
                device_type, device_id = ctypes.c_int(), ctypes.c_int()
                check_call(_LIB.MXNDArrayGetContext(handle, byref(device_type),
                                                    byref(device_id)))
                devices.add((device_type.value, device_id.value))
        self.shapes = tuple(shapes)
        self.low_precision = low


def run_cached_op(block, args):
    """The outputs of hybridized `block`'s CachedOp on `args`, dense NDArrays on the current
    device (`CallArrays.of_plain_call`); None where the call needs MXNet's own
    ``_call_cached_op`` (no CachedOp yet, an operator hook, arguments of another structure
    than the graph's).

    MXNet 1.9.1: ``HybridBlock._call_cached_op`` runs ``_cached_op`` on the inputs and the
    parameters ``_cached_op_args`` names (``(True, index)`` or ``(False, Parameter)``) and
    regroups its outputs by ``_out_format``, after flattening its arguments by the general
    rules (nested lists, None) and comparing them with ``_in_format``; with ``forward``'s
    search for their contexts, that general path was about as costly per call as a small
    network's whole graph.  A plain call's structure is ``[0, ...]``, one 0 an array.
    """
    if block._cached_op is None or block._callback is not None or \
            block._in_format != [0] * len(args):
        return None
    outputs = block._cached_op(*[args[index] if is_input else index.data()
                                 for is_input, index in block._cached_op_args])
    if isinstance(outputs, mx.nd.NDArray):
        outputs = [outputs]
    return _regroup(outputs, block._out_format)


#: What ``MXNDArrayGetShapeEx`` points to; MXNet's type flags of float16 and bfloat16.
_SHAPE_DATA = ctypes.POINTER(mx_int)
_LOW_PRECISION_FLAGS = frozenset(dtypes.type_flag(name) for name in LOW_PRECISION)


def _arrays_of(args):
    """The NDArrays among `args`, in order, nested lists and tuples flattened: `flat`'s,
    without its generator for the common call, whose arguments are arrays."""
    arrays = []
    for arg in args:
        if isinstance(arg, mx.nd.NDArray):
            arrays.append(arg)
        elif isinstance(arg, (list, tuple)):
            arrays.extend(item for item in flat(arg) if isinstance(item, mx.nd.NDArray))
    return arrays


def float32_inputs(args):
    """`args` with float16 and bfloat16 NDArrays cast to FP32 (nested lists kept).

    A converted graph reads FP32 inputs, as the FP32 net does (low-precision
    data is exact in FP32); MXNet would otherwise stop at the first operator.
    """
    def to_float32(arg):
        if isinstance(arg, (list, tuple)):
            return type(arg)(to_float32(a) for a in arg)
        if isinstance(arg, mx.nd.NDArray) and name_of_array(arg) in LOW_PRECISION:
            return cast(arg, 'float32')
        return arg
    return [to_float32(arg) for arg in args]


def flat(items: Iterable[Any]) -> Iterator[Any]:
    """The items of `items` in order, nested lists and tuples flattened."""
    for item in items:
        if isinstance(item, (list, tuple)):
            for sub in flat(item):
                yield sub
        else:
            yield item


def graph_takes(args):
    """Whether a graph can take `args`: NDArrays and None, in lists and tuples (MXNet 1.9.1's
    ``_flatten`` refuses anything else)."""
    return all(arg is None or isinstance(arg, mx.nd.NDArray) for arg in flat(args))


def forward_in_float32(block, x, *args):
    """Run converted `block`'s ``hybrid_forward`` on NDArrays, as MXNet 1.9.1's
    ``HybridBlock.forward`` does for a block not hybridized, its parameters read in FP32
    (a low-precision one through a cast that autograd follows): for calls whose arguments
    no graph takes (`graph_takes`).  Its children run as they would under it."""
    with x.context:
        params = {}
        for name, param in block._reg_params.items():
            value = param.data(x.context)
            params[name] = cast(value, 'float32') if name_of_array(value) in LOW_PRECISION \
                else value
        return block.hybrid_forward(mx.nd, x, *args, **params)


def inputs_take_gradients(args):
    """Whether autograd records and an input of `args` is in its graph: has a gradient
    attached, or was computed from an array that has.

    MXNet 1.9.1: ``MXAutogradGetSymbol`` (``autograd.get_symbol``'s C call) fails on an
    array outside any recorded graph (``NDArray::get_autograd_symbol``'s check), and MXNet
    records no operator whose inputs are all outside one.  It is called directly: through
    ``autograd.get_symbol`` each failure builds a formatted Python exception, which cost
    the common call (a batch outside the graph) more than a small network's forward.
    """
    if not autograd.is_recording():
        return False
    for arg in flat(args):
        if isinstance(arg, mx.nd.NDArray):
            symbol = SymbolHandle()
            if _LIB.MXAutogradGetSymbol(arg.handle, ctypes.byref(symbol)) == 0:
                _LIB.MXSymbolFree(symbol)
                return True
    return False
