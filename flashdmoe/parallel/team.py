"""Teams: how the ranks of an expert-parallel MoE reach each other (docs/design.md §6, §7).

A team of ``P`` ranks splits the ``E`` experts ``L = E / P`` per rank. Every rank owns three *symmetric*
buffers (same size on every rank, so a peer can address them):

* ``recv  [P, stream_rows, H]`` (input dtype): rows other ranks dispatch to this rank's experts, one
  region per source rank;
* ``comb  [P, stream_rows, H]`` (input dtype): expert results for this rank's tokens, one region per
  rank that computed them;
* ``signals`` int32: the forward's ``P * L + 5 * P`` words (per-source counts, the counts / rows-ready /
  results-done flags and the hierarchical exchange's batch-in / batch-free flags, each flag holding the
  sequence number of the forward that wrote it, never cleared by the host), then the backward's (:attr:`BufferPlan.backward_words`: its flags, abort words, each owner's
  place table and one word per staged row, ``csrc/backward/ep_rows.cuh``).

``stream_rows = max_tokens * min(top_k, L)``: the most rows one rank can send to one other rank, so a
dropless batch never overflows. The sizes are fixed when the team is made (:class:`BufferPlan`) and a
larger batch raises ``ValueError``.

Transports:

* :meth:`Team.single` -- one rank; the kernel's buffers come from its (pooled) workspace.
* :meth:`Team.emulated` -- ``P`` virtual ranks on one GPU, in one process and one kernel launch; the
  "peer pointers" are the other virtual ranks' buffers. Tests the whole device protocol on one GPU.
* :meth:`Team.nvshmem` -- one process per rank; nvshmem4py unique-id init, buffers from
  ``nvshmem.core.tensor``, peer pointers from ``nvshmem.core.get_peer_tensor`` (NVLink / same-GPU
  load-store). Several processes may share one GPU under MPS (docs/design.md §6.3).

A team runs one forward at a time, in stream order: its buffers are shared by all its launches.

A team that saw a kernel failure (timeout) is *failed*: its signal words are in an unknown state, so
every later use raises; tear it down and make a new one. A forward does not wait for its kernel, nor a
forward or backward for the team's previous launch on the same stream: the device keeps that order safe,
since a rank's launch after a failed forward or backward exchange runs nothing (:attr:`Team.device_words`).
The team's last launch is checked (waiting for it if needed) before a use on another stream and at
:meth:`Team.barrier`, and a backward checks its own forward first, so a timeout still reaches every rank
(flashdmoe/kernel/status_checks.py).

Sequence numbers and CUDA graphs: each rank counts its forwards on the device (:attr:`Team.device_words`);
a launch publishes count + 1 and its last block stores it back, so a CUDA graph's replays advance the count
exactly as eager forwards do, and an emulated or NVSHMEM team's forward can be captured and replayed
(every rank replays, in the same order as its peers, as with eager calls). A backward's exchange is
counted the same way, in a word of the rank's signals (:meth:`Team.backward_count`), so a whole training
step can be captured too. After 2^31 - 1 forwards (or backwards) the kernel refuses to run (the flags would
wrap) and the team fails.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from flashdmoe.errors import TeamFailed

__all__ = ["BufferPlan", "EXCHANGES", "RankBuffers", "Team", "TeamFailed", "MAX_RANKS"]

#: Most ranks one team (or one emulated launch) holds: the kernel's peer table (csrc/moe/params.cuh).
MAX_RANKS = 8
#: Size of an NVSHMEM unique id in bytes.
UNIQUE_ID_BYTES = 128
# How a team's forward rows reach owners on other nodes (Team.nvshmem's ``exchange``).
EXCHANGES = ("direct", "hierarchical")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    return value


@dataclass(frozen=True)
class BufferPlan:
    """What one rank's symmetric buffers are sized for.

    max_tokens: most tokens one rank may pass per forward; hidden: H; top_k: k; local_experts: L;
    dtype: the token dtype (bf16 or fp16); world_size: P.
    """

    world_size: int
    max_tokens: int
    hidden: int
    top_k: int
    local_experts: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size)
        if self.world_size > MAX_RANKS:
            raise ValueError(f"world_size={self.world_size}: expected at most {MAX_RANKS} ranks per team")
        _positive_int("max_tokens", self.max_tokens)
        _positive_int("hidden", self.hidden)
        _positive_int("top_k", self.top_k)
        _positive_int("local_experts", self.local_experts)
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"dtype={self.dtype}: expected torch.bfloat16 or torch.float16")

    @property
    def stream_rows(self) -> int:
        """Rows one source can send one destination: ``max_tokens * min(top_k, L)``."""
        return self.max_tokens * min(self.top_k, self.local_experts)

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def data_bytes(self) -> int:
        """Bytes of ``recv`` (and of ``comb``)."""
        return self.world_size * self.stream_rows * self.hidden * self.element_bytes

    @property
    def forward_signal_words(self) -> int:
        """The forward kernel's signal words (``csrc/moe/params.cuh`` ``signal_words``): counts, three flags
        per peer, and the hierarchical exchange's two."""
        return self.world_size * self.local_experts + 5 * self.world_size

    def relay_batch_layout(self) -> tuple[int, int]:
        """(rows offset, bytes) of one batch region of the hierarchical exchange (``csrc/moe/params.cuh``
        ``RelayParams``): a 16-byte header, ``top_k`` 8-byte records per row, then ``max_tokens`` rows at a
        128-byte aligned offset; the region rounded up to 128 bytes."""
        rows_offset = -(-(16 + 8 * self.max_tokens * self.top_k) // 128) * 128
        total = rows_offset + self.max_tokens * self.hidden * self.element_bytes
        return rows_offset, -(-total // 128) * 128

    def relay_bytes(self, nodes: int) -> int:
        """The hierarchical exchange's symmetric buffer of one rank: a batch region per node out, one per
        node in."""
        return 2 * nodes * self.relay_batch_layout()[1]

    @property
    def backward_words(self) -> int:
        """The backward exchange's words after the forward's (``EpSignalLayout``): 6P flags (free and ready,
        three directions), 3 abort words, the rank's count of backward exchanges, P*L place words (one per
        owner and local expert) and one word per staged row (``P * stream_rows``)."""
        P = self.world_size
        return 6 * P + 4 + P * self.local_experts + P * self.stream_rows

    @property
    def signal_words(self) -> int:
        return self.forward_signal_words + self.backward_words

    def backward_word(self, what: str, a: int, b: int) -> int:
        """Index of a backward word in a rank's signals (mirrors ``EpSignalLayout``): ``("free" | "ready",
        direction, peer)``, ``("abort", i, 0)`` (i < 3), ``("sequence", 0, 0)`` (the rank's backward exchanges
        so far), ``("place", owner, local expert)``, ``("row_word", source, stream row)`` (word ``("row_word",
        0, r)`` is also staged row ``r``)."""
        P, L, base = self.world_size, self.local_experts, self.forward_signal_words
        if what == "free":
            return base + 2 * a * P + b
        if what == "ready":
            return base + (2 * a + 1) * P + b
        if what == "abort":
            return base + 6 * P + a
        if what == "sequence":
            return base + 6 * P + 3
        if what == "place":
            return base + 6 * P + 4 + a * L + b
        if what == "row_word":
            return base + 6 * P + 4 + P * L + a * self.stream_rows + b
        raise ValueError(f"what={what!r}: expected 'free', 'ready', 'abort', 'sequence', 'place' or 'row_word'")

    @property
    def stage_rows(self) -> int:
        """Rows of the backward's staging for NVSHMEM peers: every kept choice of a batch, ``max_tokens * k``."""
        return self.max_tokens * self.top_k

    @property
    def stage_bytes(self) -> int:
        """The backward exchange's staging for peers reached by NVSHMEM puts (``EpStage``): x and dy rows and
        combine weights of ``stage_rows`` choices, then one weight-gradient word per staged row
        (``P * stream_rows``); rounded up to 16 bytes."""
        words = self.stage_rows + self.world_size * self.stream_rows
        return -(-(2 * self.stage_rows * self.hidden * self.element_bytes + 4 * words) // 16) * 16

    @property
    def bytes_per_rank(self) -> int:
        """Symmetric memory one rank holds: recv + comb + signals (plus :attr:`stage_bytes` in a team with
        NVSHMEM peers)."""
        return 2 * self.data_bytes + 4 * self.signal_words

    def check_batch(self, tokens: int, hidden: int, top_k: int, local_experts: int, dtype: torch.dtype,
                    rank: int | None = None) -> None:
        """Raise ``ValueError`` if a batch does not fit what the buffers were sized for."""
        where = "" if rank is None else f" (rank {rank})"
        if tokens > self.max_tokens:
            raise ValueError(
                f"x{where}: {tokens} tokens, but the team's buffers were sized for max_tokens={self.max_tokens} "
                "per rank; make the team with a larger max_tokens"
            )
        for name, got, want in (("hidden", hidden, self.hidden), ("top_k", top_k, self.top_k),
                                ("local experts", local_experts, self.local_experts)):
            if got != want:
                raise ValueError(f"{name}{where}: got {got}, but the team's buffers were sized for {want}")
        if dtype != self.dtype:
            raise ValueError(f"x{where}: dtype {dtype}, but the team's buffers were sized for {self.dtype}")


@dataclass
class RankBuffers:
    """One rank's symmetric buffers (uint8 / int32 tensors on its GPU) and the kernel's peer table: the
    addresses it writes peer q's buffers at (``peer_recv[q]``, ``peer_comb[q]``, ``peer_signals[q]``; for a
    peer reached through NVSHMEM, staging addresses in this rank's own buffers, see
    :func:`flashdmoe.parallel.nvshmem_transport.kernel_peer_table`). ``mapped_recv[q]`` / ``mapped_comb[q]``: q's
    buffers as this rank maps them (load/store), ``None`` without a mapping (default: the peer table)."""

    recv: torch.Tensor
    comb: torch.Tensor
    signals: torch.Tensor
    stage: torch.Tensor | None = None  # the backward's staging for NVSHMEM peers (BufferPlan.stage_bytes)
    relay: torch.Tensor | None = None  # the hierarchical exchange's batches (BufferPlan.relay_bytes)
    peer_recv: list[int] = field(default_factory=list)
    peer_comb: list[int] = field(default_factory=list)
    peer_signals: list[int] = field(default_factory=list)
    mapped_recv: list[int | None] = field(default_factory=list)
    mapped_comb: list[int | None] = field(default_factory=list)
    mapped_signals: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        # A table given without mappings is all load/store mappings (emulated teams, tests).
        if not self.mapped_recv and not self.mapped_comb:
            self.mapped_recv, self.mapped_comb = list(self.peer_recv), list(self.peer_comb)
        if not self.mapped_signals:
            self.mapped_signals = list(self.peer_signals)


def _torch_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device}: expected a CUDA device")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Team:
    """The ranks of one expert-parallel MoE and their symmetric buffers.

    Attributes:
        transport: ``"single"``, ``"emulated"`` or ``"nvshmem"``.
        rank: this process's rank (``0`` for single and emulated teams, which hold every rank).
        world_size: ``P``.
        plan: the :class:`BufferPlan` (``None`` for a single team: its buffers are per call).
    """

    def __init__(self, transport: str, rank: int, world_size: int, plan: BufferPlan | None,
                 buffers: list[RankBuffers], device: torch.device | None) -> None:
        self.transport = transport
        self.rank = rank
        self.world_size = world_size
        self.plan = plan
        self.buffers = buffers  # one entry per rank this process drives (P for emulated, 1 otherwise)
        self.device = device
        # Per rank driven here, [forwards so far, number of the first forward (or, with bit 31, backward
        # exchange) that failed (0: none)], kept by the kernels (csrc/moe/params.cuh, TeamRankWords): a
        # forward's flags carry count + 1, and a launch after a failed one runs nothing.
        self.device_words = (None if transport == "single"
                             else torch.zeros((len(buffers), 2), dtype=torch.int32, device=device))
        self._failure: str | None = None
        self._closed = False
        # The backend's state for this team: its last launch not checked yet (a LaunchReport), and the
        # launches it prepared (per batch shape and options).
        self.unchecked_launch = None
        # The stream of unchecked_launch: a forward or backward on it need not wait for it.
        self.unchecked_stream: int | None = None
        self.launch_plans: dict = {}
        # How the kernel reaches each peer ("p2p": stores through a mapping; "nvshmem": NVSHMEM puts).
        self.peer_transports: list[str] = ["p2p"] * world_size
        self.unique_id: bytes = b""  # NVSHMEM teams: the id the team was bootstrapped with
        self.ranks_per_node: int | None = None  # NVSHMEM teams: an emulated node layout (Team.nvshmem)
        self.exchange = "direct"  # NVSHMEM teams: how rows cross nodes ("direct" or "hierarchical")
        # NVSHMEM teams: the launch reports of the last backward exchange
        # (flashdmoe.backward.ep_backward.exchange_traffic).
        self.backward_reports: tuple = ()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("failed" if self._failure else "ok")
        return f"Team(transport={self.transport!r}, rank={self.rank}, world_size={self.world_size}, {state})"

    # ---- constructors ----
    @classmethod
    def single(cls) -> "Team":
        """One rank: dispatch and combine target itself."""
        return cls("single", 0, 1, None, [], None)

    @classmethod
    def emulated(cls, world_size: int, *, max_tokens: int, hidden: int, top_k: int, local_experts: int,
                 dtype: torch.dtype = torch.bfloat16, device=None) -> "Team":
        """``world_size`` virtual ranks on one GPU, run by one kernel launch per forward.

        Sized for batches of at most ``max_tokens`` tokens per rank of width ``hidden`` with ``top_k``
        choices over ``world_size * local_experts`` experts, in ``dtype``.
        """
        plan = BufferPlan(world_size, max_tokens, hidden, top_k, local_experts, dtype)
        device = _torch_device(device)
        # All ranks' signal words in one allocation, 128-byte aligned per rank.
        stride = -(-plan.signal_words // 32) * 32
        signal_block = torch.zeros(world_size * stride, dtype=torch.int32, device=device)
        recv = [torch.empty(plan.data_bytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
        comb = [torch.empty(plan.data_bytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
        signals = [signal_block[r * stride:r * stride + plan.signal_words] for r in range(world_size)]
        tables = {"peer_recv": [t.data_ptr() for t in recv], "peer_comb": [t.data_ptr() for t in comb],
                  "peer_signals": [t.data_ptr() for t in signals]}
        # every rank reaches every other by load/store (one process, one GPU): the tables are also the mappings
        buffers = [RankBuffers(recv=recv[r], comb=comb[r], signals=signals[r],
                               **{name: list(table) for name, table in tables.items()})
                   for r in range(world_size)]
        return cls("emulated", 0, world_size, plan, buffers, device)

    @staticmethod
    def make_unique_id() -> bytes:
        """A fresh 128-byte NVSHMEM unique id (rank 0 makes it; every rank passes it to :meth:`nvshmem`)."""
        nvshmem = _nvshmem()
        uid = nvshmem.get_unique_id()
        data = bytes(uid._data.tobytes())
        if len(data) != UNIQUE_ID_BYTES:
            raise RuntimeError(f"nvshmem unique id has {len(data)} bytes; expected {UNIQUE_ID_BYTES}")
        return data

    @classmethod
    def nvshmem(cls, uid_bytes: bytes, rank: int, world_size: int, *, max_tokens: int, hidden: int, top_k: int,
                local_experts: int, dtype: torch.dtype = torch.bfloat16, device=None,
                peer_transport: str = "auto", ranks_per_node: int | None = None,
                exchange: str = "direct") -> "Team":
        """Join an NVSHMEM team as ``rank`` of ``world_size`` (collective: every rank must call it).

        ``uid_bytes``: the 128 bytes of :meth:`make_unique_id` from rank 0. Sizing arguments as in
        :meth:`emulated`. The buffers are allocated on the symmetric heap (collective too).
        ``peer_transport``: how the kernel reaches each peer (:mod:`flashdmoe.parallel.nvshmem_transport`): "auto"
        (stores through a peer pointer where one exists, NVSHMEM puts elsewhere), "p2p" or "nvshmem"
        (forced for every peer). NVSHMEM puts need the process's kernel from the NVSHMEM build
        (``FLASHDMOE_KERNEL_BUILD=nvshmem``); the choice per peer is ``team.peer_transports``. Every rank
        should pass the same option.
        ``ranks_per_node``: a node layout the machine does not have, for testing a team across nodes on one
        node: ranks ``[n * ranks_per_node, (n + 1) * ranks_per_node)`` form node ``n``, and a peer on another
        node is treated as having no load/store path although one exists (no mapping of its buffers; "auto"
        reaches it by NVSHMEM puts, "p2p" is refused), as across real nodes. Default ``None``: the topology
        decides.
        ``exchange``: how a forward's rows reach owners on other nodes. ``"direct"``: each kept choice's row
        is put to its owner. ``"hierarchical"`` (docs/design.md §8): a token's row crosses to each other node
        its kept choices reach once, to the rank with this rank's index there (its relay), which stores it
        into the owners on its node; results still come back by each owner's put, so outputs are bitwise
        those of ``"direct"``. It needs ``ranks_per_node`` (at least two nodes), every peer on this rank's
        node reached by stores and every other by NVSHMEM puts (``peer_transport="auto"``), and one more
        symmetric buffer (:meth:`BufferPlan.relay_bytes`).
        """
        from flashdmoe.parallel import nvshmem_transport

        peer_transport = nvshmem_transport.parse_peer_transport(peer_transport)
        if nvshmem_transport.kernel_build_problem() is None:
            nvshmem_transport.require_unbound()
        if not isinstance(uid_bytes, (bytes, bytearray)) or len(uid_bytes) != UNIQUE_ID_BYTES:
            raise ValueError(f"uid_bytes: expected {UNIQUE_ID_BYTES} bytes from Team.make_unique_id()")
        _positive_int("world_size", world_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r}: expected an integer in [0, {world_size})")
        if ranks_per_node is not None:
            _positive_int("ranks_per_node", ranks_per_node)
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange={exchange!r}: expected one of {EXCHANGES}")
        if exchange == "hierarchical":
            if ranks_per_node is None or world_size % ranks_per_node or world_size // ranks_per_node < 2:
                raise ValueError(f"exchange='hierarchical': needs ranks_per_node dividing world_size={world_size} into "
                                 f"at least two nodes, got ranks_per_node={ranks_per_node!r}")
            if peer_transport != "auto":
                raise ValueError(f"exchange='hierarchical': needs peer_transport='auto' (stores within a node, puts "
                                 f"across), got {peer_transport!r}")
        plan = BufferPlan(world_size, max_tokens, hidden, top_k, local_experts, dtype)
        device = _torch_device(device)
        torch.cuda.set_device(device)
        nvshmem = _nvshmem()
        import numpy as np

        # The symmetric heap must hold this team's buffers (NVSHMEM's default is 1 GiB); an explicit
        # NVSHMEM_SYMMETRIC_SIZE in the environment wins.
        nodes = world_size // ranks_per_node if exchange == "hierarchical" else 0
        held = (plan.bytes_per_rank + (0 if peer_transport == "p2p" else plan.stage_bytes)
                + (plan.relay_bytes(nodes) if nodes else 0))
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(1 << 30, held * 5 // 4 + (64 << 20))))
        cuda_device = _cuda_core_device(device.index)
        cuda_device.set_current()
        uid = nvshmem.get_unique_id(empty=True)
        uid._data.view(np.int8)[:] = np.frombuffer(bytes(uid_bytes), dtype=np.int8)
        nvshmem.init(device=cuda_device, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")
        try:
            recv = nvshmem.tensor((plan.data_bytes,), dtype=torch.uint8)
            comb = nvshmem.tensor((plan.data_bytes,), dtype=torch.uint8)
            signals = nvshmem.tensor((plan.signal_words,), dtype=torch.int32)
            signals.zero_()
            own = RankBuffers(recv=recv, comb=comb, signals=signals)
            own_addresses = (recv.data_ptr(), comb.data_ptr(), signals.data_ptr())
            mapped: list[tuple[int, int, int] | None] = []
            for peer in range(world_size):
                views = [nvshmem.get_peer_tensor(t, peer) for t in (recv, comb, signals)] if peer != rank else None
                if peer == rank:
                    mapped.append(own_addresses)
                elif not same_node(rank, peer, ranks_per_node):
                    mapped.append(None)  # another (emulated) node: as if no path existed
                elif any(v is None for v in views):
                    mapped.append(None)  # no NVLink / same-GPU path: NVSHMEM puts only
                else:
                    mapped.append(tuple(v.data_ptr() for v in views))
            transports = nvshmem_transport.resolve_peer_transports(
                peer_transport, [m is not None for m in mapped], rank, nvshmem_transport.kernel_build_problem())
            own.peer_recv, own.peer_comb, own.peer_signals = nvshmem_transport.kernel_peer_table(
                rank, own_addresses, mapped, transports, plan.stream_rows * plan.hidden * plan.element_bytes)
            own.mapped_recv = [None if m is None else m[0] for m in mapped]
            own.mapped_comb = [None if m is None else m[1] for m in mapped]
            own.mapped_signals = [None if m is None else m[2] for m in mapped]
            if "nvshmem" in transports:
                # The backward's staging for those peers (collective: every rank of a team with NVSHMEM
                # peers allocates it, as reachability is symmetric).
                own.stage = nvshmem.tensor((plan.stage_bytes,), dtype=torch.uint8)
            if nodes:
                expected = ["p2p" if same_node(rank, q, ranks_per_node) else "nvshmem" for q in range(world_size)]
                if transports != expected:
                    raise ValueError(f"exchange='hierarchical': rank {rank} reaches its peers by {transports}; it needs "
                                     f"stores within its node and NVSHMEM puts across ({expected})")
                own.relay = nvshmem.tensor((plan.relay_bytes(nodes),), dtype=torch.uint8)
                own.relay.zero_()  # every batch count starts at zero

            # Everyone's signal words are zero before anyone's first kernel can write into them.
            torch.cuda.synchronize(device)
            nvshmem.barrier_all(torch.cuda.current_stream(device))
            torch.cuda.synchronize(device)
        except BaseException:
            nvshmem.finalize()
            raise
        team = cls("nvshmem", rank, world_size, plan, [own], device)
        team.peer_transports = transports
        team.ranks_per_node = ranks_per_node
        team.exchange = exchange
        team.unique_id = bytes(uid_bytes)  # binding the transport module re-initialises NVSHMEM with it
        if nvshmem_transport.kernel_build_problem() is None:
            try:
                nvshmem_transport.bound_module(team)  # the kernel's NVSHMEM device state, before its first launch
            except BaseException:
                team.close()
                raise
        return team

    # ---- state ----
    @property
    def failed(self) -> bool:
        return self._failure is not None

    @property
    def buffer_bytes(self) -> int:
        """Symmetric bytes per rank (0 for a single team), the backward's staging for NVSHMEM peers included."""
        if self.plan is None:
            return 0
        staged = any(own.stage is not None for own in self.buffers)
        relay = max((own.relay.numel() for own in self.buffers if own.relay is not None), default=0)
        return self.plan.bytes_per_rank + (self.plan.stage_bytes if staged else 0) + relay

    @property
    def relay_args(self) -> dict | None:
        """The kernel's RelayParams of this rank for the hierarchical exchange (``csrc/moe/params.cuh``), or
        ``None`` (direct)."""
        relay = self.buffers[0].relay if self.buffers else None
        if relay is None:
            return None
        rows_offset, batch_bytes = self.plan.relay_batch_layout()
        return {"ranks_per_node": self.ranks_per_node, "max_rows": self.plan.max_tokens,
                "batch_bytes": batch_bytes, "rows_offset": rows_offset, "buffer": relay.data_ptr()}

    def require_usable(self) -> None:
        if self._closed:
            raise TeamFailed(f"{self!r} is closed")
        if self._failure is not None:
            raise TeamFailed(f"{self!r} failed earlier ({self._failure}); make a new team")

    def mark_failed(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason

    def backward_count(self, local: int = 0) -> int:
        """Backward exchanges run so far by the rank held in ``buffers[local]``: the count its kernel keeps in
        its signal words (each backward's launch to the owners takes count + 1 as its sequence number and
        stores it back, so a CUDA graph's replays count as eager backwards do). Reads the device (waits for
        the stream)."""
        if self.plan is None:
            return 0
        return int(self.buffers[local].signals[self.plan.backward_word("sequence", 0, 0)].item())

    def describe(self) -> dict:
        plan = self.plan
        return {
            "transport": self.transport, "rank": self.rank, "world_size": self.world_size,
            "buffer_bytes_per_rank": self.buffer_bytes,
            "stream_rows": None if plan is None else plan.stream_rows,
            "max_tokens": None if plan is None else plan.max_tokens,
            # how this rank reaches each peer ("p2p" stores or "nvshmem" puts), and an emulated node layout
            "peer_transports": list(self.peer_transports), "ranks_per_node": self.ranks_per_node,
            "exchange": self.exchange,
        }

    def barrier(self) -> None:
        """Host-side barrier of all ranks on the current stream (nvshmem teams; a no-op otherwise).
        Checks the team's last forward first (waiting for it), like every use of the team."""
        self.require_usable()
        if self.unchecked_launch is not None:
            from flashdmoe.kernel import status_checks

            status_checks.settle_team(self)
        if self.transport == "nvshmem":
            _nvshmem().barrier_all(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        """Free the buffers (and leave NVSHMEM). Idempotent; the team cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self.launch_plans = {}
        if self.transport == "nvshmem":
            nvshmem = _nvshmem()
            try:
                torch.cuda.synchronize(self.device)
                for own in self.buffers:
                    for t in (own.recv, own.comb, own.signals, own.stage):
                        if t is not None:
                            nvshmem.free_tensor(t)
            finally:
                self.buffers = []
                try:
                    from flashdmoe.parallel import nvshmem_transport

                    nvshmem_transport.release(self)  # its finalize comes before nvshmem4py's
                finally:
                    nvshmem.finalize()
        self.buffers = []
        self.device_words = None

    def __enter__(self) -> "Team":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def same_node(rank: int, peer: int, ranks_per_node: int | None) -> bool:
    """Whether ``peer`` is on ``rank``'s node in a layout of ``ranks_per_node`` ranks per node (node-major
    ranks); always True without a layout (``None``)."""
    return ranks_per_node is None or rank // ranks_per_node == peer // ranks_per_node


def plan_for(world_size: int, max_tokens: int, hidden: int, top_k: int, experts: int, dtype) -> BufferPlan:
    """The :class:`BufferPlan` of a team over ``experts`` global experts (``experts % world_size == 0``)."""
    if experts % world_size:
        raise ValueError(f"experts={experts} is not divisible by world_size={world_size}")
    return BufferPlan(world_size, max_tokens, hidden, top_k, experts // world_size, dtype)


def _nvshmem():
    try:
        import nvshmem.core as nvshmem_core
    except ImportError as error:
        raise ImportError(
            "Team.nvshmem needs nvshmem4py (pip install 'flashdmoe[gpu]', i.e. nvshmem4py-cu13==0.4.1): "
            f"{error}"
        ) from error
    return nvshmem_core


def _cuda_core_device(index: int):
    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    return Device(index)


def mps_thread_percentage() -> int | None:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of this process, if set (several ranks share one GPU)."""
    value = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if not value:
        return None
    try:
        percent = float(value)
    except ValueError:
        return None
    return max(1, min(100, math.floor(percent)))
