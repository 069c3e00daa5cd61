"""The graph rewrite on small hand-built graphs: cast placement, invariants,
parameter storage, overrides, float16-on-CPU emulation, save/load."""
import json

import ml_dtypes
import numpy as np
import pytest

import mxnet as mx

from conftest import needs_bfloat16_compute
from mxamp import ConversionResult, convert_model, convert_symbol, convert_with_record, hardware
from mxamp.dtypes import BFLOAT16, ROUNDING_SUFFIX, cast, to_float32_numpy, type_flag
from mxamp.graph import (CAST_SUFFIX, PAD_SUFFIX, GraphError, NodePlan, cast_input, convert_graph,
                         format_report, load_graph, plan_node)
from mxamp.graph_check import check_graph
from mxamp.policy import Policy, Rules
from mxamp.symbol import SymbolOptions, make_policy


def small_cnn():
    data = mx.sym.var('data')
    x = mx.sym.Convolution(data, kernel=(3, 3), num_filter=16, pad=(1, 1), name='conv0')
    x = mx.sym.BatchNorm(x, name='bn0')
    x = mx.sym.Activation(x, act_type='relu', name='relu0')
    y = mx.sym.Convolution(x, kernel=(3, 3), num_filter=16, pad=(1, 1), name='conv1')
    x = mx.sym.elemwise_add(x, y, name='add0')
    x = mx.sym.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type='max', name='pool0')
    x = mx.sym.FullyConnected(x, num_hidden=10, name='fc')
    return mx.sym.SoftmaxOutput(x, name='softmax')


def params_of(symbol, data_shape=(2, 16, 8, 8), seed=0):
    arg_shapes, _, aux_shapes = symbol.infer_shape(data=data_shape)
    rng = np.random.RandomState(seed)
    args = {n: mx.nd.array(rng.uniform(-0.3, 0.3, s)) for n, s in zip(symbol.list_arguments(), arg_shapes)
            if n not in ('data', 'softmax_label')}
    auxs = {n: mx.nd.ones(s) if n.endswith('var') else mx.nd.zeros(s)
            for n, s in zip(symbol.list_auxiliary_states(), aux_shapes)}
    return args, auxs


def nodes(symbol):
    return json.loads(symbol.tojson())['nodes']


def casts(symbol):
    """mxamp's cast nodes, each reading the entry it converts (a rounded narrowing's
    helper steps looked through)."""
    graph = nodes(symbol)
    return [dict(n, inputs=[list(cast_input(graph, n)) + [0]]) for n in graph
            if CAST_SUFFIX in n['name'] and ROUNDING_SUFFIX not in n['name']]


def run(symbol, args, auxs, data):
    executor = symbol.bind(mx.cpu(), args=dict(args, data=data, softmax_label=mx.nd.zeros(data.shape[0])),
                           aux_states=dict(auxs), grad_req='null')
    return [to_float32_numpy(o) for o in executor.forward()]


F32, BF16, F16 = 'float32', 'bfloat16', 'float16'


def plan(precision, inputs, outputs, compute_fp32=False, pad_channels=False, activation=None):
    return NodePlan(precision, inputs, compute_fp32, pad_channels, activation, outputs)


@pytest.mark.parametrize('op, attrs, policy, states, shapes, expected', [
    # BatchNorm follows its data; its statistics stay FP32 either way.
    ('BatchNorm', {}, Policy(BF16), [F32] * 5, [None] * 5, plan(F32, (F32,) * 5, (F32,) * 3)),
    ('BatchNorm', {}, Policy(BF16), [BF16] + [F32] * 4, [None] * 5,
     plan(BF16, (BF16,) + (F32,) * 4, (BF16, F32, F32))),
    # float16 on a CPU: FP32 compute between float16 casts.
    ('FullyConnected', {}, Policy(F16, emulate_float16=True), [F32, F16, F16], [None] * 3,
     plan(F16, (F32,) * 3, (F16,), compute_fp32=True)),
    # The convolution layout rule: an RGB stem gets a zero channel, 24 channels run in FP32.
    ('Convolution', {}, Policy(BF16), [F32, F32], [None, (16, 3, 3, 3)],
     plan(BF16, (BF16, BF16), (BF16,), pad_channels=True)),
    ('Convolution', {}, Policy(BF16), [F32, BF16], [None, (24, 3, 3, 3)], plan(F32, (F32, F32), (F32,))),
    # A CPU class without bfloat16 kernels: FP32 compute, nothing padded.
    ('Convolution', {}, Policy(BF16, cpu_class='avx2'), [F32, BF16], [None, (16, 3, 3, 3)],
     plan(F32, (F32, F32), (F32,))),
    # Unary activations run as oneDNN's Activation in bfloat16 only.
    ('relu', {}, Policy(BF16), [BF16], [None], plan(BF16, (BF16,), (BF16,), activation='relu')),
    ('relu', {}, Policy(F16), [F16], [None], plan(F16, (F16,), (F16,))),
    # Widest: low precision only when every floating input is; indices are never cast.
    ('elemwise_add', {}, Policy(F16), [F16, F32], [None] * 2, plan(F32, (F32, F32), (F32,))),
    ('take', {}, Policy(F16), [F16, F32], [None] * 2, plan(F16, (F16, None), (F16,))),
    # A cast's attribute gives its output dtype.
    ('Cast', {'dtype': 'float32'}, Policy(F16), [F16], [None], plan(None, (None,), (F32,))),
])
def test_plan_node_decides_each_rule(op, attrs, policy, states, shapes, expected):
    node = {'op': op, 'name': 'node', 'attrs': attrs}
    assert plan_node(node, policy, states, shapes, [True] * len(expected.outputs)) == expected


