"""Where the time of flashdmoe.backward.expert_backward goes: eager medians of the grouped-GEMM back end (with the
element-wise kernels and the saved pre-activations) and of the fused back end (``gemm="fused"``), then
the profiler's CUDA kernel time per kernel (top entries) for one back end (``--profile-gemm``, default
``"auto"``), beside the torch grouped_mm pipeline's backward under autograd.

    python scripts/backward_profile.py [--shapes 8192/2048/2048/32/2/gelu,...] [--reps 20] [--top 10]
                                       [--profile-gemm auto|fused|grouped_mm]
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics

import torch

from flashdmoe import cuda_backend
from flashdmoe.bench import baselines
from flashdmoe.backward.expert_backward import expert_backward

ISSUE_SHAPES = "8192/2048/2048/32/2/gelu,8192/2048/768/128/8/swiglu,4096/4096/14336/8/2/swiglu"


def problem(T, H, I, E, k, activation, dtype, generator):
    """Random inputs, then the fused forward's routing and saved pre-activations, and dy."""
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(dtype)

    w1_cols = 2 * I if activation == "swiglu" else I
    x, dy = randn(T, H), randn(T, H)
    router_weight = randn(E, H, scale=1 / math.sqrt(H))
    w1, w2 = randn(E, H, w1_cols, scale=1 / math.sqrt(H)), randn(E, I, H, scale=1 / math.sqrt(I))
    pre = torch.empty(T * k, w1_cols, dtype=dtype, device="cuda")
    _, routing = cuda_backend.fused_forward(x, router_weight, w1, w2, top_k=k, activation=activation,
                                            normalize_topk=True, capacity_factor=None, saved_pre=pre)
    saved = (routing.expert.clone(), routing.weight.clone(), routing.row.clone())
    return x, router_weight, w1, w2, saved, pre, dy


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




def kernel_times(run, reps: int) -> list[tuple[str, float, int]]:
    """(kernel name, µs per call, launches per call) from the profiler over ``reps`` calls."""
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    total = collections.defaultdict(float)
    count = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            count[event.name] += 1
    return sorted(((name[:90], us / reps, count[name] // reps) for name, us in total.items()), key=lambda r: -r[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=ISSUE_SHAPES)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--profile-gemm", default="auto", choices=("auto", "fused", "grouped_mm"))
    args = parser.parse_args()
    dtype = torch.bfloat16
    summary = []
    for spec in args.shapes.split(","):
        *dims, activation = spec.split("/")
        T, H, I, E, k = map(int, dims)
        generator = torch.Generator(device="cuda").manual_seed(0)
        x, router_weight, w1, w2, (expert, weight, row), pre, dy = problem(T, H, I, E, k, activation, dtype,
                                                                           generator)
        times = {}
        for name, gemm in (("grouped_mm", "grouped_mm"), ("fused", "fused")):
            run = lambda: expert_backward(x, router_weight, w1, w2, expert, weight, row, dy, activation=activation,  # noqa: E731
                                          normalize_topk=True, gemm=gemm, pre=pre)
            times[name] = median_ms(run, args.reps)
        run = lambda: expert_backward(x, router_weight, w1, w2, expert, weight, row, dy, activation=activation,  # noqa: E731
                                      normalize_topk=True, gemm=args.profile_gemm, pre=pre)
        print(f"\n== {spec}: expert_backward eager ms: " + ", ".join(f"{n} {t:.3f}" for n, t in times.items()))
        rows = kernel_times(run, 5)
        gpu_ms = sum(us for _, us, _ in rows) / 1e3
        print(f"   kernels (gemm={args.profile_gemm}), sum {gpu_ms:.3f} ms per call:")
        for name, us, n in rows[: args.top]:
            print(f"   {us:9.1f} us  x{n:<3} {name}")

        w1b, w2b, _, _ = baselines.prepare_grouped_mm_weights(x, router_weight, w1, w2, top_k=k, activation=activation)
        leaves = [t.detach().requires_grad_() for t in (x, router_weight, w1b, w2b)]

        def base():
            y = baselines.grouped_mm_pipeline(*leaves, top_k=k, activation=activation)
            torch.autograd.grad(y, leaves, dy)

        base_rows = kernel_times(base, 5)
        print(f"   grouped_mm pipeline fwd+bwd kernels, sum {sum(us for _, us, _ in base_rows) / 1e3:.3f} ms:")
        for name, us, n in base_rows[: args.top]:
            print(f"   {us:9.1f} us  x{n:<3} {name}")
        summary.append((spec, times, gpu_ms))
        del x, router_weight, w1, w2, dy, leaves, pre
        torch.cuda.empty_cache()
    names = list(summary[0][1]) if summary else []
    print(f"\n{'shape':<32} " + " ".join(f"{n + ' ms':>14}" for n in names) + f" {'kernels ms':>10}")
    for spec, times, g in summary:
        print(f"{spec:<32} " + " ".join(f"{times[n]:14.3f}" for n in names) + f" {g:10.3f}")

if __name__ == "__main__":
    main()
