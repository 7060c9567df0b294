"""Build, cache and load the CUDA extension ``flashdmoe_cuda`` (docs/design.md §10).

The extension is a pybind11 module compiled from every ``*.cu`` and ``*.cpp`` file under ``csrc/``
with ``nvcc``, driven by a generated ``build.ninja`` (one object per source, then ``nvcc -shared``).
A tree with ``moe/launch.cu`` (the real kernel) also gets the expert-variant sources generated from
:mod:`flashdmoe.kernel.expert_variants` (the kernel instances, one unit per variant, and the dispatch header),
written into the build folder and compiled with the rest.
It links neither libtorch nor libcuda: the bindings take raw device pointers, shapes and the stream
handle, so the module imports on a machine without a GPU driver and works across torch versions.

Builds are cached under ``$FLASHDMOE_CACHE_DIR`` (default ``~/.cache/flashdmoe``) in a folder named
after a SHA-256 key of everything that changes the binary: source and header contents with their
relative paths, the generated sources,
nvcc flags and include folders, target arch, the nvcc version, the Python version and
the CUTLASS / pybind11 / NVSHMEM versions. The first use builds (under a file lock, so concurrent
processes build once), later uses import the cached shared object.

A second build, the NVSHMEM transport (docs/design.md §8), compiles the same sources plus ``csrc/nvshmem/``
with relocatable device code, its generated kernel instances publishing through ``NvshmemTransport``,
device-linked against ``libnvshmem_device.a`` and host-linked against the ``nvidia-nvshmem-cu13`` wheel's
``libnvshmem_host.so.3`` (the library nvshmem4py loads, so a process holds one NVSHMEM instance). Its one
shared object holds two modules: ``flashdmoe_nvshmem`` (device-state binding, smoke test) and a
``flashdmoe_cuda`` with the usual API, which a process imports instead of the main build when
``FLASHDMOE_KERNEL_BUILD=nvshmem`` (:func:`kernel_build`). It is built only where that library is found
(:func:`find_nvshmem`); the main build never includes ``csrc/nvshmem/`` and does not depend on NVSHMEM.

Environment:
    FLASHDMOE_CUDA_ARCH   target arch when none is passed (only ``sm_90a`` is supported).
    FLASHDMOE_KERNEL_BUILD "main" (default) or "nvshmem": which build this process imports flashdmoe_cuda from.
    FLASHDMOE_NVSHMEM_HOME an NVSHMEM tree (``include/``, ``lib/``) to use instead of the nvidia wheel's.
    FLASHDMOE_CACHE_DIR   root of the build cache.
    FLASHDMOE_SOURCE_DIR  the CUDA source tree (default: ``csrc/`` beside the package).
    FLASHDMOE_BUILD_JOBS  parallel compile jobs given to ninja (default: ninja's own choice).
    CUDA_HOME / CUDA_PATH where to find ``nvcc`` (else ``PATH``, else ``/usr/local/cuda``).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import types
from pathlib import Path
from typing import NamedTuple

from flashdmoe.kernel import expert_variants

MODULE_NAME = "flashdmoe_cuda"
DEFAULT_ARCH = "sm_90a"
# The kernel uses Hopper-only instructions (wgmma, TMA), so sm_90a is the one arch it can target.
SUPPORTED_ARCHS = ("sm_90a",)
_ARCH_BY_CAPABILITY = {(9, 0): "sm_90a"}

COMPILE_UNIT_SUFFIXES = (".cu", ".cpp")
HEADER_SUFFIXES = (".cuh", ".h", ".hpp")
# The file of the real kernel tree that includes the generated expert-variant dispatch: a tree that has
# it gets flashdmoe.kernel.expert_variants' generated sources (other trees, e.g. tests' tiny ones, do not).
VARIANT_DISPATCH_UNIT = "moe/launch.cu"

NVSHMEM_MODULE_NAME = "flashdmoe_nvshmem"
# The transport module's own compile units; they are not part of flashdmoe_cuda.
NVSHMEM_SUBDIR = "nvshmem"
# Relocatable device code: NVSHMEM's device API is a static device library resolved at device-link time.
# Sources of the host module (flashdmoe/kernel/host_queue.py: C++ against libtorch), never in a kernel build.
HOST_SUBDIR = "host"
NVSHMEM_EXTRA_FLAGS = ("-rdc=true",)
# The policy type its kernel instances publish through (csrc/nvshmem/nvshmem_transport.cuh).
NVSHMEM_TRANSPORT = "NvshmemTransport"

# Flags shared by every compile unit. -Xptxas=-v puts ptxas' register/spill report into the build
# log (see build_log_path / parse_ptxas_report); -fvisibility=hidden is what pybind11 expects.
BASE_NVCC_FLAGS = (
    "-std=c++17",
    "-O3",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "-Xcompiler=-fPIC,-O3,-fvisibility=hidden",
    "-lineinfo",
    "-Xptxas=-v",
    "-DNDEBUG",
)

BUILD_LOG_NAME = "build.log"
_KEY_FILE_NAME = "key.json"
_LOCK_FILE_NAME = ".lock"


class BuildError(RuntimeError):
    """The extension could not be built (missing toolchain, no sources, or a compiler error).

    ``log_path`` is the full build log when the compiler ran, else ``None``.
    """

    def __init__(self, message: str, log_path: Path | None = None):
        super().__init__(message)
        self.log_path = log_path


class SourceTree(NamedTuple):
    """The files of a CUDA source tree: ``root`` (absolute), ``compile_units`` (``*.cu``,
    ``*.cpp``) and ``headers`` (``*.cuh``, ``*.h``, ``*.hpp``), both sorted absolute paths, and
    ``generated``: (build-folder relative path, contents) of the files the builder writes for it."""

    root: Path
    compile_units: tuple[Path, ...]
    headers: tuple[Path, ...]
    generated: tuple[tuple[str, str], ...] = ()

    def generated_units(self) -> list[str]:
        """Build-folder relative paths of the generated compile units."""
        return [path for path, _ in self.generated if Path(path).suffix in COMPILE_UNIT_SUFFIXES]


class Toolchain(NamedTuple):
    """Resolved build tools: the ``nvcc`` and ``ninja`` executables and nvcc's version text."""

    nvcc: Path
    ninja: Path
    nvcc_version: str


