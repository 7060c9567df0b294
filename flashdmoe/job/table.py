"""The main job's console report of a results dict (:mod:`flashdmoe.job.results`): a table of steps, a
table of ranks where ranks are timed apart, medians, retries and faults, and the verification verdict."""

from __future__ import annotations

import math
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["default_console", "print_results"]


def default_console() -> Console:
    """stdout; 132 columns when not a terminal, so that job logs keep the tables' rows whole."""
    return Console(width=None if sys.stdout.isatty() else 132)


def _shown(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _nan_first(error: float) -> float:
    return math.inf if math.isnan(error) else error


def _kib(value: float | None) -> float | None:
    return None if value is None else value / 1024


def _mib(value: float | None) -> float | None:
    return None if value is None else value / 2**20


def print_results(results: dict[str, Any], console: Console) -> None:
    """Print ``results`` on ``console``."""
    run, config, metrics = results["run"], results["config"], results["metrics"]
    ranks_on = "in this process" if run["executor"] == "in-process" else "on Ray"
    console.print(f"FlashDMoE run: backend {run['backend']}, transport {run['transport']}, {run['world_size']} rank(s) "
                  f"{ranks_on}; T={config['tokens_per_rank']}/rank H={config['hidden']} I={config['ffn']} "
                  f"E={config['experts']} k={config['top_k']} {config['dtype']} {config['activation']}",
                  markup=False, highlight=False)

    steps = Table(title="steps (times of the slowest rank)")
    for column in ("step", "attempts", "forward ms", "backward ms", "step ms", "tokens/s", "dropped", "KiB sent"):
        steps.add_column(column, justify="right")
    for record in results["steps"]:
        steps.add_row(str(record["step"]), str(record["attempts"]), _shown(record["forward_ms"], ".3f"),
                      _shown(record["backward_ms"], ".3f"), _shown(record["latency_ms"], ".3f"),
                      _shown(record["tokens_per_s"], ",.0f"), str(record["dropped"]),
                      _shown(_kib(record["bytes_sent"]), ",.1f"))
    console.print(steps)

    per_rank = metrics["per_rank"]
    if any(entry["latency_ms_median"] is not None for entry in per_rank):
        ranks = Table(title=f"ranks (medians over {metrics['steps_in_median']} step(s))")
        for column in ("rank", "forward ms", "backward ms", "step ms", "tokens/s", "TFLOP/s", "KiB sent/step",
                       "payload eff.", "peak MiB"):
            ranks.add_column(column, justify="right")
        for entry in per_rank:
            ranks.add_row(str(entry["rank"]), _shown(entry["forward_ms_median"], ".3f"),
                          _shown(entry["backward_ms_median"], ".3f"), _shown(entry["latency_ms_median"], ".3f"),
                          _shown(entry["tokens_per_s"], ",.0f"), _shown(entry["tflops"], ".4f"),
                          _shown(_kib(entry["bytes_sent_per_step"]), ",.1f"),
                          _shown(entry["payload_efficiency"], ".1%"), _shown(_mib(entry["peak_memory_bytes"]), ",.0f"))
        console.print(ranks)

    console.print(f"median over {metrics['steps_in_median']} step(s): forward {_shown(metrics['forward_ms_median'], '.3f')} "
                  f"ms, backward {_shown(metrics['backward_ms_median'], '.3f')} ms, step "
                  f"{_shown(metrics['latency_ms_median'], '.3f')} ms, {_shown(metrics['tokens_per_s'], ',.0f')} "
                  f"tokens/s, {_shown(metrics['tflops'], '.4f')} TFLOP/s; peak memory "
                  f"{_shown(_mib(metrics['peak_memory_bytes']), ',.0f')} MiB", highlight=False)
    # plain text: messages may hold [brackets]
    console.print(f"retries: {results['retries']}" + "".join(
        f"\n  step {fault['step']} ({fault['call']}): {fault['kind']} on rank(s) {fault['ranks']}"
        + (f", recovered in {fault['recovery_s']:.1f}s" if fault["recovered"] else ", NOT recovered")
        + "".join(f"\n    rank {report['rank']}: {report['error']}: {report['message']}"
                  for report in fault["reports"])
        for fault in results["faults"]), markup=False, highlight=False)

    verification = results["verification"]
    if not verification["enabled"]:
        console.print("verification: skipped (--no-verify)")
    else:
        verdict = "PASSED" if verification["passed"] else "FAILED"
        worst = max(verification["tensors"], key=lambda name: _nan_first(verification["tensors"][name]["max_rel_err"]))
        console.print(f"verification {verdict} (step {verification['step']}): max rel err "
                      f"{verification['max_rel_err']:.2e} ({worst}; tolerance {verification['tolerance']:.0e}), "
                      f"max abs err {verification['max_abs_err']:.2e}, against {verification['oracle']}",
                      markup=False, highlight=False)
