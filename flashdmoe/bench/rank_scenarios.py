"""The timed scenarios the benchmarks run in rank processes (through :func:`flashdmoe.ranks.run_ranks`,
which the rank processes resolve by module and function name).

* :func:`timed_fused_forwards`: forwards of the fused kernel over the rank's NVSHMEM team, timed back to
  back with CUDA events through the public API after one checked forward (the
  ``mps-P`` rows of ``expert-parallel``);
* :func:`checked_fused_forwards`: the same, then this rank's output checked against the reference (the
  ``fused`` rows of ``multi-gpu``);
* :func:`timed_training_steps`: forward + ``backward`` of the public API over the team, forward and
  backward timed apart with CUDA events, with the team's backward on the device exchange or forced onto
  the torch-ops path (``scripts/team_backward_bench.py``);
* :func:`nccl_forwards`: the unfused baseline (:func:`flashdmoe.bench.all_to_all.all_to_all_moe`) over a
  ``torch.distributed`` group, timed and checked the same way (the ``nccl`` rows of ``multi-gpu``).

Each rotates through several seeded input sets (set ``s`` uses seed ``problem.seed + s``) so that the
working set exceeds the cache, as the single-GPU suite does.
"""

from __future__ import annotations

import datetime
import math
import statistics
from typing import Any

import torch

from flashdmoe import reference
from flashdmoe.bench import metrics
from flashdmoe.bench.all_to_all import all_to_all_moe
from flashdmoe.bench.timing import cache_bytes, input_sets_for_cache, measure
from flashdmoe.ranks import scenarios
from flashdmoe.ranks.child import RankContext, ScenarioOutput, synchronize
from flashdmoe.ranks.problem import Problem

__all__ = ["checked_fused_forwards", "nccl_forwards", "rank_reference_check", "timed_fused_forwards",
           "timed_training_steps"]


def _input_set_count(problem: Problem, params: dict[str, Any], device: torch.device) -> int:
    """``params["input_sets"]``, or enough sets that all ranks' inputs exceed twice the cache (at most
    ``params["max_input_sets"]``, default 16)."""
    if params.get("input_sets") is not None:
        return int(params["input_sets"])
    element = torch.empty((), dtype=problem.torch_dtype).element_size()
    set_bytes = element * (2 * problem.total_tokens * problem.hidden + problem.experts * problem.hidden
                           + problem.experts * (problem.hidden * problem.w1_columns + problem.ffn * problem.hidden))
    return input_sets_for_cache(set_bytes, cache_bytes(device), limit=int(params.get("max_input_sets", 16)))


