"""Faults: a worker, the server or the scheduler dies mid-run; workers outlive the
scheduler and server; a process dies mid-save.

The distributed tests run real ps-lite jobs on 127.0.0.1 through
``scripts/launch_local.py`` and kill one of their processes with SIGKILL (or
let workers run on after the scheduler and server left); they check that the
launcher notices, names the process in one line, stops everything else within a
bounded time and exits non-zero, and that the checkpoints written so far are
complete and resumable.  The save test kills (SIGKILL, no clean-up runs) a
process at every step of ``imagenet.checkpoints.save_checkpoint`` in turn.

Every test is bounded in time, and every process it starts is stopped even
when it fails (the launcher stops its children; ``_Launch`` stops the launcher
and then anything still holding the job's port).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, 'scripts')
TRAIN = os.path.join(SCRIPTS, 'train_imagenet.py')
LAUNCH = os.path.join(SCRIPTS, 'launch_local.py')
sys.path.insert(0, SCRIPTS)

import launch_local  # noqa: E402
import train_imagenet  # noqa: E402
from imagenet import checkpoints, report  # noqa: E402

# Bounds: the launcher's own timeout, and how long after a kill it may take to exit.
JOB_TIMEOUT = 150
EXIT_BOUND = 60


# --------------------------------------------------------------------------------------
# Processes

def _state(pid):
    """'R', 'S', 'Z', ... from /proc, or None when there is no such process."""
    try:
        with open('/proc/%d/stat' % pid) as handle:
            return handle.read().rsplit(')', 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid):
    return _state(pid) not in (None, 'Z', 'X')


def _job_pids(root_port):
    """Live processes whose environment holds this job's DMLC_PS_ROOT_PORT."""
    needle = ('DMLC_PS_ROOT_PORT=%d' % root_port).encode()
    found = []
    for name in os.listdir('/proc'):
        if not name.isdigit():
            continue
        try:
            with open('/proc/%s/environ' % name, 'rb') as handle:
                env = handle.read().split(b'\0')
        except OSError:
            continue
        if needle in env and _alive(int(name)):
            found.append(int(name))
    return found


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Launch(object):
    """``launch_local.py`` in a subprocess; on exit, nothing of the job is left running."""

    def __init__(self, directory, num_workers, worker_command, options=()):
        self.dir = str(directory)
        self.pid_file = os.path.join(self.dir, 'pids.json')
        self.err_path = os.path.join(self.dir, 'launcher.err')
        self.log_dir = os.path.join(self.dir, 'logs')
        self.command = [sys.executable, LAUNCH, '-n', str(num_workers), '--timeout',
                        str(JOB_TIMEOUT), '--log-dir', self.log_dir, '--pid-file',
                        self.pid_file] + list(options) + ['--'] + worker_command
        self.proc = None
        self.pids = None

    def __enter__(self):
        os.makedirs(self.dir, exist_ok=True)
        self._err = open(self.err_path, 'w')
        self.proc = subprocess.Popen(self.command, stdout=self._err, stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)
        return self

    def wait_pids(self, bound=60):
        """The launcher's pid file (written once every process started)."""
        end = time.time() + bound
        while not os.path.isfile(self.pid_file):
            assert self.proc.poll() is None, 'launcher ended early:\n' + self.output()
            assert time.time() < end, 'no pid file after %d s:\n%s' % (bound, self.output())
            time.sleep(0.05)
        with open(self.pid_file) as handle:
            self.pids = json.load(handle)
        return self.pids

    def wait(self, bound):
        return self.proc.wait(timeout=bound)

    def output(self):
        self._err.flush()
        with open(self.err_path) as handle:
            return handle.read()

    def logs(self):
        text = ''
        if os.path.isdir(self.log_dir):
            for name in sorted(os.listdir(self.log_dir)):
                with open(os.path.join(self.log_dir, name), errors='replace') as handle:
                    text += '== %s\n%s' % (name, handle.read()[-3000:])
        return text

    def __exit__(self, *exc):
        try:
            if self.proc.poll() is None:       # the launcher stops its own children
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    _kill_group(self.proc.pid)
                    self.proc.wait(timeout=10)
            pids = self.pids
            if pids is None and os.path.isfile(self.pid_file):
                with open(self.pid_file) as handle:
                    pids = json.load(handle)
            if pids:
                for name, pid in pids.items():
                    if name not in ('launcher', 'root_port') and _alive(pid):
                        _kill_group(pid)
                for pid in _job_pids(pids['root_port']):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        finally:
            self._err.close()
        return False


