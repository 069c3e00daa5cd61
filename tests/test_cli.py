"""The ``mxamp convert`` tool: outputs, report, and one clear line (exit 2) for bad input."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import mxnet as mx

from conftest import CORPUS, needs_bfloat16_compute, require_corpus
import mxamp
from mxamp import cli, hardware
from mxamp.dtypes import BFLOAT16
from mxamp.inference import fused_nodes

from test_graph import params_of, small_cnn


def convert(capsys, *argv):
    status = cli.main(['convert'] + list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _forward(prefix, data):
    """The first output of checkpoint `prefix` (epoch 0) bound by ``Module`` for inference on
    `data` (N, 16, 8, 8)."""
    symbol, args, auxs = mx.model.load_checkpoint(prefix, 0)
    batch = data.shape[0]
    module = mx.mod.Module(symbol, context=mx.cpu())
    module.bind(data_shapes=[('data', data.shape)], label_shapes=[('softmax_label', (batch,))],
                for_training=False)
    module.set_params(args, auxs)
    module.forward(mx.io.DataBatch([data], [mx.nd.zeros(batch)]), is_train=False)
    return module.get_outputs()[0]


def test_converts_symbol_and_params(model, tmp_path, capsys):
    out_prefix = str(tmp_path / 'out')
    status, out, err = convert(capsys, model + '-symbol.json', '--params', model + '-0000.params',
                               '-o', out_prefix, '--dtype', 'bfloat16', '--report',
                               '--input-shape', 'data=2,16,8,8')
    assert status == 0, err
    assert 'Convolution' in out and 'casts inserted: 1 bfloat16->float32, 1 float32->bfloat16' in out
    symbol, args, auxs = mx.model.load_checkpoint(out_prefix, 0)
    assert args['conv0_weight'].dtype == BFLOAT16 and args['bn0_gamma'].dtype == np.float32
    assert all(v.dtype == np.float32 for v in auxs.values())
    assert ('graph computes in bfloat16, which this' in err) == (hardware.cpu_class() == 'avx2')
    if not hardware.computes_bfloat16():
        # The default graph computes in bfloat16; this CPU runs the one built for it.
        status, out, err = convert(capsys, model + '-symbol.json', '--params', model + '-0000.params',
                                   '-o', out_prefix, '--dtype', 'bfloat16', '--cpu-class', 'auto')
        assert status == 0, err
    output = _forward(out_prefix, mx.nd.ones((2, 16, 8, 8)))
    assert output.dtype == np.float32
    assert np.isfinite(output.asnumpy()).all()


@pytest.mark.parametrize('cpu_class', ['avx2', 'avx512'])
def test_cpu_class_without_bfloat16_gives_fp32_compute_and_the_same_params(model, tmp_path, capsys,
                                                                           cpu_class):
    common = [model + '-symbol.json', '--params', model + '-0000.params', '--dtype', 'bfloat16',
              '--report']
    status, native_report, err = convert(capsys, *(common + ['-o', str(tmp_path / 'native')]))
    assert status == 0, err
    status, out, err = convert(capsys, *(common + ['-o', str(tmp_path / 'cpu'),
                                                   '--cpu-class', cpu_class]))
    assert status == 0, err
    assert 'casts inserted: ' in out and 'float32->bfloat16' not in out
    _, native_args, _ = mx.model.load_checkpoint(str(tmp_path / 'native'), 0)
    _, args, _ = mx.model.load_checkpoint(str(tmp_path / 'cpu'), 0)
    assert {k: v.dtype for k, v in args.items()} == {k: v.dtype for k, v in native_args.items()}
    # Every op computes in FP32 here, so the graph runs on any CPU.
    assert np.isfinite(_forward(str(tmp_path / 'cpu'), mx.nd.ones((2, 16, 8, 8))).asnumpy()).all()


def test_cpu_class_is_for_bfloat16(model, tmp_path, capsys):
    status, out, err = convert(capsys, model + '-symbol.json', '-o', str(tmp_path / 'x'),
                               '--dtype', 'float16', '--cpu-class', 'avx2')
    assert status == 2 and '--cpu-class applies to --dtype bfloat16' in err
    assert not os.listdir(str(tmp_path)) or not any(f.startswith('x') for f in os.listdir(str(tmp_path)))
    with pytest.raises(SystemExit) as exit_info:     # argparse's own usage error
        cli.main(['convert', model + '-symbol.json', '-o', str(tmp_path / 'x'),
                  '--dtype', 'bfloat16', '--cpu-class', 'avx3'])
    assert exit_info.value.code == 2 and "invalid choice: 'avx3'" in capsys.readouterr().err


def test_symbol_only_and_overrides(model, tmp_path, capsys):
    out_prefix = str(tmp_path / 'sym')
    status, out, err = convert(capsys, model + '-symbol.json', '-o', out_prefix, '--dtype', 'float16',
                               '--exclude', 'conv1', '--fp32-ops', 'Pooling')
    assert status == 0, err
    assert os.listdir(str(tmp_path)).count('sym-symbol.json') == 1
    assert not os.path.exists(out_prefix + '-0000.params')
    graph = json.load(open(out_prefix + '-symbol.json'))
    conv1 = next(n for n in graph['nodes'] if n['name'] == 'conv1')
    assert all(graph['nodes'][i]['op'] != 'Cast' or graph['nodes'][i]['attrs']['dtype'] == 'float32'
               for i, _, _ in conv1['inputs'])


def test_python_dash_m_entry_point(model, tmp_path):
    result = subprocess.run([sys.executable, '-m', 'mxamp', 'convert', model + '-symbol.json', '-o',
                             str(tmp_path / 'm'), '--dtype', 'bfloat16'], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.path.exists(str(tmp_path / 'm-symbol.json'))


def _bad_inputs(model, tmp_path):
    truncated = tmp_path / 'truncated-symbol.json'
    truncated.write_text(open(model + '-symbol.json').read()[:300])
    not_symbol = tmp_path / 'list-symbol.json'
    not_symbol.write_text('[1, 2]')
    binary = tmp_path / 'binary-symbol.json'
    binary.write_bytes(b'\xff\xfe\x00garbage')
    unknown_op = tmp_path / 'warpctc-symbol.json'
    graph = json.load(open(model + '-symbol.json'))
    graph['nodes'][3]['op'] = 'WarpCTC'
    unknown_op.write_text(json.dumps(graph))
    bad_params = tmp_path / 'bad.params'
    bad_params.write_bytes(b'not an ndarray file')
    extra = tmp_path / 'extra.params'
    mx.nd.save(str(extra), {'arg:nope': mx.nd.ones(2)})
    symbol = small_cnn()
    args, auxs = params_of(symbol)

    def params_file(name, **changed):
        # The model's parameters with some replaced (None: left out).
        path = str(tmp_path / name)
        values = dict({'arg:' + k: v for k, v in args.items()}, **{'aux:' + k: v for k, v in auxs.items()})
        values.update(changed)
        mx.nd.save(path, {k: v for k, v in values.items() if v is not None})
        return path
    wrong_shape = params_file('wrong.params', **{'arg:fc_weight': mx.nd.ones((10, 3))})
    sym = model + '-symbol.json'
    good = model + '-0000.params'
    return [
        ([str(tmp_path / 'missing.json')], "symbol file '%s' does not exist" % (tmp_path / 'missing.json')),
        ([str(truncated)], 'not valid JSON'),
        ([str(not_symbol)], 'not an MXNet symbol'),
        ([str(binary)], 'cannot read'),
        ([str(unknown_op)], "operator 'WarpCTC' is not registered"),
        ([sym, '--params', str(tmp_path / 'none.params')], 'does not exist'),
        ([sym, '--params', str(bad_params)], 'cannot read parameters'),
        ([sym, '--params', str(extra)], "parameter 'arg:nope' is not in the graph"),
        # fc reads the flattened 8x8 pooling: its input size needs the data's shape.
        ([sym, '--params', wrong_shape, '--input-shape', 'data=1,16,8,8'],
         "wrong.params: parameter 'fc_weight' has shape (10, 3); node 'fc' (FullyConnected) needs (10, 256)"),
        # The parameters' own shapes, without --input-shape: 10 classes, 16 channels.
        ([sym, '--params', params_file('classes.params', **{'arg:fc_weight': mx.nd.ones((7, 256))})],
         "parameter 'fc_weight' has shape (7, 256); node 'fc' (FullyConnected) needs (10, ?)"),
        ([sym, '--params', params_file('channels.params', **{'arg:conv1_weight': mx.nd.ones((16, 8, 3, 3))})],
         "parameter 'conv1_weight' has shape (16, 8, 3, 3); node 'conv1' (Convolution) needs (16, 16, 3, 3)"),
        ([sym, '--params', params_file('stats.params', **{'aux:bn0_moving_var': mx.nd.ones(8)})],
         "parameter 'bn0_moving_var' has shape (8,); node 'bn0' (BatchNorm) needs (16,)"),
        ([sym, '--params', params_file('noconv.params', **{'arg:conv0_weight': None}),
          '--input-shape', 'data=1,16,8,8'],
         "noconv.params: parameter 'arg:conv0_weight' is missing (--allow-missing converts without it)"),
        ([sym, '--params', params_file('nostats.params', **{'aux:bn0_moving_mean': None,
                                                            'aux:bn0_moving_var': None})],
         "parameters 'aux:bn0_moving_mean', 'aux:bn0_moving_var' are missing (--allow-missing converts "
         "without them)"),
        ([sym, '--input-shape', 'image=1,16,8,8'],
         "error: --input-shape: 'image' is not an input of the graph (its inputs: 'data', 'softmax_label')"),
        ([sym, '--params', good, '--input-shape', 'fc_weight=10,256'],
         "--input-shape: 'fc_weight' is not an input of the graph"),
        ([sym, '--params', good, '--input-shape', 'data=1,16'],
         "error: --input-shape: the graph rejects these shapes (data=1,16): Error in operator conv0: "
         "Check failed: dshp.ndim() == 4U (2 vs. 4) : Input data should be 4D"),
        ([sym, '--params', good, '--input-shape', 'data=1,3,8,8'],
         "parameter 'conv0_weight' has shape (16, 16, 3, 3); node 'conv0' (Convolution) needs (16, 3, 3, 3)"),
        ([sym, '--exclude', 'cnov*', 'conv1', 'nosuchnode'],
         "error: --exclude: 'cnov*' (did you mean 'conv*'?), 'nosuchnode' match no node of the graph"),
        ([sym, '--params', good, '--exclude', 'relu'],
         "error: --exclude: 'relu' (did you mean 'relu0'?) matches no node of the graph"),
        ([sym, '--fp32-ops', 'NoSuchOp'], "'NoSuchOp' is not registered"),
    ]


def test_bad_input_one_line_exit_2_no_output(model, tmp_path, capsys):
    out_dir = tmp_path / 'out'
    out_dir.mkdir()
    for argv, message in _bad_inputs(model, tmp_path):
        status, out, err = convert(capsys, *(argv + ['-o', str(out_dir / 'x'), '--dtype', 'bfloat16']))
        assert status == 2, (argv, err)
        assert err.count('\n') == 1 and err.startswith('mxamp: error: '), err
        assert message in err, (message, err)
        assert 'Traceback' not in err
        assert os.listdir(str(out_dir)) == [], argv


def test_allow_missing_keeps_the_missing_parameter_an_fp32_input(model, tmp_path, capsys):
    _, args, auxs = mx.model.load_checkpoint(model, 0)
    weight = args.pop('conv0_weight')
    partial = str(tmp_path / 'partial.params')
    mx.nd.save(partial, dict({'arg:' + k: v for k, v in args.items()},
                             **{'aux:' + k: v for k, v in auxs.items()}))
    out_prefix = str(tmp_path / 'out')
    status, _, err = convert(capsys, model + '-symbol.json', '--params', partial, '-o', out_prefix,
                             '--dtype', 'bfloat16', '--cpu-class', 'avx2', '--allow-missing')
    assert status == 0, err
    symbol, c_args, c_auxs = mx.model.load_checkpoint(out_prefix, 0)
    assert 'conv0_weight' not in c_args and c_args['conv1_weight'].dtype == BFLOAT16
    # The caller binds the missing weight, in FP32.
    executor = symbol.bind(mx.cpu(), args=dict(c_args, conv0_weight=weight, data=mx.nd.ones((2, 16, 8, 8)),
                                               softmax_label=mx.nd.zeros(2)),
                           aux_states=c_auxs, grad_req='null')
    assert np.isfinite(executor.forward()[0].asnumpy()).all()


def _legacy_checkpoint(tmp_path, **changed):
    """The v0.8 corpus MLP (a legacy symbol file) and a params file for it, some shapes `changed`."""
    require_corpus()
    path = os.path.join(CORPUS, 'apache__mxnet__save_000800.json')
    symbol = mx.sym.load(path)
    arg_shapes, _, aux_shapes = symbol.infer_shape(data=(1, 200))
    values = {'arg:' + n: mx.nd.zeros(s) for n, s in zip(symbol.list_arguments(), arg_shapes)
              if n not in ('data', 'softmax_label')}
    values.update({'aux:' + n: mx.nd.zeros(s) for n, s in zip(symbol.list_auxiliary_states(), aux_shapes)})
    values.update({key: mx.nd.zeros(shape) for key, shape in changed.items()})
    params = str(tmp_path / 'legacy.params')
    mx.nd.save(params, values)
    return path, params


def test_a_legacy_symbol_file_with_bad_parameters_gives_one_line(tmp_path, capfd):
    # MXNet's loader writes its upgrade notes (C++, file descriptor 2) for a v0.8
    # file; mxamp's error must be the only line on stderr.
    symbol_file, params = _legacy_checkpoint(tmp_path, **{'arg:fc2_weight': (64, 100)})
    capfd.readouterr()      # the notes of the test's own mx.sym.load
    status = cli.main(['convert', symbol_file, '--params', params, '-o', str(tmp_path / 'x'),
                       '--dtype', 'float16'])
    out, err = capfd.readouterr()
    assert status == 2 and out == ''
    assert err == ("mxamp: error: %s: parameter 'fc2_weight' has shape (64, 100); node 'fc2' "
                   "(FullyConnected) needs (64, 128)\n" % params)
    assert not any(name.startswith('x') for name in os.listdir(str(tmp_path)))


def test_a_legacy_symbol_file_converts_quietly(tmp_path, capfd):
    symbol_file, params = _legacy_checkpoint(tmp_path)
    capfd.readouterr()
    status = cli.main(['convert', symbol_file, '--params', params, '-o', str(tmp_path / 'x'),
                       '--dtype', 'float16'])
    out, err = capfd.readouterr()
    assert status == 0 and err == ''
    assert out.splitlines() == ['wrote %s' % (tmp_path / name) for name in ('x-symbol.json', 'x-0000.params')]


def test_unknown_dtype_and_bad_shape_option_exit_2(model, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(['convert', model + '-symbol.json', '-o', 'x', '--dtype', 'float8'])
    assert exit_info.value.code == 2
    assert "unknown dtype 'float8'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(['convert', model + '-symbol.json', '-o', 'x', '--dtype', 'float16', '--input-shape', 'data=a'])
    assert exit_info.value.code == 2


@pytest.mark.parametrize('alias, dtype', [('fp16', 'float16'), ('half', 'float16'),
                                          ('bf16', 'bfloat16'), ('BFloat16', 'bfloat16')])
def test_dtype_aliases_are_those_of_the_python_api(model, tmp_path, capsys, alias, dtype):
    status, out, err = convert(capsys, model + '-symbol.json', '-o', str(tmp_path / 'x'),
                               '--dtype', alias, '--report')
    assert status == 0, err
    assert '  %s  ' % dtype in out.splitlines()[0]        # the report's header names the dtype


def test_option_errors_name_the_command_line_option(model, tmp_path, capsys):
    for option in ('--fp32-ops', '--lp-ops'):
        status, _, err = convert(capsys, model + '-symbol.json', '-o', str(tmp_path / 'x'),
                                 '--dtype', 'bfloat16', option, 'Convolutoin')
        assert status == 2
        assert err == "mxamp: error: %s: operator 'Convolutoin' is not registered in MXNet 1.9.1\n" \
            % option
    assert not any(name.startswith('x') for name in os.listdir(str(tmp_path)))


def test_missing_output_directory_is_reported(model, tmp_path, capsys):
    status, _, err = convert(capsys, model + '-symbol.json', '-o', str(tmp_path / 'no' / 'dir' / 'x'),
                             '--dtype', 'bfloat16')
    assert status == 2 and 'does not exist' in err


def test_for_inference_writes_a_fused_model_and_reports_the_fusions(model, tmp_path, capsys,
                                                                   blocked_bfloat16_policy):
    out_prefix = str(tmp_path / 'fused')
    status, out, err = convert(capsys, model + '-symbol.json', '--params', model + '-0000.params',
                               '-o', out_prefix, '--dtype', 'bfloat16', '--cpu-class', 'auto',
                               '--for-inference', '--input-shape', 'data=2,16,8,8', '--report')
    assert status == 0, err
    assert ("fused for inference by MXNet's oneDNN backend: 2 _sg_mkldnn_conv, "
            "1 _sg_mkldnn_fully_connected") in out
    symbol, args, auxs = mx.model.load_checkpoint(out_prefix, 0)
    assert fused_nodes(symbol) == {'_sg_mkldnn_conv': 2, '_sg_mkldnn_fully_connected': 1}
    # On a CPU computing bfloat16, mxamp folded bn0 into conv0 itself, and says so.
    folded = hardware.cpu_class() in ('avx512_bf16', 'amx')
    assert ('1 BatchNorm folded into bfloat16 convolutions by mxamp' in out) == folded
    assert args['conv0_mxamp_folded_weight' if folded else 'conv0_weight'].dtype == BFLOAT16
    assert np.isfinite(_forward(out_prefix, mx.nd.ones((4, 16, 8, 8))).asnumpy()).all()


def _casts_of_activations(prefix):
    """The operators of the casts that read an operator's output or the input 'data'."""
    nodes = json.load(open(prefix + '-symbol.json'))['nodes']
    return sorted({node['op'] for node in nodes if node['op'] in ('Cast', 'amp_cast')
                   and not node['name'].endswith('_mxamp_no_fold')
                   and (nodes[node['inputs'][0][0]]['op'] != 'null'
                        or nodes[node['inputs'][0][0]]['name'] == 'data')})


