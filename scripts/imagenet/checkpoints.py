"""Checkpoint files: writing them atomically, listing, pruning, cleaning up after a
killed run, and choosing the one a resume continues from (`resume_point`); the
best validation's parameters (`save_best`).

A checkpoint of epoch E is ``<prefix>-<E>.params``, ``.states`` and ``.json``
(`paths`); it counts once its JSON exists.  ``<prefix>-best.params`` and
``<prefix>-best.json`` (`best_paths`) sit beside them: no checkpoint, no
states, the parameters of the epoch with the best validation top-1 so far.
"""
import json
import logging
import os
import re

from .distributed import common_epochs
from .jsonio import dump_json
from .options import UsageError

_LOG = logging.getLogger('train_imagenet')


def paths(directory, prefix, epoch):
    """The checkpoint of epoch `epoch`: its ``.params``, ``.states`` and ``.json``."""
    stem = os.path.join(directory, '%s-%04d' % (prefix, epoch))
    return stem + '.params', stem + '.states', stem + '.json'


def best_paths(directory, prefix):
    """The best validation's ``<prefix>-best.params`` and ``<prefix>-best.json``."""
    stem = os.path.join(directory, '%s-best' % prefix)
    return stem + '.params', stem + '.json'


def _fsync(path):
    """Flush a file's (or a directory's) contents to disk: a rename after it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(runner, directory, prefix, epoch, meta):
    """Write epoch `epoch`'s params, states and JSON, each atomically, JSON last.

    The JSON is the commit: a checkpoint counts only once its JSON exists, and
    the files of earlier epochs are never touched, so a kill (even ``kill -9``)
    at any moment leaves the previous checkpoint loadable.  Each file is written
    under a temporary name, flushed to disk and renamed; an older checkpoint of
    the same epoch (a run resumed from an earlier epoch) loses its JSON before
    any of its files is replaced, so a checkpoint never mixes two runs' files.
    """
    params_file, states_file, json_file = paths(directory, prefix, epoch)
    tmp = '.tmp-%d' % os.getpid()
    try:
        runner.save(params_file + tmp, states_file + tmp)
        _fsync(params_file + tmp)
        _fsync(states_file + tmp)
        if os.path.exists(json_file):
            os.remove(json_file)
        os.replace(params_file + tmp, params_file)
        os.replace(states_file + tmp, states_file)
        with open(json_file + tmp, 'w') as handle:
            dump_json(dict(meta, epoch=epoch, params=os.path.basename(params_file),
                           states=os.path.basename(states_file)), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(json_file + tmp, json_file)
        _fsync(directory)
    finally:
        for path in (params_file + tmp, states_file + tmp, json_file + tmp):
            if os.path.exists(path):
                os.remove(path)


def save_best(runner, directory, prefix, epoch, metrics):
    """Write epoch `epoch`'s parameters as the best so far (its `metrics`, the row of
    the metrics CSV, in the JSON); returns the params file's path.

    Atomic like `save_checkpoint`: the old JSON goes first, so the JSON present
    always describes the parameters beside it.
    """
    params_file, json_file = best_paths(directory, prefix)
    tmp = '.tmp-%d' % os.getpid()
    try:
        runner.save_params(params_file + tmp)
        _fsync(params_file + tmp)
        if os.path.exists(json_file):
            os.remove(json_file)
        os.replace(params_file + tmp, params_file)
        with open(json_file + tmp, 'w') as handle:
            dump_json({'epoch': epoch, 'params': os.path.basename(params_file),
                       'val_top1': metrics['val_top1'], 'val_top5': metrics['val_top5'],
                       'metrics': metrics}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(json_file + tmp, json_file)
        _fsync(directory)
    finally:
        for path in (params_file + tmp, json_file + tmp):
            if os.path.exists(path):
                os.remove(path)
    return params_file


_TMP_NAME = re.compile(r'\.tmp-(\d+)(\.mxamp-\d+\.tmp)?$')


def remove_stale_tmp(directory, prefix):
    """Delete temporary files that a killed run of `prefix` left in `directory`.

    A process killed during :func:`save_checkpoint` (or while rewriting the
    metrics) leaves ``<name>.tmp-<pid>`` files; they never count as a
    checkpoint.  A converted network's ``save_parameters`` writes through
    `mxamp.atomic_files`, whose own temporary is hidden:
    ``.<name>.tmp-<pid>.mxamp-<pid>.tmp``.  Those of processes still alive
    are kept.  Returns the names removed.
    """
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        match = _TMP_NAME.search(name)
        bare = name[1:] if match and match.group(2) and name.startswith('.') else name
        if not (match and bare.startswith(prefix + '-')):
            continue
        pid = int(match.group(1))
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
                continue            # its writer still runs
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        try:
            os.remove(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return sorted(removed)


def list_checkpoints(directory, prefix):
    """Epochs with a complete checkpoint (JSON and the files it names), ascending."""
    epochs = []
    if not os.path.isdir(directory):
        return epochs
    head = prefix + '-'
    for name in os.listdir(directory):
        if not (name.startswith(head) and name.endswith('.json')):
            continue
        stem = name[len(head):-len('.json')]
        if not stem.isdigit():
            continue
        try:
            with open(os.path.join(directory, name)) as handle:
                meta = json.load(handle)
        except (OSError, ValueError):
            continue
        if all(os.path.isfile(os.path.join(directory, meta.get(k, '-'))) for k in
               ('params', 'states')):
            epochs.append(int(stem))
    return sorted(epochs)


def prune_checkpoints(directory, prefix, keep):
    """Delete all but the newest `keep` checkpoints (JSON first: never a half one)."""
    for epoch in list_checkpoints(directory, prefix)[:-keep] if keep else []:
        params_file, states_file, json_file = paths(directory, prefix, epoch)
        for path in (json_file, params_file, states_file):
            if os.path.exists(path):
                os.remove(path)


def resume_point(args, save_dir, prefix, rank, dist_kvstore):
    """The checkpoint to continue from: ``(epoch, directory)``, or ``(None, None)``.

    None when no resume was asked for, or for ``--resume auto`` without a
    checkpoint (logged).  Raises `UsageError` when ``--resume`` or
    ``--resume-epoch`` finds none.  With `dist_kvstore`, every worker must call
    it: they agree on the newest epoch that all of them hold.
    """
    if args.resume is None and args.resume_epoch is None:
        return None, None
    own = list_checkpoints(save_dir, prefix)
    # Worker r > 0 may have been killed before its copy of a checkpoint was
    # complete; rank 0's copy (the same bytes) serves when this machine sees it.
    available = sorted(set(own) | set(list_checkpoints(args.save_dir, prefix)
                                      if rank > 0 else ()))
    if args.resume_epoch is not None:
        available = [e for e in available if e == args.resume_epoch]
    if dist_kvstore is not None:   # every worker must continue from the same epoch
        available = common_epochs(dist_kvstore, available)
    where = '%s in %s%s' % (prefix, save_dir,
                            '' if dist_kvstore is None else ' that every worker has')
    if available:
        epoch = available[-1]
        return epoch, save_dir if epoch in own else args.save_dir
    if args.resume_epoch is not None:
        raise UsageError('--resume-epoch %d: no checkpoint of that epoch of %s'
                         % (args.resume_epoch, where))
    if args.resume != 'auto':
        raise UsageError('--resume: no checkpoint of %s (--resume auto starts from scratch '
                         'then)' % where)
    _LOG.info('--resume auto: no checkpoint of %s: starting from scratch', where)
    return None, None
