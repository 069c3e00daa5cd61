"""MXNet contrib.amp's spellings work in mxamp with contrib.amp's meaning (`mxamp.migration`).

Where contrib.amp itself can convert a graph (its pass runs on any machine),
mxamp's result is compared with contrib.amp's, node by node; the calls are
written as contrib.amp's documentation writes them.  Also here: the
policy's lists (`mxamp.policy_lists`, contrib.amp's ``list_*_ops``), the
policy options behind ``target_dtype_ops`` and ``conditional_fp32_ops``, and
`mxamp.convert_with_record`.
"""
import json
import warnings

import numpy as np
import pytest

import mxnet as mx
from mxnet.contrib import amp as contrib_amp

import mxamp
from mxamp import hardware
from mxamp import policy as policy_mod
from mxamp.dtypes import BFLOAT16, name_of_array, to_float32_numpy
from mxamp.migration import from_contrib_amp
from mxamp.policy import Policy, Rules, policy_lists

from test_graph import params_of, small_cnn

DTYPES = ['float16', 'bfloat16']


def contrib_amp_precision(symbol, dtype, **options):
    """{node: dtype name of its output} in contrib.amp's conversion of `symbol`."""
    converted = contrib_amp.convert_symbol(symbol, dtype, **options)
    internals = converted.get_internals()
    inputs = {name: 'float32' for name in ('data', 'softmax_label') if name in symbol.list_arguments()}
    _, types, _ = internals.infer_type_partial(**inputs)
    nodes = {n['name'] for n in json.loads(symbol.tojson())['nodes'] if n['op'] != 'null'}
    precision = {}
    for output, dtype_ in zip(internals.list_outputs(), types):
        node = output[:-len('_output')]
        if node in nodes:
            precision[node] = 'bfloat16' if np.dtype(dtype_) == BFLOAT16 else np.dtype(dtype_).name
    return precision


def precision(symbol, dtype, **options):
    return mxamp.convert_with_record(symbol, dtype, **options).conversion.node_precision


def soft_net():
    """conv -> softrelu -> dense: contrib.amp's default conditional op, after a low-precision op."""
    x = mx.sym.Convolution(mx.sym.var('data'), kernel=(3, 3), num_filter=16, name='conv0')
    x = mx.sym.Activation(x, act_type='softrelu', name='act0')
    return mx.sym.FullyConnected(x, num_hidden=10, name='fc')


# --------------------------------------------------------------------------
# Each keyword, with contrib.amp's observable meaning

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('options', [
    {},
    {'target_dtype_ops': ['Convolution'], 'fp32_ops': ['FullyConnected']},
    {'excluded_sym_names': ['conv0']},
    {'conditional_fp32_ops': [('Activation', 'act_type', ['relu'])]},
    # contrib.amp's fp32_ops replaces its FP32 list, so the softmax output must be named
    # (test_fp32_ops_adds_to_the_float32_list).
    {'fp32_ops': ['Pooling', 'SoftmaxOutput']},
], ids=['defaults', 'target_dtype_ops+fp32_ops', 'excluded_sym_names', 'conditional_fp32_ops',
        'fp32_ops'])
def test_each_node_runs_where_contrib_amp_runs_it(dtype, options):
    symbol = small_cnn()
    expected = contrib_amp_precision(symbol, dtype, **options)
    assert precision(symbol, dtype, **options) == expected
    # The same keywords through convert_symbol give the same graph.
    with_keywords = mxamp.convert_symbol(symbol, target_dtype=dtype, **options)
    assert with_keywords.tojson() == mxamp.convert_with_record(symbol, dtype, **options).symbol.tojson()


def test_fp32_ops_adds_to_the_float32_list():
    # The one deliberate difference: contrib.amp would run the SoftmaxOutput
    # left out of its replaced list in float16 (and fail on its FP32 label).
    got = precision(small_cnn(), 'float16', fp32_ops=['Pooling'])
    assert (got['pool0'], got['softmax'], got['fc']) == ('float32', 'float32', 'float16')


@pytest.mark.parametrize('dtype', DTYPES)
def test_target_dtype_is_dtype(dtype):
    symbol = small_cnn()
    assert (mxamp.convert_symbol(symbol, target_dtype=dtype).tojson()
            == mxamp.convert_symbol(symbol, dtype).tojson())
    args, auxs = params_of(symbol)
    _, c_args, _ = mxamp.convert_model(symbol, args, auxs, target_dtype=dtype)
    assert name_of_array(c_args['conv0_weight']) == dtype


