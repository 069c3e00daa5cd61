"""Where a network's step time goes, layer by layer: the profiler's entry points.

`profile` (a Gluon network), `profile_symbol` and `profile_checkpoint` (a
Symbol, in memory or in files) build the two sides, low precision and FP32,
run the measurements of `mxamp.profile_timing` and `mxamp.profile_kernels` and
return a `ProfileReport` (docs/performance.rst, "How mxamp.profile measures").

MXNet internals relied on (MXNet 1.9.1)
---------------------------------------
``Parameter._data``, ``Parameter._deferred_init`` (initialised or deferred);
``Block._children``, ``Block.prefix`` (the block a node belongs to).
"""
import json
import tempfile
import time
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import numpy as np

import mxnet as mx
from mxnet import autograd
from mxnet.gluon import HybridBlock

from . import dtypes, passes, pipeline
from . import graph as graph_mod
from .dtypes import LOW_PRECISION, DTypeLike, name_of_array
from .gluon import check_traceable, conversion_of, is_converted, pass_context
from .network_state import Stage, describe_block, state_of
from .profile_kernels import _attribute_kernels, _kernel_pass
from .profile_report import ProfileReport, _Measured, _Network, _report
from .profile_timing import _flat, _profile_operators, _Side, _sync, _time_steps
from .symbol import convert_with_record, graph_inputs, load_params

__all__ = ['ProfileError', 'ProfileReport', 'profile', 'profile_checkpoint', 'profile_symbol']

# The benchmark's optimizer; the tiny learning rate keeps random weights finite over the steps.
_DEFAULT_OPTIMIZER_PARAMS = {'learning_rate': 1e-4, 'momentum': 0.9, 'wd': 1e-5}
_SEED = 0


class ProfileError(ValueError):
    """Input the profiler cannot measure; one line naming what and where."""


def _measure(network, fp32, low, train, iterations, warmup, kernels, timeout):
    """Measure both sides (or FP32 alone) and make the report."""
    began = time.perf_counter()
    sides = [fp32] + ([low] if low is not None else [])
    step_ms = _time_steps(sides, iterations, warmup)
    with tempfile.TemporaryDirectory(prefix='mxamp-profile-') as workdir:
        operator_times = {side.dtype: _profile_operators(side, iterations, warmup, workdir, side.dtype)
                          for side in sides}
        kernel_lines, kernel_wall, kernel_error = ({}, None, None)
        if kernels:
            kernel_lines, kernel_wall, kernel_error = _kernel_pass(sides, workdir, train, timeout)
    attributed = {side.dtype: _attribute_kernels(side.graph, kernel_lines.get(side.dtype, {}))
                  for side in sides}
    measured = _Measured(step_ms, operator_times, attributed, kernels, kernel_wall, kernel_error)
    return _report(network, sides, train, iterations, warmup, measured, began)


def _check_counts(iterations, warmup):
    if not isinstance(iterations, int) or iterations < 1:
        raise ProfileError('iterations=%r: expected an integer >= 1' % (iterations,))
    if not isinstance(warmup, int) or warmup < 0:
        raise ProfileError('warmup=%r: expected an integer >= 0' % (warmup,))


def _dtype_choice(dtype):
    """``(the dtype asked for, by name; what it means here; why 'auto' means what it does)``."""
    try:
        asked = dtypes.dtype_name(dtype, allowed=('auto', 'float32') + LOW_PRECISION)
    except ValueError as err:
        raise ProfileError('dtype: %s' % err)
    auto, reason = dtypes.auto_on_this_cpu()
    return asked, auto if asked == 'auto' else asked, reason


