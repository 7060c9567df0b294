"""When the fused kernel's errors reach the caller: a forward never waits for the GPU.

Every launch writes each rank's status block into a pinned host slot: the kernel's last block to exit
stores it there (through UVA) after every other block of the rank has finished, a timed-out launch
included (every wait in the kernel is bounded by the watchdog, so every block exits), and then sets the
block's completion word. The host reads that word to learn that a launch finished: no CUDA event is
recorded or queried per launch, and nothing waits. A launch is *checked* (its status decoded, its
error raised) at the first of these points:

* the next fused forward in this process (any shape, any team), if the launch's completion words are set:
  finished launches are checked oldest first before the new one is launched;
* before the next use of the launch's team on another stream, and at ``Team.barrier``: this one waits for
  the launch and checks it with everything queued before it, oldest first. A team's forward, or its
  backward's exchange, on the same stream as the team's last launch does not wait for it: the device
  keeps a launch off a failed one's buffers (a rank's launch after a failed forward or exchange runs
  nothing and reports ``TeamFailed``; its peers then time out), so an error surfaces there at the next
  point of this list. A team's backward waits only for its own forward (whose routing it reads), which in
  a model's backward finished long before;
* :func:`check_errors` (launches that have finished, never blocks) and :func:`synchronize` (waits for
  the device, then checks every launch, CUDA-graph replays included);
* when the 64 status slots of a device are all taken by unchecked launches (a deep queue), the oldest
  is waited for;
* at the launch itself in debug mode (``FLASHDMOE_SYNC_CHECKS=1`` or :func:`set_sync_checks`), which
  waits for every launch and raises its error from the call that made it.

A one-rank eager forward with nothing to report is launched by the host module's C++ path
(:mod:`flashdmoe.kernel.host_queue`), which checks finished launches of its own, oldest first, and leaves
everything else here: before any point above reads the queue, or the Python path adds to it, the
launches made in C++ are taken over into it, oldest first, so the points are the same whichever path
launched.

A launch's watchdog timeout raises :class:`flashdmoe.KernelTimeout` and marks its team failed (the team
then raises ``TeamFailed``, as does each launch the device stopped after it); non-finite router logits
(NaN / Inf in ``x`` or ``router_weight``) raise ``ValueError``. Each error is raised once; the message names the launch it came from.

The asynchronous scans of new weights for NaN / Inf (:class:`flashdmoe.weight_checks.WeightScan`, queued
on the stream ahead of the launch that first uses the weights) share this queue and these points: their
``ValueError`` names the weight. In debug mode a call settles, oldest first, everything queued up to and
including its own launch, so a scan's error is raised by the call that queued it (after its launch: an
NVSHMEM rank never leaves its peers waiting).

Inside a CUDA-graph capture nothing is checked (a wait may fall back to a device synchronisation, and the
weight scans' events cannot be queried, while a capture is under way):
a captured launch writes its status into a slot of its own at every replay, and :func:`synchronize`
checks those slots after the device is idle. The first forward on a device must run outside a capture
(it allocates the pinned slots), as torch's own warm-up rule asks.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np
import torch

from flashdmoe.kernel import host_queue
from flashdmoe.kernel.launch_report import LaunchReport, StatusLayout, status_layout
from flashdmoe.kernel.workspace_pool import device_key

__all__ = ["check_errors", "last_report", "set_sync_checks", "sync_checks", "synchronize"]

#: Ranks per status slot (a launch holds at most this many: the kernel's peer table).
SLOT_RANKS = 8
#: Status slots of eager launches per device: launches in flight before the oldest is waited for.
EAGER_SLOTS = 64
#: Status slots for captured launches, allocated this many at a time (outside captures) ...
GRAPH_CHUNK = 512
#: ... whenever fewer than this many are left at an eager forward.
GRAPH_LOW_WATER = 128
#: How long a wait for one launch polls its completion words before it waits for the whole device
#: instead (which also surfaces a CUDA error that kept the kernel from running).
WAIT_POLL_S = 0.05


class _Slot:
    """One launch's pinned status bytes (``SLOT_RANKS`` blocks). For an eager launch it is also the
    launch's completion: :meth:`query` and :meth:`synchronize` read the completion words the kernel sets in
    the first ``ranks`` blocks. ``release`` hands it back (an eager slot to the host queue, which owns
    their free list; a graph slot to its device's list)."""

    __slots__ = ("address", "view", "release", "device", "ranks", "done_at")

    def __init__(self, address: int, view: memoryview, release: Callable[[], None], device: int,
                 layout: StatusLayout) -> None:
        self.address = address
        self.view = view
        self.release = release
        self.device = device
        self.ranks = 1
        # The word's lowest byte (the kernel writes 1; little-endian): one byte read per rank.
        self.done_at = tuple(rank * layout.bytes + layout.done_word for rank in range(SLOT_RANKS))

    def query(self) -> bool:
        """Whether every rank of the launch set its completion word (never blocks)."""
        view = self.view
        if self.ranks == 1:
            return view[self.done_at[0]] != 0
        return all(view[at] for at in self.done_at[:self.ranks])

    def synchronize(self) -> None:
        """Wait for the launch: poll its completion words for up to ``WAIT_POLL_S``, then wait for the
        device (a launch queued behind long work, or one a CUDA error kept from running)."""
        if self.query():
            return
        # The first millisecond yields the GIL between reads (as a spinning event wait would see the end at
        # once); after it, 20 µs naps, so a team's wait for a long forward oversleeps by tens of µs at most.
        start = time.perf_counter()
        while (waited := time.perf_counter() - start) < WAIT_POLL_S:
            time.sleep(0.0 if waited < 1e-3 else 2e-5)
            if self.query():
                return
        _synchronize_device(self.device)  # raises a CUDA error that kept the kernel from finishing
        if not self.query():
            raise RuntimeError(f"a flashdmoe launch on cuda:{self.device} never marked its status slot complete, "
                               "though the device is idle")

    def give_back(self) -> None:
        # The launch's words were seen set (or the launch never started): nothing writes them until the
        # slot's next launch.
        if self.ranks == 1:
            self.view[self.done_at[0]] = 0
        else:
            view = self.view
            for at in self.done_at[:self.ranks]:
                view[at] = 0
        self.release()


def _allocate_pinned(nbytes: int) -> torch.Tensor:
    """Page-locked host memory, which the kernel writes at the same address under unified addressing
    (every 64-bit CUDA platform)."""
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)


