"""Where the commands put their files: an output directory checked before any work starts
(:func:`check_output_dir`), and files written whole or not at all (:func:`write_files`).

``flashdmoe run`` and ``flashdmoe bench`` check ``--output`` first, so a path that cannot take the
results is refused (exit status 2) before a worker or a GPU is touched; at the end each file is written
to a temporary name in its own directory and renamed over the target, so that a full disk or a
vanished directory leaves the files that were there before, never a 0-byte or half-written one.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

__all__ = ["MIN_FREE_BYTES", "OutputWriteError", "check_output_dir", "write_files"]

#: Free space an output directory's filesystem must have before a run starts: results.json, the plots
#: and the step log of a long run stay well below it.
MIN_FREE_BYTES = 1 << 20


class OutputWriteError(Exception):
    """A result file could not be written; every file it would have replaced is as it was.

    Attributes:
        path: the file that could not be written.
        error: the ``OSError`` behind it.
    """

    def __init__(self, path: Path, error: OSError) -> None:
        reason = error.strerror or str(error)
        super().__init__(f"cannot write {path}: {reason}")
        self.path = path
        self.error = error


def _nearest_existing(path: Path, shown: str, option: str) -> Path:
    """``path`` or its closest ancestor that exists."""
    current = path
    while not current.exists():
        if os.path.lexists(current):  # a symbolic link to nothing: mkdir would fail on it
            raise ValueError(f"{option} {shown}: {current} is a broken symbolic link")
        if current.parent == current:
            break
        current = current.parent
    return current


def check_output_dir(path: str | os.PathLike, *, option: str = "--output",
                     min_free_bytes: int = MIN_FREE_BYTES) -> Path:
    """Check that ``path`` is, or can be made, a writable directory with some free space; create nothing.

    Returns:
        ``path`` made absolute (not resolved: symbolic links stay as given).

    Raises:
        ValueError: naming ``option``, the path and the cause: it exists and is not a directory, an
            ancestor is a file, the directory (or the one it would be created in) is not writable, or its
            filesystem has less than ``min_free_bytes`` free.
    """
    shown = os.fspath(path)
    absolute = Path(os.path.abspath(shown))
    if absolute.exists() and not absolute.is_dir():
        raise ValueError(f"{option} {shown}: exists and is not a directory")
    existing = _nearest_existing(absolute, shown, option)
    if not existing.is_dir():
        raise ValueError(f"{option} {shown}: cannot be created: {existing} is a file, not a directory")
    where = "" if existing == absolute else f" (it would be created in {existing})"
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {shown}: {existing} is not writable by this user{where}")
    try:  # os.access trusts mode bits; a real file also meets ACLs, read-only mounts, quotas
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ValueError(f"{option} {shown}: cannot create a file in {existing}: "
                         f"{error.strerror or error}{where}") from None
    free = shutil.disk_usage(existing).free
    if free < min_free_bytes:
        raise ValueError(f"{option} {shown}: the filesystem of {existing} has {free:,} bytes free; "
                         f"at least {min_free_bytes:,} are needed for the results")
    return absolute


def _open_temporary(path: Path) -> tuple[int, Path]:
    """A new file beside ``path`` (same filesystem, so the rename is atomic), with the default mode."""
    while True:
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temporary
        except FileExistsError:
            continue


def write_files(files: Mapping[Path, Callable[[BinaryIO], None]]) -> list[Path]:
    """Write every file of ``files`` (path -> function writing its bytes to a binary file) whole or not at all.

    Each is written to a temporary file in its target's directory (created) and flushed to disk; only once
    all are written are they renamed over their targets, so a failure to write (the usual one: a full disk)
    leaves every target as it was, and no temporary file is left behind.

    Returns:
        The paths written, in order.

    Raises:
        OutputWriteError: a file could not be written (disk full, directory gone, not writable).
    """
    temporaries: dict[Path, Path] = {}
    current: Path | None = None
    try:
        for path, write in files.items():
            current = path
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor, temporary = _open_temporary(path)
            temporaries[path] = temporary
            with os.fdopen(descriptor, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
        for path, temporary in list(temporaries.items()):
            current = path
            os.replace(temporary, path)
            del temporaries[path]
    except BaseException as error:
        for temporary in temporaries.values():
            try:
                temporary.unlink(missing_ok=True)
            except OSError:
                pass
        if isinstance(error, OSError) and current is not None:
            raise OutputWriteError(current, error) from error
        raise
    return list(files)
