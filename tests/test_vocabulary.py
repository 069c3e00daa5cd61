"""One vocabulary across the fronts: the Symbol front takes its options by keyword
after `dtype`, as `mxamp.convert` does, and its dtype default moves to 'auto'.

mxamp 0.1.0's spellings (options by position, in two different orders, and the
'bfloat16' default) keep working for one release, each with a warning that
says what to write instead.
"""
import warnings

import mxnet as mx
import pytest

import mxamp
from mxamp.dtypes import name_of_array

from test_graph import params_of, small_cnn


def _same(first, second):
    return first.tojson() == second.tojson()


def test_options_are_keywords_and_the_old_positions_still_work():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    new = mxamp.convert_symbol(symbol, 'bfloat16', exclude=['conv0'])
    with pytest.warns(DeprecationWarning, match=r"convert_symbol\(\): options by position are "
                                                r"deprecated; name them \(params=\.\.\., "
                                                r"exclude=\.\.\.\)"):
        old = mxamp.convert_symbol(symbol, 'bfloat16', None, ['conv0'])
    assert _same(new, old)
    new_model = mxamp.convert_model(symbol, args, auxs, 'bfloat16', exclude=['conv0'])
    with pytest.warns(DeprecationWarning, match=r'convert_model\(\).*\(exclude=\.\.\.\)'):
        old_model = mxamp.convert_model(symbol, args, auxs, 'bfloat16', ['conv0'])
    assert _same(new_model[0], old_model[0])
    assert sorted(new_model[1]) == sorted(old_model[1])


def test_an_option_given_twice_is_refused():
    with pytest.raises(TypeError, match="got multiple values for argument 'exclude'"):
        mxamp.convert_symbol(small_cnn(), 'bfloat16', None, ['conv0'], exclude=['conv0'])
    with pytest.raises(TypeError, match='takes at most 2 positional arguments'):
        mxamp.convert_symbol(small_cnn(), 'bfloat16', *([None] * 11))


def test_the_default_dtype_says_it_moves_to_auto():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    with pytest.warns(FutureWarning, match="convert_symbol\\(\\): the default dtype becomes "
                                           "'auto'.*pass dtype='bfloat16'"):
        by_default = mxamp.convert_symbol(symbol)
    assert _same(by_default, mxamp.convert_symbol(symbol, 'bfloat16'))
    with pytest.warns(FutureWarning, match="convert_model\\(\\): the default dtype"):
        _, c_args, _ = mxamp.convert_model(symbol, args, auxs)
    assert 'bfloat16' in {name_of_array(v) for v in c_args.values()}
    with warnings.catch_warnings():
        warnings.simplefilter('error', FutureWarning)     # an explicit dtype: no warning
        mxamp.convert_symbol(symbol, 'auto', ctx=mx.cpu())
        mxamp.convert_model(symbol, args, auxs, dtype='auto', ctx=mx.cpu())


def test_every_entry_point_takes_the_same_options_by_the_same_names():
    import inspect
    keyword_only = {}
    for function in (mxamp.convert, mxamp.convert_symbol, mxamp.convert_model):
        parameters = inspect.signature(function).parameters.values()
        keyword_only[function.__name__] = {p.name for p in parameters
                                           if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert 'dtype' in inspect.signature(function).parameters
    shared = {'exclude', 'fp32_ops', 'lp_ops'}
    assert all(shared <= names for names in keyword_only.values()), keyword_only