def _synchronize_device(device: int) -> None:
    torch.cuda.synchronize(device)


class _DeviceSlots:
    """The pinned status slots of one device: a fixed ring for eager launches, whose free list the host
    queue keeps (launches made in C++ claim them there too), and a growing set for captured ones (a graph
    may replay for as long as the process lives, so its slot is never reused)."""

    def __init__(self, device: int, layout: StatusLayout, queue) -> None:
        self.device = device
        self.key = device_key(device)
        self.layout = layout
        self.queue = queue
        self.slot_bytes = SLOT_RANKS * layout.bytes
        self.chunks: list[torch.Tensor] = []  # keeps the pinned memory alive
        self.eager = self._carve(EAGER_SLOTS, lambda index: functools.partial(queue.release, self.key, index))
        self.graph_free: list[_Slot] = []
        self.graph_chunks: list[tuple[torch.Tensor, int]] = []  # (chunk, first graph slot number)
        self.graph_reports: dict[int, LaunchReport] = {}  # graph slot number -> the captured launch
        self.grow_graph_slots()
        # Last: the queue gets the slots only once everything here exists (a failed allocation above
        # frees the eager chunk, which the queue must never have seen).
        queue.add_device(self.key, self.eager[0].address, EAGER_SLOTS)

    def _carve(self, count: int, release: Callable[[int], Callable[[], None]]) -> list[_Slot]:
        chunk = _allocate_pinned(count * self.slot_bytes)
        self.chunks.append(chunk)
        view = memoryview(chunk.numpy())
        base = chunk.data_ptr()
        return [_Slot(base + i * self.slot_bytes, view[i * self.slot_bytes:(i + 1) * self.slot_bytes], release(i),
                      self.device, self.layout) for i in range(count)]

    def claim_eager(self) -> _Slot | None:
        index = self.queue.claim(self.key)
        return None if index < 0 else self.eager[index]

    def eager_free(self) -> int:
        """Eager slots free now."""
        return self.queue.free_slots(self.key)

    def next_eager(self) -> _Slot | None:
        """The eager slot the next launch claims, if any is free."""
        index = self.queue.next_free(self.key)
        return None if index < 0 else self.eager[index]

    def grow_graph_slots(self) -> None:
        first = len(self.graph_chunks) * GRAPH_CHUNK
        free = self.graph_free
        slots = self._carve(GRAPH_CHUNK, lambda index: None)
        for slot in slots:
            slot.release = functools.partial(free.append, slot)
        slots.reverse()  # pop() hands out the lowest address first
        free[:0] = slots
        self.graph_chunks.append((self.chunks[-1], first))

    def graph_slot_number(self, slot: _Slot) -> int:
        for chunk, first in self.graph_chunks:
            offset = slot.address - chunk.data_ptr()
            if 0 <= offset < chunk.numel():
                return first + offset // self.slot_bytes
        raise AssertionError("the slot is not a graph slot of this device")


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: collections.deque[LaunchReport] = collections.deque()  # eager launches, oldest first
        self.devices: dict[int, _DeviceSlots] = {}
        # The host module's LaunchQueue (made with the first device's slots): eager slots' free lists, the
        # launch id counter, and the launches made in C++, newer than everything in `pending` (see
        # launch_native); _absorb() moves them here before the Python path reads or extends the queue.
        self.queue = None
        # Eager launches recorded so far: a check queued since the last one belongs to the call about to
        # launch, and that call does not raise it before its own launch (see queued()).
        self.eager_launches = 0
        # Some device has fewer than GRAPH_LOW_WATER graph slots left: the next eager forward takes the
        # Python path, which adds more.
        self.graph_low = False
        self.sync_checks = os.environ.get("FLASHDMOE_SYNC_CHECKS", "0") == "1"
        # Threads by serial number (idents are reused as soon as a thread ends): its latest forward's report.
        self.local = threading.local()
        self.serials = itertools.count(1)
        self.last_reports: dict[int, LaunchReport] = {}


