"""The ``expert-parallel`` suite: what the expert-parallel protocol costs on one GPU (issue 4, item 5).

Every entry computes the same total problem: ``T`` tokens (split as evenly as possible over the ranks,
:func:`flashdmoe.ranks.split_tokens`), ``E`` experts (rank ``r`` owns ``[r L, (r + 1) L)``), ``k``:

* ``single`` -- ``flashdmoe.moe(x, ..., backend="cuda")`` on all tokens, no team (the single-GPU kernel);
* ``emulated-P`` (P = 1, 2, 4, 8) -- ``flashdmoe.moe_expert_parallel`` over ``Team.emulated(P)``: P virtual
  ranks in one launch, every dispatched row and combined result going through the symmetric buffers;
  ``emulated-1`` is the baseline of the "vs P=1" column (the protocol's overhead);
* ``mps-P`` (P = 2, 4) -- P processes sharing the GPU under MPS, each one rank of a ``Team.nvshmem`` team
  (:func:`flashdmoe.ranks.run_ranks` of :func:`flashdmoe.bench.rank_scenarios.timed_fused_forwards`); a
  forward's time is the slowest rank's (per run, the maximum over ranks of their CUDA-event times: the
  forwards are collective); the kernel reaches its peers through peer pointers (``peer_transport="p2p"``);
* ``mps-P-nvshmem`` -- the same processes on the NVSHMEM build (``FLASHDMOE_KERNEL_BUILD=nvshmem``) with
  ``peer_transport="nvshmem"``: every peer is reached through NVSHMEM puts, so beside ``mps-P`` it is the
  forward's latency per transport; its rows also report the bytes that went through NVSHMEM;
* ``mps-4-2nodes`` -- 4 processes as 2 nodes of 2 (stores within a node, puts across), and
  ``mps-4-2nodes-hierarchical`` the same with ``exchange="hierarchical"`` (a token's row crosses to the
  other node once, to a relay there; docs/design.md §8): the forward per cross-node exchange;
* ``reference`` -- ``flashdmoe.reference.moe`` on all tokens (the oracle; the one entry a CPU runs).

Inputs come from :class:`flashdmoe.ranks.Problem` (seeded piece by piece), so the rank processes
build exactly the tokens and experts this process uses for the reference answer. Times are medians of
CUDA events after warm-up, through the public API as users call it; input sets are rotated as in
the single-gpu suite. Traffic comes from ``flashdmoe.last_report().traffic()`` after one forward on input
set 0: bytes sent per rank (dispatch + combine) and payload efficiency (dispatched bytes over
``rows_routed_remote * H * element size``, summed over ranks: 1 when only routed rows travel).

The multi-process runs go first, before this process touches the GPU: the MPS server then starts with the
GPU to itself and this process holds no device memory while they run.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from flashdmoe import reference
from flashdmoe.bench import hardware, metrics, rank_scenarios, report
from flashdmoe.bench.entries import MoEInputs, describe_error
from flashdmoe.bench.rank_results import failure_details, failure_reason, timed_run_summary, traffic_summary
from flashdmoe.bench.results import BenchShape, ConfigResult, EntryResult, SuiteResult
from flashdmoe.bench.suite import Suite, SuiteOptions
from flashdmoe.bench.timing import cache_bytes, input_sets_for_cache, measure
from flashdmoe.bench.workload import torch_dtype
from flashdmoe.parallel.mps import MpsDaemon, mps_available
from flashdmoe.ranks import Problem, nvshmem_unavailable_reason, run_ranks, scenarios, split_tokens

SUITE_NAME = "expert-parallel"
EMULATED_RANKS = (1, 2, 4, 8)
MPS_RANKS = (2, 4)
# The kernel's transports to peers (Team.nvshmem's peer_transport); "p2p" is the plain mps-P entry.
MPS_TRANSPORTS = ("p2p", "nvshmem")
# "mps-4-2nodes": 4 processes as 2 nodes of 2 (Team.nvshmem ranks_per_node=2, "auto"): stores within a
# node, NVSHMEM puts across, the transports of a team across real nodes.
TWO_NODES = "2nodes"
ENTRY_NAMES = ("single", *(f"emulated-{p}" for p in EMULATED_RANKS),
               *(f"mps-{p}" if transport == "p2p" else f"mps-{p}-{transport}"
                 for p in MPS_RANKS for transport in MPS_TRANSPORTS), f"mps-4-{TWO_NODES}",
               f"mps-4-{TWO_NODES}-hierarchical", "reference")
# The environment of an NVSHMEM-transport rank process: it imports flashdmoe_cuda from the NVSHMEM build.
NVSHMEM_BUILD_ENV = {"FLASHDMOE_KERNEL_BUILD": "nvshmem"}
# The FlashDMoE paper's per-GPU problem as the total, and a smaller one (E = 32: every P up to 8 divides it).
EP_SHAPES = (BenchShape(8192, 2048, 2048, 32, 2), BenchShape(2048, 1024, 1024, 32, 2))
EP_QUICK_SHAPES = (BenchShape(64, 64, 128, 8, 2), BenchShape(96, 128, 64, 16, 4))
MPS_RUN_TIMEOUT_S = 600.0
KERNEL_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class EntrySpec:
    """name: as in --entries; kind: single | emulated | mps | reference; world_size: P; peer_transport:
    the team's transport to its peers (mps entries only: "p2p", "nvshmem" or "auto"); ranks_per_node: the
    team's emulated node layout (Team.nvshmem), or None; exchange: how rows cross nodes (Team.nvshmem)."""

    name: str
    kind: str
    world_size: int
    label: str
    peer_transport: str | None = None
    ranks_per_node: int | None = None
    exchange: str = "direct"

    @property
    def needs_nvshmem_build(self) -> bool:
        return self.peer_transport == "nvshmem" or self.ranks_per_node is not None


