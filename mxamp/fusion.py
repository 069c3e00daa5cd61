"""oneDNN fusion for inference, the part both fronts share.

Recognising fused nodes, fusing a symbol, folding BatchNorm into bfloat16 convolutions
more exactly than MXNet does, and refusing to train what fusion made.  It sits below the
fronts and the trainers, so that training checks a graph without importing a front.

mxamp's own attribute: ``_mxamp_inference`` on each ``Parameter`` of a fused net (the net).
"""
import collections
import json
from typing import Any, Counter, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

import mxnet as mx

from .dtypes import LOW_PRECISION, NUMPY_BFLOAT16, cast, from_numpy, type_flag
from .graph import (NO_FOLD_SUFFIX, GraphError, GraphLike, assemble_graph, entry_uses, error_line,
                    infer_entry_types, load_graph)

__all__ = ['fused_nodes', 'format_fusions', 'describe_fusion', 'fuse_symbol', 'fold_batchnorm',
           'mark_inference_only',
           'check_trainable_params', 'check_trainable_symbol', 'BACKEND', 'REFUSAL', 'FIX']

# MXNet's oneDNN subgraph backend, and the op-name prefix of the nodes it makes.
BACKEND = 'MKLDNN'
FUSED_PREFIX = '_sg_mkldnn_'

# The refusal to train a fused graph: why, and what to do instead.
REFUSAL = ("its fused oneDNN ops have no gradient (MXNet returns zeros), so training "
           "would silently learn nothing")
FIX = ('train the net before mxamp.for_inference, or load its checkpoint into a fresh net '
       'to train that one')


def fused_nodes(symbol: mx.sym.Symbol) -> Counter[str]:
    """``collections.Counter`` of the oneDNN fused nodes of `symbol`, by operator."""
    graph = json.loads(symbol.tojson(remove_amp_cast=False))
    return collections.Counter(node['op'] for node in graph['nodes']
                               if node['op'].startswith(FUSED_PREFIX))


def _count_text(counts):
    return ', '.join('%d %s' % (n, op) for op, n in sorted(counts.items()))


def format_fusions(counts: Mapping[str, int]) -> str:
    """One line saying what fusing for inference did, from `fused_nodes`' counts."""
    return ("fused for inference by MXNet's oneDNN backend: %s"
            % (_count_text(counts) or "no node (nothing in the graph is a pattern it fuses)"))


def describe_fusion(symbol: mx.sym.Symbol) -> str:
    """`format_fusions` of `symbol`, with the BatchNorm layers `fold_batchnorm` folded into it."""
    folded = sum(1 for name in symbol.list_arguments()
                 if name.endswith(FOLDED_SUFFIX + '_weight'))
    line = format_fusions(fused_nodes(symbol))
    if folded:
        line += ('; %d BatchNorm folded into bfloat16 convolutions by mxamp (in float64, '
                 'rounded once to nearest)' % folded)
    return line


def fuse_symbol(symbol: mx.sym.Symbol, arg_params: Optional[Mapping[str, mx.nd.NDArray]],
                aux_params: Optional[Mapping[str, mx.nd.NDArray]],
                input_shapes: Mapping[str, Sequence[int]], option: str = 'input_shapes',
                originals: Optional[Mapping[str, mx.nd.NDArray]] = None
                ) -> Tuple[mx.sym.Symbol, Dict[str, mx.nd.NDArray], Dict[str, mx.nd.NDArray]]:
    """MXNet's oneDNN fusion of `symbol` for inference on a CPU.

    Parameters
    ----------
    symbol : mx.sym.Symbol, converted or FP32, its variables' dtypes declared or given
    arg_params, aux_params : dict of str to NDArray, or None; not modified
    input_shapes : dict of str to tuple
        Shapes of the inputs the graph cannot shape from the others: the backend fuses
        only nodes whose shapes it infers.  The fused graph runs other batch sizes too.
    option : str, how errors name `input_shapes` (``--input-shape``)
    originals : dict of str to NDArray, optional, as `fold_batchnorm`'s

    Returns
    -------
    (mx.sym.Symbol, dict, dict)
        The fused graph and its parameters, `fold_batchnorm`'s in place of what it folded.

    Raises
    ------
    ValueError, GraphError
        An input shape neither given nor inferable; a graph the backend rejects.
    """
    args, auxs = dict(arg_params or {}), dict(aux_params or {})
    symbol, folded, count = fold_batchnorm(symbol, dict(args, **auxs), originals)
    arguments = symbol.list_arguments()
    if count:
        # What only the folded layers used leaves the files too.
        args.update(folded)
        kept = set(arguments) | set(symbol.list_auxiliary_states())
        args = {name: value for name, value in args.items() if name in kept}
        auxs = {name: value for name, value in auxs.items() if name in kept}
    shapes = {name: tuple(shape) for name, shape in input_shapes.items()}
    known = dict({name: value.shape for name, value in args.items()}, **shapes)
    try:
        inferred, _, _ = symbol.infer_shape_partial(**known)
    except mx.base.MXNetError as err:
        raise GraphError('cannot fuse for inference: the graph rejects the shapes: %s'
                         % error_line(err))
    unknown = [name for name, shape in zip(arguments, inferred)
               if name not in args and not (shape and all(shape))]
    if unknown:
        raise ValueError("%s: fusing for inference needs the shape of %s (MXNet's oneDNN backend "
                         "fuses only nodes whose shapes it infers)"
                         % (option, ', '.join("'%s'" % name for name in unknown)))
    try:
        # optimize_for adds and drops parameters in args/auxs: this function's copies.
        fused = symbol.optimize_for(BACKEND, args, auxs, ctx=mx.cpu(), shape_dict=shapes)
    except mx.base.MXNetError as err:
        raise GraphError("MXNet's oneDNN backend cannot fuse the graph: %s" % error_line(err))
    return fused, args, auxs


