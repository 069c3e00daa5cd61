"""Locating the first non-finite output and the non-finite gradients."""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import mxamp
from conftest import needs_bfloat16_compute
from mxamp import hardware
from mxamp.diagnose import BFloat16ComputeError, first_nonfinite_output, nonfinite_gradients


def net_with(weight_scale):
    net = gluon.nn.HybridSequential(prefix='net_')
    with net.name_scope():
        net.add(gluon.nn.Dense(8, in_units=4, prefix='small_'),
                gluon.nn.Activation('relu'),
                gluon.nn.Dense(8, in_units=8, prefix='big_'),
                gluon.nn.Activation('relu'),
                gluon.nn.Dense(2, in_units=8, prefix='out_'))
    net.initialize(mx.init.One())
    net[2].weight.set_data(mx.nd.ones((8, 8)) * weight_scale)
    return net


def test_names_the_layer_whose_output_overflows_float16():
    net = mxamp.convert(net_with(1e4), 'float16')
    x = mx.nd.ones((2, 4))
    found = first_nonfinite_output(net, x)
    # 8 * 1e4 * 8 = 6.4e5 > 65504: finite in FP32 (the CPU computes FC in FP32), inf
    # once stored in float16 for the relu that follows.
    assert found['node'] == 'net_big_fwd' and found['op'] == 'FullyConnected'
    assert found['cast_to'] == 'float16'


def test_finite_network_reports_none():
    net = mxamp.convert(net_with(1.0), 'bfloat16')
    assert first_nonfinite_output(net, mx.nd.ones((2, 4))) is None


def test_bfloat16_network_converted_here_names_the_layer():
    # Runs on every CPU: bfloat16 computes natively, or in FP32 between casts of
    # bfloat16 parameters (no AVX512-BF16); both overflow in the same layer:
    # 4 * 8 * 1e38 > 3.4e38, the largest float32 (and bfloat16).
    net = mxamp.convert(net_with(1e38), 'bfloat16')
    found = first_nonfinite_output(net, mx.nd.ones((2, 4)))
    assert found['node'] == 'net_big_fwd' and found['cast_to'] is None


def _two_layer_model():
    """An FP32 symbol and parameters whose second layer overflows (8 * 4 * 1e38)."""
    data = mx.sym.var('data')
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=8, name='fc1'),
                               act_type='relu', name='relu1')
    out = mx.sym.FullyConnected(hidden, num_hidden=2, name='fc2')
    args = {'fc1_weight': mx.nd.ones((8, 4)), 'fc1_bias': mx.nd.zeros(8),
            'fc2_weight': mx.nd.ones((2, 8)) * 1e38, 'fc2_bias': mx.nd.zeros(2)}
    return out, args


@pytest.mark.parametrize('cpu_class', ['avx2', 'avx512'])
def test_symbol_converted_for_a_cpu_without_native_bfloat16_runs_everywhere(cpu_class):
    sym, args = _two_layer_model()
    sym, args, _ = mxamp.convert_model(sym, args, {}, 'bfloat16', cpu_class=cpu_class)
    assert args['fc2_weight'].dtype == mxamp.dtypes.BFLOAT16    # stored in bfloat16
    found = first_nonfinite_output(sym, mx.nd.ones((2, 4)), arg_params=args)
    assert (found['node'], found['dtype'], found['cast_to']) == ('fc2', 'float32', None)
    # A bfloat16 parameter that is itself inf: named, not its FP32 cast.
    args['fc2_weight'] = mxamp.dtypes.cast(mx.nd.ones((2, 8)) * np.inf, 'bfloat16')
    found = first_nonfinite_output(sym, mx.nd.ones((2, 4)), arg_params=args)
    assert (found['node'], found['op'], found['cast_to']) == ('fc2_weight', 'null', None)


def test_bfloat16_graph_is_refused_in_one_line_where_onednn_has_no_bfloat16(monkeypatch):
    # Only type inference runs before the refusal: simulated on any CPU.
    monkeypatch.setattr(hardware, 'cpu_class', lambda: hardware.AVX2)
    sym, args = _two_layer_model()
    sym, args, _ = mxamp.convert_model(sym, args, {}, 'bfloat16')  # for a bfloat16 CPU
    with pytest.raises(BFloat16ComputeError) as err:
        first_nonfinite_output(sym, mx.nd.ones((2, 4)), arg_params=args)
    message = str(err.value)
    assert "'fc1', FullyConnected" in message and repr(hardware.cpu_class()) in message
    assert "cpu_class='auto'" in message and '--cpu-class auto' in message
    assert '\n' not in message


@needs_bfloat16_compute
def test_bfloat16_graph_runs_where_bfloat16_is_native():
    sym, args = _two_layer_model()
    sym, args, _ = mxamp.convert_model(sym, args, {}, 'bfloat16')
    found = first_nonfinite_output(sym, mx.nd.ones((2, 4)), arg_params=args)
    assert (found['node'], found['dtype']) == ('fc2', 'bfloat16')


def test_plain_symbol_and_nan_source():
    data = mx.sym.var('data')
    logs = mx.sym.log(data, name='log')  # log of a negative number: NaN
    out = mx.sym.FullyConnected(logs, num_hidden=2, name='fc')
    args = {'fc_weight': mx.nd.ones((2, 3)), 'fc_bias': mx.nd.zeros(2)}
    found = first_nonfinite_output(out, mx.nd.array([[1, -1, 2]]), arg_params=args)
    assert found['node'] == 'log' and found['cast_to'] is None
    with pytest.raises(ValueError, match='1 inputs'):
        first_nonfinite_output(out, mx.nd.ones((1, 3)), mx.nd.ones((1, 3)), arg_params=args)


def test_nonfinite_gradients_names_parameters():
    net = net_with(1.0)
    x = mx.nd.ones((2, 4))
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    assert nonfinite_gradients(net.collect_params()) == []
    net[2].weight.grad()[:] = np.inf
    assert nonfinite_gradients(net.collect_params()) == ['net_big_weight']
