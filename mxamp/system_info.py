"""One screen about this machine and this install, for bug reports (``mxamp info``).

What mxamp would do here and why, for a user to paste into an issue (like
PyTorch's ``collect_env``): versions, the CPU class and what lowered it, what
``dtype='auto'`` picks, the kernel wing's state and the environment that
changes any of it.  It reads ``/proc`` and asks MXNet; it runs no operator.

Example
-------
>>> print(mxamp.system_info.format_info(mxamp.system_info.collect()))  # doctest: +ELLIPSIS
mxamp ...
"""
import importlib
import platform
from typing import Any, Dict, Optional

from . import dtypes, hardware
from .kernels import choice, operators
from ._version import __version__

__all__ = ['collect', 'format_info']

# The CPU flags that decide a CPU class (mxamp.hardware), shown as found.
_CLASS_FLAGS = ('avx2', 'avx512f', 'avx512bw', 'avx512vl', 'avx512dq', 'avx512_bf16', 'amx_bf16',
                'amx_tile')
# MXNet build features worth a line (mx.runtime.Features names).
_FEATURES = ('MKLDNN', 'OPENMP', 'CUDA', 'CUDNN', 'NCCL', 'TENSORRT', 'DIST_KVSTORE', 'BLAS_OPEN',
             'BLAS_MKL', 'INT64_TENSOR_SIZE')
_OPTIONAL_PACKAGES = ('ml_dtypes', 'gluoncv', 'tqdm', 'matplotlib')


def _version(module_name: str) -> Optional[str]:
    try:
        module = importlib.import_module(module_name)
    except Exception:  # any failure to import means: not usable here
        return None
    return getattr(module, '__version__', 'unknown')


def _auto() -> Dict[str, str]:
    """What ``dtype='auto'`` picks on this machine's CPU and GPU, and why."""
    cpu, why = dtypes.auto_on_this_cpu()
    answer = {'cpu': cpu, 'cpu_why': why, 'cpu_class': hardware.cpu_class()}
    if hardware.gpu_count():
        answer.update(gpu='float16', gpu_why='NVIDIA GPUs compute float16 on Tensor Cores')
    return answer


def _features() -> Dict[str, bool]:
    import mxnet as mx
    try:
        found = mx.runtime.Features()
    except Exception as exc:  # an MXNet build without the runtime query still gets a report
        return {'unknown': str(exc)}  # type: ignore[dict-item]
    return {name: found.is_enabled(name) for name in _FEATURES if name in found}


def collect() -> Dict[str, Any]:
    """Everything `format_info` prints, as a dict (JSON-ready).

    Returns
    -------
    dict
        ``versions``, ``cpu`` (model, usable CPUs, class flags, class, what
        lowered it, AMX), ``auto`` (what ``dtype='auto'`` picks, and why),
        ``gpus``, ``openmp``, ``mxnet_features``, ``environment`` (the
        variables that change how MXNet computes), ``own_conv``,
        ``own_conv_choice`` and ``channels_last`` (the kernel wing's
        ``describe`` lines).
    """
    import mxnet as mx
    import numpy as np
    versions = {'mxamp': __version__, 'mxnet': mx.__version__, 'numpy': np.__version__,
                'python': platform.python_version(), 'platform': platform.platform()}
    versions.update((name, _version(name)) for name in _OPTIONAL_PACKAGES)
    flags = hardware.cpu_flags()
    cpu = {'model': hardware.cpu_model(), 'usable_cpus': hardware.usable_cpus(),
           'class_flags': [f for f in _CLASS_FLAGS if f in flags],
           'class': hardware.cpu_class(), 'description': hardware.describe_cpu_class(),
           'lowered_by': hardware.class_lowered_by(), 'amx_enabled': hardware.enable_amx()}
    return {'versions': versions, 'cpu': cpu, 'auto': _auto(), 'gpus': hardware.gpu_count(),
            'openmp': hardware.mxnet_openmp_threads(), 'mxnet_features': _features(),
            'environment': hardware.performance_variables(), 'own_conv': operators.describe(),
            'own_conv_choice': choice.describe(),
            'channels_last': choice.describe_regions()}


def format_info(info: Dict[str, Any]) -> str:
    """`info` (from `collect`) as the screen ``mxamp info`` prints."""
    versions = info['versions']
    cpu = info['cpu']
    auto = info['auto']
    optional = ', '.join('%s %s' % (k, versions[k]) for k in _OPTIONAL_PACKAGES if versions.get(k))
    lines = ['mxamp %s, MXNet %s, numpy %s, Python %s' % (
        versions['mxamp'], versions['mxnet'], versions['numpy'], versions['python']),
        'platform: %s' % versions['platform'],
        'optional packages: %s' % (optional or 'none'),
        'CPU: %s, %d usable CPUs' % (cpu['model'], cpu['usable_cpus']),
        'CPU flags that decide the class: %s' % (', '.join(cpu['class_flags']) or 'none'),
        'CPU class: %s' % cpu['description'],
        'lowered by: %s' % ('; '.join(cpu['lowered_by']) or 'nothing'),
        'AMX: %s' % ('enabled' if cpu['amx_enabled'] else
                     'not available' if 'amx_bf16' not in cpu['class_flags'] else 'not enabled'),
        "dtype='auto' on the CPU: %s (%s)" % (auto['cpu'], auto['cpu_why'])]
    if 'gpu' in auto:
        lines.append("dtype='auto' on a GPU: %s (%s)" % (auto['gpu'], auto['gpu_why']))
    lines.append('GPUs MXNet sees: %d' % info['gpus'])
    openmp = info['openmp']
    lines.append('OpenMP threads MXNet computes with: %s' % (
        openmp['openmp_threads'] if openmp['openmp_threads'] is not None
        else 'unknown (%s)' % openmp.get('openmp_unknown')))
    features = info['mxnet_features']
    lines.append('MXNet build: %s' % ', '.join(
        '%s %s' % (name, 'on' if on else 'off') for name, on in features.items()))
    lines.append(info['own_conv'])
    lines.append(info['own_conv_choice'])
    lines.append(info['channels_last'])
    environment = info['environment']
    lines.append('environment: %s' % (' '.join('%s=%s' % kv for kv in environment.items())
                                      or 'none of OMP_*, KMP_*, MXNET_*, DNNL_*, MXAMP_* set'))
    return '\n'.join(lines)
