"""The Sphinx directives of mxamp's manual, and the plan of its API reference.

* ``.. mxamp-api::`` writes the API reference from the package itself: the
  top-level names of ``mxamp.__all__``, then every module of the package with
  the names of its ``__all__``.  A name is documented once, where users reach
  it: at the top level when ``mxamp`` exports it, else in the module that
  defines it; the other modules that export it point there (:func:`api_plan`).
  A name or a module added to the package thus appears without editing the
  manual.
* ``.. command-help:: mxamp convert --help`` shows what that command prints,
  run when the manual is built, so an option's description cannot drift.
* ``.. shell-session::`` shows a console session (``$ command`` lines, then
  what they print) and makes the doctest builder run it in the page's
  doctest directory: the commands must succeed and print what is shown
  (``...`` matches anything, as in a doctest).
* ``.. benchmark:: benchmark.json`` shows the table a ``scripts/benchmark.py``
  JSON in ``docs/`` holds, with the machine and command it records.
* :func:`doctest_setup` / :func:`doctest_cleanup` give every page's examples
  a fresh temporary working directory with the checkout's ``scripts/`` in it.

:func:`api_plan` imports no Sphinx: ``tests/test_docs.py`` checks the plan in
the test suite, whose environment has no Sphinx.
"""
import doctest
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import shlex
import shutil
import subprocess
import sys
import tempfile
import types
from typing import Dict, List, NamedTuple, Optional, Tuple

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList

DOCS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(DOCS)
PACKAGE = 'mxamp'


# -- the API reference ----------------------------------------------------------------------

class ModulePlan(NamedTuple):
    """What the reference says about one module of the package."""
    name: str                       # 'mxamp.gluon'
    documented: List[str]           # names of its __all__ documented in its section
    elsewhere: Dict[str, str]       # name -> the full name under which it is documented


# Modules that are no API: the kernel wing's build, which setup.py runs.
NOT_API = ('mxamp.kernels.build',)
# Modules of an optional extra, documented where its library is installed.
OPTIONAL = {'mxamp.gluonts': 'gluonts'}


def package_modules(package: str = PACKAGE) -> List[str]:
    """The package's modules and subpackages' modules, by full name, alphabetical
    (``__main__``, private ones and `NOT_API` left out)."""
    root = importlib.import_module(package)
    return sorted(info.name for info in pkgutil.walk_packages(root.__path__, package + '.')
                  if not info.name.rsplit('.', 1)[1].startswith('_') and info.name not in NOT_API
                  and (info.name not in OPTIONAL
                       or importlib.util.find_spec(OPTIONAL[info.name]) is not None))


def _defined_in(obj: object) -> Optional[str]:
    """The module that defines a function or class; None for data (whose type has a module)."""
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return getattr(obj, '__module__', None)
    return None


def api_plan(package: str = PACKAGE) -> List[ModulePlan]:
    """Where each public name is documented: the package first, then its modules.

    The package documents the functions and classes of its ``__all__`` (its
    modules there are sections of their own).  A module documents the names
    of its ``__all__`` except those the package exports (documented there)
    and those another module of the package defines and exports (documented
    in that module).
    """
    root = importlib.import_module(package)
    top = {name: getattr(root, name) for name in getattr(root, '__all__', ())}
    plans = [ModulePlan(package, [name for name, obj in top.items()
                                  if not isinstance(obj, types.ModuleType)], {})]
    for module_name in package_modules(package):
        module = importlib.import_module(module_name)
        documented, elsewhere = [], {}
        for name in getattr(module, '__all__', ()):
            obj = getattr(module, name)
            home = _defined_in(obj)
            if name in top and top[name] is obj:
                elsewhere[name] = '%s.%s' % (package, name)
            elif (home and home != module_name and home.startswith(package + '.')
                  and name in getattr(sys.modules[home], '__all__', ())):
                elsewhere[name] = '%s.%s' % (home, name)
            else:
                documented.append(name)
        plans.append(ModulePlan(module_name, documented, elsewhere))
    return plans


