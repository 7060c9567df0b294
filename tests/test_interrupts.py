"""flashdmoe.interrupts: a KeyboardInterrupt that Python drops (raised where exceptions cannot propagate)
is raised again in the main thread; other unraisable exceptions are left to the previous hook.

The at-fork case, the one ``flashdmoe run`` met during ``ray.init``, runs in a subprocess: at-fork
callbacks cannot be unregistered, and a SIGINT there must not reach pytest.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flashdmoe.interrupts import redeliver_dropped_interrupts

REPO = Path(__file__).resolve().parents[1]

#: Python's SIGINT handler ran in an at-fork callback of a subprocess start (the callback raises what the
#: handler would); then the program goes on for up to 6 s.
_AT_FORK = """
import contextlib, os, subprocess, sys, time
from flashdmoe.interrupts import redeliver_dropped_interrupts

fired = []

def interrupt_once():
    if not fired:
        fired.append(True)
        raise KeyboardInterrupt

os.register_at_fork(after_in_parent=interrupt_once)
guard = redeliver_dropped_interrupts() if sys.argv[1] == "on" else contextlib.nullcontext()
started = time.monotonic()
try:
    with guard:
        subprocess.run(["true"], preexec_fn=lambda: None, check=True)  # a preexec_fn forks, as Ray's starts do
        while time.monotonic() - started < 6:
            time.sleep(0.01)
    print("finished")
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - started:.3f}s")
"""


def _at_fork(guard: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _AT_FORK, guard], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_interrupt_dropped_in_an_at_fork_callback_is_raised_again():
    dropped = _at_fork("off")
    assert dropped.stdout.strip() == "finished", dropped  # what Python does alone: the Ctrl-C is lost
    assert "Exception ignored" in dropped.stderr and "KeyboardInterrupt" in dropped.stderr, dropped
    redelivered = _at_fork("on")
    assert redelivered.returncode == 0 and redelivered.stdout.startswith("interrupted after "), redelivered
    assert float(redelivered.stdout.split()[-1].rstrip("s")) < 3, redelivered  # not the 6 s of going on
    assert redelivered.stderr == "", redelivered  # nothing reported as ignored


class _RaisesWhenCollected:
    def __init__(self, error: type[BaseException]) -> None:
        self.error = error

    def __del__(self) -> None:
        raise self.error("from __del__")


def test_interrupt_dropped_in_del_is_raised_in_the_main_thread():
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with redeliver_dropped_interrupts():
            _RaisesWhenCollected(KeyboardInterrupt)  # collected at once: its exception is dropped
            while time.monotonic() - started < 6:
                time.sleep(0.01)
    assert time.monotonic() - started < 3


def test_other_unraisable_exceptions_go_to_the_previous_hook_which_is_restored(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_type))
    previous = sys.unraisablehook
    helpers = {thread.name for thread in threading.enumerate()}
    with redeliver_dropped_interrupts():
        assert sys.unraisablehook is not previous
        assert "redeliver-sigint" in {thread.name for thread in threading.enumerate()}
        _RaisesWhenCollected(RuntimeError)
    assert seen == [RuntimeError]
    assert sys.unraisablehook is previous
    assert {thread.name for thread in threading.enumerate()} == helpers  # the helper thread has ended


def test_outside_the_main_thread_nothing_is_installed():
    hooks = []

    def enter() -> None:
        with redeliver_dropped_interrupts():
            hooks.append(sys.unraisablehook)

    before = sys.unraisablehook
    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert hooks == [before]
