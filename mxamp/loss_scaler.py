"""Dynamic or fixed loss scaling with skip-on-overflow, for Gluon and ``mx.mod.Module``.

This module owns :class:`LossScaler`: the loss scale and its schedule, the
overflow check of gradients on any number of contexts and in any dtypes (one
host sync; distributed workers agree through :func:`mxamp.kvkeys.agree_overflow`),
on a skipped step the check of the loss itself (a loss that is not finite is
no gradient overflow: the scale is kept), the check that a step's gradients
were scaled at all, its state, a Module's step (:meth:`LossScaler.update_module`),
and the calls that ``torch.amp``'s ``GradScaler`` users reach for (``enabled=``,
:meth:`LossScaler.get_scale`, :meth:`LossScaler.is_enabled`,
:meth:`LossScaler.set_scale`).  :class:`mxamp.Trainer` drives one for Gluon.

MXNet internals relied on (MXNet 1.9.1):

* ``mx.mod.Module`` (:meth:`LossScaler.update_module`): ``_exec_group``'s
  ``param_names`` and ``grad_arrays`` (the gradients to check, per device),
  ``_optimizer`` (its ``rescale_grad`` takes the loss scale), ``_kvstore`` and
  ``_update_on_kvstore`` (the agreement between workers); ``symbol`` and
  ``get_outputs(merge_multi_context=False)`` (the losses: outputs not under
  ``BlockGrad``).
"""
import collections
import json
import logging
import math
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

import mxnet as mx
from mxnet import autograd

from . import diagnose, kvkeys
from .dtypes import BFLOAT16, DTypeLike, precision_name, to_float32_numpy, widen
from .policy import CAST_OPS, registered_ops

__all__ = ['LossScaler', 'OverflowInfo']

# The logger's name is the one users configure: it predates this module.
_LOG = logging.getLogger('mxamp.trainer')

#: multi_all_finite in MXNet 1.9.1 takes at most 200 arrays (201 segfaults).
_MAX_FINITE_ARRAYS = 200

#: What :class:`LossScaler` passes to its ``on_overflow`` callback.
OverflowInfo = collections.namedtuple(
    'OverflowInfo', ['step', 'loss_scale', 'next_loss_scale', 'skipped_steps'])

_STATE_KEYS = ('loss_scale', 'dynamic', 'enabled', 'first_descent', 'growth_factor', 'backoff_factor',
               'growth_interval', 'min_scale', 'max_scale', 'at_min_scale', 'clean_steps',
               'skipped_steps', 'steps')

def _positive(name: str, value: Any) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError('%s must be a positive finite number, got %r' % (name, value))
    if not (math.isfinite(value) and value > 0):
        raise ValueError('%s must be a positive finite number, got %r' % (name, value))
    return value


def _check_overflow_flag(overflow: Any) -> None:
    """Refuse an `overflow` that is not a bool (Python's or numpy's).

    ``torch.amp``'s ``GradScaler.update(new_scale)`` takes a new scale, and
    ``GradScaler.update()`` takes nothing: read as a verdict, a scale such as
    1024.0 would be "overflow" and cut the scale, silently.
    """
    if isinstance(overflow, (bool, np.bool_)):
        return
    start = 'LossScaler.update(overflow) takes whether the step overflowed (True or False), got '
    if overflow is None:
        raise TypeError(start + "nothing: torch.amp's GradScaler.update() finds that by itself; "
                        'mxamp.Trainer.step() and ModuleTrainer.step() already call update(), '
                        'and LossScaler.set_scale(value) sets a new scale')
    if isinstance(overflow, (int, float, np.number)):
        raise TypeError(start + "%s %r: torch.amp's GradScaler.update(new_scale) takes a new "
                        'scale, which mxamp sets with LossScaler.set_scale(%r)'
                        % (type(overflow).__name__, overflow, overflow))
    raise TypeError(start + '%s: LossScaler.has_overflow(grads) gives it as a bool'
                    % type(overflow).__name__)


def _flat_grads(arrays: Iterable[Optional[mx.nd.NDArray]]) -> List[mx.nd.NDArray]:
    """Dense arrays to check: row_sparse gradients contribute their stored values."""
    out = []
    for arr in arrays:
        if arr is None:
            continue
        if arr.stype != 'default':
            arr = arr.data
        out.append(arr)
    return out


def _finite_flags(arrays):
    """Per-context all-finite flags, without a host sync.

    Returns a list of float32 NDArrays of shape (1,), one per context of
    `arrays` (1.0 when every array on that context is finite).  Arrays are
    grouped by context and dtype: ``multi_all_finite`` reads every input with the
    dtype of its first one and rejects bfloat16.

    * float16 and float32 on GPU: ``multi_all_finite``.
    * Every dtype on CPU: ``multi_sum_sq`` (float16 and bfloat16 widened to
      float32 first: ``multi_sum_sq`` adds float16 in float16, which overflows,
      and rejects bfloat16), then ``multi_all_finite`` on the per-array sums:
      on a CPU, MXNet 1.9.1's ``multi_all_finite`` is many times slower than
      widening and ``multi_sum_sq`` (docs/performance.rst has the
      measurements).  A sum of squares is non-finite when any element is, and
      also when it exceeds float32's range (float32 elements around 1e19;
      float16 ones cannot reach it): such gradients count as overflow too.
    """
    groups = collections.OrderedDict()
    for arr in arrays:
        groups.setdefault(arr.context, collections.OrderedDict()) \
              .setdefault(arr.dtype, []).append(arr)
    flags = []
    for ctx, by_dtype in groups.items():
        flag = mx.nd.ones((1,), ctx=ctx, dtype=np.float32)
        for dtype, group in by_dtype.items():
            sum_sq = ctx.device_type == 'cpu'
            for start in range(0, len(group), _MAX_FINITE_ARRAYS):
                chunk = group[start:start + _MAX_FINITE_ARRAYS]
                if dtype == BFLOAT16 or sum_sq and dtype != np.float32:
                    chunk = [widen(a) for a in chunk]
                if sum_sq:
                    chunk = [mx.nd.multi_sum_sq(*chunk, num_arrays=len(chunk))]
                mx.nd.multi_all_finite(*chunk, num_arrays=len(chunk), init_output=False,
                                       out=flag)
        flags.append(flag)
    return flags


