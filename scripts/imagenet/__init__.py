"""The parts of ``scripts/train_imagenet.py``, one job each (the script itself is
the user's manual and `main`: it parses, checks, calls `fit.train` and turns
errors into exit statuses).

The map: `options` is the command line (the parser, `check_args`, `UsageError`,
and which options a resumed run must keep: `RESUME_CHECKED`, `RESUME_FIXED`,
`RESUME_FREE`); `spellings` gluoncv's and NVIDIA's spellings of them
(`translate`, and the table of ``--help``); `data` the data set and its
iterators and seeds (`DataSpec`, `train_iter`, `val_iter`, `SyntheticIter`,
`decoding_threads`); `model` the two training paths (`GluonRunner`,
`ModuleRunner`), the learning-rate schedule, the optimizer's and loss scale's
arguments, ``--last-gamma`` and the check of a ``--load`` file; `distributed`
what workers agree on over the kvstore (BatchNorm statistics, the epoch to
resume from, a refusal to resume); `jsonio` valid JSON files and the
``--json-log``; `checkpoints` the checkpoint files (written atomically,
listed, pruned, cleaned up after a kill), the best validation's parameters and
the checkpoint a resume continues from (`resume_point`); `resume` the run's
settings that a checkpoint records and their comparison on resume
(`check_resume_settings`); `report` the metrics CSV, the plot, the summary
line and how the precision computed; `evaluate` validation and ``--mode val``;
`fit` the logging (``train.log`` and the console), the epoch loop and `train`,
whose steps (set-up, resume, one epoch, end of epoch and checkpoint, summary)
are its functions.

Imports run one way, lower to higher, with no circles: `options`, `jsonio`
and `distributed` import no other part; `spellings`, `model` and `data` import
`options`; `checkpoints` imports `options`, `distributed` and `jsonio`;
`resume` imports `options`, `data` and `distributed`; `report` imports
`checkpoints`; `evaluate` imports `data`, `jsonio` and `report`; `fit` imports
all but `spellings`; ``train_imagenet.py`` imports `spellings`, `fit`,
`options` and `report`.  The package is
imported from ``scripts/`` (``train_imagenet.py`` puts it on ``sys.path``, with
the repository root for ``symbols/``).
"""
