"""The mixed-precision ``Trainer``.

This module owns :class:`Trainer`, a ``gluon.Trainer`` with FP32 master
weights (:mod:`mxamp.optimizer`), a :class:`mxamp.LossScaler` built in
(:mod:`mxamp.loss_scaler`), gradient clipping, and bfloat16 over distributed
kvstores (its base class, :mod:`mxamp.kvstore_transport`).  It decides what a
step does, in which order, and how its state is saved.

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
* The overflow check covers every gradient on every context with a single
  host synchronisation per step: on a CPU ``multi_sum_sq`` over the gradients
  widened to FP32, then ``multi_all_finite`` on the sums; on a GPU
  ``multi_all_finite`` directly (`mxamp.loss_scaler` says why, and the
  200-array chunks MXNet 1.9.1 needs).
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
* A skipped step whose loss is not finite is told apart from a gradient
  overflow: the loss scale is kept, and one warning (or the error) says that
  the forward pass fails and where.
* Nothing is monkey-patched: MXNet is left exactly as it was.

MXNet internals relied on (MXNet 1.9.1):

* ``gluon.Trainer``: ``_params`` (the parameters in kvstore-key order: what
  is checked, reduced, clipped and reported), ``_params_to_init``,
  ``_kv_initialized`` and ``_init_kvstore`` (the lazy kvstore, created before
  the first check), ``_allreduce_grads`` (the reduction, run by
  :meth:`Trainer.clip_global_norm` or the step), ``_update`` (the per-context
  updaters, run only after the verdict), ``_check_and_rescale_grad`` and
  ``_optimizer`` (the loss scale and the clipping factor folded into
  ``rescale_grad``), ``_scale`` (the ``rescale_grad`` the optimizer came
  with), ``_kvstore``, ``_update_on_kvstore`` and ``_distributed`` (which path
  a step takes, and where the workers agree);
* ``gluon.Parameter._data`` (None before initialisation);
* ``NDArray._fresh_grad``: gluon's stale-gradient flag, set by backward (how
  the Trainer knows that backward ran, for :meth:`Trainer.clip_global_norm`
  and the forgotten-``scale_loss`` check) and reset by a skipped step as by an
  applied one.
"""
import contextlib
import math
import os
import pickle
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Set, Tuple, Union

import numpy as np

import mxnet as mx
from mxnet import gluon

from . import diagnose
from . import optimizer as _mp_optimizer
from .atomic_files import replaced_on_success
from .dtypes import LOW_PRECISION, param_precision, widen
from .fusion import check_trainable_params
from .kvstore_transport import Bfloat16KVStoreTrainer, ParamsLike, _as_param_list
# LossScaler and OverflowInfo are also importable from here, their first home.
from .loss_scaler import (LossScaler, OverflowInfo, _flat_grads, _nonfinite_gradients_text,
                          _nonfinite_loss_text, LossScalingState, _positive, make_loss_scaler)

__all__ = ['LossScaler', 'OverflowInfo', 'Trainer']

_FILE_MAGIC = b'MXAMP-TRAINER-STATES v1\n'


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


