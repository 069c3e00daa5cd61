"""Mixed precision for Gluon: converting HybridBlocks in place, and their summary.

This module owns :func:`convert` (the main entry point of mxamp) and
:func:`summary`.  It has no precision rules of its own: every graph a converted
block runs is the FP32 graph its ``hybrid_forward`` code builds, rewritten by
:func:`mxamp.graph.convert_graph` under one :class:`mxamp.policy.Policy`, the
same rewrite the Symbol path uses.

How a block is converted
------------------------
``convert(net)`` keeps the Block object.  Every HybridBlock of the tree (the net
and all its descendants) gets its class swapped for a generated subclass of
its own class (same name, so ``isinstance`` and ``repr`` are unchanged) that
adds mxamp's hooks; children, attribute paths and parameter names stay as
they were, and a block the tree holds in two places is one block, converted
once.  A network that cannot become a graph is converted in part: each of
its largest subtrees that can is converted so, as a network of its own,
and the network itself keeps its class but for FP32 checkpoints
(`_ConvertedInPart`).  The hooks:

* graph building: the FP32 graph of ``hybrid_forward`` is built as usual, then
  replaced by its mixed-precision rewrite before MXNet makes the CachedOp, so
  the policy applies inside every block, users' own ``hybrid_forward`` code
  included (a ``softmax`` or a ``sum`` runs in FP32).  ``convert`` itself
  rewrites no graph; a block's graph is rewritten when MXNet builds it, once
  per device type and shape knowledge (rebuilds after ``hybridize()`` and
  `summary` reuse it), and the `mxamp.graph.Conversion` kept with it is what
  `summary` and `mxamp.diagnose` report;
* imperative calls: a converted block always runs through its converted graph,
  also when it is not hybridized or after ``hybridize(active=False)`` (the
  policy only exists in graph form; running ``hybrid_forward`` on NDArrays
  would silently compute everything in the parameters' dtype).  Python code in
  ``hybrid_forward`` therefore runs once per graph build, as in hybridized
  mode;
* parameters: those consumed only by low-precision ops (decided once, by
  ``convert``, from operator classes: `mxamp.graph.storable_params`) are
  stored in the target dtype, data and gradient; all others
  (BatchNorm, LayerNorm, ... parameters and running statistics, anything
  feeding an FP32 op or an excluded block) stay FP32.  Parameters whose shape
  is still unknown (deferred initialisation) are initialised in FP32 by MXNet
  at the first forward pass and cast right after, as are those initialised
  after ``convert``.  A low-precision parameter's class is swapped too (same
  name): its initializer always draws in FP32, and a re-initialised parameter
  (``initialize(..., force_reinit=True)`` of the net, a child, the
  ``ParameterDict`` or the parameter) is cast back at once; MXNet's random
  initializers cannot write bfloat16, and Orthogonal or Bilinear would leave
  zeros;
* editing: a child registered after ``convert`` (``net.output =
  nn.Dense(10)``, ``add``, ``register_child``, at any depth) is converted with
  the net's settings when it joins (its parameters decided on its own graph),
  or, converted already, must have the net's dtype and operator lists
  (ValueError otherwise).  Replacing a child by an FP32 block of its class is
  allowed, as for FP32 nets.  The graphs of the block's ancestors, which MXNet
  keeps, are rebuilt at their next call;
* ``optimize_for`` raises: it would fuse the net for inference without
  refusing to train it; `mxamp.for_inference` does that;
* checkpoints: ``save_parameters`` writes every parameter in FP32 (low
  precision to FP32 is exact), so checkpoints are interchangeable with FP32
  nets in both directions; ``load_parameters`` accepts FP32 checkpoints (FP32
  parameters load bit-exactly, low-precision ones are rounded to nearest);
* export: ``export`` writes the converted graph (its ``Cast`` nodes included)
  with low-precision parameters in their dtype, loadable by
  ``SymbolBlock.imports``;
* ``cast()`` of a converted block raises (it would undo the conversion).

float16 on a CPU
----------------
MXNet 1.9.1 has no float16 GEMM, convolution or fully-connected kernel on the
CPU.  When a graph is built for a CPU context, those ops compute in FP32 between
float16 casts (float16 storage, FP32 accumulation); mxamp warns once.  The
decision is taken per graph build from the context of the inputs
(`mxamp.policy.emulates_float16`, the rule of the Symbol front too), and the
graph is rebuilt when the block later runs on another device type.

MXNet internals relied on (MXNet 1.9.1), each used in one place below:
``HybridBlock._get_graph`` / ``_cached_graph`` (the hook that builds the graph),
``_build_cache`` (deferred initialisation, then CachedOp), ``_call_cached_op``,
``_cached_op``, ``_clear_cached_op``, ``_active``, ``_reg_params``,
``_children``, ``Block._collect_params_with_prefix``, ``register_child`` (the
one way children are registered, clearing only that block's graph), the type
check of ``Block.__setattr__``, ``Parameter._data`` / ``_grad`` / ``_dtype`` /
``_var`` / ``_deferred_init`` / ``_finish_deferred_init`` (where a
parameter is drawn from its initializer), and the names ``HybridBlock`` gives its graph
inputs (``data``, or ``data0``, ``data1``, ...): the symbolic build in
:func:`convert` names its inputs the same, so that its graph is the one MXNet
builds later.  mxamp adds one attribute of its own to each ``Parameter`` of a
converted tree, ``_mxamp_precision`` (the dtype it gets, decided once:
`mxamp.dtypes.param_precision` reads it); each converted block carries its
`mxamp.network_state.NetworkState` (settings, tree, what its graph was built
for), which this module drives through that module's moves.
"""
import collections
import inspect
import json
import threading
import warnings
from typing import (Any, Callable, Counter, Dict, Iterable, Iterator, Optional, Sequence, Tuple, Type,
                    Union)

import numpy as np

import mxnet as mx
from mxnet import autograd
from mxnet.gluon import Block, HybridBlock

from . import dtypes
from . import graph as graph_mod
from . import hardware
from . import passes, pipeline
from .atomic_files import replaced_on_success
from .dtypes import LOW_PRECISION, DTypeLike, cast, name_of_array, numpy_dtype
from .network_state import (NetworkState, Settings, Stage, Tree, attach, check_convertible,
                            converted_state, describe_block, state_of)
from .migration import from_contrib_amp
from .policy import exclude_matches

__all__ = ['convert', 'summary', 'is_converted']

_FLOAT32 = np.dtype(np.float32)
_warned_float16_cpu = False
_warned_bfloat16_storage_only = False
_warned_bfloat16_without_amx = False
_lock = threading.Lock()


# --------------------------------------------------------------------------
# Parameters

