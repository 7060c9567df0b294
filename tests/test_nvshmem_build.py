"""The NVSHMEM transport module ``flashdmoe_nvshmem`` (flashdmoe.extension): where its sources and NVSHMEM
come from, how it is compiled and linked (relocatable device code, libnvshmem_device, the wheel's host
library), and that ``flashdmoe_cuda``'s build does not change.

The compile test needs nvcc and an NVSHMEM tree (the nvidia-nvshmem-cu13 wheel, or
``FLASHDMOE_NVSHMEM_HOME``): without them it skips locally and fails in CI, like tests/test_extension.py.
Nothing runs on a GPU here; scripts/nvshmem_smoke.py runs the module on one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashdmoe import extension

REPO_ROOT = Path(__file__).resolve().parent.parent
ARCH = "sm_90a"


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this is a failure, not a skip)")
    pytest.skip(reason)


def _fake_nvshmem(root: Path) -> Path:
    (root / "include").mkdir(parents=True)
    (root / "lib").mkdir()
    for name in ("include/nvshmem.h", "lib/libnvshmem_device.a", "lib/libnvshmem_host.so.3"):
        (root / name).write_text("")
    return root


def test_main_tree_leaves_out_the_transport_sources():
    main = extension.collect_sources(REPO_ROOT / "csrc")
    transport = extension.collect_nvshmem_sources(REPO_ROOT / "csrc")
    nvshmem_dir = REPO_ROOT / "csrc" / extension.NVSHMEM_SUBDIR
    assert not [p for p in main.compile_units + main.headers if nvshmem_dir in p.parents]
    assert transport.compile_units and all(nvshmem_dir in p.parents for p in transport.compile_units)
    # The transport module may include the kernel's headers: they are part of its key.
    assert set(main.headers) <= set(transport.headers)


def test_transport_tree_without_sources_is_a_build_error(tmp_path):
    (tmp_path / "kernel.cu").write_text("")
    with pytest.raises(extension.BuildError, match="no NVSHMEM transport sources"):
        extension.collect_nvshmem_sources(tmp_path)
    with pytest.raises(ValueError, match="source_dir="):
        extension.collect_nvshmem_sources(tmp_path / "missing")


def test_nvshmem_home_is_found_or_named_in_the_problem(tmp_path, monkeypatch):
    home = _fake_nvshmem(tmp_path / "nvshmem")
    monkeypatch.setenv("FLASHDMOE_NVSHMEM_HOME", str(home))
    library = extension.find_nvshmem()
    assert library == extension.NvshmemLibrary(home / "include", home / "lib", home / "lib" / "libnvshmem_device.a",
                                               home / "lib" / "libnvshmem_host.so.3")
    assert extension.nvshmem_problem() is None
    (home / "lib" / "libnvshmem_device.a").unlink()
    assert extension.find_nvshmem() is None  # an explicit home does not fall back to another install
    assert "FLASHDMOE_NVSHMEM_HOME" in extension.nvshmem_problem() and "libnvshmem_device.a" in extension.nvshmem_problem()
    with pytest.raises(extension.BuildError, match="cannot build flashdmoe_nvshmem"):
        extension.compile_nvshmem_sources(tmp_path / "out", source_dir=REPO_ROOT / "csrc")


def test_nvshmem_ninja_is_relocatable_and_links_nvshmem_after_the_objects(tmp_path, monkeypatch):
    try:
        toolchain = extension.find_toolchain()
    except extension.BuildError as error:
        _skip_or_fail(str(error))
    home = _fake_nvshmem(tmp_path / "nvshmem")
    monkeypatch.setenv("FLASHDMOE_NVSHMEM_HOME", str(home))
    library = extension.find_nvshmem()
    module = extension.nvshmem_module_build(ARCH, library)
    tree = extension.collect_nvshmem_sources(REPO_ROOT / "csrc")
    (tmp_path / "nv").mkdir()
    (tmp_path / "main").mkdir()
    text = extension._write_build_ninja(tmp_path / "nv", tree, ARCH, toolchain, module).read_text()
    compile_flags = next(line for line in text.splitlines() if line.startswith("nvcc_flags ="))
    assert "-rdc=true" in compile_flags and "-Xptxas=-v" in compile_flags
    assert f"-I{home / 'include'}" in text
    link_rule = next(line for line in text.splitlines() if "$link_flags" in line)
    assert link_rule.index("$in") < link_rule.index("$link_libraries")
    libraries = next(line for line in text.splitlines() if line.startswith("link_libraries ="))
    assert "-lnvshmem_device" in libraries and f"-Xlinker={library.host_lib}" in libraries
    assert f"-rpath,{library.lib}" in libraries
    assert "build flashdmoe_nvshmem" in text and "objects/nvshmem/module.cu.o" in text
    assert "objects/generated/nvshmem_instances/" in text
    main = extension._write_build_ninja(tmp_path / "main", extension.collect_sources(REPO_ROOT / "csrc"), ARCH,
                                        toolchain).read_text()
    assert "-rdc" not in main and "nvshmem/module.cu" not in main and "link_libraries" not in main
    # Two modules, two keys; the main key does not depend on the transport module's sources or NVSHMEM.
    assert extension._key_inputs(tree, ARCH, toolchain, module)["module"] == "flashdmoe_nvshmem"
    main_key = extension.cache_key(ARCH, REPO_ROOT / "csrc")
    monkeypatch.setenv("FLASHDMOE_NVSHMEM_HOME", str(tmp_path / "elsewhere"))
    assert extension.cache_key(ARCH, REPO_ROOT / "csrc") == main_key


def test_transport_instances_come_from_the_variant_list():
    from flashdmoe import expert_variants

    (path, text), = extension.nvshmem_generated_sources().items()
    default = expert_variants.VARIANTS[0]
    assert path == expert_variants.instance_unit(default).replace("/instances/", "/nvshmem_instances/")
    transported = f"WithTransport<{default.cpp_type}, NvshmemTransport>"
    for element in ("__nv_bfloat16", "__half"):
        assert f"moe_forward_kernel<{element}, {transported}>" in text
        assert f"moe_forward_kernel<{element}, SavingPre<{transported}>>" in text
    assert "float," not in text  # teams carry 16-bit inputs only
    assert '#include "nvshmem/nvshmem_transport.cuh"' in text
    tree = extension.collect_nvshmem_sources(REPO_ROOT / "csrc")
    assert dict(tree.generated) == {path: text}
    # The main module's generated units never see the NVSHMEM transport.
    assert all("Nvshmem" not in unit for unit in dict(extension.collect_sources(REPO_ROOT / "csrc").generated).values())


@pytest.mark.cuda_compile
@pytest.mark.slow
def test_transport_module_compiles_links_and_imports_without_nvshmem_running(tmp_path):
    try:
        extension.find_toolchain()
    except extension.BuildError as error:
        _skip_or_fail(str(error))
    if extension.find_nvshmem() is None:
        _skip_or_fail(extension.nvshmem_problem())
    so_path = extension.compile_nvshmem_sources(tmp_path / "out", ARCH, REPO_ROOT / "csrc")
    assert so_path.name == extension.extension_filename("flashdmoe_nvshmem")
    report = {r.name: r for r in extension.parse_ptxas_report((so_path.parent / "build.log").read_text())}
    smoke = [r for name, r in report.items() if "smoke_kernel" in name]
    assert smoke and smoke[0].arch == ARCH and smoke[0].spill_store_bytes == 0
    # The fused kernel's NVSHMEM-transport instances: bf16 and fp16, inference and training, one block per SM.
    transported = [r for name, r in report.items() if "moe_forward_kernel" in name and "NvshmemTransport" in name]
    assert len(transported) == 4, sorted(report)
    assert {("13__nv_bfloat16" in r.name, "SavingPre" in r.name) for r in transported} == {
        (True, True), (True, False), (False, True), (False, False)}
    assert all(r.registers <= 168 for r in transported)  # __launch_bounds__(288, 1) leaves no more
    # A fresh interpreter: the module imports with no GPU and no NVSHMEM initialised, and says so when
    # asked to bind its device state (the host library is the one found through the rpath).
    code = (
        "import sys\nfrom flashdmoe.extension import import_extension\n"
        "m = import_extension(sys.argv[1], 'flashdmoe_nvshmem')\n"
        "print(m.NVSHMEM_VERSION, m.init_status(), m.SMOKE_SLOTS)\n"
        "try:\n    m.init_device_state()\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(so_path)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr
    assert "refused: NVSHMEM is not initialised in this process" in result.stdout
    assert " 0 6" in result.stdout.splitlines()[0]  # init status 0 (not initialised), 6 smoke slots
