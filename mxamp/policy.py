"""The precision policy: which operators run in low precision, which in FP32.

Every operator MXNet 1.9.1 registers is in one class per target dtype: ``'low'`` (the
GEMMs tensor cores and AMX accelerate, and BatchNorm; its floating inputs cast to the target
dtype but those it wants in FP32), ``'float32'`` (numerically sensitive), ``'widest'``
(inputs that must agree: low only when all are) or ``'neutral'`` (follows its input, never
cast).  ``'conditional'`` ops resolve by attribute; backward ops are ``'neutral'``.

Low precision is chosen only where MXNet 1.9.1 has a kernel that pays: under bfloat16 the
operators of ``BFLOAT16_CPU_OPS``, which decide the parameters stored in bfloat16 on every
CPU, while what computes in bfloat16 depends on the CPU class (``BFLOAT16_CPU_OPS_BY_CLASS``);
float16 GEMMs compute in FP32 between casts off GPUs (`emulates_float16`).  A conversion's
`Rules` (the user's) and `Policy`'s options adjust it; `policy_lists` lists it (docs/policy.rst).

MXNet internals relied on: the operator registry's C API (``MXListAllOpNames``,
``NNGetOpHandle``, ``MXSymbolGetAtomicSymbolInfo``) for operator names, aliases and
attributes, with MXNet's text description of each attribute's type
(``"{'relu', 'sigmoid'}, required"``) for the values an attribute takes.
"""
import copy
import ctypes
import fnmatch
import functools
import re
from collections import abc
from typing import (AbstractSet, Any, Dict, FrozenSet, Iterable, List, Mapping, NamedTuple,
                    Optional, Sequence, Tuple)

import mxnet as mx
from mxnet.base import _LIB, OpHandle, c_str, check_call, mx_uint, py_str

from .cost import GEMM_OPS, CostModel
from .dtypes import LOW_PRECISION, DTypeLike, dtype_name
from .hardware import AMX, AVX512_BF16, CPU_CLASSES, computes_bfloat16
from .hardware import cpu_class as this_cpu_class

__all__ = ['BATCHNORM_OPS', 'BFLOAT16_CPU_FAILS', 'BFLOAT16_CPU_KERNELS', 'BFLOAT16_CPU_OPS',
           'BFLOAT16_CPU_OPS_BY_CLASS', 'BFLOAT16_CPU_SLOW', 'CAST_OPS', 'CHANNELS_FIRST_LAYOUTS',
           'CLASSES',
           'FLOAT16_CPU_EMULATED', 'Condition', 'Policy', 'Rules',
           'PolicyLists', 'attributes', 'base_class', 'canonical', 'canonical_conditions',
           'canonical_ops', 'default_lp_ops', 'emulates_float16', 'exclude_matches',
           'int_tuple', 'is_true', 'policy_lists', 'refuse_failing_bfloat16_ops',
           'registered_ops']

#: ``layout`` attributes of MXNet's Convolution meaning channels second (``'None'``: the default).
CHANNELS_FIRST_LAYOUTS = ('None', 'NCW', 'NCHW', 'NCDHW')

LOW, FLOAT32, WIDEST, NEUTRAL = 'low', 'float32', 'widest', 'neutral'
CLASSES = (LOW, FLOAT32, WIDEST, NEUTRAL)


def _names(text):
    return frozenset(text.split())


# The GEMM-based ops, compute-bound: what low precision pays for.  _mxamp_convolution and the
# _mxamp_selfatt products are mxamp's own (mxamp.kernels.operators), with bfloat16 kernels.
_GEMM = _names('''
    Convolution _mxamp_convolution Deconvolution FullyConnected RNN dot batch_dot _linalg_gemm
    _linalg_gemm2 _mxamp_selfatt_qk _mxamp_selfatt_valatt
    _contrib_interleaved_matmul_selfatt_qk _contrib_interleaved_matmul_selfatt_valatt
    _contrib_interleaved_matmul_encdec_qk _contrib_interleaved_matmul_encdec_valatt
    _np_dot _npi_matmul _npi_tensordot _npi_tensordot_int_axes _npi_einsum
''')

# The GEMMs, and BatchNorm on their outputs (statistics FP32: _FLOAT32_INPUTS);
# _mxamp_batch_norm is mxamp's own, for channels-last data.
_LOW = _GEMM | _names('BatchNorm _contrib_BatchNormWithReLU _contrib_SyncBatchNorm '
                      '_mxamp_batch_norm')

