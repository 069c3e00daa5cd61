"""The layers of docs/architecture.rst, checked on the package's imports.

Every ``from . import x`` / ``from .x import y`` / ``import mxamp.x`` in
``mxamp/`` (function-level imports included) is an edge; an edge must run to a
lower layer, or within a layer in the order given there.  The few edges that
still break the rule are listed, with why, and must exist: fixing one means
deleting its line here.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, 'mxamp')

# Bottom to top (docs/architecture.rst, "Layers").
LAYERS = (
    ('facts', {'hardware', 'kvkeys', 'atomic_files', '_version', 'own_conv', 'verdict_rules'}),
    ('precision names', {'dtypes'}),
    ('policy and graph rewrite', {'policy', 'migration', 'graph', 'fusion', 'network_state', 'diagnose',
                                  'own_conv_choice', 'channels_last'}),
    ('fronts', {'gluon', 'inference', 'symbol'}),
    ('training', {'optimizer', 'kvstore_transport', 'loss_scaler', 'trainer', 'module'}),
    ('tools', {'system_info', 'profiling', 'cli', '__main__', '__init__'}),
)
# Edges within a layer, each one way.
WITHIN = {
    ('graph', 'policy'), ('migration', 'policy'), ('fusion', 'graph'), ('network_state', 'graph'),
    ('network_state', 'policy'), ('diagnose', 'graph'), ('diagnose', 'policy'),
    ('diagnose', 'network_state'), ('own_conv_choice', 'graph'), ('own_conv_choice', 'policy'),
    ('channels_last', 'graph'), ('channels_last', 'policy'),
    ('inference', 'gluon'),
    ('trainer', 'optimizer'), ('trainer', 'kvstore_transport'), ('trainer', 'loss_scaler'),
    ('module', 'optimizer'), ('module', 'kvstore_transport'), ('module', 'loss_scaler'),
    ('__main__', 'cli'), ('__init__', 'cli'), ('cli', 'system_info'), ('__init__', 'system_info'),
    ('cli', 'profiling'), ('__init__', 'profiling'),
}
# The training layer sits beside the fronts: it may not import them.
BESIDE = ('training', 'fronts')
# Edges that still break the rule, with why; each must still exist.
KNOWN = {
    ('hardware', 'dtypes'): 'the deprecated hardware.resolve_dtype (mxamp 0.1.0 spelling), '
                            'kept for one release',
}


def _layer_of(module):
    for index, (_, members) in enumerate(LAYERS):
        if module in members:
            return index
    raise AssertionError('mxamp/%s.py is in no layer of docs/architecture.rst' % module)


def _edges():
    edges = set()
    for name in sorted(os.listdir(PACKAGE)):
        if not name.endswith('.py'):
            continue
        source = name[:-3]
        with open(os.path.join(PACKAGE, name)) as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                targets = [node.module] if node.module else [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('mxamp.'):
                targets = [node.module.split('.')[1]]
            elif isinstance(node, ast.Import):
                targets = [a.name.split('.')[1] for a in node.names
                           if a.name.startswith('mxamp.')]
            edges.update((source, target.split('.')[0]) for target in targets)
    return edges


def test_every_module_has_a_layer():
    modules = {n[:-3] for n in os.listdir(PACKAGE) if n.endswith('.py')}
    assert modules == set().union(*(members for _, members in LAYERS))


def test_imports_run_down_the_layers():
    wrong = []
    for source, target in sorted(_edges()):
        if (source, target) in KNOWN:
            continue
        above, below = _layer_of(source), _layer_of(target)
        beside = (LAYERS[above][0], LAYERS[below][0]) == BESIDE
        if below > above or beside or (below == above and (source, target) not in WITHIN):
            wrong.append('mxamp/%s.py imports mxamp.%s (%s -> %s)'
                         % (source, target, LAYERS[above][0], LAYERS[below][0]))
    assert not wrong, '\n'.join(wrong)


def test_the_known_exceptions_still_exist():
    edges = _edges()
    gone = [edge for edge in KNOWN if edge not in edges]
    assert not gone, 'fixed, delete from KNOWN and docs/architecture.rst: %s' % gone


def test_no_circle():
    graph = {}
    for source, target in _edges():
        if source != target and (source, target) not in KNOWN:
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
