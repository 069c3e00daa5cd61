"""The core converts and trains without the kernel wing (mxamp/kernels/), and loads it
only when a graph is built or the optimizer steps."""
import json
import subprocess
import sys

_WITHOUT_WING = r'''
import json, sys
sys.modules['mxamp.kernels'] = None      # as if mxamp/kernels/ were not there
import mxnet as mx
from mxnet import autograd, gluon
import mxamp
from mxamp import pipeline
from mxamp.dtypes import name_of_array
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(8, 3, padding=1), gluon.nn.BatchNorm(), gluon.nn.Activation('relu'),
        gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(4))
net.initialize()
mxamp.convert(net, 'bfloat16')
net.hybridize()
trainer = mxamp.Trainer(net.collect_params(), 'sgd', {'learning_rate': 0.1, 'momentum': 0.9})
x, y = mx.nd.random.uniform(shape=(4, 3, 8, 8)), mx.nd.array([0, 1, 2, 3])
losses = []
for _ in range(2):
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    with trainer.scale_loss(loss) as scaled:
        autograd.backward(scaled)
    trainer.step(4)
    losses.append(float(loss.mean().asscalar()))
text = mxamp.summary(net, print_fn=None)
print(json.dumps({'passes': len(pipeline.kernel_passes()), 'losses': losses,
                  'dtype': name_of_array(net[0].weight.data()),
                  'summary': text.splitlines()[0],
                  'wing': sorted(m for m in sys.modules if m.startswith('mxamp.kernels.'))}))
'''


def _run(script):
    result = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_core_converts_and_trains_without_the_wing():
    found = _run(_WITHOUT_WING)
    assert found['passes'] == 0 and found['wing'] == [] and found['dtype'] == 'bfloat16'
    assert all(loss == loss and loss < 10 for loss in found['losses']), found
    assert found['losses'][1] < found['losses'][0], found
    assert 'converted to bfloat16' in found['summary'], found


def test_import_mxamp_leaves_the_wing_and_the_profiler_unloaded():
    found = _run('import json, sys, mxamp\n'
                 'print(json.dumps(sorted(m for m in sys.modules if m.startswith("mxamp."))))')
    assert not [name for name in found if name.startswith(('mxamp.kernels', 'mxamp.profil'))
                or name in ('mxamp.system_info', 'mxamp.cli')], found
