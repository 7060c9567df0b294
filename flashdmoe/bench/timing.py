"""Timing of GPU/CPU callables: warm-up, then per-run samples and robust statistics.

CUDA: one pair of CUDA events around every run (GPU time, queued back to back, synchronised once at
the end). CPU: ``time.perf_counter`` around every run. The caller passes one zero-argument callable
per input set; runs rotate through them so a working set smaller than the L2 cache is not measured
hot (see ``input_sets_for_cache``). ``measure_phases`` does the same for runs made of consecutive
phases (a training step's forward, then its backward): one event between phases, one time per phase.
``measure_in_turns`` times several entries that a table compares in rounds, taking turns.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
    return measure_phases([(run,) for run in runs], device=device, warmup=warmup, repeats=repeats).total


@dataclass(frozen=True)
class PhaseTimings:
    """``phases[j]``: the statistics of phase ``j`` alone; ``total``: of the whole run (first to last)."""

    phases: tuple[TimingStats, ...]
    total: TimingStats


def measure_phases(
    runs: Sequence[Sequence[Callable[[], object]]],
    *,
    device: torch.device | str,
    warmup: int = 5,
    repeats: int = 20,
) -> PhaseTimings:
    """Like :func:`measure`, for runs made of phases called in order (``runs[i][0]()``, ``runs[i][1]()``,
    ...): every input set has the same number of phases, each timed on its own (a CUDA event or a clock
    reading between consecutive phases) and the run as a whole."""
    if len(runs) == 0:
        raise ValueError("runs=[]: expected at least one sequence of callables")
    phase_count = len(runs[0])
    if phase_count == 0 or any(len(phases) != phase_count for phases in runs):
        raise ValueError(
            f"runs: expected the same number (>= 1) of phases in every run, got {[len(p) for p in runs]}"
        )
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r}: expected an integer >= 0")
    _require_repeats(repeats)
    device = torch.device(device)
    for index in range(warmup):
        for phase in runs[index % len(runs)]:
            phase()
    if device.type == "cuda":
        samples = _samples_cuda(runs, device, warmup, repeats)
    else:
        samples = _samples_host(runs, warmup, repeats)
    return PhaseTimings(
        phases=tuple(TimingStats.from_samples([run[j] for run, _ in samples]) for j in range(phase_count)),
        total=TimingStats.from_samples([total for _, total in samples]),
    )


def _require_repeats(repeats: object) -> None:
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: expected an integer >= 1")


# The timed runs of several entries (things compared in one table row group) are taken in this many
# rounds, every entry once per round in turn, so that all of them see the GPU's clocks of the same stretch
# of time (a long heavy row drifts them by 10-20% within seconds) and their ratios stay fair.
TIMING_ROUNDS = 4


def round_sizes(repeats: int, rounds: int = TIMING_ROUNDS) -> list[int]:
    """``repeats`` (>= 1) timed runs split over at most ``rounds`` rounds, as evenly as they go."""
    _require_repeats(repeats)  # zero would give no round at all, so no entry would reach its own check
    rounds = min(rounds, repeats)
    return [repeats // rounds + (1 if index < repeats % rounds else 0) for index in range(rounds)]


@dataclass
class TurnTimings:
    """One entry's outcome of :func:`measure_in_turns`: its timings over every round, or the error that
    stopped it (its earlier rounds discarded); ``clocks``: the clock reading after each of its rounds."""

    timings: PhaseTimings | None = None
    error: BaseException | None = None
    clocks: list[int] = field(default_factory=list)


def measure_in_turns(
    entries: Sequence[Sequence[Sequence[Callable[[], object]]]],
    *,
    device: torch.device | str,
    warmup: int = 5,
    repeats: int = 20,
    contexts: Sequence[Callable[[], contextlib.AbstractContextManager]] | None = None,
    clock: Callable[[], int | None] | None = None,
) -> list[TurnTimings]:
    """:func:`measure_phases` for several entries (``entries[e]``: its runs, as there), their timed runs
    taken in rounds (:func:`round_sizes`), every entry once per round in turn (in order in even rounds, in
    reverse in odd ones). The first round is warmed up by ``warmup`` runs, the later ones by one (the runs
    before were another entry's). An entry that raises drops out with its error; the others go on.
    ``contexts[e]()`` is entered around each of entry e's rounds; ``clock()`` is read after each (e.g. the SM
    clock: how the rounds' conditions compare)."""
    outcomes = [TurnTimings() for _ in entries]
    samples: list[list[tuple[list[float], float]]] = [[] for _ in entries]
    for round_index, count in enumerate(round_sizes(repeats)):
        # Odd rounds in reverse order: no entry always runs right after another (on a GPU that is heating
        # up, the later entries of a round meet lower clocks).
        order = range(len(entries)) if round_index % 2 == 0 else range(len(entries) - 1, -1, -1)
        for index in order:
            runs = entries[index]
            outcome = outcomes[index]
            if outcome.error is not None:
                continue
            context = contexts[index]() if contexts is not None else contextlib.nullcontext()
            try:
                with context:
                    timings = measure_phases(runs, device=device, repeats=count,
                                             warmup=warmup if round_index == 0 else min(warmup, 1))
            except Exception as error:  # noqa: BLE001 - the entry's row reports it
                outcome.error = error
                continue
            samples[index].extend(zip(zip(*(phase.samples_ms for phase in timings.phases)),
                                      timings.total.samples_ms))
            reading = clock() if clock is not None else None
            if reading is not None:
                outcome.clocks.append(reading)
    for outcome, taken in zip(outcomes, samples):
        if outcome.error is None:
            outcome.timings = PhaseTimings(
                phases=tuple(TimingStats.from_samples([run[j] for run, _ in taken]) for j in range(len(taken[0][0]))),
                total=TimingStats.from_samples([total for _, total in taken]),
            )
    return outcomes


# Per timed run: (milliseconds of each phase, milliseconds of the whole run).
_RunSamples = list[tuple[list[float], float]]


def _samples_cuda(
    runs: Sequence[Sequence[Callable[[], object]]], device: torch.device, offset: int, repeats: int
) -> _RunSamples:
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        events = [
            [torch.cuda.Event(enable_timing=True) for _ in range(len(runs[0]) + 1)] for _ in range(repeats)
        ]
        for index, run_events in enumerate(events):
            run_events[0].record()
            for phase, end in zip(runs[(offset + index) % len(runs)], run_events[1:]):
                phase()
                end.record()
        torch.cuda.synchronize()
        return [
            ([start.elapsed_time(end) for start, end in zip(run_events, run_events[1:])],
             run_events[0].elapsed_time(run_events[-1]))
            for run_events in events
        ]


def _samples_host(runs: Sequence[Sequence[Callable[[], object]]], offset: int, repeats: int) -> _RunSamples:
    samples = []
    for index in range(repeats):
        marks = [time.perf_counter()]
        for phase in runs[(offset + index) % len(runs)]:
            phase()
            marks.append(time.perf_counter())
        samples.append(([(end - start) * 1e3 for start, end in zip(marks, marks[1:])], (marks[-1] - marks[0]) * 1e3))
    return samples


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
