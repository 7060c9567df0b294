"""The kernel's NVSHMEM transport on one GPU: P rank processes under MPS (as tests/test_ep_multiprocess.py),
each importing flashdmoe_cuda from the NVSHMEM build (``FLASHDMOE_KERNEL_BUILD=nvshmem``) and joining a
``Team.nvshmem(peer_transport="nvshmem")``, so every peer is reached through NVSHMEM puts although a peer
pointer exists.

* forward and backward of 2 and 4 ranks bitwise equal to the same problem on ``peer_transport="p2p"`` (the
  main build): the transport moves bytes, it computes nothing; and within tolerance of
  ``reference.moe_expert_parallel``; the traffic counters still count only routed rows, and the forced
  NVSHMEM run reports all of them as NVSHMEM bytes (the p2p run none), the backward's device exchange
  included (its rows, gradients and router share staged and put);
* a silent rank makes every rank raise ``KernelTimeout`` (the watchdog covers NVSHMEM peers too).

GPU only (``gpu``); on a GPU machine they fail, not skip, when nvshmem4py, the nvidia-nvshmem wheel or MPS
is missing. CPU tests of the option and the build are in tests/test_nvshmem_transport.py and
tests/test_nvshmem_build.py.
"""

from __future__ import annotations


import pytest
import torch

from flashdmoe import numerics
from flashdmoe.ranks import launcher
from flashdmoe.ranks.launcher import RunResult, run_ranks
from flashdmoe.ranks.problem import Problem, expected_relay_traffic, expected_traffic, reference_results
from mps_checks import started_daemon

RUN_TIMEOUT_S = 300  # the first NVSHMEM-build run of a machine may also wait for that build's lock
NVSHMEM_ENV = {"FLASHDMOE_KERNEL_BUILD": "nvshmem"}
SCENARIO = "flashdmoe.ranks.scenarios:forward_backward_transports"
PROBLEMS = {
    2: Problem((96, 64), 128, 128, 8, 2, "gelu", seed=41),
    4: Problem((33, 65, 0, 129), 64, 64, 8, 2, "swiglu", False, seed=43),
}
# Capacity (dropped choices), fp16, k = 3, skewed routing and a one-token rank, over two emulated nodes.
CAPACITY_FP16 = Problem((190, 256, 1, 77), 192, 256, 16, 3, "gelu", True, 1.0, dtype="float16", seed=46,
                        router_skew=((0, 3.0), (9, 3.0)))
GRADS = ("y", "dx", "d_router", "dw1", "dw2")
# The hierarchical exchange: k = 4 of 16 experts over 2 nodes of 2 ranks, so that most tokens have several
# choices on the other node; a one-token rank.
HIERARCHICAL = Problem((150, 64, 1, 97), 128, 128, 16, 4, "gelu", seed=49)


@pytest.fixture(scope="module")
def mps_daemon():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fused kernel targets Hopper (sm_90a)")
    from flashdmoe.kernel import extension
    from flashdmoe.parallel.mps import mps_available

    reason = launcher.nvshmem_unavailable_reason() or mps_available() or extension.nvshmem_problem()
    if reason:
        pytest.fail(f"the NVSHMEM transport tests need nvshmem4py, CUDA MPS and the nvidia-nvshmem wheel: {reason}")
    # Both builds here, once, not inside a rank's run (a failure on Hopper is an error, not a skip).
    extension.build()
    extension.build_nvshmem()
    daemon = started_daemon()
    yield daemon
    daemon.stop()


_RUNS: dict[tuple, RunResult] = {}


