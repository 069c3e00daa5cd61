"""Networks that hold one block in two places: converted, trained and saved as FP32 Gluon does.

Gluon lets one block instance be registered under two parents or two names
(gluoncv's GoogLeNet registers its pooling, dropout and output layers in
``head`` too) and be called twice (a Siamese tower): one parameter, one
update per step.  A converted net keeps that sharing: the block converts
once, its parameters stay one object with one FP32 master, and `summary`,
`for_inference`, checkpoints and `mxamp.profile` see one block.
"""
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import mxamp
from mxamp.kernels import operators
from mxamp.dtypes import dtype_name, to_float32_numpy
from mxamp.network_state import state_of

from conftest import convert_quietly, median_error, needs_bfloat16_compute, relative_error

DTYPES = ['bfloat16', 'float16']


class _Siamese(gluon.HybridBlock):
    """One tower registered under two names (``tower``, ``twin``) and called on both inputs."""

    def __init__(self, **kwargs):
        super(_Siamese, self).__init__(**kwargs)
        with self.name_scope():
            self.tower = nn.HybridSequential()
            self.tower.add(nn.Conv2D(16, 3, padding=1, in_channels=16, use_bias=False),
                           nn.BatchNorm(in_channels=16),
                           nn.Activation('relu'), nn.GlobalAvgPool2D(), nn.Dense(16, in_units=16))
            self.twin = self.tower
            self.head = nn.Dense(2, in_units=32)

    def hybrid_forward(self, F, x, y):
        return self.head(F.concat(self.tower(x), self.twin(y), dim=1))


def _siamese(seed=0):
    mx.random.seed(seed)
    net = _Siamese(prefix='siamese_')
    net.initialize(mx.init.Xavier(magnitude=2.0))
    return net


def _inputs(seed=0):
    rng = np.random.RandomState(seed)
    return [mx.nd.array(rng.uniform(-1, 1, (4, 16, 8, 8)).astype('f4')) for _ in range(2)]


def _copy_params(source, target):
    for (name, param), other in zip(source.collect_params().items(), target.collect_params().values()):
        assert other.name == name
        other.set_data(param.data().astype('float32'))


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_block_held_twice_converts_once_and_stays_shared(dtype):
    net = _siamese()
    fp32_params = list(net.collect_params())
    convert_quietly(net, dtype)
    assert net.tower is net.twin
    assert state_of(net.tower) is state_of(net.twin)
    assert list(net.collect_params()) == fp32_params          # one parameter each, as in FP32
    assert dtype_name(net.tower[0].weight.dtype) == dtype
    assert dtype_name(net.tower[1].gamma.dtype) == 'float32'
    x, y = _inputs()
    out = net(x, y)
    assert out.shape == (4, 2) and np.isfinite(to_float32_numpy(out)).all()


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_shared_tower_trains_as_in_fp32_one_update_a_step(dtype):
    """The first SGD step's change of every parameter, shared ones included, against FP32's:
    a shared parameter updated twice (or its gradient counted once) moves 2x (0.5x)."""
    x, y = _inputs()
    reference, net = _siamese(), _siamese()
    _copy_params(reference, net)
    convert_quietly(net, dtype)
    net.hybridize()
    deltas = []
    for model, trainer in ((reference, gluon.Trainer(reference.collect_params(), 'sgd',
                                                       {'learning_rate': 0.5})),
                           (net, mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.5},
                                               loss_scale=1.0))):
        before = {name: to_float32_numpy(p.data()) for name, p in model.collect_params().items()}
        with autograd.record():
            loss = model(x, y).sum()
        loss.backward()
        trainer.step(4)
        deltas.append({name: to_float32_numpy(p.data()) - before[name]
                       for name, p in model.collect_params().items() if p.grad_req != 'null'})
    for name, want in deltas[0].items():
        got = deltas[1][name]
        # The stored weight's change, rounded to its dtype.  Measured over 6 seeds on an AMD
        # EPYC with avx512_bf16: worst 0.14 (bfloat16, the convolution's weight), 0.01
        # (float16); a step taken twice reads 1.0, a gradient counted once 0.5.
        assert np.linalg.norm(got - want) < 0.3 * np.linalg.norm(want), name


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_shared_tower_saves_and_loads_like_fp32_gluon(dtype, tmp_path):
    x, y = _inputs()
    net = convert_quietly(_siamese(), dtype)
    out = to_float32_numpy(net(x, y))
    path = str(tmp_path / 'siamese.params')
    net.save_parameters(path)
    saved = mx.nd.load(path)
    # MXNet writes a shared parameter under each of its names, as for an FP32 net.
    assert {'tower.0.weight', 'twin.0.weight'} <= set(saved)
    assert all(value.dtype == np.float32 for value in saved.values())
    plain = _Siamese(prefix='siamese_')
    plain.load_parameters(path)
    assert relative_error(plain(x, y).asnumpy(), out) < 0.05
    again = convert_quietly(_siamese(seed=1), dtype)
    again.load_parameters(path)
    np.testing.assert_array_equal(to_float32_numpy(again(x, y)), out)


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_shared_tower_fuses_for_inference_and_summarises(dtype):
    x, y = _inputs()
    reference = _siamese()
    want = reference(x, y).asnumpy()
    net = _siamese()
    _copy_params(reference, net)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        fused = mxamp.for_inference(net, x, y, dtype=dtype)
    assert fused.tower is fused.twin
    assert relative_error(to_float32_numpy(fused(x, y)), want) < 0.05
    text = mxamp.summary(convert_quietly(_siamese(), dtype), print_fn=None)
    # The tower's layers run twice, each call a row of the converted graph.
    assert text.count('siamese_conv0_fwd ') == 2


