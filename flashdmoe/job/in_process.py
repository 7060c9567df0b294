"""Every rank of the main job inside this process, no Ray: :class:`InProcessRanks`.

With one rank the layer runs through :func:`flashdmoe.moe` (the fused kernel on CUDA when built, else
the reference); with several it runs the expert-parallel reference
:func:`flashdmoe.reference.moe_expert_parallel`, each rank holding only its expert shard.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from flashdmoe import api, reference
from flashdmoe.config import MoEConfig, make_tokens, make_weights
from flashdmoe.errors import BackendUnavailable
from flashdmoe.job.data import StepOutputs, output_gradient
from flashdmoe.job.executor import RankExecutor
from flashdmoe.job.results import rank_step_entry, step_record, worker_entry

__all__ = ["InProcessRanks"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class InProcessRanks(RankExecutor):
    """``config.world_size`` ranks emulated in this process.

    Args:
        config: the layer and run.
        backend: ``auto``, ``reference`` or ``cuda`` for one rank; several ranks run the expert-parallel
            reference (``cuda`` is refused there: the multi-rank kernel needs a team of processes).
        device: torch device for every tensor (default: CUDA when available and the backend is not
            ``reference``, else CPU).

    Raises:
        ValueError: unknown backend.
        BackendUnavailable: ``cuda`` asked for and unusable here, or with several ranks.
    """

    kind = "in-process"

    def __init__(self, config: MoEConfig, *, backend: str = "auto", device: str | torch.device | None = None) -> None:
        started = time.perf_counter()
        if backend not in api.BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {', '.join(api.BACKENDS)}")
        if device is None:
            device = "cuda" if backend != "reference" and torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"device={device!r}: {error}") from None
        if config.world_size > 1:
            if backend == "cuda":
                raise BackendUnavailable(
                    f"backend='cuda' with world_size={config.world_size}: in one process the ranks run the "
                    "expert-parallel reference; the multi-rank fused kernel runs on Ray workers (drop --in-process)")
            resolved, transport = "reference", "emulated"
        else:
            probe = torch.empty((0, config.hidden), dtype=config.torch_dtype, device=device)
            resolved, transport = api.resolve_backend(probe, backend), "single"
        self.config = config
        self.backend = resolved
        self.requested_backend = backend
        self.transport = transport
        self.device = device
        self.faults = []
        self.router_weight = make_weights(config, experts=[], device=device)[0].requires_grad_()
        self.w1s, self.w2s = [], []
        for rank in range(config.world_size):
            _, w1, w2 = make_weights(config, experts=config.expert_range(rank), device=device)
            self.w1s.append(w1.requires_grad_())
            self.w2s.append(w2.requires_grad_())
        self.startup_s = time.perf_counter() - started

    def _parameters(self) -> list[torch.Tensor]:
        return [self.router_weight, *self.w1s, *self.w2s]

    def _layer(self, xs: Sequence[torch.Tensor]):
        """(list of ``y_r [T_r, H]``, list of ``MoEAux_r``)."""
        config = self.config
        options = dict(top_k=config.top_k, activation=config.activation, normalize_topk=config.normalize_topk,
                       capacity_factor=config.capacity_factor, return_aux=True)
        if config.world_size == 1:
            y, aux = api.moe(xs[0], self.router_weight, self.w1s[0], self.w2s[0], backend=self.backend, **options)
            return [y], [aux]
        return reference.moe_expert_parallel(list(xs), self.router_weight, self.w1s, self.w2s, **options)

    def _gradients(self, ys, xs, output_grads) -> list[torch.Tensor]:
        leaves = [*xs, *self._parameters()]
        grads = torch.autograd.grad(ys, leaves, list(output_grads), allow_unused=True)
        return [torch.zeros_like(leaf) if grad is None else grad for grad, leaf in zip(grads, leaves)]

    def step(self, step: int, *, crash: dict[str, Any] | None = None) -> dict[str, Any]:
        if crash is not None:
            raise ValueError(f"crash={crash!r}: fault injection needs ranks in separate processes (the Ray executor)")
        config, device = self.config, self.device
        xs = [make_tokens(config, rank, step, device=device).requires_grad_() for rank in range(config.world_size)]
        output_grads = [output_gradient(config, rank, step, device=device) for rank in range(config.world_size)]
        _synchronize(device)
        started = time.perf_counter()
        ys, auxes = self._layer(xs)
        _synchronize(device)
        forward_s = time.perf_counter() - started
        started = time.perf_counter()
        self._gradients(ys, xs, output_grads)
        _synchronize(device)
        backward_s = time.perf_counter() - started
        if config.world_size == 1:  # one rank: the step's times are that rank's
            timed = dict(forward_ms=forward_s * 1e3, backward_ms=backward_s * 1e3,
                         latency_ms=(forward_s + backward_s) * 1e3)
            return step_record(step, [rank_step_entry(rank=0, tokens=int(xs[0].shape[0]), dropped=int(auxes[0].dropped),
                                                      **timed)])
        ranks = [rank_step_entry(rank=rank, tokens=int(x.shape[0]), dropped=int(aux.dropped))
                 for rank, (x, aux) in enumerate(zip(xs, auxes))]
        return step_record(step, ranks, forward_ms=forward_s * 1e3, backward_ms=backward_s * 1e3)

    def forward_backward(self, xs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor]) -> StepOutputs:
        world = self.config.world_size
        if len(xs) != world or len(output_grads) != world:
            raise ValueError(f"xs, output_grads: expected {world} tensors each (one per rank), got "
                             f"{len(xs)} and {len(output_grads)}")
        xs = [x.detach().to(device=self.device, dtype=self.config.torch_dtype).requires_grad_() for x in xs]
        output_grads = [dy.detach().to(device=self.device, dtype=self.config.torch_dtype) for dy in output_grads]
        ys, _ = self._layer(xs)
        grads = [grad.detach().cpu() for grad in self._gradients(ys, xs, output_grads)]
        return StepOutputs(ys=[y.detach().cpu() for y in ys], dxs=grads[:world], d_router_weight=grads[world],
                           d_w1s=grads[world + 1:2 * world + 1], d_w2s=grads[2 * world + 1:])

    def workers(self) -> list[dict[str, Any]]:
        device_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        mps = {"pipe_dir": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), "log_dir": os.environ.get("CUDA_MPS_LOG_DIRECTORY"),
               "thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}
        return [worker_entry(rank=rank, local_rank=rank, pid=os.getpid(), hostname=socket.gethostname(), device=str(self.device),
                             device_name=device_name, gpu_ids=[], generation=1, mps=dict(mps))
                for rank in range(self.config.world_size)]

    def peak_memory_bytes(self) -> tuple[list[int | None], int | None]:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:  # ru_maxrss is KiB on Linux, bytes on macOS
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        world = self.config.world_size
        return ([int(peak)] if world == 1 else [None] * world), int(peak)
