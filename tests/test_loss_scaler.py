"""mxamp.LossScaler as torch.amp's GradScaler users call it.

``GradScaler.update(new_scale)`` takes a scale where ``LossScaler.update`` takes
the step's outcome: a number is refused, and :meth:`LossScaler.set_scale` is
the way to set one.  ``get_scale()``, ``is_enabled()`` and ``enabled=False`` (a
scaler that does nothing, and trainers that then train without loss scaling).
"""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon, nd

import mxamp
from mxamp.loss_scaler import LossScaler

_UPDATE_ERROR = r'^LossScaler\.update\(overflow\) takes whether the step overflowed \(True or False\), got '


def _untouched(scaler, scale):
    return (scaler.get_scale(), scaler.steps, scaler.skipped_steps, scaler.clean_steps) \
        == (scale, 0, 0, 0)


# ---------------------------------------------------------------------------------
# update(overflow): a bool, never a scale
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize('scale', [1024.0, np.float32(1024.0), 2 ** 10, np.int64(1024)])
def test_update_refuses_a_scale_and_names_set_scale(scale):
    scaler = LossScaler()
    with pytest.raises(TypeError, match=_UPDATE_ERROR + r"\w+ 1024(\.0)?: torch\.amp's "
                       r'GradScaler\.update\(new_scale\) takes a new scale, which mxamp sets '
                       r'with LossScaler\.set_scale\(1024(\.0)?\)$'):
        scaler.update(scale)
    assert _untouched(scaler, 2.0 ** 16)


def test_update_without_a_verdict_says_that_the_trainers_already_call_it():
    scaler = LossScaler()
    with pytest.raises(TypeError, match=_UPDATE_ERROR + r"nothing: torch\.amp's GradScaler\."
                       r'update\(\) finds that by itself; mxamp\.Trainer\.step\(\) and '
                       r'ModuleTrainer\.step\(\) already call update\(\), and '
                       r'LossScaler\.set_scale\(value\) sets a new scale$'):
        scaler.update()
    assert _untouched(scaler, 2.0 ** 16)


def test_update_refuses_an_ndarray_flag_in_one_line():
    scaler = LossScaler()
    with pytest.raises(TypeError) as error:
        scaler.update(nd.ones((1,)))
    assert str(error.value).endswith('got NDArray: LossScaler.has_overflow(grads) gives it as '
                                     'a bool')
    assert '\n' not in str(error.value) and _untouched(scaler, 2.0 ** 16)


def test_update_takes_python_and_numpy_bools():
    scaler = LossScaler(init_scale=8.0, growth_interval=1)
    scaler.update(np.bool_(False))
    scaler.update(np.float32(np.inf) != np.float32(np.inf))     # numpy's own verdict type
    scaler.update(True)
    scaler.update(np.bool_(True))
    assert scaler.get_scale() == 8.0 and scaler.steps == 4 and scaler.skipped_steps == 2


# ---------------------------------------------------------------------------------
# get_scale(), is_enabled(), set_scale()
# ---------------------------------------------------------------------------------
def test_get_scale_and_is_enabled():
    scaler = LossScaler(init_scale=256.0)
    assert scaler.get_scale() == scaler.loss_scale == 256.0
    assert isinstance(scaler.get_scale(), float) and scaler.is_enabled() is True
    scaler.update(True)
    assert scaler.get_scale() == 128.0


def test_set_scale_restarts_the_schedule_from_the_new_scale():
    scaler = LossScaler(growth_interval=2)     # the default start: a fast first descent
    scaler.update(False)
    scaler.set_scale(1024)
    assert scaler.get_scale() == 1024.0 and isinstance(scaler.get_scale(), float)
    assert scaler.clean_steps == 0 and scaler.steps == 1
    scaler.update(False)
    assert scaler.get_scale() == 1024.0        # the growth interval counts from the new scale
    scaler.update(False)
    assert scaler.get_scale() == 2048.0
    fresh = LossScaler()
    fresh.set_scale(1024.0)
    fresh.update(True)
    assert fresh.get_scale() == 512.0          # backoff_factor: no fast first descent any more
    assert fresh.state_dict()['loss_scale'] == 512.0
    assert fresh.state_dict()['first_descent'] is False


def test_set_scale_changes_a_fixed_scale():
    scaler = LossScaler(init_scale=4.0, dynamic=False)
    scaler.set_scale(2.0 ** 30)                 # a fixed scale has no bounds
    scaler.update(True)
    assert scaler.get_scale() == 2.0 ** 30