@pytest.mark.parametrize('dtype', DTYPES)
def test_target_dtype_ops_replaces_the_low_precision_list(dtype):
    symbol = small_cnn()
    # Without fp32_ops too (contrib.amp then fails in MXNet's type inference:
    # the dense layer follows its low-precision input, its weights stay FP32).
    only_conv = precision(symbol, dtype, target_dtype_ops=['Convolution'])
    assert (only_conv['conv0'], only_conv['conv1'], only_conv['fc']) == (dtype, dtype, 'float32')
    assert precision(symbol, dtype)['fc'] == dtype
    # An operator mxamp does not run in low precision by itself is forced there:
    # a Pooling reading the FP32 input follows it into FP32 unless listed.
    pooled = mx.sym.FullyConnected(mx.sym.Pooling(mx.sym.var('data'), kernel=(2, 2), name='pool'),
                                   num_hidden=4, name='fc')
    assert precision(pooled, dtype)['pool'] == 'float32'
    assert precision(pooled, dtype, target_dtype_ops=['FullyConnected', 'Pooling'])['pool'] == dtype


def test_target_dtype_ops_leaves_batchnorm_following_its_data():
    # contrib.amp lists BatchNorm among the ops that run in either precision, as
    # mxamp runs it in its data's: naming only Convolution keeps it there.
    assert precision(small_cnn(), 'float16', target_dtype_ops=['Convolution'])['bn0'] == 'float16'


@pytest.mark.parametrize('dtype', DTYPES)
def test_conditional_fp32_ops_in_the_tutorial_form(dtype):
    symbol = soft_net()
    tutorial = [('Activation', 'act_type', ['softrelu'])]
    assert precision(symbol, dtype, conditional_fp32_ops=tutorial)['act0'] == 'float32'
    assert precision(symbol, dtype, conditional_fp32_ops=tutorial) == contrib_amp_precision(
        symbol, dtype, conditional_fp32_ops=tutorial)
    # mxamp's own conditions stay: softrelu is FP32 without the keyword too.
    assert precision(symbol, dtype)['act0'] == 'float32'


def test_excluded_sym_names_keeps_nodes_in_fp32_and_is_named_in_errors():
    got = precision(small_cnn(), 'bfloat16', excluded_sym_names=['conv0', 'fc'])
    assert (got['conv0'], got['fc'], got['conv1']) == ('float32', 'float32', 'bfloat16')
    with pytest.raises(ValueError, match=r"^excluded_sym_names: 'conv9' \(did you mean 'conv\d'\?\) "
                                         r"matches no node of the graph$"):
        mxamp.convert_symbol(small_cnn(), 'bfloat16', excluded_sym_names=['conv9'])
    with pytest.raises(ValueError, match="^excluded_sym_names: expected a list of node names, got 'conv0'"):
        mxamp.convert_symbol(small_cnn(), 'bfloat16', excluded_sym_names='conv0')


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('cast_optional_params', [False, True])
def test_cast_optional_params_stores_parameters_as_contrib_amp_does(dtype, cast_optional_params):
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    _, want_args, want_auxs = contrib_amp.convert_model(symbol, dict(args), dict(auxs), dtype,
                                                        cast_optional_params=cast_optional_params)
    _, got_args, got_auxs = mxamp.convert_model(symbol, args, auxs, target_dtype=dtype,
                                                cast_optional_params=cast_optional_params)
    for want, got in ((want_args, got_args), (want_auxs, got_auxs)):
        assert {n: name_of_array(v) for n, v in got.items()} == {n: name_of_array(v) for n, v in want.items()}


def test_cast_optional_params_false_runs_like_the_stored_model():
    # Every parameter stays FP32 and the graph casts it: the same model, up to
    # where float16 rounding happens.
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    data = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (2, 16, 8, 8)))
    outputs = []
    for cast in (None, False):
        converted, c_args, c_auxs = mxamp.convert_model(symbol, args, auxs, 'float16', ctx=mx.cpu(),
                                                        cast_optional_params=cast)
        executor = converted.bind(mx.cpu(), args=dict(c_args, data=data, softmax_label=mx.nd.zeros(2)),
                                  aux_states=dict(c_auxs), grad_req='null')
        outputs.append(to_float32_numpy(executor.forward()[0]))
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=0, atol=2e-3)


