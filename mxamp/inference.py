"""The Gluon inference path: a converted network fused by oneDNN, which refuses to be trained.

`for_inference` closes the traps of ``optimize_for`` on a converted net (docs/inference.rst):
partitioning before mxamp casts the parameters, fused ops' zero gradients, folded weights
kept after ``load_parameters``.  What both fronts share is `mxamp.fusion`'s, exported here too.

MXNet internals relied on (MXNet 1.9.1): ``HybridBlock._build_cache`` (finishes deferred
initialisation, partitions with ``_backend``, makes the CachedOp without running it),
``_cached_graph``, ``_cached_op_args``, ``_clear_cached_op``, ``Parameter._data`` /
``_deferred_init`` / ``_load_init``.
"""
import mxnet as mx
from mxnet import autograd
from mxnet.gluon import HybridBlock

from . import dtypes
from . import gluon as gluon_mod
from .gluon_calls import flat
from .gluon_parameters import mixed_class
from .dtypes import DTypeLike
from .fusion import (BACKEND, FIX, REFUSAL, check_trainable_params, check_trainable_symbol,
                     describe_fusion, fold_batchnorm, format_fusions, fuse_symbol, fused_nodes,
                     mark_inference_only)
from .network_state import Stage, describe_block, seen_state, state_of

__all__ = ['for_inference', 'fuse_symbol', 'fold_batchnorm', 'fused_nodes', 'format_fusions',
           'check_trainable_params', 'check_trainable_symbol']


class _InferenceOnly(object):
    """Mixin placed first in the MRO of a net made by `for_inference`."""

    def forward(self, x, *args):
        if autograd.is_recording():
            raise RuntimeError('%s was made by mxamp.for_inference: %s; %s (or, to use it frozen '
                               'inside a recorded graph, call it under autograd.pause())'
                               % (describe_block(self), REFUSAL, FIX))
        return super(_InferenceOnly, self).forward(x, *args)

    # MXNet 1.9.1: _build_cache partitions with _backend whenever the graph was cleared
    # (for_inference, load_parameters, a child registered anywhere).  Three builds:
    # 1. unfused: deferred parameters get shapes and mxamp dtypes first (the backend
    #    refuses a float32 weight in a bfloat16 graph);
    # 2. mxamp folds BatchNorm after bfloat16 convolutions (MXNet's fold truncates) into
    #    Parameters of the CachedOp only: _build_cache takes a non-empty
    #    _cached_op_args as its (is_input, Parameter) pairs;
    # 3. with the backend.  A new child's parameters get the inference-only mark too.
    def _build_cache(self, *args):
        backend = self._backend
        if backend:
            self._backend = None
            try:
                super(_InferenceOnly, self)._build_cache(*args)
            finally:
                self._backend = backend
            data, graph = self._cached_graph
            params = {param.name: param for param in self.collect_params().values()
                      if param._data is not None}
            state = seen_state(self)
            folded, values, count = fold_batchnorm(
                graph, {name: param.list_data()[0] for name, param in params.items()},
                state.float32_originals)
            self._clear_cached_op()
            if count:
                used = set(folded.list_inputs())
                # Only the folded weights' FP32 values are needed again (a later rebuild).
                state.keep_float32_originals({name: value for name, value
                                              in state.float32_originals.items()
                                              if name not in used})
                self._cached_graph = data, folded
                params.update((name, _cached_op_parameter(name, value))
                              for name, value in values.items())
                self._cached_op_args = [(False, param) for name, param in params.items()
                                        if name in used]
        super(_InferenceOnly, self)._build_cache(*args)
        if backend:
            seen_state(self).mark_fused_for_inference(
                '%s; inference only (training through it raises)'
                % describe_fusion(self._cached_graph[1]))
        mark_inference_only(self.collect_params().values(), describe_block(self))

    def load_parameters(self, *args, **kwargs):
        """``load_parameters`` whose values the fused graph uses from the next call on."""
        super(_InferenceOnly, self).load_parameters(*args, **kwargs)
        # Fold what was loaded, at the next call: a fused convolution keeps its folded weights.
        seen_state(self).keep_float32_originals({})
        self._clear_cached_op()


def _cached_op_parameter(name, value):
    """A Parameter holding `value`, for a CachedOp's inputs only (MXNet 1.9.1 makes the
    same for a backend's new parameters, with the same ``_load_init``)."""
    param = mx.gluon.Parameter(name, grad_req='null', shape=value.shape, dtype=value.dtype)
    param._load_init(value, value.context)
    return param


