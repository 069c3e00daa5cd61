"""Hardware detection and the CPU fast-path set-up.

This module answers three questions for the rest of mxamp:

* what the machine can do: bfloat16 instructions on the CPU (``avx512_bf16``,
  ``amx_bf16`` from ``/proc/cpuinfo``) and the number of GPUs;
* which precision ``'auto'`` means for a context (:func:`resolve_dtype`);
* how to make oneDNN use the AMX bfloat16 kernels (:func:`enable_amx`).

AMX
---
oneDNN 2.4.4, built into MXNet 1.9.1, has AMX bfloat16 kernels but only uses them
when ``DNNL_MAX_CPU_ISA=AVX512_CORE_AMX`` is in the environment, and Linux only
lets a process execute AMX tile instructions after it asked for them with
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; the variable without the
permission kills the process with SIGILL.  :func:`enable_amx` (called when mxamp
is imported) asks for the permission and sets the variable only if the kernel
granted it.

oneDNN reads ``DNNL_MAX_CPU_ISA`` once, when the process creates its first
oneDNN primitive (the first convolution, fully connected layer, ...), not when
libmxnet is loaded: importing mxnet before mxamp is fine, running an MXNet
operator before importing mxamp is not (the setting is then silently ignored).
libmxnet.so does not export oneDNN's C API (``dnnl_set_max_cpu_isa``,
``dnnl_get_effective_cpu_isa``), so the environment variable is the only handle
and whether it arrived in time cannot be queried; ``DNNL_VERBOSE=1`` shows it
(AMX convolutions print ``avx512_core_amx`` in their kernel name).

Environment variables
---------------------
MXAMP_AMX
    ``0`` (or ``false``, ``no``, ``off``) stops mxamp from touching AMX: no
    permission request, no ``DNNL_MAX_CPU_ISA``.
DNNL_MAX_CPU_ISA
    When the user set it, mxamp leaves it alone (it still asks for the AMX
    permission, which a user value of ``AVX512_CORE_AMX`` needs).
"""
import ctypes
import functools
import logging
import os
import platform
import sys
import warnings

__all__ = ['cpu_flags', 'has_avx512_bf16', 'has_amx_bf16', 'gpu_count',
           'resolve_dtype', 'enable_amx', 'describe']

logger = logging.getLogger('mxamp')

_AMX_ISA = 'AVX512_CORE_AMX'
# Linux x86-64 ABI: arch_prctl syscall number, its "request extended state
# permission" command and the XSAVE feature number of the AMX tile data.
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

# Result of the first enable_amx() call (None: not called yet).
_amx_enabled = None
_warned_slow_bf16 = False


@functools.lru_cache(maxsize=None)
def cpu_flags():
    """The CPU feature flags of ``/proc/cpuinfo``, as a frozenset.

    Empty when the file is missing or unreadable (non-Linux systems), so every
    feature then reads as absent.
    """
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(':')
                if key.strip() == 'flags':
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def has_avx512_bf16():
    """Whether the CPU has the AVX512-BF16 instructions (bfloat16 dot products)."""
    return 'avx512_bf16' in cpu_flags()


def has_amx_bf16():
    """Whether the CPU has AMX bfloat16 tiles (Sapphire Rapids and later)."""
    return 'amx_bf16' in cpu_flags()


def gpu_count():
    """Number of GPUs MXNet sees; 0 on a CPU build or when the query fails."""
    import mxnet as mx  # here, so that `import mxamp` does not load libmxnet
    try:
        return mx.context.num_gpus()
    except mx.base.MXNetError:
        return 0


def resolve_dtype(dtype, ctx=None):
    """The precision name mxamp should use for `dtype` on `ctx`.

    Parameters
    ----------
    dtype : str, numpy dtype or type
        ``'auto'``, or anything :func:`mxamp.dtypes.dtype_name` accepts
        (``'bfloat16'``, ``'bf16'``, ``numpy.float16``, ...).
    ctx : mxnet.Context or list of Context, optional
        Where the model runs (the first context of a list decides).  None means
        "this machine": a GPU when there is one.

    Returns
    -------
    str
        ``'float32'``, ``'float16'`` or ``'bfloat16'``.  ``'auto'`` gives
        ``'float16'`` on a GPU and ``'bfloat16'`` on a CPU.  On a CPU without
        avx512_bf16 or amx_bf16, oneDNN emulates bfloat16 and runs slower than
        float32; ``'auto'`` still gives ``'bfloat16'`` (the memory saving and the
        numerics are the same) and warns once per process.

    Raises
    ------
    ValueError
        When `dtype` is neither ``'auto'`` nor a known precision.
    """
    from .dtypes import dtype_name
    if not (isinstance(dtype, str) and dtype.lower() == 'auto'):
        return dtype_name(dtype)
    if isinstance(ctx, (list, tuple)):
        ctx = ctx[0] if ctx else None
    on_gpu = gpu_count() > 0 if ctx is None else ctx.device_type == 'gpu'
    if on_gpu:
        return 'float16'
    if not (has_avx512_bf16() or has_amx_bf16()):
        global _warned_slow_bf16
        if not _warned_slow_bf16:
            _warned_slow_bf16 = True
            warnings.warn("dtype='auto' chose bfloat16, but this CPU has neither "
                          "avx512_bf16 nor amx_bf16: oneDNN emulates bfloat16 and "
                          "will be slower than float32 here", RuntimeWarning,
                          stacklevel=2)
    return 'bfloat16'


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


def enable_amx():
    """Let oneDNN use the AMX bfloat16 kernels, when the CPU has them.

    Asks Linux for AMX tile permission and, only when it was granted, sets
    ``DNNL_MAX_CPU_ISA=AVX512_CORE_AMX`` unless the user set
    ``DNNL_MAX_CPU_ISA`` already.  Does nothing when the CPU lacks amx_bf16 or
    ``MXAMP_AMX=0``.  Only the first call acts; later calls return its result.
    It must run before the process's first oneDNN primitive (any MXNet
    convolution, fully connected layer...); ``import mxnet`` before it is fine.

    Returns
    -------
    bool
        True when the permission is granted and ``DNNL_MAX_CPU_ISA`` selects AMX.
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


def describe():
    """What mxamp found, for benchmarks and ``mxamp.summary``.

    Returns
    -------
    dict
        ``avx512_bf16``, ``amx_bf16``, ``amx_enabled`` (bools; ``amx_enabled`` is
        the result of :func:`enable_amx`, False before it ran) and ``gpus`` (int).
    """
    return {'avx512_bf16': has_avx512_bf16(), 'amx_bf16': has_amx_bf16(),
            'amx_enabled': bool(_amx_enabled), 'gpus': gpu_count()}
