"""The expert-parallel MoE layer written once over an abstract *exchange* (CPU gloo or GPU peer memory).

One rank holds its own tokens ``x [T, H]`` (``T`` may differ between ranks, 0 included), the replicated
router ``[E, H]`` and its expert shard ``w1 [L, H, I or 2I]``, ``w2 [L, I, H]`` (global experts
``[rank * L, (rank + 1) * L)``, ``E = L * P``). :func:`moe_over_exchange` computes this rank's part of
what :func:`flashdmoe.reference.moe_expert_parallel` computes for all ranks:

1. **gate** (local): :func:`flashdmoe.reference.route` and the capacity limit per (source rank, expert)
   pair -- or a *fixed routing* (``experts [T, k]``, ``keep [T, k]``, e.g. saved by a fused kernel's
   forward), in which case only the router probabilities are recomputed and gathered at ``experts``;
2. **dispatch**: the kept choices are ordered by global expert (so by destination rank, then local
   expert) and token; the per-expert row counts travel first, then the rows;
3. **experts** (local): :func:`flashdmoe.reference.expert_ffn` per local expert over the rows received
   from every source;
4. **combine**: the results travel back and the source forms ``y[t] = sum_j w[t, j] * FFN(x[t])`` in
   fixed ``j`` order (:func:`flashdmoe.reference.weighted_sum`).

The exchange is any object with ``rank``, ``world_size``, ``device``, ``traffic`` (a
:class:`TrafficCounter` or ``None``) and two collectives that every rank calls in the same order:

* ``all_to_all(tensor, output_splits, input_splits)``: ``tensor [sum(input_splits), ...]`` (any float
  dtype or int64) sends its first ``input_splits[0]`` rows to rank 0, the next ``input_splits[1]`` to
  rank 1, ...; returns ``[sum(output_splits), ...]`` in ``tensor``'s dtype, the rows from rank 0 first.
* ``all_reduce_sum(tensor)``: the element-wise sum over ranks of ``tensor`` (same shape and dtype on every
  rank), identical on every rank; returns a new tensor of ``tensor``'s shape and dtype.

:class:`flashdmoe.parallel.ep_gloo.GlooExchange` (``torch.distributed``) and
:class:`flashdmoe.parallel.ep_peer.PeerExchange` (writes into NVSHMEM peers' symmetric memory) implement it.

Autograd: the dispatch + expert compute + combine is one :class:`torch.autograd.Function` whose backward
sends the output gradients to the expert owners (same splits as the dispatch), differentiates the local
experts, and returns the row gradients with the reverse exchange, so ``dx`` is complete on every rank and
``dw1``/``dw2`` stay on the owner. The router is replicated, so the gradient of the *sum of all ranks'
losses* with respect to it is the sum of every rank's local contribution: the backward all-reduces it,
and every rank ends with the same full router gradient.

Collective discipline: every rank calls the forward, and every rank runs the backward through it (or none
does). A zero-size "anchor" tensor that requires grad keeps the autograd nodes holding collectives present
on every rank even when some rank's inputs do not require grad, and the router all-reduce is made to
depend on the exchange's backward so the two always run in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from flashdmoe import reference

__all__ = ["Exchange", "TrafficCounter", "agree_on_layer", "check_fixed_routing", "moe_over_exchange",
           "routing_aux"]


@dataclass
class TrafficCounter:
    """Bytes this rank exchanged with *other* ranks (rows it keeps for itself are not counted).

    Attributes:
        bytes_sent: payload handed to the exchange's ``all_to_all`` for other ranks (rows, results,
            gradients, the per-expert count messages and the small layer-check message), forward and
            backward. The router gradient's all-reduce is not counted.
        bytes_received: the same, received.
        rows_sent_remote: token rows dispatched to other ranks' experts by forward passes.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    rows_sent_remote: int = 0

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.rows_sent_remote = 0


class Exchange(Protocol):
    """What :func:`moe_over_exchange` needs from a transport (see the module docstring)."""

    rank: int
    world_size: int
    device: torch.device
    traffic: TrafficCounter | None

    def all_to_all(self, tensor: torch.Tensor, output_splits: Sequence[int],
                   input_splits: Sequence[int]) -> torch.Tensor: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...


# ----------------------------------------------------------------------------------------------------------
# Agreement: every rank learns whether every rank's inputs are valid and describe the same layer
# ----------------------------------------------------------------------------------------------------------


