"""Loss scaling and the mixed-precision ``Trainer``.

This module owns:

* :class:`LossScaler`, the dynamic (or fixed) loss scaler.  It works on its own,
  with Gluon or with ``mx.mod.Module`` (see :meth:`LossScaler.update_module`);
* :class:`Trainer`, a ``gluon.Trainer`` with FP32 master weights
  (:mod:`mxamp.optimizer`) and a :class:`LossScaler` built in.

A training loop changes by two lines::

    trainer = mxamp.Trainer(net.collect_params(), 'sgd',
                            {'learning_rate': 0.1, 'momentum': 0.9})
    with autograd.record():
        loss = loss_fn(net(x), y)
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    applied = trainer.step(batch_size)     # False when skipped for overflow

What it does differently from ``mxnet.contrib.amp``
---------------------------------------------------
* Unscaling is free: ``1 / loss_scale`` is folded into the optimizer's
  ``rescale_grad``, which every update kernel already applies.
* The overflow check covers every gradient on every context, using the fused
  ``multi_all_finite`` operator (chunks of at most 200 arrays: MXNet 1.9.1
  crashes with more), with a single host synchronisation per step.
* A skipped step changes nothing: weights, master weights and optimizer states
  stay bit-identical, also with ``update_on_kvstore=True`` (the check runs
  before any gradient is pushed) and with distributed kvstores (the workers
  agree through a one-element-per-worker allreduce before pushing).
* Gradient clipping (:meth:`Trainer.clip_global_norm`) takes the global norm
  in FP32 over gradients of mixed dtypes, reports it unscaled, and folds the
  clipping factor into ``rescale_grad`` too; its one host sync replaces the
  step's overflow check.
* The new scale is used from the very next step, and the scaler's state is part
  of ``save_states`` / ``load_states`` and ``state_dict``.
* bfloat16 parameters train with distributed kvstores: MXNet 1.9.1's servers
  abort on bfloat16, so their values and gradients cross the kvstore in FP32.
* Overflow at the minimum loss scale raises (or warns) with the names of the
  parameters whose gradients are inf/NaN, and, with ``diagnose_net=net``, the
  first layer whose output is not finite.
* Nothing is monkey-patched: MXNet is left exactly as it was.

MXNet internals relied on (MXNet 1.9.1):

* ``gluon.Trainer``: ``_params`` (the parameters in kvstore-key order: what
  is checked, reduced and reported), ``_param2idx`` (a parameter's key, for the
  FP32 broadcast of bfloat16 values), ``_params_to_init`` and ``_init_params``
  (the initial broadcast, overridden to send bfloat16 as FP32 and to wait for
  the pulls), ``_kv_initialized`` and ``_init_kvstore`` (the lazy kvstore,
  created before the first check), ``_allreduce_grads`` (overridden: bfloat16
  gradients through FP32), ``_update`` (the per-context updaters, run only
  after the verdict), ``_check_and_rescale_grad`` and ``_optimizer`` (the
  loss scale folded into ``rescale_grad``), ``_scale`` (the ``rescale_grad``
  the optimizer came with), ``_kvstore``, ``_update_on_kvstore`` and
  ``_distributed`` (which path a step takes, and where the workers agree);
* ``gluon.Parameter``: ``_data`` (None before initialisation),
  ``_deferred_init`` (shape still unknown), ``_stype`` (only dense bfloat16
  crosses the kvstore as FP32) and ``_check_and_get`` (the arrays of every
  context, for that broadcast);
* ``NDArray._fresh_grad``: gluon's stale-gradient flag, set by backward (how
  :meth:`Trainer.clip_global_norm` knows that backward ran) and reset by a
  skipped step as by an applied one;
* ``mx.mod.Module`` (:meth:`LossScaler.update_module`): ``_exec_group``'s
  ``param_names`` and ``grad_arrays`` (the gradients to check, per device),
  ``_optimizer`` (its ``rescale_grad`` takes the loss scale), ``_kvstore`` and
  ``_update_on_kvstore`` (the agreement between workers).
"""
import collections
import contextlib
import logging
import math
import os
import pickle
import warnings
import weakref

import numpy as np

import mxnet as mx
from mxnet import autograd, gluon

from . import diagnose, kvkeys
from . import optimizer as _mp_optimizer
from .dtypes import BFLOAT16, LOW_PRECISION, amp_cast, cast_into, dtype_name, widen

__all__ = ['LossScaler', 'OverflowInfo', 'Trainer']

_LOG = logging.getLogger(__name__)

#: multi_all_finite in MXNet 1.9.1 takes at most 200 arrays (201 segfaults).
_MAX_FINITE_ARRAYS = 200

#: What :class:`LossScaler` passes to its ``on_overflow`` callback.
OverflowInfo = collections.namedtuple(
    'OverflowInfo', ['step', 'loss_scale', 'next_loss_scale', 'skipped_steps'])

_STATE_KEYS = ('loss_scale', 'dynamic', 'growth_factor', 'backoff_factor', 'growth_interval',
               'min_scale', 'max_scale', 'at_min_scale', 'clean_steps', 'skipped_steps', 'steps')

_FILE_MAGIC = b'MXAMP-TRAINER-STATES v1\n'