def test_data_names_with_cast_optional_params_declares_the_other_variables():
    symbol = small_cnn()
    parameters = [n for n in symbol.list_arguments() + symbol.list_auxiliary_states()
                  if n not in ('data', 'softmax_label')]
    declared = mxamp.convert_symbol(symbol, 'float16', data_names=['data', 'softmax_label'],
                                    cast_optional_params=True)
    assert declared.tojson() == mxamp.convert_symbol(symbol, 'float16', params=parameters).tojson()
    # Without cast_optional_params=True every variable stays an FP32 input, as in contrib.amp.
    plain = mxamp.convert_symbol(symbol, 'float16', data_names=['data', 'softmax_label'])
    assert plain.tojson() == mxamp.convert_symbol(symbol, 'float16').tojson()
    with pytest.raises(ValueError, match="^data_names: 'image' is not a variable of the graph$"):
        mxamp.convert_symbol(symbol, 'float16', data_names=['image'])


# --------------------------------------------------------------------------
# contrib.amp's documented calls

def test_the_documented_convert_model_call():
    symbol = small_cnn()
    arg_params, aux_params = params_of(symbol)
    sym, args, auxs = mxamp.convert_model(symbol, arg_params, aux_params, target_dtype='bfloat16',
                                          target_dtype_ops=['Convolution'], fp32_ops=['FullyConnected'],
                                          excluded_sym_names=['conv0'])
    stored = {n: name_of_array(v) for n, v in args.items()}
    assert (stored['conv0_weight'], stored['conv1_weight'], stored['fc_weight']) == \
        ('float32', 'bfloat16', 'float32')
    got = precision(symbol, 'bfloat16', target_dtype_ops=['Convolution'], fp32_ops=['FullyConnected'],
                    excluded_sym_names=['conv0'])
    assert got == contrib_amp_precision(symbol, 'bfloat16', target_dtype_ops=['Convolution'],
                                        fp32_ops=['FullyConnected'], excluded_sym_names=['conv0'])


def test_the_amp_tutorial_call_gets_mxamps_default_and_float16_when_named():
    # MXNet's AMP tutorial leaves target_dtype out (contrib.amp: float16; mxamp: 'auto').
    symbol = small_cnn()
    arg_params, aux_params = params_of(symbol)
    tutorial = dict(target_dtype_ops=['Convolution'], fp32_ops=['SoftmaxOutput', 'FullyConnected'],
                    cast_optional_params=True)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')         # 'auto' may stay float32 here: said once
        by_default, args, _ = mxamp.convert_model(symbol, arg_params, aux_params, **tutorial)
        auto, auto_args, _ = mxamp.convert_model(symbol, arg_params, aux_params,
                                                 target_dtype='auto', **tutorial)
    assert by_default.tojson() == auto.tojson()
    assert name_of_array(args['conv0_weight']) == name_of_array(auto_args['conv0_weight'])
    _, args, _ = mxamp.convert_model(symbol, arg_params, aux_params, target_dtype='float16', **tutorial)
    assert args['conv0_weight'].dtype == np.float16      # the tutorial's own checks
    assert args['fc_bias'].dtype == np.float32


# --------------------------------------------------------------------------
# Two spellings of one option, and bad values

@pytest.mark.parametrize('call,message', [
    (lambda s: mxamp.convert_symbol(s, 'float16', target_dtype='float16'),
     r"^convert_symbol\(\) got both dtype and target_dtype, two spellings of one option "
     r"\(target_dtype is contrib.amp's\): pass one$"),
    (lambda s: mxamp.convert_model(s, *params_of(s), dtype='bfloat16', target_dtype='float16'),
     r'^convert_model\(\) got both dtype and target_dtype'),
    (lambda s: mxamp.convert_symbol(s, 'float16', exclude=['conv0'], excluded_sym_names=['conv0']),
     r'^convert_symbol\(\) got both exclude and excluded_sym_names'),
    (lambda s: mxamp.convert_symbol(s, 'float16', params=['fc_weight'], data_names=['data']),
     r'^convert_symbol\(\) got both params and data_names'),
    (lambda s: mxamp.convert_model(s, *params_of(s), 'float16', cast_optional_params='yes'),
     r"^convert_model\(\): cast_optional_params='yes': expected True or False$"),
])
def test_one_option_one_spelling(call, message):
    with pytest.raises(TypeError, match=message):
        call(small_cnn())


