"""Networks that cannot become one graph: their largest parts that can are converted.

A block whose ``hybrid_forward`` calls ``mx.nd`` (gluonnlp's language models
call ``nd.Dropout``), or a plain ``Block``, cannot be hybridized; contrib.amp
patches operators and runs such nets.  ``mxamp.convert`` converts each
largest subtree that becomes a graph, leaves the blocks above them in FP32,
says which and why (`summary`), and the net trains with `mxamp.Trainer` and
checkpoints in FP32 like a converted one.
"""

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import mxamp
from mxamp.dtypes import dtype_name, to_float32_numpy
from mxamp.network_state import Stage, state_of
from mxamp.profiling import ProfileError

from conftest import convert_quietly, relative_error

DTYPES = ['bfloat16', 'float16']


class _CallsNd(gluon.HybridBlock):
    """Features and an output layer, with ``mx.nd`` called between them."""

    def __init__(self, **kwargs):
        super(_CallsNd, self).__init__(**kwargs)
        with self.name_scope():
            self.features = nn.HybridSequential()
            self.features.add(nn.Conv2D(16, 3, padding=1, in_channels=16), nn.BatchNorm(in_channels=16),
                              nn.Activation('relu'), nn.GlobalAvgPool2D())
            self.dropout = nn.Dropout(0.1)
            self.output = nn.Dense(10, in_units=16)

    def hybrid_forward(self, F, x):
        features = self.features(x)
        # Not F: an NDArray call, as gluonnlp's language models make.
        features = mx.nd.Dropout(features, p=0.1)
        return self.output(self.dropout(features))


class _PlainBlock(gluon.Block):
    """A Block (not hybrid) holding HybridBlocks."""

    def __init__(self, **kwargs):
        super(_PlainBlock, self).__init__(**kwargs)
        with self.name_scope():
            self.body = nn.HybridSequential()
            self.body.add(nn.Dense(16, in_units=8, activation='relu'))
            self.head = nn.Dense(4, in_units=16)

    def forward(self, x):
        return self.head(self.body(x) * 2)


class _StatesDecoder(gluon.HybridBlock):
    """A decoder whose input is a list of states, as gluonnlp's ``TransformerDecoder``: MXNet
    hybridizes it (it flattens lists of inputs), mxamp's symbolic trace (one symbol an
    argument) cannot.  Its cell converts; its own code reads the output weight it shares with
    the embedding (tied weights)."""

    def __init__(self, **kwargs):
        super(_StatesDecoder, self).__init__(**kwargs)
        with self.name_scope():
            self.cell = nn.Dense(16, in_units=16, flatten=False)
        # Created with params=embedding.params, as gluonnlp ties weights: the embedding's.
        self.output_weight = self.params.get('weight', shape=(16, 8))

    def hybrid_forward(self, F, x, states, output_weight):
        memory, mask = states
        return F.dot(self.cell(F.broadcast_add(x, memory)) * mask, output_weight)


class _Seq2Seq(gluon.Block):
    """The pattern of gluonnlp's ``NMTModel``: a Block holding an embedding and a decoder
    mxamp cannot trace, tied by a parameter."""

    def __init__(self, **kwargs):
        super(_Seq2Seq, self).__init__(**kwargs)
        with self.name_scope():
            self.embed = nn.Dense(16, in_units=8, flatten=False)
            self.decoder = _StatesDecoder(params=self.embed.params)

    def forward(self, x, memory):
        return self.decoder(self.embed(x), [memory, mx.nd.ones_like(memory)])


def _seq2seq(seed=0):
    mx.random.seed(seed)
    net = _Seq2Seq(prefix='seq2seq_')
    net.initialize(mx.init.Xavier())
    return net


def _seq2seq_batch(seed=0):
    rng = np.random.RandomState(seed)
    return (mx.nd.array(rng.uniform(-1, 1, (4, 5, 8)).astype('f4')),
            mx.nd.array(rng.uniform(-1, 1, (4, 5, 16)).astype('f4')),
            mx.nd.array(rng.randint(0, 8, (4, 5))))


def _net(seed=0):
    mx.random.seed(seed)
    net = _CallsNd(prefix='callsnd_')
    net.initialize(mx.init.Xavier())
    return net


def _batch(seed=0):
    rng = np.random.RandomState(seed)
    return (mx.nd.array(rng.uniform(-1, 1, (8, 16, 8, 8)).astype('f4')),
            mx.nd.array(rng.randint(0, 10, 8)))


