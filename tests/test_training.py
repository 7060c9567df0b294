"""Training through the public API on the CPU: the gradient sweep and the training run of
tests/test_training_gpu.py on the reference backend, so that CI runs the same checking code.

Gradients: ``flashdmoe.moe(..., backend="reference")`` in bfloat16 / float16 against autograd in float64
on the same routing (tests/grad_checks.py). Training: a model with a ``MoELayer`` trained for 100 steps
in float32 and in bfloat16 follows the float64 run's loss curve within the band of
tests/training_checks.py.
"""

from __future__ import annotations

import pytest
import torch

from conftest import next_seed
from grad_checks import GradConfig, Sizes, check_config, draw_config, forward_routing, make_problem
from training_checks import Curve, MoEModel, TrainingSetup, assert_follows, loss_band, make_task, tolerances, train

# every test draws its inputs through next_seed(): the seed fixture prints its seed on failure
pytestmark = pytest.mark.usefixtures("seed")

CPU_SIZES = Sizes(small_tokens=96, large_tokens=(200, 300), max_experts=32, multiple=16, max_width=64,
                  max_large_width=32, max_weights=2 ** 16)
# 16 indices: every (activation, normalisation, dtype), capacity at 5, skew at 3, ties at 2 of them.
CPU_SWEEP = 16


@pytest.mark.parametrize("index", range(CPU_SWEEP))
def test_gradients_through_the_reference_backend(index):
    config = draw_config(index, next_seed(), CPU_SIZES, large_at=(5,))
    print(config)
    check_config("reference", config, next_seed(), "cpu")


def test_sweep_covers_every_option():
    configs = [draw_config(index, next_seed(), CPU_SIZES, large_at=(5,)) for index in range(CPU_SWEEP)]
    assert {(c.activation, c.normalize, c.dtype) for c in configs} == {
        (a, n, d) for a in ("relu", "gelu", "silu", "swiglu") for n in (True, False)
        for d in (torch.bfloat16, torch.float16)}
    assert {c.T for c in configs} >= {0, 1} and max(c.T for c in configs) >= 200
    assert any(c.capacity_factor for c in configs) and any(c.capacity_factor is None for c in configs)
    assert any(c.skew for c in configs) and any(c.ties for c in configs)
    assert all(1 <= c.k <= min(8, c.E) and c.H % 16 == 0 and c.I % 16 == 0 for c in configs)


def test_tied_router_rows_tie_every_token_at_the_top_k_boundary(seed):
    """ties with an odd k: every token's k-th and (k+1)-th experts have exactly equal probabilities, and
    the lower index wins (docs/design.md §3.2); the gradients still match the oracle."""
    config = GradConfig(T=50, H=32, I=16, E=6, k=3, activation="silu", normalize=True, capacity_factor=None,
                        skew=0.0, ties=True, dtype=torch.bfloat16)
    x, router_weight, *_ = make_problem(config, seed, "cpu")
    experts, _ = forward_routing("reference", x, router_weight, top_k=3, normalize=True, capacity_factor=None)
    # rows 2j and 2j + 1 are equal: the k-th choice (odd k) is the lower of a pair whose other half is out
    assert bool((experts[:, -1] % 2 == 0).all())
    assert not bool(((experts[:, -1:] + 1) == experts).any())
    check_config("reference", config, seed, "cpu")


CPU_SETUP = TrainingSetup(tokens=256, features=32, hidden=64, ffn=64, experts=8, top_k=2, outputs=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_follows_the_float64_reference(dtype, seed):
    model = MoEModel(CPU_SETUP, seed)
    x, target = make_task(CPU_SETUP, seed + 1)
    want = train(CPU_SETUP, model, x, target, backend="reference", compute_dtype=torch.float64, device="cpu")
    got = train(CPU_SETUP, model, x, target, backend="reference", compute_dtype=dtype, device="cpu")
    output_tolerance, gradient_tolerance = tolerances(dtype, CPU_SETUP)
    band = loss_band(want, outputs=CPU_SETUP.tokens * CPU_SETUP.outputs, output_tolerance=output_tolerance,
                     gradient_tolerance=gradient_tolerance)
    used, compared = assert_follows(got, want, band, what=f"{dtype} reference", max_relative_band=0.25,
                                    tokens=CPU_SETUP.tokens, output_tolerance=output_tolerance,
                                    gradient_tolerance=gradient_tolerance)
    print(f"{dtype}: loss {want.loss[0]:.4f} -> {want.loss[-1]:.4f}; {compared} steps compared, largest fraction "
          f"of the band used {used:.3f}")


def test_assert_follows_refuses_a_token_rerouted_away_from_a_tie():
    # Synthetic curves: two tokens, top-1; step 1 routes token 0 differently. Its float64 margin decides.
    def curve(losses, second_routing, margin0):
        c = Curve(loss=losses, output_square=[1.0] * 3, grad_norm=[1.0] * 3, step_norm=[0.0] * 3)
        c.routing = [torch.tensor([[0], [1]]), torch.tensor([[second_routing], [1]]), torch.tensor([[0], [1]])]
        c.margin = [torch.tensor([margin0, 1.0])] * 3
        c.logit_scale, c.logit_sensitivity = [1.0] * 3, [1.0] * 3
        return c

    want = curve([4.0, 3.0, 1.0], 0, margin0=1e-9)
    band = [1e-4] * 3  # narrower than loss / tokens: a rerouted token ends the comparison
    kwargs = dict(what="synthetic", max_relative_band=0.25, tokens=2, output_tolerance=1e-6, gradient_tolerance=0.0)
    near_tie = curve([4.0, 3.5, 1.0], 2, margin0=1e-9)  # step 1's loss is off, but the routing changed at a tie
    assert assert_follows(near_tie, want, band, **kwargs) == (0.0, 1)
    far = curve([4.0, 3.5, 1.0], 2, margin0=1e-9)
    want_far = curve([4.0, 3.0, 1.0], 0, margin0=0.5)  # token 0 was no tie in the float64 run
    with pytest.raises(AssertionError, match=r"step 1: tokens \[0\] routed differently"):
        assert_follows(far, want_far, band, **kwargs)
