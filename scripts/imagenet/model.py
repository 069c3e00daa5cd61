"""The two training paths and what they share: the learning-rate schedule, the
optimizer's parameters, the loss scale.

`GluonRunner` (a GluonCV model, ``mxamp.convert``, ``mxamp.Trainer``) and
`ModuleRunner` (the ResNet of ``symbols/``, ``mx.mod.Module``,
``mxamp.ModuleTrainer``) offer the same methods to the training loop:
``train_batch``, ``predict``, ``statistics``, ``save``, ``load``,
``save_params``, ``load_params`` and the ``optimizer``, ``loss_scale`` and
``skipped_steps`` properties.  Only `GluonRunner` mixes batches (mixup).
"""
import logging
import re

import mxamp
import mxnet as mx
from mxnet import autograd, gluon

from .options import UsageError

_LOG = logging.getLogger('train_imagenet')


# ---------------------------------------------------------------------------------------
# Learning rate, loss scale

def lr_scheduler(args, base_lr, steps_per_epoch):
    """MXNet's own scheduler for --lr-mode, with linear warm-up from --warmup-lr.

    Counted in optimizer updates: skipped (overflowing) float16 steps do not
    advance the schedule.  MXNet's schedulers pickle with the optimizer, so the
    schedule is part of the checkpoint.  ``poly`` is gluoncv's (power 2, down to
    0 at the end of the training).
    """
    warmup = int(round(args.warmup_epochs * steps_per_epoch))
    total = max(args.num_epochs * steps_per_epoch, warmup + 1)
    start = dict(warmup_steps=warmup, warmup_begin_lr=args.warmup_lr)
    if args.lr_mode == 'cosine':
        return mx.lr_scheduler.CosineScheduler(total, base_lr=base_lr, final_lr=0, **start)
    if args.lr_mode in ('linear', 'poly'):
        return mx.lr_scheduler.PolyScheduler(total, base_lr=base_lr, final_lr=0,
                                             pwr=1 if args.lr_mode == 'linear' else 2, **start)
    steps = sorted({int(e) * steps_per_epoch for e in args.lr_decay_epoch.split(',')
                    if e.strip() and int(e) * steps_per_epoch > warmup})
    if not steps:   # MultiFactorScheduler needs at least one step
        steps = [total + 1]
    return mx.lr_scheduler.MultiFactorScheduler(steps, factor=args.lr_decay, base_lr=base_lr,
                                                **start)


def _loss_scale_arg(text):
    """The ``loss_scale`` argument of mxamp.Trainer for --loss-scale (already checked)."""
    if text in ('auto', 'dynamic'):
        return text
    return None if text == 'none' else float(text)


def loss_scaling(scaler):
    """'dynamic', 'fixed' or 'off': how a trainer's loss scaler (or None) scales."""
    if scaler is None:
        return 'off'
    return 'dynamic' if scaler.dynamic else 'fixed'


def current_lr(optimizer):
    """The learning rate of `optimizer`'s next update."""
    if optimizer.lr_scheduler is None:
        return optimizer.lr
    return optimizer.lr_scheduler(optimizer.num_update)


def _no_wd(name):
    return name.endswith(('_gamma', '_beta', '_bias'))


# ---------------------------------------------------------------------------------------
# The two training paths

def _optimizer_params(args, base_lr, steps_per_epoch):
    params = {'learning_rate': base_lr, 'wd': args.wd,
              'lr_scheduler': lr_scheduler(args, base_lr, steps_per_epoch)}
    if args.momentum:
        params['momentum'] = args.momentum
    return params


def _adapt_stem(net, image_shape):
    """GluonCV ResNetV1b on tiny images: 3x3 stride-1 stem, no downsampling max-pool.

    ImageNet's 7x7 stride-2 convolution and 3x3 stride-2 pooling would shrink an
    8x8 digit to 2x2 before the first stage.  Gluon forbids changing a child's
    type, so the pooling becomes a 1x1 identity pooling.
    """
    from gluoncv.model_zoo.resnetv1b import ResNetV1b
    if image_shape[1] > 32 or not isinstance(net, ResNetV1b):
        return False
    with net.name_scope():
        net.conv1 = gluon.nn.Conv2D(net.conv1._channels, 3, 1, 1, use_bias=False)
        net.maxpool = gluon.nn.MaxPool2D(1, 1)
    return True