class KernelResources(NamedTuple):
    """One entry function's resource use as reported by ``ptxas -v``."""

    name: str
    arch: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_frame_bytes: int


class NvshmemLibrary(NamedTuple):
    """An NVSHMEM install: ``include`` (``nvshmem.h``), ``lib`` holding ``device_lib``
    (``libnvshmem_device.a``) and ``host_lib`` (``libnvshmem_host.so.3``)."""

    include: Path
    lib: Path
    device_lib: Path
    host_lib: Path


class ModuleBuild(NamedTuple):
    """How one extension module is compiled and linked: its ``name``, nvcc ``compile_flags`` (every flag
    but include folders), ``link_flags`` (before the objects) and ``link_libraries`` (after them)."""

    name: str
    compile_flags: tuple[str, ...]
    link_flags: tuple[str, ...]
    link_libraries: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# Locating sources and tools


def default_source_dir() -> Path:
    """``$FLASHDMOE_SOURCE_DIR``, else ``csrc/`` at the repository root (beside the package)."""
    from_env = os.environ.get("FLASHDMOE_SOURCE_DIR")
    if from_env:
        return Path(from_env).expanduser().resolve()
    package_dir = Path(__file__).resolve().parent.parent  # flashdmoe/, this module being flashdmoe/kernel/
    for candidate in (package_dir.parent / "csrc", package_dir / "csrc"):
        if candidate.is_dir():
            return candidate
    return package_dir.parent / "csrc"


def collect_sources(source_dir: str | os.PathLike | None = None) -> SourceTree:
    """All compile units and headers under ``source_dir`` (default: :func:`default_source_dir`).

    Raises ``ValueError`` if ``source_dir`` is not a directory, ``BuildError`` if it holds no
    ``*.cu`` / ``*.cpp`` file.
    """
    root = Path(source_dir).expanduser().resolve() if source_dir is not None else default_source_dir()
    if not root.is_dir():
        raise ValueError(f"source_dir={str(root)!r} is not a directory; expected the CUDA source tree (csrc/)")
    files = sorted(path for path in root.rglob("*")
                   if path.is_file() and not _in_nvshmem_subdir(root, path) and not _in_host_subdir(root, path))
    compile_units = tuple(path for path in files if path.suffix in COMPILE_UNIT_SUFFIXES)
    headers = tuple(path for path in files if path.suffix in HEADER_SUFFIXES)
    if not compile_units:
        raise BuildError(f"no CUDA sources ({', '.join('*' + s for s in COMPILE_UNIT_SUFFIXES)}) under {root}")
    generated = ()
    if (root / VARIANT_DISPATCH_UNIT).is_file():
        generated = tuple(expert_variants.generated_sources().items())
    return SourceTree(root, compile_units, headers, generated)


def _in_nvshmem_subdir(root: Path, path: Path) -> bool:
    return path.relative_to(root).parts[0] == NVSHMEM_SUBDIR


def _in_host_subdir(root: Path, path: Path) -> bool:
    return path.relative_to(root).parts[0] == HOST_SUBDIR


def collect_nvshmem_sources(source_dir: str | os.PathLike | None = None) -> SourceTree:
    """The transport module's tree: every compile unit of ``source_dir`` (the whole kernel module, whose
    generated instances publish through ``NvshmemTransport``) plus those under ``<source_dir>/nvshmem/``
    (the module's own entry point and smoke kernel), and every header. Raises ``ValueError`` if
    ``source_dir`` is not a directory, ``BuildError`` if ``nvshmem/`` holds no compile unit."""
    root = Path(source_dir).expanduser().resolve() if source_dir is not None else default_source_dir()
    if not root.is_dir():
        raise ValueError(f"source_dir={str(root)!r} is not a directory; expected the CUDA source tree (csrc/)")
    files = sorted(path for path in root.rglob("*") if path.is_file() and not _in_host_subdir(root, path))
    compile_units = tuple(path for path in files if path.suffix in COMPILE_UNIT_SUFFIXES)
    headers = tuple(path for path in files if path.suffix in HEADER_SUFFIXES)
    if not any(_in_nvshmem_subdir(root, path) for path in compile_units):
        raise BuildError(f"no NVSHMEM transport sources under {root / NVSHMEM_SUBDIR}")
    generated = ()
    if (root / VARIANT_DISPATCH_UNIT).is_file():
        generated = tuple(expert_variants.generated_sources(NVSHMEM_TRANSPORT).items())
    return SourceTree(root, compile_units, headers, generated)