def _set_param_dtype(param, name):
    """Store `param` (data and gradient, every context) in precision `name`.

    MXNet's ``Parameter.cast`` goes through ``astype``; this goes through
    ``mxamp.dtypes.cast`` (bfloat16-safe) and re-marks the arrays for autograd.
    Relies on ``Parameter._dtype``, ``_data``, ``_grad`` (MXNet 1.9.1).
    """
    param._dtype = numpy_dtype(name)
    if param._data is None:
        return
    with autograd.pause():
        param._data = [_cast_plain(arr, name) for arr in param._data]
        if param._grad is not None:
            param._grad = [_cast_plain(arr, name) for arr in param._grad]
            autograd.mark_variables(param._data, param._grad, param.grad_req)


def _cast_plain(array, name):
    """``cast`` that also works on arrays holding a oneDNN blocked layout.

    MXNet 1.9.1 (oneDNN 2.4): after an FP32 inference pass, a grouped or
    depthwise convolution weight keeps a blocked oneDNN layout, and ``amp_cast``
    of it to bfloat16 fails later with "could not create a primitive descriptor
    for a reorder primitive".  ``copy()`` returns the values in the default
    layout first.
    """
    if array.dtype == numpy_dtype(name):
        return array
    return cast(array.copy(), name)


def _ensure_fp32_var(param):
    """Create (and cache) the parameter's graph variable as FP32.

    ``Parameter.var()`` caches its Symbol on first use and declares the
    parameter's *current* dtype in it.  Graph building must see the FP32 graph
    (the rewrite declares the low-precision parameters itself), so the variable
    is created while the parameter reads as FP32.  Relies on ``Parameter._var``
    and ``_dtype``.
    """
    if param._var is None and name_of_array(param) in LOW_PRECISION:
        current = param._dtype
        param._dtype = _FLOAT32
        try:
            param.var()
        finally:
            param._dtype = current


def _sync_params(block):
    """Give every initialised parameter of `block`'s tree its mxamp dtype.

    A parameter's precision is decided once, when it first meets a converted
    tree (`block`'s settings: ``lp_params``), and kept in
    ``_mxamp_precision``, which `mxamp.dtypes.param_precision` reads while
    the parameter is not initialised yet.  A child converted on its own and
    added later (see `_adopt`) thus keeps the decisions of its own settings.
    """
    settings = converted_state(block).settings
    for param in block.collect_params().values():
        want = getattr(param, '_mxamp_precision', None)
        if want is None:
            if name_of_array(param) not in ('float32',) + LOW_PRECISION:
                continue  # integer or otherwise special parameters are left alone
            want = settings.dtype if param.name in settings.lp_params else 'float32'
            param._mxamp_precision = want
            if want in LOW_PRECISION:
                param.__class__ = _mixed_class(_LowPrecisionParameter, type(param))
        if param._data is not None and name_of_array(param) != want:
            _set_param_dtype(param, want)


class _LowPrecisionParameter(object):
    """Mixin placed first in the MRO of a parameter that mxamp stores in low precision."""

    # MXNet 1.9.1: _finish_deferred_init creates the array in the parameter's
    # dtype (Parameter._dtype) and fills it with the initializer.
    # Parameter.initialize calls it at once when the shape is known (also for
    # force_reinit=True, from Block and ParameterDict.initialize too),
    # HybridBlock._build_cache after inferring deferred shapes.  MXNet's random
    # initializers cannot write bfloat16 ("Output type must be float16,
    # float32, float64") and Orthogonal or Bilinear leave zeros in it: every
    # initializer draws in FP32 here, and the result is cast to the dtype the
    # parameter had (FP32 while convert's cast is still to come: the first
    # forward pass makes it, see _build_cache).
    def _finish_deferred_init(self):
        if not self._deferred_init:
            return
        stored = name_of_array(self)
        self._dtype = _FLOAT32
        try:
            super(_LowPrecisionParameter, self)._finish_deferred_init()
        finally:
            _set_param_dtype(self, stored)

    # Parameters pickle (blocks do not): the generated class has no importable
    # name, so a pickle names the class it was generated from.
    def __reduce_ex__(self, protocol):
        return _restore_low_precision, (type(self)._mxamp_base,), self.__dict__


def _restore_low_precision(base):
    """Unpickling helper: an empty parameter of ``_mixed_class(_LowPrecisionParameter, base)``."""
    return object.__new__(_mixed_class(_LowPrecisionParameter, base))


# --------------------------------------------------------------------------
# The subclass every converted block gets

class _Float32Checkpoints(object):
    """Checkpoints of a converted net: every parameter in FP32, as FP32 nets write them."""

    def save_parameters(self, filename, deduplicate=False):
        """Save parameters in FP32 (exact), loadable by converted and FP32 nets alike.

        Written whole or not at all (`mxamp.atomic_files`): an interrupted save
        leaves the previous file as it was.
        """
        # mxamp's own batch normalisation updates the moving statistics in its gradient,
        # which MXNet's engine does not know writes them (mxamp.kernels.operators.batch_norm): a
        # read right after backward() could save the values before that update.
        mx.nd.waitall()
        # MXNet 1.9.1: _collect_params_with_prefix gives the structural names
        # ('features.0.weight') that save_parameters/load_parameters use.
        named = self._collect_params_with_prefix()
        if deduplicate:
            first = {}
            for key in sorted(named):
                first.setdefault(id(named[key]), key)
            named = {key: named[key] for key in first.values()}
        arrays = {}
        for key, param in named.items():
            value = param._reduce()
            if name_of_array(value) in LOW_PRECISION:
                value = cast(value, 'float32')
            arrays[key] = value
        with replaced_on_success(filename) as temporary:
            mx.nd.save(temporary, arrays)

    def load_parameters(self, filename, ctx=None, allow_missing=False,
                        ignore_extra=False, cast_dtype=False, dtype_source='current'):
        """Load a checkpoint (FP32, as written by FP32 nets and by converted nets).

        FP32 parameters load bit-exactly; low-precision ones are loaded in FP32
        and rounded to the target dtype (round to nearest even).
        """
        low = [(p, name_of_array(p)) for p in self.collect_params().values()
               if name_of_array(p) in LOW_PRECISION]
        for param, _ in low:
            _set_param_dtype(param, 'float32')
        try:
            super(_Float32Checkpoints, self).load_parameters(
                filename, ctx=ctx, allow_missing=allow_missing, ignore_extra=ignore_extra,
                cast_dtype=cast_dtype, dtype_source=dtype_source)
        finally:
            for param, precision in low:
                _set_param_dtype(param, precision)
        for part in self._converted_parts():
            _sync_params(part)

    def _converted_parts(self):
        """The converted trees whose parameters a load gives their dtypes again."""
        raise NotImplementedError


