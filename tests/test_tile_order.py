"""The expert GEMMs' task order (csrc/common/tile_order.cuh): a host program compiled with nvcc checks that
the grouped order visits every tile once and that no group straddles two experts (tests/cuda/)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from build_checks import skip_or_fail
from flashdmoe.kernel import extension

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def nvcc() -> Path:
    found = extension.find_nvcc()
    if found is None:
        skip_or_fail("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    return found


def test_grouped_order_visits_every_tile_once_and_groups_stay_inside_an_expert(nvcc, tmp_path, seed):
    binary = tmp_path / "tile_order_check"
    subprocess.run([str(nvcc), "-std=c++17", f"-I{ROOT / 'csrc'}", str(ROOT / "tests" / "cuda" / "tile_order_check.cu"),
                    "-o", str(binary)], check=True, capture_output=True, text=True, timeout=600)
    run = subprocess.run([str(binary), str(seed % 2**31)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", f"seed {seed}: {run.stdout}{run.stderr}"
