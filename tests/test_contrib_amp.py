"""`mxamp.contrib_amp`: MXNet contrib.amp's conversion functions, names, parameters and
defaults, with contrib.amp's meaning.

Where contrib.amp itself can convert a graph (its pass runs on any machine), the result is
compared with contrib.amp's, node by node; the calls are written as contrib.amp's
documentation writes them.  Each function gives the graph and values mxamp's own call gives
where mxamp's keywords say the same; mxamp's own functions take none of contrib.amp's
keywords.  Also here: the policy's lists (`mxamp.policy_lists`, contrib.amp's
``list_*_ops``) and the `mxamp.policy.Rules` behind ``target_dtype_ops`` and
``conditional_fp32_ops``.
"""
import inspect
import json
import warnings
from unittest import mock

import numpy as np
import pytest

import mxnet as mx
from mxnet.contrib import amp as mxnet_amp

import mxamp
from mxamp import contrib_amp as amp
from mxamp import hardware
from mxamp import policy as policy_mod
from mxamp.dtypes import BFLOAT16, name_of_array, to_float32_numpy
from mxamp.policy import Policy, Rules, policy_lists
from mxamp.symbol import SymbolOptions, convert_checked

from test_graph import params_of, small_cnn

DTYPES = ['float16', 'bfloat16']
FUNCTIONS = ('convert_symbol', 'convert_model', 'convert_hybrid_block')


def contrib_amp_precision(symbol, dtype, **options):
    """{node: dtype name of its output} in MXNet contrib.amp's conversion of `symbol`."""
    converted = mxnet_amp.convert_symbol(symbol, dtype, **options)
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


def handed_over(call):
    """``(the SymbolOptions and Names that `call` handed mxamp's Symbol front, its result)``."""
    calls = []

    def recording(sym, options, names, **params):
        calls.append((options, names, convert_checked(sym, options, names, **params)))
        return calls[-1][2]
    with mock.patch.object(amp, 'convert_checked', recording):
        call()
    assert len(calls) == 1
    return calls[0]


def precision(symbol, dtype, **keywords):
    """{node: precision} of ``amp.convert_symbol(symbol, dtype, **keywords)``, as recorded."""
    return handed_over(lambda: amp.convert_symbol(symbol, dtype, **keywords))[2].conversion.node_precision


def soft_net():
    """conv -> softrelu -> dense: contrib.amp's default conditional op, after a low-precision op."""
    x = mx.sym.Convolution(mx.sym.var('data'), kernel=(3, 3), num_filter=16, name='conv0')
    x = mx.sym.Activation(x, act_type='softrelu', name='act0')
    return mx.sym.FullyConnected(x, num_hidden=10, name='fc')


# --------------------------------------------------------------------------
# contrib.amp's names, parameters and defaults; none of them on mxamp's own functions

@pytest.mark.parametrize('name', FUNCTIONS)
def test_each_function_takes_contrib_amps_parameters_in_its_order_with_its_defaults(name):
    ours = inspect.signature(getattr(amp, name)).parameters
    theirs = inspect.signature(getattr(mxnet_amp, name)).parameters
    assert list(ours) == list(theirs)
    # ctx: contrib.amp's mx.gpu(0) cannot run without a GPU; None keeps the parameters' own.
    assert {k: p.default for k, p in ours.items() if k != 'ctx'} == \
        {k: p.default for k, p in theirs.items() if k != 'ctx'}
    if name == 'convert_hybrid_block':
        assert ours['ctx'].default is None


@pytest.mark.parametrize('call', [
    lambda net, sym, args, auxs, keyword: mxamp.convert(net, 'float16', **keyword),
    lambda net, sym, args, auxs, keyword: mxamp.convert_symbol(sym, 'float16', **keyword),
    lambda net, sym, args, auxs, keyword: mxamp.convert_model(sym, args, auxs, 'float16', **keyword),
    lambda net, sym, args, auxs, keyword: mxamp.convert_with_record(sym, 'float16', **keyword),
], ids=['convert', 'convert_symbol', 'convert_model', 'convert_with_record'])
@pytest.mark.parametrize('keyword', [
    {'target_dtype': 'float16'}, {'target_dtype_ops': ['Convolution']},
    {'conditional_fp32_ops': [('Activation', 'act_type', ['relu'])]},
    {'excluded_sym_names': ['conv0']}, {'data_names': ['data']}, {'cast_optional_params': True},
], ids=lambda keyword: next(iter(keyword)))
def test_mxamps_own_functions_take_no_contrib_amp_keyword(call, keyword):
    symbol = small_cnn()
    with pytest.raises(TypeError, match="unexpected keyword argument '%s'" % next(iter(keyword))):
        call(gluon_net(), symbol, *params_of(symbol), keyword)


