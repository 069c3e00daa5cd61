"""The spellings of other mixed-precision libraries, translated to mxamp's.

mxamp's users mostly come from MXNet's own ``mxnet.contrib.amp`` (1.9.1), whose
conversion calls (``convert_symbol``, ``convert_model``,
``convert_hybrid_block``) take ``target_dtype``, ``target_dtype_ops``,
``fp32_ops``, ``conditional_fp32_ops``, ``excluded_sym_names``,
``cast_optional_params`` and, for ``convert_hybrid_block``, ``ctx``.  Every
mxamp front takes them by keyword with contrib.amp's meaning: it hands what
the caller gave, in both spellings, to `from_contrib_amp`, which checks them
and returns mxamp's options (`Options`).  A keyword given in both spellings
(``dtype=`` and ``target_dtype=``) is a TypeError.

Keyword by keyword (contrib.amp -> mxamp):

``target_dtype``
    ``dtype``: the same names (``'float16'``, ``'bfloat16'``; mxamp also takes
    ``'auto'`` and the aliases ``'fp16'``, ``'bf16'``...).  contrib.amp's
    default is ``'float16'``; mxamp's is not: every front defaults to
    ``'auto'`` (the fastest precision the machine computes).  Pass
    ``target_dtype='float16'`` to keep a contrib.amp call's result.
``target_dtype_ops``
    The policy's ``lp_ops_only``: the list of operators run in low precision,
    replaced, as in contrib.amp.  Operators mxamp runs in low precision by
    default (`mxamp.policy.default_lp_ops`) that are not named run in FP32
    (contrib.amp let them follow their input, which fails MXNet's type
    inference where such a FullyConnected reads a low-precision tensor with
    FP32 weights); named operators outside them are forced to low precision,
    as ``lp_ops`` forces them.
``fp32_ops``
    ``fp32_ops``, with one difference: contrib.amp's list replaced its default
    FP32 list, mxamp's adds to it.  Numerically sensitive operators (softmax,
    normalisation, reductions, exp/log) stay FP32 unless named in ``lp_ops``.
    An operator in both ``target_dtype_ops`` and ``fp32_ops`` is refused, as
    contrib.amp refuses it.
``conditional_fp32_ops``
    The policy's ``fp32_conditions``, the same ``(operator, attribute,
    values)`` triples (``[('Activation', 'act_type', ['softrelu'])]``): a node
    whose attribute has one of the values runs in FP32.  contrib.amp's list
    replaced its default conditions; mxamp's conditions (Activation softrelu,
    LeakyReLU elu/selu/gelu, sum/Lp Pooling) stay and these are added.
``excluded_sym_names``
    ``exclude``: node names kept entirely in FP32.  mxamp also takes
    ``fnmatch`` patterns, and refuses a name that matches no node (contrib.amp
    ignored it); the error names ``excluded_sym_names``.
``cast_optional_params``
    `Options.cast_params`: True stores the parameters that only
    low-precision operators read in the low precision (mxamp's
    ``convert_model`` does so by default: contrib.amp's default, False, kept
    every parameter in FP32 and cast it in the graph).
``ctx``
    Passed on unchanged (`Options.ctx`): where ``convert_hybrid_block`` put
    the converted block's parameters (contrib.amp's default ``mx.gpu(0)``).

``data_names`` (``convert_symbol`` only) is the Symbol front's: the variables
that are not its ``params``.  ``mxamp.policy_lists`` answers contrib.amp's
``list_lp16_ops``, ``list_fp32_ops``, ``list_widest_type_cast``,
``list_lp16_fp32_ops`` and ``list_conditional_fp32_ops``.
"""
from collections import abc
from typing import Any, Iterable, NamedTuple, Optional, Tuple

from .dtypes import DTypeLike, dtype_name
from .policy import Condition, canonical_conditions, canonical_ops

__all__ = ['CONTRIB_AMP_KEYWORDS', 'Options', 'from_contrib_amp']

#: contrib.amp's keywords that `from_contrib_amp` translates (``ctx`` is
#: mxamp's own spelling too, and ``fp32_ops`` is shared).
CONTRIB_AMP_KEYWORDS = ('target_dtype', 'target_dtype_ops', 'conditional_fp32_ops',
                        'excluded_sym_names', 'cast_optional_params')


class Options(NamedTuple):
    """A conversion's options in mxamp's spelling, made by `from_contrib_amp`.

    Attributes
    ----------
    dtype : str, numpy dtype or None
        The target precision as given (``dtype`` or ``target_dtype``); None when
        neither was: the front's default applies.
    fp32_ops, lp_ops : tuple of str
        Canonical operator names forced to FP32 / to low precision
        (`mxamp.policy.Policy`'s ``fp32_ops``, ``lp_ops``).
    lp_ops_only : tuple of str or None
        `mxamp.policy.Policy`'s ``lp_ops_only`` (from ``target_dtype_ops``);
        None: the policy's own list.
    fp32_conditions : tuple of (str, str, tuple of str)
        `mxamp.policy.Policy`'s ``fp32_conditions`` (from ``conditional_fp32_ops``).
    exclude : any
        ``exclude`` as given, or ``excluded_sym_names`` as a tuple; None for neither.
    exclude_option : str
        How errors name `exclude`: ``'exclude'`` or ``'excluded_sym_names'``,
        whichever the caller wrote.
    cast_params : bool or None
        ``cast_optional_params``: whether parameters that only low-precision
        operators read are stored in the low precision; None when not given
        (the front's default).  A front that cannot honour a value raises.
    ctx : any
        ``ctx`` as given.
    """
    dtype: Optional[DTypeLike]
    fp32_ops: Tuple[str, ...]
    lp_ops: Tuple[str, ...]
    lp_ops_only: Optional[Tuple[str, ...]]
    fp32_conditions: Tuple[Condition, ...]
    exclude: Any
    exclude_option: str
    cast_params: Optional[bool]
    ctx: Any


