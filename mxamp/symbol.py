"""The Symbol-API front: `convert_symbol`, `convert_model`, `convert_with_record` and their files.

Each public function gathers its arguments, once, into one `SymbolOptions` (the command
line and `mxamp.contrib_amp` make theirs too), which `convert_checked` reads: the options
become a `mxamp.policy.Policy` (`make_policy`); `mxamp.graph` rewrites the graph, read once;
the parameters stored in low precision are cast; files are written atomically.  It first
refuses what would give a wrong graph silently: names that match nothing, unknown or missing
parameters, parameter shapes the graph rejects (`check_params`: shapes inferred for two
probe shapes of each input, a dimension equal under both being one the graph fixes).
"""
import collections
import difflib
import os
import typing
import uuid
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import mxnet as mx

from . import cost, dtypes, hardware
from .dtypes import LOW_PRECISION, ContextLike, DTypeLike, cast, dtype_name
from .graph import Conversion, GraphError, GraphLike, convert_graph, error_line, load_graph
from .fusion import fuse_symbol
from .policy import Policy, Rules, emulates_float16, exclude_matches

__all__ = ['ConversionResult', 'ParameterError', 'SymbolOptions', 'check_params',
           'convert_checked', 'convert_model', 'convert_symbol', 'convert_with_record',
           'load_params', 'make_policy', 'save_model']


class SymbolOptions(NamedTuple):
    """The options of one conversion of the Symbol front, made once by the function that
    took them and read by `convert_checked` and `make_policy`.

    As `convert_model`'s arguments of the same names, but: `rules` holds the operator rules
    and `exclude` (`mxamp.policy.Rules`); `params`, the variables declared parameters when
    no parameter values are given (`convert_symbol`'s); `cast_params` False keeps every
    parameter FP32, cast in the graph (contrib.amp's ``cast_optional_params=False``).

    Examples
    --------
    >>> SymbolOptions('float16', ctx=mx.cpu()).rules
    Rules(fp32_ops=(), lp_ops=(), exclude=(), lp_ops_only=None, fp32_conditions=())
    """
    dtype: Optional[DTypeLike] = None
    rules: Rules = Rules()
    params: Optional[Iterable[str]] = None
    ctx: Optional[ContextLike] = None
    input_types: Optional[Mapping[str, DTypeLike]] = None
    input_shapes: Optional[Mapping[str, Sequence[int]]] = None
    portable: bool = True
    cpu_class: Optional[str] = None
    allow_missing: bool = False
    for_inference: bool = False
    cast_params: bool = True


def make_policy(options: SymbolOptions, cost_aware: bool = False) -> Policy:
    """The `Policy` for `options`, whose dtype is ``'float16'`` or ``'bfloat16'``, resolved
    (None, ``'auto'``, is refused); with ``for_inference``, for a graph fused for inference;
    `cost_aware` (the user's dtype was ``'auto'``): a bfloat16 graph for a CPU keeps the
    layers too small to pay on its class in FP32 (`mxamp.cost`; for inference alone with
    ``for_inference``).

    float16 computes GEMMs in FP32 unless every context in ``ctx`` is a GPU (no ``ctx``: a GPU)."""
    dtype = dtype_name('auto' if options.dtype is None else options.dtype, allowed=LOW_PRECISION)
    devices = [] if options.ctx is None else [c.device_type for c in _contexts(options.ctx)]
    klass = target_cpu_class(options.cpu_class)
    costs = (cost.model_for(klass, inference=options.for_inference)
             if cost_aware and dtype == 'bfloat16' and 'gpu' not in devices else None)
    return Policy(dtype, options.rules, emulate_float16=emulates_float16(devices),
                  cpu_class=klass, inference=options.for_inference, costs=costs)


