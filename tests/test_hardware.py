"""Tests of mxamp.hardware: detection, 'auto' dtype, AMX enabling."""
import logging
import os
import re
import subprocess
import sys
import textwrap
import types
import warnings

import mxnet as mx
import numpy as np
import pytest

from conftest import REAL_CPU_FLAGS
from mxamp import dtypes, hardware
from mxamp.dtypes import BFLOAT16

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


AVX512_CORE = ('avx512f', 'avx512bw', 'avx512vl', 'avx512dq')


@pytest.fixture
def flags(monkeypatch):
    """Set the CPU flags and GPU count hardware sees: flags('avx512_bf16', gpus=1).

    Clears DNNL_MAX_CPU_ISA (CI runs part of the suite with it set) and AMX enabling.
    """
    monkeypatch.delenv('DNNL_MAX_CPU_ISA', raising=False)
    monkeypatch.setattr(hardware, '_amx_enabled', False)

    def set_flags(*names, gpus=0):
        monkeypatch.setattr(hardware, 'cpu_flags', lambda: frozenset(names))
        monkeypatch.setattr(hardware, 'gpu_count', lambda: gpus)
    return set_flags


@pytest.fixture
def fresh_amx(monkeypatch):
    """A first enable_amx() call with a fake permission request; restores the environment.

    Set ``.granted`` to choose the kernel's answer; ``.requests`` counts the requests.
    """
    saved = {name: os.environ.get(name) for name in ('DNNL_MAX_CPU_ISA', 'MXAMP_AMX')}
    for name in saved:
        os.environ.pop(name, None)
    monkeypatch.setattr(hardware, '_amx_enabled', None)
    fake = types.SimpleNamespace(granted=True, requests=0)

    def request():
        fake.requests += 1
        return fake.granted
    monkeypatch.setattr(hardware, '_request_amx_permission', request)
    yield fake
    # Never leave AVX512_CORE_AMX behind without a real permission: SIGILL later.
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# --- detection -------------------------------------------------------------

def test_cpu_flags_missing_cpuinfo(monkeypatch):
    def no_file(*args, **kwargs):
        raise FileNotFoundError('/proc/cpuinfo')
    hardware.cpu_flags.cache_clear()
    monkeypatch.setattr(hardware, 'open', no_file, raising=False)
    try:
        assert hardware.cpu_flags() == frozenset()
        assert not hardware.has_avx512_bf16() and not hardware.has_amx_bf16()
    finally:
        hardware.cpu_flags.cache_clear()


def test_cpu_flags_reads_this_machine():
    flags = hardware.cpu_flags()
    if os.path.exists('/proc/cpuinfo') and 'x86' in os.uname().machine:
        assert 'sse2' in flags
    assert isinstance(flags, frozenset)


def test_gpu_count_on_cpu_build():
    assert hardware.gpu_count() == mx.context.num_gpus() >= 0


def test_describe():
    info = hardware.describe()
    assert set(info) == {'avx512_bf16', 'amx_bf16', 'amx_enabled', 'cpu_class',
                         'dnnl_max_cpu_isa', 'gpus'}
    assert info['cpu_class'] == hardware.cpu_class() in hardware.CPU_CLASSES
    assert info['avx512_bf16'] == ('avx512_bf16' in hardware.cpu_flags())
    assert isinstance(info['gpus'], int) and isinstance(info['amx_enabled'], bool)


# --- resolve_dtype ---------------------------------------------------------

@pytest.mark.parametrize('dtype, name', [
    ('bf16', 'bfloat16'), ('BFloat16', 'bfloat16'), (BFLOAT16, 'bfloat16'),
    ('fp16', 'float16'), (np.float16, 'float16'), ('float32', 'float32'),
    (np.dtype(np.float32), 'float32')])
def test_resolve_explicit_passes_through(flags, dtype, name):
    flags(gpus=1)  # an explicit dtype ignores the hardware
    assert dtypes.resolve_dtype(dtype) == name
    assert dtypes.resolve_dtype(dtype, mx.cpu()) == name


@pytest.mark.parametrize('dtype', ['int8', 'float64', 'automatic', np.int32])
def test_resolve_unknown_raises(dtype):
    with pytest.raises(ValueError):
        dtypes.resolve_dtype(dtype)


# --- CPU classes -------------------------------------------------------------