def _train_command(digits_dir, save_dir, *extra):
    return [sys.executable, TRAIN, '--kv-store', 'dist_sync', '--model', 'cifar_resnet20_v1',
            '--dtype', 'bfloat16', '--max-batches', '4', '--dataset', 'digits',
            '--data-dir', digits_dir, '--save-dir', str(save_dir), '--batch-size', '32',
            '--lr', '0.1', '--warmup-epochs', '1', '--no-progress', '--save-prefix', 'm'] \
        + list(extra)


def _wait_for(condition, bound, launch, what):
    end = time.time() + bound
    while not condition():
        assert launch.proc.poll() is None, 'the job ended before %s:\n%s\n%s' % (
            what, launch.output(), launch.logs())
        assert time.time() < end, 'no %s after %d s:\n%s' % (what, bound, launch.logs())
        time.sleep(0.02)


def _assert_nothing_left(pids):
    left = [name for name, pid in pids.items()
            if name not in ('launcher', 'root_port') and _alive(pid)]
    assert not left, 'still running: %s' % left
    assert not _job_pids(pids['root_port'])


def _checkpoint_files_consistent(directory):
    """Every checkpoint that counts names existing files and its own epoch."""
    epochs = checkpoints.list_checkpoints(directory, 'm')
    for epoch in epochs:
        with open(os.path.join(directory, 'm-%04d.json' % epoch)) as handle:
            meta = json.load(handle)
        assert meta['epoch'] == epoch
        for key in ('params', 'states'):
            assert os.path.getsize(os.path.join(directory, meta[key])) > 0
    return epochs


# --------------------------------------------------------------------------------------
# A worker killed mid-run

