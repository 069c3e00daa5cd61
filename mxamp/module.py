"""Mixed-precision training with ``mx.mod.Module``: the Symbol API's `mxamp.Trainer`.

This module owns :class:`ModuleTrainer` and :class:`Float32Init` (MXNet's
initializers cannot fill the bfloat16 arrays such a Module binds).
:class:`ModuleTrainer` runs the training step of a
bound Module whose graph came from `mxamp.convert_symbol` (or
`mxamp.convert_model`): FP32 master weights (:mod:`mxamp.optimizer`), loss
scaling (:class:`mxamp.LossScaler`), the sum of the gradients over devices and
workers (bfloat16 included, which MXNet's kvstore servers abort on), and
checkpoints of the whole training state (parameters in FP32, optimizer states,
update counts, loss scaler), so that a resumed run continues bit-exactly.

MXNet internals relied on (MXNet 1.9.1):

* ``Module._exec_group``: ``param_names``, ``param_arrays``, ``grad_arrays``
  and ``aux_names``/``aux_arrays`` (per parameter, its array on every device:
  the initial broadcast, the gradient sum, the running statistics);
* ``Module._sync_params_from_devices``: ``get_params()`` returns a cache that
  only ``update()`` refreshes, but forward passes move BatchNorm's running
  statistics also when every step was skipped;
* ``Module._updater``'s ``get_states`` / ``set_states`` (the optimizer states
  of a checkpoint);
* ``mx.optimizer.Optimizer``'s ``_all_index_update_counts`` and
  ``_index_update_count`` (the per-weight update counts that bias corrections
  and schedules read: restored so a resumed run continues bit-exactly);
* through :meth:`mxamp.LossScaler.update_module`: ``Module._optimizer``,
  ``_kvstore`` and ``_update_on_kvstore``.
"""
import pickle
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

import mxnet as mx

from . import kvstore_transport
from . import optimizer as _mp_optimizer
from .atomic_files import replaced_on_success
from .dtypes import cast, name_of_array
from .fusion import check_trainable_symbol
from .loss_scaler import LossScaler, LossScalingState, head_gradients, make_loss_scaler

__all__ = ['ModuleTrainer', 'Float32Init']

_STATE_FORMAT = 'mxamp.ModuleTrainer/1'