def _fast_and_portable(model, tmp_path, capsys, *options):
    """Converts `model` with `options`, with and without --fast-casts; the two prefixes."""
    prefixes = []
    for fast in (False, True):
        prefix = str(tmp_path / ('fast' if fast else 'portable'))
        status, out, err = convert(capsys, model + '-symbol.json', '--params',
                                   model + '-0000.params', '-o', prefix,
                                   '--input-shape', 'data=2,16,8,8', *options,
                                   *(['--fast-casts'] if fast else []))
        assert status == 0, err
        # The fast form names what a default save would do to it, once.
        assert err.count('remove_amp_cast=False') == fast, err
        prefixes.append(prefix)
    return prefixes


def test_fast_casts_cast_activations_with_amp_cast_to_the_same_values(model, tmp_path, capsys):
    # float16 for a CPU runs everywhere: its GEMMs compute in FP32 between float16 casts.
    portable, fast = _fast_and_portable(model, tmp_path, capsys, '--dtype', 'float16', '--cpu')
    assert _casts_of_activations(portable) == ['Cast']
    assert _casts_of_activations(fast) == ['amp_cast']
    data = mx.nd.random.uniform(-1, 1, shape=(2, 16, 8, 8))
    np.testing.assert_array_equal(_forward(fast, data).asnumpy(),
                                  _forward(portable, data).asnumpy())
    # What the note is about: MXNet's default save drops the casts.
    symbol = mx.sym.load(fast + '-symbol.json')
    for remove, expected_ops in ((True, set()), (False, {'amp_cast'})):
        nodes = json.loads(symbol.tojson(remove_amp_cast=remove))['nodes']
        assert {node['op'] for node in nodes} & {'amp_cast'} == expected_ops


