"""The benchmark suites, by name: ``flashdmoe bench --suite NAME`` runs ``SUITES[NAME]``.

A new suite is a module that defines a :class:`~flashdmoe.bench.suite.Suite` and one line here.
"""

from __future__ import annotations

from flashdmoe.bench import expert_parallel, multi_gpu, single_gpu, training
from flashdmoe.bench.suite import Suite

SUITES: dict[str, Suite] = {
    suite.name: suite for suite in (single_gpu.SUITE, expert_parallel.SUITE, multi_gpu.SUITE, training.SUITE)
}


def get_suite(name: str) -> Suite:
    """The suite called ``name``; raises ValueError naming the known suites."""
    if name not in SUITES:
        raise ValueError(f"--suite {name!r}: expected one of {sorted(SUITES)}")
    return SUITES[name]
