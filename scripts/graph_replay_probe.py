"""Why a CUDA-graph replay of ``flashdmoe.moe`` can take longer than the eager call on weight-heavy shapes.

For each shape: the public call eagerly and replayed from a graph (one graph per input set, as the
single-GPU bench does), each timed per call with CUDA events around it, two input sets alternated and one
set repeated; then one profiler trace of a few replays and a few eager calls listing every GPU activity
(kernels, memsets, copies) with its duration and the gap before it. A development probe.

    python scripts/graph_replay_probe.py [T/H/I/E/k/act ...]

GRAPH_PROBE_ZEROING=1 adds graphs captured with no kept sync words left (flashdmoe.kernel.workspace_pool), which
zero the launch's sync words in a step of their own before it, as every capture did before kept blocks:
what that step costs a replay, timed in alternation with the default graphs.
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

import flashdmoe
from flashdmoe.kernel import workspace_pool
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


def zeroing_graphs(eager):
    """One graph per call captured as if no kept sync-word block were left (see the docstring)."""
    graphs = []
    workspace_pool.graph_sync.take = lambda device, nbytes: None
    try:
        for call in eager:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call()
            graphs.append((graph, out))
    finally:
        del workspace_pool.graph_sync.take  # the class's method again
    flashdmoe.synchronize()
    return graphs


def main(argv):
    shapes = argv or SHAPES
    zeroing = bool(os.environ.get("GRAPH_PROBE_ZEROING"))
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
            if zeroing:
                zeroed = zeroing_graphs(eager)
                zeroed_replays = [g.replay for g, _ in zeroed]
                rows["zeroing, 2 sets"] = per_call_ms(zeroed_replays)
                rows["zeroing, 1 set"] = per_call_ms(zeroed_replays[:1])
                rows["replay, 2 sets (again)"] = per_call_ms(replays)
                rows["zeroing, 2 sets (again)"] = per_call_ms(zeroed_replays)
                for (graph, out), call in zip(zeroed, eager):
                    graph.replay()
                    same = torch.equal(out, call())
                    print(f"  zeroing replay bitwise the eager call: {same}")
            print(f"{text}:")
            for name, (median, low, high) in rows.items():
                print(f"  {name:<16} {median:8.3f} ms (min {low:.3f}, max {high:.3f})")
            trace(lambda: [r() for r in replays], "replays (2 sets, x2)", count=2)
            trace(lambda: [c() for c in eager], "eager (2 sets, x2)", count=2)
            if zeroing:
                trace(lambda: [r() for r in zeroed_replays], "zeroing replays (2 sets, x2)", count=2)
                del zeroed, zeroed_replays
            flashdmoe.synchronize()
        del sets, graphs, replays, eager
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
