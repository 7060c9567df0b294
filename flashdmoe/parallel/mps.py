"""CUDA MPS for several ranks on one GPU (docs/design.md §6): start and stop the control daemon, and the
environment a client process needs.

Without MPS, NVSHMEM runs several processes per GPU in "limited MPG" mode, where its collectives abort;
under MPS it runs full multi-process-per-GPU. Each client gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
(their sum at most 100) so that every rank's persistent kernel finds room to be resident at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["MpsDaemon", "mps_available"]

CONTROL = "nvidia-cuda-mps-control"


def mps_available() -> str | None:
    """Why MPS cannot be started here, or ``None`` if the control binary is present."""
    if shutil.which(CONTROL) is None:
        return f"{CONTROL} is not on PATH"
    return None


class MpsDaemon:
    """Context manager: ``with MpsDaemon() as mps: env = mps.client_env(50)``.

    The pipe and log directories live in a fresh temporary directory; the daemon is asked to quit on
    exit. Processes started with :meth:`client_env` become MPS clients; the process that starts the
    daemon should not hold a CUDA context of its own.
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="flashdmoe-mps-")) if root is None else Path(root)
        self.pipe_dir = self.root / "pipe"
        self.log_dir = self.root / "log"
        self.running = False

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        return env

    def start(self) -> "MpsDaemon":
        reason = mps_available()
        if reason:
            raise RuntimeError(f"cannot start MPS: {reason}")
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([CONTROL, "-d"], env=self._env(), check=True, timeout=60)
        self.running = True
        return self

    def client_env(self, thread_percentage: int | None = None) -> dict[str, str]:
        """Environment for a client process (a copy of this one's plus the MPS variables)."""
        env = self._env()
        if thread_percentage is not None:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(thread_percentage))
        for name, value in (("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"),
                            ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
            env[name] = value
        return env

    def stop(self) -> None:
        if self.running:
            try:
                subprocess.run([CONTROL], input="quit\n", text=True, env=self._env(), timeout=60, check=False)
            finally:
                self.running = False
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        """The end of the MPS control and server logs (for failure messages)."""
        out = []
        for name in ("control.log", "server.log"):
            path = self.log_dir / name
            if path.exists():
                out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def __enter__(self) -> "MpsDaemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
