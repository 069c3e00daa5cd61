"""The graph rewrite: an FP32 MXNet Symbol in, a mixed-precision Symbol out.

`plan_node` decides a node's precision, once, from the node, a `mxamp.policy.Policy`, its
inputs' precisions and known shapes (a `NodePlan`); `convert_graph` walks the graph in
topological order, plans each node, emits what the plan says and records it in a
`Conversion`, which reports, `mxamp.graph_check` and `mxamp.diagnose` read (`find_casts`
finds a graph's casts by name where the record is missing).

Casts go only where a tensor crosses a precision boundary: one per tensor and dtype, no
chains, FP32 graph inputs and outputs; only entries float32 in the FP32 graph take part.
Activations and network inputs are cast with ``amp_cast`` unless ``portable`` (MXNet 1.9.1's
``save`` drops it; ``Cast``, far slower, first reorders oneDNN layouts); a portable narrowing
to bfloat16 is `mxamp.dtypes.bfloat16_rounding_nodes`, since ``Cast`` truncates
(docs/policy.rst, "The graph rewrite").  Parameters read only in low precision are declared
in it (``__dtype__``), so their values are stored in it.
"""
import collections
import contextlib
import json
import os
import re
import sys
from typing import (Any, Collection, Counter, Dict, FrozenSet, Iterable, List, Mapping, Optional,
                    Sequence, Set, Tuple, Union)

import numpy as np

import mxnet as mx

from . import policy as policy_mod
from .cost import GEMM_OPS, layer_work
from .dtypes import (ROUNDING_SUFFIX, DTypeLike, bfloat16_rounding_nodes, numpy_dtype,
                     precision_name, type_flag)
from .policy import FLOAT32, LOW, NEUTRAL, WIDEST

__all__ = ['CAST_SUFFIX', 'Conversion', 'GraphError', 'GraphLike', 'NodePlan', 'NO_FOLD_SUFFIX',
           'PAD_SUFFIX',
           'assemble_graph', 'cast_input', 'convert_graph', 'error_line', 'find_casts',
           'format_report',
           'cast_values', 'convolution_post_ops', 'entry_uses', 'infer_entry_shapes', 'infer_entry_types', 'layer_works', 'region_works',
           'load_graph',
           'plan_node', 'storable_params']

# Tag on every cast mxamp inserts, which `find_casts` reads in a graph without its Conversion.
CAST_SUFFIX = '_mxamp_cast_'
# Tag on the nodes that add a zero input channel to a convolution (see Policy.layout).
PAD_SUFFIX = '_mxamp_pad_'
# Tag on the identity between a bfloat16 convolution and its BatchNorm in graphs that leave
# mxamp: MXNet 1.9.1's oneDNN backend, wherever it partitions a graph (Module bound for
# inference, by default), folds such a BatchNorm by truncating to bfloat16.  An in-place
# amp_cast: the backend removes _copy nodes, a Cast copies; MXNet's save drops it unless
# remove_amp_cast=False.  `mxamp.fusion` folds the pair itself (docs/inference.rst).
NO_FOLD_SUFFIX = '_mxamp_no_fold'

# Unary activations whose bfloat16 CPU kernel in MXNet 1.9.1 is a generic one, slower than
# FP32, while Activation runs them through oneDNN (docs/performance.rst): in bfloat16 the
# rewrite runs them as Activation nodes (same name, same math).
ONEDNN_ACTIVATIONS = {'relu': 'relu', 'sigmoid': 'sigmoid', 'tanh': 'tanh'}

# The version tag MXNet writes into graph files (1.9.1 -> 10901).
_MXNET_VERSION = int('%d%02d%02d' % tuple(int(part) for part in mx.__version__.split('.')[:3]))


class GraphError(ValueError):
    """A graph mxamp cannot convert; the message names the node or operator."""


NodePlan = collections.namedtuple('NodePlan', [
    'precision',     # 'float32' | dtype it runs in; None for a cast op (its attribute decides)
    'inputs',        # per input: the dtype it must arrive in, None where it is left as it is
    'compute_fp32',  # computes in FP32 between casts (low-precision storage around it)
    'pad_channels',  # a zero input channel is appended to its data and weight
    'activation',    # act_type of the oneDNN Activation it runs as, None to keep its op
    'outputs',       # per output: 'float32' | dtype read by its consumers, None if not floating
    'small',         # MFLOP a call of a layer kept in FP32 as too small to pay (Policy.costs)
    'region',        # MFLOP a call of the region through which a layer too small alone pays
], defaults=(None, None))

CastRecord = collections.namedtuple('CastRecord', [
    'name',          # the cast node's name
    'source',        # name of the node whose output it casts
    'output',        # that output's index
    'from_dtype',    # 'float32' | dtype: mxamp casts only between FP32 and the target
    'to_dtype',
])

InputRecord = collections.namedtuple('InputRecord', [
    'source',        # name of the node of the FP32 graph the input reads
    'output',        # that node's output index
    'cast',          # the CastRecord of the cast it reads through, None if none
    'pad',           # names of the nodes appending its zero channel (the last feeds the node), or ()
    'no_fold',       # name of the identity node it reads through (see NO_FOLD_SUFFIX), or None
])


class NodeRecord(collections.namedtuple('NodeRecord', [
        'name',      # the node's name, the same in both graphs
        'op',        # the operator it runs as (Activation for a relu run by oneDNN)
        'plan',      # its NodePlan
        'inputs',    # per input, an InputRecord
])):
    """What the rewrite did with one op node of the FP32 graph."""
    __slots__ = ()

    @property
    def precision(self) -> str:
        """``'float32'`` or the target dtype: the precision the node runs in (a cast: float32)."""
        return self.plan.precision or 'float32'

    @property
    def computes_in(self) -> str:
        """The precision its arithmetic runs in: float32 also between low-precision casts."""
        return 'float32' if self.plan.compute_fp32 else self.precision


