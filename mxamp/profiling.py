"""Where a network's step time goes, layer by layer: the measured kernel report.

This module owns `profile` (a Gluon network), `profile_symbol` (a Symbol and
its parameters), `profile_checkpoint` (symbol and params files, for the
command line) and the `ProfileReport` they return: one row per layer (the
user's layer and parameter names), totals (the low-precision step against
FP32, the shares of compute-bound operators, memory-bound operators, casts
and reorders, and kernels that are not the fastest this CPU has), and verdicts
in plain words from the rules of `mxamp.verdict_rules`.  `mxamp.summary` is the
static view of a converted network; this is the measured one.

How it measures
---------------
Both sides, the network in its low precision and in FP32, run as Gluon
``SymbolBlock`` s built here from their graphs, with copies of the parameters:
the user's network is not run, changed or re-hybridized (a network that still
waits for its deferred initialisation is called once on the inputs).  A
converted network's low-precision side is the very graph it runs
(`mxamp.gluon.conversion_of`); an FP32 network or symbol is converted here with
the Symbol front (`mxamp.symbol.convert_with_record`, activations cast with
``amp_cast`` as `mxamp.convert` does, for this machine's CPU class), which is
the rewrite `mxamp.convert` applies.

1. **Step time.**  Each side is hybridized as the benchmark does
   (``static_alloc=True, static_shape=True``), warmed up, then both sides run
   `iterations` steps interleaved (FP32, low precision, FP32...), each ended by
   a sync; a side's step time is the median.  A training step is a forward pass
   under ``autograd.record()``, ``backward`` of the outputs (head gradients of
   ones) and one optimizer step (SGD with momentum by default; `mxamp.Trainer`
   with FP32 master weights on the low-precision side, ``gluon.Trainer`` on
   the FP32 side), as ``scripts/benchmark.py --tasks training`` times it.
2. **Operator time.**  Each side is hybridized again with MXNet's engine
   bulking off (``forward_bulk_size=0, backward_bulk_size=0``: bulked
   operators are timed as one ``ImperativeBulk`` without names), and
   `iterations` steps run under MXNet's profiler, each phase (forward,
   backward, update) inside a profiler task, with a sync at its end.  The
   profiler names each operator by its type only (``Convolution``,
   ``_backward_Convolution``), so its events are mapped to graph nodes by
   order: MXNet's CPU engine runs one operator at a time in the order the
   CachedOp pushes them, the graph's order forward and the reverse backward.
   The two sequences are aligned (`difflib` on operator names), an event left
   over is matched to the nearest unmatched node of its operator, a backward
   event that belongs to no forward node (``add_n`` summing the gradients of a
   tensor read twice, ``_backward_copy``...) is charged to the node whose
   backward follows it (the node whose output gradient it completes), and
   MXNet's own bookkeeping (``DeleteVariable``, ``SetValueOp``...) and
   anything still unmatched is reported as unattributed, by name.  Cast nodes
   are charged to the layer that reads through them, zero-channel padding to
   its convolution, update events to the optimizer.
3. **Kernels.**  oneDNN 2.4 reads ``DNNL_VERBOSE`` once, at start-up, and
   prints to the process's stdout, so the implementation names come from a
   child process (this interpreter, ``DNNL_VERBOSE=1``, the same OpenMP
   threads and CPU limits) that loads both graphs from temporary files and runs
   one warm-up and one measured step of each.  Each ``dnnl_verbose,exec`` line
   (primitive, implementation, ISA, dtypes, shapes, time) is matched to a node
   by shapes and order: its primitive must be one the node's operator runs,
   its shape descriptor (``mb2_ic3oc8_ih16oh14kh3...``, ``2x8x14x14``) the
   node's shapes, and among the nodes that fit, the first at or after the
   previous match (nodes behind it only when none ahead fits).  A reorder
   that changes the dtype is an ``amp_cast`` node; one that changes only the
   layout is charged to the node between its neighbours that reads a tensor of
   its shape, else to the next kernel's node if it reads one, else the
   previous one's.  Lines that fit no node are reported as unattributed.

Cost
----
The profiled steps run slower than normal ones (the report states how much:
``profiling_overhead``); the kernel pass costs one child process (importing
MXNet, building both graphs, two steps each; its wall time is reported).
Measured on a 2-core Xeon with AMX (MXNet on 1 OpenMP thread, bfloat16
against FP32, default 5 iterations): a profiled step took +9% (bfloat16) and
+2% (FP32) against a normal one for ResNet-50 v1 inference at batch 16, +15%
and +13% for ResNet-18 v1 inference at batch 4, +17% for ResNet-18 v1's
bfloat16 training step at batch 4; the kernel pass took 5.6 s, 2.3 s and
4.1 s, the whole report 29 s, 5 s and 18 s (14 steps per side with the
defaults, plus the kernel pass).  Nothing here runs unless called: importing
this module (``import mxamp`` does) sets no profiler state and no environment
variable, and imports matplotlib only inside `ProfileReport.plot`; after a
report the profiler is stopped, so a normal run pays nothing for it.

MXNet internals relied on (MXNet 1.9.1)
---------------------------------------
The CachedOp flags ``forward_bulk_size`` / ``backward_bulk_size`` (passed
through ``hybridize``); the profiler's trace file (``'cat': 'operator'`` begin
and end events per engine thread, task events under their domain's name, and
``dump(finished=False)`` writing the events since the last dump without the
closing brackets); the names of backward operators (``_backward_<op>``,
``_backward_copy`` for reshaping operators); that the CPU engine runs
operators in push order (one worker thread, ``MXNET_CPU_WORKER_NTHREADS``
unset); oneDNN 2.4's verbose format (``dnnl_verbose,exec,cpu,<primitive>,
<implementation>,<propagation>,<memory descriptors>,<attributes>,<auxiliary>,
<problem>,<ms>``).
"""
import collections
import ctypes
import difflib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

import mxnet as mx
from mxnet import autograd
from mxnet.gluon import HybridBlock

from . import dtypes, hardware, passes, pipeline
from . import graph as graph_mod
from . import verdict_rules
from .dtypes import LOW_PRECISION, DTypeLike, name_of_array
from .gluon import check_traceable, conversion_of, is_converted
from .network_state import Stage, describe_block, state_of
from .symbol import convert_with_record, graph_inputs, load_params
from .trainer import Trainer

__all__ = ['KernelLine', 'ProfileError', 'ProfileReport', 'parse_verbose_line', 'profile',
           'profile_checkpoint', 'profile_symbol']

SCHEMA_VERSION = 1

# How each side is hybridized: as scripts/benchmark.py does, for the step time.
_HYBRIDIZE = {'static_alloc': True, 'static_shape': True}
# ... and for the profiled steps: no engine bulking, so that each operator is an event.  A
# static-shape inference graph is bulked whatever the bulk sizes (MXNet 1.9.1's CachedOp
# makes one segment of it), so inference is profiled without static_shape.
_UNBULKED = {'static_alloc': True, 'forward_bulk_size': 0, 'backward_bulk_size': 0}
# The optimizer of a training step, unless told: the benchmark's.  The tiny
# learning rate keeps random weights from drifting to inf/NaN over the steps.
_DEFAULT_OPTIMIZER_PARAMS = {'learning_rate': 1e-4, 'momentum': 0.9, 'wd': 1e-5}
_PROFILER_DOMAIN = 'mxamp.profile'
_KERNEL_MARKER = 'MXAMP_PROFILE_KERNELS'
_VERBOSE_PREFIX = 'dnnl_verbose,exec,'
_SEED = 0

FORWARD, BACKWARD, UPDATE = 'forward', 'backward', 'update'

# Engine operations that are MXNet's bookkeeping, not a layer's work.
_ENGINE_EVENTS = frozenset(('DeleteVariable', 'WaitForVar', 'SetValueOp',
                            'ResourceParallelRandomSetSeed'))
# Backward operators named otherwise than _backward_<forward op>.
_BACKWARD_NAMES = {'Flatten': 'copy', 'flatten': 'copy', 'Reshape': 'copy', 'reshape': 'copy',
                   'expand_dims': 'copy', 'squeeze': 'copy', 'Cast': 'cast'}

# Operator classes: what the totals and the plot group by.  Compute-bound are
# the GEMM-based classes; casts are their own; everything else is memory-bound.
_OP_CLASSES = (
    ('convolution', {'Convolution', 'Deconvolution', '_sg_mkldnn_conv'}),
    ('GEMM', {'FullyConnected', 'dot', 'batch_dot', '_linalg_gemm', '_linalg_gemm2', 'RNN',
              '_npi_matmul', '_np_dot', '_sg_mkldnn_fully_connected',
              '_contrib_interleaved_matmul_selfatt_qk', '_contrib_interleaved_matmul_selfatt_valatt',
              '_contrib_interleaved_matmul_encdec_qk', '_contrib_interleaved_matmul_encdec_valatt'}),
    ('normalization', {'BatchNorm', '_contrib_BatchNormWithReLU', '_contrib_SyncBatchNorm',
                       'LayerNorm', 'GroupNorm', 'InstanceNorm', 'L2Normalization', 'LRN'}),
    ('activation', {'Activation', 'relu', 'sigmoid', 'tanh', 'softsign', 'LeakyReLU'}),
    ('pooling', {'Pooling'}),
    ('softmax', {'softmax', 'log_softmax', 'softmin', 'SoftmaxOutput', 'SoftmaxActivation'}),
    ('cast', {'amp_cast', 'amp_multicast', 'Cast'}),
)
COMPUTE_BOUND = ('convolution', 'GEMM')
_OTHER, _PADDING, _OPTIMIZER = 'other', 'padding', 'optimizer'

