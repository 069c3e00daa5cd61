"""Tests of the loss-scaled, master-weight Trainer and its parts: mxamp.loss_scaler
(LossScaler), mxamp.kvstore_transport (bfloat16 over kvstores) and mxamp.trainer."""
import json
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon, nd

from mxamp import optimizer as mo
from mxamp.dtypes import BFLOAT16, cast, dtype_name, numpy_dtype, to_float32_numpy
from mxamp.loss_scaler import LossScaler, OverflowInfo
from mxamp.trainer import Trainer

from conftest import convert_quietly

CTXS = [mx.cpu(0), mx.cpu(1)]


class Linear(gluon.HybridBlock):
    """y = sum(x * w, axis=1) + b: elementwise only, so it runs in float16 on CPU."""

    def __init__(self, width=8, **kwargs):
        super(Linear, self).__init__(**kwargs)
        with self.name_scope():
            self.w = self.params.get('w', shape=(width,), init=mx.init.Uniform(0.5))
            self.b = self.params.get('b', shape=(1,), init=mx.init.Zero())

    def hybrid_forward(self, F, x, w, b):
        return F.broadcast_add(F.sum(F.broadcast_mul(x, w), axis=1), b)


def make_net(dtype='float16', ctx=None, seed=0, grad_req='write'):
    mx.random.seed(seed)
    net = Linear()
    net.initialize(ctx=ctx or [mx.cpu(0)])
    net.cast(numpy_dtype(dtype))   # Block.cast rejects the string 'bfloat16'
    if grad_req != 'write':
        net.collect_params().setattr('grad_req', grad_req)
    return net


def make_data(ctx, dtype='float16', seed=0, batch=4):
    rng = np.random.RandomState(seed)
    x = rng.uniform(-1, 1, (batch, 8)).astype(np.float32)
    y = rng.uniform(-1, 1, (batch,)).astype(np.float32)
    return cast(nd.array(x, ctx=ctx), dtype), cast(nd.array(y, ctx=ctx), dtype)


def forward_backward(net, trainer, ctxs, dtype='float16', seed=0, scale=True):
    """One forward/backward per context; the loss is a float32 sum of squares."""
    with autograd.record():
        losses = []
        for ctx in ctxs:
            x, y = make_data(ctx, dtype, seed)
            losses.append(nd.sum(nd.square(cast(net(x) - y, 'float32'))))
        if scale:
            with trainer.scale_loss(losses) as scaled:
                autograd.backward(scaled)
        else:
            autograd.backward(losses)
    return losses


def raw_bytes(arrays):
    return [a.asnumpy().tobytes() for a in arrays]


def updater_states(trainer):
    """Every NDArray of the optimizer states, wherever the updates run."""
    # MXNet internals: the local kvstore's updater, or the per-context updaters.
    if trainer._update_on_kvstore:
        updaters = [trainer._kvstore._updater]
    else:
        updaters = trainer._updaters

    def flat(state):
        if isinstance(state, nd.NDArray):
            return [state]
        if isinstance(state, (tuple, list)):
            return [a for s in state for a in flat(s)]
        return []
    # MXNet's Trainer numbers parameters by their names sorted as strings: ordered so, two
    # twin nets whose names cross a power of ten (dense9, dense10) list them differently.
    def position(key):
        return [int(part) if part.isdigit() else part
                for part in re.split(r'(\d+)', trainer._params[key].name)]
    return [a for u in updaters for key in sorted(u.states, key=position)
            for a in flat(u.states[key])]


def snapshot(net, trainer):
    weights = [d for p in net.collect_params().values() for d in p.list_data()]
    return raw_bytes(weights), raw_bytes(updater_states(trainer))


# ---------------------------------------------------------------------------------
# Overflow detection and skipping
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize('update_on_kvstore', [True, False])
def test_overflow_on_second_context_skips_step_bit_identically(update_on_kvstore):
    net = make_net('float16', CTXS)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                      update_on_kvstore=update_on_kvstore,
                      loss_scale=LossScaler(init_scale=2.0 ** 8))
    forward_backward(net, trainer, CTXS)
    assert trainer.step(8) is True                  # a real step: momentum, master weights
    assert trainer._update_on_kvstore is update_on_kvstore
    before_weights, before_states = snapshot(net, trainer)
    assert before_states, 'the optimizer states must exist after one step'
    assert any(a.dtype == np.float32 and a.shape == (8,) for a in updater_states(trainer))

    forward_backward(net, trainer, CTXS, seed=1)
    net.w.list_grad()[1][3] = np.inf                # only on the second context
    assert trainer.step(8) is False
    after_weights, after_states = snapshot(net, trainer)
    assert after_weights == before_weights
    assert after_states == before_states
    assert trainer.loss_scale == 2.0 ** 7           # halved on the same step
    assert trainer.skipped_steps == 1

    forward_backward(net, trainer, CTXS, seed=1)
    assert trainer.step(8) is True
    assert snapshot(net, trainer)[0] != before_weights
    assert np.all(np.isfinite(to_float32_numpy(net.w.data(CTXS[0]))))


def test_nan_on_one_context_and_default_update_on_kvstore():
    net = make_net('float16', CTXS)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    forward_backward(net, trainer, CTXS)
    net.b.list_grad()[1][:] = np.nan
    assert trainer.step(8) is False
    # Default with loss scaling and several contexts: updates after the reduction.
    assert trainer._update_on_kvstore is False


def test_overflow_of_the_reduced_gradient_is_caught():
    """Two finite float16 gradients whose sum overflows (the kvstore sums in float16)."""
    net = make_net('float16', CTXS)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale=LossScaler(init_scale=4.0))
    forward_backward(net, trainer, CTXS)
    weights = snapshot(net, trainer)[0]
    for grad in net.w.list_grad():
        grad[:] = 40000.0                                   # finite in float16 (max 65504)
    assert trainer.step(8) is False
    assert snapshot(net, trainer)[0] == weights


def test_loss_scale_folded_into_rescale_grad_is_exact():
    """A power-of-two scale, undone in rescale_grad, gives gluon.Trainer's result bit for bit."""
    net_a, net_b = make_net('float32'), make_net('float32')
    plain = gluon.Trainer(net_a.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
    amp = Trainer(net_b.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                  loss_scale=1024.0)
    assert amp.loss_scale == 1024.0
    for seed in range(3):
        forward_backward(net_a, None, [mx.cpu(0)], 'float32', seed, scale=False)
        plain.step(4)
        forward_backward(net_b, amp, [mx.cpu(0)], 'float32', seed)
        assert np.array_equal(net_b.w.grad().asnumpy(), 1024 * net_a.w.grad().asnumpy())
        assert amp.step(4) is True
        assert amp.optimizer.rescale_grad == 1.0 / (4 * 1024)
        assert net_a.w.data().asnumpy().tobytes() == net_b.w.data().asnumpy().tobytes()


def test_dynamic_scale_halves_and_doubles():
    net = make_net('float16')
    infos = []
    scaler = LossScaler(init_scale=2.0 ** 10, growth_interval=3, on_overflow=infos.append)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01}, loss_scale=scaler)
    assert trainer.loss_scaler is scaler
    scales = []
    for step in range(8):
        forward_backward(net, trainer, [mx.cpu(0)])
        if step == 4:
            net.w.grad()[0] = np.inf
        trainer.step(4)
        scales.append(trainer.loss_scale)
    assert scales == [2 ** 10, 2 ** 10, 2 ** 11, 2 ** 11, 2 ** 10, 2 ** 10, 2 ** 10, 2 ** 11]
    assert trainer.skipped_steps == 1 and scaler.steps == 8 and scaler.clean_steps == 0
    assert infos == [OverflowInfo(step=5, loss_scale=2 ** 11, next_loss_scale=2 ** 10,
                                  skipped_steps=1)]
    # The new scale applies at once: the next scaled loss uses it.
    with autograd.record():
        loss = nd.sum(net(make_data(mx.cpu(0))[0]).astype('float32'))
        with trainer.scale_loss(loss) as scaled:
            assert np.allclose(scaled.asnumpy(), loss.asnumpy() * 2 ** 11)


