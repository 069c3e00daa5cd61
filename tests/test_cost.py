"""Layers too small for bfloat16 to pay stay FP32 under 'auto' (mxamp.cost, Policy.costs)."""
import json
import warnings

import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import mxamp
from mxamp import cost, hardware
from mxamp.graph import convert_graph, region_works
from mxamp.policy import Policy, Rules

from conftest import needs_bfloat16_compute, relative_error

MODEL = cost.CostModel({'FullyConnected': 10.0, 'Convolution': 20.0, 'Deconvolution': 20.0})
BFLOAT16_CLASSES = [klass for klass in hardware.CPU_CLASSES if hardware.computes_bfloat16(klass)]


def _output_shape(symbol, **shapes):
    return tuple(symbol.infer_shape(**shapes)[1][0])


@pytest.mark.parametrize('flatten', [True, False])
def test_a_dense_layer_does_two_flops_per_multiply_add(flatten):
    sym = mx.sym.FullyConnected(mx.sym.var('x'), num_hidden=7, flatten=flatten, name='fc')
    data = (4, 3, 5)
    in_units = 15 if flatten else 5
    work = cost.layer_work('FullyConnected', [data, (7, in_units)],
                           _output_shape(sym, x=data))
    rows = 4 if flatten else 12
    assert work == pytest.approx(2e-6 * rows * in_units * 7)


def test_a_convolution_counts_its_groups_strides_and_padding():
    sym = mx.sym.Convolution(mx.sym.var('x'), kernel=(3, 3), stride=(2, 2), pad=(1, 1),
                             num_filter=8, num_group=2, name='conv')
    data, weight = (2, 4, 9, 9), (8, 2, 3, 3)
    work = cost.layer_work('Convolution', [data, weight], _output_shape(sym, x=data))
    # 5 x 5 outputs per map, 8 maps, each from 2 channels of 3 x 3 taps.
    assert work == pytest.approx(2e-6 * 2 * 8 * 5 * 5 * 2 * 9)


def test_a_deconvolution_counts_its_input():
    work = cost.layer_work('Deconvolution', [(2, 4, 6, 6), (4, 3, 2, 2)], (2, 3, 12, 12))
    assert work == pytest.approx(2e-6 * 2 * 4 * 6 * 6 * 3 * 4)


def test_unknown_shapes_and_other_operators_have_no_work():
    assert cost.layer_work('FullyConnected', [None, None], None) is None
    assert cost.layer_work('Activation', [(2, 3)], (2, 3)) is None
    assert MODEL.pays('FullyConnected', None)


def test_the_largest_unpaid_layer_is_named_only_when_none_pays():
    small = {'a': ('FullyConnected', 1.0), 'b': ('Convolution', 5.0)}
    assert cost.largest_unpaid(small, MODEL) == ('b', 'Convolution', 5.0, 20.0)
    assert cost.largest_unpaid(dict(small, c=('FullyConnected', 12.0)), MODEL) is None
    assert cost.largest_unpaid({}, MODEL) is None


@pytest.mark.parametrize('inference', [False, True], ids=['training', 'inference'])
@pytest.mark.parametrize('klass', BFLOAT16_CLASSES)
def test_every_bfloat16_class_has_a_measured_model(klass, inference):
    model = cost.model_for(klass, inference=inference)
    assert set(model.pays_from) == set(model.per_cast_value) == set(cost.GEMM_OPS)
    assert all(threshold > 0 for threshold in model.pays_from.values())
    assert all(threshold > 0 for threshold in model.per_cast_value.values())


@pytest.mark.parametrize('klass', BFLOAT16_CLASSES)
def test_inference_pays_from_layers_no_larger_than_training(klass):
    # No backward pass and no FP32 master weights to step: what pays in training pays here.
    training, inference = cost.model_for(klass), cost.model_for(klass, inference=True)
    for op in cost.GEMM_OPS:
        assert inference.pays_from[op] <= training.pays_from[op]
        assert inference.per_cast_value[op] <= training.per_cast_value[op]


def test_classes_without_bfloat16_have_no_model():
    assert cost.model_for(hardware.AVX2) is None
    assert cost.model_for(hardware.AVX2, inference=True) is None


def _head_on_a_trunk():
    """A convolution doing 37.7 MFLOP at batch 8 (pays under MODEL), then FP32 global pooling
    and a dense head of 0.005 MFLOP with its activations (which do not)."""
    x = mx.sym.var('data')
    conv = mx.sym.Convolution(x, kernel=(3, 3), pad=(1, 1), num_filter=32, name='conv')
    act = mx.sym.Activation(conv, act_type='relu', name='relu')
    # Global pooling without a kernel size has no bfloat16 kernel: the head's data is FP32.
    pool = mx.sym.Pooling(act, global_pool=True, pool_type='avg', name='pool')
    fc = mx.sym.FullyConnected(pool, num_hidden=10, name='fc')
    head = mx.sym.Activation(mx.sym.FullyConnected(mx.sym.Activation(fc, act_type='tanh', name='tanh'),
                                                   num_hidden=4, name='fc2'),
                             act_type='sigmoid', name='sigmoid')
    params = ['conv_weight', 'conv_bias', 'fc_weight', 'fc_bias', 'fc2_weight', 'fc2_bias']
    return head, params, {'data': (8, 32, 16, 16)}