def _low_side(fp32_symbol, arg_params, aux_params, dtype, inputs, ctx, train, optimizer,
              optimizer_params, exclude=None, fp32_ops=None, lp_ops=None):
    """The low-precision side of an FP32 graph, converted here with the Symbol front."""
    try:
        result = convert_with_record(
            fp32_symbol, dtype, arg_params=arg_params, aux_params=aux_params, exclude=exclude,
            fp32_ops=fp32_ops, lp_ops=lp_ops, ctx=ctx,
            input_shapes={name: value.shape for name, value in inputs.items()},
            portable=False, cpu_class='auto')
    except (graph_mod.GraphError, ValueError) as err:
        raise ProfileError('converting to %s for the report: %s' % (dtype, graph_mod.error_line(err)))
    params = dict(result.arg_params or {})
    params.update(result.aux_params or {})
    return _Side(dtype, result.symbol, params, result.conversion, inputs, ctx, train, optimizer,
                 optimizer_params)


def profile(net: HybridBlock, *inputs: mx.nd.NDArray, train: bool = False,
            dtype: Optional[DTypeLike] = None, iterations: int = 5, warmup: int = 2,
            kernels: bool = True, optimizer: str = 'sgd',
            optimizer_params: Optional[Mapping[str, Any]] = None,
            kernel_timeout: int = 1800) -> ProfileReport:
    """Measure where a Gluon network's step time goes, in its low precision and in FP32.

    Parameters
    ----------
    net : mxnet.gluon.HybridBlock
        Converted by `mxamp.convert` (the graph it runs is measured), or FP32
        (converted for the report, to `dtype`); only copies of it run.
    *inputs : NDArray
        FP32 inputs on the CPU; the first one's first dimension is the batch.
    train : bool
        A training step (forward, backward, optimizer step), not inference.
    dtype : str, optional
        FP32 net: ``'auto'`` (default), ``'bfloat16'``, ``'float16'`` or
        ``'float32'`` (FP32 alone).  Converted net: None or its own dtype.
    iterations, warmup : int
        Timed and untimed steps per side and measurement.
    kernels : bool
        Also read the oneDNN kernel behind each layer (a child process).
    optimizer, optimizer_params
        The training step's optimizer (default: ``scripts/benchmark.py``'s SGD).
    kernel_timeout : int
        Seconds the kernel pass may take.

    Returns
    -------
    ProfileReport

    Raises
    ------
    ProfileError
        Inputs that are not CPU NDArrays, an unknown or foreign dtype, an
        uninitialised net, counts below 1.
    """
    _check_counts(iterations, warmup)
    if not isinstance(net, HybridBlock):
        raise ProfileError('mxamp.profile needs a gluon HybridBlock; got %s' % type(net).__name__)
    if not inputs or not all(isinstance(x, mx.nd.NDArray) for x in inputs):
        raise ProfileError('mxamp.profile(net, *inputs): give the inputs as NDArrays '
                           '(got %s)' % (', '.join(type(x).__name__ for x in inputs) or 'none'))
    if any(x.context.device_type != 'cpu' for x in inputs):
        raise ProfileError('mxamp.profile measures on the CPU: the inputs are on %s'
                           % inputs[0].context)
    state = state_of(net)
    if state is not None and state.stage is Stage.CONVERTED_IN_PART:
        raise ProfileError('mxamp.profile times one graph, and %s cannot become one (it is '
                           'converted in part): profile each converted part (%s)'
                           % (describe_block(net), ', '.join(path for path, _ in state.parts)))
    try:
        check_traceable(net, 'mxamp.profile times one graph')
    except TypeError as err:
        raise ProfileError(str(err))
    ctx = mx.cpu()
    names = ['data'] if len(inputs) == 1 else ['data%d' % i for i in range(len(inputs))]
    feed = dict(zip(names, inputs))
    _finish_initialisation(net, inputs)
    optimizer_params = dict(optimizer_params or _DEFAULT_OPTIMIZER_PARAMS)
    fp32_symbol = _fp32_symbol(net, names)
    fp32_params = _fp32_params(net, ctx)
    fp32 = _Side('float32', fp32_symbol, fp32_params, None, feed, ctx, train, optimizer,
                 optimizer_params)
    low = None
    if is_converted(net) and state is not None:
        own = state.settings.dtype
        if dtype is not None and _dtype_choice(dtype)[1] != own:
            raise ProfileError('dtype=%r: %s is converted to %s; profile it as it is (dtype=None) '
                               'or profile its FP32 original' % (dtype, describe_block(net), own))
        requested, reason = own, 'the net is converted to %s' % own
        conversion = _same_value_passes(net, train)
        low_params = {p.name: p.data(ctx).copy() for p in net.collect_params().values()}
        low = _Side(own, conversion.symbol, low_params, conversion, feed, ctx,
                    train, optimizer, optimizer_params)
    else:
        requested, target, reason = _dtype_choice('auto' if dtype is None else dtype)
        if state is not None and state.stage is Stage.KEPT_FLOAT32 and state.float32_reason:
            reason = state.float32_reason
        if target != 'float32':
            arg_params, aux_params = _split_params(fp32_symbol, fp32_params)
            low = _low_side(fp32_symbol, arg_params, aux_params, target, feed, ctx, train,
                            optimizer, optimizer_params)
    network = _Network(describe_block(net), _gluon_layer_names(net, fp32_symbol), feed,
                       requested, reason)
    return _measure(network, fp32, low, train, iterations, warmup, kernels, kernel_timeout)


