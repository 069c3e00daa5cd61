"""Where mxamp's own operators run in a converted graph: decided by measurement, never by hope.

mxamp's own convolution (`mxamp.kernels.operators`) takes and returns MXNet's plain layouts, so
inside a network it pays for reorders MXNet's convolution does not, and a BatchNorm reading its
plain bfloat16 output runs a slower kernel: whether it wins depends on the CPU class, the OpenMP
thread count, the convolution, its batch and its reader (docs/own-convolution.rst, "Which
convolutions run on it").  A channels-last region (`mxamp.kernels.channels_last`) pays the layout
only at its borders; whether that wins was measured per CPU class on whole networks
("Channels-last regions in training").  This module owns both decisions, under the wing's one
switch ``MXAMP_KERNELS`` (`mxamp.kernels.operators.mode`):

* the **table** (:class:`ChoiceTable`), one store of measurements: per CPU class
  (`mxamp.hardware.cpu_class`), thread count and :class:`ConvCase`, MXNet's and the own
  operator's time for a chain around the convolution; per CPU class, whether its regions trained
  faster than MXNet's graph (:class:`RegionVerdict`); the shipped ``choice_table.json``, with
  ``MXAMP_KERNELS_TABLE=FILE``'s over it;
* the **rules**: regions of at least `MIN_REGION_CONVOLUTIONS` convolutions compute channels last
  on a class whose verdict says faster (:func:`choose_regions`); a convolution outside them runs
  on the own operator where the table measured that very case here at least 5% faster
  (`FASTER_BY`, :func:`choose_convolutions`).  ``MXAMP_KERNELS=all`` chooses every region where
  bfloat16 computes and every eligible convolution, ``0`` nothing;
* the **rewrite** (:func:`with_own_convolutions`), for graphs that stay inside mxamp (the Gluon
  front's training graphs): exported files, symbol files and inference graphs keep MXNet's;
* the **measurement** of convolutions (:func:`measure`, :func:`measure_symbol`, ``mxamp
  measure-conv``); regions are measured on whole networks, and their verdicts written by hand.

Eligible convolutions compute in bfloat16, have 1 to 3 spatial dimensions in MXNet's default
layout, and write their parameters' gradients (the own operator cannot honour ``grad_req='add'``).
"""
import datetime
import json
import os
import statistics
import time
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Mapping,
                    NamedTuple, Optional, Sequence, Set, Tuple)

import mxnet as mx

from .. import graph as graph_mod
from .. import hardware
from . import operators
from ..atomic_files import replaced_on_success
from ..passes import Graph, parse
from ..policy import CHANNELS_FIRST_LAYOUTS, Policy, int_tuple

if TYPE_CHECKING:
    from .channels_last import Region

__all__ = ['CONTEXTS', 'FASTER_BY', 'MIN_REGION_CONVOLUTIONS', 'TABLE_ENV', 'ConvCase', 'ConvSite',
           'Measurement', 'RegionVerdict', 'ChoiceTable', 'shipped_table_path', 'table',
           'running_threads', 'bfloat16_convolutions', 'conv_sites', 'may_choose_regions',
           'choose_regions', 'may_choose_convolutions', 'choose_convolutions',
           'with_own_convolutions', 'measure', 'measure_symbol', 'describe', 'describe_regions',
           'notes_for_table']

#: What reads a convolution's output, as the table tells cases apart: ``'batchnorm'``
#: (a BatchNorm, which runs a slower kernel on a plain bfloat16 array) or ``'other'``.
CONTEXTS = ('batchnorm', 'other')

#: The own operator is chosen where its measured time is at most this fraction of MXNet's.
FASTER_BY = 0.95

#: Fewest convolutions a channels-last region needs to pay for its borders (a ResNet bottleneck
#: has three).
MIN_REGION_CONVOLUTIONS = 3

#: Environment variable naming a table file of the user's own measurements.
TABLE_ENV = 'MXAMP_KERNELS_TABLE'

_TABLE_FORMAT = 1
_SHIPPED_NAME = 'choice_table.json'


