"""The per-call host path of the fused forward, on the CPU (tests/fake_cuda.py stands in for the extension).

* flashdmoe.api remembers call signatures: a remembered call skips the checks and the launch planning,
  but any input a check reads that changed (shape, dtype, contiguity, device, weight values / versions,
  option types, debug knobs) makes the call go through the checks again.
* flashdmoe.weight_checks scans new weights asynchronously for fused forwards: the error names the weight
  and surfaces at the points flashdmoe.kernel.status_checks documents (next call, check_errors, synchronize,
  debug mode at the call).

tests/test_weight_checks.py covers the synchronous scans (reference backend, CPU) and, on the GPU, the
asynchronous ones against the real kernel.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import flashdmoe
from fake_cuda import fake_cuda, status_block
from flashdmoe import api, cuda_backend, reference, validation, weight_checks
from flashdmoe.kernel import status_checks

H, I, E, K = 64, 64, 8, 2


def inputs(seed: int, tokens: int = 16, dtype=torch.bfloat16, ffn: int = I):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    router = (torch.randn(E, H, generator=g) / H ** 0.5).to(dtype)
    w1 = (torch.randn(E, H, ffn, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, ffn, H, generator=g) / ffn ** 0.5).to(dtype)
    return x, router, w1, w2


def forward(x, router, w1, w2, **options):
    with torch.no_grad():
        return flashdmoe.moe(x, router, w1, w2, top_k=options.pop("top_k", K), backend="cuda", **options)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(cuda_backend.debug, "timeout_ms", None)
    with fake_cuda(monkeypatch) as parts:
        yield parts


@pytest.fixture
def checks(monkeypatch):
    """Every call of the full input checks (flashdmoe.validation.validate_moe_inputs), by x's shape."""
    seen = []
    real = api.validate_moe_inputs

    def counting(x, *args, **kwargs):
        seen.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(api, "validate_moe_inputs", counting)
    return seen


def poison(tensor: torch.Tensor, seed: int, value: float = math.nan) -> None:
    index = torch.randint(tensor.numel(), (1,), generator=torch.Generator().manual_seed(seed)).item()
    tensor.view(-1)[index] = value


# ------------------------------------------------------------------------------------------------------------
# Remembered calls


def test_a_repeated_call_skips_the_checks_and_the_planning(fake, checks, seed):
    ext, _, _ = fake
    x, router, w1, w2 = inputs(seed)
    first = forward(x, router, w1, w2)
    for step in range(3):
        forward(inputs(seed + 1 + step)[0], router, w1, w2)  # new activations, same shapes and weights
    assert checks == [(16, H)] and len(ext.prepared) == 1 and len(ext.launches) == 4
    assert len(ext.scan_events) == 1, "the weights were scanned once"
    assert first.shape == x.shape and first.dtype == x.dtype


def test_a_new_shape_is_checked_and_planned(fake, checks, seed):
    ext, _, _ = fake
    x, router, w1, w2 = inputs(seed)
    forward(x, router, w1, w2)
    forward(x[:5], router, w1, w2)
    assert checks == [(16, H), (5, H)] and len(ext.prepared) == 2
    assert [p[1][0]["tokens"] for p in ext.prepared] == [16, 5]
    forward(x, router, w1, w2)
    assert len(checks) == 2, "both signatures stay remembered"
    with pytest.raises(ValueError, match=r"^x: expected a 2-D tensor"):
        forward(x[None], router, w1, w2)


def test_changed_dtype_contiguity_or_device_is_refused(fake, seed):
    x, router, w1, w2 = inputs(seed)
    forward(x, router, w1, w2)
    with pytest.raises(ValueError, match=r"^router_weight: dtype torch.bfloat16 differs from x's dtype torch.float16"):
        forward(x.half(), router, w1, w2)
    with pytest.raises(ValueError, match=r"^x: tensor of shape \[16, 64\] is not contiguous"):
        forward(x.t().contiguous().t(), router, w1, w2)
    with pytest.raises(ValueError, match=r"^router_weight: on device cpu but x is on meta"):
        forward(x.to("meta"), router, w1, w2)  # meta stands for another device here
    forward(x, router, w1, w2)


