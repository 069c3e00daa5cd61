"""Shared test fixtures: the ../shared corpus of real symbol files."""
import csv
import json
import os
import re

import pytest
from hypothesis import settings

# CI must be reproducible: the same examples on every run (a developer's run explores).
settings.register_profile('ci', derandomize=True, deadline=None, print_blob=True)
if os.environ.get('CI'):
    settings.load_profile('ci')

SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', 'shared'))
CORPUS = os.path.join(SHARED, 'corpus', 'symbols')
MANIFEST = os.path.join(CORPUS, 'MANIFEST.tsv')


def corpus_rows():
    """MANIFEST.tsv rows (dicts), or [] when ../shared is absent (a user's clone)."""
    if not os.path.isfile(MANIFEST):
        return []
    with open(MANIFEST, newline='') as handle:
        return list(csv.DictReader(handle, delimiter='\t'))


def input_shapes(row):
    """The manifest's input shapes, with ``"data/0..128"`` ranges expanded."""
    if not row['input_shapes']:
        return None
    shapes = {}
    for name, shape in json.loads(row['input_shapes']).items():
        match = re.match(r'^(.*)/(\d+)\.\.(\d+)$', name)
        if match:
            prefix, first, last = match.group(1), int(match.group(2)), int(match.group(3))
            for i in range(first, last + 1):
                shapes['%s/%d' % (prefix, i)] = tuple(shape)
        else:
            shapes[name] = tuple(shape)
    return shapes


def require_corpus():
    if not os.path.isfile(MANIFEST):
        pytest.skip('the shared symbol corpus (%s) is absent: it lives beside the project '
                    'root in the developers\' workspace, not in a clone' % CORPUS)