def zero_last_gamma(net):
    """--last-gamma: make the gamma of the last BatchNorm in each residual block's branch
    initialise to zero; returns how many.

    A residual block is one with a ``downsample`` attribute (None for an identity
    shortcut), as all of GluonCV's ResNet blocks have; its branch is the rest.
    gluoncv's own ``last_gamma`` option misses its basic v1b blocks (ResNet-18 and
    -34 v1b), hence this walk.  Call it before ``initialize``: a parameter's own
    initializer wins over the net's.
    """
    zeroed = 0
    for block in _blocks(net):
        if not hasattr(block, 'downsample'):
            continue
        shortcut = set(_blocks(block.downsample)) if block.downsample is not None else set()
        norms = [b for b in _blocks(block) if isinstance(b, gluon.nn.BatchNorm)
                 and b not in shortcut]
        if norms:
            norms[-1].gamma.init = mx.init.Zero()
            zeroed += 1
    return zeroed


def _blocks(block):
    """`block` and every block under it, in the order they were registered."""
    yield block
    for child in block._children.values():
        yield from _blocks(child)


def _check_params_file(file_names, expected, what):
    """Refuse (`UsageError`, one line naming `what`) a parameter file whose names
    (`file_names`: name -> shape) are not exactly `expected`'s (name -> shape)."""
    def some(names):
        names = sorted(names)
        return ', '.join(names[:3]) + (' and %d more' % (len(names) - 3) if len(names) > 3 else '')
    missing = set(expected) - set(file_names)
    if missing == set(expected):
        raise UsageError('%s: holds none of the parameters of this network (it has %s; the '
                         'network needs %s): saved from another network, or with other names '
                         "(save_parameters' for --model, arg:/aux: for --symbol)"
                         % (what, some(file_names), some(expected)))
    if missing:
        raise UsageError('%s: lacks %d parameter(s) of the network: %s'
                         % (what, len(missing), some(missing)))
    extra = set(file_names) - set(expected)
    if extra:
        raise UsageError('%s: holds %d parameter(s) the network does not have: %s'
                         % (what, len(extra), some(extra)))
    for name in sorted(expected):
        if tuple(file_names[name]) != tuple(expected[name]):
            raise UsageError('%s: parameter %s has the shape %s there, the network needs %s'
                             % (what, name, tuple(file_names[name]), tuple(expected[name])))


def _read_params(path, what):
    """A parameter file's names and shapes, or a `UsageError` naming `what`."""
    try:
        loaded = mx.nd.load(path)
    except mx.base.MXNetError:
        raise UsageError('%s: not an MXNet parameter file' % what)
    if not isinstance(loaded, dict):
        raise UsageError('%s: holds unnamed arrays, not named parameters' % what)
    return {name: value.shape for name, value in loaded.items()}


class _Runner(object):
    """What the loop reads of a training path, from its mxamp trainer (``self.trainer``)."""

    @property
    def optimizer(self):
        return self.trainer.optimizer

    @property
    def loss_scale(self):
        return self.trainer.loss_scale

    @property
    def skipped_steps(self):
        return self.trainer.skipped_steps


