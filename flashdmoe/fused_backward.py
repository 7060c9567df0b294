"""The backward of one rank in two persistent kernel launches.

The first (``csrc/backward/fused_backward.cuh``), from the forward's routing and saved pre-activations,
computes every expert GEMM of the backward on wgmma fed by TMA: ``g = dy W2^T`` by row tile with the
element-wise step in its epilogue (``wh = w act(pre)``, ``dpre = w g act'(pre)``, the combine weight's
gradient ``<g, act(pre)>`` as per-tile partials summed in column order), ``dx_rows = dpre W1^T``, and the
weight gradients ``dW2 = wh^T dy_rows`` and ``dW1 = x_rows^T dpre`` over each expert's rows; ``dy_rows``
and ``x_rows`` are never stored: the kernel's producer warpgroup copies each K slab's rows of ``dy`` and
``x`` by token into shared memory (``cp.async``), so the scratch holds only a token index per row besides
``wh``, ``dpre`` and the partial sums. The second
(``csrc/backward/router_backward.cu``, :func:`launch_router`) recomputes the logits, takes the router's
gradient through the softmax and top-k renormalisation, and writes ``dx`` (each token's kept rows of
``dx_rows`` summed in choice order, plus the router's term) and ``d_router``, on mma.sync tiles.
Deterministic: no float atomics, every output element written once, every sum in a fixed order.

Errors (a stuck block: the watchdog) are reported like a forward's: each kernel's last block writes the
status block into a pinned slot, checked at the next launch, :func:`flashdmoe.check_errors` or
:func:`flashdmoe.synchronize` (:mod:`flashdmoe.status_checks`); nothing waits on the host, so the
backward can be captured in a CUDA graph. The sync words come from a pool per (device, stream) and
launch, zero at each launch (the kernel's exit resets them); a capture zeroes its own inside the graph.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flashdmoe import status_checks
from flashdmoe.kernel_codes import ACTIVATION_CODES, DTYPE_CODES
from flashdmoe.launch_knobs import debug, timeout_ms
from flashdmoe.launch_report import LaunchReport, LaunchShape, status_layout
from flashdmoe.workspace_pool import WorkspacePool

__all__ = ["FusedGrads", "launch", "launch_router", "router_unsupported", "unsupported"]

_pool = WorkspacePool()
_router_pool = WorkspacePool()  # its own: alternating sync sizes in one pool would zero them at every launch


class FusedGrads(NamedTuple):
    """What one launch produces. ``dx_rows [T*k, H]`` (each kept row's dx by packed row; None when not
    asked), ``dweight_row [T*k]`` float32 (the combine weight's gradient by packed row),
    ``row_of_choice [T, k]`` int32 (each choice's packed row, -1 where dropped), ``dw1``, ``dw2`` (like
    the weights, None when not asked)."""

    dx_rows: torch.Tensor | None
    dweight_row: torch.Tensor
    row_of_choice: torch.Tensor
    dw1: torch.Tensor | None
    dw2: torch.Tensor | None


def unsupported(dtype: torch.dtype, device: torch.device, tokens: int, hidden: int, ffn: int, experts: int,
                top_k: int) -> str:
    """'' when the fused backward runs this shape here, else why not."""
    if device.type != "cuda":
        return f"the fused backward runs on CUDA devices, not {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the fused backward takes bfloat16 and float16, not {dtype}"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "the fused backward needs Hopper (wgmma, TMA)"
    from flashdmoe import extension

    why = extension.unavailable_reason()
    if why:
        return why
    return extension.loaded().fused_backward_unsupported(tokens, hidden, ffn, experts, top_k)


@functools.lru_cache(maxsize=256)
def _layout(ext, tokens, hidden, ffn, experts, top_k, activation_code) -> dict:
    return ext.fused_backward_layout(tokens, hidden, ffn, experts, top_k, activation_code)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it in fresh storage when its data does not start on a 16-byte boundary: the
    kernel copies rows of ``x`` and ``dy`` in 16-byte pieces (a contiguous view at an odd offset into a
    larger tensor is the only way such a tensor arises)."""
    return t if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _sync_words(pool: WorkspacePool, device: torch.device, stream: int, nbytes: int, capturing: bool):
    """A launch's zeroed sync words: ``pool``'s buffer for (device, stream), or inside a CUDA-graph capture
    the graph's own, zeroed inside the graph (see workspace_pool). Returns ``(address, tensor)``, the
    tensor (None for the pool's) to be held until the launch is queued."""
    if capturing:
        sync = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return sync.data_ptr(), sync
    return pool.address(device, device.index, stream, nbytes, nbytes), None


def _run_recorded(run, args: dict, stream: int, index: int, capturing: bool, tokens: int, experts: int,
                  row_bytes: int) -> None:
    """Queue one launch (``run(args, stream)``, the extension's function) on a status slot of its own and
    record it, so that its error surfaces like a forward's (:mod:`flashdmoe.status_checks`)."""
    slot = status_checks.claim_slot(index, capturing)
    args["status_host"] = slot.address
    try:
        info = run(args, stream)
    except Exception:
        slot.give_back()
        raise
    shape = LaunchShape((0,), (tokens,), experts, row_bytes, timeout_ms())
    status = status_layout()
    # a captured launch's slot belongs to its graph for good: never waited on, never given back
    report = LaunchReport(shape, status_checks.next_launch_id(), index, info, status, slot.view[:status.bytes],
                          None if capturing else slot, None if capturing else slot.give_back, capturing)
    status_checks.launched(report, slot, None, forward=False)


def launch(x: torch.Tensor, dy: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor,
           expert32: torch.Tensor, row32: torch.Tensor, weight32: torch.Tensor, *, activation: str,
           need_dx: bool, need_dw1: bool, need_dw2: bool) -> FusedGrads:
    """One launch on ``x``'s device and its current stream; does not wait.

    x, dy ``[T, H]``; w1 ``[E, H, I or 2I]``; w2 ``[E, I, H]``; pre ``[>= kept rows, I or 2I]`` (the
    forward's saved pre-activations by packed row); all one 16-bit dtype, contiguous. expert32, row32
    ``[T, k]`` int32 and weight32 ``[T, k]`` float32: the forward's routing. The caller checked shapes,
    dtypes and devices (:func:`flashdmoe.expert_backward.expert_backward`) and ``T > 0``. ``x`` or
    ``dy`` not 16-byte aligned is copied first (:func:`_aligned`).
    """
    from flashdmoe import extension

    x, dy = _aligned(x), _aligned(dy)

    ext = extension.loaded()
    tokens, hidden = x.shape
    experts, ffn = w2.shape[0], w2.shape[1]
    top_k = expert32.shape[1]
    layout = _layout(ext, tokens, hidden, ffn, experts, top_k, ACTIVATION_CODES[activation])
    device = x.device
    index = device.index
    capturing = torch.cuda.is_current_stream_capturing()
    status_checks.before_launch(index, None, capturing)
    stream = torch._C._cuda_getCurrentRawStream(index)
    sync_address, _sync = _sync_words(_pool, device, stream, layout["sync_bytes"], capturing)
    scratch = torch.empty(layout["scratch_bytes"], dtype=torch.uint8, device=device)
    choices = tokens * top_k
    dx_rows = torch.empty(choices, hidden, dtype=x.dtype, device=device) if need_dx else None
    dweight_row = torch.empty(choices, dtype=torch.float32, device=device)
    dw1 = torch.empty_like(w1) if need_dw1 else None
    dw2 = torch.empty_like(w2) if need_dw2 else None
    if debug.poison_outputs:
        for out in (dx_rows, dweight_row, dw1, dw2):
            if out is not None:
                out.fill_(float("nan"))
    offset = layout["row_of_choice_offset"]
    row_of_choice = scratch[offset:offset + 4 * choices].view(torch.int32).view(tokens, top_k)
    args = {
        "dtype": DTYPE_CODES[x.dtype], "activation": ACTIVATION_CODES[activation],
        "tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts, "top_k": top_k,
        "need_dx": need_dx, "need_dw1": need_dw1, "need_dw2": need_dw2,
        "x": x.data_ptr(), "dy": dy.data_ptr(), "w1": w1.data_ptr(), "w2": w2.data_ptr(), "pre": pre.data_ptr(),
        "expert": expert32.data_ptr(), "row": row32.data_ptr(), "weight": weight32.data_ptr(),
        "dw1": 0 if dw1 is None else dw1.data_ptr(), "dw2": 0 if dw2 is None else dw2.data_ptr(),
        "dx_rows": 0 if dx_rows is None else dx_rows.data_ptr(), "dweight_row": dweight_row.data_ptr(),
        "sync": sync_address, "scratch": scratch.data_ptr(),
        "timeout_ns": timeout_ms() * 1_000_000, "debug_withhold_phase": debug.withhold_phase,
        "max_blocks": debug.max_blocks,
    }
    _run_recorded(ext.fused_backward, args, stream, index, capturing, tokens, experts, hidden * x.element_size())
    return FusedGrads(dx_rows, dweight_row, row_of_choice, dw1, dw2)


def router_unsupported(tokens: int, hidden: int, experts: int, top_k: int) -> str:
    """'' when the second launch (:func:`launch_router`) takes these shapes, else why not (then
    :func:`flashdmoe.expert_backward.expert_backward` takes the router's gradient and dx with torch GEMMs
    and the extension's small kernels)."""
    from flashdmoe import extension

    return extension.loaded().router_backward_unsupported(tokens, hidden, experts, top_k)


@functools.lru_cache(maxsize=256)
def _router_layout(ext, tokens, hidden, experts, top_k, blocks) -> dict:
    return ext.router_backward_layout(tokens, hidden, experts, top_k, blocks)


def router_launch_args(dtype_code: int, tokens: int, hidden: int, experts: int, top_k: int, normalize_topk: bool,
                       need_dx: bool, need_router: bool, blocks: int, **pointers: int) -> dict:
    """The extension's ``router_backward`` arguments (RouterBackwardArgs' fields): the shapes and flags,
    the debug knobs and the watchdog's limit, and ``pointers`` (``x``, ``router``, ``expert``,
    ``row_of_choice``, ``dweight_row``, ``dx_rows``, ``dx``, ``d_router``, ``sync``, ``scratch``: device
    addresses, 0 for none); ``status_host`` is added at the launch."""
    return {
        "dtype": dtype_code, "tokens": tokens, "hidden": hidden, "experts": experts, "top_k": top_k,
        "normalize_topk": bool(normalize_topk), "need_dx": need_dx, "need_router": need_router, **pointers,
        "timeout_ns": timeout_ms() * 1_000_000, "debug_withhold_phase": debug.withhold_phase, "blocks": blocks,
        "max_blocks": debug.max_blocks, "status_host": 0,
    }


def launch_router(x: torch.Tensor, router_weight: torch.Tensor, expert32: torch.Tensor, grads: FusedGrads, *,
                  normalize_topk: bool, need_dx: bool, need_router: bool):
    """The second launch, after :func:`launch` on the same stream; does not wait. Returns ``(dx, d_router)``.

    x ``[T, H]`` and router_weight ``[E, H]`` (16-bit, contiguous; copied first if not 16-byte aligned),
    expert32 ``[T, k]`` int32, ``grads`` the first launch's (its ``dx_rows`` present when ``need_dx``).
    dx ``[T, H]`` like x and d_router ``[E, H]`` like router_weight, None where not wanted. The caller
    checked :func:`router_unsupported`.
    """
    from flashdmoe import extension

    ext = extension.loaded()
    tokens, hidden = x.shape
    experts, top_k = router_weight.shape[0], expert32.shape[1]
    device = x.device
    index = device.index
    blocks = torch.cuda.get_device_properties(index).multi_processor_count
    layout = _router_layout(ext, tokens, hidden, experts, top_k, blocks)
    capturing = torch.cuda.is_current_stream_capturing()
    status_checks.before_launch(index, None, capturing)
    stream = torch._C._cuda_getCurrentRawStream(index)
    sync_address, _sync = _sync_words(_router_pool, device, stream, layout["sync_bytes"], capturing)
    scratch = torch.empty(layout["scratch_bytes"], dtype=torch.uint8, device=device)
    dx = torch.empty_like(x) if need_dx else None
    d_router = torch.empty_like(router_weight) if need_router else None
    if debug.poison_outputs:
        for out in (dx, d_router):
            if out is not None:
                out.fill_(float("nan"))
    x, router_weight = _aligned(x), _aligned(router_weight)
    args = router_launch_args(
        DTYPE_CODES[x.dtype], tokens, hidden, experts, top_k, normalize_topk, need_dx, need_router, blocks,
        x=x.data_ptr(), router=router_weight.data_ptr(), expert=expert32.data_ptr(),
        row_of_choice=grads.row_of_choice.data_ptr(), dweight_row=grads.dweight_row.data_ptr(),
        dx_rows=grads.dx_rows.data_ptr() if need_dx else 0, dx=0 if dx is None else dx.data_ptr(),
        d_router=0 if d_router is None else d_router.data_ptr(), sync=sync_address, scratch=scratch.data_ptr())
    _run_recorded(ext.router_backward, args, stream, index, capturing, tokens, experts, hidden * x.element_size())
    return dx, d_router