# Numerically sensitive (softmax, norms, reductions, exp/log/pow, losses, detection, linear
# algebra, samplers), legacy ops without low-precision kernels, custom ops, quantization; and
# mxamp's master-weight kernels, which update FP32 masters and are never in a graph; mxamp's
# own LayerNorm and softmax with a length (mxamp.kernels.operators).
_FLOAT32 = _names('''
    _mxamp_follow_weight _mxamp_sgd_step _mxamp_adam_step
    softmax log_softmax softmin SoftmaxOutput SoftmaxActivation LayerNorm _mxamp_layer_norm
    _mxamp_masked_softmax
    GroupNorm InstanceNorm
    L2Normalization LRN norm moments _square_sum multi_sum_sq multi_lars
    exp expm1 log log10 log1p log2 _power _power_scalar _rpower_scalar broadcast_power _hypot
    _hypot_scalar broadcast_hypot reciprocal rsqrt rcbrt square erf erfinv gamma gammaln
    sin cos tan arcsin arccos arctan sinh cosh arcsinh arccosh arctanh
    sum mean prod nansum nanprod topk sort argsort argmax argmin argmax_channel
    LinearRegressionOutput LogisticRegressionOutput MAERegressionOutput SVMOutput MakeLoss
    make_loss CTCLoss smooth_l1 softmax_cross_entropy IdentityAttachKLSparseReg
    _contrib_box_nms _contrib_box_iou _contrib_box_encode _contrib_box_decode
    _contrib_bipartite_matching _contrib_MultiBoxPrior _contrib_MultiBoxTarget
    _contrib_MultiBoxDetection _contrib_Proposal _contrib_MultiProposal _contrib_ROIAlign
    _contrib_RROIAlign ROIPooling _contrib_PSROIPooling _contrib_DeformablePSROIPooling
    GridGenerator BilinearSampler SpatialTransformer Correlation Crop
    _contrib_DeformableConvolution _contrib_ModulatedDeformableConvolution
    _contrib_fft _contrib_ifft _contrib_count_sketch _contrib_hawkesll _contrib_quadratic
    _contrib_allclose _contrib_calibrate_entropy _histogram khatri_rao
    _linalg_det _linalg_extractdiag _linalg_extracttrian _linalg_gelqf _linalg_inverse
    _linalg_makediag _linalg_maketrian _linalg_potrf _linalg_potri _linalg_slogdet
    _linalg_sumlogdiag _linalg_syevd _linalg_syrk _linalg_trmm _linalg_trsm
    _random_exponential _random_exponential_like _random_gamma _random_gamma_like
    _random_generalized_negative_binomial _random_generalized_negative_binomial_like
    _random_negative_binomial _random_negative_binomial_like _random_normal _random_normal_like
    _random_pdf_dirichlet _random_pdf_exponential _random_pdf_gamma
    _random_pdf_generalized_negative_binomial _random_pdf_negative_binomial _random_pdf_normal
    _random_pdf_poisson _random_pdf_uniform _random_poisson _random_poisson_like _random_randint
    _random_uniform _random_uniform_like _sample_exponential _sample_gamma
    _sample_generalized_negative_binomial _sample_multinomial _sample_negative_binomial
    _sample_normal _sample_poisson _sample_uniform _sample_unique_zipfian _shuffle
    Convolution_v1 Pooling_v1 BatchNorm_v1 Custom _CachedOp _CachedOpThreadSafe _CustomFunction
    _NDArray _Native
    _contrib_quantize _contrib_quantize_asym _contrib_quantize_v2 _contrib_dequantize
    _contrib_requantize _contrib_quantized_act _contrib_quantized_batch_norm
    _contrib_quantized_concat _contrib_quantized_conv _contrib_quantized_elemwise_add
    _contrib_quantized_elemwise_mul _contrib_quantized_embedding _contrib_quantized_flatten
    _contrib_quantized_fully_connected _contrib_quantized_pooling _contrib_quantized_rnn
    _sg_mkldnn_conv _sg_mkldnn_fully_connected _sg_mkldnn_selfatt_qk _sg_mkldnn_selfatt_valatt
    _image_adjust_lighting _image_crop _image_flip_left_right _image_flip_top_bottom
    _image_normalize _image_random_brightness _image_random_color_jitter _image_random_contrast
    _image_random_flip_left_right _image_random_flip_top_bottom _image_random_hue
    _image_random_lighting _image_random_saturation _image_resize _image_to_tensor
    _cvcopyMakeBorder _cvimdecode _cvimread _cvimresize _imdecode
    _np_sum _np_prod _np_cumsum _np_trace _npi_mean _npi_std _npi_var _npi_norm _npi_average
    _npi_exp _npi_expm1 _npi_log _npi_log10 _npi_log1p _npi_log2 _npi_power _npi_power_scalar
    _npi_rpower_scalar _npi_powerd _npi_reciprocal _npi_square _npi_hypot _npi_arctan2
    _npi_arctan2_scalar _npi_rarctan2_scalar _npi_ldexp _npi_ldexp_scalar _npi_rldexp_scalar
    _npi_sin _npi_cos _npi_tan _npi_arcsin _npi_arccos _npi_arctan _npi_sinh _npi_cosh
    _npi_arcsinh _npi_arccosh _npi_arctanh _npi_argmax _npi_argmin _npi_percentile
    _npi_polyval _npi_bincount _npi_unique _npi_cholesky _npi_eig _npi_eigh _npi_eigvals
    _npi_eigvalsh _npi_svd _npi_solve _npi_pinv _npi_pinv_scalar_rcond _npi_tensorinv
    _npi_tensorsolve _npi_bernoulli _npi_choice _npi_exponential _npi_gamma _npi_gumbel
    _npi_logistic _npi_multinomial _npi_normal _npi_normal_n _npi_pareto _npi_rayleigh
    _npi_uniform _npi_uniform_n _npi_weibull _npi_blackman _npi_hamming _npi_hanning
    _npi_logspace
    Embedding _contrib_SparseEmbedding
''')

# Several floating inputs that must agree.
_WIDEST = _names('''
    add_n elemwise_add elemwise_sub elemwise_mul elemwise_div _grad_add
    broadcast_add broadcast_sub broadcast_mul broadcast_div broadcast_mod
    broadcast_maximum broadcast_minimum _maximum _minimum _mod
    broadcast_equal broadcast_not_equal broadcast_greater broadcast_greater_equal
    broadcast_lesser broadcast_lesser_equal broadcast_logical_and broadcast_logical_or
    broadcast_logical_xor _equal _not_equal _greater _greater_equal _lesser _lesser_equal
    _logical_and _logical_or _logical_xor
    Concat stack where _rnn_param_concat _identity_with_attr_like_rhs _scatter_elemwise_div
    _slice_assign _scatter_set_nd scatter_nd amp_multicast
    _npi_add _npi_subtract _npi_multiply _npi_true_divide _npi_mod _npi_copysign _npi_lcm
    _npi_equal _npi_not_equal _npi_greater _npi_greater_equal _npi_less _npi_less_equal
    _npi_bitwise_and _npi_bitwise_or _npi_bitwise_xor _npi_concatenate _npi_stack _npi_vstack
    _npi_hstack _npi_dstack _npi_column_stack _npi_where _npi_boolean_mask_assign_tensor
    _npi_insert_tensor
''')

# Follow their input: layout, slicing, selection, unary and scalar arithmetic, creation (FP32
# out), casts, optimizer updates (never in a forward graph), control flow (refused anyway).
_NEUTRAL = _names('''
    relu sigmoid tanh softsign hard_sigmoid abs negative sign ceil floor fix rint round trunc
    sqrt cbrt degrees radians clip logical_not Dropout _mxamp_dropout BlockGrad
    Flatten Reshape SwapAxis transpose expand_dims squeeze slice slice_axis slice_like
    _mxamp_fan_out _mxamp_move_channels _mxamp_pooling _mxamp_clip SliceChannel _split_v2
    _split_v2_backward reshape_like broadcast_like broadcast_axis
    broadcast_to tile repeat reverse Pad depth_to_space space_to_depth diag im2col col2im
    take batch_take pick gather_nd one_hot _onehot_encode max min
    SequenceLast SequenceMask SequenceReverse UpSampling _contrib_AdaptiveAvgPooling2D
    _contrib_BilinearResize2D _contrib_div_sqrt_dim _contrib_gradientmultiplier
    _contrib_round_ste _contrib_sign_ste _contrib_boolean_mask _contrib_index_array
    _contrib_index_copy _contrib_arange_like _contrib_getnnz _contrib_edge_id
    _contrib_dgl_adjacency _contrib_dgl_csr_neighbor_non_uniform_sample
    _contrib_dgl_csr_neighbor_uniform_sample _contrib_dgl_graph_compact _contrib_dgl_subgraph
    _plus_scalar _minus_scalar _rminus_scalar _mul_scalar _div_scalar _rdiv_scalar _mod_scalar
    _rmod_scalar _maximum_scalar _minimum_scalar _equal_scalar _not_equal_scalar
    _greater_scalar _greater_equal_scalar _lesser_scalar _lesser_equal_scalar
    _logical_and_scalar _logical_or_scalar _logical_xor_scalar _scatter_plus_scalar
    _scatter_minus_scalar _slice_assign_scalar _set_value fill_element_0index
    _zeros _zeros_without_dtype _ones _full _arange _eye _linspace zeros_like ones_like
    shape_array size_array _ravel_multi_index _unravel_index
    Cast amp_cast cast_storage _copy _copyto _CrossDeviceCopy _NoGradient
    _broadcast_backward _sparse_retain _foreach _while_loop _cond
    sgd_update sgd_mom_update mp_sgd_update mp_sgd_mom_update nag_mom_update mp_nag_mom_update
    multi_sgd_update multi_sgd_mom_update multi_mp_sgd_update multi_mp_sgd_mom_update
    preloaded_multi_sgd_update preloaded_multi_sgd_mom_update preloaded_multi_mp_sgd_update
    preloaded_multi_mp_sgd_mom_update adam_update _adamw_update _mp_adamw_update
    _multi_adamw_update _multi_mp_adamw_update lamb_update_phase1 lamb_update_phase2
    mp_lamb_update_phase1 mp_lamb_update_phase2 _multi_lamb_update _multi_mp_lamb_update
    rmsprop_update rmspropalex_update ftml_update ftrl_update signsgd_update signum_update
    _sparse_adagrad_update _contrib_group_adagrad_update all_finite multi_all_finite reset_arrays
    _contrib_backward_gradientmultiplier _contrib_backward_hawkesll _contrib_backward_index_copy
    _contrib_backward_quadratic
    _np_all _np_any _np_atleast_1d _np_atleast_2d _np_atleast_3d _np_copy _np_diag _np_diagflat
    _np_diagonal _np_max _np_min _np_moveaxis _np_reshape _np_roll _np_squeeze _np_transpose
    _npi_absolute _npi_add_scalar _npi_arange _npi_around _npi_bitwise_and_scalar
    _npi_bitwise_not _npi_bitwise_or_scalar _npi_bitwise_xor_scalar
    _npi_boolean_mask_assign_scalar _npi_broadcast_to _npi_cbrt _npi_ceil _npi_copysign_scalar
    _npi_degrees _npi_delete _npi_diag_indices_from _npi_diff _npi_dsplit _npi_ediff1d
    _npi_equal_scalar _npi_eye _npi_fix _npi_flip _npi_floor _npi_full_like
    _npi_greater_equal_scalar _npi_greater_scalar _npi_hsplit _npi_hsplit_backward
    _npi_identity _npi_indices _npi_insert_scalar _npi_insert_slice _npi_isfinite _npi_isinf
    _npi_isnan _npi_isneginf _npi_isposinf _npi_lcm_scalar _npi_less_equal_scalar
    _npi_less_scalar _npi_logical_not _npi_mod_scalar _npi_multiply_scalar _npi_nan_to_num
    _npi_negative _npi_not_equal_scalar _npi_ones _npi_pad _npi_radians _npi_rcopysign_scalar
    _npi_rint _npi_rmod_scalar _npi_rot90 _npi_rsubtract_scalar _npi_rtrue_divide_scalar
    _npi_share_memory _npi_sign _npi_sqrt _npi_subtract_scalar _npi_tanh _npi_tril
    _npi_true_divide_scalar _npi_trunc _npi_where_lscalar _npi_where_rscalar _npi_where_scalar2
    _npi_zeros _npx_constraint_check _npx_nonzero _npx_relu _npx_reshape _npx_sigmoid
''')

