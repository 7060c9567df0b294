"""flashdmoe.parallel.team: buffer plans, batch checks, team lifecycle and argument validation (CPU); emulated
teams' buffers and peer tables (GPU). The multi-process NVSHMEM team is exercised in
tests/test_ep_multiprocess.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flashdmoe.parallel import team as team_module
from flashdmoe.parallel.mps import MpsDaemon, mps_available
from flashdmoe.parallel.team import MAX_RANKS, BufferPlan, Team, TeamFailed, mps_thread_percentage, plan_for

UID = bytes(range(128))


def plan(**changes) -> BufferPlan:
    fields = dict(world_size=4, max_tokens=100, hidden=64, top_k=2, local_experts=3, dtype=torch.bfloat16)
    return BufferPlan(**(fields | changes))


# ------------------------------------------------------------------------------------------------------------
# BufferPlan


def test_relay_batch_regions_by_hand():
    """A batch region of the hierarchical exchange: 16-byte header, k records of 8 bytes per row, the rows
    from a 128-byte boundary (csrc/moe/params.cuh RelayParams); one region per node each way."""
    p = plan()  # max_tokens 100, k 2, H 64, bf16
    rows_offset, batch = p.relay_batch_layout()
    assert rows_offset == 1664 == -(-(16 + 8 * 100 * 2) // 128) * 128
    assert batch == 1664 + 100 * 64 * 2 == 14_464
    assert p.relay_bytes(2) == 4 * 14_464 and p.relay_bytes(4) == 8 * 14_464


def test_plan_sizes_by_hand():
    p = plan()
    assert p.stream_rows == 200  # max_tokens * min(k=2, L=3)
    assert p.element_bytes == 2
    assert p.data_bytes == 4 * 200 * 64 * 2 == 102_400  # P regions of [stream_rows, H] bf16
    assert p.forward_signal_words == 4 * 3 + 5 * 4 == 32  # P*L counts + 3P flags + 2P relay flags
    # the backward's: 6P flags, 3 abort words, the count, P*L place words, a word per staged row
    assert p.backward_words == 6 * 4 + 3 + 1 + 4 * 3 + 4 * 200 == 840
    assert p.signal_words == 32 + 840
    assert p.bytes_per_rank == 2 * 102_400 + 4 * 872 == 208_288  # recv + comb + int32 signals
    # k > L: a token sends at most L rows to one rank (one per local expert)
    wide = plan(top_k=5, local_experts=2, world_size=2, max_tokens=7, hidden=128, dtype=torch.float16)
    assert wide.stream_rows == 14
    assert wide.data_bytes == 2 * 14 * 128 * 2
    assert wide.forward_signal_words == 2 * 2 + 10
    assert wide.signal_words == 2 * 2 + 10 + 6 * 2 + 3 + 1 + 2 * 2 + 2 * 14
    assert wide.bytes_per_rank == 2 * wide.data_bytes + 4 * wide.signal_words


def test_plan_for_divides_experts():
    assert plan_for(4, 10, 64, 2, 16, torch.bfloat16) == BufferPlan(4, 10, 64, 2, 4, torch.bfloat16)
    with pytest.raises(ValueError, match="experts=10 is not divisible by world_size=4"):
        plan_for(4, 10, 64, 2, 10, torch.bfloat16)


@pytest.mark.parametrize("changes, message", [
    (dict(world_size=0), "world_size=0: expected an integer >= 1"),
    (dict(world_size=MAX_RANKS + 1), f"world_size={MAX_RANKS + 1}: expected at most {MAX_RANKS}"),
    (dict(world_size=True), "world_size=True"),
    (dict(world_size=2.0), "world_size=2.0"),
    (dict(max_tokens=0), "max_tokens=0"),
    (dict(hidden=-64), "hidden=-64"),
    (dict(top_k=0), "top_k=0"),
    (dict(local_experts=0), "local_experts=0"),
    (dict(dtype=torch.float32), "dtype=torch.float32: expected torch.bfloat16 or torch.float16"),
])
def test_plan_rejects_bad_fields(changes, message):
    with pytest.raises(ValueError, match=message):
        plan(**changes)


def test_check_batch_accepts_what_fits():
    p = plan()
    p.check_batch(100, 64, 2, 3, torch.bfloat16)
    p.check_batch(0, 64, 2, 3, torch.bfloat16, rank=3)


@pytest.mark.parametrize("batch, message", [
    ((101, 64, 2, 3, torch.bfloat16), r"x \(rank 1\): 101 tokens, but the team's buffers were sized for max_tokens=100"),
    ((10, 128, 2, 3, torch.bfloat16), r"hidden \(rank 1\): got 128, but the team's buffers were sized for 64"),
    ((10, 64, 3, 3, torch.bfloat16), r"top_k \(rank 1\): got 3, .* sized for 2"),
    ((10, 64, 2, 4, torch.bfloat16), r"local experts \(rank 1\): got 4, .* sized for 3"),
    ((10, 64, 2, 3, torch.float16), r"x \(rank 1\): dtype torch.float16, .* sized for torch.bfloat16"),
])
def test_check_batch_errors_name_the_argument_and_rank(batch, message):
    with pytest.raises(ValueError, match=message):
        plan().check_batch(*batch, rank=1)
    with pytest.raises(ValueError) as info:
        plan().check_batch(*batch)
    assert "(rank" not in str(info.value)


# ------------------------------------------------------------------------------------------------------------
# Teams on the CPU


def test_single_team():
    team = Team.single()
    assert (team.transport, team.rank, team.world_size, team.plan, team.buffers) == ("single", 0, 1, None, [])
    assert team.buffer_bytes == 0 and not team.failed
    assert team.describe() == {"transport": "single", "rank": 0, "world_size": 1, "buffer_bytes_per_rank": 0,
                               "stream_rows": None, "max_tokens": None, "peer_transports": ["p2p"],
                               "ranks_per_node": None, "exchange": "direct"}
    team.require_usable()
    team.barrier()  # a no-op for one rank
    assert "ok" in repr(team)


def test_a_single_team_counts_no_backward_exchanges():
    team = Team.single()
    assert team.backward_count() == 0, "one rank runs no exchange"
    assert team.device_words is None, "one rank has no forward count"


def test_backward_words_follow_each_other_without_gaps():
    """The backward's words, in EpSignalLayout's order: flags, abort words, the count, places, row words."""
    plan = BufferPlan(3, max_tokens=5, hidden=64, top_k=2, local_experts=4, dtype=torch.bfloat16)
    P, L, S = 3, 4, plan.stream_rows
    base = plan.forward_signal_words
    assert plan.backward_word("free", 0, 0) == base and plan.backward_word("ready", 2, P - 1) == base + 6 * P - 1
    assert plan.backward_word("abort", 0, 0) == base + 6 * P
    assert plan.backward_word("sequence", 0, 0) == plan.backward_word("abort", 2, 0) + 1
    assert plan.backward_word("place", 0, 0) == plan.backward_word("sequence", 0, 0) + 1
    assert plan.backward_word("row_word", 0, 0) == plan.backward_word("place", P - 1, L - 1) + 1
    assert plan.signal_words == plan.backward_word("row_word", P - 1, S - 1) + 1
    with pytest.raises(ValueError, match="'sequence'"):
        plan.backward_word("count", 0, 0)


def test_failed_team_cannot_be_used():
    team = Team.single()
    team.mark_failed("KernelTimeout: waiting on rank 1")
    team.mark_failed("a later failure")  # the first reason is kept
    assert team.failed and "failed" in repr(team)
    with pytest.raises(TeamFailed, match=r"failed earlier \(KernelTimeout: waiting on rank 1\); make a new team"):
        team.require_usable()
    with pytest.raises(TeamFailed):
        team.barrier()
    team.close()
    with pytest.raises(TeamFailed, match="is closed"):
        team.require_usable()


def test_closed_team_cannot_be_used_and_close_is_idempotent():
    with Team.single() as team:
        team.require_usable()
    assert "closed" in repr(team)
    with pytest.raises(TeamFailed, match="is closed"):
        team.require_usable()
    with pytest.raises(TeamFailed, match="is closed"):
        team.barrier()
    team.close()
    assert team.buffers == []


@pytest.fixture
def no_nvshmem_or_cuda(monkeypatch):
    """Validation must happen before NVSHMEM or CUDA are touched: both raise if they are."""

    def touched(*args, **kwargs):
        raise AssertionError("NVSHMEM or CUDA was touched before the arguments were validated")

    monkeypatch.setattr(team_module, "_nvshmem", touched)
    monkeypatch.setattr(team_module, "_cuda_core_device", touched)
    monkeypatch.setattr(torch.cuda, "set_device", touched)
    monkeypatch.setattr(torch.cuda, "current_device", touched)


SIZES = dict(max_tokens=16, hidden=64, top_k=2, local_experts=2)


@pytest.mark.parametrize("args, changes, message", [
    ((b"\x00" * 127, 0, 2), {}, "uid_bytes: expected 128 bytes"),
    ((b"\x00" * 129, 0, 2), {}, "uid_bytes: expected 128 bytes"),
    (("x" * 128, 0, 2), {}, "uid_bytes: expected 128 bytes"),
    ((UID, -1, 2), {}, r"rank=-1: expected an integer in \[0, 2\)"),
    ((UID, 2, 2), {}, r"rank=2: expected an integer in \[0, 2\)"),
    ((UID, True, 2), {}, "rank=True"),
    ((UID, 0, 0), {}, "world_size=0"),
    ((UID, 0, MAX_RANKS + 1), {}, "world_size=9"),
    ((UID, 0, 2), {"max_tokens": 0}, "max_tokens=0"),
    ((UID, 0, 2), {"dtype": torch.float32}, "dtype=torch.float32"),
    ((UID, 0, 2), {"device": "cpu"}, "device=cpu: expected a CUDA device"),
    ((UID, 0, 4), {"exchange": "relay"}, r"exchange='relay': expected one of \('direct', 'hierarchical'\)"),
    ((UID, 0, 4), {"exchange": "hierarchical"}, "needs ranks_per_node dividing world_size=4 into at least two nodes"),
    ((UID, 0, 4), {"exchange": "hierarchical", "ranks_per_node": 4}, "at least two nodes, got ranks_per_node=4"),
    ((UID, 0, 4), {"exchange": "hierarchical", "ranks_per_node": 3}, "at least two nodes, got ranks_per_node=3"),
    ((UID, 0, 4), {"exchange": "hierarchical", "ranks_per_node": 2, "peer_transport": "nvshmem"},
     "needs peer_transport='auto'"),
])
def test_nvshmem_team_validates_before_touching_nvshmem(no_nvshmem_or_cuda, args, changes, message):
    with pytest.raises(ValueError, match=message):
        Team.nvshmem(*args, **(SIZES | changes))


def test_emulated_team_validates_sizes_and_device(no_nvshmem_or_cuda):
    with pytest.raises(ValueError, match="world_size=9"):
        Team.emulated(9, **SIZES)
    with pytest.raises(ValueError, match="top_k=0"):
        Team.emulated(2, **(SIZES | {"top_k": 0}))
    with pytest.raises(ValueError, match="device=cpu: expected a CUDA device"):
        Team.emulated(2, device="cpu", **SIZES)


@pytest.mark.skipif(importlib.util.find_spec("nvshmem") is not None, reason="nvshmem4py is installed here")
def test_unique_id_without_nvshmem_says_what_to_install():
    with pytest.raises(ImportError, match="nvshmem4py"):
        Team.make_unique_id()


@pytest.mark.parametrize("value, expected", [
    (None, None), ("", None), ("50", 50), ("12.7", 12), ("abc", None), ("0", 1), ("250", 100),
])
def test_mps_thread_percentage(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    else:
        monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", value)
    assert mps_thread_percentage() == expected


def test_mps_client_env_without_a_daemon(tmp_path, monkeypatch):
    daemon = MpsDaemon(root=tmp_path)
    env = daemon.client_env(25)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "log")
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in daemon.client_env()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert "nvidia-cuda-mps-control is not on PATH" in mps_available()
    with pytest.raises(RuntimeError, match="cannot start MPS"):
        daemon.start()
    assert not daemon.running
    daemon.stop()
    assert tmp_path.exists()  # a root given by the caller is not removed


# ------------------------------------------------------------------------------------------------------------
# GPU: emulated teams


@pytest.mark.gpu
def test_emulated_team_buffers_and_peer_tables():
    P = 3
    team = Team.emulated(P, max_tokens=50, hidden=128, top_k=2, local_experts=4, dtype=torch.bfloat16)
    p = team.plan
    assert (team.transport, team.rank, team.world_size) == ("emulated", 0, P)
    assert p == BufferPlan(P, 50, 128, 2, 4, torch.bfloat16)
    # signals: the forward's P*L + 5P words, then the backward's 6P + 4 + P*L + P*stream_rows
    assert team.buffer_bytes == p.bytes_per_rank == 2 * (P * 100 * 128 * 2) + 4 * (P * 4 + 5 * P + 6 * P + 4 + P * 4 + P * 100)
    assert team.describe()["stream_rows"] == 100 and team.device.type == "cuda"
    assert len(team.buffers) == P
    for own in team.buffers:
        for tensor, dtype, size in ((own.recv, torch.uint8, p.data_bytes), (own.comb, torch.uint8, p.data_bytes),
                                    (own.signals, torch.int32, p.signal_words)):
            assert tensor.dtype == dtype and tensor.numel() == size and tensor.is_cuda and tensor.is_contiguous()
        assert int(own.signals.count_nonzero()) == 0  # zero before the first forward
        # every virtual rank reaches every rank's buffers (itself included) at their real addresses
        assert own.peer_recv == [b.recv.data_ptr() for b in team.buffers]
        assert own.peer_comb == [b.comb.data_ptr() for b in team.buffers]
        assert own.peer_signals == [b.signals.data_ptr() for b in team.buffers]
        # ...and maps them for load/store (the backward's exchange reads these tables)
        assert (own.mapped_recv, own.mapped_comb, own.mapped_signals) == (own.peer_recv, own.peer_comb,
                                                                          own.peer_signals)
        # region q of recv = rows from source q, [stream_rows, H] in the token dtype
        assert own.recv.view(torch.bfloat16).view(P, p.stream_rows, p.hidden).shape == (P, 100, 128)
    addresses = [b.recv.data_ptr() for b in team.buffers] + [b.comb.data_ptr() for b in team.buffers]
    assert len(set(addresses)) == 2 * P  # distinct buffers
    # each rank's forwards counted on the device, from zero
    assert team.device_words.tolist() == [[0, 0]] * P and team.device_words.device == team.device
    team.barrier()  # no-op for emulated teams
    team.close()
    assert team.buffers == []
    with pytest.raises(TeamFailed):
        team.require_usable()
