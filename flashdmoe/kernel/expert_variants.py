"""The expert-GEMM variants compiled into the fused kernel: the one table, and the C++ it becomes.

:data:`VARIANTS` is the only list of variants. A variant's id (what the launch passes to the kernel) is
its position in the table, its name is derived from its fields. The builder (:mod:`flashdmoe.kernel.extension`)
writes :func:`generated_sources` into the build folder: per variant one compile unit per rank capacity
of the kernel's parameter struct, holding its kernel instances (one per dtype), and
``generated/expert_variants.h``, the (dtype, id) -> instance visitor that ``csrc/moe/launch.cu``
dispatches through. Nothing in ``csrc/`` names a variant, so adding or removing
one is an edit here only.

Importing this module needs neither torch nor a GPU: the names are known before anything is built.
"""

from __future__ import annotations

import dataclasses
import functools
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


_ROW_BOX_DEFAULT = 64  # one m64 warpgroup's rows


@dataclass(frozen=True)
class ExpertVariant:
    """One expert-GEMM variant: the C++ ``ExpertVariant<ExpertMma::mma, tile_n, stages, blocks_per_sm,
    row_box, cluster>`` and the input dtypes it is compiled for. ``row_box``: rows of the TMA box A is loaded
    in (a tile loads the boxes that hold its rows; TMA variants only). ``cluster``: blocks per cluster; with
    2 a task is two row tiles of one expert, one per block, each weight slab loaded once for both
    (multicast; TMA variants only)."""

    mma: str
    tile_n: int
    stages: int
    blocks_per_sm: int
    dtypes: tuple[str, ...]
    row_box: int = _ROW_BOX_DEFAULT
    cluster: int = 1

    def __post_init__(self):
        if self.mma not in _FAMILIES:
            raise ValueError(f"mma={self.mma!r} is not an ExpertMma enumerator; expected one of {sorted(_FAMILIES)}")
        unknown = [d for d in self.dtypes if d not in _DTYPES]
        if not self.dtypes or unknown:
            raise ValueError(f"dtypes={self.dtypes!r}: expected a non-empty subset of {sorted(_DTYPES)}")
        if "fp32" in self.dtypes and self.mma != "MmaSync":
            # wgmma's TF32 form needs K-major B; the [K, N] expert weights are N-major.
            raise ValueError(f"dtypes={self.dtypes!r}: fp32 (TF32) inputs run on the MmaSync tiles only")
        # Whole 8-row swizzle atoms, whole boxes per 128-row tile.
        if self.row_box not in (8, 16, 32, 64, 128):
            raise ValueError(f"row_box={self.row_box}: expected one of 8, 16, 32, 64, 128")
        if self.mma != "WgmmaTmaPrefetch" and self.row_box != _ROW_BOX_DEFAULT:
            raise ValueError(f"row_box={self.row_box}: only TMA variants load A in boxes (leave it at "
                             f"{_ROW_BOX_DEFAULT})")
        if self.cluster not in (1, 2) or (self.cluster == 2 and self.mma != "WgmmaTmaPrefetch"):
            raise ValueError(f"cluster={self.cluster}: expected 1, or 2 for a TMA variant (multicast loads)")

    @property
    def name(self) -> str:
        prefix, suffix = _FAMILIES[self.mma]
        boxes = "" if self.row_box == _ROW_BOX_DEFAULT else f"-abox{self.row_box}"
        cluster = "" if self.cluster == 1 else f"-cluster{self.cluster}"
        return f"{prefix}{_TILE_M}x{self.tile_n}-{self.stages}stage{suffix}{boxes}{cluster}"

    @property
    def cpp_type(self) -> str:
        return (f"ExpertVariant<ExpertMma::{self.mma}, {self.tile_n}, {self.stages}, {self.blocks_per_sm}, "
                f"{self.row_box}, {self.cluster}>")