def test_casts_only_at_boundaries_with_low_precision_params():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    converted, c_args, c_auxs, conversion = convert_with_record(symbol, 'bfloat16', arg_params=args,
                                                                 aux_params=auxs)
    cast_nodes = casts(converted)
    # data into the first conv, fc output back to FP32 for the softmax: nothing else.
    assert sorted((n['inputs'][0][0], n['attrs']['dtype']) for n in cast_nodes) == sorted(
        [(0, 'bfloat16'), (next(i for i, n in enumerate(nodes(converted)) if n['name'] == 'fc'), 'float32')])
    assert conversion.casts == {('float32', 'bfloat16'): 1, ('bfloat16', 'float32'): 1}
    assert {n for n, v in c_args.items() if v.dtype == BFLOAT16} == {
        'conv0_weight', 'conv0_bias', 'conv1_weight', 'conv1_bias', 'fc_weight', 'fc_bias'}
    assert all(v.dtype == np.float32 for n, v in c_args.items() if n.startswith('bn0'))
    assert all(v.dtype == np.float32 for v in c_auxs.values())
    assert conversion.node_precision['softmax'] == 'float32'
    assert conversion.node_precision['bn0'] == 'bfloat16'
    assert check_graph(converted, Policy('bfloat16')) == []


def test_outputs_are_float32_and_close():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    data = mx.nd.random.uniform(shape=(2, 16, 8, 8))
    reference = run(symbol, args, auxs, data)[0]
    # Built for this CPU: bfloat16 compute where it has kernels, FP32 compute otherwise.
    converted, c_args, c_auxs = convert_model(symbol, args, auxs, 'bfloat16', cpu_class='auto')
    _, out_types, _ = converted.infer_type(data=np.float32)
    assert out_types == [np.float32]
    got = run(converted, c_args, c_auxs, data)[0]
    assert np.abs(got - reference).max() < 0.02


def test_without_params_every_variable_is_an_fp32_input():
    symbol = small_cnn()
    converted = convert_symbol(symbol, 'bfloat16')
    arg_types, out_types, aux_types = converted.infer_type(data=np.float32)
    assert {np.dtype(t) for t in arg_types + aux_types} == {np.dtype(np.float32)}
    # one cast per weight (and bias) of the low-precision ops, shared, plus data and output.
    weights = [n for n in nodes(converted) if n['op'] == 'null' and n['name'].endswith(('weight', 'bias'))
               and not n['name'].startswith('bn')]
    assert len(casts(converted)) == len(weights) + 2
    args, auxs = params_of(symbol)
    data = mx.nd.array(np.random.RandomState(0).uniform(size=(2, 16, 8, 8)))
    here = convert_symbol(symbol, 'bfloat16', cpu_class='auto')
    # Over 30 draws of weights and data (AMD EPYC with avx512_bf16): at most 0.016.
    assert np.abs(run(here, args, auxs, data)[0] - run(symbol, args, auxs, data)[0]).max() < 0.04


def test_no_cast_chains_and_one_cast_per_tensor():
    data = mx.sym.var('data')
    a = mx.sym.FullyConnected(data, num_hidden=4, name='fc1')
    # fc1's output feeds two FP32 ops and two low-precision ops: one cast each way.
    b = mx.sym.softmax(a, name='sm1')
    c = mx.sym.exp(a, name='exp1')
    d = mx.sym.FullyConnected(a, num_hidden=4, name='fc2')
    e = mx.sym.FullyConnected(a, num_hidden=4, name='fc3')
    # data is needed in FP32 by 'sum' and in low precision by fc1: the FP32 op reads data itself.
    s = mx.sym.sum(data, name='sum1')
    out = mx.sym.Group([b, c, d, e, s])
    converted = convert_symbol(out, 'float16')
    cast_nodes = casts(converted)
    sources = [(n['inputs'][0][0], n['attrs']['dtype']) for n in cast_nodes]
    assert len(sources) == len(set(sources))
    graph = nodes(converted)
    for node in cast_nodes:
        assert CAST_SUFFIX not in graph[node['inputs'][0][0]]['name']
    fp32_consumers = [n for n in graph if n['name'] in ('sm1', 'exp1')]
    assert fp32_consumers[0]['inputs'] == fp32_consumers[1]['inputs']
    sum_node = next(n for n in graph if n['name'] == 'sum1')
    assert graph[sum_node['inputs'][0][0]]['name'] == 'data'
    assert check_graph(converted, Policy('float16')) == []


def test_widest_op_casts_up_when_an_input_is_fp32():
    data = mx.sym.var('data')
    a = mx.sym.FullyConnected(data, num_hidden=4, name='fc1')
    b = mx.sym.softmax(data, name='sm')
    c = mx.sym.elemwise_add(a, b, name='add')
    d = mx.sym.FullyConnected(c, num_hidden=4, name='fc2')
    converted = convert_graph(d, Policy('float16'))
    assert converted.node_precision['add'] == 'float32'
    assert converted.node_precision['fc2'] == 'float16'
    assert check_graph(converted.symbol, Policy('float16')) == []