def _nvshmem_candidates() -> list[Path]:
    from_env = os.environ.get("FLASHDMOE_NVSHMEM_HOME")
    if from_env:
        return [Path(from_env).expanduser()]  # explicit: no silent fall-back to another install
    return [wheel_dir / "nvshmem" for wheel_dir in _nvidia_wheel_dirs()]


def find_nvshmem() -> NvshmemLibrary | None:
    """NVSHMEM's headers, device library and host library: ``$FLASHDMOE_NVSHMEM_HOME`` if set, else the
    ``nvidia-nvshmem-cu13`` wheel (``nvidia/nvshmem``). ``None`` when no complete install is found."""
    for home in _nvshmem_candidates():
        library = NvshmemLibrary(home / "include", home / "lib", home / "lib" / "libnvshmem_device.a",
                                 home / "lib" / "libnvshmem_host.so.3")
        if (library.include / "nvshmem.h").is_file() and library.device_lib.is_file() and library.host_lib.is_file():
            return library
    return None


def nvshmem_problem() -> str | None:
    """Why ``flashdmoe_nvshmem`` cannot be built here (no NVSHMEM install), or ``None``."""
    if find_nvshmem() is not None:
        return None
    where = os.environ.get("FLASHDMOE_NVSHMEM_HOME")
    if where:
        return (f"FLASHDMOE_NVSHMEM_HOME={where!r} lacks include/nvshmem.h, lib/libnvshmem_device.a or "
                "lib/libnvshmem_host.so.3")
    return "NVSHMEM not found (pip install nvidia-nvshmem-cu13, or set FLASHDMOE_NVSHMEM_HOME)"


def _cuda_home_candidates() -> list[Path]:
    homes = [os.environ.get(name) for name in ("CUDA_HOME", "CUDA_PATH")]
    return [Path(home) for home in homes if home] + [Path("/usr/local/cuda")]


def find_nvcc() -> Path | None:
    """``nvcc`` from ``$CUDA_HOME``/``$CUDA_PATH``, else ``PATH``, else ``/usr/local/cuda``."""
    explicit = [home / "bin" / "nvcc" for home in _cuda_home_candidates()[:-1]]
    fallback = [home / "bin" / "nvcc" for home in _cuda_home_candidates()[-1:]]
    on_path = shutil.which("nvcc")
    for candidate in [*explicit, *([Path(on_path)] if on_path else []), *fallback]:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _nvidia_wheel_dirs() -> list[Path]:
    """The folders of the ``nvidia`` namespace package (NVIDIA's pip wheels install into it)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or spec.submodule_search_locations is None:
        return []
    return [Path(location) for location in spec.submodule_search_locations]


def find_cuda_tool(name: str) -> Path | None:
    """A CUDA binary such as ``cuobjdump``: beside nvcc (its real location, even through a
    wrapper script), in a CUDA home, on ``PATH``, or from an NVIDIA wheel (``nvidia/cu13/bin``)."""
    candidates: list[Path] = []
    nvcc = find_nvcc()
    if nvcc is not None:
        candidates += [nvcc.parent / name, nvcc.resolve().parent / name]
        candidates += _bin_dirs_named_in_wrapper(nvcc, name)
    candidates += [home / "bin" / name for home in _cuda_home_candidates()]
    on_path = shutil.which(name)
    if on_path:
        candidates.append(Path(on_path))
    for wheel_dir in _nvidia_wheel_dirs():
        candidates += sorted(wheel_dir.glob(f"cu*/bin/{name}"))
        candidates += sorted(wheel_dir.glob(f"*/bin/{name}"))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _bin_dirs_named_in_wrapper(nvcc: Path, name: str) -> list[Path]:
    # Some installs put a tiny `exec /opt/cuda/bin/nvcc "$@"` script on PATH: look where it points.
    try:
        if nvcc.stat().st_size > 4096:
            return []
        text = nvcc.read_text(errors="replace")
    except OSError:
        return []
    return [Path(match).parent / name for match in re.findall(r"(/\S+/nvcc)\b", text)]


def find_ninja() -> Path | None:
    """The ``ninja`` binary of the ``ninja`` PyPI package, else the one on ``PATH``."""
    try:
        import ninja  # the PyPI package ships the binary in BIN_DIR

        bundled = Path(ninja.BIN_DIR) / "ninja"
        if bundled.is_file():
            return bundled
    except ImportError:
        pass
    on_path = shutil.which("ninja")
    return Path(on_path) if on_path else None


_nvcc_version_cache: dict[Path, str] = {}


def _nvcc_version(nvcc: Path) -> str:
    if nvcc not in _nvcc_version_cache:
        result = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BuildError(f"{nvcc} --version failed (exit {result.returncode}): {result.stderr.strip()}")
        _nvcc_version_cache[nvcc] = result.stdout.strip()
    return _nvcc_version_cache[nvcc]


def find_toolchain() -> Toolchain:
    """nvcc and ninja, or ``BuildError`` saying which one is missing and how to provide it."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    ninja = find_ninja()
    if ninja is None:
        raise BuildError("ninja not found (pip install ninja)")
    return Toolchain(nvcc, ninja, _nvcc_version(nvcc))


