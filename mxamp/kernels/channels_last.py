"""Channels-last regions of a training graph: activations kept channels last across a chain.

One own convolution at a time wins nothing inside MXNet's graphs (`mxamp.kernels.choice`): MXNet
reorders every array in oneDNN 2.4's layout to its plain one before an extension operator reads
it, and back after.  A chain on mxamp's own operators with the activations channels last
(``(N, spatial..., C)``, the layout oneDNN 3's AMX kernels compute in) pays that only at its
borders (docs/own-convolution.rst, "Channels-last regions in training").  This module owns:

* **finding** them (:func:`find_regions`): connected runs, over data edges, of eligible nodes:
  ``Convolution`` (the region's dtype, MXNet's default layout, known data shape, gradients
  written), ``BatchNorm`` over the channels without ``output_mean_var``, max and average
  ``Pooling`` (default layout, 'valid' or global, so a stem joins), and the layout-independent
  elementwise operators between them (`ELEMENTWISE_OPS`);
* the **rewrite** (:func:`with_channels_last`): convolutions, batch norms and poolings become
  ``_mxamp_convolution(channels_last=True)``, ``_mxamp_batch_norm(axis=-1)`` and
  ``_mxamp_pooling(channels_last=True)``; a batch norm absorbs the ReLU that alone reads it, or a
  residual sum and the ReLU after it; each array crossing the border gets one ``transpose``, for
  bfloat16 one ``_mxamp_move_channels`` (MXNet 1.9.1's ``transpose`` corrupts memory on bfloat16
  arrays with oneDNN, `mxamp.policy`).  An array with several readers gets one copy per reader
  (its batch norm's ``copies``, or a ``_mxamp_fan_out``): MXNet would otherwise sum its gradients
  with ``add_n``, a scalar loop on plain bfloat16, or under ``MXNET_EXEC_INPLACE_GRAD_SUM_CAP``
  add them into an own operator's gradient output, which the extension ABI cannot honour.

A stem convolution (data from the graph's inputs alone) takes ``data_gradient=False`` for calls
whose inputs take no gradient (:func:`without_input_data_gradients`): the ABI has no write
request to say so.  Only the Gluon front's training graphs get regions (`mxamp.gluon`): the ABI
does not say whether MXNet trains, so ``_mxamp_batch_norm`` always uses the batch statistics and
inference keeps MXNet's graph.  Which regions compute channels last is the chooser's decision
(`mxamp.kernels.choice.choose_regions`), not this module's.
"""
import collections
from typing import (Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, NamedTuple, Optional, Sequence,
                    Set, Tuple)

from .. import graph as graph_mod
from . import operators
from ..passes import Graph
from ..policy import CHANNELS_FIRST_LAYOUTS, int_tuple, is_true

__all__ = ['ELEMENTWISE_OPS', 'Region', 'find_regions', 'with_channels_last',
           'with_fanned_out_inputs']

#: Operators whose output at each position depends only on their inputs at that position:
#: they compute the same on channels-last data.  Their inputs must all have their output's shape.
ELEMENTWISE_OPS: FrozenSet[str] = frozenset('''
    Activation relu sigmoid tanh elemwise_add elemwise_sub elemwise_mul _Plus _plus _add
    _Minus _minus _sub _Mul _mul add_n ElementWiseSum amp_cast Cast
'''.split())

_CONVOLUTION, _BATCH_NORM, _POOLING = 'Convolution', 'BatchNorm', 'Pooling'
# The attributes _mxamp_batch_norm takes from MXNet's BatchNorm (axis becomes -1).
_BATCH_NORM_ATTRIBUTES = ('eps', 'momentum', 'fix_gamma', 'use_global_stats')
# The attributes _mxamp_pooling takes from MXNet's Pooling (it adds channels_last).
_POOLING_ATTRIBUTES = ('kernel', 'stride', 'pad', 'pool_type', 'global_pool', 'count_include_pad')


class Region(NamedTuple):
    """A connected run of eligible nodes that can compute channels last.

    ``nodes`` are the node names; ``params`` the variables its convolutions
    and batch normalisations read (gradients the own operators write);
    ``convolutions`` and ``batch_norms`` count theirs; ``borders`` is the
    number of arrays that cross it (each a transpose in the rewrite).
    """

    nodes: FrozenSet[str]
    params: FrozenSet[str]
    convolutions: int
    batch_norms: int
    borders: int

    def describe(self) -> str:
        """``'52 convolutions, 52 batch norms, 2 border transposes'``."""
        return '%d convolutions, %d batch norms, %d border transposes' % (
            self.convolutions, self.batch_norms, self.borders)