# Conditional: (op, attribute, values that force FP32); otherwise neutral.
_CONDITIONAL = {
    'Activation': ('act_type', ('softrelu',)),
    'LeakyReLU': ('act_type', ('elu', 'selu', 'gelu')),
    # Sum and Lp pooling accumulate a whole window: overflow-prone in float16.
    'Pooling': ('pool_type', ('sum', 'lp')),
}
# Conditional values neutral under bfloat16 all the same: its range is FP32's, and oneDNN's
# bfloat16 GELU computes in FP32 and rounds its output once, as every activation's.
_BFLOAT16_NEUTRAL = frozenset([('LeakyReLU', 'gelu')])

# Inputs read as indices, conditions or shapes: never cast, never deciding the data's precision.
_INDEX_INPUTS = {
    'Embedding': (0,), '_contrib_SparseEmbedding': (0,), 'take': (1,), 'batch_take': (1,),
    'pick': (1,), 'gather_nd': (1,), 'one_hot': (0,), 'where': (0,), '_npi_where': (0,),
    'SequenceMask': (1,), 'SequenceLast': (1,), 'SequenceReverse': (1,), 'slice_like': (1,),
    'reshape_like': (1,), 'broadcast_like': (1,), 'scatter_nd': (1,), '_scatter_set_nd': (2,),
    '_contrib_index_copy': (1,), '_contrib_boolean_mask': (1,), 'RNN': (4,),
    '_contrib_arange_like': (0,),
}

# Inputs an op wants in FP32 even when it runs in low precision.
_FLOAT32_INPUTS = {
    'BatchNorm': (1, 2, 3, 4), '_contrib_BatchNormWithReLU': (1, 2, 3, 4),
    '_contrib_SyncBatchNorm': (1, 2, 3, 4), '_mxamp_batch_norm': (1, 2, 3, 4),
}
# Outputs that stay FP32 when the op runs in low precision (BatchNorm's mean/var).
_FLOAT32_OUTPUTS = {
    'BatchNorm': (1, 2), '_contrib_BatchNormWithReLU': (1, 2), '_contrib_SyncBatchNorm': (1, 2),
    '_mxamp_batch_norm': (1, 2),
}

# Ops with a bfloat16 CPU kernel in MXNet 1.9.1, forward and backward, tried op by op on
# avx512_bf16.  Absent on purpose, as they fail: BFLOAT16_CPU_FAILS (below), Embedding and the
# other softmax-output losses.
# mxamp's own operators (mxamp.kernels.operators) with bfloat16 loops are in, _mxamp_dropout too.
BFLOAT16_CPU_KERNELS = _names('''
    Convolution _mxamp_convolution Deconvolution FullyConnected BatchNorm _contrib_BatchNormWithReLU
    _mxamp_batch_norm Activation LeakyReLU relu sigmoid tanh softsign Pooling _contrib_AdaptiveAvgPooling2D
    _contrib_BilinearResize2D Flatten Reshape expand_dims squeeze SwapAxis reshape_like
    slice_like broadcast_like broadcast_axis broadcast_to BlockGrad _copy _mxamp_fan_out
    _mxamp_move_channels _mxamp_pooling _mxamp_clip _mxamp_dropout make_loss
    Concat stack add_n elemwise_add elemwise_sub elemwise_mul elemwise_div _grad_add
    broadcast_add broadcast_sub broadcast_mul broadcast_div broadcast_maximum broadcast_minimum
    _maximum _minimum _plus_scalar _minus_scalar _rminus_scalar _mul_scalar _div_scalar
    _rdiv_scalar _maximum_scalar _minimum_scalar abs negative sign clip sqrt cbrt
    SequenceMask SequenceReverse _contrib_div_sqrt_dim _contrib_gradientmultiplier
    _contrib_round_ste _contrib_sign_ste zeros_like ones_like shape_array size_array
    max min _rnn_param_concat Cast amp_cast amp_multicast SliceChannel slice slice_axis
''')

# Ops MXNet 1.9.1 cannot compute in bfloat16 on a CPU in any mode: tried op by op on bfloat16
# input, each raises at its first call (Dropout in inference too, where it is the identity),
# and transpose corrupts the heap.  The user's lp_ops may not name them under bfloat16.
BFLOAT16_CPU_FAILS = _names('''
    Dropout transpose dot batch_dot _linalg_gemm _linalg_gemm2 RNN LayerNorm UpSampling Crop
    SoftmaxOutput
''')