# oneDNN primitive -> the MXNet operators that run it.
_PRIMITIVE_OPS = {
    'convolution': {'Convolution', '_sg_mkldnn_conv'},
    'deconvolution': {'Deconvolution'},
    'inner_product': {'FullyConnected', '_sg_mkldnn_fully_connected'},
    'batch_normalization': {'BatchNorm', '_contrib_BatchNormWithReLU', '_contrib_SyncBatchNorm'},
    'layer_normalization': {'LayerNorm'},
    'eltwise': {'Activation', 'relu', 'sigmoid', 'tanh', 'softrelu', 'LeakyReLU', 'clip', 'square',
                'sqrt', 'exp', 'log', 'abs'},
    'pooling': {'Pooling'}, 'pooling_v2': {'Pooling'},
    'lrn': {'LRN'},
    'sum': {'elemwise_add', 'add_n', 'ElementWiseSum', '_plus', '_Plus', '_grad_add'},
    'binary': {'broadcast_add', 'broadcast_sub', 'broadcast_mul', 'broadcast_div',
               'elemwise_mul', 'elemwise_sub', 'elemwise_div', '_mul', '_minus', '_div'},
    'concat': {'Concat', 'concat', '_rnn_param_concat'},
    'softmax': {'softmax', 'SoftmaxOutput', 'SoftmaxActivation'},
    'softmax_v2': {'softmax', 'SoftmaxOutput', 'SoftmaxActivation'},
    'logsoftmax': {'log_softmax'},
    'logsoftmax_v2': {'log_softmax'},
    'shuffle': {'transpose'},
    'matmul': {'batch_dot', 'dot', '_npi_matmul'},
    'resampling': {'UpSampling', '_contrib_BilinearResize2D'},
    'reorder': {'amp_cast', 'amp_multicast', 'Cast'},
}
_DTYPES = {'f32': 'float32', 'bf16': 'bfloat16', 'f16': 'float16', 's8': 'int8', 'u8': 'uint8',
           's32': 'int32'}


class ProfileError(ValueError):
    """Input `profile`, `profile_symbol` or `profile_checkpoint` cannot measure; one line
    naming what and where."""


# --------------------------------------------------------------------------
# oneDNN verbose lines

class KernelLine(NamedTuple):
    """One ``dnnl_verbose,exec`` line of oneDNN 2.4, parsed.

    Attributes
    ----------
    primitive : str
        ``'convolution'``, ``'reorder'``, ``'batch_normalization'``...
    implementation : str
        oneDNN's name for the kernel, e.g. ``'jit:avx2'``, ``'ref:any'``,
        ``'brgconv:avx512_core_amx'``.
    prop : str
        ``'forward_training'``, ``'backward_data'``..., ``'undef'`` for reorders.
    dtypes : tuple of str
        The precision of each memory descriptor, in order (``'float32'``,
        ``'bfloat16'``...; ``'undef'`` for absent ones).
    problem : str
        The shape descriptor, e.g. ``'mb2_ic3oc8_ih16oh14kh3sh1dh0ph0_iw16ow14kw3sw1dw0pw0'``.
    ms : float
        Execution time in milliseconds.
    """
    primitive: str
    implementation: str
    prop: str
    dtypes: Tuple[str, ...]
    problem: str
    ms: float

    @property
    def kind(self) -> str:
        """``'reference'``, ``'gemm'``, ``'generic'`` (plain C++) or ``'jit'``."""
        implementation = self.implementation
        if 'ref' in implementation:
            return 'reference'
        if 'gemm' in implementation:
            return 'gemm'
        if implementation.endswith(':any') or implementation.startswith(('simple', 'ncsp', 'nspc')):
            return 'generic'
        return 'jit'

    @property
    def isa(self) -> str:
        """The instruction set in the issue's words: ``'AMX'``, ``'AVX512-BF16'``,
        ``'AVX-512'``, ``'AVX2'``, ``'JIT'`` (a reorder's generic JIT),
        ``'GEMM'``, ``'reference C++'`` or ``'C++'``."""
        implementation = self.implementation
        if 'amx' in implementation:
            return 'AMX'
        if 'avx512_core_bf16' in implementation:
            return 'AVX512-BF16'
        if 'avx512' in implementation:
            return 'AVX-512'
        if 'avx2' in implementation:
            return 'AVX2'
        kind = self.kind
        return {'reference': 'reference C++', 'gemm': 'GEMM', 'generic': 'C++'}.get(kind, 'JIT')

    @property
    def dtype(self) -> str:
        """The precision it computes in: its first memory's (a reorder: ``'float32->bfloat16'``
        when it converts)."""
        known = [d for d in self.dtypes if d != 'undef'] or ['undef']
        if self.primitive == 'reorder' and len(known) > 1 and known[0] != known[-1]:
            return '%s->%s' % (known[0], known[-1])
        return known[0]

    @property
    def backward(self) -> bool:
        return self.prop.startswith('backward')

    def dims(self) -> List[Tuple[int, ...]]:
        """The tensor shapes written ``2x8x14x14`` in the problem (eltwise, reorder, sum...)."""
        return [tuple(int(d) for d in text.split('x'))
                for text in re.findall(r'\d+(?:x\d+)+', self.problem)]

    def fields(self) -> Dict[str, int]:
        """The named sizes of an ``mb2_ic3oc8_ih16...`` problem: ``{'mb': 2, 'ic': 3, ...}``."""
        return {key: int(value) for key, value in re.findall(r'([a-z]+)(\d+)', self.problem)
                if 'x' not in key}


def parse_verbose_line(line: str) -> Optional[KernelLine]:
    """A `KernelLine` from one line of oneDNN 2.4's ``DNNL_VERBOSE=1`` output; None for
    any other line (``info``, ``create``, a program's own output).

    Examples
    --------
    >>> line = parse_verbose_line('dnnl_verbose,exec,cpu,convolution,jit:avx2,'
    ...     'forward_training,src_f32::blocked:abcd:f0 wei_f32::blocked:Acdb8a:f0 '
    ...     'bia_f32::blocked:a:f0 dst_f32::blocked:aBcd8b:f0,,alg:convolution_direct,'
    ...     'mb2_ic3oc8_ih16oh14kh3sh1dh0ph0_iw16ow14kw3sw1dw0pw0,0.0158691')
    >>> line.implementation, line.isa, line.kind, line.dtype, line.fields()['oc']
    ('jit:avx2', 'AVX2', 'jit', 'float32', 8)
    """
    if not line.startswith(_VERBOSE_PREFIX):
        return None
    fields = line.rstrip('\n').split(',')
    if len(fields) < 11:
        return None
    try:
        ms = float(fields[-1])
    except ValueError:
        return None
    memories = fields[6].split()
    kinds = [_DTYPES.get(m.split('_', 1)[1].split(':', 1)[0], 'undef') if '_' in m else 'undef'
             for m in memories]
    return KernelLine(fields[3], fields[4], fields[5], tuple(kinds), fields[-2], ms)


# --------------------------------------------------------------------------
# The graph a side runs

class _Graph(object):
    """One side's executed graph: its op nodes in order, their shapes, and which
    layer (operator node of the FP32 graph) each one is charged to."""

    def __init__(self, symbol, input_shapes, conversion):
        graph = json.loads(symbol.tojson(remove_amp_cast=False))
        self.nodes = graph['nodes']
        self.ops = [nid for nid, node in enumerate(self.nodes) if node['op'] != 'null']
        self.shapes = _entry_shapes(symbol, graph, input_shapes)
        self.index = {node['name']: nid for nid, node in enumerate(self.nodes)}
        self.layer_of, self.kind_of = _charges(self.nodes, self.ops, conversion)

    def name(self, nid):
        return self.nodes[nid]['name']

    def op(self, nid):
        return self.nodes[nid]['op']

    def in_shapes(self, nid):
        return [self.shapes.get((src, k)) for src, k, _ in self.nodes[nid]['inputs']]

    def out_shapes(self, nid):
        return [shape for (node, _), shape in self.shapes.items() if node == nid]


def _entry_shapes(symbol, graph, input_shapes):
    """``{(node index, output index): shape}`` of every entry, from MXNet's shape inference.

    The graph is inferred with every output of every op node as a head (hidden
    outputs too, such as BatchNorm's mean), variables from its arguments.
    """
    rows = graph['node_row_ptr']
    heads = [[nid, k, 0] for nid, node in enumerate(graph['nodes']) if node['op'] != 'null'
             for k in range(rows[nid + 1] - rows[nid])]
    probe = dict(graph, heads=heads)
    probe.pop('node_row_ptr', None)
    probe_symbol = mx.sym.load_json(json.dumps(probe))
    try:
        arg_shapes, out_shapes, aux_shapes = probe_symbol.infer_shape_partial(**input_shapes)
    except mx.base.MXNetError:
        return {}
    shapes = {}
    variables = dict(zip(probe_symbol.list_arguments() + probe_symbol.list_auxiliary_states(),
                         (arg_shapes or []) + (aux_shapes or [])))
    for nid, node in enumerate(graph['nodes']):
        if node['op'] == 'null' and variables.get(node['name']):
            shapes[(nid, 0)] = tuple(variables[node['name']])
    for (nid, k, _), shape in zip(heads, out_shapes or []):
        shapes[(nid, k)] = tuple(shape)
    return {entry: shape for entry, shape in shapes.items() if shape and all(shape)}


def _charges(nodes, ops, conversion):
    """Which layer each executed op node is charged to, and what it is (``'op'``,
    ``'cast'``, ``'pad'``): casts to the layer that reads through them (an output's
    cast to the layer it casts), padding to its convolution."""
    layer_of = {nodes[nid]['name']: nodes[nid]['name'] for nid in ops}
    kind_of = dict.fromkeys(layer_of, 'op')
    if conversion is None:
        return layer_of, kind_of
    for record in conversion.nodes:
        for read in record.inputs:
            if read.cast is not None and kind_of.get(read.cast.name) == 'op':
                layer_of[read.cast.name], kind_of[read.cast.name] = record.name, 'cast'
            for name in read.pad:
                if name in layer_of:
                    layer_of[name], kind_of[name] = record.name, 'pad'
    for cast in conversion.cast_nodes:
        if kind_of.get(cast.name) == 'op':
            layer_of[cast.name], kind_of[cast.name] = cast.source, 'cast'
    # The helper nodes of a rounded narrowing (dtypes.bfloat16_rounding_nodes) are
    # named after their cast, and charged as it is.
    for name in layer_of:
        cast = name.split(dtypes.ROUNDING_SUFFIX)[0]
        if cast != name and kind_of.get(cast) == 'cast':
            layer_of[name], kind_of[name] = layer_of[cast], 'cast'
    return layer_of, kind_of


