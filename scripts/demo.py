"""``make demo``: FP32 against mixed precision on the digits, side by side.

Trains a small ResNet (GluonCV ``cifar_resnet20_v1``) on scikit-learn's
handwritten digits, packed as MXNet RecordIO (``scripts/digits_rec.py``), with
``scripts/train_imagenet.py``: once in FP32 and once in mixed precision,
bfloat16, for each seed.  On a CPU with AVX512-BF16 or AMX that is ``--dtype
auto`` and bfloat16 computes natively; on other CPUs ``auto`` would stay FP32,
so the mixed runs ask for ``--dtype bfloat16``: bfloat16 parameters, FP32
compute (MXNet's oneDNN has no bfloat16 kernels without AVX-512, only slow
emulated ones without AVX512-BF16), still the accuracy of bfloat16 weights.
Every run is its own process, so its peak RSS is its own; FP32 and mixed runs
alternate, so a noisy machine disturbs both alike.  Prints a table (precision,
how it computed, top-1, top-5, img/s, peak RSS, skipped steps) with the CPU
class that decided how, and writes a PNG of the loss and accuracy curves (mean
over seeds) and the throughput.

Usage::

    python scripts/demo.py                      # 3 seeds, about 2 minutes on 2 cores
    python scripts/demo.py --seeds 3 --plot docs/digits_fp32_vs_bf16.png
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(_HERE, 'train_imagenet.py')
sys.path.insert(0, _HERE)


def _run(dtype, seed, args, save_dir):
    command = [sys.executable, TRAIN, '--dataset', 'digits', '--model', args.model,
               '--dtype', dtype, '--seed', str(seed), '--num-epochs', str(args.epochs),
               '--batch-size', str(args.batch_size), '--lr', str(args.lr),
               '--warmup-epochs', '1', '--no-wd', '--no-progress', '--save-dir', save_dir,
               '--save-prefix', 'digits', '--keep-checkpoints', '1']
    if args.data_dir:
        command += ['--data-dir', args.data_dir]
    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, 'stdout.log'), 'w') as log:
        status = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
    if status != 0:
        with open(os.path.join(save_dir, 'stdout.log')) as log:
            tail = log.read().splitlines()[-15:]
        raise SystemExit('demo: the %s run (seed %d) failed with status %d:\n%s'
                         % (dtype, seed, status, '\n'.join(tail)))
    with open(os.path.join(save_dir, 'digits-summary.json')) as handle:
        return json.load(handle)


def _mean_rows(all_rows):
    """Epoch-wise mean of several runs' metric rows (same epochs)."""
    return [{key: float(np.mean([rows[i][key] for rows in all_rows])) for key in all_rows[0][i]}
            for i in range(min(len(rows) for rows in all_rows))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--seeds', type=int, default=3, help='runs per precision')
    parser.add_argument('--epochs', type=int, default=12)
    parser.add_argument('--model', default='cifar_resnet20_v1')
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--lr', type=float, default=0.1)
    parser.add_argument('--data-dir', default=None, help='digits cache (default ~/.mxamp/digits)')
    parser.add_argument('--out-dir', default=os.path.join('runs', 'demo'))
    parser.add_argument('--plot', default=None,
                        help='PNG path (default <out-dir>/digits_fp32_vs_mixed.png)')
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.epochs < 1:
        parser.error('--seeds and --epochs must be at least 1')
    from imagenet import report
    from mxamp import hardware
    from tqdm import tqdm

    # 'auto' stays FP32 where bfloat16 does not pay (mxamp.hardware.bfloat16_pays); the
    # demo compares precisions, so there it asks for bfloat16 (storage only on CPUs
    # without bfloat16 kernels).
    mixed = 'auto' if hardware.bfloat16_pays() else 'bfloat16'
    dtypes = ('float32', mixed)
    results = {dtype: [] for dtype in dtypes}
    rows = {dtype: [] for dtype in dtypes}
    started = time.time()
    with tqdm(total=args.seeds * len(dtypes), desc='digits runs', unit='run') as bar:
        for seed in range(args.seeds):
            for dtype in dtypes:
                bar.set_postfix_str('%s, seed %d' % (dtype, seed))
                save_dir = os.path.join(args.out_dir, '%s-seed%d' % (dtype, seed))
                results[dtype].append(_run(dtype, seed, args, save_dir))
                rows[dtype].append(report.read_metrics(
                    os.path.join(save_dir, 'digits-metrics.csv')))
                bar.update()

    # What ran and how, as the training runs report it (summary 'dtype', 'compute').
    ran = {dtype: results[dtype][0] for dtype in dtypes}
    labels = {dtype: 'FP32' if dtype == 'float32' else 'mixed (%s)' % ran[dtype]['dtype']
              for dtype in dtypes}
    plot_labels = {dtype: report.run_label(ran[dtype]['dtype'], ran[dtype]['compute'])
                   for dtype in dtypes}
    print('\n%s on the digits (%d train / 297 val images), %d epochs, %d seed(s), %s'
          % (args.model, 1500, args.epochs, args.seeds, time.strftime('%Y-%m-%d')))
    how_width = max(len(ran[dtype]['compute']) for dtype in dtypes)
    header = '%-18s %-*s %16s %8s %10s %14s %8s' % ('precision', how_width, 'how',
                                                    'top-1 (mean±sd)', 'top-5', 'img/s',
                                                    'peak RSS MiB', 'skipped')
    print(header)
    print('-' * len(header))
    table = {}
    for dtype in dtypes:
        runs = results[dtype]
        top1 = np.array([r['val_top1'] for r in runs]) * 100
        entry = {'top1_mean': float(top1.mean()), 'top1_std': float(top1.std()),
                 'top1_per_seed': [float(v) for v in top1],
                 'top5_mean': float(np.mean([r['val_top5'] for r in runs]) * 100),
                 'img_per_sec': float(np.median([r['img_per_sec'] for r in runs])),
                 'peak_rss_mb': float(np.max([r['peak_rss_mb'] for r in runs])),
                 'skipped_steps': int(sum(r['skipped_steps'] for r in runs)),
                 'dtype': ran[dtype]['dtype'], 'compute': ran[dtype]['compute']}
        table[labels[dtype]] = entry
        print('%-18s %-*s %9.2f ± %4.2f %7.2f%% %10.0f %14.0f %8d'
              % (labels[dtype], how_width, entry['compute'], entry['top1_mean'],
                 entry['top1_std'], entry['top5_mean'], entry['img_per_sec'],
                 entry['peak_rss_mb'], entry['skipped_steps']))
    device = ran[mixed]['device']
    print('\nwhy: %s' % device)
    fp32, low = table[labels['float32']], table[labels[mixed]]
    print('mixed - FP32: top-1 %+.2f points, throughput x%.2f (median img/s over seeds; '
          'total %.0f s)' % (low['top1_mean'] - fp32['top1_mean'],
                             low['img_per_sec'] / fp32['img_per_sec'], time.time() - started))
    plot = args.plot or os.path.join(args.out_dir, 'digits_fp32_vs_mixed.png')
    # The bars show the table's img/s: curves are means over seeds, throughput the median.
    report.plot_runs([(plot_labels[d], _mean_rows(rows[d])) for d in dtypes], plot,
                     title='%s on digits, mean of %d seed(s); CPU class %r'
                     % (args.model, args.seeds, hardware.cpu_class()),
                     throughput=([table[labels[d]]['img_per_sec'] for d in dtypes],
                                 'median over seeds'))
    with open(os.path.join(args.out_dir, 'results.json'), 'w') as handle:
        json.dump({'model': args.model, 'epochs': args.epochs, 'seeds': args.seeds,
                   'device': device, 'results': table}, handle, indent=1)
    print('plot: %s\nresults: %s' % (plot, os.path.join(args.out_dir, 'results.json')))
    return 0


if __name__ == '__main__':
    sys.exit(main())