@pytest.mark.parametrize('options,message', [
    ({'target_dtype': 'int8'}, r"^convert_symbol\(\): target_dtype='int8': expected 'float16', 'bfloat16'"),
    ({'target_dtype_ops': ['Convolution'], 'fp32_ops': ['Convolution']},
     r'^convert_symbol\(\): Convolution in both target_dtype_ops and fp32_ops'),
    ({'target_dtype_ops': ['Activation'], 'conditional_fp32_ops': [('Activation', 'act_type', ['relu'])]},
     r'^convert_symbol\(\): Activation in both target_dtype_ops and conditional_fp32_ops'),
    ({'target_dtype_ops': ['Convolutoin']}, r"^target_dtype_ops: operator 'Convolutoin' is not registered"),
    ({'target_dtype_ops': 'Convolution'}, r"^target_dtype_ops: expected a list of operator names, got the "
                                          r"string 'Convolution'$"),
    ({'conditional_fp32_ops': [('Activation', 'act_type')]},
     r"^conditional_fp32_ops: expected \(operator, attribute, values\) triples"),
    ({'conditional_fp32_ops': [('Activation', 'act_type', 'softrelu')]},
     r'^conditional_fp32_ops: expected \(operator, attribute, values\) triples'),
    ({'conditional_fp32_ops': [('Activation', 'acttype', ['softrelu'])]},
     r"^conditional_fp32_ops: operator Activation has no attribute 'acttype' \(its attributes: act_type\)$"),
    ({'conditional_fp32_ops': [('Activation', 'act_type', ['sofrelu'])]},
     r"^conditional_fp32_ops: Activation's act_type takes none of 'sofrelu' \(its values: 'relu', "),
    ({'params': ['fc_weight'], 'cast_optional_params': False},
     r'^convert_symbol\(\): params declares parameters stored in low precision'),
])
def test_bad_values_get_one_line_naming_the_keyword(options, message):
    dtype = None if 'target_dtype' in options else 'float16'
    with pytest.raises(ValueError, match=message):
        mxamp.convert_symbol(small_cnn(), dtype, **options)


def test_from_contrib_amp_returns_mxamps_options():
    options = from_contrib_amp('convert', target_dtype='bf16', target_dtype_ops=['Convolution'],
                               fp32_ops=['Softmax'], conditional_fp32_ops=[('LeakyReLU', 'act_type', ['selu', 'elu'])],
                               excluded_sym_names=['stage4_conv0'], cast_optional_params=True, ctx=mx.cpu())
    assert options.dtype == 'bf16'
    assert options.lp_ops_only == ('Convolution',)
    assert options.fp32_ops == ('SoftmaxOutput',)           # aliases are canonical
    assert options.fp32_conditions == (('LeakyReLU', 'act_type', ('elu', 'selu')),)
    assert (options.exclude, options.exclude_option) == (('stage4_conv0',), 'excluded_sym_names')
    assert options.cast_params is True and options.ctx == mx.cpu()
    plain = from_contrib_amp('convert', 'float16', exclude=['x'], lp_ops=['Pooling'])
    assert (plain.dtype, plain.exclude, plain.exclude_option, plain.lp_ops) == \
        ('float16', ['x'], 'exclude', ('Pooling',))
    assert plain.lp_ops_only is None and plain.cast_params is None


# --------------------------------------------------------------------------
# The policy options behind them

def test_policy_lp_ops_only_and_fp32_conditions():
    policy = Policy('float16', Rules.of(lp_ops_only=['Convolution', 'Pooling'],
                                        fp32_conditions=[('Activation', 'act_type', ['relu'])]))
    assert policy.op_class('Convolution') == 'low'
    assert policy.op_class('FullyConnected') == 'float32'       # in the replaced list, not named
    assert policy.op_class('Pooling', {'pool_type': 'max'}) == 'low'
    assert policy.op_class('BatchNorm') == 'low'                # follows its data, not replaced
    assert policy.op_class('Activation', {'act_type': 'relu'}) == 'float32'
    assert policy.op_class('Activation', {'act_type': 'tanh'}) == 'neutral'
    assert policy.op_class('Activation', {'act_type': 'softrelu'}) == 'float32'    # the policy's own
    # lp_ops still forces an operator the replaced list leaves out.
    assert Policy('float16', Rules.of(lp_ops=['FullyConnected'], lp_ops_only=['Convolution'])).op_class(
        'FullyConnected') == 'low'
    assert 'fp32_conditions=[(' in repr(policy)