# Ops whose bfloat16 kernel is MXNet's generic one (no oneDNN), slower than the FP32 op
# between two amp_casts (docs/policy.rst); the oneDNN-backed ones are faster and stay.
BFLOAT16_CPU_SLOW = _names('''
    softsign _contrib_AdaptiveAvgPooling2D _contrib_BilinearResize2D
    broadcast_like broadcast_axis broadcast_to elemwise_sub elemwise_mul elemwise_div
    broadcast_add broadcast_sub broadcast_mul broadcast_div broadcast_maximum broadcast_minimum
    _maximum _minimum _plus_scalar _minus_scalar _rminus_scalar _mul_scalar _div_scalar
    _rdiv_scalar _maximum_scalar _minimum_scalar abs negative sign clip sqrt cbrt
    SequenceReverse _contrib_div_sqrt_dim _contrib_gradientmultiplier
    _contrib_round_ste _contrib_sign_ste max min
''')

# The ops that run in bfloat16 on a CPU.
BFLOAT16_CPU_OPS = BFLOAT16_CPU_KERNELS - BFLOAT16_CPU_SLOW

# The ops that compute in bfloat16, per CPU class.  On 'avx2' oneDNN's GEMMs, BatchNorm,
# Pooling and activations raise in bfloat16 and the rest runs reference kernels; on 'avx512'
# oneDNN emulates bfloat16, slower than FP32: both compute none (docs/hardware.rst).  'amx'
# takes 'avx512_bf16''s table.  mxamp.hardware.computes_bfloat16 decides, as for 'auto'.
BFLOAT16_CPU_OPS_BY_CLASS = {
    klass: BFLOAT16_CPU_OPS if computes_bfloat16(klass) else frozenset() for klass in CPU_CLASSES}

# Ops whose bfloat16 CPU kernel exists only for some attributes (the others fall back to
# MXNet's own kernels, which reject bfloat16).
_BFLOAT16_CPU_CONDITIONS = {
    'LeakyReLU': lambda attrs: attrs.get('act_type', 'leaky') in ('leaky', 'gelu'),
    'Activation': lambda attrs: attrs.get('act_type') in ('relu', 'sigmoid', 'tanh', 'softrelu'),
    # oneDNN pooling needs an explicit kernel (global pooling without one falls back).
    'Pooling': lambda attrs: bool(attrs.get('kernel', '()').strip('()[], '))
    and attrs.get('pool_type', 'max') in ('max', 'avg')
    and attrs.get('pooling_convention', 'valid') != 'same',
}

#: BatchNorm and its variants.  They run in the precision of their data: on FP32 data (MXNet's
#: ResNets normalise the image first) a cast would hand oneDNN a plain-layout bfloat16 tensor
#: (its slow kernel).
BATCHNORM_OPS = frozenset(('BatchNorm', '_contrib_BatchNormWithReLU', '_contrib_SyncBatchNorm',
                           '_mxamp_batch_norm'))


# Activations with a slow bfloat16 kernel alone (BFLOAT16_CPU_SLOW) that MXNet 1.9.1's
# oneDNN backend fuses into the convolution they read (SgMKLDNNConvSelector: Convolution,
# BatchNorm, elemwise_add, then these), with the attributes that fuse: a ReLU6 (clip from 0)
# is oneDNN's bounded ReLU.
_FUSED_SLOW_ACTIVATIONS = {
    'clip': lambda attrs: _float_attr(attrs.get('a_min')) == 0.0,
}


def _float_attr(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


BLOCKED, PAD_CHANNELS = 'blocked', 'pad_channels'


def _bfloat16_conv_layout(attrs, input_shapes, cpu_class, training=True):
    """How a bfloat16 Convolution meets oneDNN 2.4's kernels (docs/policy.rst, "Convolution
    layouts under bfloat16"): ``'blocked'`` (bfloat16; also when shapes are unknown),
    ``'pad_channels'`` (after an exact zero input channel) or ``'float32'``.

    Blocked kernels need channels per group in multiples of 16 (depthwise: the channels) or
    an even count below 16 input channels; the fallback, a plain-layout GEMM, and the
    BatchNorm after it are slower than FP32.  FP32 also for an input smaller than the stride
    (oneDNN 2.4 and 3.2 give NaN weight gradients for the taps that see only padding), for
    `_amx_1x1_kernel_breaks`, and on ``'amx'`` when `training` for what the AMX kernels do not
    take (`_amx_kernel_takes`): their channels-last layout meets the AVX512-BF16 kernels'
    blocked one at a BatchNorm, whose backward then runs oneDNN's reference kernel.  Inference
    runs no backward and folds BatchNorm (`Policy.fuses_into_convolution`).
    """
    if attrs.get('layout', 'None') not in CHANNELS_FIRST_LAYOUTS:
        return BLOCKED    # channels-last: not oneDNN's path in MXNet 1.9.1, left alone
    data = input_shapes[0] if input_shapes else None
    if data and len(data) > 2 and all(data):
        strides = _int_tuple(attrs.get('stride'), len(data) - 2)
        if any(size < stride for size, stride in zip(data[2:], strides)):
            return FLOAT32
        if cpu_class == AMX and _amx_1x1_kernel_breaks(attrs, data):
            return FLOAT32
    weight = input_shapes[1] if input_shapes and len(input_shapes) > 1 else None
    if not weight or len(weight) < 3 or not all(weight):
        return BLOCKED
    out_channels, in_per_group = weight[0], weight[1]
    groups = int(attrs.get('num_group', 1))
    out_per_group = out_channels // max(groups, 1)
    depthwise = in_per_group == 1 and groups == out_channels
    if cpu_class == AMX and training and (
            depthwise or not _amx_kernel_takes(out_per_group, in_per_group)):
        return FLOAT32
    if depthwise:
        return BLOCKED if out_channels % 16 == 0 else FLOAT32
    if out_per_group % 16:
        return FLOAT32
    if in_per_group % 16 == 0:
        return BLOCKED
    if groups == 1 and in_per_group < 16:
        return BLOCKED if in_per_group % 2 == 0 else PAD_CHANNELS
    return FLOAT32


# Map sizes (positions, the product of the spatial dimensions) at which oneDNN 2.4's AMX
# kernel for a bfloat16 1x1 stride-1 convolution corrupts the heap ("malloc_consolidate():
# invalid chunk size", "free(): invalid next size"; MXNet 1.9.1 on an AMX Xeon, AMX enabled).
# Measured with 64 channels in and out, batch 4: every map size from 1 to 196 positions
# forward (1xN maps; 6x6, 6x7, 4x9 and 3x12 alike), 1 to 64 with both backward primitives:
# these and no other; at 6x6 with batch 1 to 16 and 64 to 2048 channels in and out.  Stride 2
# onto such a map, 3x3 kernels, and AMX off are fine.
_AMX_1X1_BROKEN_SIZES = frozenset((27, 33, 36, 39, 42, 45, 48))


def _amx_1x1_kernel_breaks(attrs, data):
    """Whether oneDNN 2.4's AMX kernel would corrupt the heap on this bfloat16 convolution."""
    spatial = len(data) - 2
    positions = 1
    for size in data[2:]:
        positions *= int(size)
    return (_int_tuple(attrs.get('kernel'), spatial) == (1,) * spatial
            and _int_tuple(attrs.get('stride'), spatial) == (1,) * spatial
            and positions in _AMX_1X1_BROKEN_SIZES)


def _amx_kernel_takes(out_per_group, in_per_group):
    """Whether oneDNN 2.4 runs a bfloat16 convolution (not depthwise) on AMX kernels in all three
    primitives (oneDNN verbose): channels per group in multiples of 32 (in: or an RGB stem's)."""
    return out_per_group % 32 == 0 and (in_per_group < 16 or in_per_group % 32 == 0)


def is_true(text: Any) -> bool:
    """A boolean attribute of a graph node (``'True'``, ``'1'``, True...) as a bool.

    >>> is_true('True'), is_true(None)
    (True, False)
    """
    return str(text).lower() in ('1', 'true')


def int_tuple(text: Any) -> Tuple[int, ...]:
    """A tuple attribute of a graph node as ints; MXNet's defaults (None, ``'()'``) give ``()``.

    >>> int_tuple('(3, 3)'), int_tuple(None)
    ((3, 3), ())
    """
    if isinstance(text, (tuple, list)):
        return tuple(int(value) for value in text)
    return tuple(int(value) for value in str(text or '').strip('()[] ').split(',')
                 if value.strip() and value.strip() != 'None')


def _int_tuple(text, length):
    """An attribute such as ``'(2, 2)'`` (or None: all ones) as `length` ints."""
    values = int_tuple(text)
    if not values:
        return (1,) * length
    return values if len(values) == length else (values + (1,) * length)[:length]


# Layout rules on input shapes, per op, under bfloat16 on a CPU.
_BFLOAT16_CPU_LAYOUT_RULES = {'Convolution': _bfloat16_conv_layout}

# MXNet 1.9.1 has no float16 kernel on a CPU for any GEMM-based op.
FLOAT16_CPU_EMULATED = _GEMM


def emulates_float16(device_types: Iterable[str]) -> bool:
    """Whether a float16 graph for `device_types` (``'cpu'``, ``'gpu'``...) computes its GEMMs
    in FP32 between casts: MXNet 1.9.1 has float16 GEMMs on GPUs only, and one graph runs on
    every device it is bound on.  No device at all means a GPU (graph files target GPUs).

    >>> emulates_float16(['gpu', 'cpu']), emulates_float16(['gpu']), emulates_float16([])
    (True, False, False)
    """
    return any(device != 'gpu' for device in device_types)

# Ops whose output dtype is an attribute (amp_multicast's is its widest input's: 'widest').
CAST_OPS = frozenset(('Cast', 'amp_cast'))


@functools.lru_cache(maxsize=None)
def registered_ops() -> Dict[str, str]:
    """Every operator name MXNet knows (aliases included), mapped to its canonical name."""
    size = mx_uint()
    plist = ctypes.POINTER(ctypes.c_char_p)()
    check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(plist)))
    names = [py_str(plist[i]) for i in range(size.value)]
    return {name: _registry_entry(name)[0] for name in names}


