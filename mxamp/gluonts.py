"""GluonTS's MXNet estimators trained with mxamp: `Trainer`, a drop-in for ``gluonts.mx.Trainer``.

A GluonTS user trains through an estimator (``estimator.train(dataset)``), which
builds the training network and hands it to its ``trainer``.  Given this
`Trainer`, the network is converted (`mxamp.convert`, ``'auto'`` by default:
layers too small for bfloat16 to pay stay FP32, docs/policy.rst) before its
first batch and trained by `mxamp.Trainer` (FP32 master weights).  After
training, the network stores its parameters in FP32 (the values trained,
exact): the predictor the estimator builds copies them (``save_parameters``),
shares them (``params=``) or shares trained blocks, which keep computing in
mixed precision, and predicts, serializes and loads as ever.

GluonTS 0.17 internals relied on, here only: ``gluonts.mx.trainer.Trainer.__call__``
makes its optimizer's trainer with ``mx.gluon.Trainer(params, optimizer=...,
kvstore=...)`` (gluonts/mx/trainer/_base.py), looked up at call time, and calls
``loss.backward()`` on the network's first output itself.  Needs ``gluonts``
(``pip install mxamp[gluonts]``).

Example
-------
>>> from gluonts.mx import DeepAREstimator
>>> estimator = DeepAREstimator(freq='H', prediction_length=24,
...                             trainer=mxamp.gluonts.Trainer(epochs=5))  # doctest: +SKIP
>>> predictor = estimator.train(dataset)                                  # doctest: +SKIP
"""
import contextlib
from typing import Any, List, Optional, Union
from unittest import mock

import mxnet as mx

try:
    from gluonts.core.component import validated
    from gluonts.mx.trainer import Trainer as _GluonTSTrainer
    from gluonts.mx.trainer.callback import Callback
except ImportError as err:  # an optional extra: say how to get it, in one line
    raise ImportError('mxamp.gluonts needs GluonTS with MXNet: pip install mxamp[gluonts] (%s)'
                      % err) from None

from . import dtypes
from .gluon import convert, store_in_float32
from .trainer import Trainer as _MixedTrainer

__all__ = ['Trainer']


class Trainer(_GluonTSTrainer):
    """``gluonts.mx.Trainer`` that trains the network in mixed precision.

    Parameters
    ----------
    dtype : str
        As `mxamp.convert`'s: ``'auto'`` (default), ``'bfloat16'`` or ``'float32'``.
        ``'float16'`` is refused: GluonTS calls ``loss.backward()`` itself, so float16's
        loss scaling could not apply.
    exclude : list of str, optional
        As `mxamp.convert`'s: blocks or node names kept in FP32.
    ctx, epochs, num_batches_per_epoch, learning_rate, clip_gradient, weight_decay, init, \
hybridize, callbacks, add_default_callbacks
        GluonTS's, with its meaning and defaults.

    Examples
    --------
    >>> trainer = mxamp.gluonts.Trainer(epochs=2, num_batches_per_epoch=10)
    >>> trainer.dtype
    'auto'
    """

    @validated()
    def __init__(self, dtype: str = 'auto', exclude: Optional[List[str]] = None,
                 ctx: Optional[mx.Context] = None, epochs: int = 100,
                 num_batches_per_epoch: int = 50, learning_rate: float = 1e-3,
                 clip_gradient: float = 10.0, weight_decay: float = 1e-8,
                 init: Union[str, mx.initializer.Initializer] = 'xavier', hybridize: bool = True,
                 callbacks: Optional[List[Callback]] = None,
                 add_default_callbacks: bool = True) -> None:
        name = dtype if dtype == 'auto' else dtypes.dtype_name(dtype)
        if name == 'float16':
            raise ValueError("mxamp.gluonts.Trainer(dtype=%r): GluonTS calls loss.backward() "
                             "itself, so float16's loss scaling cannot apply; use 'auto', "
                             "'bfloat16' or 'float32'" % (dtype,))
        super().__init__(ctx=ctx, epochs=epochs, num_batches_per_epoch=num_batches_per_epoch,
                         learning_rate=learning_rate, clip_gradient=clip_gradient,
                         weight_decay=weight_decay, init=init, hybridize=hybridize,
                         callbacks=callbacks, add_default_callbacks=add_default_callbacks)
        self.dtype = name
        self.exclude = list(exclude) if exclude else None

    def __call__(self, net: mx.gluon.HybridBlock, train_iter: Any,
                 validation_iter: Optional[Any] = None) -> None:
        """Convert `net` (the estimator's training network) and train it as GluonTS does."""
        if self.dtype == 'auto' and self.ctx.device_type == 'gpu':
            raise ValueError("mxamp.gluonts.Trainer(dtype='auto') on a GPU would choose "
                             "float16, whose loss scaling GluonTS's loop cannot apply: pass "
                             "dtype='float32' there")
        convert(net, self.dtype, exclude=self.exclude)
        with _mixed_precision_trainers():
            super().__call__(net, train_iter, validation_iter)
        # Most estimators build the predictor on the trained network's own parameters or
        # blocks (NBEATS, SimpleFeedForward, DeepState: params=...; Transformer: its
        # encoder and decoder), expecting FP32 ones.
        store_in_float32(net)


@contextlib.contextmanager
def _mixed_precision_trainers():
    """``mx.gluon.Trainer`` as `mxamp.Trainer` while GluonTS's loop makes its trainer."""
    def make(params, optimizer, optimizer_params=None, kvstore='device', **kwargs):
        # GluonTS runs its own backward, unscaled: bfloat16 and FP32 need no loss scale.
        return _MixedTrainer(params, optimizer, optimizer_params, kvstore=kvstore,
                             loss_scale=None, **kwargs)
    with mock.patch.object(mx.gluon, 'Trainer', make):
        yield
