#!/usr/bin/env python
"""What following user-changed weights costs an optimizer step (`mxamp.optimizer.follow_weight`).

Usage::

    .venv/bin/python scripts/master_weights_cost.py                  # ResNet-50 v1, both dtypes
    .venv/bin/python scripts/master_weights_cost.py --dtypes bfloat16 --repeats 9 --train-step

For each low precision, the parameters of ResNet-50 v1 (MXNet's model zoo, 25.6M
values, converted by `mxamp.convert`) are updated by SGD with momentum through
MXNet's ``Updater`` (what ``gluon.Trainer`` runs per context), with
``follow_weights=True`` (the default) and ``False``, interleaved: each
repetition times one update of every parameter in each setting, ended by
``mx.nd.waitall()``; the table shows medians.  ``--train-step`` also times one
training step of the converted net (forward + backward at ``--batch``, then the
update), so that the cost reads as a share of a step.  Numbers depend on the CPU
and its bfloat16 class (printed): compare rows of one run only.
"""
import argparse
import os
import statistics
import sys
import time
import warnings

import numpy as np

import mxamp  # noqa: F401  (first: enables AMX before oneDNN's first primitive)
import mxnet as mx
from mxnet import autograd, gluon

from mxamp import hardware
from mxamp import optimizer as mo
from mxamp.dtypes import cast


def converted_resnet50(dtype, batch):
    mx.random.seed(0)
    net = gluon.model_zoo.vision.resnet50_v1(classes=1000)
    net.initialize(mx.init.Xavier())
    mxamp.convert(net, dtype)
    net.hybridize(static_alloc=True, static_shape=True)
    net(mx.nd.zeros((batch, 3, 224, 224))).wait_to_read()   # shapes settled, parameters cast
    return net


def timed(run):
    mx.nd.waitall()
    start = time.perf_counter()
    run()
    mx.nd.waitall()
    return 1e3 * (time.perf_counter() - start)


def measure(dtype, repeats, batch, train_step):
    net = converted_resnet50(dtype, batch)
    params = [p for p in net.collect_params().values() if p.grad_req != 'null']
    rng = np.random.RandomState(0)
    low = [p.data() for p in params if p.data().dtype != np.float32]
    grads = [cast(mx.nd.array(rng.normal(0, 1e-3, w.shape)), dtype) for w in low]
    updaters = {follow: mx.optimizer.get_updater(mo.create(
        'sgd', learning_rate=1e-3, momentum=0.9, follow_weights=follow)) for follow in (True, False)}
    indices = list(range(len(low)))
    for updater in updaters.values():           # states created, kernels warm
        updater(indices, grads, low)
    times = {True: [], False: []}
    for _ in range(repeats):
        for follow, updater in updaters.items():
            times[follow].append(timed(lambda: updater(indices, grads, low)))
    row = {'dtype': dtype, 'values': sum(int(np.prod(w.shape)) for w in low),
           'update_ms': statistics.median(times[False]),
           'update_follow_ms': statistics.median(times[True])}
    if train_step:
        trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 1e-3, 'momentum': 0.9},
                                loss_scale=None)
        x = mx.nd.array(rng.uniform(-1, 1, (batch, 3, 224, 224)))
        y = mx.nd.array(rng.randint(0, 1000, (batch,)))
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

        def one_step():
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(batch)
        one_step()
        row['train_step_ms'] = statistics.median(timed(one_step) for _ in range(max(1, repeats // 3)))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--dtypes', default='bfloat16,float16', help='default: %(default)s')
    parser.add_argument('--repeats', type=int, default=7, help='default: %(default)s')
    parser.add_argument('--batch', type=int, default=16, help='for --train-step; default: %(default)s')
    parser.add_argument('--train-step', action='store_true',
                        help='also time one training step (forward, backward, update)')
    args = parser.parse_args(argv)
    warnings.filterwarnings('ignore', message='mxamp: ')
    print('CPU: %s; OMP_NUM_THREADS=%s' % (hardware.describe_cpu_class(),
                                           os.environ.get('OMP_NUM_THREADS', '(unset: all cores)')))
    print('%-9s %12s %12s %14s %10s %14s' % ('dtype', 'values', 'update ms', 'with follow ms',
                                            'follow ms', 'train step ms'))
    for dtype in args.dtypes.split(','):
        row = measure(dtype.strip(), args.repeats, args.batch, args.train_step)
        extra = row['update_follow_ms'] - row['update_ms']
        step = row.get('train_step_ms')
        print('%-9s %12s %12.1f %14.1f %10.1f %14s' % (
            row['dtype'], format(row['values'], ','), row['update_ms'], row['update_follow_ms'],
            extra, '-' if step is None else '%.0f (follow %.1f%%)' % (step, 100 * extra / step)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
