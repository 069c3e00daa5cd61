"""Tests of mxamp.optimizer: FP32 master weights for float16 and bfloat16."""
import inspect
import pickle
import re

import numpy as np
import pytest

import mxnet as mx

from mxamp import kvkeys
from mxamp import optimizer as mo
from mxamp.dtypes import BFLOAT16, cast, to_float32_numpy

# name -> (registered optimizer name, constructor arguments).  Learning rates are
# chosen so that 1000 updates with a constant gradient of 1 move a weight of 1.0
# by roughly 0.1 (about 1e-4 per update).
OPTIMIZERS = {
    'sgd': ('sgd', dict(learning_rate=1e-4)),
    'sgd_momentum': ('sgd', dict(learning_rate=1e-5, momentum=0.9)),
    'nag': ('nag', dict(learning_rate=1e-5, momentum=0.9)),
    'adam': ('adam', dict(learning_rate=1e-4)),
    'adamw': ('adamw', dict(learning_rate=1e-4)),
    'lamb': ('lamb', dict(learning_rate=1e-4)),
    'rmsprop': ('rmsprop', dict(learning_rate=3e-5)),
    'adagrad': ('adagrad', dict(learning_rate=3e-3)),
}
STEPS = 1000


def _run(name, kwargs, dtype, steps=STEPS, multi_precision=True):
    """`steps` updates with gradient 1 of two weights (1.0 and 2.0) through MXNet's Updater."""
    opt = mo.create(name, multi_precision=multi_precision, **kwargs)
    updater = mx.optimizer.get_updater(opt)
    weights = [cast(mx.nd.ones((5,)), dtype), cast(mx.nd.full((3,), 2.0), dtype)]
    grads = [cast(mx.nd.ones((5,)), dtype), cast(mx.nd.ones((3,)), dtype)]
    for _ in range(steps):
        updater([0, 1], grads, weights)
    return opt, updater, weights


def _arrays(state):
    if isinstance(state, mx.nd.NDArray):
        return [state]
    if isinstance(state, (tuple, list)):
        return [a for s in state for a in _arrays(s)]
    return []


def _spacing(value, dtype):
    if dtype == 'float16':
        return float(np.spacing(np.float16(value)))
    return 2.0 ** (np.floor(np.log2(abs(value))) - 7)  # bfloat16: 8 significant bits


@pytest.fixture(scope='module')
def fp32_reference():
    """Final weights of every optimizer with plain FP32 weights (the target)."""
    return {key: [w.asnumpy() for w in _run(name, kw, 'float32')[2]]
            for key, (name, kw) in OPTIMIZERS.items()}


@pytest.mark.parametrize('dtype', ['float16', 'bfloat16'])
@pytest.mark.parametrize('key', sorted(OPTIMIZERS))
def test_master_weights_accumulate_small_updates(key, dtype, fp32_reference):
    name, kwargs = OPTIMIZERS[key]
    opt, updater, weights = _run(name, kwargs, dtype)
    for index, (weight, reference) in enumerate(zip(weights, fp32_reference[key])):
        assert weight.dtype == np.dtype(dtype if dtype == 'float16' else BFLOAT16)
        got = to_float32_numpy(weight)
        start = 1.0 + index
        # The weight moved, by about 0.1 for the SGD family, like the FP32 run ...
        assert np.all(np.abs(got - start) > 0.03), (key, dtype, got)
        # ... and is the FP32 result rounded to the low precision.
        assert np.all(np.abs(got - reference) <= _spacing(reference[0], dtype)), \
            (key, dtype, got, reference)
        # Optimizer states, master copy included, are FP32 and track FP32 exactly.
        state = updater.states[index]
        arrays = _arrays(state)
        assert arrays and all(a.dtype == np.float32 for a in arrays)
        masters = [a for a in arrays if np.allclose(a.asnumpy(), reference, rtol=1e-5, atol=0)]
        assert masters, (key, dtype, [a.asnumpy() for a in arrays], reference)