def _run(mps_daemon, world_size: int, peer_transport: str, ranks_per_node: int | None = None,
         problem: Problem | None = None, exchange: str = "direct") -> RunResult:
    problem = PROBLEMS[world_size] if problem is None else problem
    key = (repr(problem), peer_transport, ranks_per_node, exchange)
    if key not in _RUNS:
        env = NVSHMEM_ENV if peer_transport == "nvshmem" or ranks_per_node else {}
        team = {**problem.team_kwargs(), "peer_transport": peer_transport}
        if ranks_per_node:
            team["ranks_per_node"] = ranks_per_node
        if exchange != "direct":
            team["exchange"] = exchange
        _RUNS[key] = run_ranks(SCENARIO, world_size, mps=mps_daemon, env=env, timeout_s=RUN_TIMEOUT_S,
                               params={"problem": problem.to_dict(), "iterations": 2}, team=team)
    result = _RUNS[key]
    assert result.ok, f"{world_size} ranks, peer_transport={peer_transport!r}, ranks_per_node={ranks_per_node}:\n" \
                      f"{result.summary()}"
    return result


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", sorted(PROBLEMS))
def test_nvshmem_transport_is_bitwise_the_p2p_result(mps_daemon, world_size):
    nvshmem_run = _run(mps_daemon, world_size, "nvshmem")
    p2p_run = _run(mps_daemon, world_size, "p2p")
    for got, want in zip(nvshmem_run.ranks, p2p_run.ranks):
        where = f"{world_size} ranks, rank {got.rank}"
        assert got.info["kernel_build"] == "nvshmem" and want.info["kernel_build"] == "main", where
        assert got.info["peer_transports"] == ["p2p" if q == got.rank else "nvshmem" for q in range(world_size)], where
        assert want.info["peer_transports"] == ["p2p"] * world_size, where
        for name in GRADS:
            if name in want.tensors:
                assert name in got.tensors, f"{where}: {name} missing on the nvshmem transport"
                assert torch.equal(got.tensors[name], want.tensors[name]), (
                    f"{where}: {name} differs between peer_transport='nvshmem' and 'p2p' (max abs difference "
                    f"{(got.tensors[name].double() - want.tensors[name].double()).abs().max().item():.3e})")
        assert got.info["repeat_identical"], f"{where}: y differs between back-to-back forwards"


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", sorted(PROBLEMS))
def test_nvshmem_transport_matches_the_reference_and_sends_only_routed_rows(mps_daemon, world_size):
    problem = PROBLEMS[world_size]
    result = _run(mps_daemon, world_size, "nvshmem")
    tolerance = numerics.kernel_tolerance(problem.dtype)
    for outcome, want, traffic in zip(result.ranks, reference_results(problem), expected_traffic(problem)):
        where = f"{world_size} ranks, rank {outcome.rank}"
        got = outcome.tensors["y"]
        assert got.shape == want["y"].shape and torch.isfinite(got).all(), where
        if want["y"].numel():
            error = numerics.normwise_error(got, want["y"])
            assert error < tolerance, f"{where}: y normwise error {error:.2e} >= {tolerance:.0e}"
        (counted,) = outcome.info["traffic"]
        for key in ("rows_routed_remote", "dispatch_bytes", "combine_bytes"):
            assert counted[key] == traffic[key], (where, key, counted, traffic)
        # Every peer is an NVSHMEM peer: each routed row and result went through a put.
        assert counted["nvshmem_dispatch_bytes"] == traffic["dispatch_bytes"], (where, counted, traffic)
        assert counted["nvshmem_combine_bytes"] == traffic["combine_bytes"], (where, counted, traffic)
        # The backward ran the device exchange, every byte of it by puts: each remote kept choice's x and dy
        # rows and weight to its owner; dx rows, weight gradients and the router's share back.
        assert outcome.info["backward_path"] == "device", where
        back = outcome.info["backward_traffic"]
        row_bytes = problem.hidden * torch.empty((), dtype=problem.torch_dtype).element_size()
        assert back["dispatch_bytes"] == traffic["rows_routed_remote"] * (2 * row_bytes + 4), (where, back, traffic)
        assert back["combine_bytes"] > 0, (where, back)
        assert back["nvshmem_dispatch_bytes"] == back["dispatch_bytes"], (where, back)
        assert back["nvshmem_combine_bytes"] == back["combine_bytes"], (where, back)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", sorted(PROBLEMS))
def test_p2p_transport_reports_no_nvshmem_bytes(mps_daemon, world_size):
    problem = PROBLEMS[world_size]
    result = _run(mps_daemon, world_size, "p2p")
    for outcome, traffic in zip(result.ranks, expected_traffic(problem)):
        (counted,) = outcome.info["traffic"]
        where = f"{world_size} ranks, rank {outcome.rank}"
        assert counted["dispatch_bytes"] == traffic["dispatch_bytes"], (where, counted, traffic)
        assert counted["nvshmem_dispatch_bytes"] == 0 and counted["nvshmem_combine_bytes"] == 0, (where, counted)
        back = outcome.info["backward_traffic"]
        assert outcome.info["backward_path"] == "device" and back["combine_bytes"] > 0, (where, back)
        assert back["nvshmem_dispatch_bytes"] == 0 and back["nvshmem_combine_bytes"] == 0, (where, back)


