"""FlashDMoE: a distributed Mixture-of-Experts layer as one persistent GPU kernel per GPU.

Public API::

    import flashdmoe
    y = flashdmoe.moe(x, router_weight, w1, w2, top_k=2)          # function (docs/design.md §2)
    layer = flashdmoe.MoELayer(flashdmoe.MoEConfig.from_yaml("configs/tiny.yaml").replace(world_size=1))

``flashdmoe.reference`` is the plain-PyTorch oracle; ``flashdmoe.Team`` describes the ranks.

A fused (CUDA) forward does not wait for its kernel: its errors surface later, at the points
``flashdmoe.check_errors`` lists (``flashdmoe.synchronize()`` waits and checks everything;
``flashdmoe.set_sync_checks(True)`` raises at the call). ``flashdmoe.last_report()`` is the latest
launch's report (per-phase times, traffic, status).
"""

from __future__ import annotations

import importlib
from importlib import metadata

from flashdmoe.api import moe, moe_expert_parallel
from flashdmoe.config import MoEConfig, make_tokens, make_weights
from flashdmoe.errors import BackendUnavailable, KernelTimeout
from flashdmoe.layer import MoELayer
from flashdmoe.kernel.launch_report import LaunchReport
from flashdmoe.kernel.status_checks import check_errors, last_report, set_sync_checks, synchronize

try:
    __version__ = metadata.version("flashdmoe")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"

__all__ = [
    "BackendUnavailable",
    "KernelTimeout",
    "LaunchReport",
    "MoEConfig",
    "MoELayer",
    "Team",
    "__version__",
    "check_errors",
    "last_report",
    "make_tokens",
    "make_weights",
    "moe",
    "moe_expert_parallel",
    "reference",
    "set_sync_checks",
    "synchronize",
]

# Imported on first use: the reference and the team module are heavier or come from other parts.
_LAZY_ATTRIBUTES = {"Team": ("flashdmoe.parallel.team", "Team"), "reference": ("flashdmoe.reference", None),
                    "ops": ("flashdmoe.ops", None)}


def __getattr__(name: str):
    if name in _LAZY_ATTRIBUTES:
        module_name, attribute = _LAZY_ATTRIBUTES[name]
        module = importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flashdmoe' has no attribute {name!r}")
