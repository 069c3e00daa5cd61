"""Other tools' spellings of this script's options: those of gluoncv's
``scripts/classification/imagenet/train_imagenet.py`` and of NVIDIA's MXNet
ResNet-50 v1.5 (``runner``, ``train.py``, ``fit.py``, ``data.py``).

`translate` rewrites a command line before it is parsed: a spelling with this
script's meaning becomes this script's option (``--rec-train`` is
``--data-train``), one without it is refused with one line naming what to
write here (``--resume-states``), one that asks for what this script always
does is dropped (``--use-rec``).  `HELP` is the table that ``--help`` ends
with.  The spellings that this script's own options take (a bare
``--label-smoothing``, ``--mixup ALPHA``, ``--lr-mode poly``, ``--mode val``)
are `imagenet.options`'.  Options are matched whole, as argparse matches
them here (no abbreviations); ``--flag=value``, ``-jN`` and ``-j N`` all
work, and nothing after a bare ``--`` is read.
"""
import textwrap
from collections import namedtuple

from .options import MODES, UsageError

GLUONCV, NVIDIA = 'gluoncv', 'NVIDIA'

# flags: the spellings; origin: whose; metavar: the value it takes (None: a switch);
# rewrite(flag, value): this script's words for it; meaning: the --help table's text.
Spelling = namedtuple('Spelling', 'flags origin metavar rewrite meaning')


def _as(target):
    """Read as `target`, the value (if any) passed on."""
    return lambda flag, value: [target] if value is None else [target, value]


def _dropped(flag, value):
    return []


def _refused(why):
    def refuse(flag, value):
        raise UsageError('%s: %s' % (flag if value is None else '%s %s' % (flag, value), why))
    return refuse


def _one_of(table, why):
    """A value that this script spells otherwise: `table` maps it to words (or a refusal)."""
    def rewrite(flag, value):
        words = table.get(value.lower())
        if words is None:
            raise UsageError('%s %s: %s' % (flag, value, why))
        return words(flag, value) if callable(words) else words
    return rewrite


def _number(kind, flag, value):
    try:
        return kind(value)
    except ValueError:
        raise UsageError('argument %s: invalid %s value: %r' % (flag, kind.__name__, value))


def _input_size(flag, value):
    size = _number(int, flag, value)
    return ['--image-shape', '3,%d,%d' % (size, size)]


def _crop_ratio(flag, value):
    ratio = _number(float, flag, value)
    if ratio > 0 and ratio != 0.875:      # gluoncv reads 0 or less as its default, 0.875
        raise UsageError('%s %s: validation here always resizes to 1/0.875 of the crop and '
                         'takes the centre crop (256 for 224)' % (flag, value))
    return []


def _decay_period(flag, value):
    period = _number(int, flag, value)
    if period <= 0:     # gluoncv's default, 0: no periodic decay
        return []
    raise UsageError('%s %d: name the epochs instead: --lr-decay-epoch %d,%d,... with --lr-mode '
                     'step' % (flag, period, period, 2 * period))


def _data_root(flag, value):
    root = value.rstrip('/')
    return ['--data-train', root + '/train.rec', '--data-val', root + '/val.rec']


_MODE = dict({mode: ['--mode', mode] for mode in MODES}, hybrid=['--mode', 'train_val'],
             imperative=_refused("gluoncv's imperative mode does not exist here: the converted "
                                 'network always runs as a graph (--mode hybrid)'),
             symbolic=_refused("gluoncv's symbolic mode does not exist here: the Symbol API's "
                               'network is --symbol resnet'),
             pred=_refused("NVIDIA's single-image prediction is not in this script (in Python: "
                           'mxamp.for_inference(net, x), then net(x))'))

