"""The manual (docs/, ``make docs``): checks that need no Sphinx.

``make docs`` builds it with warnings as errors and runs its examples; these
tests run in the test suite, whose environment has no Sphinx: the API
reference's plan has a place for every public name, the migration guides
cover every public call of ``contrib.amp`` and of PyTorch's ``GradScaler``,
every example of the guides is one the doctest build runs, and the manual's
own directives do what they say.
"""
import importlib
import os
import re
import sys

import pytest

import mxamp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, 'docs')
sys.path.insert(0, os.path.join(DOCS, '_ext'))

import mxamp_docs  # noqa: E402  (docs/_ext: the manual's Sphinx extension)

GUIDES = sorted(name for name in os.listdir(DOCS) if name.endswith('.rst'))


def _read(name):
    with open(os.path.join(DOCS, name)) as handle:
        return handle.read()


# -- the API reference ------------------------------------------------------------------------

def test_the_reference_is_generated_from_the_package():
    assert '.. mxamp-api::' in _read('api.rst')


def test_every_public_name_is_documented_once():
    plans = mxamp_docs.api_plan()
    documented = {}
    for plan in plans:
        for name in plan.documented:
            full = '%s.%s' % (plan.name, name)
            assert full not in documented, full
            documented[full] = plan.name
    sections = {plan.name for plan in plans}
    for name in mxamp.__all__:
        obj = getattr(mxamp, name)
        if isinstance(obj, type(mxamp)):
            assert obj.__name__ in sections, 'mxamp.%s has no section' % name
        else:
            assert 'mxamp.%s' % name in documented, 'mxamp.%s is not documented' % name
    for plan in plans[1:]:
        module = importlib.import_module(plan.name)
        assert set(plan.documented) | set(plan.elsewhere) == set(getattr(module, '__all__', ()))
        for name, full in plan.elsewhere.items():
            assert full in documented, '%s.%s points to %s, which is not documented' % (
                plan.name, name, full)


def test_every_module_of_the_package_has_a_section():
    modules = {'mxamp.' + name[:-3] for name in os.listdir(os.path.join(ROOT, 'mxamp'))
               if name.endswith('.py') and not name.startswith('_')}
    modules |= {'mxamp.kernels'} | {
        'mxamp.kernels.' + name[:-3] for name in os.listdir(os.path.join(ROOT, 'mxamp', 'kernels'))
        if name.endswith('.py') and not name.startswith('_')} - set(mxamp_docs.NOT_API)
    assert {plan.name for plan in mxamp_docs.api_plan()[1:]} == modules


def test_a_name_exported_at_the_top_is_documented_there_only():
    gluon = [plan for plan in mxamp_docs.api_plan() if plan.name == 'mxamp.gluon'][0]
    assert gluon.elsewhere['convert'] == 'mxamp.convert'
    assert 'convert' not in gluon.documented


# -- the migration guides -----------------------------------------------------------------------

def test_the_contrib_amp_guide_maps_every_public_call():
    from mxnet.contrib import amp
    calls = sorted(name for name in dir(amp) if not name.startswith('_')
                   and callable(getattr(amp, name)) and not isinstance(getattr(amp, name), type)
                   and getattr(getattr(amp, name), '__module__', '').startswith('mxnet.contrib.amp'))
    assert len(calls) >= 14, calls       # init ... list_widest_type_cast, as in MXNet 1.9.1
    guide = _read('migrating-contrib-amp.rst')
    missing = [name for name in calls if not re.search(r'amp\.%s\(' % name, guide)]
    assert not missing, missing
    for keyword in ('target_dtype', 'target_dtype_ops', 'fp32_ops', 'conditional_fp32_ops',
                    'excluded_sym_names', 'cast_optional_params'):
        assert '``%s=' % keyword in guide, keyword
    assert "``target_dtype='float16'`` everywhere" in guide   # the default that differs


# PyTorch's torch/amp/grad_scaler.py (2.x): GradScaler's public methods and arguments.
GRAD_SCALER = ('scale', 'unscale_', 'step', 'update', 'get_scale', 'get_growth_factor',
               'set_growth_factor', 'get_backoff_factor', 'set_backoff_factor',
               'get_growth_interval', 'set_growth_interval', 'is_enabled', 'state_dict',
               'load_state_dict')
