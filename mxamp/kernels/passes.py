"""The kernel wing's passes over a converted graph, in the order `mxamp.pipeline` runs them.

Each puts nodes on mxamp's own operators (`mxamp.kernels.operators`) where they
pay or are needed, and records what it did (`mxamp.passes.PassRecord`).  They
change only the graph of a converted Gluon block's CachedOp on a CPU in
bfloat16, not fused for inference: export, symbol files and fused graphs keep
MXNet's operators, which any MXNet loads.

1. `ChannelsLastRegions`: chains of convolutions, batch normalisations and
   poolings computed channels last (found and rewritten by
   `mxamp.kernels.channels_last`, chosen by `mxamp.kernels.choice`), in training
   graphs; the inference graph records them and keeps MXNet's operators (the
   own batch normalisation always uses the batch statistics).
2. `StemWithoutDataGradient`: a region convolution reading only the inputs
   computes no data gradient, when the inputs take none.
3. `OwnConvolutions`: the convolutions the measured table chooses
   (`mxamp.kernels.choice`), outside regions.
4. `OwnClips`: every ``clip`` reading an operator's output on the own clip,
   which computes the same values vectorised (MXNet 1.9.1's clip and its
   gradient are scalar loops); a clip reading a variable keeps MXNet's, since
   its gradient may add.
5. `OwnAttention`: transformers' interleaved self-attention products, which
   MXNet computes only in FP32 on a CPU, in bfloat16 on the own operators
   (`mxamp.kernels.transformer`).
6. `OwnLayerNorms`: layer normalisations over the last axis on the own
   operator, in the precision the precision pass gave them (MXNet's gradient is
   a slow generic loop).
7. `OwnSoftmax`: softmaxes with a length over the last axis (the attention
   weights of gluonnlp's BERT) on the own vectorised operator, in FP32, MXNet's
   values (MXNet's softmax with a length and its gradient are scalar loops).
8. `OwnDropouts`: dropouts (``Dropout`` in training mode, without axes) on the
   own vectorised operator (`mxamp.kernels.dropout`), in training graphs; the
   inference graph records them and keeps MXNet's ``Dropout``, the identity
   there.  Not in a graph that runs as its FP32 self (nothing in bfloat16).
9. `FanOuts`: a fan-out on each array an own convolution, self-attention
   product, layer normalisation, softmax with a length or dropout shares,
   since MXNet must never sum gradients into an own operator's output.
"""
from typing import Sequence

from .. import hardware
from ..passes import TRAINING, GraphPass, PassContext, PassRecord
from . import channels_last, choice, dropout, operators, transformer

# What the training graph runs a channels-last region's ops on.
_REGION_OPERATORS = {'Convolution': operators.OP_NAME,
                     'BatchNorm': operators.BATCH_NORM_OP_NAME,
                     'Pooling': operators.POOLING_OP_NAME}


def _applies(context: PassContext) -> bool:
    """Whether the wing changes this graph: on a CPU, in bfloat16, not fused."""
    return (not context.fused and context.device_type == 'cpu'
            and context.conversion.dtype == 'bfloat16')


def _record(earlier: Sequence[PassRecord], name: str) -> PassRecord:
    return next((record for record in earlier if record.name == name), PassRecord(name))


class ChannelsLastRegions(GraphPass):
    name = 'channels-last regions'

    def applies(self, context):
        return _applies(context) and choice.may_choose_regions(context.cpu_class)

    def run(self, graph, context, earlier):
        source = context.source
        low = [record.name for record in context.conversion.nodes
               if record.computes_in == 'bfloat16']
        regions = choice.choose_regions(channels_last.find_regions(
            source, context.shapes, low, context.writes_gradient), context.cpu_class)
        if not regions:
            return PassRecord(self.name)
        nodes = frozenset(name for region in regions for name in region.nodes)
        if context.training:
            graph.update(channels_last.with_channels_last(graph, regions, context.shapes))
        return PassRecord(
            self.name, nodes,
            {node['name']: _REGION_OPERATORS[node['op']] for node in source['nodes']
             if node['name'] in nodes and node['op'] in _REGION_OPERATORS},
            frozenset(p for region in regions for p in region.params), training_only=True,
            line="computed channels last in training: %d ops (mxamp.kernels.channels_last; "
                 "inference runs MXNet's)" % len(nodes))


class StemWithoutDataGradient(GraphPass):
    name = 'stem without data gradient'

    def applies(self, context):
        return context.mode == TRAINING and _applies(context)

    def run(self, graph, context, earlier):
        if not _record(earlier, ChannelsLastRegions.name).nodes:
            return PassRecord(self.name)
        return PassRecord(self.name, frozenset(
            channels_last.without_input_data_gradients(graph, context.parameters)),
            training_only=True)


