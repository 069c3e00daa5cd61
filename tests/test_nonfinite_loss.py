"""A loss that is not finite is not a gradient overflow.

The case users reported: masked attention in float16 fills the masked scores
with -1e18, which float16 rounds to -inf; a sample whose positions are all
masked (padding) then gives softmax(-inf, ..., -inf) = NaN, so the loss is NaN
at every step.  mxamp.Trainer (and ModuleTrainer) must skip those steps, keep
the loss scale, and say once that the forward pass fails and where, instead of
driving the scale to its floor and warning about "gradients overflow" at every
step.  A genuine gradient overflow (finite loss) keeps its handling.
"""
import os
import warnings

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon, nd

import mxamp
from mxamp import diagnose
from mxamp.dtypes import to_float32_numpy
from mxamp.loss_scaler import LossScaler
from mxamp.trainer import Trainer

from test_trainer import DIST_WORKER_SETUP, _results, _run_dist

START = LossScaler.DEFAULT_INIT_SCALE
NOT_FINITE = 'the loss is not finite'
GRADIENTS = 'gradients overflow'


class MaskedAttention(gluon.HybridBlock):
    """Scores of 6 positions, the masked ones set to `fill`, then their softmax."""

    def __init__(self, fill, **kwargs):
        super(MaskedAttention, self).__init__(**kwargs)
        self.fill = fill
        with self.name_scope():
            self.score = gluon.nn.Dense(6, in_units=4, prefix='score_')

    def hybrid_forward(self, F, x, mask):
        scores = self.score(x)
        return F.softmax(F.where(mask, scores, F.ones_like(scores) * self.fill))


class AttentionNet(gluon.HybridBlock):
    """Dense -> masked fill -> softmax -> Dense."""

    def __init__(self, fill, **kwargs):
        super(AttentionNet, self).__init__(prefix='net_', **kwargs)
        with self.name_scope():
            self.attention = MaskedAttention(fill, prefix='attn_')
            self.out = gluon.nn.Dense(2, in_units=6, prefix='out_')

    def hybrid_forward(self, F, x, mask):
        return self.out(self.attention(x, mask))


def attention_net(fill, keep_attention_fp32=False):
    mx.random.seed(0)
    net = AttentionNet(fill)
    net.initialize(mx.init.Xavier())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')         # the once-per-process note on float16 on a CPU
        mxamp.convert(net, 'float16', exclude=[net.attention] if keep_attention_fp32 else None)
    net.hybridize()
    return net


def batch(padded=True):
    """Four samples; with `padded`, the last one is padding: every position masked."""
    rng = np.random.RandomState(0)
    mask = np.array([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                     [0, 0, 0, 0, 0, 0] if padded else [1, 0, 0, 0, 0, 0]])
    return (nd.array(rng.uniform(-1, 1, (4, 4))), nd.array(mask),
            nd.array(rng.uniform(-1, 1, (4, 2))))


def train(net, trainer, steps, padded=True):
    """`steps` steps on one batch: (applied per step, loss per step, mxamp's RuntimeWarnings)."""
    x, mask, y = batch(padded)
    loss_fn = gluon.loss.L2Loss()
    applied, losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(steps):
            with autograd.record():
                loss = loss_fn(net(x, mask), y)
                with trainer.scale_loss(loss) as scaled:
                    autograd.backward(scaled)
            applied.append(trainer.step(x.shape[0]))
            losses.append(loss.asnumpy())
    messages = [str(w.message) for w in caught
                if issubclass(w.category, RuntimeWarning) and str(w.message).startswith('mxamp:')
                and 'on a CPU' not in str(w.message)]
    return applied, losses, messages


def weights(net):
    return {name: to_float32_numpy(p.data()) for name, p in net.collect_params().items()}


def count(messages, text):
    return sum(text in m for m in messages)


# ---------------------------------------------------------------------------------
# mxamp.Trainer
# ---------------------------------------------------------------------------------
def test_nan_loss_warns_once_keeps_the_scale_and_skips_every_step():
    net = attention_net(-1e18)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    start = weights(net)
    applied, losses, messages = train(net, trainer, 8)
    assert all(np.isnan(loss[3]) for loss in losses)        # the padded sample
    assert applied == [False] * 8 and trainer.skipped_steps == 8
    # The scale is not the cause: it stays where it was, far from its floor (1).
    assert trainer.loss_scale == START
    assert count(messages, NOT_FINITE) == 1 and count(messages, GRADIENTS) == 0, messages
    message = messages[0]
    assert message.startswith('mxamp: the loss is not finite (inf/NaN in the forward output) '
                              'at step 1, so this is not a gradient overflow and loss scaling '
                              'cannot fix it: the step was skipped and the loss scale kept at '
                              '65536.'), message
    # Without diagnose_net: how to find the layer, and what to do.
    assert 'mxamp.diagnose.first_nonfinite_output(net, x) with that batch x' in message
    assert 'diagnose_net=net' in message
    assert 'use a finite fill such as -1e4' in message
    assert 'mxamp.convert(net, dtype, exclude=[block])' in message
    assert 'Warned once' in message
    after = weights(net)
    for name, value in start.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)


