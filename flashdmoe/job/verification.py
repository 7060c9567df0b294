"""The main job's verification: every rank's output and all gradients of one step against a float64
oracle computed with :mod:`flashdmoe.reference`, independently of the system under test.

The oracle runs :func:`flashdmoe.reference.moe_fixed_routing` per rank on the full (concatenated)
weights in float64. Only the discrete choices (which ``k`` experts each token picks, and which choices
capacity drops) come from :func:`flashdmoe.reference.route` on the config-dtype values, i.e. in the
contract's router precision: a float64 router could break a near-tie between two experts the other way
and turn a rounding difference into a different expert. Per rank on the full weights is exact for
capacity too: capacity is per (source rank, expert) pair, ``ceil(c * T_r * k / E)``, what one rank's own
call with all ``E`` experts applies.

A tensor passes when ``max |got - want| / max |want|`` (every rank, every element) is within
:func:`tolerance_for` of the config's dtype and the backend that ran.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flashdmoe import numerics, reference
from flashdmoe.config import MoEConfig
from flashdmoe.job.data import StepInputs, StepOutputs, seeded_inputs

__all__ = ["METRIC", "ORACLE", "TENSORS", "compare", "oracle", "skipped", "tolerance_for", "verify_step"]

ORACLE = ("flashdmoe.reference.moe_fixed_routing per rank on the full weights in float64, experts chosen by "
          "flashdmoe.reference.route in the contract's router precision")
METRIC = "max |got - want| / max |want| per tensor over every rank (max |got - want| where want is all zero)"
#: The tensors compared, in the order reported.
TENSORS = ("y", "dx", "d_router_weight", "d_w1", "d_w2")

def tolerance_for(config: MoEConfig, backend: str) -> float:
    """Allowed ``max |got - want| / max |want|`` for a config and the backend that ran (from
    :mod:`flashdmoe.numerics`).

    Every backend accumulates in float32, so all carry float32's summation-order error over the longest
    reduction of the step (H, I, a rank's tokens summed into the router gradient, the tokens one expert
    sees summed into its weight gradient) through the forward's three and the backward's three
    reductions in a row. Half-precision configs add their roundings to the storage format (outputs, the
    rows exchanged between ranks, the kernel's intermediates): ``numerics.kernel_tolerance``, which also
    covers float32 inputs on the CUDA backend (TF32 tensor cores).
    """
    tokens = config.tokens_per_rank
    per_expert = -(-tokens * config.world_size * config.top_k // config.experts)
    longest = max(config.hidden, config.ffn, tokens, per_expert)
    bound = numerics.reorder_tolerance(torch.float32, longest, depth=6)
    if backend == "cuda" or config.dtype != "float32":
        bound += numerics.kernel_tolerance(config.dtype)
    return bound


def oracle(config: MoEConfig, inputs: StepInputs) -> StepOutputs:
    """The float64 outputs and gradients of ``inputs`` (CPU), loss ``sum_r <y_r, dy_r>``."""
    router = inputs.router_weight.detach().cpu()
    router64 = router.double().requires_grad_()
    w1 = torch.cat([shard.detach().cpu() for shard in inputs.w1s]).double().requires_grad_()
    w2 = torch.cat([shard.detach().cpu() for shard in inputs.w2s]).double().requires_grad_()
    xs = [x.detach().cpu() for x in inputs.xs]
    xs64 = [x.double().requires_grad_() for x in xs]
    ys = []
    for x, x64 in zip(xs, xs64):
        routing = reference.route(x, router, config.top_k, config.normalize_topk)
        capacity = reference.expert_capacity(x.shape[0], config.top_k, config.experts, config.capacity_factor)
        keep = reference.keep_mask(routing.experts, config.experts, capacity)
        ys.append(reference.moe_fixed_routing(x64, router64, w1, w2, routing.experts, keep,
                                              activation=config.activation, normalize_topk=config.normalize_topk))
    leaves = [*xs64, router64, w1, w2]
    grads = torch.autograd.grad(ys, leaves, [dy.detach().cpu().double() for dy in inputs.output_grads],
                                allow_unused=True)
    grads = [torch.zeros_like(leaf) if grad is None else grad for grad, leaf in zip(grads, leaves)]
    world, local = config.world_size, config.local_experts
    d_w1, d_w2 = grads[world + 1], grads[world + 2]
    return StepOutputs(ys=[y.detach() for y in ys], dxs=list(grads[:world]), d_router_weight=grads[world],
                       d_w1s=[d_w1[rank * local:(rank + 1) * local] for rank in range(world)],
                       d_w2s=[d_w2[rank * local:(rank + 1) * local] for rank in range(world)])


def _errors(name: str, got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, that over max |want|) in float64; zeros for empty tensors."""
    if tuple(got.shape) != tuple(want.shape):
        raise RuntimeError(f"verification: {name} has shape {tuple(got.shape)}; the oracle's is {tuple(want.shape)}")
    if want.numel() == 0:
        return 0.0, 0.0
    difference = float((got.detach().cpu().double() - want).abs().max())
    scale = float(want.abs().max())
    return difference, difference / scale if scale > 0 else difference


def compare(config: MoEConfig, backend: str, inputs: StepInputs, got: StepOutputs, *,
            step: int | None = None) -> dict[str, Any]:
    """The verification record of a system's ``got`` for ``inputs``, run on ``backend``.

    Returns:
        ``{"enabled": True, "step", "oracle", "metric", "tolerance", "max_abs_err", "max_rel_err", "passed",
        "tensors": {name: {"max_abs_err", "max_rel_err", "worst_rank"}}}`` for the names in :data:`TENSORS`
        (``worst_rank``: the rank with the largest relative error; ``None`` for ``d_router_weight``, one
        tensor for all ranks). A non-finite value makes its errors NaN or infinite and the check fail.
    """
    want = oracle(config, inputs)
    pairs = {
        "y": list(zip(got.ys, want.ys)),
        "dx": list(zip(got.dxs, want.dxs)),
        "d_router_weight": [(got.d_router_weight, want.d_router_weight)],
        "d_w1": list(zip(got.d_w1s, want.d_w1s)),
        "d_w2": list(zip(got.d_w2s, want.d_w2s)),
    }
    tensors: dict[str, dict[str, Any]] = {}
    for name in TENSORS:
        if len(pairs[name]) != (1 if name == "d_router_weight" else config.world_size):
            raise RuntimeError(f"verification: got {len(pairs[name])} {name} tensor(s) for "
                               f"{config.world_size} ranks")
        errors = [_errors(f"{name}[{rank}]", value, reference_value)
                  for rank, (value, reference_value) in enumerate(pairs[name])]
        worst = max(range(len(errors)), key=lambda rank: _order(errors[rank][1]))
        tensors[name] = {"max_abs_err": max((error[0] for error in errors), key=_order),
                         "max_rel_err": errors[worst][1],
                         "worst_rank": None if name == "d_router_weight" else worst}
    tolerance = tolerance_for(config, backend)
    max_rel = max((entry["max_rel_err"] for entry in tensors.values()), key=_order)
    return {"enabled": True, "step": step, "oracle": ORACLE, "metric": METRIC, "tolerance": tolerance,
            "max_abs_err": max((entry["max_abs_err"] for entry in tensors.values()), key=_order),
            "max_rel_err": max_rel, "passed": bool(max_rel <= tolerance), "tensors": tensors}


def _order(error: float) -> float:
    """Sort key that ranks NaN above every number, so a NaN error is the one reported."""
    return math.inf if math.isnan(error) else error


def skipped() -> dict[str, Any]:
    """The verification record of a run without verification: every field present, ``None``."""
    return {"enabled": False, "step": None, "oracle": None, "metric": None, "tolerance": None,
            "max_abs_err": None, "max_rel_err": None, "passed": None, "tensors": None}


def verify_step(ranks, step: int = 0) -> dict[str, Any]:
    """Run ``step``'s seeded inputs (:func:`flashdmoe.job.data.seeded_inputs`) through ``ranks`` (a
    :class:`flashdmoe.job.executor.RankExecutor`) once more and :func:`compare` the result."""
    inputs = seeded_inputs(ranks.config, step)
    got = ranks.forward_backward(inputs.xs, inputs.output_grads)
    return compare(ranks.config, ranks.backend, inputs, got, step=step)
