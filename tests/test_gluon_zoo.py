"""mxamp.convert on gluoncv model-zoo networks (random weights, pretrained=False), on CPU.

For each network and dtype: convert, compare the outputs with the FP32 net
(same weights; error normalised by the output scale, tolerance 32 units of
roundoff as in test_gluon.py), check parameter dtypes (BatchNorm parameters
and statistics FP32, convolution/dense weights in low precision), run
forward/backward and take an SGD step (FP32 master weights from
mxamp.optimizer): every trainable parameter must change.

He initialisation (gaussian, fan-in, magnitude 2) keeps activations O(1); with
the default uniform init some nets (MobileNetV3) output ~1e-12 at random
weights, below float16's range, which would test the init, not mxamp.
"""
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import mxamp.gluon as mg
import mxamp.optimizer as mo
from mxamp.dtypes import dtype_name, to_float32_numpy

gluoncv = pytest.importorskip('gluoncv')

UNIT_ROUNDOFF = {'bfloat16': 2.0 ** -8, 'float16': 2.0 ** -11}


QUICK = [('resnet18_v1', 32, {'classes': 10}, False),
         # Its pooling, dropout and output layers are registered twice (also in ``head``).
         ('googlenet', 224, {'classes': 10}, False)]
SLOW = [
    ('resnet18_v2', 32, {'classes': 10}, False),
    ('resnet50_v1b', 64, {'classes': 10}, False),
    ('resnet50_v1d', 64, {'classes': 10}, False),
    ('mobilenet1.0', 64, {'classes': 10}, False),
    ('mobilenetv2_1.0', 64, {'classes': 10}, False),
    ('mobilenetv3_small', 64, {'classes': 10}, False),
    ('densenet121', 224, {'classes': 10}, False),        # 7x7 final pooling
    ('vgg11_bn', 64, {'classes': 10}, False),
    ('inceptionv3', 299, {'classes': 10}, False),        # 8x8 final pooling
    ('squeezenet1.1', 224, {'classes': 10}, False),      # 13x13 final pooling
    ('se_resnext50_32x4d', 64, {'classes': 10}, False),
    ('resnest14', 64, {'classes': 10}, False),
    # SSD: closeness not compared.  Its inference outputs come after NMS
    # (discontinuous), and its training-mode head outputs go through
    # BatchNorm over 2 values (batch 2, 1x1 maps), which amplifies any rounding.
    ('ssd_300_mobilenet0.25_voc', 128, {'pretrained_base': False}, None),
    ('fcn_resnet50_voc', 96, {'pretrained_base': False}, False),
    # One ReLU block called 30 times: nodes of one name.  Compared in training mode: at
    # predict mode's initial statistics its outputs (3e-8) lie below float16's normal range.
    ('xception', 160, {'classes': 10}, True),
]

# name, input size, get_model kwargs, compare in training mode (None: do not compare)
# Tolerance: 64 units of roundoff (bfloat16 0.25, float16 0.031) of the error
# normalised by the output scale; measured worst cases are ~43 units
# (mobilenetv2, bfloat16).


class _He(mx.init.Xavier):
    """He init; vectors routed to it (a few gluoncv BatchNorm gammas) get ones."""

    def __init__(self):
        super(_He, self).__init__(rnd_type='gaussian', factor_type='in', magnitude=2)

    def _init_weight(self, name, arr):
        if len(arr.shape) < 2:
            arr[:] = 1.0
        else:
            super(_He, self)._init_weight(name, arr)


def _f32(array):
    # .copy() first: amp_cast (inside to_float32_numpy) of a bfloat16 weight
    # that holds a oneDNN blocked layout (after an inference pass through a
    # grouped/depthwise convolution) fails in MXNet 1.9.1; see the report.
    return to_float32_numpy(array.copy())


