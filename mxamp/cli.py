"""The ``mxamp`` command line (also ``python -m mxamp``).

``mxamp convert IN-symbol.json -o OUT_PREFIX --dtype bfloat16 [--params IN.params]``
rewrites a symbol file (and its parameters) to mixed precision.  Bad input
exits with status 2 and one line on stderr naming what is wrong and where (the
options as typed here: ``--exclude``, not ``exclude=``); no traceback, no
partial output file.  Parameters are checked against the graph before anything
is written: unknown or missing ones (``--allow-missing`` accepts the latter)
and shapes the graph rejects.  ``--for-inference`` also fuses the converted
graph with MXNet's oneDNN backend (`mxamp.fusion.fuse_symbol`).

``mxamp info`` prints one screen about this machine and install for a bug
report (`mxamp.system_info`): versions, the CPU class and what lowered it,
what ``dtype='auto'`` picks here and why.

``mxamp profile IN-symbol.json --input-shape data=1,3,224,224 [--params IN.params]``
measures where the step time of an FP32 graph goes, converted and in FP32,
layer by layer, and prints the report with its verdicts (`mxamp.profile`);
``--json`` and ``--plot`` also write it as JSON and as a PNG.

``mxamp measure-conv IN-symbol.json --input-shape data=16,3,224,224 -o TABLE.json``
measures, for each bfloat16 convolution of the converted graph, whether mxamp's
own oneDNN 3 operator is faster than MXNet's here, and writes the table
``MXAMP_KERNELS_TABLE`` points converted Gluon networks at
(`mxamp.kernels.choice`).
"""
import argparse
import os
import sys
import warnings
from typing import Optional, Sequence

from .dtypes import resolve_dtype
from .hardware import AVX2, CPU_CLASSES, cpu_class, describe_cpu_class

__all__ = ['EXIT_INTERNAL_ERROR', 'main']

EXIT_BAD_INPUT = 2
EXIT_INTERNAL_ERROR = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(EXIT_BAD_INPUT, '%s: error: %s\n' % (self.prog, message))


