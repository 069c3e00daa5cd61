"""mxamp.dtypes: names, and the float32 <-> bfloat16 casts on every CPU class."""
import numpy as np
import pytest

import mxnet as mx

from mxamp import dtypes
from mxamp.dtypes import BFLOAT16, to_float32_numpy


def _nearest_even(values):
    """float32 -> bfloat16 -> float32 in numpy, round to nearest even (amp_cast's rounding)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def _values():
    rng = np.random.RandomState(0)
    normal = rng.normal(0, 3, 20000).astype(np.float32)
    # Exact ties (the dropped half is 0x8000) and values just around them.
    ties = (rng.randint(0x3F800000, 0x40800000, 200).astype(np.uint32) & ~np.uint32(0xFFFF)) \
        | np.uint32(0x8000)
    near = np.concatenate([ties - 1, ties + 1]).view(np.float32)
    special = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 3.0e38, -3.0e38, 1e-30], np.float32)
    return normal, ties.view(np.float32), near, special


def test_precision_name_is_a_name_or_none():
    assert [dtypes.precision_name(t) for t in (np.float32, 'fp16', BFLOAT16, np.float64, np.int32, None)] \
        == ['float32', 'float16', 'bfloat16', None, None, None]
    assert dtypes.name_of_array(mx.nd.zeros(1, dtype='int32')) is None
    assert dtypes.name_of_array(dtypes.cast(mx.nd.zeros(1), 'bfloat16')) == 'bfloat16'


def test_generic_narrowing_rounds_to_nearest_with_ties_away_from_zero():
    # MXNet's generic kernels, used where oneDNN's bfloat16 reorders are reference
    # loops ('avx2' CPUs); they run on any CPU, so the test does too.
    normal, ties, near, special = _values()
    for values in (normal, near, special):
        got = to_float32_numpy(dtypes._generic_cast(mx.nd.array(values), BFLOAT16))
        np.testing.assert_array_equal(got, _nearest_even(values))
    got = to_float32_numpy(dtypes._generic_cast(mx.nd.array(ties), BFLOAT16))
    step = np.spacing(np.abs(ties)) * 2.0 ** 16
    np.testing.assert_array_equal(np.abs(got), np.abs(ties) + step / 2)   # away from zero
    out = mx.nd.zeros(normal.shape, dtype=BFLOAT16)
    assert dtypes._generic_cast(mx.nd.array(normal), BFLOAT16, out=out) is out
    np.testing.assert_array_equal(to_float32_numpy(out), _nearest_even(normal))


def test_generic_widening_is_exact():
    normal, _, _, special = _values()
    low = mx.nd.amp_cast(mx.nd.array(np.concatenate([normal, special])), dtype=BFLOAT16)
    wide = dtypes._generic_cast(low, np.float32)
    assert wide.dtype == np.float32
    np.testing.assert_array_equal(wide.asnumpy(), to_float32_numpy(low))


@pytest.mark.parametrize('generic', [True, False])
def test_public_casts_agree_whichever_kernel_this_cpu_uses(monkeypatch, generic):
    monkeypatch.setattr(dtypes, '_reference_bfloat16_reorders', lambda: generic)
    normal = _values()[0].reshape(100, 200)
    x = mx.nd.array(normal)
    low = dtypes.amp_cast(x, BFLOAT16)
    assert low.dtype == BFLOAT16 and low.shape == x.shape
    np.testing.assert_array_equal(to_float32_numpy(low), _nearest_even(normal))
    np.testing.assert_array_equal(dtypes.widen(low).asnumpy(), to_float32_numpy(low))
    target = mx.nd.zeros(x.shape, dtype=BFLOAT16)
    assert dtypes.cast_into(x, target) is target
    np.testing.assert_array_equal(to_float32_numpy(target), _nearest_even(normal))
    # float16 never takes the bfloat16 route.
    np.testing.assert_array_equal(dtypes.amp_cast(x, np.float16).asnumpy(),
                                  normal.astype(np.float16))
