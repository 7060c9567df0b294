"""Precision facts in one place: the dtype table and the error bounds derived from it.

Every tolerance in the package (the main job's verification, the benchmarks' error column) and in the
tests comes from here, computed from the arithmetic (unit roundoff, how many roundings a result passes
through, reduction lengths), not from what passed once. ``docs/design.md`` (numerics) explains the model.

Error measure: *normwise relative error* ``||got - want|| / ||want||`` (Frobenius or max norm, see each
function), which tolerates cancellation in single elements but not a wrong row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "DTYPES", "Precision", "precision", "dtype_by_name", "kernel_tolerance", "reorder_tolerance",
    "normwise_error", "max_normwise_error", "TF32_UNIT_ROUNDOFF", "rounding_tolerance",
    "backward_tolerance",
]

# TF32 keeps 10 explicit mantissa bits: the float32 path of the fused kernel multiplies in TF32.
TF32_UNIT_ROUNDOFF = 2.0 ** -11


@dataclass(frozen=True)
class Precision:
    """One floating-point format as the project uses it.

    ``unit_roundoff``: u = 2^-p (p = significand bits, implicit bit included), the largest relative
    error of one rounding to nearest. ``kernel``: whether the fused CUDA kernel takes it.
    ``compute_unit_roundoff``: u of what the tensor cores multiply in (TF32 for float32).
    """

    name: str
    dtype: torch.dtype
    element_bytes: int
    unit_roundoff: float
    kernel: bool
    compute_unit_roundoff: float


DTYPES: dict[str, Precision] = {
    "float64": Precision("float64", torch.float64, 8, 2.0 ** -53, False, 2.0 ** -53),
    "float32": Precision("float32", torch.float32, 4, 2.0 ** -24, True, TF32_UNIT_ROUNDOFF),
    "bfloat16": Precision("bfloat16", torch.bfloat16, 2, 2.0 ** -8, True, 2.0 ** -8),
    "float16": Precision("float16", torch.float16, 2, 2.0 ** -11, True, 2.0 ** -11),
}
_BY_DTYPE = {p.dtype: p for p in DTYPES.values()}


def precision(dtype: torch.dtype | str) -> Precision:
    """The table entry for a torch dtype or its name (``"bfloat16"``); ValueError for any other."""
    entry = DTYPES.get(dtype) if isinstance(dtype, str) else _BY_DTYPE.get(dtype)
    if entry is None:
        raise ValueError(f"dtype={dtype!r}: expected one of {tuple(DTYPES)}")
    return entry


def dtype_by_name(name: str) -> torch.dtype:
    return precision(name).dtype


def kernel_tolerance(dtype: torch.dtype | str) -> float:
    """Bound on the Frobenius normwise relative error of the fused layer's output against the reference
    computed in float32 (or float64) on the same dtype-rounded inputs and the same routing.

    The kernel accumulates in float32, so the error is set by the roundings to the storage format on the
    way: the activation h (before GEMM2), each expert's result row (before the combine) and the output y.
    Each rounding changes every element by at most u/2 relative, so ||delta|| / ||value|| <= u/2 for it,
    and GEMM2 carries h's error to y with the same relative size (a random-sign sum). float32 inputs run
    on TF32 tensor cores: x, W1, h and W2 are each rounded to TF32 (u = 2^-11) and results stay float32.
    Roundings: n = 3 for half formats, 4 for TF32, together at most n * u / 2; the bound is four times
    that, 2 * n * u, for the two statistical steps (GEMM2's propagation and the error of the fast-math
    activation functions, ~1e-6 relative).
    Float32 accumulation over K <= 2^14 terms adds < K * 2^-24 <= 2^-10 of the *sum of magnitudes*,
    which on the random-sign sums in play is ~sqrt(K) * 2^-24 relative: negligible beside these.
    """
    entry = precision(dtype)
    if not entry.kernel:
        raise ValueError(f"dtype={entry.name}: the fused kernel takes {[p.name for p in DTYPES.values() if p.kernel]}")
    roundings = 4 if entry.dtype == torch.float32 else 3
    return 2.0 * roundings * entry.compute_unit_roundoff


def rounding_tolerance(dtype: torch.dtype | str, operations: int) -> float:
    """Relative bound on a short chain of ``operations`` correctly rounded operations in ``dtype`` on
    well-conditioned values (a softmax of a few numbers, a hand-worked output): to first order the
    relative errors add, at most u each."""
    return max(int(operations), 1) * precision(dtype).unit_roundoff


def backward_tolerance(dtype: torch.dtype | str) -> float:
    """Bound on the normwise relative error of the GPU backward's gradients
    (:mod:`flashdmoe.backward.expert_backward`) against the reference in float32 or float64 on the same inputs.

    The backward rounds to the storage format (at most u/2 relative each time) on the way to a gradient:
    dx passes through 5 roundings (the saved or recomputed pre-activation, g = dy W2^T, dpre, the per-row
    dx, the returned dx), dW1 through 4, dW2 through 3, d_router through 4 (the GPU path rounds dlogits
    before its GEMM). As in :func:`kernel_tolerance` the bound is
    four times the worst sum n * u / 2: 2 * n * u with n = 5.
    """
    return 2.0 * 5 * precision(dtype).unit_roundoff


def reorder_tolerance(dtype: torch.dtype | str, reduction_length: int, *, depth: int = 1) -> float:
    """Bound on the normwise relative difference between two evaluations of the same expression in
    ``dtype`` that differ only in summation order (another blocking, another split over ranks, or the
    exact result).

    A sum of n terms carries a rounding error of at most lambda * sqrt(n) * u times the sum of the terms'
    magnitudes with probability >= 1 - 2 exp(-lambda^2 / 2) (Higham and Mary, "A new approach to
    probabilistic rounding error analysis", 2019); lambda = 6 puts that at 3e-8. Relative to the result's
    norm, a sum of n random-sign terms has norm ~ (sum of magnitudes) / sqrt(n), which gives
    lambda * n * u per reduction. ``depth`` chains that many reductions (forward GEMMs, the backward's
    GEMMs), whose errors add. The worst case (n * u per reduction, any data) is far looser and is not what
    random test data produce.
    """
    u = precision(dtype).unit_roundoff
    n = max(int(reduction_length), 1)
    if n * u >= 0.5:
        raise ValueError(f"reduction_length={reduction_length}: too long for a bound in {precision(dtype).name}")
    return depth * _LAMBDA * n * u


_LAMBDA = 6.0


def normwise_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want||_F / ||want||_F in float64 (0 when both are empty or zero; inf if only want is 0)."""
    got64, want64 = got.detach().to(torch.float64).cpu(), want.detach().to(torch.float64).cpu()
    if got64.shape != want64.shape:
        raise ValueError(f"shapes differ: got {tuple(got64.shape)}, want {tuple(want64.shape)}")
    diff, scale = float((got64 - want64).norm()), float(want64.norm())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def max_normwise_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|got - want| / max|want| in float64 (the benchmarks' and the main job's error column)."""
    got64, want64 = got.detach().to(torch.float64).cpu(), want.detach().to(torch.float64).cpu()
    if got64.shape != want64.shape:
        raise ValueError(f"shapes differ: got {tuple(got64.shape)}, want {tuple(want64.shape)}")
    if want64.numel() == 0:
        return 0.0
    diff, scale = float((got64 - want64).abs().max()), float(want64.abs().max())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale
