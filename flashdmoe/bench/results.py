"""Plain data records of one benchmark run, shared by the suites and the report writers.

Everything here converts to JSON-ready dicts with ``to_dict()``; the report module only reads these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from flashdmoe.validation import ACTIVATIONS

# Entry statuses: "ok" (timed), "unavailable" (backend/baseline cannot run here, with a reason),
# "skipped" (excluded by an option, with a reason), "error" (it was expected to run and failed).
ENTRY_STATUSES = ("ok", "unavailable", "skipped", "error")


@dataclass(frozen=True)
class BenchShape:
    """One MoE problem size: T tokens, H hidden, I expert ffn size, E experts, k experts per token."""

    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int

    def __post_init__(self) -> None:
        for name in ("tokens", "hidden", "ffn", "experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"shape field {name}={value!r}: expected a positive integer")
        if self.top_k > self.experts:
            raise ValueError(
                f"shape top_k={self.top_k}: expected 1 <= top_k <= experts ({self.experts})"
            )

    @property
    def label(self) -> str:
        return f"T={self.tokens} H={self.hidden} I={self.ffn} E={self.experts} k={self.top_k}"

    def to_dict(self) -> dict[str, int]:
        return {"T": self.tokens, "H": self.hidden, "I": self.ffn, "E": self.experts, "k": self.top_k}


@dataclass(frozen=True)
class BenchConfig:
    """One configuration of ``--configs``: a shape and, optionally, its own activation (None: the run's
    ``--activation``, or the suite's default)."""

    shape: BenchShape
    activation: str | None = None

    def __post_init__(self) -> None:
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: expected one of {ACTIVATIONS} or None")


CONFIGS_FORMAT = "T,H,I,E,k or T,H,I,E,k,activation"


def parse_configs(text: str) -> list[BenchConfig]:
    """Parse ``"T,H,I,E,k[,activation];..."`` (e.g. ``"8192,2048,2048,32,2;1,2048,768,128,8,swiglu"``);
    raises ValueError naming ``--configs`` and the bad part."""
    configs = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        fields = [item.strip() for item in part.split(",")]
        if len(fields) not in (5, 6):
            raise ValueError(f"--configs entry {part!r}: expected {CONFIGS_FORMAT} (5 integers, then an optional "
                             f"activation, one of {ACTIVATIONS})")
        try:
            values = [int(item) for item in fields[:5]]
        except ValueError:
            raise ValueError(f"--configs entry {part!r}: expected 5 comma-separated integers T,H,I,E,k, then an "
                             f"optional activation") from None
        activation = fields[5] if len(fields) == 6 else None
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"--configs entry {part!r}: activation {activation!r}: expected one of {ACTIVATIONS}")
        try:
            shape = BenchShape(*values)
        except ValueError as error:
            raise ValueError(f"--configs entry {part!r}: {error}") from None
        configs.append(BenchConfig(shape, activation))
    if not configs:
        raise ValueError(f"--configs {text!r}: expected at least one '{CONFIGS_FORMAT}' entry")
    return configs


@dataclass
class EntryResult:
    """One timed entry (fused kernel, a baseline, ...) on one configuration.

    Times are milliseconds; ``kernel_ms`` is the median device time of the entry's own CUDA kernel per
    launch, from the profiler in a pass after the timed runs (None for entries without one, off CUDA, or
    when the profile has no such kernel). ``max_relative_error`` is max|y - y_ref| / max|y_ref| over the compared
    tokens (see ConfigResult.compared_tokens); ``None`` when the entry did not run.
    """

    name: str
    label: str
    status: str
    reason: str | None = None
    median_ms: float | None = None
    p10_ms: float | None = None
    p90_ms: float | None = None
    samples_ms: list[float] = field(default_factory=list)
    kernel_ms: float | None = None
    tflops: float | None = None
    percent_of_ceiling: float | None = None
    percent_of_floor: float | None = None
    speedup_over_grouped_mm: float | None = None
    max_relative_error: float | None = None
    error_tolerance: float | None = None
    correct: bool | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in ENTRY_STATUSES:
            raise ValueError(f"entry status={self.status!r}: expected one of {ENTRY_STATUSES}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ConfigResult:
    """All entries measured on one configuration, with the numbers they are judged against."""

    label: str
    shape: dict[str, int]
    activation: str
    dtype: str
    flops: int
    input_sets: int
    entries: list[EntryResult]
    bytes_floor: int | None = None
    floor_ms: float | None = None
    compared_tokens: int | None = None
    near_tie_tokens: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def entry(self, name: str) -> EntryResult | None:
        for candidate in self.entries:
            if candidate.name == name:
                return candidate
        return None

    def to_dict(self) -> dict[str, Any]:
        result = dataclasses.asdict(self)
        result["entries"] = [entry.to_dict() for entry in self.entries]
        return result


@dataclass
class SuiteResult:
    """A whole suite run: machine facts, measured peaks, settings and per-configuration results."""

    suite: str
    machine: dict[str, Any]
    settings: dict[str, Any]
    configs: list[ConfigResult]
    ceiling_tflops: float | None = None
    copy_bandwidth_gbps: float | None = None
    command: str | None = None
    date: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "date": self.date,
            "command": self.command,
            "machine": self.machine,
            "settings": self.settings,
            "ceiling_tflops": self.ceiling_tflops,
            "copy_bandwidth_gbps": self.copy_bandwidth_gbps,
            "configs": [config.to_dict() for config in self.configs],
        }