@pytest.mark.parametrize('cpu, amx_enabled, expected', [
    (('sse2', 'avx', 'avx2', 'fma'), False, 'avx2'),
    (('avx2', 'avx512f'), False, 'avx2'),                       # no avx512_core (bw/vl/dq)
    (('avx2',) + AVX512_CORE, False, 'avx512'),                 # Skylake-SP, Cascade Lake
    (('avx2', 'avx512_bf16') + AVX512_CORE, False, 'avx512_bf16'),  # Cooper Lake, Zen 4
    (('avx512_bf16', 'amx_bf16') + AVX512_CORE, False, 'avx512_bf16'),  # AMX not enabled
    (('avx512_bf16', 'amx_bf16') + AVX512_CORE, True, 'amx'),
])
def test_cpu_class_from_flags(flags, monkeypatch, cpu, amx_enabled, expected):
    flags(*cpu)
    monkeypatch.setattr(hardware, '_amx_enabled', amx_enabled)
    assert hardware.cpu_class() == expected
    assert hardware.computes_bfloat16() is (expected in ('avx512_bf16', 'amx'))
    assert repr(expected) in hardware.describe_cpu_class()


@pytest.mark.parametrize('isa, expected', [
    ('AVX2', 'avx2'), ('sse41', 'avx2'), ('AVX512_MIC', 'avx2'), ('AVX512_CORE', 'avx512'),
    ('avx512_core_vnni', 'avx512'), ('AVX512_CORE_BF16', 'avx512_bf16'),
    ('AVX512_CORE_AMX', 'amx'), ('ALL', 'amx'), ('NO_SUCH_ISA', 'amx'),
])
def test_dnnl_max_cpu_isa_lowers_the_class(flags, monkeypatch, isa, expected):
    flags('avx512_bf16', 'amx_bf16', *AVX512_CORE)
    monkeypatch.setattr(hardware, '_amx_enabled', True)
    monkeypatch.setenv('DNNL_MAX_CPU_ISA', isa)
    assert hardware.cpu_class() == expected
    if expected != 'amx':
        assert 'DNNL_MAX_CPU_ISA=%s' % isa in hardware.describe_cpu_class()


def test_describe_names_the_cap_only_where_it_lowered_the_class(flags, monkeypatch):
    # On an AMX machine mxamp itself sets DNNL_MAX_CPU_ISA=AVX512_CORE_AMX: a class
    # named for another reason (here a caller's own) must not blame the variable.
    flags('avx512_bf16', 'amx_bf16', *AVX512_CORE)
    monkeypatch.setattr(hardware, '_amx_enabled', True)
    monkeypatch.setenv('DNNL_MAX_CPU_ISA', 'AVX512_CORE_AMX')
    monkeypatch.setattr(hardware, 'cpu_class', lambda: 'avx2')
    assert hardware.describe_cpu_class() == "'avx2' class " + hardware._CLASS_TEXT['avx2']
    monkeypatch.delenv('DNNL_MAX_CPU_ISA')
    assert 'DNNL_MAX_CPU_ISA' not in hardware.describe_cpu_class()


def test_dnnl_max_cpu_isa_never_raises_the_class(flags, monkeypatch):
    flags('avx2')
    monkeypatch.setenv('DNNL_MAX_CPU_ISA', 'AVX512_CORE_AMX')
    assert hardware.cpu_class() == 'avx2'
    assert 'DNNL_MAX_CPU_ISA' not in hardware.describe_cpu_class()


def test_resolve_auto_gpu(flags):
    flags('avx512_bf16', *AVX512_CORE, gpus=0)
    assert dtypes.resolve_dtype('auto', mx.gpu(0)) == 'float16'
    assert dtypes.resolve_dtype('AUTO', [mx.gpu(0), mx.gpu(1)]) == 'float16'
    flags('avx512_bf16', *AVX512_CORE, gpus=2)
    assert dtypes.resolve_dtype('auto') == 'float16'
    # An explicit CPU context wins over the GPUs the machine has.
    assert dtypes.resolve_dtype('auto', mx.cpu()) == 'bfloat16'


@pytest.mark.parametrize('cpu_flag', ['avx512_bf16', 'amx_bf16'])
def test_resolve_auto_bf16_cpu(flags, monkeypatch, cpu_flag):
    flags('sse2', cpu_flag, *AVX512_CORE)
    monkeypatch.setattr(hardware, '_amx_enabled', cpu_flag == 'amx_bf16')  # AMX on where it is
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert dtypes.resolve_dtype('auto') == 'bfloat16'
        assert dtypes.resolve_dtype('auto', [mx.cpu(0)]) == 'bfloat16'


