"""The measuring harness of ``scripts/benchmark.py`` and ``scripts/torch_peer.py``.

What the two measure differs (MXNet and mxamp's modes, PyTorch's autocast);
how they measure and report it is this module's, so that their figures are
made the same way and stand side by side:

* one measurement per fresh process: :func:`run_worker` starts the script again
  with a hidden ``--_worker`` argument and ``OMP_NUM_THREADS`` set, reads the
  worker's answer from its result line or says why there is none;
  :func:`worker_entry` is that worker's side, :func:`measure` and
  :func:`time_iterations` its timing and memory, :func:`best_time` and
  :func:`handoff_seconds` for the reference workloads that time the machine;
* the rounds: :func:`configurations` (network x task x batch x threads) and
  :func:`run_rounds` (one worker per mode and round, a failed mode not run
  again);
* the figures: :func:`derive`'s medians over rounds and ratios to the
  configuration's FP32 (over the processes that ran fast too, where the
  machine changed speed: :func:`slow_runs`);
* the report: the text table (:func:`align`, :func:`cell`, :func:`mode_notes`,
  :func:`reference_note`),
  the JSON (:func:`run_meta`, :func:`cpu_info`, :func:`write_json`, :func:`finish`) and the
  command-line pieces both parse alike (:func:`count`, :func:`counts`,
  :func:`names`, :func:`add_sweep_arguments`, :func:`add_run_arguments`,
  :func:`reproduce_command`).

It imports the standard library only: ``torch_peer.py`` runs under a Python
with PyTorch and no MXNet, ``benchmark.py`` under one with MXNet and mxamp and
no PyTorch.  Where the scripts differ in a detail, a parameter says which.
"""
import argparse
import datetime
import json
import os
import platform
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import namedtuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# One measured configuration: every mode of it is compared with its FP32.
Config = namedtuple('Config', 'network task batch threads')

# The reference workload's timings: the fastest of this many, after one untimed call.
REFERENCE_REPEATS = 5
# Reference timings of one configuration further apart than this fraction mean the machine
# changed speed during the run: above a quiet machine's spread, below a slow spell's
# slowdown (docs/performance.rst, "When the machine changes speed").
REFERENCE_SPREAD = 0.2
# A worker's timed stretch lasts at least this long (``--min-seconds``): a step of a fraction
# of a millisecond is timed above the noise only over thousands (docs/performance.rst, "Beyond
# image classifiers", the MLP).
MIN_SECONDS = 1.0
# `handoff_seconds`: round trips of a value between two threads on two CPUs, a timing.
HANDOFF_ROUNDS = 1000


# --------------------------------------------------------------------------
# Worker: one mode in a fresh process

def rss_mb(field):
    """This process's current RSS (``'VmRSS'``) or its peak (``'VmHWM'``), in MiB."""
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1]) / 1024.0
    return None


def time_iterations(run, batch, warmup, steps, min_seconds=0.0):
    """Run `warmup` untimed iterations, then time consecutive ones: at least `steps`, and
    on until the timed stretch lasts `min_seconds`.

    `run()` runs one iteration, ended by its computation; it returns None, or
    for training its (forward+backward, update) seconds.  A step of a fraction of a
    millisecond needs thousands to be timed above the noise of the clock and of the
    machine; a step of a second needs `steps`.

    Returns
    -------
    dict
        ``img_per_s``, samples (``batch``) per second over the timed stretch, whatever
        a sample of the network is (images, series...), ``iteration_ms`` (one value per
        timed iteration, to 0.1 us: far below any step's spread) and, for training, the
        means ``fwd_bwd_ms`` and ``update_ms`` of its two parts.
    """
    for _ in range(warmup):
        run()
    elapsed, parts = [], []
    start = time.perf_counter()
    while len(elapsed) < steps or time.perf_counter() - start < min_seconds:
        begin = time.perf_counter()
        parts.append(run())
        elapsed.append(time.perf_counter() - begin)
    stretch = time.perf_counter() - start
    # Rounded after the timed stretch: thousands of sub-millisecond steps a process would
    # otherwise fill the JSON with digits that mean nothing.
    iteration_ms = [round(1e3 * seconds, 4) for seconds in elapsed]
    timing = {'img_per_s': batch * len(elapsed) / stretch, 'iteration_ms': iteration_ms}
    if parts[0] is not None:      # training: (forward+backward s, update s) per iteration
        timing['fwd_bwd_ms'] = 1e3 * sum(p[0] for p in parts) / len(parts)
        timing['update_ms'] = 1e3 * sum(p[1] for p in parts) / len(parts)
    return timing


