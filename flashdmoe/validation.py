"""Input checks for :func:`flashdmoe.moe` (docs/design.md §2).

Every failure raises ``ValueError`` whose message names the argument, the value that was given
and what was expected, so a user can fix the call without reading the kernel.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

__all__ = [
    "ACTIVATIONS",
    "INPUT_DTYPES",
    "MAX_CAPACITY",
    "MoESizes",
    "check_capacity",
    "check_finite_input",
    "validate_capacity_factor",
    "validate_moe_inputs",
]

#: Activations every backend implements (same tuple as ``flashdmoe.reference.ACTIVATIONS``).
ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "silu", "swiglu")

#: Largest number of rows one (source rank, expert) pair may keep: the fused kernel holds it in a 32-bit int.
MAX_CAPACITY = 2**31 - 1

#: Tensor dtypes accepted by :func:`flashdmoe.moe`; float64 is for the reference/gradcheck only.
INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MoESizes:
    """Sizes read off validated inputs.

    Attributes:
        tokens: ``T``, rows of ``x`` on this rank (may be 0).
        hidden: ``H``, model width.
        ffn: ``I``, expert intermediate size (half of ``w1``'s last dim for swiglu).
        experts: ``E``, global number of experts (rows of ``router_weight``).
        top_k: ``k``, experts chosen per token.
        local_experts: ``L = E // world_size``, experts held by this rank.
        world_size: ``P``, ranks in the expert-parallel team.
    """

    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int
    local_experts: int
    world_size: int = 1


def _shape(tensor: torch.Tensor) -> str:
    return "[" + ", ".join(str(size) for size in tensor.shape) + "]"


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a size is always a mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def validate_capacity_factor(capacity_factor: object, name: str = "capacity_factor") -> float | None:
    """Check a capacity factor: ``None`` (dropless) or a finite real number > 0.

    Returns:
        ``None`` or the factor as ``float``.
    """
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
        raise ValueError(
            f"{name}={capacity_factor!r} ({type(capacity_factor).__name__}): expected None (dropless) "
            "or a real number > 0"
        )
    factor = float(capacity_factor)
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"{name}={capacity_factor!r}: expected None (dropless) or a finite number > 0")
    return factor


def check_capacity(capacity_factor: float | None, tokens: int, top_k: int, experts: int,
                   name: str = "capacity_factor") -> None:
    """Check that a valid capacity factor gives a capacity the backends can hold:
    ``c * T * k / E <= MAX_CAPACITY`` (a factor of ``E / k`` already keeps every choice, so nothing
    useful lies above it; a factor such as ``1e300`` would overflow the integer capacity).

    Raises:
        ValueError: naming ``name``, the capacity it gives and the largest useful factor.
    """
    if capacity_factor is None:
        return
    rows = capacity_factor * tokens * top_k / experts  # the order of reference.expert_capacity
    if not math.isfinite(rows) or rows > MAX_CAPACITY:
        raise ValueError(
            f"{name}={capacity_factor!r}: keeps ceil(c * T * k / E) = ceil({capacity_factor!r} * {tokens} * {top_k} / "
            f"{experts}) = {rows:.3g} rows per (source rank, expert), more than {MAX_CAPACITY} (2**31 - 1); a factor "
            f">= E / k = {experts / top_k:g} already keeps every choice: use one, or None / null for dropless"
        )


def check_finite_input(x: torch.Tensor) -> None:
    """Raise ``ValueError`` if the CPU tensor ``x`` holds NaN / Inf (a host read; CUDA inputs are checked by
    the kernel instead, which flags non-finite router logits, without a device synchronisation)."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"x: contains {bad} non-finite value(s) (NaN or Inf); expected finite input")


def validate_moe_inputs(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    activation: str,
    capacity_factor: float | None,
    world_size: int = 1,
) -> MoESizes:
    """Check the arguments of :func:`flashdmoe.moe` and return the sizes they imply.

    Args:
        x: ``[T, H]`` tokens on this rank; float32, bfloat16, float16 or float64.
        router_weight: ``[E, H]`` router (``nn.Linear`` layout), same dtype and device as ``x``.
        w1: ``[L, H, I]``, or ``[L, H, 2I]`` for ``swiglu`` (gate half first), same dtype/device.
        w2: ``[L, I, H]``, same dtype and device.
        top_k: experts per token, ``1 <= top_k <= E``: any integer type but ``bool`` (NumPy's too; the
            returned :class:`MoESizes` holds it as ``int``).
        activation: one of :data:`ACTIVATIONS`.
        capacity_factor: ``None`` (dropless) or a finite number > 0 with ``c * T * k / E`` at most
            :data:`MAX_CAPACITY` (see :func:`check_capacity`).
        world_size: ``P`` ranks in the team; ``E`` must divide by it and ``L * P == E``.

    Returns:
        :class:`MoESizes` with ``T, H, I, E, k, L, P``.

    Raises:
        ValueError: naming the offending argument, the given value and what was expected.
            ``x`` is checked for NaN/Inf only on CPU: on CUDA that would force a device sync,
            and the fused kernel detects non-finite input itself.
    """
    tensors = {"x": x, "router_weight": router_weight, "w1": w1, "w2": w2}
    expected_ndim = {"x": 2, "router_weight": 2, "w1": 3, "w2": 3}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != expected_ndim[name]:
            raise ValueError(
                f"{name}: expected a {expected_ndim[name]}-D tensor, got shape {_shape(tensor)} "
                f"({tensor.dim()}-D)"
            )
        if tensor.dtype not in INPUT_DTYPES:
            allowed = ", ".join(str(dtype).removeprefix("torch.") for dtype in INPUT_DTYPES)
            raise ValueError(f"{name}: dtype {tensor.dtype} is not supported; expected one of {allowed}")
    for name, tensor in tensors.items():
        if tensor.dtype != x.dtype:
            raise ValueError(f"{name}: dtype {tensor.dtype} differs from x's dtype {x.dtype}; all must match")
        if tensor.device != x.device:
            raise ValueError(f"{name}: on device {tensor.device} but x is on {x.device}; all must match")
        if not tensor.is_contiguous():
            raise ValueError(
                f"{name}: tensor of shape {_shape(tensor)} is not contiguous; call .contiguous() first"
            )

    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {', '.join(ACTIVATIONS)}")
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected an integer >= 1")
    capacity_factor = validate_capacity_factor(capacity_factor)

    tokens, hidden = x.shape
    experts = router_weight.shape[0]
    if hidden < 1:
        raise ValueError(f"x: shape {_shape(x)} has hidden size 0; expected [T, H] with H >= 1")
    if experts < 1:
        raise ValueError(f"router_weight: shape {_shape(router_weight)} has no experts; expected [E, H], E >= 1")
    if router_weight.shape[1] != hidden:
        raise ValueError(
            f"router_weight: shape {_shape(router_weight)} does not match x {_shape(x)}; "
            f"expected [E, {hidden}]"
        )
    if experts % world_size != 0:
        raise ValueError(
            f"router_weight: {experts} experts cannot be split over world_size={world_size} ranks; "
            "expected E % world_size == 0"
        )
    local_experts = experts // world_size
    if w1.shape[0] != local_experts:
        raise ValueError(
            f"w1: shape {_shape(w1)} holds {w1.shape[0]} experts; expected L = E / world_size = "
            f"{experts} / {world_size} = {local_experts} local experts"
        )
    if w1.shape[1] != hidden:
        raise ValueError(f"w1: shape {_shape(w1)} does not match hidden size {hidden} of x; expected [L, {hidden}, I]")
    w1_columns = w1.shape[2]
    if activation == "swiglu":
        if w1_columns % 2 != 0 or w1_columns == 0:
            raise ValueError(
                f"w1: shape {_shape(w1)} has {w1_columns} columns; swiglu expects [L, H, 2I] "
                "(gate half then up half), an even number >= 2"
            )
        ffn = w1_columns // 2
    else:
        if w1_columns == 0:
            raise ValueError(f"w1: shape {_shape(w1)} has ffn size 0; expected [L, H, I] with I >= 1")
        ffn = w1_columns
    expected_w2 = (local_experts, ffn, hidden)
    if tuple(w2.shape) != expected_w2:
        raise ValueError(
            f"w2: shape {_shape(w2)} does not match w1 {_shape(w1)} and x {_shape(x)}; "
            f"expected [L, I, H] = [{local_experts}, {ffn}, {hidden}]"
        )
    if not _is_int(top_k) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k!r}: expected an integer with 1 <= top_k <= E = {experts}")
    check_capacity(capacity_factor, tokens, int(top_k), experts)

    # A data-dependent check: eager only (a traced graph cannot branch on values; the op's CPU
    # implementation checks x when it runs).
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        check_finite_input(x)

    return MoESizes(
        tokens=tokens,
        hidden=hidden,
        ffn=ffn,
        experts=experts,
        top_k=int(top_k),
        local_experts=local_experts,
        world_size=int(world_size),
    )
