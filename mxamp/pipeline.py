"""The ordered list of passes a converted graph runs through, and the one place that runs it.

1. **precision** (`mxamp.graph.convert_graph`): each node's precision, the casts
   between them, BatchNorm kept unfolded where oneDNN would fold it wrongly,
   channels padded where a kernel needs it.  Both fronts; its record is the
   `mxamp.graph.Conversion`.
2. the kernel wing's passes (`mxamp.kernels.passes`, in its order): mxamp's own
   operators where the measured choice says they pay.  On the graph a Gluon
   block's CachedOp runs, per mode; the Symbol front writes portable files and
   `for_inference` fuses MXNet's operators, so neither runs them.

Without the wing the list ends after the precision pass, and mxamp still
converts and trains.
"""
import copy
from typing import FrozenSet, List, Optional, Sequence

from . import passes as passes_mod
from .graph import Conversion
from .passes import GraphPass, PassContext, PassRecord


def kernel_passes() -> List[GraphPass]:
    """The kernel wing's passes in order; empty without the wing.

    The core's one import of the wing's passes (the optimizer's fast step is
    the other door into it)."""
    try:
        from .kernels import passes as kernel_passes_mod
    except ImportError:
        return []
    return list(kernel_passes_mod.PASSES)


def low_precision_kernel_ops() -> FrozenSet[str]:
    """The operators the wing's passes put on kernels with fast bfloat16 loops in this
    process, which the precision pass may then compute in bfloat16 (`Policy`'s
    ``kernel_ops``)."""
    return frozenset().union(*(graph_pass.computes_low() for graph_pass in kernel_passes()))


def run(context: PassContext, passes: Optional[Sequence[GraphPass]] = None) -> Conversion:
    """`context.conversion` after `passes` (the wing's, by default) on its graph.

    Only the passes that apply to the context run, and record; the graph is parsed
    once and loaded once, and a pass list that changes nothing returns the
    conversion's own Symbol.
    """
    conversion = context.conversion
    todo = [graph_pass for graph_pass in (kernel_passes() if passes is None else passes)
            if graph_pass.applies(context)]
    if not todo:
        return conversion
    source = passes_mod.parse(conversion.symbol)
    graph = copy.deepcopy(source)
    context = context._replace(source=source)
    records: List[PassRecord] = []
    for graph_pass in todo:
        records.append(graph_pass.run(graph, context, tuple(records)))
    changed = any(record.nodes and not (record.training_only and not context.training)
                  for record in records)
    symbol = passes_mod.to_symbol(graph) if changed else conversion.symbol
    return conversion._replace(symbol=symbol, passes=conversion.passes + tuple(records))