def test_with_diagnose_net_the_warning_names_the_fill(monkeypatch):
    net = attention_net(-1e18)
    reruns = []
    first_nonfinite_output = diagnose.first_nonfinite_output

    def counted(*args, **kwargs):
        reruns.append(args)
        return first_nonfinite_output(*args, **kwargs)
    monkeypatch.setattr(diagnose, 'first_nonfinite_output', counted)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, diagnose_net=net)
    applied, _, messages = train(net, trainer, 5)
    assert not any(applied) and trainer.loss_scale == START
    assert count(messages, NOT_FINITE) == 1 and count(messages, GRADIENTS) == 0, messages
    # -1e18 is -inf in float16: the fill itself is the first output that is not finite.
    assert ('First layer whose output is not finite (last batch, inference mode): '
            'net_attn__mulscalar0 (_mul_scalar), in float16.' in messages[0]), messages[0]
    assert 'first_nonfinite_output(net, x)' not in messages[0]
    assert len(reruns) == 1                     # only for the one warning


def test_at_min_scale_raise_raises_at_every_such_step_and_ignore_is_silent():
    net = attention_net(-1e18)
    strict = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                     loss_scale=LossScaler(init_scale=8.0, at_min_scale='raise'))
    for step in (1, 2):
        with pytest.raises(FloatingPointError, match='the loss is not finite .* at step %d, '
                           'so this is not a gradient overflow' % step):
            train(net, strict, 1)
        assert strict.skipped_steps == step and strict.loss_scale == 8.0
    quiet = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                    loss_scale=LossScaler(init_scale=8.0, at_min_scale='ignore'))
    applied, _, messages = train(net, quiet, 3)
    assert applied == [False] * 3 and quiet.loss_scale == 8.0 and messages == []


def test_fixed_scale_warns_once_too():
    net = attention_net(-1e18)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, loss_scale=128.0)
    applied, _, messages = train(net, trainer, 3)
    assert applied == [False] * 3 and trainer.loss_scale == 128.0
    assert count(messages, NOT_FINITE) == 1 and len(messages) == 1, messages


def test_nan_loss_leaves_the_schedule_alone():
    """A skipped step with a NaN loss neither lowers the scale nor breaks the run of
    clean steps that grows it; it is counted as skipped."""
    infos = []
    scaler = LossScaler(init_scale=4.0, growth_interval=3, on_overflow=infos.append)
    net = attention_net(-1e18)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}, loss_scale=scaler)
    scales = []
    for padded in (False, False, True, True, False):
        assert train(net, trainer, 1, padded)[0] == [not padded]
        scales.append(trainer.loss_scale)
    assert scales == [4.0, 4.0, 4.0, 4.0, 8.0]
    assert (scaler.steps, scaler.skipped_steps, scaler.clean_steps) == (5, 2, 0)
    assert [(i.step, i.loss_scale, i.next_loss_scale) for i in infos] == [(3, 4.0, 4.0),
                                                                         (4, 4.0, 4.0)]


def test_a_finite_fill_trains():
    net = attention_net(-1e4)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.5})
    applied, losses, messages = train(net, trainer, 12)
    assert all(np.isfinite(loss).all() for loss in losses)
    assert count(messages, NOT_FINITE) == 0 and messages == [], messages
    assert sum(applied) >= 11 and all(applied[1:]), applied
    assert losses[-1].sum() < 0.9 * losses[0].sum()


def test_the_attention_block_kept_in_fp32_trains_with_the_large_fill():
    net = attention_net(-1e18, keep_attention_fp32=True)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.5})
    applied, losses, messages = train(net, trainer, 6)
    assert all(np.isfinite(loss).all() for loss in losses) and messages == []
    assert all(applied[1:]), applied


def test_a_loss_that_overflows_only_once_scaled_backs_off():
    """A float16 loss of 1000 is finite; scaled by 2**16 it is not, nor are its
    gradients: that is an overflow of the scale, which backs off as always."""
    net = attention_net(-1e4)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.01})
    x, mask, y = batch()
    with autograd.record():
        loss = (gluon.loss.L2Loss()(net(x, mask), y) * 1000).astype('float16')
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    assert np.isfinite(loss.asnumpy()).all() and not np.isfinite(scaled.asnumpy()).all()
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        assert trainer.step(4) is False
    assert trainer.loss_scale == START / 16                  # the first descent


def test_genuine_gradient_overflow_keeps_todays_handling():
    """Finite loss, inf gradients: the scale backs off, and at its floor every overflowing
    step warns, naming the parameters; nothing is said about the loss."""
    net = attention_net(-1e4)
    trainer = Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1},
                      loss_scale=LossScaler(init_scale=2.0))
    x, mask, y = batch()
    scales, messages = [], []
    for _ in range(3):
        with autograd.record():
            loss = gluon.loss.L2Loss()(net(x, mask), y)
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        net.out.weight.grad()[:] = np.inf
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            assert trainer.step(4) is False
        messages.append([str(w.message) for w in caught])
        scales.append(trainer.loss_scale)
    assert scales == [1.0, 1.0, 1.0]
    assert messages[0] == []
    for step, caught in ((2, messages[1]), (3, messages[2])):
        assert len(caught) == 1 and ('gradients overflow at the minimum loss scale 1 (step %d'
                                     % step) in caught[0], caught
        assert 'Parameters with inf/NaN gradients (1 of 4): net_out_weight' in caught[0]
        assert NOT_FINITE not in caught[0]


