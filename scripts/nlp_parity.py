#!/usr/bin/env python
"""A BERT classifier and a Transformer translator trained in FP32 and in bfloat16: accuracy parity.

Usage::

    OMP_NUM_THREADS=2 .venv/bin/python scripts/nlp_parity.py            # both, small, 3 seeds
    OMP_NUM_THREADS=2 .venv/bin/python scripts/nlp_parity.py --task bert --config base \\
        --seeds 3 --output bert_base.json

This module owns the two synthetic tasks, the networks that learn them and
their training recipes; ``tests/test_nlp_parity.py`` imports them.  Nothing is
downloaded: the vocabularies, the data and the initial weights are made here.

BERT (``--task bert``): gluonnlp 0.10's ``bert_12_768_12`` architecture
(``--config base``: BERT-base as it is; ``small`` has 2 layers of 128
units and 2 heads) under ``BERTClassifier``, fine-tuned from random
weights as gluonnlp's ``finetune_classifier.py`` fine-tunes (BERTAdam, 10%
warm-up then linear decay, weight decay 0.01 off LayerNorm and biases,
gradients clipped to a global norm of 1) on a sentence-pair task:
``[CLS] a [SEP] b [SEP]``, label 1 when segment ``b`` holds the marked word
more often than segment ``a``.  The two counts differ by 1 or 2, so the
network has to count within each segment, which only the token types and the
attention over the whole sequence tell apart.  Reported: held-out accuracy and
loss (512 pairs, the same for every run) and the training loss, the mean of
the last tenth of the steps.

Transformer (``--task transformer``): gluonnlp 0.10's ``transformer_en_de_512``
architecture (shared embeddings tied to the output projection, scaled
attention; ``--config base`` is its own size, ``small`` 2+2 layers of 128
units and 4 heads) as
``gluonnlp.model.translation.NMTModel``, trained as gluonnlp's
``train_transformer.py`` trains it (Adam with beta2 0.98, an inverse square
root schedule after a warm-up of an eighth of the steps, label smoothing 0.1,
``MaskedSoftmaxCELoss`` over the valid target tokens) to translate a sentence
of 5 to 10 words into its words reversed, each through a fixed permutation of
the vocabulary.  Reported: held-out loss (plain cross-entropy per target
token, teacher forced) and token accuracy (512 sentences), and the training
loss as for BERT.

Each seed draws the initial weights, the dropout masks and the training
batches; FP32 and bfloat16 runs of one seed start from the same weights (the
bfloat16 network rounds them) and see the same batches.  FP32 trains with
``gluon.Trainer``; bfloat16 with ``mxamp.convert(net, 'bfloat16')`` and
``mxamp.Trainer`` (FP32 master weights).  On a CPU without bfloat16 kernels
the bfloat16 runs store bfloat16 and compute in FP32 (the table says so).
The JSON file (``--output``) holds every run (its loss curve as means of 10
steps), the summaries and what ``mxamp.summary`` says computes in bfloat16.  Needs GluonNLP 0.10
(``pip install mxamp[nlp]``).
"""
import argparse
import collections
import datetime
import math
import os
import re
import sys
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# mxamp from this checkout, and the imagenet helpers beside this file, also when the
# tests load this module from its path.
sys.path[:0] = [os.path.dirname(HERE), HERE]

import mxamp  # noqa: E402  (first: enables AMX before oneDNN's first primitive)
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from tqdm import tqdm  # noqa: E402

try:
    import gluonnlp as nlp
    from gluonnlp.loss import LabelSmoothing, MaskedSoftmaxCELoss
except ImportError as err:
    sys.exit('nlp_parity: needs GluonNLP 0.10 (pip install mxamp[nlp]): %s' % err)

import benchmark_families  # noqa: E402
from imagenet.jsonio import dump_json  # noqa: E402
from mxamp import hardware  # noqa: E402
from mxamp.atomic_files import replaced_on_success  # noqa: E402

