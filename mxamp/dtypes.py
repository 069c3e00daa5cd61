"""Precision names ('float32', 'float16', 'bfloat16') and their MXNet and numpy forms.

MXNet 1.9.1 holds bfloat16 as the struct ``dtype([('bfloat16', '<u2')])``, refuses its name in
most Python entry points and gives raw uint16 from ``asnumpy()``: this module translates."""
# Unevaluated annotations: kvstore servers run this inside `import mxnet`, before mx.gluon exists.
from __future__ import annotations

import functools
import json
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import ml_dtypes
import numpy as np

import mxnet as mx

from . import hardware

__all__ = ['BFLOAT16', 'ContextLike', 'DTypeLike', 'LOW_PRECISION', 'NUMPY_BFLOAT16', 'ROUNDING_SUFFIX',
           'amp_cast', 'bfloat16_casts_round_to_even', 'bfloat16_rounding_nodes', 'cast', 'cast_into',
           'auto_on_this_cpu', 'dtype_name', 'from_numpy', 'name_of_array', 'numpy_dtype',
           'param_precision', 'precision_name', 'resolve_dtype', 'to_float32_numpy', 'to_numpy',
           'type_flag', 'widen']

#: A dtype: a precision name or alias (``'bf16'``, ``'fp16'``, ``'half'``...), a numpy type or dtype.
DTypeLike = Union[str, type, np.dtype]

#: Where a model runs: one ``mx.Context``, or a list (or tuple) of them.
ContextLike = Union[mx.Context, List[mx.Context], Tuple[mx.Context, ...]]

#: MXNet's bfloat16 dtype (equal to ``mxnet.contrib.amp.amp.bfloat16``).
BFLOAT16 = np.dtype([('bfloat16', np.uint16)])

#: numpy's bfloat16 (``ml_dtypes.bfloat16``), of `to_numpy` and `from_numpy`.
NUMPY_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: The low-precision targets mxamp converts to.
LOW_PRECISION = ('float16', 'bfloat16')

_NUMPY: Dict[str, np.dtype] = {'float32': np.dtype(np.float32), 'float16': np.dtype(np.float16),
                               'bfloat16': BFLOAT16}
_NAME_OF_NUMPY = {np_dtype: name for name, np_dtype in _NUMPY.items()}
_NAME_OF_NUMPY[NUMPY_BFLOAT16] = 'bfloat16'
# What NDArray.dtype returns, looked up as it is: a converted net reads its inputs' dtypes at
# every call, and np.dtype() costs more than the rest of that check.
_NAME_OF_RETURNED: Dict[Any, str] = {**_NAME_OF_NUMPY, np.float32: 'float32', np.float16: 'float16'}
# MXNet's TypeFlag enum (mshadow/base.h), as stored in a variable's ``__dtype__`` attribute.
_TYPE_FLAG = {'float32': 0, 'float16': 2, 'bfloat16': 12}
_ALIASES = {'fp32': 'float32', 'fp16': 'float16', 'half': 'float16', 'bf16': 'bfloat16'}


def dtype_name(dtype: DTypeLike, allowed: Sequence[str] = ('float32',) + LOW_PRECISION) -> str:
    """The canonical name of `dtype` (a name, alias, numpy type or dtype), one of `allowed`;
    ValueError listing them otherwise."""
    name = None
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.lower(), dtype.lower())
    else:
        try:
            name = _NAME_OF_RETURNED.get(dtype) or _NAME_OF_NUMPY.get(np.dtype(dtype))
        except TypeError:
            pass
    if name is None or name not in allowed:
        raise ValueError('unknown dtype %r: expected one of %s'
                         % (dtype, ', '.join(repr(a) for a in allowed)))
    return name


def numpy_dtype(name: str) -> np.dtype:
    """MXNet's dtype object for a precision name (``BFLOAT16`` for ``'bfloat16'``)."""
    return _NUMPY[dtype_name(name)]


def type_flag(name: str) -> int:
    """MXNet's integer type flag for a precision name (``__dtype__`` attribute value)."""
    return _TYPE_FLAG[dtype_name(name)]


def precision_name(dtype: Optional[DTypeLike]) -> Optional[str]:
    """The precision name of `dtype`, or None for any other type (indices, float64...)."""
    if dtype is None:
        return None
    try:
        return dtype_name(dtype)
    except ValueError:
        return None


def param_precision(param: mx.gluon.Parameter) -> Optional[str]:
    """The precision of a Gluon Parameter, or the one `mxamp.convert` gave it: an uninitialised
    parameter reads FP32 until its first forward pass, so trainers decide from this."""
    return getattr(param, '_mxamp_precision', None) or precision_name(param.dtype)


def name_of_array(array: Union[mx.ndarray.NDArray, mx.gluon.Parameter]) -> Optional[str]:
    """`precision_name` of an NDArray's (or a Parameter's) dtype."""
    return precision_name(array.dtype)


@functools.lru_cache(maxsize=None)
def _reference_bfloat16_reorders():
    """oneDNN 2.4.4 has jit bfloat16 reorders from avx512_core up: ``'avx2'`` runs slow loops."""
    return hardware.cpu_class() == hardware.AVX2


