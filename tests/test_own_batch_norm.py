"""mxamp's own batch normalisation on oneDNN 3 (mxamp.kernels.operators.batch_norm).

(bfloat16 channels-last data in training runs mxamp's AVX-512 loops instead of
oneDNN's kernel: the LOOP_SHAPES tests below hold them to the float32 kernel.)

The building block of a channels-last chain: MXNet 1.9.1's ``BatchNorm`` runs a
scalar loop on channels-last data, oneDNN 3 a vectorised kernel.  In float32 it
must give MXNet's ``BatchNorm`` in training mode (channels second, or last on
the data MXNet normalises with ``axis=3``): the output, the gradients of data,
gamma and beta, and the moving statistics after a forward and backward pass,
for ``fix_gamma`` either way and ``use_global_stats``, and with the fused
ReLU (and a residual added before it) against MXNet's ``BatchNorm`` then its
addition and ``Activation``.  Errors are normalised by
the largest value, held to 1e-5 (float32 roundoff; the sums run in other
orders).  bfloat16 data is held to bfloat16 rounding of the float32 result.
"""
import json
import os
import subprocess
import sys
import textwrap

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from mxamp import hardware
from mxamp.kernels import operators

pytestmark = pytest.mark.skipif(not operators.available(),
                                reason='own operators off here: %s' % operators.status().reason)

TOLERANCE = 1e-5
CHANNELS = 8


