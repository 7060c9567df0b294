"""Several ranks as separate processes: the harness behind the multi-process tests and the benchmarks'
multi-process rows (several ranks on one GPU under CUDA MPS, or one rank per GPU).

* :mod:`~flashdmoe.ranks.problem`: seeded problems and what their ranks must return;
* :mod:`~flashdmoe.ranks.launcher`: the parent (:func:`run_ranks`, :class:`RunResult`);
* :mod:`~flashdmoe.ranks.child`: one rank process (``python -m flashdmoe.ranks SPEC.json``);
* :mod:`~flashdmoe.ranks.scenarios`: the correctness scenarios a rank runs;
* :mod:`~flashdmoe.ranks.workdir`: the run directory the two sides talk through.
"""

from flashdmoe.ranks.child import RankContext, ScenarioOutput
from flashdmoe.ranks.launcher import RankOutcome, RanksFailed, RunResult, nvshmem_unavailable_reason, run_ranks
from flashdmoe.ranks.problem import Problem, RankInputs, split_tokens

__all__ = [
    "Problem",
    "RankContext",
    "RankInputs",
    "RankOutcome",
    "RanksFailed",
    "RunResult",
    "ScenarioOutput",
    "nvshmem_unavailable_reason",
    "run_ranks",
    "split_tokens",
]
