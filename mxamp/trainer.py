"""The mixed-precision ``Trainer``.

Owns :class:`Trainer`, a ``gluon.Trainer`` with FP32 master weights, a built-in
:class:`mxamp.LossScaler`, gradient clipping and bfloat16 over distributed kvstores (its base,
:mod:`mxamp.kvstore_transport`): what a step does, in which order, and how its state is saved.
How it differs from ``contrib.amp``: docs/training.rst, docs/migrating-contrib-amp.rst.

MXNet internals relied on (MXNet 1.9.1):

* ``gluon.Trainer``: ``_params`` (kvstore-key order), ``_params_to_init``, ``_kv_initialized``
  and ``_init_kvstore`` (the lazy kvstore), ``_allreduce_grads``, ``_update`` (after the
  verdict only), ``_check_and_rescale_grad``, ``_optimizer`` and ``_scale`` (its own
  ``rescale_grad``, with loss scale and clipping folded in), ``_kvstore``,
  ``_update_on_kvstore``, ``_distributed``; ``gluon.Parameter._data`` (None before init);
* ``NDArray._fresh_grad``: set by backward (new gradients), reset by every step, skipped too.
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
from .loss_scaler import (LossScaler, OverflowInfo, _flat_grads, _nonfinite_gradients_text,
                          _nonfinite_loss_text, LossScalingState, _positive, make_loss_scaler)

__all__ = ['LossScaler', 'OverflowInfo', 'Trainer']

_FILE_MAGIC = b'MXAMP-TRAINER-STATES v1\n'


def _sum_of_squares(arrays):
    """Sum of squares of every element of `arrays`: FP32, shape (1,), on the first one's
    context; no host sync.  One BLAS ``dot`` per array, more exact than MXNet 1.9.1's serial
    ``multi_sum_sq``; low precision widened first (the CPU ``dot`` takes float32, float64)."""
    home = arrays[0].context
    parts = []
    for arr in arrays:
        flat = arr.reshape((-1,))
        if flat.dtype != np.float32:
            flat = widen(flat)
        parts.append(mx.nd.dot(flat, flat).as_in_context(home))
    return mx.nd.add_n(*parts)


def _context_sum(grads):
    """One parameter's gradients summed over contexts, in FP32 (finite float16 cannot overflow)."""
    if len(grads) == 1:
        return grads[0]
    home = grads[0].context
    if grads[0].stype == 'default':
        grads = [g if g.dtype == np.float32 else widen(g) for g in grads]
    return mx.nd.add_n(*[g.as_in_context(home) for g in grads])


