"""Faults of mixed-precision training that only real networks show.

* oneDNN blocked layouts: depthwise/grouped convolution weights (after an
  inference pass) and their gradients (right after backward) hold a 5-D blocked
  oneDNN layout that MXNet 1.9.1's ``amp_cast`` cannot read;
* the loss scale at its floor: the error names what overflowed, with ``Trainer``
  and with ``LossScaler.update_module`` (``mx.mod.Module``);
* a forward pass that overflows: the loss is not finite, which the error says.
"""
import warnings

import ml_dtypes
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon, nd

import mxamp
from mxamp.dtypes import BFLOAT16, cast, to_float32_numpy
from mxamp.loss_scaler import LossScaler
from mxamp.trainer import Trainer


def _bf16_round(values):
    """float32 -> bfloat16 -> float32, round to nearest even, by ml-dtypes."""
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def depthwise_net(dtype='bfloat16', seed=0):
    """A MobileNet block: 32 channels, so that oneDNN picks blocked layouts (16 lanes)."""
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(32, 3, padding=1, in_channels=3, use_bias=False),
            gluon.nn.BatchNorm(in_channels=32), gluon.nn.Activation('relu'),
            gluon.nn.Conv2D(32, 3, padding=1, groups=32, in_channels=32, use_bias=False),
            gluon.nn.BatchNorm(in_channels=32), gluon.nn.Activation('relu'),
            gluon.nn.Conv2D(32, 1, in_channels=32),
            gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(4, in_units=32))
    net.initialize(mx.init.Xavier())
    if dtype != 'float32':
        mxamp.convert(net, dtype)
    net.hybridize()
    return net


def _data(seed=0, batch=4):
    rng = np.random.RandomState(seed)
    return (nd.array(rng.uniform(-1, 1, (batch, 3, 16, 16))),
            nd.array(rng.randint(0, 4, batch)))


def test_casts_of_blocked_depthwise_weights_in_both_directions():
    # FP32 net: after inference the depthwise weight is blocked; cast it to bfloat16.
    net = depthwise_net('float32')
    weight = net[3].weight.data()
    expected = _bf16_round(weight.asnumpy())
    net(_data()[0]).wait_to_read()
    assert np.array_equal(to_float32_numpy(cast(weight, 'bfloat16')), expected)
    # bfloat16 net: after inference, read its blocked bfloat16 weight back.
    net = depthwise_net('bfloat16')
    weight = net[3].weight.data()
    assert weight.dtype == BFLOAT16
    before = to_float32_numpy(weight)
    net(_data()[0]).wait_to_read()
    assert np.array_equal(cast(weight, 'float32').asnumpy(), before)
    assert np.array_equal(to_float32_numpy(weight), before)


def test_depthwise_network_trains_after_inference_without_waitall():
    """Inference leaves the depthwise weight blocked; the first training forward
    queues its reorder back to the default layout only when it runs, after the
    optimizer's first cast of the weight (its master copy) was queued.  No
    ``mx.nd.waitall()`` between backward and step."""
    net = depthwise_net('bfloat16')
    x, y = _data()
    net(x).wait_to_read()                   # e.g. a validation pass before training
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.05, 'momentum': 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    start = to_float32_numpy(net[3].weight.data())
    losses = []
    for _ in range(4):
        with autograd.record():
            loss = loss_fn(net(x), y).mean()
        loss.backward()
        assert trainer.step(1) is True
        losses.append(loss)
    values = [float(l.asscalar()) for l in losses]     # the first sync since the start
    assert np.all(np.isfinite(values)) and values[-1] < values[0], values
    moved = to_float32_numpy(net[3].weight.data())
    assert np.isfinite(moved).all() and not np.array_equal(moved, start)
    # The weight is its FP32 master copy, rounded.
    master = trainer._updaters[0].states[trainer._param2idx[net[3].weight.name]][0]
    assert np.array_equal(moved, _bf16_round(master.asnumpy()))


