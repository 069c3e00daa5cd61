"""Tests of mxamp.gluon: converting Gluon HybridBlocks in place, and summary().

Closeness to FP32: outputs are compared as max|converted - fp32| / max|fp32|
(error normalised by the output scale), against 32 units of roundoff of the
target dtype (bfloat16: 32 * 2**-8 = 0.125, float16: 32 * 2**-11 = 0.0156).  A
deep net rounds once per layer; errors of 1-30 units are what we measure on
random-weight nets.  Where a test needs exact equality (checkpoints, export) it
says so.
"""
import gc
import warnings
import weakref

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import mxamp
import mxamp.gluon as mg
import mxamp.gluon_calls as gluon_calls
import mxamp.gluon_warnings as gluon_warnings
import mxamp.dtypes as dtypes
import mxamp.hardware as hw
from conftest import computes_in, needs_bfloat16_compute
import mxamp.optimizer as mo
from mxamp.network_state import state_of
from mxamp.dtypes import BFLOAT16, cast, dtype_name, to_float32_numpy

DTYPES = ['bfloat16', 'float16']
UNIT_ROUNDOFF = {'bfloat16': 2.0 ** -8, 'float16': 2.0 ** -11}


def tolerance(dtype):
    return 32 * UNIT_ROUNDOFF[dtype]


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def dname(param):
    """Precision name of a Parameter ('bfloat16', not the raw struct)."""
    return dtype_name(param.dtype)


pytestmark = pytest.mark.usefixtures('quiet_precision_warnings')


def small_cnn(in_channels=0):
    """Conv/BN/Dense net; in_channels=0 gives deferred initialisation.

    32 channels throughout: oneDNN runs such convolutions in bfloat16 on every
    bfloat16 CPU class (an AMX CPU runs 16-channel ones in FP32, see
    mxamp.policy._amx_kernel_takes; an RGB stem gets a zero channel, see
    test_rgb_stem_runs_in_bfloat16_on_a_zero_padded_channel).
    """
    net = nn.HybridSequential()
    with net.name_scope():
        net.add(nn.Conv2D(32, 3, padding=1, in_channels=in_channels),
                nn.BatchNorm(in_channels=32 if in_channels else 0),
                nn.Activation('relu'),
                nn.Conv2D(32, 3, padding=1, in_channels=32 if in_channels else 0),
                nn.BatchNorm(in_channels=32 if in_channels else 0), nn.Activation('relu'),
                nn.GlobalAvgPool2D(),
                nn.Dense(5, in_units=32 if in_channels else 0))
    return net


def make(seed=0, in_channels=32):
    mx.random.seed(seed)
    net = small_cnn(in_channels)
    net.initialize(mx.init.Xavier(rnd_type='gaussian', factor_type='in', magnitude=2))
    return net


def data(shape=(2, 32, 16, 16), seed=1):
    return mx.nd.array(np.random.RandomState(seed).uniform(-1, 1, shape).astype(np.float32))


def trainer_for(net, lr=0.1):
    return gluon.Trainer(net.collect_params(), mo.create('sgd', learning_rate=lr, momentum=0.9))


def train_step(net, x, trainer):
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    trainer.step(x.shape[0])
    return loss


# ---------------------------------------------------------------------------
# Structure, dtypes, outputs

@pytest.mark.parametrize('dtype', DTYPES)
def test_convert_in_place_keeps_structure_and_names(dtype):
    net = make()
    x = data()
    ref = net(x).asnumpy()
    names = list(net.collect_params().keys())
    children = list(net._children.values())
    klass = type(net)
    out = mg.convert(net, dtype)
    assert out is net and mg.is_converted(net)
    assert isinstance(net, klass) and type(net).__name__ == klass.__name__
    assert list(net._children.values()) == children and net[3] is children[3]
    assert list(net.collect_params().keys()) == names
    got = net(x)
    assert got.dtype == np.float32
    assert rel_err(got.asnumpy(), ref) < tolerance(dtype)


@pytest.mark.parametrize('dtype', DTYPES)
def test_parameter_dtypes(dtype):
    net = make()
    mg.convert(net, dtype)
    net(data())
    conv, bn, dense = net[0], net[1], net[7]
    assert dname(conv.weight) == dtype and dname(conv.bias) == dtype
    assert dname(dense.weight) == dtype
    for p in (bn.gamma, bn.beta, bn.running_mean, bn.running_var):
        assert dname(p) == 'float32', p.name
    # gradients are stored like their parameters
    assert dtype_name(conv.weight.grad().dtype) == dtype
    assert dtype_name(bn.gamma.grad().dtype) == 'float32'


def test_bfloat16_never_shows_raw_uint16():
    net = make()
    mg.convert(net, 'bf16')  # alias accepted
    assert net[0].weight.dtype == BFLOAT16
    assert dtype_name(net[0].weight.dtype) == 'bfloat16'
    assert 'bfloat16' in mxamp.summary(net, print_fn=None)
    out = net(data())
    assert out.dtype == np.float32  # outputs come back in FP32


