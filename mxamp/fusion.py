"""oneDNN fusion for inference, the part both fronts share.

This module owns what fusing means whatever made the graph: recognising and
counting the fused nodes (:func:`fused_nodes`, :func:`format_fusions`), fusing
a symbol (:func:`fuse_symbol`, the Symbol front's ``convert_model(...,
for_inference=True)`` and ``mxamp convert --for-inference``), the mark a fused
Gluon net leaves on its parameters (:func:`mark_inference_only`) and the
refusal to train what fusion produced (:func:`check_trainable_params`,
:func:`check_trainable_symbol`, called by `mxamp.Trainer` and
`mxamp.ModuleTrainer`).  `mxamp.inference` builds the Gluon path on it and
exports its public names.  It sits with `mxamp.graph`, below both fronts and
the trainers: training checks a graph without importing a front.

mxamp's own attribute: ``_mxamp_inference`` on each ``Parameter`` of a fused
net (the net it belongs to, which `check_trainable_params` names).
"""
import collections
import json
from typing import Counter, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import mxnet as mx

from .graph import GraphError, error_line

__all__ = ['fused_nodes', 'format_fusions', 'fuse_symbol', 'mark_inference_only',
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
    """``collections.Counter`` of the oneDNN fused nodes of `symbol`, by operator.

    Examples
    --------
    >>> conv = mx.sym.Convolution(mx.sym.var('data'), kernel=(3, 3), num_filter=8, name='conv')
    >>> relu = mx.sym.Activation(conv, act_type='relu', name='relu')
    >>> fused = relu.optimize_for('MKLDNN', {}, {}, ctx=mx.cpu(), shape_dict={'data': (1, 4, 8, 8)})
    >>> mxamp.inference.fused_nodes(fused)
    Counter({'_sg_mkldnn_conv': 1})
    """
    graph = json.loads(symbol.tojson(remove_amp_cast=False))
    return collections.Counter(node['op'] for node in graph['nodes']
                               if node['op'].startswith(FUSED_PREFIX))


def _count_text(counts):
    return ', '.join('%d %s' % (n, op) for op, n in sorted(counts.items()))


def format_fusions(counts: Mapping[str, int]) -> str:
    """One line saying what fusing for inference did, from `fused_nodes`' counts."""
    return ("fused for inference by MXNet's oneDNN backend: %s"
            % (_count_text(counts) or "no node (nothing in the graph is a pattern it fuses)"))


def fuse_symbol(symbol: mx.sym.Symbol, arg_params: Optional[Mapping[str, mx.nd.NDArray]],
                aux_params: Optional[Mapping[str, mx.nd.NDArray]],
                input_shapes: Mapping[str, Sequence[int]], option: str = 'input_shapes'
                ) -> Tuple[mx.sym.Symbol, Dict[str, mx.nd.NDArray], Dict[str, mx.nd.NDArray]]:
    """MXNet's oneDNN fusion of `symbol` for inference on a CPU.

    Parameters
    ----------
    symbol : mx.sym.Symbol
        A graph (converted or FP32) whose variables declare their dtypes or
        have values in the parameters.
    arg_params, aux_params : dict of str to NDArray, or None
        Its parameters: they give shapes and dtypes; not modified.
    input_shapes : dict of str to tuple
        Shapes of the graph's inputs: the backend fuses only nodes whose
        shapes it infers, so each input the graph cannot shape from the others
        needs one.  The fused graph runs other batch sizes too.
    option : str
        How errors name `input_shapes` (the command line's ``--input-shape``).

    Returns
    -------
    (mx.sym.Symbol, dict, dict)
        The fused graph and its parameters (MXNet's oneDNN backend keeps the
        parameters as they are: BatchNorm is folded inside the fused
        convolution at run time).

    Raises
    ------
    ValueError
        An input whose shape is neither given nor inferable.
    GraphError
        The backend rejects the graph.

    Examples
    --------
    >>> conv = mx.sym.Convolution(mx.sym.var('data'), kernel=(1, 1), num_filter=4, name='conv')
    >>> bn = mx.sym.BatchNorm(conv, name='bn')
    >>> args = {'conv_weight': mx.nd.ones((4, 4, 1, 1)), 'conv_bias': mx.nd.zeros((4,)),
    ...         'bn_gamma': mx.nd.ones((4,)), 'bn_beta': mx.nd.zeros((4,))}
    >>> auxs = {'bn_moving_mean': mx.nd.zeros((4,)), 'bn_moving_var': mx.nd.ones((4,))}
    >>> fused, args, auxs = mxamp.inference.fuse_symbol(bn, args, auxs, {'data': (1, 4, 8, 8)})
    >>> mxamp.inference.fused_nodes(fused)
    Counter({'_sg_mkldnn_conv': 1})
    """
    args, auxs = dict(arg_params or {}), dict(aux_params or {})
    arguments = symbol.list_arguments()
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
        # optimize_for adds the parameters a backend creates to args/auxs and
        # drops those it removes: it works on this function's copies.
        fused = symbol.optimize_for(BACKEND, args, auxs, ctx=mx.cpu(), shape_dict=shapes)
    except mx.base.MXNetError as err:
        raise GraphError("MXNet's oneDNN backend cannot fuse the graph: %s" % error_line(err))
    return fused, args, auxs


def mark_inference_only(params: Iterable[mx.gluon.Parameter], owner: str) -> None:
    """Mark `params` as belonging to `owner` (a description), a net fused for inference:
    `check_trainable_params` refuses them."""
    for param in params:
        param._mxamp_inference = owner


def check_trainable_params(params: Iterable[mx.gluon.Parameter], who: str) -> None:
    """Raise RuntimeError, naming `who`, if a parameter belongs to a net made by
    ``mxamp.for_inference``."""
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
