#!/usr/bin/env python
"""How fast this CPU runs BERT-base's dense layers, and what that bounds inference at.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python scripts/dense_ceiling.py
    /path/to/python-with-torch scripts/dense_ceiling.py --framework torch --threads 2

Times one fully connected layer forward (``FullyConnected`` in MXNet, which runs
oneDNN 2.4's inner product; ``torch.nn.functional.linear`` in PyTorch, oneDNN 3's),
in float32 and in bfloat16, for each dense layer of a BERT-base encoder layer at
batch 8 x 128 tokens (the fused query-key-value projection, the attention output,
the two feed-forward layers) and for one large square product, which shows the
best rate the kernels reach on these cores.  Each repetition times each case once,
interleaved; the table shows medians, in ms and GFLOP/s.

The last lines add the encoder's 12 layers up: the time its dense layers take a
batch at the measured bfloat16 rates, and so the most sequences a second BERT-base
inference can reach if everything else took no time.  That is the ceiling any
kernel work on these layers runs into; docs/performance.rst compares it with
mxamp's and PyTorch's inference.  PyTorch is a measurement aid: run the script
with a Python that has it (mxamp never imports it).  Numbers depend on the CPU
and on what else runs on it: compare rows of one run only.
"""
import argparse
import os
import statistics
import sys
import time

import benchmark_harness as harness  # the standard library only

# BERT-base (bert_12_768_12): 12 layers of 768 units, feed-forward 3072.
LAYERS = 12
UNITS = 768
HIDDEN = 3072
# (name, input features, output features) of one encoder layer's dense layers.
DENSE_LAYERS = (('query-key-value', UNITS, 3 * UNITS), ('attention output', UNITS, UNITS),
                ('feed-forward in', UNITS, HIDDEN), ('feed-forward out', HIDDEN, UNITS))
DTYPES = ('float32', 'bfloat16')


class _MXNet:
    name = 'mxnet'

    def __init__(self, threads):
        if threads is not None:
            os.environ['OMP_NUM_THREADS'] = str(threads)  # before MXNet starts OpenMP
        from mxamp.dtypes import cast  # mxamp first: it enables AMX before oneDNN's first primitive
        import mxnet as mx
        self.mx, self.cast = mx, cast
        self.version = 'mxnet %s' % mx.__version__
        self.threads = threads or int(os.environ.get('OMP_NUM_THREADS') or os.cpu_count())

    def dense(self, rows, inputs, outputs, dtype):
        mx = self.mx
        arrays = [mx.nd.random.uniform(-1, 1, shape=shape)
                  for shape in ((rows, inputs), (outputs, inputs), (outputs,))]
        if dtype != 'float32':
            arrays = [self.cast(array, dtype) for array in arrays]
        data, weight, bias = arrays
        return lambda: mx.nd.FullyConnected(data, weight, bias, num_hidden=outputs)

    def timed(self, run):
        self.mx.nd.waitall()
        start = time.perf_counter()
        run().wait_to_read()
        return 1e3 * (time.perf_counter() - start)


class _Torch:
    name = 'torch'

    def __init__(self, threads):
        import torch
        if threads is not None:
            torch.set_num_threads(threads)
        self.torch = torch
        self.version = 'torch %s' % torch.__version__
        self.threads = torch.get_num_threads()
        torch.set_grad_enabled(False)

    def dense(self, rows, inputs, outputs, dtype):
        torch = self.torch
        kind = getattr(torch, dtype)
        data, weight, bias = (torch.rand(*shape).mul_(2).sub_(1).to(kind)
                              for shape in ((rows, inputs), (outputs, inputs), (outputs,)))
        return lambda: torch.nn.functional.linear(data, weight, bias)

    def timed(self, run):
        start = time.perf_counter()
        run()
        return 1e3 * (time.perf_counter() - start)


def cases(tokens, square):
    """``(label, rows, inputs, outputs, layers)``: what is timed, and how often the
    encoder runs it a batch (0: not part of it)."""
    found = [(name, tokens, inputs, outputs, LAYERS) for name, inputs, outputs in DENSE_LAYERS]
    found.append(('square %d' % square, square, square, square, 0))
    return found