def test_a_shared_tower_profiles_as_one_layer_per_block():
    x, y = _inputs()
    net = convert_quietly(_siamese(), 'bfloat16')
    report = mxamp.profile(net, x, y, kernels=False, iterations=1, warmup=1)
    layers = [row['layer'] for row in report.rows]
    assert 'conv0 (2 calls)' in layers
    assert len(layers) == len(set(layers))


def _two_nets_sharing_a_tower():
    """(tower, first, second): two initialised nets whose first child is one tower."""
    tower = nn.HybridSequential(prefix='tower_')
    with tower.name_scope():
        tower.add(nn.Dense(8, in_units=4))
    first = nn.HybridSequential(prefix='first_')
    second = nn.HybridSequential(prefix='second_')
    first.add(tower, nn.Dense(2, in_units=8))
    second.add(tower, nn.Dense(3, in_units=8))
    first.initialize()
    second[1].initialize()
    return tower, first, second


def test_an_edit_inside_a_shared_block_rebuilds_every_net_that_holds_it():
    tower, first, second = _two_nets_sharing_a_tower()
    x = mx.nd.ones((2, 4))
    convert_quietly(first, 'bfloat16')
    convert_quietly(second, 'bfloat16')    # the tower, converted with first, joins second's tree
    assert state_of(tower) is state_of(first[0]) is state_of(second[0])
    first(x), second(x)
    layer = nn.Dense(4, in_units=8)
    layer.initialize()
    tower.add(layer)                # the tower now ends in 4 features
    for net in (first, second):
        assert state_of(net).graph_is_stale()
    with pytest.raises(mx.MXNetError):
        # Dense(2, in_units=8) now reads 4 features: each net rebuilt its graph to see it.
        first(x).wait_to_read()
    with pytest.raises(mx.MXNetError):
        second(x).wait_to_read()


def test_a_block_converted_with_other_settings_cannot_join_a_second_net():
    _, first, second = _two_nets_sharing_a_tower()
    convert_quietly(first, 'float16')
    with pytest.raises(ValueError, match=r"'tower' was converted by mxamp with other settings "
                                          r"\(float16\) than HybridSequential 'second'.*same settings"):
        convert_quietly(second, 'bfloat16')
    assert state_of(second) is None and state_of(second[1]) is None   # nothing changed


