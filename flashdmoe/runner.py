"""The main job run in one process: ``world_size`` ranks emulated, forward + backward per step.

``flashdmoe run`` calls :func:`run_in_process`. With one rank the layer runs through
:func:`flashdmoe.moe` (fused kernel on CUDA when built, else the reference); with several ranks it
runs the expert-parallel reference :func:`flashdmoe.reference.moe_expert_parallel`, each rank
holding only its expert shard. Verification recomputes every rank's output and all gradients
with the single-rank reference on the full weights (float64 for float32 configs), an
independent code path.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from flashdmoe import api, reference
from flashdmoe.config import MoEConfig, derive_seed, make_tokens, make_weights, seeded_randn
from flashdmoe.errors import BackendUnavailable

__all__ = ["RESULTS_FILENAME", "forward_flops", "run_in_process", "tolerance_for", "write_results"]

RESULTS_FILENAME = "results.json"

#: Allowed error relative to the largest reference magnitude (max |got - want| / max |want|), by
#: dtype. float32 on the CUDA backend runs as TF32 (10-bit mantissa), hence looser.
_TOLERANCES = {
    ("float32", "reference"): 1e-4,
    ("float32", "cuda"): 2e-2,
    ("float16", "reference"): 5e-3,
    ("float16", "cuda"): 1e-2,
    ("bfloat16", "reference"): 3e-2,
    ("bfloat16", "cuda"): 3e-2,
}


def tolerance_for(dtype: str, backend: str) -> float:
    """Verification tolerance for a config dtype name and a resolved backend name."""
    return _TOLERANCES[(dtype, "cuda" if backend == "cuda" else "reference")]


def forward_flops(config: MoEConfig, tokens: int) -> int:
    """Forward FLOPs for ``tokens`` tokens: ``2*T*k*H*I*(3 if swiglu else 2) + 2*T*H*E`` (DESIGN.md §7)."""
    matmuls = 3 if config.activation == "swiglu" else 2
    return 2 * tokens * config.top_k * config.hidden * config.ffn * matmuls + 2 * tokens * config.hidden * config.experts


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 for empty tensors)."""
    if want.numel() == 0:
        return 0.0
    got64, want64 = got.detach().to(torch.float64).cpu(), want.detach().to(torch.float64).cpu()
    scale = float(want64.abs().max())
    error = float((got64 - want64).abs().max())
    return error / scale if scale > 0 else error


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _choose_device(backend: str, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if backend != "reference" and torch.cuda.is_available() else "cpu")


class _Ranks:
    """Leaf tensors of every emulated rank: replicated router, each rank's expert shard."""

    def __init__(self, config: MoEConfig, device: torch.device) -> None:
        self.config = config
        self.router_weight = make_weights(config, experts=[], device=device)[0].requires_grad_()
        self.w1s, self.w2s = [], []
        for rank in range(config.world_size):
            _, w1, w2 = make_weights(config, experts=config.expert_range(rank), device=device)
            self.w1s.append(w1.requires_grad_())
            self.w2s.append(w2.requires_grad_())

    def parameters(self) -> list[torch.Tensor]:
        return [self.router_weight, *self.w1s, *self.w2s]


def _system_forward(config: MoEConfig, ranks: _Ranks, xs: list[torch.Tensor], backend: str):
    """Forward of the system under test. Returns (list of y_r [T, H], list of MoEAux_r)."""
    options = dict(top_k=config.top_k, activation=config.activation, normalize_topk=config.normalize_topk,
                   capacity_factor=config.capacity_factor, return_aux=True)
    if config.world_size == 1:
        y, aux = api.moe(xs[0], ranks.router_weight, ranks.w1s[0], ranks.w2s[0], backend=backend, **options)
        return [y], [aux]
    return reference.moe_expert_parallel(xs, ranks.router_weight, ranks.w1s, ranks.w2s, **options)


def _oracle_dtype(config: MoEConfig) -> torch.dtype:
    """float64 for float32 configs; half-precision inputs stay as they are, because the reference
    already computes them in float32 (the contract's router precision) and a float64 router could
    pick a different expert on near-ties among many tokens."""
    return torch.float64 if config.torch_dtype == torch.float32 else config.torch_dtype


def _oracle_name(config: MoEConfig) -> str:
    precision = "float64" if _oracle_dtype(config) == torch.float64 else f"{config.dtype} inputs, float32 compute"
    return f"flashdmoe.reference.moe per rank on the full weights ({precision})"


