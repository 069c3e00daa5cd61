"""The Symbol-API front: `convert_symbol`, `convert_model` and their files.

It turns user-facing arguments (dtype names, op and layer overrides, a context)
into a `mxamp.policy.Policy`, runs the graph rewrite of `mxamp.graph`, casts the
parameters the rewrite stores in low precision, checks that parameters match the
graph, and reads and writes ``*-symbol.json`` / ``*.params`` files atomically
(a failed conversion never leaves a partial output file).
"""
import json
import os
import tempfile

import mxnet as mx

from . import hardware
from .dtypes import LOW_PRECISION, cast, dtype_name
from .graph import GraphError, convert_graph, error_line, load_graph
from .policy import Policy, emulates_float16


def make_policy(dtype, exclude=None, fp32_ops=None, lp_ops=None, ctx=None, batchnorm_data='low',
                cpu_class=None):
    """The `Policy` for user arguments.

    float16 computes GEMMs in FP32 unless every context in `ctx` is a GPU
    (`mxamp.policy.emulates_float16`; no `ctx`: a GPU).  bfloat16 graphs are
    for `cpu_class` (see `convert_symbol`).
    """
    dtype = dtype_name(dtype, allowed=LOW_PRECISION)
    devices = [] if ctx is None else [c.device_type for c in _contexts(ctx)]
    return Policy(dtype, fp32_ops=fp32_ops or (), lp_ops=lp_ops or (), exclude=exclude or (),
                  batchnorm_data=batchnorm_data, emulate_float16=emulates_float16(devices),
                  cpu_class=target_cpu_class(cpu_class))


def target_cpu_class(cpu_class):
    """The CPU class a bfloat16 graph is built for: `cpu_class`, resolved.

    None means a CPU that computes bfloat16 (``'avx512_bf16'``: graph files are
    for the machine that runs them); ``'auto'`` means this machine's class
    (`mxamp.hardware.cpu_class`); any class name is taken as it is.
    """
    if cpu_class is None:
        return hardware.AVX512_BF16
    if isinstance(cpu_class, str) and cpu_class.lower() == 'auto':
        return hardware.cpu_class()
    if cpu_class not in hardware.CPU_CLASSES:
        raise ValueError("cpu_class=%r: expected 'auto' or one of %s"
                         % (cpu_class, ', '.join(hardware.CPU_CLASSES)))
    return cpu_class


def _contexts(ctx):
    return ctx if isinstance(ctx, (list, tuple)) else [ctx]


