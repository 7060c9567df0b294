"""Expert-parallel MoE on CPUs over ``torch.distributed`` (gloo): the path Ray runs when there is no GPU.

Each process is one rank: it holds only its own tokens ``x [T_r, H]`` (``T_r`` may differ between ranks,
0 included), the replicated router ``[E, H]`` and its expert shard ``w1 [L, H, I or 2I]``,
``w2 [L, I, H]`` (global experts ``[rank * L, (rank + 1) * L)``). One call on every rank computes
exactly what :func:`flashdmoe.reference.moe_expert_parallel` computes for all ranks in one process:

1. **gate** (local): :func:`flashdmoe.reference.route` with the replicated router, then the capacity
   limit per (source rank, expert) pair, ``ceil(c * T_r * k / E)``;
2. **dispatch**: the kept choices are ordered by global expert (so by destination rank, then local
   expert) and token; per-expert row counts are exchanged first with one ``all_to_all_single``, then
   the rows with a second, variable-size ``all_to_all_single``;
3. **experts** (local): :func:`flashdmoe.reference.expert_ffn` per local expert over the rows received
   from every source;
4. **combine**: the results return with the reverse ``all_to_all_single`` and the source forms
   ``y[t] = sum_j w[t, j] * FFN(x[t])`` in fixed ``j`` order (:func:`flashdmoe.reference.weighted_sum`).

Why ``all_to_all_single`` with split sizes: gloo in torch >= 2.4 implements it for uneven splits (any
float dtype and int64, empty splits included), whereas its list form ``all_to_all`` requires equal
tensor sizes on every pair; one call per exchange keeps the message count at ``P - 1`` per rank.

Autograd: the exchange + expert compute is one :class:`torch.autograd.Function` whose backward sends the
output gradients to the expert owners (same splits as the dispatch), differentiates the local experts,
and returns the row gradients with the reverse exchange, so ``dx`` is complete on every rank and
``dw1``/``dw2`` stay on the owner. The router is replicated, so the gradient of the *sum of all ranks'
losses* with respect to it is the sum of every rank's local contribution: the backward all-reduces it
(SUM), and every rank ends with the same full ``router_weight.grad`` (what the single-process reference
gives for its one shared router).

Collective discipline (gloo matches collectives by call order, so every rank must issue the same
sequence): every rank calls the forward, and every rank calls backward on its output (or none does).
Zero-size "anchor" tensors that require grad keep the autograd nodes present on every rank even when
some rank's inputs do not require grad, and the router all-reduce is made to depend on the exchange's
backward so the two always run in the same order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashdmoe import reference
from flashdmoe.validation import ACTIVATIONS, validate_moe_inputs

__all__ = ["TrafficCounter", "expert_parallel_moe"]


@dataclass
class TrafficCounter:
    """Bytes this rank exchanged with *other* ranks (rows it keeps for itself are not counted).

    Attributes:
        bytes_sent: payload handed to ``all_to_all_single`` for other ranks (rows, results, gradients and
            the per-expert count messages), forward and backward.
        bytes_received: the same, received.
        rows_sent_remote: token rows dispatched to other ranks' experts by forward passes.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    rows_sent_remote: int = 0

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.rows_sent_remote = 0


def _exchange(tensor: torch.Tensor, output_splits: list[int], input_splits: list[int], rank: int,
              group: dist.ProcessGroup | None, traffic: TrafficCounter | None) -> torch.Tensor:
    """``all_to_all_single`` of the rows of ``tensor [sum(input_splits), ...]``; returns
    ``[sum(output_splits), ...]`` in ``tensor``'s dtype, rows ordered by source rank."""
    tensor = tensor.contiguous()
    output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
    dist.all_to_all_single(output, tensor, output_splits, input_splits, group=group)
    if traffic is not None:
        row_bytes = tensor.element_size() * math.prod(tensor.shape[1:])
        traffic.bytes_sent += row_bytes * (sum(input_splits) - input_splits[rank])
        traffic.bytes_received += row_bytes * (sum(output_splits) - output_splits[rank])
    return output