class ModuleTrainer(LossScalingState):
    """Train a bound ``mx.mod.Module`` in mixed precision.

    The Symbol API's counterpart of :class:`mxamp.Trainer`: give it the Module
    of a converted graph and call :meth:`backward` and :meth:`step` instead of
    ``module.backward()`` and ``module.update()``.

    * The optimizer gets FP32 master weights for float16 and bfloat16 weights
      (:func:`mxamp.optimizer.create`).
    * The loss scale reaches the gradients through ``backward``'s head
      gradients, so the graph's outputs must be losses that take head
      gradients (a per-sample loss, e.g. ``-log_softmax`` picked at the label);
      ``SoftmaxOutput`` and ``MakeLoss`` ignore them.  Other outputs under
      ``BlockGrad`` (logits for metrics) are fine.
    * Gradients are summed over the Module's devices and, with a distributed
      kvstore, over workers, before the overflow check: every worker sees the
      same sums, so all of them skip the same steps.  The optimizer runs in
      this process (the states are here for :meth:`save_states`).
    * A skipped step whose loss (an output not under ``BlockGrad``) is not
      finite keeps the loss scale: the forward pass fails, which no scale
      fixes; one warning says so (``at_min_scale``, see
      :class:`mxamp.LossScaler`).  The workers agree on it through the kvstore.
    * Initial weights are broadcast from worker 0 (or device 0) at
      construction, as ``gluon.Trainer`` does.

    Parameters
    ----------
    module : mx.mod.Module
        Bound with ``for_training=True``, parameters initialised, no optimizer yet.
    optimizer : str or mxamp optimizer
        A name (``'sgd'``, ``'nag'``, ``'adam'``, ...: created with
        `optimizer_params` by :func:`mxamp.optimizer.create`) or an optimizer
        made by :func:`mxamp.optimizer.create`.
    optimizer_params : dict, optional
        Keyword arguments of the optimizer when `optimizer` is a name.  Without
        ``rescale_grad``, it is ``1 / (batch size x number of workers)``:
        gradients are sums over every sample of the step.
    kvstore : str or mx.kv.KVStore or None, default 'device'
        Where gradients are summed: a type for ``mx.kv.create`` (``'device'``,
        ``'local'``, ``'dist_sync'``, ...) or a KVStore.  A local kvstore is
        only created when the Module has more than one device.
    loss_scale : 'auto', 'dynamic', float, None or LossScaler, default 'auto'
        As for :class:`mxamp.Trainer`: ``'auto'`` is dynamic when a trainable
        parameter is float16, off otherwise.

    Examples
    --------
    >>> import mxnet as mx, mxamp
    >>> fc = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=1, name='fc')
    >>> loss = mx.sym.square(mx.sym.reshape(fc, (-1,)) - mx.sym.var('label'), name='loss')
    >>> sym = mxamp.convert_symbol(loss, 'float16', params=['fc_weight', 'fc_bias'],
    ...                            ctx=mx.cpu())
    >>> mod = mx.mod.Module(sym, data_names=['data'], label_names=['label'])
    >>> mod.bind(data_shapes=[('data', (8, 4))], label_shapes=[('label', (8,))])
    >>> mod.init_params(mx.init.Zero())
    >>> trainer = mxamp.ModuleTrainer(mod, 'sgd', {'learning_rate': 0.1})
    >>> batch = mx.io.DataBatch([mx.nd.full((8, 4), 0.01)], [mx.nd.full((8,), 0.01)])
    >>> mod.forward(batch, is_train=True)
    >>> trainer.backward()
    >>> trainer.step()          # False when skipped for overflow
    True
    """

    def __init__(self, module: mx.mod.Module, optimizer: Union[str, _mp_optimizer.MultiPrecision],
                 optimizer_params: Optional[Dict[str, Any]] = None,
                 kvstore: Union[str, mx.kv.KVStore, None] = 'device',
                 loss_scale: Union[str, float, LossScaler, None] = 'auto') -> None:
        if not isinstance(module, mx.mod.Module):
            raise TypeError('ModuleTrainer: module must be an mx.mod.Module, got %s'
                            % type(module).__name__)
        if not (module.binded and module.for_training and module.params_initialized):
            raise RuntimeError('ModuleTrainer: bind the module with for_training=True and call '
                               'init_params() first')
        check_trainable_symbol(module.symbol, 'ModuleTrainer')
        if module.optimizer_initialized:
            raise RuntimeError('ModuleTrainer: the module already has an optimizer; '
                               'ModuleTrainer creates it (do not call init_optimizer())')
        self._module = module
        group = module._exec_group
        self._kvstore = self._create_kvstore(kvstore, len(group.contexts))
        self._optimizer = self._create_optimizer(optimizer, optimizer_params or {})
        with warnings.catch_warnings():
            # Module warns when rescale_grad is not 1/batch: here it covers every
            # worker's batch, and the loss scale, on purpose.
            warnings.filterwarnings('ignore', message='Optimizer created manually')
            module.init_optimizer(kvstore=None, optimizer=self._optimizer)
        trainable = [per_device[0].dtype for per_device, grads
                     in zip(group.param_arrays, group.grad_arrays) if grads[0] is not None]
        self._loss_scaler = make_loss_scaler(loss_scale, trainable)
        self._ones: Dict[Any, Tuple[float, mx.nd.NDArray]] = {}
        # FP32 copies of bfloat16 weights and gradients, per kvstore key
        self._wire: Dict[int, List[mx.nd.NDArray]] = {}
        if self._kvstore is not None:
            # Every device and worker starts from worker 0's device-0 weights.
            for key, per_device in enumerate(group.param_arrays):
                kvstore_transport.broadcast(self._kvstore, key, per_device, self._wire)

    # -- construction --------------------------------------------------------------
    @staticmethod
    def _create_kvstore(kvstore, num_devices):
        if kvstore is None or isinstance(kvstore, mx.kv.KVStore):
            return kvstore
        if not isinstance(kvstore, str):
            raise TypeError('ModuleTrainer: kvstore must be a type name, a KVStore or None, '
                            'got %r' % (kvstore,))
        if 'dist' in kvstore or num_devices > 1:
            return mx.kv.create(kvstore)
        return None

    def _create_optimizer(self, optimizer, params):
        if isinstance(optimizer, str):
            params = dict(params)
            if 'rescale_grad' not in params:
                workers = self._kvstore.num_workers if self._kvstore is not None else 1
                params['rescale_grad'] = 1.0 / (self._module._exec_group.batch_size * workers)
            return _mp_optimizer.create(optimizer, **params)
        if params:
            raise ValueError('ModuleTrainer: optimizer_params are for an optimizer given by '
                             'name; %s is already created' % type(optimizer).__name__)
        if not isinstance(optimizer, _mp_optimizer.MultiPrecision):
            raise TypeError('ModuleTrainer: optimizer must be a name or made by '
                            'mxamp.optimizer.create() (FP32 master weights), got %s'
                            % type(optimizer).__name__)
        return optimizer

    # -- state ---------------------------------------------------------------------
    @property
    def module(self) -> mx.mod.Module:
        """The Module being trained."""
        return self._module

    @property
    def optimizer(self) -> _mp_optimizer.MultiPrecision:
        """The optimizer (with FP32 master weights)."""
        return self._optimizer

    @property
    def kvstore(self) -> Optional[mx.kv.KVStore]:
        """The KVStore summing gradients, or None (one device, one worker)."""
        return self._kvstore

    def aux_arrays(self) -> List[List[mx.nd.NDArray]]:
        """Per auxiliary state (BatchNorm's running statistics), its array on every device.

        The live arrays (not copies): for averaging the statistics over
        workers, whose data differ.
        """
        return self._module._exec_group.aux_arrays

    # -- the step --------------------------------------------------------------------
    def out_grads(self, outputs: Optional[Sequence[mx.nd.NDArray]] = None) -> List[mx.nd.NDArray]:
        """Head gradients for ``module.backward``: the loss scale, shaped like `outputs`.

        `outputs` defaults to ``module.get_outputs()``.  Calling this marks the
        step as scaled (as :meth:`backward` does), for who calls
        ``module.backward(out_grads=trainer.out_grads())`` directly.  No host sync.
        """
        outputs = self._module.get_outputs() if outputs is None else outputs
        if self._loss_scaler is not None:
            return self._loss_scaler.out_grads(outputs)
        return head_gradients(outputs, 1.0, self._ones)

    def backward(self) -> None:
        """``module.backward`` with the loss scale as head gradient.  No host sync."""
        self._module.backward(out_grads=self.out_grads())

    def step(self) -> bool:
        """Sum the gradients, then update the weights or skip the step on overflow.

        Call after :meth:`backward`, instead of ``module.update()``.
        **One host sync** with loss scaling (the overflow check), none without.
        A skipped step also reads the losses (one host sync per output and
        device; see :meth:`mxamp.LossScaler.update_module`).

        Returns
        -------
        bool
            True when the update was applied, False when it was skipped.

        Raises
        ------
        RuntimeError
            With loss scaling, when no :meth:`backward` (or :meth:`out_grads`)
            came since the last step: gradients from ``module.backward()``
            without head gradients are not scaled, and dividing them by the
            loss scale would shrink every update without a word.
        FloatingPointError
            With ``at_min_scale='raise'``, after skipping a step that overflows
            at the minimum loss scale or whose loss is not finite.
        """
        if self._loss_scaler is not None:
            self._loss_scaler.check_scaled('ModuleTrainer.step()',
                                           'call trainer.backward() instead of module.backward(): '
                                           'it passes the loss scale as head gradient')
        group = self._module._exec_group
        if self._kvstore is not None:
            for key, grads in enumerate(group.grad_arrays):
                if grads[0] is not None:
                    kvstore_transport.pushpull(self._kvstore, key, grads, self._wire)
        if self._loss_scaler is None:
            self._module.update()
            return True
        # The gradients were summed here, not by the module: the workers agree on a
        # skipped step's loss check through this kvstore.
        return self._loss_scaler.update_module(self._module, kvstore=self._kvstore)

    # -- checkpoints -------------------------------------------------------------------
    def save_params(self, fname: str) -> None:
        """Write the parameters in FP32 (``arg:``/``aux:`` names, as
        ``mx.model.save_checkpoint``): the FP32 network loads them too.  Host sync.
        Written whole or not at all (`mxamp.atomic_files`)."""
        self._module._sync_params_from_devices()
        arg, aux = self._module.get_params()
        values = {'arg:' + k: cast(v, 'float32') for k, v in arg.items()}
        values.update({'aux:' + k: cast(v, 'float32') for k, v in aux.items()})
        with replaced_on_success(fname) as temporary:
            mx.nd.save(temporary, values)

    def load_params(self, fname: str) -> None:
        """Load parameters saved by :meth:`save_params` (or any FP32 checkpoint), cast
        to the dtypes of the Module's graph.

        Raises
        ------
        KeyError
            When `fname` lacks parameters of the Module (all are named).
        """
        loaded = mx.nd.load(fname)
        arg, aux = self._module.get_params()
        missing = [kind + name for kind, values in (('arg:', arg), ('aux:', aux))
                   for name in values if kind + name not in loaded]
        if missing:
            raise KeyError('%s: missing parameters %s' % (fname, ', '.join(missing)))
        for kind, values in (('arg:', arg), ('aux:', aux)):
            for name, value in values.items():
                precision = name_of_array(value)
                stored = loaded[kind + name]
                # A floating parameter is rounded to its precision (bfloat16-safe
                # cast); any other (an integer table, a counter) keeps its values
                # and takes the graph's dtype, as mx.mod.Module.set_params does.
                values[name] = (cast(stored, precision) if precision is not None
                                else stored.astype(value.dtype))
        self._module.set_params(arg, aux, force_init=True)

    def state_dict(self) -> Dict[str, Any]:
        """Optimizer states, update counts and the loss scaler, picklable.  Host sync."""
        opt = self._optimizer
        return {'format': _STATE_FORMAT,
                'updater': self._module._updater.get_states(dump_optimizer=False),
                'num_update': opt.num_update,
                'index_update_counts': opt._all_index_update_counts,
                'loss_scaler': (None if self._loss_scaler is None
                                else self._loss_scaler.state_dict())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises
        ------
        ValueError
            When `state` is not a ModuleTrainer state, or its loss scaling does
            not match this trainer's (one has a scaler, the other not).
        """
        if not isinstance(state, dict) or state.get('format') != _STATE_FORMAT:
            raise ValueError('not a ModuleTrainer state (expected format %r)' % _STATE_FORMAT)
        if (state['loss_scaler'] is None) != (self._loss_scaler is None):
            raise ValueError('the state was saved %s loss scaling and this trainer runs %s it'
                             % (('without', 'with') if self._loss_scaler is not None
                                else ('with', 'without')))
        self._module._updater.set_states(state['updater'])
        opt = self._optimizer
        opt.num_update = state['num_update']
        opt._all_index_update_counts = state['index_update_counts']
        opt._index_update_count = opt._all_index_update_counts[0]
        if self._loss_scaler is not None:
            self._loss_scaler.load_state_dict(state['loss_scaler'])

    def save_states(self, fname: str) -> None:
        """Write :meth:`state_dict` to `fname` (pickle), whole or not at all.  Host sync."""
        state = self.state_dict()
        with replaced_on_success(fname) as temporary:
            with open(temporary, 'wb') as handle:
                pickle.dump(state, handle)

    def load_states(self, fname: str) -> None:
        """Restore what :meth:`save_states` wrote (see :meth:`load_state_dict`)."""
        with open(fname, 'rb') as handle:
            self.load_state_dict(pickle.load(handle))


class Float32Init(mx.init.Initializer):
    """Run an initializer in FP32 and cast its values into low-precision arrays.

    MXNet 1.9.1's random initializers reject bfloat16 outputs (``Module.init_params``
    fails on the first bfloat16 weight).  Drawing in FP32 and rounding also makes
    a mixed-precision network start from the FP32 network's weights for the same
    seed.

    Parameters
    ----------
    initializer : mx.init.Initializer
        The initializer to run, e.g. ``mx.init.Xavier(magnitude=2)``.

    Examples
    --------
    With a Module: ``mod.init_params(mxamp.Float32Init(mx.init.Xavier(magnitude=2)))``.
    On one array:

    >>> init = mxamp.Float32Init(mx.init.Xavier(magnitude=2))
    >>> weight = mxamp.dtypes.cast(mx.nd.zeros((2, 4)), 'bfloat16')
    >>> init(mx.init.InitDesc('fc_weight'), weight)
    >>> mxamp.dtypes.name_of_array(weight), bool((mxamp.dtypes.to_float32_numpy(weight) != 0).all())
    ('bfloat16', True)
    """

    def __init__(self, initializer: mx.init.Initializer) -> None:
        super(Float32Init, self).__init__()
        self.initializer = initializer

    def dumps(self) -> str:
        return self.initializer.dumps()

    def __call__(self, desc: mx.init.InitDesc, arr: mx.nd.NDArray) -> None:
        precision = name_of_array(arr)
        if precision in (None, 'float32'):
            self.initializer(desc, arr)
            return
        staging = mx.nd.zeros(arr.shape, ctx=arr.context, dtype=np.float32)
        self.initializer(desc, staging)
        cast(staging, precision).copyto(arr)