def entry_spec(name: str) -> EntrySpec:
    if name == "single":
        return EntrySpec(name, "single", 1, "fused, no team")
    if name == "reference":
        return EntrySpec(name, "reference", 1, "reference loop")
    kind, _, rest = name.partition("-")
    count, _, transport = rest.partition("-")
    if kind == "emulated" and not transport and count.isdigit() and int(count) in EMULATED_RANKS:
        return EntrySpec(name, "emulated", int(count), f"emulated P={count}")
    if kind == "mps" and count.isdigit() and int(count) in MPS_RANKS and transport in ("", *MPS_TRANSPORTS[1:]):
        if not transport:
            return EntrySpec(name, "mps", int(count), f"{count} processes (MPS)", "p2p")
        return EntrySpec(name, "mps", int(count), f"{count} processes (MPS), {transport}", transport)
    if name == f"mps-4-{TWO_NODES}":
        return EntrySpec(name, "mps", 4, "4 processes (MPS) as 2 nodes of 2: p2p within, nvshmem across", "auto", 2)
    if name == f"mps-4-{TWO_NODES}-hierarchical":
        return EntrySpec(name, "mps", 4, "4 processes (MPS) as 2 nodes of 2, hierarchical exchange", "auto", 2,
                         "hierarchical")
    raise ValueError(f"entry {name!r}: expected one of {list(ENTRY_NAMES)}")


def validate_options(options: SuiteOptions) -> None:
    """Every selected P must divide every shape's E (each rank owns E / P experts)."""
    for shape in options.shapes:
        for name in options.entries:
            world_size = entry_spec(name).world_size
            if shape.experts % world_size:
                raise ValueError(
                    f"--configs {shape.label}: E={shape.experts} is not divisible by P={world_size} "
                    f"(entry {name}); use E a multiple of {world_size} or leave {name} out with --entries"
                )


def problem_for(shape: BenchShape, world_size: int, options: SuiteOptions, config_index: int,
                set_index: int = 0) -> Problem:
    """The seeded :class:`flashdmoe.ranks.Problem` of input set ``set_index`` split over ``world_size``."""
    return Problem(
        tokens=tuple(split_tokens(shape.tokens, world_size)), hidden=shape.hidden, ffn=shape.ffn,
        experts=shape.experts, top_k=shape.top_k, activation=options.activation,
        normalize_topk=options.normalize_topk, capacity_factor=None, dtype=options.dtype,
        seed=options.seed + 1000 * config_index + set_index, near_tie_gap=0.0,
    )


def _entry_details(spec: EntrySpec) -> dict:
    details = {"world_size": spec.world_size, "transport": spec.kind}
    if spec.peer_transport is not None:
        details["peer_transport"] = spec.peer_transport
    if spec.ranks_per_node is not None:
        details["ranks_per_node"] = spec.ranks_per_node
    if spec.exchange != "direct":
        details["exchange"] = spec.exchange
    return details


