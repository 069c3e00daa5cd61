#!/usr/bin/env python
"""Side-by-side CPU benchmark: FP32 vs mxamp ('auto', bfloat16) vs MXNet's ``contrib.amp``.

Usage::

    .venv/bin/python scripts/benchmark.py                       # full run (20+ min, 2 cores)
    .venv/bin/python scripts/benchmark.py --networks resnet50_v1 --tasks inference
    .venv/bin/python scripts/benchmark.py --networks resnet18_v1 --tasks training \\
        --modes fp32,mxamp --batch 8,16,32 --threads 1,2 --output sweep.json
    .venv/bin/python scripts/benchmark.py --networks deepar,lstm_lm,mlp \\
        --modes fp32,mxamp:auto,mxamp                           # beyond ResNets
    .venv/bin/python scripts/benchmark.py --networks mqcnn,nbeats,tft \\
        --modes fp32,mxamp:auto                                 # GluonTS forecasters
    .venv/bin/python scripts/benchmark.py --networks bert,transformer \\
        --modes fp32,mxamp:auto,mxamp,mxamp+fusion              # BERT-base, the Transformer
    .venv/bin/python scripts/benchmark.py --networks ssd_512_resnet50_v1_voc,fcn_resnet50_voc \\
        --tasks training --output vision.json                   # a detector, a segmentation net
    .venv/bin/python scripts/benchmark.py --networks tiny --batch 2 --image-size 32 \\
        --repeats 1 --steps 2 --warmup 1                         # smoke test (about a minute)
    .venv/bin/python scripts/benchmark.py --networks resnet18_v1 --tasks inference \\
        --modes fp32,mxamp --explain                             # and why: mxamp.profile's verdicts

Networks
--------
Random weights (Xavier, BERT's normal for BERT; fixed seed) and inputs;
``scripts/benchmark_families.py`` builds each, with its own input and loss (its
docstring says which).  Defaults:

==================================================  =====  ==========  ===================
``--networks``                                      batch  image size  throughput
==================================================  =====  ==========  ===================
gluoncv classifiers (default: ``resnet50_v1``,      16     224         img/s
``resnet18_v1``), ``tiny`` (a few conv layers)
``ssd_512_resnet50_v1_voc`` (any ``ssd_*``)         8      512         img/s
``fcn_resnet50_voc`` (any ``fcn_*``)                4      480         img/s
GluonTS forecasters (``deepar``, ``mqcnn``,         32     -           series/s (windows)
``nbeats``, ...; training only)
``lstm_lm`` (gluonnlp ``standard_lstm_lm_200``)     20     -           seq/s (35 tokens)
``mlp`` (64 -> 128 -> 128 -> 10 on tabular rows)    256    -           rows/s
``bert`` (gluonnlp BERT-base, 2-class classifier)   8      -           seq/s (128 tokens)
``transformer`` (gluonnlp's WMT Transformer,        16     -           pair/s (source and
``transformer_en_de_512``, teacher-forced)                             target: 32 tokens)
==================================================  =====  ==========  ===================

``--batch`` and ``--image-size`` (image networks only) replace the defaults.
Every network is hybridized with ``static_alloc=True, static_shape=True`` in
every mode but ``lstm_lm``, which cannot become one graph (its
``hybrid_forward`` calls ``nd.Dropout``): hybridized in no mode
(``mxamp.convert`` converts its parts), it skips the modes that need one graph
(``+fusion``, ``contrib.amp`` inference), with the reason.  A table of several
kinds of samples says ``samples/s``, and its notes what each network counts.
A forecaster's inference is not measured: its forecasts come from another network.
The Transformer's ``NMTModel`` is a plain ``Block``: it runs inside a
``HybridBlock`` that repeats its teacher-forced forward as one graph
(``TeacherForcedTranslation`` in ``scripts/benchmark_families.py``), so it is
hybridized in every mode, like BERT.  Its inference is that forward, not beam
search.

Modes
-----
inference (``net(*inputs)``, FP32 inputs, FP32 outputs):

``fp32``            the FP32 net.
``fp32+fusion``     the FP32 net after ``optimize_for(x, backend='MKLDNN')`` (oneDNN
                    fusion: BatchNorm folded into convolutions, ReLU and residual
                    additions fused as post-ops).
``mxamp:auto``      ``mxamp.convert(net, 'auto')``, what users get by default: bfloat16
                    where a layer does enough work to pay for it, FP32 elsewhere
                    (docs/policy.rst, "Layers too small for bfloat16").
``mxamp``           ``mxamp.convert(net, 'bfloat16')``: every layer bfloat16, as asked.
``mxamp+fusion``    ``mxamp.for_inference(net, x, dtype='bfloat16')``: converted, then
                    the same oneDNN fusion (mxamp's inference path).
``mxamp:auto+fusion`` ``mxamp.for_inference(net, x)``: ``'auto'`` for inference alone,
                    each layer weighed without a backward pass or an update (smaller
                    layers pay than in training), then fused.
``contrib.amp``     ``mxnet.contrib.amp.convert_hybrid_block(net, 'bfloat16', ctx=cpu)``.

training (forward + backward of the network's loss, then ``trainer.step``; SGD
with momentum; Adam for the forecasters, BERT and the Transformer):

``fp32``            FP32 net, ``gluon.Trainer``.
``mxamp:auto``      ``mxamp.convert(net, 'auto')``, ``mxamp.Trainer`` with its defaults.
``mxamp``           ``mxamp.convert(net, 'bfloat16')``, ``mxamp.Trainer`` with its defaults
                    (FP32 master weights; no loss scaling, as bfloat16 has FP32's range).
``mxamp+scaling``   same with ``loss_scale='dynamic'`` (loss scaler and overflow check on
                    every step): the upper bound of mxamp's own per-step overhead.
``contrib.amp``     ``amp.init('bfloat16')`` before building the net, ``amp.init_trainer``,
                    ``amp.scale_loss``.

A mode that fails on a network (``contrib.amp`` may, beyond the classifiers)
is an ``error`` entry of the table, with the error's line; a mode known to
fail on a family (``contrib.amp`` on BERT: MXNet's lists leave out gluonnlp's
fused attention) is skipped, with the reason.

Method
------
Every figure is what a user's script gets: a process that builds one mode.
``scripts/benchmark_harness.py`` runs the workers and makes the figures, the
table and the JSON, for ``scripts/torch_peer.py`` as for this script.

* Configurations: each combination of network, task, ``--batch`` and
  ``--threads`` value (both accept comma-separated lists) is measured on its
  own, with its own FP32 baseline.
* Workers: for each configuration the script runs ``--repeats`` rounds (3 by
  default); a round starts one fresh Python process (a worker: this script
  with a hidden ``--_worker`` argument) per mode, in the same order every
  round (fp32, mxamp, ..., fp32, mxamp, ...).  A worker builds its mode,
  runs ``--warmup`` untimed iterations (2), then times consecutive
  iterations, each ended by a sync (``wait_to_read`` or
  ``mx.nd.waitall()``): at least ``--steps`` (5), and on until the timed
  stretch lasts ``--min-seconds`` (1).  Its throughput is batch x iterations
  over that stretch.  A ResNet-50 step takes a second and is timed 5 times; a
  small MLP's takes a fraction of a millisecond and is timed thousands of
  times, without which a few steps measure the clock and the machine's noise.
  The table shows the median over rounds; ``x FP32`` is the ratio of the
  medians, ``paired`` the median over rounds of mode / FP32 throughput of
  the same round.  Alternating whole processes makes a change in the
  machine's load hit every mode alike; ``paired`` compares processes run
  seconds apart.
* Why one process per mode: an earlier version kept all modes of a
  configuration in one process and timed them interleaved, ``--steps 1`` per
  repetition.  Every mode's graphs, MXNet's memory pool and oneDNN's
  primitive cache were then alive at once, and each timed iteration came
  right after another mode's, on caches and memory that mode had just used.
  On a 16-core Xeon (ResNet-50 training, batch 64, 16 threads) it reported
  mxamp at 1.01x and 1.06x FP32 where one process per mode measures 1.61x
  (at 2 threads, batch 16, both agreed).
* Threads: each worker starts with ``OMP_NUM_THREADS`` set to the
  configuration's ``--threads`` (MXNet reads it when it loads, in the fresh
  process).  The default is the number of CPUs this process may use
  (``os.sched_getaffinity``), stated rather than left unset: with
  ``OMP_NUM_THREADS`` unset MXNet 1.9.1 computes on half the logical CPUs
  (``src/engine/openmp.cc`` assumes hyper-threading on x86), i.e. on one
  thread on a 2-CPU machine.  Each worker reports the OpenMP thread count
  MXNet computes with (``omp_get_max_threads()`` of the OpenMP runtime that
  ``libmxnet.so`` loaded, asked after ``import mxnet``); the table's notes
  say where it is not the one asked for.  Otherwise a worker runs with the
  environment the script was started with, not the one ``import mxamp``
  changed in this process (it may set ``DNNL_MAX_CPU_ISA``), as a user's
  process would.
* Training iterations are timed in two parts, each ended by
  ``mx.nd.waitall()``: forward+backward, then ``trainer.step``
  (``update_ms``).  mxamp's per-step overhead is ``update_ms(mxamp mode) -
  update_ms(fp32)`` (master-weight update and cast, loss scaler, overflow
  check) as a fraction of the mxamp step.
* ``contrib.amp`` training: ``amp.init`` patches ``mx.nd``/``mx.sym`` for
  good, which concerns no other mode, as each has its own process; its ratio
  is against the configuration's FP32, like every mode's.
* Memory: each worker reports its RSS after building the net, before the
  first iteration (``base_rss_mb``: MXNet itself, Python, the weights), and
  its peak at the end (``peak_rss_mb``); the table shows the medians over
  rounds.  The peak is ``VmHWM`` from ``/proc/self/status``, not
  ``getrusage(RUSAGE_SELF).ru_maxrss``, which Linux carries over ``execve``
  from the forked parent (this script, MXNet loaded).
* The machine's speed: each worker times a fixed reference workload, a chain
  of small operators through MXNet's engine (`reference_seconds`), before and
  after its iterations (``reference_ms``).  Every mode's process runs the same
  chain, so only the machine changes its time: on a virtual machine the
  hand-offs between CPUs slow down for minutes at a time, mid-process, and a
  network of small operators with them (docs/performance.rst, "When the
  machine changes speed").  Where a configuration's timings spread by more
  than 20%, a note names the modes and rounds that ran slow and gives each
  mode's ratio to FP32 over the processes that ran fast
  (``steady_ratio_vs_fp32``); that ratio, or the paired one, whose two
  processes ran seconds apart, is then the one to read.
* AMX: mxamp enables it at import when the CPU has ``amx_bf16``; the JSON
  records the CPU flags, the CPU class and whether AMX was enabled
  (``meta.hardware``).
* CPUs without native bfloat16 (`mxamp.hardware.cpu_class` ``'avx2'`` or
  ``'avx512'``, ``DNNL_MAX_CPU_ISA`` included): on ``'avx2'`` MXNet's oneDNN
  has no bfloat16 kernels (contrib.amp's graphs fail: "could not create a
  primitive descriptor iterator"), so the ``contrib.amp`` modes are skipped,
  with the reason in the table and in the JSON (``skipped`` in the mode's
  entry); on ``'avx512'`` they run oneDNN's emulated bfloat16.  mxamp's modes
  then run bfloat16 parameters with FP32 compute: they measure that
  emulation (casts, master weights), not bfloat16 arithmetic; every result
  says which (``mxamp_compute``: ``'native'`` or ``'bfloat16 storage, FP32
  compute'``).

Explain
-------
With ``--explain``, after the rounds of a configuration, one more worker per
mixed-precision mode runs `mxamp.profile` on that mode's network (the same
net, weights, batch, task and ``OMP_NUM_THREADS``; ``train=True`` for
training), in a process of its own after the timed ones, so that it changes
no figure of the table.  Under each such row the table prints the report's
step times (bfloat16 and FP32, against the row's own time per batch) and its
top 3 verdicts with the share of the step each concerns, or ``no verdict``;
the JSON holds every verdict under the mode's ``explain``.  What the report
measures differs from the row in three cases, which the row says:
``mxamp+fusion`` is profiled unfused (the report measures the converted graph
`mxamp.convert` makes, before oneDNN's fusion), ``mxamp:auto+fusion`` unfused
and as ``mxamp.convert(net, 'auto')`` weighs its layers (for training),
``mxamp+scaling`` without
loss scaling (the report's trainer is `mxamp.Trainer`'s default), and
``contrib.amp`` is not profiled (the report measures mxamp's conversion, not
MXNet's).  A report's training step is the backward of the outputs (head
gradients of ones) rather than of the benchmark's loss.  ``--explain`` needs a
mixed-precision mode other than ``contrib.amp`` among ``--modes``.

Output
------
On stdout a table (one block of rows per configuration) and its notes, then,
per network and task, FP32 and mxamp throughput by batch size and by thread
count where several were measured.  The JSON file (``--output``, default
``benchmark.json``, written whole or not at all) holds ``meta`` (command
line, versions, CPU, usable CPUs, load average) and one result per
configuration: its network's ``family``, ``throughput_unit`` and ``sample``
(what one sample is) and, per mode, its settings, every worker's answer
(``runs``: throughput as ``img_per_s``, samples per second whatever the
sample is, per-iteration times, memory, environment and OpenMP thread count),
the medians and ratios, and ``reproduce``, the command that measures that mode
and FP32 alone.  A worker that fails, crashes or times out becomes an
``error`` entry for its mode, not measured in later rounds; the table's notes
say why.  A task a network does not have (a forecaster's inference) is a result
with ``skipped`` (why) and no modes.  Schema 3 (``meta.schema_version``)
counts samples of every family where schema 2 counted images.
"""
import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# mxamp from this checkout; benchmark_families beside this file, also when it is loaded
# from its path (the tests).
sys.path[:0] = [ROOT, HERE]

