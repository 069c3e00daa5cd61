"""What the training tools print and draw: mxamp's lines without MXNet's, the
decoding threads that really run, plots whose labels and figures say what ran,
docstring examples that finish."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, 'scripts')
sys.path.insert(0, SCRIPTS)

import demo  # noqa: E402
import launch_local  # noqa: E402
import train_imagenet  # noqa: E402
from imagenet import checkpoints, data, fit, options, report, resume  # noqa: E402

# A line of MXNet's C++ logger: '[09:12:34] ../src/io/iter_image_recordio_2.cc:177: ...'.
MXNET_LOG_LINE = re.compile(r'^\[\d\d:\d\d:\d\d\] \S+\.(cc|h):\d+: ', re.M)


def _train(digits_dir, save_dir, *extra, **kwargs):
    command = [sys.executable, os.path.join(SCRIPTS, 'train_imagenet.py'), '--dataset', 'digits',
               '--data-dir', digits_dir, '--save-dir', str(save_dir), '--batch-size', '32',
               '--num-epochs', '1', '--max-batches', '2', '--no-progress', '--save-prefix', 'm']
    return subprocess.run(command + list(extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=300, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize('network', [['--model', 'cifar_resnet20_v1'],
                                     ['--symbol', 'resnet', '--num-layers', '18']],
                         ids=['gluon', 'symbol'])
def test_mxnet_log_lines_only_with_verbose(digits_dir, tmp_path, network):
    """The data iterators' set-up lines and a bound Module's subgraph notice are MXNet's,
    not the run's: hidden unless --verbose asks for them."""
    env = {k: v for k, v in os.environ.items() if k != 'MXNET_SUBGRAPH_VERBOSE'}
    quiet = _train(digits_dir, tmp_path / 'quiet', '--data-nthreads', '4', *network, env=env)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert not MXNET_LOG_LINE.search(quiet.stdout + quiet.stderr), quiet.stderr
    assert 'epoch 1/1: loss' in quiet.stderr
    loud = _train(digits_dir, tmp_path / 'loud', *network + ['--verbose'], env=env)
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert 'ImageRecordIOParser2' in loud.stderr
    if network[0] == '--symbol':
        assert 'Subgraph backend MKLDNN is activated' in loud.stderr


