"""Scratch memory of the fused kernel: one reusable buffer per (device, stream), not one per call.

Launches on one stream run one after another, so they can all use the same workspace: the next launch's
zeroing of the sync words is ordered after the previous kernel and its status copy. Launches on
different streams may overlap, so each stream has its own buffer. A buffer grows to the largest launch
seen on its stream and is kept (:meth:`WorkspacePool.release` frees them; ``held_bytes`` says how much).

A CUDA-graph capture never takes a pooled buffer: the graph would bake its address in, and a replay
could then run while an eager launch (on another stream, or the capture stream later) uses the same
buffer. Captured launches allocate their workspace with ``torch.empty`` inside the capture instead, from
the graph's private memory pool, which the graph keeps for its replays and no eager call can reach.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["WorkspacePool"]

#: Buffers grow in steps of this many bytes (and by at least a quarter), so a slowly rising batch size
#: does not reallocate at every call.
GRANULE = 2 << 20


class WorkspacePool:
    """One uint8 buffer per (device index, stream handle), grown on demand."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._addresses: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (data_ptr, bytes)
        self._lock = threading.Lock()

    def get(self, device: torch.device, stream_handle: int, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` for launches on ``stream_handle`` (the current stream of
        ``device``, on which a new buffer is allocated)."""
        key = (device.index, stream_handle)
        buffer = self._buffers.get(key)
        if buffer is not None and buffer.numel() >= nbytes:
            return buffer
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < nbytes:
                size = max(nbytes, 0 if buffer is None else buffer.numel() * 5 // 4)
                size = -(-size // GRANULE) * GRANULE
                # The old buffer goes back to torch's caching allocator, which reuses it only for work on
                # this stream, ordered after the launches that used it.
                buffer = self._buffers[key] = torch.empty(size, dtype=torch.uint8, device=device)
                self._addresses[key] = (buffer.data_ptr(), size)
        return buffer

    def address(self, device: torch.device, index: int, stream_handle: int, nbytes: int) -> int:
        """The device address of :meth:`get`'s buffer (``index``: ``device.index``), remembered with the
        buffer: no tensor call on a launch that fits."""
        entry = self._addresses.get((index, stream_handle))
        if entry is not None and entry[1] >= nbytes:
            return entry[0]
        return self.get(device, stream_handle, nbytes).data_ptr()

    def held_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._buffers.values())

    def release(self) -> None:
        """Drop every buffer (torch's caching allocator keeps the memory until ``empty_cache``)."""
        with self._lock:
            self._addresses.clear()
            self._buffers.clear()
