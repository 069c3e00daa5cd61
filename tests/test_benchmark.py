"""scripts/benchmark.py: one process per mode, the figures and JSON it reports from them."""
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'benchmark.py')


def _script(name):
    """scripts/`name`.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, 'scripts',
                                                                     name + '.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load():
    return _script('benchmark')


def _answer(img_per_s, threads=1, training=False, update_ms=20.0, peak_rss_mb=1000.0,
            reference_ms=(4.8, 4.9)):
    """A worker's answer, as `worker_main` gives it."""
    answer = {'img_per_s': img_per_s, 'iteration_ms': [10.0, 11.0], 'base_rss_mb': 500.0,
              'peak_rss_mb': peak_rss_mb, 'load_average': 0.5,
              'reference_ms': list(reference_ms),
              'environment': {'openmp_threads': threads,
                              'openmp_runtime': '/usr/lib/libgomp.so.1.0.0',
                              'variables': {'OMP_NUM_THREADS': str(threads)}}}
    if training:
        answer.update(fwd_bwd_ms=100.0, update_ms=update_ms)
    return answer


class FakeWorkers(object):
    """Stands in for `subprocess.run`: records every worker started, answers with canned img/s.

    `img_per_s(spec, call)` gives the figure of a worker (`call`: how many ran
    before it); the modes in `crash` die as a segfault would; `explain(spec)`
    answers the ``--explain`` workers.
    """

    def __init__(self, bench, img_per_s, crash=(), explain=None):
        self.prefix = bench.RESULT_PREFIX
        self.img_per_s, self.crash, self.explain = img_per_s, crash, explain
        self.calls = []    # (spec, environment) of each worker, in order

    def __call__(self, command, env, **kwargs):
        assert command[-2] == '--_worker' and command[1] == SCRIPT
        spec = json.loads(command[-1])
        if spec['mode'] in self.crash:
            self.calls.append((spec, env))
            return subprocess.CompletedProcess(command, -11, '', 'Fatal Python error: '
                                               'Segmentation fault\n\n')
        if spec.get('explain'):
            answer = self.explain(spec)
        else:
            answer = _answer(self.img_per_s(spec, len(self.calls)), int(env['OMP_NUM_THREADS']),
                             spec['task'] == 'training')
        self.calls.append((spec, env))
        return subprocess.CompletedProcess(
            command, 0, 'mxamp: a log line\n%s%s\n' % (self.prefix, json.dumps(answer)), '')


def _run_main(bench, monkeypatch, tmp_path, argv, img_per_s, crash=(), explain=None):
    workers = FakeWorkers(bench, img_per_s, crash, explain)
    monkeypatch.setattr(bench.harness.subprocess, 'run', workers)
    out = tmp_path / 'bench.json'
    assert bench.main(argv + ['--output', str(out)]) == 0
    return workers, json.loads(out.read_text())


def test_derive_computes_medians_and_ratios_from_the_workers_answers():
    bench = _load()
    result = {'network': 'n', 'task': 'training', 'batch': 4, 'threads': 2,
              'mxamp_compute': 'native', 'modes': {
                  'fp32': {'runs': [_answer(v, 2, True, u, 1000.0)
                                    for v, u in ((10.0, 20.0), (12.0, 22.0), (11.0, 21.0))]},
                  'mxamp': {'runs': [_answer(v, 2, True, u, 500.0)
                                     for v, u in ((30.0, 30.0), (20.0, 31.0), (25.0, 29.0))]},
                  # MXNet computed on 1 OpenMP thread (say MXNET_OMP_MAX_THREADS=1), not 2.
                  'contrib.amp': {'runs': [_answer(v, 1, True) for v in (16.0, 18.0, 20.0)]},
                  'mxamp+scaling': {'error': 'round 1 of 3: exit status 1: boom', 'runs': []}}}
    bench.derive(result)
    modes = result['modes']
    assert modes['fp32']['median_img_per_s'] == 11.0
    assert modes['mxamp']['img_per_s'] == [30.0, 20.0, 25.0]
    assert modes['mxamp']['ratio_vs_fp32'] == pytest.approx(25.0 / 11.0)
    assert modes['mxamp']['paired_ratio_vs_fp32'] == pytest.approx(25.0 / 11.0)  # 3, 1.67, 2.27
    assert modes['contrib.amp']['ratio_vs_fp32'] == pytest.approx(18.0 / 11.0)
    assert modes['mxamp']['vs_contrib_amp'] == pytest.approx(25.0 / 18.0)
    assert modes['mxamp']['rss_ratio_vs_fp32'] == pytest.approx(0.5)
    assert 'median_img_per_s' not in modes['mxamp+scaling']
    assert set(result['mxamp_overhead']) == {'mxamp'}
    overhead = result['mxamp_overhead']['mxamp']
    assert overhead['extra_update_ms'] == pytest.approx(30.0 - 21.0)
    assert overhead['fraction_of_step'] == pytest.approx(9.0 / (100.0 + 30.0))
    table = bench.format_table([result])
    assert '2.27' in table and '1.64' in table
    assert 'n training, batch 4, threads 2: mxamp = 1.39x contrib.amp' in table
    assert ('n training, batch 4, threads 2: mxamp+scaling failed, round 1 of 3: exit status 1: '
            'boom') in table
    assert ("n training, batch 4, threads 2: contrib.amp computed on 1 OpenMP threads, not 2 "
            "(see its runs' environment)") in table
    assert 'fp32 computed on' not in table


def _speed_result(bench, runs):
    """A derived training result of `runs`: mode -> (img/s, reference timings) a round."""
    result = {'network': 'n', 'task': 'training', 'batch': 4, 'threads': 2,
              'mxamp_compute': 'native', 'modes': {
                  mode: {'runs': [_answer(value, 2, True, reference_ms=pair)
                                  for value, pair in pairs]}
                  for mode, pairs in runs.items()}}
    bench.derive(result)
    return result