# The environment this script was started with, before `import mxamp` may set
# DNNL_MAX_CPU_ISA: the one workers start from, as a user's process would.
LAUNCH_ENV = dict(os.environ)

import mxamp  # noqa: E402  (first: enables AMX before oneDNN's first primitive)
import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
import benchmark_families as families  # noqa: E402
import benchmark_harness as harness  # noqa: E402
from benchmark_families import HYBRIDIZE  # noqa: E402
from mxamp import hardware  # noqa: E402
from mxamp.graph import error_line  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from tqdm import tqdm  # noqa: E402

INFERENCE_MODES = ('fp32', 'fp32+fusion', 'mxamp:auto', 'mxamp:auto+fusion', 'mxamp',
                   'mxamp+fusion', 'contrib.amp')
TRAINING_MODES = ('fp32', 'mxamp:auto', 'mxamp', 'mxamp+scaling', 'contrib.amp')
# 3: a result's throughput (img_per_s and the figures made from it) counts the samples of
# its network's family (its throughput_unit), no longer only images.
SCHEMA_VERSION = 3
RESULT_PREFIX = 'MXAMP_BENCHMARK_RESULT '

FUSION_BACKEND = 'MKLDNN'
# The dtype each mxamp mode converts to.
MXAMP_DTYPE = {'mxamp:auto': 'auto', 'mxamp:auto+fusion': 'auto', 'mxamp': 'bfloat16',
               'mxamp+fusion': 'bfloat16', 'mxamp+scaling': 'bfloat16'}