# ---------------------------------------------------------------------------------
# mxamp.ModuleTrainer and LossScaler.update_module
# ---------------------------------------------------------------------------------
def attention_module(fill):
    """The same attention as a converted symbol; its outputs: the per-sample loss, and
    the filled scores under BlockGrad (-inf at masked positions in float16)."""
    x, mask, label = mx.sym.var('data'), mx.sym.var('mask'), mx.sym.var('label')
    scores = mx.sym.FullyConnected(x, num_hidden=6, name='score')
    filled = mx.sym.where(mask, scores, mx.sym.ones_like(scores) * fill, name='filled')
    out = mx.sym.FullyConnected(mx.sym.softmax(filled), num_hidden=2, name='out')
    loss = mx.sym.sum(mx.sym.square(out - label), axis=1, name='loss')
    sym = mx.sym.Group([loss, mx.sym.BlockGrad(filled, name='scores')])
    params = ['score_weight', 'score_bias', 'out_weight', 'out_bias']
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        sym = mxamp.convert_symbol(sym, 'float16', params=params, ctx=mx.cpu())
    mod = mx.mod.Module(sym, data_names=['data', 'mask'], label_names=['label'])
    mod.bind(data_shapes=[('data', (4, 4)), ('mask', (4, 6))], label_shapes=[('label', (4, 2))])
    mx.random.seed(0)
    mod.init_params(mx.init.Xavier())
    return mod


def module_step(trainer, padded=True, poison=False):
    x, mask, y = batch(padded)
    trainer.module.forward(mx.io.DataBatch([x, mask], [y]), is_train=True)
    trainer.backward()
    if poison:
        trainer.module._exec_group.grad_arrays[0][0][:] = np.inf
    return trainer.step()


def test_module_nan_loss_warns_once_and_keeps_the_scale():
    trainer = mxamp.ModuleTrainer(attention_module(-1e18), 'sgd', {'learning_rate': 0.1})
    assert trainer.loss_scale == START
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        applied = [module_step(trainer) for _ in range(6)]
    messages = [str(w.message) for w in caught if str(w.message).startswith('mxamp:')]
    assert applied == [False] * 6 and trainer.skipped_steps == 6
    assert trainer.loss_scale == START
    assert count(messages, NOT_FINITE) == 1 and count(messages, GRADIENTS) == 0, messages
    assert ('mxamp.diagnose.first_nonfinite_output(module.symbol, *inputs, arg_params=arg, '
            'aux_params=aux)' in messages[0])
    assert 'mxamp.convert_symbol(sym, dtype, exclude=[node])' in messages[0]


def test_module_outputs_under_blockgrad_are_not_the_loss():
    """Finite loss, -inf in the blocked scores, inf gradients: an overflow, backed off."""
    trainer = mxamp.ModuleTrainer(attention_module(-1e18), 'sgd', {'learning_rate': 0.1},
                                  loss_scale=LossScaler(init_scale=8.0))
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)
        assert module_step(trainer, padded=False, poison=True) is False
    loss, scores = trainer.module.get_outputs()
    assert np.isfinite(loss.asnumpy()).all() and np.isneginf(scores.asnumpy()).any()
    assert trainer.loss_scale == 4.0


# ---------------------------------------------------------------------------------
# Distributed: the workers agree, so all keep the same scale
# ---------------------------------------------------------------------------------
_WORKER = DIST_WORKER_SETUP + '''
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    for step in range(4):
        # Worker 1's loss is NaN at steps 1 and 2; worker 0's is always finite.
        value = np.nan if rank == 1 and step in (1, 2) else rank + 1.0
        x = nd.full((2, 4), value, dtype='float16')
        with autograd.record():
            loss = nd.sum(nd.broadcast_mul(x, weight.data())).astype('float32')
            with tr.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        results.append((tr.step(4), tr.loss_scale))
said = [str(w.message).split(', so')[0] for w in caught
        if 'loss is not finite' in str(w.message)]
print('RESULT', rank, results, said, flush=True)
'''


@pytest.mark.slow
@pytest.mark.parametrize('update_on_kvstore', [False, True])
def test_dist_workers_agree_on_a_nan_loss_of_one_worker(tmp_path, update_on_kvstore):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outputs, server = _run_dist(tmp_path, _WORKER.format(root=root, uok=update_on_kvstore))
    results = _results(outputs, server)
    steps = '[(True, 4.0), (False, 4.0), (False, 4.0), (True, 4.0)]'
    assert results[0].startswith(steps) and results[1].startswith(steps), results
    assert results[1].endswith("['mxamp: the loss is not finite (inf/NaN in the forward "
                               "output) at step 2']"), results[1]
    assert results[0].endswith("['mxamp: the loss is not finite (inf/NaN in the forward "
                               "output of another worker) at step 2']"), results[0]