class _Converted(_Float32Checkpoints):
    """Mixin placed first in the MRO of a converted block's class."""

    def _converted_parts(self):
        return [self]

    # MXNet 1.9.1: _get_graph(*args) builds (and caches in self._cached_graph)
    # the tuple (input symbols, output Group) from hybrid_forward; _build_cache,
    # infer_shape/infer_type and export all read the graph through it.
    def _get_graph(self, *args):
        _drop_stale_graph(self)
        if not self._cached_graph:
            for param in self.collect_params().values():
                _ensure_fp32_var(param)
            inputs, fp32 = super(_Converted, self)._get_graph(*args)
            device = _device_type(args) or _params_device_type(self)
            shapes = _known_shapes(self)
            shapes.update((sym.name, arg.shape) for sym, arg in zip(_flat(inputs), _flat(args))
                          if isinstance(arg, mx.nd.NDArray))
            try:
                conversion = _conversion(self, fp32, device, shapes)
            except Exception:
                self._cached_graph = ()
                raise
            converted_state(self).graph_built(device)
            self._cached_graph = inputs, conversion.symbol
        return self._cached_graph

    # MXNet 1.9.1: _build_cache finishes deferred initialisation (in FP32 for
    # a low-precision parameter not cast yet) and makes the CachedOp; arrays
    # are fetched at call time, so casting after it is in time for the first
    # call.
    # The CachedOp runs the runtime graph for the current mode (some
    # convolutions on mxamp's own operator, channels-last regions when
    # training, see _runtime_graph); _cached_graph, which export, infer_shape
    # and summary read, keeps MXNet's operators.  (With a backend, MXNet's
    # _build_cache stores the partitioned graph there: that one stays.)
    def _build_cache(self, *args):
        inputs, symbol = self._get_graph(*args)
        training = autograd.is_training()
        mode = _mode_name(training, _inputs_take_gradients(args))
        runtime, modes_differ = _runtime_graph(self, symbol, args, mode)
        self._cached_graph = inputs, runtime
        try:
            super(_Converted, self)._build_cache(*args)
        finally:
            if self._cached_graph and self._cached_graph[1] is runtime:
                self._cached_graph = inputs, symbol
        state = converted_state(self)
        state.cached_for = mode if modes_differ else 'both'
        _sync_params(self)

    # MXNet 1.9.1: _call_cached_op(*args) builds the cache if self._cached_op is
    # None, then runs it.  A graph built for another device type (float16
    # emulation on CPU vs GPU kernels), or before a child was added to the
    # tree, is rebuilt.  A block whose training graph has channels-last
    # regions keeps a second CachedOp for inference, and a third for training
    # calls whose inputs take gradients (_use_cached_op_for).
    def _call_cached_op(self, *args):
        _drop_stale_graph(self, _device_type(args))
        if _kernel_gradient_added(self):
            self._clear_cached_op()
        _use_cached_op_for(self, _mode_name(autograd.is_training(), _inputs_take_gradients(args)))
        return super(_Converted, self)._call_cached_op(*_float32_inputs(args))

    # MXNet 1.9.1: _clear_cached_op drops the graph, _cached_op and
    # _cached_op_args; the CachedOp kept for the other mode goes with them.
    def _clear_cached_op(self):
        super(_Converted, self)._clear_cached_op()
        state = converted_state(self)
        state.cached_ops = {}
        state.cached_for = None

    # MXNet 1.9.1: Block.__setattr__ refuses to replace a Block attribute with a
    # value that is not an instance of the attribute's class, here the
    # generated class: an FP32 block of the class it was generated from (what a
    # user writes: net.output = nn.Dense(10)) raised "Changing attribute type
    # for output from Dense to Dense".  Such a replacement is let through once
    # _adopt accepted it (the net is unchanged when it refuses); other types
    # still meet MXNet's check.
    def __setattr__(self, name, value):
        existing = self.__dict__.get(name)
        if isinstance(value, Block) and isinstance(existing, Block) and \
                isinstance(value, getattr(type(existing), '_mxamp_base', type(existing))):
            _adopt(self, value)
            del self.__dict__[name]
        super(_Converted, self).__setattr__(name, value)

    # MXNet 1.9.1: Block.__setattr__ and HybridSequential.add register every
    # child through register_child; HybridBlock.register_child clears only this
    # block's graph, so the tree's edit count tells its ancestors (and the
    # block itself, on a later call) to rebuild theirs.
    def register_child(self, block, name=None):
        """``register_child`` that gives `block` this net's precision (see `_adopt`)."""
        _adopt(self, block)
        super(_Converted, self).register_child(block, name)
        converted_state(self).child_registered()

    def optimize_for(self, x, *args, **kwargs):
        """Refused: `mxamp.for_inference` fuses a converted net and refuses to train it."""
        raise RuntimeError("%s was converted by mxamp: optimize_for would fuse it for inference "
                           "without stopping training through it (MXNet's fused ops return zero "
                           "gradients); call mxamp.for_inference(net, x) instead"
                           % describe_block(self))

    # MXNet 1.9.1: hybridize(backend=...) makes _build_cache partition the graph
    # with that backend (what optimize_for does), so the same refusal applies;
    # mxamp.for_inference calls HybridBlock.hybridize itself.
    def hybridize(self, active=True, backend=None, **kwargs):
        """``HybridBlock.hybridize``; a `backend` is refused (see `optimize_for`)."""
        if backend is not None:
            raise RuntimeError("%s was converted by mxamp: hybridize(backend=%r) would fuse it "
                               "for inference without stopping training through it (MXNet's "
                               "fused ops return zero gradients); call "
                               "mxamp.for_inference(net, x) instead" % (describe_block(self), backend))
        super(_Converted, self).hybridize(active, **kwargs)

    def forward(self, x, *args):
        # Not hybridized (or hybridize(active=False)): still run the converted
        # graph.  MXNet's own forward runs hybrid_forward on NDArrays then,
        # where no policy could apply.
        if not self._active and isinstance(x, mx.nd.NDArray):
            with x.context:
                return self._call_cached_op(x, *args)
        return super(_Converted, self).forward(x, *args)

    def cast(self, dtype):
        raise TypeError('%s was converted by mxamp to %s; cast() would override the '
                        'precision policy (convert an FP32 copy of the net instead)'
                        % (describe_block(self), converted_state(self).settings.dtype))

    def export(self, path, epoch=0, remove_amp_cast=False):
        """``HybridBlock.export`` that keeps the graph's ``amp_cast`` nodes.

        The converted graph casts activations with ``amp_cast``; MXNet's export
        drops those nodes by default, which would leave a graph whose dtypes no
        longer match.  The files load with ``SymbolBlock.imports`` / ``Module``.
        """
        if remove_amp_cast:
            raise ValueError('%s was converted by mxamp: its amp_cast nodes are part of the '
                             'mixed-precision graph and cannot be removed on export'
                             % describe_block(self))
        # After a child was added, MXNet's own error asks for a forward call first.
        _drop_stale_graph(self)
        return super(_Converted, self).export(path, epoch, remove_amp_cast=False)


