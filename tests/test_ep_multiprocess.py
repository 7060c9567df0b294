"""Expert parallelism across processes: P rank processes share the one GPU under MPS, each joins a
``Team.nvshmem`` team and calls ``flashdmoe.moe(..., team=team, backend="cuda")`` (flashdmoe.ranks).

CPU part (always runs): the harness itself (unique-id hand-over, per-rank errors, hung and crashed ranks,
argument checks) and the seeded problems the GPU part is built on.

GPU part (``gpu``): forward and backward of every rank against ``reference.moe_expert_parallel``, computed
here on the CPU in float32 from the same seeded inputs; the traffic counters against the reference routing;
a silent rank makes every rank raise ``KernelTimeout`` naming it, and a new team works afterwards. On a GPU
machine the GPU part fails (it does not skip) when nvshmem4py or CUDA MPS is missing.
Tolerances (norm-relative, as tests/test_fused_gpu.py): outputs bf16 2e-2 / fp16 5e-3 (the kernel rounds the
activation and per-expert outputs to the input dtype), gradients 3e-2. Near-ties of the router are redrawn
by ``Problem`` (gap 1e-3 in log-probability), so the kernel must route exactly like the reference.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from closeness import assert_normwise_close
from flashdmoe import numerics, reference
from flashdmoe.ranks import child, launcher, scenarios
from flashdmoe.ranks.launcher import RunResult, run_ranks
from flashdmoe.ranks.problem import Problem, expected_traffic, near_tie_rows, reference_results, split_tokens
from mps_checks import started_daemon

# ------------------------------------------------------------------------------------------------------------
# CPU: the harness


def test_ranks_receive_rank0_id_and_return_results():
    result = run_ranks("selftest", 2, nvshmem=False, mps=False, timeout_s=120)
    assert result.ok, result.summary()
    assert result.check() is result
    uids = {outcome.info["uid"] for outcome in result.ranks}
    assert len(uids) == 1 and len(bytes.fromhex(uids.pop())) == 128  # one id, published by rank 0
    assert len({outcome.info["pid"] for outcome in result.ranks}) == 2  # two processes
    for rank, outcome in enumerate(result.ranks):
        assert outcome.rank == rank and outcome.returncode == 0 and outcome.phase == "exiting"
        assert torch.equal(outcome.tensors["rank"], torch.tensor([rank]))
    assert result.hung_ranks == [] and result.failed_ranks == []


def test_failing_crashing_and_hung_ranks_are_reported():
    started = time.monotonic()
    result = run_ranks("selftest", 3, nvshmem=False, mps=False, timeout_s=120, failure_grace_s=3,
                          params={"actions": {"0": "raise", "1": "hang", "2": "exit"}})
    assert time.monotonic() - started < 60  # the hung rank is killed soon after the failure, not at the timeout
    raised, hung, crashed = result.ranks
    assert raised.status == "error" and raised.error_type == "ValueError" and raised.returncode == 1
    assert "rank 0 raises as asked" in raised.error_message and "in selftest" in raised.traceback
    assert raised.phase == "scenario selftest"
    assert hung.status == "hung" and hung.phase == "selftest: hanging as asked"
    assert "after rank" in hung.kill_reason and "failed" in hung.kill_reason
    assert crashed.status == "crashed" and crashed.returncode == 7 and crashed.phase == "scenario selftest"
    assert result.hung_ranks == [1] and result.failed_ranks == [0, 1, 2] and not result.ok
    with pytest.raises(launcher.RanksFailed, match=r"rank 1: hung in phase 'selftest: hanging as asked'") as info:
        result.check()
    assert info.value.result is result
    assert "rank 0: ValueError: selftest: rank 0 raises as asked" in str(info.value)
    assert "rank 2: crashed with exit code 7" in str(info.value)


def test_uid_wait_returns_published_id(tmp_path):
    uid = bytes(range(128))
    threading.Timer(0.3, child.publish_uid, args=(tmp_path, uid)).start()
    assert child.wait_for_uid(tmp_path, timeout_s=20, poll_s=0.01) == uid
    assert sorted(p.name for p in tmp_path.iterdir()) == ["uid.bin"]  # the temporary file was renamed


def test_uid_wait_is_bounded_and_names_rank0_phase(tmp_path):
    (tmp_path / "rank0.phase.json").write_text(json.dumps({"phase": "joining the NVSHMEM team (collective)"}))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no unique id from rank 0 .* after 0.3 s .*joining the NVSHMEM team"):
        child.wait_for_uid(tmp_path, timeout_s=0.3, poll_s=0.01)
    assert time.monotonic() - started < 5


def test_uid_wait_stops_when_rank0_failed(tmp_path):
    (tmp_path / "rank0.status.json").write_text(json.dumps(
        {"status": "error", "error_type": "ImportError", "error_message": "no nvshmem"}))
    with pytest.raises(RuntimeError, match="rank 0 finished without publishing the unique id .*ImportError: no nvshmem"):
        child.wait_for_uid(tmp_path, timeout_s=60)
    (tmp_path / "uid.bin").write_bytes(b"short")
    with pytest.raises(RuntimeError, match="5 bytes; expected a 128-byte unique id"):
        child.wait_for_uid(tmp_path, timeout_s=1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(scenario="nope", world_size=2), "scenario='nope'"),
    (dict(scenario="selftest", world_size=0), "world_size=0"),
    (dict(scenario="selftest", world_size=9), "world_size=9: expected at most 8"),
    (dict(scenario="selftest", world_size=2, timeout_s=0), "timeout_s=0"),
    (dict(scenario="selftest", world_size=2, uid_timeout_s=-1), "uid_timeout_s=-1"),
    (dict(scenario="selftest", world_size=2, params={"x": object()}), "params: expected JSON-able"),
    (dict(scenario="selftest", world_size=2, nvshmem=False, mps="yes"), "mps='yes'"),
    (dict(scenario="forward_backward", world_size=2, nvshmem=True), "team: required"),
    (dict(scenario="forward_backward", world_size=3, nvshmem=True,
          params={"problem": Problem((4, 4), 64, 64, 4, 2).to_dict()}), "tokens for 2 ranks, but world_size=3"),
    (dict(scenario="forward_backward", world_size=2, team={"hidden": 64}), "team: missing"),
])
def test_run_ranks_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_ranks(**({"mps": False} | kwargs))


def _nested_scenario():
    def inner(context):
        return {}
    return inner


def test_scenarios_are_named_by_module_and_function():
    assert launcher.scenario_target("selftest") == ("selftest", "flashdmoe.ranks.scenarios:selftest")
    assert launcher.scenario_target(scenarios.forward_backward) == (
        "forward_backward", "flashdmoe.ranks.scenarios:forward_backward")
    assert launcher.scenario_target("some.module:run") == ("some.module:run", "some.module:run")
    assert child.resolve_scenario("flashdmoe.ranks.scenarios:selftest") is scenarios.selftest
    for unreachable in (lambda context: {}, _nested_scenario()):  # a rank process cannot import these by name
        with pytest.raises(ValueError, match="top level of an importable module"):
            launcher.scenario_target(unreachable)
    with pytest.raises(ValueError, match="has no function 'nope'"):
        child.resolve_scenario("flashdmoe.ranks.scenarios:nope")
    with pytest.raises(ValueError, match="expected 'package.module:function'"):
        child.resolve_scenario("selftest")


def test_child_rejects_a_bad_spec(tmp_path, capsys):
    assert child.main([]) == 2
    bad = tmp_path / "spec.json"
    bad.write_text(json.dumps({"version": 99}))
    assert child.main([str(bad)]) == 2
    assert "spec version 99" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "flashdmoe.ranks", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "bad spec" in done.stderr


# ------------------------------------------------------------------------------------------------------------
# CPU: the scenarios' own code, with a one-rank stand-in for the team and the reference as the layer
# (the GPU part below runs them for real)


class _StandInTeam:
    def __init__(self):
        self.failed = False
        self.barriers = 0

    def barrier(self):
        self.barriers += 1


def _cpu_context(tmp_path, params, team=None) -> child.RankContext:
    return child.RankContext(0, 1, params, team or _StandInTeam(), torch.device("cpu"), tmp_path, {})


def _reference_layer(calls):
    def forward(problem, context, x, router, w1, w2):
        calls.append(x)
        return reference.moe(x, router, w1, w2, **problem.moe_kwargs())
    return forward


def test_forward_backward_scenario_returns_every_gradient(monkeypatch, tmp_path):
    problem = Problem((40,), 64, 48, 4, 2, "swiglu", True, 1.0, dtype="float32", seed=7)
    calls = []
    monkeypatch.setattr(scenarios, "team_moe", _reference_layer(calls))
    traffic = [{"rank": 0, "dispatch_bytes": 0, "combine_bytes": 0, "rows_routed_remote": 0}]
    # (the traffic of a launch report needs a GPU: patch the reader)
    monkeypatch.setattr(scenarios, "last_traffic", lambda: [dict(t) for t in traffic])
    out = scenarios.forward_backward(_cpu_context(tmp_path, {"problem": problem.to_dict(), "iterations": 3}))
    assert len(calls) == 3 and all(x.requires_grad for x in calls)
    want = reference_results(problem)[0]
    # float32 on both sides, summed in other orders: reductions of <= 64 terms, three forward + three backward
    for name in ("y", "dx", "d_router", "dw1", "dw2"):
        assert_normwise_close(out.tensors[name], want[name], numerics.reorder_tolerance(torch.float32, 64, depth=6),
                              name)
    # the CPU context's team is no NVSHMEM team: the device exchange would not run it
    assert out.info == {"traffic": traffic, "iterations": 3, "repeat_identical": True,
                        "grads_repeat_identical": True, "missing_grads": [], "backward_path": "torch",
                        "backward_traffic": None}


def test_timeout_scenario_reports_both_errors_and_restores_the_knobs(monkeypatch, tmp_path):
    from flashdmoe import cuda_backend
    from flashdmoe.errors import KernelTimeout
    from flashdmoe.parallel.team import TeamFailed

    team = _StandInTeam()
    seen = []

    def forward(problem, context, *args):
        seen.append((cuda_backend.debug.silent_rank, cuda_backend.debug.timeout_ms))
        if not team.failed:
            team.failed = True
            raise KernelTimeout("flashdmoe kernel timed out in the dispatch (waiting on rank 1)")
        raise TeamFailed("Team(...) failed earlier; make a new team")

    monkeypatch.setattr(scenarios, "team_moe", forward)
    problem = Problem((8,), 64, 64, 4, 2, dtype="float32")
    out = scenarios.silent_rank_timeout(_cpu_context(tmp_path, {"problem": problem.to_dict(), "silent_rank": 1,
                                                      "timeout_ms": 500}, team))
    assert out.info["error"] == {"type": "KernelTimeout", "module": "flashdmoe.errors",
                                 "message": "flashdmoe kernel timed out in the dispatch (waiting on rank 1)"}
    assert out.info["team_failed"] is True and out.info["second_call_error"]["type"] == "TeamFailed"
    assert out.info["silent_rank"] == 1 and out.info["timeout_ms"] == 500 and out.info["elapsed_s"] < 60
    assert seen == [(1, 500), (-1, 500)]  # the second call has no silent rank
    assert getattr(cuda_backend.debug, "silent_rank", -1) == -1 and cuda_backend.debug.timeout_ms is None


# ------------------------------------------------------------------------------------------------------------
# CPU: seeded problems


def test_problem_is_deterministic_and_independent_of_the_split():
    problem = Problem(tokens=(96, 0, 160, 33), hidden=64, ffn=64, experts=8, top_k=2, capacity_factor=1.0,
                      router_skew=((3, 4.0),), seed=5)
    together = problem.all_inputs()
    for rank, inputs in enumerate(together):
        alone = problem.rank_inputs(rank)
        for name in ("x", "router_weight", "w1", "w2", "dy"):
            assert torch.equal(getattr(inputs, name), getattr(alone, name)), name
        assert inputs.x.shape == (problem.tokens[rank], 64) and inputs.x.dtype == torch.bfloat16
        assert inputs.w1.shape == (2, 64, 64) and inputs.w2.shape == (2, 64, 64)
    # The same total problem on one rank holds the same tokens and experts (the bench compares P).
    single = problem.replace(tokens=(289,))
    assert torch.equal(single.all_tokens(), torch.cat([i.x for i in together]))
    assert torch.equal(single.shard(0)[0], torch.cat([i.w1 for i in together]))
    assert not torch.equal(problem.replace(seed=6).all_tokens(), single.all_tokens())
    router = problem.router_weight().float()
    unskewed = problem.replace(router_skew=()).router_weight().float()
    assert torch.equal(router[3], 4.0 * unskewed[3])  # a power-of-two scale commutes with rounding
    assert torch.equal(router[:3], unskewed[:3])
    assert Problem.from_dict(json.loads(json.dumps(problem.to_dict()))) == problem


def test_problem_redraws_near_ties():
    problem = Problem(tokens=(3000,), hidden=64, ffn=64, experts=16, top_k=3, seed=1, near_tie_gap=1e-2)
    kept = problem.replace(near_tie_gap=0.0).all_tokens()
    fixed = problem.all_tokens()
    router = problem.router_weight()
    assert near_tie_rows(kept, router, 3, 1e-2).sum() > 0  # there were some
    assert near_tie_rows(fixed, router, 3, 1e-2).sum() == 0  # and none are left
    redrawn = (kept != fixed).any(dim=1)
    assert torch.equal(redrawn, near_tie_rows(kept, router, 3, 1e-2))  # exactly the near-ties were redrawn


@pytest.mark.parametrize("changes, message", [
    (dict(tokens=()), "tokens=()"),
    (dict(tokens=(1,) * 9), "tokens="),
    (dict(tokens=(4, -1)), r"tokens\[1\]=-1"),
    (dict(experts=6, tokens=(4, 4, 4, 4)), "experts=6: expected a multiple of the number of ranks P=4"),
    (dict(top_k=9), "top_k=9"),
    (dict(hidden=0), "hidden=0"),
    (dict(activation="tanh"), "activation='tanh'"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0"),
    (dict(dtype="float64"), "dtype='float64'"),
    (dict(router_skew=((8, 2.0),)), "router_skew expert 8"),
    (dict(router_skew=((1, -2.0),)), "router_skew scale -2.0"),
    (dict(near_tie_gap=-1.0), "near_tie_gap=-1.0"),
    (dict(normalize_topk=1), "normalize_topk=1"),
])
def test_problem_rejects_bad_fields(changes, message):
    fields = dict(tokens=(4, 4), hidden=64, ffn=64, experts=8, top_k=2) | changes
    with pytest.raises(ValueError, match=message):
        Problem(**fields)
    with pytest.raises(ValueError, match="unknown fields"):
        Problem.from_dict({"tokens": [1], "hidden": 64, "ffn": 64, "experts": 2, "top_k": 1, "colour": 1})


def test_split_tokens():
    assert split_tokens(10, 4) == [3, 3, 2, 2]
    assert split_tokens(8192, 8) == [1024] * 8
    assert split_tokens(1, 3) == [1, 0, 0]
    with pytest.raises(ValueError, match="world_size=0"):
        split_tokens(4, 0)


def test_reference_results_are_the_single_rank_layer_on_all_tokens():
    problem = Problem(tokens=(37, 0, 51), hidden=64, ffn=32, experts=6, top_k=2, activation="swiglu",
                      dtype="float32", seed=3)
    per_rank = reference_results(problem)
    inputs = problem.all_inputs()
    x = torch.cat([i.x for i in inputs]).requires_grad_()
    router = inputs[0].router_weight.clone().requires_grad_()
    w1 = torch.cat([i.w1 for i in inputs]).requires_grad_()
    w2 = torch.cat([i.w2 for i in inputs]).requires_grad_()
    y = reference.moe(x, router, w1, w2, top_k=2, activation="swiglu")  # dropless: the split does not matter
    (y * torch.cat([i.dy for i in inputs])).sum().backward()
    # float32 both ways; the split over ranks changes summation orders (the router gradient sums 88 tokens)
    tolerance = numerics.reorder_tolerance(torch.float32, 88, depth=6)
    assert_normwise_close(torch.cat([r["y"] for r in per_rank]), y.detach(), tolerance, "y")
    assert_normwise_close(torch.cat([r["dx"] for r in per_rank]), x.grad, tolerance, "dx")
    assert_normwise_close(torch.cat([r["dw1"] for r in per_rank]), w1.grad, tolerance, "dw1")
    assert_normwise_close(torch.cat([r["dw2"] for r in per_rank]), w2.grad, tolerance, "dw2")
    for r in per_rank:
        assert_normwise_close(r["d_router"], router.grad, tolerance, "d_router")
    assert per_rank[1]["y"].shape == (0, 64) and per_rank[1]["experts"].shape == (0, 2)


def test_expected_traffic_counts_remote_kept_choices():
    problem = Problem(tokens=(50, 70), hidden=64, ffn=64, experts=4, top_k=2, capacity_factor=0.5, seed=2)
    traffic = expected_traffic(problem)
    per_rank = reference_results(problem)
    owners = [r["experts"] // 2 for r in per_rank]
    sent = [int(((owners[r] != r) & per_rank[r]["keep"]).sum()) for r in range(2)]
    assert [t["rows_routed_remote"] for t in traffic] == sent
    assert [t["rows_computed_remote"] for t in traffic] == sent[::-1]  # two ranks: one's sends, the other's work
    assert [t["dispatch_bytes"] for t in traffic] == [n * 64 * 2 for n in sent]
    assert [t["combine_bytes"] for t in traffic] == [n * 64 * 2 for n in sent[::-1]]
    assert all(r["keep"].sum() < r["keep"].numel() for r in per_rank)  # capacity 0.5 dropped some


# ------------------------------------------------------------------------------------------------------------
# GPU: P processes on the one GPU under MPS

# y: the fused kernel's roundings (numerics.kernel_tolerance). Gradients: the GPU backward's roundings to
# the storage format (numerics.backward_tolerance; the device exchange runs the one-rank backward's GEMMs
# and kernels), plus other summation orders in float32 over <= 4096 terms.
TOLERANCE_Y = {name: numerics.kernel_tolerance(name) for name in ("bfloat16", "float16")}
TOLERANCE_GRAD = {name: numerics.backward_tolerance(name) + numerics.reorder_tolerance(torch.float32, 4096, depth=6)
                  for name in ("bfloat16", "float16")}
RUN_TIMEOUT_S = 240  # per run of P processes (start-up, team init, the scenario, teardown)

# (id, Problem): P = len(tokens). Ranks with T_r = 0, uneven T_r, skewed routing (router rows scaled so a
# few experts win most tokens), capacity on and off, bf16 and fp16, one expert per rank.
CONFIGS = [
    ("p2-even-gelu", Problem((128, 128), 128, 128, 8, 2, "gelu", True, None, seed=11)),
    ("p2-zero-rank-swiglu-capacity", Problem((0, 200), 256, 128, 4, 2, "swiglu", True, 1.0, seed=12)),
    ("p2-skewed-silu-capacity-k4", Problem((257, 129), 128, 192, 16, 4, "silu", False, 1.25, seed=13,
                                           router_skew=((3, 4.0), (12, 3.0)))),
    ("p4-uneven-zero-rank-skewed-relu", Problem((64, 0, 300, 129), 128, 128, 8, 2, "relu", True, None, seed=15,
                                                router_skew=((5, 4.0),))),
    ("p4-skewed-capacity-gelu-fp16", Problem((190, 256, 1, 77), 192, 256, 16, 3, "gelu", True, 1.0,
                                             dtype="float16", seed=16, router_skew=((0, 3.0), (1, 3.0)))),
    ("p4-one-expert-per-rank-swiglu", Problem((33, 65, 97, 129), 64, 64, 4, 1, "swiglu", False, None, seed=17)),
]
CONFIG_IDS = [name for name, _ in CONFIGS]


def _missing_requirement() -> str | None:
    """What this GPU machine lacks for the multi-process tests, or None. A missing package fails the
    tests instead of skipping them: on a GPU machine a skip would pass without testing the path."""
    from flashdmoe.parallel.mps import mps_available

    reason = launcher.nvshmem_unavailable_reason()
    if reason:
        return ("the multi-process GPU tests need the nvshmem4py package in this Python "
                f"(pip install -e '.[gpu]'): {reason}")
    reason = mps_available()
    if reason:
        return f"the multi-process GPU tests need CUDA MPS (several rank processes on one GPU): {reason}"
    return None


@pytest.fixture(scope="module")
def mps_daemon():
    """One MPS daemon for the module's runs; fails where a package or MPS is missing."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fused kernel targets Hopper (sm_90a)")
    from flashdmoe.kernel import extension

    extension.load()  # built here once (a failure on Hopper is an error, not a skip), not inside a rank's run
    missing = _missing_requirement()
    if missing:
        pytest.fail(missing)
    daemon = started_daemon()
    yield daemon
    daemon.stop()


