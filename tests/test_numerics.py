"""The tolerance model of flashdmoe.numerics against the arithmetic it describes (CPU).

Each bound is checked from both sides: the error of an emulation of the kernel's roundings stays under
the bound, and is not so far under it that the bound would hide a real fault. Also emulated here: the
fitted GELU's polynomial, and the gate's softmax sum, whose bits must not depend on how many lanes take a
token."""

from __future__ import annotations

import math

import pytest
import torch

from flashdmoe import numerics, reference


def _round_tf32(t: torch.Tensor) -> torch.Tensor:
    """Round float32 to TF32 (10 explicit mantissa bits), to nearest, ties away (as cvt.rna.tf32)."""
    bits = t.contiguous().view(torch.int32)
    rounded = (bits + 0x1000) & ~0x1FFF
    return rounded.view(torch.float32)


def _emulated_layer(x, w1, w2, weight, activation, dtype):
    """One expert's FFN and a combine weight with the fused kernel's roundings (float32 accumulation)."""
    if dtype == torch.float32:  # TF32 operands, float32 results
        h = _round_tf32(_hidden(_round_tf32(x), _round_tf32(w1), activation))
        return weight * (h @ _round_tf32(w2))
    h = _hidden(x, w1, activation).to(dtype).float()
    row = (h @ w2).to(dtype).float()
    return (weight * row).to(dtype).float()


def _hidden(x, w1, activation):
    pre = x @ w1
    if activation == "swiglu":
        gate, up = pre.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return {"gelu": torch.nn.functional.gelu, "relu": torch.relu, "silu": torch.nn.functional.silu}[activation](pre)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_kernel_tolerance_bounds_the_emulated_roundings(seed, dtype, activation):
    g = torch.Generator().manual_seed(seed)
    T, H, I = 256, 512, 384
    cols = 2 * I if activation == "swiglu" else I
    x = torch.randn(T, H, generator=g).to(dtype).float()
    w1 = (torch.randn(H, cols, generator=g) / math.sqrt(H)).to(dtype).float()
    w2 = (torch.randn(I, H, generator=g) / math.sqrt(I)).to(dtype).float()
    weight = torch.rand(T, 1, generator=g).to(torch.float32)
    want = weight.double() * (_hidden(x.double(), w1.double(), activation) @ w2.double())
    got = _emulated_layer(x, w1, w2, weight, activation, dtype)
    error = numerics.normwise_error(got, want)
    bound = numerics.kernel_tolerance(dtype)
    assert error <= bound, f"seed {seed}: error {error:.3e} > bound {bound:.3e}"
    # Not vacuous: the roundings the bound counts really produce an error of its order.
    assert error >= bound / 40, f"seed {seed}: error {error:.3e} far below bound {bound:.3e}: the model is off"


@pytest.mark.parametrize("dtype,n", [(torch.float32, 16), (torch.float32, 1000), (torch.float32, 20000),
                                     (torch.bfloat16, 16), (torch.bfloat16, 100)])
def test_reorder_tolerance_bounds_two_summation_orders(seed, dtype, n):
    g = torch.Generator().manual_seed(seed)
    terms = torch.randn(64, n, generator=g).to(dtype)
    forward = terms.sum(dim=1, dtype=dtype)
    backward = terms.flip(1).cumsum(dim=1)[:, -1]  # sequential, the other way round
    exact = terms.double().sum(dim=1)
    bound = numerics.reorder_tolerance(dtype, n)
    assert numerics.normwise_error(forward, exact) <= bound
    assert numerics.normwise_error(backward, exact) <= bound
    assert numerics.normwise_error(forward, backward.to(forward.dtype)) <= bound


def test_dtype_table_is_consistent():
    for name, entry in numerics.DTYPES.items():
        assert entry.name == name
        assert torch.empty((), dtype=entry.dtype).element_size() == entry.element_bytes
        assert entry.unit_roundoff == torch.finfo(entry.dtype).eps / 2
        assert numerics.precision(entry.dtype) is entry and numerics.dtype_by_name(name) == entry.dtype
    with pytest.raises(ValueError, match="dtype='float8'"):
        numerics.precision("float8")
    with pytest.raises(ValueError, match="fused kernel takes"):
        numerics.kernel_tolerance(torch.float64)
    with pytest.raises(ValueError, match="reduction_length"):
        numerics.reorder_tolerance(torch.bfloat16, 1 << 10)


def test_error_measures():
    want = torch.tensor([3.0, -4.0])
    assert numerics.normwise_error(want + torch.tensor([0.3, 0.4]), want) == pytest.approx(0.1)
    assert numerics.max_normwise_error(want + torch.tensor([0.0, 0.4]), want) == pytest.approx(0.1)
    assert numerics.normwise_error(torch.zeros(0), torch.zeros(0)) == 0.0
    assert numerics.normwise_error(torch.ones(2), torch.zeros(2)) == math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        numerics.max_normwise_error(torch.ones(2), torch.ones(3))


