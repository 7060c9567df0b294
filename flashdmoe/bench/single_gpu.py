"""The ``single-gpu`` suite: the fused kernel beside the unfused baselines on one device (torch
``grouped_mm``, a per-expert loop, the reference), each timed on rotated input sets and checked against
:func:`flashdmoe.reference.moe`. Entries with a kernel of their own (the fused ones) also get its time
alone from the profiler, in a pass after their timed runs (:mod:`flashdmoe.bench.kernel_profile`). A
configuration's entries are timed in turns (``TIMING_ROUNDS`` rounds, :func:`flashdmoe.bench.timing.measure_in_turns`),
so that clock drift during a heavy row falls on all of them alike.

Each configuration may carry its own activation (``--configs 'T,H,I,E,k,swiglu'`` or a named set);
when a run mixes activations, ``act`` joins the shape columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdmoe import reference
from flashdmoe.bench import hardware, kernel_profile, metrics
from flashdmoe.bench.entries import (
    ENTRY_TYPES,
    BenchEntry,
    EntryUnavailable,
    MoEInputs,
    MoEProblem,
    PreparedRun,
    describe_error,
)
from flashdmoe.bench.results import BenchConfig, BenchShape, ConfigResult, EntryResult, SuiteResult
from flashdmoe.bench.suite import Suite, SuiteOptions
from flashdmoe.bench.timing import TurnTimings, measure_in_turns
from flashdmoe.bench.workload import (
    free_device_memory,
    input_set_bytes,
    rotated_input_sets,
    sets_that_fit,
    torch_dtype,
)

SINGLE_GPU_SHAPES = (
    BenchShape(8192, 2048, 2048, 32, 2),  # the FlashDMoE paper's per-GPU problem
    BenchShape(16384, 2048, 2048, 64, 2),
    BenchShape(16384, 4096, 1024, 128, 2),
    BenchShape(4096, 2048, 2048, 64, 2),
    BenchShape(128, 4096, 1408, 64, 6),  # decode-sized: bound by reading the active experts
)
QUICK_SHAPES = (BenchShape(64, 64, 128, 8, 2), BenchShape(40, 32, 64, 4, 1))

# The forward targets' table, in its order: the shapes above in gelu, then swiglu model layers.
TARGETS_GELU = tuple(BenchConfig(shape, "gelu") for shape in SINGLE_GPU_SHAPES)
TARGETS_SWIGLU = (
    BenchConfig(BenchShape(4096, 4096, 14336, 8, 2), "swiglu"),  # Mixtral 8x7B
    BenchConfig(BenchShape(8192, 2048, 768, 128, 8), "swiglu"),  # Qwen3-30B-A3B
    BenchConfig(BenchShape(16384, 2048, 1408, 64, 6), "swiglu"),  # DeepSeek-V2-Lite
    BenchConfig(BenchShape(8192, 7168, 2048, 256, 8), "swiglu"),  # a DeepSeek-V3 layer: 22.5 GB of weights
    BenchConfig(BenchShape(4096, 2048, 1024, 64, 8), "swiglu"),  # OLMoE
    BenchConfig(BenchShape(1, 2048, 768, 128, 8), "swiglu"),  # decode, Qwen3-30B-A3B's layer
    BenchConfig(BenchShape(32, 7168, 2048, 256, 8), "swiglu"),  # decode, DeepSeek-V3's layer
    BenchConfig(BenchShape(128, 4096, 1408, 64, 6), "swiglu"),  # decode
)
NAMED_CONFIGS = {
    "targets": TARGETS_GELU + TARGETS_SWIGLU,
    "targets-gelu": TARGETS_GELU,
    "targets-swiglu": TARGETS_SWIGLU,
}


def run_single_gpu(options: SuiteOptions) -> SuiteResult:
    """Time every entry on every shape; peaks measured first in the same process."""
    device = torch.device(options.device)
    dtype = torch_dtype(options.dtype)
    console = options.console
    ceiling_tflops = hardware.suite_matmul_ceiling(device, console)
    console.log("measuring copy bandwidth")
    copy_bandwidth, _ = hardware.measure_copy_bandwidth(device)

    activations = [options.activation_of(index) for index in range(len(options.shapes))]
    mixed = len(set(activations)) > 1
    configs = []
    for config_index, (shape, activation) in enumerate(zip(options.shapes, activations)):
        problem = MoEProblem(shape.top_k, activation, options.normalize_topk)
        console.log(f"[{config_index + 1}/{len(options.shapes)}] {shape.label} {activation}")
        with torch.no_grad():  # forward-only benchmark: no autograd bookkeeping in any entry
            config = _run_single_gpu_config(
                shape, config_index, problem, dtype, device, options, copy_bandwidth, ceiling_tflops,
            )
        if mixed:
            config.shape["act"] = activation
        configs.append(config)
        free_device_memory(device)

    return SuiteResult(
        suite=options.suite,
        machine=hardware.machine_info(device),
        settings={
            "device": str(device),
            "dtype": options.dtype,
            "activation": "per configuration (column act)" if mixed else activations[0],
            "normalize_topk": options.normalize_topk,
            "repeats": options.repeats,
            "warmup": options.warmup,
            "seed": options.seed,
            "entries": list(options.entries),
            "reference_max_tokens": options.reference_max_tokens,
            "error_tolerance": metrics.ERROR_TOLERANCES[options.dtype],
            "near_tie_log_gap": metrics.NEAR_TIE_LOG_GAP,
            "flops_formula": "2*T*k*H*I*(2, or 3 for swiglu) + 2*T*H*E",
            "bytes_floor_formula": "(active experts' W1+W2 bytes + x bytes + y bytes) / copy bandwidth, "
                                   "active experts = the distinct experts the reference router picks on each "
                                   "input set, averaged over the sets",
            "notes": [f"kernel ms (profiler) = median device time of the fused entries' moe_forward_kernel per "
                      f"launch, from torch.profiler over {kernel_profile.PROFILED_CALLS} calls after the timed "
                      f"runs (the timed ms also count what else a call puts on the stream)"],
        },
        configs=configs,
        ceiling_tflops=ceiling_tflops,
        copy_bandwidth_gbps=copy_bandwidth / 1e9,
    )


def _run_single_gpu_config(
    shape: BenchShape,
    config_index: int,
    problem: MoEProblem,
    dtype: torch.dtype,
    device: torch.device,
    options: SuiteOptions,
    copy_bandwidth: float,
    ceiling_tflops: float | None,
) -> ConfigResult:
    activation = problem.activation
    element = dtype.itemsize
    output_bytes = shape.tokens * shape.hidden * element
    count, limit = options.input_sets, options.max_input_sets
    fit = _input_sets_that_fit(shape, activation, dtype, device)
    if fit is not None:
        limit = min(limit, fit)
        if count is not None and count > fit:
            options.console.log(f"    --input-sets {count}: {fit} fit in device memory with this shape")
            count = fit
    input_sets = rotated_input_sets(
        shape, activation=activation, dtype=dtype, device=device,
        seed=options.seed + 1000 * config_index, count=count, limit=limit,
        extra_bytes_per_set=output_bytes,
    )

    # The oracle's answer and routing on set 0 (untimed); active experts counted on every set.
    first = input_sets[0]
    expected = reference.moe(first.x, first.router_weight, first.w1, first.w2, **problem.kwargs())
    routing = reference.route(first.x, first.router_weight, shape.top_k, options.normalize_topk)
    near_ties = metrics.near_tie_mask(routing.probs, shape.top_k)
    compare_rows = ~near_ties
    active_experts = [metrics.active_expert_count(routing.experts)] + [
        metrics.active_expert_count(
            reference.route(s.x, s.router_weight, shape.top_k, options.normalize_topk).experts
        )
        for s in input_sets[1:]
    ]
    # The floor counts the experts actually routed to (what a forward on these inputs must read), not the
    # expectation under uniform routing; both are in the JSON.
    floor_bytes = round(
        sum(
            metrics.bytes_floor(active, shape.tokens, shape.hidden, shape.ffn, activation, element)
            for active in active_experts
        )
        / len(active_experts)
    )
    floor_ms = floor_bytes / copy_bandwidth * 1e3
    flops = metrics.moe_flops(
        shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k, activation
    )
    tolerance = metrics.ERROR_TOLERANCES[options.dtype]

    entries = _run_entries(
        [ENTRY_TYPES[name]() for name in options.entries], shape, input_sets, problem, expected, compare_rows,
        device, options,
    )
    for result in entries:
        if result.status == "ok":
            result.tflops = metrics.tflops(flops, result.median_ms)
            if ceiling_tflops:
                result.percent_of_ceiling = 100.0 * result.tflops / ceiling_tflops
            result.percent_of_floor = 100.0 * floor_ms / result.median_ms
            result.error_tolerance = tolerance
            result.correct = result.max_relative_error <= tolerance
        options.console.log(
            f"    {result.label}: "
            + (f"{result.median_ms:.3f} ms, err {result.max_relative_error:.2e}{_profile_text(result)}"
               if result.status == "ok" else f"{result.status}: {result.reason}")
        )

    config = ConfigResult(
        label=shape.label,
        shape=shape.to_dict(),
        activation=activation,
        dtype=options.dtype,
        flops=flops,
        input_sets=len(input_sets),
        entries=entries,
        bytes_floor=floor_bytes,
        floor_ms=floor_ms,
        compared_tokens=int(compare_rows.sum()),
        near_tie_tokens=int(near_ties.sum()),
        details={
            "active_experts_per_set": active_experts,
            "expected_active_experts": metrics.expected_active_experts(shape.tokens, shape.experts, shape.top_k),
        },
    )
    _add_speedups(config)
    return config


def _profile_text(result: EntryResult) -> str:
    """``"; profiled per call: kernel K, other O, idle I ms"`` where the profiler recorded them, else ``""``."""
    profile = (result.details or {}).get("kernel_profile") or {}
    if result.kernel_ms is None or profile.get("span_ms") is None:
        return ""
    return (f"; profiled per call: kernel {result.kernel_ms:.3f}, other {profile['other_ms']:.3f}, "
            f"idle {profile['idle_ms']:.3f} ms")


def _input_sets_that_fit(
    shape: BenchShape, activation: str, dtype: torch.dtype, device: torch.device
) -> int | None:
    """On CUDA, how many input sets the device can hold at once (None elsewhere). Held per set: the set, its
    output, and grouped_mm's copy of its weights in another layout; coming and going beside them: the
    oracle's float32 copy of one set's weights and its per-choice rows. A DeepSeek-V3 layer (22.5 GB of
    bf16 weights) gets at most 2 sets on a 141 GB H200."""
    if device.type != "cuda":
        return None
    element = dtype.itemsize
    weights = metrics.bytes_floor(shape.experts, 0, shape.hidden, shape.ffn, activation, element)  # all experts
    w1_cols = 2 * shape.ffn if activation == "swiglu" else shape.ffn
    per_set = input_set_bytes(shape, activation, element) + shape.tokens * shape.hidden * element + weights
    oracle = weights * 4 // element + shape.tokens * shape.top_k * (shape.hidden + w1_cols) * 4
    free_bytes, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # torch's, reusable
    return sets_that_fit(per_set, oracle, free_bytes + cached)


@dataclass
class _LiveEntry:
    """An entry prepared and checked, waiting for its timed runs."""

    entry: BenchEntry
    prepared: list[PreparedRun]
    max_relative_error: float


def _prepare_entry(
    entry: BenchEntry,
    shape: BenchShape,
    input_sets: list[MoEInputs],
    problem: MoEProblem,
    expected: torch.Tensor,
    compare_rows: torch.Tensor,
    options: SuiteOptions,
) -> _LiveEntry | EntryResult:
    """The entry's prepared runs and its error on set 0, or the row saying why it does not run."""
    if (
        entry.name == "reference"
        and options.reference_max_tokens is not None
        and shape.tokens > options.reference_max_tokens
    ):
        return EntryResult(
            entry.name, entry.label, "skipped",
            reason=f"T={shape.tokens} > --reference-max-tokens {options.reference_max_tokens}",
        )
    try:
        with torch.no_grad():
            prepared = [entry.prepare(inputs, problem) for inputs in input_sets]
    except EntryUnavailable as error:
        return EntryResult(entry.name, entry.label, "unavailable", reason=str(error))
    except Exception as error:  # one broken entry must not cost the rest of the GPU run
        return EntryResult(entry.name, entry.label, "error", reason=describe_error(error))
    try:
        with torch.no_grad(), entry.timing_context():
            output = prepared[0].run()
            error_report = metrics.max_relative_error(output, expected, compare_rows)
            del output
    except Exception as error:
        return EntryResult(entry.name, entry.label, "error", reason=describe_error(error))
    return _LiveEntry(entry, prepared, error_report.max_relative_error)