@functools.lru_cache(maxsize=None)
def _registry_entry(name):
    """``(canonical name, ((argument, type description), ...))`` of operator `name`; an alias
    and its operator share one nnvm Op, whose AtomicSymbolInfo gives the real name."""
    handle = OpHandle()
    check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(handle)))
    real, desc, key_var = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_char_p()
    ret_type = ctypes.c_char_p()
    num_args = mx_uint()
    arg_names = ctypes.POINTER(ctypes.c_char_p)()
    arg_types = ctypes.POINTER(ctypes.c_char_p)()
    arg_descs = ctypes.POINTER(ctypes.c_char_p)()
    check_call(_LIB.MXSymbolGetAtomicSymbolInfo(
        handle, ctypes.byref(real), ctypes.byref(desc), ctypes.byref(num_args),
        ctypes.byref(arg_names), ctypes.byref(arg_types), ctypes.byref(arg_descs),
        ctypes.byref(key_var), ctypes.byref(ret_type)))
    arguments = tuple((py_str(arg_names[i]), py_str(arg_types[i])) for i in range(num_args.value))
    return py_str(real.value), arguments


def attributes(op: str) -> Dict[str, Optional[Tuple[str, ...]]]:
    """The attributes of operator `op` (an alias allowed; KeyError if unregistered), each mapped
    to the values it takes when they are a fixed set, else to None; tensor inputs left out."""
    out: Dict[str, Optional[Tuple[str, ...]]] = {}
    for argument, description in _registry_entry(canonical(op))[1]:
        if description.startswith('NDArray-or-Symbol'):
            continue
        choices = re.match(r'\{([^}]*)\}', description)
        out[argument] = None if choices is None else tuple(
            value.strip().strip("'") for value in choices.group(1).split(',')
            if value.strip() != 'None')
    return out


def canonical(op: str) -> str:
    """The canonical name of an operator or alias; raises KeyError if unregistered."""
    return registered_ops()[op]


def canonical_ops(ops: Iterable[str], what: str) -> List[str]:
    """Canonical names of operator names `ops`; ValueError naming option `what` (as the
    caller's interface spells it) for an unknown one."""
    if isinstance(ops, str):
        raise ValueError('%s: expected a list of operator names, got the string %r' % (what, ops))
    out = []
    for op in ops:
        try:
            out.append(canonical(op))
        except (KeyError, TypeError):
            raise ValueError('%s: operator %r is not registered in MXNet %s'
                             % (what, op, mx.__version__))
    return out


#: ``(operator, attribute, values)`` (``conditional_fp32_ops``' form): such a node runs in FP32.
Condition = Tuple[str, str, Tuple[str, ...]]


def canonical_conditions(conditions: Iterable[Tuple[str, str, Iterable[str]]], what: str
                         ) -> Tuple[Condition, ...]:
    """`conditions` (``('Activation', 'act_type', ['softrelu'])``...) checked, with canonical
    operator names and values as sorted tuples.  ValueError naming option `what` for another
    form, an unknown operator or attribute, or a value the attribute never takes."""
    if isinstance(conditions, (str, bytes)) or not isinstance(conditions, abc.Iterable):
        raise ValueError('%s: expected a list of (operator, attribute, values) triples, got %r'
                         % (what, conditions))
    out = []
    for entry in conditions:
        if (not isinstance(entry, (tuple, list)) or len(entry) != 3
                or not all(isinstance(part, str) for part in entry[:2])
                or isinstance(entry[2], (str, bytes)) or not isinstance(entry[2], abc.Iterable)
                or not all(isinstance(value, str) for value in entry[2])):
            raise ValueError("%s: expected (operator, attribute, values) triples such as "
                             "('Activation', 'act_type', ['softrelu']), got %r" % (what, entry))
        op, attribute, values = canonical_ops([entry[0]], what)[0], entry[1], tuple(sorted(set(entry[2])))
        known = attributes(op)
        if attribute not in known:
            raise ValueError('%s: operator %s has no attribute %r (its attributes: %s)'
                             % (what, entry[0], attribute, ', '.join(sorted(known)) or 'none'))
        choices = known[attribute]
        unknown = [] if choices is None else [value for value in values if value not in choices]
        if choices is not None and unknown:
            raise ValueError('%s: %s\'s %s takes none of %s (its values: %s)'
                             % (what, entry[0], attribute, ', '.join(map(repr, unknown)),
                                ', '.join(map(repr, choices))))
        out.append((op, attribute, values))
    return tuple(out)