class Conversion(collections.namedtuple('Conversion', [
        'symbol',        # the converted mx.sym.Symbol
        'dtype',         # target precision name
        'lp_params',     # frozenset of parameter names stored in the target dtype
        'nodes',         # tuple of NodeRecord, every op node of the FP32 graph, in graph order
        'cast_nodes',    # tuple of CastRecord, every cast inserted, in graph order
        'output_casts',  # per graph output, the CastRecord casting it back to FP32, or None
        'shapes',        # {variable name: shape} known to the rewrite (given or inferred)
        'passes',        # tuple of mxamp.passes.PassRecord, the later passes' (mxamp.pipeline)
        'works',         # {node name: forward MFLOP a call} of the GEMM nodes of known shapes
], defaults=((), {}))):
    """What `convert_graph` made and did: the graph and the record of every decision."""
    __slots__ = ()

    @property
    def node_precision(self) -> Dict[str, str]:
        """``{node name: 'float32' | dtype}``: the precision each op node runs in."""
        return {node.name: node.precision for node in self.nodes}

    @property
    def small_layers(self) -> Dict[str, float]:
        """``{node name: MFLOP a call}`` of the layers kept in FP32 as too small for low
        precision to pay (`mxamp.policy.Policy`'s ``costs``)."""
        return {node.name: node.plan.small for node in self.nodes
                if node.plan.small is not None}

    @property
    def region_layers(self) -> Dict[str, float]:
        """``{node name: MFLOP a call of its region}`` of the layers too small to pay alone
        that compute in low precision with the layers reading them (`region_works`)."""
        return {node.name: node.plan.region for node in self.nodes
                if node.plan.region is not None}

    @property
    def computes_low(self) -> bool:
        """Whether any node computes in the target dtype."""
        return any(node.computes_in == self.dtype for node in self.nodes)

    @property
    def casts(self) -> Counter[Tuple[str, str]]:
        """``Counter {(from, to): number of casts}``."""
        return collections.Counter((cast.from_dtype, cast.to_dtype) for cast in self.cast_nodes)

    def nodes_of(self, pass_name: str) -> FrozenSet[str]:
        """The nodes the later pass named `pass_name` changed; empty when it did not run."""
        return frozenset().union(*(record.nodes for record in self.passes
                                   if record.name == pass_name))

    @property
    def differs_by_mode(self) -> bool:
        """Whether a later pass changed the training graph alone (inference keeps MXNet's)."""
        return any(record.training_only and record.nodes for record in self.passes)

    @property
    def gradients_written(self) -> FrozenSet[str]:
        """The parameters whose gradients the later passes' operators write (never add)."""
        return frozenset().union(*(record.params for record in self.passes))


class LoadedGraph(dict):
    """The parsed JSON graph (a dict) of `symbol`, the Symbol MXNet loaded it into, made by
    `load_graph`.  Edit a copy, never the graph: its `symbol` would no longer match."""
    def __init__(self, graph: Mapping[str, Any], symbol: mx.sym.Symbol) -> None:
        dict.__init__(self, graph)
        self.symbol = symbol
        # (heads, Symbol) of every op output, made by `_outputs_probe` when first needed.
        self._outputs_probe: Optional[Tuple[List[List[int]], Optional[mx.sym.Symbol]]] = None


#: A graph as `load_graph` reads it: a Symbol, its JSON text, or the parsed JSON (a dict).
GraphLike = Union[mx.sym.Symbol, str, Dict[str, Any]]


def load_graph(source: GraphLike) -> LoadedGraph:
    """The `LoadedGraph` of `source` (Symbol, JSON text or dict), upgraded to 1.x form.

    Raises
    ------
    GraphError
        Invalid JSON, not a symbol, unregistered operators, fused subgraphs.
    """
    if isinstance(source, LoadedGraph):
        return source
    symbol = source if isinstance(source, mx.sym.Symbol) else None
    if symbol is not None:
        source = json.loads(symbol.tojson(remove_amp_cast=False))
    elif isinstance(source, (bytes, str)):
        try:
            source = json.loads(source)
        except ValueError as err:
            raise GraphError('not valid JSON: %s' % err)
    if not isinstance(source, dict) or not isinstance(source.get('nodes'), list) \
            or 'heads' not in source:
        raise GraphError('not an MXNet symbol: expected a JSON object with "nodes" and "heads"')
    registry = policy_mod.registered_ops()
    for index, node in enumerate(source['nodes']):
        if not isinstance(node, dict) or not isinstance(node.get('op'), str) \
                or not isinstance(node.get('name'), str):
            raise GraphError('node %d is not an MXNet node (needs "op" and "name")' % index)
        # MXNet's loader trusts these indices (out-of-range ones crash the process).
        for entry in node.get('inputs', []):
            if not _valid_entry(entry, index):
                raise GraphError("node '%s': input %r does not name an earlier node"
                                 % (node['name'], entry))
        attrs = node.get('attrs', node.get('attr', node.get('param', {})))
        if not isinstance(attrs, dict) or not all(isinstance(v, str) for v in attrs.values()):
            raise GraphError("node '%s': attributes must be a JSON object of strings" % node['name'])
        if node['op'] != 'null' and node['op'] not in registry:
            raise GraphError("node '%s': operator '%s' is not registered in MXNet %s"
                             % (node['name'], node['op'], mx.__version__))
        if node.get('subgraphs'):
            raise GraphError("node '%s' (op %s) holds a fused subgraph: the graph was already "
                             "optimised or quantized; convert the original FP32 graph instead"
                             % (node['name'], node['op']))
    if not isinstance(source['heads'], list) or not source['heads'] or not all(
            _valid_entry(head, len(source['nodes'])) for head in source['heads']):
        raise GraphError('"heads" must list outputs of existing nodes')
    if symbol is not None:
        return LoadedGraph(source, symbol)
    try:
        with _quiet_upgrade(source):
            symbol = mx.sym.load_json(json.dumps(source))
    except mx.base.MXNetError as err:
        raise GraphError('MXNet cannot load the graph: %s' % error_line(err))
    graph = json.loads(symbol.tojson(remove_amp_cast=False))
    # MXNet's loader does not check output indices against the producer's outputs.
    counts = _output_counts(graph)
    for node in graph['nodes']:
        for src, k, _ in node['inputs']:
            if k >= counts[src]:
                raise GraphError("node '%s': input %d of node '%s' does not exist (it has %d)"
                                 % (node['name'], k, graph['nodes'][src]['name'], counts[src]))
    return LoadedGraph(graph, symbol)