def agree_on_layer(exchange: Exchange, error: ValueError | None, fields: Sequence[str],
                   values: Sequence[int] | None) -> list[list[int]]:
    """Exchange one small description of the layer between all ranks and raise on *every* rank if any
    rank's inputs were invalid or describe a different layer (so no rank is left waiting in a collective).

    Args:
        exchange: the transport.
        error: the ``ValueError`` this rank's own input checks raised, or ``None``.
        fields: names of the described quantities (the same list on every rank).
        values: one int per field (ignored when ``error`` is set).

    Returns:
        ``[P][len(fields)]`` every rank's values, rank order (identical on every rank).

    Raises:
        ValueError: this rank's ``error``; or naming the ranks whose inputs were invalid; or naming two
            ranks with different layers and the fields that differ.
    """
    width = len(fields)
    if error is None and (values is None or len(values) != width):
        raise RuntimeError(f"agree_on_layer: {len(fields)} fields but values={values!r}")
    mine = [1] + [-1] * width if error is not None else [0] + [int(v) for v in values]
    world_size = exchange.world_size
    row = torch.tensor(mine, dtype=torch.int64, device=exchange.device)
    gathered = exchange.all_to_all(row.expand(world_size, -1).contiguous(), [1] * world_size, [1] * world_size)
    table = gathered.cpu().tolist()
    if error is not None:
        raise error
    invalid = [rank for rank, theirs in enumerate(table) if theirs[0]]
    if invalid:
        raise ValueError(
            f"rank(s) {invalid} were called with invalid inputs (each raised its own ValueError); "
            f"rank {exchange.rank} stops too instead of waiting in a collective")
    table = [theirs[1:] for theirs in table]
    for other_rank, theirs in enumerate(table):
        differ = [name for name, a, b in zip(fields, table[exchange.rank], theirs) if a != b]
        if differ:
            raise ValueError(
                f"rank {exchange.rank} and rank {other_rank} were called with different layers "
                f"({', '.join(differ)}: {table[exchange.rank]} vs {theirs} for {list(fields)}); "
                "expected the same router, expert shapes and options on every rank")
    return table


# ----------------------------------------------------------------------------------------------------------
# Autograd machinery
# ----------------------------------------------------------------------------------------------------------


def _count_remote_rows(exchange: Exchange, input_splits: list[int]) -> None:
    traffic = getattr(exchange, "traffic", None)
    if traffic is not None:
        traffic.rows_sent_remote += sum(input_splits) - input_splits[exchange.rank]


class _SumAcrossRanksInBackward(torch.autograd.Function):
    """Identity on the replicated router whose backward sums the gradient over all ranks
    (``exchange.all_reduce_sum``)."""

    @staticmethod
    def forward(ctx, anchor, router_weight, exchange):
        ctx.exchange = exchange
        return router_weight.view_as(router_weight)

    @staticmethod
    def backward(ctx, grad):
        return None, ctx.exchange.all_reduce_sum(grad.contiguous()), None