def test_the_defaults_are_contrib_amps_float16_and_fp32_parameters():
    symbol = small_cnn()
    assert amp.convert_symbol(symbol).tojson() == mxamp.convert_symbol(symbol, 'float16').tojson()
    args, auxs = params_of(symbol)
    _, stored, _ = amp.convert_model(symbol, args, auxs)
    assert {name_of_array(value) for value in stored.values()} == {'float32'}    # cast in the graph
    _, stored, _ = amp.convert_model(symbol, args, auxs, cast_optional_params=True)
    assert name_of_array(stored['conv0_weight']) == 'float16'
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net = amp.convert_hybrid_block(gluon_net())
        assert mxamp.gluon.conversion_of(net)[0].dtype == 'float16'


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
    assert precision(symbol, dtype, **options) == contrib_amp_precision(symbol, dtype, **options)


@pytest.mark.parametrize('dtype', DTYPES)
def test_each_function_gives_what_mxamps_own_call_gives(dtype):
    symbol = small_cnn()
    contrib = dict(fp32_ops=['Pooling'], excluded_sym_names=['conv1'])
    own = dict(fp32_ops=['Pooling'], exclude=['conv1'])
    assert (amp.convert_symbol(symbol, dtype, **contrib).tojson()
            == mxamp.convert_symbol(symbol, dtype, **own).tojson())
    args, auxs = params_of(symbol)
    got = amp.convert_model(symbol, args, auxs, dtype, cast_optional_params=True, **contrib)
    want = mxamp.convert_model(symbol, args, auxs, dtype, **own)
    assert got[0].tojson() == want[0].tojson()
    for got_params, want_params in zip(got[1:], want[1:]):
        assert sorted(got_params) == sorted(want_params)
        for name, value in want_params.items():
            assert name_of_array(got_params[name]) == name_of_array(value), name
            np.testing.assert_array_equal(to_float32_numpy(got_params[name]), to_float32_numpy(value))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        mx.random.seed(0)
        net = amp.convert_hybrid_block(gluon_net(), dtype, excluded_sym_names=['conv0_fwd'])
        mx.random.seed(0)           # the same initial values
        same = mxamp.convert(gluon_net(), dtype, exclude=['conv0_fwd'])
        x = mx.nd.ones((2, 3, 8, 8))
        np.testing.assert_array_equal(to_float32_numpy(net(x)), to_float32_numpy(same(x)))
    assert gluon_precision(net) == gluon_precision(same)
    assert {p.name: name_of_array(p.data()) for p in net.collect_params().values()} == \
        {p.name: name_of_array(p.data()) for p in same.collect_params().values()}


def test_fp32_ops_adds_to_the_float32_list():
    # The one deliberate difference: contrib.amp would run the SoftmaxOutput
    # left out of its replaced list in float16 (and fail on its FP32 label).
    got = precision(small_cnn(), 'float16', fp32_ops=['Pooling'])
    assert (got['pool0'], got['softmax'], got['fc']) == ('float32', 'float32', 'float16')


@pytest.mark.parametrize('dtype', DTYPES)
def test_target_dtype_is_dtype(dtype):
    symbol = small_cnn()
    assert (amp.convert_symbol(symbol, target_dtype=dtype).tojson()
            == mxamp.convert_symbol(symbol, dtype).tojson())
    args, auxs = params_of(symbol)
    _, c_args, _ = amp.convert_model(symbol, args, auxs, target_dtype=dtype, cast_optional_params=True)
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
        amp.convert_symbol(small_cnn(), 'bfloat16', excluded_sym_names=['conv9'])
    with pytest.raises(ValueError, match="^excluded_sym_names: expected a list of node names, got 'conv0'"):
        amp.convert_symbol(small_cnn(), 'bfloat16', excluded_sym_names='conv0')


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('cast_optional_params', [False, True])
def test_cast_optional_params_stores_parameters_as_contrib_amp_does(dtype, cast_optional_params):
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    _, want_args, want_auxs = mxnet_amp.convert_model(symbol, dict(args), dict(auxs), dtype,
                                                      cast_optional_params=cast_optional_params)
    _, got_args, got_auxs = amp.convert_model(symbol, args, auxs, target_dtype=dtype,
                                              cast_optional_params=cast_optional_params)
    for want, got in ((want_args, got_args), (want_auxs, got_auxs)):
        assert {n: name_of_array(v) for n, v in got.items()} == {n: name_of_array(v) for n, v in want.items()}


