"""ResNet v1 and v1.5 (He et al., "Deep Residual Learning for Image Recognition"), Symbol API.

Post-activation residual units: ``conv-BN-ReLU`` inside the unit, the sum of
the residual branch and the shortcut goes through a final ReLU.  Depths 18 and
34 use basic units (two 3x3 convolutions), 50, 101 and 152 bottleneck units
(1x1, 3x3, 1x1 with four times the width at the output).  The two versions
differ only in bottleneck units that downsample: v1 strides the first 1x1
convolution, v1.5 the 3x3 one (more accurate, a little slower; NVIDIA's
published mixed-precision recipes use it).

Inputs of at most 32 pixels high (CIFAR, the 8x8 digits) get a CIFAR-style
stem, a 3x3 stride-1 convolution without max-pooling, so that the four stages
still have pixels to downsample; larger inputs get ImageNet's 7x7 stride-2
convolution and 3x3 max-pooling.  Global average pooling makes any input size
work.

Node names follow MXNet's classic examples: ``bn_data``, ``conv0``, ``bn0``,
``relu0``, ``pooling0``, then ``stage{s}_unit{u}_conv{k}`` / ``_bn{k}`` /
``_relu{k}``, the projection shortcut ``stage{s}_unit{u}_sc`` / ``_sc_bn``, the
sum ``_plus`` and its ``_relu``, then ``pool1``, ``flatten0``, ``fc1`` and
``softmax``.  Parameters are named after their node (``stage1_unit1_conv1_weight``).
"""
import mxnet as mx

from . import with_dtype

__all__ = ['get_symbol', 'resnet', 'residual_unit', 'UNITS', 'VERSIONS']

#: Residual units per stage for each supported depth.
UNITS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3),
         152: (3, 8, 36, 3)}
#: Depths built from bottleneck units; the others use basic units.
BOTTLENECK_DEPTHS = (50, 101, 152)
VERSIONS = ('1', '1.5')

# Same epsilon as MXNet's classic examples and GluonCV's ResNets: pretrained
# statistics and hyper-parameters carry over.
_BN_EPS = 2e-5
# Largest input height that gets the CIFAR-style stem.
_SMALL_INPUT = 32


