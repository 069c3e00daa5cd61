"""The Symbol-API front: `convert_symbol`, `convert_model`, `convert_with_record` and their files.

It turns user-facing arguments (dtype names, op and layer overrides, a context;
MXNet contrib.amp's keywords too, through `mxamp.migration`) into a
`mxamp.policy.Policy`, runs the graph rewrite of `mxamp.graph`, casts the
parameters the rewrite stores in low precision, and reads and writes
``*-symbol.json`` / ``*.params`` files atomically (a failed conversion never
leaves a partial output file).  `convert_with_record` also returns the
rewrite's record of every decision (`mxamp.graph.Conversion`).

Before converting it refuses what would give a wrong graph without a word:
names that match nothing in the graph (``exclude`` entries, ``input_shapes``
keys), parameters the graph does not have, parameters it needs that are
missing, and parameter shapes the graph rejects (`check_params`).  The
parameters' own shapes are checked even without input shapes: the graph's
shapes are inferred for two probe shapes of each input, and a parameter
dimension that comes out the same under both is one the graph fixes.  Errors
name the option as the caller's interface spells it (`PYTHON_NAMES`, or the
command line's flags).

The graph is read once (`mxamp.graph.load_graph`): checks, shape inference
and the rewrite share the Symbol MXNet loaded.
"""
import collections
import difflib
import os
import typing
import uuid
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import mxnet as mx

from . import dtypes, hardware
from .dtypes import LOW_PRECISION, ContextLike, DTypeLike, cast, dtype_name
from .graph import Conversion, GraphError, GraphLike, LoadedGraph, convert_graph, error_line, load_graph
from .fusion import fuse_symbol
from .migration import from_contrib_amp
from .policy import Condition, Policy, emulates_float16, exclude_matches

__all__ = ['ConversionResult', 'ParameterError', 'check_params', 'convert_model', 'convert_symbol',
           'convert_with_record', 'load_params', 'make_policy', 'save_model']


def make_policy(dtype: DTypeLike, exclude: Optional[Iterable[str]] = None,
                fp32_ops: Optional[Iterable[str]] = None, lp_ops: Optional[Iterable[str]] = None,
                ctx: Optional[ContextLike] = None, batchnorm_data: str = 'low',
                cpu_class: Optional[str] = None, lp_ops_only: Optional[Iterable[str]] = None,
                fp32_conditions: Iterable[Condition] = (), inference: bool = False) -> Policy:
    """The `Policy` for user arguments (`inference`: for a graph fused for inference).

    float16 computes GEMMs in FP32 unless every context in `ctx` is a GPU
    (`mxamp.policy.emulates_float16`; no `ctx`: a GPU).  bfloat16 graphs are
    for `cpu_class` (see `convert_symbol`).  `lp_ops_only` and
    `fp32_conditions` are the policy's (contrib.amp's ``target_dtype_ops`` and
    ``conditional_fp32_ops``, `mxamp.migration`).
    """
    dtype = dtype_name(dtype, allowed=LOW_PRECISION)
    devices = [] if ctx is None else [c.device_type for c in _contexts(ctx)]
    return Policy(dtype, fp32_ops=fp32_ops or (), lp_ops=lp_ops or (), exclude=exclude or (),
                  batchnorm_data=batchnorm_data, emulate_float16=emulates_float16(devices),
                  cpu_class=target_cpu_class(cpu_class), lp_ops_only=lp_ops_only,
                  fp32_conditions=fp32_conditions, inference=inference)


def target_cpu_class(cpu_class: Optional[str]) -> str:
    """The CPU class a bfloat16 graph is built for: `cpu_class`, resolved.

    None means a CPU that computes bfloat16 (``'avx512_bf16'``: graph files are
    for the machine that runs them); ``'auto'`` means this machine's class
    (`mxamp.hardware.cpu_class`); any class name is taken as it is.
    """
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


# Name endings MXNet (``fc1_weight``, ``bn0_moving_var``) and Gluon
# (``dense0_weight``, ``batchnorm0_running_mean``, ``prelu0_alpha``) give learnt
# parameters and statistics.  A variable so named that the parameters lack is a
# missing parameter; every other variable outside the parameters is an input
# (``data``, ``softmax_label``, an RNN's initial state).
PARAMETER_SUFFIXES = ('weight', 'bias', 'gamma', 'beta', 'alpha', 'parameters',
                      'moving_mean', 'moving_var', 'running_mean', 'running_var')

