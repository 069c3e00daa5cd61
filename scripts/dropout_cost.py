#!/usr/bin/env python
r"""What a training dropout costs on MXNet's ``Dropout`` and on mxamp's own operator.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python scripts/dropout_cost.py             # BERT-base's shapes
    OMP_NUM_THREADS=2 .venv/bin/python scripts/dropout_cost.py --repeats 31 --chain 8
    OMP_NUM_THREADS=2 .venv/bin/python scripts/dropout_cost.py --bert-steps 20
    MXNET_EXEC_BULK_EXEC_TRAIN=0 OMP_NUM_THREADS=2 .venv/bin/python scripts/dropout_cost.py \
        --bert-steps 5 --profile

For each shape (BERT-base at batch 8, sequence 128: the hidden states (8, 128, 768) and the
attention weights (96, 128, 128)) and data type, two hybridized blocks of ``--chain`` dropouts
in a row (p 0.1) train one step each (forward, then backward from a fixed output gradient,
ended by ``mx.nd.waitall()``), interleaved, ``--repeats`` times; the table shows the median
per dropout.  MXNet's ``Dropout`` has no bfloat16 kernel: on bfloat16 data it runs in FP32
between two ``amp_cast``, as a converted graph computes it; the own operator computes
bfloat16 data as it is.  In a converted network (`mxamp.kernels.dropout`) the precision pass
keeps ``Dropout`` in FP32, so the float32 rows are what a converted network's training step
saves.  Numbers depend on the CPU (printed) and on what else runs on it: compare rows of one
run only.

``--bert-steps n`` times instead ``scripts/benchmark.py``'s BERT-base training step (batch 8,
sequence 128, ``mxamp.convert(net, 'bfloat16')``, ``mxamp.Trainer``): two copies of the
network, one built with the own dropouts' pass switched off, n steps each, interleaved (each
first every other time); a step varies by several percent, so take n of 20 or more.  With
``--profile`` it runs the n steps of each side in turn under MXNet's profiler instead and prints
what the dropouts' operators took a step, and MXNet's zero fills (the own operator's mask has a
gradient MXNet fills): set ``MXNET_EXEC_BULK_EXEC_TRAIN=0``, or the profiler names bulked
segments of operators, not the operators.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from mxamp import hardware  # first: mxamp enables AMX before oneDNN's first primitive
import mxnet as mx
from mxnet import autograd, gluon

from mxamp.dtypes import cast
from mxamp.kernels import operators

SHAPES = ((8, 128, 768), (96, 128, 128))
P = 0.1


class Chain(gluon.HybridBlock):
    """`chain` dropouts of `x` in a row: MXNet's (`own` False, widening and narrowing
    bfloat16 data around each) or mxamp's own."""

    def __init__(self, chain, own, bfloat16, **kwargs):
        super(Chain, self).__init__(**kwargs)
        self._chain, self._own, self._bfloat16 = chain, own, bfloat16

    def hybrid_forward(self, F, x):
        for _ in range(self._chain):
            if self._own:
                x = operators.dropout(x, p=P)[0]
            elif self._bfloat16:
                x = F.amp_cast(F.Dropout(F.amp_cast(x, dtype='float32'), p=P), dtype='bfloat16')
            else:
                x = F.Dropout(x, p=P)
        return x


def step(block, x, head):
    mx.nd.waitall()
    start = time.perf_counter()
    with autograd.record():
        out = block(x)
    out.backward(head)
    mx.nd.waitall()
    return 1e3 * (time.perf_counter() - start)


def measure(shape, dtype, chain, repeats):
    x = cast(mx.nd.random.normal(shape=shape), dtype)
    head = cast(mx.nd.random.normal(shape=shape), dtype)
    x.attach_grad()
    blocks = {}
    for side in ('mxnet', 'own'):
        blocks[side] = Chain(chain, side == 'own', dtype == 'bfloat16')
        blocks[side].hybridize(static_alloc=True, static_shape=True)
        for _ in range(3):
            step(blocks[side], x, head)
    times = {side: [] for side in blocks}
    for _ in range(repeats):
        for side, block in blocks.items():
            times[side].append(step(block, x, head) / chain)
    return {side: statistics.median(values) for side, values in times.items()}


