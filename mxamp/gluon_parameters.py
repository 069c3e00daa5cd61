"""The parameters of a converted Gluon network, and the generated classes that hook mxamp in.

A parameter read only by low-precision operators is stored in the target dtype
(data and gradient), every other stays FP32; the decision is made once per
parameter (``_mxamp_precision``) and kept when blocks are edited.  Initializers
always draw in FP32 (MXNet's cannot write bfloat16, and some would leave zeros),
and checkpoints hold every parameter in FP32, interchangeable with FP32 nets.
A converted block or low-precision parameter gets a generated subclass of its
own class (`mixed_class`): same name and module, mxamp's hooks first in the MRO.

MXNet internals relied on (MXNet 1.9.1): ``Parameter._dtype``, ``_data``,
``_grad``, ``_var``, ``_deferred_init``, ``_finish_deferred_init``,
``Parameter._reduce`` and ``Block._collect_params_with_prefix`` (the structural
names checkpoints use).
"""
import threading
from typing import Dict, Tuple

import numpy as np

import mxnet as mx
from mxnet import autograd

from .atomic_files import replaced_on_success
from .dtypes import LOW_PRECISION, cast, name_of_array, numpy_dtype
from .network_state import converted_state

__all__ = []

_FLOAT32 = np.dtype(np.float32)
_lock = threading.Lock()
_CLASSES: Dict[Tuple[type, type], type] = {}


def set_param_dtype(param, name):
    """Store `param` (data and gradient, every context) in precision `name`, through
    `mxamp.dtypes.cast` (MXNet's ``astype`` is not bfloat16-safe), marked for autograd."""
    param._dtype = numpy_dtype(name)
    if param._data is None:
        return
    with autograd.pause():
        param._data = [_cast_plain(arr, name) for arr in param._data]
        if param._grad is not None:
            param._grad = [_cast_plain(arr, name) for arr in param._grad]
            autograd.mark_variables(param._data, param._grad, param.grad_req)


def _cast_plain(array, name):
    """``cast`` that also works on arrays holding a oneDNN blocked layout.

    MXNet 1.9.1 (oneDNN 2.4): a grouped or depthwise convolution weight keeps a
    blocked layout after an FP32 inference pass, whose ``amp_cast`` to bfloat16
    fails; ``copy()`` returns the values in the default layout first.
    """
    if array.dtype == numpy_dtype(name):
        return array
    return cast(array.copy(), name)


def ensure_fp32_var(param):
    """Create (and cache) the parameter's graph variable as FP32.

    ``Parameter.var()`` caches its Symbol on first use with the parameter's
    current dtype; graph building must see the FP32 graph (the rewrite declares
    the low-precision parameters itself).
    """
    if param._var is None and name_of_array(param) in LOW_PRECISION:
        current = param._dtype
        param._dtype = _FLOAT32
        try:
            param.var()
        finally:
            param._dtype = current


def sync_params(block):
    """Give every initialised parameter of `block`'s tree its mxamp dtype.

    A parameter's precision is decided once, when it first meets a converted
    tree, and kept in ``_mxamp_precision`` (`mxamp.dtypes.param_precision` reads
    it before initialisation): a child converted on its own keeps its decisions.
    Under ``'auto'`` its values stay FP32 until a graph that reads it is built
    (`settle`), which may keep it in FP32 (`keep_float32`).
    """
    settings = converted_state(block).settings
    for param in block.collect_params().values():
        want = getattr(param, '_mxamp_precision', None)
        if want is None:
            if name_of_array(param) not in ('float32',) + LOW_PRECISION:
                continue  # integer or otherwise special parameters are left alone
            want = settings.dtype if param.name in settings.lp_params else 'float32'
            param._mxamp_precision = want
            if want in LOW_PRECISION:
                param.__class__ = mixed_class(_LowPrecisionParameter, type(param))
        waits = settings.cost_aware and not getattr(param, '_mxamp_settled', False)
        if param._data is not None and name_of_array(param) != want and not waits:
            set_param_dtype(param, want)


def settle(params):
    """Mark `params` as read by a built graph: `sync_params` gives them their dtype."""
    for param in params:
        param._mxamp_settled = True


def keep_float32(params):
    """Store `params` (none in low precision yet) in FP32 from now on, whatever their tree
    decided at conversion (`sync_params` keeps the new decision)."""
    for param in params:
        param._mxamp_precision = 'float32'
        set_param_dtype(param, 'float32')


