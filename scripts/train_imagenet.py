"""Train ResNet-50 (or any GluonCV classifier) on ImageNet with mixed precision.

float16 on NVIDIA GPUs, bfloat16 on CPUs with AVX512-BF16 or AMX (``--dtype
auto``), through mxamp.  On other CPUs MXNet's oneDNN has no bfloat16 kernels
(no AVX-512) or only slow emulated ones: ``auto`` is FP32 there, and ``--dtype
bfloat16`` stores the parameters in bfloat16 and computes in FP32.  The Gluon
path converts a GluonCV model with ``mxamp.convert`` and trains it with
``mxamp.Trainer``; the Symbol path (``--symbol resnet``) builds the
ResNet of ``symbols/`` and trains it with ``mx.mod.Module`` and
``mxamp.ModuleTrainer``.  Data is ImageNet in MXNet RecordIO (made
by ``im2rec``), read by ``ImageRecordIter``; ``--dataset digits`` packs
scikit-learn's handwritten digits into the same format for a run of a few
seconds, and ``--synthetic`` measures throughput without a data set.

Examples
--------
NVIDIA's published ResNet-50 v1.5 mixed-precision recipe on 8 GPUs (per-device
batch 256: SGD momentum 0.875, lr 0.256 per 256 images, 5 warm-up epochs,
cosine decay, label smoothing 0.1, weight decay 1/32768 but none on
BatchNorm and biases)::

    python scripts/train_imagenet.py --data-train train.rec --data-val val.rec \\
        --model resnet50_v1b --dtype float16 --gpus 0,1,2,3,4,5,6,7 --batch-size 256 \\
        --num-epochs 90 --lr-mode cosine --warmup-epochs 5 --label-smoothing 0.1 \\
        --momentum 0.875 --wd 3.0517578125e-05 --no-wd --save-dir runs/r50_fp16

The same with the Symbol API: ``--symbol resnet --num-layers 50`` instead of
``--model``.  On a CPU: ``--dtype auto`` (or ``bfloat16``).  The log and the
summary say how the precision ran (native, or bfloat16 storage with FP32
compute) and on which CPU class.  Continue after an interruption, bit-exactly:
add ``--resume``.  It continues the run that the checkpoint records: a setting
that changes the numbers (data, model, precision, batch, schedule, optimizer,
loss scaling, seed, devices, workers) must be the same, or be named in
``--resume-override`` (``--help`` says what may change freely).  A job that may
be pre-empted and restarted with the same command line: add ``--resume auto``
(continues from the newest checkpoint, or starts from scratch when there is
none, and logs which).  ``--no-progress`` hides the progress bar only; the log
lines go to stderr and ``train.log`` either way.

Seconds-long runs on built-in data (what ``make demo`` and the tests use)::

    python scripts/train_imagenet.py --dataset digits --model cifar_resnet20_v1 \\
        --dtype bfloat16 --num-epochs 15 --batch-size 64 --lr 0.1 --warmup-epochs 1 \\
        --save-dir runs/digits_bf16 --plot runs/digits_bf16/curves.png
    python scripts/train_imagenet.py --synthetic --model resnet50_v1b --dtype auto \\
        --batch-size 32 --max-batches 20 --num-epochs 1

Several processes with MXNet's distributed kvstore (``dist_sync``, ps-lite):
each worker reads its own part of the data and the gradients are summed
across workers (float16 gradients travel in float16).  On one machine,
``scripts/launch_local.py`` starts the scheduler, a server and N workers on
127.0.0.1 (MXNet's bundled ``tools/launch.py`` fails on Python 3.11)::

    python scripts/launch_local.py -n 2 -- python scripts/train_imagenet.py \\
        --kv-store dist_sync --dataset digits --model cifar_resnet20_v1 --num-epochs 3 \\
        --save-dir runs/dist

On a cluster, start the same processes by hand on the nodes (or through your
job scheduler).  Every process gets ``DMLC_PS_ROOT_URI=<scheduler host>
DMLC_PS_ROOT_PORT=9000 DMLC_NUM_SERVER=<S> DMLC_NUM_WORKER=<W>``, and
``DMLC_NODE_HOST=<its own address>`` on multi-homed hosts, then::

    node0$ DMLC_ROLE=scheduler python -c 'import mxnet'
    nodeK$ DMLC_ROLE=server    python -c 'import mxnet'         # S of them
    nodeK$ DMLC_ROLE=worker    python scripts/train_imagenet.py --kv-store dist_sync \\
               --data-train /data/train.rec --data-val /data/val.rec --gpus 0,1,2,3 ...

All workers must see the data at the same paths and run with the same
arguments.  Worker 0 writes its checkpoints to ``--save-dir``, worker r > 0 to
``--save-dir/rank<r>`` (the copies are identical; keeping them apart avoids
concurrent writes to one file on shared storage).  If a worker dies, the
launcher stops the others (they would wait for it for ever); the same launch
with ``--resume`` continues every worker from the newest epoch that all of
them hold (a worker killed during a save lacks that epoch's copy; then it reads
rank 0's copy if it sees ``--save-dir``, else all go back one epoch).

Outputs in ``--save-dir`` (``<prefix>`` is ``--save-prefix``, by default the
model name): ``<prefix>-<epoch>.params`` (FP32 values, loadable by an FP32
network), ``<prefix>-<epoch>.states`` (optimizer state, FP32 master weights,
loss scaler), ``<prefix>-<epoch>.json`` (epoch, step, seeds, metrics, the run's
settings and those changed by ``--resume-override``),
``<prefix>-metrics.csv`` (one row per epoch: learning rate and loss scale at
its end, training loss, validation top-1/top-5, img/s, seconds, steps skipped
for inf/NaN gradients in the epoch and in total, peak RSS),
``<prefix>-summary.json`` and ``train.log``.  Bad input (missing data, unknown
model or dtype, nothing to resume) prints one line and exits with status 2.

Internals relied on (MXNet 1.9.1 and mxamp):

* ``gluon.nn.Conv2D._channels`` (the stem's width, to replace it for small
  images);
"""
import argparse
import csv
import hashlib
import json
import logging
import math
import os
import random
import re
import resource
import sys
import textwrap
import time
import warnings

import numpy as np
from tqdm import tqdm

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):   # digits_rec; the repository's symbols/
    if _path not in sys.path:
        sys.path.insert(0, _path)

# mxamp before any MXNet operator runs: it selects oneDNN's AMX kernels at import.
import mxamp  # noqa: E402
import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from mxamp import hardware, kvkeys, kvstore_transport  # noqa: E402
from mxamp.hardware import resolve_dtype  # noqa: E402