# The modes that make their net with mxamp.for_inference (in MXAMP_DTYPE's dtype).
FOR_INFERENCE_MODES = ('mxamp:auto+fusion', 'mxamp+fusion')
# mxamp.Trainer's loss_scale per mode ('auto': none for bfloat16, which has FP32's range).
MXAMP_LOSS_SCALE = {'mxamp:auto': 'auto', 'mxamp': 'auto', 'mxamp+scaling': 'dynamic'}
# --explain: what mxamp.profile measures for each mode it explains, where that is not the
# row's network as the row runs it, and why contrib.amp is not explained.
EXPLAINED_MODES = {'mxamp:auto': None,
                   'mxamp:auto+fusion': "profiled unfused, as mxamp.convert(net, 'auto') "
                                        'weighs its layers (for training)',
                   'mxamp': None,
                   'mxamp+fusion': 'profiled unfused: the report measures the graph '
                                   'mxamp.convert makes, before oneDNN fusion',
                   'mxamp+scaling': "profiled without loss scaling: the report's trainer is "
                                    "mxamp.Trainer's default"}
NOT_EXPLAINED = {'contrib.amp': "not profiled: mxamp.profile measures mxamp's conversion, not "
                                "MXNet's contrib.amp"}
EXPLAIN_VERDICTS = 3        # verdicts printed under a row (the JSON holds them all)


