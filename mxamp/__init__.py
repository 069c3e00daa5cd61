"""mxamp: mixed-precision training for Apache MXNet 1.9.1 (Gluon and Symbol API).

float16 on NVIDIA GPUs, bfloat16 on CPUs with AVX512-BF16/AMX.  One precision
policy (`mxamp.policy`) and one graph rewrite (`mxamp.graph`) serve the Symbol
front (`convert_symbol`, `convert_model`, the ``mxamp convert`` tool) and the
Gluon front (`convert`); FP32 master weights (`MultiPrecision`), the
loss-scaling `Trainer` (Gluon) and `ModuleTrainer` (``mx.mod.Module``) train
what they produce; `for_inference` (and ``convert_model(..., for_inference=True)``)
fuses a converted network with oneDNN for inference (`mxamp.inference`).
`convert_with_record` also returns the record of every decision, `policy_lists`
shows the policy's operator lists, `profile` measures where a network's step
time goes, layer by layer, and says what to change (`ProfileReport`), and `mxamp.contrib_amp` offers
MXNet ``contrib.amp``'s conversion functions, with its keywords and their meaning.
"""
import importlib
import os

from . import hardware
from ._version import __version__

# Before any oneDNN primitive exists: oneDNN reads its ISA limit once, at the first one.
hardware.enable_amx()

from . import optimizer  # noqa: E402
from .optimizer import MultiPrecision  # noqa: E402

# A dist kvstore server (DMLC_ROLE=server) runs inside `import mxnet`: MXNet 1.9.1
# starts its loop from mxnet/__init__.py, before mxnet.gluon can be imported, and
# never returns.  There this package is imported only to unpickle the optimizer
# (update_on_kvstore=True), which needs mxamp.optimizer alone; importing the
# modules below would fail on mxnet.gluon and leave the server without optimizer.
if os.environ.get('DMLC_ROLE', 'worker') == 'worker':
    from . import diagnose  # noqa: E402
    from .gluon import convert  # noqa: E402
    from .gluon_report import summary  # noqa: E402
    from . import inference  # noqa: E402
    from .inference import for_inference  # noqa: E402
    from .graph import GraphError  # noqa: E402
    from .symbol import ConversionResult, convert_model, convert_symbol, convert_with_record  # noqa: E402
    from . import contrib_amp  # noqa: E402
    from .policy import PolicyLists, policy_lists  # noqa: E402
    from .loss_scaler import LossScaler  # noqa: E402
    from .module import Float32Init, ModuleTrainer  # noqa: E402
    from .trainer import Trainer  # noqa: E402

# Loaded when first used: the profiler, what `mxamp info` reports and the kernel wing
# (which loads its library) cost an import that converting and training do not need.
_LAZY = {'profile': ('profiling', 'profile'), 'ProfileReport': ('profiling', 'ProfileReport'),
         'system_info': ('system_info', None), 'kernels': ('kernels', None),
         'gluonts': ('gluonts', None)}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError('module %r has no attribute %r' % (__name__, name))
    module_name, attribute = _LAZY[name]
    module = importlib.import_module('.' + module_name, __name__)
    return module if attribute is None else getattr(module, attribute)

__all__ = ['convert', 'summary', 'for_inference', 'inference', 'convert_symbol', 'convert_model', 'Trainer', 'ModuleTrainer', 'Float32Init', 'LossScaler', 'MultiPrecision',
           'GraphError', 'diagnose', 'optimizer', 'convert_with_record', 'ConversionResult',
           'policy_lists', 'PolicyLists', 'contrib_amp', 'system_info', 'kernels', 'profile',
           'ProfileReport', '__version__']
