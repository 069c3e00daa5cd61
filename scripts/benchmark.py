#!/usr/bin/env python
"""Side-by-side CPU benchmark: FP32 vs mxamp bfloat16 vs MXNet's own ``contrib.amp`` bfloat16.

Usage::

    .venv/bin/python scripts/benchmark.py                       # full run (about 15-25 min)
    .venv/bin/python scripts/benchmark.py --networks resnet50_v1 --tasks inference
    .venv/bin/python scripts/benchmark.py --repeats 7 --steps 2 --output docs/benchmark.json
    .venv/bin/python scripts/benchmark.py --networks tiny --batch 2 --image-size 32 \\
        --repeats 1 --steps 1                                    # smoke test (seconds)

Networks: gluoncv model-zoo names (default ``resnet50_v1`` and the smaller
``resnet18_v1``), random weights (Xavier, fixed seed), 1000 classes, or
``tiny`` (a few conv/BN/ReLU layers, for tests).  Every network is hybridized
with ``static_alloc=True, static_shape=True``.

Modes
-----
inference (``net(x)``, FP32 input, FP32 output):

``fp32``            the FP32 net.
``fp32+fusion``     the FP32 net after ``optimize_for(x, backend='MKLDNN')`` (oneDNN
                    fusion: BatchNorm folded into convolutions, ReLU and residual
                    additions fused as post-ops).
``mxamp``           ``mxamp.convert(net)`` (bfloat16).
``mxamp+fusion``    ``mxamp.for_inference(net, x, dtype='bfloat16')``: converted, then
                    the same oneDNN fusion (mxamp's inference path).
``contrib.amp``     ``mxnet.contrib.amp.convert_hybrid_block(net, 'bfloat16', ctx=cpu)``
                    (does not patch MXNet globally, so it shares the process).

training (forward + backward of softmax cross-entropy, then ``trainer.step``; SGD
with momentum):

``fp32``            FP32 net, ``gluon.Trainer``.
``mxamp``           ``mxamp.convert(net)``, ``mxamp.Trainer`` with its defaults (FP32
                    master weights; no loss scaling, as bfloat16 has FP32's range).
``mxamp+scaling``   same with ``loss_scale='dynamic'`` (loss scaler and overflow check on
                    every step): the upper bound of mxamp's own per-step overhead.
``contrib.amp``     ``amp.init('bfloat16')`` + ``amp.init_trainer`` + ``amp.scale_loss``.

Method
------
* Throughput: all modes of one (network, task) live in one process and are
  measured interleaved: after ``--warmup`` iterations per mode, each repetition
  runs ``--steps`` iterations of every mode in turn; a repetition gives one
  img/s value per mode and the table shows the median over ``--repeats``
  repetitions.  Ratios are computed from those medians (mode / FP32 of the
  same process).  Separate runs on this shared machine vary up to 2x; within
  one process, interleaved, ratios are stable.
* Training iterations are timed in two parts, each ended by ``mx.nd.waitall()``:
  forward+backward, then ``trainer.step`` (``update_ms``).  mxamp's per-step
  overhead is ``update_ms(mxamp mode) - update_ms(fp32)`` (master-weight update
  and cast, loss scaler, overflow check) as a fraction of the mxamp step.
* ``contrib.amp`` training cannot share the main process: ``amp.init``
  monkey-patches ``mx.nd``/``mx.sym`` for good.  It runs in a subprocess that
  first builds and warms up an FP32 net (its graph is built before the patch),
  then calls ``amp.init``; FP32 and contrib.amp are measured interleaved there,
  and contrib.amp's ratio is against that process's FP32 (``baseline`` field:
  ``fp32@contrib.amp process``).  After ``amp.init`` the FP32 optimizer calls go
  through contrib.amp's wrappers too, as in any process that uses it.  Its ratio
  to mxamp is a ratio of ratios (``vs_mxamp``).
* Ratios: ``ratio_vs_fp32`` is the ratio of the medians;
  ``paired_ratio_vs_fp32`` is the median over repetitions of the ratio within
  each repetition (mode and FP32 measured seconds apart), more robust when the
  machine's load changes during the run.  Both come from the per-repetition
  img/s stored in the JSON.
* Peak memory: RSS never shrinks, so each mode's peak is measured in its own
  subprocess that builds only that mode, runs ``--warmup`` + ``--steps``
  iterations and reports its high-water mark (``peak_rss_mb``).  It is read
  from ``VmHWM`` in ``/proc/self/status``, not from
  ``getrusage(RUSAGE_SELF).ru_maxrss``: Linux carries ``ru_maxrss`` over
  ``execve`` from the forked parent, so a child of a large benchmark process
  would report the parent's size (``ru_maxrss_mb`` is kept in the JSON for
  reference).  ``base_rss_mb`` is the RSS of that process after building the
  net, before the first iteration (MXNet itself, Python, the weights).
  ``--no-memory`` skips these subprocesses.
* AMX: mxamp enables it at import when the CPU has ``amx_bf16``; the JSON
  records the CPU flags, the CPU class and whether AMX was enabled
  (``meta.hardware``).
* CPUs without native bfloat16 (`mxamp.hardware.cpu_class` ``'avx2'`` or
  ``'avx512'``, ``DNNL_MAX_CPU_ISA`` included): on ``'avx2'`` MXNet's oneDNN
  has no bfloat16 kernels (contrib.amp's graphs fail: "could not create a
  primitive descriptor iterator"), so the ``contrib.amp`` modes are skipped,
  with the reason in the table and in the JSON (``skipped`` in the mode's
  entry); on ``'avx512'`` they run oneDNN's emulated bfloat16.  mxamp's modes
  then run bfloat16 parameters with FP32
  compute: they measure that emulation (casts, master weights), not bfloat16
  arithmetic; every result says which (``mxamp_compute``: ``'native'`` or
  ``'bfloat16 storage, FP32 compute'``).

Output: a text table on stdout and a JSON file (``--output``, default
``benchmark.json``) with every measured value (per-repetition img/s included).
"""
import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mxamp  # noqa: E402  (first: enables AMX before oneDNN's first primitive)
import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxamp import hardware  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

