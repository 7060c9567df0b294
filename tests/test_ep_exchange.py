"""The peer-memory exchange (``flashdmoe.parallel.ep_peer``) and the fixed-routing backward, on CPU, in one process.

``P`` threads stand in for ``P`` NVSHMEM ranks: each holds a fake team whose symmetric ``recv``/``comb``
buffers are plain CPU tensors that every thread can write ("peer memory"), whose ``barrier()`` is a
``threading.Barrier`` and whose peer views come from a stand-in for ``nvshmem.core.get_peer_tensor``. The
code under test is the real one: ``PeerExchange.from_team``, its ``all_to_all``/``all_reduce_sum`` byte
layout in the staging regions, and ``expert_parallel_backward`` end to end, checked against
``flashdmoe.reference`` (``moe_fixed_routing`` with all experts on one rank, and ``moe_expert_parallel``).
A desynchronised rank shows up as a ``BrokenBarrierError`` after the barrier's timeout, not a hang.

Tolerances: tests/ep_checks.py (derived from flashdmoe.numerics).
"""

from __future__ import annotations

import threading

import pytest
import torch

from flashdmoe import reference
from flashdmoe.parallel import ep_peer
from flashdmoe.parallel.ep_exchange import TrafficCounter
from flashdmoe.parallel.ep_peer import PeerExchange, expert_parallel_backward
from flashdmoe.parallel.team import BufferPlan, RankBuffers, Team, TeamFailed

from ep_checks import assert_close

BARRIER_TIMEOUT_S = 60


class _ThreadTeam:
    """What ``PeerExchange.from_team`` and ``expert_parallel_backward`` use of a ``Team.nvshmem`` team."""

    transport = "nvshmem"

    def __init__(self, rank: int, world_size: int, plan: BufferPlan, buffers: RankBuffers,
                 barrier: threading.Barrier) -> None:
        self.rank, self.world_size, self.plan = rank, world_size, plan
        self.buffers = [buffers]
        self._barrier = barrier
        self._failure = None
        self.barriers = 0

    def barrier(self) -> None:
        self.require_usable()
        self.barriers += 1
        if self.buffers[0].recv.is_cuda:  # a thread barrier does not order CUDA work: finish it first
            torch.cuda.synchronize(self.buffers[0].recv.device)
        self._barrier.wait()

    def require_usable(self) -> None:
        if self._failure is not None:
            raise TeamFailed(self._failure)

    def mark_failed(self, reason: str) -> None:
        self._failure = self._failure or reason

    @property
    def failed(self) -> bool:
        return self._failure is not None


def _thread_teams(world_size: int, *, max_tokens: int, hidden: int, top_k: int, local_experts: int,
                  monkeypatch, staging_scale: int = 1, device: str = "cpu") -> list[_ThreadTeam]:
    """Teams whose buffers are sized like ``Team.nvshmem``'s for a bf16 plan (times ``staging_scale``)."""
    plan = BufferPlan(world_size, max_tokens, hidden, top_k, local_experts, torch.bfloat16)
    size = plan.data_bytes * staging_scale
    recvs = [torch.full((size,), 0xAB, dtype=torch.uint8, device=device) for _ in range(world_size)]
    combs = [torch.full((size,), 0xCD, dtype=torch.uint8, device=device) for _ in range(world_size)]
    registry = {t.data_ptr(): ts for ts in (recvs, combs) for t in ts}
    # stand-in for nvshmem.core.get_peer_tensor: rank q's tensor of the same symmetric allocation
    monkeypatch.setattr(ep_peer, "_peer_tensor", lambda tensor, peer: registry[tensor.data_ptr()][peer])
    barrier = threading.Barrier(world_size, timeout=BARRIER_TIMEOUT_S)
    teams = []
    for rank in range(world_size):
        buffers = RankBuffers(recv=recvs[rank], comb=combs[rank],
                              signals=torch.zeros(plan.signal_words, dtype=torch.int32, device=device),
                              peer_recv=[t.data_ptr() for t in recvs], peer_comb=[t.data_ptr() for t in combs])
        teams.append(_ThreadTeam(rank, world_size, plan, buffers, barrier))
    return teams


