"""Tests of mxamp.inference: `for_inference` (Gluon), ``convert_model(..., for_inference=True)``,
and the refusal to train what they give.

Closeness to the unfused converted net: where the net computes in FP32 (float32,
bfloat16 on a CPU without bfloat16 kernels) fusion only reorders FP32
arithmetic (BatchNorm folded into the weights): 1e-5 of the output range.
Where it computes in low precision (float16 storage of activations, bfloat16
kernels), the tolerance of tests/test_gluon.py.
"""
import collections
import json

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

import mxamp
import mxamp.gluon as mg
import mxamp.dtypes as dtypes
import mxamp.hardware as hw
from conftest import computes_in, needs_bfloat16_compute
from mxamp import inference
from mxamp.dtypes import BFLOAT16, to_float32_numpy
from test_gluon import data, dname, make, rel_err, small_cnn, tolerance, train_step, trainer_for
from test_graph import params_of
from test_graph import small_cnn as graph_cnn

DTYPES = ['float32', 'float16', 'bfloat16']
# small_cnn of test_gluon: two conv+BN+relu blocks fuse into two convolutions, and the dense layer.
FUSED = collections.Counter({'_sg_mkldnn_conv': 2, '_sg_mkldnn_fully_connected': 1})


pytestmark = pytest.mark.usefixtures('quiet_precision_warnings')


def close(dtype):
    if dtype == 'float32' or computes_in(dtype) == 'float32':
        return 1e-5
    return tolerance(dtype)


def fused_of(net):
    # MXNet 1.9.1: the partitioned graph is the second item of _cached_graph.
    return inference.fused_nodes(net._cached_graph[1])


# ---------------------------------------------------------------------------
# Gluon: from every state

@pytest.mark.parametrize('dtype', DTYPES)
def test_a_fresh_net_under_deferred_initialisation(dtype):
    x = data()
    reference_net = mg.convert(make(in_channels=0), dtype)
    reference = reference_net(x).asnumpy()
    net = make(in_channels=0)
    assert net[0].weight._deferred_init
    assert mxamp.for_inference(net, x, dtype=dtype) is net
    assert fused_of(net) == FUSED
    assert dname(net[0].weight) == dtype and dname(net[1].gamma) == 'float32'
    assert np.array_equal(net[1].gamma.data().asnumpy(), reference_net[1].gamma.data().asnumpy())
    assert rel_err(net(x).asnumpy(), reference) < close(dtype)


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_converted_net_after_training_steps(dtype):
    x = data()
    net = mg.convert(make(), dtype)
    trainer = trainer_for(net, lr=0.05)
    for _ in range(2):
        train_step(net, x, trainer)
    reference = net(x).asnumpy()        # predict mode: BatchNorm's running statistics
    mxamp.for_inference(net, x)         # 'auto' keeps the conversion
    assert dname(net[0].weight) == dtype and fused_of(net) == FUSED
    assert rel_err(net(x).asnumpy(), reference) < close(dtype)


def randomised_statistics(net, seed):
    # Folding BatchNorm into the weights only shows with statistics other than (0, 1).
    rng = np.random.RandomState(seed)
    for bn in (net[1], net[4]):
        bn.running_mean.set_data(mx.nd.array(rng.uniform(-0.5, 0.5, (16,))))
        bn.running_var.set_data(mx.nd.array(rng.uniform(0.5, 2.0, (16,))))
    return net


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_net_after_load_parameters(tmp_path, dtype):
    x = data()
    source = randomised_statistics(mg.convert(make(seed=3), dtype), seed=4)
    reference = source(x).asnumpy()
    source.save_parameters(str(tmp_path / 'source.params'))
    net = make(seed=0, in_channels=0)
    net.load_parameters(str(tmp_path / 'source.params'))
    mxamp.for_inference(net, x, dtype=dtype)
    assert rel_err(net(x).asnumpy(), reference) < close(dtype)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_load_parameters_after_fusing_uses_the_new_values(tmp_path, dtype):
    # A fused convolution keeps the BatchNorm-folded weights it computed once
    # (measured: an FP32 net kept its old outputs); the net fuses again.
    x = data()
    source = randomised_statistics(mg.convert(make(seed=3), dtype), seed=4)
    reference = source(x).asnumpy()
    source.save_parameters(str(tmp_path / 'source.params'))
    net = mxamp.for_inference(make(seed=0), x, dtype=dtype)
    before = net(x).asnumpy()
    net.load_parameters(str(tmp_path / 'source.params'))
    assert rel_err(before, reference) > 0.1
    assert rel_err(net(x).asnumpy(), reference) < close(dtype)
    assert fused_of(net) == FUSED


