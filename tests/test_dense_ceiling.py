"""scripts/dense_ceiling.py: BERT-base's dense layers timed, added up, and bounding inference."""
import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'dense_ceiling.py')


def _load():
    sys.path.insert(0, os.path.dirname(SCRIPT))  # its harness
    try:
        spec = importlib.util.spec_from_file_location('mxamp_dense_ceiling_script', SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(SCRIPT))
    return module


def test_a_run_adds_the_encoders_dense_layers_up(tmp_path, capsys):
    script = _load()
    output = str(tmp_path / 'ceiling.json')
    assert script.main(['--batch', '2', '--length', '4', '--square', '32', '--warmup', '0',
                        '--repeats', '1', '--output', output]) == 0
    with open(output) as handle:
        data = json.load(handle)
    layers = data['layers']
    assert [(r['inputs'], r['outputs'], r['per_batch']) for r in layers] == [
        (768, 2304, 12), (768, 768, 12), (768, 3072, 12), (3072, 768, 12), (32, 32, 0)]
    assert all(r['rows'] == 8 for r in layers[:4]) and layers[4]['rows'] == 32
    for dtype in ('float32', 'bfloat16'):
        per_batch = sum(r[dtype]['ms'] * r['per_batch'] for r in layers)
        assert data['dense_ms_per_batch'][dtype] == pytest.approx(per_batch)
        assert data['ceiling_sequences_per_s'][dtype] == pytest.approx(2e3 / per_batch)
        for r in layers:
            work = 2.0 * r['rows'] * r['inputs'] * r['outputs']
            assert r[dtype]['gflops'] == pytest.approx(work / r[dtype]['ms'] / 1e6)
    assert data['dense_gflop_per_batch'] == pytest.approx(
        12 * 2 * 8 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072) / 1e9)
    meta = data['meta']
    assert meta['command'].startswith('scripts/dense_ceiling.py --batch 2')
    assert meta['cpu_model'] and set(meta['hardware']) == {'avx512_bf16', 'amx_bf16'}
    printed = capsys.readouterr().out
    assert data['table'] in printed
    assert 'inference ceiling from the dense layers alone' in data['table']


@pytest.mark.parametrize('option', ['--repeats', '--square', '--batch'])
def test_counts_below_one_are_refused_in_one_line(option, capsys):
    with pytest.raises(SystemExit) as raised:
        _load().parse_args([option, '0'])
    assert raised.value.code == 2
    assert '%s must be at least 1, got 0' % option in capsys.readouterr().err