def _op_class(op):
    for name, ops in _OP_CLASSES:
        if op in ops:
            return name
    return _OTHER


# --------------------------------------------------------------------------
# Building and running a side

class _Side(object):
    """One precision of the network: its graph, a SymbolBlock running it with copies
    of the parameters, and, for training, its trainer."""

    def __init__(self, dtype, symbol, params, conversion, inputs, ctx, train, optimizer,
                 optimizer_params):
        self.dtype = dtype
        self.symbol = symbol
        self.params = params
        self.conversion = conversion
        self.inputs = inputs
        self.train = train
        self.graph = _Graph(symbol, {name: value.shape for name, value in inputs.items()},
                            conversion)
        self.block = _symbol_block(symbol, list(inputs), params, ctx)
        self.trainer = None
        if train:
            trainer_class = mx.gluon.Trainer if dtype == 'float32' else Trainer
            self.trainer = trainer_class(self.block.collect_params(), optimizer,
                                         dict(optimizer_params))
        self.batch = next(iter(inputs.values())).shape[0]

    def hybridize(self, flags):
        self.block.hybridize(**flags)

    def phases(self):
        """The step as ``[(phase, run)]``, each run ending with a sync."""
        arguments = list(self.inputs.values())
        if not self.train:
            return [(FORWARD, lambda: _sync(self.block(*arguments)))]
        recorded = []

        def forward():
            with autograd.record():
                recorded[:] = _flat(self.block(*arguments))
            mx.nd.waitall()

        def backward():
            autograd.backward(recorded)
            mx.nd.waitall()

        def update():
            self.trainer.step(self.batch)
            mx.nd.waitall()
        return [(FORWARD, forward), (BACKWARD, backward), (UPDATE, update)]

    def step(self):
        """One step as a user's loop runs it: syncs after backward and after the update only."""
        arguments = list(self.inputs.values())
        if not self.train:
            _sync(self.block(*arguments))
            return
        with autograd.record():
            outputs = _flat(self.block(*arguments))
        autograd.backward(outputs)
        mx.nd.waitall()
        self.trainer.step(self.batch)
        mx.nd.waitall()


def _flat(output):
    return list(output) if isinstance(output, (list, tuple)) else [output]


def _sync(output):
    for array in _flat(output):
        array.wait_to_read()


def _symbol_block(symbol, input_names, params, ctx):
    """A SymbolBlock running `symbol` on `params` (name -> NDArray, any precision)."""
    with warnings.catch_warnings():
        # SymbolBlock asks the inputs' types before it has seen them; the first call gives them.
        warnings.filterwarnings('ignore', message='Cannot decide type for the following arguments')
        block = mx.gluon.SymbolBlock(symbol, [mx.sym.var(name) for name in input_names])
    block.collect_params().load_dict(params, ctx=ctx, allow_missing=False, ignore_extra=True,
                                     cast_dtype=True, dtype_source='saved')
    return block


# --------------------------------------------------------------------------
# 1. Step time, 2. operator time

def _time_steps(sides, iterations, warmup):
    """Median step ms per side, the sides interleaved (their order alternating per round)."""
    for side in sides:
        side.hybridize(_HYBRIDIZE)
        for _ in range(warmup):
            side.step()
    times = {side.dtype: [] for side in sides}
    for round_index in range(iterations):
        for side in (sides if round_index % 2 == 0 else sides[::-1]):
            start = time.perf_counter()
            side.step()
            times[side.dtype].append(1e3 * (time.perf_counter() - start))
    return {dtype: statistics.median(values) for dtype, values in times.items()}


class _Span(NamedTuple):
    name: str
    start: float
    ms: float


def _read_trace(path):
    """The events of a profiler dump written with ``finished=False`` (no closing brackets)."""
    with open(path) as handle:
        text = handle.read()
    decoder = json.JSONDecoder()
    position = text.index('[', text.index('"traceEvents"')) + 1
    events = []
    while True:
        while position < len(text) and text[position] in ' \t\r\n,':
            position += 1
        if position >= len(text) or text[position] == ']':
            return events
        event, position = decoder.raw_decode(text, position)
        events.append(event)


def _operator_spans(events):
    """Completed operator executions, in start order (begin/end events paired per thread)."""
    open_spans = collections.defaultdict(list)
    spans = []
    for event in sorted((e for e in events if e.get('cat') == 'operator' and e.get('ph') in 'BE'),
                        key=lambda e: e['ts']):
        stack = open_spans[event.get('tid')]
        if event['ph'] == 'B':
            stack.append((event['name'], event['ts']))
        elif stack:
            name, start = stack.pop()
            spans.append(_Span(name, start, (event['ts'] - start) / 1e3))
    spans.sort(key=lambda span: span.start)
    return spans


def _task_windows(events, domain):
    """``[(task name, start us, end us)]`` of the profiler tasks of `domain`."""
    begins = {}
    windows = []
    for event in sorted((e for e in events if e.get('cat') == domain), key=lambda e: e['ts']):
        if event.get('ph') == 'b':
            begins[event['name']] = event['ts']
        elif event.get('ph') == 'e' and event['name'] in begins:
            windows.append((event['name'], begins.pop(event['name']), event['ts']))
    return windows


class _OperatorTimes(object):
    """What the profiled steps of one side measured, each a mean per step.

    ``node_ms[(node, phase)]``: the executed node's own events;
    ``extra_ms[(node, phase)]``: events charged to it by order (gradient sums);
    ``unattributed``: ``{event name: ms}``; ``operator_ms``: every event of
    the forward and backward phases; ``optimizer_ms``: the update phase, wall
    time (its operators and the optimizer's Python); ``step_ms``: the
    profiled step, wall time.
    """

    def __init__(self):
        self.node_ms = collections.Counter()
        self.extra_ms = collections.Counter()
        self.unattributed = collections.Counter()
        self.operator_ms = 0.0
        self.optimizer_ms = 0.0
        self.step_ms = 0.0


def _profile_operators(side, iterations, warmup, workdir, label):
    """Run `iterations` profiled steps of `side` (engine bulking off); `_OperatorTimes`."""
    side.hybridize(dict(_UNBULKED, static_shape=side.train))
    phases = side.phases()
    for _ in range(warmup):
        for _, run in phases:
            run()
    path = os.path.join(workdir, 'trace-%s.json' % label)
    mx.profiler.set_config(profile_symbolic=True, profile_imperative=True, profile_memory=False,
                           profile_api=False, aggregate_stats=False, continuous_dump=False,
                           filename=path)
    domain = mx.profiler.Domain('%s.%s' % (_PROFILER_DOMAIN, label))
    wall = collections.Counter()
    mx.profiler.set_state('run')
    try:
        for iteration in range(iterations):
            for phase, run in phases:
                task = mx.profiler.Task(domain, '%d %s' % (iteration, phase))
                start = time.perf_counter()
                task.start()
                run()
                task.stop()
                wall[phase] += 1e3 * (time.perf_counter() - start) / iterations
    finally:
        mx.profiler.set_state('stop')
        # finished=False: the profiler can be configured again (a second report).
        mx.profiler.dump(finished=False)
    events = _read_trace(path)
    spans = _operator_spans(events)
    times = _OperatorTimes()
    times.step_ms = sum(wall.values())
    times.optimizer_ms = wall.get(UPDATE, 0.0)
    for task, begin, end in _task_windows(events, domain.name):
        phase = task.split(' ', 1)[1]
        if phase == UPDATE:
            continue
        inside = [span for span in spans if begin <= span.start <= end]
        times.operator_ms += sum(span.ms for span in inside) / iterations
        for charge, span in _align(side.graph, phase, inside):
            if charge is None:
                times.unattributed[span.name] += span.ms / iterations
            elif charge[1]:
                times.extra_ms[(charge[0], phase)] += span.ms / iterations
            else:
                times.node_ms[(charge[0], phase)] += span.ms / iterations
    return times


def _event_token(name):
    return name[len('_backward_'):].lower() if name.startswith('_backward_') else name.lower()


def _node_token(op, phase):
    if phase == BACKWARD:
        return _BACKWARD_NAMES.get(op, op).lower()
    return op.lower()


def _align(graph, phase, spans):
    """Charge each span of one phase to an executed node: ``[(charge, span)]``.

    A charge is ``(node name, by_order)`` (`by_order`: a backward event
    belonging to no forward node, charged to the node whose backward follows
    it), or None: bookkeeping or unmatched.  See the module documentation.
    """
    order = graph.ops if phase == FORWARD else graph.ops[::-1]
    node_tokens = [_node_token(graph.op(nid), phase) for nid in order]
    work = [(i, span) for i, span in enumerate(spans) if span.name not in _ENGINE_EVENTS]
    event_tokens = [_event_token(span.name) for _, span in work]
    matcher = difflib.SequenceMatcher(None, node_tokens, event_tokens, autojunk=False)
    matched = {}
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            matched[block.b + offset] = block.a + offset
    # Left over: the nearest unmatched node of the same operator (an operator run
    # out of order, e.g. a parallel branch); positions scaled to the node list.
    free = collections.defaultdict(list)
    taken = set(matched.values())
    for position, token in enumerate(node_tokens):
        if position not in taken:
            free[token].append(position)
    scale = len(node_tokens) / float(max(len(event_tokens), 1))
    for index, token in enumerate(event_tokens):
        if index not in matched and free.get(token):
            nearest = min(free[token], key=lambda p: abs(p - index * scale))
            free[token].remove(nearest)
            matched[index] = nearest
    charges = [None] * len(spans)
    for index, (span_index, _) in enumerate(work):
        if index in matched:
            charges[span_index] = (graph.name(order[matched[index]]), False)
    if phase == BACKWARD:
        following = None
        for index in range(len(work) - 1, -1, -1):
            span_index = work[index][0]
            if charges[span_index] is not None:
                following = charges[span_index][0]
            elif following is not None:
                charges[span_index] = (following, True)
    return list(zip(charges, spans))


# --------------------------------------------------------------------------
# 3. Kernels, in a child process

