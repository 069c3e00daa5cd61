"""mxamp's own oneDNN 3 kernels: the wing beside the precision rewrite.

Owns the operators (`operators`: the convolution, batch normalisation, pooling,
clip, self-attention products, layer normalisation, softmax with a length, dropout,
fan-out, channel move and master-weight steps, loaded beside MXNet from
``_native/``, built from ``csrc/`` by ``build.py``, switched by
``MXAMP_KERNELS``), the measured choice of where they run, own convolutions
and channels-last regions (`choice`, from ``choice_table.json``), the
channels-last regions of a training graph, found and rewritten
(`channels_last`), transformer blocks' attention, normalisation and softmax with a
length moved onto them (`transformer`), the dropouts of a training graph moved onto
the own one (`dropout`), and the passes that put them into a converted graph
(`passes`).  The core reaches the wing only through `mxamp.passes` and the
optimizer's fast step; mxamp converts and trains without it.
"""
from . import channels_last, choice, dropout, operators, passes, transformer  # noqa: F401
__all__ = ['channels_last', 'choice', 'dropout', 'operators', 'passes', 'transformer']
