"""mxamp's own clip (`mxamp.kernels.operators.clip`): MXNet's clip, vectorised, in converted Gluon nets.

MXNet 1.9.1's ``clip`` (a ReLU6) and its gradient are scalar loops on a CPU;
a converted Gluon network runs ``_mxamp_clip`` in their place.  It must give
MXNet's values bit for bit (NaN, signed zeros and the gradient at the bounds
included), and a converted network must train to the same bits with it.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

import mxamp
import mxamp.gluon as mg
from mxamp import hardware
from mxamp.kernels import operators
from mxamp.kernels.passes import OwnClips
from mxamp.passes import PassRecord
from mxamp.dtypes import cast, to_float32_numpy, to_numpy
from conftest import needs_bfloat16_compute
from test_inference_policy import copy_of, mobile_block

pytestmark = [pytest.mark.skipif(not operators.available(),
                                 reason='own operators off here: %s' % operators.status().reason),
              pytest.mark.usefixtures('quiet_precision_warnings')]

SPECIAL = [-np.inf, -7.0, -1e-30, -0.0, 0.0, 1e-30, 0.5, 6.0, 6.0000005, 7.0, np.inf, np.nan]


def _bits(array):
    values = array if isinstance(array, np.ndarray) else to_numpy(array)
    return np.ascontiguousarray(values).view(np.uint8)


def _values(size, dtype, seed=0):
    rng = np.random.RandomState(seed)
    values = rng.normal(3.0, 4.0, size).astype(np.float32)
    values[:len(SPECIAL)] = SPECIAL
    return cast(mx.nd.array(values), dtype)


def _clip_and_gradient(clip, data, head, a_min, a_max):
    data = data.copy()
    data.attach_grad()
    with autograd.record():
        out = clip(data, a_min, a_max)
    out.backward(head)
    return out, data.grad


# 70001 values: more than one chunk, threaded, and a ragged last chunk.
@pytest.mark.parametrize('size', [17, 70001])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_clip_gives_mxnets_values_and_gradient_bit_for_bit(size, dtype):
    data, head = _values(size, dtype), _values(size, dtype, seed=1)
    for a_min, a_max in ((0.0, 6.0), (-1.0, 1.0)):
        own, own_grad = _clip_and_gradient(operators.clip, data, head, a_min, a_max)
        theirs, their_grad = _clip_and_gradient(
            lambda x, low, high: mx.nd.clip(x, low, high), data, head, a_min, a_max)
        assert own.dtype == data.dtype and own.shape == data.shape
        np.testing.assert_array_equal(_bits(own), _bits(theirs))
        np.testing.assert_array_equal(_bits(own_grad), _bits(their_grad))


def test_bfloat16_bounds_round_to_nearest():
    # MXNet's bfloat16 kernel truncates a bound (6.3 -> 6.28125); the own one rounds it to
    # the nearest bfloat16 (6.3125), as oneDNN's fused clip does.
    data = cast(mx.nd.array([-1.0, 0.5, 7.0]), 'bfloat16')
    out = to_float32_numpy(operators.clip(data, 0.1, 6.3))
    nearest = to_float32_numpy(cast(mx.nd.array([0.1, 6.3]), 'bfloat16'))
    np.testing.assert_array_equal(out, [nearest[0], 0.5, nearest[1]])


def test_bad_input_is_refused_with_the_reason():
    with pytest.raises(mx.base.MXNetError, match='takes float32 or bfloat16'):
        operators.clip(mx.nd.ones((2, 3), dtype='float16'), 0, 6).wait_to_read()
    with pytest.raises(mx.base.MXNetError, match='a_min and a_max'):
        mx.nd.waitall()
        operators.clip(mx.nd.ones((2, 3)), 0, 'six').wait_to_read()


def _ops(symbol):
    import json
    return [node['op'] for node in json.loads(symbol.tojson(remove_amp_cast=False))['nodes']]


@pytest.mark.parametrize('mode', ['training', 'inference'])
def test_a_converted_net_runs_its_relu6_on_the_own_clip(mode):
    net, x = mobile_block()
    converted = mg.convert(copy_of(net, x), 'bfloat16')
    converted.hybridize()
    converted(x)
    ops = _ops(mg._runtime_graph(converted, converted._cached_graph[1], (x,), mode).symbol)
    assert ops.count(operators.CLIP_OP_NAME) == 3 and 'clip' not in ops


def test_a_clip_of_a_variable_keeps_mxnets():
    # An input's or a parameter's gradient may add (grad_req='add'), which an extension
    # operator cannot do: such a clip stays MXNet's.
    class ClipFirst(mx.gluon.HybridBlock):
        def __init__(self, **kwargs):
            super(ClipFirst, self).__init__(**kwargs)
            with self.name_scope():
                self.conv = mx.gluon.nn.Conv2D(16, 3)

        def hybrid_forward(self, F, x):
            return F.clip(self.conv(F.clip(x, 0, 1)), 0, 6)
    net = mg.convert(ClipFirst(), 'bfloat16')
    net.initialize()
    net.hybridize()
    x = mx.nd.random.uniform(shape=(2, 3, 8, 8))
    net(x)
    ops = _ops(mg._runtime_graph(net, net._cached_graph[1], (x,), 'training').symbol)
    assert ops.count('clip') == 1 and ops.count(operators.CLIP_OP_NAME) == 1


def _trained(net, x, steps=2):
    trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    labels = mx.nd.array(np.arange(x.shape[0]) % 10)
    losses = []
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(net(x), labels)
        loss.backward()
        trainer.step(x.shape[0])
        losses.append(loss.asnumpy())
    return losses, {name: to_numpy(param.data()) for name, param in net.collect_params().items()}


def _mxnets_clips(monkeypatch):
    """Convert from here on as before the own clip: clips in FP32 between casts, on MXNet's."""
    def policy(block, device_type):
        state = mg.converted_state(block)
        return state.settings.policy(device_type, inference=state.inference_only)
    monkeypatch.setattr(mg, '_policy', policy)
    monkeypatch.setattr(OwnClips, 'run', lambda self, graph, context, earlier: PassRecord(self.name))