DTYPES = ('float32', 'bfloat16')
TASKS = ('bert', 'transformer')
CONFIGS = ('small', 'base')
HELD_OUT = 512
# The held-out examples come from their own stream, the same for every seed and dtype.
HELD_OUT_SEED = 2026

# Architectures: keyword arguments over gluonnlp's own hyper-parameters
# (bert_12_768_12_hparams, transformer_en_de_hparams); 'base' is each model as gluonnlp defines it.
BERT = {'small': dict(num_layers=2, units=128, hidden_size=512, num_heads=2, embed_size=128),
        'base': dict()}
TRANSFORMER = {'small': dict(num_layers=2, num_units=128, hidden_size=512, num_heads=4),
               'base': dict()}
ARCHITECTURES = {'bert': BERT, 'transformer': TRANSFORMER}

Recipe = collections.namedtuple('Recipe', 'steps batch lr')
# Steps, batch and peak learning rate per task and config.  With 'small', FP32 learns each task
# clearly above chance (BERT: 94% held-out accuracy at seed 0; BERTAdam at 1e-3 stayed at chance;
# Transformer: 91% of the tokens).  BERT-base from random weights learns only at a small rate
# (the rates tried: docs/nlp.rst): BERTAdam corrects no bias, so its first hundreds of steps
# move two to three times the rate.  Batch 16 for BERT-base's cost.  The Transformer's 'base'
# recipe has not run.
RECIPES = {('bert', 'small'): Recipe(200, 32, 3e-4),
           ('bert', 'base'): Recipe(400, 16, 2e-5),
           ('transformer', 'small'): Recipe(400, 32, 2e-3),
           ('transformer', 'base'): Recipe(300, 32, 5e-4)}

# -- the sentence-pair task (BERT) ----------------------------------------------------------------

#: Tokens of a BERT input: [CLS] segment [SEP] segment [SEP], padded.
SEQUENCE = 32
BERT_WORDS = ['w%d' % i for i in range(30)]
MARKED = BERT_WORDS[0]


def bert_vocab():
    """The classifier's vocabulary: 30 words and BERT's special tokens."""
    return nlp.vocab.BERTVocab(nlp.data.count_tokens(BERT_WORDS))


def pair_batch(vocab, count, rng):
    """`count` sentence pairs of `SEQUENCE` tokens and their labels, drawn from `rng`.

    Each segment has 8 to 14 words; the marked word occurs ``c`` times in the
    first and ``c + 1``, ``c + 2``, ``c - 1`` or ``c - 2`` times in the second
    (both 0 to 6); label 1 when the second holds it more often.

    Returns
    -------
    tuple of numpy arrays
        Token ids (count, SEQUENCE), token types (count, SEQUENCE), valid lengths
        (count,) and labels (count,), all float32 (what the network reads).
    """
    pad, cls, sep = (vocab[vocab.padding_token], vocab[vocab.cls_token], vocab[vocab.sep_token])
    marked = vocab[MARKED]
    fillers = np.array([vocab[w] for w in BERT_WORDS if w != MARKED])
    tokens = np.full((count, SEQUENCE), pad, dtype='float32')
    types = np.zeros((count, SEQUENCE), dtype='float32')
    lengths = np.zeros(count, dtype='float32')
    labels = np.zeros(count, dtype='float32')
    longest = (SEQUENCE - 3) // 2
    for i in range(count):
        first = rng.randint(0, 7)
        second = first + rng.choice([-2, -1, 1, 2])
        if not 0 <= second <= 6:
            second = first - (second - first)
        segments = []
        for marks in (first, second):
            words = np.concatenate([rng.choice(fillers, rng.randint(8, longest + 1) - marks),
                                    np.full(marks, marked)])
            rng.shuffle(words)
            segments.append(words)
        pair = np.concatenate([[cls], segments[0], [sep], segments[1], [sep]])
        tokens[i, :len(pair)] = pair
        types[i, len(segments[0]) + 2:len(pair)] = 1
        lengths[i] = len(pair)
        labels[i] = second > first
    return tokens, types, lengths, labels