@pytest.mark.parametrize('rules,message', [
    ({'lp_ops': ['Activation'], 'fp32_conditions': [('Activation', 'act_type', ['relu'])]},
     '^operators both in fp32_conditions and forced to low precision: Activation$'),
    ({'lp_ops_only': ['Activation'], 'fp32_conditions': [('Activation', 'act_type', ['relu'])]},
     '^operators both in fp32_conditions and in lp_ops_only: Activation$'),
    ({'fp32_ops': ['FullyConnected'], 'lp_ops_only': ['FullyConnected']},
     '^operators both in fp32_ops and in lp_ops_only: FullyConnected$'),
    ({'fp32_ops': ['Pooling'], 'lp_ops': ['Pooling']},
     '^operators both forced to FP32 and to low precision: Pooling$'),
    ({'lp_ops_only': ['Convolutoin']}, "^lp_ops_only: operator 'Convolutoin' is not registered"),
    ({'fp32_conditions': [('Activation', 'act_type')]},
     r'^fp32_conditions: expected \(operator, attribute, values\) triples'),
])
def test_rules_refuse_contradictions_naming_the_rules(rules, message):
    with pytest.raises(ValueError, match=message):
        Rules.of(**rules)


def test_rules_are_canonical_tuples():
    rules = Rules.of(fp32_ops=['Softmax'], lp_ops=None, exclude=['fc*'],
                     fp32_conditions=[('LeakyReLU', 'act_type', ['selu', 'elu'])])
    assert rules == Rules(('SoftmaxOutput',), (), ('fc*',), None,
                          (('LeakyReLU', 'act_type', ('elu', 'selu')),))
    assert Rules.of() == Rules()


def test_default_lp_ops_is_what_target_dtype_ops_replaces():
    assert policy_mod.default_lp_ops('bfloat16') == {'Convolution', '_mxamp_convolution', 'Deconvolution',
                                                     'FullyConnected'}
    assert set(contrib_amp.list_lp16_ops('float16')) <= policy_mod.default_lp_ops('float16')
    assert 'BatchNorm' not in policy_mod.default_lp_ops('float16')


# --------------------------------------------------------------------------
# policy_lists: contrib.amp's list_*_ops

@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('cpu_class', hardware.CPU_CLASSES)
def test_policy_lists_partition_the_operators_as_the_policy_decides(dtype, cpu_class):
    lists = policy_lists(dtype, cpu_class=cpu_class)
    assert (lists.dtype, lists.cpu_class) == (dtype, cpu_class)
    classes = {'low': lists.low, 'float32': lists.float32, 'widest': lists.widest, 'neutral': lists.neutral}
    forward = sorted(op for op in set(policy_mod.registered_ops().values())
                     if not op.startswith(('_backward', '_npi_backward')))
    assert sorted(sum(classes.values(), ())) == forward                 # each operator exactly once
    policy = Policy(dtype, cpu_class=cpu_class)
    conditional = {op for op, _, _ in lists.conditional}
    for cls, ops in classes.items():
        assert list(ops) == sorted(ops) and isinstance(ops, tuple)
        for op in ops:
            if op not in conditional:
                assert policy.op_class(op, {}) == cls, op
    # Each condition puts its values, and only those, in FP32 (a bfloat16
    # Pooling needs an explicit kernel: the docstring says so).
    for op, attribute, values in lists.conditional:
        for value in policy_mod.attributes(op)[attribute]:
            attrs = {'kernel': '(2, 2)', attribute: value}
            assert (policy.op_class(op, attrs) == 'float32') == (value in values), (op, attribute, value)
    assert lists.computes_in_dtype == (dtype == 'float16' or hardware.computes_bfloat16(cpu_class))
    with pytest.raises(AttributeError):
        lists.low = ()                                                   # immutable