def test_the_own_clip_computes_in_bfloat16_where_the_cpu_does(monkeypatch, blocked_bfloat16_policy):
    # (On AMX the block's 16/48-channel convolutions train in FP32, and their clips with them.)
    net, x = mobile_block()
    converted = mg.convert(copy_of(net, x), 'bfloat16')
    converted.hybridize()
    converted(x)
    clips = {record.computes_in for record in mg.converted_state(converted).conversion_for(
        'cpu')[1].nodes if record.op == 'clip'}
    assert clips == {'bfloat16' if hardware.computes_bfloat16() else 'float32'}
    _mxnets_clips(monkeypatch)
    before = mg.convert(copy_of(net, x), 'bfloat16')
    before.hybridize()
    before(x)
    assert {record.computes_in for record in mg.converted_state(before).conversion_for(
        'cpu')[1].nodes if record.op == 'clip'} == {'float32'}


def test_a_converted_net_trains_to_the_same_bits_as_on_mxnets_clip(monkeypatch,
                                                                 blocked_bfloat16_policy):
    net, x = mobile_block()
    own = mg.convert(copy_of(net, x), 'bfloat16')
    own.hybridize()
    own_losses, own_params = _trained(own, x)
    # The same graph, its clips on MXNet's kernel (in bfloat16, its slow generic one).
    monkeypatch.setattr(OwnClips, 'run', lambda self, graph, context, earlier: PassRecord(self.name))
    mxnets = mg.convert(copy_of(net, x), 'bfloat16')
    mxnets.hybridize()
    their_losses, their_params = _trained(mxnets, x)
    np.testing.assert_array_equal(np.array(own_losses), np.array(their_losses))
    for (name, mine), theirs in zip(own_params.items(), their_params.values()):
        np.testing.assert_array_equal(_bits(mine), _bits(theirs), err_msg=name)


@needs_bfloat16_compute
def test_bfloat16_clips_are_as_accurate_as_float32_ones(monkeypatch, blocked_bfloat16_policy):
    # A clip computes exactly in either precision; in bfloat16 what reads it may compute in
    # bfloat16 too (here the residual add): the output stays as close to FP32.
    net, x = mobile_block()
    reference = net(x).asnumpy()
    errors = {}
    for how in ('own clip, bfloat16', 'MXNet clip, float32'):
        if how.startswith('MXNet'):
            _mxnets_clips(monkeypatch)
        converted = mg.convert(copy_of(net, x), 'bfloat16')
        converted.hybridize()
        out = converted(x).astype('float32').asnumpy()
        errors[how] = np.linalg.norm(out - reference) / np.linalg.norm(reference)
    assert errors['own clip, bfloat16'] < 1.5 * errors['MXNet clip, float32'] + 1e-3, errors


def test_profile_measures_the_clips_the_net_runs(monkeypatch, blocked_bfloat16_policy):
    from mxamp import profiling
    measured = {}
    side = profiling._Side

    def recorded(dtype, symbol, *args, **kwargs):
        measured[dtype] = _ops(symbol)
        return side(dtype, symbol, *args, **kwargs)
    monkeypatch.setattr(profiling, '_Side', recorded)
    net, x = mobile_block()
    converted = mg.convert(copy_of(net, x), 'bfloat16')
    report = mxamp.profile(converted, x, train=True, iterations=2, warmup=1, kernels=False)
    # The graph it times runs the own clip, as the net does (not MXNet's bfloat16 clip).
    assert measured['bfloat16'].count(operators.CLIP_OP_NAME) == 3 and \
        'clip' not in measured['bfloat16']
    clips = [row for row in report.rows if row['op'] == 'clip']
    assert len(clips) == 3, [row['op'] for row in report.rows]
    assert all(row['sides']['bfloat16']['forward_ms'] > 0 for row in clips)
    assert all(row['sides']['bfloat16']['backward_ms'] > 0 for row in clips)
