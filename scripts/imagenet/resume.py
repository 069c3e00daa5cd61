"""The run's settings: what a checkpoint records of its run (`run_settings`), and
the comparison that lets a resume continue it or refuses it
(`check_resume_settings`).

Which options count is `imagenet.options`' classification (`RESUME_CHECKED`,
`RESUME_FIXED`, `RESUME_FREE`); a checkpoint that lacks any of them is not one
this script writes, and is refused.
"""
import json
import logging
import os

from .data import decoding_threads
from .distributed import refusing_workers
from .options import UsageError

_LOG = logging.getLogger('train_imagenet')


def run_settings(args, spec, dtype, contexts, num_workers, base_lr):
    """This run's settings that its checkpoints record: `RESUME_CHECKED` name -> value.

    Effective values where a default depends on other options (the learning rate,
    the data's classes and shape, ``auto`` dtype and loss scale): a resume is
    compared with what ran, not with how it was spelled.  A data file is recorded
    by absolute path and image count (the count sets the steps per epoch, hence
    the schedule).
    """
    def data_file(path, count):
        return '%s (%d images)' % (os.path.abspath(path), count) if path else None
    loss_scale = args.loss_scale
    if loss_scale == 'auto':
        loss_scale = 'dynamic' if dtype == 'float16' else 'none'
    elif loss_scale not in ('dynamic', 'none'):
        loss_scale = float(loss_scale)
    return {
        '--dataset': args.dataset,
        '--data-train': data_file(args.data_train and spec.train_rec, spec.num_train),
        '--data-val': data_file(args.data_val and spec.val_rec, spec.num_val),
        '--synthetic': args.synthetic,
        '--num-examples': args.num_examples,
        '--num-classes': spec.num_classes,
        '--image-shape': ','.join(str(n) for n in spec.image_shape),
        '--model': args.model,
        '--symbol': args.symbol,
        '--num-layers': args.num_layers,
        '--resnet-version': args.resnet_version,
        '--last-gamma': args.last_gamma,
        '--dtype': dtype,
        '--loss-scale': loss_scale,
        '--batch-size': args.batch_size,
        '--num-epochs': args.num_epochs,
        '--max-batches': args.max_batches,
        '--optimizer': args.optimizer,
        '--lr': base_lr,
        '--momentum': args.momentum,
        '--wd': args.wd,
        '--no-wd': args.no_wd,
        '--lr-mode': args.lr_mode,
        '--lr-decay': args.lr_decay,
        '--lr-decay-epoch': ','.join(str(int(e)) for e in args.lr_decay_epoch.split(',')
                                     if e.strip()),
        '--warmup-epochs': args.warmup_epochs,
        '--warmup-lr': args.warmup_lr,
        '--label-smoothing': args.label_smoothing,
        '--mixup': args.mixup,
        '--mixup-alpha': args.mixup_alpha,
        '--mixup-off-epoch': args.mixup_off_epoch,
        '--seed': args.seed,
        '--num-gpus': sum(c.device_type == 'gpu' for c in contexts),
        '--kv-store': args.kv_store,
        'DMLC_NUM_WORKER': num_workers,
    }


def _show(value):
    """A setting's value as a refusal line prints it."""
    if value is None:
        return 'none'
    if isinstance(value, bool):
        return 'on' if value else 'off'
    return repr(value) if isinstance(value, float) else str(value)


def compare_settings(stored, current, overrides):
    """The differences between a checkpoint's settings and this run's.

    Returns ``(refused, overridden, free)``: the lines to refuse with (``--lr:
    checkpoint 0.1, now 0.2``), ``(name, checkpoint's value, this run's)`` of the
    differences that `overrides` (names) allows, and lines to log for those free
    to change.  Settings that `stored` lacks are not compared.
    """
    refused, overridden, free = [], [], []
    mode = current['--lr-mode']
    for name, now in current.items():
        if name not in stored or stored[name] == now:
            continue
        was = stored[name]
        line = '%s: checkpoint %s, now %s' % (name, _show(was), _show(now))
        if name == '--num-epochs' and stored.get('--lr-mode') == mode == 'step':
            # Step decays at fixed epochs: the schedule up to any epoch stays the same.
            free.append(line + ': free to change under --lr-mode step')
        elif name in overrides:
            overridden.append((name, was, now))
        elif name == '--num-epochs' and stored.get('--lr-mode') == mode:
            refused.append(line + ' (the %s schedule spans the epochs: the learning rate '
                                  'would jump)' % mode)
        else:
            refused.append(line)
    return refused, overridden, free


def check_resume_settings(meta, json_file, settings, args, kvstore):
    """Refuse to resume from `meta` (read from `json_file`) with other `settings`.

    Raises `UsageError` with one line per difference that --resume-override
    does not name; logs the others.  A checkpoint that lacks any of `settings`
    (or the number of threads that decoded, as ``--data-nthreads``) is not one
    this script writes: refused with one line naming them.  With a distributed
    `kvstore`, every worker must call it, and all refuse when one does: a worker
    that went on alone would wait for the others for ever.  Returns the run's
    overrides, earlier resumes' and this one's, for its checkpoints and summary.
    """
    current = json.loads(json.dumps(settings))    # as a checkpoint gives them back
    stored = meta.get('settings', {})
    missing = [name for name in current if name not in stored]
    if 'decoding_threads' not in meta:
        missing.append('--data-nthreads')
    refused, overridden, free = compare_settings(stored, current, args.resume_override or ())
    refusing = refusing_workers(kvstore, bool(missing or refused)) \
        if kvstore is not None else []
    if missing:
        raise UsageError('--resume: %s does not record %s: not a checkpoint this script '
                         'writes (start a new run; --load takes its parameters)'
                         % (json_file, ', '.join(missing)))
    if refused:
        raise UsageError('\n'.join(refused + [
            '--resume: %s was written with the settings above: resume with them, or name '
            'those to change in --resume-override (see --help)' % json_file]))
    if refusing:
        raise UsageError('--resume: the settings of worker(s) %s differ from their checkpoint '
                         '(their output says which): no worker resumes'
                         % ', '.join(str(rank) for rank in refusing))
    was = meta['decoding_threads']
    now = decoding_threads(args.data_nthreads)
    if was != now:
        free.append('--data-nthreads: the checkpoint\'s run decoded on %d thread(s), this one '
                    'on %d: free to change, but the augmentation now differs from an '
                    'uninterrupted run\'s' % (was, now))
    for line in free:
        _LOG.info(line)
    records = list(meta.get('resume_overrides', []))
    for name, was, now in overridden:
        _LOG.warning('%s: checkpoint %s, now %s: changed by --resume-override', name,
                     _show(was), _show(now))
        records.append({'epoch': meta['epoch'], 'setting': name, 'checkpoint': was, 'now': now})
    return records
