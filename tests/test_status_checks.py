"""Launch reports and when the fused kernel's errors surface, on the CPU.

The decoding is checked on synthetic status blocks; the state machine of flashdmoe.kernel.status_checks runs
through the real cuda_backend.run_forward with the extension, its events and the CUDA stream calls
replaced by tests/fake_cuda.py (the test decides when a launch's event completes and what its status
block says). tests/test_async_status_gpu.py checks the same behaviour on the GPU.
"""

from __future__ import annotations

import re
import struct
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flashdmoe
from fake_cuda import STATUS_LAYOUT, FakeCompletion, completed_block, fake_cuda, run_team_words, status_block, timeout_word
from flashdmoe import api, cuda_backend
from flashdmoe.kernel import status_checks
from flashdmoe.kernel.launch_report import (FAILED_IN_BACKWARD, ErrorKind, KernelError, LaunchReport, LaunchShape,
                                             StatusLayout, decode_rank)
from flashdmoe.parallel.team import BufferPlan, RankBuffers, Team, TeamFailed

REPO = Path(__file__).resolve().parent.parent
LAYOUT = StatusLayout.from_mapping(STATUS_LAYOUT)
H, I, E, K = 64, 64, 8, 2


def inputs(tokens=16, experts=E, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    router = torch.randn(experts, H, generator=g).to(dtype)
    w1 = torch.randn(experts, H, I, generator=g).to(dtype)
    w2 = torch.randn(experts, I, H, generator=g).to(dtype)
    return x, router, w1, w2


def forward(x, router, w1, w2, **options):
    with torch.no_grad():
        return flashdmoe.moe(x, router, w1, w2, top_k=K, backend="cuda", **options)


def emulated_team(P=2, max_tokens=32):
    """An emulated team on CPU tensors (the fake extension never touches its buffers)."""
    plan = BufferPlan(P, max_tokens, H, K, E // P, torch.bfloat16)
    stride = -(-plan.signal_words // 32) * 32
    block = torch.full((P * stride,), 5, dtype=torch.int32)
    buffers = [RankBuffers(recv=torch.empty(plan.data_bytes, dtype=torch.uint8),
                           comb=torch.empty(plan.data_bytes, dtype=torch.uint8),
                           signals=block[r * stride:r * stride + plan.signal_words]) for r in range(P)]
    for own in buffers:
        own.peer_recv = [b.recv.data_ptr() for b in buffers]
        own.peer_comb = [b.comb.data_ptr() for b in buffers]
        own.peer_signals = [b.signals.data_ptr() for b in buffers]
    return Team("emulated", 0, P, plan, buffers, torch.device("cpu"))


def emulated_forward(team, tokens=(16, 16), seed=0):
    P = team.world_size
    x, router, w1, w2 = inputs(max(tokens), seed=seed)
    xs = [x[:t] for t in tokens]
    with torch.no_grad():
        return flashdmoe.moe_expert_parallel(xs, router, list(w1.split(E // P)), list(w2.split(E // P)), top_k=K,
                                             team=team)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(cuda_backend.debug, "timeout_ms", None)
    with fake_cuda(monkeypatch) as parts:
        yield parts


# ------------------------------------------------------------------------------------------------------------
# Decoding


def test_status_layout_of_the_fake_is_the_kernels():
    """tests/fake_cuda.py writes blocks at the offsets csrc/moe/params.cuh defines."""
    text = (REPO / "csrc" / "moe" / "params.cuh").read_text()
    names = {"kPhaseClockSlots": int(re.search(r"constexpr int kPhaseClockSlots = (\d+);", text).group(1))}
    for name, expression in re.findall(r"constexpr size_t (kStatus\w+) = ([^;]+);", text):
        names[name] = eval(expression, {}, dict(names))  # noqa: S307 -- integer arithmetic on earlier names
    assert {"bytes": names["kStatusBytes"], "error_word": names["kStatusErrorWord"],
            "phase_clock": names["kStatusPhaseClock"], "phase_clock_slots": names["kPhaseClockSlots"],
            "traffic": names["kStatusTraffic"], "nvshmem_traffic": names["kStatusNvshmemTraffic"],
            "status_flags": names["kStatusFlags"], "done_word": names["kStatusDone"]} == STATUS_LAYOUT


def test_every_phase_the_kernels_name_has_a_name_in_reports():
    """The ids of the kernels' Phase enums (csrc/moe/params.cuh, csrc/backward/fused_params.cuh,
    csrc/backward/ep_rows.cuh) and flashdmoe.kernel.launch_report.PHASE_NAMES are the same set."""
    from flashdmoe.kernel.launch_report import PHASE_NAMES

    ids = {}
    for path in ("moe/params.cuh", "backward/fused_params.cuh", "backward/ep_rows.cuh"):
        for name, value in re.findall(r"^\s*(kPhase\w+) = (\d+),", (REPO / "csrc" / path).read_text(), re.M):
            assert int(value) not in ids, f"{name} reuses phase {value} of {ids.get(int(value))}"
            ids[int(value)] = name
    assert len(ids) >= 26, f"the enums were not found: {sorted(ids)}"
    assert set(ids) == set(PHASE_NAMES), f"named only in the kernels: {sorted(set(ids) - set(PHASE_NAMES))}; " \
                                         f"only in reports: {sorted(set(PHASE_NAMES) - set(ids))}"


def test_decode_a_clean_block():
    raw = status_block(clock=(1_000_000, 3_000_000, 3_500_000, 6_000_000, 16_000_000, 17_000_000), traffic=(4096, 2048),
                       nvshmem_traffic=(1024, 512))
    status = decode_rank(raw, 0, LAYOUT, rank=3)
    assert status.rank == 3 and status.error is None and not status.nonfinite_logits
    assert status.phase_ms == {"gate": 2.0, "offsets": 0.5, "dispatch": 2.5, "experts": 10.0, "combine": 1.0}
    assert (status.dispatch_bytes, status.combine_bytes) == (4096, 2048)
    assert (status.nvshmem_dispatch_bytes, status.nvshmem_combine_bytes) == (1024, 512)


def test_decode_an_error_word_into_fields():
    word = timeout_word(phase=7, peer=2, block=131)
    status = decode_rank(status_block(error=word, clock=(5, 6, 0, 0, 0, 0)), 0, LAYOUT, rank=1)
    error = status.error
    assert (error.rank, error.kind, error.phase, error.peer, error.block) == (1, ErrorKind.TIMEOUT, 7, 2, 131)
    assert error.timed_out and status.phase_ms is None
    assert error.describe() == ("rank 1 timed out in the expert GEMM1 tile waiting for a peer's dispatched rows "
                                "(waiting on rank 2; first seen by block 131)")
    other = KernelError.from_word(0, 0x7 | (3 << 8))
    assert not other.timed_out and other.describe() == "rank 0 reported error word 0x307"
    used_up = KernelError.from_word(2, int(ErrorKind.SEQUENCE))
    assert not used_up.timed_out and "rank 2: the team's forwards used up" in used_up.describe()


def report_of(blocks, ranks=None, captured=False, timeout_ms=300):
    ranks = ranks or tuple(range(len(blocks)))
    shape = LaunchShape(ranks=ranks, tokens=(16,) * len(ranks), local_experts=4, row_bytes=128, timeout_ms=timeout_ms)
    source = memoryview(bytearray(b"".join(blocks)))
    return LaunchReport(shape, 9, 0, (132, 1, 1000), LAYOUT, source, None, None, captured, None, [])


def test_exception_type_comes_from_the_error_kind_not_the_text():
    report = report_of([status_block(), status_block(error=timeout_word(8, 0))])
    error = report.exception()
    assert type(error) is flashdmoe.KernelTimeout
    assert str(error).startswith("flashdmoe kernel: rank 1 timed out in the combine waiting for a peer's expert "
                                 "results (waiting on rank 0; first seen by block 3); timeout 300 ms")
    assert "launch 9 on cuda:0" in str(error)
    unknown = report_of([status_block(error=0x5 | (8 << 8))]).exception()
    assert type(unknown) is RuntimeError and "error word 0x805" in str(unknown)
    # A timeout on one rank makes the launch a KernelTimeout even beside an unknown kind on another.
    mixed = report_of([status_block(error=0x5), status_block(error=timeout_word(1, 1))]).exception()
    assert type(mixed) is flashdmoe.KernelTimeout


def test_non_finite_logits_are_a_value_error_naming_the_ranks():
    assert report_of([status_block()]).exception() is None
    one = report_of([status_block(flags=1)]).exception()
    assert type(one) is ValueError and str(one).startswith("x or router_weight: expected finite values")
    two = report_of([status_block(), status_block(flags=1), status_block(flags=1)]).exception()
    assert "x or router_weight (rank 1, 2):" in str(two)


def test_captured_report_reads_its_slot_live_and_clears_once():
    report = report_of([status_block()], captured=True)
    assert report.exception() is None and report.phase_ms is not None
    report._source[:] = status_block(error=timeout_word(3, 0))  # a replay wrote a timeout
    assert report.error.phase == 3 and isinstance(report.exception(), flashdmoe.KernelTimeout)
    report.clear_captured_status()
    assert report.exception() is None
    with pytest.raises(RuntimeError, match="does not keep its routing"):
        report.routing


# ------------------------------------------------------------------------------------------------------------
# A launch's completion: the words its kernel sets in the status slot


def slot_of(ranks):
    layout = StatusLayout.from_mapping(STATUS_LAYOUT)
    memory = bytearray(status_checks.SLOT_RANKS * layout.bytes)
    home = []
    slot = status_checks._Slot(0, memoryview(memory), lambda: home.append(slot), 0, layout)
    slot.ranks = ranks
    return slot, memory, home, layout


def set_done(memory, layout, rank):
    struct.pack_into("<I", memory, rank * layout.bytes + layout.done_word, 1)


def test_a_slot_is_done_when_every_rank_of_its_launch_set_its_word():
    slot, memory, home, layout = slot_of(3)
    assert not slot.query()
    set_done(memory, layout, 0)
    set_done(memory, layout, 2)
    assert not slot.query(), "rank 1 has not finished"
    set_done(memory, layout, 1)
    assert slot.query()
    slot.give_back()
    assert home == [slot] and not slot.query(), "handing the slot back clears the words for its next launch"
    assert not any(memory), "and only them (the other bytes were zero)"


def test_a_wait_polls_the_words_before_it_waits_for_the_device(monkeypatch):
    slot, memory, _, layout = slot_of(1)
    synchronized = []
    monkeypatch.setattr(status_checks, "_synchronize_device", synchronized.append)
    monkeypatch.setattr(status_checks, "WAIT_POLL_S", 5.0)
    finisher = threading.Timer(0.02, set_done, (memory, layout, 0))  # the kernel, 20 ms later
    finisher.start()
    slot.synchronize()
    finisher.join()
    assert slot.query() and synchronized == [], "seen done while polling: the device was not synchronised"


def test_a_wait_that_outlasts_the_poll_waits_for_the_device_and_reports_a_launch_that_never_finished(monkeypatch):
    slot, memory, _, layout = slot_of(2)
    monkeypatch.setattr(status_checks, "WAIT_POLL_S", 0.005)
    synchronized = []

    def device_idle(device):  # the device drained; rank 0's last block wrote its word, rank 1's never ran
        synchronized.append(device)
        set_done(memory, layout, 0)

    monkeypatch.setattr(status_checks, "_synchronize_device", device_idle)
    with pytest.raises(RuntimeError, match="never marked its status slot complete"):
        slot.synchronize()
    assert synchronized == [0]
    set_done(memory, layout, 1)
    slot.synchronize()  # done: no second device wait
    assert synchronized == [0]


# ------------------------------------------------------------------------------------------------------------
# When errors surface (fake extension)


def test_forward_does_not_wait_and_the_report_decodes_later(fake):
    ext, events, synchronized = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    report = flashdmoe.last_report()
    assert not report.ready() and not report.checked and synchronized == []
    assert report.grid == 132 and report.ranks == (0,) and report.tokens == (16,)
    flashdmoe.check_errors()  # still running: nothing to check, nothing waited for
    assert not report.checked and synchronized == []
    ext.launches[0]["completion"].done = True
    flashdmoe.check_errors()
    assert report.checked and report.error is None
    assert report.phase_ms == {"gate": 0.001, "offsets": 0.0015, "dispatch": 0.0025, "experts": 0.004,
                               "combine": 0.0005}


def test_timeout_surfaces_at_the_next_call_once_finished(fake):
    ext, events, _ = fake
    x, router, w1, w2 = inputs()
    ext.script.append([status_block(error=timeout_word(2, 0))])
    forward(x, router, w1, w2)
    first = ext.launches[0]["completion"]
    forward(x, router, w1, w2)  # the first launch is still running: no error yet, the second launches
    assert len(ext.launches) == 2
    first.done = True
    with pytest.raises(flashdmoe.KernelTimeout, match=r"per-expert offsets .*\[launch 1 on"):
        forward(x, router, w1, w2)
    assert len(ext.launches) == 2, "the call that raised launched nothing"
    ext.launches[1]["completion"].done = True
    forward(x, router, w1, w2)  # raised once; the second launch was fine
    assert len(ext.launches) == 3


def test_check_errors_raises_each_error_once(fake):
    ext, _, _ = fake
    x, router, w1, w2 = inputs()
    ext.script.append([status_block(flags=1)])
    forward(x, router, w1, w2)
    ext.launches[0]["completion"].done = True
    with pytest.raises(ValueError, match="NaN or Inf"):
        flashdmoe.check_errors()
    flashdmoe.check_errors()


def test_synchronize_waits_for_the_device_and_raises(fake):
    ext, _, synchronized = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    ext.script.append([status_block(error=timeout_word(5, 0))])
    forward(x, router, w1, w2)
    with pytest.raises(flashdmoe.KernelTimeout, match="grid barrier before the combine"):
        flashdmoe.synchronize()
    assert synchronized == [None]  # the device of the launches (None: these CPU stand-ins)
    flashdmoe.synchronize()


def test_sync_checks_raise_at_the_call(fake, monkeypatch):
    ext, _, _ = fake
    x, router, w1, w2 = inputs()
    assert flashdmoe.set_sync_checks(True) is False
    ext.script.append([status_block(error=timeout_word(1, 0))])
    with pytest.raises(flashdmoe.KernelTimeout, match="grid barrier after the gate"):
        forward(x, router, w1, w2)
    forward(x, router, w1, w2)
    assert flashdmoe.last_report().checked
    assert flashdmoe.set_sync_checks(False) is True
    with pytest.raises(ValueError, match="expected True or False"):
        flashdmoe.set_sync_checks(1)
    monkeypatch.setenv("FLASHDMOE_SYNC_CHECKS", "1")
    assert status_checks._State().sync_checks
    monkeypatch.setenv("FLASHDMOE_SYNC_CHECKS", "0")
    assert not status_checks._State().sync_checks


def test_a_deep_queue_waits_for_its_oldest_launch(fake):
    ext, _, synchronized = fake
    x, router, w1, w2 = inputs()
    for _ in range(status_checks.EAGER_SLOTS):
        forward(x, router, w1, w2)
    assert synchronized == []
    forward(x, router, w1, w2)  # every slot taken: the oldest launch is waited for and its slot reused
    assert synchronized == [None] and ext.launches[0]["completion"].done
    assert ext.launches[-1]["status_host"] == ext.launches[0]["status_host"]
    assert not flashdmoe.last_report().ready(), "the reused slot's completion word was cleared"


def test_status_slots_are_not_reused_before_their_bytes_are_kept(fake):
    ext, _, _ = fake
    x, router, w1, w2 = inputs()
    ext.script.append([status_block(traffic=(11, 22))])
    forward(x, router, w1, w2)
    first = flashdmoe.last_report()
    flashdmoe.synchronize()
    forward(x, router, w1, w2)  # may take the first launch's slot: the first report kept its bytes
    flashdmoe.synchronize()
    assert (first.statuses[0].dispatch_bytes, first.statuses[0].combine_bytes) == (11, 22)


def test_a_teams_next_forward_on_the_same_stream_does_not_wait_for_its_last(fake):
    """The device keeps the order safe (a rank's launch after a failed forward runs nothing and says so):
    the host queues the next forward at once, and the errors surface oldest first at the next check."""
    ext, _, synchronized = fake
    team = emulated_team()
    ext.script.append([status_block(), status_block(error=timeout_word(6, 0))])
    emulated_forward(team)
    first = ext.launches[0]["completion"]
    assert not first.done and team.unchecked_launch is flashdmoe.last_report()
    emulated_forward(team)  # not finished yet: queued behind it all the same
    assert synchronized == [] and len(ext.launches) == 2 and not first.done and not team.failed
    assert team.device_words.tolist() == [[2, 0], [2, 1]], "rank 1's forward 1 failed"
    with pytest.raises(flashdmoe.KernelTimeout,
                       match=r"rank 1 timed out in the wait for a peer's per-expert row counts.*\[launch 1 on"):
        flashdmoe.synchronize()
    assert team.failed
    with pytest.raises(TeamFailed, match=r"rank 1 ran nothing: its team's forward number 1 failed earlier.*\[launch 2 on"):
        flashdmoe.check_errors()
    flashdmoe.check_errors()  # each raised once
    with pytest.raises(TeamFailed, match="failed earlier"):
        emulated_forward(team)
    with pytest.raises(TeamFailed):
        team.barrier()


def test_a_teams_other_uses_wait_for_its_launches_oldest_first(fake):
    """Team.barrier (as the backward) waits for the team's last launch and raises the first failure, not
    the "ran nothing" of the launch the device stopped after it."""
    ext, _, synchronized = fake
    team = emulated_team()
    ext.script.append([status_block(error=timeout_word(8, 1)), status_block()])
    emulated_forward(team)
    emulated_forward(team)
    with pytest.raises(flashdmoe.KernelTimeout, match=r"rank 0 timed out.*\[launch 1 on"):
        team.barrier()
    assert synchronized == [None] and team.failed and team.unchecked_launch is not None
    with pytest.raises(TeamFailed, match=r"rank 0 ran nothing.*\[launch 2 on"):
        flashdmoe.check_errors()
    assert team.unchecked_launch is None


def test_a_teams_forward_on_another_stream_waits_for_its_last_launch(fake, monkeypatch):
    """Stream order is what the device words rely on: on another stream the host waits, as before."""
    ext, _, synchronized = fake
    team = emulated_team()
    ext.script.append([status_block(), status_block(error=timeout_word(6, 0))])
    emulated_forward(team)
    monkeypatch.setattr(cuda_backend, "_current_stream_handle", lambda index: 8)
    with pytest.raises(flashdmoe.KernelTimeout, match="rank 1 timed out"):
        emulated_forward(team)
    assert synchronized == [None] and team.failed and len(ext.launches) == 1


def test_team_barrier_checks_the_last_launch(fake):
    ext, _, _ = fake
    team = emulated_team()
    ext.script.append([status_block(error=timeout_word(8, 1)), status_block()])
    emulated_forward(team)
    with pytest.raises(flashdmoe.KernelTimeout):
        team.barrier()
    assert team.failed


def test_non_finite_input_on_a_team_does_not_fail_it(fake):
    ext, _, _ = fake
    team = emulated_team()
    ext.script.append([status_block(), status_block(flags=1)])
    emulated_forward(team)
    with pytest.raises(ValueError, match=r"x or router_weight \(rank 1\)"):
        flashdmoe.synchronize()
    assert not team.failed
    emulated_forward(team)


def nvshmem_rank(team):
    """Rank 0 of ``team`` as one process of an NVSHMEM team would drive it (the fake never touches peers)."""
    team.transport = "nvshmem"
    team.buffers = team.buffers[:1]
    return team


def test_an_nvshmem_rank_launches_before_raising_an_earlier_error(fake):
    """Raising first would leave the peers waiting for this rank's signals: launch, then raise."""
    ext, _, _ = fake
    team = nvshmem_rank(emulated_team(P=2))
    x, router, w1, w2 = inputs()
    ext.script.append([status_block(flags=1)])
    forward(x, router, w1, w2)  # one rank, NaN input
    ext.launches[0]["completion"].done = True
    with pytest.raises(ValueError, match="NaN or Inf"):
        forward(x, router, w1[:4], w2[:4], team=team)
    assert len(ext.launches) == 2 and ext.launches[1]["sequence"] == 1 and not team.failed
    forward(x, router, w1[:4], w2[:4], team=team)
    assert [launch["sequence"] for launch in ext.launches[1:]] == [1, 2]


def test_emulated_launch_sequence_numbers_and_report(fake):
    ext, _, _ = fake
    team = emulated_team(P=2)
    ext.script.append([status_block(traffic=(128 * 3, 128 * 3)), status_block(traffic=(0, 0))])
    emulated_forward(team, tokens=(16, 5))
    emulated_forward(team, tokens=(16, 5))
    assert [launch["sequence"] for launch in ext.launches] == [1, 2]
    report = flashdmoe.last_report()
    flashdmoe.synchronize()
    assert report.ranks == (0, 1) and report.tokens == (16, 5)
    # Both ranks' workspaces at one pitch in one buffer.
    first, second = ext.launches[-1]["workspace"]
    assert second - first == ext.prepared[-1][1][0]["workspace_bytes"] > 0
    assert len(ext.prepared) == 1, "the launch was prepared once for both forwards"


def test_launch_failure_returns_the_slot_and_fails_the_team(fake):
    ext, _, _ = fake
    team = emulated_team()
    ext.fail_launch = RuntimeError("launching moe_forward_kernel: too many resources requested")
    free = status_checks._state.devices.get(None).eager_free() if status_checks._state.devices else None
    with pytest.raises(RuntimeError, match="too many resources"):
        emulated_forward(team)
    assert team.failed and "launch failed" in team._failure
    assert status_checks._state.devices[None].eager_free() == (free or status_checks.EAGER_SLOTS)


def test_one_rank_launch_failure_returns_the_slot_and_records_nothing(fake):
    """The remembered call's launch (cuda_backend.launch_one) raises the extension's error, hands its status
    slot back and leaves no report; the next call launches normally."""
    ext, _, _ = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    flashdmoe.synchronize()
    before = flashdmoe.last_report()
    free = status_checks._state.devices[None].eager_free()
    ext.fail_launch = RuntimeError("launching moe_forward_kernel: unspecified launch failure")
    with pytest.raises(RuntimeError, match="unspecified launch failure"):
        forward(x, router, w1, w2)
    assert status_checks._state.devices[None].eager_free() == free
    assert flashdmoe.last_report() is before and not status_checks._state.pending
    ext.fail_launch = None
    forward(x, router, w1, w2)
    assert flashdmoe.last_report().launch_id == before.launch_id + 1
    flashdmoe.synchronize()


def test_shape_errors_are_value_errors_and_not_cached(fake):
    ext, _, _ = fake
    x, router, w1, w2 = inputs()
    ext.shape_error = "hidden size H=64 must be a positive multiple of 128 for the fused kernel"
    with pytest.raises(ValueError, match="H=64 must be"):
        forward(x, router, w1, w2)
    assert not ext.prepared
    ext.shape_error = ""
    cuda_backend._check_shapes.cache_clear()  # the rules of one extension never change; this fake's did
    forward(x, router, w1, w2)
    forward(x, router, w1, w2)
    assert len(ext.prepared) == 1
    cuda_backend.debug.max_blocks = 8
    try:
        forward(x, router, w1, w2)
    finally:
        cuda_backend.debug.max_blocks = 0
    assert len(ext.prepared) == 2 and ext.prepared[-1][0]["max_blocks"] == 8


def test_workspaces_are_pooled_per_stream(fake, monkeypatch):
    ext, _, _ = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    forward(x, router, w1, w2)
    assert ext.launches[0]["workspace"] == ext.launches[1]["workspace"]
    monkeypatch.setattr(cuda_backend, "_current_stream_handle", lambda index: 8)
    forward(x, router, w1, w2)
    assert ext.launches[2]["workspace"] != ext.launches[0]["workspace"]
    assert cuda_backend.workspace_bytes_held() >= 2 * ext.prepared[0][1][0]["workspace_bytes"]


def test_pool_zeroes_sync_words_only_when_a_launch_reaches_past_the_last_reset():
    """The kernel's exit resets only its own sync words; the rest of its share was scratch. The pool
    zeroes what a launch needs that the previous launch on the buffer did not reset, and nothing in a
    steady loop."""
    from flashdmoe.kernel.workspace_pool import WorkspacePool

    pool = WorkspacePool()
    device = torch.device("cpu")
    buffer_of = lambda: pool._buffers[(None, 5)]  # noqa: E731  (CPU tensors: device.index is None)

    def scratch_after_launch(stride, sync, ranks):
        # What a launch leaves: its sync words reset by its exit, everything else of its shares written.
        shares = buffer_of()[:stride * ranks].view(ranks, stride)
        shares[:, sync:] = 0xAB
        shares[:, :sync] = 0

    address = pool.address(device, None, 5, stride=4096, sync_bytes=512)
    assert address == buffer_of().data_ptr() and not buffer_of().any()  # allocated zeroed
    scratch_after_launch(4096, 512, 1)
    zero_calls = []
    real_zero = torch.Tensor.zero_
    try:
        torch.Tensor.zero_ = lambda self: zero_calls.append(self.shape) or real_zero(self)
        pool.address(device, None, 5, stride=4096, sync_bytes=512)  # the same shape: nothing to do
        pool.address(device, None, 5, stride=4096, sync_bytes=256)  # fewer sync words: still zero
        assert zero_calls == []
        pool.address(device, None, 5, stride=4096, sync_bytes=1024)  # past the last reset: zeroed
        assert len(zero_calls) == 1
        assert not buffer_of()[:1024].any()
        scratch_after_launch(4096, 1024, 1)
        pool.address(device, None, 5, stride=2048, sync_bytes=512, ranks=2)  # another stride, two ranks
        assert len(zero_calls) == 2
        shares = buffer_of()[:4096].view(2, 2048)
        assert not shares[:, :512].any() and shares[1, 1024:].eq(0xAB).all()  # only the sync words
        scratch_after_launch(2048, 512, 2)
        pool.address(device, None, 5, stride=2048, sync_bytes=512, ranks=1)
        assert len(zero_calls) == 2
        scratch_after_launch(2048, 512, 1)
        pool.address(device, None, 5, stride=1024, sync_bytes=512, ranks=1)  # one rank's words start the buffer
        assert len(zero_calls) == 2
        scratch_after_launch(1024, 512, 1)
        pool.address(device, None, 5, stride=1024, sync_bytes=512, ranks=2)  # a second share: zeroed
        assert len(zero_calls) == 3 and not buffer_of()[1024:1536].any()
    finally:
        torch.Tensor.zero_ = real_zero


def test_traffic_is_computed_on_request_from_the_routing(fake):
    ext, _, _ = fake
    team = emulated_team(P=2)
    ext.script.append([status_block(traffic=(3 * 128, 3 * 128), nvshmem_traffic=(2 * 128, 128)),
                       status_block(traffic=(0, 0))])
    emulated_forward(team, tokens=(4, 2))
    report = flashdmoe.last_report()
    flashdmoe.synchronize()
    # The fake writes no routing: set one by hand (rank 0 keeps 3 choices of rank 1's experts 4..7).
    r0, r1 = report.routing
    r0.expert.copy_(torch.tensor([[0, 4], [5, 1], [6, 2], [7, 3]], dtype=torch.int32))
    r0.row.copy_(torch.tensor([[0, 0], [1, 1], [2, -1], [-1, 2]], dtype=torch.int32))
    r1.expert.copy_(torch.tensor([[4, 5], [6, 7]], dtype=torch.int32))
    r1.row.fill_(0)
    assert report.traffic() == [
        {"rank": 0, "dispatch_bytes": 384, "combine_bytes": 384, "nvshmem_dispatch_bytes": 256,
         "nvshmem_combine_bytes": 128, "rows_routed_remote": 3, "payload_efficiency": 1.0},
        {"rank": 1, "dispatch_bytes": 0, "combine_bytes": 0, "nvshmem_dispatch_bytes": 0, "nvshmem_combine_bytes": 0,
         "rows_routed_remote": 0, "payload_efficiency": None},
    ]


# ------------------------------------------------------------------------------------------------------------
# CUDA-graph capture (fake: capture is a flag)


def test_capture_before_any_eager_forward_is_refused(monkeypatch):
    capturing = {"on": True}
    with fake_cuda(monkeypatch, capturing=lambda: capturing["on"]):
        x, router, w1, w2 = inputs()
        with pytest.raises(RuntimeError, match="run one forward eagerly first"):
            forward(x, router, w1, w2)


def test_captured_launch_has_its_own_slot_and_workspace_and_surfaces_at_synchronize(monkeypatch):
    capturing = {"on": False}
    with fake_cuda(monkeypatch, capturing=lambda: capturing["on"]) as (ext, _, synchronized):
        x, router, w1, w2 = inputs()
        forward(x, router, w1, w2)
        eager = flashdmoe.last_report()
        ext.launches[0]["completion"].done = True
        capturing["on"] = True
        forward(x, router, w1, w2)
        captured = flashdmoe.last_report()
        capturing["on"] = False
        assert captured.captured and not eager.checked, "nothing is checked inside a capture"
        launch = ext.launches[-1]
        assert launch["status_host"] != ext.launches[0]["status_host"]
        assert launch["workspace"] != ext.launches[0]["workspace"], "a capture never takes the pooled workspace"
        flashdmoe.synchronize()  # the capture itself left a clean block (no replay yet): nothing raised
        assert eager.checked
        captured._source[:] = status_block(error=timeout_word(4, 0))  # what a failing replay copies back
        with pytest.raises(flashdmoe.KernelTimeout, match="a CUDA-graph replay of launch 2"):
            flashdmoe.synchronize()
        flashdmoe.synchronize()  # reported once
        flashdmoe.check_errors()


def kept_sync_blocks(monkeypatch, chunk_bytes):
    """The process's GraphSyncBlocks emptied and given ``chunk_bytes`` chunks (CPU memory for the fake)."""
    from flashdmoe.kernel import workspace_pool

    blocks = workspace_pool.graph_sync
    monkeypatch.setattr(blocks, "_devices", {})
    monkeypatch.setattr(blocks, "chunk_bytes", chunk_bytes)
    monkeypatch.setattr(blocks, "reserve_bytes", chunk_bytes)
    return blocks


def test_captured_launches_take_kept_sync_words_until_none_are_left(monkeypatch):
    """A captured launch's sync words come from a block kept for the graph (never one handed out before),
    the launch's scratch from the graph's pool; with no block left the capture takes sync words of its own
    from the graph's pool, zeroed inside the graph (never the pooled workspace's, address 0)."""
    capturing = {"on": False}
    with fake_cuda(monkeypatch, capturing=lambda: capturing["on"]) as (ext, _, _):
        x, router, w1, w2 = inputs()
        forward(x, router, w1, w2)
        (plan,) = cuda_backend._single_plans.values()  # fake_cuda starts with none
        assert ext.launches[-1]["sync"] == [0], "an eager launch's sync words lead its pooled workspace"
        size = -(-plan.sync_bytes // 256) * 256
        blocks = kept_sync_blocks(monkeypatch, 2 * size)
        blocks.reserve(x.device)
        chunk = blocks._devices[-1][0][0]
        flashdmoe.synchronize()
        capturing["on"] = True
        for _ in range(3):
            forward(x, router, w1, w2)
        capturing["on"] = False
        kept = [launch["sync"][0] for launch in ext.launches[-3:]]
        assert kept[:2] == [chunk.data_ptr(), chunk.data_ptr() + size]
        assert kept[2] != 0 and not chunk.data_ptr() <= kept[2] < chunk.data_ptr() + chunk.numel(), kept
        assert all(launch["workspace"][0] != ext.launches[0]["workspace"][0] for launch in ext.launches[-3:])
        blocks.reserve(x.device)  # a new chunk once the last one is spent (outside a capture)
        assert len(blocks._devices[-1][0]) == 2 and blocks.take(x.device, 1) == blocks._devices[-1][0][1].data_ptr()
        flashdmoe.synchronize()


def test_captured_team_ranks_take_one_kept_block_each(monkeypatch):
    capturing = {"on": False}
    with fake_cuda(monkeypatch, capturing=lambda: capturing["on"]) as (ext, _, _):
        team = emulated_team(P=4)
        emulated_forward(team, tokens=(16, 5, 9, 1))
        flashdmoe.synchronize()
        (plan,) = team.launch_plans.values()
        size = -(-plan.sync_bytes // 256) * 256
        blocks = kept_sync_blocks(monkeypatch, 8 * size)
        blocks.reserve(team.device)
        capturing["on"] = True
        emulated_forward(team, tokens=(16, 5, 9, 1))
        capturing["on"] = False
        first = blocks._devices[-1][0][0].data_ptr()
        assert ext.launches[-1]["sync"] == [first + i * size for i in range(4)]
        flashdmoe.synchronize()


def test_graph_sync_blocks_are_aligned_never_shared_and_bounded():
    from flashdmoe.kernel.workspace_pool import GraphSyncBlocks

    cpu = torch.device("cpu")
    blocks = GraphSyncBlocks(chunk_bytes=4096, reserve_bytes=1024, limit_bytes=8192)
    assert blocks.take(cpu, 100) is None, "nothing before a reserve"
    blocks.reserve(cpu)
    (chunk,) = blocks._devices[-1][0]
    assert chunk.dtype == torch.uint8 and int(chunk.count_nonzero()) == 0
    taken = [blocks.take(cpu, n) for n in (1, 256, 257, 1000)]
    assert taken == [chunk.data_ptr() + o for o in (0, 256, 512, 1024)]
    assert blocks.take(cpu, 3000) is None, "2048 bytes left"
    blocks.reserve(cpu)  # 2048 free >= 1024: nothing new
    assert blocks.held_bytes(cpu) == 4096
    assert blocks.take(cpu, 1536) == chunk.data_ptr() + 2048
    blocks.reserve(cpu)  # 512 free: a second chunk, the limit's last
    blocks.take(cpu, 4096)
    blocks.reserve(cpu)
    assert blocks.held_bytes(cpu) == 8192 and blocks.take(cpu, 1) is None, "the limit holds"


def test_a_team_launch_takes_its_sequence_numbers_from_the_device_count(fake):
    """Every rank of a team launch names its own device words (count, failed forward); the host passes
    no sequence number."""
    ext, _, _ = fake
    team = emulated_team(P=4)
    emulated_forward(team, tokens=(16, 5, 9, 1))
    emulated_forward(team, tokens=(16, 5, 9, 1))
    _, ranks = ext.prepared[-1]
    words = team.device_words
    assert words.dtype == torch.int32 and words.device == team.device and words.shape == (4, 2)
    assert [r["team_words"] for r in ranks] == [words.data_ptr() + 8 * i for i in range(4)]
    assert [launch["sequence"] for launch in ext.launches] == [1, 2] and words.tolist() == [[2, 0]] * 4
    assert Team.single().device_words is None


def test_capture_of_an_emulated_team_leaves_its_signals_and_count_to_the_device(monkeypatch):
    """A captured launch clears nothing: its replays take their sequence numbers from the device count,
    which eager forwards before and after share."""
    capturing = {"on": False}
    with fake_cuda(monkeypatch, capturing=lambda: capturing["on"]) as (ext, _, _):
        team = emulated_team()
        emulated_forward(team)
        assert int(team.buffers[0].signals[0]) == 5
        capturing["on"] = True
        with pytest.raises(RuntimeError, match="call flashdmoe.synchronize\\(\\) before capturing"):
            emulated_forward(team)
        capturing["on"] = False
        flashdmoe.synchronize()
        capturing["on"] = True
        emulated_forward(team)
        capturing["on"] = False
        assert int(team.buffers[0].signals[0]) == 5, "no signal word cleared"
        assert [launch["sequence"] for launch in ext.launches] == [1, None]
        assert all(r["team_words"] == team.device_words.data_ptr() + 8 * i
                   for i, r in enumerate(ext.prepared[-1][1]))
        assert team.unchecked_launch is None, "a captured launch is checked at synchronize, not at the team's use"
        emulated_forward(team)
        assert ext.launches[-1]["sequence"] == 2


def test_capture_of_an_nvshmem_team_takes_the_device_count(monkeypatch):
    capturing = {"on": False}
    with fake_cuda(monkeypatch, capturing=lambda: capturing["on"]) as (ext, _, _):
        team = nvshmem_rank(emulated_team(P=2))
        x, router, w1, w2 = inputs()
        with torch.no_grad():
            flashdmoe.moe(x, router, w1[:4], w2[:4], top_k=K, backend="cuda", team=team)
            flashdmoe.synchronize()
            capturing["on"] = True
            flashdmoe.moe(x, router, w1[:4], w2[:4], top_k=K, backend="cuda", team=team)
            capturing["on"] = False
            flashdmoe.moe(x, router, w1[:4], w2[:4], top_k=K, backend="cuda", team=team)
        assert [launch["sequence"] for launch in ext.launches] == [1, None, 2]
        assert ext.prepared[-1][1][0]["team_words"] == team.device_words.data_ptr()
        flashdmoe.synchronize()
        assert not team.failed


def test_used_up_sequence_numbers_fail_the_team(fake):
    """The kernel's error word for a used-up count (it ran nothing): RuntimeError naming it, team failed."""
    ext, _, _ = fake
    team = emulated_team(P=2)
    word = int(ErrorKind.SEQUENCE)
    ext.script.append([status_block(error=word), status_block(error=word)])
    emulated_forward(team)
    with pytest.raises(RuntimeError, match="used up their 2\\^31 - 1 sequence numbers") as caught:
        flashdmoe.synchronize()
    assert "FLASHDMOE_TIMEOUT_MS" not in str(caught.value) and not isinstance(caught.value, flashdmoe.KernelTimeout)
    assert team.failed


# ------------------------------------------------------------------------------------------------------------
# Host path


def test_validation_is_remembered_for_device_tensors_only(monkeypatch):
    calls = []
    real = api.validate_moe_inputs

    def counting(*args, **kwargs):
        calls.append(args[0].device.type)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "validate_moe_inputs", counting)
    api._validated.clear()
    meta = [torch.empty(s, device="meta") for s in ((4, H), (E, H), (E, H, I), (E, I, H))]
    for _ in range(3):
        api._validate(*meta, top_k=2, activation="gelu", capacity_factor=None, world_size=1)
    assert calls == ["meta"]
    with pytest.raises(ValueError, match="top_k=True"):
        api._validate(*meta, top_k=True, activation="gelu", capacity_factor=None, world_size=1)
    with pytest.raises(ValueError, match="not contiguous"):
        api._validate(meta[0], meta[1], meta[2].transpose(1, 2), meta[3], top_k=2, activation="gelu",
                      capacity_factor=None, world_size=1)
    cpu = inputs(4)
    for _ in range(2):
        api._validate(*cpu, top_k=2, activation="gelu", capacity_factor=None, world_size=1)
    assert calls.count("cpu") == 2, "CPU tensors are scanned for NaN at every call"


def test_inference_forward_builds_no_autograd_node(fake):
    x, router, w1, w2 = inputs()
    y = forward(x, router, w1, w2)
    assert y.grad_fn is None
    leaves = [t.clone().requires_grad_() for t in (x, router, w1, w2)]
    y = flashdmoe.moe(*leaves, top_k=K, backend="cuda")
    assert y.grad_fn is not None


class _BackwardExtension:
    """The fake extension plus the two backward launches, which write a clean finished status block, or
    with ``finish_at_once=False`` a status block (``script``'s next, per rank, else clean) that the fake
    device's next synchronisation completes; the row exchange honours the ranks' team words as the kernel
    does (a failed launch marks the rank with its sequence number and bit 31)."""

    def __init__(self, ext, fail: Exception | None = None, finish_at_once: bool = True) -> None:
        self.ext, self.fail, self.calls = ext, fail, []
        self.finish_at_once, self.script = finish_at_once, []

    def __getattr__(self, name):
        return getattr(self.ext, name)

    def _finish(self, status_host: int, ranks: int, team_words=(), sequence: int = 0) -> tuple[int, int, int]:
        if self.fail is not None:
            raise self.fail
        import ctypes

        blocks = self.script.pop(0) if self.script else [status_block()] * ranks
        if self.finish_at_once:
            blocks = [completed_block(block) for block in blocks]
        ctypes.memmove(status_host, b"".join(blocks), ranks * STATUS_LAYOUT["bytes"])
        for i, words in enumerate(team_words):
            if words:
                run_team_words(words, status_host + i * STATUS_LAYOUT["bytes"], FAILED_IN_BACKWARD | sequence)
        if not self.finish_at_once:
            self.ext.completions.append(FakeCompletion(status_host, ranks))
        return (66, 1, 100_000)

    def fused_backward_layout(self, tokens, hidden, ffn, experts, top_k, activation):
        return {"sync_bytes": 256, "scratch_bytes": 4096 + 8 * tokens * top_k, "row_of_choice_offset": 1024}

    def fused_backward(self, args, stream):
        self.calls.append(dict(args))
        return self._finish(args["status_host"], 1)

    def ep_rows_sync_bytes(self):
        return 512

    def ep_rows(self, args, stream):
        ranks = args if isinstance(args, list) else [args]
        self.calls.append([dict(a) for a in ranks])
        return self._finish(ranks[0]["status_host"], len(ranks), [a.get("team_words", 0) for a in ranks],
                            ranks[0].get("sequence", 0))


@pytest.mark.parametrize("fail", [False, True], ids=["launched", "raising"])
def test_fused_backward_launch_is_recorded_on_its_status_slot(fake, monkeypatch, fail):
    """flashdmoe.backward.fused_backward.launch (GPU-only otherwise): the status slot's address reaches the kernel's
    arguments, the launch is recorded as a backward (last_report stays the forward's) and checked like a
    forward; a launch that raises hands its slot back and records nothing."""
    from flashdmoe.kernel import extension
    from flashdmoe.backward import fused_backward

    ext, _, _ = fake
    backward_ext = _BackwardExtension(ext, RuntimeError("launching fused_backward_kernel: boom") if fail else None)
    monkeypatch.setattr(extension, "_loaded", backward_ext)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(fused_backward, "_pool", cuda_backend.WorkspacePool())
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    flashdmoe.synchronize()
    report, slots = flashdmoe.last_report(), status_checks._state.devices[None]
    free = slots.eager_free()
    T = x.shape[0]
    expert = torch.zeros(T, K, dtype=torch.int32)
    args = (x, x, w1, w2, torch.zeros(T * K, I, dtype=x.dtype), expert, expert, torch.ones(T, K))
    options = dict(activation="gelu", need_dx=True, need_dw1=True, need_dw2=False)
    if fail:
        with pytest.raises(RuntimeError, match="boom"):
            fused_backward.launch(*args, **options)
        assert slots.eager_free() == free and not status_checks._state.pending
        return
    claimed = slots.next_eager().address  # the slot the launch will claim
    grads = fused_backward.launch(*args, **options)
    assert grads.dw2 is None and grads.dw1.shape == w1.shape and grads.row_of_choice.shape == (T, K)
    (call,) = backward_ext.calls
    assert slots.eager_free() == free - 1, "the launch holds a slot until it is checked"
    assert call["status_host"] == claimed
    assert flashdmoe.last_report() is report, "a backward's launch does not replace the forward's report"
    (pending,) = [r for r in status_checks._state.pending if not r.checked]
    assert pending.launch_id == report.launch_id + 1 and pending.ranks == (0,) and pending.tokens == (T,)
    flashdmoe.synchronize()
    assert pending.checked and slots.eager_free() == free


def test_team_backward_row_exchange_launch_is_recorded(fake, monkeypatch):
    """flashdmoe.backward.ep_backward's launch of the row exchange (GPU-only otherwise): every rank's sync words and
    status block at their pitch, one report over the ranks, recorded against the team."""
    from flashdmoe.backward import ep_backward

    ext, _, _ = fake
    backward_ext = _BackwardExtension(ext)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(ep_backward, "_pool", cuda_backend.WorkspacePool())
    team = emulated_team(P=2)
    emulated_forward(team)
    flashdmoe.synchronize()
    report = ep_backward._launch(backward_ext, team, [{"rank": 0}, {"rank": 1}], torch.device("cpu"), (16, 16))
    (ranks,) = backward_ext.calls
    assert ranks[1]["sync"] - ranks[0]["sync"] == 512
    assert ranks[1]["status_host"] - ranks[0]["status_host"] == STATUS_LAYOUT["bytes"]
    assert report.ranks == (0, 1) and report.tokens == (16, 16) and report.team is team
    assert team.unchecked_launch is report
    status_checks.settle_team(team)
    assert report.checked and team.unchecked_launch is None


def _exchange(backward_ext, team, sequence: int):
    """One launch of the backward's row exchange for every rank of an emulated team, with the ranks' team
    words as flashdmoe.backward.ep_backward._backward passes them."""
    from flashdmoe.backward import ep_backward

    args = [{"rank": r, "sequence": sequence, "team_words": team.device_words.data_ptr() + 8 * r}
            for r in range(team.world_size)]
    return ep_backward._launch(backward_ext, team, args, torch.device("cpu"), (16,) * team.world_size)


@pytest.fixture
def exchange_ext(fake, monkeypatch):
    """The fake extension with the backward's launches, which finish at the fake device's next sync."""
    from flashdmoe.backward import ep_backward

    ext, _, synchronized = fake
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(ep_backward, "_pool", cuda_backend.WorkspacePool())
    return _BackwardExtension(ext, finish_at_once=False), synchronized


def test_a_teams_backward_waits_for_its_forward_not_for_the_teams_last_launch(exchange_ext):
    """A model's backward: the previous layer's exchange still runs on the stream when the next layer's
    backward starts; only the forward it differentiates is checked (it finished long before). On another
    stream the host waits for the exchange, as before."""
    backward_ext, synchronized = exchange_ext
    team = emulated_team()
    emulated_forward(team)
    forward = flashdmoe.last_report()
    flashdmoe.synchronize()
    assert forward.checked and synchronized == [None]
    previous = _exchange(backward_ext, team, sequence=1)
    assert team.unchecked_launch is previous and team.unchecked_stream == 7
    status_checks.before_backward(team, forward, 7)
    assert synchronized == [None] and not previous.ready() and not previous.checked
    emulated_forward(team)  # the next step's forward: the same stream, no wait either
    assert synchronized == [None] and not previous.checked
    status_checks.before_backward(team, forward, 8)
    assert synchronized == [None, None] and previous.checked
    flashdmoe.synchronize()


def test_a_captured_teams_backward_refuses_an_unchecked_eager_launch_instead_of_waiting(exchange_ext):
    """Inside a CUDA-graph capture nothing can be waited for: a backward whose forward, or whose team's last
    launch, ran eagerly and is unchecked raises (saying to synchronize first) without waiting; launches the
    graph captured, or eager ones already checked, pass."""
    backward_ext, synchronized = exchange_ext
    team = emulated_team()
    emulated_forward(team)
    forward = flashdmoe.last_report()
    with pytest.raises(RuntimeError, match=rf"launch {forward.launch_id} ran eagerly and was not checked yet.*"
                                           r"flashdmoe.synchronize\(\) before capturing"):
        status_checks.before_backward(team, forward, None, capturing=True)
    assert synchronized == [] and not forward.checked
    flashdmoe.synchronize()
    previous = _exchange(backward_ext, team, sequence=1)  # the team's last launch: eager, unchecked
    with pytest.raises(RuntimeError, match=rf"launch {previous.launch_id} ran eagerly"):
        status_checks.before_backward(team, forward, None, capturing=True)
    flashdmoe.synchronize()
    captured = SimpleNamespace(captured=True, checked=False, launch_id=99)
    status_checks.before_backward(team, captured, None, capturing=True)  # the graph's own: nothing to check
    flashdmoe.synchronize()


def test_a_teams_backward_checks_its_forward_first(exchange_ext):
    """The routing a backward reads is only meaningful if its forward succeeded: its error is raised
    before the backward launches anything."""
    backward_ext, synchronized = exchange_ext
    team = emulated_team()
    backward_ext.ext.script.append([status_block(error=timeout_word(6, 1)), status_block()])
    emulated_forward(team)
    forward = flashdmoe.last_report()
    with pytest.raises(flashdmoe.KernelTimeout, match=r"rank 0 timed out.*\[launch 1 on"):
        status_checks.before_backward(team, forward, 7)
    assert team.failed and backward_ext.calls == []


def test_a_failed_backward_exchange_stops_the_teams_next_forward_on_the_device(exchange_ext):
    """A failed exchange marks its rank (bit 31 and the backward's number): the next forward, queued at
    once on the same stream, runs nothing there and says whose failure stopped it, after that failure."""
    backward_ext, synchronized = exchange_ext
    team = emulated_team()
    emulated_forward(team)
    flashdmoe.synchronize()
    backward_ext.script.append([status_block(), status_block(error=timeout_word(16, 0))])
    failed = _exchange(backward_ext, team, sequence=1)
    assert team.device_words.tolist() == [[1, 0], [1, -(1 << 31) + 1]]
    emulated_forward(team)
    stopped = flashdmoe.last_report()
    assert synchronized == [None] and not team.failed and not failed.checked
    with pytest.raises(flashdmoe.KernelTimeout, match=rf"rank 1 timed out.*waiting on rank 0.*\[launch {failed.launch_id} on"):
        flashdmoe.synchronize()
    assert team.failed
    with pytest.raises(TeamFailed, match=rf"rank 1 ran nothing: its team's backward number 1 failed earlier.*"
                                         rf"\[launch {stopped.launch_id} on"):
        flashdmoe.check_errors()
    flashdmoe.check_errors()


@pytest.mark.parametrize("name,value", [("FLASHDMOE_TIMEOUT_MS", "ten"), ("FLASHDMOE_TIMEOUT_MS", "0"),
                                        ("FLASHDMOE_FUSED_BACKWARD_MAX_ROWS", "-3")])
def test_a_bad_knob_in_the_environment_is_named(name, value):
    """The launch knobs read from the environment at import (the watchdog's limit, the fused backward's row
    limit): a value that is not an integer in range is refused naming the variable, not with int()'s
    bare message."""
    import os
    import subprocess
    import sys

    env = {**os.environ, name: value}
    done = subprocess.run([sys.executable, "-c", "import flashdmoe.kernel.launch_knobs"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode != 0
    assert f"ValueError: {name}={value!r}: expected an integer >= " in done.stderr, done.stderr[-2000:]
