"""scripts/benchmark.py: the JSON it writes, and ratios computed from the measured numbers."""
import importlib.util
import json
import os
import statistics
import subprocess
import sys

import pytest

from mxamp import hardware

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'benchmark.py')


def _load():
    spec = importlib.util.spec_from_file_location('mxamp_benchmark_script', SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_derive_computes_medians_and_ratios_from_measurements():
    bench = _load()
    result = {'network': 'n', 'task': 'training', 'batch': 4, 'image_size': 32, 'modes': {
        'fp32': {'img_per_s': [10.0, 12.0, 11.0], 'fwd_bwd_ms': [300.0, 320.0, 310.0],
                 'update_ms': [20.0, 22.0, 21.0], 'baseline': 'fp32', 'peak_rss_mb': 1000.0},
        'mxamp': {'img_per_s': [30.0, 20.0, 25.0], 'fwd_bwd_ms': [100.0, 110.0, 120.0],
                  'update_ms': [30.0, 31.0, 29.0], 'baseline': 'fp32', 'peak_rss_mb': 500.0},
        'fp32@contrib.amp process': {'img_per_s': [8.0, 9.0, 10.0],
                                     'baseline': 'fp32@contrib.amp process'},
        'contrib.amp': {'img_per_s': [16.0, 18.0, 20.0], 'baseline': 'fp32@contrib.amp process'},
    }}
    bench.derive(result)
    modes = result['modes']
    assert modes['fp32']['median_img_per_s'] == 11.0
    assert modes['mxamp']['ratio_vs_fp32'] == pytest.approx(25.0 / 11.0)
    assert modes['mxamp']['paired_ratio_vs_fp32'] == pytest.approx(25.0 / 11.0)  # 3.0, 1.67, 2.27
    assert modes['contrib.amp']['ratio_vs_fp32'] == pytest.approx(18.0 / 9.0)
    assert modes['mxamp']['vs_contrib_amp'] == pytest.approx((25.0 / 11.0) / 2.0)
    assert modes['mxamp']['rss_ratio_vs_fp32'] == pytest.approx(0.5)
    overhead = result['mxamp_overhead']['mxamp']
    assert overhead['extra_update_ms'] == pytest.approx(30.0 - 21.0)
    assert overhead['fraction_of_step'] == pytest.approx(9.0 / (110.0 + 30.0))
    table = bench.format_table([result])
    assert 'contrib.amp' in table and '2.27' in table and '2.00*' in table


def test_contrib_amp_is_skipped_with_its_reason_where_bfloat16_is_not_native(monkeypatch):
    bench = _load()
    for klass, native in (('amx', True), ('avx512_bf16', True), ('avx512', False)):
        monkeypatch.setattr(bench.hardware, 'cpu_class', lambda: klass)
        assert bench.skip_reason('contrib.amp') is None        # runs (emulated on avx512)
        assert bench.mxamp_compute() == ('native' if native else 'bfloat16 storage, FP32 compute')
    monkeypatch.setattr(bench.hardware, 'cpu_class', lambda: 'avx2')
    reason = bench.skip_reason('contrib.amp')
    assert 'oneDNN cannot do on this CPU' in reason and "'avx2'" in reason
    assert bench.skip_reason('mxamp') is None and bench.skip_reason('fp32') is None
    assert bench.mxamp_compute() == 'bfloat16 storage, FP32 compute'
    result = {'network': 'n', 'task': 'inference', 'batch': 4, 'image_size': 32,
              'mxamp_compute': bench.mxamp_compute(), 'modes': {
                  'fp32': {'img_per_s': [10.0], 'baseline': 'fp32'},
                  'mxamp': {'img_per_s': [9.0], 'baseline': 'fp32'},
                  'contrib.amp': {'skipped': reason}}}
    bench.derive(result)
    table = bench.format_table([result])
    row = [line for line in table.splitlines() if line.startswith('n ') and 'contrib.amp' in line]
    assert len(row) == 1 and 'skipped' in row[0]
    assert 'contrib.amp skipped: ' + reason in table.splitlines()
    assert 'mxamp modes: bfloat16 storage, FP32 compute' in table


@pytest.mark.slow
def test_tiny_run_writes_a_complete_json(tmp_path):
    out = tmp_path / 'bench.json'
    proc = subprocess.run(
        [sys.executable, SCRIPT, '--networks', 'tiny', '--batch', '2', '--image-size', '32',
         '--repeats', '1', '--steps', '1', '--warmup', '1', '--output', str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data['meta']['schema_version'] == 1
    assert {'mxnet', 'hardware', 'cpu_count', 'args', 'command'} <= set(data['meta'])
    assert data['table'] in proc.stdout
    results = {(r['network'], r['task']): r for r in data['results']}
    assert set(results) == {('tiny', 'inference'), ('tiny', 'training')}
    inference, training = results[('tiny', 'inference')], results[('tiny', 'training')]
    native = hardware.computes_bfloat16()
    assert set(inference['modes']) == {'fp32', 'fp32+fusion', 'mxamp', 'mxamp+fusion',
                                       'contrib.amp'}
    assert set(training['modes']) == {'fp32', 'mxamp', 'mxamp+scaling', 'contrib.amp'} | (
        {'fp32@contrib.amp process'} if hardware.cpu_class() != 'avx2' else set())
    for result in (inference, training):
        assert result['mxamp_compute'] == ('native' if native else
                                           'bfloat16 storage, FP32 compute')
        modes = result['modes']
        for name, entry in modes.items():
            if hardware.cpu_class() == 'avx2' and name == 'contrib.amp':
                # MXNet's AMP would fail (no bfloat16 in oneDNN without AVX-512): not measured.
                assert entry == {'skipped': entry['skipped']}, entry
                assert 'contrib.amp skipped: ' + entry['skipped'] in proc.stdout
                continue
            assert 'error' not in entry and 'memory_error' not in entry, (name, entry)
            assert len(entry['img_per_s']) == 1
            assert entry['median_img_per_s'] == statistics.median(entry['img_per_s'])
            base = modes[entry['baseline']]
            assert entry['ratio_vs_fp32'] == pytest.approx(
                entry['median_img_per_s'] / base['median_img_per_s'])
            assert entry['paired_ratio_vs_fp32'] == pytest.approx(
                entry['img_per_s'][0] / base['img_per_s'][0])
            if name != 'fp32@contrib.amp process':
                assert entry['peak_rss_mb'] >= entry['base_rss_mb'] > 0
                assert entry['rss_ratio_vs_fp32'] == pytest.approx(
                    entry['peak_rss_mb'] / modes['fp32']['peak_rss_mb'])
    if native:
        assert training['modes']['contrib.amp']['baseline'] == 'fp32@contrib.amp process'
    assert set(training['mxamp_overhead']) == {'mxamp', 'mxamp+scaling'}
    for entry in training['modes'].values():
        if 'skipped' not in entry:
            assert len(entry['update_ms']) == 1 and entry['median_step_ms'] > 0
