"""Mixed precision for Gluon: converting HybridBlocks in place (:func:`convert`).

This module has no precision rules of its own: every graph a converted block
runs is the FP32 graph its ``hybrid_forward`` builds, put through the pass
pipeline (`mxamp.pipeline`: the precision pass `mxamp.graph.convert_graph`, the
Symbol front's rewrite, then the kernel wing's passes, per mode).  ``convert``
gives every HybridBlock of the tree a generated subclass of its own class
(`mxamp.gluon_parameters.mixed_class`) whose hooks rewrite the graph when MXNet
builds it, run the converted graph also when not hybridized, convert children
added later and refuse what would undo or silently break the conversion
(``cast``, ``optimize_for``).  A network that cannot become a graph is
converted in part: its largest subtrees that can; the blocks above them run
their own code, hybridized or not.  docs/gluon.rst says what a user sees;
docs/architecture.rst where this sits.

MXNet internals relied on (MXNet 1.9.1), each named where it is used below:
``HybridBlock._get_graph`` / ``_cached_graph`` (the hook that builds the graph),
``_build_cache`` (deferred initialisation, then CachedOp), ``_call_cached_op``,
``_cached_op``, ``_cached_op_args``, ``_clear_cached_op``, ``_active``,
``_backend``, ``_reg_params``, ``_children``, ``register_child`` (the one way
children are registered, clearing only that block's graph), the type check of
``Block.__setattr__``, and the names ``HybridBlock`` gives its graph inputs
(``data``, or ``data0``, ``data1``, ...): the symbolic build in :func:`convert`
names its inputs the same, so that its graph is the one MXNet builds later.
Each converted block carries its `mxamp.network_state.NetworkState`, which this
module drives through that module's moves; what it reads of each call's arguments
is `mxamp.gluon_calls`'.
"""
import gc
import inspect
import json
from typing import Mapping, Optional, Sequence, Tuple, Type, Union

import numpy as np

import mxnet as mx
from mxnet import autograd
from mxnet.gluon import Block, HybridBlock

from . import dtypes
from . import graph as graph_mod
from . import gluon_warnings
from . import hardware
from . import passes, pipeline
from .dtypes import LOW_PRECISION, DTypeLike, name_of_array
from .gluon_calls import (CallArrays, device_type_of, flat, float32_inputs,
                          forward_in_float32, graph_takes, inputs_take_gradients, run_cached_op)
from .gluon_parameters import (Float32Checkpoints, ensure_fp32_var, keep_float32, mixed_class,
                               settle, sync_params)
from .network_state import (NetworkState, Settings, Tree, attach, check_convertible,
                            converted_state, describe_block, state_of)
from .policy import Rules, exclude_matches

__all__ = ['convert', 'is_converted']


# --------------------------------------------------------------------------
# The subclass every converted block gets