def test_auto_keeps_the_small_head_in_float32_and_the_trunk_low():
    sym, params, shapes = _head_on_a_trunk()
    policy = Policy('bfloat16', costs=MODEL)
    conversion = convert_graph(sym, policy, params=params, shapes=shapes)
    precision = conversion.node_precision
    assert precision['conv'] == precision['relu'] == 'bfloat16'
    assert precision['pool'] == 'float32'
    # The head's layers are too small; the activations between them follow their inputs.
    assert precision['fc'] == precision['tanh'] == precision['fc2'] == precision['sigmoid'] == 'float32'
    assert set(conversion.small_layers) == {'fc', 'fc2'}
    assert conversion.small_layers['fc'] == pytest.approx(2e-6 * 8 * 32 * 10)
    # Their weights (small too) stay stored in bfloat16, read through casts: a larger batch
    # may make the layers pay.
    assert conversion.lp_params == set(params)
    fc2 = [node for node in conversion.nodes if node.name == 'fc2'][0]
    assert fc2.inputs[1].cast.to_dtype == 'float32'


def test_a_small_layer_whose_data_is_already_low_stays_low():
    # Keeping it in FP32 would add the casts: only a layer whose data is FP32 is weighed.
    x = mx.sym.var('data')
    trunk = mx.sym.Convolution(x, kernel=(3, 3), pad=(1, 1), num_filter=32, name='conv')
    inside = mx.sym.FullyConnected(trunk, num_hidden=16, name='inside')      # 2.1 MFLOP
    alone = mx.sym.FullyConnected(mx.sym.var('features'), num_hidden=16, name='alone')
    sym = mx.sym.Group([inside, alone])
    shapes = {'data': (8, 32, 16, 16), 'features': (8, 2048)}                # alone: 0.5 MFLOP
    conversion = convert_graph(sym, Policy('bfloat16', costs=MODEL), shapes=shapes)
    assert conversion.node_precision['inside'] == 'bfloat16'
    assert conversion.node_precision['alone'] == 'float32'
    assert set(conversion.small_layers) == {'alone'}


def test_a_layer_too_small_alone_pays_in_a_region_that_does_enough_work_together():
    model = cost.CostModel({'FullyConnected': 10.0, 'Convolution': 10.0},
                           {'FullyConnected': 100.0}, region_pays_from={'FullyConnected': 4.0})
    assert not model.pays('FullyConnected', 2.0)                        # it opens no region
    assert not model.pays('FullyConnected', 2.0, region_work=3.0)
    assert model.pays('FullyConnected', 2.0, region_work=4.0)
    assert not model.pays('Convolution', 2.0, region_work=50.0)         # pays only alone
    # Its casts are weighed as before: 2 MFLOP for 40,000 values cast out is too little.
    assert not model.pays('FullyConnected', 2.0, cast_values=40000, region_work=4.0)


def _dense_regions():
    """fc1 -> relu -> fc2 (a region), fc2 -> softmax -> fc3 and fc2 + x -> fc4 (FP32 and the
    widest of two inputs between: no region), fc1 -> Cast -> fc5 (a cast between)."""
    x = mx.sym.var('data')
    fc1 = mx.sym.FullyConnected(x, num_hidden=32, name='fc1')
    fc2 = mx.sym.FullyConnected(mx.sym.Activation(fc1, act_type='relu', name='relu'),
                                num_hidden=32, name='fc2')
    fc3 = mx.sym.FullyConnected(mx.sym.softmax(fc2, name='softmax'), num_hidden=4, name='fc3')
    fc4 = mx.sym.FullyConnected(mx.sym.elemwise_add(fc2, mx.sym.var('other'), name='add'),
                                num_hidden=4, name='fc4')
    fc5 = mx.sym.FullyConnected(mx.sym.Cast(fc1, dtype='float32', name='cast'), num_hidden=4,
                                name='fc5')
    return mx.sym.Group([fc3, fc4, fc5]), {'data': (8, 20), 'other': (8, 32)}