@pytest.mark.gpu
def test_silent_rank_times_out_every_rank_over_nvshmem(mps_daemon):
    problem = Problem((128, 128), 128, 128, 8, 2, "gelu", seed=47)
    _every_rank_timed_out(run_ranks(
        "silent_rank_timeout", 2, mps=mps_daemon, env=NVSHMEM_ENV, timeout_s=RUN_TIMEOUT_S,
        params={"problem": problem.to_dict(), "silent_rank": 1, "timeout_ms": 2000},
        team={**problem.team_kwargs(), "peer_transport": "nvshmem"}))


def _every_rank_timed_out(result: RunResult) -> None:
    """Every rank of a run with a silent rank raised KernelTimeout at its forward, its team was marked
    failed and its next call raised TeamFailed; no rank hung."""
    assert not result.hung_ranks, f"ranks {result.hung_ranks} hung: the watchdog must end every kernel"
    result.check()
    for outcome in result.ranks:
        info = outcome.info
        assert info["error"]["type"] == "KernelTimeout", f"rank {outcome.rank}: {info}"
        assert info["team_failed"] is True and info["second_call_error"]["type"] == "TeamFailed", info


@pytest.mark.gpu
def test_silent_rank_in_the_backward_times_out_every_rank_over_nvshmem(mps_daemon):
    """The backward's exchange by puts keeps the watchdog: a rank that publishes nothing in it (no place
    words, free or ready flags, no puts) makes every rank raise, naming the backward exchange."""
    problem = Problem((128, 96), 128, 128, 8, 2, "gelu", seed=48)
    timeout_ms = 2000
    result = run_ranks("silent_rank_timeout", 2, mps=mps_daemon, env=NVSHMEM_ENV, timeout_s=RUN_TIMEOUT_S,
                       params={"problem": problem.to_dict(), "silent_rank": 1, "timeout_ms": timeout_ms,
                               "in_backward": True},
                       team={**problem.team_kwargs(), "peer_transport": "nvshmem"})
    assert not result.hung_ranks, f"ranks {result.hung_ranks} hung: the watchdog must end every kernel"
    result.check()
    for outcome in result.ranks:
        info = outcome.info
        where = f"rank {outcome.rank}: {info}"
        assert info["error"]["type"] == "KernelTimeout", where
        assert "backward exchange" in info["error"]["message"], where
        assert info["elapsed_s"] < timeout_ms / 1000 + 60, where
        assert info["team_failed"] is True and info["second_call_error"]["type"] == "TeamFailed", where


@pytest.mark.gpu
@pytest.mark.parametrize("problem", [PROBLEMS[4], CAPACITY_FP16], ids=["swiglu-zero-rank", "capacity-fp16-k3"])
def test_a_team_over_two_emulated_nodes_mixes_transports_bitwise_as_p2p(mps_daemon, problem):
    """4 ranks as 2 nodes of 2 (``ranks_per_node=2``, "auto"): stores to the peer on the same node, NVSHMEM
    puts to the other node's two, in one forward and one backward, as a team across real nodes runs;
    outputs and gradients bitwise those of the all-p2p run and y within tolerance of the reference, and
    exactly the rows to or from the other node counted as NVSHMEM bytes, forward and backward."""
    mixed = _run(mps_daemon, 4, "auto", ranks_per_node=2, problem=problem)
    p2p = _run(mps_daemon, 4, "p2p", problem=problem)
    tolerance = numerics.kernel_tolerance(problem.torch_dtype)
    for got, want in zip(mixed.ranks, reference_results(problem)):
        if want["y"].numel():
            error = numerics.normwise_error(got.tensors["y"], want["y"])
            assert error < tolerance, f"rank {got.rank}: y normwise error {error:.2e} >= {tolerance:.0e}"
    row_bytes = problem.hidden * torch.empty((), dtype=problem.torch_dtype).element_size()
    for got, want, traffic in zip(mixed.ranks, p2p.ranks, expected_traffic(problem, ranks_per_node=2)):
        where = f"rank {got.rank}"
        node = got.rank // 2
        assert got.info["peer_transports"] == ["p2p" if q // 2 == node else "nvshmem" for q in range(4)], where
        for name in GRADS:
            assert torch.equal(got.tensors[name], want.tensors[name]), f"{where}: {name} differs from the p2p run"
        (counted,) = got.info["traffic"]
        for key in ("dispatch_bytes", "combine_bytes", "nvshmem_dispatch_bytes", "nvshmem_combine_bytes"):
            assert counted[key] == traffic[key], (where, key, counted, traffic)
        back = got.info["backward_traffic"]
        assert got.info["backward_path"] == "device", where
        assert back["dispatch_bytes"] == traffic["rows_routed_remote"] * (2 * row_bytes + 4), (where, back, traffic)
        assert back["nvshmem_dispatch_bytes"] == traffic["nvshmem_dispatch_bytes"] // row_bytes * (2 * row_bytes + 4), (
            where, back, traffic)
        assert back["nvshmem_combine_bytes"] < back["combine_bytes"], (where, back)
        assert got.info["repeat_identical"] and got.info["grads_repeat_identical"], where


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["graph_replay", "training_graph_replay"])
def test_graph_replays_over_nvshmem_puts_equal_eager_calls(mps_daemon, seed, scenario):
    """A team forward (``graph_replay``), or a whole training step with the backward's rows staged and put
    too (``training_graph_replay``), whose every peer is reached by NVSHMEM puts, captured and replayed on
    new inputs between eager calls: y (and every gradient) bitwise the eager call's on both ranks."""
    problem = PROBLEMS[2]
    result = run_ranks(scenario, 2, mps=mps_daemon, env=NVSHMEM_ENV, timeout_s=RUN_TIMEOUT_S,
                       params={"problem": problem.to_dict(), "replays": 3, "seed": seed},
                       team={**problem.team_kwargs(), "peer_transport": "nvshmem"})
    assert result.ok, result.summary()
    for outcome in result.ranks:
        where = f"rank {outcome.rank}: {outcome.info}"
        assert outcome.info.get("backward_path", "device") == "device", where
        assert outcome.info["replays_identical"] == [True] * 3, where
        assert outcome.info["team_failed"] is False, where


