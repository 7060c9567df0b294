"""The expert backward of one rank as one persistent kernel launch (``csrc/backward/fused_backward.cuh``).

From the forward's routing and saved pre-activations, one cooperative launch computes every expert GEMM
of the backward on wgmma fed by TMA: ``g = dy W2^T`` by row tile with the element-wise step in its
epilogue (``wh = w act(pre)``, ``dpre = w g act'(pre)``, the combine weight's gradient ``<g, act(pre)>``
as per-tile partials summed in column order), ``dx_rows = dpre W1^T``, and the weight gradients
``dW2 = wh^T dy_rows`` and ``dW1 = x_rows^T dpre`` over each expert's rows. Deterministic: no float
atomics, every output element written once, every sum in a fixed order. The router's gradient and the
sum of a token's ``k`` rows of ``dx`` follow in the extension's small kernels
(:func:`flashdmoe.backward.expert_backward.expert_backward`).

Errors (a stuck block: the watchdog) are reported like a forward's: the kernel's last block writes the
status block into a pinned slot, checked at the next launch, :func:`flashdmoe.check_errors` or
:func:`flashdmoe.synchronize` (:mod:`flashdmoe.kernel.status_checks`); nothing waits on the host, so the
backward can be captured in a CUDA graph. The sync words come from a pool per (device, stream), zero
at each launch (the kernel's exit resets them); a capture zeroes its own inside the graph.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flashdmoe.kernel import status_checks
from flashdmoe.kernel.kernel_codes import ACTIVATION_CODES, DTYPE_CODES
from flashdmoe.kernel.launch_knobs import debug, timeout_ms
from flashdmoe.kernel.launch_report import LaunchShape
from flashdmoe.kernel.workspace_pool import WorkspacePool, captured_sync_words

__all__ = ["FusedGrads", "launch", "unsupported"]

_pool = WorkspacePool()


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
    from flashdmoe.kernel import extension

    why = extension.unavailable_reason()
    if why:
        return why
    return extension.loaded().fused_backward_unsupported(tokens, hidden, ffn, experts, top_k)


@functools.lru_cache(maxsize=256)
def _layout(ext, tokens, hidden, ffn, experts, top_k, activation_code) -> dict:
    return ext.fused_backward_layout(tokens, hidden, ffn, experts, top_k, activation_code)


def launch(x: torch.Tensor, dy: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor,
           expert32: torch.Tensor, row32: torch.Tensor, weight32: torch.Tensor, *, activation: str,
           need_dx: bool, need_dw1: bool, need_dw2: bool) -> FusedGrads:
    """One launch on ``x``'s device and its current stream; does not wait.

    x, dy ``[T, H]``; w1 ``[E, H, I or 2I]``; w2 ``[E, I, H]``; pre ``[>= kept rows, I or 2I]`` (the
    forward's saved pre-activations by packed row); all one 16-bit dtype, contiguous. expert32, row32
    ``[T, k]`` int32 and weight32 ``[T, k]`` float32: the forward's routing. The caller checked shapes,
    dtypes and devices (:func:`flashdmoe.backward.expert_backward.expert_backward`) and ``T > 0``.
    """
    from flashdmoe.kernel import extension

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
    if capturing:  # kept by the graph, or zeroed inside it (see workspace_pool)
        sync_address, sync = captured_sync_words(device, layout["sync_bytes"])
    else:
        sync_address = _pool.address(device, index, stream, layout["sync_bytes"], layout["sync_bytes"])
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
    shape = LaunchShape((0,), (tokens,), experts, hidden * x.element_size(), timeout_ms())
    status_checks.record_launch(status_checks.claim_slot(index, capturing),
                                lambda status: ext.fused_backward({**args, "status_host": status}, stream), (), shape,
                                index, capturing, forward=False)
    return FusedGrads(dx_rows, dweight_row, row_of_choice, dw1, dw2)
