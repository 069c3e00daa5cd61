"""What mxamp keeps on a Gluon network it has seen, and the moves it allows.

One `NetworkState` per block holds what mxamp decided about a network and remembers of it;
this module alone attaches it (``_mxamp_state``, mxamp's one attribute on a block) and
changes it.  The Gluon front drives it; `mxamp.diagnose` reads it without importing a front.
Stages and moves: docs/gluon.rst, "What mxamp keeps on a network".  A parameter's own marks
(`mxamp.gluon`'s ``_mxamp_precision``, `mxamp.fusion`'s) are not kept here.
"""
import enum
from typing import Any, Collection, Dict, FrozenSet, Iterable, Mapping, NamedTuple, Optional, Tuple

from . import cost
from . import graph as graph_mod
from . import hardware
from .policy import Policy, Rules, emulates_float16

__all__ = ['Stage', 'Settings', 'Tree', 'NetworkState', 'state_of', 'converted_state', 'seen_state', 'attach',
           'describe_block', 'check_convertible']

_ATTRIBUTE = '_mxamp_state'


class Stage(enum.Enum):
    """Where a network `mxamp.convert` has seen stands."""
    #: asked for float32, or 'auto' found no bfloat16 kernels: the net is untouched.
    KEPT_FLOAT32 = 'kept float32'
    #: the net computes under a precision policy (its class swapped, see `mxamp.gluon`).
    CONVERTED = 'converted'
    #: its largest subtrees that can become a graph are CONVERTED, the rest runs in FP32.
    CONVERTED_IN_PART = 'converted in part'


class Settings(NamedTuple):
    """What one `mxamp.convert` call decided, before converting any block; shared by the tree.

    ``dtype`` and the user's ``rules`` (`mxamp.policy.Rules`, ``exclude`` as node-name
    patterns); ``lp_params``: the parameters stored in ``dtype``, which `decided_for` fills
    in (`of` leaves it empty); ``cost_aware``: the dtype was ``'auto'``, so layers too small
    to pay stay FP32 (`mxamp.cost`)."""
    dtype: str
    rules: Rules
    lp_params: FrozenSet[str]
    cost_aware: bool = False

    @classmethod
    def of(cls, dtype: str, rules: Rules = Rules(), cost_aware: bool = False) -> 'Settings':
        """The settings of one convert call, checked (ValueError for a dtype no policy takes)."""
        settings = cls(dtype, rules, frozenset(), bool(cost_aware))
        settings._any_policy()  # raises here, before any block is touched
        return settings

    def _any_policy(self) -> Policy:
        return Policy(self.dtype, self.rules)

    def decided_for(self, fp32_graph: dict, params: Collection[str]) -> 'Settings':
        """These rules, with the parameters of parsed `fp32_graph` stored in low precision."""
        # Operator classes alone decide it (storable_params): any device's policy will do.
        return self._replace(lp_params=frozenset(
            graph_mod.storable_params(fp32_graph, self._any_policy(), params)))

    def policy(self, device_type: str, inference: bool = False,
               kernel_ops: Iterable[str] = ()) -> Policy:
        """The policy of a graph built for `device_type` (``'cpu'``, ``'gpu'``...); with
        `inference`, of a graph `mxamp.for_inference` fuses; `kernel_ops` as `Policy`'s."""
        klass = hardware.AVX512_BF16 if device_type == 'gpu' else hardware.cpu_class()
        costs = (cost.model_for(klass, inference=inference)
                 if self.cost_aware and device_type == 'cpu' else None)
        return Policy(self.dtype, self.rules, emulate_float16=emulates_float16([device_type]),
                      cpu_class=klass, inference=inference, kernel_ops=kernel_ops, costs=costs)

    def same_policy(self, other: 'Settings') -> bool:
        """Whether a block converted with `self` may join a tree converted with `other`:
        same dtype and operator rules, and no exclude pattern beyond `other`'s."""
        def operator_rules(settings):
            rules = settings.rules
            only = None if rules.lp_ops_only is None else set(rules.lp_ops_only)
            return (settings.dtype, set(rules.fp32_ops), set(rules.lp_ops), only,
                    set(rules.fp32_conditions), settings.cost_aware)
        return (operator_rules(self) == operator_rules(other)
                and set(self.rules.exclude) <= set(other.rules.exclude))

    def text(self) -> str:
        """The settings as the arguments of the conversion that made them (those given); the
        rules only `mxamp.contrib_amp` gives under the names its functions take them by."""
        rules = self.rules
        given = [('fp32_ops', rules.fp32_ops), ('lp_ops', rules.lp_ops), ('exclude', rules.exclude),
                 ('target_dtype_ops', rules.lp_ops_only),
                 ('conditional_fp32_ops', rules.fp32_conditions)]
        dtype = "'auto' (%s)" % self.dtype if self.cost_aware else self.dtype
        return ', '.join([dtype] + ['%s=%s' % (key, list(value)) for key, value in given
                                    if value])