def test_scale_bounds_and_floor_policy(caplog):
    scaler = LossScaler(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=8.0)
    scaler.update(False)
    scaler.update(False)
    assert scaler.loss_scale == 8.0                       # capped at max_scale
    with caplog.at_level(logging.INFO, logger='mxamp.trainer'):
        scaler.update(True)
    assert 'update skipped' in caplog.text
    scaler.update(True)
    assert scaler.loss_scale == 2.0                       # floored at min_scale
    with pytest.warns(RuntimeWarning, match='minimum loss scale 2'):
        scaler.update(True)
    strict = LossScaler(init_scale=1.0, at_min_scale='raise')
    with pytest.raises(FloatingPointError, match='minimum loss scale 1'):
        strict.update(True)
    assert strict.skipped_steps == 1
    fixed = LossScaler(init_scale=3.0, dynamic=False)
    fixed.update(True)
    fixed.update(False)
    assert fixed.loss_scale == 3.0 and fixed.skipped_steps == 1


@pytest.mark.parametrize('kwargs, message', [
    (dict(init_scale=-1.0), 'loss_scale must be a positive finite number'),
    (dict(init_scale=float('inf')), 'loss_scale must be a positive finite number'),
    (dict(growth_factor=1.0), 'growth_factor must be > 1'),
    (dict(backoff_factor=1.5), 'backoff_factor must be < 1'),
    (dict(growth_interval=0), 'growth_interval must be an integer >= 1'),
    (dict(min_scale=4.0, max_scale=2.0), 'must not exceed max_scale'),
    (dict(init_scale=2.0 ** 30), r'within \[min_scale, max_scale\]'),
    (dict(at_min_scale='stop'), "at_min_scale must be 'warn', 'raise' or 'ignore'"),
])
def test_scaler_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScaler(**kwargs)


@pytest.mark.parametrize('loss_scale, message', [
    (-2.0, 'loss_scale must be a positive finite number'),
    (0, 'loss_scale must be a positive finite number'),
    ('huge', "loss_scale must be 'auto', 'dynamic'"),
    (True, 'not a bool'),
])
def test_trainer_loss_scale_errors(loss_scale, message):
    net = make_net('float16')
    with pytest.raises(ValueError, match=message):
        Trainer(net.collect_params(), 'sgd', loss_scale=loss_scale)


# ---------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------
def test_public_names_and_the_old_import_path():
    import mxamp.kvstore_transport
    import mxamp.trainer
    assert mxamp.Trainer is Trainer and mxamp.LossScaler is LossScaler
    assert mxamp.trainer.LossScaler is LossScaler and mxamp.trainer.OverflowInfo is OverflowInfo
    assert issubclass(Trainer, mxamp.kvstore_transport.Bfloat16KVStoreTrainer)


def test_defaults_by_parameter_dtype():
    fp16 = Trainer(make_net('float16').collect_params(), 'sgd')
    assert fp16.loss_scaler is not None and fp16.loss_scale == 2.0 ** 16
    assert fp16.loss_scaler.growth_interval == 2000 and fp16.loss_scaler.max_scale == 2 ** 24
    assert isinstance(fp16.optimizer, mo.MultiPrecision) and fp16.optimizer.multi_precision
    bf16 = Trainer(make_net('bfloat16').collect_params(), 'adam')
    assert bf16.loss_scaler is None and bf16.loss_scale == 1.0
    assert bf16.optimizer.multi_precision
    fp32 = Trainer(make_net('float32').collect_params(), 'sgd')
    assert fp32.loss_scaler is None and not fp32.optimizer.multi_precision
    forced = Trainer(make_net('float32').collect_params(), 'sgd', loss_scale='dynamic',
                     master_weights=True)
    assert forced.loss_scale == 2.0 ** 16 and forced.optimizer.multi_precision
    opt = mx.optimizer.SGD(learning_rate=0.3)
    wrapped = Trainer(make_net('float16').collect_params(), opt)
    assert wrapped.optimizer is opt and isinstance(opt, mo.MultiPrecision)


def test_bfloat16_dense_network_trains_with_master_weights():
    mx.random.seed(0)
    net = gluon.nn.Dense(1, in_units=8)
    net.initialize()
    # bfloat16 weights on every CPU (computing in bfloat16 where the CPU can).
    convert_quietly(net)
    assert net.weight.dtype == BFLOAT16
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 1e-4})
    x = nd.ones((4, 8))
    start = to_float32_numpy(net.weight.data())
    for _ in range(60):
        with autograd.record():
            loss = net(x)                                   # d loss / d w = 1 per sample
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        assert trainer.step(4) is True                      # no scaling, no skipping
    moved = start - to_float32_numpy(net.weight.data())
    # 60 updates of 1e-4 are 6e-3; each alone is below bfloat16's resolution.
    assert np.allclose(moved, 6e-3, atol=2e-3), moved


# ---------------------------------------------------------------------------------
# unscale, accumulation, several losses, misuse
# ---------------------------------------------------------------------------------
def test_unscale_for_gradient_clipping():
    net_a, net_b = make_net('float32'), make_net('float32')
    plain = gluon.Trainer(net_a.collect_params(), 'sgd', {'learning_rate': 0.1})
    amp = Trainer(net_b.collect_params(), 'sgd', {'learning_rate': 0.1}, loss_scale=256.0)
    forward_backward(net_a, None, [mx.cpu(0)], 'float32', scale=False)
    forward_backward(net_b, amp, [mx.cpu(0)], 'float32')
    amp.unscale()
    assert np.array_equal(net_b.w.grad().asnumpy(), net_a.w.grad().asnumpy())
    for net in (net_a, net_b):
        gluon.utils.clip_global_norm([p.grad() for p in net.collect_params().values()], 0.1)
    with pytest.raises(RuntimeError, match='unscale\\(\\) was already called'):
        amp.unscale()
    with pytest.raises(RuntimeError, match='scale_loss\\(\\) after unscale\\(\\)'):
        with amp.scale_loss(nd.ones((1,))):
            pass
    plain.step(4)
    assert amp.step(4) is True
    assert amp.optimizer.rescale_grad == 0.25               # no second unscaling
    assert net_a.w.data().asnumpy().tobytes() == net_b.w.data().asnumpy().tobytes()
    amp.unscale()                                           # allowed again after a step


def test_misuse_inside_scale_loss_block():
    net = make_net('float16')
    trainer = Trainer(net.collect_params(), 'sgd')
    with autograd.record():
        loss = nd.sum(net(make_data(mx.cpu(0))[0]).astype('float32'))
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
            with pytest.raises(RuntimeError, match=r'step\(\) called inside a trainer.scale_loss'):
                trainer.step(4)
            with pytest.raises(RuntimeError, match=r'unscale\(\) called inside'):
                trainer.unscale()
    assert trainer._scale_loss_open == 0


def test_gradient_accumulation_and_several_losses():
    net_a, net_b = make_net('float32', grad_req='add'), make_net('float32', grad_req='add')
    plain = gluon.Trainer(net_a.collect_params(), 'adam', {'learning_rate': 0.01})
    amp = Trainer(net_b.collect_params(), 'adam', {'learning_rate': 0.01}, loss_scale=512.0)
    for seed in (0, 1):                                     # two backward passes, one step
        forward_backward(net_a, None, [mx.cpu(0)], 'float32', seed, scale=False)
        forward_backward(net_b, amp, [mx.cpu(0)], 'float32', seed)
    with autograd.record():                                 # and two losses at once
        x, y = make_data(mx.cpu(0), 'float32', 2)
        l1, l2 = nd.sum(net_a(x)), nd.sum(nd.square(net_a(x) - y))
    autograd.backward([l1, l2])
    with autograd.record():
        l1, l2 = nd.sum(net_b(x)), nd.sum(nd.square(net_b(x) - y))
        with amp.scale_loss([l1, l2]) as scaled:
            assert isinstance(scaled, list) and len(scaled) == 2
            autograd.backward(scaled)
    assert np.array_equal(net_b.w.grad().asnumpy(), 512 * net_a.w.grad().asnumpy())
    plain.step(8)
    assert amp.step(8) is True
    assert net_a.w.data().asnumpy().tobytes() == net_b.w.data().asnumpy().tobytes()