def base_class(op: str) -> str:
    """The dtype-independent class of a canonical op: one of CLASSES or 'conditional'."""
    if op in _CONDITIONAL:
        return 'conditional'
    if op.startswith('_backward') or op.startswith('_npi_backward'):
        # Autograd makes them from a forward op, whose dtypes they follow.
        return NEUTRAL
    for cls, members in ((LOW, _LOW), (FLOAT32, _FLOAT32), (WIDEST, _WIDEST), (NEUTRAL, _NEUTRAL)):
        if op in members:
            return cls
    raise KeyError('operator %r has no precision class in mxamp\'s policy' % op)


def _runs_in_bfloat16_on_cpu(op, attrs):
    if op not in BFLOAT16_CPU_OPS:
        return False
    condition = _BFLOAT16_CPU_CONDITIONS.get(op)
    return condition is None or condition(attrs or {})


def exclude_matches(node_name: str, entry: str) -> bool:
    """Whether `entry` of an ``exclude`` list (a name or ``fnmatch`` pattern) names `node_name`."""
    return node_name == entry or fnmatch.fnmatchcase(node_name, entry)


def default_lp_ops(dtype: DTypeLike) -> FrozenSet[str]:
    """The operators a `Policy` for `dtype` runs in low precision by their name alone (under
    bfloat16 those of `BFLOAT16_CPU_OPS`; not BatchNorm, which follows its data): the list
    ``lp_ops_only`` replaces."""
    name = dtype_name(dtype, allowed=LOW_PRECISION)
    return frozenset(op for op in _LOW - BATCHNORM_OPS
                     if name != 'bfloat16' or op in BFLOAT16_CPU_OPS)


def _refuse_overlap(first, first_name, second, second_name):
    both = first & second
    if both:
        raise ValueError('operators both %s and %s: %s' % (first_name, second_name, ', '.join(sorted(both))))


class Rules(NamedTuple):
    """The user's rules of one conversion, which a `Policy` adds to its own: operators forced
    to FP32 (`fp32_ops`) or to low precision (`lp_ops`), node names or ``fnmatch`` patterns
    kept in FP32 (`exclude`), and contrib.amp's two rules (`mxamp.contrib_amp` alone gives
    them): `lp_ops_only`, None or the operators that replace `default_lp_ops` (those not
    named run in FP32, named ones outside it are forced to low precision), and
    `fp32_conditions`, `Condition` triples added to the policy's own.

    Made by `of`, which checks them; ``Rules()`` is no rule at all.

    Examples
    --------
    >>> Rules.of(fp32_ops=['Softmax'], exclude=['fc1'])
    Rules(fp32_ops=('SoftmaxOutput',), lp_ops=(), exclude=('fc1',), lp_ops_only=None, fp32_conditions=())
    """
    fp32_ops: Tuple[str, ...] = ()
    lp_ops: Tuple[str, ...] = ()
    exclude: Tuple[str, ...] = ()
    lp_ops_only: Optional[Tuple[str, ...]] = None
    fp32_conditions: Tuple[Condition, ...] = ()

    @classmethod
    def of(cls, *, fp32_ops: Optional[Iterable[str]] = (), lp_ops: Optional[Iterable[str]] = (),
           exclude: Optional[Iterable[str]] = (), lp_ops_only: Optional[Iterable[str]] = None,
           fp32_conditions: Optional[Iterable[Tuple[str, str, Iterable[str]]]] = ()) -> 'Rules':
        """The rules with canonical operator names (None: none); ValueError naming the
        option for an unknown operator, a malformed condition, or an operator in two
        rules that contradict each other."""
        fp32 = tuple(canonical_ops(fp32_ops or (), 'fp32_ops'))
        low = tuple(canonical_ops(lp_ops or (), 'lp_ops'))
        only = None if lp_ops_only is None else tuple(canonical_ops(lp_ops_only, 'lp_ops_only'))
        conditions = canonical_conditions(fp32_conditions or (), 'fp32_conditions')
        conditional = frozenset(op for op, _, _ in conditions)
        _refuse_overlap(frozenset(fp32), 'in fp32_ops', frozenset(only or ()), 'in lp_ops_only')
        _refuse_overlap(frozenset(fp32), 'forced to FP32', frozenset(low), 'to low precision')
        _refuse_overlap(conditional, 'in fp32_conditions', frozenset(low), 'forced to low precision')
        _refuse_overlap(conditional, 'in fp32_conditions', frozenset(only or ()), 'in lp_ops_only')
        return cls(fp32, low, tuple(exclude or ()), only, conditions)


def refuse_failing_bfloat16_ops(ops: AbstractSet[str], what: str) -> None:
    """ValueError naming option `what` when `ops` (canonical names), forced to bfloat16, hold
    one MXNet 1.9.1 cannot compute so on a CPU (`BFLOAT16_CPU_FAILS`)."""
    failing = sorted(ops & BFLOAT16_CPU_FAILS)
    if failing:
        them = 'it' if len(failing) == 1 else 'them'
        raise ValueError('%s: MXNet %s cannot compute %s in bfloat16 on a CPU (a net converted so '
                         'fails where MXNet runs it); leave %s to the policy, which keeps %s in FP32'
                         % (what, mx.__version__, ', '.join(failing), them, them))