def target_cpu_class(cpu_class: Optional[str]) -> str:
    """The CPU class a bfloat16 graph is built for: None, one that computes bfloat16 (files are
    for the machine that runs them); ``'auto'``, this machine's; else `cpu_class` itself."""
    if cpu_class is None:
        return hardware.AVX512_BF16
    if isinstance(cpu_class, str) and cpu_class.lower() == 'auto':
        return hardware.cpu_class()
    if cpu_class not in hardware.CPU_CLASSES:
        raise ValueError("cpu_class=%r: expected 'auto' or one of %s"
                         % (cpu_class, ', '.join(hardware.CPU_CLASSES)))
    return cpu_class


def _contexts(ctx):
    return ctx if isinstance(ctx, (list, tuple)) else [ctx]


# Name endings MXNet and Gluon give learnt parameters and statistics: a variable so named that
# the parameters lack is missing; every other variable outside them is an input.
PARAMETER_SUFFIXES = ('weight', 'bias', 'gamma', 'beta', 'alpha', 'parameters',
                      'moving_mean', 'moving_var', 'running_mean', 'running_var')

# Input shapes the parameter check tries, pair by pair, for an input given none: images, RGB
# images (for graphs that fix the channels), features or token ids, 1-d signals, volumes.  A
# pair differs in each dimension but the batch (no rank-1 pair) the graph leaves free, so a
# parameter dimension equal under both is fixed by the graph.
_PROBE_SHAPES = (((1, 3, 224, 224), (1, 1, 448, 448)),
                 ((1, 3, 224, 224), (1, 3, 448, 448)),
                 ((1, 100), (1, 300)),
                 ((1, 3, 224), (1, 1, 448)),
                 ((1, 3, 16, 224, 224), (1, 1, 32, 448, 448)))
# Shape inferences spent on probes, at most (an unrolled RNN has hundreds of inputs).
_PROBE_BUDGET = 16

Names = collections.namedtuple('Names', ['exclude', 'input_shapes', 'allow_missing',
                                         'for_inference', 'cpu'])
# How errors name the options: the Python API's spelling (the command line has its own).
PYTHON_NAMES = Names('exclude', 'input_shapes', 'allow_missing=True', 'for_inference=True',
                     'ctx=mx.cpu()')


class ParameterError(GraphError):
    """Parameters that do not fit the graph: unknown, missing, or of a shape it rejects."""


class ConversionResult(NamedTuple):
    """What `convert_with_record` returns (a named tuple): the converted graph (fused with
    ``for_inference``), its parameters (None when none were given) and the record of every
    decision, the `mxamp.graph.Conversion` (None for ``'float32'``: nothing was converted)."""
    symbol: mx.sym.Symbol
    arg_params: Optional[Dict[str, mx.nd.NDArray]]
    aux_params: Optional[Dict[str, mx.nd.NDArray]]
    conversion: Optional[Conversion]