SPELLINGS = (
    Spelling(('--rec-train',), GLUONCV, 'REC', _as('--data-train'), '--data-train'),
    Spelling(('--rec-train-idx',), GLUONCV, 'IDX', _as('--data-train-idx'), '--data-train-idx'),
    Spelling(('--rec-val',), GLUONCV, 'REC', _as('--data-val'), '--data-val'),
    Spelling(('--rec-val-idx',), GLUONCV, 'IDX', _as('--data-val-idx'), '--data-val-idx'),
    Spelling(('--data-root',), NVIDIA, 'DIR', _data_root,
             '--data-train DIR/train.rec --data-val DIR/val.rec'),
    Spelling(('--use-rec',), GLUONCV, None, _dropped, 'dropped: the data is always RecordIO'),
    Spelling(('--data-backend',), GLUONCV + ', ' + NVIDIA, 'B',
             _one_of({'mxnet': [], 'synthetic': ['--synthetic']},
                     "this script reads RecordIO with MXNet's ImageRecordIter only "
                     '(--data-backend mxnet), or --synthetic'),
             'mxnet: dropped (the only one); synthetic: --synthetic; DALI refused'),
    Spelling(('-j', '--num-data-workers', '--data-mxnet-threads'), GLUONCV + ', ' + NVIDIA, 'N',
             _as('--data-nthreads'), '--data-nthreads'),
    Spelling(('--num-training-samples',), GLUONCV, 'N', _as('--num-examples'),
             '--num-examples (used with --synthetic; RecordIO files are counted)'),
    Spelling(('--input-size',), GLUONCV, 'N', _input_size, '--image-shape 3,N,N'),
    Spelling(('--crop-ratio',), GLUONCV, 'R', _crop_ratio,
             '0.875: dropped (the only one); others refused'),
    Spelling(('--mode',), GLUONCV, 'M',
             _one_of(_MODE, 'expected train_val, train or val (gluoncv\'s hybrid is train_val)'),
             "hybrid: --mode train_val (always a graph); imperative, symbolic and NVIDIA's pred "
             "refused (train_val, train, val: NVIDIA's, this script's)"),
    Spelling(('--amp',), NVIDIA, None, _dropped,
             '--dtype auto (mixed precision: float16 on GPUs), also over --dtype float32'),
    Spelling(('--arch',), NVIDIA, 'A',
             _refused("name the network: --model resnet50_v1b (gluoncv's v1b is ResNet-50 "
                      'v1.5) or --symbol resnet --resnet-version 1.5 --num-layers 50'),
             'refused: --model NAME or --symbol resnet'),
    Spelling(('--use-pretrained',), GLUONCV, None,
             _refused('give the parameters as a file: --load FILE (gluoncv.model_zoo.'
                      'get_model(name, pretrained=True) downloads them to ~/.mxnet/models)'),
             'refused: --load FILE'),
    Spelling(('--use_se', '--batch-norm', '--use-gn'), GLUONCV, None,
             _refused('name the model variant with --model (e.g. se_resnext50_32x4d, '
                      'vgg16_bn)'), 'refused: --model NAME'),
    Spelling(('--teacher', '--temperature', '--hard-weight'), GLUONCV, 'X',
             _refused('distillation is not in this script'), 'refused'),
    Spelling(('--resume-params',), GLUONCV, 'FILE', _as('--load'), '--load'),
    Spelling(('--resume-states',), GLUONCV, 'FILE',
             _refused('the checkpoints in --save-dir hold the optimizer state with the '
                      'parameters: --resume-epoch E continues from <prefix>-<E>.params and '
                      '.states there'), 'refused: --resume-epoch E'),
    Spelling(('--begin-epoch',), NVIDIA, 'E',
             _refused('--resume-epoch E continues from the checkpoint of epoch E in '
                      '--save-dir'), 'refused: --resume-epoch E'),
    Spelling(('--run-epochs',), NVIDIA, 'N',
             _refused('--stop-at-epoch N ends this run after epoch N, counted from the start '
                      'of the training'), 'refused: --stop-at-epoch N'),
    Spelling(('--lr-schedule',), NVIDIA, 'S',
             _one_of({'multistep': ['--lr-mode', 'step'], 'cosine': ['--lr-mode', 'cosine']},
                     'expected multistep or cosine'), '--lr-mode (multistep: step)'),
    Spelling(('--lr-factor',), NVIDIA, 'F', _as('--lr-decay'), '--lr-decay'),
    Spelling(('--lr-steps',), NVIDIA, 'E,E',
             _refused("--lr-decay-epoch E,E,... with --lr-mode step (NVIDIA's cosine restarts "
                      'at these epochs; the cosine schedule here has no restarts)'),
             'refused: --lr-decay-epoch'),
    Spelling(('--lr-decay-period',), GLUONCV, 'P', _decay_period,
             '0: dropped; others refused: --lr-decay-epoch'),
    Spelling(('--mom',), NVIDIA, 'M', _as('--momentum'), '--momentum'),
    Spelling(('-n', '--ngpus'), NVIDIA, 'N', _as('--num-gpus'), '--num-gpus'),
    Spelling(('-b',), NVIDIA, 'N', _as('--batch-size'), "--batch-size (per GPU, the runner's)"),
    Spelling(('-e',), NVIDIA, 'N', _as('--num-epochs'), '--num-epochs'),
    Spelling(('-l',), NVIDIA, 'LR',
             _refused("the runner's learning rate per 256 images: --lr is the peak rate "
                      'itself (default: 0.256 per 256 images, the runner\'s -l 0.256)'),
             'refused: --lr'),
    Spelling(('--benchmark-iters',), NVIDIA, 'N', _as('--max-batches'), '--max-batches'),
    Spelling(('--disp-batches',), NVIDIA, 'N', _as('--log-interval'), '--log-interval'),
    Spelling(('--model-prefix',), NVIDIA, 'P', _as('--save-prefix'), '--save-prefix'),
    Spelling(('--workspace',), NVIDIA, 'DIR', _as('--save-dir'), '--save-dir'),
    Spelling(('--log',), NVIDIA, 'FILE', _as('--logging-file'), '--logging-file'),
    Spelling(('--dllogger-log',), NVIDIA, 'PATH', _as('--json-log'),
             "--json-log (the same records; lines without dllogger's 'DLLL ' prefix)"),
)
_BY_FLAG = {flag: spelling for spelling in SPELLINGS for flag in spelling.flags}
_FLOAT32 = ('float32', 'fp32')