def measure(spec, build, environment, reference):
    """A worker's answer: build its mode (``build()`` returns `time_iterations`'s `run`),
    then time it as `spec` says (``batch`` and :func:`run_settings`'s), between two timings of
    `reference`.

    `reference()` times a fixed workload, the same in every mode's process, and
    returns its seconds (None: it cannot here): what changes it is the machine
    (:func:`reference_note`).

    Returns
    -------
    dict
        :func:`time_iterations`'s figures, ``base_rss_mb`` (after building,
        before the first iteration), ``peak_rss_mb``, ``load_average`` (1 min,
        before building), ``reference_ms`` (`reference`'s time before and after
        the iterations, where it gave one) and `environment` (what the script
        found out about the threads it computes with and its launch variables).
    """
    load_average = os.getloadavg()[0]
    run = build()
    base_rss = rss_mb('VmRSS')
    before = reference()
    timing = time_iterations(run, spec['batch'], spec['warmup'], spec['steps'],
                             spec['min_seconds'])
    after = reference()
    if before is not None and after is not None:
        timing['reference_ms'] = [round(1e3 * before, 3), round(1e3 * after, 3)]
    return dict(timing, base_rss_mb=base_rss, peak_rss_mb=rss_mb('VmHWM'),
                load_average=load_average, environment=environment)


def best_time(work, repeats=REFERENCE_REPEATS):
    """The fastest of `repeats` timings of ``work()`` (which waits for its result), after one
    untimed call: seconds."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def handoff_seconds():
    """A reference workload of the standard library (:func:`measure`): `HANDOFF_ROUNDS`
    round trips of a value between this thread and another, each pinned to its own CPU,
    the fastest of :func:`best_time`'s timings; None where this process may use one CPU
    only.  Its time is that of the wake-ups between CPUs, which a virtual machine's slow
    spells lengthen."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None

    def round_trips():
        there, back = queue.SimpleQueue(), queue.SimpleQueue()

        def echo():
            os.sched_setaffinity(0, {cpus[1]})      # Linux: pid 0 is the calling thread
            for _ in range(HANDOFF_ROUNDS):
                back.put(there.get())
        other = threading.Thread(target=echo)
        other.start()
        for value in range(HANDOFF_ROUNDS):
            there.put(value)
            back.get()
        other.join()

    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[0]})
    try:
        return best_time(round_trips)
    finally:
        os.sched_setaffinity(0, own)


def first_line(exc):
    """One line saying what went wrong: the exception's type and its message's first line."""
    lines = str(exc).strip().splitlines()
    return '%s: %s' % (type(exc).__name__, lines[0] if lines else '')


def worker_entry(worker_main, spec, prefix, describe=first_line):
    """A worker process: ``worker_main(spec)``'s answer, or ``{'error': describe(exc)}``
    for the exception it raised (its traceback on stderr), on one stdout line that
    starts with `prefix`.  Returns the process's exit status."""
    try:
        answer = worker_main(spec)
    except Exception as exc:
        traceback.print_exc()
        answer = {'error': describe(exc)}
    print(prefix + json.dumps(answer), flush=True)
    return 1 if 'error' in answer else 0


def exit_text(returncode):
    """How a process ended, from its return code: ``exit status 1``, ``killed by SIGSEGV``."""
    if returncode >= 0:
        return 'exit status %d' % returncode
    try:
        return 'killed by %s' % signal.Signals(-returncode).name
    except ValueError:
        return 'killed by signal %d' % -returncode