_LOG = logging.getLogger('train_imagenet')
PROG = 'train_imagenet.py'
DTYPES = ('float32', 'float16', 'bfloat16', 'auto')
OPTIMIZERS = ('sgd', 'nag')
LR_MODES = ('cosine', 'step', 'linear')
IMAGENET_MEAN = (123.68, 116.779, 103.939)
IMAGENET_STD = (58.393, 57.12, 57.375)
# skipped_in_epoch: steps skipped (inf/NaN gradients) in this epoch; skipped_total: since
# the start of the training, across resumes.  loss_scale and lr: at the end of the epoch.
CSV_FIELDS = ('epoch', 'lr', 'train_loss', 'val_top1', 'val_top5', 'img_per_sec', 'epoch_time',
              'loss_scale', 'skipped_in_epoch', 'skipped_total', 'peak_rss_mb')


class UsageError(Exception):
    """Bad input: reported as one line (a refused resume: one per setting), exit status 2."""


# ---------------------------------------------------------------------------------------
# Command line

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


def build_parser():
    """The command-line parser (argument names follow GluonCV's train_imagenet.py)."""
    p = _Parser(prog=PROG, description=__doc__.splitlines()[0], formatter_class=_HelpFormatter,
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


def _parse_shape(text):
    try:
        shape = tuple(int(v) for v in text.split(','))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise UsageError("--image-shape %r: expected 'channels,height,width', e.g. 3,224,224"
                         % text)
    return shape


def _contexts(args):
    ids = [int(i) for i in args.gpus.split(',') if i.strip()] if args.gpus else \
        list(range(args.num_gpus))
    return [mx.gpu(i) for i in ids] or [mx.cpu()]


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
# Data

class DataSpec(object):
    """What the data iterators and the network need to know about the data set."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _index_of(rec, flag):
    idx = os.path.splitext(rec)[0] + '.idx'
    if not os.path.isfile(rec):
        raise UsageError('%s %s: no such file' % (flag, rec))
    if not os.path.isfile(idx):
        raise UsageError('%s %s: its index %s is missing (im2rec writes both)' % (flag, rec, idx))
    with open(idx) as handle:
        count = sum(1 for line in handle if line.strip())
    return idx, count


def resolve_data(args):
    """A `DataSpec` for the arguments; packs the digits when needed."""
    spec = DataSpec(synthetic=args.synthetic, train_rec=None, val_rec=None, num_val=0,
                    num_classes=1000, image_shape=(3, 224, 224), mean=IMAGENET_MEAN,
                    std=IMAGENET_STD, augment='imagenet', num_train=args.num_examples)
    if args.dataset == 'digits' and not args.synthetic:
        import digits_rec
        info = digits_rec.prepare(args.data_dir)
        spec.train_rec = args.data_train or info['train_rec']
        spec.val_rec = args.data_val or info['val_rec']
        spec.num_classes, spec.image_shape = info['num_classes'], tuple(info['image_shape'])
        spec.mean, spec.std, spec.augment = (info['mean'],), (info['std'],), 'digits'
    elif args.dataset == 'digits':
        spec.num_classes, spec.image_shape = 10, (1, 8, 8)
    elif not args.synthetic:
        if not args.data_train:
            raise UsageError('--data-train is required (or --dataset digits, or --synthetic)')
        spec.train_rec, spec.val_rec = args.data_train, args.data_val
    if args.num_classes is not None:
        spec.num_classes = args.num_classes
    if args.image_shape is not None:
        spec.image_shape = _parse_shape(args.image_shape)
    if spec.train_rec:
        spec.train_idx, spec.num_train = _index_of(spec.train_rec, '--data-train')
    if spec.val_rec:
        spec.val_idx, spec.num_val = _index_of(spec.val_rec, '--data-val')
    channels = spec.image_shape[0]
    if channels not in (1, 3):
        raise UsageError('--image-shape: 1 or 3 channels, got %d' % channels)
    spec.mean, spec.std = (spec.mean * 3)[:channels], (spec.std * 3)[:channels]
    return spec


def _normalisation(spec):
    keys = ('r', 'g', 'b')[:len(spec.mean)]
    out = {'mean_' + k: m for k, m in zip(keys, spec.mean)}
    out.update({'std_' + k: s for k, s in zip(keys, spec.std)})
    return out


def decoding_threads(requested):
    """How many threads MXNet 1.9.1's ``ImageRecordIter`` decodes with when asked for
    `requested` (``preprocess_threads``).

    Its parser caps the request at max(1, CPUs / 2 - 1), CPUs as OpenMP counts
    them, those this process may run on ("be conservative, set number of real
    cores", ``src/io/iter_image_recordio_2.cc``): one thread on 2 CPUs, 7 on 16.
    Each decoding thread has its own augmentation RNG, so this number, not the
    request, decides the augmentations.
    """
    return max(1, min(requested, usable_cpus() // 2 - 1))


def usable_cpus():
    """The CPUs this process may run on (its affinity mask), as OpenMP counts them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()


def train_iter(spec, args, batch_size, epoch, rank, num_workers):
    """A fresh training ``ImageRecordIter`` for `epoch`.

    One iterator per epoch, seeded from (seed, epoch, rank): its shuffle and
    augmentations depend on nothing else, which is what makes ``--resume``
    bit-exact (given the same number of decoding threads, `decoding_threads`:
    each has its own augmentation RNG).
    """
    seed = _derived_seed(args.seed, epoch, rank, 'data')
    common = dict(path_imgrec=spec.train_rec, path_imgidx=spec.train_idx, shuffle=True,
                  seed=seed, seed_aug=seed, batch_size=batch_size, data_shape=spec.image_shape,
                  preprocess_threads=args.data_nthreads, num_parts=num_workers,
                  part_index=rank, round_batch=True, verbose=args.verbose,
                  **_normalisation(spec))
    if spec.augment == 'digits':
        # Shifts of up to one pixel; mirroring or rescaling would turn digits into others.
        return mx.io.ImageRecordIter(rand_crop=True, pad=1, fill_value=0, **common)
    return mx.io.ImageRecordIter(random_resized_crop=True, min_random_area=0.08,
                                 max_random_area=1.0, min_aspect_ratio=3.0 / 4,
                                 max_aspect_ratio=4.0 / 3, rand_mirror=True, **common)


def val_iter(spec, args, batch_size):
    """Validation iterator: resize (256 for 224) and centre crop; None without val data.

    Make a new one for every pass: with ``round_batch`` a reset iterator starts
    after the images it wrapped around to fill its last batch.
    """
    if not spec.val_rec:
        return None
    extra = {}
    if spec.augment == 'imagenet':
        extra['resize'] = int(math.ceil(spec.image_shape[1] * 256.0 / 224))
    return mx.io.ImageRecordIter(path_imgrec=spec.val_rec, path_imgidx=spec.val_idx,
                                 shuffle=False, batch_size=batch_size,
                                 data_shape=spec.image_shape,
                                 preprocess_threads=args.data_nthreads, round_batch=True,
                                 verbose=args.verbose, **dict(extra, **_normalisation(spec)))


class SyntheticIter(object):
    """`num_batches` copies of one random batch, already on the first device."""

    def __init__(self, spec, batch_size, num_batches, ctx):
        self.data = mx.nd.random.uniform(-1, 1, shape=(batch_size,) + spec.image_shape, ctx=ctx)
        self.label = mx.nd.array(np.random.randint(0, spec.num_classes, batch_size), ctx=ctx)
        self.num_batches = num_batches

    def __iter__(self):
        for _ in range(self.num_batches):
            yield mx.io.DataBatch(data=[self.data], label=[self.label], pad=0)


def _derived_seed(seed, epoch, rank, what):
    # Distinct, reproducible 31-bit seeds per (run seed, epoch, worker, purpose).
    key = '%d/%d/%d/%s' % (seed, epoch, rank, what)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], 'little') >> 1