@pytest.mark.parametrize('dtype', DTYPES)
def test_deferred_initialisation(dtype):
    """Shapes unknown at convert time: params are created FP32 then cast."""
    mx.random.seed(0)
    net = small_cnn(in_channels=0)
    net.initialize()
    mg.convert(net, dtype)
    assert net[0].weight._data is None  # still deferred
    out = net(data())
    assert out.dtype == np.float32
    assert dname(net[0].weight) == dtype and dname(net[1].gamma) == 'float32'
    assert net[0].weight.shape == (32, 32, 3, 3)


def test_convert_before_initialize():
    net = small_cnn(in_channels=32)
    mg.convert(net, 'bfloat16')
    net.initialize()
    net(data())
    assert dname(net[0].weight) == 'bfloat16' and dname(net[1].gamma) == 'float32'


# ---------------------------------------------------------------------------
# Policy inside users' own blocks

class Custom(gluon.HybridBlock):
    def __init__(self, **kwargs):
        super(Custom, self).__init__(**kwargs)
        with self.name_scope():
            self.dense = nn.Dense(6, in_units=4)

    def hybrid_forward(self, F, x):
        h = self.dense(x)
        p = F.softmax(h, axis=-1)
        s = F.sum(F.exp(h), axis=-1, keepdims=True)
        return F.broadcast_mul(p, s) + F.relu(h)


@pytest.mark.parametrize('dtype', DTYPES)
def test_custom_block_softmax_sum_exp_run_in_fp32(dtype):
    mx.random.seed(0)
    net = Custom()
    net.initialize()
    x = data((3, 4))
    ref = net(x).asnumpy()
    mg.convert(net, dtype)
    got = net(x)
    assert got.dtype == np.float32
    assert rel_err(got.asnumpy(), ref) < tolerance(dtype)
    by_op = {}
    for node in mg.conversion_of(net)[0].nodes:
        by_op.setdefault(node.op, set()).add(node.precision)
    assert by_op['softmax'] == {'float32'}
    assert by_op['sum'] == {'float32'}
    assert by_op['exp'] == {'float32'}
    assert by_op['FullyConnected'] == {computes_in(dtype)}
    assert dname(net.dense.weight) == dtype
    text = mxamp.summary(net, print_fn=None)
    assert 'softmax' in text and 'float32' in text


def test_child_called_directly_uses_the_policy():
    net = make()
    mg.convert(net, 'bfloat16')
    net(data())
    inner = net[7]  # the Dense layer, called on its own
    out = inner(mx.nd.ones((2, 32)))
    assert out.dtype == np.float32
    assert mg.is_converted(inner)


@needs_bfloat16_compute
@pytest.mark.parametrize('deferred', [True, False])
def test_rgb_stem_runs_in_bfloat16_on_a_zero_padded_channel(deferred):
    # oneDNN has no blocked bfloat16 kernel for 3 input channels, but has one for
    # 4: the graph appends a zero channel to the image and the weight, whether
    # the shapes are known at convert time or only at the first call (deferred
    # initialisation); the parameter keeps its shape.
    net = make(in_channels=0 if deferred else 3)
    x = data((2, 3, 16, 16))
    reference = net(x).asnumpy()
    net = make(in_channels=0 if deferred else 3)
    mg.convert(net, 'bfloat16')
    net.hybridize()
    out = net(x)
    text = mxamp.summary(net)
    assert '+1 zero channel' in text
    rows = {line.split()[0]: line.split()[2] for line in text.splitlines() if '_fwd' in line}
    assert all(rows[net[i].name + '_fwd'] == 'bfloat16' for i in (0, 1, 2, 3))
    assert net[0].weight.shape == (32, 3, 3, 3) and net[0].weight.dtype == BFLOAT16
    assert np.abs(out.asnumpy() - reference).max() < 0.05 * np.abs(reference).max() + 1e-3
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    grad = net[0].weight.grad()
    assert grad.dtype == BFLOAT16 and grad.shape == (32, 3, 3, 3)
    assert np.abs(to_float32_numpy(grad)).sum() > 0


