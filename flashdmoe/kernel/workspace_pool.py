"""Scratch memory of the kernels: one reusable buffer per (device, stream), not one per call, and the sync words
of launches captured in CUDA graphs.

Launches on one stream run one after another, so they can all use the same workspace. A launch needs each
rank's sync words (the first ``sync_bytes`` of its ``stride``-byte share) zero, and no longer zeroes them
itself: the kernel's last block resets them as it exits (``finish_launch`` in csrc/common/sync.cuh).
What that reset leaves zero is the previous launch's sync words only; the rest of its share was scratch.
So the pool remembers, per buffer, the (stride, sync_bytes, ranks) of its last launch (or that the
buffer is freshly zeroed; kept in the host module's table, which the C++ launch path shares) and zeroes the sync words itself, on the stream, only when a launch's would
reach past them (larger sync words, more ranks, another stride for more than one rank): once per change of shape, never in a
steady loop. Launches on different streams may overlap, so each stream has its own buffer. A buffer
grows to the largest launch seen on its stream and is kept (:meth:`WorkspacePool.release` frees them;
``held_bytes`` says how much).

A CUDA-graph capture never takes a pooled buffer: the graph would bake its address in, and a replay
could then run while an eager launch (on another stream, or the capture stream later) uses the same
buffer. Captured launches allocate their workspace with ``torch.empty`` inside the capture instead, from
the graph's private memory pool, which the graph keeps for its replays and no eager call can reach. That
memory may hold the graph's other tensors between replays, so the sync words cannot live there without
being zeroed by the graph at every replay (a step before the launch: ~2 µs of a one-token replay). A
captured launch's sync words therefore come from :class:`GraphSyncBlocks`: zeroed memory allocated
outside any capture, a block of it handed to each captured launch for good. The launch's exit leaves
its block zero as it found it, so every replay finds it ready. Only when no block is left does the
capture fall back to zeroing sync words inside the graph.
"""

from __future__ import annotations

import threading

import torch

from flashdmoe.kernel import host_queue

__all__ = ["GraphSyncBlocks", "WorkspacePool", "captured_sync_words", "graph_sync"]

#: Buffers grow in steps of this many bytes (and by at least a quarter), so a slowly rising batch size
#: does not reallocate at every call.
GRANULE = 2 << 20


