"""FP32 master weights for every MXNet optimizer.

Owns :class:`MultiPrecision`, a mixin that gives any ``mx.optimizer.Optimizer`` subclass an
FP32 master copy, with FP32 states, of each float16 or bfloat16 weight; :class:`AdamW`; and
:func:`mixed_class` / :func:`create`, which mix it into an optimizer given by name or
instance.  Nothing is registered in MXNet.  Why: MXNet 1.9.1's ``multi_precision=True`` only
recognises float16, and its SGD kernels reject bfloat16 ("Unknown type enum 12").  The update
paths, and why master copies follow changed weights: docs/training.rst, "Master weights".
"""
# Annotations stay unevaluated: kvstore servers import this inside `import mxnet`.
from __future__ import annotations

import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Tuple, Type, Union

import numpy as np

import mxnet as mx

from . import kvkeys
from .dtypes import BFLOAT16, amp_cast, bfloat16_casts_round_to_even, cast_into, widen

if TYPE_CHECKING:
    # For the checker, the optimizer it is mixed into (untyped: Any); at run time a mixin.
    from mxnet.optimizer import Optimizer as _MixedInto
else:
    _MixedInto = object

__all__ = ['MultiPrecision', 'AdamW', 'mixed_class', 'create', 'lookup', 'follow_weight']

_FLOAT16 = np.dtype(np.float16)
_LOW = (_FLOAT16, BFLOAT16)

#: The kvstore key of LossScaler's overflow agreement: not a weight (see :mod:`mxamp.kvkeys`).
_FLAG_KEY = kvkeys.reserved_key('overflow')


def _is_low(array):
    return array.dtype in _LOW


def _float32(array):
    """`array` in float32, for gradients (default layout); ``widen``: servers lack ``mx.nd``."""
    if array.dtype == np.float32:
        return array
    return widen(array)


