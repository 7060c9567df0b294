"""NaN / Inf in router_weight, w1, w2: ValueError naming the weight, scanned once per version of a weight
(flashdmoe.weight_checks), through flashdmoe.moe, moe_expert_parallel, MoELayer and the registered op.

On the CPU and the reference backend the scan raises at the call; fused CUDA forwards queue it and its
error surfaces where the kernel's do (the GPU tests below; tests/test_host_path.py drives the same
state machine on the CPU)."""

from __future__ import annotations

import math

import pytest
import torch

import flashdmoe
from flashdmoe import ops, reference, weight_checks
from flashdmoe.config import MoEConfig

T, H, I, E, K = 6, 8, 12, 4, 2
WEIGHTS = ("router_weight", "w1", "w2")


def random_inputs(seed: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32, sizes=(T, H, I, E)):
    tokens, hidden, ffn, experts = sizes
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    return {"x": randn(tokens, hidden), "router_weight": randn(experts, hidden, scale=hidden ** -0.5),
            "w1": randn(experts, hidden, ffn, scale=hidden ** -0.5), "w2": randn(experts, ffn, hidden, scale=ffn ** -0.5)}


#: A shape the fused kernel runs (tests/test_async_status_gpu.py uses it).
KERNEL_SIZES = (256, 128, 128, 8)


def poison(tensor: torch.Tensor, value: float, seed: int) -> None:
    """Write ``value`` into one seeded element of ``tensor`` in place (bumps its version counter)."""
    index = torch.randint(tensor.numel(), (1,), generator=torch.Generator().manual_seed(seed)).item()
    tensor.view(-1)[index] = value


def call(inputs, **options):
    return flashdmoe.moe(inputs["x"], inputs["router_weight"], inputs["w1"], inputs["w2"], top_k=K, **options)


@pytest.fixture(autouse=True)
def fresh_cache():
    weight_checks.forget()
    yield
    weight_checks.forget()


@pytest.fixture
def fused():
    """The fused kernel (Hopper), with errors reported asynchronously (the default) during the test."""
    from flashdmoe.kernel import extension

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fused kernel targets Hopper (sm_90a)")
    extension.load()  # a build failure on Hopper is a test failure, not a skip
    previous = flashdmoe.set_sync_checks(False)
    yield
    flashdmoe.set_sync_checks(previous)
    try:
        flashdmoe.synchronize()
    except ValueError:  # a failing test's unchecked scan must not leak into the next test
        pass


@pytest.fixture
def scans(monkeypatch):
    """The tensors each scan reduced, in order (one list per scan)."""
    seen: list[list[torch.Tensor]] = []
    original = weight_checks._extremes

    def spy(tensors):
        seen.append(list(tensors))
        return original(tensors)

    monkeypatch.setattr(weight_checks, "_extremes", spy)
    return seen


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", WEIGHTS)
def test_non_finite_weight_is_named(seed, name, value):
    inputs = random_inputs(seed)
    poison(inputs[name], value, seed)
    with pytest.raises(ValueError, match=rf"^{name}: contains 1 non-finite value\(s\) \(NaN or Inf\)"):
        call(inputs, backend="reference")


def test_clean_weights_give_the_reference_output(seed):
    inputs = random_inputs(seed)
    want = reference.moe(inputs["x"], inputs["router_weight"], inputs["w1"], inputs["w2"], top_k=K)
    assert torch.equal(call(inputs, backend="reference"), want)


def test_weights_are_scanned_once_per_version(seed, scans):
    inputs = random_inputs(seed)
    call(inputs)
    assert [len(scan) for scan in scans] == [3], "one scan of the three weights, one host synchronisation"
    for _ in range(3):
        call(inputs)
    inputs["x"] = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1))
    call(inputs)
    assert len(scans) == 1, "steady state: weights already seen are not scanned again"
    with torch.no_grad():
        inputs["w2"].mul_(0.5)  # a finite in-place update: only w2 is scanned again
    call(inputs)
    assert len(scans) == 2 and len(scans[1]) == 1 and scans[1][0] is inputs["w2"]