@pytest.mark.parametrize('cpu_class', ['avx2', 'avx512'])
def test_bfloat16_without_bfloat16_kernels_stores_bfloat16_and_computes_fp32(monkeypatch, cpu_class):
    # What an AVX2 or AVX-512-without-BF16 CPU gets (simulated: every op here is FP32,
    # so it runs on any CPU): the same parameters in the same dtypes as on a bfloat16
    # CPU, every op computing in FP32, one warning per process, trainable.
    monkeypatch.setattr(hw, 'cpu_class', lambda: cpu_class)
    monkeypatch.setattr(gluon_warnings, '_warned_bfloat16_storage_only', False)
    net = make(in_channels=3)
    x = data((2, 3, 16, 16))
    reference = net(x).asnumpy()
    net = make(in_channels=3)
    mg.convert(net, 'bfloat16')
    net.hybridize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        out = net(x)
        net(x)
    messages = [str(w.message) for w in caught if 'bfloat16 on this' in str(w.message)]
    assert len(messages) == 1 and repr(cpu_class) in messages[0] and 'FP32' in messages[0]
    conversion = mg.conversion_of(net)[0]
    assert set(conversion.node_precision.values()) == {'float32'}
    assert {name for name, p in net.collect_params().items() if p.dtype == BFLOAT16} == \
        set(conversion.lp_params) == {net[0].weight.name, net[0].bias.name, net[3].weight.name,
                                      net[3].bias.name, net[7].weight.name, net[7].bias.name}
    # Within bfloat16 rounding of the weights: closer to FP32 than real bfloat16 compute.
    assert rel_err(out.asnumpy(), reference) < tolerance('bfloat16') / 4
    text = mxamp.summary(net, print_fn=None)
    assert 'bfloat16 storage, FP32 compute' in text and repr(cpu_class) in text
    assert '->bfloat16' not in text and '+1 zero channel' not in text
    trainer = gluon.Trainer(net.collect_params(), mo.create('sgd', learning_rate=0.5))
    before = to_float32_numpy(net[0].weight.data())
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    assert net[0].weight.grad().dtype == BFLOAT16
    trainer.step(2)
    assert np.abs(to_float32_numpy(net[0].weight.data()) - before).max() > 0


# ---------------------------------------------------------------------------
# Training

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('hybridize', [True, False])
def test_training_step_changes_weights(dtype, hybridize):
    net = make()
    mg.convert(net, dtype)
    if hybridize:
        net.hybridize(static_alloc=True)
    x = data()
    trainer = trainer_for(net)
    before = {k: to_float32_numpy(p.data()).copy() for k, p in net.collect_params().items()}
    loss = train_step(net, x, trainer)
    assert np.isfinite(loss.asnumpy()).all()
    changed = [k for k, p in net.collect_params().items()
               if p.grad_req != 'null' and (to_float32_numpy(p.data()) != before[k]).any()]
    trainable = [k for k, p in net.collect_params().items() if p.grad_req != 'null']
    assert sorted(changed) == sorted(trainable)
    assert dname(net[0].weight) == dtype  # still stored in low precision


def test_loss_decreases_float16_on_cpu():
    """float16 pipeline (emulated GEMMs, float16 storage) trains on CPU."""
    net = make()
    mg.convert(net, 'float16')
    net.hybridize()
    x = data((8, 32, 16, 16))
    y = mx.nd.array(np.arange(8) % 5)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    trainer = trainer_for(net, lr=0.05)
    losses = []
    for _ in range(8):
        with autograd.record():
            loss = loss_fn(net(x), y).mean()
        loss.backward()
        trainer.step(1)
        losses.append(float(loss.asscalar()))
    assert losses[-1] < losses[0]


def test_hybridize_after_convert_and_inactive_keep_policy():
    net = make()
    x = data()
    mg.convert(net, 'bfloat16')
    plain = net(x).asnumpy()                      # not hybridized: graph path
    net.hybridize(static_alloc=True, static_shape=True)
    hybrid = net(x).asnumpy()
    net.hybridize(active=False)
    inactive = net(x).asnumpy()
    np.testing.assert_array_equal(plain, hybrid)
    np.testing.assert_array_equal(plain, inactive)
    assert mg.conversion_of(net)[0].node_precision  # the converted graph ran
    assert dname(net[0].weight) == 'bfloat16'


def test_float16_on_cpu_warns_once(monkeypatch):
    monkeypatch.setattr(gluon_warnings, '_warned_float16_cpu', False)
    net = make()
    mg.convert(net, 'float16')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        net(data())
        net.hybridize()
        net(data())
    messages = [str(w.message) for w in caught if 'float16 on a CPU' in str(w.message)]
    assert len(messages) == 1
    assert 'FP32' in messages[0]
    text = mxamp.summary(net, print_fn=None)
    assert 'float32 (float16 storage)' in text  # convolutions computed in FP32


# ---------------------------------------------------------------------------
# Checkpoints and export