def _data_inputs(node: Mapping[str, Any]) -> List[int]:
    """Positions of the inputs of a region node that carry channels-last data."""
    return ([0] if node['op'] in (_CONVOLUTION, _BATCH_NORM, _POOLING)
            else list(range(len(node['inputs']))))


def _eligible(nid: int, node: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]],
              shapes: Mapping[Tuple[int, int], Tuple[int, ...]], low_precision: Set[str],
              writes_gradient: Callable[[str], bool]) -> bool:
    op, attrs = node['op'], node.get('attrs', {})
    if node['name'] not in low_precision:
        return False
    out_shape = shapes.get((nid, 0))
    if not out_shape or not 3 <= len(out_shape) <= 5:
        return False
    in_shapes = [shapes.get((src, k)) for src, k, _ in node['inputs']]
    if op in ELEMENTWISE_OPS:
        return bool(in_shapes) and all(shape == out_shape for shape in in_shapes)
    if op == _POOLING:
        return _own_pooling_computes(attrs) and in_shapes[0] is not None and \
            len(in_shapes[0]) == len(out_shape)
    params = [nodes[src]['name'] for src, _, _ in node['inputs'][1:] if nodes[src]['op'] == 'null']
    if not all(writes_gradient(name) for name in params):
        return False  # the own operators write gradients, never add to them
    if op == _CONVOLUTION:
        return str(attrs.get('layout', 'None')) in CHANNELS_FIRST_LAYOUTS and \
            in_shapes[0] is not None and len(in_shapes[0]) == len(out_shape)
    if op == _BATCH_NORM:
        return int(attrs.get('axis', 1)) == 1 and not is_true(attrs.get('output_mean_var', False)) \
            and in_shapes[0] == out_shape
    return False


def _own_pooling_computes(attrs: Mapping[str, Any]) -> bool:
    """Whether ``_mxamp_pooling`` computes a ``Pooling`` node with these attributes."""
    if str(attrs.get('layout', 'None')) not in CHANNELS_FIRST_LAYOUTS or \
            attrs.get('pool_type', 'max') not in ('max', 'avg'):
        return False
    if is_true(attrs.get('global_pool', False)):
        return True  # one window, whatever the convention
    if attrs.get('pooling_convention', 'valid') != 'valid':
        return False
    kernel = int_tuple(attrs.get('kernel'))
    pad = int_tuple(attrs.get('pad')) or (0,) * len(kernel)
    return bool(kernel) and len(pad) == len(kernel) and all(p < k for p, k in zip(pad, kernel))


def find_regions(graph: Graph, shapes: Mapping[str, Sequence[int]],
                 low_precision: Iterable[str],
                 writes_gradient: Callable[[str], bool] = lambda name: True) -> List[Region]:
    """The channels-last regions of `graph` that hold a convolution, largest first.

    Parameters
    ----------
    graph : dict
        A converted graph, parsed (`mxamp.passes.parse`).
    shapes : dict
        Shapes of its variables by name; nodes whose shapes do not infer from
        them are not eligible.
    low_precision : iterable of str
        Names of the nodes computing in the region's precision (one
        precision per region: the graph's casts stay where they were).
    writes_gradient : callable
        ``writes_gradient(parameter name)`` is False for a parameter whose
        gradient is added to (``grad_req='add'``), which the own operators
        cannot honour: its node is not eligible.
    """
    nodes = graph['nodes']
    entry_shapes = _entry_shapes(graph, shapes)
    # A block the graph calls twice (a shared tower) makes operator nodes of one name; the
    # rewrite names the nodes it adds after the node they serve, and MXNet merges variables
    # of one name: such nodes stay out of regions.
    calls = collections.Counter(node['name'] for node in nodes if node['op'] != 'null')
    wanted = {name for name in low_precision if calls[name] <= 1}
    eligible = {nid for nid, node in enumerate(nodes) if node['op'] != 'null' and
                _eligible(nid, node, nodes, entry_shapes, wanted, writes_gradient)}
    # Connected components over the data edges between eligible nodes (union-find).
    parent = {nid: nid for nid in eligible}

    def root(nid):
        while parent[nid] != nid:
            parent[nid] = parent[parent[nid]]
            nid = parent[nid]
        return nid

    for nid in eligible:
        for position in _data_inputs(nodes[nid]):
            src = nodes[nid]['inputs'][position][0]
            if src in eligible:
                parent[root(nid)] = root(src)
    members: Dict[int, Set[int]] = {}
    for nid in eligible:
        members.setdefault(root(nid), set()).add(nid)
    regions = []
    for group in members.values():
        ops = [nodes[nid]['op'] for nid in group]
        if _CONVOLUTION not in ops:
            continue
        params = frozenset(nodes[src]['name'] for nid in group
                           if nodes[nid]['op'] in (_CONVOLUTION, _BATCH_NORM)
                           for src, _, _ in nodes[nid]['inputs'][1:] if nodes[src]['op'] == 'null')
        regions.append(Region(frozenset(nodes[nid]['name'] for nid in group), params,
                              ops.count(_CONVOLUTION), ops.count(_BATCH_NORM),
                              _border_count(graph, group)))
    return sorted(regions, key=lambda region: (-region.convolutions, sorted(region.nodes)))