class _StepState(object):
    """Where this step's gradients stand: the one place that says what may happen to them.

    Each at most once per step (:meth:`reset`): `reduced`, `unscaled`, clipped (`clip_coef`,
    `clip_overflow`); new scaled gradients only before the last two.  An illegal move raises
    ``RuntimeError`` saying what to do instead."""
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
        As for ``gluon.Trainer``; the optimizer (also ``'adamw'``) gets FP32 master weights
        from :func:`mxamp.optimizer.create`, an instance converted in place.
    update_on_kvstore : bool, optional
        False by default with loss scaling and several contexts or a ``dist_sync`` kvstore;
        always False for bfloat16 there (docs/training.rst, "Distributed kvstores").
    loss_scale : 'auto', 'dynamic', float, None or LossScaler, default 'auto'
        ``'auto'``: dynamic when a trainable parameter is float16; ``'dynamic'``: a default
        :class:`LossScaler`; a number: fixed; None or a disabled scaler: no check, no sync.
    master_weights : bool, optional
        Default: when a parameter is float16 or bfloat16 (``multi_precision`` overrides).
    diagnose_net : Block, optional
        Its latest inputs are kept (no copy) and re-run op by op on overflow at the floor or
        a loss not finite, to name the first layer whose output is not finite.

    With loss scaling, a step on new gradients that missed :meth:`scale_loss` raises
    ``RuntimeError``; what a skipped step reports: docs/troubleshooting.rst.

    Examples
    --------
    >>> from mxnet import autograd, gluon
    >>> net = mxamp.convert(gluon.nn.Dense(2, in_units=4), 'float16')
    >>> net.initialize()
    >>> trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    >>> x, y = mx.nd.full((8, 4), 0.1), mx.nd.zeros((8, 2))
    >>> with autograd.record():
    ...     loss = gluon.loss.L2Loss()(net(x), y)
    ...     with trainer.scale_loss(loss) as scaled:
    ...         autograd.backward(scaled)
    >>> trainer.step(8)          # False when skipped for overflow
    True
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

    @contextlib.contextmanager
    def scale_loss(self, loss: Union[mx.nd.NDArray, List[mx.nd.NDArray], Tuple[mx.nd.NDArray, ...]]
                   ) -> Iterator[Union[mx.nd.NDArray, List[mx.nd.NDArray], Tuple[mx.nd.NDArray, ...]]]:
        """Context manager yielding `loss` (NDArray or list) times :attr:`loss_scale`.

        Call ``autograd.backward`` on it inside the block, as often as needed before one
        :meth:`step`.  `loss` is kept by reference until the step.  No host sync."""
        self._stage.check_new_loss()
        scaled = loss if self._loss_scaler is None else self._loss_scaler.scale(loss)
        self._scale_loss_open += 1
        try:
            yield scaled
        finally:
            self._scale_loss_open -= 1

    def unscale(self) -> None:
        """Divide every gradient by :attr:`loss_scale` in place, to inspect it before :meth:`step`.

        No host sync; clipping needs none.  ``RuntimeError`` twice in a step, inside
        :meth:`scale_loss`, or as :meth:`step`."""
        self._check_outside_scale_loss('unscale')
        self._check_scaled('unscale')
        self._stage.unscale()
        if self._loss_scaler is not None:
            factor = 1.0 / self._loss_scaler.loss_scale
            for grad in self._trainable_grads():
                grad *= factor

    def clip_global_norm(self, max_norm: float) -> float:
        """Clip the global 2-norm of the gradients at `max_norm`; return the norm before clipping.

        Once per step, after backward and before :meth:`step` (or :meth:`update`).  The norm of
        the unscaled gradients before ``1/batch_size``, in FP32 whatever their dtypes, summed
        over contexts and workers; ``max_norm / norm`` is folded into ``rescale_grad``.  A
        non-finite norm (returned as it is) skips the step.  **One host sync**, which is also
        the step's overflow verdict (docs/training.rst, "Gradient clipping").

        Raises
        ------
        ValueError
            When `max_norm` is not a positive finite number.
        RuntimeError
            Before backward, twice in a step, inside :meth:`scale_loss`, as :meth:`step`, and
            with a distributed kvstore that updates on its servers.
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
        # Once reduced, every context holds the same sum.
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

        For the ``allreduce_grads()`` / :meth:`update` split; no host sync.  ``RuntimeError``
        when already reduced (also by :meth:`clip_global_norm`) or in :meth:`scale_loss`."""
        self._check_outside_scale_loss('allreduce_grads')
        self._stage.check_reduce()
        super(Trainer, self).allreduce_grads()
        self._stage.reduced = True

    def _has_fresh_grads(self):
        return any(data._fresh_grad for param in self._params
                   if param.grad_req != 'null' and param._data is not None
                   for data in param.list_data())

    def _check_scaled(self, what):
        # New gradients only: a step without backward is gluon's stale-gradient error.
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
        grads = []
        for param in self._params:
            if param.grad_req != 'null' and param._data is not None:
                grads.extend(param.list_grad())
        return grads

    def _rescale(self, batch_size):
        scale = 1.0 if (self._loss_scaler is None or self._stage.unscaled) \
            else self._loss_scaler.loss_scale
        clip = 1.0 if self._stage.clip_coef is None else self._stage.clip_coef
        return self._scale / batch_size / scale * clip

    def init_kvstore(self) -> None:
        """Create the kvstore and broadcast worker 0's parameters now, on every worker.

        gluon does it at the first step, after a forward pass has moved every worker's
        BatchNorm statistics.  Waits for the initial pulls; no other host sync.  Idempotent."""
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()

    def _mark_consumed(self):
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
            # No kvstore agreed on a distributed verdict: name one for the loss check.
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
        """The first layer not finite, with `diagnose_net` (host syncs); else how to find it."""
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

    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> bool:
        """Reduce gradients, check them, and update the parameters or skip: True when applied.

        **One host sync** with loss scaling on (the verdict), none with ``loss_scale=None`` or
        after :meth:`clip_global_norm`; a skipped step adds one per loss of :meth:`scale_loss`.

        Parameters
        ----------
        batch_size : int
            Gradients are normalised by ``1/batch_size`` (and ``1/loss_scale``, folded in).
        ignore_stale_grad : bool, default False
            As for ``gluon.Trainer.step``.

        Raises
        ------
        RuntimeError
            Inside a :meth:`scale_loss` block; with loss scaling, on new gradients that
            missed :meth:`scale_loss` (:meth:`LossScaler.check_scaled`).
        FloatingPointError
            With ``at_min_scale='raise'``, as :meth:`LossScaler.update`.
        """
        self._check_outside_scale_loss('step')
        self._check_scaled('step')
        if self._loss_scaler is None and not self._stage.clipped and not self._stage.reduced:
            super(Trainer, self).step(batch_size, ignore_stale_grad)
            return self._finish(False)
        self.init_kvstore()
        rescale = self._rescale(batch_size)
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
            # After the reduction: sums that overflow count, and workers see the same gradients.
            overflow = self._has_overflow()
            if not overflow:
                self._update(ignore_stale_grad)
        return self._finish(overflow)

    def update(self, batch_size: int, ignore_stale_grad: bool = False) -> bool:
        """Check the reduced gradients and update or skip; True when applied.

        The ``allreduce_grads()`` / ``update()`` split (``update_on_kvstore=False``); host
        syncs and errors as :meth:`step`."""
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

    def state_dict(self) -> Dict[str, Any]:
        """``{'loss_scaler': LossScaler.state_dict() or None}``; :meth:`save_states` adds the
        optimizer states (momenta, master weights)."""
        return {'loss_scaler': None if self._loss_scaler is None
                else self._loss_scaler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.  ``KeyError`` on missing keys,
        ``ValueError`` for a scaler's state when loss scaling is off."""
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
        """Save optimizer states (master weights included) and the loss scaler's, in one file
        written whole or not at all (`mxamp.atomic_files`).  Host sync."""
        with replaced_on_success(fname) as temporary:
            super(Trainer, self).save_states(temporary)
            with open(temporary, 'rb') as f:
                inner = f.read()
            payload = pickle.dumps({'gluon_states': inner, 'mxamp': self.state_dict()})
            with open(temporary, 'wb') as f:
                f.write(_FILE_MAGIC + payload)

    def load_states(self, fname: str) -> None:
        """Load what :meth:`save_states` wrote, or a plain ``gluon.Trainer`` file (the scaler
        is then left as it is, with a warning)."""
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
