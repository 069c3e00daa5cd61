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


pytestmark = pytest.mark.usefixtures('quiet_precision_warnings', 'blocked_bfloat16_policy')


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
        bn.running_mean.set_data(mx.nd.array(rng.uniform(-0.5, 0.5, (32,))))
        bn.running_var.set_data(mx.nd.array(rng.uniform(0.5, 2.0, (32,))))
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
    # Where convolutions compute in bfloat16, mxamp folds their BatchNorm itself.
    folded = ('; 2 BatchNorm folded into bfloat16 convolutions by mxamp (in float64, rounded '
              'once to nearest)' if computes_in('bfloat16') == 'bfloat16' else '')
    assert text.splitlines()[1] == (
        "fused for inference by MXNet's oneDNN backend: 2 _sg_mkldnn_conv, "
        "1 _sg_mkldnn_fully_connected%s; inference only (training through it raises)" % folded)
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
    # The stem's BatchNorm is folded by mxamp into a weight read through the zero
    # channel: the folded weight has it (MXNet 1.9.1: the CachedOp's parameters are
    # the Parameters of _cached_op_args).
    stem = [param for is_input, param in net._cached_op_args if not is_input
            and param.name == net[0].name + '_fwd_mxamp_folded_weight']
    assert len(stem) == 1 and stem[0].shape[1] == 4 and stem[0].dtype == BFLOAT16
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
    # Where conv0 computes in bfloat16, mxamp folded bn0 into it; the rest is unchanged.
    folded = computes_in(dtype) == 'bfloat16'
    replaced = {'conv0_weight', 'conv0_bias', 'bn0_gamma', 'bn0_beta', 'bn0_moving_mean',
                'bn0_moving_var'} if folded else set()
    for converted, kept in zip(plain[1:], fused[1:]):
        assert sorted(set(kept) - {'conv0_mxamp_folded_weight', 'conv0_mxamp_folded_bias'}) \
            == sorted(set(converted) - replaced)
        assert all(np.array_equal(to_float32_numpy(kept[name]), to_float32_numpy(value))
                   and kept[name].dtype == value.dtype for name, value in converted.items()
                   if name not in replaced)
    assert ('conv0_mxamp_folded_weight' in fused[1]) == folded
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


# ---------------------------------------------------------------------------
# BatchNorm after a bfloat16 convolution: folded by mxamp, rounded to nearest.
# MXNet 1.9.1's oneDNN backend folds it itself by truncating the folded weights
# and bias to bfloat16: biased, and on a trained ResNet-20 (AMX Xeon) 3.1%
# relative error where the unfused net has 0.46%.

def bfloat16_conv_bn(with_bias):
    """data -> bfloat16 convolution -> BatchNorm, as a converted graph has it, and values
    whose fold a truncation gets wrong: a mean far from zero, small variances."""
    rng = np.random.RandomState(5)
    low = mx.sym.amp_cast(mx.sym.var('data', dtype='float32'), dtype='bfloat16', name='cast')
    weight = mx.sym.var('conv_weight', dtype=BFLOAT16)
    bias = mx.sym.var('conv_bias', dtype=BFLOAT16) if with_bias else None
    conv = mx.sym.Convolution(low, weight, bias, kernel=(3, 3), num_filter=8,
                              no_bias=not with_bias, name='conv')
    bn = mx.sym.BatchNorm(conv, fix_gamma=False, eps=1e-5, name='bn')
    out = mx.sym.amp_cast(mx.sym.Activation(bn, act_type='relu', name='relu'), dtype='float32')
    arrays = {'conv_weight': dtypes.cast(mx.nd.array(rng.normal(0, 0.2, (8, 4, 3, 3))), 'bfloat16'),
              'bn_gamma': mx.nd.array(rng.uniform(0.5, 2.0, 8)),
              'bn_beta': mx.nd.array(rng.normal(0, 1, 8)),
              'bn_moving_mean': mx.nd.array(rng.normal(3, 1, 8)),
              'bn_moving_var': mx.nd.array(rng.uniform(0.01, 0.1, 8))}
    if with_bias:
        arrays['conv_bias'] = dtypes.cast(mx.nd.array(rng.normal(0, 0.5, 8)), 'bfloat16')
    return out, arrays