# Input shapes the parameter check tries, pair by pair, for an input given none:
# the two shapes of a pair differ in every dimension but the batch, so that a
# parameter dimension equal under both is fixed by the graph, not by the input's
# size.  The second pair is for graphs that fix an image's channels (weights
# with ``__shape__``).  No rank-1 pair: its only dimension is the batch, so
# nothing would tell the graph's dimensions from the input's.
_PROBE_SHAPES = (((1, 3, 224, 224), (1, 1, 448, 448)),             # images
                 ((1, 3, 224, 224), (1, 3, 448, 448)),             # RGB images
                 ((1, 100), (1, 300)),                             # features, token ids
                 ((1, 3, 224), (1, 1, 448)),                       # 1-d signals, sequences
                 ((1, 3, 16, 224, 224), (1, 1, 32, 448, 448)))     # volumes
# Shape inferences spent looking for probe shapes, at most: a graph with hundreds
# of inputs (an unrolled RNN) is checked as far as the probes found reach.
_PROBE_BUDGET = 16

Names = collections.namedtuple('Names', ['exclude', 'input_shapes', 'allow_missing',
                                         'for_inference', 'cpu'])
# How errors name the options: the Python API's spelling (the command line has its own).
PYTHON_NAMES = Names('exclude', 'input_shapes', 'allow_missing=True', 'for_inference=True',
                     'ctx=mx.cpu()')


class ParameterError(GraphError):
    """Parameters that do not fit the graph: unknown, missing, or of a shape it rejects."""


