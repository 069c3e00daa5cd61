"""What a pass over a converted graph is given, what it does to the graph and what it records.

Conversion is an ordered list of passes over one graph (`mxamp.pipeline`).  The
first, the precision pass (`mxamp.graph.convert_graph`), decides every node's
precision and places the casts; its record is the `mxamp.graph.Conversion`.  Every
later pass implements `GraphPass`: it changes the parsed JSON graph in place and
returns one `PassRecord`, which `mxamp.pipeline` appends to that same
`Conversion` (its ``passes``), so that `mxamp.summary` and `mxamp.profile` read
one record.  The kernel wing (`mxamp.kernels.passes`) implements its passes
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

    Attributes
    ----------
    name : str
        The pass's name.
    nodes : frozenset of str
        The nodes it changed (or, with `training_only`, changes in training).
    operators : dict of str to str
        Node name to the operator that now computes it, for the nodes whose
        operator changed.
    params : frozenset of str
        Parameters whose gradients the new operators write: they cannot add to a
        gradient (``grad_req='add'``), so such a change rebuilds the graph.
    training_only : bool
        Whether the change is made to training graphs alone (recorded on the
        inference graph too, which keeps MXNet's operators there).
    line : str
        What `mxamp.summary` prints for it; empty for nothing.
    """
    name: str
    nodes: FrozenSet[str] = frozenset()
    operators: Mapping[str, str] = {}
    params: FrozenSet[str] = frozenset()
    training_only: bool = False
    line: str = ''


class PassContext(NamedTuple):
    """What a pass knows of the graph it changes.

    Attributes
    ----------
    conversion : mxamp.graph.Conversion
        The precision pass's record of the graph.
    mode : str
        `INFERENCE`, `TRAINING` or `TRAINING_INPUT_GRADIENTS`.
    shapes : dict of str to tuple
        Shapes of the graph's variables (parameters and inputs) by name.
    parameters : frozenset of str
        The variables that are parameters (auxiliary states included).
    writes_gradient : callable
        ``writes_gradient(name)``: False for a parameter whose gradient adds.
    cpu_class : str
        `mxamp.hardware.cpu_class` the graph runs on.
    device_type : str
        ``'cpu'`` or ``'gpu'``.
    fused : bool
        Whether MXNet partitions the graph for a backend (`mxamp.for_inference`).
    source : dict or None
        The precision pass's graph, parsed, which no pass changes: what passes
        choose from (`mxamp.pipeline.run` fills it).
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
