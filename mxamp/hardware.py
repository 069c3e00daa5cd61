"""Hardware facts and the CPU fast-path set-up.

What the machine can do (CPU flags, usable CPUs, GPUs), how its CPU computes bfloat16
(`cpu_class`: four classes, capped by ``DNNL_MAX_CPU_ISA`` as oneDNN caps itself;
docs/hardware.rst), making oneDNN use AMX (`enable_amx`), and the OpenMP threads MXNet
computes with (`mxnet_openmp_threads`).  Which precision ``'auto'`` means is `mxamp.dtypes`'.

oneDNN 2.4.4 in MXNet 1.9.1 uses its AMX kernels only under
``DNNL_MAX_CPU_ISA=AVX512_CORE_AMX``, read once at its first primitive (not at ``import
mxnet``); Linux runs tile instructions only after ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``, else SIGILL.  libmxnet.so does not export oneDNN's C API: the
variable is the only handle.  ``MXAMP_AMX=0`` leaves AMX alone; a user's value is kept.
"""
import ctypes
import functools
import logging
import os
import platform
import sys
from types import FrameType
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple, cast

__all__ = ['cpu_flags', 'cpu_model', 'has_avx512_bf16', 'has_amx_bf16', 'usable_cpus', 'gpu_count',
           'cpu_class', 'computes_bfloat16', 'amx_left_off', 'bfloat16_pays', 'describe_cpu_class',
           'class_lowered_by', 'isa_cap',
           'enable_amx', 'describe', 'CPU_CLASSES', 'mxnet_openmp_threads', 'mxnet_openmp_runtime',
           'launch_environment', 'performance_variables', 'PERFORMANCE_VARIABLES',
           'MXNET_OPENMP_SONAMES']

logger = logging.getLogger('mxamp')

_AMX_ISA = 'AVX512_CORE_AMX'
# Linux x86-64 ABI: arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA.
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

# Result of the first enable_amx() call (None: not called yet).
_amx_enabled: Optional[bool] = None

AVX2, AVX512, AVX512_BF16, AMX = 'avx2', 'avx512', 'avx512_bf16', 'amx'
# Lowest first: a DNNL_MAX_CPU_ISA cap can only move a CPU down this list.
CPU_CLASSES = (AVX2, AVX512, AVX512_BF16, AMX)
# The classes where oneDNN 2.4.4 computes bfloat16 natively.
BFLOAT16_COMPUTE_CLASSES = frozenset((AVX512_BF16, AMX))

# oneDNN 2.4.4's DNNL_MAX_CPU_ISA values -> the highest class each allows.
_ISA_CAPS = {
    'SSE41': AVX2, 'AVX': AVX2, 'AVX2': AVX2, 'AVX2_VNNI': AVX2,
    'AVX512_MIC': AVX2, 'AVX512_MIC_4OPS': AVX2,   # Xeon Phi: no avx512_core
    'AVX512_CORE': AVX512, 'AVX512_CORE_VNNI': AVX512,
    'AVX512_CORE_BF16': AVX512_BF16,
    'AVX512_CORE_AMX': AMX, 'ALL': AMX,
}
# What oneDNN's avx512_core needs (Skylake-SP and later; AMD Zen 4).
_AVX512_CORE_FLAGS = frozenset(('avx512f', 'avx512bw', 'avx512vl', 'avx512dq'))

# Why enable_amx() leaves a CPU's AMX tiles off (its log line says which).
_AMX_OFF_WHY = ('MXAMP_AMX=0, a DNNL_MAX_CPU_ISA of the user, or Linux refused the tile '
                'permission: kernels before 5.16 cannot grant it')

