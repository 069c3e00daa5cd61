"""The code has no unused imports or variables and no undefined names (pyflakes)."""
import os

import pyflakes.api
import pyflakes.reporter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKED = ('mxamp', 'scripts', 'symbols', 'tests')


class _Collect(pyflakes.reporter.Reporter):
    def __init__(self):
        self.lines = []

    def unexpectedError(self, filename, message):
        self.lines.append('%s: %s' % (filename, message))

    def syntaxError(self, filename, message, lineno, offset, text):
        self.lines.append('%s:%s: %s' % (filename, lineno, message))

    def flake(self, message):
        self.lines.append(str(message))


def test_pyflakes_finds_nothing():
    reporter = _Collect()
    pyflakes.api.checkRecursive([os.path.join(ROOT, d) for d in CHECKED], reporter)
    assert not reporter.lines, '\n'.join(reporter.lines)
