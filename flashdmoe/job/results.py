"""The main job's results: one versioned schema, written by :func:`write_results` as ``results.json``
whether the ranks ran in one process or on Ray (same keys at every level; ``null`` where a value is not
measured by that executor). Times are milliseconds (``_ms``) or seconds (``_s``), sizes bytes.

Schema version 2 (:data:`SCHEMA_VERSION`; 2 added ``nvshmem_bytes`` per rank and step); the key lists below (``*_FIELDS``) are exact:

``RESULTS_FIELDS`` (top level)
    ``schema_version`` (int); ``created`` (ISO 8601, UTC); ``config`` (the config's fields,
    ``MoEConfig.to_dict()``, ``world_size`` = ranks run); ``run``; ``workers`` (one per rank);
    ``steps`` (one per step); ``metrics``; ``verification``; ``retries`` (recoveries performed);
    ``faults``; ``environment`` (versions: ``flashdmoe``, ``torch``, ``python``, ``platform``, ``ray``);
    ``output`` / ``plot`` (paths of ``results.json`` / ``latency.png``; ``null`` when not written).
``RUN_FIELDS`` (``run``)
    ``executor`` (``"in-process"`` or ``"ray"``); ``backend`` (``"reference"`` or ``"cuda"``, the one
    that ran); ``requested_backend`` (``"auto"``, ``"reference"`` or ``"cuda"``); ``transport``
    (``"gloo"``, ``"nvshmem"``, ``"emulated"`` or ``"single"``); ``world_size``; ``steps``;
    ``startup_s`` (starting the ranks); ``wall_s`` (first step to the end of verification).
``WORKER_FIELDS`` (``workers[]``)
    ``rank``; ``local_rank`` (index among the ranks of its node: ``rank % (world_size // nodes)`` on Ray);
    ``pid``; ``hostname``; ``node_id`` (Ray node, ``null`` in-process); ``node_ip`` (that node's address as
    Ray reports it, ``null`` in-process); ``device``;
    ``device_name`` (GPU name or ``null``); ``gpu_ids`` (Ray's assignment); ``generation`` (team
    bootstraps so far, 1 + recoveries); ``team_id``; ``team`` (``Team.describe()`` or ``null``); ``mps``
    (``{"pipe_dir", "log_dir", "thread_percentage"}``: the CUDA MPS variables the rank's process sees,
    ``null`` where unset).
``STEP_FIELDS`` (``steps[]``)
    ``step``; ``attempts`` (1 + retries of this step); ``tokens`` (all ranks); ``forward_ms``,
    ``backward_ms``, ``latency_ms`` (forward + backward) of the slowest rank, or of the whole step where
    ranks share a process; ``tokens_per_s`` (``tokens / latency``); ``dropped`` (choices dropped by
    capacity, all ranks); ``bytes_sent`` (all ranks, or ``null``); ``ranks`` (one per rank).
``RANK_STEP_FIELDS`` (``steps[].ranks[]``)
    ``rank``; ``tokens``; ``forward_ms``, ``backward_ms``, ``latency_ms`` (``null`` where ranks share a
    process); ``dropped``; ``bytes_sent`` (gloo: every byte handed to other ranks, forward and backward;
    cuda: the forward kernel's ``dispatch_bytes + combine_bytes``, or the dispatch payload estimated from
    the routing); ``rows_sent_remote``; ``dispatch_bytes``, ``combine_bytes`` (as the kernel reports
    them, else ``null``); ``nvshmem_bytes`` (the part of ``dispatch_bytes + combine_bytes`` that went
    through NVSHMEM puts, the rest being peer-pointer stores; ``null`` where the kernel does not report
    traffic); ``payload_efficiency`` (``dispatch_bytes`` over the routed rows' bytes, as the
    kernel reports it, else ``null``); ``traffic_source`` (``"gloo"``, ``"kernel"``, ``"estimate"`` or
    ``null``).
``METRICS_FIELDS`` (``metrics``: medians over the steps after the first, which pays one-time costs,
or over the only step)
    ``steps_in_median``; ``tokens_per_step``; ``flops_per_step`` (forward + backward, backward counted
    as twice :func:`forward_flops`); ``forward_ms_median``, ``backward_ms_median``, ``latency_ms_median``
    (of ``steps[]``); ``tokens_per_s`` and ``tflops`` (per ``latency_ms_median``);
    ``peak_memory_bytes`` (the largest process); ``per_rank`` (one per rank, ``RANK_METRICS_FIELDS``:
    ``rank``, ``forward_ms_median``, ``backward_ms_median``, ``latency_ms_median``, ``tokens_per_s``,
    ``tflops``, ``bytes_sent_per_step``, ``payload_efficiency``, ``peak_memory_bytes``; ``null`` where
    not measured per rank).
``VERIFICATION_FIELDS`` (``verification``)
    ``enabled``; ``step`` (the step checked); ``oracle``; ``metric``; ``tolerance``; ``max_abs_err``;
    ``max_rel_err``; ``passed``; ``tensors`` (``{name: {"max_abs_err", "max_rel_err", "worst_rank"}}``
    for ``y``, ``dx``, ``d_router_weight``, ``d_w1``, ``d_w2``): see
    :mod:`flashdmoe.job.verification`. All ``null`` except ``enabled`` when not verified.
``FAULT_FIELDS`` (``faults[]``)
    ``call``; ``step``; ``attempt``; ``kind`` (``"worker_died"``, ``"kernel_timeout"``,
    ``"team_failed"``, ``"timeout"``); ``ranks``; ``error``; ``reports`` (per rank: ``{"rank", "error",
    "message"}``); ``recovered``; ``recovery_s``, ``teams_closed``, ``generation`` (``null`` when not
    recovered).

Beside ``results.json``, :class:`StepLog` keeps ``steps.jsonl`` (:data:`STEPS_LOG_FILENAME`): one JSON object
per line for each step as soon as it is done, so a run cut short (killed, interrupted, a team that could
not be recovered) keeps the steps it finished. ``STEP_LINE_FIELDS``: ``run_started`` (ISO 8601, UTC, the
same on every line of one run: each run starts the file anew) followed by the ``STEP_FIELDS`` of that step,
exactly as in ``steps[]``.

``results.json`` and ``latency.png`` are written whole or not at all (:func:`flashdmoe.outputs.write_files`):
when either cannot be written, the files of an earlier run in that directory are left as they were.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from flashdmoe.config import MoEConfig
from flashdmoe.outputs import OutputWriteError, write_files

__all__ = ["FAULT_FIELDS", "METRICS_FIELDS", "PLOT_FILENAME", "RANK_METRICS_FIELDS", "RANK_STEP_FIELDS",
           "RESULTS_FIELDS", "RESULTS_FILENAME", "RUN_FIELDS", "SCHEMA_VERSION", "STEPS_LOG_FILENAME", "STEP_FIELDS",
           "STEP_LINE_FIELDS", "StepLog", "VERIFICATION_FIELDS", "WORKER_FIELDS", "fault_entry", "forward_flops",
           "make_results", "rank_step_entry", "step_record", "summarize", "worker_entry", "write_results"]

SCHEMA_VERSION = 2
RESULTS_FILENAME = "results.json"
PLOT_FILENAME = "latency.png"
STEPS_LOG_FILENAME = "steps.jsonl"

RESULTS_FIELDS = ("schema_version", "created", "config", "run", "workers", "steps", "metrics", "verification",
                  "retries", "faults", "environment", "output", "plot")
RUN_FIELDS = ("executor", "backend", "requested_backend", "transport", "world_size", "steps", "startup_s", "wall_s")
WORKER_FIELDS = ("rank", "local_rank", "pid", "hostname", "node_id", "node_ip", "device", "device_name",
                 "gpu_ids", "generation", "team_id", "team", "mps")
STEP_FIELDS = ("step", "attempts", "tokens", "forward_ms", "backward_ms", "latency_ms", "tokens_per_s", "dropped",
               "bytes_sent", "ranks")
STEP_LINE_FIELDS = ("run_started", *STEP_FIELDS)
RANK_STEP_FIELDS = ("rank", "tokens", "forward_ms", "backward_ms", "latency_ms", "dropped", "bytes_sent",
                    "rows_sent_remote", "dispatch_bytes", "combine_bytes", "nvshmem_bytes", "payload_efficiency",
                    "traffic_source")
METRICS_FIELDS = ("steps_in_median", "tokens_per_step", "flops_per_step", "forward_ms_median", "backward_ms_median",
                  "latency_ms_median", "tokens_per_s", "tflops", "peak_memory_bytes", "per_rank")
RANK_METRICS_FIELDS = ("rank", "forward_ms_median", "backward_ms_median", "latency_ms_median", "tokens_per_s",
                       "tflops", "bytes_sent_per_step", "payload_efficiency", "peak_memory_bytes")
VERIFICATION_FIELDS = ("enabled", "step", "oracle", "metric", "tolerance", "max_abs_err", "max_rel_err", "passed",
                       "tensors")
FAULT_FIELDS = ("call", "step", "attempt", "kind", "ranks", "error", "reports", "recovered", "recovery_s",
                "teams_closed", "generation")


def forward_flops(config: MoEConfig, tokens: int) -> int:
    """Forward FLOPs for ``tokens`` tokens: ``2*T*k*H*I*(3 if swiglu else 2) + 2*T*H*E`` (expert GEMMs
    of the kept and dropped choices alike, plus the router GEMM)."""
    matmuls = 3 if config.activation == "swiglu" else 2
    return 2 * tokens * config.top_k * config.hidden * config.ffn * matmuls + 2 * tokens * config.hidden * config.experts


def _filled(fields: Sequence[str], values: dict[str, Any], what: str) -> dict[str, Any]:
    unknown = set(values) - set(fields)
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {', '.join(sorted(unknown))}; expected some of {', '.join(fields)}")
    return {field: values.get(field) for field in fields}


def worker_entry(**fields: Any) -> dict[str, Any]:
    """A ``workers[]`` entry: ``WORKER_FIELDS``, ``None`` for those not given."""
    return _filled(WORKER_FIELDS, fields, "worker entry")


def rank_step_entry(**fields: Any) -> dict[str, Any]:
    """A ``steps[].ranks[]`` entry: ``RANK_STEP_FIELDS``, ``None`` for those not given."""
    return _filled(RANK_STEP_FIELDS, fields, "rank step entry")


def fault_entry(**fields: Any) -> dict[str, Any]:
    """A ``faults[]`` entry: ``FAULT_FIELDS``, ``None`` for those not given."""
    return _filled(FAULT_FIELDS, fields, "fault entry")


def _sum_or_none(values: Sequence[Any]) -> Any:
    return None if any(value is None for value in values) else sum(values)


def _max_or_none(values: Sequence[Any]) -> Any:
    return None if not values or any(value is None for value in values) else max(values)


def step_record(step: int, ranks: Sequence[dict[str, Any]], *, attempts: int = 1, forward_ms: float | None = None,
                backward_ms: float | None = None) -> dict[str, Any]:
    """A ``steps[]`` record from the per-rank entries (:func:`rank_step_entry`). The step's times are the
    slowest rank's, or ``forward_ms`` / ``backward_ms`` when the step was timed as a whole (ranks sharing
    a process)."""
    if forward_ms is None:
        forward_ms = _max_or_none([rank["forward_ms"] for rank in ranks])
        backward_ms = _max_or_none([rank["backward_ms"] for rank in ranks])
        latency_ms = _max_or_none([rank["latency_ms"] for rank in ranks])
    else:
        latency_ms = forward_ms + backward_ms
    tokens = sum(rank["tokens"] for rank in ranks)
    return {"step": step, "attempts": attempts, "tokens": tokens, "forward_ms": forward_ms,
            "backward_ms": backward_ms, "latency_ms": latency_ms,
            "tokens_per_s": tokens / (latency_ms / 1e3) if latency_ms else None,
            "dropped": sum(rank["dropped"] for rank in ranks),
            "bytes_sent": _sum_or_none([rank["bytes_sent"] for rank in ranks]), "ranks": list(ranks)}


def _median_or_none(values) -> float | None:
    values = list(values)
    if not values or any(value is None for value in values):
        return None
    return statistics.median(values)


def summarize(config: MoEConfig, records: Sequence[dict[str, Any]], peak_per_rank: Sequence[int | None],
              peak_largest: int | None) -> dict[str, Any]:
    """``metrics`` from the step records (see the module docstring)."""
    timed = list(records[1:] if len(records) > 1 else records)
    tokens = config.tokens_per_rank * config.world_size
    step_flops = 3 * forward_flops(config, tokens)
    latency = _median_or_none(record["latency_ms"] for record in timed)
    per_rank = []
    for rank in range(config.world_size):
        entries = [record["ranks"][rank] for record in timed]
        rank_latency = _median_or_none(entry["latency_ms"] for entry in entries)
        efficiencies = [entry["payload_efficiency"] for entry in entries if entry["payload_efficiency"] is not None]
        per_rank.append({
            "rank": rank,
            "forward_ms_median": _median_or_none(entry["forward_ms"] for entry in entries),
            "backward_ms_median": _median_or_none(entry["backward_ms"] for entry in entries),
            "latency_ms_median": rank_latency,
            "tokens_per_s": config.tokens_per_rank / (rank_latency / 1e3) if rank_latency else None,
            "tflops": 3 * forward_flops(config, config.tokens_per_rank) / (rank_latency / 1e3) / 1e12
            if rank_latency else None,
            "bytes_sent_per_step": _median_or_none(entry["bytes_sent"] for entry in entries),
            "payload_efficiency": statistics.median(efficiencies) if efficiencies else None,
            "peak_memory_bytes": peak_per_rank[rank] if rank < len(peak_per_rank) else None,
        })
    return {"steps_in_median": len(timed), "tokens_per_step": tokens, "flops_per_step": step_flops,
            "forward_ms_median": _median_or_none(record["forward_ms"] for record in timed),
            "backward_ms_median": _median_or_none(record["backward_ms"] for record in timed),
            "latency_ms_median": latency,
            "tokens_per_s": tokens / (latency / 1e3) if latency else None,
            "tflops": step_flops / (latency / 1e3) / 1e12 if latency else None,
            "peak_memory_bytes": peak_largest, "per_rank": per_rank}


def _environment() -> dict[str, Any]:
    from flashdmoe import __version__

    try:
        ray_version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        ray_version = None
    return {"flashdmoe": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "ray": ray_version}


def make_results(ranks, records: Sequence[dict[str, Any]], verification: dict[str, Any], *,
                 wall_s: float) -> dict[str, Any]:
    """The results dict of a run on ``ranks`` (a :class:`flashdmoe.job.executor.RankExecutor`, still
    open) with step ``records`` and a ``verification`` record; ``output`` and ``plot`` are ``None`` until
    :func:`write_results`."""
    config = ranks.config
    peak_per_rank, peak_largest = ranks.peak_memory_bytes()
    faults = [fault_entry(**fault) for fault in ranks.faults]
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": config.to_dict(),
        "run": {"executor": ranks.kind, "backend": ranks.backend, "requested_backend": ranks.requested_backend,
                "transport": ranks.transport, "world_size": config.world_size, "steps": len(records),
                "startup_s": ranks.startup_s, "wall_s": wall_s},
        "workers": [worker_entry(**worker) for worker in ranks.workers()],
        "steps": list(records),
        "metrics": summarize(config, records, peak_per_rank, peak_largest),
        "verification": verification,
        "retries": sum(1 for fault in faults if fault["recovered"]),
        "faults": faults,
        "environment": _environment(),
        "output": None,
        "plot": None,
    }


def write_results(results: dict[str, Any], output_dir: str | Path) -> Path:
    """Write ``<output_dir>/results.json`` and ``<output_dir>/latency.png`` whole or not at all (the directory
    is created; its absolute path is used, so a ``ray job submit`` run names where its results went) and set
    ``results["output"]`` and ``results["plot"]``. Returns the JSON's path.

    Raises:
        OutputWriteError: a file could not be written; neither was replaced, no partial file is left, and
            ``results["output"]`` / ``results["plot"]`` stay ``None``.
    """
    from flashdmoe.job.plot import latency_figure

    directory = Path(os.path.abspath(output_dir))
    plot, path = directory / PLOT_FILENAME, directory / RESULTS_FILENAME
    figure = latency_figure(results)
    results["plot"], results["output"] = str(plot), str(path)
    # default=str: Team.describe() may hold values JSON has no type for (e.g. a torch dtype)
    text = json.dumps(results, indent=2, default=str) + "\n"
    try:
        write_files({plot: lambda handle: figure.savefig(handle, format="png"),
                     path: lambda handle: handle.write(text.encode("utf-8"))})
    except OutputWriteError:
        results["plot"] = results["output"] = None
        raise
    return path


class StepLog:
    """``<output_dir>/steps.jsonl``, begun anew: :meth:`append` adds one finished step's line (see the module
    docstring). A line that cannot be written (a full disk) is cut back off, so the file holds whole lines
    only; the log then stops with one warning on ``warnings`` (stderr) and the run goes on.

    Raises (constructor):
        OutputWriteError: the file cannot be created.
    """

    def __init__(self, output_dir: str | Path, *, warnings: TextIO | None = None) -> None:
        directory = Path(os.path.abspath(output_dir))
        self.path = directory / STEPS_LOG_FILENAME
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.error: OSError | None = None
        self._warnings = warnings
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._descriptor: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                                                   0o666)
        except OSError as error:
            raise OutputWriteError(self.path, error) from error

    def append(self, record: dict[str, Any]) -> None:
        """Add the line of step ``record`` (a ``steps[]`` record)."""
        if self._descriptor is None:
            return
        line = json.dumps({"run_started": self.started, **record}, default=str).encode("utf-8") + b"\n"
        size = None
        try:
            size = os.fstat(self._descriptor).st_size
            view = memoryview(line)
            while view:
                view = view[os.write(self._descriptor, view):]
        except OSError as error:
            if size is not None:
                try:
                    os.ftruncate(self._descriptor, size)
                except OSError:
                    pass
            self.error = error
            self.close()
            (self._warnings or sys.stderr).write(
                f"warning: {self.path}: cannot append step {record.get('step')} ({error.strerror or error}); "
                "the steps after it are only in the table and results.json\n")

    def close(self) -> None:
        if self._descriptor is not None:
            descriptor, self._descriptor = self._descriptor, None
            os.close(descriptor)

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
