"""The fused CUDA kernel against flashdmoe.reference (GPU only; skipped without a CUDA device).

Tolerances (norm-relative, ||y - ref|| / ||ref||): numerics.kernel_tolerance — the kernel rounds the
intermediate activation and the per-expert outputs to the input dtype, the reference stays in fp32.
Routing is compared with the reference's routing evaluated in float64 (an fp32 GPU matmul of the
reference rounds logits more than the kernel's fp32 tensor-core accumulation does: with E = 1024 it
flipped choices the kernel got right). It may differ only on near-ties (probability gap < 1e-4), where
the kernel's summation order may legitimately pick the other expert; outputs are then compared against
the reference evaluated on the kernel's routing.
"""

import math
import random

import pytest
import torch

import flashdmoe
from conftest import next_seed
from flashdmoe import numerics, reference
from flashdmoe.kernel.expert_variants import VARIANTS

# every test draws its inputs through next_seed(): the seed fixture prints its seed on failure
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("seed")]

TOL = {dtype: numerics.kernel_tolerance(dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)}
# fp32 inputs: the expert GEMMs run in TF32 (10-bit mantissa, hence TOL), the router GEMM in 3xTF32
# (fp32-accurate), so routing and combine weights are held to the same margins as 16-bit inputs.
ACTIVATIONS = ["relu", "gelu", "silu", "swiglu"]


@pytest.fixture(scope="module")
def backend():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        pytest.skip("fused kernel targets Hopper (sm_90a)")
    from flashdmoe import cuda_backend
    from flashdmoe.kernel import extension

    extension.load()  # a build failure on Hopper is a test failure, not a skip
    cuda_backend.debug.poison_outputs = True
    yield cuda_backend
    cuda_backend.debug.poison_outputs = False


