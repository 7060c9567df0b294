"""Knobs every kernel launch reads: the watchdog's limit and the test-only debug switches (one object,
:data:`debug`, re-exported by :mod:`flashdmoe.cuda_backend`), shared by the forward's and the fused
backward's launchers."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["DEFAULT_TIMEOUT_MS", "DebugKnobs", "debug", "timeout_ms"]

DEFAULT_TIMEOUT_MS = 10_000


def _env_int(name: str, default: int | None, minimum: int) -> int | None:
    """Integer environment variable ``name`` (``default`` when unset or empty); a value that is not an
    integer of at least ``minimum`` raises ``ValueError`` naming the variable."""
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"{name}={text!r}: expected an integer >= {minimum}")
    return value


# Read once: a forward must not consult the environment.
_ENV_TIMEOUT_MS = _env_int("FLASHDMOE_TIMEOUT_MS", DEFAULT_TIMEOUT_MS, 1)


@dataclass
class DebugKnobs:
    """Test-only switches. ``withhold_phase`` makes block 0 skip that grid barrier (forces the watchdog);
    ``poison_outputs`` fills outputs with NaN before the launch so unwritten elements show."""

    withhold_phase: int = 0
    poison_outputs: bool = False
    # This rank publishes none of its signals (counts, rows ready, results done): its peers must time out.
    silent_rank: int = -1
    # 0: the whole resident grid; else at most this many blocks (tests of small grids).
    max_blocks: int = 0
    timeout_ms: int | None = None
    # Small batches split each gate tile's K slabs over several blocks; the kernel's gate_splits_for
    # (csrc/moe/tile_config.cuh) decides how far.
    # None: on (the kernel decides); True / False (FLASHDMOE_GATE_SPLIT=1 / 0) force it for measurement.
    gate_split: bool | None = {"1": True, "0": False}.get(os.environ.get("FLASHDMOE_GATE_SPLIT", ""))
    # Expert GEMM variant (EXPERT_VARIANTS). None: chosen per shape (expert_variants.choose_variant);
    # a name (FLASHDMOE_EXPERT_VARIANT) forces it for measurement.
    expert_variant: str | None = os.environ.get("FLASHDMOE_EXPERT_VARIANT") or None
    # GEMM1 tiles of at most 16 rows spread their activation over every warp of the block (decode and small
    # batches); off (FLASHDMOE_SMALL_TILE_EPILOGUE=0) leaves it to the warp holding the rows, for measurement.
    small_tile_epilogue: bool = os.environ.get("FLASHDMOE_SMALL_TILE_EPILOGUE", "1") != "0"
    # An NVSHMEM team's backward: "auto" (the device exchange where every peer has a load/store pointer,
    # flashdmoe.backward.ep_backward) or "torch" (flashdmoe.parallel.ep_peer's torch ops, forced for measurement:
    # FLASHDMOE_TEAM_BACKWARD=torch).
    team_backward: str = os.environ.get("FLASHDMOE_TEAM_BACKWARD", "auto")
    # The backward's gemm="auto" takes the fused launch up to this many routed rows per expert on average
    # (None: expert_backward.FUSED_MAX_ROWS_PER_EXPERT); FLASHDMOE_FUSED_BACKWARD_MAX_ROWS moves the line,
    # for measurement (a large value: the fused launch wherever it runs).
    fused_backward_max_rows: int | None = _env_int("FLASHDMOE_FUSED_BACKWARD_MAX_ROWS", None, 0)

    def __setattr__(self, name, value) -> None:
        # Every setting bumps ``generation``: launches prepared under other knobs are not reused (a prepared
        # launch and a remembered call are keyed by it, so a forward reads one integer, not every knob).
        object.__setattr__(self, name, value)
        object.__setattr__(self, "generation", getattr(self, "generation", 0) + 1)


debug = DebugKnobs()


def timeout_ms() -> int:
    """The watchdog's limit: ``debug.timeout_ms``, else ``FLASHDMOE_TIMEOUT_MS`` as it was at import."""
    return debug.timeout_ms if debug.timeout_ms is not None else _ENV_TIMEOUT_MS