class Tree(object):
    """The count of children registered in one converted tree, which its blocks share.

    Each block remembers the count its graph was built at (`NetworkState.graph_is_stale`);
    trees that come to share a block merge (docs/gluon.rst, "What mxamp keeps on a network")."""
    __slots__ = ('_edits', '_merged_into')

    def __init__(self) -> None:
        self._edits = 0
        self._merged_into: Optional['Tree'] = None

    def _root(self) -> 'Tree':
        tree = self
        while tree._merged_into is not None:
            tree = tree._merged_into
        return tree

    @property
    def edits(self) -> int:
        """Children registered so far anywhere in the (merged) tree."""
        return self._root()._edits

    def edited(self) -> None:
        """A child was registered somewhere in the tree."""
        self._root()._edits += 1

    def merge_into(self, other: 'Tree') -> None:
        """This tree's blocks count `other`'s edits from now on, and `other`'s count
        theirs; every graph either built before is stale."""
        mine, theirs = self._root(), other._root()
        if mine is not theirs:
            mine._merged_into = theirs
            theirs._edits = max(mine._edits, theirs._edits) + 1


# What a conversion is kept for: the FP32 graph's identity, the policy's inference and kernel_ops.
Identity = Tuple[str, bool, FrozenSet[str]]


class NetworkState(object):
    """What mxamp keeps on one block of a network `mxamp.convert` has seen.

    Made by `kept_float32`, `converted` or `converted_in_part`, attached with `attach`, read
    with `state_of`; `settings` and `tree` raise RuntimeError unless CONVERTED.  ``parts``,
    ``float32_blocks``: a net converted in part's ``(child path, block[, why])``.
    ``inference_only``: the graph is built under the inference policy (`for_inference`).
    ``runtime``: the `Conversion` the CachedOp runs, with the later passes' records.
    ``cached_ops``: the CachedOps kept for the other modes (`mxamp.passes`' modes);
    ``cached_for``: the mode(s) of the current one, ``'both'`` when its graph serves all.
    This module is their only writer: the fronts move them through the methods below.
    """
    __slots__ = ('stage', '_settings', 'float32_reason', 'parts', 'float32_blocks', '_tree',
                 '_conversions', 'built_for',
                 '_built_at', 'fused_for_inference', '_inference_only', 'float32_originals',
                 '_runtime', '_gradients_written', '_cached_ops', '_cached_for', '_weighed')

    def __init__(self, stage: Stage, settings: Optional[Settings] = None,
                 tree: Optional[Tree] = None, float32_reason: Optional[str] = None) -> None:
        self.stage = stage
        self._settings = settings
        self.float32_reason = float32_reason
        self.parts: Tuple[Tuple[str, Any], ...] = ()
        self.float32_blocks: Tuple[Tuple[str, Any, str], ...] = ()
        self._tree = tree
        # device type -> (identity of the FP32 graph and policy, its Conversion)
        self._conversions: Dict[str, Tuple[Identity, graph_mod.Conversion]] = {}
        self.built_for: Optional[str] = None
        self._built_at = 0
        self.fused_for_inference: Optional[str] = None
        self._inference_only = False
        self.float32_originals: Dict[str, Any] = {}
        self._runtime: Optional[graph_mod.Conversion] = None
        self._gradients_written: FrozenSet[str] = frozenset()
        self._cached_ops: Dict[str, Tuple[Any, Any]] = {}
        self._cached_for: Optional[str] = None
        self._weighed: Optional[Tuple[Tuple[int, ...], ...]] = None

    @classmethod
    def kept_float32(cls, reason: str) -> 'NetworkState':
        """The state of a net convert left in FP32, saying why."""
        return cls(Stage.KEPT_FLOAT32, float32_reason=reason)

    @classmethod
    def converted(cls, settings: Settings, tree: Tree) -> 'NetworkState':
        """The state of one block of a tree converted under `settings`."""
        return cls(Stage.CONVERTED, settings=settings, tree=tree)

    @classmethod
    def converted_in_part(cls, settings: Settings, parts: Iterable[Tuple[str, Any]],
                          float32_blocks: Iterable[Tuple[str, Any, str]]) -> 'NetworkState':
        """A net converted in part: `parts` (path, block), `float32_blocks` (path, block, why)."""
        state = cls(Stage.CONVERTED_IN_PART, settings=settings)
        state.parts = tuple(parts)
        state.float32_blocks = tuple(float32_blocks)
        return state

    @property
    def precision(self) -> str:
        """The precision convert chose: the settings' dtype, or ``'float32'``."""
        return self._settings.dtype if self._settings is not None else 'float32'

    def _require_converted(self, move: str) -> Tuple[Settings, Tree]:
        if self.stage is not Stage.CONVERTED or self._settings is None or self._tree is None:
            raise RuntimeError('mxamp: %s needs a converted block; this one is %s'
                               % (move, self.stage.value))
        return self._settings, self._tree

    @property
    def settings(self) -> Settings:
        return self._require_converted('reading its settings')[0]

    @property
    def tree(self) -> Tree:
        return self._require_converted('sharing its tree')[1]

    def shapes_weighed(self, shapes: Tuple[Tuple[int, ...], ...]) -> bool:
        """Whether a call with inputs of `shapes` was last weighed against the graph's
        layers (`mxamp.cost`); records `shapes` as weighed."""
        if shapes == self._weighed:
            return True
        self._weighed = shapes
        return False

    def repeats_last_call(self, device_type: Optional[str], shapes: Tuple[Any, ...]) -> bool:
        """Whether a call on `device_type` with inputs of `shapes` finds the graph as the
        last call left it: built for that device type after every edit, and `shapes` the
        ones last weighed (`shapes_weighed`).  The common call: nothing to check."""
        # The tree read directly: this runs at every call of a converted block, whose state
        # the caller has checked (converted_state).
        return (device_type is not None and device_type == self.built_for and
                shapes == self._weighed and self._tree is not None and
                self._built_at == self._tree.edits)

    def graph_built(self, device_type: str) -> None:
        """Record that the block's graph was (re)built for `device_type`, after every edit so far."""
        tree = self._require_converted('building a graph')[1]
        self.built_for = device_type
        self._built_at = tree.edits

    def graph_is_stale(self, device_type: Optional[str] = None) -> bool:
        """Whether the last graph was built for another device type, or before an edit."""
        tree = self._require_converted('checking a graph')[1]
        return bool(device_type and device_type != self.built_for) or self._built_at != tree.edits

    def child_registered(self) -> None:
        """A child was registered somewhere in the tree: every graph built before is stale."""
        self._require_converted('registering a child')[1].edited()

    def join(self, other: 'NetworkState') -> None:
        """This block, converted before, joins `other`'s tree; the blocks that shared its
        tree (the other net that still holds it) follow (`Tree.merge_into`)."""
        own = self._require_converted('joining a tree')[1]
        theirs = other._require_converted('being joined')[1]
        own.merge_into(theirs)
        self._tree = theirs

    def conversion_for(self, device_type: str
                       ) -> Optional[Tuple[Identity, graph_mod.Conversion]]:
        """``(identity, Conversion)`` made last for `device_type`, or None; the identity is
        the FP32 graph's and the policy's `inference` and `kernel_ops`."""
        return self._conversions.get(device_type)

    def remember_conversion(self, device_type: str, identity: Identity,
                            conversion: graph_mod.Conversion) -> None:
        """Keep `conversion` (of the graph and policy `identity`) for `device_type`."""
        self._require_converted('converting a graph')
        self._conversions[device_type] = (identity, conversion)

    def forget_conversions(self) -> None:
        """Drop the conversions remembered: the next graph is rewritten, for parameters whose
        precision changed since."""
        self._conversions = {}

    def last_conversion(self) -> Optional[Tuple[graph_mod.Conversion, str]]:
        """``(Conversion, device type)`` of the graph built last, None before the first build."""
        if self.built_for is None or self.built_for not in self._conversions:
            return None
        return self._conversions[self.built_for][1], self.built_for

    # -- the graphs the block runs ------------------------------------------
    @property
    def inference_only(self) -> bool:
        return self._inference_only

    def build_for_inference(self, inference_only: bool) -> None:
        """From now on the block's graph converts under the inference policy, or not."""
        self._inference_only = bool(inference_only)

    @property
    def runtime(self) -> Optional[graph_mod.Conversion]:
        return self._runtime

    @property
    def cached_for(self) -> Optional[str]:
        return self._cached_for

    @property
    def cached_ops(self) -> Mapping[str, Tuple[Any, Any]]:
        return dict(self._cached_ops)

    @property
    def gradients_written(self) -> FrozenSet[str]:
        """`runtime`'s ``gradients_written``, kept: read at every call of the block."""
        return self._gradients_written

    def cache_built(self, mode: str, runtime: Optional[graph_mod.Conversion]) -> None:
        """The block's CachedOp was built in `mode` to run `runtime` (`mxamp.pipeline.run`'s
        result); it serves every mode unless the runtime graph differs by mode."""
        self._runtime = runtime
        self._gradients_written = runtime.gradients_written if runtime is not None else frozenset()
        self._cached_for = mode if runtime is not None and runtime.differs_by_mode else 'both'

    def cache_cleared(self) -> None:
        """MXNet dropped the block's CachedOp: the ones kept for other modes go too."""
        self._cached_ops = {}
        self._cached_for = None

    @property
    def serves_every_mode(self) -> bool:
        """Whether the current CachedOp (or the next one built) runs in any mode: a call
        then needs no mode, whose test for input gradients costs a small net's forward a
        noticeable share (`mxamp.gluon_calls.inputs_take_gradients`)."""
        return self._cached_for in (None, 'both')

    def cached_op_for(self, mode: str, current: Tuple[Any, Any]) -> Tuple[Any, Any]:
        """The ``(CachedOp, its arguments)`` to run in `mode`, given the `current` pair:
        `current` when it serves `mode` or is none yet; else the pair kept for `mode`
        (``(None, [])``: MXNet builds one), `current` kept for its own mode."""
        kept_for = self._cached_for
        if current[0] is None or kept_for is None or kept_for in ('both', mode):
            return current
        self._cached_ops[kept_for] = current
        chosen = self._cached_ops.pop(mode, (None, []))
        self._cached_for = mode if chosen[0] is not None else None
        return chosen

    def mark_fused_for_inference(self, line: str) -> None:
        """`mxamp.for_inference` made this net: `line` says what it fused."""
        self.fused_for_inference = line

    def keep_float32_originals(self, values: Dict[str, Any]) -> None:
        """Keep `values` (parameter name to FP32 NDArray) for BatchNorm folds; replaces
        what was kept.  An empty dict: the stored values are the ones to fold from."""
        self.float32_originals = dict(values)


