"""What a pass over a converted graph is given, what it does to the graph and what it records.

Every pass after the precision pass (`mxamp.pipeline`) implements `GraphPass`: it
changes the parsed JSON graph in place and returns one `PassRecord`, which the
pipeline appends to the graph's `mxamp.graph.Conversion`, the one record
`mxamp.summary` and `mxamp.profile` read.  The kernel wing implements its passes
against this module alone.

Example
-------
A pass that renames nothing and says so:

>>> class Nothing(GraphPass):
...     name = 'nothing'
...     def run(self, graph, context, earlier):
...         return PassRecord(self.name)
>>> Nothing().run({'nodes': [], 'heads': []}, None, ()).nodes
frozenset()
"""
import json
from typing import Any, Callable, Dict, FrozenSet, Mapping, NamedTuple, Sequence, Tuple

import mxnet as mx

#: The modes a Gluon block's graph runs in; training without input gradients is the
#: common call, whose graph may leave out the data gradients of its stem.
INFERENCE, TRAINING, TRAINING_INPUT_GRADIENTS = (
    'inference', 'training', 'training with input gradients')

Graph = Dict[str, Any]   # MXNet's JSON graph, parsed: nodes, arg_nodes, heads, attrs


class PassRecord(NamedTuple):
    """What one pass did to a graph.

    `nodes` it changed (with `training_only`, in training graphs alone: the
    inference graph records them and keeps MXNet's operators); `operators`, node
    name to the operator that now computes it; `params` whose gradients the new
    operators write, which cannot add (``grad_req='add'`` rebuilds the graph);
    `line`, what `mxamp.summary` prints for it; `lowered`, the nodes the precision
    pass kept in FP32 that now compute in the low dtype.
    """
    name: str
    nodes: FrozenSet[str] = frozenset()
    operators: Mapping[str, str] = {}
    params: FrozenSet[str] = frozenset()
    training_only: bool = False
    line: str = ''
    lowered: FrozenSet[str] = frozenset()


class PassContext(NamedTuple):
    """What a pass knows of the graph it changes.

    `conversion` is the precision pass's record; `mode` one of the modes above;
    `shapes` the variables' shapes by name; `parameters` the variables that are
    parameters; ``writes_gradient(name)`` False for a parameter whose gradient
    adds; `fused` whether MXNet partitions the graph for a backend
    (`mxamp.for_inference`); `source` the precision pass's graph, parsed, which
    passes choose from and none changes (`mxamp.pipeline.run` fills it).
    """
    conversion: Any
    mode: str
    shapes: Mapping[str, Tuple[int, ...]]
    parameters: FrozenSet[str]
    writes_gradient: Callable[[str], bool]
    cpu_class: str
    device_type: str
    fused: bool
    source: Any = None

    @property
    def training(self) -> bool:
        return self.mode != INFERENCE


class GraphPass(object):
    """One job on a converted graph: subclasses set `name` and implement `run`.

    `same_values` passes replace operators by others that compute the same
    values (what `mxamp.profile` measures too).
    """
    name = ''
    same_values = False

    def applies(self, context: PassContext) -> bool:
        """Whether the pass may change this graph: checked before the graph is parsed."""
        return True

    def computes_low(self) -> FrozenSet[str]:
        """Operators this pass puts on kernels with fast low-precision loops here."""
        return frozenset()

    def run(self, graph: Graph, context: PassContext, earlier: Sequence[PassRecord]
            ) -> PassRecord:
        """Change `graph` in place; `earlier` holds the records of the passes before."""
        raise NotImplementedError


def parse(symbol: mx.sym.Symbol) -> Graph:
    """`symbol`'s JSON graph, parsed (its casts kept)."""
    return json.loads(symbol.tojson(remove_amp_cast=False))


def to_symbol(graph: Graph) -> mx.sym.Symbol:
    """The Symbol of a parsed graph; ``arg_nodes`` follows ``nodes``."""
    graph['arg_nodes'] = [i for i, node in enumerate(graph['nodes']) if node['op'] == 'null']
    graph.pop('node_row_ptr', None)
    return mx.sym.load_json(json.dumps(graph))