VARIANTS: tuple[ExpertVariant, ...] = (
    # The default: fastest on every shape measured on the H200 (docs/perf-notes.md).
    ExpertVariant("WgmmaTmaPrefetch", tile_n=256, stages=4, blocks_per_sm=1, dtypes=("bf16", "fp16")),
    # fp32 inputs (TF32), and the portable comparison point for 16-bit inputs.
    ExpertVariant("MmaSync", tile_n=128, stages=3, blocks_per_sm=2, dtypes=("bf16", "fp16", "fp32")),
    # Decode: half-width tiles give twice the tasks, so that a few tokens' experts put every SM on the
    # weight stream, and A comes in 16-row boxes, so that a tile of a token or two streams 2 KB of A per
    # K slab beside 16 KB of weights (choose_variant). Same shared memory as the default (6 x 32 KB stages).
    ExpertVariant("WgmmaTmaPrefetch", tile_n=128, stages=6, blocks_per_sm=1, dtypes=("bf16", "fp16"), row_box=16),
    # Experts with many row tiles: the default's tiles in two-block clusters, a task being two row tiles of
    # one expert, each weight slab multicast to both blocks. That halves the weights' L2 reads, not the
    # bytes each SM takes in; it measured 0.4-5.6% faster with >= 8 row tiles per expert and slower with
    # fewer (choose_variant; docs/perf-notes.md).
    ExpertVariant("WgmmaTmaPrefetch", tile_n=256, stages=4, blocks_per_sm=1, dtypes=("bf16", "fp16"), cluster=2),
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

# What one SM pulls through TMA, A rows (L2 hits) and weights alike: ~6.4 TB/s over 132 SMs. Fitted to the
# expert phases measured at 971b0b0 with 128-row A boxes (docs/perf-notes.md): 128/4096/1408/64/6 gelu
# (0.389 ms) and 32/7168/2048/256/8 swiglu (3.31 ms) both move 48-49 GB/s of A + B per SM; the T = 1 and
# T = 8 decode rows reach 34-36 GB/s (GEMM2 waits for its row tile's GEMM1: wave tails the model leaves
# out). The weights themselves come from HBM at ~4.3 TB/s.
_SM_STREAM_BYTES_PER_S = 6.4e12 / 132
_HBM_BYTES_PER_S = 4.3e12
_SLAB_K = 64          # kTmaSlabK


def _experts_hit(experts: int, top_k: int, tokens: int) -> float:
    """The expected number of the ``experts`` that ``tokens`` tokens' ``top_k`` choices hit."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def expert_phase_estimate(variant: ExpertVariant, tokens: int, hidden: int, ffn: int, experts: int, top_k: int,
                          activation: str, blocks: int, world_size: int = 1, element_bytes: int = 2) -> float:
    """Seconds the expert phase of one rank would take on ``variant`` by the streaming model: the larger of
    the rank's TMA bytes spread over ``blocks`` SMs, one row tile's GEMM1 + GEMM2 chain on one SM (it
    cannot be split), and the distinct local experts' weights at HBM speed. ``tokens`` per source rank
    (``world_size`` of them, ``experts / world_size`` local experts each); expected row tiles from the
    expected number of (source, local expert) segments hit. A two-block cluster variant streams what its
    single-block twin does (the multicast halves L2 reads, not what each SM takes in), plus the empty tiles
    that pad each hit expert's row tiles to an even count: about one per expert where experts average at
    most 1.5 tiles, else every other expert."""
    if tokens <= 0:
        return 0.0
    rows = tokens * top_k  # rows this rank's experts take, over all sources
    # world_size x local experts segments (each source's tokens hit them), plus full tiles
    tiles = _experts_hit(experts, top_k, tokens) + rows / _TILE_M
    local_hit = _experts_hit(experts, top_k, tokens * world_size) / world_size
    a_boxes = -(-min(_TILE_M, rows / tiles) // variant.row_box)
    a_slab = a_boxes * variant.row_box * _SLAB_K * element_bytes
    b_slab = variant.tile_n * _SLAB_K * element_bytes
    if variant.cluster > 1:
        tiles += local_hit * (1.0 if tiles <= 1.5 * local_hit else 0.5)
    out_cols = variant.tile_n // 2 if activation == "swiglu" else variant.tile_n
    task1 = hidden // _SLAB_K * (a_slab + b_slab)
    task2 = ffn // _SLAB_K * (a_slab + b_slab)
    tasks1 = tiles * -(-ffn // out_cols)
    tasks2 = tiles * -(-hidden // variant.tile_n)
    spread = (tasks1 * task1 + tasks2 * task2) / blocks / _SM_STREAM_BYTES_PER_S
    chain = (task1 + task2) / _SM_STREAM_BYTES_PER_S
    w1_cols = 2 * ffn if activation == "swiglu" else ffn
    weights = local_hit * (hidden * w1_cols + ffn * hidden) * element_bytes / _HBM_BYTES_PER_S
    return max(spread, chain, weights)


# Row tiles per expert from which the two-block cluster variant is taken on one rank: it measured faster
# on the two shapes with >= 8 (1024 and 1536 rows per expert) and no faster or slower on those with 1-4.
_CLUSTER_MIN_TILES_PER_EXPERT = 8


def choose_variant(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, activation: str,
                   blocks: int, world_size: int = 1) -> str:
    """The TMA variant with the smallest :func:`expert_phase_estimate` for a 16-bit forward (``tokens``
    and ``blocks`` per rank); the default unless another is estimated at least 10% faster (the model's
    own error is about that). Where the default stands and one rank's experts average at least
    ``_CLUSTER_MIN_TILES_PER_EXPERT`` row tiles, its two-block cluster twin (measured, not modelled: the
    streaming model sees no difference)."""
    for name, value in (("tokens", tokens), ("hidden", hidden), ("ffn", ffn), ("experts", experts),
                        ("top_k", top_k), ("blocks", blocks), ("world_size", world_size)):
        if value < (0 if name == "tokens" else 1):
            raise ValueError(f"{name}={value} must be {'>= 0' if name == 'tokens' else '>= 1'}")
    default = VARIANTS[0]
    estimate = functools.partial(expert_phase_estimate, tokens=tokens, hidden=hidden, ffn=ffn, experts=experts,
                                 top_k=top_k, activation=activation, blocks=blocks, world_size=world_size)
    best, best_time = default, estimate(default)
    for variant in VARIANTS[1:]:
        if variant.mma != default.mma or variant.cluster > 1:
            continue
        time = estimate(variant)
        if time < 0.9 * best_time:
            best, best_time = variant, time
    hit_experts = _experts_hit(experts, top_k, tokens)
    if (best is default and world_size == 1 and hit_experts > 0
            and tokens * top_k / hit_experts >= _CLUSTER_MIN_TILES_PER_EXPERT * _TILE_M):
        twins = [v for v in VARIANTS if v.cluster == 2 and dataclasses.replace(v, cluster=1) == default]
        if twins:
            return twins[0].name
    return best.name


# ---------------------------------------------------------------------------------------------
# The C++ the builder writes into the build folder

GENERATED_HEADER = "generated/expert_variants.h"
_NOTICE = "// Generated by flashdmoe/kernel/expert_variants.py from its VARIANTS table; do not edit."


# Rank capacities of the kernel's parameter struct (csrc/moe/params.cuh LaunchParams), by unit suffix: a
# launch of one rank (one GPU, or one process of a team) passes one rank's parameters, an emulated team's
# launch up to kMaxRanks. The team instances skip the training (saved pre-activation) kernels: only one
# rank saves them.
RANK_CAPACITIES = {"": "1", "_team": "kMaxRanks"}


def instance_unit(variant: ExpertVariant, suffix: str = "") -> str:
    """The build-folder path of ``variant``'s compile unit for the rank capacity of ``suffix``
    (:data:`RANK_CAPACITIES`; one unit each: they compile in parallel)."""
    return f"generated/instances/{variant.name.replace('.', '_').replace('-', '_')}{suffix}.cu"


def instance_units() -> list[str]:
    """Every generated compile unit, in table order."""
    return [instance_unit(variant, suffix) for variant in VARIANTS for suffix in RANK_CAPACITIES]


def _instance_type(variant: ExpertVariant, transport: str | None) -> str:
    # A transport other than the default P2P wraps the variant (csrc/comm/peer_transport.cuh).
    return variant.cpp_type if transport is None else f"WithTransport<{variant.cpp_type}, {transport}>"


def _transport_includes(transport: str | None) -> list[str]:
    return [] if transport is None else [f'#include "{TRANSPORT_HEADERS[transport]}"']


def _render_header(transport: str | None = None) -> str:
    names = ", ".join(f'"{variant.name}"' for variant in VARIANTS)
    (fp32,) = [index for index, variant in enumerate(VARIANTS) if "fp32" in variant.dtypes]
    cases = []
    for index, variant in enumerate(VARIANTS):
        cases.append(f"    case {index}:  // {variant.name}")
        for dtype in variant.dtypes:
            element, code = _DTYPES[dtype]
            cases.append(f"      if (dtype == {code}) return visit({element}{{}}, {_instance_type(variant, transport)}{{}});")
        cases.append("      break;")
    return "\n".join([
        _NOTICE,
        "// The expert variants by id, and the visitor that reaches the kernel instance of a (dtype, id).",
        "#pragma once",
        "#include <cuda_bf16.h>",
        "#include <cuda_fp16.h>",
        '#include "moe/launch.h"',
        '#include "moe/tile_config.cuh"',
        *_transport_includes(transport),
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


def _render_instances(variant: ExpertVariant, capacity: str, transport: str | None = None) -> str:
    instance = _instance_type(variant, transport)
    lines = [
        _NOTICE,
        f"// Kernel instances of the {variant.name} expert variant ({', '.join(variant.dtypes)}), rank capacity "
        f"{capacity}.",
        *_transport_includes(transport),
        '#include "moe/launch_template.cuh"',
        "",
        "namespace flashdmoe {",
    ]
    for dtype in variant.dtypes:
        element = _DTYPES[dtype][0]
        lines.append(f"template LaunchInfo launch_forward_variant<{element}, {instance}, {capacity}>("
                     "PreparedLaunch&, const uintptr_t*, uint32_t, void*, cudaStream_t);")
        if capacity == "1":
            lines.append(f"template KernelAttributes kernel_attributes_variant<{element}, {instance}>();")
    lines += ["}  // namespace flashdmoe", ""]
    return "\n".join(lines)


# Transport policy types other than the default P2PTransport -> the header that defines them.
TRANSPORT_HEADERS = {"NvshmemTransport": "nvshmem/nvshmem_transport.cuh"}

# The backward exchange's publication policy per transport (csrc/backward/ep_rows.cuh): header, type.
EP_ROWS_POLICIES = {None: ("backward/ep_rows.cuh", "EpStores"),
                    "NvshmemTransport": ("nvshmem/ep_rows_puts.cuh", "EpPuts")}
EP_ROWS_POLICY_HEADER = "generated/ep_rows_policy.h"


def _render_ep_rows_policy(transport: str | None) -> str:
    header, policy = EP_ROWS_POLICIES[transport]
    return "\n".join([
        _NOTICE,
        "// The backward exchange's publication policy in this build (backward/ep_rows.cu instantiates its kernel",
        "// with it): stores through peer pointers, or NVSHMEM puts where a peer has none.",
        "#pragma once",
        f'#include "{header}"',
        "",
        "namespace flashdmoe {",
        f"using EpRowsPolicy = {policy};",
        "}  // namespace flashdmoe",
        "",
    ])


def generated_sources(transport: str | None = None) -> dict[str, str]:
    """Build-folder relative path -> contents of every generated file (the variants' header, the backward
    exchange's policy header and one compile unit per variant). ``transport``: a policy type of :data:`TRANSPORT_HEADERS` every instance publishes
    through (the NVSHMEM transport module), else the default peer-pointer stores."""
    if transport is not None and transport not in TRANSPORT_HEADERS:
        raise ValueError(f"transport={transport!r}: expected None or one of {sorted(TRANSPORT_HEADERS)}")
    files = {GENERATED_HEADER: _render_header(transport), EP_ROWS_POLICY_HEADER: _render_ep_rows_policy(transport)}
    for variant in VARIANTS:
        for suffix, capacity in RANK_CAPACITIES.items():
            files[instance_unit(variant, suffix)] = _render_instances(variant, capacity, transport)
    return files