def convert_symbol(sym, dtype='bfloat16', params=None, exclude=None, fp32_ops=None, lp_ops=None,
                   ctx=None, input_types=None, input_shapes=None, portable=True, cpu_class=None):
    """Convert an FP32 Symbol to mixed precision.

    Parameters
    ----------
    sym : mx.sym.Symbol or str
        The FP32 graph, or its JSON text.
    dtype : str
        Target low precision: ``'bfloat16'`` or ``'float16'`` (aliases
        ``'bf16'``, ``'fp16'``, ``'half'``), or ``'auto'``: the fastest
        precision this machine computes (`mxamp.hardware.resolve_dtype`, with
        `ctx`).  ``'float32'`` (also what ``'auto'`` gives on a CPU without
        native bfloat16) returns the graph unchanged, as `mxamp.convert` does.
    params : iterable of str, optional
        Names of the variables that are parameters.  Those consumed only by
        low-precision ops are declared in `dtype`, so their values must be stored
        in `dtype` (`convert_model` does that); every other variable is an input
        accepted in FP32.  By default every variable is an FP32 input and the
        graph casts the weights it needs in low precision.
    exclude : iterable of str, optional
        Node names or ``fnmatch`` patterns kept entirely in FP32.
    fp32_ops, lp_ops : iterable of str, optional
        Operator names forced to FP32 / to low precision.
    ctx : mx.Context or list, optional
        Where the graph will run.  float16 on a CPU (also in a list mixing CPUs
        and GPUs) computes the GEMM-based ops in FP32 between float16 casts
        (MXNet has no float16 GEMM on CPUs); without `ctx` float16 targets a GPU.
    input_types : dict, optional
        Inputs that are not float32, e.g. ``{'token_ids': 'int32'}``.
    input_shapes : dict, optional
        Input shapes, e.g. ``{'data': (1, 3, 224, 224)}``.  Under bfloat16 they
        let convolutions that oneDNN cannot run in blocked bfloat16 layouts (a
        3-channel stem) get the layout that is fast (see the README, "Convolution
        layouts under bfloat16"); ``__shape__`` attributes serve the same purpose.
    portable : bool
        True (default): every cast is a ``Cast`` node, and the graph survives
        MXNet's ``save``/``save_checkpoint`` with their defaults.  False:
        activations are cast with ``amp_cast``, much faster on a CPU; save such a
        graph with ``remove_amp_cast=False`` (MXNet drops amp_cast otherwise).
    cpu_class : str, optional
        bfloat16 only: the CPU class that will run the graph (see
        `mxamp.hardware.cpu_class`).  None (default): a CPU that computes
        bfloat16, so the graph computes in bfloat16.  ``'avx2'`` or
        ``'avx512'``: CPUs without native bfloat16, where every op computes in
        FP32 and the parameters stay stored in bfloat16 (the same parameter
        files).  ``'auto'``: this machine's class.

    Returns
    -------
    mx.sym.Symbol
        The converted graph: it accepts FP32 inputs and returns FP32 outputs.

    Examples
    --------
    >>> sym = mx.sym.load('resnet50-symbol.json')
    >>> bf16 = mxamp.convert_symbol(sym, 'bfloat16')
    >>> bf16.save('resnet50_bf16-symbol.json')
    """
    dtype = hardware.resolve_dtype(dtype, ctx)
    if dtype == 'float32':
        return _fp32_symbol(sym)
    policy = make_policy(dtype, exclude, fp32_ops, lp_ops, ctx, cpu_class=cpu_class)
    return convert_graph(sym, policy, params=params or (), input_types=input_types,
                         shapes=input_shapes, portable=portable).symbol


def convert_model(sym, arg_params, aux_params, dtype='bfloat16', exclude=None, fp32_ops=None,
                  lp_ops=None, ctx=None, input_types=None, input_shapes=None, return_conversion=False,
                  portable=True, cpu_class=None):
    """Convert a checkpoint (symbol + parameters) to mixed precision.

    Parameters consumed only by low-precision ops are cast to `dtype`;
    BatchNorm's gamma/beta/moving statistics and every other parameter stay FP32.
    ``input_shapes`` (e.g. ``{'data': (1, 3, 224, 224)}``) lets every parameter
    shape be checked against the graph; without it only the shapes the graph
    determines on its own are.  The parameters' shapes also choose the fast
    bfloat16 layout of each convolution.  The other arguments are those of
    `convert_symbol`.

    Returns
    -------
    (mx.sym.Symbol, dict, dict)
        The converted symbol and its ``arg_params``, ``aux_params``; with
        ``return_conversion=True`` a fourth item, the `mxamp.graph.Conversion`
        (None when `dtype` is, or ``'auto'`` resolves to, ``'float32'``: then
        the checkpoint comes back unchanged).

    Raises
    ------
    GraphError
        A parameter is not in the graph, or has a shape the graph rejects.

    Examples
    --------
    >>> sym, args, auxs = mx.model.load_checkpoint('resnet50', 0)
    >>> sym, args, auxs = mxamp.convert_model(sym, args, auxs, 'bfloat16')
    >>> mx.model.save_checkpoint('resnet50_bf16', 0, sym, args, auxs)
    """
    graph = load_graph(sym)
    check_params(graph, arg_params, aux_params, input_shapes)
    dtype = hardware.resolve_dtype(dtype, ctx)
    if dtype == 'float32':
        result = (_fp32_symbol(sym), arg_params, aux_params)
        return result + (None,) if return_conversion else result
    policy = make_policy(dtype, exclude, fp32_ops, lp_ops, ctx, cpu_class=cpu_class)
    names = list(arg_params) + list(aux_params)
    shapes = {name: value.shape for name, value in list(arg_params.items()) + list(aux_params.items())}
    shapes.update(input_shapes or {})
    conversion = convert_graph(graph, policy, params=names, input_types=input_types, shapes=shapes,
                               portable=portable)

    def converted(values):
        return {name: cast(value, conversion.dtype) if name in conversion.lp_params else value
                for name, value in values.items()}
    result = (conversion.symbol, converted(arg_params), converted(aux_params))
    return result + (conversion,) if return_conversion else result