INFERENCE_MODES = ('fp32', 'fp32+fusion', 'mxamp', 'mxamp+fusion', 'contrib.amp')
TRAINING_MODES = ('fp32', 'mxamp', 'mxamp+scaling', 'contrib.amp')
SCHEMA_VERSION = 1


# --------------------------------------------------------------------------
# Networks

def _tiny_net(classes):
    net = gluon.nn.HybridSequential(prefix='tiny_')
    with net.name_scope():
        net.add(gluon.nn.Conv2D(16, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
                gluon.nn.Activation('relu'), gluon.nn.MaxPool2D(2),
                gluon.nn.Conv2D(32, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
                gluon.nn.Activation('relu'), gluon.nn.GlobalAvgPool2D(),
                gluon.nn.Dense(classes))
    return net


def make_net(name, classes=1000, seed=0):
    """A freshly initialised FP32 network (random weights, fixed seed)."""
    mx.random.seed(seed)
    np.random.seed(seed)
    if name == 'tiny':
        net = _tiny_net(classes)
    else:
        from gluoncv.model_zoo import get_model
        net = get_model(name, classes=classes, pretrained=False)
    net.initialize(mx.init.Xavier(magnitude=2), ctx=mx.cpu())
    return net


def make_data(batch, image_size, classes=1000):
    x = mx.nd.random.uniform(-1, 1, shape=(batch, 3, image_size, image_size))
    y = mx.nd.array(np.random.RandomState(0).randint(0, classes, size=batch))
    return x, y


def _hybridize(net):
    net.hybridize(static_alloc=True, static_shape=True)
    return net


# --------------------------------------------------------------------------
# Modes: each builder returns a callable running one iteration (and syncing)

def build_inference(mode, name, x):
    net = make_net(name)
    # Deferred initialisation finished with a 1-image batch: no full-size FP32
    # pass before the mode's own (it would count in the mode's peak RSS).
    net(x[:1]).wait_to_read()
    if mode == 'mxamp':
        mxamp.convert(net, 'bfloat16')
    if mode == 'contrib.amp':
        from mxnet.contrib import amp
        net.hybridize()
        net(x[:1]).wait_to_read()
        net = amp.convert_hybrid_block(net, target_dtype='bfloat16', ctx=mx.cpu())
    if mode == 'mxamp+fusion':
        mxamp.for_inference(net, x, dtype='bfloat16')
    elif mode == 'fp32+fusion':
        net.optimize_for(x, backend='MKLDNN', static_alloc=True, static_shape=True)
    else:
        _hybridize(net)

    def run():
        net(x).wait_to_read()
        return None
    return run


def _sgd():
    # Tiny learning rate: random weights must not drift to inf/NaN during the run.
    return {'learning_rate': 1e-4, 'momentum': 0.9, 'wd': 1e-5}


def build_training(mode, name, x, y):
    if mode == 'contrib.amp':
        from mxnet.contrib import amp
        amp.init(target_dtype='bfloat16')      # the caller runs this in its own process
    # Under amp.init this net's graph is built with contrib.amp's patched operators.
    net = make_net(name)
    net(x[:1]).wait_to_read()
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    loss_fn.hybridize(static_alloc=True, static_shape=True)
    scale_loss = None
    if mode == 'fp32':
        _hybridize(net)
        trainer = gluon.Trainer(net.collect_params(), 'sgd', _sgd())
    elif mode in ('mxamp', 'mxamp+scaling'):
        mxamp.convert(net, 'bfloat16')
        _hybridize(net)
        trainer = mxamp.Trainer(net.collect_params(), 'sgd', _sgd(),
                                loss_scale='dynamic' if mode == 'mxamp+scaling' else 'auto')
        if mode == 'mxamp+scaling':
            scale_loss = trainer.scale_loss
    elif mode == 'contrib.amp':
        _hybridize(net)
        trainer = gluon.Trainer(net.collect_params(), 'sgd', _sgd())
        amp.init_trainer(trainer)

        def scale_loss(loss):
            return amp.scale_loss(loss, trainer)
    else:
        raise ValueError('unknown training mode %r' % mode)
    batch = x.shape[0]

    def run():
        start = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(x), y)
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


def skip_reason(mode):
    """Why `mode` is not measured on this CPU (one line), or None when it is."""
    if mode == 'contrib.amp' and hardware.cpu_class() == hardware.AVX2:
        return ("MXNet's AMP computes in bfloat16, which oneDNN cannot do on this CPU (%s)"
                % hardware.describe_cpu_class())
    return None


def mxamp_compute():
    """How the mxamp modes compute here: 'native' or 'bfloat16 storage, FP32 compute'."""
    return 'native' if hardware.computes_bfloat16() else 'bfloat16 storage, FP32 compute'


def build(task, mode, name, batch, image_size):
    x, y = make_data(batch, image_size)
    if task == 'inference':
        return build_inference(mode, name, x)
    return build_training(mode, name, x, y)


# --------------------------------------------------------------------------
# Measurement

def measure(runners, batch, warmup, steps, repeats, progress=None):
    """Interleaved timing of several modes in this process.

    Returns ``{mode: {'img_per_s': [...], 'fwd_bwd_ms': [...], 'update_ms': [...]}}``
    (one value per repetition; the last two only for training).
    """
    for mode, run in runners.items():
        for _ in range(warmup):
            run()
        if progress is not None:
            progress.update(warmup)
    out = {mode: {'img_per_s': [], 'fwd_bwd_ms': [], 'update_ms': []} for mode in runners}
    for _ in range(repeats):
        for mode, run in runners.items():
            parts = []
            start = time.perf_counter()
            for _ in range(steps):
                parts.append(run())
            elapsed = time.perf_counter() - start
            out[mode]['img_per_s'].append(batch * steps / elapsed)
            if parts[0] is not None:
                out[mode]['fwd_bwd_ms'].append(1e3 * sum(p[0] for p in parts) / steps)
                out[mode]['update_ms'].append(1e3 * sum(p[1] for p in parts) / steps)
            if progress is not None:
                progress.update(steps)
    for values in out.values():
        if not values['fwd_bwd_ms']:
            del values['fwd_bwd_ms'], values['update_ms']
    return out


def _median(values):
    return float(statistics.median(values)) if values else None


def _rss_mb(field='VmRSS'):
    """This process's current RSS (VmRSS) or its peak (VmHWM), in MiB."""
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1]) / 1024.0
    return None


