"""Tests of flashdmoe.kernel.extension: building, caching and loading the CUDA extension.

Most tests build a tiny throwaway source tree (one trivial kernel, a header, pybind11 bindings)
with the real toolchain (nvcc + ninja), then import the module on this GPU-less machine and call a
host-only function. ``test_real_csrc_compiles_for_sm_90a`` is CI's compile check of the real
kernel: it compiles ``csrc/`` for sm_90a and inspects the embedded SASS (nothing runs).

Compile tests need nvcc: without it they skip locally but fail in CI (``CI`` set), so the compile
check can never pass by skipping.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from build_checks import skip_or_fail
from flashdmoe.kernel import expert_variants, extension

try:
    from flashdmoe.errors import BackendUnavailable
except ImportError:  # errors.py not written yet: load() falls back to RuntimeError
    BackendUnavailable = RuntimeError

REPO_ROOT = Path(__file__).resolve().parent.parent
ARCH = "sm_90a"



@pytest.fixture(scope="module")
def toolchain():
    try:
        return extension.find_toolchain()
    except extension.BuildError as error:
        skip_or_fail(str(error))


def _write_tiny_tree(root: Path, answer: int) -> Path:
    """A throwaway csrc/-like tree: a header, a kernel in a subfolder, and pybind11 bindings.

    ``answer`` is baked into the header so a content change is visible through the module.
    """
    (root / "include").mkdir(parents=True)
    (root / "kernels").mkdir()
    (root / "include" / "tiny.cuh").write_text(
        "#pragma once\n"
        f"constexpr int kAnswer = {answer};\n"
        "int scale_kernel_block_size();\n"
    )
    (root / "kernels" / "scale.cu").write_text(
        '#include "include/tiny.cuh"\n'
        "__global__ void scale_kernel(float* values, float factor, int count) {\n"
        "  int index = blockIdx.x * blockDim.x + threadIdx.x;\n"
        "  if (index < count) values[index] *= factor;\n"
        "}\n"
        "int scale_kernel_block_size() { return 256; }\n"
    )
    (root / "bindings.cpp").write_text(
        "#include <pybind11/pybind11.h>\n"
        '#include "include/tiny.cuh"\n'
        "PYBIND11_MODULE(flashdmoe_cuda, m) {\n"
        '  m.def("add", [](long a, long b) { return a + b; });\n'
        '  m.def("answer", []() { return kAnswer; });\n'
        '  m.def("block_size", &scale_kernel_block_size);\n'
        "}\n"
    )
    return root


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """An isolated build cache for the whole module (never the user's ~/.cache)."""
    path = tmp_path_factory.mktemp("flashdmoe-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLASHDMOE_CACHE_DIR", str(path))
        patch.delenv("FLASHDMOE_CUDA_ARCH", raising=False)
        yield path


@pytest.fixture(scope="module")
def tiny_tree(tmp_path_factory):
    return _write_tiny_tree(tmp_path_factory.mktemp("tiny-csrc"), answer=41)


@pytest.fixture(scope="module")
def tiny_build(toolchain, cache_dir, tiny_tree):
    """The tiny tree built once into the isolated cache: (so path, build seconds)."""
    started = time.perf_counter()
    so_path = extension.build(arch=ARCH, source_dir=tiny_tree)
    return so_path, time.perf_counter() - started


def _run_in_fresh_process(code: str, *arguments: object) -> str:
    """Run ``code`` in a new interpreter (``import_extension``, ``sys`` and ``argv`` = ``arguments`` as
    strings are in scope) and return the last line it prints.

    Built modules are imported in child processes: a process holds one flashdmoe_cuda build (see
    extension.import_extension), and the pytest process may already hold another (e.g. the real one).
    """
    script = "import sys\nfrom flashdmoe.kernel.extension import import_extension\nargv = sys.argv[1:]\n" + code
    result = subprocess.run([sys.executable, "-c", script, *map(str, arguments)], capture_output=True, text=True,
                            cwd=REPO_ROOT, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def _report(capture, text: str) -> None:
    """Print past pytest's capture (``capture`` is the test's capsys or capfd): timings belong in the log."""
    with capture.disabled():
        print(f"\n[test_extension] {text}")


def test_build_then_import_and_call_host_function(tiny_build, cache_dir, capsys):
    so_path, seconds = tiny_build
    _report(capsys, f"tiny tree build: {seconds:.1f} s")
    assert so_path.is_file()
    assert so_path.parent.parent == cache_dir
    assert so_path.name == extension.extension_filename()
    assert so_path.parent.name.startswith(f"{ARCH}-")
    rng = random.Random(1234)
    a, b = rng.randrange(-10**9, 10**9), rng.randrange(-10**9, 10**9)
    # No GPU here: importing must not touch CUDA. block_size() lives in the .cu object, so a right
    # answer also shows the link took every source.
    printed = _run_in_fresh_process(
        "module = import_extension(argv[0])\n"
        "print(repr((module.__name__, module.add(int(argv[1]), int(argv[2])), module.answer(),"
        " module.block_size(), import_extension(argv[0]) is module)))\n",
        so_path, a, b,
    )
    assert printed == repr(("flashdmoe_cuda", a + b, 41, 256, True))


def test_build_ninja_has_one_object_per_source_and_the_required_flags(tiny_build, tiny_tree):
    so_path, _ = tiny_build
    ninja_text = (so_path.parent / "build.ninja").read_text()
    assert "objects/kernels/scale.cu.o" in ninja_text
    assert "objects/bindings.cpp.o" in ninja_text
    for flag in ("-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
                 "--expt-extended-lambda", "-Xcompiler=-fPIC,-O3", "-lineinfo", "-Xptxas=-v", "-DNDEBUG"):
        assert flag in ninja_text, flag
    assert f"-I{tiny_tree}" in ninja_text
    assert "-lcuda" not in ninja_text and "-ltorch" not in ninja_text and "libtorch" not in ninja_text


def test_tiny_tree_gets_no_generated_sources(tiny_build):
    so_path, _ = tiny_build
    assert "generated/" not in (so_path.parent / "build.ninja").read_text()
    assert not (so_path.parent / "generated").exists()


def test_kernel_tree_compiles_the_generated_variant_sources(toolchain, cache_dir, tmp_path, monkeypatch):
    """A tree with moe/launch.cu gets expert_variants' sources written into the build folder and compiled,
    and the variant table is part of the cache key."""
    tree = _write_tiny_tree(tmp_path / "tree", answer=5)
    (tree / "moe").mkdir()
    (tree / "moe" / "launch.cu").write_text(f'#include "{expert_variants.GENERATED_HEADER}"\n')
    sources = extension.collect_sources(tree)
    assert dict(sources.generated) == expert_variants.generated_sources()
    assert sources.generated_units() == expert_variants.instance_units()

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ninja_text = extension._write_build_ninja(out_dir, sources, ARCH, toolchain).read_text()
    for relative, text in sources.generated:
        assert (out_dir / relative).read_text() == text
    for unit in sources.generated_units():
        assert f"build objects/{unit}.o: cuda_compile {out_dir / unit}" in ninja_text
    assert f"-I{out_dir}" in ninja_text

    key = extension.cache_key(ARCH, tree)
    monkeypatch.setattr(expert_variants, "VARIANTS", expert_variants.VARIANTS[1:])
    assert extension.cache_key(ARCH, tree) != key


def test_second_build_is_a_cache_hit(tiny_build, tiny_tree, capfd):
    so_path, _ = tiny_build
    log_path = so_path.parent / extension.BUILD_LOG_NAME
    stamps = (so_path.stat().st_mtime_ns, log_path.stat().st_mtime_ns)
    capfd.readouterr()
    assert extension.build(arch=ARCH, source_dir=tiny_tree) == so_path
    assert extension.build_log_path(ARCH, tiny_tree) == log_path
    assert (so_path.stat().st_mtime_ns, log_path.stat().st_mtime_ns) == stamps
    assert "building" not in capfd.readouterr().err


def test_build_log_keeps_the_ptxas_register_report(tiny_build, tiny_tree):
    log_text = extension.build_log_path(ARCH, tiny_tree).read_text()
    assert "nvcc" in log_text and "-Xptxas=-v" in log_text  # ninja -v logs the commands
    report = extension.parse_ptxas_report(log_text)
    kernels = {entry.name: entry for entry in report}
    scale = kernels["_Z12scale_kernelPffi"]
    assert scale.arch == ARCH
    assert 0 < scale.registers <= 255
    assert scale.spill_store_bytes == 0 and scale.spill_load_bytes == 0


def test_cache_key_follows_sources_and_relative_paths(toolchain, cache_dir, tmp_path):
    tree = _write_tiny_tree(tmp_path / "tree", answer=7)
    original = extension.cache_key(ARCH, tree)
    assert len(original) == 64 and original == extension.cache_key(ARCH, tree)

    header = tree / "include" / "tiny.cuh"
    header_text = header.read_text()
    header.write_text(header_text + "// a header edit must invalidate the cache\n")
    assert extension.cache_key(ARCH, tree) != original
    header.write_text(header_text)
    assert extension.cache_key(ARCH, tree) == original

    kernel = tree / "kernels" / "scale.cu"
    kernel.rename(tree / "kernels" / "scale_renamed.cu")
    assert extension.cache_key(ARCH, tree) != original
    (tree / "kernels" / "scale_renamed.cu").rename(kernel)

    (tree / "notes.txt").write_text("not a source: ignored by the key")
    assert extension.cache_key(ARCH, tree) == original

    # The same contents elsewhere share the key: only relative paths count.
    copy = shutil.copytree(tree, tmp_path / "copy")
    assert extension.cache_key(ARCH, copy) == original


def test_changed_source_rebuilds_once_under_concurrent_builds(toolchain, cache_dir, tiny_build, tmp_path, capfd):
    old_so, _ = tiny_build
    tree = _write_tiny_tree(tmp_path / "tree", answer=random.Random(99).randrange(1000, 2000))
    expected_answer = int((tree / "include" / "tiny.cuh").read_text().split("=")[1].split(";")[0])
    capfd.readouterr()
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:  # two builders racing for the same cache folder
        futures = [pool.submit(extension.build, arch=ARCH, source_dir=tree) for _ in range(2)]
        results = [future.result() for future in futures]  # re-raises a builder's exception
    seconds = time.perf_counter() - started
    assert len(results) == 2 and results[0] == results[1]
    assert results[0] != old_so  # different sources, different cache folder
    assert capfd.readouterr().err.count("building flashdmoe_cuda (2 sources) ...") == 1  # the lock held
    _report(capfd, f"changed tree, two concurrent builds: {seconds:.1f} s")
    printed = _run_in_fresh_process(
        "print(import_extension(argv[0]).answer())\n"
        "try:\n"
        "    import_extension(argv[1])  # would otherwise silently return the first build's code\n"
        "except ImportError as error:\n"
        "    print(error)\n",
        results[0], old_so,
    )
    assert printed.startswith(f"flashdmoe_cuda is already imported in this process from {results[0]}")
    assert _run_in_fresh_process("print(import_extension(argv[0]).answer())", results[0]) == str(expected_answer)


def test_force_rebuilds(toolchain, tiny_build, tiny_tree, capfd):
    so_path, _ = tiny_build
    before = so_path.stat().st_mtime_ns
    capfd.readouterr()
    assert extension.build(arch=ARCH, source_dir=tiny_tree, force=True) == so_path
    assert so_path.stat().st_mtime_ns != before
    assert "building flashdmoe_cuda (2 sources) ..." in capfd.readouterr().err


def test_compile_error_reports_first_error_and_log(toolchain, cache_dir, tmp_path):
    tree = tmp_path / "tree"  # no bindings: the failing compile is the only job
    tree.mkdir()
    (tree / "broken.cu").write_text("__global__ void broken() { undeclared_symbol = 1; }\n")
    with pytest.raises(extension.BuildError) as caught:
        extension.build(arch=ARCH, source_dir=tree)
    message = str(caught.value)
    assert message.startswith("build failed: ")
    assert "undeclared_symbol" in message
    assert caught.value.log_path is not None and caught.value.log_path.is_file()
    assert f"full log at {caught.value.log_path}" in message
    assert not (caught.value.log_path.parent / extension.extension_filename()).exists()


def test_arch_argument_and_environment_are_validated(cache_dir, tiny_tree, monkeypatch):
    with pytest.raises(ValueError, match=r"arch='sm_80' is not supported.*sm_90a"):
        extension.build(arch="sm_80", source_dir=tiny_tree)
    monkeypatch.setenv("FLASHDMOE_CUDA_ARCH", "sm_86")
    with pytest.raises(ValueError, match=r"FLASHDMOE_CUDA_ARCH='sm_86' is not supported"):
        extension.resolve_arch()
    monkeypatch.setenv("FLASHDMOE_CUDA_ARCH", "90a")
    assert extension.resolve_arch() == "sm_90a"
    assert extension.gencode_flag("sm_90a") == "-gencode=arch=compute_90a,code=sm_90a"


def test_source_dir_errors(tmp_path):
    with pytest.raises(ValueError, match="source_dir=.*is not a directory"):
        extension.collect_sources(tmp_path / "missing")
    (tmp_path / "only_headers").mkdir()
    (tmp_path / "only_headers" / "a.cuh").write_text("#pragma once\n")
    with pytest.raises(extension.BuildError, match=r"no CUDA sources \(\*\.cu, \*\.cpp\)"):
        extension.collect_sources(tmp_path / "only_headers")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given on a machine without CUDA")
def test_unavailable_reason_names_the_missing_cuda_device(monkeypatch):
    monkeypatch.setattr(extension, "_status_cache", {})
    reason = extension.unavailable_reason()
    assert reason == "torch.cuda.is_available() is False (no CUDA device)"
    assert extension.available() is False
    with pytest.raises(BackendUnavailable, match=r"no CUDA device"):
        extension.load()
    assert extension.resolve_arch() == extension.DEFAULT_ARCH  # no GPU: build for sm_90a


def _pretend_gpu(monkeypatch, name: str, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(extension, "_status_cache", {})


def test_unavailable_reason_names_a_non_hopper_gpu(monkeypatch):
    monkeypatch.delenv("FLASHDMOE_CUDA_ARCH", raising=False)
    _pretend_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    assert extension.unavailable_reason() == (
        "GPU NVIDIA A100-SXM4-80GB has compute capability 8.0; the fused kernel needs Hopper (sm_90a)"
    )
    with pytest.raises(extension.BuildError, match="compute capability 8.0.*FLASHDMOE_CUDA_ARCH"):
        extension.resolve_arch()


def test_unavailable_reason_names_missing_nvcc(monkeypatch, tiny_tree):
    monkeypatch.delenv("FLASHDMOE_CUDA_ARCH", raising=False)
    _pretend_gpu(monkeypatch, "NVIDIA H200", (9, 0))
    monkeypatch.setattr(extension, "find_nvcc", lambda: None)
    assert extension.resolve_arch() == "sm_90a"
    assert extension.unavailable_reason(tiny_tree) == "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    assert extension.available(tiny_tree) is False


def test_tiny_build_embeds_sm_90a_sass(tiny_build):
    if extension.find_cuda_tool("cuobjdump") is None:
        skip_or_fail("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    so_path, _ = tiny_build
    assert set(extension.embedded_cubin_archs(so_path)) == {"sm_90a"}


def _needed_libraries(so_path: Path) -> list[str]:
    readelf = shutil.which("readelf")
    assert readelf is not None, "readelf (binutils) is needed to list the .so's dependencies"
    dynamic = subprocess.run([readelf, "-d", str(so_path)], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]


# The gate's out-of-line helpers run once per tile, at decode once per launch, from a cold instruction
# cache: their loops are kept rolled, and their size was their cost (docs/perf-notes.md, "Instruction fetch
# in the decode forward": 19.5 / 17.0 / 11.6 KB of SASS unrolled, 7.2 / 6.9 / 3.6 KB rolled).
_ONCE_PER_TILE_SASS_LIMITS = {"softmax_topk_rows": 12 << 10, "sum_gate_partials": 8 << 10}


def _sass_function_sizes(so_path, names):
    """(name, bytes) of every copy of the named device functions in the built module's cubins, from the
    symbol tables ``cuobjdump -elf`` prints."""
    result = subprocess.run([str(extension.find_cuda_tool("cuobjdump")), "-elf", str(so_path)], capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr
    pattern = re.compile(r"^\s*0x[0-9a-f]+\s+0x[0-9a-f]+\s+(0x[0-9a-f]+)\s+FUNC\b.*?(" + "|".join(names) + r")")
    return [(m.group(2), int(m.group(1), 16)) for m in map(pattern.match, result.stdout.splitlines()) if m]


def _check_once_per_tile_code_is_small(so_path):
    sizes = _sass_function_sizes(so_path, _ONCE_PER_TILE_SASS_LIMITS)
    found = {name for name, _ in sizes}
    assert found == set(_ONCE_PER_TILE_SASS_LIMITS), f"expected copies of {sorted(_ONCE_PER_TILE_SASS_LIMITS)}, found {sorted(found)}"
    over = [(name, size) for name, size in sizes if size > _ONCE_PER_TILE_SASS_LIMITS[name]]
    assert not over, f"once-per-tile gate code grew past its limit (bytes): {sorted(set(over))}"


@pytest.mark.cuda_compile
def test_real_csrc_compiles_for_sm_90a(toolchain, tmp_path, capsys, record_property):
    """CI's compile check: the real kernel compiles for sm_90a, holds sm_90a SASS, needs no driver."""
    source_dir = extension.default_source_dir()
    units = sorted(source_dir.rglob("*.cu")) + sorted(source_dir.rglob("*.cpp")) if source_dir.is_dir() else []
    if not units:
        pytest.fail(f"{source_dir} holds no *.cu / *.cpp: the compile check has nothing to compile")
    if extension.find_cuda_tool("cuobjdump") is None:
        skip_or_fail("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")

    started = time.perf_counter()
    so_path = extension.compile_sources(tmp_path / "build", arch=ARCH)
    seconds = time.perf_counter() - started
    record_property("compile_seconds", round(seconds, 1))

    archs = extension.embedded_cubin_archs(so_path)
    assert archs and set(archs) == {"sm_90a"}, archs
    _check_once_per_tile_code_is_small(so_path)
    report = extension.parse_ptxas_report((tmp_path / "build" / extension.BUILD_LOG_NAME).read_text())
    assert report and {entry.arch for entry in report} == {"sm_90a"}
    needed = _needed_libraries(so_path)
    assert not [lib for lib in needed if lib.startswith(("libcuda.", "libtorch", "libc10"))], needed

    # Importing must need no driver. In a child process: this one may already hold the tiny build.
    # The module's variants are the table's, in id order (the single source reached the binary).
    printed = _run_in_fresh_process("module = import_extension(argv[0])\nprint(repr((module.__name__, module.expert_variants())))",
                                    so_path)
    assert printed == repr(("flashdmoe_cuda", list(expert_variants.EXPERT_VARIANTS)))
    # prepare_forward checks a launch once, with no CUDA call (so no driver needed): bad input is a
    # ValueError naming what is wrong.
    printed = _run_in_fresh_process(
        "module = import_extension(argv[0])\n"
        "shared = dict(hidden=256, ffn=128, experts=8, top_k=2, world_size=1, stream_rows=64, dtype=0, activation=1,\n"
        "              normalize_topk=True, timeout_ns=10**9, debug_withhold_phase=0, expert_variant=0, max_blocks=0,\n"
        "              gate_split=False, grid_percent=100)\n"
        "rank = dict(workspace_bytes=1 << 30, tokens=32, capacity=32, rank=0, silent=False, peer_recv=[], peer_comb=[],\n"
        "            peer_signals=[])\n"
        "errors = []\n"
        "for change, where in (({'hidden': 200}, shared), ({'workspace_bytes': 64}, rank)):\n"
        "    try:\n"
        "        module.prepare_forward(dict(shared, **change) if where is shared else shared,\n"
        "                               [dict(rank, **change) if where is rank else rank])\n"
        "    except ValueError as error:\n"
        "        errors.append(str(error))\n"
        "prepared = module.prepare_forward(shared, [rank])\n"
        "print(repr((prepared.num_ranks, prepared.splits, errors)))\n",
        so_path)
    ranks, splits, errors = eval(printed)  # noqa: S307  (our own repr)
    assert ranks == 1 and splits == [] and len(errors) == 2, printed  # splits: chosen at the first launch
    assert "hidden size H=200" in errors[0] and "workspace holds 64 bytes" in errors[1], errors
    # Per (variant, dtype) of the table one kernel for each rank capacity of the parameter struct
    # (expert_variants.RANK_CAPACITIES), and one training instance (saving pre-activations, one rank) per
    # 16-bit (variant, dtype); nothing else.
    kernels = [entry.name for entry in report if "moe_forward_kernel" in entry.name]
    training = [name for name in kernels if "SavingPre" in name]
    assert len(kernels) - len(training) == len(expert_variants.RANK_CAPACITIES) * sum(
        len(variant.dtypes) for variant in expert_variants.VARIANTS), kernels
    assert len(training) == sum(len([d for d in variant.dtypes if d != "fp32"]) for variant in expert_variants.VARIANTS)

    generated = len(extension.collect_sources(source_dir).generated_units())
    lines = [f"real csrc/ ({len(units)} sources + {generated} generated) compiled for sm_90a in {seconds:.1f} s; "
             "ptxas report:"]
    lines += [f"  {entry.name}: {entry.registers} registers, spill stores {entry.spill_store_bytes} B, "
              f"spill loads {entry.spill_load_bytes} B, stack {entry.stack_frame_bytes} B" for entry in report]
    _report(capsys, "\n".join(lines))