def _package_dir(module_name: str) -> Path | None:
    # find_spec only locates the package; importing cutlass_library would pull in far more.
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def include_dirs(source_dir: Path) -> list[Path]:
    """Include folders: the source tree, pybind11, Python, CUTLASS/CuTe (``nvidia-cutlass`` wheel)
    and NVSHMEM (``nvidia-nvshmem-cu13`` wheel) when installed."""
    import pybind11

    dirs = [source_dir, Path(pybind11.get_include()), Path(sysconfig.get_paths()["include"])]
    cutlass_dir = _package_dir("cutlass_library")
    if cutlass_dir is not None:
        dirs += [cutlass_dir / "source" / "include", cutlass_dir / "source" / "tools" / "util" / "include"]
    dirs += [wheel_dir / "nvshmem" / "include" for wheel_dir in _nvidia_wheel_dirs()]
    unique: list[Path] = []
    for directory in dirs:
        if directory.is_dir() and directory not in unique:
            unique.append(directory)
    return unique


# ---------------------------------------------------------------------------------------------
# Arch selection and device checks


def _normalise_arch(value: str, origin: str) -> str:
    text = value.strip().lower()
    arch = text if text.startswith("sm_") else f"sm_{text}"
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{origin}={value!r} is not supported; expected one of {SUPPORTED_ARCHS}: "
            "the fused kernel needs Hopper (wgmma, TMA)"
        )
    return arch