# --------------------------------------------------------------------------
# Modes: each builder returns a callable running one iteration (and syncing)

def _hybridize(net):
    net.hybridize(**HYBRIDIZE)
    return net


def _wait(outputs):
    """Wait until every NDArray of `outputs` (nested lists and tuples of them) is computed."""
    if isinstance(outputs, mx.nd.NDArray):
        outputs.wait_to_read()
    else:
        for output in outputs:
            _wait(output)


def build_inference(mode, network, batch, image_size):
    family = families.family_of(network)
    setup = family.setup(network, batch, image_size, False)
    net, inputs = setup.net, setup.inputs
    if mode in ('mxamp:auto', 'mxamp'):
        mxamp.convert(net, MXAMP_DTYPE[mode])
    if mode == 'contrib.amp':
        from mxnet.contrib import amp
        net.hybridize()
        _wait(net(*setup.one))
        net = amp.convert_hybrid_block(net, target_dtype='bfloat16', ctx=mx.cpu())
    if mode in FOR_INFERENCE_MODES:
        mxamp.for_inference(net, *inputs, dtype=MXAMP_DTYPE[mode])
    elif mode == 'fp32+fusion':
        net.optimize_for(*inputs, backend=FUSION_BACKEND, **HYBRIDIZE)
    elif family.no_graph is None:
        _hybridize(net)

    def run():
        _wait(net(*inputs))
        return None
    return run


def build_training(mode, network, batch, image_size):
    family = families.family_of(network)
    if mode == 'contrib.amp':
        from mxnet.contrib import amp
        amp.init(target_dtype='bfloat16')      # patches MXNet for good: a worker's own process
    # Under amp.init this net's graph is built with contrib.amp's patched operators.
    setup = family.setup(network, batch, image_size, True)
    net, inputs = setup.net, setup.inputs
    if mode in MXAMP_LOSS_SCALE:
        mxamp.convert(net, MXAMP_DTYPE[mode])
    elif mode not in ('fp32', 'contrib.amp'):
        raise ValueError('unknown training mode %r' % mode)
    if family.no_graph is None:
        _hybridize(net)
    optimizer, optimizer_params = family.optimizer
    if mode in MXAMP_LOSS_SCALE:
        trainer = mxamp.Trainer(net.collect_params(), optimizer, dict(optimizer_params),
                                loss_scale=MXAMP_LOSS_SCALE[mode])
    else:
        trainer = gluon.Trainer(net.collect_params(), optimizer, dict(optimizer_params))
    if mode == 'mxamp+scaling':
        scale_loss = trainer.scale_loss
    elif mode == 'contrib.amp':
        amp.init_trainer(trainer)

        def scale_loss(loss):
            return amp.scale_loss(loss, trainer)
    else:
        scale_loss = None

    def run():
        start = time.perf_counter()
        with autograd.record():
            loss = setup.loss(net(*inputs))
            if scale_loss is not None:
                with scale_loss(loss) as scaled:
                    autograd.backward(scaled)
        if scale_loss is None:
            loss.backward()
        mx.nd.waitall()
        middle = time.perf_counter()
        trainer.step(batch)
        mx.nd.waitall()
        return middle - start, time.perf_counter() - middle
    return run


# The reference workload (`reference_seconds`): this many rounds of three small elementwise
# operators on an array of this shape.
REFERENCE_ROUNDS, REFERENCE_SHAPE = 200, (32, 160)


def reference_seconds():
    """The machine's speed as every worker times it, whatever its mode
    (`benchmark_harness.measure`): a chain of small elementwise operators, each handed
    from this thread to MXNet's engine, so that their time is that of the hand-offs between
    CPUs: what a virtual machine's slow spells slow down (docs/performance.rst, "When the
    machine changes speed").  The fastest of `benchmark_harness.best_time`'s timings."""
    data = mx.nd.ones(REFERENCE_SHAPE)

    def chain():
        out = data
        for _ in range(REFERENCE_ROUNDS):
            out = mx.nd.sigmoid(out) * 0.5 + out
        out.wait_to_read()
    return harness.best_time(chain)


def build(task, mode, network, batch, image_size):
    if task == 'inference':
        return build_inference(mode, network, batch, image_size)
    return build_training(mode, network, batch, image_size)