def _worker_main(spec):
    """Subprocess entry point: 'memory' (one mode) or 'contrib_training' (FP32 + contrib.amp)."""
    args = spec['args']
    if spec['kind'] == 'memory':
        run = build(spec['task'], spec['mode'], spec['network'], args['batch'], args['image_size'])
        base = _rss_mb()
        for _ in range(args['warmup'] + args['steps']):
            run()
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # KiB on Linux
        return {'peak_rss_mb': _rss_mb('VmHWM'), 'base_rss_mb': base, 'ru_maxrss_mb': maxrss}
    # contrib_training: FP32 graph built and warmed up before amp.init patches MXNet.
    runners = {'fp32': build('training', 'fp32', spec['network'], args['batch'],
                             args['image_size'])}
    runners['fp32']()
    runners['contrib.amp'] = build('training', 'contrib.amp', spec['network'], args['batch'],
                                   args['image_size'])
    return measure(runners, args['batch'], args['warmup'], args['steps'], args['repeats'])


def run_worker(spec, timeout):
    """Run `spec` in a fresh Python process; returns its JSON answer or {'error': ...}."""
    command = [sys.executable, os.path.abspath(__file__), '--_worker', json.dumps(spec)]
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {'error': 'timed out after %d s' % timeout}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith('MXAMP_BENCHMARK_RESULT '):
            return json.loads(line[len('MXAMP_BENCHMARK_RESULT '):])
    tail = [l for l in proc.stderr.splitlines() if l.strip()][-3:]
    return {'error': 'exit status %d: %s' % (proc.returncode, ' | '.join(tail))}


