"""The ``multi-gpu`` suite: the fused kernel on P real GPUs beside an NCCL all-to-all baseline (issue 7).

**Status: written for an 8-GPU machine; not yet run on multi-GPU hardware.** Its CPU parts (plan,
derived metrics, refusal, and the all-to-all baseline's exchange code over gloo through the same process
harness) are tested on the CPU; the GPU path is tested only by ``tests/test_bench.py``'s ``gpu`` test.

One process per GPU (rank ``r`` on ``cuda:r``, no MPS), started by :func:`flashdmoe.multiprocess.run_ranks`
with ``one_gpu_per_rank=True``; every configuration runs twice, on the same seeded inputs
(:class:`flashdmoe.multiprocess.Problem`: ``T`` tokens per GPU on each of ``P`` ranks, ``E`` experts, rank
``r`` owning ``[r E/P, (r + 1) E/P)``):

* ``fused`` -- :meth:`Team.nvshmem <flashdmoe.team.Team.nvshmem>` and ``flashdmoe.moe(..., team=team,
  backend="cuda")`` (the ``bench`` scenario of :mod:`flashdmoe.multiprocess`, wrapped by
  :func:`scenario_fused`): forwards timed back to back with CUDA events inside
  ``cuda_backend.deferred_status_checks()``; bytes sent and payload efficiency from
  ``cuda_backend.last_traffic`` of one checked forward;
* ``nccl`` -- the unfused baseline (scenario ``nccl_bench``): ``torch.distributed`` NCCL (a ``file://``
  rendezvous in the run's directory), :func:`all_to_all_moe`: router, per-expert counts exchanged first
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
import math
from dataclasses import dataclass

import torch

from flashdmoe import reference
from flashdmoe.bench import baselines, hardware, metrics, report
from flashdmoe.bench.entries import describe_error
from flashdmoe.bench.expert_parallel import traffic_summary
from flashdmoe.bench.results import BenchShape, ConfigResult, EntryResult, SuiteResult
from flashdmoe.bench.suites import Suite, SuiteOptions, register_suite
from flashdmoe.bench.timing import TimingStats

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


def problem_for(planned: PlannedConfig, options: SuiteOptions, config_index: int):
    """The seeded :class:`flashdmoe.multiprocess.Problem` of configuration ``config_index``."""
    from flashdmoe.multiprocess import Problem

    shape = planned.shape
    return Problem(
        tokens=(shape.tokens,) * planned.world_size, hidden=shape.hidden, ffn=shape.ffn, experts=shape.experts,
        top_k=shape.top_k, activation=options.activation, normalize_topk=options.normalize_topk,
        capacity_factor=None, dtype=options.dtype, seed=options.seed + 1000 * config_index, near_tie_gap=0.0,
    )


# ---------------------------------------------------------------------------------------------------------
# The baseline's exchange (torch.distributed: NCCL on GPUs, gloo on CPUs)


def all_to_all_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    activation: str = "gelu",
    normalize_topk: bool = True,
    group=None,
    experts: str = "grouped_mm",
    traffic: dict | None = None,
) -> torch.Tensor:
    """This rank's MoE output through host-launched collectives (the unfused expert-parallel baseline).

    Collective over ``group`` (every rank calls it). Dropless; the router as
    :func:`flashdmoe.bench.baselines.route_top_k` (fp32; ``torch.topk`` decides ties).

    Args:
        x: ``[T, H]`` this rank's tokens (T may differ per rank, 0 allowed); bfloat16/float16/float32.
        router_weight: ``[E, H]`` replicated, x's dtype.
        w1: ``[L, H, I]`` (``[L, H, 2I]`` for swiglu) this rank's experts ``[rank L, (rank + 1) L)``,
            ``E = L * world_size``; w2: ``[L, I, H]``. For ``experts="grouped_mm"`` on CUDA: bfloat16.
        experts: ``"grouped_mm"`` (two ``torch._grouped_mm`` calls) or ``"reference"``
            (:func:`flashdmoe.reference.expert_ffn` per local expert, for CPU checks).
        traffic: if given, filled with ``rows_routed_remote``, ``dispatch_bytes``, ``combine_bytes``
            (rows to / results for other ranks, in bytes) and ``count_bytes`` (the count messages).

    Returns: ``y [T, H]`` in x's dtype.
    """
    import torch.distributed as dist

    if experts not in ("grouped_mm", "reference"):
        raise ValueError(f"experts={experts!r}: expected 'grouped_mm' or 'reference'")
    if x.dim() != 2 or router_weight.dim() != 2 or router_weight.shape[1] != x.shape[1]:
        raise ValueError(f"x.shape={tuple(x.shape)}, router_weight.shape={tuple(router_weight.shape)}: "
                         "expected [T, H] and [E, H]")
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens, hidden = x.shape
    num_experts, local = router_weight.shape[0], w1.shape[0]
    if local * world_size != num_experts:
        raise ValueError(f"w1.shape={tuple(w1.shape)}: expected {num_experts // max(world_size, 1)} local "
                         f"experts (E={num_experts} over {world_size} ranks)")
    if w2.dim() != 3 or w2.shape[0] != local or w2.shape[2] != hidden:
        raise ValueError(f"w2.shape={tuple(w2.shape)}: expected [{local}, I, {hidden}]")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: expected 1 <= top_k <= E ({num_experts})")
    device = x.device

    # Gate: choices ordered by global expert (so by destination rank, then local expert), then token.
    routing = baselines.route_top_k(x, router_weight, top_k, normalize_topk)
    sorted_experts, order = torch.sort(routing.experts.reshape(-1), stable=True)
    token_of_row = order // top_k
    rows = x.index_select(0, token_of_row)  # [T k, H]
    send_counts = torch.bincount(sorted_experts, minlength=num_experts)  # int64 [E]

    # Counts first (L per destination), then one copy of all counts to the host for the splits.
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    host = torch.cat([send_counts, recv_counts]).cpu()
    input_splits = host[:num_experts].view(world_size, local).sum(1).tolist()
    recv_host = host[num_experts:].view(world_size, local)  # [source rank, local expert]
    output_splits = recv_host.sum(1).tolist()

    # Dispatch: received rows are [source][local expert][row].
    received = rows.new_empty((sum(output_splits), hidden))
    dist.all_to_all_single(received, rows, output_splits, input_splits, group=group)

    # Experts: regroup by local expert (stable: source order within an expert), compute, put back.
    per_expert = recv_host.sum(0)  # [L]
    if received.shape[0]:
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=device).repeat(world_size), recv_counts.view(-1).to(device),
            output_size=received.shape[0])
        by_expert = torch.argsort(expert_of_row, stable=True)
        grouped = received.index_select(0, by_expert)
        if experts == "grouped_mm":
            if not baselines.grouped_mm_available():
                raise baselines.BaselineUnavailable(f"torch {torch.__version__} has no torch._grouped_mm")
            offsets = torch.cumsum(per_expert, 0).to(device=device, dtype=torch.int32)
            hidden_rows = baselines.activate(torch._grouped_mm(grouped, w1, offs=offsets), activation)
            outputs = torch._grouped_mm(hidden_rows, w2, offs=offsets).to(x.dtype)
        else:
            pieces = [reference.expert_ffn(piece, w1[e], w2[e], activation).to(x.dtype)
                      for e, piece in enumerate(grouped.split(per_expert.tolist()))]
            outputs = torch.cat(pieces)
        results = torch.empty_like(outputs).index_copy_(0, by_expert, outputs)
    else:
        results = received

    # Combine: results travel back to their sources, which form the weighted sum.
    returned = rows.new_empty((tokens * top_k, hidden))
    dist.all_to_all_single(returned, results.contiguous(), input_splits, output_splits, group=group)
    row_weights = routing.weights.reshape(-1).index_select(0, order)
    y = baselines._scatter_combine(tokens, token_of_row, returned, row_weights, x.dtype)
    if traffic is not None:
        row_bytes = hidden * x.element_size()
        remote_rows = tokens * top_k - input_splits[rank]
        traffic.update({
            "rank": rank, "rows_routed_remote": int(remote_rows), "dispatch_bytes": int(remote_rows * row_bytes),
            "combine_bytes": int((sum(output_splits) - output_splits[rank]) * row_bytes),
            "count_bytes": int((world_size - 1) * local * send_counts.element_size()),
        })
    return y


# ---------------------------------------------------------------------------------------------------------
# Checks against the reference (in the rank processes: each holds its own output)


def rank_reference_check(problem, rank: int, y: torch.Tensor, device=None) -> dict:
    """Compare rank ``rank``'s output ``y [T_r, H]`` with :func:`flashdmoe.reference.moe` over all
    ``E`` experts (computed on ``device``, default y's). Near-tie tokens (:data:`metrics.NEAR_TIE_LOG_GAP`)
    are left out. Returns ``max_abs_error``, ``max_abs_reference`` (over compared rows; inf error when y has
    a non-finite compared value), ``compared_tokens``, ``near_tie_tokens``."""
    device = torch.device(device) if device is not None else y.device
    inputs = problem.rank_inputs(rank)
    w1, w2 = problem.expert_weights(0, problem.experts)
    x, router = inputs.x.to(device), inputs.router_weight.to(device)
    with torch.no_grad():
        expected = reference.moe(x, router, w1.to(device), w2.to(device), top_k=problem.top_k,
                                 activation=problem.activation, normalize_topk=problem.normalize_topk)
        probs = reference.route(x, router, problem.top_k, problem.normalize_topk).probs
        keep = ~metrics.near_tie_mask(probs, problem.top_k)
        compared = int(keep.sum())
        if tuple(y.shape) != tuple(expected.shape):
            raise ValueError(f"y.shape={tuple(y.shape)}: expected {tuple(expected.shape)} (rank {rank})")
        if compared == 0:
            error, scale = 0.0, 0.0
        else:
            got, want = y.to(device)[keep].double(), expected[keep].double()
            scale = float(want.abs().max())
            error = float((got - want).abs().max()) if bool(torch.isfinite(got).all()) else math.inf
    return {"max_abs_error": error, "max_abs_reference": scale, "compared_tokens": compared,
            "near_tie_tokens": int(keep.numel() - compared)}


def combine_checks(checks: list[dict]) -> dict:
    """One relative error over all ranks: max of their ``max_abs_error`` over max of their
    ``max_abs_reference`` (as :func:`metrics.max_relative_error` on the concatenated outputs)."""
    error = max((c["max_abs_error"] for c in checks), default=0.0)
    scale = max((c["max_abs_reference"] for c in checks), default=0.0)
    return {"max_relative_error": error / scale if scale > 0 else error,
            "compared_tokens": sum(c["compared_tokens"] for c in checks),
            "near_tie_tokens": sum(c["near_tie_tokens"] for c in checks)}


def scenario_fused(context):
    """Rank scenario: :func:`flashdmoe.multiprocess.scenario_bench` (same params), then this rank's output
    checked against the reference (info ``check``); the output tensor is not returned."""
    from flashdmoe.multiprocess import Problem, scenario_bench

    context.params["return_output"] = True
    output = scenario_bench(context)
    y = output.tensors.pop("y")
    if context.params.get("check", True):
        context.phase("checking against the reference")
        problem = Problem.from_dict(context.params["problem"])
        output.info["check"] = rank_reference_check(problem, context.rank, y, context.device)
    return output


# ---------------------------------------------------------------------------------------------------------
# Results of one run


def entry_from_run(name: str, run, hidden: int, element_bytes: int) -> EntryResult:
    """An :class:`EntryResult` from a :class:`flashdmoe.multiprocess.RunResult` (or the EntryResult of a
    run that could not start): per timed forward the slowest rank's time, errors combined over ranks."""
    label = ENTRY_LABELS[name]
    if isinstance(run, EntryResult):
        return run
    details = {"world_size": run.world_size, "wall_s": round(run.elapsed_s, 1)}
    if not run.ok:
        reason = "; ".join(outcome.describe() for outcome in run.ranks if not outcome.ok)
        return EntryResult(name, label, "error", reason=reason, details=details | {
            "ranks": [outcome.describe() for outcome in run.ranks], "summary": run.summary()})
    infos = [outcome.info for outcome in run.ranks]
    per_run = [max(samples) for samples in zip(*(info["samples_ms"] for info in infos))]
    stats = TimingStats.from_samples(per_run)
    traffic = [dict(t) for info in infos for t in (info.get("traffic") or [])]
    details |= traffic_summary(traffic, hidden, element_bytes)
    details["rank_medians_ms"] = [info["median_ms"] for info in infos]
    details["input_sets"] = infos[0].get("input_sets")
    checks = [info.get("check") for info in infos]
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


def _run_entry(name: str, planned: PlannedConfig, problem, options: SuiteOptions):
    from flashdmoe import multiprocess

    params = {"problem": problem.to_dict(), "warmup": options.warmup, "repeats": options.repeats,
              "input_sets": options.input_sets, "max_input_sets": options.max_input_sets, "check": True}
    try:
        if name == "fused":
            reason = multiprocess.nvshmem_unavailable_reason()
            if reason:
                return EntryResult(name, ENTRY_LABELS[name], "unavailable", reason=reason,
                                   details={"world_size": planned.world_size})
            return multiprocess.run_ranks(
                "flashdmoe.bench.multi_gpu:scenario_fused", planned.world_size, params=params, mps=False,
                one_gpu_per_rank=True, timeout_s=RUN_TIMEOUT_S)
        params |= {"backend": "nccl", "experts": "grouped_mm"}
        return multiprocess.run_ranks("nccl_bench", planned.world_size, params=params, nvshmem=False, mps=False,
                                      one_gpu_per_rank=True, timeout_s=RUN_TIMEOUT_S)
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
            runs[(index, name)] = _run_entry(name, planned, problem, options)
    device = torch.device("cuda", 0)
    ceiling_tflops = None
    try:
        console.log("measuring the bf16 matmul ceiling (8192^3) on cuda:0")
        ceiling_tflops, _ = hardware.measure_matmul_ceiling(device)
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


def _detail(entry: EntryResult, key: str):
    return (entry.details or {}).get(key)


def _ratio_cell(key: str, percent: bool = False):
    def cell(config, entry) -> str:
        value = _detail(entry, key)
        if value is None:
            return "–"
        return f"{100.0 * value:.1f}%" if percent else f"{value:.2f}x"
    return cell


def _studies_cell(config, entry) -> str:
    return ",".join((config.details or {}).get("studies", [])) or "–"


def _sent_cell(config, entry) -> str:
    value = _detail(entry, "max_bytes_sent_per_rank")
    return "–" if value is None else f"{value / 1e6:.2f}"


def _spread_cell(config, entry) -> str:
    return "–" if entry.p10_ms is None else f"{entry.p10_ms:.3f}–{entry.p90_ms:.3f}"


MULTI_GPU_LAYOUT = report.Layout(
    markdown=(
        report.Column("study", _studies_cell, "left"),
        report.Column("entry", lambda config, entry: entry.label, "left"),
        report.Column("ms (median)", lambda config, entry: report._number(entry.median_ms, 3)),
        report.Column("p10–p90 ms", _spread_cell),
        report.Column("TFLOP/s", lambda config, entry: report._tflops_cell(entry.tflops)),
        report.Column("% of ceiling", lambda config, entry: report._number(entry.percent_of_ceiling, 1)),
        report.Column("overlap eff.", _ratio_cell("overlap_efficiency", percent=True)),
        report.Column("vs NCCL", _ratio_cell("vs_nccl")),
        report.Column("sent MB / rank (max)", _sent_cell),
        report.Column("payload eff.", _ratio_cell("payload_efficiency", percent=True)),
        report.Column("max rel. error", lambda config, entry: report._error_cell(entry)),
        report.Column("status", lambda config, entry: report._status_cell(entry), "left"),
    ),
    terminal=(
        report.Column("entry", lambda config, entry: entry.name, "left"),
        report.Column("ms", lambda config, entry: report._number(entry.median_ms, 3)),
        report.Column("TFLOP/s", lambda config, entry: report._tflops_cell(entry.tflops)),
        report.Column("overlap", _ratio_cell("overlap_efficiency", percent=True)),
        report.Column("vs NCCL", _ratio_cell("vs_nccl")),
        report.Column("MB/rank", _sent_cell),
        report.Column("payload", _ratio_cell("payload_efficiency", percent=True)),
        report.Column("rel err", lambda config, entry: report._error_cell(entry)),
        report.Column("status", lambda config, entry: report._status_cell(entry, report.REASON_WIDTH_IN_TERMINAL),
                      "left"),
    ),
)
report.register_layout(SUITE_NAME, MULTI_GPU_LAYOUT)

register_suite(
    Suite(
        name=SUITE_NAME,
        description="fused kernel on 2/4/8 GPUs (one process per GPU) beside an NCCL all_to_all baseline",
        runner=run_multi_gpu,
        default_shapes=MULTI_GPU_SHAPES,
        quick_shapes=MULTI_GPU_QUICK_SHAPES,
        entry_names=ENTRY_NAMES,
        validate=validate_options,
    )
)
