"""Transformer blocks on mxamp's own operators: found and rewritten in a converted graph.

Self-attention
--------------
MXNet 1.9.1 computes ``_contrib_interleaved_matmul_selfatt_qk`` and ``_valatt`` (the
attention of gluonnlp's BERT and of any net using ``contrib.interleaved_matmul_*``) only
in float32 on a CPU, so the precision pass keeps them in FP32 between casts: the fused
projection widened before both, the scores' gradient and the attention weights in
FP32.  In a bfloat16 graph a CachedOp runs, each moves onto mxamp's own operator
(`mxamp.kernels.operators.selfatt_qk` / ``selfatt_valatt``: oneDNN 3's matmul over
strided views, accumulating in float32), reading the bfloat16 values the casts widened.
The scores leave in float32 (softmax reads them so: rounding them would shift its
weights), the attended values in bfloat16, where a widening followed by a narrowing
collapses into the bfloat16 value itself (both exact).

Layer normalisation
-------------------
``LayerNorm`` over the last axis moves onto mxamp's own (oneDNN 3's; it stays in the
precision the precision pass gave it, FP32): MXNet 1.9.1's CPU gradient of it is a
generic loop, many times slower (docs/policy.rst, "Transformers under bfloat16").  One whose gamma or beta gradient adds (``grad_req='add'``) keeps MXNet's,
since the own operators write gradients.

Softmax with a length
---------------------
The attention weights, ``softmax(scores, length, axis=-1, use_length=True)`` (gluonnlp's
BERT masks its padding so), stay in FP32, but move onto mxamp's own vectorised operator
(`mxamp.kernels.operators.masked_softmax`, MXNet's values): MXNet 1.9.1 has no oneDNN
softmax with a length, and computes it and its gradient in a scalar loop
(docs/policy.rst, "Transformers under bfloat16").  Only one over the last axis, with no
temperature but 1 and no ``dtype``, reading float32 data, moves; its length, an integer
input, takes no gradient.

The precision pass's graph, which export and summary read, keeps MXNet's operators:
any MXNet runs it.
"""
from typing import AbstractSet, Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..graph import assemble_graph, cast_input, infer_entry_shapes
from ..passes import Graph
from ..policy import is_true
from . import operators

__all__ = ['OWN_OPERATORS', 'with_own_attention', 'own_layer_norms', 'own_masked_softmaxes']

#: MXNet's self-attention operator -> mxamp's, computing the same product in bfloat16.
OWN_OPERATORS = {
    '_contrib_interleaved_matmul_selfatt_qk': operators.SELFATT_QK_OP_NAME,
    '_contrib_interleaved_matmul_selfatt_valatt': operators.SELFATT_VALATT_OP_NAME,
}
# Its own operator writes the scores in float32 (softmax reads them so), not bfloat16.
_SCORES = '_contrib_interleaved_matmul_selfatt_qk'
_CASTS = ('amp_cast', 'Cast')
# What mxamp calls the casts it adds here (cf. mxamp.graph.CAST_SUFFIX).
_WIDEN_SUFFIX, _NARROW_SUFFIX = '_mxamp_attention_float32', '_mxamp_attention_bfloat16'

Entry = Tuple[int, int]


def _cast_to(node: Mapping[str, Any]) -> Optional[str]:
    """The dtype a cast node converts to; None for any other node."""
    if node['op'] not in _CASTS or not node.get('inputs'):
        return None
    return node.get('attrs', {}).get('dtype')


def with_own_attention(graph: Graph) -> List[str]:
    """Put `graph`'s float32 self-attention products on mxamp's bfloat16 operators, in place;
    returns the names of the nodes moved.

    `graph` is a converted bfloat16 graph (mxamp's casts at its precision borders).  A
    product moves when its projection was computed in bfloat16 (the precision pass widened
    it): it then reads the bfloat16 values, and narrows any other input (``amp_cast`` rounds
    to nearest).  A product whose projection is FP32 (its layer too small to pay, or excluded)
    stays MXNet's, in FP32.
    """
    nodes = graph['nodes']
    if not any(node['op'] in OWN_OPERATORS for node in nodes):
        return []
    out: List[Dict[str, Any]] = []
    index: Dict[int, int] = {}              # old node -> new node computing it
    redirect: Dict[Entry, List[int]] = {}   # old entry -> new entry, where not index's
    low_of: Dict[Entry, List[int]] = {}     # new widened entry -> the bfloat16 entry it widens
    narrowed: Dict[Entry, List[int]] = {}   # new float32 entry -> its narrowing, made once
    moved: List[str] = []

    def new(src: int, k: int) -> List[int]:
        return redirect.get((src, k)) or [index[src], k, 0]

    def add(node: Dict[str, Any]) -> List[int]:
        out.append(node)
        return [len(out) - 1, 0, 0]

    def low(entry: List[int]) -> List[int]:
        source = out[entry[0]]
        if _cast_to(source) == 'float32':
            return source['inputs'][0]
        key = (entry[0], entry[1])
        if key not in narrowed:
            narrowed[key] = add({'op': 'amp_cast', 'name': source['name'] + _NARROW_SUFFIX,
                                 'attrs': {'dtype': 'bfloat16'}, 'inputs': [entry]})
        return narrowed[key]

    for nid, node in enumerate(nodes):
        inputs = [new(src, k) for src, k, _ in node['inputs']]
        if node['op'] in OWN_OPERATORS and _cast_to(out[inputs[0][0]]) == 'float32':
            own = add(dict(node, op=OWN_OPERATORS[node['op']], inputs=[low(e) for e in inputs]))
            moved.append(node['name'])
            if node['op'] == _SCORES:
                index[nid] = own[0]   # float32 scores: read as MXNet's were
                continue
            widened = add({'op': 'amp_cast', 'name': node['name'] + _WIDEN_SUFFIX,
                           'attrs': {'dtype': 'float32'}, 'inputs': [own]})
            low_of[(widened[0], 0)] = own
            redirect[(nid, 0)] = widened
            continue
        if _cast_to(node) == 'bfloat16':
            src, k = cast_input(nodes, node)
            widened = new(src, k)
            if (widened[0], widened[1]) in low_of:
                # Narrowing a widened bfloat16 value gives it back: read it directly.
                redirect[(nid, 0)] = low_of[(widened[0], widened[1])]
                continue
        index[nid] = add(dict(node, inputs=inputs))[0]
    heads = [new(src, k) for src, k, _ in graph['heads']]
    assembled, _ = assemble_graph(out, [(e[0], e[1]) for e in heads], graph.get('attrs'))
    graph.clear()
    graph.update(assembled)
    return moved