_state = _State()


# ---- public ----
def set_sync_checks(enabled: bool) -> bool:
    """Debug mode: every fused forward waits for its kernel and raises its error from that call
    (``FLASHDMOE_SYNC_CHECKS=1`` sets it at import). Returns the previous setting. Costs a host
    synchronisation per forward; CUDA-graph captures are never checked at the call."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled={enabled!r}: expected True or False")
    previous, _state.sync_checks = _state.sync_checks, enabled
    return previous


def sync_checks() -> bool:
    """Whether the debug mode of :func:`set_sync_checks` is on."""
    return _state.sync_checks


def last_report() -> LaunchReport | None:
    """The :class:`flashdmoe.kernel.launch_report.LaunchReport` of the latest fused forward this thread ran
    (``None`` before the first). Cheap: decoding happens when its fields are read."""
    _absorb()
    me = _thread_serial()
    report = _state.last_reports.get(me)
    retired = None if _state.queue is None else _state.queue.take_retired_last(me)
    if retired is not None:  # this thread's latest launch made in C++, checked clean there
        launch_id, key, plan, block, info, raw = retired
        if report is None or launch_id > report.launch_id:
            report = LaunchReport(plan.shape, launch_id, None if key < 0 else key, info, _status_layout(), raw,
                                  routing=(plan.routing(block),))
            report.checked = True
            _state.last_reports[me] = report
    return report


def check_errors() -> None:
    """Raise the error of any fused launch that has finished and was not checked yet; never blocks.

    Checks, oldest first, every eager launch of this process whose completion words are set (and every
    finished asynchronous weight scan, :mod:`flashdmoe.weight_checks`), up to the first still running, and
    raises the first error found (:class:`flashdmoe.KernelTimeout` for a watchdog timeout, which also marks
    the launch's team failed; ``ValueError`` for non-finite router logits, or naming a weight that holds
    NaN / Inf; ``RuntimeError`` for another error word). Launches still running are left for later;
    CUDA-graph replays are checked by :func:`synchronize` only. Outside this function, errors surface at
    the next fused forward (launches that have finished by then), before a team's next use (waiting for its
    last launch), and at the call itself in debug mode (:func:`set_sync_checks`); see
    :mod:`flashdmoe.kernel.status_checks`.
    """
    _poll()


def synchronize(device: int | torch.device | None = None) -> None:
    """Wait for the GPU, then raise the first error of any fused launch not checked yet.

    ``device``: a CUDA device (index or ``torch.device``); ``None`` waits for every device that ran a
    fused launch. Checks every eager launch (oldest first), then every CUDA-graph-captured launch (the
    status its latest replay left; each error is raised once). Errors as :func:`check_errors`.
    """
    _absorb()
    if device is None:
        devices = sorted(set(_state.devices) | {entry.device for entry in list(_state.pending)})
    else:
        devices = [torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index]
        if devices == [None]:
            devices = [torch.cuda.current_device()]
    for index in devices:
        _synchronize_device(index)
    wanted = set(devices)
    while (report := _take(lambda r: r.device in wanted or r.ready())) is not None:
        _raise_if_failed(report)
    for index in devices:
        slots = _state.devices.get(index)
        if slots is not None:
            _check_graph_slots(slots)


#: Whether eager one-rank forwards may launch from C++ (flashdmoe.kernel.host_queue); off, every launch
#: takes the Python path (the benchmarks' and tests' baseline for the C++ path).
native_launches = True


# ---- used by the backend around a launch ----
def native_plan(ext: Any, prepared: Any, workspaces: Any, routing_words: int, routing_stride: int, stride: int,
                sync_bytes: int, stand_in_stream: Callable[[], int | None]):
    """A prepared one-rank launch for :func:`launch_native`: through the kernel module's C entry (its
    ``native_forward`` capsule) where it has one, else through its Python ``launch`` (the CPU stand-in),
    which then asks ``stand_in_stream()`` for the current stream (``None`` inside a capture).
    ``workspaces``: the pool's ``WorkspaceTable``; the rest as the backend's plan has them."""
    launcher = getattr(ext, "native_forward", None)
    if launcher is not None:
        return host_queue.module().native_plan(launcher, prepared, workspaces, routing_words, routing_stride, stride,
                                               sync_bytes)
    return host_queue.module().native_plan(ext.launch, prepared, workspaces, routing_words, routing_stride, stride,
                                           sync_bytes, stand_in_stream)


def launch_native(native: Any, plan: Any, x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor,
                  w2: torch.Tensor, saved_pre: torch.Tensor | None):
    """An eager one-rank forward launched by the host module in one call, on x's device (which must be
    the current one) and its current stream: ``(y, routing block)``, or ``None`` when the Python path must
    run it (another current device, a capture, an unchecked launch still running or one with an error,
    debug mode, a device without slots yet, too few graph slots, a workspace to grow or zero), with nothing
    changed but the earlier launches checked, as :func:`before_launch` checks them. ``plan``: the
    backend's plan (``shape`` and ``routing(block)`` make the report if the launch is ever reported)."""
    state = _state
    queue = state.queue
    # The host module's CallCache.launch (csrc/host/call_cache.h) reads these same conditions: keep in step.
    if state.sync_checks or state.graph_low or queue is None or not native_launches:
        return None
    if state.pending:  # older launches first, as before_launch checks them (may raise their error)
        if not queue.launchable(native, x):  # a capture checks nothing (before_launch)
            return None
        _poll(launching=True)
        if state.pending:
            return None
    return queue.launch(native, plan, x, router_weight, w1, w2, saved_pre, _thread_serial())