def convert_symbol(sym: Union[mx.sym.Symbol, str], dtype: Optional[DTypeLike] = None, *,
                   params: Optional[Iterable[str]] = None, exclude: Optional[Iterable[str]] = None,
                   fp32_ops: Optional[Iterable[str]] = None, lp_ops: Optional[Iterable[str]] = None,
                   ctx: Optional[ContextLike] = None,
                   input_types: Optional[Mapping[str, DTypeLike]] = None,
                   input_shapes: Optional[Mapping[str, Sequence[int]]] = None, portable: bool = True,
                   cpu_class: Optional[str] = None) -> mx.sym.Symbol:
    """Convert an FP32 Symbol to mixed precision (FP32 inputs and outputs; docs/symbol-tool.rst).

    Parameters
    ----------
    sym : mx.sym.Symbol or str
        The FP32 graph, or its JSON text.
    dtype : str, optional
        ``'bfloat16'``, ``'float16'`` (or an alias), ``'auto'`` (default: the fastest this
        machine computes) or ``'float32'`` (the graph unchanged).
    params : iterable of str, optional
        Parameters, declared in `dtype` where only low-precision ops read them (default: none).
    exclude : iterable of str, optional
        Node names or ``fnmatch`` patterns kept in FP32; each must match a node.
    fp32_ops, lp_ops : iterable of str, optional
        Operators forced to FP32 / to low precision, added to the policy's lists.
    ctx : mx.Context or list, optional
        Where it runs: float16 on a CPU computes GEMMs in FP32 (none given: a GPU).
    input_types : dict, optional
        Inputs that are not float32 (``{'token_ids': 'int32'}``).
    input_shapes : dict, optional
        Input shapes: under bfloat16 they choose fast convolution layouts (docs/policy.rst).
    portable : bool
        True: every cast a ``Cast``; False: faster ``amp_cast``, which ``save`` drops by default.
    cpu_class : str, optional
        For bfloat16, the CPU class that will run the graph (`target_cpu_class`).

    Returns
    -------
    mx.sym.Symbol

    Raises
    ------
    ValueError, GraphError
        An unknown dtype or operator, or a name that matches nothing in the graph; a graph
        mxamp cannot read or convert.  MXNet ``contrib.amp``'s keywords are
        `mxamp.contrib_amp`'s.

    Examples
    --------
    >>> data = mx.sym.var('data')
    >>> sym = mx.sym.softmax(mx.sym.FullyConnected(data, num_hidden=10, name='fc'), name='prob')
    >>> mxamp.convert_symbol(sym, 'bfloat16').infer_type(data='float32')[1]
    [<class 'numpy.float32'>]
    """
    options = SymbolOptions(dtype, Rules.of(exclude=exclude, fp32_ops=fp32_ops, lp_ops=lp_ops),
                            params=params, ctx=ctx, input_types=input_types,
                            input_shapes=input_shapes, portable=portable, cpu_class=cpu_class)
    return convert_checked(sym, options).symbol


def convert_model(sym: Union[mx.sym.Symbol, str], arg_params: Dict[str, mx.nd.NDArray],
                  aux_params: Optional[Dict[str, mx.nd.NDArray]],
                  dtype: Optional[DTypeLike] = None, *, exclude: Optional[Iterable[str]] = None,
                  fp32_ops: Optional[Iterable[str]] = None, lp_ops: Optional[Iterable[str]] = None,
                  ctx: Optional[ContextLike] = None,
                  input_types: Optional[Mapping[str, DTypeLike]] = None,
                  input_shapes: Optional[Mapping[str, Sequence[int]]] = None, portable: bool = True,
                  cpu_class: Optional[str] = None, allow_missing: bool = False,
                  for_inference: bool = False
                  ) -> Tuple[mx.sym.Symbol, Dict[str, mx.nd.NDArray], Dict[str, mx.nd.NDArray]]:
    """Convert a checkpoint (symbol + parameters) to mixed precision.

    The parameters only low-precision ops read are cast to `dtype`, the others stay FP32; all
    are first checked against the graph (`check_params`; `input_shapes` complete the shape
    check).  The other arguments are `convert_symbol`'s.

    Parameters
    ----------
    allow_missing : bool
        Convert although parameters the graph has are missing: they stay FP32 variables.
    for_inference : bool
        Also fuse the result with oneDNN for a CPU (`mxamp.fusion.fuse_symbol`; needs
        `input_shapes`); a fused graph cannot be trained.

    Returns
    -------
    (mx.sym.Symbol, dict, dict)

    Raises
    ------
    ParameterError
        A parameter not in the graph, missing, or of a shape the graph rejects (a ValueError).

    Examples
    --------
    >>> sym = mx.sym.softmax(mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=10,
    ...                                            name='fc'), name='prob')
    >>> args = {'fc_weight': mx.nd.ones((10, 4)), 'fc_bias': mx.nd.zeros((10,))}
    >>> bf16_sym, bf16_args, bf16_auxs = mxamp.convert_model(sym, args, {}, 'bfloat16')
    >>> bf16_args['fc_weight'].dtype      # stored in bfloat16
    dtype([('bfloat16', '<u2')])
    """
    options = SymbolOptions(dtype, Rules.of(exclude=exclude, fp32_ops=fp32_ops, lp_ops=lp_ops),
                            ctx=ctx, input_types=input_types, input_shapes=input_shapes,
                            portable=portable, cpu_class=cpu_class, allow_missing=allow_missing,
                            for_inference=for_inference)
    result = convert_checked(sym, options, arg_params=arg_params, aux_params=aux_params or {})
    # Given arg_params, convert_checked returns both parameter dicts.
    args = typing.cast(Dict[str, mx.nd.NDArray], result.arg_params)
    auxs = typing.cast(Dict[str, mx.nd.NDArray], result.aux_params)
    return result.symbol, args, auxs


