"""The ``training`` suite: a training step through the public API -- forward under autograd, then the
backward -- beside the torch ``grouped_mm`` pipeline under autograd, on the same rotated input sets.

Entries, per shape (T/H/I/E/k and an activation):

* ``flashdmoe`` -- ``flashdmoe.moe(x, router_weight, w1, w2, backend="cuda")`` with all four requiring grad
  (on a CPU ``backend="reference"``, so the suite runs end to end where CI runs), then ``y.backward(dy)``.
  The previous step's gradients are dropped before the forward (``zero_grad(set_to_none=True)``): the
  backward allocates them, as in a training step.
* ``flashdmoe_graph`` -- the same step captured with ``torch.cuda.graph``: the forward in one graph, the
  backward (``torch.autograd.backward(y, dy)``) in a second graph on the first one's memory pool, as
  ``torch.cuda.make_graphed_callables`` splits a step, replayed back to back (one pair per input set).
  The gradients land in the ``.grad`` tensors made during the capture, which stay in place between
  replays. A capture that raises gives an ``error`` row with the message; the suite goes on.
* ``grouped_mm`` -- :func:`flashdmoe.bench.baselines.grouped_mm_pipeline` (weights in the layout
  :func:`~flashdmoe.bench.baselines.prepare_grouped_mm_weights` picks) under autograd, the same step.

Timing (:func:`flashdmoe.bench.timing.measure_in_turns`): a CUDA event before the forward, between forward
and backward and after the backward, so forward, backward alone and forward + backward come from the same
runs; medians over ``--repeats`` runs after ``--warmup``, input sets rotated as in ``single-gpu``, the
entries of a shape timed in turns (rounds of a quarter of the runs each) so that clock drift falls on all
of them alike.

FLOPs (:mod:`flashdmoe.bench.metrics`): forward = ``moe_flops`` (expert GEMMs + router); backward = twice
the forward's expert FLOPs + ``4*T*E*H`` (router); forward + backward = their sum. The row's ratio is
``grouped_mm``'s forward + backward median over the entry's.

Checked once per entry on input set 0, before timing: ``y`` against ``flashdmoe.reference.moe`` in
float64 (max|y - y_ref| / max|y_ref|, near-tie tokens left out, ``numerics.kernel_tolerance``) and every
gradient against autograd through the same float64 oracle (normwise, :func:`metrics.gradient_tolerance`).
Set 0's ``dy`` is zero on near-tie tokens, so an equally valid choice of expert for them changes no
gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import flashdmoe
from flashdmoe import reference
from flashdmoe.bench import baselines, hardware, metrics, report, single_gpu
from flashdmoe.bench.entries import EntryUnavailable, MoEInputs, MoEProblem, describe_error
from flashdmoe.bench.results import BenchShape, ConfigResult, EntryResult, SuiteResult
from flashdmoe.bench.suite import Suite, SuiteOptions
from flashdmoe.bench.timing import TimingStats, TurnTimings, measure_in_turns
from flashdmoe.bench.workload import free_device_memory, rotated_input_sets, torch_dtype
from flashdmoe.errors import BackendUnavailable

# The training targets' shapes (the paper's problem, Qwen3-30B-A3B, Mixtral 8x7B), then the rest of
# docs/design.md §12's benchmark shapes (the single-gpu suite's, after the paper's problem).
TRAINING_CASES: tuple[tuple[BenchShape, str], ...] = (
    (BenchShape(8192, 2048, 2048, 32, 2), "gelu"),  # the FlashDMoE paper's per-GPU problem
    (BenchShape(8192, 2048, 768, 128, 8), "swiglu"),  # Qwen3-30B-A3B
    (BenchShape(4096, 4096, 14336, 8, 2), "swiglu"),  # Mixtral 8x7B
    *((shape, "gelu") for shape in single_gpu.SINGLE_GPU_SHAPES[1:]),
)
# H and I multiples of 64 (the fused kernel's rule), so the quick run times every entry on a GPU too.
QUICK_CASES: tuple[tuple[BenchShape, str], ...] = (
    (BenchShape(64, 64, 128, 8, 2), "gelu"),
    (BenchShape(40, 64, 64, 4, 1), "swiglu"),
)
SHAPE_ACTIVATIONS = dict(TRAINING_CASES + QUICK_CASES)
# Shapes given with --configs and no --activation.
FALLBACK_ACTIVATION = "gelu"
ENTRY_NAMES = ("flashdmoe", "flashdmoe_graph", "grouped_mm")
ENTRY_LABELS = {
    "flashdmoe": "flashdmoe.moe",
    "flashdmoe_graph": "flashdmoe.moe, graph replay",
    "grouped_mm": "torch grouped_mm",
}
GRADIENT_NAMES = ("x", "router_weight", "w1", "w2")
# Eager steps on a side stream before a capture (as torch.cuda.make_graphed_callables warms up).
GRAPH_WARMUP_STEPS = 2
PHASES = ("forward", "backward")


def activation_for(shape: BenchShape, options: SuiteOptions, index: int | None = None) -> str:
    """The activation of ``options.shapes[index]``: its own from ``--configs`` when given, else
    ``--activation``, else the one this suite pairs the shape with (gelu for a shape it does not list)."""
    given = options.activation if index is None else options.activation_of(index)
    return given or SHAPE_ACTIVATIONS.get(shape, FALLBACK_ACTIVATION)


# ---------------------------------------------------------------------------------------------------------
# Steps


@dataclass
class PreparedStep:
    """One entry on one input set: ``phases`` = (forward, backward), called in that order; ``outputs()``
    after a step gives ``(y, [dx, d_router_weight, dw1, dw2])`` of that step; ``release()`` (eager steps)
    drops them."""

    phases: tuple[Callable[[], None], Callable[[], None]]
    outputs: Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]
    release: Callable[[], None] | None = None
    details: dict[str, object] = field(default_factory=dict)


def _leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    # detach() shares the storage: every entry differentiates the same values, with its own .grad.
    return [tensor.detach().requires_grad_() for tensor in tensors]


def _eager_step(forward: Callable[[list[torch.Tensor]], torch.Tensor], leaves: list[torch.Tensor],
                dy: torch.Tensor) -> PreparedStep:
    state: dict[str, torch.Tensor] = {}

    def release() -> None:
        state.clear()
        for leaf in leaves:
            leaf.grad = None

    def forward_phase() -> None:
        release()
        state["y"] = forward(leaves)

    def backward_phase() -> None:
        state["y"].backward(dy)

    return PreparedStep((forward_phase, backward_phase),
                        lambda: (state["y"].detach(), [leaf.grad for leaf in leaves]), release)


def _moe_forward(problem: MoEProblem, backend: str) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    return lambda leaves: flashdmoe.moe(*leaves, backend=backend, **problem.kwargs())


def _synchronize(device: torch.device) -> None:
    """Wait for the device; raises the error of any fused launch on it (flashdmoe.synchronize) on CUDA."""
    if device.type == "cuda":
        flashdmoe.synchronize(device)


def prepare_flashdmoe(inputs: MoEInputs, dy: torch.Tensor, problem: MoEProblem) -> PreparedStep:
    """The eager step through ``flashdmoe.moe``; one untimed step proves the path works here."""
    backend = "cuda" if inputs.x.is_cuda else "reference"
    step = _eager_step(_moe_forward(problem, backend), _leaves(inputs.x, inputs.router_weight, inputs.w1,
                                                               inputs.w2), dy)
    try:
        for phase in step.phases:
            phase()
        _synchronize(inputs.x.device)
    except BackendUnavailable as error:
        raise EntryUnavailable(str(error)) from error
    except (ValueError, NotImplementedError) as error:
        # Unsupported shape/dtype for the kernel: shown in the row, the suite goes on.
        raise EntryUnavailable(describe_error(error)) from error
    step.details["backend"] = backend
    return step


def prepare_flashdmoe_graph(inputs: MoEInputs, dy: torch.Tensor, problem: MoEProblem) -> PreparedStep:
    """The step captured as two CUDA graphs (forward; backward on the forward's pool) and replayed."""
    if not inputs.x.is_cuda:
        raise EntryUnavailable("CUDA graphs need a CUDA device")
    eager = prepare_flashdmoe(inputs, dy, problem)  # the same unavailability, and the first launches
    leaves = _leaves(inputs.x, inputs.router_weight, inputs.w1, inputs.w2)
    step = _eager_step(_moe_forward(problem, "cuda"), leaves, dy)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(GRAPH_WARMUP_STEPS):
            for phase in step.phases:
                phase()
    torch.cuda.current_stream().wait_stream(side)
    _synchronize(inputs.x.device)
    del eager, step
    for leaf in leaves:
        leaf.grad = None  # made by the captured backward, at addresses the replays keep writing
    forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(forward_graph):
        y = flashdmoe.moe(*leaves, backend="cuda", **problem.kwargs())
    with torch.cuda.graph(backward_graph, pool=forward_graph.pool()):
        torch.autograd.backward(y, dy)
    grads = [leaf.grad for leaf in leaves]
    if any(grad is None for grad in grads):
        raise RuntimeError("the captured backward left a .grad unset")
    forward_graph.replay()
    backward_graph.replay()
    _synchronize(inputs.x.device)
    return PreparedStep((forward_graph.replay, backward_graph.replay), lambda: (y.detach(), grads),
                        details={"backend": "cuda", "graph": True})


class GroupedMMPreparer:
    """The ``grouped_mm`` pipeline under autograd; the weight layout is picked on the first input set
    (fastest forward, :func:`baselines.prepare_grouped_mm_weights`) and reused for the rest."""

    def __init__(self) -> None:
        self.layout: str | None = None
        self.layout_trials: dict[str, str] = {}

    def __call__(self, inputs: MoEInputs, dy: torch.Tensor, problem: MoEProblem) -> PreparedStep:
        try:
            with torch.no_grad():
                w1, w2, layout, trials = baselines.prepare_grouped_mm_weights(
                    inputs.x, inputs.router_weight, inputs.w1, inputs.w2, **problem.kwargs(),
                    layouts=(self.layout,) if self.layout else None,
                )
        except baselines.BaselineUnavailable as error:
            raise EntryUnavailable(f"baseline unavailable: {error}") from error
        if self.layout is None:
            self.layout, self.layout_trials = layout, trials
        step = _eager_step(lambda leaves: baselines.grouped_mm_pipeline(*leaves, **problem.kwargs()),
                           _leaves(inputs.x, inputs.router_weight, w1, w2), dy)
        for phase in step.phases:
            phase()
        step.details.update(weight_layout=layout, layout_trials=self.layout_trials)
        return step


def _preparer(name: str) -> Callable[[MoEInputs, torch.Tensor, MoEProblem], PreparedStep]:
    return {"flashdmoe": prepare_flashdmoe, "flashdmoe_graph": prepare_flashdmoe_graph,
            "grouped_mm": GroupedMMPreparer()}[name]


# ---------------------------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True)
class Oracle:
    """Set 0's float64 answer: y [T, H] and the four gradients; ``compare_rows`` [T] bool (not near ties);
    ``unchecked``: gradients that are zero by construction, whose relative error means nothing."""

    y: torch.Tensor
    grads: list[torch.Tensor]
    compare_rows: torch.Tensor
    unchecked: tuple[str, ...] = ()


def float64_oracle(inputs: MoEInputs, dy: torch.Tensor, problem: MoEProblem, compare_rows: torch.Tensor) -> Oracle:
    leaves = [t.detach().to(torch.float64).requires_grad_() for t in
              (inputs.x, inputs.router_weight, inputs.w1, inputs.w2)]
    y = reference.moe(*leaves, **problem.kwargs())
    y.backward(dy.to(torch.float64))
    # One expert per token with normalised weights: every weight is 1, the router gets no gradient.
    unchecked = ("router_weight",) if problem.top_k == 1 and problem.normalize_topk else ()
    return Oracle(y.detach(), [leaf.grad for leaf in leaves], compare_rows, unchecked)


def upstream_gradients(input_sets: list[MoEInputs], seed: int, compare_rows: torch.Tensor) -> list[torch.Tensor]:
    """dy [T, H] ~ N(0, 1) per input set (seeded ``seed + set``); set 0's is zero where compare_rows is False."""
    gradients = []
    for index, inputs in enumerate(input_sets):
        generator = torch.Generator(device=inputs.x.device).manual_seed(seed + index)
        dy = torch.randn(inputs.x.shape, device=inputs.x.device, dtype=inputs.x.dtype, generator=generator)
        gradients.append(dy * compare_rows.unsqueeze(1).to(dy.dtype) if index == 0 else dy)
    return gradients


def run_training(options: SuiteOptions) -> SuiteResult:
    """Time every entry's forward, backward and forward + backward on every shape."""
    device = torch.device(options.device)
    dtype = torch_dtype(options.dtype)
    console = options.console
    ceiling_tflops = hardware.suite_matmul_ceiling(device, console)
    configs = []
    for config_index, shape in enumerate(options.shapes):
        activation = activation_for(shape, options, config_index)
        console.log(f"[{config_index + 1}/{len(options.shapes)}] {shape.label} {activation}")
        configs.append(_run_config(shape, activation, config_index, dtype, device, options, ceiling_tflops))
        free_device_memory(device)
    return SuiteResult(
        suite=options.suite,
        machine=hardware.machine_info(device),
        settings={
            "device": str(device),
            "dtype": options.dtype,
            "activation": options.activation or "per shape (column act)",
            "normalize_topk": options.normalize_topk,
            "repeats": options.repeats,
            "warmup": options.warmup,
            "seed": options.seed,
            "entries": list(options.entries),
            "kernel_tolerance": metrics.ERROR_TOLERANCES[options.dtype],
            "near_tie_log_gap": metrics.NEAR_TIE_LOG_GAP,
            "flops_formula": "forward 2*T*k*H*I*(2, or 3 for swiglu) + 2*T*H*E; backward 2x the forward's "
                             "expert FLOPs + 4*T*E*H; fwd+bwd their sum",
            "error_formula": "grad error = the largest ||g - g_ref||_F / ||g_ref||_F over dx, d_router, dW1, "
                             "dW2 against autograd through `flashdmoe.reference` in float64 (tolerance "
                             "`metrics.gradient_tolerance`), y checked too (max-norm, kernel tolerance); dy "
                             f"is zero on tokens whose k-th and (k+1)-th router log-probabilities are within "
                             f"{metrics.NEAR_TIE_LOG_GAP}",
            "plot_quantity": "forward + backward",
            "notes": ["forward, backward and fwd+bwd from the same runs: a CUDA event before the forward, "
                      "between forward and backward, and after the backward",
                      "graph replay: forward and backward captured as two CUDA graphs on one memory pool, "
                      "replayed back to back"],
        },
        configs=configs,
        ceiling_tflops=ceiling_tflops,
    )


def _run_config(
    shape: BenchShape,
    activation: str,
    config_index: int,
    dtype: torch.dtype,
    device: torch.device,
    options: SuiteOptions,
    ceiling_tflops: float | None,
) -> ConfigResult:
    problem = MoEProblem(shape.top_k, activation, options.normalize_topk)
    element = dtype.itemsize
    seed = options.seed + 1000 * config_index
    input_sets = rotated_input_sets(
        shape, activation=activation, dtype=dtype, device=device, seed=seed, count=options.input_sets,
        limit=options.max_input_sets,
        # dy, y and the four gradients (the inputs' size again)
        extra_bytes_per_set=2 * shape.tokens * shape.hidden * element + _input_bytes(shape, activation, element),
    )
    first = input_sets[0]
    routing = reference.route(first.x, first.router_weight, shape.top_k, options.normalize_topk)
    near_ties = metrics.near_tie_mask(routing.probs, shape.top_k)
    dys = upstream_gradients(input_sets, seed + 500, ~near_ties)
    oracle = float64_oracle(first, dys[0], problem, ~near_ties)
    forward_flops = metrics.moe_flops(shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k, activation)
    backward_flops = metrics.backward_flops(shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k,
                                            activation)
    w1_cols = 2 * shape.ffn if activation == "swiglu" else shape.ffn
    tolerance = metrics.gradient_tolerance(options.dtype, max(shape.tokens, shape.hidden, w1_cols, shape.experts))
    phase_flops = {"forward": forward_flops, "backward": backward_flops}

    entries = _run_entries(options.entries, input_sets, dys, problem, oracle, device, options)
    for result in entries:
        if result.status == "ok":
            result.tflops = metrics.tflops(forward_flops + backward_flops, result.median_ms)
            for phase in PHASES:
                result.details[phase]["tflops"] = metrics.tflops(phase_flops[phase],
                                                                 result.details[phase]["median_ms"])
            if ceiling_tflops:
                result.percent_of_ceiling = 100.0 * result.tflops / ceiling_tflops
            result.error_tolerance = tolerance
            result.correct = (result.max_relative_error <= tolerance
                              and result.details["errors"]["y"] <= metrics.ERROR_TOLERANCES[options.dtype])
        options.console.log(
            f"    {result.label}: "
            + (f"fwd {result.details['forward']['median_ms']:.3f} ms, bwd "
               f"{result.details['backward']['median_ms']:.3f} ms, fwd+bwd {result.median_ms:.3f} ms, "
               f"grad err {result.max_relative_error:.2e}"
               if result.status == "ok" else f"{result.status}: {result.reason}")
        )
    free_device_memory(device)

    config = ConfigResult(
        label=f"{shape.label} {activation}",
        shape={**shape.to_dict(), "act": activation},
        activation=activation,
        dtype=options.dtype,
        flops=forward_flops + backward_flops,
        input_sets=len(input_sets),
        entries=entries,
        compared_tokens=int(oracle.compare_rows.sum()),
        near_tie_tokens=int(near_ties.sum()),
        details={"forward_flops": forward_flops, "backward_flops": backward_flops},
    )
    baseline = config.entry("grouped_mm")
    if baseline is not None and baseline.status == "ok":
        for entry in entries:
            if entry.status == "ok":
                entry.speedup_over_grouped_mm = baseline.median_ms / entry.median_ms
    return config


def _input_bytes(shape: BenchShape, activation: str, element: int) -> int:
    w1_cols = 2 * shape.ffn if activation == "swiglu" else shape.ffn
    per_expert = shape.hidden * w1_cols + shape.ffn * shape.hidden + shape.hidden  # W1, W2, router row
    return (shape.tokens * shape.hidden + shape.experts * per_expert) * element


def _stats_dict(stats: TimingStats) -> dict[str, object]:
    return {"median_ms": stats.median_ms, "p10_ms": stats.p10_ms, "p90_ms": stats.p90_ms,
            "samples_ms": list(stats.samples_ms)}


def _errors(step: PreparedStep, oracle: Oracle) -> dict[str, float | None]:
    """y's max-norm relative error and each gradient's normwise one (None: not checked, see Oracle)."""
    y, grads = step.outputs()
    errors: dict[str, float | None] = {
        "y": metrics.max_relative_error(y, oracle.y, oracle.compare_rows).max_relative_error
    }
    for name, got, want in zip(GRADIENT_NAMES, grads, oracle.grads):
        if name in oracle.unchecked:
            errors[name] = None
        else:
            errors[name] = math.inf if got is None else metrics.normwise_error(got, want)
    return errors


def _checked_step(step: PreparedStep, device: torch.device) -> int | None:
    """Run one step; returns the most device memory it held at once beyond what was live without it
    (y, saved activations, gradients, temporaries), for eager steps on CUDA, else None."""
    measure_memory = device.type == "cuda" and step.release is not None
    if measure_memory:
        step.release()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for phase in step.phases:
        phase()
    _synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before if measure_memory else None


def _prepare_entry(
    name: str,
    input_sets: list[MoEInputs],
    dys: list[torch.Tensor],
    problem: MoEProblem,
    oracle: Oracle,
    device: torch.device,
) -> tuple[list[PreparedStep], dict[str, object]] | EntryResult:
    """The entry's steps (one per input set) and its checked first step's details, or the row saying why it
    does not run."""
    label = ENTRY_LABELS[name]
    prepare = _preparer(name)
    try:
        steps = [prepare(inputs, dy, problem) for inputs, dy in zip(input_sets, dys)]
    except EntryUnavailable as error:
        return EntryResult(name, label, "unavailable", reason=str(error))
    except Exception as error:  # a failed capture or launch must not cost the rest of the run
        return EntryResult(name, label, "error", reason=describe_error(error))
    try:
        details = dict(steps[0].details)
        details["peak_step_bytes"] = _checked_step(steps[0], device)
        details["errors"] = _errors(steps[0], oracle)
    except Exception as error:
        return EntryResult(name, label, "error", reason=describe_error(error))
    return steps, details


def _run_entries(
    names: list[str],
    input_sets: list[MoEInputs],
    dys: list[torch.Tensor],
    problem: MoEProblem,
    oracle: Oracle,
    device: torch.device,
    options: SuiteOptions,
) -> list[EntryResult]:
    """Every entry prepared and checked, then timed in turns (:func:`flashdmoe.bench.timing.measure_in_turns`,
    so that the GPU's clock drift falls on all of them alike); one result per entry, in order."""
    outcomes = [_prepare_entry(name, input_sets, dys, problem, oracle, device) for name in names]
    live = [(name, outcome) for name, outcome in zip(names, outcomes) if not isinstance(outcome, EntryResult)]
    turns = measure_in_turns(
        [[step.phases for step in steps] for _, (steps, _) in live], device=device, warmup=options.warmup,
        repeats=options.repeats, clock=lambda: hardware.sm_clock_mhz(device),
    )
    _synchronize(device)
    timed = iter([_timed_result(name, details, turn) for (name, (_, details)), turn in zip(live, turns)])
    return [outcome if isinstance(outcome, EntryResult) else next(timed) for outcome in outcomes]


def _timed_result(name: str, details: dict[str, object], turn: TurnTimings) -> EntryResult:
    label = ENTRY_LABELS[name]
    if turn.error is not None:
        return EntryResult(name, label, "error", reason=describe_error(turn.error))
    details = dict(details)
    for phase, stats in zip(PHASES, turn.timings.phases):
        details[phase] = _stats_dict(stats)
    if turn.clocks:
        details["sm_clock_mhz"] = list(turn.clocks)
    total = turn.timings.total
    return EntryResult(
        name, label, "ok",
        median_ms=total.median_ms, p10_ms=total.p10_ms, p90_ms=total.p90_ms, samples_ms=list(total.samples_ms),
        max_relative_error=max(details["errors"][grad] for grad in GRADIENT_NAMES
                               if details["errors"][grad] is not None),
        details=details,
    )


# ---------------------------------------------------------------------------------------------------------
# Tables


def phase_ms_cell(phase: str) -> Callable[[ConfigResult, EntryResult], str]:
    def cell(config: ConfigResult, entry: EntryResult) -> str:
        if phase == "total":
            return report.number_text(entry.median_ms, 3)
        return report.number_text((entry.details.get(phase) or {}).get("median_ms"), 3)
    return cell


def phase_tflops_cell(phase: str) -> Callable[[ConfigResult, EntryResult], str]:
    def cell(config: ConfigResult, entry: EntryResult) -> str:
        if phase == "total":
            return report.tflops_text(entry.tflops)
        return report.tflops_text((entry.details.get(phase) or {}).get("tflops"))
    return cell


def peak_gigabytes_cell(config: ConfigResult, entry: EntryResult) -> str:
    value = (entry.details or {}).get("peak_step_bytes")
    return "–" if value is None else f"{value / 2**30:.2f}"


TRAINING_LAYOUT = report.Layout(
    markdown=(
        report.Column("entry", lambda config, entry: entry.label, "left"),
        report.Column("fwd ms", phase_ms_cell("forward")),
        report.Column("bwd ms", phase_ms_cell("backward")),
        report.Column("fwd+bwd ms", phase_ms_cell("total")),
        report.Column("fwd+bwd p10–p90", lambda config, entry: report.spread_text(entry)),
        report.Column("fwd TFLOP/s", phase_tflops_cell("forward")),
        report.Column("bwd TFLOP/s", phase_tflops_cell("backward")),
        report.Column("fwd+bwd TFLOP/s", phase_tflops_cell("total")),
        report.Column("% of ceiling", lambda config, entry: report.number_text(entry.percent_of_ceiling, 1)),
        report.Column("vs grouped_mm (fwd+bwd)", lambda config, entry: report.speedup_text(entry)),
        report.Column("step GiB", peak_gigabytes_cell),
        report.Column("grad error", lambda config, entry: report.error_text(entry)),
        report.Column("SM MHz", lambda config, entry: report.clock_text(entry)),
        report.Column("status", lambda config, entry: report.status_text(entry), "left"),
    ),
    terminal=(
        report.Column("entry", lambda config, entry: entry.name, "left"),
        report.Column("fwd ms", phase_ms_cell("forward")),
        report.Column("bwd ms", phase_ms_cell("backward")),
        report.Column("f+b ms", phase_ms_cell("total")),
        report.Column("f+b TF/s", phase_tflops_cell("total")),
        report.Column("vs gmm", lambda config, entry: report.speedup_text(entry)),
        report.Column("grad err", lambda config, entry: report.error_text(entry)),
        report.Column("status", lambda config, entry: report.status_text(entry, report.REASON_WIDTH_IN_TERMINAL),
                      "left"),
    ),
)

SUITE = Suite(
    name="training",
    description="a training step (forward under autograd, backward) through flashdmoe.moe vs torch grouped_mm",
    runner=run_training,
    default_shapes=tuple(shape for shape, _ in TRAINING_CASES),
    quick_shapes=tuple(shape for shape, _ in QUICK_CASES),
    entry_names=ENTRY_NAMES,
    activation=None,
    layout=TRAINING_LAYOUT,
    per_config_activation=True,
)
