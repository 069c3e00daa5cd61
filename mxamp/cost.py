"""Whether low precision pays for a layer on a CPU class: its work against its casts.

A GEMM layer (FullyConnected, Convolution, Deconvolution) whose data is FP32
computes faster in bfloat16 only when it does enough work per call to pay for
the casts into and out of it and oneDNN's reorders; a small one is slower, and
a network of small ones (a recurrent forecaster, a small MLP) trains slower
than in FP32.  `CostModel` holds, per operator, the forward work (in MFLOP
per call, 2 per multiply-add) from which bfloat16 pays so on one CPU class,
for training or for inference (without a backward pass and FP32 master
weights, smaller layers pay), read from ``cost_table.json`` (measured by
``scripts/measure_costs.py``; the table's notes say where and when);
`layer_work` computes a node's work from its shapes.  Under ``'auto'`` the
policy keeps such a layer below its threshold in FP32 (`mxamp.policy.Policy`'s
``costs``), and what reads it follows.  A layer whose data is already bfloat16
stays so: keeping it in FP32 would add the casts.  For inference a layer below
its threshold still pays when it opens a region whose layers do enough work
together (the layer and the ones that read its output in low precision, and
so on to the region's FP32 edges: `mxamp.graph.region_works`): the casts are
paid once for them all.  A layer counts towards its region only where it
gains inside one (no casts around it) at its size; a convolution normalized by
a BatchNorm gains from smaller sizes than a bare one, since bfloat16 also
halves the bytes of the memory-bound layers between the convolutions.

Example
-------
>>> model = CostModel({'FullyConnected': 10.0}, region_pays_from={'FullyConnected': 5.0})
>>> model.pays('FullyConnected', 0.4), model.pays('FullyConnected', 64.0)
(False, True)
>>> model.pays('FullyConnected', 2.0, region_work=6.0)    # with a 4 MFLOP layer after it
True
>>> model = CostModel({'Convolution': 100.0}, region_pays_from={'Convolution': 200.0},
...                   inside_pays_from={'Convolution': 100.0},
...                   normalized_inside_pays_from={'Convolution': 25.0})
>>> model.counts_in_region('Convolution', 30.0), model.counts_in_region(
...     'Convolution', 30.0, normalized=True)
(False, True)
"""
import functools
import json
import math
import os
from typing import Mapping, Optional, Sequence, Tuple

from . import hardware

__all__ = ['GEMM_OPS', 'CostModel', 'largest_unpaid', 'layer_work', 'model_for']

#: Operators whose low-precision kernels are compute-bound: the ones whose work decides.
GEMM_OPS = frozenset(['FullyConnected', 'Convolution', 'Deconvolution'])

_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'cost_table.json')

Shape = Tuple[int, ...]


class CostModel(object):
    """The work from which low precision pays for a layer whose data is FP32, per operator,
    on one CPU class.

    Parameters
    ----------
    pays_from : mapping of str to float
        Operator to MFLOP per call; an operator not named always pays.
    per_cast_value : mapping of str to float, optional
        Operator to the FLOP a call must do per value cast besides its data (its output to
        FP32 readers, an FP32 weight) for low precision to pay.
    region_pays_from : mapping of str to float, optional
        Operator to the MFLOP a call of a layer below its `pays_from` and the layers reading
        its output must do together for low precision to pay; an operator not named pays
        only alone.
    inside_pays_from : mapping of str to float, optional
        Operator to the MFLOP a call from which a layer inside a region (its neighbours in
        low precision, no casts) computes faster so: only such layers count towards a
        region's work.  An operator not named counts at any size.
    normalized_inside_pays_from : mapping of str to float, optional
        The same for a layer whose output a BatchNorm normalizes; an operator not named
        takes its `inside_pays_from`.
    """

    def __init__(self, pays_from: Mapping[str, float],
                 per_cast_value: Optional[Mapping[str, float]] = None,
                 region_pays_from: Optional[Mapping[str, float]] = None,
                 inside_pays_from: Optional[Mapping[str, float]] = None,
                 normalized_inside_pays_from: Optional[Mapping[str, float]] = None) -> None:
        self.pays_from = dict(pays_from)
        self.per_cast_value = dict(per_cast_value or {})
        self.region_pays_from = dict(region_pays_from or {})
        self.inside_pays_from = dict(inside_pays_from or {})
        self.normalized_inside_pays_from = dict(normalized_inside_pays_from or {})

    def __repr__(self) -> str:
        return ('CostModel(%r, per_cast_value=%r, region_pays_from=%r, inside_pays_from=%r, '
                'normalized_inside_pays_from=%r)' % (
                    self.pays_from, self.per_cast_value, self.region_pays_from,
                    self.inside_pays_from, self.normalized_inside_pays_from))

    def pays(self, op: str, work: Optional[float], cast_values: int = 0,
             region_work: Optional[float] = None) -> bool:
        """Whether `op` doing `work` MFLOP a call and casting `cast_values` values besides
        its data computes faster in low precision; an unknown work (shapes not known) pays,
        as without a model.  `region_work` is the work of the region it would open, its own
        included (`mxamp.graph.region_works`; None: it opens none)."""
        if work is None:
            return True
        threshold = self.pays_from.get(op)
        if threshold is not None and work < threshold:
            region_threshold = self.region_pays_from.get(op)
            if region_threshold is None or region_work is None or region_work < region_threshold:
                return False
        per_value = self.per_cast_value.get(op)
        return per_value is None or not cast_values or 1e6 * work / cast_values >= per_value

    def counts_in_region(self, op: str, work: float, normalized: bool = False) -> bool:
        """Whether `op` doing `work` MFLOP a call inside a region computes faster in low
        precision, its work counting towards the region's; `normalized`: a BatchNorm reads
        its output."""
        threshold = self.normalized_inside_pays_from.get(op) if normalized else None
        if threshold is None:
            threshold = self.inside_pays_from.get(op)
        return threshold is None or work >= threshold


