"""The rules behind the verdicts of `mxamp.profile`'s reports, as data.

This module owns `RULES`, the one table every verdict of a profile report
comes from (a `Rule` per row), the thresholds the rules use, and `evaluate`,
which applies the table to measured records.  Records are plain dicts, so
each rule can be checked on a record written by hand (a CPU class this
machine is not) as well as on a measured one; `STEP_FIELDS` and
`LAYER_FIELDS` say what each field holds.  `mxamp.profile_report` builds the
records; this module imports nothing from mxamp.

Example
-------
>>> step = dict(EXAMPLE_STEP, dtype_requested='auto', dtype='float32')
>>> [verdict.kind for verdict in evaluate(step, [])]
['auto_kept_float32']
"""
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

__all__ = ['AMX_MIN_BATCH', 'AMX_PRIMITIVES', 'BFLOAT16_BATCHNORM_MULTIPLE', 'CAST_SHARE', 'DERIVED_FIELDS',
           'EXAMPLE_LAYER', 'EXAMPLE_STEP', 'LAYER_FIELDS', 'OVERHEAD_SHARE', 'RULES', 'Rule',
           'SLOWER_THAN_FLOAT32', 'STEP_FIELDS', 'TENSOR_CORE_MULTIPLE', 'Verdict', 'evaluate',
           'tensor_core_misfits']

STEP, LAYER = 'step', 'layer'

#: Casts and reorders worth a verdict: this share of the step or more.
CAST_SHARE = 0.05
#: Time between operators (engine, Python) worth a verdict: this share of the step or more.
OVERHEAD_SHARE = 0.2
#: A low-precision step slower than FP32: below this many times FP32's speed (noise allowed for).
SLOWER_THAN_FLOAT32 = 0.95
#: Below this batch, AMX's tile set-up does not pay (``scripts/benchmark.py --batch`` shows it).
AMX_MIN_BATCH = 16
#: The oneDNN primitives AMX runs (its tiles multiply matrices); the others have no AMX kernel.
AMX_PRIMITIVES = ('convolution', 'deconvolution', 'inner_product', 'matmul')
#: oneDNN 2.4's fast (channels-last, JIT) bfloat16 BatchNorm needs channels in multiples of this.
BFLOAT16_BATCHNORM_MULTIPLE = 16
#: NVIDIA Tensor Cores run float16 GEMMs whose dimensions are multiples of this.
TENSOR_CORE_MULTIPLE = 8

#: The step record: one per report.
STEP_FIELDS = {
    'dtype_requested': "the dtype asked for ('auto', a precision name, or None: the net's own)",
    'dtype': "the precision measured against FP32 ('float32' when none)",
    'auto_reason': "why dtype='auto' means `dtype` on this machine",
    'device': "'cpu'",
    'cpu_class': "mxamp.hardware.cpu_class(): 'avx2', 'avx512', 'avx512_bf16' or 'amx'",
    'cpu_description': 'mxamp.hardware.describe_cpu_class() in words',
    'computes_low_precision': 'whether `dtype` computes natively here (not FP32 between casts)',
    'batch': 'the batch size (first dimension of the first input)',
    'train': 'whether the step is a training step',
    'step_ms': 'the step in `dtype`, ms (normal run, no profiler)',
    'fp32_step_ms': 'the FP32 step, ms (normal run, no profiler)',
    'speedup': 'fp32_step_ms / step_ms',
    'slowdown_share': 'the share of the `dtype` step it takes beyond FP32 (0 when not slower)',
    'cast_count': 'the cast nodes of the graph',
    'cast_share': 'share of the step in cast nodes',
    'reorder_ms': 'oneDNN reorders outside the casts, ms (kernel pass)',
    'casts_and_reorders_share': 'share of the step in casts and oneDNN reorders',
    'fp32_islands': 'FP32 layers read through casts from, and cast back to, low-precision layers',
    'overhead_share': 'share of the normal step spent between operators (engine, Python)',
    'whole_step': '1.0: the cost of verdicts about the whole step',
}
#: A layer record: one per layer (an operator node of the FP32 graph).
LAYER_FIELDS = {
    'layer': "the layer's name (the block's name without the network's prefix, or the node)",
    'op': 'the MXNet operator',
    'computes_in': 'the precision its arithmetic runs in',
    'share': 'its share of the step (its operators, the casts it reads through, its gradient sums)',
    'kernel_primitive': "oneDNN primitive of its most expensive kernel ('convolution'...), or None",
    'kernel_implementation': "that kernel's implementation ('jit:avx2', 'ref:any'...)",
    'kernel_kind': "'jit', 'gemm', 'reference' or 'generic' (plain C++)",
    'kernel_isa': "'AMX', 'AVX512-BF16', 'AVX-512', 'AVX2', 'JIT', 'GEMM', 'reference C++', 'C++'",
    'kernel_dtype': "the precision the kernel computes in ('bfloat16', 'float32'...)",
    'kernel_prop': "'forward', 'backward_data'... of that kernel",
    'channels': 'BatchNorm: its channels; else None',
    'in_channels': 'Convolution: input channels per the weight (times groups); else None',
    'out_channels': 'Convolution: output channels; else None',
    'dense_in': 'FullyConnected: input features; else None',
    'dense_out': 'FullyConnected: output features; else None',
}
#: Phrases `evaluate` adds to a record before formatting a message.
DERIVED_FIELDS = {
    'island': 'the FP32 islands, named (`softmax0`, `bn3`)',
    'channels_padded': 'channels rounded up to BFLOAT16_BATCHNORM_MULTIPLE',
    'tensor_core_misfits': 'the dimensions that keep a layer off Tensor Cores, in words',
}

