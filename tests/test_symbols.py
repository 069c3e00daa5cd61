"""The Symbol-API networks of ``symbols/``: structure, mixed-precision rewrite, training."""
import os
import sys
import warnings

import numpy as np
import pytest

import mxnet as mx

import mxamp
from mxamp import hardware
from mxamp.dtypes import BFLOAT16, dtype_name, to_float32_numpy
from mxamp.graph import CAST_SUFFIX, check_graph
from mxamp.symbol import make_policy

# symbols/ is a directory of network definitions beside the package, not installed
# with it (as in MXNet's examples): make it importable however pytest is started.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import symbols  # noqa: E402
from symbols import resnet  # noqa: E402

DEPTHS = sorted(resnet.UNITS)
INPUTS = ('data', 'softmax_label')
# Reference parameter counts (torchvision's ResNets with 1000 classes: same
# layers, BatchNorm gamma/beta, bias only in the classifier).
REFERENCE_PARAMS = {18: 11689512, 34: 21797672, 50: 25557032, 101: 44549160, 152: 60192808}
# Targets of the rewrite, with the context the graph is built for.
TARGETS = [('bfloat16', None), ('bfloat16', mx.cpu()), ('float16', None), ('float16', mx.cpu())]


def _parameter_count(sym, data_shape):
    shapes, _, _ = sym.infer_shape(data=data_shape)
    return {name: int(np.prod(shape)) for name, shape in zip(sym.list_arguments(), shapes)
            if name not in INPUTS}


def _declared_types(sym):
    """{variable name: precision name} from FP32 data, as Module would bind it."""
    arg_types, out_types, aux_types = sym.infer_type(data='float32', softmax_label='float32')
    names = sym.list_arguments() + sym.list_auxiliary_states()
    declared = {name: dtype_name(t) for name, t in zip(names, list(arg_types) + list(aux_types))}
    return declared, [dtype_name(t) for t in out_types]


# -- structure ---------------------------------------------------------------

@pytest.mark.parametrize('version', resnet.VERSIONS)
@pytest.mark.parametrize('num_layers', DEPTHS)
@pytest.mark.parametrize('image_shape, batch_shape', [
    ('3,224,224', (2, 3, 224, 224)),
    ('3,32,32', (2, 3, 32, 32)),
    ((1, 8, 8), (2, 1, 8, 8)),
])
def test_every_depth_and_version_infers_shapes(num_layers, version, image_shape, batch_shape):
    sym = resnet.get_symbol(7, num_layers, image_shape, version=version)
    _, out_shapes, _ = sym.infer_shape(data=batch_shape)
    assert out_shapes == [(2, 7)]
    assert sym.list_outputs() == ['softmax_output']
    assert sym.list_arguments()[-1] == 'softmax_label'


@pytest.mark.parametrize('num_layers', DEPTHS)
def test_parameter_count_matches_reference(num_layers):
    for version in resnet.VERSIONS:
        counts = _parameter_count(resnet.get_symbol(1000, num_layers, '3,224,224', version=version),
                                  (1, 3, 224, 224))
        # bn_data normalises the raw input (gamma fixed to 1, beta learnt): 3 channels,
        # absent from the reference, which expects mean/std preprocessing instead.
        assert counts.pop('bn_data_gamma') == 3 and counts.pop('bn_data_beta') == 3
        assert sum(counts.values()) == REFERENCE_PARAMS[num_layers]


def test_resnet50_has_25_6M_parameters():
    counts = _parameter_count(resnet.get_symbol(1000, 50, '3,224,224', version='1'),
                              (1, 3, 224, 224))
    assert sum(v for k, v in counts.items() if not k.startswith('bn_data')) == 25557032


