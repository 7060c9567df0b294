"""The forward as users call it, on the GPU: no host synchronisation, errors where flashdmoe.kernel.status_checks
says they surface, CUDA-graph capture and replay bitwise equal to eager calls.

tests/test_status_checks.py checks the same state machine on the CPU with a fake extension; this file
checks it against the real kernel, its status write into pinned memory and CUDA's graph capture, and that
the sync words the kernel's exit resets (no memset before a launch) serve every next launch.
"""

import math
import traceback

import pytest
import torch

import flashdmoe
from closeness import assert_normwise_close
from conftest import next_seed
from flashdmoe import numerics, reference
from flashdmoe.kernel import status_checks
from flashdmoe.parallel.team import Team, TeamFailed

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fused kernel targets Hopper (sm_90a)")
    from flashdmoe import cuda_backend
    from flashdmoe.kernel import extension

    extension.load()  # a build failure on Hopper is a test failure, not a skip
    previous = flashdmoe.set_sync_checks(False)
    yield cuda_backend
    flashdmoe.set_sync_checks(previous)


@pytest.fixture
def knobs(backend):
    """Debug knobs set by a test, reset after it (a failing launch must not leak into the next test)."""
    yield backend.debug
    backend.debug.withhold_phase = 0
    backend.debug.silent_rank = -1
    backend.debug.timeout_ms = None
    try:
        flashdmoe.synchronize()
    except (flashdmoe.KernelTimeout, ValueError, RuntimeError):
        pass


def make_inputs(T, H, I, E, activation, *, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cols = 2 * I if activation == "swiglu" else I
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    router = (torch.randn(E, H, device="cuda", generator=g) / math.sqrt(H)).to(dtype)
    w1 = (torch.randn(E, H, cols, device="cuda", generator=g) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, I, H, device="cuda", generator=g) / math.sqrt(I)).to(dtype)
    return x, router, w1, w2