@pytest.mark.parametrize('dtype', DTYPES)
def test_googlenet_converts_trains_and_reloads(dtype, tmp_path):
    """gluoncv's GoogLeNet registers its pooling, dropout and output layers twice."""
    gluoncv = pytest.importorskip('gluoncv')
    mx.random.seed(0)
    net = gluoncv.model_zoo.get_model('googlenet', classes=10, pretrained=False)
    net.initialize(mx.init.Xavier(magnitude=2.0))
    x = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (2, 3, 224, 224)).astype('f4'))
    want = net(x).asnumpy()
    convert_quietly(net, dtype)
    assert net.output is net.head[2] and net.avgpool is net.head[0]
    got = to_float32_numpy(net(x))
    # Measured on an AMD EPYC with avx512_bf16: 0.011 (bfloat16), 0.0005 (float16).
    assert relative_error(got, want) < 0.1
    trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    before = to_float32_numpy(net.output.weight.data())
    applied = 0
    for _ in range(20):   # float16's first steps overflow until the loss scale settles
        with autograd.record():
            loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), mx.nd.array([1, 2]))
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        applied += trainer.step(2)
        if applied:
            break
    assert applied and (to_float32_numpy(net.output.weight.data()) != before).any()
    path = str(tmp_path / 'googlenet.params')
    net.save_parameters(path)
    plain = gluoncv.model_zoo.get_model('googlenet', classes=10, pretrained=False)
    plain.load_parameters(path)
    with autograd.predict_mode():
        assert relative_error(plain(x).asnumpy(), to_float32_numpy(net(x))) < 0.1


class _SiameseResNet(gluon.HybridBlock):
    """A thumbnail ResNet-18's features as a tower called on both inputs."""

    def __init__(self, **kwargs):
        super(_SiameseResNet, self).__init__(**kwargs)
        from mxnet.gluon.model_zoo.vision import get_resnet
        with self.name_scope():
            self.tower = get_resnet(1, 18, classes=10, thumbnail=True).features
            self.head = nn.Dense(2)

    def hybrid_forward(self, F, x, y):
        return self.head(F.concat(self.tower(x), self.tower(y), dim=1))


@pytest.mark.skipif(not operators.available(),
                    reason='own operators off here: %s' % operators.status().reason)
@needs_bfloat16_compute
def test_a_tower_called_twice_trains_on_the_own_operators(monkeypatch):
    """The own convolution and channels-last regions forced on (``MXAMP_KERNELS=all``): the
    tower's convolutions run on the own operator in both calls, and its nodes (one name per two
    calls) form no region."""
    monkeypatch.setenv('MXAMP_KERNELS', 'all')
    rng = np.random.RandomState(0)
    x, y = (mx.nd.array(rng.uniform(size=(8, 3, 16, 16))) for _ in range(2))

    def net():
        mx.random.seed(0)
        block = _SiameseResNet(prefix='siamese_')
        block.initialize(mx.init.Xavier())
        block.hybridize()
        return block

    def gradients(block):
        with autograd.record():
            block(x, y).sum().backward()
        return [to_float32_numpy(p.grad()) for p in block.collect_params().values()
                if p.grad_req != 'null']
    reference = gradients(net())
    converted = convert_quietly(net(), 'bfloat16')
    error = median_error(gradients(converted), reference)
    state = state_of(converted)
    assert state.runtime.nodes_of('own convolutions') and \
        not state.runtime.nodes_of('channels-last regions')
    monkeypatch.setenv('MXAMP_KERNELS', '0')
    mxnets = median_error(gradients(convert_quietly(net(), 'bfloat16')), reference)
    # Measured on an AMD EPYC with avx512_bf16: 0.404 against MXNet's operators' 0.408.
    assert error < 1.25 * mxnets