def _run_ranks(world_size: int, body):
    """Run ``body(rank)`` on ``world_size`` threads; returns (results, exceptions), one entry per rank."""
    results, errors = [None] * world_size, [None] * world_size

    def target(rank):
        try:
            results[rank] = body(rank)
        except BaseException as error:  # noqa: BLE001 - reported to the test
            errors[rank] = error

    threads = [threading.Thread(target=target, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=4 * BARRIER_TIMEOUT_S)
        assert not thread.is_alive(), "a rank is still running (deadlock)"
    return results, errors


def _raise_first(errors) -> None:
    for rank, error in enumerate(errors):
        if error is not None:
            raise AssertionError(f"rank {rank} raised {error!r}") from error


# ----------------------------------------------------------------------------------------------------------
# The exchange itself
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
def test_all_to_all_delivers_every_row_and_uses_the_documented_regions(dtype, monkeypatch):
    world_size, width = 3, 5  # 5 columns: row sizes and offsets that are not multiples of 8 bytes
    teams = _thread_teams(world_size, max_tokens=4, hidden=6, top_k=2, local_experts=2, monkeypatch=monkeypatch)
    generator = torch.Generator().manual_seed(7)
    row_size = torch.empty((), dtype=dtype).element_size() * width
    capacity_rows = PeerExchange.from_team(teams[0]).capacity_bytes // row_size
    recv_region_rows = teams[0].plan.data_bytes // world_size // row_size
    assert capacity_rows > recv_region_rows + 1  # some messages below spill from recv into comb
    # splits[src][dst]: rows src sends dst, from 0 up to the capacity
    splits = torch.randint(0, capacity_rows + 1, (world_size, world_size), generator=generator).tolist()
    splits[0][1], splits[1][0], splits[2][2] = capacity_rows, 0, capacity_rows

    def payload(src, dst, count):
        # every value names (src, dst, row): exact in every dtype here
        values = torch.arange(count * width, dtype=torch.float64).reshape(count, width)
        return (values + 100 * src + 1000 * dst).to(dtype) if dtype != torch.int64 else \
            (values + 100 * src + 1000 * dst).to(torch.int64)

    def body(rank):
        exchange = PeerExchange.from_team(teams[rank], traffic=TrafficCounter())
        sent = torch.cat([payload(rank, dst, splits[rank][dst]) for dst in range(world_size)])
        received = exchange.all_to_all(sent, [splits[src][rank] for src in range(world_size)], splits[rank])
        # region s of this rank's recv holds what s sent (first bytes of the message), as the design says
        recv = teams[rank].buffers[0].recv
        region = teams[rank].plan.data_bytes // world_size
        layout_ok = []
        for src in range(world_size):
            message = payload(src, rank, splits[src][rank]).reshape(-1).view(torch.uint8)
            shown = min(region, message.numel())
            if src != rank:
                layout_ok.append(torch.equal(recv[src * region:src * region + shown], message[:shown]))
        return received, layout_ok, exchange.traffic

    results, errors = _run_ranks(world_size, body)
    _raise_first(errors)
    for rank, (received, layout_ok, traffic) in enumerate(results):
        expected = torch.cat([payload(src, rank, splits[src][rank]) for src in range(world_size)])
        assert received.dtype == dtype and torch.equal(received, expected), f"rank {rank}"
        assert all(layout_ok), f"rank {rank}: recv regions do not hold the sources' messages"
        assert traffic.bytes_sent == row_size * sum(splits[rank][d] for d in range(world_size) if d != rank)
        assert traffic.bytes_received == row_size * sum(splits[s][rank] for s in range(world_size) if s != rank)


def test_all_to_all_refuses_a_message_larger_than_the_staging_area(monkeypatch):
    world_size = 2
    teams = _thread_teams(world_size, max_tokens=2, hidden=4, top_k=1, local_experts=1, monkeypatch=monkeypatch)
    capacity = PeerExchange.from_team(teams[0]).capacity_bytes
    rows = capacity // 16 + 1  # float32 rows of 4 columns: 16 bytes each, one more than fits

    def body(rank):
        exchange = PeerExchange.from_team(teams[rank])
        exchange.all_to_all(torch.zeros(2 * rows, 4), [rows, rows], [rows, rows])

    _, errors = _run_ranks(world_size, body)
    for error in errors:
        assert isinstance(error, ValueError) and "does not fit" in str(error) and "max_tokens" in str(error), error
    assert all(team.barriers == 0 for team in teams)  # refused before any rank waited


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_reduce_sum_is_the_rank_ordered_sum_on_every_rank(dtype, monkeypatch):
    world_size = 3
    teams = _thread_teams(world_size, max_tokens=2, hidden=4, top_k=1, local_experts=1, monkeypatch=monkeypatch)
    capacity = PeerExchange.from_team(teams[0]).capacity_bytes
    element = torch.empty((), dtype=dtype).element_size()
    numel = 3 * (capacity // element) + 5  # four chunks, the last one partial
    generator = torch.Generator().manual_seed(3)
    tensors = [(torch.randn(numel, generator=generator, dtype=torch.float64) * 10 ** (r - 1)).to(dtype)
               for r in range(world_size)]
    shape = (numel // 1,)

    results, errors = _run_ranks(
        world_size, lambda rank: PeerExchange.from_team(teams[rank]).all_reduce_sum(tensors[rank].view(shape)))
    _raise_first(errors)
    accumulate = torch.float32 if dtype == torch.bfloat16 else dtype
    expected = tensors[0].to(accumulate)
    for tensor in tensors[1:]:
        expected = expected + tensor.to(accumulate)
    expected = expected.to(dtype)
    for rank, got in enumerate(results):
        assert got.dtype == dtype and torch.equal(got, expected), f"rank {rank}"
    # and the inputs are untouched
    assert all(t.dtype == dtype for t in tensors)


def test_single_rank_team_needs_no_staging():
    exchange = PeerExchange.from_team(Team.single())
    rows = torch.randn(5, 3)
    assert torch.equal(exchange.all_to_all(rows, [5], [5]), rows)
    assert torch.equal(exchange.all_reduce_sum(rows), rows)
    with pytest.raises(ValueError, match="input_splits"):
        exchange.all_to_all(rows, [5], [4])


# ----------------------------------------------------------------------------------------------------------
# expert_parallel_backward
# ----------------------------------------------------------------------------------------------------------


def _layer(case: dict, world_size: int):
    """Seeded inputs: xs/dys ``[T_r, H]``, router ``[E, H]``, shards, and a fixed routing per rank."""
    generator = torch.Generator().manual_seed(case["seed"])
    hidden, ffn, local, top_k, dtype = case["hidden"], case["ffn"], case["local_experts"], case["top_k"], case["dtype"]
    experts = local * world_size
    w1_cols = 2 * ffn if case["activation"] == "swiglu" else ffn

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)

    router = randn(experts, hidden, scale=hidden ** -0.5)
    w1s = [randn(local, hidden, w1_cols, scale=hidden ** -0.5) for _ in range(world_size)]
    w2s = [randn(local, ffn, hidden, scale=ffn ** -0.5) for _ in range(world_size)]
    xs = [randn(tokens, hidden) for tokens in case["tokens"]]
    dys = [randn(tokens, hidden) for tokens in case["tokens"]]
    routing = []
    for x in xs:
        if case["routing"] == "router":  # what the forward kernel would pick (top-k + capacity)
            chosen = reference.route(x, router, top_k, case["normalize_topk"]).experts
            capacity = reference.expert_capacity(x.shape[0], top_k, experts, case.get("capacity_factor"))
            keep = reference.keep_mask(chosen, experts, capacity)
        else:  # any distinct experts per token, some dropped: not the router's choice
            chosen = torch.rand(x.shape[0], experts, generator=generator).argsort(dim=1)[:, :top_k]
            keep = torch.rand(x.shape[0], top_k, generator=generator) < 0.75
        routing.append((chosen.to(case.get("expert_dtype", torch.int64)), keep))
    return xs, dys, router, w1s, w2s, routing


def _reference_grads(case: dict, xs, dys, router, w1s, w2s, routing):
    """Gradients of sum_r <dy_r, y_r> with every rank's fixed routing, all experts on one rank."""
    ref_xs = [x.clone().requires_grad_() for x in xs]
    ref_router = router.clone().requires_grad_()
    ref_w1 = torch.cat(w1s).requires_grad_()
    ref_w2 = torch.cat(w2s).requires_grad_()
    loss = 0
    for x, dy, (chosen, keep) in zip(ref_xs, dys, routing):
        y = reference.moe_fixed_routing(x, ref_router, ref_w1, ref_w2, chosen.long(), keep,
                                        activation=case["activation"], normalize_topk=case["normalize_topk"])
        loss = loss + (y.double() * dy.double()).sum()
    loss.backward()
    local = case["local_experts"]
    return ([x.grad for x in ref_xs], ref_router.grad,
            [ref_w1.grad[r * local:(r + 1) * local] for r in range(len(xs))],
            [ref_w2.grad[r * local:(r + 1) * local] for r in range(len(xs))])


CASES = [
    dict(name="gelu-random-routing", seed=1, tokens=[7, 0, 5], hidden=6, ffn=5, local_experts=2, top_k=2,
         activation="gelu", normalize_topk=True, routing="random", dtype=torch.float64),
    dict(name="swiglu-unnormalised-int32", seed=2, tokens=[3, 9, 4], hidden=5, ffn=3, local_experts=2, top_k=3,
         activation="swiglu", normalize_topk=False, routing="random", dtype=torch.float64, expert_dtype=torch.int32),
    dict(name="relu-router-routing-capacity", seed=3, tokens=[8, 6, 8], hidden=4, ffn=7, local_experts=3,
         top_k=2, activation="relu", normalize_topk=True, routing="router", capacity_factor=0.5,
         dtype=torch.float64),
    dict(name="silu-bf16", seed=4, tokens=[6, 8, 1], hidden=8, ffn=6, local_experts=2, top_k=2,
         activation="silu", normalize_topk=True, routing="random", dtype=torch.bfloat16),
    dict(name="gelu-two-ranks-k1", seed=5, tokens=[5, 2], hidden=3, ffn=4, local_experts=3, top_k=1,
         activation="gelu", normalize_topk=True, routing="random", dtype=torch.float64),
]


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_backward_matches_reference_fixed_routing(case, monkeypatch):
    world_size = len(case["tokens"])
    xs, dys, router, w1s, w2s, routing = _layer(case, world_size)
    want_dx, want_router, want_w1, want_w2 = _reference_grads(case, xs, dys, router, w1s, w2s, routing)
    # float64 rows are 4x wider than the bf16 plan's: size the staging for them (the buffers are generic)
    teams = _thread_teams(world_size, max_tokens=max(max(case["tokens"]), 1), hidden=case["hidden"],
                          top_k=case["top_k"], local_experts=case["local_experts"], monkeypatch=monkeypatch,
                          staging_scale=4 if case["dtype"] == torch.float64 else 1)
    traffics = [TrafficCounter() for _ in range(world_size)]

    def body(rank):
        chosen, keep = routing[rank]
        return expert_parallel_backward(
            teams[rank], xs[rank], router, w1s[rank], w2s[rank], chosen, keep, dys[rank],
            activation=case["activation"], normalize_topk=case["normalize_topk"], traffic=traffics[rank])

    results, errors = _run_ranks(world_size, body)
    _raise_first(errors)
    dtype = case["dtype"]
    for rank, (dx, d_router, dw1, dw2) in enumerate(results):
        label = f"{case['name']} rank {rank}"
        assert_close(f"{label} dx", dx, want_dx[rank], dtype)
        assert_close(f"{label} d_router", d_router, want_router, dtype)
        assert_close(f"{label} dw1", dw1, want_w1[rank], dtype)
        assert_close(f"{label} dw2", dw2, want_w2[rank], dtype)
        # the summed router gradient is bitwise the same everywhere
        assert torch.equal(d_router, results[0][1]), label
        # exactly the kept choices owned by other ranks travelled
        chosen, keep = routing[rank]
        owner = chosen.long() // case["local_experts"]
        assert traffics[rank].rows_sent_remote == int((keep & (owner != rank)).sum()), label
    assert not any(team.failed for team in teams)
    # every rank issued the same number of barriers
    assert len({team.barriers for team in teams}) == 1


def test_backward_with_router_routing_matches_moe_expert_parallel(monkeypatch):
    """Given the router's own choices, the fixed-routing backward is the gradient of the routed layer."""
    case = dict(CASES[2], name="vs-moe-expert-parallel", seed=11, capacity_factor=1.0)
    world_size = len(case["tokens"])
    xs, dys, router, w1s, w2s, routing = _layer(case, world_size)
    ref_xs = [x.clone().requires_grad_() for x in xs]
    ref_router = router.clone().requires_grad_()
    ref_w1s = [w.clone().requires_grad_() for w in w1s]
    ref_w2s = [w.clone().requires_grad_() for w in w2s]
    ys = reference.moe_expert_parallel(ref_xs, ref_router, ref_w1s, ref_w2s, top_k=case["top_k"],
                                       activation=case["activation"], normalize_topk=case["normalize_topk"],
                                       capacity_factor=case["capacity_factor"])
    sum((y * dy).sum() for y, dy in zip(ys, dys)).backward()
    teams = _thread_teams(world_size, max_tokens=max(case["tokens"]), hidden=case["hidden"], top_k=case["top_k"],
                          local_experts=case["local_experts"], monkeypatch=monkeypatch, staging_scale=4)

    results, errors = _run_ranks(world_size, lambda rank: expert_parallel_backward(
        teams[rank], xs[rank], router, w1s[rank], w2s[rank], *routing[rank], dys[rank],
        activation=case["activation"], normalize_topk=case["normalize_topk"]))
    _raise_first(errors)
    for rank, (dx, d_router, dw1, dw2) in enumerate(results):
        assert_close(f"rank {rank} dx", dx, ref_xs[rank].grad, torch.float64)
        assert_close(f"rank {rank} d_router", d_router, ref_router.grad, torch.float64)
        assert_close(f"rank {rank} dw1", dw1, ref_w1s[rank].grad, torch.float64)
        assert_close(f"rank {rank} dw2", dw2, ref_w2s[rank].grad, torch.float64)


def test_backward_returns_only_requested_grads_even_when_ranks_differ(monkeypatch):
    """Rank 0 wants nothing but d_router, rank 1 only dx and dw2, rank 2 everything: the collectives still
    line up and every requested gradient is right."""
    case = CASES[0]
    world_size = len(case["tokens"])
    xs, dys, router, w1s, w2s, routing = _layer(case, world_size)
    want = _reference_grads(case, xs, dys, router, w1s, w2s, routing)
    needs = [(False, True, False, False), (True, False, False, True), (True, True, True, True)]
    teams = _thread_teams(world_size, max_tokens=max(case["tokens"]), hidden=case["hidden"], top_k=case["top_k"],
                          local_experts=case["local_experts"], monkeypatch=monkeypatch, staging_scale=4)

    results, errors = _run_ranks(world_size, lambda rank: expert_parallel_backward(
        teams[rank], xs[rank], router, w1s[rank], w2s[rank], *routing[rank], dys[rank],
        activation=case["activation"], normalize_topk=case["normalize_topk"], needs_input_grad=needs[rank]))
    _raise_first(errors)
    for rank, grads in enumerate(results):
        wanted = (want[0][rank], want[1], want[2][rank], want[3][rank])
        for index, (grad, need, expected) in enumerate(zip(grads, needs[rank], wanted)):
            if need:
                assert_close(f"rank {rank} grad {index}", grad, expected, torch.float64)
            else:
                assert grad is None, f"rank {rank} grad {index}"


def test_single_team_backward_matches_reference():
    case = dict(CASES[0], tokens=[6])
    xs, dys, router, w1s, w2s, routing = _layer(case, 1)
    want_dx, want_router, want_w1, want_w2 = _reference_grads(case, xs, dys, router, w1s, w2s, routing)
    dx, d_router, dw1, dw2 = expert_parallel_backward(
        Team.single(), xs[0], router, w1s[0], w2s[0], *routing[0], dys[0], activation=case["activation"],
        normalize_topk=case["normalize_topk"])
    for name, got, expected in (("dx", dx, want_dx[0]), ("d_router", d_router, want_router),
                                ("dw1", dw1, want_w1[0]), ("dw2", dw2, want_w2[0])):
        assert_close(name, got, expected, torch.float64)


# ----------------------------------------------------------------------------------------------------------
# Errors raise on every rank, and leave the team usable
# ----------------------------------------------------------------------------------------------------------


def _bf16_case_and_teams(monkeypatch, **overrides):
    case = dict(CASES[3], **overrides)
    world_size = len(case["tokens"])
    xs, dys, router, w1s, w2s, routing = _layer(case, world_size)
    teams = _thread_teams(world_size, max_tokens=max(case["tokens"]), hidden=case["hidden"], top_k=case["top_k"],
                          local_experts=case["local_experts"], monkeypatch=monkeypatch)
    return case, (xs, dys, router, w1s, w2s, routing), teams


@pytest.mark.parametrize("fault", ["too-many-tokens", "bad-expert-index", "repeated-expert", "dy-shape",
                                   "w1-shape", "other-activation", "needs-input-grad"])
def test_one_bad_rank_makes_every_rank_raise_and_the_team_stays_usable(fault, monkeypatch):
    case, (xs, dys, router, w1s, w2s, routing), teams = _bf16_case_and_teams(monkeypatch)
    world_size = len(teams)
    bad = 1

    def call(rank, broken):
        x, dy, w1, chosen, keep = xs[rank], dys[rank], w1s[rank], routing[rank][0], routing[rank][1]
        activation, needs = case["activation"], (True, True, True, True)
        if broken:
            if fault == "too-many-tokens":
                x = torch.cat([x] * 2 + [x[:1]])  # beyond the team's max_tokens
                dy = torch.cat([dy] * 2 + [dy[:1]])
                chosen = torch.cat([chosen] * 2 + [chosen[:1]])
                keep = torch.cat([keep] * 2 + [keep[:1]])
            elif fault == "bad-expert-index":
                chosen = chosen.clone()
                chosen[0, 0] = router.shape[0]
            elif fault == "repeated-expert":
                chosen = chosen.clone()
                chosen[0, 1] = chosen[0, 0]
            elif fault == "dy-shape":
                dy = dy[:, :-1]
            elif fault == "w1-shape":
                w1 = w1[:, :, :-1].contiguous()
            elif fault == "other-activation":
                activation = "relu"
            else:
                needs = (True, True)
        return expert_parallel_backward(teams[rank], x, router, w1, w2s[rank], chosen, keep, dy,
                                        activation=activation, normalize_topk=case["normalize_topk"],
                                        needs_input_grad=needs)

    _, errors = _run_ranks(world_size, lambda rank: call(rank, rank == bad))
    expected_word = {"too-many-tokens": "max_tokens", "bad-expert-index": "experts", "repeated-expert": "experts",
                     "dy-shape": "dy", "w1-shape": "w1", "other-activation": "different layers",
                     "needs-input-grad": "needs_input_grad"}[fault]
    for rank, error in enumerate(errors):
        assert isinstance(error, ValueError), f"rank {rank}: {error!r}"
        if rank == bad or fault == "other-activation":
            assert expected_word in str(error), f"rank {rank}: {error}"
        else:
            assert f"rank(s) [{bad}]" in str(error), f"rank {rank}: {error}"
    assert not any(team.failed for team in teams)
    assert len({team.barriers for team in teams}) == 1

    # the same teams still work: the failed call left every rank at the same point
    results, errors = _run_ranks(world_size, lambda rank: call(rank, False))
    _raise_first(errors)
    want = _reference_grads(case, xs, dys, router, w1s, w2s, routing)
    for rank, (dx, d_router, dw1, dw2) in enumerate(results):
        assert_close(f"rank {rank} dx", dx, want[0][rank], torch.bfloat16)
        assert_close(f"rank {rank} d_router", d_router, want[1], torch.bfloat16)


def test_rows_too_wide_for_the_staging_raise_on_every_rank(monkeypatch):
    """float64 rows are 4x what a bf16 team's buffers hold per rank pair: refused up front, everywhere."""
    case = CASES[0]
    world_size = len(case["tokens"])
    xs, dys, router, w1s, w2s, routing = _layer(case, world_size)
    teams = _thread_teams(world_size, max_tokens=max(case["tokens"]), hidden=case["hidden"], top_k=case["top_k"],
                          local_experts=case["local_experts"], monkeypatch=monkeypatch, staging_scale=1)
    _, errors = _run_ranks(world_size, lambda rank: expert_parallel_backward(
        teams[rank], xs[rank], router, w1s[rank], w2s[rank], *routing[rank], dys[rank],
        activation=case["activation"], normalize_topk=case["normalize_topk"]))
    for rank, error in enumerate(errors):
        assert isinstance(error, ValueError) and "staging" in str(error) and "max_tokens" in str(error), \
            f"rank {rank}: {error!r}"
    assert not any(team.failed for team in teams)


def test_failed_or_emulated_teams_are_refused(monkeypatch):
    teams = _thread_teams(2, max_tokens=2, hidden=4, top_k=1, local_experts=1, monkeypatch=monkeypatch)
    teams[0].mark_failed("test")
    with pytest.raises(TeamFailed):
        PeerExchange.from_team(teams[0])
    emulated = Team("emulated", 0, 2, teams[1].plan, [], None)
    with pytest.raises(ValueError, match="transport"):
        PeerExchange.from_team(emulated)
    with pytest.raises(ValueError, match="team"):
        PeerExchange.from_team(object())


# ----------------------------------------------------------------------------------------------------------
# The same code on CUDA tensors (one process; the multi-process NVSHMEM test drives flashdmoe.moe)
# ----------------------------------------------------------------------------------------------------------


def _exchange_on(device: str, monkeypatch) -> None:
    """all_to_all in three dtypes (full-capacity messages that spill into comb) and all_reduce_sum, with
    staging buffers and rows on ``device``."""
    world_size, width = 2, 6
    teams = _thread_teams(world_size, max_tokens=8, hidden=width, top_k=2, local_experts=2,
                          monkeypatch=monkeypatch, device=device)
    capacity = PeerExchange.from_team(teams[0]).capacity_bytes
    assert capacity == 2 * (8 * 2) * width * 2  # recv + comb region: 2 * stream_rows * H * bf16 bytes
    dtypes = (torch.float32, torch.bfloat16, torch.int64)

    def splits(dtype):
        full = capacity // (torch.empty((), dtype=dtype).element_size() * width)  # rows that fill a message
        return [[3, full], [full, 5]]  # splits[src][dst]

    def payload(src, dst, count, dtype):
        values = torch.arange(count * width, dtype=torch.float64, device=device).reshape(count, width)
        return (values + 100 * src + 1000 * dst).to(dtype)

    def body(rank):
        exchange = PeerExchange.from_team(teams[rank])
        out = {}
        for dtype in dtypes:
            table = splits(dtype)
            sent = torch.cat([payload(rank, dst, table[rank][dst], dtype) for dst in range(world_size)])
            received = exchange.all_to_all(sent, [table[src][rank] for src in range(world_size)], table[rank])
            assert received.device == sent.device
            out[dtype] = received.cpu()
        summed = exchange.all_reduce_sum(torch.full((1000,), float(rank + 1), device=device))
        assert summed.device.type == torch.device(device).type
        out["sum"] = summed.cpu()
        return out

    results, errors = _run_ranks(world_size, body)
    _raise_first(errors)
    for rank, out in enumerate(results):
        for dtype in dtypes:
            table = splits(dtype)
            expected = torch.cat([payload(src, rank, table[src][rank], dtype) for src in range(world_size)]).cpu()
            assert torch.equal(out[dtype], expected), (rank, dtype)
        assert torch.equal(out["sum"], torch.full((1000,), 3.0)), rank


def test_exchange_with_full_messages(monkeypatch):
    _exchange_on("cpu", monkeypatch)


@pytest.mark.gpu
def test_gpu_exchange_on_cuda_staging_buffers(monkeypatch):
    """The exchange with CUDA staging buffers and CUDA rows (threads, one GPU). Only the exchange: autograd
    runs every CUDA backward on one device thread, so two thread-ranks cannot both be inside a backward
    there (real ranks are processes)."""
    _exchange_on("cuda", monkeypatch)


@pytest.mark.gpu
def test_gpu_single_team_backward_matches_reference():
    case = dict(CASES[3], tokens=[40], local_experts=4)
    xs, dys, router, w1s, w2s, routing = _layer(case, 1)
    want_dx, want_router, want_w1, want_w2 = _reference_grads(case, xs, dys, router, w1s, w2s, routing)
    cuda = [t.cuda() for t in (xs[0], router, w1s[0], w2s[0], routing[0][0], routing[0][1], dys[0])]
    dx, d_router, dw1, dw2 = expert_parallel_backward(Team.single(), *cuda, activation=case["activation"],
                                                      normalize_topk=case["normalize_topk"])
    for name, got, expected in (("dx", dx, want_dx[0]), ("d_router", d_router, want_router),
                                ("dw1", dw1, want_w1[0]), ("dw2", dw2, want_w2[0])):
        assert got.is_cuda, name
        assert_close(name, got.cpu(), expected, torch.bfloat16)


def test_a_peer_without_a_mapping_is_refused_by_name(monkeypatch):
    # across nodes a peer is reached by NVSHMEM puts only: the team's buffers hold no mapping of it
    teams = _thread_teams(2, max_tokens=4, hidden=8, top_k=2, local_experts=2, monkeypatch=monkeypatch)
    own = teams[0].buffers[0]
    own.mapped_recv = [own.mapped_recv[0], None]
    own.mapped_comb = [own.mapped_comb[0], None]
    with pytest.raises(RuntimeError, match=r"rank 1 is reached by NVSHMEM puts only.*the torch-ops backward needs every peer mapped"):
        PeerExchange.from_team(teams[0])
