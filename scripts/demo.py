"""``make demo``: FP32 against mixed precision on the digits, side by side.

Trains a small ResNet (GluonCV ``cifar_resnet20_v1``) on scikit-learn's
handwritten digits, packed as MXNet RecordIO (``scripts/digits_rec.py``), with
``scripts/train_imagenet.py``: once in FP32 and once in mixed precision
(``--dtype auto``: bfloat16 on a CPU, float16 on a GPU), for each seed.  Every
run is its own process, so its peak RSS is its own; FP32 and mixed runs
alternate, so a noisy machine disturbs both alike.  Prints a table (top-1,
top-5, img/s, peak RSS, skipped steps) and writes a PNG of the loss and
accuracy curves (mean over seeds) and the throughput.

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
    import train_imagenet
    from tqdm import tqdm

    dtypes = ('float32', 'auto')
    results = {dtype: [] for dtype in dtypes}
    rows = {dtype: [] for dtype in dtypes}
    started = time.time()
    with tqdm(total=args.seeds * len(dtypes), desc='digits runs', unit='run') as bar:
        for seed in range(args.seeds):
            for dtype in dtypes:
                bar.set_postfix_str('%s, seed %d' % (dtype, seed))
                save_dir = os.path.join(args.out_dir, '%s-seed%d' % (dtype, seed))
                results[dtype].append(_run(dtype, seed, args, save_dir))
                rows[dtype].append(train_imagenet.read_metrics(
                    os.path.join(save_dir, 'digits-metrics.csv')))
                bar.update()

    labels = {dtype: 'FP32' if dtype == 'float32' else
              'mixed (%s)' % results[dtype][0]['dtype'] for dtype in dtypes}
    print('\n%s on the digits (%d train / 297 val images), %d epochs, %d seed(s), %s'
          % (args.model, 1500, args.epochs, args.seeds, time.strftime('%Y-%m-%d')))
    header = '%-18s %16s %8s %10s %14s %8s' % ('precision', 'top-1 (mean±sd)', 'top-5',
                                               'img/s', 'peak RSS MiB', 'skipped')
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
                 'skipped_steps': int(sum(r['skipped_steps'] for r in runs))}
        table[labels[dtype]] = entry
        print('%-18s %9.2f ± %4.2f %7.2f%% %10.0f %14.0f %8d'
              % (labels[dtype], entry['top1_mean'], entry['top1_std'], entry['top5_mean'],
                 entry['img_per_sec'], entry['peak_rss_mb'], entry['skipped_steps']))
    fp32, mixed = table[labels['float32']], table[labels['auto']]
    print('\nmixed - FP32: top-1 %+.2f points, throughput x%.2f (median img/s over seeds; '
          'total %.0f s)' % (mixed['top1_mean'] - fp32['top1_mean'],
                             mixed['img_per_sec'] / fp32['img_per_sec'], time.time() - started))
    plot = args.plot or os.path.join(args.out_dir, 'digits_fp32_vs_mixed.png')
    train_imagenet.plot_runs([(labels[d], _mean_rows(rows[d])) for d in dtypes], plot,
                             title='%s on digits, mean of %d seed(s)' % (args.model, args.seeds))
    with open(os.path.join(args.out_dir, 'results.json'), 'w') as handle:
        json.dump({'model': args.model, 'epochs': args.epochs, 'seeds': args.seeds,
                   'results': table}, handle, indent=1)
    print('plot: %s\nresults: %s' % (plot, os.path.join(args.out_dir, 'results.json')))
    return 0


if __name__ == '__main__':
    sys.exit(main())