@pytest.mark.parametrize('dtype', DTYPES)
def test_the_largest_parts_that_become_graphs_are_converted_and_reported(dtype):
    net = convert_quietly(_net(), dtype)
    state = state_of(net)
    assert state.stage is Stage.CONVERTED_IN_PART and state.precision == dtype
    assert [path for path, _ in state.parts] == ['features', 'output']
    assert mxamp.gluon.is_converted(net.features) and mxamp.gluon.is_converted(net.output)
    assert not mxamp.gluon.is_converted(net) and not mxamp.gluon.is_converted(net.dropout)
    assert dtype_name(net.features[0].weight.dtype) == dtype
    assert dtype_name(net.output.weight.dtype) == dtype
    assert dtype_name(net.features[1].gamma.dtype) == 'float32'
    text = mxamp.summary(net, print_fn=None)
    assert text.startswith("mxamp summary: _CallsNd 'callsnd' converted to %s in part" % dtype)
    assert "(the net itself) (_CallsNd 'callsnd'): AssertionError: Argument data must have " \
        "NDArray type" in text
    assert 'part features:' in text and 'part output:' in text
    with pytest.raises(ValueError, match="_CallsNd 'callsnd' is already converted in part by "
                                         "mxamp \\(to %s\\)" % dtype):
        mxamp.convert(net, dtype)


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_net_converted_in_part_computes_and_trains_as_in_fp32(dtype):
    x, y = _batch()
    reference, net = _net(), _net()
    with autograd.predict_mode():
        want = reference(x).asnumpy()
    convert_quietly(net, dtype)
    with autograd.predict_mode():
        got = net(x)
    assert got.dtype == np.float32
    # Measured on an AMD EPYC with avx512_bf16: 0.0044 (bfloat16), 0.0008 (float16).
    assert relative_error(to_float32_numpy(got), want) < 0.05
    trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.5, 'momentum': 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(20):
        with autograd.record():
            loss = loss_fn(net(x), y)
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        trainer.step(x.shape[0])
        losses.append(float(loss.mean().asscalar()))
    # It learns its batch.  Last over first loss, seeds 0-2 (AMD EPYC with avx512_bf16):
    # FP32 0.010-0.047, bfloat16 0.009-0.047, float16 0.006-0.121.
    assert losses[-1] < 0.3 * losses[0], losses


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_net_converted_in_part_checkpoints_in_fp32(dtype, tmp_path):
    x, _ = _batch()
    net = convert_quietly(_net(), dtype)
    with autograd.predict_mode():
        out = to_float32_numpy(net(x))
    path = str(tmp_path / 'net.params')
    net.save_parameters(path)
    assert all(value.dtype == np.float32 for value in mx.nd.load(path).values())
    plain = _CallsNd(prefix='callsnd_')
    plain.load_parameters(path)
    with autograd.predict_mode():
        assert relative_error(plain(x).asnumpy(), out) < 0.05
    again = convert_quietly(_net(seed=1), dtype)
    again.load_parameters(path)
    assert dtype_name(again.output.weight.dtype) == dtype
    with autograd.predict_mode():
        np.testing.assert_array_equal(to_float32_numpy(again(x)), out)
    with pytest.raises(TypeError, match='converted in part by mxamp'):
        net.cast('float32')


def test_a_plain_block_holding_hybrid_blocks_converts_in_part():
    mx.random.seed(0)
    net = _PlainBlock(prefix='plain_')
    net.initialize()
    x = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, (4, 8)))
    want = net(x).asnumpy()
    convert_quietly(net, 'bfloat16')
    assert [path for path, _ in state_of(net).parts] == ['body', 'head']
    assert "(the net itself) (_PlainBlock 'plain'): a Block, not a HybridBlock" in \
        mxamp.summary(net, print_fn=None)
    assert relative_error(to_float32_numpy(net(x)), want) < 0.05