def convert_with_record(sym: Union[mx.sym.Symbol, str], dtype: Optional[DTypeLike] = None, *,
                        arg_params: Optional[Dict[str, mx.nd.NDArray]] = None,
                        aux_params: Optional[Dict[str, mx.nd.NDArray]] = None,
                        params: Optional[Iterable[str]] = None,
                        exclude: Optional[Iterable[str]] = None,
                        fp32_ops: Optional[Iterable[str]] = None,
                        lp_ops: Optional[Iterable[str]] = None, ctx: Optional[ContextLike] = None,
                        input_types: Optional[Mapping[str, DTypeLike]] = None,
                        input_shapes: Optional[Mapping[str, Sequence[int]]] = None,
                        portable: bool = True, cpu_class: Optional[str] = None,
                        allow_missing: bool = False, for_inference: bool = False
                        ) -> ConversionResult:
    """`convert_model` (with `arg_params`) or `convert_symbol` (without), and the record of
    what the conversion decided, node by node, as a `ConversionResult`.

    Arguments as those functions'; `params` applies without `arg_params`, `aux_params`,
    `allow_missing` and `for_inference` with them (TypeError otherwise).

    Examples
    --------
    >>> sym = mx.sym.softmax(mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=10,
    ...                                            name='fc'), name='prob')
    >>> args = {'fc_weight': mx.nd.ones((10, 4)), 'fc_bias': mx.nd.zeros((10,))}
    >>> result = mxamp.convert_with_record(sym, 'bfloat16', arg_params=args, aux_params={})
    >>> result.conversion.node_precision
    {'fc': 'bfloat16', 'prob': 'float32'}
    """
    if arg_params is None:
        for name, value, default in (('aux_params', aux_params, None), ('allow_missing', allow_missing, False),
                                     ('for_inference', for_inference, False)):
            if value is not default:
                raise TypeError('convert_with_record(): %s applies to a checkpoint; pass arg_params too'
                                % name)
    else:
        if params is not None:
            raise TypeError('convert_with_record(): params applies without arg_params (the '
                            'parameters are their keys)')
        aux_params = aux_params or {}
    options = SymbolOptions(dtype, Rules.of(exclude=exclude, fp32_ops=fp32_ops, lp_ops=lp_ops),
                            params=params, ctx=ctx, input_types=input_types,
                            input_shapes=input_shapes, portable=portable, cpu_class=cpu_class,
                            allow_missing=allow_missing, for_inference=for_inference)
    return convert_checked(sym, options, arg_params=arg_params, aux_params=aux_params)


