"""Tests of editing a converted Gluon net: re-initialising it, replacing or adding
children, and MXNet's ``optimize_for`` and ``hybridize(backend=...)`` (refused:
`mxamp.for_inference` fuses).

Outputs of an edited net are compared with an FP32 copy of it that loads the
converted net's checkpoint (``save_parameters`` writes the stored values in
FP32, exactly), with the tolerance of tests/test_gluon.py: this checks that the
net runs the edited graph with the parameters it holds.
"""
import pickle

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import mxamp
import mxamp.gluon as mg
from mxamp import inference
from mxamp.dtypes import cast, dtype_name, param_precision, to_float32_numpy
from test_gluon import NotTraceable, dname, rel_err, tolerance

DTYPES = ['bfloat16', 'float16']

pytestmark = pytest.mark.usefixtures('quiet_precision_warnings')


class Net(gluon.HybridBlock):
    """A resnet-like net: ``features`` (a HybridSequential), then an ``output`` Dense.

    in_channels=0 gives deferred initialisation.
    """

    def __init__(self, classes=5, in_channels=4, **kwargs):
        super(Net, self).__init__(**kwargs)
        deferred = not in_channels
        with self.name_scope():
            self.features = nn.HybridSequential()
            self.features.add(nn.Conv2D(8, 3, padding=1, in_channels=in_channels),
                              nn.BatchNorm(in_channels=0 if deferred else 8),
                              nn.Activation('relu'), nn.GlobalAvgPool2D(), nn.Flatten())
            self.output = nn.Dense(classes, in_units=0 if deferred else 8)

    def hybrid_forward(self, F, x):
        return self.output(self.features(x))


def make(dtype, in_channels=4, seed=0):
    mx.random.seed(seed)
    net = Net(in_channels=in_channels)
    net.initialize(mx.init.Xavier())
    return mg.convert(net, dtype)


X = mx.nd.array(np.random.RandomState(1).uniform(-1, 1, (4, 4, 6, 6)).astype(np.float32))
Y = mx.nd.array([0, 1, 2, 3])


def values(param):
    return to_float32_numpy(param.data())


def seed(value):
    mx.random.seed(value)
    np.random.seed(value)        # Orthogonal draws with numpy


def snapshot(net):
    return {name: values(p) for name, p in net.collect_params().items()}


def train(net, steps=3):
    """A few SGD steps with a Trainer made now; returns the losses."""
    trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(net(X), Y).mean()
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        trainer.step(1)
        losses.append(float(loss.asscalar()))
    return losses


def assert_trains(net, dtype, moving=None):
    """The loss stays finite, the dtypes stay, and the `moving` parameters change.

    By default every trainable parameter but the convolution's bias: through
    BatchNorm in training mode its gradient is zero (up to rounding).
    """
    dtypes = {name: dname(p) for name, p in net.collect_params().items()}
    assert dtypes[net.output.weight.name] == dtype
    if moving is None:
        moving = [p for p in net.collect_params().values()
                  if p.grad_req != 'null' and p is not net.features[0].bias]
    before = snapshot(net)
    losses = train(net)
    assert np.isfinite(losses).all()
    after = snapshot(net)
    assert [p.name for p in moving if np.array_equal(after[p.name], before[p.name])] == []
    assert {name: dname(p) for name, p in net.collect_params().items()} == dtypes


def fp32_reference(net, tmp_path, edit=lambda twin: None, classes=5):
    """The output of an FP32 Net, edited by `edit`, holding `net`'s parameter values."""
    path = str(tmp_path / 'edited.params')
    net.save_parameters(path)
    twin = Net(classes=classes)
    edit(twin)
    twin.load_parameters(path)
    return twin(X).asnumpy()


# ---------------------------------------------------------------------------
# Re-initialising

INITIALIZERS = {
    'xavier': lambda: mx.init.Xavier(rnd_type='gaussian', magnitude=2),
    'uniform': lambda: mx.init.Uniform(0.5),
    'normal': lambda: mx.init.Normal(0.5),
    'orthogonal': lambda: mx.init.Orthogonal(),
    'msraprelu': lambda: mx.init.MSRAPrelu(),
    'one': lambda: mx.init.One(),
    'zero': lambda: mx.init.Zero(),
    'constant': lambda: mx.init.Constant(0.3),
}


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('init', sorted(INITIALIZERS))
def test_force_reinit_draws_in_fp32_and_casts(dtype, init):
    # Each parameter gets the FP32 draw of an FP32 net (same seed), rounded to
    # its stored dtype, which it keeps; gradients too.
    net = make(dtype)
    net.hybridize()
    net(X)
    stored = {name: dname(p) for name, p in net.collect_params().items()}
    twin = Net()
    twin.initialize()
    seed(3)
    twin.initialize(INITIALIZERS[init](), force_reinit=True)
    seed(3)
    net.initialize(INITIALIZERS[init](), force_reinit=True)
    for (name, p), q in zip(net.collect_params().items(), twin.collect_params().values()):
        assert dname(p) == stored[name], name
        if p.grad_req != 'null':
            assert dtype_name(p.grad().dtype) == stored[name], name
        np.testing.assert_array_equal(values(p), to_float32_numpy(cast(q.data(), stored[name])),
                                      err_msg=name)
    assert stored[net.output.weight.name] == dtype
    weight = values(net.features[0].weight)
    if init not in ('zero', 'one', 'constant'):
        assert len(np.unique(weight)) > weight.size // 2       # drawn, not filled
    # Constant layers are symmetric: only the output layer gets a gradient
    # (only its bias when the features are all zero).
    moving = {'zero': [net.output.bias], 'one': [net.output.weight, net.output.bias],
              'constant': [net.output.weight, net.output.bias]}.get(init)
    assert_trains(net, dtype, moving)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('how', ['net', 'collect_params', 'child', 'parameter'])
