"""``MoEWorker``: the Ray actor that is one rank of the expert-parallel MoE (docs/design.md §11).

One actor per GPU (``num_gpus=1``) or, on a cluster without GPUs, per CPU (``num_cpus=1``); the driver
(:class:`ray_actors.cluster.MoECluster`) places them (:mod:`ray_actors.placement`): on one node in a
STRICT_PACK placement group, one bundle each; across nodes, node-major, in one bundle per node.
A worker:

1. joins the team (:meth:`MoEWorker.setup`):
   - CPU: ``torch.distributed`` gloo over a TCP store that rank 0 hosts (:meth:`MoEWorker.open_store`) on
     ``127.0.0.1`` when every rank is on its node, else on its node's address as Ray reports it; gloo's
     own connections likewise on loopback, else on the interface of each rank's node address. Runs
     :func:`flashdmoe.parallel.ep_gloo.expert_parallel_moe`;
   - GPU, one rank: ``flashdmoe.parallel.team.Team.single()``; several ranks:
     ``Team.nvshmem(unique_id, rank, world_size, max_tokens=..., hidden=H, top_k=k, local_experts=E // P,
     dtype=...)`` with the 128-byte NVSHMEM unique id that rank 0 made (:meth:`MoEWorker.make_unique_id`);
     it runs ``flashdmoe.api.moe(..., team=team, backend="cuda")`` (collective; backward through autograd,
     collective too). Several ranks may share one GPU under MPS (fractional ``num_gpus``; the driver puts
     ``CUDA_MPS_*`` in the actor's environment, :func:`gpu_env_vars`);
2. builds its expert shard from the config's seed (:func:`flashdmoe.config.make_weights`);
3. runs :meth:`forward` / :meth:`backward` on batches the driver sends, or :meth:`step` on seeded
   batches (:func:`flashdmoe.config.make_tokens`, :func:`flashdmoe.job.data.output_gradient`), timing each;
4. reports its :meth:`peak_memory_bytes` and frees everything in :meth:`teardown`.

Every collective call must be issued by all ranks of the team; the driver guarantees that by sending
each call to every worker.

Faults: a ``flashdmoe.KernelTimeout`` (the fused kernel's watchdog: a peer stopped answering) is caught
by the worker, which records it (:meth:`MoEWorker.fault_reports`), marks its team failed and re-raises
it to the driver, which closes every rank's team and bootstraps a new one. On gloo, a collective that
times out waiting for a peer (the group's timeout, which the driver sets below its own bound on a call)
or loses its connection to one is re-raised as :class:`CollectiveFailed`, so the driver can tell "a peer
stopped answering" from an error of this rank's own. For tests, :meth:`step` takes
``silence={"rank": r, "timeout_ms": t}``: for that one step every rank sets
``flashdmoe.cuda_backend.debug.silent_rank = r`` (rank ``r`` publishes none of its signals) and a short
watchdog, so every rank must raise ``KernelTimeout`` instead of hanging; and ``crash_at`` (one of
:data:`CRASH_POINTS`): this rank's process exits, stops itself (``SIGSTOP``), sleeps, or raises
``KernelTimeout``.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import math
import os
import resource
import signal
import socket
import sys
import time
from typing import Any

import ray
import torch

from flashdmoe import reference
from flashdmoe.config import CONFIG_DTYPES, MoEConfig, make_tokens, make_weights
from flashdmoe.errors import BackendUnavailable, KernelTimeout
from flashdmoe.job.data import output_gradient
from flashdmoe.job.results import rank_step_entry
from flashdmoe.parallel.team import Team, TeamFailed
from ray_actors.netif import interface_of

__all__ = ["CRASH_POINTS", "GPU_ENVIRONMENT", "CollectiveFailed", "MoEWorker", "RemoteMoEWorker", "gpu_env_vars",
           "mps_share_percentage"]

#: Environment for GPU processes: no NVLink SHARP / multicast objects (docs/design.md §8).
GPU_ENVIRONMENT = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

#: Fault-injection points for tests (:meth:`MoEWorker.step`): at ``before_forward`` / ``after_forward``
#: the process exits; at ``kernel_timeout`` the rank raises ``flashdmoe.KernelTimeout`` before its forward,
#: as the fused kernel's watchdog would (lets CPU tests exercise the driver's recovery from a timeout; the
#: real watchdog is exercised on the GPU with ``silence``); at ``stop`` the process stops itself with
#: ``SIGSTOP`` after its forward (a hung worker: its peers wait in the backward's exchange); at ``stall``
#: it sleeps ``stall_s`` seconds before its forward (a slow worker), then runs the step.
CRASH_POINTS = ("before_forward", "after_forward", "kernel_timeout", "stop", "stall")

#: How long ``stall`` sleeps when not told.
DEFAULT_STALL_S = 600.0


class CollectiveFailed(RuntimeError):
    """A gloo collective of this rank failed because of a peer: it timed out waiting for one (the group's
    timeout) or lost its connection to one. The team cannot be used again; the peer is the fault."""


def _is_collective_failure(error: BaseException) -> bool:
    """Whether ``error``, raised inside a gloo collective, comes from the transport (a peer that does not
    answer or went away) rather than from this rank's own computation."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(error, dist_error):
        return True
    # gloo's enforce messages carry their source path (".../third_party/gloo/gloo/transport/tcp/pair.cc")
    return isinstance(error, RuntimeError) and "gloo" in str(error).lower()