def bert_classifier(vocab, architecture, dropout=0.1):
    """gluonnlp's ``bert_12_768_12`` with `architecture`'s changes, under a two-class
    ``BERTClassifier``; not initialised, no pretrained weights."""
    bert, _ = nlp.model.get_model('bert_12_768_12', dataset_name=None, vocab=vocab,
                                  pretrained=False, use_pooler=True, use_decoder=False,
                                  use_classifier=False, hparam_allow_override=True,
                                  dropout=dropout, **architecture)
    return nlp.model.BERTClassifier(bert, num_classes=2, dropout=dropout)


def bert_loss(net, batch):
    """Per-example softmax cross-entropy of `net` on `batch` (NDArrays, as `pair_batch`)."""
    tokens, types, lengths, labels = batch
    return gluon.loss.SoftmaxCrossEntropyLoss()(net(tokens, types, lengths), labels)


# -- the translation task (Transformer) -----------------------------------------------------------

TRANSLATION_WORDS = ['t%d' % i for i in range(24)]
#: Source words of a sentence; the source adds <eos>, the target <bos> and <eos>.
SHORTEST, LONGEST = 5, 10
# The dictionary of the translation: word i of a source becomes word PERMUTATION[i].
PERMUTATION = np.random.RandomState(12345).permutation(len(TRANSLATION_WORDS))


def translation_vocab():
    """The vocabulary both sides share: 24 words, padding, <unk>, <bos> and <eos>."""
    return nlp.Vocab(nlp.data.count_tokens(TRANSLATION_WORDS))


def reversal_batch(vocab, count, rng):
    """`count` source sentences and their translations, drawn from `rng`.

    Returns
    -------
    tuple of numpy arrays
        Source ids (count, LONGEST + 1), target ids (count, LONGEST + 2),
        source and target valid lengths (count,), all float32.
    """
    pad, bos, eos = vocab[vocab.padding_token], vocab[vocab.bos_token], vocab[vocab.eos_token]
    words = np.array([vocab[w] for w in TRANSLATION_WORDS])
    source = np.full((count, LONGEST + 1), pad, dtype='float32')
    target = np.full((count, LONGEST + 2), pad, dtype='float32')
    source_lengths = np.zeros(count, dtype='float32')
    for i in range(count):
        length = rng.randint(SHORTEST, LONGEST + 1)
        drawn = rng.randint(0, len(words), length)
        source[i, :length + 1] = np.append(words[drawn], eos)
        target[i, :length + 2] = np.concatenate([[bos], words[PERMUTATION[drawn[::-1]]], [eos]])
        source_lengths[i] = length + 1
    return source, target, source_lengths, source_lengths + 1


def transformer(vocab, architecture, dropout=0.1):
    """gluonnlp's ``transformer_en_de_512`` with `architecture`'s changes, not initialised:
    `benchmark_families.nmt_model`, its embeddings as wide as its units."""
    return benchmark_families.nmt_model(vocab, dropout=dropout,
                                        embed_size=architecture['num_units'], **architecture)


def transformer_outputs(net, batch):
    """`net`'s logits for every target position but the last (teacher forcing)."""
    source, target, source_lengths, target_lengths = batch
    outputs, _ = net(source, target[:, :-1], source_lengths, target_lengths - 1)
    return outputs


def transformer_loss(net, batch, smoothing=0.1):
    """The label-smoothed cross-entropy summed over each sentence's valid target tokens, per
    sentence, as train_transformer.py's loss (its mean over tokens times the padded length)."""
    _, target, _, target_lengths = batch
    labels = LabelSmoothing(epsilon=smoothing, units=len(net.tgt_vocab))(target[:, 1:])
    loss = MaskedSoftmaxCELoss(sparse_label=False)(transformer_outputs(net, batch), labels,
                                                   target_lengths - 1)
    return loss * (target.shape[1] - 1)


# -- training ----------------------------------------------------------------------------------