@contextlib.contextmanager
def _quiet_upgrade(graph):
    """Silence the C++ ``LOG(INFO)`` notes MXNet's loader writes on fd 2 while upgrading an
    old graph: fd 2 points at /dev/null meanwhile (other threads' writes are lost too)."""
    if (graph.get('attrs') or {}).get('mxnet_version') == ['int', _MXNET_VERSION]:
        yield       # nothing to upgrade, nothing written
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _valid_entry(entry, limit):
    """Whether `entry` is ``[node, output(, version)]`` naming a node before `limit`."""
    return (isinstance(entry, list) and len(entry) in (2, 3)
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in entry)
            and entry[0] < limit)


def error_line(err: BaseException) -> str:
    """The informative line of an exception's message, for one-line errors: of an MXNetError's
    C++ traceback, the failed check or error, without MXNet's log prefixes."""
    lines = [line.strip() for line in str(err).splitlines()
             if line.strip() and not line.strip().startswith(('Traceback', 'File ', '[bt]', 'Stack trace'))]
    chosen = next((line for line in lines if 'Check failed' in line or 'Error' in line),
                  lines[-1] if lines else type(err).__name__)
    return _CPP_LOG_PREFIX.sub('', chosen[len('MXNetError: '):]
                               if chosen.startswith('MXNetError: ') else chosen)


# What MXNet's C++ logging puts before a message: the time and the source line.
_CPP_LOG_PREFIX = re.compile(r'\[\d\d:\d\d:\d\d\] \S+:\d+: ')


def _symbol_from_graph(graph):
    if isinstance(graph, LoadedGraph):
        return graph.symbol
    return mx.sym.load_json(json.dumps(graph))


def _output_counts(graph):
    # Graphs from load_graph come from MXNet's tojson, which always writes the row pointers.
    rows = graph['node_row_ptr']
    return [rows[i + 1] - rows[i] for i in range(len(graph['nodes']))]


def _outputs_probe(graph):
    """``(heads, Symbol)``: every op output of `graph` as a graph output, for inferring all
    entries at once; built once per `LoadedGraph` (kept on it)."""
    probe = getattr(graph, '_outputs_probe', None)
    if probe is not None:
        return probe
    nodes = graph['nodes']
    counts = _output_counts(graph)
    heads = [[nid, k, 0] for nid, node in enumerate(nodes) if node['op'] != 'null'
             for k in range(counts[nid])]
    symbol = None
    if heads:
        probe_graph = dict(graph, heads=heads)
        probe_graph.pop('node_row_ptr', None)
        symbol = _symbol_from_graph(probe_graph)
    if isinstance(graph, LoadedGraph):
        graph._outputs_probe = (heads, symbol)
    return heads, symbol


def infer_entry_types(graph: Mapping[str, Any], input_types: Optional[Mapping[str, DTypeLike]] = None
                      ) -> Dict[Tuple[int, int], Optional[str]]:
    """``{(node, output): dtype name or None}`` of `graph`; variables take ``__dtype__``, else
    `input_types` (name to dtype), else float32."""
    nodes = graph['nodes']
    heads, symbol = _outputs_probe(graph)
    types = {}
    for nid, node in enumerate(nodes):
        if node['op'] == 'null':
            types[(nid, 0)] = _variable_type(node, input_types)
    if not heads:
        return types
    arguments = set(symbol.list_arguments())
    known = {}
    for nid, node in enumerate(nodes):
        name = node['name']
        if node['op'] != 'null' or name not in arguments or '__dtype__' in node.get('attrs', {}):
            continue
        if input_types and name in input_types:
            known[name] = np.dtype(input_types[name]) if types[(nid, 0)] is None else numpy_dtype(types[(nid, 0)])
        elif types[(nid, 0)] is not None:
            known[name] = numpy_dtype(types[(nid, 0)])
    try:
        _, out_types, _ = symbol.infer_type_partial(**known)
    except mx.base.MXNetError as err:
        raise GraphError('type inference failed: %s' % error_line(err))
    for (nid, k, _), out_type in zip(heads, out_types or [None] * len(heads)):
        types[(nid, k)] = precision_name(out_type)
    return types


def infer_variable_shapes(graph: Mapping[str, Any], shapes: Optional[Mapping[str, Sequence[int]]] = None
                          ) -> Dict[int, Tuple[int, ...]]:
    """Known shapes of the variables of `graph`, ``{node index: shape}``: `shapes` (by name)
    completed by MXNet's partial inference; what `shapes` states if it fails."""
    nodes = graph['nodes']
    given = {name: tuple(shape) for name, shape in (shapes or {}).items()
             if shape is not None and all(shape)}
    names = {}
    try:
        symbol = _symbol_from_graph(graph)
        arg_shapes, _, aux_shapes = symbol.infer_shape_partial(**given)
        inferred = zip(symbol.list_arguments() + symbol.list_auxiliary_states(),
                       (arg_shapes or []) + (aux_shapes or []))
        names = {name: tuple(shape) for name, shape in inferred if shape and all(shape)}
    except mx.base.MXNetError:
        pass
    names.update(given)
    return {nid: names[node['name']] for nid, node in enumerate(nodes)
            if node['op'] == 'null' and node['name'] in names}


def infer_entry_shapes(graph: Mapping[str, Any], shapes: Optional[Mapping[str, Sequence[int]]] = None
                       ) -> Dict[Tuple[int, int], Tuple[int, ...]]:
    """Known shapes of the op outputs of `graph`, ``{(node, output): shape}``, inferred from
    `shapes` as `infer_variable_shapes`'s; none if the inference fails."""
    given = {name: tuple(shape) for name, shape in (shapes or {}).items()
             if shape is not None and all(shape)}
    if not given:
        return {}
    heads, symbol = _outputs_probe(graph)
    if not heads:
        return {}
    variables = set(symbol.list_arguments() + symbol.list_auxiliary_states())
    try:
        _, out_shapes, _ = symbol.infer_shape_partial(
            **{name: shape for name, shape in given.items() if name in variables})
    except mx.base.MXNetError:
        return {}
    return {(nid, k): tuple(shape) for (nid, k, _), shape in zip(heads, out_shapes or [])
            if shape and all(shape)}