def before_launch(device: int, team: Any, capturing: bool, stream: int | None = None) -> None:
    """Surface finished launches' errors before a new launch, and settle ``team``'s last launch (waiting
    for it) unless it ran on ``stream``, the new forward's stream: the device stops a launch that follows a
    failed forward or backward exchange there (csrc/moe/params.cuh, TeamRankWords). Inside a capture only refuse a team
    whose last launch is unchecked."""
    unchecked = None if team is None else getattr(team, "unchecked_launch", None)
    if capturing:
        if device not in _state.devices:
            raise RuntimeError(
                f"the first flashdmoe forward on cuda:{device} ran inside a CUDA-graph capture; run one forward "
                "eagerly first (warm-up), which also allocates the pinned status slots the graph writes into"
            )
        if unchecked is not None:
            raise RuntimeError(
                f"team {team!r}: its last forward (launch {unchecked.launch_id}) was not checked yet and CUDA forbids "
                "waiting for it inside a graph capture; call flashdmoe.synchronize() before capturing"
            )
        return
    _absorb()
    slots = _state.devices.get(device)
    if slots is None:
        queue = _queue()
        with _state.lock:
            slots = _state.devices.get(device)
            if slots is None:
                slots = _state.devices[device] = _DeviceSlots(device, _status_layout(), queue)
    elif _state.graph_low:
        with _state.lock:
            for each in _state.devices.values():
                if len(each.graph_free) < GRAPH_LOW_WATER:
                    each.grow_graph_slots()
            _state.graph_low = False
    if unchecked is not None:
        settle_team(team, stream)
    if _state.pending:
        _poll(launching=True)