class _Version(argparse.Action):
    """``--version``: mxamp's version and the MXNet it runs on (imported only then)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, help=None):
        super(_Version, self).__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                                       help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import mxnet as mx

        from ._version import __version__
        sys.stdout.write('mxamp %s (MXNet %s)\n' % (__version__, mx.__version__))
        parser.exit()


def _dtype(text):
    """A ``--dtype`` value: what `mxamp.convert_model` accepts, ``'auto'`` included."""
    from .dtypes import dtype_name
    if text.lower() == 'auto':
        return 'auto'
    try:
        return dtype_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError("unknown dtype '%s': expected auto, float16 (fp16, half), "
                                         "bfloat16 (bf16) or float32 (fp32)" % text)


def _input_shape(text):
    name, _, dims = text.partition('=')
    try:
        shape = tuple(int(d) for d in dims.split(','))
    except ValueError:
        shape = ()
    if not name or not shape or min(shape) <= 0:
        raise argparse.ArgumentTypeError("expected NAME=D1,D2,... with positive sizes, got '%s'" % text)
    return name, shape


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: an option is matched whole (--par is not --params).
    parser = _Parser(prog='mxamp', description='Mixed precision for Apache MXNet 1.9.1.',
                     allow_abbrev=False)
    parser.add_argument('--version', action=_Version,
                        help="print mxamp's version and MXNet's, and exit")
    commands = parser.add_subparsers(dest='command', metavar='COMMAND')
    commands.required = True
    convert = commands.add_parser(
        'convert', allow_abbrev=False,
        help='convert a symbol file (and parameters) to float16 or bfloat16',
        description='Rewrite an FP32 MXNet symbol to mixed precision: low-precision compute ops, '
                    'FP32 softmax/normalisation/reductions/losses, casts only at precision boundaries.')
    convert.add_argument('symbol', metavar='IN-symbol.json', help='FP32 symbol file')
    convert.add_argument('-o', '--output', required=True, metavar='OUT_PREFIX',
                         help='writes OUT_PREFIX-symbol.json (and OUT_PREFIX-0000.params)')
    convert.add_argument('--dtype', required=True, type=_dtype,
                         metavar='{auto,float16,bfloat16,float32}',
                         help="target precision, as in Python (also fp16, half, bf16, fp32). "
                              "auto, as the Python API's default: the fastest this machine "
                              "computes, float16 where MXNet sees a GPU (unless --cpu), bfloat16 "
                              "on a CPU with bfloat16 kernels, else float32; float32 writes the "
                              "graph unchanged")
    convert.add_argument('--params', metavar='IN.params',
                         help='parameters to convert with the graph (arg:/aux: keys)')
    convert.add_argument('--exclude', nargs='+', default=[], metavar='NAME',
                         help='node names or glob patterns kept in FP32 (each must match a node)')
    convert.add_argument('--fp32-ops', nargs='+', default=[], metavar='OP',
                         help='operators forced to FP32')
    convert.add_argument('--lp-ops', nargs='+', default=[], metavar='OP',
                         help='operators forced to low precision')
    convert.add_argument('--input-shape', action='append', default=[], type=_input_shape,
                         metavar='NAME=D1,D2,...',
                         help='shape of an input (e.g. data=1,3,224,224): parameter shapes are '
                              'always checked, with it also the dimensions that depend on the '
                              "input's size")
    convert.add_argument('--allow-missing', action='store_true',
                         help='convert even when the params file lacks parameters of the graph '
                              '(they stay FP32 variables of the converted graph)')
    convert.add_argument('--cpu', action='store_true',
                         help='float16 only: the graph will run on a CPU, so GEMM ops compute in '
                              'FP32 between float16 casts')
    convert.add_argument('--cpu-class', choices=['auto'] + list(CPU_CLASSES), default=None,
                         help='bfloat16 only: the CPU class that will run the graph. By default '
                              'the graph computes in bfloat16 (CPUs with avx512_bf16 or AMX); '
                              'avx2 and avx512 (no native bfloat16) give a graph that computes in '
                              'FP32 with the same bfloat16 parameters; auto: this machine\'s class')
    convert.add_argument('--for-inference', action='store_true',
                         help="also fuse the graph for inference on a CPU with MXNet's oneDNN "
                              'backend (BatchNorm folded into convolutions, activations and '
                              'additions as post-ops); needs --input-shape for the inputs; the '
                              'output cannot be trained')
    convert.add_argument('--fast-casts', action='store_true',
                         help="cast activations and the --input-shape inputs with MXNet's "
                              "amp_cast, as Python's portable=False: several times faster on a "
                              "CPU, to the same values, but MXNet's save, save_checkpoint and "
                              "export drop amp_cast nodes unless given remove_amp_cast=False, so "
                              "a graph read from the output must be saved that way. Default: "
                              'Cast nodes, which every save keeps')
    convert.add_argument('--report', action='store_true',
                         help='print per-operator precision counts and the casts inserted (and '
                              'the fused nodes, with --for-inference)')
    commands.add_parser(
        'info', allow_abbrev=False,
        help="print this machine's facts for a bug report (versions, CPU class, what "
             "dtype='auto' picks and why)",
        description="One screen to paste into a bug report: mxamp's, MXNet's, numpy's and "
                    "Python's versions, the CPU and its class (and what lowered it), AMX, what "
                    "dtype='auto' picks here and why, the GPUs MXNet sees, OpenMP threads, "
                    "MXNet's build features and the environment variables that change them.")
    profile = commands.add_parser(
        'profile', allow_abbrev=False,
        help='measure where the step time of a symbol file goes, layer by layer, converted '
             'against FP32, and say what to change',
        description="Run an FP32 symbol converted to --dtype and in FP32, a few steps each, "
                    "under MXNet's profiler and (in a child process) oneDNN's verbose output, "
                    "and print one row per layer (precision, oneDNN kernel and its ISA, time), "
                    "the totals and verdicts in plain words.")
    profile.add_argument('symbol', metavar='IN-symbol.json', help='FP32 symbol file')
    profile.add_argument('--input-shape', action='append', required=True, type=_input_shape,
                         metavar='NAME=D1,D2,...',
                         help='shape of a data input, e.g. data=16,3,224,224 (the first '
                              'dimension is the batch); repeat for each input')
    profile.add_argument('--params', metavar='IN.params',
                         help='its parameters (arg:/aux: keys); default: random ones (the time '
                              'does not depend on their values)')
    profile.add_argument('--dtype', default='auto', type=_dtype,
                         metavar='{auto,float16,bfloat16,float32}',
                         help="the precision measured against FP32 (default auto: this machine's "
                              'fastest; float32 measures FP32 alone)')
    profile.add_argument('--train', action='store_true',
                         help='measure a training step (forward, backward, SGD update) instead '
                              'of inference')
    profile.add_argument('--iterations', type=int, default=5, metavar='N',
                         help='measured steps per precision (default 5)')
    profile.add_argument('--no-kernels', dest='kernels', action='store_false',
                         help="skip the child process that reads oneDNN's verbose output (no "
                              'kernel names, no kernel verdicts)')
    profile.add_argument('--json', metavar='OUT.json', help='also write the report as JSON')
    profile.add_argument('--plot', metavar='OUT.png',
                         help='also draw time per operator class, FP32 against the low '
                              'precision (needs matplotlib)')
    measure = commands.add_parser(
        'measure-conv', allow_abbrev=False,
        help="measure where mxamp's own oneDNN 3 convolution is faster than MXNet's, for the "
             'bfloat16 convolutions of a symbol file, and write the table mxamp decides by',
        description="For each distinct bfloat16 convolution of the FP32 graph converted for this "
                    "CPU, time the forward and backward pass of a small chain around it (MXNet's "
                    "convolutions, BatchNorm and ReLU on either side, as in a network) with "
                    "MXNet's Convolution and with mxamp's own operator in the middle, print one "
                    "row per case and merge the measurements into "
                    "OUT.json. Point MXAMP_KERNELS_TABLE at it: converted Gluon networks then run "
                    "the own operator where it measured faster on this CPU class at this OpenMP "
                    "thread count and batch size.")
    measure.add_argument('symbol', metavar='IN-symbol.json', help='FP32 symbol file')
    measure.add_argument('--input-shape', action='append', required=True, type=_input_shape,
                         metavar='NAME=D1,D2,...',
                         help='shape of a data input, e.g. data=16,3,224,224 (the first '
                              'dimension is the batch the measurements hold for); repeat for '
                              'each input')
    measure.add_argument('-o', '--output', required=True, metavar='OUT.json',
                         help='the table to write; measurements already in it for other cases, '
                              'CPU classes or thread counts are kept')
    measure.add_argument('--repeats', type=int, default=7, metavar='N',
                         help='timed passes per convolution and side (default 7; the median is kept)')
    return parser


def _input_shapes(args):
    """The --input-shape options as a dict; an input given twice is refused."""
    shapes = dict(args.input_shape)
    if len(shapes) != len(args.input_shape):
        raise ValueError('--input-shape: an input is given twice')
    return shapes


def _measure_conv(args):
    from .graph import GraphError, load_graph
    from .kernels.choice import ChoiceTable, measure_symbol, notes_for_table

    _check_file(args.symbol, 'symbol file')
    if args.repeats < 1:
        raise ValueError('--repeats %d: expected 1 or more' % args.repeats)
    shapes = _input_shapes(args)
    existing = ChoiceTable()
    if os.path.exists(args.output):
        existing = ChoiceTable.read(args.output)
    try:
        with open(args.symbol) as handle:
            symbol = load_graph(handle.read()).symbol
    except (OSError, UnicodeDecodeError) as err:
        raise GraphError("cannot read '%s': %s" % (args.symbol, err))
    except GraphError as err:
        raise GraphError('%s: %s' % (args.symbol, err))
    missing = sorted(set(shapes) - set(symbol.list_inputs()))
    if missing:
        raise ValueError('--input-shape %s: the graph has no input of that name' % missing[0])
    measurements, nodes = measure_symbol(symbol, shapes, repeats=args.repeats)
    print('%-48s %9s %9s %6s  %s' % ('convolution (data, kernel, stride, pad, ->filters)',
                                     'MXNet ms', 'own ms', 'own/MX', 'runs on'))
    for m in measurements:
        print('%-48s %9.2f %9.2f %6.2f  %s  [%s]' % (
            m.case.describe(), m.mxnet_ms, m.own_ms, m.own_ms / m.mxnet_ms,
            'own' if m.own_is_faster else 'MXNet', ', '.join(nodes[m.case])))
    mxnet_total = sum(m.mxnet_ms for m in measurements)
    own_total = sum(m.own_ms for m in measurements)
    print('%-48s %9.2f %9.2f %6.2f  (%d of %d cases on own, %s, %d OpenMP threads)' % (
        'all cases', mxnet_total, own_total, own_total / mxnet_total,
        sum(m.own_is_faster for m in measurements), len(measurements),
        measurements[0].cpu_class, measurements[0].threads))
    existing.update(measurements, notes_for_table(measurements))
    print('wrote %s' % existing.write(args.output))


def _profile(args):
    from .profiling import profile_checkpoint

    _check_file(args.symbol, 'symbol file')
    if args.params:
        _check_file(args.params, 'params file')
    if args.iterations < 1:
        raise ValueError('--iterations %d: expected 1 or more' % args.iterations)
    shapes = _input_shapes(args)
    report = profile_checkpoint(args.symbol, args.params, shapes, dtype=args.dtype,
                                train=args.train, iterations=args.iterations,
                                kernels=args.kernels)
    print(report.table())
    if args.json:
        print('wrote %s' % report.write_json(args.json))
    if args.plot:
        print('wrote %s' % report.plot(args.plot))


def _info(args):
    from .system_info import collect, format_info
    print(format_info(collect()))


def _convert(args):
    import mxnet as mx

    from .graph import GraphError, format_report, load_graph
    from .fusion import describe_fusion
    from .policy import Rules, canonical_ops
    from .symbol import Names, ParameterError, SymbolOptions, convert_checked, load_params, save_model

    _check_file(args.symbol, 'symbol file')
    try:
        with open(args.symbol) as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise GraphError("cannot read '%s': %s" % (args.symbol, err))
    try:
        graph = load_graph(text)
    except GraphError as err:
        raise GraphError('%s: %s' % (args.symbol, err))
    # Operator names are checked here so that errors name the options as typed.
    canonical_ops(args.fp32_ops, '--fp32-ops')
    canonical_ops(args.lp_ops, '--lp-ops')
    with warnings.catch_warnings():
        # resolve_dtype's note on 'auto' staying float32: the tool prints its choice itself.
        warnings.simplefilter('ignore', RuntimeWarning)
        dtype = resolve_dtype(args.dtype, mx.cpu() if args.cpu else None)
    if args.cpu_class is not None and dtype != 'bfloat16':
        raise ValueError('--cpu-class applies to --dtype bfloat16 (float16 graphs for a CPU: --cpu)%s'
                         % ('' if args.dtype != 'auto' else '; --dtype auto chose %s here' % dtype))
    arg_params = aux_params = None
    if args.params:
        _check_file(args.params, 'params file')
        arg_params, aux_params = load_params(args.params)
    # 'auto' itself, not the dtype it chose: under 'auto' small layers stay FP32 (mxamp.cost).
    options = SymbolOptions(args.dtype if args.dtype == 'auto' else dtype,
                            Rules.of(exclude=args.exclude, fp32_ops=args.fp32_ops,
                                     lp_ops=args.lp_ops),
                            ctx=mx.cpu() if args.cpu else None,
                            input_shapes=dict(args.input_shape), portable=not args.fast_casts,
                            cpu_class=args.cpu_class, allow_missing=args.allow_missing,
                            for_inference=args.for_inference)
    try:
        symbol, arg_params, aux_params, conversion = convert_checked(
            graph, options, Names('--exclude', '--input-shape', '--allow-missing',
                                  '--for-inference', '--cpu'),
            arg_params=arg_params, aux_params=aux_params)
    except ParameterError as err:
        raise GraphError('%s: %s' % (args.params, err))
    written = save_model(args.output, symbol, arg_params, aux_params)
    if args.dtype == 'auto':
        print('--dtype auto: %s (%s)' % (dtype, 'a GPU' if dtype == 'float16' and not args.cpu
                                         else describe_cpu_class()))
    if args.report and conversion is not None:
        print(format_report(conversion))
        if args.for_inference:
            print(describe_fusion(symbol))
    for path in written:
        print('wrote %s' % path)
    if args.fast_casts and _casts_with_amp_cast(symbol):
        # A default save of the written graph drops its casts: precisions would change unseen.
        sys.stderr.write("mxamp: note: --fast-casts: save a graph read from this output with "
                         "remove_amp_cast=False; MXNet's default save drops its amp_cast nodes\n")
    if dtype == 'bfloat16' and args.cpu_class is None and cpu_class() == AVX2:
        # The graph is for a machine with bfloat16 kernels; say so where it cannot run.
        sys.stderr.write('mxamp: note: the graph computes in bfloat16, which this CPU cannot run '
                         '(%s); --cpu-class auto writes one for this CPU\n' % describe_cpu_class())


def _casts_with_amp_cast(symbol):
    """Whether `symbol` changes precision through ``amp_cast`` nodes (``--fast-casts``); the
    identity ``amp_cast`` that keeps MXNet from folding a BatchNorm changes none."""
    import json

    from .graph import NO_FOLD_SUFFIX
    nodes = json.loads(symbol.tojson(remove_amp_cast=False))['nodes']
    return any(node['op'] == 'amp_cast' and not node['name'].endswith(NO_FOLD_SUFFIX)
               for node in nodes)


def _check_file(path, what):
    """Raise GraphError naming `what` when `path` is not a regular file, saying what it is instead.

    Reading a device or a named pipe could block or read nothing, so those are
    refused too (whether the file is readable, its reader says).
    """
    from .graph import GraphError
    if os.path.isdir(path):
        raise GraphError("%s '%s' is a directory" % (what, path))
    if not os.path.exists(path):
        raise GraphError("%s '%s' does not exist" % (what, path))
    if not os.path.isfile(path):
        raise GraphError("%s '%s' is not a regular file" % (what, path))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point; returns the exit status (0, or 2 for bad input)."""
    args = build_parser().parse_args(argv)
    from .graph import GraphError, error_line
    try:
        {'convert': _convert, 'info': _info, 'profile': _profile,
         'measure-conv': _measure_conv}[args.command](args)
    except (GraphError, ValueError, OSError) as err:
        sys.stderr.write('mxamp: error: %s\n' % str(err).splitlines()[0])
        return EXIT_BAD_INPUT
    except Exception as err:  # a bug of mxamp's: still one line, never a traceback
        # error_line: an MXNetError's first line is "Traceback (most recent call last):".
        sys.stderr.write('mxamp: internal error (please report): %s: %s\n'
                         % (type(err).__name__, error_line(err)))
        return EXIT_INTERNAL_ERROR
    return 0


if __name__ == '__main__':
    sys.exit(main())
