"""Quick device-side probe of the emulated expert-parallel forward: the same total work (T tokens over
P ranks, E experts) for P = 1, 2, 4, 8; CUDA events, median of 20 after warm-up. A development probe;
the benchmark of record is `flashdmoe bench --suite expert-parallel`."""

import math
import statistics
import sys

import torch

import flashdmoe
from flashdmoe import cuda_backend
from flashdmoe.parallel.team import Team

SHAPES = [(8192, 2048, 2048, 32, 2), (4096, 2048, 2048, 64, 2)]


def median_ms(fn, reps=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    print(f"{'T':>6} {'H':>5} {'I':>5} {'E':>4} {'k':>2} {'P':>2} {'ms':>8} {'vs P=1':>7} {'MB sent/rank':>12} {'payload':>8}")
    for T, H, I, E, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        router = (torch.randn(E, H, device="cuda", generator=g) / math.sqrt(H)).bfloat16()
        w1 = (torch.randn(E, H, I, device="cuda", generator=g) / math.sqrt(H)).bfloat16()
        w2 = (torch.randn(E, I, H, device="cuda", generator=g) / math.sqrt(I)).bfloat16()
        base = None
        for P in (1, 2, 4, 8):
            xs, w1s, w2s = list(x.chunk(P)), list(w1.split(E // P)), list(w2.split(E // P))
            if P == 1:
                fn = lambda: cuda_backend.fused_forward(x, router, w1, w2, top_k=k, activation="gelu",
                                                        normalize_topk=True, capacity_factor=None)
            else:
                team = Team.emulated(P, max_tokens=T // P, hidden=H, top_k=k, local_experts=E // P)
                fn = lambda: cuda_backend.run_forward(xs, router, w1s, w2s, top_k=k, activation="gelu",
                                                      normalize_topk=True, capacity_factor=None, team=team)
            ms = median_ms(fn)
            fn()
            report = flashdmoe.last_report()
            flashdmoe.synchronize()
            rep = report.traffic()
            sent = sum(e["dispatch_bytes"] + e["combine_bytes"] for e in rep) / len(rep) / 1e6
            eff = [e["payload_efficiency"] for e in rep if e["payload_efficiency"] is not None]
            base = base or ms
            print(f"{T:>6} {H:>5} {I:>5} {E:>4} {k:>2} {P:>2} {ms:>8.3f} {ms / base:>7.2f} {sent:>12.1f} "
                  f"{(min(eff) if eff else float('nan')):>8.3f}  phases={ {n: round(v, 3) for n, v in (report.phase_ms or {}).items()} } "
                  f"grid={report.grid} blocks/SM={report.blocks_per_sm} smem={report.smem_bytes}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