def prepared(net, dtype, initializer):
    """`net` initialised (the seed drawn before), converted for `dtype`, hybridized as
    gluonnlp's scripts hybridize it (an `NMTModel`, converted in part, runs its decoders'
    Python code and their cells' graphs: docs/gluon.rst)."""
    net.initialize(initializer)
    if dtype != 'float32':
        mxamp.convert(net, dtype)
    net.hybridize(static_alloc=True)
    return net


def trainer_for(net, dtype, optimizer, options):
    """gluon.Trainer for FP32, mxamp.Trainer (FP32 master weights) for the low precision."""
    make = gluon.Trainer if dtype == 'float32' else mxamp.Trainer
    return make(net.collect_params(), optimizer, options)


def backward(trainer, loss):
    """`loss`'s backward pass; through `scale_loss` for mxamp's trainer (no scaling for
    bfloat16, whose range is FP32's, but the same loop then serves float16)."""
    if isinstance(trainer, mxamp.Trainer):
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    else:
        loss.backward()


def as_arrays(batch):
    return [mx.nd.array(part) for part in batch]


def bfloat16_operators(net):
    """The ``ops:`` line of ``mxamp.summary(net)`` and the operators it lists in bfloat16."""
    text = mxamp.summary(net, print_fn=None)
    operators, totals = set(), []
    for line in text.splitlines():
        columns = re.split(r'\s{2,}', line.strip())
        if len(columns) >= 3 and columns[2] == 'bfloat16':
            operators.add(columns[1])
        if line.strip().startswith('ops: '):
            totals.append(line.strip()[len('ops: '):])
    return {'ops': '; '.join(totals), 'bfloat16_operators': sorted(operators)}


