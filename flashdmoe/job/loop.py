"""The main job's step loop, for every executor (:mod:`flashdmoe.job.executor`): ``config.steps`` timed
forward + backward steps on every rank, then the float64 verification of step 0
(:mod:`flashdmoe.job.verification`), the report (:mod:`flashdmoe.job.table`) and ``results.json`` with
``latency.png`` (:mod:`flashdmoe.job.results`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from flashdmoe.job import verification
from flashdmoe.job.executor import RankExecutor
from flashdmoe.job.results import make_results, write_results
from flashdmoe.job.table import print_results

__all__ = ["VERIFIED_STEP", "run_job"]

#: The step whose outputs and gradients verification checks (run once more after the timed steps).
VERIFIED_STEP = 0


def run_job(ranks: RankExecutor, *, verify: bool = True, output_dir: str | Path | None = None,
            progress: bool = True, console: Console | None = None,
            crash: dict[str, Any] | None = None,
            on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``ranks.config.steps`` steps on ``ranks``, verify step 0, report and write the results.

    Args:
        ranks: the open executor (its ``config`` is the run's).
        verify: check step 0's outputs and gradients of every rank against the float64 oracle
            (:func:`flashdmoe.job.verification.verify_step`).
        output_dir: directory for ``results.json`` and ``latency.png`` (created); ``None`` writes nothing.
        progress: show a progress bar on stderr.
        console: where to print the report (:func:`flashdmoe.job.table.print_results`), before any file is
            written; ``None`` prints nothing.
        crash: fault injection for tests, ``{"step": s, "rank": r, "at": point}`` (and ``"seconds"`` for
            ``"at": "stall"``): passed to ``ranks.step(s)`` without ``"step"``.
        on_step: called with each step's record as soon as the step is done (``flashdmoe run`` appends it
            to ``steps.jsonl``: :class:`flashdmoe.job.results.StepLog`).

    Returns:
        The results dict (:mod:`flashdmoe.job.results`), as written.

    Raises:
        WorkerFault: the team broke and the executor's bounded retries did not bring it back.
        OutputWriteError: ``results.json`` or ``latency.png`` could not be written (after the report).
    """
    config = ranks.config
    if crash is not None and (not isinstance(crash, dict) or not {"step", "rank", "at"} <= set(crash)
                              or not set(crash) <= {"step", "rank", "at", "seconds"}):
        raise ValueError(f"crash={crash!r}: expected None or {{'step': s, 'rank': r, 'at': point}} (and 'seconds' "
                         "for a stall)")
    started = time.perf_counter()
    records = []
    with Progress(console=Console(stderr=True), disable=not progress, transient=False) as bar:
        task = bar.add_task(f"flashdmoe run ({ranks.backend} over {ranks.transport}, {config.world_size} rank(s))",
                            total=config.steps)
        for step in range(config.steps):
            injected = None
            if crash is not None and crash["step"] == step:
                injected = {key: value for key, value in crash.items() if key != "step"}
            records.append(ranks.step(step, crash=injected))
            if on_step is not None:
                on_step(records[-1])
            bar.advance(task)
    checked = verification.verify_step(ranks, VERIFIED_STEP) if verify else verification.skipped()
    results = make_results(ranks, records, checked, wall_s=time.perf_counter() - started)
    if console is not None:
        print_results(results, console)
    if output_dir is not None:
        write_results(results, output_dir)
        if console is not None:
            console.print(f"results written to {results['output']} and {results['plot']}", markup=False,
                          highlight=False)
    return results
