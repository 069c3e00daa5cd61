"""The two sides a profile measures, and their step and operator times.

A side is the network in one precision: the graph it runs (its op nodes in
order, their shapes, and the layer each node is charged to), a Gluon
``SymbolBlock`` running that graph on copies of the parameters, and for
training its trainer.  This module times a side's normal steps (the step time)
and its profiled steps under MXNet's profiler, whose events it charges to graph
nodes by order (the operator time).  The profiler runs only inside
`_profile_operators` and is stopped after it.  Method: docs/performance.rst,
"How mxamp.profile measures".

MXNet internals relied on (MXNet 1.9.1)
---------------------------------------
The CachedOp flags ``forward_bulk_size`` / ``backward_bulk_size`` (passed
through ``hybridize``); the profiler's trace file (``'cat': 'operator'`` begin
and end events per engine thread, task events under their domain's name, and
``dump(finished=False)`` writing the events since the last dump without the
closing brackets); the names of backward operators (``_backward_<op>``,
``_backward_copy`` for reshaping operators); that the CPU engine runs
operators in push order (one worker thread, ``MXNET_CPU_WORKER_NTHREADS``
unset).
"""
import collections
import difflib
import json
import os
import statistics
import time
import warnings
from typing import Any, Dict, List, Mapping, NamedTuple, Sequence

import mxnet as mx
from mxnet import autograd

from . import dtypes
from .trainer import Trainer

__all__: List[str] = []

FORWARD, BACKWARD, UPDATE = 'forward', 'backward', 'update'

# How each side is hybridized: as scripts/benchmark.py does, for the step time.
_HYBRIDIZE = {'static_alloc': True, 'static_shape': True}
# ... and for the profiled steps: no engine bulking, so that each operator is an event.  A
# static-shape inference graph is bulked whatever the bulk sizes (MXNet 1.9.1's CachedOp
# makes one segment of it), so inference is profiled without static_shape.
_UNBULKED = {'static_alloc': True, 'forward_bulk_size': 0, 'backward_bulk_size': 0}
_PROFILER_DOMAIN = 'mxamp.profile'

# Engine operations that are MXNet's bookkeeping, not a layer's work.
_ENGINE_EVENTS = frozenset(('DeleteVariable', 'WaitForVar', 'SetValueOp',
                            'ResourceParallelRandomSetSeed'))
# Backward operators named otherwise than _backward_<forward op>.
_BACKWARD_NAMES = {'Flatten': 'copy', 'flatten': 'copy', 'Reshape': 'copy', 'reshape': 'copy',
                   'expand_dims': 'copy', 'squeeze': 'copy', 'Cast': 'cast'}


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



class _Side(object):
    """One precision of the network: its graph, a SymbolBlock running it with copies
    of the parameters, and, for training, its trainer."""

    def __init__(self, dtype: str, symbol: mx.sym.Symbol, params: Dict[str, mx.nd.NDArray],
                 conversion: Any, inputs: Dict[str, mx.nd.NDArray], ctx: mx.Context, train: bool,
                 optimizer: str, optimizer_params: Mapping[str, Any]) -> None:
        self.dtype = dtype
        self.symbol = symbol
        self.params = params
        self.conversion = conversion
        self.inputs = inputs
        self.train = train
        self.graph = _Graph(symbol, {name: value.shape for name, value in inputs.items()},
                            conversion)
        self.block = _symbol_block(symbol, list(inputs), params, ctx)
        self.trainer: Any = None
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


def _flat(output: Any) -> List[Any]:
    return list(output) if isinstance(output, (list, tuple)) else [output]


def _sync(output: Any) -> None:
    for array in _flat(output):
        array.wait_to_read()


def _symbol_block(symbol: mx.sym.Symbol, input_names: Sequence[str],
                  params: Mapping[str, mx.nd.NDArray], ctx: mx.Context) -> Any:
    """A SymbolBlock running `symbol` on `params` (name -> NDArray, any precision)."""
    with warnings.catch_warnings():
        # SymbolBlock asks the inputs' types before it has seen them; the first call gives them.
        warnings.filterwarnings('ignore', message='Cannot decide type for the following arguments')
        block = mx.gluon.SymbolBlock(symbol, [mx.sym.var(name) for name in input_names])
    block.collect_params().load_dict(params, ctx=ctx, allow_missing=False, ignore_extra=True,
                                     cast_dtype=True, dtype_source='saved')
    return block


def _time_steps(sides: Sequence[_Side], iterations: int, warmup: int) -> Dict[str, float]:
    """Median step ms per side, the sides interleaved (their order alternating per round)."""
    for side in sides:
        side.hybridize(_HYBRIDIZE)
        for _ in range(warmup):
            side.step()
    times: Dict[str, List[float]] = {side.dtype: [] for side in sides}
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


def _profile_operators(side: _Side, iterations: int, warmup: int, workdir: str,
                       label: str) -> _OperatorTimes:
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
    wall: Dict[str, float] = collections.defaultdict(float)
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

    Events and nodes are aligned by operator name in execution order (the
    graph's order forward, its reverse backward); an event left over goes to
    the nearest free node of its operator.  A charge is ``(node name,
    by_order)`` (`by_order`: a backward event of no forward node, such as a
    gradient sum, charged to the node whose backward follows it), or None:
    bookkeeping or unmatched.
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


