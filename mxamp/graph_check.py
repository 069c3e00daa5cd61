"""Checking a converted graph: the invariants of the rewrite, and its record against its graph.

`check_graph` plans each node of a converted graph again (`mxamp.graph.plan_node`) from the
types MXNet infers for it and lists where the graph differs from the plans; given a
`mxamp.graph.Conversion`, also where its record does not describe its graph.  The tests and
the corpus runs call it; conversion itself does not.
"""
from typing import List, Mapping, Optional, Sequence, Union

from . import policy as policy_mod
from .dtypes import ROUNDING_SUFFIX, DTypeLike
from .graph import (Conversion, GraphLike, _output_counts, cast_input, convolution_post_ops,
                    find_casts, infer_entry_shapes, infer_entry_types, infer_variable_shapes,
                    load_graph, plan_node)

__all__ = ['check_graph']


def check_graph(converted: Union[Conversion, GraphLike], policy: policy_mod.Policy,
                input_types: Optional[Mapping[str, DTypeLike]] = None,
                shapes: Optional[Mapping[str, Sequence[int]]] = None) -> List[str]:
    """Invariant violations of a converted graph, as a list of strings (empty: all hold).

    Types come from MXNet's own inference with every non-declared input in FP32.
    Every op node receives each floating input in the dtype `plan_node` asks
    for, given the types the node receives: no FP32 op receives a low-precision
    input, a low-precision op receives low-precision data (FP32 for BatchNorm
    statistics and for ops computing in FP32 between casts), an op whose
    floating inputs must agree receives one dtype.  No Cast converts a tensor
    to the dtype it has, no Cast feeds another Cast, no tensor is cast twice to
    the same dtype, every output is FP32 when the FP32 graph's was.  `shapes`
    (as given to `convert_graph`) tell which convolutions run in FP32.

    Parameters
    ----------
    converted : Conversion, mx.sym.Symbol, str or dict
        A `Conversion`: its record says which nodes are mxamp's casts, and is
        checked against its graph too (see `_record_problems`).  A graph alone
        (e.g. loaded from a file): its casts are found by name (`find_casts`).
    policy : mxamp.policy.Policy
    input_types, shapes : dict, optional
        As given to `convert_graph`.
    """
    record = converted if isinstance(converted, Conversion) else None
    graph = load_graph(record.symbol if record else converted)
    nodes = graph['nodes']
    types = infer_entry_types(graph, input_types)
    counts = _output_counts(graph)
    variable_shapes = infer_variable_shapes(graph, shapes)
    entry_shapes = infer_entry_shapes(graph, shapes)
    low = policy.dtype
    cast_names = {cast.name for cast in (record.cast_nodes if record else find_casts(graph, types))}
    problems = _record_problems(record, graph, types, low) if record else []
    post_ops = convolution_post_ops(graph) if policy.inference else frozenset()
    seen_casts = set()
    for nid, node in enumerate(nodes):
        if node['op'] == 'null':
            continue
        op, name = node['op'], node['name']
        if ROUNDING_SUFFIX in name:
            continue    # a step of a cast's rounded narrowing: checked as that cast
        states = [_state(types.get((src, k)), low) for src, k, _ in node['inputs']]
        if name in cast_names:
            src = cast_input(nodes, node)
            states[0] = _state(types.get(src), low)
            target = node['attrs']['dtype']
            if states[0] == target:
                problems.append("cast '%s' converts a %s tensor to %s" % (name, target, target))
            if nodes[src[0]]['name'] in cast_names:
                problems.append("cast '%s' feeds cast '%s' (cast chain)" % (nodes[src[0]]['name'], name))
            if (src, target) in seen_casts:
                problems.append("tensor %s is cast to %s twice" % (nodes[src[0]]['name'], target))
            seen_casts.add((src, target))
            continue
        # A cast of a low-precision weight reads as that weight's shape.
        input_shapes = [variable_shapes.get(_through_casts(nodes, src, cast_names))
                        or entry_shapes.get((src, k)) for src, k, _ in node['inputs']]
        plan = plan_node(node, policy, states, input_shapes,
                         [_state(types.get((nid, k)), low) is not None for k in range(counts[nid])],
                         post_op=nid in post_ops)
        bad = [pos for pos, (state, dtype) in enumerate(zip(states, plan.inputs))
               if dtype not in (None, state)]
        if bad:
            runs_in = 'float32 between %s casts' % low if plan.compute_fp32 else plan.precision
            received = ', '.join('%s at input %s' % (got, [pos for pos in bad if states[pos] == got])
                                 for got in sorted({states[pos] for pos in bad}))
            problems.append("'%s' (%s) runs in %s but receives %s" % (name, op, runs_in, received))
    for nid, k, _ in graph['heads']:
        if types.get((nid, k)) == low:
            problems.append("output '%s' is %s, not float32" % (nodes[nid]['name'], low))
    return problems


