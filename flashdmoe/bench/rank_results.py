"""Benchmark numbers from a multi-process run (:class:`flashdmoe.ranks.RunResult` of a timed rank scenario):
a forward's time is the slowest rank's, and traffic is summed over the ranks."""

from __future__ import annotations

from typing import Any

from flashdmoe.bench.timing import TimingStats
from flashdmoe.ranks import RunResult

__all__ = ["failure_details", "failure_reason", "timed_run_summary", "traffic_summary"]


def traffic_summary(traffic: list[dict] | None, hidden: int, element_bytes: int) -> dict:
    """From the per-rank traffic counters (one dict per rank, as ``LaunchReport.traffic()``): bytes each
    rank sent (dispatch + combine), their maximum, the payload efficiency over all ranks (None when no
    row went to another rank), and the part of the bytes sent through NVSHMEM puts
    (``nvshmem_bytes_sent_per_rank`` and its maximum; None where the counters have no NVSHMEM words, as
    the unfused baseline's)."""
    if not traffic:
        return {"traffic": traffic or [], "bytes_sent_per_rank": [], "max_bytes_sent_per_rank": None,
                "payload_efficiency": None, "nvshmem_bytes_sent_per_rank": None,
                "max_nvshmem_bytes_sent_per_rank": None}
    sent = [int(t.get("dispatch_bytes", 0)) + int(t.get("combine_bytes", 0)) for t in traffic]
    routed = sum(int(t.get("rows_routed_remote", 0)) for t in traffic) * hidden * element_bytes
    dispatched = sum(int(t.get("dispatch_bytes", 0)) for t in traffic)
    nvshmem = None
    if all("nvshmem_dispatch_bytes" in t for t in traffic):
        nvshmem = [int(t["nvshmem_dispatch_bytes"]) + int(t.get("nvshmem_combine_bytes", 0)) for t in traffic]
    return {"traffic": traffic, "bytes_sent_per_rank": sent, "max_bytes_sent_per_rank": max(sent),
            "payload_efficiency": dispatched / routed if routed else None, "nvshmem_bytes_sent_per_rank": nvshmem,
            "max_nvshmem_bytes_sent_per_rank": None if nvshmem is None else max(nvshmem)}


def failure_reason(run: RunResult) -> str:
    """One line: what each failed rank did."""
    return "; ".join(outcome.describe() for outcome in run.ranks if not outcome.ok)


def failure_details(run: RunResult) -> dict[str, Any]:
    """Every rank's outcome and the run's full summary (tracebacks, log tails) for the results file."""
    return {"ranks": [outcome.describe() for outcome in run.ranks], "summary": run.summary()}


def timed_run_summary(run: RunResult, hidden: int, element_bytes: int) -> tuple[TimingStats, dict[str, Any]]:
    """Timing and details of a run whose ranks all returned timing info (``samples_ms``, ``median_ms``,
    ``input_sets``, ``traffic``): per timed forward the slowest rank's time (the forwards are collective),
    the traffic summed over ranks (:func:`traffic_summary`), each rank's own median."""
    infos = [outcome.info for outcome in run.ranks]
    stats = TimingStats.from_samples([max(samples) for samples in zip(*(info["samples_ms"] for info in infos))])
    traffic = [dict(t) for info in infos for t in (info.get("traffic") or [])]
    details = traffic_summary(traffic, hidden, element_bytes)
    details["rank_medians_ms"] = [info["median_ms"] for info in infos]
    details["input_sets"] = infos[0].get("input_sets")
    return stats, details
