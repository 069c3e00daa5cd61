#!/usr/bin/env python
"""PyTorch's peers of ``scripts/benchmark.py``'s BERT and Transformer: FP32 vs bfloat16 autocast.

A measurement aid, not part of mxamp: mxamp never imports it, its tests never
run it, and no requirement file names PyTorch.  It measures, on the same CPU
and with the same scheme as ``scripts/benchmark.py``, what a PyTorch user gets
from ``torch.autocast('cpu', dtype=torch.bfloat16)`` on the networks that the
benchmark's ``bert`` and ``transformer`` families measure in MXNet, so that
mxamp's figures can stand beside PyTorch's.  Without PyTorch in the running
Python it says so in one line and exits with status 2.

Usage::

    python scripts/torch_peer.py --networks bert,transformer      # both, both tasks
    python scripts/torch_peer.py --networks bert --tasks training --threads 2 \\
        --repeats 3 --steps 5 --warmup 2 --output torch_bert.json
    python scripts/torch_peer.py --networks bert --batch 2 --repeats 1 --steps 1 \\
        --warmup 1                                                # smoke test

Networks
--------
Random weights (normal, deviation 0.02, for every matrix and embedding; the
layers' own initialisation otherwise) and random tokens from a fixed seed;
every sequence full (no padding, so no mask but the decoder's causal one):

``bert``         BERT-base: word (30,522), position (512) and segment (2)
                 embeddings summed, LayerNorm, dropout 0.1; ``nn.TransformerEncoder``
                 (``batch_first``) of 12 post-norm layers of 768, 12 heads,
                 feed-forward 3072, GELU, dropout 0.1; a tanh pooler on the first
                 token's output, dropout 0.1 and a 2-class linear classifier.
                 Sentence pairs of 128 tokens (segment 0, then 1); training:
                 cross-entropy on 2 random labels, ``torch.optim.Adam`` at lr 1e-5;
                 batch 8; seq/s.
``transformer``  ``nn.Transformer`` (``batch_first``): d_model 512, 8 heads,
                 feed-forward 2048, 6 + 6 post-norm layers, dropout 0.1; one
                 32,000-token embedding shared by source and target and tied to
                 the output projection, scaled by sqrt(512), plus sinusoidal
                 positions.  Teacher-forced: random sentence pairs of 32 source
                 and 32 target tokens, the decoder reads a target's first 32
                 tokens under the causal mask and scores each next one; training:
                 the mean cross-entropy of those scores, Adam at lr 1e-5; batch 16;
                 pair/s.  Inference is the same forward (every position's
                 scores), not beam search.

These are ``scripts/benchmark_families.py``'s sizes, inputs, losses and
optimizer (MXNet's Adam defaults are ``torch.optim.Adam``'s).  The layers are
PyTorch's own, as a PyTorch user would write the network.  BERT has gluonnlp's
parameters, 109,483,778 of them; gluonnlp's Transformer normalises its embedded
inputs where ``nn.Transformer`` normalises its encoder's and decoder's outputs,
and its attention projections have no biases: the matrix products, which
dominate the work, are the same.

Modes
-----
``fp32``      the FP32 model.
``autocast``  the same FP32 model, its forward (and loss) under
              ``torch.autocast('cpu', dtype=torch.bfloat16)``: bfloat16 where
              PyTorch's autocast lists say so, FP32 weights (the optimizer
              updates them), backward outside the autocast region.

Training: ``model.train()``; forward and loss, ``backward``, then
``optimizer.step()`` (``zero_grad(set_to_none=True)`` first), each part ended by
its own computation (PyTorch's CPU operators return when done).  Inference:
``model.eval()`` under ``torch.inference_mode()``.  In FP32 inference
``nn.TransformerEncoderLayer`` may take PyTorch's fused fast path; autocast
turns that path off ("autocast is enabled"): what PyTorch users get either way.

Method
------
``scripts/benchmark.py``'s: each combination of network, task, ``--batch``
and ``--threads`` value is measured on its own; ``--repeats`` rounds, each one
fresh Python process (a worker: this script with a hidden ``--_worker``
argument) per mode, in the same order every round; a worker builds its mode,
runs ``--warmup`` untimed iterations, then times ``--steps`` consecutive ones:
its throughput is batch x steps over that stretch.  The table shows medians
over rounds; ``x FP32`` is the ratio of the medians, ``paired`` the median of
the per-round ratios.  A worker starts with ``OMP_NUM_THREADS`` set to the
configuration's ``--threads`` and calls ``torch.set_num_threads`` with it (the
default: the CPUs this process may use); it reports the thread count PyTorch
computes with.  Memory: RSS after building (``base_rss_mb``) and the peak
(``VmHWM``, ``peak_rss_mb``).

Output
------
A table on stdout and a JSON file (``--output``, default ``torch_peer.json``,
written whole or not at all) with ``scripts/benchmark.py``'s keys where they
mean the same: ``meta`` (command, versions, CPU, load) and one result per
configuration (``throughput_unit``, ``sample``; per mode ``settings``,
``reproduce``, the workers' ``runs`` with ``img_per_s``, samples per second
whatever the sample is, ``iteration_ms``, ``fwd_bwd_ms`` and ``update_ms``;
``median_img_per_s``, ``median_iteration_ms``, ``median_step_ms``,
``ratio_vs_fp32``, ``paired_ratio_vs_fp32``) and ``table``: the manual's
``.. benchmark::`` directive shows it as it shows the benchmark's.
"""
import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections import namedtuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The environment this script was started with: the one workers start from.
LAUNCH_ENV = dict(os.environ)
RESULT_PREFIX = 'TORCH_PEER_RESULT '
MODES = ('fp32', 'autocast')
TASKS = ('inference', 'training')
SEED = 0
# scripts/benchmark_families.py's FINE_TUNING_ADAM: Adam, lr 1e-5, defaults otherwise.
LEARNING_RATE = 1e-5
INIT_STD = 0.02
DROPOUT = 0.1
# Variables that change what a worker measures, recorded with the run.
PERFORMANCE_PREFIXES = ('OMP_', 'KMP_', 'GOMP_', 'MKL_', 'DNNL_', 'ONEDNN_', 'TORCH_',
                        'LD_PRELOAD')

