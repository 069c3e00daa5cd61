"""mxamp.dtypes: names, the float32 <-> bfloat16 casts on every CPU class, and
bfloat16 data in numpy (ml_dtypes.bfloat16), checked against ml-dtypes and MXNet's own casts."""
import ml_dtypes
import numpy as np
import pytest

import mxnet as mx

from mxamp import dtypes
from mxamp.dtypes import BFLOAT16, NUMPY_BFLOAT16, to_float32_numpy


def _nearest_even(values):
    """float32 -> bfloat16 -> float32 by ml-dtypes: round to nearest even (amp_cast's rounding)."""
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


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
    # What NDArray.dtype returns (numpy scalar types, MXNet's bfloat16 dtype) is looked up as is.
    assert [dtypes.name_of_array(mx.nd.zeros(1, dtype=t)) for t in ('float32', 'float16', 'float64',
                                                                    'uint8')] \
        == ['float32', 'float16', None, None]
    assert [dtypes.precision_name(t) for t in (np.dtype('float32'), np.dtype('float16'), [1])] \
        == ['float32', 'float16', None]


def test_generic_narrowing_rounds_to_nearest_even():
    # MXNet's generic kernels, used where oneDNN's bfloat16 reorders are reference
    # loops ('avx2' CPUs), through the rounded narrowing the graph rewrite inserts
    # (dtypes.bfloat16_rounding_nodes); they run on any CPU, so the test does too.
    normal, ties, near, special = _values()
    rng = np.random.RandomState(1)
    wide = (np.exp(rng.uniform(-76, 88, 20000)) * rng.choice([-1, 1], 20000)).astype(np.float32)
    subnormal = rng.randint(1, 0x00800000, 2000).astype(np.uint32).view(np.float32)
    for values in (normal, ties, near, special, wide, subnormal):
        got = to_float32_numpy(dtypes._generic_cast(mx.nd.array(values), BFLOAT16))
        np.testing.assert_array_equal(got, _nearest_even(values))
    # Where the split's scaled operand is subnormal (normal values below 2**-110): at
    # most one step from the nearest.
    tiny = (np.exp(rng.uniform(-87, -77, 20000)) * rng.choice([-1, 1], 20000)).astype(np.float32)
    got = to_float32_numpy(dtypes._generic_cast(mx.nd.array(tiny), BFLOAT16))
    steps = np.abs(got.view(np.int32).astype(np.int64) - _nearest_even(tiny).view(np.int32)) >> 16
    assert steps.max() <= 1
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


# ---------------------------------------------------------------------------------
# bfloat16 in numpy: ml_dtypes.bfloat16, and every bit pattern against ml-dtypes and MXNet
# ---------------------------------------------------------------------------------
def _every_bfloat16():
    """All 65,536 bfloat16 bit patterns: zeros, subnormals, normals, infinities, NaNs."""
    return np.arange(2 ** 16, dtype=np.uint16).view(ml_dtypes.bfloat16)


def _subnormals():
    rng = np.random.RandomState(1)
    magnitudes = rng.randint(1, 0x800000, 2000).astype(np.uint32)
    # Ties (the dropped half is 0x8000) among them, both parities of the kept bits.
    magnitudes[:200] = (magnitudes[:200] & ~np.uint32(0xFFFF)) | np.uint32(0x8000)
    return np.concatenate([magnitudes, magnitudes | np.uint32(0x80000000)]).view(np.float32)


def _bits(values):
    return np.asarray(values).view(np.uint16).astype(np.int64)


def _mxamp_bits(values):
    """float32 values narrowed by mxamp's public cast, as uint16 bit patterns."""
    return _bits(dtypes.to_numpy(dtypes.cast(mx.nd.array(values), 'bfloat16')))


def _mxnet_truncated_bits(values):
    """MXNet's own ``Cast`` to bfloat16, which truncates toward zero.  (Its front end reads
    dtype='bfloat16' through numpy, which knows the name once ml_dtypes is imported.)"""
    return _bits(mx.nd.cast(mx.nd.array(values), dtype='bfloat16').asnumpy())


def _ml_dtypes_bits(values):
    return _bits(np.asarray(values, np.float32).astype(ml_dtypes.bfloat16))


def test_to_numpy_hands_out_numpys_bfloat16_with_mxnets_bits():
    patterns = _every_bfloat16()
    x = dtypes.from_numpy(patterns)
    assert x.dtype == BFLOAT16 and x.shape == patterns.shape
    np.testing.assert_array_equal(x.asnumpy().view(np.uint16), patterns.view(np.uint16))
    out = dtypes.to_numpy(x)
    assert out.dtype == NUMPY_BFLOAT16 == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out.view(np.uint16), patterns.view(np.uint16))
    # Shapes, and a value computed with, as numpy's own dtype.
    low = dtypes.cast(mx.nd.array([[1.0, -2.5], [0.15625, 3.0]]), 'bfloat16')
    grid = dtypes.to_numpy(low)
    assert grid.shape == (2, 2) and grid.dtype == NUMPY_BFLOAT16
    assert grid.sum(dtype=np.float32) == np.float32(1.65625)
    scalar = dtypes.to_numpy(low[0, 1].reshape(()))
    assert scalar.shape == () and scalar.dtype == NUMPY_BFLOAT16 and float(scalar) == -2.5


@pytest.mark.parametrize('dtype', [np.float32, np.float16, np.int32])
def test_to_numpy_and_from_numpy_leave_other_dtypes_as_mxnet_has_them(dtype):
    values = np.arange(6).reshape(2, 3).astype(dtype)
    x = dtypes.from_numpy(values, ctx=mx.cpu(0))
    assert x.dtype == dtype and x.context == mx.cpu(0)
    got = dtypes.to_numpy(x)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, values)


