"""The single-rank MoE layer as registered ``torch.library`` ops, so that ``torch.compile`` traces it.

Importing this module registers three ops in the ``flashdmoe`` namespace (torch >= 2.4 ``custom_op`` API;
``torch.ops.flashdmoe.moe``, below, is the forward returning ``y`` only):

``torch.ops.flashdmoe.moe_forward(x, router_weight, w1, w2, top_k, activation="gelu", normalize_topk=True,
capacity_factor=None) -> (y, expert, weight, row, counts)``
    ``x [T, H]``, ``router_weight [E, H]``, ``w1 [E, H, I or 2I]``, ``w2 [E, I, H]``, one float dtype and
    device (any strides). Returns ``y [T, H]`` in ``x.dtype`` and the routing it used: ``expert [T, k]``
    int32 (by descending probability), ``weight [T, k]`` float32 combine weights, ``row [T, k]`` int32 (the
    choice's row in the expert-packed buffer: kept choices grouped by expert in expert order, token order
    within an expert; ``-1`` = dropped by capacity) and ``counts [E]`` int32 (choices per expert before
    capacity). Differentiable in ``x``, ``router_weight``, ``w1`` and ``w2`` through ``y``; the routing
    outputs are not differentiable. Semantics are :func:`flashdmoe.reference.moe`'s.

``torch.ops.flashdmoe.moe_backward(dy, x, router_weight, w1, w2, expert, weight, row, activation,
normalize_topk, needs) -> (dx, d_router_weight, dw1, dw2)``
    The gradients of ``<dy, y>`` on the saved routing (the gate is not re-run). ``needs`` is four bools;
    a gradient not needed comes back as an empty tensor (``numel() == 0``).

Implementations: on CPU the forward is :mod:`flashdmoe.reference` (``route``, ``keep_mask``,
``moe_fixed_routing``) and the backward is the chain rule through ``moe_fixed_routing`` written out in
tensor operations (an op's implementation runs below the autograd dispatch key, where autograd records
nothing; ``torch.func.vjp`` would, but its wrapper tensors break under dispatch modes such as opcheck's
schema check). On CUDA the forward is the fused kernel
(:func:`flashdmoe.cuda_backend.fused_forward`) and the backward is
:func:`flashdmoe.backward.expert_backward.expert_backward`. The fake implementations give every output's shape and
dtype from the inputs' alone (no data-dependent shapes), so the ops trace under ``torch.compile`` and
export. Second derivatives are not implemented.

:func:`moe` is the Python entry point (``return_aux`` included); ``torch.ops.flashdmoe.moe`` is the same
forward returning ``y`` only. Both run one rank: the expert-parallel team paths stay eager.
"""

from typing import Optional, Sequence, Tuple

import torch

from flashdmoe import reference
from flashdmoe.backward.expert_backward import expert_backward, packed_rows
from flashdmoe.validation import validate_capacity_factor, validate_moe_inputs
from flashdmoe.weight_checks import check_finite_weights

__all__ = ["moe", "moe_forward", "moe_backward", "packed_rows"]

_NAMESPACE = "flashdmoe"


def _check_inputs(x, router_weight, w1, w2, top_k, activation, capacity_factor) -> None:
    """The checks of :func:`flashdmoe.moe` (ValueError naming the argument) minus contiguity: the ops take
    any strides (a model's transposed weight views included). Run on meta stand-ins so that it reads
    shapes and dtypes only, under fake tensors too."""
    for name, tensor in (("x", x), ("router_weight", router_weight), ("w1", w1), ("w2", w2)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != x.device:
            raise ValueError(f"{name}: on device {tensor.device} but x is on {x.device}; all must match")
    stand_ins = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in (x, router_weight, w1, w2)]
    validate_moe_inputs(*stand_ins, top_k=top_k, activation=activation, capacity_factor=capacity_factor)


