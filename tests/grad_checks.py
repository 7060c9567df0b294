"""Gradients of the MoE layer through the public API (``flashdmoe.moe``) against autograd through
``flashdmoe.reference.moe_fixed_routing`` in float64, on the routing the forward chose.

Shared by tests/test_training.py (CPU: the reference backend, so CI runs this code) and
tests/test_training_gpu.py (the fused backend). Configurations are drawn from a seed (``next_seed()``): the
categorical options are fixed by the configuration's index, so that every sweep covers each of them, and
the sizes are random.

Tolerances: ``numerics.kernel_tolerance`` for ``y``, ``numerics.backward_tolerance`` for the gradients,
normwise. The router gradient cancels (the softmax's and the top-k renormalisation's subtractions), so its
error is measured against :func:`router_gradient_magnitude`, the same expression on absolute values, as
tests/test_expert_backward.py does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

import flashdmoe
from flashdmoe import numerics, reference

GRAD_NAMES = ("x", "router_weight", "w1", "w2")
HALF_DTYPES = (torch.bfloat16, torch.float16)
CAPACITY_FACTORS = (0.5, 0.75, 1.0, 1.25, 2.0)
# The fused kernel's shape rule for H and I (csrc/moe/tile_config.cuh: kHiddenMultiple, kFfnMultiple).
KERNEL_MULTIPLE = 64


@dataclass(frozen=True)
class GradConfig:
    T: int
    H: int
    I: int
    E: int
    k: int
    activation: str
    normalize: bool
    capacity_factor: float | None
    skew: float          # > 0: router rows biased along a direction every token shares (a few experts get most)
    ties: bool           # router rows duplicated in pairs: exactly equal probabilities
    dtype: torch.dtype

    @property
    def w1_cols(self) -> int:
        return 2 * self.I if self.activation == "swiglu" else self.I

    def __str__(self) -> str:
        cap = "dropless" if self.capacity_factor is None else f"cf{self.capacity_factor}"
        return (f"T{self.T}-H{self.H}-I{self.I}-E{self.E}-k{self.k}-{self.activation}-"
                f"{'norm' if self.normalize else 'raw'}-{cap}{f'-skew{self.skew}' if self.skew else ''}"
                f"{'-ties' if self.ties else ''}-{str(self.dtype).removeprefix('torch.')}")


@dataclass(frozen=True)
class Sizes:
    """Ranges a sweep draws from: small batches log-uniform in [1, small_tokens], large ones uniform in
    [large_tokens[0], large_tokens[1]]; E log-uniform in [4, max_experts]; H and I multiples of
    ``multiple`` up to ``max_width`` (``max_large_width`` for large batches), with E * H * w1_cols at most
    ``max_weights``."""

    small_tokens: int
    large_tokens: tuple[int, int]
    max_experts: int
    multiple: int
    max_width: int
    max_large_width: int
    max_weights: int


def draw_config(index: int, seed: int, sizes: Sizes, *, large_at: tuple[int, ...] = ()) -> GradConfig:
    """Configuration ``index`` of a sweep. By index: activation (i % 4), normalisation (i // 4 % 2), dtype
    (i // 8 % 2), capacity (i % 3 == 1), skew (i % 5 == 2), ties (i % 7 == 3); T = 0 at index 0, 1 at index
    9, large at the indices in ``large_at`` (the largest at the first of them). Sizes from ``seed``."""
    rng = random.Random(seed)
    activation = reference.ACTIVATIONS[index % 4]
    normalize = (index // 4) % 2 == 0
    dtype = HALF_DTYPES[(index // 8) % 2]
    capacity_factor = rng.choice(CAPACITY_FACTORS) if index % 3 == 1 else None
    skew = rng.choice((2.0, 4.0)) if index % 5 == 2 else 0.0
    ties = index % 7 == 3
    large = index in large_at
    if index == 0:
        T = 0
    elif index == 9:
        T = 1
    elif large:
        T = sizes.large_tokens[1] if index == large_at[0] else rng.randint(*sizes.large_tokens)
    else:
        T = round(math.exp(rng.uniform(0.0, math.log(sizes.small_tokens))))
    E = round(math.exp(rng.uniform(math.log(4), math.log(sizes.max_experts))))
    k = rng.randint(1, min(8, E))
    if ties and k % 2 == 0:
        # With the rows paired, an odd k puts the k-th / (k+1)-th boundary on an exact tie (for every token
        # when E is even).
        k -= 1
    widest = sizes.max_large_width if large else sizes.max_width
    H = sizes.multiple * rng.randint(1, widest // sizes.multiple)
    I = sizes.multiple * rng.randint(1, widest // sizes.multiple)
    while E * H * (2 * I if activation == "swiglu" else I) > sizes.max_weights:
        if H >= I and H > sizes.multiple:
            H = sizes.multiple * max(1, H // sizes.multiple // 2)
        elif I > sizes.multiple:
            I = sizes.multiple * max(1, I // sizes.multiple // 2)
        else:
            break
    return GradConfig(T, H, I, E, k, activation, normalize, capacity_factor, skew, ties, dtype)


def make_problem(config: GradConfig, seed: int, device: str | torch.device):
    """x [T, H], router_weight [E, H], w1 [E, H, I or 2I], w2 [E, I, H], dy [T, H] in config.dtype, scaled
    so that outputs are O(1); drawn on the CPU so a seed gives the same numbers on every device."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator) * scale

    x = randn(config.T, config.H)
    router_weight = randn(config.E, config.H, scale=1 / math.sqrt(config.H))
    if config.skew:
        # A direction every token shares (a component >= 1 along it) and a descending bias along it in the
        # router rows: expert 0 gets the most tokens, the last experts none (their logits trail by >= skew).
        direction = randn(config.H)
        direction /= direction.norm()
        x += 2.0 * direction
        along = x @ direction
        x += (along.abs() + 1 - along)[:, None] * direction
        router_weight += config.skew * torch.linspace(1, -1, config.E)[:, None] * direction
    if config.ties:
        pairs = config.E // 2
        router_weight[1:2 * pairs:2] = router_weight[0:2 * pairs:2]
    w1 = randn(config.E, config.H, config.w1_cols, scale=1 / math.sqrt(config.H))
    w2 = randn(config.E, config.I, config.H, scale=1 / math.sqrt(config.I))
    dy = randn(config.T, config.H)
    return tuple(t.to(dtype=config.dtype, device=device).contiguous() for t in (x, router_weight, w1, w2, dy))


def forward_routing(backend: str, x, router_weight, *, top_k: int, normalize: bool, capacity_factor):
    """The experts [T, k] (int64) and keep mask [T, k] the forward just run used. The fused backend's are
    the latest launch's (``flashdmoe.last_report().routing``; read before any later launch); the
    reference's are recomputed by the same functions ``reference.moe`` calls."""
    T, E = x.shape[0], router_weight.shape[0]
    if T == 0:
        empty = torch.empty(0, top_k, dtype=torch.long, device=x.device)
        return empty, empty.bool()
    if backend == "cuda":
        report = flashdmoe.last_report()
        assert report is not None and report.tokens == (T,), f"no launch report for this forward: {report!r}"
        routing = report.routing[0]
        return routing.expert.long(), routing.row >= 0
    routing = reference.route(x, router_weight, top_k, normalize)
    keep = reference.keep_mask(routing.experts, E, reference.expert_capacity(T, top_k, E, capacity_factor))
    return routing.experts, keep


def check_routing(x, router_weight, experts, keep, *, top_k: int, capacity_factor, what: str = "") -> None:
    """The forward's routing is the reference's, up to near-ties: a token may pick other experts than the
    float64 reference only where its probabilities around the k-th place are within 1e-4 (docs/design.md
    §3.7); the keep mask is the capacity rule applied to its own choices."""
    T, E = experts.shape[0], router_weight.shape[0]
    if T == 0:
        return
    exact = reference.route(x.double(), router_weight.double(), top_k, False)
    differs = (experts != exact.experts).any(dim=1)
    if differs.any():
        edge = min(top_k, E - 1)
        ordered = exact.probs[differs].sort(dim=1, descending=True).values
        gaps = (ordered[:, :edge] - ordered[:, 1:edge + 1]).abs().min(dim=1).values
        assert bool((gaps < 1e-4).all()), \
            f"{what}: {int(differs.sum())} tokens routed unlike the reference off a near-tie"
    want_keep = reference.keep_mask(experts, E, reference.expert_capacity(T, top_k, E, capacity_factor))
    assert torch.equal(keep, want_keep), f"{what}: the keep mask is not the capacity rule on the chosen experts"


def run_public(backend: str, config: GradConfig, x, router_weight, w1, w2, dy):
    """flashdmoe.moe forward and backward of <y, dy>. Returns y, the four gradients and the routing."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, router_weight, w1, w2)]
    y = flashdmoe.moe(*leaves, top_k=config.k, activation=config.activation, normalize_topk=config.normalize,
                      capacity_factor=config.capacity_factor, backend=backend)
    experts, keep = forward_routing(backend, x, router_weight, top_k=config.k, normalize=config.normalize,
                                    capacity_factor=config.capacity_factor)
    y.backward(dy)
    return y.detach(), [leaf.grad for leaf in leaves], experts, keep


def oracle(x, router_weight, w1, w2, dy, experts, keep, *, activation: str, normalize: bool):
    """y and the gradients of <y, dy> by autograd through reference.moe_fixed_routing in float64 on the
    same (dtype-rounded) inputs and the given routing."""
    leaves = [t.detach().double().requires_grad_() for t in (x, router_weight, w1, w2)]
    y = reference.moe_fixed_routing(*leaves, experts, keep, activation=activation, normalize_topk=normalize)
    grads = torch.autograd.grad(y, leaves, dy.double(), allow_unused=True)
    return y.detach(), [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]


def router_gradient_magnitude(x, router_weight, w1, w2, experts, keep, dy, *, activation: str,
                              normalize_topk: bool) -> torch.Tensor:
    """d_router evaluated in float64 with every subtraction turned into an addition of magnitudes.

    The router's gradient cancels: a renormalised choice's dp_j = (dweight_j - sum_i w_i dweight_i) / S and
    the softmax's dP - sum p dP. With few tokens (T = 1) the difference can be a small part of its terms,
    so an error relative to ||d_router|| measures the problem's conditioning, not the code. Rounding errors
    are bounded relative to the terms' magnitudes (Higham's running error bound: |fl(e) - e| <= c u |e|_abs
    with |e|_abs the expression on absolute values), which is this [E, H] tensor."""
    x, router_weight, w1, w2, dy = (t.to(torch.float64) for t in (x, router_weight, w1, w2, dy))
    experts = experts.long()
    top_k, num_experts = experts.shape[1], router_weight.shape[0]
    dweight = torch.zeros(experts.numel(), dtype=torch.float64, device=x.device)
    for e in range(num_experts):
        choices = reference.routed_choices(experts, keep, e)
        outputs = reference.expert_ffn(x[choices // top_k], w1[e], w2[e], activation)
        dweight[choices] = (outputs * dy[choices // top_k]).sum(dim=1)
    dweight = dweight.view(experts.shape).abs()
    probs = reference.router_probs(x, router_weight)
    chosen = probs.gather(1, experts)
    if normalize_topk:
        total = chosen.sum(dim=1, keepdim=True)
        dweight = (dweight + (dweight * chosen / total).sum(dim=1, keepdim=True)) / total
    dprobs = torch.zeros_like(probs).scatter_(1, experts, dweight)
    dlogits = probs * (dprobs + (chosen * dweight).sum(dim=1, keepdim=True))
    return dlogits.t() @ x.abs()


def relu_kink_alternatives(x, w1, w2, dy, experts, weights, keep, *, dtype) -> dict[str, list]:
    """relu's slope jumps at 0, so a pre-activation within the rounding error of its own evaluation of 0
    can take either slope in any finite-precision backward: no smooth error model bounds the difference.
    That error: a float32 sum of H products, within gamma_H = H u / (1 - H u) of the sum of their
    magnitudes in any order (plus 2 u_TF32 of it for float32 inputs, whose operands the kernel rounds to
    TF32), and the storage format's rounding of a tiny value to 0 (half its smallest subnormal).

    For each such element j of a kept choice (t, e) (weights: [T, k] combine weights), what taking the
    other slope than the float64 oracle adds to dx[t] and to dw1[e][:, j], with dh = weight * dy[t] @
    w2[e]^T: ``{"dx": [((t,), [H] delta)], "dw1": [((e, slice(None), j), [H] delta)]}`` (float64; empty
    lists where no element is that close to 0). kink_fitted_error takes them."""
    entry = numerics.precision(dtype)
    x, w1, w2, dy = (t.detach().double() for t in (x, w1, w2, dy))
    experts = experts.long()
    top_k, hidden = experts.shape[1], x.shape[1]
    u32 = 2.0 ** -24
    relative = hidden * u32 / (1 - hidden * u32)
    if entry.dtype == torch.float32:
        relative += 2 * entry.compute_unit_roundoff
    info = torch.finfo(entry.dtype)
    to_zero = info.tiny * info.eps / 2
    flat_weights = weights.detach().double().reshape(-1)
    found: dict[str, list] = {"dx": [], "dw1": []}
    for e in range(w1.shape[0]):
        choices = reference.routed_choices(experts, keep, e)
        if not len(choices):
            continue
        tokens = choices // top_k
        rows = x[tokens]
        pre = rows @ w1[e]
        near = pre.abs() <= relative * (rows.abs() @ w1[e].abs()) + to_zero
        for i, j in near.nonzero().tolist():
            dh = float((flat_weights[choices[i]] * dy[tokens[i]]) @ w2[e][j])
            flip = -1.0 if pre[i, j] > 0 else 1.0  # the oracle's slope is 1 where pre > 0
            t = int(tokens[i])
            found["dx"].append(((t,), flip * dh * w1[e][:, j]))
            found["dw1"].append(((e, slice(None), j), flip * dh * rows[i]))
    return found


def kink_fitted_error(got: torch.Tensor, want: torch.Tensor, alternatives: list) -> float:
    """numerics.normwise_error of ``got`` against the oracle ``want`` taken with the other slope at those of
    relu_kink_alternatives' elements where that fits ``got`` better (one greedy pass; each alternative
    touches one row or column). Without alternatives, numerics.normwise_error itself."""
    if not alternatives:
        return numerics.normwise_error(got, want)
    residual = got.double() - want.double()
    for index, delta in alternatives:
        here = residual[index]
        if float(((here - delta) ** 2).sum()) < float((here ** 2).sum()):
            residual[index] = here - delta
    scale = float(want.double().norm())
    return float(residual.norm()) / scale if scale else float(residual.norm())


def router_error(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> float:
    """||got - want|| relative to ||magnitude|| (the absolute error when the magnitude is 0)."""
    scale = float(magnitude.norm())
    diff = float((got.double() - want.double()).norm())
    return diff / scale if scale else diff


def assert_gradients_close(config: GradConfig, got_y, got_grads, want_y, want_grads, magnitude,
                           kink: dict[str, torch.Tensor] | None = None) -> None:
    """y within kernel_tolerance, the four gradients within backward_tolerance (d_router relative to its
    magnitude; dx and dw1 against the oracle with relu's slope fitted at its kink where ``kink`` gives
    relu_kink_alternatives), each with the inputs' dtype and shape."""
    what = str(config)
    assert got_y.dtype == config.dtype and got_y.shape == want_y.shape, f"{what}: y {got_y.dtype} {tuple(got_y.shape)}"
    if config.T:
        error = numerics.normwise_error(got_y, want_y)
        bound = numerics.kernel_tolerance(config.dtype)
        assert error <= bound, f"{what}: y normwise error {error:.3e} > {bound:.3e}"
    bound = numerics.backward_tolerance(config.dtype)
    for name, got, want in zip(GRAD_NAMES, got_grads, want_grads):
        assert got is not None, f"{what}: no gradient for {name}"
        assert got.dtype == config.dtype and got.shape == want.shape, \
            f"{what}: d{name} is {got.dtype} {tuple(got.shape)}, expected {config.dtype} {tuple(want.shape)}"
        assert bool(torch.isfinite(got).all()), f"{what}: d{name} has non-finite values"
        if name == "router_weight":
            error = router_error(got, want, magnitude)
        else:
            error = kink_fitted_error(got, want, (kink or {}).get("d" + name, []))
        assert error <= bound, f"{what}: d{name} error {error:.3e} > backward_tolerance {bound:.3e}"


