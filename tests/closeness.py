"""Assertions on the error measures of flashdmoe.numerics (the tolerances themselves come from there)."""

from __future__ import annotations

import torch

from flashdmoe import numerics


def assert_normwise_close(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str = "") -> float:
    """||got - want||_F / ||want||_F <= tolerance; returns the error."""
    error = numerics.normwise_error(got, want)
    assert error <= tolerance, f"{what or 'value'}: normwise relative error {error:.3e} > tolerance {tolerance:.3e}"
    return error


def float64_tolerance(reduction_length: int, depth: int) -> float:
    """Two float64 evaluations of one expression that sum in other orders (another formula, another
    split over ranks): reductions of at most ``reduction_length`` terms, ``depth`` of them chained."""
    return numerics.reorder_tolerance(torch.float64, reduction_length, depth=depth)