@pytest.mark.parametrize('dtype', DTYPES)
def test_checkpoint_round_trip_fp32_and_converted(tmp_path, dtype):
    fp32 = make(seed=0)
    fp32(data())
    path = str(tmp_path / 'fp32.params')
    fp32.save_parameters(path)

    converted = make(seed=5)          # other weights, overwritten by the load
    mg.convert(converted, dtype)
    converted(data())
    converted.load_parameters(path)
    src = fp32.collect_params()
    for (name, p), (_, q) in zip(converted.collect_params().items(), src.items()):
        if dname(p) == 'float32':     # FP32 parameters: bit-exact
            np.testing.assert_array_equal(p.data().asnumpy(), q.data().asnumpy(), err_msg=name)
        else:                         # low precision: the rounded FP32 value
            assert dname(p) == dtype
            expected = to_float32_numpy(cast(q.data(), dtype))
            np.testing.assert_array_equal(to_float32_numpy(p.data()), expected, err_msg=name)

    # converted -> FP32 checkpoint, loaded by a plain FP32 net
    train_step(converted, data(), trainer_for(converted))
    back = str(tmp_path / 'converted.params')
    converted.save_parameters(back)
    assert all(v.dtype == np.float32 for v in mx.nd.load(back).values())
    plain = make(seed=7)
    plain.load_parameters(back)
    for (name, p), (_, q) in zip(plain.collect_params().items(),
                                 converted.collect_params().items()):
        np.testing.assert_array_equal(p.data().asnumpy(), to_float32_numpy(q.data()),
                                      err_msg=name)
    # and loaded back into a converted net: identical values again
    again = make(seed=9)
    mg.convert(again, dtype)
    again.load_parameters(back)
    for (name, p), (_, q) in zip(again.collect_params().items(),
                                 converted.collect_params().items()):
        assert p.dtype == q.dtype
        np.testing.assert_array_equal(to_float32_numpy(p.data()), to_float32_numpy(q.data()),
                                      err_msg=name)


@pytest.mark.parametrize('dtype', DTYPES)
def test_export_imports_same_outputs(tmp_path, dtype):
    net = make()
    mg.convert(net, dtype)
    net.hybridize()
    x = data()
    out = net(x).asnumpy()
    prefix = str(tmp_path / 'model')
    net.export(prefix)
    symbol_text = open(prefix + '-symbol.json').read()
    assert '_mxamp_cast_' in symbol_text  # cast nodes survive export
    if computes_in(dtype) == 'bfloat16':
        assert '"amp_cast"' in symbol_text    # activations cast with amp_cast (fast on CPU)
    if dtype == 'bfloat16':
        with pytest.raises(ValueError, match='amp_cast nodes are part of'):
            net.export(prefix, remove_amp_cast=True)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        loaded = gluon.SymbolBlock.imports(prefix + '-symbol.json', ['data'],
                                           prefix + '-0000.params')
    again = loaded(x)
    assert again.dtype == np.float32
    np.testing.assert_allclose(again.asnumpy(), out, rtol=1e-6, atol=1e-6)
    params = loaded.collect_params()
    assert dtype_name(params[net[0].weight.name].dtype) == dtype
    assert dtype_name(params[net[1].gamma.name].dtype) == 'float32'


# ---------------------------------------------------------------------------
# exclude=

@pytest.mark.parametrize('how', ['object', 'type', 'name', 'path'])
def test_exclude_keeps_blocks_in_fp32(how):
    net = make()
    dense = net[7]
    target = {'object': dense, 'type': nn.Dense, 'name': dense.name, 'path': '7'}[how]
    mg.convert(net, 'bfloat16', exclude=target)
    net(data())
    assert dname(dense.weight) == 'float32' and dname(dense.bias) == 'float32'
    assert dname(net[0].weight) == 'bfloat16'
    precision = mg.conversion_of(net)[0].node_precision
    assert [v for k, v in precision.items() if k.startswith(dense.prefix)] == ['float32']
    assert precision[net[0].prefix + 'fwd'] == computes_in('bfloat16')


def test_exclude_unknown_raises():
    with pytest.raises(ValueError, match='matches no block'):
        mg.convert(make(), 'bfloat16', exclude='no_such_block')
    with pytest.raises(ValueError, match='no block of that type'):
        mg.convert(make(), 'bfloat16', exclude=nn.LayerNorm)


def test_fp32_ops_and_lp_ops_options():
    net = make()
    mg.convert(net, 'bfloat16', fp32_ops=['FullyConnected'])
    net(data())
    assert dname(net[7].weight) == 'float32' and dname(net[0].weight) == 'bfloat16'
    with pytest.raises(ValueError, match='not registered'):
        mg.convert(make(), 'bfloat16', fp32_ops=['NoSuchOp'])


# ---------------------------------------------------------------------------
# Errors and corner cases

class NotTraceable(gluon.HybridBlock):
    def hybrid_forward(self, F, x):
        return x * float(x.asnumpy().sum())


class Imperative(gluon.Block):
    def forward(self, x):
        return x


def test_errors():
    with pytest.raises(TypeError, match='HybridBlock'):
        mg.convert(Imperative(), 'bfloat16')
    with pytest.raises(TypeError, match='cannot be turned into a graph'):
        mg.convert(NotTraceable(), 'bfloat16')
    with pytest.raises(ValueError, match='unknown dtype'):
        mg.convert(make(), 'int8')
    net = mg.convert(make(), 'bfloat16')
    with pytest.raises(ValueError, match='already converted'):
        mg.convert(net, 'float16')
    with pytest.raises(TypeError, match='cast'):
        net.cast('float16')
    with pytest.raises(TypeError, match='not converted'):
        mxamp.summary(make())