@pytest.mark.parametrize('value, message', [
    (0.0, r'set_scale\(\): the loss scale must be a positive finite number, got 0\.0$'),
    (float('nan'), 'must be a positive finite number'),
    ('big', "must be a positive finite number, got 'big'$"),
    (True, r'^set_scale\(\): the loss scale must be a positive finite number, not a bool$'),
    (2.0 ** 25, r'^set_scale\(\): the loss scale 33554432\.0 must lie within \[min_scale, '
                r'max_scale\] = \[1\.0, 16777216\.0\]$'),
])
def test_set_scale_refuses_bad_values(value, message):
    scaler = LossScaler(init_scale=64.0)
    with pytest.raises(ValueError, match=message):
        scaler.set_scale(value)
    assert scaler.get_scale() == 64.0


def test_set_scale_refuses_to_change_the_scale_of_gradients_in_flight():
    scaler = LossScaler(init_scale=64.0)
    x = nd.ones((2,))
    x.attach_grad()
    with autograd.record():
        loss = scaler.scale(nd.sum(x * x))
    loss.backward()
    with pytest.raises(RuntimeError, match=r'^set_scale\(8\.0\) between scale\(\) \(or '
                       r'out_grads\(\)\) and the step: these gradients carry the loss scale 64'):
        scaler.set_scale(8.0)
    scaler.update(False)
    scaler.set_scale(8.0)
    assert scaler.get_scale() == 8.0


# ---------------------------------------------------------------------------------
# enabled=False: GradScaler(enabled=False)
# ---------------------------------------------------------------------------------
def test_a_disabled_scaler_does_nothing_and_every_method_stays_callable():
    scaler = LossScaler(init_scale=1024.0, enabled=False)
    assert scaler.is_enabled() is False and scaler.get_scale() == scaler.loss_scale == 1.0
    assert repr(scaler) == 'LossScaler(enabled=False)'
    loss = nd.array([3.0])
    assert scaler.scale(loss) is loss
    assert scaler.scale([loss])[0] is loss
    assert scaler.out_grads([nd.zeros((2,))])[0].asnumpy().tolist() == [1.0, 1.0]
    scaler.check_scaled('step()', 'unused')                   # nothing to unscale
    assert scaler.has_overflow([nd.array([np.nan, np.inf])]) is False
    scaler.update(True)
    scaler.update(False)
    scaler.set_scale(8.0)
    assert _untouched(scaler, 1.0) and not scaler.scaled_since_update
    # Bad input is still refused.
    with pytest.raises(TypeError, match=_UPDATE_ERROR):
        scaler.update(1024.0)
    with pytest.raises(ValueError, match='positive finite number'):
        scaler.set_scale(-1.0)
    with pytest.raises(ValueError, match='backoff_factor must be < 1'):
        LossScaler(backoff_factor=2.0, enabled=False)


@pytest.mark.parametrize('enabled', ['no', 0, None])
def test_enabled_must_be_a_bool(enabled):
    with pytest.raises(TypeError, match='^LossScaler: enabled must be True or False, got '):
        LossScaler(enabled=enabled)


def test_state_dict_says_whether_the_scaler_is_enabled():
    on = LossScaler(init_scale=32.0)
    on.update(True)
    off = LossScaler(enabled=False)
    assert on.state_dict()['enabled'] is True
    assert off.state_dict()['enabled'] is False and off.state_dict()['loss_scale'] == 1.0
    # A disabled scaler ignores a checkpoint's scale, as a disabled GradScaler does ...
    off.load_state_dict(on.state_dict())
    assert off.get_scale() == 1.0 and off.skipped_steps == 0
    # ... and an enabled one refuses a disabled one's state, which has no scale.
    resumed = LossScaler()
    with pytest.raises(ValueError, match=r'the state is from a disabled scaler \(enabled=False\)'):
        resumed.load_state_dict(off.state_dict())
    assert resumed.get_scale() == 2.0 ** 16
    # Every key is required, 'enabled' and 'first_descent' too.
    partial = {k: v for k, v in on.state_dict().items() if k not in ('enabled', 'first_descent')}
    with pytest.raises(KeyError, match='missing keys enabled, first_descent'):
        resumed.load_state_dict(partial)
    assert resumed.get_scale() == 2.0 ** 16
    resumed.load_state_dict(on.state_dict())
    assert resumed.get_scale() == 16.0 and resumed.skipped_steps == 1


