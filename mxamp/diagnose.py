"""Locating non-finite values: which gradients, which layer's output first.

When dynamic loss scaling keeps skipping steps down to its floor, the cause is
usually one layer whose low-precision output overflows.  These functions name
it:

- `nonfinite_gradients` lists the parameters whose gradients hold inf or NaN
  (one host sync per parameter: for error paths, not for every step);
- `first_nonfinite_output` re-runs a forward pass op by op, keeping every
  intermediate tensor, and returns the first node (in execution order) whose
  output is not finite.  It works on converted Gluon networks and on symbols.
  An overflowing mxamp cast is blamed on the node it casts: a converted
  network's `mxamp.graph.Conversion` says which nodes are casts, in a symbol
  `mxamp.graph.find_casts` recognises them by name.

`check_bfloat16_runs` tells, before anything runs, whether this CPU can run a
graph's bfloat16 nodes at all, and says what to do instead in one error.

Example
-------
After ``trainer.step`` raised ``FloatingPointError`` at the loss scale's
floor, on the batch that overflowed:

>>> from mxnet import gluon
>>> net = gluon.nn.HybridSequential(prefix='net_')
>>> with net.name_scope():
...     net.add(gluon.nn.Dense(4, in_units=4), gluon.nn.Dense(4, in_units=4),
...             gluon.nn.Dense(1, in_units=4))
>>> net.initialize(mx.init.One())
>>> net = mxamp.convert(net, 'float16')
>>> x = mx.nd.full((2, 4), 1e37)
>>> mxamp.diagnose.first_nonfinite_output(net, x)
{'node': 'net_dense2_fwd', 'op': 'FullyConnected', 'dtype': 'float32', 'output': 0, ...}
"""
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
    """Names of the parameters whose gradient (on any context) holds inf or NaN.

    Parameters
    ----------
    params : ParameterDict, dict or iterable of gluon.Parameter
        Parameters with ``grad_req != 'null'`` are checked.

    Returns
    -------
    list of str
        In the order of `params`.  Forces one host sync per parameter.
    """
    if hasattr(params, 'values'):
        params = params.values()
    # A ParameterDict or a dict gave its values: Parameters (mypy's hasattr() keeps the dict).
    parameters = typing.cast(Iterable[mx.gluon.Parameter], params)
    return nonfinite_named_gradients((param.name, param.list_grad()) for param in parameters
                                     if param.grad_req != 'null' and param._data is not None)


def nonfinite_named_gradients(named_grads: Iterable[Tuple[str, Sequence[mx.nd.NDArray]]]) -> List[str]:
    """`nonfinite_gradients` for gradients that are not in gluon Parameters.

    Parameters
    ----------
    named_grads : iterable of (str, list of NDArray)
        A name and its gradient on every device, e.g. a ``Module``'s parameter
        names with its executor group's ``grad_arrays``.

    Returns
    -------
    list of str
        In the order of `named_grads`.  Forces one host sync per array.
    """
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
        A Gluon network (converted by mxamp or not; it is run once, so its graph
        exists) or a symbol.
    *inputs : NDArray
        The forward pass's inputs, in the order of the network's inputs (for a
        symbol: the order of its non-parameter arguments).
    arg_params, aux_params : dict of str to NDArray, optional
        For a symbol: its parameters.

    Returns
    -------
    dict or None
        ``{'node', 'op', 'dtype', 'output', 'cast_to', 'inputs'}``: the node's
        name, its operator, the dtype of the offending output, the output's
        index, the low-precision dtype it overflowed when mxamp cast it to (None
        when the node itself produced the inf/NaN), and the names of the nodes
        feeding it.  The node is a parameter (op ``'null'``) when mxamp stores
        it in low precision, computes with it in FP32, and the parameter itself
        holds the inf/NaN.  None when every output is finite.

    Raises
    ------
    BFloat16ComputeError
        When the graph computes in bfloat16 and this CPU cannot (see
        `check_bfloat16_runs`).  The graph always runs on the CPU.
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
        if np.dtype(value.dtype).kind not in 'fV':  # integer and boolean tensors cannot overflow
            continue
        if not np.isfinite(to_float32_numpy(value)).all():
            dtype = precision_name(value.dtype) or np.dtype(value.dtype).name
            node, stored = nodes[nid], None
            cast = cast_of.get(node['name'])
            if cast is not None:
                # The node to blame is the cast's producer.  A cast to low precision
                # overflowed a value finite in FP32; a cast to FP32 (of a bfloat16
                # parameter where the CPU computes in FP32) cannot overflow: its
                # input, a parameter, already held the inf/NaN.
                if dtype != 'float32':
                    stored = dtype
                node, k = nodes[index[cast.source]], cast.output
            return {'node': node['name'], 'op': node['op'], 'dtype': dtype, 'output': k,
                    'cast_to': stored, 'inputs': [nodes[src]['name'] for src, _, _ in node['inputs']]}
    return None


def check_bfloat16_runs(symbol: mx.sym.Symbol,
                        input_types: Optional[Mapping[str, DTypeLike]] = None) -> None:
    """Raise `BFloat16ComputeError` when `symbol` computes in bfloat16 and this CPU cannot.

    On CPUs without AVX-512 (`mxamp.hardware.cpu_class` ``'avx2'``,
    ``DNNL_MAX_CPU_ISA`` included) MXNet's oneDNN has no bfloat16 kernels: a
    graph whose nodes compute in bfloat16 (``convert_symbol(sym, 'bfloat16')``
    for a bfloat16 CPU, the default) fails there with "could not create a
    primitive descriptor iterator", asynchronously, at the next sync.  This
    check fails at once instead, naming the CPU class and the remedy.  Graphs
    built for this CPU (``cpu_class='auto'``, and Gluon networks converted on
    it) store bfloat16 parameters but compute in FP32, and pass.  (On
    ``'avx512'`` oneDNN emulates bfloat16: such graphs run, slowly.)

    A node computes in bfloat16 when it produces a bfloat16 tensor and is not a
    cast.  Nothing is run; on CPUs with AVX-512 it returns at once, elsewhere it
    costs one type inference of the graph.

    Parameters
    ----------
    symbol : mx.sym.Symbol
    input_types : dict of str to dtype, optional
        Dtypes of variables without a ``__dtype__`` attribute (default FP32),
        e.g. those of the arrays that will be bound.

    Raises
    ------
    BFloat16ComputeError
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
    # MXNet 1.9.1 reads MXNET_SUBGRAPH_BACKEND at every bind; its oneDNN fusion
    # cannot bind a graph whose outputs include a convolution feeding a
    # BatchNorm, which a graph exposing every tensor always has.
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
    # MXNet 1.9.1: HybridBlock._get_graph builds (or returns the cached) pair of
    # input symbols and output symbol; for a converted net, the rewritten graph.
    input_symbols, symbol = net._get_graph(*inputs)
    arrays = {p.name: p.data(inputs[0].context) for p in net.collect_params().values()}
    arrays.update({s.name: x for s, x in zip(input_symbols, inputs)})
    auxs = set(symbol.list_auxiliary_states())
    # The graph just built is the converted one; its conversion record says which nodes are casts.
    state = state_of(net)
    last = state.last_conversion() if state is not None and state.stage is Stage.CONVERTED else None
    conversion = last[0] if last is not None else None
    return (symbol, {k: v for k, v in arrays.items() if k not in auxs},
            {k: v for k, v in arrays.items() if k in auxs}, conversion)