def run_worker(script, spec, timeout, launch_env, prefix):
    """Measure one mode in a fresh Python process: `script` with ``--_worker spec``, in
    `launch_env` (the environment the script was started with) with
    ``OMP_NUM_THREADS=spec['threads']``.

    Returns
    -------
    dict
        The worker's answer (its last stdout line that starts with `prefix`), or
        ``{'error': why}`` when it failed, crashed or ran past `timeout` seconds.
    """
    command = [sys.executable, os.path.abspath(script), '--_worker', json.dumps(spec)]
    env = dict(launch_env, OMP_NUM_THREADS=str(spec['threads']))
    try:
        proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {'error': 'timed out after %d s' % timeout}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    tail = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
    return {'error': '%s: %s' % (exit_text(proc.returncode), ' | '.join(tail))}


# --------------------------------------------------------------------------
# Configurations and rounds

def configurations(args, default_batch):
    """Every (network, task, batch, threads) to measure, in the table's order;
    ``default_batch(network)`` where ``--batch`` is not given."""
    return [Config(network, task, batch, threads)
            for network in args.networks for task in args.tasks
            for batch in args.batch or [default_batch(network)]
            for threads in args.threads]


def reproduce_command(script, config, mode, args, variables, options=()):
    """The command line that measures `mode` of `config` alone, with its FP32 baseline:
    `script` (``'scripts/benchmark.py'``), its `options` after ``--threads``, and the
    launch `variables` but ``OMP_NUM_THREADS``, which comes from ``--threads``."""
    words = ['python', script, '--networks', config.network,
             '--tasks', config.task, '--modes', ','.join(dict.fromkeys(('fp32', mode))),
             '--batch', str(config.batch), '--threads', str(config.threads)]
    words += list(options) + ['--warmup', str(args.warmup), '--steps', str(args.steps),
                              '--min-seconds', '%g' % args.min_seconds,
                              '--repeats', str(args.repeats)]
    # The rest of the environment as it was here.
    assignments = ['%s=%s' % (k, shlex.quote(v)) for k, v in variables.items()
                   if k != 'OMP_NUM_THREADS']
    return ' '.join(assignments + [shlex.quote(w) for w in words])


def run_rounds(modes, specs, repeats, measure_one, before=None, after=None):
    """`repeats` rounds of one worker per mode, in the order of `specs`, every round.

    ``measure_one(spec)`` is a worker's answer; each answer goes to the
    ``runs`` of its mode's entry in `modes`, or an error becomes the entry's
    ``error`` (with its round) and the mode leaves `specs`: it is not run
    again.  ``before(mode, round_index)`` and ``after(mode, round_index,
    answer)``, where given, are called around each worker (progress).
    """
    for round_index in range(repeats):
        for mode in list(specs):
            if before is not None:
                before(mode, round_index)
            answer = measure_one(specs[mode])
            if after is not None:
                after(mode, round_index, answer)
            entry = modes[mode]
            if 'error' in answer:
                entry['error'] = 'round %d of %d: %s' % (round_index + 1, repeats,
                                                         answer['error'])
                del specs[mode]
            else:
                entry['runs'].append(answer)


# --------------------------------------------------------------------------
# Figures

def median(values):
    return float(statistics.median(values)) if values else None


def summarise(entry, iteration_ms=False):
    """Medians over the rounds of one mode's runs (and of every timed iteration's
    ``iteration_ms`` with `iteration_ms`)."""
    runs = entry['runs']
    entry['img_per_s'] = [run['img_per_s'] for run in runs]
    entry['median_img_per_s'] = median(entry['img_per_s'])
    if iteration_ms:
        entry['median_iteration_ms'] = median([ms for run in runs for ms in run['iteration_ms']])
    entry['median_peak_rss_mb'] = median([run['peak_rss_mb'] for run in runs])
    entry['median_base_rss_mb'] = median([run['base_rss_mb'] for run in runs])
    if 'update_ms' in runs[0]:
        entry['median_fwd_bwd_ms'] = median([run['fwd_bwd_ms'] for run in runs])
        entry['median_update_ms'] = median([run['update_ms'] for run in runs])
        entry['median_step_ms'] = entry['median_fwd_bwd_ms'] + entry['median_update_ms']