def _variable_type(node, input_types):
    flag = node.get('attrs', {}).get('__dtype__')
    if flag is not None:
        for name in ('float32', 'float16', 'bfloat16'):
            if str(type_flag(name)) == str(flag):
                return name
        return None
    if input_types and node['name'] in input_types:
        return precision_name(input_types[node['name']])
    return 'float32'


def plan_node(node: Mapping[str, Any], policy: policy_mod.Policy, input_states: Sequence[Optional[str]],
              input_shapes: Sequence[Optional[Tuple[int, ...]]], float_outputs: Sequence[bool],
              post_op: bool = False, work: Optional[float] = None,
              cast_values: int = 0, region_work: Optional[float] = None) -> NodePlan:
    """How one op node runs under `policy`: the only place a node's precision is decided.

    Parameters
    ----------
    node : dict
        The JSON node: ``'op'``, ``'name'`` and optionally ``'attrs'``.
    policy : mxamp.policy.Policy
    input_states : list
        Per input, ``'float32'``, ``policy.dtype`` or None (not floating), before casts.
    input_shapes : list
        Per input, its shape when known, else None.
    float_outputs : list of bool
        Per output, whether it is floating and takes part in the rewrite.
    post_op : bool
        Whether oneDNN would fuse the node into the convolution it reads (`convolution_post_ops`).
    work : float, optional
        A GEMM's forward MFLOP a call (`mxamp.cost.layer_work`), for `Policy.pays`.
    cast_values : int
        The values cast around a GEMM in low precision besides its data (`cast_values`).
    region_work : float, optional
        The MFLOP a call of the region a GEMM opens, its own included (`region_works`).

    Examples
    --------
    >>> from mxamp.policy import Policy
    >>> plan_node({'op': 'BatchNorm', 'name': 'bn_data'}, Policy('bfloat16'),
    ...           ['float32'] * 5, [None] * 5, [True, True, True]).precision
    'float32'
    """
    op, attrs = node['op'], node.get('attrs', {})
    if policy_mod.canonical(op) in policy_mod.CAST_OPS:
        # Its output dtype is its attribute: nothing to cast, nothing to decide.
        return NodePlan(None, (None,) * len(input_states), False, False, None,
                        tuple('float32' if f else None for f in float_outputs))
    low = policy.dtype
    index = policy.index_inputs(op, attrs)
    floating = [pos for pos, state in enumerate(input_states) if state is not None and pos not in index]
    cls = policy.op_class(op, attrs, node['name'])
    small = region = None
    if cls == LOW and input_states and input_states[0] == 'float32':
        if not policy.pays(op, work, cast_values, region_work):
            # Its data is FP32: casting it in costs more than bfloat16 saves on so little work.
            cls, small = FLOAT32, work
        elif region_work is not None and not policy.pays(op, work, cast_values):
            region = region_work    # it pays only with the layers reading it
    layout = policy.layout(op, attrs, input_shapes) if cls == LOW else policy_mod.BLOCKED
    fused = post_op and input_states[0] == low and policy.fuses_into_convolution(
        op, attrs, node['name'])
    if fused:
        # Computed by the bfloat16 convolution's kernel, before its output is rounded.
        precision = low
    elif cls == LOW and policy.follows_data(op) and input_states[0] == 'float32':
        precision = 'float32'   # its data stays FP32 (see Policy.follows_data)
    elif cls == LOW and policy.follows_inputs(op) and floating and \
            all(input_states[pos] == 'float32' for pos in floating):
        precision = 'float32'   # memory-bound: casting its FP32 inputs would cost more
    elif cls == LOW:
        # Stored parameters stay low under an FP32 layout (exact casts): shapes cannot change them.
        precision = 'float32' if layout == FLOAT32 else low
    elif cls != FLOAT32 and floating and all(input_states[pos] == low for pos in floating):
        precision = low     # widest / neutral: low precision only when every floating input is
    else:
        precision = 'float32'
    if precision == low and not policy.computes_low(op, attrs) and not fused:
        precision = 'float32'   # no kernel for the target dtype on this CPU class
    compute_fp32 = precision == low and policy.computes_in_float32(op)
    fixed_in = policy.float32_inputs(op) if precision == low else ()
    fixed_out = policy.float32_outputs(op) if precision == low else ()
    inputs = tuple(None if pos not in floating
                   else 'float32' if compute_fp32 or pos in fixed_in else precision
                   for pos in range(len(input_states)))
    # Outputs of a node computing in FP32 between casts are stored in low precision too.
    outputs = tuple(None if not f else 'float32' if k in fixed_out else precision
                    for k, f in enumerate(float_outputs))
    pad_channels = precision == low and layout == policy_mod.PAD_CHANNELS
    activation = ONEDNN_ACTIVATIONS.get(policy_mod.canonical(op)) if precision == 'bfloat16' else None
    return NodePlan(precision, inputs, compute_fp32, pad_channels, activation, outputs, small,
                    region)


def _as_onednn_activation(node, act_type):
    """`node` as the ``Activation`` node computing the same function (see ONEDNN_ACTIVATIONS)."""
    hidden = {k: v for k, v in node.get('attrs', {}).items() if k.startswith('__')}
    return dict(node, op='Activation', attrs=dict(hidden, act_type=act_type))