_CLASS_TEXT = {
    AVX2: 'CPU without AVX-512: MXNet 1.9.1\'s oneDNN has no bfloat16 kernels',
    AVX512: 'AVX-512 CPU without AVX512-BF16: oneDNN emulates bfloat16, slower than float32',
    AVX512_BF16: 'CPU with AVX512-BF16: native bfloat16',
    AMX: 'CPU with AMX: native bfloat16 on AMX tiles',
}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> FrozenSet[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(':')
                if key.strip() == 'flags':
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform.processor()`` says."""
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            for line in cpuinfo:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def has_avx512_bf16() -> bool:
    """Whether the CPU has the AVX512-BF16 instructions (bfloat16 dot products)."""
    return 'avx512_bf16' in cpu_flags()


def has_amx_bf16() -> bool:
    """Whether the CPU has AMX bfloat16 tiles (Sapphire Rapids and later)."""
    return 'amx_bf16' in cpu_flags()


def _hardware_class():
    flags = cpu_flags()
    if not _AVX512_CORE_FLAGS <= flags:
        return AVX2
    if 'amx_bf16' in flags and _amx_enabled:
        return AMX
    if 'avx512_bf16' in flags or 'amx_bf16' in flags:
        return AVX512_BF16
    return AVX512


def isa_cap() -> Optional[str]:
    """The class ``DNNL_MAX_CPU_ISA`` limits oneDNN to; None when unset or unknown to oneDNN."""
    value = os.environ.get('DNNL_MAX_CPU_ISA')
    if value is None:
        return None
    return _ISA_CAPS.get(value.strip().upper())


def cpu_class() -> str:
    """How this CPU computes bfloat16: ``'avx2'``, ``'avx512'``, ``'avx512_bf16'`` or ``'amx'``.

    Its flags' class (``'amx'`` once `enable_amx` enabled it), lowered to what
    ``DNNL_MAX_CPU_ISA`` allows, read at each call (oneDNN reads it at its first primitive)."""
    found = _hardware_class()
    cap = isa_cap()
    if cap is not None and CPU_CLASSES.index(cap) < CPU_CLASSES.index(found):
        return cap
    return found


def computes_bfloat16(klass: Optional[str] = None) -> bool:
    """Whether CPU class `klass` (default: this CPU's) computes bfloat16 natively."""
    return (klass or cpu_class()) in BFLOAT16_COMPUTE_CLASSES


def amx_left_off() -> bool:
    """Whether this CPU has AMX tiles oneDNN does not use (`class_lowered_by` says why): its
    class is then ``'avx512_bf16'``, whose kernels are no faster than FP32 on this silicon."""
    return has_amx_bf16() and cpu_class() == AVX512_BF16


def bfloat16_pays() -> bool:
    """Whether bfloat16 computes faster than FP32 here, which ``'auto'`` follows:
    `computes_bfloat16`, but not with AMX left off (docs/hardware.rst)."""
    return computes_bfloat16() and not amx_left_off()


def describe_cpu_class(klass: Optional[str] = None) -> str:
    """One phrase naming CPU class `klass` (default: this CPU's, with a ``DNNL_MAX_CPU_ISA``
    that lowered it or AMX left off) and its bfloat16 support."""
    if klass is None:
        klass = cpu_class()
        if _lowered_by_isa_cap():
            return 'CPU limited by DNNL_MAX_CPU_ISA=%s to class %r (%s)' % (
                os.environ.get('DNNL_MAX_CPU_ISA'), klass, _CLASS_TEXT[klass])
        if amx_left_off():
            return ('%r class CPU with its AMX tiles left off (%s): bfloat16 runs on '
                    'AVX512-BF16 kernels, slower than float32 here' % (klass, _AMX_OFF_WHY))
    return '%r class %s' % (klass, _CLASS_TEXT[klass])


def _lowered_by_isa_cap() -> bool:
    """Whether ``DNNL_MAX_CPU_ISA`` is what keeps this CPU's class below its flags' class."""
    cap = isa_cap()
    return cap is not None and cap == cpu_class() and \
        CPU_CLASSES.index(cap) < CPU_CLASSES.index(_hardware_class())


def class_lowered_by() -> List[str]:
    """What keeps this CPU's class below its flags', in words (``DNNL_MAX_CPU_ISA``, AMX
    left off); empty when nothing."""
    why = []
    if _lowered_by_isa_cap():
        why.append('DNNL_MAX_CPU_ISA=%s' % os.environ.get('DNNL_MAX_CPU_ISA'))
    if has_amx_bf16() and not _amx_enabled:
        why.append('AMX left off (%s)' % _AMX_OFF_WHY)
    return why


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), as OpenMP counts them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') \
        else (os.cpu_count() or 1)


def gpu_count() -> int:
    """Number of GPUs MXNet sees; 0 on a CPU build or when the query fails."""
    import mxnet as mx  # here: only this answer needs MXNet; the CPU's come from the kernel
    try:
        return mx.context.num_gpus()
    except mx.base.MXNetError:
        return 0


# Prefixes of the variables that change how MXNet computes (benchmarks, `mxamp info`).
PERFORMANCE_VARIABLES = ('OMP_', 'KMP_', 'GOMP_', 'MXNET_', 'DNNL_', 'MKLDNN_', 'MXAMP_',
                         'LD_PRELOAD')
# The OpenMP runtimes libmxnet.so links (GNU, Intel), by soname.
MXNET_OPENMP_SONAMES = ('libgomp.so.1', 'libiomp5.so')


def launch_environment() -> Dict[str, str]:
    """The environment this process was started with (``/proc/self/environ``, else os.environ).

    Not ``os.environ``: scikit-learn (loaded by ``import mxnet``) sets ``KMP_*`` variables
    when imported, and `enable_amx` may set ``DNNL_MAX_CPU_ISA``."""
    try:
        with open('/proc/self/environ', 'rb') as handle:
            raw = handle.read()
    except OSError:
        return dict(os.environ)
    pairs = (entry.decode('utf-8', 'replace').partition('=') for entry in raw.split(b'\0') if entry)
    return {key: value for key, _, value in pairs}


def performance_variables(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The variables of `environ` (default: :func:`launch_environment`) that change how
    MXNet computes, sorted by name."""
    environ = launch_environment() if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(PERFORMANCE_VARIABLES)}


def _mapped_files() -> List[str]:
    """Paths of the files mapped into this process, once each, in address order."""
    paths = []
    with open('/proc/self/maps') as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith('/'):
                paths.append(fields[5].rstrip('\n'))
    return list(dict.fromkeys(paths))


def mxnet_openmp_runtime(paths: Sequence[str]) -> Tuple[Optional[str], Optional[str]]:
    """``(path, None)``: which mapped `paths` is the OpenMP runtime libmxnet.so links (by
    soname: packages map their own copies beside it), or ``(None, why)`` for none or several."""
    runtimes = [p for p in paths if os.path.basename(p).startswith(MXNET_OPENMP_SONAMES)]
    if len(runtimes) == 1:
        return runtimes[0], None
    if runtimes:
        return None, 'several OpenMP runtimes mapped: %s' % ', '.join(runtimes)
    others = [p for p in paths if os.path.basename(p).startswith(('libgomp', 'libiomp5'))]
    return None, 'no %s mapped (other OpenMP runtimes: %s)' % (
        ' or '.join(MXNET_OPENMP_SONAMES), ', '.join(others) or 'none')


def mxnet_openmp_threads() -> Dict[str, Any]:
    """The number of OpenMP threads MXNet computes with in this process.

    libmxnet.so fixes it on load (``OMP_NUM_THREADS``, else half the logical CPUs) for the
    loading thread: ask on the main thread.  Returns ``openmp_threads`` (or None),
    ``openmp_runtime`` (a path or None) and, when the count is None, ``openmp_unknown``."""
    path, why = mxnet_openmp_runtime(_mapped_files())
    if path is not None:
        try:
            # RTLD_NOLOAD: the copy libmxnet.so uses, never a fresh one with its own settings.
            runtime = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            return {'openmp_threads': int(runtime.omp_get_max_threads()), 'openmp_runtime': path}
        except (OSError, AttributeError) as exc:
            why = '%s: %s' % (path, exc)
    return {'openmp_threads': None, 'openmp_runtime': path, 'openmp_unknown': why}


def user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` that names the first frame outside mxamp and
    MXNet: mxamp's notes come from deep inside a conversion, about the user's line."""
    import mxnet
    # Two packages, both loaded from files: their __file__ is set.
    skip = tuple(os.path.dirname(os.path.abspath(cast(str, module.__file__))) + os.sep
                 for module in (sys.modules[__name__.rpartition('.')[0]], mxnet))
    level = 1
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        level, frame = level + 1, frame.f_back
    return level


def _request_amx_permission():
    """Ask Linux for AMX tile permission; True when granted (process-wide)."""
    if not sys.platform.startswith('linux') or platform.machine() != 'x86_64':
        return False  # the syscall number below is only arch_prctl on x86-64
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):
        return False
    syscall.restype = ctypes.c_long
    status = syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                     ctypes.c_long(_XFEATURE_XTILEDATA))
    if status != 0:
        logger.debug('mxamp: arch_prctl(ARCH_REQ_XCOMP_PERM) failed: %s',
                     os.strerror(ctypes.get_errno()))
    return status == 0