def tokens_like(x, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(x.shape, device="cuda", generator=g).to(x.dtype)


def capture(fn):
    """torch's recipe: warm up on a side stream, then capture. Returns (graph, captured outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    flashdmoe.synchronize()  # checks the warm-up (a team's last launch must be checked before a capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


# ------------------------------------------------------------------------------------------------------------
# No host synchronisation


def test_forward_returns_while_the_gpu_is_still_busy(backend, seed):
    x, router, w1, w2 = make_inputs(512, 256, 256, 16, "gelu", seed=seed)
    flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    flashdmoe.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time ahead of the forward
    flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    report = flashdmoe.last_report()
    busy = not torch.cuda.current_stream().query()
    ready = report.ready()
    flashdmoe.synchronize()
    assert busy and not ready, "the forward waited for the GPU"
    assert report.checked and report.error is None and report.phase_ms is not None


def test_every_rank_marks_its_status_slot_complete_and_a_wait_polls_it(backend, seed, monkeypatch):
    """The completion words the kernel sets replace a CUDA event: readable once the device is idle, set by
    every rank of an emulated launch, and a wait for a launch queued behind GPU work returns when it ends."""
    x, router, w1, w2 = make_inputs(512, 256, 256, 16, "gelu", seed=seed)
    flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    flashdmoe.synchronize()
    torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time ahead of the forward: polled, not a device wait
    flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    report = flashdmoe.last_report()
    assert not report.ready()
    device_waits = []
    real_wait = status_checks._synchronize_device
    monkeypatch.setattr(status_checks, "_synchronize_device", lambda d: (device_waits.append(d), real_wait(d)))
    report.wait()
    assert report.ready() and device_waits == [], "seen done by polling its words, no device synchronisation"
    assert report.error is None and report.phase_ms["experts"] > 0
    P = 4
    team = Team.emulated(P, max_tokens=128, hidden=256, top_k=2, local_experts=16 // P, dtype=torch.bfloat16)
    xs = [tokens_like(x[:128], seed + rank) for rank in range(P)]
    flashdmoe.moe_expert_parallel(xs, router, list(w1.split(16 // P)), list(w2.split(16 // P)), top_k=2, team=team)
    report = flashdmoe.last_report()
    torch.cuda.synchronize()
    assert report.ready() and report.ranks == (0, 1, 2, 3)
    flashdmoe.synchronize()
    assert report.checked and report.error is None and all(s.phase_ms is not None for s in report.statuses)

def test_profiler_sees_no_synchronisation_copy_or_memset(backend, seed):
    from torch.profiler import ProfilerActivity, profile, record_function

    x, router, w1, w2 = make_inputs(1024, 256, 256, 16, "gelu", seed=seed)
    flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    flashdmoe.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("flashdmoe_forward"):
            flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
        torch.cuda.synchronize()
    flashdmoe.synchronize()
    events = list(prof.events())
    # the range appears once on the CPU (and again as its GPU projection)
    (window,) = [e for e in events if e.name == "flashdmoe_forward" and e.device_type == torch.autograd.DeviceType.CPU]
    start, end = window.time_range.start, window.time_range.end
    inside = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU
              and start <= e.time_range.start <= end}
    waits = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
             "cudaStreamWaitEvent"} & inside
    assert not waits, f"the forward called {waits}"
    # The kernel writes its status into pinned memory and resets its sync words as it exits.
    copies = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA
              and ("memcpy" in e.name.lower() or "memset" in e.name.lower())]
    assert copies == []


def test_the_cpp_launch_path_gives_the_python_paths_bits(backend, seed, monkeypatch):
    """Steady calls launch from C++ (flashdmoe.kernel.host_queue) through the kernel module's C entry;
    their outputs, routing and gradients are bitwise the Python path's."""
    from flashdmoe.kernel import extension

    assert hasattr(extension.loaded(), "native_forward")
    x, router, w1, w2 = make_inputs(64, 256, 256, 16, "swiglu", seed=seed)
    python_launches = []
    record = status_checks.record_launch

    def counting(*args, **kwargs):
        if kwargs.get("forward", True):  # the fused backward's launches are the Python path's
            python_launches.append(" <- ".join(f.name for f in reversed(traceback.extract_stack(limit=8)[:-1])))
        return record(*args, **kwargs)

    monkeypatch.setattr(status_checks, "record_launch", counting)

    # The weights live across steps, as a model's parameters do: a new weight is a new call signature (its
    # finiteness scan is queued, so that call takes the Python path).
    rg, w1g, w2g = (t.clone().requires_grad_() for t in (router, w1, w2))

    def step():
        for weight in (rg, w1g, w2g):
            weight.grad = None
        xg = x.clone().requires_grad_()
        y, aux = flashdmoe.moe(xg, rg, w1g, w2g, top_k=4, activation="swiglu", backend="cuda", return_aux=True)
        y.float().square().sum().backward()
        flashdmoe.synchronize()  # checks the backward's launches: the next forward has nothing older to check
        with torch.no_grad():
            inference = flashdmoe.moe(x, router, w1, w2, top_k=4, activation="swiglu", backend="cuda")
        return [y.detach(), aux.counts, inference, xg.grad, rg.grad, w1g.grad, w2g.grad]

    step()  # the first calls of each signature take the Python path (checks, plan, slots)
    flashdmoe.synchronize()
    before = len(python_launches)
    steady = step()
    assert len(python_launches) == before, ("a remembered call with nothing to report launches from C++; the "
                                            f"Python path launched from {python_launches[before:]}")
    flashdmoe.synchronize()
    assert flashdmoe.last_report().error is None
    monkeypatch.setattr(status_checks, "native_launches", False)
    python = step()
    flashdmoe.synchronize()
    assert len(python_launches) == before + 2
    for mine, theirs in zip(steady, python):
        assert torch.equal(mine, theirs)


# ------------------------------------------------------------------------------------------------------------
# Errors surface where documented (default: asynchronous)


def test_timeout_surfaces_at_synchronize_and_at_the_next_call(backend, knobs, seed):
    x, router, w1, w2 = make_inputs(4096, 256, 256, 16, "gelu", seed=seed)
    good = flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    flashdmoe.synchronize()
    knobs.withhold_phase, knobs.timeout_ms = 2, 300
    flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")  # returns: nothing waited
    report = flashdmoe.last_report()
    with pytest.raises(flashdmoe.KernelTimeout, match="per-expert offsets"):
        flashdmoe.synchronize()
    assert report.error.timed_out and report.error.phase == 2
    flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    failed = flashdmoe.last_report()
    knobs.withhold_phase, knobs.timeout_ms = 0, None
    torch.cuda.synchronize()  # the launch has finished: the next call checks it
    with pytest.raises(flashdmoe.KernelTimeout, match=rf"\[launch {failed.launch_id} on cuda"):
        flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    again = flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    flashdmoe.synchronize()
    assert torch.equal(again, good), "the GPU recovered"


def test_non_finite_input_surfaces_at_check_errors(backend, seed):
    x, router, w1, w2 = make_inputs(256, 128, 128, 8, "gelu", seed=seed)
    x[17, 5] = float("nan")
    flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="NaN or Inf"):
        flashdmoe.check_errors()
    flashdmoe.check_errors()  # raised once


