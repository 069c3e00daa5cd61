"""Shared test fixtures: the ../shared corpus of real symbol files, precision warnings."""
import csv
import json
import os
import re
import warnings

import pytest
from hypothesis import settings

# CI must be reproducible: the same examples on every run (a developer's run explores).
settings.register_profile('ci', derandomize=True, deadline=None, print_blob=True)
if os.environ.get('CI'):
    settings.load_profile('ci')

SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), '..', '..', 'shared'))
CORPUS = os.path.join(SHARED, 'corpus', 'symbols')
MANIFEST = os.path.join(CORPUS, 'MANIFEST.tsv')


@pytest.fixture
def quiet_precision_warnings():
    """Silence mxamp's once-per-process notes on what a CPU computes (float16
    emulated, bfloat16 storage-only): modules that convert many nets use it."""
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='mxamp: float16 on a CPU')
        warnings.filterwarnings('ignore', message='mxamp: bfloat16 on this')
        yield


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


def _bf16_skip_reason():
    from mxamp import hardware
    return ('this CPU computes no bfloat16 (%s): the test runs a graph that computes in '
            'bfloat16' % hardware.describe_cpu_class())


def needs_bfloat16_compute(test):
    """Skip `test` (with the CPU class as the reason) where no bfloat16 kernel runs.

    For tests that run graphs computing in bfloat16 (e.g. a convolution's
    zero-channel padding); tests of numerics build their graphs for this CPU
    instead (``cpu_class='auto'``) and run everywhere.
    """
    from mxamp import hardware
    return pytest.mark.skipif(not hardware.computes_bfloat16(), reason=_bf16_skip_reason())(test)


def computes_in(dtype):
    """The precision that `dtype`'s low-precision ops compute in on this machine.

    float16: float16 (GPU kernels; on a CPU the GEMMs are emulated but the graph
    still says float16); bfloat16: bfloat16 on CPUs with bfloat16 kernels, FP32
    elsewhere (bfloat16 storage only).
    """
    from mxamp import hardware
    if dtype == 'bfloat16' and not hardware.computes_bfloat16():
        return 'float32'
    return dtype
