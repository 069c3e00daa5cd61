"""The oneDNN kernel behind each node of a side: the kernel pass of a profile.

oneDNN 2.4 reads ``DNNL_VERBOSE`` once, at start-up, and prints to the
process's stdout, so the kernels are read in a child process (this
interpreter, ``DNNL_VERBOSE=1``, the same OpenMP threads and CPU limits) that
loads each side's graph from temporary files and runs one warm-up and one
marked step of it.  This module owns that child, the parsed verbose line
(`KernelLine`, `parse_verbose_line`) and the charge of each line to a graph
node by primitive, shapes and order; lines that fit no node stay
unattributed.  Method: docs/performance.rst, "How mxamp.profile measures".

MXNet internals relied on (MXNet 1.9.1)
---------------------------------------
oneDNN 2.4's verbose format (``dnnl_verbose,exec,cpu,<primitive>,
<implementation>,<propagation>,<memory descriptors>,<attributes>,<auxiliary>,
<problem>,<ms>``).
"""
import collections
import ctypes
import json
import os
import re
import subprocess
import sys
import time
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import numpy as np

import mxnet as mx
from mxnet import autograd

from . import hardware, pipeline
from .profile_timing import (BACKWARD, FORWARD, _HYBRIDIZE, _flat, _Graph, _Side, _symbol_block,
                             _sync)

__all__ = ['KernelLine', 'parse_verbose_line']

_KERNEL_MARKER = 'MXAMP_PROFILE_KERNELS'
_VERBOSE_PREFIX = 'dnnl_verbose,exec,'

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
        """The instruction set, in the report's words: ``'AMX'``, ``'AVX512-BF16'``,
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



def _kernel_pass(sides: Sequence[_Side], workdir: str, train: bool, timeout: int
                 ) -> Tuple[Dict[str, Dict[str, List[KernelLine]]], float, Optional[str]]:
    """Run each side once more in a child process with ``DNNL_VERBOSE=1``.

    Returns
    -------
    tuple
        ``({dtype: {phase: [KernelLine]}}, wall seconds, error line or None)``.
    """
    spec: Dict[str, Any] = {'train': train, 'sides': []}
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
    command = [sys.executable, '-c', 'import sys, mxamp.profile_kernels as k; '
               'sys.exit(k._kernel_child_main(sys.argv[1]))', spec_path]
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
    # library registers them before the graph loads (the parent's MXAMP_KERNELS holds here too).
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


def _attribute_kernels(graph: _Graph, phases: Mapping[str, Sequence[KernelLine]],
                       window: int = 40) -> _Kernels:
    """Charge kernel lines (``{phase: [KernelLine]}``) to executed nodes; `_Kernels`.

    A line goes to the first node at or after the previous match that `_fits`
    it, else to the nearest behind it (within `window` nodes either way); a
    layout-only reorder goes where `_reorder_owner` says.
    """
    kernels = _Kernels()
    for phase, lines in phases.items():
        order = graph.ops if phase == FORWARD else graph.ops[::-1]
        pointer = 0
        seen: Set[Tuple[int, str]] = set()          # (node position, prop) already charged
        assigned: List[Optional[int]] = [None] * len(lines)
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
    """The node position a layout-only reorder is charged to: the node between its
    neighbours' nodes that reads a tensor of its shape, else the next kernel's node if it
    reads one, else the previous kernel's."""
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