def test_a_region_is_a_layer_and_the_layers_reading_it_through_low_precision():
    sym, _ = _dense_regions()
    graph = json.loads(sym.tojson())
    index = {node['name']: nid for nid, node in enumerate(graph['nodes'])}
    works = {index[name]: work for name, work in
             (('fc1', 1.0), ('fc2', 2.0), ('fc3', 4.0), ('fc4', 8.0), ('fc5', 16.0))}
    regions = region_works(graph, Policy('bfloat16', costs=MODEL), works)
    assert regions == {index['fc1']: 3.0}
    # A layer the user keeps in FP32 ends the region without joining it.
    kept = Policy('bfloat16', Rules.of(exclude=['fc2']), costs=MODEL)
    assert region_works(graph, kept, works) == {}


def test_auto_computes_a_region_of_small_layers_in_bfloat16_when_it_pays_together():
    sym, shapes = _dense_regions()
    # fc1: 2e-6 * 8 * 20 * 32 = 0.01024 MFLOP, fc2 0.016384: 0.026624 together.
    for region_threshold, precision in ((0.026, 'bfloat16'), (0.027, 'float32')):
        model = cost.CostModel({op: 1.0 for op in cost.GEMM_OPS},
                               region_pays_from={'FullyConnected': region_threshold})
        conversion = convert_graph(sym, Policy('bfloat16', costs=model), shapes=shapes)
        precisions = conversion.node_precision
        assert precisions['fc1'] == precisions['relu'] == precisions['fc2'] == precision
        assert ('fc1' in conversion.small_layers) == (precision == 'float32')
        assert conversion.region_layers == (
            {'fc1': pytest.approx(0.026624)} if precision == 'bfloat16' else {})
        # The softmax's and the addition's readers open no region: FP32 as before.
        assert precisions['fc3'] == precisions['fc4'] == 'float32'


@pytest.mark.parametrize('klass', BFLOAT16_CLASSES)
def test_the_table_weighs_regions_of_dense_layers_for_inference_and_convolutions_for_training(klass):
    # In training steps a small dense layer ran slower even inside a chain; a convolution
    # normalized by a BatchNorm gained inside from smaller sizes (docs/policy.rst).
    # Not on the AMX class until measured there: a small CIFAR ResNet trained slower.
    training, inference = cost.model_for(klass), cost.model_for(klass, inference=True)
    assert set(training.region_pays_from) == (
        {'Convolution', 'Deconvolution'} if klass == 'avx512_bf16' else set())
    assert set(inference.region_pays_from) == {'FullyConnected'}
    for model in (training, inference):
        for op, threshold in model.region_pays_from.items():
            assert 0 < model.inside_pays_from[op] <= model.pays_from[op] <= threshold or \
                model.inside_pays_from[op] <= threshold < model.pays_from[op]
    for op in training.region_pays_from:
        normalized = training.normalized_inside_pays_from[op]
        assert 0 < normalized < training.inside_pays_from[op]
        assert training.counts_in_region(op, normalized, normalized=True)
        assert not training.counts_in_region(op, normalized)
    assert inference.normalized_inside_pays_from == {}


def _conv_chain(residual=False, outside=False):
    """conv1 -> bn1 -> relu1 -> conv2 -> bn2 -> relu2 -> conv3 (-> fc), a chain of
    convolution-BatchNorm-ReLU blocks; `residual` adds relu1 to bn3 before a last ReLU and
    conv4 (both branches in the region), `outside` adds an input from outside it instead."""
    x = mx.sym.var('data')
    relu1 = mx.sym.Activation(mx.sym.BatchNorm(mx.sym.Convolution(
        x, kernel=(3, 3), pad=(1, 1), num_filter=16, name='conv1'), name='bn1'),
        act_type='relu', name='relu1')
    relu2 = mx.sym.Activation(mx.sym.BatchNorm(mx.sym.Convolution(
        relu1, kernel=(3, 3), pad=(1, 1), num_filter=16, name='conv2'), name='bn2'),
        act_type='relu', name='relu2')
    top = mx.sym.BatchNorm(mx.sym.Convolution(relu2, kernel=(3, 3), pad=(1, 1), num_filter=16,
                                              name='conv3'), name='bn3')
    if residual or outside:
        other = mx.sym.var('other') if outside else relu1
        top = mx.sym.Convolution(mx.sym.Activation(mx.sym.elemwise_add(top, other, name='add'),
                                                   act_type='relu', name='relu3'),
                                 kernel=(1, 1), num_filter=16, name='conv4')
    return mx.sym.FullyConnected(top, num_hidden=4, name='fc')


def _chain_works(sym, works):
    graph = json.loads(sym.tojson())
    index = {node['name']: nid for nid, node in enumerate(graph['nodes'])}
    return graph, index, {index[name]: work for name, work in works.items() if name in index}


_CHAIN_MODEL = cost.CostModel({'Convolution': 100.0, 'FullyConnected': 100.0},
                              region_pays_from={'Convolution': 50.0},
                              inside_pays_from={'Convolution': 100.0, 'FullyConnected': 100.0},
                              normalized_inside_pays_from={'Convolution': 10.0})