def own_layer_norms(graph: Graph, writes_gradient: Callable[[str], bool]) -> Dict[str, List[str]]:
    """Put `graph`'s layer normalisations over the last axis on mxamp's own operator, in
    place; returns ``{node name: its gamma and beta variables}`` of those moved.

    ``writes_gradient(name)`` is False for a variable whose gradient adds: its
    normalisation stays MXNet's.  So does one asked for its statistics
    (``output_mean_var``) or given an axis other than -1 (the shape would have to say).
    """
    nodes = graph['nodes']
    moved = {}
    for node in nodes:
        attrs = node.get('attrs', {})
        if node['op'] != 'LayerNorm' or attrs.get('axis', '-1') != '-1' or \
                attrs.get('output_mean_var', 'False') not in ('False', 'false', '0'):
            continue
        params = [nodes[src]['name'] for src, _, _ in node['inputs'][1:]
                  if nodes[src]['op'] == 'null']
        if all(writes_gradient(name) for name in params):
            node['op'] = operators.LAYER_NORM_OP_NAME
            moved[node['name']] = params
    return moved


def _unit_temperature(text: Optional[str]) -> bool:
    """Whether a softmax's ``temperature`` attribute (None: unset) divides by 1."""
    if text in (None, 'None'):
        return True
    try:
        return float(text) == 1.0
    except ValueError:
        return False


def own_masked_softmaxes(graph: Graph, float32_readers: AbstractSet[str], source: Graph,
                         shapes: Mapping[str, Tuple[int, ...]]) -> List[str]:
    """Put `graph`'s softmaxes with a length over the last axis on mxamp's own operator, in
    place; returns the names of the nodes moved.

    A ``softmax`` moves when it has ``use_length``, no ``dtype`` and no temperature but 1, its
    axis is the last (-1, or the last index of its data's shape, which MXNet's inference on
    `source`, the precision pass's graph, from the variables' `shapes` must then know), and it
    reads its data in float32: named in `float32_readers` (the precision pass's record) and not
    reading a cast to another dtype.  The others stay MXNet's.
    """
    nodes = graph['nodes']
    moved = []
    for node in nodes:
        attrs = node.get('attrs', {})
        if node['op'] != 'softmax' or len(node['inputs']) != 2 or \
                node['name'] not in float32_readers or \
                not is_true(attrs.get('use_length', 'False')) or \
                attrs.get('dtype', 'None') != 'None' or \
                not _unit_temperature(attrs.get('temperature')) or \
                _cast_to(nodes[node['inputs'][0][0]]) not in (None, 'float32'):
            continue
        axis = _int(attrs.get('axis', '-1'))
        if axis is None or (axis != -1 and
                            _data_dimensions(source, node['name'], shapes) != axis + 1):
            continue
        node['op'] = operators.MASKED_SOFTMAX_OP_NAME
        node['attrs'] = dict({key: value for key, value in attrs.items() if key.startswith('__')},
                             axis='-1')
        moved.append(node['name'])
    return moved


def _int(text: str) -> Optional[int]:
    try:
        return int(text)
    except ValueError:
        return None


def _data_dimensions(source: Graph, name: str, shapes: Mapping[str, Tuple[int, ...]]
                     ) -> Optional[int]:
    """How many dimensions the data of `source`'s node `name` has; None if unknown."""
    nodes = source['nodes']
    node = next((node for node in nodes if node['name'] == name), None)
    if node is None:
        return None
    src, k, _ = node['inputs'][0]
    if nodes[src]['op'] == 'null':
        shape = shapes.get(nodes[src]['name'])
    else:
        shape = infer_entry_shapes(source, shapes).get((src, k))
    return None if shape is None else len(shape)