def test_weight_metadata_changed_in_place_is_refused(fake, seed):
    """``.data =`` keeps the address and the version counter but not the layout: still checked."""
    x, router, w1, w2 = inputs(seed)  # H == I: a transposed w1 has w1's shape
    forward(x, router, w1, w2)
    pointer, version = w1.data_ptr(), w1._version
    w1.data = w1.data.transpose(1, 2)
    assert (w1.data_ptr(), w1._version, tuple(w1.shape)) == (pointer, version, (E, H, I))
    with pytest.raises(ValueError, match=r"^w1: tensor of shape \[8, 64, 64\] is not contiguous"):
        forward(x, router, w1, w2)
    w1.data = w1.data.transpose(1, 2)
    forward(x, router, w1, w2)
    w2.data = w2.data.view(torch.float16)  # same bytes, another dtype
    with pytest.raises(ValueError, match=r"^w2: dtype torch.float16 differs from x's dtype"):
        forward(x, router, w1, w2)


@pytest.mark.parametrize("name, value", [("top_k", True), ("normalize_topk", 1), ("return_aux", 0)])
def test_an_option_equal_to_a_remembered_one_but_of_another_type_is_refused(fake, seed, name, value):
    x, router, w1, w2 = inputs(seed)
    remembered = {"top_k": 1, "normalize_topk": True, "return_aux": False}
    forward(x, router, w1, w2, **remembered)
    with pytest.raises(ValueError, match=rf"{name}={value!r}"):
        forward(x, router, w1, w2, **{**remembered, name: value})


def test_debug_knobs_change_the_plan(fake, seed):
    ext, _, _ = fake
    x, router, w1, w2 = inputs(seed)
    forward(x, router, w1, w2)
    cuda_backend.debug.max_blocks = 4
    try:
        forward(x, router, w1, w2)
    finally:
        cuda_backend.debug.max_blocks = 0
    forward(x, router, w1, w2)
    assert [p[0]["max_blocks"] for p in ext.prepared] == [0, 4, 0]


def test_an_in_place_write_after_remembered_calls_is_scanned(fake, seed):
    ext, _, _ = fake
    x, router, w1, w2 = inputs(seed)
    for _ in range(3):
        forward(x, router, w1, w2)
    poison(w1[2], seed)  # through a view: views share the version counter
    forward(x, router, w1, w2)
    assert len(ext.scan_events) == 2
    with pytest.raises(ValueError, match=r"^w1: contains 1 non-finite"):
        flashdmoe.synchronize()


def test_inference_tensor_weights_are_remembered(fake, checks, seed):
    """Inference tensors have no version counter (weight_checks keys them as version -1)."""
    with torch.inference_mode():
        x, router, w1, w2 = inputs(seed)
        for _ in range(3):
            forward(x, router, w1, w2)
    assert len(checks) == 1 and len(fake[0].scan_events) == 1


def test_a_call_with_new_weight_objects_on_live_storage_is_remembered(fake, checks, seed):
    """Views made per call (a common model pattern) reach the same signature: their storage is alive."""
    x, router, w1, w2 = inputs(seed)
    for _ in range(3):
        forward(x, router.view(E, H), w1.view(E, H, I), w2.view(E, I, H))
    assert len(checks) == 1


def test_a_call_on_freed_weights_is_not_remembered(seed):
    """The addresses in a signature may be recycled once the weights are freed: the entry no longer holds."""
    _, router, w1, w2 = inputs(seed)
    call = api._Call(K, None, None, cuda_backend, weight_checks.epoch(), (router, w1, w2), False)
    assert call.holds(router, w1, w2)
    clones = [router.clone(), w1.clone(), w2.clone()]
    assert call.holds(*clones), "other objects, but the storages seen are alive"
    del router, w1, w2
    assert not call.holds(*clones)