def test_exclude_and_fp32_ops_overrides():
    symbol = small_cnn()
    conversion = convert_graph(symbol, make_policy(SymbolOptions('bfloat16', Rules.of(exclude=['conv1'], fp32_ops=['Pooling']))))
    assert conversion.node_precision['conv1'] == 'float32'
    assert conversion.node_precision['conv0'] == 'bfloat16'
    assert conversion.node_precision['pool0'] == 'float32'
    assert check_graph(conversion.symbol, make_policy(SymbolOptions('bfloat16', Rules.of(exclude=['conv1'], fp32_ops=['Pooling'])))) == []


def test_float16_on_cpu_computes_gemm_in_fp32_between_float16_casts():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    converted, c_args, c_auxs, conversion = convert_with_record(
        symbol, 'float16', arg_params=args, aux_params=auxs, ctx=mx.cpu())
    assert c_args['conv0_weight'].dtype == np.float16  # float16 storage
    graph = nodes(converted)
    conv1 = next(n for n in graph if n['name'] == 'conv1')
    assert all(graph[i]['attrs'].get('dtype') == 'float32' for i, _, _ in conv1['inputs'])
    bn = next(n for n in graph if n['name'] == 'bn0')
    assert graph[bn['inputs'][0][0]]['attrs']['dtype'] == 'float16'  # conv output stored in float16
    data = mx.nd.array(np.random.RandomState(0).uniform(size=(2, 16, 8, 8)))
    got = run(converted, c_args, c_auxs, data)[0]
    # Over 30 draws of weights and data: at most 0.0014.
    assert np.abs(got - run(symbol, args, auxs, data)[0]).max() < 0.01
    assert check_graph(converted, make_policy(SymbolOptions('float16', ctx=mx.cpu()))) == []
    # The report says what computes: the GEMMs in FP32, the rest in float16.
    lines = format_report(conversion).splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:] if line[:1].isalpha()}
    assert rows['Convolution'] == ['2', '0', '2'] and rows['FullyConnected'] == ['1', '0', '1']
    assert rows['BatchNorm'] == ['1', '1', '0']
    assert 'of the float32 nodes, 3 compute in FP32 between float16 casts' in '\n'.join(lines)


def test_save_load_keeps_casts_and_types(tmp_path):
    symbol = small_cnn()
    converted = convert_symbol(symbol, 'bfloat16', params=[n for n in symbol.list_arguments()
                                                           if n not in ('data', 'softmax_label')])
    path = str(tmp_path / 'net-symbol.json')
    converted.save(path)
    reloaded = mx.sym.load(path)
    assert len(casts(reloaded)) == len(casts(converted)) > 0
    arg_types, out_types, _ = reloaded.infer_type(data=np.float32)
    types = dict(zip(reloaded.list_arguments(), arg_types))
    assert types['conv0_weight'] == BFLOAT16 and types['bn0_gamma'] == np.float32
    assert out_types == [np.float32]


def test_integer_tensors_are_never_cast():
    tokens = mx.sym.var('tokens')
    emb = mx.sym.Embedding(tokens, input_dim=50, output_dim=8, name='emb')
    idx = mx.sym.argmax(emb, axis=2, name='am')
    fc = mx.sym.FullyConnected(emb, num_hidden=4, flatten=False, name='fc')
    shape = mx.sym.shape_array(fc, name='shape')
    out = mx.sym.Group([fc, idx, shape])
    conversion = convert_graph(out, Policy('float16'), input_types={'tokens': 'int32'})
    graph = nodes(conversion.symbol)
    emb_node = next(n for n in graph if n['name'] == 'emb')
    assert graph[emb_node['inputs'][0][0]]['name'] == 'tokens'
    _, out_types, _ = conversion.symbol.infer_type(tokens=np.int32)
    assert out_types == [np.float32, np.float32, np.int64]


def test_converting_twice_is_refused():
    converted = convert_symbol(small_cnn(), 'bfloat16')
    with pytest.raises(GraphError, match='already converted by mxamp'):
        convert_symbol(converted, 'bfloat16')


@pytest.mark.parametrize('text,message', [
    ('{"nodes": [', 'not valid JSON'),
    ('[1, 2, 3]', 'not an MXNet symbol'),
    ('{"nodes": [{"op": "Convolution"}], "heads": []}', 'node 0 is not an MXNet node'),
    ('{"nodes": [{"op": "null", "name": "x", "inputs": []}, {"op": "WarpCTC", "name": "ctc", '
     '"inputs": [[0, 0, 0]]}], "arg_nodes": [0], "heads": [[1, 0, 0]]}',
     "node 'ctc': operator 'WarpCTC' is not registered"),
])
def test_bad_graphs_get_one_clear_line(text, message):
    with pytest.raises(GraphError) as err:
        load_graph(text)
    assert message in str(err.value)
    assert '\n' not in str(err.value)


def test_params_that_do_not_match_the_graph_are_named():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    with pytest.raises(GraphError, match="'arg:nope' is not in the graph"):
        convert_model(symbol, dict(args, nope=mx.nd.ones(1)), auxs, 'bfloat16')
    misplaced = {k: v for k, v in args.items() if k != 'bn0_gamma'}
    with pytest.raises(GraphError, match=r"'aux:bn0_gamma' is not in the graph \(it is an argument"):
        convert_model(symbol, misplaced, dict(auxs, bn0_gamma=args['bn0_gamma']), 'bfloat16')
    wrong = dict(args, fc_weight=mx.nd.ones((10, 7)))
    with pytest.raises(GraphError, match='shape'):
        convert_model(symbol, wrong, auxs, 'bfloat16', input_shapes={'data': (2, 16, 8, 8)})


