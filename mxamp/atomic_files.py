"""Files written whole or not at all.

A checkpoint that a crash, a full disk or Ctrl-C interrupts half-way must not
replace the last good one: every file mxamp writes for training state (Gluon
parameters of a converted net, trainer states, Module checkpoints) is written
to a temporary file beside its destination and renamed over it only once
complete (``os.replace``, atomic on POSIX and Windows within one file system).
The result is an ordinary file, with the permissions a plain ``open`` gives.
"""
import contextlib
import os
from typing import Iterator

__all__ = ['replaced_on_success']


@contextlib.contextmanager
def replaced_on_success(path: str) -> Iterator[str]:
    """Yield a temporary path beside `path`; on success it replaces `path`, on error it goes.

    Examples
    --------
    >>> import os, tempfile
    >>> target = os.path.join(tempfile.mkdtemp(), 'net.params')
    >>> with replaced_on_success(target) as temporary:
    ...     with open(temporary, 'w') as handle:
    ...         _ = handle.write('complete')
    >>> open(target).read()
    'complete'
    """
    directory, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(directory, '.%s.mxamp-%d.tmp' % (name, os.getpid()))
    try:
        yield temporary
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
