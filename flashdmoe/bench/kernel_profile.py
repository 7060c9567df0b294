"""Kernel-only time: the device time of one named CUDA kernel per call, read from ``torch.profiler``.

A suite's CUDA-event time of a call counts everything the call puts on the stream (memsets, copies,
launch gaps); this is the kernel alone, shown beside it. It is measured in a pass of its own after the
timed runs, so the profiler never runs during them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

# Calls profiled per entry (rotating through the input sets as the timed runs do).
PROFILED_CALLS = 6


@dataclass(frozen=True)
class KernelTime:
    """``milliseconds``: median device time of the kernel per launch, None when no launch was recorded
    (``reason`` says why); ``launches``: how many launches the median is over."""

    milliseconds: float | None
    launches: int
    reason: str | None = None


def kernel_time_from_events(events: Iterable, kernel_name: str) -> KernelTime:
    """The median ``device_time`` (µs in torch's profiler events) of the device events whose name contains
    ``kernel_name``, in ms; host-side events (a CPU op whose device time sums its kernels) are not counted."""
    durations = [
        float(event.device_time)
        for event in events
        if event.device_type == torch.autograd.DeviceType.CUDA and kernel_name in event.name
    ]
    if not durations:
        return KernelTime(None, 0, f"no {kernel_name!r} kernel in the profile")
    return KernelTime(statistics.median(durations) / 1e3, len(durations))


def profile_kernel(
    runs: Sequence[Callable[[], object]],
    *,
    device: torch.device | str,
    kernel_name: str,
    calls: int = PROFILED_CALLS,
) -> KernelTime:
    """Profile ``calls`` calls (``runs[i % len(runs)]``) and return the kernel's time per launch.

    Not a CUDA device: nothing runs and the time is None. A profiler that fails gives None with its error
    as the reason: the kernel time is a side column, never the reason a row fails.
    """
    if not runs:
        raise ValueError("runs=[]: expected at least one callable")
    if calls < 1:
        raise ValueError(f"calls={calls}: expected an integer >= 1")
    device = torch.device(device)
    if device.type != "cuda":
        return KernelTime(None, 0, f"no CUDA kernels on {device.type}")
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            for index in range(calls):
                runs[index % len(runs)]()
            torch.cuda.synchronize(device)
        return kernel_time_from_events(profiler.events(), kernel_name)
    except Exception as error:  # noqa: BLE001 - see the docstring
        text = str(error).strip().splitlines()
        return KernelTime(None, 0, f"profiler failed: {type(error).__name__}: {text[0] if text else ''}")