def test_v1_strides_the_first_1x1_and_v15_the_3x3():
    attrs = {v: resnet.get_symbol(10, 50, '3,224,224', version=v).attr_dict() for v in ('1', '1.5')}
    assert attrs['1']['stage2_unit1_conv1']['stride'] == '(2, 2)'
    assert attrs['1']['stage2_unit1_conv2']['stride'] == '(1, 1)'
    assert attrs['1.5']['stage2_unit1_conv1']['stride'] == '(1, 1)'
    assert attrs['1.5']['stage2_unit1_conv2']['stride'] == '(2, 2)'
    # Basic units have a single strided 3x3: the version changes nothing.
    assert (resnet.get_symbol(10, 18, '3,224,224', version='1').tojson()
            == resnet.get_symbol(10, 18, '3,224,224', version='1.5').tojson())


def test_small_inputs_get_the_cifar_stem():
    small = resnet.get_symbol(10, 18, '3,32,32').attr_dict()
    large = resnet.get_symbol(10, 18, '3,64,64').attr_dict()
    assert small['conv0']['kernel'] == '(3, 3)' and small['conv0']['stride'] == '(1, 1)'
    assert 'pooling0' not in small
    assert large['conv0']['kernel'] == '(7, 7)' and large['conv0']['stride'] == '(2, 2)'
    assert large['pooling0']['pool_type'] == 'max'


def test_names_are_readable_and_stable():
    sym = resnet.get_symbol(10, 50, '3,224,224')
    args = sym.list_arguments()
    for name in ('data', 'bn_data_gamma', 'conv0_weight', 'bn0_gamma',
                 'stage1_unit1_conv1_weight', 'stage1_unit1_sc_weight', 'stage1_unit1_sc_bn_beta',
                 'stage4_unit3_conv3_weight', 'stage4_unit3_bn3_gamma', 'fc1_weight', 'fc1_bias'):
        assert name in args
    assert 'stage4_unit3_bn3_moving_var' in sym.list_auxiliary_states()
    # No auto-numbered names: building twice gives the same graph, in any process.
    for dtype in ('float32', 'bfloat16'):
        first = resnet.get_symbol(10, 18, '3,32,32', dtype=dtype).tojson(remove_amp_cast=False)
        again = resnet.get_symbol(10, 18, '3,32,32', dtype=dtype).tojson(remove_amp_cast=False)
        assert first == again


@pytest.mark.parametrize('kwargs, message', [
    (dict(num_layers=20), '18, 34, 50, 101, 152'),
    (dict(num_layers=50, version='2'), "'1', '1.5'"),
    (dict(num_layers=50, image_shape='3,224'), 'channels,height,width'),
    (dict(num_layers=50, dtype='int8'), 'bfloat16'),
])
def test_bad_arguments_raise_value_error(kwargs, message):
    kwargs.setdefault('image_shape', '3,224,224')
    with pytest.raises(ValueError, match=message):
        resnet.get_symbol(10, **kwargs)


# -- mixed precision -----------------------------------------------------------

def test_float32_graph_has_no_casts_and_auto_is_bfloat16_on_a_bfloat16_cpu():
    fp32 = resnet.get_symbol(10, 18, '3,32,32')
    assert CAST_SUFFIX not in fp32.tojson(remove_amp_cast=False)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # 'auto' stays float32 here: said once per process
        auto = resnet.get_symbol(10, 18, '3,32,32', dtype='auto', ctx=mx.cpu())
    expected = 'bfloat16' if hardware.computes_bfloat16() else 'float32'
    same = resnet.get_symbol(10, 18, '3,32,32', dtype=expected, ctx=mx.cpu())
    assert auto.tojson(remove_amp_cast=False) == same.tojson(remove_amp_cast=False)


