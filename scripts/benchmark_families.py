"""The networks ``scripts/benchmark.py`` measures, by family: how to build one, a batch of
its input, its loss, and what one of its samples is.

Each family's `Family.setup` returns a `Setup`: an FP32 network, initialised
with random weights from a fixed seed (deferred initialisation finished on a
one-sample batch, so that no full-size FP32 pass counts in a mode's memory),
one batch of inputs and, for training, the loss of the network's outputs.
The benchmark converts, hybridizes and times it; nothing here depends on the
mode.

Families (``--networks`` names; default batch, image size)
----------------------------------------------------------
``classifier``    gluoncv model-zoo classifiers (any name not below, e.g.
                  ``resnet50_v1``) and ``tiny`` (a few conv/BN/ReLU layers, for
                  tests): 1000 classes, softmax cross-entropy; batch 16, 224x224.
``detector``      gluoncv SSD (``ssd_512_resnet50_v1_voc``, any ``ssd_*`` name):
                  ``SSDMultiBoxLoss`` on targets that gluoncv's
                  ``SSDTargetGenerator`` makes from random boxes (3 an image), as
                  gluoncv's ``train_ssd.py`` makes them in its data transform;
                  batch 8, the size in its name (512).
``segmentation``  gluoncv FCN (``fcn_resnet50_voc``, any ``fcn_*`` name), built for
                  the image size (``crop_size``), with its auxiliary head:
                  ``MixSoftmaxCrossEntropyLoss`` on random per-pixel labels; batch 4,
                  480x480.
``forecaster``    a GluonTS estimator's training network (``deepar``: DeepAR with
                  2 LSTM layers of 40 cells; ``mqcnn``, ``nbeats``, ``tft`` and the
                  others of ``scripts/gluonts_estimators.py``, with their own
                  defaults; 48 hours of context, 24 predicted) on synthetic hourly
                  series (sines and noise), called as GluonTS's trainer calls it,
                  its output (its first) the loss; Adam as GluonTS's trainer sets
                  it up; batch 32.  Training only: predictions come from another
                  network.
``lstm_lm``       gluonnlp's ``standard_lstm_lm_200`` on a 10,000-word
                  vocabulary, 35 random tokens a sequence, softmax cross-entropy
                  on the decoder's output; batch 20.  Never hybridized (its
                  ``hybrid_forward`` calls ``nd.Dropout``; mxamp converts its
                  parts).
``mlp``           a tabular MLP, 64 features -> 128 -> 128 -> 10 classes with
                  ReLU, softmax cross-entropy; batch 256.
``bert``          gluonnlp's BERT-base (``bert_12_768_12``: 12 layers of 768, 12
                  heads, on a 30,522-token vocabulary, the size of BERT's
                  uncased English one) in ``BERTClassifier`` (2 classes, dropout
                  0.1), initialised as BERT is, ``Normal(0.02)``: a fine-tuning
                  step on sentence pairs of 128 random tokens (segment 0, then
                  1; every token valid), softmax cross-entropy on 2 random
                  labels; Adam, lr 1e-5; batch 8.  Inference: the classifier's
                  forward.
``transformer``   gluonnlp's ``transformer_en_de_512`` (6 + 6 layers of 512, 8
                  heads, feed-forward 2048, source and target embeddings and
                  output projection tied) on a 32,000-token shared vocabulary
                  (WMT English-German's shared BPE vocabularies are of that
                  size: about 37,000 tokens in Vaswani et al. 2017), the
                  ``NMTModel`` built as ``transformer_en_de_512`` builds it,
                  Xavier (magnitude 3, as gluonnlp's ``train_transformer.py``):
                  a teacher-forced step on random sentence pairs of 32 source
                  and 32 target tokens (every token valid), gluonnlp's
                  ``MaskedSoftmaxCELoss`` on the next target tokens (as its
                  machine-translation scripts, without label smoothing); Adam,
                  lr 1e-5; batch 16 (a few seconds an FP32 step on 2 cores).
                  Inference: the same teacher-forced forward (the scores of
                  every target position), not beam search.  Run as
                  `TeacherForcedTranslation`, one graph (why: its docstring).
"""
import warnings
from collections import namedtuple

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import gluonts_estimators