def operator_milliseconds(run, steps):
    """{operator: milliseconds a step} of `steps` calls of `run`, by MXNet's profiler."""
    # MXNet's profiler replaces its file (it removes what is there), so a file of its own:
    # never os.devnull.
    with tempfile.TemporaryDirectory() as directory:
        mx.profiler.set_config(profile_all=True, aggregate_stats=True,
                               filename=os.path.join(directory, 'profile.json'))
        mx.profiler.dumps(reset=True)
        mx.profiler.set_state('run')
        for _ in range(steps):
            run()
        mx.nd.waitall()
        mx.profiler.set_state('stop')
        table = json.loads(mx.profiler.dumps(reset=True, format='json'))['Time']
    return {name: entry['Total'] / steps for name, entry in table.get('operator', {}).items()}


def bert_steps(steps, profile=False):
    """Median seconds of BERT-base's bfloat16 training step (forward and backward, then the
    trainer's step) with MXNet's dropouts and with the own ones, interleaved; with `profile`,
    {side: {operator: milliseconds a step}} instead."""
    import benchmark   # scripts/, beside this file
    from mxamp.kernels.passes import OwnDropouts
    from mxamp.passes import PassRecord

    def step(side):
        if side == 'own':
            return sum(runs[side]())
        # Every call, in case one makes its graph again: without the own dropouts.
        original = OwnDropouts.run
        OwnDropouts.run = lambda self, graph, context, earlier: PassRecord(self.name)
        try:
            return sum(runs[side]())
        finally:
            OwnDropouts.run = original
    runs = {}
    for side in ('mxnet', 'own'):
        runs[side] = benchmark.build_training('mxamp', 'bert', 8, None)
        for _ in range(2):
            step(side)
    if profile:
        return {side: operator_milliseconds(lambda: step(side), steps) for side in runs}
    times = {side: [] for side in runs}
    order = list(runs)
    for i in range(steps):
        for side in order if i % 2 == 0 else order[::-1]:   # each side first every other time
            times[side].append(step(side))
    return {side: statistics.median(values) for side, values in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--repeats', type=int, default=21)
    parser.add_argument('--chain', type=int, default=4, help='dropouts per block')
    parser.add_argument('--bert-steps', type=int, default=0,
                        help="time BERT-base's training step instead, this many steps a side")
    parser.add_argument('--profile', action='store_true',
                        help="with --bert-steps: the dropouts' operators' time, by the profiler")
    args = parser.parse_args(argv)
    operators.require_loaded()
    mx.random.seed(0)
    print('CPU: %s; MXNet %s; %s' % (hardware.describe_cpu_class(), mx.__version__,
                                     operators.describe()))
    if args.bert_steps and args.profile:
        for side, times in bert_steps(args.bert_steps, profile=True).items():
            dropouts = sum(ms for name, ms in times.items() if 'dropout' in name.lower())
            zeros = sum(ms for name, ms in times.items() if name.startswith('_zeros'))
            print("BERT-base bfloat16 training step, %s dropouts: their operators %.1f ms a step, "
                  "zero fills %.1f ms" % ("MXNet's" if side == 'mxnet' else 'own', dropouts, zeros))
        return 0
    if args.bert_steps:
        median = bert_steps(args.bert_steps)
        print("BERT-base bfloat16 training step: MXNet's dropouts %.3f s, own %.3f s (%.1f%% less)"
              % (median['mxnet'], median['own'], 100 * (1 - median['own'] / median['mxnet'])))
        return 0
    print('%-16s %-9s %12s %10s %8s' % ('shape', 'dtype', 'MXNet ms', 'own ms', 'speed-up'))
    for shape in SHAPES:
        for dtype in ('float32', 'bfloat16'):
            median = measure(shape, dtype, args.chain, args.repeats)
            print('%-16s %-9s %12.3f %10.3f %7.1fx' % (
                'x'.join(map(str, shape)), dtype, median['mxnet'], median['own'],
                median['mxnet'] / median['own']))
    return 0


if __name__ == '__main__':
    sys.exit(main())