class _Builder(object):
    """Accumulates the nodes of the converted graph and the precision of each entry."""

    def __init__(self, dtype, portable, data_inputs):
        self.dtype = dtype
        self.portable = portable
        self.data_inputs = frozenset(data_inputs)
        self.nodes = []
        self.state = {}          # new entry -> 'float32' | dtype | None (not floating)
        self.cast_cache = {}     # (entry, target) -> entry
        self.cast_source = {}    # entry made by a cast -> the entry it was cast from
        self.casts = {}          # node index of each cast -> its CastRecord
        self.names = set()

    def add(self, node, states):
        nid = len(self.nodes)
        self.nodes.append(node)
        self.names.add(node['name'])
        for k, state in enumerate(states):
            self.state[(nid, k)] = state
        return nid

    def to(self, entry, target):
        """`entry` in precision `target`, inserting (or reusing) one Cast node."""
        if self.state.get(entry) in (None, target):
            return entry
        source = self.cast_source.get(entry)
        if source is not None and self.state[source] == target:
            return source
        key = (entry, target)
        if key not in self.cast_cache:
            producer = self.nodes[entry[0]]['name']
            name = '%s%s%s' % (producer, '' if entry[1] == 0 else '_out%d' % entry[1],
                               CAST_SUFFIX + target)
            while name in self.names:
                name += '_'
            # Parameters take no amp_cast: one may hold a blocked oneDNN layout amp_cast's reorder
            # rejects (mxamp.dtypes.amp_cast), and they are small.
            source = self.nodes[entry[0]]
            fast = not self.portable and (source['op'] != 'null' or source['name'] in self.data_inputs)
            if fast or (self.state[entry], target) != ('float32', 'bfloat16'):
                nid = self.add({'op': 'amp_cast' if fast else 'Cast', 'name': name,
                                'attrs': {'dtype': target},
                                'inputs': [[entry[0], entry[1], 0]]}, [target])
            else:
                # Cast truncates to bfloat16: the rounded narrowing instead (steps in float32).
                steps = bfloat16_rounding_nodes(entry, len(self.nodes), name)
                for step in steps[:-1]:
                    self.add(step, ['float32'])
                nid = self.add(steps[-1], [target])
            self.cast_cache[key] = (nid, 0)
            self.cast_source[(nid, 0)] = entry
            self.casts[nid] = CastRecord(name, producer, entry[1], self.state[entry], target)
        return self.cast_cache[key]

    def keep_unfolded(self, entry):
        """`entry` through the identity ``amp_cast`` of NO_FOLD_SUFFIX, and the node's name."""
        name = self.nodes[entry[0]]['name'] + NO_FOLD_SUFFIX
        while name in self.names:
            name += '_'
        nid = self.add({'op': 'amp_cast', 'name': name, 'attrs': {'dtype': 'bfloat16'},
                        'inputs': [[entry[0], entry[1], 0]]}, [self.state[entry]])
        return (nid, 0), name

    def pad_channels(self, entry, name, zero_shape=None):
        """`entry` (N, C, ...) with a zero channel appended (of `zero_shape`, else of its first
        channel's shape), and the names of the nodes added, the Concat last."""
        state = self.state[entry]
        if zero_shape is not None:
            zero = [self.add({'op': '_zeros', 'name': name + '_zero',
                              'attrs': {'shape': str(tuple(zero_shape)), 'dtype': state},
                              'inputs': []}, [state])]
        else:
            first = self.add({'op': 'slice_axis', 'name': name + '_slice',
                              'attrs': {'axis': '1', 'begin': '0', 'end': '1'},
                              'inputs': [[entry[0], entry[1], 0]]}, [state])
            zero = [first, self.add({'op': 'zeros_like', 'name': name + '_zero', 'attrs': {},
                                     'inputs': [[first, 0, 0]]}, [state])]
        nid = self.add({'op': 'Concat', 'name': name, 'attrs': {'dim': '1', 'num_args': '2'},
                        'inputs': [[entry[0], entry[1], 0], [zero[-1], 0, 0]]}, [state])
        return (nid, 0), tuple(self.nodes[i]['name'] for i in zero + [nid])

    def pad_convolution(self, name, inputs, weight_shape):
        """A convolution's `inputs` with a zero input channel appended to data and weight
        (exact), and per input the padding nodes' names; `weight_shape`: the unpadded weight's."""
        # MXNet infers no shape backwards through Concat: the weight declares its shape.
        variable = self.nodes[self.cast_source.get(inputs[1], inputs[1])[0]]
        if variable['op'] == 'null':
            variable['attrs']['__shape__'] = str(tuple(weight_shape))
        data, data_pad = self.pad_channels(inputs[0], name + PAD_SUFFIX + 'data')
        weight, weight_pad = self.pad_channels(inputs[1], name + PAD_SUFFIX + 'weight',
                                               (weight_shape[0], 1) + tuple(weight_shape[2:]))
        return [data, weight] + inputs[2:], [data_pad, weight_pad] + [()] * (len(inputs) - 2)


def _input_shapes(node, variable_shapes, entry_shapes):
    """The known shape of each input of `node` (None where unknown)."""
    return [variable_shapes.get(src) or entry_shapes.get((src, k)) for src, k, _ in node['inputs']]


def layer_works(graph: Mapping[str, Any], variable_shapes: Mapping[int, Tuple[int, ...]],
                entry_shapes: Mapping[Tuple[int, int], Tuple[int, ...]]) -> Dict[int, float]:
    """``{node index: forward MFLOP a call}`` of the GEMM nodes whose shapes are known
    (`mxamp.cost.layer_work`)."""
    works = {}
    for nid, node in enumerate(graph['nodes']):
        if node['op'] not in GEMM_OPS:
            continue
        work = layer_work(node['op'], _input_shapes(node, variable_shapes, entry_shapes),
                          entry_shapes.get((nid, 0)))
        if work is not None:
            works[nid] = work
    return works


def cast_values(graph: Mapping[str, Any], policy: policy_mod.Policy, works: Mapping[int, float],
                variable_shapes: Mapping[int, Tuple[int, ...]],
                entry_shapes: Mapping[Tuple[int, int], Tuple[int, ...]]) -> Dict[int, int]:
    """``{node index: values}`` cast around each GEMM of `works` computing in low precision,
    besides its data: its output where only FP32 operators or the graph's outputs read it,
    and its weight where an FP32 operator reads it too, so that it cannot be stored low (a
    decoder tied to an embedding)."""
    nodes = graph['nodes']
    storable = storable_params(graph, policy, {node['name'] for node in nodes if node['op'] == 'null'})
    readers: Dict[int, List[Optional[int]]] = collections.defaultdict(list)
    for nid, node in enumerate(nodes):
        for src, k, _ in node['inputs']:
            if k == 0:
                readers[src].append(nid)
    for nid, k, _ in graph['heads']:
        if k == 0:
            readers[nid].append(None)
    values = {}
    for nid in works:
        count = 0
        output = entry_shapes.get((nid, 0))
        if output is not None and readers[nid] and all(
                reader is None or policy.op_class(nodes[reader]['op'], nodes[reader].get('attrs'),
                                                  nodes[reader]['name']) == FLOAT32
                for reader in readers[nid]):
            count += int(np.prod(output))
        inputs = nodes[nid]['inputs']
        if len(inputs) > 1:
            weight = nodes[inputs[1][0]]
            shape = variable_shapes.get(inputs[1][0])
            if weight['op'] == 'null' and weight['name'] not in storable and shape is not None:
                count += int(np.prod(shape))
        values[nid] = count
    return values