def test_gluoncv_mobilenet_v3_trains_without_waitall():
    """The reported case: gluoncv's MobileNet v3 small, converted to bfloat16, one
    inference pass, then trained with no ``mx.nd.waitall()``."""
    model_zoo = pytest.importorskip('gluoncv.model_zoo')
    mx.random.seed(0)
    net = model_zoo.get_model('mobilenetv3_small', pretrained=False, classes=10)
    net.initialize(mx.init.Xavier())
    net(nd.ones((1, 3, 64, 64)))
    mxamp.convert(net, 'bfloat16')
    net.hybridize()
    x, y = nd.random.uniform(shape=(2, 3, 64, 64)), nd.array([1, 2])
    net(x).wait_to_read()
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01, 'momentum': 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(3):
        with autograd.record():
            loss = loss_fn(net(x), y).mean()
        loss.backward()
        assert trainer.step(2) is True
        losses.append(float(loss.asscalar()))        # a training loop's logging
    mx.nd.waitall()
    assert np.all(np.isfinite(losses)), losses


# ---------------------------------------------------------------------------------
# Loss scale at its floor
# ---------------------------------------------------------------------------------
def overflowing_float16_net():
    """Dense layers in float16; the middle one's output (8 * 1e4 * 8 = 6.4e5) is
    finite in FP32 but not in float16 (max 65504).  Through the clip in
    `_overflowing_step` the loss stays finite, but the gradient of net_out's
    weight is 0 * inf = NaN: an overflow at the floor, not a loss that is not finite."""
    net = gluon.nn.HybridSequential(prefix='net_')
    with net.name_scope():
        net.add(gluon.nn.Dense(8, in_units=4, prefix='small_'), gluon.nn.Activation('relu'),
                gluon.nn.Dense(8, in_units=8, prefix='big_'), gluon.nn.Activation('relu'),
                gluon.nn.Dense(2, in_units=8, prefix='out_'))
    net.initialize(mx.init.One())
    net[2].weight.set_data(nd.ones((8, 8)) * 1e4)
    return mxamp.convert(net, 'float16')


def _overflowing_step(net, trainer, clip=True):
    with autograd.record():
        out = net(nd.ones((2, 4)))
        loss = (nd.clip(out, -1, 1) if clip else out).sum()
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    return trainer.step(2)


def test_error_at_the_floor_names_gradients_and_first_overflowing_layer():
    net = overflowing_float16_net()
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale=LossScaler(init_scale=2.0, at_min_scale='raise'),
                      diagnose_net=net)
    assert _overflowing_step(net, trainer) is False                # 2 -> 1, no error yet
    with pytest.raises(FloatingPointError) as info:
        _overflowing_step(net, trainer)
    message = str(info.value)
    assert 'minimum loss scale 1' in message
    # The clip stops the inf output of net_big; its consumer's weight gradient is NaN.
    assert 'Parameters with inf/NaN gradients (1 of 6): net_out_weight.' in message
    assert ('First layer whose output is not finite (last batch, inference mode): '
            'net_big_fwd (FullyConnected), finite in FP32 but not once stored in float16'
            in message)
    assert trainer.skipped_steps == 2


def test_forward_overflow_is_a_loss_that_is_not_finite_and_the_error_names_the_layer():
    net = overflowing_float16_net()
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale=LossScaler(init_scale=2.0, at_min_scale='raise'),
                      diagnose_net=net)
    with pytest.raises(FloatingPointError) as info:
        _overflowing_step(net, trainer, clip=False)                  # the loss is inf
    message = str(info.value)
    assert 'the loss is not finite' in message and 'not a gradient overflow' in message
    assert ('First layer whose output is not finite (last batch, inference mode): '
            'net_big_fwd (FullyConnected), finite in FP32 but not once stored in float16'
            in message)
    assert trainer.skipped_steps == 1 and trainer.loss_scale == 2.0   # kept


