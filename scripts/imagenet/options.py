"""The command line of train_imagenet.py: its options, their checks, and which of them a
resumed run must keep.

`build_parser` and `check_args` turn the arguments into a namespace or a
`UsageError` (one line, exit status 2).  `RESUME_CHECKED`, `RESUME_FIXED` and
`RESUME_FREE` sort every option by what a resume may do with it; the checkpoint
side of that comparison is `imagenet.resume`'s.
"""
import argparse
import math

from mxamp.dtypes import resolve_dtype

PROG = 'train_imagenet.py'
DTYPES = ('float32', 'float16', 'bfloat16', 'auto')
OPTIMIZERS = ('sgd', 'nag')
LR_MODES = ('cosine', 'step', 'linear')


class UsageError(Exception):
    """Bad input: reported as one line (a refused resume: one per setting), exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help where a default exists and the
    help does not state it already (a default that depends on other options is
    written into the help by hand)."""

    def _get_help_string(self, action):
        text = action.help or ''
        if action.default is None or action.default is False or action.default in ('', []) \
                or action.default is argparse.SUPPRESS or 'default' in text:
            return text
        return (text + ' ' if text else '') + '(default: %(default)s)'


def build_parser(description=None):
    """The command-line parser (argument names follow GluonCV's train_imagenet.py).

    `description` heads the ``--help`` (train_imagenet.py gives its docstring's first
    line).
    """
    p = _Parser(prog=PROG, description=description, formatter_class=_HelpFormatter,
                epilog='Examples, outputs and multi-process runs: see the docstring at the '
                       'top of this script.')
    data = p.add_argument_group('data')
    data.add_argument('--data-train', metavar='REC',
                      help='training RecordIO file (its .idx beside it)')
    data.add_argument('--data-val', metavar='REC',
                      help='validation RecordIO file (its .idx beside it)')
    data.add_argument('--dataset', choices=('imagenet', 'digits'), default='imagenet',
                      help="digits: scikit-learn's digits packed as RecordIO in --data-dir")
    data.add_argument('--data-dir', metavar='DIR',
                      help='cache directory of the digits RecordIO (default: ~/.mxamp/digits)')
    data.add_argument('--synthetic', action='store_true',
                      help='random data on the device, for throughput; no validation')
    data.add_argument('--num-classes', type=int, metavar='N',
                      help='classes of the classifier (default: 1000; with --dataset '
                           'digits, 10)')
    data.add_argument('--image-shape', metavar='C,H,W',
                      help='channels,height,width (default: 3,224,224; with --dataset '
                           'digits, 1,8,8)')
    data.add_argument('--num-examples', type=int, default=1281167, metavar='N',
                      help='images per epoch with --synthetic')
    data.add_argument('--data-nthreads', type=int, default=4, metavar='N',
                      help="decoding threads per iterator; MXNet 1.9.1's ImageRecordIter "
                           'uses at most max(1, CPUs/2 - 1) of them (the log says how many '
                           'ran; --resume is bit-exact only with the same number running)')
    model = p.add_argument_group('model')
    model.add_argument('--model', default='resnet50_v1b', metavar='NAME',
                       help='GluonCV model zoo name')
    model.add_argument('--symbol', choices=('resnet',),
                       help='train the Symbol-API network of symbols/ with mx.mod.Module '
                            'instead of --model')
    model.add_argument('--num-layers', type=int, default=50, choices=(18, 34, 50, 101, 152),
                       help='depth of --symbol resnet')
    model.add_argument('--resnet-version', default='1.5', choices=('1', '1.5'),
                       help='version of --symbol resnet')
    model.add_argument('--dtype', default='auto', metavar='DTYPE',
                       help='float32, float16, bfloat16 or auto (aliases fp32, fp16, half, '
                            'bf16); auto: float16 on GPUs, bfloat16 on CPUs with AVX512-BF16 '
                            'or AMX, float32 on other CPUs (where bfloat16 stores the '
                            'parameters in bfloat16 and computes in FP32)')
    model.add_argument('--loss-scale', default='auto', metavar='SCALE',
                       help="'auto' (dynamic for float16, none otherwise), 'dynamic', 'none' "
                            "or a fixed number")
    train = p.add_argument_group('training')
    train.add_argument('--batch-size', type=int, default=32, metavar='N',
                       help='images per device')
    train.add_argument('--num-epochs', type=int, default=90, metavar='N',
                       help='epochs of the whole training (the learning-rate schedule spans '
                            'them)')
    train.add_argument('--max-batches', type=int, metavar='N',
                       help='stop each epoch (training and validation) after N batches '
                            '(default: the whole data set)')
    train.add_argument('--optimizer', default='sgd', type=str.lower, choices=OPTIMIZERS,
                       help='SGD or NAG, with --momentum')
    train.add_argument('--lr', type=float,
                       help='peak learning rate (default: 0.256 per 256 images of the global '
                            'batch)')
    train.add_argument('--momentum', type=float, default=0.875,
                       help='momentum of --optimizer (0: none)')
    train.add_argument('--wd', type=float, default=1.0 / 32768,
                       help='weight decay (default: 1/32768)')
    train.add_argument('--no-wd', action='store_true',
                       help='exempt from weight decay the parameters named *_gamma or *_beta '
                            '(BatchNorm scale and shift) and *_bias (without it, --wd applies '
                            'to every parameter)')
    train.add_argument('--lr-mode', default='cosine', type=str.lower, choices=LR_MODES,
                       help='decay after the warm-up')
    train.add_argument('--lr-decay', type=float, default=0.1,
                       help='factor of --lr-mode step')
    train.add_argument('--lr-decay-epoch', default='30,60,80', metavar='E,E,...',
                       help='epochs of --lr-mode step')
    train.add_argument('--warmup-epochs', type=float, default=5, metavar='E',
                       help='linear warm-up from 0 (fractions allowed)')
    train.add_argument('--label-smoothing', type=float, default=0.1, metavar='EPS',
                       help='epsilon of label smoothing (0 disables it)')
    train.add_argument('--seed', type=int, default=0,
                       help='initial weights, data order and augmentation')
    dev = p.add_argument_group('devices')
    dev.add_argument('--gpus', default='', metavar='IDS',
                     help="GPU ids, e.g. '0,1' (default: --num-gpus, else the CPU)")
    dev.add_argument('--num-gpus', type=int, default=0, metavar='N',
                     help='use GPUs 0..N-1 (if no --gpus)')
    dev.add_argument('--kv-store', default='device',
                     help='device, local, dist_sync or dist_device_sync (used with several '
                          'devices or workers)')
    out = p.add_argument_group('output')
    out.add_argument('--save-dir', default='params', metavar='DIR',
                     help='checkpoints, metrics and train.log')
    out.add_argument('--save-prefix', metavar='PREFIX',
                     help='file name prefix (default: the model name)')
    out.add_argument('--save-frequency', type=int, default=1, metavar='N',
                     help='checkpoint every N epochs (and after the last)')
    out.add_argument('--keep-checkpoints', type=int, default=0, metavar='N',
                     help='keep only the newest N checkpoints (default: 0, all)')
    out.add_argument('--resume', nargs='?', const='newest', choices=('newest', 'auto'),
                     help="continue from the newest checkpoint in --save-dir (an error if "
                          "there is none) with the settings it records (see "
                          "--resume-override); --resume auto: the same, or start from "
                          "scratch when there is none (one command line for a job that may "
                          "be pre-empted and restarted)")
    out.add_argument('--resume-epoch', type=int, metavar='E',
                     help='continue from the checkpoint of epoch E (an error if it is missing)')
    out.add_argument('--resume-override', action='extend', type=_setting_names,
                     metavar='SETTING[,SETTING...]',
                     help='with --resume or --resume-epoch: let these settings differ from '
                          "the checkpoint's (named as the refusal prints them, without the "
                          'dashes, e.g. lr,batch-size; repeatable).  Without it a resume '
                          'stops (status 2, one line per difference) when a setting that '
                          'changes the numbers differs: the data, model, --dtype, batch '
                          'size, learning-rate schedule and warm-up, optimizer, loss scale, '
                          'label smoothing, seed, number of GPUs, --kv-store or number of '
                          'workers (DMLC_NUM_WORKER).  Free to change: --num-epochs with '
                          '--lr-mode step (the cosine and linear schedules span it: extending '
                          'them needs num-epochs here, and the learning rate then jumps to '
                          'the longer schedule), --data-nthreads (the run is then not '
                          'bit-exact), --data-dir, which --gpus (not how many), '
                          '--stop-at-epoch and the output and logging options.  Never: the '
                          'network (%s; start a new run).  The changes are logged and kept in '
                          'the checkpoints and the summary' % ', '.join(
                              name.lstrip('-') for name in RESUME_FIXED))
    out.add_argument('--stop-at-epoch', type=int, metavar='N',
                     help='end this run after epoch N (its checkpoint written); the schedule '
                          'still spans --num-epochs: split a run into jobs, then --resume')
    out.add_argument('--log-interval', type=int, default=10, metavar='N',
                     help='batches between progress-bar updates (each one syncs the host)')
    out.add_argument('--verbose', action='store_true',
                     help="also show MXNet's own log lines (its data iterators' set-up, "
                          "the oneDNN subgraph notice of a bound Module): hidden by default")
    out.add_argument('--no-progress', action='store_true',
                     help='no progress bar (the log lines still go to stderr and train.log)')
    out.add_argument('--plot', metavar='PNG',
                     help='write loss/accuracy curves and throughput to this PNG')
    out.add_argument('--compare', nargs='*', default=[], metavar='CSV',
                     help="other runs' *-metrics.csv to draw in the --plot")
    return p