class _ConvertedInPart(_Float32Checkpoints):
    """Mixin placed first in the MRO of a net `convert` converted in part.

    The net itself runs as it did (its code calls the converted parts, which
    take and return FP32 arrays); what it adds is the FP32 checkpoints of a
    converted net, and the refusal to ``cast()``.
    """

    def _converted_parts(self):
        return [part for _, part in state_of(self).parts]

    def cast(self, dtype):
        raise TypeError('%s was converted in part by mxamp to %s; cast() would override the '
                        'precision policy of its parts (convert an FP32 copy of the net instead)'
                        % (describe_block(self), state_of(self).precision))


_CLASSES: Dict[Tuple[type, type], type] = {}


def _mixed_class(mixin: type, cls: type) -> type:
    """The generated subclass of `cls` with `mixin` first in its MRO (same name and module).

    Created once per (mixin, class); `cls` already holding `mixin` is returned
    as it is.  Its ``_mxamp_base`` is the class before any mixin.
    """
    if issubclass(cls, mixin):
        return cls
    with _lock:
        klass = _CLASSES.get((mixin, cls))
        if klass is None:
            klass = type(cls.__name__, (mixin, cls),
                         {'__module__': cls.__module__,
                          '__qualname__': getattr(cls, '__qualname__', cls.__name__),
                          '__doc__': cls.__doc__,
                          '_mxamp_base': getattr(cls, '_mxamp_base', cls)})
            _CLASSES[(mixin, cls)] = klass
    return klass


def is_converted(block: Block) -> bool:
    """Whether `block` was converted by :func:`convert`."""
    return isinstance(block, _Converted)


def _drop_stale_graph(block, device=None):
    """Clear `block`'s graph and CachedOp when built for another device type than `device`,
    or before a child was registered somewhere in its tree."""
    if block._cached_graph and converted_state(block).graph_is_stale(device):
        block._clear_cached_op()


def _adopt(parent, block):
    """Give `block`, about to be registered as a child of the converted `parent`, its precision.

    An FP32 HybridBlock is converted with `parent`'s settings (dtype,
    operator lists, exclude patterns), its parameters decided on its own
    graph; one converted already keeps its conversion if it has the same
    dtype and operator lists and no exclude beyond the net's (the net's policy
    rewrites its ops inside the net's graph).  Either way it joins `parent`'s
    `mxamp.network_state.Tree`.  A non-hybrid block is left to MXNet's refusal; a SymbolBlock,
    which `convert` never converts, keeps FP32 parameters (`_sync_params`).

    Raises
    ------
    ValueError
        `block` was converted with other settings.
    TypeError
        `block` cannot be traced (see `convert`).
    """
    if not isinstance(block, HybridBlock) or isinstance(block, mx.gluon.SymbolBlock):
        return
    parent_state = converted_state(parent)
    if not is_converted(block):
        graph = graph_mod.load_graph(_fp32_graph(block))
        settings = _decided(parent_state.settings, [('', block, graph)])
        _check_shared(block, settings, parent)
        _convert_tree(block, settings, parent_state.tree)
        return
    _check_joins(block, parent_state.settings, parent,
                 "add it unconverted (FP32), and it takes the net's settings")
    for sub in _walk(block):
        if is_converted(sub):
            converted_state(sub).join(parent_state)


def _check_shared(root, settings, net):
    """Raise ValueError when a block of `root`'s tree, converted before for another net that
    holds it too, has other settings than `settings`, those of `net`."""
    for block in _walk(root):
        if is_converted(block):
            _check_joins(block, settings, net, 'a block shared by two nets has one precision '
                         'policy: convert both with the same settings')


def _check_joins(block, settings, net, remedy):
    """Raise ValueError, ending with `remedy`, when the converted `block` has other settings
    than `settings`, those of `net`, whose tree it would join."""
    own = converted_state(block).settings
    if not own.same_policy(settings):
        raise ValueError("%s was converted by mxamp with other settings (%s) than %s, which it "
                         "would join (%s): %s" % (describe_block(block), own.text(),
                                                  describe_block(net), settings.text(), remedy))


def chosen_precision(block: Block) -> Optional[str]:
    """The precision :func:`convert` gave `block`: its dtype, ``'float32'`` when
    convert kept it in FP32 (asked for float32, or ``'auto'`` on a CPU without
    bfloat16 kernels), None when convert never saw it."""
    state = state_of(block)
    return state.precision if state is not None else None


# --------------------------------------------------------------------------
# Graphs

def _device_type(args):
    for arg in _flat(args):
        if isinstance(arg, mx.nd.NDArray):
            return arg.context.device_type
    return None


def _float32_inputs(args):
    """`args` with float16 and bfloat16 NDArrays cast to FP32 (nested lists kept).

    A converted graph reads FP32 inputs, as the FP32 net does, and casts them
    where its policy says; data from a low-precision input pipeline is exact
    in FP32, and MXNet would otherwise stop at the first op with "expected
    float32, got float16".
    """
    def to_float32(arg):
        if isinstance(arg, (list, tuple)):
            return type(arg)(to_float32(a) for a in arg)
        if isinstance(arg, mx.nd.NDArray) and name_of_array(arg) in LOW_PRECISION:
            return cast(arg, 'float32')
        return arg
    return [to_float32(arg) for arg in args]


def _flat(items: Iterable[Any]) -> Iterator[Any]:
    for item in items:
        if isinstance(item, (list, tuple)):
            for sub in _flat(item):
                yield sub
        else:
            yield item


def _param_contexts(block):
    """The contexts of `block`'s parameters (deferred ones included); [] before initialize()."""
    for param in block.collect_params().values():
        if param._data is not None:
            return param.list_ctx()
        if param._deferred_init:
            return list(param._deferred_init[1])
    return []


def _params_device_type(block):
    """Device type of `block`'s parameters; ``'cpu'`` before initialize()."""
    ctxs = _param_contexts(block)
    return ctxs[0].device_type if ctxs else 'cpu'


def _known_shapes(block):
    """Parameter shapes known so far (deferred initialisation leaves zeros)."""
    return {p.name: p.shape for p in block.collect_params().values()
            if p.shape and all(p.shape)}


def _conversion(block, fp32_symbol, device_type, shapes):
    """The `Conversion` of `block`'s FP32 graph for `device_type`, rewritten only when needed.

    MXNet builds a block's graph again after ``hybridize()`` and for another
    device type, and `summary` may need one before the first call; each reuses
    the conversion last made for the device type when the FP32 graph is the
    same and it knew every shape in `shapes` (parameters and inputs, by name)
    with those values.  The rewrite reads shapes for its layout decisions, so
    a graph is converted once per device type and distinct shape knowledge:
    under deferred initialisation typically once, at the first call (whose
    input shapes settle the parameters'), or twice when `summary` runs before
    that call (shapes not known yet).  Reusing a conversion that knew more
    shapes is exact: shapes only choose between exact layouts.
    """
    state = converted_state(block)
    # A graph for inference alone, or one with operators on the later passes' kernels,
    # converts under another policy (Policy's inference and kernel_ops).
    policy = _policy(block, device_type)
    identity = _graph_identity(fp32_symbol), policy.inference, policy.kernel_ops
    cached = state.conversion_for(device_type)
    if cached is None or cached[0] != identity or any(
            cached[1].shapes.get(name) != tuple(shape) for name, shape in shapes.items()):
        cached = identity, _rewrite(block, fp32_symbol, policy, shapes)
        state.remember_conversion(device_type, *cached)
    return cached[1]