Network = namedtuple('Network', 'name sample counts batch length build')
Network.__doc__ = """A network measured, as `scripts/benchmark_families.py`'s family of the same name.

Attributes
----------
name : str
    Its ``--networks`` name.
sample : str
    The throughput's unit: ``'seq'`` for seq/s.
counts : str
    What one sample is.
batch : int
    The default batch.
length : int
    Tokens a sequence (source and target alike for the Transformer).
build : callable
    ``build(torch, batch)`` -> (model, inputs, loss), `loss` a function of the
    model's output.
"""

Config = namedtuple('Config', 'network task batch threads')


# --------------------------------------------------------------------------
# Networks (torch is imported in the workers only, and passed in)

def _initialize(torch, model):
    """Every matrix and embedding from a normal of deviation `INIT_STD`, as BERT's own
    initialisation (the mxamp family's); 1-D parameters keep the layers' own."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, INIT_STD)
    return model


def _bert(torch, batch, length=128, vocabulary=30522, positions=512, segments=2, units=768,
          layers=12, heads=12, hidden=3072, classes=2):
    nn = torch.nn

    class BertClassifier(nn.Module):
        """BERT-base and a 2-class classifier on its tanh-pooled first token."""

        def __init__(self):
            super().__init__()
            self.word_embed = nn.Embedding(vocabulary, units)
            self.position_embed = nn.Embedding(positions, units)
            self.segment_embed = nn.Embedding(segments, units)
            self.embed_norm = nn.LayerNorm(units, eps=1e-12)
            self.embed_dropout = nn.Dropout(DROPOUT)
            layer = nn.TransformerEncoderLayer(units, heads, hidden, DROPOUT, activation='gelu',
                                               layer_norm_eps=1e-12, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers)
            self.pooler = nn.Linear(units, units)
            self.classifier = nn.Sequential(nn.Dropout(DROPOUT), nn.Linear(units, classes))

        def forward(self, tokens, segment_ids):
            steps = torch.arange(tokens.shape[1], device=tokens.device)
            embedded = (self.word_embed(tokens) + self.position_embed(steps)
                        + self.segment_embed(segment_ids))
            encoded = self.encoder(self.embed_dropout(self.embed_norm(embedded)))
            return self.classifier(torch.tanh(self.pooler(encoded[:, 0])))

    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, vocabulary, (batch, length), generator=generator)
    # A sentence pair a sequence: its first half segment 0, its second segment 1.
    segment_ids = (torch.arange(length) >= length // 2).long().expand(batch, length)
    labels = torch.randint(0, classes, (batch,), generator=generator)

    def loss(scores):
        return torch.nn.functional.cross_entropy(scores, labels)
    return _initialize(torch, BertClassifier()), (tokens, segment_ids), loss


def _sinusoids(torch, length, units):
    """The Transformer's position encodings, (length, units)."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, units, 2, dtype=torch.float32)
                          * (-math.log(10000.0) / units))
    table = torch.zeros(length, units)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