def check_args(args):
    """Validate what argparse cannot; raise `UsageError` with one line."""
    if args.dtype.lower() != 'auto':
        try:
            resolve_dtype(args.dtype)   # the names (and aliases) the Python API takes
        except ValueError:
            raise UsageError('unknown dtype %r: expected one of %s (or fp32, fp16, half, bf16)'
                             % (args.dtype, ', '.join(DTYPES)))
    for name in ('batch_size', 'num_epochs', 'data_nthreads', 'log_interval', 'save_frequency'):
        if getattr(args, name) < 1:
            raise UsageError('--%s must be at least 1' % name.replace('_', '-'))
    for name in ('max_batches', 'stop_at_epoch', 'resume_epoch'):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError('--%s must be at least 1' % name.replace('_', '-'))
    if not 0 <= args.label_smoothing < 1:
        raise UsageError('--label-smoothing must lie in [0, 1)')
    if args.loss_scale not in ('auto', 'dynamic', 'none'):
        try:
            value = float(args.loss_scale)
        except ValueError:
            value = float('nan')
        if not (math.isfinite(value) and value > 0):
            raise UsageError("--loss-scale %r: expected 'auto', 'dynamic', 'none' or a positive "
                             "number" % args.loss_scale)
    if args.symbol is None:
        from gluoncv.model_zoo import get_model_list
        if args.model.lower() not in get_model_list():
            raise UsageError('unknown model %r: not in the GluonCV model zoo (e.g. '
                             'resnet50_v1b, resnet18_v1b, cifar_resnet20_v1)' % args.model)
    if args.resume == 'auto' and args.resume_epoch is not None:
        raise UsageError('--resume auto takes the newest checkpoint if any, --resume-epoch '
                         'names one: give only one of them')
    if args.resume_override and args.resume is None and args.resume_epoch is None:
        raise UsageError('--resume-override changes settings of a resumed run: give it with '
                         '--resume or --resume-epoch')
    try:
        [int(e) for e in args.lr_decay_epoch.split(',') if e.strip()]
    except ValueError:
        raise UsageError('--lr-decay-epoch %r: expected comma-separated epochs'
                         % args.lr_decay_epoch)


