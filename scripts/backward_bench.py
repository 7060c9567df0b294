"""Time flashdmoe.expert_backward beside the torch grouped_mm pipeline's backward under autograd.

For each shape (issue 14's three by default): the backward alone from saved routing (eager and replayed
from a CUDA graph), and the baseline ``flashdmoe.bench.baselines.grouped_mm_pipeline`` under autograd
(backward alone, and forward + backward). CUDA events around each run, medians; one table at the end.
"Useful" TFLOP/s counts 2x the forward's expert FLOPs plus the router's backward (4 T E H), not the
recomputed GEMM1.

    python scripts/backward_bench.py [--shapes 8192/2048/2048/32/2/gelu,...] [--dtype bfloat16] [--reps 20]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from flashdmoe import reference
from flashdmoe.bench import baselines
from flashdmoe.expert_backward import expert_backward, grouped_mm_supported

ISSUE_SHAPES = "8192/2048/2048/32/2/gelu,8192/2048/768/128/8/swiglu,4096/4096/14336/8/2/swiglu"


def pack_rows(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Dropless rows as the fused kernel numbers them: by expert, token order within an expert."""
    order = torch.sort(experts.reshape(-1), stable=True).indices
    row = torch.empty_like(order)
    row[order] = torch.arange(order.numel(), device=order.device)
    return row.view(experts.shape).to(torch.int32)


def problem(T, H, I, E, k, activation, dtype, generator):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(dtype)

    w1_cols = 2 * I if activation == "swiglu" else I
    x, dy = randn(T, H), randn(T, H)
    router_weight = randn(E, H, scale=1 / math.sqrt(H))
    w1, w2 = randn(E, H, w1_cols, scale=1 / math.sqrt(H)), randn(E, I, H, scale=1 / math.sqrt(I))
    routing = reference.route(x, router_weight, k, normalize_topk=True)
    saved = (routing.experts.to(torch.int32), routing.weights.float(), pack_rows(routing.experts, E))
    return x, router_weight, w1, w2, saved, dy


def median_ms(run, reps: int, before=None) -> float:
    """Median over ``reps`` of the GPU time between events around ``run()``; ``before()`` runs untimed."""
    times = []
    for _ in range(reps + 3):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times[3:])


def bench_shape(T, H, I, E, k, activation, dtype, reps):
    generator = torch.Generator(device="cuda").manual_seed(0)
    x, router_weight, w1, w2, (expert, weight, row), dy = problem(T, H, I, E, k, activation, dtype, generator)
    options = dict(activation=activation, normalize_topk=True)
    ours = lambda: expert_backward(x, router_weight, w1, w2, expert, weight, row, dy, **options)  # noqa: E731

    torch.cuda.synchronize()
    base_memory = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ours()
    torch.cuda.synchronize()
    peak_gb = (torch.cuda.max_memory_allocated() - base_memory) / 2**30
    eager_ms = median_ms(ours, reps)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ours()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours()
    graph_ms = median_ms(graph.replay, reps)
    del graph

    w1_base, w2_base, _, _ = baselines.prepare_grouped_mm_weights(x, router_weight, w1, w2, top_k=k,
                                                                  activation=activation)
    leaves = [t.detach().requires_grad_() for t in (x, router_weight, w1_base, w2_base)]
    state = {}

    def forward():
        state["y"] = baselines.grouped_mm_pipeline(*leaves, top_k=k, activation=activation)

    def backward():
        torch.autograd.grad(state.pop("y"), leaves, dy)

    base_bwd_ms = median_ms(backward, reps, before=forward)
    base_total_ms = median_ms(lambda: (forward(), backward()), reps)

    w1_cols = 2 * I if activation == "swiglu" else I
    useful = 2 * (2 * T * k * H * (w1_cols + I)) + 4 * T * E * H
    return {
        "shape": f"{T}/{H}/{I}/{E}/{k} {activation}",
        "gemm": "grouped_mm" if not grouped_mm_supported(dtype, x.device, H, I) else "padded_bmm",
        "ours_ms": eager_ms, "graph_ms": graph_ms, "peak_gb": peak_gb,
        "base_bwd_ms": base_bwd_ms, "base_total_ms": base_total_ms,
        "tflops": useful / (eager_ms * 1e-3) / 1e12,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=ISSUE_SHAPES, help="comma-separated T/H/I/E/k/activation")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, medians of {args.reps}")
    rows = []
    for spec in args.shapes.split(","):
        *dims, activation = spec.split("/")
        rows.append(bench_shape(*map(int, dims), activation, dtype, args.reps))
        torch.cuda.empty_cache()
    header = (f"{'shape (T/H/I/E/k act)':<32} {'gemm':>10} {'ours ms':>8} {'graph ms':>8} {'TFLOP/s':>8} "
              f"{'peak GB':>8} {'gmm bwd ms':>10} {'gmm f+b ms':>10} {'speedup':>7}")
    print(header)
    for r in rows:
        print(f"{r['shape']:<32} {r['gemm']:>10} {r['ours_ms']:8.3f} {r['graph_ms']:8.3f} {r['tflops']:8.1f} "
              f"{r['peak_gb']:8.2f} {r['base_bwd_ms']:10.3f} {r['base_total_ms']:10.3f} "
              f"{r['base_bwd_ms'] / r['ours_ms']:6.2f}x")


if __name__ == "__main__":
    main()