@needs_bfloat16_compute
def test_fast_casts_give_the_bits_of_the_rounded_portable_casts_in_bfloat16(model, tmp_path,
                                                                           capsys):
    portable, fast = _fast_and_portable(model, tmp_path, capsys, '--dtype', 'bfloat16')
    assert _casts_of_activations(fast) == ['amp_cast']
    assert 'amp_cast' not in _casts_of_activations(portable)
    data = mx.nd.random.uniform(-1, 1, shape=(2, 16, 8, 8))
    np.testing.assert_array_equal(_forward(fast, data).asnumpy(),
                                  _forward(portable, data).asnumpy())


@pytest.mark.parametrize('options', [['--dtype', 'float32'],
                                     ['--dtype', 'bfloat16', '--cpu-class', 'avx2']])
def test_fast_casts_without_activation_casts_write_no_note(model, tmp_path, capsys, options):
    # float32 writes the graph unchanged; a bfloat16 graph for an AVX2 CPU computes in FP32
    # and casts parameters only, which are always Cast nodes.
    status, out, err = convert(capsys, model + '-symbol.json', '-o', str(tmp_path / 'x'),
                               '--fast-casts', *options)
    assert status == 0 and 'remove_amp_cast' not in err, err
    assert _casts_of_activations(str(tmp_path / 'x')) == []