def before_backward(team: Any, forward: Any, stream: int | None, capturing: bool = False) -> None:
    """Before a team's backward on ``stream``: check ``forward`` (the report of the forward it
    differentiates, whose routing it reads; waits for it and for what was queued before it, oldest first,
    unless checked), and settle the team's last launch only if it ran on another stream. On the same stream
    the device stops the backward's exchange after a failed launch of the team (csrc/backward/ep_rows.cuh),
    so a model's backward queues each layer's behind the previous one's without waiting. Inside a capture
    nothing can be waited for: an eager launch not checked yet is refused (captured ones are the graph's)."""
    if capturing:
        for report in (forward, getattr(team, "unchecked_launch", None)):
            if report is not None and not report.captured and not report.checked:
                raise RuntimeError(
                    f"team {team!r}: launch {report.launch_id} ran eagerly and was not checked yet, and CUDA forbids "
                    "waiting for it inside a graph capture; call flashdmoe.synchronize() before capturing")
        return
    if forward is not None and not forward.checked:
        settle_through(forward)
    settle_team(team, stream)


def claim_slot(device: int, capturing: bool, ranks: int = 1) -> _Slot:
    """A free status slot for a launch of ``ranks`` ranks on ``device`` (eager: waits for the oldest launch
    when all are taken, which may raise its error)."""
    slots = _state.devices[device]
    if capturing:
        with _state.lock:
            if not slots.graph_free:
                raise RuntimeError(
                    f"no pinned status slot left for another captured flashdmoe launch on cuda:{device} ({GRAPH_CHUNK} "
                    "are added at each eager forward when fewer than "
                    f"{GRAPH_LOW_WATER} remain); run an eager forward between large captures"
                )
            slot = slots.graph_free.pop()
            if len(slots.graph_free) < GRAPH_LOW_WATER:
                _state.graph_low = True
            return slot
    while True:
        slot = slots.claim_eager()
        if slot is not None:
            slot.ranks = ranks
            return slot
        _absorb()
        with _state.lock:
            oldest = next((r for r in _state.pending
                           if not r.checked and r.device == device and isinstance(r, LaunchReport)), None)
        if oldest is None:
            raise RuntimeError(f"no status slot free on cuda:{device} and no unchecked launch holds one")
        settle(oldest)


def record_launch(slot: _Slot, launch: Callable[..., tuple[int, int, int]], args: tuple, shape: Any, device: int,
                  capturing: bool, *, team: Any = None, routing: tuple = (), forward: bool = True,
                  failed: Callable[[Exception], None] | None = None, stream: int | None = None) -> LaunchReport:
    """Launch on a claimed status slot and record the launch: ``launch(*args, slot.address)`` calls the
    extension (its status blocks go to that address) and returns its ``(grid, blocks_per_sm, smem_bytes)``.
    A launch that raises gives the slot back (``failed(error)`` first, where given). The report covers the
    slot's first ``len(shape.ranks)`` status blocks (``shape``: a
    :class:`flashdmoe.kernel.launch_report.LaunchShape`); then :func:`launched` (``team``, ``routing``,
    ``forward`` and ``stream`` as there and in :class:`LaunchReport`). A captured launch's slot belongs to its graph for
    good: never waited on, never given back."""
    try:
        info = launch(*args, slot.address)
    except Exception as error:
        slot.give_back()
        if failed is not None:
            failed(error)
        raise
    layout = _status_layout()
    source = slot.view[:len(shape.ranks) * layout.bytes]
    launch_id = _queue().next_id()
    if capturing:
        report = LaunchReport(shape, launch_id, device, info, layout, source, None, None, True, team, routing)
    else:
        report = LaunchReport(shape, launch_id, device, info, layout, source, slot, slot.give_back, False, team,
                              routing)
    launched(report, slot, team, forward, stream)
    return report


