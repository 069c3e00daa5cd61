"""Run a distributed-kvstore (ps-lite) job on this machine: scheduler, servers, N workers.

MXNet's bundled ``tools/launch.py --launcher local`` fails on Python 3.11
(``dmlc_tracker`` calls the removed ``Thread.isAlive``).  This launcher starts
the same processes directly, every one with ``DMLC_PS_ROOT_URI=127.0.0.1``, a
free port, ``DMLC_NODE_HOST=127.0.0.1`` (all traffic stays on the loopback
interface), ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER`` and its ``DMLC_ROLE``.
The scheduler and the servers run ``python -c 'import mxnet'`` (importing MXNet
with those roles runs the ps-lite loop); the workers run the given command.

It is bounded and cleans up: every child runs in its own process group, and
all of them are killed when a worker fails, when ``--timeout`` expires, on
Ctrl-C/SIGTERM, or when the launcher exits for any other reason.  The exit
status is 0 when every worker succeeded, else the first failing worker's
status (124 on timeout, 130 on Ctrl-C).

Usage::

    python scripts/launch_local.py -n 2 --timeout 600 -- \\
        python scripts/train_imagenet.py --kv-store dist_sync --dataset digits ...

Worker ``i``'s output goes to the launcher's stdout/stderr, or with
``--log-dir`` to ``worker<i>.log`` (and ``scheduler.log``, ``server<j>.log``).
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time

PROG = 'launch_local.py'
# How long the scheduler and servers get to shut down after the last worker.
_GRACE = 15.0


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


class Job(object):
    """The processes of one launch; :meth:`kill` ends every one still running."""

    def __init__(self, log_dir=None):
        self.procs = []        # (name, Popen)
        self.log_dir = log_dir
        self._files = []

    def start(self, name, command, env):
        out = None
        if self.log_dir:
            out = open(os.path.join(self.log_dir, name + '.log'), 'wb')
            self._files.append(out)
        # Own session and process group: a kill reaches the child's children too.
        proc = subprocess.Popen(command, env=env, stdout=out,
                                stderr=subprocess.STDOUT if out else None,
                                start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def kill(self):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for _, p in self.procs if p.poll() is None]
            for proc in alive:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 5
            while alive and time.time() < deadline:
                alive = [p for p in alive if p.poll() is None]
                time.sleep(0.05)
            if not alive:
                break
        for handle in self._files:
            handle.close()
        self._files = []


def launch(command, num_workers, num_servers=1, timeout=None, log_dir=None, env=None):
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

    Returns
    -------
    int
        0, the first failing worker's exit status, or 124 on timeout.
    """
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    base = dict(os.environ if env is None else env)
    base.update({'DMLC_PS_ROOT_URI': '127.0.0.1', 'DMLC_PS_ROOT_PORT': str(free_port()),
                 'DMLC_NODE_HOST': '127.0.0.1', 'DMLC_NUM_SERVER': str(num_servers),
                 'DMLC_NUM_WORKER': str(num_workers)})
    service = [sys.executable, '-c', 'import mxnet']
    job = Job(log_dir)

    def on_signal(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        job.start('scheduler', service, dict(base, DMLC_ROLE='scheduler'))
        for j in range(num_servers):
            job.start('server%d' % j, service, dict(base, DMLC_ROLE='server'))
        workers = [job.start('worker%d' % i, command,
                             dict(base, DMLC_ROLE='worker'))
                   for i in range(num_workers)]
        deadline = None if timeout is None else time.time() + timeout
        status = None
        while status is None:
            codes = [w.poll() for w in workers]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                status = failed[0]
                print('%s: a worker exited with status %d; stopping the job'
                      % (PROG, status), file=sys.stderr)
            elif all(c == 0 for c in codes):
                status = 0
            elif deadline is not None and time.time() > deadline:
                status = 124
                print('%s: timed out after %g s; stopping the job' % (PROG, timeout),
                      file=sys.stderr)
            else:
                time.sleep(0.1)
        if status == 0:
            # The scheduler and servers leave once the workers have finalised.
            end = time.time() + _GRACE
            while time.time() < end and any(p.poll() is None for _, p in job.procs):
                time.sleep(0.1)
        return status
    except KeyboardInterrupt:
        print('%s: interrupted; stopping the job' % PROG, file=sys.stderr)
        return 130
    finally:
        job.kill()
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
    args = parser.parse_args(own)
    if not command:
        parser.error('no worker command: put it after --')
    if args.num_workers < 1 or args.num_servers < 1:
        parser.error('--num-workers and --num-servers must be at least 1')
    return launch(command, args.num_workers, args.num_servers, args.timeout, args.log_dir)


if __name__ == '__main__':
    sys.exit(main())