def _graph_identity(symbol):
    """A string equal for two Symbols exactly when they are the same graph.

    MXNet's JSON also gives each input entry a version, the number of times
    the variable was written as an auxiliary state so far; it grows each time
    a block builds its graph again from the same variables, so it is left out.
    """
    graph = json.loads(symbol.tojson())
    return json.dumps([[node['op'], node['name'], node.get('attrs', {}),
                        [entry[:2] for entry in node['inputs']]] for node in graph['nodes']]
                      + [[head[:2] for head in graph['heads']]], sort_keys=True)


def _policy(block, device_type):
    """The policy `block`'s graph converts under for `device_type`: the tree's, for
    inference alone after `mxamp.for_inference`, computing in bfloat16 the operators the
    later passes put on fast kernels (on a CPU, not fused)."""
    state = converted_state(block)
    kernel_ops = pipeline.low_precision_kernel_ops() \
        if device_type == 'cpu' and not state.inference_only else ()
    return state.settings.policy(device_type, inference=state.inference_only,
                                 kernel_ops=kernel_ops)


def _rewrite(block, fp32_symbol, policy, shapes):
    """Converted graph of `block`: mxamp.graph.convert_graph under `policy`."""
    if policy.emulate_float16:
        _warn_float16_cpu()
    if policy.bfloat16_storage_only:
        _warn_bfloat16_storage_only()
    elif policy.dtype == 'bfloat16' and hardware.amx_left_off():
        _warn_bfloat16_without_amx()
    names = set(fp32_symbol.list_inputs())
    # Only parameters already chosen for low precision (by the whole tree, at
    # convert time, or for a child added later, see _adopt) may be declared in
    # low precision: a child block called on its own must agree with its
    # parents on each parameter's dtype.
    params = block.collect_params().values()
    candidates = {p.name for p in params
                  if p.name in names and getattr(p, '_mxamp_precision', None) == policy.dtype}
    # Every parameter variable declares its dtype (__dtype__): no input_types needed.
    inputs = names - {p.name for p in params}
    return graph_mod.convert_graph(fp32_symbol, policy, params=candidates, shapes=shapes,
                                   portable=False, data_inputs=inputs)


def _mode_name(training, input_gradients=False):
    """The mode (`mxamp.passes`) a call runs in: the graphs of the modes may differ."""
    if not training:
        return passes.INFERENCE
    return passes.TRAINING_INPUT_GRADIENTS if input_gradients else passes.TRAINING


def _inputs_take_gradients(args):
    """Whether autograd records and an input of `args` is in its graph: has a gradient
    attached, or was computed from an array that has.

    MXNet 1.9.1: ``autograd.get_symbol`` fails on an array outside any recorded graph
    (``NDArray::get_autograd_symbol``'s check, 11 microseconds), and MXNet records no
    operator whose inputs are all outside one.
    """
    if not autograd.is_recording():
        return False
    for arg in _flat(args):
        if isinstance(arg, mx.nd.NDArray):
            try:
                autograd.get_symbol(arg)
            except mx.base.MXNetError:
                continue
            return True
    return False


def _use_cached_op_for(block, mode):
    """Make `block`'s CachedOp the one for `mode`, keeping the other mode's aside.

    MXNet 1.9.1's ``_call_cached_op`` runs ``_cached_op`` with the arrays
    ``_cached_op_args`` names, and builds both when ``_cached_op`` is None.
    """
    state = converted_state(block)
    if block._cached_op is None or state.cached_for in ('both', mode):
        return
    state.cached_ops[state.cached_for] = block._cached_op, block._cached_op_args
    block._cached_op, block._cached_op_args = state.cached_ops.pop(mode, (None, []))
    state.cached_for = mode if block._cached_op is not None else None


def _runtime_graph(block, symbol, args, mode):
    """The graph `block`'s CachedOp runs in `mode` (`_mode_name`), and whether it differs
    between modes: `symbol` after the later passes (`mxamp.pipeline`), whose record
    the block's state keeps (see `_kernel_gradient_added`)."""
    state = converted_state(block)
    device = _device_type(args) or _params_device_type(block)
    cached = state.conversion_for(device)
    if cached is None:
        state.ran(None)
        return symbol, False
    conversion = cached[1]._replace(symbol=symbol)
    shapes = dict(conversion.shapes)
    inputs, _ = block._cached_graph
    shapes.update((sym.name, arg.shape) for sym, arg in zip(_flat(inputs), _flat(args))
                  if isinstance(arg, mx.nd.NDArray))
    params = block.collect_params()

    def writes_gradient(name):
        return name not in params or params[name].grad_req != 'add'

    runtime = pipeline.run(passes.PassContext(
        conversion, mode, shapes, frozenset(params.keys()), writes_gradient,
        state.settings.policy(device).cpu_class, device, block._backend is not None))
    state.ran(runtime)
    return runtime.symbol, any(record.training_only and record.nodes
                               for record in runtime.passes)


def _kernel_gradient_added(block):
    """Whether a parameter whose gradient a later pass's operator writes now adds its gradient.

    ``grad_req`` may change after the CachedOp was made; the own operators
    always write gradients, so the graph is then rebuilt without them there.
    """
    runtime = converted_state(block).runtime
    names = runtime.gradients_written if runtime is not None else ()
    if not names:
        return False
    params = block.collect_params()
    return any(params[name].grad_req == 'add' for name in names if name in params)


def _warn_float16_cpu():
    global _warned_float16_cpu
    if not _warned_float16_cpu:
        _warned_float16_cpu = True
        warnings.warn('mxamp: float16 on a CPU: MXNet 1.9.1 has no float16 convolution, '
                      'fully-connected or GEMM kernels on CPU, so these ops compute in FP32 '
                      'between float16 casts (float16 storage, FP32 accumulation, like '
                      'tensor cores); other ops run in float16', RuntimeWarning,
                      stacklevel=hardware.user_stacklevel())


def _warn_bfloat16_storage_only():
    global _warned_bfloat16_storage_only
    if not _warned_bfloat16_storage_only:
        _warned_bfloat16_storage_only = True
        warnings.warn('mxamp: bfloat16 on this %s: parameters are stored in bfloat16 and every '
                      'op computes in FP32 between casts (results within bfloat16 rounding of a '
                      'bfloat16 CPU; for portability and half-size parameters, not for speed, '
                      'and in training not for memory: the FP32 master weights stay beside them)'
                      % hardware.describe_cpu_class(),
                      RuntimeWarning, stacklevel=hardware.user_stacklevel())