def test_a_region_runs_through_every_layer_that_keeps_low_precision_to_its_edges():
    works = {'conv1': 5.0, 'conv2': 20.0, 'conv3': 30.0, 'conv4': 40.0, 'fc': 1.0}
    policy = Policy('bfloat16', costs=_CHAIN_MODEL, cpu_class='avx512_bf16')
    graph, index, gemm = _chain_works(_conv_chain(), works)
    # conv1's region holds conv2 and conv3 (normalized: they count from 10 MFLOP), not the
    # dense layer (below its inside threshold) nor conv1 itself (5 MFLOP).
    regions = region_works(graph, policy, gemm)
    assert regions[index['conv1']] == 50.0 and regions[index['conv2']] == 50.0
    assert index['conv3'] not in regions    # nothing counted after it
    # A residual addition of two branches of the region joins it; an outside input ends it.
    graph, index, gemm = _chain_works(_conv_chain(residual=True), works)
    assert region_works(graph, policy, gemm)[index['conv1']] == 50.0    # conv4: bare, 40 < 100
    bare_counts = cost.CostModel(_CHAIN_MODEL.pays_from, region_pays_from={'Convolution': 50.0},
                                 normalized_inside_pays_from={'Convolution': 10.0})
    bare_policy = Policy('bfloat16', costs=bare_counts, cpu_class='avx512_bf16')
    assert region_works(graph, bare_policy, gemm)[index['conv1']] == 91.0
    graph, index, gemm = _chain_works(_conv_chain(outside=True), works)
    assert region_works(graph, bare_policy, gemm)[index['conv1']] == 50.0
    # A convolution that runs in FP32 for its layout ends the region and opens none.
    graph, index, gemm = _chain_works(_conv_chain(), works)
    regions = region_works(graph, policy, gemm, runs_float32={index['conv2']})
    assert index['conv1'] not in regions and index['conv2'] not in regions


@pytest.mark.parametrize('batch, precision', [(2, 'float32'), (3, 'bfloat16')])
def test_auto_trains_a_chain_of_normalized_convolutions_in_bfloat16_when_it_pays_together(
        batch, precision):
    # Each convolution does 2e-6 * batch * 16 * 8 * 8 * 16 * 9 MFLOP (0.59 at batch 2, 0.88
    # at 3): three of them do 1.77 and 2.65, either side of the region threshold.
    work = 2e-6 * batch * 16 * 64 * 16 * 9
    model = cost.CostModel({op: 1e3 for op in cost.GEMM_OPS},
                           region_pays_from={'Convolution': 2.0},
                           inside_pays_from={'Convolution': 1e3, 'FullyConnected': 1e3},
                           normalized_inside_pays_from={'Convolution': 0.5})
    conversion = convert_graph(_conv_chain(), Policy('bfloat16', costs=model,
                                                     cpu_class='avx512_bf16'),
                               shapes={'data': (batch, 16, 8, 8)})
    precisions = conversion.node_precision
    # The dense layer after them reads their output: it follows, in bfloat16 or FP32.
    assert {precisions[name] for name in ('conv1', 'bn1', 'relu1', 'conv2', 'conv3', 'fc')} == {
        precision}
    assert conversion.region_layers == (
        {'conv1': pytest.approx(3 * work)} if precision == 'bfloat16' else {})
    assert ('conv1' in conversion.small_layers) == (precision == 'float32')


def test_a_decoder_tied_to_an_embedding_counts_its_weight_and_output_casts():
    # gluonnlp's language models: the decoder reads the embedding's weight (FP32: Embedding
    # computes in FP32) and its scores go out of the graph: both are cast at every call.
    tokens, weight = mx.sym.var('tokens'), mx.sym.var('embed_weight')
    embedded = mx.sym.Embedding(tokens, weight=weight, input_dim=1000, output_dim=64, name='embed')
    hidden = mx.sym.var('hidden')
    decoder = mx.sym.FullyConnected(hidden, weight=weight, num_hidden=1000, no_bias=True,
                                    flatten=False, name='decoder')
    sym = mx.sym.Group([embedded, decoder])
    shapes = {'tokens': (35, 20), 'hidden': (35, 20, 64), 'embed_weight': (1000, 64)}
    model = cost.CostModel({'FullyConnected': 10.0}, per_cast_value={'FullyConnected': 1024})
    conversion = convert_graph(sym, Policy('bfloat16', costs=model), params=['embed_weight'],
                               shapes=shapes)
    # 89.6 MFLOP against 700,000 scores and 64,000 weights cast: 117 FLOP a value.
    assert conversion.small_layers == {'decoder': pytest.approx(2e-6 * 700 * 64 * 1000)}
    generous = cost.CostModel({'FullyConnected': 10.0}, per_cast_value={'FullyConnected': 100})
    conversion = convert_graph(sym, Policy('bfloat16', costs=generous), params=['embed_weight'],
                               shapes=shapes)
    assert conversion.node_precision['decoder'] == 'bfloat16'