#: A complete step record (AVX2, bfloat16 storage only), for examples and tests.
EXAMPLE_STEP: Dict[str, Any] = {
    'dtype_requested': 'bfloat16', 'dtype': 'bfloat16', 'auto_reason': "float32 on this CPU",
    'device': 'cpu', 'cpu_class': 'avx2', 'cpu_description': "'avx2' class CPU",
    'computes_low_precision': False, 'batch': 32, 'train': False,
    'step_ms': 10.0, 'fp32_step_ms': 10.0, 'speedup': 1.0, 'slowdown_share': 0.0,
    'cast_count': 0, 'cast_share': 0.0, 'reorder_ms': 0.0, 'casts_and_reorders_share': 0.0,
    'fp32_islands': [], 'overhead_share': 0.0, 'whole_step': 1.0,
}
#: A complete layer record (an FP32 JIT convolution), for examples and tests.
EXAMPLE_LAYER: Dict[str, Any] = {
    'layer': 'conv0', 'op': 'Convolution', 'computes_in': 'float32', 'share': 0.5,
    'kernel_primitive': 'convolution', 'kernel_implementation': 'jit:avx2', 'kernel_kind': 'jit',
    'kernel_isa': 'AVX2', 'kernel_dtype': 'float32', 'kernel_prop': 'forward',
    'channels': None, 'in_channels': 16, 'out_channels': 16, 'dense_in': None, 'dense_out': None,
}


class Rule(NamedTuple):
    """One row of `RULES`.

    Attributes
    ----------
    kind : str
        Its stable name (the report's JSON carries it).
    scope : str
        ``'step'`` (the report's one step record) or ``'layer'`` (each layer
        record, read over the step's, so ``{cpu_class}`` and ``{dtype}`` too).
    condition : callable
        Of that record: the verdict is given when it returns True.
    message : str
        The verdict in plain words: a ``str.format`` template of the record's
        fields and `DERIVED_FIELDS`.
    cost : str
        The field holding the share of the step it concerns; verdicts are
        ranked by it, most expensive first.
    measured : bool
        False for a rule that no CPU can measure (Tensor Core eligibility for
        float16 on NVIDIA GPUs): its message says so.
    """
    kind: str
    scope: str
    condition: Callable[[Mapping[str, Any]], bool]
    message: str
    cost: str
    measured: bool = True


class Verdict(NamedTuple):
    """One verdict of a report: the rule's `kind`, its `message`, the `share` of the
    step it concerns, the `layer` it names (None for the whole step) and whether
    it is `measured` (False: a rule about hardware this machine is not)."""
    kind: str
    message: str
    share: float
    layer: Optional[str]
    measured: bool


def _off_multiple(value: Optional[int], multiple: int) -> bool:
    return value is not None and value % multiple != 0


def tensor_core_misfits(record: Mapping[str, Any]) -> List[str]:
    """The dimensions of a layer (a `LAYER_FIELDS` record, with the step's
    ``batch``) that are not multiples of `TENSOR_CORE_MULTIPLE`, in words."""
    named: Sequence[Tuple[str, Optional[int]]]
    if record.get('op') == 'Convolution':
        named = (('input channels', record.get('in_channels')),
                 ('output channels', record.get('out_channels')))
    elif record.get('op') == 'FullyConnected':
        named = (('batch', record.get('batch')), ('input features', record.get('dense_in')),
                 ('output features', record.get('dense_out')))
    else:
        return []
    return [('batch %d' if what == 'batch' else '%%d %s' % what) % value for what, value in named
            if value is not None and value % TENSOR_CORE_MULTIPLE != 0]