def _warn_bfloat16_without_amx():
    global _warned_bfloat16_without_amx
    if not _warned_bfloat16_without_amx:
        _warned_bfloat16_without_amx = True
        warnings.warn("mxamp: bfloat16 on this %s (ResNet-50 training: 0.77x FP32). Enable "
                      "AMX for the fast path, or keep float32 (dtype='auto' does)"
                      % hardware.describe_cpu_class(),
                      RuntimeWarning, stacklevel=hardware.user_stacklevel())


def _input_names(block):
    """Graph input names for a symbolic build of `block`, from hybrid_forward's signature."""
    try:
        signature = inspect.signature(block.hybrid_forward)
    except (TypeError, ValueError):
        return ['data']
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.name not in block._reg_params]
    required = [p for p in positional[1:] if p.default is p.empty]  # [0] is F
    count = max(1, len(required))
    return ['data'] if count == 1 else ['data%d' % i for i in range(count)]


class _Untraceable(TypeError):
    """A block whose ``hybrid_forward`` does not build a graph; `cause` says why, briefly."""

    def __init__(self, block, cause):
        super(_Untraceable, self).__init__(
            '%s cannot be turned into a graph (its hybrid_forward must work with F=mx.sym, as '
            'for hybridize()), so mxamp cannot convert it: %s' % (describe_block(block), cause))
        self.cause = cause


def _fp32_graph(block):
    """The FP32 symbol of `block`, built symbolically (no shapes or data needed).

    Raises `_Untraceable` (a TypeError) when its ``hybrid_forward`` fails on symbols."""
    for param in block.collect_params().values():
        _ensure_fp32_var(param)
    inputs = [mx.sym.var(name) for name in _input_names(block)]
    # Symbol inputs make HybridBlock.forward (ours too) call hybrid_forward
    # with F=mx.sym, without touching any cached graph.
    try:
        out = HybridBlock.forward(block, *inputs)
    except Exception as err:  # any failure means the block cannot be traced
        raise _Untraceable(block, '%s: %s' % (type(err).__name__, graph_mod.error_line(err)))
    outputs = list(_flat([out])) if isinstance(out, (list, tuple)) else [out]
    if not all(isinstance(o, mx.sym.Symbol) for o in outputs):
        raise _Untraceable(block, 'it returns non-Symbol outputs when traced')
    return mx.sym.Group(outputs)


def check_traceable(block: HybridBlock, purpose: str) -> None:
    """Raise TypeError, starting with `purpose`, when `block` cannot become one graph."""
    try:
        _fp32_graph(block)
    except _Untraceable as err:
        raise TypeError('%s, and %s cannot become one: %s' % (purpose, describe_block(block),
                                                             err.cause))


def _graph_parts(net):
    """The largest subtrees of `net` that become a graph, and the blocks above them.

    Returns ``(parts, float32_blocks)``: ``(child path, block, parsed FP32
    graph)`` of each such subtree (``[('', net, graph)]`` when `net` itself
    becomes one), and ``(child path, block, why)`` of each block that does
    not, each block once.  Below a block that does not, a subtree without
    parameters has nothing to store or compute in low precision: it stays
    FP32 with its parent.
    """
    parts, float32_blocks, seen = [], [], set()

    def visit(block, path):
        if id(block) in seen:
            return
        seen.add(id(block))
        if isinstance(block, mx.gluon.SymbolBlock):
            float32_blocks.append((path, block, 'a SymbolBlock: mxamp converts its symbol '
                                                'with mxamp.convert_symbol, not the block'))
            return
        if isinstance(block, HybridBlock):
            try:
                graph = graph_mod.load_graph(_fp32_graph(block))
            except _Untraceable as err:
                float32_blocks.append((path, block, err.cause))
            else:
                if block is net or list(block.collect_params().values()):
                    parts.append((path, block, graph))
                return
        else:
            float32_blocks.append((path, block, 'a Block, not a HybridBlock: it has no graph'))
        for key, child in block._children.items():
            visit(child, '%s.%s' % (path, key) if path else key)
    visit(net, '')
    return parts, float32_blocks


def _float32_params(block):
    """Names of `block`'s FP32 parameters that may be stored in low precision: not the
    constants (anchors, fixed tables), which are data, not weights."""
    return {p.name for p in block.collect_params().values()
            if name_of_array(p) == 'float32' and not isinstance(p, mx.gluon.Constant)}


def _decided(rules, parts):
    """`rules` (`mxamp.network_state.Settings`) with the parameters stored in low precision
    decided on the FP32 graphs of `parts` (``(path, block, graph)``): a parameter two parts
    read (tied weights) only where both would store it so."""
    wanted, refused = set(), set()
    for _, block, graph in parts:
        params = _float32_params(block)
        low = rules.decided_for(graph, params).lp_params
        wanted |= low
        refused |= params - low
    return rules._replace(lp_params=frozenset(wanted - refused))


# --------------------------------------------------------------------------
# exclude=

# One entry of convert's `exclude`: a block, a block type, or a name (or pattern).
_Excluded = Union[Block, Type[Block], str]

def _exclude_patterns(net, exclude, node_names, option='exclude'):
    """Node-name patterns for Policy(exclude=...) from blocks, block types and names;
    errors name the keyword the caller used (`option`: exclude, excluded_sym_names)."""
    if exclude is None:
        return []
    if isinstance(exclude, (str, type, Block)):
        exclude = [exclude]
    blocks = list(_walk(net))
    patterns = []
    for item in exclude:
        if isinstance(item, type):
            if not issubclass(item, Block):
                raise TypeError('%s=%r: a type in %s must be a Block subclass' % (option, item, option))
            found = [b for b in blocks if isinstance(b, item)]
            if not found:
                raise ValueError('%s=%s: the net has no block of that type' % (option, item.__name__))
            patterns.extend(b.prefix + '*' for b in found)
        elif isinstance(item, Block):
            if not any(b is item for b in blocks):
                raise ValueError('%s: %s is not part of the net' % (option, describe_block(item)))
            patterns.append(item.prefix + '*')
        elif isinstance(item, str):
            block = _find_block(net, blocks, item)
            if block is not None:
                patterns.append(block.prefix + '*')
            else:
                pattern = item
                if not any(exclude_matches(name, pattern) for name in node_names):
                    raise ValueError("%s=%r matches no block (by name, prefix or child "
                                     "path such as 'features.3') and no graph node" % (option, item))
                patterns.append(pattern)
        else:
            raise TypeError('%s=%r: expected blocks, block types or names' % (option, item))
    return patterns


def _walk(block):
    """`block` and its descendants, each once: a block registered under two parents or
    two names (gluoncv's GoogLeNet, a Siamese tower, tied layers) is one block."""
    seen = set()
    pending = [block]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending.extend(reversed(list(current._children.values())))


