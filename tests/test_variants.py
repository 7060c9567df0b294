"""The expert-variant table (flashdmoe/kernel/expert_variants.py) is the one source of the variants: the C++ it
generates dispatches exactly its variants, ids and dtypes, and csrc/ names none of its own (CPU only).
The built module's list is checked against the table by tests/test_extension.py's compile check."""

import dataclasses
import re
from pathlib import Path

import pytest

from flashdmoe import cuda_backend
from flashdmoe.kernel import expert_variants
from flashdmoe.kernel.expert_variants import EXPERT_VARIANTS, VARIANTS, ExpertVariant

CSRC = Path(__file__).resolve().parent.parent / "csrc"
ELEMENTS = {"__nv_bfloat16": "bf16", "__half": "fp16", "float": "fp32"}
DTYPE_CODES = {"DType::BFloat16": "bf16", "DType::Float16": "fp16", "DType::Float32": "fp32"}
CPP_VARIANT = r"ExpertVariant<ExpertMma::(\w+), (\d+), (\d+), (\d+), (\d+), (\d+)>"


def _fields(variant: ExpertVariant):
    return variant.mma, variant.tile_n, variant.stages, variant.blocks_per_sm, variant.row_box, variant.cluster


def _cpp_fields(match):
    mma, tile_n, stages, blocks, row_box, cluster = match
    return mma, int(tile_n), int(stages), int(blocks), int(row_box), int(cluster)


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
            assert {_cpp_fields(f[1:7]) for f in found} == {_fields(variant)}
            assert {f[7] for f in found} == {capacity}
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
    with pytest.raises(ValueError, match=r"row_box=24: expected one of 8, 16, 32, 64, 128"):
        dataclasses.replace(tma, row_box=24)
    with pytest.raises(ValueError, match=r"row_box=16: only TMA variants load A in boxes"):
        dataclasses.replace(VARIANTS[1], row_box=16)
    with pytest.raises(ValueError, match=r"fp32 \(TF32\) inputs run on the MmaSync tiles only"):
        dataclasses.replace(tma, dtypes=("bf16", "fp32"))
    with pytest.raises(ValueError, match=r"mma='Wgmma' is not an ExpertMma enumerator"):
        dataclasses.replace(tma, mma="Wgmma")
    with pytest.raises(ValueError, match=r"dtypes=\('int8',\)"):
        dataclasses.replace(tma, dtypes=("int8",))
    with pytest.raises(ValueError, match=r"cluster=2: expected 1, or 2 for a TMA variant"):
        dataclasses.replace(VARIANTS[1], cluster=2)
    with pytest.raises(ValueError, match=r"cluster=4: expected 1, or 2"):
        dataclasses.replace(tma, cluster=4)


# ---------------------------------------------------------------------------------------------------------
# The variant a forward runs on

NARROW = "tma-wgmma-128x128-6stage-prefetch-abox16"
# (T, H, I, E, k, activation): decode rows of issue 15's table, and large-T rows.
DECODE_ONE_TOKEN = [(1, 2048, 768, 128, 8, "swiglu"), (1, 4096, 1408, 64, 6, "gelu"), (1, 4096, 14336, 8, 2, "swiglu")]
WIDE_ENOUGH = [(8, 2048, 768, 128, 8, "swiglu"), (128, 4096, 1408, 64, 6, "swiglu"), (128, 4096, 1408, 64, 6, "gelu"),
               (32, 7168, 2048, 256, 8, "swiglu"), (8192, 2048, 2048, 32, 2, "gelu"), (16384, 2048, 2048, 64, 2, "gelu"),
               (8192, 2048, 768, 128, 8, "swiglu")]
# At least 8 row tiles per expert: Mixtral 8x7B's layer (1024 rows per expert), DeepSeek-V2-Lite's (1536).
MANY_ROW_TILES = [(4096, 4096, 14336, 8, 2, "swiglu"), (16384, 2048, 1408, 64, 6, "swiglu")]
CLUSTER = "tma-wgmma-128x256-4stage-prefetch-cluster2"