def test_allreduce_grads_and_update_split():
    net = make_net('float16', CTXS)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale=LossScaler(init_scale=64.0))
    forward_backward(net, trainer, CTXS)
    trainer.allreduce_grads()
    net.w.list_grad()[0][0] = np.inf
    weights = snapshot(net, trainer)[0]
    assert trainer.update(8) is False
    assert snapshot(net, trainer)[0] == weights and trainer.loss_scale == 32.0
    forward_backward(net, trainer, CTXS)
    trainer.allreduce_grads()
    assert trainer.update(8) is True


# ---------------------------------------------------------------------------------
# A forgotten scale_loss
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize('call', ['step', 'update', 'unscale', 'clip_global_norm'])
def test_forgotten_scale_loss_raises_before_anything_changes(call):
    net = make_net('float16')
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                      loss_scale=LossScaler(init_scale=2.0 ** 8))
    forward_backward(net, trainer, [mx.cpu(0)])
    assert trainer.step(4) is True
    before = snapshot(net, trainer)
    forward_backward(net, trainer, [mx.cpu(0)], seed=1, scale=False)
    grad = net.w.grad().asnumpy().tobytes()
    run = {'step': lambda: trainer.step(4), 'update': lambda: trainer.update(4),
           'unscale': trainer.unscale, 'clip_global_norm': lambda: trainer.clip_global_norm(1.0)}
    with pytest.raises(RuntimeError, match=r'%s\(\): the gradients were not computed from a '
                       r'scaled loss .* loss scale 256 .*trainer.scale_loss' % call):
        run[call]()
    assert snapshot(net, trainer) == before and net.w.grad().asnumpy().tobytes() == grad
    assert trainer.loss_scaler.steps == 1
    forward_backward(net, trainer, [mx.cpu(0)], seed=1)        # done right, it steps
    assert trainer.step(4) is True


def test_scaling_by_the_scaler_itself_and_accumulation_pass_the_check():
    net = make_net('float16', grad_req='add')
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale=LossScaler(init_scale=2.0 ** 8))
    for step in range(2):
        for seed in (0, 1):                                 # one scale_loss per micro-batch
            forward_backward(net, trainer, [mx.cpu(0)], seed=seed)
        assert trainer.step(8) is True
        for param in net.collect_params().values():
            param.zero_grad()
    with autograd.record():
        loss = nd.sum(net(make_data(mx.cpu(0))[0]).astype('float32'))
    trainer.loss_scaler.scale(loss).backward()
    assert trainer.step(4) is True
    # No backward since: no new gradients, nothing to check (gluon's stale-gradient rules).
    assert trainer.step(4, ignore_stale_grad=True) is True


@pytest.mark.parametrize('dtype, loss_scale', [
    ('float32', 'auto'), ('bfloat16', 'auto'), ('float16', None), ('float16', 1.0)])
def test_no_scale_loss_needed_without_a_scale(dtype, loss_scale):
    net = make_net(dtype)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale=loss_scale)
    before = snapshot(net, trainer)[0]
    forward_backward(net, trainer, [mx.cpu(0)], dtype, scale=False)
    assert trainer.step(4) is True
    assert snapshot(net, trainer)[0] != before


def test_module_update_without_out_grads_raises():
    rng = np.random.RandomState(0)
    batch = mx.io.DataBatch([nd.array(rng.randn(8, 4))], [nd.array(rng.randn(8))])
    mod = _module(mo.create('sgd', learning_rate=0.1, rescale_grad=1.0 / 8), [mx.cpu(0)])
    scaler = LossScaler(init_scale=2.0 ** 8)
    mod.forward(batch, is_train=True)
    mod.backward([nd.ones((8,))])
    weights = [a.asnumpy().tobytes() for a in mod.get_params()[0].values()]
    with pytest.raises(RuntimeError, match=r'update_module\(\): the gradients were not '
                       r'computed from a scaled loss .*scaler.out_grads'):
        scaler.update_module(mod)
    assert weights == [a.asnumpy().tobytes() for a in mod.get_params()[0].values()]
    mod.backward(scaler.out_grads(mod.get_outputs()))
    assert scaler.update_module(mod) is True
    assert not scaler.scaled_since_update
    fixed = LossScaler(init_scale=1.0, dynamic=False)     # nothing to forget
    mod.forward(batch, is_train=True)
    mod.backward([nd.ones((8,))])
    assert fixed.update_module(mod) is True


# ---------------------------------------------------------------------------------
# Gradient clipping
# ---------------------------------------------------------------------------------
def mixed_net(dtype='float16', ctx=None, seed=0):
    """Dense -> BatchNorm -> Dense, converted: dense parameters in `dtype`, BatchNorm's FP32."""
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(6, in_units=8), gluon.nn.BatchNorm(in_channels=6),
            gluon.nn.Dense(1, in_units=6))
    net.initialize(mx.init.Uniform(0.5), ctx=ctx or [mx.cpu(0)])
    return convert_quietly(net, dtype)


def trainable(net):
    return [p for p in net.collect_params().values() if p.grad_req != 'null']


def mixed_backward(net, trainer, ctxs=(mx.cpu(0),), seed=0, scale=True):
    """Backward of a float32 sum of squares, different data on each context."""
    rng = np.random.RandomState(seed)
    with autograd.record():
        losses = [nd.sum(nd.square(net(nd.array(rng.uniform(-2, 2, (4, 8)), ctx=ctx))
                                   .reshape((-1,)) - 3.0)) for ctx in ctxs]
        if scale:
            with trainer.scale_loss(losses) as scaled:
                autograd.backward(scaled)
        else:
            autograd.backward(losses)


def trained_state(net, trainer):
    """The trainable weights and the optimizer states (BatchNorm's statistics move in forward)."""
    return raw_bytes([d for p in trainable(net) for d in p.list_data()]), \
        raw_bytes(updater_states(trainer))


def float64_grads(params, divide_by=1.0):
    """Each parameter's gradient summed over its contexts, in float64."""
    return [sum(to_float32_numpy(g).astype(np.float64) for g in p.list_grad()) / divide_by
            for p in params]


def global_norm(grads):
    return float(np.sqrt(sum(np.sum(np.square(g)) for g in grads)))


def fp32_values(trainer, params):
    """What each parameter's next update starts from: its FP32 master copy when it has one."""
    # gluon.Trainer internals: the first context's updater, keyed by _param2idx.
    states = trainer._updaters[0].states
    values = []
    for param in params:
        if dtype_name(param.dtype) == 'float32':
            values.append(param.data().asnumpy().astype(np.float64))
            continue
        index = trainer._param2idx[param.name]
        if index not in states:                 # before the first update: the weight itself
            values.append(to_float32_numpy(param.data()).astype(np.float64))
            continue
        state = states[index]
        masters = [a for a in (state if isinstance(state, (tuple, list)) else [state])
                   if isinstance(a, nd.NDArray) and a.dtype == np.float32]
        assert len(masters) == 1, state         # plain SGD: the master copy is the only state
        values.append(masters[0].asnumpy().astype(np.float64))
    return values


