"""The MoE layer's backward on the GPU through the public API (``flashdmoe.moe(..., backend="cuda")``,
``flashdmoe.moe_expert_parallel`` on an emulated team, ``flashdmoe.MoELayer``), whatever computes it.

- Gradients of x, router_weight, w1 and w2 against autograd through ``reference.moe_fixed_routing`` in
  float64 on the routing the forward chose, over a sweep of random configurations (tests/grad_checks.py:
  tolerances ``numerics.kernel_tolerance`` / ``backward_tolerance``, normwise; the router's relative to its
  magnitude). Emulated teams of 2, 4 and 8 ranks the same way, the router gradient summed over ranks.
- Three forward + backward runs on the same inputs give bitwise identical gradients.
- A model with a ``MoELayer`` trained for 100 steps in bfloat16 on the fused backend follows the float64
  reference backend's loss curve within the band of tests/training_checks.py, learns, and repeats bitwise.
- A rank that times out in an emulated team's forward makes the backward raise ``KernelTimeout`` naming
  every rank, produce no gradient, and fail the team; a new team works.
- An emulated team's backward moves its rows by the exchange kernel (bytes both ways, every rank of a
  direction in one launch); a rank silent in it makes ``KernelTimeout`` name every rank and fails the team.

The tests marked ``gpu`` need a Hopper GPU; the unmarked ones check the sweep itself on the CPU
(tests/test_training.py runs the same checks on the reference backend).
"""

from __future__ import annotations

import pytest
import torch

import flashdmoe
from conftest import next_seed
from flashdmoe import numerics, reference
from flashdmoe.parallel.team import Team, TeamFailed
from grad_checks import (GradConfig, Sizes, assert_dropped_tokens_get_no_dx, assert_idle_experts_get_no_weight_gradient,
                         check_config, check_routing, draw_config, kink_fitted_error, make_problem,
                         relu_kink_alternatives, router_error, router_gradient_magnitude, run_public)
from training_checks import MoEModel, TrainingSetup, assert_follows, loss_band, make_task, tolerances, train

# every test draws its inputs through next_seed(): the seed fixture prints its seed on failure
pytestmark = pytest.mark.usefixtures("seed")

GPU_SIZES = Sizes(small_tokens=2048, large_tokens=(4096, 20000), max_experts=256, multiple=64, max_width=1024,
                  max_large_width=512, max_weights=2 ** 25)
GPU_SWEEP = 32
LARGE_AT = (5, 17, 26)  # T = 20000 at index 5, uniform in [4096, 20000] at 17 and 26


@pytest.fixture(scope="module")
def fused():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fused kernel targets Hopper (sm_90a)")
    from flashdmoe import cuda_backend
    from flashdmoe.kernel import extension

    extension.load()  # a build failure on Hopper is a test failure, not a skip
    cuda_backend.debug.poison_outputs = True
    yield cuda_backend
    cuda_backend.debug.poison_outputs = False


# ---------------------------------------------------------------------------------------------------------
# The sweep (its coverage is checked on the CPU)
# ---------------------------------------------------------------------------------------------------------


def test_gpu_sweep_covers_every_option():
    configs = [draw_config(index, next_seed(), GPU_SIZES, large_at=LARGE_AT) for index in range(GPU_SWEEP)]
    assert {(c.activation, c.normalize, c.dtype) for c in configs} == {
        (a, n, d) for a in reference.ACTIVATIONS for n in (True, False) for d in (torch.bfloat16, torch.float16)}
    tokens = sorted(c.T for c in configs)
    assert tokens[0] == 0 and 1 in tokens and tokens[-1] == 20000
    assert sum(T >= 4096 for T in tokens) == len(LARGE_AT) and sum(T <= 2048 for T in tokens) == GPU_SWEEP - 3
    assert min(c.E for c in configs) >= 4 and max(c.E for c in configs) <= 256
    assert all(1 <= c.k <= min(8, c.E) for c in configs)
    assert all(c.H % 64 == 0 and c.I % 64 == 0 for c in configs)  # the kernel's shape rule
    assert all(c.E * c.H * c.w1_cols <= GPU_SIZES.max_weights for c in configs)
    assert any(c.capacity_factor for c in configs) and any(c.capacity_factor is None for c in configs)
    assert any(c.skew for c in configs) and sum(c.ties for c in configs) >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(GPU_SWEEP))