def _same_value_passes(net, train):
    """`net`'s conversion after its same-value passes (`mxamp.passes.GraphPass.same_values`),
    as it runs them: MXNet's kernels would misreport what they compute in bfloat16.  The
    passes that choose kernels by measurement are what the profile judges: it skips them."""
    conversion, device = conversion_of(net)
    context = pass_context(net, conversion, passes.TRAINING if train else passes.INFERENCE,
                           device, conversion.shapes)
    return pipeline.run(context, [graph_pass for graph_pass in pipeline.kernel_passes()
                                  if graph_pass.same_values])


def _finish_initialisation(net, inputs):
    params = list(net.collect_params().values())
    if any(p._data is None and not p._deferred_init for p in params):
        missing = next(p.name for p in params if p._data is None and not p._deferred_init)
        raise ProfileError('%s is not initialised (parameter %s): call net.initialize() first'
                           % (describe_block(net), missing))
    if any(p._deferred_init for p in params):
        with autograd.pause():
            _sync(net(*inputs))


def _fp32_symbol(net, names):
    """The FP32 graph of `net`'s ``hybrid_forward`` (every variable declared FP32)."""
    output = net(*[mx.sym.var(name) for name in names])
    symbol = mx.sym.Group(_flat(output)) if isinstance(output, (list, tuple)) else output
    graph = json.loads(symbol.tojson())
    for node in graph['nodes']:
        if node['op'] == 'null':
            node.get('attrs', {}).pop('__dtype__', None)
    return mx.sym.load_json(json.dumps(graph))


def _fp32_params(net, ctx):
    """FP32 copies of `net`'s parameters, by name (low-precision ones widened, exactly)."""
    values = {}
    for param in net.collect_params().values():
        value = param.data(ctx)
        values[param.name] = (dtypes.cast(value.copy(), 'float32')
                              if name_of_array(value) in LOW_PRECISION else value.copy())
    return values


def _split_params(symbol, params):
    auxiliary = set(symbol.list_auxiliary_states())
    arg_params = {k: v for k, v in params.items() if k not in auxiliary}
    aux_params = {k: v for k, v in params.items() if k in auxiliary}
    return arg_params, aux_params