def test_the_narrow_tile_is_in_the_table_for_16_bit_inputs():
    narrow = VARIANTS[EXPERT_VARIANTS[NARROW]]
    assert (narrow.mma, narrow.tile_n, narrow.row_box, narrow.dtypes) == ("WgmmaTmaPrefetch", 128, 16, ("bf16", "fp16"))
    # the same shared memory as the default: stages x (A + B) bytes per stage
    default = VARIANTS[0]
    assert narrow.stages * (128 + narrow.tile_n) == default.stages * (128 + default.tile_n)


@pytest.mark.parametrize("shape", DECODE_ONE_TOKEN)
def test_one_token_picks_the_narrow_tile(shape):
    """With the wide tile a token's k experts give fewer GEMM1 or GEMM2 tasks than the 132 SMs (48 GEMM1
    tasks at Qwen3's 1/2048/768/128/8, 32 GEMM2 tasks at Mixtral's 1/4096/14336/8/2): the narrow tile
    doubles them and is estimated at least 10% faster."""
    T, H, I, E, k, act = shape
    wide_tasks = min(k * -(-I // (128 if act == "swiglu" else 256)), k * -(-H // 256))
    assert wide_tasks < 132
    assert expert_variants.choose_variant(*shape, blocks=132) == NARROW
    narrow = expert_variants.expert_phase_estimate(VARIANTS[EXPERT_VARIANTS[NARROW]], *shape, blocks=132)
    wide = expert_variants.expert_phase_estimate(VARIANTS[0], *shape, blocks=132)
    assert narrow < 0.9 * wide


@pytest.mark.parametrize("shape", WIDE_ENOUGH)
def test_batches_that_fill_the_grid_keep_the_default(shape):
    assert expert_variants.choose_variant(*shape, blocks=132) == expert_variants.DEFAULT_EXPERT_VARIANT


@pytest.mark.parametrize("shape", MANY_ROW_TILES)
def test_experts_with_many_row_tiles_take_the_cluster_twin(shape):
    """The default's tiles in two-block clusters where one rank's experts average >= 8 row tiles; a team's
    rank keeps the default (not measured there), and the model itself sees no gain in the multicast."""
    cluster = VARIANTS[EXPERT_VARIANTS[CLUSTER]]
    assert dataclasses.replace(cluster, cluster=1) == VARIANTS[0]
    assert expert_variants.choose_variant(*shape, blocks=132) == CLUSTER
    assert expert_variants.choose_variant(*shape, blocks=66, world_size=2) == expert_variants.DEFAULT_EXPERT_VARIANT
    assert expert_variants.expert_phase_estimate(cluster, *shape, blocks=132) >= \
        expert_variants.expert_phase_estimate(VARIANTS[0], *shape, blocks=132)


def test_a_cluster_pads_odd_row_tiles():
    """One row tile per expert (T = 128, k = 6 over 64 experts): a cluster runs twice the tiles."""
    cluster = VARIANTS[EXPERT_VARIANTS[CLUSTER]]
    shape = (128, 4096, 1408, 64, 6, "gelu")
    assert expert_variants.expert_phase_estimate(cluster, *shape, blocks=132) > \
        1.5 * expert_variants.expert_phase_estimate(VARIANTS[0], *shape, blocks=132)


def test_fewer_blocks_per_rank_take_longer_until_a_chain_binds():
    """An emulated team of 8 on one GPU gives each rank 16 blocks: its share of the stream is slower; with
    all 132 the one-token estimate is a row tile's GEMM1 -> GEMM2 chain, which more blocks cannot shorten."""
    shape = DECODE_ONE_TOKEN[0]
    for variant in (VARIANTS[0], VARIANTS[EXPERT_VARIANTS[NARROW]]):
        few, all_, more = (expert_variants.expert_phase_estimate(variant, *shape, blocks=b) for b in (16, 132, 264))
        assert few > all_ == more


def test_a_team_rank_streams_only_its_local_experts():
    """One token per rank of a 4-rank team on 128 blocks each (a GPU per rank): each rank's floor is the
    weights of its 32 local experts the team's 4 x 8 choices hit, not of 8 x 128."""
    T, H, I, E, k, act = 1, 2048, 768, 128, 8, "swiglu"
    narrow = VARIANTS[EXPERT_VARIANTS[NARROW]]
    local_hit = E / 4 * (1 - (1 - k / E) ** (4 * T))
    floor = local_hit * (H * 2 * I + I * H) * 2 / 4.3e12
    team = expert_variants.expert_phase_estimate(narrow, T, H, I, E, k, act, blocks=132, world_size=4)
    alone = expert_variants.expert_phase_estimate(narrow, T, H, I, E, k, act, blocks=132)
    assert team >= floor and team <= alone


def test_the_estimate_is_the_weight_floor_at_least():
    T, H, I, E, k, act = 32, 7168, 2048, 256, 8, "swiglu"
    hit = E * (1 - (1 - k / E) ** T)
    floor = hit * (H * 2 * I + I * H) * 2 / 4.3e12
    for variant in VARIANTS:
        assert expert_variants.expert_phase_estimate(variant, T, H, I, E, k, act, blocks=132) >= floor
    assert expert_variants.expert_phase_estimate(VARIANTS[0], 0, H, I, E, k, act, blocks=132) == 0.0


@pytest.mark.parametrize("name,value", [("tokens", -1), ("hidden", 0), ("experts", 0), ("top_k", 0), ("blocks", 0),
                                        ("world_size", 0)])
def test_choose_variant_refuses_bad_sizes(name, value):
    sizes = dict(tokens=1, hidden=2048, ffn=768, experts=128, top_k=8, activation="swiglu", blocks=132)
    sizes[name] = value
    with pytest.raises(ValueError, match=rf"^{name}={value} must be"):
        expert_variants.choose_variant(**sizes)


def test_the_plan_launches_the_chosen_variant_unless_forced(monkeypatch):
    """The public call picks the variant per shape (and turns the split gate on); the debug knobs force
    either for measurement."""
    import torch

    import flashdmoe
    from fake_cuda import fake_cuda

    monkeypatch.setattr(cuda_backend.debug, "timeout_ms", None)
    g = torch.Generator().manual_seed(5)
    H, I, E, k = 256, 768, 128, 8
    w1 = (torch.randn(E, H, 2 * I, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, I, H, generator=g) / I ** 0.5).bfloat16()
    router = (torch.randn(E, H, generator=g) / H ** 0.5).bfloat16()

    def planned(tokens):
        x = torch.randn(tokens, H, generator=g).bfloat16()
        with torch.no_grad():
            flashdmoe.moe(x, router, w1, w2, top_k=k, activation="swiglu", backend="cuda")
        shared = ext.prepared[-1][0]
        return shared["expert_variant"], shared["gate_split"]

    with fake_cuda(monkeypatch) as (ext, _, _):
        assert cuda_backend.debug.expert_variant is None and cuda_backend.debug.gate_split is None
        assert planned(1) == (EXPERT_VARIANTS[NARROW], True)
        assert planned(4096) == (EXPERT_VARIANTS[expert_variants.DEFAULT_EXPERT_VARIANT], True)
        assert planned(16384) == (EXPERT_VARIANTS[CLUSTER], True)  # 1024 rows per expert
        monkeypatch.setattr(cuda_backend.debug, "expert_variant", expert_variants.DEFAULT_EXPERT_VARIANT)
        monkeypatch.setattr(cuda_backend.debug, "gate_split", False)
        assert planned(1) == (EXPERT_VARIANTS[expert_variants.DEFAULT_EXPERT_VARIANT], False)
