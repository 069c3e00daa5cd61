"""The report `mxamp.profile` returns, made from what it measured.

This module owns `ProfileReport` (its table, JSON and plot) and its making:
one row per layer (the user's layer and parameter names, the kernel behind
it, its time per side), the totals (the low-precision step against FP32, the
shares of compute-bound operators, memory-bound operators, casts and
reorders, and kernels that are not the fastest this CPU has), the step and
layer records `mxamp.verdict_rules` turns into verdicts, and the notes on
what was not measured.  It measures nothing; matplotlib is imported only
inside `ProfileReport.plot`.
"""
import collections
import json
import math
import os
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import mxnet as mx

from . import hardware, verdict_rules
from .profile_timing import BACKWARD, FORWARD

__all__ = ['ProfileReport']

SCHEMA_VERSION = 1

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


def _op_class(op):
    for name, ops in _OP_CLASSES:
        if op in ops:
            return name
    return _OTHER


class ProfileReport(object):
    """What `mxamp.profile` measured: rows per layer, totals, verdicts.

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


class _Network(NamedTuple):
    """What is measured: a name, per-node layer names, the sides' inputs."""
    name: str
    layer_names: Dict[str, Tuple[str, Optional[str]]]     # node -> (layer, block path)
    inputs: Dict[str, mx.nd.NDArray]
    dtype_requested: Optional[str]
    auto_reason: str


class _Measured(NamedTuple):
    """What the three measurements of a profile found, by a side's dtype."""
    step_ms: Dict[str, float]
    operator_times: Dict[str, Any]
    kernels: Dict[str, Any]
    kernels_measured: bool
    kernel_pass_s: Optional[float]
    kernel_error: Optional[str]


def _report(network: _Network, sides: Sequence[Any], train: bool, iterations: int, warmup: int,
            measured: _Measured, began: float) -> ProfileReport:
    """The report of `sides` (FP32 first, the low precision last, if any); `began`: when the
    profile began (``time.perf_counter()``)."""
    fp32, primary = sides[0], sides[-1]
    low = primary if len(sides) > 1 else None
    step_ms, operator_times = measured.step_ms, measured.operator_times
    attributed = measured.kernels
    rows = _rows(network, sides, operator_times, attributed)
    totals = _totals(sides, primary, step_ms, operator_times, attributed, rows)
    step = _step_record(network, fp32, low, train, step_ms, totals, rows)
    layers = [_layer_record(row, primary, sides) for row in rows]
    verdicts = verdict_rules.evaluate(step, layers)
    threads = hardware.mxnet_openmp_threads()['openmp_threads']
    data: Dict[str, Any] = {
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
            'kernel_pass_s': measured.kernel_pass_s, 'report_s': time.perf_counter() - began},
        'notes': [],
    }
    data['notes'] = _notes(data, measured.kernels_measured, measured.kernel_error, attributed)
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


