"""README.rst is what users read first: it renders without a warning, and its Python runs."""
import os
import subprocess
import sys

import docutils.core
import docutils.nodes
import docutils.utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rst_problems(text):
    """docutils' warnings and errors for `text`, one line each."""
    doctree = docutils.core.publish_doctree(text, settings_overrides={
        'report_level': docutils.utils.Reporter.WARNING_LEVEL,
        'halt_level': docutils.utils.Reporter.SEVERE_LEVEL + 1,
        'warning_stream': False})
    return ['line %s: %s' % (node.get('line'), node.astext().splitlines()[0])
            for node in doctree.findall(docutils.nodes.system_message)
            if node['level'] >= docutils.utils.Reporter.WARNING_LEVEL]


def test_readme_renders_without_warnings():
    with open(os.path.join(ROOT, 'README.rst')) as handle:
        problems = rst_problems(handle.read())
    assert not problems, '\n'.join(problems)


def test_the_check_sees_broken_markup():
    assert rst_problems('Title\n===\n\n- item\n  ::\n\n text\n\n``unclosed\n')



def code_blocks(text, language):
    """The README's ``.. code-block:: <language>`` blocks: (line, source) pairs, in order."""
    doctree = docutils.core.publish_doctree(text, settings_overrides={
        'report_level': docutils.utils.Reporter.SEVERE_LEVEL + 1})
    return [(node.line, node.astext()) for node in doctree.findall(docutils.nodes.literal_block)
            if language in node.get('classes', ())]


def test_the_readme_marks_its_examples_runnable():
    with open(os.path.join(ROOT, 'README.rst')) as handle:
        text = handle.read()
    python = [source for _, source in code_blocks(text, 'python')]
    assert any('mxamp.convert(net' in source for source in python)
    assert any('mxamp.convert_model(' in source for source in python)
    assert any(source.startswith('mxamp convert') for _, source in code_blocks(text, 'bash'))


def test_readme_code_runs_as_written(tmp_path):
    """The Quick start, in order, from an empty directory: each Python block in a fresh
    process (so each shows its own imports), then the command-line example on the files
    they wrote."""
    with open(os.path.join(ROOT, 'README.rst')) as handle:
        text = handle.read()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]),
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get('PATH', '')]))
    runs = [(line, [sys.executable, '-c', source]) for line, source in code_blocks(text, 'python')]
    runs += [(line, ['bash', '-euo', 'pipefail', '-c', source])
             for line, source in code_blocks(text, 'bash')]
    for line, command in runs:
        result = subprocess.run(command, cwd=str(tmp_path), env=env, universal_newlines=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert result.returncode == 0, 'README.rst line %s:\n%s' % (line, result.stderr[-3000:])
    assert (tmp_path / 'resnet50_bf16-symbol.json').exists()