def test_cast_optional_params_false_is_options_keeping_the_parameters_fp32():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    options, _, result = handed_over(lambda: amp.convert_model(symbol, args, auxs, 'float16'))
    assert options.cast_params is False
    assert handed_over(lambda: amp.convert_model(symbol, args, auxs, 'float16',
                                                 cast_optional_params=True))[0].cast_params is True
    # Every parameter stays FP32 and the graph casts it: the same model, up to where float16
    # rounding happens (on a CPU: float16 GEMMs in FP32 between casts).
    data = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (2, 16, 8, 8)))
    outputs = []
    for cast_params in (True, False):
        converted, c_args, c_auxs, _ = convert_checked(
            symbol, SymbolOptions('float16', ctx=mx.cpu(), cast_params=cast_params),
            arg_params=args, aux_params=auxs)
        executor = converted.bind(mx.cpu(), args=dict(c_args, data=data, softmax_label=mx.nd.zeros(2)),
                                  aux_states=dict(c_auxs), grad_req='null')
        outputs.append(to_float32_numpy(executor.forward()[0]))
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=0, atol=2e-3)


def test_data_names_with_cast_optional_params_declares_the_other_variables():
    symbol = small_cnn()
    parameters = [n for n in symbol.list_arguments() + symbol.list_auxiliary_states()
                  if n not in ('data', 'softmax_label')]
    declared = amp.convert_symbol(symbol, 'float16', data_names=['data', 'softmax_label'],
                                  cast_optional_params=True)
    assert declared.tojson() == mxamp.convert_symbol(symbol, 'float16', params=parameters).tojson()
    # Without cast_optional_params=True every variable stays an FP32 input, as in contrib.amp.
    plain = amp.convert_symbol(symbol, 'float16', data_names=['data', 'softmax_label'])
    assert plain.tojson() == mxamp.convert_symbol(symbol, 'float16').tojson()
    with pytest.raises(ValueError, match="^data_names: 'image' is not a variable of the graph$"):
        amp.convert_symbol(symbol, 'float16', data_names=['image'])
    with pytest.raises(ValueError, match="^data_names: expected a list of variable names, got the string 'data'$"):
        amp.convert_symbol(symbol, 'float16', data_names='data')


def test_the_keywords_become_one_rules_object():
    symbol = small_cnn()
    parameters = [n for n in symbol.list_arguments() + symbol.list_auxiliary_states()
                  if n not in ('data', 'softmax_label')]
    options, names, _ = handed_over(lambda: amp.convert_symbol(
        symbol, 'bf16', target_dtype_ops=['Convolution'], fp32_ops=['Softmax'],
        conditional_fp32_ops=[('LeakyReLU', 'act_type', ['selu', 'elu'])],
        excluded_sym_names=['conv0'], data_names=['data', 'softmax_label'],
        cast_optional_params=True))
    assert options.dtype == 'bf16'
    assert options.rules == Rules(fp32_ops=('SoftmaxOutput',), exclude=('conv0',),   # aliases canonical
                                  lp_ops_only=('Convolution',),
                                  fp32_conditions=(('LeakyReLU', 'act_type', ('elu', 'selu')),))
    assert sorted(options.params) == sorted(parameters)
    assert names.exclude == 'excluded_sym_names'


# --------------------------------------------------------------------------
# contrib.amp's documented calls

def test_the_documented_convert_model_call():
    symbol = small_cnn()
    arg_params, aux_params = params_of(symbol)
    sym, args, auxs = amp.convert_model(symbol, arg_params, aux_params, target_dtype='bfloat16',
                                        target_dtype_ops=['Convolution'], fp32_ops=['FullyConnected'],
                                        excluded_sym_names=['conv0'], cast_optional_params=True)
    stored = {n: name_of_array(v) for n, v in args.items()}
    assert (stored['conv0_weight'], stored['conv1_weight'], stored['fc_weight']) == \
        ('float32', 'bfloat16', 'float32')
    got = precision(symbol, 'bfloat16', target_dtype_ops=['Convolution'], fp32_ops=['FullyConnected'],
                    excluded_sym_names=['conv0'])
    assert got == contrib_amp_precision(symbol, 'bfloat16', target_dtype_ops=['Convolution'],
                                        fp32_ops=['FullyConnected'], excluded_sym_names=['conv0'])


