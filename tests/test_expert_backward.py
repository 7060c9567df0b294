"""Tests of flashdmoe.backward.expert_backward: gradients against autograd through reference.moe_fixed_routing in
float64, both GEMM back ends, determinism, argument checks; on a GPU also no host sync and CUDA graphs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import flashdmoe
import grad_checks
from flashdmoe import numerics, reference
from flashdmoe.backward.expert_backward import expert_backward, grouped_mm_supported

GRAD_NAMES = ("dx", "d_router", "dw1", "dw2")

def backward_tolerance(dtype: torch.dtype) -> float:
    return numerics.backward_tolerance(dtype)  # derivation in its docstring


def oracle_tolerance(dtype: torch.dtype, case: "Case") -> float:
    """float32 / float64 against the float64 oracle: the oracle is exact to ~1e-16, so the difference is
    one evaluation's rounding error, within reorder_tolerance (which bounds two orders). Reductions run
    over H (pre, g), I or 2I (per-row dx, dweight), T (weight gradients, d_router) and k; chained four
    deep (pre -> g, dweight -> dpre -> dx / dW1)."""
    longest = max(case.H, case.w1_cols, case.T, case.E)
    return numerics.reorder_tolerance(dtype, longest, depth=4)


@dataclass(frozen=True)
class Case:
    T: int
    H: int
    I: int
    E: int
    k: int
    activation: str
    normalize: bool = True
    capacity_factor: float | None = None
    skew: float = 0.0            # > 0: a few experts get most tokens
    gemm: str = "auto"
    cap_rows: bool = False       # padded back end with max_rows_per_expert = the capacity
    expect: str = ""             # "dropped" / "empty": a property of the routing the case exists to cover

    @property
    def w1_cols(self) -> int:
        return 2 * self.I if self.activation == "swiglu" else self.I

    def __str__(self) -> str:
        cap = "dropless" if self.capacity_factor is None else f"cf{self.capacity_factor}"
        return (f"T{self.T}-H{self.H}-I{self.I}-E{self.E}-k{self.k}-{self.activation}-"
                f"{'norm' if self.normalize else 'raw'}-{cap}{'-skew' if self.skew else ''}-{self.gemm}"
                f"{'-caprows' if self.cap_rows else ''}")


CASES = [
    Case(16, 8, 12, 4, 2, "gelu"),
    Case(16, 8, 12, 4, 2, "relu", normalize=False),
    Case(16, 8, 12, 4, 2, "silu", capacity_factor=1.0),
    Case(16, 8, 12, 4, 2, "swiglu", normalize=False, capacity_factor=0.5, expect="dropped"),
    Case(1, 8, 8, 4, 1, "gelu"),
    Case(1, 4, 4, 3, 3, "swiglu"),                                        # k = E
    Case(0, 8, 8, 4, 2, "silu"),
    Case(3, 8, 8, 8, 1, "relu", expect="empty"),
    Case(33, 16, 20, 8, 4, "gelu", capacity_factor=0.75, skew=3.0, expect="dropped"),
    Case(33, 16, 20, 8, 4, "swiglu", normalize=False, skew=3.0),
    Case(50, 12, 16, 6, 3, "silu", capacity_factor=0.5, skew=2.0, expect="dropped"),
    Case(24, 6, 10, 5, 2, "relu"),                                        # H, I off 16 bytes: padded
    Case(20, 8, 8, 5, 2, "gelu", gemm="padded_bmm"),
    Case(30, 8, 12, 6, 2, "swiglu", capacity_factor=0.8, skew=2.0, gemm="padded_bmm", cap_rows=True,
         expect="dropped"),
    Case(64, 32, 24, 16, 4, "gelu", capacity_factor=1.25),
    Case(64, 32, 24, 16, 2, "swiglu", skew=4.0, expect="empty"),
    Case(7, 4, 4, 2, 1, "silu", normalize=False, capacity_factor=0.5, expect="dropped"),
    Case(9, 8, 4, 4, 4, "relu", capacity_factor=0.5, expect="dropped"),  # k = E, renormalised over dropped
    Case(40, 16, 16, 4, 2, "relu", capacity_factor=1.0, skew=6.0, expect="dropped"),
    Case(100, 8, 16, 32, 3, "gelu", normalize=False, expect="empty"),
    Case(5, 8, 8, 4, 2, "swiglu", gemm="padded_bmm"),
    Case(12, 4, 8, 3, 2, "gelu", capacity_factor=2.0),
    Case(1, 16, 16, 16, 4, "silu", gemm="padded_bmm", expect="empty"),
    Case(10, 8, 8, 1, 1, "gelu"),                                         # one expert: no router gradient
    Case(17, 12, 8, 6, 3, "relu", normalize=False, capacity_factor=0.5, gemm="padded_bmm", cap_rows=True,
         expect="dropped"),
]


def pack_rows(experts: torch.Tensor, keep: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The row of each kept choice in one rank's packed expert buffer, as the fused kernel numbers them:
    expert 0's kept choices first, then expert 1's, ..., each expert's in token order (a token picks an
    expert at most once, so flat choice order t * k + j is token order); rows 0 .. kept - 1 without gaps;
    -1 for a dropped choice. experts [T, k] int64, keep [T, k] bool -> [T, k] int32."""
    flat = experts.reshape(-1)
    key = torch.where(keep.reshape(-1), flat, num_experts)  # dropped choices sort last
    order = torch.sort(key, stable=True).indices
    kept = int(keep.sum())
    row = torch.full_like(flat, -1)
    row[order[:kept]] = torch.arange(kept, device=flat.device)
    return row.view(experts.shape).to(torch.int32)