def _record_problems(record, graph, types, low):
    """Where the record of a `Conversion` does not describe its graph `graph`.

    Every recorded cast is a cast node reading the recorded output and giving
    the recorded dtypes; every recorded node runs the recorded operator, reads
    each input through the recorded cast and padding, and writes the dtypes its
    plan gives; every graph output reads its recorded cast; and the graph has no
    op node the record does not name.
    """
    nodes = graph['nodes']
    index = {node['name']: nid for nid, node in enumerate(nodes)}
    problems = []
    named = set()
    for cast in record.cast_nodes:
        node = nodes[index[cast.name]] if cast.name in index else None
        named.add(cast.name)
        if node is None or policy_mod.canonical(node['op']) not in policy_mod.CAST_OPS:
            problems.append("recorded cast '%s' is not a cast node of the graph" % cast.name)
            continue
        src, k = cast_input(nodes, node)
        named.update(nodes[step]['name'] for step in _rounding_steps(nodes, node))
        found = (nodes[src]['name'], k, _state(types.get((src, k)), low), node['attrs'].get('dtype'))
        if found != (cast.source, cast.output, cast.from_dtype, cast.to_dtype):
            problems.append("cast '%s' is recorded as %s[%d] %s->%s but casts %s[%d] %s->%s"
                            % ((cast.name, cast.source, cast.output, cast.from_dtype, cast.to_dtype)
                               + found))
    for record_node in record.nodes:
        name = record_node.name
        nid = index.get(name)
        named.add(name)
        if nid is None or nodes[nid]['op'] != record_node.op:
            problems.append("recorded node '%s' (%s) is not in the graph" % (name, record_node.op))
            continue
        for pos, (entry, read) in enumerate(zip(nodes[nid]['inputs'], record_node.inputs)):
            named.update(read.pad)
            if read.no_fold:
                named.add(read.no_fold)
            expected = (read.no_fold or (read.pad[-1] if read.pad else None)
                        or (read.cast.name if read.cast else read.source))
            if nodes[entry[0]]['name'] != expected:
                problems.append("'%s' input %d is recorded as reading '%s' but reads '%s'"
                                % (name, pos, expected, nodes[entry[0]]['name']))
        for k, state in enumerate(record_node.plan.outputs):
            written = 'float32' if state is not None and record_node.plan.compute_fp32 else state
            if state is not None and types.get((nid, k)) is not None and \
                    _state(types[(nid, k)], low) != written:
                problems.append("'%s' output %d is recorded as %s but is %s"
                                % (name, k, written, types[(nid, k)]))
    for (nid, _, _), cast in zip(graph['heads'], record.output_casts):
        if cast is not None and nodes[nid]['name'] != cast.name:
            problems.append("output '%s' is recorded as cast by '%s'" % (nodes[nid]['name'], cast.name))
    problems.extend("'%s' (%s) is not in the conversion's record" % (node['name'], node['op'])
                    for node in nodes if node['op'] != 'null' and node['name'] not in named)
    return problems


def _state(dtype, low):
    """The precision state of a tensor of type `dtype` in a graph converted to `low`."""
    return dtype if dtype in ('float32', low) else None


def _rounding_steps(nodes, cast):
    """The indices of the helper nodes of `cast`'s rounded narrowing (none for a plain cast)."""
    steps, pending = [], [src for src, _, _ in cast['inputs']]
    while pending:
        nid = pending.pop()
        if ROUNDING_SUFFIX in nodes[nid]['name'] and nid not in steps:
            steps.append(nid)
            pending.extend(src for src, _, _ in nodes[nid]['inputs'])
    return steps


def _through_casts(nodes, nid, cast_names):
    while nodes[nid]['name'] in cast_names:
        nid = cast_input(nodes, nodes[nid])[0]
    return nid
