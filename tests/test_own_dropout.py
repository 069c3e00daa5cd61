"""mxamp's own dropout (`mxamp.kernels.operators.dropout`) and the pass that puts a converted
training graph's ``Dropout`` on it (`mxamp.kernels.dropout`).

The operator computes MXNet's ``Dropout`` as it trains: each value kept with probability
1 - p and scaled by MXNet's float32 1 / (1 - p), the others x * 0; bfloat16 values scaled in
float32 and rounded once; the gradient dy times the same mask and scale.  Its random bits are
Philox4x32-10's, keyed by a seed each call draws from MXNet's random state: ``mx.random.seed``
repeats them, two calls differ, and the thread count changes nothing.  In a converted bfloat16
network the training graph runs it in place of MXNet's ``Dropout`` (mode 'training', no axes,
0 < p < 1, an operator's output); inference and export keep MXNet's.
"""
import ctypes
import json
import os
import subprocess
import sys
import textwrap

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import mxamp
import mxamp.gluon as mg
from mxamp.dtypes import cast, to_float32_numpy, to_numpy
from mxamp.kernels import dropout as dropout_mod
from mxamp.kernels import operators
from conftest import relative_error

pytestmark = [pytest.mark.skipif(not operators.available(),
                                 reason='own operators off here: %s' % operators.status().reason),
              pytest.mark.usefixtures('quiet_precision_warnings'),
              # mxamp's note that these small layers do not pay for bfloat16 says nothing here.
              pytest.mark.filterwarnings('ignore:mxamp:RuntimeWarning')]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A million values: 5 binomial standard deviations are 0.16% of p = 0.1's kept count.
SHAPE = (16, 256, 256)
SIGMAS = 5.0


def _scale(p):
    """MXNet's scale of the kept values: 1 / (1 - p), in float32 as its Dropout computes it."""
    return np.float32(1) / (np.float32(1) - np.float32(p))


