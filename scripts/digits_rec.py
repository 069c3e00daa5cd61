"""Pack scikit-learn's handwritten digits into an MXNet RecordIO data set.

The 1,797 8x8 grey-level images of ``sklearn.datasets.load_digits`` become
``train.rec``/``train.idx`` (1,500 images) and ``val.rec``/``val.idx`` (297
images), lossless PNG records written with MXNet's own ``recordio`` tools, the
format ``im2rec`` produces for ImageNet.  Training on them runs exactly the
``ImageRecordIter`` pipeline an ImageNet run uses, on data that ships with
scikit-learn (nothing is downloaded).  ``meta.json`` beside them records the
class count, image shape, sizes and the pixel mean/std of the training split.

Usage::

    python scripts/digits_rec.py --data-dir ~/.mxamp/digits

``scripts/train_imagenet.py --dataset digits`` calls :func:`prepare` itself.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

#: Where the packed files are cached unless the caller chooses a directory.
DEFAULT_DIR = os.path.join(os.path.expanduser('~'), '.mxamp', 'digits')
NUM_VAL = 297
# Bump when the packed content changes, so stale caches are rebuilt.
FORMAT_VERSION = 1
_FILES = ('train.rec', 'train.idx', 'val.rec', 'val.idx', 'meta.json')


def _split(num_images):
    """Fixed train/val index split: the same for every user and every run."""
    order = np.random.RandomState(0).permutation(num_images)
    return np.sort(order[NUM_VAL:]), np.sort(order[:NUM_VAL])


def _write(directory, name, images, labels):
    import mxnet as mx
    record = mx.recordio.MXIndexedRecordIO(os.path.join(directory, name + '.idx'),
                                           os.path.join(directory, name + '.rec'), 'w')
    try:
        for index, (image, label) in enumerate(zip(images, labels)):
            header = mx.recordio.IRHeader(0, float(label), index, 0)
            record.write_idx(index, mx.recordio.pack_img(header, image, quality=9,
                                                         img_fmt='.png'))
    finally:
        record.close()


def _cached_meta(directory):
    path = os.path.join(directory, 'meta.json')
    if not all(os.path.isfile(os.path.join(directory, f)) for f in _FILES):
        return None
    try:
        with open(path) as handle:
            meta = json.load(handle)
    except (OSError, ValueError):
        return None
    return meta if meta.get('format_version') == FORMAT_VERSION else None


def prepare(directory=None):
    """Pack the digits into `directory` unless a complete copy is already there.

    Parameters
    ----------
    directory : str, optional
        Cache directory (created if needed); default ``~/.mxamp/digits``.

    Returns
    -------
    dict
        ``meta.json``'s content plus absolute paths: ``train_rec``,
        ``train_idx``, ``val_rec``, ``val_idx``.

    Notes
    -----
    The files are packed in a temporary directory beside `directory` and moved
    in one by one, ``meta.json`` last; a copy without a valid ``meta.json`` is
    packed again, so an interrupted run never leaves a cache that looks
    complete.  Concurrent callers may both pack; each move is atomic and the
    content is identical.
    """
    from sklearn.datasets import load_digits

    directory = os.path.abspath(os.path.expanduser(directory or DEFAULT_DIR))
    meta = _cached_meta(directory)
    if meta is None:
        os.makedirs(directory, exist_ok=True)
        digits = load_digits()
        # 0..16 grey levels to 0..255; exact multiples of 1/16 survive PNG.
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
        train, val = _split(len(images))
        staging = tempfile.mkdtemp(prefix='.digits-', dir=directory)
        try:
            _write(staging, 'train', images[train], digits.target[train])
            _write(staging, 'val', images[val], digits.target[val])
            pixels = images[train].astype(np.float64)
            meta = {'format_version': FORMAT_VERSION, 'num_classes': 10,
                    'image_shape': [1, 8, 8], 'num_train': int(len(train)),
                    'num_val': int(len(val)), 'mean': round(float(pixels.mean()), 3),
                    'std': round(float(pixels.std()), 3)}
            with open(os.path.join(staging, 'meta.json'), 'w') as handle:
                json.dump(meta, handle, indent=1)
            for name in _FILES:
                os.replace(os.path.join(staging, name), os.path.join(directory, name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    paths = {key: os.path.join(directory, key.replace('_', '.'))
             for key in ('train_rec', 'train_idx', 'val_rec', 'val_idx')}
    return dict(meta, **paths)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--data-dir', default=DEFAULT_DIR,
                        help='cache directory (default: %(default)s)')
    args = parser.parse_args(argv)
    info = prepare(args.data_dir)
    print('digits RecordIO: %d train, %d val images in %s'
          % (info['num_train'], info['num_val'], os.path.dirname(info['train_rec'])))
    return 0


if __name__ == '__main__':
    sys.exit(main())
