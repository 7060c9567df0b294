"""A CPU stand-in for the ``flashdmoe_cuda`` extension and the few ``torch.cuda`` calls a fused forward
makes, so that ``flashdmoe.cuda_backend.run_forward`` and the error-surfacing state machine run without a
GPU (tests/test_status_checks.py, tests/test_host_path.py, scripts/host_overhead.py).

The fake ``launch`` writes the status blocks a test scripted straight into the host slot (where the real
kernel's last block writes them as it exits) but leaves their completion words unset, the launch
"running", until the test completes it (``ext.launches[i]["completion"].done = True``) or the host waits
for the device (every launch completes), so every check point of :mod:`flashdmoe.kernel.status_checks` can be
driven by hand. The asynchronous weight scans (:mod:`flashdmoe.weight_checks`) run on the CPU tensors and
record a fake event of their own (``ext.scan_events``), driven the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
from dataclasses import dataclass, field

import torch

# csrc/moe/launch.h kAddressesPerRank: x, w1, w2, y, four routing outputs, saved_pre, workspace, sync words
# (last: 0 while they lead the workspace)
ADDRESSES_PER_RANK = 11

# The real block (csrc/moe/params.cuh): error word, phase clock [6], traffic [2], status flags, and the
# completion word the kernel sets last.
STATUS_LAYOUT = {"bytes": 128, "error_word": 0, "phase_clock": 8, "phase_clock_slots": 6, "traffic": 56,
                 "nvshmem_traffic": 72, "status_flags": 88, "done_word": 96}


def status_block(*, error: int = 0, flags: int = 0, clock=(1_000, 2_000, 3_500, 6_000, 10_000, 10_500),
                 traffic=(0, 0), nvshmem_traffic=(0, 0)) -> bytes:
    """One rank's status block as the kernel leaves it, but for its completion word (see FakeCompletion)."""
    raw = bytearray(STATUS_LAYOUT["bytes"])
    struct.pack_into("<Q", raw, STATUS_LAYOUT["error_word"], error)
    for i, value in enumerate(clock):
        struct.pack_into("<Q", raw, STATUS_LAYOUT["phase_clock"] + 8 * i, value)
    struct.pack_into("<QQ", raw, STATUS_LAYOUT["traffic"], *traffic)
    struct.pack_into("<QQ", raw, STATUS_LAYOUT["nvshmem_traffic"], *nvshmem_traffic)
    struct.pack_into("<I", raw, STATUS_LAYOUT["status_flags"], flags)
    return bytes(raw)


_CLEAN_BLOCK = status_block()


def completed_block(block: bytes) -> bytes:
    """A status block as a finished launch leaves it: its completion word set."""
    raw = bytearray(block)
    struct.pack_into("<I", raw, STATUS_LAYOUT["done_word"], 1)
    return bytes(raw)


_CLEAN_DONE_BLOCK = completed_block(_CLEAN_BLOCK)


def timeout_word(phase: int, peer: int, block: int = 3) -> int:
    return 1 | (phase << 8) | (peer << 16) | (block << 32)


def team_failed_word(failed: int) -> int:
    """The error word of a team rank that ran nothing because of its failed word ``failed``: a forward's
    number, or a backward's with bit 31 set (csrc/moe/params.cuh)."""
    return 3 | (failed << 32)


def run_team_words(team_words: int, status_at: int, sequence: int) -> None:
    """What the kernel does with a team rank's words (csrc/moe/params.cuh, TeamRankWords) around a launch
    whose status block is at ``status_at`` (a scripted error already written there): a rank whose earlier
    launch failed runs nothing and says so; a launch that failed marks the rank with ``sequence``."""
    failed = ctypes.c_uint32.from_address(team_words + 4)
    error_at = status_at + STATUS_LAYOUT["error_word"]
    if failed.value:
        ctypes.memmove(error_at, struct.pack("<Q", team_failed_word(failed.value)), 8)
    elif struct.unpack("<Q", ctypes.string_at(error_at, 8))[0]:
        failed.value = sequence


class FakeEvent:
    """A CUDA event whose completion the test decides (``done``); ``synchronize`` completes it."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.done = True
        self.records = 0
        self.waits = 0

    def record(self) -> None:
        self.records += 1
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


class FakeCompletion:
    """A launch's end as the host sees it: setting ``done`` writes every rank's completion word into the
    status slot, as the kernel's last block does."""

    def __init__(self, status_host: int, ranks: int) -> None:
        self.status_host = status_host
        self.ranks = ranks
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    @done.setter
    def done(self, value: bool) -> None:
        assert value, "a launch cannot be undone"
        self._done = True
        if self.status_host:
            for rank in range(self.ranks):
                at = self.status_host + rank * STATUS_LAYOUT["bytes"] + STATUS_LAYOUT["done_word"]
                ctypes.memmove(at, struct.pack("<I", 1), 4)


