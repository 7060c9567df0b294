"""The correctness scenarios a rank process runs (:data:`SCENARIOS`, by the name given to
:func:`flashdmoe.ranks.launcher.run_ranks`).

* ``forward_backward``: seeded inputs (:class:`~flashdmoe.ranks.problem.Problem`),
  ``flashdmoe.moe(..., team=team, backend="cuda")`` and ``loss.backward()`` on a seeded ``dy``; returns y,
  dx, d_router, dw1, dw2 and the forward's traffic counters.
* ``silent_rank_timeout``: one rank never publishes its signals and the watchdog is short; returns the
  exception each rank saw, whether the team is marked failed, and what a further call raised.
* ``graph_replay``: the team's forward captured in a CUDA graph, replayed on new inputs copied in and
  interleaved with eager calls on the same inputs; returns whether every replay equalled its eager call.
* ``training_graph_replay``: a training step (forward and backward) captured in a CUDA graph, replayed on
  new inputs between eager steps on the same inputs; returns whether every replay's y and gradients
  equalled the eager step's.
* ``selftest``: no NVSHMEM and no GPU; exercises the harness itself (unique-id hand-over, errors, hangs,
  crashes) so it is tested on a CPU machine.

Timed scenarios belong to the benchmarks (:mod:`flashdmoe.bench.rank_scenarios`); they reuse
:func:`team_moe` and :func:`last_traffic`.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from typing import Any

import torch

import flashdmoe
from flashdmoe.ranks.child import RankContext, ScenarioOutput, error_info, synchronize
from flashdmoe.ranks.problem import Problem

__all__ = ["SCENARIOS", "backward_path", "forward_backward", "forward_backward_transports", "graph_replay", "last_traffic",
           "selftest", "silent_rank_timeout", "team_moe", "training_graph_replay"]


def team_moe(problem: Problem, context: RankContext, x, router_weight, w1, w2) -> torch.Tensor:
    """This rank's ``flashdmoe.moe`` over the context's team, with the problem's routing options."""
    return flashdmoe.moe(x, router_weight, w1, w2, team=context.team, backend="cuda", **problem.moe_kwargs())


def last_traffic() -> list[dict[str, Any]]:
    """The traffic counters of this process's latest fused launch (``flashdmoe.last_report().traffic()``,
    which waits for it); empty when no fused launch ran."""
    report = flashdmoe.last_report()
    return [] if report is None else copy.deepcopy(report.traffic())


def forward_backward(context: RankContext) -> ScenarioOutput:
    """params: ``problem`` (:meth:`Problem.to_dict`), ``iterations`` (default 2: forward + backward
    repeated, checking that signals work back to back and that y is bitwise repeatable).

    Returns tensors y ``[T_r, H]``, dx ``[T_r, H]``, d_router ``[E, H]``, dw1 ``[L, H, .]``, dw2 ``[L, I, H]``
    (the problem's dtype; y of the first iteration, gradients of the last) and info ``traffic`` (the
    first forward's :func:`last_traffic`), ``repeat_identical`` (every iteration's y equal to the first
    bit for bit), ``grads_repeat_identical``, ``missing_grads`` (leaves whose ``.grad`` stayed None; filled
    with zeros in the tensors), ``backward_path`` and ``backward_traffic`` (the last backward exchange's bytes
    per transport, None without one).
    """
    from flashdmoe.backward import ep_backward

    problem = Problem.from_dict(context.params["problem"])
    iterations = int(context.params.get("iterations", 2))
    if iterations < 1:
        raise ValueError(f"iterations={iterations}: expected >= 1")
    inputs = problem.rank_inputs(context.rank).to(context.device)
    names = ("dx", "d_router", "dw1", "dw2")
    first_y = first_grads = traffic = None
    repeat_identical = grads_identical = True
    missing: list[str] = []
    for iteration in range(iterations):
        leaves = [t.detach().clone().requires_grad_()
                  for t in (inputs.x, inputs.router_weight, inputs.w1, inputs.w2)]
        context.enter_phase(f"forward {iteration}")
        y = team_moe(problem, context, *leaves)
        if iteration == 0:
            traffic = last_traffic()
        loss = (y.float() * inputs.dy.float()).sum()
        context.enter_phase(f"backward {iteration}")
        loss.backward()
        synchronize(context.device)
        grads = []
        for name, leaf in zip(names, leaves):
            if leaf.grad is None:
                if name not in missing:
                    missing.append(name)
                grads.append(torch.zeros_like(leaf))
            else:
                grads.append(leaf.grad.detach())
        y = y.detach()
        if iteration == 0:
            first_y, first_grads = y, grads
        else:
            repeat_identical &= torch.equal(first_y, y)
            grads_identical &= all(torch.equal(a, b) for a, b in zip(first_grads, grads))
    tensors = {"y": first_y} | dict(zip(names, grads))
    return ScenarioOutput(tensors, {
        "traffic": traffic, "iterations": iterations, "repeat_identical": bool(repeat_identical),
        "grads_repeat_identical": bool(grads_identical), "missing_grads": missing,
        "backward_path": backward_path(context, inputs.x),
        "backward_traffic": ep_backward.exchange_traffic(context.team),
    })