def _linear_net(seed=0):
    mx.random.seed(seed)
    net = gluon.nn.Dense(1, in_units=4)
    net.initialize(mx.init.Uniform(0.5))
    return net


def _train(loss_scale, poison_step=None):
    """Three SGD steps of a Dense layer; `poison_step` puts an inf into the gradient."""
    net = _linear_net()
    trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                            loss_scale=loss_scale)
    rng = np.random.RandomState(0)
    applied = []
    for step in range(3):
        x = nd.array(rng.uniform(-1, 1, (4, 4)))
        with autograd.record():
            loss = nd.sum(nd.square(net(x)))
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        if step == poison_step:
            net.weight.grad()[0, 0] = np.inf
        applied.append(trainer.step(4))
    return trainer, net.weight.data().asnumpy(), applied


def test_trainer_given_a_disabled_scaler_trains_without_loss_scaling():
    scaler = LossScaler(enabled=False)
    trainer, weights, applied = _train(scaler)
    plain_trainer, plain_weights, plain_applied = _train(None)
    assert trainer.loss_scaler is None and trainer.loss_scale == 1.0
    assert trainer.state_dict() == plain_trainer.state_dict() == {'loss_scaler': None}
    assert applied == plain_applied == [True, True, True]
    np.testing.assert_array_equal(weights, plain_weights)
    # No overflow check, as with loss_scale=None: an inf gradient is applied.
    _, weights, applied = _train(LossScaler(enabled=False), poison_step=1)
    assert applied == [True, True, True] and not np.isfinite(weights).all()
    assert _untouched(scaler, 1.0)


def test_module_trainer_given_a_disabled_scaler_trains_without_loss_scaling():
    fc = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=1, name='fc')
    loss = mx.sym.square(mx.sym.reshape(fc, (-1,)) - mx.sym.var('label'), name='loss')
    batch = mx.io.DataBatch([nd.full((8, 4), 0.5)], [nd.full((8,), 2.0)])

    def run(loss_scale):
        mod = mx.mod.Module(loss, data_names=['data'], label_names=['label'])
        mod.bind(data_shapes=[('data', (8, 4))], label_shapes=[('label', (8,))])
        mod.init_params(mx.init.Constant(0.1))
        trainer = mxamp.ModuleTrainer(mod, 'sgd', {'learning_rate': 0.1}, loss_scale=loss_scale)
        mod.forward(batch, is_train=True)
        trainer.backward()
        assert trainer.step() is True
        return trainer, mod.get_params()[0]['fc_weight'].asnumpy()

    trainer, weights = run(LossScaler(enabled=False))
    assert trainer.loss_scaler is None and trainer.loss_scale == 1.0
    np.testing.assert_array_equal(weights, run(None)[1])


def test_update_module_with_a_disabled_scaler_always_updates():
    fc = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=1, name='fc')
    loss = mx.sym.square(mx.sym.reshape(fc, (-1,)) - mx.sym.var('label'))
    mod = mx.mod.Module(loss, data_names=['data'], label_names=['label'])
    mod.bind(data_shapes=[('data', (8, 4))], label_shapes=[('label', (8,))])
    mod.init_params(mx.init.Constant(0.1))
    mod.init_optimizer(optimizer=mxamp.optimizer.create('sgd', learning_rate=0.1,
                                                        rescale_grad=1.0 / 8))
    scaler = LossScaler(enabled=False)
    mod.forward(mx.io.DataBatch([nd.ones((8, 4))], [nd.ones((8,))]), is_train=True)
    mod.backward(scaler.out_grads(mod.get_outputs()))     # head gradients of 1
    before = mod.get_params()[0]['fc_weight'].asnumpy()
    assert scaler.update_module(mod) is True
    assert not np.array_equal(mod.get_params()[0]['fc_weight'].asnumpy(), before)
    assert mod._optimizer.rescale_grad == 1.0 / 8 and _untouched(scaler, 1.0)


def test_set_scale_reaches_the_trainer_from_its_next_step():
    scaler = LossScaler(init_scale=2.0 ** 10)
    trainer, _, _ = _train(scaler)
    scaler.set_scale(4.0)
    assert trainer.loss_scale == 4.0 and trainer.state_dict()['loss_scaler']['loss_scale'] == 4.0
    net = _linear_net()
    trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, loss_scale=scaler)
    with autograd.record():
        loss = nd.sum(nd.square(net(nd.ones((4, 4)))))
        with trainer.scale_loss(loss) as scaled:
            assert scaled.asscalar() == 4.0 * loss.asscalar()