def test_in_place_write_after_a_clean_call_is_caught(seed):
    inputs = random_inputs(seed)
    call(inputs)
    poison(inputs["w1"][1], math.nan, seed)  # through a view: views share the version counter
    with pytest.raises(ValueError, match=r"^w1: contains 1 non-finite"):
        call(inputs)


def test_write_through_data_needs_forget(seed):
    inputs = random_inputs(seed)
    call(inputs)
    # in an expert a token chose (an unchosen one's inf would not reach y); .data has a version counter
    # of its own: not seen
    chosen = int(reference.route(inputs["x"], inputs["router_weight"], K, True).experts[0, 0])
    poison(inputs["w2"].data[chosen], math.inf, seed)
    assert not torch.isfinite(call(inputs)).all()
    weight_checks.forget()
    with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):
        call(inputs)


@pytest.mark.parametrize("kind", ["for-loop", "foreach", "fused"])
def test_optimizer_step_forgets_what_was_seen(seed, kind):
    """Fused optimizers update parameters in place without bumping their version counters."""
    config = MoEConfig(hidden=H, ffn=I, experts=E, top_k=K, tokens_per_rank=T, seed=seed)
    layer = flashdmoe.MoELayer(config)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed))
    layer(x).sum().backward()
    options = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[kind]
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1, **options)
    layer.w1.grad[0, 0, 0] = math.nan
    version = layer.w1._version
    optimizer.step()
    assert not torch.isfinite(layer.w1).all()
    if kind == "fused":
        assert layer.w1._version == version, "fused steps leave the version counter alone"
    with pytest.raises(ValueError, match=r"^w1: contains 1 non-finite"):
        layer(x)


def test_a_recycled_address_is_scanned_again(seed, monkeypatch):
    """A weight freed and a new one allocated at its address with the same metadata and version: the
    entry's storage has expired, so the new tensor is scanned."""
    inputs = random_inputs(seed)
    key = ("same address", 0)
    monkeypatch.setattr(weight_checks, "_key", lambda tensor: key)
    weight_checks.check_finite_weights([("w1", inputs["w1"])])
    assert not weight_checks._seen[key].expired()
    del inputs["w1"]
    assert weight_checks._seen[key].expired()
    bad = torch.full((E, H, I), math.nan)
    with pytest.raises(ValueError, match=r"^w1: contains 384 non-finite"):
        weight_checks.check_finite_weights([("w1", bad)])


def test_cache_is_bounded(seed, monkeypatch):
    """Full: entries whose storage was freed go first; if none was, everything is forgotten."""
    monkeypatch.setattr(weight_checks, "LIMIT", 4)
    generator = torch.Generator().manual_seed(seed)
    alive = [torch.randn(3, generator=generator) for _ in range(5)]
    for tensor in alive[:3]:
        weight_checks.check_finite_weights([("w", tensor)])
    weight_checks.check_finite_weights([("w", torch.randn(3, generator=generator))])  # freed after the call
    assert len(weight_checks._seen) == 4
    weight_checks.check_finite_weights([("w", alive[3])])
    assert len(weight_checks._seen) == 4 and not any(ref.expired() for ref in weight_checks._seen.values())
    weight_checks.check_finite_weights([("w", alive[4])])
    assert list(weight_checks._seen) == [weight_checks._key(alive[4])]