def _fp32_symbol(source):
    """`source` (Symbol, JSON text or parsed graph) as a Symbol, unchanged."""
    if isinstance(source, mx.sym.Symbol):
        return source
    return mx.sym.load_json(json.dumps(load_graph(source)))


def check_params(graph, arg_params, aux_params, input_shapes=None):
    """Raise `GraphError` naming the first parameter that does not fit the graph."""
    symbol = mx.sym.load_json(json.dumps(graph))
    arguments, auxiliary = set(symbol.list_arguments()), set(symbol.list_auxiliary_states())
    for kind, values, expected in (('arg', arg_params, arguments), ('aux', aux_params, auxiliary)):
        for name in values:
            if name not in expected:
                other = auxiliary if kind == 'arg' else arguments
                hint = (' (it is an %s of the graph)' % ('auxiliary state' if kind == 'arg' else 'argument')
                        if name in other else '')
                raise GraphError("parameter '%s:%s' is not in the graph%s" % (kind, name, hint))
    shapes = {name: value.shape for name, value in arg_params.items()}
    shapes.update(input_shapes or {})
    try:
        arg_shapes, _, aux_shapes = symbol.infer_shape_partial(**shapes)
    except mx.base.MXNetError as err:
        if "nconsistent" not in str(err):
            return  # shapes of the inputs are needed to check this graph's parameters
        raise GraphError("parameter shapes do not fit the graph: %s" % error_line(err))
    for names, inferred, values in ((symbol.list_arguments(), arg_shapes, arg_params),
                                    (symbol.list_auxiliary_states(), aux_shapes, aux_params)):
        for name, shape in zip(names, inferred or []):
            if name in values and shape and 0 not in shape and tuple(shape) != values[name].shape:
                raise GraphError("parameter '%s' has shape %s, the graph needs %s"
                                 % (name, values[name].shape, tuple(shape)))


def load_params(path):
    """``(arg_params, aux_params)`` of an MXNet ``.params`` file; `GraphError` if unreadable."""
    try:
        loaded = mx.nd.load(path)
    except mx.base.MXNetError as err:
        raise GraphError("cannot read parameters from '%s': %s" % (path, error_line(err)))
    if not isinstance(loaded, dict):
        raise GraphError("'%s' holds unnamed arrays, not a parameter dictionary" % path)
    arg_params, aux_params = {}, {}
    for key, value in loaded.items():
        kind, _, name = key.partition(':')
        if kind == 'arg' and name:
            arg_params[name] = value
        elif kind == 'aux' and name:
            aux_params[name] = value
        else:
            # Gluon's save_parameters writes bare names; treat them as arguments.
            arg_params[key] = value
    return arg_params, aux_params


def save_model(prefix, symbol, arg_params=None, aux_params=None):
    """Write ``PREFIX-symbol.json`` (and ``PREFIX-0000.params``) with no partial files on failure.

    Both files are first written to temporary names in the target directory; the
    renames happen only after both writes succeeded.
    """
    directory = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(directory):
        raise GraphError("output directory '%s' does not exist" % directory)
    outputs = [('%s-symbol.json' % prefix, lambda tmp: symbol.save(tmp, remove_amp_cast=False))]
    if arg_params is not None:
        saved = {'arg:%s' % k: v for k, v in arg_params.items()}
        saved.update({'aux:%s' % k: v for k, v in (aux_params or {}).items()})
        outputs.append(('%s-0000.params' % prefix, lambda tmp: mx.nd.save(tmp, saved)))
    staged = []
    try:
        for final, write in outputs:
            handle, temporary = tempfile.mkstemp(prefix='.mxamp-', dir=directory)
            os.close(handle)
            staged.append((temporary, final))
            write(temporary)
        for temporary, final in staged:
            os.replace(temporary, final)
    finally:
        for temporary, _ in staged:
            if os.path.exists(temporary):
                os.unlink(temporary)
    return [final for _, final in staged]
