#!/usr/bin/env python
"""MXNet's softmax with a length against mxamp's own (`mxamp.kernels.operators.masked_softmax`).

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python scripts/masked_softmax_cost.py
    .venv/bin/python scripts/masked_softmax_cost.py --shape 96 128 128 --repeats 21

Times ``softmax(data, length, axis=-1, use_length=True)`` on float32 data (by default
BERT-base's attention weights: batch 8 x 12 heads, sequence 128), forward alone and forward
with backward, with every row's length the whole row and with lengths drawn from 1 to the
row's, on MXNet's operator and on mxamp's, interleaved: each repetition times each case once,
ended by ``mx.nd.waitall()``; the table shows medians.  Numbers depend on the CPU and on what
else runs on it: compare rows of one run only.
"""
import argparse
import statistics
import sys
import time

import numpy as np

import mxamp  # first: enables AMX before oneDNN's first primitive
import mxnet as mx
from mxnet import autograd

from mxamp.kernels import operators


def mxnets(data, length):
    return mx.nd.softmax(data, length, axis=-1, use_length=True)


def timed(run):
    mx.nd.waitall()
    start = time.perf_counter()
    run()
    mx.nd.waitall()
    return 1e3 * (time.perf_counter() - start)


def forward(softmax, data, length):
    return lambda: softmax(data, length)


def forward_backward(softmax, data, length, head):
    def run():
        with autograd.record():
            out = softmax(data, length)
        out.backward(head)
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--shape', type=int, nargs='+', default=[96, 128, 128],
                        help='the data shape; the softmax runs over its last axis')
    parser.add_argument('--repeats', type=int, default=21, help='timed repetitions (medians)')
    args = parser.parse_args(argv)
    if not operators.available():
        sys.exit('mxamp\'s own operators are off here: %s' % operators.status().reason)
    shape = tuple(args.shape)
    rng = np.random.RandomState(0)
    data = mx.nd.array(3 * rng.normal(size=shape))
    head = mx.nd.array(rng.normal(size=shape))
    data.attach_grad()
    lengths = {'whole rows': np.full(shape[:-1], shape[-1]),
               'lengths 1 to %d' % shape[-1]: rng.randint(1, shape[-1] + 1, size=shape[:-1])}
    cases = {}
    for what, values in lengths.items():
        length = mx.nd.array(values, dtype='int32')
        for how, softmax in (("MXNet's", mxnets), ("mxamp's", operators.masked_softmax)):
            cases[(what, 'forward', how)] = forward(softmax, data, length)
            cases[(what, 'forward+backward', how)] = forward_backward(softmax, data, length, head)
    for run in cases.values():   # warm-up
        timed(run)
    times = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case, run in cases.items():
            times[case].append(timed(run))
    threads = mxamp.hardware.mxnet_openmp_threads()['openmp_threads'] or '?'
    print('softmax with a length over %s float32, median of %d interleaved repetitions, '
          '%s threads, %s' % ('x'.join(map(str, shape)), args.repeats, threads,
                              mxamp.hardware.describe_cpu_class()))
    print('%-16s %-18s %12s %12s %8s' % ('lengths', 'pass', "MXNet's ms", "mxamp's ms", 'ratio'))
    for what in lengths:
        for step in ('forward', 'forward+backward'):
            theirs = statistics.median(times[(what, step, "MXNet's")])
            own = statistics.median(times[(what, step, "mxamp's")])
            print('%-16s %-18s %12.2f %12.2f %7.1fx' % (what, step, theirs, own, theirs / own))
    return 0


if __name__ == '__main__':
    sys.exit(main())