def test_gradients_against_float64_oracle(fused, index):
    config = draw_config(index, next_seed(), GPU_SIZES, large_at=LARGE_AT)
    print(config)
    check_config("cuda", config, next_seed(), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dropped_choices_and_idle_experts_get_no_gradient(fused, dtype):
    """A routing that surely drops (k = 1, capacity 0.5, skewed) and leaves experts idle: whole tokens
    dropped (dx exactly 0), experts without rows (dw1, dw2 exactly 0), the rest against the oracle."""
    config = GradConfig(T=3000, H=256, I=128, E=16, k=1, activation="gelu", normalize=True, capacity_factor=0.5,
                        skew=4.0, ties=False, dtype=dtype)
    covered = check_config("cuda", config, next_seed(), "cuda")
    assert covered["dropped"] > 0 and covered["idle_experts"] > 0, covered


# ---------------------------------------------------------------------------------------------------------
# Repeated runs
# ---------------------------------------------------------------------------------------------------------


REPEAT_CONFIGS = [
    GradConfig(20000, 512, 256, 64, 8, "swiglu", True, None, 0.0, False, torch.bfloat16),
    GradConfig(4096, 1024, 512, 32, 4, "gelu", False, 1.25, 3.0, False, torch.bfloat16),
    GradConfig(777, 256, 128, 256, 7, "silu", True, None, 0.0, True, torch.float16),
    GradConfig(1, 128, 128, 8, 2, "relu", True, 0.5, 0.0, False, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", REPEAT_CONFIGS, ids=str)
def test_repeated_backward_is_bitwise_identical(fused, config):
    inputs = make_problem(config, next_seed(), "cuda")
    first_y, first_grads, _, _ = run_public("cuda", config, *inputs)
    for run in (2, 3):
        y, grads, _, _ = run_public("cuda", config, *inputs)
        assert torch.equal(y, first_y), f"{config}: y of run {run} differs from run 1"
        for name, got, want in zip(("x", "router_weight", "w1", "w2"), grads, first_grads):
            assert torch.equal(got, want), f"{config}: d{name} of run {run} differs from run 1"


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------


GPU_SETUP = TrainingSetup(tokens=4096, features=64, hidden=128, ffn=128, experts=16, top_k=2, outputs=16,
                          activation="swiglu")


@pytest.mark.gpu
def test_training_follows_the_float64_reference(fused, seed):
    model = MoEModel(GPU_SETUP, seed)
    x, target = make_task(GPU_SETUP, seed + 1)
    want = train(GPU_SETUP, model, x, target, backend="reference", compute_dtype=torch.float64, device="cuda")
    got = train(GPU_SETUP, model, x, target, backend="cuda", compute_dtype=torch.bfloat16, device="cuda")
    output_tolerance, gradient_tolerance = tolerances(torch.bfloat16, GPU_SETUP)
    band = loss_band(want, outputs=GPU_SETUP.tokens * GPU_SETUP.outputs, output_tolerance=output_tolerance,
                     gradient_tolerance=gradient_tolerance)
    used, compared = assert_follows(got, want, band, what="bfloat16 on the fused backend", max_relative_band=0.25,
                                    tokens=GPU_SETUP.tokens, output_tolerance=output_tolerance,
                                    gradient_tolerance=gradient_tolerance)
    print(f"loss {want.loss[0]:.4f} -> {want.loss[-1]:.4f}; {compared} steps compared, largest fraction of the "
          f"band used {used:.3f}")
    again = train(GPU_SETUP, model, x, target, backend="cuda", compute_dtype=torch.bfloat16, device="cuda")
    assert again.loss == got.loss, "a second bfloat16 training run differs from the first"


# ---------------------------------------------------------------------------------------------------------
# Emulated teams
# ---------------------------------------------------------------------------------------------------------


# (P, tokens per rank, H, I, L, k, activation, normalize, capacity, skew, dtype)
EMULATED_CONFIGS = [
    (2, (300, 0), 128, 128, 4, 2, "gelu", True, None, 0.0, torch.bfloat16),
    (2, (1, 700), 256, 64, 2, 3, "swiglu", False, 1.0, 3.0, torch.float16),
    (4, (500, 129, 0, 64), 128, 192, 4, 4, "silu", True, 0.5, 0.0, torch.bfloat16),
    (4, (1000, 1000, 1000, 1000), 256, 128, 8, 8, "relu", False, None, 3.0, torch.float16),
    (8, (256, 256, 0, 256, 256, 256, 256, 256), 128, 128, 2, 2, "swiglu", False, 1.25, 0.0, torch.bfloat16),
    (8, (33, 0, 800, 5, 2000, 64, 1, 300), 64, 64, 8, 6, "gelu", True, None, 2.0, torch.float16),
]


def emulated_problem(P, tokens, H, I, L, k, activation, normalize, capacity_factor, skew, dtype):
    """All ranks' tokens drawn as one batch (one skew direction) and split; weights split into shards."""
    config = GradConfig(sum(tokens), H, I, P * L, k, activation, normalize, capacity_factor, skew, False, dtype)
    x, router_weight, w1, w2, dy = make_problem(config, next_seed(), "cuda")
    return config, list(x.split(tokens)), router_weight, list(w1.split(L)), list(w2.split(L)), list(dy.split(tokens))


def run_emulated(team, config, xs, router_weight, w1s, w2s, dys):
    """moe_expert_parallel forward and backward of sum_r <y_r, dy_r>. Returns the leaves (router, xs, w1s,
    w2s), the ys and each rank's routing (experts, keep)."""
    leaves = [t.detach().clone().requires_grad_() for t in (router_weight, *xs, *w1s, *w2s)]
    P = len(xs)
    ys = flashdmoe.moe_expert_parallel(leaves[1:1 + P], leaves[0], leaves[1 + P:1 + 2 * P], leaves[1 + 2 * P:],
                                       top_k=config.k, activation=config.activation,
                                       normalize_topk=config.normalize, capacity_factor=config.capacity_factor,
                                       team=team)
    report = flashdmoe.last_report()
    routings = [(r.expert.long(), r.row >= 0) for r in report.routing]
    sum((y.float() * dy.float()).sum() for y, dy in zip(ys, dys)).backward()
    return leaves, ys, routings


def small_emulated(P, tokens, activation="gelu"):
    """A small emulated problem (H = I = 128, 2 local experts, k = 2, bf16), its team and fresh leaves
    (router, xs, w1s, w2s) for moe_expert_parallel."""
    problem = emulated_problem(P, tokens, 128, 128, 2, 2, activation, True, None, 0.0, torch.bfloat16)
    team = Team.emulated(P, max_tokens=max(tokens), hidden=128, top_k=2, local_experts=2, dtype=torch.bfloat16)
    _, xs, router_weight, w1s, w2s, _ = problem
    leaves = [t.detach().clone().requires_grad_() for t in (router_weight, *xs, *w1s, *w2s)]
    return (*problem, team, leaves)


def check_emulated(config, xs, router_weight, w1s, w2s, dys, leaves, ys, routings):
    """Each rank's y and dx, the summed router gradient and every shard's weight gradients against float64
    autograd through reference.moe_fixed_routing on the concatenated experts (what moe_expert_parallel
    computes, reference.moe_expert_parallel's docstring) and each rank's own routing."""
    P = len(xs)
    w1_all, w2_all = torch.cat(w1s), torch.cat(w2s)
    router64, w1_64, w2_64 = (t.detach().double().requires_grad_() for t in (router_weight, w1_all, w2_all))
    xs64 = [x.detach().double().requires_grad_() for x in xs]
    # every leaf in the graph (exact zero gradients where no rank has a term)
    loss = 0.0 * (router64.sum() + w1_64.sum() + w2_64.sum() + sum(x.sum() for x in xs64))
    magnitude = torch.zeros_like(router64)
    dx_kinks, w1_kinks = [[] for _ in range(P)], []  # relu's kink (grad_checks.relu_kink_alternatives)
    for rank, (x64, dy, (experts, keep)) in enumerate(zip(xs64, dys, routings)):
        check_routing(xs[rank], router_weight, experts, keep, top_k=config.k, capacity_factor=config.capacity_factor,
                      what=f"{config} rank {rank}")
        if x64.shape[0] == 0:
            continue
        y64 = reference.moe_fixed_routing(x64, router64, w1_64, w2_64, experts, keep, activation=config.activation,
                                          normalize_topk=config.normalize)
        error = numerics.normwise_error(ys[rank], y64)
        assert error <= numerics.kernel_tolerance(config.dtype), f"{config}: rank {rank}: y error {error:.3e}"
        loss = loss + (y64 * dy.double()).sum()
        magnitude += router_gradient_magnitude(xs[rank], router_weight, w1_all, w2_all, experts, keep, dy,
                                               activation=config.activation, normalize_topk=config.normalize)
        if config.activation == "relu":
            chosen = reference.combine_weights(reference.router_probs(xs[rank].double(), router_weight.double()),
                                               experts, config.normalize)
            kinks = relu_kink_alternatives(xs[rank], w1_all, w2_all, dy, experts, chosen, keep, dtype=config.dtype)
            dx_kinks[rank], w1_kinks = kinks["dx"], w1_kinks + kinks["dw1"]
    want_router, want_w1, want_w2, *want_xs = torch.autograd.grad(loss, [router64, w1_64, w2_64, *xs64])
    router_leaf, x_leaves = leaves[0], leaves[1:1 + P]
    got_w1 = torch.cat([leaf.grad for leaf in leaves[1 + P:1 + 2 * P]])
    got_w2 = torch.cat([leaf.grad for leaf in leaves[1 + 2 * P:]])
    bound = numerics.backward_tolerance(config.dtype)
    error = router_error(router_leaf.grad, want_router, magnitude)
    assert error <= bound, f"{config}: d_router error {error:.3e} > {bound:.3e}"
    for name, got, want, kinks in (("w1", got_w1, want_w1, w1_kinks), ("w2", got_w2, want_w2, [])):
        error = kink_fitted_error(got, want, kinks)
        assert error <= bound, f"{config}: d{name} error {error:.3e} > {bound:.3e}"
    for rank, (leaf, want, (_, keep)) in enumerate(zip(x_leaves, want_xs, routings)):
        got = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        error = kink_fitted_error(got, want, dx_kinks[rank])
        assert error <= bound, f"{config}: rank {rank}: dx error {error:.3e} > {bound:.3e}"
        assert_dropped_tokens_get_no_dx(got, keep, f"{config} rank {rank}")
    assert_idle_experts_get_no_weight_gradient(got_w1, got_w2, routings, str(config))


@pytest.mark.gpu
@pytest.mark.parametrize("P,tokens,H,I,L,k,activation,normalize,capacity_factor,skew,dtype", EMULATED_CONFIGS)
def test_emulated_team_gradients_against_float64_oracle(fused, P, tokens, H, I, L, k, activation, normalize,
                                                        capacity_factor, skew, dtype):
    config, xs, router_weight, w1s, w2s, dys = emulated_problem(P, tokens, H, I, L, k, activation, normalize,
                                                                capacity_factor, skew, dtype)
    team = Team.emulated(P, max_tokens=max(max(tokens), 1), hidden=H, top_k=k, local_experts=L, dtype=dtype)
    leaves, ys, routings = run_emulated(team, config, xs, router_weight, w1s, w2s, dys)
    check_emulated(config, xs, router_weight, w1s, w2s, dys, leaves, ys, routings)
    # and bitwise again on the same team
    again, _, _ = run_emulated(team, config, xs, router_weight, w1s, w2s, dys)
    for index, (first, second) in enumerate(zip(leaves, again)):
        assert torch.equal(first.grad, second.grad), f"{config}: gradient of leaf {index} differs between runs"


@pytest.mark.gpu
@pytest.mark.parametrize("P,silent", [(2, 1), (3, 0), (4, 2)])
def test_backward_after_a_timed_out_forward_raises_on_every_rank(fused, P, silent):
    """A timeout forced in the forward (a rank that publishes no signal), with the default deferred checks:
    the forward returns, and the backward, which checks the forward's launch before it starts, is where it
    surfaces (a silent rank in the backward itself: the test below)."""
    config, xs, router_weight, w1s, w2s, dys, team, leaves = small_emulated(P, (256,) * P)
    previous = flashdmoe.set_sync_checks(False)
    try:
        fused.debug.silent_rank, fused.debug.timeout_ms = silent, 300
        try:
            ys = flashdmoe.moe_expert_parallel(leaves[1:1 + P], leaves[0], leaves[1 + P:1 + 2 * P],
                                               leaves[1 + 2 * P:], top_k=2, team=team)
        finally:
            fused.debug.silent_rank, fused.debug.timeout_ms = -1, None
        loss = sum((y.float() * dy.float()).sum() for y, dy in zip(ys, dys))
        with pytest.raises(flashdmoe.KernelTimeout) as caught:
            loss.backward()
    finally:
        flashdmoe.set_sync_checks(previous)
    segments = str(caught.value).split("; ")
    for rank in range(P):
        mine = [s for s in segments if f"rank {rank} timed out" in s]
        assert len(mine) == 1, str(caught.value)
        if rank != silent:
            assert f"waiting on rank {silent}" in mine[0], str(caught.value)
    assert all(leaf.grad is None for leaf in leaves), "a gradient came out of a timed-out forward"
    assert team.failed
    with pytest.raises(TeamFailed):
        flashdmoe.moe_expert_parallel(xs, router_weight, w1s, w2s, top_k=2, team=team)
    # The GPU is fine: a new team trains.
    fresh = Team.emulated(P, max_tokens=256, hidden=128, top_k=2, local_experts=2, dtype=torch.bfloat16)
    leaves, ys, routings = run_emulated(fresh, config, xs, router_weight, w1s, w2s, dys)
    check_emulated(config, xs, router_weight, w1s, w2s, dys, leaves, ys, routings)


@pytest.mark.gpu
@pytest.mark.parametrize("P,tokens", [(2, (200, 64)), (3, (200, 0, 77)), (8, (40,) * 8)])
def test_emulated_backward_moves_rows_by_the_exchange(fused, P, tokens):
    """An emulated team's backward runs on the device exchange (every rank of a direction in one launch):
    gradients against the float64 oracle and bytes moved between ranks both ways; with
    FLASHDMOE_TEAM_BACKWARD=torch (each rank's expert_backward) the oracle's gradients too."""
    from flashdmoe.backward import ep_backward

    config, xs, router_weight, w1s, w2s, dys = emulated_problem(P, tokens, 128, 128, 2, 2, "gelu", True, None, 0.0,
                                                                torch.bfloat16)
    team = Team.emulated(P, max_tokens=max(tokens), hidden=128, top_k=2, local_experts=2, dtype=torch.bfloat16)
    leaves, ys, routings = run_emulated(team, config, xs, router_weight, w1s, w2s, dys)
    check_emulated(config, xs, router_weight, w1s, w2s, dys, leaves, ys, routings)
    reports = team.backward_reports
    assert len(reports) == 3 and all(report.ranks == tuple(range(P)) for report in reports)
    traffic = ep_backward.exchange_traffic(team)
    assert traffic["dispatch_bytes"] > 0 and traffic["combine_bytes"] > 0, traffic
    assert traffic["nvshmem_dispatch_bytes"] == traffic["nvshmem_combine_bytes"] == 0, traffic
    previous = fused.debug.team_backward
    fused.debug.team_backward = "torch"
    try:
        leaves, ys, routings = run_emulated(team, config, xs, router_weight, w1s, w2s, dys)
    finally:
        fused.debug.team_backward = previous
    check_emulated(config, xs, router_weight, w1s, w2s, dys, leaves, ys, routings)


@pytest.mark.gpu
def test_the_emulated_backward_queues_its_work_without_a_stream_synchronisation(fused):
    """Once the forward is checked, the exchange backward only queues work: a synchronising copy or query
    (torch's sync debug mode) would stall the host behind every launch before it."""
    P = 3
    *_, dys, team, leaves = small_emulated(P, (96, 0, 150), "swiglu")
    ys = flashdmoe.moe_expert_parallel(leaves[1:1 + P], leaves[0], leaves[1 + P:1 + 2 * P], leaves[1 + 2 * P:],
                                       top_k=2, activation="swiglu", team=team)
    loss = sum((y.float() * dy.float()).sum() for y, dy in zip(ys, dys))
    flashdmoe.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    flashdmoe.synchronize()
    assert len(team.backward_reports) == 3
    assert all(leaf.grad is not None and bool(leaf.grad.isfinite().all()) for leaf in leaves)


@pytest.mark.gpu
@pytest.mark.parametrize("P,silent", [(2, 1), (4, 0)])
def test_a_silent_rank_in_the_emulated_backward_times_out_every_rank(fused, P, silent):
    _, xs, router_weight, w1s, w2s, dys, team, leaves = small_emulated(P, (128,) * P)
    previous = flashdmoe.set_sync_checks(False)
    try:
        ys = flashdmoe.moe_expert_parallel(leaves[1:1 + P], leaves[0], leaves[1 + P:1 + 2 * P], leaves[1 + 2 * P:],
                                           top_k=2, team=team)
        loss = sum((y.float() * dy.float()).sum() for y, dy in zip(ys, dys))
        fused.debug.silent_rank, fused.debug.timeout_ms = silent, 300
        # Every rank's timeout surfaces at synchronize(), or earlier at a later exchange launch of this
        # backward if the timed-out one has already finished when the host queues it (docs/design.md §9).
        try:
            with pytest.raises(flashdmoe.KernelTimeout) as caught:
                loss.backward()
                flashdmoe.synchronize()
        finally:
            fused.debug.silent_rank, fused.debug.timeout_ms = -1, None
    finally:
        flashdmoe.set_sync_checks(previous)
    for rank in range(P):
        assert f"rank {rank} timed out" in str(caught.value), str(caught.value)
    assert team.failed
    with pytest.raises(TeamFailed):
        flashdmoe.moe_expert_parallel(xs, router_weight, w1s, w2s, top_k=2, team=team)
    # The exchange launches queued before the first timeout surfaced timed out too; their errors (each
    # raised once) belong to this test, not to the next one's first forward.
    drain_launch_errors()


def launch_errors(limit: int = 16) -> list[Exception]:
    """Every unchecked launch error, oldest first (flashdmoe.check_errors() raises one per call)."""
    torch.cuda.synchronize()  # every launch finished: check_errors then sees each of them
    errors = []
    for _ in range(limit):
        try:
            flashdmoe.check_errors()
            return errors
        except Exception as error:  # noqa: BLE001 - collected for the test's assertions
            errors.append(error)
    raise AssertionError(f"more than {limit} unchecked launch errors")


@pytest.mark.gpu
@pytest.mark.parametrize("P,silent", [(2, 1), (3, 0)])
def test_a_forward_queued_behind_a_failed_emulated_backward_runs_nothing(fused, P, silent):
    """The host does not wait for a team's backward before its next forward on the same stream: a failed
    exchange marks its ranks on the device (bit 31 and the backward's number), the forward queued behind it
    runs nothing on any rank, and the errors surface oldest first: the timeouts, then TeamFailed."""
    _, xs, router_weight, w1s, w2s, dys, team, leaves = small_emulated(P, (128,) * P)
    previous = flashdmoe.set_sync_checks(False)
    try:
        for _ in range(2):  # the first loads the backward's kernels (a lazy load may wait for the GPU)
            ys = flashdmoe.moe_expert_parallel(leaves[1:1 + P], leaves[0], leaves[1 + P:1 + 2 * P],
                                               leaves[1 + 2 * P:], top_k=2, team=team)
            loss = sum((y.float() * dy.float()).sum() for y, dy in zip(ys, dys))
            if not team.backward_reports:
                loss.backward()
        flashdmoe.synchronize()
        fused.debug.silent_rank, fused.debug.timeout_ms = silent, 300
        try:
            loss.backward()  # queued: the exchange times out 300 ms later
        finally:
            fused.debug.silent_rank, fused.debug.timeout_ms = -1, None
        exchange = team.backward_reports
        with torch.no_grad():
            flashdmoe.moe_expert_parallel(xs, router_weight, w1s, w2s, top_k=2, team=team)
        stopped = flashdmoe.last_report()
        waited = exchange[0].ready()
        errors = launch_errors()
    finally:
        flashdmoe.set_sync_checks(previous)
    assert not waited, "the forward waited on the host for the backward's exchange"
    assert errors and all(isinstance(e, flashdmoe.KernelTimeout) for e in errors[:-1]), errors
    assert f"[launch {exchange[0].launch_id} on" in str(errors[0]) and "backward exchange" in str(errors[0])
    for rank in range(P):
        assert f"rank {rank} timed out" in str(errors[0]), str(errors[0])
    assert isinstance(errors[-1], TeamFailed) and f"[launch {stopped.launch_id} on" in str(errors[-1]), errors
    number = team.backward_count()
    for rank in range(P):
        assert f"rank {rank} ran nothing: its team's backward number {number} failed earlier" in str(errors[-1])
    assert team.device_words[:, 1].tolist() == [number - (1 << 31)] * P
    assert team.failed
    with pytest.raises(TeamFailed):
        flashdmoe.moe_expert_parallel(xs, router_weight, w1s, w2s, top_k=2, team=team)


@pytest.mark.gpu
def test_a_multi_layer_emulated_backward_queues_without_a_host_wait(fused, monkeypatch):
    """Three layers of an emulated team, residual: each layer's backward starts without waiting for the
    previous layer's exchange (all queued behind half a second of GPU work before any ran), and the
    gradients equal those of the same step in debug mode (a wait at every launch), bit for bit."""
    from flashdmoe.backward import ep_backward

    P, layers = 3, 3
    config, xs, router_weight, w1s, w2s, dys = emulated_problem(P, (96, 130, 64), 128, 128, 2, 2, "swiglu", True,
                                                                None, 0.0, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(next_seed())
    weights = [(router_weight, w1s, w2s)] + [
        ((torch.randn(router_weight.shape, device="cuda", generator=g) * router_weight.float().std()).to(torch.bfloat16),
         [(torch.randn(w.shape, device="cuda", generator=g) * w.float().std()).to(w.dtype) for w in w1s],
         [(torch.randn(w.shape, device="cuda", generator=g) * w.float().std()).to(w.dtype) for w in w2s])
        for _ in range(layers - 1)]
    team = Team.emulated(P, max_tokens=130, hidden=128, top_k=2, local_experts=2, dtype=torch.bfloat16)
    launched = []
    real_launch = ep_backward._launch
    def recorded(*args, **kwargs):
        launched.append(real_launch(*args, **kwargs))
        return launched[-1]

    monkeypatch.setattr(ep_backward, "_launch", recorded)

    def step(busy: bool):
        leaves = [[t.detach().clone().requires_grad_() for t in (r, *a, *b)] for r, a, b in weights]
        hs = [x.detach().clone().requires_grad_() for x in xs]
        out = hs
        for layer in leaves:
            ys = flashdmoe.moe_expert_parallel(out, layer[0], layer[1:1 + P], layer[1 + P:], top_k=2,
                                               activation="swiglu", team=team)
            out = [h + y for h, y in zip(out, ys)]
        loss = sum((h.float() * dy.float()).sum() for h, dy in zip(out, dys))
        flashdmoe.synchronize()
        launched.clear()
        if busy:
            torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time ahead of the backward
        loss.backward()
        ran = [r.ready() for r in launched]
        flashdmoe.synchronize()
        return [t.grad for t in hs] + [t.grad for layer in leaves for t in layer], ran, len(launched)

    previous = flashdmoe.set_sync_checks(True)
    try:
        want, _, count = step(busy=False)
    finally:
        flashdmoe.set_sync_checks(previous)
    previous = flashdmoe.set_sync_checks(False)
    try:
        got, ran, queued = step(busy=True)
    finally:
        flashdmoe.set_sync_checks(previous)
    assert count == queued == 3 * layers
    assert not any(ran), f"exchange launches finished before the backward returned: {ran}"
    for index, (a, b) in enumerate(zip(got, want)):
        assert a is not None and torch.equal(a, b), f"gradient {index} differs from the debug-mode step"


def drain_launch_errors(limit: int = 16) -> None:
    """Raise and drop every unchecked launch error (flashdmoe.synchronize() raises one per call)."""
    for _ in range(limit):
        try:
            flashdmoe.synchronize()
            return
        except (flashdmoe.KernelTimeout, RuntimeError):
            continue
    raise AssertionError(f"more than {limit} unchecked launch errors")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_emulated_team_training_step_graph_replays_equal_eager_steps_bitwise(fused, activation):
    """A whole training step of a 4-rank emulated team (forward, loss, backward on the device exchange)
    captured in one CUDA graph: each replay, with new tokens and output gradients copied in, gives every
    output and gradient of an eager step on the same inputs, bit for bit. The captured backward lays out the
    owners' rows for the team's bound on the device (no host counts), where the eager one sizes them exactly."""
    P, tokens = 4, (96, 130, 0, 64)
    _, xs, router_weight, w1s, w2s, dys = emulated_problem(P, tokens, 128, 128, 2, 2, activation, True, None, 0.0,
                                                           torch.bfloat16)
    team = Team.emulated(P, max_tokens=max(tokens), hidden=128, top_k=2, local_experts=2, dtype=torch.bfloat16)
    weights = [t.detach().clone().requires_grad_() for t in (router_weight, *w1s, *w2s)]
    static_xs = [x.detach().clone().requires_grad_() for x in xs]
    static_dys = [dy.clone() for dy in dys]
    leaves = [weights[0], *static_xs, *weights[1:]]

    def step(xs_, dys_, leaves_):
        ys = flashdmoe.moe_expert_parallel(xs_, leaves_[0], leaves_[1 + P:1 + 2 * P], leaves_[1 + 2 * P:], top_k=2,
                                           activation=activation, team=team)
        sum((y.float() * dy.float()).sum() for y, dy in zip(ys, dys_)).backward()
        return ys

    fused.debug.poison_outputs = False  # a fill in the graph would only hide what the replay writes
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(static_xs, static_dys, leaves)
        torch.cuda.current_stream().wait_stream(side)
        flashdmoe.synchronize()
        for leaf in leaves:
            leaf.grad = None  # the captured backward's gradients come from the graph's pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_ys = step(static_xs, static_dys, leaves)
        grads = [leaf.grad for leaf in leaves]
        count = team.backward_count()
        for replay in range(3):
            g = torch.Generator(device="cuda").manual_seed(next_seed())
            new_xs = [torch.randn(x.shape, device="cuda", generator=g).to(x.dtype) for x in xs]
            new_dys = [torch.randn(dy.shape, device="cuda", generator=g).to(dy.dtype) for dy in dys]
            with torch.no_grad():
                for static, new in zip(static_xs + static_dys, new_xs + new_dys):
                    static.copy_(new)
                for out in static_ys + grads:
                    out.fill_(float("nan"))
            graph.replay()
            flashdmoe.synchronize()
            # each replay counts one backward on the device, as each eager step between them does
            assert team.backward_count() == count + 1 + 2 * replay, "a replay counts one backward on the device"
            fresh = [t.detach().clone().requires_grad_() for t in (weights[0], *new_xs, *weights[1:])]
            ys = step(fresh[1:1 + P], new_dys, fresh)
            flashdmoe.synchronize()
            for rank in range(P):
                assert torch.equal(static_ys[rank], ys[rank]), f"replay {replay}: rank {rank}'s y"
            for i, (got, leaf) in enumerate(zip(grads, fresh)):
                assert torch.equal(got, leaf.grad), f"replay {replay}: gradient of leaf {i}"
    finally:
        fused.debug.poison_outputs = True


@pytest.mark.gpu
def test_used_up_backward_numbers_fail_the_team(fused):
    """The kernel counts a rank's backward exchanges; at 2^31 - 1 the next backward runs nothing, every rank
    reports it (a sequence error naming the backward exchanges) and the team fails."""
    P = 2
    _, xs, router_weight, w1s, w2s, dys, team, leaves = small_emulated(P, (64, 64))
    ys = flashdmoe.moe_expert_parallel(leaves[1:1 + P], leaves[0], leaves[1 + P:1 + 2 * P], leaves[1 + 2 * P:],
                                       top_k=2, team=team)
    sum((y.float() * dy.float()).sum() for y, dy in zip(ys, dys)).backward()
    flashdmoe.synchronize()
    assert team.backward_count() == 1 and team.backward_count(P - 1) == 1
    word = team.plan.backward_word("sequence", 0, 0)
    for own in team.buffers:
        own.signals[word] = 2 ** 31 - 1
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ys = flashdmoe.moe_expert_parallel(leaves[1:1 + P], leaves[0], leaves[1 + P:1 + 2 * P], leaves[1 + 2 * P:],
                                       top_k=2, team=team)
    with pytest.raises(RuntimeError) as caught:  # at loss.backward() if its first launch was checked by then
        sum((y.float() * dy.float()).sum() for y, dy in zip(ys, dys)).backward()
        flashdmoe.synchronize()
    for rank in range(P):
        assert f"rank {rank}: the team's backward exchanges used up" in str(caught.value), str(caught.value)
    assert team.failed
    assert team.backward_count() == 2 ** 31 - 1, "a used-up count stays"
    drain_launch_errors()
    with pytest.raises(TeamFailed):
        flashdmoe.moe_expert_parallel(xs, router_weight, w1s, w2s, top_k=2, team=team)