def launched(report: LaunchReport, slot: _Slot, team: Any, forward: bool = True, stream: int | None = None) -> None:
    """Record a started launch (its slot is its completion), or a captured launch's graph slot; then, in
    debug mode, check it (and what was queued before it) at once.
    ``forward``: a forward's launch, which :func:`last_report` then returns (a fused backward's is checked
    the same way but does not replace it). ``stream``: a team launch's stream (a forward's or a backward
    exchange's: the device stops the rank's later launches after either fails), where the team's next
    forward or backward need not wait for this one (:func:`before_launch`, :func:`before_backward`)."""
    if forward:
        _state.last_reports[_thread_serial()] = report
    if report.captured:
        slots = _state.devices[report.device]
        with _state.lock:
            slots.graph_reports[slots.graph_slot_number(slot)] = report
        return
    _absorb(report)
    if team is not None:
        team.unchecked_launch = report
        team.unchecked_stream = stream
    if _state.sync_checks:
        settle_through(report)


def queued(entry: Any) -> None:
    """Record a check queued on the device without a launch of its own (a
    :class:`flashdmoe.weight_checks.WeightScan`); it is checked with the launches, oldest first. A check
    queued by a forward before its launch surfaces after that launch (at the next forward, check_errors(),
    synchronize()), never from the forward's own pre-launch poll, however fast the device ran it."""
    _absorb(entry, launch=False)


def settle_through(last: Any = None) -> None:
    """Wait for and check every unchecked entry, oldest first, up to and including ``last`` (``None``: all
    of them): debug mode's check at the call. Raises the first error found."""
    _absorb()
    while (entry := _take(lambda entry: True)) is not None:
        _raise_if_failed(entry)
        if entry is last:
            return


def settle(report: LaunchReport) -> None:
    """Wait for ``report``'s launch and check it (raises its error) unless it was checked already."""
    with _state.lock:
        if report.checked:
            return
        report.checked = True  # stays in the queue; _take drops checked entries
    _raise_if_failed(report)  # keeping the status waits for it


def settle_team(team: Any, stream: int | None = None) -> None:
    """Before another use of ``team``: wait for and check its last launch, if unchecked, and every entry
    queued before it, oldest first (the first error raised is an earlier failed forward's, not the
    "ran nothing" of the launches the device stopped after it). Not if that launch ran on ``stream``, the
    new use's: there the device stops a launch that follows a failed one (csrc/moe/params.cuh)."""
    unchecked = getattr(team, "unchecked_launch", None)
    if stream is not None and getattr(team, "unchecked_stream", None) == stream:
        return
    if unchecked is not None and not unchecked.checked:  # settle_through would drain the whole queue
        settle_through(unchecked)


# ---- internals ----
def _status_layout() -> StatusLayout:
    return status_layout()


def _queue():
    """This state's ``flashdmoe_host.LaunchQueue`` (made on first use)."""
    queue = _state.queue
    if queue is None:
        with _state.lock:
            if _state.queue is None:
                layout = _status_layout()
                _state.queue = host_queue.module().LaunchQueue(layout.bytes, layout.done_word, layout.error_word,
                                                               layout.status_flags, SLOT_RANKS)
            queue = _state.queue
    return queue


def _absorb(then: Any = None, launch: bool = True) -> None:
    """Move the launches made in C++ (:func:`launch_native`) into the Python queue, oldest first, as
    reports of their own, then append ``then`` if given (a launch's report; with ``launch=False`` a check
    queued without a launch): one step under the lock, so that no other thread's entry lands between
    them. Their slots stay theirs until they are checked."""
    queue = _state.queue
    if then is None and (queue is None or not queue.outstanding()):
        return
    with _state.lock:
        if queue is not None and queue.outstanding():
            layout = _status_layout()
            for launch_id, key, index, plan, block, info, thread, latest in queue.take():
                device = None if key < 0 else key
                slot = _state.devices[device].eager[index]
                slot.ranks = 1
                report = LaunchReport(plan.shape, launch_id, device, info, layout, slot.view[:layout.bytes], slot,
                                      slot.give_back, False, None, (plan.routing(block),))
                _state.eager_launches += 1
                _state.pending.append(report)
                if latest:
                    earlier = _state.last_reports.get(thread)
                    if earlier is None or earlier.launch_id < launch_id:
                        _state.last_reports[thread] = report
        if then is not None:
            if launch:
                _state.eager_launches += 1
            else:
                then.queued_after = _state.eager_launches
            _state.pending.append(then)