def test_without_a_cost_model_every_layer_is_low():
    sym, params, shapes = _head_on_a_trunk()
    conversion = convert_graph(sym, Policy('bfloat16'), params=params, shapes=shapes)
    assert conversion.small_layers == {}
    assert conversion.node_precision['fc2'] == 'bfloat16'
    assert conversion.works['fc2'] == pytest.approx(2e-6 * 8 * 10 * 4)


def test_the_users_lp_ops_outweigh_the_cost_model():
    sym, params, shapes = _head_on_a_trunk()
    policy = Policy('bfloat16', Rules.of(lp_ops=['FullyConnected']), costs=MODEL)
    conversion = convert_graph(sym, policy, params=params, shapes=shapes)
    assert conversion.small_layers == {}
    assert conversion.node_precision['fc2'] == 'bfloat16'


def _small_mlp():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(32, activation='tanh', in_units=20),
            gluon.nn.Dense(16, activation='relu', in_units=32), gluon.nn.Dense(3, in_units=16))
    return net


def _fp32_twin(seed):
    """Two small MLPs with the same FP32 initial values."""
    nets = []
    for _ in range(2):
        mx.random.seed(seed)
        net = _small_mlp()
        net.initialize(mx.init.Xavier())
        nets.append(net)
    return nets


def _train(net, trainer, batches):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for x, y in batches:
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        losses.append(loss.asnumpy())
    return np.array(losses)


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason="'auto' is float32 on this CPU class: nothing to decide")
def test_auto_trains_a_net_too_small_to_pay_exactly_as_float32():
    reference, net = _fp32_twin(seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        mxamp.convert(net, 'auto')
        net.hybridize()
        rng = np.random.RandomState(0)
        batches = [(mx.nd.array(rng.normal(size=(8, 20))), mx.nd.array(rng.randint(0, 3, 8)))
                   for _ in range(4)]
        got = _train(net, mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1}),
                     batches)
    want = _train(reference, gluon.Trainer(reference.collect_params(), 'sgd',
                                           {'learning_rate': 0.1}), batches)
    np.testing.assert_array_equal(got, want)
    assert {np.dtype(p.dtype) for p in net.collect_params().values()} == {np.dtype('float32')}
    text = mxamp.summary(net, print_fn=None)
    assert 'ops: ' in text and 'bfloat16' not in text.split('ops: ')[1].split('\n')[0]
    assert 'the whole net computes in float32' in text
    said = [str(w.message) for w in caught if "dtype='auto' computes" in str(w.message)]
    assert len(said) <= 1      # once per process: an earlier test may have said it
    if said:
        assert 'FullyConnected' in said[0] and 'bfloat16 pays from' in said[0]


@needs_bfloat16_compute
def test_bfloat16_asked_for_a_small_net_computes_it_and_says_it_will_be_slower(monkeypatch):
    from mxamp import gluon as gluon_front, gluon_warnings
    monkeypatch.setattr(gluon_warnings, '_warned_unpaid', False)
    _, net = _fp32_twin(seed=4)
    mxamp.convert(net, 'bfloat16')
    with pytest.warns(RuntimeWarning, match=r"computes in bfloat16 as asked.*expect it slower "
                                            r"than float32 .dtype='auto' would keep it in "
                                            r"float32; mxamp\.profile\(net, \*inputs, "
                                            r"train=True\) times both on this machine\)"):
        net(mx.nd.ones((8, 20))).wait_to_read()
    conversion, _ = gluon_front.conversion_of(net)
    assert conversion.small_layers == {}
    assert conversion.node_precision[[n.name for n in conversion.nodes
                                      if n.op == 'FullyConnected'][0]] == 'bfloat16'