def head_gradients(outputs: Sequence[mx.nd.NDArray], value: float,
                   cache: Dict[Any, Tuple[float, mx.nd.NDArray]]) -> List[mx.nd.NDArray]:
    """Arrays full of `value`, shaped like `outputs` and in their dtypes, for
    ``Module.backward(out_grads=...)``.  No host sync.

    `cache` (a dict owned by the caller) keeps them, reused while `value` is
    unchanged: a step then allocates nothing.
    """
    result = []
    for out in outputs:
        key = (out.shape, out.context, np.dtype(out.dtype).str
               if out.dtype != BFLOAT16 else 'bf16')
        cached = cache.get(key)
        if cached is None or cached[0] != value:
            grad = mx.nd.full(out.shape, value, ctx=out.context, dtype=np.float32)
            if out.dtype != np.float32:
                grad = mx.nd.amp_cast(grad, dtype=out.dtype)
            cached = (value, grad)
            cache[key] = cached
        result.append(cached[1])
    return result


class LossScaler(object):
    """Dynamic or fixed loss scaling with skip-on-overflow.

    Multiply the loss by :attr:`loss_scale` before ``backward`` (:meth:`scale`
    or :meth:`out_grads`), undo it in the optimizer through ``rescale_grad``,
    check the gradients for inf/NaN (:meth:`has_overflow`), skip the update if
    any is found and report the outcome with :meth:`update`.  A dynamic scaler
    multiplies the scale by `backoff_factor` on every overflow and by
    `growth_factor` after `growth_interval` consecutive clean steps; the new
    scale applies from the very next step.

    The default start is 2**16 with a fast first descent: until the first
    step is applied, an overflow divides the scale by 16 (or by
    1 / `backoff_factor` when that is larger), so the start costs at most
    four skipped steps on the way down to 1 (halving: up to sixteen), and the
    scale it settles on is at most 8x below the largest power of two that
    fits.  Why: MXNet sums per-sample gradients, so they are batch-size times
    the mean-loss gradients that 2**16 (PyTorch's ``GradScaler``; Keras uses
    2**15) was chosen for, and halving from there skips many steps.  A scale
    too high only costs skipped steps; one too low loses small gradients to
    float16 underflow until it grows back, so the start stays high and only
    the descent is faster.  The rule depends on the overflow verdicts alone
    (which the workers agree on), so every worker keeps the same scale.

    Early skipped steps cost accuracy, not only time (docs/training.rst has
    the measurements): the start is where they happen.

    A loss that is not finite is not a gradient overflow.  When a step is
    skipped, the losses that :meth:`scale` received (kept by reference, no
    copy) or, with :meth:`update_module`, the Module's loss outputs are read;
    if one holds inf/NaN, the forward pass itself failed (in float16, e.g. a
    -1e18 fill of masked attention scores, which is -inf there), and no loss
    scale can fix that.  The step stays skipped and counted, but the scale
    and its count of clean steps are left as they are: lowering the scale
    would only lose small gradients to underflow once the loss is finite
    again, and a step that says nothing about the scale must not decide it.
    What happens then is what ``at_min_scale`` says for an overflow that
    loss scaling cannot fix: one warning per scaler, an error, or nothing.
    The read costs host syncs on skipped steps only; distributed workers
    agree on it (any worker's loss counts), so all of them keep the same scale.

    :class:`Trainer` drives a scaler for Gluon; :meth:`update_module` does the
    same for ``mx.mod.Module``.

    Parameters
    ----------
    init_scale : float, optional
        Initial (or, with ``dynamic=False``, fixed) loss scale.  Default:
        2**16 with the fast first descent described above.  Given explicitly,
        the scale starts exactly there and every overflow multiplies it by
        `backoff_factor`.
    dynamic : bool, default True
        Adjust the scale; with False the scale is fixed but overflowing steps
        are still skipped.
    growth_factor : float, default 2.0
        Factor (> 1) applied after `growth_interval` clean steps.
    backoff_factor : float, default 0.5
        Factor (between 0 and 1) applied on overflow.
    growth_interval : int, default 2000
        Consecutive overflow-free steps before the scale grows.
    min_scale, max_scale : float, default 1.0 and 2**24
        Bounds of the dynamic scale.
    at_min_scale : {'warn', 'raise', 'ignore'}, default 'warn'
        What to do when loss scaling cannot fix a skipped step: on an overflow
        when the scale is already `min_scale`, and on a step whose loss is not
        finite (whatever the scale, fixed scales included).  Warn
        (``RuntimeWarning``: at every such overflow at the floor, but once per
        scaler for a loss that is not finite), raise ``FloatingPointError``
        (after skipping the step and counting it), or do nothing.  Persistent
        overflow at the floor usually means the model itself produces inf/NaN.
    on_overflow : callable, optional
        Called as ``on_overflow(info)`` after every skipped step, with an
        :class:`OverflowInfo` ``(step, loss_scale, next_loss_scale,
        skipped_steps)``; after a step whose loss is not finite,
        ``next_loss_scale`` equals ``loss_scale``.  Skips are also logged at
        INFO level on the ``mxamp.trainer`` logger.
    enabled : bool, default True
        False makes a scaler that does nothing, as ``GradScaler(enabled=False)``
        does, for one script with and without mixed precision
        (``LossScaler(enabled=use_amp)``): its scale is 1.0 and never changes,
        :meth:`scale` returns the loss as it is, :meth:`has_overflow` checks
        nothing (False), :meth:`update`, :meth:`set_scale` and
        :meth:`load_state_dict` change nothing, :meth:`update_module` always
        updates.  Every method stays callable.  :class:`mxamp.Trainer` and
        :class:`mxamp.ModuleTrainer` given a disabled scaler train without loss
        scaling, as with ``loss_scale=None`` (their ``loss_scaler`` is None).
        The other arguments are still checked.

    Notes
    -----
    For ``torch.amp`` users, ``GradScaler``'s calls and mxamp's:

    * ``GradScaler(init_scale=..., growth_factor=..., backoff_factor=...,
      growth_interval=..., enabled=...)``: ``LossScaler`` with the same
      keywords (without `init_scale`, mxamp's first descent is faster: see
      above); ``mxamp.Trainer(..., loss_scale=scaler)`` uses it.
    * ``scaler.scale(loss)``: :meth:`scale`, or with :class:`mxamp.Trainer`,
      ``with trainer.scale_loss(loss) as scaled: autograd.backward(scaled)``.
    * ``scaler.unscale_(optimizer)``: ``trainer.unscale()``; clipping needs none
      (``trainer.clip_global_norm(max_norm)`` reports the unscaled norm).
    * ``scaler.step(optimizer)`` then ``scaler.update()``:
      ``trainer.step(batch_size)`` does both and returns False for a skipped
      step.  By hand: :meth:`has_overflow`, then :meth:`update` with that
      verdict, a bool, never a scale.
    * ``scaler.update(new_scale)``: :meth:`set_scale`.
    * ``scaler.get_scale()``, ``scaler.is_enabled()``: :meth:`get_scale`
      (also :attr:`loss_scale`), :meth:`is_enabled`.
    * ``scaler.state_dict()``, ``scaler.load_state_dict(state)``: the same
      names; ``trainer.save_states(fname)`` also saves this state.
    * ``get_growth_factor()``, ``get_backoff_factor()``,
      ``get_growth_interval()``: the attributes ``growth_factor``,
      ``backoff_factor``, ``growth_interval``.

    Examples
    --------
    With ``mx.mod.Module`` driven by hand (:class:`mxamp.ModuleTrainer` does
    all of this): let the symbol's output be the per-sample loss itself (no
    ``SoftmaxOutput``/``MakeLoss`` head: those ignore head gradients), give
    the scaled head gradients to ``backward`` and let the scaler run the
    update:

    >>> fc = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=1, name='fc')
    >>> loss = mx.sym.square(mx.sym.reshape(fc, (-1,)) - mx.sym.var('label'))
    >>> mod = mx.mod.Module(loss, data_names=['data'], label_names=['label'])
    >>> mod.bind(data_shapes=[('data', (8, 4))], label_shapes=[('label', (8,))])
    >>> mod.init_params()
    >>> mod.init_optimizer(optimizer=mxamp.optimizer.create(
    ...     'sgd', learning_rate=0.1, rescale_grad=1.0 / 8))
    >>> scaler = mxamp.LossScaler()
    >>> batch = mx.io.DataBatch([mx.nd.ones((8, 4))], [mx.nd.ones((8,))])
    >>> mod.forward(batch, is_train=True)
    >>> mod.backward(scaler.out_grads(mod.get_outputs()))
    >>> scaler.update_module(mod)     # False when the step was skipped
    True

    A switch for runs with and without mixed precision, and a new scale set
    by hand, where ``torch.amp``'s ``GradScaler.update(new_scale)`` would:

    >>> mxamp.LossScaler(enabled=False).get_scale()
    1.0
    >>> scaler.set_scale(1024.0)
    >>> scaler.get_scale(), scaler.is_enabled()
    (1024.0, True)
    """

    #: The start when `init_scale` is not given, and the largest factor of its
    #: first descent (see the class docstring).
    DEFAULT_INIT_SCALE = 2.0 ** 16
    FIRST_DESCENT_FACTOR = 2.0 ** -4

    def __init__(self, init_scale: Optional[float] = None, dynamic: bool = True,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, max_scale: float = 2.0 ** 24,
                 at_min_scale: str = 'warn',
                 on_overflow: Optional[Callable[[OverflowInfo], Any]] = None,
                 enabled: bool = True) -> None:
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError('LossScaler: enabled must be True or False, got %r' % (enabled,))
        self._configure(dict(loss_scale=self.DEFAULT_INIT_SCALE if init_scale is None
                             else init_scale, dynamic=dynamic,
                             growth_factor=growth_factor, backoff_factor=backoff_factor,
                             growth_interval=growth_interval, min_scale=min_scale,
                             max_scale=max_scale, at_min_scale=at_min_scale,
                             first_descent=init_scale is None))
        if on_overflow is not None and not callable(on_overflow):
            raise TypeError('on_overflow must be callable, got %r' % (on_overflow,))
        self.on_overflow = on_overflow
        self._enabled = bool(enabled)
        if not self._enabled:
            self._scale = 1.0
        self._clean_steps = 0
        self._skipped_steps = 0
        self._steps = 0
        self._scaled = False        # scale() or out_grads() since the last update()
        self._losses: List[mx.nd.NDArray] = []   # what scale() received since the last update()
        # (dist kvstore, rescale_grad) of this step's verdict
        self._agreement: Optional[Tuple[mx.kv.KVStore, Optional[float]]] = None
        self._loss_warned = False   # the warning about a non-finite loss is given once
        self._out_grads: Dict[Any, Tuple[float, mx.nd.NDArray]] = {}
        self._base_rescale: weakref.WeakKeyDictionary[mx.optimizer.Optimizer, float] = \
            weakref.WeakKeyDictionary()
        # The kvstores where the overflow key is initialised.
        self._flag_kvstores: weakref.WeakKeyDictionary[mx.kv.KVStore, bool] = \
            weakref.WeakKeyDictionary()

    def _configure(self, cfg):
        scale = _positive('loss_scale', cfg['loss_scale'])
        growth = _positive('growth_factor', cfg['growth_factor'])
        backoff = _positive('backoff_factor', cfg['backoff_factor'])
        if growth <= 1.0:
            raise ValueError('growth_factor must be > 1, got %r' % (cfg['growth_factor'],))
        if backoff >= 1.0:
            raise ValueError('backoff_factor must be < 1, got %r' % (cfg['backoff_factor'],))
        interval = cfg['growth_interval']
        if isinstance(interval, bool) or not isinstance(interval, (int, np.integer)) \
                or interval < 1:
            raise ValueError('growth_interval must be an integer >= 1, got %r' % (interval,))
        low = _positive('min_scale', cfg['min_scale'])
        high = _positive('max_scale', cfg['max_scale'])
        dynamic = bool(cfg['dynamic'])
        if low > high:
            raise ValueError('min_scale (%r) must not exceed max_scale (%r)' % (low, high))
        if dynamic and not low <= scale <= high:
            raise ValueError('the loss scale %r must lie within [min_scale, max_scale] = '
                             '[%r, %r]' % (scale, low, high))
        if cfg['at_min_scale'] not in ('warn', 'raise', 'ignore'):
            raise ValueError("at_min_scale must be 'warn', 'raise' or 'ignore', got %r"
                             % (cfg['at_min_scale'],))
        self._scale = scale
        self.dynamic = dynamic
        self.growth_factor = growth
        self.backoff_factor = backoff
        self.growth_interval = int(interval)
        self.min_scale = low
        self.max_scale = high
        self.at_min_scale = cfg['at_min_scale']
        self._first_descent = bool(cfg['first_descent'])

    # -- public state --------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale (a Python float; no host sync)."""
        return self._scale

    def get_scale(self) -> float:
        """The current loss scale, as :attr:`loss_scale` (``GradScaler.get_scale()``).

        1.0 for a disabled scaler.  A Python float; no host sync.
        """
        return self._scale

    def is_enabled(self) -> bool:
        """Whether this scaler scales at all (``enabled=`` at construction;
        ``GradScaler.is_enabled()``)."""
        return self._enabled

    def set_scale(self, value: float) -> None:
        """Use `value` as the loss scale from the next step on.

        What ``torch.amp``'s ``GradScaler.update(new_scale)`` does (here,
        :meth:`update` takes the step's outcome instead).  The scale starts
        again from `value`, as if it were `init_scale`: a dynamic scaler counts
        its `growth_interval` clean steps from here, and its next overflow
        multiplies it by `backoff_factor` (no fast first descent).  A fixed
        scaler (``dynamic=False``) keeps `value` as its scale.  The counters of
        steps and skipped steps go on.  A disabled scaler checks `value` and
        keeps its scale of 1.0.  No host sync.

        Parameters
        ----------
        value : float
            A positive finite number; for a dynamic scaler, within
            [`min_scale`, `max_scale`].

        Raises
        ------
        ValueError
            When `value` is not a positive finite number (or is a bool), or is
            outside a dynamic scaler's bounds.
        RuntimeError
            When :meth:`scale` or :meth:`out_grads` ran since the last
            :meth:`update`: that step's gradients carry the current scale,
            which the step divides them by.  Set the scale after the step.
        """
        if isinstance(value, (bool, np.bool_)):
            raise ValueError('set_scale(): the loss scale must be a positive finite number, '
                             'not a bool')
        scale = _positive('set_scale(): the loss scale', value)
        if self.dynamic and not self.min_scale <= scale <= self.max_scale:
            raise ValueError('set_scale(): the loss scale %r must lie within [min_scale, '
                             'max_scale] = [%r, %r]' % (value, self.min_scale, self.max_scale))
        if not self._enabled:
            return
        if self._scaled:
            raise RuntimeError('set_scale(%r) between scale() (or out_grads()) and the step: '
                               'these gradients carry the loss scale %g, which the step divides '
                               'them by; set the scale after the step' % (value, self._scale))
        self._scale = scale
        self._clean_steps = 0
        self._first_descent = False

    @property
    def skipped_steps(self) -> int:
        """Number of steps skipped because of overflow."""
        return self._skipped_steps

    @property
    def steps(self) -> int:
        """Number of steps reported to :meth:`update` (applied or skipped)."""
        return self._steps

    @property
    def clean_steps(self) -> int:
        """Consecutive overflow-free steps since the scale last changed or overflowed."""
        return self._clean_steps

    @property
    def scaled_since_update(self) -> bool:
        """Whether :meth:`scale` or :meth:`out_grads` ran since the last :meth:`update`."""
        return self._scaled

    def check_scaled(self, caller: str, remedy: str) -> None:
        """Refuse to unscale gradients that were never scaled.  No host sync.

        Gradients computed without :meth:`scale` (or :meth:`out_grads`) would
        be divided by :attr:`loss_scale` all the same: the update would shrink
        by that factor, silently.  :class:`Trainer` and :meth:`update_module`
        call this before a step that has new gradients; a scale fixed at 1
        needs no scaling and passes.

        Parameters
        ----------
        caller : str
            What is about to unscale, for the message (``'step()'``).
        remedy : str
            How to scale the gradients, for the message.

        Raises
        ------
        RuntimeError
            When neither :meth:`scale` nor :meth:`out_grads` ran since the last
            :meth:`update`.
        """
        if self._scaled or not self._enabled or (not self.dynamic and self._scale == 1.0):
            return
        raise RuntimeError('%s: the gradients were not computed from a scaled loss since the '
                           'last step, so dividing them by the loss scale %g would shrink the '
                           'update %g times; %s' % (caller, self._scale, self._scale, remedy))

    def __repr__(self) -> str:
        if not self._enabled:
            return 'LossScaler(enabled=False)'
        return ('LossScaler(loss_scale=%g, dynamic=%s, skipped_steps=%d, steps=%d)'
                % (self._scale, self.dynamic, self._skipped_steps, self._steps))

    # -- scaling ---------------------------------------------------------------
    def scale(self, loss: Union[mx.nd.NDArray, List[mx.nd.NDArray], Tuple[mx.nd.NDArray, ...]]
              ) -> Union[mx.nd.NDArray, List[mx.nd.NDArray], Tuple[mx.nd.NDArray, ...]]:
        """`loss` times :attr:`loss_scale` (an NDArray, or a list/tuple of them).

        Recorded by autograd (opens a ``record`` scope if none is active), so
        ``backward`` on the result gives scaled gradients.  Marks the step as
        scaled (see :meth:`check_scaled`).  Keeps a reference to `loss` (no
        copy) until :meth:`update`, which reads it only if the step is
        skipped.  No host sync.  A disabled scaler returns `loss` as it is.
        """
        self._scaled = True
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(item) for item in loss)
        if not isinstance(loss, mx.nd.NDArray):
            raise TypeError('scale() expects an NDArray or a list of NDArrays, got %r'
                            % (type(loss),))
        if not self._enabled:
            return loss
        self._losses.append(loss)
        if autograd.is_recording():
            return loss * self._scale
        with autograd.record():
            return loss * self._scale

    def out_grads(self, outputs: Sequence[mx.nd.NDArray]) -> List[mx.nd.NDArray]:
        """Head gradients equal to :attr:`loss_scale`, shaped like `outputs`.

        For ``Module.backward(out_grads=...)`` when the symbol's outputs are
        losses.  The arrays are cached and reused while the scale is unchanged.
        Marks the step as scaled (see :meth:`check_scaled`).  No host sync.
        """
        self._scaled = True
        return head_gradients(outputs, self._scale, self._out_grads)

    # -- overflow ----------------------------------------------------------------
    def has_overflow(self, arrays: Iterable[mx.nd.NDArray], kvstore: Optional[mx.kv.KVStore] = None,
                     rescale_grad: Optional[float] = None) -> bool:
        """True when any of `arrays` holds an inf or NaN.  **One host sync.**

        A disabled scaler checks nothing and returns False (no host sync), as
        a disabled ``GradScaler`` steps the optimizer unchecked.

        Parameters
        ----------
        arrays : list of NDArray
            Gradients, on any number of contexts and in any dtypes (float16,
            bfloat16, float32; row_sparse gradients are checked on their values).
        kvstore : KVStore, optional
            With a distributed kvstore, the verdict is agreed between workers by
            summing a flag through the kvstore (:func:`mxamp.kvkeys.agree_overflow`:
            ``pushpull`` of one reserved key), so every worker skips the same
            steps.  Ignored for local kvstores.
        rescale_grad : float, optional
            Sent along with the flag so that kvstore servers that run the
            optimizer (``update_on_kvstore=True``) apply it.  Give it only when
            the servers run the optimizer: they must then run an mxamp (mixed-in)
            optimizer, or ``RuntimeError`` is raised before anything is pushed.

        Raises
        ------
        RuntimeError
            With a distributed kvstore and `rescale_grad`, when the server does
            not run an mxamp optimizer (typically: it failed to unpickle it).
        """
        if not self._enabled:
            return False
        flags = _finite_flags(_flat_grads(arrays))
        self._agreement = None
        if kvstore is not None and 'dist' in kvstore.type:
            cpu = mx.cpu()
            bad = mx.nd.zeros((1,), ctx=cpu)
            for flag in flags:
                bad += 1.0 - flag.as_in_context(cpu)
            overflow = kvkeys.agree_overflow(kvstore, bad, rescale_grad, self._flag_kvstores)
            # update() agrees on the loss check through the same kvstore, if it comes to that.
            self._agreement = (kvstore, rescale_grad)
            return overflow
        if not flags:
            return False
        if len(flags) == 1:
            return flags[0].asscalar() != 1.0
        gathered = mx.nd.concat(*[f.as_in_context(mx.cpu()) for f in flags], dim=0)
        return bool((gathered.asnumpy() != 1.0).any())

    def update(self, overflow: Optional[bool] = None, details: Optional[Callable[[], str]] = None,
               loss_details: Optional[Callable[[], str]] = None,
               kvstore: Optional[mx.kv.KVStore] = None) -> None:
        """Record the outcome of a step and adjust the scale.

        On a skipped step, first reads the losses that :meth:`scale` received
        since the last update: when one is not finite, the scale and its
        count of clean steps are kept, and ``at_min_scale`` says whether to
        warn (once per scaler), raise or do nothing (see the class docstring).

        No host sync when the step was applied.  On a skipped step, one host
        sync per kept loss (to read it) and, with a distributed kvstore, one
        ``pushpull`` (:func:`mxamp.kvkeys.agree_overflow`) so that every worker
        keeps or lowers the scale alike: all workers must then call this on the
        same steps, which an agreed overflow verdict guarantees.

        A disabled scaler changes nothing.

        Parameters
        ----------
        overflow : bool
            Whether the step was skipped because of inf/NaN gradients (a
            Python or numpy bool; required).  Not a scale, as in ``torch.amp``'s
            ``GradScaler.update(new_scale)``: :meth:`set_scale` sets one.
        details : callable, optional
            Called with no argument only when an overflow happens at
            `min_scale` with finite losses (and ``at_min_scale`` is not
            ``'ignore'``); the string it returns is appended to the error or
            warning.  :class:`Trainer` and :meth:`update_module` use it to name
            the parameters with inf/NaN gradients (host syncs, on that path only).
        loss_details : callable, optional
            Called with no argument only when a loss that is not finite is
            reported (the first time with ``'warn'``, every time with
            ``'raise'``); the string it returns is appended to the error or
            warning.  :class:`Trainer` and :meth:`update_module` use it to say
            where the inf/NaN starts and how to keep that block in FP32.
            Default: how to find the first layer whose output is not finite
            and what usually fixes it.
        kvstore : KVStore, optional
            A distributed kvstore through which the workers agree whether some
            worker's loss was not finite.  Default: the one :meth:`has_overflow`
            agreed through on this step, if any.  Give it when the overflow
            verdict is shared without it (every worker checked the same
            gradients, summed over workers).

        Raises
        ------
        TypeError
            When `overflow` is missing or not a bool (a scale, say); the
            message names :meth:`set_scale`.
        FloatingPointError
            With ``at_min_scale='raise'``, on overflow at `min_scale` and on a
            loss that is not finite.
        """
        _check_overflow_flag(overflow)
        losses, self._losses = self._losses, []
        agreement, self._agreement = self._agreement, None
        if not self._enabled:
            self._scaled = False
            return
        # The verdict on the losses comes first: a failed agreement must not leave
        # the counters half updated.
        nonfinite_loss = self._nonfinite_loss(losses, kvstore, agreement) if overflow else None
        self._steps += 1
        self._scaled = False
        if not overflow:
            self._clean_steps += 1
            if self.dynamic and self._clean_steps >= self.growth_interval:
                self._clean_steps = 0
                new = min(self._scale * self.growth_factor, self.max_scale)
                if new != self._scale:
                    _LOG.debug('mxamp: loss scale %g -> %g after %d clean steps',
                               self._scale, new, self.growth_interval)
                self._scale = new
            return
        self._skipped_steps += 1
        if nonfinite_loss is not None:
            self._report_nonfinite_loss(nonfinite_loss, loss_details)
            return
        self._clean_steps = 0
        old = self._scale
        at_floor = self.dynamic and old <= self.min_scale
        if self.dynamic:
            factor = self.backoff_factor
            # The counters follow the agreed verdicts, so all workers take this branch alike.
            if self._first_descent and self._steps == self._skipped_steps:
                factor = min(factor, self.FIRST_DESCENT_FACTOR)
            self._scale = max(old * factor, self.min_scale)
        _LOG.info('mxamp: inf/NaN gradients at step %d, update skipped; loss scale %g -> %g',
                  self._steps, old, self._scale)
        if self.on_overflow is not None:
            self.on_overflow(OverflowInfo(self._steps, old, self._scale, self._skipped_steps))
        if at_floor and self.at_min_scale != 'ignore':
            message = ('mxamp: gradients overflow at the minimum loss scale %g (step %d, %d '
                       'steps skipped): the model produces inf/NaN without loss scaling'
                       % (old, self._steps, self._skipped_steps))
            if details is not None:
                message += details()
            if self.at_min_scale == 'raise':
                raise FloatingPointError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _nonfinite_loss(self, losses, kvstore, agreement):
        """Where a loss of the step is not finite: None (nowhere), ``'here'`` or
        ``'another worker'``.  Host syncs; one pushpull with a distributed kvstore."""
        agreed_kvstore, agreed_rescale = agreement or (None, None)
        if kvstore is None:
            kvstore = agreed_kvstore
        bad = sum(not np.isfinite(to_float32_numpy(loss)).all() for loss in losses)
        if kvstore is not None and 'dist' in kvstore.type:
            # Servers that run the optimizer adopt the rescale_grad sent with the flag:
            # resend this step's, which they already hold.
            anywhere = kvkeys.agree_overflow(
                kvstore, mx.nd.array([bad], ctx=mx.cpu()),
                agreed_rescale if kvstore is agreed_kvstore else None, self._flag_kvstores)
        else:
            anywhere = bad > 0
        if not anywhere:
            return None
        return 'here' if bad else 'another worker'

    def _report_nonfinite_loss(self, where, loss_details):
        """Log a skipped step whose loss is not finite (`where`: ``'here'`` or
        ``'another worker'``); warn once, or raise."""
        _LOG.info('mxamp: inf/NaN loss at step %d (%s), update skipped; loss scale %g kept',
                  self._steps, where, self._scale)
        if self.on_overflow is not None:
            self.on_overflow(OverflowInfo(self._steps, self._scale, self._scale,
                                          self._skipped_steps))
        if self.at_min_scale == 'ignore' or (self.at_min_scale == 'warn' and self._loss_warned):
            return
        message = ('mxamp: the loss is not finite (inf/NaN in the forward output%s) at step '
                   '%d, so this is not a gradient overflow and loss scaling cannot fix it: the '
                   'step was skipped and the loss scale kept at %g'
                   % ('' if where == 'here' else ' of another worker', self._steps, self._scale))
        if where == 'here':
            message += (loss_details if loss_details is not None else _default_loss_details)()
        else:
            message += ".  That worker's warning or error says where it comes from"
        if self.at_min_scale == 'raise':
            raise FloatingPointError(message)
        self._loss_warned = True
        warnings.warn(message + '.  Warned once; further such steps are skipped and logged '
                      'at INFO on the mxamp.trainer logger', RuntimeWarning, stacklevel=4)

    # -- Module ------------------------------------------------------------------
    def update_module(self, module: mx.mod.Module, kvstore: Optional[mx.kv.KVStore] = None) -> bool:
        """Check, then update a bound ``mx.mod.Module`` or skip the step.

        Call after ``module.backward(scaler.out_grads(module.get_outputs()))``
        instead of ``module.update()``.  Checks the gradients of every device,
        sets the optimizer's ``rescale_grad`` to its value at the first call
        divided by :attr:`loss_scale`, calls ``module.update()`` unless there was
        an overflow, and adjusts the scale.  The check happens before the
        module pushes anything to its kvstore, so a skipped step leaves weights
        and optimizer states untouched also with ``update_on_kvstore``.
        **One host sync** when the step is applied.  A skipped step also reads
        the Module's losses (its outputs, except those under ``BlockGrad``):
        when one is not finite, the scale is kept, as :meth:`update` does for
        the losses of :meth:`scale` (host syncs on that path only).

        Parameters
        ----------
        module : mx.mod.Module
        kvstore : KVStore, optional
            A distributed kvstore that summed the gradients before this call
            (:class:`mxamp.ModuleTrainer`'s), through which the workers agree
            whether some worker's loss was not finite.  Not needed when the
            Module's own kvstore sums them.

        Returns
        -------
        bool
            True when the update was applied, False when it was skipped.  A
            disabled scaler calls ``module.update()`` unchecked: always True.

        Raises
        ------
        RuntimeError
            When `module` is not bound for training or has no optimizer, when
            :meth:`out_grads` (or :meth:`scale`) did not run since the last
            update (see :meth:`check_scaled`), and as :meth:`has_overflow`
            raises it with ``update_on_kvstore`` and a distributed kvstore.
        FloatingPointError
            On overflow at `min_scale` with ``at_min_scale='raise'``.  The error
            (or, with ``'warn'``, the warning) names the parameters whose
            gradients hold inf/NaN, as :class:`Trainer` does, and says how to
            find the first layer whose output is not finite.  Also on a loss
            that is not finite, with ``at_min_scale='raise'``; the error (or the
            one warning) says so and how to find the layer.
        """
        # MXNet 1.9.1 Module internals: _exec_group.param_names and .grad_arrays
        # (aligned; per parameter, per device; None for fixed parameters),
        # _optimizer, _kvstore, _update_on_kvstore.
        if not (module.binded and module.optimizer_initialized):
            raise RuntimeError('update_module(): bind the module and call init_optimizer() '
                               'first')
        if not module.for_training:
            raise RuntimeError('update_module(): the module is bound with for_training=False, so '
                               'it has no gradients; bind it with for_training=True to train')
        if not self._enabled:
            self._scaled = False
            module.update()
            return True
        self.check_scaled('update_module()', 'pass the loss scale to backward: '
                          'module.backward(scaler.out_grads(module.get_outputs()))')
        optimizer = module._optimizer
        named_grads = list(zip(module._exec_group.param_names, module._exec_group.grad_arrays))
        grads = [g for _, per_device in named_grads for g in per_device]
        base = self._base_rescale.get(optimizer)
        if base is None:
            base = optimizer.rescale_grad
            self._base_rescale[optimizer] = base
        rescale = base / self._scale
        # The servers learn rescale_grad from the flag only when they run the optimizer.
        overflow = self.has_overflow(grads, kvstore=module._kvstore, rescale_grad=rescale
                                     if module._update_on_kvstore else None)
        if overflow:
            self._losses.extend(_module_losses(module))     # what update() reads
        else:
            optimizer.rescale_grad = rescale
            module.update()
        self.update(overflow, details=lambda: _module_overflow_details(named_grads),
                    loss_details=_module_loss_details, kvstore=kvstore)
        return not overflow

    # -- state -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The scale, its configuration and the counters, as a dict of Python scalars.

        ``'first_descent'``: whether overflows before the first applied step
        descend fast (the default start).  ``'enabled'``: False for a
        disabled scaler.
        """
        return {'loss_scale': self._scale, 'dynamic': self.dynamic, 'enabled': self._enabled,
                'first_descent': self._first_descent,
                'growth_factor': self.growth_factor, 'backoff_factor': self.backoff_factor,
                'growth_interval': self.growth_interval, 'min_scale': self.min_scale,
                'max_scale': self.max_scale, 'at_min_scale': self.at_min_scale,
                'clean_steps': self._clean_steps, 'skipped_steps': self._skipped_steps,
                'steps': self._steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        A disabled scaler ignores `state`, as a disabled ``GradScaler`` does:
        resuming a mixed-precision run's checkpoint without mixed precision.

        Raises
        ------
        KeyError
            When keys are missing (all are named in the message).
        ValueError
            When a value is invalid, and when `state` is from a disabled
            scaler: it has no scale to restore.
        """
        if not self._enabled:
            return
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise KeyError('LossScaler.load_state_dict(): missing keys %s' % ', '.join(missing))
        if not state['enabled']:
            raise ValueError('LossScaler.load_state_dict(): the state is from a disabled scaler '
                             '(enabled=False), which has no loss scale to restore; create this '
                             'one with enabled=False too, or start it afresh')
        self._configure(state)
        self._clean_steps = int(state['clean_steps'])
        self._skipped_steps = int(state['skipped_steps'])
        self._steps = int(state['steps'])


