"""Training state mxamp writes is written whole or not at all: an interrupted save keeps the last good file."""
import os
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd
from mxnet.gluon import nn

import mxamp
from mxamp.atomic_files import replaced_on_success


class Interrupted(Exception):
    pass


def _files(directory):
    return sorted(os.listdir(str(directory)))


def test_replaced_on_success_replaces_only_a_complete_file(tmp_path):
    target = tmp_path / 'state'
    target.write_text('good')
    with pytest.raises(Interrupted):
        with replaced_on_success(str(target)) as temporary:
            with open(temporary, 'w') as handle:
                handle.write('half')
            raise Interrupted()
    assert target.read_text() == 'good' and _files(tmp_path) == ['state']
    with replaced_on_success(str(target)) as temporary:
        with open(temporary, 'w') as handle:
            handle.write('new')
    assert target.read_text() == 'new' and _files(tmp_path) == ['state']
    assert oct(os.stat(str(target)).st_mode & 0o777) == oct(0o666 & ~_umask())  # an ordinary file


def _umask():
    current = os.umask(0)
    os.umask(current)
    return current


def _interrupt_nd_save(monkeypatch):
    """mx.nd.save that writes half a file, then fails (a full disk, a kill)."""
    def half_save(fname, data):
        with open(fname, 'wb') as handle:
            handle.write(b'\0' * 7)
        raise Interrupted()
    monkeypatch.setattr(mx.nd, 'save', half_save)


def _trained_net_and_trainer():
    net = nn.HybridSequential()
    net.add(nn.Dense(4, in_units=3))
    net.initialize()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # bfloat16 storage only on a CPU without its kernels
        mxamp.convert(net, 'bfloat16')
    trainer = mxamp.Trainer(net.collect_params(), 'adam', {'learning_rate': 0.1})
    with autograd.record():
        loss = net(mx.nd.ones((2, 3))).sum()
        with trainer.scale_loss(loss) as scaled:
            autograd.backward(scaled)
    trainer.step(2)
    return net, trainer


def test_a_converted_nets_parameters_survive_an_interrupted_save(tmp_path, monkeypatch):
    net, _ = _trained_net_and_trainer()
    path = str(tmp_path / 'net.params')
    net.save_parameters(path)
    good = open(path, 'rb').read()
    _interrupt_nd_save(monkeypatch)
    with pytest.raises(Interrupted):
        net.save_parameters(path)
    assert open(path, 'rb').read() == good and _files(tmp_path) == ['net.params']


def test_trainer_states_survive_an_interrupted_save(tmp_path, monkeypatch):
    _, trainer = _trained_net_and_trainer()
    path = str(tmp_path / 'trainer.states')
    trainer.save_states(path)
    good = open(path, 'rb').read()
    monkeypatch.setattr(trainer, 'state_dict', lambda: (_ for _ in ()).throw(Interrupted()))
    with pytest.raises(Interrupted):
        trainer.save_states(path)
    assert open(path, 'rb').read() == good and _files(tmp_path) == ['trainer.states']
    monkeypatch.undo()
    trainer.load_states(path)     # still a whole, loadable file


def _module_trainer():
    x = mx.sym.var('data')
    # An integer parameter (a lookup table) beside the floating ones.
    table = mx.sym.var('table_weight', dtype='int32', shape=(3,))
    out = mx.sym.broadcast_add(mx.sym.sum(mx.sym.FullyConnected(x, num_hidden=3, name='fc'), axis=1),
                               mx.sym.sum(mx.sym.cast(table, 'float32')))
    sym = mxamp.convert_symbol(out, 'bfloat16', params=['fc_weight', 'fc_bias'], ctx=mx.cpu(),
                               cpu_class='auto')
    mod = mx.mod.Module(sym, data_names=['data'], label_names=[])
    mod.bind(data_shapes=[('data', (2, 4))])
    mod.init_params(mxamp.Float32Init(mx.init.Uniform(0.1)), allow_missing=True,
                    arg_params={'table_weight': mx.nd.array([1, 2, 3], dtype='int32')})
    return mxamp.ModuleTrainer(mod, 'sgd', {'learning_rate': 0.1}, loss_scale=None)


def test_module_checkpoints_survive_an_interrupted_save(tmp_path, monkeypatch):
    trainer = _module_trainer()
    params, states = str(tmp_path / 'm.params'), str(tmp_path / 'm.states')
    trainer.save_params(params)
    trainer.save_states(states)
    good = open(params, 'rb').read(), open(states, 'rb').read()
    monkeypatch.setattr(trainer, 'state_dict', lambda: (_ for _ in ()).throw(Interrupted()))
    with pytest.raises(Interrupted):
        trainer.save_states(states)
    _interrupt_nd_save(monkeypatch)
    with pytest.raises(Interrupted):
        trainer.save_params(params)
    assert (open(params, 'rb').read(), open(states, 'rb').read()) == good
    assert _files(tmp_path) == ['m.params', 'm.states']


def test_module_params_with_an_integer_parameter_load_back(tmp_path):
    trainer = _module_trainer()
    path = str(tmp_path / 'm.params')
    trainer.save_params(path)
    assert mx.nd.load(path)['arg:table_weight'].dtype == np.int32
    arg, aux = trainer.module.get_params()
    arg['table_weight'] = mx.nd.zeros((3,), dtype='int32')
    trainer.module.set_params(arg, aux)
    trainer.load_params(path)
    table = trainer.module.get_params()[0]['table_weight']
    assert table.dtype == np.int32 and table.asnumpy().tolist() == [1, 2, 3]