@pytest.mark.slow
def test_killed_worker_stops_job_and_checkpoint_resumes(digits_dir, tmp_path):
    """kill -9 worker 1 after worker 0's epoch-1 checkpoint: report, stop all, resume."""
    save = tmp_path / 'run'
    with _Launch(tmp_path / 'first', 2,
                 _train_command(digits_dir, save, '--num-epochs', '8')) as launch:
        pids = launch.wait_pids()
        _wait_for(lambda: 1 in checkpoints.list_checkpoints(str(save), 'm'), 120, launch,
                  "worker 0's epoch-1 checkpoint")
        assert launch.proc.poll() is None
        os.kill(pids['worker1'], signal.SIGKILL)
        killed = time.time()
        status = launch.wait(EXIT_BOUND)
        elapsed = time.time() - killed
        output = launch.output()
        print('kill -9 worker 1 -> launcher exit: %.2f s' % elapsed)

    assert status == 128 + signal.SIGKILL, output + launch.logs()
    assert elapsed < EXIT_BOUND
    lines = [line for line in output.splitlines() if 'killed by signal' in line]
    assert lines == ['launch_local.py: worker 1 (rank 1, pid %d) was killed by signal 9 '
                     '(SIGKILL); stopping the job' % pids['worker1']], output
    # Worker 0 had not ended on its own: it waited for worker 1 in ps-lite.
    stopped = [line for line in output.splitlines() if line.startswith('launch_local.py: stopped')]
    assert len(stopped) == 1 and 'worker 0 (rank 0, pid %d)' % pids['worker0'] in stopped[0]
    _assert_nothing_left(pids)

    # Worker 0 cannot finish epoch 2 without worker 1: its last checkpoint is epoch 1.
    assert _checkpoint_files_consistent(str(save)) == [1]
    with open(save / 'm-0001.json') as handle:
        meta = json.load(handle)
    assert (meta['epoch'], meta['rank'], meta['num_workers']) == (1, 0, 2)
    # Worker 1 may have died during its own save: whatever it left, nothing half counts.
    assert _checkpoint_files_consistent(str(save / 'rank1')) in ([], [1])

    # The params load into the same network (FP32) and it runs.
    import mxnet as mx
    from gluoncv.model_zoo import get_model
    net = get_model('cifar_resnet20_v1', classes=10)
    net.load_parameters(str(save / meta['params']), ctx=mx.cpu())
    assert net(mx.nd.zeros((2, 1, 8, 8))).shape == (2, 10)

    # Worker 1 was killed during its epoch-1 save or just after it: make it the former
    # (its copy without the commit), the case where it must use worker 0's copy.
    if os.path.exists(save / 'rank1' / 'm-0001.json'):
        os.remove(save / 'rank1' / 'm-0001.json')

    # The same 2-worker launch with --resume continues from epoch 1 on both workers.
    # The run's length is a setting of its cosine schedule: the same 8 epochs, stopped at 2.
    with _Launch(tmp_path / 'resume', 2, _train_command(digits_dir, save, '--num-epochs', '8',
                                                        '--stop-at-epoch', '2',
                                                        '--resume')) as launch:
        pids = launch.wait_pids()
        status = launch.wait(JOB_TIMEOUT + 30)
        assert status == 0, launch.output() + launch.logs()
    _assert_nothing_left(pids)
    for log in (save / 'train.log', save / 'rank1' / 'train.log'):
        with open(log) as handle:
            text = handle.read()
        assert 'resumed from %s (epoch 1, step 4)' % (save / 'm-0001.json') in text, text
    assert _checkpoint_files_consistent(str(save)) == [1, 2]
    assert _checkpoint_files_consistent(str(save / 'rank1'))[-1] == 2
    with open(save / 'm-0002.params', 'rb') as a, open(save / 'rank1' / 'm-0002.params',
                                                         'rb') as b:
        assert a.read() == b.read()
    rows = report.read_metrics(str(save / 'm-metrics.csv'))
    assert [r['epoch'] for r in rows] == [1, 2]
    # The resumed run removed what the killed run had left half-written.
    assert not [n for n in os.listdir(str(save / 'rank1')) if '.tmp' in n]


# --------------------------------------------------------------------------------------
# The server or the scheduler killed mid-run

_PUSHPULL_WORKER = '''
import os, sys, time
import mxnet as mx
kv = mx.kv.create("dist_sync")
value = mx.nd.ones((4,))
kv.init(0, value)
kv.pushpull(0, value, out=value)
value.wait_to_read()
open(os.path.join(sys.argv[1], "ready%d" % kv.rank), "w").close()
while True:
    value[:] = 1
    kv.pushpull(0, value, out=value)
    value.wait_to_read()
    time.sleep(0.02)
'''


@pytest.mark.slow
@pytest.mark.parametrize('victim, label', [('server0', 'server 0'),
                                           ('scheduler', 'scheduler')])
def test_killed_service_stops_job(tmp_path, victim, label):
    """kill -9 the server (or scheduler) while 2 workers push and pull: report, stop all."""
    ready = tmp_path / 'ready'
    ready.mkdir()
    with _Launch(tmp_path, 2, [sys.executable, '-c', _PUSHPULL_WORKER, str(ready)]) as launch:
        pids = launch.wait_pids()
        _wait_for(lambda: len(os.listdir(str(ready))) == 2, 120, launch, 'both workers ready')
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.time()
        status = launch.wait(EXIT_BOUND)
        elapsed = time.time() - killed
        output = launch.output()
        print('kill -9 %s -> launcher exit: %.2f s' % (victim, elapsed))
    assert status == 128 + signal.SIGKILL, output + launch.logs()
    lines = [line for line in output.splitlines() if 'killed by signal' in line]
    assert lines == ['launch_local.py: %s (pid %d) was killed by signal 9 (SIGKILL) while 2 '
                     'worker(s) were running; stopping the job' % (label, pids[victim])], output
    _assert_nothing_left(pids)


