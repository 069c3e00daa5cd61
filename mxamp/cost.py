"""Whether low precision pays for a layer on a CPU class: its work against its casts.

A GEMM layer (FullyConnected, Convolution, Deconvolution) computes faster in
bfloat16 than in FP32 only when it does enough work per call to pay for what
bfloat16 adds: oneDNN's reorders, and the casts into it where its data is FP32.
A small one is slower, and a network of small ones (a recurrent forecaster, a
small MLP) trains slower than in FP32.  `CostModel` holds, per operator, the
forward work (in MFLOP per call, 2 per multiply-add) from which bfloat16 pays
on one CPU class, for a layer that opens a bfloat16 region (its data cast
from FP32: "alone") and for one inside a region (its data already bfloat16),
read from ``cost_table.json`` (measured by ``scripts/measure_costs.py``; the
table's notes say where and when); `layer_work` computes a node's work from
its shapes.  Under ``'auto'`` the policy keeps a layer below its threshold in
FP32 (`mxamp.policy.Policy`'s ``costs``), and what reads it follows.

Example
-------
>>> model = CostModel({'FullyConnected': 10.0}, inside={'FullyConnected': 1.0})
>>> model.pays('FullyConnected', 4.0), model.pays('FullyConnected', 4.0, inside=True)
(False, True)
"""
import functools
import json
import os
from typing import Any, Mapping, Optional, Sequence, Tuple

from . import hardware

__all__ = ['GEMM_OPS', 'CostModel', 'largest_unpaid', 'layer_work', 'model_for']

#: Operators whose low-precision kernels are compute-bound: the ones whose work decides.
GEMM_OPS = frozenset(['FullyConnected', 'Convolution', 'Deconvolution'])

_TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'cost_table.json')

Shape = Tuple[int, ...]


class CostModel(object):
    """The work from which low precision pays, per operator, on one CPU class.

    Parameters
    ----------
    alone : mapping of str to float
        Operator to MFLOP per call, for a layer whose data is cast from FP32; an operator
        not named always pays.
    inside : mapping of str to float, optional
        The same for a layer whose data is already in low precision (default: `alone`).
    """

    def __init__(self, alone: Mapping[str, float],
                 inside: Optional[Mapping[str, float]] = None) -> None:
        self.alone = dict(alone)
        self.inside = dict(alone if inside is None else inside)

    def __repr__(self) -> str:
        return 'CostModel(%r, inside=%r)' % (self.alone, self.inside)

    def pays(self, op: str, work: Optional[float], inside: bool = False) -> bool:
        """Whether `op` doing `work` MFLOP a call computes faster in low precision, its data
        cast from FP32 or, `inside` a low-precision region, not; an unknown work (shapes not
        known) pays, as without a model."""
        threshold = self.threshold(op, inside)
        return threshold is None or work is None or work >= threshold

    def threshold(self, op: str, inside: bool = False) -> Optional[float]:
        """The MFLOP a call from which `op` pays; None when it always does."""
        return (self.inside if inside else self.alone).get(op)


@functools.lru_cache(maxsize=None)
def _table():
    with open(_TABLE) as f:
        return json.load(f)


def model_for(cpu_class: str) -> Optional[CostModel]:
    """The cost model of `cpu_class` (`mxamp.hardware.CPU_CLASSES`); None for a class that
    computes no bfloat16 or that the table does not hold."""
    if not hardware.computes_bfloat16(cpu_class):
        return None
    entry = _table()['classes'].get(cpu_class)
    if entry is None:
        return None
    return CostModel({op: float(values['alone_from_mflop']) for op, values in entry.items()},
                     inside={op: float(values['inside_from_mflop']) for op, values in entry.items()})


def largest_unpaid(layers: Mapping[str, Tuple[str, float]], model: CostModel
                   ) -> Optional[Tuple[str, str, float, float]]:
    """``(name, op, work, threshold)`` of the largest of `layers` (``{name: (op, MFLOP)}``)
    when none of them pays under `model` with its data cast from FP32, as in a network
    that computes in FP32; None when one pays or there are none."""
    if not layers or any(model.pays(op, work) for op, work in layers.values()):
        return None
    name, (op, work) = max(layers.items(), key=lambda item: item[1][1])
    return name, op, work, model.threshold(op)


def layer_work(op: str, attrs: Mapping[str, Any], input_shapes: Sequence[Optional[Shape]],
               output_shape: Optional[Shape]) -> Optional[float]:
    """Forward MFLOP of one call of a `GEMM_OPS` node (2 per multiply-add); None when a
    shape it needs is unknown or `op` is not a GEMM.

    Examples
    --------
    >>> round(layer_work('FullyConnected', {'num_hidden': '160'}, [(32, 80), (160, 80)], (32, 160)), 4)
    0.8192
    """
    if op not in GEMM_OPS or not input_shapes:
        return None
    weight = input_shapes[1] if len(input_shapes) > 1 else None
    if op == 'FullyConnected':
        if output_shape is None or weight is None or len(weight) != 2:
            return None
        return 2e-6 * _product(output_shape) * weight[1]
    data = input_shapes[0]
    if weight is None or len(weight) < 3:
        return None
    # weight: (out, in / groups, *kernel) for a Convolution, (in, out / groups, *kernel) for a
    # Deconvolution: each output (input) element takes weight[1] * kernel multiply-adds.
    per_element = weight[1] * _product(weight[2:])
    if op == 'Convolution':
        return None if output_shape is None else 2e-6 * _product(output_shape) * per_element
    return None if data is None else 2e-6 * _product(data) * per_element


def _product(shape):
    total = 1
    for dim in shape:
        total *= int(dim)
    return total