def train_bert(dtype, seed, architecture, recipe, dropout=0.1, step_done=None):
    """Fine-tune a fresh BERT classifier for `recipe.steps` steps; its figures.

    Returns
    -------
    dict
        ``accuracy`` and ``loss`` on the held-out pairs, ``train_loss`` (the mean
        of the last tenth of the steps' batch losses), ``losses`` (each step's),
        ``seconds`` (training only) and, in bfloat16, ``computes`` (what
        `bfloat16_operators` finds).
    """
    vocab = bert_vocab()
    mx.random.seed(seed)
    net = prepared(bert_classifier(vocab, architecture, dropout), dtype, mx.init.Normal(0.02))
    # finetune_classifier.py: no weight decay on LayerNorm's gamma and beta and on biases.
    for param in net.collect_params('.*beta|.*gamma|.*bias').values():
        param.wd_mult = 0.0
    trainer = trainer_for(net, dtype, 'bertadam', {'learning_rate': recipe.lr, 'epsilon': 1e-6,
                                                   'wd': 0.01})
    trainable = [p for p in net.collect_params().values() if p.grad_req != 'null']
    rng = np.random.RandomState(seed)
    warmup = max(1, recipe.steps // 10)
    losses = []
    start = time.time()
    for step in range(recipe.steps):
        # Linear warm-up, then linear decay to zero (finetune_classifier.py).
        if step < warmup:
            trainer.set_learning_rate(recipe.lr * (step + 1) / warmup)
        else:
            trainer.set_learning_rate(recipe.lr * (recipe.steps - step) / (recipe.steps - warmup))
        batch = as_arrays(pair_batch(vocab, recipe.batch, rng))
        with autograd.record():
            loss = bert_loss(net, batch).mean()
            backward(trainer, loss)
        if isinstance(trainer, mxamp.Trainer):
            trainer.clip_global_norm(1.0)
        else:
            nlp.utils.clip_grad_global_norm(trainable, 1.0)
        trainer.step(1)
        losses.append(float(loss.asscalar()))
        if step_done is not None:
            step_done()
    seconds = time.time() - start
    correct, total_loss = 0, 0.0
    held_out = np.random.RandomState(HELD_OUT_SEED)
    for _ in range(HELD_OUT // recipe.batch):
        batch = as_arrays(pair_batch(vocab, recipe.batch, held_out))
        with autograd.predict_mode():
            scores = net(*batch[:3])
        correct += int((scores.argmax(axis=1) == batch[3]).sum().asscalar())
        total_loss += float(gluon.loss.SoftmaxCrossEntropyLoss()(scores, batch[3])
                            .sum().asscalar())
    evaluated = HELD_OUT // recipe.batch * recipe.batch
    result = {'accuracy': correct / evaluated, 'loss': total_loss / evaluated,
              'train_loss': float(np.mean(losses[-max(1, recipe.steps // 10):])),
              'losses': losses, 'seconds': seconds}
    if dtype != 'float32':
        result['computes'] = bfloat16_operators(net)
    return result


def train_transformer(dtype, seed, architecture, recipe, dropout=0.1, step_done=None):
    """Train a fresh Transformer for `recipe.steps` steps; its figures.

    Returns
    -------
    dict
        ``accuracy`` (of the target tokens) and ``loss`` (cross-entropy per
        target token, no smoothing) on the held-out sentences, ``train_loss``
        (label-smoothed, per sentence: the mean of the last tenth of the
        steps), ``losses``, ``seconds`` and, in bfloat16, ``computes``.
    """
    vocab = translation_vocab()
    mx.random.seed(seed)
    # train_transformer.py's initializer (its --magnitude 3.0).
    net = prepared(transformer(vocab, architecture, dropout), dtype, mx.init.Xavier(magnitude=3.0))
    trainer = trainer_for(net, dtype, 'adam', {'learning_rate': recipe.lr, 'beta2': 0.98,
                                               'epsilon': 1e-9})
    rng = np.random.RandomState(seed)
    warmup = max(1, recipe.steps // 8)
    losses = []
    start = time.time()
    for step in range(1, recipe.steps + 1):
        # train_transformer.py's schedule, units**-0.5 * min(step**-0.5, step * warmup**-1.5),
        # scaled so that its peak (at the end of the warm-up) is recipe.lr.
        trainer.set_learning_rate(recipe.lr * min(step / warmup, math.sqrt(warmup / step)))
        batch = as_arrays(reversal_batch(vocab, recipe.batch, rng))
        with autograd.record():
            loss = transformer_loss(net, batch).mean()
            backward(trainer, loss)
        trainer.step(1)
        losses.append(float(loss.asscalar()))
        if step_done is not None:
            step_done()
    seconds = time.time() - start
    correct, tokens, total_loss = 0, 0, 0.0
    held_out = np.random.RandomState(HELD_OUT_SEED)
    for _ in range(HELD_OUT // recipe.batch):
        batch = as_arrays(reversal_batch(vocab, recipe.batch, held_out))
        target, lengths = batch[1][:, 1:].asnumpy(), batch[3].asnumpy() - 1
        with autograd.predict_mode():
            outputs = transformer_outputs(net, batch)
        valid = np.arange(target.shape[1])[None, :] < lengths[:, None]
        correct += int((outputs.argmax(axis=-1).asnumpy() == target)[valid].sum())
        tokens += int(valid.sum())
        # MaskedSoftmaxCELoss averages over the padded length: back to a sum over valid tokens.
        total_loss += float((MaskedSoftmaxCELoss()(outputs, batch[1][:, 1:], batch[3] - 1)
                             * target.shape[1]).sum().asscalar())
    result = {'accuracy': correct / tokens, 'loss': total_loss / tokens,
              'train_loss': float(np.mean(losses[-max(1, recipe.steps // 10):])),
              'losses': losses, 'seconds': seconds}
    if dtype != 'float32':
        result['computes'] = bfloat16_operators(net)
    return result


TRAIN = {'bert': train_bert, 'transformer': train_transformer}

# -- the report ----------------------------------------------------------------------------------

FIGURES = ('accuracy', 'loss', 'train_loss')
HEADINGS = {'bert': ('held-out accuracy', 'held-out loss', 'training loss'),
            'transformer': ('held-out token accuracy', 'held-out loss per token',
                            'training loss (smoothed)')}


def spread(values):
    """Mean, standard deviation (over seeds, ddof 1 when there are several), min and max."""
    values = np.asarray(values, dtype='float64')
    return {'mean': float(values.mean()), 'sd': float(values.std(ddof=1 if len(values) > 1 else 0)),
            'min': float(values.min()), 'max': float(values.max())}


def for_json(result):
    """`result` with its per-step losses as means of 10 steps (``loss_curve``): the curve, in a
    file small enough for docs/."""
    kept = {key: value for key, value in result.items() if key != 'losses'}
    losses = result['losses']
    kept['loss_curve'] = [round(float(np.mean(losses[i:i + 10])), 5)
                          for i in range(0, len(losses), 10)]
    return kept


def summarise(runs):
    """Per dtype and figure, `spread` over the seeds of `runs` ({dtype: [result per seed]})."""
    return {dtype: {figure: spread([r[figure] for r in results]) for figure in FIGURES}
            for dtype, results in runs.items()}


def describe_architecture(task, config):
    if task == 'bert':
        a = dict(nlp.model.bert.bert_12_768_12_hparams, **BERT[config])
        return ('BERT %s (bert_12_768_12 architecture: %d layers, %d units, %d heads, FFN %d)'
                % (config, a['num_layers'], a['units'], a['num_heads'], a['hidden_size']))
    a = dict(nlp.model.transformer.transformer_en_de_hparams, **TRANSFORMER[config])
    return ('Transformer %s (transformer_en_de_512 architecture: %d+%d layers, %d units, '
            '%d heads, FFN %d)' % (config, a['num_layers'], a['num_layers'], a['num_units'],
                                   a['num_heads'], a['hidden_size']))


def table(task, config, recipe, runs, summary, bfloat16_label):
    """The lines of one task's table: per seed, then mean, sd and range, then the verdict."""
    names = {'float32': 'FP32', 'bfloat16': bfloat16_label}
    lines = ['', '%s, %d steps of %d %s' % (
        describe_architecture(task, config), recipe.steps, recipe.batch,
        'sentence pairs of %d tokens' % SEQUENCE if task == 'bert'
        else 'sentences of %d to %d words' % (SHORTEST, LONGEST))]
    header = '%-6s %-9s' % ('seed', 'dtype') + ''.join(
        '%26s' % h for h in HEADINGS[task]) + '%10s' % 'seconds'
    lines += [header, '-' * len(header)]
    seeds = len(runs['float32'])
    for seed in range(seeds):
        for dtype in DTYPES:
            r = runs[dtype][seed]
            lines.append('%-6d %-9s%25.2f%%%26.4f%26.4f%10.1f' % (
                seed, names[dtype], 100 * r['accuracy'], r['loss'], r['train_loss'],
                r['seconds']))
    for what in ('mean', 'sd', 'min', 'max'):
        for dtype in DTYPES:
            s = summary[dtype]
            lines.append('%-6s %-9s%25.2f%%%26.4f%26.4f' % (
                what, names[dtype], 100 * s['accuracy'][what], s['loss'][what],
                s['train_loss'][what]))
    fp32, low = summary['float32']['accuracy'], summary['bfloat16']['accuracy']
    inside = fp32['min'] <= low['mean'] <= fp32['max']
    lines.append('%s mean accuracy %.2f%% %s FP32\'s range over seeds (%.2f%% to %.2f%%); '
                 'difference of means %+.2f points, FP32\'s sd %.2f points'
                 % (names['bfloat16'], 100 * low['mean'], 'lies within' if inside else 'lies outside',
                    100 * fp32['min'], 100 * fp32['max'], 100 * (low['mean'] - fp32['mean']),
                    100 * fp32['sd']))
    return lines


# -- the command line ------------------------------------------------------------------------------

class UsageError(Exception):
    """Bad input: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _count(text):
    """argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError('expected a positive integer, got %r' % text)
    return value


def parse_args(argv):
    parser = _Parser(prog='nlp_parity', description=__doc__.split('\n')[0])
    parser.add_argument('--task', choices=TASKS + ('both',), default='both',
                        help='what to train (default: %(default)s)')
    parser.add_argument('--config', choices=CONFIGS, default='small',
                        help="the networks' size; base is BERT-base and transformer_en_de_512 "
                             'as gluonnlp defines them (default: %(default)s)')
    parser.add_argument('--seeds', type=_count, default=3,
                        help='seeds 0 to N-1, each trained in both dtypes (default: %(default)s)')
    parser.add_argument('--steps', type=_count,
                        help='training steps (default: the recipe of the task and config)')
    parser.add_argument('--output', help='write every run and the summaries to this JSON file')
    args = parser.parse_args(argv)
    if args.output:
        directory = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(directory):
            raise UsageError('--output %s: directory %s does not exist' % (args.output, directory))
    return args


def meta(argv):
    """Where and how the figures were measured."""
    return {'command': ' '.join(['scripts/nlp_parity.py'] + list(argv)),
            'date': datetime.date.today().isoformat(),
            'cpu_model': hardware.cpu_model(), 'cpu_class': hardware.describe_cpu_class(),
            'usable_cpus': hardware.usable_cpus(),
            'OMP_NUM_THREADS': os.environ.get('OMP_NUM_THREADS'),
            'DNNL_MAX_CPU_ISA': os.environ.get('DNNL_MAX_CPU_ISA'),
            'versions': {'mxamp': mxamp.__version__, 'mxnet': mx.__version__,
                         'gluonnlp': nlp.__version__},
            'load_average_start': list(os.getloadavg())}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except UsageError as error:
        sys.stderr.write('nlp_parity: error: %s\n' % error)
        return 2
    tasks = TASKS if args.task == 'both' else (args.task,)
    recipes = {task: RECIPES[task, args.config]._replace(
        **({'steps': args.steps} if args.steps else {})) for task in tasks}
    bfloat16_label = 'bfloat16' if hardware.computes_bfloat16() else 'bf16 store'
    report = {'meta': meta(argv), 'tasks': {}}
    total = sum(recipes[t].steps for t in tasks) * args.seeds * len(DTYPES)
    started = time.time()
    with warnings.catch_warnings(), tqdm(total=total, unit='step', desc='training') as progress:
        # mxamp's notes (bfloat16 slower than FP32 for small layers) and gluonnlp's
        # deprecations: the table is what this script reports.
        warnings.simplefilter('ignore')
        for task in tasks:
            runs = {dtype: [] for dtype in DTYPES}
            for seed in range(args.seeds):
                for dtype in DTYPES:
                    progress.set_postfix_str('%s %s seed %d' % (task, dtype, seed))
                    runs[dtype].append(TRAIN[task](dtype, seed, ARCHITECTURES[task][args.config],
                                                   recipes[task],
                                                   step_done=lambda: progress.update(1)))
            report['tasks'][task] = {
                'config': args.config, 'architecture': describe_architecture(task, args.config),
                'recipe': recipes[task]._asdict(), 'summary': summarise(runs),
                'runs': {dtype: [for_json(r) for r in results] for dtype, results in runs.items()}}
    for task in tasks:
        entry = report['tasks'][task]
        print('\n'.join(table(task, args.config, recipes[task], entry['runs'], entry['summary'],
                              bfloat16_label)))
        print('computes in bfloat16: %s'
              % ', '.join(entry['runs']['bfloat16'][0]['computes']['bfloat16_operators']))
    if bfloat16_label != 'bfloat16':
        print("bf16 store: this CPU (%s) computes no bfloat16: the 'bfloat16' runs store "
              'bfloat16 and compute in FP32' % hardware.describe_cpu_class())
    print('%s, %s, OMP_NUM_THREADS=%s, %.0f s in all'
          % (report['meta']['date'], report['meta']['cpu_model'],
             report['meta']['OMP_NUM_THREADS'], time.time() - started))
    if args.output:
        with replaced_on_success(args.output) as temporary:
            with open(temporary, 'w') as handle:
                dump_json(report, handle)
        print('wrote %s' % args.output)
    return 0


if __name__ == '__main__':
    sys.exit(main())