class _StepState(object):
    """Where this step's gradients stand, between two steps: the one place that
    says what may happen to them next.

    Between backward and :meth:`Trainer.step` the gradients may be, each at
    most once: summed over contexts and workers (`reduced`: by
    :meth:`Trainer.allreduce_grads` or :meth:`Trainer.clip_global_norm`, else
    by the step itself), divided by the loss scale (`unscaled`:
    :meth:`Trainer.unscale`) and clipped (`clip_coef` and its verdict
    `clip_overflow`: :meth:`Trainer.clip_global_norm`).  New scaled gradients
    may join them only before they are unscaled or clipped.  ``step()`` and
    ``update()`` end the step (:meth:`reset`).  Each move is checked here and an
    illegal one raises ``RuntimeError`` saying what to do instead.
    """
    __slots__ = ('reduced', 'unscaled', 'clip_coef', 'clip_overflow')

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.reduced = False
        self.unscaled = False
        self.clip_coef: Optional[float] = None
        self.clip_overflow = False

    @property
    def clipped(self) -> bool:
        return self.clip_coef is not None

    def check_new_loss(self) -> None:
        """Before :meth:`Trainer.scale_loss` adds scaled gradients."""
        if self.unscaled:
            raise RuntimeError('scale_loss() after unscale() in the same step: the gradients '
                               'are already unscaled, and new scaled gradients would be mixed '
                               'with them; call step() first')
        if self.clipped:
            raise RuntimeError('scale_loss() after clip_global_norm() in the same step: the '
                               'norm does not include the new gradients; call step() first')

    def unscale(self) -> None:
        if self.unscaled:
            raise RuntimeError('unscale() was already called since the last step(); the '
                               'gradients would be divided by the loss scale twice')
        self.unscaled = True

    def check_clip(self) -> None:
        """Before :meth:`Trainer.clip_global_norm` computes the norm."""
        if self.clipped:
            raise RuntimeError('clip_global_norm() was already called since the last step(); '
                               'call it once per step, after backward')

    def clip(self, norm: float, max_norm: float) -> None:
        """Record the unscaled global `norm`: the clipping factor and its verdict."""
        self.clip_overflow = not math.isfinite(norm)
        self.clip_coef = max_norm / norm if norm > max_norm and not self.clip_overflow \
            else 1.0

    def check_reduce(self) -> None:
        """Before :meth:`Trainer.allreduce_grads` sums the gradients (it then sets `reduced`)."""
        if self.reduced:
            raise RuntimeError('allreduce_grads() was already called since the last step() '
                               '(clip_global_norm() calls it); the gradients would be summed '
                               'twice')


