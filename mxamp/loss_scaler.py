"""Dynamic or fixed loss scaling with skip-on-overflow, for Gluon and ``mx.mod.Module``.

Owns :class:`LossScaler`: the scale and its schedule, the overflow check of gradients on any
contexts and dtypes (one host sync; distributed workers agree through
:func:`mxamp.kvkeys.agree_overflow`), the check of a skipped step's loss, the check that
gradients were scaled, its state, and a Module's step.  :class:`mxamp.Trainer` drives one.

MXNet internals relied on (MXNet 1.9.1):

* ``mx.mod.Module`` (:meth:`LossScaler.update_module`): ``_exec_group``'s ``param_names`` and
  ``grad_arrays`` (the gradients, per device), ``_optimizer`` (its ``rescale_grad`` takes the
  loss scale), ``_kvstore`` and ``_update_on_kvstore``; ``symbol`` and
  ``get_outputs(merge_multi_context=False)`` (the losses: outputs not under ``BlockGrad``).
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

# The name users configure, shared with mxamp.trainer.
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
    """Refuse a non-bool `overflow`: a scale, as ``GradScaler.update(new_scale)`` takes, would
    read as "overflow" and cut the scale, silently."""
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
    """Per-context all-finite flags (float32, shape (1,), 1.0 when finite); no host sync.

    Grouped by context and dtype: ``multi_all_finite`` reads every input in its first one's
    dtype and rejects bfloat16.  On a CPU, ``multi_sum_sq`` on FP32 copies (it adds float16 in
    float16 and rejects bfloat16), then ``multi_all_finite`` on the sums: much faster there
    (docs/performance.rst).  A sum past float32's range (elements near 1e19) counts too.
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
    """Arrays full of `value`, like `outputs`, for ``Module.backward(out_grads=...)``; kept in
    `cache` (the caller's) while `value` holds.  No host sync."""
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

    Multiply the loss by :attr:`loss_scale` before ``backward`` (:meth:`scale`,
    :meth:`out_grads`), undo it through the optimizer's ``rescale_grad``, check the gradients
    (:meth:`has_overflow`), skip the update on inf/NaN and report with :meth:`update`.  A
    dynamic scale changes by `backoff_factor` on overflow and `growth_factor` after
    `growth_interval` clean steps, from the next step on.  It starts at 2**16 and, until a step
    is applied, divides by 16 on overflow: MXNet sums per-sample gradients (docs/training.rst,
    "The loss scale's start").  A skipped step whose loss is not finite keeps the scale
    (docs/troubleshooting.rst).  The rules follow agreed verdicts: workers keep one scale.
    For ``torch.amp`` users: docs/migrating-torch-amp.rst.

    Parameters
    ----------
    init_scale : float, optional
        Start (fixed scale with ``dynamic=False``); given, no fast first descent.
    dynamic : bool, default True
        False: a fixed scale; overflowing steps are still skipped.
    growth_factor, backoff_factor : float, default 2.0 and 0.5
    growth_interval : int, default 2000
    min_scale, max_scale : float, default 1.0 and 2**24
    at_min_scale : {'warn', 'raise', 'ignore'}, default 'warn'
        When scaling cannot fix a skipped step (overflow at `min_scale`, a loss not finite):
        ``RuntimeWarning`` (once per scaler for a loss), ``FloatingPointError``, or nothing.
    on_overflow : callable, optional
        Called with an :class:`OverflowInfo` after every skipped step (also logged at INFO).
    enabled : bool, default True
        False: a scaler that does nothing, as ``GradScaler(enabled=False)`` (the other
        arguments are still checked); a trainer given one trains without loss scaling.

    Examples
    --------
    >>> scaler = mxamp.LossScaler()
    >>> scaler.set_scale(1024.0)
    >>> scaler.get_scale(), scaler.is_enabled(), mxamp.LossScaler(enabled=False).get_scale()
    (1024.0, True, 1.0)
    """

    #: The start without `init_scale`, and the largest factor of its first descent.
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
        self._scaled = False
        self._losses: List[mx.nd.NDArray] = []   # what scale() received since the last update()
        # (dist kvstore, rescale_grad) of this step's verdict
        self._agreement: Optional[Tuple[mx.kv.KVStore, Optional[float]]] = None
        self._loss_warned = False
        self._out_grads: Dict[Any, Tuple[float, mx.nd.NDArray]] = {}
        self._base_rescale: weakref.WeakKeyDictionary[mx.optimizer.Optimizer, float] = \
            weakref.WeakKeyDictionary()
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

    @property
    def loss_scale(self) -> float:
        """The current loss scale (a Python float; no host sync)."""
        return self._scale

    def get_scale(self) -> float:
        """:attr:`loss_scale` (``GradScaler.get_scale()``; 1.0 when disabled).  No host sync."""
        return self._scale

    def is_enabled(self) -> bool:
        """Whether this scaler scales at all (``enabled=``)."""
        return self._enabled

    def set_scale(self, value: float) -> None:
        """Use `value` as the loss scale from the next step (``GradScaler.update(new_scale)``).

        As a new `init_scale`: no fast first descent, clean steps counted afresh; step counters
        go on.  A disabled scaler keeps 1.0.  No host sync.

        Raises
        ------
        ValueError
            When `value` is not a positive finite number or is outside dynamic bounds.
        RuntimeError
            Between :meth:`scale` (or :meth:`out_grads`) and the step, whose gradients carry
            the current scale.
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
        """Refuse to unscale gradients that were never scaled (the update would shrink silently):
        ``RuntimeError`` naming `caller` and `remedy`, unless :meth:`scale` or :meth:`out_grads`
        ran since :meth:`update` or the scale is fixed at 1.  No host sync."""
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

    def scale(self, loss: Union[mx.nd.NDArray, List[mx.nd.NDArray], Tuple[mx.nd.NDArray, ...]]
              ) -> Union[mx.nd.NDArray, List[mx.nd.NDArray], Tuple[mx.nd.NDArray, ...]]:
        """`loss` (NDArray, list or tuple) times :attr:`loss_scale`, recorded by autograd.

        Kept by reference until :meth:`update`, which reads it on a skipped step.  No host sync.
        A disabled scaler returns `loss`."""
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
        """Head gradients equal to :attr:`loss_scale`, like `outputs` (losses), for
        ``Module.backward(out_grads=...)``; cached while the scale holds.  No host sync."""
        self._scaled = True
        return head_gradients(outputs, self._scale, self._out_grads)

    def has_overflow(self, arrays: Iterable[mx.nd.NDArray], kvstore: Optional[mx.kv.KVStore] = None,
                     rescale_grad: Optional[float] = None) -> bool:
        """True when any of `arrays` holds an inf or NaN.  **One host sync** (none if disabled).

        Parameters
        ----------
        arrays : list of NDArray
            Gradients, on any contexts, in any dtypes (row_sparse: their values).
        kvstore : KVStore, optional
            A distributed one makes the workers agree, so all skip the same steps.
        rescale_grad : float, optional
            Only when the servers run the optimizer: they adopt it.  ``RuntimeError`` when
            they run no mxamp optimizer.
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
            # update() agrees on the loss check through the same kvstore.
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

        A skipped step whose loss (from :meth:`scale`) is not finite keeps the scale.  No host
        sync on an applied step; on a skipped one, one per kept loss and, distributed, one
        ``pushpull``: every worker calls this on the same steps.  Disabled: changes nothing.

        Parameters
        ----------
        overflow : bool
            Whether the step was skipped for inf/NaN gradients; required; not a scale.
        details, loss_details : callable, optional
            Return text for the message on overflow at `min_scale`, and on a loss not
            finite; called only then.
        kvstore : KVStore, optional
            Where workers agree on the loss; default: :meth:`has_overflow`'s this step.

        Raises
        ------
        TypeError
            When `overflow` is not a bool; the message names :meth:`set_scale`.
        FloatingPointError
            With ``at_min_scale='raise'``, on overflow at `min_scale` and on a loss not finite.
        """
        _check_overflow_flag(overflow)
        losses, self._losses = self._losses, []
        agreement, self._agreement = self._agreement, None
        if not self._enabled:
            self._scaled = False
            return
        # Losses first: a failed agreement must not leave the counters half updated.
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
            # The counters follow agreed verdicts: every worker takes this branch alike.
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
        """None, ``'here'`` or ``'another worker'``: where a loss is not finite.  Host syncs."""
        agreed_kvstore, agreed_rescale = agreement or (None, None)
        if kvstore is None:
            kvstore = agreed_kvstore
        bad = sum(not np.isfinite(to_float32_numpy(loss)).all() for loss in losses)
        if kvstore is not None and 'dist' in kvstore.type:
            # Servers running the optimizer adopt the rescale_grad sent: resend this step's.
            anywhere = kvkeys.agree_overflow(
                kvstore, mx.nd.array([bad], ctx=mx.cpu()),
                agreed_rescale if kvstore is agreed_kvstore else None, self._flag_kvstores)
        else:
            anywhere = bad > 0
        if not anywhere:
            return None
        return 'here' if bad else 'another worker'

    def _report_nonfinite_loss(self, where, loss_details):
        """Log a skipped step whose loss is not finite; warn once, or raise."""
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

    def update_module(self, module: mx.mod.Module, kvstore: Optional[mx.kv.KVStore] = None) -> bool:
        """Check, then update a bound ``mx.mod.Module`` or skip the step.

        Call after ``module.backward(scaler.out_grads(module.get_outputs()))`` instead of
        ``module.update()``.  Sets the optimizer's ``rescale_grad`` to its first value over
        :attr:`loss_scale`; the check precedes any push, so a skipped step changes nothing.
        **One host sync**; a skipped step also reads the losses, as :meth:`update`.
        `kvstore`: a distributed one that summed the gradients (:class:`mxamp.ModuleTrainer`).

        Returns
        -------
        bool
            True when applied (always, for a disabled scaler), False when skipped.

        Raises
        ------
        RuntimeError
            On a module unbound or without optimizer, as :meth:`check_scaled` and
            :meth:`has_overflow`.
        FloatingPointError
            As :meth:`update`; the message names the parameters with inf/NaN gradients.
        """
        # _exec_group.param_names and .grad_arrays: aligned, per device, None when fixed.
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
        overflow = self.has_overflow(grads, kvstore=module._kvstore, rescale_grad=rescale
                                     if module._update_on_kvstore else None)
        if overflow:
            self._losses.extend(_module_losses(module))
        else:
            optimizer.rescale_grad = rescale
            module.update()
        self.update(overflow, details=lambda: _module_overflow_details(named_grads),
                    loss_details=_module_loss_details, kvstore=kvstore)
        return not overflow

    def state_dict(self) -> Dict[str, Any]:
        """The scale, configuration and counters, as Python scalars."""
        return {'loss_scale': self._scale, 'dynamic': self.dynamic, 'enabled': self._enabled,
                'first_descent': self._first_descent,
                'growth_factor': self.growth_factor, 'backoff_factor': self.backoff_factor,
                'growth_interval': self.growth_interval, 'min_scale': self.min_scale,
                'max_scale': self.max_scale, 'at_min_scale': self.at_min_scale,
                'clean_steps': self._clean_steps, 'skipped_steps': self._skipped_steps,
                'steps': self._steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a disabled scaler ignores it).

        Raises ``KeyError`` naming missing keys, ``ValueError`` on an invalid value or a
        disabled scaler's state."""
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
    """``'.  Parameters with inf/NaN gradients (2 of 6): a, b'``: `find_names()` of `total`."""
    try:
        names = find_names()
    except Exception as err:   # never hide the overflow behind a diagnosis error
        return '.  Could not read the gradients (%s)' % (err,)
    shown = ', '.join(names[:10]) + (', ...' if len(names) > 10 else '')
    return ('.  Parameters with inf/NaN gradients (%d of %d): %s'
            % (len(names), total, shown or 'none'))


