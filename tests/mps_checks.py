"""The MPS daemon of the GPU tests that run several processes on one GPU (tests/test_ep_multiprocess.py,
tests/test_ep_nvshmem_transport.py, tests/test_ray.py)."""

from __future__ import annotations

import subprocess

import pytest

from flashdmoe.parallel.mps import MpsDaemon


def started_daemon() -> MpsDaemon:
    """A running MPS daemon; the test fails (with the daemon's log) when it does not start: on a GPU machine
    a skip would pass without testing the path."""
    daemon = MpsDaemon()
    try:
        return daemon.start()
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log = daemon.log_tail()  # before stop(): it removes the daemon's own folders, logs included
        daemon.stop()
        pytest.fail(f"the MPS daemon did not start: {error}\n{log}")
