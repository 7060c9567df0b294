"""The plain-PyTorch Mixture-of-Experts oracle: docs/design.md §2-§3, written for clarity, not speed.

Every backend (the fused CUDA kernel, the Ray/gloo expert-parallel path) is tested against this module.

Notation: ``T`` tokens on a rank, ``H`` hidden size, ``I`` expert intermediate size, ``E`` global
experts, ``k`` experts per token (``top_k``), ``P`` ranks, ``L = E // P`` experts per rank.

Semantics:

* Router: ``logits = x @ router_weight.T`` and ``p = softmax(logits)`` in the *compute dtype*
  (float64 when ``x`` is float64, float32 otherwise, whatever the storage dtype); the ``k`` experts with
  the largest ``p`` are chosen, ties going to the lower expert index; the combine weights are
  ``p_topk / sum(p_topk)`` when ``normalize_topk`` else ``p_topk``.
* Expert ``e``: ``FFN_e(v) = act(v @ W1_e) @ W2_e``; for ``swiglu`` ``W1_e`` is ``[H, 2I]``, gate half
  first, and ``FFN_e(v) = (silu(v @ W1_gate) * (v @ W1_up)) @ W2_e``. ``gelu`` is the exact (erf) GELU.
* Output: ``y[t] = sum_j w[t, j] * FFN_{e(t, j)}(x[t])`` in the compute dtype, returned in ``x.dtype``.
* Capacity factor ``c``: each (source rank, expert) pair keeps at most ``ceil(c * T * k / E)`` choices,
  the earliest tokens first; a dropped choice contributes zero and the remaining weights are *not*
  renormalised. ``None`` is dropless.
* Aux: per-expert choice counts (before capacity) and the Switch load-balancing loss
  ``E * sum_e f_e * mean_t p[t, e]`` with ``f_e = counts_e / (T * k)`` (a constant for autograd).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "gelu", "silu", "swiglu")


class Routing(NamedTuple):
    """The router's decision for ``T`` tokens.

    probs:   ``[T, E]`` compute dtype (float32, or float64 for float64 input): softmax of the logits.
    experts: ``[T, k]`` int64: chosen experts per token, by descending probability, ties to the lower index.
    weights: ``[T, k]`` compute dtype: the combine weight of each choice (renormalised over the ``k``
             choices when ``normalize_topk``).
    """

    probs: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


class MoEAux(NamedTuple):
    """Routing statistics of one rank's forward pass.

    counts:   ``[E]`` int64: choices routed to each expert, before capacity is applied.
    dropped:  0-dim int64: choices dropped by the capacity limit (0 when dropless).
    aux_loss: 0-dim compute dtype: ``E * sum_e f_e * mean_t p[t, e]``, differentiable through ``p``
              (0 when ``T == 0``).
    """

    counts: torch.Tensor
    dropped: torch.Tensor
    aux_loss: torch.Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the oracle computes in for inputs stored as ``dtype``: float64 stays, all else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; expected one of {ACTIVATIONS}")


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} is invalid; expected an int with 1 <= top_k <= experts ({num_experts})")


def _check_expert_weights(w1: torch.Tensor, w2: torch.Tensor, hidden: int, activation: str, name: str) -> None:
    """w1 ``[n, H, I or 2I]`` and w2 ``[n, I, H]`` must agree with each other, ``H`` and the activation."""
    if w2.dim() != 3 or w2.shape[2] != hidden:
        raise ValueError(f"{name}w2 has shape {tuple(w2.shape)}; expected [experts, I, H={hidden}]")
    intermediate = w2.shape[1]
    w1_cols = 2 * intermediate if activation == "swiglu" else intermediate
    expected = (w2.shape[0], hidden, w1_cols)
    if tuple(w1.shape) != expected:
        raise ValueError(
            f"{name}w1 has shape {tuple(w1.shape)}; expected {list(expected)} "
            f"([experts, H, {'2I' if activation == 'swiglu' else 'I'}] for activation={activation!r}, I={intermediate})"
        )


# ----------------------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------------------


def router_probs(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """Softmax router probabilities.

    x: ``[T, H]`` any float dtype; router_weight: ``[E, H]`` any float dtype.
    Returns ``p`` ``[T, E]`` in the compute dtype of ``x`` (float64 for float64, else float32).
    """
    if x.dim() != 2 or router_weight.dim() != 2 or x.shape[1] != router_weight.shape[1]:
        raise ValueError(
            f"x has shape {tuple(x.shape)} and router_weight {tuple(router_weight.shape)}; expected [T, H] and [E, H]"
        )
    dtype = compute_dtype(x.dtype)
    logits = x.to(dtype) @ router_weight.to(dtype).T
    return torch.softmax(logits, dim=-1)


def top_k_experts(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Indices of the ``top_k`` largest probabilities per row, ties to the lower expert index.

    probs: ``[T, E]`` float. Returns ``[T, k]`` int64, ordered by descending probability.
    A *stable* ascending sort of ``-probs`` keeps equal values in index order, which is exactly the
    tie rule (``torch.topk`` gives no such guarantee).
    """
    _check_top_k(top_k, probs.shape[-1])
    order = torch.sort(-probs.detach(), dim=-1, stable=True).indices
    return order[:, :top_k]