def _nonfinite_loss_text(where: str, keep_fp32: str) -> str:
    """The end of the message on a loss not finite: `where` it starts, cause, remedies."""
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
    """The outputs of `module` not under ``BlockGrad`` (behind casts too), on every device."""
    graph = json.loads(module.symbol.tojson(remove_amp_cast=False))
    nodes = graph['nodes']
    ops = registered_ops()

    def op_of(node):
        return ops.get(node['op'], node['op'])
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
    """:meth:`LossScaler.update_module`'s text at the floor (host syncs); fixed ones: None."""
    allocated = [(name, grads) for name, grads in named_grads
                 if not any(g is None for g in grads)]
    return _nonfinite_gradients_text(lambda: diagnose.nonfinite_named_gradients(allocated),
                                     len(named_grads)) + (
        '.  To find the first layer whose output is not finite, call '
        'mxamp.diagnose.first_nonfinite_output(module.symbol, *inputs, arg_params=arg, '
        'aux_params=aux) with the inputs of an overflowing batch and arg, aux = '
        'module.get_params()')


class LossScalingState(object):
    """A trainer's loss-scaling properties, read from its `_loss_scaler`."""

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
    """The LossScaler, or None, for a trainer's `loss_scale`: ``'auto'`` is dynamic when one of
    `trainable_dtypes` is float16; a number is fixed; a disabled scaler is None (no check)."""
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