def _native_bfloat16(record):
    return record['cpu_class'] in ('avx512_bf16', 'amx')


def _reference(record):
    return record['kernel_kind'] == 'reference'


def _bfloat16_batchnorm_off(record):
    return (record['op'] == 'BatchNorm' and record['dtype'] == 'bfloat16'
            and _off_multiple(record['channels'], BFLOAT16_BATCHNORM_MULTIPLE))


def _casts_matter(record):
    return record['casts_and_reorders_share'] >= CAST_SHARE


#: Every rule behind a verdict, in no particular order (verdicts are ranked by cost).
RULES = (
    Rule('auto_kept_float32', STEP,
         lambda r: r['dtype_requested'] == 'auto' and r['dtype'] == 'float32',
         "dtype='auto' chose float32: {auto_reason}; profile with dtype='bfloat16' to measure "
         "what that costs",
         'whole_step'),
    Rule('bfloat16_storage_only', STEP,
         lambda r: r['dtype'] == 'bfloat16' and not r['computes_low_precision'],
         "bfloat16 on this {cpu_description}: every operator computes in FP32 between casts, so "
         "the bfloat16 step takes {step_ms:.1f} ms against FP32's {fp32_step_ms:.1f} ms "
         "({speedup:.2f}x FP32); FP32 is this CPU's fastest precision (dtype='auto' picks it)",
         'slowdown_share'),
    Rule('float16_on_cpu', STEP,
         lambda r: r['dtype'] == 'float16' and r['device'] == 'cpu',
         "float16 on a CPU: MXNet 1.9.1 has no float16 convolution or GEMM kernels on CPUs, so "
         "those compute in FP32 between float16 casts; the float16 step takes {step_ms:.1f} ms "
         "against FP32's {fp32_step_ms:.1f} ms ({speedup:.2f}x FP32). float16 pays on NVIDIA "
         "GPUs (see the Tensor Core lines)",
         'slowdown_share'),
    Rule('slower_than_float32', STEP,
         lambda r: (r['dtype'] != 'float32' and r['computes_low_precision']
                    and r['speedup'] < SLOWER_THAN_FLOAT32),
         "the {dtype} step takes {step_ms:.1f} ms against FP32's {fp32_step_ms:.1f} ms "
         "({speedup:.2f}x FP32): slower than FP32 here; the other lines say where the time goes",
         'slowdown_share'),
    Rule('reference_bfloat16_kernel', LAYER,
         lambda r: _reference(r) and r['kernel_dtype'] == 'bfloat16' and not _native_bfloat16(r),
         "`{layer}` runs the reference bfloat16 {kernel_primitive} ({kernel_implementation}; this "
         "CPU has no AVX512-BF16): {share:.0%} of the step",
         'share'),
    Rule('reference_kernel', LAYER,
         lambda r: _reference(r) and (r['kernel_dtype'] != 'bfloat16' or _native_bfloat16(r)),
         "`{layer}` runs oneDNN's reference {kernel_dtype} {kernel_primitive} "
         "({kernel_implementation}), plain C++ instead of a JIT kernel: {share:.0%} of the step",
         'share'),
    Rule('generic_kernel', LAYER,
         lambda r: r['kernel_kind'] == 'generic',
         "`{layer}` runs a generic C++ {kernel_dtype} {kernel_primitive} "
         "({kernel_implementation}), not one of oneDNN's JIT kernels for this CPU: "
         "{share:.0%} of the step",
         'share'),
    Rule('gemm_convolution', LAYER,
         lambda r: (r['kernel_kind'] == 'gemm'
                    and r['kernel_primitive'] in ('convolution', 'deconvolution')),
         "`{layer}` runs a GEMM-based {kernel_primitive} ({kernel_implementation}: im2col, then "
         "a matrix multiply), not one of oneDNN's direct JIT kernels: {share:.0%} of the step",
         'share'),
    Rule('emulated_bfloat16_kernel', LAYER,
         lambda r: r['kernel_dtype'] == 'bfloat16' and r['kernel_isa'] == 'AVX-512',
         "`{layer}` computes bfloat16 on AVX-512 without AVX512-BF16 ({kernel_implementation}): "
         "oneDNN emulates it, slower than FP32: {share:.0%} of the step",
         'share'),
    Rule('amx_unused', LAYER,
         lambda r: (r['cpu_class'] == 'amx' and r['kernel_dtype'] == 'bfloat16'
                    and r['kernel_primitive'] in AMX_PRIMITIVES
                    and r['kernel_isa'] != 'AMX'),
         "`{layer}` ({kernel_prop}) runs {kernel_implementation}, not an AMX kernel, on a CPU "
         "with AMX: {share:.0%} of the step",
         'share'),
    Rule('bfloat16_batchnorm_channels', LAYER,
         lambda r: _bfloat16_batchnorm_off(r) and _native_bfloat16(r),
         "`{layer}` has {channels} channels; oneDNN's fast bfloat16 BatchNorm needs a multiple "
         "of 16, so it takes a plain C++ path (pad the layer before it to {channels_padded}): "
         "{share:.0%} of the step",
         'share'),
    Rule('bfloat16_batchnorm_channels_elsewhere', LAYER,
         lambda r: _bfloat16_batchnorm_off(r) and not _native_bfloat16(r),
         "`{layer}` has {channels} channels; oneDNN's fast bfloat16 BatchNorm needs a multiple "
         "of 16: on a CPU with AVX512-BF16 or AMX it takes a plain C++ path (this CPU computes "
         "it in FP32)",
         'share'),
    Rule('fp32_island_casts', STEP,
         lambda r: _casts_matter(r) and bool(r['fp32_islands']),
         "casts and reorders cost {casts_and_reorders_share:.0%} of the step: the FP32 island "
         "around {island} sits between {dtype} layers",
         'casts_and_reorders_share'),
    Rule('casts', STEP,
         lambda r: _casts_matter(r) and not r['fp32_islands'],
         "casts and reorders cost {casts_and_reorders_share:.0%} of the step ({cast_count} cast "
         "nodes, {reorder_ms:.1f} ms of oneDNN reorders)",
         'casts_and_reorders_share'),
    Rule('small_batch_for_amx', STEP,
         lambda r: r['cpu_class'] == 'amx' and r['dtype'] == 'bfloat16' and r['batch'] < AMX_MIN_BATCH,
         "batch {batch} is too small for AMX to pay; scripts/benchmark.py --batch 8,16,32,64 "
         "shows where it starts on this machine",
         'overhead_share'),
    Rule('framework_overhead', STEP,
         lambda r: r['overhead_share'] >= OVERHEAD_SHARE,
         "{overhead_share:.0%} of the step passes between operators (MXNet's engine and Python), "
         "not in kernels: batch {batch} is too small to amortise it",
         'overhead_share'),
    Rule('tensor_cores', LAYER,
         lambda r: r['dtype'] == 'float16' and bool(tensor_core_misfits(r)),
         "on an NVIDIA GPU (a rule, not a measurement): `{layer}` has {tensor_core_misfits}; "
         "float16 Tensor Cores need multiples of 8, so it would run on CUDA cores",
         'share', measured=False),
)


