"""What the main job's step loop (:func:`flashdmoe.job.loop.run_job`) needs from the ranks it drives,
wherever they run: :class:`RankExecutor`, and the two ways a run can fail that are not bad input.

Two executors implement it: :class:`flashdmoe.job.in_process.InProcessRanks` (every rank in this
process, no Ray) and :class:`ray_actors.cluster.MoECluster` (one Ray actor per rank).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch

from flashdmoe.config import MoEConfig
from flashdmoe.job.data import StepOutputs

__all__ = ["ClusterTooSmall", "ClusterUnreachable", "RankExecutor", "WorkerFault"]


class ClusterTooSmall(ValueError):
    """The cluster cannot host the ranks asked for: too few CPUs or GPUs in all, on any one node, or free
    within the placement timeout. Raised before any step runs; the message names what was asked for and
    what the cluster has. A ``ValueError``: like bad input, the run as requested cannot start here."""


class ClusterUnreachable(ValueError):
    """The cluster address given does not answer (nothing accepts a connection there within the connect
    timeout), or ``"auto"`` finds no running cluster. Raised before anything starts; a ``ValueError``: the
    run as requested cannot start."""


class WorkerFault(RuntimeError):
    """The team broke during a call: a worker died, a kernel watchdog fired, a rank's team had failed
    earlier, or a worker stopped answering (hung: stopped, stuck in a collective or a kernel, or slower than
    the bound on a call). Raised out of an executor once its bounded retries are spent.

    Attributes:
        kind: ``"worker_died"``, ``"kernel_timeout"``, ``"team_failed"`` or ``"timeout"`` (hung).
        ranks: the ranks concerned (for ``"timeout"``: those that did not answer).
        reports: one entry per rank that did not return: ``{"rank", "error" (exception class name, or
            "stuck"), "message"}`` (a ``KernelTimeout``'s own text names the phase and the peer waited on).
    """

    def __init__(self, kind: str, ranks: Sequence[int], message: str,
                 reports: Sequence[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.ranks = list(ranks)
        self.reports = list(reports or [])


class RankExecutor(abc.ABC):
    """The ``config.world_size`` ranks of one run, ready to compute (set up when constructed); a context
    manager that frees them on exit.

    Attributes set by every implementation:
        kind: ``"in-process"`` or ``"ray"``.
        config: the layer and run (``world_size`` is the number of ranks).
        backend: the backend that runs, ``"reference"`` or ``"cuda"`` (the fused kernel).
        requested_backend: what was asked for: ``"auto"``, ``"reference"`` or ``"cuda"``.
        transport: how tokens travel between ranks: ``"gloo"`` (Ray workers on CPUs), ``"nvshmem"`` (Ray
            workers on GPUs, one team), ``"emulated"`` (every rank in one process) or ``"single"`` (one
            rank, nothing travels).
        startup_s: seconds the ranks took to start (Ray, actors, team bootstrap, weights).
        faults: every recovery from a broken team (see ``ray_actors.cluster.MoECluster``); empty where
            ranks cannot fail independently.
    """

    kind: str
    config: MoEConfig
    backend: str
    requested_backend: str
    transport: str
    startup_s: float
    faults: list[dict[str, Any]]

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @abc.abstractmethod
    def step(self, step: int, *, crash: dict[str, Any] | None = None) -> dict[str, Any]:
        """One timed forward + backward of every rank on its seeded data of ``step``
        (:func:`flashdmoe.job.data.seeded_inputs`).

        Args:
            step: the step index (selects the data).
            crash: fault injection for tests, ``{"rank": r, "at": point}`` (with ``"seconds"`` for a
                ``"stall"``; ``ray_actors.worker.CRASH_POINTS``); executors whose ranks cannot fail
                independently refuse it with ``ValueError``.

        Returns:
            The step record (:func:`flashdmoe.job.results.step_record`).
        """

    @abc.abstractmethod
    def forward_backward(self, xs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor]) -> StepOutputs:
        """Every rank's output for ``xs`` (``P`` tensors ``[T_r, H]``) and all gradients of
        ``sum_r <y_r, output_grads[r]>``, untimed, on the CPU."""

    @abc.abstractmethod
    def workers(self) -> list[dict[str, Any]]:
        """Where each rank runs: one :func:`flashdmoe.job.results.worker_entry` per rank."""

    @abc.abstractmethod
    def peak_memory_bytes(self) -> tuple[list[int | None], int | None]:
        """``(per rank, largest process)``: peak memory so far (CUDA max allocated, else the process's max
        RSS); a rank's entry is ``None`` where ranks share a process."""

    def close(self) -> None:
        """Free the ranks (idempotent)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
