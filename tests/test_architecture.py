"""The layers of docs/architecture.rst, checked on the package's imports.

Every ``from . import x`` / ``from .x import y`` / ``import mxamp.x`` in
``mxamp/`` (function-level imports included) is an edge; an edge must run to a
lower layer, or within a layer in the order given there.  The kernel wing
(``mxamp/kernels/``) is one room, which only its doors import.  Also the length of
modules and of parameter lists: public signatures stay short, and the Symbol front's
internals pass one options object (`mxamp.symbol.SymbolOptions`), not the options one by one.
"""
import ast
import inspect
import os
import types

import mxamp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, 'mxamp')
WING = os.path.join(PACKAGE, 'kernels')

# Bottom to top (docs/architecture.rst, "Layers").  ``kernels`` is the kernel wing, the
# subpackage mxamp/kernels/, one room: its modules' imports of each other are its own.
LAYERS = (
    ('facts', {'hardware', 'cost', 'kvkeys', 'atomic_files', '_version', 'verdict_rules'}),
    ('precision names', {'dtypes'}),
    ('policy and graph rewrite', {'policy', 'graph', 'graph_check', 'passes',
                                  'fusion', 'network_state', 'diagnose'}),
    ('kernel wing', {'kernels'}),
    ('pass pipeline', {'pipeline'}),
    ('fronts', {'gluon_parameters', 'gluon_warnings', 'gluon_calls', 'gluon', 'gluon_report', 'inference',
                'symbol', 'contrib_amp'}),
    ('training', {'optimizer', 'kvstore_transport', 'loss_scaler', 'trainer', 'module'}),
    ('tools', {'system_info', 'profile_timing', 'profile_kernels', 'profile_report', 'profiling',
               'cli', 'gluonts', '__main__', '__init__'}),
)
# Edges within a layer, each one way.
WITHIN = {
    ('cost', 'hardware'),
    ('graph', 'policy'), ('fusion', 'graph'), ('network_state', 'graph'),
    ('graph_check', 'graph'), ('graph_check', 'policy'),
    ('network_state', 'policy'), ('diagnose', 'graph'), ('diagnose', 'policy'),
    ('diagnose', 'network_state'),
    ('gluon', 'gluon_parameters'), ('gluon', 'gluon_warnings'), ('gluon', 'gluon_calls'), ('gluon_report', 'gluon'),
    ('inference', 'gluon'), ('inference', 'gluon_calls'),
    ('inference', 'gluon_parameters'), ('contrib_amp', 'gluon'), ('contrib_amp', 'symbol'),
    ('trainer', 'optimizer'), ('trainer', 'kvstore_transport'), ('trainer', 'loss_scaler'),
    ('module', 'optimizer'), ('module', 'kvstore_transport'), ('module', 'loss_scaler'),
    ('__main__', 'cli'), ('__init__', 'cli'), ('cli', 'system_info'), ('__init__', 'system_info'),
    ('cli', 'profiling'), ('__init__', 'profiling'),
    ('profiling', 'profile_timing'), ('profiling', 'profile_kernels'),
    ('profiling', 'profile_report'), ('profile_kernels', 'profile_timing'),
    ('profile_report', 'profile_timing'),
}
# The training layer sits beside the fronts: it may not import them.
BESIDE = ('training', 'fronts')
# The modules that may import the kernel wing: the pass pipeline and the optimizer's fast
# step (the core's two doors into it), and the tools that report on it or measure it.
WING_DOORS = {'pipeline', 'optimizer', 'system_info', 'cli'}
# The most lines a module of mxamp/ (the wing's included) may have.
MAX_LINES = 1000
# The most parameters a public function or method may take; and a function of the Symbol
# front other than its public ones, which hand the internals one SymbolOptions.
MAX_PUBLIC_PARAMETERS = 15
MAX_SYMBOL_INTERNAL_PARAMETERS = 8
SYMBOL_FRONT_PUBLIC = ('convert_symbol', 'convert_model', 'convert_with_record')


def _modules():
    """``(room, path)`` of every Python module: mxamp/x.py is room x; the wing's are 'kernels'."""
    for name in sorted(os.listdir(PACKAGE)):
        if name.endswith('.py'):
            yield name[:-3], os.path.join(PACKAGE, name)
    for name in sorted(os.listdir(WING)):
        if name.endswith('.py'):
            yield 'kernels', os.path.join(WING, name)


def _layer_of(module):
    for index, (_, members) in enumerate(LAYERS):
        if module in members:
            return index
    raise AssertionError('mxamp/%s.py is in no layer of docs/architecture.rst' % module)