def test_decoding_threads_are_those_mxnet_runs(digits_dir):
    """`decoding_threads` predicts the count MXNet's own parser reports."""
    script = ('import sys, mxnet as mx\n'
              'for n in (1, 2, 4, 64):\n'
              '    mx.io.ImageRecordIter(path_imgrec=sys.argv[1], data_shape=(1, 8, 8),\n'
              '                          batch_size=4, preprocess_threads=n, verbose=True)\n')
    proc = subprocess.run([sys.executable, '-c', script, os.path.join(digits_dir, 'train.rec')],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    used = [int(n) for n in re.findall(r'use (\d+) threads for decoding', proc.stderr)]
    assert used == [data.decoding_threads(n) for n in (1, 2, 4, 64)], proc.stderr
    cpus = data.usable_cpus()
    assert data.decoding_threads(64) == max(1, cpus // 2 - 1)


def test_the_log_says_how_many_threads_decode(digits_dir, tmp_path, capsys):
    argv = ['--dataset', 'digits', '--data-dir', digits_dir, '--save-dir', str(tmp_path),
            '--batch-size', '32', '--num-epochs', '1', '--max-batches', '1', '--no-progress',
            '--model', 'cifar_resnet20_v1', '--data-nthreads', '64']
    assert train_imagenet.main(argv) == 0
    err = capsys.readouterr().err
    threads = data.decoding_threads(64)
    assert 'data: decoding on %d thread(s) per iterator' % threads in err
    if threads < 64:
        assert '--data-nthreads 64: ' in err and '%d CPUs' % data.usable_cpus() in err
    with open(os.path.join(str(tmp_path), 'cifar_resnet20_v1-0001.json')) as handle:
        assert json.load(handle)['decoding_threads'] == threads


@pytest.mark.parametrize('cpus, was, now, note', [
    (2, 1, 4, False),     # both decode on one thread: the same augmentations
    (16, 2, 4, True),
    (16, 4, 4, False)])
def test_resume_notes_a_change_of_the_threads_that_decode(monkeypatch, caplog, cpus, was, now,
                                                          note):
    monkeypatch.setattr(data, 'usable_cpus', lambda: cpus)
    args = options.build_parser().parse_args(['--data-nthreads', str(now)])
    settings = {'--lr-mode': 'cosine'}
    meta = {'epoch': 1, 'decoding_threads': data.decoding_threads(was), 'settings': settings}
    with caplog.at_level('INFO', logger='train_imagenet'):
        resume.check_resume_settings(meta, 'm-0001.json', settings, args, None)
    notes = [r.getMessage() for r in caplog.records if 'decoded on' in r.getMessage()]
    assert notes == (["--data-nthreads: the checkpoint's run decoded on %d thread(s), this one "
                      "on %d: free to change, but the augmentation now differs from an "
                      "uninterrupted run's" % (min(was, 7), min(now, 7))] if note else [])


def _rows(speeds):
    return [{'epoch': e + 1, 'train_loss': 1.0 / (e + 1), 'val_top1': 0.1 * e,
             'img_per_sec': s, 'skipped_in_epoch': 0, 'skipped_total': 0}
            for e, s in enumerate(speeds)]


def _write_run(directory, prefix, dtype=None, compute=None, checkpoint=False):
    os.makedirs(directory, exist_ok=True)
    report.write_metrics(os.path.join(directory, '%s-metrics.csv' % prefix),
                                 _rows([50.0, 60.0]))
    if compute is not None:
        with open(os.path.join(directory, '%s-summary.json' % prefix), 'w') as handle:
            json.dump({'dtype': dtype, 'compute': compute}, handle)
    if checkpoint:
        for path in checkpoints.paths(directory, prefix, 2)[:2]:
            open(path, 'w').close()
        params, states, meta = checkpoints.paths(directory, prefix, 2)
        with open(meta, 'w') as handle:
            json.dump({'dtype': dtype, 'epoch': 2, 'params': os.path.basename(params),
                       'states': os.path.basename(states)}, handle)
    return os.path.join(directory, '%s-metrics.csv' % prefix)


def test_compared_runs_are_labelled_with_their_precision(tmp_path):
    finished = _write_run(str(tmp_path / 'a'), 'r50', 'bfloat16',
                          'bfloat16 storage, FP32 compute')
    native = _write_run(str(tmp_path / 'b'), 'r50', 'bfloat16', 'native')
    fp32 = _write_run(str(tmp_path / 'c'), 'r50', 'float32', 'FP32')
    running = _write_run(str(tmp_path / 'd'), 'r18', 'float16', checkpoint=True)
    bare = _write_run(str(tmp_path / 'e'), 'r18')
    labels = [report.compared_run(path)[0]
              for path in (finished, native, fp32, running, bare)]
    assert labels == ['r50: bfloat16 storage, FP32 compute', 'r50: bfloat16 (native)',
                      'r50: FP32', 'r18: float16', 'r18: precision not recorded']


def test_a_plot_with_compare_names_every_curve(digits_dir, tmp_path):
    other = tmp_path / 'other'
    common = ['--dataset', 'digits', '--data-dir', digits_dir, '--batch-size', '32',
              '--num-epochs', '1', '--max-batches', '1', '--no-progress',
              '--model', 'cifar_resnet20_v1']
    assert train_imagenet.main(common + ['--save-dir', str(other), '--dtype', 'float32']) == 0
    figures = []
    original = report.plot_runs

    def keep(*args, **kwargs):
        figures.append(original(*args, **kwargs))
        return figures[-1]
    fit.plot_runs = keep
    try:
        assert train_imagenet.main(common + [
            '--save-dir', str(tmp_path / 'mine'), '--dtype', 'bfloat16',
            '--plot', str(tmp_path / 'p.png'),
            '--compare', str(other / 'cifar_resnet20_v1-metrics.csv')]) == 0
    finally:
        fit.plot_runs = original
    from mxamp import hardware
    how = 'bfloat16 (native)' if hardware.computes_bfloat16() else \
        'bfloat16 storage, FP32 compute'
    legend = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert legend == ['cifar_resnet20_v1: %s' % how, 'cifar_resnet20_v1: FP32']


def test_plot_bars_show_the_figures_given(tmp_path):
    fig = report.plot_runs([('a', _rows([10.0, 30.0, 40.0])), ('b', _rows([5.0]))],
                                   str(tmp_path / 'given.png'),
                                   throughput=([12.5, 7.25], 'median over seeds'))
    speed = fig.axes[2]
    assert [bar.get_height() for bar in speed.patches] == [12.5, 7.25]
    assert speed.get_title() == 'training throughput (median over seeds)'
    fig = report.plot_runs([('a', _rows([10.0, 30.0, 40.0]))],
                                   str(tmp_path / 'default.png'))
    assert [bar.get_height() for bar in fig.axes[2].patches] == [35.0]   # steady epochs
    assert report.steady_img_per_sec(_rows([10.0, 30.0, 40.0])) == 35.0


def test_demo_plot_and_table_show_the_same_throughput(tmp_path, monkeypatch, capsys):
    """The demo's bars are its table's img/s (median over seeds), not a median of the
    seed-averaged curves."""
    speeds = {('float32', 0): [5.0, 10.0, 11.0], ('float32', 1): [5.0, 30.0, 31.0],
              ('float32', 2): [5.0, 12.0, 14.0]}

    def fake_run(dtype, seed, args, save_dir):
        key = ('float32' if dtype == 'float32' else 'mixed', seed)
        rows = _rows(speeds.get(key, [2.0, 20.0, 24.0]))
        os.makedirs(save_dir, exist_ok=True)
        report.write_metrics(os.path.join(save_dir, 'digits-metrics.csv'), rows)
        return {'val_top1': 0.5, 'val_top5': 0.9, 'peak_rss_mb': 100.0, 'skipped_steps': 0,
                'img_per_sec': report.steady_img_per_sec(rows), 'dtype': dtype,
                'compute': 'FP32' if dtype == 'float32' else 'native', 'device': 'a CPU'}
    plotted = {}
    monkeypatch.setattr(demo, '_run', fake_run)
    monkeypatch.setattr(report, 'plot_runs',
                        lambda runs, path, title=None, throughput=None: plotted.update(
                            runs=runs, throughput=throughput))
    assert demo.main(['--seeds', '3', '--out-dir', str(tmp_path)]) == 0
    with open(str(tmp_path / 'results.json')) as handle:
        table = json.load(handle)['results']
    assert table['FP32']['img_per_sec'] == 13.0          # medians 10.5, 30.5, 13.0
    bars, what = plotted['throughput']
    assert bars[0] == table['FP32']['img_per_sec']
    assert bars[1] == [entry for name, entry in table.items() if name != 'FP32'][0][
        'img_per_sec']
    assert what == 'median over seeds'
    assert '%10.0f' % 13.0 in capsys.readouterr().out


def _commands(docstring, script):
    """The shell commands of a docstring's literal blocks that run `script`, joined
    across backslash-newlines."""
    text = re.sub(r'\\\s*\n\s*', ' ', docstring)
    return [line.strip() for line in text.splitlines() if script in line]


def test_docstring_examples_on_built_in_data_end():
    """Examples a user pastes on built-in data (digits, synthetic) finish: they name
    their epochs (train_imagenet's default is ImageNet's 90) or batches."""
    examples = []
    for module in (train_imagenet, launch_local):
        examples += [c for c in _commands(module.__doc__, 'train_imagenet.py')
                     if '--dataset digits' in c or '--synthetic' in c]
    assert len(examples) >= 3, examples
    for command in examples:
        assert '--num-epochs' in command or '--max-batches' in command, command
        assert '...' not in command, command


@pytest.mark.slow
def test_launch_locals_example_runs_as_written(tmp_path):
    """The launcher's Usage example, pasted (its --save-dir under a temporary
    directory), finishes with status 0."""
    command, = [c for c in _commands(launch_local.__doc__, 'launch_local.py')
                if c.startswith('python ')]
    words = command.split()
    words[words.index('--save-dir') + 1] = str(tmp_path / 'run')
    words = [sys.executable if w == 'python' else
             os.path.join(ROOT, w) if w.startswith('scripts/') else w for w in words]
    proc = subprocess.run(words, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.isfile(str(tmp_path / 'run' / 'cifar_resnet20_v1-summary.json'))
