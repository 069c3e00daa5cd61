"""The training: logging (``train.log`` and the console), the epoch loop and
`train`, in named steps; ``--mode val`` (`imagenet.evaluate`) shares its set-up.
"""
import json
import logging
import math
import os
import sys
import time
import warnings
from types import SimpleNamespace

import mxnet as mx
import numpy as np
from tqdm import tqdm
from mxamp.dtypes import resolve_dtype

from .checkpoints import list_checkpoints, paths, prune_checkpoints, remove_stale_tmp, \
    resume_point, save_best, save_checkpoint
from .data import SyntheticIter, decoding_threads, derived_seed, resolve_data, \
    seed_everything, train_iter, usable_cpus, val_iter
from .distributed import average_statistics
from .evaluate import evaluate, validate
from .jsonio import JsonLog, dump_json
from .model import GluonRunner, ModuleRunner, current_lr, loss_scaling, lr_scheduler
from .options import UsageError, run_prefix
from .report import compared_run, describe_precision, peak_rss_mb, percent, plot_runs, \
    read_metrics, run_label, steady_img_per_sec, write_metrics
from .resume import check_resume_settings, run_settings

_LOG = logging.getLogger('train_imagenet')


class _ConsoleHandler(logging.StreamHandler):
    """Log lines to stderr through ``tqdm.write``: one logged while the progress bar
    shows lands above the bar instead of breaking its line."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def _log_warning(message, category, filename, lineno, file=None, line=None):
    # A replacement for warnings.showwarning: mxamp's warnings (float16 on a CPU, the
    # loss scale at its floor, ...) belong in train.log as much as on the console.
    _LOG.warning('%s: %s', category.__name__, message)


def setup_logging(log_file, rank):
    """Log to stderr and to `log_file` (appended to), Python warnings included.

    ``--no-progress`` hides the progress bar only: a batch job's console and log
    file keep every line.  `main` restores ``warnings.showwarning`` and closes the
    file.
    """
    os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
    handlers = [logging.FileHandler(log_file), _ConsoleHandler(sys.stderr)]
    fmt = '%(asctime)s ' + ('[worker %d] ' % rank if rank is not None else '') + '%(message)s'
    for handler in handlers:
        handler.setFormatter(logging.Formatter(fmt, datefmt='%H:%M:%S'))
    close_logging()
    _LOG.handlers[:] = handlers
    _LOG.setLevel(logging.INFO)
    _LOG.propagate = False
    warnings.showwarning = _log_warning


def close_logging():
    """Close the log file and stop logging to the console (`setup_logging` undone)."""
    for handler in _LOG.handlers:
        handler.close()
    _LOG.handlers[:] = []


# ---------------------------------------------------------------------------------------
# train() and its steps, in the order it takes them

def train(args):
    """Run training (or, with ``--mode val``, the evaluation) for parsed, checked
    `args`; returns the summary dict."""
    run = _set_up(args)
    try:
        if args.mode == 'val':
            params_file = args.load or _checkpoint_to_evaluate(run)
            _open_json_log(run, append=False)
            _log_set_up(run)
            return evaluate(run, _build_runner(run, None, params_file), params_file)
        resume = _resume(run)
        _open_json_log(run, append=resume is not None)
        _log_set_up(run)
        runner = _build_runner(run, resume, args.load)
        if run.start_epoch >= run.last_epoch:
            _LOG.info('nothing to train: the checkpoint is at epoch %d, this run ends after '
                      'epoch %d', run.start_epoch, run.last_epoch)
        for epoch in range(run.start_epoch, run.last_epoch):
            loss_sum, seen, elapsed, skipped_before = _train_epoch(run, runner, epoch)
            _end_epoch(run, runner, epoch, loss_sum, seen, elapsed, skipped_before)
        return _summarise(run, runner)
    finally:
        if run.json_log is not None:
            run.json_log.close()


def _set_up(args):
    """Devices, kvstore, output directory and logging, and what the run derives from
    `args`: the state that `train`'s steps share (a namespace), at epoch 0, step 0."""
    spec = resolve_data(args)
    contexts = _contexts(args)
    kvstore = None
    rank, num_workers = 0, 1
    if 'dist' in args.kv_store or len(contexts) > 1:
        kvstore = mx.kv.create(args.kv_store)
        rank, num_workers = kvstore.rank, kvstore.num_workers
    distributed = kvstore is not None and 'dist' in kvstore.type
    prefix = run_prefix(args)
    save_dir = args.save_dir if rank == 0 else os.path.join(args.save_dir, 'rank%d' % rank)
    os.makedirs(save_dir, exist_ok=True)
    setup_logging(_log_file(args.logging_file, save_dir, rank), rank if distributed else None)
    dtype = resolve_dtype(args.dtype, contexts)   # after the logging: its warning is logged
    stale = remove_stale_tmp(save_dir, prefix)
    if stale:
        _LOG.info('removed %d temporary file(s) of an interrupted run: %s', len(stale),
                  ', '.join(stale))

    batch_size = args.batch_size
    local_batch = batch_size * len(contexts)
    global_batch = local_batch * num_workers
    per_worker = spec.num_train // num_workers
    steps_per_epoch = max(1, int(math.ceil(per_worker / float(local_batch))))
    if args.max_batches is not None:
        steps_per_epoch = min(steps_per_epoch, args.max_batches)
    base_lr = args.lr if args.lr is not None else 0.256 * global_batch / 256
    if args.warmup_lr > base_lr:
        raise UsageError('--warmup-lr %g exceeds the learning rate %g (0.256 per 256 images of '
                         'the global batch): the warm-up rises to it' % (args.warmup_lr, base_lr))
    last_epoch = args.num_epochs if args.stop_at_epoch is None else \
        min(args.num_epochs, args.stop_at_epoch)
    return SimpleNamespace(
        args=args, spec=spec, contexts=contexts, kvstore=kvstore, rank=rank,
        num_workers=num_workers, distributed=distributed,
        dist_kvstore=kvstore if distributed else None, prefix=prefix, save_dir=save_dir,
        dtype=dtype, batch_size=batch_size, local_batch=local_batch, global_batch=global_batch,
        steps_per_epoch=steps_per_epoch, base_lr=base_lr, last_epoch=last_epoch,
        path='symbol' if args.symbol else 'gluon',
        settings=run_settings(args, spec, dtype, contexts, num_workers, base_lr),
        csv_path=os.path.join(save_dir, '%s-metrics.csv' % prefix),
        show_bar=not args.no_progress and rank == 0, json_log=None, initial_params=args.load,
        rows=[], start_epoch=0, global_step=0, overrides=[], train_time=0.0, stats_keys=set())