def _step_beyond_resolution(weight, grad, dtype, learning_rate):
    """Where an SGD step (the loss scale of 1024 undone) must change `weight` in `dtype`.

    A step below half the spacing of the stored dtype at that weight rounds away,
    in any implementation: such elements may rightly stay put.
    """
    bits = {'float32': 0, 'float16': 13, 'bfloat16': 16}[dtype]
    spacing = np.spacing(np.abs(weight).astype(np.float32)) * 2.0 ** bits
    return np.abs(learning_rate * grad / 1024) > spacing


def _outputs(out):
    return [to_float32_numpy(o) for o in (out if isinstance(out, (list, tuple)) else [out])]


def _check(name, size, kwargs, train_mode, dtype, compare=True):
    mx.random.seed(0)
    net = gluoncv.model_zoo.get_model(name, pretrained=False, **kwargs)
    net.initialize(_He())
    x = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (2, 3, size, size)).astype('f4'))
    if train_mode is None:
        train_mode, compare = True, False
    mode = autograd.train_mode if train_mode else autograd.predict_mode
    with mode():
        ref = _outputs(net(x))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        mg.convert(net, dtype)
        net.hybridize(static_alloc=True)
        with mode():
            out = net(x)
    got = _outputs(out)
    assert all(o.dtype == np.float32 for o in (out if isinstance(out, (list, tuple)) else [out]))
    errors = []
    for g, r in zip(got, ref):
        assert g.shape == r.shape and np.isfinite(g).all()
        assert g.dtype == np.float32
        errors.append(float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30)))
    if compare:
        assert max(errors) < 64 * UNIT_ROUNDOFF[dtype], errors

    params = net.collect_params()
    for p in params.values():
        dt = dtype_name(p.dtype)
        if 'batchnorm' in p.name or p.name.endswith(('running_mean', 'running_var', 'gamma', 'beta')):
            assert dt == 'float32', p.name
    low = [p.name for p in params.values() if dtype_name(p.dtype) == dtype]
    assert low and all(p.endswith(('weight', 'bias')) for p in low)

    trainable = {k: p for k, p in params.items() if p.grad_req != 'null'}
    before = {k: _f32(p.data()) for k, p in trainable.items()}
    trainer = gluon.Trainer(params, mo.create('sgd', learning_rate=0.1, rescale_grad=1. / 1024))
    with autograd.record():
        outs = net(x)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        # x1024: a static loss scale, so that float16 gradients do not underflow
        loss = 1024 * sum(o.sum() for o in outs if o.dtype == np.float32)
    loss.backward()
    # bfloat16 has FP32's range: finite gradients, as in FP32 (oneDNN's bfloat16 weight
    # gradient of a convolution whose input is smaller than its stride is NaN: SSD's
    # last layers; the policy's rule).  float16's may overflow at this static scale.
    nonfinite = [k for k, p in trainable.items() if not np.isfinite(_f32(p.grad())).all()]
    assert dtype == 'float16' or not nonfinite, nonfinite
    trainer.step(1)
    changed = {k for k, p in trainable.items() if (_f32(p.data()) != before[k]).any()}
    # Every parameter with a nonzero gradient moved.  (Some get none, in FP32
    # too: e.g. most of se_resnext50's stage weights at these tiny inputs.)
    assert changed
    assert any(dtype_name(trainable[k].dtype) == dtype for k in changed)
    stuck = [k for k in set(trainable) - changed
             if (_step_beyond_resolution(before[k], _f32(trainable[k].grad()),
                                         dtype_name(trainable[k].dtype), 0.1)).any()]
    assert not stuck, stuck
    return errors


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
@pytest.mark.parametrize('name,size,kwargs,train_mode', QUICK, ids=[q[0] for q in QUICK])
def test_zoo_quick(name, size, kwargs, train_mode, dtype):
    _check(name, size, kwargs, train_mode, dtype)


@pytest.mark.slow
@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
@pytest.mark.parametrize('name,size,kwargs,train_mode', SLOW, ids=[s[0] for s in SLOW])
def test_zoo(name, size, kwargs, train_mode, dtype):
    _check(name, size, kwargs, train_mode, dtype)