def state_of(block: object) -> Optional[NetworkState]:
    """The `NetworkState` of `block`, None when mxamp never saw it."""
    return getattr(block, _ATTRIBUTE, None)


def attach(block: object, state: NetworkState) -> None:
    """Give `block` its state (a new one replaces a KEPT_FLOAT32 one only)."""
    current = state_of(block)
    if current is not None and current.stage is not Stage.KEPT_FLOAT32:
        raise RuntimeError('mxamp: %s already holds a converted state' % describe_block(block))
    object.__setattr__(block, _ATTRIBUTE, state)


def converted_state(block: object) -> NetworkState:
    """The state of `block`, which `mxamp.convert` converted (TypeError otherwise)."""
    state = state_of(block)
    if state is None or state.stage is not Stage.CONVERTED:
        raise TypeError('%s is not converted by mxamp: call mxamp.convert(net) first'
                        % describe_block(block))
    return state


def seen_state(block: object) -> NetworkState:
    """The state of `block`, which `mxamp.convert` has seen (TypeError otherwise)."""
    state = state_of(block)
    if state is None:
        raise TypeError('%s was never seen by mxamp.convert' % describe_block(block))
    return state


def describe_block(block: object) -> str:
    """``HybridSequential 'net_'``: a block as errors and reports name it."""
    name = getattr(block, 'name', None)
    return "%s '%s'" % (type(block).__name__, name) if name is not None else type(block).__name__


def check_convertible(block: object) -> None:
    """Raise ValueError when `block` is converted already (convert is one move, once)."""
    state = state_of(block)
    if state is not None and state.stage is not Stage.KEPT_FLOAT32:
        raise ValueError('%s is already %s by mxamp (to %s)'
                         % (describe_block(block), state.stage.value, state.precision))