def _transformer(torch, batch, length=32, vocabulary=32000, units=512, heads=8, hidden=2048,
                 layers=6):
    nn = torch.nn

    class TranslationTransformer(nn.Module):
        """``nn.Transformer`` with one shared embedding, tied to the output projection."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocabulary, units)
            self.register_buffer('positions', _sinusoids(torch, length, units))
            self.embed_dropout = nn.Dropout(DROPOUT)
            self.transformer = nn.Transformer(units, heads, layers, layers, hidden, DROPOUT,
                                              batch_first=True)
            self.project = nn.Linear(units, vocabulary)
            self.project.weight = self.embed.weight
            self.register_buffer('causal_mask',
                                 nn.Transformer.generate_square_subsequent_mask(length))

        def _embedded(self, tokens):
            scaled = self.embed(tokens) * math.sqrt(units)
            return self.embed_dropout(scaled + self.positions[:tokens.shape[1]])

        def forward(self, source, target):
            decoded = self.transformer(self._embedded(source), self._embedded(target),
                                       tgt_mask=self.causal_mask, tgt_is_causal=True)
            return self.project(decoded)

    generator = torch.Generator().manual_seed(SEED)
    source = torch.randint(0, vocabulary, (batch, length), generator=generator)
    # The decoder reads a target's first `length` tokens and scores each next one.
    target = torch.randint(0, vocabulary, (batch, length + 1), generator=generator)
    target_in, target_out = target[:, :-1].contiguous(), target[:, 1:].contiguous()

    def loss(scores):
        return torch.nn.functional.cross_entropy(scores.reshape(-1, vocabulary),
                                                 target_out.reshape(-1))
    return _initialize(torch, TranslationTransformer()), (source, target_in), loss


NETWORKS = {
    'bert': Network('bert', 'seq', 'sentence pairs of 128 tokens', 8, 128, _bert),
    'transformer': Network('transformer', 'pair', 'sentence pairs of 32 source and 32 target '
                           'tokens', 16, 32, _transformer),
}


# --------------------------------------------------------------------------
# Worker: one mode in a fresh process

def _torch():
    import torch
    return torch


def build(torch, task, mode, network, batch):
    """The callable that runs one iteration of `mode` of `task` (and returns, for
    training, its forward+backward and update seconds)."""
    if mode not in MODES:
        raise ValueError('unknown mode %r' % mode)
    torch.manual_seed(SEED)
    model, inputs, loss_of = NETWORKS[network].build(torch, batch)
    autocast = mode == 'autocast'
    if task == 'inference':
        model.eval()

        def run():
            with torch.inference_mode(), \
                    torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
                model(*inputs)
            return None
        return run
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)

    def run():
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(model(*inputs))
        loss.backward()
        middle = time.perf_counter()
        optimizer.step()
        return middle - start, time.perf_counter() - middle
    return run


def _rss_mb(field):
    """This process's current RSS (``'VmRSS'``) or its peak (``'VmHWM'``), in MiB."""
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1]) / 1024.0
    return None