# --------------------------------------------------------------------------------------
# The scheduler and the server gone, the workers running on

_FINALISED_WORKER = '''
import os, sys, time
import mxnet as mx
kv = mx.kv.create("dist_sync")
rank = kv.rank
value = mx.nd.ones((4,))
kv.init(0, value)
kv.pushpull(0, value, out=value)
value.wait_to_read()
del kv          # finalises ps-lite: once both workers did, the scheduler and server exit 0
open(os.path.join(sys.argv[1], "finalised%d" % rank), "w").close()
time.sleep(120)     # hung in its own shutdown, as far as the launcher can tell
'''


@pytest.mark.slow
def test_workers_running_on_after_services_exited_are_stopped_after_grace(tmp_path):
    """Scheduler and server exit 0 while both workers run on: --service-grace later
    the launcher names the exited process and the workers, stops them, exits 1."""
    grace = 3
    finalised = tmp_path / 'finalised'
    finalised.mkdir()
    with _Launch(tmp_path, 2, [sys.executable, '-c', _FINALISED_WORKER, str(finalised)],
                 options=['--service-grace', str(grace)]) as launch:
        pids = launch.wait_pids()
        _wait_for(lambda: len(os.listdir(str(finalised))) == 2, 120, launch,
                  'both workers finalised')
        since = time.time()
        status = launch.wait(EXIT_BOUND)
        elapsed = time.time() - since
        output = launch.output()
        print('workers finalised -> launcher exit: %.2f s' % elapsed)
    assert status == 1, output + launch.logs()
    # The grace counts from the first service exit, which follows the finalisation
    # that both workers passed (give the launcher's 0.1 s polling some slack).
    assert grace - 1 < elapsed < EXIT_BOUND, output
    # Both services have exited by then; the scheduler is named first.
    lines = [line for line in output.splitlines() if 'exited with status 0' in line]
    assert lines == ['launch_local.py: scheduler (pid %d) exited with status 0 but worker(s) '
                     '0, 1 still run %d s later; stopping the job' % (pids['scheduler'], grace)
                     ], output
    stopped = [line for line in output.splitlines() if line.startswith('launch_local.py: stopped')]
    assert stopped == ['launch_local.py: stopped worker 0 (rank 0, pid %d), worker 1 (rank 1, '
                       'pid %d)' % (pids['worker0'], pids['worker1'])], output
    _assert_nothing_left(pids)


def test_service_grace_defaults_to_30_s(monkeypatch):
    calls = []
    monkeypatch.setattr(launch_local, 'launch', lambda *args, **kwargs: calls.append(kwargs))
    launch_local.main(['-n', '1', '--', 'true'])
    launch_local.main(['-n', '1', '--service-grace', '0.5', '--', 'true'])
    assert [call['service_grace'] for call in calls] == [30.0, 0.5]


# --------------------------------------------------------------------------------------
# kill -9 at every step of a checkpoint save

class _ChunkRunner(object):
    """Writes its files in chunks, flushed: a kill between chunks leaves a partial file."""

    def __init__(self, tag, tick):
        self.tag, self.tick = tag, tick

    def save(self, params_file, states_file):
        for path, kind in ((params_file, b'params'), (states_file, b'states')):
            with open(path, 'wb') as handle:
                for _ in range(3):
                    handle.write(self.tag + kind * 1000)
                    handle.flush()
                    self.tick()


def _content(tag, kind):
    return (tag + kind * 1000) * 3