class ConvCase(NamedTuple):
    """One convolution as the table knows it: what it computes and what reads its output."""

    data_shape: Tuple[int, ...]
    kernel: Tuple[int, ...]
    stride: Tuple[int, ...]
    dilate: Tuple[int, ...]
    pad: Tuple[int, ...]
    num_filter: int
    num_group: int
    no_bias: bool
    dtype: str
    context: str

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, str], data_shape: Sequence[int], dtype: str,
                   context: str) -> 'ConvCase':
        """The case of a ``Convolution`` node with JSON attributes `attrs`."""
        kernel = int_tuple(attrs['kernel'])
        spatial = len(kernel)

        def spatial_attr(key, default):
            return int_tuple(attrs.get(key)) or (default,) * spatial

        return cls(tuple(int(d) for d in data_shape), kernel, spatial_attr('stride', 1),
                   spatial_attr('dilate', 1), spatial_attr('pad', 0), int(attrs['num_filter']),
                   int(attrs.get('num_group', 1)), attrs.get('no_bias', 'False') in ('True', '1', 'true'),
                   dtype, context)

    @property
    def weight_shape(self) -> Tuple[int, ...]:
        return (self.num_filter, self.data_shape[1] // self.num_group) + self.kernel

    def attributes(self) -> Dict[str, Any]:
        """Keyword arguments of ``Convolution`` (and of `mxamp.kernels.operators.convolution`)."""
        return {'kernel': self.kernel, 'stride': self.stride, 'dilate': self.dilate,
                'pad': self.pad, 'num_filter': self.num_filter, 'num_group': self.num_group}

    def describe(self) -> str:
        """``'16x64x56x56 k3x3 s1 p1 ->64 (batchnorm)'``: one line of a table."""
        text = '%s k%s s%s p%s' % ('x'.join(map(str, self.data_shape)),
                                   'x'.join(map(str, self.kernel)),
                                   ','.join(map(str, self.stride)), ','.join(map(str, self.pad)))
        if any(d != 1 for d in self.dilate):
            text += ' d%s' % ','.join(map(str, self.dilate))
        if self.num_group != 1:
            text += ' g%d' % self.num_group
        return '%s ->%d%s (%s)' % (text, self.num_filter, '' if self.no_bias else '+b',
                                   self.context)


class ConvSite(NamedTuple):
    """An eligible convolution node of a graph: its name, case and parameter inputs."""

    name: str
    case: ConvCase
    params: Tuple[str, ...]


class Measurement(NamedTuple):
    """MXNet's and the own operator's time for one case on one CPU class and thread count.

    The times are medians, in milliseconds, of the forward and backward pass of
    the case's chain (:func:`measure`).
    """

    cpu_class: str
    threads: int
    case: ConvCase
    mxnet_ms: float
    own_ms: float

    @property
    def own_is_faster(self) -> bool:
        return self.own_ms <= FASTER_BY * self.mxnet_ms

    @property
    def key(self) -> Tuple[str, int, ConvCase]:
        return self.cpu_class, self.threads, self.case


class RegionVerdict(NamedTuple):
    """Whether channels-last regions trained faster than MXNet's graph on a CPU class.

    Measured on whole networks, so one verdict per class, at any thread count
    (docs/own-convolution.rst, "Channels-last regions in training").
    """

    cpu_class: str
    faster: bool


class ChoiceTable(object):
    """Measurements by (CPU class, thread count, case), region verdicts by CPU class; a later one
    replaces an earlier.

    Example
    -------
    >>> from mxamp.kernels.choice import ChoiceTable, ConvCase, Measurement, RegionVerdict
    >>> case = ConvCase((16, 64, 56, 56), (1, 1), (1, 1), (1, 1), (0, 0), 64, 1, True,
    ...                 'bfloat16', 'batchnorm')
    >>> table = ChoiceTable([Measurement('amx', 2, case, 24.9, 35.6)],
    ...                     regions=[RegionVerdict('amx', True)])
    >>> table.lookup('amx', 2, case).own_is_faster
    False
    >>> table.lookup('amx', 16, case) is None
    True
    >>> table.region_verdict('amx').faster, table.region_verdict('avx512_bf16')
    (True, None)
    """

    def __init__(self, measurements: Iterable[Measurement] = (),
                 notes: Optional[Mapping[str, str]] = None,
                 regions: Iterable[RegionVerdict] = ()) -> None:
        self._by_key: Dict[Tuple[str, int, ConvCase], Measurement] = {}
        self._regions: Dict[str, RegionVerdict] = {}
        #: Where each part was measured: ``{'amx, 2 threads': 'CPU model, date, versions'}``.
        self.notes: Dict[str, str] = dict(notes or {})
        self.update(measurements, regions=regions)

    def update(self, measurements: Iterable[Measurement],
               notes: Optional[Mapping[str, str]] = None,
               regions: Iterable[RegionVerdict] = ()) -> None:
        for measurement in measurements:
            self._by_key[measurement.key] = measurement
        for verdict in regions:
            self._regions[verdict.cpu_class] = verdict
        self.notes.update(notes or {})

    def merge(self, other: 'ChoiceTable') -> None:
        """`other`'s measurements, region verdicts and notes over this table's."""
        self.update(other, other.notes, other.region_verdicts())

    def lookup(self, cpu_class: str, threads: int, case: ConvCase) -> Optional[Measurement]:
        return self._by_key.get((cpu_class, threads, case))

    def region_verdict(self, cpu_class: str) -> Optional[RegionVerdict]:
        """The verdict on channels-last regions for `cpu_class`, None where never measured."""
        return self._regions.get(cpu_class)

    def region_verdicts(self) -> List[RegionVerdict]:
        return [self._regions[cpu_class] for cpu_class in sorted(self._regions)]

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Measurement]:
        return iter(self._by_key.values())

    @classmethod
    def read(cls, path: str) -> 'ChoiceTable':
        """The table in the JSON file `path`.

        Raises
        ------
        ValueError
            One line naming the file and what is wrong with it.
        OSError
            When it cannot be read.
        """
        with open(path) as handle:
            try:
                document = json.load(handle)
            except ValueError as error:
                raise ValueError('%s: not a JSON file (%s)' % (path, error)) from None
        if not isinstance(document, dict) or document.get('format') != _TABLE_FORMAT:
            raise ValueError('%s: not an mxamp own-convolution table (format %d)'
                             % (path, _TABLE_FORMAT))
        notes = document.get('notes', {})
        if not isinstance(notes, dict):
            raise ValueError('%s: its notes are not a JSON object' % path)
        regions = []
        for index, row in enumerate(document.get('regions', [])):
            try:
                if not isinstance(row['faster'], bool):
                    raise TypeError('faster is %r, not true or false' % (row['faster'],))
                regions.append(RegionVerdict(str(row['cpu_class']), row['faster']))
            except (KeyError, TypeError) as error:
                raise ValueError('%s: region verdict %d is malformed (%s: %s)'
                                 % (path, index, type(error).__name__, error)) from None
        measurements = []
        for index, row in enumerate(document.get('measurements', [])):
            try:
                case = row['case']
                measurements.append(Measurement(
                    str(row['cpu_class']), int(row['threads']),
                    ConvCase(tuple(case['data_shape']), tuple(case['kernel']),
                             tuple(case['stride']), tuple(case['dilate']), tuple(case['pad']),
                             int(case['num_filter']), int(case['num_group']),
                             bool(case['no_bias']), str(case['dtype']), str(case['context'])),
                    float(row['mxnet_ms']), float(row['own_ms'])))
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError('%s: measurement %d is malformed (%s: %s)'
                                 % (path, index, type(error).__name__, error)) from None
        return cls(measurements, {str(k): str(v) for k, v in notes.items()}, regions)

    def write(self, path: str) -> str:
        """Write the table to `path` (whole or not at all), one measurement or verdict per line."""
        rows = [json.dumps({'cpu_class': m.cpu_class, 'threads': m.threads,
                            'case': m.case._asdict(), 'mxnet_ms': round(m.mxnet_ms, 3),
                            'own_ms': round(m.own_ms, 3)})
                for m in sorted(self, key=lambda m: (m.cpu_class, m.threads, m.case))]
        verdicts = [json.dumps(verdict._asdict()) for verdict in self.region_verdicts()]
        text = ('{\n "format": %d,\n "notes": %s,\n "regions": [%s],\n "measurements": [%s]\n}\n'
                % (_TABLE_FORMAT,
                   json.dumps(self.notes, indent=2, sort_keys=True).replace('\n', '\n '),
                   _json_rows(verdicts), _json_rows(rows)))
        with replaced_on_success(path) as temporary:
            with open(temporary, 'w') as handle:
                handle.write(text)
        return path


