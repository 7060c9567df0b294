"""Host time per fused forward: how long ``flashdmoe.moe(..., backend="cuda")`` keeps the CPU busy.

On a GPU (the default when one is present): for each shape, the GPU is first held busy by a long
``torch.cuda._sleep``, then ``--calls`` forwards are issued back to back; the host time per call is pure
Python + binding + CUDA API work (nothing can wait for the GPU, which has not reached them yet). Also
printed: the parts of a remembered call (its lookup, ``launch_one``, the extension's C++ launch alone
-- so Python's share and C++'s show apart --, ``MoELayer`` around it, and the same call with every launch
made by the Python path instead of the host module's C++ one: the baseline in the same run), and
the GPU time per call of back-to-back eager calls and of CUDA-graph replays (CUDA events), so that what
the host adds shows.

``--stand-in`` (no GPU needed): the same host path on CPU tensors with the extension and the CUDA
stream calls replaced by tests/fake_cuda.py, so the host work per call (call lookup, launch
bookkeeping, output and workspace handling, report, status checks) is measured without the CUDA API
(whose calls -- the launch and the two output allocations -- come on top). What device tensors get is timed: the
NaN scan of ``x`` that CPU tensors get at every call is left out, and the process runs with glibc's
allocator kept off ``mmap`` (re-executed with ``MALLOC_MMAP_THRESHOLD_``) so that allocating ``y`` costs
about what torch's CUDA caching allocator costs, whatever its size. The fake extension's own ``launch``
(Python, in place of one C++ call) is timed apart and is included in the totals.

    python scripts/host_overhead.py [--stand-in] [--calls N] [--trials N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import flashdmoe  # noqa: E402
from flashdmoe import api, cuda_backend  # noqa: E402
from flashdmoe.kernel import status_checks

# (T, H, I, E, k, activation): decode, a small batch, the paper's shape.
SHAPES = [(1, 2048, 768, 128, 8, "swiglu"), (128, 4096, 1408, 64, 6, "swiglu"), (8192, 2048, 2048, 32, 2, "gelu")]

# glibc serves large blocks with mmap / munmap at every allocation; these keep them on its heap instead.
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def make_inputs(T, H, I, E, k, activation, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    cols = 2 * I if activation == "swiglu" else I
    x = torch.randn(T, H, device=device, generator=g).to(dtype)
    router = (torch.randn(E, H, device=device, generator=g) / H ** 0.5).to(dtype)
    w1 = (torch.randn(E, H, cols, device=device, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, I, H, device=device, generator=g) / I ** 0.5).to(dtype)
    return x, router, w1, w2


STATISTIC = statistics.median  # --stand-in: min (a shared CPU's load only ever adds time)


def per_call_us(fn, calls: int, trials: int, before=None, after=None) -> float:
    """STATISTIC over trials of (host seconds for `calls` calls of fn) / calls, in microseconds."""
    samples = []
    for _ in range(trials):
        if before is not None:
            before()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        if after is not None:
            after()
    return STATISTIC(samples)


def python_path_share(fn, calls: int, before=None) -> str:
    """How many of ``calls`` calls of fn launched by the Python path rather than the host module's C++ one
    (flashdmoe.kernel.host_queue), as in a trial of the timings (a synchronize, then ``before``): which
    path they measured."""
    flashdmoe.synchronize()
    if before is not None:
        before()
    count = []
    record = status_checks.record_launch
    status_checks.record_launch = lambda *args, **kwargs: count.append(1) or record(*args, **kwargs)
    try:
        for _ in range(calls):
            fn()
    finally:
        status_checks.record_launch = record
    flashdmoe.synchronize()
    return f"{len(count)} of {calls}"


def python_launch_path_us(fn, calls, trials, before, after) -> float:
    """:func:`per_call_us` of fn with the host module's C++ launch path turned away (every launch by the
    Python path: status_checks.record_launch and the Python report, as before that path existed)."""
    status_checks.native_launches = False
    try:
        return per_call_us(fn, calls, trials, before, after)
    finally:
        status_checks.native_launches = True


def host_parts(x, router, w1, w2, k, activation, calls, trials, before=None, after=None) -> dict[str, float]:
    """µs per call of the whole call and of its parts (the call is remembered after its first run)."""
    full = lambda: flashdmoe.moe(x, router, w1, w2, top_k=k, activation=activation, backend="cuda")  # noqa: E731
    full()
    options = (k, activation, True, None, "cuda", False)
    plan = api.remembered_call(x, router, w1, w2, *options).plan
    config = flashdmoe.MoEConfig(hidden=x.shape[1], ffn=w2.shape[1], experts=router.shape[0], top_k=k,
                                 tokens_per_rank=x.shape[0], activation=activation,
                                 dtype=str(x.dtype).removeprefix("torch."))
    layer = flashdmoe.MoELayer(config, device=x.device)
    with torch.no_grad():
        for mine, theirs in zip((layer.router_weight, layer.w1, layer.w2), (router, w1, w2)):
            mine.copy_(theirs)
    layer.backend = "cuda"
    layer(x)
    parts = {
        "flashdmoe.moe": per_call_us(full, calls, trials, before, after),
        "  remembered-call lookup": per_call_us(lambda: api.remembered_call(x, router, w1, w2, *options), calls * 10,
                                                trials),
        "  cuda_backend.launch_one": per_call_us(
            lambda: cuda_backend.launch_one(plan, x, router, w1, w2), calls, trials, before, after),
        "MoELayer forward": per_call_us(lambda: layer(x), calls, trials, before, after),
        # The baseline in the same run: the launch made by the Python path every time.
        "flashdmoe.moe, Python launch path": python_launch_path_us(full, calls, trials, before, after),
    }
    if x.is_cuda:
        parts["  extension launch (C++)"] = extension_launch_us(plan, x, router, w1, w2, calls, trials, before, after)
    return parts


def extension_launch_us(plan, x, router, w1, w2, calls, trials, before, after) -> float:
    """µs per call of the extension's ``launch`` alone (the prepared launch: one CUDA call), on
    outputs, workspace and a status slot taken once: what ``launch_one`` spends outside Python."""
    index = x.device.index
    handle = cuda_backend._current_stream_handle(index)
    y = torch.empty_like(x)
    routing = torch.empty(plan.routing_words, dtype=torch.int32, device=x.device)
    workspace = cuda_backend._pool.address(x.device, index, handle, plan.stride, plan.sync_bytes)
    addresses = cuda_backend.single_addresses(plan, router.data_ptr(), x.data_ptr(), w1.data_ptr(), w2.data_ptr(),
                                              y.data_ptr(), routing.data_ptr(), 0, workspace, 0)
    flashdmoe.synchronize()
    slot = status_checks.claim_slot(index, False)
    try:
        launch = lambda: plan.launch(plan.prepared, addresses, 1, handle, slot.address)  # noqa: E731
        return per_call_us(launch, calls, trials, before, after)
    finally:
        torch.cuda.synchronize()
        slot.give_back()


def gpu_report(args) -> None:
    device = torch.device("cuda")
    flashdmoe.set_sync_checks(False)
    for T, H, I, E, k, activation in SHAPES:
        x, router, w1, w2 = make_inputs(T, H, I, E, k, activation, device)
        with torch.no_grad():
            for _ in range(5):
                flashdmoe.moe(x, router, w1, w2, top_k=k, activation=activation, backend="cuda")
            flashdmoe.synchronize()
            # ~50 ms of GPU work ahead of the calls: none of them can be reached while they are issued.
            busy = lambda: torch.cuda._sleep(100_000_000)  # noqa: E731
            parts = host_parts(x, router, w1, w2, k, activation, args.calls, args.trials, busy, flashdmoe.synchronize)
            share = python_path_share(
                lambda: flashdmoe.moe(x, router, w1, w2, top_k=k, activation=activation, backend="cuda"), args.calls,
                busy)

            def gpu_ms(fn, n=50):
                fn()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(n):
                    fn()
                end.record()
                flashdmoe.synchronize()
                return start.elapsed_time(end) / n

            eager = gpu_ms(lambda: flashdmoe.moe(x, router, w1, w2, top_k=k, activation=activation, backend="cuda"))
            static_x = x.clone()
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                flashdmoe.moe(static_x, router, w1, w2, top_k=k, activation=activation, backend="cuda")
            torch.cuda.current_stream().wait_stream(side)
            flashdmoe.synchronize()
            with torch.cuda.graph(graph):
                flashdmoe.moe(static_x, router, w1, w2, top_k=k, activation=activation, backend="cuda")
            replay = gpu_ms(graph.replay)
        print(f"T={T} H={H} I={I} E={E} k={k} {activation}:")
        for name, value in parts.items():
            print(f"  {name:<28} {value:8.1f} us/call (host)")
        print(f"  {'calls on the Python path':<28} {share}")
        print(f"  {'back-to-back eager':<28} {eager * 1e3:8.1f} us/call (GPU)")
        print(f"  {'CUDA-graph replay':<28} {replay * 1e3:8.1f} us/call (GPU)")


def stand_in_report(args) -> None:
    import pytest

    sys.path.insert(0, str(REPO / "tests"))
    from fake_cuda import ADDRESSES_PER_RANK, FakeExtension, fake_cuda

    from flashdmoe import validation

    patch = pytest.MonkeyPatch()
    # Each launch has finished by the next call (as at small T), so every call also checks one.
    fake = FakeExtension(finish_at_once=True, record=False)
    try:
        with fake_cuda(patch, fake):
            patch.setattr(validation, "check_finite_input", lambda x: None)  # CPU tensors only: see above
            empty = per_call_us(lambda: torch.empty(4), 2000, args.trials)
            print(f"calibration: torch.empty(4) on this CPU takes {empty:.2f} us")
            for T, H, I, E, k, activation in SHAPES:
                x, router, w1, w2 = make_inputs(T, H, 64, E, k, activation, "cpu")  # I: only a size here
                with torch.no_grad():
                    parts = host_parts(x, router, w1, w2, k, activation, args.calls, args.trials,
                                       after=flashdmoe.synchronize)
                    plan = api.remembered_call(x, router, w1, w2, k, activation, True, None, "cuda", False).plan
                    slot = status_checks.claim_slot(None, False)
                    addresses = [0] * (1 + ADDRESSES_PER_RANK)
                    parts["  (the fake's launch)"] = per_call_us(
                        lambda: fake.launch(plan.prepared, addresses, 1, 7, slot.address),
                        args.calls * 10, args.trials)
                    slot.give_back()
                    share = python_path_share(
                        lambda: flashdmoe.moe(x, router, w1, w2, top_k=k, activation=activation, backend="cuda"),
                        args.calls)
                print(f"stand-in T={T} H={H} I={I} E={E} k={k} {activation} (CPU tensors, fake extension):")
                for name, value in parts.items():
                    print(f"  {name:<28} {value:8.2f} us/call (host)")
                print(f"  {'calls on the Python path':<28} {share}")
    finally:
        patch.undo()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stand-in", action="store_true", help="CPU only: fake extension and CUDA calls")
    parser.add_argument("--calls", type=int, help="forwards per trial (default 40; --stand-in: 20)")
    parser.add_argument("--trials", type=int,
                        help="trials; the median is printed (default 15), the minimum with --stand-in (default 300)")
    args = parser.parse_args(argv)
    args.calls = args.calls or (20 if args.stand_in else 40)
    args.trials = args.trials or (300 if args.stand_in else 15)
    if args.stand_in:
        if any(os.environ.get(name) != value for name, value in _MALLOC_ENV.items()):
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_MALLOC_ENV})
        global STATISTIC
        STATISTIC = min
        stand_in_report(args)
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: pass --stand-in to measure the host path with a fake extension")
    else:
        gpu_report(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