def _unavailable(spec: EntrySpec, reason: str) -> EntryResult:
    return EntryResult(spec.name, spec.label, "unavailable", reason=reason, details=_entry_details(spec))


def _nvshmem_build_reason() -> str | None:
    """Why the NVSHMEM build cannot serve the nvshmem entries here, or ``None`` once it is built (here, so
    that no rank process builds it inside its timed run)."""
    from flashdmoe.kernel import extension

    reason = extension.nvshmem_problem()
    if reason:
        return reason
    try:
        extension.build_nvshmem()
    except Exception as error:
        return f"the NVSHMEM build failed: {describe_error(error)}"
    return None


def _kernel_unavailable_reason(options: SuiteOptions) -> str | None:
    if torch.device(options.device).type != "cuda":
        return "needs a CUDA device (--device cuda)"
    if options.dtype not in KERNEL_DTYPES:
        return f"the fused kernel runs {' and '.join(KERNEL_DTYPES)}, not {options.dtype}"
    return None


# ---------------------------------------------------------------------------------------------------------
# Multi-process runs (first, before this process uses the GPU)


def _run_mps_entries(options: SuiteOptions, names: list[str]) -> dict[tuple[int, str], object]:
    """(config index, entry name) -> RunResult of :func:`~flashdmoe.bench.rank_scenarios.timed_fused_forwards`,
    or an EntryResult if it could not run."""
    specs = [entry_spec(name) for name in names]
    reason = _kernel_unavailable_reason(options) or nvshmem_unavailable_reason() or mps_available()
    if reason:
        return {(index, spec.name): _unavailable(spec, reason)
                for index in range(len(options.shapes)) for spec in specs}
    out: dict[tuple[int, str], object] = {}
    if any(spec.needs_nvshmem_build for spec in specs):
        reason = _nvshmem_build_reason()
        if reason:
            for spec in [spec for spec in specs if spec.needs_nvshmem_build]:
                specs.remove(spec)
                out |= {(index, spec.name): _unavailable(spec, reason) for index in range(len(options.shapes))}
    if not specs:
        return out
    daemon = MpsDaemon()
    try:
        daemon.start()
    except Exception as error:
        reason = f"the MPS daemon did not start: {describe_error(error)}"
        daemon.stop()
        return out | {(index, spec.name): _unavailable(spec, reason)
                      for index in range(len(options.shapes)) for spec in specs}
    try:
        for index, shape in enumerate(options.shapes):
            for spec in specs:
                options.console.log(f"[{index + 1}/{len(options.shapes)}] {shape.label}: {spec.label}")
                problem = problem_for(shape, spec.world_size, options, index)
                params = {"problem": problem.to_dict(), "warmup": options.warmup, "repeats": options.repeats,
                          "input_sets": options.input_sets, "max_input_sets": options.max_input_sets}
                try:
                    out[(index, spec.name)] = run_ranks(
                        rank_scenarios.timed_fused_forwards, spec.world_size, params=params, mps=daemon,
                        timeout_s=MPS_RUN_TIMEOUT_S, **mps_run_kwargs(spec, problem))
                except Exception as error:
                    out[(index, spec.name)] = EntryResult(
                        spec.name, spec.label, "error", reason=describe_error(error), details=_entry_details(spec))
    finally:
        daemon.stop()
    return out


def mps_run_kwargs(spec: EntrySpec, problem: Problem) -> dict:
    """The :func:`~flashdmoe.ranks.run_ranks` arguments that choose the entry's transport: the team's
    ``peer_transport`` (and node layout) and, where a peer goes by puts, the NVSHMEM build in the rank
    processes."""
    kwargs = {"team": {**problem.team_kwargs(), "peer_transport": spec.peer_transport or "p2p"}}
    if spec.ranks_per_node is not None:
        kwargs["team"]["ranks_per_node"] = spec.ranks_per_node
    if spec.exchange != "direct":
        kwargs["team"]["exchange"] = spec.exchange
    if spec.needs_nvshmem_build:
        kwargs["env"] = dict(NVSHMEM_BUILD_ENV)
    return kwargs


