"""Locating the first non-finite output and the non-finite gradients."""
import numpy as np
import pytest

import mxnet as mx
from mxnet import autograd, gluon

import mxamp
from mxamp.diagnose import first_nonfinite_output, nonfinite_gradients


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