def test_huge_finite_weights_are_not_a_false_alarm(scans):
    """Two bfloat16 maxima overflow a float32 sum; the exact count finds no non-finite element."""
    w = torch.full((2, 2, 2), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    weight_checks.check_finite_weights([("w1", w)])
    weight_checks.check_finite_weights([("w1", w)])
    assert len(scans) == 1, "a false alarm is remembered as finite"


def test_inference_tensors_are_checked_and_remembered(seed, scans):
    with torch.inference_mode():
        inputs = random_inputs(seed)
        call(inputs)
        call(inputs)
        assert len(scans) == 1
        poison(inputs["router_weight"], math.nan, seed)
        weight_checks.forget()  # inference tensors have no version counter
        with pytest.raises(ValueError, match=r"^router_weight: contains 1 non-finite"):
            call(inputs)


def test_expert_parallel_names_the_rank_shard(seed):
    inputs = random_inputs(seed)
    xs = list(inputs["x"].split([2, 4]))
    w1s, w2s = list(inputs["w1"].split(2)), list(inputs["w2"].split(2))
    flashdmoe.moe_expert_parallel(xs, inputs["router_weight"], w1s, w2s, top_k=K)
    poison(w2s[1], math.nan, seed)
    with pytest.raises(ValueError, match=r"^w2s\[1\]: contains 1 non-finite"):
        flashdmoe.moe_expert_parallel(xs, inputs["router_weight"], w1s, w2s, top_k=K)


def test_registered_op_checks_eager_and_compiled(seed):
    inputs = random_inputs(seed)
    poison(inputs["w2"], math.nan, seed)
    arguments = (inputs["x"], inputs["router_weight"], inputs["w1"], inputs["w2"])
    with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):
        ops.moe(*arguments, top_k=K)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *tensors: ops.moe(*tensors, top_k=K), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):
        compiled(*arguments)


# -- GPU ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", WEIGHTS)
def test_cuda_weights_raise_at_the_call_then_cost_no_scan(seed, name, scans):
    """On CUDA tensors the first call scans and raises at the call (not at a later status check, as the
    kernel's own flags do); later calls with the same weights scan nothing. The check sits in front of
    both backends; the reference runs any shape."""
    inputs = random_inputs(seed, device="cuda", dtype=torch.bfloat16)
    call(inputs, backend="reference")
    call(inputs, backend="reference")
    assert len(scans) == 1
    poison(inputs[name], math.nan, seed)
    with pytest.raises(ValueError, match=rf"^{name}: contains 1 non-finite"):
        call(inputs, backend="reference")
    assert len(scans) == 2


@pytest.mark.gpu
def test_fused_forward_with_new_or_seen_weights_does_not_synchronise(fused, seed, scans):
    """The fused forward's promise (no host synchronisation) holds for new weights too: their scan is
    queued, not waited for."""
    call(random_inputs(seed + 1, device="cuda", dtype=torch.bfloat16, sizes=KERNEL_SIZES), backend="cuda")
    flashdmoe.synchronize()  # the warm-up: the device's first forward allocates its pinned status slots
    inputs = random_inputs(seed, device="cuda", dtype=torch.bfloat16, sizes=KERNEL_SIZES)
    scans.clear()
    busy = []
    for _ in range(3):
        torch.cuda._sleep(1_000_000_000)  # the GPU stays busy well past the next call
        call(inputs, backend="cuda")
        busy.append(not torch.cuda.current_stream().query())
        flashdmoe.synchronize()
        with torch.no_grad():
            inputs["w1"].mul_(0.5)  # a new version: scanned at the next forward
    assert busy == [True, True, True], "a forward waited for the GPU"
    assert len(scans) == 3 and all(len(scan) in (1, 3) for scan in scans)


@pytest.mark.gpu
@pytest.mark.parametrize("name", WEIGHTS)
def test_fused_scan_error_names_the_weight_at_synchronize(fused, seed, name):
    inputs = random_inputs(seed, device="cuda", dtype=torch.bfloat16, sizes=KERNEL_SIZES)
    call(inputs, backend="cuda")
    flashdmoe.synchronize()
    poison(inputs[name], math.nan, seed)
    torch.cuda._sleep(1_000_000_000)
    call(inputs, backend="cuda")  # returns while the GPU is busy: nothing raised yet
    busy = not torch.cuda.current_stream().query()
    with pytest.raises(ValueError, match=rf"^{name}: contains 1 non-finite value\(s\) \(NaN or Inf\)"):
        flashdmoe.synchronize()
    assert busy
    if name == "router_weight":  # the launch that ran on it also flagged its logits, raised once after
        with pytest.raises(ValueError, match="router logits contain NaN or Inf"):
            flashdmoe.synchronize()
    flashdmoe.synchronize()