def mode_settings(task, mode, family=families.CLASSIFIER):
    """What `mode` runs on a network of `family`, for the JSON: enough to build it again by
    hand.

    Returns
    -------
    dict
        ``dtype`` of the parameters (``'auto'``: bfloat16 where a layer pays,
        FP32 elsewhere), ``conversion`` (the call that converts the net, None
        for FP32), ``hybridize`` flags (None: not hybridized), ``fusion`` (the
        subgraph backend, or None) and, for training, ``loss``, ``trainer``,
        ``optimizer`` (name and hyper-parameters) and ``loss_scale``.
    """
    if mode.startswith('fp32'):
        conversion = None
    elif mode == 'contrib.amp':
        conversion = ("amp.convert_hybrid_block(net, target_dtype='bfloat16', ctx=mx.cpu())"
                      if task == 'inference' else
                      "amp.init(target_dtype='bfloat16') before building the net")
    elif mode in FOR_INFERENCE_MODES:
        conversion = "mxamp.for_inference(net, x, dtype=%r)" % MXAMP_DTYPE[mode]
    else:
        conversion = "mxamp.convert(net, %r)" % MXAMP_DTYPE[mode]
    settings = {'dtype': 'float32' if conversion is None else MXAMP_DTYPE.get(mode, 'bfloat16'),
                'conversion': conversion,
                'hybridize': dict(HYBRIDIZE) if family.no_graph is None else None,
                'fusion': FUSION_BACKEND if mode.endswith('+fusion') else None}
    if task == 'training':
        if mode == 'contrib.amp':
            loss_scale = 'dynamic (amp.init_trainer, amp.scale_loss)'
        else:
            loss_scale = MXAMP_LOSS_SCALE.get(mode)
        optimizer, optimizer_params = family.optimizer
        settings.update(loss=family.loss_name,
                        trainer='mxamp.Trainer' if mode in MXAMP_LOSS_SCALE else 'gluon.Trainer',
                        optimizer=dict(name=optimizer, **optimizer_params), loss_scale=loss_scale)
    return settings


def task_modes(task, selected):
    """The modes of `task` among `selected`, in the table's order."""
    return [m for m in (INFERENCE_MODES if task == 'inference' else TRAINING_MODES)
            if m in selected]


def skip_reason(mode):
    """Why `mode` is not measured on this CPU (one line), or None when it is."""
    if mode == 'contrib.amp' and hardware.cpu_class() == hardware.AVX2:
        return ("MXNet's AMP computes in bfloat16, which oneDNN cannot do on this CPU (%s)"
                % hardware.describe_cpu_class())
    return None


def unfit_reason(family, task, mode):
    """Why `mode` of `task` cannot run a network of `family` (one line), or None when it can:
    the modes that need the network as one graph, for a network that cannot become one, and
    the modes known to fail on the family's networks (its ``unfit_modes``)."""
    needs_graph = mode.endswith('+fusion') or (mode, task) == ('contrib.amp', 'inference')
    if family.no_graph and needs_graph:
        return 'needs one graph, and %s cannot become one: %s' % (family.name, family.no_graph)
    return (family.unfit_modes or {}).get(mode)


def mode_plan(config, selected):
    """Each mode of `config` among `selected`, in the table's order, with why it is not
    measured (`skip_reason`, `unfit_reason`) or None."""
    family = families.family_of(config.network)
    return {mode: skip_reason(mode) or unfit_reason(family, config.task, mode)
            for mode in task_modes(config.task, selected)}


def mxamp_compute():
    """How the mxamp modes compute here: 'native' or 'bfloat16 storage, FP32 compute'."""
    return 'native' if hardware.computes_bfloat16() else 'bfloat16 storage, FP32 compute'


# --------------------------------------------------------------------------
# Worker: one mode in a fresh process

def launch_variables():
    """The variables this process was started with that change a measurement."""
    return hardware.performance_variables(LAUNCH_ENV)


def worker_main(spec):
    """Build and time the one mode of `spec` in this (fresh) process; the worker's answer
    (`explain_main`'s instead for an ``--explain`` worker, ``spec['explain']``).

    Returns
    -------
    dict
        :func:`benchmark_harness.measure`'s figures; its ``environment``:
        :func:`mxamp.hardware.mxnet_openmp_threads` and the ``variables`` the
        process was started with.
    """
    if spec.get('explain'):
        return explain_main(spec)
    environment = dict(hardware.mxnet_openmp_threads(), variables=launch_variables())
    return harness.measure(spec, lambda: build(spec['task'], spec['mode'], spec['network'],
                                               spec['batch'], spec['image_size']), environment,
                           reference_seconds)


def explain_main(spec):
    """Profile the network of `spec`'s mode with `mxamp.profile`, in this (fresh) process.

    The net, its weights and the batch are the ones the mode's workers time
    (same seed); it is converted with ``mxamp.convert`` (the mode's dtype) and
    hybridized as they do, then profiled (``train=True`` for training, `spec`'s
    steps and warm-up).

    Returns
    -------
    dict
        ``verdicts`` (each verdict's ``kind``, ``message``, ``share``, ``layer``,
        ``measured``; most expensive first), ``step_ms`` (the report's normal
        step time per dtype), ``speedup``, ``attributed`` (share of the
        profiled step charged to layers), ``report_s`` (its wall time),
        ``profiled`` (how the report's network differs from the row's, or
        None) and ``openmp_threads`` (what MXNet computed with here).
    """
    threads = hardware.mxnet_openmp_threads()['openmp_threads']
    family = families.family_of(spec['network'])
    training = spec['task'] == 'training'
    setup = family.setup(spec['network'], spec['batch'], spec['image_size'], training)
    net = mxamp.convert(setup.net, MXAMP_DTYPE[spec['mode']])
    if family.no_graph is None:
        _hybridize(net)
    # 'auto' decides at the converted net's first call, from its shapes, which layers pay
    # for bfloat16 (and casts their parameters then): a full batch, as the workers' first.
    with autograd.train_mode() if training else autograd.predict_mode():
        _wait(net(*setup.inputs))
    report = mxamp.profile(net, *setup.inputs, train=training, iterations=spec['steps'],
                           warmup=spec['warmup'])
    data = report.to_dict()
    totals = data['totals']
    return {'verdicts': [verdict._asdict() for verdict in report.verdicts],
            'step_ms': {dtype: side['step_ms'] for dtype, side in totals['sides'].items()},
            'speedup': totals['speedup'], 'attributed': totals['attributed'],
            'report_s': data['cost']['report_s'], 'profiled': EXPLAINED_MODES[spec['mode']],
            'openmp_threads': threads}


