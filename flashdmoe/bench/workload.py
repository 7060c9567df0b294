"""Fresh random MoE inputs for benchmarking (randn, never zeros), built directly on the device, and the
rotated sets a suite times an entry on."""

from __future__ import annotations

import gc
import math

import torch

from flashdmoe.bench.entries import MoEInputs
from flashdmoe.bench.results import BenchShape
from flashdmoe.bench.timing import cache_bytes, input_sets_for_cache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: expected one of {tuple(DTYPES)}")
    return DTYPES[name]


def make_inputs(
    shape: BenchShape, *, activation: str, dtype: torch.dtype, device: torch.device | str, seed: int
) -> MoEInputs:
    """One input set, deterministic from ``seed``.

    x [T, H] ~ N(0, 1); router_weight [E, H] ~ N(0, 1/H) so logits are O(1) and routing is spread;
    w1 [E, H, I or 2I] ~ N(0, 1/H) and w2 [E, I, H] ~ N(0, 1/I) so y is O(1). All in ``dtype``.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    w1_cols = 2 * shape.ffn if activation == "swiglu" else shape.ffn

    def normal(*size: int, scale: float = 1.0) -> torch.Tensor:
        values = torch.randn(*size, device=device, dtype=dtype, generator=generator)
        return values.mul_(scale) if scale != 1.0 else values

    return MoEInputs(
        x=normal(shape.tokens, shape.hidden),
        router_weight=normal(shape.experts, shape.hidden, scale=1.0 / math.sqrt(shape.hidden)),
        w1=normal(shape.experts, shape.hidden, w1_cols, scale=1.0 / math.sqrt(shape.hidden)),
        w2=normal(shape.experts, shape.ffn, shape.hidden, scale=1.0 / math.sqrt(shape.ffn)),
    )


def rotated_input_sets(
    shape: BenchShape,
    *,
    activation: str,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    count: int | None,
    limit: int,
    extra_bytes_per_set: int = 0,
) -> list[MoEInputs]:
    """The input sets an entry's timed runs rotate through; set ``i`` is ``make_inputs(..., seed=seed + i)``.

    ``count`` sets, or (``None``) as many as it takes for the sets, each with ``extra_bytes_per_set`` more
    (outputs, gradients), to exceed twice the cache together (:func:`timing.input_sets_for_cache`),
    at most ``limit``.
    """
    first = make_inputs(shape, activation=activation, dtype=dtype, device=device, seed=seed)
    if count is None:
        count = input_sets_for_cache(first.nbytes + extra_bytes_per_set, cache_bytes(device), limit=limit)
    return [first] + [
        make_inputs(shape, activation=activation, dtype=dtype, device=device, seed=seed + index)
        for index in range(1, count)
    ]


def input_set_bytes(shape: BenchShape, activation: str, element_size: int) -> int:
    """Bytes of one :func:`make_inputs` set: x, router_weight, w1 and w2."""
    w1_cols = 2 * shape.ffn if activation == "swiglu" else shape.ffn
    return element_size * (
        shape.tokens * shape.hidden
        + shape.experts * shape.hidden
        + shape.experts * shape.hidden * w1_cols
        + shape.experts * shape.ffn * shape.hidden
    )


def sets_that_fit(per_set_bytes: int, transient_bytes: int, free_bytes: int) -> int:
    """How many sets of ``per_set_bytes`` fit in ``free_bytes`` beside ``transient_bytes`` that come and go
    while they are held; at least 1 (a set that does not fit fails where it is allocated, with torch's
    out-of-memory message)."""
    if per_set_bytes < 1:
        raise ValueError(f"per_set_bytes={per_set_bytes}: expected a positive byte count")
    return max(1, (free_bytes - transient_bytes) // per_set_bytes)


def free_device_memory(device: torch.device) -> None:
    """Drop what the last configuration left (Python garbage, the CUDA caching allocator's free blocks)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