# MXNet 1.9.1's BatchNormParam defaults: a JSON node leaves defaults out.
_BATCHNORM_DEFAULTS = {'eps': '0.001', 'fix_gamma': 'True', 'axis': '1', 'output_mean_var': 'False'}
# Convolution layouts whose channel axis is 1 (None: the default, NCHW and kin).
_CHANNELS_FIRST = (None, 'NCW', 'NCHW', 'NCDHW')
FOLDED_SUFFIX = '_mxamp_folded'


def _true(text):
    return str(text).lower() in ('true', '1')


def _foldable_pairs(graph):
    """``(convolution, BatchNorm)`` node pairs where the BatchNorm (channel axis 1, no statistics
    output) alone reads a bfloat16 convolution, maybe through `mxamp.graph.NO_FOLD_SUFFIX`'s cast."""
    nodes = graph['nodes']
    uses = entry_uses(graph)
    types = infer_entry_types(graph)
    pairs = []
    for bn, node in enumerate(nodes):
        if node['op'] != 'BatchNorm':
            continue
        attrs = dict(_BATCHNORM_DEFAULTS, **node.get('attrs', {}))
        conv, k, _ = node['inputs'][0]
        if nodes[conv]['op'] == 'amp_cast' and nodes[conv]['name'].endswith(NO_FOLD_SUFFIX) and \
                uses[(conv, 0)] == 1:
            conv, k, _ = nodes[conv]['inputs'][0]
        layout = nodes[conv].get('attrs', {}).get('layout')
        if (nodes[conv]['op'] == 'Convolution' and k == 0 and uses[(conv, 0)] == 1
                and types.get((conv, 0)) == 'bfloat16' and layout in _CHANNELS_FIRST
                and int(attrs['axis']) == 1 and not _true(attrs['output_mean_var'])
                and not uses[(bn, 1)] and not uses[(bn, 2)]):
            pairs.append((conv, bn))
    return pairs


def _values(graph, entries, arrays):
    """The float64 values of parameter-only `entries`, computed in FP32 from `arrays`, and their
    context; None when one depends on something `arrays` lacks."""
    probe, _ = assemble_graph(graph['nodes'], entries, graph.get('attrs'))
    for node in probe['nodes']:
        # In FP32 (a weight's zero channel, say), so that FP32 originals can stand in.
        attrs = node.setdefault('attrs', {})
        if node['op'] == 'null':
            attrs.pop('__dtype__', None)
        elif attrs.get('dtype') in LOW_PRECISION:
            attrs['dtype'] = 'float32'
    symbol = mx.sym.load_json(json.dumps(probe))
    inputs = symbol.list_inputs()
    if any(name not in arrays for name in inputs):
        return None
    ctx = arrays[inputs[0]].context if inputs else mx.cpu()
    # A CachedOp, not Symbol.eval: binding would apply MXNet's default subgraph backend.
    outputs = mx.nd.CachedOp(symbol)(*[cast(arrays[name], 'float32') for name in inputs])
    if isinstance(outputs, mx.nd.NDArray):
        outputs = [outputs]
    return [value.asnumpy().astype(np.float64) for value in outputs], ctx