def _round_to_bfloat16(values):
    """float32 `values` rounded to bfloat16 (nearest, ties to even), as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def _data(shape=SHAPE, dtype='float32', seed=0):
    values = np.random.RandomState(seed).normal(size=shape).astype(np.float32)
    return cast(mx.nd.array(values), dtype)


def _kept(mask, shape):
    """The own dropout's mask (one bit a value, bit i % 8 of byte i // 8) as 0/1 of `shape`."""
    bits = to_numpy(mask)
    size = int(np.prod(shape))
    assert bits.dtype == np.uint8 and bits.shape == ((size + 7) // 8,)
    assert not np.unpackbits(bits, bitorder='little')[size:].any()    # the bits past the end
    return np.unpackbits(bits, bitorder='little')[:size].reshape(shape)


def _dropped_out(x, p, head=None):
    """The own dropout's output, kept values (0/1) and data gradient of `x` against `head`:
    numpy, the output and gradient widened to float32 (exactly)."""
    x = x.copy()
    x.attach_grad()
    with autograd.record():
        out, mask = operators.dropout(x, p=p)
    out.backward(head if head is not None else mx.nd.ones_like(out))
    assert out.dtype == x.dtype and x.grad.dtype == x.dtype
    return to_float32_numpy(out), _kept(mask, x.shape), to_float32_numpy(x.grad)


@pytest.mark.parametrize('p', [0.1, 0.5])
def test_the_kept_fraction_is_within_binomial_bounds_everywhere(p):
    mx.random.seed(11)
    _, mask, _ = _dropped_out(_data(), p)
    keep, n = 1 - p, mask.size

    def within(kept, count, probability):
        return abs(kept - count * probability) < SIGMAS * np.sqrt(count * probability *
                                                                  (1 - probability))
    assert within(int(mask.sum()), n, keep)
    # Each position in the generator's layout (value i reads word (i >> 4) & 3 of block
    # (i >> 6) * 16 + (i & 15)) keeps at the same rate, and neighbours are independent.
    flat = mask.ravel().astype(np.int64)
    for residue in range(64):
        assert within(int(flat[residue::64].sum()), n // 64, keep), residue
    for lag in (1, 16, 64):
        assert within(int((flat[:-lag] & flat[lag:]).sum()), n - lag, keep * keep), lag


@pytest.mark.parametrize('p', [0.1, 0.5])
def test_float32_values_and_gradient_are_mxnets_arithmetic_exactly(p):
    mx.random.seed(3)
    x = _data()
    head = _data(seed=1)
    out, mask, grad = _dropped_out(x, p, head)
    x, head = to_numpy(x), to_numpy(head)
    kept = mask == 1
    scale = _scale(p)
    assert np.array_equal(out, np.where(kept, x * scale, x * np.float32(0)))
    assert np.array_equal(grad, np.where(kept, head * scale, head * np.float32(0)))
    # The same mask forward and backward: the gradient is nonzero exactly where values were kept.
    assert np.array_equal(grad != 0, kept) and np.array_equal(out != 0, kept)
    # MXNet's own Dropout computes its kept values so: x * (1 / (1 - p)) in float32.
    with autograd.record():
        theirs = mx.nd.Dropout(mx.nd.array(x), p=p).asnumpy()
    assert np.array_equal(theirs[theirs != 0], (x * scale)[theirs != 0])


@pytest.mark.parametrize('p', [0.1, 0.5])
def test_bfloat16_values_are_scaled_in_float32_and_rounded_once(p):
    mx.random.seed(4)
    x = _data(dtype='bfloat16')
    head = _data(dtype='bfloat16', seed=1)
    out, mask, grad = _dropped_out(x, p, head)
    kept = mask == 1
    wide, wide_head = to_float32_numpy(x), to_float32_numpy(head)
    scale = _scale(p)
    exact = np.where(kept, wide * scale, wide * np.float32(0))
    assert np.array_equal(out, _round_to_bfloat16(exact))
    assert np.array_equal(grad, _round_to_bfloat16(np.where(kept, wide_head * scale,
                                                            wide_head * np.float32(0))))
    # Scaled by 1 / 0.9 the products need their rounding; doubled (p 0.5) they are exact.
    assert ((out != exact)[kept].mean() > 0.5) == (p == 0.1)


def test_special_values_drop_as_in_mxnet():
    # Dropped: x * 0, so NaN and infinities give NaN (MXNet: 0 * x * scale), signs of zeros kept.
    mx.random.seed(5)
    values = np.tile(np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, -3.0, 3.0], np.float32), 4096)
    out, mask, _ = _dropped_out(mx.nd.array(values), 0.5)
    kept, scale = mask == 1, _scale(0.5)
    with np.errstate(invalid='ignore'):
        want = np.where(kept, values * scale, values * np.float32(0))
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    assert np.isnan(out[~kept & ~np.isfinite(values)]).all()


def test_p_0_is_the_identity_and_p_1_drops_everything():
    x = _data((3, 1001))
    head = _data((3, 1001), seed=1)
    out, mask, grad = _dropped_out(x, 0.0, head)
    assert np.array_equal(out, to_numpy(x)) and np.array_equal(grad, to_numpy(head))
    assert (mask == 1).all()
    # MXNet 1.9.1 writes NaN for p = 1 (0 * x * 1/0); the own operator zeros, and converted
    # graphs keep MXNet's Dropout for p = 1.
    out, mask, grad = _dropped_out(x, 1.0, head)
    assert not out.any() and not mask.any() and not grad.any()


def test_a_seed_repeats_the_mask_and_two_calls_differ():
    x = _data((4, 1001))
    masks = []
    for seed in (7, 7, 8):
        mx.random.seed(seed)
        masks.append([_kept(operators.dropout(x, p=0.5)[1], x.shape) for _ in range(2)])
    assert np.array_equal(masks[0][0], masks[1][0]) and np.array_equal(masks[0][1], masks[1][1])
    assert not np.array_equal(masks[0][0], masks[0][1])
    assert not np.array_equal(masks[0][0], masks[2][0])


_MASK_SCRIPT = textwrap.dedent('''
    import sys
    import mxnet as mx
    import numpy as np
    from mxamp.kernels import operators
    mx.random.seed(21)
    x = mx.nd.ones((40, 1000, 33))   # 1.3 million values: 81 chunks, shared among threads
    masks = [np.unpackbits(operators.dropout(x, p=0.3)[1].asnumpy(), bitorder='little')
             for _ in range(2)]
    np.save(sys.argv[1], np.stack(masks))
''')


