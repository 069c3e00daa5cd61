"""scripts/measure_costs.py: the ladders that write mxamp/cost_table.json, for training and inference."""
import importlib.util
import json
import os

import pytest

from mxamp import hardware

pytestmark = pytest.mark.usefixtures('quiet_precision_warnings')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'measure_costs.py')


def _load():
    spec = importlib.util.spec_from_file_location('mxamp_measure_costs_script', SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason='measure_costs measures bfloat16 kernels, which this CPU class lacks')
@pytest.mark.parametrize('task', ['training', 'inference'])
# The ladder's smallest layers are meant not to pay: converted for bfloat16, they say so.
@pytest.mark.filterwarnings('ignore:mxamp.*expect it slower than float32:RuntimeWarning')
def test_a_short_ladder_writes_each_size_and_the_thresholds(task, tmp_path, monkeypatch, capsys):
    script = _load()
    sizes, *rest = script.OPERATORS['FullyConnected']
    monkeypatch.setitem(script.OPERATORS, 'FullyConnected', ([(4, 8, 16), (8, 32, 32)], *rest))
    output = tmp_path / 'costs.json'
    script.main(['--task', task, '--ops', 'FullyConnected', '--repeats', '1',
                 '--json', str(output)])
    data = json.loads(output.read_text())
    assert data['task'] == task and data['cpu_class'] == hardware.cpu_class()
    entry = data['operators']['FullyConnected']
    assert [row['size'] for row in entry['rows']] == [[4, 8, 16], [8, 32, 32]]
    assert all(row['float32_ms'] > 0 and row['bfloat16_ms'] > 0 for row in entry['rows'])
    # A threshold, when one is found, is the work of a size of the ladder.
    assert entry['pays_from_mflop'] in (None,) + tuple(row['mflop'] for row in entry['rows'])
    # The chain of two, a region, does the work of two layers.
    assert all(row['region_mflop'] == 2 * row['mflop'] and row['region'] > 0
               for row in entry['rows'])
    assert entry['region_pays_from_mflop'] in (None,) + tuple(
        row['region_mflop'] for row in entry['rows'])
    assert entry['inside_pays_from_mflop'] == script.threshold(
        entry['rows'], 'mflop', data['margin'], ('inside',))
    printed = capsys.readouterr().out
    assert script.TASKS[task] in printed


@pytest.mark.skipif(not hardware.computes_bfloat16(),
                    reason='measure_costs measures bfloat16 kernels, which this CPU class lacks')
@pytest.mark.filterwarnings('ignore:mxamp.*expect it slower than float32:RuntimeWarning')
def test_the_blocks_ladders_run_their_convolutions_with_batchnorm_and_relu(tmp_path, monkeypatch):
    script = _load()
    plain = script.conv_block_chain(2, 8)
    separable = script.conv_block_chain(2, 8, separable=True)
    kinds = [type(layer).__name__ for layer in separable]
    assert kinds == ['Conv2D', 'BatchNorm', 'Activation'] * 4 and len(plain) == 6
    assert separable[0]._kwargs['num_group'] == 8 and separable[3]._kwargs['num_group'] == 1
    for op in script.BLOCKS:
        _, *rest = script.BLOCKS[op]
        monkeypatch.setitem(script.BLOCKS, op, ([(2, 8, 6)], *rest))
    output = tmp_path / 'blocks.json'
    script.main(['--ops'] + list(script.BLOCKS) + ['--repeats', '1', '--json', str(output)])
    entries = json.loads(output.read_text())['operators']
    assert set(entries) == set(script.BLOCKS)
    assert entries['Separable+BatchNorm+ReLU']['rows'][0]['mflop'] == pytest.approx(
        2e-6 * 2 * 8 * (8 + 9) * 36)


def test_a_threshold_is_where_every_larger_size_pays():
    script = _load()
    rows = [{'mflop': 1.0, 'alone': 0.9, 'inside': 1.2}, {'mflop': 2.0, 'alone': 1.1, 'inside': 0.9},
            {'mflop': 4.0, 'alone': 1.2, 'inside': 1.3}, {'mflop': 8.0, 'alone': 1.5, 'inside': 1.6}]
    assert script.threshold(rows, 'mflop', 1.05) == 4.0
    assert script.threshold(rows, 'mflop', 1.05, ('alone',)) == 2.0
    assert script.threshold(rows, 'mflop', 2.0) is None


def test_an_unknown_task_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        _load().main(['--task', 'serving'])
    assert exit_.value.code == 2
    assert "argument --task: invalid choice: 'serving'" in capsys.readouterr().err