def make_problem(case: Case, seed: int, dtype: torch.dtype, device: str = "cpu"):
    """Random inputs (O(1) outputs), the reference's routing and capacity, the packed rows and dy."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale

    x = randn(case.T, case.H)
    router_weight = randn(case.E, case.H, scale=1 / math.sqrt(case.H))
    direction = randn(case.H)
    direction /= direction.norm()
    if case.skew:
        # A shared direction in every token and a descending bias along it in the router rows: expert 0
        # gets the most tokens, the last experts few.
        x += 2.0 * direction
        router_weight += case.skew * torch.linspace(1, -1, case.E, dtype=torch.float64)[:, None] * direction
    if case.expect == "empty" and case.T * case.k >= case.E:
        # Every token gets a component >= 1 along the direction and the last expert's router row points
        # 30 against it: its logit is <= -30, below the other experts' O(1) logits, so with k < E it is
        # never chosen (check_case_covers confirms).
        along = x @ direction
        x += (along.abs() + 1 - along)[:, None] * direction
        router_weight[-1] = -30.0 * direction
    w1 = randn(case.E, case.H, case.w1_cols, scale=1 / math.sqrt(case.H))
    w2 = randn(case.E, case.I, case.H, scale=1 / math.sqrt(case.I))
    dy = randn(case.T, case.H)
    x, router_weight, w1, w2, dy = (t.to(dtype=dtype, device=device) for t in (x, router_weight, w1, w2, dy))
    routing = reference.route(x, router_weight, case.k, case.normalize)
    capacity = reference.expert_capacity(case.T, case.k, case.E, case.capacity_factor)
    keep = reference.keep_mask(routing.experts, case.E, capacity)
    row = pack_rows(routing.experts, keep, case.E)
    # weights: float32 as the kernel saves them (float64 for float64 x)
    inputs = (x, router_weight, w1, w2, routing.experts.to(torch.int32), routing.weights, row, dy)
    return inputs, keep, capacity


def oracle_grads(inputs, keep, case: Case):
    """Autograd through reference.moe_fixed_routing in float64 on the same (dtype-rounded) inputs."""
    x, router_weight, w1, w2, experts, _, _, dy = inputs
    leaves = [t.detach().to(torch.float64).requires_grad_() for t in (x, router_weight, w1, w2)]
    y = reference.moe_fixed_routing(*leaves, experts.long(), keep, activation=case.activation,
                                    normalize_topk=case.normalize)
    return torch.autograd.grad(y, leaves, dy.to(torch.float64), allow_unused=True)


def run(inputs, case: Case, capacity, **overrides):
    options = dict(activation=case.activation, normalize_topk=case.normalize, gemm=case.gemm)
    if case.cap_rows:
        options["max_rows_per_expert"] = capacity
    options.update(overrides)
    return expert_backward(*inputs, **options)


def check_case_covers(case: Case, inputs, keep):
    """The routing really has what the case claims to cover (a case that drops nothing tests no drops)."""
    experts = inputs[4].long()
    if case.expect == "dropped":
        assert (~keep).any(), f"{case}: no choice was dropped"
    if case.expect == "empty":
        kept_counts = torch.bincount(experts[keep], minlength=case.E)
        assert (kept_counts == 0).any(), f"{case}: every expert got rows"


def router_gradient_magnitude(inputs, keep, case: Case) -> torch.Tensor:
    """d_router on absolute values (grad_checks.router_gradient_magnitude): the scale of its rounding errors."""
    x, router_weight, w1, w2, experts, _, _, dy = inputs
    return grad_checks.router_gradient_magnitude(x, router_weight, w1, w2, experts, keep, dy,
                                                 activation=case.activation, normalize_topk=case.normalize)


def assert_close(got, want, tolerance, case, dtype, *, inputs, keep):
    """Normwise relative errors within ``tolerance``; d_router's relative to its magnitude bound; dx and
    dw1 of relu cases against the oracle with the slope fitted at relu's kink
    (grad_checks.relu_kink_alternatives)."""
    kink = None
    if case.activation == "relu":
        x, _, w1, w2, experts, weights, _, dy = inputs
        kink = grad_checks.relu_kink_alternatives(x, w1, w2, dy, experts, weights, keep, dtype=dtype)
    for name, g, w in zip(GRAD_NAMES, got, want):
        assert g is not None and g.shape == w.shape, f"{case}: {name} missing or misshapen"
        assert g.dtype == dtype, f"{case}: {name} is {g.dtype}, expected {dtype}"
        if name == "d_router":
            scale = float(router_gradient_magnitude(inputs, keep, case).norm())
            error = float((g.to(torch.float64) - w).norm()) / scale if scale else float(g.abs().max())
        else:
            error = grad_checks.kink_fitted_error(g, w, (kink or {}).get(name, []))
        assert error <= tolerance, f"{case} {dtype}: {name} normwise error {error:.3g} > {tolerance:.3g}"


# ---------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_float32_against_float64_oracle(case, seed):
    inputs, keep, capacity = make_problem(case, seed, torch.float32)
    check_case_covers(case, inputs, keep)
    got = run(inputs, case, capacity)
    assert_close(got, oracle_grads(inputs, keep, case), oracle_tolerance(torch.float32, case), case, torch.float32,
                 inputs=inputs, keep=keep)
    again = run(inputs, case, capacity)
    for name, first, second in zip(GRAD_NAMES, got, again):
        assert torch.equal(first, second), f"{case}: {name} differs between two runs"


@pytest.mark.parametrize("case", [c for c in CASES if c.T > 0][::3], ids=str)
def test_float64_against_float64_oracle(case, seed):
    """float64 runs the padded back end; agreement to float64 rounding checks the formulas themselves."""
    inputs, keep, capacity = make_problem(case, seed, torch.float64)
    got = run(inputs, case, capacity)
    assert_close(got, oracle_grads(inputs, keep, case), oracle_tolerance(torch.float64, case), case, torch.float64,
                 inputs=inputs, keep=keep)


HALF_CASES = [CASES[3], CASES[8], CASES[9], CASES[14], CASES[15], CASES[18]]


@pytest.mark.parametrize("gemm", ["auto", "padded_bmm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", HALF_CASES, ids=str)
def test_half_precision_on_cpu(case, dtype, gemm, seed):
    """The CPU runs the same half-precision code (torch._grouped_mm takes bf16 / fp16 here)."""
    case = Case(**{**case.__dict__, "gemm": gemm})
    inputs, keep, capacity = make_problem(case, seed, dtype)
    got = run(inputs, case, capacity)
    assert_close(got, oracle_grads(inputs, keep, case), backward_tolerance(dtype), case, dtype,
                 inputs=inputs, keep=keep)


def test_auto_picks_grouped_mm_where_it_runs_on_cpu():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    cpu = torch.device("cpu")
    assert grouped_mm_supported(torch.float32, cpu, 8, 12) == ""
    assert grouped_mm_supported(torch.bfloat16, cpu, 16, 24) == ""
    assert "multiples of 4" in grouped_mm_supported(torch.float32, cpu, 6, 12)
    assert "float64" in grouped_mm_supported(torch.float64, cpu, 8, 8)


def test_auto_picks_fused_for_few_rows_per_expert_with_saved_pre(monkeypatch):
    """choose_gemm's rule, with the fused launch's own checks passing (as on a Hopper GPU) and failing."""
    from flashdmoe.backward import expert_backward as eb

    cuda = torch.device("cuda")
    limit = eb.FUSED_MAX_ROWS_PER_EXPERT
    monkeypatch.setattr(eb, "grouped_mm_supported", lambda *args: "")
    monkeypatch.setattr(eb.fused_backward, "unsupported", lambda *args: "")
    # (T, E, k, saved pre, elementwise) -> expected back end
    for T, E, k, have_pre, elementwise, want in [
        (8192, 32, 2, True, "auto", "fused"),            # 512 rows per expert: the limit itself
        (limit * 8 + 1, 16, 2, True, "auto", "grouped_mm"),  # one row past it
        (4096, 64, 2, True, "auto", "fused"),            # 128 rows per expert
        (128, 64, 6, True, "cuda", "fused"),
        (4096, 8, 2, True, "auto", "grouped_mm"),        # 1024 rows per expert (Mixtral 8x7B's layer)
        (4096, 64, 2, False, "auto", "grouped_mm"),      # nothing saved: the fused launch cannot run
        (4096, 64, 2, True, "torch", "grouped_mm"),      # torch element-wise ops asked for
    ]:
        got = eb.choose_gemm(torch.bfloat16, cuda, T, 2048, 2048, E, k, have_pre, elementwise)
        assert got == want, (T, E, k, have_pre, elementwise)
    monkeypatch.setattr(eb.fused_backward, "unsupported", lambda *args: "the fused backward needs Hopper")
    assert eb.choose_gemm(torch.bfloat16, cuda, 4096, 2048, 2048, 64, 2, True) == "grouped_mm"
    monkeypatch.setattr(eb, "grouped_mm_supported", lambda *args: "not here")
    assert eb.choose_gemm(torch.bfloat16, cuda, 4096, 2048, 2048, 64, 2, True) == "padded_bmm"


def test_the_fused_backward_row_limit_knob_moves_autos_line(monkeypatch):
    """debug.fused_backward_max_rows (FLASHDMOE_FUSED_BACKWARD_MAX_ROWS) replaces the default limit; None
    restores it."""
    from flashdmoe.backward import expert_backward as eb
    from flashdmoe.kernel.launch_knobs import debug

    cuda = torch.device("cuda")
    monkeypatch.setattr(eb, "grouped_mm_supported", lambda *args: "")
    monkeypatch.setattr(eb.fused_backward, "unsupported", lambda *args: "")
    monkeypatch.setattr(debug, "fused_backward_max_rows", 128)
    assert eb.choose_gemm(torch.bfloat16, cuda, 2048, 2048, 2048, 32, 2, True) == "fused"  # 128 per expert
    assert eb.choose_gemm(torch.bfloat16, cuda, 2049, 2048, 2048, 32, 2, True) == "grouped_mm"
    monkeypatch.setattr(debug, "fused_backward_max_rows", None)
    assert eb.choose_gemm(torch.bfloat16, cuda, 2049, 2048, 2048, 32, 2, True) == "fused"  # the default line, 512


def test_auto_never_picks_fused_on_cpu():
    from flashdmoe.backward.expert_backward import choose_gemm

    assert choose_gemm(torch.bfloat16, torch.device("cpu"), 64, 64, 64, 16, 2, True) != "fused"


@pytest.mark.parametrize("needs", [(True, False, False, False), (False, True, False, False),
                                   (False, False, True, False), (False, False, False, True),
                                   (False, True, False, True), (False, False, False, False)], ids=str)
def test_needs_selects_gradients_and_changes_none(needs, seed):
    case = Case(24, 8, 12, 6, 3, "swiglu", capacity_factor=0.75, skew=2.0)
    inputs, _, capacity = make_problem(case, seed, torch.float32)
    full = run(inputs, case, capacity)
    partial = run(inputs, case, capacity, needs=needs)
    for name, need, whole, part in zip(GRAD_NAMES, needs, full, partial):
        if need:
            assert torch.equal(whole, part), f"{name} differs when computed alone"
        else:
            assert part is None, f"{name} was not asked for"


@pytest.mark.parametrize("gemm", ["grouped_mm", "padded_bmm"])
def test_unwritten_rows_are_never_read(gemm, seed):
    """torch._grouped_mm leaves rows past the last group unwritten; deterministic mode fills fresh memory
    with NaN, so a read of any of them would show. Same bits as without it: nothing else changes either."""
    if gemm == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    case = Case(40, 8, 12, 6, 3, "swiglu", capacity_factor=0.5, skew=2.0, gemm=gemm, expect="dropped")
    inputs, keep, capacity = make_problem(case, seed, torch.float32)
    check_case_covers(case, inputs, keep)
    plain = run(inputs, case, capacity)
    was_on = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        poisoned = run(inputs, case, capacity)
    finally:
        torch.use_deterministic_algorithms(was_on)
    for name, want, got in zip(GRAD_NAMES, plain, poisoned):
        assert torch.equal(got, want), f"{name} changed when unwritten memory holds NaN"


def test_zero_tokens_gives_zero_weight_gradients():
    case = Case(0, 8, 8, 4, 2, "gelu")
    inputs, _, capacity = make_problem(case, 0, torch.float32)
    dx, d_router, dw1, dw2 = run(inputs, case, capacity)
    assert dx.shape == (0, 8)
    for grad, like in ((d_router, inputs[1]), (dw1, inputs[2]), (dw2, inputs[3])):
        assert grad.shape == like.shape and not grad.any()


def test_too_few_padded_rows_is_caught_on_the_device():
    case = Case(16, 8, 8, 2, 1, "relu", gemm="padded_bmm")
    inputs, keep, capacity = make_problem(case, 1, torch.float32)
    rows_of_busiest = int(torch.bincount(inputs[4].long()[keep], minlength=2).max())
    run(inputs, case, capacity, max_rows_per_expert=rows_of_busiest)  # exactly enough is fine
    with pytest.raises(RuntimeError, match="max_rows_per_expert"):
        run(inputs, case, capacity, max_rows_per_expert=rows_of_busiest - 1)


def _bad_arguments():
    case = Case(4, 8, 8, 3, 2, "gelu")
    inputs, _, _ = make_problem(case, 0, torch.float32)
    x, router_weight, w1, w2, expert, weight, row, dy = inputs
    good = dict(x=x, router_weight=router_weight, w1=w1, w2=w2, expert=expert, weight=weight, row=row, dy=dy)
    return [
        ("x", dict(good, x=x[:, None]), {}),
        ("x", dict(good, x=x.to(torch.int32)), {}),
        ("router_weight", dict(good, router_weight=router_weight[:, :4]), {}),
        ("router_weight", dict(good, router_weight=router_weight.double()), {}),
        ("w1", dict(good, w1=w1[:, :, :4]), {}),
        ("w2", dict(good, w2=w2[:2]), {}),
        ("dy", dict(good, dy=dy[:2]), {}),
        ("expert", dict(good, expert=expert.float()), {}),
        ("expert", dict(good, expert=expert[:2]), {}),
        ("weight", dict(good, weight=weight[:, :1]), {}),
        ("weight", dict(good, weight=weight.int()), {}),
        ("row", dict(good, row=row.to(torch.int16)), {}),
        ("activation", good, dict(activation="tanh")),
        ("gemm", good, dict(gemm="cublas")),
        ("needs", good, dict(needs=(True, True))),
        ("max_rows_per_expert", good, dict(max_rows_per_expert=-1)),
        ("grouped_mm", dict(good, **{k: v.double() for k, v in good.items()
                                     if k in ("x", "router_weight", "w1", "w2", "dy")}), dict(gemm="grouped_mm")),
    ]


@pytest.mark.parametrize("argument,arguments,options", _bad_arguments(),
                         ids=[f"{name}-{i}" for i, (name, _, _) in enumerate(_bad_arguments())])
def test_bad_arguments_raise_value_error_naming_them(argument, arguments, options):
    kwargs = dict(activation="gelu", normalize_topk=True)
    kwargs.update(options)
    with pytest.raises(ValueError, match=argument):
        expert_backward(*arguments.values(), **kwargs)


# ---------------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------------

GPU_CASES = [
    Case(512, 256, 512, 16, 4, "gelu", capacity_factor=1.25, skew=2.0),
    Case(777, 128, 384, 8, 2, "swiglu", normalize=False),
    Case(300, 128, 256, 32, 8, "silu", capacity_factor=0.5, expect="dropped"),
    Case(64, 256, 128, 64, 6, "relu", expect="empty"),
    Case(1, 128, 128, 8, 2, "swiglu"),
    Case(2048, 512, 256, 16, 2, "swiglu", capacity_factor=1.0, skew=3.0, expect="dropped"),
    # H and I not multiples of 128: every GEMM's last column tile partly past the matrix
    Case(900, 320, 192, 4, 2, "gelu", skew=1.5),
    Case(600, 192, 320, 8, 3, "swiglu", normalize=False),
]


def _gpu_problem(case, seed, dtype):
    return make_problem(case, seed, dtype, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("elementwise", ["cuda", "torch"])
@pytest.mark.parametrize("gemm", ["auto", "padded_bmm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_against_float64_oracle(case, dtype, gemm, elementwise, seed):
    case = Case(**{**case.__dict__, "gemm": gemm})
    inputs, keep, capacity = _gpu_problem(case, seed, dtype)
    check_case_covers(case, inputs, keep)
    got = run(inputs, case, capacity, elementwise=elementwise)
    assert_close(got, oracle_grads(inputs, keep, case), backward_tolerance(dtype), case, dtype,
                 inputs=inputs, keep=keep)
    again = run(inputs, case, capacity, elementwise=elementwise)
    for name, first, second in zip(GRAD_NAMES, got, again):
        assert torch.equal(first, second), f"{case} {dtype}: {name} differs between two runs"


@pytest.mark.gpu
@pytest.mark.parametrize("with_router_term", [True, False])
@pytest.mark.parametrize("top_k", [1, 3, 8, 11])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_combine_grad_sums_each_token_in_choice_order(dtype, top_k, with_router_term, seed):
    """The extension's dx combine: a token's kept rows summed in float32 in choice order, then the
    router's term, rounded once; dropped choices (-1) add nothing. Bitwise against the same float32 sum
    in torch, for k below, at and above the rows it loads at once (8), H a multiple of 8 but not of the
    2048 columns a block covers per step."""
    from flashdmoe.kernel import extension
    from flashdmoe.kernel.kernel_codes import DTYPE_CODES

    generator = torch.Generator(device="cuda").manual_seed(seed)
    tokens, hidden, rows = 300, 2056, 4000
    dx_rows = torch.randn(rows, hidden, device="cuda", generator=generator).to(dtype)
    row = torch.randint(0, rows, (tokens, top_k), device="cuda", generator=generator, dtype=torch.int32)
    dropped = torch.rand(tokens, top_k, device="cuda", generator=generator) < 0.2
    row = torch.where(dropped, -1, row).contiguous()
    extra = torch.randn(tokens, hidden, device="cuda", generator=generator) if with_router_term else None
    dx = torch.full((tokens, hidden), float("nan"), dtype=dtype, device="cuda")
    extension.loaded().combine_grad(DTYPE_CODES[dtype], dx_rows.data_ptr(), row.data_ptr(),
                                    0 if extra is None else extra.data_ptr(), dx.data_ptr(), tokens, top_k, hidden,
                                    torch.cuda.current_stream().cuda_stream)
    want = torch.zeros(tokens, hidden, device="cuda")
    for j in range(top_k):
        kept = row[:, j] >= 0
        want = torch.where(kept[:, None], want + dx_rows[row[:, j].clamp(min=0).long()].float(), want)
    if extra is not None:
        want = want + extra
    assert torch.equal(dx, want.to(dtype)), f"largest difference {(dx.float() - want.to(dtype).float()).abs().max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_no_host_synchronisation(dtype, seed):
    case = Case(1024, 256, 512, 16, 4, "swiglu", capacity_factor=1.0, skew=2.0)
    inputs, _, capacity = _gpu_problem(case, seed, dtype)
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] == 9:
        # Hopper bf16 must take the CUTLASS grouped GEMMs, the path whose lack of sync this checks.
        assert grouped_mm_supported(dtype, inputs[0].device, case.H, case.I) == ""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = run(inputs, case, capacity)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(g is not None for g in grads)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gpu_cuda_graph_replay_equals_eager(dtype, seed):
    case = Case(1024, 256, 384, 16, 4, "gelu", capacity_factor=1.25, skew=2.0)
    static_inputs, _, capacity = _gpu_problem(case, seed, dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (library handles, allocator pools)
        for _ in range(2):
            run(static_inputs, case, capacity)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grads = run(static_inputs, case, capacity)
    # New values (and new routing) in the same tensors: a replay must use them, not the captured ones.
    fresh_inputs, _, _ = _gpu_problem(case, seed + 1, dtype)
    for static, fresh in zip(static_inputs, fresh_inputs):
        static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    eager = run(fresh_inputs, case, capacity)
    for name, replayed, want in zip(GRAD_NAMES, static_grads, eager):
        assert torch.equal(replayed, want), f"{dtype}: {name} from the graph differs from eager"


def saved_pre(inputs, keep):
    """The pre-activations the fused forward saves: x_t @ W1_e by packed row (float64, rounded once), NaN
    in the rows past the kept ones (they must never be read)."""
    x, _, w1, _, experts, _, row, _ = inputs
    pre = torch.full((experts.numel(), w1.shape[2]), float("nan"), dtype=x.dtype, device=x.device)
    tokens = keep.nonzero()[:, 0]
    pre[row[keep].long()] = torch.einsum("rh,rhc->rc", x[tokens].double(),
                                         w1[experts[keep].long()].double()).to(x.dtype)
    return pre


@pytest.mark.gpu
@pytest.mark.parametrize("elementwise", ["cuda", "torch"])
@pytest.mark.parametrize("gemm", ["auto", "padded_bmm"])
@pytest.mark.parametrize("case", GPU_CASES[:4], ids=str)
def test_gpu_saved_pre_activations(case, gemm, elementwise, seed):
    """pre= (no GEMM1 in the backward): the packed rows taken as they are, or gathered into the padded layout."""
    case = Case(**{**case.__dict__, "gemm": gemm})
    inputs, keep, capacity = _gpu_problem(case, seed, torch.bfloat16)
    got = run(inputs, case, capacity, elementwise=elementwise, pre=saved_pre(inputs, keep))
    assert_close(got, oracle_grads(inputs, keep, case), backward_tolerance(torch.bfloat16), case, torch.bfloat16,
                 inputs=inputs, keep=keep)


def test_saved_pre_activations_on_cpu(seed):
    case = Case(300, 64, 96, 8, 2, "swiglu", capacity_factor=1.0, expect="dropped")
    inputs, keep, capacity = make_problem(case, seed, torch.float32)
    check_case_covers(case, inputs, keep)
    got = run(inputs, case, capacity, pre=saved_pre(inputs, keep))
    assert_close(got, oracle_grads(inputs, keep, case), backward_tolerance(torch.float32), case, torch.float32,
                 inputs=inputs, keep=keep)
    with pytest.raises(ValueError, match="pre has shape"):
        run(inputs, case, capacity, pre=saved_pre(inputs, keep)[:, :-1])


@pytest.mark.gpu
def test_gpu_auto_takes_the_elementwise_kernels():
    from flashdmoe.backward.expert_backward import elementwise_kernels_supported

    assert elementwise_kernels_supported(torch.bfloat16, torch.device("cuda"), 256, 384) == ""
    assert "float32" in elementwise_kernels_supported(torch.float32, torch.device("cuda"), 256, 384)


def test_elementwise_cuda_off_a_gpu_is_refused_by_name(seed):
    case = Case(16, 64, 64, 4, 2, "gelu")
    inputs, _, capacity = make_problem(case, seed, torch.float32)
    with pytest.raises(ValueError, match="elementwise='cuda'"):
        run(inputs, case, capacity, elementwise="cuda")
    with pytest.raises(ValueError, match="elementwise='fast'"):
        run(inputs, case, capacity, elementwise="fast")


def test_emulated_backward_packs_rows_as_one_rank_does(seed):
    """An emulated team's rows index the owners' streams; its backward repacks them with
    expert_backward.packed_rows, which must be the single-rank packing this file's oracle assumes."""
    from flashdmoe.backward.expert_backward import packed_rows

    g = torch.Generator().manual_seed(seed)
    for T, k, E in [(0, 2, 4), (1, 1, 3), (37, 3, 8), (200, 4, 16)]:
        experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.empty(0, k, dtype=torch.long)
        keep = torch.rand(T, k, generator=g) < 0.8
        got = packed_rows(experts.to(torch.int32), keep, E)
        assert got.dtype == torch.int32
        assert torch.equal(got.long(), pack_rows(experts, keep, E).long()), (T, k, E)