class _SumAcrossRanksInBackward(torch.autograd.Function):
    """Identity on the replicated router whose backward all-reduces (SUM) the gradient over the group."""

    @staticmethod
    def forward(ctx, anchor, router_weight, group):
        ctx.group = group
        return router_weight.view_as(router_weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return None, grad, None


class _DispatchExpertsCombine(torch.autograd.Function):
    """Dispatch kept choices to their owners, run the local experts, bring the results back.

    Inputs: ``x_compute [T, H]`` (compute dtype), ``w1 [L, H, .]``, ``w2 [L, I, H]``, the routing
    ``experts [T, k]`` int64 and ``keep [T, k]`` bool. Output: ``choice_outputs [T, k, H]`` in the compute
    dtype, the expert output of every kept choice and zeros for dropped ones.
    """

    @staticmethod
    def forward(ctx, anchor, router_alias, x_compute, w1, w2, experts, keep, activation, transport_dtype,
                build_graph, group, traffic):
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        tokens, top_k = experts.shape
        hidden = x_compute.shape[1]
        local_experts = w1.shape[0]
        num_experts = local_experts * world_size

        # Kept choices ordered by global expert (= destination rank, then local expert), then token.
        flat_experts = experts.reshape(-1)
        kept_choices = torch.nonzero(keep.reshape(-1), as_tuple=False).reshape(-1)
        order = torch.sort(flat_experts[kept_choices], stable=True).indices
        sent_choices = kept_choices[order]                                   # [N_send] flat t*k+j
        sent_counts = torch.bincount(flat_experts[sent_choices], minlength=num_experts)  # [E]
        input_splits = sent_counts.view(world_size, local_experts).sum(1).tolist()

        # received_counts[src * L + l]: rows source `src` sends to this rank's local expert l.
        received_counts = _exchange(sent_counts, [local_experts] * world_size, [local_experts] * world_size,
                                    rank, group, traffic)
        output_splits = received_counts.view(world_size, local_experts).sum(1).tolist()

        # Rows travel in the storage dtype (exact: x_compute is a widened copy of it).
        rows = x_compute[sent_choices // top_k].to(transport_dtype)
        received = _exchange(rows, output_splits, input_splits, rank, group, traffic)
        if traffic is not None:
            traffic.rows_sent_remote += sum(input_splits) - input_splits[rank]

        # Group the received rows by local expert (sources in rank order, rows in arrival order).
        received_expert = torch.repeat_interleave(
            torch.arange(local_experts).repeat(world_size), received_counts)
        by_expert = torch.sort(received_expert, stable=True).indices
        rows_per_expert = torch.bincount(received_expert, minlength=local_experts).tolist()

        # With grad mode on (the caller's), keep the local expert graph for backward: it runs there on
        # the gradients that arrive for these rows, without recomputing the experts.
        compute_dtype = x_compute.dtype
        received_leaf = received.to(compute_dtype).detach().requires_grad_(build_graph)
        w1_leaf = w1.detach().requires_grad_(build_graph)
        w2_leaf = w2.detach().requires_grad_(build_graph)
        with torch.set_grad_enabled(build_graph):
            grouped = received_leaf[by_expert].split(rows_per_expert)
            # every expert runs, even on 0 rows, so w1/w2 always get a (zero) gradient
            results_grouped = torch.cat([
                reference.expert_ffn(grouped[local], w1_leaf[local], w2_leaf[local], activation)
                for local in range(local_experts)
            ]) if local_experts else received_leaf.new_zeros(0, hidden)
            results = torch.empty_like(results_grouped).index_copy(0, by_expert, results_grouped)

        returned = _exchange(results.detach(), input_splits, output_splits, rank, group, traffic)
        choice_outputs = returned.new_zeros(tokens * top_k, hidden).index_copy(0, sent_choices, returned)

        ctx.group, ctx.traffic = group, traffic
        ctx.splits = (input_splits, output_splits)
        ctx.shape = (tokens, top_k, hidden)
        ctx.graph = (received_leaf, w1_leaf, w2_leaf, results) if build_graph else None
        ctx.save_for_backward(sent_choices)
        return choice_outputs.view(tokens, top_k, hidden)

    @staticmethod
    def backward(ctx, grad_choice_outputs):
        (sent_choices,) = ctx.saved_tensors
        input_splits, output_splits = ctx.splits
        group, traffic = ctx.group, ctx.traffic
        rank = dist.get_rank(group)
        tokens, top_k, hidden = ctx.shape
        if ctx.graph is None:
            raise RuntimeError("expert_parallel_moe: backward ran twice through one forward (retain_graph); "
                               "run the forward again for a second backward")
        received_leaf, w1_leaf, w2_leaf, results = ctx.graph
        ctx.graph = None  # free the saved expert graph once used

        # Output gradients travel to the owners exactly like the rows did.
        grad_sent = grad_choice_outputs.reshape(tokens * top_k, hidden)[sent_choices]
        grad_results = _exchange(grad_sent, output_splits, input_splits, rank, group, traffic)
        grad_received, grad_w1, grad_w2 = torch.autograd.grad(
            results, (received_leaf, w1_leaf, w2_leaf), grad_results, allow_unused=True)
        grad_w1 = torch.zeros_like(w1_leaf) if grad_w1 is None else grad_w1
        grad_w2 = torch.zeros_like(w2_leaf) if grad_w2 is None else grad_w2
        if grad_received is None:
            grad_received = torch.zeros_like(received_leaf)

        # Row gradients come back to the sources; a token's k choices are summed in fixed j order.
        grad_rows = _exchange(grad_received, input_splits, output_splits, rank, group, traffic)
        grad_choices = grad_rows.new_zeros(tokens * top_k, hidden).index_copy(0, sent_choices, grad_rows)
        grad_x = grad_choices.view(tokens, top_k, hidden).sum(dim=1)
        return None, None, grad_x, grad_w1, grad_w2, None, None, None, None, None, None, None


def _check_same_layer_on_every_rank(sizes, activation: str, normalize_topk: bool,
                                    capacity_factor: float | None, dtype: torch.dtype,
                                    group: dist.ProcessGroup | None) -> None:
    """All-gather the layer's description so a rank with a different layer fails loudly (ValueError on
    every rank) instead of exchanging mismatched rows."""
    fields = ("hidden", "ffn", "experts", "top_k", "local_experts", "activation", "normalize_topk",
              "capacity_factor (x1e9)", "dtype")
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    mine = torch.tensor([sizes.hidden, sizes.ffn, sizes.experts, sizes.top_k, sizes.local_experts,
                         ACTIVATIONS.index(activation), int(normalize_topk),
                         -1 if capacity_factor is None else round(capacity_factor * 1e9),
                         dtypes.index(dtype)], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    for other_rank, theirs in enumerate(gathered):
        differ = [name for name, a, b in zip(fields, mine.tolist(), theirs.tolist()) if a != b]
        if differ:
            raise ValueError(
                f"rank {dist.get_rank(group)} and rank {other_rank} were called with different layers "
                f"({', '.join(differ)}: {mine.tolist()} vs {theirs.tolist()} for {list(fields)}); "
                "expected the same router, expert shapes and options on every rank")


def expert_parallel_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    activation: str = "gelu",
    normalize_topk: bool = True,
    capacity_factor: float | None = None,
    return_aux: bool = False,
    group: dist.ProcessGroup | None = None,
    traffic: TrafficCounter | None = None,
):
    """This rank's part of the expert-parallel MoE layer; a collective over ``group`` (gloo, CPU tensors).

    Must be called by every rank of ``group`` with the same layer (checked: a mismatch raises
    ``ValueError`` on every rank), and if one rank calls ``backward`` through the result, all must.

    Args:
        x: ``[T, H]`` this rank's tokens (``T`` may differ between ranks and may be 0); float32,
            bfloat16, float16 or float64, contiguous, CPU.
        router_weight: ``[E, H]`` the replicated router, same dtype; identical on every rank.
        w1: ``[L, H, I]`` (``[L, H, 2I]`` for swiglu) this rank's experts ``[rank * L, (rank + 1) * L)``,
            ``E = L * world_size``.
        w2: ``[L, I, H]`` this rank's experts.
        top_k, activation, normalize_topk, capacity_factor: as :func:`flashdmoe.moe`; capacity applies per
            (source rank, expert) pair, ``ceil(capacity_factor * T * k / E)`` with this rank's ``T``.
        return_aux: also return this rank's :class:`flashdmoe.reference.MoEAux`.
        group: the process group (default: the default group).
        traffic: if given, accumulates the bytes exchanged with other ranks (forward and backward).

    Returns:
        ``y [T, H]`` in ``x.dtype`` or ``(y, MoEAux)``; differentiable. After backward, ``x.grad`` is
        complete, ``w1.grad``/``w2.grad`` are this shard's gradients, and ``router_weight.grad`` is the
        gradient summed over all ranks (the same on every rank).

    Raises:
        ValueError: bad input (naming the argument) or ranks called with different layers.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group('gloo', ...) on every rank first")
    world_size = dist.get_world_size(group)
    for name, value in (("normalize_topk", normalize_topk), ("return_aux", return_aux)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: expected True or False")
    sizes = validate_moe_inputs(x, router_weight, w1, w2, top_k=top_k, activation=activation,
                                capacity_factor=capacity_factor, world_size=world_size)
    if x.device.type != "cpu":
        raise ValueError(f"x: on device {x.device}; the gloo expert-parallel path runs on CPU tensors")
    _check_same_layer_on_every_rank(sizes, activation, normalize_topk, capacity_factor, x.dtype, group)

    grad_enabled = torch.is_grad_enabled()
    # Zero-size leaves that require grad: the autograd nodes holding collectives exist on every rank.
    anchor = torch.empty(0, requires_grad=grad_enabled)
    router = _SumAcrossRanksInBackward.apply(anchor, router_weight, group) if grad_enabled else router_weight

    compute_dtype = reference.compute_dtype(x.dtype)
    x_compute = x.to(compute_dtype)  # one widening shared by router and experts, as in the reference
    routing = reference.route(x_compute, router, top_k, normalize_topk)
    capacity = reference.expert_capacity(sizes.tokens, top_k, sizes.experts, capacity_factor)
    keep = reference.keep_mask(routing.experts, sizes.experts, capacity)

    # `router` is passed only so the router all-reduce waits for this node's backward (fixed order).
    choice_outputs = _DispatchExpertsCombine.apply(
        anchor, router, x_compute, w1, w2, routing.experts, keep, activation, x.dtype, grad_enabled, group, traffic)
    y = reference.weighted_sum(routing.weights, keep, choice_outputs).to(x.dtype)
    if not return_aux:
        return y
    return y, _aux(routing, keep)


def _aux(routing: reference.Routing, keep: torch.Tensor) -> reference.MoEAux:
    """This rank's counts ``[E]`` (before capacity), dropped choices and Switch loss
    ``E * sum_e f_e * mean_t p[t, e]`` with ``f_e = counts_e / (T * k)`` (0 when ``T == 0``)."""
    tokens, top_k = routing.experts.shape
    num_experts = routing.probs.shape[1]
    counts = torch.bincount(routing.experts.reshape(-1), minlength=num_experts)
    fraction = counts.to(routing.probs.dtype) / max(tokens * top_k, 1)
    mean_prob = routing.probs.sum(dim=0) / max(tokens, 1)
    return reference.MoEAux(counts=counts, dropped=(~keep).sum(),
                            aux_loss=num_experts * (fraction * mean_prob).sum())