def time_iterations(run, batch, warmup, steps):
    """`warmup` untimed iterations, then `steps` timed consecutive ones: ``img_per_s``
    (samples a second, whatever a sample is), ``iteration_ms`` and, for training, the
    means ``fwd_bwd_ms`` and ``update_ms`` (as ``scripts/benchmark.py``'s)."""
    for _ in range(warmup):
        run()
    iteration_ms, parts = [], []
    start = time.perf_counter()
    for _ in range(steps):
        begin = time.perf_counter()
        parts.append(run())
        iteration_ms.append(1e3 * (time.perf_counter() - begin))
    timing = {'img_per_s': batch * steps / (time.perf_counter() - start),
              'iteration_ms': iteration_ms}
    if parts[0] is not None:
        timing['fwd_bwd_ms'] = 1e3 * sum(p[0] for p in parts) / steps
        timing['update_ms'] = 1e3 * sum(p[1] for p in parts) / steps
    return timing


def launch_variables():
    """The variables this script was started with that change a measurement."""
    return {k: v for k, v in sorted(LAUNCH_ENV.items()) if k.startswith(PERFORMANCE_PREFIXES)}


def worker_main(spec):
    """Build and time the one mode of `spec` in this (fresh) process: `time_iterations`'s
    figures, ``base_rss_mb``, ``peak_rss_mb``, ``load_average`` and ``environment`` (the
    threads PyTorch computes with, its CPU capability, the launch variables)."""
    torch = _torch()
    torch.set_num_threads(spec['threads'])
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:          # older PyTorch
        capability = None
    environment = {'torch_threads': torch.get_num_threads(), 'cpu_capability': capability,
                   'variables': launch_variables()}
    load_average = os.getloadavg()[0]
    run = build(torch, spec['task'], spec['mode'], spec['network'], spec['batch'])
    base_rss = _rss_mb('VmRSS')
    timing = time_iterations(run, spec['batch'], spec['warmup'], spec['steps'])
    return dict(timing, base_rss_mb=base_rss, peak_rss_mb=_rss_mb('VmHWM'),
                load_average=load_average, environment=environment)


def _worker_entry(spec):
    """A worker process: its answer (or the error it met) on one stdout line."""
    try:
        answer = worker_main(spec)
    except Exception as exc:
        traceback.print_exc()
        lines = str(exc).strip().splitlines()
        answer = {'error': '%s: %s' % (type(exc).__name__, lines[0] if lines else '')}
    print(RESULT_PREFIX + json.dumps(answer), flush=True)
    return 1 if 'error' in answer else 0


def _exit_text(returncode):
    if returncode >= 0:
        return 'exit status %d' % returncode
    try:
        return 'killed by %s' % signal.Signals(-returncode).name
    except ValueError:
        return 'killed by signal %d' % -returncode


def run_worker(spec, timeout):
    """Measure one mode in a fresh Python process with ``OMP_NUM_THREADS=spec['threads']``:
    the worker's answer, or ``{'error': why}``."""
    command = [sys.executable, os.path.abspath(__file__), '--_worker', json.dumps(spec)]
    env = dict(LAUNCH_ENV, OMP_NUM_THREADS=str(spec['threads']))
    try:
        proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {'error': 'timed out after %d s' % timeout}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
    return {'error': '%s: %s' % (_exit_text(proc.returncode), ' | '.join(tail))}


# --------------------------------------------------------------------------
# Configurations, rounds, figures

def configurations(args):
    """Every (network, task, batch, threads) to measure, in the table's order."""
    return [Config(network, task, batch, threads)
            for network in args.networks for task in args.tasks
            for batch in args.batch or [NETWORKS[network].batch]
            for threads in args.threads]


