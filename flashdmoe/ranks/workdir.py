"""The run directory: the files through which the launcher and the rank processes talk.

One directory per run. The launcher writes ``rank<r>.spec.json`` (what rank ``r`` runs) and collects
``rank<r>.log`` (its output); rank 0 publishes the NVSHMEM unique id as ``uid.bin``; every rank keeps
``rank<r>.phase.json`` up to date (the step it is in, so a hang is reported with where it hung) and at the
end writes ``rank<r>.pt`` (``torch.save`` of CPU tensors) and ``rank<r>.status.json`` (``"ok"`` with the
scenario's JSON info, or the exception), plus ``rank<r>.teardown.json`` if closing its team failed.
Files are written whole (a temporary file, then an atomic rename): a reader sees all of a file or none.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["SPEC_VERSION", "UID_FILE", "RankFiles", "read_json", "write_bytes", "write_json"]

#: Version of the spec format; a child refuses a spec of another version.
SPEC_VERSION = 1
UID_FILE = "uid.bin"


@dataclass(frozen=True)
class RankFiles:
    """The paths of rank ``rank``'s files in run directory ``root``."""

    root: Path
    rank: int

    def _path(self, suffix: str) -> Path:
        return self.root / f"rank{self.rank}.{suffix}"

    @property
    def spec(self) -> Path:
        return self._path("spec.json")

    @property
    def status(self) -> Path:
        return self._path("status.json")

    @property
    def phase(self) -> Path:
        return self._path("phase.json")

    @property
    def teardown(self) -> Path:
        return self._path("teardown.json")

    @property
    def tensors(self) -> Path:
        return self._path("pt")

    @property
    def log(self) -> Path:
        return self._path("log")


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically (tensors, dtypes, paths and bytes made JSON-able)."""
    write_bytes(path, json.dumps(data, indent=1, default=_jsonable).encode())


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None when the file is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return repr(value)