@pytest.mark.gpu
def test_hierarchical_exchange_is_bitwise_the_direct_one_and_sends_each_row_once_per_node(mps_daemon):
    """4 ranks as 2 nodes of 2 with ``exchange="hierarchical"``: a token's row crosses to the other node once,
    to the rank with the sender's index there, which stores it into that node's owners. Outputs and
    gradients (two forwards and a backward) bitwise those of the direct exchange; the forward's bytes
    exactly the batches (one row, k records per token and other node hit, a header per node) plus the
    stores within each node, fewer NVSHMEM bytes than the direct puts; results as before."""
    relayed = _run(mps_daemon, 4, "auto", ranks_per_node=2, problem=HIERARCHICAL, exchange="hierarchical")
    direct = _run(mps_daemon, 4, "auto", ranks_per_node=2, problem=HIERARCHICAL)
    relay_traffic = expected_relay_traffic(HIERARCHICAL, ranks_per_node=2)
    flat_traffic = expected_traffic(HIERARCHICAL, ranks_per_node=2)
    for got, want, traffic, flat in zip(relayed.ranks, direct.ranks, relay_traffic, flat_traffic):
        where = f"rank {got.rank}"
        assert got.info["kernel_build"] == "nvshmem", where
        for name in GRADS:
            assert torch.equal(got.tensors[name], want.tensors[name]), f"{where}: {name} differs from the direct exchange"
        assert got.info["repeat_identical"], f"{where}: y differs between back-to-back forwards"
        (counted,) = got.info["traffic"]
        assert counted["nvshmem_dispatch_bytes"] == traffic["nvshmem_dispatch_bytes"], (where, counted, traffic)
        assert counted["dispatch_bytes"] == traffic["dispatch_bytes"], (where, counted, traffic)
        assert counted["combine_bytes"] == flat["combine_bytes"], (where, counted, flat)
        assert counted["nvshmem_combine_bytes"] == flat["nvshmem_combine_bytes"], (where, counted, flat)
    row_bytes = HIERARCHICAL.hidden * 2
    assert sum(t["batch_rows"] for t in relay_traffic) * row_bytes < sum(t["nvshmem_dispatch_bytes"] for t in flat_traffic)


@pytest.mark.gpu
def test_silent_rank_times_out_every_rank_over_the_hierarchical_exchange(mps_daemon):
    problem = Problem((64, 64, 64, 64), 128, 128, 16, 4, "gelu", seed=50)
    _every_rank_timed_out(run_ranks(
        "silent_rank_timeout", 4, mps=mps_daemon, env=NVSHMEM_ENV, timeout_s=RUN_TIMEOUT_S,
        params={"problem": problem.to_dict(), "silent_rank": 2, "timeout_ms": 2000},
        team={**problem.team_kwargs(), "ranks_per_node": 2, "exchange": "hierarchical"}))