_RUNS: dict[str, RunResult] = {}
_HUNG: list[str] = []


def _run(mps_daemon, scenario: str, world_size: int, params: dict, what: str) -> RunResult:
    """run_ranks, except after a run that hung: then fail at once instead of spending the timeout again."""
    if _HUNG:
        pytest.fail(f"not started: an earlier multi-process run hung ({_HUNG[0]})")
    result = run_ranks(scenario, world_size, mps=mps_daemon, params=params, timeout_s=RUN_TIMEOUT_S)
    if result.hung_ranks:
        _HUNG.append(f"{what}: ranks {result.hung_ranks}")
    return result


def _forward_backward(mps_daemon, name: str, problem: Problem) -> RunResult:
    """One multi-process run per config, shared by the tests that read it."""
    if name not in _RUNS:
        _RUNS[name] = _run(mps_daemon, "forward_backward", problem.world_size,
                           {"problem": problem.to_dict(), "iterations": 2}, name)
    return _RUNS[name]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def _check_close(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    if want.numel() == 0:
        return
    if float(want.norm()) == 0.0:
        assert float(got.abs().max()) == 0.0, f"{what}: expected exactly zero"
        return
    error = _relative_error(got, want)
    assert error < tolerance, f"{what}: relative error {error:.2e} >= {tolerance:.0e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name, problem", CONFIGS, ids=CONFIG_IDS)
