"""Why a CUDA-graph replay of ``flashdmoe.moe`` can take longer than the eager call on weight-heavy shapes.

For each shape: the public call eagerly and replayed from a graph (one graph per input set, as the
single-GPU bench does), each timed per call with CUDA events around it, two input sets alternated and one
set repeated; then one profiler trace of a few replays and a few eager calls listing every GPU activity
(kernels, memsets, copies) with its duration and the gap before it. A development probe.

    python scripts/graph_replay_probe.py [T/H/I/E/k/act ...]

GRAPH_PROBE_PERSISTENT=1 adds graphs whose launches take a workspace allocated and zeroed before the
capture and kept for the graph's life, instead of one from the graph's pool with its sync words zeroed
inside the graph: what the zeroing step costs a replay (each replay's last block leaves the words zero,
so such a graph stays correct while its launches succeed; a failed one would leave them dirty).
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

import flashdmoe
from flashdmoe import cuda_backend
from flashdmoe.bench.results import BenchShape
from flashdmoe.bench.workload import make_inputs

SHAPES = ["32/7168/2048/256/8/swiglu", "1/2048/768/128/8/swiglu", "16384/2048/1408/64/6/swiglu",
          "128/4096/1408/64/6/swiglu"]


def per_call_ms(calls, repeats=20, warmup=3):
    for i in range(warmup):
        calls[i % len(calls)]()
    samples = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls[i % len(calls)]()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples), min(samples), max(samples)


def trace(fn, label, count=4):
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(count):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    print(f"  trace {label}: {len(events)} GPU activities")
    previous_end = None
    for e in events:
        gap = "" if previous_end is None else f"gap {e.time_range.start - previous_end:8.1f} us"
        print(f"    {e.name[:60]:<60} {e.time_range.elapsed_us():9.1f} us  {gap}")
        previous_end = e.time_range.end


def persistent_graphs(sets, eager, k, activation):
    """One graph per input set whose launch takes a workspace made before the capture (see the docstring)."""
    made = []
    for s in sets:
        plan = cuda_backend.single_plan(s.x, s.router_weight, s.w2, top_k=k, activation=activation,
                                        normalize_topk=True, capacity_factor=None)
        made.append(torch.zeros(plan.workspace_bytes, dtype=torch.uint8, device=s.x.device))
    original, taken = cuda_backend._captured_workspace, []

    def kept_workspace(plan, device):
        taken.append(made[len(taken)])
        return taken[-1]

    cuda_backend._captured_workspace = kept_workspace
    try:
        graphs = []
        for call in eager:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call()
            graphs.append((graph, out))
    finally:
        cuda_backend._captured_workspace = original
    assert len(taken) == len(eager), f"the capture took {len(taken)} kept workspaces, expected {len(eager)}"
    flashdmoe.synchronize()
    return graphs


def main(argv):
    shapes = argv or SHAPES
    persistent = bool(os.environ.get("GRAPH_PROBE_PERSISTENT"))
    flashdmoe.set_sync_checks(False)
    for text in shapes:
        T, H, I, E, k = (int(v) for v in text.split("/")[:5])
        activation = text.split("/")[5]
        shape = BenchShape(tokens=T, hidden=H, ffn=I, experts=E, top_k=k)
        sets = [make_inputs(shape, activation=activation, dtype=torch.bfloat16, device="cuda", seed=s) for s in (0, 1)]
        with torch.no_grad():
            eager = [lambda s=s: flashdmoe.moe(s.x, s.router_weight, s.w1, s.w2, top_k=k, activation=activation,
                                               backend="cuda") for s in sets]
            for call in eager:
                call()
            flashdmoe.synchronize()
            graphs = []
            for call in eager:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call()
                graphs.append(graph)
            flashdmoe.synchronize()
            replays = [g.replay for g in graphs]
            rows = {
                "eager, 2 sets": per_call_ms(eager),
                "replay, 2 sets": per_call_ms(replays),
                "eager, 1 set": per_call_ms(eager[:1]),
                "replay, 1 set": per_call_ms(replays[:1]),
            }
            if persistent:
                kept = persistent_graphs(sets, eager, k, activation)
                kept_replays = [g.replay for g, _ in kept]
                rows["kept ws, 2 sets"] = per_call_ms(kept_replays)
                rows["kept ws, 1 set"] = per_call_ms(kept_replays[:1])
                rows["replay, 2 sets (again)"] = per_call_ms(replays)
                rows["kept ws, 2 sets (again)"] = per_call_ms(kept_replays)
                for (graph, out), call in zip(kept, eager):
                    graph.replay()
                    same = torch.equal(out, call())
                    print(f"  kept-workspace replay bitwise the eager call: {same}")
            print(f"{text}:")
            for name, (median, low, high) in rows.items():
                print(f"  {name:<16} {median:8.3f} ms (min {low:.3f}, max {high:.3f})")
            trace(lambda: [r() for r in replays], "replays (2 sets, x2)", count=2)
            trace(lambda: [c() for c in eager], "eager (2 sets, x2)", count=2)
            if persistent:
                trace(lambda: [r() for r in kept_replays], "kept-workspace replays (2 sets, x2)", count=2)
                del kept, kept_replays
            flashdmoe.synchronize()
        del sets, graphs, replays, eager
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