def _find_block(net, blocks, text):
    for block in blocks:
        if text in (block.name, block.prefix):
            return block
    node = net
    for part in text.split('.'):
        children = node._children
        if part in children:
            node = children[part]
        else:
            return None
    return node if node is not net else None


# --------------------------------------------------------------------------
# Public API

def convert(net: Block, dtype: Optional[DTypeLike] = None, *,
            exclude: Union[_Excluded, Sequence[_Excluded], None] = None,
            fp32_ops: Optional[Sequence[str]] = None, lp_ops: Optional[Sequence[str]] = None,
            target_dtype: Optional[DTypeLike] = None,
            target_dtype_ops: Optional[Sequence[str]] = None,
            conditional_fp32_ops: Optional[Sequence[Tuple[str, str, Sequence[str]]]] = None,
            excluded_sym_names: Optional[Sequence[str]] = None,
            cast_optional_params: Optional[bool] = None, ctx: Optional[mx.Context] = None
            ) -> Block:
    """Convert a Gluon HybridBlock to mixed precision, in place; returns `net`.

    Parameters
    ----------
    net : mxnet.gluon.HybridBlock
        An FP32 network, initialised or not (deferred initialisation is fine).
        One that cannot become a graph (its ``hybrid_forward`` calls
        ``mx.nd``, or a plain ``Block``) is converted in part: each of its
        largest subtrees that can (`summary` says which blocks stay FP32
        and why).
    dtype : str
        ``'auto'`` (float16 on a GPU, bfloat16 on a CPU that computes it,
        float32 on other CPUs, see `mxamp.dtypes.resolve_dtype`; decided from
        the context of the net's parameters, else from the machine),
        ``'float16'`` or ``'bfloat16'`` (aliases ``'fp16'``, ``'bf16'``...).
        ``'float32'`` leaves `net` untouched (`summary` says so).  bfloat16 on a CPU without
        bfloat16 kernels (`mxamp.hardware.cpu_class` ``'avx2'`` or
        ``'avx512'``) stores the same parameters in bfloat16 and computes every
        op in FP32 (one warning per process).
    exclude : block, block type, str, or a list of them
        Blocks kept entirely in FP32 (their ops and parameters): Block objects,
        Block subclasses (every block of that type), block names or prefixes
        (``'resnetv1b0_layer4'``), child paths (``'features.3'``), or
        ``fnmatch`` patterns on graph node names.
    fp32_ops, lp_ops : list of str
        MXNet operator names forced to FP32 / to low precision.
    target_dtype, target_dtype_ops, conditional_fp32_ops, excluded_sym_names, cast_optional_params, ctx
        MXNet ``contrib.amp.convert_hybrid_block``'s keywords, with its meaning
        (`mxamp.migration` says how each maps): `target_dtype` is `dtype`
        (contrib.amp's default was ``'float16'``, mxamp's is ``'auto'``),
        `excluded_sym_names` node names for `exclude`, `ctx` moves the
        parameters there after converting.  `cast_optional_params` may be
        True (what mxamp does) or left out.

    Returns
    -------
    net, converted: the same object, its class swapped for a generated
    subclass of the same name; see the module documentation.

    Raises
    ------
    TypeError
        `net` is not a Block, or no part of it can be traced symbolically.
    ValueError
        Unknown dtype or operator name, an `exclude` entry that matches nothing,
        a net that is already converted, ``cast_optional_params=False``.
    TypeError
        An option given in both spellings (``dtype`` and ``target_dtype``).
    """
    if not isinstance(net, Block):
        raise TypeError('mxamp.convert needs a gluon Block (a HybridBlock, or a Block holding '
                        'some); got %s' % type(net).__name__)
    if isinstance(net, mx.gluon.SymbolBlock):
        raise TypeError('mxamp.convert does not convert a SymbolBlock; convert its symbol '
                        'with mxamp.graph.convert_graph instead')
    check_convertible(net)
    options = from_contrib_amp('convert', dtype, fp32_ops=fp32_ops, lp_ops=lp_ops, exclude=exclude,
                               target_dtype=target_dtype, target_dtype_ops=target_dtype_ops,
                               conditional_fp32_ops=conditional_fp32_ops,
                               excluded_sym_names=excluded_sym_names,
                               cast_optional_params=cast_optional_params, ctx=ctx)
    if options.cast_params is False:
        raise ValueError('mxamp.convert stores the parameters that only low-precision operators '
                         'read in the low precision (contrib.amp\'s cast_optional_params=True); '
                         'cast_optional_params=False is not supported: leave it out')
    dtype = 'auto' if options.dtype is None else options.dtype
    ctxs = [options.ctx] if options.ctx is not None else _param_contexts(net)
    name = dtypes.resolve_dtype(dtype, ctxs[0] if ctxs else None)
    if name == 'float32':
        # Not converted; summary() says why ('auto': resolve_dtype warned once already).
        if isinstance(dtype, str) and dtype.lower() == 'auto':
            reason = "dtype='auto' kept it in float32 on this %s" % hardware.describe_cpu_class()
        else:
            reason = 'mxamp.convert was asked for float32 (%r)' % (dtype,)
        attach(net, NetworkState.kept_float32(reason))
        return net
    parts, float32_blocks = _graph_parts(net)
    if not parts:
        if isinstance(net, HybridBlock) and float32_blocks[0][1] is net:
            raise _Untraceable(net, float32_blocks[0][2])
        raise TypeError('mxamp.convert: no part of %s becomes a graph (%s), so there is nothing '
                        'to convert' % (describe_block(net), float32_blocks[0][2]))
    node_names = [n['name'] for _, _, graph in parts for n in graph['nodes'] if n['op'] != 'null']
    patterns = _exclude_patterns(net, options.exclude, node_names, options.exclude_option)
    rules = Settings.rules(name, options.fp32_ops, options.lp_ops, patterns,
                           lp_ops_only=options.lp_ops_only, fp32_conditions=options.fp32_conditions)
    settings = _decided(rules, parts)
    for _, part, _ in parts:   # all refusals before any block changes
        _check_shared(part, settings, net)
    for _, part, _ in parts:
        _convert_tree(part, settings, Tree())
    if float32_blocks:
        attach(net, NetworkState.converted_in_part(
            settings, [(path, part) for path, part, _ in parts], float32_blocks))
        net.__class__ = _mixed_class(_ConvertedInPart, type(net))
    if options.ctx is not None:
        # contrib.amp's convert_hybrid_block(ctx=...): where the parameters live.
        net.collect_params().reset_ctx(options.ctx)
    return net


