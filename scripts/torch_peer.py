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
``scripts/benchmark.py``'s, from the harness both scripts share
(``scripts/benchmark_harness.py``, the standard library only): each
combination of network, task, ``--batch`` and ``--threads`` value is measured
on its own; ``--repeats`` rounds, each one fresh Python process (a worker:
this script with a hidden ``--_worker`` argument) per mode, in the same order
every round; a worker builds its mode, runs ``--warmup`` untimed iterations,
then times consecutive ones, at least ``--steps`` and for at least
``--min-seconds``: its throughput is batch x iterations over that stretch.
The table shows medians over rounds; ``x FP32`` is the ratio of the medians,
``paired`` the median of the per-round ratios.  A worker starts
with ``OMP_NUM_THREADS`` set to the configuration's ``--threads`` and calls
``torch.set_num_threads`` with it (the default: the CPUs this process may
use); it reports the thread count PyTorch computes with.  Memory: RSS after
building (``base_rss_mb``) and the peak (``VmHWM``, ``peak_rss_mb``).  The
machine's speed: a fixed reference workload timed before and after the
iterations (``reference_ms``; round trips between two threads on two CPUs,
``benchmark_harness.handoff_seconds``), with ``scripts/benchmark.py``'s note
where it changed during the run.

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
import importlib.util
import json
import math
import os
import platform
import sys
import time
from collections import namedtuple

HERE = os.path.dirname(os.path.abspath(__file__))
# benchmark_harness beside this file, also when it is loaded from its path.
sys.path[:0] = [HERE]

import benchmark_harness as harness  # noqa: E402  (the standard library only)

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


def launch_variables():
    """The variables this script was started with that change a measurement."""
    return {k: v for k, v in sorted(LAUNCH_ENV.items()) if k.startswith(PERFORMANCE_PREFIXES)}


def worker_main(spec):
    """Build and time the one mode of `spec` in this (fresh) process:
    `benchmark_harness.measure`'s answer (``img_per_s``, ``iteration_ms``, ``base_rss_mb``,
    ``peak_rss_mb``, ``load_average``...), its ``environment`` the threads PyTorch
    computes with, its CPU capability and the launch variables."""
    torch = _torch()
    torch.set_num_threads(spec['threads'])
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:          # older PyTorch
        capability = None
    environment = {'torch_threads': torch.get_num_threads(), 'cpu_capability': capability,
                   'variables': launch_variables()}
    return harness.measure(spec, lambda: build(torch, spec['task'], spec['mode'],
                                               spec['network'], spec['batch']), environment,
                           harness.handoff_seconds)


def run_worker(spec, timeout):
    """Measure one mode in a fresh Python process with ``OMP_NUM_THREADS=spec['threads']``:
    the worker's answer, or ``{'error': why}`` (`benchmark_harness.run_worker`)."""
    return harness.run_worker(__file__, spec, timeout, LAUNCH_ENV, RESULT_PREFIX)


# --------------------------------------------------------------------------
# Configurations, rounds, figures

def configurations(args):
    """Every (network, task, batch, threads) to measure, in the table's order."""
    return harness.configurations(args, lambda network: NETWORKS[network].batch)


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
    return harness.reproduce_command('scripts/torch_peer.py', config, mode, args,
                                     launch_variables())


def bench(config, args, progress):
    """Measure every mode of `config`: `args.repeats` rounds of one worker per mode."""
    network = NETWORKS[config.network]
    result = dict(config._asdict(), family=network.name, framework='pytorch',
                  throughput_unit=network.sample + '/s', sample=network.counts,
                  sequence_length=network.length, **harness.run_settings(args),
                  repeats=args.repeats, modes={})
    specs = {}
    for mode in args.modes:
        result['modes'][mode] = {'settings': mode_settings(config.task, mode),
                                 'reproduce': reproduce_command(config, mode, args), 'runs': []}
        specs[mode] = dict(config._asdict(), mode=mode, **harness.run_settings(args))

    def before(mode, round_index):
        progress('%s: %s, round %d of %d' % (harness.label(result), mode, round_index + 1,
                                             args.repeats))
    harness.run_rounds(result['modes'], specs, args.repeats,
                       lambda spec: run_worker(spec, args.timeout), before)
    # scripts/benchmark.py's figures, and the median time of every timed iteration.
    harness.derive(result, iteration_ms=True)
    return result


# --------------------------------------------------------------------------
# Report

def format_table(results):
    """The text report: a block of rows per configuration, then its notes."""
    header = ('network', 'task', 'batch', 'threads', 'mode', harness.throughput_column(results),
              'x FP32', 'paired', 'median ms', 'update ms', 'peak RSS MB')
    cell = harness.cell
    blocks = [[harness.config_cells(res) + (
        mode, harness.throughput_cell(entry), cell(entry, 'ratio_vs_fp32', '%.2f'),
        cell(entry, 'paired_ratio_vs_fp32', '%.2f'), cell(entry, 'median_iteration_ms', '%.0f'),
        cell(entry, 'median_update_ms', '%.0f'), cell(entry, 'median_peak_rss_mb', '%.0f'))
        for mode, entry in res['modes'].items()] for res in results]
    lines = harness.align(header, blocks, left=5)
    lines.append('PyTorch %s; %s, median ms (per iteration), update ms, peak RSS: medians over '
                 'the rounds (one process per mode and round); x FP32: ratio of the medians; '
                 'paired: median of the per-round ratios; autocast: torch.autocast(\'cpu\', '
                 'dtype=torch.bfloat16)' % (results[0].get('torch_version', '?') if results
                                            else '?', header[5]))
    counts = {r['network']: r['sample'] for r in results}
    lines.append('samples counted: ' + '; '.join('%s: %s' % item for item in counts.items()))
    for res in results:
        lines += harness.mode_notes(res, 'torch_threads', '%s: %s computed on %s threads, not %d')
        speed = harness.reference_note(res)
        if speed:
            lines.append(speed)
    return '\n'.join(lines)


def meta(args, argv, torch_version):
    """What the run was and where it ran (``scripts/benchmark.py``'s keys)."""
    cpu_model, hardware = harness.cpu_info()
    return {**harness.run_meta(__file__, argv, args),
            'versions': {'torch': torch_version, 'python': platform.python_version()},
            'cpu_model': cpu_model, 'cpu_count': os.cpu_count(),
            'usable_cpus': len(os.sched_getaffinity(0)), 'hardware': hardware,
            'environment': launch_variables(), 'load_average_start': list(os.getloadavg())}


# --------------------------------------------------------------------------
# Command line

def parse_args(argv=None):
    usable_cpus = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--networks', type=harness.names(tuple(NETWORKS), 'network'),
                   default=list(NETWORKS), help='comma-separated: bert, transformer '
                                                '(default: both)')
    p.add_argument('--tasks', type=harness.names(TASKS, 'task'), default=list(TASKS),
                   help='default: inference,training')
    p.add_argument('--modes', type=harness.names(MODES, 'mode'), default=list(MODES),
                   help='fp32, autocast (default: both); fp32 is always included')
    harness.add_sweep_arguments(p, usable_cpus, "each network's own: bert 8, transformer 16",
                                'torch.set_num_threads and OMP_NUM_THREADS')
    harness.add_run_arguments(p, 'torch_peer.json')
    args = p.parse_args(argv)
    args.modes = ['fp32'] + [m for m in args.modes if m != 'fp32']
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args._worker:
        return harness.worker_entry(worker_main, json.loads(args._worker), RESULT_PREFIX)
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
    return harness.finish(args.output, info, results, format_table)


if __name__ == '__main__':
    sys.exit(main())
