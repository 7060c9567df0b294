"""The eager forward's C++ host path (flashdmoe.kernel.host_queue, csrc/host/) on the CPU.

The host module is real (built here with torch.utils.cpp_extension); the kernel module and the CUDA calls
are tests/fake_cuda.py's, whose Python ``launch`` the C++ path calls in place of the kernel module's C
entry. Checked: which calls take the C++ path and which the Python one, that both hand the kernel the
same arguments, and that errors of launches made in C++ surface where and when
flashdmoe.kernel.status_checks documents (the next call, check_errors, synchronize, oldest first, once).
"""

from __future__ import annotations

import gc
import shutil
import threading
from pathlib import Path

import pytest
import torch

import flashdmoe
from fake_cuda import ADDRESSES_PER_RANK, FakeExtension, fake_cuda, status_block, timeout_word
from test_status_checks import K, forward
from test_status_checks import inputs as layer_inputs
from flashdmoe import cuda_backend
from flashdmoe.kernel import host_queue, status_checks

SEED = 20261205


def inputs(tokens=16):
    return layer_inputs(tokens, seed=SEED)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(cuda_backend.debug, "timeout_ms", None)
    python_launches = []
    record = status_checks.record_launch

    def counting(*args, **kwargs):  # launches made by the Python path
        python_launches.append(args[4])
        return record(*args, **kwargs)

    monkeypatch.setattr(status_checks, "record_launch", counting)
    with fake_cuda(monkeypatch) as (ext, _, synchronized):
        yield ext, python_launches, synchronized


def finish(ext, *indices):
    for i in indices:
        ext.launches[i]["completion"].done = True


def test_steady_calls_launch_in_cpp_with_the_python_paths_arguments(fake):
    ext, python_launches, _ = fake
    print(f"seed {SEED}")
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)  # the first call makes the device's slots and the queue: Python path
    assert len(python_launches) == 1
    finish(ext, 0)
    outputs = []
    for i in range(1, 4):
        outputs.append(forward(x, router, w1, w2))
        finish(ext, i)
    assert len(python_launches) == 1 and len(ext.launches) == 4, "three launches made in C++"
    first, native = ext.launches[0], ext.launches[1]
    assert native["ranks"] == 1 and native["stream"] == first["stream"] == 7
    # Router, x, w1, w2 as the Python path passed them; the workspace is the same pooled buffer.
    assert native["addresses"][:4] == first["addresses"][:4]
    assert native["workspace"] == first["workspace"]
    y = outputs[0]
    assert native["addresses"][4] == y.data_ptr() and y.shape == x.shape and y.dtype == x.dtype
    block = native["addresses"][5]
    stride = 4 * x.shape[0] * K  # expert, weight, row, counts: int32 / float32 words
    assert native["addresses"][6:9] == [block + stride, block + 2 * stride, block + 3 * stride]
    assert native["addresses"][9] == 0, "no saved pre-activations without a gradient"
    assert len(native["addresses"]) == 1 + ADDRESSES_PER_RANK
    # Each launch has a slot of its own while it runs; a finished one's slot is reused.
    assert ext.launches[2]["status_host"] == ext.launches[1]["status_host"]


def test_a_steady_call_runs_in_one_cpp_call_and_anything_else_in_python(fake, monkeypatch):
    """flashdmoe.moe's steady state is the call cache's ``launch``: no Python launch function is entered.
    Autograd, return_aux, a check the Python queue holds, and the C++ path turned off take the Python
    path (which may still launch from C++ through launch_native)."""
    from flashdmoe import api

    ext, python_launches, _ = fake
    entered = []
    for module, name in ((cuda_backend, "launch_one"), (status_checks, "launch_native")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: entered.append(_n) or _f(*a, **k))
    x, router, w1, w2 = inputs()
    first = forward(x, router, w1, w2)
    finish(ext, 0)
    entered.clear()
    # The Python queue still holds the first launch and its weight scan: the Python path checks them, then
    # launches from C++.
    forward(x, router, w1, w2)
    assert entered == ["launch_one", "launch_native"] and not status_checks._state.pending
    finish(ext, 1)
    entered.clear()
    steady = forward(x, router, w1, w2)
    assert entered == [] and len(python_launches) == 1 and len(ext.launches) == 3
    assert steady.shape == first.shape and steady.dtype == first.dtype  # the stand-in computes nothing
    finish(ext, 2)
    y, aux = flashdmoe.moe(x, router, w1, w2, top_k=K, backend="cuda", return_aux=True)
    assert entered == ["launch_one", "launch_native"] and len(python_launches) == 1, "aux: Python, launch in C++"
    assert y.shape == first.shape and aux.counts.shape == (router.shape[0],)
    finish(ext, 3)
    entered.clear()
    monkeypatch.setattr(status_checks, "native_launches", False)
    forward(x, router, w1, w2)
    assert entered == ["launch_one", "launch_native"] and len(python_launches) == 2, "turned off: Python launch"
    finish(ext, 4)
    monkeypatch.setattr(status_checks, "native_launches", True)
    entered.clear()
    x_grad = x.clone().requires_grad_()
    flashdmoe.moe(x_grad, router, w1, w2, top_k=K, backend="cuda")
    assert "launch_one" in entered, "autograd: the Python path"
    assert api.remembered_call(x, router, w1, w2, K, "gelu", True, None, "cuda", False) is not None