def normalised_error(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def run(data, head, params, own, **attributes):
    """Output, gradients of (data, gamma, beta) and the moving statistics after one step.

    ``act_type='relu'``: MXNet's side is its BatchNorm, then its Activation; a
    `residual` array is added before it, and its gradient comes last.
    """
    gamma, beta, moving_mean, moving_var = [array.copy() for array in params]
    data = data.copy()
    residual = attributes.pop('residual', None)
    arrays = [data, gamma, beta] + ([] if residual is None else [residual.copy()])
    for array in arrays:
        array.attach_grad()
    with autograd.record():
        if own:
            out = operators.batch_norm(data, gamma, beta, moving_mean, moving_var,
                                      residual=None if residual is None else arrays[3],
                                      **attributes)[0]
        else:
            axis = attributes.pop('axis', 1)
            act_type = attributes.pop('act_type', None)
            out = mx.nd.BatchNorm(data, gamma, beta, moving_mean, moving_var,
                                  axis=axis if axis == 1 else data.ndim - 1, **attributes)
            if residual is not None:
                out = out + arrays[3]
            if act_type is not None:
                out = mx.nd.Activation(out, act_type=act_type)
    out.backward(head)
    cast = lambda a: mx.nd.amp_cast(a, dtype='float32').asnumpy()
    return [cast(out), cast(data.grad), gamma.grad.asnumpy(), beta.grad.asnumpy(),
            moving_mean.asnumpy(), moving_var.asnumpy()] + [cast(a.grad) for a in arrays[3:]]


def random_case(shape, seed=0):
    rng = np.random.RandomState(seed)
    data = mx.nd.array(rng.normal(0.5, 2.0, shape))
    head = mx.nd.array(rng.uniform(-1, 1, shape))
    params = [mx.nd.array(rng.uniform(0.5, 1.5, CHANNELS)), mx.nd.array(rng.uniform(-1, 1, CHANNELS)),
              mx.nd.array(rng.uniform(-0.1, 0.1, CHANNELS)), mx.nd.array(rng.uniform(0.5, 2, CHANNELS))]
    return data, head, params


@pytest.mark.parametrize('shape,axis', [((4, CHANNELS, 5, 6), 1), ((4, 5, 6, CHANNELS), -1),
                                        ((3, 4, 5, 6, CHANNELS), -1), ((6, 7, CHANNELS), -1),
                                        ((6, CHANNELS, 7), 1)])
@pytest.mark.parametrize('fix_gamma', [False, True])
@pytest.mark.parametrize('use_global_stats', [False, True])
@pytest.mark.parametrize('act_type', [None, 'relu'])
@pytest.mark.parametrize('with_residual', [False, True])
def test_float32_matches_mxnet_batch_norm_in_training(shape, axis, fix_gamma, use_global_stats,
                                                      act_type, with_residual):
    data, head, params = random_case(shape)
    attributes = dict(eps=1e-5, momentum=0.8, fix_gamma=fix_gamma,
                      use_global_stats=use_global_stats, axis=axis, act_type=act_type)
    if with_residual:
        attributes['residual'] = mx.nd.array(np.random.RandomState(5).normal(size=shape))
    own = run(data, head, params, True, **dict(attributes))
    mxnet = run(data, head, params, False, **dict(attributes))
    names = ['output', 'data gradient', 'gamma gradient', 'beta gradient', 'moving mean',
             'moving variance', 'residual gradient']
    assert len(own) == len(mxnet) == 6 + with_residual
    for name, got, want in zip(names, own, mxnet):
        assert normalised_error(got, want) < TOLERANCE, (name, got, want)
    if fix_gamma:
        assert not own[2].any()                      # a fixed gamma takes no gradient
    if use_global_stats:
        np.testing.assert_array_equal(own[4], params[2].asnumpy())   # moving statistics kept
    else:
        assert normalised_error(own[4], params[2].asnumpy()) > 1e-3  # ... or updated


def test_moving_statistics_follow_mxnets_update_over_steps():
    # moving = moving * momentum + batch * (1 - momentum), the biased batch variance, each step.
    data, head, params = random_case((8, 3, 3, CHANNELS))
    mean, var = mx.nd.zeros(CHANNELS), mx.nd.ones(CHANNELS)
    expected_mean, expected_var = np.zeros(CHANNELS), np.ones(CHANNELS)
    for step in range(3):
        batch = data.asnumpy() * (step + 1)
        batch_data = mx.nd.array(batch)
        batch_data.attach_grad()
        with autograd.record():
            out, batch_mean, batch_var = operators.batch_norm(
                batch_data, params[0], params[1], mean, var, momentum=0.9, axis=-1)
        out.backward()
        # The gradient's update is no declared write (as MXNet 1.9.1's BatchNorm's is not):
        # wait for it, or the read below may come first (2 runs in 30 failed without).
        mx.nd.waitall()
        np.testing.assert_allclose(batch_mean.asnumpy(), batch.mean(axis=(0, 1, 2)), rtol=1e-5)
        np.testing.assert_allclose(batch_var.asnumpy(), batch.var(axis=(0, 1, 2)), rtol=1e-4)
        expected_mean = expected_mean * 0.9 + batch.mean(axis=(0, 1, 2)) * 0.1
        expected_var = expected_var * 0.9 + batch.var(axis=(0, 1, 2)) * 0.1
        np.testing.assert_allclose(mean.asnumpy(), expected_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var.asnumpy(), expected_var, rtol=1e-4)


def run_with_copies(data, heads, params, residual=None, **attributes):
    """The own batch normalisation with a copy of its output per head after the first:
    output, gradients of (data, gamma, beta), moving statistics[, residual gradient]."""
    gamma, beta, moving_mean, moving_var = [array.copy() for array in params]
    arrays = [data.copy(), gamma, beta] + ([] if residual is None else [residual.copy()])
    for array in arrays:
        array.attach_grad()
    copies = len(heads) - 1
    with autograd.record():
        outputs = operators.batch_norm(*arrays[:3], moving_mean, moving_var, copies=copies,
                                      residual=None if residual is None else arrays[3],
                                      **attributes)
    # (output, mean, variance, copies...[, the fused ReLU's workspace])
    assert len(outputs) == 3 + copies + (attributes.get('act_type') == 'relu' and residual is None)
    for copy in outputs[3:3 + copies]:
        np.testing.assert_array_equal(copy.asnumpy(), outputs[0].asnumpy())
    autograd.backward([outputs[0]] + outputs[3:3 + copies], heads)
    cast = lambda a: mx.nd.amp_cast(a, dtype='float32').asnumpy()
    return [cast(outputs[0]), cast(arrays[0].grad), gamma.grad.asnumpy(), beta.grad.asnumpy(),
            moving_mean.asnumpy(), moving_var.asnumpy()] + [cast(a.grad) for a in arrays[3:]]


@pytest.mark.parametrize('act_type', [None, 'relu'])
@pytest.mark.parametrize('with_residual', [False, True])
def test_copies_of_the_output_sum_their_gradients(act_type, with_residual):
    # MXNet's side: one output read by three heads, whose gradients MXNet sums.
    data, _, params = random_case((4, 3, 5, CHANNELS))
    rng = np.random.RandomState(3)
    heads = [mx.nd.array(rng.uniform(-1, 1, data.shape)) for _ in range(3)]
    residual = mx.nd.array(rng.normal(size=data.shape)) if with_residual else None
    attributes = dict(fix_gamma=False, axis=-1, act_type=act_type)
    want = run(data, heads[0] + heads[1] + heads[2], params, False, residual=residual,
               **dict(attributes))
    got = run_with_copies(data, heads, params, residual, **attributes)
    assert len(got) == len(want) == 6 + with_residual
    for name, got_array, want_array in zip(['output', 'data gradient', 'gamma gradient',
                                            'beta gradient', 'moving mean', 'moving variance',
                                            'residual gradient'], got, want):
        assert normalised_error(got_array, want_array) < TOLERANCE, name


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('with_residual', [False, True])
def test_copies_gradients_are_summed_once_as_one_head_of_their_sum(dtype, with_residual):
    # The copies' gradients are summed in float32 and rounded once: the same bits as one
    # head holding that sum, also where a residual's ReLU masks the sum in the same pass.
    if dtype == 'bfloat16' and not hardware.computes_bfloat16():
        pytest.skip('no bfloat16 kernels on this CPU (class %r)' % hardware.cpu_class())
    to_dtype = lambda a: mx.nd.amp_cast(a, dtype=dtype)
    data, _, params = random_case((4, 3, 5, CHANNELS))
    rng = np.random.RandomState(4)
    heads = [to_dtype(mx.nd.array(rng.uniform(-1, 1, data.shape))) for _ in range(2)]
    # Zeros in the output (where the ReLU's mask decides) and cancelling pairs of heads.
    heads[1][0] = -heads[0][0]
    residual = to_dtype(mx.nd.array(rng.normal(size=data.shape))) if with_residual else None
    summed = to_dtype(mx.nd.amp_cast(heads[0], dtype='float32') +
                      mx.nd.amp_cast(heads[1], dtype='float32'))
    attributes = dict(fix_gamma=False, axis=-1, act_type='relu')
    got = run_with_copies(to_dtype(data), heads, params, residual, **attributes)
    want = run_with_copies(to_dtype(data), [summed], params, residual, **attributes)
    assert (got[0] == 0).any() and (got[0] > 0).any()
    for got_array, want_array in zip(got, want):
        np.testing.assert_array_equal(got_array, want_array)


@pytest.mark.parametrize('own', [False, True], ids=['mxnet', 'own'])
def test_a_forward_pass_without_its_backward_leaves_the_moving_statistics(own):
    # MXNet's BatchNorm updates them in the backward pass: a loss computed under
    # autograd.record and dropped (or a forward in train_mode) leaves them, for both.
    data, _, params = random_case((4, CHANNELS, 3, 3))
    mean, var = params[2].copy(), params[3].copy()
    with autograd.record():
        if own:
            operators.batch_norm(data, params[0], params[1], mean, var)[0].wait_to_read()
        else:
            mx.nd.BatchNorm(data, params[0], params[1], mean, var).wait_to_read()
    np.testing.assert_array_equal(mean.asnumpy(), params[2].asnumpy())
    np.testing.assert_array_equal(var.asnumpy(), params[3].asnumpy())


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason='no bfloat16 kernels on this CPU (class %r)' % hardware.cpu_class())
def test_bfloat16_data_is_float32_within_bfloat16_rounding():
    data, head, params = random_case((8, 7, 7, 32))
    params = [mx.nd.array(np.random.RandomState(1).uniform(0.5, 1.5, 32)) for _ in range(4)]
    reference = run(data, head, params, True, fix_gamma=False, axis=-1)
    bf16 = lambda a: mx.nd.amp_cast(a, dtype='bfloat16')
    low = run(bf16(data), bf16(head), params, True, fix_gamma=False, axis=-1)
    for name, got, want in zip(['output', 'data gradient', 'gamma gradient', 'beta gradient'],
                               low, reference):
        # Inputs rounded to 8 bits of mantissa, the output once more: a few ulps of bfloat16.
        assert normalised_error(got, want) < 2.0 ** -6, name


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason='no bfloat16 kernels on this CPU (class %r)' % hardware.cpu_class())
def test_bfloat16_fused_relu_is_the_batch_norm_then_mxnets_relu():
    # The fused ReLU's gradient reads bfloat16's own workspace; against float32 a value near 0
    # may change sign with the inputs' rounding, so the reference is the same batch norm in
    # bfloat16 followed by MXNet's bfloat16 Activation: the same numbers exactly.
    data, head, params = random_case((8, 7, 7, 32))
    params = [mx.nd.array(np.random.RandomState(1).uniform(0.5, 1.5, 32)) for _ in range(4)]
    bf16 = lambda a: mx.nd.amp_cast(a, dtype='bfloat16')
    results = []
    for fused in (True, False):
        x = bf16(data)
        gamma, beta, mean, var = [array.copy() for array in params]
        for array in (x, gamma, beta):
            array.attach_grad()
        with autograd.record():
            out = operators.batch_norm(x, gamma, beta, mean, var, fix_gamma=False, axis=-1,
                                      act_type='relu' if fused else None)[0]
            if not fused:
                out = mx.nd.Activation(out, act_type='relu')
        out.backward(bf16(head))
        results.append([mx.nd.amp_cast(a, dtype='float32').asnumpy()
                        for a in (out, x.grad, gamma.grad, beta.grad)])
    for name, got, want in zip(['output', 'data gradient', 'gamma gradient', 'beta gradient'],
                               *results):
        np.testing.assert_array_equal(got, want, err_msg=name)