def _nonfinite_gradients_text(find_names: Callable[[], Sequence[str]], total: int) -> str:
    """What overflowed, for the error at the loss scale's floor (host syncs).

    `find_names()` returns the names of the parameters with non-finite
    gradients (one of mxamp.diagnose's), out of `total` parameters.  Returns
    ``'.  Parameters with inf/NaN gradients (2 of 6): a, b'``, at most ten names.
    """
    try:
        names = find_names()
    except Exception as err:   # never hide the overflow behind a diagnosis error
        return '.  Could not read the gradients (%s)' % (err,)
    shown = ', '.join(names[:10]) + (', ...' if len(names) > 10 else '')
    return ('.  Parameters with inf/NaN gradients (%d of %d): %s'
            % (len(names), total, shown or 'none'))


def _nonfinite_loss_text(where: str, keep_fp32: str) -> str:
    """The end of the message about a loss that is not finite: `where` it starts, the
    usual cause and its remedies, `keep_fp32` naming how to keep a block in FP32."""
    return ('.  %s.  A common cause in float16 (largest finite value 65504): a fill such as '
            '-1e9 or -1e18 for masked positions (attention) becomes -inf, and 0 * -inf or a '
            'softmax over a fully masked row is NaN; use a finite fill such as -1e4, or keep '
            'the block that computes it in FP32 with %s' % (where, keep_fp32))


