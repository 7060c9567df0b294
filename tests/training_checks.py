"""A small model with a ``flashdmoe.MoELayer`` trained end to end, and the band its loss curve must stay in
around the float64 reference's.

Shared by tests/test_training.py (CPU: the reference backend in float32 / bfloat16) and
tests/test_training_gpu.py (the fused backend in bfloat16).

Model: ``x -> x @ W_in -> h + MoELayer(h) -> @ W_head``, a residual MoE block between two linear maps.
Task: regression of a fixed random teacher ``tanh(x A) B`` plus Gaussian noise, full batch (the same
tokens every step), mean squared error, plain SGD. Mixed precision as it is done in practice: the
optimizer keeps float32 master weights (float64 for the float64 run) and every step copies them into a
compute copy in the run's dtype, whose gradients are cast back to the masters.

The band (:func:`loss_band`): a first-order perturbation bound of the run against the float64 run, every
problem-dependent factor read off the float64 run (not off the run under test):

    |L(s) - L64(s)| <= F(s) + D(s)

F (forward): at equal parameters the run's model output differs from float64 by a normwise relative error
at most ``output_tolerance`` (the roundings to the compute dtype on the way, see :func:`tolerances`). With
r the residual, d that error and n the number of outputs, mean((r + d)^2) - mean(r^2) = (2 <r, d> +
||d||^2) / n. Rounding errors are modelled as numerics models them (independent, mean zero; lambda = 6 as
in ``numerics.reorder_tolerance``): |<r, d>| <= lambda ||r|| ||d|| / sqrt(n). With ||d|| <= tau ||out||:
F = 2 lambda tau sqrt(L Q) / sqrt(n) + tau^2 Q, where L = mean(r^2) and Q = mean(out^2).

D (drift): each step's gradient carries a relative error at most ``gradient_tolerance`` (eps); SGD moves
the parameters by lr * g, so step j adds at most eps * ||step_j|| to the distance between the two
parameter vectors. Taking the step map as non-expansive (plain SGD with lr below 2 / the curvature, a
locally convex loss) those errors add at worst linearly: ||theta(s) - theta64(s)|| <= eps * sum_{j<s}
||step_j||, and the loss moves by at most ||grad L64(s)|| times that (Cauchy-Schwarz, first order).

What the bound leaves out: top-k routing is piecewise constant, and a token whose k-th and (k+1)-th
experts are nearly tied may pick differently in the two runs (docs/design.md §3.7). One such token moves
the loss by O(1 / T) relative, and the two runs then follow different paths. Where the band is wider
than loss / T (bfloat16: runs of the reference backend on the CPU and of the fused layer's backward used
at most a sixth of the band over ten seeds) the band absorbs it. Where it is narrower (float32) the
comparison ends at the first step whose routing differs (:func:`assert_follows`); every token routed
differently there must be a near-tie of the float64 run, its top-k margin within what the two runs'
logits may differ by: the forward's rounding bound on the logits plus the parameter drift times the
logits' sensitivity to the parameters (:func:`margin_allowance`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import nn

import flashdmoe
from flashdmoe import numerics

# lambda of numerics' probabilistic rounding model (numerics.reorder_tolerance): a sum of independent
# mean-zero errors exceeds lambda standard deviations with probability < 2 exp(-lambda^2 / 2) = 3e-8.
LAMBDA = 6.0
# Roundings to the compute dtype outside the fused layer on the way to the output: x, W_in, x @ W_in, the
# layer's three weights copied from the masters, h + moe(h), W_head, the head's product.
DENSE_OUTPUT_ROUNDINGS = 9
# ... and on the way to the dense layers' gradients: d_out, d_out @ W_head^T, the residual's sum of
# gradients, and the two weight-gradient products.
DENSE_GRADIENT_ROUNDINGS = 5
# Reductions chained in the float32 forward (x @ W_in, router, w1, w2, head) and forward + backward.
FORWARD_DEPTH = 5
TRAINING_DEPTH = 10


@dataclass(frozen=True)
class TrainingSetup:
    tokens: int
    features: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    outputs: int
    activation: str = "gelu"
    steps: int = 100
    lr: float = 0.1
    noise: float = 0.5
    teacher_width: int = 64


@dataclass
class Curve:
    """Per step: the loss, mean(out^2), the gradient's norm and the SGD step's norm (all parameters)."""

    loss: list[float] = field(default_factory=list)
    output_square: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    step_norm: list[float] = field(default_factory=list)
    # Routing per step: each token's top-k experts as reference.route picks them from the run's own
    # layer input and router (sorted, [T, k]); in float64 from the same parameters, each token's margin
    # between its k-th and (k+1)-th logit ([T]), the largest |logit|, and the logits' sensitivity to the
    # parameters: max_t ||x_t|| * max_e ||r_e|| + max_t ||h_t|| (|d logit| <= that * ||d theta||).
    routing: list[torch.Tensor] = field(default_factory=list)
    margin: list[torch.Tensor] = field(default_factory=list)
    logit_scale: list[float] = field(default_factory=list)
    logit_sensitivity: list[float] = field(default_factory=list)


class MoEModel(nn.Module):
    """x [T, features] -> h = x @ W_in -> h + MoELayer(h) -> @ W_head -> [T, outputs]."""

    def __init__(self, setup: TrainingSetup, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(setup.features, setup.hidden, generator=generator)
                                  / math.sqrt(setup.features))
        config = flashdmoe.MoEConfig(hidden=setup.hidden, ffn=setup.ffn, experts=setup.experts, top_k=setup.top_k,
                                     tokens_per_rank=setup.tokens, activation=setup.activation, seed=seed)
        self.moe = flashdmoe.MoELayer(config)
        self.head = nn.Parameter(torch.randn(setup.hidden, setup.outputs, generator=generator)
                                 / math.sqrt(setup.hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.embed
        return (h + self.moe(h)) @ self.head


def make_task(setup: TrainingSetup, seed: int):
    """Inputs [T, features] and targets [T, outputs] (float64, CPU): a random tanh teacher plus noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(setup.tokens, setup.features, generator=generator, dtype=torch.float64)
    a = torch.randn(setup.features, setup.teacher_width, generator=generator, dtype=torch.float64)
    b = torch.randn(setup.teacher_width, setup.outputs, generator=generator, dtype=torch.float64)
    target = torch.tanh(x @ a * (2 / math.sqrt(setup.features))) @ b * (2 / math.sqrt(setup.teacher_width))
    target += setup.noise * torch.randn(target.shape, generator=generator, dtype=torch.float64)
    return x, target


