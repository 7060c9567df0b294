"""Where the fused backward's time goes: the launch alone (flashdmoe.backward.fused_backward.launch) with each kind
of task switched on in turn (g tiles only; then with the dx tiles, the dW2 tiles, the dW1 tiles; then all),
beside torch.mm on the same FLOPs as one dense GEMM (what cuBLAS reaches on them).

    python scripts/backward_phases.py [--shapes 8192/2048/2048/32/2/gelu,...] [--reps 20] [--kinds g,g+dx,...]
"""

from __future__ import annotations

import argparse

import torch

from backward_profile import median_ms  # scripts/ is on the path when a script runs
from flashdmoe import cuda_backend
from flashdmoe.backward import fused_backward

ISSUE_SHAPES = "8192/2048/2048/32/2/gelu,8192/2048/768/128/8/swiglu,4096/4096/14336/8/2/swiglu"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=ISSUE_SHAPES)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--kinds", default="g,g+dx,g+dW2,g+dW1,all",
                        help="the launches to time (the per-kind split needs all five)")
    args = parser.parse_args()
    dtype = torch.bfloat16
    kinds = {"g": (False, False, False), "g+dx": (True, False, False), "g+dW2": (False, False, True),
             "g+dW1": (False, True, False), "all": (True, True, True)}
    wanted = args.kinds.split(",")
    unknown = sorted(set(wanted) - set(kinds))
    if unknown:
        parser.error(f"--kinds: {unknown} not among {sorted(kinds)}")
    kinds = {name: need for name, need in kinds.items() if name in wanted}
    lines = []
    for spec in args.shapes.split(","):
        *dims, activation = spec.split("/")
        T, H, I, E, k = map(int, dims)
        w1_cols = 2 * I if activation == "swiglu" else I
        g = torch.Generator(device="cuda").manual_seed(0)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

        x, dy = randn(T, H), randn(T, H)
        router = randn(E, H, scale=H ** -0.5)
        w1, w2 = randn(E, H, w1_cols, scale=H ** -0.5), randn(E, I, H, scale=I ** -0.5)
        pre = torch.empty(T * k, w1_cols, dtype=dtype, device="cuda")
        _, routing = cuda_backend.fused_forward(x, router, w1, w2, top_k=k, activation=activation, normalize_topk=True,
                                                capacity_factor=None, saved_pre=pre)
        expert = routing.expert.to(torch.int32).contiguous()
        row = routing.row.to(torch.int32).contiguous()
        weight = routing.weight.to(torch.float32).contiguous()
        rows = T * k
        flops = {"g": 2 * rows * H * I, "dx": 2 * rows * w1_cols * H, "dW2": 2 * rows * I * H, "dW1": 2 * rows * H * w1_cols}
        times = {}
        for name, (need_dx, need_dw1, need_dw2) in kinds.items():
            times[name] = median_ms(lambda: fused_backward.launch(
                x, dy, w1, w2, pre, expert, row, weight, activation=activation, need_dx=need_dx,
                need_dw1=need_dw1, need_dw2=need_dw2), args.reps)
        if len(kinds) == 5:
            parts = {"g": times["g"], "dx": times["g+dx"] - times["g"], "dW2": times["g+dW2"] - times["g"],
                     "dW1": times["g+dW1"] - times["g"]}
            text = ", ".join(f"{n} {t:.3f} ms ({flops[n] / t / 1e9:.0f} TFLOP/s)" for n, t in parts.items())
            lines.append(f"{spec}: all {times['all']:.3f} ms; {text}")
        else:
            lines.append(f"{spec}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()))
        print(lines[-1], flush=True)
        a, b = randn(rows, H), randn(H, I)
        dense = median_ms(lambda: torch.mm(a, b), args.reps)
        lines.append(f"{spec}: torch.mm [{rows}, {H}] x [{H}, {I}] {dense:.3f} ms "
                     f"({2 * rows * H * I / dense / 1e9:.0f} TFLOP/s)")
        print(lines[-1], flush=True)
        del x, dy, router, w1, w2, pre, a, b
        torch.cuda.empty_cache()
    flashdmoe_check()
    print("\n".join(["", "== summary"] + lines))


def flashdmoe_check():
    import flashdmoe

    flashdmoe.synchronize()  # a launch that failed raises here


if __name__ == "__main__":
    main()
