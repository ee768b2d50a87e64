"""What graded exercise code may reach in a module, as it runs (guards.py): an allow-list per module, by name.

A module not listed here is out of reach, whatever name holds it; a name not listed under its module is refused
with what an exercise uses instead. torch.distributed lists the questions a rank asks (its rank, its groups) and
``new_group``: data moves between ranks through lablib's traced calls (``lablib.all_reduce``, ``lablib.send``,
...), which the checks count. Nothing here reads or writes files, seeds a random generator, compiles code or
reaches the interpreter.
"""
from __future__ import annotations


def _words(text: str) -> frozenset:
    return frozenset(text.split())


TORCH = _words("""
    Tensor Size device dtype finfo iinfo
    float float16 float32 float64 half bfloat16 double int int8 int16 int32 int64 long short uint8 bool
    complex64 complex128 cfloat
    no_grad enable_grad inference_mode set_grad_enabled is_grad_enabled is_tensor is_floating_point numel
    tensor as_tensor zeros zeros_like ones ones_like empty empty_like full full_like arange linspace logspace eye
    rand rand_like randn randn_like randint randint_like randperm multinomial bernoulli normal
    cat concat concatenate stack hstack vstack dstack chunk split tensor_split unbind narrow select index_select
    masked_select take take_along_dim gather scatter scatter_add scatter_reduce index_add index_copy index_fill
    reshape flatten unflatten squeeze unsqueeze permute transpose swapaxes movedim t flip roll repeat_interleave
    tile broadcast_to broadcast_tensors expand_copy tril triu diag diagonal diag_embed block_diag meshgrid
    clone where nonzero argwhere masked_fill isin bucketize searchsorted unique unique_consecutive
    sort argsort topk kthvalue msort cumsum cumprod cummax cummin logcumsumexp diff bincount histc count_nonzero
    sum mean median nanmean nansum prod std var std_mean var_mean amax amin aminmax max min maximum minimum
    argmax argmin all any norm dist logsumexp softmax log_softmax
    abs neg sign sqrt rsqrt square exp exp2 expm1 log log2 log10 log1p pow float_power sin cos tan tanh sigmoid
    erf erfc relu clamp clip floor ceil round trunc frac fmod remainder reciprocal lerp hypot atan2 logaddexp
    logaddexp2 add sub subtract mul multiply div divide true_divide floor_divide
    matmul mm bmm mv dot vdot outer inner einsum tensordot addmm baddbmm addmv kron cross trace
    eq ne lt le gt ge equal allclose isclose isfinite isinf isnan isneginf isposinf nan_to_num logical_and
    logical_or logical_not logical_xor bitwise_and bitwise_or bitwise_xor bitwise_not
    autograd nn distributed cuda linalg
""")

MODULES: dict[str, frozenset] = {
    "torch": TORCH,
    "torch.autograd": _words("Function backward grad"),
    "torch.nn": _words("functional Module Parameter Linear LayerNorm Sequential ModuleList GELU ReLU"),
    "torch.nn.functional": _words("""
        linear bilinear gelu relu relu6 leaky_relu elu selu celu silu mish sigmoid tanh softplus softsign hardtanh
        glu logsigmoid softmax softmin log_softmax gumbel_softmax normalize layer_norm rms_norm group_norm
        batch_norm dropout one_hot embedding pad cosine_similarity pairwise_distance
        scaled_dot_product_attention mse_loss l1_loss smooth_l1_loss huber_loss cross_entropy nll_loss kl_div
        binary_cross_entropy binary_cross_entropy_with_logits"""),
    "torch.distributed": _words("""
        get_rank get_world_size get_group_rank get_global_rank get_process_group_ranks get_backend is_initialized
        ReduceOp new_group"""),
    "torch.cuda": _words("is_available synchronize current_device device_count"),
    "torch.linalg": _words("vector_norm matrix_norm norm"),
    "math": _words("""
        pi e tau inf nan ceil floor trunc sqrt isqrt exp expm1 log log2 log10 log1p pow fabs fmod copysign
        sin cos tan asin acos atan atan2 sinh cosh tanh erf erfc gamma lgamma hypot dist gcd lcm comb perm
        factorial prod fsum isclose isfinite isinf isnan degrees radians"""),
    "lablib": _words("""
        all_reduce all_gather reduce_scatter broadcast all_to_all barrier send recv isend irecv exchange attend
        expert span device to_device"""),
    "functools": _words("partial reduce cache lru_cache cmp_to_key"),
    "itertools": _words("""
        accumulate chain combinations combinations_with_replacement count cycle groupby islice pairwise permutations
        product repeat starmap zip_longest"""),
    "collections": _words("defaultdict deque OrderedDict Counter namedtuple"),
}