def test_policy_lists_answer_contrib_amps_lists():
    float16, bfloat16 = policy_lists('float16'), policy_lists('bf16')
    assert set(contrib_amp.list_lp16_ops('float16')) <= set(float16.low)
    assert set(contrib_amp.list_lp16_ops(contrib_amp.amp.bfloat16)) <= set(bfloat16.low)
    assert {'softmax', 'SoftmaxOutput', 'LayerNorm', 'sum', 'exp'} <= set(float16.float32)
    assert {'Concat', 'elemwise_add', 'add_n'} <= set(float16.widest)
    assert {'relu', 'Flatten', 'Reshape', 'Activation', 'Pooling'} <= set(float16.neutral)
    assert ('Activation', 'act_type', ('softrelu',)) in float16.conditional
    assert ('LeakyReLU', 'act_type', ('elu', 'gelu', 'selu')) in float16.conditional
    # Under bfloat16 also the attribute values oneDNN has no bfloat16 kernel for.
    assert ('Activation', 'act_type', ('softrelu', 'softsign')) in bfloat16.conditional
    assert ('Pooling', 'pooling_convention', ('same',)) in bfloat16.conditional
    # The conditions read back as conditional_fp32_ops.
    assert precision(soft_net(), 'float16', conditional_fp32_ops=float16.conditional)['act0'] == 'float32'


def test_policy_lists_default_to_this_cpu_and_refuse_unknown_names():
    assert policy_lists('bfloat16').cpu_class == hardware.cpu_class()
    assert policy_lists('bfloat16', cpu_class='auto') == policy_lists('bfloat16')
    assert not policy_lists('bfloat16', cpu_class='avx2').computes_in_dtype
    assert policy_lists('bfloat16', cpu_class='amx').computes_in_dtype
    with pytest.raises(ValueError, match="^unknown dtype 'float32': expected one of 'float16', 'bfloat16'$"):
        policy_lists('float32')
    with pytest.raises(ValueError, match="^unknown dtype 'int8'"):
        policy_lists('int8')
    with pytest.raises(ValueError, match=r"^cpu_class='avx9': expected None, 'auto' or one of avx2, "):
        policy_lists('bfloat16', cpu_class='avx9')


# --------------------------------------------------------------------------
# One function, one return type: convert_with_record

def test_convert_with_record_returns_what_convert_model_and_convert_symbol_return_and_the_record():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    record = mxamp.convert_with_record(symbol, 'bfloat16', arg_params=args, aux_params=auxs)
    assert isinstance(record, mxamp.ConversionResult)
    model = mxamp.convert_model(symbol, args, auxs, 'bfloat16')
    assert record.symbol.tojson() == model[0].tojson()
    assert sorted(record.arg_params) == sorted(model[1]) and sorted(record.aux_params) == sorted(model[2])
    assert 'conv0' in record.conversion.node_precision
    graph_only = mxamp.convert_with_record(symbol, 'bfloat16')
    assert graph_only.arg_params is None and graph_only.aux_params is None
    assert graph_only.symbol.tojson() == mxamp.convert_symbol(symbol, 'bfloat16').tojson()
    assert 'conv0' in graph_only.conversion.node_precision
    with warnings.catch_warnings():
        warnings.simplefilter('error')      # the call warns about nothing
        assert mxamp.convert_with_record(symbol, 'float32').conversion is None


def test_convert_with_record_defaults_to_auto_and_refuses_options_that_do_not_apply():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')         # 'auto' may stay float32 here: said once
        assert (mxamp.convert_with_record(symbol, ctx=mx.cpu()).symbol.tojson()
                == mxamp.convert_with_record(symbol, 'auto', ctx=mx.cpu()).symbol.tojson())
    with pytest.raises(TypeError, match=r'^convert_with_record\(\): params applies without arg_params'):
        mxamp.convert_with_record(symbol, 'bfloat16', arg_params=args, aux_params=auxs, params=['fc_weight'])
    with pytest.raises(TypeError, match=r'^convert_with_record\(\): for_inference applies to a checkpoint'):
        mxamp.convert_with_record(symbol, 'bfloat16', for_inference=True)
    with pytest.raises(TypeError, match=r'^convert_with_record\(\): aux_params applies to a checkpoint'):
        mxamp.convert_with_record(symbol, 'bfloat16', aux_params=auxs)


# --------------------------------------------------------------------------
# The Gluon front: contrib.amp.convert_hybrid_block's keywords on mxamp.convert

