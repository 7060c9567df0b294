"""``latency.png``: per-step latency of a run (forward + backward), per rank where ranks are timed apart."""

from __future__ import annotations

from typing import Any

__all__ = ["latency_figure"]


def latency_figure(results: dict[str, Any]):
    """The matplotlib figure of the step latencies of ``results`` (:mod:`flashdmoe.job.results`), written as
    ``latency.png`` by :func:`flashdmoe.job.results.write_results`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    records = results["steps"]
    steps = [record["step"] for record in records]
    run = results["run"]
    per_rank = bool(records) and all(entry["latency_ms"] is not None
                                     for record in records for entry in record["ranks"])
    if per_rank:
        for rank in range(run["world_size"]):
            axes.plot(steps, [record["ranks"][rank]["latency_ms"] for record in records], marker="o",
                      label=f"rank {rank}")
        latencies = [entry["latency_ms"] for record in records for entry in record["ranks"]]
    else:
        latencies = [record["latency_ms"] for record in records]
        axes.plot(steps, latencies, marker="o", label=f"all {run['world_size']} ranks (one process)")
    if latencies and min(latencies) > 0 and max(latencies) / min(latencies) > 20:
        axes.set_yscale("log")  # e.g. a retried step next to fast ones
    axes.set_xlabel("step")
    axes.set_ylabel("forward + backward (ms)")
    axes.set_title(f"per-step latency: {run['backend']} over {run['transport']}, {run['world_size']} rank(s), "
                   f"{run['executor']}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return figure