# bfloat16 channels-last data in training takes mxamp's AVX-512 loops (bfloat16_batch_norm.cc):
# shapes that reach each of their branches.  Values: rows (every dimension but the last) times
# channels; threads start at 65536 values, chunks hold 256 KB of data, sums take 16 (8 for the
# gradient) vectors of 16 channels at a time.
LOOP_SHAPES = [
    pytest.param((2, 3, 5, 24), id='one-thread-tail'),         # 8 channels in the last vector
    pytest.param((16, 16, 16, 64), id='threads-two-chunks'),   # 4096 rows, 2048 a chunk
    pytest.param((4, 9, 9, 300), id='blocks-and-tail'),        # 19 vectors: 16 + 3, and 8 + 8 + 3
    pytest.param((8, 5, 5, 2048), id='wide-rows'),             # a chunk of 64 rows
    pytest.param((3, 7, 11, 3), id='three-channels'),          # a masked vector only
]
needs_bfloat16 = pytest.mark.skipif(
    not hardware.computes_bfloat16(),
    reason='no bfloat16 kernels on this CPU (class %r)' % hardware.cpu_class())


def bfloat16_case(shape, mean=0.5, std=2.0, seed=0):
    rng = np.random.RandomState(seed)
    channels = shape[-1]
    bf16 = lambda a: mx.nd.amp_cast(mx.nd.array(a), dtype='bfloat16')
    data, head = bf16(rng.normal(mean, std, shape)), bf16(rng.uniform(-1, 1, shape))
    params = [mx.nd.array(rng.uniform(0.5, 1.5, channels)) for _ in range(4)]
    return data, head, params, bf16(rng.normal(0, 1, shape))