@pytest.mark.parametrize('dtype, loss_scale', [('float16', 2.0 ** 10), ('bfloat16', 'auto')])
def test_clip_global_norm_over_mixed_dtypes_gives_the_clipped_fp32_update(dtype, loss_scale):
    net = mixed_net(dtype)
    params = trainable(net)
    assert {dtype_name(p.dtype) for p in params} == {dtype, 'float32'}
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale=LossScaler(init_scale=loss_scale)
                      if loss_scale != 'auto' else 'auto')
    for step in range(2):
        before = fp32_values(trainer, params)
        mixed_backward(net, trainer, seed=step)
        grads = float64_grads(params, trainer.loss_scale)
        expected = global_norm(grads)
        norm = trainer.clip_global_norm(expected / 4)         # clips by a factor of 4
        assert norm == pytest.approx(expected, rel=1e-6)
        assert trainer.step(4) is True
        after, start, grad = [np.concatenate([a.ravel() for a in arrays])
                              for arrays in (fp32_values(trainer, params), before, grads)]
        clipped = start - 0.1 * grad / 4 / 4
        assert np.allclose(after, clipped, rtol=1e-5, atol=1e-7), (after, clipped)
        assert not np.allclose(after, start - 0.1 * grad / 4, rtol=1e-5, atol=1e-7)


def test_clip_global_norm_below_max_norm_changes_nothing_and_replaces_the_check():
    net_a, net_b = make_net('float16'), make_net('float16')
    plain, clipped = [Trainer(n.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                              loss_scale=LossScaler(init_scale=2.0 ** 8)) for n in (net_a, net_b)]
    checks = []
    check = clipped.loss_scaler.has_overflow
    clipped.loss_scaler.has_overflow = lambda *a, **k: checks.append(1) or check(*a, **k)
    for seed in range(2):
        forward_backward(net_a, plain, [mx.cpu(0)], seed=seed)
        forward_backward(net_b, clipped, [mx.cpu(0)], seed=seed)
        assert clipped.clip_global_norm(1e6) < 1e6
        assert plain.step(4) is True and clipped.step(4) is True
        assert snapshot(net_a, plain) == snapshot(net_b, clipped)
    assert checks == []             # the norm's host sync gave the verdict: no second one


def test_clip_global_norm_matches_gluon_recipe_in_float32():
    net_a, net_b = make_net('float32'), make_net('float32')
    plain = gluon.Trainer(net_a.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
    amp = Trainer(net_b.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                  loss_scale=256.0)
    for seed in range(3):
        forward_backward(net_a, None, [mx.cpu(0)], 'float32', seed, scale=False)
        reference = gluon.utils.clip_global_norm(
            [p.grad() for p in net_a.collect_params().values()], 0.5)
        assert reference > 1.0                                # so both really clip
        forward_backward(net_b, amp, [mx.cpu(0)], 'float32', seed)
        assert amp.clip_global_norm(0.5) == pytest.approx(reference, rel=1e-6)
        plain.step(4)
        assert amp.step(4) is True
        assert np.allclose(net_b.w.data().asnumpy(), net_a.w.data().asnumpy(), rtol=1e-6)


def test_clip_global_norm_after_unscale_is_the_same_clip():
    # The same up to FP32 rounding, not bitwise: run after test_gluon.py's store_in_float32
    # tests and this file's earlier ones, the norms (FP32 sums of BLAS dots) once differed
    # in the eighth digit; which earlier state moves their last bits is not found.
    nets = [mixed_net(), mixed_net()]
    trainers = [Trainer(n.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                        loss_scale=LossScaler(init_scale=2.0 ** 8)) for n in nets]
    for seed in range(2):
        norms = []
        for index, (net, trainer) in enumerate(zip(nets, trainers)):
            mixed_backward(net, trainer, seed=seed)
            if index == 1:
                trainer.unscale()
            norms.append(trainer.clip_global_norm(2.0))
            assert trainer.step(4) is True
        assert norms[0] == pytest.approx(norms[1], rel=1e-6) and norms[0] > 2.0
        for got, want in zip(*([p.data() for p in trainable(net)] + updater_states(trainer)
                               for net, trainer in zip(nets, trainers))):
            # A float16 weight may round to the neighbouring value.
            rtol = 1e-3 if got.dtype == np.float16 else 1e-5
            np.testing.assert_allclose(to_float32_numpy(got), to_float32_numpy(want),
                                       rtol=rtol, atol=1e-7)


@pytest.mark.parametrize('bad', [np.inf, np.nan])
def test_clip_global_norm_on_overflow_skips_the_step(bad):
    net = mixed_net()
    params = trainable(net)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                      loss_scale=LossScaler(init_scale=2.0 ** 8))
    mixed_backward(net, trainer)
    trainer.clip_global_norm(1.0)
    assert trainer.step(4) is True
    before = trained_state(net, trainer)
    mixed_backward(net, trainer, seed=1)
    assert params[0].dtype == np.float16
    params[0].grad()[0, 0] = bad
    norm = trainer.clip_global_norm(1.0)
    assert not np.isfinite(norm)
    assert trainer.step(4) is False
    assert trained_state(net, trainer) == before
    assert trainer.loss_scale == 2.0 ** 7 and trainer.skipped_steps == 1
    mixed_backward(net, trainer, seed=2)                     # and training goes on
    assert np.isfinite(trainer.clip_global_norm(1.0))
    assert trainer.step(4) is True and trained_state(net, trainer) != before


def test_clip_global_norm_without_loss_scaling_skips_a_nonfinite_step():
    net = mixed_net('bfloat16')
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    assert trainer.loss_scaler is None
    mixed_backward(net, trainer)
    before = trained_state(net, trainer)
    trainable(net)[0].grad()[0, 0] = np.inf
    assert trainer.clip_global_norm(1.0) == np.inf
    with pytest.warns(RuntimeWarning, match='gradient norm is not finite'):
        assert trainer.step(4) is False
    assert trained_state(net, trainer) == before


@pytest.mark.parametrize('update_on_kvstore', [False, True])
def test_clip_global_norm_on_two_contexts_is_the_norm_of_the_sum(update_on_kvstore):
    net = mixed_net(ctx=CTXS)
    params = trainable(net)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      update_on_kvstore=update_on_kvstore,
                      loss_scale=LossScaler(init_scale=2.0 ** 8))
    before = fp32_values(trainer, params)
    mixed_backward(net, trainer, CTXS)
    grads = float64_grads(params, trainer.loss_scale)
    expected = global_norm(grads)
    # What the norm over every context's gradient (not their sum) would be.
    every_context = global_norm([to_float32_numpy(g).astype(np.float64) / trainer.loss_scale
                                 for p in params for g in p.list_grad()])
    assert abs(every_context / expected - 1) > 0.05
    # The kvstore sums float16 gradients in float16: the reduced sum is rounded.
    norm = trainer.clip_global_norm(expected / 2)
    assert norm == pytest.approx(expected, rel=1e-3)
    assert trainer.step(8) is True
    assert trainer._update_on_kvstore is update_on_kvstore
    for param in params:
        assert np.array_equal(*[to_float32_numpy(d) for d in param.list_data()])
    after, start, grad = [np.concatenate([a.ravel() for a in arrays])
                          for arrays in (fp32_values(trainer, params), before, grads)]
    update = 0.1 * grad / 8 * (expected / 2 / norm)
    assert np.allclose(after, start - update, rtol=0, atol=1e-3 * np.abs(update).max())


def test_allreduce_grads_then_clip_then_update_reduces_once():
    nets = [mixed_net(ctx=CTXS), mixed_net(ctx=CTXS)]
    trainers = [Trainer(n.collect_params(), 'sgd', {'learning_rate': 0.1},
                        loss_scale=LossScaler(init_scale=2.0 ** 8)) for n in nets]
    for net, trainer in zip(nets, trainers):
        mixed_backward(net, trainer, CTXS)
    trainers[0].allreduce_grads()
    norms = [trainers[0].clip_global_norm(1.0), trainers[1].clip_global_norm(1.0)]
    with pytest.raises(RuntimeError, match=r'allreduce_grads\(\) was already called'):
        trainers[1].allreduce_grads()
    assert norms[0] == norms[1]
    assert trainers[0].update(8) is True and trainers[1].step(8) is True
    assert snapshot(nets[0], trainers[0]) == snapshot(nets[1], trainers[1])


