"""``mxamp info``: the screen a user pastes into a bug report says what mxamp does here, and why."""
import json

import mxnet as mx
import numpy as np
import pytest

import mxamp
from mxamp import hardware, system_info

AVX512_CORE = ('avx512f', 'avx512bw', 'avx512vl', 'avx512dq')


@pytest.fixture
def machine(monkeypatch):
    """Set the CPU flags, GPU count, AMX state and launch environment `collect` sees."""
    def set_machine(*flags, gpus=0, amx=False, environment=None):
        monkeypatch.setattr(hardware, 'cpu_flags', lambda: frozenset(flags))
        monkeypatch.setattr(hardware, 'gpu_count', lambda: gpus)
        monkeypatch.setattr(hardware, '_amx_enabled', amx)
        monkeypatch.setattr(hardware, 'launch_environment', lambda: dict(environment or {}))
        monkeypatch.delenv('DNNL_MAX_CPU_ISA', raising=False)
        for key, value in (environment or {}).items():
            monkeypatch.setenv(key, value)
    return set_machine


def test_versions_and_the_machine_as_they_are():
    info = system_info.collect()
    assert info['versions']['mxamp'] == mxamp.__version__
    assert info['versions']['mxnet'] == mx.__version__ == '1.9.1'
    assert info['versions']['numpy'] == np.__version__
    assert info['cpu']['class'] == hardware.cpu_class()
    assert info['cpu']['usable_cpus'] == hardware.usable_cpus()
    assert info['openmp']['openmp_threads'] >= 1
    assert info['mxnet_features']['MKLDNN'] is True
    json.dumps(info)  # JSON-ready, for `mxamp info --json`


def test_an_avx2_cpu_says_why_auto_is_float32_and_what_bfloat16_costs(machine):
    machine('avx2')
    info = system_info.collect()
    assert info['auto']['cpu'] == 'float32'
    text = system_info.format_info(info)
    assert "dtype='auto' on the CPU: float32 (this 'avx2' class CPU without AVX-512" in text
    assert 'bfloat16 storage, FP32 compute, slower than FP32' in text
    assert 'lowered by: nothing' in text and 'AMX: not available' in text


def test_a_bfloat16_cpu_lowered_by_the_isa_cap_says_so(machine, monkeypatch):
    machine('avx512_bf16', *AVX512_CORE)
    assert system_info.collect()['auto']['cpu'] == 'bfloat16'
    monkeypatch.setenv('DNNL_MAX_CPU_ISA', 'AVX2')
    info = system_info.collect()
    assert info['auto']['cpu'] == 'float32'
    assert info['cpu']['lowered_by'] == ['DNNL_MAX_CPU_ISA=AVX2']
    assert 'lowered by: DNNL_MAX_CPU_ISA=AVX2' in system_info.format_info(info)


def test_amx_left_off_is_named(machine):
    machine('avx512_bf16', 'amx_bf16', 'amx_tile', *AVX512_CORE, amx=False)
    info = system_info.collect()
    assert info['cpu']['class'] == 'avx512_bf16'
    assert info['cpu']['lowered_by'][0].startswith('AMX left off')
    text = system_info.format_info(info)
    assert 'AMX: not enabled' in text
    # Its AVX512-BF16 kernels are slower than FP32 (hardware.bfloat16_pays): 'auto' keeps FP32.
    assert info['auto']['cpu'] == 'float32'
    assert "dtype='bfloat16' still computes in bfloat16 here" in info['auto']['cpu_why']
    assert 'AMX tiles left off' in text
    machine('avx512_bf16', 'amx_bf16', 'amx_tile', *AVX512_CORE, amx=True)
    info = system_info.collect()
    assert info['cpu']['class'] == 'amx' and info['cpu']['lowered_by'] == []
    assert info['auto']['cpu'] == 'bfloat16'
    assert 'AMX: enabled' in system_info.format_info(info)


def test_gpus_and_auto_on_them(machine):
    machine('avx2', gpus=2)
    info = system_info.collect()
    assert info['gpus'] == 2 and info['auto']['gpu'] == 'float16'
    assert "dtype='auto' on a GPU: float16" in system_info.format_info(info)
    machine('avx2')
    assert "on a GPU" not in system_info.format_info(system_info.collect())


def test_the_environment_shown_is_the_launch_one_and_only_what_changes_mxnet(machine):
    machine('avx2', environment={'OMP_NUM_THREADS': '2', 'HOME': '/root', 'MXNET_ENGINE_TYPE': 'x'})
    info = system_info.collect()
    assert info['environment'] == {'MXNET_ENGINE_TYPE': 'x', 'OMP_NUM_THREADS': '2'}
    assert 'environment: MXNET_ENGINE_TYPE=x OMP_NUM_THREADS=2' in system_info.format_info(info)


def test_launch_environment_ignores_what_packages_set_after_start(monkeypatch):
    # scikit-learn, which `import mxnet` loads, sets KMP_* in os.environ.
    monkeypatch.setenv('MXAMP_TEST_SET_LATER', '1')
    assert 'MXAMP_TEST_SET_LATER' not in hardware.launch_environment()
    assert 'PATH' in hardware.launch_environment()


def test_the_own_convolution_choice_is_one_line_whatever_the_switch(monkeypatch, tmp_path):
    from mxamp.kernels import choice
    from mxamp.kernels.choice import ChoiceTable, ConvCase, Measurement
    monkeypatch.setenv('MXAMP_KERNELS', '0')
    lines = system_info.format_info(system_info.collect()).splitlines()
    assert 'none' in next(line for line in lines if line.startswith('own convolution choice'))
    assert lines[-2] == 'channels-last regions in training: off (MXAMP_KERNELS=0)'
    assert 'own convolution: off, switched off (MXAMP_KERNELS=0)' in lines
    monkeypatch.setenv('MXAMP_KERNELS', 'all')
    assert choice.describe().endswith('(MXAMP_KERNELS=all)')
    monkeypatch.setenv('MXAMP_KERNELS', '1')
    case = ConvCase((1, 32, 8, 8), (1, 1), (1, 1), (1, 1), (0, 0), 32, 1, True, 'bfloat16', 'other')
    here = mxamp.hardware.cpu_class(), choice.running_threads()
    table = ChoiceTable([Measurement(*here, case, 10.0, 5.0)]).write(str(tmp_path / 't.json'))
    monkeypatch.setenv(choice.TABLE_ENV, table)
    shipped = ChoiceTable.read(choice.shipped_table_path())
    measured = 1 + sum((m.cpu_class, m.threads) == here for m in shipped)
    faster = 1 + sum((m.cpu_class, m.threads) == here and m.own_is_faster for m in shipped)
    assert ('%d of %d cases measured on this CPU class (%s) at %d OpenMP threads run on it'
            % ((faster, measured) + here) in choice.describe())
    monkeypatch.setenv(choice.TABLE_ENV, str(tmp_path / 'gone.json'))
    assert choice.describe() == ('own convolution choice: unknown, MXAMP_KERNELS_TABLE=%s: '
                                          'no such file' % (tmp_path / 'gone.json'))