def test_launch_ids_and_the_report_of_a_launch_made_in_cpp(fake):
    ext, python_launches, _ = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    finish(ext, 0)
    first = flashdmoe.last_report()
    forward(x, router, w1, w2)  # launch 1 is checked (finished, clean); launch 2 in C++
    assert len(python_launches) == 1
    report = flashdmoe.last_report()  # still running: taken over by the Python queue, unchecked
    assert report.launch_id == first.launch_id + 1 and not report.checked and not report.ready()
    assert report.tokens == (16,) and report.grid == 132
    finish(ext, 1)
    assert report.phase_ms["experts"] == pytest.approx(0.004)
    assert report.routing[0].expert.shape == (16, K)
    flashdmoe.synchronize()
    for i in range(2, 5):  # each call retires the previous launch in C++ and queues its own there
        forward(x, router, w1, w2)
        finish(ext, i)
    flashdmoe.check_errors()
    latest = flashdmoe.last_report()
    assert latest.launch_id == first.launch_id + 4 and latest.checked and latest.error is None
    assert latest.phase_ms["gate"] == pytest.approx(0.001)
    assert len(python_launches) == 1


def test_an_error_of_a_launch_made_in_cpp_surfaces_at_the_next_call_oldest_first(fake):
    ext, python_launches, _ = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    finish(ext, 0)
    forward(x, router, w1, w2)  # launch 2, C++
    ext.script.append([status_block(error=timeout_word(2, 0))])
    forward(x, router, w1, w2)  # launch 3 (C++; launch 2 still running) times out
    forward(x, router, w1, w2)  # launch 4 (launches 2 and 3 still running)
    assert len(python_launches) == 1 and len(ext.launches) == 4
    finish(ext, 2)
    forward(x, router, w1, w2)  # launch 2 is still running: nothing to check yet, launch 5
    assert len(ext.launches) == 5
    finish(ext, 1)
    with pytest.raises(flashdmoe.KernelTimeout, match=r"per-expert offsets .*\[launch 3 on"):
        forward(x, router, w1, w2)
    assert len(ext.launches) == 5, "the call that raised launched nothing"
    finish(ext, 3, 4)
    forward(x, router, w1, w2)  # raised once; launches 4 and 5 were clean
    assert len(ext.launches) == 6


@pytest.mark.parametrize("where", ["check_errors", "synchronize"])
def test_check_errors_and_synchronize_see_launches_made_in_cpp(fake, where):
    ext, python_launches, synchronized = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    finish(ext, 0)
    ext.script.append([status_block(flags=1)])
    forward(x, router, w1, w2)
    assert len(python_launches) == 1
    if where == "check_errors":
        flashdmoe.check_errors()  # still running: nothing raised, nothing waited for
        assert synchronized == []
        finish(ext, 1)
        with pytest.raises(ValueError, match=r"NaN or Inf.*\[launch 2 on"):
            flashdmoe.check_errors()
        flashdmoe.check_errors()
    else:
        with pytest.raises(ValueError, match=r"NaN or Inf.*\[launch 2 on"):
            flashdmoe.synchronize()
        assert synchronized == [None]
        flashdmoe.synchronize()