def convert_checked(sym: GraphLike, options: SymbolOptions, names: Names = PYTHON_NAMES,
                    arg_params: Optional[Dict[str, mx.nd.NDArray]] = None,
                    aux_params: Optional[Dict[str, mx.nd.NDArray]] = None) -> ConversionResult:
    """Check `options` against graph `sym` and convert it: `convert_symbol` (no `arg_params`)
    and `convert_model` (the parameters cast as the graph declares them), errors naming the
    options by `names`.  No dtype means ``'auto'``.

    Examples
    --------
    >>> sym = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=10, name='fc')
    >>> result = mxamp.symbol.convert_checked(sym, SymbolOptions('bfloat16'))
    >>> result.conversion.node_precision, result.arg_params
    ({'fc': 'bfloat16'}, None)
    """
    graph = load_graph(sym)
    if arg_params is not None:
        aux_params = aux_params or {}
        params = list(arg_params) + list(aux_params)
    else:
        params = list(options.params or ())
        check_variables(graph, params, 'params')
    input_shapes = check_input_shapes(graph, options.input_shapes, params, names.input_shapes)
    check_variables(graph, options.input_types or (), 'input_types')
    check_exclude(graph, options.rules.exclude, names.exclude)
    if arg_params is not None:
        assert aux_params is not None
        check_params(graph, arg_params, aux_params, input_shapes, options.allow_missing, names)
    dtype = dtypes.resolve_dtype('auto' if options.dtype is None else options.dtype, options.ctx)
    devices = [] if options.ctx is None else [c.device_type for c in _contexts(options.ctx)]
    if options.for_inference and ('gpu' in devices or (dtype == 'float16' and not devices)):
        raise ValueError("%s fuses with MXNet's oneDNN backend, for CPUs: a %s graph for a GPU "
                         "has nothing it can fuse%s"
                         % (names.for_inference, dtype,
                            ' (float16 for a CPU: %s)' % names.cpu if dtype == 'float16' else ''))
    originals = None
    if dtype == 'float32':
        symbol, conversion = graph.symbol, None
    else:
        auto = options.dtype is None or dtypes.is_auto(options.dtype)
        policy = make_policy(options._replace(dtype=dtype), cost_aware=auto)
        shapes = {}
        if arg_params is not None:
            assert aux_params is not None
            shapes = {name: value.shape for name, value in list(arg_params.items()) + list(aux_params.items())}
        shapes.update(input_shapes)
        # keep_batchnorm: Module's inference bind would fold BatchNorm with truncated values.
        # The inputs given shapes are the network's, not parameters (check_input_shapes).
        def converted(declared):
            return convert_graph(graph, policy, params=declared, input_types=options.input_types,
                                 shapes=shapes, portable=options.portable,
                                 data_inputs=set(input_shapes), keep_batchnorm=True)

        conversion = converted(params if options.cast_params else ())
        if policy.costs is not None and not conversion.computes_low and conversion.lp_params:
            # No layer pays ('auto'): the graph computes in FP32, its parameters too.
            conversion = converted(())
        symbol = conversion.symbol
        if arg_params is not None:
            originals = dict(arg_params)
            arg_params, aux_params = _cast_params(arg_params, conversion), _cast_params(aux_params, conversion)
    if options.for_inference:
        # BatchNorm folds start from the FP32 values, so each folded value is rounded once.
        symbol, fused_args, fused_auxs = fuse_symbol(symbol, arg_params, aux_params, input_shapes,
                                                     names.input_shapes, originals)
        if arg_params is not None:
            arg_params, aux_params = fused_args, fused_auxs
    return ConversionResult(symbol, arg_params, aux_params, conversion)


def _cast_params(values, conversion):
    """`values` with the parameters the rewrite stores in low precision cast to its dtype."""
    return {name: cast(value, conversion.dtype) if name in conversion.lp_params else value
            for name, value in values.items()}


def is_parameter_name(name: str) -> bool:
    """Whether a variable named `name` is a parameter by MXNet's and Gluon's naming (`PARAMETER_SUFFIXES`)."""
    return any(name == suffix or name.endswith('_' + suffix) for suffix in PARAMETER_SUFFIXES)


def graph_inputs(graph: GraphLike, params: Iterable[str] = ()) -> List[str]:
    """The inputs of `graph`: the arguments outside `params` not named like parameters."""
    params = set(params)
    return [name for name in load_graph(graph).symbol.list_arguments()
            if name not in params and not is_parameter_name(name)]


def _listing(names, limit=6):
    quoted = ["'%s'" % name for name in names]
    if len(quoted) > limit:
        return '%s and %d more' % (', '.join(quoted[:limit]), len(quoted) - limit)
    return ', '.join(quoted) or 'none'


