"""What one launch of the fused kernel reported, decoded from its status words on request.

Every rank of a launch has a status block (``csrc/moe/params.cuh``: error word, phase clock, traffic
counters, status flags) that the kernel's last block writes into pinned host memory as it exits; nothing
waits for it. A :class:`LaunchReport` holds those bytes and decodes them when asked: the error and the
non-finite flag when the launch is checked (:mod:`flashdmoe.kernel.status_checks`), the per-phase times and the
bytes sent only when read, and the traffic against the routing (a GPU reduction) only in
:meth:`LaunchReport.traffic`.

This module touches no CUDA API itself: the launch's completion (an object with ``query()`` and
``synchronize()``: the status slot, which reads the completion words the kernel sets), the status bytes
and the routing tensors are handed in, so the decoding is tested on the CPU with synthetic status bytes.
"""

from __future__ import annotations

import enum
import functools
import struct
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from flashdmoe.kernel import extension
from flashdmoe.errors import KernelTimeout, TeamFailed

__all__ = ["ErrorKind", "KernelError", "LaunchReport", "LaunchShape", "PHASE_CLOCK_NAMES", "PHASE_NAMES", "RankStatus",
           "StatusLayout"]


class ErrorKind(enum.IntEnum):
    """Bits 0-7 of the error word (``csrc/moe/params.cuh``, ``enum ErrorKind``)."""

    NONE = 0
    TIMEOUT = 1
    SEQUENCE = 2  # a team rank's forwards (or, with a backward phase, backward exchanges) used up 2^31 - 1 numbers
    TEAM_FAILED = 3  # the rank ran nothing: an earlier launch of its team failed (bits 32-63: FAILED_IN_BACKWARD
    # plus a backward's sequence number, or a forward's number)


#: The bit of a TEAM_FAILED error's number that says the failure was a backward's exchange (csrc/moe/params.cuh,
#: kTeamFailedInBackward); the rest is that backward's number.
FAILED_IN_BACKWARD = 1 << 31


# Phase ids the kernel's watchdog writes (csrc/moe/params.cuh, enum Phase).
PHASE_NAMES = {
    1: "grid barrier after the gate",
    2: "grid barrier after the per-expert offsets",
    3: "grid barrier after dispatch",
    4: "expert GEMM2 tile waiting for its GEMM1 row tile",
    5: "grid barrier before the combine",
    6: "wait for a peer's per-expert row counts",
    7: "expert GEMM1 tile waiting for a peer's dispatched rows",
    8: "combine waiting for a peer's expert results",
    9: "expert tile pipeline (a TMA stage that never filled or was never released)",
    10: "backward: grid barrier after the kept rows were counted",
    11: "backward: grid barrier after dy's and x's rows were gathered",
    12: "backward: dx tile waiting for its row tile's g tiles",
    13: "backward: weight-gradient tile waiting for its expert's g tiles",
    14: "backward exchange: waiting for an expert owner to free its staging for this rank's rows",
    15: "backward exchange: grid barrier after the rows to the owners were written",
    16: "backward exchange: waiting for a source's dy and x rows",
    17: "backward exchange: waiting for a source to free its staging for the dx rows",
    18: "backward exchange: grid barrier after the dx rows were written",
    19: "backward exchange: waiting for an owner's dx rows and weight gradients",
    20: "backward exchange: waiting for a peer to free its staging for this rank's share of the router's gradient",
    21: "backward exchange: grid barrier after this rank's share of the router's gradient was written",
    22: "backward exchange: waiting for a peer's share of the router's gradient",
    23: "hierarchical exchange: waiting for a relay on another node to free this rank's batch region",
    24: "hierarchical exchange: a relay waiting for a source's batch of rows",
    25: "hierarchical exchange: grid barrier after the relayed rows were stored",
    26: "combine: a copy of result rows into shared memory that never landed",
}
#: The backward exchange's phases (csrc/backward/ep_rows.cuh, EpBackwardPhase).
BACKWARD_EXCHANGE_PHASES = range(14, 23)