def _error_line(exc):
    """One line saying what went wrong: the exception's type and `mxamp.graph.error_line`
    (an MXNetError's informative line, without its C++ stack and log prefixes)."""
    return '%s: %s' % (type(exc).__name__, error_line(exc))


def run_worker(spec, timeout):
    """Measure one mode in a fresh Python process, with ``OMP_NUM_THREADS=spec['threads']``:
    the worker's answer (:func:`worker_main`), or ``{'error': why}`` when it failed,
    crashed or ran past `timeout` seconds (:func:`benchmark_harness.run_worker`)."""
    return harness.run_worker(__file__, spec, timeout, LAUNCH_ENV, RESULT_PREFIX)


# --------------------------------------------------------------------------
# One configuration: rounds of one worker per mode

def configurations(args):
    """Every (network, task, batch, threads) to measure, in the table's order; a network's
    own default batch (`benchmark_families`) where ``--batch`` is not given."""
    return harness.configurations(args, lambda network: families.family_of(network).batch)


def image_size(network, args):
    """The image size `network` runs at: ``--image-size``, else its own default; None for
    a network whose input is no image."""
    default = families.family_of(network).image_size
    return None if default is None else args.image_size or default


def unmeasured_task(config):
    """Why `config`'s task is not measured on its network at all (one line), or None."""
    return families.family_of(config.network).no_inference if config.task == 'inference' \
        else None


def reproduce_command(config, mode, args):
    """The command line that measures `mode` of `config` alone, with its FP32 baseline."""
    size = image_size(config.network, args)
    return harness.reproduce_command('scripts/benchmark.py', config, mode, args,
                                     launch_variables(),
                                     [] if size is None else ['--image-size', str(size)])


def bench(config, args, progress):
    """Measure every mode of `config`: `args.repeats` rounds of one worker per mode.

    Returns
    -------
    dict
        The configuration, the run's settings, its network's ``family``,
        ``throughput_unit`` and ``sample`` (what one sample is), and ``modes``:
        per mode either ``skipped`` (why), or its ``settings``, ``reproduce``
        and ``runs`` (the workers' answers, one per round) with :func:`derive`'s
        figures, and ``error`` when a worker failed (the mode is not run again).
        A task the network does not have is ``skipped`` (why), with no modes.
    """
    family = families.family_of(config.network)
    size = image_size(config.network, args)
    result = dict(config._asdict(), family=family.name, throughput_unit=family.sample + '/s',
                  sample=family.counts, image_size=size, **harness.run_settings(args),
                  repeats=args.repeats, mxamp_compute=mxamp_compute(), modes={})
    if unmeasured_task(config):
        result['skipped'] = unmeasured_task(config)
        return result
    specs = {}      # the worker's spec of each mode measured, in the table's order
    for mode, reason in mode_plan(config, args.modes).items():
        if reason:
            result['modes'][mode] = {'skipped': reason}
            continue
        result['modes'][mode] = {'settings': mode_settings(config.task, mode, family),
                                 'reproduce': reproduce_command(config, mode, args), 'runs': []}
        specs[mode] = dict(config._asdict(), mode=mode, image_size=size,
                           **harness.run_settings(args))

    def before(mode, round_index):
        progress.set_postfix_str('%s: %s' % (harness.label(result), mode))

    def after(mode, round_index, answer):
        progress.update()
        if 'error' in answer:           # not run again: fewer processes to come
            progress.total -= args.repeats - round_index - 1
            progress.refresh()
    harness.run_rounds(result['modes'], specs, args.repeats,
                       lambda spec: run_worker(spec, args.timeout), before, after)
    derive(result)
    if args.explain:
        explain(result, specs, args, progress)
    return result


def explain(result, specs, args, progress):
    """``--explain``: one `explain_main` worker per mixed-precision mode measured, after
    every timed worker of the configuration; its answer (or error) becomes the mode's
    ``explain``, with the row's time per batch set against the report's step times."""
    modes = result['modes']
    for mode, entry in modes.items():
        if mode in NOT_EXPLAINED and 'skipped' not in entry:
            entry['explain'] = {'skipped': NOT_EXPLAINED[mode]}
    for mode in [m for m in specs if m in EXPLAINED_MODES]:
        progress.set_postfix_str('%s: explain %s' % (harness.label(result), mode))
        answer = run_worker(dict(specs[mode], explain=True), args.timeout)
        progress.update()
        measured = modes[mode].get('median_img_per_s')
        if measured and 'error' not in answer:
            answer['row_batch_ms'] = 1e3 * result['batch'] / measured
            answer['row_vs_report'] = answer['row_batch_ms'] / answer['step_ms']['bfloat16']
        modes[mode]['explain'] = answer