class WorkspacePool:
    """One uint8 buffer per (device index, stream handle), grown on demand. What is known of each buffer
    (address, size, known-zero sync words) lives in :attr:`table` (``flashdmoe_host.WorkspaceTable``), which
    the C++ launch path (:mod:`flashdmoe.kernel.host_queue`) reads and updates too."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._table = None
        self._grow = self._zero = None  # set with the table
        self._lock = threading.Lock()

    @property
    def table(self):
        """The pool's ``flashdmoe_host.WorkspaceTable`` (device index ``None``, a CPU stand-in's, is -1)."""
        if self._table is None:
            with self._lock:
                if self._table is None:
                    module = host_queue.module()
                    self._grow, self._zero = module.GROW, module.ZERO  # WorkspaceTable.claim's answers
                    self._table = module.WorkspaceTable()
        return self._table

    def get(self, device: torch.device, stream_handle: int, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` for launches on ``stream_handle`` (the current stream of
        ``device``, on which a new buffer is allocated, zeroed)."""
        key = (device.index, stream_handle)
        buffer = self._buffers.get(key)
        if buffer is not None and buffer.numel() >= nbytes:
            return buffer
        table = self.table
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < nbytes:
                size = max(nbytes, 0 if buffer is None else buffer.numel() * 5 // 4)
                size = -(-size // GRANULE) * GRANULE
                # The old buffer goes back to torch's caching allocator, which reuses it only for work on
                # this stream, ordered after the launches that used it.
                buffer = self._buffers[key] = torch.zeros(size, dtype=torch.uint8, device=device)
                table.set(device_key(device.index), stream_handle, buffer.data_ptr(), size)
        return buffer

    def address(self, device: torch.device, index: int, stream_handle: int, stride: int, sync_bytes: int,
                ranks: int = 1) -> int:
        """The device address of a buffer for a launch of ``ranks`` shares of ``stride`` bytes whose first
        ``sync_bytes`` each are zero when the launch starts (``index``: ``device.index``). No tensor call
        on a launch that fits and whose sync words the previous launch's exit left zero."""
        table = self.table
        key = device_key(index)
        address, need = table.claim(key, stream_handle, stride, sync_bytes, ranks)
        if need == self._grow:
            self.get(device, stream_handle, stride * ranks)
            address, need = table.claim(key, stream_handle, stride, sync_bytes, ranks)
        if need == self._zero:
            shares = self._buffers[(index, stream_handle)][:stride * ranks].view(ranks, stride)
            shares[:, :sync_bytes].zero_()
        return address

    def held_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._buffers.values())

    def release(self) -> None:
        """Drop every buffer (torch's caching allocator keeps the memory until ``empty_cache``)."""
        with self._lock:
            if self._table is not None:
                self._table.clear()
            self._buffers.clear()


def device_key(index: int | None) -> int:
    """A device index as the host module keys it (a CPU stand-in's ``None`` is -1)."""
    return -1 if index is None else index


class GraphSyncBlocks:
    """Zeroed sync words for launches captured in CUDA graphs, per device; a block is never handed out twice.

    A launch's exit resets its sync words (``finish_launch``), timeouts included, so a block given to a
    captured launch stays zero between that graph's replays without a zeroing step in the graph. Blocks are
    not returned (nothing tells when a graph is destroyed): each costs the launch's ``sync_bytes`` (about
    2 KB per rank; a model of 48 MoE layers captured at 67 batch sizes takes ~7 MB). Memory comes in
    chunks of ``chunk_bytes``, allocated only outside a capture (:meth:`reserve`, run when a launch
    plan is made) and at most ``limit_bytes`` per device; a capture that finds no block left
    (:meth:`take` answers ``None``) zeroes its sync words inside the graph, as every capture did before.
    """

    ALIGN = 256  # bytes; the kernels' sync words are 128-byte aligned from their base

    @classmethod
    def block_bytes(cls, nbytes: int) -> int:
        """What :meth:`take` hands out for ``nbytes``: rounded up to ``ALIGN`` (a team's ranks' blocks lie
        that far apart)."""
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def __init__(self, chunk_bytes: int = 4 << 20, reserve_bytes: int = 1 << 20, limit_bytes: int = 256 << 20):
        self.chunk_bytes, self.reserve_bytes, self.limit_bytes = chunk_bytes, reserve_bytes, limit_bytes
        # device key -> [chunks (tensors, kept for the process's life), address of the free part, bytes free]
        self._devices: dict[int, list] = {}
        self._lock = threading.Lock()

    def reserve(self, device: torch.device) -> None:
        """Outside a capture: make sure ``reserve_bytes`` are free on ``device`` (allocating one zeroed chunk
        if not, up to the limit). Waits for the zeroing once per chunk, so that a graph captured on any
        stream later finds it done."""
        key = device_key(device.index)
        state = self._devices.get(key)
        if state is not None and state[2] >= self.reserve_bytes:
            return
        with self._lock:
            state = self._devices.setdefault(key, [[], 0, 0])
            held = len(state[0]) * self.chunk_bytes
            if state[2] >= self.reserve_bytes or held + self.chunk_bytes > self.limit_bytes:
                return
            chunk = torch.zeros(self.chunk_bytes, dtype=torch.uint8, device=device)
            if chunk.is_cuda:
                torch.cuda.current_stream(device).synchronize()
            state[0].append(chunk)
            state[1], state[2] = chunk.data_ptr(), self.chunk_bytes  # what was left of the last chunk stays unused

    def take(self, device: torch.device, nbytes: int) -> int | None:
        """The address of ``nbytes`` zero bytes on ``device`` that no other launch will be given, or ``None``
        when the reserved chunk has fewer left (the caller then zeroes sync words of its own)."""
        size = self.block_bytes(nbytes)
        with self._lock:
            state = self._devices.get(device_key(device.index))
            if state is None or state[2] < size:
                return None
            address = state[1]
            state[1] += size
            state[2] -= size
            return address

    def held_bytes(self, device: torch.device) -> int:
        state = self._devices.get(device_key(device.index))
        return 0 if state is None else len(state[0]) * self.chunk_bytes


#: The process's blocks for captured launches (the forward's and the backward kernels').
graph_sync = GraphSyncBlocks()


def captured_sync_words(device: torch.device, nbytes: int) -> tuple[int, torch.Tensor | None]:
    """Inside a capture: ``nbytes`` of zero sync words for a launch, as ``(address, tensor)``. From a block
    the graph keeps (tensor ``None``), else a tensor from the graph's pool zeroed inside the capture (the
    caller keeps it alive until the launch is recorded)."""
    address = graph_sync.take(device, nbytes)
    if address is not None:
        return address, None
    held = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return held.data_ptr(), held
