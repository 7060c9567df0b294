"""Expert parallelism inside the kernel, emulated: P virtual ranks in one launch on one GPU
(``Team.emulated``), against ``flashdmoe.reference`` (GPU only).

Each rank's output is compared with the reference evaluated on the kernel's routing (near-ties may flip a
choice, see tests/test_fused_gpu.py), with norm-relative tolerances numerics.kernel_tolerance. The routing
itself is checked exactly: counts, the per-(source, expert) capacity mask, and each destination stream is
a permutation ordered by (local expert, token). Outputs are poisoned with NaN before every launch.
"""

import math
import random

import pytest
import torch

import flashdmoe
from flashdmoe.kernel.expert_variants import VARIANTS
from conftest import next_seed
from flashdmoe import numerics, reference
from flashdmoe.parallel.team import Team, TeamFailed

# every test draws its inputs through next_seed(): the seed fixture prints its seed on failure
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("seed")]

TOL = {dtype: numerics.kernel_tolerance(dtype) for dtype in (torch.bfloat16, torch.float16)}
ACTIVATIONS = ["relu", "gelu", "silu", "swiglu"]


@pytest.fixture(scope="module")
def backend():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fused kernel targets Hopper (sm_90a)")
    from flashdmoe import cuda_backend
    from flashdmoe.kernel import extension

    extension.load()
    cuda_backend.debug.poison_outputs = True
    yield cuda_backend
    cuda_backend.debug.poison_outputs = False


