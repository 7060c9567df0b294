"""Teams: how the ranks of an expert-parallel MoE reach each other (DESIGN.md §4).

Only ``Team.single()`` exists today: one rank whose dispatch and combine target itself. The emulated and
NVSHMEM teams arrive with expert parallelism inside the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Team:
    """rank: this process's rank; world_size: number of ranks P (experts are split E / P per rank)."""

    rank: int
    world_size: int
    transport: str

    @classmethod
    def single(cls) -> "Team":
        return cls(rank=0, world_size=1, transport="single")

    def close(self) -> None:
        """Nothing to free for a single-rank team."""