def test_report_table_counts_nodes_and_casts():
    conversion = convert_graph(small_cnn(), Policy('bfloat16'))
    text = format_report(conversion)
    lines = text.splitlines()
    assert lines[0].split() == ['operator', 'nodes', 'bfloat16', 'float32']
    conv_row = next(line for line in lines if line.startswith('Convolution'))
    assert conv_row.split() == ['Convolution', '2', '2', '0']
    assert 'SoftmaxOutput' in text and 'casts inserted:' in text


def test_bfloat16_values_never_leak_as_uint16():
    x = cast(mx.nd.array([1.5, -2.25]), 'bfloat16')
    assert x.dtype == BFLOAT16
    assert to_float32_numpy(x).tolist() == [1.5, -2.25]


def test_amp_multicast_in_the_graph_unifies_like_widest():
    data = mx.sym.var('data')
    anchors = mx.sym.var('anchors')
    boxes = mx.sym.FullyConnected(data, num_hidden=4, name='fc')
    a, b = mx.sym.amp_multicast(boxes, anchors, num_outputs=2, name='multicast')
    out = mx.sym.Concat(a, b, dim=1, name='concat')
    conversion = convert_graph(out, Policy('float16'))
    assert conversion.node_precision['multicast'] == 'float32'
    _, out_types, _ = conversion.symbol.infer_type(data=np.float32, anchors=np.float32)
    assert out_types == [np.float32]
    assert check_graph(conversion.symbol, Policy('float16')) == []


def test_bfloat16_unary_activations_run_as_onednn_activation():
    # MXNet 1.9.1's relu/sigmoid/tanh ops have no oneDNN bfloat16 kernel (30-100x slower
    # than Activation): in bfloat16 graphs the rewrite runs them as Activation nodes.
    from mxamp.policy import Policy
    data = mx.sym.var('data')
    conv = mx.sym.Convolution(data, kernel=(3, 3), num_filter=4, name='conv')
    out = mx.sym.tanh(mx.sym.sigmoid(mx.sym.relu(conv, name='r'), name='s'), name='t')
    out = mx.sym.FullyConnected(out, num_hidden=2, name='fc')
    conv_bf16 = convert_graph(out, Policy('bfloat16'), params=['conv_weight', 'conv_bias'])
    nodes = {n['name']: n for n in json.loads(conv_bf16.symbol.tojson())['nodes']}
    for name, act in (('r', 'relu'), ('s', 'sigmoid'), ('t', 'tanh')):
        assert nodes[name]['op'] == 'Activation' and nodes[name]['attrs'] == {'act_type': act}
        assert conv_bf16.node_precision[name] == 'bfloat16'
        assert next(n.op for n in conv_bf16.nodes if n.name == name) == 'Activation'
    assert check_graph(conv_bf16.symbol, Policy('bfloat16')) == []
    x = mx.nd.random.uniform(-1, 1, shape=(2, 3, 8, 8))
    args = {'data': x, 'conv_weight': mx.nd.random.uniform(shape=(4, 3, 3, 3)),
            'conv_bias': mx.nd.zeros(4), 'fc_weight': mx.nd.random.uniform(shape=(2, 144)),
            'fc_bias': mx.nd.zeros(2)}
    ref = out.eval(ctx=mx.cpu(), **args)[0].asnumpy()
    from mxamp.dtypes import cast
    low = dict(args, conv_weight=cast(args['conv_weight'], 'bfloat16'),
               conv_bias=cast(args['conv_bias'], 'bfloat16'))
    here = convert_graph(out, Policy('bfloat16', cpu_class=hardware.cpu_class()),
                         params=['conv_weight', 'conv_bias']).symbol
    got = here.eval(ctx=mx.cpu(), **{k: v for k, v in low.items() if k in here.list_arguments()})
    assert abs(got[0].asnumpy() - ref).max() < 0.05 * abs(ref).max() + 1e-3
    # float16 graphs are left alone (GPU kernels exist for the ops themselves).
    fp16 = convert_graph(out, Policy('float16'))
    assert next(n.op for n in fp16.nodes if n.name == 'r') == 'relu'


def stem_cnn(stem_channels=16, body_channels=16):
    """A stem on `data` before a body convolution; 3 input channels is an RGB stem."""
    data = mx.sym.var('data')
    x = mx.sym.Convolution(data, kernel=(3, 3), num_filter=stem_channels, pad=(1, 1), no_bias=True,
                           name='stem')
    x = mx.sym.BatchNorm(x, name='stem_bn')
    x = mx.sym.Activation(x, act_type='relu', name='stem_relu')
    x = mx.sym.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type='max', name='stem_pool')
    x = mx.sym.Convolution(x, kernel=(3, 3), num_filter=body_channels, pad=(1, 1), no_bias=True,
                           name='body')
    x = mx.sym.BatchNorm(x, name='body_bn')
    x = mx.sym.FullyConnected(x, num_hidden=10, name='fc')
    return mx.sym.SoftmaxOutput(x, name='softmax')