def test_the_mask_does_not_depend_on_the_thread_count(tmp_path):
    masks = {}
    for threads in (1, 2):
        path = str(tmp_path / ('mask%d.npy' % threads))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get('PYTHONPATH')]
                                                        if p]))
        done = subprocess.run([sys.executable, '-c', _MASK_SCRIPT, path], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        masks[threads] = np.load(path)
    assert np.array_equal(masks[1], masks[2])
    assert 0.65 < masks[1].mean() < 0.75


# Philox4x32-10's published answer for counter 0 and key 0 (Random123's kat_vectors).
_KNOWN_ANSWER = [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def _words(seed, first, count, wide):
    library = ctypes.CDLL(operators.library_path())
    out = np.zeros(count, dtype=np.uint32)
    library.mxamp_dropout_random_words(
        ctypes.c_uint64(seed), ctypes.c_uint64(first), ctypes.c_uint64(count),
        out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), ctypes.c_int(int(wide)))
    return out


def _philox(block, seed):
    """Philox4x32-10 of counter (block, block >> 32, 0, 0) keyed by the seed's halves."""
    mask = 0xFFFFFFFF
    c = [block & mask, block >> 32, 0, 0]
    k0, k1 = seed & mask, seed >> 32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & mask, (p0 >> 32) ^ c[3] ^ k1, p0 & mask]
        k0, k1 = (k0 + 0x9E3779B9) & mask, (k1 + 0xBB67AE85) & mask
    return c


@pytest.mark.parametrize('wide', [True, False])
def test_the_random_words_are_philox4x32_10s_from_either_generator(wide):
    assert list(_words(0, 0, 64, wide)[::16]) == _KNOWN_ANSWER
    seed, first = 0x0123456789ABCDEF, (1 << 34) - 100   # across the counter's 32-bit carry
    got = _words(seed, first, 300, wide)
    for offset in (0, 1, 17, 99, 100, 150, 299):
        i = first + offset
        assert got[offset] == _philox((i >> 6) * 16 + (i & 15), seed)[(i >> 4) & 3], offset
    assert np.array_equal(got, _words(seed, first, 300, not wide))


