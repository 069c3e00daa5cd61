"""mxamp's own pooling on oneDNN 3 (mxamp.kernels.operators.pooling).

What lets a channels-last region take a network's stem in (`mxamp.kernels.channels_last`):
MXNet 1.9.1 has no CPU pooling on channels-last data.  In float32 it must give
MXNet's ``Pooling`` (pooling_convention 'valid'), output and data gradient, for
max and average pooling (padding counted or not), global pooling, 1 to 3
spatial dimensions, channels second or last.  Max pooling picks the same
element as MXNet's, so its output is exact; sums (average pooling, and the
gradients of overlapping windows) run in another order: 1e-6 of the largest
value.  bfloat16 data gives MXNet's bfloat16 ``Pooling`` within bfloat16
rounding.
"""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from mxamp import hardware
from mxamp.kernels import operators

pytestmark = pytest.mark.skipif(not operators.available(),
                                reason='own operators off here: %s' % operators.status().reason)


# Transposes run in numpy: MXNet 1.9.1's transpose corrupts memory on bfloat16 arrays.
def channels_last(array):
    return array.transpose((0,) + tuple(range(2, array.ndim)) + (1,))


def channels_first(array):
    return array.transpose((0, array.ndim - 1) + tuple(range(1, array.ndim - 1)))


def to_numpy(array):
    return mx.nd.amp_cast(array, dtype='float32').asnumpy()


def to_mxnet(array, dtype):
    return mx.nd.amp_cast(mx.nd.array(array), dtype=dtype)


def mxnet_pooling(data, head, dtype, **attributes):
    """MXNet's Pooling on numpy `data` and `head` in `dtype`: output and data gradient."""
    data = to_mxnet(data, dtype)
    data.attach_grad()
    with autograd.record():
        out = mx.nd.Pooling(data, **attributes)
    out.backward(to_mxnet(head, dtype))
    return to_numpy(out), to_numpy(data.grad)


def own_pooling(data, head, dtype, last, **attributes):
    """mxamp's pooling on the same arrays (channels last if `last`), results channels second."""
    data = to_mxnet(channels_last(data) if last else data, dtype)
    data.attach_grad()
    with autograd.record():
        outputs = operators.pooling(data, channels_last=last, **attributes)
        out = outputs[0] if isinstance(outputs, list) else outputs
    out.backward(to_mxnet(channels_last(head) if last else head, dtype))
    out, grad = to_numpy(out), to_numpy(data.grad)
    if last:
        out, grad = channels_first(out), channels_first(grad)
    return out, grad, outputs


def assert_close(got, want, tolerance):
    assert np.abs(got - want).max() <= tolerance * np.abs(want).max()


CASES = [
    dict(pool_type='max', kernel=(3, 3), stride=(2, 2), pad=(1, 1)),       # ResNet's stem
    dict(pool_type='max', kernel=(2, 2), stride=(2, 2)),
    dict(pool_type='max', kernel=(3,), stride=(1,), pad=(1,)),
    dict(pool_type='max', kernel=(2, 3, 2), stride=(1, 2, 2), pad=(1, 1, 0)),
    dict(pool_type='avg', kernel=(3, 3), stride=(2, 2), pad=(1, 1)),
    dict(pool_type='avg', kernel=(3, 3), stride=(2, 2), pad=(1, 1), count_include_pad=False),
    dict(pool_type='avg', kernel=(2, 2), stride=(2, 2)),
    dict(pool_type='avg', global_pool=True),
    dict(pool_type='max', global_pool=True),
]


def case_id(case):
    return '-'.join('%s=%s' % item for item in sorted(case.items()))


@pytest.mark.parametrize('case', CASES, ids=[case_id(case) for case in CASES])
@pytest.mark.parametrize('last', [False, True], ids=['channels_second', 'channels_last'])
def test_float32_matches_mxnet_pooling(case, last):
    spatial = {1: (11,), 2: (9, 11), 3: (5, 6, 7)}[len(case.get('kernel', (0, 0)))]
    rng = np.random.RandomState(0)
    data = rng.normal(size=(2, 5) + spatial)
    head = rng.uniform(-1, 1, mx.nd.Pooling(mx.nd.array(data), **case).shape)
    want_out, want_grad = mxnet_pooling(data, head, 'float32', **case)
    got_out, got_grad, outputs = own_pooling(data, head, 'float32', last, **case)
    if case['pool_type'] == 'max':
        np.testing.assert_array_equal(got_out, want_out)
        # The second output: where each window's maximum was, kept for the gradient.
        assert len(outputs) == 2 and outputs[1].dtype == np.uint8 and outputs[1].ndim == 1
    else:
        assert_close(got_out, want_out, 1e-6)
    assert_close(got_grad, want_grad, 1e-6)


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason='no bfloat16 kernels on this CPU (class %r)' % hardware.cpu_class())
@pytest.mark.parametrize('pool_type', ['max', 'avg'])
def test_bfloat16_matches_mxnets_bfloat16_pooling(pool_type):
    case = dict(pool_type=pool_type, kernel=(3, 3), stride=(2, 2), pad=(1, 1))
    rng = np.random.RandomState(1)
    data = rng.normal(size=(4, 32, 14, 14))
    head = rng.uniform(-1, 1, (4, 32, 7, 7))
    want_out, want_grad = mxnet_pooling(data, head, 'bfloat16', **case)
    got_out, got_grad, _ = own_pooling(data, head, 'bfloat16', True, **case)
    if pool_type == 'max':   # the same elements picked
        np.testing.assert_array_equal(got_out, want_out)
    # Sums rounded to bfloat16: within its rounding.
    assert_close(got_out, want_out, 2.0 ** -7)
    assert_close(got_grad, want_grad, 2.0 ** -7)


def test_in_a_symbol_graph_max_pooling_has_two_outputs():
    out = operators.pooling(mx.sym.var('data'), kernel=(2, 2), stride=(2, 2), channels_last=True,
                           name='pool')
    assert out.list_outputs() == ['pool_output0', 'pool_output1']
    _, out_shapes, _ = out.infer_shape(data=(2, 8, 8, 3))
    assert out_shapes[0] == (2, 4, 4, 3)
    _, out_types, _ = out.infer_type(data=np.float32)
    assert out_types == [np.float32, np.uint8]
    average = operators.pooling(mx.sym.var('data'), pool_type='avg', global_pool=True)
    assert len(average.list_outputs()) == 1


@pytest.mark.parametrize('attributes,message', [
    (dict(kernel=(3, 3), pad=(3, 3)), 'pad must be smaller than kernel'),
    (dict(kernel=(3,)), 'data must have 3 dimensions for a 1-D kernel'),
    (dict(), 'kernel is required unless global_pool'),
])
def test_bad_attributes_get_one_clear_line(attributes, message):
    with pytest.raises(mx.base.MXNetError, match=message):
        outputs = operators.pooling(mx.nd.ones((2, 3, 6, 6)), **attributes)
        outputs[0].wait_to_read()


def test_other_pool_types_are_refused_by_name():
    with pytest.raises(ValueError, match="pool_type='lp'"):
        operators.pooling(mx.nd.ones((2, 3, 6, 6)), kernel=(2, 2), pool_type='lp')