def _run_entries(
    entries: list[BenchEntry],
    shape: BenchShape,
    input_sets: list[MoEInputs],
    problem: MoEProblem,
    expected: torch.Tensor,
    compare_rows: torch.Tensor,
    device: torch.device,
    options: SuiteOptions,
) -> list[EntryResult]:
    """Every entry prepared and checked, then timed in rounds (TIMING_ROUNDS), then profiled; one result
    per entry, in order. Each round is warmed up: the first by ``options.warmup`` runs, the later ones by
    one (the runs before were another entry's)."""
    outcomes = [
        _prepare_entry(entry, shape, input_sets, problem, expected, compare_rows, options) for entry in entries
    ]
    live = [outcome for outcome in outcomes if isinstance(outcome, _LiveEntry)]
    with torch.no_grad():
        turns = measure_in_turns(
            [[(p.run,) for p in timed.prepared] for timed in live], device=device, warmup=options.warmup,
            repeats=options.repeats, contexts=[timed.entry.timing_context for timed in live],
            clock=lambda: hardware.sm_clock_mhz(device),
        )
    timed_results = iter([_timed_result(timed, turn, device) for timed, turn in zip(live, turns)])
    return [next(timed_results) if isinstance(outcome, _LiveEntry) else outcome for outcome in outcomes]