def test_warning_at_the_floor_without_debug_mode_says_how_to_find_the_layer():
    net = overflowing_float16_net()
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale=LossScaler(init_scale=1.0))          # at_min_scale='warn'
    with pytest.warns(RuntimeWarning) as record:
        assert _overflowing_step(net, trainer) is False
    message = ' '.join(str(w.message) for w in record if 'minimum loss scale' in str(w.message))
    assert 'Parameters with inf/NaN gradients (1 of 6): net_out_weight.' in message
    assert 'mxamp.diagnose.first_nonfinite_output(net, x)' in message
    assert 'diagnose_net=net' in message
    # Without overflow at the floor, no diagnosis (and no extra sync) happens.
    net[2].weight.set_data(nd.ones((8, 8)))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert _overflowing_step(net, trainer) is True


def overflowing_module(contexts):
    """The same three dense layers as a Module, in FP32 so that no conversion is needed:
    the middle layer's output (8 * 5 * 1e38) overflows FP32 itself.  net_big's bias is
    fixed (Module allocates no gradient for it).  The output, clipped as in
    `_overflowing_step`, is the loss (finite): its head gradients carry the loss scale."""
    data = mx.sym.var('data')
    hidden = mx.sym.relu(mx.sym.FullyConnected(data, num_hidden=8, name='net_small'))
    hidden = mx.sym.relu(mx.sym.FullyConnected(hidden, num_hidden=8, name='net_big'))
    out = mx.sym.clip(mx.sym.FullyConnected(hidden, num_hidden=2, name='net_out'), -1, 1)
    mod = mx.mod.Module(out, data_names=['data'], label_names=None, context=contexts,
                        fixed_param_names=['net_big_bias'])
    mod.bind(data_shapes=[('data', (4, 4))])
    mod.init_params(mx.init.One())
    arg_params, aux_params = mod.get_params()
    arg_params['net_big_weight'] = nd.ones((8, 8)) * 1e38
    mod.set_params(arg_params, aux_params)
    mod.init_optimizer(optimizer=mxamp.optimizer.create('sgd', learning_rate=0.1,
                                                        rescale_grad=1.0 / 4))
    return mod


def _overflowing_module_step(mod, scaler, batch):
    mod.forward(batch, is_train=True)
    mod.backward(scaler.out_grads(mod.get_outputs()))
    return scaler.update_module(mod)


def test_module_error_at_the_floor_names_gradients_as_the_trainer_does():
    mod = overflowing_module([mx.cpu(0), mx.cpu(1)])
    scaler = LossScaler(init_scale=2.0, at_min_scale='raise')
    batch = mx.io.DataBatch([nd.ones((4, 4))])
    assert _overflowing_module_step(mod, scaler, batch) is False      # 2 -> 1, no error yet
    with pytest.raises(FloatingPointError) as info:
        _overflowing_module_step(mod, scaler, batch)
    message = str(info.value)
    assert 'minimum loss scale 1' in message
    # As in the Gluon case: the consumer of the inf output, behind the clip.
    assert 'Parameters with inf/NaN gradients (1 of 6): net_out_weight.' in message
    assert scaler.skipped_steps == 2
    # The message's advice finds the layer.
    assert ('mxamp.diagnose.first_nonfinite_output(module.symbol, *inputs, arg_params=arg, '
            'aux_params=aux)' in message)
    arg_params, aux_params = mod.get_params()
    found = mxamp.diagnose.first_nonfinite_output(mod.symbol, *batch.data,
                                                  arg_params=arg_params, aux_params=aux_params)
    assert (found['node'], found['op'], found['cast_to']) == \
        ('net_big', 'FullyConnected', None)


def test_module_warning_at_the_floor_names_gradients():
    mod = overflowing_module([mx.cpu()])
    scaler = LossScaler(init_scale=1.0)                                # at_min_scale='warn'
    with pytest.warns(RuntimeWarning) as record:
        assert _overflowing_module_step(mod, scaler, mx.io.DataBatch([nd.ones((4, 4))])) \
            is False
    message = ' '.join(str(w.message) for w in record if 'minimum loss scale' in str(w.message))
    assert 'Parameters with inf/NaN gradients (1 of 6): net_out_weight.' in message