@pytest.mark.gpu
def test_fused_scan_errors_surface_at_the_documented_points(fused, seed):
    """The next call (before its launch), check_errors, and the call itself in debug mode; after each error
    the weight is forgotten, so the next forward with it scans, and fails, again."""
    inputs = random_inputs(seed, device="cuda", dtype=torch.bfloat16, sizes=KERNEL_SIZES)
    poison(inputs["w2"], math.inf, seed)
    call(inputs, backend="cuda")
    launched = flashdmoe.last_report().launch_id
    torch.cuda.synchronize()  # the scan has finished: the next forward raises its error
    with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):
        call(inputs, backend="cuda")
    assert flashdmoe.last_report().launch_id == launched, "the call that raised launched nothing"
    call(inputs, backend="cuda")
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):
        flashdmoe.check_errors()
    flashdmoe.check_errors()  # raised once
    previous = flashdmoe.set_sync_checks(True)
    try:
        with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):
            call(inputs, backend="cuda")
        assert flashdmoe.last_report().launch_id == launched + 2, "debug mode raises after the launch"
    finally:
        flashdmoe.set_sync_checks(previous)
    flashdmoe.synchronize()


@pytest.mark.gpu
def test_training_steps_scan_without_waiting_and_catch_a_nan_step(fused, seed):
    """Every optimizer step forgets the scans (fused optimizers do not bump versions); the forward after
    it scans again without waiting, and a step that wrote NaN is reported at synchronize."""
    config = MoEConfig(hidden=KERNEL_SIZES[1], ffn=KERNEL_SIZES[2], experts=KERNEL_SIZES[3], top_k=K,
                       tokens_per_rank=KERNEL_SIZES[0], seed=seed, dtype="bfloat16")
    layer = flashdmoe.MoELayer(config, device="cuda")
    layer.backend = "cuda"
    x = random_inputs(seed, device="cuda", dtype=torch.bfloat16, sizes=KERNEL_SIZES)["x"]
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3, fused=True)
    busy = []
    for _ in range(3):
        layer(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        flashdmoe.synchronize()
        torch.cuda._sleep(1_000_000_000)
        layer(x)
        busy.append(not torch.cuda.current_stream().query())
        flashdmoe.synchronize()
    assert busy == [True, True, True], "the forward after an optimizer step waited for the GPU"
    layer(x).float().square().mean().backward()
    layer.w1.grad.view(-1)[7] = math.nan
    optimizer.step()
    layer(x)
    with pytest.raises(ValueError, match=r"^w1: contains 1 non-finite"):
        flashdmoe.synchronize()


@pytest.mark.gpu
def test_capture_skips_the_scan_and_the_next_eager_call_makes_it(fused, seed, scans):
    """Weights first used inside a CUDA-graph capture are not scanned (a capture cannot queue a check
    that is read later); the capture succeeds, and the next eager call with them queues the scan, whose
    error surfaces at synchronize."""
    warm = random_inputs(seed, device="cuda", dtype=torch.bfloat16, sizes=KERNEL_SIZES)
    bad = random_inputs(seed + 1, device="cuda", dtype=torch.bfloat16, sizes=KERNEL_SIZES)
    poison(bad["w1"], math.nan, seed)
    bad["x"] = warm["x"]
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call(warm, backend="cuda")  # the eager warm-up a capture needs
        torch.cuda.current_stream().wait_stream(side)
        flashdmoe.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call(bad, backend="cuda")
        assert len(scans) == 1, "nothing was scanned inside the capture"
        call(bad, backend="cuda")
        assert len(scans) == 2
    with pytest.raises(ValueError, match=r"^w1: contains 1 non-finite"):
        flashdmoe.synchronize()
