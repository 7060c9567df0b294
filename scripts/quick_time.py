"""Quick device-side timing of the fused forward on the shapes of docs/design.md §12 (CUDA events, median of 20
after warm-up, 3 rotated input sets). A development probe; the benchmark of record is `flashdmoe bench`."""

import math
import os
import statistics

import torch

import flashdmoe
from flashdmoe import cuda_backend, extension
from flashdmoe.expert_variants import EXPERT_VARIANTS, variant_id

SHAPES = [(8192, 2048, 2048, 32, 2), (16384, 2048, 2048, 64, 2), (16384, 4096, 1024, 128, 2),
          (4096, 2048, 2048, 64, 2), (128, 4096, 1408, 64, 6)]


def main():
    ext = extension.load()
    for name, code in EXPERT_VARIANTS.items():
        print(f"kernel attributes bf16 {name}:", ext.kernel_attributes(0, code))
    print(f"{'variant':>16} {'T':>6} {'H':>5} {'I':>5} {'E':>4} {'k':>2} {'ms':>8} {'TF/s':>7}")
    wanted = [v for v in os.environ.get("QUICK_VARIANTS", "").split(",") if v] or list(EXPERT_VARIANTS)
    for name in wanted:
        variant_id(name)  # an unknown name fails here, before any timing
    # QUICK_SHAPES="T/H/I/E/k,...": shapes besides docs/design.md §12's (e.g. to separate per-tile from per-slab cost).
    shapes = [tuple(int(v) for v in s.split("/")) for s in os.environ.get("QUICK_SHAPES", "").split(",") if s] or SHAPES
    # QUICK_ACTIVATION=relu: how much of a tile's time the GEMM1 epilogue's activation takes.
    activation = os.environ.get("QUICK_ACTIVATION", "gelu")
    for (T, H, I, E, k), variant in [(s, v) for s in shapes for v in wanted]:
        cuda_backend.debug.expert_variant = variant
        sets = []
        for _ in range(3):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            r = (torch.randn(E, H, device="cuda") / math.sqrt(H)).bfloat16()
            w1 = (torch.randn(E, H, I, device="cuda") / math.sqrt(H)).bfloat16()
            w2 = (torch.randn(E, I, H, device="cuda") / math.sqrt(I)).bfloat16()
            sets.append((x, r, w1, w2))
        run = lambda s: cuda_backend.fused_forward(*s, top_k=k, activation=activation, normalize_topk=True,
                                                   capacity_factor=None)
        # Events around each forward, no synchronisation in between (a forward never waits): the host runs
        # ahead, so "ms" is the GPU's time per forward (memset + kernel + status copy), not the host's too.
        for i in range(5):
            run(sets[i % 3])
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(21)]
        for i, (a, b) in enumerate(events):
            a.record()
            run(sets[i % 3])
            b.record()
        flashdmoe.synchronize()
        times = [a.elapsed_time(b) for a, b in events]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(6):
                run(sets[i % 3])
            torch.cuda.synchronize()
        flashdmoe.synchronize()
        kern = [e.device_time for e in prof.events() if "moe_forward_kernel" in e.name]
        kernel_ms = statistics.median(kern) / 1000 if kern else float("nan")
        import time as _t

        h0 = _t.perf_counter()
        for i in range(10):
            run(sets[i % 3])
        h1 = _t.perf_counter()
        flashdmoe.synchronize()
        host_us = (h1 - h0) / 10 * 1e6
        ms = statistics.median(times)
        flops = 2 * T * k * H * I * 2 + 2 * T * H * E
        phases = " ".join(f"{k}={v:.3f}" for k, v in (flashdmoe.last_report().phase_ms or {}).items())
        if os.environ.get("QUICK_PROFILE") == str(T):  # where the host time of a call goes (QUICK_PROFILE=T)
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            for i in range(20):
                run(sets[i % 3])
            profiler.disable()
            flashdmoe.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
        print(f"{variant:>16} {T:>6} {H:>5} {I:>5} {E:>4} {k:>2} {ms:>8.3f} {flops / ms / 1e9:>7.1f}  kernel {kernel_ms:.3f} ms"
              f" ({flops / kernel_ms / 1e9:.0f} TF/s)  host {host_us:.0f} us/call  phases(ms) {phases}")


if __name__ == "__main__":
    main()