@pytest.mark.parametrize('dtype, ctx', TARGETS)
def test_low_precision_graph_passes_check_graph(dtype, ctx):
    sym = resnet.get_symbol(1000, 50, '3,224,224', dtype=dtype, version='1', ctx=ctx)
    # get_symbol builds bfloat16 graphs for this machine's CPU class.
    policy = make_policy(dtype, ctx=ctx, cpu_class='auto')
    assert check_graph(sym, policy, shapes={'data': (1, 3, 224, 224)}) == []
    if dtype == 'bfloat16':
        # The bfloat16 policy is the same with or without a CPU context.
        assert check_graph(sym, make_policy(dtype, ctx=mx.cpu(), cpu_class='auto'),
                           shapes={'data': (1, 3, 224, 224)}) == []
    declared, outputs = _declared_types(sym)
    assert outputs == ['float32']
    assert declared['data'] == 'float32' and declared['softmax_label'] == 'float32'
    for name, precision in declared.items():
        if name in INPUTS:
            continue
        if '_bn' in name or name.startswith('bn'):
            assert precision == 'float32', name
        else:
            # Convolution and fc1 weights (fc1_bias too): stored in low precision.
            assert precision == dtype, name
    assert {n for n, p in declared.items() if p == dtype} >= {'conv0_weight', 'fc1_weight',
                                                              'stage4_unit3_conv3_weight'}


def test_bfloat16_graph_is_what_convert_model_makes_of_an_fp32_checkpoint():
    # So FP32 checkpoints of the network load into the bfloat16 network once
    # converted, and the bfloat16 network computes what the FP32 one does.
    fp32 = resnet.get_symbol(10, 18, '3,32,32')
    arg_shapes, _, aux_shapes = fp32.infer_shape(data=(4, 3, 32, 32))
    mx.random.seed(3)
    args = {n: mx.nd.random.normal(0, 0.05, shape=s)
            for n, s in zip(fp32.list_arguments(), arg_shapes) if n not in INPUTS}
    auxs = {n: (mx.nd.ones(s) if n.endswith('var') else mx.nd.zeros(s))
            for n, s in zip(fp32.list_auxiliary_states(), aux_shapes)}
    conv_sym, conv_args, conv_auxs = mxamp.convert_model(fp32, args, auxs, 'bfloat16',
                                                         cpu_class='auto')
    bf16 = resnet.get_symbol(10, 18, '3,32,32', dtype='bfloat16')
    assert conv_sym.tojson(remove_amp_cast=False) == bf16.tojson(remove_amp_cast=False)
    assert conv_args['conv0_weight'].dtype == BFLOAT16

    data = mx.nd.random.uniform(-1, 1, shape=(4, 3, 32, 32))
    label = mx.nd.zeros((4,))
    outputs = []
    for sym, a, x in ((fp32, args, auxs), (bf16, conv_args, conv_auxs)):
        exe = sym.bind(mx.cpu(), dict(a, data=data, softmax_label=label), aux_states=x,
                       grad_req='null')
        outputs.append(exe.forward(is_train=False)[0].asnumpy())
    np.testing.assert_allclose(outputs[1], outputs[0], atol=0.02)


def test_float32_init_fills_low_precision_arrays_like_fp32():
    desc = mx.init.InitDesc('stage1_unit1_conv1_weight')
    init = symbols.Float32Init(mx.init.Xavier(magnitude=2))
    arrays = {}
    for precision, dtype in (('float32', np.float32), ('bfloat16', BFLOAT16),
                             ('float16', np.float16)):
        arrays[precision] = mx.nd.zeros((64, 64, 3, 3), dtype=dtype)
        mx.random.seed(11)
        init(desc, arrays[precision])
    reference = arrays['float32'].asnumpy()
    assert reference.std() > 0
    np.testing.assert_allclose(to_float32_numpy(arrays['bfloat16']), reference, rtol=2 ** -8)
    # float16 rounds exactly as numpy does (also the subnormals of small weights).
    np.testing.assert_array_equal(arrays['float16'].asnumpy(), reference.astype(np.float16))


# -- training with Module ------------------------------------------------------

def _random_batch(batch_size, shape, num_classes, seed):
    rng = np.random.RandomState(seed)
    data = rng.uniform(-1, 1, (batch_size,) + shape).astype(np.float32)
    label = rng.randint(0, num_classes, batch_size).astype(np.float32)
    return mx.io.DataBatch([mx.nd.array(data)], [mx.nd.array(label)]), label.astype(int)