def _save_and_die(directory, epoch, tag, kill_at, count_file):
    """Fork; the child saves a checkpoint and SIGKILLs itself before step `kill_at`.

    Steps: each chunk written, each ``os.fsync``, ``os.replace`` and ``os.remove``.
    Returns the child's wait status.  A child that finishes writes its step count.
    """
    pid = os.fork()
    if pid == 0:      # the child: no return, no clean-up handlers
        try:
            steps = [0]

            def tick():
                steps[0] += 1
                if steps[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            def wrap(function):
                def wrapped(*args, **kwargs):
                    tick()
                    return function(*args, **kwargs)
                return wrapped
            os.fsync, os.replace, os.remove = (wrap(os.fsync), wrap(os.replace),
                                               wrap(os.remove))
            checkpoints.save_checkpoint(_ChunkRunner(tag, tick), directory, 'm', epoch,
                                           {'global_step': epoch * 10})
            with open(count_file, 'w') as handle:
                handle.write(str(steps[0]))
            os._exit(0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return status


def _snapshot(directory):
    return {name: open(os.path.join(directory, name), 'rb').read()
            for name in os.listdir(directory)}


@pytest.mark.parametrize('existing', ['fresh', 'overwrite'])
def test_kill_9_at_every_step_of_a_save(tmp_path, existing):
    """Killed anywhere in a save: epoch 1 stays intact; epoch 2 counts only when whole.

    'overwrite': an older epoch-2 checkpoint exists (a run resumed from epoch 1
    saves epoch 2 again): a kill never leaves an epoch 2 mixing old and new files.
    """
    outcomes, uncommitted = [], 0
    for kill_at in range(1, 60):
        directory = str(tmp_path / ('k%02d' % kill_at))
        os.makedirs(directory)
        checkpoints.save_checkpoint(_ChunkRunner(b'one', lambda: None), directory, 'm', 1,
                                       {'global_step': 10})
        if existing == 'overwrite':
            checkpoints.save_checkpoint(_ChunkRunner(b'old', lambda: None), directory, 'm',
                                           2, {'global_step': 20})
        before = _snapshot(directory)
        count_file = str(tmp_path / 'count')
        status = _save_and_die(directory, 2, b'new', kill_at, count_file)
        finished = os.WIFEXITED(status)
        assert finished and os.WEXITSTATUS(status) == 0 or \
            os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status

        # Epoch 1 is untouched and loadable.
        for name in ('m-0001.params', 'm-0001.states', 'm-0001.json'):
            assert _snapshot(directory)[name] == before[name]
        epochs = checkpoints.list_checkpoints(directory, 'm')
        assert epochs in ([1], [1, 2])
        if 2 in epochs:
            with open(os.path.join(directory, 'm-0002.json')) as handle:
                meta = json.load(handle)
            tags = set()
            for key, kind in (('params', b'params'), ('states', b'states')):
                with open(os.path.join(directory, meta[key]), 'rb') as handle:
                    data = handle.read()
                tag = data[:3]
                assert data == _content(tag, kind), 'partial %s' % meta[key]
                tags.add(tag)
            assert len(tags) == 1, 'epoch 2 mixes two saves: %s' % tags
            assert meta['epoch'] == 2 and meta['global_step'] == 20
            outcome = tags.pop().decode()
        else:
            outcome = 'none'
            # Files under their final names but no JSON yet: not a checkpoint.
            params = os.path.join(directory, 'm-0002.params')
            if os.path.exists(params) and open(params, 'rb').read()[:3] == b'new':
                uncommitted += 1
        outcomes.append(outcome)

        # What the killed process left behind is removable and never counted.
        checkpoints.remove_stale_tmp(directory, 'm')
        assert not [n for n in os.listdir(directory) if '.tmp' in n]
        assert checkpoints.list_checkpoints(directory, 'm') == epochs
        if finished:
            with open(count_file) as handle:
                assert kill_at > int(handle.read())
            break
    else:
        pytest.fail('the save never finished')
    # The sweep went through the whole save: before the commit (the JSON's rename)
    # the previous state stands, from it on the new checkpoint; nothing in between.
    assert outcomes[-1] == 'new'
    first_new = outcomes.index('new')
    assert all(o == 'new' for o in outcomes[first_new:])
    earlier = set(outcomes[:first_new])
    assert earlier == ({'none'} if existing == 'fresh' else {'old', 'none'}), outcomes
    assert len(outcomes) > 10 and uncommitted >= 2


# --------------------------------------------------------------------------------------
# The launcher itself killed

@pytest.mark.slow
def test_killed_launcher_takes_its_job_along(tmp_path):
    """kill -9 the launcher: its scheduler, server and workers die with it (Linux)."""
    if not sys.platform.startswith('linux'):
        pytest.skip('PR_SET_PDEATHSIG is Linux only')
    with _Launch(tmp_path, 2, [sys.executable, '-c', 'import time; time.sleep(120)']) as launch:
        pids = launch.wait_pids()
        os.kill(pids['launcher'], signal.SIGKILL)
        launch.wait(EXIT_BOUND)
        end = time.time() + 20
        children = [pid for name, pid in pids.items() if name not in ('launcher', 'root_port')]
        while any(_alive(pid) for pid in children) and time.time() < end:
            time.sleep(0.05)
        _assert_nothing_left(pids)


# --------------------------------------------------------------------------------------
# A real training process killed during a save, then resumed

_DIE_AT_SAVE = '''
import os, signal, sys
sys.path.insert(0, %r)
import train_imagenet
replace = os.replace


def replace_or_die(source, target):
    if target.endswith(sys.argv[1]):     # both files of the save written, none committed
        os.kill(os.getpid(), signal.SIGKILL)
    return replace(source, target)
os.replace = replace_or_die
sys.exit(train_imagenet.main(sys.argv[2:]))
''' % SCRIPTS


def _single(digits_dir, save_dir, *extra):
    return ['--model', 'cifar_resnet20_v1', '--dtype', 'bfloat16', '--num-epochs', '2',
            '--max-batches', '3', '--dataset', 'digits', '--data-dir', digits_dir,
            '--save-dir', str(save_dir), '--batch-size', '32', '--lr', '0.1',
            '--warmup-epochs', '1', '--no-progress', '--save-prefix', 'm'] + list(extra)


@pytest.mark.slow
def test_resume_after_kill_9_during_save_is_bit_exact(digits_dir, tmp_path):
    """A run SIGKILLed while saving epoch 2, resumed, ends with an uninterrupted run's bytes."""
    whole, killed = tmp_path / 'whole', tmp_path / 'killed'
    result = subprocess.run([sys.executable, '-c', _DIE_AT_SAVE, 'm-0002.params']
                            + _single(digits_dir, killed), capture_output=True, text=True,
                            timeout=180, cwd=ROOT)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert checkpoints.list_checkpoints(str(killed), 'm') == [1]
    left = sorted(n for n in os.listdir(str(killed)) if '.tmp' in n)
    assert [n.split('.tmp')[0] for n in left] == ['m-0002.params', 'm-0002.states'], left

    assert train_imagenet.main(_single(digits_dir, whole)) == 0
    assert train_imagenet.main(_single(digits_dir, killed, '--resume')) == 0
    with open(killed / 'train.log') as handle:
        log = handle.read()
    assert 'removed 2 temporary file(s) of an interrupted run' in log
    assert 'resumed from %s (epoch 1, step 3)' % (killed / 'm-0001.json') in log
    assert not [n for n in os.listdir(str(killed)) if '.tmp' in n]
    for suffix in ('params', 'states'):
        with open(whole / ('m-0002.' + suffix), 'rb') as a, \
                open(killed / ('m-0002.' + suffix), 'rb') as b:
            assert a.read() == b.read(), suffix
    rows = [report.read_metrics(str(d / 'm-metrics.csv')) for d in (whole, killed)]
    assert [(r['epoch'], r['train_loss'], r['val_top1']) for r in rows[0]] == \
        [(r['epoch'], r['train_loss'], r['val_top1']) for r in rows[1]]