def _default_loss_details():
    return _nonfinite_loss_text(
        'To find the first layer whose output is not finite, call '
        'mxamp.diagnose.first_nonfinite_output(net, *inputs) with the inputs of that batch',
        'mxamp.convert(net, dtype, exclude=[block]) or mxamp.convert_symbol(sym, dtype, '
        'exclude=[node])')


def _module_loss_details():
    return _nonfinite_loss_text(
        'To find the first layer whose output is not finite, call '
        'mxamp.diagnose.first_nonfinite_output(module.symbol, *inputs, arg_params=arg, '
        'aux_params=aux) with the inputs of that batch and arg, aux = module.get_params()',
        'mxamp.convert_symbol(sym, dtype, exclude=[node])')


def _module_losses(module):
    """The outputs of `module` that take head gradients, on every device: the losses.

    Outputs under ``BlockGrad`` (logits for metrics) are left out, also behind
    the cast to FP32 that a converted graph may add.  No copy, no host sync.
    """
    graph = json.loads(module.symbol.tojson(remove_amp_cast=False))
    nodes = graph['nodes']
    ops = registered_ops()

    def op_of(node):
        return ops.get(node['op'], node['op'])     # variables ('null') are no operator
    losses = []
    for (nid, _, _), per_device in zip(graph['heads'],
                                       module.get_outputs(merge_multi_context=False)):
        node = nodes[nid]
        while op_of(node) in CAST_OPS:
            node = nodes[node['inputs'][0][0]]
        if op_of(node) != 'BlockGrad':
            losses.extend(per_device)
    return losses