class OwnConvolutions(GraphPass):
    name = 'own convolutions'

    def applies(self, context):
        return _applies(context) and choice.may_choose_convolutions(
            context.cpu_class, choice.running_threads())

    def run(self, graph, context, earlier):
        in_regions = _record(earlier, ChannelsLastRegions.name).nodes if context.training \
            else frozenset()
        names = [name for name in choice.bfloat16_convolutions(context.conversion)
                 if name not in in_regions]
        sites = choice.conv_sites(context.source, context.shapes, names, 'bfloat16')
        chosen = choice.choose_convolutions(sites, context.cpu_class, choice.running_threads(),
                                            context.writes_gradient)
        if not chosen:
            return PassRecord(self.name)
        nodes = frozenset(site.name for site in chosen)
        choice.with_own_convolutions(graph, nodes)
        return PassRecord(self.name, nodes, {name: operators.OP_NAME for name in nodes},
                          frozenset(p for site in chosen for p in site.params),
                          line="convolutions on mxamp's own oneDNN 3 operator: %d "
                               "(mxamp.kernels.choice)" % len(nodes))


class OwnClips(GraphPass):
    name = 'own clips'
    same_values = True

    def computes_low(self):
        return frozenset(['clip']) if operators.available() else frozenset()

    def applies(self, context):
        return _applies(context) and operators.available()

    def run(self, graph, context, earlier):
        nodes = graph['nodes']
        clips = [node for node in nodes
                 if node['op'] == 'clip' and nodes[node['inputs'][0][0]]['op'] != 'null']
        for node in clips:
            node['op'] = operators.CLIP_OP_NAME
        return PassRecord(self.name, frozenset(node['name'] for node in clips))


class OwnAttention(GraphPass):
    name = 'own attention'

    def applies(self, context):
        # oneDNN 3's bfloat16 matmul needs the CPU's bfloat16 instructions (no emulation).
        return _applies(context) and hardware.computes_bfloat16(context.cpu_class) and \
            operators.available()

    def run(self, graph, context, earlier):
        moved = frozenset(transformer.with_own_attention(graph))
        if not moved:
            return PassRecord(self.name)
        ops = {node['name']: transformer.OWN_OPERATORS[node['op']] for node in context.source['nodes']
               if node['name'] in moved}
        return PassRecord(self.name, moved, ops, lowered=moved,
                          line="self-attention products in bfloat16 on mxamp's own oneDNN 3 "
                               "operators: %d (mxamp.kernels.transformer)" % len(moved))


class OwnLayerNorms(GraphPass):
    name = 'own layer normalisations'

    def applies(self, context):
        return _applies(context) and operators.available()

    def run(self, graph, context, earlier):
        moved = transformer.own_layer_norms(graph, context.writes_gradient)
        if not moved:
            return PassRecord(self.name)
        return PassRecord(self.name, frozenset(moved),
                          {name: operators.LAYER_NORM_OP_NAME for name in moved},
                          frozenset(p for params in moved.values() for p in params),
                          line="layer normalisations on mxamp's own oneDNN 3 operator: %d "
                               "(mxamp.kernels.transformer)" % len(moved))


class OwnSoftmax(GraphPass):
    name = 'own softmaxes with a length'

    def applies(self, context):
        return _applies(context) and operators.available()

    def run(self, graph, context, earlier):
        float32_readers = frozenset(
            record.name for record in context.conversion.nodes
            if record.precision == 'float32' and record.plan.inputs[:1] == ('float32',))
        moved = transformer.own_masked_softmaxes(graph, float32_readers, context.source,
                                                 context.shapes)
        if not moved:
            return PassRecord(self.name)
        return PassRecord(self.name, frozenset(moved),
                          {name: operators.MASKED_SOFTMAX_OP_NAME for name in moved},
                          line="softmaxes with a length on mxamp's own vectorised operator: %d "
                               "(mxamp.kernels.transformer)" % len(moved))


class OwnDropouts(GraphPass):
    name = 'own dropouts'

    def applies(self, context):
        # A graph that computes nothing in bfloat16 and stores no parameter so (dtype='auto'
        # where no layer pays) runs as its FP32 self, value for value: MXNet's masks too.
        conversion = context.conversion
        return _applies(context) and operators.available() and \
            bool(conversion.computes_low or conversion.lp_params)

    def run(self, graph, context, earlier):
        precision = {record.name: record.precision for record in context.conversion.nodes}
        moved = frozenset(dropout.movable_dropouts(context.source, precision))
        if not moved:
            return PassRecord(self.name)
        if context.training:
            dropout.with_own_dropouts(graph, moved)
        return PassRecord(self.name, moved, {name: operators.DROPOUT_OP_NAME for name in moved},
                          training_only=True,
                          line="dropouts on mxamp's own vectorised operator in training: %d "
                               "(mxamp.kernels.dropout; inference runs MXNet's)" % len(moved))


class FanOuts(GraphPass):
    name = 'fan-outs'

    def applies(self, context):
        return _applies(context)

    def run(self, graph, context, earlier):
        own = _record(earlier, OwnConvolutions.name).nodes
        if context.training:  # (inference: no gradient, no sum to avoid)
            own |= _record(earlier, OwnAttention.name).nodes | \
                _record(earlier, OwnLayerNorms.name).nodes | \
                _record(earlier, OwnSoftmax.name).nodes | \
                _record(earlier, OwnDropouts.name).nodes
        return PassRecord(self.name, frozenset(channels_last.with_fanned_out_inputs(graph, own)))


#: The wing's passes, in order (`mxamp.pipeline`).
PASSES = (ChannelsLastRegions(), StemWithoutDataGradient(), OwnConvolutions(), OwnClips(),
          OwnAttention(), OwnLayerNorms(), OwnSoftmax(), OwnDropouts(), FanOuts())