def check_variables(graph: GraphLike, names: Iterable[str], what: str) -> None:
    """Raise ValueError (naming option `what`) for a name in `names` that is not a variable of `graph`."""
    symbol = load_graph(graph).symbol
    variables = set(symbol.list_arguments()) | set(symbol.list_auxiliary_states())
    unknown = [name for name in names if name not in variables]
    if unknown:
        raise ValueError('%s: %s %s of the graph'
                         % (what, _listing(unknown),
                            'is not a variable' if len(unknown) == 1 else 'are not variables'))


def check_input_shapes(graph: GraphLike, input_shapes: Optional[Mapping[str, Sequence[int]]],
                       params: Iterable[str] = (), what: str = 'input_shapes'
                       ) -> Dict[str, Tuple[int, ...]]:
    """`input_shapes` as ``{name: tuple}``; ValueError naming option `what` for a name that is
    no argument outside `params`, or shapes the graph rejects (with what MXNet expects)."""
    shapes = {name: tuple(shape) for name, shape in (input_shapes or {}).items()}
    params = set(params)
    symbol = load_graph(graph).symbol
    arguments = symbol.list_arguments()
    allowed = set(arguments) - params
    unknown = [name for name in shapes if name not in allowed]
    if unknown:
        inputs = graph_inputs(graph, params) or [name for name in arguments if name not in params]
        raise ValueError('%s: %s %s not an input of the graph (its inputs: %s)'
                         % (what, _listing(unknown), 'is' if len(unknown) == 1 else 'are',
                            _listing(inputs)))
    if shapes:
        try:
            symbol.infer_shape_partial(**shapes)
        except mx.base.MXNetError as err:
            raise _rejected_shapes(what, shapes, err)
    return shapes


def _rejected_shapes(what, input_shapes, err):
    """The ValueError for input shapes MXNet's shape inference rejected (`err`)."""
    given = ', '.join('%s=%s' % (name, ','.join(str(d) for d in shape))
                      for name, shape in sorted(input_shapes.items()))
    return ValueError('%s: the graph rejects these shapes (%s): %s' % (what, given, error_line(err)))


def check_exclude(graph: GraphLike, exclude: Optional[Iterable[str]], what: str = 'exclude') -> None:
    """Raise ValueError (naming option `what`) for `exclude` entries (names or ``fnmatch``
    patterns) that match no node of `graph`, suggesting a close node name."""
    nodes = [node['name'] for node in load_graph(graph)['nodes'] if node['op'] != 'null']
    unmatched = [entry for entry in exclude or () if not any(exclude_matches(n, entry) for n in nodes)]
    if unmatched:
        described = ', '.join("'%s'%s" % (entry, _suggestion(entry, nodes)) for entry in unmatched)
        raise ValueError('%s: %s %s no node of the graph'
                         % (what, described, 'matches' if len(unmatched) == 1 else 'match'))


def _suggestion(entry, nodes):
    # A pattern 'stgae4*' is compared with the nodes' names cut to its length.
    literal = entry.rstrip('*')
    star = entry[len(literal):]
    candidates = {name[:len(literal)] for name in nodes} if star else set(nodes)
    close = difflib.get_close_matches(literal, sorted(candidates), n=1)
    return " (did you mean '%s%s'?)" % (close[0], star) if close else ''