def test_sync_checks_raise_at_the_call(backend, knobs, seed):
    x, router, w1, w2 = make_inputs(256, 128, 128, 8, "gelu", seed=seed)
    bad = x.clone()
    bad[3, 3] = float("inf")
    previous = flashdmoe.set_sync_checks(True)
    try:
        with pytest.raises(ValueError, match="NaN or Inf"):
            flashdmoe.moe(bad, router, w1, w2, top_k=2, backend="cuda")
        knobs.withhold_phase, knobs.timeout_ms = 3, 300
        with pytest.raises(flashdmoe.KernelTimeout, match="after dispatch"):
            flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    finally:
        flashdmoe.set_sync_checks(previous)


def test_a_stuck_rank_fails_every_rank_and_the_device_stops_the_teams_next_forward(backend, knobs, seed):
    """The next forward is queued without waiting for the failed one; every rank of it runs nothing (the
    failed word on the device) and says so after the failure itself, oldest first."""
    P, H, I, E, k = 3, 128, 128, 12, 2
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(256, H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(P)]
    _, router, w1, w2 = make_inputs(1, H, I, E, "gelu", seed=seed + 1)
    w1s, w2s = list(w1.split(E // P)), list(w2.split(E // P))
    team = Team.emulated(P, max_tokens=256, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    knobs.silent_rank, knobs.timeout_ms = 2, 300
    flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)  # returns
    failed = flashdmoe.last_report()
    knobs.silent_rank, knobs.timeout_ms = -1, None
    flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)  # queued: no wait
    stopped = flashdmoe.last_report()
    assert not failed.ready(), "the second forward waited for the first (300 ms watchdog)"
    with pytest.raises(flashdmoe.KernelTimeout) as caught:
        flashdmoe.synchronize()
    segments = str(caught.value).split("; ")
    for r in range(P):
        assert len([s for s in segments if f"rank {r} timed out" in s]) == 1, str(caught.value)
    assert all("waiting on rank 2" in s for s in segments if "timed out" in s and "rank 2 timed" not in s)
    assert f"[launch {failed.launch_id} on" in str(caught.value)
    assert team.failed
    with pytest.raises(TeamFailed) as caught:
        flashdmoe.check_errors()
    for r in range(P):
        assert f"rank {r} ran nothing: its team's forward number 1 failed earlier" in str(caught.value)
    assert f"[launch {stopped.launch_id} on" in str(caught.value)
    assert [s.phase_ms for s in stopped.statuses] == [None] * P
    assert team.device_words.tolist() == [[2, 1]] * P
    with pytest.raises(TeamFailed):
        flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)