@pytest.mark.parametrize('cpu, isa, named', [
    (('sse2', 'avx2'), None, "'avx2'"),
    (('avx2',) + AVX512_CORE, None, "'avx512'"),
    (('avx512_bf16',) + AVX512_CORE, 'AVX2', 'DNNL_MAX_CPU_ISA=AVX2'),
])
def test_resolve_auto_cpu_without_bf16_stays_float32_and_says_so_once(flags, monkeypatch,
                                                                       cpu, isa, named):
    flags(*cpu)
    if isa:
        monkeypatch.setenv('DNNL_MAX_CPU_ISA', isa)
    monkeypatch.setattr(dtypes, '_warned_auto_float32', False)
    with pytest.warns(RuntimeWarning) as record:
        assert dtypes.resolve_dtype('auto') == 'float32'
    assert len(record) == 1
    message = str(record[0].message)
    assert named in message and 'float32' in message and 'AVX512-BF16 or AMX' in message
    assert '\n' not in message
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert dtypes.resolve_dtype('auto', mx.cpu()) == 'float32'
        assert dtypes.resolve_dtype('bfloat16', mx.cpu()) == 'bfloat16'  # explicit: kept
        assert dtypes.resolve_dtype('auto', mx.gpu(0)) == 'float16'


# --- enable_amx (fake permission) ------------------------------------------

def test_enable_amx_without_amx_does_nothing(flags, fresh_amx):
    flags('avx512_bf16')
    assert hardware.enable_amx() is False
    assert fresh_amx.requests == 0 and 'DNNL_MAX_CPU_ISA' not in os.environ


def test_enable_amx_sets_isa_and_logs_once(flags, fresh_amx, caplog):
    flags('avx512_bf16', 'amx_bf16')
    with caplog.at_level(logging.INFO, logger='mxamp'):
        assert hardware.enable_amx() is True
        assert hardware.enable_amx() is True  # idempotent: no second request or log
    assert fresh_amx.requests == 1
    assert os.environ['DNNL_MAX_CPU_ISA'] == 'AVX512_CORE_AMX'
    lines = [r for r in caplog.records if r.name == 'mxamp' and r.levelno == logging.INFO]
    assert len(lines) == 1 and 'AMX enabled' in lines[0].getMessage()
    assert hardware.describe()['amx_enabled'] is True


def test_enable_amx_never_sets_isa_without_permission(flags, fresh_amx):
    flags('amx_bf16')
    fresh_amx.granted = False
    assert hardware.enable_amx() is False
    assert fresh_amx.requests == 1 and 'DNNL_MAX_CPU_ISA' not in os.environ


@pytest.mark.parametrize('value', ['0', 'off', 'False'])
def test_enable_amx_opt_out(flags, fresh_amx, value):
    flags('amx_bf16')
    os.environ['MXAMP_AMX'] = value
    assert hardware.enable_amx() is False
    assert fresh_amx.requests == 0 and 'DNNL_MAX_CPU_ISA' not in os.environ


@pytest.mark.parametrize('user_isa, enabled', [('AVX512_CORE_BF16', False),
                                               ('avx512_core_amx', True)])
def test_enable_amx_respects_user_isa(flags, fresh_amx, user_isa, enabled):
    flags('amx_bf16')
    os.environ['DNNL_MAX_CPU_ISA'] = user_isa
    assert hardware.enable_amx() is enabled
    assert os.environ['DNNL_MAX_CPU_ISA'] == user_isa
    assert fresh_amx.requests == 1  # the user's AMX value needs the permission too


def test_enable_amx_warns_about_user_isa_without_permission(flags, fresh_amx, caplog):
    flags('amx_bf16')
    fresh_amx.granted = False
    os.environ['DNNL_MAX_CPU_ISA'] = 'AVX512_CORE_AMX'
    with caplog.at_level(logging.INFO, logger='mxamp'):
        assert hardware.enable_amx() is False
    assert any(r.levelno == logging.WARNING and 'SIGILL' in r.getMessage()
               for r in caplog.records)


def test_real_permission_request_is_harmless():
    # False on CPUs without AMX or non-Linux; True on AMX machines (process-wide,
    # allows tile instructions without enabling anything else).
    assert hardware._request_amx_permission() in (True, False)


# --- fresh processes: mxnet imported first, then a real bfloat16 convolution --

