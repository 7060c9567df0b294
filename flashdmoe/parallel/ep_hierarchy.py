"""The hierarchical cross-node exchange of docs/design.md §8, written over an exchange: the reference of
what a kernel would do, tested on CPU with gloo ranks laid out as nodes.

Ranks are node-major, ``G`` per node (``ranks_per_node``); rank ``r`` is local rank ``r % G`` of node
``r // G``. For this rank's token ``t`` (on node ``a``, local rank ``g``):

1. **Across nodes, once per node.** For every other node ``b`` that ``t``'s kept choices hit, ``x[t]`` goes
   once to the *relay* ``(b, g)`` (the same local rank there: the same rail), with the ids and combine
   weights of ``t``'s choices on ``b``. Where direct puts send one row per choice, this sends one per node.
2. **Within a node.** Each rank then serves as the source of its own tokens (their choices on its node)
   and of the tokens it relays (their choices on its node): each such choice's row goes to the expert's
   owner on the node, which runs the expert and returns the result (:func:`flashdmoe.reference.expert_ffn`).
3. **Partial sums, back across once.** The rank sums each of those tokens' returned results with their
   weights (``j`` order); a relayed token's partial sum goes back to its source: one row per node again.
4. **The source's output**: its own node's partial, then the other nodes' partials in node order.

The sums run in another order than :func:`flashdmoe.reference.moe_expert_parallel`'s (per node, then over
nodes), so results agree within rounding, not bitwise. Differentiable: every move is an exchange
``all_to_all`` whose backward is the reverse ``all_to_all`` (all ranks build the same graph, so their
backwards issue the same collectives in the same order); the router's gradient is this rank's share
(sum it over the ranks for the replicated router, as the caller of the gloo path does).

:class:`HierarchyTraffic` counts the rows each step moved, across nodes and within them, so a run can be
set against direct puts' rows for the same routing (:func:`direct_rows`) and the cost model of
:mod:`flashdmoe.bench.internode_model`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdmoe import reference

__all__ = ["HierarchyTraffic", "direct_rows", "hierarchical_moe"]


@dataclass
class HierarchyTraffic:
    """Rows this rank sent per forward: ``cross_node_rows`` (token rows to relays, partial sums back to
    sources) and ``in_node_rows`` (choice rows to owners on the node and results back), each excluding rows
    a rank keeps for itself."""

    cross_node_rows: int = 0
    in_node_rows: int = 0


class _AllToAll(torch.autograd.Function):
    """``exchange.all_to_all`` with the reverse ``all_to_all`` as its backward. ``anchor``: a zero-size view
    of the previous move's output (the first: a zero-size leaf that requires grad), so that every rank
    records every move and the backward runs their collectives in exactly the reverse order: a move's
    backward waits for the next one's, whatever else each rank's graph holds."""

    @staticmethod
    def forward(ctx, anchor, tensor, exchange, output_splits, input_splits):
        ctx.exchange, ctx.splits = exchange, (list(output_splits), list(input_splits))
        ctx.anchor = (anchor.shape, anchor.dtype)
        return exchange.all_to_all(tensor.contiguous(), output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        shape, dtype = ctx.anchor
        moved = ctx.exchange.all_to_all(grad.contiguous(), input_splits, output_splits)
        return grad.new_zeros(shape, dtype=dtype), moved, None, None, None


class _Moves:
    """The layer's differentiable moves, chained through their anchors (see :class:`_AllToAll`)."""

    def __init__(self, exchange, like: torch.Tensor) -> None:
        self.exchange = exchange
        self.anchor = like.new_zeros(0, requires_grad=True)

    def __call__(self, tensor: torch.Tensor, output_splits, input_splits) -> torch.Tensor:
        out = _AllToAll.apply(self.anchor, tensor, self.exchange, output_splits, input_splits)
        self.anchor = out.reshape(-1)[:0]
        return out


def _splits(counts: torch.Tensor, exchange) -> tuple[list[int], list[int]]:
    """(output, input) splits of an all_to_all in which this rank sends ``counts[q]`` rows to rank ``q``."""
    sent = [int(c) for c in counts]
    received = exchange.all_to_all(torch.tensor(sent, dtype=torch.int64).reshape(-1, 1), [1] * len(sent),
                                   [1] * len(sent)).reshape(-1)
    return [int(c) for c in received], sent


