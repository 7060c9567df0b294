"""Host side of an eager training step through the public API: where the CPU time of
``flashdmoe.moe`` (grad mode) and its backward goes, and whether anything waits for the GPU.

Prints the profiler's top CPU operators (self time per step), the CUDA runtime calls that block
(synchronisations, device-to-host copies) and the wall time per step beside the GPU time.

    python scripts/training_host_profile.py [--shape 8192/2048/2048/32/2/gelu] [--steps 20]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import flashdmoe

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
            "cudaMemcpyAsync", "cudaMalloc", "cudaFree", "cudaHostAlloc")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192/2048/2048/32/2/gelu")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    *dims, activation = args.shape.split("/")
    T, H, I, E, k = map(int, dims)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    cols = 2 * I if activation == "swiglu" else I
    leaves = [randn(T, H), randn(E, H, scale=1 / math.sqrt(H)), randn(E, H, cols, scale=1 / math.sqrt(H)),
              randn(E, I, H, scale=1 / math.sqrt(I))]
    for leaf in leaves:
        leaf.requires_grad_()
    dy = randn(T, H)

    def step():
        for leaf in leaves:
            leaf.grad = None
        y = flashdmoe.moe(*leaves, top_k=k, activation=activation, backend="cuda")
        y.backward(dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    forward_host = backward_host = 0.0
    for _ in range(args.steps):
        for leaf in leaves:
            leaf.grad = None
        t0 = time.perf_counter()
        y = flashdmoe.moe(*leaves, top_k=k, activation=activation, backend="cuda")
        t1 = time.perf_counter()
        y.backward(dy)
        t2 = time.perf_counter()
        forward_host += t1 - t0
        backward_host += t2 - t1
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps * 1e3
    print(f"{args.shape}: wall {wall:.3f} ms per step; host time in forward {forward_host / args.steps * 1e3:.3f} ms, "
          f"in backward {backward_host / args.steps * 1e3:.3f} ms")

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    rows = sorted(table, key=lambda e: -e.self_cpu_time_total)
    print(f"top CPU operators (self µs per step, calls per step):")
    for event in rows[:25]:
        print(f"  {event.self_cpu_time_total / args.steps:9.1f}  x{event.count // args.steps:<4} {event.key[:80]}")
    print("blocking CUDA runtime calls per step:")
    for event in table:
        if event.key.startswith(BLOCKING):
            print(f"  {event.key[:60]:<60} x{event.count / args.steps:.1f}  {event.cpu_time_total / args.steps:9.1f} µs")
    ops = sum(e.count for e in table if e.key.startswith("aten::")) / args.steps
    print(f"aten operator calls per step: {ops:.0f}")


if __name__ == "__main__":
    main()
