"""The kvstore keys mxamp reserves, and the overflow agreement sent under one of them.

This module owns:

* the reserved key space.  ``gluon.Trainer`` and ``Module`` push parameter
  ``i`` under key ``i``; keys from ``2**28`` on are left to the purposes of
  :func:`reserved_key`, which hands each its own, so that none collides with a
  parameter or with another purpose;
* both ends of the overflow agreement between distributed workers: what a
  worker pushes and reads back (:func:`agree_overflow`, for
  :class:`mxamp.LossScaler`), and what a kvstore server running an mxamp
  optimizer stores (:func:`store_overflow_sum`, for
  :class:`mxamp.optimizer.MultiPrecision`).

The payload, :data:`OVERFLOW_FLAG_SIZE` float32 values: each worker pushes
``[non-finite count, rescale_grad, 1, 0]`` and the kvstore sums them.  A server
running a mixed-in optimizer stores that sum with the last element set to 1
and adopts the workers' mean ``rescale_grad``.  A server without one keeps the
plain sum, last element 0: MXNet 1.9.1's server stores pushed sums as they are
when it has no optimizer, weights included, so with ``update_on_kvstore=True``
the workers must not go on.

mxamp.optimizer imports this module on kvstore servers, inside ``import mxnet``
(see :class:`mxamp.optimizer.MultiPrecision`), where ``mx.nd`` does not exist
yet: it reaches MXNet through ``mx.ndarray`` only.
"""
# Annotations stay unevaluated: on a kvstore server, inside `import mxnet`, mx.kvstore
# (named in them) is not there yet.
from __future__ import annotations

import weakref
from typing import Optional

import mxnet as mx

__all__ = ['reserved_key', 'agree_overflow', 'store_overflow_sum', 'OVERFLOW_FLAG_SIZE']

#: The first key of each purpose; a purpose may use the keys after it, up to the next one.
_KEYS = {
    # scripts/train_imagenet.py: which checkpoints every worker holds, then whether
    # every worker accepts its checkpoint's settings (two keys).
    'resume': 2 ** 28,
    # scripts/train_imagenet.py: BatchNorm statistics averaged over workers (one key each).
    'statistics': 2 ** 29,
    # LossScaler's overflow agreement (one key).
    'overflow': 2 ** 30 - 7,
}

#: Length of the value under ``reserved_key('overflow')``.
OVERFLOW_FLAG_SIZE = 4


def reserved_key(purpose: str) -> int:
    """The kvstore key reserved for `purpose`, the same on every worker and server.

    Parameters
    ----------
    purpose : str
        ``'overflow'`` (the loss scaler's agreement), ``'statistics'`` (values
        averaged over workers: the key of the first, the others follow) or
        ``'resume'`` (the checkpoints every worker holds, and the key after it:
        whether every worker accepts its checkpoint's settings).

    Raises
    ------
    ValueError
        For another purpose.
    """
    try:
        return _KEYS[purpose]
    except KeyError:
        raise ValueError('no kvstore key is reserved for %r: expected one of %s'
                         % (purpose, ', '.join(sorted(_KEYS))))


def agree_overflow(kvstore: mx.kvstore.KVStore, bad: mx.ndarray.NDArray, rescale_grad: Optional[float],
                   initialized: weakref.WeakKeyDictionary) -> bool:
    """Sum the workers' non-finite counts through `kvstore`; True when any is above 0.

    One ``pushpull`` of ``reserved_key('overflow')`` and one host sync.  Every
    worker pulls the same sum, so every worker reaches the same verdict (and
    raises the same error).

    Parameters
    ----------
    kvstore : KVStore
        A distributed kvstore.
    bad : NDArray
        Shape (1,), on the CPU: this worker's count of contexts with inf/NaN.
    rescale_grad : float or None
        The optimizer's ``rescale_grad`` when the servers run the optimizer
        (``update_on_kvstore=True``): they adopt the workers' mean and must run
        an mxamp optimizer.  None otherwise.
    initialized : weakref.WeakKeyDictionary
        The kvstores whose key this caller has initialised; updated here.

    Raises
    ------
    RuntimeError
        With `rescale_grad`, when the server runs no mxamp optimizer.  The usual
        cause: it could not unpickle it, which MXNet's server only logs; it then
        stores the pushed gradient sums as the weights.  Raised before any
        gradient is pushed.
    """
    key = reserved_key('overflow')
    cpu = mx.cpu()
    payload = mx.ndarray.concat(bad, mx.ndarray.array(
        [1.0 if rescale_grad is None else rescale_grad, 1.0, 0.0], ctx=cpu), dim=0)
    if kvstore not in initialized:
        kvstore.init(key, mx.ndarray.zeros((OVERFLOW_FLAG_SIZE,), ctx=cpu))
        initialized[kvstore] = True
    kvstore.pushpull(key, payload, out=payload)
    summed = payload.asnumpy()
    if rescale_grad is not None and summed[-1] != 1.0:
        raise RuntimeError(
            'mxamp: the kvstore server does not run the mxamp optimizer that '
            'update_on_kvstore=True sends it, so it would store summed gradients as '
            'weights.  Most likely it failed to unpickle it: MXNet 1.9.1 runs the server '
            'inside `import mxnet`, where importing a module that needs mxnet.gluon '
            'fails; see the server log ("Exception ignored on calling ctypes callback '
            'function").  Use update_on_kvstore=False (the default for distributed '
            'kvstores) or make mxamp importable on the server.')
    return bool(summed[0] > 0)


def store_overflow_sum(stored: mx.ndarray.NDArray, merged: mx.ndarray.NDArray) -> Optional[float]:
    """Server side: store the workers' summed payload `merged` into `stored`, marked.

    Sets the last element to 1 (this server runs an mxamp optimizer), so the
    workers pull the sum with that mark.  Synchronises the server with its engine.

    Returns
    -------
    float or None
        The workers' mean ``rescale_grad`` (loss scale and batch size folded
        in), which the server's copy of the optimizer cannot otherwise learn;
        None when `merged` is not a payload of :data:`OVERFLOW_FLAG_SIZE` values
        from at least one worker.
    """
    values = merged.asnumpy()
    rescale_grad = None
    if values.shape == (OVERFLOW_FLAG_SIZE,):
        if values[2] > 0:
            rescale_grad = float(values[1] / values[2])
        values[-1] = 1.0
    stored[:] = values
    return rescale_grad
