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
``--model``.  gluoncv's and NVIDIA's spellings work too, with their meaning, or
stop with one line naming this script's (the table at the end of ``--help``);
a ResNet-50 v1b run with mixup written as gluoncv's model-zoo commands are::

    python scripts/train_imagenet.py --rec-train train.rec --rec-train-idx train.idx \\
        --rec-val val.rec --rec-val-idx val.idx --use-rec --model resnet50_v1b \\
        --mode hybrid --lr 0.4 --lr-mode cosine --num-epochs 200 --batch-size 128 \\
        --num-gpus 8 -j 60 --warmup-epochs 5 --dtype float16 --last-gamma --no-wd \\
        --label-smoothing --mixup --save-dir runs/r50_mixup --logging-file r50_mixup.log

Evaluate a saved model (NVIDIA's ``--mode val``) without training: ``--mode val
--load runs/r50_fp16/resnet50_v1b-best.params --data-val val.rec`` (without
``--load``: the newest checkpoint in ``--save-dir``).

On a CPU: ``--dtype auto`` (or ``bfloat16``).  The log and the
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

Outputs in ``--save-dir`` (by default ``runs/<prefix>``; ``<prefix>`` is
``--save-prefix``, by default the model name): ``<prefix>-<epoch>.params``
(FP32 values, loadable by an FP32 network), ``<prefix>-<epoch>.states``
(optimizer state, FP32 master weights, loss scaler), ``<prefix>-<epoch>.json``
(epoch, step, seeds, metrics, the run's settings and those changed by
``--resume-override``), ``<prefix>-best.params`` and ``<prefix>-best.json``
(the epoch with the best validation top-1 so far), ``<prefix>-metrics.csv``
(one row per epoch: learning rate and loss scale at its end, training loss,
validation top-1/top-5, img/s, seconds, steps skipped for inf/NaN gradients in
the epoch and in total, peak RSS), ``<prefix>-summary.json`` (``--mode val``:
``<prefix>-eval.json``) and ``train.log`` (or ``--logging-file``).  Every JSON
file is valid JSON: a figure that does not exist (no validation) is ``null``.
``--json-log PATH`` adds a log in JSON lines for other tools (dllogger's
layout, see ``--help``).  Bad input (missing data, unknown model or dtype,
nothing to resume, another tool's spelling that means something else here)
prints one line and exits with status 2.

Internals relied on (MXNet 1.9.1 and mxamp):

* ``gluon.nn.Conv2D._channels`` (the stem's width, to replace it for small
  images);
* ``gluon.Block._children`` (the residual blocks that ``--last-gamma`` walks)
  and ``Block._collect_params_with_prefix`` (the names of ``save_parameters``,
  which ``--load`` checks);
"""
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):   # imagenet/, digits_rec; the repository's symbols/
    if _path not in sys.path:
        sys.path.insert(0, _path)

# mxamp before any MXNet operator runs: it selects oneDNN's AMX kernels at import.
import mxamp  # noqa: E402
from imagenet import spellings  # noqa: E402
from imagenet.fit import close_logging, train  # noqa: E402
from imagenet.options import PROG, UsageError, build_parser, check_args  # noqa: E402
from imagenet.report import format_summary  # noqa: E402

del mxamp   # imported first for its side effect alone (the package's modules use it)


def main(argv=None):
    """Command-line entry point; returns the exit status."""
    showwarning = warnings.showwarning   # train() routes warnings into its log
    try:
        words, read = spellings.translate(sys.argv[1:] if argv is None else list(argv))
        args = build_parser(__doc__.splitlines()[0], spellings.HELP).parse_args(words)
        args.spellings_read = read
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
        close_logging()
    print(format_summary(summary))
    return 0


if __name__ == '__main__':
    sys.exit(main())