def test_a_change_of_the_machines_speed_is_named_with_the_processes_it_hit():
    bench = _load()
    slowed = _speed_result(bench, {
        'fp32': [(100.0, (4.8, 4.9)), (70.0, (8.9, 9.0)), (104.0, (4.7, 4.8)),
                 (98.0, (4.9, 5.0))],
        # Round 2 slowed down during the iterations: its second timing says so.
        'mxamp:auto': [(96.0, (4.9, 4.8)), (75.0, (4.8, 8.7)), (73.0, (8.6, 8.8)),
                       (99.0, (4.7, 4.9))]})
    assert bench.harness.reference_note(slowed) == (
        'n training, batch 4, threads 2: the machine changed speed during the run: the '
        'reference workload took 4.7-9.0 ms (1.91x); slower by over 20% in fp32 round 2; '
        'mxamp:auto rounds 2, 3; read the paired ratio, or over the processes that ran '
        'fast: mxamp:auto 0.97x FP32 (2 and 3 processes)')
    auto = slowed['modes']['mxamp:auto']
    # All rounds: 85.5 / 99 = 0.86x FP32; the fast ones: 97.5 / 100 (the JSON keeps both).
    assert auto['ratio_vs_fp32'] == pytest.approx(85.5 / 99.0)
    assert auto['steady_img_per_s'] == 97.5 and auto['steady_runs'] == 2
    assert auto['steady_ratio_vs_fp32'] == pytest.approx(0.975)
    assert bench.harness.reference_note(slowed) in bench.format_table([slowed]).splitlines()
    many = _speed_result(bench, {'fp32': [(70.0, (9.0, 9.0)), (99.0, (4.8, 4.8)),
                                          (70.0, (9.0, 9.0))]})
    assert 'in fp32 rounds 1, 3; read the paired ratio' in bench.harness.reference_note(many)
    # A quiet machine's timings (within 20%), and a JSON from before the reference: no note.
    steady = _speed_result(bench, {'fp32': [(99.0, (4.8, 5.1)), (98.0, (4.9, 5.0))],
                                   'mxamp:auto': [(97.0, (4.7, 5.5))]})
    assert bench.harness.reference_note(steady) is None
    assert 'steady_ratio_vs_fp32' not in steady['modes']['mxamp:auto']
    assert 'changed speed' not in bench.format_table([steady])
    for entry in steady['modes'].values():
        for run in entry['runs']:
            del run['reference_ms']
    assert bench.harness.reference_note(steady) is None


def test_a_worker_times_the_reference_before_and_after_its_iterations():
    bench = _load()
    events = []

    def reference():
        events.append('reference')
        return 0.0048 if events.count('reference') == 1 else 0.0089

    def build():
        events.append('build')
        return lambda: events.append('iteration')
    spec = {'batch': 2, 'warmup': 1, 'steps': 2, 'min_seconds': 0.0}
    answer = bench.harness.measure(spec, build, {}, reference)
    assert events == ['build', 'reference', 'iteration', 'iteration', 'iteration', 'reference']
    assert answer['reference_ms'] == [4.8, 8.9]
    assert 'reference_ms' not in bench.harness.measure(spec, build, {}, lambda: None)


