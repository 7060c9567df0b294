"""The Ray driver: :class:`MoECluster` (the Python API) and :func:`run_job` (the main job), DESIGN.md §6.

``MoECluster(config)`` starts an embedded Ray on 127.0.0.1 (or connects to ``address``), checks the
config and the cluster's resources before any actor starts, reserves a STRICT_PACK placement group with
one bundle per rank (``{"GPU": g}`` or ``{"CPU": 1}``), starts one :class:`ray_actors.worker.MoEWorker`
per bundle and bootstraps the team: on CPUs a gloo group whose TCP store rank 0 hosts on a fresh port,
on GPUs an NVSHMEM team (``flashdmoe.team.Team.nvshmem``) from a fresh unique id made by rank 0's actor
(``Team.make_unique_id``) and handed by the driver to every rank, sized for ``max_tokens`` tokens per
rank. All ``setup`` calls are submitted before any is awaited, because team initialisation is collective.

Several ranks on one GPU: ``gpus_per_worker=g < 1`` schedules each actor with ``num_gpus=g`` and gives it
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=floor(100 g)`` and the MPS daemon's pipe/log directories
(``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``; by default those of the driver's environment)
through the actor's ``runtime_env``. The MPS daemon is started by whoever starts the cluster
(docs/deploy.md, "Several ranks on one GPU").

Faults: when a worker dies during a call (``ray.exceptions.RayActorError``), a kernel watchdog fires on
any rank (``flashdmoe.KernelTimeout``, caught and reported by each worker) or a call exceeds
``call_timeout_s``, the team is torn down and bootstrapped again (new port or new unique id, new actors)
and the call is retried, at most ``max_retries`` times. After a watchdog every rank is alive, so every
worker first closes its team (collective; bounded by ``teardown_timeout_s``) before the actors are
replaced; after a death or a hang the workers are killed directly. Each recovery is recorded in
:attr:`MoECluster.faults` (with every rank's report) and reported by :func:`run_job`.

Run as a module for ``ray job submit``::

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m ray_actors.driver --config configs/tiny.yaml --verify --output /tmp/results
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flashdmoe import reference
from flashdmoe.config import MoEConfig, make_tokens, make_weights
from flashdmoe.errors import BackendUnavailable, KernelTimeout
from flashdmoe.runner import RESULTS_FILENAME, forward_flops, tolerance_for
from flashdmoe.team import TeamFailed
from ray_actors.worker import CRASH_POINTS, RemoteMoEWorker, gpu_env_vars, upstream_gradient

__all__ = ["BACKENDS", "PLOT_FILENAME", "MoECluster", "WorkerFault", "load_config", "main", "plot_latency", "run_job",
           "summarize", "verify_against_reference"]

#: ``backend`` values: ``auto`` (CUDA when the cluster has a GPU per worker and the NVSHMEM team exists,
#: else gloo), ``gloo`` (CPU expert parallelism) or ``cuda`` (fused kernel over an NVSHMEM team).
BACKENDS = ("auto", "gloo", "cuda")
PLOT_FILENAME = "latency.png"

#: After one rank fails, how long the others get to finish or fail before they count as stuck.
_FAULT_GRACE_S = 30.0

#: Token dtypes a multi-rank (NVSHMEM) team carries (flashdmoe.team.BufferPlan).
_TEAM_DTYPES = ("bfloat16", "float16")

_log = logging.getLogger(__name__)


class WorkerFault(RuntimeError):
    """The team broke during a call: a worker died, a kernel watchdog fired, a rank's team had failed
    earlier, or a call timed out.

    Attributes:
        kind: ``"worker_died"``, ``"kernel_timeout"``, ``"team_failed"`` or ``"timeout"``.
        ranks: the ranks concerned.
        reports: one entry per rank that did not return: ``{"rank", "error" (exception class name, or
            "stuck"), "message"}`` (a ``KernelTimeout``'s own text names the phase and the peer waited on).
    """

    def __init__(self, kind: str, ranks: Sequence[int], message: str,
                 reports: Sequence[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.ranks = list(ranks)
        self.reports = list(reports or [])


def load_config(config: MoEConfig | dict[str, Any] | str | Path) -> MoEConfig:
    """A :class:`MoEConfig` from a config, a mapping of its fields, or a YAML path (validated)."""
    if isinstance(config, MoEConfig):
        return config
    if isinstance(config, dict):
        return MoEConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return MoEConfig.from_yaml(config)
    raise ValueError(f"config: got {type(config).__name__}; expected a MoEConfig, a dict of its fields or a YAML path")


def _cuda_dtypes(world_size: int) -> tuple[str, ...]:
    """Config dtypes the CUDA backend runs for ``world_size`` ranks: the fused kernel's
    (``flashdmoe.cuda_backend.DTYPE_CODES``), and for several ranks only what a team's buffers carry."""
    from flashdmoe.config import CONFIG_DTYPES

    try:
        from flashdmoe.cuda_backend import DTYPE_CODES
        kernel = {dtype for dtype in DTYPE_CODES}
    except ImportError:
        kernel = {torch.bfloat16, torch.float16}
    names = tuple(name for name, dtype in CONFIG_DTYPES.items() if dtype in kernel)
    return names if world_size == 1 else tuple(name for name in names if name in _TEAM_DTYPES)


def _nvshmem_team_available() -> bool:
    try:
        from flashdmoe.team import Team
    except ImportError:
        return False
    return callable(getattr(Team, "nvshmem", None)) and callable(getattr(Team, "make_unique_id", None))


def _code_paths() -> str:
    """PYTHONPATH for embedded-Ray workers: where ``ray_actors`` and ``flashdmoe`` are imported from here."""
    import flashdmoe
    import ray_actors

    paths = [str(Path(module.__file__).resolve().parent.parent) for module in (ray_actors, flashdmoe)]
    paths += [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    return os.pathsep.join(dict.fromkeys(paths))


class MoECluster:
    """Expert-parallel MoE layer over Ray actors, one rank each. Use as a context manager.

    Args:
        config: the layer (a :class:`MoEConfig`, a dict of its fields or a YAML path).
        address: Ray cluster to connect to; ``None`` starts an embedded Ray on 127.0.0.1 (or joins the
            cluster of the Ray job this driver runs in, from ``RAY_ADDRESS``).
        workers: number of ranks ``P``; default ``config.world_size`` (the config is re-validated with it).
        backend: one of :data:`BACKENDS`.
        gpus_per_worker: GPU share per rank on the CUDA backend, ``0 < g <= 1`` (the actors' ``num_gpus``);
            below 1 several ranks share a GPU under MPS (DESIGN.md §4) and each gets
            ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=floor(100*g)``.
        max_retries: recoveries allowed per call before the fault is raised.
        collective_timeout_s: gloo's timeout for one collective (a dead peer is usually noticed sooner).
        call_timeout_s: longest a call may take on any rank before the team counts as hung.
        num_cpus: CPUs of the embedded Ray (default ``max(os.cpu_count(), P)``).
        max_tokens: most tokens any rank passes to one forward on the CUDA backend with several ranks (it
            sizes the NVSHMEM team's symmetric buffers); default ``config.tokens_per_rank`` (at least 1).
            :meth:`forward` refuses larger batches.
        mps_pipe_dir, mps_log_dir: the MPS daemon's directories, passed to every GPU actor as
            ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``; default (when ``gpus_per_worker < 1``)
            those of this process's environment, if set (else the MPS default ``/tmp/nvidia-mps``).
        teardown_timeout_s: how long the workers get to close their teams after a kernel watchdog fired,
            before they are killed anyway.

    Raises:
        ValueError: bad config or arguments, or a cluster too small, before any actor starts.
        BackendUnavailable: ``backend="cuda"`` on a cluster without the GPUs or the NVSHMEM team.
    """

    def __init__(self, config: MoEConfig | dict[str, Any] | str | Path, address: str | None = None,
                 workers: int | None = None, *, backend: str = "auto", gpus_per_worker: float = 1.0,
                 max_retries: int = 2, collective_timeout_s: float = 120.0, call_timeout_s: float = 600.0,
                 num_cpus: int | None = None, max_tokens: int | None = None,
                 mps_pipe_dir: str | os.PathLike | None = None, mps_log_dir: str | os.PathLike | None = None,
                 teardown_timeout_s: float = 60.0) -> None:
        config = load_config(config)
        if workers is not None:
            if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
                raise ValueError(f"workers={workers!r}: expected an integer >= 1")
            try:
                config = config.replace(world_size=workers)
            except ValueError as error:
                raise ValueError(f"workers={workers}: {error}") from None
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
        if isinstance(gpus_per_worker, bool) or not isinstance(gpus_per_worker, (int, float)) \
                or not 0 < gpus_per_worker <= 1:
            raise ValueError(f"gpus_per_worker={gpus_per_worker!r}: expected a number in (0, 1]")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries={max_retries!r}: expected an integer >= 0")
        for name, value in (("collective_timeout_s", collective_timeout_s), ("call_timeout_s", call_timeout_s),
                            ("teardown_timeout_s", teardown_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a number of seconds > 0")
        if num_cpus is not None and (isinstance(num_cpus, bool) or not isinstance(num_cpus, int) or num_cpus < 1):
            raise ValueError(f"num_cpus={num_cpus!r}: expected None or an integer >= 1")
        if max_tokens is None:
            max_tokens = max(1, config.tokens_per_rank)
        elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < config.tokens_per_rank \
                or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}: expected an integer >= max(1, tokens_per_rank="
                             f"{config.tokens_per_rank})")
        if gpus_per_worker < 1:
            mps_pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") if mps_pipe_dir is None else mps_pipe_dir
            mps_log_dir = os.environ.get("CUDA_MPS_LOG_DIRECTORY") if mps_log_dir is None else mps_log_dir
        self._gpu_env = gpu_env_vars(gpus_per_worker, mps_pipe_dir=mps_pipe_dir, mps_log_dir=mps_log_dir)

        self.config = config
        self.world_size = config.world_size
        self.gpus_per_worker = float(gpus_per_worker)
        self.max_retries = max_retries
        self.collective_timeout_s = float(collective_timeout_s)
        self.call_timeout_s = float(call_timeout_s)
        self.teardown_timeout_s = float(teardown_timeout_s)
        self.max_tokens = max_tokens
        self.generation = 0  # teams bootstrapped so far (1 after the first; +1 per recovery)
        self.faults: list[dict[str, Any]] = []
        self.step_records: list[dict[str, Any]] = []
        self.workers: list[Any] = []
        self.node_infos: list[dict[str, Any]] = []
        self._placement_group = None
        self._last_xs: list[torch.Tensor] | None = None
        self._next_step = 0
        self._owns_ray = False
        self._closed = False
        self._team_broken = False

        self._connect(address, num_cpus)
        try:
            self.backend = self._resolve_backend(backend)
            self._start()
        except BaseException:
            self.close()
            raise

    # -- cluster and team lifecycle ------------------------------------------------------------------

    def _connect(self, address: str | None, num_cpus: int | None) -> None:
        if ray.is_initialized():
            return  # the caller's Ray session; leave it running at close()
        if address is None and not os.environ.get("RAY_ADDRESS"):
            # address="local": always a new embedded Ray; with None, ray.init joins a `ray start` cluster
            # recorded in /tmp/ray (and then refuses num_cpus)
            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                     num_cpus=num_cpus or max(os.cpu_count() or 1, self.world_size),
                     runtime_env={"env_vars": {"PYTHONPATH": _code_paths()}}, logging_level=logging.WARNING)
        else:
            # an existing cluster: the code must be importable there (installed, or the job's working_dir)
            ray.init(address=address, logging_level=logging.WARNING)
        self._owns_ray = True

    def _resolve_backend(self, requested: str) -> str:
        resources = ray.cluster_resources()
        gpus, cpus = resources.get("GPU", 0.0), resources.get("CPU", 0.0)
        gpus_needed = self.world_size * self.gpus_per_worker
        dtypes = _cuda_dtypes(self.world_size)
        if requested == "cuda":
            if self.config.dtype not in dtypes:
                raise ValueError(f"dtype={self.config.dtype!r}: the cuda backend with {self.world_size} worker(s) "
                                 f"runs {', '.join(dtypes)}; use backend='gloo' (reference) for {self.config.dtype}")
            if gpus < gpus_needed:
                raise BackendUnavailable(f"backend='cuda': the Ray cluster has {gpus:g} GPUs; {self.world_size} "
                                         f"workers x {self.gpus_per_worker:g} GPU need {gpus_needed:g}")
            if self.world_size > 1 and not _nvshmem_team_available():
                raise BackendUnavailable("backend='cuda': flashdmoe.team.Team has no nvshmem()/make_unique_id() in "
                                         "this build, so several ranks cannot form an NVSHMEM team (one worker can)")
            return "cuda"
        if requested == "auto" and gpus >= gpus_needed and self.config.dtype in dtypes \
                and (self.world_size == 1 or _nvshmem_team_available()):
            return "cuda"
        if cpus < self.world_size:
            raise ValueError(f"workers={self.world_size}: the Ray cluster has {cpus:g} CPUs; the gloo backend needs "
                             "one CPU per worker")
        return "gloo"

    def _start(self) -> None:
        """Reserve the placement group, start the workers and bootstrap a fresh team on them."""
        resource = {"GPU": self.gpus_per_worker} if self.backend == "cuda" else {"CPU": 1.0}
        group = placement_group([dict(resource) for _ in range(self.world_size)], strategy="STRICT_PACK")
        self._placement_group = group
        try:
            ray.get(group.ready(), timeout=self.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"could not reserve {self.world_size} x {resource} on one node within "
                               f"{self.call_timeout_s:g}s (STRICT_PACK); cluster resources: "
                               f"{ray.cluster_resources()}") from None
        if self.backend == "cuda":
            # multicast off; when ranks share a GPU, their MPS share and the daemon's directories
            options = dict(num_cpus=0, num_gpus=self.gpus_per_worker, runtime_env={"env_vars": dict(self._gpu_env)})
        else:
            options = dict(num_cpus=1)
        self.workers = [
            RemoteMoEWorker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                     placement_group_bundle_index=rank),
                max_restarts=0, **options).remote()
            for rank in range(self.world_size)
        ]
        self.generation += 1
        # every actor process up before any rendezvous starts its clock (gloo's store timeout, NVSHMEM's init)
        self._gather([worker.ping.remote() for worker in self.workers], "start")
        if self.backend == "cuda" and self.world_size == 1:
            # a single-rank team needs no bootstrap
            rendezvous = {"backend": "cuda", "unique_id": None, "max_tokens": self.max_tokens}
            team_id = "single"
        elif self.backend == "cuda":
            # a fresh unique id per team: a failed team's id is never reused
            unique_id = self._gather([self.workers[0].make_unique_id.remote(self.config.dtype)], "make_unique_id",
                                     ranks=[0])[0]
            rendezvous = {"backend": "cuda", "unique_id": unique_id, "max_tokens": self.max_tokens}
            team_id = "nvshmem-" + hashlib.sha256(bytes(unique_id)).hexdigest()[:16]
        else:
            port = self._gather([self.workers[0].free_port.remote()], "free_port", ranks=[0])[0]
            rendezvous = {"backend": "gloo", "address": "127.0.0.1", "port": port,
                          "timeout_s": self.collective_timeout_s}
            team_id = f"gloo-127.0.0.1:{port}"
        config_dict = self.config.to_dict()
        # all submitted before any is awaited: team initialisation blocks until every rank has joined
        refs = [worker.setup.remote(rank, self.world_size, config_dict, rendezvous)
                for rank, worker in enumerate(self.workers)]
        self.node_infos = [dict(info, generation=self.generation, team_id=team_id)
                           for info in self._gather(refs, "setup")]
        self._last_xs = None

    def _stop_workers(self) -> None:
        """Kill every worker and release the placement group (no collective teardown: peers may be hung)."""
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception as error:  # already gone
                _log.debug("ray.kill: %s", error)
        self.workers = []
        if self._placement_group is not None:
            try:
                remove_placement_group(self._placement_group)
            except Exception as error:
                _log.debug("remove_placement_group: %s", error)
            self._placement_group = None

    def _close_teams(self) -> bool:
        """Every worker closes its team (collective on NVSHMEM), bounded by ``teardown_timeout_s``; True if
        all of them did."""
        if not self.workers:
            return False
        refs = [worker.teardown.remote() for worker in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.teardown_timeout_s)
        closed = len(ready) == len(refs)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as error:
                closed = False
                _log.warning("closing a team after a fault: %s", _first_line(error))
        return closed

    def _restart(self, close_teams: bool = False) -> bool | None:
        """Replace the team: optionally let every worker close its team first (returns whether all did;
        ``None`` when not asked), then kill the workers and bootstrap a new team on new ones."""
        closed = self._close_teams() if close_teams else None
        self._stop_workers()
        self._start()
        return closed

    def close(self) -> None:
        """Tear the team down (each worker leaves its group), stop the workers, and stop Ray if this
        cluster started it. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.workers:
            refs = [worker.teardown.remote() for worker in self.workers]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=30)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as error:  # a dead or broken worker is killed below anyway
                    _log.debug("teardown: %s", error)
        self._stop_workers()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> MoECluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- calls with fault detection ----------------------------------------------------------------------

    def _gather(self, refs: list, what: str, ranks: Sequence[int] | None = None) -> list:
        """Results of one call per rank; classifies failures (see :class:`WorkerFault`)."""
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        pending = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        deadline = time.monotonic() + self.call_timeout_s
        first_error_at = 0.0
        while pending:
            limit = deadline if not errors else min(deadline, first_error_at + _FAULT_GRACE_S)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as error:
                    if not errors:
                        first_error_at = time.monotonic()
                    errors[rank] = error
        stuck = sorted(pending.values())
        if not errors and not stuck:
            return [results[rank] for rank in ranks]
        reports = sorted([{"rank": rank, "error": _error_name(error), "message": _error_message(error)}
                          for rank, error in errors.items()]
                         + [{"rank": rank, "error": "stuck", "message": f"did not finish {what}"} for rank in stuck],
                         key=lambda report: report["rank"])
        died = sorted(rank for rank, error in errors.items() if isinstance(error, RayActorError))
        if died:
            raise WorkerFault("worker_died", died, f"rank(s) {died} died during {what}: "
                              f"{_first_line(errors[died[0]])}", reports)
        for kind, error_type in (("kernel_timeout", KernelTimeout), ("team_failed", TeamFailed)):
            hit = sorted(rank for rank, error in errors.items() if _is_error(error, error_type))
            if hit:
                raise WorkerFault(kind, hit, f"{error_type.__name__} on rank(s) {hit} during {what}: "
                                  f"{_error_message(errors[hit[0]])}", reports)
        if not errors:
            raise WorkerFault("timeout", stuck, f"rank(s) {stuck} did not finish {what} within "
                              f"{self.call_timeout_s:g}s", reports)
        # an ordinary error (not retried); if it left other ranks inside a collective the team is unusable
        self._team_broken = bool(stuck)
        raise errors[min(errors)]

    def _call(self, method: str, args_per_rank: Sequence[tuple] | None = None) -> list:
        args_per_rank = args_per_rank or [()] * self.world_size
        refs = [getattr(worker, method).remote(*args) for worker, args in zip(self.workers, args_per_rank)]
        return self._gather(refs, method)

    def _with_recovery(self, what: str, attempt_fn: Callable[[int], Any], step: int | None = None) -> Any:
        """Run ``attempt_fn(attempt)``; on a :class:`WorkerFault` restart the team and retry (bounded)."""
        if self._closed:
            raise RuntimeError("MoECluster is closed")
        attempt = 0
        fault_event: dict[str, Any] | None = None  # the fault being recovered from
        while True:
            try:
                if fault_event is not None:
                    started = time.perf_counter()
                    # after a watchdog every rank is alive: each closes its team before the actors are
                    # replaced; then a new team with a new port / unique id on new workers
                    fault_event["teams_closed"] = self._restart(
                        close_teams=fault_event["kind"] in ("kernel_timeout", "team_failed"))
                    fault_event.update(recovered=True, recovery_s=time.perf_counter() - started,
                                       generation=self.generation)
                    self.faults.append(fault_event)
                    fault_event = None
                return attempt_fn(attempt)
            except WorkerFault as fault:
                if fault_event is not None:  # the restart itself failed
                    fault_event["recovered"] = False
                    self.faults.append(fault_event)
                fault_event = {"call": what, "step": step, "attempt": attempt, "kind": fault.kind,
                               "ranks": fault.ranks, "error": str(fault), "reports": fault.reports}
                if attempt >= self.max_retries:
                    fault_event["recovered"] = False
                    self.faults.append(fault_event)
                    raise
                _log.warning("%s: %s; restarting the team (retry %d of %d)", what, fault, attempt + 1,
                             self.max_retries)
                attempt += 1
            except Exception:
                if self._team_broken:  # keep the cluster usable after an ordinary error, then report it
                    self._team_broken = False
                    self._restart()
                raise

    # -- the layer -----------------------------------------------------------------------------------------

    def _check_batches(self, name: str, tensors: Sequence[torch.Tensor], rows: Sequence[int] | None = None) -> None:
        if not isinstance(tensors, (list, tuple)) or len(tensors) != self.world_size:
            raise ValueError(f"{name}: expected a list of {self.world_size} tensors (one per rank), got "
                             f"{len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__}")
        for rank, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.shape[1] != self.config.hidden:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{name}[{rank}]: got {shape}; expected [T, H={self.config.hidden}]")
            if rows is not None and tensor.shape[0] != rows[rank]:
                raise ValueError(f"{name}[{rank}]: got {tensor.shape[0]} rows; expected {rows[rank]} (that rank's T)")

    def forward(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's output.

        Args:
            xs: ``P`` tensors ``[T_r, H]``, one per rank (``T_r`` may differ, 0 allowed; on the CUDA backend
                with several ranks at most :attr:`max_tokens`); cast to the config dtype.

        Returns:
            ``P`` tensors ``y_r [T_r, H]`` (config dtype, CPU).
        """
        self._check_batches("xs", xs)
        if self.backend == "cuda" and self.world_size > 1:
            for rank, x in enumerate(xs):  # one rank refusing inside a collective would leave the others waiting
                if x.shape[0] > self.max_tokens:
                    raise ValueError(f"xs[{rank}]: {x.shape[0]} rows, but the team's buffers were sized for "
                                     f"max_tokens={self.max_tokens} per rank (MoECluster(max_tokens=...))")
        xs = [x.detach().cpu() for x in xs]
        self._last_xs = None

        def attempt(_: int) -> list[torch.Tensor]:
            return self._call("forward", [(x,) for x in xs])

        ys = self._with_recovery("forward", attempt)
        self._last_xs = xs
        return ys

    def backward(self, dys: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """Back-propagate ``dys`` (``P`` tensors ``[T_r, H]``) through the last :meth:`forward`.

        Returns:
            ``(dxs, grads)``: ``dxs`` the ``P`` input gradients ``[T_r, H]``; ``grads`` a dict with
            ``router_weight`` ``[E, H]`` (summed over ranks: the router is replicated), ``w1`` and ``w2``,
            lists of the ``P`` shards' gradients ``[L, H, .]`` / ``[L, I, H]``. CPU, config dtype.
        """
        if self._last_xs is None:
            raise RuntimeError("backward() needs a preceding successful forward()")
        xs = self._last_xs
        self._check_batches("dys", dys, rows=[x.shape[0] for x in xs])
        dys = [dy.detach().cpu() for dy in dys]

        def attempt(number: int) -> list[dict[str, Any]]:
            if number > 0:  # a fresh team holds no graph: replay the forward first
                self._call("forward", [(x,) for x in xs])
            return self._call("backward", [(dy,) for dy in dys])

        outputs = self._with_recovery("backward", attempt)
        self._last_xs = None
        if outputs[0]["router_grad_summed"]:
            router_grad = outputs[0]["router_weight"]
        else:
            router_grad = torch.stack([output["router_weight"].float() for output in outputs]).sum(0).to(
                outputs[0]["router_weight"].dtype)
        grads = {"router_weight": router_grad, "w1": [output["w1"] for output in outputs],
                 "w2": [output["w2"] for output in outputs]}
        return [output["dx"] for output in outputs], grads

    def step(self, step: int | None = None, *, crash: dict[str, Any] | None = None,
             silence: dict[str, Any] | None = None) -> dict[str, Any]:
        """One timed forward + backward on every rank's seeded batch (tokens and output gradients of ``step``).

        Args:
            step: data index (default: one past the previous step).
            crash: fault injection for tests, ``{"rank": r, "at": point}`` (see
                :data:`ray_actors.worker.CRASH_POINTS`), on the first attempt only: at ``before_forward`` /
                ``after_forward`` that worker's process exits; at ``kernel_timeout`` it raises
                ``KernelTimeout`` before its forward.
            silence: test knob for "a peer stops answering", ``{"rank": r, "timeout_ms": t}`` (CUDA backend,
                several ranks), on the first attempt only: every worker sets
                ``flashdmoe.cuda_backend.debug.silent_rank = r`` and a ``t`` ms watchdog for this step, so
                every rank raises ``KernelTimeout``; the team is then closed, bootstrapped again and the step
                retried (needs ``max_retries >= 1`` to succeed).

        Returns:
            The step record ``{"step", "attempts", "latency_ms": [P], "forward_ms": [P], "backward_ms": [P],
            "bytes_sent": [P], "payload_efficiency": [P], "dropped": [P]}`` (also appended to
            :attr:`step_records`; see :meth:`ray_actors.worker.MoEWorker.step` for the traffic fields).
        """
        step = self._next_step if step is None else step
        if crash is not None:
            if not isinstance(crash, dict) or crash.get("at") not in CRASH_POINTS or \
                    crash.get("rank") not in range(self.world_size):
                raise ValueError(f"crash={crash!r}: expected {{'rank': 0..{self.world_size - 1}, "
                                 f"'at': one of {CRASH_POINTS}}}")
        if silence is not None:
            if self.backend != "cuda" or self.world_size < 2:
                raise ValueError(f"silence={silence!r}: needs the cuda backend with at least 2 workers (this "
                                 f"cluster: backend {self.backend!r}, {self.world_size} worker(s))")
            if not isinstance(silence, dict) or set(silence) != {"rank", "timeout_ms"} \
                    or silence["rank"] not in range(self.world_size) or isinstance(silence["timeout_ms"], bool) \
                    or not isinstance(silence["timeout_ms"], int) or silence["timeout_ms"] < 1:
                raise ValueError(f"silence={silence!r}: expected {{'rank': 0..{self.world_size - 1}, "
                                 "'timeout_ms': an integer >= 1}")
        attempts = []

        def attempt(number: int) -> list[dict[str, Any]]:
            attempts.append(number)
            args = [(step, crash["at"] if crash and number == 0 and rank == crash["rank"] else None,
                     silence if number == 0 else None)
                    for rank in range(self.world_size)]
            return self._call("step", args)

        per_rank = self._with_recovery("step", attempt, step=step)
        record = {"step": step, "attempts": len(attempts)}
        for key in ("latency_ms", "forward_ms", "backward_ms", "bytes_sent", "payload_efficiency", "dropped"):
            record[key] = [rank_record.get(key) for rank_record in per_rank]
        self.step_records.append(record)
        self._next_step = step + 1
        return record

    def benchmark(self, steps: int = 10, warmup: int = 2) -> dict[str, Any]:
        """Run ``warmup`` untimed then ``steps`` timed steps; returns ``{"steps": [records], "metrics": ...}``
        (see :func:`summarize`)."""
        for name, value, minimum in (("steps", steps, 1), ("warmup", warmup, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
        for _ in range(warmup):
            self.step()
        records = [self.step() for _ in range(steps)]
        return {"steps": records, "metrics": summarize(self.config, records, self.worker_metrics())}

    def worker_metrics(self) -> list[dict[str, Any]]:
        """Each worker's :meth:`ray_actors.worker.MoEWorker.metrics` (since its team was last bootstrapped)."""
        return self._with_recovery("metrics", lambda _: self._call("metrics"))


# -- results ----------------------------------------------------------------------------------------------


def _median_or_none(values) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def summarize(config: MoEConfig, records: Sequence[dict[str, Any]],
              worker_metrics: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Medians over step records (the first step, which pays one-time costs, is left out when there are
    more). A step's latency is its slowest rank's. TFLOP/s counts backward as twice the forward FLOPs.
    Per rank also ``bytes_sent_per_step`` and ``payload_efficiency`` (``None`` where not reported)."""
    timed = list(records[1:] if len(records) > 1 else records)
    world = config.world_size
    tokens = config.tokens_per_rank * world
    step_flops = 3 * forward_flops(config, tokens)
    metrics: dict[str, Any] = {"steps_in_median": len(timed), "tokens_per_step": tokens,
                               "flops_per_step": step_flops}
    if not timed:
        return metrics
    latency = statistics.median(max(record["latency_ms"]) for record in timed)
    metrics.update(latency_ms_median=latency,
                   tokens_per_s=tokens / (latency / 1e3) if latency > 0 else None,
                   tflops=step_flops / (latency / 1e3) / 1e12 if latency > 0 else None)
    peaks = {entry["rank"]: entry.get("peak_memory_bytes") for entry in worker_metrics or []}
    per_rank = []
    for rank in range(world):
        rank_latency = statistics.median(record["latency_ms"][rank] for record in timed)
        per_rank.append({
            "rank": rank,
            "forward_ms_median": statistics.median(record["forward_ms"][rank] for record in timed),
            "backward_ms_median": statistics.median(record["backward_ms"][rank] for record in timed),
            "latency_ms_median": rank_latency,
            "tokens_per_s": config.tokens_per_rank / (rank_latency / 1e3) if rank_latency > 0 else None,
            "tflops": 3 * forward_flops(config, config.tokens_per_rank) / (rank_latency / 1e3) / 1e12
            if rank_latency > 0 else None,
            "bytes_sent_per_step": statistics.median(record["bytes_sent"][rank] for record in timed),
            "payload_efficiency": _median_or_none(record.get("payload_efficiency", [None] * world)[rank]
                                                  for record in timed),
            "peak_memory_bytes": peaks.get(rank),
        })
    metrics["per_rank"] = per_rank
    return metrics


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__


def _cause(error: BaseException) -> BaseException:
    """The exception a Ray task raised (``RayTaskError.cause``), else ``error`` itself."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _is_error(error: BaseException, error_type: type) -> bool:
    return isinstance(error, error_type) or isinstance(_cause(error), error_type)


def _error_name(error: BaseException) -> str:
    return type(_cause(error)).__name__ if not isinstance(error, RayActorError) else "ActorDiedError"


def _error_message(error: BaseException, limit: int = 1000) -> str:
    """The raised exception's own text (a ``KernelTimeout``'s names the phase and peer) on one line, at most
    ``limit`` characters; for a dead actor the first line of Ray's explanation."""
    if isinstance(error, RayActorError):
        text = str(error).strip().splitlines()[0] if str(error).strip() else "the actor died"
    else:
        cause = _cause(error)
        text = " ".join(str(cause).split()) if cause is not error else ""
        text = text or _first_line(error)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, that divided by max |want|) in float64; zeros for empty tensors."""
    if want.numel() == 0:
        return 0.0, 0.0
    difference = float((got.double() - want.double()).abs().max())
    scale = float(want.double().abs().max())
    return difference, difference / scale if scale > 0 else difference


def verify_against_reference(cluster: MoECluster, step: int = 0) -> dict[str, Any]:
    """Check every rank's output and all gradients of ``step``'s seeded batch against
    :func:`flashdmoe.reference.moe_expert_parallel` in float64 (same weights, loss ``sum_r <y_r, dy_r>``).

    Passes when, for each of ``y``, ``dx``, ``d_router_weight``, ``d_w1``, ``d_w2`` and every rank,
    ``max |got - want| / max |want|`` is within :func:`flashdmoe.runner.tolerance_for` of the dtype and
    backend (float32 on gloo: 1e-4).
    """
    config = cluster.config
    world = config.world_size
    xs = [make_tokens(config, rank, step) for rank in range(world)]
    dys = [upstream_gradient(config, rank, step) for rank in range(world)]
    ys = cluster.forward(xs)
    dxs, grads = cluster.backward(dys)

    router, w1, w2 = (tensor.double() for tensor in make_weights(config))
    local = config.local_experts
    xs64 = [x.double().requires_grad_() for x in xs]
    router64 = router.requires_grad_()
    w1s64 = [w1[rank * local:(rank + 1) * local].clone().requires_grad_() for rank in range(world)]
    w2s64 = [w2[rank * local:(rank + 1) * local].clone().requires_grad_() for rank in range(world)]
    want_ys = reference.moe_expert_parallel(xs64, router64, w1s64, w2s64, top_k=config.top_k,
                                            activation=config.activation, normalize_topk=config.normalize_topk,
                                            capacity_factor=config.capacity_factor)
    leaves = [*xs64, router64, *w1s64, *w2s64]
    want_grads = torch.autograd.grad(want_ys, leaves, [dy.double() for dy in dys], allow_unused=True)
    want_grads = [torch.zeros_like(leaf) if grad is None else grad for grad, leaf in zip(want_grads, leaves)]
    want_dxs, want_router = want_grads[:world], want_grads[world]
    want_w1s, want_w2s = want_grads[world + 1:2 * world + 1], want_grads[2 * world + 1:]

    pairs = {"y": list(zip(ys, want_ys)), "dx": list(zip(dxs, want_dxs)),
             "d_router_weight": [(grads["router_weight"], want_router)],
             "d_w1": list(zip(grads["w1"], want_w1s)), "d_w2": list(zip(grads["w2"], want_w2s))}
    tolerance = tolerance_for(config.dtype, "cuda" if cluster.backend == "cuda" else "reference")
    per_tensor = {}
    for name, tensor_pairs in pairs.items():
        errors = [_errors(got, want.detach()) for got, want in tensor_pairs]
        per_tensor[name] = {"max_abs_err": max(error[0] for error in errors),
                            "max_rel_err": max(error[1] for error in errors)}
    max_rel = max(entry["max_rel_err"] for entry in per_tensor.values())
    return {"step": step, "oracle": "flashdmoe.reference.moe_expert_parallel, float64",
            "metric": "max |got - want| / max |want| per tensor, every rank",
            "max_abs_err": max(entry["max_abs_err"] for entry in per_tensor.values()), "max_rel_err": max_rel,
            "tolerance": tolerance, "passed": max_rel <= tolerance, "tensors": per_tensor}


def _print_results(results: dict[str, Any], console) -> None:
    from rich.table import Table

    config = results["config"]
    table = Table(title=f"FlashDMoE Ray run: backend {results['backend']}, {results['world_size']} workers, "
                        f"T={config['tokens_per_rank']}/rank H={config['hidden']} I={config['ffn']} "
                        f"E={config['experts']} k={config['top_k']} {config['dtype']} {config['activation']}")
    for column in ("rank", "forward ms", "backward ms", "step ms", "tokens/s", "TFLOP/s", "KiB sent/step",
                   "payload eff.", "peak MiB"):
        table.add_column(column, justify="right")

    def shown(value, spec):
        return "-" if value is None else format(value, spec)

    metrics = results["metrics"]
    for entry in metrics.get("per_rank", []):
        peak = entry["peak_memory_bytes"]
        table.add_row(str(entry["rank"]), shown(entry["forward_ms_median"], ".3f"),
                      shown(entry["backward_ms_median"], ".3f"), shown(entry["latency_ms_median"], ".3f"),
                      shown(entry["tokens_per_s"], ",.0f"), shown(entry["tflops"], ".4f"),
                      shown(entry["bytes_sent_per_step"] / 1024, ",.1f"), shown(entry.get("payload_efficiency"), ".1%"),
                      shown(None if peak is None else peak / 2**20, ",.0f"))
    console.print(table)
    console.print(f"{len(results['steps'])} steps; median over {metrics['steps_in_median']}: step "
                  f"{shown(metrics.get('latency_ms_median'), '.3f')} ms (slowest rank), "
                  f"{shown(metrics.get('tokens_per_s'), ',.0f')} tokens/s, "
                  f"{shown(metrics.get('tflops'), '.4f')} TFLOP/s")
    console.print(f"retries: {results['retries']}" + "".join(  # plain text: messages may hold [brackets]
        f"\n  step {fault['step']} ({fault['call']}): {fault['kind']} on rank(s) {fault['ranks']}"
        + (f", recovered in {fault['recovery_s']:.1f}s" if fault.get("recovered") else ", NOT recovered")
        + "".join(f"\n    rank {report['rank']}: {report['error']}: {report['message']}"
                  for report in fault.get("reports", []))
        for fault in results["faults"]), markup=False, highlight=False)
    verification = results["verification"]
    if verification is None:
        console.print("verification: not requested (--verify)")
    else:
        verdict = "PASSED" if verification["passed"] else "FAILED"
        console.print(f"verification {verdict}: max rel err {verification['max_rel_err']:.2e} "
                      f"(tolerance {verification['tolerance']:.0e}), max abs err {verification['max_abs_err']:.2e}, "
                      f"against {verification['oracle']}")


def plot_latency(results: dict[str, Any], path: str | Path) -> Path:
    """PNG of per-step latency (forward + backward, ms) per rank."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    steps = [record["step"] for record in results["steps"]]
    for rank in range(results["world_size"]):
        axes.plot(steps, [record["latency_ms"][rank] for record in results["steps"]], marker="o", label=f"rank {rank}")
    latencies = [value for record in results["steps"] for value in record["latency_ms"]]
    if latencies and min(latencies) > 0 and max(latencies) / min(latencies) > 20:
        axes.set_yscale("log")  # e.g. a retried step next to fast ones
    axes.set_xlabel("step")
    axes.set_ylabel("forward + backward (ms)")
    axes.set_title(f"per-step latency per rank ({results['backend']}, {results['world_size']} workers)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path)
    return path


def run_job(config: MoEConfig | dict[str, Any] | str | Path, *, address: str | None = None, workers: int | None = None,
            verify: bool = False, output_dir: str | Path | None = None, progress: bool = True,
            backend: str = "auto", gpus_per_worker: float = 1.0, max_retries: int = 2,
            mps_pipe_dir: str | os.PathLike | None = None, mps_log_dir: str | os.PathLike | None = None,
            inject_crash: dict[str, Any] | None = None, console=None) -> dict[str, Any]:
    """The main job on Ray: ``config.steps`` forward + backward steps on every rank, optional verification,
    a results table, and (with ``output_dir``) ``results.json`` and ``latency.png``.

    Args:
        config: a :class:`MoEConfig`, a dict of its fields or a YAML path.
        address, workers, backend, gpus_per_worker, max_retries, mps_pipe_dir, mps_log_dir: as
            :class:`MoECluster`.
        verify: check step 0's outputs and gradients on every rank against
            :func:`flashdmoe.reference.moe_expert_parallel` (see :func:`verify_against_reference`).
        output_dir: directory for ``results.json`` and ``latency.png`` (created); ``None`` writes nothing.
        progress: show a progress bar.
        inject_crash: fault injection for tests, ``{"step": s, "rank": r, "at": point}`` (see
            :meth:`MoECluster.step`'s ``crash``).
        console: a ``rich.console.Console`` for the table (default: stdout).

    Returns:
        ``{"config", "world_size", "backend", "workers" (node info per rank), "steps" (per step: "step",
        "attempts", per-rank lists "latency_ms", "forward_ms", "backward_ms", "bytes_sent",
        "payload_efficiency", "dropped"),
        "metrics" (see :func:`summarize`), "verification" (None, or "max_abs_err", "max_rel_err",
        "passed", "tolerance", ...), "retries" (recoveries performed), "faults" (each fault: "call", "step",
        "attempt", "kind", "ranks", "error", "reports" (per rank), "recovered", "recovery_s", "teams_closed",
        "generation"), "wall_s",
        "created"}``, plus "output" and "plot" (paths) when written.
    """
    from rich.console import Console
    from rich.progress import Progress

    config = load_config(config)
    if inject_crash is not None and (not isinstance(inject_crash, dict) or set(inject_crash) != {"step", "rank", "at"}):
        raise ValueError(f"inject_crash={inject_crash!r}: expected None or {{'step': s, 'rank': r, 'at': point}}")
    console = console or Console(width=None if sys.stdout.isatty() else 132)
    started = time.perf_counter()
    with MoECluster(config, address, workers, backend=backend, gpus_per_worker=gpus_per_worker,
                    max_retries=max_retries, mps_pipe_dir=mps_pipe_dir, mps_log_dir=mps_log_dir) as cluster:
        config = cluster.config
        with Progress(console=Console(stderr=True), disable=not progress, transient=False) as bar:
            task = bar.add_task(f"flashdmoe ray run ({cluster.backend}, {cluster.world_size} workers)",
                                total=config.steps)
            for step in range(config.steps):
                crash = None
                if inject_crash is not None and inject_crash["step"] == step:
                    crash = {"rank": inject_crash["rank"], "at": inject_crash["at"]}
                cluster.step(step, crash=crash)
                bar.advance(task)
        worker_metrics = cluster.worker_metrics()
        verification = verify_against_reference(cluster) if verify else None
        results = {
            "config": config.to_dict(),
            "world_size": cluster.world_size,
            "backend": cluster.backend,
            "workers": cluster.node_infos,
            "steps": cluster.step_records,
            "metrics": summarize(config, cluster.step_records, worker_metrics),
            "verification": verification,
            "retries": sum(1 for fault in cluster.faults if fault.get("recovered")),
            "faults": cluster.faults,
        }
    results["wall_s"] = time.perf_counter() - started
    results["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if output_dir is not None:
        # absolute, so the printed paths say where a `ray job submit` run (cwd: the job's copy of its
        # working dir) left its results
        directory = Path(output_dir).resolve()
        directory.mkdir(parents=True, exist_ok=True)
        results["plot"] = str(plot_latency(results, directory / PLOT_FILENAME))
        results["output"] = str(directory / RESULTS_FILENAME)
        (directory / RESULTS_FILENAME).write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    _print_results(results, console)
    if "output" in results:
        console.print(f"results written to {results['output']} and {results['plot']}")
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ray_actors.driver",
                                     description="Run the FlashDMoE layer on Ray workers (one rank each).")
    parser.add_argument("--config", required=True, type=Path, help="YAML config (see configs/)")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else embedded Ray)")
    parser.add_argument("--workers", type=int, default=None, help="ranks (default: the config's world_size)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="default: auto")
    parser.add_argument("--gpus-per-worker", type=float, default=1.0,
                        help="GPU share per rank (CUDA backend); below 1 ranks share a GPU under MPS")
    parser.add_argument("--mps-pipe-dir", default=None,
                        help="MPS daemon pipe directory for the workers (default: $CUDA_MPS_PIPE_DIRECTORY)")
    parser.add_argument("--mps-log-dir", default=None,
                        help="MPS daemon log directory for the workers (default: $CUDA_MPS_LOG_DIRECTORY)")
    parser.add_argument("--max-retries", type=int, default=2, help="recoveries allowed per call (default 2)")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=False,
                        help="check outputs and gradients against the reference (default: off)")
    parser.add_argument("--output", type=Path, default=Path("results"),
                        help="directory for results.json and latency.png (default: results/)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; exit status 0 on success, 1 if verification failed, 2 on bad input."""
    args = build_parser().parse_args(argv)
    try:
        results = run_job(args.config, address=args.address, workers=args.workers, verify=args.verify,
                          output_dir=args.output, progress=not args.no_progress, backend=args.backend,
                          gpus_per_worker=args.gpus_per_worker, max_retries=args.max_retries,
                          mps_pipe_dir=args.mps_pipe_dir, mps_log_dir=args.mps_log_dir)
    except (ValueError, FileNotFoundError, BackendUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except WorkerFault as fault:  # the team broke and the bounded retries did not bring it back
        print(f"error: the run failed ({fault.kind} on rank(s) {fault.ranks}): {fault}", file=sys.stderr)
        return 1
    verification = results["verification"]
    return 1 if verification is not None and not verification["passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