def _thread_serial() -> int:
    """This thread's serial number (never reused, unlike thread idents); its end forgets its reports."""
    local = _state.local
    serial = getattr(local, "serial", None)
    if serial is None:
        serial = local.serial = next(_state.serials)
        local.mark = mark = _ThreadMark()  # released with the thread's local state
        weakref.finalize(mark, _forget_thread, weakref.ref(_state), serial)
    return serial


class _ThreadMark:
    """Lives in one thread's local state, and dies with it."""


def _forget_thread(state_ref: weakref.ref, serial: int) -> None:
    state = state_ref()
    if state is None:
        return
    state.last_reports.pop(serial, None)
    if state.queue is not None:
        state.queue.forget_thread(serial)


def _take(accept: Callable[[LaunchReport], bool] = lambda report: report.ready()) -> LaunchReport | None:
    """Pop the oldest unchecked launch if ``accept`` takes it (default: finished), marking it checked."""
    pending = _state.pending
    with _state.lock:
        while pending:
            head = pending[0]
            if head.checked:
                pending.popleft()
                continue
            if not accept(head):
                return None
            pending.popleft()
            head.checked = True
            return head
    return None


def _poll(launching: bool = False) -> None:
    """Check finished entries, oldest first, up to the first one still running (never blocks); before a
    launch (``launching``), also up to the first check queued by the launching call itself. The launches
    made in C++ are newer than every entry here: once these are checked, the host queue retires its
    finished clean ones itself, and a finished one with an error is taken over and raised."""
    pending, lock = _state.pending, _state.lock
    while True:
        while pending:
            with lock:
                if not pending:
                    break
                head = pending[0]
                if head.checked:  # checked elsewhere (settle): only drop it
                    pending.popleft()
                    continue
                if not head.ready():
                    return
                if launching and getattr(head, "queued_after", None) == _state.eager_launches:
                    return
                head.checked = True
                pending.popleft()
            _raise_if_failed(head)
        queue = _state.queue
        if queue is None or not queue.outstanding() or not queue.retire_finished():
            return
        _absorb()  # a finished launch with an error, and those after it: raised from here


def _raise_if_failed(report: LaunchReport) -> None:
    error = report.exception()  # keeps the status first (waiting for it), which frees its slot
    team = report.team
    if team is not None and getattr(team, "unchecked_launch", None) is report:
        team.unchecked_launch = None
    if error is None:
        return
    _fail_team(team, error)
    raise error


def _fail_team(team: Any, error: Exception) -> None:
    # Non-finite input leaves the team's signals consistent; a kernel error does not.
    if team is not None and not isinstance(error, ValueError) and getattr(team, "transport", "single") != "single":
        team.mark_failed(str(error))


def _dirty_graph_slots(slots: _DeviceSlots) -> list[int]:
    """Numbers of the graph slots whose error word or status flags are not zero (one pass per chunk, so
    a process with thousands of captured launches checks them in microseconds)."""
    if not slots.graph_reports:
        return []
    layout = _status_layout()
    words = [(layout.error_word, layout.error_word + 8), (layout.status_flags, layout.status_flags + 4)]
    last = max(slots.graph_reports)
    dirty = []
    for chunk, first in slots.graph_chunks:
        if first > last:
            break
        used = min(GRAPH_CHUNK, last - first + 1) * SLOT_RANKS  # blocks up to the last slot handed out
        blocks = chunk.numpy().reshape(-1, layout.bytes)[:used]
        hot = np.zeros(blocks.shape[0], dtype=bool)
        for start, end in words:
            hot |= blocks[:, start:end].any(axis=1)
        dirty.extend(first + int(block) // SLOT_RANKS for block in np.flatnonzero(hot))
    return sorted(set(dirty))


def _check_graph_slots(slots: _DeviceSlots) -> None:
    """Raise the first error a captured launch's latest replay left (the device is idle), once."""
    for number in _dirty_graph_slots(slots):
        with _state.lock:
            report = slots.graph_reports.get(number)
        if report is None:
            continue
        error = report.exception()
        if error is None:
            continue
        report.clear_captured_status()
        _fail_team(report.team, error)
        raise error
