"""Arrays through MXNet's kvstores: bfloat16 as FP32, each key in one dtype.

This module owns :class:`Bfloat16KVStoreTrainer`, the layer of
:class:`mxamp.Trainer` that moves parameters and gradients through the kvstore.
MXNet 1.9.1's kvstore servers abort on bfloat16 ("Unknown type enum 12"), so
with a distributed kvstore the initial values and the gradients of dense
bfloat16 parameters cross it as FP32 copies (one buffer per parameter and
context, allocated once), the FP32 sum is rounded back into the gradient once,
and the updates run on the workers.  float16 and FP32 arrays, and every array
with a local kvstore (which sums bfloat16 correctly), take gluon's own path.
With a distributed kvstore it also broadcasts every initial value in the
default layout (MXNet's own broadcast aborts the server on a oneDNN-layout
value, as an inference pass leaves them) and waits for the initial pulls
(see :meth:`Bfloat16KVStoreTrainer._init_params`).  :func:`broadcast` and
:func:`pushpull` do the same for arrays outside a gluon Trainer
(:class:`mxamp.ModuleTrainer`, running statistics averaged over workers).

MXNet internals relied on (MXNet 1.9.1):

* ``gluon.Trainer``: ``_params`` (the parameters in kvstore-key order),
  ``_param2idx`` (a parameter's key, for the FP32 broadcast of bfloat16
  values), ``_params_to_init`` and ``_init_params`` (the initial broadcast,
  overridden to send bfloat16 as FP32 and to wait for the pulls),
  ``_allreduce_grads`` (overridden: bfloat16 gradients through FP32),
  ``_kvstore`` and ``_distributed``;
* ``gluon.Parameter``: ``_data`` (None before initialisation),
  ``_deferred_init`` (shape still unknown), ``_stype`` (only dense bfloat16
  crosses the kvstore as FP32) and ``_check_and_get`` (the arrays of every
  context, for that broadcast).
"""
from typing import Any, Dict, Iterable, List, Optional, Union

import numpy as np

import mxnet as mx
from mxnet import gluon

from .dtypes import amp_cast, cast_into, name_of_array, param_precision

__all__ = ['Bfloat16KVStoreTrainer', 'ParamsLike', 'broadcast', 'init_zeros', 'pushpull']

#: The parameters a ``gluon.Trainer`` takes: a ``ParameterDict``, a dict of them by
#: name, or a list.
ParamsLike = Union[gluon.ParameterDict, Dict[str, gluon.Parameter], Iterable[gluon.Parameter]]


def _on_the_wire(key, arrays, buffers=None):
    """What crosses the kvstore for `arrays` (one per device, one dtype): FP32 copies
    of bfloat16 ones, the others themselves.

    A key keeps the byte size it was initialised with, so its values and its
    gradients must travel in the same dtype.  `buffers`, a dict owned by the
    caller, keeps the FP32 copies per key, allocated once and refilled after.
    ``amp_cast``: a weight may still hold a oneDNN blocked layout.
    """
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
    """Initialise `key` with ``arrays[0]`` of worker 0 and pull it into every array.

    bfloat16 travels as FP32.  Every worker must call it, with the same key
    and shape.  Waits for the pulls (a later push of other arrays under the
    same key could otherwise be served first).  The initial value is sent in
    the default layout: MXNet 1.9.1's ``KVStoreDist::Init`` pushes it without
    the merge step that brings every later push out of a oneDNN blocked layout,
    and an inference pass leaves weights and BatchNorm statistics in one; that
    push then fails inside MXNet's engine, unseen, and the server aborts at the
    first pull ("init K first").

    Parameters
    ----------
    kvstore : mx.kv.KVStore
    key : int
    arrays : list of NDArray
        One array per device, same shape; overwritten.
    buffers : dict, optional
        The FP32 copies of bfloat16 arrays, per key, kept for later calls.
    """
    wire = _on_the_wire(key, arrays, buffers)
    first = wire[0] if wire is not arrays else amp_cast(arrays[0], arrays[0].dtype)
    kvstore.init(key, first)
    kvstore.pull(key, out=wire, priority=-key)
    _back_from_the_wire(wire, arrays)
    for array in arrays:
        array.wait_to_read()


def init_zeros(kvstore: mx.kv.KVStore, key: int, like: mx.nd.NDArray) -> None:
    """Initialise `key` with zeros shaped like `like`, in the dtype `like` travels in.

    For keys that are only summed (:func:`pushpull`), never broadcast.
    """
    kvstore.init(key, _on_the_wire(key, [like])[0].zeros_like())


def pushpull(kvstore: mx.kv.KVStore, key: int, arrays: List[mx.nd.NDArray],
             buffers: Optional[Dict[int, List[mx.nd.NDArray]]] = None) -> None:
    """Sum `arrays` (one per device) over devices and workers, in place.  No host sync.

    bfloat16 travels as FP32 and the sum is rounded back once; other dtypes
    travel as they are.  `key` must have been initialised by :func:`broadcast`
    or :func:`init_zeros`.  `buffers`: as for :func:`broadcast` (a step then
    allocates no FP32 copy).
    """
    wire = _on_the_wire(key, arrays, buffers)
    kvstore.pushpull(key, wire, out=wire, priority=-key)
    _back_from_the_wire(wire, arrays)


def _as_param_list(params: ParamsLike) -> List[gluon.Parameter]:
    if isinstance(params, (dict, gluon.ParameterDict)):
        return list(params.values())
    return list(params)


class Bfloat16KVStoreTrainer(gluon.Trainer):
    """``gluon.Trainer`` whose bfloat16 parameters train over a distributed kvstore.

    Parameters are those of ``gluon.Trainer``.  With a distributed kvstore and
    any bfloat16 parameter, `update_on_kvstore` becomes False (the servers
    cannot run updates on bfloat16), and True raises ``ValueError``, as does
    ``dist_async`` (it always updates on the servers).  With a distributed
    kvstore the initial broadcast is `broadcast`'s; otherwise it is gluon's
    Trainer unchanged.  Adds no host sync to a step; with a distributed
    kvstore, the initial pulls are waited for once.

    Raises
    ------
    ValueError
        With bfloat16 parameters and a distributed kvstore, for
        ``update_on_kvstore=True`` and for an asynchronous kvstore.
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
        # gluon.Trainer internals: _params_to_init, _param2idx, Parameter._data,
        # _deferred_init, _stype.  With a distributed kvstore every dense value is
        # broadcast by `broadcast` (bfloat16 as FP32 copies, every value in the
        # default layout: gluon's own broadcast aborts the server on a value that an
        # inference pass left in a oneDNN layout); sparse ones take gluon's path (an
        # init, no pull).  `broadcast` waits for its pulls: the initial weights are
        # pulled under the keys the gradients are pushed to next, the pull (writes the
        # weights) and the push (reads the gradients) share no array, so MXNet's
        # engine could send the push first, and with update_on_kvstore=False the
        # server would serve the pull the gradient sum.
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
        """Sum the gradients over contexts and workers (gluon's, plus bfloat16 via FP32).

        With a distributed kvstore, each bfloat16 gradient is cast into an FP32
        buffer (allocated once per parameter and context), push-pulled, and the
        FP32 sum is cast back into the gradient (rounded once).  Everything else
        takes gluon's path: float16 gradients are summed in float16.  No host sync.
        """
        if not (self._kvstore and self._fp32_reduce):
            super(Bfloat16KVStoreTrainer, self)._allreduce_grads()
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
                pushpull(self._kvstore, index, grads, self._fp32_buffers)
            else:
                self._kvstore.pushpull(index, grads, priority=-index)