def test_an_existing_conversion_is_kept_and_another_dtype_refused():
    x = data()
    net = mg.convert(make(), 'float16')
    with pytest.raises(ValueError, match="converted to float16, dtype='bfloat16' asks for another"):
        mxamp.for_inference(net, x, dtype='bfloat16')
    mxamp.for_inference(net, x, dtype='fp16')
    assert dname(net[0].weight) == 'float16'
    mxamp.for_inference(net, x)         # a second call fuses again, same result
    assert dname(net[0].weight) == 'float16' and fused_of(net) == FUSED


@pytest.mark.parametrize('how', ['float32', 'fp32', 'auto'])
def test_the_float32_that_convert_chose_is_kept(monkeypatch, how):
    # A net that mxamp.convert kept in float32 (asked, or 'auto' on a CPU without
    # bfloat16 kernels) stays float32 where 'auto' would mean bfloat16 for a new one.
    x = data()
    monkeypatch.setattr(hw, 'cpu_class', lambda: hw.AVX2)
    monkeypatch.setattr(dtypes, '_warned_auto_float32', True)
    net, other = mg.convert(make(), how), mg.convert(make(), how)
    reference = net(x).asnumpy()
    monkeypatch.setattr(hw, 'cpu_class', lambda: hw.AVX512_BF16)
    assert mxamp.for_inference(net, x) is net
    assert dname(net[0].weight) == 'float32' and fused_of(net) == FUSED
    assert rel_err(net(x).asnumpy(), reference) < 1e-5
    with pytest.raises(ValueError, match="converted to float32, dtype='bfloat16' asks for another"):
        mxamp.for_inference(other, x, dtype='bfloat16')


def test_bad_calls_are_refused_in_one_line():
    x = data()
    with pytest.raises(TypeError, match='needs example inputs'):
        mxamp.for_inference(make(), dtype='float32')
    with pytest.raises(TypeError, match='needs a gluon HybridBlock'):
        mxamp.for_inference(mx.gluon.nn.Sequential(), x)
    with pytest.raises(ValueError, match='inputs are on several contexts'):
        mxamp.for_inference(make(), x, x.as_in_context(mx.cpu(1)))
    with pytest.raises(RuntimeError, match=r'not initialised; call net.initialize\(\)'):
        mxamp.for_inference(small_cnn(in_channels=16), x)


# ---------------------------------------------------------------------------
# Refusal to train

def test_mxnet_fused_ops_return_zero_gradients():
    # Why the refusal exists: with plain optimize_for, backward through the
    # fused net runs and gives zeros to the weights and the input alike.
    x = data()
    x.attach_grad()
    net = make()
    net.optimize_for(x, backend='MKLDNN')
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    assert not x.grad.asnumpy().any() and not net[0].weight.grad().asnumpy().any()


@pytest.mark.parametrize('train_mode', [True, False])
def test_recording_through_it_raises_with_the_fix(train_mode):
    x = data()
    net = mxamp.for_inference(make(), x, dtype='bfloat16')
    with pytest.raises(RuntimeError, match=r'made by mxamp.for_inference: .* no gradient .*'
                                           r'load its checkpoint into a fresh net.*autograd.pause'):
        with autograd.record(train_mode=train_mode):
            net(x)
    with autograd.record():
        with autograd.pause():
            frozen = net(x)
    assert frozen.shape == (2, 5)