@needs_bfloat16
@pytest.mark.parametrize('shape', LOOP_SHAPES)
@pytest.mark.parametrize('mean,std', [(0.5, 2.0), (1000.0, 8.0)], ids=['centred', 'offset'])
def test_bfloat16_batch_statistics_are_those_of_the_rounded_data(shape, mean, std):
    # The mean and the biased variance of the bfloat16 values themselves, to float32's
    # precision, also where the mean is 125 standard deviations from 0 (where summing squares
    # and subtracting the squared mean would lose most digits of the variance).
    data, _, params, _ = bfloat16_case(shape, mean, std)
    _, batch_mean, batch_var = operators.batch_norm(data, *params, axis=-1, fix_gamma=False)[:3]
    values = mx.nd.amp_cast(data, dtype='float32').asnumpy().astype(np.float64)
    values = values.reshape(-1, shape[-1])
    np.testing.assert_allclose(batch_mean.asnumpy(), values.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(batch_var.asnumpy(), values.var(axis=0), rtol=2e-5)


@needs_bfloat16
@pytest.mark.parametrize('shape', LOOP_SHAPES)
@pytest.mark.parametrize('act_type', [None, 'relu'])
@pytest.mark.parametrize('with_residual', [False, True])
def test_bfloat16_loops_are_float32_within_bfloat16_rounding(shape, act_type, with_residual):
    # Against the same batch normalisation of the same values in float32 (oneDNN's kernel):
    # the output and data gradient rounded once to bfloat16, gamma's and beta's gradients and
    # the moving statistics summed in float32.
    data, head, params, residual = bfloat16_case(shape)
    attributes = dict(eps=1e-5, momentum=0.8, fix_gamma=False, axis=-1, act_type=act_type)
    if with_residual:
        attributes['residual'] = residual
    low = run(data, head, params, True, **dict(attributes))
    f32 = lambda a: mx.nd.amp_cast(a, dtype='float32')
    if with_residual:
        attributes['residual'] = f32(residual)
    want = run(f32(data), f32(head), params, True, **attributes)
    names = ['output', 'data gradient', 'gamma gradient', 'beta gradient', 'moving mean',
             'moving variance', 'residual gradient']
    rounded = {'output', 'data gradient', 'residual gradient'}
    for name, got_array, want_array in zip(names, low, want):
        limit = 2.0 ** -7 if name in rounded else 1e-5
        assert normalised_error(got_array, want_array) < limit, name


@needs_bfloat16
def test_bfloat16_channels_last_training_runs_no_onednn_batch_norm(tmp_path):
    # oneDNN's verbose log of one forward and backward pass: the loops, not its kernel, for
    # batch statistics; its kernel for the global-statistics form the loops leave to it.
    script = tmp_path / 'probe.py'
    script.write_text(textwrap.dedent("""
        import mxnet as mx
        from mxnet import autograd
        from mxamp.kernels import operators
        data = mx.nd.amp_cast(mx.nd.ones((2, 4, 4, 32)), dtype='bfloat16')
        params = [mx.nd.ones(32) for _ in range(4)]
        for use_global_stats in (False, True):
            data.attach_grad()
            with autograd.record():
                out = operators.batch_norm(data, *params, axis=-1, act_type='relu',
                                          use_global_stats=use_global_stats)[0]
            out.backward()
            mx.nd.waitall()
            print('MARK', flush=True)
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=dict(os.environ, ONEDNN_VERBOSE='1'), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    training, global_stats = result.stdout.split('MARK')[:2]
    assert 'batch_normalization' not in training
    assert 'batch_normalization' in global_stats


def test_in_a_symbol_graph_the_moving_statistics_are_auxiliary_states():
    c = CHANNELS
    out = operators.batch_norm(mx.sym.var('data'), *[mx.sym.var(name, shape=(c,)) for name in
                                                    ('gamma', 'beta', 'mean', 'var')],
                              axis=-1, fix_gamma=False, name='bn')
    assert out.list_arguments() == ['data', 'gamma', 'beta']
    assert out.list_auxiliary_states() == ['mean', 'var']
    assert json.loads(out.tojson())['nodes'][-1]['op'] == operators.BATCH_NORM_OP_NAME
    loss = mx.sym.MakeLoss(mx.sym.sum(out[0] * mx.sym.var('head')))
    executor = loss.simple_bind(mx.cpu(), data=(4, 3, 3, c), head=(4, 3, 3, c))
    data, head, params = random_case((4, 3, 3, c))
    for name, array in (('data', data), ('head', head), ('gamma', params[0]), ('beta', params[1])):
        executor.arg_dict[name][:] = array
    executor.aux_dict['mean'][:] = params[2]
    executor.aux_dict['var'][:] = params[3]
    executor.forward(is_train=True)
    executor.backward()
    want = run(data, head, params, False, fix_gamma=False, axis=-1)
    got = [executor.grad_dict['data'], executor.grad_dict['gamma'], executor.grad_dict['beta'],
           executor.aux_dict['mean'], executor.aux_dict['var']]
    for got_array, want_array in zip(got, want[1:]):
        assert normalised_error(got_array.asnumpy(), want_array) < TOLERANCE


@pytest.mark.parametrize('attributes,message', [
    (dict(axis=2), 'axis=2'),
    (dict(axis=-1, momentum='fast'), 'momentum=fast is not a number'),
    (dict(act_type='tanh'), 'act_type=tanh: only relu is fused'),
])
def test_bad_attributes_get_one_clear_line(attributes, message):
    data, _, params = random_case((2, 3, 3, CHANNELS))
    with pytest.raises(mx.base.MXNetError, match=message):
        operators.batch_norm(data, *params, **attributes)[0].wait_to_read()


def test_symbols_need_known_statistics_shapes():
    # MXNet 1.9.1's shape inference for extension operators overruns its buffer when more
    # inputs than the data has dimensions come with unknown shapes: refused before that.
    with pytest.raises(ValueError, match="gamma.*shape"):
        operators.batch_norm(*[mx.sym.var(name) for name in
                              ('data', 'gamma', 'beta', 'mean', 'var')])
