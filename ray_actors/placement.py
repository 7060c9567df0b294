"""Where the ranks of a :class:`ray_actors.cluster.MoECluster` run: :class:`Placement`, the placement group
that reserves them and the rank each slot of it holds.

One node (``nodes=1``, the default): one STRICT_PACK group with a bundle per rank, as Ray's docs describe
gang scheduling on one node. Several nodes: one STRICT_SPREAD group with one bundle per node, each bundle
holding that node's ``G = world_size // nodes`` ranks (``{"GPU": G * g}`` or ``{"CPU": G}``), and the
node's ``G`` actors scheduled into its bundle. One group keeps the reservation all-or-nothing (a run never
holds some nodes while waiting for others) and STRICT_SPREAD puts every bundle on a distinct node without
asking the nodes to declare anything; Ray hands each actor of a bundle its own GPUs out of the bundle's.
Ranks are node-major: rank ``r`` runs on the group's node ``r // G`` as its local rank ``r % G``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from flashdmoe.job.executor import ClusterTooSmall

__all__ = ["Placement", "format_resources"]


def format_resources(resources: Mapping[str, float]) -> str:
    """``"2 CPU, 0 GPU"``: the two resources the ranks ask for."""
    return f"{resources.get('CPU', 0.0):g} CPU, {resources.get('GPU', 0.0):g} GPU"


@dataclasses.dataclass(frozen=True)
class Placement:
    """``world_size`` ranks, each needing ``per_rank`` (e.g. ``{"GPU": 1.0}``), over ``nodes`` nodes."""

    world_size: int
    nodes: int
    per_rank: Mapping[str, float]

    def __post_init__(self) -> None:
        for name in ("world_size", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an integer >= 1")
        if self.world_size % self.nodes:
            raise ValueError(f"nodes={self.nodes}: expected a divisor of world_size={self.world_size} (every node "
                             "runs world_size // nodes ranks)")
        object.__setattr__(self, "per_rank", {key: float(amount) for key, amount in self.per_rank.items()})

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nodes

    @property
    def strategy(self) -> str:
        return "STRICT_PACK" if self.nodes == 1 else "STRICT_SPREAD"

    @property
    def per_node(self) -> dict[str, float]:
        """What one node must hold for its ranks."""
        return {key: amount * self.ranks_per_node for key, amount in self.per_rank.items()}

    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles: one per rank on one node, else one per node."""
        if self.nodes == 1:
            return [dict(self.per_rank) for _ in range(self.world_size)]
        return [self.per_node for _ in range(self.nodes)]

    def node_index(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def bundle_index(self, rank: int) -> int:
        """The bundle rank ``rank``'s actor is scheduled into."""
        return rank if self.nodes == 1 else self.node_index(rank)

    def describe(self) -> str:
        """``"4 workers x {'CPU': 1.0} on 2 distinct nodes, 2 per node"`` (or ``"... on one node"``)."""
        if self.nodes == 1:
            return f"{self.world_size} workers x {dict(self.per_rank)} on one node"
        return (f"{self.world_size} workers x {dict(self.per_rank)} on {self.nodes} distinct nodes, "
                f"{self.ranks_per_node} per node")

    def check_fits(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        """Refuse at once when too few of the cluster's alive nodes (``ray.nodes()`` entries) are large
        enough, by their total resources (what is free now is the placement group's to wait for)."""
        alive = [node.get("Resources", {}) for node in nodes if node.get("Alive")]
        needed = self.per_node
        large = [node for node in alive if all(node.get(key, 0.0) >= amount for key, amount in needed.items())]
        if len(large) >= self.nodes:
            return
        if self.nodes == 1:
            largest = max(alive, key=lambda node: tuple(node.get(key, 0.0) for key in needed), default={})
            raise ClusterTooSmall(
                f"{self.world_size} workers x {dict(self.per_rank)} must share one node (STRICT_PACK), which needs "
                f"{format_resources(needed)} on one node; the Ray cluster's largest of {len(alive)} node(s) has "
                f"{format_resources(largest)}")
        raise ClusterTooSmall(
            f"nodes={self.nodes}: {self.world_size} workers x {dict(self.per_rank)}, {self.ranks_per_node} per node, "
            f"need {self.nodes} distinct nodes with {format_resources(needed)} each; the Ray cluster has "
            f"{len(large)} such node(s) of {len(alive)} alive")
