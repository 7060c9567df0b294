"""Results out: JSON file, a Markdown table for docs/benchmarks.md, a PNG bar plot, a rich table.

Works on any ``SuiteResult``: shape columns come from each configuration's ``shape`` dict.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flashdmoe.bench.results import ConfigResult, EntryResult, SuiteResult

REASON_WIDTH_IN_TERMINAL = 48


def output_paths(result: SuiteResult, output_dir: Path) -> dict[str, Path]:
    stem = result.suite
    return {
        "json": output_dir / f"{stem}.json",
        "markdown": output_dir / f"{stem}.md",
        "plot": output_dir / f"{stem}.png",
    }


def write_all(result: SuiteResult, output_dir: Path | str) -> dict[str, Path]:
    """Write ``<suite>.json``, ``<suite>.md`` and ``<suite>.png`` into output_dir (created)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = output_paths(result, output_dir)
    write_json(result, paths["json"])
    paths["markdown"].write_text(markdown_report(result, plot_name=paths["plot"].name))
    write_plot(result, paths["plot"])
    return paths


def write_json(result: SuiteResult, path: Path) -> None:
    # Infinite errors (non-finite outputs) are written as strings: JSON has no Infinity.
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        if isinstance(value, list):
            return [finite(item) for item in value]
        return value

    path.write_text(json.dumps(finite(result.to_dict()), indent=2) + "\n")


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _tflops_cell(value: float | None) -> str:
    # Tiny CPU smoke shapes run at a few GFLOP/s: keep three significant digits there.
    if value is None:
        return "–"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _error_cell(entry: EntryResult) -> str:
    if entry.max_relative_error is None:
        return "–"
    mark = "" if entry.correct in (True, None) else " FAIL"
    return f"{entry.max_relative_error:.1e}{mark}"


def _status_cell(entry: EntryResult, width: int | None = None) -> str:
    if entry.status == "ok":
        return "ok"
    text = f"{entry.status}: {entry.reason}" if entry.reason else entry.status
    if width is not None and len(text) > width:
        text = text[: width - 1] + "…"
    return text


def _row_cells(entry: EntryResult) -> list[str]:
    spread = (
        "–" if entry.p10_ms is None else f"{entry.p10_ms:.3f}–{entry.p90_ms:.3f}"
    )
    return [
        entry.label,
        _number(entry.median_ms, 3),
        spread,
        _tflops_cell(entry.tflops),
        _number(entry.percent_of_ceiling, 1),
        _number(entry.percent_of_floor, 1),
        "–" if entry.speedup_over_grouped_mm is None else f"{entry.speedup_over_grouped_mm:.2f}x",
        _error_cell(entry),
    ]


ROW_HEADERS = [
    "entry", "ms (median)", "p10–p90 ms", "TFLOP/s", "% of ceiling", "% of floor",
    "vs grouped_mm", "max rel. error",
]


def markdown_report(result: SuiteResult, plot_name: str | None = None) -> str:
    """Header (command, date, machine, peaks) and one table row per (configuration, entry)."""
    machine = result.machine
    settings = result.settings
    lines = [
        f"### `{result.suite}` — {result.date or ''}",
        "",
        f"- Command: `{result.command}`",
        f"- Device: {machine.get('gpu_name') or machine.get('cpu') or machine.get('device')}, "
        f"torch {machine.get('torch')}, CUDA {machine.get('cuda_runtime')}",
        f"- dtype {settings.get('dtype')}, activation {settings.get('activation')}, "
        f"{settings.get('repeats')} timed runs after {settings.get('warmup')} warm-up, medians",
        "- Measured in this run: "
        + (f"bf16 matmul ceiling {result.ceiling_tflops:.0f} TFLOP/s, " if result.ceiling_tflops else "")
        + (f"copy bandwidth {result.copy_bandwidth_gbps:.0f} GB/s (read + write)"
           if result.copy_bandwidth_gbps else ""),
        f"- FLOPs = {settings.get('flops_formula', '')}; floor = {settings.get('bytes_floor_formula', '')}; "
        f"max rel. error = max|y − y_ref| / max|y_ref| against `flashdmoe.reference` "
        f"(tolerance {settings.get('error_tolerance')}; tokens whose k-th and (k+1)-th router "
        f"log-probabilities are within {settings.get('near_tie_log_gap')} are left out)",
        "",
    ]
    shape_keys = list(result.configs[0].shape) if result.configs else []
    headers = shape_keys + ["floor ms"] + ROW_HEADERS + ["status"]
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "|".join("---" for _ in headers) + "|")
    for config in result.configs:
        shape_cells = [str(config.shape[key]) for key in shape_keys]
        for entry in config.entries:
            cells = shape_cells + [_number(config.floor_ms, 3)] + _row_cells(entry)
            cells.append(_status_cell(entry))
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    if plot_name:
        lines += ["", f"![{result.suite} median ms per entry]({plot_name})"]
    return "\n".join(lines) + "\n"


def _compact_label(config: ConfigResult) -> str:
    return "/".join(str(value) for value in config.shape.values())


def rich_table(result: SuiteResult) -> Table:
    """Short terminal summary: one row per (configuration, entry); full reasons are in the files."""
    shape_keys = "/".join(result.configs[0].shape) if result.configs else "config"
    table = Table(title=f"flashdmoe bench --suite {result.suite}", show_lines=False)
    for header, justify in (
        (shape_keys, "left"), ("entry", "left"), ("ms", "right"), ("TFLOP/s", "right"),
        ("% ceil", "right"), ("% floor", "right"), ("vs gmm", "right"), ("rel err", "right"),
        ("status", "left"),
    ):
        table.add_column(header, justify=justify, no_wrap=True, overflow="ellipsis")
    for config in result.configs:
        for index, entry in enumerate(config.entries):
            table.add_row(
                _compact_label(config) if index == 0 else "",
                entry.name,
                _number(entry.median_ms, 3),
                _tflops_cell(entry.tflops),
                _number(entry.percent_of_ceiling, 1),
                _number(entry.percent_of_floor, 1),
                "–" if entry.speedup_over_grouped_mm is None else f"{entry.speedup_over_grouped_mm:.2f}x",
                _error_cell(entry),
                _status_cell(entry, REASON_WIDTH_IN_TERMINAL),
                end_section=index == len(config.entries) - 1,
            )
    return table


def print_summary(result: SuiteResult, console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        # Logs (CI, ray job logs) are read later in wide viewers: do not squeeze to 80 columns.
        console.width = max(console.width, 150)
    console.print(rich_table(result))


def _two_line_label(config: ConfigResult) -> str:
    parts = [f"{key}={value}" for key, value in config.shape.items()]
    middle = (len(parts) + 1) // 2
    return " ".join(parts[:middle]) + "\n" + " ".join(parts[middle:])


def write_plot(result: SuiteResult, path: Path) -> None:
    """Grouped bars: median ms per configuration, one bar per timed entry, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entry_labels: list[str] = []
    for config in result.configs:
        for entry in config.entries:
            if entry.status == "ok" and entry.label not in entry_labels:
                entry_labels.append(entry.label)

    figure, axes = plt.subplots(figsize=(max(6.0, 2.2 * len(result.configs) + 2.0), 4.8))
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
    axes.set_ylabel("median ms per forward (log)")
    device = result.machine.get("gpu_name") or result.machine.get("device")
    axes.set_title(f"flashdmoe bench {result.suite} — {device}, {result.settings.get('dtype')}")
    if entry_labels or floors:
        axes.legend(fontsize=8, markerscale=0.3)
    axes.grid(axis="y", which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