def _log_file(logging_file, save_dir, rank):
    """Where this worker logs: --logging-file (``-rank<r>`` added for worker r > 0), or
    ``train.log`` in its `save_dir`."""
    if logging_file is None:
        return os.path.join(save_dir, 'train.log')
    if not rank:
        return logging_file
    stem, extension = os.path.splitext(logging_file)
    return '%s-rank%d%s' % (stem, rank, extension)


def _open_json_log(run, append):
    """The --json-log of worker 0 (`run.json_log`), its first record the run's settings."""
    if run.args.json_log is None or run.rank != 0:
        return
    run.json_log = JsonLog(run.args.json_log, append)
    parameters = {name.lstrip('-').replace('-', '_'): value
                  for name, value in run.settings.items()}
    parameters.update(mode=run.args.mode, save_dir=run.save_dir, prefix=run.prefix,
                      global_batch=run.global_batch, steps_per_epoch=run.steps_per_epoch)
    run.json_log.log('PARAMETER', parameters)


def _checkpoint_to_evaluate(run):
    """--mode val without --load: the params of the newest checkpoint in --save-dir (or
    of --resume-epoch's)."""
    wanted = run.args.resume_epoch
    epochs = [e for e in list_checkpoints(run.save_dir, run.prefix) if wanted in (None, e)]
    if not epochs:
        raise UsageError('--mode val: no checkpoint %sof %s in %s: name a parameter file with '
                         '--load' % ('' if wanted is None else 'of epoch %d ' % wanted,
                                     run.prefix, run.save_dir))
    return paths(run.save_dir, run.prefix, epochs[-1])[0]