def mps_share_percentage(gpus_per_worker: float) -> int:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for a rank holding ``gpus_per_worker`` (in (0, 1]) of a GPU:
    ``floor(100 * gpus_per_worker)``, at least 1, so the ranks sharing a GPU ask for at most 100% together."""
    if isinstance(gpus_per_worker, bool) or not isinstance(gpus_per_worker, (int, float)) \
            or not 0 < gpus_per_worker <= 1:
        raise ValueError(f"gpus_per_worker={gpus_per_worker!r}: expected a number in (0, 1]")
    # the epsilon keeps e.g. 0.29 at 29 (100 * 0.29 is 28.999999999999996 in binary floating point)
    return max(1, math.floor(100 * gpus_per_worker + 1e-9))


def gpu_env_vars(gpus_per_worker: float = 1.0, *, mps_pipe_dir: str | os.PathLike | None = None,
                 mps_log_dir: str | os.PathLike | None = None, nodes: int = 1) -> dict[str, str]:
    """``runtime_env["env_vars"]`` of a GPU worker actor.

    Always the three multicast-off variables (:data:`GPU_ENVIRONMENT`). With ``gpus_per_worker < 1``
    (several ranks share a GPU under MPS) also ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` =
    :func:`mps_share_percentage`. ``mps_pipe_dir`` / ``mps_log_dir``, when given, become
    ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` (the MPS daemon's directories; the daemon is
    started by whoever starts the cluster, e.g. :class:`flashdmoe.parallel.mps.MpsDaemon`). With ``nodes > 1`` also
    ``FLASHDMOE_KERNEL_BUILD=nvshmem``: peers on other nodes have no load/store path, and only the NVSHMEM
    build of the kernel reaches them (docs/design.md §8).
    """
    percentage = mps_share_percentage(gpus_per_worker)
    environment = dict(GPU_ENVIRONMENT)
    if nodes > 1:
        environment["FLASHDMOE_KERNEL_BUILD"] = "nvshmem"
    if gpus_per_worker < 1:
        environment["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percentage)
    for argument, variable, value in (("mps_pipe_dir", "CUDA_MPS_PIPE_DIRECTORY", mps_pipe_dir),
                                      ("mps_log_dir", "CUDA_MPS_LOG_DIRECTORY", mps_log_dir)):
        if value is None:
            continue
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise ValueError(f"{argument}={value!r}: expected a directory path")
        environment[variable] = os.fspath(value)
    return environment


def _load_cuda_backend(dtype: torch.dtype, device: torch.device, rank: int | None) -> None:
    """Build (first use) or load the fused kernel's extension now, before this rank joins a team: a rank
    still compiling when its peers launch their first kernel would leave them spinning into the watchdog
    (and a peer stuck inside the collective team init). Raises ``BackendUnavailable`` with the reason."""
    from flashdmoe import api, cuda_backend

    torch.cuda.set_device(device)
    reason = api.cuda_unavailable_reason(torch.empty((0, 1), dtype=dtype, device=device))
    if reason is not None:
        raise BackendUnavailable(f"rank {rank}: backend 'cuda' cannot run here: {reason}")
    resolve = getattr(cuda_backend, "_extension", None)  # resolved once per process, then reused by forward
    if callable(resolve):
        resolve()


class MoEWorker:
    """One rank. The driver creates it as a Ray actor (:data:`RemoteMoEWorker`); all methods run in the
    actor process."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.local_rank: int | None = None
        self.world_size: int | None = None
        self.config: MoEConfig | None = None
        self.backend: str | None = None
        self.team = None
        self.traffic = None
        self.device = torch.device("cpu")
        self.faults: list[dict[str, Any]] = []  # what _fault_guard caught (fault_reports)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (x leaf, y) awaiting backward
        self._store_socket: socket.socket | None = None  # rank 0: the gloo store's listening socket

    # -- rendezvous ------------------------------------------------------------------------------

    def node_info(self) -> dict[str, Any]:
        """Where this actor runs: ``pid``, ``hostname``, Ray ``node_id`` and ``node_ip`` (the node's address as
        Ray reports it), assigned ``gpu_ids`` and ``mps``: the MPS variables this process sees (``pipe_dir``,
        ``log_dir``, ``thread_percentage``; ``None`` where unset)."""
        return {"pid": os.getpid(), "hostname": socket.gethostname(),
                "node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
                "mps": {"pipe_dir": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
                        "log_dir": os.environ.get("CUDA_MPS_LOG_DIRECTORY"),
                        "thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}}

    def open_store(self, across_nodes: bool = False) -> tuple[str, int]:
        """Rank 0 only: listen for the gloo store on a fresh port and keep the socket until :meth:`setup`
        hands it to the store (so the port cannot be taken meanwhile, and the store listens on exactly this
        address). On ``127.0.0.1``, or with ``across_nodes`` on this node's address as Ray reports it.

        Returns:
            ``(address, port)`` for every rank's rendezvous.
        """
        address = ray.util.get_node_ip_address() if across_nodes else "127.0.0.1"
        if self._store_socket is not None:
            self._store_socket.close()
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((address, 0))
            sock.listen(max(128, (self.world_size or 0) * 2))
        except BaseException:
            sock.close()
            raise
        self._store_socket = sock
        return address, sock.getsockname()[1]

    def _bind_to_node(self, variable: str, across_nodes: bool) -> None:
        """Point a library's interface variable at loopback (one node) or at the interface of this node's
        Ray address (across nodes); a value already in the environment wins."""
        if variable in os.environ:
            return
        os.environ[variable] = interface_of(ray.util.get_node_ip_address()) if across_nodes else "lo"

    def make_unique_id(self, dtype: str = "bfloat16", across_nodes: bool = False) -> bytes:
        """Rank 0 only: a fresh 128-byte NVSHMEM unique id for :meth:`setup` on every rank. Loads (or, on
        first use, builds) the CUDA extension first, while no peer waits yet, so the other ranks find it
        cached. ``dtype``: the config's dtype name (checked against the kernel's). ``across_nodes``: the team
        spans nodes, so the id must carry this node's routable address: NVSHMEM's bootstrap interface
        (``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME``) is set to the one holding the address Ray reports for it."""
        os.environ.update(GPU_ENVIRONMENT)
        if across_nodes:
            self._bind_to_node("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", True)
        if dtype not in CONFIG_DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(CONFIG_DTYPES)}")
        if not torch.cuda.is_available():
            raise BackendUnavailable("rank 0: backend 'cuda' but this actor sees no CUDA device "
                                     f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        _load_cuda_backend(CONFIG_DTYPES[dtype], torch.device("cuda", 0), 0)
        return bytes(Team.make_unique_id())

    def setup(self, rank: int, world_size: int, config_dict: dict[str, Any],
              rendezvous: dict[str, Any], local_rank: int | None = None) -> dict[str, Any]:
        """Join the team and build this rank's expert shard. Collective: the driver submits it to every
        rank before waiting on any (team initialisation blocks until all ranks arrive).

        Args:
            rank, world_size: this rank and ``P``.
            config_dict: :meth:`MoEConfig.to_dict` of the layer (``world_size`` equal to ``P``).
            rendezvous: ``{"backend": "gloo", "address": str, "port": int, "across_nodes": bool,
                "timeout_s": float, "rendezvous_s": float}`` (rank 0's :meth:`open_store`; the group's
                collective timeout; how long the ranks may take to meet at rank 0's store, default
                ``timeout_s``) or ``{"backend": "cuda", "unique_id": bytes | None, "max_tokens": int,
                "across_nodes": bool}``: the unique id from rank 0's :meth:`make_unique_id` (``None`` for one
                rank) and the most tokens any rank will pass per forward, which sizes the team's symmetric
                buffers. ``across_nodes``: the team spans nodes, so gloo's connections
                (``GLOO_SOCKET_IFNAME``) and NVSHMEM's bootstrap (``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME``) use
                the interface of the address Ray reports for this node instead of loopback (a value already
                set in the environment wins).
            local_rank: this rank's index among the ranks of its node (default ``rank``: one node).

        Returns:
            :meth:`node_info` plus ``rank``, ``local_rank``, ``device``, ``device_name`` (the GPU's, else
            ``None``) and ``team`` (``Team.describe()``, or ``None`` on gloo): the fields of a results
            ``workers[]`` entry (:func:`flashdmoe.job.results.worker_entry`) but ``generation`` and
            ``team_id``.
        """
        config = MoEConfig.from_dict(config_dict)
        if config.world_size != world_size or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: expected 0 <= rank < world_size == "
                             f"config.world_size={config.world_size}")
        if local_rank is None:
            local_rank = rank
        if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not 0 <= local_rank <= rank:
            raise ValueError(f"local_rank={local_rank!r}: expected an integer in [0, rank={rank}]")
        backend = rendezvous.get("backend")
        across_nodes = bool(rendezvous.get("across_nodes", False))
        if backend == "gloo":
            import torch.distributed as dist

            from flashdmoe.parallel.ep_gloo import TrafficCounter

            self._bind_to_node("GLOO_SOCKET_IFNAME", across_nodes)
            collective_s = float(rendezvous.get("timeout_s", 120))
            rendezvous_s = float(rendezvous.get("rendezvous_s", collective_s))
            listen_fd = None
            if rank == 0:
                sock = self._store_socket
                if sock is None or sock.getsockname()[1] != int(rendezvous["port"]):
                    raise ValueError(f"rendezvous['port']={rendezvous.get('port')!r}: rank 0 holds no store socket "
                                     "on it; call open_store() on rank 0 first")
                self._store_socket = None
                listen_fd = sock.detach()  # the store owns it from here
            # The store's rendezvous gets the longer startup bound (ranks may arrive seconds apart); once
            # every rank has connected to it, collectives run under the group's timeout, which the driver
            # keeps below its own bound on a call, so a peer that stops answering is reported, not waited on.
            store = dist.TCPStore(rendezvous["address"], int(rendezvous["port"]), world_size, is_master=rank == 0,
                                  timeout=datetime.timedelta(seconds=rendezvous_s), wait_for_workers=True,
                                  master_listen_fd=listen_fd)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=collective_s))
            self.traffic = TrafficCounter()
            self.device = torch.device("cpu")
        elif backend == "cuda":
            os.environ.update(GPU_ENVIRONMENT)
            if across_nodes:
                self._bind_to_node("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", True)
            if not torch.cuda.is_available():
                raise BackendUnavailable(f"rank {rank}: backend 'cuda' but this actor sees no CUDA device "
                                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            torch.cuda.set_device(0)  # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU(s)
            self.device = torch.device("cuda", 0)
            _load_cuda_backend(config.torch_dtype, self.device, rank)  # before the team: see there
            if world_size == 1:
                self.team = Team.single()
            else:
                max_tokens = rendezvous.get("max_tokens", max(1, config.tokens_per_rank))
                if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                    raise ValueError(f"rendezvous['max_tokens']={max_tokens!r}: expected an integer >= 1")
                # the hierarchical exchange needs the node layout (ranks node-major, as placed)
                layout = ({"ranks_per_node": config.ranks_per_node, "exchange": "hierarchical"}
                          if config.exchange == "hierarchical" else {})
                self.team = Team.nvshmem(
                    rendezvous["unique_id"], rank, world_size, max_tokens=max_tokens, hidden=config.hidden,
                    top_k=config.top_k, local_experts=config.local_experts, dtype=config.torch_dtype,
                    device=self.device, **layout)
        else:
            raise ValueError(f"rendezvous['backend']={backend!r}: expected 'gloo' or 'cuda'")
        self.rank, self.world_size, self.config, self.backend = rank, world_size, config, backend
        self.local_rank = local_rank
        # torch imports this (and sympy, ~1-2 s) lazily inside the first backward with an explicit
        # gradient; importing it here keeps that one-time cost out of the first step's timing
        importlib.import_module("torch.fx.experimental.symbolic_shapes")
        router_weight, w1, w2 = make_weights(config, experts=config.expert_range(rank), device=self.device)
        self.router_weight = router_weight.requires_grad_()
        self.w1 = w1.requires_grad_()
        self.w2 = w2.requires_grad_()
        self.faults = []
        describe = getattr(self.team, "describe", None)
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        return {**self.node_info(), "rank": rank, "local_rank": local_rank, "device": str(self.device),
                "device_name": device_name, "team": describe() if callable(describe) else None}

    # -- compute ---------------------------------------------------------------------------------

    def _require_setup(self) -> MoEConfig:
        if self.config is None:
            raise RuntimeError("MoEWorker: call setup() before running the layer")
        return self.config

    def _synchronize(self) -> None:
        """Wait for this rank's GPU work and raise what its fused launches reported."""
        if self.device.type == "cuda":
            import flashdmoe

            flashdmoe.synchronize(self.device)

    def _layer(self, x: torch.Tensor):
        """``(y [T, H], MoEAux)`` of this rank's tokens through the team's backend (collective)."""
        config = self.config
        options = dict(top_k=config.top_k, activation=config.activation, normalize_topk=config.normalize_topk,
                       capacity_factor=config.capacity_factor, return_aux=True)
        if self.backend == "gloo":
            from flashdmoe.parallel.ep_gloo import expert_parallel_moe

            return expert_parallel_moe(x, self.router_weight, self.w1, self.w2, traffic=self.traffic, **options)
        from flashdmoe import api

        return api.moe(x, self.router_weight, self.w1, self.w2, team=self.team, backend="cuda", **options)

    def _check_batch(self, name: str, tensor: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        config = self.config
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.shape[1] != config.hidden:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} (rank {self.rank}): got {shape}; expected a [T, H={config.hidden}] tensor")
        if rows is not None and tensor.shape[0] != rows:
            raise ValueError(f"{name} (rank {self.rank}): got {tensor.shape[0]} rows; expected {rows} like y")
        return tensor.to(device=self.device, dtype=config.torch_dtype).contiguous()

    @contextlib.contextmanager
    def _fault_guard(self, call: str, step: int | None = None):
        """Catch a ``KernelTimeout`` (or ``TeamFailed``) raised inside a collective call: record it in
        :attr:`faults`, mark the team failed (it cannot be used again) and re-raise it for the driver. On
        gloo, a collective failing because of a peer is recorded and re-raised as :class:`CollectiveFailed`."""
        try:
            yield
        except (KernelTimeout, TeamFailed) as error:
            self._record_fault(call, step, error)
            mark_failed = getattr(self.team, "mark_failed", None)
            if callable(mark_failed):
                mark_failed(f"{type(error).__name__} during {call}: {error}")
            raise
        except RuntimeError as error:
            if self.backend != "gloo" or not _is_collective_failure(error):
                raise
            text = " ".join(str(error).split())
            failed = CollectiveFailed(f"rank {self.rank}: a gloo collective failed during {call}: {text}")
            self._record_fault(call, step, failed)
            raise failed from error

    def _record_fault(self, call: str, step: int | None, error: BaseException) -> None:
        self._pending = None
        self.faults.append({"rank": self.rank, "call": call, "step": step, "error": type(error).__name__,
                            "message": str(error)})

    def fault_reports(self) -> list[dict[str, Any]]:
        """The ``KernelTimeout`` / ``TeamFailed`` / ``CollectiveFailed`` errors this actor caught since its
        last :meth:`setup`: ``[{"rank", "call", "step", "error" (class name), "message"}]``."""
        return list(self.faults)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``y [T, H]`` (config dtype, on CPU) of this rank's tokens ``x [T, H]``; keeps the graph for
        :meth:`backward`. Collective."""
        self._require_setup()
        x = self._check_batch("x", x).requires_grad_()
        with self._fault_guard("forward"):
            y, _ = self._layer(x)
            self._synchronize()
        self._pending = (x, y)
        return y.detach().cpu()

    def backward(self, dy: torch.Tensor) -> dict[str, Any]:
        """Back-propagate ``dy [T, H]`` through the last :meth:`forward`. Collective.

        Returns:
            ``{"dx": [T, H], "router_weight": [E, H], "w1": [L, H, .], "w2": [L, I, H],
            "router_grad_summed": bool}`` (CPU tensors, config dtype). ``router_grad_summed`` says whether
            ``router_weight`` already holds the sum over all ranks (gloo all-reduces it in backward) or
            only this rank's contribution (the driver then sums).
        """
        self._require_setup()
        if self._pending is None:
            raise RuntimeError(f"rank {self.rank}: backward() without a preceding forward()")
        x, y = self._pending
        self._pending = None
        dy = self._check_batch("dy", dy, rows=y.shape[0])
        self._zero_grads()
        with self._fault_guard("backward"):
            y.backward(dy)
            self._synchronize()
        return {"dx": x.grad.detach().cpu(), "router_weight": self.router_weight.grad.detach().cpu(),
                "w1": self.w1.grad.detach().cpu(), "w2": self.w2.grad.detach().cpu(),
                "router_grad_summed": self.backend == "gloo" or (self.team is not None and self.team.world_size > 1)}

    def _zero_grads(self) -> None:
        for tensor in (self.router_weight, self.w1, self.w2):
            tensor.grad = None

    def _bytes_sent(self) -> int:
        return self.traffic.bytes_sent if self.traffic is not None else 0

    @contextlib.contextmanager
    def _silenced(self, silence: dict[str, Any] | None):
        """For one call, make rank ``silence["rank"]`` publish none of its signals
        (``flashdmoe.cuda_backend.debug.silent_rank``) with a ``silence["timeout_ms"]`` watchdog; the
        previous knob values are restored afterwards."""
        if silence is None:
            yield
            return
        if self.backend != "cuda" or (self.world_size or 1) < 2:
            raise ValueError(f"silence={silence!r}: needs the cuda backend with world_size >= 2 (got backend "
                             f"{self.backend!r}, world_size {self.world_size})")
        if not isinstance(silence, dict) or set(silence) != {"rank", "timeout_ms"}:
            raise ValueError(f"silence={silence!r}: expected {{'rank': r, 'timeout_ms': t}}")
        rank, timeout_ms = silence["rank"], silence["timeout_ms"]
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"silence['rank']={rank!r}: expected an integer in [0, {self.world_size})")
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int) or timeout_ms < 1:
            raise ValueError(f"silence['timeout_ms']={timeout_ms!r}: expected an integer >= 1")
        from flashdmoe import cuda_backend

        knobs = cuda_backend.debug
        if not hasattr(knobs, "silent_rank"):
            raise BackendUnavailable("flashdmoe.cuda_backend.debug has no silent_rank knob in this build")
        saved = (knobs.silent_rank, knobs.timeout_ms)
        knobs.silent_rank, knobs.timeout_ms = rank, timeout_ms
        try:
            yield
        finally:
            knobs.silent_rank, knobs.timeout_ms = saved

    def _kernel_traffic(self) -> dict[str, Any] | None:
        """This rank's entry of the traffic of this process's latest fused launch
        (``flashdmoe.last_report().traffic()``), or ``None`` where no fused launch ran."""
        import flashdmoe

        report = flashdmoe.last_report()
        entries = None if report is None else report.traffic()
        if not entries:
            return None
        for entry in entries:
            if isinstance(entry, dict) and entry.get("rank") == self.rank:
                return dict(entry)
        return None

    def step(self, step: int, crash_at: str | None = None, silence: dict[str, Any] | None = None,
             stall_s: float | None = None) -> dict[str, Any]:
        """One timed forward + backward on seeded data (:func:`flashdmoe.config.make_tokens` and
        :func:`flashdmoe.job.data.output_gradient` of ``(rank, step)``). Collective.

        Args:
            step: step index (selects the data).
            crash_at: fault injection for tests: one of :data:`CRASH_POINTS`.
            stall_s: with ``crash_at="stall"``, how long to sleep before the forward (default
                :data:`DEFAULT_STALL_S`).
            silence: test knob, ``{"rank": r, "timeout_ms": t}`` (cuda backend, several ranks): for this
                step rank ``r`` publishes none of its signals and the watchdog waits ``t`` ms, so every rank
                raises ``KernelTimeout`` (caught, recorded in :meth:`fault_reports`, re-raised).

        Returns:
            This rank's entry of the step record (:func:`flashdmoe.job.results.rank_step_entry`): ``rank``,
            ``tokens``, ``forward_ms``, ``backward_ms``, ``latency_ms``, ``dropped``, ``bytes_sent``,
            ``rows_sent_remote``, ``dispatch_bytes``, ``combine_bytes``, ``nvshmem_bytes``, ``payload_efficiency``,
            ``traffic_source``. ``bytes_sent``: gloo: every byte this rank handed
            to other ranks (forward and backward); cuda: the forward kernel's ``dispatch_bytes +
            combine_bytes`` (``flashdmoe.cuda_backend.last_traffic``; ``traffic_source`` "kernel"), or, where
            the kernel does not report traffic, the dispatch payload estimated from the routing
            (``traffic_source`` "estimate"). ``payload_efficiency`` = ``dispatch_bytes / (rows routed to
            other ranks * H * itemsize)`` as the kernel reports it; ``None`` on gloo, on estimates, and when no
            row left the rank. ``dispatch_bytes`` / ``combine_bytes`` are ``None`` where not reported.
        """
        config = self._require_setup()
        if crash_at is not None and crash_at not in CRASH_POINTS:
            raise ValueError(f"crash_at={crash_at!r}: expected None or one of {CRASH_POINTS}")
        if stall_s is not None and (isinstance(stall_s, bool) or not isinstance(stall_s, (int, float))
                                    or not 0 < stall_s < math.inf):
            raise ValueError(f"stall_s={stall_s!r}: expected a finite number of seconds > 0")
        x = make_tokens(config, self.rank, step, device=self.device).requires_grad_()
        dy = output_gradient(config, self.rank, step, device=self.device)
        bytes_before = self._bytes_sent()
        rows_before = self.traffic.rows_sent_remote if self.traffic is not None else 0
        self._zero_grads()
        if crash_at == "before_forward":
            os._exit(17)
        if crash_at == "stall":  # a slow rank: its peers wait for it in the forward's exchange
            time.sleep(DEFAULT_STALL_S if stall_s is None else stall_s)
        with self._silenced(silence), self._fault_guard("step", step):
            if crash_at == "kernel_timeout":
                raise KernelTimeout(f"injected by the test (crash_at='kernel_timeout') on rank {self.rank}, "
                                    "before the forward")
            self._synchronize()
            started = time.perf_counter()
            y, aux = self._layer(x)
            self._synchronize()
            forward_s = time.perf_counter() - started
            kernel_traffic = self._kernel_traffic() if self.backend == "cuda" else None
            if crash_at == "after_forward":
                os._exit(17)  # peers are now blocked in the backward exchange with this rank
            if crash_at == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # hung, alive: nothing answers until it is killed
            started = time.perf_counter()
            y.backward(dy)
            self._synchronize()
            backward_s = time.perf_counter() - started
        dispatch_bytes = combine_bytes = nvshmem_bytes = efficiency = None
        if self.traffic is not None:
            bytes_sent = self._bytes_sent() - bytes_before
            rows_remote = self.traffic.rows_sent_remote - rows_before
            source = "gloo"
        elif kernel_traffic is not None:
            dispatch_bytes = int(kernel_traffic.get("dispatch_bytes", 0))
            combine_bytes = int(kernel_traffic.get("combine_bytes", 0))
            bytes_sent = dispatch_bytes + combine_bytes
            nvshmem_bytes = (int(kernel_traffic.get("nvshmem_dispatch_bytes", 0))
                             + int(kernel_traffic.get("nvshmem_combine_bytes", 0)))
            rows_remote = int(kernel_traffic.get("rows_routed_remote", 0))
            efficiency = kernel_traffic.get("payload_efficiency")
            if isinstance(efficiency, (int, float)) and math.isfinite(efficiency) and rows_remote > 0:
                efficiency = float(efficiency)
            else:
                efficiency = None
            source = "kernel"
        else:
            bytes_sent, rows_remote = self._estimated_gpu_payload(x.detach(), aux)
            source = "estimate"
        return rank_step_entry(rank=self.rank, tokens=int(x.shape[0]), forward_ms=forward_s * 1e3,
                               backward_ms=backward_s * 1e3, latency_ms=(forward_s + backward_s) * 1e3,
                               dropped=int(aux.dropped), bytes_sent=int(bytes_sent), rows_sent_remote=int(rows_remote),
                               dispatch_bytes=dispatch_bytes, combine_bytes=combine_bytes, nvshmem_bytes=nvshmem_bytes,
                               payload_efficiency=efficiency, traffic_source=source)

    def _estimated_gpu_payload(self, x: torch.Tensor, aux) -> tuple[int, int]:
        """Forward dispatch payload on the GPU path, from the routing: rows of kept choices whose expert
        lives on another rank, times ``H * itemsize`` (what a payload-efficient kernel sends)."""
        config = self.config
        with torch.no_grad():
            routing = reference.route(x, self.router_weight, config.top_k, config.normalize_topk)
            capacity = reference.expert_capacity(x.shape[0], config.top_k, config.experts, config.capacity_factor)
            keep = reference.keep_mask(routing.experts, config.experts, capacity)
            owner = routing.experts // config.local_experts
            rows = int(((owner != self.rank) & keep).sum())
        return rows * config.hidden * x.element_size(), rows

    # -- reporting ---------------------------------------------------------------------------------

    def peak_memory_bytes(self) -> int:
        """This process's peak memory so far: CUDA max allocated on a GPU, else the max RSS."""
        self._require_setup()
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        # ru_maxrss is KiB on Linux, bytes on macOS
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

    def ping(self) -> int:
        """Liveness probe: this actor's pid."""
        return os.getpid()

    def teardown(self) -> bool:
        """Leave the team and free it (the actor can be set up again afterwards). On an NVSHMEM team this
        is collective (freeing symmetric memory and finalising NVSHMEM synchronise all ranks): the driver
        sends it to every rank, also after a ``KernelTimeout`` (the kernel has exited on every rank then).

        Returns:
            ``True`` if a team was left (``False`` if there was none).
        """
        had_team = self.backend is not None
        self._pending = None
        if self._store_socket is not None:  # opened for a team that never formed
            self._store_socket.close()
            self._store_socket = None
        if self.backend == "gloo":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        elif self.team is not None:
            self.team.close()
        self.team = None
        self.config = None
        self.backend = None
        return had_team


#: The actor class. ``MoEWorker`` itself stays a plain module-level class so that Ray pickles it by
#: reference (workers import this module) instead of by value, which would drag module globals along.
RemoteMoEWorker = ray.remote(MoEWorker)
