"""The pass pipeline: passes run in order on one parsed graph, each appends its record to the
conversion, and a converted Gluon block keeps the record of the graph it runs."""
import mxnet as mx
import pytest
from mxnet import autograd, gluon

import mxamp
from mxamp import graph as graph_mod
from mxamp import passes, pipeline
from mxamp.kernels import operators
from mxamp.network_state import converted_state
from mxamp.passes import GraphPass, PassContext, PassRecord
from mxamp.policy import Policy


def _conversion():
    data = mx.sym.var('data')
    hidden = mx.sym.FullyConnected(data, num_hidden=8, name='fc')
    out = mx.sym.clip(mx.sym.relu(hidden, name='relu'), 0, 6, name='relu6')
    return graph_mod.convert_graph(out, Policy('bfloat16'), params=['fc_weight', 'fc_bias'],
                                   shapes={'data': (2, 4)}, portable=False)


def _context(conversion, mode=passes.TRAINING):
    return PassContext(conversion, mode, dict(conversion.shapes), frozenset(['fc_weight', 'fc_bias']),
                       lambda name: True, 'avx512_bf16', 'cpu', False)


class _Rename(GraphPass):
    """Puts the node named `node` on `op`, saying what it saw before it."""

    def __init__(self, name, node, op, training_only=False):
        self.name, self.node, self.op, self.training_only = name, node, op, training_only
        self.seen = None

    def run(self, graph, context, earlier):
        self.seen = ([record.name for record in earlier],
                     [n['op'] for n in context.source['nodes'] if n['name'] == self.node])
        changed = [n for n in graph['nodes'] if n['name'] == self.node]
        if context.training or not self.training_only:
            for node in changed:
                node['op'] = self.op
        return PassRecord(self.name, frozenset(n['name'] for n in changed),
                          {n['name']: self.op for n in changed}, training_only=self.training_only)


def _ops(symbol):
    return {n['name']: n['op'] for n in passes.parse(symbol)['nodes']}


def test_passes_run_in_order_on_one_graph_and_append_their_records():
    conversion = _conversion()
    before = _ops(conversion.symbol)['relu']
    first, second = _Rename('first', 'relu', 'sigmoid'), _Rename('second', 'relu', 'tanh')
    runtime = pipeline.run(_context(conversion), [first, second])
    assert [record.name for record in runtime.passes] == ['first', 'second']
    # Each chooses from the precision pass's graph, and changes the graph the one before left.
    assert first.seen == ([], [before]) and second.seen == (['first'], [before])
    assert _ops(runtime.symbol)['relu'] == 'tanh'
    assert _ops(conversion.symbol)['relu'] == before
    assert runtime.nodes_of('first') == {'relu'} and runtime.nodes == conversion.nodes


def test_a_training_only_change_leaves_the_inference_graph_as_it_was():
    conversion = _conversion()
    runtime = pipeline.run(_context(conversion, passes.INFERENCE),
                           [_Rename('regions', 'relu', 'sigmoid', training_only=True)])
    assert runtime.symbol is conversion.symbol
    assert runtime.nodes_of('regions') == {'relu'}                # recorded all the same


def test_no_passes_return_the_conversion_itself():
    conversion = _conversion()
    assert pipeline.run(_context(conversion), []) is conversion


def test_the_kernel_wing_names_its_passes_in_order():
    names = [graph_pass.name for graph_pass in pipeline.kernel_passes()]
    assert names == ['channels-last regions', 'stem without data gradient', 'own convolutions',
                     'own clips', 'own attention', 'own layer normalisations',
                     'own softmaxes with a length', 'own dropouts', 'fan-outs']
    assert pipeline.low_precision_kernel_ops() == (
        frozenset(['clip']) if operators.available() else frozenset())


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_a_converted_block_keeps_the_record_of_the_graph_it_runs(dtype):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3), gluon.nn.Activation('relu'), gluon.nn.Dense(3))
    net.initialize()
    mxamp.convert(net, dtype)
    net.hybridize()
    with autograd.record():
        net(mx.nd.ones((2, 3, 8, 8))).backward()
    runtime = converted_state(net).runtime
    names = [graph_pass.name for graph_pass in pipeline.kernel_passes()]
    ran = [record.name for record in runtime.passes]
    assert ran == [name for name in names if name in ran]           # in the wing's order
    # The kernel wing changes bfloat16 graphs on a CPU only: a float16 graph runs none of it.
    if dtype == 'float16':
        assert ran == []
    elif operators.available():
        assert {'own clips', 'fan-outs', 'stem without data gradient'} <= set(ran)
    assert runtime.symbol is not None and runtime.dtype == dtype


class _Never(_Rename):
    def applies(self, context):
        return False


def test_a_pass_that_does_not_apply_neither_runs_nor_records():
    conversion = _conversion()
    never = _Never('never', 'relu', 'sigmoid')
    assert pipeline.run(_context(conversion), [never]) is conversion    # nothing parsed
    runtime = pipeline.run(_context(conversion), [never, _Rename('first', 'relu', 'tanh')])
    assert never.seen is None and [record.name for record in runtime.passes] == ['first']