def _timed_result(timed: _LiveEntry, turn: TurnTimings, device: torch.device) -> EntryResult:
    """The result row of an entry that was timed: its statistics over every round, its SM clock after each
    round (``details["sm_clock_mhz"]``, where the driver reports it) and its profiled kernel time."""
    entry = timed.entry
    if turn.error is not None:
        return EntryResult(entry.name, entry.label, "error", reason=describe_error(turn.error))
    stats = turn.timings.total
    details = dict(timed.prepared[0].details)
    if turn.clocks:
        details["sm_clock_mhz"] = list(turn.clocks)
    kernel_ms = None
    if entry.profiled_kernel is not None:
        with torch.no_grad(), entry.timing_context():
            kernel = kernel_profile.profile_kernel(
                [p.run for p in timed.prepared], device=device, kernel_name=entry.profiled_kernel
            )
        kernel_ms = kernel.milliseconds
        details["kernel_profile"] = {"kernel": entry.profiled_kernel, **kernel.details()}
    return EntryResult(
        entry.name,
        entry.label,
        "ok",
        median_ms=stats.median_ms,
        p10_ms=stats.p10_ms,
        p90_ms=stats.p90_ms,
        samples_ms=list(stats.samples_ms),
        kernel_ms=kernel_ms,
        max_relative_error=timed.max_relative_error,
        details=details,
    )


def _add_speedups(config: ConfigResult) -> None:
    """speed-up over grouped_mm = grouped_mm median / entry median, for every timed entry."""
    baseline = config.entry("grouped_mm")
    if baseline is None or baseline.status != "ok":
        return
    for entry in config.entries:
        if entry.status == "ok":
            entry.speedup_over_grouped_mm = baseline.median_ms / entry.median_ms


SUITE = Suite(
    name="single-gpu",
    description="fused kernel vs torch grouped_mm, per-expert loop and reference on one device",
    runner=run_single_gpu,
    default_shapes=SINGLE_GPU_SHAPES,
    quick_shapes=QUICK_SHAPES,
    entry_names=("fused", "fused_graph", "grouped_mm", "per_expert_loop", "reference"),
    per_config_activation=True,
    named_configs=NAMED_CONFIGS,
)
