"""The Symbol-API networks of ``symbols/``: structure, mixed-precision rewrite, training."""
import collections
import os
import sys
import warnings

import numpy as np
import pytest

import mxnet as mx

import mxamp
from conftest import CORPUS, corpus_rows, input_shapes, require_corpus
from mxamp import hardware
from mxamp.dtypes import BFLOAT16, dtype_name, to_float32_numpy
from mxamp.graph import CAST_SUFFIX
from mxamp.graph_check import check_graph
from mxamp.symbol import ParameterError, SymbolOptions, make_policy

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
    expected = 'bfloat16' if hardware.bfloat16_pays() else 'float32'
    same = resnet.get_symbol(10, 18, '3,32,32', dtype=expected, ctx=mx.cpu())
    assert auto.tojson(remove_amp_cast=False) == same.tojson(remove_amp_cast=False)


@pytest.mark.parametrize('dtype, ctx', TARGETS)
def test_low_precision_graph_passes_check_graph(dtype, ctx):
    sym = resnet.get_symbol(1000, 50, '3,224,224', dtype=dtype, version='1', ctx=ctx)
    # get_symbol builds bfloat16 graphs for this machine's CPU class.
    policy = make_policy(SymbolOptions(dtype, ctx=ctx, cpu_class='auto'))
    assert check_graph(sym, policy, shapes={'data': (1, 3, 224, 224)}) == []
    if dtype == 'bfloat16':
        # The bfloat16 policy is the same with or without a CPU context.
        assert check_graph(sym, make_policy(SymbolOptions(dtype, ctx=mx.cpu(), cpu_class='auto')),
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


# -- parameters checked against the graph -------------------------------------

def _checkpoint(sym, data_shape=(1, 3, 224, 224)):
    """Zero parameters of the shapes `sym` gives them for `data_shape` (values are not read)."""
    arg_shapes, _, aux_shapes = sym.infer_shape(data=data_shape)
    args = {n: mx.nd.zeros(s) for n, s in zip(sym.list_arguments(), arg_shapes) if n not in INPUTS}
    auxs = {n: mx.nd.zeros(s) for n, s in zip(sym.list_auxiliary_states(), aux_shapes)}
    return args, auxs


@pytest.fixture(scope='module')
def resnet18():
    sym = resnet.get_symbol(1000, 18, '3,224,224')
    return (sym,) + _checkpoint(sym)


@pytest.mark.parametrize('name, shape, message', [
    # A 10-class classifier for the 1000-class graph, found without any input shape.
    ('fc1_weight', (10, 512), "parameter 'fc1_weight' has shape (10, 512); node 'fc1' "
                              "(FullyConnected) needs (1000, 512)"),
    ('fc1_bias', (10,), "parameter 'fc1_bias' has shape (10,); node 'fc1' (FullyConnected) "
                        "needs (1000,)"),
    # Input channels of a convolution: what the previous layer gives.
    ('stage3_unit1_conv1_weight', (256, 64, 3, 3),
     "'stage3_unit1_conv1_weight' has shape (256, 64, 3, 3); node 'stage3_unit1_conv1' "
     "(Convolution) needs (256, 128, 3, 3)"),
    ('stage4_unit2_bn1_moving_var', (256,), "needs (512,)"),
    # The stem reads the image: its input channels are the image's, any number.
    ('conv0_weight', (64, 3, 5, 5), "'conv0_weight' has shape (64, 3, 5, 5); node 'conv0' "
                                    "(Convolution) needs (64, ?, 7, 7)"),
])
def test_parameter_shapes_are_checked_without_input_shapes(resnet18, name, shape, message):
    sym, args, auxs = resnet18
    args, auxs = dict(args), dict(auxs)
    (auxs if name in auxs else args)[name] = mx.nd.zeros(shape)
    with pytest.raises(ParameterError) as err:
        mxamp.convert_model(sym, args, auxs, 'bfloat16')
    assert message in str(err.value)


def test_a_grayscale_stem_is_not_a_wrong_shape(resnet18):
    # The probes vary every dimension of the image but the batch, so the stem's
    # input channels are the parameters' to choose.
    sym = resnet.get_symbol(1000, 18, '1,224,224')
    args, auxs = _checkpoint(sym, (1, 1, 224, 224))
    _, c_args, _ = mxamp.convert_model(sym, args, auxs, 'float16')
    assert c_args['conv0_weight'].shape == (64, 1, 7, 7)


def test_missing_parameters_are_refused_unless_allowed(resnet18):
    sym, args, auxs = resnet18
    partial = {k: v for k, v in args.items() if k != 'conv0_weight'}
    with pytest.raises(ParameterError, match=r"^parameter 'arg:conv0_weight' is missing "
                                             r"\(allow_missing=True converts without it\)$"):
        mxamp.convert_model(sym, partial, auxs, 'bfloat16', input_shapes={'data': (1, 3, 224, 224)})
    no_stats = {k: v for k, v in auxs.items() if not k.startswith('stage1')}
    with pytest.raises(ParameterError, match=r"parameters 'aux:stage1_unit1_bn1_moving_mean', .* and "
                                             r"\d+ more are missing \(allow_missing=True converts "
                                             r"without them\)"):
        mxamp.convert_model(sym, args, no_stats, 'bfloat16')
    converted, c_args, _ = mxamp.convert_model(sym, partial, auxs, 'bfloat16', allow_missing=True)
    # The missing weight stays an FP32 variable of the graph; the others are bfloat16.
    declared = dict(zip(converted.list_arguments(),
                        converted.infer_type(data='float32', softmax_label='float32')[0]))
    assert dtype_name(declared['conv0_weight']) == 'float32'
    assert 'conv0_weight' not in c_args and c_args['fc1_weight'].dtype == BFLOAT16


def test_names_that_match_nothing_are_refused_naming_the_option(resnet18):
    sym, args, auxs = resnet18
    with pytest.raises(ValueError, match=r"^input_shapes: 'image' is not an input of the graph "
                                         r"\(its inputs: 'data', 'softmax_label'\)$"):
        mxamp.convert_model(sym, args, auxs, 'bfloat16', input_shapes={'image': (1, 3, 224, 224)})
    with pytest.raises(ValueError, match=r"^exclude: 'stgae4\*' \(did you mean 'stage4\*'\?\), "
                                         r"'nosuchnode' match no node of the graph$"):
        mxamp.convert_model(sym, args, auxs, 'bfloat16', exclude=['stgae4*', 'nosuchnode'])
    with pytest.raises(ValueError, match=r"^exclude: 'fc1_weight' matches no node"):
        mxamp.convert_symbol(sym, 'float16', exclude=['fc1_weight'])     # a variable, not a node
    with pytest.raises(ValueError, match=r"^params: 'fc2_weight' is not a variable of the graph$"):
        mxamp.convert_symbol(sym, 'float16', params=['fc1_weight', 'fc2_weight'])
    with pytest.raises(ValueError, match=r"^input_types: 'tokens' is not a variable of the graph$"):
        mxamp.convert_symbol(sym, 'float16', input_types={'tokens': 'int32'})
    # Even where 'auto' leaves the graph in float32: the same call fails on every machine.
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        with pytest.raises(ValueError, match='nosuchnode'):
            mxamp.convert_model(sym, args, auxs, 'auto', exclude=['nosuchnode'], ctx=mx.cpu())
    # What does match is excluded.
    precision = mxamp.convert_with_record(sym, 'bfloat16', arg_params=args, aux_params=auxs,
                                          exclude=['stage4*', 'fc1']).conversion.node_precision
    assert {p for n, p in precision.items() if n.startswith(('stage4', 'fc1'))} == {'float32'}
    assert precision['stage3_unit2_conv2'] == 'bfloat16'


def test_dense_layers_that_disagree_are_named():
    # fc1 gives 64 features, fc2's weight reads 32; the input's 20 features are fc1's to read.
    data = mx.sym.var('data')
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=64, name='fc1'), act_type='relu')
    out = mx.sym.FullyConnected(hidden, num_hidden=10, name='fc2')
    args = {'fc1_weight': mx.nd.zeros((64, 20)), 'fc1_bias': mx.nd.zeros(64),
            'fc2_weight': mx.nd.zeros((10, 32)), 'fc2_bias': mx.nd.zeros(10)}
    with pytest.raises(ParameterError, match=r"'fc2_weight' has shape \(10, 32\); node 'fc2' "
                                             r"\(FullyConnected\) needs \(10, 64\)"):
        mxamp.convert_model(out, args, {}, 'float16')
    args['fc2_weight'] = mx.nd.zeros((10, 64))
    assert mxamp.convert_model(out, args, {}, 'float16')[1]['fc2_weight'].dtype == np.float16