def test_every_way_to_reinitialise(dtype, how, tmp_path):
    net = make(dtype)
    net.hybridize(static_alloc=True)
    net(X)
    before = snapshot(net)
    init = mx.init.Uniform(0.5)
    if how == 'net':
        net.initialize(init, force_reinit=True)
    elif how == 'collect_params':
        net.collect_params().initialize(init, force_reinit=True)
    elif how == 'child':
        net.output.initialize(init, force_reinit=True)
    else:
        net.output.weight.initialize(init, force_reinit=True)
    blocks = {'net': net, 'collect_params': net, 'child': net.output}
    targets = blocks[how].collect_params().values() if how in blocks else [net.output.weight]
    drawn = {p.name for p in targets if p.name.endswith('weight')}   # biases, BN: their own init
    assert net.output.weight.name in drawn
    for name, p in net.collect_params().items():
        now = values(p)
        if name in drawn:
            assert dname(p) == dtype and dtype_name(p.grad().dtype) == dtype
            assert not np.array_equal(now, before[name]) and np.abs(now).max() <= 0.5
            assert len(np.unique(now)) > now.size // 2
        elif how in ('child', 'parameter'):
            np.testing.assert_array_equal(now, before[name], err_msg=name)
    # The hybridized net computes with the new values.
    out = net(X).asnumpy()
    assert rel_err(out, fp32_reference(net, tmp_path)) < tolerance(dtype)
    assert_trains(net, dtype)


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_low_precision_parameter_still_pickles_and_reinitialises(dtype):
    net = make(dtype)
    net(X)
    weight = net.output.weight
    again = pickle.loads(pickle.dumps(weight))
    assert type(again) is type(weight) and param_precision(again) == dtype
    np.testing.assert_array_equal(values(again), values(weight))
    again.initialize(mx.init.Xavier(), force_reinit=True)
    assert dname(again) == dtype and not np.array_equal(values(again), values(weight))


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('deferred', [True, False])
def test_converted_before_initialize_with_an_initializer(dtype, deferred):
    # convert, then initialize with a non-default initializer: shapes known
    # (drawn at once) or deferred (drawn at the first call); the values are
    # the FP32 net's, rounded.
    in_channels = 0 if deferred else 4
    net = mg.convert(Net(in_channels=in_channels), dtype)
    twin = Net(in_channels=in_channels)
    for block in (net, twin):
        block.hybridize()
        seed(5)
        block.initialize(mx.init.Orthogonal(scale=0.9))
        block(X)
    assert dname(net.features[0].weight) == dtype and dname(net.output.weight) == dtype
    assert dname(net.features[1].gamma) == 'float32'
    for (name, p), q in zip(net.collect_params().items(), twin.collect_params().values()):
        np.testing.assert_array_equal(values(p), to_float32_numpy(cast(q.data(), dname(p))),
                                      err_msg=name)
    assert np.abs(values(net.output.weight)).max() > 0.1
    assert_trains(net, dtype)


# ---------------------------------------------------------------------------
# Replacing and adding children

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('hybridize', [True, False])
def test_replacing_the_output_layer(dtype, hybridize, tmp_path):
    net = make(dtype)
    if hybridize:
        net.hybridize(static_alloc=True)
    net(X)
    old = net.output
    net.output = nn.Dense(10)                 # FP32, shapes deferred: the fine-tuning edit
    net.output.initialize(mx.init.Xavier())
    assert net.output is not old and mg.is_converted(net.output)
    assert list(net._children) == ['features', 'output'] and net._children['output'] is net.output
    assert old.weight.name not in net.collect_params()
    out = net(X)
    assert out.shape == (4, 10) and out.dtype == np.float32
    head = net.output
    assert dname(head.weight) == dtype and dname(head.bias) == dtype
    assert dtype_name(head.weight.grad().dtype) == dtype
    reference = fp32_reference(net, tmp_path, classes=10)
    assert rel_err(out.asnumpy(), reference) < tolerance(dtype)
    rows = mxamp.summary(net, print_fn=None)
    assert head.name + '_fwd' in rows and old.name + '_fwd' not in rows
    assert_trains(net, dtype)


