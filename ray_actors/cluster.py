"""The main job's ranks on Ray: :class:`MoECluster`, one :class:`ray_actors.worker.MoEWorker` actor per
rank, a :class:`flashdmoe.job.executor.RankExecutor` for :func:`flashdmoe.job.run_job` and a Python API
of its own (:meth:`MoECluster.forward`, :meth:`MoECluster.backward`, :meth:`MoECluster.step`).

``MoECluster(config)`` starts an embedded Ray on 127.0.0.1 (or connects to ``address``), checks the
config and the cluster's resources before any actor starts, reserves a placement group
(:class:`ray_actors.placement.Placement`; waiting at most ``placement_timeout_s``): on one node
(``nodes=1``, the default) a STRICT_PACK group with one bundle per rank (``{"GPU": g}`` or
``{"CPU": 1}``), over ``nodes`` nodes a STRICT_SPREAD group with one bundle per node holding its
``world_size // nodes`` ranks, ranks node-major (rank ``r`` on node ``r // G`` as local rank ``r % G``).
It starts one worker per rank in its bundle and bootstraps the team: on CPUs a gloo group whose TCP store
rank 0 hosts on a socket it holds from the moment the port is chosen, on GPUs an NVSHMEM team
(``flashdmoe.parallel.team.Team.nvshmem``) from a fresh unique id made by rank 0's actor (``Team.make_unique_id``)
and handed by the driver to every rank, sized for ``max_tokens`` tokens per rank. On one node the store
and gloo's connections stay on 127.0.0.1; across nodes they use the address Ray reports for each rank's
node (the store: rank 0's node address), and so does NVSHMEM's unique-id bootstrap (see
:meth:`ray_actors.worker.MoEWorker.setup`). All ``setup`` calls are submitted before any is awaited,
because team initialisation is collective. A cluster that cannot place the ranks raises
:class:`flashdmoe.job.executor.ClusterTooSmall` naming what was asked for and what it has.

Several ranks on one GPU: ``gpus_per_worker=g < 1`` schedules each actor with ``num_gpus=g`` and gives it
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=floor(100 g)`` and the MPS daemon's pipe/log directories
(``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``; by default those of the driver's environment)
through the actor's ``runtime_env``. The MPS daemon is started by whoever starts the cluster
(docs/deploy.md, "Several ranks on one GPU").

Faults: when a worker dies during a call (``ray.exceptions.RayActorError``; kind ``worker_died``), a
kernel watchdog fires on any rank (``flashdmoe.KernelTimeout``, caught and reported by each worker;
``kernel_timeout``) or a worker stops answering (kind ``timeout``: a stopped or stuck process, a stuck
collective or kernel, a rank slower than the bound), the team is torn down and bootstrapped again (new
port or new unique id, new actors) and the call is retried, at most ``max_retries`` times. A worker
counts as hung when its call has not returned within ``call_timeout_s`` (the config's
``step_timeout_s``, else :func:`default_step_timeout_s`: 20 s for small layers). On gloo the group's own
timeout is three quarters of that bound, so the ranks waiting on a hung peer give up first and report
:class:`ray_actors.worker.CollectiveFailed`, and the peer that never answered is the one named. After a
watchdog every rank is alive, so every worker first closes its team (collective; bounded by
``teardown_timeout_s``) before the actors are replaced; after a death or a hang the workers are killed
directly (a hung worker of an embedded Ray also by its pid, since a stopped process cannot act on Ray's
request to exit). A lost node (every worker on it dies) is a ``worker_died`` fault like any other: the new
team is placed afresh, on a spare node if the cluster has one; if it no longer has enough nodes, the
driver waits up to ``placement_timeout_s`` for the placement group and then raises :class:`NoNewTeam`
(a :class:`~flashdmoe.job.executor.WorkerFault`, not retried) naming the lost nodes. Starting the workers
is bounded too (``startup_timeout_s``) and retried the same way.
Each recovery is recorded in :attr:`MoECluster.faults` (with every rank's report), which the results
carry. An interrupted call (``KeyboardInterrupt``) leaves its workers busy: :meth:`close` then kills
them at once instead of asking them to leave their teams.

Every wait of the driver is bounded: connecting to ``address`` (a TCP probe of ``connect_timeout_s``
first, so that an address where nothing listens fails at once; ``flashdmoe run`` checks the address itself,
within ``--connect-timeout``, and turns the probe off), placing the workers
(``placement_timeout_s``), starting them and bootstrapping the team (``startup_timeout_s``), each call
(``call_timeout_s``), and closing teams (``teardown_timeout_s``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from flashdmoe.config import MoEConfig
from flashdmoe.errors import KernelTimeout
from flashdmoe.job.data import StepOutputs
from flashdmoe.job.executor import ClusterTooSmall, ClusterUnreachable, RankExecutor, WorkerFault
from flashdmoe.job.results import fault_entry, forward_flops, step_record, worker_entry
from flashdmoe.parallel.team import TeamFailed
from ray_actors.embedded import start_embedded_ray
from ray_actors.placement import Placement, format_resources
from ray_actors.worker import CRASH_POINTS, CollectiveFailed, RemoteMoEWorker, gpu_env_vars

__all__ = ["BACKENDS", "MoECluster", "NoNewTeam", "default_step_timeout_s"]

#: ``backend`` values: ``auto`` (the fused kernel when the cluster has a GPU per worker and the dtype is one
#: it runs, else the reference), ``reference`` (CPU expert parallelism over gloo, reference experts) or
#: ``cuda`` (the fused kernel; several ranks form an NVSHMEM team).
BACKENDS = ("auto", "reference", "cuda")

#: After one rank fails, how long the others get to finish or fail before they count as stuck.
_FAULT_GRACE_S = 30.0

#: The part of the bound on a step that does not scale with the layer (default_step_timeout_s).
STEP_TIMEOUT_BASE_S = 20.0

#: Throughput per rank (FLOP/s) that default_step_timeout_s allows for: far below what a CPU core or a GPU
#: reaches, so that only a rank that stopped answering exceeds the bound.
_ASSUMED_FLOPS = {"reference": 1e9, "cuda": 1e12}

#: gloo's collective timeout as a fraction of the bound on a call: the ranks waiting on a hung peer report
#: before the driver's deadline, so the rank that never answered is the one named.
_COLLECTIVE_FRACTION = 0.75

#: Default bound on starting the workers and bootstrapping a team, per backend: on GPUs the first use may
#: compile the CUDA extension (minutes).
_STARTUP_TIMEOUT_S = {"reference": 120.0, "cuda": 1200.0}

#: Token dtypes a multi-rank (NVSHMEM) team carries (flashdmoe.parallel.team.BufferPlan).
_TEAM_DTYPES = ("bfloat16", "float16")

_log = logging.getLogger(__name__)


def _load_config(config: MoEConfig | dict[str, Any] | str | Path) -> MoEConfig:
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


def _code_paths() -> str:
    """PYTHONPATH for embedded-Ray workers: where ``ray_actors`` and ``flashdmoe`` are imported from here."""
    import flashdmoe
    import ray_actors

    paths = [str(Path(module.__file__).resolve().parent.parent) for module in (ray_actors, flashdmoe)]
    paths += [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    return os.pathsep.join(dict.fromkeys(paths))


def _positive_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r}: expected a finite number of seconds > 0")
    return float(value)


def _optional_seconds(name: str, value: object) -> float | None:
    return None if value is None else _positive_seconds(name, value)


def _watchdog_s() -> float:
    """The fused kernel's watchdog in seconds (``FLASHDMOE_TIMEOUT_MS``, as the workers will read it)."""
    try:
        from flashdmoe.cuda_backend import DEFAULT_TIMEOUT_MS
    except ImportError:
        DEFAULT_TIMEOUT_MS = 10_000
    try:
        return int(os.environ.get("FLASHDMOE_TIMEOUT_MS", DEFAULT_TIMEOUT_MS)) / 1e3
    except ValueError:
        return DEFAULT_TIMEOUT_MS / 1e3