def test_float32_is_a_no_op():
    net = make()
    klass = type(net)
    assert mg.convert(net, 'float32') is net and type(net) is klass


def test_auto_on_cpu_is_bfloat16_where_bfloat16_pays():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # 'auto' stays in float32: said once per process
        net = mg.convert(make(), 'auto')
    if hw.bfloat16_pays():
        assert state_of(net).settings.dtype == 'bfloat16'
    else:
        assert not mg.is_converted(net)
        text = mxamp.summary(net, print_fn=None)
        assert 'runs in float32' in text and repr(hw.cpu_class()) in text
        assert len(text.splitlines()) == 1


@pytest.mark.parametrize('amx_enabled', [False, True])
def test_amx_left_off_keeps_auto_in_float32_and_bfloat16_says_what_it_costs(monkeypatch,
                                                                             amx_enabled):
    # A CPU with AMX tiles that oneDNN does not use computes bfloat16 on its AVX512-BF16
    # kernels, slower than FP32 there (hardware.bfloat16_pays); symbolic builds only, so
    # any CPU runs this.
    monkeypatch.setattr(hw, 'cpu_flags', lambda: frozenset((
        'avx512f', 'avx512bw', 'avx512vl', 'avx512dq', 'avx512_bf16', 'amx_bf16')))
    monkeypatch.setattr(hw, '_amx_enabled', amx_enabled)
    monkeypatch.delenv('DNNL_MAX_CPU_ISA', raising=False)
    monkeypatch.setattr(gluon_warnings, '_warned_bfloat16_without_amx', False)
    monkeypatch.setattr(dtypes, '_warned_auto_float32', True)
    assert mg.is_converted(mg.convert(make(), 'auto')) is amx_enabled
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(2):
            mxamp.summary(mg.convert(make(), 'bfloat16'), print_fn=None)
    messages = [str(w.message) for w in caught if 'AMX tiles left off' in str(w.message)]
    if amx_enabled:
        assert messages == []
    else:
        assert len(messages) == 1, messages
        assert 'slower than FP32' in messages[0] and 'Enable AMX' in messages[0]


def test_auto_on_a_cpu_without_bfloat16_stays_float32(monkeypatch):
    monkeypatch.setattr(hw, 'cpu_class', lambda: 'avx2')
    monkeypatch.setattr(dtypes, '_warned_auto_float32', False)
    net = make()
    klass = type(net)
    # On a CPU whose class DNNL_MAX_CPU_ISA lowered (CI's AVX2 pass), the warning says so.
    with pytest.warns(RuntimeWarning,
                      match=r"stays in float32 on this (CPU limited by \S+ to class )?'avx2'"):
        assert mg.convert(net, 'auto') is net
    assert type(net) is klass and dname(net[0].weight) == 'float32'
    assert "dtype='auto' kept it in float32" in mxamp.summary(net, print_fn=None)


def test_summary_lists_ops_dtypes_and_casts(capsys):
    net = mg.convert(make(), 'bfloat16')
    text = mxamp.summary(net)                     # before any forward: symbolic build
    assert text == capsys.readouterr().out.rstrip('\n')
    assert 'Convolution' in text and 'BatchNorm' in text
    if computes_in('bfloat16') == 'bfloat16':
        assert 'data->bfloat16' in text        # the input cast
        assert 'outputs cast back' in text
        assert 'casts: ' in text and 'float32->bfloat16' in text
    else:
        assert 'bfloat16 storage, FP32 compute' in text
        assert 'casts: ' in text and 'bfloat16->float32' in text   # the weights, read in FP32
    assert 'parameters: ' in text


def test_float32_leaves_the_net_as_it_is_and_summary_says_so():
    net = make()
    assert mg.convert(net, 'fp32') is net and not mg.is_converted(net)
    text = mxamp.summary(net, print_fn=None)
    assert text.startswith('mxamp summary: ') and "asked for float32 ('fp32')" in text


def test_summary_shows_the_recorded_casts_and_zero_channels(monkeypatch):
    # For a CPU with bfloat16 kernels (simulated: nothing runs): the RGB stem
    # reads its input cast and zero-padded, its stored weight zero-padded.
    monkeypatch.setattr(hw, 'cpu_class', lambda: hw.AVX512_BF16)
    net = mg.convert(make(in_channels=3), 'bfloat16')
    text = mxamp.summary(net, print_fn=None)
    rows = {line.split()[0]: line for line in text.splitlines()[3:] if line.startswith(net.prefix)}
    stem, dense = net[0].name + '_fwd', net[7].name + '_fwd'
    assert rows[stem].split(None, 3)[1:] == [
        'Convolution', 'bfloat16', 'data->bfloat16 +1 zero channel, %s +1 zero channel' % net[0].weight.name]
    assert rows[dense].split()[1:] == ['FullyConnected', 'bfloat16']   # reads bfloat16: no cast
    assert 'outputs cast back: %s->float32' % dense in text
    conversion, device = mg.conversion_of(net)
    assert device == 'cpu' and len(rows) == len(conversion.nodes)
    assert 'casts: 1 bfloat16->float32, 1 float32->bfloat16' in text