def _derived(record):
    multiple = BFLOAT16_BATCHNORM_MULTIPLE
    channels = record.get('channels')
    return {'island': ', '.join('`%s`' % name for name in record.get('fp32_islands') or ()),
            'channels_padded': None if channels is None else -(-channels // multiple) * multiple,
            'tensor_core_misfits': ' and '.join(tensor_core_misfits(record))}


def evaluate(step: Mapping[str, Any], layers: Sequence[Mapping[str, Any]],
             rules: Sequence[Rule] = RULES) -> List[Verdict]:
    """Apply `rules` to a step record and its layer records; the verdicts, most expensive first.

    Parameters
    ----------
    step : dict
        The step record (`STEP_FIELDS`).
    layers : list of dict
        One record per layer (`LAYER_FIELDS`).
    rules : list of Rule
        Default: `RULES`.

    Returns
    -------
    list of Verdict
        Sorted by share, largest first; ties keep the order of `rules`, then of `layers`.

    Raises
    ------
    KeyError
        A record lacks a field a rule reads.
    """
    found = []
    for order, rule in enumerate(rules):
        records = [step] if rule.scope == STEP else [dict(step, **layer) for layer in layers]
        for record in records:
            if rule.condition(record):
                fields = dict(record, **_derived(record))
                layer = record['layer'] if rule.scope == LAYER else None
                share = float(record[rule.cost] or 0.0)
                found.append((-share, order, Verdict(rule.kind, rule.message.format(**fields),
                                                     share, layer, rule.measured)))
    found.sort(key=lambda item: item[:2])
    return [verdict for _, _, verdict in found]