def test_clip_global_norm_with_a_distributed_kvstore():
    kv = _DistKVStoreWithoutBfloat16()
    net = mixed_net(ctx=CTXS)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, kvstore=kv,
                      loss_scale=LossScaler(init_scale=2.0 ** 8))
    mixed_backward(net, trainer, CTXS)
    expected = global_norm(float64_grads(trainable(net), trainer.loss_scale))
    assert trainer.clip_global_norm(1.0) == pytest.approx(expected, rel=1e-3)
    assert trainer.step(8) is True
    net = mixed_net(ctx=CTXS)
    on_servers = Trainer(net.collect_params(), 'sgd', kvstore=_DistKVStoreWithoutBfloat16(),
                         update_on_kvstore=True)
    mixed_backward(net, on_servers, CTXS)
    with pytest.raises(RuntimeError, match='update_on_kvstore=True: the servers'):
        on_servers.clip_global_norm(1.0)


def test_clip_global_norm_misuse():
    net = mixed_net()
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale=LossScaler(init_scale=2.0 ** 8))
    with pytest.raises(RuntimeError, match=r'clip_global_norm\(\) before backward'):
        trainer.clip_global_norm(1.0)
    for bad in (0, -1.0, np.inf, np.nan, 'one'):
        with pytest.raises(ValueError, match='max_norm must be a positive finite number'):
            trainer.clip_global_norm(bad)
    with autograd.record():
        loss = nd.sum(net(nd.ones((4, 8))))
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
            with pytest.raises(RuntimeError, match=r'clip_global_norm\(\) called inside'):
                trainer.clip_global_norm(1.0)
    trainer.clip_global_norm(1.0)
    with pytest.raises(RuntimeError, match=r'clip_global_norm\(\) was already called'):
        trainer.clip_global_norm(1.0)
    with pytest.raises(RuntimeError, match=r'scale_loss\(\) after clip_global_norm\(\)'):
        with trainer.scale_loss(nd.ones((1,))):
            pass
    assert trainer.step(4) is True
    with pytest.raises(RuntimeError, match=r'clip_global_norm\(\) before backward'):
        trainer.clip_global_norm(1.0)                       # the step consumed the gradients


# ---------------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize('update_on_kvstore', [False, True])
def test_save_and_load_states_resume_exactly(tmp_path, update_on_kvstore):
    ctxs = CTXS if update_on_kvstore else [mx.cpu(0)]

    def build():
        net = make_net('float16', ctxs)
        return net, Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.05, 'momentum': 0.9},
                            update_on_kvstore=update_on_kvstore if len(ctxs) > 1 else None,
                            loss_scale=LossScaler(init_scale=2.0 ** 8, growth_interval=4))
    net, trainer = build()
    for step in range(6):
        forward_backward(net, trainer, ctxs, seed=step)
        if step == 2:
            net.w.list_grad()[-1][0] = np.inf
        trainer.step(4)
    assert (trainer.loss_scale, trainer.skipped_steps) == (2.0 ** 7, 1)
    assert trainer.loss_scaler.clean_steps == 3
    path = str(tmp_path / 'trainer.states')
    trainer.save_states(path)
    net.save_parameters(str(tmp_path / 'net.params'))

    net2, trainer2 = build()
    net2.load_parameters(str(tmp_path / 'net.params'), ctx=ctxs)
    trainer2.load_states(path)
    assert trainer2.state_dict() == trainer.state_dict()
    assert isinstance(trainer2.optimizer, mo.MultiPrecision)
    assert raw_bytes(updater_states(trainer2)) == raw_bytes(updater_states(trainer))
    for n, t in ((net, trainer), (net2, trainer2)):             # the next step grows the scale
        forward_backward(n, t, ctxs, seed=9)
        assert t.step(4) is True
    assert trainer2.loss_scale == trainer.loss_scale == 2.0 ** 8
    assert snapshot(net2, trainer2) == snapshot(net, trainer)


def test_plain_gluon_states_file_is_accepted_with_a_warning(tmp_path):
    net = make_net('float16')
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    forward_backward(net, trainer, [mx.cpu(0)])
    trainer.step(4)
    path = str(tmp_path / 'plain.states')
    gluon.Trainer.save_states(trainer, path)
    with pytest.warns(UserWarning, match='plain gluon.Trainer states file'):
        trainer.load_states(path)


def test_state_dict_errors():
    trainer = Trainer(make_net('float16').collect_params(), 'sgd')
    with pytest.raises(KeyError, match="missing key 'loss_scaler'"):
        trainer.load_state_dict({})
    state = trainer.state_dict()
    del state['loss_scaler']['clean_steps'], state['loss_scaler']['steps']
    with pytest.raises(KeyError, match='missing keys clean_steps, steps'):
        trainer.load_state_dict(state)
    off = Trainer(make_net('float32').collect_params(), 'sgd')
    with pytest.raises(ValueError, match='loss scaling off'):
        off.load_state_dict(trainer.state_dict())
    state = trainer.state_dict()
    state['loss_scaler']['loss_scale'] = -4.0
    with pytest.raises(ValueError, match='positive finite'):
        trainer.load_state_dict(state)


# ---------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------
def _underflow_run(trainer_factory, steps=40):
    """A float16 linear model with a float32 loss multiplied by 1e-8: the gradient
    entering the float16 part is below float16's smallest subnormal (6e-8) unless
    the loss is scaled."""
    net = make_net('float16', seed=3)
    trainer = trainer_factory(net)
    rng = np.random.RandomState(0)
    x = rng.uniform(-1, 1, (16, 8)).astype(np.float32)
    y = x.dot(rng.uniform(-1, 1, 8)).astype(np.float32)
    x16, y32 = nd.array(x, dtype='float16'), nd.array(y)

    def loss_value():
        return float(nd.mean(nd.square(net(x16).astype('float32') - y32)).asscalar())
    first = loss_value()
    for _ in range(steps):
        with autograd.record():
            loss = nd.sum(nd.square(net(x16).astype('float32') - y32)) * 1e-8
            if isinstance(trainer, Trainer):
                with trainer.scale_loss(loss) as scaled:
                    autograd.backward(scaled)
            else:
                loss.backward()
        trainer.step(1)
    return first, loss_value(), net


def test_float16_network_with_underflowing_gradients_trains_only_with_scaling():
    first, last, net = _underflow_run(lambda n: gluon.Trainer(
        n.collect_params(), 'adam', {'learning_rate': 0.05, 'multi_precision': True}))
    assert last == first                      # every gradient was exactly zero
    assert not np.any(net.w.grad().asnumpy())
    first, last, _ = _underflow_run(lambda n: Trainer(n.collect_params(), 'adam',
                                                      {'learning_rate': 0.05}))
    assert last < 0.3 * first, (first, last)


# ---------------------------------------------------------------------------------
# Symbol API: mx.mod.Module
# ---------------------------------------------------------------------------------
def _module(optimizer, contexts):
    data, label = mx.sym.var('data'), mx.sym.var('label')
    out = mx.sym.FullyConnected(data, num_hidden=1, name='fc')
    loss = mx.sym.square(mx.sym.reshape(out, (-1,)) - label)       # per-sample loss
    mod = mx.mod.Module(loss, data_names=['data'], label_names=['label'], context=contexts)
    mod.bind(data_shapes=[('data', (8, 4))], label_shapes=[('label', (8,))])
    mx.random.seed(0)
    mod.init_params(mx.init.Uniform(0.5))
    mod.init_optimizer(kvstore='device', optimizer=optimizer)
    return mod