def test_a_network_is_converted_once_per_device_and_shape_knowledge(monkeypatch):
    rewrites = []
    convert_graph = mg.graph_mod.convert_graph
    monkeypatch.setattr(mg.graph_mod, 'convert_graph',
                        lambda *args, **kwargs: rewrites.append(kwargs['shapes']) or convert_graph(*args, **kwargs))
    mx.random.seed(0)
    net = small_cnn(in_channels=0)      # deferred: shapes known at the first call only
    net.initialize()
    mg.convert(net, 'bfloat16')
    # What is stored in low precision is decided by convert, for good, before any rewrite.
    assert rewrites == []
    assert state_of(net).settings.lp_params == {p.name for i in (0, 3, 7) for p in (net[i].weight, net[i].bias)}
    with pytest.raises(AttributeError):
        state_of(net).settings.lp_params = frozenset()
    x = data()
    out = net(x).asnumpy()
    # One rewrite, knowing the input's shape, from which the weights' follow.
    assert len(rewrites) == 1 and rewrites[0]['data'] == x.shape and net[0].weight.name not in rewrites[0]
    mxamp.summary(net, print_fn=None)
    net.hybridize(static_alloc=True)          # MXNet builds the graph again: the same rewrite
    np.testing.assert_array_equal(net(x).asnumpy(), out)
    net.hybridize(active=False)
    net(x)
    mxamp.summary(net, print_fn=None)
    assert len(rewrites) == 1
    net(data((3, 32, 16, 16)))                # a shape the rewrite did not know
    assert len(rewrites) == 1                 # (the graph, built once, serves every batch)
    net.hybridize()
    net(data((3, 32, 16, 16)))
    assert len(rewrites) == 2

    # summary before the first call converts without the input's shape; the call then knows more.
    net = mg.convert(make(), 'bfloat16')
    del rewrites[:]
    mxamp.summary(net, print_fn=None)
    mxamp.summary(net, print_fn=None)
    net(x)
    net.hybridize()
    net(x)
    names = {p.name for p in net.collect_params().values()}
    assert [set(shapes) for shapes in rewrites] == [names, names | {'data'}]


@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
@pytest.mark.parametrize('hybridize', [True, False])
def test_low_precision_inputs_are_read_as_their_exact_float32_values(dtype, hybridize):
    # A low-precision input pipeline: MXNet stopped at the first op ("expected float32, got float16").
    net = make()
    mg.convert(net, dtype)
    if hybridize:
        net.hybridize()
    x = cast(data(), dtype)
    np.testing.assert_array_equal(net(x).asnumpy(), net(cast(x, 'float32')).asnumpy())


def test_a_bfloat16_convolution_of_a_map_smaller_than_its_stride_trains_in_float32():
    # SSD's last extra layers at small inputs: oneDNN's bfloat16 weight gradient of a
    # 3x3 stride-2 convolution of a 1x1 map is NaN or garbage (an AMX Xeon: every step of
    # ssd_300_mobilenet0.25 at 128x128).  mxamp runs such a convolution in FP32.
    def net_and_grad(dtype):
        mx.random.seed(0)
        net = nn.HybridSequential()
        net.add(nn.Conv2D(128, 3, padding=1, in_channels=128),
                nn.Conv2D(128, 3, strides=2, padding=1, in_channels=128))
        net.initialize(mx.init.Xavier())
        if dtype != 'float32':
            mg.convert(net, dtype)
        net.hybridize()
        x = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (2, 128, 1, 1)))
        with autograd.record():
            loss = (net(x) * mx.nd.array(np.random.RandomState(1).uniform(-1, 1, (2, 128, 1, 1)))).sum()
        loss.backward()
        return net, to_float32_numpy(net[1].weight.grad())
    _, reference = net_and_grad('float32')
    net, grad = net_and_grad('bfloat16')
    precision = mg.conversion_of(net)[0].node_precision
    assert precision[net[1].prefix + 'fwd'] == 'float32'
    assert precision[net[0].prefix + 'fwd'] == computes_in('bfloat16')   # its input is 1x1 too, stride 1
    assert np.isfinite(grad).all() and rel_err(grad, reference) < tolerance('bfloat16')


