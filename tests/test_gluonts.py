"""GluonTS estimators trained with mxamp through their own `train` (mxamp.gluonts.Trainer)."""
import warnings

import numpy as np
import pytest

gluonts = pytest.importorskip('gluonts', reason='mxamp.gluonts needs GluonTS (the test extra '
                                                'installs it on Python 3.10 and 3.11)')

import mxnet as mx  # noqa: E402

import mxamp  # noqa: E402
import mxamp.gluonts  # noqa: E402
from gluonts.dataset.common import ListDataset  # noqa: E402
from gluonts.evaluation import Evaluator, make_evaluation_predictions  # noqa: E402
from gluonts.model.predictor import Predictor  # noqa: E402
from gluonts.mx import DeepAREstimator, MQCNNEstimator  # noqa: E402
from gluonts.mx.trainer import Trainer as GluonTSTrainer  # noqa: E402

from conftest import needs_bfloat16_compute  # noqa: E402

FREQ, PREDICTION = 'H', 12


def _series(seed=0, count=8, length=24 * 12):
    rng = np.random.RandomState(seed)
    steps = np.arange(length)
    return [{'start': '2021-01-01 00:00',
             'target': (10 + 5 * np.sin(steps * 2 * np.pi / 24 + k) + rng.normal(size=length))
             .astype('float32')} for k in range(count)]


def _datasets():
    series = _series()
    train = ListDataset([dict(s, target=s['target'][:-PREDICTION]) for s in series], freq=FREQ)
    return train, ListDataset(series, freq=FREQ)


def _deepar(trainer):
    return DeepAREstimator(freq=FREQ, prediction_length=PREDICTION, context_length=24,
                           num_layers=1, num_cells=10, batch_size=16, trainer=trainer)


def _trained(make_estimator, trainer, seed=0):
    """The predictor `train` returns, and its forecasts' mean weighted quantile loss."""
    mx.random.seed(seed)
    np.random.seed(seed)
    train, test = _datasets()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        predictor = make_estimator(trainer).train(train)
        forecasts, series = make_evaluation_predictions(test, predictor, num_samples=20)
        forecasts = list(forecasts)
        metrics, _ = Evaluator(quantiles=[0.1, 0.5, 0.9], num_workers=0)(series, forecasts)
    return predictor, forecasts, metrics['mean_wQuantileLoss']


def _trainer(**kwargs):
    return dict(epochs=1, num_batches_per_epoch=3, add_default_callbacks=False, **kwargs)


def test_auto_trains_deepar_through_its_estimator_as_gluonts_does():
    # DeepAR's layers are far too small for bfloat16 to pay: 'auto' computes in FP32 and the
    # forecasts are GluonTS's own, value for value (float32 on CPUs without bfloat16 too).
    _, want, want_loss = _trained(_deepar, GluonTSTrainer(**_trainer()))
    predictor, got, got_loss = _trained(_deepar, mxamp.gluonts.Trainer(**_trainer()))
    assert got_loss == want_loss
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.samples, b.samples)
    assert {np.dtype(p.dtype) for p in predictor.prediction_net.collect_params().values()} == \
        {np.dtype('float32')}


def test_the_predictor_serializes_and_loads(tmp_path):
    predictor, forecasts, _ = _trained(_deepar, mxamp.gluonts.Trainer(**_trainer()))
    predictor.serialize(tmp_path)
    loaded = Predictor.deserialize(tmp_path)
    assert loaded.prediction_length == PREDICTION
    _, test = _datasets()
    assert len(list(loaded.predict(test, num_samples=5))) == len(forecasts)


@needs_bfloat16_compute
def test_bfloat16_trains_deepar_close_to_float32_and_says_it_will_be_slower(monkeypatch):
    from mxamp import gluon_warnings
    monkeypatch.setattr(gluon_warnings, '_warned_unpaid', False)
    _, _, want = _trained(_deepar, mxamp.gluonts.Trainer(dtype='float32', **_trainer()))
    with pytest.warns(RuntimeWarning, match='expect it slower than float32'):
        mx.random.seed(0)
        np.random.seed(0)
        _deepar(mxamp.gluonts.Trainer(dtype='bfloat16', **_trainer())).train(_datasets()[0])
    _, _, got = _trained(_deepar, mxamp.gluonts.Trainer(dtype='bfloat16', **_trainer()))
    assert np.isfinite(got)
    assert abs(got - want) < 0.03 * want   # measured over seeds 0-4: at most 0.5%


def test_auto_trains_a_convolutional_forecaster():
    def mqcnn(trainer):
        return MQCNNEstimator(freq=FREQ, prediction_length=PREDICTION, context_length=24,
                              batch_size=16, trainer=trainer)
    _, _, want = _trained(mqcnn, GluonTSTrainer(**_trainer()))
    _, _, got = _trained(mqcnn, mxamp.gluonts.Trainer(**_trainer()))
    # Its decoder's dense layer may pay for bfloat16 (by the CPU class's table): close, not equal.
    assert abs(got - want) < 0.02 * want   # measured over seeds 0-4: at most 0.2%


def test_float16_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="GluonTS calls loss.backward.. itself, so float16's "
                                         'loss scaling cannot apply'):
        mxamp.gluonts.Trainer(dtype='float16')


def test_the_trainer_keeps_gluonts_options():
    trainer = mxamp.gluonts.Trainer(dtype='bfloat16', exclude=['dense'], epochs=3,
                                    learning_rate=0.01)
    assert (trainer.dtype, trainer.exclude, trainer.epochs, trainer.learning_rate) == \
        ('bfloat16', ['dense'], 3, 0.01)


def _nbeats(trainer):
    from gluonts.mx import NBEATSEstimator
    return NBEATSEstimator(freq=FREQ, prediction_length=PREDICTION, context_length=24,
                           num_stacks=2, widths=[64], batch_size=16, trainer=trainer)


def _feedforward(trainer):
    from gluonts.mx import SimpleFeedForwardEstimator
    return SimpleFeedForwardEstimator(prediction_length=PREDICTION, context_length=24,
                                      batch_size=16, trainer=trainer)


def _transformer(trainer):
    from gluonts.mx import TransformerEstimator
    return TransformerEstimator(freq=FREQ, prediction_length=PREDICTION, context_length=24,
                                model_dim=16, inner_ff_dim_scale=2, num_heads=2,
                                batch_size=16, trainer=trainer)


@needs_bfloat16_compute
@pytest.mark.parametrize('make_estimator', [_nbeats, _feedforward, _transformer],
                         ids=['nbeats', 'simple_feedforward', 'transformer'])
def test_predictors_built_on_the_trained_parameters_or_blocks_predict(make_estimator):
    # These estimators hand the trained network's parameters (params=...) or blocks to the
    # predictor's network, which expects FP32 parameters; the Transformer's decoder predicts
    # with a flag and a dict of states, which no graph takes.  Before: NBEATS failed to build
    # its predictor (a bfloat16 parameter where FP32 was asked), the Transformer to predict.
    predictor, forecasts, loss = _trained(
        make_estimator, mxamp.gluonts.Trainer(dtype='bfloat16', **_trainer()))
    assert np.isfinite(loss) and all(np.isfinite(f.samples).all() for f in forecasts)
    assert {np.dtype(p.dtype) for p in predictor.prediction_net.collect_params().values()} == \
        {np.dtype('float32')}