class Policy(object):
    """Precision decisions for one target dtype.

    Parameters
    ----------
    dtype : str
        ``'float16'`` or ``'bfloat16'`` (or an equivalent numpy/MXNet dtype).
    rules : Rules
        The user's operator rules and excluded nodes (`Rules.of`; default: none).
    batchnorm_data : {'low', 'float32'}
        Whether BatchNorm's data stays in low precision or gets an FP32 cast.
    emulate_float16 : bool
        Whether float16 GEMMs compute in FP32 between casts (`emulates_float16`).
    cpu_class : str
        Under bfloat16, the CPU class the graph is for: ``'avx512_bf16'`` (default) and
        ``'amx'`` compute in bfloat16; on ``'avx2'`` and ``'avx512'`` every op computes in
        FP32, with the same parameters stored in bfloat16.
    inference : bool
        A graph for inference alone, fused by oneDNN: training-only bfloat16 rules are off
        (`_bfloat16_conv_layout`), and `fuses_into_convolution` applies.
    kernel_ops : iterable of str
        Operators a later pass puts on fast bfloat16 kernels of mxamp's
        (`mxamp.pipeline.low_precision_kernel_ops`), though MXNet's are slow.
    costs : mxamp.cost.CostModel, optional
        Keep in FP32 the layers whose data is FP32 and that are too small for low precision
        to pay on the target (``'auto'``), and the memory-bound operators whose every input
        is FP32 (`follows_inputs`).

    Examples
    --------
    >>> policy = Policy('bfloat16', Rules.of(exclude=['fc1'], fp32_ops=['Pooling']))
    >>> policy.op_class('Convolution', {}, 'conv0'), policy.op_class('Convolution', {}, 'fc1')
    ('low', 'float32')
    """
    def __init__(self, dtype: DTypeLike, rules: Rules = Rules(), *, batchnorm_data: str = 'low',
                 emulate_float16: bool = False, cpu_class: str = AVX512_BF16,
                 inference: bool = False, kernel_ops: Iterable[str] = (),
                 costs: Optional[CostModel] = None) -> None:
        self.dtype = dtype_name(dtype, allowed=LOW_PRECISION)
        fp32, low = frozenset(rules.fp32_ops), frozenset(rules.lp_ops)
        if self.dtype == 'bfloat16':
            refuse_failing_bfloat16_ops(low, 'lp_ops')
        if rules.lp_ops_only is not None:
            # Rules.of refused the overlaps, so neither set gains what the other holds.
            only = frozenset(rules.lp_ops_only)
            default = default_lp_ops(self.dtype)
            if self.dtype == 'bfloat16':
                refuse_failing_bfloat16_ops(only - default, 'lp_ops_only')
            fp32 |= default - only - low
            low |= only - default
        conditions: Dict[str, List[Tuple[str, FrozenSet[str]]]] = {}
        for op, attribute, values in rules.fp32_conditions:
            conditions.setdefault(op, []).append((attribute, frozenset(values)))
        self.fp32_ops, self.lp_ops = fp32, low
        self.fp32_conditions = {op: tuple(entries) for op, entries in conditions.items()}
        self.exclude = tuple(rules.exclude)
        if batchnorm_data not in (LOW, FLOAT32):
            raise ValueError("batchnorm_data=%r: expected 'low' or 'float32'" % (batchnorm_data,))
        self.batchnorm_data = batchnorm_data
        self.emulate_float16 = bool(emulate_float16) and self.dtype == 'float16'
        if cpu_class not in CPU_CLASSES:
            raise ValueError('cpu_class=%r: expected one of %s' % (cpu_class, ', '.join(CPU_CLASSES)))
        self.cpu_class = cpu_class
        self.inference = bool(inference)
        self.kernel_ops = frozenset(kernel_ops)
        self.costs = costs

    def __repr__(self) -> str:
        conditions = sorted((op, attribute, tuple(sorted(values)))
                            for op, rules in self.fp32_conditions.items() for attribute, values in rules)
        return ('Policy(%r, fp32_ops=%s, lp_ops=%s, exclude=%s, batchnorm_data=%r, '
                'cpu_class=%r%s%s%s%s)'
                % (self.dtype, sorted(self.fp32_ops), sorted(self.lp_ops), list(self.exclude),
                   self.batchnorm_data, self.cpu_class,
                   ', fp32_conditions=%s' % conditions if conditions else '',
                   ', inference=True' if self.inference else '',
                   ', kernel_ops=%s' % sorted(self.kernel_ops) if self.kernel_ops else '',
                   ', costs=%r' % self.costs if self.costs is not None else ''))

    def with_costs(self, costs: CostModel) -> 'Policy':
        """This policy weighing each layer's cost under `costs` (what ``'auto'`` does)."""
        weighed = copy.copy(self)
        weighed.costs = costs
        return weighed

    def is_excluded(self, node_name: str) -> bool:
        return any(exclude_matches(node_name, pattern) for pattern in self.exclude)

    def op_class(self, op: str, attrs: Optional[Mapping[str, str]] = None,
                 node_name: Optional[str] = None) -> str:
        """Class of one node (`op` may be an alias; `attrs` resolve conditions, `node_name`
        applies `exclude`): ``'low'``, ``'float32'``, ``'widest'`` or ``'neutral'``."""
        op = canonical(op)
        if self._user_keeps_float32(op, attrs, node_name):
            return FLOAT32
        if op in self.lp_ops:
            return LOW
        cls = base_class(op)
        if cls == 'conditional':
            key, fp32_values = _CONDITIONAL[op]
            value = (attrs or {}).get(key)
            cls = FLOAT32 if value in fp32_values and not (
                self.dtype == 'bfloat16' and (op, value) in _BFLOAT16_NEUTRAL) else NEUTRAL
        if op in _FLOAT32_INPUTS and self.batchnorm_data == FLOAT32:
            cls = FLOAT32
        if (self.dtype == 'bfloat16' and cls != FLOAT32
                and not _runs_in_bfloat16_on_cpu(op, attrs) and op not in self.kernel_ops):
            # No bfloat16 kernel, or a slow one: under bfloat16 the op runs in FP32.
            cls = FLOAT32
        return cls

    @property
    def bfloat16_storage_only(self) -> bool:
        """Whether this is a bfloat16 policy for a CPU that computes no bfloat16: parameters
        are stored in bfloat16 and cast to FP32 where used."""
        return self.dtype == 'bfloat16' and not computes_bfloat16(self.cpu_class)

    def computes_low(self, op: str, attrs: Optional[Mapping[str, str]] = None) -> bool:
        """Whether a node `op_class` puts in low precision computes in it on the target: always
        under float16 (see `computes_in_float32`); under bfloat16 where the CPU class has a
        kernel, or for the user's `lp_ops` on a class that computes bfloat16."""
        if self.dtype != 'bfloat16':
            return True
        op = canonical(op)
        if op in self.lp_ops or op in self.kernel_ops:
            return not self.bfloat16_storage_only
        return op in BFLOAT16_CPU_OPS_BY_CLASS[self.cpu_class]

    def computes_low_nowhere(self, op: str) -> bool:
        """Whether no CPU class computes `op` in the target dtype (bfloat16, and no bfloat16
        kernel of MXNet 1.9.1 that pays): such a node computes in FP32 wherever it runs."""
        op = canonical(op)
        return self.dtype == 'bfloat16' and op not in BFLOAT16_CPU_OPS and \
            op not in self.lp_ops and op not in self.kernel_ops

    def _user_keeps_float32(self, op: str, attrs: Optional[Mapping[str, str]],
                            node_name: Optional[str]) -> bool:
        """Whether `exclude`, `fp32_ops` or `fp32_conditions` keep the node in FP32."""
        if node_name is not None and self.is_excluded(node_name):
            return True
        return op in self.fp32_ops or any((attrs or {}).get(attribute) in values
                                          for attribute, values in self.fp32_conditions.get(op, ()))

    def computes_in_float32(self, op: str) -> bool:
        """Whether a low-precision node must compute in FP32 between casts (float16 on CPU)."""
        return self.emulate_float16 and canonical(op) in FLOAT16_CPU_EMULATED

    def layout(self, op: str, attrs: Optional[Mapping[str, str]] = None,
               input_shapes: Optional[Sequence[Optional[Tuple[int, ...]]]] = None) -> str:
        """How a low-precision node meets oneDNN's blocked bfloat16 kernels (`_bfloat16_conv_layout`;
        `input_shapes`: one shape or None per input)."""
        op = canonical(op)
        rule = _BFLOAT16_CPU_LAYOUT_RULES.get(op)
        if self.bfloat16_storage_only:
            return FLOAT32
        if self.dtype != 'bfloat16' or rule is None or op in self.lp_ops:
            return BLOCKED
        return rule(attrs or {}, input_shapes, self.cpu_class, training=not self.inference)

    def fuses_into_convolution(self, op: str, attrs: Optional[Mapping[str, str]] = None,
                               node_name: Optional[str] = None) -> bool:
        """Whether the node computes in bfloat16 when it reads a bfloat16 convolution that
        oneDNN fuses it into (`mxamp.graph.convolution_post_ops`): under an `inference`
        policy, for an activation whose unfused bfloat16 kernel is slow (a ReLU6), unless the
        user keeps it in FP32.  Fused it costs nothing; FP32 would put casts around it."""
        if not (self.inference and self.dtype == 'bfloat16' and computes_bfloat16(self.cpu_class)):
            return False
        op, attrs = canonical(op), attrs or {}
        condition = _FUSED_SLOW_ACTIVATIONS.get(op)
        return (condition is not None and condition(attrs)
                and not self._user_keeps_float32(op, attrs, node_name))

    def pays(self, op: str, work: Optional[float], cast_values: int = 0,
             region_work: Optional[float] = None) -> bool:
        """Whether a low-precision `op` whose data is FP32, doing `work` MFLOP a call (None:
        unknown), casting `cast_values` more values (`mxamp.graph.cast_values`) and opening a
        region of `region_work` MFLOP (`mxamp.graph.region_works`), computes faster so on the
        target: always without `costs` and for the user's `lp_ops`."""
        op = canonical(op)
        return (self.costs is None or op in self.lp_ops
                or self.costs.pays(op, work, cast_values, region_work))

    def follows_inputs(self, op: str) -> bool:
        """Whether a low-precision `op` runs in FP32 when every floating input is FP32:
        under `costs`, for the memory-bound operators (not `GEMM_OPS`), whose casts would
        cost more than low precision saves."""
        op = canonical(op)
        return self.costs is not None and op not in GEMM_OPS and op not in self.lp_ops

    def follows_data(self, op: str) -> bool:
        """Whether a low-precision node runs in FP32 when its data input is FP32."""
        return self.batchnorm_data == LOW and canonical(op) in BATCHNORM_OPS

    @staticmethod
    def index_inputs(op: str, attrs: Optional[Mapping[str, str]] = None) -> Tuple[int, ...]:
        """Input positions holding indices/conditions/shapes: never cast."""
        op = canonical(op)
        positions = _INDEX_INPUTS.get(op, ())
        if op == 'RNN' and str((attrs or {}).get('use_sequence_length', 'False')) not in ('True', '1', 'true'):
            return ()
        return positions

    @staticmethod
    def float32_inputs(op: str) -> Tuple[int, ...]:
        """Input positions kept in FP32 even when the op runs in low precision."""
        return _FLOAT32_INPUTS.get(canonical(op), ())

    @staticmethod
    def float32_outputs(op: str) -> Tuple[int, ...]:
        """Output positions that stay FP32 when the op runs in low precision."""
        return _FLOAT32_OUTPUTS.get(canonical(op), ())