def derive(result):
    """Medians over rounds and ratios to the configuration's FP32, from the workers' answers
    (:func:`benchmark_harness.derive`), then mxamp against ``contrib.amp`` and, for
    training, mxamp's per-step overhead."""
    complete = harness.derive(result)
    fp32 = complete.get('fp32', {})
    camp, ours = complete.get('contrib.amp', {}), complete.get('mxamp', {})
    if camp.get('median_img_per_s') and ours.get('median_img_per_s'):
        ours['vs_contrib_amp'] = ours['median_img_per_s'] / camp['median_img_per_s']
    if result['task'] == 'training' and fp32.get('median_update_ms') is not None:
        overhead = {}
        for name in MXAMP_LOSS_SCALE:
            entry = complete.get(name, {})
            if entry.get('median_step_ms'):
                extra = entry['median_update_ms'] - fp32['median_update_ms']
                overhead[name] = {'extra_update_ms': extra,
                                  'fraction_of_step': extra / entry['median_step_ms']}
        result['mxamp_overhead'] = overhead


# --------------------------------------------------------------------------
# Report

def table_header(results):
    """The table's columns; its throughput's is the results' unit (``img/s``...), or
    ``samples/s`` where they count different samples (the notes say which)."""
    return ('network', 'task', 'batch', 'threads', 'mode', harness.throughput_column(results),
            'x FP32', 'paired', 'update ms', 'peak RSS MB', 'RSS x FP32')


def _explanation(entry):
    """The lines ``--explain`` prints under a row: the report's step times and its top
    verdicts (or why there are none); nothing for a row it did not explain."""
    explained = entry.get('explain')
    if explained is None:
        return []
    pad = ' ' * 4
    if 'skipped' in explained:
        return [pad + 'explain: ' + explained['skipped']]
    if 'error' in explained:
        return [pad + 'explain failed: ' + explained['error']]
    steps = explained['step_ms']
    line = 'mxamp.profile: step bfloat16 %.1f ms, float32 %.1f ms' % (steps['bfloat16'],
                                                                       steps['float32'])
    if explained.get('row_batch_ms') is not None:
        line += '; this row %.1f ms per batch' % explained['row_batch_ms']
    lines = [pad + line]
    if explained['profiled']:
        lines.append(pad + '(%s)' % explained['profiled'])
    verdicts = explained['verdicts'][:EXPLAIN_VERDICTS]
    lines += [pad + '%3.0f%%  %s' % (100 * v['share'], v['message']) for v in verdicts]
    return lines if verdicts else lines + [pad + 'no verdict']


def _table_row(result, mode, entry):
    cell = harness.cell
    return harness.config_cells(result) + (
        mode, harness.throughput_cell(entry), cell(entry, 'ratio_vs_fp32', '%.2f'),
        cell(entry, 'paired_ratio_vs_fp32', '%.2f'), cell(entry, 'median_update_ms', '%.0f'),
        cell(entry, 'median_peak_rss_mb', '%.0f'), cell(entry, 'rss_ratio_vs_fp32', '%.2f'))


def _skipped_row(result):
    return harness.config_cells(result) + ('-', 'skipped') + ('-',) * 5


def _notes(results, header):
    """The lines under the table: how to read it, then what each configuration needs said."""
    notes = ['%s, update ms, peak RSS: medians over the rounds (one process per mode and '
             'round); x FP32: ratio of the medians; paired: median of the per-round ratios'
             % header[5]]
    counts = {r['network']: r.get('sample', 'images') for r in results}
    if set(counts.values()) != {'images'}:
        notes.append('samples counted: ' + '; '.join('%s: %s' % item for item in counts.items()))
    if any(r['mxamp_compute'] != 'native' for r in results):
        notes.append('mxamp modes: bfloat16 storage, FP32 compute (this CPU has no native '
                     'bfloat16): they measure that emulation, not bfloat16 arithmetic')
    skips = {(mode, e['skipped']) for r in results for mode, e in r['modes'].items()
             if 'skipped' in e}
    notes.extend('%s skipped: %s' % (mode, reason) for mode, reason in sorted(skips))
    for res in results:
        label = harness.label(res)
        if 'skipped' in res:
            notes.append('%s: not measured, %s' % (label, res['skipped']))
        for name, o in res.get('mxamp_overhead', {}).items():
            notes.append('%s: %s per-step overhead (update vs FP32) %.0f ms = %.1f%% of the step'
                         % (label, name, o['extra_update_ms'], 100 * o['fraction_of_step']))
        ours = res['modes'].get('mxamp', {})
        if ours.get('vs_contrib_amp'):
            notes.append('%s: mxamp = %.2fx contrib.amp' % (label, ours['vs_contrib_amp']))
        notes += harness.mode_notes(res, 'openmp_threads', "%s: %s computed on %s OpenMP "
                                    "threads, not %d (see its runs' environment)")
        speed = harness.reference_note(res)
        if speed:
            notes.append(speed)
    return notes


