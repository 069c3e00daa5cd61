"""The package's type hints agree with its code: mypy finds no error in ``mxamp/``.

Runs ``python -m mypy`` (this interpreter's, from the repository root) with the
``[mypy]`` section of ``setup.cfg``: the annotated public API and the functions
modules call across module boundaries, their bodies included; unannotated
private helpers are not checked inside.  MXNet and gluoncv ship no types, so
their objects are ``Any`` to the checker.  mypy is a test dependency (the
``test`` extra), not an optional one: without it this test fails.
"""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, 'setup.cfg')


def test_mypy_finds_nothing():
    if importlib.util.find_spec('mypy') is None:
        pytest.fail("mypy is not installed for %s; it is a test dependency: install the test "
                    "extra, pip install -c constraints.txt -e '.[test]' (or: make test)"
                    % sys.executable)
    result = subprocess.run([sys.executable, '-m', 'mypy', '--config-file', CONFIG],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True, timeout=300)
    assert result.returncode == 0, 'mypy (exit status %d):\n%s' % (result.returncode,
                                                                  result.stdout)