def _entry_shapes(graph: Mapping[str, Any], shapes: Mapping[str, Sequence[int]]
                  ) -> Dict[Tuple[int, int], Tuple[int, ...]]:
    """The shapes of `graph`'s entries, op outputs and variables, inferred from `shapes`."""
    entry_shapes = dict(graph_mod.infer_entry_shapes(graph, shapes))
    for nid, node in enumerate(graph['nodes']):
        if node['op'] == 'null' and node['name'] in shapes:
            entry_shapes[(nid, 0)] = tuple(shapes[node['name']])
    return entry_shapes


def _border_count(graph: Mapping[str, Any], group: Set[int]) -> int:
    """Arrays crossing the border of the node indices `group`, in or out."""
    nodes = graph['nodes']
    entering, leaving = set(), set()
    for nid, node in enumerate(nodes):
        inside = nid in group
        positions = _data_inputs(node) if inside else range(len(node.get('inputs', [])))
        for position in positions:
            src, k, _ = node['inputs'][position]
            if inside and src not in group:
                entering.add((src, k))
            elif not inside and src in group:
                leaving.add((src, k))
    leaving.update((src, k) for src, k, _ in graph['heads'] if src in group)
    return len(entering) + len(leaving)


def with_channels_last(graph: Graph, regions: Iterable[Region],
                       shapes: Mapping[str, Sequence[int]]) -> Graph:
    """`graph` with `regions` computing channels last (see the module's rewrite), a new graph.

    `shapes` are the variables' shapes, as given to :func:`find_regions`.  The
    graph keeps its variables, in the same order, and its outputs; the nodes
    of a region keep their names.
    """
    names: Set[str] = set()
    for region in regions:
        names |= region.nodes
    if not names:
        return graph
    operators.require_loaded()
    nodes = graph['nodes']
    inside = {nid for nid, node in enumerate(nodes) if node['name'] in names}
    entry_shapes = _entry_shapes(graph, shapes)
    types = graph_mod.infer_entry_types(graph)
    return _Rewrite(graph, inside, entry_shapes, types).run()


def without_input_data_gradients(graph: Graph, parameters: Iterable[str]) -> List[str]:
    """Set ``data_gradient=False`` on each own convolution of `graph` whose data depends on no
    parameter (auxiliary states included in `parameters`); returns their names.

    For a graph whose inputs take no gradient: MXNet drops those data gradients unread.
    """
    nodes = graph['nodes']
    names = frozenset(parameters)
    # MXNet's JSON lists every node after its inputs.
    reads_parameter: List[bool] = []
    for node in nodes:
        reads_parameter.append(node['name'] in names if node['op'] == 'null' else
                               any(reads_parameter[src] for src, _, _ in node['inputs']))
    marked = [node for node in nodes if node['op'] == operators.OP_NAME and
              not reads_parameter[node['inputs'][0][0]]]
    for node in marked:
        node.setdefault('attrs', {})['data_gradient'] = 'False'
    return [node['name'] for node in marked]


def _fusable_relus(nodes: Sequence[Mapping[str, Any]],
                   readers: Mapping[Tuple[int, int], List[int]], inside: Set[int]) -> Dict[int, int]:
    """``{batch norm: ReLU}`` for each region batch norm whose output only a region ReLU reads.

    ``_mxamp_batch_norm(act_type='relu')`` computes both in one pass and keeps
    one array for the backward pass instead of two.  `readers`: :func:`_readers`.
    """
    fused = {}
    for nid in inside:
        node = nodes[nid]
        if not _is_relu(node):
            continue
        src, k, _ = node['inputs'][0]
        if src in inside and k == 0 and nodes[src]['op'] == _BATCH_NORM and \
                readers.get((src, 0)) == [nid]:
            fused[src] = nid
    return fused


