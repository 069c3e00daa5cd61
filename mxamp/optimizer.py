"""FP32 master weights for every MXNet optimizer.

This module owns:

* :class:`MultiPrecision`, a mixin that gives any ``mx.optimizer.Optimizer``
  subclass an FP32 master copy of each float16 or bfloat16 weight, with FP32
  optimizer states;
* :class:`AdamW`, decoupled-weight-decay Adam on MXNet's fused
  ``contrib.adamw_update`` / ``contrib.mp_adamw_update`` kernels (MXNet 1.9.1
  ships the kernels but registers no ``'adamw'`` optimizer);
* :func:`mixed_class` and :func:`create`, the factory that turns an optimizer
  name (``'sgd'``, ``'adam'``, ...) or instance into a mixed-in optimizer.  This
  is how ``mxamp.Trainer(params, 'sgd', {...})`` gets master weights.

Nothing here registers anything in MXNet's optimizer registry or changes MXNet
globally: mixed-in classes are created on demand and cached in this module.

Why it is needed
----------------
MXNet 1.9.1's ``multi_precision=True`` only recognises ``weight.dtype ==
numpy.float16``.  A bfloat16 weight gets no master copy, and the SGD family's
kernels reject it ("Unknown type enum 12").  Without a master copy, small
updates vanish: a float16 weight of 1.0 cannot move by 1e-4 (its spacing there
is 9.8e-4), a bfloat16 one by less than 3.9e-3.

How an update runs
------------------
* FP32 weights (or ``multi_precision=False``): the base optimizer, unchanged.
* float16 weights, base optimizer with a fused mixed-precision kernel (SGD and
  its momentum/aggregated variants, NAG, LAMB, LARS, :class:`AdamW`): the base
  optimizer's own ``update_multi_precision``, which calls ``mp_sgd_update``,
  ``mp_sgd_mom_update``, ``multi_mp_sgd_*``, ``mp_nag_mom_update``,
  ``mp_lamb_update_phase1/2`` or ``contrib.mp_adamw_update``.  These run on CPU.
* bfloat16 weights with MXNet's own ``SGD`` (with or without momentum) on a
  CPU where mxamp's native library runs: one native pass per weight
  (`mxamp.kernels.operators.sgd_step_bfloat16`) that computes what the generic path
  below computes, bit for bit, reading and writing each value once instead
  of in four MXNet passes (on CPUs without AVX-512, whose generic narrowing
  keeps subnormals, the pass rounds as a bfloat16 CPU does: the two differ
  only below 2**-100 in magnitude; :func:`mxamp.dtypes.bfloat16_casts_round_to_even`).
* Everything else (other bfloat16 weights, float16 weights with Adam, RMSProp,
  AdaGrad, ...): the generic path.  The gradient is cast to FP32, the base
  optimizer's FP32 ``update`` runs on the master copy and its FP32 states, and
  the master copy is cast back into the low-precision weight in place
  (:func:`mxamp.dtypes.cast_into`: no extra allocation for the weight, and
  correct when the weight holds a oneDNN blocked layout, which it may after an
  inference pass).  The master copy is made from the weight with
  :func:`mxamp.dtypes.amp_cast`, which reads blocked layouts too.

The state of a weight on the generic path is ``(master, inner_state)``, the
layout of MXNet's own ``Optimizer.create_state_multi_precision``.

Weights the user changes
------------------------
A master copy that never looks at its weight would write itself back at the
next update, silently undoing whatever changed the weight since: a
``load_parameters`` mid-training, ``set_data``, an in-place
``param.data()[:] = ...``, an EMA recipe that swaps averaged weights in
(MXNet's own ``multi_precision`` has that flaw).  So each update first restarts
every element of the master copy whose weight no longer holds the master's
rounding from the weight (:func:`follow_weight`): however the weight changed,
the update starts from the weight the user sees, as in FP32.  Elements nobody
touched keep their full FP32 master value.  A changed weight restarts from its
low-precision value (what the weight holds; the FP32 digits below it are not
recoverable from it): to restore a master copy exactly, load the trainer's
states saved with the parameters.  The check is five memory-bound
elementwise passes per weight, or one native pass for bfloat16 weights on a
CPU, no host sync (docs/training.rst, "Changing the
weights during training", has its cost on ResNet-50); ``follow_weights=False`` turns
it off for loops that never change weights outside the optimizer.
"""
# Annotations stay unevaluated, as in the modules below this one that kvstore
# servers import (see MultiPrecision: they run inside `import mxnet`).
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Dict, List, Tuple, Type, Union