def test_trainers_refuse_its_parameters_and_summary_says_fused():
    x = data()
    net = mxamp.for_inference(make(), x, dtype='bfloat16')
    for params in (net.collect_params(), net[0].collect_params()):
        with pytest.raises(RuntimeError, match="mxamp.Trainer: parameter '.*' belongs to "
                                               "HybridSequential '.*', made by mxamp.for_inference"):
            mxamp.Trainer(params, 'sgd', {'learning_rate': 0.1})
    mxamp.Trainer(make().collect_params(), 'sgd', {'learning_rate': 0.1})   # others still train
    text = mxamp.summary(net, print_fn=None)
    assert text.splitlines()[1] == (
        "fused for inference by MXNet's oneDNN backend: 2 _sg_mkldnn_conv, "
        "1 _sg_mkldnn_fully_connected; inference only (training through it raises)")
    plain = mxamp.for_inference(make(), x, dtype='float32')
    assert 'runs in float32' in mxamp.summary(plain, print_fn=None)
    assert 'inference only' in mxamp.summary(plain, print_fn=None)


def test_a_child_added_after_fusing_is_inference_only_too():
    x = data()
    net = mxamp.for_inference(make(), x, dtype='bfloat16')
    head = mx.gluon.nn.Dense(3)
    head.initialize()
    net.add(head)
    net(x)                      # partitioned again, with the child inside the fused graph
    with pytest.raises(RuntimeError, match="parameter '%s' belongs to" % head.weight.name):
        mxamp.Trainer(head.collect_params(), 'sgd', {'learning_rate': 0.1})


# ---------------------------------------------------------------------------
# bfloat16 compute: a zero-padded RGB stem under deferred initialisation

def test_bfloat16_padding_is_partitioned_with_the_parameters_final_dtypes(monkeypatch):
    # For a CPU with bfloat16 kernels (simulated: partitioning infers types, nothing
    # runs): the RGB stem reads its weight through a zero channel.  MXNet's own
    # optimize_for would partition in the step that finishes deferred initialisation,
    # with the weight still FP32 ("Non-uniform data type in Concat"): a converted net
    # refuses it and points to for_inference, which partitions after the casts.
    monkeypatch.setattr(hw, 'cpu_class', lambda: hw.AVX512_BF16)
    x = data((2, 3, 16, 16))
    direct = mg.convert(make(in_channels=0), 'bfloat16')
    with pytest.raises(RuntimeError, match=r'call mxamp\.for_inference\(net, x\)'):
        direct.optimize_for(x, backend='MKLDNN')
    net = mxamp.for_inference(make(in_channels=0), x, dtype='bfloat16')
    nodes = json.loads(net._cached_graph[1].tojson())['nodes']
    assert any(node['name'].endswith('_mxamp_pad_weight') for node in nodes)
    assert fused_of(net) == FUSED and net[0].weight.dtype == BFLOAT16


@needs_bfloat16_compute
def test_bfloat16_rgb_net_under_deferred_initialisation_runs_fused():
    x = data((2, 3, 16, 16))
    reference = mg.convert(make(in_channels=0), 'bfloat16')(x).asnumpy()
    net = mxamp.for_inference(make(in_channels=0), x, dtype='bfloat16')
    assert '+1 zero channel' in mxamp.summary(net, print_fn=None)
    assert fused_of(net) == FUSED
    assert rel_err(net(x).asnumpy(), reference) < tolerance('bfloat16')


# ---------------------------------------------------------------------------
# Symbol API

SYMBOL_CASES = {'float32': {}, 'float16': {'ctx': mx.cpu()}, 'bfloat16': {'cpu_class': 'auto'}}


def checkpoint(seed=0):
    symbol = graph_cnn()
    args, auxs = params_of(symbol, seed=seed)
    rng = np.random.RandomState(seed + 1)
    auxs = {name: mx.nd.array(rng.uniform(0.5, 2.0, value.shape)) for name, value in auxs.items()}
    return symbol, args, auxs


