"""Scratch memory of the fused kernel: one reusable buffer per (device, stream), not one per call.

Launches on one stream run one after another, so they can all use the same workspace. A launch needs each
rank's sync words (the first ``sync_bytes`` of its ``stride``-byte share) zero, and no longer zeroes them
itself: the kernel's last block resets them as it exits (``finish_launch`` in csrc/common/sync.cuh).
What that reset leaves zero is the previous launch's sync words only; the rest of its share was scratch.
So the pool remembers, per buffer, the (stride, sync_bytes, ranks) of its last launch (or that the
buffer is freshly zeroed) and zeroes the sync words itself, on the stream, only when a launch's would
reach past them (another stride, larger sync words, more ranks): once per change of shape, never in a
steady loop. Launches on different streams may overlap, so each stream has its own buffer. A buffer
grows to the largest launch seen on its stream and is kept (:meth:`WorkspacePool.release` frees them;
``held_bytes`` says how much).

A CUDA-graph capture never takes a pooled buffer: the graph would bake its address in, and a replay
could then run while an eager launch (on another stream, or the capture stream later) uses the same
buffer. Captured launches allocate their workspace with ``torch.empty`` inside the capture instead, from
the graph's private memory pool, which the graph keeps for its replays and no eager call can reach; the
capture zeroes its sync words ahead of the launch (a graph's memory may hold other tensors between
replays).
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
        # key -> [data_ptr, bytes, what is known zero: None (all of it) or the last launch's
        # (stride, sync_bytes, ranks)]
        self._entries: dict[tuple[int, int], list] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device, stream_handle: int, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` for launches on ``stream_handle`` (the current stream of
        ``device``, on which a new buffer is allocated, zeroed)."""
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
                buffer = self._buffers[key] = torch.zeros(size, dtype=torch.uint8, device=device)
                self._entries[key] = [buffer.data_ptr(), size, None]
        return buffer

    def address(self, device: torch.device, index: int, stream_handle: int, stride: int, sync_bytes: int,
                ranks: int = 1) -> int:
        """The device address of a buffer for a launch of ``ranks`` shares of ``stride`` bytes whose first
        ``sync_bytes`` each are zero when the launch starts (``index``: ``device.index``). No tensor call
        on a launch that fits and whose sync words the previous launch's exit left zero."""
        key = (index, stream_handle)
        entry = self._entries.get(key)
        if entry is None or entry[1] < stride * ranks:
            self.get(device, stream_handle, stride * ranks)
            entry = self._entries[key]
        zero = entry[2]
        if zero is not None and not (zero[0] == stride and zero[1] >= sync_bytes and zero[2] >= ranks):
            shares = self._buffers[key][:stride * ranks].view(ranks, stride)
            shares[:, :sync_bytes].zero_()
        entry[2] = (stride, sync_bytes, ranks)
        return entry[0]

    def held_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self._buffers.values())

    def release(self) -> None:
        """Drop every buffer (torch's caching allocator keeps the memory until ``empty_cache``)."""
        with self._lock:
            self._entries.clear()
            self._buffers.clear()