def from_contrib_amp(function: str, dtype: Optional[DTypeLike] = None, *,
                     fp32_ops: Optional[Iterable[str]] = None,
                     lp_ops: Optional[Iterable[str]] = None, exclude: Any = None,
                     target_dtype: Optional[DTypeLike] = None,
                     target_dtype_ops: Optional[Iterable[str]] = None,
                     conditional_fp32_ops: Optional[Iterable[Tuple[str, str, Iterable[str]]]] = None,
                     excluded_sym_names: Optional[Iterable[str]] = None,
                     cast_optional_params: Optional[bool] = None, ctx: Any = None) -> Options:
    """A front's options, given in mxamp's or contrib.amp's spelling, in mxamp's.

    The module documentation says what each contrib.amp keyword becomes.  A
    front passes everything its caller gave, None for what was left out.

    Parameters
    ----------
    function : str
        The caller's public name, for error messages (``'convert_model'``).
    dtype, fp32_ops, lp_ops, exclude
        mxamp's spellings, as the caller gave them (`exclude` is not looked
        into: the fronts take different things there).
    target_dtype, target_dtype_ops, conditional_fp32_ops, excluded_sym_names, cast_optional_params, ctx
        contrib.amp's spellings, with contrib.amp's meaning.

    Returns
    -------
    Options

    Raises
    ------
    TypeError
        A keyword given in both spellings (``dtype`` and ``target_dtype``,
        ``exclude`` and ``excluded_sym_names``), a `cast_optional_params`
        that is not a bool.
    ValueError
        An unknown `target_dtype` or operator, a malformed
        `conditional_fp32_ops` entry (`mxamp.policy.canonical_conditions`),
        `excluded_sym_names` that is not a list of names, an operator in both
        `target_dtype_ops` and `fp32_ops` (or `conditional_fp32_ops`).  Each
        message names the keyword as the caller wrote it.

    Examples
    --------
    >>> options = from_contrib_amp('convert_model', target_dtype='float16',
    ...                            target_dtype_ops=['Convolution'],
    ...                            excluded_sym_names=['conv0'])
    >>> options.dtype, options.lp_ops_only, options.exclude
    ('float16', ('Convolution',), ('conv0',))
    """
    _one_spelling(function, 'dtype', dtype, 'target_dtype', target_dtype)
    _one_spelling(function, 'exclude', exclude, 'excluded_sym_names', excluded_sym_names)
    if target_dtype is not None:
        _check_target_dtype(function, target_dtype)
        dtype = target_dtype
    fp32 = tuple(canonical_ops(fp32_ops or (), 'fp32_ops'))
    only = None if target_dtype_ops is None else tuple(canonical_ops(target_dtype_ops, 'target_dtype_ops'))
    conditions = canonical_conditions(conditional_fp32_ops or (), 'conditional_fp32_ops')
    for other, other_name in ((fp32, 'fp32_ops'),
                              (tuple(op for op, _, _ in conditions), 'conditional_fp32_ops')):
        both = sorted(set(only or ()) & set(other))
        if both:
            raise ValueError('%s(): %s in both target_dtype_ops and %s (contrib.amp refuses that too)'
                             % (function, ', '.join(both), other_name))
    exclude_option = 'exclude'
    if excluded_sym_names is not None:
        names = (tuple(excluded_sym_names) if isinstance(excluded_sym_names, abc.Iterable)
                 and not isinstance(excluded_sym_names, (str, bytes)) else None)
        if names is None or not all(isinstance(name, str) for name in names):
            raise ValueError('excluded_sym_names: expected a list of node names, got %r'
                             % (excluded_sym_names,))
        exclude, exclude_option = names, 'excluded_sym_names'
    if cast_optional_params is not None and not isinstance(cast_optional_params, bool):
        raise TypeError('%s(): cast_optional_params=%r: expected True or False'
                        % (function, cast_optional_params))
    return Options(dtype, fp32, tuple(canonical_ops(lp_ops or (), 'lp_ops')), only, conditions,
                   exclude, exclude_option, cast_optional_params, ctx)


def _one_spelling(function, mxamp_name, mxamp_value, contrib_name, contrib_value):
    if mxamp_value is not None and contrib_value is not None:
        raise TypeError('%s() got both %s and %s, two spellings of one option (%s is '
                        "contrib.amp's): pass one" % (function, mxamp_name, contrib_name, contrib_name))


def _check_target_dtype(function, target_dtype):
    if isinstance(target_dtype, str) and target_dtype.lower() == 'auto':
        return
    try:
        dtype_name(target_dtype)
    except ValueError:
        raise ValueError("%s(): target_dtype=%r: expected 'float16', 'bfloat16', 'float32' or 'auto'"
                         % (function, target_dtype))
