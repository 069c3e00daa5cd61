#!/usr/bin/env python
"""Where bfloat16 starts to pay for a layer on this CPU: the data of ``mxamp/cost_table.json``.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python scripts/measure_costs.py            # table on stdout
    OMP_NUM_THREADS=2 .venv/bin/python scripts/measure_costs.py --json out.json --repeats 15
    OMP_NUM_THREADS=2 .venv/bin/python scripts/measure_costs.py --task inference

For each operator whose bfloat16 kernels are compute-bound (FullyConnected,
Convolution) and a ladder of sizes, a chain of one, two and four identical layers
(hybridized Gluon nets, FP32 against ``mxamp.convert(net, 'bfloat16')``) runs a
training step, forward, backward and an Adam update (``gluon.Trainer`` against
``mxamp.Trainer``, whose bfloat16 weights step through FP32 master copies),
or with ``--task inference`` a forward call outside ``autograd.record`` (the
graphs ``mxamp.for_inference`` and a Symbol converted ``for_inference`` weigh),
interleaved in this process; the table shows the median time of each and the
ratio.  One layer in bfloat16 pays for
the casts around it ("alone"); the layers inside the chain of four have
bfloat16 neighbours and no casts ("inside": the chain's extra three layers).
The work is the forward pass's floating-point operations per call (2 per
multiply-add), in MFLOP.  Two thresholds are written per operator, the two
fields of the table: ``pays_from_mflop``, the smallest work from which every
larger size ran at least ``--margin`` times faster in bfloat16, alone and
inside, and ``pays_from_flop_per_cast_value``, the same alone for the work
per output value (the values cast back to FP32 after a layer alone).  Below
either, ``'auto'`` keeps a layer whose data is FP32 in FP32 (`mxamp.cost`).
A third, ``region_pays_from_mflop``, is the same for the chain of two as a
whole ("region": two layers between the casts) against the two layers' work:
a layer below the first threshold whose region does that much work together
pays (`mxamp.cost.CostModel`), where the table takes it (docs/policy.rst says
which).  A fourth, ``inside_pays_from_mflop``, is the same inside the chain of
four alone: a layer counts towards its region's work from there.

``--ops`` also takes two blocks that are not operators of the table: a 3x3
convolution followed by BatchNorm and ReLU, and MobileNet's depthwise 3x3 and
pointwise 1x1 pair, each followed by them (the work is the convolutions').
The memory-bound layers between the convolutions gain in bfloat16 too: the
block ladder's ``inside_pays_from_mflop`` is the table's
``normalized_inside_pays_from_mflop`` for ``Convolution``, the size from which
a convolution a BatchNorm reads counts towards its region (docs/policy.rst,
"Regions of convolutions, for training").

Numbers depend on the CPU, its bfloat16 class (printed) and the threads:
measure on an idle machine; docs/policy.rst, "Layers too small for bfloat16",
keeps the measurements with their date and command.  The thresholds go into
``cost_table.json`` under the CPU class and the task.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time


import mxamp  # noqa: F401  (first: enables AMX before oneDNN's first primitive)
import mxnet as mx
from mxnet import autograd, gluon
from tqdm import tqdm

from mxamp import hardware

#: The update of each training step: Adam, the optimizer of GluonTS's estimators and of
#: fine-tuning (its bfloat16 step through master copies costs more than SGD's).
OPTIMIZER = ('adam', {'learning_rate': 1e-5})

#: (batch, in units, out units) of the FullyConnected ladder.
DENSE_SIZES = [(32, 16, 64), (32, 40, 160), (32, 64, 256), (32, 128, 512), (64, 256, 256),
               (32, 512, 512), (64, 512, 512), (32, 1024, 1024), (64, 1024, 1024),
               (128, 1024, 1024), (128, 1024, 4096)]
#: (batch, channels, height = width) of the 3x3 Convolution ladder (channels in = out).
CONV_SIZES = [(4, 8, 14), (8, 8, 28), (8, 16, 14), (8, 32, 14), (8, 16, 28), (8, 32, 28),
              (8, 64, 14), (16, 32, 28), (8, 64, 28), (8, 64, 56), (16, 128, 28), (16, 256, 14)]
#: (batch, channels, height = width) of the depthwise-separable block ladder: MobileNet 0.25's
#: and 0.5's blocks at batch 16.
SEPARABLE_SIZES = [(16, 16, 28), (16, 32, 28), (16, 64, 14), (16, 128, 14), (16, 64, 28),
                   (16, 128, 28), (16, 256, 14)]


def dense_chain(depth, units_in, units_out):
    # Widths alternate, so that every layer does the work of the first.
    widths = [units_in, units_out] * depth
    net = gluon.nn.HybridSequential()
    for k in range(depth):
        net.add(gluon.nn.Dense(widths[k + 1], flatten=False, in_units=widths[k]))
    return net


def conv_chain(depth, channels):
    net = gluon.nn.HybridSequential()
    for _ in range(depth):
        net.add(gluon.nn.Conv2D(channels, 3, padding=1, in_channels=channels))
    return net


def conv_block_chain(depth, channels, separable=False):
    # (kernel, groups) of each block's convolutions: a depthwise one first where separable.
    convolutions = [(3, channels), (1, 1)] if separable else [(3, 1)]
    net = gluon.nn.HybridSequential()
    for _ in range(depth):
        for kernel, groups in convolutions:
            net.add(gluon.nn.Conv2D(channels, kernel, padding=kernel // 2, groups=groups,
                                    use_bias=False, in_channels=channels),
                    gluon.nn.BatchNorm(in_channels=channels), gluon.nn.Activation('relu'))
    return net


def separable_work(size):
    batch, channels, side = size
    return 2e-6 * batch * channels * (channels + 9) * side * side


def dense_work(size):
    batch, units_in, units_out = size
    return 2e-6 * batch * units_in * units_out


def conv_work(size):
    batch, channels, side = size
    return 2e-6 * batch * channels * channels * 9 * side * side


def dense_data(size):
    return mx.nd.random.uniform(-1, 1, (size[0], size[1]))


def dense_outputs(size):
    return size[0] * size[2]


def conv_outputs(size):
    return size[0] * size[1] * size[2] * size[2]


def conv_data(size):
    return mx.nd.random.uniform(-1, 1, (size[0], size[1], size[2], size[2]))


#: What a timed step does, per ``--task``.
TASKS = {'training': 'training step (forward, backward, Adam update)',
         'inference': 'forward call, recording nothing'}

OPERATORS = {
    'FullyConnected': (DENSE_SIZES, lambda depth, s: dense_chain(depth, s[1], s[2]), dense_work,
                       dense_outputs, dense_data),
    'Convolution': (CONV_SIZES, lambda depth, s: conv_chain(depth, s[1]), conv_work,
                    conv_outputs, conv_data),
}
#: Ladders of blocks, measured as the operators are, for what the cost model leaves out.
BLOCKS = {
    'Convolution+BatchNorm+ReLU': (CONV_SIZES, lambda depth, s: conv_block_chain(depth, s[1]),
                                   conv_work, conv_outputs, conv_data),
    'Separable+BatchNorm+ReLU': (SEPARABLE_SIZES,
                                 lambda depth, s: conv_block_chain(depth, s[1], True),
                                 separable_work, conv_outputs, conv_data),
}


def ladder(op):
    """(sizes, chain builder, work, outputs, data) of the operator or block `op`."""
    return OPERATORS[op] if op in OPERATORS else BLOCKS[op]


def trained_step(net, data, trainer):
    """A training step of `net` on `data`: forward, backward (weights' and data's gradients,
    as a layer inside a network computes them) and `trainer`'s update."""
    data.attach_grad()

    def step():
        with autograd.record():
            out = net(data)
        out.backward()
        trainer.step(data.shape[0])
    return step