def train(setup: TrainingSetup, model: MoEModel, x: torch.Tensor, target: torch.Tensor, *, backend: str,
          compute_dtype: torch.dtype, device) -> Curve:
    """``setup.steps`` SGD steps on a copy of ``model``: float32 masters (float64 when computing in float64),
    a compute copy in ``compute_dtype`` whose MoELayer runs on ``backend``."""
    master_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    master = copy.deepcopy(model).to(device=device, dtype=master_dtype)
    work = copy.deepcopy(master).to(compute_dtype)
    work.moe.backend = backend
    optimizer = torch.optim.SGD(master.parameters(), lr=setup.lr)
    inputs = x.to(device=device, dtype=compute_dtype)
    target = target.to(device=device, dtype=master_dtype)
    masters, copies = list(master.parameters()), list(work.parameters())
    curve = Curve()
    for _ in range(setup.steps):
        with torch.no_grad():
            for compute, kept in zip(copies, masters):
                compute.copy_(kept)
        record_routing(curve, work, inputs, setup.top_k)
        work.zero_grad(set_to_none=True)
        out = work(inputs).to(master_dtype)
        loss = ((out - target) ** 2).mean()
        loss.backward()
        for compute, kept in zip(copies, masters):
            kept.grad = compute.grad.to(master_dtype)
        grad_norm = math.sqrt(sum(float(kept.grad.double().norm()) ** 2 for kept in masters))
        curve.loss.append(float(loss.detach()))
        curve.output_square.append(float((out.detach().double() ** 2).mean()))
        curve.grad_norm.append(grad_norm)
        curve.step_norm.append(setup.lr * grad_norm)
        optimizer.step()
    return curve


def tolerances(dtype: torch.dtype, setup: TrainingSetup) -> tuple[float, float]:
    """(output_tolerance, gradient_tolerance) of a run computing in ``dtype`` against float64, normwise.

    Half precision: the fused layer's ``kernel_tolerance`` and ``backward_tolerance`` (the reference backend
    rounds less than the kernel, so they bound it too) plus one unit roundoff per rounding of the dense
    layers (``rounding_tolerance``). float32: every product is a float32 reduction, ``reorder_tolerance`` over
    the longest one (T in the weight gradients), chained through the forward (and the backward)."""
    if dtype in (torch.bfloat16, torch.float16):
        return (numerics.kernel_tolerance(dtype) + numerics.rounding_tolerance(dtype, DENSE_OUTPUT_ROUNDINGS),
                numerics.backward_tolerance(dtype) + numerics.rounding_tolerance(dtype, DENSE_GRADIENT_ROUNDINGS))
    if dtype == torch.float32:
        longest = max(setup.features, setup.hidden, setup.ffn, setup.tokens)
        return (numerics.reorder_tolerance(dtype, longest, depth=FORWARD_DEPTH),
                numerics.reorder_tolerance(dtype, longest, depth=TRAINING_DEPTH))
    raise ValueError(f"dtype={dtype}: expected bfloat16, float16 or float32")