def _oracle(config: MoEConfig, ranks: _Ranks, xs: list[torch.Tensor], output_grads: list[torch.Tensor]):
    """Per-rank single-rank reference on the full weights (see :func:`_oracle_dtype`).

    Per rank is exact for capacity too: capacity is per (source rank, expert) pair,
    ``ceil(c * T_r * k / E)``, which is what one rank's own call with all ``E`` experts applies.
    Returns (ys, dxs, d_router [E, H], d_w1 [E, H, .], d_w2 [E, I, H]) in the oracle dtype.
    """
    dtype = _oracle_dtype(config)
    router = ranks.router_weight.detach().to(dtype).requires_grad_()
    w1 = torch.cat([shard.detach() for shard in ranks.w1s]).to(dtype).requires_grad_()
    w2 = torch.cat([shard.detach() for shard in ranks.w2s]).to(dtype).requires_grad_()
    xs_oracle = [x.detach().to(dtype).requires_grad_() for x in xs]
    ys = [reference.moe(x, router, w1, w2, top_k=config.top_k, activation=config.activation,
                        normalize_topk=config.normalize_topk, capacity_factor=config.capacity_factor)
          for x in xs_oracle]
    leaves = [*xs_oracle, router, w1, w2]
    grads = torch.autograd.grad(ys, leaves, [grad.to(dtype) for grad in output_grads], allow_unused=True)
    grads = [torch.zeros_like(leaf) if grad is None else grad for grad, leaf in zip(grads, leaves)]
    world = config.world_size
    return [y.detach() for y in ys], list(grads[:world]), grads[world], grads[world + 1], grads[world + 2]


def _compare(ys, dxs, d_router, d_w1s, d_w2s, oracle) -> dict[str, float]:
    want_ys, want_dxs, want_router, want_w1, want_w2 = oracle
    return {
        "y": max(_relative_error(got, want) for got, want in zip(ys, want_ys)),
        "dx": max(_relative_error(got, want) for got, want in zip(dxs, want_dxs)),
        "d_router_weight": _relative_error(d_router, want_router),
        "d_w1": _relative_error(torch.cat(list(d_w1s)), want_w1),
        "d_w2": _relative_error(torch.cat(list(d_w2s)), want_w2),
    }


def _environment(device: torch.device) -> dict[str, Any]:
    from flashdmoe import __version__

    environment = {"flashdmoe": __version__, "torch": torch.__version__, "python": platform.python_version(),
                   "device": str(device)}
    if device.type == "cuda":
        environment["device_name"] = torch.cuda.get_device_name(device)
    return environment


