"""Precision names and their MXNet representations.

mxamp speaks three precisions, always by name: ``'float32'``, ``'float16'`` and
``'bfloat16'``.  MXNet 1.9.1 has no numpy dtype for bfloat16: it represents it as
the numpy struct ``dtype([('bfloat16', '<u2')])``, rejects the string
``'bfloat16'`` in most Python entry points (``nd.Cast``, ``astype``) and hands raw
uint16 structs back from ``asnumpy()``.  This module owns the translation, so the
rest of mxamp (and its users) only ever handle the names.
"""
import numpy as np

import mxnet as mx

#: MXNet's bfloat16 dtype (equal to ``mxnet.contrib.amp.amp.bfloat16``).
BFLOAT16 = np.dtype([('bfloat16', np.uint16)])

#: The low-precision targets mxamp converts to.
LOW_PRECISION = ('float16', 'bfloat16')

_NUMPY = {'float32': np.dtype(np.float32), 'float16': np.dtype(np.float16), 'bfloat16': BFLOAT16}
# MXNet's TypeFlag enum (mshadow/base.h), as stored in a variable's ``__dtype__`` attribute.
_TYPE_FLAG = {'float32': 0, 'float16': 2, 'bfloat16': 12}
_ALIASES = {'fp32': 'float32', 'fp16': 'float16', 'half': 'float16', 'bf16': 'bfloat16'}


def dtype_name(dtype, allowed=('float32',) + LOW_PRECISION):
    """Return the canonical name of `dtype`, one of `allowed`.

    Parameters
    ----------
    dtype : str, numpy dtype or type
        ``'bfloat16'``, ``'float16'``, ``'float32'`` (or ``'bf16'``, ``'fp16'``,
        ``'fp32'``), ``numpy.float16``, ``numpy.float32`` or MXNet's bfloat16 struct.
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
            as_numpy = np.dtype(dtype)
        except TypeError:
            as_numpy = None
        for candidate, np_dtype in _NUMPY.items():
            if as_numpy == np_dtype:
                name = candidate
    if name not in allowed:
        raise ValueError('unknown dtype %r: expected one of %s'
                         % (dtype, ', '.join(repr(a) for a in allowed)))
    return name


def numpy_dtype(name):
    """MXNet's dtype object for a precision name (``BFLOAT16`` for ``'bfloat16'``)."""
    return _NUMPY[dtype_name(name)]


def type_flag(name):
    """MXNet's integer type flag for a precision name (``__dtype__`` attribute value)."""
    return _TYPE_FLAG[dtype_name(name)]


def name_of_array(array):
    """Precision name of an NDArray (or a Parameter), or None for non-floating types."""
    try:
        return dtype_name(array.dtype)
    except ValueError:
        return None


def cast(array, name):
    """Cast an NDArray to a precision name; works for bfloat16, unlike ``astype``.

    Returns `array` itself when it already has that dtype.
    """
    target = numpy_dtype(name)
    if array.dtype == target:
        return array
    # amp_cast is the only cast operator whose Python front end accepts the
    # bfloat16 struct dtype in MXNet 1.9.1.
    return mx.nd.amp_cast(array, dtype=target)


def to_float32_numpy(array):
    """``array.asnumpy()`` in float32, also for bfloat16 arrays (never raw uint16)."""
    if array.dtype == BFLOAT16:
        array = mx.nd.amp_cast(array, dtype=np.float32)
    return array.asnumpy().astype(np.float32, copy=False)