@pytest.mark.parametrize('file, changed, message', [
    # The MXNet model zoo's ImageNet-11k ResNet-50 (a v0.8 file): a 10-class head.
    ('pathak-ashutosh__plant-seeds-classification__resnet-50-symbol.json', ('fc1_weight', (10, 2048)),
     "'fc1_weight' has shape (10, 2048); node 'fc1' (FullyConnected) needs (11586, 2048)"),
    ('pathak-ashutosh__plant-seeds-classification__resnet-50-symbol.json', ('conv0_weight', None),
     "parameter 'arg:conv0_weight' is missing"),
    # DenseNet: a convolution reading the concatenation of 64 + 32 channels.
    ('miraclewkf__DenseNet__densenet-121-symbol.json', ('conv2_2_x1_weight', (128, 64, 1, 1)),
     "'conv2_2_x1_weight' has shape (128, 64, 1, 1); node 'conv2_2_x1' (Convolution) needs "
     "(128, 96, 1, 1)"),
    # MobileFaceNet's embedding reads a flattened feature map: its width depends on the image size.
    ('hanson-young__mobileFacenet-ncnn__model-symbol.json', ('pre_fc1_weight', (128, 512)),
     "'pre_fc1_weight' has shape (128, 512); node 'pre_fc1' (FullyConnected) needs (512, ?)"),
])
def test_corpus_checkpoints_with_bad_parameters_are_refused(file, changed, message):
    require_corpus()
    sym = mx.sym.load(os.path.join(CORPUS, file))
    shapes = input_shapes(next(row for row in corpus_rows() if row['file'] == file))
    args, auxs = _checkpoint(sym, shapes['data'])
    # The right parameters pass, with or without input shapes.
    mxamp.symbol.check_params(sym, args, auxs)
    mxamp.symbol.check_params(sym, args, auxs, {'data': shapes['data']})
    name, shape = changed
    if shape is None:
        del args[name]
    else:
        args[name] = mx.nd.zeros(shape)
    with pytest.raises(ParameterError) as err:
        mxamp.convert_model(sym, args, auxs, 'bfloat16')
    assert message in str(err.value) and '\n' not in str(err.value)


