"""What a benchmark suite is: a :class:`Suite` record (its runner, shapes, entries and table layout) and
the :class:`SuiteOptions` its runner receives. The suites themselves are listed in
:mod:`flashdmoe.bench.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console

from flashdmoe.bench.report import DEFAULT_LAYOUT, Layout
from flashdmoe.bench.results import BenchConfig, BenchShape, SuiteResult


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
    # shapes[i]'s own activation from --configs (None: ``activation``); empty: none has its own.
    shape_activations: tuple[str | None, ...] = ()

    def __post_init__(self) -> None:
        if self.shape_activations and len(self.shape_activations) != len(self.shapes):
            raise ValueError(f"shape_activations has {len(self.shape_activations)} entries: expected one per shape "
                             f"({len(self.shapes)})")

    def activation_of(self, index: int) -> str | None:
        """The activation of ``shapes[index]``: its own, else ``activation``."""
        own = self.shape_activations[index] if self.shape_activations else None
        return own or self.activation


@dataclass(frozen=True)
class Suite:
    """A named suite: ``runner(options) -> SuiteResult``; ``validate(options)`` (optional) raises ValueError
    for option combinations it cannot run; ``layout``: the columns of its tables after the shape;
    ``activation``: the default of ``--activation``, or None for a suite that pairs each shape with one;
    ``per_config_activation``: whether its runner honours an activation per ``--configs`` entry
    (:meth:`SuiteOptions.activation_of`); ``named_configs``: sets ``--configs NAME`` selects."""

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
    per_config_activation: bool = False
    named_configs: dict[str, tuple[BenchConfig, ...]] = field(default_factory=dict)
