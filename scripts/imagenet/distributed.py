"""What the workers of a distributed kvstore agree on, beside the gradients: the
BatchNorm statistics (`average_statistics`), the epoch a resume starts from
(`common_epochs`) and whether any worker refuses to resume (`refusing_workers`).

Each is one push-pull on keys that ``mxamp.kvkeys`` reserves, clear of the
parameters' keys; every worker must call it.
"""
import numpy as np
import mxnet as mx

from mxamp import kvkeys, kvstore_transport

# Keys for BatchNorm statistics (consecutive from this one), clear of every other key.
_STATS_KEY = kvkeys.reserved_key('statistics')


def average_statistics(kvstore, stats, initialized):
    """Replace running statistics by their mean over devices and workers.

    Data-parallel workers see different images, so their BatchNorm running
    means and variances drift apart (the weights do not).  Averaging them at the
    end of each epoch makes every worker validate and checkpoint the same model.

    Parameters
    ----------
    kvstore : mx.kv.KVStore
    stats : list of list of NDArray
        Per statistic, its array on every device.
    initialized : set
        Keys already initialised in `kvstore` (updated here).
    """
    for index, per_device in enumerate(stats):
        key = _STATS_KEY + index
        if key not in initialized:
            kvstore_transport.init_zeros(kvstore, key, per_device[0])
            initialized.add(key)
        kvstore_transport.pushpull(kvstore, key, per_device)
        for array in per_device:
            array *= 1.0 / (kvstore.num_workers * len(per_device))


# Key of the resume agreement, clear of every other key.
_RESUME_KEY = kvkeys.reserved_key('resume')
_RESUME_SLOTS = 4096


def common_epochs(kvstore, epochs):
    """Of `epochs` (this worker's complete checkpoints), those every worker has.

    A worker killed during a save has one checkpoint fewer than the others;
    resuming workers from different epochs would train different models and
    hang at the end.  One push-pull of a vector with a 1 per epoch held;
    epochs from 4096 on are ignored.  Every worker must call it.
    """
    held = np.zeros(_RESUME_SLOTS, dtype=np.float32)
    for epoch in epochs:
        if 0 <= epoch < _RESUME_SLOTS:
            held[epoch] = 1.0
    counts = mx.nd.array(held)
    kvstore.init(_RESUME_KEY, mx.nd.zeros(_RESUME_SLOTS))
    kvstore.pushpull(_RESUME_KEY, counts, out=counts)
    return [int(e) for e in np.nonzero(counts.asnumpy() >= kvstore.num_workers)[0]]


# The resume purpose's second key (kvkeys: a purpose may use the keys after its own).
_SETTINGS_KEY = _RESUME_KEY + 1


def refusing_workers(kvstore, refuses):
    """Ranks of the workers that refuse to resume; `refuses`: whether this one does.

    One push-pull of a vector with a 1 per refusing worker.  Every worker must
    call it.
    """
    flags = np.zeros(kvstore.num_workers, dtype=np.float32)
    flags[kvstore.rank] = float(refuses)
    value = mx.nd.array(flags)
    kvstore.init(_SETTINGS_KEY, mx.nd.zeros(kvstore.num_workers))
    kvstore.pushpull(_SETTINGS_KEY, value, out=value)
    return [int(rank) for rank in np.nonzero(value.asnumpy())[0]]