def test_input_shapes_complete_the_check():
    # Without the image size, a dense layer reading a flattened map can have any
    # width; with it, only the right one.
    require_corpus()
    sym = mx.sym.load(os.path.join(CORPUS, 'hanson-young__mobileFacenet-ncnn__model-symbol.json'))
    args, auxs = _checkpoint(sym, (1, 3, 112, 112))
    args['pre_fc1_weight'] = mx.nd.zeros((512, 100))
    mxamp.symbol.check_params(sym, args, auxs)
    with pytest.raises(ParameterError, match=r"'pre_fc1_weight' has shape \(512, 100\); node 'pre_fc1' "
                                             r"\(FullyConnected\) needs \(512, 512\)"):
        mxamp.convert_model(sym, args, auxs, 'bfloat16', input_shapes={'data': (1, 3, 112, 112)})


def test_convert_model_reads_the_graph_once(monkeypatch):
    # One load of the JSON text, one for the type-inference probe, one for the
    # converted graph; one tojson, to read the loaded graph back.
    sym = resnet.get_symbol(10, 18, '3,32,32')
    args, auxs = _checkpoint(sym, (1, 3, 32, 32))
    text = sym.tojson()
    calls = collections.Counter()
    for owner, name in ((mx.sym, 'load_json'), (mx.sym.Symbol, 'tojson')):
        def counted(*a, _original=getattr(owner, name), _name=name, **k):
            calls[_name] += 1
            return _original(*a, **k)
        monkeypatch.setattr(owner, name, counted)
    mxamp.convert_model(text, args, auxs, 'bfloat16')
    assert calls == {'load_json': 3, 'tojson': 1}


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
    assert check_graph(sym, make_policy(SymbolOptions('float16', ctx=mx.cpu()))) == []
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