class PolicyLists(NamedTuple):
    """mxamp's precision policy for one dtype and CPU class, as sorted lists of operators.

    Made by `policy_lists`.  Every forward operator MXNet 1.9.1 registers (canonical names;
    ``_backward_*`` ops follow their forward op) is in one of:
    ``low`` (contrib.amp's ``list_lp16_ops``; BatchNorm follows its data, statistics FP32),
    ``float32`` (``list_fp32_ops``; under bfloat16 also the ops without a kernel that pays,
    and the losses of ``list_loss_output_functions``), ``widest``
    (``list_widest_type_cast``) and ``neutral`` (``list_lp16_fp32_ops``).  ``conditional``
    holds `Condition` triples (``list_conditional_fp32_ops``; under bfloat16 also the values
    oneDNN lacks a kernel for).  ``computes_in_dtype``: whether ``low`` computes in the dtype
    on the class (False for bfloat16 on ``'avx2'`` and ``'avx512'``; float16's lists are a
    GPU's).  BatchNorm's FP32 parameters (``list_lp16_use_fp32_params``) are
    `Policy.float32_inputs`.
    """
    dtype: str
    cpu_class: str
    low: Tuple[str, ...]
    float32: Tuple[str, ...]
    widest: Tuple[str, ...]
    neutral: Tuple[str, ...]
    conditional: Tuple[Condition, ...]
    computes_in_dtype: bool


def policy_lists(dtype: DTypeLike = 'bfloat16', *, cpu_class: Optional[str] = None) -> PolicyLists:
    """The default policy for `dtype` on a CPU class, as lists (contrib.amp's ``list_*_ops``).

    Parameters
    ----------
    dtype : str
        ``'bfloat16'`` (default) or ``'float16'`` (or an alias).
    cpu_class : str, optional
        None or ``'auto'``: this machine's class; or one of `mxamp.hardware.CPU_CLASSES`.

    Raises
    ------
    ValueError
        An unknown dtype (``'float32'`` included) or CPU class.

    Examples
    --------
    >>> lists = mxamp.policy_lists('float16')
    >>> 'Convolution' in lists.low, 'softmax' in lists.float32, 'Concat' in lists.widest
    (True, True, True)
    """
    name = dtype_name(dtype, allowed=LOW_PRECISION)
    if cpu_class is None or (isinstance(cpu_class, str) and cpu_class.lower() == 'auto'):
        klass = this_cpu_class()
    elif cpu_class in CPU_CLASSES:
        klass = cpu_class
    else:
        raise ValueError("cpu_class=%r: expected None, 'auto' or one of %s"
                         % (cpu_class, ', '.join(CPU_CLASSES)))
    return _policy_lists(name, klass)


# Set beside the probed attribute: without an explicit kernel a bfloat16 Pooling is always FP32.
_PROBE_ATTRS = {'Pooling': {'kernel': '(2, 2)'}}


@functools.lru_cache(maxsize=None)
def _policy_lists(dtype: str, klass: str) -> PolicyLists:
    policy = Policy(dtype, cpu_class=klass)
    members: Dict[str, List[str]] = {cls: [] for cls in CLASSES}
    conditional: List[Condition] = []
    for op in sorted(set(registered_ops().values())):
        if op.startswith('_backward') or op.startswith('_npi_backward'):
            continue
        conditions = _probed_conditions(policy, op)
        conditional.extend(conditions)
        # The list an operator is in: its class where no condition holds.
        attrs = dict(_PROBE_ATTRS.get(op, {}))
        for _, attribute, values in conditions:
            attrs[attribute] = next(v for v in attributes(op)[attribute] or () if v not in values)
        members[policy.op_class(op, attrs)].append(op)
    return PolicyLists(dtype, klass, tuple(members[LOW]), tuple(members[FLOAT32]),
                       tuple(members[WIDEST]), tuple(members[NEUTRAL]), tuple(conditional),
                       dtype == 'float16' or computes_bfloat16(klass))


def _probed_conditions(policy, op):
    """The `Condition` triples under which `policy` runs `op` in FP32: per attribute with a
    fixed set of values, those that put it in FP32, when some but not all do."""
    if op not in _CONDITIONAL and op not in _BFLOAT16_CPU_CONDITIONS:
        return []
    base = _PROBE_ATTRS.get(op, {})
    found = []
    for attribute, choices in sorted(attributes(op).items()):
        forcing = tuple(sorted(value for value in choices or ()
                               if policy.op_class(op, dict(base, **{attribute: value})) == FLOAT32))
        if forcing and len(forcing) < len(choices or ()):
            found.append((op, attribute, forcing))
    return found
