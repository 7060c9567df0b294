"""The gloo expert-parallel MoE (``flashdmoe.parallel.ep_gloo``) in real multi-process runs against the reference.

Each test spawns P processes (one per rank) that join a gloo group on 127.0.0.1, run many cases, and
compare their own output and gradients with ``reference.moe_expert_parallel`` (computed by every rank for
all ranks, from the same seeded inputs). Spawning costs a few seconds per process, so one spawn covers
many cases.

Fixed-routing cases pass ``experts``/``keep`` (random distinct experts with random drops, or the router's
own choice) and are checked against ``reference.moe_fixed_routing`` with all experts on one rank.

Tolerances: tests/ep_checks.py (derived from flashdmoe.numerics).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flashdmoe import reference
from flashdmoe.parallel.ep_gloo import TrafficCounter, expert_parallel_moe

from ep_checks import assert_close
from gloo_ranks import case_inputs, spawn



def _run_case(case: dict, rank: int, world_size: int) -> None:
    xs, dys, router, w1s, w2s = case_inputs(case, world_size)
    options = dict(top_k=case["top_k"], activation=case["activation"], normalize_topk=case["normalize_topk"],
                   capacity_factor=case["capacity_factor"])
    dtype = case["dtype"]

    # Reference: all ranks in one process, summed loss sum_r <y_r, dy_r> + aux weight * sum_r aux_r.
    ref_xs = [x.clone().requires_grad_() for x in xs]
    ref_router = router.clone().requires_grad_()
    ref_w1s = [w.clone().requires_grad_() for w in w1s]
    ref_w2s = [w.clone().requires_grad_() for w in w2s]
    ref_ys, ref_auxes = reference.moe_expert_parallel(ref_xs, ref_router, ref_w1s, ref_w2s, return_aux=True, **options)
    loss = sum((y.double() * dy.double()).sum() for y, dy in zip(ref_ys, dys))
    loss = loss + 0.1 * sum(aux.aux_loss.double() for aux in ref_auxes)
    loss.backward()

    # Distributed: this rank's tokens and shard only.
    x = xs[rank].clone().requires_grad_(case.get("x_requires_grad", [True] * world_size)[rank])
    my_router = router.clone().requires_grad_()
    w1, w2 = w1s[rank].clone().requires_grad_(), w2s[rank].clone().requires_grad_()
    traffic = TrafficCounter()
    y, aux = expert_parallel_moe(x, my_router, w1, w2, return_aux=True, traffic=traffic, **options)
    local_loss = (y.double() * dys[rank].double()).sum() + 0.1 * aux.aux_loss.double()
    local_loss.backward()

    label = f"case {case['name']} rank {rank}"
    assert_close(f"{label} y", y, ref_ys[rank].detach(), dtype)
    with torch.no_grad():  # inference: no graph, same output
        y_inference = expert_parallel_moe(x, my_router, w1, w2, **options)
    assert not y_inference.requires_grad and torch.equal(y_inference, y.detach()), label
    assert torch.equal(aux.counts, ref_auxes[rank].counts), label
    assert int(aux.dropped) == int(ref_auxes[rank].dropped), label
    assert_close(f"{label} aux_loss", aux.aux_loss.detach(), ref_auxes[rank].aux_loss.detach(), torch.float64
                  if dtype == torch.float64 else torch.float32)
    if x.requires_grad:
        assert_close(f"{label} dx", x.grad, ref_xs[rank].grad, dtype)
    assert_close(f"{label} d router_weight", my_router.grad, ref_router.grad, dtype)
    assert_close(f"{label} dw1", w1.grad, ref_w1s[rank].grad, dtype)
    assert_close(f"{label} dw2", w2.grad, ref_w2s[rank].grad, dtype)
    # Traffic: exactly the rows this rank dispatched to the other ranks' experts.
    local = case["local_experts"]
    owner = ref_auxes[rank].counts.new_tensor([e // local for e in range(local * world_size)])
    # with capacity, dropped choices do not travel: count the kept ones per destination
    routing = reference.route(xs[rank], router, case["top_k"], case["normalize_topk"])
    capacity = reference.expert_capacity(xs[rank].shape[0], case["top_k"], local * world_size, case["capacity_factor"])
    keep = reference.keep_mask(routing.experts, local * world_size, capacity)
    remote_rows = int((owner[routing.experts][keep] != rank).sum())
    assert traffic.rows_sent_remote == remote_rows, label


def _fixed_routing(case: dict, xs, router, world_size: int):
    """Every rank's fixed routing ``(experts [T, k], keep [T, k])``, seeded and the same on every rank."""
    generator = torch.Generator().manual_seed(case["seed"] + 500)
    num_experts, top_k = case["local_experts"] * world_size, case["top_k"]
    routing = []
    for x in xs:
        if case["fixed"] == "router":
            chosen = reference.route(x, router, top_k, case["normalize_topk"]).experts
            keep = reference.keep_mask(chosen, num_experts, reference.expert_capacity(
                x.shape[0], top_k, num_experts, 0.75))
        else:
            chosen = torch.rand(x.shape[0], num_experts, generator=generator).argsort(dim=1)[:, :top_k]
            keep = torch.rand(x.shape[0], top_k, generator=generator) < 0.7
        routing.append((chosen.to(case.get("expert_dtype", torch.int64)), keep))
    return routing