def test_bfloat16_rgb_stem_gets_a_zero_channel():
    # oneDNN's blocked bfloat16 convolution needs an even channel count below 16:
    # the rewrite appends a zero channel to the image and the weight (exact).
    symbol = stem_cnn()
    shapes = {'data': (2, 3, 8, 8)}
    args, auxs = params_of(symbol, data_shape=shapes['data'])
    converted, c_args, c_auxs, conversion = convert_with_record(
        symbol, 'bfloat16', arg_params=args, aux_params=auxs, input_shapes=shapes)
    assert set(conversion.node_precision.values()) == {'bfloat16', 'float32'}
    assert all(conversion.node_precision[n] == 'bfloat16' for n in ('stem', 'stem_bn', 'body', 'fc'))
    graph = nodes(converted)
    stem = next(n for n in graph if n['name'] == 'stem')
    assert [graph[i]['name'] for i, _, _ in stem['inputs']] == [
        'stem' + PAD_SUFFIX + 'data', 'stem' + PAD_SUFFIX + 'weight']
    # The padded weight reads the stored (3-channel) bfloat16 parameter, which
    # declares its shape: MXNet infers none backwards through the Concat.
    assert c_args['stem_weight'].dtype == BFLOAT16 and c_args['stem_weight'].shape == (16, 3, 3, 3)
    arg_shapes, _, _ = converted.infer_shape(data=shapes['data'])
    assert dict(zip(converted.list_arguments(), arg_shapes))['stem_weight'] == (16, 3, 3, 3)
    assert check_graph(converted, Policy('bfloat16'), shapes=shapes) == []
    # Stored dtypes do not depend on whether the shapes were known.
    without_shapes = convert_graph(symbol, Policy('bfloat16'), params=list(args) + list(auxs))
    assert without_shapes.lp_params == conversion.lp_params
    assert not any(PAD_SUFFIX in n['name'] for n in nodes(without_shapes.symbol))
    # On a CPU without bfloat16 kernels the stem computes in FP32: nothing to pad.
    storage_only = convert_graph(symbol, Policy('bfloat16', cpu_class='avx2'),
                                 params=list(args) + list(auxs), shapes=shapes)
    assert storage_only.lp_params == conversion.lp_params
    assert not any(PAD_SUFFIX in n['name'] for n in nodes(storage_only.symbol))
    assert set(storage_only.node_precision.values()) == {'float32'}


def test_the_conversion_records_each_node_and_cast_and_the_graph_agrees():
    # The record (what summary and format_report print) is what the graph does:
    # the name scan of the graph finds the same casts, check_graph finds the
    # record true, and a record that lies is caught.
    symbol = stem_cnn()
    shapes = {'data': (2, 3, 8, 8)}
    policy = Policy('bfloat16')
    params = symbol.list_arguments()[1:-1] + symbol.list_auxiliary_states()
    conversion = convert_graph(symbol, policy, params=params, shapes=shapes, portable=False)
    stem = next(n for n in conversion.nodes if n.name == 'stem')
    assert stem.op == 'Convolution' and stem.plan.pad_channels and stem.computes_in == 'bfloat16'
    data, weight = stem.inputs
    assert (data.source, data.cast.from_dtype, data.cast.to_dtype) == ('data', 'float32', 'bfloat16')
    assert data.pad[-1] == 'stem' + PAD_SUFFIX + 'data' and len(data.pad) == 3  # slice, zeros, concat
    assert (weight.source, weight.cast, weight.pad) == (
        'stem_weight', None, ('stem' + PAD_SUFFIX + 'weight_zero', 'stem' + PAD_SUFFIX + 'weight'))
    assert [n.name for n in conversion.nodes] == [n['name'] for n in nodes(symbol) if n['op'] != 'null']
    softmax = next(n for n in conversion.nodes if n.name == 'softmax')
    assert softmax.inputs[0].cast.name == 'fc' + CAST_SUFFIX + 'float32'
    assert conversion.output_casts == (None,)     # SoftmaxOutput writes FP32 itself
    graph = load_graph(conversion.symbol)
    from mxamp.graph import find_casts, infer_entry_types
    assert list(conversion.cast_nodes) == find_casts(graph, infer_entry_types(graph))
    assert check_graph(conversion, policy, shapes=shapes) == []
    lying = [
        conversion._replace(cast_nodes=conversion.cast_nodes[1:]),
        conversion._replace(cast_nodes=tuple(c._replace(to_dtype='float16') for c in conversion.cast_nodes)),
        conversion._replace(nodes=tuple(n._replace(plan=n.plan._replace(compute_fp32=True))
                                        if n.name == 'fc' else n for n in conversion.nodes)),
        conversion._replace(nodes=tuple(n._replace(inputs=(n.inputs[0]._replace(pad=()),) + n.inputs[1:])
                                        if n.name == 'stem' else n for n in conversion.nodes)),
        conversion._replace(nodes=tuple(n._replace(op='relu') if n.name == 'stem_relu' else n
                                        for n in conversion.nodes)),
    ]
    for record in lying:
        assert check_graph(record, policy, shapes=shapes), record


@needs_bfloat16_compute
def test_bfloat16_rgb_stem_with_zero_channel_runs_close_to_fp32():
    symbol = stem_cnn()
    shapes = {'data': (2, 3, 8, 8)}
    args, auxs = params_of(symbol, data_shape=shapes['data'])
    converted, c_args, c_auxs = convert_model(symbol, args, auxs, 'bfloat16', input_shapes=shapes)
    assert any(PAD_SUFFIX in n['name'] for n in nodes(converted))
    data = mx.nd.array(np.random.RandomState(0).uniform(size=shapes['data']))
    got = run(converted, c_args, c_auxs, data)[0]
    # Over 30 draws of weights and data (AMD EPYC with avx512_bf16): at most 0.011.
    assert np.abs(got - run(symbol, args, auxs, data)[0]).max() < 0.02