@needs_bfloat16_compute
def test_bfloat16_asked_for_inference_says_it_will_be_slower_without_a_profile_to_run(
        monkeypatch):
    # A fused net built for inference alone is not one mxamp.profile times: no hint.
    from mxamp import gluon_warnings
    monkeypatch.setattr(gluon_warnings, '_warned_unpaid', False)
    net, x = _mlp_and_batch(seed=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        mxamp.for_inference(net, x, dtype='bfloat16')
    (unpaid,) = [str(w.message) for w in caught if 'expect it slower' in str(w.message)]
    assert unpaid.endswith("(dtype='auto' would keep it in float32)")


@needs_bfloat16_compute
def test_bfloat16_asked_for_a_layer_that_pays_by_work_but_not_per_value_says_so(monkeypatch):
    # 134 MFLOP (pays by work) for a million scores that go out of the graph: 128 FLOP a
    # value cast, below what pays, so 'auto' keeps it FP32; asked for, bfloat16 warns.
    from mxamp import gluon as gluon_front, gluon_warnings
    monkeypatch.setattr(gluon_warnings, '_warned_unpaid', False)
    mx.random.seed(6)
    net = gluon.nn.Dense(4096, in_units=64)
    net.initialize()
    mxamp.convert(net, 'bfloat16')
    with pytest.warns(RuntimeWarning, match="computes in bfloat16 as asked, but its layers that "
                                            "do enough work cast more values"):
        net(mx.nd.ones((256, 64))).wait_to_read()
    conversion, _ = gluon_front.conversion_of(net)
    assert set(conversion.node_precision.values()) == {'bfloat16'}


@needs_bfloat16_compute
def test_auto_keeps_layers_that_pay_in_bfloat16():
    mx.random.seed(5)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(1024, activation='relu'), gluon.nn.Dense(1024))
    net.initialize()
    mxamp.convert(net, 'auto')
    net(mx.nd.ones((64, 1024))).wait_to_read()   # 134 MFLOP, 2,048 FLOP a value: pays
    conversion, _ = mxamp.gluon.conversion_of(net)
    assert conversion.small_layers == {}
    assert conversion.computes_low
    assert all(p.dtype != np.float32 for name, p in net.collect_params().items()
               if name.endswith('weight'))


def _small_mlp_symbol():
    x = mx.sym.var('data')
    h = mx.sym.Activation(mx.sym.FullyConnected(x, num_hidden=32, name='fc1'), act_type='relu',
                          name='relu1')
    return mx.sym.FullyConnected(h, num_hidden=4, name='fc2')


def _mlp_params():
    rng = np.random.RandomState(0)
    shapes = {'fc1_weight': (32, 20), 'fc1_bias': (32,), 'fc2_weight': (4, 32), 'fc2_bias': (4,)}
    return {name: mx.nd.array(rng.normal(size=shape)) for name, shape in shapes.items()}


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason="'auto' is float32 on this CPU class: nothing to decide")
def test_the_symbol_front_keeps_small_layers_in_float32_under_auto():
    sym, args = _small_mlp_symbol(), _mlp_params()
    auto = mxamp.convert_with_record(sym, 'auto', arg_params=args, aux_params={},
                                     input_shapes={'data': (8, 20)})
    assert set(auto.conversion.small_layers) == {'fc1', 'fc2'}
    assert not auto.conversion.computes_low
    assert {np.dtype(value.dtype) for value in auto.arg_params.values()} == {np.dtype('float32')}
    asked = mxamp.convert_with_record(sym, 'bfloat16', arg_params=args, aux_params={},
                                      input_shapes={'data': (8, 20)})
    assert asked.conversion.small_layers == {}
    assert asked.conversion.node_precision['fc1'] == 'bfloat16'


def test_without_input_shapes_the_symbol_front_cannot_weigh_layers():
    sym = _small_mlp_symbol()
    conversion = mxamp.convert_with_record(sym, 'bfloat16', cpu_class='avx512_bf16').conversion
    assert conversion.works == {} and conversion.small_layers == {}


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason="'auto' is float32 on this CPU class: nothing to decide")
def test_a_first_call_on_one_sample_does_not_keep_the_net_in_float32():
    mx.random.seed(6)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(1024, activation='relu', in_units=1024),
            gluon.nn.Dense(1024, in_units=1024))
    net.initialize()
    mxamp.convert(net, 'auto')
    net.hybridize()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net(mx.nd.ones((1, 1024))).wait_to_read()
    assert not mxamp.gluon.conversion_of(net)[0].computes_low
    net(mx.nd.ones((64, 1024))).wait_to_read()   # 134 MFLOP a layer: pays
    conversion, _ = mxamp.gluon.conversion_of(net)
    assert conversion.small_layers == {} and conversion.computes_low


def test_profile_runs_a_net_converted_under_auto_after_a_call_at_another_size():
    mx.random.seed(7)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(32, activation='relu'), gluon.nn.Dense(4))
    net.initialize()
    x = mx.nd.ones((4, 16))
    net(x[:1]).wait_to_read()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        mxamp.convert(net, 'auto')
        net.hybridize()
        report = mxamp.profile(net, x, iterations=1, warmup=1, kernels=False)
    assert report is not None


# Inference alone (mxamp.for_inference, a Symbol converted for_inference) weighs layers with the
# class's inference model; these tests give the two models values far apart, whatever the table.
_TRAINING_ONLY_LARGE = cost.CostModel({op: 1e6 for op in cost.GEMM_OPS})
_INFERENCE_ANY = cost.CostModel({op: 1e-3 for op in cost.GEMM_OPS})
# No layer pays alone; any two dense layers together do.
_REGIONS_ONLY = cost.CostModel({op: 1e6 for op in cost.GEMM_OPS},
                               region_pays_from={'FullyConnected': 1e-3})