def test_module_update_applies_scaled_step_and_skips_overflow():
    rng = np.random.RandomState(0)
    batch = mx.io.DataBatch([nd.array(rng.randn(8, 4))], [nd.array(rng.randn(8))])
    plain = _module(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / 8), CTXS)
    amp = _module(mo.create('sgd', learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / 8), CTXS)
    scaler = LossScaler(init_scale=2.0 ** 12)
    for _ in range(2):
        plain.forward(batch, is_train=True)
        plain.backward([nd.ones((8,))])
        plain.update()
        amp.forward(batch, is_train=True)
        amp.backward(scaler.out_grads(amp.get_outputs()))
        assert scaler.update_module(amp) is True
    weights = [a.asnumpy().tobytes() for a in amp.get_params()[0].values()]
    assert weights == [a.asnumpy().tobytes() for a in plain.get_params()[0].values()]
    amp.forward(batch, is_train=True)
    amp.backward(scaler.out_grads(amp.get_outputs()))
    amp._exec_group.grad_arrays[0][1][:] = np.inf        # fc_weight grad, second device
    assert scaler.update_module(amp) is False
    assert weights == [a.asnumpy().tobytes() for a in amp.get_params()[0].values()]
    assert scaler.loss_scale == 2.0 ** 11 and scaler.skipped_steps == 1


def test_module_update_needs_a_module_bound_for_training():
    data = mx.sym.var('data')
    mod = mx.mod.Module(mx.sym.FullyConnected(data, num_hidden=1, name='fc'), data_names=['data'],
                        label_names=None, context=mx.cpu())
    scaler = LossScaler()
    with pytest.raises(RuntimeError, match='init_optimizer'):
        scaler.update_module(mod)
    mod.bind(data_shapes=[('data', (8, 4))], for_training=False)
    mod.init_params(mx.init.Uniform(0.5))
    mod.init_optimizer(optimizer=mo.create('sgd', learning_rate=0.1))
    with pytest.raises(RuntimeError, match='for_training=False'):
        scaler.update_module(mod)


# ---------------------------------------------------------------------------------
# Distributed: two workers, one server, on 127.0.0.1
# ---------------------------------------------------------------------------------
# One float16 weight of 4 ones on each of two workers, a Trainer with loss scale 4
# (format with root= and uok=, the update_on_kvstore); each test's steps follow.
DIST_WORKER_SETUP = textwrap.dedent('''
    import sys, warnings, numpy as np, mxnet as mx
    from mxnet import autograd, gluon, nd
    sys.path.insert(0, {root!r})
    from mxamp.trainer import Trainer, LossScaler
    kv = mx.kv.create('dist_sync')
    rank = kv.rank
    weight = gluon.Parameter('w', shape=(4,), init=mx.init.One())
    weight.initialize()
    weight.cast(np.float16)
    tr = Trainer([weight], 'sgd', {{'learning_rate': 0.5}}, kvstore=kv,
                 update_on_kvstore={uok}, loss_scale=LossScaler(init_scale=4.0))
    results = []
''')
_WORKER = DIST_WORKER_SETUP + textwrap.dedent('''
    for step in range(3):
        x = nd.full((2, 4), rank + 1.0, dtype='float16')
        with autograd.record():
            loss = nd.sum(nd.broadcast_mul(x, weight.data())).astype('float32')
            with tr.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        if step == 1 and rank == 1:
            weight.grad()[0] = np.inf              # only worker 1 overflows
        results.append((tr.step(4), tr.loss_scale))
    w = weight.data().astype('float32').asnumpy().ravel().tolist()
    print('RESULT', rank, results, w, flush=True)
''')


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _run_dist(tmp_path, worker_source, timeout=120):
    """Scheduler, server and two workers on 127.0.0.1: each worker's (stdout, stderr)
    and the server's stderr.  Stops early when the server dies (the workers would
    wait for it until `timeout`); every process is killed on the way out."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / 'worker.py'
    script.write_text(worker_source)
    env = dict(os.environ, DMLC_PS_ROOT_URI='127.0.0.1', DMLC_PS_ROOT_PORT=str(_free_port()),
               DMLC_NUM_SERVER='1', DMLC_NUM_WORKER='2', PYTHONPATH=root,
               OMP_NUM_THREADS='1')
    logs = {name: tmp_path / ('%s.log' % name)
            for name in ('server', 'worker0.out', 'worker0.err', 'worker1.out', 'worker1.err')}
    procs = []
    try:
        for role in ('scheduler', 'server'):
            with open(logs['server'] if role == 'server' else os.devnull, 'w') as err:
                procs.append(subprocess.Popen(
                    [sys.executable, '-c', 'import mxnet'], env=dict(env, DMLC_ROLE=role),
                    stdout=subprocess.DEVNULL, stderr=err))
        server = procs[1]
        workers = []
        for i in range(2):
            with open(logs['worker%d.out' % i], 'w') as out, \
                    open(logs['worker%d.err' % i], 'w') as err:
                workers.append(subprocess.Popen([sys.executable, str(script)],
                                                env=dict(env, DMLC_ROLE='worker'),
                                                stdout=out, stderr=err))
        procs.extend(workers)
        deadline = time.monotonic() + timeout
        while any(w.poll() is None for w in workers):
            if time.monotonic() > deadline:
                break
            if server.poll() is not None:           # died (or done): give workers 5 s
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
    outputs = [(logs['worker%d.out' % i].read_text(), logs['worker%d.err' % i].read_text())
               for i in range(2)]
    return outputs, logs['server'].read_text()


def _results(outputs, server_err=''):
    """{rank: the rest of the worker's RESULT line}."""
    results = {}
    for out, err in outputs:
        line = [l for l in out.splitlines() if l.startswith('RESULT')]
        assert line, out + err[-3000:] + '\nserver: ' + server_err[-2000:]
        _, rank, rest = line[0].split(' ', 2)
        results[int(rank)] = rest
    return results


@pytest.mark.slow
@pytest.mark.parametrize('update_on_kvstore', [False, True])
def test_dist_sync_workers_skip_the_same_steps(tmp_path, update_on_kvstore):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outputs, _ = _run_dist(tmp_path, _WORKER.format(root=root, uok=update_on_kvstore))
    results = _results(outputs)
    # Both workers: applied, skipped (worker 1's inf), applied; identical weights.
    assert results[0] == results[1]
    assert results[0].startswith('[(True, 4.0), (False, 2.0), (True, 2.0)]')
    # Two applied steps: gradient per worker = 2 * (rank + 1) * scale on each weight,
    # summed over workers = 6 * scale, rescaled by 1 / (4 * scale): 1.5 each; lr 0.5.
    weights = eval(results[0].split('] ', 1)[1])
    assert np.allclose(weights, 1.0 - 2 * 0.5 * 1.5)


_LAYOUT_WORKER = textwrap.dedent('''
    import sys, mxnet as mx
    from mxnet import autograd, gluon
    sys.path.insert(0, {root!r})
    import mxamp
    kv = mx.kv.create('dist_sync')
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(16, 3, use_bias=False), gluon.nn.BatchNorm(), gluon.nn.Dense(3))
    net.initialize(mx.init.Xavier())
    if {dtype!r} != 'float32':
        mxamp.convert(net, {dtype!r})
    with autograd.pause():      # an inference pass: oneDNN layouts left in the parameters
        net(mx.nd.zeros((32, 1, 8, 8)))
    tr = mxamp.Trainer(net.collect_params(), 'sgd', {{'learning_rate': 0.1}}, kvstore=kv,
                       update_on_kvstore={uok})
    tr.init_kvstore()
    with autograd.record():
        loss = net(mx.nd.ones((2, 1, 8, 8)) * (kv.rank + 1)).astype('float32').sum()
    loss.backward()
    tr.step(1)     # 1: with update_on_kvstore the servers keep the rescale_grad they got
    print('RESULT', kv.rank, [round(float(p.data().astype('float32').sum().asscalar()), 5)
                              for p in net.collect_params().values()
                              if p.grad_req != 'null'], flush=True)   # statistics: per worker
''')


@pytest.mark.slow
@pytest.mark.parametrize('dtype, update_on_kvstore', [('float32', False), ('float32', True),
                                                      ('bfloat16', False)])
def test_dist_training_starts_after_an_inference_pass(tmp_path, dtype, update_on_kvstore):
    """Values an inference pass left in a oneDNN layout are broadcast (gluon's own
    broadcast made MXNet 1.9.1's server abort: 'init 4 first')."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outputs, server = _run_dist(tmp_path, _LAYOUT_WORKER.format(root=root, dtype=dtype,
                                                                uok=update_on_kvstore))
    results = _results(outputs, server)
    assert results[0] == results[1]


# ---------------------------------------------------------------------------------
# bfloat16 gradients and MXNet's kvstores
# ---------------------------------------------------------------------------------
def _bf16_round(values):
    """float32 -> bfloat16 -> float32, round to nearest even, by ml-dtypes."""
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _dense_run(dtype, ctxs, kvstore, steps=3, seed=0, **trainer_kwargs):
    """A Dense(4) layer on `ctxs`, SGD with momentum, one batch per context per step.

    The FP32 run starts from the bfloat16 run's initial weights and data (rounded),
    so that both compute the same thing up to bfloat16 rounding."""
    mx.random.seed(seed)
    net = gluon.nn.Dense(4, in_units=8)
    net.initialize(mx.init.Uniform(0.5), ctx=ctxs)
    for param in net.collect_params().values():
        param.set_data(nd.array(_bf16_round(param.data(ctxs[0]).asnumpy())))
    if dtype != 'float32':
        convert_quietly(net, dtype)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9},
                      kvstore=kvstore, **trainer_kwargs)
    rng = np.random.RandomState(seed)
    for _ in range(steps):
        with autograd.record():
            losses = []
            for ctx in ctxs:
                x = nd.array(_bf16_round(rng.uniform(-1, 1, (2, 8))), ctx=ctx)
                out = net(x)
                losses.append(nd.sum(nd.square(out - 0.5)))
        autograd.backward(losses)
        trainer.step(2 * len(ctxs))
    weights = [[to_float32_numpy(d) for d in p.list_data()] for p in net.collect_params().values()]
    return weights, trainer


@pytest.mark.parametrize('kvstore, update_on_kvstore', [
    ('device', None), ('device', False), ('local', None), ('local', False)])
def test_bfloat16_on_two_contexts_matches_float32(kvstore, update_on_kvstore):
    """MXNet 1.9.1's local kvstores sum bfloat16 gradients correctly (each sum rounded
    to bfloat16): bfloat16 keeps travelling as it is there."""
    reference, _ = _dense_run('float32', CTXS, kvstore)
    weights, trainer = _dense_run('bfloat16', CTXS, kvstore, update_on_kvstore=update_on_kvstore)
    assert not getattr(trainer, '_fp32_reduce', False)          # bfloat16 travels as it is
    for per_ctx, ref in zip(weights, reference):
        assert np.array_equal(per_ctx[0], per_ctx[1])             # contexts agree bit for bit
        ref = ref[0]
        # Three steps of two computations (bfloat16 forward, backward and sums against FP32):
        # over seeds 0-9 the largest gap is 0.37 of this bound (AMD EPYC with avx512_bf16).
        assert np.allclose(per_ctx[0], ref, rtol=2 ** -6, atol=2 ** -8), (per_ctx[0], ref)


class _DistKVStoreWithoutBfloat16(mx.kvstore.KVStoreBase):
    """A one-worker 'dist_sync' kvstore in process: MXNet's local 'device' kvstore
    behind a server that, like MXNet 1.9.1's, cannot take bfloat16 arrays."""
    type = 'dist_sync'
    rank = 0
    num_workers = 1

    def __init__(self):
        self._local = mx.kv.create('device')
        self.dtypes = set()

    def _check(self, *values):
        for value in values:
            for array in value if isinstance(value, (list, tuple)) else [value]:
                name = dtype_name(array.dtype)
                self.dtypes.add(name)
                if name == 'bfloat16':
                    raise mx.base.MXNetError('Unknown type enum 12 (the dist kvstore server '
                                             'aborts on bfloat16)')

    def broadcast(self, key, value, out, priority=0):
        self._check(value, out)
        self._local.broadcast(key, value, out, priority)

    def pushpull(self, key, value, out=None, priority=0):
        self._check(value, out or [])
        self._local.pushpull(key, value, out, priority)

    def push(self, key, value, priority=0):
        self._check(value)
        self._local.push(key, value, priority)

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        self._check(out)
        self._local.pull(key, out, priority, ignore_sparse)

    def init(self, key, value):
        self._check(value)
        self._local.init(key, value)

    @staticmethod
    def is_capable(capability):
        return True

    def set_optimizer(self, optimizer):
        self._local.set_optimizer(optimizer)


