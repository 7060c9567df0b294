"""One fused forward per listed shape for Nsight Compute (`ncu ... python3 scripts/ncu_probe.py`): a warm-up
launch (skipped with --launch-skip) then one profiled launch per shape. A development probe."""

import math
import sys

import torch

from flashdmoe import cuda_backend

SHAPES = {"paper": (8192, 2048, 2048, 32, 2), "small": (128, 4096, 1408, 64, 6),
          "experts": (16384, 2048, 8192, 8, 1)}  # "experts": the expert GEMMs are nearly all of the kernel


def main():
    for name in sys.argv[1:] or ["paper"]:
        T, H, I, E, k = SHAPES[name]
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        r = (torch.randn(E, H, device="cuda") / math.sqrt(H)).bfloat16()
        w1 = (torch.randn(E, H, I, device="cuda") / math.sqrt(H)).bfloat16()
        w2 = (torch.randn(E, I, H, device="cuda") / math.sqrt(I)).bfloat16()
        for _ in range(2):
            cuda_backend.fused_forward(x, r, w1, w2, top_k=k, activation="gelu", normalize_topk=True,
                                       capacity_factor=None)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