def _contexts(args):
    ids = [int(i) for i in args.gpus.split(',') if i.strip()] if args.gpus else \
        list(range(args.num_gpus))
    return [mx.gpu(i) for i in ids] or [mx.cpu()]


def _resume(run):
    """The checkpoint's ``paths`` to continue from, or None; moves `run` to its epoch and
    step and takes its overrides (`check_resume_settings` may refuse it instead).

    Found (or refused) before the slow model build, and before this run logs its set-up:
    a refused resume leaves the checkpoint's directory as it was.
    """
    found, directory = resume_point(run.args, run.save_dir, run.prefix, run.rank,
                                    run.dist_kvstore)
    if found is None:
        return None
    resume = paths(directory, run.prefix, found)
    with open(resume[2]) as handle:
        meta = json.load(handle)
    run.overrides = check_resume_settings(meta, resume[2], run.settings, run.args,
                                          run.dist_kvstore)
    run.start_epoch, run.global_step = found, meta['global_step']
    run.initial_params = meta.get('initial_params')
    return resume


def _log_set_up(run):
    """Log what runs where (and how the precision computes: `run.compute`,
    `run.device`) and how many threads decode."""
    args, spec = run.args, run.spec
    run.compute, run.device = describe_precision(run.dtype, run.contexts)
    _LOG.info('%s %s, %s, dtype %s (%s) on %s, %d worker(s), global batch %d, lr %g, '
              '%d steps/epoch', run.path, run.prefix, 'synthetic data' if spec.synthetic else
              spec.train_rec, run.dtype, run.compute, run.contexts, run.num_workers,
              run.global_batch, run.base_lr, run.steps_per_epoch)
    _LOG.info('device: %s', run.device)
    for note in args.spellings_read:
        _LOG.info('read as this script spells it: %s', note)
    if not spec.synthetic:
        threads = decoding_threads(args.data_nthreads)
        _LOG.info('data: decoding on %d thread(s) per iterator%s', threads,
                  '' if threads == args.data_nthreads else
                  " (--data-nthreads %d: MXNet's ImageRecordIter uses at most max(1, CPUs/2 "
                  "- 1) with %d CPUs)" % (args.data_nthreads, usable_cpus()))
    if not args.verbose:
        # The notice MXNet prints when a Module binds with its oneDNN subgraph backend;
        # read at each bind.  A value the user set stays.
        os.environ.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')


def _build_runner(run, resume, params_file):
    """The training path's runner, with the checkpoint `resume` (``paths``) loaded and
    the metric rows up to its epoch, or else the parameters of `params_file` (if any)."""
    args = run.args
    seed_everything(args.seed)   # same on every worker: same initial weights
    runner_cls = ModuleRunner if args.symbol else GluonRunner
    runner = runner_cls(args, run.spec, run.contexts, run.dtype, run.kvstore, run.batch_size,
                        run.global_batch, run.base_lr, run.steps_per_epoch)

    if resume is not None:
        runner.load(resume[0], resume[1])
        # The schedule follows this run's arguments (a longer --num-epochs under --lr-mode
        # step, or what --resume-override changed); it is a function of the restored
        # update count, so unchanged arguments continue it.
        runner.optimizer.lr_scheduler = lr_scheduler(args, run.base_lr, run.steps_per_epoch)
        if os.path.isfile(run.csv_path):
            run.rows = [r for r in read_metrics(run.csv_path) if r['epoch'] <= run.start_epoch]
        _LOG.info('resumed from %s (epoch %d, step %d)', resume[2], run.start_epoch,
                  run.global_step)
    elif params_file is not None:
        runner.load_params(params_file, '--load %s' % params_file if params_file == args.load
                           else params_file)
        _LOG.info('parameters from %s', params_file)
    return runner


