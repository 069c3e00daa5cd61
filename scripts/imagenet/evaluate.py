"""Validation: top-1 and top-5 over the validation set (`validate`), after each
epoch and in the evaluation-only run of ``--mode val`` (`evaluate`).
"""
import logging
import os
import time
from collections import namedtuple

import mxnet as mx

from .data import val_iter
from .jsonio import dump_json
from .report import percent

_LOG = logging.getLogger('train_imagenet')

# top1, top5: fractions (NaN without validation); images: how many were scored.
Validation = namedtuple('Validation', 'top1 top5 images seconds')
NO_VALIDATION = Validation(float('nan'), float('nan'), 0, 0.0)


def validate(runner, data_iter, max_batches):
    """Top-1 and top-5 accuracy over `data_iter` (a fresh iterator, or None: no
    validation), and how many images in how many seconds: a `Validation`."""
    if data_iter is None:
        return NO_VALIDATION
    top1 = mx.metric.Accuracy()
    top5 = mx.metric.TopKAccuracy(top_k=5)
    tic = time.time()
    for index, batch in enumerate(data_iter):
        if max_batches is not None and index >= max_batches:
            break
        outputs, labels = runner.predict(batch)
        keep = batch.data[0].shape[0] - batch.pad
        # Padding (round_batch) fills the last batch with repeats: score real images only.
        for out, label in zip(outputs, labels):
            n = min(keep, out.shape[0])
            keep -= n
            if n:
                top1.update([label[:n]], [out[:n]])
                top5.update([label[:n]], [out[:n]])
    # The metrics read their inputs on the host: every batch has been computed.
    return Validation(top1.get()[1], top5.get()[1], top1.num_inst, time.time() - tic)


def evaluate(run, runner, params_file):
    """``--mode val``: validate `runner` (its parameters loaded from `params_file`) on
    the validation set; log, write ``<prefix>-eval.json`` and the ``--json-log``'s
    summary record, and return the figures (a dict)."""
    args, spec = run.args, run.spec
    result = validate(runner, val_iter(spec, args, run.local_batch), args.max_batches)
    summary = {'mode': 'val', 'model': run.prefix, 'path': run.path, 'dtype': run.dtype,
               'compute': run.compute, 'device': run.device,
               'params': os.path.abspath(params_file),
               'data_val': os.path.abspath(spec.val_rec), 'images': result.images,
               'val_top1': result.top1, 'val_top5': result.top5,
               'img_per_sec': result.images / max(result.seconds, 1e-9),
               'eval_time': result.seconds, 'rank': run.rank}
    _LOG.info('evaluated %s on %d images of %s: top-1 %s, top-5 %s, %.1f img/s', params_file,
              result.images, spec.val_rec, percent(result.top1), percent(result.top5),
              summary['img_per_sec'])
    with open(os.path.join(run.save_dir, '%s-eval.json' % run.prefix), 'w') as handle:
        dump_json(summary, handle)
    if run.json_log is not None:
        run.json_log.log((), {'val.accuracy': result.top1,
                              'val.top_k_accuracy_5': result.top5,
                              'val.ips': summary['img_per_sec']})
    return summary
