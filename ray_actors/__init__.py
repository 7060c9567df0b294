"""The main job's ranks on Ray: :class:`~ray_actors.cluster.MoECluster` (the executor the step loop
:func:`flashdmoe.job.run_job` drives, and a Python API) and :class:`~ray_actors.worker.MoEWorker` (the
actor that is one rank). ``flashdmoe run`` is the entry point, also under ``ray job submit``.
"""

from __future__ import annotations

import importlib

__all__ = ["MoECluster", "MoEWorker"]

# Imported on first use: importing ray_actors alone should not import Ray.
_LAZY = {"MoECluster": "ray_actors.cluster", "MoEWorker": "ray_actors.worker"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ray_actors' has no attribute {name!r}")