def test_streams_and_devices_are_asked_at_every_call(fake, monkeypatch, seed):
    ext, _, _ = fake
    x, router, w1, w2 = inputs(seed)
    forward(x, router, w1, w2)
    forward(x, router, w1, w2)
    monkeypatch.setattr(cuda_backend, "_current_stream_handle", lambda index: 8)
    forward(x, router, w1, w2)
    assert [launch["stream"] for launch in ext.launches] == [7, 7, 8]
    assert ext.launches[0]["workspace"] == ext.launches[1]["workspace"] != ext.launches[2]["workspace"]
    # x's device is not the current one: the launch runs under a guard switching to x's device.
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        monkeypatch.setattr(cuda_backend, "_current_device", lambda: index)
        yield
        monkeypatch.setattr(cuda_backend, "_current_device", lambda: 3)

    monkeypatch.setattr(cuda_backend, "_current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "device", device)
    forward(x, router, w1, w2)
    assert entered == [x.device.index] and len(ext.launches) == 4


def test_remembered_calls_give_the_reference_routing_and_aux(fake, seed):
    """The remembered path returns what the full path returns (the fake writes no y: check what it
    returns around it: aux from the routing, shapes, dtypes)."""
    ext, _, _ = fake
    x, router, w1, w2 = inputs(seed)
    forward(x, router, w1, w2, return_aux=True)
    y, aux = forward(x, router, w1, w2, return_aux=True)
    assert y.shape == x.shape and aux.counts.shape == (E,) and aux.counts.dtype == torch.int64
    routing = flashdmoe.last_report().routing[0]
    assert torch.equal(aux.counts, routing.counts.long())
    assert ext.launches[-1]["addresses"][:4] == [router.data_ptr(), x.data_ptr(), w1.data_ptr(), w2.data_ptr()]


def test_the_cpu_input_scan_still_runs_on_a_remembered_call(fake, seed):
    """CPU tensors (only here, on the fake) scan x at every call."""
    x, router, w1, w2 = inputs(seed)
    forward(x, router, w1, w2)
    bad = x.clone()
    poison(bad, seed)
    with pytest.raises(ValueError, match=r"^x: contains 1 non-finite"):
        forward(bad, router, w1, w2)


def test_autograd_calls_use_the_remembered_checks(fake, checks, seed):
    x, router, w1, w2 = inputs(seed)
    leaves = [t.clone().requires_grad_() for t in (x, router, w1, w2)]
    flashdmoe.moe(*leaves, top_k=K, backend="cuda")
    y = flashdmoe.moe(*leaves, top_k=K, backend="cuda")
    assert y.grad_fn is not None and len(checks) == 1


# ------------------------------------------------------------------------------------------------------------
# Asynchronous weight scans


@pytest.fixture
def slow_scans(fake):
    """Scans that run until the test completes their events (launches finish at once)."""
    ext, events, synchronized = fake
    ext.scans_finish_at_once = False
    ext.finish_at_once = True
    return fake


def test_a_scan_is_queued_not_waited_for(slow_scans, seed):
    ext, _, _ = slow_scans
    x, router, w1, w2 = inputs(seed)
    poison(w1, seed)
    forward(x, router, w1, w2)  # returns: nothing waited for the scan
    (scan,) = ext.scan_events
    assert scan.waits == 0 and len(ext.launches) == 1
    flashdmoe.check_errors()  # still running: nothing raised
    forward(x, router, w1, w2)
    assert len(ext.scan_events) == 1 and len(ext.launches) == 2, "remembered as checked while it runs"
    scan.done = True
    with pytest.raises(ValueError, match=r"^w1: contains 1 non-finite value\(s\) \(NaN or Inf\).*fused forward"):
        flashdmoe.check_errors()
    flashdmoe.check_errors()  # raised once


def test_a_failed_scan_surfaces_at_the_next_call_before_its_launch(slow_scans, seed):
    ext, _, _ = slow_scans
    x, router, w1, w2 = inputs(seed)
    poison(router, seed, math.inf)
    forward(x, router, w1, w2)
    ext.scan_events[0].done = True
    with pytest.raises(ValueError, match=r"^router_weight: contains 1 non-finite"):
        forward(x, router, w1, w2)
    assert len(ext.launches) == 1, "the call that raised launched nothing"
    # Forgotten after its error: the next forward with it is scanned, and fails, again.
    forward(x, router, w1, w2)
    assert len(ext.scan_events) == 2 and len(ext.launches) == 2
    ext.scan_events[1].done = True
    with pytest.raises(ValueError, match=r"^router_weight: contains 1 non-finite"):
        forward(x, router, w1, w2)


def test_a_scan_done_before_its_forward_launches_surfaces_at_the_next_call(fake, seed):
    # A fast GPU may finish a call's scan before that call's pre-launch poll: it still launches.
    ext, _, _ = fake
    ext.scans_finish_at_once = True
    ext.finish_at_once = True
    x, router, w1, w2 = inputs(seed)
    poison(w2, seed)
    forward(x, router, w1, w2)
    assert len(ext.launches) == 1 and ext.scan_events[0].query()
    with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):
        forward(x, router, w1, w2)
    assert len(ext.launches) == 1, "the call that raised launched nothing"