def _kernel_pass(sides, workdir, train, timeout):
    """Run each side once more in a child process with ``DNNL_VERBOSE=1``.

    Returns
    -------
    tuple
        ``({dtype: {phase: [KernelLine]}}, wall seconds, error line or None)``.
    """
    spec = {'train': train, 'sides': []}
    for side in sides:
        prefix = os.path.join(workdir, 'kernels-%s' % side.dtype)
        side.symbol.save(prefix + '-symbol.json', remove_amp_cast=False)
        mx.nd.save(prefix + '.params', side.params)
        mx.nd.save(prefix + '.inputs', side.inputs)
        spec['sides'].append({'dtype': side.dtype, 'prefix': prefix, 'inputs': list(side.inputs)})
    spec_path = os.path.join(workdir, 'kernels.json')
    with open(spec_path, 'w') as handle:
        json.dump(spec, handle)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, DNNL_VERBOSE='1',
               PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get('PYTHONPATH')])))
    threads = hardware.mxnet_openmp_threads()['openmp_threads']
    if threads:
        env['OMP_NUM_THREADS'] = str(threads)
    command = [sys.executable, '-c', 'import sys, mxamp.profiling as p; '
               'sys.exit(p._kernel_child_main(sys.argv[1]))', spec_path]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {}, time.perf_counter() - start, 'the kernel pass ran past %d s' % timeout
    wall = time.perf_counter() - start
    lines = _kernel_lines(done.stdout)
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if line.strip()][-1:]
        return lines, wall, 'the kernel pass failed (exit status %d): %s' % (
            done.returncode, tail[0] if tail else 'no message')
    return lines, wall, None


def _kernel_lines(stdout):
    """``{dtype: {phase: [KernelLine]}}`` from the child's stdout, between its markers."""
    found = {}
    current = None
    for text in stdout.splitlines():
        if text.startswith(_KERNEL_MARKER):
            _, dtype, phase = text.split()
            current = found.setdefault(dtype, {}).setdefault(phase, []) \
                if phase in (FORWARD, BACKWARD) else None
            continue
        line = parse_verbose_line(text)
        if line is not None and current is not None:
            current.append(line)
    return found


def _mark(text):
    """Print a marker through C's stdout, the stream oneDNN's verbose lines go to (in order)."""
    libc = ctypes.CDLL(None)
    libc.fflush(None)
    libc.puts(('%s %s' % (_KERNEL_MARKER, text)).encode())
    libc.fflush(None)


def _kernel_child_main(spec_path):
    """The kernel pass's child process: one warm-up and one marked step per side."""
    with open(spec_path) as handle:
        spec = json.load(handle)
    # A converted Gluon net's graph may hold the wing's operators (_same_value_passes): the
    # library registers them before the graph loads (the parent's MXAMP_OWN_CONV holds here too).
    pipeline.low_precision_kernel_ops()
    ctx = mx.cpu()
    for entry in spec['sides']:
        prefix = entry['prefix']
        symbol = mx.sym.load(prefix + '-symbol.json')
        params = mx.nd.load(prefix + '.params')
        inputs = mx.nd.load(prefix + '.inputs')
        block = _symbol_block(symbol, entry['inputs'], params, ctx)
        block.hybridize(**_HYBRIDIZE)
        arguments = [inputs[name] for name in entry['inputs']]
        for phase_prefix in ('warmup-', ''):
            _mark('%s %s%s' % (entry['dtype'], phase_prefix, FORWARD))
            if spec['train']:
                with autograd.record():
                    outputs = _flat(block(*arguments))
                mx.nd.waitall()
                _mark('%s %s%s' % (entry['dtype'], phase_prefix, BACKWARD))
                autograd.backward(outputs)
            else:
                _sync(block(*arguments))
            mx.nd.waitall()
        _mark('%s done' % entry['dtype'])
    return 0


class _Kernels(object):
    """The kernel lines of one side, charged to executed nodes."""

    def __init__(self) -> None:
        self.by_node: Dict[str, List[Tuple[str, KernelLine]]] = collections.defaultdict(list)
        self.unattributed: List[Tuple[str, KernelLine]] = []


def _fits(graph, nid, line):
    """Whether kernel `line` can be node `nid`'s work (primitive and shapes)."""
    op = graph.op(nid)
    if op not in _PRIMITIVE_OPS.get(line.primitive, ()):
        return False
    ins = [shape for shape in graph.in_shapes(nid) if shape]
    outs = graph.out_shapes(nid)
    if not ins:
        return False
    data = ins[0]
    fields = line.fields()
    if line.primitive in ('convolution', 'deconvolution', 'pooling', 'pooling_v2',
                          'batch_normalization', 'lrn'):
        spatial = [fields.get(key) for key in ('id', 'ih', 'iw') if key in fields]
        wanted = (fields.get('mb'), fields.get('ic'), *spatial)
        if tuple(data) != wanted:
            return False
        if line.primitive in ('convolution', 'deconvolution'):
            return bool(outs) and outs[0][1] == fields.get('oc')
        return True
    if line.primitive == 'inner_product':
        return (bool(outs) and outs[0][-1] == fields.get('oc')
                and fields.get('mb', 0) * fields.get('ic', 0) == int(np.prod(data)))
    dims = set(line.dims())
    if line.primitive == 'reorder':
        # A dtype-changing reorder is a cast node's work.
        return '->' in line.dtype and tuple(data) in dims
    return bool(dims & set(ins + outs))


def _attribute_kernels(graph, phases, window=40):
    """Charge kernel lines (``{phase: [KernelLine]}``) to executed nodes; `_Kernels`."""
    kernels = _Kernels()
    for phase, lines in phases.items():
        order = graph.ops if phase == FORWARD else graph.ops[::-1]
        pointer = 0
        seen = set()            # (node position, prop) already charged
        assigned = [None] * len(lines)
        for index, line in enumerate(lines):
            if line.primitive == 'reorder' and '->' not in line.dtype:
                continue        # layout only: charged below, from its neighbours
            ahead = range(pointer, min(len(order), pointer + window))
            behind = range(pointer - 1, max(-1, pointer - 1 - window), -1)
            for position in list(ahead) + list(behind):
                if (position, line.prop) not in seen and _fits(graph, order[position], line):
                    seen.add((position, line.prop))
                    assigned[index] = position
                    if position >= pointer:
                        pointer = position
                    break
        for index, line in enumerate(lines):
            if assigned[index] is None and line.primitive == 'reorder' and '->' not in line.dtype:
                assigned[index] = _reorder_owner(graph, order, lines, assigned, index)
            if assigned[index] is None:
                kernels.unattributed.append((phase, line))
            else:
                kernels.by_node[graph.name(order[assigned[index]])].append((phase, line))
    return kernels


def _reorder_owner(graph, order, lines, assigned, index):
    """The node position a layout-only reorder is charged to (see the module documentation)."""
    dims = set(lines[index].dims())
    before = next((assigned[i] for i in range(index - 1, -1, -1) if assigned[i] is not None), None)
    after = next((assigned[i] for i in range(index + 1, len(lines))
                  if assigned[i] is not None and lines[i].primitive != 'reorder'), None)
    if before is not None and after is not None:
        for position in range(before + 1, after):
            if dims & set(s for s in graph.in_shapes(order[position]) if s):
                return position
    if after is not None and dims & set(s for s in graph.in_shapes(order[after]) if s):
        return after
    if before is not None and dims & set(
            [s for s in graph.in_shapes(order[before]) if s] + graph.out_shapes(order[before])):
        return before
    return None


# --------------------------------------------------------------------------
# The report

