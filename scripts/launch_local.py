"""Run a distributed-kvstore (ps-lite) job on this machine: scheduler, servers, N workers.

MXNet's bundled ``tools/launch.py --launcher local`` fails on Python 3.11
(``dmlc_tracker`` calls the removed ``Thread.isAlive``).  This launcher starts
the same processes directly, every one with ``DMLC_PS_ROOT_URI=127.0.0.1``, a
free port, ``DMLC_NODE_HOST=127.0.0.1`` (all traffic stays on the loopback
interface), ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER`` and its ``DMLC_ROLE``.
The scheduler and the servers run ``python -c 'import mxnet'`` (importing MXNet
with those roles runs the ps-lite loop); the workers run the given command.
Worker ``i`` is the kvstore's rank ``i``: ps-lite numbers the nodes of a host
by their port, so every node gets its own port (``PORT``), in ascending order.

It watches every process and is bounded.  A job ends when

- every worker has exited with status 0 (exit status 0);
- a worker fails: exits non-zero or is killed by a signal (a worker that dies
  leaves the others blocked for ever in a push, pull or barrier of ps-lite);
- the scheduler or a server dies, or exits with status 0 while workers still
  run and they do not all finish within ``--service-grace`` seconds of the
  first such exit (default 30; status 1);
- ``--timeout`` expires (status 124), or Ctrl-C/SIGTERM (status 130).

A failure is reported as one line on stderr naming the process, its kvstore
rank, its pid and its exit status or signal, e.g.::

    launch_local.py: worker 1 (rank 1, pid 4242) was killed by signal 9 (SIGKILL); stopping the job

and then every process still running is stopped (SIGTERM to its process
group, SIGKILL 5 s later) and named in a last line (``launch_local.py:
stopped worker 0 (rank 0, pid 4241), scheduler (pid 4239), ...``).  The exit
status is the failing process's exit status, or 128 + N if signal N killed it
(as a shell reports it).  Every child runs in its own process group and, on
Linux, is also killed if the launcher itself is killed (``PR_SET_PDEATHSIG``).

At start the launcher prints one line per process (``launch_local.py: worker 1
(rank 1) pid 4242``) and, with ``--pid-file``, writes the pids as JSON
(``{"launcher": ..., "root_port": ..., "scheduler": ..., "server0": ...,
"worker0": ..., ...}``), written atomically once every process has started.

Usage::

    python scripts/launch_local.py -n 2 --timeout 600 -- \\
        python scripts/train_imagenet.py --kv-store dist_sync --dataset digits \\
        --model cifar_resnet20_v1 --num-epochs 3 --save-dir runs/dist_digits

Worker ``i``'s output goes to the launcher's stdout/stderr, or with
``--log-dir`` to ``worker<i>.log`` (and ``scheduler.log``, ``server<j>.log``).
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

PROG = 'launch_local.py'
# How long the scheduler and servers get to shut down after the last worker.
_GRACE = 15.0
# How long workers may run on after the scheduler or a server exited with status 0
# (the default of --service-grace).  ps-lite's scheduler and servers leave once every
# worker has finalised its kvstore, so a worker still running this long after is
# hung in its own shutdown (or never uses the kvstore again); without this bound it
# would only end with --timeout.
SERVICE_GRACE = 30.0
# Between SIGTERM and SIGKILL when stopping a process group.
_KILL_WAIT = 5.0


def free_ports(count):
    """`count` distinct TCP ports on 127.0.0.1 that were free a moment ago, ascending."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(('127.0.0.1', 0))
        return sorted(sock.getsockname()[1] for sock in socks)
    finally:
        for sock in socks:
            sock.close()


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


def _prctl():
    """libc's prctl, resolved here (never in a forked child), or None off Linux."""
    if not sys.platform.startswith('linux'):
        return None
    try:
        import ctypes
        function = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    return function


_PRCTL = _prctl()
_PR_SET_PDEATHSIG = 1