def _bound_module(sym, batch_size, shape, label_name):
    mod = mx.mod.Module(sym, context=mx.cpu(), label_names=[label_name])
    mod.bind(data_shapes=[('data', (batch_size,) + shape)],
             label_shapes=[(label_name, (batch_size,))])
    mx.random.seed(5)
    mod.init_params(symbols.Float32Init(mx.init.Xavier(rnd_type='gaussian', magnitude=2)))
    return mod


def _weights(mod, *names):
    args, _ = mod.get_params()
    return {name: to_float32_numpy(args[name]) for name in names}


def test_bfloat16_resnet18_trains_with_module():
    batch_size, shape, classes = 8, (1, 8, 8), 4
    sym = resnet.get_symbol(classes, 18, '1,8,8', dtype='bfloat16', ctx=mx.cpu())
    mod = _bound_module(sym, batch_size, shape, 'softmax_label')
    args, _ = mod.get_params()
    assert args['conv0_weight'].dtype == BFLOAT16 and args['bn0_gamma'].dtype == np.float32
    mod.init_optimizer(optimizer=mxamp.optimizer.create(
        'sgd', learning_rate=0.02, momentum=0.9, multi_precision=True,
        rescale_grad=1.0 / batch_size))
    batch, label = _random_batch(batch_size, shape, classes, seed=0)
    before = _weights(mod, 'conv0_weight', 'fc1_weight', 'bn0_gamma')
    losses = []
    for _ in range(8):
        mod.forward(batch, is_train=True)
        probs = mod.get_outputs()[0].asnumpy()
        losses.append(-np.log(probs[np.arange(batch_size), label] + 1e-12).mean())
        mod.backward()
        mod.update()
    assert np.isfinite(losses).all()
    assert min(losses[-3:]) < losses[0] * 0.7, losses
    after = _weights(mod, 'conv0_weight', 'fc1_weight', 'bn0_gamma')
    for name in before:
        assert np.abs(after[name] - before[name]).max() > 1e-3, name
    # The master weights the optimizer updates are FP32 copies of the bfloat16 weights.
    master = mod._updater.states[mod._exec_group.param_names.index('conv0_weight')][0]
    assert master.dtype == np.float32


def test_float16_on_cpu_trains_with_loss_scaler():
    # LossScaler needs head gradients, which SoftmaxOutput ignores: take the
    # FP32 network's logits, put a per-sample cross-entropy on them, convert.
    batch_size, shape, classes = 8, (1, 8, 8), 4
    logits = resnet.get_symbol(classes, 18, '1,8,8').get_internals()['fc1_output']
    loss = -mx.sym.pick(mx.sym.log_softmax(logits), mx.sym.var('label'), axis=1)
    sym = symbols.with_dtype(loss, 'float16', ctx=mx.cpu(), inputs=('data', 'label'))
    assert check_graph(sym, make_policy('float16', ctx=mx.cpu())) == []
    mod = _bound_module(sym, batch_size, shape, 'label')
    assert mod.get_params()[0]['conv0_weight'].dtype == np.float16
    mod.init_optimizer(optimizer=mxamp.optimizer.create(
        'sgd', learning_rate=0.02, momentum=0.9, rescale_grad=1.0 / batch_size))
    # Small enough that random-data gradients fit float16 after a backoff or two.
    scaler = mxamp.trainer.LossScaler(init_scale=2.0 ** 10)
    batch, _ = _random_batch(batch_size, shape, classes, seed=0)
    before = _weights(mod, 'conv0_weight', 'fc1_weight')
    losses, applied = [], []
    for _ in range(8):
        mod.forward(batch, is_train=True)
        losses.append(float(mod.get_outputs()[0].asnumpy().mean()))
        mod.backward(scaler.out_grads(mod.get_outputs()))
        applied.append(scaler.update_module(mod))
    assert sum(applied) >= 4, (applied, scaler)
    assert np.isfinite(losses).all()
    assert min(losses[-3:]) < losses[0] * 0.7, losses
    after = _weights(mod, 'conv0_weight', 'fc1_weight')
    for name in before:
        assert np.abs(after[name] - before[name]).max() > 1e-3, name
