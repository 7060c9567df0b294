"""The package's layers import downwards only.

* The core package never imports the benchmarks: ``flashdmoe.bench`` builds on ``flashdmoe``, never the
  reverse (so the benchmarks can change, or be absent, without touching the layer). Checked twice:
  statically, every import in every module under ``flashdmoe/`` outside ``flashdmoe/bench/`` (module level
  or inside a function, absolute or relative, and by name through ``importlib``); and at run time,
  importing ``flashdmoe`` and each core module in a fresh interpreter loads no ``flashdmoe.bench``.
* The folders below the fused layer (docs/architecture.md): ``kernel/`` (the kernel's launch path)
  imports only itself and the base modules (errors, numerics, the reference, validation); ``parallel/``
  (teams) adds ``kernel/``; ``backward/`` adds ``parallel/``. Nothing there imports ``cuda_backend``,
  the API or anything above it. Checked statically with the same scan.
* The device scripts (scripts/, run only on a GPU machine) import only modules and names the package has,
  and the probe scripts' edits of csrc/ (kernels built with a part changed) still find their text.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "flashdmoe"
BENCH = "flashdmoe.bench"
#: Core files allowed to load the benchmarks, and why: the command line hands ``flashdmoe bench ...`` to
#: them (inside the function that adds the subcommand, never when the CLI module is imported).
ALLOWED = {"flashdmoe/cli.py": "the `flashdmoe bench` subcommand"}


def _core_files() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if (PACKAGE / "bench") not in path.parents)


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_bench(name: str) -> bool:
    return name == BENCH or name.startswith(BENCH + ".") or name.startswith(BENCH + ":")


def _import_nodes(path: Path, package: Path = PACKAGE):
    """Every import in ``path`` (a module of the ``flashdmoe`` package at ``package``) as (node, source,
    names): ``import`` nodes with their dotted names (source None), ``from`` nodes with their module
    resolved (relative ones against this module's package) and the names they take, and string
    constants (importlib, ``module:function`` names) as (node, None, [the string])."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path, package)
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, None, [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield node, source, [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node, None, [node.value]


def bench_imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, what) of every reference to ``flashdmoe.bench`` by import in ``path`` (a module of the
    ``flashdmoe`` package at ``package``)."""
    found = []
    for node, source, names in _import_nodes(path, package):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {name}") for name in names if _is_bench(name)]
        elif isinstance(node, ast.ImportFrom):
            if any(_is_bench(target) for target in [source] + [f"{source}.{name}" for name in names]):
                found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import {', '.join(names)}"))
        elif _is_bench(names[0]):
            # importlib.import_module("flashdmoe.bench..."), __import__, or a "module:function" name
            found.append((node.lineno, f"the name {names[0]!r}"))
    return sorted(found)


def test_the_scan_sees_every_kind_of_import(tmp_path):
    """The scanner itself, on a module written to import the benchmarks in each way it looks for."""
    fake = tmp_path / "flashdmoe" / "ranks"
    fake.mkdir(parents=True)
    source = fake / "sample.py"
    source.write_text(
        "import flashdmoe.bench.timing\n"
        "from flashdmoe import bench\n"
        "from flashdmoe.bench import registry\n"
        "def later():\n"
        "    from ..bench.timing import measure\n"
        "    from .. import bench as b\n"
        "    import importlib\n"
        "    return importlib.import_module('flashdmoe.bench')\n"
        "SCENARIO = 'flashdmoe.bench.rank_scenarios:nccl_forwards'\n"
        "from flashdmoe import benchmarks_elsewhere, reference\n"
        "from . import bench\n"  # flashdmoe.ranks.bench: not the benchmarks
    )
    found = bench_imports(source, tmp_path / "flashdmoe")
    assert [line for line, _ in found] == [1, 2, 3, 5, 6, 8, 9], found


def test_core_modules_do_not_import_the_benchmarks():
    files = _core_files()
    assert PACKAGE / "ranks" / "launcher.py" in files and PACKAGE / "cli.py" in files  # the scan sees the core
    offending = []
    for path in files:
        relative = path.relative_to(PACKAGE.parent).as_posix()
        found = bench_imports(path)
        if relative in ALLOWED:
            tree = ast.parse(path.read_text())
            top_level = {node.lineno for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))}
            assert not top_level & {line for line, _ in found}, f"{relative} may load {BENCH} only when used"
            continue
        offending += [f"{relative}:{line}: {what}" for line, what in found]
    assert not offending, f"the core package must not import {BENCH}:\n" + "\n".join(offending)


def test_importing_the_core_loads_no_benchmark_module():
    modules = [_module_name(path) for path in _core_files() if path.name != "__main__.py"]  # __main__ runs
    script = (
        "import importlib, sys\n"
        f"for name in ['flashdmoe'] + {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"    loaded = sorted(m for m in sys.modules if m == {BENCH!r} or m.startswith({BENCH + '.'!r}))\n"
        "    if loaded:\n"
        "        sys.exit(f'importing {name} loaded {loaded}')\n"
        "print(len(sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-3000:]


#: The modules below the kernel's launch path: every layer may import them.
BASE = ("flashdmoe.errors", "flashdmoe.numerics", "flashdmoe.reference", "flashdmoe.validation")
#: Folder -> what its modules may import from the package (the folder itself, the layers below, BASE).
LAYERS = {
    "kernel": ("flashdmoe.kernel",) + BASE,
    "parallel": ("flashdmoe.parallel", "flashdmoe.kernel") + BASE,
    "backward": ("flashdmoe.backward", "flashdmoe.parallel", "flashdmoe.kernel") + BASE,
}


def package_imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) of every module of the ``flashdmoe`` package that ``path`` imports: ``import X``,
    ``from X import name`` (``X.name`` where that is a module of the package, else ``X``), relative forms
    resolved, and module names written as strings (``importlib``)."""
    root = package.parent

    def is_module(name: str) -> bool:
        target = root.joinpath(*name.split("."))
        return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()

    found = []
    for node, source, names in _import_nodes(path, package):
        if isinstance(node, ast.Import):
            found += [(node.lineno, name) for name in names if name.split(".")[0] == "flashdmoe"]
        elif isinstance(node, ast.ImportFrom):
            if source.split(".")[0] == "flashdmoe":
                found += [(node.lineno, f"{source}.{name}" if is_module(f"{source}.{name}") else source)
                          for name in names]
        elif names[0].startswith("flashdmoe.") and is_module(names[0].split(":")[0]):
            found.append((node.lineno, names[0].split(":")[0]))
    return sorted(set(found))


def test_the_package_scan_resolves_every_form(tmp_path):
    """package_imports on a module written to import the package in each way it looks for."""
    root = tmp_path / "flashdmoe"
    for folder in ("kernel", "parallel"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    for name in ("kernel/extension.py", "parallel/team.py", "api.py", "errors.py"):
        (root / name).write_text("")
    source = root / "kernel" / "sample.py"
    source.write_text(
        "from flashdmoe.kernel import extension\n"
        "from flashdmoe import errors, api\n"
        "def later():\n"
        "    from ..parallel.team import Team\n"
        "    from . import extension\n"
        "    import importlib\n"
        "    return importlib.import_module('flashdmoe.api')\n"
    )
    assert package_imports(source, root) == [(1, "flashdmoe.kernel.extension"), (2, "flashdmoe.api"),
                                             (2, "flashdmoe.errors"), (4, "flashdmoe.parallel.team"),
                                             (5, "flashdmoe.kernel.extension"), (7, "flashdmoe.api")]


def test_lower_layers_import_nothing_above_them():
    offending = []
    for folder, allowed in LAYERS.items():
        files = sorted((PACKAGE / folder).glob("*.py"))
        assert files, f"flashdmoe/{folder}/ has no modules"
        for path in files:
            for line, name in package_imports(path):
                if not any(name == ok or name.startswith(ok + ".") for ok in allowed):
                    offending.append(f"{path.relative_to(PACKAGE.parent).as_posix()}:{line}: imports {name}")
    for path in (PACKAGE.parent / (name.replace(".", "/") + ".py") for name in BASE):
        offending += [f"{path.relative_to(PACKAGE.parent).as_posix()}:{line}: imports {name}"
                      for line, name in package_imports(path) if name not in BASE]
    assert not offending, "a layer imports one above it (docs/architecture.md):\n" + "\n".join(offending)


def test_the_device_scripts_import_what_the_package_has():
    """scripts/ runs only on a GPU machine (nothing here executes it), so a module that moved or a name that
    went away would break it unseen: every ``import`` / ``from ... import`` of ``flashdmoe`` in scripts/
    must resolve (the module imports, the name is an attribute or a submodule of it)."""
    import importlib

    scripts = sorted((PACKAGE.parent / "scripts").glob("*.py"))
    assert scripts, "no scripts found"
    missing = []
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                targets = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in targets:
                if module.split(".")[0] != "flashdmoe":
                    continue
                where = f"{path.name}:{node.lineno}"
                try:
                    imported = importlib.import_module(module)
                except ImportError as error:
                    missing.append(f"{where}: {module} ({error})")
                    continue
                if name is None or hasattr(imported, name):
                    continue
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{where}: {module} has no {name}")
    assert not missing, "scripts import what the package does not have:\n" + "\n".join(missing)


# The scripts that build probe kernels (they call probe_build or probe_patch from scripts/probe_build.sh).
PROBE_SCRIPTS = sorted(path.name for path in (PACKAGE.parent / "scripts").glob("*.sh")
                       if re.search(r"^\s*probe_(build|patch) ", path.read_text(), flags=re.M))


def test_there_are_probe_scripts():
    assert PROBE_SCRIPTS, "no script under scripts/ calls probe_build"
    assert "cluster_units_probe.sh" in PROBE_SCRIPTS  # a probe_patch script is found too


@pytest.mark.parametrize("script", PROBE_SCRIPTS)
def test_the_probe_scripts_edits_apply_to_the_sources(script, tmp_path):
    """The probe scripts build the kernel from csrc/ with text replaced (scripts/probe_build.sh); a probe
    whose text moved in the sources would time an unchanged kernel, or fail on the GPU machine. Each
    probe's edits, applied without building (PROBE_CHECK_ONLY), must all match."""
    root = PACKAGE.parent
    env = {**os.environ, "PROBE_CHECK_ONLY": "1", "OUT": str(tmp_path)}
    run = subprocess.run(["bash", str(root / "scripts" / script)], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    probes = re.findall(r"^\s*\[(\w+)\]=", (root / "scripts" / script).read_text(), flags=re.M)
    assert probes, f"{script}: no probes found"
    for probe in probes:
        assert re.search(rf"^\w*_{probe}: every edit applies", run.stdout, flags=re.M), \
            f"{script}, probe {probe}:\n{run.stdout}\n{run.stderr}"


@pytest.mark.parametrize("more, sides", [(None, ["base", "new"]), ("", ["base", "new"]),
                                         ("a=/x,b=/y", ["base", "a", "b", "new"])])
def test_the_ab_sides_with_and_without_more_trees(more, sides):
    """forward_ab.sh and backward_ab.sh run under ``set -u``: the sides of an A/B must come out whether or
    not AB_MORE names further trees, and each further side's environment must name its tree."""
    root = PACKAGE.parent
    env = {k: v for k, v in os.environ.items() if k != "AB_MORE"}
    if more is not None:
        env["AB_MORE"] = more
    script = f"set -u; source {root / 'scripts' / 'probe_build.sh'}; ab_sides; ab_env a"
    run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.split()
    assert lines[:len(sides)] == sides, run.stdout
    assert lines[len(sides):] == (["FLASHDMOE_SOURCE_DIR=/x", "FLASHDMOE_CACHE_DIR=/tmp/ab_a_cache"] if more else [])