class MultiPrecision(_MixedInto):
    """Mixin: FP32 master weights and FP32 states for float16 and bfloat16 weights.

    Put it first among the bases of any ``mx.optimizer.Optimizer`` subclass, or let
    :func:`mixed_class` / :func:`create` do it::

        class MyAdam(mxamp.optimizer.MultiPrecision, mx.optimizer.Adam):
            pass

    ``multi_precision`` defaults to True.  ``follow_weights`` (default True): master copies
    follow weights changed outside the optimizer.  Pickles where mxamp is importable: on a
    kvstore server, inside ``import mxnet``, without ``mxnet.gluon``, ``mx.nd`` or ``mx.sym``
    (docs/training.rst, "Distributed kvstores").
    """

    def __init__(self, *args: Any, follow_weights: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault('multi_precision', True)
        super(MultiPrecision, self).__init__(*args, **kwargs)
        self.follow_weights = bool(follow_weights)

    def _mxamp_fused_fp16(self):
        """Whether the base has a fused float16 path: in MXNet 1.9.1, exactly the optimizers that
        override ``update_multi_precision`` (SGD, NAG, LAMB, LARS)."""
        cls = type(self)
        cached = cls.__dict__.get('_mxamp_fused_fp16_cache')
        if cached is not None:
            return cached
        mro = cls.__mro__
        fused = False
        for klass in mro[mro.index(MultiPrecision) + 1:]:
            if 'update_multi_precision' in klass.__dict__:
                fused = klass is not mx.optimizer.Optimizer
                break
        setattr(cls, '_mxamp_fused_fp16_cache', fused)
        return fused

    def _mxamp_master_index(self):
        """Where the fused path's state keeps the master: MXNet 1.9.1's SGD, NAG and LARS return
        ``(inner_state, master)`` (1); ``Optimizer``'s, also the generic path's, ``(master, _)``."""
        cls = type(self)
        cached = cls.__dict__.get('_mxamp_master_index_cache')
        if cached is not None:
            return cached
        mro = cls.__mro__
        index = 0
        for klass in mro[mro.index(MultiPrecision) + 1:]:
            if 'create_state_multi_precision' in klass.__dict__:
                index = 0 if klass is mx.optimizer.Optimizer else 1
                break
        setattr(cls, '_mxamp_master_index_cache', index)
        return index

    def _mxamp_follow(self, weights, states, generic):
        """Master copies of `states` follow their `weights` (see :func:`follow_weight`)."""
        if not getattr(self, 'follow_weights', True):   # pickles without the option: on
            return
        at = 0 if generic else self._mxamp_master_index()
        for weight, state in zip(weights, states):
            follow_weight(state[at], weight)

    def _mxamp_generic(self, weight):
        """True when `weight` takes the generic cast-update-cast path."""
        if not (self.multi_precision and _is_low(weight)):
            return False
        return weight.dtype == BFLOAT16 or not self._mxamp_fused_fp16()

    def create_state_multi_precision(self, index: int, weight: mx.ndarray.NDArray) -> Any:
        """State for `weight`: ``(fp32_master, fp32_state)`` on the generic path.  No host sync.
        ``amp_cast``: the weight may hold a oneDNN blocked layout (after an inference pass)."""
        if index == _FLAG_KEY:
            return None
        if self._mxamp_generic(weight):
            master = amp_cast(weight, np.float32)
            return (master, self.create_state(index, master))
        if weight.dtype == BFLOAT16 and not self.multi_precision:
            warnings.warn('bfloat16 weight %r without master weights: MXNet 1.9.1 update '
                          'kernels reject bfloat16 and small updates are lost; use '
                          'multi_precision=True' % (index,))
        return super(MultiPrecision, self).create_state_multi_precision(index, weight)

    def update_multi_precision(self, index: Union[int, List[int]],
                               weight: Union[mx.ndarray.NDArray, List[mx.ndarray.NDArray]],
                               grad: Union[mx.ndarray.NDArray, List[mx.ndarray.NDArray]],
                               state: Any) -> None:
        """Update `weight` (one array or a list of one dtype) from `grad`.  No host sync."""
        if isinstance(index, (list, tuple)):
            if _FLAG_KEY in index:
                keep = [i for i, idx in enumerate(index) if idx != _FLAG_KEY]
                for i, idx in enumerate(index):
                    if idx == _FLAG_KEY:
                        self._mxamp_overflow_flag(weight[i], grad[i])
                if not keep:
                    return
                index, weight, grad, state = ([seq[i] for i in keep]
                                              for seq in (index, weight, grad, state))
            first = weight[0]
        else:
            if index == _FLAG_KEY:
                self._mxamp_overflow_flag(weight, grad)
                return
            first = weight
        if not _is_low(first):   # FP32 weights (one dtype a list): MXNet's update as is
            super(MultiPrecision, self).update_multi_precision(index, weight, grad, state)
            return
        many = isinstance(index, (list, tuple))
        if self._mxamp_native_step(mx.optimizer.SGD, first, grad[0] if many else grad):
            self._mxamp_sgd_steps(*([index, weight, grad, state] if many else
                                    [[index], [weight], [grad], [state]]))
            return
        if self._mxamp_native_step(mx.optimizer.Adam, first, grad[0] if many else grad):
            self._mxamp_adam_steps(*([index, weight, grad, state] if many else
                                     [[index], [weight], [grad], [state]]))
            return
        if self.multi_precision:
            self._mxamp_follow(weight if many else [weight], state if many else [state],
                               self._mxamp_generic(first))
        if not self._mxamp_generic(first):
            super(MultiPrecision, self).update_multi_precision(index, weight, grad, state)
            return
        if isinstance(index, (list, tuple)):     # many (the checker needs the isinstance)
            masters = [s[0] for s in state]
            inner = [s[1] for s in state]
            grads32 = [_float32(g) for g in grad]
            self.update(list(index), masters, grads32, inner)
            for master, low in zip(masters, weight):
                cast_into(master, low)
        else:
            master, inner = state
            self.update(index, master, _float32(grad), inner)
            cast_into(master, weight)

    def _mxamp_native_step(self, base, weight, grad):
        """Whether the native one-pass step of `base` applies: MXNet's own `base` (``SGD`` or
        ``Adam``, not a subclass), dense bfloat16; also on ``'avx2'`` CPUs, rounding as
        ``amp_cast`` does (generic narrowing differs below 2**-100)."""
        return (type(self).__dict__.get('_mxamp_base') is base and
                self.multi_precision and weight.stype == 'default' and
                grad.stype == 'default' and _native_library_takes(weight))

    def _mxamp_sgd_steps(self, indices, weights, grads, states):
        """SGD on bfloat16 weights, one native pass each, bookkeeping as ``SGD._update_impl``."""
        operators = _fast_step_kernels()
        self._update_count(indices)
        lrs, wds = self._get_lrs(indices), self._get_wds(indices)
        # SGD passes clip_gradient only when set (None and 0 mean none): -1 is its kernel's none.
        clip = self.clip_gradient if self.clip_gradient else -1.0
        follow = getattr(self, 'follow_weights', True)
        for weight, grad, (master, momentum), lr, wd in zip(weights, grads, states, lrs, wds):
            stepped = operators.sgd_step_bfloat16(
                weight, grad, master, momentum, lr=lr, wd=wd, momentum=self.momentum,
                rescale_grad=self.rescale_grad, clip_gradient=clip, follow=follow)
            stepped.copyto(weight)   # whatever oneDNN layout the weight holds

    def _mxamp_adam_steps(self, indices, weights, grads, states):
        """Adam on bfloat16 weights, one native pass each, bookkeeping (update count, bias
        correction folded into the rate) as ``Adam.update``."""
        operators = _fast_step_kernels()
        follow = getattr(self, 'follow_weights', True)
        # Adam passes clip_gradient only when set (None and 0 mean none): -1 is its kernel's none.
        clip = self.clip_gradient if self.clip_gradient else -1.0
        for index, weight, grad, (master, (mean, variance)) in zip(indices, weights, grads,
                                                                  states):
            self._update_count(index)
            count = self._index_update_count[index]
            lr = self._get_lr(index) * math.sqrt(1. - self.beta2 ** count) / (
                1. - self.beta1 ** count)
            stepped = operators.adam_step_bfloat16(
                weight, grad, master, mean, variance, lr=lr, wd=self._get_wd(index),
                beta1=self.beta1, beta2=self.beta2, epsilon=self.epsilon,
                rescale_grad=self.rescale_grad, clip_gradient=clip, follow=follow)
            stepped.copyto(weight)   # whatever oneDNN layout the weight holds

    def _mxamp_overflow_flag(self, stored, merged):
        """Server side of LossScaler's overflow agreement: :func:`mxamp.kvkeys.store_overflow_sum`."""
        rescale_grad = kvkeys.store_overflow_sum(stored, merged)
        if rescale_grad is not None:
            self.rescale_grad = rescale_grad

    def __reduce_ex__(self, protocol):
        base = type(self).__dict__.get('_mxamp_base')
        if base is None:
            return super(MultiPrecision, self).__reduce_ex__(protocol)
        return (_restore_mixed, (base,), self.__getstate__())


def follow_weight(master: mx.ndarray.NDArray, weight: mx.ndarray.NDArray) -> None:
    """Restart `master` from `weight` wherever `weight` no longer holds `master` rounded.

    Such an element was changed outside the optimizer and restarts from the weight (widened
    exactly); the others keep their FP32 value.  In place, no host sync: five elementwise
    passes, or one native pass for bfloat16 on a CPU whose casts round to nearest even.

    Parameters
    ----------
    master, weight : NDArray
        The float32 master (overwritten); the float16 or bfloat16 weight, any oneDNN layout.
    """
    if weight.stype != 'default':
        return   # mxamp stores no sparse weight in low precision
    if _follows_natively(master, weight):
        _fast_step_kernels().follow_bfloat16_weight(master, weight)
        return
    # In FP32: MXNet's low-precision comparisons convert element by element, slower than two
    # widening casts.  _equal: ``==`` without its broadcast kernel.
    seen = amp_cast(weight, np.float32)
    written = widen(amp_cast(master, weight.dtype))
    mx.ndarray.where(mx.ndarray._internal._equal(seen, written), master, seen, out=master)


def _follows_natively(master, weight):
    """Whether the native kernel may follow `weight`: not on ``'avx2'`` CPUs (generic narrowing)."""
    return master.context == weight.context and bfloat16_casts_round_to_even() and \
        _native_library_takes(weight)


def _native_library_takes(weight):
    """bfloat16 on the CPU, in a worker with the library loaded (servers never import it)."""
    if weight.dtype != BFLOAT16 or weight.context.device_type != 'cpu' or \
            os.environ.get('DMLC_ROLE', 'worker') != 'worker':
        return False
    operators = _fast_step_kernels()
    return operators is not None and operators.available()


def _fast_step_kernels():
    """`mxamp.kernels.operators`, None without the wing: the optimizer's one door into it."""
    try:
        from .kernels import operators
    except ImportError:
        return None
    return operators


def _restore_mixed(base):
    """Unpickling helper: an empty instance of ``mixed_class(base)``."""
    return object.__new__(mixed_class(base))


class AdamW(mx.optimizer.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), on MXNet's fused kernels.

    Each step, with ``t`` the weight's update count and ``g = clip(rescale_grad * grad,
    clip_gradient)``::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        w -= lr * (sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + epsilon) + wd * w)

    float16 weights with ``multi_precision``: ``contrib.mp_adamw_update``.  ``create('adamw')``.

    Parameters
    ----------
    learning_rate, beta1, beta2, epsilon : float
        As ``mx.optimizer.Adam``; other keywords go to ``mx.optimizer.Optimizer``.
    """

    def __init__(self, learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, **kwargs: Any) -> None:
        super(AdamW, self).__init__(learning_rate=learning_rate, **kwargs)
        self.beta1 = beta1
        self.beta2 = beta2
        self.epsilon = epsilon

    def create_state(self, index: int, weight: mx.ndarray.NDArray
                     ) -> Tuple[mx.ndarray.NDArray, mx.ndarray.NDArray]:
        return (mx.ndarray.zeros(weight.shape, weight.context, dtype=weight.dtype),
                mx.ndarray.zeros(weight.shape, weight.context, dtype=weight.dtype))

    def _kwargs(self, index):
        self._update_count(index)
        t = self._index_update_count[index]
        kwargs = {'lr': (1. - self.beta2 ** t) ** 0.5 / (1. - self.beta1 ** t),
                  'eta': self._get_lr(index), 'wd': self._get_wd(index),
                  'beta1': self.beta1, 'beta2': self.beta2, 'epsilon': self.epsilon,
                  'rescale_grad': self.rescale_grad}
        if self.clip_gradient:
            kwargs['clip_gradient'] = self.clip_gradient
        return kwargs

    def update(self, index: int, weight: mx.ndarray.NDArray, grad: mx.ndarray.NDArray,
               state: Tuple[mx.ndarray.NDArray, mx.ndarray.NDArray]) -> None:
        mean, var = state
        mx.ndarray.contrib.adamw_update(weight, grad, mean, var, out=weight,
                                        **self._kwargs(index))

    def update_multi_precision(self, index: int, weight: mx.ndarray.NDArray, grad: mx.ndarray.NDArray,
                               state: Any) -> None:
        if self.multi_precision and weight.dtype == _FLOAT16:
            master, (mean, var) = state
            mx.ndarray.contrib.mp_adamw_update(weight, grad, mean, var, master, out=weight,
                                               **self._kwargs(index))
        else:
            self.update(index, weight, grad, state)


_OWN = {'adamw': AdamW}
_MIXED: Dict[type, type] = {}


def lookup(name: str) -> Type[mx.optimizer.Optimizer]:
    """The optimizer class for `name`: mxamp's own (``'adamw'``), then MXNet's registry.
    Raises ``ValueError``, naming the known ones, for an unknown name."""
    key = name.lower()
    if key in _OWN:
        return _OWN[key]
    # MXNet 1.9.1 internal: the registry dict behind mx.optimizer.register.
    registry = mx.optimizer.Optimizer.opt_registry
    if key in registry:
        return registry[key]
    raise ValueError('unknown optimizer %r: expected one of %s'
                     % (name, ', '.join(sorted(set(registry) | set(_OWN)))))


def mixed_class(base: Type[mx.optimizer.Optimizer]) -> Type[MultiPrecision]:
    """``MultiPrecision<Base>(MultiPrecision, base)``, made once; `base` if already mixed."""
    if not (isinstance(base, type) and issubclass(base, mx.optimizer.Optimizer)):
        raise TypeError('expected a subclass of mx.optimizer.Optimizer, got %r' % (base,))
    if issubclass(base, MultiPrecision):
        return base
    klass = _MIXED.get(base)
    if klass is None:
        klass = type('MultiPrecision' + base.__name__, (MultiPrecision, base),
                     {'_mxamp_base': base, '__module__': __name__,
                      '__doc__': '%s with FP32 master weights (mxamp.optimizer.MultiPrecision).'
                                 % base.__name__})
        _MIXED[base] = klass
    return klass


def create(optimizer: Union[str, mx.optimizer.Optimizer], multi_precision: bool = True,
           **kwargs: Any) -> MultiPrecision:
    """An optimizer with FP32 master weights, from a name or an existing instance.

    Parameters
    ----------
    optimizer : str or mx.optimizer.Optimizer
        A name known to :func:`lookup`, or an instance: converted **in place** (its class
        becomes ``mixed_class(type(optimizer))``) and returned.
    multi_precision : bool, default True
        Whether float16/bfloat16 weights get FP32 master copies.
    **kwargs
        Constructor arguments, with a name only.

    Examples
    --------
    >>> type(mxamp.optimizer.create('sgd', learning_rate=0.1, momentum=0.9)).__name__
    'MultiPrecisionSGD'
    """
    if isinstance(optimizer, str):
        return mixed_class(lookup(optimizer))(multi_precision=multi_precision, **kwargs)
    if isinstance(optimizer, mx.optimizer.Optimizer):
        if kwargs:
            raise TypeError('create(): keyword arguments %s are only accepted with an '
                            'optimizer name, not with an instance' % sorted(kwargs))
        optimizer.__class__ = mixed_class(type(optimizer))
        optimizer.multi_precision = multi_precision
        return optimizer
    raise TypeError('optimizer must be a name or an mx.optimizer.Optimizer, got %r'
                    % (optimizer,))