_SUMS = ('elemwise_add', '_Plus', '_plus', '_add')


def _is_relu(node: Mapping[str, Any]) -> bool:
    return node['op'] == 'relu' or (node['op'] == 'Activation' and
                                    node.get('attrs', {}).get('act_type') == 'relu')


def _fusable_residuals(nodes: Sequence[Mapping[str, Any]],
                       readers: Mapping[Tuple[int, int], List[int]], inside: Set[int],
                       taken: Set[int]
                       ) -> Dict[int, Tuple[int, Tuple[int, int], Optional[int]]]:
    """``{batch norm: (sum, (other input), ReLU or None)}`` for a residual block's end.

    A region batch norm (not in `taken`) read only by a region sum of two arrays, itself read
    only by a region ReLU or not: ``_mxamp_batch_norm(residual=True)`` computes them in one pass.
    """
    fused: Dict[int, Tuple[int, Tuple[int, int], Optional[int]]] = {}
    for nid in sorted(inside):
        node = nodes[nid]
        if node['op'] not in _SUMS or len(node['inputs']) != 2:
            continue
        for position in (0, 1):
            src, k, _ = node['inputs'][position]
            other = tuple(node['inputs'][1 - position][:2])
            if src in inside and k == 0 and src not in taken and src not in fused and \
                    nodes[src]['op'] == _BATCH_NORM and readers.get((src, 0)) == [nid] and \
                    other != (src, 0):
                after = readers.get((nid, 0), [])
                relu = after[0] if len(after) == 1 and after[0] in inside and \
                    _is_relu(nodes[after[0]]) else None
                fused[src] = (nid, (int(other[0]), int(other[1])), relu)
                break
    return fused


def _readers(nodes: Sequence[Mapping[str, Any]], heads: Sequence[Sequence[int]]
             ) -> Dict[Tuple[int, int], List[int]]:
    """``{entry: the nodes reading it}``, a graph output counting as reader -1."""
    readers: Dict[Tuple[int, int], List[int]] = {}
    for nid, node in enumerate(nodes):
        for src, k, _ in node.get('inputs', []):
            readers.setdefault((src, k), []).append(nid)
    for head in heads:
        readers.setdefault((head[0], head[1]), []).append(-1)
    return readers