def _weigh_inference_with(monkeypatch, inference_model):
    """`cost.model_for` giving `inference_model` for inference and `_TRAINING_ONLY_LARGE` for
    training, on the classes that compute bfloat16."""
    monkeypatch.setattr(cost, 'model_for', lambda klass, inference=False: (
        None if not hardware.computes_bfloat16(klass)
        else inference_model if inference else _TRAINING_ONLY_LARGE))


@pytest.fixture
def far_apart_models(monkeypatch):
    _weigh_inference_with(monkeypatch, _INFERENCE_ANY)


def _mlp_and_batch(seed):
    """`_small_mlp`, initialised from `seed`, and a batch for it."""
    mx.random.seed(seed)
    net = _small_mlp()
    net.initialize(mx.init.Xavier())
    return net, mx.nd.random.uniform(-1, 1, shape=(16, 20))


def _relative_error(got, want):
    return relative_error(got.astype('float32').asnumpy(), want.asnumpy())


@needs_bfloat16_compute
@pytest.mark.usefixtures('far_apart_models', 'quiet_precision_warnings')
def test_for_inference_weighs_a_trained_auto_net_with_the_inference_model():
    net, x = _mlp_and_batch(seed=8)
    mxamp.convert(net, 'auto')
    net.hybridize()
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    assert not mxamp.gluon.conversion_of(net)[0].computes_low   # training: FP32 throughout
    want = net(x)
    trained = {name: p.data().copy() for name, p in net.collect_params().items()}
    mxamp.for_inference(net, x)
    conversion, _ = mxamp.gluon.conversion_of(net)
    assert conversion.computes_low and conversion.small_layers == {}
    assert {conversion.node_precision[n.name] for n in conversion.nodes
            if n.op == 'FullyConnected'} == {'bfloat16'}
    assert _relative_error(net(x), want) < 0.02
    # The trained values stay as they were, in FP32, read through casts.
    for name, p in net.collect_params().items():
        assert p.data().dtype == np.float32
        np.testing.assert_array_equal(p.data().asnumpy(), trained[name].asnumpy())


@needs_bfloat16_compute
@pytest.mark.usefixtures('far_apart_models', 'quiet_precision_warnings')
def test_for_inference_under_auto_stores_the_layers_that_pay_for_inference_low():
    net, x = _mlp_and_batch(seed=9)
    want = net(x)
    mxamp.for_inference(net, x)
    conversion, _ = mxamp.gluon.conversion_of(net)
    assert conversion.computes_low
    assert all(p.data().dtype != np.float32 for p in net.collect_params().values())
    assert _relative_error(net(x), want) < 0.02


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason="'auto' is float32 on this CPU class: nothing to decide")
@pytest.mark.usefixtures('far_apart_models')
def test_the_symbol_front_weighs_a_graph_for_inference_with_the_inference_model():
    sym, args = _small_mlp_symbol(), _mlp_params()
    options = dict(arg_params=args, aux_params={}, input_shapes={'data': (8, 20)})
    trained = mxamp.convert_with_record(sym, 'auto', **options)
    assert not trained.conversion.computes_low
    inferred = mxamp.convert_with_record(sym, 'auto', for_inference=True, **options)
    assert inferred.conversion.small_layers == {}
    assert inferred.conversion.node_precision['fc1'] == 'bfloat16'


@needs_bfloat16_compute
@pytest.mark.usefixtures('quiet_precision_warnings')
def test_a_larger_batch_after_for_inference_is_weighed_for_inference(monkeypatch):
    # One sample keeps the first layer FP32 under both models; 16 pay under the inference
    # model alone, so the fused net builds its graph again in bfloat16 only if that model weighs.
    _weigh_inference_with(monkeypatch, cost.CostModel({op: 0.01 for op in cost.GEMM_OPS}))
    net, x = _mlp_and_batch(seed=10)
    want = net(x)
    mxamp.for_inference(net, x[:1])
    net(x[:1]).wait_to_read()
    assert not mxamp.gluon.conversion_of(net)[0].computes_low
    got = net(x)
    conversion, _ = mxamp.gluon.conversion_of(net)
    assert conversion.computes_low and conversion.small_layers == {}
    assert _relative_error(got, want) < 0.02


