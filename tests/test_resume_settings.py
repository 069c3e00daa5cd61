"""scripts/train_imagenet.py --resume continues the run that its checkpoint records.

Each checkpoint records the run's settings (everything that changes the
numbers).  A resume with other settings stops with status 2 and one line per
difference before anything trains or is written, on every worker of a
distributed run; what may change (a longer step schedule, data threads, the
output options) resumes, and ``--resume-override`` changes the rest on purpose,
logged and recorded.  A checkpoint that lacks any of the settings is not one this
script writes: refused in one line.

Most runs here refuse before the model is built: they share one checkpoint,
trained once per module (epoch 1 of 2, two batches of the digits).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, 'scripts')
TRAIN = os.path.join(SCRIPTS, 'train_imagenet.py')
LAUNCH = os.path.join(SCRIPTS, 'launch_local.py')
sys.path.insert(0, SCRIPTS)

import train_imagenet  # noqa: E402
from imagenet import checkpoints, data, options, resume  # noqa: E402

ERROR = 'train_imagenet.py: error: '


def _argv(digits_dir, save_dir, *extra):
    """The run's command line; options in `extra` replace earlier ones (argparse keeps
    the last)."""
    return ['--dataset', 'digits', '--data-dir', digits_dir, '--save-dir', str(save_dir),
            '--model', 'cifar_resnet20_v1', '--dtype', 'float32', '--batch-size', '32',
            '--lr', '0.1', '--warmup-epochs', '1', '--num-epochs', '2', '--max-batches', '2',
            '--no-progress', '--save-prefix', 'm'] + list(extra)


@pytest.fixture(scope='module')
def trained(digits_dir, tmp_path_factory):
    """A directory with the checkpoint of epoch 1 of a 2-epoch run (do not change it)."""
    directory = tmp_path_factory.mktemp('trained') / 'run'
    assert train_imagenet.main(_argv(digits_dir, directory, '--stop-at-epoch', '1')) == 0
    assert checkpoints.list_checkpoints(str(directory), 'm') == [1]
    return directory


@pytest.fixture
def run_dir(trained, tmp_path):
    """A copy of `trained` for one test."""
    directory = tmp_path / 'run'
    shutil.copytree(str(trained), str(directory))
    return directory


def _meta(directory, epoch):
    with open(os.path.join(str(directory), 'm-%04d.json' % epoch)) as handle:
        return json.load(handle)


def _write_meta(directory, epoch, meta):
    with open(os.path.join(str(directory), 'm-%04d.json' % epoch), 'w') as handle:
        json.dump(meta, handle)


def _files(directory):
    """Every file under `directory`: relative path -> bytes."""
    found = {}
    for root, _, names in os.walk(str(directory)):
        for name in names:
            path = os.path.join(root, name)
            with open(path, 'rb') as handle:
                found[os.path.relpath(path, str(directory))] = handle.read()
    return found


def _errors(err):
    return [line[len(ERROR):] for line in err.splitlines() if line.startswith(ERROR)]


def _hint(directory, epoch=1):
    return ('--resume: %s was written with the settings above: resume with them, or name '
            'those to change in --resume-override (see --help)'
            % os.path.join(str(directory), 'm-%04d.json' % epoch))


# --------------------------------------------------------------------------------------
# What a checkpoint records

def test_every_option_is_checked_or_free_on_resume():
    """A new option must be classified: recorded and compared, or free to change."""
    checked, free = set(options.RESUME_CHECKED), set(options.RESUME_FREE)
    flags = {option for action in options.build_parser()._actions
             for option in action.option_strings if option.startswith('--')} - {'--help'}
    assert not checked & free
    assert flags == (checked | free) - {'DMLC_NUM_WORKER'}
    assert set(options.RESUME_FIXED) <= checked


def test_checkpoint_and_summary_record_the_settings(trained):
    meta = _meta(trained, 1)
    settings = meta['settings']
    assert list(settings) == list(options.RESUME_CHECKED)
    expected = {'--dataset': 'digits', '--data-train': None, '--model': 'cifar_resnet20_v1',
                '--symbol': None, '--dtype': 'float32', '--loss-scale': 'none',
                '--num-classes': 10, '--image-shape': '1,8,8', '--batch-size': 32,
                '--num-epochs': 2, '--max-batches': 2, '--optimizer': 'sgd', '--lr': 0.1,
                '--momentum': 0.875, '--wd': 1.0 / 32768, '--no-wd': False,
                '--lr-mode': 'cosine', '--warmup-epochs': 1.0, '--label-smoothing': 0.1,
                '--seed': 0, '--num-gpus': 0, '--kv-store': 'device', 'DMLC_NUM_WORKER': 1}
    assert {name: settings[name] for name in expected} == expected
    assert meta['resume_overrides'] == []
    with open(trained / 'm-summary.json') as handle:
        assert json.load(handle)['resume_overrides'] == []


def test_effective_values_are_recorded(digits_dir):
    """The learning rate that ran (default: 0.256 per 256 images of the global batch),
    and 'auto' as it resolved: the same run spelled otherwise is the same run."""
    import mxnet as mx
    parser = options.build_parser()
    args = parser.parse_args(['--dataset', 'digits', '--data-dir', digits_dir, '--batch-size',
                              '64', '--loss-scale', 'auto', '--lr-decay-epoch', '30, 60,80'])
    spec = data.resolve_data(args)
    settings = resume.run_settings(args, spec, 'float16', [mx.cpu()], 2, 0.128)
    assert settings['--lr'] == 0.128 and settings['DMLC_NUM_WORKER'] == 2
    assert settings['--loss-scale'] == 'dynamic'
    assert settings['--lr-decay-epoch'] == '30,60,80'
    assert settings['--data-train'] is None     # the digits' own files, wherever cached
    # A data file by absolute path, however it was given, and its number of images.
    train_rec = os.path.join(digits_dir, 'train.rec')
    args = parser.parse_args(['--dataset', 'digits', '--data-dir', digits_dir,
                              '--data-train', os.path.relpath(train_rec)])
    spec = data.resolve_data(args)
    settings = resume.run_settings(args, spec, 'float32', [mx.cpu()], 1, 0.064)
    assert settings['--loss-scale'] == 'none'
    assert settings['--data-train'] == '%s (1500 images)' % os.path.abspath(train_rec)


# --------------------------------------------------------------------------------------
# A resume with other settings is refused

REFUSED = [
    (['--lr', '0.2'], '--lr: checkpoint 0.1, now 0.2'),
    (['--batch-size', '16'], '--batch-size: checkpoint 32, now 16'),
    (['--warmup-epochs', '2'], '--warmup-epochs: checkpoint 1.0, now 2.0'),
    (['--num-epochs', '3'], '--num-epochs: checkpoint 2, now 3 (the cosine schedule spans the '
                            'epochs: the learning rate would jump)'),
    (['--lr-mode', 'step'], '--lr-mode: checkpoint cosine, now step'),
    (['--optimizer', 'nag'], '--optimizer: checkpoint sgd, now nag'),
    (['--momentum', '0.9'], '--momentum: checkpoint 0.875, now 0.9'),
    (['--wd', '1e-4'], '--wd: checkpoint 3.0517578125e-05, now 0.0001'),
    (['--no-wd'], '--no-wd: checkpoint off, now on'),
    (['--label-smoothing', '0'], '--label-smoothing: checkpoint 0.1, now 0.0'),
    (['--seed', '1'], '--seed: checkpoint 0, now 1'),
    (['--loss-scale', '128'], '--loss-scale: checkpoint none, now 128.0'),
    (['--max-batches', '3'], '--max-batches: checkpoint 2, now 3'),
    (['--dtype', 'bfloat16'], '--dtype: checkpoint float32, now bfloat16'),
    (['--model', 'cifar_resnet56_v1'], '--model: checkpoint cifar_resnet20_v1, now '
                                       'cifar_resnet56_v1'),
    (['--synthetic'], '--synthetic: checkpoint off, now on'),
    (['--kv-store', 'local'], '--kv-store: checkpoint device, now local'),
]


@pytest.mark.parametrize('change, line', REFUSED, ids=[change[0] for change, _ in REFUSED])
def test_a_changed_setting_is_refused_before_anything_is_written(digits_dir, run_dir, capsys,
                                                                 change, line):
    before = _files(run_dir)
    assert train_imagenet.main(_argv(digits_dir, run_dir, '--resume', *change)) == 2
    err = capsys.readouterr().err
    assert _errors(err) == [line, _hint(run_dir)], err
    assert 'Traceback' not in err
    assert _files(run_dir) == before          # train.log included: nothing was logged


def test_one_line_per_difference(digits_dir, run_dir, capsys):
    """Every difference at once, in a fixed order; the default learning rate follows
    the batch size, and says so."""
    argv = _argv(digits_dir, run_dir, '--resume-epoch', '1', '--seed', '3', '--batch-size',
                 '64', '--label-smoothing', '0.2')
    argv.remove('--lr')
    argv.remove('0.1')
    assert train_imagenet.main(argv) == 2
    assert _errors(capsys.readouterr().err) == [
        '--batch-size: checkpoint 32, now 64', '--lr: checkpoint 0.1, now 0.064',
        '--label-smoothing: checkpoint 0.1, now 0.2', '--seed: checkpoint 0, now 3',
        _hint(run_dir)]


# --------------------------------------------------------------------------------------
# What may change

def test_free_options_resume(digits_dir, run_dir, capsys):
    """Data threads, logging and checkpoint options, which epoch: the run goes on;
    a different number of threads decoding is logged (not bit-exact then; the
    note itself: test_train_output)."""
    assert train_imagenet.main(_argv(digits_dir, run_dir, '--resume-epoch', '1', '--gpus', '',
                                     '--data-nthreads', '2', '--log-interval', '1',
                                     '--save-frequency', '1', '--keep-checkpoints', '5')) == 0
    err = capsys.readouterr().err
    assert not _errors(err)
    changed = data.decoding_threads(4) != data.decoding_threads(2)
    assert ("--data-nthreads: the checkpoint's run decoded on" in err) == changed
    assert 'epoch 2/2: loss' in err
    assert _meta(run_dir, 2)['settings'] == _meta(run_dir, 1)['settings']


def _params_and_states(directory, epoch):
    return [(directory / ('m-%04d.%s' % (epoch, suffix))).read_bytes()
            for suffix in ('params', 'states')]


def test_a_step_schedule_extends_bit_exactly(digits_dir, tmp_path, capsys):
    """--lr-mode step decays at fixed epochs: a finished 1-epoch run extended to 2
    epochs is the 2-epoch run, to the bit."""
    step = ('--lr-mode', 'step', '--lr-decay-epoch', '1', '--warmup-epochs', '0.5')
    whole, split = tmp_path / 'whole', tmp_path / 'split'
    assert train_imagenet.main(_argv(digits_dir, whole, *step)) == 0
    assert train_imagenet.main(_argv(digits_dir, split, *step + ('--num-epochs', '1'))) == 0
    capsys.readouterr()
    assert train_imagenet.main(_argv(digits_dir, split, '--resume', *step)) == 0
    err = capsys.readouterr().err
    assert '--num-epochs: checkpoint 1, now 2: free to change under --lr-mode step' in err
    assert not _errors(err)
    assert _params_and_states(whole, 2) == _params_and_states(split, 2)
    assert _meta(split, 2)['settings']['--num-epochs'] == 2


# --------------------------------------------------------------------------------------
# --resume-override

def test_override_changes_the_setting_logs_and_records_it(digits_dir, run_dir, capsys):
    argv = _argv(digits_dir, run_dir, '--resume', '--lr', '0.2', '--num-epochs', '3',
                 '--stop-at-epoch', '2', '--resume-override', 'lr',
                 '--resume-override', 'num-epochs')
    assert train_imagenet.main(argv) == 0
    err = capsys.readouterr().err
    records = [{'epoch': 1, 'setting': '--num-epochs', 'checkpoint': 2, 'now': 3},
               {'epoch': 1, 'setting': '--lr', 'checkpoint': 0.1, 'now': 0.2}]
    for record in records:
        line = '%(setting)s: checkpoint %(checkpoint)s, now %(now)s: changed by ' \
               '--resume-override' % record
        assert line in err and line in (run_dir / 'train.log').read_text()
    assert 'global batch 32, lr 0.2,' in err
    meta = _meta(run_dir, 2)
    assert meta['resume_overrides'] == records
    assert (meta['settings']['--lr'], meta['settings']['--num-epochs']) == (0.2, 3)
    with open(run_dir / 'm-summary.json') as handle:
        assert json.load(handle)['resume_overrides'] == records

    # The same command line again (a restarted job): nothing differs, the record stays.
    assert train_imagenet.main(argv[:-4] + ['--stop-at-epoch', '3', '--resume-override',
                                            'lr,num-epochs']) == 0
    err = capsys.readouterr().err
    assert not _errors(err) and 'changed by' not in err
    assert _meta(run_dir, 3)['resume_overrides'] == records
    # The checkpoint records the overridden value: the original one now differs.
    assert train_imagenet.main(_argv(digits_dir, run_dir, '--resume', '--num-epochs',
                                     '3')) == 2
    assert _errors(capsys.readouterr().err) == ['--lr: checkpoint 0.2, now 0.1',
                                                _hint(run_dir, 3)]


@pytest.mark.parametrize('extra, message', [
    (['--resume', '--resume-override', 'lr,lrr'],
     "argument --resume-override: 'lrr' is not a setting that a checkpoint records (dataset, "),
    (['--resume', '--resume-override', 'dtype'],
     'argument --resume-override: dtype: the network cannot change on resume'),
    (['--resume-override', 'lr'],
     '--resume-override changes settings of a resumed run: give it with --resume or '
     '--resume-epoch'),
], ids=['unknown', 'network', 'without-resume'])
def test_override_names_are_checked(digits_dir, tmp_path, capsys, extra, message):
    assert train_imagenet.main(_argv(digits_dir, tmp_path, *extra)) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith(message), errors
    assert not os.listdir(str(tmp_path))


def test_compare_settings():
    stored = {'--lr': 0.1, '--num-epochs': 2, '--lr-mode': 'step', '--seed': 0}
    current = {'--lr': 0.2, '--num-epochs': 4, '--lr-mode': 'step', '--seed': 0,
               '--wd': 0.1}            # --wd: not recorded, not compared
    assert resume.compare_settings(stored, current, ()) == (
        ['--lr: checkpoint 0.1, now 0.2'], [],
        ['--num-epochs: checkpoint 2, now 4: free to change under --lr-mode step'])
    assert resume.compare_settings(stored, current, ('--lr',))[:2] == (
        [], [('--lr', 0.1, 0.2)])
    cosine = dict(current, **{'--lr-mode': 'cosine'})
    assert resume.compare_settings(dict(stored, **{'--lr-mode': 'cosine'}), cosine,
                                           ('--lr', '--num-epochs')) == (
        [], [('--lr', 0.1, 0.2), ('--num-epochs', 2, 4)], [])


# --------------------------------------------------------------------------------------
# A checkpoint that lacks settings

def test_a_checkpoint_lacking_settings_is_refused_in_one_line(digits_dir, run_dir, capsys):
    """Every checkpoint of this script records them all: one that lacks some (here
    --lr, --seed and the threads that decoded) is not resumed, whatever else matches."""
    meta = _meta(run_dir, 1)
    del meta['settings']['--lr'], meta['settings']['--seed'], meta['decoding_threads']
    _write_meta(run_dir, 1, meta)
    before = _files(run_dir)
    assert train_imagenet.main(_argv(digits_dir, run_dir, '--resume')) == 2
    err = capsys.readouterr().err
    assert _errors(err) == [
        '--resume: %s does not record --lr, --seed, --data-nthreads: not a checkpoint this '
        'script writes (start a new run; --load takes its parameters)'
        % (run_dir / 'm-0001.json')], err
    assert 'Traceback' not in err
    assert _files(run_dir) == before          # train.log included: nothing was logged
    # No settings at all: the one line names every one.
    del meta['settings']
    _write_meta(run_dir, 1, meta)
    before = _files(run_dir)
    assert train_imagenet.main(_argv(digits_dir, run_dir, '--resume')) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith(
        '--resume: %s does not record %s, --data-nthreads: '
        % (run_dir / 'm-0001.json', ', '.join(options.RESUME_CHECKED))), errors
    assert _files(run_dir) == before


# --------------------------------------------------------------------------------------
# Distributed: every worker agrees, none hangs

def _launch(digits_dir, save, logs, *extra):
    # bfloat16: float32 over dist_sync aborts MXNet's server ("init 4 first"), before and
    # after --resume checked settings.
    command = [sys.executable, TRAIN, '--kv-store', 'dist_sync'] + \
        _argv(digits_dir, save, '--dtype', 'bfloat16', *extra)
    result = subprocess.run([sys.executable, LAUNCH, '-n', '2', '--timeout', '150',
                             '--log-dir', str(logs), '--'] + command, capture_output=True,
                            text=True, timeout=200, cwd=ROOT)
    return result.returncode, [(logs / ('worker%d.log' % rank)).read_text() for rank in (0, 1)]


@pytest.mark.slow
def test_dist_workers_refuse_together(digits_dir, tmp_path):
    save = tmp_path / 'run'
    status, logs = _launch(digits_dir, save, tmp_path / 'first', '--stop-at-epoch', '1')
    assert status == 0, logs
    # Both workers see the other learning rate: both refuse.
    status, logs = _launch(digits_dir, save, tmp_path / 'other-lr', '--resume', '--lr', '0.2')
    assert status == 2, logs
    for log in logs:
        assert ERROR + '--lr: checkpoint 0.1, now 0.2' in log, logs
    # Only worker 1's checkpoint differs: worker 0 refuses too, at once, rather than
    # train alone and wait for worker 1 for ever.
    meta = _meta(save / 'rank1', 1)
    meta['settings']['--lr'] = 0.3
    _write_meta(save / 'rank1', 1, meta)
    status, logs = _launch(digits_dir, save, tmp_path / 'worker1', '--resume')
    assert status == 2, logs
    assert ERROR + '--lr: checkpoint 0.3, now 0.1' in logs[1], logs
    assert (ERROR + '--resume: the settings of worker(s) 1 differ from their checkpoint '
            '(their output says which): no worker resumes') in logs[0], logs
    assert 'checkpoint 0.3' not in logs[0]
    assert checkpoints.list_checkpoints(str(save), 'm') == [1]
    assert checkpoints.list_checkpoints(str(save / 'rank1'), 'm') == [1]