def seed_everything(seed):
    """Seed MXNet (every device), numpy and Python's `random`."""
    mx.random.seed(seed)
    np.random.seed(seed)
    random.seed(seed)


# ---------------------------------------------------------------------------------------
# Learning rate, loss scale

def lr_scheduler(args, base_lr, steps_per_epoch):
    """MXNet's own scheduler for --lr-mode, with linear warm-up from 0.

    Counted in optimizer updates: skipped (overflowing) float16 steps do not
    advance the schedule.  MXNet's schedulers pickle with the optimizer, so the
    schedule is part of the checkpoint.
    """
    warmup = int(round(args.warmup_epochs * steps_per_epoch))
    total = max(args.num_epochs * steps_per_epoch, warmup + 1)
    if args.lr_mode == 'cosine':
        return mx.lr_scheduler.CosineScheduler(total, base_lr=base_lr, final_lr=0,
                                               warmup_steps=warmup, warmup_begin_lr=0)
    if args.lr_mode == 'linear':
        return mx.lr_scheduler.PolyScheduler(total, base_lr=base_lr, pwr=1, final_lr=0,
                                             warmup_steps=warmup, warmup_begin_lr=0)
    steps = sorted({int(e) * steps_per_epoch for e in args.lr_decay_epoch.split(',')
                    if e.strip() and int(e) * steps_per_epoch > warmup})
    if not steps:   # MultiFactorScheduler needs at least one step
        steps = [total + 1]
    return mx.lr_scheduler.MultiFactorScheduler(steps, factor=args.lr_decay, base_lr=base_lr,
                                                warmup_steps=warmup, warmup_begin_lr=0)


def _loss_scale_arg(text):
    """The ``loss_scale`` argument of mxamp.Trainer for --loss-scale (already checked)."""
    if text in ('auto', 'dynamic'):
        return text
    return None if text == 'none' else float(text)


def _loss_scaling(scaler):
    """'dynamic', 'fixed' or 'off': how a trainer's loss scaler (or None) scales."""
    if scaler is None:
        return 'off'
    return 'dynamic' if scaler.dynamic else 'fixed'


def _current_lr(optimizer):
    if optimizer.lr_scheduler is None:
        return optimizer.lr
    return optimizer.lr_scheduler(optimizer.num_update)


def _no_wd(name):
    return name.endswith(('_gamma', '_beta', '_bias'))


# ---------------------------------------------------------------------------------------
# Gradient reduction for bfloat16 across workers

# Keys for BatchNorm statistics (consecutive from this one), clear of every other key.
_STATS_KEY = kvkeys.reserved_key('statistics')


def average_statistics(kvstore, stats, initialized):
    """Replace running statistics by their mean over devices and workers.

    Data-parallel workers see different images, so their BatchNorm running
    means and variances drift apart (the weights do not).  Averaging them at the
    end of each epoch makes every worker validate and checkpoint the same model.

    Parameters
    ----------
    kvstore : mx.kv.KVStore
    stats : list of list of NDArray
        Per statistic, its array on every device.
    initialized : set
        Keys already initialised in `kvstore` (updated here).
    """
    for index, per_device in enumerate(stats):
        key = _STATS_KEY + index
        if key not in initialized:
            kvstore_transport.init_zeros(kvstore, key, per_device[0])
            initialized.add(key)
        kvstore_transport.pushpull(kvstore, key, per_device)
        for array in per_device:
            array *= 1.0 / (kvstore.num_workers * len(per_device))


# Key of the resume agreement, clear of every other key.
_RESUME_KEY = kvkeys.reserved_key('resume')
_RESUME_SLOTS = 4096


def common_epochs(kvstore, epochs):
    """Of `epochs` (this worker's complete checkpoints), those every worker has.

    A worker killed during a save has one checkpoint fewer than the others;
    resuming workers from different epochs would train different models and
    hang at the end.  One push-pull of a vector with a 1 per epoch held;
    epochs from 4096 on are ignored.  Every worker must call it.
    """
    held = np.zeros(_RESUME_SLOTS, dtype=np.float32)
    for epoch in epochs:
        if 0 <= epoch < _RESUME_SLOTS:
            held[epoch] = 1.0
    counts = mx.nd.array(held)
    kvstore.init(_RESUME_KEY, mx.nd.zeros(_RESUME_SLOTS))
    kvstore.pushpull(_RESUME_KEY, counts, out=counts)
    return [int(e) for e in np.nonzero(counts.asnumpy() >= kvstore.num_workers)[0]]


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


class GluonRunner(object):
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

    @property
    def optimizer(self):
        return self.trainer.optimizer

    @property
    def loss_scale(self):
        return self.trainer.loss_scale

    @property
    def skipped_steps(self):
        return self.trainer.skipped_steps

    def statistics(self):
        """Per running statistic (BatchNorm mean/variance), its array on every device."""
        return [p.list_data() for p in self.net.collect_params().values()
                if p.grad_req == 'null']

    def _targets(self, label):
        k, eps = self.num_classes, self.smoothing
        return mx.nd.one_hot(label, k, on_value=1.0 - eps + eps / k, off_value=eps / k)

    def train_batch(self, batch):
        """One step; returns the summed per-sample loss (NDArray) and whether it applied."""
        xs = gluon.utils.split_and_load(batch.data[0], self.contexts, even_split=False)
        ys = gluon.utils.split_and_load(batch.label[0], self.contexts, even_split=False)
        with autograd.record():
            losses = [self.loss_fn(self.net(x), self._targets(y)) for x, y in zip(xs, ys)]
            with self.trainer.scale_loss(losses) as scaled:
                autograd.backward(scaled)
        applied = self.trainer.step(self.global_batch)
        total = sum(loss.sum().as_in_context(mx.cpu()) for loss in losses)
        return total, applied

    def predict(self, batch):
        xs = gluon.utils.split_and_load(batch.data[0], self.contexts, even_split=False)
        return [self.net(x) for x in xs], \
            gluon.utils.split_and_load(batch.label[0], self.contexts, even_split=False)

    def save(self, params_file, states_file):
        self.net.save_parameters(params_file)
        self.trainer.save_states(states_file)

    def load(self, params_file, states_file):
        self.net.load_parameters(params_file, ctx=self.contexts)
        self.trainer.load_states(states_file)


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