@torch.no_grad()
def record_routing(curve: Curve, work: MoEModel, inputs: torch.Tensor, top_k: int) -> None:
    """Appends this step's routing of ``work``'s MoE layer (see :class:`Curve`)."""
    h = inputs @ work.embed  # the layer's input, as MoEModel.forward computes it
    router = work.moe.router_weight
    curve.routing.append(flashdmoe.reference.route(h, router, top_k).experts.sort(dim=1).values.cpu())
    x64, h64, router64 = inputs.double(), h.double(), router.double()
    logits = h64 @ router64.T
    top = logits.topk(top_k + 1, dim=1).values
    curve.margin.append((top[:, top_k - 1] - top[:, top_k]).cpu())
    curve.logit_scale.append(float(logits.abs().max()))
    curve.logit_sensitivity.append(float(x64.norm(dim=1).max() * router64.norm(dim=1).max() + h64.norm(dim=1).max()))


def margin_allowance(reference: Curve, step: int, *, output_tolerance: float, gradient_tolerance: float) -> float:
    """How far apart the two runs' logits of a token may be at ``step`` (so the largest top-k margin of
    the float64 run that the other run may see reversed): rounding, at most ``output_tolerance`` of the
    largest logit (the forward's bound covers the router's two chained products), plus the parameter
    drift (:func:`loss_band`'s D) times the logits' sensitivity; on both sides of the margin."""
    drift = gradient_tolerance * sum(reference.step_norm[:step])
    return 2 * (output_tolerance * reference.logit_scale[step] + drift * reference.logit_sensitivity[step])


def loss_band(reference: Curve, *, outputs: int, output_tolerance: float, gradient_tolerance: float) -> list[float]:
    """Per step, the largest |L(s) - L64(s)| the module docstring's bound allows; ``reference`` is the
    float64 run, ``outputs`` the number of output elements (T * outputs)."""
    band, drift = [], 0.0
    for loss, square, grad_norm, step_norm in zip(reference.loss, reference.output_square, reference.grad_norm,
                                                 reference.step_norm):
        forward = (2 * LAMBDA * output_tolerance * math.sqrt(loss * square) / math.sqrt(outputs)
                   + output_tolerance ** 2 * square)
        band.append(forward + gradient_tolerance * grad_norm * drift)
        drift += step_norm
    return band


def assert_follows(got: Curve, want: Curve, band: list[float], *, what: str, max_relative_band: float,
                   tokens: int, output_tolerance: float, gradient_tolerance: float) -> tuple[float, int]:
    """Every step's loss within the band; the band itself below ``max_relative_band`` of the loss (a band
    as wide as the loss would test nothing); both runs learn (final loss below half the initial). Where
    the band is narrower than what one token routed differently moves (loss / ``tokens``), the comparison
    ends at the first step whose routing differs, after checking that every such token is a near-tie
    (:func:`margin_allowance`). Returns the largest fraction of the band used and the steps compared."""
    assert len(got.loss) == len(want.loss) == len(band)
    used, compared = 0.0, len(band)
    for step, (loss, loss64, allowed) in enumerate(zip(got.loss, want.loss, band)):
        assert math.isfinite(loss), f"{what}: step {step}: loss {loss}"
        assert allowed <= max_relative_band * loss64, \
            f"{what}: step {step}: band {allowed:.3e} exceeds {max_relative_band} of the loss {loss64:.4e}"
        rerouted = (got.routing[step] != want.routing[step]).any(dim=1).nonzero().flatten()
        if len(rerouted) and allowed < loss64 / tokens:
            allowance = margin_allowance(want, step, output_tolerance=output_tolerance,
                                         gradient_tolerance=gradient_tolerance)
            margins = want.margin[step][rerouted]
            assert float(margins.max()) <= allowance, (
                f"{what}: step {step}: tokens {rerouted.tolist()} routed differently with float64 top-k margins "
                f"{margins.tolist()}, beyond the {allowance:.3e} the two runs' logits may differ by")
            compared = step
            break
        difference = abs(loss - loss64)
        assert difference <= allowed, (f"{what}: step {step}: loss {loss:.6e} vs float64 {loss64:.6e}: difference "
                                       f"{difference:.3e} ({difference / loss64:.2e} relative) > band {allowed:.3e}")
        used = max(used, difference / allowed)
    for name, curve in (("run", got), ("float64 run", want)):
        assert curve.loss[-1] < 0.5 * curve.loss[0], \
            f"{what}: the {name} did not learn: loss {curve.loss[0]:.4e} -> {curve.loss[-1]:.4e}"
    return used, compared