@needs_bfloat16_compute
@pytest.mark.parametrize('dtype', ['auto', 'bfloat16'])
def test_for_inference_computes_a_net_whose_layers_pay_only_together_in_bfloat16(
        monkeypatch, dtype):
    # No layer pays alone under either model; together the inference model's regions do.
    from mxamp import gluon_warnings
    monkeypatch.setattr(gluon_warnings, '_warned_unpaid', False)
    _weigh_inference_with(monkeypatch, _REGIONS_ONLY)
    net, x = _mlp_and_batch(seed=11)
    want = net(x)
    with warnings.catch_warnings():
        warnings.simplefilter('error')      # neither 'auto' nor 'bfloat16' warns: it pays
        fused = mxamp.for_inference(net, x, dtype=dtype)
        got = fused(x)
    conversion, _ = mxamp.gluon.conversion_of(net)
    assert conversion.small_layers == {}
    assert {conversion.node_precision[n.name] for n in conversion.nodes
            if n.op == 'FullyConnected'} == {'bfloat16'}
    assert _relative_error(got, want) < 0.02
    # The summary says which layer pays only with the ones reading it, under 'auto' alone.
    (first,) = conversion.region_layers if dtype == 'auto' else ('',)
    lines = [line for line in mxamp.summary(fused).splitlines() if 'too small alone' in line]
    assert lines == ([] if dtype == 'bfloat16' else [
        "in bfloat16 with the layers reading them, too small alone (dtype='auto'): %s "
        "(0.0205 MFLOP a call, 0.0384 together)" % first])     # its three layers' work


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason="'auto' is float32 on this CPU class: nothing to decide")
def test_the_symbol_front_weighs_regions_for_inference(monkeypatch):
    _weigh_inference_with(monkeypatch, _REGIONS_ONLY)
    sym, args = _small_mlp_symbol(), _mlp_params()
    options = dict(arg_params=args, aux_params={}, input_shapes={'data': (8, 20)})
    assert not mxamp.convert_with_record(sym, 'auto', **options).conversion.computes_low
    inferred = mxamp.convert_with_record(sym, 'auto', for_inference=True, **options)
    assert inferred.conversion.small_layers == {}
    assert inferred.conversion.node_precision['fc1'] == inferred.conversion.node_precision[
        'fc2'] == 'bfloat16'


def test_a_convolution_on_padded_image_channels_opens_no_region():
    # A 3-channel stem computes on 4 (a zero channel appended): outside the ladders, and a CIFAR
    # ResNet whose stem opened its region trained 2x slower than with it in FP32.  The next
    # convolution opens the region instead.
    model = cost.CostModel({op: 1e3 for op in cost.GEMM_OPS},
                           region_pays_from={'Convolution': 1.6},
                           inside_pays_from={'Convolution': 1e3, 'FullyConnected': 1e3},
                           normalized_inside_pays_from={'Convolution': 0.5})
    work = 2e-6 * 3 * 16 * 64 * 16 * 9          # conv2 and conv3 each, at batch 3
    for channels, opener in ((3, 'conv2'), (16, 'conv1')):
        conversion = convert_graph(_conv_chain(), Policy('bfloat16', costs=model,
                                                         cpu_class='avx512_bf16'),
                                   shapes={'data': (3, channels, 8, 8)})
        precisions = conversion.node_precision
        assert list(conversion.region_layers) == [opener]
        assert precisions['conv1'] == ('float32' if channels == 3 else 'bfloat16')
        assert precisions['conv2'] == precisions['conv3'] == 'bfloat16'
    assert conversion.region_layers['conv1'] == pytest.approx(3 * work)


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason="'auto' is float32 on this CPU class: nothing to decide")
def test_the_table_trains_mobilenet_in_bfloat16_from_a_batch_where_its_regions_pay():
    # MobileNet 0.25's convolutions do 1.8-103 MFLOP each at batch 16, none enough alone; its
    # conv-BN-ReLU region trains 1.36x FP32 in bfloat16 on an avx512_bf16 CPU (docs/policy.rst).
    # At batch 4 its pointwise convolutions (12.8-25.7 MFLOP) count for nothing and it stays
    # FP32.  (On an AMX CPU its 16-channel and depthwise convolutions train in FP32 for their
    # layout, and so does the whole net.)
    from gluoncv import model_zoo
    sym = model_zoo.get_model('mobilenet0.25')(mx.sym.var('data'))
    convs = [node['name'] for node in json.loads(sym.tojson())['nodes']
             if node['op'] == 'Convolution']
    for batch, computes_low in ((16, True), (4, False)):
        conversion = mxamp.convert_with_record(
            sym, 'auto', cpu_class='avx512_bf16',
            input_shapes={'data': (batch, 3, 224, 224)}).conversion
        low = [name for name in convs if conversion.node_precision[name] == 'bfloat16']
        assert conversion.computes_low == computes_low
        if computes_low:
            # The stem and the depthwise layer after it run FP32 for their 8 channels' layout;
            # the first pointwise layer opens the region, and every later layer is in it.
            assert low == convs[2:] and list(conversion.region_layers) == [convs[2]]
        else:
            assert low == [] and conversion.region_layers == {}