def _sequence_model():
    mx.random.seed(0)
    net = nn.HybridSequential(prefix='seq_')
    with net.name_scope():
        net.add(nn.Embedding(50, 16), gluon.rnn.LSTM(16, input_size=16),
                nn.Dense(4, flatten=False, in_units=16))
    net.initialize()
    return net


def test_parameters_that_no_cpu_reads_in_bfloat16_stay_fp32():
    """The weights of MXNet's RNN operator (packed through _rnn_param_concat), which no CPU
    computes in bfloat16, are stored FP32: stored in bfloat16 they were rounded and cast
    back at every step for nothing.  float16 (GPU kernels) stores them in float16."""
    tokens = mx.nd.array(np.random.RandomState(0).randint(0, 50, (5, 2)))
    reference = _sequence_model()
    want = reference(tokens).asnumpy()
    for dtype, recurrent in (('bfloat16', 'float32'), ('float16', 'float16')):
        net = _sequence_model()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            mg.convert(net, dtype)
        lstm = net[1]
        assert {dtype_name(p.dtype) for p in lstm.collect_params().values()} == {recurrent}
        assert dtype_name(net[0].weight.dtype) == 'float32'      # Embedding: FP32 always
        assert dtype_name(net[2].weight.dtype) == dtype
        got = to_float32_numpy(net(tokens))
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_call_arrays_read_what_the_ndarray_properties_say():
    """A converted block's per-call reads (C calls, not NDArray's properties) agree with
    the properties: shapes in order through nested lists, whether any array is float16 or
    bfloat16, and the device type of the context MXNet's forward calls it in."""
    x = mx.nd.ones((4, 3))
    nested = [mx.nd.zeros((2,)), (mx.nd.ones((1, 2, 3)), 'not an array')]
    with x.context:
        read = gluon_calls.CallArrays((x, nested, None))
    assert read.shapes == ((4, 3), (2,), (1, 2, 3))
    assert read.device_type == x.context.device_type == 'cpu'
    assert not read.low_precision
    with mx.Context('cpu_shared', 0):
        assert gluon_calls.CallArrays((x,)).device_type == 'cpu_shared'
    for low in (cast(mx.nd.ones((2, 2)), 'bfloat16'), mx.nd.ones((2, 2), dtype='float16')):
        read = gluon_calls.CallArrays((x, [low]))
        assert read.low_precision and read.shapes == ((4, 3), (2, 2))
    empty = gluon_calls.CallArrays((None, 'text'))
    assert empty.shapes == () and empty.device_type is None and not empty.low_precision


class _Flagged(gluon.HybridBlock):
    """A block whose call takes a Python flag besides its array (GluonTS's decoders do)."""

    def __init__(self, **kwargs):
        super(_Flagged, self).__init__(**kwargs)
        with self.name_scope():
            self.weight = self.params.get('weight', shape=(4, 3))

    def hybrid_forward(self, F, x, double=False, weight=None):
        y = F.FullyConnected(x, weight, no_bias=True, num_hidden=4)
        return y * 2 if double else y


def test_a_call_with_values_no_graph_takes_runs_the_code_in_float32():
    # Not hybridized, a converted block runs its converted graph; a call passing a Python
    # value cannot (nor can MXNet's, hybridized): it runs the block's code on NDArrays, its
    # low-precision parameters read in FP32, and gradients reach them.
    net = _Flagged()
    net.initialize(mx.init.Uniform())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        mxamp.convert(net, 'float16')
    assert dtype_name(net.weight.data().dtype) == 'float16'
    x = mx.nd.random.uniform(shape=(2, 3))
    want = mx.nd.dot(x, net.weight.data().astype('float32').T).asnumpy()
    np.testing.assert_allclose(net(x, False).asnumpy(), want, rtol=1e-6)
    net.weight.grad()[:] = 0
    with autograd.record():
        y = net(x, True)
    y.backward()
    np.testing.assert_allclose(y.asnumpy(), 2 * want, rtol=1e-6)
    assert net.weight.grad().abs().sum().asscalar() > 0
    net.hybridize()
    with pytest.raises(ValueError, match='must be .nested. list of Symbol or NDArray'):
        net(x, False)   # as MXNet itself refuses, for an FP32 block too


def test_store_in_float32_keeps_a_float16_net_running_on_its_float32_values():
    _check_stored_in_float32('float16')


@needs_bfloat16_compute
def test_store_in_float32_keeps_a_bfloat16_net_running_on_its_float32_values():
    _check_stored_in_float32('bfloat16')