def derive(result, iteration_ms=False):
    """Medians over rounds (:func:`summarise`) and ratios to the configuration's FP32, from
    the workers' answers; returns the modes measured in every round, by name."""
    complete = {name: entry for name, entry in result['modes'].items()
                if entry.get('runs') and 'error' not in entry}
    for entry in complete.values():
        summarise(entry, iteration_ms)
    fp32 = complete.get('fp32', {})
    for entry in complete.values():
        if fp32.get('median_img_per_s'):
            entry['ratio_vs_fp32'] = entry['median_img_per_s'] / fp32['median_img_per_s']
            # Rounds pair up: mode and FP32 ran seconds apart, under the same load.
            entry['paired_ratio_vs_fp32'] = median(
                [ours / base for ours, base in zip(entry['img_per_s'], fp32['img_per_s'])])
        if fp32.get('median_peak_rss_mb'):
            entry['rss_ratio_vs_fp32'] = entry['median_peak_rss_mb'] / fp32['median_peak_rss_mb']
    _derive_steady(complete)
    return complete


def slow_runs(modes):
    """``(fastest, slowest, {mode: [round index...]})`` of `modes`' reference timings
    (:func:`measure`'s ``reference_ms``): the processes whose slower timing is over
    `REFERENCE_SPREAD` above the fastest of all ran (at least partly) while the machine
    was slower.  None when no process timed the reference."""
    timings = {(mode, index): run['reference_ms'] for mode, entry in modes.items()
               for index, run in enumerate(entry.get('runs', ())) if run.get('reference_ms')}
    if not timings:
        return None
    fastest = min(min(pair) for pair in timings.values())
    slowest = max(max(pair) for pair in timings.values())
    slow = {}
    for (mode, index), pair in timings.items():
        if max(pair) > fastest * (1 + REFERENCE_SPREAD):
            slow.setdefault(mode, []).append(index)
    return fastest, slowest, slow


def _derive_steady(modes):
    """Where the machine changed speed, each mode's median over its processes that ran fast
    throughout (``steady_img_per_s``, ``steady_runs``) and its ratio to FP32's
    (``steady_ratio_vs_fp32``): the two machines' figures kept apart."""
    found = slow_runs(modes)
    if found is None or not found[2]:
        return
    slow = found[2]
    for mode, entry in modes.items():
        steady = [value for index, value in enumerate(entry['img_per_s'])
                  if index not in slow.get(mode, ())]
        entry['steady_runs'] = len(steady)
        entry['steady_img_per_s'] = median(steady)
    base = modes.get('fp32', {}).get('steady_img_per_s')
    for entry in modes.values():
        if base and entry['steady_img_per_s']:
            entry['steady_ratio_vs_fp32'] = entry['steady_img_per_s'] / base


def reference_note(result):
    """A line saying that the machine changed speed during `result`'s run, in which
    processes, and each mode's ratio to FP32 over the processes that ran fast; None when
    it did not change speed.

    Every process of the configuration timed the same reference workload before and after
    its iterations (:func:`measure`).  Where those times spread by more than
    `REFERENCE_SPREAD` (:func:`slow_runs`), the ratio of medians mixes two machines; the
    paired ratio, whose processes ran seconds apart, and the ratio over the fast processes
    do not.
    """
    found = slow_runs(result['modes'])
    if found is None or not found[2]:
        return None
    fastest, slowest, slow = found
    where = '; '.join('%s round%s %s' % (mode, 's' if len(rounds) > 1 else '',
                                        ', '.join(str(index + 1) for index in rounds))
                      for mode, rounds in slow.items())
    steady = ['%s %.2fx FP32 (%d and %d processes)'
              % (mode, entry['steady_ratio_vs_fp32'], entry['steady_runs'],
                 result['modes']['fp32']['steady_runs'])
              for mode, entry in result['modes'].items()
              if mode != 'fp32' and entry.get('steady_ratio_vs_fp32')]
    return ('%s: the machine changed speed during the run: the reference workload took '
            '%.1f-%.1f ms (%.2fx); slower by over %d%% in %s; read the paired ratio%s'
            % (label(result), fastest, slowest, slowest / fastest,
               round(100 * REFERENCE_SPREAD), where,
               ', or over the processes that ran fast: ' + ', '.join(steady) if steady else ''))