class ProfileReport(object):
    """What `profile` measured: rows per layer, totals, verdicts.

    Print it (``str(report)``, `table`), save it (`to_dict`, `to_json`,
    `write_json`) or draw it (`plot`).

    Attributes
    ----------
    verdicts : list of mxamp.verdict_rules.Verdict
        Most expensive first.
    rows : list of dict
        One per layer, in graph order (see `to_dict`).
    totals : dict
        Step times, shares and attribution (see `to_dict`).
    """

    def __init__(self, data: Dict[str, Any], verdicts: List[verdict_rules.Verdict]) -> None:
        self._data = data
        self.verdicts = verdicts

    @property
    def rows(self) -> List[Dict[str, Any]]:
        return self._data['rows']

    @property
    def totals(self) -> Dict[str, Any]:
        return self._data['totals']

    def to_dict(self) -> Dict[str, Any]:
        """The report as JSON-ready data (no NaN or infinity: unknown values are None).

        Keys: ``schema_version``; ``network`` (its name, the dtype measured and
        the one asked for, train, batch, input shapes, iterations);
        ``machine`` (CPU, class, threads, versions); ``totals`` (per side
        ``step_ms`` and ``profiled_step_ms``, ``speedup``, ``shares`` of the
        low-precision (else FP32) step by operator class, ``compute_bound``,
        ``memory_bound``, ``casts_and_reorders``, ``not_fastest_kernels``,
        ``attributed`` and what was not: ``unattributed_events``,
        ``unattributed_kernels``, ``between_operators_ms``); ``rows`` (per
        layer: ``layer``, ``node``, ``block``, ``params``, ``op``,
        ``op_class``, ``shape``, ``computes_in``, ``kernel`` and ``kernels``,
        and per side ``forward_ms``, ``backward_ms``, ``gradient_sums_ms``,
        ``casts_ms``, ``reorders_ms``, ``total_ms``, ``share``);
        ``verdicts``; ``cost`` (profiling overhead, the kernel pass's wall
        time, the report's); ``notes``.
        """
        return json.loads(json.dumps(self._data, allow_nan=False))

    def to_json(self, indent: Optional[int] = 1) -> str:
        """`to_dict` as JSON text."""
        return json.dumps(self._data, indent=indent, allow_nan=False)

    def write_json(self, path: str) -> str:
        """Write `to_json` to `path` whole or not at all; returns `path`."""
        partial = '%s.tmp-%d' % (path, os.getpid())
        try:
            with open(partial, 'w') as handle:
                handle.write(self.to_json())
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return path

    def __str__(self) -> str:
        return self.table()

    def table(self, rows: Optional[int] = None) -> str:
        """The printable report: heading, totals, rows, verdicts, notes.

        Parameters
        ----------
        rows : int, optional
            Show only this many layers, the most expensive; default every layer
            in graph order.
        """
        data = self._data
        network, totals = data['network'], data['totals']
        primary, fp32 = network['dtype'], 'float32'
        sides = totals['sides']
        lines = ['mxamp profile: %s, %s against float32, %s, batch %d, %s' % (
            network['name'], primary, 'training step' if network['train'] else 'inference',
            network['batch'], _machine_text(data['machine']))
            if primary != fp32 else
            'mxamp profile: %s in float32, %s, batch %d, %s' % (
                network['name'], 'training step' if network['train'] else 'inference',
                network['batch'], _machine_text(data['machine']))]
        steps = ', '.join('%s %.1f ms' % (dtype, sides[dtype]['step_ms']) for dtype in sides)
        if totals.get('speedup') is not None:
            steps += ' (%.2fx FP32)' % totals['speedup']
        lines.append('step: %s; %.0f%% of the profiled %s step charged to layers%s' % (
            steps, 100 * totals['attributed'], primary,
            ' and the optimizer' if network['train'] else ''))
        shares = totals['shares']
        lines.append('shares of the profiled %s step: compute-bound operators %.0f%%, memory-bound '
                     '%.0f%%, casts %.0f%%%s, between operators %.0f%%; oneDNN reorders %.0f%%, '
                     'kernels not the fastest here %.0f%%' % (
                         primary, 100 * totals['compute_bound'], 100 * totals['memory_bound'],
                         100 * totals['casts'],
                         ', optimizer %.0f%%' % (100 * totals['optimizer']) if network['train'] else '',
                         100 * totals['between_operators'], 100 * totals['reorders'],
                         100 * totals['not_fastest_kernels']))
        lines.append('by operator class (ms, %s): %s' % (
            ' / '.join(sides), ', '.join(
                '%s %s' % (name, ' / '.join(_ms(shares_ms.get(name)) for shares_ms in
                                            [sides[d]['class_ms'] for d in sides]))
                for name in shares)))
        lines.append('')
        chosen = self.rows
        if rows is not None:
            chosen = sorted(chosen, key=lambda r: -(r['sides'][primary]['total_ms'] or 0))[:rows]
        lines.extend(_row_table(chosen, primary, list(sides)))
        lines.append('')
        lines.append('verdicts (most expensive first):' if self.verdicts else
                     'verdicts: none of the rules holds')
        lines.extend('  %d. %s' % (number, verdict.message)
                     for number, verdict in enumerate(self.verdicts, 1))
        lines.append('')
        lines.extend('note: %s' % note for note in data['notes'])
        return '\n'.join(lines)

    def plot(self, path: str) -> str:
        """Draw time per operator class, FP32 against the low precision, into a PNG at `path`.

        Imports matplotlib (its non-interactive ``Agg`` backend) here, only.
        Returns `path`.
        """
        import matplotlib
        matplotlib.use('Agg')
        from matplotlib import pyplot
        sides = self._data['totals']['sides']
        classes = list(self._data['totals']['shares'])
        figure, axes = pyplot.subplots(figsize=(8, 0.45 * len(classes) + 1.8))
        height = 0.8 / max(len(sides), 1)
        for number, (dtype, side) in enumerate(sides.items()):
            values = [side['class_ms'].get(name) or 0.0 for name in classes]
            axes.barh([i + number * height for i in range(len(classes))], values, height,
                      label='%s (step %.1f ms)' % (dtype, side['step_ms']))
        axes.set_yticks([i + height * (len(sides) - 1) / 2 for i in range(len(classes))])
        axes.set_yticklabels(classes)
        axes.invert_yaxis()
        axes.set_xlabel('ms per step (profiled)')
        network = self._data['network']
        axes.set_title('%s: %s, batch %d' % (network['name'], 'training step' if network['train']
                                             else 'inference', network['batch']))
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, format='png')
        pyplot.close(figure)
        return path


def _ms(value):
    return '-' if value is None else '%.2f' % value


def _machine_text(machine):
    return '%s, %s threads, %s' % (machine['cpu'], machine['threads'] or '?',
                                   machine['cpu_description'])


def _row_table(rows, primary, sides):
    header = ['layer', 'op', 'shape', 'computes in', 'kernel', 'fwd ms', 'bwd ms', 'casts ms',
              'reorders ms'] + ['%s ms' % dtype for dtype in sides if dtype != primary] + ['share']
    table = []
    for row in rows:
        mine = row['sides'][primary]
        cells = [row['layer'], row['op'], 'x'.join(map(str, row['shape'] or ())) or '-',
                 row['computes_in'], row['kernel'] or '-', _ms(mine['forward_ms']),
                 _ms(_sum_known(mine['backward_ms'], mine['gradient_sums_ms'])),
                 _ms(mine['casts_ms']), _ms(mine['reorders_ms'])]
        cells += [_ms(row['sides'][dtype]['total_ms']) for dtype in sides if dtype != primary]
        cells.append('%.1f%%' % (100 * (mine['share'] or 0.0)))
        table.append(cells)
    widths = [max(len(r[i]) for r in table + [header]) for i in range(len(header))]
    left = 5

    def line(cells):
        return '  '.join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(header), line(['-' * w for w in widths])] + [line(cells) for cells in table]


def _sum_known(*values):
    known = [v for v in values if v is not None]
    return sum(known) if known else None


# --------------------------------------------------------------------------
# Putting it together

class _Network(NamedTuple):
    """What is measured: a name, per-node layer names, the sides' inputs."""
    name: str
    layer_names: Dict[str, Tuple[str, Optional[str]]]     # node -> (layer, block path)
    inputs: Dict[str, mx.nd.NDArray]
    dtype_requested: Optional[str]
    auto_reason: str


def _measure(network, fp32, low, train, iterations, warmup, kernels, timeout):
    """Measure both sides (or FP32 alone) and build the report."""
    began = time.perf_counter()
    sides = [fp32] + ([low] if low is not None else [])
    primary = sides[-1]
    step_ms = _time_steps(sides, iterations, warmup)
    with tempfile.TemporaryDirectory(prefix='mxamp-profile-') as workdir:
        operator_times = {side.dtype: _profile_operators(side, iterations, warmup, workdir, side.dtype)
                          for side in sides}
        kernel_lines, kernel_wall, kernel_error = ({}, None, None)
        if kernels:
            kernel_lines, kernel_wall, kernel_error = _kernel_pass(sides, workdir, train, timeout)
    attributed = {side.dtype: _attribute_kernels(side.graph, kernel_lines.get(side.dtype, {}))
                  for side in sides}
    rows = _rows(network, sides, operator_times, attributed)
    totals = _totals(sides, primary, step_ms, operator_times, attributed, rows)
    step = _step_record(network, fp32, low, train, step_ms, totals, rows)
    layers = [_layer_record(row, primary, sides) for row in rows]
    verdicts = verdict_rules.evaluate(step, layers)
    threads = hardware.mxnet_openmp_threads()['openmp_threads']
    data = {
        'schema_version': SCHEMA_VERSION,
        'network': {'name': network.name, 'dtype': primary.dtype,
                    'dtype_requested': network.dtype_requested, 'train': train,
                    'batch': primary.batch, 'iterations': iterations, 'warmup': warmup,
                    'inputs': {name: list(value.shape) for name, value in network.inputs.items()}},
        'machine': {'cpu': hardware.cpu_model(), 'cpu_class': hardware.cpu_class(),
                    'cpu_description': hardware.describe_cpu_class(), 'threads': threads,
                    'mxnet': mx.__version__},
        'totals': totals,
        'rows': rows,
        'verdicts': [verdict._asdict() for verdict in verdicts],
        'cost': {'profiling_overhead': {
            side.dtype: _ratio(operator_times[side.dtype].step_ms, step_ms[side.dtype], minus=1.0)
            for side in sides},
            'kernel_pass_s': kernel_wall, 'report_s': time.perf_counter() - began},
        'notes': [],
    }
    data['notes'] = _notes(data, kernels, kernel_error, attributed)
    return ProfileReport(_finite(data), verdicts)


def _ratio(numerator, denominator, minus=0.0):
    if not numerator or not denominator:
        return None
    return numerator / denominator - minus


