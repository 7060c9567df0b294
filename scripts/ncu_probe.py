"""One fused forward per listed shape for Nsight Compute (`ncu ... python3 scripts/ncu_probe.py`): a warm-up
launch (skipped with --launch-skip) then one profiled launch per shape. A development probe.

"decode" is Qwen3-30B-A3B's layer at one token, where most of the kernel's code runs once per launch: its
warp stall reasons (`ncu --section WarpStateStats --section SourceCounters -o R`) say where instruction
fetch ("no instruction") is waited on; `ncu --import R.ncu-rep --page source --csv --print-source sass`
then `scripts/sass_samples.py` sum them by source line."""

import math
import sys

import torch

from flashdmoe import cuda_backend

# (T, H, I, E, k, activation); "experts": the expert GEMMs are nearly all of the kernel
SHAPES = {"paper": (8192, 2048, 2048, 32, 2, "gelu"), "small": (128, 4096, 1408, 64, 6, "gelu"),
          "experts": (16384, 2048, 8192, 8, 1, "gelu"), "decode": (1, 2048, 768, 128, 8, "swiglu")}


def main():
    for name in sys.argv[1:] or ["paper"]:
        T, H, I, E, k, activation = SHAPES[name]
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        r = (torch.randn(E, H, device="cuda") / math.sqrt(H)).bfloat16()
        w1_cols = 2 * I if activation == "swiglu" else I  # swiglu: gate and up columns side by side
        w1 = (torch.randn(E, H, w1_cols, device="cuda") / math.sqrt(H)).bfloat16()
        w2 = (torch.randn(E, I, H, device="cuda") / math.sqrt(I)).bfloat16()
        for _ in range(2):
            cuda_backend.fused_forward(x, r, w1, w2, top_k=k, activation=activation, normalize_topk=True,
                                       capacity_factor=None)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