def _dies_with(parent):
    """A ``preexec_fn``: the child gets SIGKILL when `parent` (the launcher) dies.

    It only calls the prctl resolved at import: safe in the child of a process
    with threads (no import, no allocation by Python code of its own).
    """
    kill = int(signal.SIGKILL)

    def setup():
        _PRCTL(_PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != parent:      # the launcher died before the prctl
            os.kill(os.getpid(), kill)
    return setup


def describe_status(code):
    """'exited with status 3' / 'was killed by signal 9 (SIGKILL)' for a Popen returncode."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = 'unknown'
        return 'was killed by signal %d (%s)' % (-code, name)
    return 'exited with status %s' % code


def exit_status(code):
    """A Popen returncode as a shell reports it: 128 + N for signal N."""
    return 128 - code if code < 0 else code


class Job(object):
    """The processes of one launch; :meth:`kill` ends every one still running."""

    def __init__(self, log_dir=None):
        self.procs = []        # (name, Popen)
        self.labels = {}       # name -> how it is named in messages
        self.log_dir = log_dir
        self._files = []

    def start(self, name, command, env, label=None):
        out = None
        if self.log_dir:
            out = open(os.path.join(self.log_dir, name + '.log'), 'wb')
            self._files.append(out)
        # Own session and process group: a kill reaches the child's children too.
        proc = subprocess.Popen(command, env=env, stdout=out,
                                stderr=subprocess.STDOUT if out else None,
                                start_new_session=True,
                                preexec_fn=_dies_with(os.getpid()) if _PRCTL else None)
        self.procs.append((name, proc))
        self.labels[name] = label or name
        print('%s: %s pid %d' % (PROG, self.labels[name], proc.pid), file=sys.stderr,
              flush=True)
        return proc

    def describe(self, name, proc):
        """'worker 1 (rank 1, pid 42)'."""
        label = self.labels[name]
        if label.endswith(')'):
            return '%s, pid %d)' % (label[:-1], proc.pid)
        return '%s (pid %d)' % (label, proc.pid)

    def kill(self):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for _, p in self.procs if p.poll() is None]
            for proc in alive:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + _KILL_WAIT
            while alive and time.time() < deadline:
                alive = [p for p in alive if p.poll() is None]
                time.sleep(0.05)
            if not alive:
                break
        for handle in self._files:
            handle.close()
        self._files = []


def _write_pid_file(path, pids):
    tmp = '%s.tmp-%d' % (path, os.getpid())
    with open(tmp, 'w') as handle:
        json.dump(pids, handle, indent=1)
    os.replace(tmp, path)


def launch(command, num_workers, num_servers=1, timeout=None, log_dir=None, env=None,
           pid_file=None, service_grace=SERVICE_GRACE):
    """Run `command` as `num_workers` workers of a dist kvstore job on 127.0.0.1.

    Parameters
    ----------
    command : list of str
        The worker command line.
    num_workers, num_servers : int
    timeout : float, optional
        Seconds before everything is killed (exit status 124).
    log_dir : str, optional
        Directory for one log file per process (created if needed).
    env : dict, optional
        Base environment (default: this process's).
    pid_file : str, optional
        Write the pids of the launcher and of every process here (JSON) once all started.
    service_grace : float, default SERVICE_GRACE (30)
        Seconds the workers may run on after the scheduler or a server exited
        with status 0; then the job is stopped (exit status 1).

    Returns
    -------
    int
        0; the first failing process's exit status (128 + N for signal N; 1 for a
        scheduler or server that exited with 0 while workers hung); 124 on
        timeout; 130 on Ctrl-C or SIGTERM.
    """
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    ports = free_ports(1 + num_servers + num_workers)
    root_port, node_ports = ports[0], ports[1:]
    base = dict(os.environ if env is None else env)
    base.update({'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_PS_ROOT_PORT': str(root_port),
                 'DMLC_NODE_HOST': '127.0.0.1', 'DMLC_NUM_SERVER': str(num_servers),
                 'DMLC_NUM_WORKER': str(num_workers)})
    base.pop('PORT', None)
    service = [sys.executable, '-c', 'import mxnet']
    job = Job(log_dir)
    status = None

    def on_signal(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        services = [('scheduler', job.start('scheduler', service,
                                            dict(base, DMLC_ROLE='scheduler')))]
        for j in range(num_servers):
            services.append(('server%d' % j, job.start(
                'server%d' % j, service,
                dict(base, DMLC_ROLE='server', PORT=str(node_ports[j])),
                label='server %d' % j)))
        # Ascending ports: ps-lite gives worker i the rank i.
        workers = [('worker%d' % i, job.start(
            'worker%d' % i, command,
            dict(base, DMLC_ROLE='worker', PORT=str(node_ports[num_servers + i])),
            label='worker %d (rank %d)' % (i, i))) for i in range(num_workers)]
        if pid_file:
            pids = {'launcher': os.getpid(), 'root_port': root_port}
            pids.update((name, proc.pid) for name, proc in job.procs)
            _write_pid_file(pid_file, pids)
        deadline = None if timeout is None else time.time() + timeout
        service_exited = None      # when a scheduler/server first exited with status 0
        while status is None:
            codes = [w.poll() for _, w in workers]
            failed = [(name, w) for name, w in workers if w.returncode not in (None, 0)]
            broken = [(name, s) for name, s in services if s.poll() not in (None, 0)]
            if failed or broken:
                # A dead scheduler or server takes workers down, never the reverse.
                name, proc = (broken or failed)[0]
                status = exit_status(proc.returncode)
                running = [n for n, w in workers if w.poll() is None]
                print('%s: %s %s%s; stopping the job' % (
                    PROG, job.describe(name, proc), describe_status(proc.returncode),
                    ' while %d worker(s) were running' % len(running) if broken else ''),
                    file=sys.stderr, flush=True)
            elif all(c == 0 for c in codes):
                status = 0
            elif deadline is not None and time.time() > deadline:
                status = 124
                print('%s: timed out after %g s; stopping the job' % (PROG, timeout),
                      file=sys.stderr, flush=True)
            else:
                ended = [(n, s) for n, s in services if s.returncode == 0]
                if ended and service_exited is None:
                    service_exited = time.time()
                if ended and time.time() - service_exited > service_grace:
                    name, proc = ended[0]
                    status = 1
                    print('%s: %s exited with status 0 but worker(s) %s still run %g s '
                          'later; stopping the job' % (
                              PROG, job.describe(name, proc),
                              ', '.join(n[len('worker'):] for n, w in workers
                                        if w.poll() is None), service_grace),
                          file=sys.stderr, flush=True)
                else:
                    time.sleep(0.1)
        if status == 0:
            # The scheduler and servers leave once the workers have finalised.
            end = time.time() + _GRACE
            while time.time() < end and any(p.poll() is None for _, p in job.procs):
                time.sleep(0.1)
        return status
    except KeyboardInterrupt:
        print('%s: interrupted; stopping the job' % PROG, file=sys.stderr, flush=True)
        status = 130
        return status
    finally:
        running = [job.describe(n, p) for n, p in job.procs if p.poll() is None]
        job.kill()
        if running and status != 0:
            print('%s: stopped %s' % (PROG, ', '.join(running)), file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, previous)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if '--' in argv:
        split = argv.index('--')
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                     usage='%(prog)s -n N [options] -- COMMAND ...')
    parser.add_argument('-n', '--num-workers', type=int, required=True)
    parser.add_argument('-s', '--num-servers', type=int, default=1)
    parser.add_argument('--timeout', type=float, default=None,
                        help='seconds before the whole job is killed (exit status 124)')
    parser.add_argument('--log-dir', default=None, help='one log file per process here')
    parser.add_argument('--pid-file', default=None,
                        help='write the pids of every process here (JSON) once all started')
    parser.add_argument('--service-grace', type=float, default=SERVICE_GRACE,
                        help='seconds workers may run on after the scheduler or a server '
                             'exited with status 0 before the job is stopped (exit status 1; '
                             'default %(default)g)')
    args = parser.parse_args(own)
    if not command:
        parser.error('no worker command: put it after --')
    if args.num_workers < 1 or args.num_servers < 1:
        parser.error('--num-workers and --num-servers must be at least 1')
    if args.service_grace < 0:
        parser.error('--service-grace must be at least 0')
    return launch(command, args.num_workers, args.num_servers, args.timeout, args.log_dir,
                  pid_file=args.pid_file, service_grace=args.service_grace)


if __name__ == '__main__':
    sys.exit(main())