def test_a_teams_forwards_on_one_stream_queue_without_a_host_wait(backend, seed):
    """Back-to-back team forwards behind busy GPU work: the host returns from each before the first ran,
    and the results equal those of forwards with the GPU idle, bit for bit."""
    P, H, I, E, k = 4, 256, 256, 16, 2
    x, router, w1, w2 = make_inputs(512, H, I, E, "gelu", seed=seed)
    xs = [tokens_like(x[:128], seed + rank) for rank in range(P)]
    w1s, w2s = list(w1.split(E // P)), list(w2.split(E // P))
    team = Team.emulated(P, max_tokens=128, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    expected = [y.clone() for y in flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)]
    flashdmoe.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time ahead of the forwards
    outs, reports = [], []
    for _ in range(3):
        outs.append(flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team))
        reports.append(flashdmoe.last_report())
    waited = reports[0].ready()
    flashdmoe.synchronize()
    assert not waited, "a team forward waited on the host for the team's previous one"
    assert all(r.checked and r.error is None for r in reports) and team.device_words[:, 0].tolist() == [4] * P
    for ys in outs:
        assert all(torch.equal(y, e) for y, e in zip(ys, expected))


# ------------------------------------------------------------------------------------------------------------
# The sync words: reset by each launch's exit (finish_launch), zeroed by the pool only for a larger reach


def _sync_words(backend, stride, sync_bytes, ranks=1):
    """The pooled workspace's sync words of the current stream, per rank (after the device is idle)."""
    index = torch.cuda.current_device()
    buffer = backend._pool._buffers[(index, torch.cuda.current_stream().cuda_stream)]
    return buffer[:stride * ranks].view(ranks, stride)[:, :sync_bytes]


# Shapes whose sync words and scratch overlap one another's in one pooled workspace, so that a launch
# often reaches past the previous one's reset (more row tiles) or lands on its scratch.
CHANGING_SHAPES = [(1, 2048, 768, 128, 8, "swiglu"), (2048, 256, 256, 16, 2, "gelu"), (37, 512, 256, 64, 6, "swiglu"),
                   (4096, 256, 128, 8, 2, "gelu"), (5, 256, 256, 16, 2, "gelu"), (300, 1024, 512, 32, 4, "silu")]


def assert_matches_reference(y, routing, inputs, activation, what):
    """y against the float reference on the kernel's own routing (near-tie routing is
    tests/test_fused_gpu.py's concern)."""
    x, router, w1, w2 = inputs
    expected = reference.moe_fixed_routing(x.float(), router.float(), w1.float(), w2.float(), routing.expert.long(),
                                           routing.row >= 0, activation=activation, normalize_topk=True)
    assert_normwise_close(y.float(), expected, numerics.kernel_tolerance(x.dtype), what)


def test_a_pooled_workspace_serves_launches_of_changing_shapes(backend, seed):
    cases = []
    for T, H, I, E, k, activation in CHANGING_SHAPES:
        cases.append((make_inputs(T, H, I, E, activation, seed=next_seed()), k, activation))
    call = lambda inputs, k, activation: flashdmoe.moe(*inputs, top_k=k, activation=activation,  # noqa: E731
                                                       backend="cuda")
    first = []
    for inputs, k, activation in cases:
        y, routing = backend.fused_forward(*inputs, top_k=k, activation=activation, normalize_topk=True,
                                           capacity_factor=None)
        first.append(y)
        assert_matches_reference(y, routing, inputs, activation, f"T={inputs[0].shape[0]}")  # waits
    # Back to back on one stream, in other orders: every launch starts from what the previous one left.
    indices = list(range(len(cases)))
    for order in (indices[::-1], indices[1::2] + indices[::2], indices):
        again = [call(*cases[i]) for i in order]
        flashdmoe.synchronize()
        for i, y in zip(order, again):
            assert torch.equal(y, first[i]), f"T={cases[i][0][0].shape[0]}"


@pytest.mark.parametrize("phase", [1, 3, 5])
def test_sync_words_are_zero_after_launches_that_succeed_or_time_out(backend, knobs, phase, seed):
    x, router, w1, w2 = make_inputs(2048, 256, 256, 16, "gelu", seed=seed)
    good = flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    flashdmoe.synchronize()
    # The knobs change no layout: this plan's stride and sync words are the timed-out launch's too.
    plan = backend.single_plan(x, router, w2, top_k=2, activation="gelu", normalize_topk=True, capacity_factor=None)
    assert not _sync_words(backend, plan.stride, plan.sync_bytes).any()
    # A timeout leaves every counter mid-way; the exit resets them all the same.
    knobs.withhold_phase, knobs.timeout_ms = phase, 300
    flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    with pytest.raises(flashdmoe.KernelTimeout):
        flashdmoe.synchronize()
    knobs.withhold_phase, knobs.timeout_ms = 0, None
    assert not _sync_words(backend, plan.stride, plan.sync_bytes).any()
    # The next launches, of this shape and of another, on the same workspace.
    small = make_inputs(7, 512, 256, 64, "swiglu", seed=seed + 1)
    y_small, routing = backend.fused_forward(*small, top_k=6, activation="swiglu", normalize_topk=True,
                                             capacity_factor=None)
    again = flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    flashdmoe.synchronize()
    assert torch.equal(again, good)
    assert_matches_reference(y_small, routing, small, "swiglu", "after the timeout")


def emulated_problem(seed: int):
    """A 4-rank emulated team (one rank without tokens), its router and per-rank expert weights, each rank's
    token count and top_k."""
    P, H, I, E, k = 4, 256, 128, 16, 2
    _, router, w1, w2 = make_inputs(1, H, I, E, "gelu", seed=seed)
    team = Team.emulated(P, max_tokens=200, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    return team, router, list(w1.split(E // P)), list(w2.split(E // P)), [200, 0, 77, 129], k


def test_an_emulated_teams_sync_words_are_zero_after_its_launches(backend, seed):
    team, router, w1s, w2s, tokens, k = emulated_problem(seed)
    P, H = team.world_size, router.shape[1]
    xs = [tokens_like(torch.empty(T, H, device="cuda", dtype=torch.bfloat16), seed + r) for r, T in enumerate(tokens)]
    with torch.no_grad():
        first = flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)
        for _ in range(3):
            again = flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)
    flashdmoe.synchronize()
    for r in range(P):
        assert torch.equal(again[r], first[r]), f"rank {r}"
    (plan,) = team.launch_plans.values()
    assert not _sync_words(backend, plan.stride, plan.sync_bytes, ranks=P).any()


# ------------------------------------------------------------------------------------------------------------
# CUDA graphs


@pytest.mark.parametrize("T,H,I,E,k,activation", [(1, 2048, 768, 128, 8, "swiglu"), (300, 512, 256, 16, 2, "gelu"),
                                                  (2048, 1024, 512, 32, 4, "silu")])
def test_graph_replays_equal_eager_calls_bitwise(backend, T, H, I, E, k, activation, seed):
    x, router, w1, w2 = make_inputs(T, H, I, E, activation, seed=seed)
    static_x = x.clone()
    call = lambda inputs: flashdmoe.moe(inputs, router, w1, w2, top_k=k, activation=activation,  # noqa: E731
                                        capacity_factor=1.25, backend="cuda", return_aux=True)
    with torch.no_grad():
        graph, (y, aux) = capture(lambda: call(static_x))
        for step in range(1, 4):
            fresh = tokens_like(x, seed + step)
            static_x.copy_(fresh)
            graph.replay()
            want_y, want_aux = call(fresh)
            torch.cuda.synchronize()
            assert torch.equal(y, want_y), f"replay with input set {step} differs from the eager call"
            assert torch.equal(aux.counts, want_aux.counts) and torch.equal(aux.dropped, want_aux.dropped)
    flashdmoe.synchronize()  # every replay's status checked: none failed


def test_layer_graph_replays_equal_eager_calls_bitwise(backend, seed):
    config = flashdmoe.MoEConfig(hidden=512, ffn=256, experts=16, top_k=2, tokens_per_rank=64, dtype="bfloat16",
                                 activation="swiglu", seed=seed)
    layer = flashdmoe.MoELayer(config, device="cuda")
    layer.backend = "cuda"
    static_x = tokens_like(torch.empty(64, 512, device="cuda", dtype=torch.bfloat16), seed)
    with torch.no_grad():
        graph, y = capture(lambda: layer(static_x))
        for step in range(1, 4):
            fresh = tokens_like(static_x, seed + step)
            static_x.copy_(fresh)
            graph.replay()
            want = layer(fresh)
            torch.cuda.synchronize()
            assert torch.equal(y, want)
    flashdmoe.synchronize()


def test_emulated_team_graph_replays_equal_eager_calls_bitwise(backend, seed):
    team, router, w1s, w2s, tokens, k = emulated_problem(seed)
    P, H = team.world_size, router.shape[1]
    static_xs = [tokens_like(torch.empty(T, H, device="cuda", dtype=torch.bfloat16), seed + r)
                 for r, T in enumerate(tokens)]
    call = lambda xs: flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)  # noqa: E731
    with torch.no_grad():
        graph, ys = capture(lambda: call(static_xs))
        # Replays and eager calls interleaved: both take their sequence numbers from each rank's count on
        # the device, which each of them advances.
        for step in range(1, 4):
            fresh = [tokens_like(x, seed + 10 * step + r) for r, x in enumerate(static_xs)]
            for static, new in zip(static_xs, fresh):
                static.copy_(new)
            graph.replay()
            want = call(fresh)
            torch.cuda.synchronize()
            for r in range(P):
                assert torch.equal(ys[r], want[r]), f"rank {r}, input set {step}"
    flashdmoe.synchronize()
    assert not team.failed


def _replayed_kernels(graph, replays=2):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _kept_block(backend, plan):
    """The kept sync-word block the last captured launch took, as a uint8 view (flashdmoe.kernel.workspace_pool)."""
    from flashdmoe.kernel.workspace_pool import GraphSyncBlocks, graph_sync

    chunks, free_at, _ = graph_sync._devices[torch.cuda.current_device()]
    size = GraphSyncBlocks.block_bytes(plan.sync_bytes)
    address = free_at - size
    (chunk,) = [c for c in chunks if c.data_ptr() <= address < c.data_ptr() + c.numel()]
    return chunk[address - chunk.data_ptr():][:plan.sync_bytes]


def test_a_replay_runs_the_forward_alone_on_sync_words_it_leaves_zero(backend, knobs, seed, monkeypatch):
    """A captured forward takes kept sync words (no zeroing step in the graph): a replay is the one kernel,
    every replay's exit -- a timed-out one's too -- leaves them zero, and replays equal eager calls. With no
    kept block left the capture zeroes sync words of its own in the graph, with the same bits."""
    from flashdmoe.kernel import workspace_pool

    T, H, I, E, k = 4, 512, 256, 16, 2
    x, router, w1, w2 = make_inputs(T, H, I, E, "swiglu", seed=seed)
    static_x = x.clone()
    call = lambda: flashdmoe.moe(static_x, router, w1, w2, top_k=k, activation="swiglu", backend="cuda")  # noqa: E731
    plan = backend.single_plan(x, router, w2, top_k=k, activation="swiglu", normalize_topk=True,
                               capacity_factor=None)
    with torch.no_grad():
        kept, y = capture(call)
        block = _kept_block(backend, plan)
        names = _replayed_kernels(kept)
        assert len(names) == 2 and all("moe_forward_kernel" in n for n in names), names
        assert not block.any()
        want = call()
        torch.cuda.synchronize()
        assert torch.equal(y, want)

        knobs.withhold_phase, knobs.timeout_ms = 5, 200  # baked into the next capture (no eager warm-up)
        stuck = torch.cuda.CUDAGraph()
        with torch.cuda.graph(stuck):
            call()
        knobs.withhold_phase, knobs.timeout_ms = 0, None
        stuck_block = _kept_block(backend, plan)
        for _ in range(2):
            stuck.replay()
            with pytest.raises(flashdmoe.KernelTimeout, match="grid barrier before the combine"):
                flashdmoe.synchronize()
            assert not stuck_block.any(), "a timed-out replay leaves its sync words zero"

        monkeypatch.setattr(workspace_pool.graph_sync, "take", lambda device, nbytes: None)
        zeroing, y_zeroing = capture(call)
        names = _replayed_kernels(zeroing, replays=1)
        assert len(names) == 2 and "moe_forward_kernel" in names[-1], names
        for step in range(1, 3):
            static_x.copy_(tokens_like(x, seed + step))
            kept.replay()
            zeroing.replay()
            want = call()
            torch.cuda.synchronize()
            assert torch.equal(y, want) and torch.equal(y_zeroing, want), f"input set {step}"
    flashdmoe.synchronize()


def test_graph_replay_errors_surface_at_synchronize(backend, knobs, seed):
    x, router, w1, w2 = make_inputs(512, 256, 256, 16, "gelu", seed=seed)
    static_x = x.clone()
    call = lambda: flashdmoe.moe(static_x, router, w1, w2, top_k=2, backend="cuda")  # noqa: E731
    with torch.no_grad():
        healthy, _ = capture(call)
        healthy.replay()
        flashdmoe.synchronize()
        knobs.withhold_phase, knobs.timeout_ms = 5, 200  # baked into the next capture
        stuck = torch.cuda.CUDAGraph()
        with torch.cuda.graph(stuck):
            call()
        knobs.withhold_phase, knobs.timeout_ms = 0, None
        stuck.replay()
        with pytest.raises(flashdmoe.KernelTimeout, match="grid barrier before the combine.*a CUDA-graph replay of launch"):
            flashdmoe.synchronize()
        flashdmoe.synchronize()  # reported once
        static_x[0, 0] = float("nan")
        healthy.replay()
        with pytest.raises(ValueError, match="NaN or Inf"):
            flashdmoe.synchronize()