def run_in_process(config: MoEConfig, output_dir: str | Path | None = "results", *, backend: str = "auto",
                   device: str | torch.device | None = None, verify: bool = True,
                   progress: bool = True) -> dict[str, Any]:
    """Run ``config.steps`` forward + backward steps of ``config.world_size`` emulated ranks.

    Each step feeds every rank ``make_tokens(config, rank, step)`` (``[tokens_per_rank, H]``) and
    back-propagates seeded random output gradients (``[tokens_per_rank, H]``, config dtype).

    Args:
        config: the layer and run.
        output_dir: where ``results.json`` is written (created if needed); ``None`` writes nothing.
        backend: ``auto``, ``reference`` or ``cuda`` for a one-rank run; several ranks run the
            expert-parallel reference (``cuda`` is refused there until the multi-rank kernel lands).
        device: torch device for all tensors (default: CUDA when available and the backend is
            not ``reference``, else CPU).
        verify: compare every step's outputs and gradients with the per-rank reference.
        progress: show a progress bar on a terminal.

    Returns:
        The results dict also written as JSON: ``config``, ``run`` (backend, device, mode),
        ``steps`` (per step ``forward_ms``, ``backward_ms``, ``tokens_per_s``, ``tflops``,
        ``dropped_choices``, ``errors``, ``max_error``, ``passed``), ``metrics`` (medians over steps
        after the first, which includes warm-up, or over the only step), ``verification``,
        ``environment`` and ``created``.

    Raises:
        ValueError: unknown backend, or ``cuda`` asked for with ``world_size > 1``.
        BackendUnavailable: ``cuda`` asked for and unusable here.
    """
    if backend not in api.BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(api.BACKENDS)}")
    device = _choose_device(backend, device)
    if config.world_size > 1:
        if backend == "cuda":
            raise BackendUnavailable(
                f"backend='cuda' with world_size={config.world_size}: the in-process run emulates ranks with "
                "the expert-parallel reference; the multi-rank fused kernel is not available here yet"
            )
        resolved, mode = "reference", "expert-parallel reference, ranks emulated in one process"
    else:
        probe = torch.empty((0, config.hidden), dtype=config.torch_dtype, device=device)
        resolved, mode = api.resolve_backend(probe, backend), "single rank via flashdmoe.moe"
    tolerance = tolerance_for(config.dtype, resolved)
    ranks = _Ranks(config, device)
    tokens_per_step = config.tokens_per_rank * config.world_size
    flops_per_step = forward_flops(config, tokens_per_step)

    step_records: list[dict[str, Any]] = []
    for step in tqdm(range(config.steps), desc="flashdmoe run", unit="step", file=sys.stderr,
                     disable=None if progress else True):
        xs = [make_tokens(config, rank, step, device=device).requires_grad_()
              for rank in range(config.world_size)]
        output_grads = [seeded_randn((config.tokens_per_rank, config.hidden),
                                     derive_seed(config.seed, "output-grad", rank, step),
                                     dtype=config.torch_dtype, device=device)
                        for rank in range(config.world_size)]
        _synchronize(device)
        started = time.perf_counter()
        ys, auxes = _system_forward(config, ranks, xs, resolved)
        _synchronize(device)
        forward_s = time.perf_counter() - started
        started = time.perf_counter()
        grads = torch.autograd.grad(ys, [*xs, *ranks.parameters()], output_grads, allow_unused=True)
        _synchronize(device)
        backward_s = time.perf_counter() - started
        grads = [torch.zeros_like(leaf) if grad is None else grad
                 for grad, leaf in zip(grads, [*xs, *ranks.parameters()])]
        world = config.world_size
        dxs, d_router = grads[:world], grads[world]
        d_w1s, d_w2s = grads[world + 1: 2 * world + 1], grads[2 * world + 1:]

        record: dict[str, Any] = {
            "step": step,
            "forward_ms": forward_s * 1e3,
            "backward_ms": backward_s * 1e3,
            "tokens": tokens_per_step,
            "tokens_per_s": tokens_per_step / forward_s if forward_s > 0 else None,
            "tflops": flops_per_step / forward_s / 1e12 if forward_s > 0 else None,
            "dropped_choices": int(sum(int(aux.dropped) for aux in auxes)),
            "errors": None,
            "max_error": None,
            "passed": None,
        }
        if verify:
            errors = _compare(ys, dxs, d_router, d_w1s, d_w2s, _oracle(config, ranks, xs, output_grads))
            record["errors"] = errors
            record["max_error"] = max(errors.values())
            record["passed"] = record["max_error"] <= tolerance
        step_records.append(record)

    timed = step_records[1:] if len(step_records) > 1 else step_records

    def median(key: str) -> float | None:
        values = [record[key] for record in timed if record[key] is not None]
        return statistics.median(values) if values else None

    results: dict[str, Any] = {
        "config": config.to_dict(),
        "run": {"backend": resolved, "requested_backend": backend, "device": str(device), "mode": mode,
                "world_size": config.world_size, "steps": config.steps},
        "steps": step_records,
        "metrics": {
            "tokens_per_step": tokens_per_step,
            "forward_flops_per_step": flops_per_step,
            "forward_ms_median": median("forward_ms"),
            "backward_ms_median": median("backward_ms"),
            "tokens_per_s_median": median("tokens_per_s"),
            "tflops_median": median("tflops"),
            "steps_in_median": len(timed),
        },
        "verification": {
            "enabled": verify,
            "oracle": _oracle_name(config) if verify else None,
            "metric": "max |got - want| / max |want| over y, dx, d_router_weight, d_w1, d_w2",
            "tolerance": tolerance if verify else None,
            "max_error": max(record["max_error"] for record in step_records) if verify else None,
            "passed": all(record["passed"] for record in step_records) if verify else None,
        },
        "environment": _environment(device),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if output_dir is not None:
        results["output"] = str(write_results(results, output_dir))
    return results


def write_results(results: dict[str, Any], output_dir: str | Path) -> Path:
    """Write ``results`` as ``<output_dir>/results.json`` (directories created); returns the path."""
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RESULTS_FILENAME
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return path
