"""Shared test fixtures: the ../shared corpus of real symbol files, precision warnings,
and a simulated CPU class.

A simulated CPU class
---------------------
What mxamp decides depends on the CPU class (`mxamp.hardware.cpu_class`), and CI
runs on whichever CPU the submitting machine has: code written on an AVX2
machine can break the bfloat16 CPUs unseen (``DNNL_MAX_CPU_ISA`` only lowers a
class).  ``pytest --simulate-cpu-class=avx512_bf16`` (or ``amx``; also the
environment variable ``MXAMP_TEST_CPU_CLASS``) makes mxamp see that class's CPU
flags, as `mxamp.hardware.enable_amx` leaves them on such a machine, for the
whole run: every decision (``'auto'``, the policy, warnings, summaries) is the
one that class takes.  What cannot be simulated is a bfloat16 kernel: on a CPU
without them, a test that fails because oneDNN has no bfloat16 primitive
(`missing_bfloat16_kernel`) is reported as skipped, with the simulated class in
the reason, and everything it checked before that point has been checked.
Tests that must run bfloat16 kernels to mean anything use
`needs_bfloat16_compute`, which asks the real CPU.
"""
import csv
import json
import os
import re
import warnings

import pytest
from hypothesis import settings

from mxamp import hardware

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


@pytest.fixture
def blocked_bfloat16_policy(monkeypatch):
    """On an AMX CPU, convert under the 'avx512_bf16' class's policy.

    For tests of fusion and accuracy on nets with 16-channel convolutions: the
    AMX class runs those in FP32 (mxamp.policy._amx_kernel_takes), which would
    leave these tests nothing in bfloat16 to check.  The 'avx512_bf16' policy
    runs them in bfloat16, and an AMX CPU has every kernel it uses.  Other
    classes keep their own policy.
    """
    if hardware.cpu_class() == hardware.AMX:
        monkeypatch.setattr(hardware, 'cpu_class', lambda: hardware.AVX512_BF16)


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


# --------------------------------------------------------------------------
# CPU classes: the real one, and the simulated one

#: This machine's CPU flags and whether oneDNN computes bfloat16 on it, read before
#: any simulation: what kernels can run.
REAL_CPU_FLAGS = hardware.cpu_flags()
REAL_CPU_CLASS = hardware.cpu_class()
REAL_COMPUTES_BFLOAT16 = hardware.computes_bfloat16()

_AVX512_CORE = frozenset(('avx512f', 'avx512bw', 'avx512vl', 'avx512dq'))
#: The CPU flags (added to the real ones) of each class a run can simulate.
SIMULATED_FLAGS = {
    hardware.AVX512_BF16: _AVX512_CORE | {'avx512_bf16'},
    hardware.AMX: _AVX512_CORE | {'avx512_bf16', 'amx_bf16'},
}
#: The class this run simulates, or None (set by pytest_configure).
SIMULATED_CPU_CLASS = None

# What MXNet 1.9.1 says where oneDNN has no bfloat16 primitive (docs/hardware.rst):
# the errors a simulated class meets when a test runs its graphs.
_MISSING_KERNEL = ('could not create a primitive descriptor', 'Unknown type enum 12',
                   'unknown type for MKLDNN')


def pytest_addoption(parser):
    parser.addoption(
        '--simulate-cpu-class', choices=sorted(SIMULATED_FLAGS),
        default=os.environ.get('MXAMP_TEST_CPU_CLASS') or None,
        help='let mxamp see the CPU flags of this class for the whole run (its decisions, '
             'not its kernels: tests that need bfloat16 kernels this CPU lacks are skipped '
             'with the reason); also MXAMP_TEST_CPU_CLASS')


