"""mxamp's own convolution on oneDNN 3: the built library, its switch and its operator.

MXNet 1.9.1 computes convolutions with the oneDNN 2.4 built into it, whose
backward kernels are far behind oneDNN 3's on AMX CPUs.  mxamp builds, when it
is installed, a small C++ library (``csrc/``) that runs convolutions on oneDNN
3.2 (the ``onednn-cpu-gomp`` wheel, GNU OpenMP like MXNet) and registers them
in MXNet as one operator, ``_mxamp_convolution``, with MXNet's
``Convolution`` attributes and a gradient.  This module owns loading that
library (once per process), the switch that keeps it off, what it says about
itself (:func:`status`, :func:`describe`, for ``mxamp info``), and the calls
that put the operator into NDArray code, Symbol graphs and hybridized Gluon
blocks (:func:`convolution`).  Which convolutions of a network use it is not
decided here.  The library also carries the one-pass kernel with which FP32
master weights follow their bfloat16 weights (:func:`follow_bfloat16_weight`,
for `mxamp.optimizer.follow_weight`), and a batch normalisation on oneDNN 3
(:func:`batch_norm`) for data whose channels come last, the layout oneDNN 3's
AMX kernels compute in and in which MXNet's ``BatchNorm`` runs a scalar loop:
the building blocks of a channels-last chain (:func:`convolution` with
``channels_last=True``), with max and average pooling (:func:`pooling`), which
MXNet 1.9.1 has no CPU kernel for on channels-last data.  And a vectorised
``clip`` (:func:`clip`), which converted Gluon networks run in place of MXNet's
scalar one (a ReLU6).

How it plugs into MXNet
-----------------------
Through MXNet's extension-library ABI (``MXLoadLib``, what
``mx.library.load`` calls; ``MX_LIBRARY_VERSION`` 11 in 1.9.1), implemented by
the library directly: the operator is a native MXNet operator, scheduled by
MXNet's engine on its own worker threads like ``Convolution``, usable in
``mx.nd``, ``mx.sym`` and hybridized Gluon, with no Python in the call.  The
other way, ``mx.operator.CustomOp`` calling the library through ctypes, pays
for Python, the GIL and MXNet's custom-operator thread on every call; measured
on this project's 2-core AVX2 machine, it costs more per call than the whole
extension operator does (see ``DESIGN_MEASUREMENTS`` below).

The operator takes and returns MXNet's plain layouts (NCW/NCHW/NCDHW data,
OIHW weights), or with ``channels_last`` the data and output channels last
(NWC/NHWC/NDHWC) and the weight still OIHW.  oneDNN 3 picks its own layout for each primitive; an argument
whose layout differs is reordered through MXNet's temporary space inside the
call.  Both libraries link the same ``libgomp.so.1``, and the operator runs on
the MXNet worker thread that called it, so it computes on that thread's OpenMP
team, with MXNet's thread count: one pool, no oversubscription.

What MXNet's extension ABI does not carry: the write request.  Gradients are
always written, never added, so ``grad_req='add'`` is not honoured for the
operator's inputs; MXNet's partial shape inference needs the data shape
first (the weight shape is inferred from it).

Environment variables
---------------------
MXAMP_OWN_CONV
    ``0`` (or ``false``, ``no``, ``off``) keeps the library unloaded:
    :func:`available` answers False and :func:`convolution` raises.  ``all``
    puts every eligible bfloat16 convolution of a converted Gluon network on
    it, whatever was measured (to measure whole networks both ways); unset
    (or ``1``), the measured choice of `mxamp.kernels.choice` applies.

MXNet internals relied on
-------------------------
``MXLoadLib`` and ``NNGetOpHandle`` of MXNet's C API (through
``mxnet.base._LIB``), and ``mxnet.ndarray.register._make_ndarray_function`` /
``mxnet.symbol.register._make_symbol_function``, which make the operator's
Python functions.  ``mx.library.load`` would do the same and then regenerate
every operator's Python function (2.4 s measured here), undoing any monkey
patch of ``mx.nd`` (``mxnet.contrib.amp.init``'s).
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
           'MOVE_CHANNELS_OP_NAME', 'POOLING_OP_NAME', 'SGD_STEP_OP_NAME', 'CLIP_OP_NAME',
           'follow_bfloat16_weight', 'sgd_step_bfloat16', 'OwnConvStatus', 'OwnConvUnavailable',
           'status', 'available', 'describe', 'mode', 'require_loaded', 'convolution',
           'batch_norm', 'fan_out', 'move_channels', 'pooling', 'clip', 'kernels', 'library_path']

logger = logging.getLogger('mxamp')

#: The operator's name in MXNet (its gradient: ``_backward__mxamp_convolution``).
OP_NAME = '_mxamp_convolution'
#: The master-weight follow operator's name in MXNet (no gradient).
FOLLOW_OP_NAME = '_mxamp_follow_weight'
#: The batch normalisation operator's name in MXNet (its gradient: ``_backward__mxamp_batch_norm``).
BATCH_NORM_OP_NAME = '_mxamp_batch_norm'
#: The fan-out operator's name in MXNet: one array, ``num_outputs`` copies of it, the gradient
#: their gradients' sum (its gradient: ``_backward__mxamp_fan_out``).
FAN_OUT_OP_NAME = '_mxamp_fan_out'
#: The operator moving an array's channels between the second and the last dimension (its
#: gradient: ``_backward__mxamp_move_channels``): see :func:`move_channels`.
MOVE_CHANNELS_OP_NAME = '_mxamp_move_channels'
#: The pooling operator's name in MXNet (its gradient: ``_backward__mxamp_pooling``).
POOLING_OP_NAME = '_mxamp_pooling'
#: The SGD step operator's name in MXNet (no gradient): see :func:`sgd_step_bfloat16`.
SGD_STEP_OP_NAME = '_mxamp_sgd_step'
#: The clip operator's name in MXNet (its gradient: ``_backward__mxamp_clip``): see :func:`clip`.
CLIP_OP_NAME = '_mxamp_clip'

_NATIVE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_native')
_LIBRARY_NAME = 'libmxamp_own_conv.so'
# Written by the build (mxamp/kernels/build.py) when it could not build the library: the reason.
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
    """Where mxamp's own convolution stands in this process.

    Attributes
    ----------
    built : bool
        The library was built when mxamp was installed.
    enabled : bool
        Not switched off by ``MXAMP_OWN_CONV``.
    loaded : bool
        Loaded and registered in MXNet: the operator can run.
    onednn_version : str or None
        The oneDNN it runs on ("3.2.0"), when loaded.
    cpu_isa : str or None
        The instruction set oneDNN 3 uses on this CPU ("avx2", "avx512_core_amx"...), when loaded.
    reason : str or None
        Why it cannot run, when it cannot.
    """

    built: bool
    enabled: bool
    loaded: bool
    onednn_version: Optional[str]
    cpu_isa: Optional[str]
    reason: Optional[str]


class _Loaded(NamedTuple):
    library: Any
    nd_function: Callable[..., Any]
    sym_function: Callable[..., Any]
    follow_function: Callable[..., Any]
    batch_norm_nd: Callable[..., Any]
    batch_norm_sym: Callable[..., Any]
    fan_out_nd: Callable[..., Any]
    fan_out_sym: Callable[..., Any]
    move_channels_nd: Callable[..., Any]
    move_channels_sym: Callable[..., Any]
    pooling_nd: Callable[..., Any]
    pooling_sym: Callable[..., Any]
    sgd_step_nd: Callable[..., Any]
    clip_nd: Callable[..., Any]
    clip_sym: Callable[..., Any]
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
    """``MXAMP_OWN_CONV`` read: ``'off'``, ``'measured'`` (the default) or ``'all'``.

    Raises
    ------
    ValueError
        For any other value, naming the variable and the values it takes.
    """
    value = os.environ.get('MXAMP_OWN_CONV', '1').strip().lower()
    if value in _OFF_VALUES:
        return 'off'
    if value in _ON_VALUES:
        return 'measured'
    if value == _EVERYWHERE:
        return 'all'
    raise ValueError('MXAMP_OWN_CONV=%s: expected 0 (off), 1 (the measured choice, the default) '
                     'or all' % os.environ['MXAMP_OWN_CONV'])


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
    """The path of oneDNN 3's shared library, from the onednn-cpu-gomp wheel's file list."""
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
        # By absolute path, before MXNet opens ours: the dynamic loader then finds the
        # library's dependency on libdnnl.so.3 already loaded (matched by soname).
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
    handle, follow, norm, fan, move, pool, sgd, clip_op = [ctypes.c_void_p() for _ in range(8)]
    check_call(_LIB.NNGetOpHandle(c_str(OP_NAME), ctypes.byref(handle)))
    check_call(_LIB.NNGetOpHandle(c_str(FOLLOW_OP_NAME), ctypes.byref(follow)))
    check_call(_LIB.NNGetOpHandle(c_str(BATCH_NORM_OP_NAME), ctypes.byref(norm)))
    check_call(_LIB.NNGetOpHandle(c_str(FAN_OUT_OP_NAME), ctypes.byref(fan)))
    check_call(_LIB.NNGetOpHandle(c_str(MOVE_CHANNELS_OP_NAME), ctypes.byref(move)))
    check_call(_LIB.NNGetOpHandle(c_str(POOLING_OP_NAME), ctypes.byref(pool)))
    check_call(_LIB.NNGetOpHandle(c_str(SGD_STEP_OP_NAME), ctypes.byref(sgd)))
    check_call(_LIB.NNGetOpHandle(c_str(CLIP_OP_NAME), ctypes.byref(clip_op)))
    return _Loaded(library=library,
                   nd_function=_make_ndarray_function(handle, OP_NAME, OP_NAME),
                   sym_function=_make_symbol_function(handle, OP_NAME, OP_NAME),
                   follow_function=_make_ndarray_function(follow, FOLLOW_OP_NAME, FOLLOW_OP_NAME),
                   batch_norm_nd=_make_ndarray_function(norm, BATCH_NORM_OP_NAME,
                                                        BATCH_NORM_OP_NAME),
                   batch_norm_sym=_make_symbol_function(norm, BATCH_NORM_OP_NAME,
                                                        BATCH_NORM_OP_NAME),
                   fan_out_nd=_make_ndarray_function(fan, FAN_OUT_OP_NAME, FAN_OUT_OP_NAME),
                   fan_out_sym=_make_symbol_function(fan, FAN_OUT_OP_NAME, FAN_OUT_OP_NAME),
                   move_channels_nd=_make_ndarray_function(move, MOVE_CHANNELS_OP_NAME,
                                                           MOVE_CHANNELS_OP_NAME),
                   move_channels_sym=_make_symbol_function(move, MOVE_CHANNELS_OP_NAME,
                                                           MOVE_CHANNELS_OP_NAME),
                   pooling_nd=_make_ndarray_function(pool, POOLING_OP_NAME, POOLING_OP_NAME),
                   pooling_sym=_make_symbol_function(pool, POOLING_OP_NAME, POOLING_OP_NAME),
                   sgd_step_nd=_make_ndarray_function(sgd, SGD_STEP_OP_NAME, SGD_STEP_OP_NAME),
                   clip_nd=_make_ndarray_function(clip_op, CLIP_OP_NAME, CLIP_OP_NAME),
                   clip_sym=_make_symbol_function(clip_op, CLIP_OP_NAME, CLIP_OP_NAME),
                   onednn_version=library.mxamp_own_conv_onednn_version().decode(),
                   cpu_isa=library.mxamp_own_conv_cpu_isa().decode())


def _ensure_loaded() -> Optional[_Loaded]:
    """The loaded library, loading it on the first call; None when it cannot run."""
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
    """Where mxamp's own convolution stands: built, switched on, loaded, its oneDNN.

    Loads the library on the first call (about 20 ms; no operator runs) unless
    ``MXAMP_OWN_CONV`` switches it off.
    """
    built = os.path.exists(library_path())
    if _switched_off():
        return OwnConvStatus(built, False, False, None, None,
                             'switched off (MXAMP_OWN_CONV=%s)' % os.environ['MXAMP_OWN_CONV'])
    loaded = _ensure_loaded()
    if loaded is None:
        return OwnConvStatus(built, True, False, None, None, _failure)
    return OwnConvStatus(built, True, True, loaded.onednn_version, loaded.cpu_isa, None)


def available() -> bool:
    """Whether the operator can run in this process.

    The first time it cannot, says why once in the ``mxamp`` log (a warning,
    or an info line when ``MXAMP_OWN_CONV`` switched it off).
    """
    global _failure_said
    state = status()
    if not state.loaded and not _failure_said:
        _failure_said = True
        level = logging.INFO if not state.enabled else logging.WARNING
        logger.log(level, "mxamp: own oneDNN 3 convolution off, MXNet's Convolution runs instead: %s",
                   state.reason)
    return state.loaded


def describe() -> str:
    """One line for ``mxamp info``: the state of mxamp's own convolution.

    Example
    -------
    >>> mxamp.kernels.operators.describe()  # doctest: +ELLIPSIS
    'own convolution: ...'
    """
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
    """A convolution on mxamp's own oneDNN 3 operator, like ``Convolution``.

    Takes NDArrays (runs now, records for autograd) or Symbols (builds a graph
    node, for the Symbol API and hybridized Gluon blocks, whose
    ``hybrid_forward`` passes either).  The attributes are MXNet
    ``Convolution``'s; layouts NCW, NCHW and NCDHW, or their channels-last
    forms.

    Parameters
    ----------
    data, weight, bias : NDArray or Symbol
        ``(N, C, spatial...)`` (``(N, spatial..., C)`` with `channels_last`),
        ``(num_filter, C / num_group, kernel...)`` in either layout, and
        ``(num_filter,)``; no bias when `bias` is None.
    kernel, stride, dilate, pad : tuple of int
        One per spatial dimension (1 to 3); stride and dilate default to 1, pad to 0.
    num_filter, num_group : int
        Output channels and groups (``num_group == C`` is depthwise).
    channels_last : bool
        Data and output hold their channels last, as oneDNN 3's AMX kernels
        compute: a chain of channels-last operators passes its arrays on with
        no reorder.  The weight keeps MXNet's layout.
    name : str, optional
        The node's name (Symbols only).

    Returns
    -------
    NDArray or Symbol

    Raises
    ------
    OwnConvUnavailable
        When the operator cannot run here (:func:`status` says why).
    """
    loaded = _require()
    attributes = _attributes(kernel, num_filter, stride, dilate, pad, num_group, bias is None,
                             channels_last)
    inputs = [data, weight] + ([] if bias is None else [bias])
    if isinstance(data, mx.sym.Symbol):
        return loaded.sym_function(*inputs, name=name, **attributes)
    return loaded.nd_function(*inputs, **attributes)


def batch_norm(data: Any, gamma: Any, beta: Any, moving_mean: Any, moving_var: Any, *,
               eps: float = 1e-3, momentum: float = 0.9, fix_gamma: bool = True,
               use_global_stats: bool = False, axis: int = 1, act_type: Optional[str] = None,
               residual: Any = None, copies: int = 0, name: Optional[str] = None) -> Any:
    """Training-mode batch normalisation on mxamp's own oneDNN 3 operator.

    MXNet ``BatchNorm``'s arithmetic and attributes, for data whose channels
    are the second (``axis=1``) or the last (``axis=-1``) dimension: channels
    last is what a chain of channels-last convolutions passes on, and where
    MXNet 1.9.1's ``BatchNorm`` runs a scalar loop.  It normalises with the
    batch statistics and, in the backward pass, updates `moving_mean` and
    `moving_var` in place (``moving = moving * momentum + batch * (1 - momentum)``, with the biased
    batch variance, as MXNet does), unless `use_global_stats`, which
    normalises with the moving statistics and leaves them.  It always trains:
    MXNet's extension ABI does not tell an operator whether MXNet is
    training, so inference graphs keep MXNet's ``BatchNorm``.  Like MXNet's,
    it updates the moving statistics when the gradient runs: a forward pass
    without its backward leaves them.  As in MXNet 1.9.1 (whose
    ``_backward_BatchNorm`` declares no mutated input), MXNet's engine does not
    know the gradient writes them: read them after something that waits for
    the gradient, ``mx.nd.waitall()`` or a trainer step that updates this
    gamma or beta, or the read may come first (measured: 3 reads in 200 right
    after ``backward()`` saw the old values here; MXNet's faster kernel left
    none in 200).

    Parameters
    ----------
    data : NDArray or Symbol
        float32 or bfloat16, 3 to 5 dimensions.
    gamma, beta, moving_mean, moving_var : NDArray or Symbol
        float32 ``(C,)``.
    eps, momentum, fix_gamma, use_global_stats, axis
        As MXNet's ``BatchNorm``: `fix_gamma` takes gamma as 1 and gives it a
        zero gradient.  In a Symbol graph, gamma, beta and the moving
        statistics need known shapes (a ``ValueError`` says so otherwise).
    act_type : {None, 'relu'}
        ``'relu'``: a ReLU on the output, in the same pass (its gradient
        taken from the output, as MXNet's ``Activation`` takes it).
    residual : NDArray or Symbol, optional
        An array like `data` added to the normalised output, before the
        ReLU (a residual block's end); it gets the sum's gradient.
    copies : int
        Further outputs, each a copy of the output for one more reader, whose
        gradients are summed with the output's (what ``_mxamp_fan_out`` does
        after an operator, without its pass over the output).
    name : str, optional
        The node's name (Symbols only).

    Returns
    -------
    list of NDArray, or Symbol
        The output (like `data`), the batch mean and the batch variance
        (float32, ``(C,)``), then the output's `copies`, as a list of NDArrays
        or a Symbol of that many outputs.

    Raises
    ------
    OwnConvUnavailable
        When the library cannot run here.
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
        return loaded.batch_norm_sym(*inputs, name=name, **attributes)
    return loaded.batch_norm_nd(*inputs, **attributes)


def fan_out(data: Any, num_outputs: int, *, name: Optional[str] = None) -> Any:
    """`num_outputs` copies of `data`, whose gradient is the sum of theirs, in one operator.

    Where an array has several readers, MXNet sums their gradients with
    ``add_n``, whose bfloat16 kernel on MXNet's plain layout is a scalar loop
    (81 ms against 2.5 ms for ``elemwise_add`` on 51 million values, 2
    threads, Xeon with AMX): `mxamp.kernels.channels_last` gives each reader of such
    an array in its regions its own copy instead.

    Parameters
    ----------
    data : NDArray or Symbol
        float32 or bfloat16.
    num_outputs : int
        2 or more.
    name : str, optional
        The node's name (Symbols only).

    Returns
    -------
    list of NDArray, or Symbol
        The copies, as a list of NDArrays or a Symbol of `num_outputs` outputs.
    """
    loaded = _require()
    if isinstance(data, mx.sym.Symbol):
        return loaded.fan_out_sym(data, num_outputs=int(num_outputs), name=name)
    return loaded.fan_out_nd(data, num_outputs=int(num_outputs))


def move_channels(data: Any, *, to: str = 'last', name: Optional[str] = None) -> Any:
    """`data`'s channels moved to the last dimension (``to='last'``: (N, C, spatial...) into
    (N, spatial..., C)) or back (``to='first'``), in one pass of exact copies.

    MXNet 1.9.1's ``transpose`` corrupts memory on bfloat16 arrays with oneDNN
    (see `mxamp.policy`): `mxamp.kernels.channels_last` moves a bfloat16 array across a
    region's border with this instead of a cast to float32, a transpose and a
    cast back.  The gradient is the output gradient moved the other way.

    Parameters
    ----------
    data : NDArray or Symbol
        float32 or bfloat16, 3 or more dimensions.
    to : {'last', 'first'}
    name : str, optional
        The node's name (Symbols only).

    Returns
    -------
    NDArray or Symbol

    Examples
    --------
    >>> x = mx.nd.arange(24).reshape((1, 2, 3, 4))
    >>> last = mxamp.kernels.operators.move_channels(x, to='last')
    >>> last.shape
    (1, 3, 4, 2)
    >>> last[0, 0, 1].asnumpy()
    array([ 1., 13.], dtype=float32)
    """
    if to not in ('last', 'first'):
        raise ValueError("to=%r: expected 'last' or 'first'" % (to,))
    loaded = _require()
    if isinstance(data, mx.sym.Symbol):
        return loaded.move_channels_sym(data, to=to, name=name)
    return loaded.move_channels_nd(data, to=to)


def clip(data: Any, a_min: float, a_max: float, *, name: Optional[str] = None) -> Any:
    """`data` clipped to [`a_min`, `a_max`]: MXNet's ``clip``, vectorised, with its gradient.

    MXNet 1.9.1's ``clip`` (a ReLU6 is ``clip(x, 0, 6)``) and its gradient are
    scalar loops on a CPU: MobileNetV2's 35 ReLU6 layers took 53% of its
    bfloat16 training step and 51% of its FP32 one (batch 16, 2 threads, Xeon
    with AMX).  A converted Gluon network runs this instead (see
    `mxamp.gluon`).  The same values as MXNet's, bit for bit, NaN and the
    gradient at the bounds included; in bfloat16 the bounds are rounded to
    nearest where MXNet's kernel truncates them (0 and 6 are exact either way).

    Parameters
    ----------
    data : NDArray or Symbol
        float32 or bfloat16.
    a_min, a_max : float
    name : str, optional
        The node's name (Symbols only).

    Returns
    -------
    NDArray or Symbol

    Examples
    --------
    >>> mxamp.kernels.operators.clip(mx.nd.array([-1, 3, 7]), 0, 6).asnumpy()
    array([0., 3., 6.], dtype=float32)
    """
    loaded = _require()
    if isinstance(data, mx.sym.Symbol):
        return loaded.clip_sym(data, a_min=a_min, a_max=a_max, name=name)
    return loaded.clip_nd(data, a_min=a_min, a_max=a_max)


def pooling(data: Any, *, kernel: Sequence[int] = (), pool_type: str = 'max',
            stride: Optional[Sequence[int]] = None, pad: Optional[Sequence[int]] = None,
            global_pool: bool = False, count_include_pad: bool = True,
            channels_last: bool = False, name: Optional[str] = None) -> Any:
    """Max or average pooling on mxamp's own oneDNN 3 operator.

    MXNet ``Pooling``'s arithmetic and attributes (``pooling_convention``
    'valid'), for data whose channels are the second dimension or, with
    `channels_last`, the last: the layout a channels-last region passes on
    (`mxamp.kernels.channels_last` takes a network's stem pooling into its region
    with it), where MXNet 1.9.1 has no CPU pooling.

    Parameters
    ----------
    data : NDArray or Symbol
        float32 or bfloat16, 3 to 5 dimensions.
    kernel, stride, pad : tuple of int
        One per spatial dimension, as MXNet's (`stride` 1 and `pad` 0 by
        default); `pad` below `kernel`.
    pool_type : {'max', 'avg'}
    global_pool : bool
        Pool over the whole spatial extent (`kernel` ignored).
    count_include_pad : bool
        Average pooling: the padding counts in the divisor (MXNet's default).
    channels_last : bool
        Data and output ``(N, spatial..., C)``.
    name : str, optional
        The node's name (Symbols only).

    Returns
    -------
    NDArray or Symbol
        The pooled data.  Max pooling has a second output, the workspace its
        gradient reads (where each window's maximum was, uint8 bytes): a list
        ``[output, workspace]`` of NDArrays, or a Symbol of two outputs.

    Raises
    ------
    OwnConvUnavailable
        When the library cannot run here.
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
        return loaded.pooling_sym(data, name=name, **attributes)
    return loaded.pooling_nd(data, **attributes)


def _require_known_shape(what: str, symbol: mx.sym.Symbol) -> None:
    """Refuse a variable of unknown shape among an extension operator's statistics inputs.

    MXNet 1.9.1's shape inference for extension operators (``src/c_api/c_api.cc``)
    sizes its buffer by the sum of the inputs' dimension counts, an unknown
    shape counting -1, and then copies the known shapes into it: with more
    unknown inputs than the data has dimensions it writes past the buffer and
    the process dies.
    """
    if symbol.get_children() is None and '__shape__' not in (symbol.list_attr() or {}):
        raise ValueError('%s (%s) has no shape: give it one (mx.sym.var(name, shape=(C,))); '
                         "MXNet's shape inference for extension operators cannot infer it"
                         % (what, symbol.name))


def follow_bfloat16_weight(master: mx.nd.NDArray, weight: mx.nd.NDArray) -> None:
    """`master` restarts from `weight` wherever `weight` no longer holds `master` rounded.

    The arithmetic of `mxamp.optimizer.follow_weight` for a float32 `master`
    and a bfloat16 `weight` on the CPU, in one vectorised pass on the calling
    thread's OpenMP team that reads 6 bytes per value and writes 4 (MXNet's
    elementwise ops take five passes, about 46 bytes).  Rounding to nearest, ties to even, as ``amp_cast``;
    compared as floats (-0 equals +0, NaN equals nothing).  Asynchronous, in
    place; `weight` may hold a oneDNN layout (MXNet reorders it for the call).

    Raises
    ------
    OwnConvUnavailable
        When the library cannot run here.
    """
    _require().follow_function(master, weight, out=master)


def sgd_step_bfloat16(weight: mx.nd.NDArray, grad: mx.nd.NDArray, master: mx.nd.NDArray,
                      momentum_state: Optional[mx.nd.NDArray], *, lr: float, wd: float,
                      momentum: float, rescale_grad: float, clip_gradient: float,
                      follow: bool) -> mx.nd.NDArray:
    """One SGD step on the FP32 `master` copy of a bfloat16 `weight`, in one pass.

    What `mxamp.optimizer`'s generic path computes for ``mx.optimizer.SGD``
    with four MXNet passes (the gradient widened, the master following the
    weight, ``multi_sgd_mom_update`` on the master, the master narrowed into
    the weight), in one vectorised pass of mxamp's native library on the
    calling thread's OpenMP team: the same expression in float32, operand for
    operand, so the same numbers.  Asynchronous, no host sync.

    Parameters
    ----------
    weight, grad : NDArray
        bfloat16, same shape; `weight` is read (to follow it), not written.
    master, momentum_state : NDArray
        float32, updated in place; `momentum_state` None when `momentum` is 0.
    lr, wd, momentum, rescale_grad : float
        As MXNet's SGD.
    clip_gradient : float
        Negative: no clipping.
    follow : bool
        Restart the master from the weight where the weight changed
        (`mxamp.optimizer.follow_weight`).

    Returns
    -------
    NDArray
        The new weight (bfloat16, MXNet's default layout): the caller copies
        it into `weight`, whatever layout that holds.

    Raises
    ------
    OwnConvUnavailable
        When the library cannot run here.
    """
    inputs = [weight, grad, master] + ([] if momentum == 0 else [momentum_state])
    return _require().sgd_step_nd(*inputs, lr=float(lr), wd=float(wd), momentum=float(momentum),
                                  rescale_grad=float(rescale_grad),
                                  clip_gradient=float(clip_gradient), follow=bool(follow))


def kernels(data_shape: Sequence[int], *, kernel: Sequence[int], num_filter: int,
            stride: Optional[Sequence[int]] = None, dilate: Optional[Sequence[int]] = None,
            pad: Optional[Sequence[int]] = None, num_group: int = 1, no_bias: bool = False,
            dtype: str = 'float32', channels_last: bool = False) -> str:
    """The oneDNN kernels one convolution runs, and how many arguments each reorders.

    Makes the convolution's primitives (forward and both backward ones) without
    running them, as the operator would on its first call.  `data_shape` is in the
    layout `channels_last` says, as for :func:`convolution`.

    Returns
    -------
    str
        ``'forward=<impl> (<n> reorders) backward_data=... backward_weights=...'``,
        and ``backward_bias=mxamp channel sums`` where the weight gradient is a
        ``matmul`` (1x1, bfloat16, channels last) and the bias's gradient the
        output gradient's per-channel sum in mxamp's own loops.  A strided 1x1
        convolution's ``backward_data=matmul ...`` computes the gradient at the
        positions the kernel reads, which mxamp then spreads over the data.

    Raises
    ------
    ValueError
        For an unknown `dtype`, or attributes oneDNN has no kernel for on this
        CPU (bfloat16 without AVX-512, for one), with oneDNN's reason.
    OwnConvUnavailable
        When the library cannot run here.
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
