"""End-to-end tests of scripts/train_imagenet.py, scripts/launch_local.py and scripts/digits_rec.py.

Training runs use the digits RecordIO (packed once per session into a temporary
directory), tiny networks and ``--max-batches``; most run in this process
through ``train_imagenet.main`` (one MXNet start-up for all of them), the
command-line contract (exit status 2, one line) and the distributed run in
subprocesses.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, 'scripts')
TRAIN = os.path.join(SCRIPTS, 'train_imagenet.py')
LAUNCH = os.path.join(SCRIPTS, 'launch_local.py')
sys.path.insert(0, SCRIPTS)

import digits_rec  # noqa: E402
import launch_local  # noqa: E402
import train_imagenet  # noqa: E402
from imagenet import checkpoints, data, fit, model, options, report  # noqa: E402
import mxamp  # noqa: E402
from mxamp import hardware  # noqa: E402

# How bfloat16 runs on this CPU: natively, or stored in bfloat16 and computed in FP32.
BFLOAT16_COMPUTE = 'native' if hardware.computes_bfloat16() else 'bfloat16 storage, FP32 compute'


def _common(digits_dir, save_dir, *extra):
    return ['--dataset', 'digits', '--data-dir', digits_dir, '--save-dir', str(save_dir),
            '--batch-size', '32', '--lr', '0.1', '--warmup-epochs', '1', '--no-progress',
            '--save-prefix', 'm'] + list(extra)


def _summary(save_dir):
    with open(os.path.join(str(save_dir), 'm-summary.json')) as handle:
        return json.load(handle)


def _params_equal(first, second):
    with open(first, 'rb') as a, open(second, 'rb') as b:
        return a.read() == b.read()


# --------------------------------------------------------------------------------------
# Data

def test_digits_recordio(digits_dir):
    import mxnet as mx
    info = digits_rec.prepare(digits_dir)      # cached: returns without packing again
    assert (info['num_train'], info['num_val'], info['num_classes']) == (1500, 297, 10)
    record = mx.recordio.MXIndexedRecordIO(info['val_idx'], info['val_rec'], 'r')
    header, image = mx.recordio.unpack_img(record.read_idx(0), -1)
    record.close()
    assert image.shape == (8, 8) and 0 <= header.label < 10
    assert len(record.keys) == 297


def test_data_is_reproducible_per_epoch(digits_dir):
    """Fresh iterators with the same (seed, epoch) give the same batches; others do not."""
    args = options.build_parser().parse_args(['--dataset', 'digits', '--data-dir',
                                                     digits_dir])
    spec = data.resolve_data(args)

    def first(epoch):
        batch = next(iter(data.train_iter(spec, args, 32, epoch, 0, 1)))
        return batch.data[0].asnumpy(), batch.label[0].asnumpy()
    a, b, c = first(0), first(0), first(1)
    assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
    assert not (a[1] == c[1]).all()


# --------------------------------------------------------------------------------------
# Training, in process

@pytest.mark.slow
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16', 'float16'])
@pytest.mark.parametrize('network', [['--model', 'cifar_resnet20_v1'],
                                     ['--symbol', 'resnet', '--num-layers', '18']],
                         ids=['gluon', 'symbol'])
def test_train_digits(digits_dir, tmp_path, network, dtype):
    batches = '2' if dtype == 'float16' else '3'   # float16 is emulated (slow) on a CPU
    status = train_imagenet.main(_common(digits_dir, tmp_path, '--dtype', dtype, '--num-epochs',
                                         '1', '--max-batches', batches, *network))
    assert status == 0
    summary = _summary(tmp_path)
    assert summary['dtype'] == dtype
    assert summary['compute'] == {'float32': 'FP32', 'bfloat16': BFLOAT16_COMPUTE,
                                  'float16': 'float16 storage, GEMMs in FP32'}[dtype]
    assert summary['device'] == hardware.describe_cpu_class()
    assert summary['path'] == ('symbol' if '--symbol' in network else 'gluon')
    assert 0.0 <= summary['val_top1'] <= summary['val_top5'] <= 1.0
    if dtype == 'float16':
        assert summary['loss_scaling'] == 'dynamic'
        start = mxamp.LossScaler().loss_scale
        # Each skipped step lowered the scale; two steps are too few to raise it.
        assert (summary['loss_scale'] < start) == (summary['skipped_steps'] > 0)
    else:
        assert summary['loss_scaling'] == 'off'
        assert summary['loss_scale'] == 1.0 and summary['skipped_steps'] == 0
    rows = report.read_metrics(str(tmp_path / 'm-metrics.csv'))
    assert [r['epoch'] for r in rows] == [1]
    assert os.path.isfile(tmp_path / 'm-0001.params')
    assert checkpoints.list_checkpoints(str(tmp_path), 'm') == [1]


@pytest.mark.slow
def test_training_learns(digits_dir, tmp_path):
    """A few epochs in bfloat16 bring the digits far above chance (10%)."""
    status = train_imagenet.main(_common(digits_dir, tmp_path, '--model', 'cifar_resnet20_v1',
                                         '--dtype', 'bfloat16', '--num-epochs', '3',
                                         '--batch-size', '64'))
    assert status == 0
    assert _summary(tmp_path)['val_top1'] > 0.8


@pytest.mark.slow
def test_synthetic_and_plot(tmp_path):
    png = tmp_path / 'curves.png'
    status = train_imagenet.main(['--synthetic', '--dataset', 'digits', '--model',
                                  'cifar_resnet20_v1', '--dtype', 'auto', '--batch-size', '16',
                                  '--max-batches', '3', '--num-epochs', '2', '--no-progress',
                                  '--save-dir', str(tmp_path), '--save-prefix', 'm',
                                  '--plot', str(png)])
    assert status == 0
    summary = _summary(tmp_path)
    # 'auto' on a CPU: bfloat16 where it is faster than FP32, FP32 elsewhere.
    assert summary['dtype'] == ('bfloat16' if hardware.bfloat16_pays() else 'float32')
    assert summary['img_per_sec'] > 0
    assert summary['val_top1'] is None or summary['val_top1'] != summary['val_top1']  # NaN
    assert png.stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize('network', [['--model', 'resnet18_v1b', '--dtype', 'bfloat16'],
                                     ['--symbol', 'resnet', '--num-layers', '18',
                                      '--dtype', 'float16']],
                         ids=['gluon-bf16', 'symbol-fp16'])
def test_resume_is_bit_exact(digits_dir, tmp_path, network):
    """2 epochs == 1 epoch, stop, --resume, 1 more: same bytes in params and states."""
    args = network + ['--num-epochs', '2', '--max-batches', '3']
    whole, split = tmp_path / 'whole', tmp_path / 'split'
    assert train_imagenet.main(_common(digits_dir, whole, *args)) == 0
    assert train_imagenet.main(_common(digits_dir, split, '--stop-at-epoch', '1', *args)) == 0
    assert checkpoints.list_checkpoints(str(split), 'm') == [1]
    assert train_imagenet.main(_common(digits_dir, split, '--resume', *args)) == 0
    for suffix in ('params', 'states'):
        assert _params_equal(whole / ('m-0002.' + suffix), split / ('m-0002.' + suffix))
    whole_rows = report.read_metrics(str(whole / 'm-metrics.csv'))
    split_rows = report.read_metrics(str(split / 'm-metrics.csv'))
    assert [(r['epoch'], r['train_loss'], r['val_top1']) for r in whole_rows] == \
        [(r['epoch'], r['train_loss'], r['val_top1']) for r in split_rows]


def _preempted_after_first_checkpoint(monkeypatch):
    """Make the next run die (as if pre-empted) right after its first checkpoint."""
    save = checkpoints.save_checkpoint

    def save_then_die(*args, **kwargs):
        save(*args, **kwargs)
        monkeypatch.setattr(fit, 'save_checkpoint', save)
        raise KeyboardInterrupt
    monkeypatch.setattr(fit, 'save_checkpoint', save_then_die)


def test_resume_auto_one_command_line_and_logs_without_progress(digits_dir, tmp_path, capsys,
                                                               monkeypatch):
    """A pre-emptible job: the same command line starts fresh, then resumes.  With
    --no-progress every log line still reaches the console and train.log."""
    argv = _common(digits_dir, tmp_path, '--model', 'cifar_resnet20_v1', '--dtype', 'float32',
                   '--num-epochs', '2', '--max-batches', '2', '--resume', 'auto')
    _preempted_after_first_checkpoint(monkeypatch)
    assert train_imagenet.main(argv) == 130
    first = capsys.readouterr().err
    assert checkpoints.list_checkpoints(str(tmp_path), 'm') == [1]
    assert train_imagenet.main(argv) == 0
    second = capsys.readouterr().err
    assert checkpoints.list_checkpoints(str(tmp_path), 'm') == [1, 2]
    fresh = '--resume auto: no checkpoint of m in %s: starting from scratch' % tmp_path
    resumed = 'resumed from %s (epoch 1, step 2)' % (tmp_path / 'm-0001.json')
    assert fresh in first and 'epoch 1/2: loss' in first and 'resumed' not in first
    assert resumed in second and 'epoch 2/2: loss' in second and 'epoch 1/2' not in second
    assert '%|' not in first + second            # no progress bar
    with open(tmp_path / 'train.log') as handle:
        log = handle.read()
    assert fresh in log and resumed in log and log.count('epoch 2/2: loss') == 1


def test_warnings_reach_the_console_and_train_log(tmp_path, capsys):
    import warnings
    with warnings.catch_warnings():            # restores warnings.showwarning
        warnings.simplefilter('always')
        fit.setup_logging(str(tmp_path / 'train.log'), None)
        try:
            warnings.warn('mxamp: a test warning', RuntimeWarning)
        finally:
            fit.close_logging()
    assert 'RuntimeWarning: mxamp: a test warning' in capsys.readouterr().err
    assert 'RuntimeWarning: mxamp: a test warning' in (tmp_path / 'train.log').read_text()


def test_resume_auto_and_resume_epoch_exclude_each_other(digits_dir, tmp_path, capsys):
    argv = _common(digits_dir, tmp_path, '--model', 'cifar_resnet20_v1', '--resume', 'auto',
                   '--resume-epoch', '1')
    assert train_imagenet.main(argv) == 2
    assert 'give only one of them' in capsys.readouterr().err


def test_missing_named_checkpoint_is_an_error(digits_dir, tmp_path, capsys):
    argv = _common(digits_dir, tmp_path, '--model', 'cifar_resnet20_v1', '--resume-epoch', '3')
    assert train_imagenet.main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if 'error' in line]
    assert len(errors) == 1 and '--resume-epoch 3: no checkpoint of that epoch' in errors[0]
    assert not os.path.exists(tmp_path / 'm-metrics.csv')


def test_epoch_line_says_this_epochs_skipped_steps_and_the_total(digits_dir, tmp_path, capsys):
    """float16 under a fixed loss scale of 1e10 overflows at every step: 2 per epoch."""
    assert train_imagenet.main(_common(digits_dir, tmp_path, '--model', 'cifar_resnet20_v1',
                                       '--dtype', 'float16', '--loss-scale', '1e10',
                                       '--num-epochs', '2', '--max-batches', '2')) == 0
    err = capsys.readouterr().err
    assert 'skipped 2 steps (2 in total)' in err and 'skipped 2 steps (4 in total)' in err
    rows = report.read_metrics(str(tmp_path / 'm-metrics.csv'))
    assert [(r['skipped_in_epoch'], r['skipped_total']) for r in rows] == [(2, 2), (2, 4)]
    assert _summary(tmp_path)['skipped_steps'] == 4


def test_plot_epoch_ticks_are_integers(tmp_path):
    rows = [{'epoch': e, 'train_loss': 2.0 / e, 'val_top1': 0.2 * e, 'img_per_sec': 100.0}
            for e in (1, 2, 3)]
    fig = report.plot_runs([('run', rows)], str(tmp_path / 'curves.png'))
    assert (tmp_path / 'curves.png').stat().st_size > 1000
    for ax in fig.axes[:2]:                      # loss and accuracy per epoch
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(t == int(t) for t in ticks), ticks


def test_no_wd_exempts_batchnorm_and_biases_only(digits_dir):
    """--no-wd does what its help says: no decay on BatchNorm's gamma and beta and on
    biases, full decay on everything else."""
    import mxnet as mx
    from mxnet import gluon
    parser = options.build_parser()
    for flag, expect_exempt in (([], False), (['--no-wd'], True)):
        args = parser.parse_args(['--dataset', 'digits', '--data-dir', digits_dir, '--model',
                                  'cifar_resnet20_v1', '--dtype', 'float32'] + flag)
        spec = data.resolve_data(args)
        runner = model.GluonRunner(args, spec, [mx.cpu()], 'float32', None, 4, 4,
                                            0.1, 1)
        exempt = set()

        def visit(block):
            if isinstance(block, gluon.nn.BatchNorm):
                exempt.update((block.gamma.name, block.beta.name))
            if getattr(block, 'bias', None) is not None:
                exempt.add(block.bias.name)
            for child in block._children.values():
                visit(child)
        visit(runner.net)
        trained = {n: p.wd_mult for n, p in runner.net.collect_params().items()
                   if p.grad_req != 'null'}
        assert any(n.endswith('_bias') for n in exempt) and len(exempt) > 10
        assert {n for n, mult in trained.items() if mult == 0} == \
            (exempt if expect_exempt else set())
        assert all(mult == 1 for n, mult in trained.items() if n not in exempt)


def test_interrupted_save_keeps_previous_checkpoint(tmp_path):
    """A save that dies midway leaves no half checkpoint and the previous one intact."""
    class Runner(object):
        def __init__(self, fail):
            self.fail = fail

        def save(self, params_file, states_file):
            with open(params_file, 'w') as handle:
                handle.write('params')
            if self.fail:
                raise KeyboardInterrupt
            with open(states_file, 'w') as handle:
                handle.write('states')

    directory = str(tmp_path)
    checkpoints.save_checkpoint(Runner(False), directory, 'm', 1, {'global_step': 3})
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save_checkpoint(Runner(True), directory, 'm', 2, {'global_step': 6})
    assert checkpoints.list_checkpoints(directory, 'm') == [1]
    assert sorted(os.listdir(directory)) == ['m-0001.json', 'm-0001.params', 'm-0001.states']
    with open(os.path.join(directory, 'm-0001.json')) as handle:
        assert json.load(handle)['global_step'] == 3


def test_prune_checkpoints(tmp_path):
    class Runner(object):
        def save(self, params_file, states_file):
            for path in (params_file, states_file):
                with open(path, 'w') as handle:
                    handle.write('x')
    for epoch in (1, 2, 3):
        checkpoints.save_checkpoint(Runner(), str(tmp_path), 'm', epoch, {})
    checkpoints.prune_checkpoints(str(tmp_path), 'm', 2)
    assert checkpoints.list_checkpoints(str(tmp_path), 'm') == [2, 3]


def test_symbol_loss_head_matches_smoothed_cross_entropy():
    import mxnet as mx
    import numpy as np
    logits = np.random.RandomState(0).randn(4, 5).astype(np.float32)
    label = np.array([0, 3, 4, 1], dtype=np.float32)
    head = model.symbol_loss_head(mx.sym.var('x'), mx.sym.var('y'), 0.1, 5)
    out = head.eval(x=mx.nd.array(logits), y=mx.nd.array(label))[0].asnumpy()
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    target = np.full((4, 5), 0.1 / 5)
    target[np.arange(4), label.astype(int)] += 0.9
    np.testing.assert_allclose(out, -(target * logp).sum(axis=1), rtol=1e-5)


# --------------------------------------------------------------------------------------
# Command line: one line and exit status 2 on bad input

def _run(args, timeout=120, **kwargs):
    return subprocess.run([sys.executable] + args, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize('argv, message', [
    (['--data-train', '/nonexistent/train.rec'], '--data-train /nonexistent/train.rec: no such'),
    (['--dataset', 'digits', '--model', 'resnet_nope'], "unknown model 'resnet_nope'"),
    (['--dataset', 'digits', '--dtype', 'float8'], "unknown dtype 'float8'"),
    (['--dataset', 'digits', '--resume'], '--resume: no checkpoint'),
])
def test_bad_input_exits_2_with_one_line(digits_dir, tmp_path, argv, message):
    result = _run([TRAIN, '--data-dir', digits_dir, '--save-dir', str(tmp_path),
                   '--no-progress'] + argv)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if 'error' in line]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert 'Traceback' not in result.stderr


def test_help_states_each_default_once(capsys):
    with pytest.raises(SystemExit):
        train_imagenet.main(['--help'])
    text = capsys.readouterr().out
    entries, current = [], None
    for line in text.splitlines():
        if line.startswith('  -'):
            current = [line.strip()]
            entries.append(current)
        elif current is not None and line.startswith('    '):
            current.append(line.strip())
        else:
            current = None
    entries = [' '.join(entry) for entry in entries]
    assert len(entries) > 40
    for entry in entries:
        assert entry.lower().count('default') <= 1, entry
        for empty in ('(default: None)', '(default: )', '(default: [])', '(default: False)'):
            assert empty not in entry, entry
    assert any('--num-classes N' in e and 'default: 1000; with --dataset digits, 10' in e
               for e in entries)
    assert all(action.help for action in options.build_parser()._actions)


def test_dtype_takes_the_python_apis_aliases():
    parser = options.build_parser()
    for alias in ('fp16', 'half', 'bf16', 'fp32', 'BFloat16'):
        options.check_args(parser.parse_args(['--dtype', alias]))
    with pytest.raises(options.UsageError, match="unknown dtype 'float8'"):
        options.check_args(parser.parse_args(['--dtype', 'float8']))


def test_missing_index_is_reported(tmp_path):
    rec = tmp_path / 'train.rec'
    rec.write_bytes(b'')
    with pytest.raises(options.UsageError, match='train.idx is missing'):
        args = options.build_parser().parse_args(['--data-train', str(rec)])
        data.resolve_data(args)


# --------------------------------------------------------------------------------------
# make demo

@pytest.mark.slow
@pytest.mark.parametrize('isa', [None, 'AVX2'], ids=['this-cpu', 'DNNL_MAX_CPU_ISA=AVX2'])
def test_demo_compares_fp32_with_bfloat16_and_says_how_and_why(digits_dir, tmp_path, isa):
    env = dict(os.environ)
    if isa is not None:
        env['DNNL_MAX_CPU_ISA'] = isa      # on AVX-512 machines: a CPU without AVX-512
    out = tmp_path / 'demo'
    result = _run([os.path.join(SCRIPTS, 'demo.py'), '--seeds', '1', '--epochs', '1',
                   '--data-dir', digits_dir, '--out-dir', str(out)], timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    how = BFLOAT16_COMPUTE if isa is None else 'bfloat16 storage, FP32 compute'
    rows = {line.split('  ')[0]: line for line in result.stdout.splitlines()
            if line.startswith(('FP32 ', 'mixed ('))}
    assert set(rows) == {'FP32', 'mixed (bfloat16)'}, result.stdout
    assert how in rows['mixed (bfloat16)']
    why = [line[len('why: '):] for line in result.stdout.splitlines() if line.startswith('why: ')]
    assert len(why) == 1, result.stdout
    if isa is None:
        assert why[0] == hardware.describe_cpu_class()
    else:
        assert "'avx2'" in why[0]
    assert 'mixed - FP32: top-1 ' in result.stdout
    with open(out / 'results.json') as handle:
        results = json.load(handle)['results']
    assert results['mixed (bfloat16)']['compute'] == how
    assert results['FP32']['compute'] == 'FP32'
    assert (out / 'digits_fp32_vs_mixed.png').stat().st_size > 1000


# --------------------------------------------------------------------------------------
# Distributed: 2 workers on 127.0.0.1

@pytest.mark.slow
def test_dist_sync_two_workers_end_identical(digits_dir, tmp_path):
    save = tmp_path / 'run'
    command = [sys.executable, TRAIN, '--kv-store', 'dist_sync', '--model', 'cifar_resnet20_v1',
               '--dtype', 'bfloat16', '--num-epochs', '2', '--max-batches', '4']
    command += _common(digits_dir, save)
    result = _run([LAUNCH, '-n', '2', '--timeout', '150', '--log-dir', str(tmp_path / 'logs'),
                   '--'] + command, timeout=200)
    logs = ''.join(open(tmp_path / 'logs' / name).read()
                   for name in ('worker0.log', 'worker1.log'))
    assert result.returncode == 0, result.stderr + logs
    for epoch in ('0001', '0002'):
        assert _params_equal(save / ('m-%s.params' % epoch),
                             save / 'rank1' / ('m-%s.params' % epoch))
    first, second = _summary(save), _summary(save / 'rank1')
    assert (first['rank'], second['rank'], first['num_workers']) == (0, 1, 2)
    assert first['global_batch'] == 64
    assert first['val_top1'] == second['val_top1']


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_launcher_propagates_failure_and_cleans_up(tmp_path):
    """One worker exits 3 at once, the other would sleep: status 3, nobody left running."""
    script = ('import os, sys, time\n'
              'open(os.path.join(%r, str(os.getpid())), "w").close()\n'
              'try:\n'
              '    os.open(os.path.join(%r, "first"), os.O_CREAT | os.O_EXCL)\n'
              'except FileExistsError:\n'
              '    sys.exit(3)\n'
              'time.sleep(60)\n') % (str(tmp_path), str(tmp_path))
    status = launch_local.launch([sys.executable, '-c', script], num_workers=2, timeout=50)
    # 3, the failed worker's status: the launcher stopped the sleeping one (a launcher
    # that waited would end at its timeout, status 124, or after the sleep, status 0).
    assert status == 3
    pids = [int(name) for name in os.listdir(str(tmp_path)) if name.isdigit()]
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)


def test_launcher_timeout(tmp_path):
    status = launch_local.launch([sys.executable, '-c', 'import time; time.sleep(60)'],
                                 num_workers=1, timeout=2)
    assert status == 124     # the timeout's status: the sleep (status 0) did not finish


_FIRST_STEP_WORKER = '''
import hashlib, sys
sys.path.insert(0, %r)
import numpy as np
import mxnet as mx
from imagenet import data, model, options
from mxamp.dtypes import name_of_array
kv = mx.kv.create("dist_sync")
args = options.build_parser().parse_args(
    ["--synthetic", "--dataset", "digits", "--model", "cifar_resnet20_v1", "--lr", "0.1"])
spec = data.resolve_data(args)
data.seed_everything(0)
runner = model.GluonRunner(args, spec, [mx.cpu()], "bfloat16", kv, 4, 8, 0.1, 1)
params = runner.net.collect_params()
weight = [p for n, p in params.items() if n.endswith("_weight")][0].data()
before = weight.asnumpy().tobytes()
# Each worker its own images: its own BatchNorm statistics, the gradient summed over both.
images = mx.nd.array(np.random.RandomState(kv.rank).uniform(size=(4,) + spec.image_shape))
runner.train_batch(mx.io.DataBatch([images], [mx.nd.array([0, 1, 2, 3])]))
mean = [p for n, p in params.items() if n.endswith("_running_mean")][0].data()
after = weight.asnumpy().tobytes()
print("RESULT", kv.rank, name_of_array(weight), after != before,
      hashlib.sha256(after).hexdigest(), mean.asnumpy().tolist(), flush=True)
''' % SCRIPTS


@pytest.mark.slow
def test_dist_gluon_first_step_keeps_each_workers_statistics(tmp_path):
    """bfloat16 over dist_sync: after one step the weights are identical on both
    workers (bfloat16 gradients summed through the kvstore), and each worker's
    BatchNorm running mean is its own: worker 0's parameters were broadcast before
    the first forward pass, not after it."""
    logs = tmp_path / 'logs'
    result = _run([LAUNCH, '-n', '2', '--timeout', '150', '--log-dir', str(logs), '--',
                   sys.executable, '-c', _FIRST_STEP_WORKER], timeout=200)
    output = ''.join(open(logs / name).read() for name in ('worker0.log', 'worker1.log'))
    assert result.returncode == 0, result.stderr + output
    rows = sorted(line.split(' ', 2)[1:] for line in output.splitlines()
                  if line.startswith('RESULT'))
    assert [rank for rank, _ in rows] == ['0', '1'], output
    (dtype, moved, digest, mean), (dtype1, moved1, digest1, mean1) = [
        rest.split(' ', 3) for _, rest in rows]
    assert dtype == dtype1 == 'bfloat16' and moved == moved1 == 'True', output
    assert digest == digest1, output
    assert mean != mean1, output


def test_a_resume_removes_the_hidden_temporaries_of_a_killed_save(tmp_path):
    # A converted net's save_parameters writes through mxamp.atomic_files, whose temporary
    # is hidden: killed during a checkpoint's save, a run left
    # ".m-0001.params.tmp-<pid>.mxamp-<pid>.tmp", which resume must remove too.
    dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    names = ['m-0001.params.tmp-%d' % pid, '.m-0001.params.tmp-%d.mxamp-%d.tmp' % (pid, pid),
             'm-0001.json', '.other-0001.params.tmp-%d.mxamp-%d.tmp' % (pid, pid)]
    for name in names:
        (tmp_path / name).write_text('x')
    removed = checkpoints.remove_stale_tmp(str(tmp_path), 'm')
    assert removed == sorted(names[:2])
    assert sorted(os.listdir(str(tmp_path))) == sorted(names[2:])