# ---------------------------------------------------------------------------------------
# Resume: which options a checkpoint records

# What a checkpoint records of its run (`run_settings`), named as the user sets them: what
# changes the numbers.  A resume refuses any difference that --resume-override does not
# name, except --num-epochs under --lr-mode step (`compare_settings`).
RESUME_CHECKED = ('--dataset', '--data-train', '--data-val', '--synthetic', '--num-examples',
                  '--num-classes', '--image-shape', '--model', '--symbol', '--num-layers',
                  '--resnet-version', '--dtype', '--loss-scale', '--batch-size', '--num-epochs',
                  '--max-batches', '--optimizer', '--lr', '--momentum', '--wd', '--no-wd',
                  '--lr-mode', '--lr-decay', '--lr-decay-epoch', '--warmup-epochs',
                  '--label-smoothing', '--seed', '--num-gpus', '--kv-store', 'DMLC_NUM_WORKER')
# The network that the checkpoint holds: no override, its files would not load into another
# network (or precision).
RESUME_FIXED = ('--model', '--symbol', '--num-layers', '--resnet-version', '--num-classes',
                '--image-shape', '--dtype')
# Options free to change on resume: they leave the numbers alone (--data-nthreads only the
# bit-exactness; --gpus names the devices, their number is checked as --num-gpus).
RESUME_FREE = ('--data-dir', '--data-nthreads', '--gpus', '--save-dir', '--save-prefix',
               '--save-frequency', '--keep-checkpoints', '--resume', '--resume-epoch',
               '--resume-override', '--stop-at-epoch', '--log-interval', '--verbose',
               '--no-progress', '--plot', '--compare')


def _setting_names(text):
    """The argparse type of --resume-override: 'lr,batch-size' -> ['--lr', '--batch-size']."""
    known = {name.lstrip('-'): name for name in RESUME_CHECKED}
    names = []
    for word in (w.strip() for w in text.split(',') if w.strip()):
        if word not in known:
            raise argparse.ArgumentTypeError(
                '%r is not a setting that a checkpoint records (%s)'
                % (word, ', '.join(w for w, name in known.items() if name not in RESUME_FIXED)))
        if known[word] in RESUME_FIXED:
            raise argparse.ArgumentTypeError(
                '%s: the network cannot change on resume (the checkpoint would not load into '
                'another): start a new run' % word)
        names.append(known[word])
    return names
