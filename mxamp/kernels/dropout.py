"""Dropouts of a converted training graph on mxamp's own operator: which move, and the rewrite.

MXNet 1.9.1's CPU ``Dropout`` draws each value's uniform number from a Mersenne twister in a
scalar loop and packs its mask bit by bit, and has no bfloat16 kernel (the precision pass
keeps it in FP32 under bfloat16, `mxamp.policy`).  A transformer runs dozens of them a step
(gluonnlp's BERT-base: the attention weights and two hidden states per layer).  In the graph a
converted block's CachedOp runs in training, each ``Dropout`` that computes as
`mxamp.kernels.operators.dropout` does moves onto it: each value kept with probability 1 - p,
MXNet's values given the same mask, the random bits from a counter-based generator seeded from
MXNet's random state (``csrc/dropout.h``), vectorised; the mask differs from the one MXNet
would draw.

A ``Dropout`` moves when its mode is ``'training'`` (the default), it has no ``axes``, its
``p`` is above 0 and below 1, it computes in float32 or bfloat16 (the precision pass's
record), and its data is an operator's output.  The others stay MXNet's: ``p`` 0 is MXNet's
identity, computed in place; ``p`` 1 gives NaN in MXNet 1.9.1 and zeros on the own operator;
``mode='always'`` drops in inference too, where the graph keeps MXNet's; a mask shared along
``axes`` is MXNet's alone; the gradient of a variable may add (``grad_req='add'``), which the
own operator, writing its gradient, cannot.

A graph that computes nothing in bfloat16 and stores no parameter so (``dtype='auto'`` where
no layer pays) keeps MXNet's: it runs as its FP32 self, value for value, masks included
(`mxamp.kernels.passes.OwnDropouts`).  The inference graph keeps MXNet's ``Dropout``, the
identity there, and so do export, symbol files and graphs fused for inference.

The own operator's mask is a second, visible output (the extension ABI hides none); the
graph's readers and outputs name the first alone, so a ``Dropout`` that is a graph output
still gives the block one output.
"""
from typing import Any, Iterable, List, Mapping

from ..passes import Graph
from . import operators

__all__ = ['movable_dropouts', 'with_own_dropouts']

_DROPOUT = 'Dropout'


def _probability(attrs: Mapping[str, str]) -> float:
    """``p`` of a Dropout node's attributes (MXNet's default 0.5); NaN when unreadable."""
    try:
        return float(attrs.get('p', '0.5'))
    except ValueError:
        return float('nan')


def _moves(node: Mapping[str, Any], nodes: List[Mapping[str, Any]],
           precision: Mapping[str, str]) -> bool:
    attrs = node.get('attrs', {})
    return (node['op'] == _DROPOUT and attrs.get('mode', 'training') == 'training'
            and not attrs.get('axes', '()').strip('()[], ')
            and 0.0 < _probability(attrs) < 1.0
            and precision.get(node['name']) in ('float32', 'bfloat16')
            and nodes[node['inputs'][0][0]]['op'] != 'null')


def movable_dropouts(graph: Graph, precision: Mapping[str, str]) -> List[str]:
    """The names of `graph`'s Dropout nodes the own operator computes (see the module), given
    ``precision`` ``{node name: 'float32' | dtype}``, the precision pass's."""
    nodes = graph['nodes']
    return [node['name'] for node in nodes if _moves(node, nodes, precision)]


def with_own_dropouts(graph: Graph, names: Iterable[str]) -> List[str]:
    """Put the Dropout nodes of `graph` named in `names` on the own operator, in place; returns
    the names of those moved.  Their attributes are MXNet's, which the own operator takes."""
    wanted = set(names)
    moved = []
    for node in graph['nodes']:
        if node['op'] == _DROPOUT and node['name'] in wanted:
            node['op'] = operators.DROPOUT_OP_NAME
            moved.append(node['name'])
    return moved
