"""Precision names and their MXNet and numpy representations.

mxamp speaks three precisions, always by name: ``'float32'``, ``'float16'`` and
``'bfloat16'``.  MXNet 1.9.1 has no numpy dtype for bfloat16: it represents it as
the numpy struct ``dtype([('bfloat16', '<u2')])``, rejects the string
``'bfloat16'`` in most Python entry points (``astype``, ``nd.array``; its
operators, ``nd.Cast`` included, read the name through numpy, which knows it only
once ``ml_dtypes`` is imported) and hands raw uint16 structs back from
``asnumpy()``.  This module owns the translation, so the rest of mxamp (and its
users) only ever handle the names, and which name ``'auto'`` stands for on a
device (:func:`resolve_dtype`, from the facts of :mod:`mxamp.hardware`, the one
mxamp module below this one).

On the host, bfloat16 data is numpy's ``ml_dtypes.bfloat16`` (the dtype JAX and
TensorFlow use, `NUMPY_BFLOAT16`): :func:`to_numpy` and :func:`from_numpy` move
bfloat16 NDArrays to and from it bit for bit, and every function that takes a
dtype takes it for ``'bfloat16'``.
"""
# Annotations stay unevaluated: this module also runs on kvstore servers, inside
# `import mxnet`, where mx.gluon (named in them) does not exist yet.
from __future__ import annotations

import functools
import json
import warnings
from typing import Dict, List, Optional, Sequence, Tuple, Union

import ml_dtypes
import numpy as np

import mxnet as mx

from . import hardware

__all__ = ['BFLOAT16', 'ContextLike', 'DTypeLike', 'LOW_PRECISION', 'NUMPY_BFLOAT16', 'ROUNDING_SUFFIX',
           'amp_cast', 'bfloat16_casts_round_to_even', 'bfloat16_rounding_nodes', 'cast', 'cast_into',
           'auto_on_this_cpu', 'dtype_name', 'from_numpy', 'name_of_array', 'numpy_dtype',
           'param_precision', 'precision_name', 'resolve_dtype', 'to_float32_numpy', 'to_numpy',
           'type_flag', 'widen']

#: What mxamp accepts wherever it takes a dtype: a precision name or alias
#: (``'bfloat16'``, ``'bf16'``, ``'float16'``, ``'fp16'``, ``'half'``, ``'float32'``,
#: ``'fp32'``; ``'auto'`` where a function says so), a numpy scalar type
#: (``numpy.float16``, ``ml_dtypes.bfloat16``) or a numpy dtype (MXNet's bfloat16
#: struct, `BFLOAT16`, and `NUMPY_BFLOAT16` included).  Which of them a function
#: takes is in its docstring; the precision names are what mxamp hands back.
DTypeLike = Union[str, type, np.dtype]

#: Where a model runs: one ``mx.Context``, or a list (or tuple) of them.
ContextLike = Union[mx.Context, List[mx.Context], Tuple[mx.Context, ...]]

#: MXNet's bfloat16 dtype (equal to ``mxnet.contrib.amp.amp.bfloat16``).
BFLOAT16 = np.dtype([('bfloat16', np.uint16)])

#: numpy's bfloat16 (``ml_dtypes.bfloat16``): the dtype of the bfloat16 arrays
#: that :func:`to_numpy` hands out and :func:`from_numpy` takes.
NUMPY_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: The low-precision targets mxamp converts to.
LOW_PRECISION = ('float16', 'bfloat16')

_NUMPY: Dict[str, np.dtype] = {'float32': np.dtype(np.float32), 'float16': np.dtype(np.float16),
                               'bfloat16': BFLOAT16}
# The numpy dtypes that name a precision: MXNet's, and numpy's own bfloat16.
_NAME_OF_NUMPY = {np_dtype: name for name, np_dtype in _NUMPY.items()}
_NAME_OF_NUMPY[NUMPY_BFLOAT16] = 'bfloat16'
# MXNet's TypeFlag enum (mshadow/base.h), as stored in a variable's ``__dtype__`` attribute.
_TYPE_FLAG = {'float32': 0, 'float16': 2, 'bfloat16': 12}
_ALIASES = {'fp32': 'float32', 'fp16': 'float16', 'half': 'float16', 'bf16': 'bfloat16'}