def test_the_python_path_runs_what_cpp_leaves(fake, monkeypatch):
    """Debug mode, a capture, poisoned outputs and a workspace to zero are the Python path's; nothing was
    changed by the C++ path's refusal."""
    ext, python_launches, _ = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    flashdmoe.synchronize()
    flashdmoe.set_sync_checks(True)
    try:
        forward(x, router, w1, w2)
    finally:
        flashdmoe.set_sync_checks(False)
    assert len(python_launches) == 2
    # Another shape on the same stream: larger sync words than the buffer's last launch left zero.
    monkeypatch.setattr(ext, "workspace_layout", lambda T, *a, **k: {
        "total_bytes": 4096 + 64 * T * K, "sync_bytes": 1024 + 8 * T})
    big = inputs(64)[0]
    forward(big, router, w1, w2)
    assert len(python_launches) == 3
    flashdmoe.synchronize()
    forward(big, router, w1, w2)  # now the sync words it needs are the ones its last launch reset
    assert len(python_launches) == 3 and len(ext.launches) == 4
    forward(x, router, w1, w2)  # fewer sync words than known zero (one rank: any stride): C++ too
    assert len(python_launches) == 3 and len(ext.launches) == 5
    flashdmoe.synchronize()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    forward(x, router, w1, w2)  # a capture: a graph slot, the Python path
    assert len(python_launches) == 4 and flashdmoe.last_report().captured


def test_a_launch_that_fails_in_cpp_hands_its_slot_back(fake):
    ext, python_launches, _ = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    flashdmoe.synchronize()
    before = flashdmoe.last_report()
    slots = status_checks._state.devices[None]
    free = slots.eager_free()
    ext.fail_launch = ValueError("addresses: wrong count for the prepared launch")
    with pytest.raises(ValueError, match="wrong count"):
        forward(x, router, w1, w2)
    assert slots.eager_free() == free and status_checks._state.queue.outstanding() == 0
    assert flashdmoe.last_report() is before
    ext.fail_launch = None
    forward(x, router, w1, w2)
    assert len(python_launches) == 1 and flashdmoe.last_report().launch_id == before.launch_id + 1


def test_a_full_ring_falls_back_to_waiting_for_the_oldest(fake):
    ext, python_launches, synchronized = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    flashdmoe.synchronize()
    for _ in range(status_checks.EAGER_SLOTS):  # none finishes
        forward(x, router, w1, w2)
    assert len(python_launches) == 1 and synchronized == [None]
    forward(x, router, w1, w2)  # no slot left: the Python path waits for the oldest
    assert len(python_launches) == 2 and synchronized == [None, None]
    flashdmoe.synchronize()
    assert status_checks._state.devices[None].eager_free() == status_checks.EAGER_SLOTS


def test_weight_scans_and_launches_made_in_cpp_keep_one_order(fake):
    """A new weight's scan is queued behind the launches made in C++ before it: its error surfaces after
    theirs, and the launch of the call that queued it goes by the Python path."""
    ext, python_launches, _ = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    flashdmoe.synchronize()
    ext.script.append([status_block(error=timeout_word(2, 0))])
    forward(x, router, w1, w2)  # launch 2 in C++, will time out
    assert len(python_launches) == 1
    bad = w2.clone()
    bad[1, 2, 3] = float("nan")
    forward(x, router, w1, bad)  # scan queued after launch 2; the Python path launches
    assert len(python_launches) == 2
    finish(ext, 1, 2)
    with pytest.raises(flashdmoe.KernelTimeout, match=r"\[launch 2 on"):
        flashdmoe.check_errors()
    with pytest.raises(ValueError, match="w2"):
        flashdmoe.check_errors()
    flashdmoe.check_errors()


def test_each_thread_gets_its_own_latest_report(fake):
    """A thread's latest launch may be checked (retired) in C++ by another thread's call; its report keeps
    the status it had then."""
    ext, python_launches, _ = fake
    x, router, w1, w2 = inputs()
    forward(x, router, w1, w2)
    flashdmoe.synchronize()
    mine = flashdmoe.last_report()
    launched, asked = threading.Event(), threading.Event()
    seen = {}

    def worker():
        forward(x, router, w1, w2)  # launch 2, C++
        launched.set()
        asked.wait()
        seen["report"] = flashdmoe.last_report()

    thread = threading.Thread(target=worker)
    thread.start()
    launched.wait()
    finish(ext, 1)
    forward(x, router, w1, w2)  # launch 3: retires the worker's launch 2 in C++
    asked.set()
    thread.join()
    theirs = seen["report"]
    assert theirs.launch_id == mine.launch_id + 1 and theirs.checked and theirs.error is None
    assert theirs.phase_ms["combine"] == pytest.approx(0.0005) and theirs.routing[0].row.shape == (16, K)
    assert flashdmoe.last_report().launch_id == mine.launch_id + 2
    assert len(python_launches) == 1