def _edges():
    edges = set()
    for source, path in _modules():
        in_wing = source == 'kernels'
        with open(path) as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 1 + in_wing:
                targets = [node.module] if node.module else [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 1 and in_wing:
                targets = ['kernels']
            elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('mxamp.'):
                targets = [node.module.split('.')[1]]
            elif isinstance(node, ast.Import):
                targets = [a.name.split('.')[1] for a in node.names
                           if a.name.startswith('mxamp.')]
            edges.update((source, target.split('.')[0]) for target in targets)
    return edges


def test_every_module_has_a_layer():
    rooms = {room for room, _ in _modules()}
    assert rooms == set().union(*(members for _, members in LAYERS))


def test_only_the_doors_import_the_kernel_wing():
    importers = {source for source, target in _edges() if target == 'kernels' and source != 'kernels'}
    assert importers <= WING_DOORS, 'import the wing through mxamp.pipeline: %s' % (
        sorted(importers - WING_DOORS))


def test_no_module_is_too_long():
    long = ['%s: %d lines' % (os.path.relpath(path, ROOT), count) for path, count in
            ((path, sum(1 for _ in open(path))) for _, path in _modules()) if count > MAX_LINES]
    assert not long, 'over %d lines: %s' % (MAX_LINES, ', '.join(long))


def test_imports_run_down_the_layers():
    wrong = []
    for source, target in sorted(_edges()):
        if source == target:
            continue
        above, below = _layer_of(source), _layer_of(target)
        beside = (LAYERS[above][0], LAYERS[below][0]) == BESIDE
        if below > above or beside or (below == above and (source, target) not in WITHIN):
            wrong.append('mxamp/%s.py imports mxamp.%s (%s -> %s)'
                         % (source, target, LAYERS[above][0], LAYERS[below][0]))
    assert not wrong, '\n'.join(wrong)


def test_no_circle():
    graph = {}
    for source, target in _edges():
        if source != target:
            graph.setdefault(source, set()).add(target)
    state = {}

    def visit(node, path):
        state[node] = 'open'
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 'open':
                raise AssertionError('import circle: %s' % ' -> '.join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 'done'
    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def _public_api():
    """``(name, function)`` of mxamp's public API: the functions in ``mxamp.__all__`` and the
    public methods (``__init__`` too) of its classes, and so for each module there, those of
    its ``__all__``; methods inherited from MXNet's classes are MXNet's."""
    def members(prefix, obj):
        if inspect.isfunction(obj):
            yield prefix, obj
        elif inspect.isclass(obj):
            for name, method in inspect.getmembers(obj, inspect.isfunction):
                if ((not name.startswith('_') or name == '__init__')
                        and method.__module__.startswith('mxamp')):
                    yield '%s.%s' % (prefix, name), method
    for name in mxamp.__all__:
        obj = getattr(mxamp, name)
        if isinstance(obj, types.ModuleType):
            for inner in getattr(obj, '__all__', ()):
                for found in members('%s.%s' % (name, inner), getattr(obj, inner)):
                    yield found
        else:
            for found in members(name, obj):
                yield found


def test_public_signatures_are_short():
    api = dict(_public_api())
    assert {'convert', 'convert_with_record', 'contrib_amp.convert_model', 'Trainer.__init__'} <= set(api)
    long = ['%s: %d parameters' % (name, len(inspect.signature(function).parameters))
            for name, function in sorted(api.items())
            if len(inspect.signature(function).parameters) > MAX_PUBLIC_PARAMETERS]
    assert not long, 'over %d parameters: %s' % (MAX_PUBLIC_PARAMETERS, ', '.join(long))


def test_the_symbol_front_passes_one_options_object():
    with open(os.path.join(PACKAGE, 'symbol.py')) as handle:
        tree = ast.parse(handle.read())
    functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert set(SYMBOL_FRONT_PUBLIC) <= set(functions)
    long = []
    for name, node in sorted(functions.items()):
        arguments = node.args
        count = (len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs)
                 + bool(arguments.vararg) + bool(arguments.kwarg))
        if name not in SYMBOL_FRONT_PUBLIC and count > MAX_SYMBOL_INTERNAL_PARAMETERS:
            long.append('%s: %d parameters' % (name, count))
    assert not long, 'over %d parameters: %s' % (MAX_SYMBOL_INTERNAL_PARAMETERS, ', '.join(long))
    for name in ('convert_checked', 'make_policy'):
        annotations = [ast.unparse(a.annotation) for a in functions[name].args.args if a.annotation]
        assert 'SymbolOptions' in annotations, name