def fold_batchnorm(symbol: GraphLike, arrays: Mapping[str, mx.nd.NDArray],
                   originals: Optional[Mapping[str, mx.nd.NDArray]] = None
                   ) -> Tuple[mx.sym.Symbol, Dict[str, mx.nd.NDArray], int]:
    """Fold every inference BatchNorm that follows a bfloat16 convolution into it.

    MXNet 1.9.1's oneDNN backend truncates such a fold to bfloat16 (mshadow keeps the upper
    16 bits), a bias towards zero that adds up layer after layer.  Here the fold is computed
    in float64, weight ``w * gamma / sqrt(var + eps)`` and bias ``beta + (b - mean) * gamma /
    sqrt(var + eps)``, from `originals` where given, and rounded once, to nearest
    (docs/inference.rst).  FP32 convolutions are left to MXNet, whose fold is exact.

    Parameters
    ----------
    symbol : Symbol, JSON text or parsed JSON; an unfused graph, for inference
    arrays : dict of str to NDArray
        Stored parameter and auxiliary values; a pair missing one stays unfolded.
    originals : dict of str to NDArray, optional
        FP32 values that the stored ones of the same names were rounded from.

    Returns
    -------
    (Symbol, dict, int)
        The graph, each folded pair one convolution reading new variables
        ``<conv>_mxamp_folded_weight`` and ``_bias``; their bfloat16 values; the count.
    """
    graph = load_graph(symbol)
    nodes = graph['nodes']
    names = {node['name'] for node in nodes}
    arrays = dict(arrays, **(originals or {}))
    remap = {}
    folded = {}      # convolution index -> (weight name, bias name)
    values = {}
    for conv, bn in _foldable_pairs(graph):
        conv_node, bn_node = nodes[conv], nodes[bn]
        has_bias = not _true(conv_node.get('attrs', {}).get('no_bias', 'False'))
        entries = [(src, k) for src, k, _ in conv_node['inputs'][1:3 if has_bias else 2]]
        entries += [(src, k) for src, k, _ in bn_node['inputs'][1:5]]
        found = _values(graph, entries, arrays)
        if found is None:
            continue
        found, ctx = found
        weight, bias = found[0], (found[1] if has_bias else 0.0)
        gamma, beta, mean, var = found[-4:]
        attrs = dict(_BATCHNORM_DEFAULTS, **bn_node.get('attrs', {}))
        if _true(attrs['fix_gamma']):
            gamma = np.ones_like(gamma)
        alpha = gamma / np.sqrt(var + float(attrs['eps']))
        pair = []
        for part, value in (('weight', weight * alpha.reshape((-1,) + (1,) * (weight.ndim - 1))),
                            ('bias', beta + (bias - mean) * alpha)):
            name = '%s%s_%s' % (conv_node['name'], FOLDED_SUFFIX, part)
            while name in names:
                name += '_'
            names.add(name)
            values[name] = from_numpy(value.astype(NUMPY_BFLOAT16), ctx=ctx)
            pair.append(name)
        folded[conv] = tuple(pair)
        remap[(bn, 0)] = (conv, 0)
    if not folded:
        return graph.symbol, {}, 0
    out: List[Dict[str, Any]] = []
    index: Dict[int, int] = {}
    for nid, node in enumerate(nodes):
        inputs = [list(remap.get((src, k), (src, k))) for src, k, _ in node['inputs']]
        node = dict(node, inputs=[[index[src], k, 0] for src, k in inputs])
        if nid in folded:
            for name in folded[nid]:
                out.append({'op': 'null', 'name': name, 'inputs': [],
                            'attrs': {'__dtype__': str(type_flag('bfloat16'))}})
            node['inputs'] = node['inputs'][:1] + [[len(out) - 2, 0, 0], [len(out) - 1, 0, 0]]
            node['attrs'] = dict(node.get('attrs', {}), no_bias='False')
        index[nid] = len(out)
        out.append(node)
    heads = [remap.get((nid, k), (nid, k)) for nid, k, _ in graph['heads']]
    heads = [(index[nid], k) for nid, k in heads]
    result, _ = assemble_graph(out, heads, graph.get('attrs'))
    return mx.sym.load_json(json.dumps(result)), values, len(folded)


def mark_inference_only(params: Iterable[mx.gluon.Parameter], owner: str) -> None:
    """Mark `params` as `owner`'s (a description of a fused net): `check_trainable_params` refuses them."""
    for param in params:
        param._mxamp_inference = owner


def check_trainable_params(params: Iterable[mx.gluon.Parameter], who: str) -> None:
    """Raise RuntimeError, naming `who`, if a parameter belongs to a `for_inference` net."""
    for param in params:
        owner = getattr(param, '_mxamp_inference', None)
        if owner is not None:
            raise RuntimeError("%s: parameter '%s' belongs to %s, made by mxamp.for_inference: %s; %s"
                               % (who, param.name, owner, REFUSAL, FIX))


def check_trainable_symbol(symbol: mx.sym.Symbol, who: str) -> None:
    """Raise RuntimeError, naming `who`, if `symbol` holds oneDNN fused nodes."""
    counts = fused_nodes(symbol)
    if counts:
        raise RuntimeError('%s: the graph is fused for inference (%s): %s; train the unfused '
                           'converted graph (convert without for_inference / --for-inference)'
                           % (who, _count_text(counts), REFUSAL))