# ----------------------------------------------------------------------------------------------------------
# moe_forward
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_NAMESPACE}::moe_forward", mutates_args=())
def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    activation: str = "gelu",
    normalize_topk: bool = True,
    capacity_factor: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference implementation (CPU, and any device without its own registration)."""
    _check_inputs(x, router_weight, w1, w2, top_k, activation, capacity_factor)
    if x.device.type == "cpu" and x.shape[0] > 0 and not bool(torch.isfinite(x).all()):
        raise ValueError("x: contains non-finite values (NaN or Inf); expected finite input")
    check_finite_weights((("router_weight", router_weight), ("w1", w1), ("w2", w2)))
    num_experts = router_weight.shape[0]
    routing = reference.route(x, router_weight, top_k, normalize_topk)
    capacity = reference.expert_capacity(x.shape[0], top_k, num_experts, capacity_factor)
    keep = reference.keep_mask(routing.experts, num_experts, capacity)
    y = reference.moe_fixed_routing(x, router_weight, w1, w2, routing.experts, keep, activation=activation,
                                    normalize_topk=normalize_topk)
    counts = torch.bincount(routing.experts.reshape(-1), minlength=num_experts)
    return (y, routing.experts.to(torch.int32), routing.weights.to(torch.float32),
            packed_rows(routing.experts, keep, num_experts), counts.to(torch.int32))


@moe_forward.register_kernel("cuda")
def _moe_forward_cuda(x, router_weight, w1, w2, top_k, activation="gelu", normalize_topk=True,
                      capacity_factor=None):
    _check_inputs(x, router_weight, w1, w2, top_k, activation, capacity_factor)
    # queued, not waited for: its error surfaces where the kernel's do (flashdmoe.weight_checks)
    check_finite_weights((("router_weight", router_weight), ("w1", w1), ("w2", w2)), asynchronous=True)
    from flashdmoe import cuda_backend

    # The kernel reads dense row-major operands; a transposed view (a Hugging Face expert layout that
    # patch_moe did not re-lay) costs one copy here.
    y, routing = cuda_backend.fused_forward(
        x.contiguous(), router_weight.contiguous(), w1.contiguous(), w2.contiguous(), top_k=top_k,
        activation=activation, normalize_topk=normalize_topk, capacity_factor=capacity_factor)
    # the routing tensors are views of one block: a custom op's outputs may not alias each other
    return y, routing.expert.clone(), routing.weight.clone(), routing.row.clone(), routing.counts.clone()


@moe_forward.register_fake
def _moe_forward_fake(x, router_weight, w1, w2, top_k, activation="gelu", normalize_topk=True,
                      capacity_factor=None):
    _check_inputs(x, router_weight, w1, w2, top_k, activation, capacity_factor)
    tokens, experts = x.shape[0], router_weight.shape[0]
    return (x.new_empty(x.shape), x.new_empty((tokens, top_k), dtype=torch.int32),
            x.new_empty((tokens, top_k), dtype=torch.float32), x.new_empty((tokens, top_k), dtype=torch.int32),
            x.new_empty((experts,), dtype=torch.int32))


# ----------------------------------------------------------------------------------------------------------
# moe_backward
# ----------------------------------------------------------------------------------------------------------


def _check_needs(needs: Sequence[bool]) -> None:
    if len(needs) != 4:
        raise ValueError(f"needs={list(needs)!r}: expected 4 bools (x, router_weight, w1, w2)")


@torch.library.custom_op(f"{_NAMESPACE}::moe_backward", mutates_args=())
def moe_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    expert: torch.Tensor,
    weight: torch.Tensor,
    row: torch.Tensor,
    activation: str,
    normalize_topk: bool,
    needs: Sequence[bool],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU implementation: :func:`flashdmoe.backward.expert_backward.expert_backward` (the chain rule through
    :func:`flashdmoe.reference.moe_fixed_routing`, as on CUDA) with the combine weights recomputed in the
    reference's compute dtype (the saved ``weight`` is float32, which would round float64 gradients)."""
    weights = reference.combine_weights(reference.router_probs(x, router_weight), expert.long(), normalize_topk)
    return _backward_on_saved_routing(dy, x, router_weight, w1, w2, expert, weights, row, activation,
                                      normalize_topk, needs)


def _backward_on_saved_routing(dy, x, router_weight, w1, w2, expert, weight, row, activation, normalize_topk, needs):
    _check_needs(needs)
    inputs = (x, router_weight, w1, w2)
    grads = expert_backward(*(t.contiguous() for t in inputs), expert, weight, row, dy.contiguous(),
                            activation=activation, normalize_topk=normalize_topk, needs=tuple(bool(n) for n in needs))
    return tuple(g if need and g is not None else t.new_empty(0) for g, t, need in zip(grads, inputs, needs))