def test_bfloat16_crosses_a_dist_kvstore_in_float32_and_float16_stays_float16():
    reference, _ = _dense_run('float32', CTXS, 'device')
    kv = _DistKVStoreWithoutBfloat16()
    weights, trainer = _dense_run('bfloat16', CTXS, kv)
    assert trainer._update_on_kvstore is False and trainer._fp32_reduce
    assert kv.dtypes == {'float32'}                                 # never bfloat16
    for per_ctx, ref in zip(weights, reference):
        assert np.array_equal(per_ctx[0], per_ctx[1])
        # The FP32 sum is rounded once; the weight is its FP32 master copy rounded.  Over
        # seeds 0-9 the largest gap is 0.34 of this bound (AMD EPYC with avx512_bf16).
        assert np.allclose(per_ctx[0], ref[0], rtol=2 ** -6, atol=2 ** -8), (per_ctx[0], ref[0])
    # float16 gradients keep travelling in float16.
    kv16 = _DistKVStoreWithoutBfloat16()
    net = make_net('float16', CTXS)
    fp16 = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, kvstore=kv16,
                   loss_scale=LossScaler(init_scale=2.0 ** 8))
    forward_backward(net, fp16, CTXS)
    assert fp16.step(8) is True
    assert not fp16._fp32_reduce and kv16.dtypes == {'float16'}


def test_bfloat16_with_dist_kvstore_refuses_server_updates():
    params = make_net('bfloat16').collect_params()
    with pytest.raises(ValueError, match='update_on_kvstore=True is not supported with bfloat16'):
        Trainer(params, 'sgd', kvstore='dist_sync', update_on_kvstore=True)
    with pytest.raises(ValueError, match="bfloat16 parameters cannot be trained with kvstore "
                                         "'dist_async'"):
        Trainer(params, 'sgd', kvstore='dist_async')
    # gluon.Trainer._kvstore_params: the kvstore itself is created at the first step.
    assert Trainer(params, 'sgd', kvstore='dist_sync')._kvstore_params['update_on_kvstore'] \
        is False


_BF16_WORKER = textwrap.dedent('''
    import json, sys, numpy as np, mxnet as mx
    from mxnet import autograd, gluon, nd
    sys.path.insert(0, {root!r})
    import warnings
    import mxamp
    from mxamp.dtypes import cast, to_float32_numpy
    from mxamp.trainer import Trainer
    kv = mx.kv.create('dist_sync')
    rank = kv.rank
    mx.random.seed(rank)                       # different: the broadcast must win
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize(mx.init.Uniform(0.5))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')        # bfloat16 storage only on CPUs without it
        mxamp.convert(net, 'bfloat16')
    start = [to_float32_numpy(p.data()).ravel().tolist() for p in (net.weight, net.bias)]
    tr = Trainer(net.collect_params(), 'sgd', {{'learning_rate': 0.1}}, kvstore=kv)
    i, j = np.meshgrid(np.arange(2), np.arange(4), indexing='ij')
    # Rounded to bfloat16 values (nearest even), so bfloat16 and FP32 compute read the same x.
    x = cast(cast(nd.array(0.1 * (rank + 1) * (i + j + 1)), 'bfloat16'), 'float32')
    for step in range(3):
        with autograd.record():
            loss = nd.sum(net(x))
        loss.backward()
        tr.step(4)
    end = [to_float32_numpy(p.data()).ravel().tolist() for p in (net.weight, net.bias)]
    print('RESULT', rank, json.dumps([tr._update_on_kvstore, start, end]), flush=True)
''')