def pytest_configure(config):
    global SIMULATED_CPU_CLASS
    klass = config.getoption('simulate_cpu_class')
    if klass is None:
        return
    if os.environ.get('DNNL_MAX_CPU_ISA') and hardware.isa_cap() != hardware.AMX:
        raise pytest.UsageError('--simulate-cpu-class=%s with DNNL_MAX_CPU_ISA=%s: the cap '
                                'would lower the simulated class again; unset it'
                                % (klass, os.environ['DNNL_MAX_CPU_ISA']))
    SIMULATED_CPU_CLASS = klass
    read_cpuinfo = hardware.cpu_flags

    def simulated_flags():
        # /proc/cpuinfo as that class's machine shows it (nothing when unreadable).
        found = read_cpuinfo()
        return found | SIMULATED_FLAGS[klass] if found else found
    simulated_flags.cache_clear = read_cpuinfo.cache_clear
    # Module attributes that mxamp.hardware reads at each call (cpu_flags is the
    # one source of flags; _amx_enabled is enable_amx's result).
    hardware.cpu_flags = simulated_flags
    hardware._amx_enabled = klass == hardware.AMX
    if klass == hardware.AMX:
        # What enable_amx sets on an AMX machine; oneDNN ignores a cap above the CPU.
        os.environ['DNNL_MAX_CPU_ISA'] = 'AVX512_CORE_AMX'
    assert hardware.cpu_class() == klass


def pytest_report_header(config):
    if SIMULATED_CPU_CLASS is None:
        return 'mxamp: CPU class %r' % REAL_CPU_CLASS
    return ('mxamp: CPU class %r SIMULATED on a %r CPU (tests that need bfloat16 kernels it '
            'lacks are skipped)' % (SIMULATED_CPU_CLASS, REAL_CPU_CLASS))


def missing_bfloat16_kernel(error):
    """Whether `error` (or an exception it was raised from) is oneDNN lacking a bfloat16 primitive."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(text in str(error) for text in _MISSING_KERNEL):
            return True
        error = error.__cause__ or error.__context__
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (SIMULATED_CPU_CLASS is not None and not REAL_COMPUTES_BFLOAT16 and report.failed
            and call.excinfo is not None and missing_bfloat16_kernel(call.excinfo.value)):
        report.outcome = 'skipped'
        report.longrepr = (str(item.path), item.location[1] or 0,
                           'Skipped: simulated CPU class %r: needs bfloat16 kernels, which this '
                           '%r CPU lacks (%s)' % (SIMULATED_CPU_CLASS, REAL_CPU_CLASS,
                                                  _first_line(call.excinfo.value)))


@pytest.fixture(autouse=True)
def _drain_missing_kernel_errors():
    """Under a simulated class, end each test with MXNet's queue drained.

    MXNet raises an operator's error at the next sync, which can be in the next
    test: a kernel missing in one test must be that test's skip, not another's.
    """
    yield
    if SIMULATED_CPU_CLASS is not None and not REAL_COMPUTES_BFLOAT16:
        import mxnet as mx
        try:
            mx.nd.waitall()
        except mx.base.MXNetError as error:
            if not missing_bfloat16_kernel(error):
                raise


def _first_line(error):
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0][:160] if lines else type(error).__name__


def _bf16_skip_reason():
    return ('this CPU computes no bfloat16 (%r class): the test runs a graph that computes in '
            'bfloat16' % REAL_CPU_CLASS)


def needs_bfloat16_compute(test):
    """Skip `test` (with the CPU class as the reason) where no bfloat16 kernel runs.

    For tests that run graphs computing in bfloat16 (e.g. a convolution's
    zero-channel padding); tests of numerics build their graphs for this CPU
    instead (``cpu_class='auto'``) and run everywhere.
    """
    return pytest.mark.skipif(not REAL_COMPUTES_BFLOAT16, reason=_bf16_skip_reason())(test)


def computes_in(dtype):
    """The precision that `dtype`'s low-precision ops compute in on this machine.

    float16: float16 (GPU kernels; on a CPU the GEMMs are emulated but the graph
    still says float16); bfloat16: bfloat16 on CPUs with bfloat16 kernels, FP32
    elsewhere (bfloat16 storage only): what mxamp decides, so the simulated
    class where a run simulates one.
    """
    if dtype == 'bfloat16' and not hardware.computes_bfloat16():
        return 'float32'
    return dtype


@pytest.fixture(scope='session')
def digits_dir(tmp_path_factory):
    """scikit-learn's digits packed as RecordIO (scripts/digits_rec.py), once per run."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    'scripts'))
    import digits_rec
    directory = str(tmp_path_factory.mktemp('digits'))
    digits_rec.prepare(directory)
    return directory