def test_forward_backward_matches_reference(mps_daemon, name, problem):
    result = _forward_backward(mps_daemon, name, problem)
    result.check()
    expected = reference_results(problem)
    dtype = problem.torch_dtype
    for rank, (outcome, want) in enumerate(zip(result.ranks, expected)):
        got = outcome.tensors
        where = f"{name} rank {rank}"
        assert got["y"].dtype == dtype and got["dw1"].dtype == dtype, where
        allowed_missing = ["dx"] if problem.tokens[rank] == 0 else []
        assert [g for g in outcome.info["missing_grads"] if g not in allowed_missing] == [], where
        _check_close(got["y"], want["y"], TOLERANCE_Y[problem.dtype], f"{where}: y")
        assert outcome.info["repeat_identical"], f"{where}: y differs between back-to-back forwards"
        assert outcome.info["backward_path"] == "device", f"{where}: the backward did not take the device exchange"
        assert outcome.info["grads_repeat_identical"], f"{where}: gradients differ between back-to-back steps"
        _check_close(got["dx"], want["dx"], TOLERANCE_GRAD[problem.dtype], f"{where}: dx")
        _check_close(got["d_router"], want["d_router"], TOLERANCE_GRAD[problem.dtype], f"{where}: d_router")
        for expert in range(problem.local_experts):  # per expert: a busy expert must not hide an idle one
            _check_close(got["dw1"][expert], want["dw1"][expert], TOLERANCE_GRAD[problem.dtype], f"{where}: dw1[{expert}]")
            _check_close(got["dw2"][expert], want["dw2"][expert], TOLERANCE_GRAD[problem.dtype], f"{where}: dw2[{expert}]")
    # The router is replicated: every rank holds the same summed gradient, bit for bit.
    routers = [outcome.tensors["d_router"] for outcome in result.ranks]
    assert all(torch.equal(routers[0], other) for other in routers[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("name, problem", CONFIGS, ids=CONFIG_IDS)
def test_only_routed_rows_travel(mps_daemon, name, problem):
    """The launch report's traffic of each rank's forward against the reference routing (payload efficiency 1)."""
    result = _forward_backward(mps_daemon, name, problem)
    result.check()
    for outcome, want in zip(result.ranks, expected_traffic(problem)):
        traffic = outcome.info["traffic"]
        assert isinstance(traffic, list) and len(traffic) == 1, traffic  # one rank per process
        got = traffic[0]
        assert got["rank"] == outcome.rank
        assert got["rows_routed_remote"] == want["rows_routed_remote"], (name, got, want)
        assert got["dispatch_bytes"] == want["dispatch_bytes"], (name, got, want)
        assert got["combine_bytes"] == want["combine_bytes"], (name, got, want)
        if want["rows_routed_remote"]:
            assert got["payload_efficiency"] == pytest.approx(1.0), (name, got)


@pytest.mark.gpu
def test_silent_rank_in_the_backward_makes_every_rank_time_out(mps_daemon):
    problem = Problem((128, 96), 128, 128, 8, 2, "gelu", seed=22)
    timeout_ms = 2000
    result = _run(mps_daemon, "silent_rank_timeout", 2,
                  {"problem": problem.to_dict(), "silent_rank": 1, "timeout_ms": timeout_ms, "in_backward": True},
                  "backward timeout")
    result.check()  # no rank hung
    for outcome in result.ranks:
        info = outcome.info
        where = f"rank {outcome.rank}: {info}"
        assert info["error"]["type"] == "KernelTimeout", where
        assert "backward exchange" in info["error"]["message"], where
        peer = r"waiting on rank 1\b" if outcome.rank == 0 else r"waiting on rank [01]\b"
        assert re.search(peer, info["error"]["message"]), where
        assert info["elapsed_s"] < timeout_ms / 1000 + 60, where
        assert info["team_failed"] is True, where
        assert info["second_call_error"]["type"] == "TeamFailed", where


@pytest.mark.gpu
def test_forwards_queued_behind_a_silent_ranks_run_nothing_on_every_rank(mps_daemon):
    """No rank waits on the host between its team's forwards: the two queued behind the failed one are
    stopped by the device on every rank (its failed word), and raise TeamFailed after the timeout."""
    problem = Problem((128, 128), 128, 128, 8, 2, "gelu", seed=23)
    timeout_ms = 2000
    result = _run(mps_daemon, "silent_rank_timeout", 2,
                  {"problem": problem.to_dict(), "silent_rank": 1, "timeout_ms": timeout_ms, "queued_forwards": 2},
                  "queued after a timeout")
    result.check()
    for outcome in result.ranks:
        info = outcome.info
        where = f"rank {outcome.rank}: {info}"
        assert info["error"]["type"] == "KernelTimeout", where
        failed = int(re.search(r"\[launch (\d+) on", info["error"]["message"]).group(1))
        assert [e["type"] for e in info["queued_errors"]] == ["TeamFailed", "TeamFailed"], where
        for launch, queued in zip((failed + 1, failed + 2), info["queued_errors"]):
            assert re.search(rf"rank {outcome.rank} ran nothing: its team's forward number \d+ failed earlier",
                             queued["message"]), where
            assert f"[launch {launch} on" in queued["message"], where
        assert info["elapsed_s"] < timeout_ms / 1000 + 60, where
        assert info["team_failed"] is True and info["second_call_error"]["type"] == "TeamFailed", where


@pytest.mark.gpu
def test_forwards_queued_behind_a_failed_backward_run_nothing_on_every_rank(mps_daemon):
    """No rank waits on the host for its team's backward before the next forward: the two forwards queued
    behind a backward whose exchange timed out are stopped by the device on every rank (the exchange marked
    the rank with its backward number), and raise TeamFailed after the backward's timeouts."""
    problem = Problem((128, 96), 128, 128, 8, 2, "gelu", seed=24)
    timeout_ms = 2000
    result = _run(mps_daemon, "silent_rank_timeout", 2,
                  {"problem": problem.to_dict(), "silent_rank": 1, "timeout_ms": timeout_ms, "in_backward": True,
                   "queued_forwards": 2}, "forwards queued after a backward timeout")
    result.check()
    for outcome in result.ranks:
        info = outcome.info
        where = f"rank {outcome.rank}: {info}"
        assert info["error"]["type"] == "KernelTimeout" and "backward exchange" in info["error"]["message"], where
        failed = int(re.search(r"\[launch (\d+) on", info["error"]["message"]).group(1))
        kinds = [e["type"] for e in info["queued_errors"]]
        # the backward's later exchange launches stopped with the first one's error, then the two forwards
        assert kinds[-2:] == ["TeamFailed", "TeamFailed"] and set(kinds[:-2]) <= {"KernelTimeout"}, where
        for queued in info["queued_errors"][-2:]:
            assert re.search(rf"rank {outcome.rank} ran nothing: its team's backward number \d+ failed earlier",
                             queued["message"]), where
        launches = [int(re.search(r"\[launch (\d+) on", e["message"]).group(1)) for e in info["queued_errors"]]
        assert [failed, *launches] == sorted(set([failed, *launches])), where  # oldest first, each once
        assert info["elapsed_s"] < timeout_ms / 1000 + 60, where
        assert info["team_failed"] is True and info["second_call_error"]["type"] == "TeamFailed", where


@pytest.mark.gpu
def test_silent_rank_makes_every_rank_time_out_then_a_new_team_works(mps_daemon):
    problem = Problem((128, 128), 128, 128, 8, 2, "gelu", seed=21)
    timeout_ms = 2000
    result = _run(mps_daemon, "silent_rank_timeout", 2,
                  {"problem": problem.to_dict(), "silent_rank": 1, "timeout_ms": timeout_ms}, "timeout")
    result.check()  # no rank hung: the watchdog ended every kernel
    for outcome in result.ranks:
        info = outcome.info
        where = f"rank {outcome.rank}: {info}"
        assert info["error"]["type"] == "KernelTimeout", where
        assert info["error"]["module"].startswith("flashdmoe"), where
        peer = r"waiting on rank 1\b" if outcome.rank == 0 else r"waiting on rank [01]\b"  # 1 is silent
        assert re.search(peer, info["error"]["message"]), where
        assert info["elapsed_s"] < timeout_ms / 1000 + 60, where  # bounded by the watchdog, not a hang
        assert info["team_failed"] is True, where
        assert info["second_call_error"]["type"] == "TeamFailed", where
    # The GPU and MPS recovered: a new team (new processes, new unique id) computes correctly.
    name, fresh = CONFIGS[0]
    again = _run(mps_daemon, "forward_backward", 2, {"problem": fresh.to_dict(), "iterations": 1},
                 "after the timeout").check()
    for outcome, want in zip(again.ranks, reference_results(fresh)):
        _check_close(outcome.tensors["y"], want["y"], TOLERANCE_Y[fresh.dtype], f"after the timeout: rank {outcome.rank} y")


@pytest.mark.gpu
@pytest.mark.parametrize("name, problem", [CONFIGS[0], CONFIGS[3]], ids=[CONFIGS[0][0], CONFIGS[3][0]])
def test_graph_replays_of_a_team_training_step_equal_eager_steps(mps_daemon, name, problem, seed):
    """Each rank captures a whole training step (forward and the device-exchange backward) in a CUDA graph
    and replays it on new tokens and output gradients between eager steps: y and every gradient bitwise the
    eager step's, on every rank (the backward's sequence numbers counted on the device)."""
    result = _run(mps_daemon, "training_graph_replay", problem.world_size,
                  {"problem": problem.to_dict(), "replays": 3, "seed": seed}, f"training graph replay {name}").check()
    for outcome in result.ranks:
        where = f"{name} rank {outcome.rank}: {outcome.info}"
        assert outcome.info["backward_path"] == "device", where
        assert outcome.info["replays_identical"] == [True] * 3, where
        assert outcome.info["team_failed"] is False, where


@pytest.mark.gpu
@pytest.mark.parametrize("name, problem", [CONFIGS[0], CONFIGS[3]], ids=[CONFIGS[0][0], CONFIGS[3][0]])
def test_graph_replays_of_a_team_forward_equal_eager_calls(mps_daemon, name, problem, seed):
    """Each rank captures its forward in a CUDA graph and replays it on new inputs, interleaved with eager
    calls: the device-counted sequence numbers keep replays and eager forwards in step on every rank."""
    result = _run(mps_daemon, "graph_replay", problem.world_size,
                  {"problem": problem.to_dict(), "replays": 3, "seed": seed}, f"graph replay {name}").check()
    for outcome in result.ranks:
        where = f"{name} rank {outcome.rank}: {outcome.info}"
        assert outcome.info["replays_identical"] == [True] * 3, where
        assert outcome.info["team_failed"] is False, where
        assert torch.isfinite(outcome.tensors["y"].float()).all(), where