@pytest.mark.slow
def test_dist_sync_trains_bfloat16_parameters(tmp_path):
    """Two workers, bfloat16 Dense layer: the server never sees bfloat16 (it would
    abort with "Unknown type enum 12"), both workers end with the same weights."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outputs, server_err = _run_dist(tmp_path, _BF16_WORKER.format(root=root))
    assert 'Unknown type enum' not in server_err
    parsed = {rank: json.loads(rest) for rank, rest in _results(outputs, server_err).items()}
    assert parsed[0][0] is False and parsed[1][0] is False           # update_on_kvstore
    parsed = {rank: (start, end) for rank, (_, start, end) in parsed.items()}
    assert parsed[0][1] == parsed[1][1]                              # identical weights
    # loss = sum(W x + b): dW[o, j] = sum_i x[i, j], db = batch, whatever W is.
    i, j = np.meshgrid(np.arange(2), np.arange(4), indexing='ij')
    grad_w = sum(_bf16_round(0.1 * (r + 1) * (i + j + 1)).sum(axis=0) for r in range(2))
    w0, b0 = (np.array(v) for v in parsed[0][0])                     # rank 0's, broadcast
    expected_w = w0.reshape(3, 4) - 3 * 0.1 * grad_w / 4
    expected_b = b0 - 3 * 0.1 * 4 / 4
    w, b = (np.array(v) for v in parsed[0][1])
    assert np.allclose(w.reshape(3, 4), expected_w, rtol=2 ** -7, atol=2 ** -8), (w, expected_w)
    assert np.allclose(b, expected_b, rtol=2 ** -7, atol=2 ** -8), (b, expected_b)


class _OneWorkerDistKVStore(object):
    """The overflow-flag traffic of a dist_sync kvstore with one worker, in process:
    the server runs `optimizer`'s updater, or none (then, like MXNet's server, it
    stores what is pushed)."""
    type = 'dist_sync'

    def __init__(self, optimizer=None):
        self._updater = None if optimizer is None else mx.optimizer.get_updater(optimizer)
        self._store = {}

    def init(self, key, value):
        self._store[key] = value.copy()

    def pushpull(self, key, value, out):
        stored = self._store[key]
        if self._updater is None:
            value.copyto(stored)
        else:
            self._updater(key, value, stored)
        stored.copyto(out)


def test_dist_agreement_detects_a_server_without_the_mxamp_optimizer():
    grads = [nd.ones((3,)), cast(nd.ones((2,)), 'float16')]
    scaler = LossScaler()
    # update_on_kvstore=True (rescale_grad sent): the server must run an mxamp optimizer.
    with pytest.raises(RuntimeError, match='does not run the mxamp optimizer'):
        scaler.has_overflow(grads, kvstore=_OneWorkerDistKVStore(), rescale_grad=0.25)
    with pytest.raises(RuntimeError, match='does not run the mxamp optimizer'):
        scaler.has_overflow(grads, kvstore=_OneWorkerDistKVStore(mx.optimizer.SGD()),
                            rescale_grad=0.25)
    # update_on_kvstore=False: the plain sum is all the workers need.
    assert scaler.has_overflow(grads, kvstore=_OneWorkerDistKVStore()) is False
    server = mo.create('sgd', learning_rate=0.1)
    kv = _OneWorkerDistKVStore(server)
    assert scaler.has_overflow(grads, kvstore=kv, rescale_grad=0.25) is False
    assert server.rescale_grad == 0.25
    grads[1][0] = np.inf
    assert scaler.has_overflow(grads, kvstore=kv, rescale_grad=0.125) is True
    assert server.rescale_grad == 0.125


@pytest.mark.parametrize('dtype', ['float32', 'float16', 'bfloat16'])
@pytest.mark.parametrize('bad', [np.inf, -np.inf, np.nan, None])
def test_has_overflow_every_dtype_mixed_groups_and_many_arrays(dtype, bad):
    scaler = LossScaler()
    # 250 arrays (more than multi_all_finite's 200) of two dtypes on two contexts.
    arrays = [cast(nd.ones((3,), ctx=CTXS[i % 2]), dtype if i % 3 else 'float32')
              for i in range(250)]
    if bad is not None:
        values = nd.array([1.0, bad, 2.0], ctx=CTXS[1])
        arrays[-2] = cast(values, dtype)                    # the last chunk, second context
    assert scaler.has_overflow(arrays) is (bad is not None)


def test_init_kvstore_broadcasts_before_the_first_step():
    """The first context's (worker 0's) values reach every context at once, not at the
    first step after a forward pass has moved BatchNorm statistics."""
    param = gluon.Parameter('w', shape=(3,), init=mx.init.One())
    param.initialize(ctx=CTXS)
    param.list_data()[1][:] = 5.0
    trainer = Trainer([param], 'sgd', {'learning_rate': 0.1}, kvstore='device')
    assert param.list_data()[1].asnumpy().tolist() == [5.0] * 3      # gluon: lazily
    trainer.init_kvstore()
    assert trainer._kvstore is not None
    for data in param.list_data():
        assert data.asnumpy().tolist() == [1.0] * 3
    param.list_data()[1][:] = 7.0
    trainer.init_kvstore()                                          # once only
    assert param.list_data()[1].asnumpy().tolist() == [7.0] * 3


@pytest.mark.parametrize('order', ['convert-then-initialize', 'deferred-initialisation'])
def test_trainer_sees_the_dtype_convert_gave_uninitialised_parameters(order):
    """Parameters read FP32 until the first forward casts them: the Trainer must still
    give float16 master weights and loss scaling (it decides at construction)."""
    if order == 'convert-then-initialize':
        net = convert_quietly(gluon.nn.Dense(2, in_units=4), 'float16')
        net.initialize()
    else:
        net = gluon.nn.Dense(2, use_bias=False)     # its one parameter: shape unknown
        net.initialize()
        net = convert_quietly(net, 'float16')
    assert all(p.dtype in (np.float32, 'float32') for p in net.collect_params().values())
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale='auto')
    assert trainer.optimizer.multi_precision
    assert trainer.loss_scaler is not None and trainer.loss_scaler.dynamic
    applied = []
    for _ in range(4):
        with autograd.record():
            loss = net(nd.full((4, 4), 1e-3)).sum()
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        applied.append(trainer.step(4))
    assert any(applied)
    # Without momentum the state is the FP32 master copy alone (and a None).
    masters = [a for state in trainer._updaters[0].states.values() for a in state
               if a is not None]
    assert masters and all(m.dtype == np.float32 for m in masters)
    assert all(p.data().dtype == np.float16 for p in net.collect_params().values())


def test_bfloat16_over_a_dist_kvstore_is_known_before_initialisation():
    net = convert_quietly(gluon.nn.Dense(2, in_units=4), 'bfloat16')
    net.initialize()
    with pytest.raises(ValueError, match='update_on_kvstore=True is not supported'):
        Trainer(net.collect_params(), 'sgd', kvstore='dist_sync', update_on_kvstore=True)


@pytest.mark.parametrize('poison, finite', [(None, True), (np.nan, False), (np.inf, False),
                                            (-np.inf, False)])
def test_float16_overflow_check_on_cpu(poison, finite):
    """float16 gradients on a CPU are checked through FP32 sums of squares: the largest
    finite float16 values are no overflow (their squares overflow float16, not float32),
    any inf or NaN is."""
    from mxamp.loss_scaler import _finite_flags
    grads = [nd.full((1000,), 65504.0, dtype='float16'), nd.ones((3, 3), dtype='float16')]
    if poison is not None:
        grads[1][1, 2] = poison
    flags = _finite_flags(grads)
    assert len(flags) == 1 and flags[0].asscalar() == (1.0 if finite else 0.0)