def make_inputs(T, H, I, E, k, activation, dtype, *, seed=None, one_expert=False, hot=4.0):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed if seed is not None else next_seed())
    dev = "cuda"
    cols = 2 * I if activation == "swiglu" else I
    x = torch.randn(T, H, device=dev, generator=g).to(dtype)
    router = (torch.randn(E, H, device=dev, generator=g) / math.sqrt(H)).to(dtype)
    w1 = (torch.randn(E, H, cols, device=dev, generator=g) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, I, H, device=dev, generator=g) / math.sqrt(I)).to(dtype)
    if one_expert:
        x = x.abs()
        router[E // 2] = (torch.ones(H, device=dev) * (hot / math.sqrt(H))).to(dtype)
    return x, router, w1, w2


def check_against_reference(backend, x, router, w1, w2, *, top_k, activation, normalize, capacity_factor):
    T, E = x.shape[0], router.shape[0]
    y, routing = backend.fused_forward(
        x, router, w1, w2, top_k=top_k, activation=activation, normalize_topk=normalize,
        capacity_factor=capacity_factor,
    )
    flashdmoe.synchronize()  # waits, and raises the launch's error if it had one
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) or NaN output elements"
    ref_route = reference.route(x.double(), router.double(), top_k, normalize)
    kernel_experts = routing.expert.long()
    differs = (kernel_experts != ref_route.experts).any(dim=1)
    if differs.any():
        # Allowed only on near-ties of the reference probabilities.
        probs = ref_route.probs[differs]
        sorted_p = probs.sort(dim=1, descending=True).values
        edge = min(top_k, E - 1)  # adjacent pairs up to the k-th/(k+1)-th boundary
        gaps = (sorted_p[:, :edge] - sorted_p[:, 1 : edge + 1]).abs().min(dim=1).values
        assert (gaps < 1e-4).all(), f"{int(differs.sum())} tokens routed differently without a near-tie"
    # Near-ties are rare: at most 1% of the tokens, and one token in a batch of fewer than 200 (a batch of
    # 100 with one near-tied token once failed a bound of < 1%).
    assert int(differs.sum()) <= max(1, T // 100), f"{int(differs.sum())} of {T} tokens routed differently"
    # Weights on the kernel's routing.
    ref_probs = ref_route.probs.gather(1, kernel_experts)
    ref_w = ref_probs / ref_probs.sum(1, keepdim=True) if normalize else ref_probs
    torch.testing.assert_close(routing.weight, ref_w.float(), rtol=1e-4, atol=1e-5)
    # Counts and the capacity mask in token order, on the kernel's routing.
    counts = torch.bincount(kernel_experts.flatten(), minlength=E)
    assert torch.equal(routing.counts.long(), counts)
    cap = reference.expert_capacity(T, top_k, E, capacity_factor)
    keep = reference.keep_mask(kernel_experts, E, cap)
    assert torch.equal(routing.row >= 0, keep)
    # Rows: a permutation of the kept choices, grouped per expert.
    kept_rows = routing.row[keep]
    assert kept_rows.numel() == int(keep.sum())
    assert torch.equal(kept_rows.sort().values, torch.arange(kept_rows.numel(), device=x.device, dtype=kept_rows.dtype))
    expected = reference.moe_fixed_routing(
        x.float(), router.float(), w1.float(), w2.float(), kernel_experts, keep,
        activation=activation, normalize_topk=normalize,
    )
    err = ((y.float() - expected).norm() / expected.norm().clamp_min(1e-12)).item()
    assert err < TOL[x.dtype], f"relative error {err:.2e} >= {TOL[x.dtype]:.0e}"
    return y, routing


def random_configs(n, seed=1234):
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        E = rng.choice([8, 16, 32, 64, 128, 256])
        k = rng.randint(1, min(8, E))
        T = rng.choice([1, 3, 31, 32, 33, 127, 128, 129, 500, 1000, 2047, 4096, 5000, 20000])
        H = rng.choice([64, 128, 256, 512, 1024])
        I = rng.choice([64, 128, 192, 256, 512])
        act = ACTIVATIONS[i % 4]
        dtype = [torch.bfloat16, torch.float16, torch.float32][(i // 4) % 3]
        normalize = rng.random() < 0.5
        cf = rng.choice([None, None, 0.5, 1.0, 1.25, 2.0])
        cases.append((T, H, I, E, k, act, dtype, normalize, cf))
    return cases


@pytest.mark.parametrize("T,H,I,E,k,activation,dtype,normalize,capacity_factor", random_configs(44))
def test_random_configurations(backend, T, H, I, E, k, activation, dtype, normalize, capacity_factor):
    x, router, w1, w2 = make_inputs(T, H, I, E, k, activation, dtype)
    check_against_reference(backend, x, router, w1, w2, top_k=k, activation=activation, normalize=normalize,
                            capacity_factor=capacity_factor)


# Every compiled kernel instance (expert variant x dtype of flashdmoe/kernel/expert_variants.py), each on the
# same four shapes (one per activation): no variant is left to the default's tests.
INSTANCES = [(variant.name, dtype) for variant in VARIANTS for dtype in variant.dtypes]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VARIANT_SHAPES = [case[:6] + case[7:] for case in random_configs(4, seed=99)]  # the instance sets the dtype


@pytest.mark.parametrize("variant,dtype_name", INSTANCES)
@pytest.mark.parametrize("T,H,I,E,k,activation,normalize,capacity_factor", VARIANT_SHAPES)
def test_every_expert_variant(backend, monkeypatch, variant, dtype_name, T, H, I, E, k, activation, normalize,
                              capacity_factor):
    monkeypatch.setattr(backend.debug, "expert_variant", variant)
    x, router, w1, w2 = make_inputs(T, H, I, E, k, activation, DTYPES[dtype_name])
    check_against_reference(backend, x, router, w1, w2, top_k=k, activation=activation, normalize=normalize,
                            capacity_factor=capacity_factor)


@pytest.mark.parametrize("variant,dtype_name", [i for i in INSTANCES if i[1] != "fp32"])
@pytest.mark.parametrize("T,H,I,E,k,activation,normalize,capacity_factor", VARIANT_SHAPES)
def test_saved_pre_activations(backend, monkeypatch, variant, dtype_name, T, H, I, E, k, activation, normalize,
                               capacity_factor):
    """The forward that saves GEMM1's pre-activations for the backward: y bitwise the forward that does not;
    every kept row's pre = x_t @ W1_e (the accumulators rounded once); rows past the kept ones untouched."""
    monkeypatch.setattr(backend.debug, "expert_variant", variant)
    dtype = DTYPES[dtype_name]
    x, router, w1, w2 = make_inputs(T, H, I, E, k, activation, dtype)
    options = dict(top_k=k, activation=activation, normalize_topk=normalize, capacity_factor=capacity_factor)
    y_plain, _ = backend.fused_forward(x, router, w1, w2, **options)
    saved = torch.full((T * k, w1.shape[2]), float("nan"), dtype=dtype, device="cuda")
    y, routing = backend.fused_forward(x, router, w1, w2, saved_pre=saved, **options)
    flashdmoe.synchronize()
    assert torch.equal(y, y_plain), "saving pre-activations changed the forward's output"
    keep = routing.row >= 0
    rows, experts = routing.row[keep].long(), routing.expert[keep].long()
    tokens = keep.nonzero()[:, 0]
    want = torch.einsum("rh,rhc->rc", x[tokens].double(), w1[experts].double())
    got = saved[rows].double()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item() if rows.numel() else 0.0
    # one rounding to the storage format after a float32 sum over H terms
    assert err < numerics.rounding_tolerance(dtype, 1) + numerics.reorder_tolerance(torch.float32, H), \
        f"saved pre relative error {err:.2e}"
    untouched = torch.ones(T * k, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    assert torch.isnan(saved[untouched]).all(), "rows past the kept ones were written"


def test_saved_pre_activations_refused_for_a_bad_buffer(backend):
    x, router, w1, w2 = make_inputs(64, 128, 128, 8, 2, "gelu", torch.bfloat16)
    with pytest.raises(ValueError, match="saved_pre"):
        backend.fused_forward(x, router, w1, w2, top_k=2, activation="gelu", normalize_topk=True,
                              capacity_factor=None, saved_pre=torch.empty(64, 128, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_all_tokens_to_one_expert(backend, capacity_factor):
    x, router, w1, w2 = make_inputs(3000, 256, 128, 16, 2, "gelu", torch.bfloat16, one_expert=True)
    y, routing = check_against_reference(backend, x, router, w1, w2, top_k=2, activation="gelu", normalize=True,
                                         capacity_factor=capacity_factor)
    assert (routing.expert[:, 0] == 8).all()


def test_zero_tokens(backend):
    x, router, w1, w2 = make_inputs(0, 128, 128, 8, 2, "relu", torch.bfloat16)
    y = flashdmoe.moe(x, router, w1, w2, top_k=2, activation="relu", backend="cuda")
    assert y.shape == (0, 128)


@pytest.mark.parametrize("T,H,E,k", [(128, 4096, 64, 6), (100, 1024, 256, 8), (100, 1024, 1024, 8), (2048, 512, 32, 2),
                                     (33, 64, 8, 2), (1, 2048, 128, 8), (8, 2048, 128, 8), (32, 7168, 256, 8),
                                     (64, 2048, 512, 2), (1, 2048, 512, 10), (8, 2048, 512, 10)])
@pytest.mark.parametrize("split", [True, False])
def test_small_batches_split_the_gate(backend, T, H, E, k, split):
    """Few gate tiles, with the split gate forced on (each tile's K slabs split over several blocks, partial
    logits summed in split order by the tile's last block; the default) and forced off. Correct against the
    reference, and bitwise repeatable. E = 512 and 1024 run the shallow gate pipeline (it once misrouted
    whole tiles there when split: docs/perf-notes.md)."""
    backend.debug.gate_split = split
    try:
        x, router, w1, w2 = make_inputs(T, H, 128, E, k, "silu", torch.bfloat16)
        y, routing = check_against_reference(backend, x, router, w1, w2, top_k=k, activation="silu",
                                             normalize=True, capacity_factor=None)
        plan = backend.single_plan(x, router, w2, top_k=k, activation="silu", normalize_topk=True,
                                   capacity_factor=None)
        (ran,) = plan.prepared.splits
        if not split:
            assert ran["gate_splits"] == 1
        elif ran["blocks"] == 132:  # an H200's SMs: csrc/moe/tile_config.cuh splits all but a one-slab H
            assert (ran["gate_splits"] > 1) == (H > 64), ran
        for _ in range(3):
            again, again_routing = backend.fused_forward(x, router, w1, w2, top_k=k, activation="silu",
                                                         normalize_topk=True, capacity_factor=None)
            assert torch.equal(y, again)
            assert torch.equal(routing.weight, again_routing.weight)
    finally:
        backend.debug.gate_split = None


@pytest.mark.parametrize("T", [1, 3, 8, 9])
@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.25])
@pytest.mark.parametrize("one_expert", [False, True])
@pytest.mark.parametrize("split", [True, False])
def test_decode_batches_routed_in_the_gate(backend, T, capacity_factor, one_expert, split):
    """One rank, T <= 8: the block that finishes the gate tile (the split tile's last block, or block 0
    unsplit) also does the offsets pass and the dispatch (csrc/moe/dispatch.cuh route_gate_tile); T = 9
    takes the three phases. Routing, counts, dropped choices and y against the reference (a capacity of
    1 or 2 with every token on one hot expert drops most of its choices), and bitwise repeatable."""
    backend.debug.gate_split = split
    try:
        # The hot expert's logit ~0.4 sqrt(H) (~18) above the rest: at 4 / sqrt(H) it would be ~145 above, and
        # every other expert's float32 probability would underflow to an exact 0, a tie that the float64
        # reference breaks otherwise for every token.
        x, router, w1, w2 = make_inputs(T, 2048, 256, 128, 8, "swiglu", torch.bfloat16, one_expert=one_expert, hot=0.5)
        y, routing = check_against_reference(backend, x, router, w1, w2, top_k=8, activation="swiglu",
                                             normalize=True, capacity_factor=capacity_factor)
        if one_expert and T >= 2 and capacity_factor is not None:  # capacity 1 or 2 < T choices of one expert
            assert (routing.row < 0).any(), "the capacity drops choices"
        again, again_routing = backend.fused_forward(x, router, w1, w2, top_k=8, activation="swiglu",
                                                     normalize_topk=True, capacity_factor=capacity_factor)
        assert torch.equal(y, again) and torch.equal(routing.row, again_routing.row)
    finally:
        backend.debug.gate_split = None


@pytest.mark.parametrize("variant,dtype_name", INSTANCES)
def test_routed_decode_runs_no_offsets_or_dispatch_barrier(backend, monkeypatch, variant, dtype_name):
    """With the offsets or the dispatch barrier withheld (block 0 never arrives), a routed batch (T = 5)
    still finishes, correct, on every kernel instance: it runs neither barrier. T = 9 runs them and times
    out there."""
    monkeypatch.setattr(backend.debug, "expert_variant", variant)
    dtype = DTYPES[dtype_name]
    for phase in (2, 3):
        x, router, w1, w2 = make_inputs(5, 256, 128, 16, 4, "gelu", dtype)
        monkeypatch.setattr(backend.debug, "withhold_phase", phase)
        monkeypatch.setattr(backend.debug, "timeout_ms", 300)
        check_against_reference(backend, x, router, w1, w2, top_k=4, activation="gelu", normalize=True,
                                capacity_factor=None)
        x, router, w1, w2 = make_inputs(9, 256, 128, 16, 4, "gelu", dtype)
        flashdmoe.moe(x, router, w1, w2, top_k=4, activation="gelu", backend="cuda")
        report = flashdmoe.last_report()
        with pytest.raises(flashdmoe.KernelTimeout):
            flashdmoe.synchronize()
        assert report.error.timed_out and report.error.phase == phase
        monkeypatch.setattr(backend.debug, "withhold_phase", 0)
        monkeypatch.setattr(backend.debug, "timeout_ms", None)


def test_bitwise_deterministic(backend):
    x, router, w1, w2 = make_inputs(8192, 512, 256, 32, 4, "swiglu", torch.bfloat16)
    outs = [flashdmoe.moe(x, router, w1, w2, top_k=4, activation="swiglu", backend="cuda") for _ in range(4)]
    for other in outs[1:]:
        assert torch.equal(outs[0], other)


def test_one_kernel_launch_per_forward(backend):
    from torch.profiler import ProfilerActivity, profile

    x, router, w1, w2 = make_inputs(1024, 256, 256, 16, 2, "gelu", torch.bfloat16)
    flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")  # build + warm-up
    backend.debug.poison_outputs = False
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
            torch.cuda.synchronize()
    finally:
        backend.debug.poison_outputs = True
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memset" not in e.name.lower() and "memcpy" not in e.name.lower()]
    assert len(kernels) == 1 and "moe_forward_kernel" in kernels[0], kernels


# The two-block cluster variant (a task = two row tiles of one expert sharing each weight slab).
CLUSTER_VARIANT = next(variant.name for variant in VARIANTS if variant.cluster == 2)
CLUSTER_CASES = [case for case in random_configs(44) if case[6] != torch.float32][:18] + [
    (8192, 2048, 2048, 32, 2, "gelu", torch.bfloat16, True, None),  # the paper's shape: even tiles per expert
    (3000, 512, 512, 8, 2, "swiglu", torch.float16, False, 1.25),
    (777, 256, 192, 16, 3, "relu", torch.bfloat16, True, None),
]


@pytest.mark.parametrize("T,H,I,E,k,activation,dtype,normalize,capacity_factor", CLUSTER_CASES)
def test_cluster_variant_is_bitwise_the_default(backend, monkeypatch, T, H, I, E, k, activation, dtype, normalize,
                                                capacity_factor):
    """The same tiles, K order and epilogue as the default variant, two blocks to a task: the default's bits,
    also where an expert's odd number of row tiles pairs its last with an empty tile (that block writes
    nothing), and with the pre-activations saved."""
    x, router, w1, w2 = make_inputs(T, H, I, E, k, activation, dtype)
    options = dict(top_k=k, activation=activation, normalize_topk=normalize, capacity_factor=capacity_factor)
    monkeypatch.setattr(backend.debug, "expert_variant", VARIANTS[0].name)
    y_default, routing_default = backend.fused_forward(x, router, w1, w2, **options)
    monkeypatch.setattr(backend.debug, "expert_variant", CLUSTER_VARIANT)
    y, routing = check_against_reference(backend, x, router, w1, w2, top_k=k, activation=activation,
                                         normalize=normalize, capacity_factor=capacity_factor)
    assert torch.equal(y, y_default)
    assert torch.equal(routing.row, routing_default.row) and torch.equal(routing.expert, routing_default.expert)
    saved = torch.full((T * k, w1.shape[2]), float("nan"), dtype=dtype, device="cuda")
    y_saving, _ = backend.fused_forward(x, router, w1, w2, saved_pre=saved, **options)
    monkeypatch.setattr(backend.debug, "expert_variant", VARIANTS[0].name)
    saved_default = torch.full_like(saved, float("nan"))
    backend.fused_forward(x, router, w1, w2, saved_pre=saved_default, **options)
    flashdmoe.synchronize()
    assert torch.equal(y_saving, y_default)
    assert torch.equal(saved.isnan(), saved_default.isnan())
    assert torch.equal(saved.nan_to_num(), saved_default.nan_to_num())


@pytest.mark.parametrize("variant", [None, CLUSTER_VARIANT])
@pytest.mark.parametrize("phase,message", [(2, "per-expert offsets"), (5, "before the combine")])
def test_watchdog_timeout_raises_and_gpu_recovers(backend, monkeypatch, variant, phase, message):
    """Debug mode (set_sync_checks): the call raises. The default (raised later) is in
    tests/test_async_status_gpu.py. A barrier before the expert phase and one after it (a cluster
    variant's blocks leave the expert phase and meet again at the kernel's end)."""
    monkeypatch.setattr(backend.debug, "expert_variant", variant)
    x, router, w1, w2 = make_inputs(4096, 256, 256, 16, 2, "gelu", torch.bfloat16)
    backend.debug.withhold_phase = phase
    backend.debug.timeout_ms = 300
    previous = flashdmoe.set_sync_checks(True)
    try:
        with pytest.raises(flashdmoe.KernelTimeout, match=message):
            flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    finally:
        flashdmoe.set_sync_checks(previous)
        backend.debug.withhold_phase = 0
        backend.debug.timeout_ms = None
    check_against_reference(backend, x, router, w1, w2, top_k=2, activation="gelu", normalize=True,
                            capacity_factor=None)


def test_non_finite_input_is_rejected(backend):
    x, router, w1, w2 = make_inputs(256, 128, 128, 8, 2, "gelu", torch.bfloat16)
    x[17, 5] = float("nan")
    previous = flashdmoe.set_sync_checks(True)
    try:
        with pytest.raises(ValueError, match="NaN or Inf"):
            flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")
    finally:
        flashdmoe.set_sync_checks(previous)


def test_unsupported_shape_names_constraint(backend):
    x, router, w1, w2 = make_inputs(64, 96, 128, 8, 2, "gelu", torch.bfloat16)
    with pytest.raises(ValueError, match="H=96"):
        flashdmoe.moe(x, router, w1, w2, top_k=2, backend="cuda")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_gradients_match_reference(backend, activation, capacity_factor):
    T, H, I, E, k = 512, 128, 128, 8, 2
    x, router, w1, w2 = make_inputs(T, H, I, E, k, activation, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, router, w1, w2)]
    y, aux = flashdmoe.moe(*leaves, top_k=k, activation=activation, capacity_factor=capacity_factor,
                           backend="cuda", return_aux=True)
    dy = torch.randn_like(y)
    ((y.float() * dy.float()).sum() + aux.aux_loss).backward()
    ref_leaves = [t.detach().float().clone().requires_grad_() for t in (x, router, w1, w2)]
    ref_y, ref_aux = reference.moe(*ref_leaves, top_k=k, activation=activation, capacity_factor=capacity_factor,
                                   return_aux=True)
    ((ref_y * dy.float()).sum() + ref_aux.aux_loss).backward()
    assert torch.equal(aux.counts.cpu(), ref_aux.counts.cpu())
    assert int(aux.dropped) == int(ref_aux.dropped)
    for got, want, name in zip(leaves, ref_leaves, ["x", "router_weight", "w1", "w2"]):
        err = ((got.grad.float() - want.grad).norm() / want.grad.norm()).item()
        assert err < numerics.backward_tolerance(torch.bfloat16), f"grad {name}: relative error {err:.2e}"


def test_layer_uses_fused_kernel(backend):
    cfg = flashdmoe.MoEConfig(hidden=256, ffn=256, experts=16, top_k=2, tokens_per_rank=300, dtype="bfloat16")
    layer = flashdmoe.MoELayer(cfg).cuda()
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    ref = reference.moe(x, layer.router_weight, layer.w1, layer.w2, top_k=2, activation=cfg.activation)
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < numerics.kernel_tolerance(torch.bfloat16)


# Decode batches (T <= 128) on issue 15's decode layers: the narrow expert tile forced on every T (it is a
# correct path whatever the public call picks), and the public call's own choice of variant. The split
# gate is on (its default) throughout.
NARROW_VARIANT = "tma-wgmma-128x128-6stage-prefetch-abox16"
DECODE_LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "deepseek-v2-lite": (4096, 1408, 64, 6)}


@pytest.mark.parametrize("T", [1, 2, 8, 32, 128])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_decode_on_the_narrow_tile(backend, monkeypatch, T, activation, dtype, capacity_factor):
    monkeypatch.setattr(backend.debug, "expert_variant", NARROW_VARIANT)
    H, I, E, k = DECODE_LAYERS["qwen3-30b-a3b"]
    x, router, w1, w2 = make_inputs(T, H, I, E, k, activation, dtype)
    check_against_reference(backend, x, router, w1, w2, top_k=k, activation=activation, normalize=True,
                            capacity_factor=capacity_factor)


@pytest.mark.parametrize("layer", sorted(DECODE_LAYERS))
@pytest.mark.parametrize("T", [1, 2, 8, 32, 128])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_decode_as_the_public_call_picks(backend, monkeypatch, layer, T, activation):
    """The variant and gate split the public call picks per shape (the narrow tile at one token), and a
    second call bitwise the first (the split gate sums its partials in a fixed order)."""
    monkeypatch.setattr(backend.debug, "expert_variant", None)
    monkeypatch.setattr(backend.debug, "gate_split", None)
    H, I, E, k = DECODE_LAYERS[layer]
    x, router, w1, w2 = make_inputs(T, H, I, E, k, activation, torch.bfloat16)
    y, routing = check_against_reference(backend, x, router, w1, w2, top_k=k, activation=activation, normalize=True,
                                         capacity_factor=None)
    again, again_routing = backend.fused_forward(x, router, w1, w2, top_k=k, activation=activation,
                                                 normalize_topk=True, capacity_factor=None)
    assert torch.equal(y, again) and torch.equal(routing.weight, again_routing.weight)


def test_one_token_on_a_deep_ffn(backend, monkeypatch):
    """Mixtral's layer at T = 1: the narrow tile is picked for its 32 GEMM2 tasks, each 14336 deep."""
    from flashdmoe.kernel import expert_variants

    monkeypatch.setattr(backend.debug, "expert_variant", None)

    T, H, I, E, k = 1, 4096, 14336, 8, 2
    blocks = torch.cuda.get_device_properties(0).multi_processor_count
    assert expert_variants.choose_variant(T, H, I, E, k, "swiglu", blocks) == NARROW_VARIANT
    x, router, w1, w2 = make_inputs(T, H, I, E, k, "swiglu", torch.bfloat16)
    check_against_reference(backend, x, router, w1, w2, top_k=k, activation="swiglu", normalize=True,
                            capacity_factor=None)


@pytest.mark.parametrize("variant", ["tma-wgmma-128x256-4stage-prefetch", NARROW_VARIANT])
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu", "silu"])
@pytest.mark.parametrize("save_pre", [False, True])
def test_small_tile_epilogue_is_bitwise_the_warp_epilogue(backend, monkeypatch, variant, activation, save_pre):
    """GEMM1 tiles of at most 16 rows spread their activation over every warp (csrc/moe/epilogue.cuh): the
    same values as leaving it to the warp that holds the rows, for every activation, both TMA variants,
    with and without the saved pre-activations. 96 tokens x 6 choices over 64 experts, capacity 12 per
    expert (some choices dropped): every tile has at most 12 rows; a partial last column tile (I = 384)."""
    monkeypatch.setattr(backend.debug, "expert_variant", variant)
    T, H, I, E, k = 96, 512, 384, 64, 6
    x, router, w1, w2 = make_inputs(T, H, I, E, k, activation, torch.bfloat16)
    options = dict(top_k=k, activation=activation, normalize_topk=True, capacity_factor=1.25)
    outputs = {}
    for spread in (True, False):
        monkeypatch.setattr(backend.debug, "small_tile_epilogue", spread)
        saved = torch.full((T * k, w1.shape[2]), float("nan"), dtype=x.dtype, device="cuda") if save_pre else None
        y, routing = backend.fused_forward(x, router, w1, w2, saved_pre=saved, **options)
        flashdmoe.synchronize()
        outputs[spread] = (y, saved)
    assert torch.equal(outputs[True][0], outputs[False][0]), "the small-tile epilogue changed y"
    if save_pre:
        assert torch.equal(outputs[True][1].nan_to_num(7.0), outputs[False][1].nan_to_num(7.0))
    check_against_reference(backend, x, router, w1, w2, top_k=k, activation=activation, normalize=True,
                            capacity_factor=1.25)
