#!/usr/bin/env python
"""GluonTS forecasters trained through their estimators in FP32, under 'auto' and in bfloat16.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python scripts/gluonts_parity.py            # DeepAR and MQ-CNN
    OMP_NUM_THREADS=2 .venv/bin/python scripts/gluonts_parity.py --models deepar --seeds 5

For each model and seed, the estimator (``DeepAREstimator(num_layers=2,
num_cells=40)``, ``MQCNNEstimator`` or another of `MODELS`, each with its
defaults; hourly, context 48, prediction 24, batch 32) trains with
``mxamp.gluonts.Trainer(dtype=...)`` for ``--epochs`` of 25 batches on 40
synthetic series (daily and weekly sines, a level per series,
Gaussian noise; the seed draws the noise and the network's initial values),
and its predictor forecasts the last 24 hours of each series; the table shows
the mean weighted quantile loss (quantiles 0.1, 0.5, 0.9, 100 sample paths)
per dtype and seed, and the training's wall time (the machine's load included:
for speed, ``scripts/benchmark.py --networks`` with the same model names).
Needs GluonTS (``pip install mxamp[gluonts]``).
"""
import argparse
import logging
import sys
import time
import warnings

import numpy as np

import mxamp  # noqa: F401  (first: enables AMX before oneDNN's first primitive)
import mxnet as mx
from tqdm import tqdm

try:
    from gluonts.dataset.common import ListDataset
    from gluonts.evaluation import Evaluator, make_evaluation_predictions
except ImportError as err:
    sys.exit('gluonts_parity: needs GluonTS (pip install mxamp[gluonts]): %s' % err)

import mxamp.gluonts
from gluonts_estimators import MODELS, PREDICTION, estimator, hourly_series

DTYPES = ('float32', 'auto', 'bfloat16')
HOURS = 24 * 40


def datasets(seed):
    """Training series (the last `PREDICTION` hours held out) and the whole series."""
    series = hourly_series(np.random.RandomState(100 + seed), 40, HOURS)
    train = ListDataset([dict(s, target=s['target'][:-PREDICTION]) for s in series], freq='H')
    return train, ListDataset(series, freq='H')


def trained(model, dtype, seed, epochs):
    """(mean weighted quantile loss, seconds of training) of one run."""
    mx.random.seed(seed)
    np.random.seed(seed)
    train, test = datasets(seed)
    trainer = mxamp.gluonts.Trainer(dtype=dtype, epochs=epochs, num_batches_per_epoch=25,
                                    add_default_callbacks=False)
    start = time.time()
    predictor = estimator(model, trainer).train(train)
    seconds = time.time() - start
    forecasts, series = make_evaluation_predictions(test, predictor, num_samples=100)
    metrics, _ = Evaluator(quantiles=[0.1, 0.5, 0.9], num_workers=0)(series, list(forecasts))
    return metrics['mean_wQuantileLoss'], seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default='deepar,mqcnn',
                        help='comma-separated, of: %s (default: deepar,mqcnn)'
                        % ', '.join(MODELS))
    parser.add_argument('--seeds', type=int, default=3)
    parser.add_argument('--epochs', type=int, default=8)
    args = parser.parse_args(argv)
    models = args.models.split(',')
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        sys.exit('gluonts_parity: --models %s: expected some of %s'
                 % (','.join(unknown), ', '.join(MODELS)))
    logging.disable(logging.WARNING)
    rows = []
    with warnings.catch_warnings(), tqdm(total=len(models) * args.seeds * len(DTYPES),
                                         desc='runs', unit='run') as progress:
        warnings.simplefilter('ignore')
        for model in models:
            for seed in range(args.seeds):
                losses = {}
                for dtype in DTYPES:
                    losses[dtype] = trained(model, dtype, seed, args.epochs)
                    progress.update(1)
                rows.append((model, seed, losses))
    print('%-18s %4s  %s' % ('model', 'seed', '  '.join('%-18s' % d for d in DTYPES)))
    for model, seed, losses in rows:
        print('%-18s %4d  %s' % (model, seed, '  '.join(
            '%.4f (%5.1f s)    ' % losses[d] for d in DTYPES)))
    print('mean weighted quantile loss (training seconds); epochs of 25 batches: %d' % args.epochs)


if __name__ == '__main__':
    main()