def test_bfloat16_convolution_without_blocked_kernel_runs_in_float32():
    # 24 channels: oneDNN's bfloat16 GEMM fallback (plain layouts) is slower than
    # FP32; the convolutions reading or writing 24 channels and the layers
    # following them run in FP32, their weights stay stored in bfloat16 (read
    # through an exact cast), the fully-connected layer casts back.
    symbol = stem_cnn(stem_channels=24)
    shapes = {'data': (2, 16, 8, 8)}
    args, auxs = params_of(symbol, data_shape=shapes['data'])
    converted, c_args, c_auxs, conversion = convert_with_record(
        symbol, 'bfloat16', arg_params=args, aux_params=auxs, input_shapes=shapes)
    precision = conversion.node_precision
    assert [precision[n] for n in ('stem', 'stem_bn', 'stem_relu', 'stem_pool', 'body', 'body_bn')] \
        == ['float32'] * 6
    assert precision['fc'] == 'bfloat16'
    assert c_args['stem_weight'].dtype == BFLOAT16 and c_args['body_weight'].dtype == BFLOAT16
    assert check_graph(converted, Policy('bfloat16'), shapes=shapes) == []
    # Without shapes the check cannot tell the layout rule from a bug, and says so.
    assert any("'stem'" in p for p in check_graph(converted, Policy('bfloat16')))
    data = mx.nd.array(np.random.RandomState(0).uniform(size=shapes['data']))
    here, h_args, h_auxs = convert_model(symbol, args, auxs, 'bfloat16', input_shapes=shapes,
                                         cpu_class='auto')
    got = run(here, h_args, h_auxs, data)[0]
    # Softmax probabilities.  Over 30 draws of weights and data (AMD EPYC with avx512_bf16)
    # the largest difference was 0.021, the median 0.003 (an unseeded draw failed 0.02).
    assert np.abs(got - run(symbol, args, auxs, data)[0]).max() < 0.04


def test_batchnorm_on_fp32_data_stays_fp32():
    # A BatchNorm on the network input (MXNet's ResNet 'bn_data') normalises FP32
    # data in FP32; the convolution after it casts.
    data = mx.sym.var('data')
    x = mx.sym.BatchNorm(data, fix_gamma=True, name='bn_data')
    x = mx.sym.Convolution(x, kernel=(1, 1), num_filter=16, name='conv')
    conversion = convert_graph(x, Policy('bfloat16'), params=['conv_weight', 'conv_bias'])
    assert conversion.node_precision == {'bn_data': 'float32', 'conv': 'bfloat16'}
    assert check_graph(conversion.symbol, Policy('bfloat16')) == []
    # With batchnorm_data='float32' nothing changes for it; float16 follows the same rule.
    assert convert_graph(x, Policy('float16')).node_precision['bn_data'] == 'float32'


def test_activation_casts_are_amp_cast_unless_portable():
    symbol = stem_cnn(stem_channels=24)
    params = symbol.list_arguments()[1:-1] + symbol.list_auxiliary_states()
    shapes = {'data': (2, 16, 8, 8)}
    fast = convert_graph(symbol, Policy('bfloat16'), params=params, shapes=shapes, portable=False)
    portable = convert_graph(symbol, Policy('bfloat16'), params=params, shapes=shapes)
    fast_ops = {n['name']: n['op'] for n in json.loads(fast.symbol.tojson(remove_amp_cast=False))['nodes']
                if CAST_SUFFIX in n['name']}
    # Weights are cast with Cast (a parameter may hold a blocked layout amp_cast rejects),
    # activations with amp_cast (one oneDNN reorder).
    assert fast_ops == {'stem_weight' + CAST_SUFFIX + 'float32': 'Cast',
                        'body_weight' + CAST_SUFFIX + 'float32': 'Cast',
                        'body_bn' + CAST_SUFFIX + 'bfloat16': 'amp_cast',
                        'fc' + CAST_SUFFIX + 'float32': 'amp_cast'}
    assert {n['op'] for n in casts(portable.symbol)} == {'Cast'}
    # MXNet's default save drops amp_cast: only the portable graph survives it.  Its one
    # narrowing of an activation rounds in seven nodes (mxamp.dtypes.bfloat16_rounding_nodes).
    assert len(casts(portable.symbol)) == 4
    steps = [n['name'] for n in nodes(portable.symbol) if ROUNDING_SUFFIX in n['name']]
    assert {name.split(ROUNDING_SUFFIX)[0] for name in steps} == {'body_bn' + CAST_SUFFIX + 'bfloat16'}
    assert len(nodes(fast.symbol)) == len(nodes(portable.symbol)) - 2 - len(steps) == 24