HYBRIDIZE = {'static_alloc': True, 'static_shape': True}
# Tiny learning rate: random weights must not drift to inf/NaN during the run.
SGD = ('sgd', {'learning_rate': 1e-4, 'momentum': 0.9, 'wd': 1e-5})
# What gluonts.mx.Trainer gives its Adam by default.
ADAM = ('adam', {'learning_rate': 1e-3, 'wd': 1e-8, 'clip_gradient': 10.0})
# BERT's and the Transformer's: a fine-tuning learning rate, MXNet's Adam defaults otherwise
# (betas 0.9 and 0.999, epsilon 1e-8, no weight decay), which are torch.optim.Adam's, as
# scripts/torch_peer.py runs its peers.
FINE_TUNING_ADAM = ('adam', {'learning_rate': 1e-5})
SEED = 0

Setup = namedtuple('Setup', 'net inputs one loss')
Setup.__doc__ = """One network, ready to convert and time.

Attributes
----------
net : mxnet.gluon.Block
    The FP32 network, initialised.
inputs : tuple of NDArray
    One batch: the network's arguments, in order.
one : tuple of NDArray
    The same for one sample (what finished deferred initialisation).
loss : callable or None
    The network's outputs -> the loss of each sample; None for inference.
"""

Family = namedtuple('Family', 'name package sample counts batch image_size no_graph optimizer '
                              'loss_name no_inference setup unfit_modes', defaults=(None,))
Family.__doc__ = """What the benchmark needs to know of a family of networks.

Attributes
----------
name : str
    The family's name.
package : str or None
    The package that provides its networks (the JSON records its version).
sample : str
    The throughput's unit: ``'img'`` for img/s.
counts : str
    What one sample is, for the table's notes.
batch : int
    The default batch.
image_size : int or None
    The default image size; None: the input is no image.
no_graph : str or None
    Why the network cannot become one graph (it is hybridized in no mode); None
    when it can (it is hybridized in every mode).
optimizer : (str, dict)
    The training optimizer's name and parameters.
loss_name : str
    The loss, for the JSON.
no_inference : str or None
    Why inference is not measured; None when it is.
setup : callable
    ``setup(network, batch, image_size, training)`` -> `Setup`.
unfit_modes : dict or None
    The modes known to fail on the family's networks, each with why (one line): the
    benchmark skips them, with that reason.  None: none known.
"""


def _seed():
    mx.random.seed(SEED)
    np.random.seed(SEED)
    return np.random.RandomState(SEED)


def _initialize(net, init=None):
    # gluoncv's FeatureExpander (SSD's extra layers) gives its BatchNorms' parameters no
    # initializer of their own: a global Xavier would be applied to those vectors and fail.
    for name, param in net.collect_params().items():
        if param.init is None and name.endswith(('gamma', 'var')):
            param.init = 'ones'
        elif param.init is None and name.endswith(('beta', 'mean')):
            param.init = 'zeros'
    # force_reinit: gluoncv's FCN initialises its heads itself; every layer starts from `init`.
    net.initialize(init or mx.init.Xavier(magnitude=2), ctx=mx.cpu(), force_reinit=True)
    return net


def _images(batch, image_size):
    return mx.nd.random.uniform(-1, 1, shape=(batch, 3, image_size, image_size))


def _finish(setup):
    """`setup`, its network's deferred initialisation finished on one sample."""
    setup.net(*setup.one)
    mx.nd.waitall()
    return setup


def _cross_entropy(labels, output=lambda outputs: outputs, hybridize=True, batch_axis=0):
    """Softmax cross-entropy of ``output(outputs)`` against `labels`, one value a sample."""
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss(batch_axis=batch_axis)
    if hybridize:
        loss_fn.hybridize(**HYBRIDIZE)
    return lambda outputs: loss_fn(output(outputs), labels)


# --------------------------------------------------------------------------
# Image classifiers

