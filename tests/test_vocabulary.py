"""One vocabulary across the fronts: the Symbol front takes its options by keyword
after `dtype`, and its dtype defaults to 'auto', as `mxamp.convert` does.
"""
import inspect
import warnings

import pytest

import mxamp
from mxamp.dtypes import name_of_array

from test_graph import params_of, small_cnn


def _same(first, second):
    return first.tojson() == second.tojson()


def test_options_after_dtype_are_keywords_only():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    with pytest.raises(TypeError, match='positional arguments but 4 were given'):
        mxamp.convert_symbol(symbol, 'bfloat16', None, ['conv0'])
    with pytest.raises(TypeError, match='positional arguments but 5 were given'):
        mxamp.convert_model(symbol, args, auxs, 'bfloat16', ['conv0'])
    with pytest.raises(TypeError, match='positional arguments but 3 were given'):
        mxamp.convert_with_record(symbol, 'bfloat16', ['conv0'])


def test_the_default_dtype_is_auto():
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')     # 'auto' may stay float32 here: said once per process
        assert _same(mxamp.convert_symbol(symbol), mxamp.convert_symbol(symbol, 'auto'))
        by_default = mxamp.convert_model(symbol, args, auxs)
        auto = mxamp.convert_model(symbol, args, auxs, 'auto')
    assert _same(by_default[0], auto[0])
    for got, expected in zip(by_default[1:], auto[1:]):
        assert {k: name_of_array(v) for k, v in got.items()} == \
            {k: name_of_array(v) for k, v in expected.items()}


def test_every_entry_point_takes_the_same_options_by_the_same_names():
    keyword_only = {}
    for function in (mxamp.convert, mxamp.convert_symbol, mxamp.convert_model):
        parameters = inspect.signature(function).parameters.values()
        keyword_only[function.__name__] = {p.name for p in parameters
                                           if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert 'dtype' in inspect.signature(function).parameters
    shared = {'exclude', 'fp32_ops', 'lp_ops'}
    assert all(shared <= names for names in keyword_only.values()), keyword_only