def _api_rst(plans: List[ModulePlan]) -> List[str]:
    """The reST of the API reference: one section per module.

    ``:members:`` without names documents a module's ``__all__`` (autodoc's rule)
    and a class's members; ``:exclude-members:`` leaves out what is documented
    elsewhere.  (Naming the members instead would also restrict the classes'
    members to those names.)
    """
    package, modules = plans[0], plans[1:]
    root = importlib.import_module(package.name)
    exported_modules = [name for name in getattr(root, '__all__', ())
                        if isinstance(getattr(root, name), types.ModuleType)]
    lines = ['`%s`' % package.name, '-' * (len(package.name) + 2), '',
             '.. automodule:: %s' % package.name, '   :members:', '']
    if exported_modules:
        lines += ['Modules exported by ``%s``: %s.' % (package.name, ', '.join(
            ':mod:`%s.%s`' % (package.name, name) for name in exported_modules)), '']
    for plan in modules:
        lines += ['`%s`' % plan.name, '-' * (len(plan.name) + 2), '',
                  '.. automodule:: %s' % plan.name, '   :members:']
        if plan.elsewhere:
            lines.append('   :exclude-members: %s' % ', '.join(plan.elsewhere))
        lines.append('')
        if plan.elsewhere:
            lines += ['Also exported here, documented where the link goes: %s.' % ', '.join(
                ':py:obj:`%s <%s>`' % (name, full) for name, full in plan.elsewhere.items()), '']
    return lines


class ApiDirective(Directive):
    """``.. mxamp-api::``: the reference of every public name of the package."""
    has_content = False

    def run(self):
        from sphinx.util.nodes import nested_parse_with_titles
        container = nodes.section()
        container.document = self.state.document
        nested_parse_with_titles(self.state, StringList(_api_rst(api_plan()), '<mxamp-api>'),
                                 container)
        return container.children


# -- docstrings ---------------------------------------------------------------------------

# The sections napoleon reads in a numpy-style docstring (the others are free headings).
_NUMPY_SECTIONS = {
    'args', 'arguments', 'attention', 'attributes', 'caution', 'danger', 'error', 'example',
    'examples', 'hint', 'important', 'keyword args', 'keyword arguments', 'methods', 'note',
    'notes', 'other parameters', 'parameters', 'receive', 'receives', 'return', 'returns',
    'raise', 'raises', 'references', 'see also', 'tip', 'todo', 'warning', 'warnings', 'warn',
    'warns', 'yield', 'yields'}


def free_headings_to_rubrics(app, what, name, obj, options, lines: List[str]) -> None:
    """Turn a class's or function's own headings (``Overflow at the floor`` over dashes)
    into rubrics, before napoleon reads the docstring.

    mxamp's docstrings give long explanations headings of their own.  In a
    module's docstring they become sections; in a class's, docutils allows no
    section, and napoleon would read the text after a ``Parameters`` section
    as more parameters.  Two blank lines end napoleon's section; the rubric
    keeps the heading.
    """
    if what == 'module':
        return
    index = 1
    while index < len(lines):
        title, underline = lines[index - 1].strip(), lines[index].strip()
        if (title and len(underline) >= 3 and set(underline) == {'-'}
                and len(underline) == len(title) and title.lower() not in _NUMPY_SECTIONS):
            indent = lines[index - 1][:len(lines[index - 1]) - len(lines[index - 1].lstrip())]
            lines[index - 1:index + 1] = ['', '', indent + '.. rubric:: ' + title, '']
            index += 3
        index += 1


def skip_namedtuple_fields(app, what, name, obj, skip, options) -> Optional[bool]:
    """Leave out the members a NamedTuple makes for its fields ("Alias for field number
    0"): the class's docstring describes them."""
    if what == 'class' and (getattr(obj, '__doc__', None) or '').startswith(
            'Alias for field number'):
        return True
    return None


