"""The expert-GEMM variants compiled into the fused kernel: the one table, and the C++ it becomes.

:data:`VARIANTS` is the only list of variants. A variant's id (what the launch passes to the kernel) is
its position in the table, its name is derived from its fields. The builder (:mod:`flashdmoe.extension`)
writes :func:`generated_sources` into the build folder: one compile unit per variant holding its kernel
instances (one per dtype), and ``generated/expert_variants.h``, the (dtype, id) -> instance visitor that
``csrc/moe/launch.cu`` dispatches through. Nothing in ``csrc/`` names a variant, so adding or removing
one is an edit here only.

Importing this module needs neither torch nor a GPU: the names are known before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass

# ExpertMma enumerator (csrc/moe/tile_config.cuh) -> (name prefix, name suffix).
_FAMILIES = {
    "WgmmaTmaPrefetch": ("tma-wgmma-", "-prefetch"),
    "MmaSync": ("mma.sync-", ""),
}
# dtype name -> (C++ element type, launch.h DType enumerator).
_DTYPES = {
    "bf16": ("__nv_bfloat16", "DType::BFloat16"),
    "fp16": ("__half", "DType::Float16"),
    "fp32": ("float", "DType::Float32"),
}
_TILE_M = 128  # kExpertTileM


@dataclass(frozen=True)
class ExpertVariant:
    """One expert-GEMM variant: the C++ ``ExpertVariant<ExpertMma::mma, tile_n, stages, blocks_per_sm>``
    and the input dtypes it is compiled for."""

    mma: str
    tile_n: int
    stages: int
    blocks_per_sm: int
    dtypes: tuple[str, ...]

    def __post_init__(self):
        if self.mma not in _FAMILIES:
            raise ValueError(f"mma={self.mma!r} is not an ExpertMma enumerator; expected one of {sorted(_FAMILIES)}")
        unknown = [d for d in self.dtypes if d not in _DTYPES]
        if not self.dtypes or unknown:
            raise ValueError(f"dtypes={self.dtypes!r}: expected a non-empty subset of {sorted(_DTYPES)}")
        if "fp32" in self.dtypes and self.mma != "MmaSync":
            # wgmma's TF32 form needs K-major B; the [K, N] expert weights are N-major.
            raise ValueError(f"dtypes={self.dtypes!r}: fp32 (TF32) inputs run on the MmaSync tiles only")

    @property
    def name(self) -> str:
        prefix, suffix = _FAMILIES[self.mma]
        return f"{prefix}{_TILE_M}x{self.tile_n}-{self.stages}stage{suffix}"

    @property
    def cpp_type(self) -> str:
        return f"ExpertVariant<ExpertMma::{self.mma}, {self.tile_n}, {self.stages}, {self.blocks_per_sm}>"


VARIANTS: tuple[ExpertVariant, ...] = (
    # The default: fastest on every shape measured on the H200 (docs/perf-notes.md).
    ExpertVariant("WgmmaTmaPrefetch", tile_n=256, stages=4, blocks_per_sm=1, dtypes=("bf16", "fp16")),
    # fp32 inputs (TF32), and the portable comparison point for 16-bit inputs.
    ExpertVariant("MmaSync", tile_n=128, stages=3, blocks_per_sm=2, dtypes=("bf16", "fp16", "fp32")),
    # Decode: half-width tiles give twice the tasks, so that a few tokens' experts put every SM on the
    # weight stream (choose_variant). Same shared memory as the default (6 x 32 KB stages).
    ExpertVariant("WgmmaTmaPrefetch", tile_n=128, stages=6, blocks_per_sm=1, dtypes=("bf16", "fp16")),
)

# name -> id, in id order.
EXPERT_VARIANTS: dict[str, int] = {variant.name: index for index, variant in enumerate(VARIANTS)}
DEFAULT_EXPERT_VARIANT = VARIANTS[0].name
(FP32_EXPERT_VARIANT,) = [variant.name for variant in VARIANTS if "fp32" in variant.dtypes]


def variant_id(name: str) -> int:
    """The id the kernel knows variant ``name`` by; ``ValueError`` naming the known ones otherwise."""
    if name not in EXPERT_VARIANTS:
        raise ValueError(f"expert_variant={name!r} is not compiled into the kernel; expected one of "
                         f"{list(EXPERT_VARIANTS)}")
    return EXPERT_VARIANTS[name]


# ---------------------------------------------------------------------------------------------
# The variant a forward runs on (16-bit inputs; fp32 has its one variant)

# What one SM pulls through TMA when all stream: the H200's ~4.3 TB/s of reads over 132 SMs. A lone SM
# gets about the same (the T = 1 decode row's expert phase: 48-64 busy SMs, 1.3 TB/s), so a phase's time
# is set by its busiest SM's bytes, A rows included (they come through the same TMA unit).
_SM_STREAM_BYTES_PER_S = 4.3e12 / 132
_HBM_BYTES_PER_S = 4.3e12
_SLAB_K = 64          # kTmaSlabK
_ROW_BOX_ROWS = 64    # kExpertRowBoxRows (csrc/moe/tma_boxes.cuh)


def expert_phase_estimate(variant: ExpertVariant, tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                          activation: str, blocks: int, element_bytes: int = 2) -> float:
    """Seconds the expert phase of one rank would take on ``variant`` by the streaming model: the larger of
    the rank's TMA bytes spread over ``blocks`` SMs, one row tile's GEMM1 + GEMM2 chain on one SM (it
    cannot be split), and the distinct experts' weights at HBM speed. ``tokens`` per source rank;
    expected row tiles from the expected number of (source, expert) segments hit."""
    if tokens <= 0:
        return 0.0
    hit = 1.0 - (1.0 - top_k / experts) ** tokens   # P(a given expert gets a token of one source)
    rows = tokens * top_k                           # rows this rank's experts take, over all sources
    tiles = experts * hit + rows / _TILE_M          # segments hit, plus the full tiles' share
    a_boxes = -(-min(_TILE_M, rows / tiles) // _ROW_BOX_ROWS)
    a_slab = a_boxes * _ROW_BOX_ROWS * _SLAB_K * element_bytes
    b_slab = variant.tile_n * _SLAB_K * element_bytes
    out_cols = variant.tile_n // 2 if activation == "swiglu" else variant.tile_n
    task1 = hidden // _SLAB_K * (a_slab + b_slab)
    task2 = ffn // _SLAB_K * (a_slab + b_slab)
    tasks1 = tiles * -(-ffn // out_cols)
    tasks2 = tiles * -(-hidden // variant.tile_n)
    spread = (tasks1 * task1 + tasks2 * task2) / blocks / _SM_STREAM_BYTES_PER_S
    chain = (task1 + task2) / _SM_STREAM_BYTES_PER_S
    w1_cols = 2 * ffn if activation == "swiglu" else ffn
    weights = experts * hit * (hidden * w1_cols + ffn * hidden) * element_bytes / _HBM_BYTES_PER_S
    return max(spread, chain, weights)


def choose_variant(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, activation: str,
                   blocks: int) -> str:
    """The TMA variant with the smallest :func:`expert_phase_estimate` for a 16-bit forward (``tokens``
    per rank, ``blocks`` per rank); the default unless another is estimated at least 10% faster (the
    model's own error is about that)."""
    for name, value in (("tokens", tokens), ("hidden", hidden), ("ffn", ffn), ("experts", experts),
                        ("top_k", top_k), ("blocks", blocks)):
        if value < (0 if name == "tokens" else 1):
            raise ValueError(f"{name}={value} must be {'>= 0' if name == 'tokens' else '>= 1'}")
    default = VARIANTS[0]
    best, best_time = default, expert_phase_estimate(default, tokens, hidden, ffn, experts, top_k, activation, blocks)
    for variant in VARIANTS[1:]:
        if variant.mma != default.mma:
            continue
        time = expert_phase_estimate(variant, tokens, hidden, ffn, experts, top_k, activation, blocks)
        if time < 0.9 * best_time:
            best, best_time = variant, time
    return best.name


# ---------------------------------------------------------------------------------------------
# The C++ the builder writes into the build folder

GENERATED_HEADER = "generated/expert_variants.h"
_NOTICE = "// Generated by flashdmoe/expert_variants.py from its VARIANTS table; do not edit."


def instance_unit(variant: ExpertVariant) -> str:
    """The build-folder path of ``variant``'s compile unit (one per variant: they compile in parallel)."""
    return f"generated/instances/{variant.name.replace('.', '_').replace('-', '_')}.cu"


def _render_header() -> str:
    names = ", ".join(f'"{variant.name}"' for variant in VARIANTS)
    (fp32,) = [index for index, variant in enumerate(VARIANTS) if "fp32" in variant.dtypes]
    cases = []
    for index, variant in enumerate(VARIANTS):
        cases.append(f"    case {index}:  // {variant.name}")
        for dtype in variant.dtypes:
            element, code = _DTYPES[dtype]
            cases.append(f"      if (dtype == {code}) return visit({element}{{}}, {variant.cpp_type}{{}});")
        cases.append("      break;")
    return "\n".join([
        _NOTICE,
        "// The expert variants by id, and the visitor that reaches the kernel instance of a (dtype, id).",
        "#pragma once",
        "#include <cuda_bf16.h>",
        "#include <cuda_fp16.h>",
        '#include "moe/launch.h"',
        '#include "moe/tile_config.cuh"',
        "",
        "namespace flashdmoe {",
        "",
        f"constexpr int kExpertVariantCount = {len(VARIANTS)};",
        f"constexpr const char* kExpertVariantNames[kExpertVariantCount] = {{{names}}};",
        f"constexpr int kFp32ExpertVariant = {fp32};  // {VARIANTS[fp32].name}",
        "",
        "// Throws std::invalid_argument naming what is wrong with (dtype, variant) (moe/launch.cu).",
        "[[noreturn]] void throw_no_instance(DType dtype, int variant);",
        "",
        "// Calls visit(Element{}, Variant{}) for the kernel instance of (dtype, variant id).",
        "template <typename Visit>",
        "auto visit_expert_instance(DType dtype, int variant, Visit&& visit) {",
        "  switch (variant) {",
        *cases,
        "  }",
        "  throw_no_instance(dtype, variant);",
        "}",
        "",
        "}  // namespace flashdmoe",
        "",
    ])


def _render_instances(variant: ExpertVariant) -> str:
    lines = [
        _NOTICE,
        f"// Kernel instances of the {variant.name} expert variant ({', '.join(variant.dtypes)}).",
        '#include "moe/launch_template.cuh"',
        "",
        "namespace flashdmoe {",
    ]
    for dtype in variant.dtypes:
        element = _DTYPES[dtype][0]
        lines += [
            f"template LaunchInfo launch_forward_variant<{element}, {variant.cpp_type}>(const ForwardArgs&, cudaStream_t);",
            f"template KernelAttributes kernel_attributes_variant<{element}, {variant.cpp_type}>();",
        ]
    lines += ["}  // namespace flashdmoe", ""]
    return "\n".join(lines)


def generated_sources() -> dict[str, str]:
    """Build-folder relative path -> contents of every generated file (the header and one compile unit
    per variant)."""
    files = {GENERATED_HEADER: _render_header()}
    for variant in VARIANTS:
        files[instance_unit(variant)] = _render_instances(variant)
    return files