class GluonRunner(_Runner):
    """GluonCV model, ``mxamp.convert``, ``mxamp.Trainer``."""

    def __init__(self, args, spec, contexts, dtype, kvstore, batch_size, global_batch,
                 base_lr, steps_per_epoch):
        from gluoncv.model_zoo import get_model
        from mxamp import convert
        self.contexts, self.global_batch = contexts, global_batch
        self.num_classes, self.smoothing = spec.num_classes, args.label_smoothing
        net = get_model(args.model, classes=spec.num_classes)
        if _adapt_stem(net, spec.image_shape):
            _LOG.info('small input %s: %s gets a 3x3 stride-1 stem without max-pooling',
                      spec.image_shape, args.model)
        if args.last_gamma and not zero_last_gamma(net):
            raise UsageError('--last-gamma: %s has no residual blocks (GluonCV blocks with a '
                             'downsample shortcut, as its ResNets have)' % args.model)
        net.initialize(mx.init.MSRAPrelu(), ctx=contexts)
        if dtype != 'float32':
            convert(net, dtype)
        net.hybridize(static_alloc=True, static_shape=True)
        # Materialise deferred parameters (shapes) before the trainer and a resume see them.
        with autograd.pause():
            net(mx.nd.zeros((batch_size,) + spec.image_shape, ctx=contexts[0]))
        if args.no_wd:
            for name, param in net.collect_params().items():
                if _no_wd(name):
                    param.wd_mult = 0.0
        self.net = net
        # Local updates: the schedule, the states and the scaler stay in this process,
        # where checkpoints can save them.  bfloat16 gradients cross a dist kvstore as
        # FP32 (mxamp.Trainer casts them: MXNet's servers abort on bfloat16).
        self.trainer = mxamp.Trainer(net.collect_params(), args.optimizer,
                                     _optimizer_params(args, base_lr, steps_per_epoch),
                                     kvstore=kvstore, update_on_kvstore=False,
                                     loss_scale=_loss_scale_arg(args.loss_scale))
        if kvstore is not None and 'dist' in kvstore.type:
            # Left to the first step, the broadcast would come after the first training
            # forward pass and replace every worker's first update of the BatchNorm
            # running statistics by worker 0's.
            self.trainer.init_kvstore()
        self.loss_fn = gluon.loss.SoftmaxCrossEntropyLoss(sparse_label=False)

    def statistics(self):
        """Per running statistic (BatchNorm mean/variance), its array on every device."""
        return [p.list_data() for p in self.net.collect_params().values()
                if p.grad_req == 'null']

    def _targets(self, label):
        k, eps = self.num_classes, self.smoothing
        return mx.nd.one_hot(label, k, on_value=1.0 - eps + eps / k, off_value=eps / k)

    def train_batch(self, batch, mixup=None):
        """One step; returns the summed per-sample loss (NDArray) and whether it applied.

        `mixup`: gluoncv's mixup with this weight, each device's part of the batch
        mixed with itself reversed (images and smoothed one-hot labels alike).
        """
        xs = gluon.utils.split_and_load(batch.data[0], self.contexts, even_split=False)
        ys = gluon.utils.split_and_load(batch.label[0], self.contexts, even_split=False)
        targets = [self._targets(y) for y in ys]
        if mixup is not None:
            xs = [mixup * x + (1 - mixup) * mx.nd.flip(x, axis=0) for x in xs]
            targets = [mixup * t + (1 - mixup) * mx.nd.flip(t, axis=0) for t in targets]
        with autograd.record():
            losses = [self.loss_fn(self.net(x), t) for x, t in zip(xs, targets)]
            with self.trainer.scale_loss(losses) as scaled:
                autograd.backward(scaled)
        applied = self.trainer.step(self.global_batch)
        total = sum(loss.sum().as_in_context(mx.cpu()) for loss in losses)
        return total, applied

    def predict(self, batch):
        xs = gluon.utils.split_and_load(batch.data[0], self.contexts, even_split=False)
        return [self.net(x) for x in xs], \
            gluon.utils.split_and_load(batch.label[0], self.contexts, even_split=False)

    def save_params(self, params_file):
        """The parameters in FP32, as ``save_parameters`` names them."""
        self.net.save_parameters(params_file)

    def load_params(self, params_file, what):
        """Load a ``save_parameters`` file, checked first (`UsageError` naming `what`)."""
        expected = {name: param.shape
                    for name, param in self.net._collect_params_with_prefix().items()}
        _check_params_file(_read_params(params_file, what), expected, what)
        self.net.load_parameters(params_file, ctx=self.contexts)

    def save(self, params_file, states_file):
        self.save_params(params_file)
        self.trainer.save_states(states_file)

    def load(self, params_file, states_file):
        self.net.load_parameters(params_file, ctx=self.contexts)
        self.trainer.load_states(states_file)


_UNIT_NORM = re.compile(r'^(stage\d+_unit\d+)_bn(\d+)_gamma$')


def last_unit_gammas(arg_params):
    """--last-gamma for ``symbols.resnet``: the gamma of the last BatchNorm of each
    residual unit's branch (``bn2`` of a basic unit, ``bn3`` of a bottleneck; not
    the shortcut's ``sc_bn``), by name."""
    last = {}
    for name in arg_params:
        match = _UNIT_NORM.match(name)
        if match and int(match.group(2)) > last.get(match.group(1), (0, None))[0]:
            last[match.group(1)] = (int(match.group(2)), name)
    return sorted(name for _, name in last.values())