def _run_fixed_case(case: dict, rank: int, world_size: int) -> None:
    """``experts``/``keep`` given: y and every gradient vs ``reference.moe_fixed_routing`` (all experts on
    one rank, loss summed over ranks)."""
    xs, dys, router, w1s, w2s = case_inputs(case, world_size)
    routing = _fixed_routing(case, xs, router, world_size)
    dtype, local = case["dtype"], case["local_experts"]
    options = dict(activation=case["activation"], normalize_topk=case["normalize_topk"])

    ref_xs = [x.clone().requires_grad_() for x in xs]
    ref_router = router.clone().requires_grad_()
    ref_w1, ref_w2 = torch.cat(w1s).requires_grad_(), torch.cat(w2s).requires_grad_()
    ref_ys = [reference.moe_fixed_routing(x, ref_router, ref_w1, ref_w2, chosen.long(), keep, **options)
              for x, (chosen, keep) in zip(ref_xs, routing)]
    sum((y.double() * dy.double()).sum() for y, dy in zip(ref_ys, dys)).backward()

    x = xs[rank].clone().requires_grad_(case.get("x_requires_grad", [True] * world_size)[rank])
    my_router = router.clone().requires_grad_()
    w1, w2 = w1s[rank].clone().requires_grad_(), w2s[rank].clone().requires_grad_()
    chosen, keep = routing[rank]
    traffic = TrafficCounter()
    y, aux = expert_parallel_moe(x, my_router, w1, w2, top_k=case["top_k"], experts=chosen, keep=keep,
                                 return_aux=True, traffic=traffic, **options)
    (y.double() * dys[rank].double()).sum().backward()

    label = f"case {case['name']} rank {rank}"
    assert_close(f"{label} y", y, ref_ys[rank].detach(), dtype)
    if x.requires_grad:
        assert_close(f"{label} dx", x.grad, ref_xs[rank].grad, dtype)
    assert_close(f"{label} d router_weight", my_router.grad, ref_router.grad, dtype)
    assert_close(f"{label} dw1", w1.grad, ref_w1.grad[rank * local:(rank + 1) * local], dtype)
    assert_close(f"{label} dw2", w2.grad, ref_w2.grad[rank * local:(rank + 1) * local], dtype)
    num_experts = local * world_size
    assert torch.equal(aux.counts, torch.bincount(chosen.long().reshape(-1), minlength=num_experts)), label
    assert int(aux.dropped) == int((~keep).sum()), label
    assert traffic.rows_sent_remote == int((keep & (chosen.long() // local != rank)).sum()), label


def _run_bad_rank(case: dict, rank: int, world_size: int) -> None:
    """One rank's own input check fails: every rank raises ValueError (none waits in a collective), and the
    group is still in step afterwards."""
    xs, _, router, w1s, w2s = case_inputs(case, world_size)
    options = dict(top_k=case["top_k"], activation=case["activation"])
    w1 = w1s[rank]
    bad = rank == case["bad_rank"]
    if bad and case["fault"] == "w1":
        w1 = w1[:, :, :-1].contiguous()
    call = dict(options)
    if case["fault"] == "capacity-with-fixed-routing":  # every rank makes this mistake
        chosen, keep = _fixed_routing(dict(case, fixed="random"), xs, router, world_size)[rank]
        call.update(experts=chosen, keep=keep, capacity_factor=1.0)
    elif bad and case["fault"] == "experts":
        chosen, keep = _fixed_routing(dict(case, fixed="random"), xs, router, world_size)[rank]
        call.update(experts=chosen[:, :1].contiguous(), keep=keep)  # k = 1 but top_k = 2
    expected = {"w1": "w1", "experts": "experts", "capacity-with-fixed-routing": "capacity_factor"}[case["fault"]]
    with pytest.raises(ValueError) as raised:
        expert_parallel_moe(xs[rank], router, w1, w2s[rank], **call)
    message = str(raised.value)
    if bad or case["fault"] == "capacity-with-fixed-routing":
        assert expected in message, message
    else:
        assert f"rank(s) [{case['bad_rank']}]" in message, message
    # still in step: a good call on every rank goes through
    expert_parallel_moe(xs[rank], router, w1s[rank], w2s[rank], **options)


def _run_cases(rank: int, world_size: int, cases: list[dict]) -> None:
    for case in cases:
        if case.get("mismatch_rank") is not None:
            _run_mismatch(case, rank, world_size)
        elif case.get("fault") is not None:
            _run_bad_rank(case, rank, world_size)
        elif case.get("fixed") is not None:
            _run_fixed_case(case, rank, world_size)
        else:
            _run_case(case, rank, world_size)
        dist.barrier()


def _run_mismatch(case: dict, rank: int, world_size: int) -> None:
    """One rank uses a different top_k: every rank must raise ValueError naming it (no hang)."""
    xs, _, router, w1s, w2s = case_inputs(case, world_size)
    top_k = case["top_k"] + (1 if rank == case["mismatch_rank"] else 0)
    with pytest.raises(ValueError, match="top_k"):
        expert_parallel_moe(xs[rank], router, w1s[rank], w2s[rank], top_k=top_k, activation=case["activation"])


def _spawn(world_size: int, cases: list[dict], tmp_path) -> None:
    spawn(_run_cases, world_size, tmp_path, cases)


def _cases(world_size: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1000 + world_size)
    activations = reference.ACTIVATIONS
    cases = []
    for index in range(8):
        tokens = torch.randint(1, 40, (world_size,), generator=generator).tolist()
        tokens[index % world_size] = 0 if index % 3 == 0 else tokens[index % world_size]  # a rank with T = 0
        cases.append(dict(
            name=f"p{world_size}-{index}", seed=index + 10 * world_size, tokens=tokens,
            hidden=int(torch.randint(4, 24, (1,), generator=generator)),
            ffn=int(torch.randint(3, 20, (1,), generator=generator)),
            local_experts=1 + index % 3,
            top_k=min(1 + index % 2 + (index % 4 == 3), (1 + index % 3) * world_size),
            activation=activations[index % len(activations)], normalize_topk=index % 2 == 0,
            capacity_factor=(None, 0.5, 1.0, 1.25)[index % 4],
            dtype=(torch.float64, torch.float64, torch.float32, torch.bfloat16)[index % 4]))
    # no tokens anywhere: the exchanges are all empty
    cases.append(dict(cases[0], name=f"p{world_size}-no-tokens", tokens=[0] * world_size))
    # fully skewed routing: a zero router makes every probability tie, so every token picks experts
    # 0..k-1 (ties to the lower index) and rank 0 receives everything; with capacity some are dropped
    cases.append(dict(cases[1], name=f"p{world_size}-skewed", zero_router=True, tokens=[17] * world_size))
    # rank 0's x does not require grad while others' do: collectives must still line up
    cases.append(dict(cases[1], name=f"p{world_size}-mixed-requires-grad",
                      x_requires_grad=[False] + [True] * (world_size - 1)))
    cases.append(dict(cases[2], name=f"p{world_size}-layer-mismatch", mismatch_rank=world_size - 1))
    # fixed routing (experts/keep given): random distinct experts with drops, float64 and bfloat16, a rank
    # with T = 0, int32 experts, the router's own choice, a rank whose x needs no grad
    cases.append(dict(cases[0], name=f"p{world_size}-fixed-random-f64", fixed="random", top_k=2,
                      local_experts=2, normalize_topk=False))
    cases.append(dict(cases[3], name=f"p{world_size}-fixed-random-bf16", fixed="random", top_k=2,
                      expert_dtype=torch.int32))
    cases.append(dict(cases[5], name=f"p{world_size}-fixed-router-f64", fixed="router", dtype=torch.float64,
                      x_requires_grad=[True] * (world_size - 1) + [False]))
    # bad input on one rank / the same mistake on every rank: ValueError everywhere, no hang
    cases.append(dict(cases[2], name=f"p{world_size}-bad-w1", fault="w1", bad_rank=world_size - 1))
    cases.append(dict(cases[1], name=f"p{world_size}-bad-experts", fault="experts", bad_rank=0, top_k=2,
                      local_experts=2))
    cases.append(dict(cases[1], name=f"p{world_size}-capacity-with-fixed-routing",
                      fault="capacity-with-fixed-routing", bad_rank=0, top_k=2, local_experts=2))
    return cases


@pytest.mark.parametrize("world_size", [2, 3])
def test_expert_parallel_gloo_matches_reference(world_size, tmp_path):
    _spawn(world_size, _cases(world_size), tmp_path)


def test_expert_parallel_requires_initialised_group():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="init_process_group"):
        expert_parallel_moe(x, torch.randn(2, 4), torch.randn(2, 4, 5), torch.randn(2, 5, 4), top_k=1)
