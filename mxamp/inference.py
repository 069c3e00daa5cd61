"""The inference path: a converted network fused by oneDNN, which refuses to be trained.

This module owns :func:`for_inference`, the Gluon path: a net converted,
materialised and fused, which refuses to be recorded.  What both fronts share
(recognising fused nodes, fusing a symbol with :func:`fuse_symbol`, the
refusal to train with :func:`check_trainable_params` and
:func:`check_trainable_symbol`) is `mxamp.fusion`'s; this module exports those
names too, as the public spelling.

Why more than ``optimize_for``
------------------------------
MXNet 1.9.1's oneDNN subgraph backend (``optimize_for(x, backend='MKLDNN')``)
folds BatchNorm into convolutions and fuses activations and residual additions
as post-ops: on CPUs with AMX that is most of mixed precision's inference speed.
Called directly on a converted net it has three traps, which this module closes
(so a converted net refuses ``optimize_for`` and points here):

* **Order under deferred initialisation.**  ``optimize_for`` partitions the
  graph in the same step that finishes deferred initialisation, so it sees
  the parameters still in FP32 (mxamp casts them right after).  A bfloat16
  graph declares its weights bfloat16; where a convolution reads them through
  a zero input channel (planned only where bfloat16 computes, see
  `mxamp.policy`), the padding's ``Concat`` then joins an FP32 weight and a
  bfloat16 zero: "Non-uniform data type in Concat ... _mxamp_pad_weight".
  :func:`for_inference` first builds the graph unfused (parameters
  materialised and cast), then partitions it: every parameter has its final
  dtype when the backend infers types.  Nothing is computed.
* **No gradient.**  The fused ops' backward returns zeros for every input
  (MXNet's ``MakeZeroGradNodes``), and Gluon does not refuse to record them:
  training through a fused net silently learns nothing (and its BatchNorm,
  folded, uses the running statistics in training mode too).  A net made by
  :func:`for_inference` raises under ``autograd.record()`` and `mxamp.Trainer`
  refuses its parameters; `mxamp.ModuleTrainer` refuses a graph holding fused
  nodes.
* **Stale weights.**  The fused convolution folds BatchNorm into its weights
  when it first runs and keeps the result: ``load_parameters`` into a fused
  FP32 net left its outputs at the old values (measured).  ``load_parameters``
  of a net made by :func:`for_inference` therefore partitions again at the
  next call.

On a GPU MXNet 1.9.1 has no oneDNN backend (and no other fusing backend in
its standard builds): :func:`for_inference` converts, materialises and
hybridizes with static memory there, and refuses training the same way, so
that the same code behaves the same on both devices.

MXNet internals relied on (MXNet 1.9.1), each used in one place below:
``HybridBlock._build_cache`` (finishes deferred initialisation, then partitions
with ``_backend`` and makes the CachedOp, without running it: what
``optimize_for`` does after ``hybridize``), ``_cached_graph`` (the partitioned
graph, whose fused nodes are reported), ``_clear_cached_op``, and
``Parameter._data`` / ``_deferred_init`` (whether a parameter is initialised,
deferred or not).  What was fused is kept in the net's
`mxamp.network_state.NetworkState` (the line `mxamp.summary` prints); its
parameters carry `mxamp.fusion`'s mark.
"""
import mxnet as mx
from mxnet import autograd
from mxnet.gluon import HybridBlock

from . import dtypes
from . import gluon as gluon_mod
from .gluon_parameters import mixed_class
from .dtypes import DTypeLike
from .fusion import (BACKEND, FIX, REFUSAL, check_trainable_params, check_trainable_symbol,
                     describe_fusion, fold_batchnorm, format_fusions, fuse_symbol, fused_nodes,
                     mark_inference_only)
from .network_state import Stage, describe_block, seen_state, state_of

__all__ = ['for_inference', 'fuse_symbol', 'fold_batchnorm', 'fused_nodes', 'format_fusions',
           'check_trainable_params', 'check_trainable_symbol']

# --------------------------------------------------------------------------
# Gluon

class _InferenceOnly(object):
    """Mixin placed first in the MRO of a net made by `for_inference`."""

    def forward(self, x, *args):
        if autograd.is_recording():
            raise RuntimeError('%s was made by mxamp.for_inference: %s; %s (or, to use it frozen '
                               'inside a recorded graph, call it under autograd.pause())'
                               % (describe_block(self), REFUSAL, FIX))
        return super(_InferenceOnly, self).forward(x, *args)

    # MXNet 1.9.1: _build_cache partitions the graph with the backend
    # for_inference set (HybridBlock._backend) whenever the graph was cleared:
    # at for_inference, after load_parameters, after a child was registered
    # anywhere in the tree.  Three steps:
    # 1. an unfused build: deferred parameters (a new child's too) get their
    #    shapes and their mxamp dtype before the backend reads them (it refuses
    #    a float32 weight in a bfloat16 graph);
    # 2. BatchNorm after bfloat16 convolutions folded by mxamp (fold_batchnorm:
    #    MXNet's own fold truncates).  The folded weights and biases are
    #    Parameters of the CachedOp only, not of the net (never saved, never
    #    trained): MXNet's _build_cache takes its parameters from
    #    _cached_op_args when that list is not empty, as (is_input, Parameter)
    #    pairs, and keeps a backend's new parameters the same way;
    # 3. the build with the backend, over that graph.
    # A child's parameters are part of the fused graph from then on: they get
    # the inference-only mark too.
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
        # The FP32 values for_inference kept are not these: fold what was loaded.
        seen_state(self).keep_float32_originals({})
        # Partition again at the next call: a fused convolution keeps the
        # BatchNorm-folded weights it computed from the previous values.
        self._clear_cached_op()


