"""``flashdmoe_host``: the eager one-rank forward's host path in C++ (``csrc/host/``).

Python costs about as much per call as the CUDA launch itself: the outputs' allocation, the status slot,
the launch report and its queueing made a one-rank forward's host time ~8 µs of Python on a development
CPU (docs/perf-notes.md, "Host time"). This module does that work in one C++ call for the common case --
nothing to report, a slot free, the workspace ready -- and answers ``None`` for everything else, which
the Python path (:mod:`flashdmoe.kernel.status_checks`) then runs as before, having first taken over the
launches queued in C++ so that every error still surfaces where and when it is documented.

What it holds:

* ``CallCache``: :func:`flashdmoe.moe`'s remembered calls; its ``launch`` is the whole steady call (lookup,
  the remembered checks, the launch through the queue below, ``y`` back);
* ``WorkspaceTable``: per (device, stream) the pooled workspace's address, size and which sync words are
  known zero (:class:`flashdmoe.kernel.workspace_pool.WorkspacePool` keeps the buffers themselves);
* ``LaunchQueue``: each device's eager status slots (pinned memory the Python side allocates), the launch
  id counter, and the launches made in C++ and not yet checked, oldest first;
* ``native_plan(...)``: a prepared one-rank launch as the C++ path runs it, through the kernel module's C
  entry (``flashdmoe_cuda.native_forward``, a capsule: no Python call between the queue and the CUDA
  launch) or, with the CPU stand-in of the tests, a Python ``launch`` callable.

It links libtorch, not CUDA, and is built on first use with ``torch.utils.cpp_extension`` (ninja; about
15 s) into the flashdmoe build cache, per torch and Python version and per source tree; a module built
there before is imported directly. The kernel module stays free of libtorch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import threading
import types
from pathlib import Path

MODULE_NAME = "flashdmoe_host"
SOURCE = Path("host") / "module.cpp"

_module: types.ModuleType | None = None
_failure: Exception | None = None  # a build that failed is not tried again in this process
_lock = threading.Lock()


# What the module compiles, relative to the source tree (csrc/), and how.
INPUTS = (Path("host"), Path("common") / "native_launch.h")
CFLAGS = ("-O2", "-fvisibility=hidden")  # hidden: what pybind11 expects of a module's own types


def build_dir(source_dir: Path | None = None) -> Path:
    """Where the module is built, under the flashdmoe build cache: per torch and Python version and per
    source tree (its path, the contents of :data:`INPUTS`, :data:`CFLAGS`), so that no process rebuilds a
    module another one has loaded."""
    import torch

    from flashdmoe.kernel import extension

    root = source_dir or extension.default_source_dir()
    digest = hashlib.sha256(" ".join((str(root),) + CFLAGS).encode())
    for item in INPUTS:
        paths = sorted((root / item).rglob("*")) if (root / item).is_dir() else [root / item]
        for path in paths:
            if path.is_file():
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    tag = f"torch-{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}"
    return extension.cache_root() / "host" / f"{tag}-{digest.hexdigest()[:16]}"


def module() -> types.ModuleType:
    """The built module (built on the first call in a process, cached on disk after). Raises
    ``flashdmoe.kernel.extension.BuildError`` if it does not build, the same one at every later call."""
    global _module, _failure
    if _module is None:
        with _lock:
            if _failure is not None:
                raise _failure
            if _module is None:
                try:
                    _module = _build()
                except Exception as error:
                    _failure = error
                    raise
    return _module


def _import_built(out: Path) -> types.ModuleType | None:
    """The module built earlier into ``out`` (its folder is keyed by everything that changes it), imported
    without ninja, a compiler or a writable cache (an image's prebuilt module, a read-only cache); ``None``
    when there is none, or while a build is under way there (torch's builder holds ``lock``)."""
    path = out / f"{MODULE_NAME}.so"
    if not path.is_file() or (out / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:  # a build cut short: built again
        return None
    return module


def _build() -> types.ModuleType:
    from torch.utils import cpp_extension

    from flashdmoe.kernel import extension

    source_dir = extension.default_source_dir()
    source = source_dir / SOURCE
    if not source.is_file():
        raise extension.BuildError(f"{source}: the host module's source is missing")
    out = build_dir(source_dir)
    built = _import_built(out)
    if built is not None:
        return built
    out.mkdir(parents=True, exist_ok=True)
    ninja = extension.find_ninja()
    if ninja is None:
        raise extension.BuildError("ninja not found (pip install ninja): the host module is built with it")
    if shutil.which("ninja") is None:  # torch's builder runs `ninja` from PATH; the PyPI package's may not be there
        os.environ["PATH"] = f"{ninja.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        return cpp_extension.load(
            name=MODULE_NAME, sources=[str(source)], extra_include_paths=[str(source_dir)],
            extra_cflags=list(CFLAGS), build_directory=str(out), with_cuda=False,
            verbose=os.environ.get("FLASHDMOE_BUILD_VERBOSE", "0") == "1",
        )
    except (RuntimeError, OSError, ImportError) as error:
        raise extension.BuildError(f"the host module {MODULE_NAME} did not build in {out}: {error}") from error