def measure(framework, tokens, square, warmup, repeats):
    """Median ms of each case in each dtype: ``{(label, dtype): ms}``."""
    runs = {(case[0], dtype): framework.dense(*case[1:4], dtype)
            for case in cases(tokens, square) for dtype in DTYPES}
    for run in runs.values():
        for _ in range(warmup):
            framework.timed(run)
    times = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            times[key].append(framework.timed(run))
    return {key: statistics.median(values) for key, values in times.items()}


def gflops(rows, inputs, outputs, ms):
    return 2.0 * rows * inputs * outputs / ms / 1e6


def report(framework, tokens, batch, square, medians):
    """The table's lines and the JSON record of one run."""
    rows, records = [], []
    for label, m, k, n, layers in cases(tokens, square):
        record = {'layer': label, 'rows': m, 'inputs': k, 'outputs': n, 'per_batch': layers}
        for dtype in DTYPES:
            ms = medians[(label, dtype)]
            record[dtype] = {'ms': ms, 'gflops': gflops(m, k, n, ms)}
        records.append(record)
        rows.append('%-18s %5d x %4d -> %4d  %9.2f %8.0f  %9.2f %8.0f  %5.2fx' % (
            label, m, k, n, record['float32']['ms'], record['float32']['gflops'],
            record['bfloat16']['ms'], record['bfloat16']['gflops'],
            record['float32']['ms'] / record['bfloat16']['ms']))
    per_batch = {dtype: sum(medians[(r['layer'], dtype)] * r['per_batch'] for r in records)
                 for dtype in DTYPES}
    work = sum(2.0 * r['rows'] * r['inputs'] * r['outputs'] * r['per_batch'] for r in records)
    ceiling = {dtype: 1e3 * batch / per_batch[dtype] for dtype in DTYPES}
    lines = ['%s, %d threads; BERT-base dense layers at %d tokens (batch %d)'
             % (framework.version, framework.threads, tokens, batch),
             '%-18s %-19s  %9s %8s  %9s %8s  %6s' % ('layer', 'shape', 'fp32 ms', 'GFLOP/s',
                                                    'bf16 ms', 'GFLOP/s', 'x fp32')]
    lines += rows
    lines.append('%d layers: %.1f GFLOP of dense work a batch; %.0f ms in float32, %.0f ms '
                 'in bfloat16' % (LAYERS, work / 1e9, per_batch['float32'],
                                  per_batch['bfloat16']))
    lines.append('inference ceiling from the dense layers alone: %.2f sequences/s in float32, '
                 '%.2f in bfloat16' % (ceiling['float32'], ceiling['bfloat16']))
    return lines, {'framework': framework.version, 'threads': framework.threads,
                   'tokens': tokens, 'batch': batch, 'layers': records,
                   'dense_gflop_per_batch': work / 1e9, 'dense_ms_per_batch': per_batch,
                   'ceiling_sequences_per_s': ceiling}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--framework', choices=('mxnet', 'torch'), default='mxnet')
    parser.add_argument('--threads', type=int, default=None,
                        help='threads (default: OMP_NUM_THREADS, else every CPU)')
    parser.add_argument('--batch', type=int, default=8, help='sequences a batch (default 8)')
    parser.add_argument('--length', type=int, default=128, help='tokens a sequence (default 128)')
    parser.add_argument('--square', type=int, default=4096,
                        help='size of the square product (default 4096)')
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--repeats', type=int, default=11)
    parser.add_argument('--output', help='also write the figures to this JSON file')
    args = parser.parse_args(argv)
    for name in ('threads', 'batch', 'length', 'square', 'repeats'):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error('--%s must be at least 1, got %d' % (name, value))
    return args


def main(argv=None):
    args = parse_args(argv)
    framework = (_MXNet if args.framework == 'mxnet' else _Torch)(args.threads)
    tokens = args.batch * args.length
    medians = measure(framework, tokens, args.square, args.warmup, args.repeats)
    lines, record = report(framework, tokens, args.batch, args.square, medians)
    print('\n'.join(lines))
    if args.output:
        cpu_model, hardware = harness.cpu_info()
        meta = dict(harness.run_meta(__file__, sys.argv[1:] if argv is None else list(argv), args),
                    cpu_model=cpu_model, cpu_count=os.cpu_count(), hardware=hardware,
                    load_average=list(os.getloadavg()))
        harness.write_json(args.output, {'meta': meta, 'table': '\n'.join(lines), **record})
        print('written: %s' % args.output)
    return 0


if __name__ == '__main__':
    sys.exit(main())