def dtype_name(dtype: DTypeLike, allowed: Sequence[str] = ('float32',) + LOW_PRECISION) -> str:
    """Return the canonical name of `dtype`, one of `allowed`.

    Parameters
    ----------
    dtype : str, numpy dtype or type
        ``'bfloat16'``, ``'float16'``, ``'float32'`` (or ``'bf16'``, ``'fp16'``,
        ``'fp32'``), ``numpy.float16``, ``numpy.float32``, ``ml_dtypes.bfloat16``
        or MXNet's bfloat16 struct.
    allowed : tuple of str
        The names the caller accepts.

    Raises
    ------
    ValueError
        When `dtype` is not one of `allowed`; the message lists them.
    """
    name = None
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.lower(), dtype.lower())
    else:
        try:
            name = _NAME_OF_NUMPY.get(np.dtype(dtype))
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
    """The precision name of `dtype` (see `dtype_name`), or None for any other type.

    For code that meets every tensor type (integer indices, float64, unknown:
    None) and only acts on mxamp's three precisions.
    """
    if dtype is None:
        return None
    try:
        return dtype_name(dtype)
    except ValueError:
        return None


def param_precision(param: mx.gluon.Parameter) -> Optional[str]:
    """The precision name of a Gluon Parameter, or the one `mxamp.convert` gave it.

    A parameter of a converted network that is not initialised yet (or whose
    initialisation is deferred) reads as FP32 until its first forward pass
    casts it; trainers decide master weights and loss scaling from this
    instead, so the order of ``convert``, ``initialize`` and ``Trainer`` does
    not matter.  None for non-floating parameters.
    """
    return getattr(param, '_mxamp_precision', None) or precision_name(param.dtype)


def name_of_array(array: Union[mx.ndarray.NDArray, mx.gluon.Parameter]) -> Optional[str]:
    """`precision_name` of an NDArray's (or a Parameter's) dtype."""
    return precision_name(array.dtype)


@functools.lru_cache(maxsize=None)
def _reference_bfloat16_reorders():
    """Whether oneDNN's bfloat16 reorders, ``amp_cast``'s kernel, are reference loops here.

    oneDNN 2.4.4 has jit bfloat16 reorders from avx512_core up; below it (CPU
    class ``'avx2'``) ``amp_cast`` runs a reference loop, far slower than
    MXNet's generic ``Cast``, even with the extra work of the rounded narrowing
    of :func:`_generic_cast` (docs/hardware.rst has the
    measurements).  Decided once per process, as oneDNN decides its ISA once.
    """
    return hardware.cpu_class() == hardware.AVX2


#: The name part of the helper nodes of a rounded narrowing (`bfloat16_rounding_nodes`):
#: how readers of a graph tell them from the network's own operators.
ROUNDING_SUFFIX = '_mxamp_rounding_'

# Bounds of the rounded narrowing's arithmetic: above the midpoint between the largest
# finite bfloat16 and 2**128 (about 3.3961e38: every larger float32 rounds to infinity,
# so clipping to the bound keeps the result) and small enough that the scaled split
# below cannot overflow (below 2**128 / (1 + 2**-16)).
_SPLIT_BOUND = 3.4e38