def _finite(value):
    """`value` with every NaN or infinity replaced by None (the report's JSON is strict)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _rows(network, sides, operator_times, attributed):
    """One row per operator node of the FP32 graph (the layers), in graph order.

    A block the network calls twice (a shared tower) makes nodes of one name,
    which MXNet's profiler times as one: they are one row, its layer named
    with the count of calls.
    """
    fp32_graph = sides[0].graph
    rows = []
    calls = collections.Counter(fp32_graph.name(nid) for nid in fp32_graph.ops)
    seen = set()
    for nid in fp32_graph.ops:
        node = fp32_graph.name(nid)
        if node in seen:
            continue  # a later call of a layer that has its row
        seen.add(node)
        layer, block = network.layer_names.get(node, (node, None))
        if calls[node] > 1:
            layer = '%s (%d calls)' % (layer, calls[node])
        shape = fp32_graph.out_shapes(nid)
        row = {'layer': layer, 'node': node, 'block': block, 'op': fp32_graph.op(nid),
               'op_class': _op_class(fp32_graph.op(nid)),
               'params': [fp32_graph.name(src) for src, _, _ in fp32_graph.nodes[nid]['inputs']
                          if fp32_graph.op(src) == 'null' and fp32_graph.name(src) in sides[0].params],
               'shape': list(shape[0]) if shape else None, 'sides': {}}
        rows.append(row)
    by_node = {row['node']: row for row in rows}
    for side in sides:
        times, kernels, graph = operator_times[side.dtype], attributed[side.dtype], side.graph
        for row in rows:
            row['sides'][side.dtype] = dict.fromkeys(
                ('forward_ms', 'backward_ms', 'gradient_sums_ms', 'casts_ms', 'padding_ms',
                 'reorders_ms', 'kernel_ms', 'total_ms', 'share'))
        for nid in graph.ops:
            name = graph.name(nid)
            row = by_node.get(graph.layer_of.get(name))
            if row is None:
                continue
            cells = row['sides'][side.dtype]
            kind = graph.kind_of[name]
            for phase in (FORWARD, BACKWARD):
                own = times.node_ms.get((name, phase))
                extra = times.extra_ms.get((name, phase))
                if kind == 'op':
                    key = 'forward_ms' if phase == FORWARD else 'backward_ms'
                    cells[key] = _sum_known(cells[key], own)
                else:
                    key = 'casts_ms' if kind == 'cast' else 'padding_ms'
                    cells[key] = _sum_known(cells[key], own)
                cells['gradient_sums_ms'] = _sum_known(cells['gradient_sums_ms'], extra)
            for _, line in kernels.by_node.get(name, ()):
                if line.primitive == 'reorder' and kind == 'op':
                    cells['reorders_ms'] = _sum_known(cells['reorders_ms'], line.ms)
                cells['kernel_ms'] = _sum_known(cells['kernel_ms'], line.ms)
        for row in rows:
            cells = row['sides'][side.dtype]
            cells['total_ms'] = _sum_known(cells['forward_ms'], cells['backward_ms'],
                                           cells['gradient_sums_ms'], cells['casts_ms'],
                                           cells['padding_ms'])
            cells['share'] = _ratio(cells['total_ms'] or 0.0, times.step_ms) or 0.0
    primary = sides[-1]
    for row in rows:
        row['computes_in'] = _computes_in(primary, row['node'])
        row['kernels'] = _row_kernels(primary, row['node'], attributed[primary.dtype])
        main = _main_kernel(row['kernels'])
        row['kernel'] = None if main is None else '%s (%s)' % (main['implementation'], main['isa'])
        row['params'] = sorted(row['params'])
    return rows


def _computes_in(side, node):
    if side.conversion is None:
        return side.dtype
    record = next((r for r in side.conversion.nodes if r.name == node), None)
    return record.computes_in if record is not None else 'float32'


def _row_kernels(side, node, kernels):
    """The kernel lines charged to a layer on `side`: its own node's, its casts' and padding's."""
    found = []
    for name, charged in kernels.by_node.items():
        if side.graph.layer_of.get(name) != node:
            continue
        for phase, line in charged:
            found.append({'node': name, 'phase': phase, 'primitive': line.primitive,
                          'implementation': line.implementation, 'isa': line.isa,
                          'kind': line.kind, 'prop': line.prop, 'dtype': line.dtype,
                          'problem': line.problem, 'ms': line.ms})
    return found


def _main_kernel(kernels):
    """The most expensive kernel of a layer that is not a reorder, else None."""
    compute = [k for k in kernels if k['primitive'] != 'reorder']
    return max(compute, key=lambda k: k['ms']) if compute else None


def _not_fastest(kernel, cpu_class):
    """Whether a kernel is not the fastest kind this CPU has (see mxamp.verdict_rules)."""
    if kernel is None:
        return False
    if kernel['kind'] in ('reference', 'generic'):
        return True
    if kernel['kind'] == 'gemm' and kernel['primitive'] in ('convolution', 'deconvolution'):
        return True
    if kernel['dtype'] == 'bfloat16':
        return kernel['isa'] == 'AVX-512' or (cpu_class == hardware.AMX and kernel['isa'] != 'AMX'
                                              and kernel['primitive'] in verdict_rules.AMX_PRIMITIVES)
    return False


def _totals(sides, primary, step_ms, operator_times, attributed, rows):
    """Step times, class shares and attribution of every side; shares of `primary`'s step."""
    per_side = {}
    for side in sides:
        times = operator_times[side.dtype]
        class_ms = collections.OrderedDict((name, 0.0) for name, _ in _OP_CLASSES)
        class_ms.update({_PADDING: 0.0, _OTHER: 0.0, _OPTIMIZER: 0.0})
        layer_ms = 0.0
        for row in rows:
            cells = row['sides'][side.dtype]
            own = _sum_known(cells['forward_ms'], cells['backward_ms'], cells['gradient_sums_ms'])
            class_ms[row['op_class']] += own or 0.0
            class_ms['cast'] += cells['casts_ms'] or 0.0
            class_ms[_PADDING] += cells['padding_ms'] or 0.0
            layer_ms += cells['total_ms'] or 0.0
        class_ms[_OPTIMIZER] = times.optimizer_ms
        kernels = attributed[side.dtype]
        reorder_ms = sum(line.ms for name, charged in kernels.by_node.items()
                         if side.graph.kind_of.get(name) == 'op'
                         for _, line in charged if line.primitive == 'reorder')
        per_side[side.dtype] = {
            'step_ms': step_ms[side.dtype], 'profiled_step_ms': times.step_ms,
            'operators_ms': times.operator_ms, 'layers_ms': layer_ms,
            'optimizer_ms': times.optimizer_ms, 'reorders_ms': reorder_ms,
            'class_ms': {name: value for name, value in class_ms.items() if value},
            'unattributed_events_ms': dict(sorted(times.unattributed.items())),
            'unattributed_kernels': [{'phase': phase, 'primitive': line.primitive,
                                      'implementation': line.implementation,
                                      'problem': line.problem, 'ms': line.ms}
                                     for phase, line in kernels.unattributed],
            'between_operators_ms': max(times.step_ms - times.optimizer_ms - times.operator_ms, 0.0),
            'attributed': _ratio(layer_ms + times.optimizer_ms, times.step_ms) or 0.0,
        }
    mine = per_side[primary.dtype]
    profiled = mine['profiled_step_ms']
    classes = mine['class_ms']
    compute = sum(classes.get(name, 0.0) for name in COMPUTE_BOUND)
    casts = classes.get('cast', 0.0)
    not_fastest = sum(row['sides'][primary.dtype]['total_ms'] or 0.0 for row in rows
                      if _not_fastest(_main_kernel(row['kernels']), hardware.cpu_class()))
    operators = mine['operators_ms']
    order = [name for name, _ in _OP_CLASSES] + [_PADDING, _OTHER, _OPTIMIZER]
    present = [name for name in order if any(name in side['class_ms'] for side in per_side.values())]
    return {
        'sides': per_side,
        'speedup': _ratio(step_ms['float32'], step_ms[primary.dtype]) if primary.dtype != 'float32'
        else None,
        'shares': {name: classes.get(name, 0.0) / profiled for name in present},
        'compute_bound': compute / profiled,
        'memory_bound': max(operators - compute - casts, 0.0) / profiled,
        'casts': casts / profiled,
        'optimizer': mine['optimizer_ms'] / profiled,
        'reorders': mine['reorders_ms'] / profiled,
        'casts_and_reorders': (casts + mine['reorders_ms']) / profiled,
        'not_fastest_kernels': not_fastest / profiled,
        'between_operators': mine['between_operators_ms'] / profiled,
        'attributed': mine['attributed'],
    }


def _fp32_islands(conversion):
    """The FP32 nodes read through casts from low-precision activations whose outputs are
    cast back to low precision: the islands that cost casts on both sides."""
    if conversion is None:
        return []
    low = conversion.dtype
    cast_back = {cast.source for cast in conversion.cast_nodes
                 if cast.from_dtype == 'float32' and cast.to_dtype == low}
    records = {record.name: record for record in conversion.nodes}
    islands = []
    for record in conversion.nodes:
        if record.precision != 'float32' or record.name not in cast_back:
            continue
        read_up = any(read.cast is not None and read.cast.from_dtype == low
                      and read.source in records for read in record.inputs)
        if read_up:
            islands.append(record.name)
    return islands


def _step_record(network, fp32, low, train, step_ms, totals, rows):
    """The step record the rules of `mxamp.verdict_rules` read."""
    primary = low if low is not None else fp32
    fp32_ms, mine_ms = step_ms['float32'], step_ms[primary.dtype]
    speedup = fp32_ms / mine_ms if low is not None else 1.0
    conversion = primary.conversion
    layer_names = {row['node']: row['layer'] for row in rows}
    operators = totals['sides'][primary.dtype]['operators_ms']
    optimizer = totals['sides'][primary.dtype]['optimizer_ms']
    return {
        'dtype_requested': network.dtype_requested, 'dtype': primary.dtype,
        'auto_reason': network.auto_reason, 'device': 'cpu',
        'cpu_class': hardware.cpu_class(), 'cpu_description': hardware.describe_cpu_class(),
        'computes_low_precision': primary.dtype == 'bfloat16' and hardware.computes_bfloat16(),
        'batch': primary.batch, 'train': train, 'step_ms': mine_ms, 'fp32_step_ms': fp32_ms,
        'speedup': speedup, 'slowdown_share': max(mine_ms - fp32_ms, 0.0) / mine_ms,
        'cast_count': len(conversion.cast_nodes) if conversion is not None else 0,
        'cast_share': totals['casts'],
        'reorder_ms': totals['sides'][primary.dtype]['reorders_ms'],
        'casts_and_reorders_share': totals['casts_and_reorders'],
        'fp32_islands': [layer_names.get(name, name) for name in _fp32_islands(conversion)],
        'overhead_share': max(mine_ms - operators - optimizer, 0.0) / mine_ms,
        'whole_step': 1.0,
    }


def _layer_record(row, primary, sides):
    """A layer record the rules of `mxamp.verdict_rules` read."""
    main = _main_kernel(row['kernels'])
    record = {'layer': row['layer'], 'op': row['op'], 'computes_in': row['computes_in'],
              'share': row['sides'][primary.dtype]['share'] or 0.0,
              'kernel_primitive': None, 'kernel_implementation': None, 'kernel_kind': None,
              'kernel_isa': None, 'kernel_dtype': None, 'kernel_prop': None,
              'channels': None, 'in_channels': None, 'out_channels': None,
              'dense_in': None, 'dense_out': None}
    if main is not None:
        record.update(kernel_primitive=main['primitive'], kernel_implementation=main['implementation'],
                      kernel_kind=main['kind'], kernel_isa=main['isa'], kernel_dtype=main['dtype'],
                      kernel_prop=main['prop'])
    graph = sides[0].graph
    nid = graph.index[row['node']]
    ins = graph.in_shapes(nid)
    shape = row['shape']
    if row['op'] == 'BatchNorm' and ins and ins[0]:
        axis = int(graph.nodes[nid].get('attrs', {}).get('axis', 1))
        record['channels'] = ins[0][axis]
    elif row['op'] == 'Convolution' and len(ins) > 1 and ins[1] and shape:
        groups = int(graph.nodes[nid].get('attrs', {}).get('num_group', 1))
        record['in_channels'], record['out_channels'] = ins[1][1] * groups, shape[1]
    elif row['op'] == 'FullyConnected' and len(ins) > 1 and ins[1]:
        record['dense_in'], record['dense_out'] = ins[1][1], ins[1][0]
    return record