@needs_bfloat16_compute
def test_every_narrowing_to_bfloat16_rounds_to_nearest():
    """MXNet 1.9.1's Cast truncates to bfloat16 (a float32's upper 16 bits).  mxamp's
    narrowings round to nearest: a portable graph, whose input, weights and activation
    narrow in seven saved nodes each, gives the bits of the non-portable one (amp_cast for
    the input and the activation), also after MXNet's default save."""
    x = mx.sym.Convolution(mx.sym.var('data'), kernel=(3, 3), num_filter=16, pad=(1, 1), name='a')
    x = mx.sym.softmax(x, axis=1, name='spread')      # FP32: its output narrows for b
    x = mx.sym.Convolution(x, kernel=(3, 3), num_filter=16, pad=(1, 1), name='b')
    symbol = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(x, num_hidden=10, name='fc'), name='softmax')
    shapes = {'data': (2, 16, 8, 8)}
    args, auxs = params_of(symbol)
    fast = convert_graph(symbol, Policy('bfloat16'), shapes=shapes, portable=False,
                         data_inputs=['data'])
    portable = convert_graph(symbol, Policy('bfloat16'), shapes=shapes)
    saved = mx.sym.load_json(portable.symbol.tojson())
    ops = {n['name']: n['op'] for n in json.loads(fast.symbol.tojson(remove_amp_cast=False))['nodes']}
    assert ops['data' + CAST_SUFFIX + 'bfloat16'] == ops['spread' + CAST_SUFFIX + 'bfloat16'] \
        == 'amp_cast'
    narrowed = {n['name'].split(ROUNDING_SUFFIX)[0] for n in nodes(saved) if ROUNDING_SUFFIX in n['name']}
    assert narrowed == {name + CAST_SUFFIX + 'bfloat16'
                        for name in ('data', 'a_weight', 'a_bias', 'spread', 'b_weight', 'b_bias',
                                     'fc_weight', 'fc_bias')}
    assert not check_graph(saved, Policy('bfloat16'), shapes=shapes)
    data = np.random.RandomState(1).normal(0, 1, shapes['data']).astype(np.float32)
    expected = run(fast.symbol, args, auxs, mx.nd.array(data))[0]
    np.testing.assert_array_equal(run(saved, args, auxs, mx.nd.array(data))[0], expected)
    # The input's narrowing rounds: the image rounded beforehand gives the same bits,
    # truncated beforehand (what Cast did) others.
    rounded = data.astype(ml_dtypes.bfloat16).astype(np.float32)
    truncated = (data.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    np.testing.assert_array_equal(run(saved, args, auxs, mx.nd.array(rounded))[0], expected)
    assert (run(saved, args, auxs, mx.nd.array(truncated))[0] != expected).any()


def padded_convolution(kernel, data_shape):
    """A convolution on an odd channel count below 16, its {-1, 0, 1} values, its bfloat16 conversion.

    Every sum that the convolution and its gradients take over such values (for
    these shapes at most 144 terms, 16 filters x 3x3 taps) is an integer below
    256: exact in FP32 and in bfloat16 in any summation order.  The padded graph runs other
    oneDNN kernels than the unpadded one (another order of summation), so only
    such values let the two be compared bit for bit.
    """
    out = mx.sym.Convolution(mx.sym.var('data'), kernel=kernel, num_filter=16,
                             pad=tuple(k // 2 for k in kernel), name='conv')
    arg_shapes, out_shapes, _ = out.infer_shape(data=data_shape)
    rng = np.random.RandomState(len(kernel))
    values = {n: mx.nd.array(rng.randint(-1, 2, s)) for n, s in zip(out.list_arguments(), arg_shapes)}
    head_grad = mx.nd.array(rng.randint(-1, 2, out_shapes[0]))
    args = {n: v for n, v in values.items() if n != 'data'}
    converted, c_args, _, conversion = convert_with_record(
        out, 'bfloat16', arg_params=args, aux_params={}, input_shapes={'data': data_shape})
    assert next(n for n in conversion.nodes if n.name == 'conv').plan.pad_channels
    return out, values, head_grad, converted, dict(c_args, data=values['data'])


def forward_backward(symbol, values, head_grad):
    """Output and every gradient of `symbol` at `values`, as FP32 numpy arrays."""
    executor = symbol.bind(mx.cpu(), args=dict(values),
                           args_grad={k: mx.nd.zeros(v.shape, dtype=v.dtype) for k, v in values.items()})
    out = executor.forward(is_train=True)[0]
    executor.backward(head_grad)
    result = {k: to_float32_numpy(v) for k, v in executor.grad_dict.items()}
    result['out'] = to_float32_numpy(out)
    return result


def relabelled_float32(symbol):
    """`symbol` with every bfloat16 it declares or casts to read as float32.

    The padded graph, built for a bfloat16 CPU, then runs on any CPU: the
    padding's nodes unchanged, every cast the identity.
    """
    graph = json.loads(symbol.tojson(remove_amp_cast=False))
    relabel = {'dtype': ('bfloat16', 'float32'), '__dtype__': (str(type_flag(BF16)), str(type_flag(F32)))}
    for node in graph['nodes']:
        attrs = node.get('attrs', {})
        for key, (old, new) in relabel.items():
            if attrs.get(key) == old:
                attrs[key] = new
    return mx.sym.load_json(json.dumps(graph))


PADDED_CONVOLUTIONS = pytest.mark.parametrize('kernel, data_shape', [((3,), (2, 5, 12)),
                                                                     ((3, 3), (2, 3, 8, 8))])


@PADDED_CONVOLUTIONS
def test_zero_channel_padding_appends_zeros_and_changes_nothing(kernel, data_shape):
    # 1-D and 2-D, with a gradient for the data too (the padding's Concat slices it
    # back).  The bfloat16 graph, read as FP32, runs here whatever the CPU.
    out, values, head_grad, converted, _ = padded_convolution(kernel, data_shape)
    padded = relabelled_float32(converted)
    internals = padded.get_internals()
    pads = mx.sym.Group([internals['conv' + PAD_SUFFIX + name + '_output'] for name in ('data', 'weight')])
    executor = pads.bind(mx.cpu(), args={n: values[n] for n in pads.list_arguments()})
    for padded_value, name in zip(executor.forward(), ('data', 'conv_weight')):
        padded_value, value = padded_value.asnumpy(), values[name].asnumpy()
        assert padded_value.shape == (value.shape[0], value.shape[1] + 1) + value.shape[2:], name
        assert np.array_equal(padded_value[:, :-1], value), name
        assert not padded_value[:, -1].any(), name
    want, got = forward_backward(out, values, head_grad), forward_backward(padded, values, head_grad)
    assert sorted(got) == sorted(want) == ['conv_bias', 'conv_weight', 'data', 'out']
    for key in want:
        assert np.array_equal(got[key], want[key]), key


@needs_bfloat16_compute
@PADDED_CONVOLUTIONS
def test_zero_channel_padding_is_exact_in_bfloat16(kernel, data_shape):
    # Every value and sum is exact in bfloat16 (see padded_convolution): the
    # bfloat16 graph, padded, must give FP32's output and gradients bit for bit.
    out, values, head_grad, converted, c_values = padded_convolution(kernel, data_shape)
    assert c_values['conv_weight'].dtype == BFLOAT16
    want, got = forward_backward(out, values, head_grad), forward_backward(converted, c_values, head_grad)
    assert sorted(got) == sorted(want) == ['conv_bias', 'conv_weight', 'data', 'out']
    for key in want:
        assert np.array_equal(got[key], want[key]), key


def test_auto_and_float32_mean_for_symbols_what_they_mean_for_gluon(monkeypatch):
    # 'auto' is this machine's fastest precision; 'float32' (and 'auto' on a CPU
    # without native bfloat16) leaves the checkpoint as it is, as mxamp.convert does.
    import warnings
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    # Each class's CPU as its flags show it (an AMD EPYC each): on an AMX machine's own
    # flags an 'avx512_bf16' class means AMX left off, where 'auto' keeps float32.
    for klass, flags, expected in (
            ('avx2', {'avx2'}, 'float32'),
            ('avx512_bf16', {'avx512f', 'avx512bw', 'avx512vl', 'avx512dq', 'avx512_bf16'},
             'bfloat16')):
        monkeypatch.setattr(hardware, 'cpu_class', lambda: klass)
        monkeypatch.setattr(hardware, 'cpu_flags', lambda: frozenset(flags))
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')     # 'auto' stays float32: said once per process
            sym, c_args, c_auxs, conversion = convert_with_record(symbol, 'auto', arg_params=args,
                                                                  aux_params=auxs, ctx=mx.cpu())
            graph_only = convert_symbol(symbol.tojson(), 'auto', ctx=mx.cpu())
        if expected == 'float32':
            assert conversion is None and sym is symbol and c_args is args and c_auxs is auxs
            assert graph_only.tojson() == symbol.tojson()
        else:
            assert conversion.dtype == 'bfloat16' and c_args['conv0_weight'].dtype == BFLOAT16
            assert CAST_SUFFIX in graph_only.tojson(remove_amp_cast=False)
    assert convert_model(symbol, args, auxs, 'float32')[0] is symbol
    assert convert_symbol(symbol, 'fp32') is symbol
    assert convert_model(symbol, args, auxs, 'bf16')[1]['fc_weight'].dtype == BFLOAT16
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        convert_symbol(symbol, 'float8')


# --------------------------------------------------------------------------
# One function, one return type: convert_with_record

def test_convert_with_record_returns_what_convert_model_and_convert_symbol_return_and_the_record():
    import warnings
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    record = convert_with_record(symbol, 'bfloat16', arg_params=args, aux_params=auxs)
    assert isinstance(record, ConversionResult)
    model = convert_model(symbol, args, auxs, 'bfloat16')
    assert record.symbol.tojson() == model[0].tojson()
    assert sorted(record.arg_params) == sorted(model[1]) and sorted(record.aux_params) == sorted(model[2])
    assert 'conv0' in record.conversion.node_precision
    graph_only = convert_with_record(symbol, 'bfloat16')
    assert graph_only.arg_params is None and graph_only.aux_params is None
    assert graph_only.symbol.tojson() == convert_symbol(symbol, 'bfloat16').tojson()
    assert 'conv0' in graph_only.conversion.node_precision
    with warnings.catch_warnings():
        warnings.simplefilter('error')      # the call warns about nothing
        assert convert_with_record(symbol, 'float32').conversion is None


def test_convert_with_record_defaults_to_auto_and_refuses_options_that_do_not_apply():
    import warnings
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')         # 'auto' may stay float32 here: said once
        assert (convert_with_record(symbol, ctx=mx.cpu()).symbol.tojson()
                == convert_with_record(symbol, 'auto', ctx=mx.cpu()).symbol.tojson())
    with pytest.raises(TypeError, match=r'^convert_with_record\(\): params applies without arg_params'):
        convert_with_record(symbol, 'bfloat16', arg_params=args, aux_params=auxs, params=['fc_weight'])
    with pytest.raises(TypeError, match=r'^convert_with_record\(\): for_inference applies to a checkpoint'):
        convert_with_record(symbol, 'bfloat16', for_inference=True)
    with pytest.raises(TypeError, match=r'^convert_with_record\(\): aux_params applies to a checkpoint'):
        convert_with_record(symbol, 'bfloat16', aux_params=auxs)