def mode_settings(task, mode):
    """What `mode` runs, for the JSON."""
    settings = {'dtype': 'float32' if mode == 'fp32' else
                'autocast bfloat16 (FP32 weights)',
                'autocast': None if mode == 'fp32' else
                "torch.autocast('cpu', dtype=torch.bfloat16)"}
    if task == 'training':
        settings['optimizer'] = {'name': 'torch.optim.Adam', 'lr': LEARNING_RATE}
    else:
        settings['grad'] = 'torch.inference_mode()'
    return settings


def reproduce_command(config, mode, args):
    """The command line that measures `mode` of `config` alone, with its FP32 baseline."""
    words = ['python', 'scripts/torch_peer.py', '--networks', config.network,
             '--tasks', config.task, '--modes', ','.join(dict.fromkeys(('fp32', mode))),
             '--batch', str(config.batch), '--threads', str(config.threads),
             '--warmup', str(args.warmup), '--steps', str(args.steps),
             '--repeats', str(args.repeats)]
    variables = ['%s=%s' % (k, shlex.quote(v)) for k, v in launch_variables().items()
                 if k != 'OMP_NUM_THREADS']
    return ' '.join(variables + [shlex.quote(w) for w in words])


def _median(values):
    return float(statistics.median(values)) if values else None


def derive(result):
    """Medians over rounds and ratios to the configuration's FP32, from the workers'
    answers (``scripts/benchmark.py``'s figures)."""
    complete = {name: entry for name, entry in result['modes'].items()
                if entry.get('runs') and 'error' not in entry}
    for entry in complete.values():
        runs = entry['runs']
        entry['img_per_s'] = [run['img_per_s'] for run in runs]
        entry['median_img_per_s'] = _median(entry['img_per_s'])
        entry['median_iteration_ms'] = _median([ms for run in runs for ms in run['iteration_ms']])
        entry['median_peak_rss_mb'] = _median([run['peak_rss_mb'] for run in runs])
        entry['median_base_rss_mb'] = _median([run['base_rss_mb'] for run in runs])
        if 'update_ms' in runs[0]:
            entry['median_fwd_bwd_ms'] = _median([run['fwd_bwd_ms'] for run in runs])
            entry['median_update_ms'] = _median([run['update_ms'] for run in runs])
            entry['median_step_ms'] = entry['median_fwd_bwd_ms'] + entry['median_update_ms']
    fp32 = complete.get('fp32', {})
    for entry in complete.values():
        if fp32.get('median_img_per_s'):
            entry['ratio_vs_fp32'] = entry['median_img_per_s'] / fp32['median_img_per_s']
            entry['paired_ratio_vs_fp32'] = _median(
                [ours / base for ours, base in zip(entry['img_per_s'], fp32['img_per_s'])])
        if fp32.get('median_peak_rss_mb'):
            entry['rss_ratio_vs_fp32'] = entry['median_peak_rss_mb'] / fp32['median_peak_rss_mb']


def bench(config, args, progress):
    """Measure every mode of `config`: `args.repeats` rounds of one worker per mode."""
    network = NETWORKS[config.network]
    result = dict(config._asdict(), family=network.name, framework='pytorch',
                  throughput_unit=network.sample + '/s', sample=network.counts,
                  sequence_length=network.length, warmup=args.warmup, steps=args.steps,
                  repeats=args.repeats, modes={})
    specs = {}
    for mode in args.modes:
        result['modes'][mode] = {'settings': mode_settings(config.task, mode),
                                 'reproduce': reproduce_command(config, mode, args), 'runs': []}
        specs[mode] = dict(config._asdict(), mode=mode, warmup=args.warmup, steps=args.steps)
    for round_index in range(args.repeats):
        for mode in list(specs):
            progress('%s %s, batch %d, threads %d: %s, round %d of %d' % (
                config.network, config.task, config.batch, config.threads, mode,
                round_index + 1, args.repeats))
            answer = run_worker(specs[mode], args.timeout)
            entry = result['modes'][mode]
            if 'error' in answer:
                entry['error'] = 'round %d of %d: %s' % (round_index + 1, args.repeats,
                                                         answer['error'])
                del specs[mode]
            else:
                entry['runs'].append(answer)
    derive(result)
    return result


