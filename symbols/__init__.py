"""Symbol-API network definitions, in the style of MXNet's image-classification examples.

Each module has a ``get_symbol(num_classes, num_layers, image_shape,
dtype='float32', **kwargs)`` returning an ``mx.sym.Symbol`` that ends in
``SoftmaxOutput(name='softmax')``, so ``mx.mod.Module`` trains it with the
inputs ``data`` and ``softmax_label``.  The networks are written once, in FP32;
a low-precision `dtype` is produced by mxamp's graph rewrite
(:func:`with_dtype`), never by casts placed by hand.  ``Module`` allocates the
parameters in the dtypes the graph declares; MXNet's initializers cannot fill
bfloat16 arrays, :class:`mxamp.Float32Init` can (also importable from here).

Modules
-------
resnet
    ResNet v1 and v1.5, 18 to 152 layers.
"""
import mxamp
from mxamp.dtypes import resolve_dtype
from mxamp.module import Float32Init

__all__ = ['with_dtype', 'Float32Init']

#: Inputs of every network here: fed by the data iterator, never parameters.
INPUTS = ('data', 'softmax_label')


def with_dtype(symbol, dtype, ctx=None, inputs=INPUTS, input_shapes=None, cpu_class='auto'):
    """`symbol` (an FP32 graph) in the precision `dtype`, through `mxamp.convert_symbol`.

    Every variable except `inputs` is a parameter: those that feed only
    low-precision operators (convolution and fully-connected weights and biases)
    are declared in `dtype`, so ``Module`` allocates and updates them in `dtype`;
    the others (BatchNorm's gamma, beta and moving statistics) stay FP32.

    Parameters
    ----------
    symbol : mx.sym.Symbol
        The FP32 network.
    dtype : str
        ``'float32'`` (returns `symbol` unchanged), ``'float16'``, ``'bfloat16'``
        or ``'auto'`` (``'float16'`` on a GPU, ``'bfloat16'`` on a CPU that
        computes it natively, ``'float32'`` on other CPUs; see
        `mxamp.dtypes.resolve_dtype`).
    ctx : mx.Context or list of Context, optional
        Where the network runs.  float16 with a CPU context computes convolutions
        and fully-connected layers in FP32 between float16 casts (MXNet 1.9.1 has
        no float16 GEMM on CPUs); without `ctx`, float16 targets a GPU.
    inputs : tuple of str
        Variables that are data, not parameters; they stay FP32 inputs.
    input_shapes : dict, optional
        Shapes of `inputs` (batch size irrelevant), e.g. ``{'data': (1, 3, 224, 224)}``:
        with them, bfloat16 keeps the convolutions oneDNN cannot run in blocked
        bfloat16 layouts (the 3-channel stem) in FP32, as `mxamp.convert_model`
        does for a checkpoint.
    cpu_class : str or None
        bfloat16 only: the CPU class the graph is for (see
        `mxamp.convert_symbol`).  ``'auto'`` (default): this machine's, so the
        graph runs here; on CPUs without native bfloat16 it stores its
        parameters in bfloat16 and computes in FP32 (MXNet's oneDNN has no
        bfloat16 kernels on CPUs without AVX-512).  None: a CPU that computes
        bfloat16.

    Returns
    -------
    mx.sym.Symbol
        Takes FP32 data and returns FP32 outputs.
    """
    dtype = resolve_dtype(dtype, ctx)
    if dtype == 'float32':
        return symbol
    names = symbol.list_arguments() + symbol.list_auxiliary_states()
    params = [name for name in names if name not in inputs]
    return mxamp.convert_symbol(symbol, dtype, params=params, ctx=ctx, input_shapes=input_shapes,
                                cpu_class=cpu_class)