class _Rewrite(object):
    """One pass over a graph's nodes in order, building the channels-last graph."""

    def __init__(self, graph, inside, shapes, types):
        nodes = graph['nodes']
        self.graph, self.nodes, self.inside, self.shapes, self.types = (graph, nodes, inside,
                                                                        shapes, types)
        readers = _readers(nodes, graph['heads'])
        # batch norm -> the ReLU it absorbs
        self.relu_of = _fusable_relus(nodes, readers, inside)
        # batch norm -> (the sum it absorbs, the sum's other input, the ReLU after it or None)
        self.residual_of = _fusable_residuals(nodes, readers, inside, set(self.relu_of))
        self.absorbed = {relu: norm for norm, relu in self.relu_of.items()}
        for norm, (total, _, relu) in self.residual_of.items():
            self.absorbed[total] = norm
            if relu is not None:
                self.absorbed[relu] = norm
        self.out: List[Dict[str, Any]] = []
        self.index: Dict[int, int] = {}  # old node -> new node computing it
        # Old entries of the other layout than their node's: transposes made once per array.
        self.plain: Dict[Tuple[int, int], List[int]] = {}
        self.last: Dict[Tuple[int, int], List[int]] = {}
        self.channels_last: Set[Tuple[int, int]] = set()  # new entries holding channels-last data

    def run(self):
        graph = self.graph
        sums = {total: norm for norm, (total, _, _) in self.residual_of.items()}
        for nid in range(len(self.nodes)):
            if nid in self.residual_of:
                continue   # made where its sum stood, once the sum's other input exists
            if nid in sums:
                self._emit(sums[nid])
            if nid in self.absorbed:   # computed by its batch norm: the same array
                self.index[nid] = self.index[self.absorbed[nid]]
                continue
            self._emit(nid)
        heads = [self.plain_entry(src, k) for src, k, _ in graph['heads']]
        nodes, heads = _with_fan_outs(self.out, heads,
                                      self.channels_last | _own_operator_inputs(self.out))
        return {'nodes': nodes,
                'arg_nodes': [i for i, n in enumerate(nodes) if n['op'] == 'null'],
                'heads': heads,
                'attrs': graph.get('attrs', {'mxnet_version': ['int', 10901]})}

    def _emit(self, nid):
        node = self.nodes[nid]
        if nid in self.inside:
            new = self._region_node(node)
            if nid in self.relu_of:
                new['attrs']['act_type'] = 'relu'
            if nid in self.residual_of:
                _, (src, k), relu = self.residual_of[nid]
                new['inputs'].append(self.last_entry(src, k))
                new['attrs']['residual'] = 'True'
                if relu is not None:
                    new['attrs']['act_type'] = 'relu'
        else:
            new = dict(node, inputs=[self.plain_entry(src, k) for src, k, _ in node['inputs']])
        self.index[nid] = self._append(new)
        if nid in self.inside:
            self.channels_last.add((self.index[nid], 0))

    def _append(self, node):
        self.out.append(node)
        return len(self.out) - 1

    def _region_node(self, node):
        data = set(_data_inputs(node))
        inputs = [self.last_entry(src, k) if position in data else self.plain_entry(src, k)
                  for position, (src, k, _) in enumerate(node['inputs'])]
        attrs = dict(node.get('attrs', {}))
        if node['op'] == _CONVOLUTION:
            attrs.pop('layout', None)
            attrs['channels_last'] = 'True'
            return dict(node, op=operators.OP_NAME, attrs=attrs, inputs=inputs)
        if node['op'] == _BATCH_NORM:
            attrs = {key: value for key, value in attrs.items() if key in _BATCH_NORM_ATTRIBUTES}
            attrs['axis'] = '-1'
            return dict(node, op=operators.BATCH_NORM_OP_NAME, attrs=attrs, inputs=inputs)
        if node['op'] == _POOLING:
            attrs = {key: value for key, value in attrs.items() if key in _POOLING_ATTRIBUTES}
            attrs['channels_last'] = 'True'
            return dict(node, op=operators.POOLING_OP_NAME, attrs=attrs, inputs=inputs)
        return dict(node, inputs=inputs)

    def _transpose(self, entry, old, to_last):
        """The new `entry` (old entry `old`) with its channels moved last (`to_last`) or back
        second: MXNet's transpose, or for bfloat16 data mxamp's (the module docstring)."""
        src, k = old
        name = '%s%s_mxamp_%s' % (self.nodes[src]['name'], '_%d' % k if k else '',
                                  'channels_last' if to_last else 'channels_first')
        if self.types.get(old) == 'bfloat16':
            node = {'op': operators.MOVE_CHANNELS_OP_NAME, 'name': name,
                    'attrs': {'to': 'last' if to_last else 'first'}, 'inputs': [entry]}
        else:
            ndim = len(self.shapes[old])
            axes = ((0,) + tuple(range(2, ndim)) + (1,) if to_last else
                    (0, ndim - 1) + tuple(range(1, ndim - 1)))
            node = {'op': 'transpose', 'name': name, 'attrs': {'axes': str(axes)},
                    'inputs': [entry]}
        return [self._append(node), 0, 0]

    def plain_entry(self, src, k):
        """The new input entry for old entry (src, k), in MXNet's layout."""
        if src not in self.inside:
            return [self.index[src], k, 0]
        if (src, k) not in self.plain:
            self.plain[(src, k)] = self._transpose([self.index[src], k, 0], (src, k), False)
        return self.plain[(src, k)]

    def last_entry(self, src, k):
        """The new input entry for old entry (src, k), channels last."""
        if src in self.inside:
            return [self.index[src], k, 0]
        if (src, k) not in self.last:
            self.last[(src, k)] = self._transpose(self.plain_entry(src, k), (src, k), True)
            self.channels_last.add(tuple(self.last[(src, k)][:2]))
        return self.last[(src, k)]


_OWN_OPERATORS = (operators.OP_NAME, operators.BATCH_NORM_OP_NAME, operators.POOLING_OP_NAME,
                  operators.SELFATT_QK_OP_NAME, operators.SELFATT_VALATT_OP_NAME,
                  operators.LAYER_NORM_OP_NAME, operators.MASKED_SOFTMAX_OP_NAME,
                  operators.DROPOUT_OP_NAME)