def _train_epoch(run, runner, epoch):
    """Train epoch `epoch` (from 0): ``(summed loss, images, seconds, skipped steps
    before it)``."""
    args, spec, steps_per_epoch = run.args, run.spec, run.steps_per_epoch
    seed_everything(derived_seed(args.seed, epoch, run.rank, 'mxnet'))
    if spec.synthetic:
        data = SyntheticIter(spec, run.local_batch, steps_per_epoch, run.contexts[0])
    else:
        data = train_iter(spec, args, run.local_batch, epoch, run.rank, run.num_workers)
    bar = tqdm(total=steps_per_epoch, desc='epoch %d/%d' % (epoch + 1, args.num_epochs),
               unit='batch', disable=not run.show_bar, leave=False, dynamic_ncols=True)
    loss_sum, seen, window_loss, window_seen = 0.0, 0, mx.nd.zeros((1,)), 0
    skipped_before = runner.skipped_steps
    # gluoncv's mixup: one Beta(alpha, alpha) weight per batch (from numpy's generator,
    # seeded above: a resumed epoch draws the same), none in the last --mixup-off-epoch.
    mixing = args.mixup and epoch < args.num_epochs - args.mixup_off_epoch
    tic = window_tic = time.time()
    for index, batch in enumerate(data):
        if index >= steps_per_epoch:
            break
        if mixing:
            batch_loss, _ = runner.train_batch(batch, np.random.beta(args.mixup_alpha,
                                                                     args.mixup_alpha))
        else:
            batch_loss, _ = runner.train_batch(batch)
        window_loss += batch_loss
        window_seen += batch.data[0].shape[0]
        run.global_step += 1
        if (index + 1) % args.log_interval == 0 or index + 1 == steps_per_epoch:
            value = window_loss.asscalar()   # host sync, once per window
            now = time.time()
            loss_sum, seen = loss_sum + value, seen + window_seen
            bar.set_postfix({'img/s': '%.0f' % (seen * run.num_workers / (now - tic)),
                             'loss': '%.3f' % (value / window_seen),
                             'scale': '%g' % runner.loss_scale}, refresh=False)
            bar.update((index + 1) - bar.n)
            if run.json_log is not None:
                run.json_log.log((epoch, index), {
                    'train.loss': value / window_seen,
                    'train.ips': window_seen * run.num_workers / (now - window_tic),
                    'train.lr': current_lr(runner.optimizer),
                    'train.loss_scale': runner.loss_scale,
                    'train.skipped_steps': runner.skipped_steps})
            window_loss, window_seen, window_tic = mx.nd.zeros((1,)), 0, now
    mx.nd.waitall()
    elapsed = time.time() - tic
    bar.close()
    run.train_time += elapsed
    return loss_sum, seen, elapsed, skipped_before


