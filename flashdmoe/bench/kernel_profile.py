"""Kernel-only time: the device time of one named CUDA kernel per call, read from ``torch.profiler``.

A suite's CUDA-event time of a call counts everything the call puts on the stream (memsets, copies,
launch gaps); this is the kernel alone, shown beside it, with the rest of the profiled calls' time taken
apart: the other GPU activities by name and the time the GPU had none (waiting on the host, or on a launch
to start). It is measured in a pass of its own after the timed runs, so the profiler never runs during them.
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
    (``reason`` says why); ``launches``: how many launches the median is over.

    Per profiled call (None when nothing was recorded): ``span_ms``, from the first GPU activity's start to
    the last one's end over all calls, divided by the calls; ``other_ms``, the device time of every activity
    but the kernel (``others``: the largest by name, ms per call); ``idle_ms``, the part of the span with no
    activity at all."""

    milliseconds: float | None
    launches: int
    reason: str | None = None
    span_ms: float | None = None
    other_ms: float | None = None
    idle_ms: float | None = None
    others: dict[str, float] | None = None

    def details(self) -> dict[str, object]:
        """The JSON form, without the kernel's own time (the entry's ``kernel_ms``)."""
        fields = {"launches": self.launches, "reason": self.reason}
        if self.span_ms is not None:
            fields.update(span_ms=self.span_ms, other_ms=self.other_ms, idle_ms=self.idle_ms, others=self.others)
        return fields


# Names of the other activities kept in ``KernelTime.others`` (the largest first).
OTHERS_SHOWN = 4


def _busy_microseconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def kernel_time_from_events(events: Iterable, kernel_name: str, calls: int | None = None) -> KernelTime:
    """The median ``device_time`` (µs in torch's profiler events) of the device events whose name contains
    ``kernel_name``, in ms; host-side events (a CPU op whose device time sums its kernels) are not counted.
    With ``calls`` (how many calls the events are of), the span, other activities and idle time per call too,
    from the events' ``time_range`` (start and end in µs)."""
    device = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
    durations = [float(event.device_time) for event in device if kernel_name in event.name]
    if not durations:
        return KernelTime(None, 0, f"no {kernel_name!r} kernel in the profile")
    median = statistics.median(durations) / 1e3
    if not calls:
        return KernelTime(median, len(durations))
    intervals = [(float(e.time_range.start), float(e.time_range.end)) for e in device]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    others: dict[str, float] = {}
    for event in device:
        if kernel_name not in event.name:
            others[event.name] = others.get(event.name, 0.0) + float(event.device_time)
    largest = sorted(others.items(), key=lambda item: -item[1])[:OTHERS_SHOWN]
    return KernelTime(
        median, len(durations),
        span_ms=span / calls / 1e3,
        other_ms=sum(others.values()) / calls / 1e3,
        idle_ms=(span - _busy_microseconds(intervals)) / calls / 1e3,
        others={name[:80]: total / calls / 1e3 for name, total in largest},
    )


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
        return kernel_time_from_events(profiler.events(), kernel_name, calls)
    except Exception as error:  # noqa: BLE001 - see the docstring
        text = str(error).strip().splitlines()
        return KernelTime(None, 0, f"profiler failed: {type(error).__name__}: {text[0] if text else ''}")
