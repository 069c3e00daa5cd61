"""mxamp's own oneDNN 3 operators: the built library, its switch, and the calls into it.

MXNet 1.9.1's built-in oneDNN 2.4 is far behind oneDNN 3 on AMX CPUs.  mxamp's library
(``csrc/``, built at install) runs on oneDNN 3.2 (GNU OpenMP like MXNet: one thread pool) as native
MXNet operators of the extension-library ABI (``MXLoadLib``, ``MX_LIBRARY_VERSION`` 11), which has
no write request: gradients are written, never added (docs/own-convolution.rst, "How it plugs
into MXNet").  This module reads the wing's switch, loads the library once, reports on it and
calls the operators from NDArray, Symbol and Gluon code; `mxamp.kernels.choice` decides where
they run.

Environment variables
---------------------
MXAMP_KERNELS
    The wing's one switch.  ``0`` (``false``, ``no``, ``off``): the library stays unloaded, no
    own operator runs.  Unset or ``1``: own convolutions and channels-last regions where
    `mxamp.kernels.choice`'s measurements say they pay, the other own operators wherever the
    library loads.  ``all``: every eligible convolution on the own operator and regions wherever
    bfloat16 computes (to measure both ways).

MXNet internals relied on
-------------------------
``MXLoadLib`` and ``NNGetOpHandle`` (through ``mxnet.base._LIB``), and
``_make_ndarray_function`` / ``_make_symbol_function``: ``mx.library.load`` would regenerate
every operator's Python function, undoing monkey patches of ``mx.nd`` (``contrib.amp``'s).
"""
import ctypes
import importlib.metadata
import logging
import os
import threading
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import mxnet as mx
from mxnet.base import _LIB, c_str, check_call, mx_uint
from mxnet.ndarray.register import _make_ndarray_function
from mxnet.symbol.register import _make_symbol_function

__all__ = ['OP_NAME', 'FOLLOW_OP_NAME', 'BATCH_NORM_OP_NAME', 'FAN_OUT_OP_NAME',
           'MOVE_CHANNELS_OP_NAME', 'POOLING_OP_NAME', 'SGD_STEP_OP_NAME', 'ADAM_STEP_OP_NAME',
           'CLIP_OP_NAME', 'adam_step_bfloat16',
           'SELFATT_QK_OP_NAME', 'SELFATT_VALATT_OP_NAME', 'LAYER_NORM_OP_NAME', 'selfatt_qk',
           'selfatt_valatt', 'layer_norm', 'MASKED_SOFTMAX_OP_NAME', 'masked_softmax',
           'DROPOUT_OP_NAME', 'dropout',
           'follow_bfloat16_weight', 'sgd_step_bfloat16', 'OwnConvStatus', 'OwnConvUnavailable',
           'ENV', 'status', 'available', 'describe', 'mode', 'require_loaded', 'convolution',
           'batch_norm', 'fan_out', 'move_channels', 'pooling', 'clip', 'kernels', 'library_path']

logger = logging.getLogger('mxamp')

#: The wing's one switch (see the module's environment variables).
ENV = 'MXAMP_KERNELS'