def backward_path(context: RankContext, x: torch.Tensor) -> str:
    """Which backward this rank's team runs: ``"device"`` (:mod:`flashdmoe.backward.ep_backward`) or ``"torch"``
    (:mod:`flashdmoe.parallel.ep_peer`)."""
    from flashdmoe.backward import ep_backward
    from flashdmoe.kernel.launch_knobs import debug

    return "device" if debug.team_backward != "torch" and not ep_backward.unsupported(context.team, x) else "torch"


#: What a call that raised nothing reports (error_info's fields).
_NO_ERROR = {"type": None, "module": None, "message": None}


def silent_rank_timeout(context: RankContext) -> ScenarioOutput:
    """params: ``problem``, ``silent_rank`` (its signals are never published), ``timeout_ms`` (default 2000),
    ``in_backward`` (default False: the forward is silent; True: a forward with every rank, then a
    backward in which the rank is silent), ``queued_forwards`` (default 0: forwards every rank queues
    behind the silent forward or backward, no rank silent, before it waits for the device).

    Returns info ``error`` (type/module/message of what the forward, or the backward, or the wait after
    them raised; type None if nothing), ``elapsed_s`` (of that call), ``queued_errors`` (what each later
    ``flashdmoe.check_errors()`` raised, oldest first, until one raised nothing: the failed backward's later
    exchange launches, then one per queued forward, which the device stopped, so each must be
    ``TeamFailed``), ``team_failed`` (``team.failed`` afterwards) and ``second_call_error`` (what a
    further forward on the same team raised: it must be ``TeamFailed``).
    """
    from flashdmoe import cuda_backend

    problem = Problem.from_dict(context.params["problem"])
    silent_rank = int(context.params["silent_rank"])
    timeout_ms = int(context.params.get("timeout_ms", 2000))
    inputs = problem.rank_inputs(context.rank).to(context.device)
    args = (inputs.x, inputs.router_weight, inputs.w1, inputs.w2)
    knobs = cuda_backend.debug
    saved = (getattr(knobs, "silent_rank", -1), knobs.timeout_ms)
    in_backward = bool(context.params.get("in_backward", False))
    queued = int(context.params.get("queued_forwards", 0))
    knobs.silent_rank = -1 if in_backward else silent_rank
    knobs.timeout_ms = timeout_ms
    error = second = _NO_ERROR
    queued_errors = []
    try:
        started = time.monotonic()
        try:
            if in_backward:
                leaves = [t.detach().clone().requires_grad_() for t in args]
                if queued:
                    # A first backward loads its kernels (CUDA's lazy loading), and a load may wait for the
                    # kernels running on the GPU: here, the silent backward's exchange until it times out.
                    team_moe(problem, context, *leaves).backward(inputs.dy)
                y = team_moe(problem, context, *leaves)
                synchronize(context.device)
                knobs.silent_rank = silent_rank
                started = time.monotonic()
                y.backward(inputs.dy)
                knobs.silent_rank = -1
                with torch.no_grad():
                    for _ in range(queued):
                        team_moe(problem, context, *args)
            else:
                with torch.no_grad():
                    team_moe(problem, context, *args)
                    knobs.silent_rank = -1
                    for _ in range(queued):
                        team_moe(problem, context, *args)
            synchronize(context.device)
        except Exception as caught:
            error = error_info(caught)
        elapsed = time.monotonic() - started
        for _ in range(queued + 8 if queued else 0):  # the device finished: each check raises one launch's
            try:
                flashdmoe.check_errors()
                break
            except Exception as caught:
                queued_errors.append(error_info(caught))
        team_failed = bool(context.team.failed)
        knobs.silent_rank = -1
        try:
            with torch.no_grad():
                team_moe(problem, context, *args)
            synchronize(context.device)
        except Exception as caught:
            second = error_info(caught)
    finally:
        knobs.silent_rank, knobs.timeout_ms = saved
    return ScenarioOutput(info={"error": error, "elapsed_s": elapsed, "team_failed": team_failed,
                                "second_call_error": second, "silent_rank": silent_rank,
                                "timeout_ms": timeout_ms, "queued_errors": queued_errors})