# --------------------------------------------------------------------------
# One (network, task)

def bench(network, task, args, progress):
    modes = [m for m in (INFERENCE_MODES if task == 'inference' else TRAINING_MODES)
             if m in args.modes]
    reasons = {m: skip_reason(m) for m in modes}
    skipped = {m: reason for m, reason in reasons.items() if reason}
    modes = [m for m in modes if m not in skipped]
    local = [m for m in modes if not (task == 'training' and m == 'contrib.amp')]
    runners = {}
    for mode in local:
        runners[mode] = build(task, mode, network, args.batch, args.image_size)
    raw = measure(runners, args.batch, args.warmup, args.steps, args.repeats, progress)
    spec_args = {k: getattr(args, k) for k in ('batch', 'image_size', 'warmup', 'steps', 'repeats')}
    result = {'network': network, 'task': task, 'batch': args.batch,
              'image_size': args.image_size, 'mxamp_compute': mxamp_compute(), 'modes': {}}
    for mode in local:
        result['modes'][mode] = dict(raw[mode], process='main', baseline='fp32')
    if task == 'training' and 'contrib.amp' in modes:
        sub = run_worker({'kind': 'contrib_training', 'network': network, 'args': spec_args},
                         args.timeout)
        progress.update((args.warmup + args.steps * args.repeats) * 2)
        if 'error' in sub:
            result['modes']['contrib.amp'] = {'error': sub['error']}
        else:
            result['modes']['fp32@contrib.amp process'] = dict(
                sub['fp32'], process='contrib.amp', baseline='fp32@contrib.amp process')
            result['modes']['contrib.amp'] = dict(
                sub['contrib.amp'], process='contrib.amp', baseline='fp32@contrib.amp process')
    if args.memory:
        for mode in modes:
            mem = run_worker({'kind': 'memory', 'network': network, 'task': task, 'mode': mode,
                              'args': spec_args}, args.timeout)
            progress.update(args.warmup + args.steps)
            entry = result['modes'].setdefault(mode, {})
            if 'error' in mem:
                entry['memory_error'] = mem['error']
            else:
                entry.update(mem)
    result['modes'].update((m, {'skipped': reason}) for m, reason in skipped.items())
    derive(result)
    return result