def make_inputs(tokens, H, I, E, P, activation, dtype, *, seed=None, skew=0.0):
    """xs (one per rank, tokens[r] rows), router [E, H], w1s / w2s shards [L, ...]. skew > 0 scales a few
    router rows up so that a handful of experts draw most tokens."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed if seed is not None else next_seed())
    cols = 2 * I if activation == "swiglu" else I
    xs = [torch.randn(T, H, device="cuda", generator=g).to(dtype) for T in tokens]
    router = torch.randn(E, H, device="cuda", generator=g) / math.sqrt(H)
    if skew:
        router[: max(1, E // 8)] *= 1.0 + skew
    router = router.to(dtype)
    w1 = (torch.randn(E, H, cols, device="cuda", generator=g) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, I, H, device="cuda", generator=g) / math.sqrt(I)).to(dtype)
    L = E // P
    return xs, router, list(w1.split(L)), list(w2.split(L))


def check_rank(x, router, w1_all, w2_all, y, routing, *, rank, P, top_k, activation, normalize, capacity_factor):
    T, E = x.shape[0], router.shape[0]
    L = E // P
    assert not torch.isnan(y).any(), f"rank {rank}: unwritten (NaN-poisoned) or NaN output elements"
    experts = routing.expert.long()
    ref_route = reference.route(x, router, top_k, normalize)
    differs = (experts != ref_route.experts).any(dim=1)
    if differs.any():
        sorted_p = ref_route.probs[differs].sort(dim=1, descending=True).values
        edge = min(top_k, E - 1)
        gaps = (sorted_p[:, :edge] - sorted_p[:, 1:edge + 1]).abs().min(dim=1).values
        assert (gaps < 1e-4).all(), f"rank {rank}: {int(differs.sum())} tokens routed differently without a near-tie"
    assert torch.equal(routing.counts.long(), torch.bincount(experts.flatten(), minlength=E))
    keep = reference.keep_mask(experts, E, reference.expert_capacity(T, top_k, E, capacity_factor))
    assert torch.equal(routing.row >= 0, keep), f"rank {rank}: capacity mask differs"
    # Each destination's stream: kept choices for its experts, rows 0..n-1 ordered by (local expert, token).
    owner = experts // L
    for dst in range(P):
        sel = keep & (owner == dst)
        rows = routing.row[sel].long()
        n = rows.numel()
        if n == 0:
            continue
        token = torch.arange(T, device=x.device).unsqueeze(1).expand_as(experts)[sel]
        order = torch.argsort((experts[sel] % L) * (T + 1) + token, stable=True)
        assert torch.equal(rows[order], torch.arange(n, device=x.device)), f"rank {rank} -> {dst}: stream order"
    expected = reference.moe_fixed_routing(x.float(), router.float(), w1_all.float(), w2_all.float(), experts, keep,
                                           activation=activation, normalize_topk=normalize)
    if T == 0:
        assert y.shape == (0, x.shape[1])
        return
    err = ((y.float() - expected).norm() / expected.norm().clamp_min(1e-12)).item()
    assert err < TOL[x.dtype], f"rank {rank}: relative error {err:.2e} >= {TOL[x.dtype]:.0e}"


def run_and_check(backend, team, xs, router, w1s, w2s, *, top_k, activation, normalize, capacity_factor):
    P = len(xs)
    ys = flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=top_k, activation=activation,
                                       normalize_topk=normalize, capacity_factor=capacity_factor, team=team)
    report = flashdmoe.last_report()
    flashdmoe.synchronize()  # waits, and raises the launch's error if it had one
    assert report.checked and report.ranks == tuple(range(P)) and report.error is None
    routings = report.routing
    assert len(routings) == P
    w1_all, w2_all = torch.cat(w1s), torch.cat(w2s)
    for r in range(P):
        check_rank(xs[r], router, w1_all, w2_all, ys[r], routings[r], rank=r, P=P, top_k=top_k,
                   activation=activation, normalize=normalize, capacity_factor=capacity_factor)
    # Payload: exactly the routed rows travel, and exactly their results come back.
    H, elt = xs[0].shape[1], xs[0].element_size()
    traffic = report.traffic()
    for entry in traffic:
        assert entry["dispatch_bytes"] == entry["rows_routed_remote"] * H * elt, entry
    total_sent = sum(e["dispatch_bytes"] for e in traffic)
    total_back = sum(e["combine_bytes"] for e in traffic)
    assert total_sent == total_back, "every remote row's result returns to its source"
    return ys


def ep_configs(n, seed=4321):
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        P = [2, 4, 8][i % 3]
        L = rng.choice([1, 2, 4, 8])
        E = P * L
        k = rng.randint(1, min(6, E))
        tokens = [rng.choice([0, 1, 5, 33, 128, 200, 777, 1500, 3000]) for _ in range(P)]
        if i % 4 == 0:
            tokens[rng.randrange(P)] = 0  # a rank with no tokens
        H = rng.choice([64, 128, 256, 512])
        I = rng.choice([64, 128, 192, 256])
        act = ACTIVATIONS[i % 4]
        dtype = [torch.bfloat16, torch.float16][(i // 3) % 2]
        normalize = rng.random() < 0.5
        cf = rng.choice([None, None, 0.5, 1.0, 1.5])
        skew = rng.choice([0.0, 0.0, 3.0])
        cases.append((P, tuple(tokens), H, I, E, k, act, dtype, normalize, cf, skew))
    return cases


@pytest.mark.parametrize("P,tokens,H,I,E,k,activation,dtype,normalize,capacity_factor,skew", ep_configs(24))
def test_emulated_against_reference(backend, P, tokens, H, I, E, k, activation, dtype, normalize, capacity_factor,
                                    skew):
    xs, router, w1s, w2s = make_inputs(list(tokens), H, I, E, P, activation, dtype, skew=skew)
    team = Team.emulated(P, max_tokens=max(max(tokens), 1), hidden=H, top_k=k, local_experts=E // P, dtype=dtype)
    run_and_check(backend, team, xs, router, w1s, w2s, top_k=k, activation=activation, normalize=normalize,
                  capacity_factor=capacity_factor)


CLUSTER_VARIANT = next(variant.name for variant in VARIANTS if variant.cluster == 2)


@pytest.mark.parametrize("P,tokens,H,I,E,k,activation,dtype,normalize,capacity_factor,skew", ep_configs(9, seed=77))
def test_emulated_on_the_cluster_variant(backend, monkeypatch, P, tokens, H, I, E, k, activation, dtype, normalize,
                                         capacity_factor, skew):
    """Two-block clusters inside each virtual rank's share of the grid (never split between ranks)."""
    monkeypatch.setattr(backend.debug, "expert_variant", CLUSTER_VARIANT)
    xs, router, w1s, w2s = make_inputs(list(tokens), H, I, E, P, activation, dtype, skew=skew)
    team = Team.emulated(P, max_tokens=max(max(tokens), 1), hidden=H, top_k=k, local_experts=E // P, dtype=dtype)
    run_and_check(backend, team, xs, router, w1s, w2s, top_k=k, activation=activation, normalize=normalize,
                  capacity_factor=capacity_factor)


def test_back_to_back_forwards_reuse_signals(backend):
    """Sequence numbers: the same team runs many forwards with no host-side clearing of its signals."""
    P, H, I, E, k = 4, 256, 128, 16, 2
    team = Team.emulated(P, max_tokens=1024, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    for step in range(5):
        tokens = [1024, 17 * step, 512, 1024 - 100 * step]
        xs, router, w1s, w2s = make_inputs(tokens, H, I, E, P, "gelu", torch.bfloat16)
        run_and_check(backend, team, xs, router, w1s, w2s, top_k=k, activation="gelu", normalize=True,
                      capacity_factor=None)


def test_bitwise_deterministic(backend):
    P, H, I, E, k = 4, 512, 256, 32, 4
    xs, router, w1s, w2s = make_inputs([2048, 1000, 3000, 7], H, I, E, P, "swiglu", torch.bfloat16)
    team = Team.emulated(P, max_tokens=3000, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    runs = [flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, activation="swiglu", team=team)
            for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_one_kernel_launch_per_forward(backend):
    from torch.profiler import ProfilerActivity, profile

    P, H, I, E, k = 4, 256, 256, 16, 2
    xs, router, w1s, w2s = make_inputs([512, 300, 0, 100], H, I, E, P, "gelu", torch.bfloat16)
    team = Team.emulated(P, max_tokens=512, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)
    backend.debug.poison_outputs = False
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)
            torch.cuda.synchronize()
    finally:
        backend.debug.poison_outputs = True
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memset" not in e.name.lower() and "memcpy" not in e.name.lower()]
    assert len(kernels) == 1 and "moe_forward_kernel" in kernels[0], kernels


@pytest.mark.parametrize("variant", [None, CLUSTER_VARIANT])
@pytest.mark.parametrize("silent", [0, 2])
def test_silent_rank_times_out_every_rank(backend, monkeypatch, variant, silent):
    """Debug mode (set_sync_checks): the forward itself raises. tests/test_async_status_gpu.py covers the
    default, where the same error surfaces at the team's next use or at flashdmoe.synchronize(). On the
    cluster variant the other ranks' blocks give up inside the expert phase, in pairs."""
    monkeypatch.setattr(backend.debug, "expert_variant", variant)
    P, H, I, E, k = 3 if silent == 2 else 2, 128, 128, 12, 2
    xs, router, w1s, w2s = make_inputs([256] * P, H, I, E, P, "gelu", torch.bfloat16)
    team = Team.emulated(P, max_tokens=256, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    backend.debug.silent_rank = silent
    backend.debug.timeout_ms = 300
    previous = flashdmoe.set_sync_checks(True)
    try:
        with pytest.raises(flashdmoe.KernelTimeout) as caught:
            flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)
    finally:
        flashdmoe.set_sync_checks(previous)
        backend.debug.silent_rank = -1
        backend.debug.timeout_ms = None
    message = str(caught.value)
    segments = message.split("; ")
    for r in range(P):
        mine = [s for s in segments if f"rank {r} timed out" in s]
        assert len(mine) == 1, message
        if r != silent:
            assert f"waiting on rank {silent}" in mine[0], message
    assert team.failed
    with pytest.raises(TeamFailed):
        flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)
    # The GPU is fine: a new team works.
    fresh = Team.emulated(P, max_tokens=256, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    run_and_check(backend, fresh, xs, router, w1s, w2s, top_k=k, activation="gelu", normalize=True,
                  capacity_factor=None)


def test_batch_larger_than_team_is_refused(backend):
    P, H, I, E, k = 2, 128, 128, 8, 2
    xs, router, w1s, w2s = make_inputs([300, 10], H, I, E, P, "gelu", torch.bfloat16)
    team = Team.emulated(P, max_tokens=256, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="max_tokens=256"):
        flashdmoe.moe_expert_parallel(xs, router, w1s, w2s, top_k=k, team=team)


@pytest.mark.parametrize("activation,capacity_factor", [("gelu", None), ("swiglu", 1.0), ("relu", None)])
def test_gradients_match_reference(backend, activation, capacity_factor):
    P, H, I, E, k = 4, 128, 128, 8, 2
    tokens = [300, 0, 129, 64]
    xs, router, w1s, w2s = make_inputs(tokens, H, I, E, P, activation, torch.bfloat16)
    team = Team.emulated(P, max_tokens=300, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in [router, *xs, *w1s, *w2s]]
    r_l, xs_l, w1_l, w2_l = leaves[0], leaves[1:1 + P], leaves[1 + P:1 + 2 * P], leaves[1 + 2 * P:]
    ys = flashdmoe.moe_expert_parallel(xs_l, r_l, w1_l, w2_l, top_k=k, activation=activation,
                                       capacity_factor=capacity_factor, team=team)
    dys = [torch.randn_like(y) for y in ys]
    sum((y.float() * dy.float()).sum() for y, dy in zip(ys, dys)).backward()
    ref_leaves = [t.detach().float().clone().requires_grad_() for t in [router, *xs, *w1s, *w2s]]
    rr, rxs, rw1, rw2 = ref_leaves[0], ref_leaves[1:1 + P], ref_leaves[1 + P:1 + 2 * P], ref_leaves[1 + 2 * P:]
    ref_ys = reference.moe_expert_parallel(rxs, rr, rw1, rw2, top_k=k, activation=activation,
                                           capacity_factor=capacity_factor)
    sum((y * dy.float()).sum() for y, dy in zip(ref_ys, dys)).backward()
    names = ["router"] + [f"x{r}" for r in range(P)] + [f"w1[{r}]" for r in range(P)] + [f"w2[{r}]" for r in range(P)]
    for got, want, name in zip(leaves, ref_leaves, names):
        if want.grad is None or want.grad.norm() == 0:
            assert got.grad is None or got.grad.float().norm() == 0, name
            continue
        err = ((got.grad.float() - want.grad).norm() / want.grad.norm()).item()
        assert err < numerics.backward_tolerance(torch.bfloat16), f"grad {name}: relative error {err:.2e}"


@pytest.mark.parametrize("variant", [None, "tma-wgmma-128x128-6stage-prefetch-abox16"])
@pytest.mark.parametrize("P,tokens", [(2, (1, 1)), (4, (1, 2, 8, 0)), (4, (32, 1, 128, 3))])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_decode_on_qwen3_layer(backend, monkeypatch, variant, P, tokens, activation):
    """Decode batches on Qwen3-30B-A3B's layer split over the team: the expert variant the public call
    picks per rank's share of the grid (None), and the narrow decode tile forced; split gate on."""
    monkeypatch.setattr(backend.debug, "expert_variant", variant)
    monkeypatch.setattr(backend.debug, "gate_split", None)
    H, I, E, k = 2048, 768, 128, 8
    xs, router, w1s, w2s = make_inputs(list(tokens), H, I, E, P, activation, torch.bfloat16)
    team = Team.emulated(P, max_tokens=max(tokens), hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
    run_and_check(backend, team, xs, router, w1s, w2s, top_k=k, activation=activation, normalize=True,
                  capacity_factor=None)
