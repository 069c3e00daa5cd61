"""MXNet ``contrib.amp``'s conversion functions on mxamp: its names, parameters and defaults.

``from mxamp import contrib_amp as amp`` is the drop-in for ``amp.convert_symbol``,
``amp.convert_model``, ``amp.convert_hybrid_block`` and the ``amp.list_*`` functions
(docs/migrating-contrib-amp.rst).  This module alone knows contrib.amp's spellings: it
refuses what contrib.amp refuses, translates its keywords into mxamp's options (the
`mxamp.policy.Rules` ``lp_ops_only`` and ``fp32_conditions`` come only from here) and calls
the fronts' internal entries, `mxamp.symbol.convert_checked` and
`mxamp.gluon.convert_with_rules`.  Its defaults are contrib.amp's (``target_dtype='float16'``,
``cast_optional_params=False``), so a migrated call means what it meant; mxamp's own
functions default to ``dtype='auto'``.
"""
import typing
from collections import abc
from typing import Dict, Iterable, List, Optional, Tuple

import mxnet as mx

from .dtypes import DTypeLike, dtype_name, is_auto
from .gluon import convert_with_rules
from .graph import load_graph
from .policy import (Condition, Rules, canonical_conditions, canonical_ops, policy_lists,
                     refuse_failing_bfloat16_ops)
from .symbol import PYTHON_NAMES, SymbolOptions, check_variables, convert_checked

__all__ = ['convert_hybrid_block', 'convert_model', 'convert_symbol', 'list_conditional_fp32_ops',
           'list_fp32_ops', 'list_lp16_fp32_ops', 'list_lp16_ops', 'list_widest_type_cast']

# Errors about excluded nodes name the keyword as contrib.amp spells it.
_NAMES = PYTHON_NAMES._replace(exclude='excluded_sym_names')

# A conditional_fp32_ops entry as contrib.amp takes it: (operator, attribute, values).
ConditionLike = Tuple[str, str, Iterable[str]]


def convert_symbol(sym: mx.sym.Symbol, target_dtype: DTypeLike = 'float16',
                   target_dtype_ops: Optional[Iterable[str]] = None,
                   fp32_ops: Optional[Iterable[str]] = None,
                   conditional_fp32_ops: Optional[Iterable[ConditionLike]] = None,
                   excluded_sym_names: Optional[Iterable[str]] = None,
                   data_names: Optional[Iterable[str]] = None,
                   cast_optional_params: bool = False) -> mx.sym.Symbol:
    """contrib.amp's ``convert_symbol``: `mxamp.convert_symbol` with contrib.amp's keywords.

    Parameters
    ----------
    sym : mx.sym.Symbol
        The FP32 graph.
    target_dtype : str
        ``'float16'`` (contrib.amp's default), ``'bfloat16'``; also ``'auto'`` and
        ``'float32'`` (the graph unchanged), as mxamp's ``dtype``.
    target_dtype_ops : list of str, optional
        These operators, and no others, run in the target dtype (mxamp's default list
        otherwise); those of the default list not named run in FP32.
    fp32_ops : list of str, optional
        Operators forced to FP32, added to mxamp's FP32 list (contrib.amp's replaced its).
    conditional_fp32_ops : list of (str, str, list of str), optional
        ``(operator, attribute, values)``: such a node runs in FP32; added to mxamp's own.
    excluded_sym_names : list of str, optional
        Nodes kept in FP32 (mxamp's ``exclude``: also ``fnmatch`` patterns); each must match.
    data_names : list of str, optional
        The variables that are data; with ``cast_optional_params=True`` the others are
        parameters, declared in the target dtype where only low-precision ops read them
        (mxamp's ``params``).  Otherwise every variable is an FP32 input.
    cast_optional_params : bool
        See `data_names`.

    Returns
    -------
    mx.sym.Symbol

    Raises
    ------
    ValueError
        An unknown dtype or operator, a malformed entry, a name that matches nothing, an
        operator both in `target_dtype_ops` and in `fp32_ops` or `conditional_fp32_ops`.
    TypeError
        `cast_optional_params` not a bool.

    Examples
    --------
    >>> from mxamp import contrib_amp as amp
    >>> fc = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=10, name='fc')
    >>> converted = amp.convert_symbol(fc, target_dtype='bfloat16', data_names=['data'],
    ...                                cast_optional_params=True)
    >>> converted.infer_type(data='float32')[0]        # data, fc_weight, fc_bias
    [<class 'numpy.float32'>, dtype([('bfloat16', '<u2')]), dtype([('bfloat16', '<u2')])]
    """
    dtype, rules = _translated('convert_symbol', target_dtype, target_dtype_ops, fp32_ops,
                               conditional_fp32_ops, excluded_sym_names, cast_optional_params)
    graph = load_graph(sym)
    options = SymbolOptions(dtype, rules, params=_declared_params(graph, data_names,
                                                                  cast_optional_params))
    return convert_checked(graph, options, _NAMES).symbol