def _mps_entry(spec: EntrySpec, run, shape: BenchShape, expected, compare_rows, device, element_bytes) -> EntryResult:
    if isinstance(run, EntryResult):
        return run
    details = _entry_details(spec) | {"wall_s": round(run.elapsed_s, 1)}
    if not run.ok:
        return EntryResult(spec.name, spec.label, "error", reason=failure_reason(run),
                           details=details | failure_details(run))
    stats, summary = timed_run_summary(run, shape.hidden, element_bytes)
    details |= summary
    output = torch.cat([outcome.tensors["y"] for outcome in run.ranks]).to(device)
    error = metrics.max_relative_error(output, expected, compare_rows)
    return EntryResult(spec.name, spec.label, "ok", median_ms=stats.median_ms, p10_ms=stats.p10_ms,
                       p90_ms=stats.p90_ms, samples_ms=list(stats.samples_ms),
                       max_relative_error=error.max_relative_error, details=details)


# ---------------------------------------------------------------------------------------------------------
# In-process entries


# this process's latest fused launch (the rank scenarios' reader)
_last_traffic = scenarios.last_traffic


def _in_process_entry(spec: EntrySpec, shape: BenchShape, input_sets: list[MoEInputs], options: SuiteOptions,
                      expected, compare_rows, device, element_bytes) -> EntryResult:
    details = _entry_details(spec)
    kwargs = {"top_k": shape.top_k, "activation": options.activation, "normalize_topk": options.normalize_topk}
    team = None
    if spec.kind == "reference":
        if options.reference_max_tokens is not None and shape.tokens > options.reference_max_tokens:
            return EntryResult(spec.name, spec.label, "skipped", details=details,
                               reason=f"T={shape.tokens} > --reference-max-tokens {options.reference_max_tokens}")
        runs = [lambda s=s: reference.moe(s.x, s.router_weight, s.w1, s.w2, **kwargs) for s in input_sets]
        gather = lambda out: out  # noqa: E731
    else:
        reason = _kernel_unavailable_reason(options)
        if reason:
            return _unavailable(spec, reason)
        import flashdmoe
        from flashdmoe.errors import BackendUnavailable

        if spec.kind == "single":
            runs = [lambda s=s: flashdmoe.moe(s.x, s.router_weight, s.w1, s.w2, backend="cuda", **kwargs)
                    for s in input_sets]
            gather = lambda out: out  # noqa: E731
        else:
            forward = getattr(flashdmoe, "moe_expert_parallel", None)
            if forward is None:
                return _unavailable(spec, "flashdmoe.moe_expert_parallel is not in this build")
            from flashdmoe.parallel.team import Team

            P = spec.world_size
            splits = split_tokens(shape.tokens, P)
            try:
                team = Team.emulated(P, max_tokens=max(1, max(splits)), hidden=shape.hidden, top_k=shape.top_k,
                                     local_experts=shape.experts // P, dtype=torch_dtype(options.dtype),
                                     device=device)
            except (ValueError, RuntimeError) as error:
                return _unavailable(spec, describe_error(error))
            details["buffer_bytes_per_rank"] = team.buffer_bytes
            sharded = [(list(s.x.split(splits)), s.router_weight, list(s.w1.chunk(P)), list(s.w2.chunk(P)))
                       for s in input_sets]
            runs = [lambda a=a: forward(a[0], a[1], a[2], a[3], team=team, **kwargs) for a in sharded]
            gather = torch.cat
        try:
            with torch.no_grad():
                runs[0]()  # probe: unsupported shapes or a missing build are "unavailable", not errors
        except (BackendUnavailable, ValueError, NotImplementedError) as error:
            if team is not None:
                team.close()
            return _unavailable(spec, describe_error(error))
        except Exception as error:
            if team is not None:
                team.close()
            return EntryResult(spec.name, spec.label, "error", reason=describe_error(error), details=details)
    try:
        with torch.no_grad():
            output = gather(runs[0]())  # checked (not deferred): last_traffic is this forward's
            if spec.kind != "reference":
                details |= traffic_summary(_last_traffic() if spec.kind == "emulated" else [],
                                           shape.hidden, element_bytes)
            error = metrics.max_relative_error(output, expected, compare_rows)
            del output
            stats = measure(runs, device=device, warmup=options.warmup, repeats=options.repeats)
    except Exception as failure:
        return EntryResult(spec.name, spec.label, "error", reason=describe_error(failure), details=details)
    finally:
        if team is not None:
            team.close()
    return EntryResult(spec.name, spec.label, "ok", median_ms=stats.median_ms, p10_ms=stats.p10_ms,
                       p90_ms=stats.p90_ms, samples_ms=list(stats.samples_ms),
                       max_relative_error=error.max_relative_error, details=details)