def assert_dropped_tokens_get_no_dx(dx, keep, what: str) -> None:
    """A token whose every choice was dropped has y = 0 whatever the parameters: its dx is exactly 0."""
    all_dropped = ~keep.any(dim=1)
    if all_dropped.any():
        assert not dx[all_dropped].any(), f"{what}: tokens with every choice dropped got a nonzero dx"


def assert_idle_experts_get_no_weight_gradient(dw1, dw2, routings, what: str) -> None:
    """An expert that kept no row (from any rank: ``routings`` is a list of (experts, keep)) contributed
    nothing: its dw1 and dw2 are exactly 0."""
    rows = sum(torch.bincount(experts[keep], minlength=dw1.shape[0]) for experts, keep in routings)
    idle = rows == 0
    if idle.any():
        assert not dw1[idle].any() and not dw2[idle].any(), f"{what}: experts without rows got weight gradients"


def check_config(backend: str, config: GradConfig, seed: int, device) -> dict:
    """Forward and backward through flashdmoe.moe against the float64 oracle on the forward's routing.
    Returns what the routing covered (dropped choices, idle experts, tokens at an exact tie)."""
    x, router_weight, w1, w2, dy = make_problem(config, seed, device)
    y, grads, experts, keep = run_public(backend, config, x, router_weight, w1, w2, dy)
    check_routing(x, router_weight, experts, keep, top_k=config.k, capacity_factor=config.capacity_factor,
                  what=str(config))
    want_y, want_grads = oracle(x, router_weight, w1, w2, dy, experts, keep, activation=config.activation,
                                normalize=config.normalize)
    magnitude = router_gradient_magnitude(x, router_weight, w1, w2, experts, keep, dy,
                                          activation=config.activation, normalize_topk=config.normalize)
    kink = None
    if config.activation == "relu":
        chosen = reference.combine_weights(reference.router_probs(x.double(), router_weight.double()),
                                           experts.long(), config.normalize)
        kink = relu_kink_alternatives(x, w1, w2, dy, experts, chosen, keep, dtype=config.dtype)
    assert_gradients_close(config, y, grads, want_y, want_grads, magnitude, kink)
    assert_dropped_tokens_get_no_dx(grads[0], keep, str(config))
    assert_idle_experts_get_no_weight_gradient(grads[2], grads[3], [(experts, keep)], str(config))
    rows = torch.bincount(experts[keep], minlength=config.E) if config.T else torch.zeros(config.E)
    return {"dropped": int((~keep).sum()), "idle_experts": int((rows == 0).sum())}