def _convert_tree(net, settings, tree):
    """Convert the HybridBlocks of `net`'s tree under `settings` (`mxamp.network_state.Settings`,
    its low-precision parameters decided, see `_decided`), as members of `tree`; then cast
    its parameters.

    A block converted before, as part of another net that shares it (a tower
    two nets hold), keeps its conversion and joins `tree`; the callers check
    first that its settings agree (`_check_shared`).
    """
    # No graph is converted here: each block's is, when it is built (_get_graph).
    joined = NetworkState.converted(settings, tree)
    for block in _walk(net):
        if is_converted(block):
            converted_state(block).join(joined)
        elif isinstance(block, HybridBlock) and not isinstance(block, mx.gluon.SymbolBlock):
            attach(block, NetworkState.converted(settings, tree))
            block.__class__ = _mixed_class(_Converted, type(block))
        block._clear_cached_op()
    _sync_params(net)


def _in_part_lines(net, state):
    """The head of the summary of a net converted in part: what stays FP32 and why."""
    lines = ['mxamp summary: %s converted to %s in part: it cannot become one graph, so its '
             'largest parts that can were converted (%s); the rest computes in float32:'
             % (describe_block(net), state.precision,
                ', '.join(path for path, _ in state.parts))]
    lines.extend('  %s (%s): %s' % (path or '(the net itself)', describe_block(block), why)
                 for path, block, why in state.float32_blocks)
    return '\n'.join(lines)


def conversion_of(net: HybridBlock) -> Tuple[graph_mod.Conversion, str]:
    """What converting `net` did: ``(mxamp.graph.Conversion, device type)`` of its graph.

    The graph the net last ran (on the device of its parameters, when its
    graph was cleared since), else a symbolic build of it for that device.

    Raises
    ------
    TypeError
        `net` is not converted.
    """
    state = converted_state(net)
    _drop_stale_graph(net)
    last = state.last_conversion() if net._cached_graph else None
    if last is not None:
        return last
    device = _params_device_type(net)
    cached = state.conversion_for(device)
    if cached is not None:
        return cached[1], device
    return _conversion(net, _fp32_graph(net), device, _known_shapes(net)), device


def _runtime_op(node, records):
    """The operator the CachedOp runs `node` on, after the later passes' `records`."""
    op = node.op
    for record in records:
        if node.name in record.operators and not record.training_only:
            op = record.operators[node.name]
    for record in records:
        if node.name in record.operators and record.training_only:
            op = '%s (training: %s)' % (node.op, record.operators[node.name])
    return op


def summary(net: HybridBlock, print_fn: Optional[Callable[[str], Any]] = print) -> str:
    """Print, and return, which ops of a converted net run in which dtype and where casts sit.

    One row per operator of the converted graph (the graph the net last ran,
    or a symbolic build of it): node name, operator, precision it computes in,
    and the casts on its inputs.  Totals follow: ops per precision, casts per
    direction, parameters per storage dtype.  A net made by
    `mxamp.for_inference` gets a line saying what was fused and that it is for
    inference only (the rows are the converted graph's, before fusion).

    This is the static view: what the rewrite decided.  The measured one,
    what ran and what it cost per layer (oneDNN's kernel and its ISA, time
    against FP32, verdicts on what to change), is ``mxamp.profile(net, x)``
    (`mxamp.profiling`).

    Parameters
    ----------
    net : HybridBlock
        A net returned by :func:`convert` or `mxamp.for_inference`.
    print_fn : callable or None
        Called with the text; None prints nothing.

    Returns
    -------
    str
    """
    state = state_of(net)
    if state is not None and state.stage is Stage.CONVERTED_IN_PART:
        text = '\n\n'.join([_in_part_lines(net, state)] +
                           ['part %s:\n%s' % (path, summary(part, print_fn=None))
                            for path, part in state.parts])
        if print_fn is not None:
            print_fn(text)
        return text
    # Set by mxamp.for_inference: what it fused, and that the net cannot train.
    inference = state.fused_for_inference if state is not None else None
    if state is not None and state.stage is Stage.KEPT_FLOAT32:
        text = 'mxamp summary: %s runs in float32: %s' % (describe_block(net), state.float32_reason)
        if inference is not None:
            text += '\n' + inference
        if print_fn is not None:
            print_fn(text)
        return text
    conversion, device = conversion_of(net)
    settings = converted_state(net).settings
    policy = settings.policy(device)
    rows = []
    counts: Counter[str] = collections.Counter()
    runtime = converted_state(net).runtime
    records = runtime.passes if runtime is not None else ()
    for node in conversion.nodes:
        shown = node.computes_in
        if node.computes_in != node.precision:
            shown = 'float32 (%s storage)' % node.precision
        counts[shown] += 1
        reads = ['%s%s' % ('%s->%s' % (read.cast.source, read.cast.to_dtype) if read.cast else read.source,
                           ' +1 zero channel' if read.pad else '')
                 for read in node.inputs if read.cast or read.pad]
        rows.append((node.name, _runtime_op(node, records), shown, ', '.join(reads)))
    heads = ['%s->%s' % (cast.source, cast.to_dtype) for cast in conversion.output_casts if cast]
    widths = [max([len(r[i]) for r in rows] + [len(h)])
              for i, h in enumerate(('node', 'op', 'computes in', 'casts on inputs'))]
    widths[3] = 0
    fmt = '  '.join('%%-%ds' % w for w in widths[:3]) + '  %s'
    if policy.emulate_float16:
        how = ', float16 GEMMs emulated in FP32'
    elif policy.bfloat16_storage_only:
        how = ', %s: bfloat16 storage, FP32 compute' % hardware.describe_cpu_class(policy.cpu_class)
    elif settings.dtype == 'bfloat16':
        how = ', %s' % hardware.describe_cpu_class(policy.cpu_class)
    else:
        how = ''
    lines = ['mxamp summary: %s converted to %s (graph built for %s%s)'
             % (describe_block(net), settings.dtype, device or 'cpu', how)]
    if inference is not None:
        lines.append(inference)
    lines += [fmt % ('node', 'op', 'computes in', 'casts on inputs'),
              fmt % (tuple('-' * w for w in widths[:3]) + ('-' * 15,))]
    lines.extend((fmt % row).rstrip() for row in rows)
    if heads:
        lines.append('outputs cast back: %s' % ', '.join(heads))
    lines.append('ops: ' + ', '.join('%d %s' % (n, k) for k, n in sorted(counts.items())))
    lines.append('casts: ' + (', '.join('%d %s->%s' % (n, a, b)
                                        for (a, b), n in sorted(conversion.casts.items()))
                              or 'none'))
    lines.extend(record.line for record in records if record.line)
    by_dtype: Dict[str, Tuple[int, int]] = {}
    for param in net.collect_params().values():
        key = name_of_array(param) or str(param.dtype)
        count, size = by_dtype.get(key, (0, 0))
        shape = param.shape or ()
        known = all(d > 0 for d in shape)
        elems = int(np.prod(shape)) if known else 0
        by_dtype[key] = (count + 1, size + elems)
    lines.append('parameters: ' + ', '.join(
        '%d in %s (%s values)' % (n, k, format(v, ',')) for k, (n, v) in sorted(by_dtype.items())))
    text = '\n'.join(lines)
    if print_fn is not None:
        print_fn(text)
    return text
