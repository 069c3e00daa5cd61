"""The inference policy: what a graph fused for inference alone computes in bfloat16.

`mxamp.for_inference` and ``convert_model(..., for_inference=True)`` convert
under ``Policy(inference=True)``: the layout rule that exists for training
alone (on AMX CPUs, convolutions its AMX kernels do not take run in FP32,
for BatchNorm's backward) is off, and a ReLU6 (``clip`` from 0) that MXNet's
oneDNN backend fuses into the bfloat16 convolution before it computes there
instead of in FP32 between two casts.  The decisions are checked on graphs
(every CPU); the fused runs need a CPU that computes bfloat16.
"""
import collections
import json

import mxnet as mx
import numpy as np
import pytest
from mxnet.gluon import HybridBlock, nn

import mxamp
import mxamp.gluon as mg
from conftest import needs_bfloat16_compute
from mxamp import hardware, inference
from mxamp.dtypes import ROUNDING_SUFFIX
from mxamp.graph import NO_FOLD_SUFFIX, convert_graph, convolution_post_ops, load_graph
from mxamp.graph_check import check_graph
from mxamp.policy import Policy, Rules

pytestmark = pytest.mark.usefixtures('quiet_precision_warnings')


def _conv(data, channels, name, kernel=3, groups=1):
    return mx.sym.Convolution(data, kernel=(kernel, kernel), pad=(kernel // 2,) * 2,
                              num_filter=channels, num_group=groups, name=name)


def _relu6(data, name='relu6', a_min=0):
    return mx.sym.clip(data, a_min, 6, name=name)


def _conv_layout(policy, channels_in, channels_out, kernel=3, size=8, groups=1):
    shapes = [(4, channels_in, size, size), (channels_out, channels_in // groups, kernel, kernel)]
    attrs = {'kernel': '(%d, %d)' % (kernel, kernel), 'num_group': str(groups)}
    return policy.layout('Convolution', attrs, shapes)


# ---------------------------------------------------------------------------
# The AMX layout rule is a training rule

def test_the_amx_layout_rule_is_for_training_only():
    training = Policy('bfloat16', cpu_class='amx')
    for_inference = Policy('bfloat16', cpu_class='amx', inference=True)
    # 16 and 48 channels: AVX512-BF16 kernels, whose layout meets AMX's at a BatchNorm's
    # backward.  Inference runs none: bfloat16, as on an AVX512-BF16 CPU.
    assert _conv_layout(training, 16, 16) == 'float32'
    assert _conv_layout(for_inference, 16, 16) == 'blocked'
    assert _conv_layout(training, 32, 48) == 'float32'
    assert _conv_layout(for_inference, 32, 48) == 'blocked'
    # Depthwise: the same.
    assert _conv_layout(training, 32, 32, groups=32) == 'float32'
    assert _conv_layout(for_inference, 32, 32, groups=32) == 'blocked'
    # What AMX kernels take is bfloat16 either way.
    assert _conv_layout(training, 64, 64) == _conv_layout(for_inference, 64, 64) == 'blocked'
    # The rules that keep a forward pass from crashing or computing garbage stay: a 1x1
    # convolution on a 6x6 map (oneDNN 2.4's AMX kernel corrupts the heap), a map
    # smaller than the stride.
    assert _conv_layout(for_inference, 64, 64, kernel=1, size=6) == 'float32'
    attrs = {'kernel': '(3, 3)', 'stride': '(2, 2)'}
    assert for_inference.layout('Convolution', attrs, [(4, 64, 1, 1), (64, 64, 3, 3)]) == 'float32'
    # Other classes have no training rule: the same decisions.
    for klass in ('avx512_bf16', 'avx2'):
        assert _conv_layout(Policy('bfloat16', cpu_class=klass), 16, 48) == \
            _conv_layout(Policy('bfloat16', cpu_class=klass, inference=True), 16, 48)
    assert 'inference=True' in repr(for_inference) and 'inference' not in repr(training)


# ---------------------------------------------------------------------------
# A ReLU6 fused into its convolution

def test_convolution_post_ops_are_what_mxnets_backend_fuses():
    data = mx.sym.var('data')
    conv = _conv(data, 16, 'conv')
    plain = _relu6(conv, 'direct')
    through_bn = _relu6(mx.sym.BatchNorm(_conv(plain, 16, 'conv1'), name='bn1'), 'after_bn')
    # conv -> BatchNorm -> elemwise_add (the convolution is either operand) -> ReLU6
    added = mx.sym.elemwise_add(through_bn, mx.sym.BatchNorm(_conv(through_bn, 16, 'conv2'),
                                                             name='bn2'), name='add')
    after_add = _relu6(added, 'after_add')
    # The convolution's output read twice: the backend stops at the branch.
    branched = _conv(after_add, 16, 'conv3')
    twice = mx.sym.elemwise_add(_relu6(branched, 'branch'), branched, name='add2')
    # Not a convolution: a dense layer's output.
    dense = _relu6(mx.sym.FullyConnected(twice, num_hidden=8, name='fc'), 'after_fc')
    graph = load_graph(mx.sym.Group([dense]))
    names = {graph['nodes'][nid]['name'] for nid in convolution_post_ops(graph)}
    assert {'direct', 'bn1', 'after_bn', 'bn2', 'add', 'after_add'} <= names
    assert not names & {'branch', 'add2', 'after_fc', 'conv1', 'conv'}


def test_convolution_post_ops_look_through_the_symbol_fronts_identity():
    conv = _conv(mx.sym.var('data'), 16, 'conv')
    kept = mx.sym.amp_cast(conv, dtype='bfloat16', name='conv' + NO_FOLD_SUFFIX)
    graph = load_graph(_relu6(mx.sym.BatchNorm(kept, name='bn')))
    names = {graph['nodes'][nid]['name'] for nid in convolution_post_ops(graph)}
    assert names == {'conv' + NO_FOLD_SUFFIX, 'bn', 'relu6'}


def _relu6_net(**relu6):
    """conv(16) -> BatchNorm -> ReLU6 -> conv(16), shapes known."""
    data = mx.sym.var('data')
    y = _relu6(mx.sym.BatchNorm(_conv(data, 16, 'conv0'), name='bn0'), **relu6)
    return _conv(y, 16, 'conv1'), {'data': (2, 16, 8, 8)}


def _computes_in(conversion, name):
    return next(record.computes_in for record in conversion.nodes if record.name == name)


def _checked(symbol, policy, shapes):
    graph = load_graph(symbol)
    params = [node['name'] for node in graph['nodes']
              if node['op'] == 'null' and node['name'] != 'data']
    conversion = convert_graph(symbol, policy, params=params, shapes=shapes)
    assert check_graph(conversion, policy, shapes=shapes) == []
    return conversion


@pytest.mark.parametrize('cpu_class', ['avx512_bf16', 'amx'])
def test_a_relu6_after_a_bfloat16_convolution_computes_in_it_for_inference(cpu_class):
    symbol, shapes = _relu6_net()
    fused = _checked(symbol, Policy('bfloat16', cpu_class=cpu_class, inference=True), shapes)
    assert _computes_in(fused, 'relu6') == 'bfloat16'
    assert not [cast for cast in fused.cast_nodes if 'relu6' in cast.name]
    # For training (and unfused inference) MXNet's generic bfloat16 clip is slower than
    # FP32 between casts: FP32 there.
    training = _checked(symbol, Policy('bfloat16', cpu_class=cpu_class), shapes)
    assert _computes_in(training, 'relu6') == 'float32'
    # The checker knows the rule: the inference graph breaks the training policy.
    problems = check_graph(fused.symbol, Policy('bfloat16', cpu_class=cpu_class), shapes=shapes)
    assert any("'relu6'" in problem for problem in problems), problems


@pytest.mark.parametrize('case', ['lower bound -1', 'fp32_ops', 'exclude', 'FP32 convolution',
                                  'no bfloat16 kernels'])
def test_a_relu6_stays_float32_where_it_would_not_fuse_or_the_user_says_so(case):
    symbol, shapes = _relu6_net(a_min=-1 if case == 'lower bound -1' else 0)
    rules = Rules.of(fp32_ops=['clip']) if case == 'fp32_ops' else \
        Rules.of(exclude=['relu6']) if case == 'exclude' else \
        Rules.of(exclude=['conv0']) if case == 'FP32 convolution' else Rules()
    cpu_class = 'avx2' if case == 'no bfloat16 kernels' else 'avx512_bf16'
    conversion = _checked(symbol, Policy('bfloat16', rules, inference=True, cpu_class=cpu_class), shapes)
    assert _computes_in(conversion, 'relu6') == 'float32'


# ---------------------------------------------------------------------------
# Fused runs

class MobileBlock(HybridBlock):
    """1x1 expand to 48 channels, ReLU6, depthwise 3x3, ReLU6, 1x1 to 16: MobileNet v2's
    block, whose channel counts AMX kernels do not take (16, 48, depthwise)."""

    def __init__(self, **kwargs):
        super(MobileBlock, self).__init__(**kwargs)
        with self.name_scope():
            self.stem = nn.Conv2D(16, 3, padding=1, use_bias=False)
            self.stem_bn = nn.BatchNorm()
            self.expand = nn.Conv2D(48, 1, use_bias=False)
            self.expand_bn = nn.BatchNorm()
            self.depthwise = nn.Conv2D(48, 3, padding=1, groups=48, use_bias=False)
            self.depthwise_bn = nn.BatchNorm()
            self.project = nn.Conv2D(16, 1, use_bias=False)
            self.project_bn = nn.BatchNorm()
            self.pool = nn.GlobalAvgPool2D()
            self.output = nn.Dense(10)

    def hybrid_forward(self, F, x):
        x = F.clip(self.stem_bn(self.stem(x)), 0, 6)
        y = F.clip(self.expand_bn(self.expand(x)), 0, 6)
        y = F.clip(self.depthwise_bn(self.depthwise(y)), 0, 6)
        return self.output(self.pool(x + self.project_bn(self.project(y))))


def mobile_block():
    mx.random.seed(3)
    net = MobileBlock()
    net.initialize(mx.init.Xavier())
    x = mx.nd.random.uniform(shape=(4, 3, 16, 16))
    net(x)
    # BatchNorm statistics away from identity, so that folds have work to do.
    for name, param in net.collect_params().items():
        if name.endswith(('running_mean', 'beta')):
            param.set_data(mx.nd.random.normal(0, 0.2, shape=param.shape))
        elif name.endswith(('running_var', 'gamma')):
            param.set_data(mx.nd.random.uniform(0.5, 1.5, shape=param.shape))
    return net, x


def copy_of(net, x):
    twin = MobileBlock()
    twin.initialize()
    twin(x)
    for (_, mine), (_, theirs) in zip(twin.collect_params().items(), net.collect_params().items()):
        mine.set_data(theirs.data())
    return twin


def _top_level_clips(fused):
    # (A portable graph's rounded narrowings hold clips of their own: mxamp.dtypes.)
    return [node['name'] for node in json.loads(fused.tojson())['nodes']
            if node['op'] == 'clip' and ROUNDING_SUFFIX not in node['name']]


def _ops(conversion):
    return collections.Counter((record.op, record.computes_in) for record in conversion.nodes)


@needs_bfloat16_compute
def test_for_inference_on_an_amx_cpu_computes_the_mobile_block_in_bfloat16(monkeypatch):
    monkeypatch.setattr(hardware, 'cpu_class', lambda: hardware.AMX)
    net, x = mobile_block()
    reference = net(x).asnumpy()
    trained = mg.convert(copy_of(net, x), 'bfloat16')
    trained.hybridize()
    trained(x)
    training_ops = _ops(mg.converted_state(trained).conversion_for('cpu')[1])
    # The training graph on AMX: the stem's 3 channels in, 16 out, and the block's 16/48
    # channel convolutions in FP32 (their weights stored in bfloat16).
    assert training_ops[('Convolution', 'float32')] == 4, training_ops
    fused = mxamp.for_inference(copy_of(net, x), x, dtype='bfloat16')
    ops = _ops(mg.converted_state(fused).conversion_for('cpu')[1])
    assert ops[('Convolution', 'bfloat16')] == 4 and not ops[('Convolution', 'float32')], ops
    assert ops[('clip', 'bfloat16')] == 3 and not ops[('clip', 'float32')], ops
    # Each ReLU6 is a post-op of its convolution: no clip is left in the fused graph.
    assert not _top_level_clips(fused._cached_graph[1])
    assert inference.fused_nodes(fused._cached_graph[1])['_sg_mkldnn_conv'] == 4
    out = fused(x).astype('float32').asnumpy()
    error = np.linalg.norm(out - reference) / np.linalg.norm(reference)
    assert error < 0.02, error


@needs_bfloat16_compute
def test_a_fused_relu6_changes_no_bit(monkeypatch):
    # clip from 0 to 6 commutes with rounding to bfloat16 (0 and 6 are bfloat16 values,
    # rounding is monotonic): computing it inside the convolution, before its output is
    # rounded, gives the bits FP32 between casts gives.
    monkeypatch.setattr(hardware, 'cpu_class', lambda: hardware.AVX512_BF16)
    net, x = mobile_block()
    inside = mxamp.for_inference(copy_of(net, x), x, dtype='bfloat16')(x).asnumpy()
    monkeypatch.setattr(Policy, 'fuses_into_convolution', lambda self, *args, **kwargs: False)
    between_casts = mxamp.for_inference(copy_of(net, x), x, dtype='bfloat16')
    ops = _ops(mg.converted_state(between_casts).conversion_for('cpu')[1])
    assert ops[('clip', 'float32')] == 3, ops
    np.testing.assert_array_equal(between_casts(x).asnumpy(), inside)


@needs_bfloat16_compute
@pytest.mark.parametrize('cpu_class', ['avx512_bf16', 'amx'])
def test_convert_model_for_inference_converts_under_the_inference_policy(cpu_class):
    symbol, shapes = _relu6_net()
    arg_shapes, _, aux_shapes = symbol.infer_shape(**shapes)
    rng = np.random.RandomState(0)

    def values(names, shapes, positive):
        return {name: mx.nd.array(rng.uniform(0.5, 1.5, shape) if name.endswith(positive)
                                  else rng.normal(0, 0.3, shape))
                for name, shape in zip(names, shapes) if name != 'data'}
    args = values(symbol.list_arguments(), arg_shapes, ('gamma',))
    auxs = values(symbol.list_auxiliary_states(), aux_shapes, ('var',))
    result = mxamp.convert_with_record(symbol, 'bfloat16', arg_params=args, aux_params=auxs,
                                       input_shapes=shapes, cpu_class=cpu_class,
                                       for_inference=True)
    # Both 16-channel convolutions and the ReLU6 in bfloat16, on AMX too; the ReLU6 a
    # post-op of the first (no clip left but those of the input's rounded narrowing).
    ops = _ops(result.conversion)
    assert ops[('Convolution', 'bfloat16')] == 2 and ops[('clip', 'bfloat16')] == 1, ops
    assert not _top_level_clips(result.symbol)
    assert inference.fused_nodes(result.symbol)['_sg_mkldnn_conv'] == 2
    x = mx.nd.array(rng.uniform(size=shapes['data']))

    def run(sym, arg_params, aux_params):
        module = mx.mod.Module(sym, data_names=['data'], label_names=None)
        module.bind([('data', shapes['data'])], for_training=False)
        module.set_params(arg_params, aux_params)
        module.forward(mx.io.DataBatch([x]), is_train=False)
        return module.get_outputs()[0].astype('float32').asnumpy()
    reference = run(symbol, args, auxs)
    out = run(result.symbol, result.arg_params, result.aux_params)
    error = np.linalg.norm(out - reference) / np.linalg.norm(reference)
    assert error < 0.02, error
