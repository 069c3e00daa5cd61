"""The data: what the data set is (`DataSpec`, `resolve_data`), its iterators and
their seeds.

Training reads a fresh ``ImageRecordIter`` per epoch (`train_iter`), seeded
from (seed, epoch, rank) alone (`derived_seed`): with the same number of
decoding threads (`decoding_threads`) a resumed run sees the same images in the
same order and augmentation.  ``--synthetic`` uses `SyntheticIter`.
"""
import hashlib
import math
import os
import random

import numpy as np
import mxnet as mx
from mxamp.hardware import usable_cpus

from .options import UsageError

IMAGENET_MEAN = (123.68, 116.779, 103.939)
IMAGENET_STD = (58.393, 57.12, 57.375)


class DataSpec(object):
    """What the data iterators and the network need to know about the data set."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _index_of(rec, idx, flag):
    """`rec`'s index (`idx`, or the .idx beside it) and its number of records."""
    if not os.path.isfile(rec):
        raise UsageError('%s %s: no such file' % (flag, rec))
    if idx is not None:
        if not os.path.isfile(idx):
            raise UsageError('%s-idx %s: no such file' % (flag, idx))
    else:
        idx = os.path.splitext(rec)[0] + '.idx'
        if not os.path.isfile(idx):
            raise UsageError('%s %s: its index %s is missing (im2rec writes both; or name it '
                             'with %s-idx)' % (flag, rec, idx, flag))
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
        if args.mode == 'val' and not args.data_val:
            raise UsageError('--mode val evaluates on --data-val: give it (or --dataset digits)')
        if not args.data_train and args.mode != 'val':
            raise UsageError('--data-train is required (or --dataset digits, or --synthetic)')
        spec.train_rec, spec.val_rec = args.data_train, args.data_val
    if args.num_classes is not None:
        spec.num_classes = args.num_classes
    if args.image_shape is not None:
        spec.image_shape = _parse_shape(args.image_shape)
    if spec.train_rec:
        spec.train_idx, spec.num_train = _index_of(spec.train_rec, args.data_train_idx,
                                                   '--data-train')
    if spec.val_rec:
        spec.val_idx, spec.num_val = _index_of(spec.val_rec, args.data_val_idx, '--data-val')
    channels = spec.image_shape[0]
    if channels not in (1, 3):
        raise UsageError('--image-shape: 1 or 3 channels, got %d' % channels)
    spec.mean, spec.std = (spec.mean * 3)[:channels], (spec.std * 3)[:channels]
    return spec


def _parse_shape(text):
    try:
        shape = tuple(int(v) for v in text.split(','))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise UsageError("--image-shape %r: expected 'channels,height,width', e.g. 3,224,224"
                         % text)
    return shape


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


def train_iter(spec, args, batch_size, epoch, rank, num_workers):
    """A fresh training ``ImageRecordIter`` for `epoch`.

    One iterator per epoch, seeded from (seed, epoch, rank): its shuffle and
    augmentations depend on nothing else, which is what makes ``--resume``
    bit-exact (given the same number of decoding threads, `decoding_threads`:
    each has its own augmentation RNG).
    """
    seed = derived_seed(args.seed, epoch, rank, 'data')
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


def derived_seed(seed, epoch, rank, what):
    # Distinct, reproducible 31-bit seeds per (run seed, epoch, worker, purpose).
    key = '%d/%d/%d/%s' % (seed, epoch, rank, what)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], 'little') >> 1


def seed_everything(seed):
    """Seed MXNet (every device), numpy and Python's `random`."""
    mx.random.seed(seed)
    np.random.seed(seed)
    random.seed(seed)
