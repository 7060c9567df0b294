"""``MoEWorker``: the Ray actor that is one rank of the expert-parallel MoE (DESIGN.md §6).

One actor per GPU (``num_gpus=1``) or, on a cluster without GPUs, per CPU (``num_cpus=1``); the driver
(:mod:`ray_actors.driver`) places them in a STRICT_PACK placement group, one bundle each. A worker:

1. joins the team (:meth:`MoEWorker.setup`):
   - CPU: ``torch.distributed`` gloo over a TCP store on ``127.0.0.1:<port>`` (rank 0's node; STRICT_PACK
     keeps every rank on that node), and runs :func:`flashdmoe.ep_gloo.expert_parallel_moe`;
   - GPU: ``flashdmoe.team.Team.nvshmem(unique_id, rank, world_size)`` with the 128-byte NVSHMEM unique id
     that rank 0 made (:meth:`MoEWorker.make_unique_id`), and runs
     ``flashdmoe.api.moe(..., backend="cuda", team=team)``;
2. builds its expert shard from the config's seed (:func:`flashdmoe.config.make_weights`);
3. runs :meth:`forward` / :meth:`backward` on batches the driver sends, or :meth:`step` on seeded
   batches (:func:`flashdmoe.config.make_tokens`, :func:`upstream_gradient`), timing each;
4. reports :meth:`metrics` and frees everything in :meth:`teardown`.

Every collective call must be issued by all ranks of the team; the driver guarantees that by sending
each call to every worker.
"""

from __future__ import annotations

import datetime
import importlib
import os
import resource
import socket
import statistics
import sys
import time
from typing import Any

import ray
import torch

from flashdmoe import reference
from flashdmoe.config import MoEConfig, derive_seed, make_tokens, make_weights, seeded_randn
from flashdmoe.errors import BackendUnavailable
from flashdmoe.runner import forward_flops

__all__ = ["CRASH_POINTS", "GPU_ENVIRONMENT", "MoEWorker", "RemoteMoEWorker", "upstream_gradient"]

#: Environment for GPU processes: no NVLink SHARP / multicast objects (DESIGN.md §4).
GPU_ENVIRONMENT = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

#: Crash points for fault-injection tests (:meth:`MoEWorker.step`): the process exits there.
CRASH_POINTS = ("before_forward", "after_forward")


def upstream_gradient(config: MoEConfig, rank: int, step: int) -> torch.Tensor:
    """Seeded ``dL/dy`` fed to backward by :meth:`MoEWorker.step`: ``[tokens_per_rank, H]``, standard
    normal, config dtype (the same stream as ``flashdmoe.runner``'s output gradients)."""
    return seeded_randn((config.tokens_per_rank, config.hidden), derive_seed(config.seed, "output-grad", rank, step),
                        dtype=config.torch_dtype)


def _gpu_team_class():
    """``flashdmoe.team.Team`` if it offers the NVSHMEM constructors, else a clear error."""
    try:
        from flashdmoe.team import Team
    except ImportError as error:
        raise BackendUnavailable(f"flashdmoe.team cannot be imported: {error}") from error
    missing = [name for name in ("nvshmem", "make_unique_id") if not callable(getattr(Team, name, None))]
    if missing:
        raise BackendUnavailable(
            f"flashdmoe.team.Team lacks {', '.join(missing)}: this build has no multi-process NVSHMEM team, so "
            "the GPU Ray path cannot run; use backend='gloo' (the CPU expert-parallel path)")
    return Team


