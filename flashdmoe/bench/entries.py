"""The things a suite times: the fused kernel, the baselines and the reference, behind one interface.

An entry's ``prepare(inputs, problem)`` does the untimed set-up for one input set (weight layout,
a probe call that proves the path works here) and returns a ``PreparedRun`` whose zero-argument
``run`` does one forward pass and returns y [T, H]. It raises ``EntryUnavailable`` with a reason
when the path cannot run on this machine (no CUDA, extension not built, dtype not supported), which
the suite reports instead of crashing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashdmoe.bench import baselines


class EntryUnavailable(RuntimeError):
    """This entry cannot run here; ``str(error)`` is the reason shown in the results."""


@dataclass(frozen=True)
class MoEInputs:
    """One input set. x [T, H]; router_weight [E, H]; w1 [E, H, I or 2I]; w2 [E, I, H]; one dtype."""

    x: torch.Tensor
    router_weight: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x, self.router_weight, self.w1, self.w2))


@dataclass(frozen=True)
class MoEProblem:
    """The non-tensor arguments every entry receives."""

    top_k: int
    activation: str
    normalize_topk: bool = True

    def kwargs(self) -> dict[str, object]:
        return {"top_k": self.top_k, "activation": self.activation, "normalize_topk": self.normalize_topk}


ForwardRun = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class PreparedRun:
    """``run()`` does one forward pass -> y [T, H]; ``details`` go into the results (e.g. layout)."""

    run: ForwardRun
    details: dict[str, object] = field(default_factory=dict)


class BenchEntry:
    """Base of all entries: ``name`` (used by --entries and in JSON) and ``label`` (for tables);
    ``profiled_kernel``: the CUDA kernel (a substring of its name) whose time alone the suite reads from
    the profiler beside the timed runs, or None."""

    name: str = ""
    label: str = ""
    profiled_kernel: str | None = None

    def prepare(self, inputs: MoEInputs, problem: MoEProblem) -> PreparedRun:
        raise NotImplementedError(f"{type(self).__name__} must implement prepare()")

    def timing_context(self) -> contextlib.AbstractContextManager:
        """Entered around the timed runs (and the correctness run) of this entry."""
        return contextlib.nullcontext()


def describe_error(error: BaseException) -> str:
    """``"TypeName: first line of the message"`` for a results row."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


class FusedEntry(BenchEntry):
    """``flashdmoe.moe(..., backend="cuda")``: the persistent kernel, one launch per forward."""

    name = "fused"
    label = "fused kernel"
    profiled_kernel = "moe_forward_kernel"

    def prepare(self, inputs: MoEInputs, problem: MoEProblem) -> PreparedRun:
        import flashdmoe
        from flashdmoe.errors import BackendUnavailable

        def forward() -> torch.Tensor:
            return flashdmoe.moe(
                inputs.x, inputs.router_weight, inputs.w1, inputs.w2,
                backend="cuda", **problem.kwargs(),
            )

        try:
            forward()
        except BackendUnavailable as error:
            raise EntryUnavailable(str(error)) from error
        except (ValueError, NotImplementedError) as error:
            # Unsupported shape/dtype for the kernel: shown in the row, the suite goes on.
            raise EntryUnavailable(describe_error(error)) from error
        return PreparedRun(forward)


class FusedGraphEntry(FusedEntry):
    """The same public call captured once per input set with ``torch.cuda.graph`` and replayed: how an
    inference server runs a step (its inputs live in the captured buffers)."""

    name = "fused_graph"
    label = "fused, graph replay"

    def prepare(self, inputs: MoEInputs, problem: MoEProblem) -> PreparedRun:
        import flashdmoe

        eager = super().prepare(inputs, problem)  # also the first (eager) launch a capture needs
        if not inputs.x.is_cuda:
            raise EntryUnavailable("CUDA graphs need a CUDA device")
        with torch.no_grad():
            eager.run()
            flashdmoe.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = eager.run()
        flashdmoe.synchronize()

        def replay() -> torch.Tensor:
            graph.replay()
            return captured

        return PreparedRun(replay, {"graph": True})


class GroupedMMEntry(BenchEntry):
    """Router + sort + ``torch._grouped_mm`` x 2 + scatter (the docs/design.md §12 baseline).

    The weight layout is chosen on the first input set (fastest that works) and reused for the rest.
    """

    name = "grouped_mm"
    label = "torch grouped_mm"

    def __init__(self) -> None:
        self.layout: str | None = None
        self.layout_trials: dict[str, str] = {}

    def prepare(self, inputs: MoEInputs, problem: MoEProblem) -> PreparedRun:
        try:
            w1, w2, layout, trials = baselines.prepare_grouped_mm_weights(
                inputs.x, inputs.router_weight, inputs.w1, inputs.w2, **problem.kwargs(),
                layouts=(self.layout,) if self.layout else None,
            )
        except baselines.BaselineUnavailable as error:
            raise EntryUnavailable(f"baseline unavailable: {error}") from error
        if self.layout is None:
            self.layout, self.layout_trials = layout, trials

        def forward() -> torch.Tensor:
            return baselines.grouped_mm_pipeline(
                inputs.x, inputs.router_weight, w1, w2, **problem.kwargs()
            )

        return PreparedRun(forward, {"weight_layout": layout, "layout_trials": self.layout_trials})


class PerExpertLoopEntry(BenchEntry):
    """The same routing, then a Python loop over experts with two matmuls each."""

    name = "per_expert_loop"
    label = "per-expert loop"

    def prepare(self, inputs: MoEInputs, problem: MoEProblem) -> PreparedRun:
        def forward() -> torch.Tensor:
            return baselines.per_expert_loop(
                inputs.x, inputs.router_weight, inputs.w1, inputs.w2, **problem.kwargs()
            )

        return PreparedRun(forward)


class ReferenceEntry(BenchEntry):
    """``flashdmoe.reference.moe``: the plain-PyTorch oracle (written for clarity), timed as a baseline."""

    name = "reference"
    label = "reference loop"

    def prepare(self, inputs: MoEInputs, problem: MoEProblem) -> PreparedRun:
        from flashdmoe import reference

        def forward() -> torch.Tensor:
            return reference.moe(
                inputs.x, inputs.router_weight, inputs.w1, inputs.w2, **problem.kwargs()
            )

        return PreparedRun(forward)


ENTRY_TYPES: dict[str, type[BenchEntry]] = {
    entry.name: entry for entry in (FusedEntry, FusedGraphEntry, GroupedMMEntry, PerExpertLoopEntry, ReferenceEntry)
}