def _json_rows(rows: Sequence[str]) -> str:
    return '\n  %s\n ' % ',\n  '.join(rows) if rows else ''


def shipped_table_path() -> str:
    """The table measured by mxamp's developers, installed with the package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), _SHIPPED_NAME)


_tables: Dict[Tuple[str, Optional[float]], ChoiceTable] = {}


def table() -> ChoiceTable:
    """The shipped table, with ``MXAMP_KERNELS_TABLE``'s measurements and verdicts over it.

    Read again when that variable or its file changes.

    Raises
    ------
    ValueError
        When the file ``MXAMP_KERNELS_TABLE`` names is missing or malformed:
        one line naming it.
    """
    user = os.environ.get(TABLE_ENV, '').strip()
    try:
        stamp = os.path.getmtime(user) if user else None
    except OSError:
        raise ValueError('%s=%s: no such file' % (TABLE_ENV, user)) from None
    key = (user, stamp)
    if key not in _tables:
        combined = ChoiceTable()
        if os.path.exists(shipped_table_path()):
            combined.merge(ChoiceTable.read(shipped_table_path()))
        if user:
            try:
                combined.merge(ChoiceTable.read(user))
            except (OSError, ValueError) as error:
                raise ValueError('%s=%s: %s' % (TABLE_ENV, user, error)) from None
        _tables.clear()
        _tables[key] = combined
    return _tables[key]


_threads: Optional[int] = None


def running_threads() -> int:
    """MXNet's OpenMP thread count in this process (fixed when libmxnet.so loaded)."""
    global _threads
    if _threads is None:
        counted = hardware.mxnet_openmp_threads()['openmp_threads']
        _threads = int(counted) if counted else 0
    return _threads


