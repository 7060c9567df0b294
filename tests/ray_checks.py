"""Checks shared by the Ray executor's tests (test_ray, test_ray_multinode): a :class:`MoECluster`'s
distributed forward and backward against ``reference.moe_expert_parallel``."""

from __future__ import annotations

import torch

from closeness import assert_normwise_close
from flashdmoe import numerics, reference
from flashdmoe.config import make_weights

# float32 gloo ranks against the single-process reference: summation orders differ (the router gradient
# is all-reduced over ranks); the problems here reduce over at most 64 terms, three forward and three
# backward reductions in a row.
TOLERANCE = numerics.reorder_tolerance(torch.float32, 64, depth=6)


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if want.numel():
        assert_normwise_close(got, want, TOLERANCE, name)


def check_against_reference(cluster, tokens: list[int], seed: int) -> None:
    """Random batches (``tokens[r]`` rows on rank r) and output gradients through the cluster vs the reference."""
    config = cluster.config
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(count, config.hidden, generator=generator) for count in tokens]
    dys = [torch.randn(count, config.hidden, generator=generator) for count in tokens]
    ys = cluster.forward(xs)
    dxs, grads = cluster.backward(dys)

    router, w1, w2 = make_weights(config)
    local = config.local_experts
    ref_xs = [x.clone().requires_grad_() for x in xs]
    ref_router = router.clone().requires_grad_()
    ref_w1s = [w1[r * local:(r + 1) * local].clone().requires_grad_() for r in range(config.world_size)]
    ref_w2s = [w2[r * local:(r + 1) * local].clone().requires_grad_() for r in range(config.world_size)]
    want = reference.moe_expert_parallel(ref_xs, ref_router, ref_w1s, ref_w2s, top_k=config.top_k,
                                         activation=config.activation, normalize_topk=config.normalize_topk,
                                         capacity_factor=config.capacity_factor)
    torch.autograd.backward(want, dys)
    for rank in range(config.world_size):
        assert_close(f"y[{rank}]", ys[rank], want[rank].detach())
        assert_close(f"dx[{rank}]", dxs[rank], ref_xs[rank].grad)
        assert_close(f"dw1[{rank}]", grads["w1"][rank], ref_w1s[rank].grad)
        assert_close(f"dw2[{rank}]", grads["w2"][rank], ref_w2s[rank].grad)
    assert_close("d router_weight", grads["router_weight"], ref_router.grad)