def gluon_net():
    """conv -> softrelu -> dense, as `soft_net`, as a Gluon net (nodes conv0_fwd, act0_fwd, dense0_fwd)."""
    net = mx.gluon.nn.HybridSequential(prefix='')
    with net.name_scope():
        net.add(mx.gluon.nn.Conv2D(16, 3, in_channels=3, prefix='conv0_'),
                mx.gluon.nn.Activation('softrelu', prefix='act0_'),
                mx.gluon.nn.Dense(10, in_units=16 * 6 * 6, prefix='dense0_'))
    net.initialize()
    return net


def gluon_precision(net):
    net(mx.nd.ones((2, 3, 8, 8)))
    return mxamp.gluon.conversion_of(net)[0].node_precision


@pytest.mark.parametrize('dtype', DTYPES)
def test_convert_takes_convert_hybrid_blocks_keywords_with_the_symbol_fronts_meaning(dtype):
    options = dict(target_dtype_ops=['Convolution'], fp32_ops=['FullyConnected'],
                   conditional_fp32_ops=[('Activation', 'act_type', ['relu'])])
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net = mxamp.convert(gluon_net(), target_dtype=dtype, **options)
        found = gluon_precision(net)
        symbol = gluon_net()(mx.sym.var('data'))
        # The Gluon front decides for this CPU, as the Symbol front does with cpu_class='auto'.
        expected = precision(symbol, dtype, cpu_class='auto', **options)
    assert {k: found[k] for k in expected} == expected
    assert found['dense0_fwd'] == 'float32'


def test_convert_hybrid_block_call_as_documented():
    # contrib.amp: net = amp.convert_hybrid_block(net, target_dtype='float16', ctx=ctx)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net = mxamp.convert(gluon_net(), target_dtype='float16', ctx=mx.cpu(1),
                            cast_optional_params=True)
    assert mxamp.gluon.is_converted(net)
    assert net[0].weight.list_ctx() == [mx.cpu(1)]
    assert name_of_array(net[0].weight.data(mx.cpu(1))) == 'float16'
    assert net(mx.nd.ones((2, 3, 8, 8), ctx=mx.cpu(1))).shape == (2, 10)


def test_convert_excluded_sym_names_and_conditions():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net = mxamp.convert(gluon_net(), target_dtype='float16', excluded_sym_names=['conv0_fwd'])
        assert gluon_precision(net)['conv0_fwd'] == 'float32'
        net = mxamp.convert(gluon_net(), 'float16',
                            conditional_fp32_ops=[('Activation', 'act_type', ['softrelu'])])
        assert gluon_precision(net)['act0_fwd'] == 'float32'
    with pytest.raises(ValueError, match=r"excluded_sym_names='nothing_fwd' matches no block"):
        mxamp.convert(gluon_net(), 'float16', excluded_sym_names=['nothing_fwd'])


def test_convert_refuses_what_it_cannot_honour_in_one_line():
    with pytest.raises(TypeError, match='target_dtype'):
        mxamp.convert(gluon_net(), 'float16', target_dtype='bfloat16')
    with pytest.raises(TypeError, match='excluded_sym_names'):
        mxamp.convert(gluon_net(), 'float16', exclude=['conv0_fwd'], excluded_sym_names=['conv0_fwd'])
    with pytest.raises(ValueError, match='cast_optional_params=False is not supported'):
        mxamp.convert(gluon_net(), target_dtype='float16', cast_optional_params=False)
    net = gluon_net()
    with pytest.raises(ValueError, match="Convolution"):
        mxamp.convert(net, 'float16', target_dtype_ops=['Convolution'], fp32_ops=['Convolution'])
    assert not mxamp.gluon.is_converted(net)      # nothing was touched


def test_a_child_joins_only_a_tree_converted_with_the_same_contrib_amp_rules():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net = mxamp.convert(gluon_net(), 'float16', target_dtype_ops=['Convolution'])
        same = mxamp.convert(mx.gluon.nn.HybridSequential(), 'float16', target_dtype_ops=['Convolution'])
        net.add(same)
        other = mxamp.convert(mx.gluon.nn.HybridSequential(), 'float16')
    with pytest.raises(ValueError, match=r"other settings \(float16\) than .*target_dtype_ops=\['Convolution'\]"):
        net.add(other)