def test_workspace_table_answers():
    table = host_queue.module().WorkspaceTable()
    grow, ready, zero = host_queue.module().GROW, host_queue.module().READY, host_queue.module().ZERO
    assert table.claim(0, 7, 256, 64, 1) == (0, grow)
    table.set(0, 7, 4096, 1024)
    assert table.claim(0, 7, 256, 64, 1) == (4096, ready), "a new buffer is all zero"
    assert table.claim(0, 7, 256, 32, 1) == (4096, ready), "fewer sync words than the last launch's"
    assert table.claim(0, 7, 256, 64, 1, commit_zero=False) == (4096, zero), "more: to be zeroed"
    assert table.claim(0, 7, 256, 32, 1) == (4096, ready), "a refusal without commit recorded nothing"
    assert table.claim(0, 7, 256, 64, 2) == (4096, zero), "more ranks"
    assert table.claim(0, 7, 512, 64, 1) == (4096, ready), "one rank's sync words start the buffer at any stride"
    assert table.claim(0, 7, 256, 64, 2) == (4096, zero), "more ranks again"
    assert table.claim(0, 7, 512, 64, 2) == (4096, zero), "two ranks at another stride"
    assert table.claim(0, 7, 4096, 64, 1) == (0, grow), "too small"
    assert table.claim(1, 7, 256, 64, 1) == (0, grow) and table.claim(0, 8, 256, 64, 1) == (0, grow)
    table.clear()
    assert table.claim(0, 7, 256, 64, 1) == (0, grow)


def test_each_source_tree_builds_into_a_folder_of_its_own(tmp_path):
    """Two checkouts (or two versions) never rebuild a module the other has loaded."""
    tree = tmp_path / "a"
    (tree / "host").mkdir(parents=True)
    (tree / "common").mkdir()
    (tree / "host" / "module.cpp").write_text("int x;")
    (tree / "common" / "native_launch.h").write_text("")
    (tree / "common" / "other.h").write_text("")
    first = host_queue.build_dir(tree)
    assert host_queue.build_dir(tree) == first
    (tree / "common" / "other.h").write_text("changed")
    assert host_queue.build_dir(tree) == first, "a file the module does not compile"
    (tree / "common" / "native_launch.h").write_text("changed")
    second = host_queue.build_dir(tree)
    assert second != first
    (tree / "host" / "module.cpp").write_text("int y;")
    assert host_queue.build_dir(tree) not in (first, second)
    shutil.copytree(tree, tmp_path / "b")
    assert host_queue.build_dir(tmp_path / "b") != host_queue.build_dir(tree)


