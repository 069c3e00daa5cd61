"""``mxamp convert`` names a bad path for what it is, and leaves nothing partial behind.

The vocabulary of ``--dtype``, ``--input-shape`` checks, a directory given as an
input and the bfloat16 note are in ``test_cli_words.py``; here are the outputs
(a directory in the way, a directory that takes no files), the inputs that
exist but are not files, and the one line of an internal error from MXNet.
"""
import os

import mxnet as mx
import pytest

from mxamp import cli

from test_cli import convert


def leftovers(directory, prefix):
    """Files in `directory` that a conversion to `prefix` left: outputs or temporary files."""
    return sorted(name for name in os.listdir(str(directory))
                  if name.startswith((prefix, '.mxamp-'))
                  and not os.path.isdir(os.path.join(str(directory), name)))


@pytest.mark.parametrize('taken', ['symbol.json', '0000.params'])
def test_an_output_that_is_a_directory_is_refused_before_anything_is_written(model, tmp_path, capsys,
                                                                              taken):
    out = str(tmp_path / 'out')
    os.mkdir('%s-%s' % (out, taken))
    status, stdout, err = convert(capsys, model + '-symbol.json', '--params', model + '-0000.params',
                                  '-o', out, '--dtype', 'float16')
    assert status == 2
    assert err == "mxamp: error: output '%s-%s' is a directory\n" % (out, taken)
    # Before, the symbol file was renamed into place before the params rename failed.
    assert leftovers(tmp_path, 'out') == [] and stdout == ''


@pytest.mark.skipif(not os.path.isdir('/sys/kernel'), reason='needs Linux sysfs')
def test_an_output_directory_that_takes_no_files_is_one_line_naming_the_output(model, capsys):
    # sysfs refuses new files even to root, so this fails on any Linux machine.
    status, stdout, err = convert(capsys, model + '-symbol.json', '--params', model + '-0000.params',
                                  '-o', '/sys/kernel/out', '--dtype', 'float16')
    assert status == 2, err
    assert err.startswith("mxamp: error: cannot write '/sys/kernel/out-symbol.json': ") \
        and err.count('\n') == 1, err
    assert '.mxamp-' not in err and 'internal error' not in err and stdout == ''


@pytest.mark.parametrize('which', ['symbol', 'params'])
def test_an_input_that_exists_but_is_not_a_file_is_not_called_missing(model, tmp_path, capsys, which):
    argv = [os.devnull if which == 'symbol' else model + '-symbol.json',
            '-o', str(tmp_path / 'out'), '--dtype', 'float16']
    if which == 'params':
        argv += ['--params', os.devnull]
    status, _, err = convert(capsys, *argv)
    assert status == 2
    assert err == "mxamp: error: %s file '%s' is not a regular file\n" % (which, os.devnull)
    assert leftovers(tmp_path, 'out') == []


def test_an_internal_error_from_mxnet_prints_its_message_not_traceback(model, tmp_path, capsys,
                                                                       monkeypatch):
    def fails(args):
        raise mx.base.MXNetError('Traceback (most recent call last):\n'
                                 '  File "../src/operator/nn/convolution.cc", line 151\n'
                                 'MXNetError: Check failed: something mxamp got wrong')
    monkeypatch.setattr(cli, '_convert', fails)
    status, _, err = convert(capsys, model + '-symbol.json', '-o', str(tmp_path / 'out'),
                             '--dtype', 'float16')
    assert status == cli.EXIT_INTERNAL_ERROR
    assert err == ('mxamp: internal error (please report): MXNetError: '
                   'Check failed: something mxamp got wrong\n')