def graph_replay(context: RankContext) -> ScenarioOutput:
    """params: ``problem``, ``replays`` (default 3), ``seed`` (default 0: the new inputs' seed).

    One eager forward (the warm-up CUDA graphs ask for), then the forward captured on a static ``x``;
    for each replay new inputs (seeded per rank and replay, the problem's scale) are copied into the
    static ``x``, the graph is replayed, and an eager forward runs on the same inputs. Every rank does
    the same calls in the same order (the team's forwards are collective, replayed or not). Returns
    tensors y (the last replay's) and info ``replays_identical`` (per replay: the replay's y equal to the
    eager one bit for bit), ``team_failed``.
    """
    problem = Problem.from_dict(context.params["problem"])
    replays = int(context.params.get("replays", 3))
    seed = int(context.params.get("seed", 0))
    inputs = problem.rank_inputs(context.rank).to(context.device)
    scale = float(inputs.x.float().std()) if inputs.x.numel() > 1 else 1.0
    moe = lambda x: team_moe(problem, context, x, inputs.router_weight, inputs.w1, inputs.w2)  # noqa: E731
    identical = []
    with torch.no_grad():
        context.enter_phase("graph_replay: warm-up")
        moe(inputs.x)
        synchronize(context.device)  # a team's last forward is checked before a capture may use the team
        static_x = inputs.x.clone()
        graph = torch.cuda.CUDAGraph()
        context.enter_phase("graph_replay: capture")
        with torch.cuda.graph(graph):
            static_y = moe(static_x)
        generator = torch.Generator(device="cpu")
        for replay in range(replays):
            generator.manual_seed(seed * 1_000_003 + 1_000 * context.rank + replay)
            fresh = (torch.randn(static_x.shape, generator=generator) * scale).to(static_x.dtype).to(context.device)
            static_x.copy_(fresh)
            context.enter_phase(f"graph_replay: replay {replay}")
            graph.replay()
            context.enter_phase(f"graph_replay: eager {replay}")
            want = moe(fresh)
            synchronize(context.device)
            identical.append(bool(torch.equal(static_y, want)))
    return ScenarioOutput({"y": static_y.clone()},
                          {"replays_identical": identical, "team_failed": bool(context.team.failed)})