def _notes(data, kernels, kernel_error, attributed):
    """The lines under the report: what it is, what it could not do."""
    network, totals, cost = data['network'], data['totals'], data['cost']
    primary = network['dtype']
    mine = totals['sides'][primary]
    notes = ['step times: median of %d normal steps per side, interleaved; operator times: mean '
             'of %d profiled steps (engine bulking off, MXNet profiler)'
             % (network['iterations'], network['iterations'])]
    overhead = cost['profiling_overhead'].get(primary)
    if overhead is not None:
        notes.append('profiling overhead: a profiled %s step took %+.0f%% against a normal one; '
                     'a normal run pays nothing (nothing is set unless a report is asked for)'
                     % (primary, 100 * overhead))
    unattributed = mine['unattributed_events_ms']
    notes.append('not charged to a layer: %.2f ms between operators (engine, Python), %s'
                 % (mine['between_operators_ms'],
                    ', '.join('%s %.2f ms' % item for item in unattributed.items())
                    or 'no operator event'))
    if not kernels:
        notes.append('kernels: not measured (kernels=False)')
    elif kernel_error is not None:
        notes.append('kernels: %s' % kernel_error)
    else:
        lost = attributed[primary].unattributed
        notes.append('kernels: oneDNN verbose output of a child process (DNNL_VERBOSE=1), %.1f s; '
                     '%d kernel line(s) matched no layer%s' % (
                         cost['kernel_pass_s'], len(lost),
                         ': ' + ', '.join('%s %s (%s)' % (line.primitive, line.problem, phase)
                                          for phase, line in lost[:5]) if lost else ''))
    if primary == 'float16':
        notes.append('Tensor Core lines are a rule (channels and dense dimensions multiples of '
                     '8), not a measurement: this machine runs no NVIDIA GPU')
    if os.environ.get('MXNET_CPU_WORKER_NTHREADS', '1') != '1':
        notes.append('MXNET_CPU_WORKER_NTHREADS=%s: operators may run out of order, so some '
                     'events may be charged to the wrong layer' % os.environ['MXNET_CPU_WORKER_NTHREADS'])
    return notes


# --------------------------------------------------------------------------
# Public entry points

def _check_counts(iterations, warmup):
    if not isinstance(iterations, int) or iterations < 1:
        raise ProfileError('iterations=%r: expected an integer >= 1' % (iterations,))
    if not isinstance(warmup, int) or warmup < 0:
        raise ProfileError('warmup=%r: expected an integer >= 0' % (warmup,))


def _dtype_choice(dtype):
    """``(the dtype asked for, by name; what it means here; why 'auto' means what it does)``."""
    try:
        asked = dtypes.dtype_name(dtype, allowed=('auto', 'float32') + LOW_PRECISION)
    except ValueError as err:
        raise ProfileError('dtype: %s' % err)
    auto, reason = dtypes.auto_on_this_cpu()
    return asked, auto if asked == 'auto' else asked, reason


def _low_side(fp32_symbol, arg_params, aux_params, dtype, inputs, ctx, train, optimizer,
              optimizer_params, exclude=None, fp32_ops=None, lp_ops=None):
    """The low-precision side of an FP32 graph, converted here with the Symbol front."""
    try:
        result = convert_with_record(
            fp32_symbol, dtype, arg_params=arg_params, aux_params=aux_params, exclude=exclude,
            fp32_ops=fp32_ops, lp_ops=lp_ops, ctx=ctx,
            input_shapes={name: value.shape for name, value in inputs.items()},
            portable=False, cpu_class='auto')
    except (graph_mod.GraphError, ValueError) as err:
        raise ProfileError('converting to %s for the report: %s' % (dtype, graph_mod.error_line(err)))
    params = dict(result.arg_params or {})
    params.update(result.aux_params or {})
    return _Side(dtype, result.symbol, params, result.conversion, inputs, ctx, train, optimizer,
                 optimizer_params)


def profile(net: HybridBlock, *inputs: mx.nd.NDArray, train: bool = False,
            dtype: Optional[DTypeLike] = None, iterations: int = 5, warmup: int = 2,
            kernels: bool = True, optimizer: str = 'sgd',
            optimizer_params: Optional[Mapping[str, Any]] = None,
            kernel_timeout: int = 1800) -> ProfileReport:
    """Measure where a Gluon network's step time goes, in its low precision and in FP32.

    Parameters
    ----------
    net : mxnet.gluon.HybridBlock
        A network converted by `mxamp.convert` (its low-precision side is the
        graph it runs), or an FP32 one (converted for the report only, with
        `dtype`).  It is not run, changed or re-hybridized; its parameters are
        copied (one call on `inputs` first when its initialisation is still
        deferred).
    *inputs : NDArray
        The network's inputs (FP32, on the CPU); the first one's first
        dimension is the batch.
    train : bool
        False: inference (forward).  True: a training step (forward under
        ``autograd.record()``, backward of the outputs, one optimizer step).
    dtype : str, optional
        For an FP32 net: ``'auto'`` (default; float32 on a CPU without
        bfloat16 kernels, and then only FP32 is measured, saying why),
        ``'bfloat16'``, ``'float16'`` or ``'float32'``.  For a converted net:
        None or its own dtype.
    iterations, warmup : int
        Timed and untimed steps per side, for the step time and again for the
        operator time (default 5 and 2).
    kernels : bool
        Also run the kernel pass (a child process with ``DNNL_VERBOSE=1``)
        for the oneDNN implementation behind each layer.
    optimizer, optimizer_params
        The training step's optimizer (default SGD with momentum 0.9,
        learning rate 1e-4, weight decay 1e-5, as ``scripts/benchmark.py``).
    kernel_timeout : int
        Seconds the kernel pass may take.

    Returns
    -------
    ProfileReport

    Raises
    ------
    ProfileError
        Inputs that are not CPU NDArrays, an unknown dtype, a dtype other than
        a converted net's, a net that is not initialised, counts below 1.
    """
    _check_counts(iterations, warmup)
    if not isinstance(net, HybridBlock):
        raise ProfileError('mxamp.profile needs a gluon HybridBlock; got %s' % type(net).__name__)
    if not inputs or not all(isinstance(x, mx.nd.NDArray) for x in inputs):
        raise ProfileError('mxamp.profile(net, *inputs): give the inputs as NDArrays '
                           '(got %s)' % (', '.join(type(x).__name__ for x in inputs) or 'none'))
    if any(x.context.device_type != 'cpu' for x in inputs):
        raise ProfileError('mxamp.profile measures on the CPU: the inputs are on %s'
                           % inputs[0].context)
    state = state_of(net)
    if state is not None and state.stage is Stage.CONVERTED_IN_PART:
        raise ProfileError('mxamp.profile times one graph, and %s cannot become one (it is '
                           'converted in part): profile each converted part (%s)'
                           % (describe_block(net), ', '.join(path for path, _ in state.parts)))
    try:
        check_traceable(net, 'mxamp.profile times one graph')
    except TypeError as err:
        raise ProfileError(str(err))
    ctx = mx.cpu()
    names = ['data'] if len(inputs) == 1 else ['data%d' % i for i in range(len(inputs))]
    feed = dict(zip(names, inputs))
    _finish_initialisation(net, inputs)
    optimizer_params = dict(optimizer_params or _DEFAULT_OPTIMIZER_PARAMS)
    fp32_symbol = _fp32_symbol(net, names)
    fp32_params = _fp32_params(net, ctx)
    fp32 = _Side('float32', fp32_symbol, fp32_params, None, feed, ctx, train, optimizer,
                 optimizer_params)
    low = None
    if is_converted(net) and state is not None:
        own = state.settings.dtype
        if dtype is not None and _dtype_choice(dtype)[1] != own:
            raise ProfileError('dtype=%r: %s is converted to %s; profile it as it is (dtype=None) '
                               'or profile its FP32 original' % (dtype, describe_block(net), own))
        requested, reason = own, 'the net is converted to %s' % own
        conversion = _same_value_passes(net, train)
        low_params = {p.name: p.data(ctx).copy() for p in net.collect_params().values()}
        low = _Side(own, conversion.symbol, low_params, conversion, feed, ctx,
                    train, optimizer, optimizer_params)
    else:
        requested, target, reason = _dtype_choice('auto' if dtype is None else dtype)
        if state is not None and state.stage is Stage.KEPT_FLOAT32 and state.float32_reason:
            reason = state.float32_reason
        if target != 'float32':
            arg_params, aux_params = _split_params(fp32_symbol, fp32_params)
            low = _low_side(fp32_symbol, arg_params, aux_params, target, feed, ctx, train,
                            optimizer, optimizer_params)
    network = _Network(describe_block(net), _gluon_layer_names(net, fp32_symbol), feed,
                       requested, reason)
    return _measure(network, fp32, low, train, iterations, warmup, kernels, kernel_timeout)


def _same_value_passes(net, train):
    """`net`'s conversion after the later passes that compute the same values on other
    kernels (`mxamp.passes.GraphPass.same_values`), as the net runs them: its policy may
    compute those operators in bfloat16 there, which MXNet's kernels would misreport.
    The passes that choose kernels by measurement are what the profile judges, so the
    profile times MXNet's operators there."""
    conversion, device = conversion_of(net)
    params = net.collect_params()
    context = passes.PassContext(
        conversion, passes.TRAINING if train else passes.INFERENCE, conversion.shapes,
        frozenset(params.keys()), lambda name: True,
        state_of(net).settings.policy(device).cpu_class, device, False)
    return pipeline.run(context, [graph_pass for graph_pass in pipeline.kernel_passes()
                                  if graph_pass.same_values])