def direct_rows(experts: torch.Tensor, keep: torch.Tensor, local_experts: int, rank: int,
                ranks_per_node: int) -> tuple[int, int]:
    """(rows across nodes, rows to other ranks of the node) that direct puts would send for this routing."""
    owner = experts // local_experts
    remote_node = (owner // ranks_per_node) != rank // ranks_per_node
    return int((keep & remote_node).sum()), int((keep & ~remote_node & (owner != rank)).sum())


def hierarchical_moe(exchange, x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
                     top_k: int, activation: str, normalize_topk: bool, capacity_factor: float | None,
                     ranks_per_node: int, traffic: HierarchyTraffic | None = None):
    """This rank's ``y [T, H]`` (compute dtype: float64 for float64 inputs, else float32) of the
    expert-parallel layer through the hierarchical exchange; a collective over ``exchange`` (every rank, the
    same layer and ``ranks_per_node``). Inputs as :func:`flashdmoe.parallel.ep_gloo.expert_parallel_moe` (this rank's
    tokens, the replicated router, this rank's expert shard); capacity per (source rank, expert) as there.
    Returns ``(y, routing, keep)``."""
    P, rank, G = exchange.world_size, exchange.rank, ranks_per_node
    if G < 1 or P % G:
        raise ValueError(f"ranks_per_node={ranks_per_node!r}: expected a divisor of the {P} ranks")
    L, (T, H) = w1.shape[0], x.shape
    E = L * P
    node, local = divmod(rank, G)
    nodes = P // G
    move = _Moves(exchange, x.new_zeros(0, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32))

    routing = reference.route(x, router_weight, top_k, normalize_topk)
    keep = reference.keep_mask(routing.experts, E, reference.expert_capacity(T, top_k, E, capacity_factor))
    compute = routing.weights.dtype
    owner_node = routing.experts // L // G                                # [T, k]
    xc = x.to(compute)

    # 1. each token once to the relay of every other node its kept choices hit
    relay_tokens, relay_counts = [], torch.zeros(P, dtype=torch.int64)
    for b in range(nodes):
        if b != node:
            hits = ((owner_node == b) & keep).any(dim=1).nonzero().reshape(-1)
            relay_tokens.append((b, hits))
            relay_counts[b * G + local] = hits.numel()
    order = torch.cat([hits for _, hits in relay_tokens]) if relay_tokens else torch.zeros(0, dtype=torch.int64)
    out_splits, in_splits = _splits(relay_counts, exchange)
    relayed_x = move(xc[order], out_splits, in_splits)
    # the ids and weights of each sent token's choices on the relay's node (others: id -1, weight 0)
    dest_node = torch.cat([torch.full((hits.numel(),), b, dtype=torch.int64) for b, hits in relay_tokens]) \
        if relay_tokens else torch.zeros(0, dtype=torch.int64)
    on_dest = keep[order] & (owner_node[order] == dest_node[:, None])
    relayed_ids = exchange.all_to_all(torch.where(on_dest, routing.experts[order], -1), out_splits, in_splits)
    relayed_w = move(routing.weights[order] * on_dest, out_splits, in_splits)

    # 2. this node's choices of own and relayed tokens, to their owners on the node, and the results back
    mine = keep & (owner_node == node)
    rows_v = torch.cat([xc, relayed_x])
    ids_v = torch.cat([torch.where(mine, routing.experts, -1), relayed_ids])
    w_v = torch.cat([routing.weights * mine, relayed_w])
    flat = (ids_v >= 0).reshape(-1).nonzero().reshape(-1)                 # kept choices, (token, j) order
    chosen = ids_v.reshape(-1)[flat]
    by_expert = torch.sort(chosen, stable=True).indices                   # owner, then local expert, then token
    sends, chosen_sorted = flat[by_expert], chosen[by_expert]
    owner_counts = torch.bincount(chosen_sorted // L, minlength=P)
    o_splits, i_splits = _splits(owner_counts, exchange)
    rows_in = move(rows_v[sends // top_k], o_splits, i_splits)
    ids_in = exchange.all_to_all(chosen_sorted.reshape(-1, 1), o_splits, i_splits).reshape(-1)
    results = rows_in.new_zeros(rows_in.shape)
    for e in range(L):
        picked = (ids_in - rank * L == e).nonzero().reshape(-1)
        if picked.numel():
            results = results.index_put((picked,), reference.expert_ffn(rows_in[picked], w1[e], w2[e], activation))
    back = move(results, i_splits, o_splits)
    choice_out = rows_v.new_zeros(ids_v.numel(), H).index_put((sends,), back).reshape(-1, top_k, H)
    partial = reference.weighted_sum(w_v, ids_v >= 0, choice_out)         # [T + relayed, H], j order

    # 3. relayed tokens' partials back to their sources; 4. own node's partial, then the others in node order
    returned = move(partial[T:], in_splits, out_splits)
    y = partial[:T]
    start = 0
    for _, hits in relay_tokens:
        y = y.index_add(0, hits, returned[start:start + hits.numel()])
        start += hits.numel()

    if traffic is not None:
        # token rows out and the relayed tokens' partial sums back; choice rows out and results back
        traffic.cross_node_rows += sum(in_splits) + sum(out_splits)
        traffic.in_node_rows += sum(i_splits) - i_splits[rank] + sum(o_splits) - o_splits[rank]
    return y, routing, keep