def bfloat16_convolutions(conversion: graph_mod.Conversion) -> List[str]:
    """The names of the ``Convolution`` nodes `conversion` computes in bfloat16."""
    return [record.name for record in conversion.nodes
            if record.op == 'Convolution' and record.computes_in == 'bfloat16']


def conv_sites(graph: Graph, shapes: Mapping[str, Sequence[int]],
               names: Iterable[str], dtype: str) -> List[ConvSite]:
    """The eligible ``Convolution`` nodes among `names` in `graph`, with their cases.

    Parameters
    ----------
    graph : dict
        A converted graph, parsed (`mxamp.passes.parse`).
    shapes : dict
        Known shapes of its variables, by name (a conversion's ``shapes`` and
        the inputs'): the data shapes of the convolutions are inferred from
        them; a convolution whose data shape does not infer is not eligible.
    names : iterable of str
        The convolution nodes computing in `dtype` (:func:`bfloat16_convolutions`).
    dtype : str
        Their data type.
    """
    nodes = graph['nodes']
    wanted = set(names)
    entry_shapes = graph_mod.infer_entry_shapes(graph, shapes)
    readers: Dict[int, Set[str]] = {}
    for node in nodes:
        for src, k, _ in node.get('inputs', []):
            if k == 0:
                readers.setdefault(src, set()).add(node['op'])
    sites = []
    for nid, node in enumerate(nodes):
        attrs = node.get('attrs', {})
        if node['op'] != 'Convolution' or node['name'] not in wanted or \
                str(attrs.get('layout', 'None')) not in CHANNELS_FIRST_LAYOUTS:
            continue
        src, k, _ = node['inputs'][0]
        data_shape = shapes.get(nodes[src]['name']) if nodes[src]['op'] == 'null' \
            else entry_shapes.get((src, k))
        if not data_shape or len(data_shape) != len(int_tuple(attrs['kernel'])) + 2:
            continue
        context = 'batchnorm' if 'BatchNorm' in readers.get(nid, ()) else 'other'
        params = tuple(nodes[p]['name'] for p, _, _ in node['inputs'][1:]
                       if nodes[p]['op'] == 'null')
        sites.append(ConvSite(node['name'], ConvCase.from_attrs(attrs, data_shape, dtype, context),
                              params))
    return sites