class ModuleRunner(object):
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
        params = dict(_optimizer_params(args, base_lr, steps_per_epoch),
                      rescale_grad=1.0 / global_batch)
        self.trainer = mxamp.ModuleTrainer(mod, args.optimizer, params, kvstore=kvstore,
                                           loss_scale=_loss_scale_arg(args.loss_scale))
        # Explicit per name: MXNet's default (no decay unless *_weight) is not the recipe's.
        self.trainer.optimizer.set_wd_mult({name: 0.0 if args.no_wd and _no_wd(name) else 1.0
                                            for name in mod.get_params()[0]})
        self.mod = mod

    @property
    def optimizer(self):
        return self.trainer.optimizer

    @property
    def loss_scale(self):
        return self.trainer.loss_scale

    @property
    def skipped_steps(self):
        return self.trainer.skipped_steps

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

    def save(self, params_file, states_file):
        self.trainer.save_params(params_file)
        self.trainer.save_states(states_file)

    def load(self, params_file, states_file):
        self.trainer.load_params(params_file)
        self.trainer.load_states(states_file)


# ---------------------------------------------------------------------------------------
# Checkpoints

def _paths(directory, prefix, epoch):
    stem = os.path.join(directory, '%s-%04d' % (prefix, epoch))
    return stem + '.params', stem + '.states', stem + '.json'