# Inputs of own operators that take no gradient (a softmax's integer length): never fanned out.
_NO_GRADIENT_INPUTS = {operators.MASKED_SOFTMAX_OP_NAME: (1,)}


def _own_operator_inputs(nodes: Sequence[Mapping[str, Any]],
                         names: Optional[Set[str]] = None) -> Set[Tuple[int, int]]:
    """The entries that mxamp's own operators (those named `names`) read and give a gradient."""
    return {(src, k) for node in nodes if node['op'] in _OWN_OPERATORS and
            (names is None or node['name'] in names)
            for position, (src, k, _) in enumerate(node['inputs'])
            if position not in _NO_GRADIENT_INPUTS.get(node['op'], ())}


def with_fanned_out_inputs(graph: Graph, names: Iterable[str]) -> List[str]:
    """Put a fan-out in `graph` on each array that an own operator named in `names` shares;
    returns the fan-outs' names.

    For own convolutions outside regions (`mxamp.kernels.choice`), self-attention products
    (both reading one projection), layer normalisations and softmaxes with a length (their
    data; the length takes no gradient) (`mxamp.kernels.transformer`): MXNet must never sum
    gradients into an own operator's output (see the module's rewrite).
    """
    wanted = set(names)
    if not wanted:
        return []
    entries = _own_operator_inputs(graph['nodes'], wanted)
    nodes, heads = _with_fan_outs(graph['nodes'], [list(head) for head in graph['heads']], entries)
    if nodes is graph['nodes']:
        return []
    before = {node['name'] for node in graph['nodes']}
    added = [node['name'] for node in nodes if node['name'] not in before]
    graph.update(nodes=nodes, heads=heads,
                 arg_nodes=[i for i, node in enumerate(nodes) if node['op'] == 'null'])
    graph.pop('node_row_ptr', None)
    return added


def _with_fan_outs(nodes: List[Dict[str, Any]], heads: List[List[int]],
                   entries: Set[Tuple[int, int]]) -> Tuple[List[Dict[str, Any]], List[List[int]]]:
    """`nodes` and `heads` with each of `entries` read more than once given one copy per reader,
    written by the own batch norm that computes it (``copies``) or a ``_mxamp_fan_out`` (see the
    module's rewrite)."""
    readers: Dict[Tuple[int, int], List[Tuple[int, int]]] = {}
    for nid, node in enumerate(nodes):
        for position, (src, k, _) in enumerate(node['inputs']):
            if (src, k) in entries:
                readers.setdefault((src, k), []).append((nid, position))
    for position, (src, k, _) in enumerate(heads):
        if (src, k) in entries:
            readers.setdefault((src, k), []).append((-1, position))
    shared = {entry: places for entry, places in readers.items() if len(places) > 1}
    if not shared:
        return nodes, heads
    out: List[Dict[str, Any]] = []
    index: Dict[int, int] = {}  # old node -> new
    redirect: Dict[Tuple[int, int], List[int]] = {}  # reader (node or -1, position) -> entry
    for nid, node in enumerate(nodes):
        index[nid] = len(out)
        out.append(dict(node, inputs=[redirect.get((nid, position)) or [index[src], k, 0]
                                      for position, (src, k, _) in enumerate(node['inputs'])]))
        for (src, k), places in sorted(shared.items()):
            if src != nid:
                continue
            if node['op'] == operators.BATCH_NORM_OP_NAME and k == 0:
                # The batch norm writes the copies itself (outputs 3...): no pass over its
                # output, and one array fewer kept for the backward pass.
                producer = out[index[nid]]
                producer['attrs'] = dict(producer.get('attrs', {}), copies=str(len(places) - 1))
                outputs = [0] + list(range(3, 2 + len(places)))
                for output, place in zip(outputs, places):
                    redirect[place] = [index[nid], output, 0]
                continue
            out.append({'op': operators.FAN_OUT_OP_NAME,
                        'name': '%s%s_mxamp_fan_out' % (node['name'], '_%d' % k if k else ''),
                        'attrs': {'num_outputs': str(len(places))},
                        'inputs': [[index[nid], k, 0]]})
            for output, place in enumerate(places):
                redirect[place] = [len(out) - 1, output, 0]
    return out, [redirect.get((-1, position)) or [index[src], k, 0]
                 for position, (src, k, _) in enumerate(heads)]
