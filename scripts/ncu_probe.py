"""One fused forward per listed shape for Nsight Compute (`ncu ... python3 scripts/ncu_probe.py`): a warm-up
launch (skipped with --launch-skip) then one profiled launch per shape. A shape is a name below or
T/H/I/E/k[/activation] (inputs as the bench draws them, in bf16: a DeepSeek-V3 layer fits an 80 GB GPU).
A development probe.

    ncu --replay-mode application --metrics dram__bytes_read.sum,... python3 scripts/ncu_probe.py 8192/7168/2048/256/8/swiglu

"decode" is Qwen3-30B-A3B's layer at one token, where most of the kernel's code runs once per launch: its
warp stall reasons (`ncu --section WarpStateStats --section SourceCounters -o R`) say where instruction
fetch ("no instruction") is waited on; `ncu --import R.ncu-rep --page source --csv --print-source sass`
then `scripts/sass_samples.py` sum them by source line (`--reasons`: by stall reason, where the expert GEMMs
wait). NCU_VARIANT=<expert variant> forces one (e.g. the default where the public call picks the cluster
variant, which the profiler's replay fails on)."""

import os
import sys

import torch

from flashdmoe import cuda_backend
from flashdmoe.bench.results import BenchShape
from flashdmoe.bench.workload import make_inputs
from quick_time import parse_shapes  # scripts/ is on the path when a script runs

# (T, H, I, E, k, activation); "experts": the expert GEMMs are nearly all of the kernel
SHAPES = {"paper": (8192, 2048, 2048, 32, 2, "gelu"), "small": (128, 4096, 1408, 64, 6, "gelu"),
          "experts": (16384, 2048, 8192, 8, 1, "gelu"), "decode": (1, 2048, 768, 128, 8, "swiglu")}


def main():
    cuda_backend.debug.expert_variant = os.environ.get("NCU_VARIANT") or None
    shapes = [shape for item in sys.argv[1:] or ["paper"]
              for shape in ([SHAPES[item]] if item in SHAPES else parse_shapes(item, "gelu"))]
    for T, H, I, E, k, activation in shapes:
        inputs = make_inputs(BenchShape(T, H, I, E, k), activation=activation, dtype=torch.bfloat16, device="cuda",
                             seed=0)
        for _ in range(2):
            cuda_backend.fused_forward(inputs.x, inputs.router_weight, inputs.w1, inputs.w2, top_k=k,
                                       activation=activation, normalize_topk=True, capacity_factor=None)
        torch.cuda.synchronize()
        del inputs


if __name__ == "__main__":
    main()