def _fsync(path):
    """Flush a file's (or a directory's) contents to disk: a rename after it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(runner, directory, prefix, epoch, meta):
    """Write epoch `epoch`'s params, states and JSON, each atomically, JSON last.

    The JSON is the commit: a checkpoint counts only once its JSON exists, and
    the files of earlier epochs are never touched, so a kill (even ``kill -9``)
    at any moment leaves the previous checkpoint loadable.  Each file is written
    under a temporary name, flushed to disk and renamed; an older checkpoint of
    the same epoch (a run resumed from an earlier epoch) loses its JSON before
    any of its files is replaced, so a checkpoint never mixes two runs' files.
    """
    params_file, states_file, json_file = _paths(directory, prefix, epoch)
    tmp = '.tmp-%d' % os.getpid()
    try:
        runner.save(params_file + tmp, states_file + tmp)
        _fsync(params_file + tmp)
        _fsync(states_file + tmp)
        if os.path.exists(json_file):
            os.remove(json_file)
        os.replace(params_file + tmp, params_file)
        os.replace(states_file + tmp, states_file)
        with open(json_file + tmp, 'w') as handle:
            json.dump(dict(meta, epoch=epoch, params=os.path.basename(params_file),
                           states=os.path.basename(states_file)), handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(json_file + tmp, json_file)
        _fsync(directory)
    finally:
        for path in (params_file + tmp, states_file + tmp, json_file + tmp):
            if os.path.exists(path):
                os.remove(path)


_TMP_NAME = re.compile(r'\.tmp-(\d+)(\.mxamp-\d+\.tmp)?$')


def remove_stale_tmp(directory, prefix):
    """Delete temporary files that a killed run of `prefix` left in `directory`.

    A process killed during :func:`save_checkpoint` (or while rewriting the
    metrics) leaves ``<name>.tmp-<pid>`` files; they never count as a
    checkpoint.  Those of processes still alive are kept.  Returns the names
    removed.
    """
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        match = _TMP_NAME.search(name)
        if not (name.startswith(prefix + '-') and match):
            continue
        pid = int(match.group(1))
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
                continue            # its writer still runs
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        try:
            os.remove(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return sorted(removed)


def list_checkpoints(directory, prefix):
    """Epochs with a complete checkpoint (JSON and the files it names), ascending."""
    epochs = []
    if not os.path.isdir(directory):
        return epochs
    head = prefix + '-'
    for name in os.listdir(directory):
        if not (name.startswith(head) and name.endswith('.json')):
            continue
        stem = name[len(head):-len('.json')]
        if not stem.isdigit():
            continue
        try:
            with open(os.path.join(directory, name)) as handle:
                meta = json.load(handle)
        except (OSError, ValueError):
            continue
        if all(os.path.isfile(os.path.join(directory, meta.get(k, '-'))) for k in
               ('params', 'states')):
            epochs.append(int(stem))
    return sorted(epochs)


def prune_checkpoints(directory, prefix, keep):
    """Delete all but the newest `keep` checkpoints (JSON first: never a half one)."""
    for epoch in list_checkpoints(directory, prefix)[:-keep] if keep else []:
        params_file, states_file, json_file = _paths(directory, prefix, epoch)
        for path in (json_file, params_file, states_file):
            if os.path.exists(path):
                os.remove(path)


# ---------------------------------------------------------------------------------------
# Resume: the run's settings

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


def run_settings(args, spec, dtype, contexts, num_workers, base_lr):
    """This run's settings that its checkpoints record: `RESUME_CHECKED` name -> value.

    Effective values where a default depends on other options (the learning rate,
    the data's classes and shape, ``auto`` dtype and loss scale): a resume is
    compared with what ran, not with how it was spelled.  A data file is recorded
    by absolute path and image count (the count sets the steps per epoch, hence
    the schedule).
    """
    def data_file(path, count):
        return '%s (%d images)' % (os.path.abspath(path), count) if path else None
    loss_scale = args.loss_scale
    if loss_scale == 'auto':
        loss_scale = 'dynamic' if dtype == 'float16' else 'none'
    elif loss_scale not in ('dynamic', 'none'):
        loss_scale = float(loss_scale)
    return {
        '--dataset': args.dataset,
        '--data-train': data_file(args.data_train and spec.train_rec, spec.num_train),
        '--data-val': data_file(args.data_val and spec.val_rec, spec.num_val),
        '--synthetic': args.synthetic,
        '--num-examples': args.num_examples,
        '--num-classes': spec.num_classes,
        '--image-shape': ','.join(str(n) for n in spec.image_shape),
        '--model': args.model,
        '--symbol': args.symbol,
        '--num-layers': args.num_layers,
        '--resnet-version': args.resnet_version,
        '--dtype': dtype,
        '--loss-scale': loss_scale,
        '--batch-size': args.batch_size,
        '--num-epochs': args.num_epochs,
        '--max-batches': args.max_batches,
        '--optimizer': args.optimizer,
        '--lr': base_lr,
        '--momentum': args.momentum,
        '--wd': args.wd,
        '--no-wd': args.no_wd,
        '--lr-mode': args.lr_mode,
        '--lr-decay': args.lr_decay,
        '--lr-decay-epoch': ','.join(str(int(e)) for e in args.lr_decay_epoch.split(',')
                                     if e.strip()),
        '--warmup-epochs': args.warmup_epochs,
        '--label-smoothing': args.label_smoothing,
        '--seed': args.seed,
        '--num-gpus': sum(c.device_type == 'gpu' for c in contexts),
        '--kv-store': args.kv_store,
        'DMLC_NUM_WORKER': num_workers,
    }


def _show(value):
    """A setting's value as a refusal line prints it."""
    if value is None:
        return 'none'
    if isinstance(value, bool):
        return 'on' if value else 'off'
    return repr(value) if isinstance(value, float) else str(value)


def _recorded_settings(meta):
    """A checkpoint's settings.  An earlier version of this script recorded none; what
    its other fields say stands in for them."""
    if 'settings' in meta:
        return meta['settings']
    stored = {name: meta[key] for key, name in (('dtype', '--dtype'), ('seed', '--seed'),
                                                ('num_workers', 'DMLC_NUM_WORKER'))
              if key in meta}
    if 'path' in meta:
        stored['--symbol'] = 'resnet' if meta['path'] == 'symbol' else None
    return stored


def compare_settings(stored, current, overrides):
    """The differences between a checkpoint's settings and this run's.

    Returns ``(refused, overridden, free)``: the lines to refuse with (``--lr:
    checkpoint 0.1, now 0.2``), ``(name, checkpoint's value, this run's)`` of the
    differences that `overrides` (names) allows, and lines to log for those free
    to change.  Settings that `stored` lacks are not compared.
    """
    refused, overridden, free = [], [], []
    mode = current['--lr-mode']
    for name, now in current.items():
        if name not in stored or stored[name] == now:
            continue
        was = stored[name]
        line = '%s: checkpoint %s, now %s' % (name, _show(was), _show(now))
        if name == '--num-epochs' and stored.get('--lr-mode') == mode == 'step':
            # Step decays at fixed epochs: the schedule up to any epoch stays the same.
            free.append(line + ': free to change under --lr-mode step')
        elif name in overrides:
            overridden.append((name, was, now))
        elif name == '--num-epochs' and stored.get('--lr-mode') == mode:
            refused.append(line + ' (the %s schedule spans the epochs: the learning rate '
                                  'would jump)' % mode)
        else:
            refused.append(line)
    return refused, overridden, free


# The resume purpose's second key (kvkeys: a purpose may use the keys after its own).
_SETTINGS_KEY = _RESUME_KEY + 1


def refusing_workers(kvstore, refuses):
    """Ranks of the workers that refuse to resume; `refuses`: whether this one does.

    One push-pull of a vector with a 1 per refusing worker.  Every worker must
    call it.
    """
    flags = np.zeros(kvstore.num_workers, dtype=np.float32)
    flags[kvstore.rank] = float(refuses)
    value = mx.nd.array(flags)
    kvstore.init(_SETTINGS_KEY, mx.nd.zeros(kvstore.num_workers))
    kvstore.pushpull(_SETTINGS_KEY, value, out=value)
    return [int(rank) for rank in np.nonzero(value.asnumpy())[0]]


def check_resume_settings(meta, json_file, settings, args, kvstore):
    """Refuse to resume from `meta` (read from `json_file`) with other `settings`.

    Raises `UsageError` with one line per difference that --resume-override
    does not name; logs the others.  With a distributed `kvstore`, every worker
    must call it, and all refuse when one does: a worker that went on alone
    would wait for the others for ever.  Returns the run's overrides, earlier
    resumes' and this one's, for its checkpoints and summary.
    """
    current = json.loads(json.dumps(settings))    # as a checkpoint gives them back
    stored = _recorded_settings(meta)
    refused, overridden, free = compare_settings(stored, current, args.resume_override or ())
    refusing = refusing_workers(kvstore, bool(refused)) if kvstore is not None else []
    if refused:
        raise UsageError('\n'.join(refused + [
            '--resume: %s was written with the settings above: resume with them, or name '
            'those to change in --resume-override (see --help)' % json_file]))
    if refusing:
        raise UsageError('--resume: the settings of worker(s) %s differ from their checkpoint '
                         '(their output says which): no worker resumes'
                         % ', '.join(str(rank) for rank in refusing))
    unchecked = [name for name in current if name not in stored]
    if unchecked:
        _LOG.warning('--resume: %s does not record %s (an earlier version of this script wrote '
                     'it): not checked; this run\'s checkpoints record them', json_file,
                     ', '.join(unchecked))
    # Checkpoints of earlier versions record the request only (then decoding_threads of it).
    was = meta.get('decoding_threads', decoding_threads(meta.get('data_nthreads',
                                                                  args.data_nthreads)))
    now = decoding_threads(args.data_nthreads)
    if was != now:
        free.append('--data-nthreads: the checkpoint\'s run decoded on %d thread(s), this one '
                    'on %d: free to change, but the augmentation now differs from an '
                    'uninterrupted run\'s' % (was, now))
    for line in free:
        _LOG.info(line)
    records = list(meta.get('resume_overrides', []))
    for name, was, now in overridden:
        _LOG.warning('%s: checkpoint %s, now %s: changed by --resume-override', name,
                     _show(was), _show(now))
        records.append({'epoch': meta['epoch'], 'setting': name, 'checkpoint': was, 'now': now})
    return records


# ---------------------------------------------------------------------------------------
# Metrics, summary, plot

def peak_rss_mb():
    """Peak resident memory of this process so far, in MiB (Linux: ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def read_metrics(path):
    """Rows of a ``*-metrics.csv`` as dicts of floats (`CSV_FIELDS`; the epoch and
    the skipped-step counts as ints)."""
    with open(path, newline='') as handle:
        rows = [{k: float(v) if v not in ('', None) else float('nan') for k, v in row.items()}
                for row in csv.DictReader(handle)]
    total = 0
    for row in rows:
        if 'skipped_steps' in row:
            # A file of an earlier version of this script, whose skipped_steps was the
            # running total: a run resumed over it keeps its rows.
            row['skipped_total'] = row.pop('skipped_steps')
            row['skipped_in_epoch'] = row['skipped_total'] - total
        row['epoch'], row['skipped_in_epoch'] = int(row['epoch']), int(row['skipped_in_epoch'])
        total = row['skipped_total'] = int(row['skipped_total'])
    return rows


def write_metrics(path, rows):
    """Write the rows atomically (the file is rewritten each epoch: it is small)."""
    tmp = path + '.tmp-%d' % os.getpid()
    with open(tmp, 'w', newline='') as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, '') for k in CSV_FIELDS})
    os.replace(tmp, path)


def steady_img_per_sec(rows):
    """A run's throughput: the median over its epochs' img/s, the first epoch left out
    when there are more (it pays for graph construction and memory planning).  The
    summary's figure and the plot's bar."""
    speeds = [r['img_per_sec'] for r in rows]
    steady = speeds[1:] if len(speeds) > 1 else speeds
    return float(np.median(steady)) if steady else 0.0


def run_label(dtype, compute):
    """What a run's curve is, by its precision: 'FP32', 'bfloat16 (native)', or how an
    emulated precision ran ('bfloat16 storage, FP32 compute')."""
    if dtype == 'float32':
        return 'FP32'
    if compute == 'native':
        return '%s (native)' % dtype
    return compute if compute.startswith(dtype) else '%s (%s)' % (dtype, compute)


def compared_run(csv_path):
    """``(label, rows)`` of another run's ``*-metrics.csv`` for ``--compare``.

    The label names the run (its file prefix) and its precision, read from the
    summary beside the file, or from its newest checkpoint for a run that has not
    finished (which records the dtype, not how it computed).
    """
    directory = os.path.dirname(os.path.abspath(csv_path))
    prefix = os.path.basename(csv_path)[:-len('-metrics.csv')] \
        if csv_path.endswith('-metrics.csv') else os.path.basename(csv_path)
    summary = os.path.join(directory, '%s-summary.json' % prefix)
    epochs = list_checkpoints(directory, prefix)
    if os.path.isfile(summary):
        with open(summary) as handle:
            recorded = json.load(handle)
        precision = run_label(recorded['dtype'], recorded['compute'])
    elif epochs:
        with open(_paths(directory, prefix, epochs[-1])[2]) as handle:
            precision = json.load(handle)['dtype']
    else:
        precision = 'precision not recorded'
    return '%s: %s' % (prefix, precision), read_metrics(csv_path)


def plot_runs(runs, path, title=None, throughput=None):
    """PNG with training loss and validation top-1 per epoch, and throughput per run.

    Parameters
    ----------
    runs : list of (str, list of dict)
        A label and the metric rows (`read_metrics`) of each run.
    path : str
        Output PNG.
    title : str, optional
    throughput : (list of float, str), optional
        The bars' img/s, one per run, and what they are (the panel's title), for
        figures that a table shows beside the plot; by default each run's
        `steady_img_per_sec`, 'median epoch'.

    Returns
    -------
    matplotlib.figure.Figure
        The figure written (already closed).
    """
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, (ax_loss, ax_acc, ax_speed) = plt.subplots(1, 3, figsize=(11, 3.3))
    for label, rows in runs:
        epochs = [r['epoch'] for r in rows]
        ax_loss.plot(epochs, [r['train_loss'] for r in rows], marker='.', label=label)
        ax_acc.plot(epochs, [100 * r['val_top1'] for r in rows], marker='.', label=label)
    labels = [label for label, _ in runs]
    speeds, what = throughput or ([steady_img_per_sec(rows) for _, rows in runs],
                                  'median epoch')
    ax_loss.set(xlabel='epoch', ylabel='training loss', title='loss')
    ax_acc.set(xlabel='epoch', ylabel='top-1 (%)', title='validation accuracy')
    bars = ax_speed.bar(range(len(speeds)), speeds, color=['C%d' % i for i in range(len(speeds))])
    ax_speed.set_xticks(range(len(labels)))
    ax_speed.set_xticklabels([textwrap.fill(label, 20) for label in labels], fontsize=8)
    ax_speed.set(ylabel='img/s', title='training throughput (%s)' % what)
    for bar, value in zip(bars, speeds):
        ax_speed.annotate('%.0f' % value, (bar.get_x() + bar.get_width() / 2, value),
                          ha='center', va='bottom', fontsize=8)
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # epochs, not 1.25, 1.5, ...
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return fig


def describe_precision(dtype, contexts):
    """How `dtype` computes on `contexts`, and why: ``(how, why)``, two phrases.

    `how` is ``'FP32'``, ``'native'``, ``'bfloat16 storage, FP32 compute'``
    (bfloat16 on a CPU without native bfloat16: mxamp stores the parameters in
    bfloat16 and every op computes in FP32) or ``'float16 storage, GEMMs in
    FP32'`` (float16 on a CPU, which has no float16 GEMM).  `why` names the
    device: the CPU class (`mxamp.hardware.describe_cpu_class`) or ``'GPU'``.
    """
    if contexts[0].device_type == 'gpu':
        return ('FP32' if dtype == 'float32' else 'native'), 'GPU'
    why = hardware.describe_cpu_class()
    if dtype == 'bfloat16':
        return ('native' if hardware.computes_bfloat16() else 'bfloat16 storage, FP32 compute'), why
    if dtype == 'float16':
        return 'float16 storage, GEMMs in FP32', why
    return 'FP32', why


def _percent(fraction):
    """'12.34%', or '-' where there was no validation (None or NaN)."""
    return '-' if fraction is None or not math.isfinite(fraction) else '%.2f%%' % (100 * fraction)


def _format_summary(summary):
    return ('%s %s [%s] (%s): top-1 %s, top-5 %s, %.1f img/s, %d skipped steps in all, '
            'loss scale %g, peak RSS %.0f MiB, %.1f s of training'
            % (summary['model'], summary['dtype'], summary['compute'], summary['path'],
               _percent(summary['val_top1']), _percent(summary['val_top5']),
               summary['img_per_sec'],
               summary['skipped_steps'], summary['loss_scale'], summary['peak_rss_mb'],
               summary['train_time']))


# ---------------------------------------------------------------------------------------
# Main loop

class _ConsoleHandler(logging.StreamHandler):
    """Log lines to stderr through ``tqdm.write``: one logged while the progress bar
    shows lands above the bar instead of breaking its line."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def _log_warning(message, category, filename, lineno, file=None, line=None):
    # A replacement for warnings.showwarning: mxamp's warnings (float16 on a CPU, the
    # loss scale at its floor, ...) belong in train.log as much as on the console.
    _LOG.warning('%s: %s', category.__name__, message)