def test_from_numpy_refuses_what_is_not_a_numpy_array():
    with pytest.raises(TypeError,
                       match=r'^from_numpy\(\): values must be a numpy array, got list$'):
        dtypes.from_numpy([1.0, 2.0])


def test_numpys_bfloat16_names_the_bfloat16_precision():
    for spelling in (ml_dtypes.bfloat16, NUMPY_BFLOAT16, BFLOAT16, 'bfloat16', 'bf16'):
        assert dtypes.dtype_name(spelling) == 'bfloat16'
    assert dtypes.precision_name(ml_dtypes.float8_e4m3fn) is None
    # MXNet's own dtype stays what mxamp gives MXNet.
    assert dtypes.numpy_dtype(ml_dtypes.bfloat16) == BFLOAT16
    assert dtypes.cast(mx.nd.ones(3), ml_dtypes.bfloat16).dtype == BFLOAT16


def test_widening_is_exact_for_every_bit_pattern():
    """Infinities stay infinite, NaNs stay NaN (payloads kept), subnormals exact:
    what ml-dtypes and MXNet's own Cast to float32 give, bit for bit."""
    patterns = _every_bfloat16()
    x = dtypes.from_numpy(patterns)
    got = to_float32_numpy(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), patterns.astype(np.float32).view(np.uint32))
    np.testing.assert_array_equal(got.view(np.uint32),
                                  mx.nd.cast(x, dtype='float32').asnumpy().view(np.uint32))
    assert np.isnan(got).sum() == np.isnan(patterns.astype(np.float32)).sum() == 2 * (2 ** 7 - 1)
    assert np.isinf(got).sum() == 2


@pytest.mark.parametrize('generic', [False, True])
def test_narrowing_is_mxnets_truncation_or_one_step_up_to_the_nearest(monkeypatch, generic):
    """Finite float32 values: mxamp's cast gives MXNet's truncated bits or the next
    ones (the bits order bfloat16 magnitudes), rounding up exactly when the dropped
    half-word is above half a step; ties go to even (ml-dtypes), with amp_cast and with
    the rounded narrowing on MXNet's generic kernels (the 'avx2' route)."""
    monkeypatch.setattr(dtypes, '_reference_bfloat16_reorders', lambda: generic)
    normal, ties, near, special = _values()
    values = np.concatenate([normal, ties, near, special[special != 0], -ties])
    got, truncated, nearest = _mxamp_bits(values), _mxnet_truncated_bits(values), \
        _ml_dtypes_bits(values)
    dropped = values.view(np.uint32) & 0xFFFF
    tie = dropped == 0x8000
    np.testing.assert_array_equal(got - truncated, np.where(tie, got - truncated, dropped > 0x8000))
    np.testing.assert_array_equal(got[~tie], nearest[~tie])
    np.testing.assert_array_equal(got[tie], nearest[tie])
    # ml-dtypes' ties go to even: up exactly where the truncated bits are odd.
    np.testing.assert_array_equal(nearest[tie] - truncated[tie], truncated[tie] & 1)
    # Zeros stay zero; oneDNN's reorder (amp_cast) gives -0.0 as +0.0.
    zeros = to_float32_numpy(dtypes.cast(mx.nd.array([0.0, -0.0]), 'bfloat16'))
    np.testing.assert_array_equal(zeros, [0.0, 0.0])


@pytest.mark.parametrize('generic', [False, True])
def test_narrowing_subnormals_rounds_like_ml_dtypes_or_flushes_to_zero(monkeypatch, generic):
    """oneDNN's reorder (amp_cast) treats float32 subnormals as zero, as bfloat16
    hardware does; the rounded narrowing on MXNet's generic kernels rounds them as it
    rounds normal values, except that a negative one rounding to zero gives +0.0 (the
    split's scaled operand underflows, see dtypes.bfloat16_rounding_nodes)."""
    monkeypatch.setattr(dtypes, '_reference_bfloat16_reorders', lambda: generic)
    values = _subnormals()
    got, truncated, nearest = _mxamp_bits(values), _mxnet_truncated_bits(values), \
        _ml_dtypes_bits(values)
    signed_zero = (values.view(np.uint32) >> 16).astype(np.int64) & 0x8000
    if generic:
        np.testing.assert_array_equal(np.where((nearest == 0x8000) & (got == 0), 0x8000, got), nearest)
    else:
        assert ((got == nearest) | (got == signed_zero)).all()
    # The oracle itself: ml-dtypes keeps subnormals, one step at most above MXNet's truncation.
    assert set(np.unique(nearest - truncated)) <= {0, 1} and (nearest != signed_zero).any()


@pytest.mark.parametrize('generic', [False, True])
def test_narrowing_keeps_nan_and_infinity(monkeypatch, generic):
    """NaN stays NaN, whatever its payload (a signalling NaN whose payload sits in the
    dropped half does not become infinite); infinities stay infinite, with amp_cast and
    with MXNet's generic kernels (whose rounding clips before it subtracts, see
    dtypes.bfloat16_rounding_nodes)."""
    monkeypatch.setattr(dtypes, '_reference_bfloat16_reorders', lambda: generic)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF], np.uint32) \
        .view(np.float32)
    infinities = np.array([np.inf, -np.inf], np.float32)
    assert np.isnan(nans.astype(ml_dtypes.bfloat16).astype(np.float32)).all()
    assert np.isnan(to_float32_numpy(dtypes.cast(mx.nd.array(nans), 'bfloat16'))).all()
    got = to_float32_numpy(dtypes.cast(mx.nd.array(infinities), 'bfloat16'))
    np.testing.assert_array_equal(_bits(got.astype(ml_dtypes.bfloat16)),
                                  _ml_dtypes_bits(infinities))
    np.testing.assert_array_equal(got, infinities)
