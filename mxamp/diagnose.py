"""Naming what produced inf or NaN: the gradients, the first layer output that is not finite
(docs/troubleshooting.rst), or a CPU that cannot run a graph's bfloat16 nodes at all."""
import contextlib
import json
import os
import typing
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

import mxnet as mx

from . import hardware
from .dtypes import DTypeLike, precision_name, to_float32_numpy
from .graph import find_casts, infer_entry_types, load_graph
from .network_state import Stage, state_of
from .policy import CAST_OPS, canonical

__all__ = ['nonfinite_gradients', 'nonfinite_named_gradients', 'first_nonfinite_output',
           'check_bfloat16_runs', 'BFloat16ComputeError']


class BFloat16ComputeError(RuntimeError):
    """A graph computes in bfloat16 on a CPU that does not compute bfloat16 natively."""


def nonfinite_gradients(params: Union[mx.gluon.ParameterDict, Mapping[str, mx.gluon.Parameter],
                                      Iterable[mx.gluon.Parameter]]) -> List[str]:
    """Names, in order, of the `params` whose gradient holds inf or NaN on any context.

    Parameters with ``grad_req='null'`` are skipped; one host sync per parameter."""
    if hasattr(params, 'values'):
        params = params.values()
    # mypy's hasattr() keeps the dict: these are Parameters.
    parameters = typing.cast(Iterable[mx.gluon.Parameter], params)
    return nonfinite_named_gradients((param.name, param.list_grad()) for param in parameters
                                     if param.grad_req != 'null' and param._data is not None)


def nonfinite_named_gradients(named_grads: Iterable[Tuple[str, Sequence[mx.nd.NDArray]]]) -> List[str]:
    """`nonfinite_gradients` for ``(name, [gradient on each device])`` pairs (a Module's
    ``grad_arrays``): names in order, one host sync per array."""
    return [name for name, grads in named_grads
            if any(not np.isfinite(to_float32_numpy(grad)).all() for grad in grads)]


def first_nonfinite_output(net: Union[mx.gluon.HybridBlock, mx.sym.Symbol], *inputs: mx.nd.NDArray,
                           arg_params: Optional[Mapping[str, mx.nd.NDArray]] = None,
                           aux_params: Optional[Mapping[str, mx.nd.NDArray]] = None
                           ) -> Optional[Dict[str, Any]]:
    """The first node of a forward pass whose output holds inf or NaN, or None.

    Parameters
    ----------
    net : HybridBlock or mx.sym.Symbol
        Converted by mxamp or not; it runs once, op by op, on the CPU.
    *inputs : NDArray
        In the order of the network's inputs (a symbol's non-parameter arguments).
    arg_params, aux_params : dict of str to NDArray, a symbol's parameters

    Returns
    -------
    dict or None
        ``{'node', 'op', 'dtype', 'output', 'cast_to', 'inputs'}``.  An mxamp cast that
        overflowed is blamed on its producer, ``cast_to`` naming the low precision.
    """
    symbol, args, auxs, conversion = _graph_and_arrays(net, inputs, arg_params or {}, aux_params or {})
    input_types = {name: value.dtype for name, value in list(args.items()) + list(auxs.items())}
    check_bfloat16_runs(symbol, input_types)
    graph = json.loads(symbol.tojson(remove_amp_cast=False))
    nodes = graph['nodes']
    index = {node['name']: nid for nid, node in enumerate(nodes)}
    casts = conversion.cast_nodes if conversion else find_casts(graph, infer_entry_types(graph, input_types))
    cast_of = {cast.name: cast for cast in casts}
    rows = graph['node_row_ptr']
    heads = [[nid, k, 0] for nid, node in enumerate(nodes) if node['op'] != 'null'
             for k in range(rows[nid + 1] - rows[nid])]
    probe = mx.sym.load_json(json.dumps(dict(graph, heads=heads)))
    with _unfused():
        executor = probe.bind(mx.cpu(), args={k: v.as_in_context(mx.cpu()) for k, v in args.items()
                                              if k in probe.list_arguments()},
                              aux_states={k: v.as_in_context(mx.cpu()) for k, v in auxs.items()},
                              grad_req='null')
    outputs = executor.forward(is_train=False)
    for (nid, k, _), value in zip(heads, outputs):
        if np.dtype(value.dtype).kind not in 'fV':  # integers and booleans cannot overflow
            continue
        if not np.isfinite(to_float32_numpy(value)).all():
            dtype = precision_name(value.dtype) or np.dtype(value.dtype).name
            node, stored = nodes[nid], None
            cast = cast_of.get(node['name'])
            if cast is not None:
                # Blame the producer.  A cast to FP32 (of a bfloat16 parameter) cannot
                # overflow: the parameter itself held the inf/NaN.
                if dtype != 'float32':
                    stored = dtype
                node, k = nodes[index[cast.source]], cast.output
            return {'node': node['name'], 'op': node['op'], 'dtype': dtype, 'output': k,
                    'cast_to': stored, 'inputs': [nodes[src]['name'] for src, _, _ in node['inputs']]}
    return None