@pytest.fixture
def model(tmp_path):
    """The prefix of a saved checkpoint of test_graph's small CNN (input 'data', N,16,8,8)."""
    import mxnet as mx
    from test_graph import params_of, small_cnn
    symbol = small_cnn()
    args, auxs = params_of(symbol)
    prefix = str(tmp_path / 'cnn')
    mx.model.save_checkpoint(prefix, 0, symbol, args, auxs)
    return prefix


def run_python(code, **environment):
    """Runs `code` in a fresh Python with `environment` added to this one's; its standard
    output (the test fails with the end of its standard error if it exits non-zero)."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, **environment))
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def region_verdicts_table(path, faster):
    """Write a table (`mxamp.kernels.choice.ChoiceTable`) at `path` holding only a verdict on
    channels-last regions for every CPU class: measured `faster` or not; returns the path.

    Pointed at by ``MXAMP_KERNELS_TABLE``, it turns regions on or off while the
    convolutions stay on the measured choice (what ``MXAMP_KERNELS=all`` or ``0``
    would change too).  Every class, so that a child process, which sees the real
    CPU class and not a simulated one, reads the same verdict.
    """
    from mxamp.kernels.choice import ChoiceTable, RegionVerdict
    return ChoiceTable(regions=[RegionVerdict(klass, faster) for klass in hardware.CPU_CLASSES]
                       ).write(str(path))


@pytest.fixture
def regions_measured(monkeypatch, tmp_path):
    """``regions_measured(True)``: channels-last regions chosen on any CPU class (where bfloat16
    computes), ``regions_measured(False)``: none, each through a table of the user's own
    (`region_verdicts_table`); convolutions stay measured."""
    def measured(faster):
        path = tmp_path / ('regions-%s.json' % ('faster' if faster else 'slower'))
        monkeypatch.setenv('MXAMP_KERNELS_TABLE', region_verdicts_table(path, faster))
    return measured


def pattern_task(seed=0):
    """A task a small ResNet learns in 30 steps: 8 batches of 16 noisy copies of 10 patterns.

    Returns (batches (8, 16, 3, 16, 16), labels (8, 16) as NDArrays, classes as numpy).
    """
    import mxnet as mx
    import numpy as np
    rng = np.random.RandomState(seed)
    patterns = rng.uniform(-1, 1, size=(10, 3, 16, 16))
    classes = rng.randint(0, 10, size=(8, 16))
    batches = mx.nd.array(patterns[classes] + rng.normal(0, 0.5, size=(8, 16, 3, 16, 16)))
    return batches, mx.nd.array(classes), classes


def convert_quietly(net, dtype='bfloat16'):
    """mxamp.convert without its once-per-process notes (float16 or bfloat16 on this CPU)."""
    import mxamp
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return mxamp.convert(net, dtype)


def relative_error(got, want):
    """The largest difference of two arrays, relative to the largest magnitude of `want`."""
    import numpy as np
    return float(np.abs(got - want).max() / np.abs(want).max())


def first_gradients(net, batch, label):
    """The gradients (float32 numpy) of `net`'s trainable parameters after one backward pass
    of the softmax cross-entropy of `batch` against `label`."""
    from mxnet import autograd, gluon
    from mxamp.dtypes import to_float32_numpy
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(batch), label)
    loss.backward()
    return [to_float32_numpy(p.grad()) for p in net.collect_params().values() if p.grad_req != 'null']


def median_error(gradients, reference):
    """The median over parameters of each gradient's relative error against `reference`'s."""
    import numpy as np
    return float(np.median([np.linalg.norm(got - want) / np.linalg.norm(want)
                            for got, want in zip(gradients, reference)]))


def loss_curve(net, batches, labels, steps=30):
    """The loss of each of `steps` SGD steps (momentum 0.9, learning rate 0.02) of `net`."""
    import numpy as np
    from mxnet import autograd, gluon
    import mxamp
    trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.02, 'momentum': 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    curve = []
    for step in range(steps):
        x, y = batches[step % len(batches)], labels[step % len(labels)]
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        curve.append(loss.mean().asscalar())
    return np.array(curve)