def _gluon_layer_names(net, symbol):
    """``{node name: (layer, block path)}``: the name without the net's prefix and ``_fwd``;
    the path of the deepest block whose prefix starts it."""
    blocks = []

    def walk(block, path):
        blocks.append((block.prefix, path))
        for key, child in block._children.items():
            walk(child, '%s.%s' % (path, key) if path else key)
    walk(net, '')
    blocks.sort(key=lambda item: -len(item[0]))
    root = net.prefix
    names = {}
    for node in json.loads(symbol.tojson())['nodes']:
        if node['op'] == 'null':
            continue
        name = node['name']
        layer = name[len(root):] if root and name.startswith(root) and name != root else name
        if layer.endswith('_fwd') and len(layer) > 4:
            layer = layer[:-4]
        path = next((path for prefix, path in blocks if prefix and name.startswith(prefix)), '')
        names[name] = (layer, path or None)
    return names


def profile_symbol(symbol: mx.sym.Symbol, arg_params: Optional[Dict[str, mx.nd.NDArray]] = None,
                   aux_params: Optional[Dict[str, mx.nd.NDArray]] = None, *,
                   input_shapes: Mapping[str, Sequence[int]], dtype: DTypeLike = 'auto',
                   train: bool = False, iterations: int = 5, warmup: int = 2,
                   kernels: bool = True, exclude: Optional[Iterable[str]] = None,
                   fp32_ops: Optional[Iterable[str]] = None, lp_ops: Optional[Iterable[str]] = None,
                   optimizer: str = 'sgd', optimizer_params: Optional[Mapping[str, Any]] = None,
                   kernel_timeout: int = 1800) -> ProfileReport:
    """Measure where an FP32 Symbol's step time goes, converted to `dtype` and in FP32.

    Parameters
    ----------
    symbol : mx.sym.Symbol
        The FP32 graph.
    arg_params, aux_params : dict of str to NDArray, optional
        Its parameters; default: random (Xavier, fixed seed), since the time
        does not depend on their values.
    input_shapes : dict
        Every data input's shape, e.g. ``{'data': (4, 3, 224, 224)}`` (random values,
        fixed seed); inputs the graph infers (``softmax_label``) get zeros.
    dtype : str
        As `profile`'s for an FP32 net (default ``'auto'``).
    train, iterations, warmup, kernels, optimizer, optimizer_params, kernel_timeout
        As `profile`'s.
    exclude, fp32_ops, lp_ops
        As `mxamp.convert_symbol`'s.

    Returns
    -------
    ProfileReport

    Raises
    ------
    ProfileError
        A converted graph, input shapes that do not fit it, missing or unknown
        parameters, an unknown dtype.
    """
    _check_counts(iterations, warmup)
    requested, target, reason = _dtype_choice(dtype)
    ctx = mx.cpu()
    try:
        loaded = graph_mod.load_graph(symbol)
    except graph_mod.GraphError as err:
        raise ProfileError('the symbol: %s' % err)
    casts = graph_mod.find_casts(loaded, graph_mod.infer_entry_types(loaded))
    if casts:
        raise ProfileError("the symbol is already converted by mxamp (cast node '%s'): profile "
                           "the FP32 graph with dtype=... instead" % casts[0].name)
    params = dict(arg_params or {})
    params.update(aux_params or {})
    if arg_params is None and aux_params:
        raise ProfileError('aux_params without arg_params: give both, or neither (random values)')
    inputs = _symbol_inputs(symbol, params, input_shapes)
    if arg_params is None:
        params = _random_params(symbol, inputs, ctx)
    optimizer_params = dict(optimizer_params or _DEFAULT_OPTIMIZER_PARAMS)
    fp32 = _Side('float32', symbol, params, None, inputs, ctx, train, optimizer, optimizer_params)
    low = None
    if target != 'float32':
        args, auxs = _split_params(symbol, params)
        low = _low_side(symbol, args, auxs, target, inputs, ctx, train, optimizer,
                        optimizer_params, exclude=exclude, fp32_ops=fp32_ops, lp_ops=lp_ops)
    layer_names: Dict[str, Tuple[str, Optional[str]]] = {
        node['name']: (node['name'], None) for node in loaded['nodes'] if node['op'] != 'null'}
    name = 'symbol (%s)' % ', '.join(symbol.list_outputs())
    network = _Network(name, layer_names, inputs, requested, reason)
    return _measure(network, fp32, low, train, iterations, warmup, kernels, kernel_timeout)


