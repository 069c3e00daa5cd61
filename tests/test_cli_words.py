"""``mxamp convert`` speaks the Python API's vocabulary and says what is wrong in one line."""
import json
import os
import warnings

import mxnet as mx
import pytest

import mxamp
from mxamp import cli, dtypes, hardware

from test_cli import convert


def graph_of(prefix):
    with open(prefix + '-symbol.json') as handle:
        return json.load(handle)['nodes']


@pytest.mark.parametrize('spelling', ['auto', 'AUTO'])
def test_dtype_auto_is_what_the_python_api_does_with_auto(model, tmp_path, capsys, spelling):
    out = str(tmp_path / 'out')
    status, stdout, err = convert(capsys, model + '-symbol.json', '--params', model + '-0000.params',
                                  '-o', out, '--dtype', spelling, '--input-shape', 'data=2,16,8,8')
    assert status == 0, err
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', RuntimeWarning)
        chosen = dtypes.resolve_dtype('auto')
    assert '--dtype auto: %s (' % chosen in stdout and 'RuntimeWarning' not in err
    symbol, args, auxs = mx.model.load_checkpoint(model, 0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', RuntimeWarning)
        expected = mxamp.convert_model(symbol, args, auxs, 'auto',
                                       input_shapes={'data': (2, 16, 8, 8)})[0]
    assert graph_of(out) == json.loads(expected.tojson(remove_amp_cast=False))['nodes']


@pytest.mark.parametrize('spelling', ['float32', 'fp32'])
def test_dtype_float32_writes_the_graph_unchanged(model, tmp_path, capsys, spelling):
    out = str(tmp_path / 'out')
    status, _, err = convert(capsys, model + '-symbol.json', '-o', out, '--dtype', spelling)
    assert status == 0, err
    assert graph_of(out) == graph_of(model)


def test_an_unknown_dtype_lists_the_accepted_ones(model, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        convert(capsys, model + '-symbol.json', '-o', str(tmp_path / 'out'), '--dtype', 'int8')
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown dtype 'int8': expected auto, float16 (fp16, half), bfloat16 (bf16) or float32" in err
    assert err.count('error:') == 1


def test_an_input_shape_the_graph_cannot_take_is_refused_and_nothing_written(model, tmp_path,
                                                                              capsys):
    out = str(tmp_path / 'out')
    status, stdout, err = convert(capsys, model + '-symbol.json', '-o', out, '--dtype', 'float16',
                                  '--input-shape', 'data=1,3')
    assert status == 2
    assert err.strip() == ('mxamp: error: --input-shape: the graph rejects these shapes (data=1,3): '
                           'Error in operator conv0: Check failed: dshp.ndim() == 4U (2 vs. 4) : '
                           'Input data should be 4D in batch-num_filter-y-x')
    assert not os.path.exists(out + '-symbol.json') and stdout == ''


@pytest.mark.parametrize('which', ['symbol', 'params'])
def test_a_directory_is_called_a_directory(model, tmp_path, capsys, which):
    argv = [str(tmp_path) if which == 'symbol' else model + '-symbol.json',
            '-o', str(tmp_path / 'out'), '--dtype', 'float16']
    if which == 'params':
        argv += ['--params', str(tmp_path)]
    status, _, err = convert(capsys, *argv)
    assert status == 2
    assert err.strip() == "mxamp: error: %s file '%s' is a directory" % (which, tmp_path)


def test_the_note_for_a_cpu_without_bfloat16_reads_as_a_sentence(model, tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setattr(cli, 'cpu_class', lambda: hardware.AVX2)
    status, _, err = convert(capsys, model + '-symbol.json', '-o', str(tmp_path / 'out'),
                             '--dtype', 'bfloat16')
    assert status == 0
    assert err.strip() == ('mxamp: note: the graph computes in bfloat16, which this CPU cannot run '
                           '(%s); --cpu-class auto writes one for this CPU'
                           % hardware.describe_cpu_class())