@pytest.mark.parametrize('dtype', DTYPES)
def test_a_block_above_converted_parts_hybridizes_trains_and_checkpoints(dtype, tmp_path):
    """The decoder stays FP32 and holds a converted part: hybridized, it keeps running its
    code on NDArrays (one graph of it would read its part's parameters as FP32), and the
    weight its own code reads stays FP32."""
    x, memory, labels = _seq2seq_batch()
    reference, net = _seq2seq(), _seq2seq()
    want = reference(x, memory).asnumpy()
    convert_quietly(net, dtype)
    assert [path for path, _ in state_of(net).parts] == ['embed', 'decoder.cell']
    assert dtype_name(net.decoder.cell.weight.dtype) == dtype
    assert net.decoder.output_weight is net.embed.weight
    assert dtype_name(net.embed.weight.dtype) == 'float32'
    unhybridized = to_float32_numpy(net(x, memory))
    net.hybridize()
    np.testing.assert_array_equal(to_float32_numpy(net(x, memory)), unhybridized)
    # Measured on an AMD EPYC with avx512_bf16, seeds 0-3: 0.002-0.004 (bfloat16), 0.0002
    # (float16).
    assert relative_error(unhybridized, want) < 0.05
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    deltas = []
    for model, trainer in ((reference, gluon.Trainer(reference.collect_params(), 'sgd',
                                                       {'learning_rate': 0.5})),
                           (net, mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.5},
                                               loss_scale=1.0))):
        before = {name: to_float32_numpy(p.data()) for name, p in model.collect_params().items()}
        with autograd.record():
            loss = loss_fn(model(x, memory), labels)
        loss.backward()
        trainer.step(x.shape[0])
        deltas.append({name: to_float32_numpy(p.data()) - before[name]
                       for name, p in model.collect_params().items()})
    for name, step in deltas[0].items():
        # The stored weight's change, rounded to its dtype.  Measured on an AMD EPYC with
        # avx512_bf16, seeds 0-3: worst 0.017 (bfloat16), 0.002 (float16), the cell's weight.
        assert np.linalg.norm(deltas[1][name] - step) < 0.1 * np.linalg.norm(step), name
    with autograd.predict_mode():
        out = to_float32_numpy(net(x, memory))
    path = str(tmp_path / 'seq2seq.params')
    net.save_parameters(path)
    assert all(value.dtype == np.float32 for value in mx.nd.load(path).values())
    plain = _Seq2Seq(prefix='seq2seq_')
    plain.load_parameters(path)
    assert relative_error(plain(x, memory).asnumpy(), out) < 0.05


def test_a_block_above_converted_parts_hybridized_before_convert_or_replaced():
    x, memory, _ = _seq2seq_batch()
    net = _seq2seq()
    want = net(x, memory).asnumpy()
    net.decoder.hybridize()
    net(x, memory)                    # its FP32 graph is built and cached
    convert_quietly(net, 'bfloat16')
    net.decoder.hybridize()
    assert relative_error(to_float32_numpy(net(x, memory)), want) < 0.05
    # Replaced, the decoder is an FP32 block like any child added later to a block that
    # stays FP32.
    decoder = _StatesDecoder(params=net.embed.params)
    decoder.cell.initialize()
    net.decoder = decoder
    assert net.decoder is decoder and not mxamp.gluon.is_converted(decoder.cell)
    net.hybridize()
    assert net(x, memory).shape == (4, 5, 8)


def test_nothing_that_becomes_a_graph_is_refused_with_the_reason():
    class Nothing(gluon.Block):
        def forward(self, x):
            return x * 2
    with pytest.raises(TypeError, match=r"no part of Nothing '.*' becomes a graph \(a Block, "
                                        r"not a HybridBlock"):
        mxamp.convert(Nothing(), 'bfloat16')

    class Leaf(gluon.HybridBlock):
        def hybrid_forward(self, F, x):
            return mx.nd.relu(x)
    with pytest.raises(TypeError, match="Leaf '.*' cannot be turned into a graph"):
        mxamp.convert(Leaf(), 'bfloat16')


def test_fusing_and_profiling_need_one_graph_and_say_so():
    x, _ = _batch()
    with pytest.raises(TypeError, match="for_inference fuses one graph, and _CallsNd 'callsnd' "
                                        "cannot become one: AssertionError"):
        mxamp.for_inference(_net(), x)
    net = convert_quietly(_net(), 'bfloat16')
    with pytest.raises(TypeError, match=r"converted in part\): call it on each converted part "
                                        r"\(features, output\)"):
        mxamp.for_inference(net, x)
    with pytest.raises(ProfileError, match=r"profile each converted part \(features, output\)"):
        mxamp.profile(net, x, kernels=False)