def _module_overflow_details(named_grads):
    """:meth:`LossScaler.update_module`'s text for the error at the floor (host syncs).

    `named_grads`: (parameter name, its gradient on every device) pairs;
    Module leaves the gradients of fixed parameters unallocated (None).
    """
    allocated = [(name, grads) for name, grads in named_grads
                 if not any(g is None for g in grads)]
    return _nonfinite_gradients_text(lambda: diagnose.nonfinite_named_gradients(allocated),
                                     len(named_grads)) + (
        '.  To find the first layer whose output is not finite, call '
        'mxamp.diagnose.first_nonfinite_output(module.symbol, *inputs, arg_params=arg, '
        'aux_params=aux) with the inputs of an overflowing batch and arg, aux = '
        'module.get_params()')


class LossScalingState(object):
    """What a trainer tells about its loss scaling, read from its `_loss_scaler`.

    Shared by :class:`mxamp.Trainer` and :class:`mxamp.ModuleTrainer`.
    """

    _loss_scaler: Optional[LossScaler] = None

    @property
    def loss_scaler(self) -> Optional[LossScaler]:
        """The :class:`LossScaler`, or None when loss scaling is off."""
        return self._loss_scaler

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when scaling is off).  No host sync."""
        return 1.0 if self._loss_scaler is None else self._loss_scaler.loss_scale

    @property
    def skipped_steps(self) -> int:
        """Number of steps skipped because of inf/NaN gradients."""
        return 0 if self._loss_scaler is None else self._loss_scaler.skipped_steps


def make_loss_scaler(loss_scale: Union[str, float, LossScaler, None],
                     trainable_dtypes: Iterable[Optional[DTypeLike]]) -> Optional[LossScaler]:
    """The LossScaler (or None) for a trainer's `loss_scale` argument.

    ``'auto'`` is dynamic when one of `trainable_dtypes` (the dtypes or precision
    names of the trainable parameters) is float16, off otherwise; a number is a
    fixed scale.  A disabled LossScaler (``enabled=False``) is no loss scaling,
    None: the trainers then take the paths of ``loss_scale=None`` (no overflow
    check, no host sync), as torch's optimizer step runs unchecked under a
    disabled ``GradScaler``.
    """
    if isinstance(loss_scale, LossScaler):
        return loss_scale if loss_scale.is_enabled() else None
    if loss_scale is None:
        return None
    if isinstance(loss_scale, str):
        if loss_scale == 'dynamic':
            return LossScaler()
        if loss_scale == 'auto':
            if any(precision_name(dtype) == 'float16' for dtype in trainable_dtypes):
                return LossScaler()
            return None
        raise ValueError("loss_scale must be 'auto', 'dynamic', a positive number, None or a "
                         "LossScaler, got %r" % (loss_scale,))
    if isinstance(loss_scale, bool):
        raise ValueError('loss_scale must be a positive number, not a bool')
    return LossScaler(init_scale=_positive('loss_scale', loss_scale), dynamic=False)