def test_the_amp_tutorial_call_gets_float16_as_in_contrib_amp():
    # MXNet's AMP tutorial leaves target_dtype out: contrib.amp's default, float16.
    symbol = small_cnn()
    arg_params, aux_params = params_of(symbol)
    tutorial = dict(target_dtype_ops=['Convolution'], fp32_ops=['SoftmaxOutput', 'FullyConnected'],
                    cast_optional_params=True)
    by_default, args, _ = amp.convert_model(symbol, arg_params, aux_params, **tutorial)
    named, named_args, _ = amp.convert_model(symbol, arg_params, aux_params, target_dtype='float16',
                                             **tutorial)
    assert by_default.tojson() == named.tojson()
    assert args['conv0_weight'].dtype == np.float16      # the tutorial's own checks
    assert args['fc_bias'].dtype == np.float32
    assert named_args['conv0_weight'].dtype == np.float16


# --------------------------------------------------------------------------
# Bad values: one line naming the keyword

@pytest.mark.parametrize('options,message', [
    ({'target_dtype': 'int8'}, r"^convert_symbol\(\): target_dtype='int8': expected 'float16', 'bfloat16'"),
    ({'target_dtype_ops': ['Convolution'], 'fp32_ops': ['Convolution']},
     r'^convert_symbol\(\): Convolution in both target_dtype_ops and fp32_ops'),
    ({'target_dtype_ops': ['Activation'], 'conditional_fp32_ops': [('Activation', 'act_type', ['relu'])]},
     r'^convert_symbol\(\): Activation in both target_dtype_ops and conditional_fp32_ops'),
    ({'target_dtype_ops': ['Convolutoin']}, r"^target_dtype_ops: operator 'Convolutoin' is not registered"),
    ({'target_dtype_ops': 'Convolution'}, r"^target_dtype_ops: expected a list of operator names, got the "
                                          r"string 'Convolution'$"),
    ({'fp32_ops': ['Convolutoin']}, r"^fp32_ops: operator 'Convolutoin' is not registered"),
    ({'conditional_fp32_ops': [('Activation', 'act_type')]},
     r"^conditional_fp32_ops: expected \(operator, attribute, values\) triples"),
    ({'conditional_fp32_ops': [('Activation', 'act_type', 'softrelu')]},
     r'^conditional_fp32_ops: expected \(operator, attribute, values\) triples'),
    ({'conditional_fp32_ops': [('Activation', 'acttype', ['softrelu'])]},
     r"^conditional_fp32_ops: operator Activation has no attribute 'acttype' \(its attributes: act_type\)$"),
    ({'conditional_fp32_ops': [('Activation', 'act_type', ['sofrelu'])]},
     r"^conditional_fp32_ops: Activation's act_type takes none of 'sofrelu' \(its values: 'relu', "),
])
def test_bad_values_get_one_line_naming_the_keyword(options, message):
    options.setdefault('target_dtype', 'float16')
    with pytest.raises(ValueError, match=message):
        amp.convert_symbol(small_cnn(), **options)


@pytest.mark.parametrize('name', FUNCTIONS)
def test_cast_optional_params_is_true_or_false(name):
    symbol = small_cnn()
    args = {'convert_symbol': (symbol,), 'convert_model': (symbol,) + params_of(symbol),
            'convert_hybrid_block': (gluon_net(),)}[name]
    with pytest.raises(TypeError, match=r"^%s\(\): cast_optional_params='yes': expected True or False$"
                                        % name):
        getattr(amp, name)(*args, cast_optional_params='yes')


# --------------------------------------------------------------------------
# The rules behind them

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
    assert set(mxnet_amp.list_lp16_ops('float16')) <= policy_mod.default_lp_ops('float16')
    assert 'BatchNorm' not in policy_mod.default_lp_ops('float16')


# --------------------------------------------------------------------------
# policy_lists and contrib.amp's list_*_ops

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
    assert set(mxnet_amp.list_lp16_ops('float16')) <= set(float16.low)
    assert set(mxnet_amp.list_lp16_ops(mxnet_amp.amp.bfloat16)) <= set(bfloat16.low)
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