def test_small_updates_are_lost_without_master_weights():
    _, _, weights = _run('sgd', dict(learning_rate=1e-4), 'float16', multi_precision=False)
    assert np.array_equal(weights[0].asnumpy(), np.ones(5, np.float16))
    # bfloat16 cannot represent a step of 1e-4 from 1.0 either, and MXNet's
    # kernels reject bfloat16 weights altogether.
    one = cast(mx.nd.array([1.0 - 1e-4]), 'bfloat16')
    assert to_float32_numpy(one)[0] == 1.0
    with pytest.raises(mx.base.MXNetError):
        w = cast(mx.nd.ones((2,)), 'bfloat16')
        mx.nd.sgd_update(w, w, lr=0.1, out=w)
        w.wait_to_read()


def test_float32_weights_behave_exactly_like_the_base_optimizer():
    mixed = mo.create('sgd', learning_rate=0.1, momentum=0.9, wd=1e-3)
    plain = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3)
    rng = np.random.RandomState(0)
    w_mixed, w_plain = mx.nd.array(rng.randn(7)), mx.nd.array(rng.randn(7))
    w_plain[:] = w_mixed
    up_mixed, up_plain = mx.optimizer.get_updater(mixed), mx.optimizer.get_updater(plain)
    for _ in range(5):
        g = mx.nd.array(rng.randn(7))
        up_mixed(0, g, w_mixed)
        up_plain(0, g, w_plain)
    assert w_mixed.asnumpy().tobytes() == w_plain.asnumpy().tobytes()


@pytest.mark.parametrize('name, fused', [('sgd', True), ('nag', True), ('lamb', True),
                                         ('adamw', True), ('adam', False), ('rmsprop', False),
                                         ('adagrad', False)])
def test_fused_float16_kernels_are_used_where_mxnet_has_them(name, fused):
    opt = mo.create(name)
    assert opt._mxamp_fused_fp16() is fused
    w16 = mx.nd.ones((3,), dtype='float16')
    wbf = cast(mx.nd.ones((3,)), 'bfloat16')
    assert opt._mxamp_generic(w16) is (not fused)
    assert opt._mxamp_generic(wbf)   # no MXNet kernel takes bfloat16
    assert not opt._mxamp_generic(mx.nd.ones((3,)))


def test_float16_sgd_state_is_mxnets_own_layout():
    opt, updater, weights = _run('sgd', dict(learning_rate=0.1, momentum=0.9), 'float16',
                                 steps=1)
    momentum, master = updater.states[0]   # the layout MXNet's mp_sgd_mom_update path uses
    assert master.dtype == np.float32 and momentum.dtype == np.float32
    assert np.allclose(master.asnumpy(), 1.0 - 0.1)


def test_create_from_name_and_instance():
    opt = mo.create('SGD', learning_rate=0.5, momentum=0.9)
    assert type(opt).__name__ == 'MultiPrecisionSGD'
    assert isinstance(opt, mo.MultiPrecision) and isinstance(opt, mx.optimizer.SGD)
    assert opt.multi_precision and opt.lr == 0.5 and opt.momentum == 0.9
    assert type(mo.create('adam')) is mo.mixed_class(mx.optimizer.Adam)  # cached class
    assert mo.mixed_class(mo.mixed_class(mx.optimizer.Adam)) is mo.mixed_class(mx.optimizer.Adam)
    plain = mx.optimizer.RMSProp(learning_rate=0.01)
    same = mo.create(plain)
    assert same is plain and isinstance(plain, mo.MultiPrecision) and plain.multi_precision
    assert isinstance(mo.create('adamw'), mo.AdamW)
    assert 'adamw' not in mx.optimizer.Optimizer.opt_registry   # MXNet left untouched


def test_create_errors():
    with pytest.raises(ValueError, match="unknown optimizer 'nosuch'.*adamw"):
        mo.create('nosuch')
    with pytest.raises(TypeError, match='only accepted with an optimizer name'):
        mo.create(mx.optimizer.SGD(), learning_rate=0.1)
    with pytest.raises(TypeError, match='must be a name or an mx.optimizer.Optimizer'):
        mo.create(3)
    with pytest.raises(TypeError, match='subclass of mx.optimizer.Optimizer'):
        mo.mixed_class(dict)