@pytest.mark.parametrize('steps, min_seconds, timed', [
    (3, 0.0, 3),        # no minimum: the steps asked
    (3, 1.0, 4),        # short steps: on until the stretch lasts a second
    (6, 1.0, 6),        # long enough already
])
def test_a_worker_times_short_steps_until_the_stretch_lasts_its_minimum(
        monkeypatch, steps, min_seconds, timed):
    bench = _load()
    clock = [0.0]
    monkeypatch.setattr(bench.harness, 'time',
                        types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def run():          # a step of a quarter of a second on the fake clock
        clock[0] += 0.25
        return (0.2, 0.05)
    timing = bench.harness.time_iterations(run, 8, warmup=2, steps=steps,
                                           min_seconds=min_seconds)
    assert timing['iteration_ms'] == [250.0] * timed
    assert timing['img_per_s'] == pytest.approx(8 / 0.25)
    assert (timing['fwd_bwd_ms'], timing['update_ms']) == pytest.approx((200.0, 50.0))


def test_the_reference_workloads_time_what_they_say():
    bench = _load()
    assert 0 < bench.reference_seconds() < 10          # MXNet's operator chain, timed for real
    handoff = bench.harness.handoff_seconds
    own = os.sched_getaffinity(0)
    if len(own) > 1:
        assert 0 < handoff() < 10
        assert os.sched_getaffinity(0) == own           # the caller's CPUs given back
    answers = []

    def on_one_cpu():                                   # a thread with one CPU: nothing to time
        os.sched_setaffinity(0, {min(own)})
        answers.append(handoff())
    thread = threading.Thread(target=on_one_cpu)
    thread.start()
    thread.join()
    assert answers == [None]


def test_contrib_amp_is_skipped_with_its_reason_where_bfloat16_is_not_native(monkeypatch):
    bench = _load()
    for klass, native in (('amx', True), ('avx512_bf16', True), ('avx512', False)):
        monkeypatch.setattr(bench.hardware, 'cpu_class', lambda: klass)
        assert bench.skip_reason('contrib.amp') is None        # runs (emulated on avx512)
        assert bench.mxamp_compute() == ('native' if native else 'bfloat16 storage, FP32 compute')
    monkeypatch.setattr(bench.hardware, 'cpu_class', lambda: 'avx2')
    reason = bench.skip_reason('contrib.amp')
    assert 'oneDNN cannot do on this CPU' in reason and "'avx2'" in reason
    assert bench.skip_reason('mxamp') is None and bench.skip_reason('fp32') is None
    assert bench.mxamp_compute() == 'bfloat16 storage, FP32 compute'
    result = {'network': 'n', 'task': 'inference', 'batch': 4, 'threads': 1,
              'mxamp_compute': bench.mxamp_compute(), 'modes': {
                  'fp32': {'runs': [_answer(10.0)]}, 'mxamp': {'runs': [_answer(9.0)]},
                  'contrib.amp': {'skipped': reason}}}
    bench.derive(result)
    table = bench.format_table([result])
    row = [line for line in table.splitlines() if line.startswith('n ') and 'contrib.amp' in line]
    assert len(row) == 1 and 'skipped' in row[0]
    assert 'contrib.amp skipped: ' + reason in table.splitlines()
    assert 'mxamp modes: bfloat16 storage, FP32 compute' in table


def test_reported_figures_are_the_medians_of_single_mode_worker_processes(
        monkeypatch, tmp_path, capsys):
    bench = _load()
    canned = {'fp32': [10.0, 12.0, 11.0], 'mxamp': [30.0, 20.0, 25.0],
              'mxamp+scaling': [18.0, 21.0, 19.0]}
    workers, data = _run_main(
        bench, monkeypatch, tmp_path,
        ['--networks', 'tiny', '--tasks', 'training', '--modes', 'fp32,mxamp,mxamp+scaling',
         '--batch', '4', '--threads', '3', '--repeats', '3', '--steps', '5', '--warmup', '2'],
        lambda spec, call: canned[spec['mode']][call // 3])
    # Whole processes alternate, A B C A B C A B C, each one mode with its threads and batch.
    assert [spec['mode'] for spec, _ in workers.calls] == ['fp32', 'mxamp', 'mxamp+scaling'] * 3
    for spec, env in workers.calls:
        assert env['OMP_NUM_THREADS'] == '3'
        assert {k: spec[k] for k in ('network', 'task', 'batch', 'threads', 'warmup', 'steps',
                                     'min_seconds')} \
            == {'network': 'tiny', 'task': 'training', 'batch': 4, 'threads': 3, 'warmup': 2,
                'steps': 5, 'min_seconds': bench.harness.MIN_SECONDS}
    (result,) = data['results']
    modes = result['modes']
    assert list(modes) == ['fp32', 'mxamp', 'mxamp+scaling']
    for mode, values in canned.items():
        assert [run['img_per_s'] for run in modes[mode]['runs']] == values
        assert modes[mode]['median_img_per_s'] == statistics.median(values)
        assert modes[mode]['paired_ratio_vs_fp32'] == pytest.approx(
            statistics.median([a / b for a, b in zip(values, canned['fp32'])]))
    assert modes['mxamp']['ratio_vs_fp32'] == pytest.approx(25.0 / 11.0)
    table = capsys.readouterr().out
    assert data['table'] in table
    row = [line.split() for line in table.splitlines() if line.startswith('tiny ')]
    assert row[1][:8] == ['tiny', 'training', '4', '3', 'mxamp', '25.00', '2.27', '2.27']


def test_a_failed_worker_is_an_error_entry_that_the_table_explains(monkeypatch, tmp_path, capsys):
    bench = _load()
    workers, data = _run_main(
        bench, monkeypatch, tmp_path,
        ['--networks', 'tiny', '--tasks', 'inference', '--modes', 'fp32,mxamp,mxamp+fusion',
         '--batch', '2', '--threads', '1', '--repeats', '3'],
        lambda spec, call: 10.0 + call, crash={'mxamp'})
    # Not started again after it failed; the other modes keep alternating.
    assert [spec['mode'] for spec, _ in workers.calls] == [
        'fp32', 'mxamp', 'mxamp+fusion', 'fp32', 'mxamp+fusion', 'fp32', 'mxamp+fusion']
    modes = data['results'][0]['modes']
    error = 'round 1 of 3: killed by SIGSEGV: Fatal Python error: Segmentation fault'
    assert modes['mxamp']['error'] == error and 'median_img_per_s' not in modes['mxamp']
    assert modes['mxamp+fusion']['median_img_per_s'] == 14.0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith('tiny ')]
    assert [row[5] for row in rows if row[4] == 'mxamp'] == ['error']
    assert 'tiny inference, batch 2, threads 1: mxamp failed, ' + error in out.splitlines()


def test_a_worker_reports_the_error_it_met_on_its_result_line(capsys):
    bench = _load()
    spec = {'network': 'tiny', 'task': 'training', 'mode': 'bogus', 'batch': 2,
            'image_size': 8, 'warmup': 0, 'steps': 1, 'threads': 1}
    assert bench._worker_entry(spec) == 1
    line = capsys.readouterr().out.splitlines()[-1]
    assert json.loads(line[len(bench.RESULT_PREFIX):]) == {
        'error': "ValueError: unknown training mode 'bogus'"}
    mxnet_error = bench.mx.base.MXNetError(
        'Traceback (most recent call last):\n  File "src/op.h", line 67\n'
        'MXNetError: Check failed: l == 1 || r == 1: operands could not be broadcast')
    assert bench._error_line(mxnet_error) == ('MXNetError: Check failed: l == 1 || r == 1: '
                                              'operands could not be broadcast')


def test_batch_and_threads_lists_sweep_every_combination(monkeypatch, tmp_path, capsys):
    bench = _load()
    args = bench.parse_args(['--networks', 'tiny', '--tasks', 'inference',
                             '--batch', '2,4', '--threads', '1,2'])
    assert bench.configurations(args) == [
        bench.harness.Config('tiny', 'inference', batch, threads)
        for batch, threads in ((2, 1), (2, 2), (4, 1), (4, 2))]
    assert bench.parse_args([]).threads == [len(os.sched_getaffinity(0))]
    # Without --batch each network runs at its own default: 16 for the image classifiers.
    assert {c.batch for c in bench.configurations(bench.parse_args([]))} == {16}
    workers, data = _run_main(
        bench, monkeypatch, tmp_path,
        ['--networks', 'tiny', '--tasks', 'inference', '--modes', 'fp32,mxamp',
         '--batch', '2,4', '--threads', '1,2', '--repeats', '1'],
        lambda spec, call: spec['batch'] * spec['threads'] * (20.0 if spec['mode'] == 'mxamp'
                                                             else 10.0))
    assert [(s['batch'], s['threads'], env['OMP_NUM_THREADS']) for s, env in workers.calls] == [
        (2, 1, '1'), (2, 1, '1'), (2, 2, '2'), (2, 2, '2'),
        (4, 1, '1'), (4, 1, '1'), (4, 2, '2'), (4, 2, '2')]
    assert [(r['batch'], r['threads']) for r in data['results']] == [(2, 1), (2, 2), (4, 1),
                                                                      (4, 2)]
    lines = capsys.readouterr().out.splitlines()
    view = lines.index('tiny inference, threads 2: by batch')
    assert [line.split() for line in lines[view + 1:view + 5]] == [
        ['batch', 'fp32', 'img/s', 'mxamp', 'img/s', 'x', 'FP32'], ['-----'] + ['-' * 10,
                                                                               '-' * 11, '-' * 6],
        ['2', '40.00', '80.00', '2.00'], ['4', '80.00', '160.00', '2.00']]
    for title in ('tiny inference, threads 1: by batch', 'tiny inference, batch 2: by threads',
                  'tiny inference, batch 4: by threads'):
        assert title in lines


@pytest.mark.parametrize('argv, complaint', [
    (['--threads', '0'], "argument --threads: expected positive integers separated by commas, "
                         "got '0'"),
    (['--threads', '1,0'], "argument --threads: expected positive integers"),
    (['--batch', 'x'], "argument --batch: expected positive integers separated by commas, "
                       "got 'x'"),
    (['--batch', '2,,4'], "argument --batch: expected positive integers"),
    (['--steps', '0'], "argument --steps: expected an integer >= 1, got '0'"),
    (['--min-seconds', '-1'], "argument --min-seconds: expected seconds >= 0, got '-1'"),
    (['--min-seconds', 'nan'], "argument --min-seconds: expected seconds >= 0, got 'nan'"),
    (['--min-seconds', 'inf'], "argument --min-seconds: expected seconds >= 0, got 'inf'"),
])
def test_bad_sweep_values_are_refused_with_one_line(argv, complaint, capsys):
    bench = _load()
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(argv)
    assert exit_.value.code == 2
    error = [line for line in capsys.readouterr().err.splitlines() if 'error:' in line]
    assert len(error) == 1 and complaint in error[0]


def test_json_records_the_run_and_how_to_reproduce_each_mode(monkeypatch, tmp_path):
    bench = _load()
    # The environment the script was started with: the user's OMP_NUM_THREADS gives way to
    # --threads, the rest reaches the workers and the reproduce commands.
    monkeypatch.setattr(bench, 'LAUNCH_ENV', {'PATH': '/usr/bin', 'OMP_NUM_THREADS': '7',
                                              'DNNL_MAX_CPU_ISA': 'AVX512_CORE'})
    argv = ['--networks', 'tiny', '--tasks', 'training', '--modes', 'fp32,mxamp+scaling',
            '--batch', '4', '--threads', '3', '--image-size', '32', '--repeats', '2',
            '--min-seconds', '0.5']
    workers, data = _run_main(bench, monkeypatch, tmp_path, argv, lambda spec, call: 10.0)
    assert {env['OMP_NUM_THREADS'] for _, env in workers.calls} == {'3'}
    assert {env['DNNL_MAX_CPU_ISA'] for _, env in workers.calls} == {'AVX512_CORE'}
    meta = data['meta']
    assert meta['schema_version'] == 3
    assert meta['command'] == shlex.join(['scripts/benchmark.py'] + argv + [
        '--output', str(tmp_path / 'bench.json')])
    assert meta['args']['batch'] == [4] and meta['args']['threads'] == [3]
    assert set(meta['versions']) == {'mxnet', 'mxamp', 'numpy', 'python', 'gluoncv'}
    assert meta['versions']['mxnet'] == bench.mx.__version__
    assert meta['cpu_count'] == os.cpu_count()
    assert meta['usable_cpus'] == len(os.sched_getaffinity(0))
    assert meta['hardware'] == bench.hardware.describe()
    assert meta['cpu_class'] == bench.hardware.describe_cpu_class()
    assert meta['DNNL_MAX_CPU_ISA'] == 'AVX512_CORE'
    assert meta['environment'] == {'DNNL_MAX_CPU_ISA': 'AVX512_CORE', 'OMP_NUM_THREADS': '7'}
    assert len(meta['load_average_start']) == len(meta['load_average_end']) == 3
    (result,) = data['results']
    assert {k: result[k] for k in ('network', 'task', 'batch', 'image_size', 'threads', 'warmup',
                                   'steps', 'min_seconds', 'repeats')} == {
        'network': 'tiny', 'task': 'training', 'batch': 4, 'image_size': 32, 'threads': 3,
        'warmup': 2, 'steps': 5, 'min_seconds': 0.5, 'repeats': 2}
    assert {spec['min_seconds'] for spec, _ in workers.calls} == {0.5}
    scaling = result['modes']['mxamp+scaling']
    assert scaling['settings'] == {
        'dtype': 'bfloat16', 'conversion': "mxamp.convert(net, 'bfloat16')",
        'hybridize': {'static_alloc': True, 'static_shape': True}, 'fusion': None,
        'loss': 'SoftmaxCrossEntropyLoss', 'trainer': 'mxamp.Trainer',
        'optimizer': {'name': 'sgd', 'learning_rate': 1e-4, 'momentum': 0.9, 'wd': 1e-5},
        'loss_scale': 'dynamic'}
    assert result['modes']['fp32']['settings']['dtype'] == 'float32'
    assert [run['environment']['openmp_threads'] for run in scaling['runs']] == [3, 3]
    assert scaling['reproduce'] == (
        'DNNL_MAX_CPU_ISA=AVX512_CORE python scripts/benchmark.py --networks tiny '
        '--tasks training --modes fp32,mxamp+scaling --batch 4 --threads 3 '
        '--image-size 32 --warmup 2 --steps 5 --min-seconds 0.5 --repeats 2')
    words = shlex.split(scaling['reproduce'])
    reproduced = bench.parse_args(words[words.index('scripts/benchmark.py') + 1:])
    assert bench.configurations(reproduced) == [bench.harness.Config('tiny', 'training', 4, 3)]
    assert reproduced.modes == ['fp32', 'mxamp+scaling']
    assert result['modes']['fp32']['reproduce'].endswith(
        '--modes fp32 --batch 4 --threads 3 --image-size 32 --warmup 2 --steps 5 '
        '--min-seconds 0.5 --repeats 2')
    assert bench.mode_settings('inference', 'mxamp+fusion')['fusion'] == 'MKLDNN'
    auto = bench.mode_settings('inference', 'mxamp:auto+fusion')
    assert (auto['dtype'], auto['conversion'], auto['fusion']) == (
        'auto', "mxamp.for_inference(net, x, dtype='auto')", 'MKLDNN')


def test_output_is_written_whole_or_not_at_all(tmp_path):
    bench = _load()
    out = tmp_path / 'bench.json'
    bench.harness.write_json(str(out), {'results': [1]})
    with pytest.raises(TypeError):
        bench.harness.write_json(str(out), {'results': [object()]})    # fails halfway through
    assert json.loads(out.read_text()) == {'results': [1]}
    assert os.listdir(str(tmp_path)) == ['bench.json']


def test_output_keeps_a_list_of_numbers_on_one_line(tmp_path):
    bench = _load()
    out = tmp_path / 'bench.json'
    data = {'meta': {'date': 'd', 'args': {}, 'threads': [2], 'hardware': {'amx_bf16': False}},
            'results': [{'runs': [{'iteration_ms': [1.5, 2, 0.25e-3], 'peak_rss_mb': None}]},
                        {'runs': []}],
            'table': 'a\nb'}
    bench.harness.write_json(str(out), data)
    text = out.read_text()
    assert json.loads(text) == data
    assert '"iteration_ms": [1.5, 2, 0.00025]' in text
    # Everything else one item a line, indented one space a level, as json.dump(indent=1) does.
    assert '   "runs": [\n    {\n     "iteration_ms"' in text and text.count('\n') == 23


def _explanation(verdicts):
    """An ``--explain`` worker's answer, as `explain_main` gives it."""
    return {'verdicts': verdicts, 'step_ms': {'bfloat16': 80.0, 'float32': 160.0},
            'speedup': 2.0, 'attributed': 0.97, 'report_s': 3.0, 'profiled': None,
            'openmp_threads': 2}


def _verdict(message, share):
    return {'kind': 'casts', 'message': message, 'share': share, 'layer': None,
            'measured': True}


def test_explain_prints_the_top_verdicts_under_each_mixed_precision_row(
        monkeypatch, tmp_path, capsys):
    bench = _load()
    monkeypatch.setattr(bench.hardware, 'cpu_class', lambda: 'amx')
    verdicts = [_verdict('verdict %d: %d%% of the step' % (n, 50 - n), (50 - n) / 100.0)
                for n in range(1, 5)]

    def explain(spec):
        return _explanation(verdicts if spec['mode'] == 'mxamp' else [])
    argv = ['--networks', 'tiny', '--tasks', 'inference', '--batch', '4', '--threads', '2',
            '--image-size', '32', '--repeats', '2',
            '--modes', 'fp32,mxamp,mxamp+fusion,contrib.amp', '--explain']
    workers, data = _run_main(bench, monkeypatch, tmp_path, argv,
                              lambda spec, call: 50.0 if spec['mode'] == 'mxamp' else 25.0,
                              explain=explain)
    # The profiling workers come after every timed one, with the configuration's threads.
    assert [(spec['mode'], bool(spec.get('explain'))) for spec, _ in workers.calls] == [
        ('fp32', False), ('mxamp', False), ('mxamp+fusion', False), ('contrib.amp', False)] * 2 + [
        ('mxamp', True), ('mxamp+fusion', True)]
    assert {env['OMP_NUM_THREADS'] for _, env in workers.calls} == {'2'}
    lines = capsys.readouterr().out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.split()[4:5] == ['mxamp'])
    assert lines[row + 1].split() == ['mxamp.profile:', 'step', 'bfloat16', '80.0', 'ms,',
                                      'float32', '160.0', 'ms;', 'this', 'row', '80.0', 'ms',
                                      'per', 'batch']
    assert [line.strip() for line in lines[row + 2:row + 5]] == [
        '49%  verdict 1: 49% of the step', '48%  verdict 2: 48% of the step',
        '47%  verdict 3: 47% of the step']
    assert lines[row + 5].split()[4] == 'mxamp+fusion'
    assert lines[row + 6].strip().startswith('mxamp.profile: step bfloat16 80.0 ms')
    assert lines[row + 7].strip() == 'no verdict'
    assert lines[row + 8].split()[4] == 'contrib.amp'
    assert lines[row + 9].strip() == 'explain: ' + bench.NOT_EXPLAINED['contrib.amp']
    assert not lines[row - 1].startswith('    ')         # nothing under the fp32 row
    modes = data['results'][0]['modes']
    assert modes['mxamp']['explain']['verdicts'] == verdicts
    assert modes['mxamp']['explain']['row_batch_ms'] == pytest.approx(1e3 * 4 / 50.0)
    assert modes['mxamp']['explain']['row_vs_report'] == pytest.approx(1.0)
    assert modes['mxamp+fusion']['explain']['verdicts'] == []
    assert modes['contrib.amp']['explain'] == {'skipped': bench.NOT_EXPLAINED['contrib.amp']}
    assert 'explain' not in modes['fp32']
    assert data['meta']['args']['explain'] is True


def test_explain_needs_an_mxamp_mode(capsys):
    bench = _load()
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(['--modes', 'fp32,contrib.amp', '--explain'])
    assert exit_.value.code == 2
    assert ('--explain profiles the mxamp modes (mxamp:auto, mxamp:auto+fusion, mxamp, '
            'mxamp+fusion, mxamp+scaling); '
            '--modes fp32,contrib.amp has none of them') in capsys.readouterr().err
    assert not bench.parse_args([]).explain


def test_each_family_runs_at_its_own_defaults_and_counts_its_own_samples(
        monkeypatch, tmp_path, capsys):
    bench = _load()
    workers, data = _run_main(
        bench, monkeypatch, tmp_path,
        ['--networks', 'mlp,deepar', '--modes', 'fp32,mxamp:auto,mxamp', '--threads', '1',
         '--repeats', '1'],
        lambda spec, call: 100.0 if spec['mode'] == 'fp32' else 50.0)
    # Each network at its own batch; no image size; DeepAR's inference starts no worker.
    assert [(s['network'], s['task'], s['mode'], s['batch'], s['image_size'])
            for s, _ in workers.calls] == [
        (network, task, mode, batch, None)
        for network, task, batch in (('mlp', 'inference', 256), ('mlp', 'training', 256),
                                     ('deepar', 'training', 32))
        for mode in ('fp32', 'mxamp:auto', 'mxamp')]
    results = {(r['network'], r['task']): r for r in data['results']}
    reason = bench.families.family_of('deepar').no_inference
    assert results[('deepar', 'inference')]['skipped'] == reason
    assert results[('deepar', 'inference')]['modes'] == {}
    deepar = results[('deepar', 'training')]
    assert {k: deepar[k] for k in ('family', 'throughput_unit', 'sample', 'batch',
                                   'image_size')} == {
        'family': 'forecaster', 'throughput_unit': 'series/s',
        'sample': 'series windows (48 hours of context, 24 predicted)', 'batch': 32,
        'image_size': None}
    assert results[('mlp', 'training')]['throughput_unit'] == 'rows/s'
    assert deepar['modes']['mxamp:auto']['settings'] == {
        'dtype': 'auto', 'conversion': "mxamp.convert(net, 'auto')",
        'hybridize': {'static_alloc': True, 'static_shape': True}, 'fusion': None,
        'loss': "the network's output (its first)", 'trainer': 'mxamp.Trainer',
        'optimizer': {'name': 'adam', 'learning_rate': 1e-3, 'wd': 1e-8, 'clip_gradient': 10.0},
        'loss_scale': 'auto'}
    assert deepar['modes']['mxamp']['ratio_vs_fp32'] == pytest.approx(0.5)
    reproduce = deepar['modes']['mxamp']['reproduce']
    assert '--batch 32 ' in reproduce and '--image-size' not in reproduce
    assert 'gluonts' in data['meta']['versions'] and 'gluonnlp' not in data['meta']['versions']
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[5] == 'samples/s'
    assert ('samples counted: mlp: rows of 64 features; deepar: series windows (48 hours of '
            'context, 24 predicted)') in lines
    rows = [line.split() for line in lines if line.startswith('deepar ')]
    assert rows[0] == ['deepar', 'inference', '32', '1', '-', 'skipped'] + ['-'] * 5
    assert rows[2][4:6] == ['mxamp:auto', '50.00']
    assert 'deepar inference, batch 32, threads 1: not measured, ' + reason in lines
    # One kind of sample: the column says which.
    table = bench.format_table([deepar])
    assert table.splitlines()[0].split()[5] == 'series/s'
    assert 'samples counted: deepar: series windows' in table


def test_lstm_lm_skips_the_modes_that_need_one_graph(monkeypatch, tmp_path):
    bench = _load()
    monkeypatch.setattr(bench.hardware, 'cpu_class', lambda: 'amx')
    workers, data = _run_main(bench, monkeypatch, tmp_path,
                              ['--networks', 'lstm_lm', '--threads', '1', '--repeats', '1'],
                              lambda spec, call: 10.0)
    assert [(s['task'], s['mode']) for s, _ in workers.calls] == [
        ('inference', 'fp32'), ('inference', 'mxamp:auto'), ('inference', 'mxamp'),
        ('training', 'fp32'), ('training', 'mxamp:auto'), ('training', 'mxamp'),
        ('training', 'mxamp+scaling'), ('training', 'contrib.amp')]
    assert {s['batch'] for s, _ in workers.calls} == {20}
    inference, training = data['results']
    reason = 'needs one graph, and lstm_lm cannot become one: its hybrid_forward calls nd.Dropout'
    for mode in ('fp32+fusion', 'mxamp:auto+fusion', 'mxamp+fusion', 'contrib.amp'):
        assert inference['modes'][mode] == {'skipped': reason}
    assert inference['throughput_unit'] == 'seq/s'
    # Never hybridized, in any mode.
    assert {entry['settings']['hybridize'] for entry in training['modes'].values()} == {None}
    assert 'contrib.amp skipped: ' + reason in data['table'].splitlines()


def test_bert_skips_contrib_amp_and_the_transformer_runs_every_mode(monkeypatch, tmp_path):
    bench = _load()
    monkeypatch.setattr(bench.hardware, 'cpu_class', lambda: 'amx')
    workers, data = _run_main(bench, monkeypatch, tmp_path,
                              ['--networks', 'bert,transformer', '--threads', '1',
                               '--repeats', '1'],
                              lambda spec, call: 10.0)
    started = [(s['network'], s['task'], s['mode'], s['batch']) for s, _ in workers.calls]
    assert started == (
        [('bert', 'inference', mode, 8) for mode in bench.INFERENCE_MODES[:-1]]
        + [('bert', 'training', mode, 8) for mode in bench.TRAINING_MODES[:-1]]
        + [('transformer', 'inference', mode, 16) for mode in bench.INFERENCE_MODES]
        + [('transformer', 'training', mode, 16) for mode in bench.TRAINING_MODES])
    results = {(r['network'], r['task']): r for r in data['results']}
    reason = bench.families.BERT_CONTRIB_AMP
    for task in ('inference', 'training'):
        assert results[('bert', task)]['modes']['contrib.amp'] == {'skipped': reason}
        assert results[('bert', task)]['throughput_unit'] == 'seq/s'
        assert results[('transformer', task)]['throughput_unit'] == 'pair/s'
        # One graph each: hybridized in every mode.
        for network in ('bert', 'transformer'):
            assert {str(entry['settings']['hybridize'])
                    for entry in results[(network, task)]['modes'].values()
                    if 'settings' in entry} == {str(bench.HYBRIDIZE)}
    assert 'contrib.amp skipped: ' + reason in data['table'].splitlines()
    training = results[('bert', 'training')]['modes']['mxamp']['settings']
    assert (training['loss'], training['optimizer']) == (
        'SoftmaxCrossEntropyLoss', {'name': 'adam', 'learning_rate': 1e-5})
    assert results[('transformer', 'training')]['modes']['fp32']['settings']['loss'] == \
        'gluonnlp.loss.MaskedSoftmaxCELoss'
    assert 'gluonnlp' in data['meta']['versions']


def test_teacher_forced_translation_computes_what_nmt_model_does():
    """The benchmark's Transformer is one graph; its outputs are gluonnlp's NMTModel's."""
    pytest.importorskip('gluonnlp', reason='the Transformer is built with gluonnlp')
    families = _load().families
    mx = families.mx
    vocab = families._vocab(50)
    # transformer_en_de_512's construction, small: 2 + 2 layers of 16, 2 heads.
    nmt = families.nmt_model(vocab, num_units=16, embed_size=16, hidden_size=32, num_layers=2,
                             num_heads=2)
    graph = families.TeacherForcedTranslation(nmt)
    graph.initialize(mx.init.Xavier(magnitude=3))
    rng = families.np.random.RandomState(1)
    source, target = (mx.nd.array(rng.randint(0, 50, (3, length))) for length in (7, 5))
    # Padded batches too: the memory mask the graph builds is init_state_from_encoder's.
    source_length, target_length = mx.nd.array([7, 4, 2]), mx.nd.array([5, 5, 3])
    expected, _ = nmt(source, target, source_length, target_length)
    assert sorted(graph.collect_params().keys()) == sorted(nmt.collect_params().keys())
    for hybridized in (False, True):
        if hybridized:
            graph.hybridize(**families.HYBRIDIZE)
        scores = graph(source, target, source_length, target_length)
        assert scores.shape == (3, 5, 50)
        families.np.testing.assert_allclose(scores.asnumpy(), expected.asnumpy(), rtol=1e-5,
                                            atol=1e-6)


def test_networks_name_their_family_and_defaults():
    bench = _load()
    families = bench.families
    for network, family, batch, size in (
            ('resnet50_v1', 'classifier', 16, 224), ('tiny', 'classifier', 16, 224),
            ('ssd_512_resnet50_v1_voc', 'detector', 8, 512),
            ('ssd_300_vgg16_atrous_voc', 'detector', 8, 300),
            ('fcn_resnet50_voc', 'segmentation', 4, 480), ('deepar', 'forecaster', 32, None),
            ('nbeats', 'forecaster', 32, None), ('ts_transformer', 'forecaster', 32, None),
            ('lstm_lm', 'lstm_lm', 20, None), ('mlp', 'mlp', 256, None),
            ('bert', 'bert', 8, None), ('transformer', 'transformer', 16, None)):
        args = bench.parse_args(['--networks', network, '--tasks', 'training'])
        assert families.family_of(network).name == family
        assert bench.configurations(args) == [bench.harness.Config(network, 'training', batch,
                                                                   args.threads[0])]
        assert bench.image_size(network, args) == size
    args = bench.parse_args(['--networks', 'fcn_resnet50_voc,mlp', '--batch', '2',
                             '--image-size', '64'])
    assert {c.batch for c in bench.configurations(args)} == {2}
    assert (bench.image_size('fcn_resnet50_voc', args), bench.image_size('mlp', args)) == \
        (64, None)


# What each family needs to run at a tiny size, and the package that provides it.
FAMILY_SMOKE = [
    pytest.param('mlp', 4, None, None, id='mlp'),
    pytest.param('deepar', 4, None, 'gluonts', id='deepar'),
    *(pytest.param(model, 4, None, 'gluonts', id=model, marks=pytest.mark.slow)
      for model in _script('gluonts_estimators').MODELS if model != 'deepar'),
    pytest.param('lstm_lm', 2, None, 'gluonnlp', id='lstm_lm'),
    pytest.param('ssd_512_resnet50_v1_voc', 1, 128, 'gluoncv', id='ssd', marks=pytest.mark.slow),
    pytest.param('fcn_resnet50_voc', 1, 64, 'gluoncv', id='fcn', marks=pytest.mark.slow),
    # Full size (BERT-base, the 6 + 6-layer Transformer), a small batch.
    pytest.param('bert', 1, None, 'gluonnlp', id='bert', marks=pytest.mark.slow),
    pytest.param('transformer', 2, None, 'gluonnlp', id='transformer', marks=pytest.mark.slow),
]


# gluoncv's, GluonTS's and mxamp's notes (layers too small for bfloat16) are not checked here.
@pytest.mark.filterwarnings('ignore')
@pytest.mark.parametrize('network, batch, size, package', FAMILY_SMOKE)
def test_each_family_builds_its_training_step_and_inference(network, batch, size, package):
    if package:
        pytest.importorskip(package, reason='%s is built with %s, not installed' % (network,
                                                                                   package))
    bench = _load()
    family = bench.families.family_of(network)
    setup = family.setup(network, batch, size, True)
    with bench.autograd.record():
        loss = setup.loss(setup.net(*setup.inputs))
    # One loss a sample (what the throughput counts), or the batch's mean where a GluonTS
    # forecaster gives that.
    forecaster = family is bench.families.FORECASTER
    assert loss.shape in (((batch,), (1,)) if forecaster else ((batch,),))
    assert bench.np.isfinite(loss.asnumpy()).all()
    # Every GluonTS estimator batches as asked (CanonicalRNN's takes no batch size).
    assert not forecaster or all(x.shape[0] == batch for x in setup.inputs)
    tasks = ['training'] + ([] if family.no_inference else ['inference'])
    for task in tasks:
        for mode in ('fp32', 'mxamp:auto', 'mxamp'):
            run = bench.build(task, mode, network, batch, size)
            timing = bench.harness.time_iterations(run, batch, warmup=0, steps=1)
            assert timing['img_per_s'] > 0, (task, mode)
            assert (timing.get('update_ms', 0) > 0) == (task == 'training'), (task, mode)


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['mxamp', 'mxamp:auto'])
@pytest.mark.parametrize('task', ['inference', 'training'])
def test_explain_worker_profiles_the_rows_network(task, mode):
    bench = _load()
    answer = bench.explain_main({'network': 'tiny', 'task': task, 'mode': mode, 'batch': 2,
                                 'threads': 1, 'image_size': 32, 'warmup': 1, 'steps': 2,
                                 'explain': True})
    assert set(answer['step_ms']) == {'bfloat16', 'float32'}
    assert all(ms > 0 for ms in answer['step_ms'].values())
    assert answer['profiled'] is None and 0 < answer['attributed'] <= 1.5
    for verdict in answer['verdicts']:
        assert set(verdict) == {'kind', 'message', 'share', 'layer', 'measured'}
    json.dumps(answer)          # it travels as the worker's result line
    lines = bench._explanation({'explain': answer})
    assert lines[0].startswith('    mxamp.profile: step bfloat16 ')
    assert lines[1:] == (['    no verdict'] if not answer['verdicts'] else lines[1:4])