def module_outputs(symbol, args, auxs, x, for_training=False):
    module = mx.mod.Module(symbol, context=mx.cpu())
    module.bind(data_shapes=[('data', x.shape)], label_shapes=[('softmax_label', (x.shape[0],))],
                for_training=for_training)
    module.set_params(args, auxs)
    module.forward(mx.io.DataBatch([x], [mx.nd.zeros(x.shape[0])]), is_train=False)
    return module.get_outputs()[0].asnumpy(), module


@pytest.mark.parametrize('dtype', DTYPES)
def test_convert_model_for_inference_loads_and_matches_the_unfused_model(tmp_path, monkeypatch, dtype):
    symbol, args, auxs = checkpoint()
    options = dict(SYMBOL_CASES[dtype], dtype=dtype, input_shapes={'data': (2, 16, 8, 8)})
    plain = mxamp.convert_model(symbol, args, auxs, **options)
    fused = mxamp.convert_model(symbol, args, auxs, for_inference=True, **options)
    assert inference.fused_nodes(fused[0]) == collections.Counter(
        {'_sg_mkldnn_conv': 2, '_sg_mkldnn_fully_connected': 1})
    assert not inference.fused_nodes(plain[0])
    for converted, kept in zip(plain[1:], fused[1:]):
        assert sorted(converted) == sorted(kept)
        assert all(np.array_equal(to_float32_numpy(kept[name]), to_float32_numpy(value))
                   and kept[name].dtype == value.dtype for name, value in converted.items())
    prefix = str(tmp_path / 'fused')
    mx.model.save_checkpoint(prefix, 0, *fused)
    loaded = mx.model.load_checkpoint(prefix, 0)
    x = data((3, 16, 8, 8))              # another batch size than the one fused for
    # Module fuses an inference bind itself (MXNET_SUBGRAPH_BACKEND): off for the reference.
    monkeypatch.setenv('MXNET_SUBGRAPH_BACKEND', 'NONE')
    reference, _ = module_outputs(*plain, x)
    monkeypatch.delenv('MXNET_SUBGRAPH_BACKEND')
    out, _ = module_outputs(*loaded, x)
    assert rel_err(out, reference) < close(dtype)
    block = mx.gluon.SymbolBlock.imports(prefix + '-symbol.json', ['data', 'softmax_label'],
                                         prefix + '-0000.params')
    assert rel_err(block(x, mx.nd.zeros(3)).asnumpy(), reference) < close(dtype)


def test_module_trainer_refuses_a_fused_graph():
    symbol, args, auxs = checkpoint()
    fused = mxamp.convert_model(symbol, args, auxs, 'bfloat16', cpu_class='auto',
                                input_shapes={'data': (2, 16, 8, 8)}, for_inference=True)
    _, module = module_outputs(*fused, data((2, 16, 8, 8)), for_training=True)
    with pytest.raises(RuntimeError, match=r'ModuleTrainer: the graph is fused for inference '
                                           r'\(2 _sg_mkldnn_conv, 1 _sg_mkldnn_fully_connected\)'):
        mxamp.ModuleTrainer(module, 'sgd', {'learning_rate': 0.1})


def test_convert_model_for_inference_needs_shapes_and_a_cpu():
    symbol, args, auxs = checkpoint()
    with pytest.raises(ValueError, match="input_shapes: fusing for inference needs the shape of 'data'"):
        mxamp.convert_model(symbol, args, auxs, 'bfloat16', for_inference=True)
    with pytest.raises(ValueError, match=r'for_inference=True fuses .* for CPUs: a float16 graph '
                                         r'for a GPU .*\(float16 for a CPU: ctx=mx.cpu\(\)\)'):
        mxamp.convert_model(symbol, args, auxs, 'float16', for_inference=True,
                            input_shapes={'data': (2, 16, 8, 8)})
