"""Files mxamp writes are ordinary files: the permissions the user's umask gives any new file.

``tempfile.mkstemp`` creates 0600 files; a converted model written that way
could not be read by a serving container or another user.
"""
import os
import stat
import subprocess
import sys

import mxnet as mx
import pytest

from mxamp import symbol as symbol_mod


def small_model():
    data = mx.sym.var('data')
    out = mx.sym.FullyConnected(data, num_hidden=3, name='fc')
    args = {'fc_weight': mx.nd.ones((3, 4)), 'fc_bias': mx.nd.zeros((3,))}
    return out, args


def mode_of(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize('umask', [0o022, 0o027, 0o002])
def test_save_model_gives_the_umask_permissions(tmp_path, umask):
    sym, args = small_model()
    old = os.umask(umask)
    try:
        written = symbol_mod.save_model(str(tmp_path / 'model'), sym, args, {})
    finally:
        os.umask(old)
    assert sorted(os.path.basename(p) for p in written) == ['model-0000.params', 'model-symbol.json']
    for path in written:
        assert mode_of(path) == 0o666 & ~umask, (path, oct(mode_of(path)))
    assert sorted(os.listdir(tmp_path)) == ['model-0000.params', 'model-symbol.json']  # no leftovers


def test_the_command_line_tool_writes_ordinary_files(tmp_path):
    sym, args = small_model()
    sym.save(str(tmp_path / 'in-symbol.json'))
    mx.nd.save(str(tmp_path / 'in-0000.params'), {'arg:' + k: v for k, v in args.items()})
    result = subprocess.run(
        ['sh', '-c', 'umask 022 && exec "$0" -m mxamp convert "$1" --params "$2" -o "$3" '
         '--dtype float16', sys.executable, str(tmp_path / 'in-symbol.json'),
         str(tmp_path / 'in-0000.params'), str(tmp_path / 'out')],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ('out-symbol.json', 'out-0000.params'):
        assert mode_of(tmp_path / name) == 0o644, name