def _symbol_inputs(symbol, params, input_shapes):
    """`symbol`'s inputs: uniform random for `input_shapes` (fixed seed), else zeros."""
    names = graph_inputs(symbol, params)
    unknown = [name for name in input_shapes if name not in names]
    if unknown:
        raise ProfileError('input_shapes: %s is not an input of the graph (its inputs: %s)'
                           % (unknown[0], ', '.join(names) or 'none'))
    try:
        arg_shapes, _, _ = symbol.infer_shape_partial(**{k: tuple(v) for k, v in input_shapes.items()})
    except mx.base.MXNetError as err:
        raise ProfileError('input_shapes %s do not fit the graph: %s'
                           % (dict(input_shapes), graph_mod.error_line(err)))
    shapes = dict(zip(symbol.list_arguments(), arg_shapes or []))
    random = np.random.RandomState(_SEED)
    inputs = {}
    for name in names:
        shape = tuple(input_shapes.get(name) or shapes.get(name) or ())
        if not shape or not all(shape):
            raise ProfileError('input_shapes: give the shape of input %s (the graph does not '
                               'infer it)' % name)
        values = random.uniform(size=shape) if name in input_shapes else np.zeros(shape)
        inputs[name] = mx.nd.array(values, dtype='float32')
    return inputs


def _random_params(symbol, inputs, ctx):
    """Xavier-initialised FP32 parameters of `symbol` (fixed seed), by name."""
    mx.random.seed(_SEED)
    block = mx.gluon.SymbolBlock(symbol, [mx.sym.var(name) for name in inputs])
    block.initialize(mx.init.Xavier(), ctx=ctx)
    with autograd.pause():
        _sync(block(*inputs.values()))
    return {param.name: param.data(ctx).copy() for param in block.collect_params().values()}


def profile_checkpoint(symbol_file: str, params_file: Optional[str],
                       input_shapes: Mapping[str, Sequence[int]], *, dtype: DTypeLike = 'auto',
                       train: bool = False, iterations: int = 5, warmup: int = 2,
                       kernels: bool = True, exclude: Optional[Iterable[str]] = None,
                       fp32_ops: Optional[Iterable[str]] = None,
                       lp_ops: Optional[Iterable[str]] = None) -> ProfileReport:
    """`profile_symbol` on files: what ``mxamp profile SYMBOL.json`` runs.

    Parameters
    ----------
    symbol_file : str
        A ``*-symbol.json`` of an FP32 graph.
    params_file : str or None
        Its ``*.params`` (``arg:``/``aux:`` keys or plain names); None: random.
    input_shapes, dtype, train, iterations, warmup, kernels, exclude, fp32_ops, lp_ops
        As `profile_symbol`'s.

    Returns
    -------
    ProfileReport

    Raises
    ------
    ProfileError
        One line naming the file or option that is wrong.
    """
    try:
        with open(symbol_file) as handle:
            text = handle.read()
    except OSError as err:
        raise ProfileError('%s: %s' % (symbol_file, err.strerror))
    try:
        symbol = graph_mod.load_graph(text).symbol
    except graph_mod.GraphError as err:
        raise ProfileError('%s: %s' % (symbol_file, err))
    arg_params = aux_params = None
    if params_file is not None:
        try:
            arg_params, aux_params = load_params(params_file)
        except (OSError, ValueError, mx.base.MXNetError) as err:
            raise ProfileError('%s: %s' % (params_file, graph_mod.error_line(err)))
    return profile_symbol(symbol, arg_params, aux_params, input_shapes=input_shapes, dtype=dtype,
                          train=train, iterations=iterations, warmup=warmup, kernels=kernels,
                          exclude=exclude, fp32_ops=fp32_ops, lp_ops=lp_ops)