#: The operator's name in MXNet (its gradient: ``_backward__mxamp_convolution``).
OP_NAME = '_mxamp_convolution'
#: The master-weight follow operator's name in MXNet (no gradient).
FOLLOW_OP_NAME = '_mxamp_follow_weight'
#: The batch normalisation operator's name in MXNet (its gradient: ``_backward__mxamp_batch_norm``).
BATCH_NORM_OP_NAME = '_mxamp_batch_norm'
#: The fan-out operator's name in MXNet (its gradient: ``_backward__mxamp_fan_out``).
FAN_OUT_OP_NAME = '_mxamp_fan_out'
#: The channel-moving operator's name in MXNet (its gradient: ``_backward__mxamp_move_channels``).
MOVE_CHANNELS_OP_NAME = '_mxamp_move_channels'
#: The pooling operator's name in MXNet (its gradient: ``_backward__mxamp_pooling``).
POOLING_OP_NAME = '_mxamp_pooling'
#: The SGD step operator's name in MXNet (no gradient): see :func:`sgd_step_bfloat16`.
SGD_STEP_OP_NAME = '_mxamp_sgd_step'
#: The Adam step operator's name in MXNet (no gradient): see :func:`adam_step_bfloat16`.
ADAM_STEP_OP_NAME = '_mxamp_adam_step'
#: The clip operator's name in MXNet (its gradient: ``_backward__mxamp_clip``): see :func:`clip`.
CLIP_OP_NAME = '_mxamp_clip'
#: The self-attention products' names in MXNet (gradients: ``_backward_`` + the name): see
#: :func:`selfatt_qk` and :func:`selfatt_valatt`.
SELFATT_QK_OP_NAME = '_mxamp_selfatt_qk'
SELFATT_VALATT_OP_NAME = '_mxamp_selfatt_valatt'
#: The layer normalisation's name in MXNet (its gradient: ``_backward__mxamp_layer_norm``): see
#: :func:`layer_norm`.
LAYER_NORM_OP_NAME = '_mxamp_layer_norm'
#: The softmax with a length's name in MXNet (its gradient: ``_backward__mxamp_masked_softmax``):
#: see :func:`masked_softmax`.
MASKED_SOFTMAX_OP_NAME = '_mxamp_masked_softmax'
#: The dropout's name in MXNet (its gradient: ``_backward__mxamp_dropout``): see :func:`dropout`.
DROPOUT_OP_NAME = '_mxamp_dropout'
#: Every operator the library registers.
_OPERATORS = (OP_NAME, FOLLOW_OP_NAME, BATCH_NORM_OP_NAME, FAN_OUT_OP_NAME, MOVE_CHANNELS_OP_NAME,
              POOLING_OP_NAME, SGD_STEP_OP_NAME, ADAM_STEP_OP_NAME, CLIP_OP_NAME, SELFATT_QK_OP_NAME,
              SELFATT_VALATT_OP_NAME, LAYER_NORM_OP_NAME, MASKED_SOFTMAX_OP_NAME,
              DROPOUT_OP_NAME)

_NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_native')
_LIBRARY_NAME = 'libmxamp_own_conv.so'
_NOT_BUILT_NOTE = 'own_conv_not_built.txt'
_ONEDNN_DISTRIBUTION = 'onednn-cpu-gomp'
_ONEDNN_SONAME = 'libdnnl.so.3'
_OFF_VALUES = ('0', 'false', 'no', 'off')
_ON_VALUES = ('', '1', 'true', 'yes', 'on')
_EVERYWHERE = 'all'
# MXNet's type flags (mshadow) of the data types the operator computes in.
_DTYPE_FLAGS = {'float32': 0, 'float16': 2, 'bfloat16': 12}


class OwnConvUnavailable(RuntimeError):
    """mxamp's own convolution cannot run in this process; the message says why."""


class OwnConvStatus(NamedTuple):
    """Where mxamp's own operators stand: built at install, not switched off, loaded; when loaded,
    oneDNN's version ("3.2.0") and the instruction set it uses here; else why they cannot run."""

    built: bool
    enabled: bool
    loaded: bool
    onednn_version: Optional[str]
    cpu_isa: Optional[str]
    reason: Optional[str]


class _Loaded(NamedTuple):
    library: Any
    nd: Dict[str, Callable[..., Any]]  # each operator's NDArray function, by its name
    sym: Dict[str, Callable[..., Any]]  # and its Symbol function
    onednn_version: str
    cpu_isa: str


_lock = threading.Lock()
_loaded: Optional[_Loaded] = None
_failure: Optional[str] = None
_failure_said = False


def library_path() -> str:
    """Where the built library is (or would be): ``mxamp/_native/libmxamp_own_conv.so``."""
    return os.path.join(_NATIVE_DIR, _LIBRARY_NAME)


def mode() -> str:
    """``MXAMP_KERNELS`` read: ``'off'``, ``'measured'`` (the default) or ``'all'``.

    Raises
    ------
    ValueError
        For any other value.
    """
    value = os.environ.get(ENV, '1').strip().lower()
    if value in _OFF_VALUES:
        return 'off'
    if value in _ON_VALUES:
        return 'measured'
    if value == _EVERYWHERE:
        return 'all'
    raise ValueError('%s=%s: expected 0 (off), 1 (the measured choice, the default) or all'
                     % (ENV, os.environ[ENV]))


