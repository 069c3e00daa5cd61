"""The command line of train_imagenet.py: its options, their checks, and which of them a
resumed run must keep.

`build_parser` and `check_args` turn the arguments into a namespace or a
`UsageError` (one line, exit status 2).  `RESUME_CHECKED`, `RESUME_FIXED` and
`RESUME_FREE` sort every option by what a resume may do with it (the
checkpoint side: `imagenet.resume`).  Other tools' spellings: `imagenet.spellings`.
"""
import argparse
import math
import os

from mxamp.dtypes import resolve_dtype

PROG = 'train_imagenet.py'
DTYPES = ('float32', 'float16', 'bfloat16', 'auto')
OPTIMIZERS = ('sgd', 'nag')
LR_MODES = ('cosine', 'step', 'linear', 'poly')
MODES = ('train_val', 'train', 'val')
RUNS_DIR = 'runs'        # the default --save-dir is runs/<prefix>, git-ignored in the checkout


class UsageError(Exception):
    """Bad input: reported as one line (a refused resume: one per setting), exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends ``(default: X)`` to an option's help where a default exists and the
    help does not state it already (a default that depends on other options is
    written into the help by hand); the epilog keeps its line breaks (a table)."""

    def _get_help_string(self, action):
        text = action.help or ''
        if action.default is None or action.default is False or action.default in ('', []) \
                or action.default is argparse.SUPPRESS or 'default' in text:
            return text
        return (text + ' ' if text else '') + '(default: %(default)s)'