class _LowPrecisionParameter(object):
    """Mixin placed first in the MRO of a parameter that mxamp stores in low precision."""

    # MXNet 1.9.1: _finish_deferred_init creates the array in Parameter._dtype and fills
    # it with the initializer (from initialize, force_reinit included, and from
    # _build_cache for deferred shapes).  MXNet's random initializers cannot write
    # bfloat16, and Orthogonal or Bilinear leave zeros: every initializer draws in FP32
    # here, and the result is cast to the dtype the parameter had.
    def _finish_deferred_init(self):
        if not self._deferred_init:
            return
        stored = name_of_array(self)
        self._dtype = _FLOAT32
        try:
            super(_LowPrecisionParameter, self)._finish_deferred_init()
        finally:
            set_param_dtype(self, stored)

    # MXNet 1.9.1: Block.load_parameters hands each array to Parameter._load_init, which
    # refuses another dtype unless cast_dtype.  mxamp's checkpoints hold FP32 values
    # (Float32Checkpoints); a parent mxamp did not convert loads them here directly (GluonTS
    # copies a trained network's values into a predictor holding its blocks so).
    def _load_init(self, data, ctx, cast_dtype=False, dtype_source='current'):
        stored = name_of_array(self)
        if stored in LOW_PRECISION and name_of_array(data) == 'float32' and not cast_dtype:
            data = cast(data, stored)
        super(_LowPrecisionParameter, self)._load_init(data, ctx, cast_dtype=cast_dtype,
                                                       dtype_source=dtype_source)

    # Parameters pickle (blocks do not): the generated class has no importable
    # name, so a pickle names the class it was generated from.
    def __reduce_ex__(self, protocol):
        return _restore_low_precision, (type(self)._mxamp_base,), self.__dict__


def _restore_low_precision(base):
    """Unpickling helper: an empty parameter of ``mixed_class(_LowPrecisionParameter, base)``."""
    return object.__new__(mixed_class(_LowPrecisionParameter, base))



class Float32Checkpoints(object):
    """Checkpoints of a converted net: every parameter in FP32, as FP32 nets write them."""

    def save_parameters(self, filename, deduplicate=False):
        """Save parameters in FP32 (exact), loadable by converted and FP32 nets alike.

        Written whole or not at all (`mxamp.atomic_files`): an interrupted save
        leaves the previous file as it was.
        """
        # The kernel wing's batch normalisation updates the moving statistics in its
        # gradient, unknown to MXNet's engine: a read right after backward() could miss it.
        mx.nd.waitall()
        # MXNet 1.9.1: _collect_params_with_prefix gives the structural names
        # ('features.0.weight') that save_parameters/load_parameters use.
        named = self._collect_params_with_prefix()
        if deduplicate:
            first = {}
            for key in sorted(named):
                first.setdefault(id(named[key]), key)
            named = {key: named[key] for key in first.values()}
        arrays = {}
        for key, param in named.items():
            value = param._reduce()
            if name_of_array(value) in LOW_PRECISION:
                value = cast(value, 'float32')
            arrays[key] = value
        with replaced_on_success(filename) as temporary:
            mx.nd.save(temporary, arrays)

    def load_parameters(self, filename, ctx=None, allow_missing=False,
                        ignore_extra=False, cast_dtype=False, dtype_source='current'):
        """Load a checkpoint (FP32, as written by FP32 nets and by converted nets).

        FP32 parameters load bit-exactly; low-precision ones are loaded in FP32
        and rounded to the target dtype (round to nearest even).
        """
        low = [(p, name_of_array(p)) for p in self.collect_params().values()
               if name_of_array(p) in LOW_PRECISION]
        for param, _ in low:
            set_param_dtype(param, 'float32')
        try:
            super(Float32Checkpoints, self).load_parameters(
                filename, ctx=ctx, allow_missing=allow_missing, ignore_extra=ignore_extra,
                cast_dtype=cast_dtype, dtype_source=dtype_source)
        finally:
            for param, precision in low:
                set_param_dtype(param, precision)
        for part in self._converted_parts():
            sync_params(part)

    def _converted_parts(self):
        """The converted trees whose parameters a load gives their dtypes again."""
        raise NotImplementedError



def mixed_class(mixin: type, cls: type) -> type:
    """The generated subclass of `cls` with `mixin` first in its MRO (same name and module).

    Created once per (mixin, class); `cls` already holding `mixin` is returned
    as it is.  Its ``_mxamp_base`` is the class before any mixin.
    """
    if issubclass(cls, mixin):
        return cls
    with _lock:
        klass = _CLASSES.get((mixin, cls))
        if klass is None:
            klass = type(cls.__name__, (mixin, cls),
                         {'__module__': cls.__module__,
                          '__qualname__': getattr(cls, '__qualname__', cls.__name__),
                          '__doc__': cls.__doc__,
                          '_mxamp_base': getattr(cls, '_mxamp_base', cls)})
            _CLASSES[(mixin, cls)] = klass
    return klass
