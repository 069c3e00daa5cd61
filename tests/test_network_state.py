"""The life cycle of a network mxamp has seen: one state object, its moves, its refusals."""
import warnings

import mxnet as mx
import pytest
from mxnet.gluon import nn

import mxamp
from mxamp import network_state
from mxamp.network_state import NetworkState, Settings, Stage, Tree, state_of


def _net():
    net = nn.HybridSequential(prefix='net_')
    with net.name_scope():
        net.add(nn.Dense(8, in_units=4), nn.Activation('relu'), nn.Dense(2, in_units=8))
    net.initialize()
    return net


def _settings():
    return Settings.of('bfloat16')


def test_an_fp32_net_has_no_state():
    assert state_of(_net()) is None


def test_convert_gives_every_block_of_the_tree_one_state_sharing_settings_and_tree():
    net = mxamp.convert(_net(), 'bfloat16')
    states = [state_of(block) for block in (net, net[0], net[1], net[2])]
    assert all(s.stage is Stage.CONVERTED for s in states)
    assert len({id(s) for s in states}) == 4             # one per block
    assert len({id(s.settings) for s in states}) == 1    # the tree's settings
    assert len({id(s.tree) for s in states}) == 1        # the tree's edit count
    assert states[0].precision == 'bfloat16'
    # mxamp's one attribute on a block
    assert not [name for name in vars(net) if name.startswith('_mxamp') and name != '_mxamp_state']


def test_a_graph_records_what_it_was_built_for_and_goes_stale_when_the_tree_changes():
    net = mxamp.convert(_net(), 'bfloat16')
    state = state_of(net)
    assert state.built_for is None and state.last_conversion() is None
    net(mx.nd.ones((2, 4)))
    assert state.built_for == 'cpu' and not state.graph_is_stale('cpu')
    conversion, device = state.last_conversion()
    assert device == 'cpu' and conversion.nodes
    assert state.graph_is_stale('gpu')                 # another device type: rebuild
    head = nn.Dense(3, in_units=2)
    head.initialize()
    net.add(head)                                      # a child registered in the tree
    assert state.graph_is_stale()
    assert state_of(net[0]).graph_is_stale()           # every block of the tree sees it
    assert net(mx.nd.ones((2, 4))).shape == (2, 3)     # rebuilt
    assert not state.graph_is_stale()


def test_kept_float32_says_why_and_allows_a_later_conversion():
    net = _net()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        mxamp.convert(net, 'float32')
    state = state_of(net)
    assert state.stage is Stage.KEPT_FLOAT32 and state.precision == 'float32'
    assert 'asked for float32' in state.float32_reason
    assert 'runs in float32' in mxamp.summary(net, print_fn=None)
    mxamp.convert(net, 'bfloat16')
    assert state_of(net).stage is Stage.CONVERTED


def test_converting_twice_is_one_clear_error():
    net = mxamp.convert(_net(), 'bfloat16')
    with pytest.raises(ValueError, match="HybridSequential 'net' is already converted by mxamp "
                                         r"\(to bfloat16\)"):
        mxamp.convert(net, 'bfloat16')
    with pytest.raises(RuntimeError, match='already holds a converted state'):
        network_state.attach(net, NetworkState.kept_float32('no'))


def test_moves_of_a_converted_block_are_refused_on_a_kept_float32_one():
    state = NetworkState.kept_float32('asked for float32')
    for move in (lambda: state.graph_built('cpu'), state.child_registered, lambda: state.tree,
                 lambda: state.join(NetworkState.converted(_settings(), Tree())),
                 lambda: state.remember_conversion('cpu', '', None)):
        with pytest.raises(RuntimeError, match='needs a converted block; this one is kept float32'):
            move()


def test_a_child_converted_on_its_own_joins_the_tree_it_is_added_to():
    net = mxamp.convert(_net(), 'bfloat16')
    child = mxamp.convert(nn.HybridSequential(prefix='child_'), 'bfloat16')
    with child.name_scope():
        child.add(nn.Dense(2, in_units=2))
    child.initialize()
    net.add(child)
    assert state_of(child).tree is state_of(net).tree
    other = mxamp.convert(_net(), 'float16')
    with pytest.raises(ValueError, match=r'other settings \(float16\) than .* \(bfloat16\)'):
        net.add(other)


def test_for_inference_marks_the_state_not_the_stage():
    net = _net()
    x = mx.nd.ones((2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        net = mxamp.for_inference(net, x, dtype='bfloat16')
    state = state_of(net)
    assert state.stage is Stage.CONVERTED
    assert 'inference only' in state.fused_for_inference
    assert state.fused_for_inference in mxamp.summary(net, print_fn=None)


def test_trees_that_come_to_share_a_block_count_edits_as_one():
    first, second = Tree(), Tree()
    first.edited()
    first.edited()
    built_before = {id(first): first.edits, id(second): second.edits}
    first.merge_into(second)
    # Every graph built before the merge is stale; from now on one count serves both.
    assert first.edits == second.edits not in built_before.values()
    second.edited()
    assert first.edits == second.edits
    first.merge_into(second)            # merging again changes nothing
    assert first.edits == second.edits