def region_works(graph: Mapping[str, Any], policy: policy_mod.Policy,
                 works: Mapping[int, float], runs_float32: Collection[int] = (),
                 openers: Optional[Iterable[int]] = None) -> Dict[int, float]:
    """``{node index: MFLOP a call}`` of the region each GEMM of `openers` (default: all of
    `works`, each GEMM's MFLOP a call) opens, one cast in for it all: the GEMM and every GEMM
    reading its output as data, then theirs, through operators that keep low precision (by
    class not FP32; the widest of several inputs only once each of its inputs is in the
    region, as a residual addition of two of its branches), those GEMMs computing in low
    precision (by class, not excluded by the user, with a kernel, not in `runs_float32`: an
    FP32 layout).  A GEMM's work counts where it gains inside a region at its size
    (`mxamp.cost.CostModel.counts_in_region`, normalized when a BatchNorm reads it).  Only
    GEMMs whose region holds another counted GEMM are listed; `policy` needs a cost model."""
    costs = policy.costs
    if costs is None:
        raise ValueError('region_works weighs regions with a cost model: %r has none' % policy)
    nodes = graph['nodes']
    readers: Dict[int, List[Tuple[int, int]]] = collections.defaultdict(list)
    for nid, node in enumerate(nodes):
        for pos, (src, _, _) in enumerate(node['inputs']):
            readers[src].append((nid, pos))
    # Decided once per node, not per walk: how a node joins a region, and what a GEMM adds.
    classes = {nid: None if policy_mod.canonical(node['op']) in policy_mod.CAST_OPS
               else policy.op_class(node['op'], node.get('attrs'), node['name'])
               for nid, node in enumerate(nodes) if node['op'] != 'null'}
    counted = {nid: work if costs.counts_in_region(
        policy_mod.canonical(nodes[nid]['op']), work, normalized=any(
            pos == 0 and policy_mod.canonical(nodes[reader]['op']) in policy_mod.BATCHNORM_OPS
            for reader, pos in readers[nid])) else 0.0 for nid, work in works.items()}

    def joins(nid, pos, seen):
        cls = classes[nid]
        if nodes[nid]['op'] in GEMM_OPS:
            return pos == 0 and cls == LOW and nid not in runs_float32
        if cls == WIDEST:
            return all(src in seen for src, _, _ in nodes[nid]['inputs'])
        return cls in (LOW, NEUTRAL)

    regions = {}
    for nid in works if openers is None else openers:
        if nid in runs_float32:
            continue
        seen, stack = {nid}, [nid]
        total, members = counted[nid], 0
        while stack:
            # A node enters `seen` when pushed, so the widest of several inputs, reached once
            # from each, finds them all in `seen` when reached from the last of them.
            for reader, pos in readers[stack.pop()]:
                if reader in seen or not joins(reader, pos, seen):
                    continue
                seen.add(reader)
                stack.append(reader)
                if reader in works:
                    total, members = total + counted[reader], members + (counted[reader] > 0)
        if members and total > 0:
            regions[nid] = total
    return regions


def storable_params(graph: Mapping[str, Any], policy: policy_mod.Policy,
                    params: Collection[str]) -> Set[str]:
    """The parameters among `params` whose every consumer takes them in low precision.

    Decided on operator classes and kernels alone (not shapes, device or CPU class), so that
    a network has the same parameters in the same dtypes wherever it runs."""
    nodes = graph['nodes']
    # Read in FP32: by an FP32 operator, as a fixed input, by an operator no CPU computes in
    # bfloat16 (RNN, dot), or through operators that pass it on (RNN weights reach it through
    # _rnn_param_concat).  Graphs list producers first.
    read_in_float32 = [False] * len(nodes)
    for nid in reversed(range(len(nodes))):
        node = nodes[nid]
        if node['op'] == 'null':
            continue
        cls = policy.op_class(node['op'], node.get('attrs'), node['name'])
        fixed = set(policy.float32_inputs(node['op'])) | set(policy.index_inputs(node['op'], node.get('attrs')))
        passes_on = cls in (NEUTRAL, WIDEST) and read_in_float32[nid]
        for pos, (src, _, _) in enumerate(node['inputs']):
            if cls == FLOAT32 or pos in fixed or passes_on or \
                    (cls == LOW and policy.computes_low_nowhere(node['op'])):
                read_in_float32[src] = True
    return {node['name'] for nid, node in enumerate(nodes) if node['op'] == 'null'
            and node['name'] in params and not read_in_float32[nid]}


def entry_uses(graph: Mapping[str, Any]) -> Counter[Tuple[int, int]]:
    """The readers (node inputs, graph outputs) of each entry ``(node, output)`` of `graph`."""
    uses: Counter[Tuple[int, int]] = collections.Counter(
        (src, k) for node in graph['nodes'] for src, k, _ in node['inputs'])
    uses.update((nid, k) for nid, k, _ in graph['heads'])
    return uses


# What MXNet 1.9.1's oneDNN backend fuses between a convolution and the activation after
# it (SgMKLDNNConvSelector): a BatchNorm, then an elemwise_add, in that order, each optional.
_FUSED_BEFORE_ACTIVATION = ('elemwise_add', 'BatchNorm')