# Intervals between consecutive phase clock slots (slot 0 start, 1..4 after the grid barriers, 5 exit).
PHASE_CLOCK_NAMES = ("gate", "offsets", "dispatch", "experts", "combine")

_ZERO8, _ZERO4 = bytes(8), bytes(4)
_U64 = struct.Struct("<Q")
_U64X2 = struct.Struct("<QQ")
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class StatusLayout:
    """Byte offsets inside one rank's status block (the extension's ``status_layout()``)."""

    bytes: int
    error_word: int
    phase_clock: int
    phase_clock_slots: int
    traffic: int
    nvshmem_traffic: int
    status_flags: int
    done_word: int

    @classmethod
    def from_mapping(cls, mapping) -> "StatusLayout":
        return cls(**{name: int(mapping[name]) for name in cls.__dataclass_fields__})


@functools.lru_cache(maxsize=1)
def status_layout() -> StatusLayout:
    """Offsets inside a rank's status block, from the built extension (csrc/moe/params.cuh); asked once
    (``status_layout.cache_clear()`` when the extension is replaced, as the tests' stand-in does)."""
    return StatusLayout.from_mapping(extension.loaded().status_layout())


@dataclass(frozen=True)
class KernelError:
    """A rank's error word, decoded: ``kind`` (:class:`ErrorKind` or another code), the ``phase`` that was
    waiting, the ``peer`` rank it waited on and the ``block`` that saw it first."""

    rank: int
    kind: int
    phase: int
    peer: int
    block: int
    word: int

    @classmethod
    def from_word(cls, rank: int, word: int) -> "KernelError":
        return cls(rank=rank, kind=word & 0xFF, phase=(word >> 8) & 0xFF, peer=(word >> 16) & 0xFFFF,
                   block=word >> 32, word=word)

    @property
    def timed_out(self) -> bool:
        return self.kind == ErrorKind.TIMEOUT

    @property
    def phase_name(self) -> str:
        return PHASE_NAMES.get(self.phase, f"phase {self.phase}")

    def describe(self) -> str:
        if self.timed_out:
            return (f"rank {self.rank} timed out in the {self.phase_name} (waiting on rank {self.peer}; first seen "
                    f"by block {self.block})")
        if self.kind == ErrorKind.SEQUENCE:
            what = "backward exchanges" if self.phase in BACKWARD_EXCHANGE_PHASES else "forwards"
            return (f"rank {self.rank}: the team's {what} used up their 2^31 - 1 sequence numbers (the kernel ran "
                    "nothing); make a new team")
        if self.kind == ErrorKind.TEAM_FAILED:
            which = (f"backward number {self.block - FAILED_IN_BACKWARD}" if self.block & FAILED_IN_BACKWARD
                     else f"forward number {self.block}")
            return (f"rank {self.rank} ran nothing: its team's {which} failed earlier (that launch's error says "
                    "why); make a new team")
        return f"rank {self.rank} reported error word {self.word:#x}"


@dataclass(frozen=True)
class RankStatus:
    """One rank's status block, decoded.

    ``phase_ms``: milliseconds per phase (:data:`PHASE_CLOCK_NAMES`), ``None`` when the launch failed or a
    phase was not stamped. ``dispatch_bytes`` / ``combine_bytes``: token rows and results this rank sent
    its peers (every transport); ``nvshmem_dispatch_bytes`` / ``nvshmem_combine_bytes``: the part of them
    that went through NVSHMEM puts (0 for peers reached by peer-pointer stores).
    """

    rank: int
    error: KernelError | None
    nonfinite_logits: bool
    phase_ms: dict[str, float] | None
    dispatch_bytes: int
    combine_bytes: int
    nvshmem_dispatch_bytes: int
    nvshmem_combine_bytes: int


def read_error_and_flags(raw, at: int, layout: StatusLayout) -> tuple[int, int]:
    """(error word, status flags) of the block at byte ``at`` of ``raw``: all a check needs."""
    return _U64.unpack_from(raw, at + layout.error_word)[0], _U32.unpack_from(raw, at + layout.status_flags)[0]