import numpy as np

import mxnet as mx

from . import kvkeys
from .dtypes import BFLOAT16, amp_cast, bfloat16_casts_round_to_even, cast_into, widen

if TYPE_CHECKING:
    # For the checker, MultiPrecision is the optimizer it is mixed into (untyped
    # MXNet: Any), whose attributes and methods its own use; at run time it is a
    # plain mixin, first among the bases of an Optimizer subclass.
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
    """`array` in float32 (itself when it already is), for gradients.

    :func:`mxamp.dtypes.widen` reaches MXNet through ``mx.ndarray``, because
    ``mx.nd`` does not exist on a kvstore server (see :class:`MultiPrecision`).
    Gradients are always in the default oneDNN layout; weights may not be, and
    take :func:`mxamp.dtypes.amp_cast` (see :meth:`MultiPrecision.create_state_multi_precision`).
    """
    if array.dtype == np.float32:
        return array
    return widen(array)


class MultiPrecision(_MixedInto):
    """Mixin: FP32 master weights and FP32 states for float16 and bfloat16 weights.

    Put it first among the bases of any ``mx.optimizer.Optimizer`` subclass, or
    let :func:`mixed_class` / :func:`create` do it::

        class MyAdam(mxamp.optimizer.MultiPrecision, mx.optimizer.Adam):
            pass

        opt = mxamp.optimizer.create('adam', learning_rate=1e-3)   # same thing

    ``multi_precision`` defaults to True (MXNet's default is False); with
    ``multi_precision=False`` the optimizer behaves exactly like its base.
    ``follow_weights`` (default True): before each update, master copies
    follow weights changed outside the optimizer (see the module
    documentation; False saves its pass over the weights).

    The mixin overrides only ``create_state_multi_precision`` and
    ``update_multi_precision``, the two hooks through which MXNet's ``Updater``
    (used by ``gluon.Trainer``, ``Module`` and the kvstore) drives every
    optimizer; ``update`` and ``create_state`` of the base are reused unchanged
    on FP32 arrays.  The per-step cost of the generic path is one FP32 copy of
    each gradient and one cast of each master weight back into the weight.

    Notes
    -----
    A mixed-in optimizer pickles (``Trainer.save_states``, dist kvstore servers)
    as long as its base class can be pickled by reference and mxamp is
    importable where it is unpickled.  On a dist kvstore server that is while
    ``import mxnet`` is still running: MXNet 1.9.1 starts the server loop from
    inside ``mxnet/__init__.py`` (line 33, through ``mxnet.contrib`` ->
    ``mxnet.model`` -> ``mxnet.kvstore.kvstore_server``) and never returns, so
    ``mxnet.gluon``, ``mx.nd`` and ``mx.sym`` do not exist there.  This module
    uses only ``mx.optimizer`` and ``mx.ndarray`` for that reason, and importing
    the ``mxamp`` package on a server must not import ``mxnet.gluon``.  A server
    that fails to unpickle the optimizer only logs "Exception ignored on calling
    ctypes callback function"; :class:`mxamp.Trainer` detects it (see
    :mod:`mxamp.kvkeys`) and raises.
    """

    def __init__(self, *args: Any, follow_weights: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault('multi_precision', True)
        super(MultiPrecision, self).__init__(*args, **kwargs)
        self.follow_weights = bool(follow_weights)

    # -- which path --------------------------------------------------------
    def _mxamp_fused_fp16(self):
        """True when the base optimizer has its own float16 multi-precision update.

        Relies on MXNet 1.9.1's convention that optimizers with fused
        mixed-precision kernels override ``update_multi_precision`` (SGD, NAG,
        LAMB, LARS); the generic ``Optimizer.update_multi_precision`` is not used.
        """
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
        """Where the fused path's state keeps the master copy: 0 or 1.

        MXNet 1.9.1's SGD, NAG and LARS define their own
        ``create_state_multi_precision``, returning ``(inner_state, master)``;
        the others (LAMB, :class:`AdamW`) inherit ``Optimizer``'s, which
        returns ``(master, inner_state)``, the generic path's layout too.
        """
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
        if not getattr(self, 'follow_weights', True):   # pickles from before the option: on
            return
        at = 0 if generic else self._mxamp_master_index()
        for weight, state in zip(weights, states):
            follow_weight(state[at], weight)

    def _mxamp_generic(self, weight):
        """True when `weight` takes the generic cast-update-cast path."""
        if not (self.multi_precision and _is_low(weight)):
            return False
        return weight.dtype == BFLOAT16 or not self._mxamp_fused_fp16()

    # -- MXNet optimizer hooks ---------------------------------------------
    def create_state_multi_precision(self, index: int, weight: mx.ndarray.NDArray) -> Any:
        """State for `weight`: ``(fp32_master, fp32_state)`` for low-precision weights.

        Called once per weight by MXNet's ``Updater``; allocates the master copy
        (no host sync).  The weight may still hold a oneDNN blocked layout (a
        depthwise convolution after an inference pass), hence
        :func:`mxamp.dtypes.amp_cast`.
        """
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
        """Update `weight` (one array or a list of same-dtype arrays) from `grad`.

        Asynchronous: queues MXNet operators, never synchronises with the host.
        """
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
        many = isinstance(index, (list, tuple))
        if self._mxamp_native_sgd(first, grad[0] if many else grad):
            self._mxamp_sgd_steps(*([index, weight, grad, state] if many else
                                    [[index], [weight], [grad], [state]]))
            return
        if self.multi_precision and _is_low(first):
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

    def _mxamp_native_sgd(self, weight, grad):
        """Whether `weight` takes the one-pass SGD step (`mxamp.kernels.operators.sgd_step_bfloat16`).

        Only for MXNet's own ``SGD`` mixed in by :func:`mixed_class` (a
        subclass may change the update), on dense bfloat16 weights where the
        native kernels run (see `_native_library_takes`).  Also where this
        process's bfloat16 casts are MXNet's generic kernels (CPU class
        ``'avx2'``), unlike the native follow: the step writes the weight
        itself, rounded as it then compares, as a bfloat16 CPU's ``amp_cast``
        rounds.  That differs from the generic narrowing only below 2**-100
        in magnitude (subnormals flushed to zero), where the first step may
        restart a master converted from such a weight to the weight's value.
        """
        return (type(self).__dict__.get('_mxamp_base') is mx.optimizer.SGD and
                self.multi_precision and weight.stype == 'default' and
                grad.stype == 'default' and _native_library_takes(weight))

    def _mxamp_sgd_steps(self, indices, weights, grads, states):
        """SGD's update of bfloat16 weights on their masters, one native pass per weight.

        The learning rates, weight decays and update counts come from MXNet's
        own bookkeeping (``_update_count``, ``_get_lrs``, ``_get_wds``), as in
        ``SGD._update_impl``; asynchronous, no host sync.
        """
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

    def _mxamp_overflow_flag(self, stored, merged):
        """Server side of LossScaler's overflow agreement: :func:`mxamp.kvkeys.store_overflow_sum`."""
        rescale_grad = kvkeys.store_overflow_sum(stored, merged)
        if rescale_grad is not None:
            self.rescale_grad = rescale_grad

    # -- pickling of classes made by mixed_class() --------------------------
    def __reduce_ex__(self, protocol):
        base = type(self).__dict__.get('_mxamp_base')
        if base is None:
            return super(MultiPrecision, self).__reduce_ex__(protocol)
        return (_restore_mixed, (base,), self.__getstate__())


def follow_weight(master: mx.ndarray.NDArray, weight: mx.ndarray.NDArray) -> None:
    """Restart `master` from `weight` wherever `weight` no longer holds `master` rounded.

    After an update `weight` holds `master` rounded to its dtype; an element
    where it holds anything else was changed outside the optimizer, and its
    master restarts from the weight's value (widened exactly).  Elements where
    they agree keep their FP32 master value.  In place, no host sync: five
    elementwise passes (the master narrowed and widened back, the weight
    widened, compared, selected), about 46 bytes of memory traffic per value:
    on ResNet-50 v1 (25.5M values, 2 cores) 1.27 s per step on an AVX2 AMD
    EPYC (9.2% of a batch-16 bfloat16 step) and 0.11 s on an AMX Xeon (11%
    of its 1.0 s step).  A bfloat16 weight on the CPU takes one vectorised
    pass of mxamp's native library instead, with the same result, where the
    casts round to nearest even (`mxamp.kernels.operators.follow_bfloat16_weight`;
    29 ms, 3% of the step, on that Xeon; docs/training.rst, "Changing the
    weights during training").

    Parameters
    ----------
    master : NDArray
        float32, the master copy; overwritten.
    weight : NDArray
        float16 or bfloat16, same shape, in any oneDNN layout.
    """
    if weight.stype != 'default':
        return   # mxamp stores no sparse weight in low precision
    if _follows_natively(master, weight):
        _fast_step_kernels().follow_bfloat16_weight(master, weight)
        return
    # Compared in FP32: MXNet's float16/bfloat16 comparisons convert element by
    # element, slower than the two widening casts (measured).  _equal is the
    # elementwise comparison, without the broadcast kernel of ``==``.
    seen = amp_cast(weight, np.float32)
    written = widen(amp_cast(master, weight.dtype))
    mx.ndarray.where(mx.ndarray._internal._equal(seen, written), master, seen, out=master)


def _follows_natively(master, weight):
    """Whether mxamp's native one-pass kernel can follow `weight` (see `follow_weight`).

    Where the casts that wrote the weight round as the kernel does: not where
    MXNet's generic kernels stand in for ``amp_cast`` (CPU class ``'avx2'``),
    whose narrowing differs from the kernel's below 2**-100 in magnitude, so
    the kernel would restart those masters.
    """
    return master.context == weight.context and bfloat16_casts_round_to_even() and \
        _native_library_takes(weight)


def _native_library_takes(weight):
    """Whether mxamp's native master-weight kernels (follow, SGD step) can run on `weight`.

    bfloat16 weights on the CPU, in a worker process with the library loaded.
    Not on a kvstore server: it runs inside ``import mxnet`` (see
    MultiPrecision), where mxamp's package, and with it the library, is never
    imported.
    """
    if weight.dtype != BFLOAT16 or weight.context.device_type != 'cpu' or \
            os.environ.get('DMLC_ROLE', 'worker') != 'worker':
        return False
    operators = _fast_step_kernels()
    return operators is not None and operators.available()


def _fast_step_kernels():
    """The kernel wing's operators (`mxamp.kernels.operators`), None without the wing: the
    optimizer's one door into it."""
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

    Each step, with ``t`` the update count of the weight::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        w -= lr * (sqrt(1 - beta2**t) / (1 - beta1**t) * m / (sqrt(v) + epsilon) + wd * w)

    where ``g = clip(rescale_grad * grad, clip_gradient)`` and ``lr`` includes the
    scheduler and ``lr_mult``.  Uses ``contrib.adamw_update`` for FP32 weights and
    ``contrib.mp_adamw_update`` for float16 weights with ``multi_precision``.
    Not registered in MXNet's registry; :func:`create` finds it as ``'adamw'``.

    Parameters
    ----------
    learning_rate : float, default 0.001
    beta1, beta2 : float, default 0.9 and 0.999
    epsilon : float, default 1e-8
    **kwargs
        Passed to ``mx.optimizer.Optimizer`` (``wd``, ``clip_gradient``, ...).
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

    Raises
    ------
    ValueError
        When no optimizer has that name; the message lists the known names.
    """
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
    """The class ``MultiPrecision<Base>(MultiPrecision, base)``, created once per base.

    Returns `base` itself when it already derives from :class:`MultiPrecision`.
    """
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
        A name known to :func:`lookup` (case-insensitive), or an instance.  An
        instance is converted **in place** (its class becomes
        ``mixed_class(type(optimizer))``), so references the caller holds keep
        working, and it is returned.
    multi_precision : bool, default True
        Whether float16/bfloat16 weights get FP32 master copies.
    **kwargs
        Constructor arguments when `optimizer` is a name (``learning_rate``,
        ``momentum``, ...).  Not allowed with an instance.

    Examples
    --------
    >>> opt = mxamp.optimizer.create('sgd', learning_rate=0.1, momentum=0.9)
    >>> type(opt).__name__
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
