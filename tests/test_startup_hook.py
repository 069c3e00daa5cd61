"""The start-up hook installed with mxamp (_mxamp_numpy_aliases.py + its .pth): on Python 3.12 (numpy 1.26)
it is what lets ``import mxnet`` work, whoever imports it first."""
import subprocess
import sys
import types

import _mxamp_numpy_aliases


def _run(code):
    result = subprocess.run([sys.executable, '-c', code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True, timeout=300)
    assert result.returncode == 0, result.stdout
    return result.stdout.split()


def test_the_pth_loads_the_hook_at_start_without_numpy():
    assert _run("import sys; print('_mxamp_numpy_aliases' in sys.modules, 'numpy' in sys.modules)") == \
        ['True', 'False']


def test_mxnet_imported_first_has_numpys_aliases():
    # as the kvstore servers of scripts/launch_local.py do: `import mxnet`, nothing before it
    # (mxnet.numpy's boolean indexing uses numpy.bool at run time too)
    out = _run("import mxnet\n"
               "a = mxnet.numpy.array([1, 2, 3])\n"
               "print(a[a > 1].asnumpy().tolist())")
    assert out == ['[2.0,', '3.0]']


def test_restore_puts_back_only_what_numpy_removed():
    numpy_126 = types.SimpleNamespace(__version__='1.26.4')
    _mxamp_numpy_aliases.restore(numpy_126)
    assert (numpy_126.bool, numpy_126.int, numpy_126.float) == (bool, int, float)

    numpy_123 = types.SimpleNamespace(__version__='1.23.5')  # still has them, with a DeprecationWarning
    _mxamp_numpy_aliases.restore(numpy_123)
    assert vars(numpy_123) == {'__version__': '1.23.5'}

    numpy_2 = types.SimpleNamespace(__version__='2.0.0', bool='numpy.bool')
    _mxamp_numpy_aliases.restore(numpy_2)
    assert numpy_2.bool == 'numpy.bool'
