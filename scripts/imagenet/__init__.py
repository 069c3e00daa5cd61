"""The parts of ``scripts/train_imagenet.py``, one job each (the script itself is
the user's manual and `main`: it parses, checks, calls `fit.train` and turns
errors into exit statuses).

The map: `options` is the command line (the parser, `check_args`, `UsageError`,
and which options a resumed run must keep: `RESUME_CHECKED`, `RESUME_FIXED`,
`RESUME_FREE`); `data` the data set and its iterators and seeds (`DataSpec`,
`train_iter`, `val_iter`, `SyntheticIter`, `decoding_threads`); `model` the two
training paths (`GluonRunner`, `ModuleRunner`), the learning-rate schedule and
the optimizer's and loss scale's arguments; `distributed` what workers agree on
over the kvstore (BatchNorm statistics, the epoch to resume from, a refusal to
resume); `checkpoints` the checkpoint files (written atomically, listed,
pruned, cleaned up after a kill) and the one a resume continues from
(`resume_point`); `resume` the run's settings that a checkpoint records and
their comparison on resume (`check_resume_settings`); `report` the metrics CSV,
the plot, the summary line and how the precision computed; `fit` the logging
(``train.log`` and the console), validation, the epoch loop and `train`, whose
steps (set-up, resume, one epoch, end of epoch and checkpoint, summary) are its
functions.

Imports run one way, lower to higher, with no circles: `options`, `model` and
`distributed` import no other part; `data` imports `options`; `checkpoints`
imports `options` and `distributed`; `resume` imports `options`, `data` and
`distributed`; `report` imports `checkpoints`; `fit` imports all but `options`;
``train_imagenet.py`` imports `fit`, `options` and `report`.  The package is
imported from ``scripts/`` (``train_imagenet.py`` puts it on ``sys.path``, with
the repository root for ``symbols/``).
"""
