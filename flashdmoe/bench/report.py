"""Results out: JSON file, a Markdown table for docs/benchmarks.md, a PNG bar plot, a rich table.

Works on any ``SuiteResult``: shape columns come from each configuration's ``shape`` dict; the columns
after them come from the suite's :class:`Layout` (``Suite.layout``; by default the single-gpu columns).
``settings["notes"]`` (a list of strings) adds bullet lines to the Markdown header; ``settings["error_formula"]``
replaces its description of the error column and ``settings["plot_quantity"]`` the plot's "forward".
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flashdmoe.bench.results import ConfigResult, EntryResult, SuiteResult
from flashdmoe.outputs import write_files

REASON_WIDTH_IN_TERMINAL = 48


def output_paths(result: SuiteResult, output_dir: Path) -> dict[str, Path]:
    stem = result.suite
    return {
        "json": output_dir / f"{stem}.json",
        "markdown": output_dir / f"{stem}.md",
        "plot": output_dir / f"{stem}.png",
    }


def write_all(result: SuiteResult, output_dir: Path | str, layout: Layout | None = None) -> dict[str, Path]:
    """Write ``<suite>.json``, ``<suite>.md`` (tables in ``layout``) and ``<suite>.png`` into output_dir
    (created), all whole or none (:func:`flashdmoe.outputs.write_files`).

    Raises:
        flashdmoe.outputs.OutputWriteError: a file could not be written; the files already there are as they were.
    """
    paths = output_paths(result, Path(output_dir))
    json_bytes = json_text(result).encode("utf-8")
    markdown = markdown_report(result, plot_name=paths["plot"].name, layout=layout).encode("utf-8")
    figure = plot_figure(result)
    write_files({paths["json"]: lambda handle: handle.write(json_bytes),
                 paths["markdown"]: lambda handle: handle.write(markdown),
                 paths["plot"]: lambda handle: figure.savefig(handle, format="png", dpi=120)})
    return paths


def json_text(result: SuiteResult) -> str:
    """The JSON report of ``result``."""
    # Infinite errors (non-finite outputs) are written as strings: JSON has no Infinity.
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        if isinstance(value, list):
            return [finite(item) for item in value]
        return value

    return json.dumps(finite(result.to_dict()), indent=2) + "\n"


def number_text(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def tflops_text(value: float | None) -> str:
    # Tiny CPU smoke shapes run at a few GFLOP/s: keep three significant digits there.
    if value is None:
        return "–"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def error_text(entry: EntryResult) -> str:
    if entry.max_relative_error is None:
        return "–"
    mark = "" if entry.correct in (True, None) else " FAIL"
    return f"{entry.max_relative_error:.1e}{mark}"


def status_text(entry: EntryResult, width: int | None = None) -> str:
    if entry.status == "ok":
        return "ok"
    text = f"{entry.status}: {entry.reason}" if entry.reason else entry.status
    if width is not None and len(text) > width:
        text = text[: width - 1] + "…"
    return text


def spread_text(entry: EntryResult) -> str:
    return "–" if entry.p10_ms is None else f"{entry.p10_ms:.3f}–{entry.p90_ms:.3f}"


def clock_text(entry: EntryResult) -> str:
    """The SM clock after the entry's timing rounds (``details["sm_clock_mhz"]``): ``"min–max"`` MHz, one value
    when they agree, ``"–"`` where it was not read."""
    clocks = (entry.details or {}).get("sm_clock_mhz") or []
    if not clocks:
        return "–"
    low, high = min(clocks), max(clocks)
    return f"{low}" if low == high else f"{low}–{high}"


def speedup_text(entry: EntryResult) -> str:
    return "–" if entry.speedup_over_grouped_mm is None else f"{entry.speedup_over_grouped_mm:.2f}x"


@dataclass(frozen=True)
class Column:
    """One table column: its header and the cell text of an entry on a configuration."""

    header: str
    cell: Callable[[ConfigResult, EntryResult], str]
    justify: str = "right"  # terminal alignment


@dataclass(frozen=True)
class Layout:
    """The columns after the shape: ``markdown`` for the .md table, ``terminal`` for the rich table."""

    markdown: tuple[Column, ...]
    terminal: tuple[Column, ...]


def ratio_cell(key: str, percent: bool = False) -> Callable[[ConfigResult, EntryResult], str]:
    """Cell of the ratio ``entry.details[key]``: ``1.23x``, or ``45.6%`` with ``percent``."""
    def cell(config: ConfigResult, entry: EntryResult) -> str:
        value = (entry.details or {}).get(key)
        if value is None:
            return "–"
        return f"{100.0 * value:.1f}%" if percent else f"{value:.2f}x"
    return cell


def sent_megabytes_cell(config: ConfigResult, entry: EntryResult) -> str:
    """Cell of ``entry.details["max_bytes_sent_per_rank"]`` in MB."""
    value = (entry.details or {}).get("max_bytes_sent_per_rank")
    return "–" if value is None else f"{value / 1e6:.2f}"


def nvshmem_megabytes_cell(config: ConfigResult, entry: EntryResult) -> str:
    """Cell of ``entry.details["max_nvshmem_bytes_sent_per_rank"]`` (the bytes of NVSHMEM puts) in MB."""
    value = (entry.details or {}).get("max_nvshmem_bytes_sent_per_rank")
    return "–" if value is None else f"{value / 1e6:.2f}"


DEFAULT_LAYOUT = Layout(
    markdown=(
        Column("floor ms", lambda config, entry: number_text(config.floor_ms, 3)),
        Column("entry", lambda config, entry: entry.label),
        Column("ms (median)", lambda config, entry: number_text(entry.median_ms, 3)),
        Column("p10–p90 ms", lambda config, entry: spread_text(entry)),
        Column("kernel ms (profiler)", lambda config, entry: number_text(entry.kernel_ms, 3)),
        Column("TFLOP/s", lambda config, entry: tflops_text(entry.tflops)),
        Column("% of ceiling", lambda config, entry: number_text(entry.percent_of_ceiling, 1)),
        Column("% of floor", lambda config, entry: number_text(entry.percent_of_floor, 1)),
        Column("vs grouped_mm", lambda config, entry: speedup_text(entry)),
        Column("max rel. error", lambda config, entry: error_text(entry)),
        Column("SM MHz", lambda config, entry: clock_text(entry)),
        Column("status", lambda config, entry: status_text(entry), "left"),
    ),
    terminal=(
        Column("entry", lambda config, entry: entry.name, "left"),
        Column("ms", lambda config, entry: number_text(entry.median_ms, 3)),
        Column("kernel ms", lambda config, entry: number_text(entry.kernel_ms, 3)),
        Column("TFLOP/s", lambda config, entry: tflops_text(entry.tflops)),
        Column("% ceil", lambda config, entry: number_text(entry.percent_of_ceiling, 1)),
        Column("% floor", lambda config, entry: number_text(entry.percent_of_floor, 1)),
        Column("vs gmm", lambda config, entry: speedup_text(entry)),
        Column("rel err", lambda config, entry: error_text(entry)),
        Column("status", lambda config, entry: status_text(entry, REASON_WIDTH_IN_TERMINAL), "left"),
    ),
)


def markdown_report(result: SuiteResult, plot_name: str | None = None, layout: Layout | None = None) -> str:
    """Header (command, date, machine, peaks) and one table row per (configuration, entry), the columns
    after the shape from ``layout`` (default: the single-gpu columns)."""
    machine = result.machine
    settings = result.settings
    peaks = [f"bf16 matmul ceiling {result.ceiling_tflops:.0f} TFLOP/s"] if result.ceiling_tflops else []
    if result.copy_bandwidth_gbps:
        peaks.append(f"copy bandwidth {result.copy_bandwidth_gbps:.0f} GB/s (read + write)")
    floor = f"floor = {settings['bytes_floor_formula']}; " if "bytes_floor_formula" in settings else ""
    lines = [
        f"### `{result.suite}` — {result.date or ''}",
        "",
        f"- Command: `{result.command}`",
        f"- Device: {machine.get('gpu_name') or machine.get('cpu') or machine.get('device')}, "
        f"torch {machine.get('torch')}, CUDA {machine.get('cuda_runtime')}",
        f"- dtype {settings.get('dtype')}, activation {settings.get('activation')}, "
        f"{settings.get('repeats')} timed runs after {settings.get('warmup')} warm-up, medians",
        *(["- Measured in this run: " + ", ".join(peaks)] if peaks else []),
        f"- FLOPs = {settings.get('flops_formula', '')}; {floor}"
        + settings.get(
            "error_formula",
            f"max rel. error = max|y − y_ref| / max|y_ref| against `flashdmoe.reference` "
            f"(tolerance {settings.get('error_tolerance')}; tokens whose k-th and (k+1)-th router "
            f"log-probabilities are within {settings.get('near_tie_log_gap')} are left out)",
        ),
    ]
    lines += [f"- {note}" for note in settings.get("notes", [])]
    lines.append("")
    columns = (layout or DEFAULT_LAYOUT).markdown
    shape_keys = list(result.configs[0].shape) if result.configs else []
    headers = shape_keys + [column.header for column in columns]
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    for config in result.configs:
        shape_cells = [str(config.shape[key]) for key in shape_keys]
        for entry in config.entries:
            cells = shape_cells + [column.cell(config, entry) for column in columns]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    if plot_name:
        lines += ["", f"![{result.suite} median ms per entry]({plot_name})"]
    return "\n".join(lines) + "\n"


def _compact_label(config: ConfigResult) -> str:
    return "/".join(str(value) for value in config.shape.values())


def rich_table(result: SuiteResult, layout: Layout | None = None) -> Table:
    """Short terminal summary: one row per (configuration, entry); full reasons are in the files."""
    shape_keys = "/".join(result.configs[0].shape) if result.configs else "config"
    columns = (layout or DEFAULT_LAYOUT).terminal
    table = Table(title=f"flashdmoe bench --suite {result.suite}", show_lines=False)
    table.add_column(shape_keys, justify="left", no_wrap=True, overflow="ellipsis")
    for column in columns:
        table.add_column(column.header, justify=column.justify, no_wrap=True, overflow="ellipsis")
    for config in result.configs:
        for index, entry in enumerate(config.entries):
            table.add_row(
                _compact_label(config) if index == 0 else "",
                *(column.cell(config, entry) for column in columns),
                end_section=index == len(config.entries) - 1,
            )
    return table


def print_summary(result: SuiteResult, console: Console | None = None, layout: Layout | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        # Logs (CI, ray job logs) are read later in wide viewers: do not squeeze to 80 columns.
        console.width = max(console.width, 150)
    console.print(rich_table(result, layout))


def _two_line_label(config: ConfigResult) -> str:
    parts = [f"{key}={value}" for key, value in config.shape.items()]
    middle = (len(parts) + 1) // 2
    return " ".join(parts[:middle]) + "\n" + " ".join(parts[middle:])


def plot_figure(result: SuiteResult):
    """Grouped bars: median ms per configuration, one bar per timed entry, log scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    entry_labels: list[str] = []
    for config in result.configs:
        for entry in config.entries:
            if entry.status == "ok" and entry.label not in entry_labels:
                entry_labels.append(entry.label)

    # A Figure of its own, not pyplot's: nothing global to close, and it is rendered only when written.
    figure = Figure(figsize=(max(6.0, 2.2 * len(result.configs) + 2.0), 4.8))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    bar_width = 0.8 / max(1, len(entry_labels))
    for entry_index, label in enumerate(entry_labels):
        positions, heights = [], []
        for config_index, config in enumerate(result.configs):
            entry = next((e for e in config.entries if e.label == label), None)
            if entry is not None and entry.status == "ok":
                positions.append(config_index + (entry_index - (len(entry_labels) - 1) / 2) * bar_width)
                heights.append(entry.median_ms)
        bars = axes.bar(positions, heights, width=bar_width, label=label)
        axes.bar_label(bars, labels=[f"{h:.3g}" for h in heights], fontsize=6, padding=1)
    floors = [(i, c.floor_ms) for i, c in enumerate(result.configs) if c.floor_ms]
    if floors:
        axes.scatter([i for i, _ in floors], [f for _, f in floors], marker="_", s=900,
                     color="black", label="bytes floor", zorder=3)
    axes.set_xticks(range(len(result.configs)))
    axes.set_xticklabels([_two_line_label(c) for c in result.configs], fontsize=8)
    axes.set_yscale("log")
    axes.set_ylabel(f"median ms per {result.settings.get('plot_quantity', 'forward')} (log)")
    device = result.machine.get("gpu_name") or result.machine.get("device")
    axes.set_title(f"flashdmoe bench {result.suite} — {device}, {result.settings.get('dtype')}")
    if entry_labels or floors:
        axes.legend(fontsize=8, markerscale=0.3)
    axes.grid(axis="y", which="both", alpha=0.3)
    figure.tight_layout()
    return figure