def for_inference(net: HybridBlock, *inputs: mx.nd.NDArray, dtype: DTypeLike = 'auto') -> HybridBlock:
    """Make `net` a converted, fused inference network, in place; returns `net`.

    Converts `net` unless `mxamp.convert` has seen it, finishes deferred initialisation from
    `inputs` without computing, fuses the graph with oneDNN on a CPU (not on a GPU) and
    hybridizes it with static memory.  The result raises under ``autograd.record()``; after
    ``load_parameters`` the next call fuses again, after ``set_data`` call this again.

    Parameters
    ----------
    net : mxnet.gluon.HybridBlock, initialised (deferred is fine), converted or not
    *inputs : NDArray, example inputs, for their shapes and context
    dtype : str, as `mxamp.convert`; for a converted net ``'auto'`` or its own dtype

    Raises
    ------
    TypeError, ValueError, RuntimeError
        No HybridBlock or no NDArray input; inputs on several contexts or another dtype;
        `net` not initialised.
    """
    if not isinstance(net, HybridBlock):
        raise TypeError('mxamp.for_inference needs a gluon HybridBlock, got %s'
                        % type(net).__name__)
    arrays = [x for x in flat(inputs) if isinstance(x, mx.nd.NDArray)]
    if not arrays:
        raise TypeError('mxamp.for_inference(net, *inputs) needs example inputs (NDArrays, as '
                        'the net is called with) to settle shapes and the device')
    contexts = {x.context for x in arrays}
    if len(contexts) > 1:
        raise ValueError('mxamp.for_inference: the inputs are on several contexts (%s); give '
                         'inputs on the one the net will run on'
                         % ', '.join(sorted(str(c) for c in contexts)))
    device = arrays[0].context.device_type
    uninitialised = [p.name for p in net.collect_params().values()
                     if p._data is None and not p._deferred_init]
    if uninitialised:
        raise RuntimeError("mxamp.for_inference: parameter '%s' of %s is not initialised; call "
                           "net.initialize() or net.load_parameters() first"
                           % (uninitialised[0], describe_block(net)))
    state = state_of(net)
    if state is not None and state.stage is Stage.CONVERTED_IN_PART:
        raise TypeError('mxamp.for_inference fuses one graph, and %s cannot become one (it is '
                        'converted in part): call it on each converted part (%s), or run the net '
                        'as it is' % (describe_block(net), ', '.join(p for p, _ in state.parts)))
    if state is None or state.stage is Stage.KEPT_FLOAT32:
        gluon_mod.check_traceable(net, 'mxamp.for_inference fuses one graph')
    kept = gluon_mod.chosen_precision(net)
    if kept is not None:
        # The user's precision stands, float32 included: 'auto' is for unconverted nets.
        if not dtypes.is_auto(dtype) and \
                dtypes.resolve_dtype(dtype, arrays[0].context) != kept:
            raise ValueError('mxamp.for_inference: %s is converted to %s, dtype=%r asks for '
                             'another precision (give dtype=\'auto\' to keep it, or convert an '
                             'FP32 copy)' % (describe_block(net), kept, dtype))
    else:
        # The FP32 values, before convert rounds them: BatchNorm folds start from them.
        float32 = {param.name: param.list_data()[0] for param in net.collect_params().values()
                   if param._data is not None and dtypes.name_of_array(param) == 'float32'}
        gluon_mod.convert(net, dtype)
        state = seen_state(net)
        state.keep_float32_originals({
            param.name: float32[param.name] for param in net.collect_params().values()
            if param.name in float32 and param._data is not None
            and dtypes.name_of_array(param) in dtypes.LOW_PRECISION})
    backend = BACKEND if device == 'cpu' else None
    flags = dict(static_alloc=True, static_shape=True)
    base = type(net)
    state = seen_state(net)
    # The inference class first: its _build_cache builds unfused, folds, then fuses.
    net.__class__ = mixed_class(_InferenceOnly, base)
    try:
        # The graph converts under the inference policy (Policy's inference) from now on.
        state.build_for_inference(True)
        # HybridBlock's own: a converted block's hybridize refuses a backend to its users.
        HybridBlock.hybridize(net, True, backend=backend, clear=True, **flags)
        net._build_cache(*inputs)
    except Exception:
        net.__class__ = base
        state.build_for_inference(False)
        raise
    if not backend:
        seen_state(net).mark_fused_for_inference(
            'not fused (MXNet 1.9.1 has no oneDNN backend on %s); inference only (training '
            'through it raises)' % device)
    return net