def test_a_threads_reports_end_with_it_and_a_new_thread_inherits_none(monkeypatch):
    """A thread's latest report keeps its routing outputs alive until the thread ends, in the host queue
    and in the Python queue; a new thread (which may get an ended one's ident) has no latest report."""
    monkeypatch.setattr(cuda_backend.debug, "timeout_ms", None)
    with fake_cuda(monkeypatch, FakeExtension(finish_at_once=True, record=False)):
        x, router, w1, w2 = inputs()
        forward(x, router, w1, w2)

        def crowd(count, ask):
            barrier = threading.Barrier(count)

            def worker():
                forward(x, router, w1, w2)
                if ask:
                    flashdmoe.last_report()
                barrier.wait()

            threads = [threading.Thread(target=worker) for _ in range(count)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            gc.collect()

        queue = status_checks._state.queue
        mine = flashdmoe.last_report()
        crowd(40, ask=False)  # launched in C++, each thread's latest kept there until it ended
        assert queue.kept_threads() == 0
        crowd(10, ask=True)  # their reports made in Python
        assert list(status_checks._state.last_reports.values()) == [mine]
        seen = []
        for _ in range(2):
            thread = threading.Thread(target=lambda: seen.append((threading.get_ident(), flashdmoe.last_report())))
            thread.start()
            thread.join()
            if seen[-1][1] is None:
                worker = threading.Thread(target=lambda: forward(x, router, w1, w2))
                worker.start()
                worker.join()
        assert [report for _, report in seen] == [None, None]


def test_a_host_module_that_does_not_build_makes_the_backend_unavailable(monkeypatch):
    """Tried once per process; the reason reaches backend='cuda''s error like the kernel build's."""
    from types import SimpleNamespace

    from flashdmoe import api
    from flashdmoe.kernel import extension

    attempts = []

    def failing():
        attempts.append(1)
        raise extension.BuildError("the host module flashdmoe_host did not build: c++: not found")

    monkeypatch.setattr(host_queue, "_module", None)
    monkeypatch.setattr(host_queue, "_failure", None)
    monkeypatch.setattr(host_queue, "_build", failing)
    monkeypatch.setattr(extension, "available", lambda: True)
    x = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert "c++: not found" in api.cuda_unavailable_reason(x)
    with pytest.raises(extension.BuildError, match="c\\+\\+: not found"):
        host_queue.module()
    assert attempts == [1]


def _run_program(ops, native):
    """Apply ``ops`` on a fresh stand-in; what the caller sees (each call's outcome, in order) and how
    many launches the Python path made."""
    seen, python_launches = [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_backend.debug, "timeout_ms", None)
        if not native:
            patch.setattr(status_checks, "native_launches", False)
        record = status_checks.record_launch
        patch.setattr(status_checks, "record_launch",
                      lambda *args, **kwargs: python_launches.append(1) or record(*args, **kwargs))
        with fake_cuda(patch) as (ext, _, _):
            x, router, w1, w2 = inputs()
            for op, value in ops + [("sync", 0)]:
                try:
                    if op == "forward":
                        if value:  # a launch that times out, or sees NaN router logits
                            ext.script.append([status_block(error=timeout_word(2, 0)) if value == 1
                                               else status_block(flags=1)])
                        y = forward(x, router, w1, w2)
                        seen.append(("launched", len(ext.launches), tuple(y.shape)))
                    elif op == "finish":
                        running = [launch for launch in ext.launches if not launch["completion"].done]
                        if running:
                            running[value % len(running)]["completion"].done = True
                        seen.append(("finished", len(running)))
                    elif op == "check":
                        flashdmoe.check_errors()
                        seen.append(("checked",))
                    elif op == "sync":
                        flashdmoe.synchronize()
                        seen.append(("synchronized",))
                    else:
                        report = flashdmoe.last_report()
                        seen.append(("last", report.launch_id, report.checked) if report else ("last", None))
                except (flashdmoe.KernelTimeout, ValueError) as error:
                    seen.append(("raised", type(error).__name__, str(error).split("[")[-1]))
    return seen, len(python_launches)


def test_the_cpp_path_changes_nothing_a_caller_sees():
    """Random sequences of forwards (some failing), launches finishing in any order, check_errors,
    synchronize and last_report: the same outcomes, errors and launch ids with the C++ path as without."""
    import random

    rng = random.Random(SEED)
    print(f"seed {SEED}")
    kinds = ["forward"] * 12 + ["finish"] * 6 + ["check", "sync", "last", "last"]
    in_cpp = 0
    for _ in range(30):
        ops = [(kind, rng.choice([0, 0, 0, 0, 1, 2]) if kind == "forward" else rng.randrange(64))
               for kind in (rng.choice(kinds) for _ in range(40))]
        native, python_path_launches = _run_program(ops, native=True)
        python, _ = _run_program(ops, native=False)
        assert native == python, ops
        in_cpp += sum(1 for event in native if event[0] == "launched") - python_path_launches
    print(f"launches made in C++: {in_cpp}")
    assert in_cpp > 100, "the programs exercise the C++ path"


def test_a_built_module_is_imported_without_building(monkeypatch):
    """A module built before into its folder (an image's prebuilt one) is imported directly: no ninja, no
    compiler, no write to the cache; while a build holds the folder's lock, the builder is asked."""
    from torch.utils import cpp_extension

    from flashdmoe.kernel import extension

    built = host_queue.module()
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs) or pytest.fail("rebuilt"))
    monkeypatch.setattr(extension, "find_ninja", lambda: None)
    assert host_queue._build().__file__ == built.__file__ and calls == []
    lock = host_queue.build_dir() / "lock"  # torch's builder holds it while it builds
    exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self, *args, **kwargs: self == lock or exists(self, *args, **kwargs))
    with pytest.raises(extension.BuildError, match="ninja not found"):
        host_queue._build()


def test_a_weight_updated_in_place_replaces_its_remembered_call(fake):
    """An optimizer step makes a new version of a weight: the call remembered for the old version is
    replaced, not kept beside it (the old version never comes back)."""
    from flashdmoe import api

    x, router, w1, w2 = inputs()
    counts = []
    for _ in range(6):
        forward(x, router, w1, w2)
        counts.append(api.remembered_calls())
        with torch.no_grad():
            w1.add_(0.0)
    forward(x, router, w1, w2)
    assert counts == [1] * 6 and api.remembered_calls() == 1
    assert api.remembered_call(x, router, w1, w2, K, "gelu", True, None, "cuda", False) is not None