@pytest.mark.parametrize('dtype', ['float16', 'bfloat16', np.float16, mxnet_amp.amp.bfloat16])
def test_contrib_amps_list_functions_are_the_policy_lists(dtype):
    lists = policy_lists(dtype)
    assert amp.list_lp16_ops(dtype) == list(lists.low)
    assert amp.list_fp32_ops(dtype) == list(lists.float32)
    assert amp.list_lp16_fp32_ops(dtype) == list(lists.neutral)
    assert amp.list_widest_type_cast(dtype) == list(lists.widest)
    conditional = amp.list_conditional_fp32_ops(dtype)
    assert conditional == [(op, attribute, list(values)) for op, attribute, values in lists.conditional]
    # In contrib.amp's form: they read back as conditional_fp32_ops.
    assert all(isinstance(values, list) for _, _, values in conditional)
    assert precision(soft_net(), dtype, conditional_fp32_ops=conditional)['act0'] == 'float32'


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
# The Gluon front: convert_hybrid_block

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
def test_convert_hybrid_block_takes_contrib_amps_keywords_with_the_symbol_fronts_meaning(dtype):
    options = dict(target_dtype_ops=['Convolution'], fp32_ops=['FullyConnected'],
                   conditional_fp32_ops=[('Activation', 'act_type', ['relu'])])
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net = amp.convert_hybrid_block(gluon_net(), target_dtype=dtype, **options)
        found = gluon_precision(net)
        symbol = gluon_net()(mx.sym.var('data'))
        # The Gluon front decides for this CPU, as the Symbol front does with cpu_class='auto'.
        rules = Rules.of(lp_ops_only=options['target_dtype_ops'], fp32_ops=options['fp32_ops'],
                         fp32_conditions=options['conditional_fp32_ops'])
        expected = convert_checked(symbol, SymbolOptions(dtype, rules, cpu_class='auto')
                                   ).conversion.node_precision
    assert {k: found[k] for k in expected} == expected
    assert found['dense0_fwd'] == 'float32'


@pytest.mark.parametrize('cast_optional_params', [False, True])
def test_convert_hybrid_block_call_as_documented(cast_optional_params):
    # contrib.amp: net = amp.convert_hybrid_block(net, target_dtype='float16', ctx=ctx)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net = amp.convert_hybrid_block(gluon_net(), target_dtype='float16', ctx=mx.cpu(1),
                                       cast_optional_params=cast_optional_params)
    assert mxamp.gluon.is_converted(net)
    assert net[0].weight.list_ctx() == [mx.cpu(1)]
    # Either value: stored in float16 (contrib.amp cast them either way, to the same values).
    assert name_of_array(net[0].weight.data(mx.cpu(1))) == 'float16'
    assert net(mx.nd.ones((2, 3, 8, 8), ctx=mx.cpu(1))).shape == (2, 10)


def test_convert_hybrid_block_keeps_the_parameters_where_they_are_without_ctx():
    net = gluon_net()
    net.collect_params().reset_ctx(mx.cpu(2))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        assert amp.convert_hybrid_block(net, 'float16') is net
    assert net[0].weight.list_ctx() == [mx.cpu(2)]


def test_convert_hybrid_block_excluded_sym_names_and_conditions():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net = amp.convert_hybrid_block(gluon_net(), target_dtype='float16', excluded_sym_names=['conv0_fwd'])
        assert gluon_precision(net)['conv0_fwd'] == 'float32'
        net = amp.convert_hybrid_block(gluon_net(), 'float16',
                                       conditional_fp32_ops=[('Activation', 'act_type', ['softrelu'])])
        assert gluon_precision(net)['act0_fwd'] == 'float32'
    with pytest.raises(ValueError, match=r"excluded_sym_names='nothing_fwd' matches no block"):
        amp.convert_hybrid_block(gluon_net(), 'float16', excluded_sym_names=['nothing_fwd'])


def test_convert_hybrid_block_refuses_what_contrib_amp_refuses_and_touches_nothing():
    net = gluon_net()
    with pytest.raises(ValueError, match=r"^convert_hybrid_block\(\): Convolution in both target_dtype_ops "
                                         r"and fp32_ops"):
        amp.convert_hybrid_block(net, 'float16', target_dtype_ops=['Convolution'], fp32_ops=['Convolution'])
    with pytest.raises(ValueError, match=r"^convert_hybrid_block\(\): target_dtype='int8'"):
        amp.convert_hybrid_block(net, 'int8')
    with pytest.raises(ValueError, match='^excluded_sym_names: expected a list of node names'):
        amp.convert_hybrid_block(net, 'float16', excluded_sym_names='conv0_fwd')
    assert not mxamp.gluon.is_converted(net)      # nothing was touched


def test_a_child_joins_only_a_tree_converted_with_the_same_contrib_amp_rules():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net = amp.convert_hybrid_block(gluon_net(), 'float16', target_dtype_ops=['Convolution'])
        same = amp.convert_hybrid_block(mx.gluon.nn.HybridSequential(), 'float16',
                                        target_dtype_ops=['Convolution'])
        net.add(same)
        other = mxamp.convert(mx.gluon.nn.HybridSequential(), 'float16')
    with pytest.raises(ValueError, match=r"other settings \(float16\) than .*target_dtype_ops=\['Convolution'\]"):
        net.add(other)
