"""Tolerances and the closeness check shared by the expert-parallel exchange tests (gloo and peer memory)."""

from __future__ import annotations

import torch

#: (atol, rtol) per dtype for expert-parallel results against the reference.
TOLERANCES = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Same shape and dtype, and |got - want| <= atol + rtol * |want| elementwise (TOLERANCES[dtype])."""
    atol, rtol = TOLERANCES[dtype]
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{name}: {got.shape}/{got.dtype} vs {want.shape}/{want.dtype}"
    if want.numel():
        error = (got.double() - want.double()).abs()
        bound = atol + rtol * want.double().abs()
        assert bool((error <= bound).all()), \
            f"{name}: max abs error {error.max().item():.3e} exceeds {atol}+{rtol}*|want|"