def _positive(name, value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError('%s must be a positive finite number, got %r' % (name, value))
    if not (math.isfinite(value) and value > 0):
        raise ValueError('%s must be a positive finite number, got %r' % (name, value))
    return value


def _flat_grads(arrays):
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

    * float16 and float32 on GPU, float16 on CPU: ``multi_all_finite``.
    * float32 and bfloat16 on CPU: ``multi_sum_sq`` (bfloat16 cast to float32
      first), then ``multi_all_finite`` on the per-array sums.  On CPU, MXNet
      1.9.1's ``multi_all_finite`` is about 9x slower than ``multi_sum_sq``
      (measured: 270 ms vs 32 ms for 34M float32 elements).  A sum of squares
      is non-finite when any element is, and also when it exceeds float32's
      range (elements around 1e19): such gradients count as overflow too.
    """
    groups = collections.OrderedDict()
    for arr in arrays:
        groups.setdefault(arr.context, collections.OrderedDict()) \
              .setdefault(arr.dtype, []).append(arr)
    flags = []
    for ctx, by_dtype in groups.items():
        flag = mx.nd.ones((1,), ctx=ctx, dtype=np.float32)
        for dtype, group in by_dtype.items():
            sum_sq = ctx.device_type == 'cpu' and dtype in (np.float32, BFLOAT16)
            for start in range(0, len(group), _MAX_FINITE_ARRAYS):
                chunk = group[start:start + _MAX_FINITE_ARRAYS]
                if dtype == BFLOAT16:
                    chunk = [widen(a) for a in chunk]
                if sum_sq:
                    chunk = [mx.nd.multi_sum_sq(*chunk, num_arrays=len(chunk))]
                mx.nd.multi_all_finite(*chunk, num_arrays=len(chunk), init_output=False,
                                       out=flag)
        flags.append(flag)
    return flags


def _sum_of_squares(arrays):
    """The sum of the squares of every element of `arrays`, in FP32; no host sync.

    Returns a float32 NDArray of shape (1,) on the context of the first array.
    Each array is read by one ``dot`` with itself (BLAS: several partial sums,
    so the rounding error stays small; MXNet 1.9.1's ``multi_sum_sq``
    accumulates serially and is off by about 1e-3 on a 2M-element gradient).
    float16 and bfloat16 arrays are widened to float32 one at a time first:
    MXNet's CPU ``dot`` only takes float32 and float64.  The sum is non-finite
    when an element is, and also when it exceeds float32's range (elements
    around 1e19).
    """
    home = arrays[0].context
    parts = []
    for arr in arrays:
        flat = arr.reshape((-1,))
        if flat.dtype != np.float32:
            flat = widen(flat)
        parts.append(mx.nd.dot(flat, flat).as_in_context(home))
    return mx.nd.add_n(*parts)


def _context_sum(grads):
    """The sum of one parameter's gradients over its contexts, on the first; no host sync.

    Dense low-precision gradients are summed in float32, so that the sum of
    finite float16 gradients cannot overflow.
    """
    if len(grads) == 1:
        return grads[0]
    home = grads[0].context
    if grads[0].stype == 'default':
        grads = [g if g.dtype == np.float32 else widen(g) for g in grads]
    return mx.nd.add_n(*[g.as_in_context(home) for g in grads])


class LossScaler(object):
    """Dynamic or fixed loss scaling with skip-on-overflow.

    Multiply the loss by :attr:`loss_scale` before ``backward`` (:meth:`scale`
    or :meth:`out_grads`), undo it in the optimizer through ``rescale_grad``,
    check the gradients for inf/NaN (:meth:`has_overflow`), skip the update if
    any is found and report the outcome with :meth:`update`.  A dynamic scaler
    multiplies the scale by `backoff_factor` on every overflow and by
    `growth_factor` after `growth_interval` consecutive clean steps; the new
    scale applies from the very next step.

    :class:`Trainer` drives a scaler for Gluon; :meth:`update_module` does the
    same for ``mx.mod.Module``.

    Parameters
    ----------
    init_scale : float, default 2**16
        Initial (or, with ``dynamic=False``, fixed) loss scale.
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
        What to do on an overflow when the scale is already `min_scale`: warn
        (``RuntimeWarning``), raise ``FloatingPointError`` (after skipping the
        step and counting it), or do nothing.  Persistent overflow at the floor
        usually means the model itself produces inf/NaN.
    on_overflow : callable, optional
        Called as ``on_overflow(info)`` after every skipped step, with an
        :class:`OverflowInfo` ``(step, loss_scale, next_loss_scale,
        skipped_steps)``.  Skips are also logged at INFO level on the
        ``mxamp.trainer`` logger.

    Examples
    --------
    With ``mx.mod.Module``: let the symbol's output be the per-sample loss
    itself (no ``SoftmaxOutput``/``MakeLoss`` head: those ignore head
    gradients), give the scaled head gradients to ``backward`` and let the
    scaler run the update:

    >>> fc = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=1, name='fc')
    >>> loss = mx.sym.square(mx.sym.reshape(fc, (-1,)) - mx.sym.var('label'))
    >>> mod = mx.mod.Module(loss, data_names=['data'], label_names=['label'])
    >>> mod.bind(data_shapes=[('data', (8, 4))], label_shapes=[('label', (8,))])
    >>> mod.init_params()
    >>> mod.init_optimizer(optimizer=mxamp.optimizer.create(
    ...     'sgd', learning_rate=0.1, rescale_grad=1.0 / 8))
    >>> scaler = mxamp.trainer.LossScaler()
    >>> for batch in train_iter:
    ...     mod.forward(batch, is_train=True)
    ...     mod.backward(scaler.out_grads(mod.get_outputs()))
    ...     applied = scaler.update_module(mod)     # False: step skipped
    """

    def __init__(self, init_scale=2.0 ** 16, dynamic=True, growth_factor=2.0,
                 backoff_factor=0.5, growth_interval=2000, min_scale=1.0,
                 max_scale=2.0 ** 24, at_min_scale='warn', on_overflow=None):
        self._configure(dict(loss_scale=init_scale, dynamic=dynamic,
                             growth_factor=growth_factor, backoff_factor=backoff_factor,
                             growth_interval=growth_interval, min_scale=min_scale,
                             max_scale=max_scale, at_min_scale=at_min_scale))
        if on_overflow is not None and not callable(on_overflow):
            raise TypeError('on_overflow must be callable, got %r' % (on_overflow,))
        self.on_overflow = on_overflow
        self._clean_steps = 0
        self._skipped_steps = 0
        self._steps = 0
        self._scaled = False        # scale() or out_grads() since the last update()
        self._out_grads = {}
        self._base_rescale = weakref.WeakKeyDictionary()
        self._flag_kvstores = weakref.WeakKeyDictionary()   # overflow key initialised there

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

    # -- public state --------------------------------------------------------
    @property
    def loss_scale(self):
        """The current loss scale (a Python float; no host sync)."""
        return self._scale

    @property
    def skipped_steps(self):
        """Number of steps skipped because of overflow."""
        return self._skipped_steps

    @property
    def steps(self):
        """Number of steps reported to :meth:`update` (applied or skipped)."""
        return self._steps

    @property
    def clean_steps(self):
        """Consecutive overflow-free steps since the scale last changed or overflowed."""
        return self._clean_steps

    @property
    def scaled_since_update(self):
        """Whether :meth:`scale` or :meth:`out_grads` ran since the last :meth:`update`."""
        return self._scaled

    def check_scaled(self, caller, remedy):
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
        if self._scaled or (not self.dynamic and self._scale == 1.0):
            return
        raise RuntimeError('%s: the gradients were not computed from a scaled loss since the '
                           'last step, so dividing them by the loss scale %g would shrink the '
                           'update %g times; %s' % (caller, self._scale, self._scale, remedy))

    def __repr__(self):
        return ('LossScaler(loss_scale=%g, dynamic=%s, skipped_steps=%d, steps=%d)'
                % (self._scale, self.dynamic, self._skipped_steps, self._steps))

    # -- scaling ---------------------------------------------------------------
    def scale(self, loss):
        """`loss` times :attr:`loss_scale` (an NDArray, or a list/tuple of them).

        Recorded by autograd (opens a ``record`` scope if none is active), so
        ``backward`` on the result gives scaled gradients.  Marks the step as
        scaled (see :meth:`check_scaled`).  No host sync.
        """
        self._scaled = True
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale(item) for item in loss)
        if not isinstance(loss, mx.nd.NDArray):
            raise TypeError('scale() expects an NDArray or a list of NDArrays, got %r'
                            % (type(loss),))
        if autograd.is_recording():
            return loss * self._scale
        with autograd.record():
            return loss * self._scale

    def out_grads(self, outputs):
        """Head gradients equal to :attr:`loss_scale`, shaped like `outputs`.

        For ``Module.backward(out_grads=...)`` when the symbol's outputs are
        losses.  The arrays are cached and reused while the scale is unchanged.
        Marks the step as scaled (see :meth:`check_scaled`).  No host sync.
        """
        self._scaled = True
        result = []
        for out in outputs:
            key = (out.shape, out.context, np.dtype(out.dtype).str
                   if out.dtype != BFLOAT16 else 'bf16')
            cached = self._out_grads.get(key)
            if cached is None or cached[0] != self._scale:
                grad = mx.nd.full(out.shape, self._scale, ctx=out.context, dtype=np.float32)
                if out.dtype != np.float32:
                    grad = mx.nd.amp_cast(grad, dtype=out.dtype)
                cached = (self._scale, grad)
                self._out_grads[key] = cached
            result.append(cached[1])
        return result

    # -- overflow ----------------------------------------------------------------
    def has_overflow(self, arrays, kvstore=None, rescale_grad=None):
        """True when any of `arrays` holds an inf or NaN.  **One host sync.**

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
        flags = _finite_flags(_flat_grads(arrays))
        if kvstore is not None and 'dist' in kvstore.type:
            cpu = mx.cpu()
            bad = mx.nd.zeros((1,), ctx=cpu)
            for flag in flags:
                bad += 1.0 - flag.as_in_context(cpu)
            return kvkeys.agree_overflow(kvstore, bad, rescale_grad, self._flag_kvstores)
        if not flags:
            return False
        if len(flags) == 1:
            return flags[0].asscalar() != 1.0
        gathered = mx.nd.concat(*[f.as_in_context(mx.cpu()) for f in flags], dim=0)
        return bool((gathered.asnumpy() != 1.0).any())

    def update(self, overflow, details=None):
        """Record the outcome of a step and adjust the scale.  No host sync.

        Parameters
        ----------
        overflow : bool
            Whether the step was skipped because of inf/NaN gradients.
        details : callable, optional
            Called with no argument only when an overflow happens at
            `min_scale` (and ``at_min_scale`` is not ``'ignore'``); the string
            it returns is appended to the error or warning.  :class:`Trainer`
            and :meth:`update_module` use it to name the parameters with
            inf/NaN gradients (host syncs, on that path only).

        Raises
        ------
        FloatingPointError
            On overflow at `min_scale` with ``at_min_scale='raise'``.
        """
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
        self._clean_steps = 0
        old = self._scale
        at_floor = self.dynamic and old <= self.min_scale
        if self.dynamic:
            self._scale = max(old * self.backoff_factor, self.min_scale)
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

    # -- Module ------------------------------------------------------------------
    def update_module(self, module):
        """Check, then update a bound ``mx.mod.Module`` or skip the step.

        Call after ``module.backward(scaler.out_grads(module.get_outputs()))``
        instead of ``module.update()``.  Checks the gradients of every device,
        sets the optimizer's ``rescale_grad`` to its value at the first call
        divided by :attr:`loss_scale`, calls ``module.update()`` unless there was
        an overflow, and adjusts the scale.  The check happens before the
        module pushes anything to its kvstore, so a skipped step leaves weights
        and optimizer states untouched also with ``update_on_kvstore``.
        **One host sync.**

        Returns
        -------
        bool
            True when the update was applied, False when it was skipped.

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
            find the first layer whose output is not finite.
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
        self.check_scaled('update_module()', 'pass the loss scale to backward: '
                          'module.backward(scaler.out_grads(module.get_outputs()))')
        optimizer = module._optimizer
        kvstore = module._kvstore
        named_grads = list(zip(module._exec_group.param_names, module._exec_group.grad_arrays))
        grads = [g for _, per_device in named_grads for g in per_device]
        base = self._base_rescale.get(optimizer)
        if base is None:
            base = optimizer.rescale_grad
            self._base_rescale[optimizer] = base
        rescale = base / self._scale
        # The servers learn rescale_grad from the flag only when they run the optimizer.
        overflow = self.has_overflow(grads, kvstore=kvstore, rescale_grad=rescale
                                     if module._update_on_kvstore else None)
        if not overflow:
            optimizer.rescale_grad = rescale
            module.update()
        self.update(overflow, details=lambda: _module_overflow_details(named_grads))
        return not overflow

    # -- state -------------------------------------------------------------------
    def state_dict(self):
        """The scale, its configuration and the counters, as a dict of Python scalars."""
        return {'loss_scale': self._scale, 'dynamic': self.dynamic,
                'growth_factor': self.growth_factor, 'backoff_factor': self.backoff_factor,
                'growth_interval': self.growth_interval, 'min_scale': self.min_scale,
                'max_scale': self.max_scale, 'at_min_scale': self.at_min_scale,
                'clean_steps': self._clean_steps, 'skipped_steps': self._skipped_steps,
                'steps': self._steps}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned.

        Raises
        ------
        KeyError
            When keys are missing (all are named in the message).
        ValueError
            When a value is invalid.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise KeyError('LossScaler.load_state_dict(): missing keys %s' % ', '.join(missing))
        self._configure(state)
        self._clean_steps = int(state['clean_steps'])
        self._skipped_steps = int(state['skipped_steps'])
        self._steps = int(state['steps'])


def _nonfinite_gradients_text(find_names, total):
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


def _precision(dtype):
    """'float16', 'bfloat16', 'float32' or None (other dtypes)."""
    try:
        return dtype_name(dtype)
    except ValueError:
        return None


def _as_param_list(params):
    if isinstance(params, (dict, gluon.ParameterDict)):
        return list(params.values())
    return list(params)


def make_loss_scaler(loss_scale, trainable_dtypes):
    """The LossScaler (or None) for a trainer's `loss_scale` argument.

    ``'auto'`` is dynamic when one of `trainable_dtypes` (the dtypes of the
    trainable parameters) is float16, off otherwise; a number is a fixed scale.
    """
    if isinstance(loss_scale, LossScaler):
        return loss_scale
    if loss_scale is None:
        return None
    if isinstance(loss_scale, str):
        if loss_scale == 'dynamic':
            return LossScaler()
        if loss_scale == 'auto':
            if any(_precision(dtype) == 'float16' for dtype in trainable_dtypes):
                return LossScaler()
            return None
        raise ValueError("loss_scale must be 'auto', 'dynamic', a positive number, None or a "
                         "LossScaler, got %r" % (loss_scale,))
    if isinstance(loss_scale, bool):
        raise ValueError('loss_scale must be a positive number, not a bool')
    return LossScaler(init_scale=_positive('loss_scale', loss_scale), dynamic=False)


class Trainer(gluon.Trainer):
    """``gluon.Trainer`` with FP32 master weights and loss scaling.

    Parameters
    ----------
    params, optimizer, optimizer_params, kvstore, compression_params
        As for ``gluon.Trainer``.  An optimizer name or instance is given
        FP32 master weights with :func:`mxamp.optimizer.create` (an instance is
        converted in place).  ``'adamw'`` is also accepted.
    update_on_kvstore : bool, optional
        As for ``gluon.Trainer``, except that with loss scaling on and several
        contexts or a distributed (non-async) kvstore, the default becomes
        False.  Reason: the kvstore sums float16 gradients in float16, and a
        sum of finite gradients can overflow; with ``update_on_kvstore=True``
        that sum is applied inside the kvstore, where no check can see it
        before the update.  With False the check runs on the reduced
        gradients.  Passing True explicitly is supported: the gradients of
        every context are checked before they are pushed.

        bfloat16 parameters with a distributed kvstore: always False (True
        raises ``ValueError``, and so does ``dist_async``, which updates on
        the servers).  MXNet 1.9.1's kvstore servers abort on bfloat16
        ("Unknown type enum 12"), so the initial weights and the gradients of
        bfloat16 parameters cross the kvstore as FP32 copies: each gradient is
        cast into an FP32 buffer (one per parameter and context, allocated
        once: twice the bfloat16 gradient memory), push-pulled, and the FP32
        sum is rounded back into the gradient.  float16 and FP32 gradients
        travel in their own dtype.  Local kvstores (``'device'``, ``'local'``)
        sum bfloat16 correctly and are left alone.
    loss_scale : 'auto', 'dynamic', float, None or LossScaler, default 'auto'
        ``'auto'``: dynamic scaling when any trainable parameter is float16,
        none otherwise (bfloat16 has float32's range).  ``'dynamic'``: a
        :class:`LossScaler` with its defaults (2**16, x2 after 2000 clean steps,
        x0.5 on overflow, within [1, 2**24]).  A number: fixed scale; steps with
        inf/NaN are still skipped.  None: no scaling, no check, no host sync.
        A :class:`LossScaler`: used as configured.
    master_weights : bool, optional
        FP32 master weights for float16/bfloat16 parameters.  Default: on when
        any parameter is float16 or bfloat16.  A ``multi_precision`` entry in
        `optimizer_params` takes precedence.
    diagnose_net : Block, optional
        Debug mode for overflow at the loss scale's floor.  The trainer keeps a
        reference to the inputs of `diagnose_net`'s latest call (a forward
        pre-hook: no copy, no sync), and when gradients overflow at
        ``min_scale`` it re-runs that forward op by op
        (:func:`mxamp.diagnose.first_nonfinite_output`, inference mode, on the
        CPU) and names the first layer whose output is not finite in the
        error or warning.  Costs one extra batch kept alive; the re-run only
        happens on that path.

    A forgotten ``scale_loss``
    --------------------------
    With loss scaling on, a step (or :meth:`update`, :meth:`unscale`,
    :meth:`clip_global_norm`) whose gradients are new but did not come through
    :meth:`scale_loss` raises ``RuntimeError`` before anything changes: those
    gradients would be divided by a loss scale they never got, and the update
    would silently shrink by that factor.  Several ``scale_loss`` per step
    (gradient accumulation, several losses) are fine; a scale fixed at 1 and
    ``loss_scale=None`` need none.  The check reads gluon's fresh-gradient
    flags only: no host sync.

    Overflow at the floor
    ---------------------
    When dynamic scaling overflows at ``min_scale``, the ``FloatingPointError``
    (``at_min_scale='raise'``) or ``RuntimeWarning`` (``'warn'``) names the
    parameters whose gradients hold inf/NaN
    (:func:`mxamp.diagnose.nonfinite_gradients`: one host sync per parameter,
    only then) and, with `diagnose_net`, the first layer whose output is not
    finite; without it, the message says how to find that layer.  The layer
    that overflows is usually upstream of the parameters named: an inf output
    makes the gradients of the layers that consume it non-finite.

    Examples
    --------
    >>> trainer = mxamp.Trainer(net.collect_params(), 'sgd',
    ...                         {'learning_rate': 0.1, 'momentum': 0.9})
    >>> for x, y in data:
    ...     with autograd.record():
    ...         loss = loss_fn(net(x), y)
    ...         with trainer.scale_loss(loss) as scaled:
    ...             autograd.backward(scaled)
    ...     trainer.step(x.shape[0])

    Gradient clipping: call :meth:`clip_global_norm` after backward, then step::

    ...     norm = trainer.clip_global_norm(max_norm)   # of the unscaled gradients
    ...     trainer.step(x.shape[0])
    """

    def __init__(self, params, optimizer, optimizer_params=None, kvstore='device',
                 compression_params=None, update_on_kvstore=None, loss_scale='auto',
                 master_weights=None, diagnose_net=None):
        param_list = _as_param_list(params)
        low = any(_precision(p.dtype) in LOW_PRECISION for p in param_list)
        optimizer_params = dict(optimizer_params or {})
        multi_precision = optimizer_params.pop('multi_precision', None)
        if multi_precision is None:
            multi_precision = low if master_weights is None else bool(master_weights)
        if isinstance(optimizer, str):
            optimizer = _mp_optimizer.create(optimizer, multi_precision=multi_precision,
                                             **optimizer_params)
        elif isinstance(optimizer, mx.optimizer.Optimizer):
            if optimizer_params:
                raise ValueError('optimizer_params must be empty when optimizer is an '
                                 'Optimizer instance, got %s' % sorted(optimizer_params))
            optimizer = _mp_optimizer.create(optimizer, multi_precision=multi_precision)
        else:
            raise TypeError('optimizer must be a name or an mx.optimizer.Optimizer, got %r'
                            % (optimizer,))
        self._loss_scaler = make_loss_scaler(
            loss_scale, [p.dtype for p in param_list if p.grad_req != 'null'])
        self._fp32_buffers = {}
        kv_type = kvstore if isinstance(kvstore, str) else (getattr(kvstore, 'type', '') or '')
        # MXNet 1.9.1's kvstore servers abort on bfloat16 ("Unknown type enum 12"):
        # reduce bfloat16 gradients through FP32 copies, update on the workers.
        self._fp32_reduce = 'dist' in kv_type and any(
            _precision(p.dtype) == 'bfloat16' for p in param_list)
        if self._fp32_reduce:
            if 'async' in kv_type:
                raise ValueError(
                    'bfloat16 parameters cannot be trained with kvstore %r: MXNet 1.9.1\'s '
                    'kvstore servers abort on bfloat16 arrays, and asynchronous training runs '
                    'the updates on the servers.  Use dist_sync (mxamp then reduces bfloat16 '
                    'gradients in FP32) or FP32 parameters.' % (kv_type,))
            if update_on_kvstore:
                raise ValueError(
                    'update_on_kvstore=True is not supported with bfloat16 parameters and a '
                    'distributed kvstore (%r): MXNet 1.9.1\'s kvstore servers abort on '
                    'bfloat16 arrays.  Leave update_on_kvstore unset: mxamp reduces the '
                    'bfloat16 gradients in FP32 and updates on the workers.' % (kv_type,))
            update_on_kvstore = False
        if update_on_kvstore is None and self._loss_scaler is not None:
            contexts = set()
            for param in param_list:
                try:
                    contexts.update(param.list_ctx())
                except RuntimeError:
                    pass
            if 'async' not in kv_type and (len(contexts) > 1 or 'dist' in kv_type):
                update_on_kvstore = False
        super(Trainer, self).__init__(params, optimizer, None, kvstore=kvstore,
                                      compression_params=compression_params,
                                      update_on_kvstore=update_on_kvstore)
        self._scale_loss_open = 0
        self._unscaled = False
        self._reduced = False             # summed over contexts and workers this step
        self._clip_coef = None            # set by clip_global_norm() for this step
        self._clip_overflow = False       # its verdict: the norm is not finite
        self._diagnose_net = None
        self._last_inputs = []
        if diagnose_net is not None:
            if not isinstance(diagnose_net, gluon.Block):
                raise TypeError('diagnose_net must be a gluon Block, got %r' % (diagnose_net,))
            self._diagnose_net = diagnose_net
            last = self._last_inputs   # the hook holds this list, not the trainer

            def keep_inputs(block, inputs):
                last[:] = [inputs]
            self._diagnose_hook = diagnose_net.register_forward_pre_hook(keep_inputs)

    # -- public state ------------------------------------------------------------
    @property
    def loss_scaler(self):
        """The :class:`LossScaler`, or None when loss scaling is off."""
        return self._loss_scaler

    @property
    def loss_scale(self):
        """Current loss scale (1.0 when scaling is off).  No host sync."""
        return 1.0 if self._loss_scaler is None else self._loss_scaler.loss_scale

    @property
    def skipped_steps(self):
        """Number of steps skipped because of inf/NaN gradients."""
        return 0 if self._loss_scaler is None else self._loss_scaler.skipped_steps

    # -- loss scaling --------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(self, loss):
        """Context manager yielding `loss` (NDArray or list) times :attr:`loss_scale`.

        Call ``autograd.backward`` on the yielded value inside the block.  Can be
        used several times before one :meth:`step` (several losses, gradient
        accumulation with ``grad_req='add'``).  No host sync.
        """
        if self._unscaled:
            raise RuntimeError('scale_loss() after unscale() in the same step: the gradients '
                               'are already unscaled, and new scaled gradients would be mixed '
                               'with them; call step() first')
        if self._clip_coef is not None:
            raise RuntimeError('scale_loss() after clip_global_norm() in the same step: the '
                               'norm does not include the new gradients; call step() first')
        scaled = loss if self._loss_scaler is None else self._loss_scaler.scale(loss)
        self._scale_loss_open += 1
        try:
            yield scaled
        finally:
            self._scale_loss_open -= 1

    def unscale(self):
        """Divide every gradient, on every context, by :attr:`loss_scale` in place.

        For inspecting the gradients between backward and :meth:`step`; the
        following step does not unscale again.  One in-place multiply per
        gradient array, no host sync.  Gradient clipping needs no unscaling:
        :meth:`clip_global_norm` works on the scaled gradients and reports the
        norm of the unscaled ones.

        Raises
        ------
        RuntimeError
            When called twice before a step, inside :meth:`scale_loss`, or
            on gradients that did not come through :meth:`scale_loss` (as
            :meth:`step`).
        """
        self._check_outside_scale_loss('unscale')
        self._check_scaled('unscale')
        if self._unscaled:
            raise RuntimeError('unscale() was already called since the last step(); the '
                               'gradients would be divided by the loss scale twice')
        if self._loss_scaler is not None:
            factor = 1.0 / self._loss_scaler.loss_scale
            for grad in self._trainable_grads():
                grad *= factor
        self._unscaled = True

    def clip_global_norm(self, max_norm):
        """Clip the global 2-norm of the gradients at `max_norm`; return the norm.

        Call after backward and before :meth:`step` (or :meth:`update`), once
        per step, with or without :meth:`unscale` before it.  The norm is
        computed over every trainable parameter, in FP32 whatever the
        gradients' dtypes (float16, bfloat16 and float32 mixed), and is that of
        the *unscaled* gradients before the ``1/batch_size`` normalisation:
        what ``gluon.utils.clip_global_norm`` would compute on FP32 gradients
        reduced by ``allreduce_grads``.  When it exceeds `max_norm`, the next
        step multiplies every gradient by ``max_norm / norm``; the factor is
        folded into the optimizer's ``rescale_grad`` with ``1/loss_scale`` and
        ``1/batch_size``, so no gradient is rewritten.  Parameters whose
        gradient is stale (not used since the last step) count with what their
        gradient holds.

        Contexts and kvstores:

        * several contexts, ``update_on_kvstore=False``: this method sums the
          gradients over the contexts (the ``allreduce_grads`` that the step
          would run; the step then does not reduce again) and takes the norm
          of the sum;
        * several contexts, local kvstore, ``update_on_kvstore=True``: the sum
          over contexts is formed in FP32 for the norm, one parameter at a
          time; the kvstore still reduces and updates at the step;
        * distributed kvstore: the norm is that of the gradients summed over
          all workers (after the allreduce), so every worker clips by the
          same factor and skips the same steps.  ``update_on_kvstore=True``
          (``dist_async``, or asked for) is refused: the servers sum and apply
          the gradients in one operation, so no worker sees the global norm.

        Overflow: a non-finite norm (some gradient is inf or NaN) is returned
        as it is, and the next step is skipped as without clipping (weights,
        master weights and optimizer states unchanged, the loss scale backs
        off).  With loss scaling off the step is skipped too, with a
        ``RuntimeWarning``.

        Cost: one read of every gradient (float16 and bfloat16 ones through a
        float32 copy each, so up to twice their size in temporary memory) and
        **one host sync**, to read the norm.  The following step takes its
        overflow verdict from that norm instead of checking the gradients
        again, so with loss scaling on a clipped step still costs one host
        sync in all.  Do not change the gradients between this call and the
        step.

        Parameters
        ----------
        max_norm : float
            The largest global norm let through (positive).

        Returns
        -------
        float
            The global 2-norm of the unscaled gradients before clipping; inf or
            NaN when some gradient is.

        Raises
        ------
        ValueError
            When `max_norm` is not a positive finite number.
        RuntimeError
            When no gradient was computed since the last step (called before
            backward), when called twice before one step or inside a
            :meth:`scale_loss` block, on gradients that did not come through
            :meth:`scale_loss` (as :meth:`step`), and with a distributed
            kvstore that updates on its servers.
        """
        self._check_outside_scale_loss('clip_global_norm')
        max_norm = _positive('max_norm', max_norm)
        if self._clip_coef is not None:
            raise RuntimeError('clip_global_norm() was already called since the last step(); '
                               'call it once per step, after backward')
        if not self._has_fresh_grads():
            raise RuntimeError('clip_global_norm() before backward: no gradient was computed '
                               'since the last step(); call it after autograd.backward() and '
                               'before step()')
        self._check_scaled('clip_global_norm')
        self._ensure_kvstore()
        if self._kvstore is not None and self._update_on_kvstore:
            if self._distributed:
                raise RuntimeError(
                    'clip_global_norm() with kvstore %r and update_on_kvstore=True: the '
                    'servers sum and apply the gradients in one operation, so no worker sees '
                    'their global norm; create the Trainer with update_on_kvstore=False'
                    % (self._kvstore.type,))
        elif self._kvstore is not None and not self._reduced:
            self._allreduce_grads()
            self._reduced = True
        # After the reduction every context holds the same sum: the first one's will do.
        grads = [param.list_grad()[0] if self._reduced else _context_sum(param.list_grad())
                 for param in self._params
                 if param.grad_req != 'null' and param._data is not None]
        norm = math.sqrt(_sum_of_squares(_flat_grads(grads)).asscalar())   # the host sync
        if self._loss_scaler is not None and not self._unscaled:
            norm /= self._loss_scaler.loss_scale
        self._clip_overflow = not math.isfinite(norm)
        self._clip_coef = max_norm / norm if norm > max_norm and not self._clip_overflow \
            else 1.0
        return norm

    def allreduce_grads(self):
        """Sum the gradients over contexts and workers, as ``gluon.Trainer.allreduce_grads``.

        For the ``allreduce_grads()`` / :meth:`update` split
        (``update_on_kvstore=False``).  :meth:`clip_global_norm` and
        :meth:`step` after it do not reduce again.  No host sync.

        Raises
        ------
        RuntimeError
            When the gradients were already reduced since the last step (by
            this method or by :meth:`clip_global_norm`), or inside a
            :meth:`scale_loss` block.
        """
        self._check_outside_scale_loss('allreduce_grads')
        if self._reduced:
            raise RuntimeError('allreduce_grads() was already called since the last step() '
                               '(clip_global_norm() calls it); the gradients would be summed '
                               'twice')
        super(Trainer, self).allreduce_grads()
        self._reduced = True

    def _has_fresh_grads(self):
        # NDArray._fresh_grad: set by backward, cleared by a step.
        return any(data._fresh_grad for param in self._params
                   if param.grad_req != 'null' and param._data is not None
                   for data in param.list_data())

    def _check_scaled(self, what):
        # Only new gradients: a step without backward is gluon's stale-gradient error.
        scaler = self._loss_scaler
        if scaler is not None and not scaler.scaled_since_update and self._has_fresh_grads():
            scaler.check_scaled('%s()' % what, 'run backward inside "with trainer.scale_loss('
                                'loss) as scaled: autograd.backward(scaled)", or create the '
                                'Trainer with loss_scale=None to train without loss scaling')

    def _check_outside_scale_loss(self, what):
        if self._scale_loss_open:
            raise RuntimeError('%s() called inside a trainer.scale_loss() block: call '
                               'autograd.backward(scaled) inside the block and %s() after it'
                               % (what, what))

    def _trainable_grads(self):
        # gluon.Trainer._params: the Parameter list in kvstore-index order.
        grads = []
        for param in self._params:
            if param.grad_req != 'null' and param._data is not None:
                grads.extend(param.list_grad())
        return grads

    def _rescale(self, batch_size):
        # gluon.Trainer._scale: the optimizer's rescale_grad at construction.
        scale = 1.0 if (self._loss_scaler is None or self._unscaled) \
            else self._loss_scaler.loss_scale
        clip = 1.0 if self._clip_coef is None else self._clip_coef
        return self._scale / batch_size / scale * clip

    def _ensure_kvstore(self):
        # gluon.Trainer internals: lazy kvstore creation and parameter broadcast.
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()

    # -- kvstore: bfloat16 through FP32, initial pulls --------------------------------
    def _is_fp32_reduced(self, param):
        """Whether `param`'s values and gradients cross the kvstore as FP32 copies."""
        return (self._fp32_reduce and param._stype == 'default'
                and _precision(param.dtype) == 'bfloat16')

    def _fp32_copies(self, index, arrays):
        """FP32 buffers for kvstore key `index`, one per context (allocated once)."""
        # dtypes.amp_cast: a weight may still hold a oneDNN blocked layout.
        buffers = self._fp32_buffers.get(index)
        if buffers is None:
            buffers = [amp_cast(a, np.float32) for a in arrays]
            self._fp32_buffers[index] = buffers
        else:
            for array, buf in zip(arrays, buffers):
                amp_cast(array, np.float32, out=buf)
        return buffers

    def _init_params(self):
        # gluon.Trainer internals: _params_to_init, _param2idx, Parameter._data,
        # _deferred_init.  bfloat16 values are broadcast as FP32 copies.
        pending = list(self._params_to_init)
        if self._kvstore and self._fp32_reduce:
            rest = []
            for param in pending:
                if param._deferred_init or not self._is_fp32_reduced(param):
                    rest.append(param)
                    continue
                index = self._param2idx[param.name]
                arrays = param._check_and_get(param._data, list)
                buffers = self._fp32_copies(index, arrays)
                self._kvstore.broadcast(index, buffers[0], buffers)
                for buf, array in zip(buffers, arrays):
                    cast_into(buf, array)
            self._params_to_init = rest
        super(Trainer, self)._init_params()
        if self._distributed:
            # The initial weights are pulled from the servers under the keys the
            # gradients are pushed to next.  The pull (writes the weights) and
            # the push (reads the gradients) share no array, so MXNet's engine
            # may send the push first; with update_on_kvstore=False the server
            # then replaces the stored weight by the gradient sum before the
            # pull is served (seen as one worker starting from the gradient).
            # Wait for the pulls once.
            for param in pending:
                if param._data is not None and param not in self._params_to_init:
                    for data in param.list_data():
                        data.wait_to_read()

    def _allreduce_grads(self):
        """Sum the gradients over contexts and workers (gluon's, plus bfloat16 via FP32).

        With a distributed kvstore, each bfloat16 gradient is cast into an FP32
        buffer (allocated once per parameter and context), push-pulled, and the
        FP32 sum is cast back into the gradient (rounded once).  Everything else
        takes gluon's path: float16 gradients are summed in float16.  No host sync.
        """
        if not (self._kvstore and self._fp32_reduce):
            super(Trainer, self)._allreduce_grads()
            return
        # gluon.Trainer._allreduce_grads, with update_on_kvstore=False (forced for
        # this case in __init__; sparse gradients make gluon refuse that earlier).
        for index, param in enumerate(self._params):
            if param.grad_req == 'null':
                continue
            grads = param.list_grad()
            if grads[0].stype != 'default':
                self._kvstore.push(index, grads, priority=-index)
                self._kvstore.pull(index, grads, priority=-index, ignore_sparse=True)
            elif self._is_fp32_reduced(param):
                buffers = self._fp32_copies(index, grads)
                self._kvstore.pushpull(index, buffers, priority=-index)
                for buf, grad in zip(buffers, grads):
                    cast_into(buf, grad)
            else:
                self._kvstore.pushpull(index, grads, priority=-index)

    def _mark_consumed(self):
        # NDArray._fresh_grad: gluon's stale-gradient flag, reset as a real step would.
        for param in self._params:
            if param.grad_req != 'null' and param._data is not None:
                for data in param.list_data():
                    data._fresh_grad = False

    def _has_overflow(self, **kvstore_args):
        """This step's overflow verdict: clip_global_norm()'s, or the scaler's (one host sync)."""
        if self._clip_coef is not None:
            return self._clip_overflow
        if self._loss_scaler is None:
            return False
        return self._loss_scaler.has_overflow(self._trainable_grads(), **kvstore_args)

    def _finish(self, overflow):
        self._unscaled = False
        self._reduced = False
        self._clip_coef = None
        self._clip_overflow = False
        if overflow:
            self._mark_consumed()
        if self._loss_scaler is not None:
            self._loss_scaler.update(overflow, details=self._overflow_details)
        elif overflow:
            warnings.warn('mxamp: the gradient norm is not finite (inf/NaN gradients): step '
                          'skipped.  Loss scaling is off, so nothing adapts; if it recurs, the '
                          'model produces inf/NaN', RuntimeWarning, stacklevel=3)
        return not overflow

    def _overflow_details(self):
        """What overflowed, for the error at the loss scale's floor (host syncs)."""
        text = _nonfinite_gradients_text(lambda: diagnose.nonfinite_gradients(self._params),
                                         len(self._params))
        if self._diagnose_net is None or not self._last_inputs:
            return text + ('.  To find the first layer whose output is not finite, call '
                           'mxamp.diagnose.first_nonfinite_output(net, x) with an overflowing '
                           'batch x, or create the Trainer with diagnose_net=net')
        try:
            found = diagnose.first_nonfinite_output(self._diagnose_net, *self._last_inputs[0])
        except Exception as err:
            return text + ('.  Re-running the last forward pass op by op failed: %s: %s'
                           % (type(err).__name__, err))
        if found is None:
            return text + ('.  Re-running the last batch op by op (inference mode) gives '
                           'finite outputs at every layer')
        where = ('finite in FP32 but not once stored in %s' % found['cast_to']
                 if found['cast_to'] else 'in %s' % found['dtype'])
        return text + ('.  First layer whose output is not finite (last batch, inference '
                       'mode): %s (%s), %s' % (found['node'], found['op'], where))

    # -- stepping --------------------------------------------------------------------
    def step(self, batch_size, ignore_stale_grad=False):
        """Reduce gradients, check them, and update the parameters or skip.

        Parameters
        ----------
        batch_size : int
            Gradients are normalised by ``1/batch_size`` (and by ``1/loss_scale``,
            folded into the same ``rescale_grad``).
        ignore_stale_grad : bool, default False
            As for ``gluon.Trainer.step``.

        Returns
        -------
        bool
            True when the update was applied, False when it was skipped because
            some gradient was inf/NaN.  With loss scaling on, **one host sync**
            (the overflow verdict); with ``loss_scale=None``, none.  After
            :meth:`clip_global_norm`, none: its norm gives the verdict.

        Raises
        ------
        RuntimeError
            When called inside a :meth:`scale_loss` block, and, with loss
            scaling on, when backward ran since the last step but not on a
            loss from :meth:`scale_loss`: those gradients would be divided by
            the loss scale they never got (:meth:`LossScaler.check_scaled`).
        """
        self._check_outside_scale_loss('step')
        self._check_scaled('step')
        if self._loss_scaler is None and self._clip_coef is None and not self._reduced:
            super(Trainer, self).step(batch_size, ignore_stale_grad)
            return self._finish(False)
        self._ensure_kvstore()
        rescale = self._rescale(batch_size)
        # gluon.Trainer internals: _kvstore, _update_on_kvstore, _allreduce_grads
        # (push/pull per parameter), _update (per-context updaters + stale check).
        if self._kvstore is not None and self._update_on_kvstore:
            # Check before pushing: the kvstore applies the update on push.
            overflow = self._has_overflow(kvstore=self._kvstore, rescale_grad=rescale)
            if not overflow:
                self._optimizer.rescale_grad = rescale
                self._allreduce_grads()
                self._update(ignore_stale_grad)
        else:
            self._check_and_rescale_grad(rescale)
            if not self._reduced:
                self._allreduce_grads()
            # After the reduction: catches sums that overflow, and every worker
            # of a distributed kvstore sees the same reduced gradients.
            overflow = self._has_overflow()
            if not overflow:
                self._update(ignore_stale_grad)
        return self._finish(overflow)

    def update(self, batch_size, ignore_stale_grad=False):
        """Check the (already reduced) gradients and update or skip.

        For the ``allreduce_grads()`` / ``update()`` split of ``gluon.Trainer``
        (``update_on_kvstore=False`` only).  Returns True when applied.  One host
        sync with loss scaling on, none after :meth:`clip_global_norm`.  Raises
        ``RuntimeError`` as :meth:`step` does.
        """
        self._check_outside_scale_loss('update')
        self._check_scaled('update')
        if self._loss_scaler is None and self._clip_coef is None:
            super(Trainer, self).update(batch_size, ignore_stale_grad)
            return self._finish(False)
        self._ensure_kvstore()
        if self._kvstore is not None and self._update_on_kvstore:
            raise RuntimeError('update() is not supported with update_on_kvstore=True; '
                               'use step(), or create the Trainer with '
                               'update_on_kvstore=False')
        self._check_and_rescale_grad(self._rescale(batch_size))
        overflow = self._has_overflow()
        if not overflow:
            self._update(ignore_stale_grad)
        return self._finish(overflow)

    # -- state -------------------------------------------------------------------------
    def state_dict(self):
        """Mixed-precision state: ``{'loss_scaler': LossScaler.state_dict() or None}``.

        Optimizer states (momenta, master weights) are saved by
        :meth:`save_states`, which includes this dict too.
        """
        return {'loss_scaler': None if self._loss_scaler is None
                else self._loss_scaler.state_dict()}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned.

        Raises
        ------
        KeyError
            When ``'loss_scaler'`` (or a key of the scaler's state) is missing.
        ValueError
            When the state has a scaler and this Trainer has loss scaling off.
        """
        if 'loss_scaler' not in state:
            raise KeyError("Trainer.load_state_dict(): missing key 'loss_scaler'")
        scaler_state = state['loss_scaler']
        if scaler_state is None:
            return
        if self._loss_scaler is None:
            raise ValueError('Trainer.load_state_dict(): the state has a loss scaler but this '
                             'Trainer was created with loss scaling off (loss_scale=None)')
        self._loss_scaler.load_state_dict(scaler_state)

    def save_states(self, fname):
        """Save optimizer states (master weights included) and the loss scaler state.

        The file wraps what ``gluon.Trainer.save_states`` writes; plain
        ``gluon.Trainer`` files are still accepted by :meth:`load_states`.
        Synchronises with the host (reads the states).
        """
        tmp = '%s.mxamp-%d.tmp' % (fname, os.getpid())
        try:
            super(Trainer, self).save_states(tmp)
            with open(tmp, 'rb') as f:
                inner = f.read()
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        payload = pickle.dumps({'gluon_states': inner, 'mxamp': self.state_dict()})
        with open(fname, 'wb') as f:
            f.write(_FILE_MAGIC + payload)

    def load_states(self, fname):
        """Load what :meth:`save_states` wrote (or a plain ``gluon.Trainer`` file).

        A plain gluon file carries no scaler state: the scaler is left as it is
        and a warning says so.
        """
        with open(fname, 'rb') as f:
            data = f.read()
        if not data.startswith(_FILE_MAGIC):
            warnings.warn('%s is a plain gluon.Trainer states file: the loss scaler keeps its '
                          'current state' % fname)
            super(Trainer, self).load_states(fname)
            return
        payload = pickle.loads(data[len(_FILE_MAGIC):])
        tmp = '%s.mxamp-%d.tmp' % (fname, os.getpid())
        try:
            with open(tmp, 'wb') as f:
                f.write(payload['gluon_states'])
            super(Trainer, self).load_states(tmp)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.load_state_dict(payload['mxamp'])