def test_bfloat16_without_master_weights_warns():
    opt = mo.create('sgd', multi_precision=False)
    with pytest.warns(UserWarning, match='bfloat16 weight'):
        opt.create_state_multi_precision(0, cast(mx.nd.ones((2,)), 'bfloat16'))


def test_pickle_round_trip_keeps_class_and_states():
    opt, updater, weights = _run('adam', dict(learning_rate=1e-3), 'bfloat16', steps=3)
    blob = updater.get_states(dump_optimizer=True)
    fresh = mx.optimizer.get_updater(mo.create('sgd'))
    fresh.set_states(blob)
    assert type(fresh.optimizer) is mo.mixed_class(mx.optimizer.Adam)
    assert fresh.optimizer.lr == 1e-3 and fresh.optimizer.multi_precision
    for index in updater.states:
        for a, b in zip(_arrays(updater.states[index]), _arrays(fresh.states[index])):
            assert a.asnumpy().tobytes() == b.asnumpy().tobytes()
    # Protocol 0 is what the distributed kvstore uses to ship optimizers to servers.
    again = pickle.loads(pickle.dumps(opt, 0))
    assert type(again) is type(opt) and again.beta1 == opt.beta1


def test_adamw_matches_numpy():
    lr, wd, b1, b2, eps = 0.01, 0.1, 0.9, 0.999, 1e-8
    opt = mo.create('adamw', learning_rate=lr, wd=wd, rescale_grad=0.5)
    updater = mx.optimizer.get_updater(opt)
    rng = np.random.RandomState(1)
    w = rng.randn(6).astype(np.float32)
    weight = mx.nd.array(w)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t in range(1, 6):
        g = rng.randn(6).astype(np.float32)
        updater(0, mx.nd.array(g), weight)
        g = 0.5 * g
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * (np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (np.sqrt(v) + eps) + wd * w)
    assert np.allclose(weight.asnumpy(), w, rtol=1e-5, atol=1e-6)


def test_overflow_flag_key_is_summed_not_optimized():
    """On a kvstore server the reserved flag key keeps the workers' sum."""
    opt = mo.create('sgd', learning_rate=0.1, momentum=0.9)
    updater = mx.optimizer.get_updater(opt)
    key = kvkeys.reserved_key('overflow')
    stored = mx.nd.zeros((kvkeys.OVERFLOW_FLAG_SIZE,))
    merged = mx.nd.array([1.0, 2 * 0.125, 2.0, 0.0])   # two workers, rescale_grad 0.125 each
    updater(key, merged, stored)
    # The sum, marked (last element 1) as handled by an mxamp optimizer.
    assert stored.asnumpy().tolist() == [1.0, 0.25, 2.0, 1.0]
    assert opt.rescale_grad == 0.125
    # Mixed with ordinary keys in one aggregated call, the others are still updated.
    w = mx.nd.ones((2,))
    updater([5, key], [mx.nd.ones((2,)), merged], [w, stored])
    assert np.allclose(w.asnumpy(), 1.0 - 0.1 * 0.125)


def test_reserved_keys_are_fixed():
    """Workers and servers of any mxamp version must use the same keys."""
    assert [kvkeys.reserved_key(p) for p in ('resume', 'statistics', 'overflow')] \
        == [2 ** 28, 2 ** 29, 2 ** 30 - 7]
    with pytest.raises(ValueError, match='expected one of overflow, resume, statistics'):
        kvkeys.reserved_key('weights')


def test_module_needs_no_mx_nd_alias():
    """A dist kvstore server unpickles the optimizer while ``import mxnet`` is still
    running (the server loop starts inside it), before ``mx.nd`` exists."""
    for module in (mo, kvkeys):
        source = inspect.getsource(module)
        assert not re.search(r'\bmx\.(nd|sym|symbol|gluon|np|npx)\.', source)
        assert not re.search(r'^\s*(from|import) mxnet(\.gluon| import .*\bgluon\b)', source, re.M)