def _check_stored_in_float32(dtype):
    # What mxamp.gluonts does after training: the parameters FP32 again (exact), and the
    # converted net, called again, builds a graph that reads them so.
    net = nn.HybridSequential()
    net.add(nn.Dense(8, in_units=4), nn.Dense(3, in_units=8))
    net.initialize(mx.init.Uniform())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        mxamp.convert(net, dtype)
    net.hybridize()
    x = mx.nd.random.uniform(shape=(5, 4))
    before = net(x).asnumpy()
    low = {name: to_float32_numpy(p.data()) for name, p in net.collect_params().items()
           if dtype_name(p.data().dtype) == dtype}
    assert low
    mg.store_in_float32(net)
    assert {dtype_name(p.data().dtype) for p in net.collect_params().values()} == {'float32'}
    for name, values in low.items():
        np.testing.assert_array_equal(net.collect_params()[name].data().asnumpy(), values)
    np.testing.assert_allclose(net(x).asnumpy(), before, rtol=1e-6, atol=1e-6)


class _TwoInNestedOut(nn.HybridBlock):
    """Two inputs; outputs nested as (array, [array, array])."""

    def __init__(self, **kwargs):
        super(_TwoInNestedOut, self).__init__(**kwargs)
        with self.name_scope():
            self.left = nn.Dense(4, in_units=3, use_bias=False)
            self.right = nn.Dense(4, in_units=5, use_bias=False)

    def hybrid_forward(self, F, x, y):
        h = self.left(x) + self.right(y)
        return h, [h * 2, F.sum(h, axis=1)]


def _integer_twin_nets():
    # Small integers: exact in float16 storage, so the converted net's outputs equal FP32's.
    nets = []
    for _ in range(2):
        net = _TwoInNestedOut()
        net.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
        for param, seed in zip(net.collect_params().values(), (1, 2)):
            param.set_data(mx.nd.array(np.random.RandomState(seed).randint(-2, 3, param.shape)))
        net.hybridize()
        nets.append(net)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        mxamp.convert(nets[1], 'float16')
    return nets


def test_a_plain_call_runs_the_cached_op_as_mxnet_runs_it(monkeypatch):
    # A call of dense NDArrays on one device runs the converted CachedOp without MXNet's
    # general _call_cached_op (its cost per call, on a small net, was the graph's): the same
    # outputs, nested as MXNet nests them, on the inputs' device.
    fp32, converted = _integer_twin_nets()
    rng = np.random.RandomState(3)
    x, y = (mx.nd.array(rng.randint(-3, 4, shape)) for shape in ((2, 3), (2, 5)))
    converted(x, y)  # builds the CachedOp (through MXNet's path)
    general = []
    original = gluon.HybridBlock._call_cached_op
    monkeypatch.setattr(gluon.HybridBlock, '_call_cached_op',
                        lambda block, *args: general.append(block) or original(block, *args))
    want = fp32(x, y)
    general.clear()
    got = converted(x, y)
    assert general == []
    assert isinstance(got, tuple) is isinstance(want, tuple) and isinstance(got[1], list)
    for g, w in ((got[0], want[0]), (got[1][0], want[1][0]), (got[1][1], want[1][1])):
        assert g.shape == w.shape and dtype_name(g.dtype) == 'float32'
        np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())
    other = [a.as_in_context(mx.cpu(1)) for a in (x, y)]
    with mx.cpu(0):
        moved = converted(*other)
    assert moved[0].context == mx.cpu(1)
    np.testing.assert_array_equal(moved[0].asnumpy(), want[0].asnumpy())
    with pytest.raises(ValueError, match='multiple contexts'):
        converted(x, other[1])  # as MXNet refuses it


def test_an_op_hook_still_sees_every_operator_of_a_converted_net():
    _, converted = _integer_twin_nets()
    x, y = mx.nd.ones((2, 3)), mx.nd.ones((2, 5))
    converted(x, y)
    seen = []
    converted.register_op_hook(lambda name, op, array: seen.append(op.decode()))
    converted(x, y)
    mx.nd.waitall()
    assert any('FullyConnected' in op for op in seen)


def test_convert_frees_what_tracing_left_in_reference_cycles():
    # A hybrid_forward that leaves its Symbol in a reference cycle, as GluonTS's argument
    # checks do (an exception kept with its traceback): the conversion's trace must not
    # leave it for Python's rare full collections.
    class Kept(object):
        pass
    kept = []

    class Net(nn.HybridBlock):
        def __init__(self, **kwargs):
            super(Net, self).__init__(**kwargs)
            self.dense = nn.Dense(4, in_units=3)

        def hybrid_forward(self, F, x):
            out = self.dense(x)
            if isinstance(out, mx.sym.Symbol):
                holder = Kept()
                holder.cycle, holder.symbol = holder, out
                kept.append(weakref.ref(holder))
            return out
    net = Net()
    net.initialize()
    thresholds = gc.get_threshold()
    gc.set_threshold(10 ** 9, 10 ** 9, 10 ** 9)   # only what convert collects is collected
    try:
        mxamp.convert(net, 'bfloat16')
        left = [ref() for ref in kept]
    finally:
        gc.set_threshold(*thresholds)
    assert left and left == [None] * len(left)
    assert net(mx.nd.ones((2, 3))).shape == (2, 4)