# -- commands -------------------------------------------------------------------------------

def _argv(command: str) -> List[str]:
    """The argv that runs `command` (as a user types it) with this Python."""
    words = shlex.split(command)
    if words[0] == 'mxamp':
        return [sys.executable, '-m', 'mxamp'] + words[1:]
    if words[0] == 'python':
        return [sys.executable] + words[1:]
    raise ValueError("a command must start with 'mxamp' or 'python', got %r" % command)


def _environment() -> Dict[str, str]:
    """This Python first on PATH (``python``, ``mxamp``), the checkout first on PYTHONPATH,
    and a fixed width for argparse's help."""
    env = dict(os.environ, COLUMNS='90')
    env['PATH'] = os.pathsep.join([os.path.dirname(sys.executable), env.get('PATH', '')])
    env['PYTHONPATH'] = os.pathsep.join([ROOT] + [p for p in env.get('PYTHONPATH', '').split(
        os.pathsep) if p])
    return env


class CommandHelpDirective(Directive):
    """``.. command-help:: python scripts/train_imagenet.py --help``: that command's output."""
    required_arguments = 1
    final_argument_whitespace = True
    has_content = False

    def run(self):
        command = self.arguments[0]
        try:
            result = subprocess.run(_argv(command), cwd=ROOT, env=_environment(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    universal_newlines=True, timeout=120)
        except (ValueError, OSError, subprocess.TimeoutExpired) as error:
            raise self.error('command-help: %s: %s' % (command, error))
        if result.returncode != 0:
            raise self.error('command-help: %s exited with status %d:\n%s'
                             % (command, result.returncode, result.stderr[-2000:]))
        text = '$ %s\n%s' % (command, result.stdout.rstrip())
        block = nodes.literal_block(text, text, language='console')
        self.add_name(block)
        return [block]


class ShellSessionDirective(Directive):
    """``.. shell-session::``: a console session that the doctest builder runs.

    Content: ``$ command`` lines (``\\`` continues a command on the next line),
    each followed by what it prints on stdout (compared as a doctest compares,
    with ELLIPSIS and NORMALIZE_WHITESPACE; nothing shown means nothing
    checked).  stderr, where notes about this machine go, is not compared,
    except for a command expected to fail: its output ends with its stderr
    and ``[exit status N]`` (see :func:`run_command`).  A command must succeed
    otherwise.  The optional argument names the doctest group (default: ``default``, the
    page's other examples, so that the session sees the files they wrote).
    """
    optional_arguments = 1
    has_content = True

    def run(self):
        text = '\n'.join(self.content)
        groups = [self.arguments[0]] if self.arguments else ['default']
        shown = nodes.literal_block(text, text, language='console')
        result = [shown]
        for command, expected in _session_steps(list(self.content)):
            # Each command's output is checked with it; nothing shown checks nothing printed.
            code = ('from mxamp_docs import run_command as _run_command\n'
                    '_run_command(%r, show_output=%r)\n' % (command, expected is not None))
            result.append(nodes.comment(code, code, testnodetype='testcode', groups=groups,
                                        options={}))
            if expected is not None:
                result.append(nodes.comment(expected, expected, testnodetype='testoutput',
                                            groups=groups, options={
                                                doctest.ELLIPSIS: True,
                                                doctest.NORMALIZE_WHITESPACE: True}))
        return result


def _session_steps(lines: List[str]) -> List[Tuple[str, Optional[str]]]:
    """(command, what it prints or None) for each ``$`` line of a shell session."""
    steps: List[Tuple[str, Optional[str]]] = []
    command: Optional[str] = None
    output: List[str] = []
    for line in lines:
        if command is not None and not output and command.endswith('\\'):
            command = command[:-1].rstrip() + ' ' + line.strip()
        elif line.startswith('$ '):
            if command is not None:
                steps.append((command, '\n'.join(output).strip() or None))
            command, output = line[2:].strip(), []
        elif command is not None:
            output.append(line)
    if command is not None:
        steps.append((command, '\n'.join(output).strip() or None))
    return steps


def run_command(command: str, show_output: bool) -> None:
    """Run one command of a shell session (doctest builder, in the page's directory).

    Prints what the command printed on stdout, for the doctest to compare
    (stderr holds notes that depend on the machine).  A command that fails
    prints its stderr and ``[exit status N]`` instead, which the session must
    show to expect the failure; a failing command whose output is not shown
    raises, with its output.
    """
    result = subprocess.run(_argv(command), env=_environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, universal_newlines=True)
    if result.returncode != 0 and not show_output:
        raise RuntimeError('%s exited with status %d:\n%s%s' % (
            command, result.returncode, result.stdout[-3000:], result.stderr[-3000:]))
    if show_output:
        shown = [result.stdout.rstrip()]
        if result.returncode != 0:
            shown += [result.stderr.rstrip(), '[exit status %d]' % result.returncode]
        print('\n'.join(part for part in shown if part))


# -- measurements ---------------------------------------------------------------------------

class BenchmarkDirective(Directive):
    """``.. benchmark:: benchmark_avx2.json``: the table a ``scripts/benchmark.py`` JSON
    holds (``table``), under the machine and command it records (``meta``).

    The figures in the manual are thus the measured ones, file for file.
    """
    required_arguments = 1
    has_content = False

    def run(self):
        name = self.arguments[0]
        path = os.path.join(DOCS, name)
        try:
            with open(path) as handle:
                data = json.load(handle)
            meta, table = data['meta'], data['table']
        except (OSError, ValueError, KeyError) as error:
            raise self.error('benchmark: %s: %s' % (name, error))
        hardware = meta.get('hardware', {})
        features = ', '.join(flag for flag in ('avx512_bf16', 'amx_bf16') if hardware.get(flag))
        # A run under a cap of oneDNN's ISA measured a lower CPU class: the command says so.
        cap = meta.get('DNNL_MAX_CPU_ISA')
        command = ('DNNL_MAX_CPU_ISA=%s ' % cap if cap else '') + meta.get('command', '')
        caption = ('``docs/%s``: %s, %s CPUs (%s), %s; ``%s``' % (
            name, meta.get('cpu_model', 'CPU'), meta.get('cpu_count', '?'),
            features or 'no AVX512-BF16, no AMX', meta.get('date', '')[:10], command))
        text, messages = self.state.inline_text(caption, self.lineno)
        block = nodes.literal_block(table, table, language='text')
        return [nodes.paragraph(caption, '', *text), block] + messages


# -- the doctest directory ----------------------------------------------------------------------

# (the directory to return to, the temporary one) of each page whose examples run now
_directories: List[Tuple[str, str]] = []


def doctest_setup() -> None:
    """Run a page's examples in a fresh temporary directory that holds ``scripts/``."""
    directory = tempfile.mkdtemp(prefix='mxamp-docs-')
    os.symlink(os.path.join(ROOT, 'scripts'), os.path.join(directory, 'scripts'))
    _directories.append((os.getcwd(), directory))
    os.chdir(directory)


def doctest_cleanup() -> None:
    """Leave and remove the directory of :func:`doctest_setup`."""
    previous, directory = _directories.pop()
    os.chdir(previous)
    shutil.rmtree(directory, ignore_errors=True)


def setup(app):
    app.add_directive('mxamp-api', ApiDirective)
    app.add_directive('command-help', CommandHelpDirective)
    app.add_directive('shell-session', ShellSessionDirective)
    app.add_directive('benchmark', BenchmarkDirective)
    # Before napoleon (priority 500) rewrites the docstring.
    app.connect('autodoc-process-docstring', free_headings_to_rubrics, priority=400)
    app.connect('autodoc-skip-member', skip_namedtuple_fields)
    return {'version': '1', 'parallel_read_safe': True, 'parallel_write_safe': True}
