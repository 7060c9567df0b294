"""The ``multi-gpu`` suite: the fused kernel on P real GPUs beside an NCCL all-to-all baseline (issue 7).

**Status: written for an 8-GPU machine; not yet run on multi-GPU hardware.** Its CPU parts (plan,
derived metrics, refusal, and the all-to-all baseline's exchange code over gloo through the same process
harness) are tested on the CPU; the GPU path is tested only by ``tests/test_bench.py``'s ``gpu`` test.

One process per GPU (rank ``r`` on ``cuda:r``, no MPS), started by :func:`flashdmoe.ranks.run_ranks`
with ``one_gpu_per_rank=True``; every configuration runs twice, on the same seeded inputs
(:class:`flashdmoe.ranks.Problem`: ``T`` tokens per GPU on each of ``P`` ranks, ``E`` experts, rank
``r`` owning ``[r E/P, (r + 1) E/P)``):

* ``fused`` -- :meth:`Team.nvshmem <flashdmoe.parallel.team.Team.nvshmem>` and ``flashdmoe.moe(..., team=team,
  backend="cuda")`` (:func:`flashdmoe.bench.rank_scenarios.checked_fused_forwards`): forwards timed back to
  back with CUDA events through the public API; bytes sent and payload efficiency
  from ``flashdmoe.last_report().traffic()`` of one forward;
* ``nccl`` -- the unfused baseline (:func:`flashdmoe.bench.rank_scenarios.nccl_forwards`):
  ``torch.distributed`` NCCL (a ``file://`` rendezvous in the run's directory),
  :func:`flashdmoe.bench.all_to_all.all_to_all_moe`: router, per-expert counts exchanged first
  (``all_to_all_single``), the routed rows dispatched with ``all_to_all_single``, the local experts as two
  ``torch._grouped_mm`` calls (:mod:`flashdmoe.bench.baselines`), the results sent back with
  ``all_to_all_single`` and the weighted sum at the source.

A forward's time is the slowest rank's (per timed run, the maximum over ranks of their CUDA-event
times); the row's median is the median of those. Every rank checks its own output against
:func:`flashdmoe.reference.moe` with all experts on its GPU (near-tie tokens left out); the row's error is
``max over ranks of max|y - y_ref|`` over ``max over ranks of max|y_ref|``.

Configurations (:func:`plan_configs`; only GPU counts <= the GPUs visible): weak scaling, 8192 tokens per
GPU, H = I = 2048, E = 32, k = 2 on 2, 4, 8 GPUs; token scaling 4K/8K/16K per GPU and expert scaling
E = 8..128 at the largest GPU count (a configuration shared by several studies runs once). ``--configs`` or
``--quick`` shapes (T per GPU) run as weak scaling over the GPU counts only.

Derived (:func:`add_derived`): overlap efficiency = 2-GPU median / P-GPU median of the same entry and
per-GPU shape (weak scaling: 1.0 is perfect), speed-up over NCCL = NCCL median / fused median, payload
efficiency = dispatched bytes / (rows routed to other ranks x H x element size).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from flashdmoe.bench import hardware, metrics, rank_scenarios, report
from flashdmoe.bench.entries import describe_error
from flashdmoe.bench.rank_results import failure_details, failure_reason, timed_run_summary
from flashdmoe.bench.results import BenchShape, ConfigResult, EntryResult, SuiteResult
from flashdmoe.bench.suite import Suite, SuiteOptions
from flashdmoe.ranks import Problem, RunResult, nvshmem_unavailable_reason, run_ranks

SUITE_NAME = "multi-gpu"
ENTRY_NAMES = ("fused", "nccl")
ENTRY_LABELS = {"fused": "fused (NVSHMEM)", "nccl": "NCCL all_to_all + grouped_mm"}
GPU_COUNTS = (2, 4, 8)
MIN_GPUS = 2
#: The FlashDMoE paper's per-GPU problem: weak scaling over GPU_COUNTS.
WEAK_SHAPE = BenchShape(8192, 2048, 2048, 32, 2)
TOKEN_SCALING = (4096, 8192, 16384)
EXPERT_SCALING = (8, 16, 32, 64, 128)
MULTI_GPU_SHAPES = (WEAK_SHAPE,)
MULTI_GPU_QUICK_SHAPES = (BenchShape(64, 64, 128, 8, 2),)
KERNEL_DTYPES = ("bfloat16", "float16")
RUN_TIMEOUT_S = 600.0
STUDIES = ("weak", "tokens", "experts")


# ---------------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class PlannedConfig:
    """One configuration: ``world_size`` GPUs, ``shape`` per GPU (``shape.tokens`` = T per GPU), and the
    studies (``"weak"``, ``"tokens"``, ``"experts"``) it belongs to."""

    world_size: int
    shape: BenchShape
    studies: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"P={self.world_size} T/GPU={self.shape.tokens} H={self.shape.hidden} I={self.shape.ffn} " \
               f"E={self.shape.experts} k={self.shape.top_k}"

    def shape_dict(self) -> dict[str, int]:
        s = self.shape
        return {"P": self.world_size, "T/GPU": s.tokens, "H": s.hidden, "I": s.ffn, "E": s.experts, "k": s.top_k}


def gpu_counts_for(gpu_count: int) -> list[int]:
    """The GPU counts of :data:`GPU_COUNTS` that fit in ``gpu_count`` visible GPUs."""
    return [count for count in GPU_COUNTS if count <= gpu_count]


def plan_configs(gpu_count: int, shapes: tuple[BenchShape, ...] | list[BenchShape] | None = None) -> list[PlannedConfig]:
    """The configurations to run on ``gpu_count`` visible GPUs.

    ``shapes=None`` (the suite's default): weak scaling of :data:`WEAK_SHAPE` on every count of
    :data:`GPU_COUNTS` <= ``gpu_count``, then token scaling (:data:`TOKEN_SCALING` per GPU) and expert
    scaling (:data:`EXPERT_SCALING`) at the largest of those counts; a configuration in several studies
    appears once with all of them. Given shapes (T per GPU): each as weak scaling only.
    Raises ValueError when fewer than 2 GPUs are given.
    """
    counts = gpu_counts_for(gpu_count)
    if not counts:
        raise ValueError(f"gpu_count={gpu_count}: the multi-gpu suite needs at least {MIN_GPUS} GPUs")
    planned: dict[tuple[int, BenchShape], list[str]] = {}

    def add(world_size: int, shape: BenchShape, study: str) -> None:
        studies = planned.setdefault((world_size, shape), [])
        if study not in studies:
            studies.append(study)

    if shapes is None:
        for count in counts:
            add(count, WEAK_SHAPE, "weak")
        largest = counts[-1]
        base = WEAK_SHAPE
        for tokens in TOKEN_SCALING:
            add(largest, BenchShape(tokens, base.hidden, base.ffn, base.experts, base.top_k), "tokens")
        for experts in EXPERT_SCALING:
            if experts % largest == 0 and experts >= base.top_k:
                add(largest, BenchShape(base.tokens, base.hidden, base.ffn, experts, base.top_k), "experts")
    else:
        for shape in shapes:
            for count in counts:
                add(count, shape, "weak")
    return [PlannedConfig(world_size, shape, tuple(studies)) for (world_size, shape), studies in planned.items()]


def plan_for_options(options: SuiteOptions, gpu_count: int) -> list[PlannedConfig]:
    """The default shapes give the full plan; ``--quick``/``--configs`` shapes weak scaling only."""
    if tuple(options.shapes) == MULTI_GPU_SHAPES:
        return plan_configs(gpu_count)
    return plan_configs(gpu_count, options.shapes)


def visible_gpu_count() -> int:
    """CUDA devices torch sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def validate_options(options: SuiteOptions, gpu_count: int | None = None) -> None:
    """Refuse what cannot run: fewer than 2 visible GPUs (or ``--device cpu``), a dtype the kernel does
    not run, or a shape whose E is not divisible by a planned GPU count. Raises ValueError."""
    found = visible_gpu_count() if gpu_count is None else gpu_count
    if torch.device(options.device).type != "cuda":
        raise ValueError(
            f"--device {options.device}: the multi-gpu suite runs one process per CUDA GPU and needs at least "
            f"{MIN_GPUS}; found {found} visible CUDA GPU(s)")
    if found < MIN_GPUS:
        raise ValueError(
            f"the multi-gpu suite needs at least {MIN_GPUS} CUDA GPUs (one process per GPU); "
            f"found {found} visible GPU(s)")
    if options.dtype not in KERNEL_DTYPES:
        raise ValueError(f"--dtype {options.dtype}: the fused kernel runs {' or '.join(KERNEL_DTYPES)}")
    for planned in plan_for_options(options, found):
        if planned.shape.experts % planned.world_size:
            raise ValueError(
                f"--configs {planned.shape.label}: E={planned.shape.experts} is not divisible by "
                f"P={planned.world_size} GPUs; use E a multiple of {max(gpu_counts_for(found))}")


def problem_for(planned: PlannedConfig, options: SuiteOptions, config_index: int) -> Problem:
    """The seeded :class:`flashdmoe.ranks.Problem` of configuration ``config_index``."""
    shape = planned.shape
    return Problem(
        tokens=(shape.tokens,) * planned.world_size, hidden=shape.hidden, ffn=shape.ffn, experts=shape.experts,
        top_k=shape.top_k, activation=options.activation, normalize_topk=options.normalize_topk,
        capacity_factor=None, dtype=options.dtype, seed=options.seed + 1000 * config_index, near_tie_gap=0.0,
    )


# ---------------------------------------------------------------------------------------------------------
# Results of one run


def combine_checks(checks: list[dict]) -> dict:
    """One relative error over all ranks: max of their ``max_abs_error`` over max of their
    ``max_abs_reference`` (as :func:`metrics.max_relative_error` on the concatenated outputs)."""
    error = max((c["max_abs_error"] for c in checks), default=0.0)
    scale = max((c["max_abs_reference"] for c in checks), default=0.0)
    return {"max_relative_error": error / scale if scale > 0 else error,
            "compared_tokens": sum(c["compared_tokens"] for c in checks),
            "near_tie_tokens": sum(c["near_tie_tokens"] for c in checks)}


def entry_from_run(name: str, run: RunResult | EntryResult, hidden: int, element_bytes: int) -> EntryResult:
    """An :class:`EntryResult` from a :class:`flashdmoe.ranks.RunResult` (or the EntryResult of a run that
    could not start): per timed forward the slowest rank's time, errors combined over ranks."""
    label = ENTRY_LABELS[name]
    if isinstance(run, EntryResult):
        return run
    details = {"world_size": run.world_size, "wall_s": round(run.elapsed_s, 1)}
    if not run.ok:
        return EntryResult(name, label, "error", reason=failure_reason(run), details=details | failure_details(run))
    stats, summary = timed_run_summary(run, hidden, element_bytes)
    details |= summary
    checks = [outcome.info.get("check") for outcome in run.ranks]
    if any(check is None for check in checks):
        return EntryResult(name, label, "error", reason="a rank returned no reference check", details=details)
    combined = combine_checks(checks)
    details["compared_tokens"] = combined["compared_tokens"]
    details["near_tie_tokens"] = combined["near_tie_tokens"]
    return EntryResult(name, label, "ok", median_ms=stats.median_ms, p10_ms=stats.p10_ms, p90_ms=stats.p90_ms,
                       samples_ms=list(stats.samples_ms), max_relative_error=combined["max_relative_error"],
                       details=details)


def add_derived(configs: list[ConfigResult]) -> None:
    """Speed-up over NCCL (``details["vs_nccl"]`` = nccl median / entry median, same configuration) and
    overlap efficiency (``details["overlap_efficiency"]`` = the same entry's median on the 2-GPU weak-scaling
    configuration of the same per-GPU shape / this median) on every timed entry."""
    def key(config: ConfigResult) -> tuple:
        return tuple((k, v) for k, v in config.shape.items() if k != "P")

    two_gpu: dict[tuple, ConfigResult] = {
        key(config): config for config in configs
        if config.shape.get("P") == 2 and "weak" in (config.details or {}).get("studies", ())}
    for config in configs:
        nccl = config.entry("nccl")
        base = two_gpu.get(key(config)) if "weak" in (config.details or {}).get("studies", ()) else None
        for entry in config.entries:
            if entry.status != "ok":
                continue
            if nccl is not None and nccl.status == "ok":
                entry.details["vs_nccl"] = nccl.median_ms / entry.median_ms
            reference_entry = base.entry(entry.name) if base is not None else None
            if reference_entry is not None and reference_entry.status == "ok":
                entry.details["overlap_efficiency"] = reference_entry.median_ms / entry.median_ms


# ---------------------------------------------------------------------------------------------------------
# The suite


def _run_entry_ranks(name: str, planned: PlannedConfig, problem: Problem,
                     options: SuiteOptions) -> RunResult | EntryResult:
    """The rank processes of entry ``name`` on one configuration, or the EntryResult of a run that could not
    start."""
    params = {"problem": problem.to_dict(), "warmup": options.warmup, "repeats": options.repeats,
              "input_sets": options.input_sets, "max_input_sets": options.max_input_sets, "check": True}
    try:
        if name == "fused":
            reason = nvshmem_unavailable_reason()
            if reason:
                return EntryResult(name, ENTRY_LABELS[name], "unavailable", reason=reason,
                                   details={"world_size": planned.world_size})
            return run_ranks(rank_scenarios.checked_fused_forwards, planned.world_size, params=params, mps=False,
                             one_gpu_per_rank=True, timeout_s=RUN_TIMEOUT_S)
        params |= {"backend": "nccl", "experts": "grouped_mm"}
        return run_ranks(rank_scenarios.nccl_forwards, planned.world_size, params=params, nvshmem=False,
                         mps=False, one_gpu_per_rank=True, timeout_s=RUN_TIMEOUT_S)
    except Exception as error:
        return EntryResult(name, ENTRY_LABELS[name], "error", reason=describe_error(error),
                           details={"world_size": planned.world_size})


def run_multi_gpu(options: SuiteOptions) -> SuiteResult:
    """Every planned configuration: the fused run, then the NCCL run (each P processes, one per GPU); the
    matmul ceiling is measured on cuda:0 afterwards (this process touches no GPU while ranks run)."""
    gpu_count = visible_gpu_count()
    validate_options(options, gpu_count)
    plan = plan_for_options(options, gpu_count)
    element_bytes = torch.empty((), dtype=getattr(torch, options.dtype)).element_size()
    tolerance = metrics.ERROR_TOLERANCES[options.dtype]
    console = options.console
    runs = {}
    for index, planned in enumerate(plan):
        problem = problem_for(planned, options, index)
        for name in options.entries:
            console.log(f"[{index + 1}/{len(plan)}] {planned.label}: {ENTRY_LABELS[name]}")
            runs[(index, name)] = _run_entry_ranks(name, planned, problem, options)
    device = torch.device("cuda", 0)
    ceiling_tflops = None
    try:
        ceiling_tflops = hardware.suite_matmul_ceiling(device, console)
    except Exception as error:  # the table is still worth having without it
        console.log(f"matmul ceiling not measured: {describe_error(error)}")
    configs = []
    for index, planned in enumerate(plan):
        shape = planned.shape
        total_tokens = shape.tokens * planned.world_size
        flops = metrics.moe_flops(total_tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k,
                                  options.activation)
        entries = []
        for name in options.entries:
            entry = entry_from_run(name, runs[(index, name)], shape.hidden, element_bytes)
            if entry.status == "ok":
                entry.tflops = metrics.tflops(flops, entry.median_ms)
                if ceiling_tflops:
                    entry.percent_of_ceiling = 100.0 * entry.tflops / (ceiling_tflops * planned.world_size)
                entry.error_tolerance = tolerance
                entry.correct = entry.max_relative_error <= tolerance
            console.log(f"    {planned.label} {entry.label}: " + (
                f"{entry.median_ms:.3f} ms, err {entry.max_relative_error:.2e}" if entry.status == "ok"
                else f"{entry.status}: {entry.reason}"))
            entries.append(entry)
        checked = next((e for e in entries if e.status == "ok"), None)
        configs.append(ConfigResult(
            label=planned.label, shape=planned.shape_dict(), activation=options.activation, dtype=options.dtype,
            flops=flops, input_sets=(checked.details.get("input_sets") if checked else None) or 0,
            entries=entries,
            compared_tokens=checked.details.get("compared_tokens") if checked else None,
            near_tie_tokens=checked.details.get("near_tie_tokens") if checked else None,
            details={"studies": list(planned.studies), "tokens_total": total_tokens},
        ))
    add_derived(configs)
    gc.collect()
    return SuiteResult(
        suite=options.suite,
        machine=hardware.machine_info(device) | {"visible_gpus": gpu_count},
        settings={
            "device": "cuda (one process per GPU, rank r on cuda:r, no MPS)", "dtype": options.dtype,
            "activation": options.activation, "normalize_topk": options.normalize_topk,
            "repeats": options.repeats, "warmup": options.warmup, "seed": options.seed,
            "entries": list(options.entries), "error_tolerance": tolerance,
            "near_tie_log_gap": metrics.NEAR_TIE_LOG_GAP, "gpu_counts": gpu_counts_for(gpu_count),
            "flops_formula": "2*T*k*H*I*(2, or 3 for swiglu) + 2*T*H*E with T = P x T/GPU (all ranks)",
            "notes": [
                ("T/GPU tokens on each of P GPUs; E experts, E / P per GPU; ms per forward = the slowest rank's "
                 "CUDA-event time, median over the timed forwards"),
                "% of ceiling = TFLOP/s over (P x the bf16 matmul ceiling measured on cuda:0)",
                "overlap eff. = 2-GPU median / P-GPU median of the same entry and per-GPU shape (weak scaling)",
                "vs NCCL = NCCL baseline median / entry median (same inputs, same run)",
                ("sent MB / rank = max over ranks of dispatch + combine bytes to other ranks; payload eff. = "
                 "dispatched bytes / (rows routed to other ranks x H x element size)"),
                ("NCCL baseline: router, counts all_to_all_single, rows all_to_all_single, torch._grouped_mm x2, "
                 "results all_to_all_single, weighted sum (NCCL_NVLS_ENABLE=0)"),
            ],
        },
        configs=configs,
        ceiling_tflops=ceiling_tflops,
    )


# ---------------------------------------------------------------------------------------------------------
# Tables


def _studies_cell(config, entry) -> str:
    return ",".join((config.details or {}).get("studies", [])) or "–"


MULTI_GPU_LAYOUT = report.Layout(
    markdown=(
        report.Column("study", _studies_cell, "left"),
        report.Column("entry", lambda config, entry: entry.label, "left"),
        report.Column("ms (median)", lambda config, entry: report.number_text(entry.median_ms, 3)),
        report.Column("p10–p90 ms", lambda config, entry: report.spread_text(entry)),
        report.Column("TFLOP/s", lambda config, entry: report.tflops_text(entry.tflops)),
        report.Column("% of ceiling", lambda config, entry: report.number_text(entry.percent_of_ceiling, 1)),
        report.Column("overlap eff.", report.ratio_cell("overlap_efficiency", percent=True)),
        report.Column("vs NCCL", report.ratio_cell("vs_nccl")),
        report.Column("sent MB / rank (max)", report.sent_megabytes_cell),
        report.Column("payload eff.", report.ratio_cell("payload_efficiency", percent=True)),
        report.Column("max rel. error", lambda config, entry: report.error_text(entry)),
        report.Column("status", lambda config, entry: report.status_text(entry), "left"),
    ),
    terminal=(
        report.Column("entry", lambda config, entry: entry.name, "left"),
        report.Column("ms", lambda config, entry: report.number_text(entry.median_ms, 3)),
        report.Column("TFLOP/s", lambda config, entry: report.tflops_text(entry.tflops)),
        report.Column("overlap", report.ratio_cell("overlap_efficiency", percent=True)),
        report.Column("vs NCCL", report.ratio_cell("vs_nccl")),
        report.Column("MB/rank", report.sent_megabytes_cell),
        report.Column("payload", report.ratio_cell("payload_efficiency", percent=True)),
        report.Column("rel err", lambda config, entry: report.error_text(entry)),
        report.Column("status", lambda config, entry: report.status_text(entry, report.REASON_WIDTH_IN_TERMINAL),
                      "left"),
    ),
)

SUITE = Suite(
    name=SUITE_NAME,
    description="fused kernel on 2/4/8 GPUs (one process per GPU) beside an NCCL all_to_all baseline",
    runner=run_multi_gpu,
    default_shapes=MULTI_GPU_SHAPES,
    quick_shapes=MULTI_GPU_QUICK_SHAPES,
    entry_names=ENTRY_NAMES,
    validate=validate_options,
    layout=MULTI_GPU_LAYOUT,
)
