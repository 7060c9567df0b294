"""What a benchmark suite is: a :class:`Suite` record (its runner, shapes, entries and table layout) and
the :class:`SuiteOptions` its runner receives. The suites themselves are listed in
:mod:`flashdmoe.bench.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console

from flashdmoe.bench.report import DEFAULT_LAYOUT, Layout
from flashdmoe.bench.results import BenchShape, SuiteResult


@dataclass
class SuiteOptions:
    """Everything a suite runner needs, already validated and with defaults resolved."""

    suite: str
    device: str
    dtype: str
    activation: str | None  # None: the suite's own activation per shape (--activation not given)
    shapes: list[BenchShape]
    entries: list[str]
    repeats: int = 20
    warmup: int = 5
    normalize_topk: bool = True
    reference_max_tokens: int | None = None
    input_sets: int | None = None  # None: enough sets to exceed twice the cache
    max_input_sets: int = 16
    seed: int = 0
    console: Console = field(default_factory=lambda: Console(stderr=True, log_path=False))


@dataclass(frozen=True)
class Suite:
    """A named suite: ``runner(options) -> SuiteResult``; ``validate(options)`` (optional) raises ValueError
    for option combinations it cannot run; ``layout``: the columns of its tables after the shape;
    ``activation``: the default of ``--activation``, or None for a suite that pairs each shape with one."""

    name: str
    description: str
    runner: Callable[[SuiteOptions], SuiteResult]
    default_shapes: tuple[BenchShape, ...]
    quick_shapes: tuple[BenchShape, ...]
    entry_names: tuple[str, ...]
    activation: str | None = "gelu"
    dtype: str = "bfloat16"
    validate: Callable[[SuiteOptions], None] | None = None
    layout: Layout = DEFAULT_LAYOUT