def default_step_timeout_s(config: MoEConfig, backend: str) -> float:
    """The bound on one call (a step's forward + backward, or one verification pass) when the config sets no
    ``step_timeout_s``: :data:`STEP_TIMEOUT_BASE_S` (on the cuda backend at least twice the kernel's
    watchdog, so that a silent peer surfaces as ``KernelTimeout`` on every rank rather than as a hang) plus
    the step's FLOPs (three forwards) at a deliberately low throughput (1 GFLOP/s per rank on the reference
    backend, 1 TFLOP/s on cuda). ``configs/tiny.yaml``: 20 s; ``configs/h200x8.yaml``: 21 s on GPUs."""
    if backend not in _ASSUMED_FLOPS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(_ASSUMED_FLOPS)}")
    base = max(STEP_TIMEOUT_BASE_S, 2 * _watchdog_s()) if backend == "cuda" else STEP_TIMEOUT_BASE_S
    return base + 3 * forward_flops(config, config.tokens_per_rank) / _ASSUMED_FLOPS[backend]


def _host_and_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a Ray address (``HOST:PORT``, ``ray://HOST:PORT``), or ``None`` where it names none."""
    rest = address.split("://", 1)[1] if "://" in address else address
    rest = rest.split("/", 1)[0]
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _is_worker_process(pid: int) -> bool:
    """Whether ``pid`` is (still) a MoEWorker actor process of this machine (Ray titles them ``ray::MoEWorker``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return b"MoEWorker" in file.read()
    except OSError:
        return False


class NoNewTeam(WorkerFault):
    """The team broke and no new one could be placed within ``placement_timeout_s``: the cluster lost
    nodes (or another job holds their resources). Not retried: the wait was the placement timeout."""


class MoECluster(RankExecutor):
    """Expert-parallel MoE layer over Ray actors, one rank each. Use as a context manager.

    Args:
        config: the layer (a :class:`MoEConfig`, a dict of its fields or a YAML path).
        address: Ray cluster to connect to; ``None`` starts an embedded Ray on 127.0.0.1 (or joins the
            cluster of the Ray job this driver runs in, from ``RAY_ADDRESS``).
        workers: number of ranks ``P``; default ``config.world_size`` (the config is re-validated with it).
        nodes: number of nodes the ranks span, dividing ``P``; default ``config.nodes`` (1: every rank on one
            node). Each node runs ``P // nodes`` ranks (one per GPU), node-major.
        backend: one of :data:`BACKENDS`.
        gpus_per_worker: GPU share per rank on the CUDA backend, ``0 < g <= 1`` (the actors' ``num_gpus``);
            below 1 several ranks share a GPU under MPS and each gets
            ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=floor(100*g)``.
        max_retries: recoveries allowed per call (and for starting the first team) before the fault is raised.
        collective_timeout_s: gloo's timeout for one collective, at most ``call_timeout_s`` (a dead peer is
            usually noticed sooner); default three quarters of ``call_timeout_s``.
        call_timeout_s: longest a call (a step, a forward, a backward) may take on any rank before the team
            counts as hung, is replaced and the call retried; default the config's ``step_timeout_s``, else
            :func:`default_step_timeout_s`.
        startup_timeout_s: longest starting the workers or bootstrapping a team may take; default 120 s on
            CPU workers, 1200 s on GPU workers (the first use may compile the CUDA extension).
        connect_timeout_s: with ``address``, how long the TCP probe of that address may take before
            :class:`~flashdmoe.job.executor.ClusterUnreachable`.
        check_address: whether to probe ``address`` before ``ray.init``; False where the caller has just
            checked it (``flashdmoe run``, within ``--connect-timeout``), so that it is checked once.
        placement_timeout_s: longest to wait for the cluster to place the ranks (the placement group) before
            :class:`~flashdmoe.job.executor.ClusterTooSmall` (at start) or :class:`NoNewTeam` (replacing a
            broken team).
        num_cpus: CPUs of the embedded Ray (default ``max(os.cpu_count(), P)``).
        max_tokens: most tokens any rank passes to one forward on the CUDA backend with several ranks (it
            sizes the NVSHMEM team's symmetric buffers); default ``config.tokens_per_rank`` (at least 1).
            :meth:`forward` refuses larger batches.
        mps_pipe_dir, mps_log_dir: the MPS daemon's directories, passed to every GPU actor as
            ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``; default (when ``gpus_per_worker < 1``)
            those of this process's environment, if set (else the MPS default ``/tmp/nvidia-mps``).
        teardown_timeout_s: how long the workers get to close their teams (after a kernel watchdog fired,
            and at :meth:`close`), before they are killed anyway.

    Raises:
        ValueError: bad config or arguments, before any actor starts.
        ClusterUnreachable: nothing answers at ``address``, or no cluster is running for ``address="auto"``.
        ClusterTooSmall: the cluster cannot place the ranks (too few CPUs or GPUs in all, on one node, or
            too few nodes large enough; or not free within ``placement_timeout_s``).
        WorkerFault: the workers could not be started within the retries.
    """

    kind = "ray"

    def __init__(self, config: MoEConfig | dict[str, Any] | str | Path, address: str | None = None,
                 workers: int | None = None, *, nodes: int | None = None, backend: str = "auto",
                 gpus_per_worker: float = 1.0, max_retries: int = 2, collective_timeout_s: float | None = None,
                 call_timeout_s: float | None = None, placement_timeout_s: float = 120.0,
                 num_cpus: int | None = None, max_tokens: int | None = None,
                 mps_pipe_dir: str | os.PathLike | None = None, mps_log_dir: str | os.PathLike | None = None,
                 teardown_timeout_s: float = 30.0, startup_timeout_s: float | None = None,
                 connect_timeout_s: float = 10.0, check_address: bool = True) -> None:
        started = time.perf_counter()
        config = _load_config(config)
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers={workers!r}: expected an integer >= 1")
        if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
            raise ValueError(f"nodes={nodes!r}: expected an integer >= 1")
        changes = {name: value for name, value in (("world_size", workers), ("nodes", nodes)) if value is not None}
        if changes:
            try:
                config = config.replace(**changes)
            except ValueError as error:  # the config's own message names the field
                raise ValueError(f"workers={workers}: {error}" if workers is not None else str(error)) from None
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
        if isinstance(gpus_per_worker, bool) or not isinstance(gpus_per_worker, (int, float)) \
                or not 0 < gpus_per_worker <= 1:
            raise ValueError(f"gpus_per_worker={gpus_per_worker!r}: expected a number in (0, 1]")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries={max_retries!r}: expected an integer >= 0")
        collective_timeout_s = _optional_seconds("collective_timeout_s", collective_timeout_s)
        call_timeout_s = _optional_seconds("call_timeout_s", call_timeout_s)
        if collective_timeout_s is not None and call_timeout_s is not None and collective_timeout_s > call_timeout_s:
            raise ValueError(f"collective_timeout_s={collective_timeout_s:g}: expected at most call_timeout_s="
                             f"{call_timeout_s:g} (the ranks waiting on a hung peer give up first, which names it)")
        startup_timeout_s = _optional_seconds("startup_timeout_s", startup_timeout_s)
        self.placement_timeout_s = _positive_seconds("placement_timeout_s", placement_timeout_s)
        self.teardown_timeout_s = _positive_seconds("teardown_timeout_s", teardown_timeout_s)
        self.connect_timeout_s = _positive_seconds("connect_timeout_s", connect_timeout_s)
        self.check_address = bool(check_address)
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
        self._gpu_env = gpu_env_vars(gpus_per_worker, mps_pipe_dir=mps_pipe_dir, mps_log_dir=mps_log_dir,
                                     nodes=config.nodes)

        self.config = config
        self.requested_backend = backend
        self.gpus_per_worker = float(gpus_per_worker)
        self.max_retries = max_retries
        self.max_tokens = max_tokens
        self.generation = 0  # teams bootstrapped so far (1 after the first; +1 per recovery)
        self.faults: list[dict[str, Any]] = []
        self.actors: list[Any] = []
        self.node_infos: list[dict[str, Any]] = []
        self.placement: Placement | None = None  # set once the backend is known
        self._placement_group = None
        self._last_xs: list[torch.Tensor] | None = None
        self._owns_ray = False
        self._embedded = False  # a Ray started here on 127.0.0.1: every worker is a process of this machine
        self._closed = False
        self._team_broken = False
        self._busy = False  # a call's tasks may still run on the workers (interrupted, or ranks stuck)
        self._pids: dict[int, int] = {}  # rank -> pid of the current workers

        try:
            self._connect(address, num_cpus)
            self.backend = self._resolve_backend(backend)
            self.placement = Placement(self.world_size, config.nodes, self._bundle())
            self.transport = "gloo" if self.backend == "reference" else "nvshmem" if self.world_size > 1 else "single"
            self.call_timeout_s = (call_timeout_s or config.step_timeout_s
                                   or default_step_timeout_s(config, self.backend))
            if collective_timeout_s is not None and collective_timeout_s > self.call_timeout_s:
                raise ValueError(f"collective_timeout_s={collective_timeout_s:g}: expected at most the bound on a "
                                 f"call, {self.call_timeout_s:g}s (call_timeout_s, else the config's step_timeout_s)")
            self.collective_timeout_s = collective_timeout_s or _COLLECTIVE_FRACTION * self.call_timeout_s
            self.startup_timeout_s = startup_timeout_s or _STARTUP_TIMEOUT_S[self.backend]
            self._with_recovery("start", lambda attempt: self._start() if attempt == 0 else None,
                                restart_on_error=False)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - started

    # -- cluster and team lifecycle ------------------------------------------------------------------

    def _connect(self, address: str | None, num_cpus: int | None) -> None:
        if ray.is_initialized():
            return  # the caller's Ray session; leave it running at close()
        self._owns_ray = True  # also when ray.init is interrupted: close() shuts Ray down (start_embedded_ray has
        # already stopped the processes of an embedded one)
        if address is None and not os.environ.get("RAY_ADDRESS"):
            # always a new embedded Ray (loopback, token auth: ray_actors.embedded); address=None would
            # join a `ray start` cluster recorded in /tmp/ray (and then refuse num_cpus)
            self._embedded = True
            start_embedded_ray(num_cpus=num_cpus or max(os.cpu_count() or 1, self.world_size),
                               runtime_env={"env_vars": {"PYTHONPATH": _code_paths()}}, logging_level=logging.WARNING)
            return
        # an existing cluster: the code must be importable there (installed, or the job's working_dir)
        if self.check_address:
            self._probe(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError as error:  # e.g. "auto" with no cluster running
            raise ClusterUnreachable(f"address={address!r}: {_first_line(error)}") from None

    def _probe(self, address: str | None) -> None:
        """Refuse at once an address where nothing accepts a TCP connection within ``connect_timeout_s``
        (ray.init would retry it for many minutes)."""
        if address in (None, "auto"):  # $RAY_ADDRESS, else the cluster recorded on this node, as ray.init finds it
            try:
                from ray._private.services import get_ray_address_from_environment
            except ImportError:  # another Ray layout: leave it to ray.init
                return
            try:
                address = get_ray_address_from_environment(address, None)
            except ConnectionError as error:
                raise ClusterUnreachable(f"address={address!r}: {_first_line(error)}") from None
        where = _host_and_port(address or "")
        if where is None:
            return
        try:
            socket.create_connection(where, timeout=self.connect_timeout_s).close()
        except OSError as error:
            raise ClusterUnreachable(
                f"address={address!r}: nothing answers at {where[0]}:{where[1]} within {self.connect_timeout_s:g}s "
                f"({error.strerror or error}); start the cluster first (ray start --head) or leave the address "
                "out to start an embedded Ray") from None

    def _resolve_backend(self, requested: str) -> str:
        resources = ray.cluster_resources()
        gpus, cpus = resources.get("GPU", 0.0), resources.get("CPU", 0.0)
        gpus_needed = self.world_size * self.gpus_per_worker
        dtypes = _cuda_dtypes(self.world_size)
        if requested == "cuda":
            if self.config.dtype not in dtypes:
                raise ValueError(f"dtype={self.config.dtype!r}: the cuda backend with {self.world_size} worker(s) "
                                 f"runs {', '.join(dtypes)}; use backend='reference' for {self.config.dtype}")
            if gpus < gpus_needed:
                raise ClusterTooSmall(f"backend='cuda': the Ray cluster has {gpus:g} GPUs; {self.world_size} "
                                      f"workers x {self.gpus_per_worker:g} GPU need {gpus_needed:g}")
            return "cuda"
        if requested == "auto" and gpus >= gpus_needed and self.config.dtype in dtypes:
            return "cuda"
        if cpus < self.world_size:
            raise ClusterTooSmall(f"workers={self.world_size}: the Ray cluster has {cpus:g} CPUs; the reference "
                                  "backend (gloo) needs one CPU per worker")
        return "reference"

    def _bundle(self) -> dict[str, float]:
        return {"GPU": self.gpus_per_worker} if self.backend == "cuda" else {"CPU": 1.0}

    def _place(self) -> Any:
        """Reserve the placement group (at most ``placement_timeout_s``)."""
        placement = self.placement
        group = placement_group(placement.bundles(), strategy=placement.strategy)
        self._placement_group = group
        try:
            ray.get(group.ready(), timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            alive = sum(1 for node in ray.nodes() if node.get("Alive"))
            raise ClusterTooSmall(
                f"could not place {placement.describe()} within {self.placement_timeout_s:g}s ({placement.strategy} placement group "
                f"still pending): the Ray cluster has {format_resources(ray.cluster_resources())} in all and "
                f"{format_resources(ray.available_resources())} free, on {alive} alive node(s); other actors or jobs "
                "hold the rest, or nodes are missing (wait longer with --placement-timeout)") from None
        return group

    def _start(self, check_fits: bool = True) -> None:
        """Reserve the placement group, start the workers and bootstrap a fresh team on them. With
        ``check_fits``, a cluster whose nodes are too few or too small is refused at once; without (replacing
        a team, when a lost node may yet be replaced), the placement group is waited for."""
        placement = self.placement
        if check_fits:
            placement.check_fits(ray.nodes())
        group = self._place()
        if self.backend == "cuda":
            # multicast off; when ranks share a GPU, their MPS share and the daemon's directories
            options = dict(num_cpus=0, num_gpus=self.gpus_per_worker, runtime_env={"env_vars": dict(self._gpu_env)})
        else:
            options = dict(num_cpus=1)
        self.actors = [
            RemoteMoEWorker.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=placement.bundle_index(rank)),
                max_restarts=0, **options).remote()
            for rank in range(self.world_size)
        ]
        self.generation += 1
        self._pids = {}
        bound = self.startup_timeout_s
        # every actor process up before any rendezvous starts its clock (gloo's store timeout, NVSHMEM's init)
        pids = self._gather([worker.ping.remote() for worker in self.actors], "start", timeout_s=bound)
        self._pids = {rank: pid for rank, pid in enumerate(pids) if isinstance(pid, int)}
        # one node: every socket of the bootstrap on loopback; several: on the addresses Ray reports
        across_nodes = placement.nodes > 1
        if self.backend == "cuda" and self.world_size == 1:
            # a single-rank team needs no bootstrap
            rendezvous = {"backend": "cuda", "unique_id": None, "max_tokens": self.max_tokens}
            team_id = "single"
        elif self.backend == "cuda":
            # a fresh unique id per team: a failed team's id is never reused
            unique_id = self._gather([self.actors[0].make_unique_id.remote(self.config.dtype, across_nodes)],
                                     "make_unique_id", ranks=[0], timeout_s=bound)[0]
            rendezvous = {"backend": "cuda", "unique_id": unique_id, "max_tokens": self.max_tokens,
                          "across_nodes": across_nodes}
            team_id = "nvshmem-" + hashlib.sha256(bytes(unique_id)).hexdigest()[:16]
        else:
            host, port = self._gather([self.actors[0].open_store.remote(across_nodes)], "open_store", ranks=[0],
                                      timeout_s=bound)[0]
            rendezvous = {"backend": "gloo", "address": host, "port": port, "across_nodes": across_nodes,
                          "timeout_s": self.collective_timeout_s, "rendezvous_s": bound}
            team_id = f"gloo-{host}:{port}"
        config_dict = self.config.to_dict()
        # all submitted before any is awaited: team initialisation blocks until every rank has joined
        refs = [worker.setup.remote(rank, self.world_size, config_dict, rendezvous, placement.local_rank(rank))
                for rank, worker in enumerate(self.actors)]
        self.node_infos = [worker_entry(**info, generation=self.generation, team_id=team_id)
                           for info in self._gather(refs, "setup", timeout_s=bound)]
        self._last_xs = None

    def _stop_workers(self, hung: Sequence[int] = ()) -> None:
        """Kill every worker and release the placement group (no collective teardown: peers may be hung).
        On an embedded Ray the ``hung`` ranks' processes are also killed by pid: a stopped process cannot act
        on Ray's request, which Ray only enforces after a grace period."""
        for worker in self.actors:
            try:
                ray.kill(worker, no_restart=True)
            except Exception as error:  # already gone
                _log.debug("ray.kill: %s", error)
        if self._embedded:
            for rank in hung:
                pid = self._pids.get(rank)
                if pid is not None and _is_worker_process(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError as error:  # exited meanwhile
                        _log.debug("kill %d: %s", pid, error)
        self.actors = []
        self._pids = {}
        self._busy = False
        if self._placement_group is not None:
            try:
                remove_placement_group(self._placement_group)
            except Exception as error:
                _log.debug("remove_placement_group: %s", error)
            self._placement_group = None

    def _close_teams(self) -> bool:
        """Every worker closes its team (collective on NVSHMEM), bounded by ``teardown_timeout_s``; True if
        all of them did."""
        if not self.actors:
            return False
        refs = [worker.teardown.remote() for worker in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.teardown_timeout_s)
        closed = len(ready) == len(refs)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as error:
                closed = False
                _log.warning("closing a team after a fault: %s", _first_line(error))
        return closed

    def _restart(self, close_teams: bool = False, hung: Sequence[int] = ()) -> bool | None:
        """Replace the team: optionally let every worker close its team first (returns whether all did;
        ``None`` when not asked), then kill the workers (``hung`` ranks by pid too, see :meth:`_stop_workers`)
        and bootstrap a new team on new ones, waiting up to ``placement_timeout_s`` for the placement."""
        closed = self._close_teams() if close_teams else None
        self._stop_workers(hung)
        self._start(check_fits=False)
        return closed

    def _lost_nodes(self) -> str:
        """The current team's nodes that Ray no longer reports alive, with their ranks (``""`` if none)."""
        try:
            alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
        except Exception as error:  # the GCS itself unreachable: nothing to add
            _log.debug("ray.nodes: %s", error)
            return ""
        lost: dict[str, list[int]] = {}
        addresses: dict[str, str] = {}
        for info in self.node_infos:
            if info["node_id"] and info["node_id"] not in alive:
                lost.setdefault(info["node_id"], []).append(info["rank"])
                addresses[info["node_id"]] = info["node_ip"] or "?"
        return "; ".join(f"node {node_id[:12]} ({addresses[node_id]}) with rank(s) {ranks}"
                         for node_id, ranks in lost.items())

    def close(self) -> None:
        """Tear the team down (each worker leaves its group), stop the workers, and stop Ray if this
        cluster started it. Safe to call twice. Workers still busy with a call (it was interrupted, or a
        rank is stuck) are killed without being asked to leave their teams."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.actors and not self._busy:
                refs = [worker.teardown.remote() for worker in self.actors]
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.teardown_timeout_s)
                for ref in ready:
                    try:
                        ray.get(ref)
                    except Exception as error:  # a dead or broken worker is killed below anyway
                        _log.debug("teardown: %s", error)
        finally:
            try:
                self._stop_workers(hung=list(self._pids) if self._busy else ())
            finally:
                if self._owns_ray:
                    ray.shutdown()  # also after an interrupted ray.init: stops what it started

    def __enter__(self) -> MoECluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- calls with fault detection ----------------------------------------------------------------------

    def _gather(self, refs: list, what: str, ranks: Sequence[int] | None = None,
                timeout_s: float | None = None) -> list:
        """Results of one call per rank, waiting at most ``timeout_s`` (default ``call_timeout_s``);
        classifies failures (see :class:`WorkerFault`):

        - a dead worker: ``worker_died``; a ``KernelTimeout`` / ``TeamFailed``: ``kernel_timeout`` /
          ``team_failed``;
        - an error of a rank's own (anything else): raised as it is, not retried (the team is replaced first
          if it left other ranks waiting inside a collective);
        - otherwise ranks that did not answer in time, or only collectives that gave up on a peer
          (:class:`CollectiveFailed`): ``timeout``, naming the ranks that did not answer.
        """
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        pending = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        deadline = time.monotonic() + timeout_s
        first_error_at = 0.0
        self._busy = True  # stays set if this wait is interrupted: close() must not queue behind the call
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
        self._busy = bool(stuck)
        if not errors and not stuck:
            return [results[rank] for rank in ranks]
        reports = sorted([{"rank": rank, "error": _error_name(error), "message": _error_message(error)}
                          for rank, error in errors.items()]
                         + [{"rank": rank, "error": "stuck", "message": f"did not finish {what} within {timeout_s:g}s"}
                            for rank in stuck],
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
        gave_up = sorted(rank for rank, error in errors.items() if _is_error(error, CollectiveFailed))
        own = sorted(set(errors) - set(gave_up))
        if own:
            # an ordinary error (not retried); if it left other ranks inside a collective the team is unusable
            self._team_broken = bool(stuck or gave_up)
            raise errors[own[0]]
        if stuck:
            waited = f"; rank(s) {gave_up} gave up waiting on them" if gave_up else ""
            raise WorkerFault("timeout", stuck, f"rank(s) {stuck} stopped answering during {what}: no result within "
                              f"{timeout_s:g}s{waited}", reports)
        raise WorkerFault("timeout", gave_up, f"collectives of rank(s) {gave_up} gave up on a peer during {what} (no "
                          f"answer within the collective timeout, {self.collective_timeout_s:g}s): "
                          f"{_error_message(errors[gave_up[0]])}", reports)

    def _call(self, method: str, args_per_rank: Sequence[tuple] | None = None) -> list:
        args_per_rank = args_per_rank or [()] * self.world_size
        refs = [getattr(worker, method).remote(*args) for worker, args in zip(self.actors, args_per_rank)]
        return self._gather(refs, method)

    def _with_recovery(self, what: str, attempt_fn: Callable[[int], Any], step: int | None = None, *,
                       restart_on_error: bool = True) -> Any:
        """Run ``attempt_fn(attempt)``; on a :class:`WorkerFault` restart the team and retry (bounded). After an
        ordinary error that left the team unusable, the team is replaced (with ``restart_on_error``) before
        the error is raised."""
        if self._closed:
            raise RuntimeError("MoECluster is closed")
        attempt = 0
        fault: dict[str, Any] | None = None  # the fault being recovered from
        while True:
            try:
                if fault is not None:
                    self._recover(fault)
                    self.faults.append(fault)
                    fault = None
                return attempt_fn(attempt)
            except WorkerFault as error:
                if fault is not None:  # the restart itself failed
                    fault["recovered"] = False
                    self.faults.append(fault)
                    if isinstance(error, NoNewTeam):  # it already waited the placement timeout
                        raise
                fault = fault_entry(call=what, step=step, attempt=attempt, kind=error.kind, ranks=error.ranks,
                                    error=str(error), reports=error.reports)
                if attempt >= self.max_retries:
                    fault["recovered"] = False
                    self.faults.append(fault)
                    raise
                _log.warning("%s: %s; restarting the team (retry %d of %d)", what, error, attempt + 1,
                             self.max_retries)
                attempt += 1
            except Exception:
                if self._team_broken and restart_on_error:  # keep the cluster usable, then report the error
                    self._team_broken = False
                    self._restart(hung=list(self._pids) if self._busy else ())
                raise

    def _recover(self, fault: dict[str, Any]) -> None:
        """A new team on new workers after ``fault`` (updated with the outcome). After a watchdog every
        rank is alive: each closes its team before the actors are replaced."""
        started = time.perf_counter()
        hung = [report["rank"] for report in fault["reports"] if report["error"] == "stuck"]
        lost = self._lost_nodes()
        if lost:
            fault["error"] += f" (lost: {lost})"
        # closing an NVSHMEM team is collective: only when every rank answered
        close_teams = fault["kind"] in ("kernel_timeout", "team_failed") and not hung
        try:
            fault["teams_closed"] = self._restart(close_teams=close_teams, hung=hung)
        except ClusterTooSmall as error:  # the cluster lost nodes, or the resources are held elsewhere
            raise NoNewTeam(fault["kind"], fault["ranks"], f"no new team after {fault['error']}: {error}",
                            fault["reports"]) from error
        fault.update(recovered=True, recovery_s=time.perf_counter() - started, generation=self.generation)

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

    def step(self, step: int, *, crash: dict[str, Any] | None = None,
             silence: dict[str, Any] | None = None) -> dict[str, Any]:
        """One timed forward + backward on every rank's seeded batch of ``step``
        (:func:`flashdmoe.job.data.seeded_inputs`), with recovery.

        Args:
            step: data index.
            crash: fault injection for tests, ``{"rank": r, "at": point}`` (see
                :data:`ray_actors.worker.CRASH_POINTS`), on the first attempt only: at ``before_forward`` /
                ``after_forward`` that worker's process exits; at ``kernel_timeout`` it raises
                ``KernelTimeout`` before its forward; at ``stop`` it stops itself (``SIGSTOP``) after its
                forward; at ``stall`` it sleeps ``crash["seconds"]`` (default
                :data:`ray_actors.worker.DEFAULT_STALL_S`) before its forward. A stopped or stalled rank is
                detected as hung after ``call_timeout_s``.
            silence: test knob for "a peer stops answering", ``{"rank": r, "timeout_ms": t}`` (CUDA backend,
                several ranks), on the first attempt only: every worker sets
                ``flashdmoe.cuda_backend.debug.silent_rank = r`` and a ``t`` ms watchdog for this step, so
                every rank raises ``KernelTimeout``; the team is then closed, bootstrapped again and the step
                retried (needs ``max_retries >= 1`` to succeed).

        Returns:
            The step record (:func:`flashdmoe.job.results.step_record`; times of the slowest rank, per-rank
            entries from :meth:`ray_actors.worker.MoEWorker.step`).
        """
        if crash is not None:
            if not isinstance(crash, dict) or crash.get("at") not in CRASH_POINTS or \
                    crash.get("rank") not in range(self.world_size) or not set(crash) <= {"rank", "at", "seconds"} \
                    or ("seconds" in crash and crash["at"] != "stall"):
                raise ValueError(f"crash={crash!r}: expected {{'rank': 0..{self.world_size - 1}, "
                                 f"'at': one of {CRASH_POINTS}}}, and 'seconds' only with 'at': 'stall'")
            seconds = crash.get("seconds")
            if seconds is not None:
                _positive_seconds("crash['seconds']", seconds)
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
            injected = crash is not None and number == 0
            args = [(step, crash["at"] if injected and rank == crash["rank"] else None,
                     silence if number == 0 else None,
                     crash.get("seconds") if injected and rank == crash["rank"] else None)
                    for rank in range(self.world_size)]
            return self._call("step", args)

        per_rank = self._with_recovery("step", attempt, step=step)
        return step_record(step, per_rank, attempts=len(attempts))

    def forward_backward(self, xs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor]) -> StepOutputs:
        ys = self.forward(xs)
        dxs, grads = self.backward(output_grads)
        return StepOutputs(ys=ys, dxs=dxs, d_router_weight=grads["router_weight"], d_w1s=grads["w1"],
                           d_w2s=grads["w2"])

    def workers(self) -> list[dict[str, Any]]:
        """Where each rank's actor runs (of the current team): :func:`flashdmoe.job.results.worker_entry`."""
        return [dict(info) for info in self.node_infos]

    def peak_memory_bytes(self) -> tuple[list[int | None], int | None]:
        peaks = self._with_recovery("peak_memory_bytes", lambda _: self._call("peak_memory_bytes"))
        return peaks, max(peaks)


# -- errors raised in the workers ---------------------------------------------------------------------------


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


