"""The closeness check shared by the expert-parallel exchange tests (gloo and peer memory).

Both sides compute the same expression in the same precision and differ only in summation order (the
router gradient is summed over ranks, rows are packed differently), so the tolerance is
``numerics.reorder_tolerance`` for the precision the arithmetic runs in: float64 or float32 as given,
float32 for bfloat16 inputs (the reference's compute dtype), whose results are then rounded to bfloat16
once on each side (two roundings: ``numerics.rounding_tolerance(bfloat16, 2)``).
"""

from __future__ import annotations

import torch

from flashdmoe import numerics

# The longest reduction in these tests (tokens summed into the router gradient, H and I in the GEMMs) is
# well under this; the forward's three GEMMs and the backward's three make the depth.
REDUCTION_LENGTH = 1024
DEPTH = 6


def tolerance(dtype: torch.dtype) -> float:
    compute = reference_compute = numerics.precision(dtype)
    if compute.dtype in (torch.bfloat16, torch.float16):
        reference_compute = numerics.precision(torch.float32)
    bound = numerics.reorder_tolerance(reference_compute.dtype, REDUCTION_LENGTH, depth=DEPTH)
    if compute is not reference_compute:
        bound += numerics.rounding_tolerance(dtype, 2)
    return bound


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Same shape and dtype, and normwise relative error ||got - want|| / ||want|| <= tolerance(dtype)."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{name}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
    if want.numel():
        error, bound = numerics.normwise_error(got, want), tolerance(dtype)
        assert error <= bound, f"{name}: normwise relative error {error:.3e} > {bound:.3e}"