def bfloat16_rounding_nodes(source: Sequence[int], first: int, name: str) -> List[Dict]:
    """The nodes of a float32 -> bfloat16 cast that rounds to nearest even, in ops any
    MXNet runs and saves.

    MXNet 1.9.1's ``Cast`` to bfloat16 truncates (it keeps a float32's upper
    16 bits), and ``amp_cast``, which rounds to nearest even, is dropped by
    ``save``/``tojson`` with their defaults.  This narrowing rounds first in
    float32 arithmetic, with Veltkamp's split: for ``c = (2**16 + 1) * x``,
    ``c - (c - x)`` is `x` rounded to its 8 leading significant bits, to
    nearest, ties to even, exactly as ``amp_cast`` rounds (checked on 10**6
    values, the ties included); the ``Cast`` of that value is then exact.
    The split runs on ``x * 2**-16`` so that it cannot overflow; `x` is first
    clipped to +-3.4e38, which leaves every result unchanged (larger values
    round to infinity either way) and keeps infinities infinite; NaN stays
    NaN.  Where ``x * 2**-16`` is subnormal, normal values of magnitude below
    ``2**-110`` (about 7.7e-34), the result may be one step from the nearest.
    Seven elementwise nodes: ``clip``, three ``_mul_scalar``, two
    ``elemwise_sub`` and the ``Cast``; measured on 8x256x56x56 values (2
    threads, AMX Xeon): 55 ms, against 7.3 ms for a truncating ``Cast`` and
    1.2 ms for ``amp_cast``.

    Parameters
    ----------
    source : (int, int)
        The float32 entry to cast: node index and output.
    first : int
        The index the first returned node will have: the nodes are appended
        to a graph in order and refer to each other by index.
    name : str
        The name of the last node, the ``Cast`` that gives the bfloat16
        value; the others are named `name` + `ROUNDING_SUFFIX` + their step.

    Returns
    -------
    list of dict
        JSON nodes (MXNet's graph format).
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
    # A graph loaded from JSON carries dtype='bfloat16' as the string the C++ Cast
    # parses, whatever numpy knows: MXNet 1.9.1's nd.Cast reads the name through
    # np.dtype(), which knows it only while ml_dtypes is imported.
    nodes = [{'op': 'null', 'name': 'x', 'inputs': []}] + \
        bfloat16_rounding_nodes((0, 0), 1, 'to_bfloat16')
    graph = {'nodes': nodes, 'arg_nodes': [0], 'heads': [[len(nodes) - 1, 0, 0]],
             'attrs': {'mxnet_version': ['int', 10901]}}
    return mx.ndarray.CachedOp(mx.symbol.load_json(json.dumps(graph)))


def _generic_cast(array, dtype, out=None):
    """Cast between float32 and bfloat16 with MXNet's generic kernels (no oneDNN reorder).

    Widening is exact (``Cast``).  Narrowing rounds to nearest even, as the
    graph rewrite's casts do (`bfloat16_rounding_nodes`).
    """
    if np.dtype(dtype) == np.float32:
        return mx.ndarray.Cast(array, dtype='float32', out=out)
    return _round_to_bfloat16()(array, out=out)


def bfloat16_casts_round_to_even() -> bool:
    """Whether this process narrows float32 to bfloat16 as oneDNN's reorders do.

    True where :func:`amp_cast` and :func:`cast_into` run oneDNN's reorders
    (nearest, ties to even, subnormals flushed to zero); False on CPUs whose
    bfloat16 reorders are reference loops, where MXNet's generic kernels stand
    in (see :func:`_generic_cast`): also to nearest, ties to even, but they
    keep subnormals and may land one step off below 2**-110
    (`bfloat16_rounding_nodes`); measured on 2**20 random float32 values, a
    quarter of them exact ties, the two narrowings differed on 0.14% of them,
    all below 2**-100 in magnitude.  Code that recomputes a cast's result must
    round as the cast did.
    """
    return not _reference_bfloat16_reorders()


def _generic_applies(source, target):
    return _reference_bfloat16_reorders() and {np.dtype(source), np.dtype(target)} == {
        np.dtype(np.float32), BFLOAT16}


def widen(array: mx.ndarray.NDArray) -> mx.ndarray.NDArray:
    """A float32 copy of `array` (a gradient: default oneDNN layout); no host sync.

    Plain ``amp_cast``, or MXNet's generic ``Cast`` where bfloat16 reorders are
    reference loops (see :func:`_generic_cast`).  Through ``mx.ndarray``, so
    kvstore servers can run it.
    """
    if _generic_applies(array.dtype, np.float32):
        return _generic_cast(array, np.float32)
    return mx.ndarray.amp_cast(array, dtype=np.float32)


def cast_into(array: mx.ndarray.NDArray, out: mx.ndarray.NDArray) -> mx.ndarray.NDArray:
    """Cast `array` into `out` (same shape, any dtype), whatever `out`'s oneDNN layout.

    ``mx.nd.amp_cast(array, out=out)`` with `array` in the default layout: the
    kernel rewrites `out` in the default layout (see :func:`amp_cast`).  On
    CPUs whose bfloat16 reorders are reference loops, MXNet's generic kernels
    instead (see :func:`_generic_cast`).  No host sync.
    """
    if _generic_applies(array.dtype, out.dtype):
        return _generic_cast(array, out.dtype, out=out)
    return mx.ndarray.amp_cast(array, dtype=out.dtype, out=out)


def amp_cast(array: mx.ndarray.NDArray, dtype: DTypeLike,
             out: Optional[mx.ndarray.NDArray] = None) -> mx.ndarray.NDArray:
    """``amp_cast`` that also works on arrays holding a oneDNN blocked layout.

    MXNet 1.9.1 (oneDNN 2.4): after an inference pass, grouped and depthwise
    convolution weights keep a 5-D blocked oneDNN layout (the next training
    forward queues a reorder back to the default layout, but only when it
    runs, so an ``amp_cast`` queued before that still sees the blocked layout).
    ``amp_cast``'s oneDNN kernel reorders its input's memory into a plain memory
    of the array's 4-D shape, and oneDNN cannot reorder 5-D into 4-D: "could not
    create a primitive descriptor for a reorder primitive", raised
    asynchronously, at the next sync.  Given a *view* whose shape differs from
    its storage's, that kernel first brings the data back to the default
    layout.  So the cast reads a 1-D view of `array` (a view costs no copy and
    no engine operation) and writes a 1-D view of the result, which costs
    nothing more when the layout is already the default one.

    Gradients never need this: MXNet 1.9.1's oneDNN backward kernels always
    commit weight gradients in the default layout (``CreateMKLDNNWeightGrad``
    + ``CommitOutput``), so per-step gradient casts use plain ``amp_cast``.

    Parameters
    ----------
    array : NDArray
    dtype : numpy dtype or ``BFLOAT16``
    out : NDArray, optional
        A private array in the default layout with `array`'s shape.  To write
        into an array that may hold a blocked layout (a weight), use
        ``mx.nd.amp_cast(src, dtype=..., out=weight)`` with `src` in the default
        layout instead: the kernel then rewrites `weight` in the default
        layout, which is correct.

    Returns
    -------
    NDArray
        `out`, or a new array (never a view: oneDNN operators treat views
        differently, so parameters must not be views).

    Uses ``mx.ndarray``, never ``mx.nd``: :mod:`mxamp.optimizer` calls it, also
    on kvstore servers.  On CPUs whose bfloat16 reorders are reference loops,
    float32 <-> bfloat16 casts take MXNet's generic kernels (see
    :func:`_generic_cast`), which read any layout.
    """
    if _generic_applies(array.dtype, dtype):
        return _generic_cast(array, dtype, out=out)
    if array.ndim <= 1:
        return mx.ndarray.amp_cast(array, dtype=dtype, out=out)
    if out is None:
        # MXNet 1.9.1 internal: an NDArray whose memory is allocated when the cast
        # runs, as for any operator's output.  mx.nd.empty allocates at once, in
        # this thread: twice the time of the whole cast on a CPU (measured).
        out = mx.ndarray.NDArray(mx.ndarray.ndarray._new_alloc_handle(
            array.shape, array.context, True, dtype))
    mx.ndarray.amp_cast(array.reshape((-1,)), dtype=dtype, out=out.reshape((-1,)))
    return out


def cast(array: mx.ndarray.NDArray, name: str) -> mx.ndarray.NDArray:
    """Cast an NDArray to a precision name; works for bfloat16, unlike ``astype``.

    Returns `array` itself when it already has that dtype.  Works on arrays
    holding a oneDNN blocked layout (see :func:`amp_cast`).  Differentiable
    inside ``autograd.record()`` (the result is then a reshaped view).
    """
    target = numpy_dtype(name)
    if array.dtype == target:
        return array
    # amp_cast is the only cast operator whose Python front end accepts the
    # bfloat16 struct dtype in MXNet 1.9.1 and rounds to nearest (Cast truncates).
    if mx.autograd.is_recording() and array.ndim > 1 and not _generic_applies(array.dtype, target):
        # out= is not recorded; a cast between recorded reshapes is.
        return mx.nd.amp_cast(array.reshape((-1,)), dtype=target).reshape(array.shape)
    return amp_cast(array, target)


def to_float32_numpy(array: mx.ndarray.NDArray) -> np.ndarray:
    """``array.asnumpy()`` in float32, also for bfloat16 arrays (never raw uint16).

    bfloat16 values are widened on the host, exactly (infinities, NaNs and
    subnormals included), so no MXNet operator runs: ``asnumpy`` itself handles
    every oneDNN layout, whereas an ``amp_cast`` of a blocked array fails (see
    :func:`amp_cast`).
    """
    return to_numpy(array).astype(np.float32, copy=False)


def to_numpy(array: mx.ndarray.NDArray) -> np.ndarray:
    """``array.asnumpy()``, with bfloat16 data as numpy's ``ml_dtypes.bfloat16``.

    MXNet's own ``asnumpy()`` hands bfloat16 data back as raw uint16 structs;
    here it comes as `NUMPY_BFLOAT16`, the same bits in a dtype numpy computes
    with.  Arrays of every other dtype come as ``asnumpy()`` gives them.  Any
    oneDNN layout.  **One host sync.**

    Examples
    --------
    >>> low = mxamp.dtypes.cast(mx.nd.array([1.0, -2.5, 3.14159]), 'bfloat16')
    >>> mxamp.dtypes.to_numpy(low)
    array([1, -2.5, 3.14062], dtype=bfloat16)
    """
    values = array.asnumpy()
    if array.dtype == BFLOAT16:
        return values.view(NUMPY_BFLOAT16)
    return values


def from_numpy(values: np.ndarray, ctx: Optional[mx.Context] = None) -> mx.ndarray.NDArray:
    """An NDArray holding `values`, in their dtype; bfloat16 ones bit for bit.

    The inverse of :func:`to_numpy`: a numpy array of ``ml_dtypes.bfloat16``
    (`NUMPY_BFLOAT16`) becomes an MXNet bfloat16 NDArray with the same bits
    (``mx.nd.array`` would read it as floats and store float32); any other
    dtype is kept as ``mx.nd.array(values, dtype=values.dtype)`` keeps it.

    Parameters
    ----------
    values : numpy.ndarray
    ctx : mxnet.Context, optional
        Where the array lives; default: the current context.

    Raises
    ------
    TypeError
        When `values` is not a numpy array.
    """
    if not isinstance(values, np.ndarray):
        raise TypeError('from_numpy(): values must be a numpy array, got %s'
                        % type(values).__name__)
    if values.dtype == NUMPY_BFLOAT16:
        # MXNet copies a uint16 array into its bfloat16 struct field as it is.
        return mx.nd.array(values.view(np.uint16), ctx=ctx, dtype=BFLOAT16)
    return mx.nd.array(values, ctx=ctx, dtype=values.dtype)


# Whether resolve_dtype said that 'auto' stays float32 on this CPU (once per process).
_warned_auto_float32 = False


def resolve_dtype(dtype: DTypeLike, ctx: Optional[ContextLike] = None) -> str:
    """The precision name mxamp should use for `dtype` on `ctx`.

    Parameters
    ----------
    dtype : str, numpy dtype or type
        ``'auto'``, or anything :func:`dtype_name` accepts
        (``'bfloat16'``, ``'bf16'``, ``numpy.float16``, ...).
    ctx : mxnet.Context or list of Context, optional
        Where the model runs (the first context of a list decides).  None means
        "this machine": a GPU when there is one.

    Returns
    -------
    str
        ``'float32'``, ``'float16'`` or ``'bfloat16'``.  ``'auto'`` gives the
        fastest precision the hardware computes: ``'float16'`` on a GPU,
        ``'bfloat16'`` on a CPU where bfloat16 is faster than FP32
        (:func:`mxamp.hardware.bfloat16_pays`: :func:`mxamp.hardware.cpu_class`
        ``'avx512_bf16'`` or ``'amx'``, but not a CPU with AMX tiles left off),
        ``'float32'`` on other CPUs, saying so once per process in one warning
        that names the CPU class.

    Raises
    ------
    ValueError
        When `dtype` is neither ``'auto'`` nor a known precision.
    """
    if not (isinstance(dtype, str) and dtype.lower() == 'auto'):
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
    """What ``'auto'`` means on this machine's CPU, and why in words; warns nothing.

    Returns
    -------
    (str, str)
        ``'bfloat16'`` where :func:`mxamp.hardware.bfloat16_pays`, else
        ``'float32'``; and a phrase starting ``'this <CPU class>'`` that says
        why and, for float32, what ``dtype='bfloat16'`` still does here.
    """
    cpu = hardware.describe_cpu_class()
    if hardware.bfloat16_pays():
        return 'bfloat16', 'this %s computes bfloat16 natively' % cpu
    if hardware.computes_bfloat16():
        return 'float32', ("this %s; dtype='bfloat16' still computes in bfloat16 here; AMX "
                           "enabled makes it the fast path" % cpu)
    return 'float32', ("this %s; bfloat16 pays on CPUs with AVX512-BF16 or AMX; "
                       "dtype='bfloat16' still works here: bfloat16 storage, FP32 compute, "
                       "slower than FP32" % cpu)

