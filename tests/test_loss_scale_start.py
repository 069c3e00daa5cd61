"""Tests of the loss scale's start: the default 2**16 with a fast first descent.

Until the first step is applied, an overflow divides the default scale by 16;
afterwards, and always with an explicit ``init_scale``, by ``backoff_factor``.
"""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon, nd

from mxamp.trainer import LossScaler, OverflowInfo, Trainer


def scales_after(scaler, verdicts):
    """The loss scale after each of `verdicts` (True: overflow) is reported."""
    scales = []
    for overflow in verdicts:
        scaler.update(overflow)
        scales.append(scaler.loss_scale)
    return scales


def test_default_start_descends_by_16_until_the_first_applied_step():
    infos = []
    scaler = LossScaler(on_overflow=infos.append)
    assert scaler.loss_scale == 2.0 ** 16
    assert scales_after(scaler, [True, True, False, True, True, False, True]) == \
        [2.0 ** 12, 2.0 ** 8, 2.0 ** 8, 2.0 ** 7, 2.0 ** 6, 2.0 ** 6, 2.0 ** 5]
    assert scaler.skipped_steps == 5 and scaler.steps == 7
    assert infos[:3] == [OverflowInfo(1, 2.0 ** 16, 2.0 ** 12, 1),
                         OverflowInfo(2, 2.0 ** 12, 2.0 ** 8, 2),
                         OverflowInfo(4, 2.0 ** 8, 2.0 ** 7, 3)]


def test_first_descent_reaches_the_floor_in_four_skips():
    scaler = LossScaler(at_min_scale='raise')
    assert scales_after(scaler, [True] * 4) == [2.0 ** 12, 2.0 ** 8, 2.0 ** 4, 1.0]
    with pytest.raises(FloatingPointError, match='minimum loss scale 1'):
        scaler.update(True)
    assert scaler.loss_scale == 1.0 and scaler.skipped_steps == 5


def test_first_descent_keeps_a_larger_backoff():
    """A backoff_factor below 1/16 is already faster: the first descent uses it."""
    scaler = LossScaler(backoff_factor=2.0 ** -6)
    assert scales_after(scaler, [True, False, True]) == [2.0 ** 10, 2.0 ** 10, 2.0 ** 4]


@pytest.mark.parametrize('init_scale', [2.0 ** 16, 1000.0])
def test_explicit_init_scale_starts_there_and_halves(init_scale):
    scaler = LossScaler(init_scale=init_scale)
    assert scaler.loss_scale == init_scale
    assert scales_after(scaler, [True, True, False, True]) == \
        [init_scale / 2, init_scale / 4, init_scale / 4, init_scale / 8]


def test_fixed_default_scale_does_not_descend():
    scaler = LossScaler(dynamic=False)
    assert scales_after(scaler, [True, True]) == [2.0 ** 16, 2.0 ** 16]
    assert scaler.skipped_steps == 2


def test_descent_depends_only_on_the_verdicts():
    """Workers agree on the verdicts, not on their batches: the loss size must not matter."""
    verdicts = [True, True, False, True]
    with_batch, with_scalar = LossScaler(), LossScaler()
    for scaler, loss in ((with_batch, nd.ones((64,))), (with_scalar, nd.ones((1,)))):
        scaler.scale(loss)
        scaler.out_grads([loss])
    assert scales_after(with_batch, verdicts) == scales_after(with_scalar, verdicts) == \
        [2.0 ** 12, 2.0 ** 8, 2.0 ** 8, 2.0 ** 7]


def test_state_round_trip_continues_the_descent():
    scaler = LossScaler()
    scaler.update(True)
    state = scaler.state_dict()
    assert state['first_descent'] is True and state['loss_scale'] == 2.0 ** 12
    resumed = LossScaler(init_scale=4.0)        # the state decides, not the constructor
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert scales_after(resumed, [True, False, True]) == [2.0 ** 8, 2.0 ** 8, 2.0 ** 7]


def test_state_round_trip_after_the_first_applied_step_halves():
    scaler = LossScaler()
    scales_after(scaler, [True, False])
    resumed = LossScaler()
    resumed.load_state_dict(scaler.state_dict())
    assert scales_after(resumed, [True]) == [2.0 ** 11]


def test_explicit_init_scale_state_keeps_halving():
    scaler = LossScaler(init_scale=2.0 ** 10)
    assert scaler.state_dict()['first_descent'] is False
    resumed = LossScaler()
    resumed.load_state_dict(scaler.state_dict())
    assert scales_after(resumed, [True]) == [2.0 ** 9]


class Scale(gluon.HybridBlock):
    """y = x * w: elementwise, so it runs in float16 on the CPU."""

    def __init__(self, **kwargs):
        super(Scale, self).__init__(**kwargs)
        with self.name_scope():
            self.w = self.params.get('w', shape=(4,), init=mx.init.One())

    def hybrid_forward(self, F, x, w):
        return F.broadcast_mul(x, w)


def test_trainer_default_scaler_descends_fast_and_skips():
    net = Scale()
    net.initialize(ctx=mx.cpu())
    net.cast('float16')
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})   # 'auto'
    applied, scales = [], []
    for step in range(4):
        with autograd.record():
            loss = net(nd.ones((2, 4), dtype='float16')).sum(axis=1)
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        if step in (0, 1, 3):
            net.w.grad()[0] = np.inf
        applied.append(trainer.step(2))
        scales.append(trainer.loss_scale)
    assert applied == [False, False, True, False]
    assert scales == [2.0 ** 12, 2.0 ** 8, 2.0 ** 8, 2.0 ** 7]
    # Only the applied step moved w: lr 0.1 x gradient 1 (the batch-mean of 1, 1).
    assert (net.w.data().asnumpy() == np.float16(0.9)).all()
