"""The integer codes the ``flashdmoe_cuda`` extension takes for a dtype and an activation.

They mirror the C++ enums: ``DType`` in ``csrc/moe/launch.h`` and ``Activation`` in ``csrc/moe/params.cuh``,
which the forward's launch and the backward's element-wise kernels (``csrc/backward/expert_grad.h``) both
take; change them together. Importing this module needs no GPU and no built extension.
"""

from __future__ import annotations

import torch

__all__ = ["ACTIVATION_CODES", "DTYPE_CODES"]

ACTIVATION_CODES = {"relu": 0, "gelu": 1, "silu": 2, "swiglu": 3}
# float32 runs the forward's tensor cores in TF32 (one rank, on expert_variants.FP32_EXPERT_VARIANT; teams
# carry bf16 / fp16); the backward's element-wise kernels take the 16-bit codes only.
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