@pytest.mark.slow
def test_tiny_run_writes_a_complete_json(tmp_path):
    out = tmp_path / 'bench.json'
    proc = subprocess.run(
        [sys.executable, SCRIPT, '--networks', 'tiny', '--batch', '2', '--image-size', '32',
         '--repeats', '1', '--steps', '2', '--warmup', '1', '--min-seconds', '0.05',
         '--threads', '1', '--output', str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    meta = data['meta']
    assert meta['schema_version'] == 3
    assert {'versions', 'hardware', 'cpu_count', 'usable_cpus', 'args', 'command',
            'load_average_start', 'load_average_end'} <= set(meta)
    assert data['table'] in proc.stdout
    results = {(r['network'], r['task']): r for r in data['results']}
    assert set(results) == {('tiny', 'inference'), ('tiny', 'training')}
    inference, training = results[('tiny', 'inference')], results[('tiny', 'training')]
    # The CPU as the run saw it (a simulated class in this process would not reach it).
    cpu_class = meta['hardware']['cpu_class']
    native = cpu_class in ('avx512_bf16', 'amx')
    assert list(inference['modes']) == ['fp32', 'fp32+fusion', 'mxamp:auto',
                                        'mxamp:auto+fusion', 'mxamp', 'mxamp+fusion',
                                        'contrib.amp']
    assert list(training['modes']) == ['fp32', 'mxamp:auto', 'mxamp', 'mxamp+scaling',
                                       'contrib.amp']
    for result in (inference, training):
        assert (result['batch'], result['threads'], result['steps'],
                result['min_seconds']) == (2, 1, 2, 0.05)
        assert result['mxamp_compute'] == ('native' if native else
                                           'bfloat16 storage, FP32 compute')
        modes = result['modes']
        for name, entry in modes.items():
            if cpu_class == 'avx2' and name == 'contrib.amp':
                # MXNet's AMP would fail (no bfloat16 in oneDNN without AVX-512): not measured.
                assert entry == {'skipped': entry['skipped']}, entry
                assert 'contrib.amp skipped: ' + entry['skipped'] in proc.stdout
                continue
            assert 'error' not in entry, (name, entry)
            (run,) = entry['runs']
            # MXNet in the worker computed on the one OpenMP thread asked for.
            assert run['environment']['openmp_threads'] == 1, run['environment']
            assert run['environment']['variables']['OMP_NUM_THREADS'] == '1'
            # At least the steps asked, and no more than the 50 ms minimum needed.
            timed = run['iteration_ms']
            assert len(timed) >= 2 and (len(timed) == 2 or sum(timed[:-1]) < 50), timed
            assert run['peak_rss_mb'] >= run['base_rss_mb'] > 0
            assert entry['median_img_per_s'] == run['img_per_s']
            assert entry['ratio_vs_fp32'] == pytest.approx(
                entry['median_img_per_s'] / modes['fp32']['median_img_per_s'])
            assert entry['paired_ratio_vs_fp32'] == pytest.approx(entry['ratio_vs_fp32'])
            assert entry['rss_ratio_vs_fp32'] == pytest.approx(
                entry['median_peak_rss_mb'] / modes['fp32']['median_peak_rss_mb'])
            assert '--threads 1 ' in entry['reproduce'] and entry['settings']['dtype']
    assert set(training['mxamp_overhead']) == {'mxamp:auto', 'mxamp', 'mxamp+scaling'}
    for entry in training['modes'].values():
        if 'skipped' not in entry:
            assert entry['median_update_ms'] > 0 and entry['median_step_ms'] > 0