def _own_operators_compute_bfloat16() -> bool:
    """Whether oneDNN 3 has bfloat16 kernels on this CPU (``avx2`` and ``avx512_core`` have none).

    Asked of oneDNN (the real CPU, under ``DNNL_MAX_CPU_ISA``), not of `mxamp.hardware`, whose CPU
    class a test run may simulate."""
    isa = operators.status().cpu_isa or ''
    return 'bf16' in isa or 'amx' in isa


def _regions_measured_faster(cpu_class: str) -> bool:
    verdict = table().region_verdict(cpu_class)
    return verdict is not None and verdict.faster


def may_choose_regions(cpu_class: str) -> bool:
    """Whether :func:`choose_regions` can choose any region on this CPU class.

    Cheap next to finding regions (no graph is read): the switch, the table's
    verdict, and whether the own operators run with bfloat16 kernels.
    """
    current = operators.mode()
    return current != 'off' and (current == 'all' or _regions_measured_faster(cpu_class)) and \
        operators.available() and _own_operators_compute_bfloat16()


def choose_regions(regions: Iterable['Region'], cpu_class: str) -> List['Region']:
    """The regions (`mxamp.kernels.channels_last.find_regions`) that compute channels last on this
    CPU class (see the module's rules)."""
    if not may_choose_regions(cpu_class):
        return []
    return [region for region in regions if region.convolutions >= MIN_REGION_CONVOLUTIONS]


def may_choose_convolutions(cpu_class: str, threads: int) -> bool:
    """Whether :func:`choose_convolutions` can choose any on this class at this thread count.

    Cheap: no graph is read, the library is not loaded."""
    mode = operators.mode()
    if mode == 'off':
        return False
    return mode == 'all' or any(m.own_is_faster and m.cpu_class == cpu_class and
                                m.threads == threads for m in table())


def choose_convolutions(sites: Iterable[ConvSite], cpu_class: str, threads: int,
                        writes_gradient: Callable[[str], bool]) -> List[ConvSite]:
    """The sites that run on the own operator here (see the module's rules).

    `writes_gradient(param_name)`: False for a parameter whose gradient is
    added to (``grad_req='add'``), which the own operator cannot honour.
    Empty when the operator cannot run in this process.
    """
    mode = operators.mode()
    if mode == 'off' or not operators.available():
        return []
    chosen = []
    for site in sites:
        if not all(writes_gradient(p) for p in site.params):
            continue
        if mode == 'all':
            chosen.append(site)
            continue
        measured = table().lookup(cpu_class, threads, site.case)
        if measured is not None and measured.own_is_faster:
            chosen.append(site)
    return chosen


def with_own_convolutions(graph: Graph, names: Iterable[str]) -> None:
    """Put the ``Convolution`` nodes of `graph` named `names` on the own operator, same inputs and
    attributes (it ignores ``workspace`` and the cuDNN ones)."""
    names = set(names)
    if not names:
        return
    operators.require_loaded()
    for node in graph['nodes']:
        if node['name'] in names and node['op'] == 'Convolution':
            node['op'] = operators.OP_NAME


def _chain(case: ConvCase, own: bool) -> mx.sym.Symbol:
    """MXNet's 1x1 convolution, BatchNorm (in its context), ReLU; the convolution (MXNet's or
    own); BatchNorm, ReLU, MXNet's 1x1 convolution; a scalar loss.

    MXNet's neighbours, as in a network: the own operator's input is reordered from oneDNN
    2.4's layout, and its plain output reordered by the next convolution, not by the loss's cast.
    """
    x = mx.sym.amp_cast(mx.sym.var('data'), dtype=case.dtype)
    weight = mx.sym.amp_cast(mx.sym.var('weight'), dtype=case.dtype)
    bias = None if case.no_bias else mx.sym.amp_cast(mx.sym.var('bias'), dtype=case.dtype)
    channels = case.data_shape[1]
    x = mx.sym.Convolution(x, mx.sym.amp_cast(mx.sym.var('producer_weight'), dtype=case.dtype),
                           kernel=(1,) * len(case.kernel), num_filter=channels, no_bias=True,
                           name='producer')
    if case.context == 'batchnorm':
        x = mx.sym.BatchNorm(x, fix_gamma=False, name='producer_bn')
    x = mx.sym.Activation(x, act_type='relu')
    inputs = [x, weight] + ([] if bias is None else [bias])
    if own:
        y = operators.convolution(*inputs, **case.attributes(), name='conv')
    else:
        y = mx.sym.Convolution(*inputs, no_bias=case.no_bias, name='conv', **case.attributes())
    if case.context == 'batchnorm':
        y = mx.sym.BatchNorm(y, fix_gamma=False, name='consumer_bn')
    y = mx.sym.Activation(y, act_type='relu')
    y = mx.sym.Convolution(y, mx.sym.amp_cast(mx.sym.var('consumer_weight'), dtype=case.dtype),
                           kernel=(1,) * len(case.kernel), num_filter=case.num_filter,
                           no_bias=True, name='consumer')
    return mx.sym.MakeLoss(mx.sym.mean(mx.sym.amp_cast(y, dtype='float32')))


