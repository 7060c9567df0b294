"""The expert-variant table (flashdmoe/expert_variants.py) is the one source of the variants: the C++ it
generates dispatches exactly its variants, ids and dtypes, and csrc/ names none of its own (CPU only).
The built module's list is checked against the table by tests/test_extension.py's compile check."""

import dataclasses
import re
from pathlib import Path

import pytest

from flashdmoe import cuda_backend, expert_variants
from flashdmoe.expert_variants import EXPERT_VARIANTS, VARIANTS, ExpertVariant

CSRC = Path(__file__).resolve().parent.parent / "csrc"
ELEMENTS = {"__nv_bfloat16": "bf16", "__half": "fp16", "float": "fp32"}
DTYPE_CODES = {"DType::BFloat16": "bf16", "DType::Float16": "fp16", "DType::Float32": "fp32"}
CPP_VARIANT = r"ExpertVariant<ExpertMma::(\w+), (\d+), (\d+), (\d+)>"


def _fields(variant: ExpertVariant):
    return variant.mma, variant.tile_n, variant.stages, variant.blocks_per_sm


def _cpp_fields(match):
    mma, tile_n, stages, blocks = match
    return mma, int(tile_n), int(stages), int(blocks)


def test_generated_dispatch_reaches_exactly_the_table():
    header = expert_variants.generated_sources()[expert_variants.GENERATED_HEADER]
    cases = re.findall(r"case (\d+):  // (\S+)\n((?:      if .*\n)+)      break;", header)
    assert [(int(index), name) for index, name, _ in cases] == [(i, v.name) for i, v in enumerate(VARIANTS)]
    for (_, _, body), variant in zip(cases, VARIANTS):
        visits = re.findall(r"if \(dtype == (DType::\w+)\) return visit\((\w+)\{\}, " + CPP_VARIANT + r"\{\}\);", body)
        assert [(DTYPE_CODES[code], ELEMENTS[element]) for code, element, *_ in visits] == [
            (dtype, dtype) for dtype in variant.dtypes]
        assert {_cpp_fields(v[2:]) for v in visits} == {_fields(variant)}
    names = re.search(r"kExpertVariantNames\[kExpertVariantCount\] = \{(.*)\};", header).group(1)
    assert re.findall(r'"([^"]+)"', names) == list(EXPERT_VARIANTS)
    assert f"kExpertVariantCount = {len(VARIANTS)};" in header
    fp32 = int(re.search(r"kFp32ExpertVariant = (\d+);", header).group(1))
    assert VARIANTS[fp32].name == expert_variants.FP32_EXPERT_VARIANT


def test_one_generated_unit_per_variant_and_rank_capacity_instantiates_exactly_its_dtypes():
    """Per variant a unit of one-rank launches (which also answers kernel_attributes) and one of emulated
    teams' launches (the kMaxRanks parameter struct)."""
    sources = expert_variants.generated_sources()
    units = {path: text for path, text in sources.items() if path.endswith(".cu")}
    assert sorted(units) == sorted(expert_variants.instance_units())
    assert len(units) == len(VARIANTS) * len(expert_variants.RANK_CAPACITIES) == len(set(units))
    for variant in VARIANTS:
        for suffix, capacity in expert_variants.RANK_CAPACITIES.items():
            text = units[expert_variants.instance_unit(variant, suffix)]
            found = re.findall(rf"template \w+ launch_forward_variant<(\w+), {CPP_VARIANT}, (\w+)>\(", text)
            assert [ELEMENTS[element] for element, *_ in found] == list(variant.dtypes), (variant.name, suffix)
            assert {_cpp_fields(f[1:5]) for f in found} == {_fields(variant)}
            assert {f[5] for f in found} == {capacity}
            attributes = re.findall(rf"template \w+ kernel_attributes_variant<(\w+), {CPP_VARIANT}>", text)
            want = list(variant.dtypes) if capacity == "1" else []
            assert [ELEMENTS[element] for element, *_ in attributes] == want, (variant.name, suffix)
    assert set(expert_variants.RANK_CAPACITIES.values()) == {"1", "kMaxRanks"}


def test_csrc_names_no_variant_of_its_own():
    """No instance files, aliases or dispatch cases in csrc/: launch.cu dispatches through the generated
    header only."""
    assert not (CSRC / "moe" / "instances").exists()
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".cu", ".cuh", ".h", ".cpp"):
            continue
        text = path.read_text()
        assert not re.search(r"template \w+ (launch_forward|kernel_attributes)_variant<", text), path
        assert not re.search(r"ExpertVariant<ExpertMma::\w+, \d+", text), path
    launch = (CSRC / "moe" / "launch.cu").read_text()
    assert f'#include "{expert_variants.GENERATED_HEADER}"' in launch
    assert launch.count("visit_expert_instance(") == 2 and "switch" not in launch


def test_names_ids_default_and_fp32():
    assert len(set(EXPERT_VARIANTS)) == len(VARIANTS)
    assert list(EXPERT_VARIANTS.values()) == list(range(len(VARIANTS)))
    assert expert_variants.DEFAULT_EXPERT_VARIANT == "tma-wgmma-128x256-4stage-prefetch"
    assert expert_variants.FP32_EXPERT_VARIANT == "mma.sync-128x128-3stage"
    # The backend launches with the table's ids.
    assert cuda_backend.variant_id is expert_variants.variant_id
    assert cuda_backend.DEFAULT_EXPERT_VARIANT == expert_variants.DEFAULT_EXPERT_VARIANT


def test_variant_id_rejects_an_unknown_name():
    assert expert_variants.variant_id("mma.sync-128x128-3stage") == EXPERT_VARIANTS["mma.sync-128x128-3stage"]
    with pytest.raises(ValueError, match=r"expert_variant='tma-wgmma-128x256-4stage-cluster2' is not compiled"):
        expert_variants.variant_id("tma-wgmma-128x256-4stage-cluster2")


def test_the_table_refuses_variants_the_kernel_cannot_compile():
    tma = VARIANTS[0]
    with pytest.raises(ValueError, match=r"fp32 \(TF32\) inputs run on the MmaSync tiles only"):
        dataclasses.replace(tma, dtypes=("bf16", "fp32"))
    with pytest.raises(ValueError, match=r"mma='Wgmma' is not an ExpertMma enumerator"):
        dataclasses.replace(tma, mma="Wgmma")
    with pytest.raises(ValueError, match=r"dtypes=\('int8',\)"):
        dataclasses.replace(tma, dtypes=("int8",))
