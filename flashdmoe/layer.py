"""``MoELayer``: an ``nn.Module`` over :func:`flashdmoe.moe` with seeded parameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flashdmoe.api import BACKENDS, moe
from flashdmoe.config import MoEConfig

__all__ = ["MoELayer"]


class MoELayer(nn.Module):
    """Mixture-of-Experts layer holding this rank's expert shard.

    Parameters (all in ``config.torch_dtype``), initialised by ``config.make_weights`` from
    ``config.seed`` so every rank and backend starts from the same numbers:

    - ``router_weight``: ``[E, H]``, replicated on every rank.
    - ``w1``: ``[L, H, I]`` (``[L, H, 2I]`` for swiglu), global experts ``[rank*L, (rank+1)*L)``.
    - ``w2``: ``[L, I, H]``, same experts.

    Args:
        config: the layer's sizes and options.
        team: ``None`` for one rank (then ``config.world_size`` must be 1), or a
            :class:`flashdmoe.Team` whose ``world_size`` equals ``config.world_size``.
        device: where to create the parameters (default CPU).

    Attributes:
        backend: ``"auto"`` (default), ``"reference"`` or ``"cuda"``; passed to :func:`flashdmoe.moe`.
    """

    def __init__(self, config: MoEConfig, team: Any = None, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise ValueError(f"config: expected a flashdmoe.MoEConfig, got {type(config).__name__}")
        if team is None:
            if config.world_size != 1:
                raise ValueError(
                    f"team=None means one rank, but config.world_size={config.world_size}; pass a "
                    f"flashdmoe.Team with world_size {config.world_size} or use world_size: 1"
                )
            rank = 0
        else:
            if getattr(team, "world_size", None) != config.world_size:
                raise ValueError(
                    f"team: world_size={getattr(team, 'world_size', None)!r} does not match "
                    f"config.world_size={config.world_size}"
                )
            rank = team.rank
        self.config = config
        self.team = team
        self.rank = rank
        self.backend = "auto"
        router_weight, w1, w2 = config.make_weights(experts=config.expert_range(rank), device=device)
        self.router_weight = nn.Parameter(router_weight)
        self.w1 = nn.Parameter(w1)
        self.w2 = nn.Parameter(w2)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise the parameters from ``config.seed`` (same values as at construction)."""
        router_weight, w1, w2 = self.config.make_weights(experts=self.config.expert_range(self.rank))
        self.router_weight.copy_(router_weight)
        self.w1.copy_(w1)
        self.w2.copy_(w2)

    def forward(self, x: torch.Tensor, *, return_aux: bool = False):
        """Apply the layer.

        Args:
            x: ``[T, H]`` tokens of this rank, same dtype and device as the parameters.
            return_aux: also return the ``MoEAux`` (per-expert counts, dropped, load-balancing loss).

        Returns:
            ``y [T, H]`` in ``x``'s dtype, or ``(y, aux)``.
        """
        backend = self.backend
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
        # The registered parameters straight from their dict (nn.Module.__getattr__ costs a Python call each);
        # torch.func.functional_call swaps them there too. A name no longer registered (a parametrization, an
        # old-style weight_norm hook's plain attribute) is read as an attribute.
        params = self._parameters
        router_weight, w1, w2 = params.get("router_weight"), params.get("w1"), params.get("w2")
        if router_weight is None or w1 is None or w2 is None:
            router_weight, w1, w2 = self.router_weight, self.w1, self.w2
        config = self.config
        return moe(x, router_weight, w1, w2, top_k=config.top_k, activation=config.activation,
                   normalize_topk=config.normalize_topk, capacity_factor=config.capacity_factor,
                   team=self.team, backend=backend, return_aux=return_aux)

    def extra_repr(self) -> str:
        config = self.config
        return (f"hidden={config.hidden}, ffn={config.ffn}, experts={config.experts}, top_k={config.top_k}, "
                f"activation={config.activation}, rank={self.rank}/{config.world_size}, backend={self.backend}")
