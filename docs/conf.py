"""Sphinx configuration of mxamp's manual (``make docs``).

The API reference is generated from the package's numpy-style docstrings
(autodoc + napoleon), driven by each module's ``__all__`` (``_ext/mxamp_docs.py``):
a name added to ``__all__`` appears without editing the manual.  The code in
the guides is run by ``sphinx-build -b doctest`` on the CPU that builds it, so
it must work on every CPU class (see ``troubleshooting.rst``).
"""
import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
sys.path[:0] = [ROOT, os.path.join(DOCS, '_ext')]

import mxamp  # noqa: E402  (after the path is set: the checkout's mxamp, not another one)

project = 'mxamp'
author = 'the mxamp authors'
copyright = 'the mxamp authors, Apache-2.0'
release = version = mxamp.__version__

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'sphinx.ext.doctest',
    'mxamp_docs',
]

root_doc = 'index'
exclude_patterns = ['_build']

# -- API reference ----------------------------------------------------------------------
# Members come from __all__ (autodoc's rule for modules, see _ext/mxamp_docs.py).  The type
# hints stay in the signature, one parameter a line when it is long; the docstrings' own
# "Parameters" sections keep their grouping (``params, optimizer : ...`` is one entry).
autodoc_member_order = 'bysource'
autodoc_typehints = 'signature'
autodoc_class_signature = 'separated'
autodoc_inherit_docstrings = False     # a method without a docstring of its own is MXNet's
maximum_signature_line_length = 88
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_param = False
napoleon_use_rtype = False
# A docstring's "Attributes" section becomes fields of its class, not entries of their own:
# autodoc also lists a NamedTuple's fields, and two entries of one name are an error.
napoleon_use_ivar = True
# The docstrings' ``single backquotes`` name Python objects: link them where they resolve.
default_role = 'py:obj'

# -- doctest ---------------------------------------------------------------------------
# The guides' examples run in a fresh temporary directory per page (they write checkpoints),
# with the checkout's scripts/ reachable as in a checkout; see mxamp_docs.doctest_setup.
doctest_global_setup = 'from mxamp_docs import doctest_setup as _setup; _setup()'
doctest_global_cleanup = 'from mxamp_docs import doctest_cleanup as _cleanup; _cleanup()'
# The docstrings' own examples run in tests/test_docstrings.py; here only the guides' run,
# each written as a ``.. doctest::`` (or testcode) block.
doctest_test_doctest_blocks = ''

# -- HTML --------------------------------------------------------------------------------
html_theme = 'alabaster'
html_title = 'mxamp %s' % release
html_theme_options = {
    'description': 'Mixed precision for Apache MXNet 1.9.1',
    'fixed_sidebar': True,
    'page_width': '1100px',
    'sidebar_width': '240px',
}
html_show_sourcelink = False