def _gpu_problem() -> str | None:
    """Why the current CUDA device cannot run the kernel, or ``None`` when it is a Hopper GPU."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no CUDA device)"
    device = torch.cuda.current_device()
    capability = tuple(torch.cuda.get_device_capability(device))
    if capability not in _ARCH_BY_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"GPU {name} has compute capability {capability[0]}.{capability[1]}; "
            "the fused kernel needs Hopper (sm_90a)"
        )
    return None


def resolve_arch(arch: str | None = None) -> str:
    """The target arch: ``arch``, else ``$FLASHDMOE_CUDA_ARCH``, else the current GPU's (Hopper
    9.0 -> ``sm_90a``), else :data:`DEFAULT_ARCH` when there is no GPU.

    Raises ``ValueError`` for an unsupported arch and ``BuildError`` when the present GPU is not
    a Hopper GPU.
    """
    if arch is not None:
        return _normalise_arch(arch, "arch")
    from_env = os.environ.get("FLASHDMOE_CUDA_ARCH")
    if from_env:
        return _normalise_arch(from_env, "FLASHDMOE_CUDA_ARCH")
    problem = _gpu_problem()
    if problem is None:
        import torch

        return _ARCH_BY_CAPABILITY[tuple(torch.cuda.get_device_capability(torch.cuda.current_device()))]
    if problem.startswith("GPU "):
        raise BuildError(f"{problem}; pass arch='sm_90a' or set FLASHDMOE_CUDA_ARCH to cross-compile")
    return DEFAULT_ARCH


def gencode_flag(arch: str) -> str:
    """``-gencode=arch=compute_XX,code=sm_XX`` for ``arch`` (e.g. ``sm_90a``)."""
    number = arch.removeprefix("sm_")
    return f"-gencode=arch=compute_{number},code=sm_{number}"


def nvcc_flags(arch: str) -> list[str]:
    """Every nvcc flag of a compile unit except include folders and the dependency file."""
    return [*BASE_NVCC_FLAGS, gencode_flag(arch)]


def main_module_build(arch: str) -> ModuleBuild:
    """``flashdmoe_cuda``: whole-program device code, no NVSHMEM."""
    # The arch is repeated at link time: without it nvcc adds a device-link cubin for its default arch.
    return ModuleBuild(MODULE_NAME, tuple(nvcc_flags(arch)), ("-shared", gencode_flag(arch)))


def nvshmem_module_build(arch: str, library: NvshmemLibrary) -> ModuleBuild:
    """``flashdmoe_nvshmem``: relocatable device code; nvcc's link step device-links it with
    ``libnvshmem_device.a`` and the host side links the host library by path (its soname is
    ``libnvshmem_host.so.3``, the wheel has no unversioned link name), found again at run time
    through the rpath."""
    return ModuleBuild(
        NVSHMEM_MODULE_NAME,
        (*nvcc_flags(arch), *NVSHMEM_EXTRA_FLAGS),
        ("-shared", *NVSHMEM_EXTRA_FLAGS, gencode_flag(arch)),
        (f"-L{library.lib}", "-lnvshmem_device", f"-Xlinker={library.host_lib}", f"-Xlinker=-rpath,{library.lib}"),
    )


def extension_filename(module_name: str = MODULE_NAME) -> str:
    """``module_name`` (default ``flashdmoe_cuda``) plus this interpreter's extension suffix
    (sysconfig ``EXT_SUFFIX``)."""
    return module_name + sysconfig.get_config_var("EXT_SUFFIX")


# ---------------------------------------------------------------------------------------------
# Cache key and folders


def cache_root() -> Path:
    """``$FLASHDMOE_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashdmoe``, else ``~/.cache/flashdmoe``."""
    from_env = os.environ.get("FLASHDMOE_CACHE_DIR")
    if from_env:
        return Path(from_env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "flashdmoe"


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _module_include_dirs(tree: SourceTree, module: ModuleBuild | None) -> list[Path]:
    dirs = include_dirs(tree.root)
    if module is not None and module.name == NVSHMEM_MODULE_NAME:
        library = find_nvshmem()
        if library is not None and library.include not in dirs:
            dirs.append(library.include)
    return dirs


def _library_stamp(path: Path) -> list:
    stat = path.stat()
    return [str(path), stat.st_size, stat.st_mtime_ns]


def _key_inputs(tree: SourceTree, arch: str, toolchain: Toolchain, module: ModuleBuild | None = None) -> dict:
    files = sorted(tree.compile_units + tree.headers)
    inputs = {
        "module": MODULE_NAME if module is None else module.name,
        "arch": arch,
        "nvcc_flags": nvcc_flags(arch) if module is None else list(module.compile_flags),
        # The source folder itself is named by a placeholder: a moved tree keeps its key.
        "include_dirs": ["<source_dir>" if path == tree.root else str(path)
                         for path in _module_include_dirs(tree, module)],
        "nvcc_version": toolchain.nvcc_version,
        "python": sys.version,
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "cutlass": _distribution_version("nvidia-cutlass"),
        "pybind11": _distribution_version("pybind11"),
        "nvshmem": _distribution_version("nvidia-nvshmem-cu13"),
        "sources": [[path.relative_to(tree.root).as_posix(), _file_digest(path)] for path in files],
        "generated": [[path, hashlib.sha256(text.encode()).hexdigest()] for path, text in tree.generated],
    }
    if module is not None and module.name != MODULE_NAME:
        # The libraries linked in change the binary too: keyed by path, size and time (hashing them is slow).
        inputs["link"] = [list(module.link_flags), list(module.link_libraries)]
        library = find_nvshmem()
        if library is not None:
            inputs["nvshmem_libraries"] = [_library_stamp(library.device_lib), _library_stamp(library.host_lib)]
    return inputs


def cache_key(arch: str | None = None, source_dir: str | os.PathLike | None = None) -> str:
    """SHA-256 (hex) of the build inputs of ``source_dir`` for ``arch`` (see module docstring)."""
    tree = collect_sources(source_dir)
    inputs = _key_inputs(tree, resolve_arch(arch), find_toolchain())
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def build_dir(arch: str | None = None, source_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder of this build: ``<cache_root>/<arch>-<first 16 hex digits of the key>``."""
    resolved = resolve_arch(arch)
    return cache_root() / f"{resolved}-{cache_key(resolved, source_dir)[:16]}"


def build_log_path(arch: str | None = None, source_dir: str | os.PathLike | None = None) -> Path:
    """The build log (nvcc commands and ptxas' register/spill report) of the cached build."""
    return build_dir(arch, source_dir) / BUILD_LOG_NAME


# ---------------------------------------------------------------------------------------------
# Building


def _write_generated(out_dir: Path, tree: SourceTree) -> None:
    # Rewritten only when different, so that ninja sees an unchanged file as up to date.
    for relative, text in tree.generated:
        path = out_dir / relative
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def _write_build_ninja(out_dir: Path, tree: SourceTree, arch: str, toolchain: Toolchain,
                       module: ModuleBuild | None = None) -> Path:
    from ninja import ninja_syntax

    module = module if module is not None else main_module_build(arch)

    def shell_join(args: list[str]) -> str:
        # Shell-quote for /bin/sh, then escape '$' for ninja's own variable syntax.
        return ninja_syntax.escape(" ".join(shlex.quote(arg) for arg in args))

    _write_generated(out_dir, tree)
    include_flags = [f"-I{directory}" for directory in _module_include_dirs(tree, module)]
    if tree.generated:
        include_flags.append(f"-I{out_dir}")  # #include "generated/..."
    object_paths = []
    ninja_file = out_dir / "build.ninja"
    with ninja_file.open("w") as handle:
        # No line wrapping: a wrap inside a quoted path would drop the space there.
        writer = ninja_syntax.Writer(handle, width=1 << 20)
        writer.comment(f"Generated by flashdmoe.kernel.extension for {module.name} ({arch}); do not edit.")
        writer.variable("ninja_required_version", "1.3")
        writer.variable("nvcc", shell_join([str(toolchain.nvcc)]))
        writer.variable("nvcc_flags", shell_join(list(module.compile_flags)))
        writer.variable("include_flags", shell_join(include_flags))
        writer.variable("link_flags", shell_join(list(module.link_flags)))
        if module.link_libraries:
            writer.variable("link_libraries", shell_join(list(module.link_libraries)))
        writer.newline()
        writer.rule(
            "cuda_compile",
            "$nvcc $nvcc_flags $include_flags -MD -MF $out.d -c $in -o $out",
            description="NVCC $in",
            depfile="$out.d",
            deps="gcc",
        )
        # Link to a temporary name, then rename: a cached .so is either complete or absent.
        # Libraries follow the objects: a static (device) library only resolves symbols needed before it.
        libraries = " $link_libraries" if module.link_libraries else ""
        writer.rule("cuda_link", f"$nvcc $link_flags $in{libraries} -o $out.tmp && mv -f $out.tmp $out",
                    description="LINK $out")
        writer.newline()
        for source in tree.compile_units:
            object_path = f"objects/{source.relative_to(tree.root).as_posix()}.o"
            writer.build(object_path, "cuda_compile", str(source))
            object_paths.append(object_path)
        for relative in tree.generated_units():
            object_path = f"objects/{relative}.o"
            writer.build(object_path, "cuda_compile", str(out_dir / relative))
            object_paths.append(object_path)
        writer.build(extension_filename(module.name), "cuda_link", object_paths)
        writer.default(extension_filename(module.name))
    return ninja_file