def translate(argv):
    """`argv` in this script's spellings, and what was read how (lines to log).

    Raises `UsageError` (one line) for a spelling that is refused, or that lacks
    its value.
    """
    words, notes, amp = [], [], False
    index = 0
    while index < len(argv):
        word = argv[index]
        index += 1
        if word == '--':
            words += argv[index - 1:]
            break
        flag, value = word, None
        if word.startswith('--') and '=' in word:
            flag, value = word.split('=', 1)
        elif len(word) > 2 and not word.startswith('--') and word[:2] in _BY_FLAG:
            flag, value = word[:2], word[2:]          # -j8
        spelling = _BY_FLAG.get(flag)
        if spelling is None:
            words.append(word)
            continue
        if spelling.metavar is None and value is not None:
            raise UsageError('argument %s: ignored explicit argument %r' % (flag, value))
        if spelling.metavar is not None and value is None:
            if index == len(argv):
                raise UsageError('argument %s: expected one argument' % flag)
            value, index = argv[index], index + 1
        rewritten = spelling.rewrite(flag, value)
        words += rewritten
        amp = amp or flag == '--amp'
        if flag != '--mode' or rewritten != [flag, value]:
            notes.append('%s (%s): %s' % (' '.join(w for w in (flag, value) if w),
                                          spelling.origin, ' '.join(rewritten) or
                                          spelling.meaning))
    if amp:
        words = _with_amp(words)
    return words, notes


def _with_amp(words):
    """NVIDIA's --amp: mixed precision on an FP32 network, i.e. --dtype auto, unless
    --dtype names a low precision already."""
    end = words.index('--') if '--' in words else len(words)
    dtype = None
    for index, word in enumerate(words[:end]):
        if word == '--dtype' and index + 1 < end:
            dtype = words[index + 1]
        elif word.startswith('--dtype='):
            dtype = word.split('=', 1)[1]
    if dtype is None or dtype.lower() in _FLOAT32:
        return words[:end] + ['--dtype', 'auto'] + words[end:]
    return words


def _help():
    lines = textwrap.wrap("Spellings of gluoncv's and NVIDIA's ImageNet scripts, read as this "
                          "script's options or refused with one line naming them:", 79)
    for spelling in SPELLINGS:
        flags = ', '.join(flag + ('' if spelling.metavar is None else ' ' + spelling.metavar)
                          for flag in spelling.flags)
        text = textwrap.wrap('%s (%s)' % (spelling.meaning, spelling.origin), 48,
                             break_on_hyphens=False)
        if len(flags) > 28:
            lines.append('  ' + flags)
        else:
            lines.append('  %-28s %s' % (flags, text.pop(0)))
        lines += [' ' * 31 + line for line in text]
    return '\n'.join(lines + [''] + textwrap.wrap(
        'The same names with the same meaning: --model, --dtype, --batch-size (per device, '
        "gluoncv's), --num-gpus, --gpus, --num-epochs, --lr, --lr-mode, --lr-decay, "
        '--lr-decay-epoch, --warmup-epochs, --warmup-lr, --wd, --no-wd, --last-gamma, '
        '--label-smoothing, --mixup, --mixup-alpha, --mixup-off-epoch, --save-dir, '
        "--save-frequency, --resume-epoch (gluoncv's: the epochs done), --log-interval, "
        "--logging-file (gluoncv's); --data-train, --data-val and their -idx, --image-shape, "
        "--num-examples, --num-classes, --seed, --kv-store, --optimizer, --mode, --load "
        "(NVIDIA's).  Other defaults: --optimizer sgd (gluoncv: nag), --label-smoothing 0.1 "
        '(gluoncv: off), --dtype auto, --lr 0.256 per 256 images, --momentum 0.875, '
        '--save-dir runs/<prefix>.', 79, break_on_hyphens=False))


HELP = _help()