class ConversionResult(NamedTuple):
    """What `convert_with_record` returns: the converted graph, its parameters and the record.

    A named tuple, so ``symbol, arg_params, aux_params, conversion =
    mxamp.convert_with_record(...)`` works too.

    Attributes
    ----------
    symbol : mx.sym.Symbol
        The converted graph (fused with ``for_inference=True``).
    arg_params, aux_params : dict of str to NDArray, or None
        The converted parameters; None when none were given.
    conversion : mxamp.graph.Conversion or None
        The record of every decision: ``conversion.node_precision`` (the
        precision each node of the FP32 graph runs in), ``conversion.casts``
        (the casts inserted), ``conversion.lp_params`` (the parameters stored
        in low precision).  None when the dtype is, or ``'auto'`` resolves to,
        ``'float32'``: nothing was converted.
    """
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
                   cpu_class: Optional[str] = None, target_dtype: Optional[DTypeLike] = None,
                   target_dtype_ops: Optional[Iterable[str]] = None,
                   conditional_fp32_ops: Optional[Iterable[Tuple[str, str, Iterable[str]]]] = None,
                   excluded_sym_names: Optional[Iterable[str]] = None,
                   data_names: Optional[Iterable[str]] = None,
                   cast_optional_params: Optional[bool] = None) -> mx.sym.Symbol:
    """Convert an FP32 Symbol to mixed precision.

    Takes contrib.amp's keywords too, with contrib.amp's meaning
    (``mxnet.contrib.amp.convert_symbol``; `mxamp.migration` says what each
    becomes).  The options after `dtype` are keyword-only.

    Parameters
    ----------
    sym : mx.sym.Symbol or str
        The FP32 graph, or its JSON text.
    dtype : str, optional
        Target low precision: ``'bfloat16'`` or ``'float16'`` (aliases
        ``'bf16'``, ``'fp16'``, ``'half'``), or ``'auto'``: the fastest
        precision this machine computes (`mxamp.dtypes.resolve_dtype`, with
        `ctx`).  ``'float32'`` (also what ``'auto'`` gives on a CPU without
        native bfloat16) returns the graph unchanged, as `mxamp.convert` does.
        Left out (and no `target_dtype`): ``'auto'``, as `mxamp.convert`'s.
        contrib.amp's default, ``'float16'``, is not mxamp's: a contrib.amp
        call that left ``target_dtype`` out needs ``target_dtype='float16'``
        here.
    params : iterable of str, optional
        Names of the variables that are parameters.  Those consumed only by
        low-precision ops are declared in `dtype`, so their values must be stored
        in `dtype` (`convert_model` does that); every other variable is an input
        accepted in FP32.  By default every variable is an FP32 input and the
        graph casts the weights it needs in low precision.
    exclude : iterable of str, optional
        Node names or ``fnmatch`` patterns kept entirely in FP32; each must
        match a node of the graph.
    fp32_ops, lp_ops : iterable of str, optional
        Operator names forced to FP32 / to low precision.  Both add to the
        policy's lists (contrib.amp's ``fp32_ops`` replaced its FP32 list:
        here softmax, normalisations and reductions stay FP32).
    ctx : mx.Context or list, optional
        Where the graph will run.  float16 on a CPU (also in a list mixing CPUs
        and GPUs) computes the GEMM-based ops in FP32 between float16 casts
        (MXNet has no float16 GEMM on CPUs); without `ctx` float16 targets a GPU.
    input_types : dict, optional
        Inputs that are not float32, e.g. ``{'token_ids': 'int32'}``.
    input_shapes : dict, optional
        Input shapes, e.g. ``{'data': (1, 3, 224, 224)}``; each name must be a
        variable of the graph outside `params`.  Under bfloat16 they let
        convolutions that oneDNN cannot run in blocked bfloat16 layouts (a
        3-channel stem) get the layout that is fast (see docs/policy.rst,
        "Convolution layouts under bfloat16"); ``__shape__`` attributes serve
        the same purpose.
    portable : bool
        True (default): every cast is a ``Cast`` node, and the graph survives
        MXNet's ``save``/``save_checkpoint`` with their defaults.  False:
        activations are cast with ``amp_cast``, much faster on a CPU; save such a
        graph with ``remove_amp_cast=False`` (MXNet drops amp_cast otherwise).
    cpu_class : str, optional
        bfloat16 only: the CPU class that will run the graph (see
        `mxamp.hardware.cpu_class`).  None (default): a CPU that computes
        bfloat16, so the graph computes in bfloat16.  ``'avx2'`` or
        ``'avx512'``: CPUs without native bfloat16, where every op computes in
        FP32 and the parameters stay stored in bfloat16 (the same parameter
        files).  ``'auto'``: this machine's class.
    target_dtype : str, optional
        contrib.amp's name for `dtype` (give one of the two).
    target_dtype_ops : list of str, optional
        contrib.amp's list of the operators run in low precision, replacing
        mxamp's (`mxamp.policy.default_lp_ops`): the GEMM-based operators not
        named run in FP32, named operators outside them are forced to low
        precision.
    conditional_fp32_ops : list of (str, str, list of str), optional
        ``(operator, attribute, values)``: nodes whose attribute has one of
        the values run in FP32, e.g. ``[('Activation', 'act_type',
        ['softrelu'])]``; added to mxamp's own conditions.
    excluded_sym_names : list of str, optional
        contrib.amp's name for `exclude` (give one of the two).
    data_names : list of str, optional
        contrib.amp's: the variables that are data inputs; with
        ``cast_optional_params=True`` every other variable is a parameter (as
        `params` declares them).  Give `params` or `data_names`.
    cast_optional_params : bool, optional
        contrib.amp's: True declares the parameters (`data_names`'
        complement) that only low-precision ops read in `dtype`; False keeps
        every variable an FP32 input (mxamp's default without `params`).

    Returns
    -------
    mx.sym.Symbol
        The converted graph: it accepts FP32 inputs and returns FP32 outputs.
        `convert_with_record` also returns the record of the conversion.

    Raises
    ------
    TypeError
        An option given in both spellings (`dtype` and `target_dtype`, `exclude`
        and `excluded_sym_names`, `params` and `data_names`).
    ValueError
        An unknown dtype or operator, or a name in `params`, `exclude`,
        `input_shapes`, `input_types` or `data_names` that matches nothing in
        the graph.
    GraphError
        A graph mxamp cannot read or convert.

    Examples
    --------
    >>> data = mx.sym.var('data')
    >>> sym = mx.sym.softmax(mx.sym.FullyConnected(data, num_hidden=10, name='fc'), name='prob')
    >>> bf16 = mxamp.convert_symbol(sym, 'bfloat16')
    >>> bf16.infer_type(data='float32')[1]     # inputs and outputs stay FP32
    [<class 'numpy.float32'>]
    >>> bf16.save('net_bf16-symbol.json')

    contrib.amp's spelling:

    >>> f16 = mxamp.convert_symbol(sym, target_dtype='float16', fp32_ops=['FullyConnected'])
    """
    return _front('convert_symbol', sym, dtype, params=params, exclude=exclude,
                  fp32_ops=fp32_ops, lp_ops=lp_ops, ctx=ctx, input_types=input_types,
                  input_shapes=input_shapes, portable=portable, cpu_class=cpu_class,
                  target_dtype=target_dtype, target_dtype_ops=target_dtype_ops,
                  conditional_fp32_ops=conditional_fp32_ops,
                  excluded_sym_names=excluded_sym_names, data_names=data_names,
                  cast_optional_params=cast_optional_params).symbol