def _end_epoch(run, runner, epoch, loss_sum, seen, elapsed, skipped_before):
    """After epoch `epoch`'s training: the workers' BatchNorm statistics averaged,
    validation, the metrics row (CSV and log line), the checkpoint when one is due."""
    args, spec = run.args, run.spec
    if run.distributed:
        average_statistics(run.kvstore, runner.statistics(), run.stats_keys)
    checked = validate(runner, None if spec.synthetic or args.mode == 'train' else
                       val_iter(spec, args, run.local_batch), args.max_batches)
    top1, top5 = checked.top1, checked.top5
    best = max([r['val_top1'] for r in run.rows if math.isfinite(r['val_top1'])] or [-1.0])
    row = {'epoch': epoch + 1, 'lr': current_lr(runner.optimizer),
           'train_loss': loss_sum / max(seen, 1), 'val_top1': top1, 'val_top5': top5,
           'img_per_sec': seen * run.num_workers / elapsed, 'epoch_time': elapsed,
           'loss_scale': runner.loss_scale,
           'skipped_in_epoch': runner.skipped_steps - skipped_before,
           'skipped_total': runner.skipped_steps, 'peak_rss_mb': peak_rss_mb()}
    run.rows.append(row)
    write_metrics(run.csv_path, run.rows)
    _LOG.info('epoch %d/%d: loss %.4f, top-1 %s, top-5 %s, %.1f img/s, loss scale %g, '
              'skipped %d steps (%d in total)', epoch + 1, args.num_epochs,
              row['train_loss'], percent(top1), percent(top5), row['img_per_sec'],
              row['loss_scale'], row['skipped_in_epoch'], row['skipped_total'])
    if run.json_log is not None:
        run.json_log.log((epoch,), {
            'train.loss': row['train_loss'], 'train.ips': row['img_per_sec'],
            'train.lr': row['lr'], 'train.loss_scale': row['loss_scale'],
            'train.skipped_steps': row['skipped_total'], 'train.time': elapsed,
            'val.accuracy': top1, 'val.top_k_accuracy_5': top5,
            'val.ips': checked.images / checked.seconds if checked.images else None})
    if math.isfinite(top1) and top1 > best:
        written = save_best(runner, run.save_dir, run.prefix, epoch + 1, row)
        _LOG.info('epoch %d: the best validation top-1 so far: %s', epoch + 1, written)
    if (epoch + 1) % args.save_frequency == 0 or epoch + 1 == run.last_epoch:
        _checkpoint(run, runner, epoch + 1, row)


def _checkpoint(run, runner, epoch, row):
    """Write the checkpoint of epoch `epoch` (from 1; its metrics `row`) and prune the
    old ones."""
    args = run.args
    meta = {'global_step': run.global_step, 'seed': args.seed, 'dtype': run.dtype,
            'path': run.path, 'model': run.prefix, 'rank': run.rank,
            'num_workers': run.num_workers, 'data_nthreads': args.data_nthreads,
            'decoding_threads': decoding_threads(args.data_nthreads),
            'rng': 'per epoch e: mxnet/numpy/random and ImageRecordIter seeded from '
                   'sha256(seed/e/rank/purpose)', 'metrics': row,
            'settings': run.settings, 'resume_overrides': run.overrides,
            'initial_params': run.initial_params and os.path.abspath(run.initial_params)}
    save_checkpoint(runner, run.save_dir, run.prefix, epoch, meta)
    prune_checkpoints(run.save_dir, run.prefix, args.keep_checkpoints)


def _summarise(run, runner):
    """The run's summary: written to ``<prefix>-summary.json`` (and the ``--plot``
    drawn), returned."""
    args, rows, prefix = run.args, run.rows, run.prefix
    last = rows[-1] if rows else {}
    summary = {'mode': args.mode, 'model': prefix, 'path': run.path, 'dtype': run.dtype, 'compute': run.compute,
               'device': run.device, 'epochs': len(rows),
               'val_top1': last.get('val_top1'), 'val_top5': last.get('val_top5'),
               'img_per_sec': steady_img_per_sec(rows),
               'skipped_steps': runner.skipped_steps, 'loss_scale': runner.loss_scale,
               'loss_scaling': loss_scaling(runner.trainer.loss_scaler),
               'peak_rss_mb': peak_rss_mb(), 'train_time': run.train_time, 'rank': run.rank,
               'num_workers': run.num_workers, 'global_batch': run.global_batch,
               'resume_overrides': run.overrides}
    with open(os.path.join(run.save_dir, '%s-summary.json' % prefix), 'w') as handle:
        dump_json(summary, handle)
    if run.json_log is not None:
        run.json_log.log((), {'train.ips': summary['img_per_sec'],
                              'train.time': summary['train_time'],
                              'train.loss_scale': summary['loss_scale'],
                              'train.skipped_steps': summary['skipped_steps'],
                              'val.accuracy': summary['val_top1'],
                              'val.top_k_accuracy_5': summary['val_top5']})
    if args.plot and run.rank == 0:
        runs = [('%s: %s' % (prefix, run_label(run.dtype, run.compute)), rows)]
        plot_runs(runs + [compared_run(other) for other in args.compare], args.plot)
    return summary