def check_params(graph: GraphLike, arg_params: Mapping[str, mx.nd.NDArray],
                 aux_params: Mapping[str, mx.nd.NDArray],
                 input_shapes: Optional[Mapping[str, Tuple[int, ...]]] = None,
                 allow_missing: bool = False, names: Names = PYTHON_NAMES) -> None:
    """Raise `ParameterError` (one line) when the parameters do not fit `graph`.

    In order: a parameter that is not a variable of its kind; missing ones, unless
    `allow_missing` (`names` spells it); a shape the graph rejects, naming the shape it needs
    (``?`` where it depends on an input's size) and the node that reads it."""
    graph = load_graph(graph)
    symbol = graph.symbol
    arguments, auxiliary = symbol.list_arguments(), symbol.list_auxiliary_states()
    for kind, values, expected in (('arg', arg_params, set(arguments)), ('aux', aux_params, set(auxiliary))):
        for name in values:
            if name not in expected:
                other = auxiliary if kind == 'arg' else arguments
                hint = (' (it is an %s of the graph)' % ('auxiliary state' if kind == 'arg' else 'argument')
                        if name in other else '')
                raise ParameterError("parameter '%s:%s' is not in the graph%s" % (kind, name, hint))
    input_shapes = input_shapes or {}
    missing = (['arg:' + name for name in arguments if name not in arg_params and name not in input_shapes
                and is_parameter_name(name)]
               + ['aux:' + name for name in auxiliary if name not in aux_params])
    if missing and not allow_missing:
        raise ParameterError('%s %s %s missing (%s converts without %s)'
                             % ('parameter' if len(missing) == 1 else 'parameters', _listing(missing),
                                'is' if len(missing) == 1 else 'are', names.allow_missing,
                                'it' if len(missing) == 1 else 'them'))
    given = {name: value.shape for name, value in list(arg_params.items()) + list(aux_params.items())}
    inputs = [name for name in arguments if name not in arg_params and not is_parameter_name(name)]
    probes, probed = _probe_shapes(symbol, inputs, input_shapes, names.input_shapes)
    for name in arguments + auxiliary:
        needed = _agreed(probe.get(name) for probe in probes) if name in given else None
        if needed is not None and (len(needed) != len(given[name]) or any(
                want is not None and want != got for want, got in zip(needed, given[name]))):
            raise ParameterError("parameter '%s' has shape %s; %s needs %s"
                                 % (name, _shape_text(given[name]), _reader(graph, name),
                                    _shape_text(needed)))
    if not probed and all(probes[0].get(name) and all(probes[0][name]) for name in inputs):
        # Every input shape is known, none probed: MXNet checks the parameters together.
        try:
            symbol.infer_shape_partial(**dict({n: s for n, s in given.items() if n in arg_params},
                                              **input_shapes))
        except mx.base.MXNetError as err:
            raise ParameterError('parameter shapes do not fit the graph: %s' % error_line(err))


def _probe_shapes(symbol, inputs, input_shapes, what):
    """``(probes, probed)``: the graph's variable shapes for two sets of input shapes,
    `input_shapes` completed by the first `_PROBE_SHAPES` pair the graph accepts for each other
    input, and whether any was probed.  ValueError (option `what`) if `input_shapes` fail."""
    names = symbol.list_arguments() + symbol.list_auxiliary_states()

    def infer(shapes):
        arg_shapes, _, aux_shapes = symbol.infer_shape_partial(**shapes)
        return dict(zip(names, list(arg_shapes) + list(aux_shapes)))
    try:
        known = infer(input_shapes)
    except mx.base.MXNetError as err:
        if input_shapes:
            raise _rejected_shapes(what, input_shapes, err)
        known = {}      # some graphs infer nothing until an input has a shape
    sets = [(dict(input_shapes), known), (dict(input_shapes), known)]
    budget = _PROBE_BUDGET
    probed = False
    pending = [name for name in inputs if name not in input_shapes]
    progress = True
    while progress and budget >= 2:
        # An input the graph cannot shape alone (a valid length) may fit once others have shapes.
        progress = False
        for name in list(pending):
            if sets[0][1].get(name):
                pending.remove(name)        # shaped by the inputs probed before it (a label)
                continue
            for pair in _PROBE_SHAPES:
                if budget < 2:
                    break
                tried = []
                for (shapes, _), shape in zip(sets, pair):
                    budget -= 1
                    shapes = dict(shapes, **{name: shape})
                    try:
                        tried.append((shapes, infer(shapes)))
                    except mx.base.MXNetError:
                        break
                if len(tried) == 2:
                    sets, probed, progress = tried, True, True
                    pending.remove(name)
                    break
    return [inferred for _, inferred in sets], probed


