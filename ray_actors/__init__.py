"""Ray orchestration of FlashDMoE: one :class:`~ray_actors.worker.MoEWorker` actor per rank and the
driver (:class:`~ray_actors.driver.MoECluster`, :func:`~ray_actors.driver.run_job`); DESIGN.md §6.

``python -m ray_actors.driver --config FILE`` is the ``ray job submit`` entrypoint.
"""

from __future__ import annotations

import importlib

__all__ = ["MoECluster", "MoEWorker", "run_job"]

# Imported on first use, so `python -m ray_actors.driver` does not import the driver twice.
_LAZY = {"MoECluster": "ray_actors.driver", "run_job": "ray_actors.driver", "MoEWorker": "ray_actors.worker"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ray_actors' has no attribute {name!r}")