def _first_error_lines(log_text: str, limit: int = 6) -> str:
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror\b", line, re.IGNORECASE)]
    chosen = errors[:limit] if errors else lines[-limit:]
    return " | ".join(chosen)


def _run_ninja(out_dir: Path, toolchain: Toolchain, verbose: bool) -> None:
    command = [str(toolchain.ninja), "-C", str(out_dir), "-v"]
    jobs = os.environ.get("FLASHDMOE_BUILD_JOBS")
    if jobs:
        if not jobs.isdigit() or int(jobs) < 1:
            raise ValueError(f"FLASHDMOE_BUILD_JOBS={jobs!r} is invalid; expected a positive integer")
        command += ["-j", jobs]
    log_path = out_dir / BUILD_LOG_NAME
    with log_path.open("w") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if verbose:
                sys.stderr.write(line)
        returncode = process.wait()
    if returncode != 0:
        summary = _first_error_lines(log_path.read_text(errors="replace"))
        raise BuildError(f"build failed: {summary}, full log at {log_path}", log_path)


def _build_into(out_dir: Path, tree: SourceTree, arch: str, toolchain: Toolchain, *, force: bool,
                verbose: bool, key_inputs: dict | None = None, module: ModuleBuild | None = None) -> Path:
    """Build ``tree`` into ``out_dir`` under its file lock; return the shared object's path."""
    module = module if module is not None else main_module_build(arch)
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / extension_filename(module.name)
    with (out_dir / _LOCK_FILE_NAME).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits while another process builds the same folder
        try:
            if force:
                output.unlink(missing_ok=True)
                shutil.rmtree(out_dir / "objects", ignore_errors=True)
            elif output.is_file():
                return output  # built by someone else while we waited for the lock
            if key_inputs is not None:
                (out_dir / _KEY_FILE_NAME).write_text(json.dumps(key_inputs, indent=2, sort_keys=True))
            _write_build_ninja(out_dir, tree, arch, toolchain, module)
            count = len(tree.compile_units) + len(tree.generated_units())
            print(f"building {module.name} ({count} source{'s' if count != 1 else ''}) ...", file=sys.stderr,
                  flush=True)
            started = time.perf_counter()
            _run_ninja(out_dir, toolchain, verbose)
            print(f"built {output.name} in {time.perf_counter() - started:.1f} s (log: {out_dir / BUILD_LOG_NAME})",
                  file=sys.stderr, flush=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if not output.is_file():
        raise BuildError(f"build finished but {output} is missing, full log at {out_dir / BUILD_LOG_NAME}",
                         out_dir / BUILD_LOG_NAME)
    return output


def build(arch: str | None = None, force: bool = False, verbose: bool = False,
          source_dir: str | os.PathLike | None = None) -> Path:
    """Build the extension into the cache (or reuse the cached build) and return the ``.so`` path.

    Works without a GPU: ``arch`` defaults to ``$FLASHDMOE_CUDA_ARCH``, the current GPU's arch, or
    ``sm_90a``. ``force`` rebuilds even when cached; ``verbose`` echoes the compiler output.
    Raises ``BuildError`` (missing toolchain, no sources, compile error) and ``ValueError``
    (unsupported ``arch``, missing ``source_dir``).
    """
    tree = collect_sources(source_dir)
    resolved = resolve_arch(arch)
    toolchain = find_toolchain()
    inputs = _key_inputs(tree, resolved, toolchain)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    out_dir = cache_root() / f"{resolved}-{key[:16]}"
    output = out_dir / extension_filename()
    if output.is_file() and not force:
        return output  # cache hit: the .so only appears once fully linked
    return _build_into(out_dir, tree, resolved, toolchain, force=force, verbose=verbose, key_inputs=inputs)


def compile_sources(out_dir: str | os.PathLike, arch: str = DEFAULT_ARCH,
                    source_dir: str | os.PathLike | None = None, verbose: bool = False) -> Path:
    """Compile and link ``source_dir`` into ``out_dir`` without importing it (the CI compile check).

    Always compiles (an existing ``out_dir`` build is redone). Returns the ``.so`` path; the build
    log with ptxas' report is ``out_dir / "build.log"``. Needs nvcc, no GPU.
    """
    tree = collect_sources(source_dir)
    resolved = _normalise_arch(arch, "arch")
    return _build_into(Path(out_dir).resolve(), tree, resolved, find_toolchain(), force=True, verbose=verbose)


def _nvshmem_module(arch: str) -> ModuleBuild:
    library = find_nvshmem()
    if library is None:
        raise BuildError(f"cannot build {NVSHMEM_MODULE_NAME}: {nvshmem_problem()}")
    return nvshmem_module_build(arch, library)


def build_nvshmem(arch: str | None = None, force: bool = False, verbose: bool = False,
                  source_dir: str | os.PathLike | None = None) -> Path:
    """:func:`build` for ``flashdmoe_nvshmem`` (``csrc/nvshmem/``, relocatable device code, NVSHMEM
    linked in). Cached like the main module, in its own folder ``<arch>-nvshmem-<key>``.
    Raises ``BuildError`` also when NVSHMEM is not found (:func:`nvshmem_problem`)."""
    tree = collect_nvshmem_sources(source_dir)
    resolved = resolve_arch(arch)
    module = _nvshmem_module(resolved)
    toolchain = find_toolchain()
    inputs = _key_inputs(tree, resolved, toolchain, module)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    out_dir = cache_root() / f"{resolved}-nvshmem-{key[:16]}"
    output = out_dir / extension_filename(module.name)
    if output.is_file() and not force:
        return output
    return _build_into(out_dir, tree, resolved, toolchain, force=force, verbose=verbose, key_inputs=inputs,
                       module=module)


def compile_nvshmem_sources(out_dir: str | os.PathLike, arch: str = DEFAULT_ARCH,
                            source_dir: str | os.PathLike | None = None, verbose: bool = False) -> Path:
    """:func:`compile_sources` for ``flashdmoe_nvshmem`` (always compiles; no GPU needed)."""
    tree = collect_nvshmem_sources(source_dir)
    resolved = _normalise_arch(arch, "arch")
    return _build_into(Path(out_dir).resolve(), tree, resolved, find_toolchain(), force=True, verbose=verbose,
                       module=_nvshmem_module(resolved))


# ---------------------------------------------------------------------------------------------
# Loading


_loaded_modules: dict[tuple[Path, str], types.ModuleType] = {}
_load_lock = threading.Lock()


def import_extension(path: str | os.PathLike, module_name: str = MODULE_NAME) -> types.ModuleType:
    """Import a built ``module_name`` (default ``flashdmoe_cuda``) shared object from ``path`` (once per
    process).

    Importing touches no CUDA API (cudart initialises lazily), so it works without a GPU.
    A process holds one build: pybind11 (>= 3) keeps the first module initialised under a name and
    hands its contents to any later one of the same name, so importing a second, different build
    raises ``ImportError`` instead of silently running the old code. A rebuild needs a new process.
    """
    so_path = Path(path).resolve()
    with _load_lock:
        if (so_path, module_name) not in _loaded_modules:
            earlier = [path for path, name in _loaded_modules if name == module_name]
            if earlier:
                raise ImportError(
                    f"{module_name} is already imported in this process from {earlier[0]}; one process holds "
                    f"one build (pybind11 caches modules by name), so {so_path} needs a new process"
                )
            spec = importlib.util.spec_from_file_location(module_name, so_path)
            if spec is None or spec.loader is None:
                raise ImportError(f"{so_path} is not an importable extension module")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _loaded_modules[so_path, module_name] = module
        return _loaded_modules[so_path, module_name]


def _unavailable(reason: str) -> RuntimeError:
    try:
        from flashdmoe.errors import BackendUnavailable
    except ImportError:  # errors.py not present: still say why
        return RuntimeError(f"CUDA backend unavailable: {reason}")
    return BackendUnavailable(f"CUDA backend unavailable: {reason}")


KERNEL_BUILDS = ("main", "nvshmem")


def kernel_build() -> str:
    """Which build this process imports ``flashdmoe_cuda`` from: ``$FLASHDMOE_KERNEL_BUILD``, "main"
    (default: peer-pointer stores, no NVSHMEM dependency) or "nvshmem" (the same API from the NVSHMEM
    transport build, whose kernels also reach peers through NVSHMEM puts). Read at the first load: a
    process holds one ``flashdmoe_cuda``. ``ValueError`` naming the variable for another value."""
    value = os.environ.get("FLASHDMOE_KERNEL_BUILD", "main").strip().lower() or "main"
    if value not in KERNEL_BUILDS:
        raise ValueError(f"FLASHDMOE_KERNEL_BUILD={os.environ['FLASHDMOE_KERNEL_BUILD']!r}: expected one of "
                         f"{KERNEL_BUILDS}")
    return value


def load(source_dir: str | os.PathLike | None = None) -> types.ModuleType:
    """The ``flashdmoe_cuda`` module for the current Hopper GPU, building it on first use (from the build
    :func:`kernel_build` names).

    Raises ``flashdmoe.errors.BackendUnavailable`` with the reason (no GPU, wrong arch, no nvcc,
    build failure, import failure).
    """
    problem = _gpu_problem()
    if problem is not None:
        raise _unavailable(problem)
    try:
        if kernel_build() == "nvshmem":
            return import_extension(build_nvshmem(source_dir=source_dir), MODULE_NAME)
        return import_extension(build(source_dir=source_dir))
    except (BuildError, ValueError) as error:
        raise _unavailable(str(error)) from error
    except ImportError as error:
        raise _unavailable(f"import of the built extension failed: {error}") from error
    except OSError as error:  # e.g. an unwritable cache folder
        raise _unavailable(f"{type(error).__name__}: {error}") from error


def load_nvshmem(source_dir: str | os.PathLike | None = None) -> types.ModuleType:
    """The ``flashdmoe_nvshmem`` module (building it on first use) for the current Hopper GPU.

    Importing it does not initialise NVSHMEM; its ``init_device_state()`` binds the module to the
    NVSHMEM instance a team started. Raises ``BackendUnavailable`` with the reason (no GPU, no NVSHMEM
    install, build or import failure).
    """
    problem = _gpu_problem()
    if problem is not None:
        raise _unavailable(problem)
    try:
        return import_extension(build_nvshmem(source_dir=source_dir), NVSHMEM_MODULE_NAME)
    except (BuildError, ValueError) as error:
        raise _unavailable(str(error)) from error
    except ImportError as error:
        raise _unavailable(f"import of the built {NVSHMEM_MODULE_NAME} failed: {error}") from error
    except OSError as error:
        raise _unavailable(f"{type(error).__name__}: {error}") from error


_loaded: types.ModuleType | None = None


def loaded() -> types.ModuleType:
    """:func:`load` for the package's own sources, resolved once per process (the build cache lookup
    hashes every source file, far too slow for a per-call lookup). Raises as :func:`load` does."""
    global _loaded
    if _loaded is None:
        _loaded = load()
    return _loaded


_status_cache: dict[str, str | None] = {}


def unavailable_reason(source_dir: str | os.PathLike | None = None) -> str | None:
    """Why the CUDA backend cannot be used in this process, or ``None`` if it can.

    On a Hopper GPU this builds the extension on first use. The answer is cached for the process.
    """
    cache_entry = str(Path(source_dir).resolve()) if source_dir is not None else ""
    if cache_entry not in _status_cache:
        try:
            load(source_dir)
            _status_cache[cache_entry] = None
        except RuntimeError as error:
            _status_cache[cache_entry] = str(error).removeprefix("CUDA backend unavailable: ")
    return _status_cache[cache_entry]


def available(source_dir: str | os.PathLike | None = None) -> bool:
    """Whether the fused CUDA kernel can run here (a Hopper GPU and a built extension)."""
    return unavailable_reason(source_dir) is None


# ---------------------------------------------------------------------------------------------
# Inspecting a build


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPERTIES_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS_RE = re.compile(r"Used (\d+) registers")


def parse_ptxas_report(log_text: str) -> list[KernelResources]:
    """Per-entry-function registers, spills and stack frame from ``ptxas -v`` output (a build log)."""
    results: list[KernelResources] = []
    entry: tuple[str, str] | None = None
    frames: dict[str, tuple[int, int, int]] = {}
    properties_of: str | None = None
    for line in log_text.splitlines():
        if match := _ENTRY_RE.search(line):
            entry, properties_of = (match.group(1), match.group(2)), None
        elif match := _PROPERTIES_RE.search(line):
            properties_of = match.group(1)
        elif (match := _FRAME_RE.search(line)) and properties_of is not None:
            frames[properties_of] = (int(match.group(1)), int(match.group(2)), int(match.group(3)))
        elif (match := _REGISTERS_RE.search(line)) and entry is not None:
            name, arch = entry
            stack, stores, loads = frames.get(name, (0, 0, 0))
            results.append(KernelResources(name, arch, int(match.group(1)), stores, loads, stack))
            entry = None
    return results


def embedded_cubin_archs(so_path: str | os.PathLike) -> list[str]:
    """The SASS archs (e.g. ``["sm_90a"]``) of the cubins embedded in a built shared object,
    listed by ``cuobjdump --list-elf``. Raises ``BuildError`` when cuobjdump is not found."""
    cuobjdump = find_cuda_tool("cuobjdump")
    if cuobjdump is None:
        raise BuildError("cuobjdump not found (CUDA's bin folder, PATH, or pip install nvidia-cuda-cuobjdump)")
    result = subprocess.run([str(cuobjdump), "--list-elf", str(so_path)], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        raise BuildError(f"cuobjdump --list-elf {so_path} failed: {result.stderr.strip() or result.stdout.strip()}")
    return re.findall(r"\.(sm_\w+?)\.cubin", result.stdout)