def convert_model(sym: Union[mx.sym.Symbol, str], arg_params: Dict[str, mx.nd.NDArray],
                  aux_params: Optional[Dict[str, mx.nd.NDArray]],
                  dtype: Optional[DTypeLike] = None, *, exclude: Optional[Iterable[str]] = None,
                  fp32_ops: Optional[Iterable[str]] = None, lp_ops: Optional[Iterable[str]] = None,
                  ctx: Optional[ContextLike] = None,
                  input_types: Optional[Mapping[str, DTypeLike]] = None,
                  input_shapes: Optional[Mapping[str, Sequence[int]]] = None, portable: bool = True,
                  cpu_class: Optional[str] = None, allow_missing: bool = False,
                  for_inference: bool = False, target_dtype: Optional[DTypeLike] = None,
                  target_dtype_ops: Optional[Iterable[str]] = None,
                  conditional_fp32_ops: Optional[Iterable[Tuple[str, str, Iterable[str]]]] = None,
                  excluded_sym_names: Optional[Iterable[str]] = None,
                  cast_optional_params: Optional[bool] = None
                  ) -> Tuple[mx.sym.Symbol, Dict[str, mx.nd.NDArray], Dict[str, mx.nd.NDArray]]:
    """Convert a checkpoint (symbol + parameters) to mixed precision.

    Parameters consumed only by low-precision ops are cast to `dtype`;
    BatchNorm's gamma/beta/moving statistics and every other parameter stay FP32.
    The parameters are checked against the graph first (`check_params`): each
    must be a variable of the graph, each parameter the graph has must be
    there, and each shape must be one the graph accepts.  ``input_shapes``
    (e.g. ``{'data': (1, 3, 224, 224)}``) make the shape check complete;
    without them the dimensions that depend on an input's size (a dense layer
    reading a flattened image) go unchecked.  The parameters' shapes also
    choose the fast bfloat16 layout of each convolution.  The other arguments
    are those of `convert_symbol` (contrib.amp's keywords included,
    ``mxnet.contrib.amp.convert_model``'s), and:

    Parameters
    ----------
    allow_missing : bool
        Convert even when parameters the graph has are missing from
        `arg_params`/`aux_params` (a variable named like a parameter,
        ``*_weight``, ``*_gamma``..., or any auxiliary state): they stay FP32
        variables of the converted graph, bound by the caller.
    for_inference : bool
        Also fuse the converted graph with MXNet's oneDNN backend for
        inference on a CPU (`mxamp.inference.fuse_symbol`: BatchNorm folded
        into convolutions, activations and residual additions as post-ops;
        also for ``'float32'``).  Needs `input_shapes` for the inputs the graph
        cannot shape from its parameters, and a CPU target (float16:
        ``ctx=mx.cpu()``).  The fused graph cannot be trained
        (`mxamp.ModuleTrainer` refuses it); its parameters are the converted
        ones, unchanged.
    cast_optional_params : bool, optional
        contrib.amp's: True, like mxamp's default (None), stores the
        parameters that only low-precision ops read in `dtype`; False
        (contrib.amp's default) keeps every parameter FP32 and casts it in the
        graph, at every run.

    Returns
    -------
    (mx.sym.Symbol, dict, dict)
        The converted (and fused) symbol and its ``arg_params``, ``aux_params``
        (when `dtype` is, or ``'auto'`` resolves to, ``'float32'``, the
        checkpoint comes back unconverted, fused with `for_inference`).

    Raises
    ------
    ParameterError
        A parameter is not in the graph, is missing, or has a shape the graph
        rejects (a `GraphError`, so a ``ValueError``).
    TypeError, ValueError
        As `convert_symbol`.

    Examples
    --------
    >>> sym = mx.sym.softmax(mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=10,
    ...                                            name='fc'), name='prob')
    >>> args = {'fc_weight': mx.nd.ones((10, 4)), 'fc_bias': mx.nd.zeros((10,))}
    >>> bf16_sym, bf16_args, bf16_auxs = mxamp.convert_model(sym, args, {}, 'bfloat16')
    >>> bf16_args['fc_weight'].dtype      # stored in bfloat16
    dtype([('bfloat16', '<u2')])
    >>> mx.model.save_checkpoint('net_bf16', 0, bf16_sym, bf16_args, bf16_auxs)

    For inference on a CPU, fused:

    >>> fused_sym, fused_args, fused_auxs = mxamp.convert_model(
    ...     sym, args, {}, 'bfloat16', input_shapes={'data': (1, 4)}, for_inference=True)
    >>> mxamp.inference.fused_nodes(fused_sym)
    Counter({'_sg_mkldnn_fully_connected': 1})
    """
    result = _front('convert_model', sym, dtype, arg_params=arg_params,
                    aux_params=aux_params or {}, exclude=exclude, fp32_ops=fp32_ops, lp_ops=lp_ops,
                    ctx=ctx, input_types=input_types, input_shapes=input_shapes, portable=portable,
                    cpu_class=cpu_class, allow_missing=allow_missing, for_inference=for_inference,
                    target_dtype=target_dtype, target_dtype_ops=target_dtype_ops,
                    conditional_fp32_ops=conditional_fp32_ops,
                    excluded_sym_names=excluded_sym_names,
                    cast_optional_params=cast_optional_params)
    # Given arg_params, _front returns both parameter dicts.
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
                        allow_missing: bool = False, for_inference: bool = False,
                        target_dtype: Optional[DTypeLike] = None,
                        target_dtype_ops: Optional[Iterable[str]] = None,
                        conditional_fp32_ops: Optional[Iterable[Tuple[str, str, Iterable[str]]]] = None,
                        excluded_sym_names: Optional[Iterable[str]] = None,
                        data_names: Optional[Iterable[str]] = None,
                        cast_optional_params: Optional[bool] = None) -> ConversionResult:
    """`convert_model` (with `arg_params`) or `convert_symbol` (without), and the record of
    what the conversion decided, node by node.

    Parameters
    ----------
    sym : mx.sym.Symbol or str
        The FP32 graph, or its JSON text.
    dtype : str, optional
        As `convert_symbol`'s.
    arg_params, aux_params : dict of str to NDArray, optional
        The checkpoint's parameters: converted and checked as `convert_model`
        does.  Without them the graph is converted as `convert_symbol` does
        (then `params` and `data_names` apply, `allow_missing` and
        `for_inference` do not).
    params, exclude, fp32_ops, lp_ops, ctx, input_types, input_shapes, portable, cpu_class
        As `convert_symbol`'s.
    allow_missing, for_inference
        As `convert_model`'s.
    target_dtype, target_dtype_ops, conditional_fp32_ops, excluded_sym_names, data_names, cast_optional_params
        contrib.amp's, as `convert_symbol` and `convert_model` take them.

    Returns
    -------
    ConversionResult
        ``.symbol``, ``.arg_params``, ``.aux_params`` (None without
        `arg_params`) and ``.conversion``, the `mxamp.graph.Conversion` (None
        when nothing was converted: ``'float32'``).

    Raises
    ------
    TypeError
        As `convert_symbol`, and `params`, `data_names`, `allow_missing` or
        `for_inference` where they do not apply.
    ValueError, GraphError, ParameterError
        As `convert_symbol` and `convert_model`.

    Examples
    --------
    >>> sym = mx.sym.softmax(mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=10,
    ...                                            name='fc'), name='prob')
    >>> args = {'fc_weight': mx.nd.ones((10, 4)), 'fc_bias': mx.nd.zeros((10,))}
    >>> result = mxamp.convert_with_record(sym, 'bfloat16', arg_params=args, aux_params={})
    >>> result.conversion.node_precision
    {'fc': 'bfloat16', 'prob': 'float32'}
    >>> sorted(result.conversion.lp_params)
    ['fc_bias', 'fc_weight']
    """
    if arg_params is None:
        for name, value, default in (('aux_params', aux_params, None), ('allow_missing', allow_missing, False),
                                     ('for_inference', for_inference, False)):
            if value is not default:
                raise TypeError('convert_with_record(): %s applies to a checkpoint; pass arg_params too'
                                % name)
    else:
        for option, given in (('params', params), ('data_names', data_names)):
            if given is not None:
                raise TypeError('convert_with_record(): %s applies without arg_params (the '
                                'parameters are their keys)' % option)
        aux_params = aux_params or {}
    return _front('convert_with_record', sym, dtype, arg_params=arg_params,
                  aux_params=aux_params, params=params, exclude=exclude, fp32_ops=fp32_ops,
                  lp_ops=lp_ops, ctx=ctx, input_types=input_types, input_shapes=input_shapes,
                  portable=portable, cpu_class=cpu_class, allow_missing=allow_missing,
                  for_inference=for_inference, target_dtype=target_dtype,
                  target_dtype_ops=target_dtype_ops, conditional_fp32_ops=conditional_fp32_ops,
                  excluded_sym_names=excluded_sym_names, data_names=data_names,
                  cast_optional_params=cast_optional_params)