def convert_model(sym: mx.sym.Symbol, arg_params: Dict[str, mx.nd.NDArray],
                  aux_params: Dict[str, mx.nd.NDArray], target_dtype: DTypeLike = 'float16',
                  target_dtype_ops: Optional[Iterable[str]] = None,
                  fp32_ops: Optional[Iterable[str]] = None,
                  conditional_fp32_ops: Optional[Iterable[ConditionLike]] = None,
                  excluded_sym_names: Optional[Iterable[str]] = None,
                  cast_optional_params: bool = False
                  ) -> Tuple[mx.sym.Symbol, Dict[str, mx.nd.NDArray], Dict[str, mx.nd.NDArray]]:
    """contrib.amp's ``convert_model``: `mxamp.convert_model` with contrib.amp's keywords.

    The keywords are `convert_symbol`'s.  ``cast_optional_params=False`` (contrib.amp's
    default) keeps every parameter FP32, cast in the graph at every run; True stores those
    only low-precision operators read in the target dtype, as `mxamp.convert_model` does.
    The dicts given are left as they are; the parameters are checked against the graph first.

    Returns
    -------
    (mx.sym.Symbol, dict, dict)
        The converted graph, its arg_params and aux_params.

    Examples
    --------
    >>> from mxamp import contrib_amp as amp
    >>> fc = mx.sym.FullyConnected(mx.sym.var('data'), num_hidden=10, name='fc')
    >>> args = {'fc_weight': mx.nd.ones((10, 4)), 'fc_bias': mx.nd.zeros((10,))}
    >>> sym16, args16, auxs16 = amp.convert_model(fc, args, {}, cast_optional_params=True)
    >>> args16['fc_weight'].dtype
    <class 'numpy.float16'>
    """
    dtype, rules = _translated('convert_model', target_dtype, target_dtype_ops, fp32_ops,
                               conditional_fp32_ops, excluded_sym_names, cast_optional_params)
    symbol, args, auxs, _ = convert_checked(
        sym, SymbolOptions(dtype, rules, cast_params=cast_optional_params), _NAMES,
        arg_params=arg_params, aux_params=aux_params or {})
    # Given arg_params, convert_checked returns both parameter dicts.
    return (symbol, typing.cast(Dict[str, mx.nd.NDArray], args),
            typing.cast(Dict[str, mx.nd.NDArray], auxs))


def convert_hybrid_block(block: mx.gluon.HybridBlock, target_dtype: DTypeLike = 'float16',
                         target_dtype_ops: Optional[Iterable[str]] = None,
                         fp32_ops: Optional[Iterable[str]] = None,
                         conditional_fp32_ops: Optional[Iterable[ConditionLike]] = None,
                         excluded_sym_names: Optional[Iterable[str]] = None,
                         ctx: Optional[mx.Context] = None,
                         cast_optional_params: bool = False) -> mx.gluon.HybridBlock:
    """contrib.amp's ``convert_hybrid_block``: `mxamp.convert` with contrib.amp's keywords.

    Converts `block` in place and returns it (contrib.amp returned a new ``SymbolBlock``):
    it stays trainable, with its children and parameter names.  The keywords are
    `convert_symbol`'s, but `excluded_sym_names` also takes what `mxamp.convert`'s
    ``exclude`` takes by name (block names, prefixes, child paths).  `ctx`: where the
    parameters live once converted; contrib.amp's default, ``mx.gpu(0)``, cannot run on a
    machine without a GPU, so here None keeps them where they are.  `cast_optional_params`
    only chose where contrib.amp cast the parameters, to the same values: either value is
    taken, and the parameters only low-precision operators read are stored in the target
    dtype, as `mxamp.convert` stores them.

    Returns
    -------
    mxnet.gluon.HybridBlock
        `block`, converted.

    Examples
    --------
    >>> from mxamp import contrib_amp as amp
    >>> net = mx.gluon.nn.Dense(10, in_units=4)
    >>> net.initialize()
    >>> net = amp.convert_hybrid_block(net, target_dtype='bfloat16')
    >>> mxamp.dtypes.name_of_array(net.weight.data())
    'bfloat16'
    """
    dtype, rules = _translated('convert_hybrid_block', target_dtype, target_dtype_ops, fp32_ops,
                               conditional_fp32_ops, excluded_sym_names, cast_optional_params)
    exclude = None if excluded_sym_names is None else list(rules.exclude)
    return convert_with_rules(block, dtype, rules._replace(exclude=()), exclude=exclude, ctx=ctx,
                              exclude_option='excluded_sym_names')


def list_lp16_ops(target_dtype: DTypeLike) -> List[str]:
    """The operators mxamp runs in `target_dtype` on this machine's CPU class
    (`mxamp.policy_lists`' ``low``).

    >>> 'Convolution' in list_lp16_ops('float16')
    True
    """
    return list(policy_lists(target_dtype).low)


