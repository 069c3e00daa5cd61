"""What a run reports: the metrics CSV, the summary line and figures, the plot
(with other runs for ``--compare``), and how its precision computed.
"""
import csv
import json
import math
import os
import resource
import textwrap

import numpy as np

from mxamp import hardware

from .checkpoints import list_checkpoints, paths

# skipped_in_epoch: steps skipped (inf/NaN gradients) in this epoch; skipped_total: since
# the start of the training, across resumes.  loss_scale and lr: at the end of the epoch.
CSV_FIELDS = ('epoch', 'lr', 'train_loss', 'val_top1', 'val_top5', 'img_per_sec', 'epoch_time',
              'loss_scale', 'skipped_in_epoch', 'skipped_total', 'peak_rss_mb')


def peak_rss_mb():
    """Peak resident memory of this process so far, in MiB (Linux: ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def read_metrics(path):
    """Rows of a ``*-metrics.csv`` as dicts of floats (`CSV_FIELDS`; the epoch and
    the skipped-step counts as ints)."""
    with open(path, newline='') as handle:
        rows = [{k: float(v) if v not in ('', None) else float('nan') for k, v in row.items()}
                for row in csv.DictReader(handle)]
    for row in rows:
        for name in ('epoch', 'skipped_in_epoch', 'skipped_total'):
            row[name] = int(row[name])
    return rows


def write_metrics(path, rows):
    """Write the rows atomically (the file is rewritten each epoch: it is small)."""
    tmp = path + '.tmp-%d' % os.getpid()
    with open(tmp, 'w', newline='') as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, '') for k in CSV_FIELDS})
    os.replace(tmp, path)


def steady_img_per_sec(rows):
    """A run's throughput: the median over its epochs' img/s, the first epoch left out
    when there are more (it pays for graph construction and memory planning).  The
    summary's figure and the plot's bar."""
    speeds = [r['img_per_sec'] for r in rows]
    steady = speeds[1:] if len(speeds) > 1 else speeds
    return float(np.median(steady)) if steady else 0.0


def run_label(dtype, compute):
    """What a run's curve is, by its precision: 'FP32', 'bfloat16 (native)', or how an
    emulated precision ran ('bfloat16 storage, FP32 compute')."""
    if dtype == 'float32':
        return 'FP32'
    if compute == 'native':
        return '%s (native)' % dtype
    return compute if compute.startswith(dtype) else '%s (%s)' % (dtype, compute)


def compared_run(csv_path):
    """``(label, rows)`` of another run's ``*-metrics.csv`` for ``--compare``.

    The label names the run (its file prefix) and its precision, read from the
    summary beside the file, or from its newest checkpoint for a run that has not
    finished (which records the dtype, not how it computed).
    """
    directory = os.path.dirname(os.path.abspath(csv_path))
    prefix = os.path.basename(csv_path)[:-len('-metrics.csv')] \
        if csv_path.endswith('-metrics.csv') else os.path.basename(csv_path)
    summary = os.path.join(directory, '%s-summary.json' % prefix)
    precision = 'precision not recorded'
    if os.path.isfile(summary):
        with open(summary) as handle:
            recorded = json.load(handle)
        precision = run_label(recorded['dtype'], recorded['compute'])
    else:
        epochs = list_checkpoints(directory, prefix)   # reads every checkpoint's JSON
        if epochs:
            with open(paths(directory, prefix, epochs[-1])[2]) as handle:
                precision = json.load(handle)['dtype']
    return '%s: %s' % (prefix, precision), read_metrics(csv_path)


def plot_runs(runs, path, title=None, throughput=None):
    """PNG with training loss and validation top-1 per epoch, and throughput per run.

    Parameters
    ----------
    runs : list of (str, list of dict)
        A label and the metric rows (`read_metrics`) of each run.
    path : str
        Output PNG.
    title : str, optional
    throughput : (list of float, str), optional
        The bars' img/s, one per run, and what they are (the panel's title), for
        figures that a table shows beside the plot; by default each run's
        `steady_img_per_sec`, 'median epoch'.

    Returns
    -------
    matplotlib.figure.Figure
        The figure written (already closed).
    """
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, (ax_loss, ax_acc, ax_speed) = plt.subplots(1, 3, figsize=(11, 3.3))
    for label, rows in runs:
        epochs = [r['epoch'] for r in rows]
        ax_loss.plot(epochs, [r['train_loss'] for r in rows], marker='.', label=label)
        ax_acc.plot(epochs, [100 * r['val_top1'] for r in rows], marker='.', label=label)
    labels = [label for label, _ in runs]
    speeds, what = throughput or ([steady_img_per_sec(rows) for _, rows in runs],
                                  'median epoch')
    ax_loss.set(xlabel='epoch', ylabel='training loss', title='loss')
    ax_acc.set(xlabel='epoch', ylabel='top-1 (%)', title='validation accuracy')
    bars = ax_speed.bar(range(len(speeds)), speeds, color=['C%d' % i for i in range(len(speeds))])
    ax_speed.set_xticks(range(len(labels)))
    ax_speed.set_xticklabels([textwrap.fill(label, 20) for label in labels], fontsize=8)
    ax_speed.set(ylabel='img/s', title='training throughput (%s)' % what)
    for bar, value in zip(bars, speeds):
        ax_speed.annotate('%.0f' % value, (bar.get_x() + bar.get_width() / 2, value),
                          ha='center', va='bottom', fontsize=8)
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # epochs, not 1.25, 1.5, ...
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return fig


def describe_precision(dtype, contexts):
    """How `dtype` computes on `contexts`, and why: ``(how, why)``, two phrases.

    `how` is ``'FP32'``, ``'native'``, ``'bfloat16 storage, FP32 compute'``
    (bfloat16 on a CPU without native bfloat16: mxamp stores the parameters in
    bfloat16 and every op computes in FP32) or ``'float16 storage, GEMMs in
    FP32'`` (float16 on a CPU, which has no float16 GEMM).  `why` names the
    device: the CPU class (`mxamp.hardware.describe_cpu_class`) or ``'GPU'``.
    """
    if contexts[0].device_type == 'gpu':
        return ('FP32' if dtype == 'float32' else 'native'), 'GPU'
    why = hardware.describe_cpu_class()
    if dtype == 'bfloat16':
        return ('native' if hardware.computes_bfloat16() else 'bfloat16 storage, FP32 compute'), why
    if dtype == 'float16':
        return 'float16 storage, GEMMs in FP32', why
    return 'FP32', why


def percent(fraction):
    """'12.34%', or '-' where there was no validation (None or NaN)."""
    return '-' if fraction is None or not math.isfinite(fraction) else '%.2f%%' % (100 * fraction)


def format_summary(summary):
    """The line a run ends with: its figures, or with ``--mode val`` the evaluation's."""
    if summary['mode'] == 'val':
        return ('%s %s [%s] (%s): evaluated %s on %d images: top-1 %s, top-5 %s, %.1f img/s'
                % (summary['model'], summary['dtype'], summary['compute'], summary['path'],
                   summary['params'], summary['images'], percent(summary['val_top1']),
                   percent(summary['val_top5']), summary['img_per_sec']))
    return ('%s %s [%s] (%s): top-1 %s, top-5 %s, %.1f img/s, %d skipped steps in all, '
            'loss scale %g, peak RSS %.0f MiB, %.1f s of training'
            % (summary['model'], summary['dtype'], summary['compute'], summary['path'],
               percent(summary['val_top1']), percent(summary['val_top5']),
               summary['img_per_sec'],
               summary['skipped_steps'], summary['loss_scale'], summary['peak_rss_mb'],
               summary['train_time']))
