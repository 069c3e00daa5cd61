"""Start-up hook: numpy's ``bool``, ``int`` and ``float`` aliases, back before MXNet 1.9.1 is imported.

MXNet 1.9.1 uses ``numpy.bool`` (at import and at run time) and ``numpy.int``;
gluoncv 0.10.5 uses ``numpy.float`` and ``numpy.int``.  numpy 1.24 removed these
aliases of the builtins, and the oldest numpy with Python 3.12 wheels is 1.26, so
on Python 3.12 ``import mxnet`` fails with an AttributeError unless they are put
back first.  mxamp's setup.py installs this module beside a ``.pth`` file that
imports it at every interpreter start, so the order holds whoever imports
``mxnet`` first: a user's script, a test, ``python -c 'import mxnet'`` (the
kvstore servers of scripts/launch_local.py).

At start it only puts a finder first in ``sys.meta_path`` (numpy is not imported
then); the finder acts when ``mxnet`` is about to be imported.  With numpy < 1.24
(Python 3.8 to 3.11) it changes nothing.
"""
import sys

_ALIASES = {'bool': bool, 'int': int, 'float': float}


def restore(numpy):
    """Put back the aliases that numpy >= 1.24 no longer has, as numpy 1.23 had them (the builtins)."""
    major, minor = (int(part) for part in numpy.__version__.split('.')[:2])
    if (major, minor) < (1, 24):
        return
    for name, builtin in _ALIASES.items():
        if name not in vars(numpy):  # numpy 2 has its own numpy.bool: keep it
            setattr(numpy, name, builtin)


class _BeforeMXNet:
    """Meta-path finder that finds nothing: it restores the aliases when ``mxnet`` is looked up."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == 'mxnet' and 'mxnet' not in sys.modules:
            try:
                import numpy
            except ImportError:  # then `import mxnet` says what is missing
                return None
            restore(numpy)
        return None


if not any(isinstance(finder, _BeforeMXNet) for finder in sys.meta_path):
    sys.meta_path.insert(0, _BeforeMXNet())