class Trainer(LossScalingState, Bfloat16KVStoreTrainer):
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
        x0.5 on overflow, within [1, 2**24]; until the first applied step an
        overflow divides the scale by 16).  A number: fixed scale; steps with
        inf/NaN are still skipped.  None: no scaling, no check, no host sync.
        A :class:`LossScaler`: used as configured; one made with
        ``enabled=False`` is the same as None (torch's disabled ``GradScaler``).
    master_weights : bool, optional
        FP32 master weights for float16/bfloat16 parameters.  Default: on when
        any parameter is float16 or bfloat16.  A ``multi_precision`` entry in
        `optimizer_params` takes precedence.
    diagnose_net : Block, optional
        Debug mode for overflow at the loss scale's floor and for a loss that
        is not finite.  The trainer keeps a reference to the inputs of
        `diagnose_net`'s latest call (a forward pre-hook: no copy, no sync),
        and when gradients overflow at ``min_scale``, or a skipped step's loss
        is not finite, it re-runs that forward op by op
        (:func:`mxamp.diagnose.first_nonfinite_output`, inference mode, on the
        CPU) and names the first layer whose output is not finite in the
        error or warning.  Costs one extra batch kept alive; the re-run only
        happens on those paths.

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
    When dynamic scaling overflows at ``min_scale`` with a finite loss (else see
    below), the ``FloatingPointError`` (``at_min_scale='raise'``) or
    ``RuntimeWarning`` (``'warn'``, at every such step) names the
    parameters whose gradients hold inf/NaN
    (:func:`mxamp.diagnose.nonfinite_gradients`: one host sync per parameter,
    only then) and, with `diagnose_net`, the first layer whose output is not
    finite; without it, the message says how to find that layer.  The layer
    that overflows is usually upstream of the parameters named: an inf output
    makes the gradients of the layers that consume it non-finite.

    A loss that is not finite
    -------------------------
    When a step is skipped, the trainer also reads what :meth:`scale_loss`
    received (kept by reference since then, not copied).  If that loss holds
    inf/NaN, the forward pass itself fails (in float16, typically a fill such
    as -1e18 for masked attention scores: -inf there, and ``0 * -inf`` is
    NaN): that is no gradient overflow, and no loss scale fixes it.  The step
    is still skipped and counted, but the loss scale is kept (see
    :class:`LossScaler`), and ``at_min_scale`` decides: one
    ``RuntimeWarning`` per trainer (``'warn'``), ``FloatingPointError``
    (``'raise'``) or nothing.  The message names the first layer whose output
    is not finite with `diagnose_net` (else says how to find it) and the
    remedies: a finite fill such as -1e4, or that block kept in FP32 with
    ``mxamp.convert(net, dtype, exclude=[block])``.  Cost: host syncs on
    skipped steps only, one per loss array, plus one ``pushpull`` with a
    distributed kvstore (all workers keep the same scale).

    Examples
    --------
    >>> from mxnet import autograd, gluon
    >>> net = mxamp.convert(gluon.nn.Dense(2, in_units=4), 'float16')
    >>> net.initialize()
    >>> trainer = mxamp.Trainer(net.collect_params(), 'sgd',
    ...                         {'learning_rate': 0.1, 'momentum': 0.9})
    >>> loss_fn = gluon.loss.L2Loss()
    >>> data = [(mx.nd.full((8, 4), 0.1), mx.nd.zeros((8, 2)))]
    >>> for x, y in data:
    ...     with autograd.record():
    ...         loss = loss_fn(net(x), y)
    ...         with trainer.scale_loss(loss) as scaled:
    ...             autograd.backward(scaled)
    ...     trainer.step(x.shape[0])         # False when skipped for overflow
    True

    Gradient clipping: call :meth:`clip_global_norm` after backward, then step::

    ...     norm = trainer.clip_global_norm(max_norm)   # of the unscaled gradients
    ...     trainer.step(x.shape[0])
    """

    def __init__(self, params: ParamsLike, optimizer: Union[str, mx.optimizer.Optimizer],
                 optimizer_params: Optional[Dict[str, Any]] = None,
                 kvstore: Union[str, mx.kv.KVStore, None] = 'device',
                 compression_params: Optional[Dict[str, Any]] = None,
                 update_on_kvstore: Optional[bool] = None,
                 loss_scale: Union[str, float, LossScaler, None] = 'auto',
                 master_weights: Optional[bool] = None,
                 diagnose_net: Optional[gluon.Block] = None) -> None:
        param_list = _as_param_list(params)
        check_trainable_params(param_list, 'mxamp.Trainer')
        low = any(param_precision(p) in LOW_PRECISION for p in param_list)
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
            loss_scale, [param_precision(p) for p in param_list if p.grad_req != 'null'])
        kv_type = kvstore if isinstance(kvstore, str) else (getattr(kvstore, 'type', '') or '')
        if update_on_kvstore is None and self._loss_scaler is not None:
            contexts: Set[mx.Context] = set()
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
        self._stage = _StepState()
        self._diagnose_net: Optional[gluon.Block] = None
        self._last_inputs: List[Tuple[Any, ...]] = []
        if diagnose_net is not None:
            if not isinstance(diagnose_net, gluon.Block):
                raise TypeError('diagnose_net must be a gluon Block, got %r' % (diagnose_net,))
            self._diagnose_net = diagnose_net
            last = self._last_inputs   # the hook holds this list, not the trainer

            def keep_inputs(block, inputs):
                last[:] = [inputs]
            self._diagnose_hook = diagnose_net.register_forward_pre_hook(keep_inputs)

    # -- loss scaling --------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(self, loss: Union[mx.nd.NDArray, List[mx.nd.NDArray], Tuple[mx.nd.NDArray, ...]]
                   ) -> Iterator[Union[mx.nd.NDArray, List[mx.nd.NDArray], Tuple[mx.nd.NDArray, ...]]]:
        """Context manager yielding `loss` (NDArray or list) times :attr:`loss_scale`.

        Call ``autograd.backward`` on the yielded value inside the block.  Can be
        used several times before one :meth:`step` (several losses, gradient
        accumulation with ``grad_req='add'``).  `loss` is kept by reference (no
        copy) until the step, which reads it only when it skips.  No host sync.
        """
        self._stage.check_new_loss()
        scaled = loss if self._loss_scaler is None else self._loss_scaler.scale(loss)
        self._scale_loss_open += 1
        try:
            yield scaled
        finally:
            self._scale_loss_open -= 1

    def unscale(self) -> None:
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
        self._stage.unscale()
        if self._loss_scaler is not None:
            factor = 1.0 / self._loss_scaler.loss_scale
            for grad in self._trainable_grads():
                grad *= factor

    def clip_global_norm(self, max_norm: float) -> float:
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
        self._stage.check_clip()
        if not self._has_fresh_grads():
            raise RuntimeError('clip_global_norm() before backward: no gradient was computed '
                               'since the last step(); call it after autograd.backward() and '
                               'before step()')
        self._check_scaled('clip_global_norm')
        self.init_kvstore()
        if self._kvstore is not None and self._update_on_kvstore:
            if self._distributed:
                raise RuntimeError(
                    'clip_global_norm() with kvstore %r and update_on_kvstore=True: the '
                    'servers sum and apply the gradients in one operation, so no worker sees '
                    'their global norm; create the Trainer with update_on_kvstore=False'
                    % (self._kvstore.type,))
        elif self._kvstore is not None and not self._stage.reduced:
            self._allreduce_grads()
            self._stage.reduced = True
        # After the reduction every context holds the same sum: the first one's will do.
        grads = [param.list_grad()[0] if self._stage.reduced else _context_sum(param.list_grad())
                 for param in self._params
                 if param.grad_req != 'null' and param._data is not None]
        norm = math.sqrt(_sum_of_squares(_flat_grads(grads)).asscalar())   # the host sync
        if self._loss_scaler is not None and not self._stage.unscaled:
            norm /= self._loss_scaler.loss_scale
        self._stage.clip(norm, max_norm)
        return norm

    def allreduce_grads(self) -> None:
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
        self._stage.check_reduce()
        super(Trainer, self).allreduce_grads()
        self._stage.reduced = True

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
        scale = 1.0 if (self._loss_scaler is None or self._stage.unscaled) \
            else self._loss_scaler.loss_scale
        clip = 1.0 if self._stage.clip_coef is None else self._stage.clip_coef
        return self._scale / batch_size / scale * clip

    def init_kvstore(self) -> None:
        """Create the kvstore and broadcast worker 0's parameters now.

        ``gluon.Trainer`` does both lazily, at the first step, after the first
        forward pass: with a distributed kvstore that pass has already moved
        every worker's BatchNorm running statistics, which the broadcast then
        replaces by worker 0's.  Call this after the parameters are initialised
        (shapes known) and before training.  Every worker must call it.  Waits
        for the initial pulls of a distributed kvstore; no other host sync.
        Calling it again does nothing.
        """
        # gluon.Trainer internals: lazy kvstore creation and parameter broadcast.
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()

    def _mark_consumed(self):
        # NDArray._fresh_grad: gluon's stale-gradient flag, reset as a real step would.
        for param in self._params:
            if param.grad_req != 'null' and param._data is not None:
                for data in param.list_data():
                    data._fresh_grad = False

    def _has_overflow(self, **kvstore_args):
        """This step's overflow verdict: clip_global_norm()'s, or the scaler's (one host sync)."""
        if self._stage.clipped:
            return self._stage.clip_overflow
        if self._loss_scaler is None:
            return False
        return self._loss_scaler.has_overflow(self._trainable_grads(), **kvstore_args)

    def _finish(self, overflow):
        self._stage.reset()
        if overflow:
            self._mark_consumed()
        if self._loss_scaler is not None:
            # With a distributed kvstore and update_on_kvstore=False every worker checked
            # the same summed gradients, so no kvstore agreed on the verdict: name it, for
            # the agreement on the loss check of a skipped step.
            self._loss_scaler.update(overflow, details=self._overflow_details,
                                     loss_details=self._loss_details,
                                     kvstore=self._kvstore if self._distributed else None)
        elif overflow:
            warnings.warn('mxamp: the gradient norm is not finite (inf/NaN gradients): step '
                          'skipped.  Loss scaling is off, so nothing adapts; if it recurs, the '
                          'model produces inf/NaN', RuntimeWarning, stacklevel=3)
        return not overflow

    def _overflow_details(self):
        """What overflowed, for the error at the loss scale's floor (host syncs)."""
        return (_nonfinite_gradients_text(lambda: diagnose.nonfinite_gradients(self._params),
                                          len(self._params))
                + '.  ' + self._first_nonfinite_layer('an overflowing batch x'))

    def _loss_details(self):
        """Where a loss that is not finite comes from and what to do (host syncs)."""
        return _nonfinite_loss_text(self._first_nonfinite_layer('that batch x'),
                                    'mxamp.convert(net, dtype, exclude=[block])')

    def _first_nonfinite_layer(self, batch):
        """The first layer whose output is not finite, with `diagnose_net` (re-runs the
        last batch: host syncs); without it, how to find it on `batch`."""
        if self._diagnose_net is None or not self._last_inputs:
            return ('To find the first layer whose output is not finite, call '
                    'mxamp.diagnose.first_nonfinite_output(net, x) with %s, or create the '
                    'Trainer with diagnose_net=net' % batch)
        try:
            found = diagnose.first_nonfinite_output(self._diagnose_net, *self._last_inputs[0])
        except Exception as err:
            return ('Re-running the last forward pass op by op failed: %s: %s'
                    % (type(err).__name__, err))
        if found is None:
            return ('Re-running the last batch op by op (inference mode) gives finite outputs '
                    'at every layer')
        where = ('finite in FP32 but not once stored in %s' % found['cast_to']
                 if found['cast_to'] else 'in %s' % found['dtype'])
        return ('First layer whose output is not finite (last batch, inference mode): %s '
                '(%s), %s' % (found['node'], found['op'], where))

    # -- stepping --------------------------------------------------------------------
    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> bool:
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
            :meth:`clip_global_norm`, none: its norm gives the verdict.  A
            skipped step adds one per loss given to :meth:`scale_loss`, to
            tell a loss that is not finite from a gradient overflow.

        Raises
        ------
        RuntimeError
            When called inside a :meth:`scale_loss` block, and, with loss
            scaling on, when backward ran since the last step but not on a
            loss from :meth:`scale_loss`: those gradients would be divided by
            the loss scale they never got (:meth:`LossScaler.check_scaled`).
        FloatingPointError
            With ``at_min_scale='raise'``, after skipping a step that overflows
            at the minimum loss scale or whose loss is not finite.
        """
        self._check_outside_scale_loss('step')
        self._check_scaled('step')
        if self._loss_scaler is None and not self._stage.clipped and not self._stage.reduced:
            super(Trainer, self).step(batch_size, ignore_stale_grad)
            return self._finish(False)
        self.init_kvstore()
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
            if not self._stage.reduced:
                self._allreduce_grads()
            # After the reduction: catches sums that overflow, and every worker
            # of a distributed kvstore sees the same reduced gradients.
            overflow = self._has_overflow()
            if not overflow:
                self._update(ignore_stale_grad)
        return self._finish(overflow)

    def update(self, batch_size: int, ignore_stale_grad: bool = False) -> bool:
        """Check the (already reduced) gradients and update or skip.

        For the ``allreduce_grads()`` / ``update()`` split of ``gluon.Trainer``
        (``update_on_kvstore=False`` only).  Returns True when applied.  One host
        sync with loss scaling on, none after :meth:`clip_global_norm`; a skipped
        step adds one per loss, as in :meth:`step`.  Raises ``RuntimeError`` as
        :meth:`step` does.
        """
        self._check_outside_scale_loss('update')
        self._check_scaled('update')
        if self._loss_scaler is None and not self._stage.clipped:
            super(Trainer, self).update(batch_size, ignore_stale_grad)
            return self._finish(False)
        self.init_kvstore()
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
    def state_dict(self) -> Dict[str, Any]:
        """Mixed-precision state: ``{'loss_scaler': LossScaler.state_dict() or None}``.

        Optimizer states (momenta, master weights) are saved by
        :meth:`save_states`, which includes this dict too.
        """
        return {'loss_scaler': None if self._loss_scaler is None
                else self._loss_scaler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
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
                             'Trainer was created with loss scaling off (loss_scale=None, or a '
                             'LossScaler(enabled=False))')
        self._loss_scaler.load_state_dict(scaler_state)

    def save_states(self, fname: str) -> None:
        """Save optimizer states (master weights included) and the loss scaler state.

        The file wraps what ``gluon.Trainer.save_states`` writes; plain
        ``gluon.Trainer`` files are still accepted by :meth:`load_states`.
        Synchronises with the host (reads the states).  Written whole or not at
        all (`mxamp.atomic_files`): an interrupted save leaves the previous file.
        """
        with replaced_on_success(fname) as temporary:
            # gluon.Trainer writes a file of its own; it becomes one item of mxamp's.
            super(Trainer, self).save_states(temporary)
            with open(temporary, 'rb') as f:
                inner = f.read()
            payload = pickle.dumps({'gluon_states': inner, 'mxamp': self.state_dict()})
            with open(temporary, 'wb') as f:
                f.write(_FILE_MAGIC + payload)

    def load_states(self, fname: str) -> None:
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