GRAD_SCALER_ARGS = ('init_scale', 'growth_factor', 'backoff_factor', 'growth_interval',
                    'enabled')


def test_the_torch_amp_guide_maps_every_gradscaler_call():
    guide = _read('migrating-torch-amp.rst')
    missing = [name for name in GRAD_SCALER if name + '(' not in guide]
    assert not missing, missing
    assert all(arg in guide for arg in GRAD_SCALER_ARGS)
    assert 'autocast' in guide


# -- examples that run --------------------------------------------------------------------------

def _unrun_prompts(text):
    """Line numbers of ``>>>`` prompts outside a ``.. doctest::`` block (the doctest build
    runs only those: a bare ``>>>`` block would be shown and never run)."""
    lines, block_indent, found = text.splitlines(), None, []
    for number, line in enumerate(lines, 1):
        indent = len(line) - len(line.lstrip())
        if block_indent is not None and line.strip() and indent <= block_indent:
            block_indent = None
        if re.match(r'\s*\.\. (doctest|testcode)::', line):
            block_indent = indent
        elif line.lstrip().startswith('>>>') and block_indent is None:
            found.append(number)
    return found


@pytest.mark.parametrize('page', GUIDES)
def test_every_python_example_is_run_by_the_doctest_build(page):
    assert not _unrun_prompts(_read(page)), page


def test_the_check_sees_an_example_that_would_not_run():
    text = 'Text\n\n.. doctest::\n\n    >>> 1\n    1\n\n::\n\n    >>> 2\n'
    assert _unrun_prompts(text) == [10]


def test_a_shell_session_is_split_into_commands_and_their_output():
    lines = ['$ mxamp convert a.json \\', '    --dtype bfloat16', 'wrote a', '',
             '$ python scripts/x.py']
    assert mxamp_docs._session_steps(lines) == [
        ('mxamp convert a.json --dtype bfloat16', 'wrote a'), ('python scripts/x.py', None)]


def test_a_session_command_runs_with_this_python(capsys):
    mxamp_docs.run_command('python -c "print(42)"', show_output=True)
    assert capsys.readouterr().out == '42\n'


def test_a_failing_session_command_fails_unless_its_failure_is_shown(capsys):
    with pytest.raises(RuntimeError, match='exited with status 3'):
        mxamp_docs.run_command('python -c "import sys; sys.exit(3)"', show_output=False)
    mxamp_docs.run_command('python -c "import sys; sys.exit(\'bad input\')"', show_output=True)
    assert capsys.readouterr().out == 'bad input\n[exit status 1]\n'


def test_a_session_command_is_mxamp_or_python():
    with pytest.raises(ValueError, match="must start with 'mxamp' or 'python'"):
        mxamp_docs._argv('rm -rf build')


def test_the_examples_run_in_a_fresh_directory_with_the_scripts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mxamp_docs.doctest_setup()
    directory = os.getcwd()
    try:
        assert directory != str(tmp_path)
        assert os.path.isfile(os.path.join('scripts', 'train_imagenet.py'))
    finally:
        mxamp_docs.doctest_cleanup()
    assert os.getcwd() == str(tmp_path)
    assert not os.path.exists(directory)


def test_a_docstring_heading_of_its_own_becomes_a_rubric():
    lines = ['Parameters', '----------', 'x : int', '    A number.', '',
             'Overflow at the floor', '---------------------', 'Text.']
    mxamp_docs.free_headings_to_rubrics(None, 'class', 'C', None, {}, lines)
    assert lines == ['Parameters', '----------', 'x : int', '    A number.', '', '', '',
                     '.. rubric:: Overflow at the floor', '', 'Text.']


def test_the_benchmark_tables_are_the_measured_ones():
    for page in GUIDES:
        for name in re.findall(r'^\.\. benchmark:: (\S+)', _read(page), re.M):
            assert os.path.isfile(os.path.join(DOCS, name)), (page, name)
    assert re.search(r'^\.\. benchmark:: benchmark_avx2\.json$', _read('performance.rst'), re.M)