def _switched_off() -> bool:
    return mode() == 'off'


def _not_built_reason() -> str:
    try:
        with open(os.path.join(_NATIVE_DIR, _NOT_BUILT_NOTE)) as handle:
            why = handle.read().strip()
    except OSError:
        why = 'no build ran'
    return ('not built when mxamp was installed (%s); install a C++ compiler and reinstall '
            'mxamp to build it' % why)


def _onednn_library() -> str:
    try:
        files = importlib.metadata.distribution(_ONEDNN_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        raise OwnConvUnavailable('%s is not installed (it carries oneDNN 3)'
                                 % _ONEDNN_DISTRIBUTION) from None
    for entry in files:
        if entry.name == _ONEDNN_SONAME:
            return os.path.normpath(str(entry.locate()))
    raise OwnConvUnavailable('%s lists no %s' % (_ONEDNN_DISTRIBUTION, _ONEDNN_SONAME))


def _load() -> _Loaded:
    path = library_path()
    if not os.path.exists(path):
        raise OwnConvUnavailable(_not_built_reason())
    onednn = _onednn_library()
    try:
        # Before MXNet opens ours: the loader then finds libdnnl.so.3 loaded (matched by soname).
        ctypes.CDLL(onednn)
    except OSError as error:
        raise OwnConvUnavailable('cannot load %s: %s' % (onednn, error)) from None
    try:
        check_call(_LIB.MXLoadLib(c_str(path), mx_uint(0)))
    except mx.base.MXNetError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else 'MXNetError'
        raise OwnConvUnavailable('MXNet refused %s: %s' % (path, first_line)) from None
    library = ctypes.CDLL(path)
    for name in ('mxamp_own_conv_onednn_version', 'mxamp_own_conv_cpu_isa',
                 'mxamp_own_conv_last_error', 'mxamp_own_conv_kernels'):
        getattr(library, name).restype = ctypes.c_char_p
    nd, sym = {}, {}
    for name in _OPERATORS:
        handle = ctypes.c_void_p()
        check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
        nd[name] = _make_ndarray_function(handle, name, name)
        sym[name] = _make_symbol_function(handle, name, name)
    return _Loaded(library=library, nd=nd, sym=sym,
                   onednn_version=library.mxamp_own_conv_onednn_version().decode(),
                   cpu_isa=library.mxamp_own_conv_cpu_isa().decode())


def _ensure_loaded() -> Optional[_Loaded]:
    global _loaded, _failure
    if _switched_off():
        return None
    with _lock:
        if _loaded is None and _failure is None:
            try:
                _loaded = _load()
            except OwnConvUnavailable as error:
                _failure = str(error)
        return _loaded


def status() -> OwnConvStatus:
    """Where mxamp's own operators stand; loads the library on first call unless switched off."""
    built = os.path.exists(library_path())
    if _switched_off():
        return OwnConvStatus(built, False, False, None, None,
                             'switched off (%s=%s)' % (ENV, os.environ[ENV]))
    loaded = _ensure_loaded()
    if loaded is None:
        return OwnConvStatus(built, True, False, None, None, _failure)
    return OwnConvStatus(built, True, True, loaded.onednn_version, loaded.cpu_isa, None)


def available() -> bool:
    """Whether the operators can run here; the first time they cannot, says why in the log."""
    global _failure_said
    # The optimizer's fast step asks before each parameter's update: once loaded, the
    # answer needs no look at the file system (status() checks the library file).
    if _loaded is not None and not _switched_off():
        return True
    state = status()
    if not state.loaded and not _failure_said:
        _failure_said = True
        level = logging.INFO if not state.enabled else logging.WARNING
        logger.log(level, "mxamp: own oneDNN 3 convolution off, MXNet's Convolution runs instead: %s",
                   state.reason)
    return state.loaded


def describe() -> str:
    """One line for ``mxamp info``: the state of mxamp's own operators."""
    state = status()
    if state.loaded:
        return 'own convolution: on (oneDNN %s, %s)' % (state.onednn_version, state.cpu_isa)
    return 'own convolution: off, %s' % state.reason


def require_loaded() -> None:
    """Load the library (registering the operator in MXNet), or raise `OwnConvUnavailable`."""
    _require()


def _require() -> _Loaded:
    loaded = _ensure_loaded()
    if loaded is None:
        raise OwnConvUnavailable("mxamp's own convolution is off: %s" % status().reason)
    return loaded


def _tuple(value: Any) -> Tuple[int, ...]:
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _attributes(kernel: Sequence[int], num_filter: int, stride: Optional[Sequence[int]],
                dilate: Optional[Sequence[int]], pad: Optional[Sequence[int]], num_group: int,
                no_bias: bool, channels_last: bool = False) -> dict:
    attributes = {'kernel': _tuple(kernel), 'num_filter': int(num_filter),
                  'num_group': int(num_group), 'no_bias': bool(no_bias)}
    if channels_last:
        attributes['channels_last'] = True
    for key, value in (('stride', stride), ('dilate', dilate), ('pad', pad)):
        if value is not None:
            attributes[key] = _tuple(value)
    return attributes


def convolution(data: Any, weight: Any, bias: Any = None, *, kernel: Sequence[int],
                num_filter: int, stride: Optional[Sequence[int]] = None,
                dilate: Optional[Sequence[int]] = None, pad: Optional[Sequence[int]] = None,
                num_group: int = 1, channels_last: bool = False,
                name: Optional[str] = None) -> Any:
    """MXNet's ``Convolution`` (its attributes, 1 to 3 spatial dimensions) on mxamp's operator.

    NDArrays run now (and record for autograd); Symbols make a graph node named `name`.  With
    `channels_last`, data and output are ``(N, spatial..., C)``, the layout oneDNN 3's AMX kernels
    compute in; the weight keeps MXNet's.  `bias` None: no bias.  Every operator function here
    takes NDArrays or Symbols alike and raises `OwnConvUnavailable` when the library cannot run.
    """
    loaded = _require()
    attributes = _attributes(kernel, num_filter, stride, dilate, pad, num_group, bias is None,
                             channels_last)
    inputs = [data, weight] + ([] if bias is None else [bias])
    if isinstance(data, mx.sym.Symbol):
        return loaded.sym[OP_NAME](*inputs, name=name, **attributes)
    return loaded.nd[OP_NAME](*inputs, **attributes)


def batch_norm(data: Any, gamma: Any, beta: Any, moving_mean: Any, moving_var: Any, *,
               eps: float = 1e-3, momentum: float = 0.9, fix_gamma: bool = True,
               use_global_stats: bool = False, axis: int = 1, act_type: Optional[str] = None,
               residual: Any = None, copies: int = 0, name: Optional[str] = None) -> Any:
    """Training-mode ``BatchNorm`` on mxamp's operator, channels second or last.

    MXNet 1.9.1's ``BatchNorm`` runs a scalar loop on channels-last data.  The extension ABI does
    not say whether MXNet trains, so this normalises with the batch statistics (unless
    `use_global_stats`) and inference graphs keep MXNet's.  The backward pass updates the moving
    statistics in place, which MXNet 1.9.1's engine is not told (``_backward_BatchNorm`` declares
    no mutated input): read them after ``mx.nd.waitall()`` or a trainer step.  `data` is float32
    or bfloat16, 3 to 5 dimensions, the other inputs float32 ``(C,)`` of known shapes; `act_type`
    ``'relu'`` adds a ReLU, `residual` an array before it, `copies` copies of the output for
    further readers (their gradients summed).  Returns the output, the batch mean and variance,
    then the copies.

    Raises
    ------
    ValueError
        For a Symbol variable among gamma, beta and the statistics with no shape.
    """
    loaded = _require()
    attributes: Dict[str, Any] = {
        'eps': eps, 'momentum': momentum, 'fix_gamma': bool(fix_gamma),
        'use_global_stats': bool(use_global_stats), 'axis': int(axis)}
    if act_type is not None:
        attributes['act_type'] = act_type
    inputs = [data, gamma, beta, moving_mean, moving_var]
    if residual is not None:
        attributes['residual'] = True
        inputs.append(residual)
    if copies:
        attributes['copies'] = int(copies)
    if isinstance(data, mx.sym.Symbol):
        for what, symbol in zip(('gamma', 'beta', 'moving_mean', 'moving_var'), inputs[1:]):
            _require_known_shape(what, symbol)
        return loaded.sym[BATCH_NORM_OP_NAME](*inputs, name=name, **attributes)
    return loaded.nd[BATCH_NORM_OP_NAME](*inputs, **attributes)


def fan_out(data: Any, num_outputs: int, *, name: Optional[str] = None) -> Any:
    """`num_outputs` (2 or more) copies of float32 or bfloat16 `data`; its gradient sums theirs.

    For the readers of a shared array: MXNet 1.9.1's ``add_n`` is a scalar loop on bfloat16."""
    loaded = _require()
    if isinstance(data, mx.sym.Symbol):
        return loaded.sym[FAN_OUT_OP_NAME](data, num_outputs=int(num_outputs), name=name)
    return loaded.nd[FAN_OUT_OP_NAME](data, num_outputs=int(num_outputs))


def move_channels(data: Any, *, to: str = 'last', name: Optional[str] = None) -> Any:
    """`data`'s channels moved last (``to='last'``) or back second (``to='first'``): exact copies.

    MXNet 1.9.1's ``transpose`` corrupts memory on bfloat16 arrays with oneDNN (`mxamp.policy`):
    channels-last regions move bfloat16 arrays across their borders with this.

    Examples
    --------
    >>> x = mx.nd.arange(24).reshape((1, 2, 3, 4))
    >>> mxamp.kernels.operators.move_channels(x, to='last')[0, 0, 1].asnumpy()
    array([ 1., 13.], dtype=float32)
    """
    if to not in ('last', 'first'):
        raise ValueError("to=%r: expected 'last' or 'first'" % (to,))
    loaded = _require()
    if isinstance(data, mx.sym.Symbol):
        return loaded.sym[MOVE_CHANNELS_OP_NAME](data, to=to, name=name)
    return loaded.nd[MOVE_CHANNELS_OP_NAME](data, to=to)


def clip(data: Any, a_min: float, a_max: float, *, name: Optional[str] = None) -> Any:
    """float32 or bfloat16 `data` clipped to [`a_min`, `a_max`]: MXNet's ``clip``, vectorised.

    MXNet 1.9.1's ``clip`` (a ReLU6) and its gradient are scalar loops on a CPU.  MXNet's values
    bit for bit, except that bfloat16 bounds round to nearest where MXNet truncates them.

    Examples
    --------
    >>> mxamp.kernels.operators.clip(mx.nd.array([-1, 3, 7]), 0, 6).asnumpy()
    array([0., 3., 6.], dtype=float32)
    """
    loaded = _require()
    if isinstance(data, mx.sym.Symbol):
        return loaded.sym[CLIP_OP_NAME](data, a_min=a_min, a_max=a_max, name=name)
    return loaded.nd[CLIP_OP_NAME](data, a_min=a_min, a_max=a_max)


def selfatt_qk(projection: Any, *, heads: int, name: Optional[str] = None) -> Any:
    """Self-attention scores of a head-interleaved projection: MXNet's
    ``contrib.interleaved_matmul_selfatt_qk``, in float32 or bfloat16.

    `projection` is (sequence, batch, heads * 3 * head_dim), each head's query, key and value
    side by side; the scores are (batch * heads, sequence, sequence), q k^T / sqrt(head_dim).
    MXNet 1.9.1 computes them only in float32 on a CPU; here bfloat16 runs oneDNN 3's matmul,
    accumulating in float32, and the scale applies before the one rounding.

    Examples
    --------
    >>> qkv = mx.nd.ones((4, 2, 2 * 3 * 8))
    >>> mxamp.kernels.operators.selfatt_qk(qkv, heads=2).shape
    (4, 4, 4)
    """
    loaded = _require()
    if isinstance(projection, mx.sym.Symbol):
        return loaded.sym[SELFATT_QK_OP_NAME](projection, heads=heads, name=name)
    return loaded.nd[SELFATT_QK_OP_NAME](projection, heads=heads)


def selfatt_valatt(projection: Any, attention: Any, *, heads: int,
                   name: Optional[str] = None) -> Any:
    """The attention-weighted values of a head-interleaved projection: MXNet's
    ``contrib.interleaved_matmul_selfatt_valatt``, in float32 or bfloat16.

    `attention` is (batch * heads, sequence, sequence), as :func:`selfatt_qk` gives the scores;
    the output is (sequence, batch, heads * head_dim).

    Examples
    --------
    >>> qkv = mx.nd.ones((4, 2, 2 * 3 * 8))
    >>> attention = mx.nd.softmax(mxamp.kernels.operators.selfatt_qk(qkv, heads=2))
    >>> mxamp.kernels.operators.selfatt_valatt(qkv, attention, heads=2).shape
    (4, 2, 16)
    """
    loaded = _require()
    if isinstance(projection, mx.sym.Symbol):
        return loaded.sym[SELFATT_VALATT_OP_NAME](projection, attention, heads=heads, name=name)
    return loaded.nd[SELFATT_VALATT_OP_NAME](projection, attention, heads=heads)


def layer_norm(data: Any, gamma: Any, beta: Any, *, eps: float = 1e-5,
               name: Optional[str] = None) -> Any:
    """MXNet's ``LayerNorm`` over the last axis on oneDNN 3: `data` float32 or bfloat16,
    `gamma`, `beta` and the statistics float32.

    Returns the output (`data`'s dtype) and the rows' mean and variance (float32, one value a
    row), which its gradient reads.  MXNet 1.9.1's CPU gradient of ``LayerNorm`` is a generic
    loop several times slower.

    Examples
    --------
    >>> x = mx.nd.array([[1, 2, 3], [2, 2, 2]])
    >>> out, mean, variance = mxamp.kernels.operators.layer_norm(x, mx.nd.ones(3), mx.nd.zeros(3))
    >>> mean.asnumpy()
    array([2., 2.], dtype=float32)
    """
    loaded = _require()
    if isinstance(data, mx.sym.Symbol):
        return loaded.sym[LAYER_NORM_OP_NAME](data, gamma, beta, eps=eps, name=name)
    return loaded.nd[LAYER_NORM_OP_NAME](data, gamma, beta, eps=eps)


def masked_softmax(data: Any, length: Any, *, name: Optional[str] = None) -> Any:
    """MXNet's ``softmax(data, length, axis=-1, use_length=True)``, vectorised: `data` float32,
    `length` int32 or int64 of `data`'s shape without its last axis.

    Each row's first ``length`` values get their softmax, the rest 0 (all of a row of length
    0); a length below 0 or beyond the row counts as 0 or the row's (MXNet reads and writes
    outside the row there).  Its gradient reaches `data` only.  MXNet 1.9.1 computes this
    softmax and its gradient in a scalar loop on a CPU; the values are MXNet's to float32's
    rounding.

    Raises
    ------
    ValueError
        For a Symbol variable as `length` with no shape.

    Examples
    --------
    >>> scores = mx.nd.array([[1, 2, 3], [1, 1, 1]])
    >>> weights = mxamp.kernels.operators.masked_softmax(scores, mx.nd.array([2, 0], dtype='int32'))
    >>> weights.asnumpy().round(4)
    array([[0.2689, 0.7311, 0.    ],
           [0.    , 0.    , 0.    ]], dtype=float32)
    """
    loaded = _require()
    if isinstance(data, mx.sym.Symbol):
        _require_known_shape('length', length)
        return loaded.sym[MASKED_SOFTMAX_OP_NAME](data, length, axis=-1, name=name)
    return loaded.nd[MASKED_SOFTMAX_OP_NAME](data, length, axis=-1)


def dropout(data: Any, p: float = 0.5, *, name: Optional[str] = None) -> Any:
    """MXNet's ``Dropout`` as it trains (``mode='training'``, no ``axes``), vectorised:
    `data` float32 or bfloat16.

    Returns the output (`data`'s dtype) and the mask its gradient reads, one bit a value as
    MXNet's ``Dropout`` keeps it (uint8, (bytes,): bit i % 8 of byte i // 8 set where value i
    of the flattened data was kept).  Each value is kept with probability 1 - `p` and
    scaled by 1 / (1 - `p`) (in float32, a bfloat16 value rounded once), as MXNet computes
    it; `p` 0 is the identity; `p` 1 gives zeros (MXNet 1.9.1: NaN).  It always drops: the
    extension ABI does not say whether MXNet trains.  Each call draws its random bits' seed
    from MXNet's random state (``mx.random.seed`` makes runs repeat); the bits of a value
    depend on the seed and its index alone, not on the thread count (``csrc/dropout.h``).
    MXNet 1.9.1's own CPU ``Dropout`` draws each value from a Mersenne twister in a scalar loop.

    Examples
    --------
    >>> out, mask = mxamp.kernels.operators.dropout(mx.nd.ones((2, 4)), p=0.5)
    >>> kept = np.unpackbits(mask.asnumpy(), bitorder='little').reshape(2, 4)
    >>> bool((out.asnumpy() == 2 * kept).all())   # kept: 1 / (1 - p); dropped: 0
    True
    """
    loaded = _require()
    if isinstance(data, mx.sym.Symbol):
        return loaded.sym[DROPOUT_OP_NAME](data, p=float(p), name=name)
    return loaded.nd[DROPOUT_OP_NAME](data, p=float(p))


def pooling(data: Any, *, kernel: Sequence[int] = (), pool_type: str = 'max',
            stride: Optional[Sequence[int]] = None, pad: Optional[Sequence[int]] = None,
            global_pool: bool = False, count_include_pad: bool = True,
            channels_last: bool = False, name: Optional[str] = None) -> Any:
    """Max or average ``Pooling`` (MXNet's attributes, 'valid' convention) on mxamp's operator.

    With `channels_last`, data ``(N, spatial..., C)``, which MXNet 1.9.1 has no CPU pooling for.
    `data` is float32 or bfloat16, 3 to 5 dimensions; `pad` below `kernel`.  Max pooling has a
    second output, the workspace its gradient reads.
    """
    loaded = _require()
    if pool_type not in ('max', 'avg'):
        raise ValueError("pool_type=%r: mxamp's pooling takes 'max' or 'avg'" % (pool_type,))
    attributes: Dict[str, Any] = {'pool_type': pool_type, 'global_pool': bool(global_pool),
                                  'count_include_pad': bool(count_include_pad),
                                  'channels_last': bool(channels_last)}
    if not global_pool:
        attributes['kernel'] = _tuple(kernel)
        if stride is not None:
            attributes['stride'] = _tuple(stride)
        if pad is not None:
            attributes['pad'] = _tuple(pad)
    if isinstance(data, mx.sym.Symbol):
        return loaded.sym[POOLING_OP_NAME](data, name=name, **attributes)
    return loaded.nd[POOLING_OP_NAME](data, **attributes)


def _require_known_shape(what: str, symbol: mx.sym.Symbol) -> None:
    """Refuse a statistics or length input of unknown shape: MXNet 1.9.1's shape inference for
    extension operators (``src/c_api/c_api.cc``) sizes its buffer by the inputs' dimension
    counts, an unknown shape counting -1, so unknown shapes write past it and kill the process."""
    if symbol.get_children() is None and '__shape__' not in (symbol.list_attr() or {}):
        raise ValueError('%s (%s) has no shape: give it one (mx.sym.var(name, shape=...)); '
                         "MXNet's shape inference for extension operators cannot infer it"
                         % (what, symbol.name))


def follow_bfloat16_weight(master: mx.nd.NDArray, weight: mx.nd.NDArray) -> None:
    """`master` restarts from `weight` wherever `weight` no longer holds `master` rounded.

    `mxamp.optimizer.follow_weight` for float32 `master`, bfloat16 `weight` (any oneDNN layout), in
    one asynchronous pass: rounded as ``amp_cast``, compared as floats (NaN equals nothing)."""
    _require().nd[FOLLOW_OP_NAME](master, weight, out=master)


def sgd_step_bfloat16(weight: mx.nd.NDArray, grad: mx.nd.NDArray, master: mx.nd.NDArray,
                      momentum_state: Optional[mx.nd.NDArray], *, lr: float, wd: float,
                      momentum: float, rescale_grad: float, clip_gradient: float,
                      follow: bool) -> mx.nd.NDArray:
    """One SGD step on the FP32 `master` copy of a bfloat16 `weight`, in one pass.

    Replaces the four MXNet passes of `mxamp.optimizer`'s generic path for ``mx.optimizer.SGD``
    with the same float32 expression operand for operand, so the same numbers; asynchronous.
    `weight` and `grad` are bfloat16 (`weight` read, not written); `master` and `momentum_state`
    (None when `momentum` is 0) float32, updated in place; the hyperparameters MXNet SGD's (a
    negative `clip_gradient`: no clipping); `follow`: `mxamp.optimizer.follow_weight` first.
    Returns the new weight (bfloat16, MXNet's layout), for the caller to copy into `weight`.
    """
    inputs = [weight, grad, master] + ([] if momentum == 0 else [momentum_state])
    return _require().nd[SGD_STEP_OP_NAME](
        *inputs, lr=float(lr), wd=float(wd), momentum=float(momentum),
        rescale_grad=float(rescale_grad), clip_gradient=float(clip_gradient), follow=bool(follow))


def adam_step_bfloat16(weight: mx.nd.NDArray, grad: mx.nd.NDArray, master: mx.nd.NDArray,
                       mean: mx.nd.NDArray, variance: mx.nd.NDArray, *, lr: float, wd: float,
                       beta1: float, beta2: float, epsilon: float, rescale_grad: float,
                       clip_gradient: float, follow: bool) -> mx.nd.NDArray:
    """One Adam step (MXNet's ``adam_update``) on the FP32 master copy of a bfloat16 weight,
    in one native pass.

    `weight` and `grad` are bfloat16 (`weight` read, not written); `master`, `mean` and
    `variance` float32, updated in place; `lr` the step's, bias correction included, as
    ``mx.optimizer.Adam`` passes it (a negative `clip_gradient`: no clipping); `follow`:
    `mxamp.optimizer.follow_weight` first.  Returns the new weight (bfloat16, MXNet's
    layout), for the caller to copy into `weight`.
    """
    return _require().nd[ADAM_STEP_OP_NAME](
        weight, grad, master, mean, variance, lr=float(lr), wd=float(wd), beta1=float(beta1),
        beta2=float(beta2), epsilon=float(epsilon), rescale_grad=float(rescale_grad),
        clip_gradient=float(clip_gradient), follow=bool(follow))


def kernels(data_shape: Sequence[int], *, kernel: Sequence[int], num_filter: int,
            stride: Optional[Sequence[int]] = None, dilate: Optional[Sequence[int]] = None,
            pad: Optional[Sequence[int]] = None, num_group: int = 1, no_bias: bool = False,
            dtype: str = 'float32', channels_last: bool = False) -> str:
    """The oneDNN kernels a convolution (as :func:`convolution` takes it) runs, and their reorders.

    ``'forward=<impl> (<n> reorders) backward_data=...'``: docs/own-convolution.rst, "What it is".

    Raises
    ------
    ValueError
        For an unknown `dtype`, or attributes oneDNN has no kernel for on this CPU.
    """
    loaded = _require()
    if dtype not in _DTYPE_FLAGS:
        raise ValueError('dtype=%r: expected one of %s' % (dtype, ', '.join(sorted(_DTYPE_FLAGS))))
    attributes = _attributes(kernel, num_filter, stride, dilate, pad, num_group, no_bias,
                             channels_last)
    keys = [key.encode() for key in attributes]
    values = [str(value).encode() for value in attributes.values()]
    shape = (ctypes.c_int64 * len(data_shape))(*data_shape)
    text = loaded.library.mxamp_own_conv_kernels(
        (ctypes.c_char_p * len(keys))(*keys), (ctypes.c_char_p * len(values))(*values),
        len(keys), shape, len(data_shape), _DTYPE_FLAGS[dtype])
    if text is None:
        raise ValueError(loaded.library.mxamp_own_conv_last_error().decode())
    return text.decode()