def _gelu_tail_source():
    """The clamp and the polynomial's coefficients (highest order first) as csrc/moe/activation.cuh has them."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "csrc/moe/activation.cuh").read_text()
    body = text[text.index("float normal_tail(float v)"):]
    body = body[: body.index("return exp2_approx(p);")]
    clamp = float(re.search(r"constexpr float kGeluTailClamp = ([-+0-9.eE]+)f;", text).group(1))
    first = re.search(r"float p = ([-+0-9.eE]+)f;", body).group(1)
    rest = re.findall(r"p = fmaf\(p, t, ([-+0-9.eE]+)f\);", body)
    return clamp, [float(first)] + [float(c) for c in rest]


def _fit_script():
    """scripts/fit_gelu_cdf.py as a module: its fp32 Horner evaluation and its error measure."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts/fit_gelu_cdf.py"
    spec = importlib.util.spec_from_file_location("fit_gelu_cdf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gelu_normal_tail_polynomial_gives_phi_to_fp32_rounding():
    """The kernels' GELU takes Phi(-|v|) from 2^p(min(|v|, clamp)) (csrc/moe/activation.cuh). Evaluated
    as the GPU does (fp32 fused multiply-adds, highest order first), its Phi is within 1e-7 of float64's
    on a dense grid and past the clamp; the hardware exp2 (2^-22 relative) is not emulated."""
    import numpy as np

    fit_script = _fit_script()
    clamp, high_first = _gelu_tail_source()
    assert len(high_first) == 8 and clamp == 9.0, (clamp, high_first)
    low_first = list(reversed(high_first))

    def tail(v):  # Phi(-|v|) as the kernels compute it, but for the exact exp2
        return np.exp2(fit_script.horner_fp32(low_first, np.minimum(np.abs(np.asarray(v, np.float32)), clamp)))

    t = np.concatenate([np.linspace(0.0, clamp, 100_001), [clamp * 1.5, 50.0]]).astype(np.float32)
    got = tail(t)
    want = np.array([0.5 * math.erfc(float(x) / math.sqrt(2.0)) for x in t])
    error = np.abs(got - want)
    assert error.max() <= 1e-7, f"largest |error| of Phi {error.max():.3e} at t = {t[error.argmax()]}"
    assert abs(got[0] - 0.5) <= 2 ** -24  # Phi(0) is 1/2 to fp32 rounding
    # GELU from the tail as the kernels write it (0.5 v + |v| (0.5 - q)), against torch's exact erf form.
    v = torch.linspace(-12, 12, 4801, dtype=torch.float64)
    gelu = 0.5 * v + v.abs() * (0.5 - torch.from_numpy(tail(v.numpy())))
    assert torch.allclose(gelu, torch.nn.functional.gelu(v), rtol=0, atol=1e-6)


def test_the_gelu_fit_script_reproduces_a_fit_as_accurate_as_the_sources():
    """scripts/fit_gelu_cdf.py (how the coefficients were made) still runs and fits Phi to fp32 rounding."""
    fit_script = _fit_script()
    clamp, high_first = _gelu_tail_source()
    coefficients = fit_script.fit(len(high_first) - 1, clamp)
    assert fit_script.phi_error(coefficients, clamp, points=20_001) <= 1e-7
    assert fit_script.phi_error(list(reversed(high_first)), clamp, points=20_001) <= 1e-7


def _lane_partials(ex: torch.Tensor) -> torch.Tensor:
    """[rows, 32] float32: lane L's partial, the experts e = L mod 32 added in ascending order (0 if none)."""
    rows, E = ex.shape
    part = torch.zeros(rows, 32, dtype=torch.float32)
    for e in range(E):
        part[:, e % 32] = part[:, e % 32] + ex[:, e]
    return part


def _gate_row_sum(part: torch.Tensor, group: int) -> torch.Tensor:
    """The gate's softmax sum (csrc/moe/gate.cuh softmax_topk_rows) with `group` lanes per row: lane g
    holds the partials of lanes g + group * u; butterfly levels 16 .. group inside the lane, the rest
    between lanes (xor shuffles). Returns every lane's result, [rows, group]."""
    rows = part.shape[0]
    per_lane = 32 // group
    held = part.reshape(rows, per_lane, group).transpose(1, 2)  # [rows, lane g, u] = partial g + group * u
    offset = 16
    while offset >= group:
        u = torch.arange(per_lane)
        held = held + held[:, :, u ^ (offset // group)]
        offset //= 2
    value = held[:, :, 0]
    offset = group // 2
    while offset > 0:
        lanes = torch.arange(group)
        value = value + value[:, lanes ^ offset]
        offset //= 2
    return value


@pytest.mark.parametrize("experts", [8, 40, 64, 128, 1000])
def test_gate_softmax_sum_is_one_tree_for_every_group_size(seed, experts):
    """A full gate tile takes a token's softmax with 8 lanes, a decode batch with a warp: both must give
    the 32-lane butterfly's bits (and every lane of a group the same value), or the routing of a token
    would depend on the batch it came in."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, experts, generator=g) * 4
    ex = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
    part = _lane_partials(ex)
    warp = _gate_row_sum(part, 32)
    assert torch.equal(warp, warp[:, :1].expand_as(warp)), f"seed {seed}: lanes of a warp disagree"
    for group in (16, 8, 4, 2, 1):
        sums = _gate_row_sum(part, group)
        assert torch.equal(sums, warp[:, :group]), f"seed {seed}: {group} lanes per row give other bits than 32"
    # Not vacuous: a sequential sum of the same values differs from the tree in some rows.
    sequential = torch.zeros(64)
    for e in range(experts):
        sequential = sequential + ex[:, e]
    if experts >= 64:
        assert not torch.equal(sequential, warp[:, 0]), f"seed {seed}: the tree's order made no difference"