@functools.lru_cache(maxsize=None)
def _table():
    with open(_TABLE) as f:
        return json.load(f)


def model_for(cpu_class: str, inference: bool = False) -> Optional[CostModel]:
    """The cost model of `cpu_class` (`mxamp.hardware.CPU_CLASSES`) for training, or with
    `inference` for a graph built for inference alone; None for a class that computes no
    bfloat16 or that the table does not hold."""
    if not hardware.computes_bfloat16(cpu_class):
        return None
    entry = _table()['classes'].get(cpu_class, {}).get('inference' if inference else 'training')
    if entry is None:
        return None

    def optional(field):
        return {op: float(values[field]) for op, values in entry.items()
                if values.get(field) is not None}

    return CostModel({op: float(values['pays_from_mflop']) for op, values in entry.items()},
                     {op: float(values['pays_from_flop_per_cast_value'])
                      for op, values in entry.items()},
                     optional('region_pays_from_mflop'), optional('inside_pays_from_mflop'),
                     optional('normalized_inside_pays_from_mflop'))


def largest_unpaid(layers: Mapping[str, Tuple[str, float]], model: CostModel
                   ) -> Optional[Tuple[str, str, float, float]]:
    """``(name, op, work, threshold)`` of the largest of `layers` (``{name: (op, MFLOP)}``)
    when none of them pays alone under `model`; None when one pays or there are none."""
    if not layers or any(model.pays(op, work) for op, work in layers.values()):
        return None
    name, (op, work) = max(layers.items(), key=lambda item: item[1][1])
    return name, op, work, model.pays_from[op]


def layer_work(op: str, input_shapes: Sequence[Optional[Shape]],
               output_shape: Optional[Shape]) -> Optional[float]:
    """Forward MFLOP of one call of a `GEMM_OPS` node (2 per multiply-add); None when a
    shape it needs is unknown or `op` is not a GEMM.

    Examples
    --------
    >>> round(layer_work('FullyConnected', [(32, 80), (160, 80)], (32, 160)), 4)
    0.8192
    """
    if op not in GEMM_OPS or not input_shapes:
        return None
    weight = input_shapes[1] if len(input_shapes) > 1 else None
    if op == 'FullyConnected':
        if output_shape is None or weight is None or len(weight) != 2:
            return None
        return 2e-6 * math.prod(output_shape) * weight[1]
    data = input_shapes[0]
    if weight is None or len(weight) < 3:
        return None
    # weight: (out, in / groups, *kernel) for a Convolution, (in, out / groups, *kernel) for a
    # Deconvolution: each output (input) element takes weight[1] * kernel multiply-adds.
    per_element = weight[1] * math.prod(weight[2:])
    if op == 'Convolution':
        return None if output_shape is None else 2e-6 * math.prod(output_shape) * per_element
    return None if data is None else 2e-6 * math.prod(data) * per_element