BF16_CONV = textwrap.dedent('''
    import os
    import mxnet as mx
    from mxamp import dtypes, hardware
    print('ENABLED=%s ISA=%s' % (hardware.enable_amx(), os.environ.get('DNNL_MAX_CPU_ISA')))
    x = mx.nd.amp_cast(mx.nd.ones((2, 32, 14, 14)), dtype=dtypes.BFLOAT16)
    w = mx.nd.amp_cast(mx.nd.ones((32, 32, 3, 3)) * 0.01, dtype=dtypes.BFLOAT16)
    y = mx.nd.Convolution(x, w, kernel=(3, 3), pad=(1, 1), num_filter=32, no_bias=True)
    print('VALUE=%.4f' % dtypes.to_float32_numpy(y)[0, 0, 5, 5])
''')


def run_python(code, **env):
    """Run `code` in a fresh Python with DNNL_VERBOSE=1; returns (returncode, output)."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ('DNNL_MAX_CPU_ISA', 'MXAMP_AMX', 'DNNL_VERBOSE')}
    full_env.update(DNNL_VERBOSE='1', PYTHONPATH=REPO, **env)
    proc = subprocess.run([sys.executable, '-c', code], env=full_env, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120)
    return proc.returncode, proc.stdout


def conv_kernels(output):
    """Kernel names of the oneDNN convolutions in DNNL_VERBOSE output."""
    return [line.split(',')[4] for line in output.splitlines()
            if line.startswith('dnnl_verbose,exec,cpu,convolution,')]


# These fresh processes run without DNNL_MAX_CPU_ISA, so what counts is the CPU itself
# (never a simulated class: conftest).
needs_bf16_kernels = pytest.mark.skipif(
    not set(AVX512_CORE) <= REAL_CPU_FLAGS,
    reason="this CPU has no AVX-512 (avx512_core): MXNet 1.9.1's oneDNN has no bfloat16 "
           "convolution to run here")


@pytest.fixture(scope='module')
def bf16_conv_run():
    return run_python(BF16_CONV)


@needs_bf16_kernels
def test_bf16_conv_after_enable_amx_exits_cleanly(bf16_conv_run):
    returncode, output = bf16_conv_run
    assert returncode == 0, output[-2000:]  # -4 would be SIGILL
    value = float(re.search(r'VALUE=([-0-9.e+]+)', output).group(1))
    assert abs(value - 2.88) < 0.03  # 9 taps * 32 channels * 0.01, in bfloat16
    assert conv_kernels(output), output[-2000:]
    if 'amx_bf16' not in REAL_CPU_FLAGS:
        assert 'ENABLED=False ISA=None' in output


@needs_bf16_kernels
def test_bf16_conv_uses_amx_kernel(bf16_conv_run):
    if 'amx_bf16' not in REAL_CPU_FLAGS:
        pytest.skip('this CPU has no amx_bf16 (/proc/cpuinfo), so no AMX kernel to look for')
    returncode, output = bf16_conv_run
    assert returncode == 0
    if 'ENABLED=True' not in output:
        pytest.skip('Linux refused AMX tile permission (kernel older than 5.16?)')
    assert any('amx' in kernel for kernel in conv_kernels(output)), output[-2000:]


@needs_bf16_kernels
def test_bf16_conv_with_opt_out():
    returncode, output = run_python(BF16_CONV, MXAMP_AMX='0')
    assert returncode == 0, output[-2000:]
    assert 'ENABLED=False ISA=None' in output
    kernels = conv_kernels(output)
    assert kernels and not any('amx' in kernel for kernel in kernels)


# What enable_amx relies on: oneDNN reads DNNL_MAX_CPU_ISA at its first
# primitive, not when libmxnet loads.  A low cap (SSE4.1) makes it visible on
# any x86-64 CPU.
ISA_TIMING = textwrap.dedent('''
    import os
    import mxnet as mx
    def conv():
        x, w = mx.nd.ones((1, 16, 8, 8)), mx.nd.ones((16, 16, 3, 3))
        mx.nd.Convolution(x, w, kernel=(3, 3), num_filter=16, no_bias=True).wait_to_read()
    if LATE:
        conv()
    os.environ['DNNL_MAX_CPU_ISA'] = 'SSE41'
    print('--- probe')
    conv()
''')


@pytest.mark.skipif('sse4_1' not in REAL_CPU_FLAGS or 'avx2' not in REAL_CPU_FLAGS,
                    reason='needs an x86-64 CPU better than SSE4.1 to see the cap')
@pytest.mark.parametrize('when, capped', [('early', True), ('late', False)])
def test_onednn_reads_isa_at_first_primitive(when, capped):
    returncode, output = run_python('LATE = %s\n' % (when == 'late') + ISA_TIMING)
    assert returncode == 0, output[-2000:]
    probe = conv_kernels(output.split('--- probe', 1)[1])
    assert probe, output[-2000:]
    assert ('sse41' in probe[0]) is capped, probe


def test_openmp_runtime_is_the_one_libmxnet_links():
    ours = '/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0'
    vendored = '/venv/site-packages/scikit_learn.libs/libgomp-a34b3233.so.1.0.0'
    assert hardware.mxnet_openmp_runtime([vendored, ours, '/usr/lib/libc.so.6']) == (ours, None)
    assert hardware.mxnet_openmp_runtime(['/opt/intel/lib/libiomp5.so']) == (
        '/opt/intel/lib/libiomp5.so', None)
    path, why = hardware.mxnet_openmp_runtime([vendored])
    assert path is None and vendored in why
    path, why = hardware.mxnet_openmp_runtime([ours, '/opt/intel/lib/libiomp5.so'])
    assert path is None and why.startswith('several OpenMP runtimes mapped')
    here = hardware.mxnet_openmp_threads()     # this process loaded MXNet
    assert here['openmp_threads'] >= 1, here
    assert os.path.basename(here['openmp_runtime']).startswith(hardware.MXNET_OPENMP_SONAMES)


def test_performance_variables_are_the_ones_that_change_how_mxnet_computes():
    env = {'OMP_NUM_THREADS': '2', 'MXNET_ENGINE_TYPE': 'NaiveEngine', 'DNNL_VERBOSE': '1',
           'HOME': '/root', 'MXAMP_AMX': '0', 'PATH': '/bin'}
    assert list(hardware.performance_variables(env)) == ['DNNL_VERBOSE', 'MXAMP_AMX', 'MXNET_ENGINE_TYPE',
                                                  'OMP_NUM_THREADS']


# --- where bfloat16 pays ('auto') ----------------------------------------------

@pytest.mark.parametrize('cpu, amx_enabled, isa, pays', [
    (('avx512_bf16',) + AVX512_CORE, False, None, True),                  # Zen 4, Cooper Lake
    (('avx512_bf16', 'amx_bf16') + AVX512_CORE, True, None, True),        # AMX enabled
    (('avx512_bf16', 'amx_bf16') + AVX512_CORE, False, None, False),      # AMX left off
    (('avx512_bf16', 'amx_bf16') + AVX512_CORE, False, 'AVX512_CORE_BF16', False),  # user's cap
    (('avx512_bf16', 'amx_bf16') + AVX512_CORE, False, 'AVX2', False),    # no bfloat16 kernels
    (('avx2',), False, None, False),
])
def test_auto_is_bfloat16_only_where_bfloat16_is_faster(flags, monkeypatch, cpu, amx_enabled,
                                                         isa, pays):
    flags(*cpu)
    monkeypatch.setattr(hardware, '_amx_enabled', amx_enabled)
    if isa:
        monkeypatch.setenv('DNNL_MAX_CPU_ISA', isa)
    monkeypatch.setattr(dtypes, '_warned_auto_float32', True)
    assert hardware.bfloat16_pays() is pays
    assert hardware.amx_left_off() is ('amx_bf16' in cpu and hardware.cpu_class() == 'avx512_bf16')
    assert dtypes.resolve_dtype('auto', mx.cpu()) == ('bfloat16' if pays else 'float32')
    assert dtypes.resolve_dtype('bfloat16', mx.cpu()) == 'bfloat16'  # explicit: kept


def test_auto_with_amx_left_off_says_why_and_what_bfloat16_does(flags, monkeypatch):
    # A Sapphire Rapids whose tiles Linux did not grant: the AVX512-BF16 kernels
    # trained ResNet-50 at 0.77x FP32 there, so 'auto' keeps FP32 and says how to
    # get the fast path.
    flags('avx512_bf16', 'amx_bf16', *AVX512_CORE)
    monkeypatch.setattr(dtypes, '_warned_auto_float32', False)
    with pytest.warns(RuntimeWarning) as record:
        assert dtypes.resolve_dtype('auto') == 'float32'
    assert len(record) == 1
    message = str(record[0].message)
    assert "'avx512_bf16' class CPU with its AMX tiles left off" in message
    assert 'MXAMP_AMX=0' in message and 'before 5.16' in message
    assert 'slower than float32' in message
    assert "dtype='bfloat16' still computes in bfloat16 here" in message
    assert 'storage' not in message and '\n' not in message
    assert 'AMX tiles left off' not in hardware.describe_cpu_class('avx512_bf16')  # a class alone