def decode_rank(raw, at: int, layout: StatusLayout, rank: int) -> RankStatus:
    """Decode the status block at byte ``at`` of ``raw`` for global rank ``rank``."""
    word, flags = read_error_and_flags(raw, at, layout)
    clock = [_U64.unpack_from(raw, at + layout.phase_clock + 8 * i)[0] for i in range(layout.phase_clock_slots)]
    phase_ms = None
    if not word and all(clock):
        phase_ms = {name: (clock[i + 1] - clock[i]) / 1e6 for i, name in enumerate(PHASE_CLOCK_NAMES)}
    dispatch, combine = _U64X2.unpack_from(raw, at + layout.traffic)
    nvshmem_dispatch, nvshmem_combine = _U64X2.unpack_from(raw, at + layout.nvshmem_traffic)
    return RankStatus(rank=rank, error=KernelError.from_word(rank, word) if word else None,
                      nonfinite_logits=bool(flags & 1), phase_ms=phase_ms, dispatch_bytes=dispatch,
                      combine_bytes=combine, nvshmem_dispatch_bytes=nvshmem_dispatch,
                      nvshmem_combine_bytes=nvshmem_combine)


@dataclass(frozen=True)
class LaunchShape:
    """What a report needs to know about its launch, fixed per prepared launch: the global ``ranks`` it
    ran, ``tokens`` per rank, ``local_experts`` per rank, ``row_bytes`` (H x element size) and the
    watchdog's ``timeout_ms``."""

    ranks: tuple[int, ...]
    tokens: tuple[int, ...]
    local_experts: int
    row_bytes: int
    timeout_ms: int