def _setup_logging(directory, rank):
    """Log to stderr and ``train.log`` in `directory`, Python warnings included.

    ``--no-progress`` hides the progress bar only: a batch job's console and log
    file keep every line.  `main` restores ``warnings.showwarning`` and closes the
    file.
    """
    handlers = [logging.FileHandler(os.path.join(directory, 'train.log')),
                _ConsoleHandler(sys.stderr)]
    fmt = '%(asctime)s ' + ('[worker %d] ' % rank if rank is not None else '') + '%(message)s'
    for handler in handlers:
        handler.setFormatter(logging.Formatter(fmt, datefmt='%H:%M:%S'))
    _close_logging()
    _LOG.handlers[:] = handlers
    _LOG.setLevel(logging.INFO)
    _LOG.propagate = False
    warnings.showwarning = _log_warning


def _close_logging():
    for handler in _LOG.handlers:
        handler.close()
    _LOG.handlers[:] = []


def _validate(runner, data_iter, max_batches):
    """Top-1 and top-5 accuracy over `data_iter` (a fresh iterator), or NaN without one."""
    if data_iter is None:
        return float('nan'), float('nan')
    top1 = mx.metric.Accuracy()
    top5 = mx.metric.TopKAccuracy(top_k=5)
    for index, batch in enumerate(data_iter):
        if max_batches is not None and index >= max_batches:
            break
        outputs, labels = runner.predict(batch)
        keep = batch.data[0].shape[0] - batch.pad
        # Padding (round_batch) fills the last batch with repeats: score real images only.
        for out, label in zip(outputs, labels):
            n = min(keep, out.shape[0])
            keep -= n
            if n:
                top1.update([label[:n]], [out[:n]])
                top5.update([label[:n]], [out[:n]])
    return top1.get()[1], top5.get()[1]