def _run_loops(values, head, p, seed, wide):
    """Forward and backward of the library's plain (`wide` False) or AVX-512 loops on numpy
    `values` and `head` (float32, or bfloat16 as uint16 bits): output, mask, gradient."""
    library = ctypes.CDLL(operators.library_path())
    library.mxamp_dropout_forward_backward.restype = ctypes.c_char_p
    out, grad = np.empty_like(values), np.empty_like(head)
    mask = np.full((values.size + 7) // 8, 0xAA, dtype=np.uint8)    # garbage: all written
    error = library.mxamp_dropout_forward_backward(
        values.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
        mask.ctypes.data_as(ctypes.c_void_p), head.ctypes.data_as(ctypes.c_void_p),
        grad.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(values.size), ctypes.c_float(p),
        ctypes.c_uint64(seed), ctypes.c_int(values.dtype == np.uint16), ctypes.c_int(int(wide)))
    assert error is None, error
    return out, mask, grad


@pytest.mark.parametrize('size', [1, 7, 17, 100, 1000, 16384 * 3 + 1029])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_the_plain_loops_give_the_avx512_loops_bits(size, dtype):
    rng = np.random.RandomState(size)
    values, head = [rng.normal(size=size).astype(np.float32) for _ in range(2)]
    if dtype == 'bfloat16':    # the high halves: bfloat16 truncated, as bits
        values, head = [(a.view(np.uint32) >> 16).astype(np.uint16) for a in (values, head)]
    for p in (0.0, 0.3):
        wide = _run_loops(values, head, p, 99, True)
        plain = _run_loops(values, head, p, 99, False)
        for name, mine, theirs in zip(('output', 'mask', 'gradient'), wide, plain):
            assert np.array_equal(mine.view(np.uint8), theirs.view(np.uint8)), (name, p)
        kept = np.unpackbits(wide[1], bitorder='little')
        assert not kept[size:].any()
        assert kept[:size].all() if p == 0 else 0.6 < kept[:size].mean() < 0.8 or size < 1000


def test_what_it_does_not_compute_is_refused_with_the_reason():
    with pytest.raises(mx.base.MXNetError, match='dropout takes 0 <= p <= 1'):
        operators.dropout(mx.nd.ones(4), p=1.5)[0].wait_to_read()
    mx.nd.waitall()
    with pytest.raises(mx.base.MXNetError, match='takes float32 or bfloat16'):
        operators.dropout(mx.nd.ones(4, dtype='float16'), p=0.5)[0].wait_to_read()
    mx.nd.waitall()
    handle = operators._require().nd[operators.DROPOUT_OP_NAME]
    with pytest.raises(mx.base.MXNetError, match='takes no axes'):
        handle(mx.nd.ones((2, 4)), p=0.5, axes=(1,))[0].wait_to_read()
    mx.nd.waitall()


# -- the pass -------------------------------------------------------------------------------------

class _Net(gluon.HybridBlock):
    """Two dense layers with dropouts between: gluon's (p 0.3), F.Dropout's of the given
    attributes, and a dropout that is the network's output (p 0.1)."""

    def __init__(self, middle=None, units=64, classes=10, **kwargs):
        super(_Net, self).__init__(**kwargs)
        self._middle = {'p': 0.2} if middle is None else middle
        with self.name_scope():
            self.hidden = gluon.nn.Dense(units, activation='relu', flatten=False)
            self.dropout = gluon.nn.Dropout(0.3)
            self.output = gluon.nn.Dense(classes)

    def hybrid_forward(self, F, x):
        hidden = F.Dropout(self.dropout(self.hidden(x)), **self._middle)
        return F.Dropout(self.output(hidden), p=0.1)


def _converted(net, x, dtype='bfloat16', **kwargs):
    net.initialize(mx.init.Xavier())
    net(x)
    mxamp.convert(net, dtype, **kwargs)
    net.hybridize()
    with autograd.record():
        net(x)
    return net


def _runtime_ops(net, x, mode):
    symbol = mg._runtime_graph(net, net._cached_graph[1], (x,), mode).symbol
    return [node['op'] for node in json.loads(symbol.tojson(remove_amp_cast=False))['nodes']]


def _x(shape=(8, 32)):
    return _data(shape, seed=2)


@pytest.mark.parametrize('mode', ['training', 'inference', 'training with input gradients'])
def test_a_converted_training_graph_drops_out_on_the_own_operator(mode):
    x = _x()
    net = _converted(_Net(), x)
    ops = _runtime_ops(net, x, mode)
    if mode == 'inference':
        assert ops.count('Dropout') == 3 and operators.DROPOUT_OP_NAME not in ops
    else:
        assert ops.count(operators.DROPOUT_OP_NAME) == 3 and 'Dropout' not in ops
    # The precision pass's graph, which export writes, keeps MXNet's.
    assert [node['op'] for node in json.loads(net._cached_graph[1].tojson())['nodes']].count(
        'Dropout') == 3


def test_export_keeps_mxnets_dropout_and_runs_on_plain_mxnet(tmp_path):
    x = _x()
    net = _converted(_Net(), x)
    out = to_float32_numpy(net(x))
    net.export(str(tmp_path / 'net'))
    with open(str(tmp_path / 'net-symbol.json')) as f:
        ops = [node['op'] for node in json.load(f)['nodes']]
    assert ops.count('Dropout') == 3 and operators.DROPOUT_OP_NAME not in ops
    loaded = gluon.SymbolBlock.imports(str(tmp_path / 'net-symbol.json'), ['data'],
                                       str(tmp_path / 'net-0000.params'))
    assert relative_error(to_float32_numpy(loaded(x)), out) < 1e-6


def test_a_dropout_that_is_the_output_gives_one_output_and_its_gradient():
    x = _x()
    net = _converted(_Net(), x)
    x.attach_grad()
    with autograd.record():
        out = net(x)
    assert isinstance(out, mx.nd.NDArray) and out.shape == (8, 10)
    out.backward()
    grad = to_float32_numpy(x.grad)
    assert np.isfinite(grad).all() and grad.any()
    # The output's dropped values are exact zeros, about a tenth of them.
    assert 0 < (to_float32_numpy(out) == 0).mean() < 0.4


@pytest.mark.parametrize('middle', [{'p': 0.2, 'axes': (1,)}, {'p': 0.0},
                                    {'p': 1.0}, {'p': 0.2, 'mode': 'always'}])
def test_dropouts_the_own_operator_does_not_stand_in_for_stay_mxnets(middle):
    x = _x((8, 4, 32))
    net = _converted(_Net(middle), x)
    ops = _runtime_ops(net, x, 'training')
    assert ops.count('Dropout') == 1 and ops.count(operators.DROPOUT_OP_NAME) == 2


def test_a_network_that_runs_as_its_float32_self_keeps_mxnets_masks():
    # Under 'auto' no layer this small pays for bfloat16: the network computes and stores
    # everything in FP32 and trains as its FP32 self, value for value, dropouts included.
    # (On a CPU without bfloat16 kernels 'auto' leaves the net unconverted: the same promise.)
    x = _x()
    net = _converted(_Net(), x, 'auto')
    if mg.is_converted(net):
        conversion = mg.converted_state(net).conversion_for('cpu')[1]
        assert not conversion.computes_low and not conversion.lp_params
        ops = _runtime_ops(net, x, 'training')
        assert ops.count('Dropout') == 3 and operators.DROPOUT_OP_NAME not in ops
    fp32 = _Net()
    fp32.initialize()
    fp32(x)
    for mine, theirs in zip(fp32.collect_params().values(), net.collect_params().values()):
        mine.set_data(theirs.data())
    fp32.hybridize()
    outputs = []
    for block in (net, fp32):
        mx.random.seed(4)
        with autograd.record():
            outputs.append(block(x).asnumpy())
    assert np.array_equal(outputs[0], outputs[1])


def test_a_dropout_of_the_inputs_stays_mxnets():
    class _InputDropout(gluon.HybridBlock):
        def __init__(self, **kwargs):
            super(_InputDropout, self).__init__(**kwargs)
            with self.name_scope():
                self.dense = gluon.nn.Dense(4)

        def hybrid_forward(self, F, x):
            return self.dense(F.Dropout(x, p=0.2))
    x = _x()
    ops = _runtime_ops(_converted(_InputDropout(), x), x, 'training with input gradients')
    assert 'Dropout' in ops and operators.DROPOUT_OP_NAME not in ops


def test_summary_names_the_own_dropouts():
    x = _x()
    text = mxamp.summary(_converted(_Net(), x), print_fn=None)
    assert "dropouts on mxamp's own vectorised operator in training: 3" in text
    assert text.count('Dropout (training: %s)' % operators.DROPOUT_OP_NAME) == 3


def test_the_pass_reads_the_precision_pass_record():
    graph = {'nodes': [{'op': 'null', 'name': 'x', 'inputs': []},
                       {'op': 'relu', 'name': 'r', 'inputs': [[0, 0, 0]]},
                       {'op': 'Dropout', 'name': 'd', 'attrs': {'p': '0.5'}, 'inputs': [[1, 0, 0]]},
                       {'op': 'Dropout', 'name': 'e', 'inputs': [[2, 0, 0]]}],
             'heads': [[3, 0, 0]]}
    assert dropout_mod.movable_dropouts(graph, {'r': 'float32', 'd': 'float32',
                                                'e': 'bfloat16'}) == ['d', 'e']
    assert dropout_mod.movable_dropouts(graph, {'d': 'float16', 'e': 'float32'}) == ['e']
    assert dropout_mod.with_own_dropouts(graph, ['e']) == ['e']
    assert [node['op'] for node in graph['nodes']] == ['null', 'relu', 'Dropout',
                                                       operators.DROPOUT_OP_NAME]


class _Shared(gluon.HybridBlock):
    """A dropout whose input another operator reads too: h + dropout(h); returns both."""

    def __init__(self, **kwargs):
        super(_Shared, self).__init__(**kwargs)
        with self.name_scope():
            self.dense = gluon.nn.Dense(256, flatten=False)

    def hybrid_forward(self, F, x):
        hidden = self.dense(x)
        return hidden + F.Dropout(hidden, p=0.5), hidden


def test_a_shared_input_is_fanned_out_and_both_gradients_arrive():
    # MXNet may add the second reader's gradient into the first's output (in place), which an
    # own operator, writing its gradient, would overwrite: the input gets a fan-out.
    x = _x((16, 64))
    net = _converted(_Shared(), x)
    ops = _runtime_ops(net, x, 'training')
    assert operators.DROPOUT_OP_NAME in ops and operators.FAN_OUT_OP_NAME in ops
    with autograd.record():
        out, hidden = net(x)
    out.backward()
    out, hidden = to_float32_numpy(out), to_float32_numpy(hidden)
    # d out / d hidden = 1 + 2 * kept (p 0.5); the bias's gradient sums it over the batch.
    kept = np.abs(out - hidden) > 1e-3 * np.abs(hidden)
    want = (1 + 2 * kept).sum(axis=0)
    got = to_float32_numpy(net.dense.bias.grad())
    assert relative_error(got, want) < 1e-2


def test_a_converted_net_with_dropouts_learns():
    rng = np.random.RandomState(0)
    centres = rng.normal(0, 1, (10, 32)).astype(np.float32)
    labels = rng.randint(0, 10, 512)
    data = centres[labels] + rng.normal(0, 0.5, (512, 32)).astype(np.float32)
    x, y = mx.nd.array(data), mx.nd.array(labels)
    mx.random.seed(0)
    net = _converted(_Net(units=128), x[:8])
    trainer = mxamp.Trainer(net.collect_params(), 'adam', {'learning_rate': 3e-3})
    loss_of = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for step in range(60):
        batch = slice(64 * (step % 8), 64 * (step % 8 + 1))
        with autograd.record():
            loss = loss_of(net(x[batch]), y[batch])
        loss.backward()
        trainer.step(64)
        losses.append(float(loss.mean().asscalar()))
    assert operators.DROPOUT_OP_NAME in _runtime_ops(net, x[:64], 'training')
    assert np.mean(losses[-8:]) < 0.5 * np.mean(losses[:8]), losses
    # Inference (MXNet's Dropout, the identity) classifies the data.
    assert (net(x).asnumpy().argmax(axis=1) == labels).mean() > 0.8


def test_gluonnlps_bert_drops_out_on_the_own_operator_in_training():
    nlp = pytest.importorskip('gluonnlp', reason='needs GluonNLP 0.10 (the test extra)')
    vocab = nlp.vocab.BERTVocab(nlp.data.count_tokens(['w%d' % i for i in range(30)]))
    bert, _ = nlp.model.get_model('bert_12_768_12', dataset_name=None, vocab=vocab,
                                  pretrained=False, use_pooler=True, use_decoder=False,
                                  use_classifier=False, hparam_allow_override=True, dropout=0.1,
                                  num_layers=2, units=64, hidden_size=128, num_heads=2,
                                  embed_size=64)
    net = nlp.model.BERTClassifier(bert, num_classes=2, dropout=0.1)
    mx.random.seed(0)
    net.initialize(mx.init.Normal(0.02))
    tokens = mx.nd.array(np.random.RandomState(0).randint(5, 30, (4, 16)))
    types, lengths = mx.nd.zeros((4, 16)), mx.nd.array([16, 12, 9, 16])
    mxamp.convert(net, 'bfloat16')
    net.hybridize()
    with autograd.record():
        loss = net(tokens, types, lengths).sum()
    loss.backward()
    symbol = net._cached_graph[1]
    dropouts = [node['op'] for node in json.loads(symbol.tojson())['nodes']].count('Dropout')
    training = mg._runtime_graph(net, symbol, (tokens, types, lengths), 'training').symbol
    inference = mg._runtime_graph(net, symbol, (tokens, types, lengths), 'inference').symbol
    ops = {mode: [node['op'] for node in json.loads(graph.tojson())['nodes']]
           for mode, graph in (('training', training), ('inference', inference))}
    # Embeddings, per layer attention weights and two hidden states, the classifier's input.
    assert dropouts >= 7
    assert ops['training'].count(operators.DROPOUT_OP_NAME) == dropouts
    assert 'Dropout' not in ops['training']
    assert ops['inference'].count('Dropout') == dropouts
    assert np.isfinite(float(loss.asscalar()))