def _conv(data, num_filter, kernel, stride, name, workspace):
    pad = (kernel // 2, kernel // 2)
    return mx.sym.Convolution(data=data, num_filter=num_filter, kernel=(kernel, kernel),
                              stride=(stride, stride), pad=pad, no_bias=True,
                              workspace=workspace, name=name)


def _bn(data, name, bn_mom):
    return mx.sym.BatchNorm(data=data, fix_gamma=False, eps=_BN_EPS, momentum=bn_mom, name=name)


def _relu(data, name):
    return mx.sym.Activation(data=data, act_type='relu', name=name)


def residual_unit(data, num_filter, stride, dim_match, name, bottleneck, stride_in_3x3=True,
                  bn_mom=0.9, workspace=256):
    """One post-activation residual unit.

    Parameters
    ----------
    data : mx.sym.Symbol
        Input of the unit.
    num_filter : int
        Output channels (a bottleneck unit runs its 1x1 and 3x3 convolutions at
        a quarter of it).
    stride : int
        Spatial stride of the unit (1 or 2).
    dim_match : bool
        Whether input and output shapes agree: identity shortcut if True,
        otherwise a strided 1x1 projection (``_sc`` and ``_sc_bn``).
    name : str
        Prefix of every node of the unit, e.g. ``'stage2_unit1'``.
    bottleneck : bool
        Bottleneck (1x1, 3x3, 1x1) instead of basic (3x3, 3x3) unit.
    stride_in_3x3 : bool, default True
        Bottleneck only: stride the 3x3 convolution (v1.5) rather than the first
        1x1 (v1).
    bn_mom : float, default 0.9
        Momentum of BatchNorm's moving statistics.
    workspace : int, default 256
        Convolution workspace limit in MB.

    Returns
    -------
    mx.sym.Symbol
    """
    if bottleneck:
        width = num_filter // 4
        stride1, stride2 = (1, stride) if stride_in_3x3 else (stride, 1)
        body = _relu(_bn(_conv(data, width, 1, stride1, name + '_conv1', workspace),
                         name + '_bn1', bn_mom), name + '_relu1')
        body = _relu(_bn(_conv(body, width, 3, stride2, name + '_conv2', workspace),
                         name + '_bn2', bn_mom), name + '_relu2')
        body = _bn(_conv(body, num_filter, 1, 1, name + '_conv3', workspace), name + '_bn3', bn_mom)
    else:
        body = _relu(_bn(_conv(data, num_filter, 3, stride, name + '_conv1', workspace),
                         name + '_bn1', bn_mom), name + '_relu1')
        body = _bn(_conv(body, num_filter, 3, 1, name + '_conv2', workspace), name + '_bn2', bn_mom)
    if dim_match:
        shortcut = data
    else:
        shortcut = _bn(_conv(data, num_filter, 1, stride, name + '_sc', workspace),
                       name + '_sc_bn', bn_mom)
    return _relu(mx.sym.elemwise_add(body, shortcut, name=name + '_plus'), name + '_relu')


def resnet(units, filter_list, bottleneck, num_classes, image_shape, stride_in_3x3=True,
           bn_mom=0.9, workspace=256):
    """The FP32 ResNet graph for an explicit configuration.

    Parameters
    ----------
    units : sequence of int
        Residual units per stage.
    filter_list : sequence of int
        Channels of the stem followed by the output channels of each stage
        (``len(units) + 1`` numbers).
    bottleneck : bool
        Bottleneck or basic units.
    num_classes : int
        Outputs of ``fc1``.
    image_shape : tuple of int
        ``(channels, height, width)``; a height of at most 32 selects the
        CIFAR-style stem.
    stride_in_3x3, bn_mom, workspace
        As in :func:`residual_unit`.

    Returns
    -------
    mx.sym.Symbol
        Ends in ``SoftmaxOutput(name='softmax')`` (label ``softmax_label``).
    """
    if len(filter_list) != len(units) + 1:
        raise ValueError('filter_list needs %d entries (stem and %d stages), got %d'
                         % (len(units) + 1, len(units), len(filter_list)))
    data = mx.sym.var('data')
    # Normalises the raw input, so the network trains without a mean/std preprocessing step.
    body = mx.sym.BatchNorm(data=data, fix_gamma=True, eps=_BN_EPS, momentum=bn_mom,
                            name='bn_data')
    if image_shape[1] <= _SMALL_INPUT:
        body = _conv(body, filter_list[0], 3, 1, 'conv0', workspace)
        body = _relu(_bn(body, 'bn0', bn_mom), 'relu0')
    else:
        body = _conv(body, filter_list[0], 7, 2, 'conv0', workspace)
        body = _relu(_bn(body, 'bn0', bn_mom), 'relu0')
        body = mx.sym.Pooling(data=body, kernel=(3, 3), stride=(2, 2), pad=(1, 1),
                              pool_type='max', name='pooling0')
    for stage, count in enumerate(units):
        num_filter = filter_list[stage + 1]
        for unit in range(count):
            first = unit == 0
            stride = 2 if first and stage > 0 else 1
            in_filter = filter_list[stage + 1 if not first else stage]
            body = residual_unit(body, num_filter, stride,
                                 dim_match=stride == 1 and in_filter == num_filter,
                                 name='stage%d_unit%d' % (stage + 1, unit + 1),
                                 bottleneck=bottleneck, stride_in_3x3=stride_in_3x3,
                                 bn_mom=bn_mom, workspace=workspace)
    # global_pool ignores the kernel, but an explicit one is what selects
    # oneDNN's (bfloat16-capable) pooling in MXNet 1.9.1.
    pool = mx.sym.Pooling(data=body, global_pool=True, kernel=(7, 7), pool_type='avg',
                          name='pool1')
    flat = mx.sym.Flatten(data=pool, name='flatten0')
    fc1 = mx.sym.FullyConnected(data=flat, num_hidden=num_classes, name='fc1')
    return mx.sym.SoftmaxOutput(data=fc1, name='softmax')


def _parse_shape(image_shape):
    if isinstance(image_shape, str):
        parts = [p for p in image_shape.replace(' ', '').split(',') if p]
        try:
            shape = tuple(int(p) for p in parts)
        except ValueError:
            shape = ()
    else:
        shape = tuple(int(p) for p in image_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError("image_shape %r: expected 'channels,height,width', e.g. '3,224,224'"
                         % (image_shape,))
    return shape


def get_symbol(num_classes, num_layers, image_shape, dtype='float32', version='1.5', **kwargs):
    """A ResNet for `num_classes` classes, in FP32 or mixed precision.

    Parameters
    ----------
    num_classes : int
        Number of classes.
    num_layers : int
        Depth: 18, 34 (basic units), 50, 101 or 152 (bottleneck units).
    image_shape : str or tuple of int
        ``'channels,height,width'`` such as ``'3,224,224'``, or a tuple.  Inputs
        at most 32 pixels high (``'3,32,32'``, ``'1,8,8'``) get the CIFAR-style
        stem: 3x3 stride-1 convolution, no max-pooling.
    dtype : {'float32', 'float16', 'bfloat16', 'auto'}
        ``'float32'`` gives the FP32 graph.  The others give that graph rewritten
        by `mxamp.convert_symbol` (see :func:`symbols.with_dtype`): convolutions
        and ``fc1`` run in low precision and their weights are declared in it;
        BatchNorm's parameters and statistics, the softmax and the output stay
        FP32.  ``'auto'`` picks float16 on a GPU and, on a CPU, bfloat16 where
        it computes natively, else FP32 (`mxamp.dtypes.resolve_dtype`).
    version : {'1.5', '1'}
        Where a downsampling bottleneck strides: its 3x3 convolution (v1.5) or
        its first 1x1 convolution (v1).  No effect on depths 18 and 34.
    **kwargs
        ``ctx`` (where the network will run: float16 on a CPU context computes
        GEMMs in FP32 between float16 casts, without it float16 targets a GPU),
        ``cpu_class`` (bfloat16: the CPU class the graph is for, by default this
        machine's; see :func:`symbols.with_dtype`), ``bn_mom`` (default 0.9),
        ``conv_workspace`` (MB, default 256).  Other
        keywords are ignored, so a training script may pass all its options.

    Returns
    -------
    mx.sym.Symbol
        Inputs ``data`` and ``softmax_label`` (FP32); output
        ``SoftmaxOutput(name='softmax')`` (FP32).

    Raises
    ------
    ValueError
        Unknown `num_layers`, `version`, `dtype` or malformed `image_shape`.

    Notes
    -----
    ``mx.mod.Module`` allocates the low-precision parameters in low precision;
    MXNet's initializers cannot fill bfloat16 arrays, so initialise through
    :class:`symbols.Float32Init`.  MXNet's own optimizers cannot update
    bfloat16 weights and lose small updates to float16 ones: train with mxamp's
    FP32 master weights, ``mxamp.optimizer.create('sgd', ...)``.  float16
    training also needs loss scaling (`mxamp.trainer.LossScaler`), which in turn
    needs a per-sample loss output instead of ``SoftmaxOutput`` (see its
    docstring).

    Examples
    --------
    >>> sym = get_symbol(1000, 50, '3,224,224')                    # FP32 ResNet-50 v1.5
    >>> sym = get_symbol(10, 18, '3,32,32', dtype='bfloat16')      # CPU mixed precision
    >>> mod = mx.mod.Module(sym, context=mx.cpu())
    >>> mod.bind(data_shapes=[('data', (32, 3, 32, 32))], label_shapes=[('softmax_label', (32,))])
    >>> mod.init_params(symbols.Float32Init(mx.init.Xavier(magnitude=2)))
    >>> mod.init_optimizer(optimizer=mxamp.optimizer.create('sgd', learning_rate=0.1,
    ...                                                     momentum=0.9))
    """
    if num_layers not in UNITS:
        raise ValueError('num_layers=%r: ResNet is defined for %s layers'
                         % (num_layers, ', '.join(str(n) for n in sorted(UNITS))))
    version = str(version)
    if version not in VERSIONS:
        raise ValueError("version=%r: expected one of %s"
                         % (version, ', '.join(repr(v) for v in VERSIONS)))
    shape = _parse_shape(image_shape)
    bottleneck = num_layers in BOTTLENECK_DEPTHS
    filter_list = (64, 256, 512, 1024, 2048) if bottleneck else (64, 64, 128, 256, 512)
    symbol = resnet(UNITS[num_layers], filter_list, bottleneck, num_classes, shape,
                    stride_in_3x3=version == '1.5', bn_mom=kwargs.get('bn_mom', 0.9),
                    workspace=kwargs.get('conv_workspace', 256))
    return with_dtype(symbol, dtype, ctx=kwargs.get('ctx'), input_shapes={'data': (1,) + shape},
                      cpu_class=kwargs.get('cpu_class', 'auto'))