def _bind(case: ConvCase, own: bool) -> mx.executor.Executor:
    channels = case.data_shape[1]
    shapes = {'data': case.data_shape, 'weight': case.weight_shape,
              'producer_weight': (channels, channels) + (1,) * len(case.kernel),
              'consumer_weight': (case.num_filter, case.num_filter) + (1,) * len(case.kernel)}
    if not case.no_bias:
        shapes['bias'] = (case.num_filter,)
    # As in a Gluon training graph: no oneDNN subgraph backend, which MXNet reads at each bind.
    previous = os.environ.get('MXNET_SUBGRAPH_BACKEND')
    os.environ['MXNET_SUBGRAPH_BACKEND'] = 'NONE'
    try:
        executor = _chain(case, own).simple_bind(mx.cpu(), grad_req={'data': 'null'}, **shapes)
    finally:
        if previous is None:
            del os.environ['MXNET_SUBGRAPH_BACKEND']
        else:
            os.environ['MXNET_SUBGRAPH_BACKEND'] = previous
    for name, array in executor.arg_dict.items():
        if name in shapes:
            array[:] = mx.nd.random.uniform(-1, 1, shape=array.shape)
        elif name.endswith('gamma'):
            array[:] = 1
    return executor


def measure(cases: Sequence[ConvCase], *, repeats: int = 7, warmup: int = 2,
            progress: bool = True) -> List[Measurement]:
    """Measure each case on this machine, MXNet's convolution against the own one.

    The forward and backward pass of each case's chain as networks have it (:func:`_chain`),
    timed both ways alternating after `warmup` passes; the medians of `repeats` are kept.

    Raises
    ------
    mxamp.kernels.operators.OwnConvUnavailable
        When the own operator cannot run here.
    ValueError
        For an empty `cases` or fewer than 1 repeat.
    """
    if repeats < 1:
        raise ValueError('repeats=%d: expected 1 or more' % repeats)
    operators.require_loaded()
    cpu_class, threads = hardware.cpu_class(), running_threads()
    results = []
    for case in _progress(cases, progress, 'measuring convolutions'):
        executors = [_bind(case, own=False), _bind(case, own=True)]
        times: List[List[float]] = [[], []]
        for step in range(warmup + repeats):
            for side, executor in enumerate(executors):
                start = time.perf_counter()
                executor.forward(is_train=True)
                executor.backward()
                mx.nd.waitall()
                if step >= warmup:
                    times[side].append(1000.0 * (time.perf_counter() - start))
        results.append(Measurement(cpu_class, threads, case, statistics.median(times[0]),
                                   statistics.median(times[1])))
    return results


def _progress(items, enabled, description):
    if not enabled:
        return items
    from tqdm import tqdm
    return tqdm(items, desc=description, unit='case', leave=False)