def list_fp32_ops(target_dtype: DTypeLike) -> List[str]:
    """The operators mxamp runs in FP32 under `target_dtype` (`mxamp.policy_lists`' ``float32``;
    the losses of contrib.amp's ``list_loss_output_functions`` among them).

    >>> 'softmax' in list_fp32_ops('float16')
    True
    """
    return list(policy_lists(target_dtype).float32)


def list_lp16_fp32_ops(target_dtype: DTypeLike) -> List[str]:
    """The operators that run in their input's precision (`mxamp.policy_lists`' ``neutral``).

    >>> 'Flatten' in list_lp16_fp32_ops('float16')
    True
    """
    return list(policy_lists(target_dtype).neutral)


def list_conditional_fp32_ops(target_dtype: DTypeLike) -> List[Tuple[str, str, List[str]]]:
    """``(operator, attribute, values)``: such a node runs in FP32 under `target_dtype`
    (`mxamp.policy_lists`' ``conditional``), in the form ``conditional_fp32_ops`` takes.

    >>> ('Activation', 'act_type', ['softrelu']) in list_conditional_fp32_ops('float16')
    True
    """
    return [(op, attribute, list(values))
            for op, attribute, values in policy_lists(target_dtype).conditional]


def list_widest_type_cast(target_dtype: DTypeLike) -> List[str]:
    """The operators whose inputs must agree, run in the widest one's precision
    (`mxamp.policy_lists`' ``widest``).

    >>> 'Concat' in list_widest_type_cast('float16')
    True
    """
    return list(policy_lists(target_dtype).widest)


def _translated(function: str, target_dtype: DTypeLike, target_dtype_ops: Optional[Iterable[str]],
                fp32_ops: Optional[Iterable[str]],
                conditional_fp32_ops: Optional[Iterable[ConditionLike]],
                excluded_sym_names: Optional[Iterable[str]], cast_optional_params: bool
                ) -> Tuple[DTypeLike, Rules]:
    """``(dtype, rules)`` for contrib.amp's keywords, checked as contrib.amp checks them;
    errors name the keyword and, where contrib.amp's meaning is at stake, `function`."""
    _check_target_dtype(function, target_dtype)
    fp32 = tuple(canonical_ops(fp32_ops or (), 'fp32_ops'))
    only = None if target_dtype_ops is None else tuple(canonical_ops(target_dtype_ops, 'target_dtype_ops'))
    conditions: Tuple[Condition, ...] = canonical_conditions(conditional_fp32_ops or (),
                                                             'conditional_fp32_ops')
    for other, other_name in ((fp32, 'fp32_ops'),
                              (tuple(op for op, _, _ in conditions), 'conditional_fp32_ops')):
        both = sorted(set(only or ()) & set(other))
        if both:
            raise ValueError('%s(): %s in both target_dtype_ops and %s (contrib.amp refuses that too)'
                             % (function, ', '.join(both), other_name))
    if only and not is_auto(target_dtype) and dtype_name(target_dtype) == 'bfloat16':
        refuse_failing_bfloat16_ops(frozenset(only), 'target_dtype_ops')
    exclude: Tuple[str, ...] = ()
    if excluded_sym_names is not None:
        names = (tuple(excluded_sym_names) if isinstance(excluded_sym_names, abc.Iterable)
                 and not isinstance(excluded_sym_names, (str, bytes)) else None)
        if names is None or not all(isinstance(name, str) for name in names):
            raise ValueError('excluded_sym_names: expected a list of node names, got %r'
                             % (excluded_sym_names,))
        exclude = names
    if not isinstance(cast_optional_params, bool):
        raise TypeError('%s(): cast_optional_params=%r: expected True or False'
                        % (function, cast_optional_params))
    return target_dtype, Rules.of(fp32_ops=fp32, exclude=exclude, lp_ops_only=only,
                                  fp32_conditions=conditions)


def _check_target_dtype(function, target_dtype):
    if is_auto(target_dtype):
        return
    try:
        dtype_name(target_dtype)
    except ValueError:
        raise ValueError("%s(): target_dtype=%r: expected 'float16', 'bfloat16', 'float32' or 'auto'"
                         % (function, target_dtype))


def _declared_params(graph, data_names, cast_optional_params):
    """mxamp's ``params`` for contrib.amp's `data_names`: the other variables of `graph`, with
    ``cast_optional_params=True``; else none (every variable an FP32 input)."""
    if data_names is None:
        return None
    if isinstance(data_names, (str, bytes)):
        raise ValueError('data_names: expected a list of variable names, got the string %r' % data_names)
    data = list(data_names)
    check_variables(graph, data, 'data_names')
    if not cast_optional_params:
        return None
    symbol = graph.symbol
    return [name for name in symbol.list_arguments() + symbol.list_auxiliary_states() if name not in data]