def _front(function: str, sym: GraphLike, dtype: Optional[DTypeLike],
           arg_params: Optional[Dict[str, mx.nd.NDArray]] = None,
           aux_params: Optional[Dict[str, mx.nd.NDArray]] = None,
           params: Optional[Iterable[str]] = None, data_names: Optional[Iterable[str]] = None,
           target_dtype: Optional[DTypeLike] = None, target_dtype_ops: Optional[Iterable[str]] = None,
           conditional_fp32_ops: Optional[Iterable[Tuple[str, str, Iterable[str]]]] = None,
           excluded_sym_names: Optional[Iterable[str]] = None,
           cast_optional_params: Optional[bool] = None, exclude: Optional[Iterable[str]] = None,
           fp32_ops: Optional[Iterable[str]] = None, lp_ops: Optional[Iterable[str]] = None,
           ctx: Optional[ContextLike] = None, **checked: Any) -> ConversionResult:
    """The public functions' common part: both spellings to mxamp's (`mxamp.migration`), then `_convert`.

    Without `dtype` (in either spelling) the dtype is ``'auto'``.  `checked`
    holds `_convert`'s other options.
    """
    options = from_contrib_amp(function, dtype, fp32_ops=fp32_ops, lp_ops=lp_ops, exclude=exclude,
                               target_dtype=target_dtype, target_dtype_ops=target_dtype_ops,
                               conditional_fp32_ops=conditional_fp32_ops,
                               excluded_sym_names=excluded_sym_names,
                               cast_optional_params=cast_optional_params)
    dtype = 'auto' if options.dtype is None else options.dtype
    graph = load_graph(sym)
    if arg_params is None:
        params = _declared_params(function, graph, params, data_names, options.cast_params)
    symbol, args, auxs, conversion = _convert(
        graph, dtype, PYTHON_NAMES._replace(exclude=options.exclude_option), params=params,
        arg_params=arg_params, aux_params=aux_params, exclude=options.exclude,
        fp32_ops=options.fp32_ops, lp_ops=options.lp_ops, ctx=ctx, lp_ops_only=options.lp_ops_only,
        fp32_conditions=options.fp32_conditions, cast_params=options.cast_params is not False,
        **checked)
    return ConversionResult(symbol, args, auxs, conversion)


