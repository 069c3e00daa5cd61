"""contrib.amp's keywords as mxamp's options, for both fronts (docs/migrating-contrib-amp.rst).

Every front hands what it was given, in either spelling, to `from_contrib_amp`.
"""
from collections import abc
from typing import Any, Iterable, NamedTuple, Optional, Tuple

from .dtypes import DTypeLike, dtype_name
from .policy import Condition, canonical_conditions, canonical_ops

__all__ = ['CONTRIB_AMP_KEYWORDS', 'Options', 'from_contrib_amp']

#: contrib.amp's keywords that `from_contrib_amp` translates.
CONTRIB_AMP_KEYWORDS = ('target_dtype', 'target_dtype_ops', 'conditional_fp32_ops',
                        'excluded_sym_names', 'cast_optional_params')


class Options(NamedTuple):
    """A conversion's options in mxamp's spelling, made by `from_contrib_amp`.

    None: not given, the front's default applies.  ``exclude_option`` names ``exclude`` in errors."""
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

    Parameters
    ----------
    function : str
        The caller's public name, for messages.  The other keywords are as the
        caller gave them, None when left out.

    Returns
    -------
    Options

    Raises
    ------
    TypeError
        A keyword given in both spellings; a `cast_optional_params` not a bool.
    ValueError
        An unknown dtype or operator, a malformed entry, an operator in both
        `target_dtype_ops` and `fp32_ops`; each message names the keyword given.
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