# --------------------------------------------------------------------------
# Report

def unit(result):
    # A result of benchmark.py's schema 2 counted images.
    return result.get('throughput_unit', 'img/s')


def throughput_column(results):
    """The throughput column's title: the results' unit (``img/s``...), or ``samples/s``
    where they count different samples (the notes say which)."""
    units = {unit(res) for res in results}
    return units.pop() if len(units) == 1 else 'samples/s'


def label(result):
    return '%s %s, batch %d, threads %d' % (result['network'], result['task'], result['batch'],
                                            result['threads'])


def config_cells(result):
    """A row's first four cells: network, task, batch, threads."""
    return result['network'], result['task'], str(result['batch']), str(result['threads'])


def cell(entry, key, fmt):
    value = entry.get(key)
    return fmt % value if isinstance(value, (int, float)) else '-'


def throughput_cell(entry):
    """A mode's median throughput, or ``error`` / ``skipped`` where it has none."""
    if 'error' in entry:
        return 'error'
    if 'skipped' in entry:
        return 'skipped'
    return cell(entry, 'median_img_per_s', '%.2f')


def align(header, blocks, left, indent='', under=None):
    """Text table: `header`, a rule, then the rows of each block, blocks apart by a blank line.

    The first `left` columns are left-aligned, the others (numbers) right-aligned.
    `under`, shaped as `blocks`, gives the lines printed under each row.
    """
    rows = [row for block in blocks for row in block]
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]

    def line(row):
        return indent + '  '.join(c.ljust(w) if i < left else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(row, widths)))
    lines = [line(header), indent + '  '.join('-' * w for w in widths)]
    for number, block in enumerate(blocks):
        lines += [''] if number else []
        for index, row in enumerate(block):
            lines.append(line(row))
            lines += under[number][index] if under else []
    return lines


def mode_notes(result, threads_key, threads_note):
    """The notes each mode of `result` needs: why it failed, and on how many threads it
    computed where that is not the configuration's.

    `threads_key` names the count in a run's ``environment`` (None: not found
    out); `threads_note` is the note's ``%`` format, of the label, the mode, the
    counts and the threads asked for.
    """
    notes = []
    name = label(result)
    for mode, entry in result['modes'].items():
        if 'error' in entry:
            notes.append('%s: %s failed, %s' % (name, mode, entry['error']))
        counts = {run['environment'][threads_key] for run in entry.get('runs', ())}
        counts.discard(None)        # not found out: the JSON says why
        if counts - {result['threads']}:
            notes.append(threads_note % (name, mode, '/'.join(map(str, sorted(counts))),
                                         result['threads']))
    return notes


def cpu_info():
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


def run_meta(script, argv, args):
    """The JSON's ``meta`` about the run itself: ``date``, ``command`` (`script`,
    relative to the checkout, and `argv`) and ``args`` (the parsed options)."""
    return {'date': datetime.datetime.now().isoformat(timespec='seconds'),
            'command': ' '.join(shlex.quote(w) for w in
                                [os.path.relpath(os.path.abspath(script), ROOT)] + argv),
            'args': {k: v for k, v in vars(args).items() if not k.startswith('_')}}


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_text(value, indent=''):
    """`value` as indented JSON, but a list of numbers on one line: the per-iteration times
    of a run of thousands of short steps would otherwise take a line each."""
    inner = indent + ' '
    if isinstance(value, dict) and value:
        lines = ['%s%s: %s' % (inner, json.dumps(key), _json_text(item, inner))
                 for key, item in value.items()]
    elif isinstance(value, list) and value and not all(_is_number(item) for item in value):
        lines = [inner + _json_text(item, inner) for item in value]
    else:
        return json.dumps(value)
    opening, closing = ('{', '}') if isinstance(value, dict) else ('[', ']')
    return '%s\n%s\n%s%s' % (opening, ',\n'.join(lines), indent, closing)


