"""The tensors of one step of the main job: the seeded inputs every executor feeds its ranks, and the
outputs and gradients a system returns for them.

Every rank ``r`` of step ``s`` gets the tokens :func:`flashdmoe.config.make_tokens` ``(r, s)`` and the
upstream gradient :func:`output_gradient` ``(r, s)``; the weights are :func:`flashdmoe.config.make_weights`
of the config's seed (router replicated, rank ``r`` holding experts ``config.expert_range(r)``). The
loss is ``sum_r <y_r, dy_r>``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdmoe.config import MoEConfig, derive_seed, make_tokens, make_weights, seeded_randn

__all__ = ["StepInputs", "StepOutputs", "output_gradient", "seeded_inputs"]


@dataclass(frozen=True)
class StepInputs:
    """What the ranks of one step compute on (``P`` ranks, ``L = E / P`` experts each).

    xs: ``P`` tensors ``[T_r, H]``; output_grads: ``P`` tensors ``[T_r, H]`` (``dL/dy_r``);
    router_weight: ``[E, H]`` (replicated); w1s: ``P`` shards ``[L, H, I or 2I]``; w2s: ``P`` shards
    ``[L, I, H]``. Config dtype.
    """

    xs: list[torch.Tensor]
    output_grads: list[torch.Tensor]
    router_weight: torch.Tensor
    w1s: list[torch.Tensor]
    w2s: list[torch.Tensor]


@dataclass(frozen=True)
class StepOutputs:
    """What a system returns for :class:`StepInputs`: ``ys`` and ``dxs`` (``P`` tensors ``[T_r, H]``),
    ``d_router_weight`` ``[E, H]`` (summed over ranks: the router is replicated), ``d_w1s`` / ``d_w2s``
    (``P`` shards, shaped like ``w1s`` / ``w2s``)."""

    ys: list[torch.Tensor]
    dxs: list[torch.Tensor]
    d_router_weight: torch.Tensor
    d_w1s: list[torch.Tensor]
    d_w2s: list[torch.Tensor]


def output_gradient(config: MoEConfig, rank: int, step: int, *,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Seeded ``dL/dy`` of ``rank`` at ``step``: ``[tokens_per_rank, H]``, standard normal, config dtype."""
    return seeded_randn((config.tokens_per_rank, config.hidden), derive_seed(config.seed, "output-grad", rank, step),
                        dtype=config.torch_dtype, device=device)


def seeded_inputs(config: MoEConfig, step: int) -> StepInputs:
    """The inputs of ``step`` for every rank, on the CPU."""
    router_weight, w1, w2 = make_weights(config)
    local = config.local_experts
    ranks = range(config.world_size)
    return StepInputs(xs=[make_tokens(config, rank, step) for rank in ranks],
                      output_grads=[output_gradient(config, rank, step) for rank in ranks],
                      router_weight=router_weight,
                      w1s=[w1[rank * local:(rank + 1) * local] for rank in ranks],
                      w2s=[w2[rank * local:(rank + 1) * local] for rank in ranks])