def build_parser(description=None, epilog=''):
    """The command-line parser (argument names follow GluonCV's train_imagenet.py).

    `description` heads the ``--help`` (train_imagenet.py gives its docstring's first
    line); `epilog` is added to its end (train_imagenet.py gives the table of other
    tools' spellings).  Options are matched whole: no abbreviations.
    """
    p = _Parser(prog=PROG, description=description, formatter_class=_HelpFormatter,
                allow_abbrev=False,
                epilog='Examples, outputs and multi-process runs: see the docstring at the\n'
                       'top of this script.' + ('\n\n' + epilog if epilog else ''))
    data = p.add_argument_group('data')
    data.add_argument('--data-train', metavar='REC',
                      help='training RecordIO file (its .idx beside it, or --data-train-idx)')
    data.add_argument('--data-train-idx', metavar='IDX',
                      help="--data-train's index (default: the .idx beside it)")
    data.add_argument('--data-val', metavar='REC',
                      help='validation RecordIO file (its .idx beside it, or --data-val-idx)')
    data.add_argument('--data-val-idx', metavar='IDX',
                      help="--data-val's index (default: the .idx beside it)")
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
    model.add_argument('--last-gamma', action='store_true',
                       help='initialise to zero the gamma of the last BatchNorm of each '
                            "residual block's branch (the blocks with a shortcut of GluonCV's "
                            'ResNets; with --symbol resnet, each unit\'s last BatchNorm): every '
                            'block starts as the identity')
    model.add_argument('--load', metavar='PARAMS',
                       help="start from these parameters, not random ones: save_parameters' "
                            "names (*-best.params, a checkpoint's .params, a model-zoo file), "
                            "with --symbol mx.model.save_checkpoint's arg:/aux: names; every "
                            "name and shape must be the network's (--resume auto: used when "
                            'there is no checkpoint)')
    train = p.add_argument_group('training')
    train.add_argument('--mode', default='train_val', type=str.lower, choices=MODES,
                       help="train_val: train, validate after each epoch; train: no "
                            'validation; val: only evaluate the --load parameters, else the '
                            'newest checkpoint in --save-dir (--resume-epoch E: that one), on '
                            '--data-val: top-1 and top-5 printed and written to '
                            "<prefix>-eval.json.  gluoncv's --mode hybrid is train_val (the "
                            'network always runs as a graph)')
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
                       help='decay after the warm-up, to 0: cosine, step (by --lr-decay at '
                            "--lr-decay-epoch), linear or poly (power 2, gluoncv's)")
    train.add_argument('--lr-decay', type=float, default=0.1,
                       help='factor of --lr-mode step')
    train.add_argument('--lr-decay-epoch', default='30,60,80', metavar='E,E,...',
                       help='epochs of --lr-mode step')
    train.add_argument('--warmup-epochs', type=float, default=5, metavar='E',
                       help='linear warm-up from --warmup-lr to --lr (fractions allowed)')
    train.add_argument('--warmup-lr', type=float, default=0.0, metavar='LR',
                       help='the learning rate the warm-up starts from')
    train.add_argument('--label-smoothing', type=float, nargs='?', const=0.1, default=0.1,
                       metavar='EPS',
                       help="epsilon of label smoothing, 0 disables it (default: 0.1, "
                            "NVIDIA's; gluoncv's is 0); a bare --label-smoothing, gluoncv's "
                            'switch, means 0.1')
    train.add_argument('--mixup', type=float, nargs='?', const=True, default=False,
                       metavar='ALPHA',
                       help='train on mixed pairs: each batch (per device) with itself '
                            'reversed, images and labels weighted by one Beta(ALPHA, ALPHA) '
                            "draw per batch, as gluoncv does; bare: gluoncv's switch, ALPHA "
                            "from --mixup-alpha; --mixup ALPHA: NVIDIA's (0: off; NVIDIA draws "
                            'one weight per image); not with --symbol')
    train.add_argument('--mixup-alpha', type=float, metavar='ALPHA',
                       help='ALPHA of a bare --mixup (default: 0.2)')
    train.add_argument('--mixup-off-epoch', type=int, default=0, metavar='N',
                       help='train the last N epochs without mixup')
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
    out.add_argument('--save-dir', metavar='DIR',
                     help='checkpoints, metrics and train.log (default: runs/<prefix> in the '
                          "current directory, git-ignored in mxamp's checkout)")
    out.add_argument('--save-prefix', metavar='PREFIX',
                     help='file name prefix (default: the model name)')
    out.add_argument('--save-frequency', type=int, default=1, metavar='N',
                     help='checkpoint every N epochs (and after the last); besides, '
                          '<prefix>-best.params and <prefix>-best.json hold the epoch of the '
                          'best validation top-1 so far')
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
                          'label smoothing, mixup, --last-gamma, seed, number of GPUs, '
                          '--kv-store or number of workers (DMLC_NUM_WORKER).  Free to '
                          'change: --num-epochs with --lr-mode step (the cosine, linear and '
                          'poly schedules span it: extending them needs num-epochs here, and '
                          'the learning rate then jumps to the longer schedule), '
                          '--data-nthreads (the run is then not bit-exact), --data-dir, the '
                          'index files, which --gpus (not how many), --mode, --load, '
                          '--stop-at-epoch and the output and logging options.  Never: the '
                          'network (%s; start a new run).  The changes are logged and kept in '
                          'the checkpoints and the summary' % ', '.join(
                              name.lstrip('-') for name in RESUME_FIXED))
    out.add_argument('--stop-at-epoch', type=int, metavar='N',
                     help='end this run after epoch N (its checkpoint written); the schedule '
                          'still spans --num-epochs: split a run into jobs, then --resume')
    out.add_argument('--log-interval', type=int, default=10, metavar='N',
                     help='batches between progress-bar updates and --json-log records '
                          '(each one syncs the host)')
    out.add_argument('--logging-file', metavar='FILE',
                     help='the log file (default: train.log in --save-dir); worker r > 0 of '
                          'a distributed run writes FILE with -rank<r> before its extension')
    out.add_argument('--json-log', metavar='PATH',
                     help="also log to PATH for other tools: one JSON object per line, "
                          "written whole, in NVIDIA dllogger's layout without its 'DLLL ' "
                          'prefix: {"timestamp", "datetime", "elapsedtime", "type", "step", '
                          '"data"}; step "PARAMETER" (the settings), [epoch, iteration] '
                          'every --log-interval batches ("train.loss", "train.ips", '
                          '"train.lr", "train.loss_scale", "train.skipped_steps"), [epoch] '
                          '(also "train.time", "val.accuracy", "val.top_k_accuracy_5", '
                          '"val.ips"), [] the summary; counted from 0, null where no figure.  '
                          'Worker 0 only; a resumed run appends')
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


def run_prefix(args):
    """The run's file name prefix: --save-prefix, else the model's name."""
    if args.save_prefix:
        return args.save_prefix
    return 'resnet%d_v%s' % (args.num_layers, args.resnet_version) if args.symbol else args.model


def check_args(args):
    """Validate what argparse cannot; raise `UsageError` with one line.

    Also settles what depends on other options: the --mixup switch and its alpha,
    and the default --save-dir.
    """
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
    if args.kv_store.lower() == 'horovod':
        raise UsageError("--kv-store horovod: Horovod is not supported; several processes run "
                         'with --kv-store dist_sync (scripts/launch_local.py on one machine)')
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
    _check_start(args)
    _settle_mixup(args)
    if not 0 <= args.warmup_lr:
        raise UsageError('--warmup-lr must be at least 0')
    if args.lr is not None and args.warmup_lr > args.lr:
        raise UsageError('--warmup-lr %g exceeds --lr %g: the warm-up rises to --lr'
                         % (args.warmup_lr, args.lr))
    if args.save_dir is None:
        args.save_dir = os.path.join(RUNS_DIR, run_prefix(args))


