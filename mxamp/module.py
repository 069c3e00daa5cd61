"""Mixed-precision training with ``mx.mod.Module``: the Symbol API's `mxamp.Trainer`.

Owns :class:`ModuleTrainer` (master weights, loss scaling, gradient sums over devices and
workers, checkpoints of the whole state for a bit-exact resume) and :class:`Float32Init`.

MXNet internals relied on (MXNet 1.9.1): ``Module._exec_group``'s ``param_names``,
``param_arrays``, ``grad_arrays``, ``aux_names``, ``aux_arrays`` (per device);
``Module._sync_params_from_devices`` (``get_params()`` is a cache only ``update()`` refreshes,
yet forward passes move BatchNorm statistics); ``Module._updater``'s
``get_states``/``set_states``; ``Optimizer._all_index_update_counts``, ``_index_update_count``
(bias corrections and schedules read them); via :meth:`mxamp.LossScaler.update_module`:
``Module._optimizer``, ``_kvstore``, ``_update_on_kvstore``."""
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
    """Train a bound ``mx.mod.Module`` in mixed precision: :class:`mxamp.Trainer` for symbols.

    Call :meth:`backward` and :meth:`step` instead of ``module.backward()`` and
    ``module.update()``.  The loss scale travels as head gradients: outputs must be per-sample
    losses (``SoftmaxOutput`` and ``MakeLoss`` ignore them) or under ``BlockGrad``.  Sums over
    devices and workers precede the check: all workers skip the same steps.  `module`: bound for
    training, initialised, without optimizer.  `optimizer`: a name with `optimizer_params`
    (``rescale_grad`` defaults to ``1 / (batch size x workers)``) or one from
    :func:`mxamp.optimizer.create`.  `kvstore` sums the gradients (``'device'``: only for
    several devices); `loss_scale` as for :class:`mxamp.Trainer`.

    Examples
    --------
    >>> fc = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=1, name='fc')
    >>> loss = mx.sym.square(mx.sym.reshape(fc, (-1,)) - mx.sym.var('label'), name='loss')
    >>> sym = mxamp.convert_symbol(loss, 'float16', params=['fc_weight', 'fc_bias'], ctx=mx.cpu())
    >>> mod = mx.mod.Module(sym, data_names=['data'], label_names=['label'])
    >>> mod.bind(data_shapes=[('data', (8, 4))], label_shapes=[('label', (8,))])
    >>> mod.init_params(mx.init.Zero())
    >>> trainer = mxamp.ModuleTrainer(mod, 'sgd', {'learning_rate': 0.1})
    >>> mod.forward(mx.io.DataBatch([mx.nd.zeros((8, 4))], [mx.nd.zeros((8,))]), is_train=True)
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
            # rescale_grad covers every worker's batch and the loss scale, on purpose.
            warnings.filterwarnings('ignore', message='Optimizer created manually')
            module.init_optimizer(kvstore=None, optimizer=self._optimizer)
        trainable = [per_device[0].dtype for per_device, grads
                     in zip(group.param_arrays, group.grad_arrays) if grads[0] is not None]
        self._loss_scaler = make_loss_scaler(loss_scale, trainable)
        self._ones: Dict[Any, Tuple[float, mx.nd.NDArray]] = {}
        self._wire: Dict[int, List[mx.nd.NDArray]] = {}
        if self._kvstore is not None:
            for key, per_device in enumerate(group.param_arrays):
                kvstore_transport.broadcast(self._kvstore, key, per_device, self._wire)

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
        """The live arrays of each auxiliary state (BatchNorm statistics), per device."""
        return self._module._exec_group.aux_arrays

    def out_grads(self, outputs: Optional[Sequence[mx.nd.NDArray]] = None) -> List[mx.nd.NDArray]:
        """Head gradients (the loss scale) like `outputs`; marks the step scaled.  No host sync."""
        outputs = self._module.get_outputs() if outputs is None else outputs
        if self._loss_scaler is not None:
            return self._loss_scaler.out_grads(outputs)
        return head_gradients(outputs, 1.0, self._ones)

    def backward(self) -> None:
        """``module.backward`` with the loss scale as head gradient.  No host sync."""
        self._module.backward(out_grads=self.out_grads())

    def step(self) -> bool:
        """Sum the gradients, then update the weights or skip on overflow: True when applied.

        **One host sync** with loss scaling, none without; a skipped step also reads the losses.
        ``RuntimeError`` (loss scaling) when no :meth:`backward` came since the last step."""
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
        # Summed here, not by the module: workers agree on the loss check through this kvstore.
        return self._loss_scaler.update_module(self._module, kvstore=self._kvstore)

    def save_params(self, fname: str) -> None:
        """Write the parameters in FP32 (as ``mx.model.save_checkpoint``), whole.  Host sync."""
        self._module._sync_params_from_devices()
        arg, aux = self._module.get_params()
        values = {'arg:' + k: cast(v, 'float32') for k, v in arg.items()}
        values.update({'aux:' + k: cast(v, 'float32') for k, v in aux.items()})
        with replaced_on_success(fname) as temporary:
            mx.nd.save(temporary, values)

    def load_params(self, fname: str) -> None:
        """Load an FP32 checkpoint into the graph's dtypes; ``KeyError`` names missing ones."""
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
                # Others (an integer table, a counter) keep their values, as set_params does.
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
        """Restore :meth:`state_dict`; ``ValueError`` for another format or loss scaling."""
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
    """Run `initializer` in FP32 and cast its values into low-precision arrays.

    MXNet 1.9.1's random initializers reject bfloat16; and a seed gives the FP32 net's weights.

    Examples
    --------
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