def measure_symbol(symbol: mx.sym.Symbol, input_shapes: Mapping[str, Sequence[int]], *,
                   repeats: int = 7, progress: bool = True
                   ) -> Tuple[List[Measurement], Dict[ConvCase, List[str]]]:
    """Measure the bfloat16 convolutions of an FP32 graph as mxamp converts it here.

    The graph is converted under this machine's policy (as the Gluon front
    would); its distinct eligible cases are measured (:func:`measure`).

    Returns
    -------
    (list of Measurement, dict)
        The measurements, and per case the convolution nodes that have it.

    Raises
    ------
    ValueError
        When this CPU computes no bfloat16 convolution (nothing to measure), or
        the graph has no eligible one.
    """
    cpu_class = hardware.cpu_class()
    if cpu_class not in (hardware.AMX, hardware.AVX512_BF16):
        raise ValueError('this CPU (class %s) computes no bfloat16 convolution: mxamp runs them '
                         'in FP32 here, so there is nothing to measure' % cpu_class)
    policy = Policy('bfloat16', cpu_class=cpu_class)
    params = [name for name in symbol.list_inputs() if name not in input_shapes]
    conversion = graph_mod.convert_graph(symbol, policy, params=params, shapes=input_shapes,
                                         portable=False)
    sites = conv_sites(parse(conversion.symbol), dict(conversion.shapes, **input_shapes),
                       bfloat16_convolutions(conversion), 'bfloat16')
    if not sites:
        raise ValueError('the graph has no convolution mxamp computes in bfloat16 on this CPU '
                         '(class %s) with a known data shape' % cpu_class)
    by_case: Dict[ConvCase, List[str]] = {}
    for site in sites:
        by_case.setdefault(site.case, []).append(site.name)
    return measure(list(by_case), repeats=repeats, progress=progress), by_case


def describe() -> str:
    """One line for ``mxamp info``: which convolutions run on the own operator here.

    Example
    -------
    >>> print(mxamp.kernels.choice.describe())  # doctest: +ELLIPSIS
    own convolution choice: ...
    """
    try:
        mode = operators.mode()
        if mode == 'off':
            return "own convolution choice: none, MXNet's everywhere (%s=0)" % operators.ENV
        if mode == 'all':
            return ('own convolution choice: every eligible bfloat16 convolution (%s=all)'
                    % operators.ENV)
        cpu_class, threads = hardware.cpu_class(), running_threads()
        here = [m for m in table() if m.cpu_class == cpu_class and m.threads == threads]
    except ValueError as error:
        return 'own convolution choice: unknown, %s' % error
    return ("own convolution choice: %d of %d cases measured on this CPU class (%s) at %d OpenMP "
            "threads run on it, every other convolution on MXNet's (%s; mxamp measure-conv "
            "measures more)" % (sum(m.own_is_faster for m in here), len(here), cpu_class, threads,
                                _source()))


def _source() -> str:
    """Which tables the measured choice reads."""
    return 'shipped table' + (' and %s=%s' % (TABLE_ENV, os.environ[TABLE_ENV])
                              if os.environ.get(TABLE_ENV, '').strip() else '')


def describe_regions(cpu_class: Optional[str] = None) -> str:
    """One line for ``mxamp info``: whether training graphs get channels-last regions here.

    Example
    -------
    >>> print(mxamp.kernels.choice.describe_regions('avx2'))  # doctest: +ELLIPSIS
    channels-last regions in training: ...
    """
    if cpu_class is None:
        cpu_class = hardware.cpu_class()
    try:
        current = operators.mode()
        if current == 'off':
            return 'channels-last regions in training: off (%s=0)' % operators.ENV
        if not operators.available():
            return "channels-last regions in training: off (mxamp's own operators cannot run here)"
        if not _own_operators_compute_bfloat16():
            return ('channels-last regions in training: off (oneDNN 3 has no bfloat16 kernels '
                    'for %s)' % operators.status().cpu_isa)
        if current == 'all':
            return ('channels-last regions in training: on wherever bfloat16 computes (%s=all)'
                    % operators.ENV)
        verdict = table().region_verdict(cpu_class)
    except ValueError as error:
        return 'channels-last regions in training: unknown, %s' % error
    if verdict is None:
        return ('channels-last regions in training: off, not measured on this CPU class (%s; '
                '%s=all tries them)' % (cpu_class, operators.ENV))
    return 'channels-last regions in training: %s for this CPU class (%s), measured %s (%s)' % (
        'on' if verdict.faster else 'off', cpu_class, 'faster' if verdict.faster else 'slower',
        _source())


def notes_for_table(measurements: Sequence[Measurement]) -> Dict[str, str]:
    """The note a table keeps of where `measurements` (of one run) were taken."""
    if not measurements:
        return {}
    first = measurements[0]
    where = '%s, %d thread%s' % (first.cpu_class, first.threads, '' if first.threads == 1 else 's')
    return {where: '%s; measured %s; MXNet %s; %s' % (
        hardware.cpu_model(), datetime.date.today().isoformat(), mx.__version__,
        operators.describe())}