def _finish_initialisation(net, inputs):
    params = list(net.collect_params().values())
    if any(p._data is None and not p._deferred_init for p in params):
        missing = next(p.name for p in params if p._data is None and not p._deferred_init)
        raise ProfileError('%s is not initialised (parameter %s): call net.initialize() first'
                           % (describe_block(net), missing))
    if any(p._deferred_init for p in params):
        with autograd.pause():
            _sync(net(*inputs))


def _fp32_symbol(net, names):
    """The FP32 graph of `net`'s ``hybrid_forward`` (every variable declared FP32)."""
    output = net(*[mx.sym.var(name) for name in names])
    symbol = mx.sym.Group(_flat(output)) if isinstance(output, (list, tuple)) else output
    graph = json.loads(symbol.tojson())
    for node in graph['nodes']:
        if node['op'] == 'null':
            node.get('attrs', {}).pop('__dtype__', None)
    return mx.sym.load_json(json.dumps(graph))


def _fp32_params(net, ctx):
    """FP32 copies of `net`'s parameters, by name (low-precision ones widened, exactly)."""
    values = {}
    for param in net.collect_params().values():
        value = param.data(ctx)
        values[param.name] = (dtypes.cast(value.copy(), 'float32')
                              if name_of_array(value) in LOW_PRECISION else value.copy())
    return values


def _split_params(symbol, params):
    auxiliary = set(symbol.list_auxiliary_states())
    arg_params = {k: v for k, v in params.items() if k not in auxiliary}
    aux_params = {k: v for k, v in params.items() if k in auxiliary}
    return arg_params, aux_params


def _gluon_layer_names(net, symbol):
    """``{node name: (layer, block path)}``: a node's layer is its name without the
    network's prefix (and ``_fwd``); its block the child path of the deepest block
    whose prefix starts the node's name."""
    blocks = []

    def walk(block, path):
        blocks.append((block.prefix, path))
        for key, child in block._children.items():
            walk(child, '%s.%s' % (path, key) if path else key)
    walk(net, '')
    blocks.sort(key=lambda item: -len(item[0]))
    root = net.prefix
    names = {}
    for node in json.loads(symbol.tojson())['nodes']:
        if node['op'] == 'null':
            continue
        name = node['name']
        layer = name[len(root):] if root and name.startswith(root) and name != root else name
        if layer.endswith('_fwd') and len(layer) > 4:
            layer = layer[:-4]
        path = next((path for prefix, path in blocks if prefix and name.startswith(prefix)), '')
        names[name] = (layer, path or None)
    return names


def profile_symbol(symbol: mx.sym.Symbol, arg_params: Optional[Dict[str, mx.nd.NDArray]] = None,
                   aux_params: Optional[Dict[str, mx.nd.NDArray]] = None, *,
                   input_shapes: Mapping[str, Sequence[int]], dtype: DTypeLike = 'auto',
                   train: bool = False, iterations: int = 5, warmup: int = 2,
                   kernels: bool = True, exclude: Optional[Iterable[str]] = None,
                   fp32_ops: Optional[Iterable[str]] = None, lp_ops: Optional[Iterable[str]] = None,
                   optimizer: str = 'sgd', optimizer_params: Optional[Mapping[str, Any]] = None,
                   kernel_timeout: int = 1800) -> ProfileReport:
    """Measure where an FP32 Symbol's step time goes, converted to `dtype` and in FP32.

    Parameters
    ----------
    symbol : mx.sym.Symbol
        The FP32 graph (as ``mx.model.load_checkpoint`` or ``HybridBlock.export``
        give it).
    arg_params, aux_params : dict of str to NDArray, optional
        Its parameters; without them the parameters are drawn at random
        (Xavier, fixed seed): the time does not depend on their values.
    input_shapes : dict
        The shape of every data input, e.g. ``{'data': (4, 3, 224, 224)}``;
        inputs left out whose shape the graph infers (``softmax_label``) get
        zeros.  Data inputs are uniform random, fixed seed.
    dtype : str
        ``'auto'`` (default: this machine's fastest precision; float32 on a CPU
        without bfloat16 kernels, and then only FP32 is measured, saying why),
        ``'bfloat16'``, ``'float16'`` or ``'float32'``.
    train, iterations, warmup, kernels, optimizer, optimizer_params, kernel_timeout
        As `profile`'s.
    exclude, fp32_ops, lp_ops
        As `mxamp.convert_symbol`'s.

    Returns
    -------
    ProfileReport

    Raises
    ------
    ProfileError
        A graph that is already converted, input shapes that do not fit it
        (naming the input), missing or unknown parameters, an unknown dtype.
    """
    _check_counts(iterations, warmup)
    requested, target, reason = _dtype_choice(dtype)
    ctx = mx.cpu()
    try:
        loaded = graph_mod.load_graph(symbol)
    except graph_mod.GraphError as err:
        raise ProfileError('the symbol: %s' % err)
    casts = graph_mod.find_casts(loaded, graph_mod.infer_entry_types(loaded))
    if casts:
        raise ProfileError("the symbol is already converted by mxamp (cast node '%s'): profile "
                           "the FP32 graph with dtype=... instead" % casts[0].name)
    params = dict(arg_params or {})
    params.update(aux_params or {})
    if arg_params is None and aux_params:
        raise ProfileError('aux_params without arg_params: give both, or neither (random values)')
    inputs = _symbol_inputs(symbol, params, input_shapes)
    if arg_params is None:
        params = _random_params(symbol, inputs, ctx)
    optimizer_params = dict(optimizer_params or _DEFAULT_OPTIMIZER_PARAMS)
    fp32 = _Side('float32', symbol, params, None, inputs, ctx, train, optimizer, optimizer_params)
    low = None
    if target != 'float32':
        args, auxs = _split_params(symbol, params)
        low = _low_side(symbol, args, auxs, target, inputs, ctx, train, optimizer,
                        optimizer_params, exclude=exclude, fp32_ops=fp32_ops, lp_ops=lp_ops)
    layer_names: Dict[str, Tuple[str, Optional[str]]] = {
        node['name']: (node['name'], None) for node in loaded['nodes'] if node['op'] != 'null'}
    name = 'symbol (%s)' % ', '.join(symbol.list_outputs())
    network = _Network(name, layer_names, inputs, requested, reason)
    return _measure(network, fp32, low, train, iterations, warmup, kernels, kernel_timeout)


def _symbol_inputs(symbol, params, input_shapes):
    """The input arrays of `symbol`: uniform random for `input_shapes` (fixed seed), zeros
    for the inputs whose shapes the graph infers (labels)."""
    names = graph_inputs(symbol, params)
    unknown = [name for name in input_shapes if name not in names]
    if unknown:
        raise ProfileError('input_shapes: %s is not an input of the graph (its inputs: %s)'
                           % (unknown[0], ', '.join(names) or 'none'))
    try:
        arg_shapes, _, _ = symbol.infer_shape_partial(**{k: tuple(v) for k, v in input_shapes.items()})
    except mx.base.MXNetError as err:
        raise ProfileError('input_shapes %s do not fit the graph: %s'
                           % (dict(input_shapes), graph_mod.error_line(err)))
    shapes = dict(zip(symbol.list_arguments(), arg_shapes or []))
    random = np.random.RandomState(_SEED)
    inputs = {}
    for name in names:
        shape = tuple(input_shapes.get(name) or shapes.get(name) or ())
        if not shape or not all(shape):
            raise ProfileError('input_shapes: give the shape of input %s (the graph does not '
                               'infer it)' % name)
        values = random.uniform(size=shape) if name in input_shapes else np.zeros(shape)
        inputs[name] = mx.nd.array(values, dtype='float32')
    return inputs


def _random_params(symbol, inputs, ctx):
    """Xavier-initialised FP32 parameters of `symbol` (fixed seed), by name."""
    mx.random.seed(_SEED)
    block = mx.gluon.SymbolBlock(symbol, [mx.sym.var(name) for name in inputs])
    block.initialize(mx.init.Xavier(), ctx=ctx)
    with autograd.pause():
        _sync(block(*inputs.values()))
    return {param.name: param.data(ctx).copy() for param in block.collect_params().values()}


def profile_checkpoint(symbol_file: str, params_file: Optional[str],
                       input_shapes: Mapping[str, Sequence[int]], *, dtype: DTypeLike = 'auto',
                       train: bool = False, iterations: int = 5, warmup: int = 2,
                       kernels: bool = True, exclude: Optional[Iterable[str]] = None,
                       fp32_ops: Optional[Iterable[str]] = None,
                       lp_ops: Optional[Iterable[str]] = None) -> ProfileReport:
    """`profile_symbol` on files: what ``mxamp profile SYMBOL.json`` runs.

    Parameters
    ----------
    symbol_file : str
        A ``*-symbol.json`` of an FP32 graph.
    params_file : str or None
        Its ``*.params`` (``arg:``/``aux:`` prefixes or plain names); None
        draws random parameters.
    input_shapes, dtype, train, iterations, warmup, kernels, exclude, fp32_ops, lp_ops
        As `profile_symbol`'s.

    Returns
    -------
    ProfileReport
        Print it, or write it with ``report.write_json(path)`` and
        ``report.plot(path)``.

    Raises
    ------
    ProfileError
        One line naming the file or option that is wrong.
    """
    try:
        with open(symbol_file) as handle:
            text = handle.read()
    except OSError as err:
        raise ProfileError('%s: %s' % (symbol_file, err.strerror))
    try:
        symbol = graph_mod.load_graph(text).symbol
    except graph_mod.GraphError as err:
        raise ProfileError('%s: %s' % (symbol_file, err))
    arg_params = aux_params = None
    if params_file is not None:
        try:
            arg_params, aux_params = load_params(params_file)
        except (OSError, ValueError, mx.base.MXNetError) as err:
            raise ProfileError('%s: %s' % (params_file, graph_mod.error_line(err)))
    return profile_symbol(symbol, arg_params, aux_params, input_shapes=input_shapes, dtype=dtype,
                          train=train, iterations=iterations, warmup=warmup, kernels=kernels,
                          exclude=exclude, fp32_ops=fp32_ops, lp_ops=lp_ops)