class _DispatchExpertsCombine(torch.autograd.Function):
    """Dispatch kept choices to their owners, run the local experts, bring the results back.

    Inputs: ``x_compute [T, H]`` (compute dtype), ``w1 [L, H, .]``, ``w2 [L, I, H]``, the routing
    ``experts [T, k]`` int64 and ``keep [T, k]`` bool. Output: ``choice_outputs [T, k, H]`` in the compute
    dtype, the expert output of every kept choice and zeros for dropped ones.
    """

    @staticmethod
    def forward(ctx, anchor, router_alias, x_compute, w1, w2, experts, keep, activation, transport_dtype,
                build_graph, exchange):
        world_size = exchange.world_size
        device = x_compute.device
        tokens, top_k = experts.shape
        hidden = x_compute.shape[1]
        local_experts = w1.shape[0]
        num_experts = local_experts * world_size

        # Kept choices ordered by global expert (= destination rank, then local expert), then token.
        flat_experts = experts.reshape(-1)
        kept_choices = torch.nonzero(keep.reshape(-1), as_tuple=False).reshape(-1)
        order = torch.sort(flat_experts[kept_choices], stable=True).indices
        sent_choices = kept_choices[order]                                   # [N_send] flat t*k+j
        sent_counts = torch.bincount(flat_experts[sent_choices], minlength=num_experts)  # [E] int64
        input_splits = sent_counts.view(world_size, local_experts).sum(1).tolist()

        # received_counts[src * L + l]: rows source `src` sends to this rank's local expert l.
        received_counts = exchange.all_to_all(sent_counts, [local_experts] * world_size,
                                              [local_experts] * world_size)
        output_splits = received_counts.view(world_size, local_experts).sum(1).tolist()

        # Rows travel in the storage dtype (exact: x_compute is a widened copy of it).
        rows = x_compute[sent_choices // top_k].to(transport_dtype)
        received = exchange.all_to_all(rows, output_splits, input_splits)
        _count_remote_rows(exchange, input_splits)

        # Group the received rows by local expert (sources in rank order, rows in arrival order).
        received_expert = torch.repeat_interleave(
            torch.arange(local_experts, device=device).repeat(world_size), received_counts)
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
            ])
            results = torch.empty_like(results_grouped).index_copy(0, by_expert, results_grouped)

        returned = exchange.all_to_all(results.detach(), input_splits, output_splits)
        choice_outputs = returned.new_zeros(tokens * top_k, hidden).index_copy(0, sent_choices, returned)

        ctx.exchange = exchange
        ctx.splits = (input_splits, output_splits)
        ctx.shape = (tokens, top_k, hidden)
        ctx.graph = (received_leaf, w1_leaf, w2_leaf, results) if build_graph else None
        ctx.save_for_backward(sent_choices)
        return choice_outputs.view(tokens, top_k, hidden)

    @staticmethod
    def backward(ctx, grad_choice_outputs):
        (sent_choices,) = ctx.saved_tensors
        input_splits, output_splits = ctx.splits
        exchange = ctx.exchange
        tokens, top_k, hidden = ctx.shape
        if ctx.graph is None:
            raise RuntimeError("expert-parallel MoE: backward ran twice through one forward (retain_graph); "
                               "run the forward again for a second backward")
        received_leaf, w1_leaf, w2_leaf, results = ctx.graph
        ctx.graph = None  # free the saved expert graph once used
        want_w1, want_w2 = ctx.needs_input_grad[3], ctx.needs_input_grad[4]

        # Output gradients travel to the owners exactly like the rows did.
        grad_sent = grad_choice_outputs.reshape(tokens * top_k, hidden)[sent_choices]
        grad_results = exchange.all_to_all(grad_sent, output_splits, input_splits)
        # The row gradients are always computed: whether a source needs them is that rank's business,
        # and the return exchange must happen on every rank.
        wanted = [received_leaf] + ([w1_leaf] if want_w1 else []) + ([w2_leaf] if want_w2 else [])
        grads = list(torch.autograd.grad(results, wanted, grad_results, allow_unused=True))
        grad_received = grads.pop(0)
        grad_w1 = grads.pop(0) if want_w1 else None
        grad_w2 = grads.pop(0) if want_w2 else None
        if want_w1 and grad_w1 is None:
            grad_w1 = torch.zeros_like(w1_leaf)
        if want_w2 and grad_w2 is None:
            grad_w2 = torch.zeros_like(w2_leaf)
        if grad_received is None:
            grad_received = torch.zeros_like(received_leaf)

        # Row gradients come back to the sources; a token's k choices are summed in fixed j order.
        grad_rows = exchange.all_to_all(grad_received, input_splits, output_splits)
        grad_choices = grad_rows.new_zeros(tokens * top_k, hidden).index_copy(0, sent_choices, grad_rows)
        grad_x = grad_choices.view(tokens, top_k, hidden).sum(dim=1)
        return None, None, grad_x, grad_w1, grad_w2, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------------