def _cached_op_parameter(name, value):
    """A Parameter holding `value`, for a CachedOp's inputs only (MXNet 1.9.1 makes the
    same for a backend's new parameters, with the same ``_load_init``)."""
    param = mx.gluon.Parameter(name, grad_req='null', shape=value.shape, dtype=value.dtype)
    param._load_init(value, value.context)
    return param


def for_inference(net: HybridBlock, *inputs: mx.nd.NDArray, dtype: DTypeLike = 'auto') -> HybridBlock:
    """Make `net` a converted, fused inference network, in place; returns `net`.

    The one call for inference: it converts `net` (`mxamp.convert` with
    `dtype`) unless `mxamp.convert` has seen it already (that precision is
    kept, also when it is float32),
    finishes deferred initialisation (and the casts of the parameters) from
    `inputs` without computing anything, then lets MXNet's oneDNN backend fuse
    the graph on a CPU (BatchNorm folded into convolutions, activations and
    residual additions as post-ops) and hybridizes it with static memory.
    Works on a fresh net under deferred initialisation, after training, after
    ``load_parameters``.  Where the net computes in FP32, outputs match the
    unfused converted net up to the reordered arithmetic of the folded
    BatchNorm.  Where convolutions compute in bfloat16 (CPUs with bfloat16
    kernels), mxamp folds their BatchNorm itself (`fold_batchnorm`: MXNet's
    fold truncates), from the FP32 values when it converts `net` here (it
    keeps those of the folded weights, 4 bytes each, until
    ``load_parameters``), else from the stored bfloat16 ones; fused outputs
    are as close to FP32 as unfused ones (docs/inference.rst has the
    figures).

    The result cannot be trained: a call under ``autograd.record()`` (train or
    predict mode) raises RuntimeError, and so does `mxamp.Trainer` on its
    parameters.  ``load_parameters`` still works (the next call fuses the new
    values); after changing parameters otherwise (``set_data``) call
    ``for_inference`` again.  On a GPU (no oneDNN) nothing is fused, the rest
    is the same.  `mxamp.summary` says what was fused.

    Parameters
    ----------
    net : mxnet.gluon.HybridBlock
        Initialised (deferred initialisation is fine), converted or not.
    *inputs : NDArray
        Example inputs, as the net is called with (FP32): their shapes settle
        deferred parameters, their context chooses the device.
    dtype : str
        For a net not converted yet: as `mxamp.convert` (``'auto'``: float16
        on a GPU, bfloat16 on a CPU that computes it, float32 elsewhere).  For
        a net `mxamp.convert` has seen, ``'auto'`` or its own dtype: the
        precision it chose is kept, float32 included.

    Returns
    -------
    net, ready to call.

    Raises
    ------
    TypeError
        `net` is not a HybridBlock, or no NDArray input is given.
    ValueError
        Inputs on several contexts, or a `dtype` other than the one `net` is
        converted to.
    RuntimeError
        `net` is not initialised.

    Examples
    --------
    >>> net = mx.gluon.nn.HybridSequential()
    >>> net.add(mx.gluon.nn.Conv2D(8, 3), mx.gluon.nn.BatchNorm(), mx.gluon.nn.Activation('relu'))
    >>> net.initialize()
    >>> x = mx.nd.ones((1, 3, 8, 8))
    >>> net = mxamp.for_inference(net, x)
    >>> net(x).shape
    (1, 8, 6, 6)
    >>> with mx.autograd.record():
    ...     net(x)
    Traceback (most recent call last):
    RuntimeError: HybridSequential '...' was made by mxamp.for_inference: ...
    """
    if not isinstance(net, HybridBlock):
        raise TypeError('mxamp.for_inference needs a gluon HybridBlock, got %s'
                        % type(net).__name__)
    arrays = [x for x in gluon_mod._flat(inputs) if isinstance(x, mx.nd.NDArray)]
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
        if not (isinstance(dtype, str) and dtype.lower() == 'auto') and \
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
        state.inference_only = True
        # HybridBlock's own: a converted block's hybridize refuses a backend to its users.
        HybridBlock.hybridize(net, True, backend=backend, clear=True, **flags)
        net._build_cache(*inputs)
    except Exception:
        net.__class__ = base
        state.inference_only = False
        raise
    if not backend:
        seen_state(net).mark_fused_for_inference(
            'not fused (MXNet 1.9.1 has no oneDNN backend on %s); inference only (training '
            'through it raises)' % device)
    return net