# ---------------------------------------------------------------------------------------------------------
# The fused backward (one persistent launch; flashdmoe/backward/fused_backward.py)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def fused_knobs():
    """The fused backward's debug knobs, outputs poisoned (NaN) before every launch; reset afterwards."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fused backward needs a Hopper GPU")
    from flashdmoe.kernel import extension
    from flashdmoe.kernel.launch_knobs import debug

    extension.load()  # a build failure on Hopper is a test failure, not a skip
    debug.poison_outputs = True
    yield debug
    debug.poison_outputs, debug.withhold_phase, debug.timeout_ms = False, 0, None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_fused_against_float64_oracle(case, dtype, fused_knobs, seed):
    """gemm='fused' on the saved pre-activations (NaN past the kept rows): against the float64 oracle, and
    bitwise the same on a second run."""
    case = Case(**{**case.__dict__, "gemm": "fused"})
    inputs, keep, capacity = _gpu_problem(case, seed, dtype)
    check_case_covers(case, inputs, keep)
    pre = saved_pre(inputs, keep)
    got = run(inputs, case, capacity, pre=pre)
    assert_close(got, oracle_grads(inputs, keep, case), backward_tolerance(dtype), case, dtype,
                 inputs=inputs, keep=keep)
    again = run(inputs, case, capacity, pre=pre)
    for name, first, second in zip(GRAD_NAMES, got, again):
        assert torch.equal(first, second), f"{case} {dtype}: {name} differs between two runs"
    flashdmoe.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("needs", [(True, False, False, False), (False, True, False, False),
                                   (False, False, True, False), (False, False, False, True)], ids=str)
def test_gpu_fused_needs_selects_gradients(needs, fused_knobs, seed):
    case = Case(700, 128, 256, 16, 4, "swiglu", capacity_factor=1.0, skew=2.0, gemm="fused", expect="dropped")
    inputs, keep, capacity = _gpu_problem(case, seed, torch.bfloat16)
    pre = saved_pre(inputs, keep)
    everything = run(inputs, case, capacity, pre=pre)
    some = run(inputs, case, capacity, pre=pre, needs=needs)
    for name, need, full, part in zip(GRAD_NAMES, needs, everything, some):
        if need:
            assert torch.equal(full, part), f"{name} changes when it is the only gradient asked for"
        else:
            assert part is None, f"{name} was not asked for"


@pytest.mark.gpu
def test_gpu_auto_runs_the_fused_launch_for_few_rows_per_expert(fused_knobs, monkeypatch, seed):
    """gemm='auto' with saved pre and <= 512 rows per expert: the fused launch (counted), bitwise what
    gemm='fused' gives; with 1024 rows per expert it is not launched."""
    from flashdmoe.backward import expert_backward as eb

    launches = []
    real = eb._fused
    monkeypatch.setattr(eb, "_fused", lambda *args: launches.append(1) or real(*args))
    case = Case(512, 256, 384, 16, 4, "gelu", capacity_factor=1.25, skew=2.0)  # 128 rows per expert
    inputs, keep, capacity = _gpu_problem(case, seed, torch.bfloat16)
    pre = saved_pre(inputs, keep)
    auto = run(inputs, case, capacity, pre=pre)
    assert len(launches) == 1
    fused = run(inputs, Case(**{**case.__dict__, "gemm": "fused"}), capacity, pre=pre)
    for name, a, b in zip(GRAD_NAMES, auto, fused):
        assert torch.equal(a, b), f"{name}: auto and fused differ"
    many = Case(4096, 256, 384, 16, 4, "gelu")  # 1024 rows per expert
    inputs, keep, capacity = _gpu_problem(many, seed, torch.bfloat16)
    run(inputs, many, capacity, pre=saved_pre(inputs, keep))
    assert len(launches) == 2  # the gemm='fused' call above, not this one
    flashdmoe.check_errors()


@pytest.mark.gpu
def test_gpu_fused_no_host_synchronisation(fused_knobs, seed):
    case = Case(1024, 256, 512, 16, 4, "swiglu", capacity_factor=1.0, skew=2.0, gemm="fused")
    inputs, keep, capacity = _gpu_problem(case, seed, torch.bfloat16)
    pre = saved_pre(inputs, keep)
    run(inputs, case, capacity, pre=pre)  # warm-up: the extension's first launch sets its limits
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = run(inputs, case, capacity, pre=pre)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(g is not None for g in grads)


@pytest.mark.gpu
def test_gpu_fused_cuda_graph_replay_equals_eager(fused_knobs, seed):
    case = Case(1024, 256, 384, 16, 4, "gelu", capacity_factor=1.25, skew=2.0, gemm="fused")
    static_inputs, keep, capacity = _gpu_problem(case, seed, torch.bfloat16)
    static_pre = saved_pre(static_inputs, keep)
    fused_knobs.poison_outputs = False  # a fill in the graph would only hide what the replay writes
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run(static_inputs, case, capacity, pre=static_pre)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grads = run(static_inputs, case, capacity, pre=static_pre)
    fresh_inputs, fresh_keep, _ = _gpu_problem(case, seed + 1, torch.bfloat16)
    fresh_pre = saved_pre(fresh_inputs, fresh_keep)
    for static, fresh in zip(static_inputs + (static_pre,), fresh_inputs + (fresh_pre,)):
        static.copy_(fresh)
    for grad in static_grads:
        grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = run(fresh_inputs, case, capacity, pre=fresh_pre)
    for name, replayed, want in zip(GRAD_NAMES, static_grads, eager):
        assert torch.equal(replayed, want), f"{name} from the graph differs from eager"
    flashdmoe.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("phase", [10, 11])
def test_gpu_fused_timeout_raises(phase, fused_knobs, seed):
    """A block that never reaches a grid barrier of the backward: KernelTimeout naming the phase, at the
    next check, not a hang; the next backward works."""
    case = Case(512, 128, 256, 8, 2, "relu", gemm="fused")
    inputs, keep, capacity = _gpu_problem(case, seed, torch.bfloat16)
    pre = saved_pre(inputs, keep)
    fused_knobs.withhold_phase, fused_knobs.timeout_ms = phase, 300
    run(inputs, case, capacity, pre=pre)
    with pytest.raises(flashdmoe.KernelTimeout, match="backward: grid barrier"):
        flashdmoe.synchronize()
    fused_knobs.withhold_phase, fused_knobs.timeout_ms = 0, None
    got = run(inputs, case, capacity, pre=pre)
    assert_close(got, oracle_grads(inputs, keep, case), backward_tolerance(torch.bfloat16), case, torch.bfloat16,
                 inputs=inputs, keep=keep)
    flashdmoe.check_errors()


def test_fused_is_refused_where_it_cannot_run(seed):
    case = Case(20, 64, 64, 4, 2, "gelu", gemm="fused")
    inputs, keep, capacity = make_problem(case, seed, torch.bfloat16)
    with pytest.raises(ValueError, match="gemm='fused' cannot run here: no saved pre-activations"):
        run(inputs, case, capacity)
    with pytest.raises(ValueError, match="gemm='fused' cannot run here: the fused backward runs on CUDA devices"):
        run(inputs, case, capacity, pre=saved_pre(inputs, keep))


@pytest.mark.gpu
def test_gpu_fused_backward_leaves_last_report_to_the_forward(fused_knobs, seed):
    """flashdmoe.last_report() stays the forward's (its traffic and routing) after a fused backward."""
    from flashdmoe import cuda_backend

    case = Case(256, 128, 256, 8, 2, "gelu", gemm="fused")
    inputs, keep, capacity = _gpu_problem(case, seed, torch.bfloat16)
    x, router_weight, w1, w2 = inputs[:4]
    cuda_backend.fused_forward(x, router_weight, w1, w2, top_k=case.k, activation=case.activation,
                               normalize_topk=case.normalize, capacity_factor=None)
    forward_report = flashdmoe.last_report()
    run(inputs, case, capacity, pre=saved_pre(inputs, keep))
    assert flashdmoe.last_report() is forward_report
    flashdmoe.synchronize()