class _Converted(Float32Checkpoints):
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
                ensure_fp32_var(param)
            inputs, fp32 = super(_Converted, self)._get_graph(*args)
            device = device_type_of(args) or _params_device_type(self)
            shapes = _known_shapes(self)
            shapes.update((sym.name, arg.shape) for sym, arg in zip(flat(inputs), flat(args))
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
        mode = _mode_name(training, inputs_take_gradients(args))
        runtime = _runtime_graph(self, symbol, args, mode)
        graph = symbol if runtime is None else runtime.symbol
        self._cached_graph = inputs, graph
        try:
            super(_Converted, self)._build_cache(*args)
        finally:
            if self._cached_graph and self._cached_graph[1] is graph:
                self._cached_graph = inputs, symbol
        converted_state(self).cache_built(mode, runtime)
        sync_params(self)

    # MXNet 1.9.1: _call_cached_op(*args) builds the cache if self._cached_op is
    # None, then runs it.  A graph built for another device type, or before a child
    # was added, is rebuilt; a block whose graphs differ by mode keeps one CachedOp
    # per mode (_use_cached_op_for).
    # Each call reads its inputs' shapes, dtypes and device once (CallArrays): each read is
    # a C call, and on a small net these checks are a visible share of the forward.
    def _call_cached_op(self, *args):
        return self._run_call(args, CallArrays(args))

    def _run_call(self, args, arrays):
        state = converted_state(self)
        if _kernel_gradient_added(self, state):
            self._clear_cached_op()
        elif not state.repeats_last_call(arrays.device_type, arrays.shapes):
            _drop_stale_graph(self, arrays.device_type)
            if _rebuilt_for_larger_batch(self, args, arrays):
                self._clear_cached_op()
        if not state.serves_every_mode:
            _use_cached_op_for(self, _mode_name(autograd.is_training(),
                                                inputs_take_gradients(args)))
        if arrays.low_precision:
            args = float32_inputs(args)
        if arrays.device is not None:
            outputs = run_cached_op(self, args)
            if outputs is not None:
                return outputs
        return super(_Converted, self)._call_cached_op(*args)

    # MXNet 1.9.1: _clear_cached_op drops the graph, _cached_op and
    # _cached_op_args; the CachedOp kept for the other mode goes with them.
    def _clear_cached_op(self):
        super(_Converted, self)._clear_cached_op()
        converted_state(self).cache_cleared()

    # MXNet 1.9.1: Block.__setattr__ refuses a Block attribute that is not an instance
    # of the attribute's class, here the generated one, so net.output = nn.Dense(10)
    # would fail; such a replacement is let through once _adopt accepted it.
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
        # A call of dense NDArrays on one device (the common one) runs the CachedOp
        # directly (gluon_calls.run_cached_op): MXNet's general path costs a small network
        # about as much as its graph.
        # Not hybridized (or hybridize(active=False)): still run the converted
        # graph.  MXNet's own forward runs hybrid_forward on NDArrays then,
        # where no policy could apply.  A call passing other values than arrays
        # (a flag, a dict of states: GluonTS's Transformer decoder when it
        # predicts) cannot run as a graph, in mxamp or MXNet: it runs the
        # block's code on NDArrays in FP32, as MXNet runs it.
        call = (x,) + args
        arrays = CallArrays.of_plain_call(call)
        if arrays is not None:
            current = mx.context.current_context()
            if (current.device_typeid, current.device_id) == arrays.device:
                return self._run_call(call, arrays)
            with mx.Context(arrays.device_type, arrays.device[1]):
                return self._run_call(call, arrays)
        if not self._active and isinstance(x, mx.nd.NDArray):
            if not graph_takes(args):
                return forward_in_float32(self, x, *args)
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


class _AboveConvertedParts(object):
    """Mixin placed first in the MRO of a block that stays FP32 above converted parts.

    Such a block runs its own code on NDArrays, calling its parts, which take
    and return FP32 arrays.  MXNet can hybridize some of them where mxamp's
    trace cannot (gluonnlp's ``TransformerDecoder`` takes a list of states),
    but their one graph would run their parts' FP32 code, not the converted
    one, on the parts' low-precision parameters: ``hybridize()`` passes on to
    the children and leaves this block imperative.
    """

    # MXNet 1.9.1: HybridBlock.hybridize sets _active and passes the call on to the
    # children (Block.hybridize only passes it on).
    def hybridize(self, active=True, **kwargs):
        """``hybridize`` of the children; this block keeps running its code on NDArrays."""
        super(_AboveConvertedParts, self).hybridize(active, **kwargs)
        if isinstance(self, HybridBlock):
            _run_imperatively(self)

    # MXNet 1.9.1: Block.__setattr__ refuses a Block attribute that is not an instance
    # of the attribute's class, here the generated one, so net.decoder = Decoder(...)
    # would fail where it worked before convert; it is let through, and the new block
    # stays FP32, as a child added later here does.
    def __setattr__(self, name, value):
        existing = self.__dict__.get(name)
        if isinstance(existing, _AboveConvertedParts) and isinstance(value, existing._mxamp_base):
            del self.__dict__[name]
        super(_AboveConvertedParts, self).__setattr__(name, value)


def _run_imperatively(block):
    """Make `block`, a HybridBlock above converted parts, run ``hybrid_forward`` on NDArrays
    (MXNet 1.9.1: when ``_active`` is False); a graph it cached before is dropped."""
    block._active = False
    block._clear_cached_op()


class _ConvertedInPart(_AboveConvertedParts, Float32Checkpoints):
    """Mixin placed first in the MRO of a net `convert` converted in part.

    The net itself runs as it did (its code calls the converted parts, which
    take and return FP32 arrays), imperatively (`_AboveConvertedParts`); what
    it adds is the FP32 checkpoints of a converted net, and the refusal to
    ``cast()``.
    """

    def _converted_parts(self):
        return [part for _, part in state_of(self).parts]

    def cast(self, dtype):
        raise TypeError('%s was converted in part by mxamp to %s; cast() would override the '
                        'precision policy of its parts (convert an FP32 copy of the net instead)'
                        % (describe_block(self), state_of(self).precision))


def is_converted(block: Block) -> bool:
    """Whether `block` was converted by :func:`convert`."""
    return isinstance(block, _Converted)


def store_in_float32(net: Block) -> None:
    """Store every parameter of converted `net` in FP32 from now on, with the values it holds
    (exact), its graphs built again to read them so (a layer still in low precision reads
    its weight through a cast).

    For a library that builds another network on a trained network's parameters or blocks
    and expects them in FP32: GluonTS's estimators make their predictors so.
    """
    keep_float32([p for p in net.collect_params().values() if name_of_array(p) in LOW_PRECISION])
    for block in _walk(net):
        if is_converted(block):
            block._clear_cached_op()
            converted_state(block).forget_conversions()


def _rebuilt_for_larger_batch(block, args, arrays):
    """Whether `args` (read into `arrays`, a `CallArrays`) are larger than the inputs
    `block`'s graph was converted for, enough for a layer kept in FP32 as too small
    (`mxamp.cost`) to pay: the graph is then built again for them.  (A first call on one
    sample, say, does not keep the net in FP32.)"""
    if not block._cached_graph:
        return False
    state = converted_state(block)
    if state.shapes_weighed(arrays.shapes):
        return False   # the common call: the shapes of the last one, nothing to weigh
    device = arrays.device_type or _params_device_type(block)
    cached = state.conversion_for(device)
    if cached is None or not cached[1].small_layers:
        return False
    conversion = cached[1]
    model = _policy(block, device).costs
    growth = max([arg.size / float(np.prod(conversion.shapes[sym.name]))
                  for sym, arg in zip(flat(block._cached_graph[0]), flat(args))
                  if isinstance(arg, mx.nd.NDArray) and sym.name in conversion.shapes] or [1.0])
    if model is None or growth <= 1.0:
        return False
    ops = {node.name: node.op for node in conversion.nodes}
    return any(model.pays(ops[name], work * growth)
               for name, work in conversion.small_layers.items())


def _drop_stale_graph(block, device=None):
    """Clear `block`'s graph and CachedOp when built for another device type than `device`,
    or before a child was registered somewhere in its tree."""
    if block._cached_graph and converted_state(block).graph_is_stale(device):
        block._clear_cached_op()


def _adopt(parent, block):
    """Give `block`, about to be registered as a child of the converted `parent`, its precision.

    An FP32 HybridBlock is converted with `parent`'s settings, its parameters
    decided on its own graph; one converted already must have the same settings.
    Either way it joins `parent`'s `mxamp.network_state.Tree`.  A SymbolBlock,
    which `convert` never converts, keeps FP32 parameters.

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
    device type; the conversion last made for the device type is reused when
    the FP32 graph is the same and it knew every shape in `shapes` with those
    values (shapes only choose between exact layouts, so knowing more is exact).
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
        gluon_warnings.warn_float16_cpu()
    if policy.bfloat16_storage_only:
        gluon_warnings.warn_bfloat16_storage_only()
    elif policy.dtype == 'bfloat16' and hardware.amx_left_off():
        gluon_warnings.warn_bfloat16_without_amx()
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
    stored = {p.name for p in params if p.name in candidates and p._data is not None
              and name_of_array(p) == policy.dtype}
    def converted(declared, under=policy):
        return graph_mod.convert_graph(fp32_symbol, under, params=declared, shapes=shapes,
                                       portable=False, data_inputs=inputs)

    conversion = converted(candidates)
    if policy.costs is not None and not conversion.computes_low and candidates - stored:
        # No layer pays ('auto'): the parameters not yet in low precision (no values, or FP32
        # ones: 'auto' casts at the first build) stay FP32, and the net runs as its FP32 self.
        # Where some layers pay, the small ones' parameters (small too) stay low, read through
        # casts, so that a larger batch that makes them pay (_rebuilt_for_larger_batch) finds
        # them low.
        keep_float32([p for p in params if p.name in candidates - stored])
        conversion = converted(stored)
    settle([p for p in params if p.name in names])
    sync_params(block)
    gluon_warnings.warn_unpaid(block, policy, conversion, converted)
    return conversion


def _mode_name(training, input_gradients=False):
    """The mode (`mxamp.passes`) a call runs in: the graphs of the modes may differ."""
    if not training:
        return passes.INFERENCE
    return passes.TRAINING_INPUT_GRADIENTS if input_gradients else passes.TRAINING


def _use_cached_op_for(block, mode):
    """Make `block`'s CachedOp the one for `mode`, keeping the other mode's aside.

    MXNet 1.9.1's ``_call_cached_op`` runs ``_cached_op`` with the arrays
    ``_cached_op_args`` names, and builds both when ``_cached_op`` is None.
    """
    block._cached_op, block._cached_op_args = converted_state(block).cached_op_for(
        mode, (block._cached_op, block._cached_op_args))


def _runtime_graph(block, symbol, args, mode):
    """The `Conversion` `block`'s CachedOp runs in `mode` (`_mode_name`): `symbol` after the
    later passes (`mxamp.pipeline`); None before any conversion for the device."""
    state = converted_state(block)
    device = device_type_of(args) or _params_device_type(block)
    cached = state.conversion_for(device)
    if cached is None:
        return None
    conversion = cached[1]._replace(symbol=symbol)
    shapes = dict(conversion.shapes)
    inputs, _ = block._cached_graph
    shapes.update((sym.name, arg.shape) for sym, arg in zip(flat(inputs), flat(args))
                  if isinstance(arg, mx.nd.NDArray))
    return pipeline.run(pass_context(block, conversion, mode, device, shapes))


def pass_context(block: HybridBlock, conversion: graph_mod.Conversion, mode: str, device: str,
                 shapes: Mapping[str, Tuple[int, ...]]) -> passes.PassContext:
    """What the later passes (`mxamp.pipeline`) know of converted `block`'s graph
    `conversion` running in `mode` on `device`, its variables of `shapes`."""
    params = block.collect_params()

    def writes_gradient(name):
        return name not in params or params[name].grad_req != 'add'

    return passes.PassContext(
        conversion, mode, shapes, frozenset(params.keys()), writes_gradient,
        converted_state(block).settings.policy(device).cpu_class, device,
        block._backend is not None)


def _kernel_gradient_added(block, state):
    """Whether a parameter whose gradient a later pass's operator writes now adds its gradient
    (`state`: `block`'s).

    ``grad_req`` may change after the CachedOp was made; the own operators
    always write gradients, so the graph is then rebuilt without them there.
    """
    names = state.gradients_written
    if not names:
        return False
    params = block.collect_params()
    return any(params[name].grad_req == 'add' for name in names if name in params)


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
        ensure_fp32_var(param)
    inputs = [mx.sym.var(name) for name in _input_names(block)]
    # Symbol inputs make HybridBlock.forward (ours too) call hybrid_forward
    # with F=mx.sym, without touching any cached graph.
    try:
        out = HybridBlock.forward(block, *inputs)
    except Exception as err:  # any failure means the block cannot be traced
        raise _Untraceable(block, '%s: %s' % (type(err).__name__, graph_mod.error_line(err)))
    outputs = list(flat([out])) if isinstance(out, (list, tuple)) else [out]
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


def _decided(settings, parts, read_in_float32=frozenset()):
    """`settings` (`mxamp.network_state.Settings`) with the parameters stored in low precision
    decided on the FP32 graphs of `parts` (``(path, block, graph)``): a parameter two parts
    read (tied weights) only where both would store it so, and none of `read_in_float32`,
    the names of those FP32 code reads (`_read_in_float32`)."""
    wanted, refused = set(), set(read_in_float32)
    for _, block, graph in parts:
        params = _float32_params(block)
        low = settings.decided_for(graph, params).lp_params
        wanted |= low
        refused |= params - low
    return settings._replace(lp_params=frozenset(wanted - refused))


def _read_in_float32(float32_blocks):
    """Names of the parameters the blocks a net converted in part keeps in FP32 (`_graph_parts`'
    ``(path, block, why)``) read in their own code: their own, which may be a part's too
    (gluonnlp ties weights by ``params=``).  That code gets the values as stored."""
    return {param.name for _, block, _ in float32_blocks
            for param in list(block.params.values()) + list(block._reg_params.values())}


def _above_parts(float32_blocks, parts):
    """The HybridBlocks of `float32_blocks` (``(path, block, why)``) holding a part of
    `parts` (``(path, block, graph)``) in their subtree."""
    part_ids = {id(part) for _, part, _ in parts}
    return [block for _, block, _ in float32_blocks if isinstance(block, HybridBlock)
            and any(id(sub) in part_ids for sub in _walk(block))]


# --------------------------------------------------------------------------
# exclude=

# One entry of convert's `exclude`: a block, a block type, or a name (or pattern).
_Excluded = Union[Block, Type[Block], str]

def _exclude_patterns(net, exclude, node_names, option='exclude'):
    """Node-name patterns for `mxamp.policy.Rules`' exclude from blocks, block types and names;
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
            ctx: Optional[mx.Context] = None) -> Block:
    """Convert a Gluon HybridBlock to mixed precision, in place; returns `net`.

    MXNet ``contrib.amp``'s ``convert_hybrid_block``, with its keywords, is
    `mxamp.contrib_amp`'s.

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
        `ctx`, else from the context of the net's parameters, else from the machine),
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
    ctx : mx.Context, optional
        Where the parameters live once converted (they are moved there); default: where
        they are.

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
        a net that is already converted.

    Examples
    --------
    >>> net = mx.gluon.nn.Dense(10, in_units=4)
    >>> net.initialize()
    >>> net = mxamp.convert(net, 'bfloat16')
    >>> mxamp.dtypes.name_of_array(net.weight.data())
    'bfloat16'
    """
    return convert_with_rules(net, dtype, Rules.of(fp32_ops=fp32_ops, lp_ops=lp_ops),
                              exclude=exclude, ctx=ctx)


def convert_with_rules(net: Block, dtype: Optional[DTypeLike], rules: Rules,
                       exclude: Union[_Excluded, Sequence[_Excluded], None] = None,
                       ctx: Optional[mx.Context] = None, exclude_option: str = 'exclude') -> Block:
    """`convert` with the operator rules made (`mxamp.contrib_amp` gives rules its keywords
    cannot); `exclude`, named `exclude_option` in errors, becomes the rules' patterns here."""
    if not isinstance(net, Block):
        raise TypeError('mxamp.convert needs a gluon Block (a HybridBlock, or a Block holding '
                        'some); got %s' % type(net).__name__)
    if isinstance(net, mx.gluon.SymbolBlock):
        raise TypeError('mxamp.convert does not convert a SymbolBlock; convert its symbol '
                        'with mxamp.graph.convert_graph instead')
    check_convertible(net)
    dtype = 'auto' if dtype is None else dtype
    auto = dtypes.is_auto(dtype)
    ctxs = [ctx] if ctx is not None else _param_contexts(net)
    name = dtypes.resolve_dtype(dtype, ctxs[0] if ctxs else None)
    if name == 'float32':
        # Not converted; summary() says why ('auto': resolve_dtype warned once already).
        if auto:
            reason = "dtype='auto' kept it in float32 on this %s" % hardware.describe_cpu_class()
        else:
            reason = 'mxamp.convert was asked for float32 (%r)' % (dtype,)
        attach(net, NetworkState.kept_float32(reason))
        return net
    parts, float32_blocks = _graph_parts(net)
    # Tracing a hybrid_forward can leave objects holding MXNet Symbols in reference cycles
    # (GluonTS's argument checks keep exceptions whose tracebacks hold the frames); in a
    # long trace they reach Python's oldest generation, which is collected rarely.  Left
    # there, a converted GluonTS DeepAR trained measurably slower than with them freed now
    # (docs/gluonts.rst, "Speed").  One full collection, once per conversion.
    gc.collect()
    if not parts:
        if isinstance(net, HybridBlock) and float32_blocks[0][1] is net:
            raise _Untraceable(net, float32_blocks[0][2])
        raise TypeError('mxamp.convert: no part of %s becomes a graph (%s), so there is nothing '
                        'to convert' % (describe_block(net), float32_blocks[0][2]))
    node_names = [n['name'] for _, _, graph in parts for n in graph['nodes'] if n['op'] != 'null']
    patterns = _exclude_patterns(net, exclude, node_names, exclude_option)
    settings = _decided(Settings.of(name, rules._replace(exclude=tuple(patterns)),
                                    cost_aware=auto), parts, _read_in_float32(float32_blocks))
    for _, part, _ in parts:   # all refusals before any block changes
        _check_shared(part, settings, net)
    for _, part, _ in parts:
        _convert_tree(part, settings, Tree())
    if float32_blocks:
        for block in _above_parts(float32_blocks, parts):
            if block is not net:
                block.__class__ = mixed_class(_AboveConvertedParts, type(block))
            _run_imperatively(block)   # hybridized before convert: its graph is FP32
        attach(net, NetworkState.converted_in_part(
            settings, [(path, part) for path, part, _ in parts], float32_blocks))
        net.__class__ = mixed_class(_ConvertedInPart, type(net))
    if ctx is not None:
        net.collect_params().reset_ctx(ctx)
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
            block.__class__ = mixed_class(_Converted, type(block))
        block._clear_cached_op()
    sync_params(net)


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