def _check_start(args):
    """--mode and --load against the resume options: what a run starts from."""
    if args.load is not None and not os.path.isfile(args.load):
        raise UsageError('--load %s: no such file' % args.load)
    if args.mode == 'val':
        if args.resume is not None or args.resume_override:
            raise UsageError('--mode val evaluates, it does not train: not with --resume or '
                             '--resume-override')
        if args.synthetic:
            raise UsageError('--mode val evaluates on --data-val: not with --synthetic')
        if args.load is not None and args.resume_epoch is not None:
            raise UsageError('--mode val evaluates --load or the checkpoint of --resume-epoch: '
                             'give only one of them')
    elif args.load is not None and (args.resume == 'newest' or args.resume_epoch is not None):
        raise UsageError('--load starts a new run from a parameter file, --resume and '
                         '--resume-epoch continue a checkpoint in --save-dir with its own: give '
                         'only one of them (--resume auto takes --load when there is no '
                         'checkpoint)')


def _settle_mixup(args):
    """--mixup as a switch (gluoncv) or with its alpha (NVIDIA's, 0: off): sets
    ``args.mixup`` (bool) and ``args.mixup_alpha`` (float)."""
    given_alpha = args.mixup_alpha
    if args.mixup is not True and args.mixup is not False:   # --mixup ALPHA
        if given_alpha is not None and given_alpha != args.mixup:
            raise UsageError('--mixup %g and --mixup-alpha %g: give the alpha once'
                             % (args.mixup, given_alpha))
        given_alpha, args.mixup = args.mixup, args.mixup != 0
    elif given_alpha is not None and not args.mixup:
        raise UsageError('--mixup-alpha %g without --mixup: mixup is off (add --mixup)'
                         % given_alpha)
    args.mixup_alpha = 0.2 if given_alpha is None or not args.mixup else given_alpha
    if args.mixup and not args.mixup_alpha > 0:
        raise UsageError('--mixup: alpha must be positive (0 turns mixup off)')
    if args.mixup and args.symbol:
        raise UsageError('--mixup: the Gluon path only (--model); --symbol resnet trains on '
                         'hard labels')
    if not 0 <= args.mixup_off_epoch <= args.num_epochs:
        raise UsageError('--mixup-off-epoch must lie in [0, --num-epochs]')


# ---------------------------------------------------------------------------------------
# Resume: which options a checkpoint records

# What a checkpoint records of its run (`run_settings`), named as the user sets them: what
# changes the numbers.  A resume refuses any difference that --resume-override does not
# name, except --num-epochs under --lr-mode step (`compare_settings`).
RESUME_CHECKED = ('--dataset', '--data-train', '--data-val', '--synthetic', '--num-examples',
                  '--num-classes', '--image-shape', '--model', '--symbol', '--num-layers',
                  '--resnet-version', '--last-gamma', '--dtype', '--loss-scale', '--batch-size',
                  '--num-epochs', '--max-batches', '--optimizer', '--lr', '--momentum', '--wd',
                  '--no-wd', '--lr-mode', '--lr-decay', '--lr-decay-epoch', '--warmup-epochs',
                  '--warmup-lr', '--label-smoothing', '--mixup', '--mixup-alpha',
                  '--mixup-off-epoch', '--seed', '--num-gpus', '--kv-store', 'DMLC_NUM_WORKER')
# The network that the checkpoint holds: no override, its files would not load into another
# network (or precision).
RESUME_FIXED = ('--model', '--symbol', '--num-layers', '--resnet-version', '--num-classes',
                '--image-shape', '--dtype')
# Options free to change on resume: they leave the numbers alone (--data-nthreads only the
# bit-exactness; --gpus names the devices, their number is checked as --num-gpus; --load
# and --mode val do not apply to a resumed run, --mode train only skips validation).
RESUME_FREE = ('--data-train-idx', '--data-val-idx', '--data-dir', '--data-nthreads', '--gpus',
               '--load', '--mode', '--save-dir', '--save-prefix', '--save-frequency',
               '--keep-checkpoints', '--resume', '--resume-epoch', '--resume-override',
               '--stop-at-epoch', '--log-interval', '--logging-file', '--json-log', '--verbose',
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
