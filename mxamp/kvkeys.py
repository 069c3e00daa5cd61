"""The kvstore keys mxamp reserves (from ``2**28``; parameter ``i`` travels under ``i``), and
the overflow agreement sent under one of them (docs/training.rst, "Distributed kvstores").
Runs on kvstore servers inside ``import mxnet``, before ``mx.nd`` and ``mx.kvstore`` exist:
MXNet only through ``mx.ndarray``, and annotations stay unevaluated."""
from __future__ import annotations

import weakref
from typing import Optional

import mxnet as mx

__all__ = ['reserved_key', 'agree_overflow', 'store_overflow_sum', 'OVERFLOW_FLAG_SIZE']

#: The first key of each purpose; a purpose may use the keys after it, up to the next one.
_KEYS = {
    'resume': 2 ** 28,
    'statistics': 2 ** 29,
    'overflow': 2 ** 30 - 7,
}

#: Length of the value under ``reserved_key('overflow')``.
OVERFLOW_FLAG_SIZE = 4


def reserved_key(purpose: str) -> int:
    """The key of `purpose`, the same on every worker and server: ``'overflow'``, ``'resume'``
    (two keys) or ``'statistics'`` (the first of one key per value averaged over workers).
    Raises ``ValueError`` for another purpose."""
    try:
        return _KEYS[purpose]
    except KeyError:
        raise ValueError('no kvstore key is reserved for %r: expected one of %s'
                         % (purpose, ', '.join(sorted(_KEYS))))


def agree_overflow(kvstore: mx.kvstore.KVStore, bad: mx.ndarray.NDArray, rescale_grad: Optional[float],
                   initialized: weakref.WeakKeyDictionary) -> bool:
    """Sum the workers' non-finite counts `bad` (shape (1,), CPU): True when any is above 0.

    One ``pushpull``, host sync; every worker reaches the same verdict.  `rescale_grad`: the
    optimizer's when the servers run it, else None.  `initialized`: the kvstores whose key this
    caller has set.  Raises ``RuntimeError`` (before any gradient is pushed) when servers given
    `rescale_grad` run no mxamp optimizer."""
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
    """Server side: store the summed payload `merged` into `stored`, marked by a last 1.  Host
    sync.  Returns the workers' mean ``rescale_grad``, None when `merged` is no payload."""
    values = merged.asnumpy()
    rescale_grad = None
    if values.shape == (OVERFLOW_FLAG_SIZE,):
        if values[2] > 0:
            rescale_grad = float(values[1] / values[2])
        values[-1] = 1.0
    stored[:] = values
    return rescale_grad