def _tiny_net(classes):
    net = gluon.nn.HybridSequential(prefix='tiny_')
    with net.name_scope():
        net.add(gluon.nn.Conv2D(16, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
                gluon.nn.Activation('relu'), gluon.nn.MaxPool2D(2),
                gluon.nn.Conv2D(32, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
                gluon.nn.Activation('relu'), gluon.nn.GlobalAvgPool2D(),
                gluon.nn.Dense(classes))
    return net


def _classifier(network, batch, image_size, training, classes=1000):
    rng = _seed()
    if network == 'tiny':
        net = _tiny_net(classes)
    else:
        from gluoncv.model_zoo import get_model
        net = get_model(network, classes=classes, pretrained=False)
    _initialize(net)
    x = _images(batch, image_size)
    labels = mx.nd.array(rng.randint(0, classes, size=batch))
    return _finish(Setup(net, (x,), (x[:1],), _cross_entropy(labels) if training else None))


# --------------------------------------------------------------------------
# Detection and segmentation (gluoncv)

def _random_boxes(rng, batch, image_size, count=3):
    """`count` boxes an image, corners in pixels, and their class ids (VOC's 20)."""
    corner = rng.uniform(0, 0.6 * image_size, (batch, count, 2))
    extent = rng.uniform(0.1 * image_size, 0.4 * image_size, (batch, count, 2))
    return (mx.nd.array(np.concatenate([corner, corner + extent], axis=-1)),
            mx.nd.array(rng.randint(0, 20, (batch, count, 1))))


def _detector(network, batch, image_size, training):
    from gluoncv.loss import SSDMultiBoxLoss
    from gluoncv.model_zoo import get_model
    from gluoncv.model_zoo.ssd.target import SSDTargetGenerator
    rng = _seed()
    net = _initialize(get_model(network, pretrained=False, pretrained_base=False))
    x = _images(batch, image_size)
    # In training mode SSD returns its anchors too (this also finishes initialisation).
    with autograd.train_mode():
        anchors = net(x[:1])[2]
    mx.nd.waitall()
    if not training:
        return Setup(net, (x,), (x[:1],), None)
    # train_ssd.py's transform: SSDDefaultTrainTransform's generator, no hard negative mining.
    generator = SSDTargetGenerator(iou_thresh=0.5, stds=(0.1, 0.1, 0.2, 0.2),
                                   negative_mining_ratio=-1)
    cls_targets, box_targets, _ = generator(anchors, None, *_random_boxes(rng, batch, image_size))
    loss_fn = SSDMultiBoxLoss()

    def loss(outputs):
        cls_preds, box_preds, _ = outputs
        # One device: the loss takes and returns a list per device.
        return loss_fn([cls_preds], [box_preds], [cls_targets], [box_targets])[0][0]
    return Setup(net, (x,), (x[:1],), loss)


def _segmentation(network, batch, image_size, training):
    from gluoncv.loss import MixSoftmaxCrossEntropyLoss
    from gluoncv.model_zoo import get_model
    rng = _seed()
    # FCN upsamples to crop_size, whatever the input's size: build it for the images'.
    net = _initialize(get_model(network, pretrained=False, pretrained_base=False,
                                crop_size=image_size))
    x = _images(batch, image_size)
    labels = mx.nd.array(rng.randint(0, net.nclass, (batch, image_size, image_size)))
    # Not hybridized: its hybrid_forward reads pred.dtype, which a Symbol does not have.
    loss_fn = MixSoftmaxCrossEntropyLoss(aux=net.aux)
    return _finish(Setup(net, (x,), (x[:1],),
                         (lambda outputs: loss_fn(*outputs, labels)) if training else None))


# --------------------------------------------------------------------------
# Forecasting, language model, tabular

def _forecaster(network, batch, image_size, training):
    """A GluonTS estimator's training network (`gluonts_estimators.MODELS`) on a batch of its
    training loader, called as GluonTS's trainer calls it: the batch's fields that its
    ``hybrid_forward`` names, in that order; the loss is its output, or its first
    (`_forecast_loss`)."""
    from gluonts.dataset.common import ListDataset
    from gluonts.mx.trainer import Trainer
    from gluonts.mx.util import get_hybrid_forward_input_names
    rng = _seed()
    with warnings.catch_warnings():
        # pandas deprecates the 'H' frequency that GluonTS 0.17's own examples use.
        warnings.simplefilter('ignore', FutureWarning)
        estimator = gluonts_estimators.estimator(network, Trainer(), batch_size=batch)
        dataset = ListDataset(gluonts_estimators.hourly_series(rng, 16, 24 * 28), freq='H')
        loader = estimator.create_training_data_loader(
            estimator.create_transformation().apply(dataset))
        fields = next(iter(loader))
    # GluonTS's trainer initialises with its default, 'xavier'.
    net = _initialize(estimator.create_training_network(), mx.init.Xavier())
    inputs = tuple(fields[name] for name in get_hybrid_forward_input_names(type(net)))
    return _finish(Setup(net, inputs, tuple(x[:1] for x in inputs),
                         _forecast_loss if training else None))


def _forecast_loss(outputs):
    """Each sample's loss, its terms summed (MQ-CNN gives one a predicted hour), or the
    batch's where the network gives one (the Transformer, TFT): the gradient GluonTS's
    trainer takes, which calls ``backward`` on the whole output."""
    loss = outputs if isinstance(outputs, mx.nd.NDArray) else outputs[0]
    return loss.reshape((0, -1)).sum(axis=1) if loss.ndim > 1 else loss


def _lstm_lm(network, batch, image_size, training, bptt=35, words=10000):
    import gluonnlp as nlp
    rng = _seed()
    vocab = nlp.Vocab(nlp.data.count_tokens([str(i) for i in range(words)]))
    net = _initialize(nlp.model.standard_lstm_lm_200(vocab=vocab, pretrained=False)[0])
    tokens = mx.nd.array(rng.randint(0, len(vocab), (bptt, batch)))
    targets = mx.nd.array(rng.randint(0, len(vocab), (bptt, batch)))
    # Time-major: the decoder's scores are (sequence, batch, vocabulary), a sample a column.
    loss = _cross_entropy(targets, lambda outputs: outputs[0], hybridize=False, batch_axis=1)
    return _finish(Setup(net, (tokens,), (tokens[:, :1],), loss if training else None))


def _mlp(network, batch, image_size, training, features=64, classes=10):
    rng = _seed()
    net = gluon.nn.HybridSequential(prefix='mlp_')
    with net.name_scope():
        net.add(gluon.nn.Dense(128, activation='relu'), gluon.nn.Dense(128, activation='relu'),
                gluon.nn.Dense(classes))
    _initialize(net)
    x = mx.nd.random.uniform(-1, 1, shape=(batch, features))
    labels = mx.nd.array(rng.randint(0, classes, size=batch))
    return _finish(Setup(net, (x,), (x[:1],), _cross_entropy(labels) if training else None))


# --------------------------------------------------------------------------
# Transformers (gluonnlp): BERT-base, the WMT English-German Transformer

def _vocab(size):
    """A gluonnlp Vocab of `size` tokens, built offline: numbered words and the four special
    tokens `nlp.Vocab` adds (unknown, padding, begin and end of sequence)."""
    import gluonnlp as nlp
    vocab = nlp.Vocab(nlp.data.count_tokens([str(i) for i in range(size - 4)]))
    if len(vocab) != size:
        raise RuntimeError('gluonnlp made a vocabulary of %d tokens, not %d' % (len(vocab), size))
    return vocab


def _tokens(rng, vocab, *shape):
    return mx.nd.array(rng.randint(0, len(vocab), shape))


def _bert(network, batch, image_size, training, length=128, vocabulary=30522, classes=2):
    import gluonnlp as nlp
    rng = _seed()
    vocab = _vocab(vocabulary)
    bert, _ = nlp.model.get_model('bert_12_768_12', dataset_name=None, vocab=vocab,
                                  pretrained=False, use_pooler=True, use_decoder=False,
                                  use_classifier=False)
    # BERT's own initialisation (a normal of deviation 0.02; gluonnlp's layers set theirs for
    # the biases and LayerNorms).
    net = _initialize(nlp.model.BERTClassifier(bert, num_classes=classes, dropout=0.1),
                      mx.init.Normal(0.02))
    tokens = _tokens(rng, vocab, batch, length)
    # A sentence pair a sequence: its first half segment 0, its second segment 1.
    segments = mx.nd.array(np.broadcast_to(np.arange(length) >= length // 2, (batch, length)),
                           dtype='float32')
    # Every token valid: the attention is the same dense computation as a padded batch's, and
    # the PyTorch peer's (no mask) computes the same.
    valid_length = mx.nd.full((batch,), length)
    labels = mx.nd.array(rng.randint(0, classes, size=batch))
    inputs = (tokens, segments, valid_length)
    return _finish(Setup(net, inputs, tuple(x[:1] for x in inputs),
                         _cross_entropy(labels) if training else None))


class TeacherForcedTranslation(gluon.HybridBlock):
    """gluonnlp 0.10's ``NMTModel.forward`` (the teacher-forced pass its training runs), as
    one graph: the scores of each target position, given the source and the targets before.

    ``NMTModel`` is a plain ``Block``: its forward makes the decoder's memory mask with
    ``mx.nd`` (``init_state_from_encoder``), between the encoder's graph and the decoder's.
    This block calls the model's own blocks (embeddings, encoder, decoder, projection) with
    the same arguments, and makes that mask with the graph's operators: its outputs are the
    model's (tests/test_benchmark.py compares them), and every mode of the benchmark runs
    one graph, as BERT's.  (``mxamp.convert`` of the ``NMTModel`` itself converts it in
    part, since its decoder takes a list of states: its cells become graphs, the decoder and
    the model run their Python code.)

    Parameters
    ----------
    nmt : gluonnlp.model.translation.NMTModel
        The model; this block holds its blocks, not the model (a HybridBlock's children
        are HybridBlocks).  Its one-step decoder, for beam search, is not used.
    """

    def __init__(self, nmt, **kwargs):
        super(TeacherForcedTranslation, self).__init__(**kwargs)
        # The model's blocks, under their own names (``tgt_embed`` is ``src_embed``: shared).
        self.src_embed, self.encoder = nmt.src_embed, nmt.encoder
        self.tgt_embed, self.decoder, self.tgt_proj = nmt.tgt_embed, nmt.decoder, nmt.tgt_proj

    def hybrid_forward(self, F, src_seq, tgt_seq, src_valid_length, tgt_valid_length):
        """The scores, (batch, target length, vocabulary), as ``NMTModel(...)[0]``."""
        memory, _ = self.encoder(self.src_embed(src_seq), None, src_valid_length)
        positions = F.contrib.arange_like(memory, axis=1)
        memory_mask = F.broadcast_lesser(positions.reshape((1, -1)),
                                         src_valid_length.reshape((-1, 1)))
        outputs, _, _ = self.decoder(self.tgt_embed(tgt_seq), [memory, memory_mask],
                                     tgt_valid_length)
        return self.tgt_proj(outputs)


def nmt_model(vocab, **overrides):
    """The ``NMTModel`` that gluonnlp's ``transformer_en_de_512`` builds, on `vocab` (source
    and target), its hyper-parameters replaced by `overrides` (a smaller one for tests).

    ``transformer_en_de_512`` itself needs a dataset name (its vocabularies come from
    it): the same construction, from its hyper-parameters.
    """
    from gluonnlp.model.transformer import (get_transformer_encoder_decoder,
                                            transformer_en_de_hparams)
    from gluonnlp.model.translation import NMTModel
    config = dict(transformer_en_de_hparams, **overrides)
    encoder, decoder, one_step_decoder = get_transformer_encoder_decoder(
        units=config['num_units'], hidden_size=config['hidden_size'],
        dropout=config['dropout'], num_layers=config['num_layers'],
        num_heads=config['num_heads'], max_src_length=530, max_tgt_length=549,
        scaled=config['scaled'])
    return NMTModel(src_vocab=vocab, tgt_vocab=vocab, encoder=encoder, decoder=decoder,
                    one_step_ahead_decoder=one_step_decoder, share_embed=config['share_embed'],
                    embed_size=config['embed_size'], tie_weights=config['tie_weights'],
                    embed_initializer=config['embed_initializer'], prefix='transformer_')


def _transformer(network, batch, image_size, training, length=32, vocabulary=32000):
    import gluonnlp as nlp
    rng = _seed()
    vocab = _vocab(vocabulary)
    net = _initialize(TeacherForcedTranslation(nmt_model(vocab)), mx.init.Xavier(magnitude=3))
    source = _tokens(rng, vocab, batch, length)
    # The decoder reads a target's first `length` tokens and scores each next one.
    target = _tokens(rng, vocab, batch, length + 1)
    target_in, target_out = target[:, :-1], target[:, 1:]
    valid_length = mx.nd.full((batch,), length)
    loss_fn = nlp.loss.MaskedSoftmaxCELoss()
    loss_fn.hybridize(**HYBRIDIZE)
    inputs = (source, target_in, valid_length, valid_length)
    return _finish(Setup(net, inputs, tuple(x[:1] for x in inputs),
                         (lambda outputs: loss_fn(outputs, target_out, valid_length))
                         if training else None))


# What MXNet 1.9.1's contrib.amp meets in BERT, in training (amp.init) as in inference
# (convert_hybrid_block).
BERT_CONTRIB_AMP = ("MXNet's bfloat16 AMP lists leave out gluonnlp's fused self-attention "
                    "(_contrib_interleaved_matmul_selfatt_valatt), which then gets bfloat16 and "
                    "float32 inputs and fails: 'Incompatible attr ... expected bfloat16, got "
                    "float32'")

CLASSIFIER = Family('classifier', 'gluoncv', 'img', 'images', 16, 224, None, SGD,
                    'SoftmaxCrossEntropyLoss', None, _classifier)
DETECTOR = Family('detector', 'gluoncv', 'img', 'images', 8, 512, None, SGD,
                  'gluoncv.loss.SSDMultiBoxLoss', None, _detector)
SEGMENTATION = Family('segmentation', 'gluoncv', 'img', 'images', 4, 480, None, SGD,
                      'gluoncv.loss.MixSoftmaxCrossEntropyLoss', None, _segmentation)
NAMED = {
    'lstm_lm': Family('lstm_lm', 'gluonnlp', 'seq', 'sequences of 35 tokens', 20, None,
                      'its hybrid_forward calls nd.Dropout', SGD, 'SoftmaxCrossEntropyLoss', None,
                      _lstm_lm),
    'mlp': Family('mlp', None, 'rows', 'rows of 64 features', 256, None, None, SGD,
                  'SoftmaxCrossEntropyLoss', None, _mlp),
    'bert': Family('bert', 'gluonnlp', 'seq', 'sentence pairs of 128 tokens', 8, None, None,
                   FINE_TUNING_ADAM, 'SoftmaxCrossEntropyLoss', None, _bert,
                   {'contrib.amp': BERT_CONTRIB_AMP}),
    'transformer': Family('transformer', 'gluonnlp', 'pair',
                          'sentence pairs of 32 source and 32 target tokens', 16, None, None,
                          FINE_TUNING_ADAM, 'gluonnlp.loss.MaskedSoftmaxCELoss', None,
                          _transformer),
}


FORECASTER = Family('forecaster', 'gluonts', 'series',
                    'series windows (48 hours of context, 24 predicted)', 32, None, None, ADAM,
                    "the network's output (its first)", 'its forecasts come from another '
                    'network (the estimator\'s prediction network): training only', _forecaster)


def family_of(network):
    """The `Family` of a ``--networks`` name (defaults for that network)."""
    if network in NAMED:
        return NAMED[network]
    if network in gluonts_estimators.MODELS:
        return FORECASTER
    if network.startswith('ssd_'):
        size = network.split('_')[1]
        return DETECTOR._replace(image_size=int(size)) if size.isdigit() else DETECTOR
    if network.startswith('fcn_'):
        return SEGMENTATION
    return CLASSIFIER