def test_gluonnlp_standard_lstm_lm_650_converts_in_part_and_trains():
    """gluonnlp 0.10's StandardRNN calls nd.Dropout in hybrid_forward: embedding, LSTM and
    decoder (its weight tied to the embedding's) convert; the model trains."""
    nlp = pytest.importorskip('gluonnlp')
    vocab = nlp.Vocab(nlp.data.count_tokens(['w%d' % i for i in range(200)]))
    mx.random.seed(0)
    net, _ = nlp.model.standard_lstm_lm_650(vocab=vocab, pretrained=False)
    net.initialize(mx.init.Xavier())
    rng = np.random.RandomState(0)
    tokens = mx.nd.array(rng.randint(0, len(vocab), (12, 4)))
    targets = mx.nd.array(rng.randint(0, len(vocab), (12, 4)))
    with autograd.predict_mode():
        want = net(tokens)[0].asnumpy()
    convert_quietly(net, 'bfloat16')
    state = state_of(net)
    assert [path for path, _ in state.parts] == ['embedding', 'encoder', 'decoder']
    tied = net.embedding[0].weight
    assert net.decoder[0].weight is tied and dtype_name(tied.dtype) == 'float32'
    # No CPU computes MXNet's RNN operator in bfloat16: its weights stay FP32.
    assert dtype_name(net.encoder.l0_i2h_weight.dtype) == 'float32'
    assert dtype_name(net.decoder[0].bias.dtype) == 'bfloat16'
    with autograd.predict_mode():
        # Measured on an AMD EPYC with avx512_bf16: 0.004.
        assert relative_error(to_float32_numpy(net(tokens)[0]), want) < 0.05
    trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 1.0})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(6):
        with autograd.record():
            loss = loss_fn(net(tokens)[0], targets)
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        assert trainer.step(tokens.size)
        losses.append(float(loss.mean().asscalar()))
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize('dtype', ['bfloat16', 'auto'])
def test_gluonnlp_transformer_nmt_model_converts_in_part_and_trains_hybridized(dtype):
    """gluonnlp 0.10's NMTModel, built as ``transformer_en_de_512`` builds it (smaller): its
    TransformerDecoder takes a list of states, so its cells convert and it stays FP32;
    hybridized, as gluonnlp's scripts do, it runs as unhybridized and trains."""
    nlp = pytest.importorskip('gluonnlp', reason='the NMTModel test needs gluonnlp 0.10')
    vocab = nlp.Vocab(nlp.data.count_tokens(['w%d' % i for i in range(100)]))
    mx.random.seed(0)
    encoder, decoder, one_step_ahead_decoder = \
        nlp.model.transformer.get_transformer_encoder_decoder(
            num_layers=2, units=64, hidden_size=128, num_heads=4, dropout=0.0, max_src_length=32,
            max_tgt_length=32, scaled=True, prefix='transformer_')
    net = nlp.model.translation.NMTModel(
        src_vocab=vocab, tgt_vocab=vocab, encoder=encoder, decoder=decoder,
        one_step_ahead_decoder=one_step_ahead_decoder, embed_size=64, share_embed=True,
        tie_weights=True, embed_initializer=None, prefix='transformer_')
    net.initialize(mx.init.Xavier())
    rng = np.random.RandomState(0)
    source = mx.nd.array(rng.randint(0, len(vocab), (2, 7)))
    target = mx.nd.array(rng.randint(0, len(vocab), (2, 6)))
    lengths = mx.nd.array([7, 5]), mx.nd.array([6, 4])
    want = net(source, target, *lengths)[0].asnumpy()
    convert_quietly(net, dtype)
    state = state_of(net)
    if state.precision == 'float32':
        pytest.skip("'auto' keeps the net in float32 on this CPU")
    assert 'decoder.transformer_cells.0' in [path for path, _ in state.parts]
    assert 'decoder' in [path for path, _, _ in state.float32_blocks]
    unhybridized = to_float32_numpy(net(source, target, *lengths)[0])
    net.hybridize()
    np.testing.assert_array_equal(to_float32_numpy(net(source, target, *lengths)[0]), unhybridized)
    # Measured on an AMD EPYC with avx512_bf16: 0.007 (bfloat16); 0 ('auto': no layer this
    # small pays for bfloat16 there).
    assert relative_error(unhybridized, want) < 0.05
    trainer = mxamp.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.01})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _ in range(4):
        with autograd.record():
            loss = loss_fn(net(source, target, *lengths)[0], target)
            with trainer.scale_loss(loss) as scaled:
                autograd.backward(scaled)
        assert trainer.step(source.shape[0])
        losses.append(float(loss.mean().asscalar()))
    # It learns its batch.  Measured on an AMD EPYC with avx512_bf16: 4.09 to 1.72 (bfloat16),
    # to 1.68 ('auto').
    assert losses[-1] < 0.6 * losses[0], losses