def _declared_params(function: str, graph: LoadedGraph, params: Optional[Iterable[str]],
                     data_names: Optional[Iterable[str]], cast_params: Optional[bool]
                     ) -> Optional[List[str]]:
    """`convert_symbol`'s `params` from mxamp's `params` or contrib.amp's `data_names`.

    contrib.amp declares the variables outside `data_names` as parameters in
    the low precision only with ``cast_optional_params=True``; otherwise every
    variable stays an FP32 input, as mxamp's default without `params`.
    """
    if params is not None and data_names is not None:
        raise TypeError("%s() got both params and data_names (contrib.amp's: the variables "
                        "that are not parameters): pass one" % function)
    if params is not None and cast_params is False:
        raise ValueError('%s(): params declares parameters stored in low precision, '
                         'cast_optional_params=False keeps every variable an FP32 input: '
                         'pass one' % function)
    if data_names is None:
        return None if params is None else list(params)
    if isinstance(data_names, (str, bytes)):
        raise ValueError('data_names: expected a list of variable names, got the string %r' % data_names)
    data = list(data_names)
    check_variables(graph, data, 'data_names')
    if not cast_params:
        return None
    symbol = graph.symbol
    return [name for name in symbol.list_arguments() + symbol.list_auxiliary_states() if name not in data]


