"""README.rst is what users read first: it must render without a warning."""
import os

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
            for node in doctree.traverse(docutils.nodes.system_message)
            if node['level'] >= docutils.utils.Reporter.WARNING_LEVEL]


def test_readme_renders_without_warnings():
    with open(os.path.join(ROOT, 'README.rst')) as handle:
        problems = rst_problems(handle.read())
    assert not problems, '\n'.join(problems)


def test_the_check_sees_broken_markup():
    assert rst_problems('Title\n===\n\n- item\n  ::\n\n text\n\n``unclosed\n')