@dataclass(eq=False)  # hashable by identity: the backend caches per extension
class FakeExtension:
    """``prepare_forward`` / ``launch`` / ``status_layout`` / ``check_shapes`` / ``workspace_layout``."""

    shape_error: str = ""
    # Status blocks for the next launches, one list of per-rank blocks per launch (default: success).
    script: list = field(default_factory=list)
    prepared: list = field(default_factory=list)
    launches: list = field(default_factory=list)
    fail_launch: Exception | None = None
    completions: list = field(default_factory=list)  # every launch's FakeCompletion, in order
    # True: every launch has completed by the next call (a GPU faster than the host).
    finish_at_once: bool = False
    # False: launches are not recorded in ``launches`` (scripts/host_overhead.py times the Python around
    # the launch, not the fake's bookkeeping).
    record: bool = True
    scan_events: list = field(default_factory=list)  # the weight scans' events, in order
    # True: a weight scan has finished by the next check point; False: it runs until a test completes it.
    scans_finish_at_once: bool = True

    def check_shapes(self, T, H, I, E, k, world_size=1):
        return self.shape_error

    def workspace_layout(self, T, H, I, E, k, dtype, world_size=1, stream_rows=0):
        return {"total_bytes": 4096 + 64 * T * k, "error_word": 0, "status_flags": 88, "phase_clock": 8,
                "phase_clock_slots": 6, "traffic": 56, "sync_bytes": 1024}

    def status_layout(self):
        return dict(STATUS_LAYOUT)

    def prepare_forward(self, shared, ranks):
        prepared = (dict(shared), [dict(r) for r in ranks])
        self.prepared.append(prepared)
        return prepared

    def launch(self, prepared, addresses, sequence, stream, status_host):
        if self.fail_launch is not None:
            raise self.fail_launch
        shared, ranks = prepared
        assert len(addresses) == 1 + ADDRESSES_PER_RANK * len(ranks)
        completion = FakeCompletion(status_host, len(ranks))
        if status_host:
            if self.script:
                data = b"".join(self.script.pop(0))
                ctypes.memmove(status_host, data, len(data))
                if self.finish_at_once:
                    completion.done = True
            elif self.finish_at_once:  # one copy, completion words included (scripts/host_overhead.py times it)
                completion._done = True
                ctypes.memmove(status_host, _CLEAN_DONE_BLOCK * len(ranks), len(ranks) * STATUS_LAYOUT["bytes"])
            else:
                ctypes.memmove(status_host, _CLEAN_BLOCK * len(ranks), len(ranks) * STATUS_LAYOUT["bytes"])
        elif self.finish_at_once:
            completion.done = True
        if not completion.done:
            self.completions.append(completion)
        # A team rank's words on the device (csrc/moe/params.cuh, TeamRankWords): the kernel publishes
        # count + 1 and stores it back (run_team_words does the rest). A captured launch runs nothing until
        # a replay.
        captured = torch.cuda.is_current_stream_capturing()
        for i, rank in enumerate(ranks):
            if rank.get("team_words") is not None:
                if captured:
                    sequence = None
                    continue
                count = ctypes.c_int32.from_address(rank["team_words"])
                sequence = count.value = count.value + 1
                if status_host:
                    run_team_words(rank["team_words"], status_host + i * STATUS_LAYOUT["bytes"], sequence)
        if self.record:
            self.launches.append({"sequence": sequence, "stream": stream, "ranks": len(ranks),
                                  "completion": completion, "status_host": status_host, "addresses": list(addresses),
                                  "workspace": addresses[ADDRESSES_PER_RANK - 1::ADDRESSES_PER_RANK],
                                  "sync": addresses[ADDRESSES_PER_RANK::ADDRESSES_PER_RANK]})
        return (132, 1, 200_000)

    def synchronize(self) -> None:
        """The device drained: every launch so far has completed."""
        for completion in self.completions:
            if not completion.done:
                completion.done = True
        self.completions.clear()

    def record_scan_event(self, device) -> FakeEvent:
        """A weight scan's event, recorded (finished at once unless ``scans_finish_at_once`` is False)."""
        event = FakeEvent(handle=-1 - len(self.scan_events))
        event.record()
        event.done = self.scans_finish_at_once
        self.scan_events.append(event)
        return event


@contextlib.contextmanager
def fake_cuda(monkeypatch, ext: FakeExtension | None = None, *, capturing=lambda: False):
    """Run the fused path on CPU tensors: the fake extension, unpinned slots, and CPU tensors accepted as
    CUDA by ``flashdmoe.moe``. Yields (ext, the weight scans' events, synchronized devices): waiting for the
    device completes every launch."""
    from flashdmoe import api, cuda_backend, weight_checks
    from flashdmoe.kernel import extension, launch_report, status_checks

    ext = ext or FakeExtension()
    synchronized: list = []

    def synchronize_device(device):
        synchronized.append(device)
        ext.synchronize()

    monkeypatch.setattr(extension, "_loaded", ext)
    caches = (launch_report.status_layout, cuda_backend._check_shapes, cuda_backend._workspace_layout)
    for cache in caches:
        cache.cache_clear()
    cuda_backend._single_plans.clear()
    api.forget_calls()
    weight_checks.forget()
    monkeypatch.setattr(cuda_backend, "_pool", cuda_backend.WorkspacePool())
    monkeypatch.setattr(status_checks, "_state", status_checks._State())
    monkeypatch.setattr(status_checks, "_allocate_pinned", lambda n: torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(status_checks, "_synchronize_device", synchronize_device)
    monkeypatch.setattr(status_checks, "WAIT_POLL_S", 0.0)  # a wait goes straight to the device's
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", capturing)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cuda_backend, "_current_stream_handle", lambda index: 7)
    monkeypatch.setattr(cuda_backend, "_current_device", lambda: None)  # CPU tensors' device index
    monkeypatch.setattr(cuda_backend, "_multiprocessors", lambda index: 132)  # an H200's SMs (variant choice)
    monkeypatch.setattr(api, "cuda_unavailable_reason", lambda x: None)
    monkeypatch.setattr(weight_checks, "_scans_asynchronously", lambda tensor: True)
    monkeypatch.setattr(weight_checks, "_allocate_pinned", lambda n: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(weight_checks, "_pinned", [])
    monkeypatch.setattr(weight_checks, "_record_event", ext.record_scan_event)
    try:
        yield ext, ext.scan_events, synchronized
    finally:
        for cache in caches:
            cache.cache_clear()
        cuda_backend._single_plans.clear()
        api.forget_calls()
        weight_checks.forget()