def _convert(sym: GraphLike, dtype: DTypeLike, names: Names, params: Optional[Iterable[str]] = None,
             arg_params: Optional[Dict[str, mx.nd.NDArray]] = None,
             aux_params: Optional[Dict[str, mx.nd.NDArray]] = None, allow_missing: bool = False,
             exclude: Optional[Iterable[str]] = None, fp32_ops: Optional[Iterable[str]] = None,
             lp_ops: Optional[Iterable[str]] = None, ctx: Optional[ContextLike] = None,
             input_types: Optional[Mapping[str, DTypeLike]] = None,
             input_shapes: Optional[Mapping[str, Sequence[int]]] = None, portable: bool = True,
             cpu_class: Optional[str] = None, for_inference: bool = False,
             lp_ops_only: Optional[Iterable[str]] = None, fp32_conditions: Iterable[Condition] = (),
             cast_params: bool = True
             ) -> Tuple[mx.sym.Symbol, Optional[Dict[str, mx.nd.NDArray]],
                        Optional[Dict[str, mx.nd.NDArray]], Optional[Conversion]]:
    """`convert_symbol` (no `arg_params`) and `convert_model`, with errors naming `names`.

    Returns ``(symbol, arg_params, aux_params, conversion)``; the parameters
    are None without `arg_params`, the conversion None for ``'float32'``.
    With `for_inference` the symbol (and parameters) are fused by
    `mxamp.inference.fuse_symbol`.  `cast_params` False keeps `arg_params` and
    `aux_params` in FP32 (contrib.amp's ``cast_optional_params=False``): the
    graph casts them.
    """
    graph = load_graph(sym)
    if arg_params is not None:
        aux_params = aux_params or {}
        params = list(arg_params) + list(aux_params)
    else:
        params = list(params or ())
        check_variables(graph, params, 'params')
    input_shapes = check_input_shapes(graph, input_shapes, params, names.input_shapes)
    check_variables(graph, input_types or (), 'input_types')
    check_exclude(graph, exclude, names.exclude)
    if arg_params is not None:
        assert aux_params is not None       # `aux_params or {}` above
        check_params(graph, arg_params, aux_params, input_shapes, allow_missing, names)
    dtype = dtypes.resolve_dtype(dtype, ctx)
    devices = [] if ctx is None else [c.device_type for c in _contexts(ctx)]
    if for_inference and ('gpu' in devices or (dtype == 'float16' and not devices)):
        raise ValueError("%s fuses with MXNet's oneDNN backend, for CPUs: a %s graph for a GPU "
                         "has nothing it can fuse%s"
                         % (names.for_inference, dtype,
                            ' (float16 for a CPU: %s)' % names.cpu if dtype == 'float16' else ''))
    originals = None
    if dtype == 'float32':
        symbol, conversion = graph.symbol, None
    else:
        policy = make_policy(dtype, exclude, fp32_ops, lp_ops, ctx, cpu_class=cpu_class,
                             lp_ops_only=lp_ops_only, fp32_conditions=fp32_conditions,
                             inference=for_inference)
        shapes = {}
        if arg_params is not None:
            assert aux_params is not None   # `aux_params or {}` above
            shapes = {name: value.shape for name, value in list(arg_params.items()) + list(aux_params.items())}
        shapes.update(input_shapes)
        # keep_batchnorm: Module's inference bind would fold BatchNorm with truncated values.
        # The inputs given shapes are the network's, not parameters (check_input_shapes).
        conversion = convert_graph(graph, policy, params=params if cast_params else (),
                                   input_types=input_types, shapes=shapes, portable=portable,
                                   data_inputs=set(input_shapes),
                                   keep_batchnorm=True)
        symbol = conversion.symbol
        if arg_params is not None:
            originals = dict(arg_params)
            arg_params, aux_params = _cast_params(arg_params, conversion), _cast_params(aux_params, conversion)
    if for_inference:
        # BatchNorm folds start from the FP32 values, so each folded value is rounded once.
        symbol, fused_args, fused_auxs = fuse_symbol(symbol, arg_params, aux_params, input_shapes,
                                                     names.input_shapes, originals)
        if arg_params is not None:
            arg_params, aux_params = fused_args, fused_auxs
    return symbol, arg_params, aux_params, conversion


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
    """`input_shapes` as ``{name: tuple}``, each name an argument of `graph` outside `params`.

    Raises ValueError naming option `what` and the graph's inputs otherwise, and
    when the graph cannot take the shapes (MXNet's shape inference rejects them:
    the error names the input and what MXNet says it expects).
    """
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
    """Raise ValueError (naming option `what`) for `exclude` entries that match no node of `graph`.

    Each entry is a node name or an ``fnmatch`` pattern, as `mxamp.policy.Policy`
    applies them to operator nodes; the message suggests a close node name.
    """
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

    In this order: a parameter that is not a variable of the graph (or is an
    argument given as an auxiliary state, or the reverse); parameters the graph
    has that are missing, unless `allow_missing` (variables named like
    parameters, `is_parameter_name`, outside `input_shapes`, and auxiliary
    states); a parameter whose shape the graph rejects, naming its shape, the
    shape the graph needs (``?`` for a dimension that depends on the input's
    size) and the node that reads it.  `names` spells the option that allows
    missing parameters.
    """
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
        # Every input's shape is known, none a probe's: MXNet can check the
        # parameters against each other too.
        try:
            symbol.infer_shape_partial(**dict({n: s for n, s in given.items() if n in arg_params},
                                              **input_shapes))
        except mx.base.MXNetError as err:
            raise ParameterError('parameter shapes do not fit the graph: %s' % error_line(err))


def _probe_shapes(symbol, inputs, input_shapes, what):
    """The graph's variable shapes inferred from input shapes alone, and whether any was probed.

    Returns ``(probes, probed)``: `probes` lists two ``{name: shape}``, one per
    set of input shapes: `input_shapes`, completed for the other `inputs` (those
    the graph does not shape from the inputs before them) by the first pair of
    `_PROBE_SHAPES` the graph accepts, one shape of the pair per set.  Raises
    ValueError naming option `what` when the graph rejects `input_shapes`.
    """
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
        # An input the graph cannot shape alone (a valid length) may take a probe
        # once the others have theirs: go round again after each success.
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
    """The shape all `shapes` agree on, None in a dimension where they differ or are unknown.

    None altogether when one of them is unknown or their ranks differ.
    """
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

    Both files are first written to temporary names in the target directory; the
    renames happen only after both writes succeeded.  The temporary files are
    created with ``open``, so the outputs get the permissions the user's umask
    gives any new file (``tempfile.mkstemp`` would make them 0600: unreadable by
    a serving container or another user).

    Raises
    ------
    GraphError
        When the output directory does not exist, an output path is a
        directory, or a file cannot be written; the message names the output,
        never a temporary file.
    """
    directory = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(directory):
        raise GraphError("output directory '%s' does not exist" % directory)
    outputs = [('%s-symbol.json' % prefix, lambda tmp: symbol.save(tmp, remove_amp_cast=False))]
    if arg_params is not None:
        saved = {'arg:%s' % k: v for k, v in arg_params.items()}
        saved.update({'aux:%s' % k: v for k, v in (aux_params or {}).items()})
        outputs.append(('%s-0000.params' % prefix, lambda tmp: mx.nd.save(tmp, saved)))
    # A directory in the way fails only at its rename, possibly after the other
    # output was renamed into place: refuse it before writing anything.
    for final, _ in outputs:
        if os.path.isdir(final):
            raise GraphError("output '%s' is a directory" % final)
    staged = []
    try:
        for final, write in outputs:
            temporary = os.path.join(directory, '.mxamp-%d-%s.tmp' % (os.getpid(), uuid.uuid4().hex))
            try:
                # Created here rather than by MXNet, whose error for an unwritable
                # directory names the temporary file and hides the reason.
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