# --------------------------------------------------------------------------
# Report

def _cell(entry, key, fmt):
    value = entry.get(key)
    return fmt % value if isinstance(value, (int, float)) else '-'


def format_table(results):
    """The text report: a block of rows per configuration, then its notes."""
    units = {r['throughput_unit'] for r in results}
    header = ('network', 'task', 'batch', 'threads', 'mode',
              units.pop() if len(units) == 1 else 'samples/s', 'x FP32', 'paired',
              'median ms', 'update ms', 'peak RSS MB')
    blocks = []
    for res in results:
        blocks.append([(res['network'], res['task'], str(res['batch']), str(res['threads']),
                        mode, 'error' if 'error' in entry else
                        _cell(entry, 'median_img_per_s', '%.2f'),
                        _cell(entry, 'ratio_vs_fp32', '%.2f'),
                        _cell(entry, 'paired_ratio_vs_fp32', '%.2f'),
                        _cell(entry, 'median_iteration_ms', '%.0f'),
                        _cell(entry, 'median_update_ms', '%.0f'),
                        _cell(entry, 'median_peak_rss_mb', '%.0f'))
                       for mode, entry in res['modes'].items()])
    rows = [row for block in blocks for row in block]
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]

    def line(row):
        return '  '.join(c.ljust(w) if i < 5 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths)))
    lines = [line(header), '  '.join('-' * w for w in widths)]
    for number, block in enumerate(blocks):
        lines += [''] if number else []
        lines += [line(row) for row in block]
    lines.append('PyTorch %s; %s, median ms (per iteration), update ms, peak RSS: medians over '
                 'the rounds (one process per mode and round); x FP32: ratio of the medians; '
                 'paired: median of the per-round ratios; autocast: torch.autocast(\'cpu\', '
                 'dtype=torch.bfloat16)' % (results[0].get('torch_version', '?') if results
                                            else '?', header[5]))
    counts = {r['network']: r['sample'] for r in results}
    lines.append('samples counted: ' + '; '.join('%s: %s' % item for item in counts.items()))
    for res in results:
        label = '%s %s, batch %d, threads %d' % (res['network'], res['task'], res['batch'],
                                                 res['threads'])
        for mode, entry in res['modes'].items():
            if 'error' in entry:
                lines.append('%s: %s failed, %s' % (label, mode, entry['error']))
            threads = {run['environment']['torch_threads'] for run in entry.get('runs', ())}
            if threads - {res['threads']}:
                lines.append('%s: %s computed on %s threads, not %d' % (
                    label, mode, '/'.join(map(str, sorted(threads))), res['threads']))
    return '\n'.join(lines)


def _cpu_info():
    """The CPU's model name and whether it has AVX512-BF16 and AMX-BF16 (``/proc/cpuinfo``)."""
    fields = {}
    try:
        with open('/proc/cpuinfo') as handle:
            for line in handle:
                key, _, value = line.partition(':')
                fields.setdefault(key.strip(), value.strip())   # the first CPU's
    except OSError:
        pass
    flags = set(fields.get('flags', '').split())
    return (fields.get('model name') or platform.processor() or 'CPU',
            {flag: flag in flags for flag in ('avx512_bf16', 'amx_bf16')})


def meta(args, argv, torch_version):
    """What the run was and where it ran (``scripts/benchmark.py``'s keys)."""
    cpu_model, hardware = _cpu_info()
    return {'date': datetime.datetime.now().isoformat(timespec='seconds'),
            'command': ' '.join(shlex.quote(w) for w in
                                [os.path.relpath(os.path.abspath(__file__), ROOT)] + argv),
            'args': {k: v for k, v in vars(args).items() if not k.startswith('_')},
            'versions': {'torch': torch_version, 'python': platform.python_version()},
            'cpu_model': cpu_model, 'cpu_count': os.cpu_count(),
            'usable_cpus': len(os.sched_getaffinity(0)), 'hardware': hardware,
            'environment': launch_variables(), 'load_average_start': list(os.getloadavg())}