#: The name part of `bfloat16_rounding_nodes`' helper nodes, for readers of a graph.
ROUNDING_SUFFIX = '_mxamp_rounding_'

# Above the midpoint between the largest bfloat16 and 2**128 (larger floats round to
# infinity) and below 2**128 / (1 + 2**-16), so that the scaled split cannot overflow.
_SPLIT_BOUND = 3.4e38


def bfloat16_rounding_nodes(source: Sequence[int], first: int, name: str) -> List[Dict]:
    """The JSON nodes of a float32 -> bfloat16 cast that rounds to nearest even, in ops any
    MXNet runs and saves (MXNet 1.9.1's ``Cast`` truncates; ``save`` drops ``amp_cast``).

    Veltkamp's split of ``x * 2**-16`` (`x` clipped to +-3.4e38) rounds to 8 significant
    bits as ``amp_cast`` does, and ``Cast`` is then exact; below 2**-110 it may be one step
    off (docs/policy.rst).  `source` is the float32 entry (node, output), `first` the index
    the first node gets, `name` the ``Cast``'s; the others add `ROUNDING_SUFFIX` and a step.
    """
    def scaled(factor, index):
        return '_mul_scalar', {'scalar': repr(factor)}, [[index, 0, 0]]
    steps = [('bounded', 'clip', {'a_min': repr(-_SPLIT_BOUND), 'a_max': repr(_SPLIT_BOUND)},
              [[source[0], source[1], 0]]),
             ('scaled',) + scaled(2.0 ** -16, first),
             ('spread',) + scaled((2 ** 16 + 1) * 2.0 ** -16, first),
             ('residual', 'elemwise_sub', {}, [[first + 2, 0, 0], [first + 1, 0, 0]]),
             ('split', 'elemwise_sub', {}, [[first + 2, 0, 0], [first + 3, 0, 0]]),
             ('rounded',) + scaled(2.0 ** 16, first + 4)]
    nodes = [{'op': op, 'name': name + ROUNDING_SUFFIX + step, 'attrs': attrs, 'inputs': inputs}
             for step, op, attrs, inputs in steps]
    nodes.append({'op': 'Cast', 'name': name, 'attrs': {'dtype': 'bfloat16'},
                  'inputs': [[first + len(steps) - 1, 0, 0]]})
    return nodes


@functools.lru_cache(maxsize=None)
def _round_to_bfloat16():
    # MXNet 1.9.1: the C++ Cast reads dtype='bfloat16' from JSON; nd.Cast needs ml_dtypes.
    nodes = [{'op': 'null', 'name': 'x', 'inputs': []}] + \
        bfloat16_rounding_nodes((0, 0), 1, 'to_bfloat16')
    graph = {'nodes': nodes, 'arg_nodes': [0], 'heads': [[len(nodes) - 1, 0, 0]],
             'attrs': {'mxnet_version': ['int', 10901]}}
    return mx.ndarray.CachedOp(mx.symbol.load_json(json.dumps(graph)))


def _generic_cast(array, dtype, out=None):
    """float32 <-> bfloat16 with MXNet's generic kernels: exact widening, rounded narrowing."""
    if np.dtype(dtype) == np.float32:
        return mx.ndarray.Cast(array, dtype='float32', out=out)
    return _round_to_bfloat16()(array, out=out)


def bfloat16_casts_round_to_even() -> bool:
    """Whether this process narrows float32 to bfloat16 as oneDNN's reorders do (subnormals
    flushed); else as `bfloat16_rounding_nodes`.  Code that recomputes a cast must round alike."""
    return not _reference_bfloat16_reorders()


def _generic_applies(source, target):
    return _reference_bfloat16_reorders() and {np.dtype(source), np.dtype(target)} == {
        np.dtype(np.float32), BFLOAT16}


def widen(array: mx.ndarray.NDArray) -> mx.ndarray.NDArray:
    """A float32 copy of `array` (a gradient: default layout); through ``mx.ndarray``, for servers."""
    if _generic_applies(array.dtype, np.float32):
        return _generic_cast(array, np.float32)
    return mx.ndarray.amp_cast(array, dtype=np.float32)


def cast_into(array: mx.ndarray.NDArray, out: mx.ndarray.NDArray) -> mx.ndarray.NDArray:
    """Cast `array` (default layout) into `out`, whose oneDNN layout the kernel resets."""
    if _generic_applies(array.dtype, out.dtype):
        return _generic_cast(array, out.dtype, out=out)
    return mx.ndarray.amp_cast(array, dtype=out.dtype, out=out)


