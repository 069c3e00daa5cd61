"""Arrays through MXNet's kvstores: bfloat16 as FP32, each key in one dtype.

Owns :class:`Bfloat16KVStoreTrainer`, the layer of :class:`mxamp.Trainer` that moves
parameters and gradients through the kvstore, and :func:`broadcast` / :func:`pushpull` for
arrays outside a gluon Trainer (:class:`mxamp.ModuleTrainer`, statistics averaged over
workers).  MXNet 1.9.1's kvstore servers abort on bfloat16, so with a distributed kvstore
dense bfloat16 arrays cross as FP32 copies (docs/training.rst, "Distributed kvstores").

MXNet internals relied on (MXNet 1.9.1):

* ``gluon.Trainer``: ``_params`` (kvstore-key order), ``_param2idx``, ``_params_to_init`` and
  ``_init_params`` (overridden: the initial broadcast), ``_allreduce_grads`` (overridden),
  ``_kvstore``, ``_distributed``;
* ``gluon.Parameter``: ``_data`` (None before initialisation), ``_deferred_init``,
  ``_stype`` and ``_check_and_get`` (the arrays of every context)."""
from typing import Any, Dict, Iterable, List, Optional, Union

import numpy as np

import mxnet as mx
from mxnet import gluon

from .dtypes import amp_cast, cast_into, name_of_array, param_precision

__all__ = ['Bfloat16KVStoreTrainer', 'ParamsLike', 'broadcast', 'init_zeros', 'pushpull']

#: The parameters a ``gluon.Trainer`` takes: a ``ParameterDict``, a dict by name, or a list.
ParamsLike = Union[gluon.ParameterDict, Dict[str, gluon.Parameter], Iterable[gluon.Parameter]]


def _on_the_wire(key, arrays, buffers=None):
    """What crosses the kvstore for `arrays` (one per device): FP32 copies of bfloat16 ones,
    kept in `buffers[key]` when given, else the arrays.  A key keeps the byte size it was
    initialised with; ``amp_cast`` reads a weight's oneDNN blocked layout."""
    if name_of_array(arrays[0]) != 'bfloat16':
        return arrays
    wire = None if buffers is None else buffers.get(key)
    if wire is None:
        wire = [amp_cast(a, np.float32) for a in arrays]
        if buffers is not None:
            buffers[key] = wire
    else:
        for array, buf in zip(arrays, wire):
            amp_cast(array, np.float32, out=buf)
    return wire


def _back_from_the_wire(wire, arrays):
    for value, target in zip(wire, arrays):
        if value is not target:
            cast_into(value, target)


def broadcast(kvstore: mx.kv.KVStore, key: int, arrays: List[mx.nd.NDArray],
              buffers: Optional[Dict[int, List[mx.nd.NDArray]]] = None) -> None:
    """Initialise `key` with worker 0's ``arrays[0]`` and pull it into every array (one per
    device, overwritten); every worker calls it.  bfloat16 travels as FP32 (copies kept in
    `buffers`).  Waits for the pulls.  Sent in the default layout: MXNet 1.9.1's
    ``KVStoreDist::Init`` aborts the server on a oneDNN-layout value ("init K first")."""
    wire = _on_the_wire(key, arrays, buffers)
    first = wire[0] if wire is not arrays else amp_cast(arrays[0], arrays[0].dtype)
    kvstore.init(key, first)
    kvstore.pull(key, out=wire, priority=-key)
    _back_from_the_wire(wire, arrays)
    for array in arrays:
        array.wait_to_read()


def init_zeros(kvstore: mx.kv.KVStore, key: int, like: mx.nd.NDArray) -> None:
    """Initialise `key` with zeros like `like`, in its wire dtype, for :func:`pushpull` only."""
    kvstore.init(key, _on_the_wire(key, [like])[0].zeros_like())


def pushpull(kvstore: mx.kv.KVStore, key: int, arrays: List[mx.nd.NDArray],
             buffers: Optional[Dict[int, List[mx.nd.NDArray]]] = None) -> None:
    """Sum `arrays` (one per device) over devices and workers, in place.  No host sync.

    bfloat16 travels as FP32 (copies kept in `buffers`) and is rounded back once.  `key` comes
    from :func:`broadcast` or :func:`init_zeros`."""
    wire = _on_the_wire(key, arrays, buffers)
    kvstore.pushpull(key, wire, out=wire, priority=-key)
    _back_from_the_wire(wire, arrays)


def _as_param_list(params: ParamsLike) -> List[gluon.Parameter]:
    if isinstance(params, (dict, gluon.ParameterDict)):
        return list(params.values())
    return list(params)


class Bfloat16KVStoreTrainer(gluon.Trainer):
    """``gluon.Trainer`` whose bfloat16 parameters train over a distributed kvstore.

    Parameters as ``gluon.Trainer``.  With a distributed kvstore and bfloat16 parameters the
    updates run on the workers (``update_on_kvstore=True`` and ``dist_async`` raise
    ``ValueError``) and initial values go through :func:`broadcast`, waited for once;
    otherwise it is gluon's Trainer.  No host sync added to a step.
    """

    def __init__(self, params: ParamsLike, optimizer: Union[str, mx.optimizer.Optimizer],
                 optimizer_params: Optional[Dict[str, Any]] = None,
                 kvstore: Union[str, mx.kv.KVStore, None] = 'device',
                 compression_params: Optional[Dict[str, Any]] = None,
                 update_on_kvstore: Optional[bool] = None) -> None:
        self._fp32_buffers: Dict[int, List[mx.nd.NDArray]] = {}
        kv_type = kvstore if isinstance(kvstore, str) else (getattr(kvstore, 'type', '') or '')
        self._fp32_reduce = 'dist' in kv_type and any(
            param_precision(p) == 'bfloat16' for p in _as_param_list(params))
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
        super(Bfloat16KVStoreTrainer, self).__init__(
            params, optimizer, optimizer_params, kvstore=kvstore,
            compression_params=compression_params, update_on_kvstore=update_on_kvstore)

    def _is_fp32_reduced(self, param):
        """Whether `param`'s values and gradients cross the kvstore as FP32 copies."""
        return (self._fp32_reduce and param._stype == 'default'
                and name_of_array(param) == 'bfloat16')

    def _init_params(self):
        # Dense values through `broadcast` (sparse: gluon's init), which waits: the engine could
        # push the next gradients under these keys first, and the pull would get their sum.
        if self._kvstore and self._distributed:
            rest = []
            for param in self._params_to_init:
                if param._deferred_init or param._stype != 'default':
                    rest.append(param)
                    continue
                broadcast(self._kvstore, self._param2idx[param.name],
                          param._check_and_get(param._data, list), self._fp32_buffers)
            self._params_to_init = rest
        super(Bfloat16KVStoreTrainer, self)._init_params()

    def _allreduce_grads(self):
        """gluon's, with bfloat16 gradients summed through FP32 buffers.  No host sync."""
        if not (self._kvstore and self._fp32_reduce):
            super(Bfloat16KVStoreTrainer, self)._allreduce_grads()
            return
        # gluon's _allreduce_grads with update_on_kvstore=False (forced in __init__).
        for index, param in enumerate(self._params):
            if param.grad_req == 'null':
                continue
            grads = param.list_grad()
            if grads[0].stype != 'default':
                self._kvstore.push(index, grads, priority=-index)
                self._kvstore.pull(index, grads, priority=-index, ignore_sparse=True)
            elif self._is_fp32_reduced(param):
                pushpull(self._kvstore, index, grads, self._fp32_buffers)
            else:
                self._kvstore.pushpull(index, grads, priority=-index)
