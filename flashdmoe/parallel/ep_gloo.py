"""Expert-parallel MoE on CPUs over ``torch.distributed`` (gloo): the path Ray runs when there is no GPU.

Each process is one rank: it holds only its own tokens ``x [T_r, H]`` (``T_r`` may differ between ranks,
0 included), the replicated router ``[E, H]`` and its expert shard ``w1 [L, H, I or 2I]``,
``w2 [L, I, H]`` (global experts ``[rank * L, (rank + 1) * L)``). One call on every rank computes
exactly what :func:`flashdmoe.reference.moe_expert_parallel` computes for all ranks in one process.

The layer itself (gate, dispatch, experts, combine and their autograd) lives in
:mod:`flashdmoe.parallel.ep_exchange`, written over an abstract exchange; this module supplies
:class:`GlooExchange`, whose collectives are ``torch.distributed`` calls:

* ``all_to_all`` is one ``all_to_all_single`` with split sizes: gloo in torch >= 2.4 implements it for
  uneven splits (any float dtype and int64, empty splits included), whereas its list form ``all_to_all``
  requires equal tensor sizes on every pair; one call per exchange keeps the message count at ``P - 1``
  per rank. The dispatch sends the per-expert row counts first, then the rows.
* ``all_reduce_sum`` is ``all_reduce(SUM)`` (gloo's result is the same on every rank).

Collective discipline (gloo matches collectives by call order, so every rank must issue the same
sequence): every rank calls the forward, and every rank calls backward on its output (or none does).
Before any data moves, the ranks exchange a small description of their layer and whether their own input
checks passed, so a bad input or a different layer on one rank raises ``ValueError`` on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashdmoe.parallel.ep_exchange import (
    TrafficCounter,
    agree_on_layer,
    check_fixed_routing,
    moe_over_exchange,
    routing_aux,
    row_bytes,
)
from flashdmoe.validation import ACTIVATIONS, validate_moe_inputs

__all__ = ["GlooExchange", "TrafficCounter", "expert_parallel_moe"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_LAYER_FIELDS = ("hidden", "ffn", "experts", "top_k", "local_experts", "activation", "normalize_topk",
                 "capacity_factor (x1e9)", "dtype")


class GlooExchange:
    """The exchange of :mod:`flashdmoe.parallel.ep_exchange` over a ``torch.distributed`` group (gloo, CPU tensors).

    Args:
        group: the process group (``None``: the default group).
        traffic: if given, accumulates the bytes this rank's ``all_to_all`` calls moved to and from other
            ranks.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, traffic: TrafficCounter | None = None) -> None:
        self.group = group
        self.traffic = traffic
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = torch.device("cpu")

    def all_to_all(self, tensor: torch.Tensor, output_splits, input_splits) -> torch.Tensor:
        """``all_to_all_single`` of the rows of ``tensor [sum(input_splits), ...]``; returns
        ``[sum(output_splits), ...]`` in ``tensor``'s dtype, rows ordered by source rank."""
        output_splits, input_splits = list(output_splits), list(input_splits)
        tensor = tensor.contiguous()
        output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        dist.all_to_all_single(output, tensor, output_splits, input_splits, group=self.group)
        if self.traffic is not None:
            size = row_bytes(tensor)
            self.traffic.bytes_sent += size * (sum(input_splits) - input_splits[self.rank])
            self.traffic.bytes_received += size * (sum(output_splits) - output_splits[self.rank])
        return output

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over the group (a new tensor, same shape and dtype, same on every rank)."""
        total = tensor.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total


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
    experts: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
):
    """This rank's part of the expert-parallel MoE layer; a collective over ``group`` (gloo, CPU tensors).

    Must be called by every rank of ``group`` with the same layer; a rank with invalid inputs or a
    different layer makes *every* rank raise ``ValueError`` (nobody is left waiting). If one rank calls
    ``backward`` through the result, all must.

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
        experts, keep: a fixed routing instead of the router's choice (both or neither):
            ``experts [T, top_k]`` int32/int64 (distinct experts per row, in ``[0, E)``) and
            ``keep [T, top_k]`` bool (False = dropped, contributes 0). The combine weights are still the
            router's probabilities gathered at ``experts`` (renormalised over the ``k`` choices when
            ``normalize_topk``), so gradients flow into the router as in
            :func:`flashdmoe.reference.moe_fixed_routing`. ``capacity_factor`` must then be ``None``
            (``keep`` already encodes any capacity limit).

    Returns:
        ``y [T, H]`` in ``x.dtype`` or ``(y, MoEAux)``; differentiable. After backward, ``x.grad`` is
        complete, ``w1.grad``/``w2.grad`` are this shard's gradients, and ``router_weight.grad`` is the
        gradient summed over all ranks (the same on every rank).

    Raises:
        ValueError: bad input (naming the argument, on every rank) or ranks called with different layers.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group('gloo', ...) on every rank first")
    exchange = GlooExchange(group, traffic)

    error, values = None, None
    try:
        for name, value in (("normalize_topk", normalize_topk), ("return_aux", return_aux)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}: expected True or False")
        sizes = validate_moe_inputs(x, router_weight, w1, w2, top_k=top_k, activation=activation,
                                    capacity_factor=capacity_factor, world_size=exchange.world_size)
        if x.device.type != "cpu":
            raise ValueError(f"x: on device {x.device}; the gloo expert-parallel path runs on CPU tensors")
        if (experts is None) != (keep is None):
            raise ValueError("experts/keep: pass both (a fixed routing) or neither (route with the router)")
        if experts is not None:
            if capacity_factor is not None:
                raise ValueError(f"capacity_factor={capacity_factor!r}: with a fixed routing (experts/keep) "
                                 "the capacity limit is already in keep; pass capacity_factor=None")
            experts = check_fixed_routing(experts, keep, sizes.tokens, sizes.top_k, sizes.experts, x.device)
        values = [sizes.hidden, sizes.ffn, sizes.experts, sizes.top_k, sizes.local_experts,
                  ACTIVATIONS.index(activation), int(normalize_topk),
                  -1 if capacity_factor is None else round(capacity_factor * 1e9), _DTYPES.index(x.dtype)]
    except ValueError as caught:
        error = caught
    agree_on_layer(exchange, error, _LAYER_FIELDS, values)

    y, routing, keep, _ = moe_over_exchange(
        exchange, x, router_weight, w1, w2, top_k=top_k, activation=activation, normalize_topk=normalize_topk,
        capacity_factor=capacity_factor, experts=experts, keep=keep)
    y = y.to(x.dtype)
    if not return_aux:
        return y
    return y, routing_aux(routing, keep)