def test_synchronize_waits_for_a_scan(slow_scans, seed):
    ext, _, synchronized = slow_scans
    x, router, w1, w2 = inputs(seed)
    poison(w2, seed, -math.inf)
    forward(x, router, w1, w2)
    with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):
        flashdmoe.synchronize()
    assert ext.scan_events[0].waits == 1 and synchronized == [None]


def test_debug_mode_raises_a_scan_at_the_call_after_its_launch(slow_scans, seed):
    ext, _, _ = slow_scans
    x, router, w1, w2 = inputs(seed)
    poison(w2, seed)
    previous = flashdmoe.set_sync_checks(True)
    try:
        with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):
            forward(x, router, w1, w2)
        assert len(ext.launches) == 1, "launched first (an NVSHMEM rank's peers must not wait for it)"
        assert ext.scan_events[0].waits == 1
        report = flashdmoe.last_report()
        assert not report.checked, "the launch's own check comes at the next point"
        with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):  # re-scanned: still NaN
            forward(x, router, w1, w2)
        assert report.checked
    finally:
        flashdmoe.set_sync_checks(previous)


def test_scans_and_launches_are_checked_oldest_first(slow_scans, seed):
    ext, _, _ = slow_scans
    x, router, w1, w2 = inputs(seed)
    poison(w1, seed)
    ext.script.append([status_block(flags=1)])  # this launch flags non-finite logits
    forward(x, router, w1, w2)
    ext.launches[0]["completion"].done = True
    flashdmoe.check_errors()  # the scan (queued first) still runs: the launch behind it waits its turn
    assert not flashdmoe.last_report().checked
    ext.scan_events[0].done = True
    with pytest.raises(ValueError, match=r"^w1: contains"):
        flashdmoe.check_errors()
    with pytest.raises(ValueError, match=r"^x or router_weight: expected finite values"):
        flashdmoe.check_errors()


def test_a_scan_does_not_keep_its_weights_alive(slow_scans, seed):
    ext, _, _ = slow_scans
    x, router, w1, w2 = inputs(seed)
    poison(w1, seed)
    forward(x, router, w1, w2)
    del w1
    ext.scan_events[0].done = True
    with pytest.raises(ValueError, match=r"^w1: contained non-finite values \(NaN or Inf\) when a forward used it "
                                         r"\(it has been freed since\)"):
        flashdmoe.check_errors()


def test_an_optimizer_step_rescans_without_waiting(slow_scans, seed):
    ext, _, _ = slow_scans
    x, router, w1, w2 = inputs(seed, dtype=torch.float32)
    params = [torch.nn.Parameter(t) for t in (router, w1, w2)]
    forward(x, *params)
    forward(x, *params)
    optimizer = torch.optim.SGD(params, lr=0.1, fused=True)  # fused: versions do not move
    for p in params:
        p.grad = torch.zeros_like(p)
    params[1].grad.view(-1)[3] = math.nan
    optimizer.step()
    forward(x, *params)
    assert len(ext.scan_events) == 2 and all(e.waits == 0 for e in ext.scan_events)
    ext.scan_events[0].done = ext.scan_events[1].done = True
    with pytest.raises(ValueError, match=r"^w1: contains 1 non-finite"):
        flashdmoe.check_errors()


