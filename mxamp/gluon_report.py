"""`summary`: which operators of a converted Gluon network run in which precision.

The static view of what the passes decided (`mxamp.pipeline`): one row per
operator of the graph the net last ran (or of a symbolic build of it), the
operator it runs on after the kernel wing's passes, its precision and the casts
on its inputs, then totals.  The measured view is `mxamp.profile`.
"""
import collections
from typing import Any, Callable, Counter, Dict, Optional, Tuple

import numpy as np

from mxnet.gluon import HybridBlock

from . import hardware
from .dtypes import name_of_array
from .gluon import conversion_of
from .network_state import Stage, converted_state, describe_block, state_of

__all__ = ['summary']


def _in_part_lines(net, state):
    """The head of the summary of a net converted in part: what stays FP32 and why."""
    lines = ['mxamp summary: %s converted to %s in part: it cannot become one graph, so its '
             'largest parts that can were converted (%s); the rest computes in float32:'
             % (describe_block(net), state.precision,
                ', '.join(path for path, _ in state.parts))]
    lines.extend('  %s (%s): %s' % (path or '(the net itself)', describe_block(block), why)
                 for path, block, why in state.float32_blocks)
    return '\n'.join(lines)


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
    lowered = frozenset().union(*(record.lowered for record in records))
    for node in conversion.nodes:
        if node.name in lowered:
            shown = conversion.dtype
        elif node.computes_in != node.precision:
            shown = 'float32 (%s storage)' % node.precision
        else:
            shown = node.computes_in
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
    small = conversion.small_layers
    if small:
        lines.append("kept in float32, %s would not pay for its casts on this CPU (dtype='auto'): "
                     '%d layers, the largest %.3g MFLOP a call%s'
                     % (settings.dtype, len(small), max(small.values()),
                        '' if conversion.computes_low else ': the whole net computes in float32'))
    regions = conversion.region_layers
    if regions:
        shown = sorted(regions, key=lambda name: regions[name], reverse=True)[:3]
        lines.append("in %s with the layers reading them, too small alone (dtype='auto'): %s%s"
                     % (settings.dtype, ', '.join(
                         '%s (%.3g MFLOP a call, %.3g together)'
                         % (name, conversion.works[name], regions[name]) for name in shown),
                        ' and %d more' % (len(regions) - len(shown)) if len(regions) > 3 else ''))
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