def _agreed(shapes):
    """The shape all `shapes` agree on, None in a dimension where they differ or are unknown;
    None altogether when one is unknown or their ranks differ."""
    shapes = list(shapes)
    if not shapes or any(not shape for shape in shapes) or len({len(s) for s in shapes}) != 1:
        return None
    return tuple(dims[0] if dims[0] and len(set(dims)) == 1 else None for dims in zip(*shapes))


def _shape_text(shape):
    dims = ['?' if dim is None else str(dim) for dim in shape]
    return '(%s%s)' % (', '.join(dims), ',' if len(dims) == 1 else '')


def _reader(graph, name):
    """'node NAME (OP)' for the first node that reads variable `name`."""
    nodes = graph['nodes']
    node = next(node for node in nodes if node['op'] != 'null'
                and any(nodes[src]['name'] == name for src, _, _ in node['inputs']))
    return "node '%s' (%s)" % (node['name'], node['op'])


def load_params(path: str) -> Tuple[Dict[str, mx.nd.NDArray], Dict[str, mx.nd.NDArray]]:
    """``(arg_params, aux_params)`` of an MXNet ``.params`` file; `GraphError` if unreadable."""
    try:
        loaded = mx.nd.load(path)
    except mx.base.MXNetError as err:
        raise GraphError("cannot read parameters from '%s': %s" % (path, error_line(err)))
    if not isinstance(loaded, dict):
        raise GraphError("'%s' holds unnamed arrays, not a parameter dictionary" % path)
    arg_params, aux_params = {}, {}
    for key, value in loaded.items():
        kind, _, name = key.partition(':')
        if kind == 'arg' and name:
            arg_params[name] = value
        elif kind == 'aux' and name:
            aux_params[name] = value
        else:
            # Gluon's save_parameters writes bare names; treat them as arguments.
            arg_params[key] = value
    return arg_params, aux_params


def save_model(prefix: str, symbol: mx.sym.Symbol,
               arg_params: Optional[Mapping[str, mx.nd.NDArray]] = None,
               aux_params: Optional[Mapping[str, mx.nd.NDArray]] = None) -> List[str]:
    """Write ``PREFIX-symbol.json`` (and ``PREFIX-0000.params``) with no partial files on failure.

    Both are written to temporary names in the target directory, renamed once both succeeded.
    `GraphError` names the output (never a temporary file) when one cannot be written.
    """
    directory = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(directory):
        raise GraphError("output directory '%s' does not exist" % directory)
    outputs = [('%s-symbol.json' % prefix, lambda tmp: symbol.save(tmp, remove_amp_cast=False))]
    if arg_params is not None:
        saved = {'arg:%s' % k: v for k, v in arg_params.items()}
        saved.update({'aux:%s' % k: v for k, v in (aux_params or {}).items()})
        outputs.append(('%s-0000.params' % prefix, lambda tmp: mx.nd.save(tmp, saved)))
    # A directory in the way would fail only at its rename, maybe after the other one's.
    for final, _ in outputs:
        if os.path.isdir(final):
            raise GraphError("output '%s' is a directory" % final)
    staged = []
    try:
        for final, write in outputs:
            temporary = os.path.join(directory, '.mxamp-%d-%s.tmp' % (os.getpid(), uuid.uuid4().hex))
            try:
                # By open: the umask's permissions (mkstemp: 0600); MXNet's errors hide why.
                open(temporary, 'xb').close()
                staged.append((temporary, final))
                write(temporary)
            except OSError as err:
                raise GraphError("cannot write '%s': %s" % (final, err.strerror or err))
            except mx.base.MXNetError as err:
                raise GraphError("cannot write '%s': %s" % (final, error_line(err)))
        for temporary, final in staged:
            os.replace(temporary, final)
    finally:
        for temporary, _ in staged:
            if os.path.exists(temporary):
                os.unlink(temporary)
    return [final for _, final in staged]