def write_json(path, data):
    """Write `data` to `path` (`_json_text`) whole or not at all: an interrupted run leaves no
    half file."""
    partial = '%s.tmp-%d' % (path, os.getpid())
    try:
        with open(partial, 'w') as handle:
            handle.write(_json_text(data))
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def finish(output, info, results, format_table):
    """End a run: the load average to `info`, the JSON (``meta``, ``results``, ``table``)
    to `output`, the table on stdout.  Returns the exit status, 0."""
    info['load_average_end'] = list(os.getloadavg())
    report = format_table(results)
    write_json(output, {'meta': info, 'results': results, 'table': report})
    print(report)
    print('written: %s' % output)
    return 0


# --------------------------------------------------------------------------
# Command line

def count(minimum):
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


def seconds(text):
    """argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float('inf'):
        raise argparse.ArgumentTypeError('expected seconds >= 0, got %r' % text)
    return value


def run_settings(args):
    """What every worker of a run is told about its iterations, and what the run's result
    records: ``warmup``, ``steps`` (the least timed) and ``min_seconds``."""
    return dict(warmup=args.warmup, steps=args.steps, min_seconds=args.min_seconds)


def counts(text):
    """argparse type: comma-separated positive integers, e.g. '1,8,16' -> [1, 8, 16]."""
    try:
        values = [int(v) for v in text.split(',')]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            'expected positive integers separated by commas, got %r' % text)
    return list(dict.fromkeys(values))


def names(allowed, what):
    """argparse type: comma-separated names among `allowed`, in their order there."""
    def parse(text):
        given = [n for n in text.split(',') if n]
        unknown = sorted(set(given) - set(allowed))
        if unknown or not given:
            raise argparse.ArgumentTypeError('unknown %s %s (known: %s)' % (
                what, ', '.join(unknown) or repr(text), ', '.join(allowed)))
        return [n for n in allowed if n in given]
    return parse


def add_sweep_arguments(parser, usable_cpus, default_batch, threads_set):
    """``--batch`` and ``--threads``: the sweep.  `default_batch` says what a network runs
    at without ``--batch``; `threads_set`, what a ``--threads`` value sets."""
    parser.add_argument('--batch', type=counts,
                        help='batch sizes, comma-separated (default: %s)' % default_batch)
    parser.add_argument('--threads', type=counts, default=[usable_cpus],
                        help='%s values, comma-separated (default: the CPUs this process may '
                             'use, %d here)' % (threads_set, usable_cpus))


def add_run_arguments(parser, output):
    """``--warmup``, ``--steps``, ``--min-seconds``, ``--repeats``, ``--timeout``,
    ``--output`` (default `output`) and the hidden ``--_worker``."""
    parser.add_argument('--warmup', type=count(0), default=2,
                        help='untimed iterations at the start of each process '
                             '(default: %(default)s)')
    parser.add_argument('--steps', type=count(1), default=5,
                        help='timed consecutive iterations per process, at least '
                             '(default: %(default)s)')
    parser.add_argument('--min-seconds', type=seconds, default=MIN_SECONDS,
                        help='time iterations past --steps until the timed stretch lasts '
                             'this long, so that short steps are timed above the noise '
                             '(default: %(default)s)')
    parser.add_argument('--repeats', type=count(1), default=3,
                        help='rounds, each one process per mode; medians over rounds '
                             '(default: %(default)s)')
    parser.add_argument('--timeout', type=count(1), default=3600, help='seconds per process')
    parser.add_argument('--output', default=output)
    parser.add_argument('--_worker', help=argparse.SUPPRESS)