def check_fixed_routing(experts, keep, tokens: int, top_k: int | None, num_experts: int,
                        device: torch.device) -> torch.Tensor:
    """Check a fixed routing and return ``experts`` as int64.

    experts: ``[T, k]`` int32 or int64, each row ``k`` distinct experts in ``[0, E)``; keep: ``[T, k]``
    bool; both on ``device``. ``top_k`` (if not ``None``) must equal ``k``. Raises ``ValueError`` naming
    the argument. (On CUDA the value checks cost one device sync.)
    """
    for name, tensor in (("experts", experts), ("keep", keep)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2 or tensor.shape[0] != tokens:
            raise ValueError(f"{name}: shape {list(tensor.shape)}; expected [T={tokens}, k]")
        if tensor.device != device:
            raise ValueError(f"{name}: on device {tensor.device}; expected {device} like x")
    if experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"experts: dtype {experts.dtype}; expected torch.int32 or torch.int64")
    if keep.dtype != torch.bool:
        raise ValueError(f"keep: dtype {keep.dtype}; expected torch.bool")
    if keep.shape != experts.shape:
        raise ValueError(f"keep: shape {list(keep.shape)} differs from experts {list(experts.shape)}")
    k = experts.shape[1]
    if top_k is not None and k != top_k:
        raise ValueError(f"experts: {k} choices per token, but top_k={top_k}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"experts: {k} choices per token; expected 1 <= k <= E = {num_experts}")
    experts = experts.to(torch.int64)
    if tokens:
        out_of_range = (experts < 0) | (experts >= num_experts)
        ordered = torch.sort(experts, dim=1).values
        repeated = ordered[:, 1:] == ordered[:, :-1]
        flags = torch.stack([out_of_range.any(), repeated.any()]).tolist()
        if flags[0]:
            raise ValueError(f"experts: contains values outside [0, E={num_experts})")
        if flags[1]:
            raise ValueError("experts: a token lists the same expert twice; expected k distinct experts per row")
    return experts


def moe_over_exchange(exchange: Exchange, x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor,
                      w2: torch.Tensor, *, top_k: int, activation: str, normalize_topk: bool,
                      capacity_factor: float | None = None, experts: torch.Tensor | None = None,
                      keep: torch.Tensor | None = None):
    """This rank's part of the expert-parallel layer, in the compute dtype (no input checks: callers check).

    Args:
        exchange: the transport (see the module docstring); a collective over its ranks.
        x: ``[T, H]`` this rank's tokens, float dtype.
        router_weight: ``[E, H]`` any float dtype (the router math runs in ``x``'s compute dtype).
        w1: ``[L, H, I or 2I]``; w2: ``[L, I, H]``: this rank's experts.
        top_k, activation, normalize_topk, capacity_factor: as :func:`flashdmoe.moe`.
        experts, keep: an optional fixed routing, ``[T, k]`` int64 / bool (``capacity_factor`` is then
            not applied: ``keep`` already says which choices survive).

    Returns:
        ``(y, routing, keep, anchor)``: ``y [T, H]`` in the compute dtype of ``x`` (float64 for float64,
        else float32), the :class:`flashdmoe.reference.Routing` (probs ``[T, E]``, experts ``[T, k]``,
        weights ``[T, k]``), the keep mask ``[T, k]`` bool and the zero-size anchor tensor (it requires
        grad when grad mode is on; differentiate with respect to it to force every collective of the
        backward to run).
    """
    grad_enabled = torch.is_grad_enabled()
    # Zero-size leaf that requires grad: the autograd nodes holding collectives exist on every rank.
    anchor = torch.empty(0, device=x.device, requires_grad=grad_enabled)
    router = _SumAcrossRanksInBackward.apply(anchor, router_weight, exchange) if grad_enabled else router_weight

    compute_dtype = reference.compute_dtype(x.dtype)
    x_compute = x.to(compute_dtype)  # one widening shared by router and experts, as in the reference
    if experts is None:
        routing = reference.route(x_compute, router, top_k, normalize_topk)
        capacity = reference.expert_capacity(x.shape[0], top_k, router_weight.shape[0], capacity_factor)
        keep = reference.keep_mask(routing.experts, router_weight.shape[0], capacity)
    else:
        probs = reference.router_probs(x_compute, router)
        routing = reference.Routing(probs=probs, experts=experts,
                                    weights=reference.combine_weights(probs, experts, normalize_topk))

    # `router` is passed only so the router all-reduce waits for this node's backward (fixed order).
    choice_outputs = _DispatchExpertsCombine.apply(
        anchor, router, x_compute, w1, w2, routing.experts, keep, activation, x.dtype, grad_enabled, exchange)
    y = reference.weighted_sum(routing.weights, keep, choice_outputs)
    return y, routing, keep, anchor


def routing_aux(routing: reference.Routing, keep: torch.Tensor) -> reference.MoEAux:
    """This rank's counts ``[E]`` int64 (before capacity), dropped choices (0-dim int64) and Switch loss
    ``E * sum_e f_e * mean_t p[t, e]`` with ``f_e = counts_e / (T * k)`` (0 when ``T == 0``)."""
    tokens, top_k = routing.experts.shape
    num_experts = routing.probs.shape[1]
    counts = torch.bincount(routing.experts.reshape(-1), minlength=num_experts)
    fraction = counts.to(routing.probs.dtype) / max(tokens * top_k, 1)
    mean_prob = routing.probs.sum(dim=0) / max(tokens, 1)
    return reference.MoEAux(counts=counts, dropped=(~keep).sum(),
                            aux_loss=num_experts * (fraction * mean_prob).sum())


def row_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one row (first dimension) of ``tensor``."""
    return tensor.element_size() * math.prod(tensor.shape[1:])