def derive(result):
    """Medians and ratios, computed from the measured per-repetition values."""
    modes = result['modes']
    for entry in modes.values():
        if 'img_per_s' in entry:
            entry['median_img_per_s'] = _median(entry['img_per_s'])
            if entry.get('update_ms'):
                entry['median_update_ms'] = _median(entry['update_ms'])
                entry['median_fwd_bwd_ms'] = _median(entry['fwd_bwd_ms'])
                entry['median_step_ms'] = entry['median_update_ms'] + entry['median_fwd_bwd_ms']
    fp32 = modes.get('fp32', {})
    for name, entry in modes.items():
        base = modes.get(entry.get('baseline', 'fp32'), {})
        if entry.get('median_img_per_s') and base.get('median_img_per_s'):
            entry['ratio_vs_fp32'] = entry['median_img_per_s'] / base['median_img_per_s']
            entry['paired_ratio_vs_fp32'] = _median(
                [a / b for a, b in zip(entry['img_per_s'], base['img_per_s'])])
        if entry.get('peak_rss_mb') and fp32.get('peak_rss_mb'):
            entry['rss_ratio_vs_fp32'] = entry['peak_rss_mb'] / fp32['peak_rss_mb']
    # contrib.amp against mxamp: ratio of the ratios, each against its own process's FP32.
    camp, ours = modes.get('contrib.amp', {}), modes.get('mxamp', {})
    if camp.get('ratio_vs_fp32') and ours.get('ratio_vs_fp32'):
        ours['vs_contrib_amp'] = ours['ratio_vs_fp32'] / camp['ratio_vs_fp32']
    if result['task'] == 'training' and fp32.get('median_update_ms'):
        overhead = {}
        for name in ('mxamp', 'mxamp+scaling'):
            entry = modes.get(name, {})
            if entry.get('median_step_ms'):
                extra = entry['median_update_ms'] - fp32['median_update_ms']
                overhead[name] = {'extra_update_ms': extra,
                                  'fraction_of_step': extra / entry['median_step_ms']}
        result['mxamp_overhead'] = overhead


# --------------------------------------------------------------------------
# Report

def format_table(results):
    header = ('network', 'task', 'batch', 'mode', 'img/s', 'x FP32', 'paired', 'update ms',
              'peak RSS MB', 'RSS x FP32')
    rows = []
    for res in results:
        for mode, e in res['modes'].items():
            def num(key, fmt):
                value = e.get(key)
                return fmt % value if isinstance(value, (int, float)) else '-'
            ratio = num('ratio_vs_fp32', '%.2f')
            if e.get('baseline', 'fp32') != 'fp32' and ratio != '-':
                ratio += '*'
            measured = 'error' if 'error' in e else 'skipped' if 'skipped' in e else \
                num('median_img_per_s', '%.2f')
            rows.append((res['network'], res['task'], str(res['batch']), mode, measured,
                         ratio, num('paired_ratio_vs_fp32', '%.2f'),
                         num('median_update_ms', '%.0f'), num('peak_rss_mb', '%.0f'),
                         num('rss_ratio_vs_fp32', '%.2f')))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ['  '.join(c.ljust(w) if i < 4 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths)))
             for row in [header] + rows]
    lines.insert(1, '  '.join('-' * w for w in widths))
    notes = []
    notes.append('img/s: median of the repetitions; x FP32: ratio of the medians; paired: '
                 'median of the per-repetition ratios')
    if any(e.get('baseline', 'fp32') != 'fp32' for r in results for e in r['modes'].values()):
        notes.append('* against the FP32 net measured in the contrib.amp process')
    if any(r.get('mxamp_compute', 'native') != 'native' for r in results):
        notes.append('mxamp modes: bfloat16 storage, FP32 compute (this CPU has no native '
                     'bfloat16): they measure that emulation, not bfloat16 arithmetic')
    skips = {(mode, e['skipped']) for r in results for mode, e in r['modes'].items()
             if 'skipped' in e}
    notes.extend('%s skipped: %s' % (mode, reason) for mode, reason in sorted(skips))
    for res in results:
        for name, o in sorted(res.get('mxamp_overhead', {}).items()):
            notes.append('%s training: %s per-step overhead (update vs FP32) %.0f ms = %.1f%% '
                         'of the step' % (res['network'], name, o['extra_update_ms'],
                                          100 * o['fraction_of_step']))
        ours = res['modes'].get('mxamp', {})
        if ours.get('vs_contrib_amp'):
            notes.append('%s %s: mxamp = %.2fx contrib.amp (ratio of the ratios to FP32)'
                         % (res['network'], res['task'], ours['vs_contrib_amp']))
        for mode, e in res['modes'].items():
            for key in ('error', 'memory_error'):
                if key in e:
                    notes.append('%s %s %s: %s' % (res['network'], res['task'], mode, e[key]))
    return '\n'.join(lines + notes)