def inferred_step(net, data):
    """A forward call of `net` on `data`, recording nothing (inference)."""
    def step():
        net(data)
    return step


def built(make, depth, size, data, dtype, task):
    mx.random.seed(0)
    net = make(depth, size)
    net.initialize(mx.init.Xavier())
    if dtype != 'float32':
        mxamp.convert(net, dtype)
    net.hybridize(static_alloc=True, static_shape=True)
    if task == 'inference':
        step = inferred_step(net, data)
    else:
        # The update counts: bfloat16 weights step through FP32 master copies
        # (mxamp.Trainer), which costs more than FP32's own step, most on small tensors
        # (a layer's bias).
        make_trainer = gluon.Trainer if dtype == 'float32' else mxamp.Trainer
        trainer = make_trainer(net.collect_params(), *OPTIMIZER)
        step = trained_step(net, data, trainer)
    for _ in range(3):
        step()
    mx.nd.waitall()
    return step


def timed(step):
    start = time.perf_counter()
    step()
    mx.nd.waitall()
    return time.perf_counter() - start


def measure(op, repeats, progress, task='training'):
    sizes, make, work, outputs, make_data = ladder(op)
    rows = []
    for size in sizes:
        data = make_data(size)
        steps = {(depth, dtype): built(make, depth, size, data.copy(), dtype, task)
                 for depth in (1, 2, 4) for dtype in ('float32', 'bfloat16')}
        times = {key: [] for key in steps}
        for _ in range(repeats):
            for key, step in steps.items():
                times[key].append(timed(step))
        median = {key: statistics.median(values) for key, values in times.items()}
        alone = median[(1, 'float32')] / median[(1, 'bfloat16')]
        inside = ((median[(4, 'float32')] - median[(1, 'float32')])
                  / max(median[(4, 'bfloat16')] - median[(1, 'bfloat16')], 1e-9))
        region = median[(2, 'float32')] / median[(2, 'bfloat16')]
        # Exact: a threshold is a measured size's work, which the same layer must reach.
        rows.append({'size': list(size), 'mflop': work(size),
                     'flop_per_cast_value': 1e6 * work(size) / outputs(size),
                     'region_mflop': 2 * work(size),
                     'float32_ms': round(1e3 * median[(1, 'float32')], 3),
                     'bfloat16_ms': round(1e3 * median[(1, 'bfloat16')], 3),
                     'alone': round(alone, 3), 'inside': round(inside, 3),
                     'region': round(region, 3)})
        progress.update(1)
    return rows