def _input_sets(problem: Problem, rank: int, count: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """``(x, router_weight, w1, w2)`` of this rank for input sets ``0..count-1``, on ``device``."""
    out = []
    for index in range(count):
        inputs = problem.replace(seed=problem.seed + index).rank_inputs(rank).to(device)
        out.append((inputs.x, inputs.router_weight, inputs.w1, inputs.w2))
    return out


def _timing_info(stats, input_sets: int) -> dict[str, Any]:
    return {"samples_ms": list(stats.samples_ms), "median_ms": stats.median_ms, "p10_ms": stats.p10_ms,
            "p90_ms": stats.p90_ms, "input_sets": input_sets}


def timed_fused_forwards(context: RankContext) -> ScenarioOutput:
    """params: ``problem``; ``warmup`` (default 5) and ``repeats`` (default 20) forwards; ``input_sets``
    (None: enough to exceed twice the L2 cache with all ranks' inputs, at most ``max_input_sets``,
    default 16); ``return_output`` (default True).

    Every rank runs the same number of forwards (they are collective). Returns info ``samples_ms`` (one
    CUDA-event time per timed forward, in order), ``median_ms``/``p10_ms``/``p90_ms``, ``input_sets``,
    ``traffic`` (the traffic counters of the checked forward on set 0), and tensor ``y`` of set 0.
    """
    problem = Problem.from_dict(context.params["problem"])
    warmup = int(context.params.get("warmup", 5))
    repeats = int(context.params.get("repeats", 20))
    count = _input_set_count(problem, context.params, context.device)
    prepared = _input_sets(problem, context.rank, count, context.device)
    with torch.no_grad():
        context.enter_phase("checked forward on set 0")
        y = scenarios.team_moe(problem, context, *prepared[0])
        synchronize(context.device)
        traffic = scenarios.last_traffic()
        runs = [lambda args=args: scenarios.team_moe(problem, context, *args) for args in prepared]
        context.team.barrier()
        synchronize(context.device)
        context.enter_phase("timed forwards")
        stats = measure(runs, device=context.device, warmup=warmup, repeats=repeats)
    tensors = {"y": y} if context.params.get("return_output", True) else {}
    return ScenarioOutput(tensors, _timing_info(stats, count) | {"traffic": traffic})


def timed_training_steps(context: RankContext) -> ScenarioOutput:
    """params: ``problem``; ``warmup`` (default 3) and ``repeats`` (default 10) steps; ``backward``:
    ``"auto"`` (what users get) or ``"torch"`` (the torch-ops backward, forced: the baseline).

    A step is ``y = flashdmoe.moe(x, ...)`` with every input requiring grad, then ``y.backward(dy)`` on a
    the problem's seeded ``dy``; CUDA events before the forward, between, and after the backward. Returns info
    ``forward_ms``, ``backward_ms``, ``step_ms`` (medians), ``backward`` (the path asked for) and tensors
    ``dx``, ``d_router``, ``dw1``, ``dw2`` of the last step (for comparing the two paths).
    """
    from flashdmoe.kernel.launch_knobs import debug

    problem = Problem.from_dict(context.params["problem"])
    warmup = int(context.params.get("warmup", 3))
    repeats = int(context.params.get("repeats", 10))
    path = str(context.params.get("backward", "auto"))
    if path not in ("auto", "torch"):
        raise ValueError(f"backward={path!r}: expected 'auto' or 'torch'")
    inputs = problem.rank_inputs(context.rank).to(context.device)
    leaves = [t.detach().clone().requires_grad_(True) for t in (inputs.x, inputs.router_weight, inputs.w1, inputs.w2)]
    dy = inputs.dy
    before = debug.team_backward
    debug.team_backward = path
    times = []
    try:
        context.enter_phase(f"timed training steps ({path} backward)")
        for step in range(warmup + repeats):
            for leaf in leaves:
                leaf.grad = None
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
            y = scenarios.team_moe(problem, context, *leaves)
            events[1].record()
            y.backward(dy)
            events[2].record()
            synchronize(context.device)
            if step >= warmup:
                times.append((events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])))
    finally:
        debug.team_backward = before
    median = statistics.median_high  # a measured step, not the mean of two
    info = {"forward_ms": median([f for f, _ in times]), "backward_ms": median([b for _, b in times]),
            "step_ms": median([f + b for f, b in times]), "backward": path, "repeats": repeats}
    grads = [leaf.grad.detach().clone() if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
    if context.params.get("profile"):  # one more step under the torch profiler: where the backward's time goes
        for leaf in leaves:
            leaf.grad = None
        debug.team_backward = path
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as profiler:
                y = scenarios.team_moe(problem, context, *leaves)
                y.backward(dy)
                synchronize(context.device)
        finally:
            debug.team_backward = before
        info["profile"] = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        info["profile_cuda"] = profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
    tensors = dict(zip(("dx", "d_router", "dw1", "dw2"), grads))
    return ScenarioOutput(tensors, info)


def checked_fused_forwards(context: RankContext) -> ScenarioOutput:
    """:func:`timed_fused_forwards` (same params), then this rank's output checked against the reference
    (info ``check``: :func:`rank_reference_check`, unless params ``check`` is False); no tensor returned."""
    context.params["return_output"] = True
    output = timed_fused_forwards(context)
    y = output.tensors.pop("y")
    if context.params.get("check", True):
        context.enter_phase("checking against the reference")
        problem = Problem.from_dict(context.params["problem"])
        output.info["check"] = rank_reference_check(problem, context.rank, y, context.device)
    return output


def nccl_forwards(context: RankContext) -> ScenarioOutput:
    """The unfused expert-parallel baseline (:func:`~flashdmoe.bench.all_to_all.all_to_all_moe`), timed like
    :func:`timed_fused_forwards`. Runs with ``nvshmem=False`` (no team).

    params: ``problem``; ``backend`` (``"nccl"``, default, on ``cuda:<spec device>``; ``"gloo"`` on the CPU);
    ``experts`` (``"grouped_mm"``, default, or ``"reference"``); ``warmup`` (5), ``repeats`` (20),
    ``input_sets``/``max_input_sets`` as there; ``check`` (default True: this rank's output against
    :func:`flashdmoe.reference.moe`, info ``check``); ``return_output`` (default False: tensor ``y`` of set 0);
    ``pg_timeout_s`` (the process group's timeout, default 300). The process group meets through a
    ``file://`` store in the run directory.

    Returns info ``samples_ms``, ``median_ms``/``p10_ms``/``p90_ms``, ``input_sets``, ``traffic`` (one dict:
    rows_routed_remote, dispatch_bytes, combine_bytes, count_bytes of the checked forward), ``check``,
    ``backend``, ``device``.
    """
    import torch.distributed as dist

    params = context.params
    problem = Problem.from_dict(params["problem"])
    backend = params.get("backend", "nccl")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r}: expected 'nccl' or 'gloo'")
    if backend == "nccl":
        device = context.device or torch.device("cuda", int(context.spec.get("device", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    warmup = int(params.get("warmup", 5))
    repeats = int(params.get("repeats", 20))
    context.enter_phase(f"joining the {backend} process group (collective)")
    store = context.workdir / f"{backend}_rendezvous"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=context.rank,
                            world_size=context.world_size,
                            timeout=datetime.timedelta(seconds=float(params.get("pg_timeout_s", 300))))
    try:
        count = _input_set_count(problem, params, device)
        prepared = _input_sets(problem, context.rank, count, device)
        kwargs = {"top_k": problem.top_k, "activation": problem.activation,
                  "normalize_topk": problem.normalize_topk, "experts": params.get("experts", "grouped_mm")}
        barrier = (lambda: dist.barrier(device_ids=[device.index])) if backend == "nccl" else dist.barrier
        with torch.no_grad():
            context.enter_phase("checked forward on set 0")
            traffic: dict[str, Any] = {}
            y = all_to_all_moe(*prepared[0], traffic=traffic, **kwargs)
            synchronize(device)
            runs = [lambda args=args: all_to_all_moe(*args, **kwargs) for args in prepared]
            barrier()
            synchronize(device)
            context.enter_phase("timed forwards")
            stats = measure(runs, device=device, warmup=warmup, repeats=repeats)
            barrier()
        info = _timing_info(stats, count) | {"traffic": [traffic], "backend": backend, "device": str(device)}
        if params.get("check", True):
            context.enter_phase("checking against the reference")
            info["check"] = rank_reference_check(problem, context.rank, y, device)
    finally:
        dist.destroy_process_group()
    return ScenarioOutput({"y": y} if params.get("return_output", False) else {}, info)


def rank_reference_check(problem: Problem, rank: int, y: torch.Tensor, device=None) -> dict:
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