def meta(args):
    return {'schema_version': SCHEMA_VERSION,
            'date': datetime.datetime.now().isoformat(timespec='seconds'),
            'command': ' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
            'args': {k: v for k, v in vars(args).items() if not k.startswith('_')},
            'mxnet': mx.__version__, 'mxamp': mxamp.__version__,
            'python': platform.python_version(), 'cpu_count': os.cpu_count(),
            'cpu_model': _cpu_model(), 'hardware': hardware.describe(),
            'DNNL_MAX_CPU_ISA': os.environ.get('DNNL_MAX_CPU_ISA'),
            'load_average_start': os.getloadavg()[0]}


def _cpu_model():
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            for line in cpuinfo:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--networks', default='resnet50_v1,resnet18_v1',
                   help="comma-separated gluoncv model names, or 'tiny' (default: %(default)s)")
    p.add_argument('--tasks', default='inference,training', help='default: %(default)s')
    p.add_argument('--modes', default=','.join(sorted(set(INFERENCE_MODES + TRAINING_MODES))),
                   help='modes to run (default: all); fp32 is always included')
    p.add_argument('--batch', type=int, default=16)
    p.add_argument('--image-size', type=int, default=224)
    p.add_argument('--warmup', type=int, default=2, help='iterations per mode before timing')
    p.add_argument('--steps', type=int, default=1, help='iterations per mode per repetition')
    p.add_argument('--repeats', type=int, default=7, help='repetitions (median taken)')
    p.add_argument('--no-memory', dest='memory', action='store_false',
                   help='skip the peak-RSS subprocesses')
    p.add_argument('--timeout', type=int, default=3600, help='seconds per subprocess')
    p.add_argument('--output', default='benchmark.json')
    p.add_argument('--_worker', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.networks = [n for n in args.networks.split(',') if n]
    args.tasks = [t for t in args.tasks.split(',') if t]
    args.modes = ['fp32'] + [m for m in args.modes.split(',') if m and m != 'fp32']
    unknown = set(args.tasks) - {'inference', 'training'}
    unknown |= set(args.modes) - set(INFERENCE_MODES + TRAINING_MODES)
    if unknown:
        p.error('unknown task/mode: %s' % ', '.join(sorted(unknown)))
    return args


def main(argv=None):
    args = parse_args(argv)
    if args._worker:
        answer = _worker_main(json.loads(args._worker))
        print('MXAMP_BENCHMARK_RESULT ' + json.dumps(answer))
        return 0
    total = 0
    for task in args.tasks:
        modes = [m for m in (INFERENCE_MODES if task == 'inference' else TRAINING_MODES)
                 if m in args.modes and not skip_reason(m)]
        per = args.warmup + args.steps * args.repeats
        total += len(modes) * per + (per if task == 'training' and 'contrib.amp' in modes else 0)
        if args.memory:
            total += len(modes) * (args.warmup + args.steps)
    total *= len(args.networks)
    progress = tqdm(total=total, unit='it', desc='benchmark', file=sys.stderr) if tqdm else None

    class _Null(object):
        def update(self, n):
            pass
    progress = progress or _Null()
    info = meta(args)
    results = []
    for network in args.networks:
        for task in args.tasks:
            results.append(bench(network, task, args, progress))
    if hasattr(progress, 'close'):
        progress.close()
    info['load_average_end'] = os.getloadavg()[0]
    table = format_table(results)
    with open(args.output, 'w') as handle:
        json.dump({'meta': info, 'results': results, 'table': table}, handle, indent=1)
    print(table)
    print('written: %s' % args.output)
    return 0


if __name__ == '__main__':
    sys.exit(main())
