"""scripts/train_imagenet.py speaks gluoncv's and NVIDIA's language, and writes what
other tools read.

Options are matched whole (no argparse abbreviations, here and in ``mxamp``);
the spellings of gluoncv's and NVIDIA's ImageNet scripts are read with their
meaning or refused with one line naming this script's; what those users rely
on works (``--mode val``, ``--load``, the best checkpoint, ``--mixup``,
``--last-gamma``, ``--warmup-lr``, ``--lr-mode poly``); every JSON file is
valid JSON and ``--json-log`` writes dllogger's records as JSON lines; the
default ``--save-dir`` is ``runs/<prefix>``, git-ignored.  Training runs use the
digits (tiny networks, one or two epochs of one or two batches), in this
process through ``train_imagenet.main``.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, 'scripts')
sys.path.insert(0, SCRIPTS)

import train_imagenet  # noqa: E402
from imagenet import checkpoints, data, model, options, spellings  # noqa: E402
from mxamp import cli  # noqa: E402

ERROR = 'train_imagenet.py: error: '


def _strict(text):
    """JSON as a strict reader takes it: a bare NaN or Infinity is an error."""
    def reject(constant):
        raise ValueError('not JSON: %s' % constant)
    return json.loads(text, parse_constant=reject)


def _read(path):
    with open(str(path)) as handle:
        return _strict(handle.read())


def _parse(argv):
    """`argv` as train_imagenet.main reads it: translated, parsed, checked."""
    words, _ = spellings.translate(argv)
    args = options.build_parser().parse_args(words)
    options.check_args(args)
    return args


def _digits(digits_dir, save_dir, *extra):
    return ['--dataset', 'digits', '--data-dir', digits_dir, '--save-dir', str(save_dir),
            '--model', 'cifar_resnet20_v1', '--dtype', 'float32', '--batch-size', '32',
            '--lr', '0.1', '--warmup-epochs', '1', '--num-epochs', '1', '--max-batches', '1',
            '--no-progress', '--save-prefix', 'm'] + list(extra)


def _errors(err):
    return [line[len(ERROR):] for line in err.splitlines() if line.startswith(ERROR)]


# --------------------------------------------------------------------------------------
# Options are matched whole

def test_gluoncvs_mode_hybrid_is_not_read_as_model(digits_dir):
    args = _parse(['--mode', 'hybrid', '--dataset', 'digits'])
    assert (args.mode, args.model) == ('train_val', 'resnet50_v1b')
    with pytest.raises(options.UsageError, match='unrecognized arguments: --mod resnet18_v1b'):
        _parse(['--mod', 'resnet18_v1b'])
    with pytest.raises(options.UsageError, match='unrecognized arguments: --momen 0.9'):
        _parse(['--momen', '0.9'])


def test_mxamp_convert_takes_no_abbreviations(model, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(['convert', model + '-symbol.json', '-o', str(tmp_path / 'out'), '--dtype',
                  'bfloat16', '--par', model + '-0000.params'])
    assert exited.value.code == 2
    assert 'unrecognized arguments: --par' in capsys.readouterr().err
    assert not [name for name in os.listdir(str(tmp_path)) if name.startswith('out')]


# --------------------------------------------------------------------------------------
# Other tools' spellings: read with their meaning

SAME = [
    (['--rec-train', 't.rec', '--rec-val', 'v.rec'], ['--data-train', 't.rec', '--data-val',
                                                      'v.rec']),
    (['--rec-train-idx', 't.idx', '--rec-val-idx', 'v.idx'],
     ['--data-train-idx', 't.idx', '--data-val-idx', 'v.idx']),
    (['--data-root', '/d/'], ['--data-train', '/d/train.rec', '--data-val', '/d/val.rec']),
    (['-j', '8'], ['--data-nthreads', '8']),
    (['-j8'], ['--data-nthreads', '8']),
    (['--num-data-workers=8'], ['--data-nthreads', '8']),
    (['--data-mxnet-threads', '8'], ['--data-nthreads', '8']),
    (['--num-training-samples', '5000'], ['--num-examples', '5000']),
    (['--input-size', '128'], ['--image-shape', '3,128,128']),
    (['--use-rec', '--data-backend', 'mxnet', '--crop-ratio', '0.875'], []),
    (['--data-backend', 'synthetic'], ['--synthetic']),
    (['--lr-decay-period', '0'], []),
    (['--mode', 'hybrid'], ['--mode', 'train_val']),
    (['--mode', 'val'], ['--mode', 'val']),
    (['--amp'], ['--dtype', 'auto']),
    (['--dtype', 'float32', '--amp'], ['--dtype', 'auto']),
    (['--amp', '--dtype', 'float32'], ['--dtype', 'auto']),
    (['--amp', '--dtype', 'bfloat16'], ['--dtype', 'bfloat16']),
    (['--resume-params', __file__], ['--load', __file__]),
    (['--lr-schedule', 'multistep'], ['--lr-mode', 'step']),
    (['--lr-factor', '0.256'], ['--lr-decay', '0.256']),
    (['--mom', '0.9'], ['--momentum', '0.9']),
    (['-n', '2', '-b', '64', '-e', '3'], ['--num-gpus', '2', '--batch-size', '64',
                                          '--num-epochs', '3']),
    (['--benchmark-iters', '5'], ['--max-batches', '5']),
    (['--disp-batches', '5'], ['--log-interval', '5']),
    (['--model-prefix', 'r50'], ['--save-prefix', 'r50']),
    (['--workspace', 'out'], ['--save-dir', 'out']),
    (['--log', 'x.log'], ['--logging-file', 'x.log']),
    (['--dllogger-log', 'dl.json'], ['--json-log', 'dl.json']),
    (['--label-smoothing'], ['--label-smoothing', '0.1']),
    (['--mixup'], ['--mixup', '0.2']),
    (['--mixup', '--mixup-alpha', '0.4'], ['--mixup', '0.4']),
    (['--mixup', '0'], []),
]


@pytest.mark.parametrize('theirs, ours', SAME, ids=[' '.join(t).replace(__file__, 'FILE') for t, _ in SAME])
def test_their_spelling_means_ours(theirs, ours):
    common = ['--dataset', 'digits']
    mine, yours = vars(_parse(common + ours)), vars(_parse(common + theirs))
    assert {k: v for k, v in yours.items() if yours[k] != mine[k]} == {}


def test_a_bare_double_dash_ends_the_translation():
    assert spellings.translate(['--rec-train', 'a', '--', '--rec-val', 'b']) == (
        ['--data-train', 'a', '--', '--rec-val', 'b'], ['--rec-train a (gluoncv): --data-train a'])


REFUSED = [
    (['--resume-states', 's'], '--resume-states s: the checkpoints in --save-dir hold the '
                               'optimizer state with the parameters: --resume-epoch E'),
    (['--begin-epoch', '3'], '--begin-epoch 3: --resume-epoch E continues'),
    (['--run-epochs', '3'], '--run-epochs 3: --stop-at-epoch N ends this run'),
    (['--lr-steps', '30,60'], '--lr-steps 30,60: --lr-decay-epoch E,E,... with --lr-mode step'),
    (['--lr-decay-period', '10'], '--lr-decay-period 10: name the epochs instead: '
                                  '--lr-decay-epoch 10,20,...'),
    (['--arch', 'resnetv15'], '--arch resnetv15: name the network: --model resnet50_v1b'),
    (['--use-pretrained'], '--use-pretrained: give the parameters as a file: --load FILE'),
    (['--use_se'], '--use_se: name the model variant with --model'),
    (['--teacher', 'resnet152_v1d'], '--teacher resnet152_v1d: distillation is not'),
    (['-l', '0.256'], "-l 0.256: the runner's learning rate per 256 images: --lr is the peak"),
    (['--data-backend', 'dali-gpu'], "--data-backend dali-gpu: this script reads RecordIO with "
                                     "MXNet's ImageRecordIter only (--data-backend mxnet)"),
    (['--crop-ratio', '0.9'], '--crop-ratio 0.9: validation here always resizes'),
    (['--mode', 'imperative'], "--mode imperative: gluoncv's imperative mode does not exist "
                               'here: the converted network always runs as a graph (--mode '
                               'hybrid)'),
    (['--mode', 'symbolic'], "--mode symbolic: gluoncv's symbolic mode does not exist here: "
                             "the Symbol API's network is --symbol resnet"),
    (['--mode', 'pred'], "--mode pred: NVIDIA's single-image prediction is not in this script"),
    (['--kv-store', 'horovod'], '--kv-store horovod: Horovod is not supported'),
    (['--input-size', 'large'], "argument --input-size: invalid int value: 'large'"),
    (['--rec-train'], 'argument --rec-train: expected one argument'),
    (['--use-rec=yes'], "argument --use-rec: ignored explicit argument 'yes'"),
]


@pytest.mark.parametrize('argv, message', REFUSED, ids=[' '.join(a) for a, _ in REFUSED])
def test_a_spelling_with_another_meaning_is_refused_in_one_line(tmp_path, capsys, argv,
                                                                message):
    assert train_imagenet.main(['--dataset', 'digits', '--save-dir', str(tmp_path)] + argv) == 2
    err = capsys.readouterr().err
    errors = _errors(err)
    assert len(errors) == 1 and errors[0].startswith(message), err
    assert 'Traceback' not in err and not os.listdir(str(tmp_path))


def test_help_states_every_spelling(capsys):
    with pytest.raises(SystemExit):
        train_imagenet.main(['--help'])
    text = capsys.readouterr().out
    table = text[text.index("Spellings of gluoncv's and NVIDIA's"):]
    for spelling in spellings.SPELLINGS:
        for flag in spelling.flags:
            assert '  %s' % flag in table or ', %s' % flag in table, flag
    for ours in ('--mode {train_val,train,val}', '--label-smoothing [EPS]', '--mixup [ALPHA]',
                 'poly (power 2', '--json-log PATH', 'runs/<prefix>', '--warmup-lr LR',
                 '--last-gamma', '--load PARAMS', '<prefix>-best.params'):
        assert ours in text, ours


# --------------------------------------------------------------------------------------
# Commands written as gluoncv's and NVIDIA's documentation writes them

def test_a_gluoncv_command_runs(digits_dir, tmp_path):
    save = tmp_path / 'params_cifar'
    argv = ['--rec-train', os.path.join(digits_dir, 'train.rec'),
            '--rec-train-idx', os.path.join(digits_dir, 'train.idx'),
            '--rec-val', os.path.join(digits_dir, 'val.rec'),
            '--rec-val-idx', os.path.join(digits_dir, 'val.idx'), '--use-rec',
            '--dataset', 'digits', '--model', 'cifar_resnet20_v1', '--mode', 'hybrid',
            '--lr', '0.1', '--lr-mode', 'poly', '--num-epochs', '1', '--batch-size', '32',
            '-j', '1', '--warmup-epochs', '1', '--dtype', 'float32', '--last-gamma', '--no-wd',
            '--label-smoothing', '--mixup', '--save-dir', str(save), '--logging-file',
            str(tmp_path / 'cifar.log'), '--max-batches', '1', '--no-progress']
    assert train_imagenet.main(argv) == 0
    settings = _read(save / 'cifar_resnet20_v1-0001.json')['settings']
    assert settings['--data-train'] == '%s (1500 images)' % os.path.join(digits_dir,
                                                                         'train.rec')
    assert (settings['--lr-mode'], settings['--last-gamma'], settings['--mixup'],
            settings['--mixup-alpha'], settings['--label-smoothing']) == ('poly', True, True,
                                                                          0.2, 0.1)
    log = (tmp_path / 'cifar.log').read_text()
    assert 'read as this script spells it: --rec-train %s' % digits_dir in log
    assert 'epoch 1/1: loss' in log and not (save / 'train.log').exists()


def test_an_nvidia_command_runs(digits_dir, tmp_path):
    work = tmp_path / 'workspace'
    argv = ['--data-train', os.path.join(digits_dir, 'train.rec'),
            '--data-train-idx', os.path.join(digits_dir, 'train.idx'),
            '--data-val', os.path.join(digits_dir, 'val.rec'),
            '--data-val-idx', os.path.join(digits_dir, 'val.idx'), '--dataset', 'digits',
            '--model', 'cifar_resnet20_v1', '-b', '32', '-e', '1', '--lr', '0.1',
            '--lr-schedule', 'cosine', '--warmup-epochs', '1', '--mom', '0.875', '--wd',
            '3.0517578125e-05', '--label-smoothing', '0.1', '--mixup', '0.2', '--amp',
            '--mode', 'train_val', '--seed', '1', '--benchmark-iters', '1', '--workspace',
            str(work), '--model-prefix', 'model', '--dllogger-log', str(tmp_path / 'dl.json'),
            '--data-mxnet-threads', '1', '--no-progress']
    assert train_imagenet.main(argv) == 0
    settings = _read(work / 'model-0001.json')['settings']
    assert (settings['--momentum'], settings['--mixup'], settings['--mixup-alpha'],
            settings['--max-batches']) == (0.875, True, 0.2, 1)
    steps = [record['step'] for record in map(_strict, open(tmp_path / 'dl.json'))
             if record['type'] == 'LOG']
    assert steps == ['PARAMETER', [0, 0], [0], []]


# --------------------------------------------------------------------------------------
# --mode val, --load, the best checkpoint

def test_mode_val_evaluates_a_saved_model_without_training(digits_dir, tmp_path, capsys):
    assert train_imagenet.main(_digits(digits_dir, tmp_path / 'run', '--max-batches', '2')) == 0
    row = _read(tmp_path / 'run' / 'm-0001.json')['metrics']
    capsys.readouterr()
    before = os.listdir(str(tmp_path / 'run'))
    best = str(tmp_path / 'run' / 'm-best.params')
    # NVIDIA's: the params file named; here on the same validation batches as the run's.
    assert train_imagenet.main(_digits(digits_dir, tmp_path / 'eval', '--mode', 'val',
                                       '--load', best, '--max-batches', '2',
                                       '--json-log', str(tmp_path / 'eval.jsonl'))) == 0
    out = capsys.readouterr().out
    result = _read(tmp_path / 'eval' / 'm-eval.json')
    assert (result['val_top1'], result['val_top5']) == (row['val_top1'], row['val_top5'])
    assert result['params'] == best and result['images'] == 64
    assert 'evaluated %s on 64 images: top-1 %.2f%%' % (best, 100 * row['val_top1']) in out
    assert not [n for n in os.listdir(str(tmp_path / 'eval')) if n.endswith(('.csv', '.states'))]
    last = [_strict(line) for line in open(tmp_path / 'eval.jsonl')][-1]
    assert last['step'] == [] and last['data']['val.accuracy'] == row['val_top1']
    # Without --load: the newest checkpoint of --save-dir; nothing of the run changes.
    assert train_imagenet.main(_digits(digits_dir, tmp_path / 'run', '--mode', 'val',
                                       '--max-batches', '2')) == 0
    assert _read(tmp_path / 'run' / 'm-eval.json')['params'].endswith('m-0001.params')
    assert sorted(os.listdir(str(tmp_path / 'run'))) == sorted(before + ['m-eval.json'])


@pytest.mark.parametrize('argv, message', [
    (['--mode', 'val'], '--mode val: no checkpoint of m in '),
    (['--mode', 'val', '--resume'], '--mode val evaluates, it does not train: not with --resume'),
    (['--mode', 'val', '--synthetic'], '--mode val evaluates on --data-val: not with '
                                       '--synthetic'),
], ids=['nothing-to-evaluate', 'resume', 'synthetic'])
def test_mode_val_refusals(digits_dir, tmp_path, capsys, argv, message):
    assert train_imagenet.main(_digits(digits_dir, tmp_path, *argv)) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_load_starts_training_from_a_params_file(digits_dir, tmp_path):
    import mxnet as mx
    assert train_imagenet.main(_digits(digits_dir, tmp_path / 'a')) == 0
    start = str(tmp_path / 'a' / 'm-0001.params')
    # A learning rate of 0: only BatchNorm's running statistics move.
    assert train_imagenet.main(_digits(digits_dir, tmp_path / 'b', '--load', start, '--lr', '0',
                                       '--momentum', '0')) == 0
    loaded, trained = mx.nd.load(start), mx.nd.load(str(tmp_path / 'b' / 'm-0001.params'))
    fixed = [name for name in loaded if not name.endswith(('running_mean', 'running_var'))]
    assert len(fixed) > 50
    assert all((loaded[n].asnumpy() == trained[n].asnumpy()).all() for n in fixed)
    assert _read(tmp_path / 'b' / 'm-0001.json')['initial_params'] == start


@pytest.mark.parametrize('network, extra, message', [
    (['--model', 'resnet18_v1b'], [], 'holds none of the parameters of this network (it has '
                                      'features.0.weight, '),
    (['--symbol', 'resnet', '--num-layers', '18'], [], 'holds none of the parameters of this '
                                                       'network'),
    (['--model', 'cifar_resnet20_v1'], ['--num-classes', '5'],
     'parameter output.bias has the shape (10,) there, the network needs (5,)'),
], ids=['other-network', 'symbol', 'other-shape'])
def test_a_params_file_that_does_not_fit_is_one_line(digits_dir, tmp_path, capsys, network,
                                                     extra, message):
    assert train_imagenet.main(_digits(digits_dir, tmp_path / 'a')) == 0
    start = str(tmp_path / 'a' / 'm-0001.params')
    capsys.readouterr()
    assert train_imagenet.main(_digits(digits_dir, tmp_path / 'b', '--load', start, *network
                                       + extra)) == 2
    err = capsys.readouterr().err
    errors = _errors(err)
    assert errors == [errors[0]] and errors[0].startswith('--load %s: %s' % (start, message)), err
    assert 'Traceback' not in err


def test_load_with_a_resume_is_refused(digits_dir, tmp_path, capsys):
    (tmp_path / 'x.params').write_bytes(b'')
    assert train_imagenet.main(_digits(digits_dir, tmp_path, '--load', str(tmp_path / 'x.params'),
                                       '--resume')) == 2
    assert _errors(capsys.readouterr().err)[0].startswith(
        '--load starts a new run from a parameter file, --resume and --resume-epoch continue')


def test_the_best_validation_is_kept_beside_the_checkpoints(digits_dir, tmp_path):
    assert train_imagenet.main(_digits(digits_dir, tmp_path, '--num-epochs', '3',
                                       '--max-batches', '2', '--lr', '0.5')) == 0
    tops = [_read(tmp_path / ('m-%04d.json' % e))['metrics']['val_top1'] for e in (1, 2, 3)]
    epoch = tops.index(max(tops)) + 1
    best = _read(tmp_path / 'm-best.json')
    assert (best['epoch'], best['val_top1'], best['params']) == (epoch, max(tops), 'm-best.params')
    assert (tmp_path / 'm-best.params').read_bytes() == \
        (tmp_path / ('m-%04d.params' % epoch)).read_bytes()
    assert checkpoints.list_checkpoints(str(tmp_path), 'm') == [1, 2, 3]


def test_mode_train_skips_validation(digits_dir, tmp_path):
    assert train_imagenet.main(_digits(digits_dir, tmp_path, '--mode', 'train')) == 0
    assert _read(tmp_path / 'm-summary.json')['val_top1'] is None
    assert not (tmp_path / 'm-best.params').exists()


# --------------------------------------------------------------------------------------
# --mixup, --last-gamma, --warmup-lr, --lr-mode poly

def _gluon_runner(digits_dir, *argv):
    import mxnet as mx
    args = _parse(['--dataset', 'digits', '--data-dir', digits_dir, '--dtype', 'float32']
                  + list(argv))
    spec = data.resolve_data(args)
    data.seed_everything(0)
    return model.GluonRunner(args, spec, [mx.cpu()], 'float32', None, 4, 4, 0.1, 1)


def test_mixup_mixes_each_batch_with_itself_reversed(digits_dir):
    import mxnet as mx
    runner = _gluon_runner(digits_dir, '--model', 'cifar_resnet20_v1', '--mixup')
    seen = {}
    net, loss_fn = runner.net, runner.loss_fn

    def record_net(x):
        seen['x'] = x.asnumpy()
        return net(x)

    def record_loss(output, target):
        seen['target'] = target.asnumpy()
        return loss_fn(output, target)
    runner.net, runner.loss_fn = record_net, record_loss
    images = np.random.RandomState(0).uniform(size=(4, 1, 8, 8)).astype(np.float32)
    labels = np.array([0, 1, 2, 3], dtype=np.float32)
    runner.train_batch(mx.io.DataBatch([mx.nd.array(images)], [mx.nd.array(labels)]), 0.3)
    np.testing.assert_allclose(seen['x'], 0.3 * images + 0.7 * images[::-1], rtol=1e-5)
    smooth = np.full((4, 10), 0.01, dtype=np.float32)
    smooth[np.arange(4), labels.astype(int)] = 0.91
    np.testing.assert_allclose(seen['target'], 0.3 * smooth + 0.7 * smooth[::-1], rtol=1e-5)


def test_mixup_is_off_in_the_last_mixup_off_epochs(digits_dir, tmp_path, monkeypatch):
    weights = []
    train_batch = model.GluonRunner.train_batch

    def record(self, batch, mixup=None):
        weights.append(mixup)
        return train_batch(self, batch, mixup)
    monkeypatch.setattr(model.GluonRunner, 'train_batch', record)
    assert train_imagenet.main(_digits(digits_dir, tmp_path, '--num-epochs', '2', '--mixup',
                                       '0.4', '--mixup-off-epoch', '1')) == 0
    assert len(weights) == 2 and 0 < weights[0] < 1 and weights[1] is None
    settings = _read(tmp_path / 'm-0002.json')['settings']
    assert (settings['--mixup'], settings['--mixup-alpha'], settings['--mixup-off-epoch']) == \
        (True, 0.4, 1)


@pytest.mark.parametrize('argv, message', [
    (['--mixup-alpha', '0.3'], '--mixup-alpha 0.3 without --mixup: mixup is off'),
    (['--mixup', '0.3', '--mixup-alpha', '0.2'], '--mixup 0.3 and --mixup-alpha 0.2: give the '
                                                 'alpha once'),
    (['--mixup', '--symbol', 'resnet'], '--mixup: the Gluon path only'),
    (['--mixup', '--mixup-off-epoch', '3'], '--mixup-off-epoch must lie in [0, --num-epochs]'),
    (['--warmup-lr', '0.5'], '--warmup-lr 0.5 exceeds --lr 0.1'),
], ids=['alpha-alone', 'alpha-twice', 'symbol', 'off-epochs', 'warmup-lr'])
def test_mixup_and_warmup_refusals(digits_dir, tmp_path, capsys, argv, message):
    assert train_imagenet.main(_digits(digits_dir, tmp_path, *argv)) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith(message), errors


def _gammas(net):
    """Every BatchNorm gamma of `net` by its structural name ('layer1.0.bn2.gamma')."""
    return {name: param.data().asnumpy()
            for name, param in net._collect_params_with_prefix().items()
            if name.endswith('gamma')}


# The residual blocks of each network and the last BatchNorm of their branch (gluoncv's
# ResNet-18 v1b ignores its own last_gamma option: its basic blocks take no such argument).
BRANCH_END = {'resnet18_v1b': ('BasicBlockV1b', 8, lambda block: block.bn2),
              'resnet50_v1b': ('BottleneckV1b', 16, lambda block: block.bn3),
              'cifar_resnet20_v1': ('CIFARBasicBlockV1', 9, lambda block: block.body[4])}


@pytest.mark.parametrize('network', sorted(BRANCH_END))
def test_last_gamma_zeroes_the_last_norm_of_each_residual_branch(digits_dir, network):
    kind, count, branch_end = BRANCH_END[network]
    plain = _gammas(_gluon_runner(digits_dir, '--model', network).net)
    runner = _gluon_runner(digits_dir, '--model', network, '--last-gamma')
    blocks = [b for b in model._blocks(runner.net) if type(b).__name__ == kind]
    structural = {id(p): name for name, p in runner.net._collect_params_with_prefix().items()}
    last = {structural[id(branch_end(block).gamma)] for block in blocks}
    assert len(blocks) == len(last) == count
    for name, gamma in _gammas(runner.net).items():
        assert (gamma == (0 if name in last else 1)).all(), name
        assert (plain[name] == 1).all(), name


def test_last_gamma_needs_residual_blocks(digits_dir):
    with pytest.raises(options.UsageError, match='--last-gamma: mobilenet0.25 has no residual'):
        _gluon_runner(digits_dir, '--model', 'mobilenet0.25', '--last-gamma')


def test_last_gamma_on_the_symbol_path(digits_dir):
    import mxnet as mx
    args = _parse(['--dataset', 'digits', '--data-dir', digits_dir, '--symbol', 'resnet',
                   '--num-layers', '18', '--last-gamma'])
    runner = model.ModuleRunner(args, data.resolve_data(args), [mx.cpu()], 'float32', None, 4,
                                4, 0.1, 1)
    gammas = {n: v.asnumpy() for n, v in runner.mod.get_params()[0].items()
              if n.endswith('_gamma')}
    zeroed = sorted(n for n, v in gammas.items() if (v == 0).all())
    assert zeroed == ['stage%d_unit%d_bn2_gamma' % (s, u) for s in (1, 2, 3, 4) for u in (1, 2)]
    assert all((v == 1).all() for n, v in gammas.items() if n not in zeroed)


def test_warmup_rises_from_warmup_lr_and_poly_decays_as_gluoncvs():
    args = options.build_parser().parse_args(['--lr-mode', 'poly', '--warmup-epochs', '1',
                                              '--warmup-lr', '0.01', '--num-epochs', '3'])
    schedule = model.lr_scheduler(args, 0.4, 10)
    assert schedule(0) == pytest.approx(0.01)
    assert schedule(5) == pytest.approx(0.01 + (0.4 - 0.01) * 0.5)
    assert schedule(10) == pytest.approx(0.4)
    for step in (15, 20, 25, 30):      # (1 - progress after the warm-up) ** 2
        assert schedule(step) == pytest.approx(0.4 * (1 - (step - 10) / 20.0) ** 2)
    cosine = model.lr_scheduler(options.build_parser().parse_args(['--warmup-lr', '0.01']),
                                0.4, 10)
    assert cosine(0) == pytest.approx(0.01)


# --------------------------------------------------------------------------------------
# Settings added since a checkpoint was written

# --------------------------------------------------------------------------------------
# What other tools read: valid JSON, --json-log, the default --save-dir

def test_summary_and_checkpoint_json_are_valid_without_validation(digits_dir, tmp_path):
    assert train_imagenet.main(['--synthetic', '--dataset', 'digits', '--model',
                                'cifar_resnet20_v1', '--dtype', 'float32', '--batch-size', '8',
                                '--max-batches', '1', '--num-epochs', '1', '--no-progress',
                                '--save-dir', str(tmp_path), '--save-prefix', 'm']) == 0
    summary = _read(tmp_path / 'm-summary.json')
    assert summary['val_top1'] is None and summary['val_top5'] is None
    metrics = _read(tmp_path / 'm-0001.json')['metrics']
    assert metrics['val_top1'] is None and metrics['train_loss'] > 0


def test_json_log_has_dlloggers_records_one_per_line(digits_dir, tmp_path):
    log = tmp_path / 'log.jsonl'
    argv = _digits(digits_dir, tmp_path / 'run', '--num-epochs', '2', '--max-batches', '2',
                   '--log-interval', '1', '--json-log', str(log))
    assert train_imagenet.main(argv + ['--stop-at-epoch', '1']) == 0
    assert train_imagenet.main(argv + ['--resume']) == 0     # appends
    records = [_strict(line) for line in log.read_text().splitlines()]
    assert all(set(r) >= {'timestamp', 'datetime', 'elapsedtime', 'type'} for r in records)
    assert [r['timestamp'] for r in records] == sorted(r['timestamp'] for r in records)
    units = {r['metric']: r['metadata']['unit'] for r in records if r['type'] == 'METADATA'}
    assert units['train.ips'] == units['val.ips'] == 'images/s'
    logs = [r for r in records if r['type'] == 'LOG']
    assert [r['step'] for r in logs] == ['PARAMETER', [0, 0], [0, 1], [0], [],
                                         'PARAMETER', [1, 0], [1, 1], [1], []]
    assert logs[0]['data']['lr'] == 0.1 and logs[0]['data']['mode'] == 'train_val'
    assert set(logs[1]['data']) == {'train.loss', 'train.ips', 'train.lr', 'train.loss_scale',
                                    'train.skipped_steps'}
    epoch = logs[3]['data']
    row = _read(tmp_path / 'run' / 'm-0001.json')['metrics']
    assert (epoch['train.loss'], epoch['val.accuracy'], epoch['val.top_k_accuracy_5']) == \
        (row['train_loss'], row['val_top1'], row['val_top5'])
    assert epoch['val.ips'] > 0 and epoch['train.time'] > 0
    assert logs[-1]['data']['val.accuracy'] == _read(tmp_path / 'run' / 'm-summary.json')[
        'val_top1']


def test_default_save_dir_is_under_runs(digits_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = _digits(digits_dir, 'unused')
    del argv[argv.index('--save-dir'):argv.index('--save-dir') + 2]
    assert train_imagenet.main(argv) == 0
    assert sorted(os.listdir(str(tmp_path))) == ['runs']
    assert checkpoints.list_checkpoints(str(tmp_path / 'runs' / 'm'), 'm') == [1]
    if not os.path.isdir(os.path.join(ROOT, '.git')) or shutil.which('git') is None:
        pytest.skip('not a git checkout')
    for path in ('runs/m/m-0001.params', 'scripts/runs/m/m-0001.params'):
        assert subprocess.run(['git', 'check-ignore', '-q', path], cwd=ROOT).returncode == 0, path


def test_index_files_may_be_named(digits_dir, tmp_path):
    idx = tmp_path / 'elsewhere.idx'
    shutil.copy(os.path.join(digits_dir, 'train.idx'), str(idx))
    args = _parse(['--dataset', 'digits', '--data-dir', digits_dir, '--data-train',
                   os.path.join(digits_dir, 'train.rec'), '--data-train-idx', str(idx)])
    spec = data.resolve_data(args)
    assert (spec.train_idx, spec.num_train) == (str(idx), 1500)
    args.data_train_idx = str(tmp_path / 'missing.idx')
    with pytest.raises(options.UsageError, match='--data-train-idx .*missing.idx: no such file'):
        data.resolve_data(args)
