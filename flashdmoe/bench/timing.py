"""Timing of GPU/CPU callables: warm-up, then per-run samples and robust statistics.

CUDA: one pair of CUDA events around every run (GPU time, queued back to back, synchronised once at
the end). CPU: ``time.perf_counter`` around every run. The caller passes one zero-argument callable
per input set; runs rotate through them so a working set smaller than the L2 cache is not measured
hot (see ``input_sets_for_cache``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# The H200's L2 is 60 MB; used when the device does not report its own size.
DEFAULT_GPU_L2_BYTES = 60 * 1024 * 1024
# CPUs have no torch-reported cache size; a typical last-level cache is assumed.
DEFAULT_CPU_CACHE_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class TimingStats:
    """Statistics of ``samples_ms`` (milliseconds per run, in run order)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    samples_ms: tuple[float, ...]

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float]) -> TimingStats:
        if len(samples_ms) == 0:
            raise ValueError("samples_ms=[]: expected at least one timing sample")
        ordered = sorted(float(sample) for sample in samples_ms)
        return cls(
            median_ms=statistics.median(ordered),
            p10_ms=percentile(ordered, 10.0),
            p90_ms=percentile(ordered, 90.0),
            samples_ms=tuple(float(sample) for sample in samples_ms),
        )


def percentile(values: Sequence[float], percent: float) -> float:
    """Linear-interpolation percentile (numpy's default method) of a non-empty sequence."""
    if not 0.0 <= percent <= 100.0:
        raise ValueError(f"percent={percent}: expected a value in [0, 100]")
    ordered = sorted(values)
    if not ordered:
        raise ValueError("values=[]: expected at least one value")
    position = (len(ordered) - 1) * percent / 100.0
    lower = math.floor(position)
    upper = math.ceil(position)
    fraction = position - lower
    return ordered[lower] + (ordered[upper] - ordered[lower]) * fraction


def measure(
    runs: Sequence[Callable[[], object]],
    *,
    device: torch.device | str,
    warmup: int = 5,
    repeats: int = 20,
) -> TimingStats:
    """Time ``repeats`` runs after ``warmup`` untimed ones, rotating through ``runs``.

    Args:
        runs: one zero-argument callable per input set; run ``i`` calls ``runs[i % len(runs)]``.
        device: where the work runs; ``cuda`` devices are timed with CUDA events, others with
            ``time.perf_counter``.
        warmup: untimed runs first (>= 0).
        repeats: timed runs (>= 1).
    """
    if len(runs) == 0:
        raise ValueError("runs=[]: expected at least one callable")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r}: expected an integer >= 0")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: expected an integer >= 1")
    device = torch.device(device)
    for index in range(warmup):
        runs[index % len(runs)]()
    if device.type == "cuda":
        return _measure_cuda(runs, device, warmup, repeats)
    return _measure_host(runs, warmup, repeats)


def _measure_cuda(
    runs: Sequence[Callable[[], object]], device: torch.device, offset: int, repeats: int
) -> TimingStats:
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for index in range(repeats):
            starts[index].record()
            runs[(offset + index) % len(runs)]()
            ends[index].record()
        torch.cuda.synchronize()
        return TimingStats.from_samples(
            [start.elapsed_time(end) for start, end in zip(starts, ends)]
        )


def _measure_host(runs: Sequence[Callable[[], object]], offset: int, repeats: int) -> TimingStats:
    samples = []
    for index in range(repeats):
        begin = time.perf_counter()
        runs[(offset + index) % len(runs)]()
        samples.append((time.perf_counter() - begin) * 1e3)
    return TimingStats.from_samples(samples)


def cache_bytes(device: torch.device | str) -> int:
    """Bytes of the cache a rotated working set must exceed: the GPU's L2, or an assumed CPU LLC."""
    device = torch.device(device)
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        reported = getattr(properties, "L2_cache_size", None)
        return int(reported) if reported else DEFAULT_GPU_L2_BYTES
    return DEFAULT_CPU_CACHE_BYTES


def input_sets_for_cache(bytes_per_set: int, cache_size: int, *, limit: int) -> int:
    """How many distinct input sets to rotate so that together they exceed twice the cache.

    One set when a single set already exceeds ``2 * cache_size``; never more than ``limit``.
    """
    if bytes_per_set < 1:
        raise ValueError(f"bytes_per_set={bytes_per_set}: expected a positive byte count")
    if limit < 1:
        raise ValueError(f"limit={limit}: expected at least one input set")
    needed = math.ceil(2 * cache_size / bytes_per_set)
    return max(1, min(limit, needed))