# ---------------------------------------------------------------------------------------------------------
# The suite


def run_expert_parallel(options: SuiteOptions) -> SuiteResult:
    validate_options(options)
    device = torch.device(options.device)
    dtype = torch_dtype(options.dtype)
    console = options.console
    specs = [entry_spec(name) for name in options.entries]
    mps_names = [spec.name for spec in specs if spec.kind == "mps"]
    mps_runs = _run_mps_entries(options, mps_names) if mps_names else {}

    ceiling_tflops = hardware.suite_matmul_ceiling(device, console)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    tolerance = metrics.ERROR_TOLERANCES[options.dtype]
    configs = []
    for index, shape in enumerate(options.shapes):
        console.log(f"[{index + 1}/{len(options.shapes)}] {shape.label}")
        with torch.no_grad():
            configs.append(_run_config(index, shape, specs, mps_runs, options, device, element_bytes,
                                       ceiling_tflops, tolerance))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return SuiteResult(
        suite=options.suite,
        machine=hardware.machine_info(device),
        settings={
            "device": str(device), "dtype": options.dtype, "activation": options.activation,
            "normalize_topk": options.normalize_topk, "repeats": options.repeats, "warmup": options.warmup,
            "seed": options.seed, "entries": list(options.entries),
            "reference_max_tokens": options.reference_max_tokens, "error_tolerance": tolerance,
            "near_tie_log_gap": metrics.NEAR_TIE_LOG_GAP,
            "flops_formula": "2*T*k*H*I*(2, or 3 for swiglu) + 2*T*H*E over all ranks' tokens",
            "notes": [
                "T is the total over the ranks (split as evenly as possible); E experts, E / P per rank",
                "vs P=1 = median / median of emulated P=1 (the same problem through the team buffers on one "
                "virtual rank; the fused kernel without a team when emulated P=1 did not run)",
                "sent MB / rank = max over ranks of dispatch + combine bytes written into other ranks' buffers "
                "(flashdmoe.last_report().traffic(), one forward on input set 0); payload eff. = dispatched "
                "bytes / (rows routed to other ranks x H x element size), over all ranks; of it NVSHMEM MB = "
                "the part of those bytes that went through NVSHMEM puts (same rank)",
                "N processes (MPS): one Team.nvshmem rank per process on the one GPU, "
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / N each; ms per forward = the slowest rank's; "
                "the kernel reaches its peers through peer pointers (p2p), or, in the nvshmem rows, through "
                "NVSHMEM puts (the NVSHMEM build, peer_transport='nvshmem')",
            ],
        },
        configs=configs,
        ceiling_tflops=ceiling_tflops,
    )