def symbol_loss_head(logits, label, smoothing, num_classes):
    """Per-sample cross-entropy with label smoothing, as a plain output.

    ``SoftmaxOutput`` (and ``MakeLoss``) compute their own gradient and ignore
    the head gradient ``Module.backward`` passes, so a loss scale given there
    would be lost.  With the loss itself as the output, ``backward`` takes
    the loss scale per sample (``mxamp.ModuleTrainer.backward``) and scales every
    gradient, for float16 exactly as the Gluon path does.  log_softmax, pick
    and mean run in FP32 under mxamp's policy.
    """
    logp = mx.sym.log_softmax(logits, axis=-1, name='log_softmax')
    nll = -mx.sym.pick(logp, label, axis=-1)
    if smoothing:
        nll = (1.0 - smoothing) * nll - smoothing * mx.sym.mean(logp, axis=-1)
    return mx.sym.identity(nll, name='loss')


class ModuleRunner(_Runner):
    """symbols.resnet, ``mx.mod.Module``, ``mxamp.ModuleTrainer``."""

    def __init__(self, args, spec, contexts, dtype, kvstore, batch_size, global_batch,
                 base_lr, steps_per_epoch):
        import symbols
        from symbols import resnet
        fp32 = resnet.get_symbol(spec.num_classes, args.num_layers, spec.image_shape,
                                 version=args.resnet_version)
        logits = fp32.get_internals()['fc1_output']
        loss = symbol_loss_head(logits, mx.sym.var('softmax_label'), args.label_smoothing,
                                spec.num_classes)
        graph = mx.sym.Group([loss, mx.sym.BlockGrad(logits, name='logits')])
        self.symbol = symbols.with_dtype(graph, dtype, ctx=contexts)
        local_batch = batch_size * len(contexts)
        mod = mx.mod.Module(self.symbol, data_names=['data'], label_names=['softmax_label'],
                            context=contexts, logger=_LOG)
        mod.bind(data_shapes=[('data', (local_batch,) + spec.image_shape)],
                 label_shapes=[('softmax_label', (local_batch,))])
        mod.init_params(symbols.Float32Init(mx.init.Xavier(rnd_type='gaussian',
                                                           factor_type='in', magnitude=2)))
        if args.last_gamma:
            arg_params, aux_params = mod.get_params()
            for name in last_unit_gammas(arg_params):
                arg_params[name][:] = 0
            mod.set_params(arg_params, aux_params)
        params = dict(_optimizer_params(args, base_lr, steps_per_epoch),
                      rescale_grad=1.0 / global_batch)
        self.trainer = mxamp.ModuleTrainer(mod, args.optimizer, params, kvstore=kvstore,
                                           loss_scale=_loss_scale_arg(args.loss_scale))
        # Explicit per name: MXNet's default (no decay unless *_weight) is not the recipe's.
        self.trainer.optimizer.set_wd_mult({name: 0.0 if args.no_wd and _no_wd(name) else 1.0
                                            for name in mod.get_params()[0]})
        self.mod = mod

    def train_batch(self, batch):
        self.mod.forward(batch, is_train=True)
        self.trainer.backward()
        applied = self.trainer.step()
        return self.mod.get_outputs()[0].sum(), applied

    def statistics(self):
        """Per auxiliary state (BatchNorm mean/variance), its array on every device."""
        return self.trainer.aux_arrays()

    def predict(self, batch):
        self.mod.forward(batch, is_train=False)
        return [self.mod.get_outputs()[1]], [batch.label[0]]

    def save_params(self, params_file):
        """The parameters in FP32, with ``mx.model.save_checkpoint``'s arg:/aux: names."""
        self.trainer.save_params(params_file)

    def load_params(self, params_file, what):
        """Load an arg:/aux: parameter file, checked first (`UsageError` naming `what`)."""
        arg_params, aux_params = self.mod.get_params()
        expected = {kind + name: value.shape for kind, values in
                    (('arg:', arg_params), ('aux:', aux_params)) for name, value in values.items()}
        _check_params_file(_read_params(params_file, what), expected, what)
        self.trainer.load_params(params_file)

    def save(self, params_file, states_file):
        self.save_params(params_file)
        self.trainer.save_states(states_file)

    def load(self, params_file, states_file):
        self.trainer.load_params(params_file)
        self.trainer.load_states(states_file)