@moe_backward.register_kernel("cuda")
def _moe_backward_cuda(dy, x, router_weight, w1, w2, expert, weight, row, activation, normalize_topk, needs):
    return _backward_on_saved_routing(dy, x, router_weight, w1, w2, expert, weight, row, activation,
                                      normalize_topk, needs)


@moe_backward.register_fake
def _moe_backward_fake(dy, x, router_weight, w1, w2, expert, weight, row, activation, normalize_topk, needs):
    _check_needs(needs)
    return tuple(t.new_empty(t.shape) if need else t.new_empty(0)
                 for t, need in zip((x, router_weight, w1, w2), needs))


# ----------------------------------------------------------------------------------------------------------
# Autograd: moe_forward's backward is moe_backward on the routing the forward returned
# ----------------------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x, router_weight, w1, w2, _top_k, activation, normalize_topk, _capacity_factor = inputs
    _, expert, weight, row, counts = output
    ctx.mark_non_differentiable(expert, weight, row, counts)
    ctx.save_for_backward(x, router_weight, w1, w2, expert, weight, row)
    ctx.activation = activation
    ctx.normalize_topk = normalize_topk


def _backward(ctx, dy, *_routing_grads):
    x, router_weight, w1, w2, expert, weight, row = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:4]]
    grads = torch.ops.flashdmoe.moe_backward(dy, x, router_weight, w1, w2, expert, weight, row, ctx.activation,
                                             ctx.normalize_topk, needs)
    return tuple(g if need else None for g, need in zip(grads, needs)) + (None,) * 4


moe_forward.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------
# y only: torch.ops.flashdmoe.moe and the Python entry point
# ----------------------------------------------------------------------------------------------------------

torch.library.define(
    f"{_NAMESPACE}::moe",
    "(Tensor x, Tensor router_weight, Tensor w1, Tensor w2, int top_k, str activation=\"gelu\", "
    "bool normalize_topk=True, float? capacity_factor=None) -> Tensor",
)


# Composite: under autograd and compile it decomposes into moe_forward, whose autograd and fake it uses.
@torch.library.impl(f"{_NAMESPACE}::moe", "CompositeImplicitAutograd")
def _moe_y(x, router_weight, w1, w2, top_k, activation="gelu", normalize_topk=True, capacity_factor=None):
    return torch.ops.flashdmoe.moe_forward(x, router_weight, w1, w2, top_k, activation, normalize_topk,
                                           capacity_factor)[0]


def moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    activation: str = "gelu",
    normalize_topk: bool = True,
    capacity_factor: Optional[float] = None,
    return_aux: bool = False,
):
    """:func:`flashdmoe.moe` on one rank through the registered op (traceable by ``torch.compile``).

    Arguments and result as :func:`flashdmoe.reference.moe`: ``y [T, H]`` in ``x.dtype``, or ``(y, aux)``
    with :class:`flashdmoe.reference.MoEAux` (``counts [E]`` int64, ``dropped``, the Switch loss
    ``E * sum_e f_e * mean_t p[t, e]``, differentiable through ``p`` recomputed from ``x`` and the router).
    """
    if not isinstance(normalize_topk, bool):
        raise ValueError(f"normalize_topk={normalize_topk!r}: expected True or False")
    if not isinstance(return_aux, bool):
        raise ValueError(f"return_aux={return_aux!r}: expected True or False")
    capacity_factor = validate_capacity_factor(capacity_factor)  # the schema's float?: an int 2 becomes 2.0
    y, _expert, _weight, row, counts = torch.ops.flashdmoe.moe_forward(
        x, router_weight, w1, w2, top_k, activation, normalize_topk, capacity_factor)
    if not return_aux:
        return y
    tokens, num_experts = x.shape[0], router_weight.shape[0]
    dtype = reference.compute_dtype(x.dtype)
    probs = torch.softmax(x.to(dtype) @ router_weight.to(dtype).T, dim=-1)
    # max(., 1): with T == 0 both factors are zero vectors and the loss is exactly 0 (as the reference's)
    fraction_routed = counts.to(dtype) / max(tokens * top_k, 1)
    aux_loss = num_experts * (fraction_routed * (probs.sum(dim=0) / max(tokens, 1))).sum()
    return y, reference.MoEAux(counts=counts.long(), dropped=(row < 0).sum().long(), aux_loss=aux_loss)
