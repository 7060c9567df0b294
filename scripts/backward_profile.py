"""Where the time of flashdmoe.expert_backward goes: eager medians with each element-wise back end, then
the profiler's CUDA kernel time per kernel (top entries) for the default one, beside the torch grouped_mm
pipeline's backward under autograd.

    python scripts/backward_profile.py [--shapes 8192/2048/2048/32/2/gelu,...] [--reps 20] [--top 10]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from backward_bench import ISSUE_SHAPES, median_ms, problem  # noqa: E402

from flashdmoe.bench import baselines  # noqa: E402
from flashdmoe.expert_backward import expert_backward  # noqa: E402


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
    args = parser.parse_args()
    dtype = torch.bfloat16
    summary = []
    for spec in args.shapes.split(","):
        *dims, activation = spec.split("/")
        T, H, I, E, k = map(int, dims)
        generator = torch.Generator(device="cuda").manual_seed(0)
        x, router_weight, w1, w2, (expert, weight, row), dy = problem(T, H, I, E, k, activation, dtype, generator)
        times = {}
        for elementwise in ("torch", "cuda"):
            run = lambda: expert_backward(x, router_weight, w1, w2, expert, weight, row, dy, activation=activation,  # noqa: E731
                                          normalize_topk=True, elementwise=elementwise)
            times[elementwise] = median_ms(run, args.reps)
        print(f"\n== {spec}: expert_backward eager ms: torch element-wise {times['torch']:.3f}, "
              f"cuda element-wise {times['cuda']:.3f}")
        rows = kernel_times(run, 5)
        gpu_ms = sum(us for _, us, _ in rows) / 1e3
        print(f"   kernels (cuda element-wise), sum {gpu_ms:.3f} ms per call:")
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
        summary.append((spec, times["torch"], times["cuda"], gpu_ms))
        del x, router_weight, w1, w2, dy, leaves
        torch.cuda.empty_cache()
    print(f"\n{'shape':<32} {'torch ew ms':>11} {'cuda ew ms':>10} {'kernels ms':>10}")
    for spec, t, c, g in summary:
        print(f"{spec:<32} {t:11.3f} {c:10.3f} {g:10.3f}")


if __name__ == "__main__":
    main()