def test_for_inference_errors_exit_2_and_write_nothing(model, tmp_path, capsys):
    for extra, message in (
            ([], "mxamp: error: --input-shape: fusing for inference needs the shape of 'data'"),
            (['--dtype', 'float16', '--input-shape', 'data=2,16,8,8'],
             'mxamp: error: --for-inference fuses with MXNet\'s oneDNN backend, for CPUs: a float16 '
             'graph for a GPU has nothing it can fuse (float16 for a CPU: --cpu)')):
        argv = [model + '-symbol.json', '--params', model + '-0000.params', '-o',
                str(tmp_path / 'x'), '--dtype', 'bfloat16', '--for-inference'] + extra
        status, out, err = convert(capsys, *argv)
        assert status == 2 and err.count('\n') == 1 and err.startswith(message), err
        assert not any(name.startswith('x') for name in os.listdir(str(tmp_path)))


def test_version_prints_mxamps_and_mxnets_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(['--version'])
    assert exited.value.code == 0
    out, err = capsys.readouterr()
    assert out == 'mxamp %s (MXNet %s)\n' % (mxamp.__version__, mx.__version__) and not err
    assert out.startswith('mxamp 0.1.0 ')
    # As a user types it: the module and the console script.
    result = subprocess.run([sys.executable, '-m', 'mxamp', '--version'], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == out, result.stderr


def test_info_prints_the_facts_of_a_bug_report(capsys):
    assert cli.main(['info']) == 0
    out, err = capsys.readouterr()
    assert out.startswith('mxamp %s, MXNet %s' % (mxamp.__version__, mx.__version__)), out
    # The class this machine has and what 'auto' picks here, as mxamp decides them.
    # "CPU class: 'amx' class CPU ..." or, lowered, "CPU class: CPU limited by ... to class 'avx2'".
    assert re.search(r"^CPU class: .*'%s'" % hardware.cpu_class(), out, re.M), out
    auto = mxamp.dtypes.resolve_dtype('auto', mx.cpu())
    assert "dtype='auto' on the CPU: %s" % auto in out
    assert not err