def _resume_point(args, save_dir, prefix, rank, dist_kvstore):
    """The checkpoint to continue from: ``(epoch, directory)``, or ``(None, None)``.

    None when no resume was asked for, or for ``--resume auto`` without a
    checkpoint (logged).  Raises `UsageError` when ``--resume`` or
    ``--resume-epoch`` finds none.  With `dist_kvstore`, every worker must call
    it: they agree on the newest epoch that all of them hold.
    """
    if args.resume is None and args.resume_epoch is None:
        return None, None
    own = list_checkpoints(save_dir, prefix)
    # Worker r > 0 may have been killed before its copy of a checkpoint was
    # complete; rank 0's copy (the same bytes) serves when this machine sees it.
    available = sorted(set(own) | set(list_checkpoints(args.save_dir, prefix)
                                      if rank > 0 else ()))
    if args.resume_epoch is not None:
        available = [e for e in available if e == args.resume_epoch]
    if dist_kvstore is not None:   # every worker must continue from the same epoch
        available = common_epochs(dist_kvstore, available)
    where = '%s in %s%s' % (prefix, save_dir,
                            '' if dist_kvstore is None else ' that every worker has')
    if available:
        epoch = available[-1]
        return epoch, save_dir if epoch in own else args.save_dir
    if args.resume_epoch is not None:
        raise UsageError('--resume-epoch %d: no checkpoint of that epoch of %s'
                         % (args.resume_epoch, where))
    if args.resume != 'auto':
        raise UsageError('--resume: no checkpoint of %s (--resume auto starts from scratch '
                         'then)' % where)
    _LOG.info('--resume auto: no checkpoint of %s: starting from scratch', where)
    return None, None