def _run_config(index, shape, specs, mps_runs, options, device, element_bytes, ceiling_tflops, tolerance):
    def inputs_for(set_index: int) -> MoEInputs:
        problem = problem_for(shape, 1, options, index, set_index)
        w1, w2 = problem.shard(0)
        return MoEInputs(problem.all_tokens().to(device), problem.router_weight().to(device),
                          w1.to(device), w2.to(device))

    input_sets = [inputs_for(0)]
    output_bytes = shape.tokens * shape.hidden * element_bytes
    set_count = options.input_sets or input_sets_for_cache(
        input_sets[0].nbytes + output_bytes, cache_bytes(device), limit=options.max_input_sets)
    input_sets += [inputs_for(set_index) for set_index in range(1, set_count)]
    first = input_sets[0]
    kwargs = {"top_k": shape.top_k, "activation": options.activation, "normalize_topk": options.normalize_topk}
    expected = reference.moe(first.x, first.router_weight, first.w1, first.w2, **kwargs)
    routing = reference.route(first.x, first.router_weight, shape.top_k, options.normalize_topk)
    near_ties = metrics.near_tie_mask(routing.probs, shape.top_k)
    compare_rows = ~near_ties
    flops = metrics.moe_flops(shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k, options.activation)

    entries = []
    for spec in specs:
        if spec.kind == "mps":
            result = _mps_entry(spec, mps_runs[(index, spec.name)], shape, expected, compare_rows, device,
                                element_bytes)
        else:
            result = _in_process_entry(spec, shape, input_sets, options, expected, compare_rows, device,
                                       element_bytes)
        if result.status == "ok":
            result.tflops = metrics.tflops(flops, result.median_ms)
            if ceiling_tflops:
                result.percent_of_ceiling = 100.0 * result.tflops / ceiling_tflops
            result.error_tolerance = tolerance
            result.correct = result.max_relative_error <= tolerance
        options.console.log(
            f"    {spec.label}: "
            + (f"{result.median_ms:.3f} ms, err {result.max_relative_error:.2e}"
               if result.status == "ok" else f"{result.status}: {result.reason}")
        )
        entries.append(result)
    # vs P=1: against emulated P=1 (the same path on one rank), else the single-rank kernel without a team.
    baseline = next((e for name in ("emulated-1", "single") for e in entries
                     if e.name == name and e.status == "ok"), None)
    for entry in entries:
        if baseline is not None and entry.status == "ok":
            entry.details["vs_p1"] = entry.median_ms / baseline.median_ms
            entry.details["vs_p1_baseline"] = baseline.name
    return ConfigResult(
        label=shape.label, shape=shape.to_dict(), activation=options.activation, dtype=options.dtype,
        flops=flops, input_sets=len(input_sets), entries=entries,
        compared_tokens=int(compare_rows.sum()), near_tie_tokens=int(near_ties.sum()),
        details={"tokens_per_rank": {spec.name: problem_for(shape, spec.world_size, options, index).tokens
                                     for spec in specs if spec.kind in ("emulated", "mps")}},
    )


# ---------------------------------------------------------------------------------------------------------
# Tables


def _world_size_cell(config, entry) -> str:
    value = (entry.details or {}).get("world_size")
    return "–" if value is None else str(value)


EP_LAYOUT = report.Layout(
    markdown=(
        report.Column("P", _world_size_cell),
        report.Column("entry", lambda config, entry: entry.label, "left"),
        report.Column("ms (median)", lambda config, entry: report.number_text(entry.median_ms, 3)),
        report.Column("p10–p90 ms", lambda config, entry: report.spread_text(entry)),
        report.Column("TFLOP/s", lambda config, entry: report.tflops_text(entry.tflops)),
        report.Column("% of ceiling", lambda config, entry: report.number_text(entry.percent_of_ceiling, 1)),
        report.Column("vs P=1", report.ratio_cell("vs_p1")),
        report.Column("sent MB / rank (max)", report.sent_megabytes_cell),
        report.Column("of it NVSHMEM MB", report.nvshmem_megabytes_cell),
        report.Column("payload eff.", report.ratio_cell("payload_efficiency", percent=True)),
        report.Column("max rel. error", lambda config, entry: report.error_text(entry)),
        report.Column("status", lambda config, entry: report.status_text(entry), "left"),
    ),
    terminal=(
        report.Column("entry", lambda config, entry: entry.name, "left"),
        report.Column("P", _world_size_cell),
        report.Column("ms", lambda config, entry: report.number_text(entry.median_ms, 3)),
        report.Column("TFLOP/s", lambda config, entry: report.tflops_text(entry.tflops)),
        report.Column("vs P=1", report.ratio_cell("vs_p1")),
        report.Column("MB/rank", report.sent_megabytes_cell),
        report.Column("nvshmem MB", report.nvshmem_megabytes_cell),
        report.Column("payload", report.ratio_cell("payload_efficiency", percent=True)),
        report.Column("rel err", lambda config, entry: report.error_text(entry)),
        report.Column("status", lambda config, entry: report.status_text(entry, report.REASON_WIDTH_IN_TERMINAL),
                      "left"),
    ),
)

SUITE = Suite(
    name=SUITE_NAME,
    description="expert-parallel protocol on one GPU: emulated P = 1, 2, 4, 8 and P processes under MPS "
                "(p2p and nvshmem transports)",
    runner=run_expert_parallel,
    default_shapes=EP_SHAPES,
    quick_shapes=EP_QUICK_SHAPES,
    entry_names=ENTRY_NAMES,
    validate=validate_options,
    layout=EP_LAYOUT,
)
