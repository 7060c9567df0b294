"""The main job behind ``flashdmoe run``: one step loop (:func:`run_job`) over the ranks of an executor
(:class:`InProcessRanks`, or ``ray_actors.MoECluster`` on Ray), one float64 verification
(:mod:`flashdmoe.job.verification`), one versioned results schema (:mod:`flashdmoe.job.results`).

Modules: ``data`` (the seeded tensors of a step), ``executor`` (what the loop needs from the ranks),
``in_process`` (ranks in this process), ``loop`` (the steps), ``verification``, ``results``, ``table``
(console report), ``plot`` (``latency.png``), ``preflight`` (memory and cluster checks before a run starts).
"""

from __future__ import annotations

from flashdmoe.job.executor import ClusterTooSmall, ClusterUnreachable, RankExecutor, WorkerFault
from flashdmoe.job.in_process import InProcessRanks
from flashdmoe.job.loop import run_job
from flashdmoe.job.results import RESULTS_FILENAME, SCHEMA_VERSION, write_results
from flashdmoe.job.verification import tolerance_for

__all__ = ["RESULTS_FILENAME", "SCHEMA_VERSION", "ClusterTooSmall", "ClusterUnreachable", "InProcessRanks",
           "RankExecutor", "WorkerFault", "run_job", "tolerance_for", "write_results"]
