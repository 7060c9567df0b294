"""Fit the polynomial the kernels' exact GELU takes its normal tail from (csrc/moe/activation.cuh).

GELU(v) = v * Phi(v) with Phi the standard normal CDF. The kernels write it as 0.5 v + |v| (0.5 - q) with
q = Phi(-|v|) = 2^p(t), t = min(|v|, T), and p a polynomial in t fit to log2 Phi(-t) on [0, T]: one clamp,
a Horner chain of fused multiply-adds, one hardware exp2 and two more instructions per value, where
erff took about 25 (both of its branches, selected per lane). The fit weighs each point by q, so the
error it minimises is the absolute error of Phi, which is what the GELU's value carries.

    python scripts/fit_gelu_cdf.py [--degree 7] [--clamp 9]

prints the coefficients (lowest order first) in C and the largest |error| of Phi on a dense grid, with the
Horner chain evaluated in fp32 fused multiply-adds as the GPU does (the hardware exp2's own error,
about 2^-22 relative, comes on top). numpy and the standard library only.
"""

from __future__ import annotations

import argparse
import math

import numpy as np


def log2_tail(t: np.ndarray) -> np.ndarray:
    """log2 Phi(-t) in float64 (math.erfc keeps its relative accuracy far into the tail)."""
    return np.log2(np.array([0.5 * math.erfc(x / math.sqrt(2.0)) for x in np.asarray(t, np.float64)]))


def horner_fp32(coefficients, t: np.ndarray) -> np.ndarray:
    """The polynomial as the kernels evaluate it: fp32 fused multiply-adds, highest order first (each
    step's product and sum taken exactly in float64, then rounded once to fp32, as an FFMA does)."""
    c = np.asarray(coefficients, np.float32).astype(np.float64)
    t = np.asarray(t, np.float32).astype(np.float64)
    p = np.full_like(t, c[-1])
    for a in c[-2::-1]:
        p = (p * t + a).astype(np.float32).astype(np.float64)
    return p


def phi_error(coefficients, clamp: float, points: int = 200_001) -> float:
    """Largest |Phi(-t) - 2^p(t)| over t in [0, clamp]."""
    t = np.linspace(0.0, clamp, points).astype(np.float32)
    return float(np.abs(np.exp2(horner_fp32(coefficients, t)) - np.exp2(log2_tail(t))).max())


def fit(degree: int, clamp: float, nodes: int = 4000, rounds: int = 30) -> np.ndarray:
    """Weighted least squares on Chebyshev nodes, reweighted towards the minimax error (Lawson)."""
    t = (np.cos(np.linspace(0.0, math.pi, nodes)) + 1.0) * clamp / 2.0
    y = log2_tail(t)
    q = np.exp2(y)
    weights = q.copy()
    for _ in range(rounds):
        c = np.polynomial.polynomial.polyfit(t, y, degree, w=weights)
        err = np.abs(np.polynomial.polynomial.polyval(t, c) - y) * q
        weights = weights * np.sqrt(err / err.max() + 1e-3)
    return c.astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--degree", type=int, default=7)
    parser.add_argument("--clamp", type=float, default=9.0)
    args = parser.parse_args()
    c = fit(args.degree, args.clamp)
    print("{" + ", ".join(f"{float(x):.9e}f" for x in c) + "}")
    print(f"largest |error| of Phi on [0, {args.clamp}]: {phi_error(c, args.clamp):.3e}; "
          f"Phi(-{args.clamp}) = {0.5 * math.erfc(args.clamp / math.sqrt(2.0)):.2e}")


if __name__ == "__main__":
    main()