def threshold(rows, key, margin, columns=('alone', 'inside')):
    """The smallest `key` from which every row (sizes of equal `key` included) ran at least
    `margin` times faster in bfloat16 in each of `columns`; None if none does.

    The work threshold takes both: a layer that opens a bfloat16 region takes the layers
    after it along (their data is bfloat16), and with the update counted, small ones there
    ran slower.  The threshold per value cast takes ``'alone'``: inside, nothing is cast."""
    paying = None
    for value in sorted({row[key] for row in rows}, reverse=True):
        if any(min(row[column] for column in columns) < margin
               for row in rows if row[key] >= value):
            break
        paying = value
    return paying


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--repeats', type=int, default=9, help='timed steps per mode and size')
    parser.add_argument('--margin', type=float, default=1.05,
                        help='bfloat16 pays from this ratio to FP32 (default 1.05)')
    parser.add_argument('--json', help='also write the measurements and thresholds here')
    parser.add_argument('--ops', nargs='+', default=list(OPERATORS),
                        choices=list(OPERATORS) + list(BLOCKS),
                        help='the ladders to run (default: the operators of the table)')
    parser.add_argument('--task', choices=list(TASKS), default='training',
                        help='what each step does (default: %(default)s)')
    args = parser.parse_args(argv)
    klass = hardware.cpu_class()
    if not hardware.computes_bfloat16(klass):
        sys.exit('measure_costs: this %s computes no bfloat16: there is nothing to measure'
                 % hardware.describe_cpu_class())
    threads = os.environ.get('OMP_NUM_THREADS', 'unset')
    total = sum(len(ladder(op)[0]) for op in args.ops)
    result = {'cpu_class': klass, 'task': args.task, 'cpu': hardware.cpu_model(),
              'threads': threads, 'date': datetime.date.today().isoformat(),
              'margin': args.margin,
              'command': 'OMP_NUM_THREADS=%s scripts/measure_costs.py %s'
                         % (threads, ' '.join(argv if argv is not None else sys.argv[1:])),
              'operators': {}}
    with tqdm(total=total, desc='sizes', unit='size') as progress:
        for op in args.ops:
            rows = measure(op, args.repeats, progress, args.task)
            result['operators'][op] = {
                'pays_from_mflop': threshold(rows, 'mflop', args.margin),
                'pays_from_flop_per_cast_value': threshold(rows, 'flop_per_cast_value',
                                                           args.margin, ('alone',)),
                'region_pays_from_mflop': threshold(rows, 'region_mflop', args.margin,
                                                    ('region',)),
                'inside_pays_from_mflop': threshold(rows, 'mflop', args.margin, ('inside',)),
                'rows': rows}
    print('%s, %s threads; %s, medians of %d'
          % (hardware.describe_cpu_class(klass), threads, TASKS[args.task], args.repeats))
    for op, entry in result['operators'].items():
        print('\n%s: bfloat16 pays from %s MFLOP a call and %s FLOP per value cast; a region '
              'of layers below, from %s MFLOP together; inside a region, from %s'
              % (op, entry['pays_from_mflop'], entry['pays_from_flop_per_cast_value'],
                 entry['region_pays_from_mflop'], entry['inside_pays_from_mflop']))
        print('%-22s %10s %12s %12s %8s %8s %8s' % ('size', 'MFLOP', 'FP32 ms', 'bf16 ms',
                                                     'alone', 'inside', 'region'))
        for row in entry['rows']:
            print('%-22s %10.3f %12.3f %12.3f %7.2fx %7.2fx %7.2fx'
                  % (tuple(row['size']), row['mflop'], row['float32_ms'], row['bfloat16_ms'],
                     row['alone'], row['inside'], row['region']))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
