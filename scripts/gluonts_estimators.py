"""The GluonTS 0.17 MXNet estimators the scripts train, each with its options, and synthetic
hourly series to train them on.

``scripts/gluonts_parity.py`` trains them through their estimators (accuracy);
``scripts/benchmark.py`` times their training networks (speed).  GluonTS is
imported only when an estimator is built, so that the scripts load without it.
"""
import inspect

import numpy as np

PREDICTION, CONTEXT = 24, 48

#: Each model's estimator class in ``gluonts.mx`` and its options besides the common ones
#: (hourly, `PREDICTION` hours predicted; `CONTEXT` hours of context where taken).
MODELS = {
    'deepar': ('DeepAREstimator', {'num_layers': 2, 'num_cells': 40}),
    'mqcnn': ('MQCNNEstimator', {}),
    'mqrnn': ('MQRNNEstimator', {}),
    'nbeats': ('NBEATSEstimator', {}),
    'simple_feedforward': ('SimpleFeedForwardEstimator', {}),
    'ts_transformer': ('TransformerEstimator', {}),
    'wavenet': ('WaveNetEstimator', {}),
    'deepstate': ('DeepStateEstimator', {'use_feat_static_cat': False, 'cardinality': [1],
                                         'past_length': CONTEXT}),
    'deep_factor': ('DeepFactorEstimator', {}),
    'tft': ('TemporalFusionTransformerEstimator', {}),
    'canonical_rnn': ('CanonicalRNNEstimator', {}),
}


def estimator(model, trainer, batch_size=32):
    """`model`'s estimator (`MODELS`), training with `trainer` (a ``gluonts.mx`` Trainer); the
    common options go to the estimators that take them (SimpleFeedForward has no ``freq``,
    WaveNet no context), the batch size to all."""
    import gluonts.mx as estimators
    name, options = MODELS[model]
    klass = getattr(estimators, name)
    common = {'freq': 'H', 'prediction_length': PREDICTION, 'context_length': CONTEXT,
              'batch_size': batch_size, 'trainer': trainer}
    taken = inspect.signature(klass.__init__).parameters
    built = klass(**{key: value for key, value in common.items() if key in taken}, **options)
    # CanonicalRNN takes no batch size: its loader reads the attribute its base class sets.
    built.batch_size = batch_size
    return built


def hourly_series(rng, count, hours):
    """`count` series of `hours` values: daily and weekly sines, a level per series, Gaussian
    noise drawn from `rng` (a ``numpy.random.RandomState``)."""
    steps = np.arange(hours)
    return [{'start': '2021-01-01 00:00',
             'target': (20 + 3 * k + 8 * np.sin(steps * 2 * np.pi / 24 + k)
                        + 3 * np.sin(steps * 2 * np.pi / 168) + rng.normal(size=hours))
             .astype('float32')} for k in range(count)]
