"""Plain data records of one benchmark run, shared by the suites and the report writers.

Everything here converts to JSON-ready dicts with ``to_dict()``; the report module only reads these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

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


def parse_shapes(text: str) -> list[BenchShape]:
    """Parse ``"T,H,I,E,k;T,H,I,E,k"`` into shapes; raises ValueError naming the bad part."""
    shapes = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        fields = [item.strip() for item in part.split(",")]
        if len(fields) != 5:
            raise ValueError(
                f"--configs entry {part!r}: expected 5 comma-separated integers T,H,I,E,k"
            )
        try:
            values = [int(item) for item in fields]
        except ValueError:
            raise ValueError(
                f"--configs entry {part!r}: expected 5 comma-separated integers T,H,I,E,k"
            ) from None
        shapes.append(BenchShape(*values))
    if not shapes:
        raise ValueError(f"--configs {text!r}: expected at least one 'T,H,I,E,k' entry")
    return shapes


@dataclass
class EntryResult:
    """One timed entry (fused kernel, a baseline, ...) on one configuration.

    Times are milliseconds. ``max_relative_error`` is max|y - y_ref| / max|y_ref| over the compared
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