def combine_weights(probs: torch.Tensor, experts: torch.Tensor, normalize_topk: bool) -> torch.Tensor:
    """Combine weights of the chosen experts: ``p[t, e(t, j)]``, divided by their sum when ``normalize_topk``.

    probs: ``[T, E]`` float; experts: ``[T, k]`` int64. Returns ``[T, k]`` in ``probs.dtype``
    (differentiable through ``probs``).
    """
    chosen = probs.gather(1, experts)
    if normalize_topk:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize_topk: bool = True) -> Routing:
    """Route ``T`` tokens: softmax probabilities, top-k experts (ties to the lower index), combine weights.

    x: ``[T, H]``; router_weight: ``[E, H]``. See :class:`Routing` for the outputs' shapes and dtypes.
    """
    probs = router_probs(x, router_weight)
    experts = top_k_experts(probs, top_k)
    return Routing(probs=probs, experts=experts, weights=combine_weights(probs, experts, normalize_topk))


# ----------------------------------------------------------------------------------------------------------
# Capacity
# ----------------------------------------------------------------------------------------------------------


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int | None:
    """Choices one expert keeps from one source rank: ``ceil(capacity_factor * tokens * top_k / num_experts)``.

    Evaluated in Python double precision in exactly that order, so every backend that calls this
    function agrees on the value. ``None`` (dropless) when ``capacity_factor`` is ``None``.
    """
    if capacity_factor is None:
        return None
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor!r} is invalid; expected None or a number > 0")
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def keep_mask(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """Which choices survive the capacity limit: for each expert, its first ``capacity`` choices in token order.

    experts: ``[T, k]`` int64 (a token's ``k`` experts are distinct, so token order fixes the order of
    each expert's choices). Returns ``[T, k]`` bool; all True when ``capacity`` is ``None``.
    """
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    flat = experts.reshape(-1)  # row-major: token t's choices come before token t+1's
    # slot of each choice inside its expert's segment = how many earlier choices picked the same expert
    one_hot = F.one_hot(flat, num_experts)
    slot = (one_hot.cumsum(dim=0) - one_hot).gather(1, flat[:, None]).squeeze(1)
    return (slot < capacity).reshape(experts.shape)


def routed_choices(experts: torch.Tensor, keep: torch.Tensor, expert: int) -> torch.Tensor:
    """Flat indices ``t * k + j`` of the kept choices of ``expert``, ascending (token order).

    experts, keep: ``[T, k]`` int64 / bool. Returns ``[n]`` int64; the token of choice ``i`` is ``i // k``.
    """
    return torch.nonzero(((experts == expert) & keep).reshape(-1), as_tuple=False).reshape(-1)


# ----------------------------------------------------------------------------------------------------------
# Experts and combine
# ----------------------------------------------------------------------------------------------------------


def expert_ffn(v: torch.Tensor, w1_e: torch.Tensor, w2_e: torch.Tensor, activation: str) -> torch.Tensor:
    """One expert's feed-forward network on ``n`` rows: ``act(v @ w1_e) @ w2_e``.

    v: ``[n, H]``; w1_e: ``[H, I]`` (``[H, 2I]`` for swiglu, gate half first then up half); w2_e: ``[I, H]``.
    Computes in the compute dtype of ``v`` (float64 for float64, else float32) and returns ``[n, H]`` in it.
    """
    _check_activation(activation)
    dtype = compute_dtype(v.dtype)
    v, w1_e, w2_e = v.to(dtype), w1_e.to(dtype), w2_e.to(dtype)
    hidden = v @ w1_e
    if activation == "swiglu":
        intermediate = w2_e.shape[0]
        gate, up = hidden[:, :intermediate], hidden[:, intermediate:]
        hidden = F.silu(gate) * up
    elif activation == "relu":
        hidden = F.relu(hidden)
    elif activation == "gelu":
        hidden = F.gelu(hidden, approximate="none")
    else:  # silu
        hidden = F.silu(hidden)
    return hidden @ w2_e


def weighted_sum(weights: torch.Tensor, keep: torch.Tensor, choice_outputs: torch.Tensor) -> torch.Tensor:
    """The combine: ``y[t] = sum_j keep[t, j] * weights[t, j] * choice_outputs[t, j]``, summed in ``j`` order.

    weights: ``[T, k]`` float; keep: ``[T, k]`` bool; choice_outputs: ``[T, k, H]`` float (same dtype as
    ``weights``). Returns ``[T, H]``. Dropped choices contribute zero and nothing is renormalised.
    """
    kept_weights = weights * keep.to(weights.dtype)
    return (kept_weights.unsqueeze(-1) * choice_outputs).sum(dim=1)


def _local_choice_outputs(
    x: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str
) -> torch.Tensor:
    """Every kept choice's expert output with all experts local. x: ``[T, H]`` compute dtype;
    experts/keep: ``[T, k]``; w1: ``[E, H, .]``; w2: ``[E, I, H]``. Returns ``[T, k, H]`` (zeros where dropped)."""
    tokens, top_k = experts.shape
    outputs = x.new_zeros(tokens * top_k, x.shape[1])
    for expert in range(w1.shape[0]):
        # even an expert with no rows runs (on 0 rows), so every weight is part of the autograd graph
        choices = routed_choices(experts, keep, expert)
        result = expert_ffn(x[choices // top_k], w1[expert], w2[expert], activation)
        outputs = outputs.index_copy(0, choices, result)
    return outputs.reshape(tokens, top_k, x.shape[1])


def _aux(routing: Routing, keep: torch.Tensor) -> MoEAux:
    """Counts, dropped choices and the Switch load-balancing loss of one rank (see :class:`MoEAux`)."""
    tokens, top_k = routing.experts.shape
    num_experts = routing.probs.shape[1]
    counts = torch.bincount(routing.experts.reshape(-1), minlength=num_experts)
    dropped = (~keep).sum()
    # max(., 1): with T == 0 both factors are zero vectors, so the loss is exactly 0 (and still has a graph)
    fraction_routed = counts.to(routing.probs.dtype) / max(tokens * top_k, 1)
    mean_prob = routing.probs.sum(dim=0) / max(tokens, 1)
    aux_loss = num_experts * (fraction_routed * mean_prob).sum()
    return MoEAux(counts=counts, dropped=dropped, aux_loss=aux_loss)


# ----------------------------------------------------------------------------------------------------------
# Single rank
# ----------------------------------------------------------------------------------------------------------


def moe(
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
):
    """The MoE layer on one rank that owns all ``E`` experts.

    x: ``[T, H]`` float16/bfloat16/float32/float64; router_weight: ``[E, H]``; w1: ``[E, H, I]``
    (``[E, H, 2I]`` for swiglu); w2: ``[E, I, H]``. All on one device (CPU or CUDA).
    Returns ``y`` ``[T, H]`` in ``x.dtype``, or ``(y, MoEAux)`` when ``return_aux``.
    Differentiable with respect to all four tensors.
    """
    _check_activation(activation)
    _check_expert_weights(w1, w2, x.shape[-1], activation, "")
    if w1.shape[0] != router_weight.shape[0]:
        raise ValueError(
            f"w1 holds {w1.shape[0]} experts but router_weight has {router_weight.shape[0]} rows; expected equal"
        )
    routing = route(x, router_weight, top_k, normalize_topk)
    capacity = expert_capacity(x.shape[0], top_k, router_weight.shape[0], capacity_factor)
    keep = keep_mask(routing.experts, router_weight.shape[0], capacity)
    dtype = routing.probs.dtype
    outputs = _local_choice_outputs(x.to(dtype), routing.experts, keep, w1.to(dtype), w2.to(dtype), activation)
    y = weighted_sum(routing.weights, keep, outputs).to(x.dtype)
    return (y, _aux(routing, keep)) if return_aux else y


def moe_fixed_routing(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    experts: torch.Tensor,
    keep: torch.Tensor,
    *,
    activation: str = "gelu",
    normalize_topk: bool = True,
) -> torch.Tensor:
    """:func:`moe` with the choices already made (e.g. by a kernel's forward), for an unfused backward.

    x: ``[T, H]``; router_weight: ``[E, H]``; w1: ``[E, H, I or 2I]``; w2: ``[E, I, H]``;
    experts: ``[T, k]`` int64 (distinct per row); keep: ``[T, k]`` bool.
    The router probabilities are recomputed and re-gathered at ``experts`` (renormalised over the
    ``k`` choices when ``normalize_topk``), so gradients flow through them as in :func:`moe`.
    Given ``route()``'s experts and ``keep_mask()``'s mask it returns exactly ``moe()``'s ``y``
    (``[T, H]``, ``x.dtype``).
    """
    _check_activation(activation)
    _check_expert_weights(w1, w2, x.shape[-1], activation, "")
    if experts.shape != keep.shape or experts.dim() != 2 or experts.shape[0] != x.shape[0]:
        raise ValueError(
            f"experts {tuple(experts.shape)} and keep {tuple(keep.shape)} must both be [T={x.shape[0]}, k]"
        )
    probs = router_probs(x, router_weight)
    weights = combine_weights(probs, experts, normalize_topk)
    dtype = probs.dtype
    outputs = _local_choice_outputs(x.to(dtype), experts, keep, w1.to(dtype), w2.to(dtype), activation)
    return weighted_sum(weights, keep, outputs).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# P ranks (expert parallel), written as the distributed algorithm: gate -> dispatch -> expert -> combine
# ----------------------------------------------------------------------------------------------------------


def moe_expert_parallel(
    xs: Sequence[torch.Tensor],
    router_weight: torch.Tensor,
    w1s: Sequence[torch.Tensor],
    w2s: Sequence[torch.Tensor],
    *,
    top_k: int,
    activation: str = "gelu",
    normalize_topk: bool = True,
    capacity_factor: float | None = None,
    return_aux: bool = False,
):
    """The MoE layer over ``P`` expert-parallel ranks, simulated in one process.

    xs: ``P`` tensors ``[T_r, H]`` (``T_r`` may differ between ranks and may be 0), one float dtype;
    router_weight: ``[E, H]`` (replicated); w1s: ``P`` shards ``[L, H, I or 2I]``; w2s: ``P`` shards
    ``[L, I, H]``; rank ``r`` owns global experts ``[r * L, (r + 1) * L)``, ``E = P * L``.
    Every rank's tokens are routed over all ``E`` experts; capacity applies per (source rank, expert)
    pair: ``ceil(capacity_factor * T_r * k / E)``.
    Returns the list of ``y_r`` ``[T_r, H]`` (each in ``xs[r].dtype``), plus the list of per-rank
    :class:`MoEAux` when ``return_aux``. Equal to :func:`moe` run per rank on the concatenated shards.
    """
    world_size = len(xs)
    if world_size == 0 or len(w1s) != world_size or len(w2s) != world_size:
        raise ValueError(
            f"got {len(xs)} token batches, {len(w1s)} w1 shards and {len(w2s)} w2 shards; "
            "expected the same number P >= 1 of each"
        )
    _check_activation(activation)
    hidden = router_weight.shape[1]
    local_experts = w1s[0].shape[0]
    num_experts = router_weight.shape[0]
    if num_experts != world_size * local_experts:
        raise ValueError(
            f"router_weight has {num_experts} experts but {world_size} ranks x {local_experts} local experts "
            f"= {world_size * local_experts}; expected equal"
        )
    for rank in range(world_size):
        _check_expert_weights(w1s[rank], w2s[rank], hidden, activation, f"rank {rank}: ")
        if w1s[rank].shape[0] != local_experts:
            raise ValueError(
                f"rank {rank}: w1 holds {w1s[rank].shape[0]} experts; expected {local_experts} like rank 0"
            )
    dtype = compute_dtype(xs[0].dtype)

    # 1. Gate, on every source rank: route its own tokens over all E experts, apply its capacity.
    routings = [route(x, router_weight, top_k, normalize_topk) for x in xs]
    keeps = [
        keep_mask(routing.experts, num_experts, expert_capacity(x.shape[0], top_k, num_experts, capacity_factor))
        for x, routing in zip(xs, routings)
    ]

    # 2. Dispatch: source `src` sends to owner `dst`, for each of dst's local experts, the rows of its
    #    tokens whose kept choices picked that expert, in token order. It remembers which choice each
    #    row was, to place the results on return.
    #    inbox[dst][src][local] = [n, H] rows;  sent_choices[src][dst][local] = [n] flat choice indices
    inbox = [[[None] * local_experts for _ in range(world_size)] for _ in range(world_size)]
    sent_choices = [[[None] * local_experts for _ in range(world_size)] for _ in range(world_size)]
    for src in range(world_size):
        rows = xs[src].to(dtype)
        for dst in range(world_size):
            for local in range(local_experts):
                choices = routed_choices(routings[src].experts, keeps[src], dst * local_experts + local)
                sent_choices[src][dst][local] = choices
                inbox[dst][src][local] = rows[choices // top_k]

    # 3. Expert compute, on every owner rank, with only its own shard of the weights.
    outbox = [[[None] * local_experts for _ in range(world_size)] for _ in range(world_size)]
    for dst in range(world_size):
        w1_shard, w2_shard = w1s[dst].to(dtype), w2s[dst].to(dtype)
        for src in range(world_size):
            for local in range(local_experts):
                outbox[dst][src][local] = expert_ffn(
                    inbox[dst][src][local], w1_shard[local], w2_shard[local], activation
                )

    # 4. Combine, on every source rank: results come back to the choices they were sent for, and
    #    y[t] = sum_j w[t, j] * result[t, j] in fixed j order.
    ys = []
    for src in range(world_size):
        tokens = xs[src].shape[0]
        results = xs[src].new_zeros(tokens * top_k, hidden, dtype=dtype)
        for dst in range(world_size):
            for local in range(local_experts):
                results = results.index_copy(0, sent_choices[src][dst][local], outbox[dst][src][local])
        results = results.reshape(tokens, top_k, hidden)
        ys.append(weighted_sum(routings[src].weights, keeps[src], results).to(xs[src].dtype))

    if return_aux:
        return ys, [_aux(routing, keep) for routing, keep in zip(routings, keeps)]
    return ys
