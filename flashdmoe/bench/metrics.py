"""The numbers an entry is judged by: FLOPs, the bytes floor, and error against the reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashdmoe import numerics

# Max relative error (max|y - y_ref| / max|y_ref|) accepted per input dtype: the fused kernel's rounding
# bound (flashdmoe.numerics.kernel_tolerance). The largest element's error and the largest element are
# both a few standard deviations out, so the normwise bound carries over to this max-norm measure.
ERROR_TOLERANCES = {name: numerics.kernel_tolerance(name) for name, p in numerics.DTYPES.items() if p.kernel}


def gradient_tolerance(dtype: str, longest_reduction: int) -> float:
    """Bound on a gradient's normwise relative error against the float64 oracle: the roundings to the storage
    format (:func:`flashdmoe.numerics.backward_tolerance`), or for float32, where those are negligible, the
    summation order of four chained reductions of at most ``longest_reduction`` terms
    (:func:`flashdmoe.numerics.reorder_tolerance`)."""
    if numerics.precision(dtype).dtype == torch.float32:
        return numerics.reorder_tolerance(dtype, longest_reduction, depth=4)
    return numerics.backward_tolerance(dtype)


# Tokens whose k-th and (k+1)-th router log-probabilities differ by less than this are near ties:
# a different (equally valid) fp32 summation order may pick the other expert, so they are left out
# of the comparison (and counted).
NEAR_TIE_LOG_GAP = 1e-4


def expert_flops(tokens: int, hidden: int, ffn: int, top_k: int, activation: str) -> int:
    """The forward's expert GEMMs: ``2*T*k*H*I*(2, or 3 for swiglu)``."""
    expert_matmuls = 3 if activation == "swiglu" else 2
    return 2 * tokens * top_k * hidden * ffn * expert_matmuls


def moe_flops(shape_tokens: int, hidden: int, ffn: int, experts: int, top_k: int, activation: str) -> int:
    """Forward FLOPs: ``2*T*k*H*I*(2, or 3 for swiglu) + 2*T*H*E`` (expert GEMMs + router GEMM)."""
    return expert_flops(shape_tokens, hidden, ffn, top_k, activation) + 2 * shape_tokens * hidden * experts


def backward_flops(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, activation: str) -> int:
    """Backward FLOPs: every forward expert GEMM twice (data and weight gradient) plus the router's two,
    ``2 * expert_flops + 4*T*E*H``. Recomputing a forward GEMM (the pre-activations) is not counted: the
    number is the same for every implementation, so TFLOP/s compare like for like."""
    return 2 * expert_flops(tokens, hidden, ffn, top_k, activation) + 4 * tokens * experts * hidden


def tflops(flops: int, milliseconds: float) -> float:
    return flops / (milliseconds * 1e-3) / 1e12


def bytes_floor(
    active_experts: int, tokens: int, hidden: int, ffn: int, activation: str, element_size: int
) -> int:
    """Bytes a forward must move at least: active experts' W1 and W2 once, x read, y written."""
    w1_cols = 2 * ffn if activation == "swiglu" else ffn
    expert_bytes = (hidden * w1_cols + ffn * hidden) * element_size
    return active_experts * expert_bytes + 2 * tokens * hidden * element_size


def expected_active_experts(tokens: int, experts: int, top_k: int) -> float:
    """Distinct experts T tokens hit when each picks k of E uniformly: ``E * (1 - (1 - k/E)^T)``."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def active_expert_count(experts: torch.Tensor) -> int:
    """Distinct experts chosen at least once in experts [T, k] (int64)."""
    return int(torch.unique(experts).numel())


def near_tie_mask(probabilities: torch.Tensor, top_k: int, log_gap: float = NEAR_TIE_LOG_GAP) -> torch.Tensor:
    """bool [T]: the k-th and (k+1)-th largest of probabilities [T, E] are within ``log_gap`` in log.

    All False when k == E (no boundary to fall on).
    """
    experts = probabilities.shape[-1]
    if top_k >= experts:
        return torch.zeros(probabilities.shape[0], dtype=torch.bool, device=probabilities.device)
    largest = torch.topk(probabilities.double(), top_k + 1, dim=-1).values
    return (torch.log(largest[:, top_k - 1]) - torch.log(largest[:, top_k])) < log_gap


@dataclass(frozen=True)
class ErrorReport:
    max_relative_error: float
    compared_tokens: int


def max_relative_error(output: torch.Tensor, expected: torch.Tensor, keep: torch.Tensor) -> ErrorReport:
    """max|output - expected| / max|expected| over the rows where keep [T] is True.

    output, expected: [T, H] (any float dtype; compared in float64). Non-finite output gives inf.
    """
    if output.shape != expected.shape:
        raise ValueError(
            f"output.shape={tuple(output.shape)}: expected the reference's shape {tuple(expected.shape)}"
        )
    compared = int(keep.sum())
    if compared == 0:
        return ErrorReport(0.0, 0)
    got = output[keep].double()
    want = expected[keep].double()
    if not bool(torch.isfinite(got).all()):
        return ErrorReport(float("inf"), compared)
    scale = float(want.abs().max())
    difference = float((got - want).abs().max())
    return ErrorReport(difference / scale if scale > 0 else difference, compared)


def normwise_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want||_F / ||want||_F`` in float64, as :func:`flashdmoe.numerics.normwise_error` but on the
    tensors' device (gradients of large expert weights are slow to copy to the host)."""
    if got.shape != want.shape:
        raise ValueError(f"got.shape={tuple(got.shape)}: expected {tuple(want.shape)}")
    want64 = want.detach().to(torch.float64)
    difference = float((got.detach().to(device=want64.device, dtype=torch.float64) - want64).norm())
    scale = float(want64.norm())
    if scale == 0.0:
        return 0.0 if difference == 0.0 else math.inf
    return difference / scale