def training_graph_replay(context: RankContext) -> ScenarioOutput:
    """params: ``problem``, ``replays`` (default 3), ``seed`` (default 0: the new inputs' seed).

    A training step (forward, ``<y, dy>``, backward) run eagerly twice (the warm-up), then captured in a
    CUDA graph on static ``x`` and ``dy``; for each replay new ``x`` and ``dy`` (seeded per rank and replay)
    are copied in, the graph is replayed, and an eager step runs on the same inputs. Every rank makes the
    same calls in the same order (forward and backward are collectives, replayed or not). Returns tensors
    y, dx, d_router, dw1, dw2 (the last replay's) and info ``replays_identical`` (per replay: y and every
    gradient equal to the eager step's bit for bit), ``backward_path``, ``team_failed``.
    """
    problem = Problem.from_dict(context.params["problem"])
    replays = int(context.params.get("replays", 3))
    seed = int(context.params.get("seed", 0))
    inputs = problem.rank_inputs(context.rank).to(context.device)
    scale = float(inputs.x.float().std()) if inputs.x.numel() > 1 else 1.0
    weights = [t.detach().clone().requires_grad_() for t in (inputs.router_weight, inputs.w1, inputs.w2)]
    static_x = inputs.x.detach().clone().requires_grad_()
    static_dy = inputs.dy.clone()

    def step(x, dy, router_weight, w1, w2):
        y = team_moe(problem, context, x, router_weight, w1, w2)
        (y.float() * dy.float()).sum().backward()
        return y

    context.enter_phase("training_graph_replay: warm-up")
    for _ in range(2):
        step(static_x, static_dy, *weights)
    synchronize(context.device)  # a team's last launch is checked before a capture may use the team
    leaves = [static_x, *weights]
    for leaf in leaves:
        leaf.grad = None  # the captured backward's gradients come from the graph's pool
    graph = torch.cuda.CUDAGraph()
    context.enter_phase("training_graph_replay: capture")
    with torch.cuda.graph(graph):
        static_y = step(static_x, static_dy, *weights)
    grads = [leaf.grad for leaf in leaves]
    generator = torch.Generator(device="cpu")
    identical = []
    for replay in range(replays):
        generator.manual_seed(seed * 1_000_003 + 1_000 * context.rank + replay)
        x = (torch.randn(static_x.shape, generator=generator) * scale).to(static_x.dtype).to(context.device)
        dy = torch.randn(static_dy.shape, generator=generator).to(static_dy.dtype).to(context.device)
        with torch.no_grad():
            static_x.copy_(x)
            static_dy.copy_(dy)
        context.enter_phase(f"training_graph_replay: replay {replay}")
        graph.replay()
        context.enter_phase(f"training_graph_replay: eager {replay}")
        fresh = [t.detach().clone().requires_grad_() for t in (x, *weights)]
        y = step(fresh[0], dy, *fresh[1:])
        synchronize(context.device)
        identical.append(bool(torch.equal(static_y, y))
                         and all(got is not None and leaf.grad is not None and torch.equal(got, leaf.grad)
                                 for got, leaf in zip(grads, fresh)))
    names = ("dx", "d_router", "dw1", "dw2")
    tensors = {"y": static_y.detach().clone()} | {name: (g.clone() if g is not None else torch.zeros(0))
                                                   for name, g in zip(names, grads)}
    return ScenarioOutput(tensors, {"replays_identical": identical, "backward_path": backward_path(context, inputs.x),
                                    "team_failed": bool(context.team.failed)})


def selftest(context: RankContext) -> ScenarioOutput:
    """The harness itself, without NVSHMEM or a GPU. params: ``actions`` {rank: "ok" | "raise" | "hang" |
    "exit"} (default "ok"); "hang" sleeps ``hang_s`` (default 3600). Returns tensor ``rank`` and info
    ``uid`` (the hex of the id rank 0 published), ``pid``."""
    actions = {int(rank): action for rank, action in (context.params.get("actions") or {}).items()}
    action = actions.get(context.rank, "ok")
    if action == "raise":
        raise ValueError(f"selftest: rank {context.rank} raises as asked")
    if action == "hang":
        context.enter_phase("selftest: hanging as asked")
        time.sleep(float(context.params.get("hang_s", 3600)))
    if action == "exit":
        os._exit(7)
    return ScenarioOutput({"rank": torch.tensor([context.rank])},
                          {"uid": context.uid.hex(), "pid": os.getpid()})


def forward_backward_transports(context: RankContext) -> ScenarioOutput:
    """:func:`forward_backward`, plus the team's ``peer_transports`` and the kernel build this process runs
    (``flashdmoe.kernel.extension.kernel_build()``) in the info."""
    from flashdmoe.kernel import extension

    output = forward_backward(context)
    output.info["peer_transports"] = list(context.team.peer_transports)
    output.info["kernel_build"] = extension.kernel_build()
    return output


SCENARIOS: dict[str, Callable[[RankContext], Any]] = {
    "forward_backward": forward_backward,
    "forward_backward_transports": forward_backward_transports,
    "graph_replay": graph_replay,
    "training_graph_replay": training_graph_replay,
    "silent_rank_timeout": silent_rank_timeout,
    "selftest": selftest,
}