def train(args):
    """Run training for parsed, checked `args`; returns the summary dict."""
    spec = resolve_data(args)
    contexts = _contexts(args)
    kvstore = None
    rank, num_workers = 0, 1
    if 'dist' in args.kv_store or len(contexts) > 1:
        kvstore = mx.kv.create(args.kv_store)
        rank, num_workers = kvstore.rank, kvstore.num_workers
    distributed = kvstore is not None and 'dist' in kvstore.type
    prefix = args.save_prefix or (('resnet%d_v%s' % (args.num_layers, args.resnet_version))
                                  if args.symbol else args.model)
    save_dir = args.save_dir if rank == 0 else os.path.join(args.save_dir, 'rank%d' % rank)
    os.makedirs(save_dir, exist_ok=True)
    _setup_logging(save_dir, rank if distributed else None)
    dtype = resolve_dtype(args.dtype, contexts)   # after the logging: its warning is logged
    stale = remove_stale_tmp(save_dir, prefix)
    if stale:
        _LOG.info('removed %d temporary file(s) of an interrupted run: %s', len(stale),
                  ', '.join(stale))

    batch_size = args.batch_size
    local_batch = batch_size * len(contexts)
    global_batch = local_batch * num_workers
    per_worker = spec.num_train // num_workers
    steps_per_epoch = max(1, int(math.ceil(per_worker / float(local_batch))))
    if args.max_batches is not None:
        steps_per_epoch = min(steps_per_epoch, args.max_batches)
    base_lr = args.lr if args.lr is not None else 0.256 * global_batch / 256
    path = 'symbol' if args.symbol else 'gluon'
    settings = run_settings(args, spec, dtype, contexts, num_workers, base_lr)

    csv_path = os.path.join(save_dir, '%s-metrics.csv' % prefix)
    rows, start_epoch, global_step, resume, overrides = [], 0, 0, None, []
    # Found (or refused) before the slow model build, and before this run logs its set-up:
    # a refused resume leaves the checkpoint's directory as it was.
    found, directory = _resume_point(args, save_dir, prefix, rank,
                                     kvstore if distributed else None)
    if found is not None:
        resume = _paths(directory, prefix, found)
        with open(resume[2]) as handle:
            meta = json.load(handle)
        overrides = check_resume_settings(meta, resume[2], settings, args,
                                          kvstore if distributed else None)
        start_epoch, global_step = found, meta['global_step']
    compute, device = describe_precision(dtype, contexts)
    _LOG.info('%s %s, %s, dtype %s (%s) on %s, %d worker(s), global batch %d, lr %g, '
              '%d steps/epoch', path, prefix, 'synthetic data' if spec.synthetic else
              spec.train_rec, dtype, compute, contexts, num_workers, global_batch, base_lr,
              steps_per_epoch)
    _LOG.info('device: %s', device)
    if not spec.synthetic:
        threads = decoding_threads(args.data_nthreads)
        _LOG.info('data: decoding on %d thread(s) per iterator%s', threads,
                  '' if threads == args.data_nthreads else
                  " (--data-nthreads %d: MXNet's ImageRecordIter uses at most max(1, CPUs/2 "
                  "- 1) with %d CPUs)" % (args.data_nthreads, usable_cpus()))
    if not args.verbose:
        # The notice MXNet prints when a Module binds with its oneDNN subgraph backend;
        # read at each bind.  A value the user set stays.
        os.environ.setdefault('MXNET_SUBGRAPH_VERBOSE', '0')

    seed_everything(args.seed)   # same on every worker: same initial weights
    runner_cls = ModuleRunner if args.symbol else GluonRunner
    runner = runner_cls(args, spec, contexts, dtype, kvstore, batch_size, global_batch,
                        base_lr, steps_per_epoch)

    if resume is not None:
        runner.load(resume[0], resume[1])
        # The schedule follows this run's arguments (a longer --num-epochs under --lr-mode
        # step, or what --resume-override changed); it is a function of the restored
        # update count, so unchanged arguments continue it.
        runner.optimizer.lr_scheduler = lr_scheduler(args, base_lr, steps_per_epoch)
        if os.path.isfile(csv_path):
            rows = [r for r in read_metrics(csv_path) if r['epoch'] <= start_epoch]
        _LOG.info('resumed from %s (epoch %d, step %d)', resume[2], start_epoch, global_step)

    show_bar = not args.no_progress and rank == 0
    train_time = 0.0
    stats_keys = set()
    last_epoch = args.num_epochs if args.stop_at_epoch is None else \
        min(args.num_epochs, args.stop_at_epoch)
    if start_epoch >= last_epoch:
        _LOG.info('nothing to train: the checkpoint is at epoch %d, this run ends after epoch %d',
                  start_epoch, last_epoch)
    for epoch in range(start_epoch, last_epoch):
        seed_everything(_derived_seed(args.seed, epoch, rank, 'mxnet'))
        if spec.synthetic:
            data = SyntheticIter(spec, local_batch, steps_per_epoch, contexts[0])
        else:
            data = train_iter(spec, args, local_batch, epoch, rank, num_workers)
        bar = tqdm(total=steps_per_epoch, desc='epoch %d/%d' % (epoch + 1, args.num_epochs),
                   unit='batch', disable=not show_bar, leave=False, dynamic_ncols=True)
        loss_sum, seen, window_loss, window_seen = 0.0, 0, mx.nd.zeros((1,)), 0
        skipped_before = runner.skipped_steps
        tic = time.time()
        for index, batch in enumerate(data):
            if index >= steps_per_epoch:
                break
            batch_loss, _ = runner.train_batch(batch)
            window_loss += batch_loss
            window_seen += batch.data[0].shape[0]
            global_step += 1
            if (index + 1) % args.log_interval == 0 or index + 1 == steps_per_epoch:
                value = window_loss.asscalar()   # host sync, once per window
                loss_sum, seen = loss_sum + value, seen + window_seen
                bar.set_postfix({'img/s': '%.0f' % (seen * num_workers / (time.time() - tic)),
                                 'loss': '%.3f' % (value / window_seen),
                                 'scale': '%g' % runner.loss_scale}, refresh=False)
                bar.update((index + 1) - bar.n)
                window_loss, window_seen = mx.nd.zeros((1,)), 0
        mx.nd.waitall()
        elapsed = time.time() - tic
        bar.close()
        train_time += elapsed
        if distributed:
            average_statistics(kvstore, runner.statistics(), stats_keys)
        top1, top5 = _validate(runner, None if spec.synthetic else
                               val_iter(spec, args, local_batch), args.max_batches)
        row = {'epoch': epoch + 1, 'lr': _current_lr(runner.optimizer),
               'train_loss': loss_sum / max(seen, 1), 'val_top1': top1, 'val_top5': top5,
               'img_per_sec': seen * num_workers / elapsed, 'epoch_time': elapsed,
               'loss_scale': runner.loss_scale,
               'skipped_in_epoch': runner.skipped_steps - skipped_before,
               'skipped_total': runner.skipped_steps, 'peak_rss_mb': peak_rss_mb()}
        rows.append(row)
        write_metrics(csv_path, rows)
        _LOG.info('epoch %d/%d: loss %.4f, top-1 %s, top-5 %s, %.1f img/s, loss scale %g, '
                  'skipped %d steps (%d in total)', epoch + 1, args.num_epochs,
                  row['train_loss'], _percent(top1), _percent(top5), row['img_per_sec'],
                  row['loss_scale'], row['skipped_in_epoch'], row['skipped_total'])
        if (epoch + 1) % args.save_frequency == 0 or epoch + 1 == last_epoch:
            meta = {'global_step': global_step, 'seed': args.seed, 'dtype': dtype,
                    'path': path, 'model': prefix, 'rank': rank, 'num_workers': num_workers,
                    'data_nthreads': args.data_nthreads,
                    'decoding_threads': decoding_threads(args.data_nthreads),
                    'rng': 'per epoch e: mxnet/numpy/random and ImageRecordIter seeded from '
                           'sha256(seed/e/rank/purpose)', 'metrics': row,
                    'settings': settings, 'resume_overrides': overrides}
            save_checkpoint(runner, save_dir, prefix, epoch + 1, meta)
            prune_checkpoints(save_dir, prefix, args.keep_checkpoints)

    last = rows[-1] if rows else {}
    summary = {'model': prefix, 'path': path, 'dtype': dtype, 'compute': compute,
               'device': device, 'epochs': len(rows),
               'val_top1': last.get('val_top1'), 'val_top5': last.get('val_top5'),
               'img_per_sec': steady_img_per_sec(rows),
               'skipped_steps': runner.skipped_steps, 'loss_scale': runner.loss_scale,
               'loss_scaling': _loss_scaling(runner.trainer.loss_scaler),
               'peak_rss_mb': peak_rss_mb(), 'train_time': train_time, 'rank': rank,
               'num_workers': num_workers, 'global_batch': global_batch,
               'resume_overrides': overrides}
    with open(os.path.join(save_dir, '%s-summary.json' % prefix), 'w') as handle:
        json.dump(summary, handle, indent=1)
    if args.plot and rank == 0:
        runs = [('%s: %s' % (prefix, run_label(dtype, compute)), rows)]
        plot_runs(runs + [compared_run(other) for other in args.compare], args.plot)
    return summary


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    showwarning = warnings.showwarning   # train() routes warnings into its log
    try:
        args = build_parser().parse_args(argv)
        check_args(args)
        if args.plot:
            for other in args.compare:
                if not os.path.isfile(other):
                    raise UsageError('--compare %s: no such file' % other)
        summary = train(args)
    except UsageError as err:
        # A refused resume: one line per setting.  Flushed: a distributed launcher may stop
        # this worker as soon as another one exits.
        for line in str(err).splitlines():
            print('%s: error: %s' % (PROG, line), file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print('%s: interrupted; the checkpoints already written are intact (continue with '
              '--resume)' % PROG, file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = showwarning
        _close_logging()
    print(_format_summary(summary))
    return 0


if __name__ == '__main__':
    sys.exit(main())