def enable_amx() -> bool:
    """Let oneDNN use the AMX bfloat16 kernels, when the CPU has them; True when it will.

    Asks Linux for the tile permission and, if granted, sets ``DNNL_MAX_CPU_ISA`` unless the
    user did.  Nothing under ``MXAMP_AMX=0``.  Only the first call acts.  Call it before the
    process's first oneDNN primitive; ``import mxnet`` before it is fine.
    """
    global _amx_enabled
    if _amx_enabled is None:
        _amx_enabled = _enable_amx_once()
    return _amx_enabled


def _enable_amx_once():
    if os.environ.get('MXAMP_AMX', '1').strip().lower() in ('0', 'false', 'no', 'off'):
        logger.debug('mxamp: AMX left alone (MXAMP_AMX=%s)', os.environ['MXAMP_AMX'])
        return False
    if not has_amx_bf16():
        return False
    user_isa = os.environ.get('DNNL_MAX_CPU_ISA')
    if not _request_amx_permission():
        if user_isa is not None and user_isa.upper() == _AMX_ISA:
            logger.warning('mxamp: DNNL_MAX_CPU_ISA=%s but Linux refused AMX tile '
                           'permission: oneDNN will crash with SIGILL', user_isa)
        else:
            logger.info('mxamp: CPU has AMX but Linux refused tile permission; '
                        'bfloat16 runs on AVX-512')
        return False
    if user_isa is not None:
        enabled = user_isa.upper() == _AMX_ISA
        logger.info('mxamp: AMX tile permission granted; DNNL_MAX_CPU_ISA=%s was set '
                    'by the user and kept (AMX kernels %s)', user_isa,
                    'enabled' if enabled else 'not enabled')
        return enabled
    os.environ['DNNL_MAX_CPU_ISA'] = _AMX_ISA
    logger.info('mxamp: AMX enabled for oneDNN bfloat16 (tile permission granted, '
                'DNNL_MAX_CPU_ISA=%s; takes effect if no oneDNN primitive ran yet)',
                _AMX_ISA)
    return True


def describe() -> Dict[str, Any]:
    """What mxamp found, for benchmarks and ``mxamp.summary``: ``avx512_bf16``, ``amx_bf16``,
    ``amx_enabled`` (`enable_amx`'s result), ``cpu_class``, ``dnnl_max_cpu_isa``, ``gpus``."""
    return {'avx512_bf16': has_avx512_bf16(), 'amx_bf16': has_amx_bf16(),
            'amx_enabled': bool(_amx_enabled), 'cpu_class': cpu_class(),
            'dnnl_max_cpu_isa': os.environ.get('DNNL_MAX_CPU_ISA'), 'gpus': gpu_count()}

