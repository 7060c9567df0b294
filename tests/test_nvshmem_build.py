"""The NVSHMEM transport module ``flashdmoe_nvshmem`` (flashdmoe.kernel.extension): where its sources and NVSHMEM
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

from build_checks import skip_or_fail
from flashdmoe.kernel import extension

REPO_ROOT = Path(__file__).resolve().parent.parent
ARCH = "sm_90a"



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
    # The transport build is the whole kernel module plus csrc/nvshmem/.
    assert set(transport.compile_units) - set(main.compile_units) == {
        p for p in transport.compile_units if nvshmem_dir in p.parents} != set()
    assert set(main.compile_units) < set(transport.compile_units) and set(main.headers) < set(transport.headers)


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
        skip_or_fail(str(error))
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
    assert "objects/generated/instances/" in text and "objects/moe/launch.cu.o" in text
    main = extension._write_build_ninja(tmp_path / "main", extension.collect_sources(REPO_ROOT / "csrc"), ARCH,
                                        toolchain).read_text()
    assert "-rdc" not in main and "nvshmem/module.cu" not in main and "link_libraries" not in main
    # Two modules, two keys; the main key does not depend on the transport module's sources or NVSHMEM.
    assert extension._key_inputs(tree, ARCH, toolchain, module)["module"] == "flashdmoe_nvshmem"
    main_key = extension.cache_key(ARCH, REPO_ROOT / "csrc")
    monkeypatch.setenv("FLASHDMOE_NVSHMEM_HOME", str(tmp_path / "elsewhere"))
    assert extension.cache_key(ARCH, REPO_ROOT / "csrc") == main_key


def test_transport_instances_come_from_the_variant_list():
    from flashdmoe.kernel import expert_variants

    generated = dict(extension.collect_nvshmem_sources(REPO_ROOT / "csrc").generated)
    main = dict(extension.collect_sources(REPO_ROOT / "csrc").generated)
    assert generated.keys() == main.keys()  # the same header and one unit per variant
    assert main == expert_variants.generated_sources()  # the main build's instances are unchanged
    header = generated[expert_variants.GENERATED_HEADER]
    assert '#include "nvshmem/nvshmem_transport.cuh"' in header
    for variant in expert_variants.VARIANTS:
        transported = f"WithTransport<{variant.cpp_type}, NvshmemTransport>"
        assert f"{transported}{{}}" in header  # the visitor reaches the transported instance by the same id
        unit = generated[expert_variants.instance_unit(variant)]
        assert unit.count(f"launch_forward_variant<") == len(variant.dtypes) and unit.count(transported) == 2 * len(variant.dtypes)
        assert "Nvshmem" not in main[expert_variants.instance_unit(variant)]
    with pytest.raises(ValueError, match="transport='Tcp'"):
        expert_variants.generated_sources("Tcp")


@pytest.mark.cuda_compile
@pytest.mark.slow
def test_transport_module_compiles_links_and_imports_without_nvshmem_running(tmp_path):
    try:
        extension.find_toolchain()
    except extension.BuildError as error:
        skip_or_fail(str(error))
    if extension.find_nvshmem() is None:
        skip_or_fail(extension.nvshmem_problem())
    so_path = extension.compile_nvshmem_sources(tmp_path / "out", ARCH, REPO_ROOT / "csrc")
    assert so_path.name == extension.extension_filename("flashdmoe_nvshmem")
    report = {r.name: r for r in extension.parse_ptxas_report((so_path.parent / "build.log").read_text())}
    smoke = [r for name, r in report.items() if "smoke_kernel" in name]
    assert smoke and smoke[0].arch == ARCH and smoke[0].spill_store_bytes == 0
    # The fused kernel's instances all publish through NvshmemTransport: each variant and dtype, inference
    # and training.
    kernels = [r for name, r in report.items() if "moe_forward_kernel" in name]
    from flashdmoe.kernel import expert_variants

    # An inference instance per rank capacity, and a one-rank training instance except for fp32 (teams and
    # the backward carry 16-bit inputs).
    capacities = len(expert_variants.RANK_CAPACITIES)
    expected = sum(capacities + (dtype != "fp32") for v in expert_variants.VARIANTS for dtype in v.dtypes)
    assert len(kernels) == expected, sorted(report)
    assert all("NvshmemTransport" in r.name for r in kernels)
    assert all(r.registers <= 168 for r in kernels)  # __launch_bounds__ of the default variant leaves no more
    # A fresh interpreter: the module imports with no GPU and no NVSHMEM initialised, and says so when
    # asked to bind its device state (the host library is the one found through the rpath).
    code = (
        "import sys\nfrom flashdmoe.kernel.extension import import_extension\n"
        "kernel = import_extension(sys.argv[1], 'flashdmoe_cuda')\n"  # the same .so holds both modules
        "assert 'tma-wgmma-128x256-4stage-prefetch' in kernel.expert_variants(), kernel.expert_variants()\n"
        "m = import_extension(sys.argv[1], 'flashdmoe_nvshmem')\n"
        "print(m.NVSHMEM_VERSION, m.init_status(), m.SMOKE_SLOTS)\n"
        "try:\n    m.init_device_state(bytes(128), 0, 1)\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(so_path)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stderr
    assert "refused: NVSHMEM is not initialised in this process" in result.stdout
    assert " 0 6" in result.stdout.splitlines()[0]  # init status 0 (not initialised), 6 smoke slots