class MoEWorker:
    """One rank. The driver creates it as a Ray actor (:data:`RemoteMoEWorker`); all methods run in the
    actor process."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.world_size: int | None = None
        self.config: MoEConfig | None = None
        self.backend: str | None = None
        self.team = None
        self.traffic = None
        self.device = torch.device("cpu")
        self.records: list[dict[str, Any]] = []
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (x leaf, y) awaiting backward

    # -- rendezvous ------------------------------------------------------------------------------

    def node_info(self) -> dict[str, Any]:
        """Where this actor runs: ``pid``, ``hostname``, Ray ``node_id``, assigned ``gpu_ids``, ``cuda``."""
        return {"pid": os.getpid(), "hostname": socket.gethostname(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()], "cuda": torch.cuda.is_available()}

    def free_port(self) -> int:
        """A TCP port free on 127.0.0.1 of this node, for the gloo store rank 0 will host."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    def make_unique_id(self) -> bytes:
        """Rank 0 only: a fresh 128-byte NVSHMEM unique id for :meth:`setup` on every rank."""
        os.environ.update(GPU_ENVIRONMENT)
        return bytes(_gpu_team_class().make_unique_id())

    def setup(self, rank: int, world_size: int, config_dict: dict[str, Any],
              rendezvous: dict[str, Any]) -> dict[str, Any]:
        """Join the team and build this rank's expert shard. Collective: the driver submits it to every
        rank before waiting on any (team initialisation blocks until all ranks arrive).

        Args:
            rank, world_size: this rank and ``P``.
            config_dict: :meth:`MoEConfig.to_dict` of the layer (``world_size`` equal to ``P``).
            rendezvous: ``{"backend": "gloo", "address": "127.0.0.1", "port": int, "timeout_s": float}`` or
                ``{"backend": "cuda", "unique_id": bytes}``.

        Returns:
            :meth:`node_info` plus ``rank``, ``backend`` and ``device``.
        """
        config = MoEConfig.from_dict(config_dict)
        if config.world_size != world_size or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: expected 0 <= rank < world_size == "
                             f"config.world_size={config.world_size}")
        backend = rendezvous.get("backend")
        if backend == "gloo":
            import torch.distributed as dist

            from flashdmoe.ep_gloo import TrafficCounter

            # loopback only: every rank is on this node (STRICT_PACK)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group("gloo", init_method=f"tcp://{rendezvous['address']}:{rendezvous['port']}",
                                    rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=float(rendezvous.get("timeout_s", 120))))
            self.traffic = TrafficCounter()
            self.device = torch.device("cpu")
        elif backend == "cuda":
            os.environ.update(GPU_ENVIRONMENT)
            if not torch.cuda.is_available():
                raise BackendUnavailable(f"rank {rank}: backend 'cuda' but this actor sees no CUDA device "
                                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            torch.cuda.set_device(0)  # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU
            self.device = torch.device("cuda", 0)
            if world_size == 1:
                from flashdmoe.team import Team

                self.team = Team.single()
            else:
                self.team = _gpu_team_class().nvshmem(rendezvous["unique_id"], rank, world_size)
        else:
            raise ValueError(f"rendezvous['backend']={backend!r}: expected 'gloo' or 'cuda'")
        self.rank, self.world_size, self.config, self.backend = rank, world_size, config, backend
        # torch imports this (and sympy, ~1-2 s) lazily inside the first backward with an explicit
        # gradient; importing it here keeps that one-time cost out of the first step's timing
        importlib.import_module("torch.fx.experimental.symbolic_shapes")
        router_weight, w1, w2 = make_weights(config, experts=config.expert_range(rank), device=self.device)
        self.router_weight = router_weight.requires_grad_()
        self.w1 = w1.requires_grad_()
        self.w2 = w2.requires_grad_()
        self.records = []
        return {**self.node_info(), "rank": rank, "backend": backend, "device": str(self.device)}

    # -- compute ---------------------------------------------------------------------------------

    def _require_setup(self) -> MoEConfig:
        if self.config is None:
            raise RuntimeError("MoEWorker: call setup() before running the layer")
        return self.config

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _layer(self, x: torch.Tensor):
        """``(y [T, H], MoEAux)`` of this rank's tokens through the team's backend (collective)."""
        config = self.config
        options = dict(top_k=config.top_k, activation=config.activation, normalize_topk=config.normalize_topk,
                       capacity_factor=config.capacity_factor, return_aux=True)
        if self.backend == "gloo":
            from flashdmoe.ep_gloo import expert_parallel_moe

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``y [T, H]`` (config dtype, on CPU) of this rank's tokens ``x [T, H]``; keeps the graph for
        :meth:`backward`. Collective."""
        self._require_setup()
        x = self._check_batch("x", x).requires_grad_()
        y, _ = self._layer(x)
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
        y.backward(dy)
        return {"dx": x.grad.detach().cpu(), "router_weight": self.router_weight.grad.detach().cpu(),
                "w1": self.w1.grad.detach().cpu(), "w2": self.w2.grad.detach().cpu(),
                "router_grad_summed": self.backend == "gloo"}

    def _zero_grads(self) -> None:
        for tensor in (self.router_weight, self.w1, self.w2):
            tensor.grad = None

    def _bytes_sent(self) -> int:
        return self.traffic.bytes_sent if self.traffic is not None else 0

    def step(self, step: int, crash_at: str | None = None) -> dict[str, Any]:
        """One timed forward + backward on seeded data (:func:`flashdmoe.config.make_tokens` and
        :func:`upstream_gradient` of ``(rank, step)``). Collective.

        Args:
            step: step index (selects the data).
            crash_at: fault injection for tests: one of :data:`CRASH_POINTS`, where the process exits.

        Returns:
            ``{"rank", "step", "tokens", "forward_ms", "backward_ms", "latency_ms", "bytes_sent",
            "rows_sent_remote", "dropped"}``; also kept for :meth:`metrics`.
        """
        config = self._require_setup()
        if crash_at is not None and crash_at not in CRASH_POINTS:
            raise ValueError(f"crash_at={crash_at!r}: expected None or one of {CRASH_POINTS}")
        x = make_tokens(config, self.rank, step, device=self.device).requires_grad_()
        dy = upstream_gradient(config, self.rank, step).to(self.device)
        bytes_before = self._bytes_sent()
        rows_before = self.traffic.rows_sent_remote if self.traffic is not None else 0
        self._zero_grads()
        if crash_at == "before_forward":
            os._exit(17)
        self._synchronize()
        started = time.perf_counter()
        y, aux = self._layer(x)
        self._synchronize()
        forward_s = time.perf_counter() - started
        if crash_at == "after_forward":
            os._exit(17)  # peers are now blocked in the backward exchange with this rank
        started = time.perf_counter()
        y.backward(dy)
        self._synchronize()
        backward_s = time.perf_counter() - started
        if self.traffic is not None:
            bytes_sent = self._bytes_sent() - bytes_before
            rows_remote = self.traffic.rows_sent_remote - rows_before
        else:
            bytes_sent, rows_remote = self._estimated_gpu_payload(x.detach(), aux)
        record = {"rank": self.rank, "step": step, "tokens": int(x.shape[0]), "forward_ms": forward_s * 1e3,
                  "backward_ms": backward_s * 1e3, "latency_ms": (forward_s + backward_s) * 1e3,
                  "bytes_sent": int(bytes_sent), "rows_sent_remote": int(rows_remote), "dropped": int(aux.dropped)}
        self.records.append(record)
        return record

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

    def metrics(self) -> dict[str, Any]:
        """Summary of this actor's :meth:`step` records: medians of ``forward_ms``, ``backward_ms``,
        ``latency_ms``; ``tokens_per_s``; ``tflops`` (backward counted as twice the forward FLOPs);
        ``bytes_sent`` in total; ``peak_memory_bytes`` (CUDA max allocated, or the process's max RSS)."""
        config = self._require_setup()
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:  # ru_maxrss is KiB on Linux, bytes on macOS
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        summary: dict[str, Any] = {"rank": self.rank, "backend": self.backend, "device": str(self.device),
                                   "steps": len(self.records), "peak_memory_bytes": int(peak),
                                   "bytes_sent": sum(record["bytes_sent"] for record in self.records)}
        if self.records:
            latency = statistics.median(record["latency_ms"] for record in self.records)
            summary.update(
                forward_ms=statistics.median(record["forward_ms"] for record in self.records),
                backward_ms=statistics.median(record["backward_ms"] for record in self.records),
                latency_ms=latency,
                tokens_per_s=config.tokens_per_rank / (latency / 1e3) if latency > 0 else None,
                tflops=3 * forward_flops(config, config.tokens_per_rank) / (latency / 1e3) / 1e12
                if latency > 0 else None)
        return summary

    def ping(self) -> int:
        """Liveness probe: this actor's pid."""
        return os.getpid()

    def teardown(self) -> None:
        """Leave the team and free it (the actor can be set up again afterwards)."""
        self._pending = None
        if self.backend == "gloo":
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        elif self.team is not None:
            self.team.close()
        self.team = None
        self.config = None
        self.backend = None


#: The actor class. ``MoEWorker`` itself stays a plain module-level class so that Ray pickles it by
#: reference (workers import this module) instead of by value, which would drag module globals along.
RemoteMoEWorker = ray.remote(MoEWorker)
