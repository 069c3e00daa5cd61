"""Every example in mxamp's docstrings (``>>>``) runs as written."""
import doctest
import importlib
import pkgutil

import numpy as np
import pytest

import mxnet as mx

import mxamp

MODULES = sorted(m.name for m in pkgutil.iter_modules(mxamp.__path__) if m.name != '__main__')
# Modules of an optional extra: their examples need its library.
OPTIONAL = {'gluonts': 'gluonts'}


def _examples(module_name):
    if module_name in OPTIONAL:
        pytest.importorskip(OPTIONAL[module_name], reason='mxamp.%s needs %s (the test extra '
                            'installs it on Python 3.10 and 3.11)' % (module_name, OPTIONAL[module_name]))
    module = importlib.import_module('mxamp.' + module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [test for test in finder.find(module, extraglobs={'mx': mx, 'mxamp': mxamp, 'np': np})
            if test.examples]


def test_the_package_has_examples():
    assert sum(len(_examples(name)) for name in MODULES if name not in OPTIONAL) >= 5


@pytest.mark.parametrize('module_name', MODULES)
def test_docstring_examples_run(module_name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)     # examples that save files write them here
    failures = []
    for test in _examples(module_name):
        report = []
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test, out=report.append)
        if runner.failures:
            failures.append(''.join(report))
    assert not failures, '\n'.join(failures)