def write_json(path, data):
    """Write `data` to `path` whole or not at all."""
    partial = '%s.tmp-%d' % (path, os.getpid())
    try:
        with open(partial, 'w') as handle:
            json.dump(data, handle, indent=1)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


# --------------------------------------------------------------------------
# Command line

def _counts(text):
    """argparse type: comma-separated positive integers, e.g. '1,8,16' -> [1, 8, 16]."""
    try:
        values = [int(v) for v in text.split(',')]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            'expected positive integers separated by commas, got %r' % text)
    return list(dict.fromkeys(values))


def _count(minimum):
    """argparse type: an integer >= `minimum`."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError('expected an integer >= %d, got %r' % (minimum, text))
        return value
    return parse


def _names(allowed, what):
    """argparse type: comma-separated names among `allowed`, in their order there."""
    def parse(text):
        names = [n for n in text.split(',') if n]
        unknown = sorted(set(names) - set(allowed))
        if unknown or not names:
            raise argparse.ArgumentTypeError('unknown %s %s (known: %s)' % (
                what, ', '.join(unknown) or repr(text), ', '.join(allowed)))
        return [n for n in allowed if n in names]
    return parse


def parse_args(argv=None):
    usable_cpus = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--networks', type=_names(tuple(NETWORKS), 'network'),
                   default=list(NETWORKS), help='comma-separated: bert, transformer '
                                                '(default: both)')
    p.add_argument('--tasks', type=_names(TASKS, 'task'), default=list(TASKS),
                   help='default: inference,training')
    p.add_argument('--modes', type=_names(MODES, 'mode'), default=list(MODES),
                   help='fp32, autocast (default: both); fp32 is always included')
    p.add_argument('--batch', type=_counts,
                   help="batch sizes, comma-separated (default: each network's own: "
                        "bert 8, transformer 16)")
    p.add_argument('--threads', type=_counts, default=[usable_cpus],
                   help='torch.set_num_threads and OMP_NUM_THREADS values, comma-separated '
                        '(default: the CPUs this process may use, %d here)' % usable_cpus)
    p.add_argument('--warmup', type=_count(0), default=2,
                   help='untimed iterations at the start of each process (default: %(default)s)')
    p.add_argument('--steps', type=_count(1), default=5,
                   help='timed consecutive iterations per process (default: %(default)s)')
    p.add_argument('--repeats', type=_count(1), default=3,
                   help='rounds, each one process per mode; medians over rounds '
                        '(default: %(default)s)')
    p.add_argument('--timeout', type=_count(1), default=3600, help='seconds per process')
    p.add_argument('--output', default='torch_peer.json')
    p.add_argument('--_worker', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = ['fp32'] + [m for m in args.modes if m != 'fp32']
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args._worker:
        return _worker_entry(json.loads(args._worker))
    if importlib.util.find_spec('torch') is None:
        print('torch_peer.py: PyTorch is not installed in %s; it measures PyTorch, so run it '
              'with a Python that has torch (mxamp itself does not need it)' % sys.executable,
              file=sys.stderr)
        return 2
    # The version from the package's metadata: this process never imports torch (workers do).
    from importlib import metadata
    try:
        torch_version = metadata.version('torch')
    except metadata.PackageNotFoundError:
        torch_version = None
    info = meta(args, argv, torch_version)

    def progress(text):
        print('torch_peer: ' + text, file=sys.stderr, flush=True)
    results = []
    for config in configurations(args):
        result = bench(config, args, progress)
        result['torch_version'] = torch_version
        results.append(result)
    info['load_average_end'] = list(os.getloadavg())
    report = format_table(results)
    write_json(args.output, {'meta': info, 'results': results, 'table': report})
    print(report)
    print('written: %s' % args.output)
    return 0


if __name__ == '__main__':
    sys.exit(main())