def convolution_post_ops(graph: Mapping[str, Any]) -> FrozenSet[int]:
    """The op nodes of `graph` that MXNet's oneDNN backend can fuse into a convolution: those
    reading its output directly or through a BatchNorm then an elemwise_add (either operand),
    each tensor on the way with no other reader (and the `NO_FOLD_SUFFIX` identity looked
    through).  Whether it fuses is `Policy.fuses_into_convolution`'s question.

    >>> x = mx.sym.Convolution(mx.sym.var('data'), kernel=(1, 1), num_filter=16, name='conv')
    >>> graph = load_graph(mx.sym.clip(mx.sym.BatchNorm(x, name='bn'), 0, 6, name='relu6'))
    >>> [graph['nodes'][nid]['name'] for nid in sorted(convolution_post_ops(graph))]
    ['bn', 'relu6']
    """
    nodes = graph['nodes']
    uses = entry_uses(graph)

    def reads_convolution(entry, allowed):
        src, k = entry[0], entry[1]
        if uses[(src, k)] != 1:
            return False
        node = nodes[src]
        if node['op'] == 'Convolution':
            return k == 0
        if node['op'] == 'amp_cast' and node['name'].endswith(NO_FOLD_SUFFIX):
            return reads_convolution(node['inputs'][0], allowed)
        if node['op'] not in allowed:
            return False
        return fuses(node, allowed)

    def fuses(node, allowed):
        # Either operand of an elemwise_add may lead there (the backend swaps them).
        if node['op'] in allowed:
            allowed = allowed[allowed.index(node['op']) + 1:]
        operands = node['inputs'] if node['op'] == 'elemwise_add' else node['inputs'][:1]
        return any(reads_convolution(operand, allowed) for operand in operands)

    return frozenset(nid for nid, node in enumerate(nodes)
                     if node['op'] != 'null' and node['inputs']
                     and fuses(node, _FUSED_BEFORE_ACTIVATION))


def _regions(graph, policy, works, variable_shapes, entry_shapes, casts_around):
    """`region_works` of the GEMMs too small alone (each walk can cross the whole graph), for
    a policy with region thresholds; ``{}`` otherwise.  A convolution on padded input channels
    (an image's, `Policy.layout`) opens none: its kernel is outside the ladders that measured
    the thresholds, and a CIFAR ResNet whose stem opened its region trained far slower than
    with the stem in FP32 (docs/policy.rst, "Regions of convolutions, for training")."""
    if policy.costs is None or not policy.costs.region_pays_from:
        return {}
    nodes = graph['nodes']
    layouts = {nid: policy.layout(nodes[nid]['op'], nodes[nid].get('attrs'),
                                  _input_shapes(nodes[nid], variable_shapes, entry_shapes))
               for nid in works}
    return region_works(graph, policy, works, runs_float32=[
        nid for nid, layout in layouts.items() if layout == FLOAT32], openers=[
        nid for nid, work in works.items() if layouts[nid] != policy_mod.PAD_CHANNELS
        and not policy.pays(nodes[nid]['op'], work, casts_around.get(nid, 0))])


def convert_graph(source: GraphLike, policy: policy_mod.Policy, params: Iterable[str] = (),
                  input_types: Optional[Mapping[str, DTypeLike]] = None,
                  shapes: Optional[Mapping[str, Sequence[int]]] = None,
                  portable: bool = True, keep_batchnorm: bool = False,
                  data_inputs: Iterable[str] = ()) -> Conversion:
    """Rewrite an FP32 graph to mixed precision.

    Parameters
    ----------
    source : mx.sym.Symbol, str or dict
        The FP32 graph (a Symbol or its JSON, any MXNet 0.8 to 1.9 format).
    policy : mxamp.policy.Policy
    params : iterable of str
        Variables that are parameters (`storable_params` are declared in the target dtype);
        the others are inputs accepted in FP32.
    input_types : dict, optional
        Dtypes of inputs that are not float32 (``{'tokens': 'int32'}``).
    shapes : dict, optional
        Known shapes of parameters and inputs, by name: under bfloat16 they choose each
        convolution's layout (`mxamp.policy.Policy.layout`).
    portable : bool
        True: every cast a ``Cast``, kept by MXNet's ``save``; False: ``amp_cast`` for activations.
    keep_batchnorm : bool
        Put the `NO_FOLD_SUFFIX` identity before each BatchNorm reading a bfloat16 convolution.
    data_inputs : iterable of str
        The network's inputs, cast like activations under ``portable=False``.

    Returns
    -------
    Conversion
    """
    graph = load_graph(source)
    types = infer_entry_types(graph, input_types)
    already = find_casts(graph, types)
    if already:
        raise GraphError("the graph is already converted by mxamp (cast node '%s')" % already[0].name)
    params = set(params)
    nodes = graph['nodes']
    counts = _output_counts(graph)
    variable_shapes = infer_variable_shapes(graph, shapes)
    entry_shapes = infer_entry_shapes(graph, shapes)
    works = layer_works(graph, variable_shapes, entry_shapes)
    lp_params = storable_params(graph, policy, params)
    casts_around = cast_values(graph, policy, works, variable_shapes, entry_shapes) \
        if policy.costs is not None else {}
    regions = _regions(graph, policy, works, variable_shapes, entry_shapes, casts_around)
    post_ops = convolution_post_ops(graph) if policy.inference else frozenset()
    low = policy.dtype
    out = _Builder(low, portable, data_inputs)
    new_entry = {}
    records = []

    for nid, node in enumerate(nodes):
        original = [types.get((nid, k)) for k in range(counts[nid])]
        if node['op'] == 'null':
            node = dict(node, attrs=dict(node.get('attrs', {})))
            state = 'float32' if original[0] == 'float32' else None
            if node['name'] in lp_params:
                state = low
            if state is not None:
                # MXNet infers no type backwards through a Cast: every floating variable declares it.
                node['attrs']['__dtype__'] = str(type_flag(state))
            new_entry[(nid, 0)] = (out.add(node, [state]), 0)
            continue
        inputs = [new_entry[(src, k)] for src, k, _ in node['inputs']]
        input_shapes = _input_shapes(node, variable_shapes, entry_shapes)
        plan = plan_node(node, policy, [out.state[entry] for entry in inputs], input_shapes,
                         [t == 'float32' for t in original], post_op=nid in post_ops,
                         work=works.get(nid), cast_values=casts_around.get(nid, 0),
                         region_work=regions.get(nid))
        inputs = [entry if dtype is None else out.to(entry, dtype)
                  for entry, dtype in zip(inputs, plan.inputs)]
        casts = [out.casts.get(entry[0]) for entry in inputs]
        pads = [()] * len(inputs)
        if plan.pad_channels:
            inputs, pads = out.pad_convolution(node['name'], inputs, input_shapes[1])
        no_fold = None
        if keep_batchnorm and node['op'] == 'BatchNorm' and out.state[inputs[0]] == 'bfloat16' and \
                out.nodes[inputs[0][0]]['op'] == 'Convolution':
            inputs[0], no_fold = out.keep_unfolded(inputs[0])
        new_node = dict(node, inputs=[[e[0], e[1], 0] for e in inputs])
        if plan.activation is not None:
            new_node = _as_onednn_activation(new_node, plan.activation)
        # A node computing in FP32 between casts writes FP32, read through casts to low.
        written = ['float32' if plan.compute_fp32 and state else state for state in plan.outputs]
        new_id = out.add(new_node, written)
        for k, state in enumerate(plan.outputs):
            new_entry[(nid, k)] = out.to((new_id, k), state)
        records.append(NodeRecord(node['name'], new_node['op'], plan, tuple(
            InputRecord(nodes[src]['name'], k, cast, pad, no_fold if pos == 0 else None)
            for pos, ((src, k, _), cast, pad) in enumerate(zip(node['inputs'], casts, pads)))))

    heads = [out.to(new_entry[(nid, k)], 'float32') for nid, k, _ in graph['heads']]
    converted, kept = assemble_graph(out.nodes, heads, graph.get('attrs'))
    # Every FP32 node feeds an output and is kept; casts nothing reads are gone.
    return Conversion(symbol=_symbol_from_graph(converted), dtype=low, lp_params=frozenset(lp_params),
                      nodes=tuple(records),
                      cast_nodes=tuple(out.casts[nid] for nid in kept if nid in out.casts),
                      output_casts=tuple(out.casts.get(nid) for nid, _ in heads),
                      shapes={nodes[nid]['name']: shape for nid, shape in variable_shapes.items()},
                      works={nodes[nid]['name']: work for nid, work in works.items()})


