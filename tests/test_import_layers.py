"""The core package never imports the benchmarks: ``flashdmoe.bench`` builds on ``flashdmoe``, never the
reverse (so the benchmarks can change, or be absent, without touching the layer).

Checked twice: statically, every import in every module under ``flashdmoe/`` outside ``flashdmoe/bench/``
(module level or inside a function, absolute or relative, and by name through ``importlib``); and at run
time, importing ``flashdmoe`` and each core module in a fresh interpreter loads no ``flashdmoe.bench``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


def bench_imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, what) of every reference to ``flashdmoe.bench`` by import in ``path`` (a module of the
    ``flashdmoe`` package at ``package``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path, package)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {alias.name}") for alias in node.names if _is_bench(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
            if any(_is_bench(target) for target in targets):
                names = ", ".join(alias.name for alias in node.names)
                found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import {names}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_bench(node.value):
            # importlib.import_module("flashdmoe.bench..."), __import__, or a "module:function" name
            found.append((node.lineno, f"the name {node.value!r}"))
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