def amp_cast(array: mx.ndarray.NDArray, dtype: DTypeLike,
             out: Optional[mx.ndarray.NDArray] = None) -> mx.ndarray.NDArray:
    """``amp_cast`` that also works on arrays holding a oneDNN blocked layout; never a view.

    MXNet 1.9.1 (oneDNN 2.4): grouped and depthwise weights keep a 5-D layout after inference,
    which ``amp_cast`` cannot reorder into 4-D; from a 1-D view it reads the default layout,
    at no cost.  Weight gradients are always in the default layout (``CreateMKLDNNWeightGrad``).
    `out`: a private array in the default layout.  ``mx.ndarray``: it runs on kvstore servers.
    """
    if _generic_applies(array.dtype, dtype):
        return _generic_cast(array, dtype, out=out)
    if array.ndim <= 1:
        return mx.ndarray.amp_cast(array, dtype=dtype, out=out)
    if out is None:
        # MXNet 1.9.1 internal: memory allocated when the cast runs (mx.nd.empty: at once).
        out = mx.ndarray.NDArray(mx.ndarray.ndarray._new_alloc_handle(
            array.shape, array.context, True, dtype))
    mx.ndarray.amp_cast(array.reshape((-1,)), dtype=dtype, out=out.reshape((-1,)))
    return out


def cast(array: mx.ndarray.NDArray, name: str) -> mx.ndarray.NDArray:
    """Cast an NDArray to a precision name (`array` itself if it has it); differentiable."""
    target = numpy_dtype(name)
    if array.dtype == target:
        return array
    # MXNet 1.9.1: amp_cast alone takes the bfloat16 struct in Python and rounds to nearest.
    if mx.autograd.is_recording() and array.ndim > 1 and not _generic_applies(array.dtype, target):
        # out= is not recorded; a cast between recorded reshapes is.
        return mx.nd.amp_cast(array.reshape((-1,)), dtype=target).reshape(array.shape)
    return amp_cast(array, target)


def to_float32_numpy(array: mx.ndarray.NDArray) -> np.ndarray:
    """``array.asnumpy()`` in float32, bfloat16 widened exactly on the host (any layout)."""
    return to_numpy(array).astype(np.float32, copy=False)


def to_numpy(array: mx.ndarray.NDArray) -> np.ndarray:
    """``array.asnumpy()``, with bfloat16 as `NUMPY_BFLOAT16`, not raw uint16; one host sync.

    >>> mxamp.dtypes.to_numpy(mxamp.dtypes.cast(mx.nd.array([1.0, -2.5, 3.14159]), 'bfloat16'))
    array([1, -2.5, 3.14062], dtype=bfloat16)
    """
    values = array.asnumpy()
    if array.dtype == BFLOAT16:
        return values.view(NUMPY_BFLOAT16)
    return values


def from_numpy(values: np.ndarray, ctx: Optional[mx.Context] = None) -> mx.ndarray.NDArray:
    """An NDArray (on `ctx`) holding numpy `values` in their dtype, bfloat16 bit for bit
    (``mx.nd.array`` would store float32); TypeError for anything but a numpy array."""
    if not isinstance(values, np.ndarray):
        raise TypeError('from_numpy(): values must be a numpy array, got %s'
                        % type(values).__name__)
    if values.dtype == NUMPY_BFLOAT16:
        return mx.nd.array(values.view(np.uint16), ctx=ctx, dtype=BFLOAT16)
    return mx.nd.array(values, ctx=ctx, dtype=values.dtype)


_warned_auto_float32 = False


def is_auto(dtype: Optional[DTypeLike]) -> bool:
    """Whether `dtype` asks for ``'auto'`` (any case)."""
    return isinstance(dtype, str) and dtype.lower() == 'auto'


def resolve_dtype(dtype: DTypeLike, ctx: Optional[ContextLike] = None) -> str:
    """The precision name for `dtype` (``'auto'`` or a `dtype_name`) on `ctx` (None: this machine).

    ``'auto'`` is float16 on a GPU, bfloat16 where `mxamp.hardware.bfloat16_pays`, else float32,
    said once per process in a warning naming the CPU class.  ValueError: unknown `dtype`."""
    if not is_auto(dtype):
        return dtype_name(dtype)
    if isinstance(ctx, (list, tuple)):
        ctx = ctx[0] if ctx else None
    on_gpu = hardware.gpu_count() > 0 if ctx is None else ctx.device_type == 'gpu'
    if on_gpu:
        return 'float16'
    precision, why = auto_on_this_cpu()
    global _warned_auto_float32
    if precision == 'float32' and not _warned_auto_float32:
        _warned_auto_float32 = True
        warnings.warn("mxamp: dtype='auto' stays in float32 on %s" % why,
                      RuntimeWarning, stacklevel=hardware.user_stacklevel())
    return precision


def auto_on_this_cpu() -> Tuple[str, str]:
    """``('bfloat16' or 'float32', why)``: ``'auto'`` on this CPU, the reason a phrase
    starting ``'this <CPU class>'``; warns nothing."""
    cpu = hardware.describe_cpu_class()
    if hardware.bfloat16_pays():
        return 'bfloat16', 'this %s computes bfloat16 natively' % cpu
    if hardware.computes_bfloat16():
        return 'float32', ("this %s; dtype='bfloat16' still computes in bfloat16 here; AMX "
                           "enabled makes it the fast path" % cpu)
    return 'float32', ("this %s; bfloat16 pays on CPUs with AVX512-BF16 or AMX; "
                       "dtype='bfloat16' still works here: bfloat16 storage, FP32 compute, "
                       "slower than FP32" % cpu)

