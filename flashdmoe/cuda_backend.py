"""The fused CUDA backend: one persistent kernel launch per forward (plus a memset of its sync words).

Forward runs ``csrc/`` through the ``flashdmoe_cuda`` extension. Backward is unfused for now: it
recomputes the layer with torch ops on the routing the forward saved
(:func:`flashdmoe.reference.moe_fixed_routing`), so gradients match the reference semantics exactly.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

from flashdmoe import reference
from flashdmoe.errors import KernelTimeout

ACTIVATION_CODES = {"relu": 0, "gelu": 1, "silu": 2, "swiglu": 3}
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1}
# Expert GEMM variants compiled into the kernel (csrc/moe/tile_config.cuh): MMA family, cp.async
# stages, blocks per SM.
EXPERT_VARIANTS = {"wgmma-128x128-3stage": 0, "wgmma-128x128-4stage": 1, "wgmma-128x256-4stage": 2,
                   "mma.sync-128x128-3stage": 3}
# Fastest or tied on all five shapes of docs/benchmarks.md (H200, 2026-12-02 variant sweep).
DEFAULT_EXPERT_VARIANT = "wgmma-128x256-4stage"

# Phase ids written by the kernel's watchdog (csrc/moe/params.cuh, enum Phase).
PHASE_NAMES = {
    1: "grid barrier after the gate",
    2: "grid barrier after the per-expert offsets",
    3: "grid barrier after dispatch",
    4: "expert GEMM2 tile waiting for its GEMM1 row tile",
    5: "grid barrier before the combine",
}

DEFAULT_TIMEOUT_MS = 10_000


@dataclass
class DebugKnobs:
    """Test-only switches. ``withhold_phase`` makes block 0 skip that grid barrier (forces the watchdog);
    ``poison_outputs`` fills outputs with NaN before the launch so unwritten elements show."""

    withhold_phase: int = 0
    poison_outputs: bool = False
    timeout_ms: int | None = None
    # Expert GEMM variant (EXPERT_VARIANTS); FLASHDMOE_EXPERT_VARIANT overrides the default.
    expert_variant: str = os.environ.get("FLASHDMOE_EXPERT_VARIANT", DEFAULT_EXPERT_VARIANT)


debug = DebugKnobs()
_deferred: list | None = None  # status words awaiting a check inside deferred_status_checks()


@dataclass
class FusedRouting:
    """Routing the forward kernel produced.

    expert: [T, k] int32 chosen experts; weight: [T, k] float32 combine weights;
    row: [T, k] int32 row in the packed expert buffers (-1 = dropped by capacity);
    counts: [E] int32 choices routed to each expert before capacity.
    """

    expert: torch.Tensor
    weight: torch.Tensor
    row: torch.Tensor
    counts: torch.Tensor

    @property
    def keep(self) -> torch.Tensor:
        return self.row >= 0


_module = None


def _extension():
    """The built flashdmoe_cuda module, resolved once per process (the build cache lookup hashes every
    source file, far too slow for a per-forward call)."""
    global _module
    if _module is None:
        from flashdmoe import extension

        _module = extension.load()
    return _module


@functools.lru_cache(maxsize=256)
def _shape_facts(ext, T, H, I, E, k, dtype_code):
    """(shape error or '', workspace layout) per shape: asked once, not on every forward."""
    error = ext.check_shapes(T, H, I, E, k)
    return error, (None if error else ext.workspace_layout(T, H, I, E, k, dtype_code))


def _check_shapes(ext, T, H, I, E, k):
    return _shape_facts(ext, T, H, I, E, k, 0)[0]


def _workspace_layout(ext, T, H, I, E, k, dtype_code):
    return _shape_facts(ext, T, H, I, E, k, dtype_code)[1]


def timeout_ns() -> int:
    ms = debug.timeout_ms if debug.timeout_ms is not None else int(os.environ.get("FLASHDMOE_TIMEOUT_MS", DEFAULT_TIMEOUT_MS))
    return int(ms) * 1_000_000


PHASE_CLOCK_NAMES = ("gate", "offsets", "dispatch", "experts", "combine")
last_phase_ms: dict[str, float] = {}  # per-phase breakdown of the most recently checked launch


def _decode_status(status: torch.Tensor, offsets: tuple[int, int, int]) -> None:
    """status: uint8 CPU bytes from the error word through the phase clock. Raises on failure."""
    flags_offset, clock_offset, slots = offsets
    raw = status.numpy().tobytes()
    error = int.from_bytes(raw[0:8], "little")
    flags = int.from_bytes(raw[flags_offset:flags_offset + 4], "little")
    clock = [int.from_bytes(raw[clock_offset + 8 * i:clock_offset + 8 * i + 8], "little") for i in range(slots)]
    if not error and all(clock):
        last_phase_ms.clear()
        last_phase_ms.update({name: (clock[i + 1] - clock[i]) / 1e6 for i, name in enumerate(PHASE_CLOCK_NAMES)})
    if error:
        kind, phase, peer, block = error & 0xFF, (error >> 8) & 0xFF, (error >> 16) & 0xFFFF, error >> 32
        what = PHASE_NAMES.get(phase, f"phase {phase}")
        if kind == 1:
            raise KernelTimeout(
                f"flashdmoe kernel timed out in the {what} (waiting on rank {peer}; first seen by block {block}); "
                f"timeout {timeout_ns() // 1_000_000} ms (FLASHDMOE_TIMEOUT_MS)"
            )
        raise RuntimeError(f"flashdmoe kernel reported error word {error:#x}")
    if flags & 1:
        raise ValueError("x or router_weight: expected finite values, the router logits contain NaN or Inf")


@contextlib.contextmanager
def deferred_status_checks():
    """Inside this block launches do not synchronise to read the kernel's status words; they are copied
    asynchronously and checked (after a device synchronise) when the block exits. Used by benchmarks."""
    global _deferred
    outer, _deferred = _deferred, []
    try:
        yield
    finally:
        pending, _deferred = _deferred, outer
        if pending:
            torch.cuda.synchronize()
            for status, offsets in pending:
                _decode_status(status, offsets)


def fused_forward(x, router_weight, w1, w2, *, top_k, activation, normalize_topk, capacity_factor):
    """Run the fused kernel. x: [T, H]; router_weight: [E, H]; w1: [E, H, I or 2I]; w2: [E, I, H]; all
    bf16 or fp16, contiguous, on one CUDA device. Returns (y [T, H] dtype of x, FusedRouting)."""
    if x.dtype not in DTYPE_CODES:
        raise ValueError(
            f"x: the cuda backend takes bfloat16 or float16, got {x.dtype}; use backend='reference' for "
            "float32/float64 (the TF32 kernel path is not implemented yet)"
        )
    ext = _extension()
    T, H = x.shape
    E = router_weight.shape[0]
    I = w2.shape[1]
    shape_error = _check_shapes(ext, T, H, I, E, top_k)
    if shape_error:
        raise ValueError(f"shapes unsupported by the fused kernel: {shape_error} (backend='reference' covers them)")
    cap = reference.expert_capacity(T, top_k, E, capacity_factor)
    capacity = T if cap is None else cap
    dtype_code = DTYPE_CODES[x.dtype]
    device = x.device

    y = torch.empty_like(x)
    expert = torch.empty((T, top_k), dtype=torch.int32, device=device)
    weight = torch.empty((T, top_k), dtype=torch.float32, device=device)
    row = torch.empty((T, top_k), dtype=torch.int32, device=device)
    counts = torch.empty((E,), dtype=torch.int32, device=device)
    if debug.poison_outputs:
        y.fill_(float("nan"))
        weight.fill_(float("nan"))
        for t in (expert, row, counts):
            t.fill_(-7)
    if T == 0:
        counts.zero_()
        return y, FusedRouting(expert, weight, row, counts)

    layout = _workspace_layout(ext, T, H, I, E, top_k, dtype_code)
    workspace = torch.empty((layout["total_bytes"],), dtype=torch.uint8, device=device)
    ext.forward(
        x=x.data_ptr(), router=router_weight.data_ptr(), w1=w1.data_ptr(), w2=w2.data_ptr(), y=y.data_ptr(),
        topk_expert=expert.data_ptr(), topk_weight=weight.data_ptr(), topk_row=row.data_ptr(),
        expert_counts=counts.data_ptr(), workspace=workspace.data_ptr(), workspace_bytes=layout["total_bytes"],
        tokens=T, hidden=H, ffn=I, experts=E, top_k=top_k, dtype=dtype_code,
        activation=ACTIVATION_CODES[activation], normalize_topk=bool(normalize_topk), capacity=capacity,
        timeout_ns=timeout_ns(), debug_withhold_phase=int(debug.withhold_phase), expert_variant=EXPERT_VARIANTS[debug.expert_variant],
        stream=torch.cuda.current_stream(device).cuda_stream,
    )
    # One device-to-host copy of the status bytes (no extra kernels: a forward is one launch).
    err_at, flags_at = layout["error_word"], layout["status_flags"]
    clock_at = layout["phase_clock"]
    status = workspace[err_at:clock_at + 8 * layout["phase_clock_slots"]]
    offsets = (flags_at - err_at, clock_at - err_at, layout["phase_clock_slots"])
    if _deferred is not None:
        _deferred.append((status.to("cpu", non_blocking=True), offsets))
    else:
        _decode_status(status.cpu(), offsets)
    return y, FusedRouting(expert, weight, row, counts)


class _FusedMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, router_weight, w1, w2, top_k, activation, normalize_topk, capacity_factor, routing_out):
        y, routing = fused_forward(
            x, router_weight, w1, w2, top_k=top_k, activation=activation, normalize_topk=normalize_topk,
            capacity_factor=capacity_factor,
        )
        ctx.save_for_backward(x, router_weight, w1, w2, routing.expert, routing.row)
        ctx.options = (activation, normalize_topk)
        routing_out.append(routing)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, router_weight, w1, w2, expert, row = ctx.saved_tensors
        activation, normalize_topk = ctx.options
        inputs = [t.detach().requires_grad_(need) for t, need in zip((x, router_weight, w1, w2), ctx.needs_input_grad[:4])]
        with torch.enable_grad():
            y = reference.moe_fixed_routing(
                *inputs, expert.long(), row >= 0, activation=activation, normalize_topk=normalize_topk
            )
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(y, wanted, dy)) if wanted else iter(())
        return tuple(next(grads) if t.requires_grad else None for t in inputs) + (None,) * 5


def _aux(x, router_weight, top_k, counts, row) -> reference.MoEAux:
    """Switch load-balancing loss E * sum_e f_e * mean_t p[t, e]; differentiable through p (recomputed
    with torch from x and router_weight)."""
    T = x.shape[0]
    E = router_weight.shape[0]
    probs = torch.softmax(x.float() @ router_weight.float().t(), dim=-1)
    if T == 0:
        loss = (probs.sum() * 0.0)
    else:
        fraction = counts.float() / float(T * top_k)
        loss = E * (fraction * probs.mean(dim=0)).sum()
    dropped = (row < 0).sum().to(torch.int64)
    return reference.MoEAux(counts=counts.long(), dropped=dropped, aux_loss=loss)


def moe_cuda(x, router_weight, w1, w2, *, top_k, activation="gelu", normalize_topk=True, capacity_factor=None,
             return_aux=False, team=None):
    """flashdmoe.moe on the fused kernel (single rank). Shapes and semantics as flashdmoe.moe."""
    if team is not None and getattr(team, "world_size", 1) != 1:
        raise ValueError(
            f"team: the fused kernel currently runs single-rank teams, got world_size={team.world_size}; "
            "expert parallelism inside the kernel is not implemented yet"
        )
    routing_out: list[FusedRouting] = []
    y = _FusedMoE.apply(x, router_weight, w1, w2, top_k, activation, normalize_topk, capacity_factor, routing_out)
    if not return_aux:
        return y
    routing = routing_out[0]
    return y, _aux(x, router_weight, top_k, routing.counts, routing.row)
