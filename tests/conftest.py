"""Shared pytest set-up.

GPU tests (``@pytest.mark.gpu``) are skipped where CUDA is unavailable. Random inputs draw from the
``seed`` fixture: one base seed per run (``FLASHDMOE_SEED``, else random), printed in the header, and a
per-test seed derived from it and the test's id, printed with every failure so that
``FLASHDMOE_SEED=<base> pytest <test id>`` replays it.

Every Ray the tests start (embedded in this process, in ``flashdmoe run`` subprocesses, ``ray start``)
runs with token authentication on, whatever the calling shell's ``RAY_AUTH_MODE``, with a token made for
this run (``RAY_AUTH_TOKEN``: nothing is read from or written to ``~/.ray``), and on 127.0.0.1 only
(``ray_actors.embedded`` explains the switch). Set here, before any test module imports Ray.
"""

from __future__ import annotations

import atexit
import os
import secrets
import sys
import zlib

import pytest
import torch

os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
os.environ.pop("RAY_AUTH_TOKEN_PATH", None)

_BASE_SEED = int(os.environ.get("FLASHDMOE_SEED") or int.from_bytes(os.urandom(4), "little"))


# pytest's exit status, for _leave_without_teardown.
_exit_status: int | None = None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


def _leave_without_teardown() -> None:
    """Once pytest is done, a process that loaded Ray leaves with pytest's status and no interpreter
    teardown. The tests start and stop in-process Ray sessions several times, and Ray's background
    threads can then touch freed core-worker state while the interpreter tears down
    (ray-project/ray#31145): one CI run segfaulted there after every test had passed. Registered before
    any test module imports Ray, so it runs after Ray's own exit handler (atexit runs last-in, first-out)."""
    if _exit_status is None or "ray" not in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


atexit.register(_leave_without_teardown)


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; repeated so a run with another rootdir still knows the marker.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped when torch.cuda.is_available() is False)")


def pytest_report_header(config: pytest.Config) -> str:
    return f"FLASHDMOE_SEED={_BASE_SEED} (set it to replay this run's random inputs)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def test_seed(nodeid: str) -> int:
    """The seed a test with this id draws from in this run (stable for a given FLASHDMOE_SEED)."""
    return zlib.crc32(f"{_BASE_SEED}:{nodeid}".encode()) & 0x7FFFFFFF


test_seed.__test__ = False  # a helper, not a test


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    value = test_seed(request.node.nodeid)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.failed and "seed" in getattr(item, "fixturenames", ()):
        report.sections.append((
            "seed", f"per-test seed {test_seed(item.nodeid)}; replay: FLASHDMOE_SEED={_BASE_SEED} "
                    f"python -m pytest '{item.nodeid}'"))
    return report


_draws: dict[str, int] = {}


def next_seed() -> int:
    """A fresh seed for the running test: its per-test seed plus how many were drawn before in it (for
    helpers that make inputs several times per test; replayable like the ``seed`` fixture)."""
    nodeid = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    count = _draws.get(nodeid, 0)
    _draws[nodeid] = count + 1
    return (test_seed(nodeid) + count) & 0x7FFFFFFF