def check_bfloat16_runs(symbol: mx.sym.Symbol,
                        input_types: Optional[Mapping[str, DTypeLike]] = None) -> None:
    """Raise `BFloat16ComputeError` when `symbol` computes in bfloat16 and this CPU cannot.

    On ``'avx2'`` CPUs oneDNN has no bfloat16 kernels and such a graph fails later, at a
    sync (docs/hardware.rst); this fails at once, naming the remedy.  A node computes
    in bfloat16 when it produces a bfloat16 tensor and is not a cast.

    Parameters
    ----------
    symbol : mx.sym.Symbol
    input_types : dict of str to dtype, of variables without ``__dtype__`` (default FP32)
    """
    if hardware.cpu_class() != hardware.AVX2:
        return
    graph = load_graph(symbol)
    nodes = graph['nodes']
    types = infer_entry_types(graph, input_types)
    computing = sorted({nid for (nid, _), name in types.items()
                        if name == 'bfloat16' and nodes[nid]['op'] != 'null'
                        and canonical(nodes[nid]['op']) not in CAST_OPS})
    if computing:
        first = nodes[computing[0]]
        raise BFloat16ComputeError(
            "%d node(s) of the graph compute in bfloat16 (first: '%s', %s), which this machine "
            "cannot do: %s.  Convert the FP32 graph for this CPU (bfloat16 "
            "parameters, FP32 compute): mxamp.convert_symbol/convert_model(..., "
            "cpu_class='auto') or mxamp convert --dtype bfloat16 --cpu-class auto"
            % (len(computing), first['name'], first['op'], hardware.describe_cpu_class()))


@contextlib.contextmanager
def _unfused():
    # MXNet 1.9.1 reads MXNET_SUBGRAPH_BACKEND at every bind; its fusion cannot bind a
    # graph whose outputs include a convolution feeding a BatchNorm, as here.
    previous = os.environ.get('MXNET_SUBGRAPH_BACKEND')
    os.environ['MXNET_SUBGRAPH_BACKEND'] = 'NONE'
    try:
        yield
    finally:
        if previous is None:
            del os.environ['MXNET_SUBGRAPH_BACKEND']
        else:
            os.environ['MXNET_SUBGRAPH_BACKEND'] = previous


def _graph_and_arrays(net, inputs, arg_params, aux_params):
    if isinstance(net, mx.sym.Symbol):
        params = set(arg_params) | set(aux_params)
        names = [n for n in net.list_arguments() if n not in params]
        if len(names) != len(inputs):
            raise ValueError('the symbol has %d inputs (%s), %d given'
                             % (len(names), ', '.join(names), len(inputs)))
        return net, dict(arg_params, **dict(zip(names, inputs))), aux_params, None
    net(*inputs)  # finishes deferred initialisation
    # MXNet 1.9.1: HybridBlock._get_graph returns the (cached) inputs and output symbol.
    input_symbols, symbol = net._get_graph(*inputs)
    arrays = {p.name: p.data(inputs[0].context) for p in net.collect_params().values()}
    arrays.update({s.name: x for s, x in zip(input_symbols, inputs)})
    auxs = set(symbol.list_auxiliary_states())
    # The converted graph's record says which nodes are casts.
    state = state_of(net)
    last = state.last_conversion() if state is not None and state.stage is Stage.CONVERTED else None
    conversion = last[0] if last is not None else None
    return (symbol, {k: v for k, v in arrays.items() if k not in auxs},
            {k: v for k, v in arrays.items() if k in auxs}, conversion)