def assemble_graph(nodes: Sequence[Mapping[str, Any]], heads: Sequence[Tuple[int, int]],
                   attrs: Optional[Mapping[str, Any]]) -> Tuple[Dict[str, Any], List[int]]:
    """The JSON graph of what `heads` (``(node, output)`` pairs) reach of `nodes` (topological,
    with ``[node, output, version]`` inputs), renumbered, and the old indices kept; `attrs`:
    the graph's (None: MXNet 1.9.1's version)."""
    reachable = set()
    stack = [nid for nid, _ in heads]
    while stack:
        nid = stack.pop()
        if nid in reachable:
            continue
        reachable.add(nid)
        stack.extend(src for src, _, _ in nodes[nid]['inputs'])
    order = sorted(reachable)
    index = {old: new for new, old in enumerate(order)}
    kept = [dict(nodes[old], inputs=[[index[s], k, 0] for s, k, _ in nodes[old]['inputs']])
            for old in order]
    graph = {'nodes': kept,
             'arg_nodes': [i for i, n in enumerate(kept) if n['op'] == 'null'],
             'heads': [[index[nid], k, 0] for nid, k in heads]}
    graph['attrs'] = dict(attrs or {'mxnet_version': ['int', 10901]})
    return graph, order


def find_casts(graph: Mapping[str, Any],
               types: Mapping[Tuple[int, int], Optional[str]]) -> List[CastRecord]:
    """The `CastRecord` of each cast mxamp inserted in parsed `graph`, in graph order, found by
    name: for graphs without their `Conversion`.  `types`: its `infer_entry_types`."""
    nodes = graph['nodes']
    found = []
    for node in nodes:
        if CAST_SUFFIX in node['name'] and ROUNDING_SUFFIX not in node['name'] and \
                node['op'] != 'null' and node['inputs'] and \
                policy_mod.canonical(node['op']) in policy_mod.CAST_OPS:
            src, k = cast_input(nodes, node)
            found.append(CastRecord(node['name'], nodes[src]['name'], k, types.get((src, k)),
                                    node.get('attrs', {}).get('dtype')))
    return found


def cast_input(nodes: Sequence[Mapping[str, Any]], cast: Mapping[str, Any]) -> Tuple[int, int]:
    """The entry (node, output) a cast of mxamp's converts, through the helper nodes of a
    rounded narrowing (`mxamp.dtypes.bfloat16_rounding_nodes`)."""
    src, k = cast['inputs'][0][:2]
    while ROUNDING_SUFFIX in nodes[src]['name']:
        src, k = nodes[src]['inputs'][0][:2]
    return src, k


def format_report(conversion: Conversion) -> str:
    """A text table: per operator, how many nodes compute in which precision (FP32 between
    low-precision casts counts as float32, with a line saying how many); then the casts."""
    low = conversion.dtype
    per_op: Dict[str, Counter[str]] = collections.OrderedDict()
    for node in sorted(conversion.nodes, key=lambda n: n.op):
        per_op.setdefault(node.op, collections.Counter())[node.computes_in] += 1
    rows = [(op, str(sum(c.values())), str(c[low]), str(c['float32'])) for op, c in per_op.items()]
    total: Counter[str] = sum(per_op.values(), collections.Counter())
    rows.append(('total', str(sum(total.values())), str(total[low]), str(total['float32'])))
    header = ('operator', 'nodes', low, 'float32')
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(4)]
    rule = '  '.join('-' * w for w in widths)

    def line(row):
        return '  '.join(cell.ljust(w) if i == 0 else cell.rjust(w)
                         for i, (cell, w) in enumerate(zip(row, widths)))
    lines = [line(header), rule] + [line(r) for r in rows[:-1]] + [rule, line(rows[-1])]
    fp32_compute = sum(1 for node in conversion.nodes if node.plan.compute_fp32)
    if fp32_compute:
        lines.append('of the float32 nodes, %d compute in FP32 between %s casts (%s storage, '
                     'no %s kernel on this device)' % (fp32_compute, low, low, low))
    casts = ', '.join('%d %s->%s' % (n, a, b) for (a, b), n in sorted(conversion.casts.items()))
    lines.append('casts inserted: %s' % (casts or 'none'))
    lines.append('parameters stored in %s: %d' % (low, len(conversion.lp_params)))
    return '\n'.join(lines)