@pytest.mark.parametrize('dtype', DTYPES)
def test_editing_a_nested_sequential_rebuilds_the_parents_graph(dtype, tmp_path):
    # MXNet rebuilds only the graph of the block a child is registered into;
    # the hybridized root must not keep running the old layer.
    net = make(dtype)
    net.hybridize(static_alloc=True, static_shape=True)
    net(X)
    conv = nn.Conv2D(8, 3, padding=1, in_channels=4)   # an FP32 layer, initialised already
    conv.initialize(mx.init.Uniform(1.0))
    net.features.register_child(conv, '0')              # replaces features[0]
    assert net.features[0] is conv and mg.is_converted(conv)
    assert dname(conv.weight) == dtype and dtype_name(conv.weight.grad().dtype) == dtype
    extra = nn.Dense(8, in_units=8)
    net.features.add(extra)
    extra.initialize(mx.init.Uniform(1.0))    # FP32 until the next forward pass
    assert len(net.features) == 6 and mg.is_converted(extra)

    def edit(twin):
        twin.features.add(nn.Dense(8, in_units=8))
    out = net(X).asnumpy()
    assert dname(extra.weight) == dtype and dtype_name(extra.weight.grad().dtype) == dtype
    assert rel_err(out, fp32_reference(net, tmp_path, edit)) < tolerance(dtype)
    assert_trains(net, dtype)


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_block_converted_on_its_own(dtype, tmp_path):
    net = make(dtype)
    net(X)
    head = mg.convert(nn.Dense(5, in_units=8), dtype)
    head.initialize(mx.init.Xavier())
    net.output = head
    out = net(X)
    assert net.output is head and dname(head.weight) == dtype
    assert rel_err(out.asnumpy(), fp32_reference(net, tmp_path)) < tolerance(dtype)
    assert_trains(net, dtype)


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_block_converted_differently_is_refused_and_the_net_kept(dtype):
    other = 'float16' if dtype == 'bfloat16' else 'bfloat16'
    net = make(dtype)
    out = net(X).asnumpy()
    head, children = net.output, list(net.features)
    wrong = mg.convert(nn.Dense(5, in_units=8), other)
    message = (r"Dense '%s' was converted by mxamp with other settings \(%s\) than \w+ '\w+', "
               r"which it would join \(%s\): add it unconverted" % (wrong.name, other, dtype))
    with pytest.raises(ValueError, match=message):
        net.output = wrong
    with pytest.raises(ValueError, match=message):
        net.features.add(wrong)
    options = mg.convert(nn.Dense(5, in_units=8), dtype, fp32_ops=['FullyConnected'])
    with pytest.raises(ValueError, match=r"\(%s, fp32_ops=\['FullyConnected'\]\)" % dtype):
        net.output = options
    with pytest.raises(TypeError, match='cannot be turned into a graph'):
        net.features.add(NotTraceable())
    with pytest.raises(TypeError, match='Changing attribute type'):   # MXNet's own rule
        net.output = nn.Conv2D(5, 1)
    assert net.output is head and list(net.features) == children
    assert net._children['output'] is head
    np.testing.assert_array_equal(net(X).asnumpy(), out)


# ---------------------------------------------------------------------------
# optimize_for

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('deferred', [True, False])
def test_optimize_for_refuses_and_for_inference_fuses(dtype, deferred):
    net = make(dtype, in_channels=0 if deferred else 4)
    with pytest.raises(RuntimeError, match=r"optimize_for .* call mxamp\.for_inference\(net, x\)"):
        net.optimize_for(X, backend='MKLDNN')
    # hybridize(backend=...) partitions at the next call as optimize_for does: refused alike.
    with pytest.raises(RuntimeError, match=r"hybridize\(backend='MKLDNN'\) would fuse it for "
                                           r"inference .* call mxamp\.for_inference\(net, x\)"):
        net.hybridize(backend='MKLDNN')
    net.hybridize(static_alloc=True)     # without a backend: MXNet's own
    assert net._flags[0] == ('static_alloc', True)
    # Nothing was partitioned: the net still trains (non-zero gradients).
    with autograd.record():
        loss = net(X).sum()
    loss.backward()
    assert np.abs(to_float32_numpy(net.features[0].weight.grad())).max() > 0
    assert dname(net.features[0].weight) == dtype
    reference = net(X).asnumpy()
    assert mxamp.for_inference(net, X) is net
    # MXNet 1.9.1: the partitioned graph is the second item of _cached_graph.
    assert inference.fused_nodes(net._cached_graph[1])['_sg_mkldnn_conv'] == 1
    assert rel_err(net(X).asnumpy(), reference) < tolerance(dtype)
    with pytest.raises(RuntimeError, match=r'optimize_for'):
        net.optimize_for(X, backend='MKLDNN')