def _views(results):
    """FP32 and mxamp throughput by batch size (per thread count), then by thread count
    (per batch).

    One view per network, task and fixed value, where more than one value of the
    other was measured: what a user needs to pick a batch size or a thread count.
    """
    lines = []
    for axis, fixed in (('batch', 'threads'), ('threads', 'batch')):
        groups = {}
        for res in results:
            if 'skipped' not in res:
                groups.setdefault((res['network'], res['task'], res[fixed]), []).append(res)
        for (network, task, value), group in groups.items():
            if len(group) < 2:
                continue
            unit, cell = harness.unit(group[0]), harness.cell
            rows = [(str(res[axis]),
                     cell(res['modes'].get('fp32', {}), 'median_img_per_s', '%.2f'),
                     cell(res['modes'].get('mxamp', {}), 'median_img_per_s', '%.2f'),
                     cell(res['modes'].get('mxamp', {}), 'ratio_vs_fp32', '%.2f'))
                    for res in group]
            lines += ['', '%s %s, %s %d: by %s' % (network, task, fixed, value, axis)]
            lines += harness.align((axis, 'fp32 ' + unit, 'mxamp ' + unit, 'x FP32'), [rows],
                                   left=0, indent='  ')
    return lines


def format_table(results):
    """The text report: the table (a block per configuration), its notes, then the views."""
    header = table_header(results)
    blocks = [[_skipped_row(res)] if 'skipped' in res else
              [_table_row(res, mode, entry) for mode, entry in res['modes'].items()]
              for res in results]
    under = [[[]] if 'skipped' in res else [_explanation(entry) for entry in res['modes'].values()]
             for res in results]
    return '\n'.join(harness.align(header, blocks, left=5, under=under)
                     + _notes(results, header) + _views(results))


def _version(package):
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def meta(args, argv):
    """What the run was and where it ran: command line, versions (the packages of the
    networks measured among them), CPU, load."""
    packages = {families.family_of(network).package for network in args.networks} - {None}
    return {'schema_version': SCHEMA_VERSION, **harness.run_meta(__file__, argv, args),
            'versions': dict({'mxnet': mx.__version__, 'mxamp': mxamp.__version__,
                              'numpy': np.__version__, 'python': platform.python_version(),
                              'gluoncv': _version('gluoncv')},
                             **{package: _version(package) for package in packages}),
            'cpu_model': hardware.cpu_model(), 'cpu_count': os.cpu_count(),
            'usable_cpus': hardware.usable_cpus(),
            'hardware': hardware.describe(), 'cpu_class': hardware.describe_cpu_class(),
            'DNNL_MAX_CPU_ISA': LAUNCH_ENV.get('DNNL_MAX_CPU_ISA'),
            'environment': launch_variables(),
            'load_average_start': list(os.getloadavg())}


# --------------------------------------------------------------------------
# Command line

def parse_args(argv=None):
    usable_cpus = hardware.usable_cpus()
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--networks', default='resnet50_v1,resnet18_v1',
                   help="comma-separated: gluoncv classifier, ssd_* and fcn_* names, a GluonTS "
                        "forecaster (%s), 'lstm_lm', 'mlp', 'bert', 'transformer' or 'tiny' "
                        "(default: %%(default)s)" % ', '.join(families.gluonts_estimators.MODELS))
    p.add_argument('--tasks', default='inference,training', help='default: %(default)s')
    p.add_argument('--modes', default=','.join(sorted(set(INFERENCE_MODES + TRAINING_MODES))),
                   help='modes to run (default: all); fp32 is always included')
    harness.add_sweep_arguments(p, usable_cpus, "each network's own, 16 for an image "
                                "classifier", 'OMP_NUM_THREADS')
    p.add_argument('--image-size', type=harness.count(1),
                   help="for the networks whose input is an image (default: each network's "
                        "own, 224 for a classifier)")
    harness.add_run_arguments(p, 'benchmark.json')
    p.add_argument('--explain', action='store_true',
                   help='after each configuration, profile its mixed-precision modes with '
                        'mxamp.profile and print the top verdicts under their rows')
    args = p.parse_args(argv)
    args.networks = [n for n in args.networks.split(',') if n]
    args.tasks = [t for t in args.tasks.split(',') if t]
    args.modes = ['fp32'] + [m for m in args.modes.split(',') if m and m != 'fp32']
    unknown = set(args.tasks) - {'inference', 'training'}
    unknown |= set(args.modes) - set(INFERENCE_MODES + TRAINING_MODES)
    if unknown:
        p.error('unknown task/mode: %s' % ', '.join(sorted(unknown)))
    if args.explain and not set(args.modes) & set(EXPLAINED_MODES):
        p.error('--explain profiles the mxamp modes (%s); --modes %s has none of them'
                % (', '.join(EXPLAINED_MODES), ','.join(args.modes)))
    return args


def _worker_entry(spec):
    """A worker process: its answer (or the error it met, :func:`_error_line`) on one stdout
    line."""
    return harness.worker_entry(worker_main, spec, RESULT_PREFIX, _error_line)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args._worker:
        return _worker_entry(json.loads(args._worker))
    configs = configurations(args)
    info = meta(args, argv)
    measured = [[] if unmeasured_task(c) else
                [mode for mode, reason in mode_plan(c, args.modes).items() if not reason]
                for c in configs]
    processes = sum(len(modes) * args.repeats
                    + (len(set(modes) & set(EXPLAINED_MODES)) if args.explain else 0)
                    for modes in measured)
    with tqdm(total=processes, unit='process', desc='benchmark', file=sys.stderr) as progress:
        results = [bench(config, args, progress) for config in configs]
    return harness.finish(args.output, info, results, format_table)


if __name__ == '__main__':
    sys.exit(main())
