"""The hierarchical cross-node exchange (flashdmoe.parallel.ep_hierarchy) in real gloo processes laid out as nodes:
y and every gradient against ``reference.moe_expert_parallel`` (float64 and float32; tolerances from
tests/ep_checks.py), and the rows it sends across nodes against the routing: one per (token, other node
hit), never more than direct puts' one per remote choice, and fewer wherever a token's choices share a
node. One spawn covers every case."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashdmoe import reference
from flashdmoe.parallel.ep_hierarchy import HierarchyTraffic, direct_rows, hierarchical_moe
from flashdmoe.parallel.ep_gloo import GlooExchange

from ep_checks import assert_close
from gloo_ranks import case_inputs, spawn

WORLD = 6  # 3 nodes of 2, or 2 nodes of 3

CASES = [
    dict(name="3x2-k4-gelu-f64", ranks_per_node=2, tokens=[23, 0, 17, 31, 5, 12], hidden=16, ffn=12, local_experts=2, top_k=4,
         activation="gelu", normalize=True, capacity=None, dtype=torch.float64, seed=1),
    dict(name="2x3-k3-swiglu-capacity-f64", ranks_per_node=3, tokens=[40, 9, 27, 0, 33, 18], hidden=8, ffn=8, local_experts=2,
         top_k=3, activation="swiglu", normalize=False, capacity=0.75, dtype=torch.float64, seed=2),
    dict(name="3x2-k2-relu-f32", ranks_per_node=2, tokens=[30, 30, 30, 30, 30, 30], hidden=12, ffn=10, local_experts=1,
         top_k=2, activation="relu", normalize=True, capacity=None, dtype=torch.float32, seed=3),
    dict(name="6x1-k1-silu-f64", ranks_per_node=1, tokens=[7, 3, 0, 11, 5, 2], hidden=8, ffn=6, local_experts=3, top_k=1,
         activation="silu", normalize=True, capacity=1.0, dtype=torch.float64, seed=4),
]


def _run_case(case: dict, rank: int) -> None:
    xs, dys, router, w1s, w2s = case_inputs(case, WORLD)
    options = dict(top_k=case["top_k"], activation=case["activation"], normalize_topk=case["normalize"],
                   capacity_factor=case["capacity"])
    ref_xs = [x.clone().requires_grad_() for x in xs]
    ref_router = router.clone().requires_grad_()
    ref_w1s = [w.clone().requires_grad_() for w in w1s]
    ref_w2s = [w.clone().requires_grad_() for w in w2s]
    ref_ys = reference.moe_expert_parallel(ref_xs, ref_router, ref_w1s, ref_w2s, **options)
    sum((y.double() * dy.double()).sum() for y, dy in zip(ref_ys, dys)).backward()

    x = xs[rank].clone().requires_grad_()
    my_router = router.clone().requires_grad_()
    w1, w2 = w1s[rank].clone().requires_grad_(), w2s[rank].clone().requires_grad_()
    exchange = GlooExchange()
    traffic = HierarchyTraffic()
    y, routing, keep = hierarchical_moe(exchange, x, my_router, w1, w2, ranks_per_node=case["ranks_per_node"],
                                        traffic=traffic, **options)
    (y.double() * dys[rank].double()).sum().backward()
    router_grad = exchange.all_reduce_sum(my_router.grad)  # the replicated router: every rank's share summed
    label = f"case {case['name']} rank {rank}"
    dtype = case["dtype"]
    assert_close(f"{label} y", y.to(dtype), ref_ys[rank].detach(), dtype)
    assert_close(f"{label} dx", x.grad, ref_xs[rank].grad, dtype)
    assert_close(f"{label} d router_weight", router_grad, ref_router.grad, dtype)
    assert_close(f"{label} dw1", w1.grad, ref_w1s[rank].grad, dtype)
    assert_close(f"{label} dw2", w2.grad, ref_w2s[rank].grad, dtype)

    # Rows across nodes: this rank's tokens once per other node they hit, out, and as many partial sums
    # back for the tokens other ranks relayed here. Direct puts would send one per remote kept choice.
    G, L, E = case["ranks_per_node"], case["local_experts"], case["local_experts"] * WORLD
    node = rank // G

    def tokens_hitting(source: int, target_node: int) -> int:
        r = reference.route(xs[source], router, case["top_k"], case["normalize"])
        kept = reference.keep_mask(r.experts, E, reference.expert_capacity(xs[source].shape[0], case["top_k"], E,
                                                                          case["capacity"]))
        return int(((r.experts // L // G == target_node) & kept).any(dim=1).sum())

    out_rows = sum(tokens_hitting(rank, b) for b in range(WORLD // G) if b != node)
    relayed_here = sum(tokens_hitting(q, node) for q in range(WORLD) if q // G != node and q % G == rank % G)
    assert traffic.cross_node_rows == out_rows + relayed_here, (label, traffic, out_rows, relayed_here)
    cross_direct, _ = direct_rows(routing.experts, keep, L, rank, G)
    assert out_rows <= cross_direct, label
    owner_node = routing.experts // L // G
    # two kept choices of a token on the same other node: that node gets one row, not two
    shared = int(((owner_node[:, :, None] == owner_node[:, None, :]) & keep[:, :, None] & keep[:, None, :]
                  & (owner_node[:, :, None] != node)).triu(1).sum())
    assert (out_rows < cross_direct) == (shared > 0), (label, out_rows, cross_direct, shared)


def _run_cases(rank: int, world_size: int) -> None:
    for case in CASES:
        _run_case(case, rank)
        dist.barrier()


def test_hierarchical_exchange_matches_the_reference_and_sends_one_row_per_node(tmp_path):
    spawn(_run_cases, WORLD, tmp_path, timeout_s=120)


def test_direct_rows_split_remote_choices_by_node():
    experts = torch.tensor([[0, 5], [2, 3], [7, 1]])  # L = 1, 2 ranks per node: rank 0's node is {0, 1}
    keep = torch.tensor([[True, True], [True, False], [True, True]])
    assert direct_rows(experts, keep, 1, 0, 2) == (3, 1)  # 5, 2, 7 cross; 1 stays on the node; 0 is rank 0's
