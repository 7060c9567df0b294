"""The expert-variant names Python passes to the kernel agree with the C++ side (CPU only: reads the
sources). A variant added in one place only, or a name whose tile / stage count is not the one compiled,
fails here instead of silently launching another kernel."""

import re
from pathlib import Path

from flashdmoe import cuda_backend

CSRC = Path(__file__).resolve().parent.parent / "csrc"

# ExpertMma enumerator -> (name prefix, name suffix) in cuda_backend.EXPERT_VARIANTS.
FAMILIES = {
    "MmaSync": ("mma.sync-", ""),
    "WgmmaTmaPrefetch": ("tma-wgmma-", "-prefetch"),
}


def _dispatch_cases():
    """Variant id -> C++ alias, from launch.cu's with_instance switch."""
    text = (CSRC / "moe" / "launch.cu").read_text()
    return {int(i): alias for i, alias in re.findall(r"case (\d+): return visit\(element, (\w+)\{\}\);", text)}


def _aliases():
    """C++ alias -> (ExpertMma, tile N, stages, id in the trailing comment), from tile_config.cuh."""
    text = (CSRC / "moe" / "tile_config.cuh").read_text()
    pattern = r"using (\w+) = ExpertVariant<ExpertMma::(\w+), (\d+), (\d+), \d+>;\s*// (\d+)"
    return {alias: (mma, int(n), int(stages), int(i)) for alias, mma, n, stages, i in re.findall(pattern, text)}


def test_every_python_variant_has_a_kernel_instance_and_back():
    cases = _dispatch_cases()
    assert cases, "no dispatch cases found in csrc/moe/launch.cu"
    assert sorted(cases) == sorted(cuda_backend.EXPERT_VARIANTS.values())
    instances = {p.read_text() for p in (CSRC / "moe" / "instances").glob("*.cu")}
    for alias in cases.values():
        assert any(f"FLASHDMOE_INSTANTIATE_VARIANT({alias})" in text for text in instances), alias


def test_variant_names_match_the_compiled_tile_and_stages():
    cases, aliases = _dispatch_cases(), _aliases()
    for name, variant_id in cuda_backend.EXPERT_VARIANTS.items():
        mma, tile_n, stages, comment_id = aliases[cases[variant_id]]
        assert comment_id == variant_id, f"{cases[variant_id]} is commented as id {comment_id}, dispatched as {variant_id}"
        prefix, suffix = FAMILIES[mma]
        assert name == f"{prefix}128x{tile_n}-{stages}stage{suffix}", (name, mma, tile_n, stages)


def test_default_and_fp32_variants_are_known():
    assert cuda_backend.DEFAULT_EXPERT_VARIANT in cuda_backend.EXPERT_VARIANTS
    fp32_id = int(re.search(r"kFp32ExpertVariant = (\d+);", (CSRC / "moe" / "tile_config.cuh").read_text()).group(1))
    assert cuda_backend.EXPERT_VARIANTS[cuda_backend.FP32_EXPERT_VARIANT] == fp32_id