def test_an_nvshmem_rank_launches_before_raising_a_scan_error(slow_scans, seed):
    from test_status_checks import emulated_team, nvshmem_rank

    ext, _, _ = slow_scans
    team = nvshmem_rank(emulated_team(P=2))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, H, generator=g).to(torch.bfloat16)
    router = torch.randn(E, H, generator=g).to(torch.bfloat16)
    w1 = torch.randn(E // 2, H, I, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E // 2, I, H, generator=g).to(torch.bfloat16)
    poison(w2, seed)
    with torch.no_grad():
        flashdmoe.moe(x, router, w1, w2, top_k=K, backend="cuda", team=team)
        ext.scan_events[0].done = True
        with pytest.raises(ValueError, match=r"^w2: contains 1 non-finite"):
            flashdmoe.moe(x, router, w1, w2, top_k=K, backend="cuda", team=team)
    assert [launch["sequence"] for launch in ext.launches] == [1, 2], "launched, then raised"
    assert not team.failed


def test_scan_results_reuse_their_pinned_buffers(fake, monkeypatch, seed):
    """A page-locked allocation may serialise the device's streams: scans after the first take theirs
    from a pool."""
    x, router, w1, w2 = inputs(seed)
    allocated = []
    real = weight_checks._allocate_pinned

    def allocate(nbytes):
        allocated.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(weight_checks, "_allocate_pinned", allocate)
    for _ in range(3):
        with torch.no_grad():
            w1.mul_(0.5)  # a new version: scanned at the next forward
        forward(x, router, w1, w2)
        flashdmoe.synchronize()
    assert len(fake[0].scan_events) == 3 and allocated == [weight_checks._PINNED_BYTES]


def test_reference_backend_scans_at_the_call(fake, seed):
    """The reference waits for the device anyway: its scans stay synchronous (no queue entry)."""
    ext, _, _ = fake
    x, router, w1, w2 = inputs(seed, dtype=torch.float32)
    poison(w1, seed)
    with pytest.raises(ValueError, match=r"^w1: contains 1 non-finite"):
        flashdmoe.moe(x, router, w1, w2, top_k=K, backend="reference")
    assert not ext.scan_events and not status_checks._state.pending


def test_scan_extremes_find_every_non_finite_kind_and_no_false_alarm(seed):
    g = torch.Generator().manual_seed(seed)
    huge = torch.full((4, 4), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)  # a float32 sum overflows
    clean = torch.randn(5, 7, generator=g).to(torch.bfloat16)
    tensors = [huge, clean, torch.empty(0, 3, dtype=torch.bfloat16)]
    for value in (math.nan, math.inf, -math.inf):
        bad = clean.clone()
        poison(bad, seed, value)
        tensors.append(bad)
    extremes = weight_checks._extremes(tensors).tolist()
    finite = [math.isfinite(low) and math.isfinite(high) for low, high in extremes]
    assert finite == [True, True, True, False, False, False]
    mixed = weight_checks._extremes([clean, clean.double()])
    assert mixed.dtype == torch.float64 and mixed[0].tolist() == mixed[1].tolist()


def test_remembered_calls_match_the_reference_on_cpu(seed):
    """Without the fake, ``backend='auto'`` on CPU runs the reference every call: nothing is remembered."""
    x, router, w1, w2 = inputs(seed, dtype=torch.float32)
    before = api.remembered_calls()
    y = flashdmoe.moe(x, router, w1, w2, top_k=K)
    assert torch.equal(y, reference.moe(x, router, w1, w2, top_k=K)) and api.remembered_calls() == before


def test_check_finite_input_names_x(seed):
    x = inputs(seed)[0].float()
    validation.check_finite_input(x)
    validation.check_finite_input(x[:0])
    poison(x, seed)
    with pytest.raises(ValueError, match=r"^x: contains 1 non-finite"):
        validation.check_finite_input(x)


def test_the_host_overhead_script_times_the_steady_call_on_the_stand_in():
    """scripts/host_overhead.py --stand-in runs (its fake launch takes the addresses a launch passes) and finds
    every steady call of each shape on the C++ launch path."""
    repo = pathlib.Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(repo / "scripts" / "host_overhead.py"), "--stand-in", "--calls", "3",
                          "--trials", "2"], capture_output=True, text=True, timeout=600, cwd=repo)
    assert run.returncode == 0, run.stderr[-3000:]
    shares = re.findall(r"calls on the Python path\s+(\d+) of (\d+)", run.stdout)
    assert len(shares) == 3 and all(path == "0" and calls == "3" for path, calls in shares), run.stdout
    assert len(re.findall(r"\(the fake's launch\)\s+[\d.]+ us/call", run.stdout)) == 3, run.stdout