class LaunchReport:
    """The report of one launch of the fused kernel (one rank, or every rank of an emulated team).

    Attributes:
        launch_id: this process's launch counter (1, 2, ...), quoted in errors raised later.
        device: the CUDA device index.
        ranks: the global ranks the launch ran (``(0,)`` for one rank, ``0..P-1`` for an emulated team,
            this process's rank for an NVSHMEM team).
        tokens: tokens per rank.
        grid, blocks_per_sm, smem_bytes: the launch's grid, resident blocks per SM and dynamic shared
            memory per block.
        captured: the launch was recorded into a CUDA graph; the status then holds the last replay's.
        checked: its status was checked (errors raised) by :mod:`flashdmoe.kernel.status_checks`.
        timeout_ms: the watchdog's limit for this launch.

    Reading the status (:attr:`statuses`, :attr:`error`, :attr:`phase_ms`, ...) waits for the launch if it
    is still running (a captured launch: call :func:`flashdmoe.synchronize` after the replay first).
    """

    __slots__ = ("launch_id", "device", "grid", "blocks_per_sm", "smem_bytes", "captured", "checked", "_shape",
                 "_layout", "_source", "_completion", "_release", "_raw", "_statuses", "_team", "_routing")

    def __init__(self, shape: LaunchShape, launch_id: int, device: int, launch_info: tuple[int, int, int],
                 layout: StatusLayout, source, completion=None, release: Callable[[], None] | None = None,
                 captured: bool = False, team: Any = None, routing: tuple = ()) -> None:
        """``source``: the status bytes of every rank (pinned memory), read once ``completion`` (``query()``
        never blocks, ``synchronize()`` waits; ``None`` for a captured launch) reports the launch done;
        ``release`` hands the pinned slot back once the bytes are kept; ``routing``: per rank an object with
        the ``expert`` and ``row`` tensors (:class:`flashdmoe.cuda_backend.FusedRouting`)."""
        self.launch_id = launch_id
        self.device = device
        self.grid, self.blocks_per_sm, self.smem_bytes = launch_info
        self.captured = captured
        self.checked = False
        self._shape = shape
        self._layout = layout
        self._source = source
        self._completion = completion
        self._release = release
        self._raw: bytes | None = None
        self._statuses: tuple[RankStatus, ...] | None = None
        if captured:  # a graph's outputs and its team belong to the user: refer to them weakly
            self._team = None if team is None else weakref.ref(team)
            self._routing = tuple((weakref.ref(r.expert), weakref.ref(r.row)) for r in routing)
        else:
            self._team = team
            self._routing = routing

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._shape.ranks

    @property
    def tokens(self) -> tuple[int, ...]:
        return self._shape.tokens

    @property
    def timeout_ms(self) -> int:
        return self._shape.timeout_ms

    @property
    def routing(self) -> tuple:
        """Per rank, the routing the launch produced (:class:`flashdmoe.cuda_backend.FusedRouting`:
        ``expert``, ``weight``, ``row``, ``counts``); eager launches only (a report does not keep a
        graph's outputs alive)."""
        if self.captured:
            raise RuntimeError(f"{self!r}: a captured launch's report does not keep its routing outputs")
        return tuple(self._routing)

    def __repr__(self) -> str:
        state = "captured" if self.captured else ("checked" if self.checked else "pending")
        return (f"LaunchReport(launch_id={self.launch_id}, device={self.device}, ranks={self.ranks}, grid={self.grid}, "
                f"{state})")

    # ---- completion ----
    @property
    def team(self):
        return self._team() if self.captured and self._team is not None else self._team

    def ready(self) -> bool:
        """Whether the status words are on the host (never blocks)."""
        completion = self._completion
        if self._raw is not None or completion is None:
            return True
        if completion.query():
            self._completion = None  # done: keeping the status needs no wait
            return True
        return False

    def wait(self) -> None:
        """Block until the status words are on the host."""
        if self._raw is None and self._completion is not None:
            self._completion.synchronize()

    def keep_status(self) -> None:
        """Copy the finished status bytes out of the pinned slot and hand the slot back (eager launches)."""
        if self._raw is not None or self.captured:
            return
        completion = self._completion
        if completion is not None:
            completion.synchronize()
        self._raw = bytes(self._source) if self._source is not None else b""
        self._source = self._completion = None
        release = self._release
        if release is not None:
            self._release = None
            release()

    def _bytes(self):
        if self._raw is not None:
            return self._raw
        if self.captured:
            return self._source
        self.keep_status()
        return self._raw

    # ---- quick check (error words and flags only) ----
    def clean(self) -> bool:
        """No rank reported an error or a status flag (the common case, checked without decoding)."""
        raw = self._raw
        if raw is None:
            raw = self._bytes()
        layout = self._layout
        error, flags, ranks = layout.error_word, layout.status_flags, len(self._shape.ranks)
        if ranks == 1:  # the common case
            return raw[error:error + 8] == _ZERO8 and raw[flags:flags + 4] == _ZERO4
        for at in range(0, ranks * layout.bytes, layout.bytes):
            if raw[at + error:at + error + 8] != _ZERO8 or raw[at + flags:at + flags + 4] != _ZERO4:
                return False
        return True

    def error_words(self) -> list[tuple[int, int, int]]:
        """``(rank, error word, status flags)`` per rank, read without decoding the rest."""
        raw = self._bytes()
        size = self._layout.bytes
        return [(rank, *read_error_and_flags(raw, i * size, self._layout)) for i, rank in enumerate(self.ranks)]

    def exception(self) -> Exception | None:
        """The exception this launch's status calls for, or ``None``: :class:`flashdmoe.KernelTimeout` when
        a rank's watchdog fired, :class:`flashdmoe.errors.TeamFailed` when every failed rank ran nothing
        because an earlier forward of its team had failed, ``RuntimeError`` for another error kind,
        ``ValueError`` when a rank's router logits were not finite (NaN or Inf in ``x`` or
        ``router_weight``). Keeps the status first (waiting for the launch)."""
        if self.clean():
            return None
        words = self.error_words()
        errors = [KernelError.from_word(rank, word) for rank, word, _ in words if word]
        where = self._where()
        if errors:
            timed_out = any(e.timed_out for e in errors)
            limit = f"; timeout {self.timeout_ms} ms (FLASHDMOE_TIMEOUT_MS)" if timed_out else ""
            message = "flashdmoe kernel: " + "; ".join(e.describe() for e in errors) + limit + where
            if timed_out:
                return KernelTimeout(message)
            if all(e.kind == ErrorKind.TEAM_FAILED for e in errors):
                return TeamFailed(message)
            return RuntimeError(message)
        nonfinite = [rank for rank, _, flags in words if flags & 1]
        if nonfinite:
            ranks = "" if len(self.ranks) == 1 else f" (rank {', '.join(map(str, nonfinite))})"
            return ValueError(f"x or router_weight{ranks}: expected finite values, the router logits contain NaN "
                              f"or Inf{where}")
        return None

    def _where(self) -> str:
        tokens = ", ".join(map(str, self.tokens))
        what = "a CUDA-graph replay of launch" if self.captured else "launch"
        return f" [{what} {self.launch_id} on cuda:{self.device}, tokens per rank {tokens}]"

    def clear_captured_status(self) -> None:
        """Zero a captured launch's status slot once its error was raised, so it is reported once."""
        if self.captured and self._source is not None:
            self._source[:] = bytes(len(self._source))

    # ---- decoded on request ----
    @property
    def statuses(self) -> tuple[RankStatus, ...]:
        """Every rank's decoded status block, in :attr:`ranks` order."""
        if self._statuses is not None:
            return self._statuses
        raw = self._bytes()
        size = self._layout.bytes
        statuses = tuple(decode_rank(raw, i * size, self._layout, rank) for i, rank in enumerate(self.ranks))
        if not self.captured:  # a captured launch's slot changes with every replay
            self._statuses = statuses
        return statuses

    @property
    def error(self) -> KernelError | None:
        """The first rank's error, or ``None``."""
        return next((s.error for s in self.statuses if s.error is not None), None)

    @property
    def nonfinite_ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.statuses if s.nonfinite_logits)

    @property
    def phase_ms(self) -> dict[str, float] | None:
        """Per-phase milliseconds of the first rank (block 0's view), ``None`` if the launch failed."""
        return self.statuses[0].phase_ms if self.statuses else None

    def traffic(self) -> list[dict]:
        """Bytes each rank wrote into its peers, against what was routed to other ranks.

        One dict per rank: ``rank``, ``dispatch_bytes`` (token rows sent into peers' receive buffers),
        ``combine_bytes`` (result rows sent into peers' combine buffers), ``nvshmem_dispatch_bytes`` /
        ``nvshmem_combine_bytes`` (the part of those two that went through NVSHMEM puts, the rest being
        peer-pointer stores), ``rows_routed_remote`` (kept choices whose expert lives on another rank) and
        ``payload_efficiency`` (``dispatch_bytes / (rows_routed_remote * H * element size)``; 1.0: no byte
        beyond the routed rows; ``None`` when nothing was routed remote). Reduces the routing on the GPU
        (synchronises).
        """
        report = []
        shape = self._shape
        for status, routing in zip(self.statuses, self._routing):
            if self.captured:
                expert, row = routing[0](), routing[1]()
                if expert is None or row is None:
                    raise RuntimeError(f"{self!r}: the routing outputs of this captured launch no longer exist")
            else:
                expert, row = routing.expert, routing.row
            owner = expert.long() // shape.local_experts
            remote = int(((row >= 0) & (owner != status.rank)).sum().item())
            payload = remote * shape.row_bytes
            report.append({
                "rank": status.rank, "dispatch_bytes": status.dispatch_bytes, "combine_bytes": status.combine_bytes,
                "nvshmem_dispatch_bytes": status.nvshmem_dispatch_bytes,
                "nvshmem_combine_bytes": status.nvshmem_combine_bytes,
                "rows_routed_remote": remote,
                "payload_efficiency": (status.dispatch_bytes / payload) if payload else None,
            })
        return report