@pytest.mark.parametrize('with_bias', [False, True])
def test_fold_batchnorm_rounds_the_exact_fold_to_nearest(with_bias):
    from ml_dtypes import bfloat16
    symbol, arrays = bfloat16_conv_bn(with_bias)
    folded, values, count = inference.fold_batchnorm(symbol, arrays)
    assert count == 1 and sorted(values) == ['conv_mxamp_folded_bias', 'conv_mxamp_folded_weight']
    nodes = json.loads(folded.tojson(remove_amp_cast=False))['nodes']
    ops = collections.Counter(node['op'] for node in nodes)
    assert 'BatchNorm' not in ops and ops['Convolution'] == 1
    conv = next(node for node in nodes if node['op'] == 'Convolution')
    assert conv['attrs']['no_bias'] == 'False'
    assert [nodes[src]['name'] for src, _, _ in conv['inputs'][1:]] == [
        'conv_mxamp_folded_weight', 'conv_mxamp_folded_bias']
    assert sorted(folded.list_arguments()) == ['conv_mxamp_folded_bias', 'conv_mxamp_folded_weight',
                                               'data']
    # The fold in float64, rounded once to nearest: bit for bit.
    value = {name: to_float32_numpy(array).astype(np.float64) for name, array in arrays.items()}
    alpha = value['bn_gamma'] / np.sqrt(value['bn_moving_var'] + 1e-5)
    weight = value['conv_weight'] * alpha[:, None, None, None]
    bias = value['bn_beta'] + (value.get('conv_bias', 0.0) - value['bn_moving_mean']) * alpha
    for name, exact in (('conv_mxamp_folded_weight', weight), ('conv_mxamp_folded_bias', bias)):
        got = dtypes.to_numpy(values[name])
        assert values[name].dtype == BFLOAT16
        assert np.array_equal(got.view(np.uint16), exact.astype(bfloat16).view(np.uint16))
    # What MXNet's fold stores instead: truncated, so smaller in magnitude, never larger.
    truncated = (bias.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert not np.array_equal(truncated, to_float32_numpy(values['conv_mxamp_folded_bias']))


def test_fold_batchnorm_leaves_float32_convolutions_and_incomplete_values_to_mxnet():
    symbol, arrays = bfloat16_conv_bn(False)
    missing = dict(arrays)
    del missing['bn_moving_var']
    assert inference.fold_batchnorm(symbol, missing)[1:] == ({}, 0)
    fp32 = mx.sym.BatchNorm(mx.sym.Convolution(mx.sym.var('data'), kernel=(1, 1), num_filter=4,
                                               name='conv'), name='bn')
    args, auxs = params_of(fp32, data_shape=(1, 4, 4, 4))
    assert inference.fold_batchnorm(fp32, dict(args, **auxs))[1:] == ({}, 0)


def test_a_bfloat16_graph_keeps_its_batchnorm_from_mxnets_fold():
    # Convolutions computing in bfloat16 (the default bfloat16 graph, for CPUs that
    # have the kernels) reach their BatchNorm through an in-place amp_cast, which
    # MXNet's oneDNN partitioner does not fold across (Module's inference bind).
    symbol, args, auxs = checkpoint()
    converted, cargs, cauxs = mxamp.convert_model(symbol, args, auxs, dtype='bfloat16',
                                                  input_shapes={'data': (2, 16, 8, 8)})
    nodes = json.loads(converted.tojson(remove_amp_cast=False))['nodes']
    barrier = [node for node in nodes if node['name'].endswith('_mxamp_no_fold')]
    assert [(node['op'], node['attrs'], nodes[node['inputs'][0][0]]['name']) for node in barrier] \
        == [('amp_cast', {'dtype': 'bfloat16'}, 'conv0')]
    bn = next(node for node in nodes if node['name'] == 'bn0')
    assert nodes[bn['inputs'][0][0]]['name'] == 'conv0_mxamp_no_fold'
    partitioned = converted.optimize_for('MKLDNN', dict(cargs), dict(cauxs), ctx=mx.cpu(),
                                         shape_dict={'data': (2, 16, 8, 8)})
    ops = collections.Counter(node['op'] for node in json.loads(
        partitioned.tojson(remove_amp_cast=False))['nodes'])
    assert ops['BatchNorm'] == 1
    # What mxamp fuses folds the pair itself and drops the amp_cast.
    fused, fargs, fauxs = mxamp.convert_model(symbol, args, auxs, dtype='bfloat16',
                                              input_shapes={'data': (2, 16, 8, 8)},
                                              for_inference=True)
    names = [node['name'] for node in json.loads(fused.tojson(remove_amp_cast=False))['nodes']]
    assert not any(name.endswith('_mxamp_no_fold') for name in names)
    assert sorted(fargs) == sorted(set(cargs) - {'conv0_weight', 'conv0_bias', 'bn0_gamma', 'bn0_beta'}
                                   | {'conv0_mxamp_folded_weight', 'conv0_mxamp_folded_bias'})
    assert not fauxs


def resnet_with_wide_statistics():
    """A ResNet-20 whose BatchNorm statistics are those of a trained net (means far from
    zero, small variances): where a truncated fold shows."""
    import gluoncv
    net = gluoncv.model_zoo.get_model('cifar_resnet20_v1', classes=10)
    net.initialize(mx.init.Xavier(magnitude=2), ctx=mx.cpu())
    rng = np.random.RandomState(7)
    net(mx.nd.zeros((1, 3, 16, 16)))
    for name, param in net.collect_params().items():
        if name.endswith('running_mean'):
            param.set_data(mx.nd.array(rng.normal(1.0, 1.0, param.shape)))
        elif name.endswith('running_var'):
            param.set_data(mx.nd.array(rng.uniform(0.05, 0.5, param.shape)))
        elif name.endswith('beta'):
            param.set_data(mx.nd.array(rng.normal(0.0, 0.5, param.shape)))
    return net


def module_paths(prefix, x):
    """Outputs for `x` of the checkpoint at `prefix` converted to bfloat16 by the Symbol
    front and run by Module: fused by convert_model(for_inference=True), and unfused,
    which Module's inference bind partitions with MXNet's oneDNN backend by default."""
    symbol, args, auxs = mx.model.load_checkpoint(prefix, 0)
    outputs = {}
    for for_inference in (True, False):
        converted = mxamp.convert_model(symbol, args, auxs, dtype='bfloat16',
                                        for_inference=for_inference,
                                        input_shapes={'data': (1,) + x.shape[1:]})
        module = mx.mod.Module(converted[0], label_names=None, context=mx.cpu())
        module.bind(data_shapes=[('data', x.shape)], for_training=False)
        module.set_params(*converted[1:])
        module.forward(mx.io.DataBatch([x]), is_train=False)
        outputs['Module, for_inference=%s' % for_inference] = module.get_outputs()[0].asnumpy()
    return outputs


@needs_bfloat16_compute
def test_fused_bfloat16_inference_is_as_accurate_as_unfused_on_every_path(tmp_path):
    """Each front's fused path errs as its own unfused path does, summed over six nets.

    One net's error ratio is no measure: over twelve seeded nets the fused Symbol
    front's error ranged from 0.54x to 2.2x its unfused one (AMX Xeon).  The fronts
    differ too (the Symbol front, built for any bfloat16 CPU, computes every
    convolution in bfloat16; the Gluon front on an AMX CPU keeps nine in FP32), so
    each is compared with itself.  Measured over these six nets (AMX Xeon): 1.02x
    (Gluon) and 1.18x (Symbol); folds from rounded weights instead of FP32 ones
    (mxamp.fusion.fold_batchnorm) gave the Symbol front 1.87x.
    """
    import gluoncv
    x = mx.nd.array(np.random.RandomState(8).uniform(0, 1, (32, 3, 16, 16)))
    errors = collections.defaultdict(float)
    for seed in range(6):
        mx.random.seed(seed)
        source = resnet_with_wide_statistics()
        source.hybridize()
        reference = source(x).asnumpy()
        prefix = str(tmp_path / ('r20_%d' % seed))
        source.export(prefix)
        source.save_parameters(prefix + '.params')

        def fresh():
            net = gluoncv.model_zoo.get_model('cifar_resnet20_v1', classes=10)
            net.load_parameters(prefix + '.params')
            return net
        unfused = mg.convert(fresh(), 'bfloat16')
        unfused.hybridize()
        errors['Gluon'] += rel_err(unfused(x).asnumpy(), reference)
        fused = mxamp.for_inference(fresh(), x, dtype='bfloat16')
        assert 'BatchNorm folded into bfloat16 convolutions by mxamp' in \
            mxamp.summary(fused, print_fn=None)
        errors['Gluon, for_inference'] += rel_err(fused(x).asnumpy(), reference)
        for path, out in module_paths(prefix, x).items():
            errors[path] += rel_err(out, reference)
    for fused, unfused in (('Gluon, for_inference', 'Gluon'),
                           ('Module, for_inference=True', 'Module, for_inference=False')):
        assert errors[fused] < 1.3 * errors[unfused], (fused, dict(errors))


@pytest.fixture(scope='module')
def trained_resnet(tmp_path_factory):
    """A ResNet-20 trained in FP32 for three epochs on scikit-learn's digits (16x16, RGB):
    its files, test images and their labels."""
    import gluoncv
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = np.repeat(np.repeat(digits.images / 16.0, 2, 1), 2, 2)[:, None].repeat(3, 1)
    order = np.random.RandomState(0).permutation(len(images))
    images, labels = images[order].astype(np.float32), digits.target[order].astype(np.float32)
    mx.random.seed(0)
    net = gluoncv.model_zoo.get_model('cifar_resnet20_v1', classes=10)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = mx.gluon.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
    loss = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    # Three epochs: two left it at 86% on 2 OpenMP threads (summation order changes the run).
    for _ in range(3):
        for start in range(0, 1500, 50):
            with autograd.record():
                value = loss(net(mx.nd.array(images[start:start + 50])),
                             mx.nd.array(labels[start:start + 50]))
            value.backward()
            trainer.step(50)
    prefix = str(tmp_path_factory.mktemp('resnet') / 'r20')
    net.export(prefix)
    net.save_parameters(prefix + '.params')
    return prefix, mx.nd.array(images[1500:]), labels[1500:]


@needs_bfloat16_compute
def test_fused_bfloat16_inference_of_a_trained_net_is_as_accurate_as_unfused(trained_resnet):
    import gluoncv
    prefix, x, labels = trained_resnet

    def fresh():
        net = gluoncv.model_zoo.get_model('cifar_resnet20_v1', classes=10)
        net.load_parameters(prefix + '.params')
        return net
    reference_net = fresh()
    reference_net.hybridize()
    reference = reference_net(x).asnumpy()
    assert (reference.argmax(1) == labels).mean() > 0.9
    unfused = mg.convert(fresh(), 'bfloat16')
    unfused.hybridize()
    bound = 1.5 * rel_err(unfused(x).asnumpy(), reference)
    outputs = {
        # Folded from the FP32 values for_inference converts.
        'FP32 net': mxamp.for_inference(fresh(), x, dtype='bfloat16')(x).asnumpy(),
        # Folded from the bfloat16 values a converted (trained) net stores.
        'converted net': mxamp.for_inference(mg.convert(fresh(), 'bfloat16'), x)(x).asnumpy()}
    outputs.update(module_paths(prefix, x))
    errors = {path: rel_err(out, reference) for path, out in outputs.items()}
    assert all(error < bound for error in errors.values()), (errors, bound)
