"""The MoE layer's backward on one rank from the routing its forward saved: grouped GEMMs and element-wise kernels.

:func:`expert_backward` computes the gradients of ``<dy, y>`` with ``y`` the layer of
:func:`flashdmoe.reference.moe_fixed_routing` (routing fixed, router probabilities differentiated through
softmax and the top-k renormalisation) with respect to ``x``, ``router_weight``, ``w1`` and ``w2``.
Expert work runs as grouped GEMMs over all experts at once; nothing loops over experts in Python, nothing
waits on the host, every shape is fixed by the input shapes, so a call can be captured in a CUDA graph.
It is deterministic: no atomics; each reduction (GEMMs, the sum of a token's ``k`` choices, the router's
sums) runs in a fixed order.

Per kept choice ``(t, j)`` of expert ``e`` with combine weight ``w`` (``pre`` recomputed, see below)::

    pre = x_t @ W1_e,  h = act(pre),  g = dy_t @ W2_e^T
    dweight_tj = <g, h>                         (gradient of the combine weight)
    dW2_e += (w h)^T dy_t
    dpre = w g * act'(pre),  dW1_e += x_t^T dpre,  dx_t += dpre @ W1_e^T

then the router: ``dweight`` through the renormalisation (when ``normalize_topk``), the gather of the
chosen probabilities and the softmax gives ``dlogits [T, E]``; ``d_router = dlogits^T x`` and
``dx += dlogits @ router_weight``, in the compute dtype.

GEMM back ends (``gemm=``):

* ``"fused"``: one persistent kernel launch for every expert GEMM, the element-wise step in the first
  GEMM's epilogue (:mod:`flashdmoe.backward.fused_backward`); it needs the forward's saved ``pre``, 16-bit inputs,
  Hopper and the extension, ``H`` and ``I`` multiples of 64. ``g`` stays float32 into the epilogue
  (rounded nowhere), ``wh``, ``dpre`` and the per-row ``dx`` are rounded once as below.
* ``"grouped_mm"``: ``torch._grouped_mm`` on the rows packed by expert (``offs`` = each expert's end row,
  derived on the device): 2D x 3D for the row GEMMs, 2D x 2D for the weight gradients. It takes float32,
  bfloat16 and float16 and returns its input dtype (a float32 ``out_dtype`` for half inputs is refused).
  On CUDA only bfloat16 on compute capability 9.x / 10.x runs the CUTLASS kernel; every other CUDA case
  falls back to a per-group loop that copies ``offs`` to the host (a synchronisation, not capturable),
  so it is never chosen there. It is used on 9.x (Hopper) only: on 10.x, weight gradients of empty
  groups have been reported non-zero (pytorch/pytorch#172439). On CPU it takes all three dtypes. Row
  strides must be multiples of 16 bytes (``H`` and ``I`` multiples of ``16 / element size``). It has no
  float64.
* ``"padded_bmm"``: ``torch.bmm`` over ``[E, M, .]`` blocks, expert ``e``'s rows at ``[e * M, e * M + n_e)``,
  the rest zero. ``M = max_rows_per_expert`` (default ``T``: a token picks an expert at most once; pass
  the capacity when there is one), so it costs ``E * M / (T * k)`` times the grouped GEMMs' work and
  memory: a fallback for float16 / float32 on CUDA, float64, shapes that break the stride rule, and
  torch without ``_grouped_mm``.
* ``"auto"`` (default): ``"fused"`` where it runs and the experts get at most
  ``FUSED_MAX_ROWS_PER_EXPERT`` routed rows on average (``T * k <= 512 * E``), else ``"grouped_mm"``
  where it runs without a host synchronisation, else ``"padded_bmm"``. With its consumer warpgroups apart
  the fused launch's backward was 2–8% faster than the grouped GEMMs' from 256 to 512 rows per expert (an
  H100 on four shapes, an H200 on two) and level or slower at 1024 (docs/perf-notes.md, "Next steps").

Element-wise back ends (``elementwise=``), for the step between the row GEMMs and for the sum of a
token's ``k`` rows of ``dx``:

* ``"cuda"``: the extension's kernels (``csrc/backward/``): one pass over the rows reads ``pre`` and ``g``
  in the storage dtype and writes ``dweight`` (float32), ``w h`` and ``dpre`` (storage dtype), all
  arithmetic in float32; a second kernel sums each token's kept ``dx`` rows in choice order and the
  router's term, rounding once. bfloat16 / float16 on a GPU the extension runs on, ``H`` and ``I``
  multiples of 8. No float32 ``[rows, I]`` temporaries.
* ``"torch"``: the same arithmetic as torch ops in the compute dtype (every dtype and device).
* ``"auto"`` (default): ``"cuda"`` where it runs, else ``"torch"``.

Saved or recomputed pre-activations (``pre=``): the fused forward saves ``pre`` by packed row when a
gradient is wanted (one rank, 16-bit inputs): ``T * k * I`` elements (``2I`` for swiglu) held from the
forward to the backward (Qwen3-30B-A3B's layer at 8192 tokens: 200 MB in bf16; Mixtral 8x7B's at 4096:
470 MB), for one grouped GEMM fewer (a quarter of the backward's GEMM FLOPs for gelu/relu/silu, a third
for swiglu). Without it ``pre`` is recomputed (emulated teams, float32, the custom op). The saved values
are the kernel's float32 accumulators rounded once, as the recomputed ones are.

Precision: GEMMs accumulate in float32 (float64 for float64 inputs) and write the input dtype (what
``torch._grouped_mm`` allows), so ``pre``, ``g``, ``w h``, ``dpre`` and the per-row ``dx`` are each
rounded once to the storage format; activations, their derivatives, the ``k``-sum and the router's
softmax run in the compute dtype (:func:`flashdmoe.reference.compute_dtype`). The router's GEMMs: with
the CUDA element-wise kernels, tensor-core GEMMs on the 16-bit ``x`` and ``router_weight`` with float32
results (``dlogits`` rounded once to the storage dtype for ``d_router`` and the router's share of
``dx``); otherwise ``x`` and ``router_weight`` are upcast (activation- and router-sized, not the expert
weights). float32 GEMMs on CUDA follow ``torch.backends.cuda.matmul.allow_tf32`` (off by default).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from flashdmoe.backward import fused_backward
from flashdmoe.kernel.kernel_codes import ACTIVATION_CODES, DTYPE_CODES
from flashdmoe.kernel.launch_knobs import debug
from flashdmoe.reference import ACTIVATIONS, compute_dtype

__all__ = ["expert_backward", "choose_gemm", "PackedRows", "packed_row_grads", "ELEMENTWISE_BACKENDS", "FUSED_MAX_ROWS_PER_EXPERT", "GEMM_BACKENDS",
           "elementwise_kernels_supported", "grouped_mm_supported", "packed_rows"]

GEMM_BACKENDS = ("auto", "fused", "grouped_mm", "padded_bmm")
ELEMENTWISE_BACKENDS = ("auto", "cuda", "torch")
# "auto" takes the fused launch up to this many routed rows per expert on average (measured crossover:
# faster up to 512, level or slower at 1024; docs/perf-notes.md).
FUSED_MAX_ROWS_PER_EXPERT = 512
# What the element-wise kernels take (csrc/backward/expert_grad.h: 16-bit storage).
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_STORAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def packed_rows(expert: torch.Tensor, keep: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The ``row`` this module takes, as one rank's fused kernel numbers it: kept choices grouped by expert
    (expert 0's first), token order within an expert, rows ``0 .. kept - 1`` without gaps, ``-1`` where
    dropped. expert ``[T, k]`` int (distinct per token), keep ``[T, k]`` bool -> ``[T, k]`` int32.
    (Emulated teams' rows index the owners' streams instead; the CPU op has no kernel to number them.)"""
    key = torch.where(keep, expert.long(), num_experts).flatten()
    order = torch.sort(key, stable=True).indices
    packed = torch.empty_like(order)
    packed[order] = torch.arange(order.numel(), device=order.device)
    return torch.where(keep, packed.view_as(expert), -1).to(torch.int32)


def grouped_mm_supported(dtype: torch.dtype, device: torch.device, hidden: int, intermediate: int) -> str:
    """'' when ``torch._grouped_mm`` runs this backward without a host synchronisation, else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"torch._grouped_mm takes float32, bfloat16 and float16, not {dtype}"
    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        if dtype != torch.bfloat16 or major != 9:
            # Only bf16 on sm90 / sm100 reaches the CUTLASS kernel; the rest loops over offs.cpu().
            # sm100 is left out: empty groups' weight gradients reported wrong there (pytorch#172439).
            return (f"torch._grouped_mm on CUDA is used for bfloat16 on compute capability 9.x only "
                    f"(got {dtype}, {major}.x)")
    elif device.type != "cpu":
        return f"device {device.type} is not CPU or CUDA"
    align = 16 // torch.empty((), dtype=dtype).element_size()
    if hidden % align or intermediate % align:
        return (f"torch._grouped_mm needs H and I to be multiples of {align} for {dtype} "
                f"(got H={hidden}, I={intermediate})")
    return ""


def choose_gemm(dtype: torch.dtype, device: torch.device, tokens: int, hidden: int, intermediate: int, experts: int,
                top_k: int, have_pre: bool, elementwise: str = "auto") -> str:
    """The GEMM back end ``gemm="auto"`` runs (module docstring): ``"fused"``, ``"grouped_mm"`` or
    ``"padded_bmm"``. have_pre: the forward's pre-activations were saved (the fused launch needs them)."""
    max_rows = FUSED_MAX_ROWS_PER_EXPERT if debug.fused_backward_max_rows is None else debug.fused_backward_max_rows
    if (have_pre and elementwise != "torch" and tokens * top_k <= max_rows * experts
            and not fused_backward.unsupported(dtype, device, tokens, hidden, intermediate, experts, top_k)):
        return "fused"
    return "padded_bmm" if grouped_mm_supported(dtype, device, hidden, intermediate) else "grouped_mm"


def _check(x, router_weight, w1, w2, expert, weight, row, dy, activation, needs, gemm, max_rows_per_expert,
           elementwise, pre):
    """Shapes, dtypes and devices (host-side metadata only, nothing read from the device)."""
    if elementwise not in ELEMENTWISE_BACKENDS:
        raise ValueError(f"elementwise={elementwise!r}: expected one of {ELEMENTWISE_BACKENDS}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; expected one of {ACTIVATIONS}")
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"gemm={gemm!r}: expected one of {GEMM_BACKENDS}")
    if len(needs) != 4 or not all(isinstance(n, bool) for n in needs):
        raise ValueError(f"needs={needs!r}: expected 4 bools (dx, d_router, dw1, dw2)")
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [T, H]")
    if x.dtype not in _STORAGE_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; expected one of {_STORAGE_DTYPES}")
    tokens, hidden = x.shape
    if router_weight.dim() != 2 or router_weight.shape[1] != hidden:
        raise ValueError(f"router_weight has shape {tuple(router_weight.shape)}; expected [E, H={hidden}]")
    experts = router_weight.shape[0]
    if w2.dim() != 3 or w2.shape[0] != experts or w2.shape[2] != hidden:
        raise ValueError(f"w2 has shape {tuple(w2.shape)}; expected [E={experts}, I, H={hidden}]")
    intermediate = w2.shape[1]
    w1_cols = 2 * intermediate if activation == "swiglu" else intermediate
    if tuple(w1.shape) != (experts, hidden, w1_cols):
        raise ValueError(f"w1 has shape {tuple(w1.shape)}; expected [{experts}, {hidden}, {w1_cols}] "
                         f"(I={intermediate}, activation={activation!r})")
    if tuple(dy.shape) != (tokens, hidden):
        raise ValueError(f"dy has shape {tuple(dy.shape)}; expected [T={tokens}, H={hidden}]")
    for name, tensor in (("router_weight", router_weight), ("w1", w1), ("w2", w2), ("dy", dy)):
        if tensor.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {tensor.dtype}; expected x's dtype {x.dtype}")
    if expert.dim() != 2 or expert.shape[0] != tokens or not 1 <= expert.shape[1] <= experts:
        raise ValueError(f"expert has shape {tuple(expert.shape)}; expected [T={tokens}, k] with 1 <= k <= E={experts}")
    for name, tensor in (("weight", weight), ("row", row)):
        if tensor.shape != expert.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected expert's shape {tuple(expert.shape)}")
    for name, tensor in (("expert", expert), ("row", row)):
        if tensor.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} has dtype {tensor.dtype}; expected int32 or int64")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"weight has dtype {weight.dtype}; expected a float dtype (float32 from the kernel)")
    for name, tensor in (("router_weight", router_weight), ("w1", w1), ("w2", w2), ("expert", expert),
                         ("weight", weight), ("row", row), ("dy", dy)):
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}; expected x's device {x.device}")
    if max_rows_per_expert is not None and (not isinstance(max_rows_per_expert, int)
                                            or isinstance(max_rows_per_expert, bool) or max_rows_per_expert < 0):
        raise ValueError(f"max_rows_per_expert={max_rows_per_expert!r}: expected None or an int >= 0")
    if pre is not None and (pre.dim() != 2 or pre.shape[1] != w1_cols or pre.shape[0] < expert.numel()
                            or pre.dtype != x.dtype or pre.device != x.device):
        raise ValueError(f"pre has shape {tuple(pre.shape)}, dtype {pre.dtype} on {pre.device}; expected "
                         f"[>= T*k={expert.numel()}, {w1_cols}] {x.dtype} on {x.device}")
    if gemm == "grouped_mm":
        why = grouped_mm_supported(x.dtype, x.device, hidden, intermediate)
        if why:
            raise ValueError(f"gemm='grouped_mm' cannot run here: {why}")
    return tokens, hidden, intermediate, experts


class _Rows:
    """Where each kept choice's row lives and the grouped GEMMs over those rows.

    ``rows`` rows in all (``T * k`` packed, or ``E * M`` padded). ``token_of_row [rows]`` int64 and
    ``w_row [rows]`` (compute dtype): each row's token and combine weight (token 0 and weight 0 for a row
    holding no choice); ``rows_of_tokens [T, k]`` int32: each choice's row, -1 when dropped; ``offs [E]``
    int32: each expert's end row (packed). Torch-built tables (no ``kernels``) also have ``kept [T * k]``
    bool and ``row_of_choice [T * k]`` int64 (0 for a dropped choice, which is masked).
    With the extension's kernels and packed rows the table is one launch (``backward_rows``) on ``stream``,
    reading ``expert32`` (``expert`` as contiguous int32); both None without the kernels.
    """

    live_rows = None  # every row is this step's (PackedRows over a bound has a device end row instead)

    def __init__(self, expert, row, weight, experts, padded_rows, kernels, cdtype, expert32, stream):
        tokens, top_k = expert.shape
        choices = tokens * top_k
        device = expert.device
        self.experts = experts
        self.padded_rows = padded_rows
        if kernels is not None and padded_rows is None:
            self.rows = choices
            self.live = None
            self.token_of_row = torch.zeros(choices, dtype=torch.int64, device=device)
            self.w_row = torch.zeros(choices, dtype=torch.float32, device=device)
            self.rows_of_tokens = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
            expert_end = torch.zeros(experts, dtype=torch.int32, device=device)
            row32 = row.to(torch.int32).contiguous()
            weight32 = weight.to(torch.float32).contiguous()
            kernels.backward_rows(expert32.data_ptr(), row32.data_ptr(), weight32.data_ptr(), choices, top_k, experts,
                                  self.token_of_row.data_ptr(), self.w_row.data_ptr(), self.rows_of_tokens.data_ptr(),
                                  expert_end.data_ptr(), stream)
            self.offs = torch.cummax(expert_end, 0).values  # empty experts end where the previous one did
            return
        # Bounded on the device: routing of a forward that failed (its error surfaces at the next check)
        # must not make the gathers and scatters below read or write out of range.
        flat_expert = expert.reshape(-1).long().clamp(0, experts - 1)
        flat_row = row.reshape(-1).long()
        self.kept = (flat_row >= 0) & (flat_row < choices)
        choice_ids = torch.arange(choices, device=device)
        # Dropped choices write to their own slots past the end (never the same index twice, so the
        # scatters are deterministic) and those slots are cut off.
        target = torch.where(self.kept, flat_row, choices + choice_ids)
        # Packed rows are ordered by expert, so expert_of_row is sorted (unused tail rows: E, also sorted).
        expert_of_row = flat_expert.new_full((2 * choices,), experts).scatter_(0, target, flat_expert)[:choices]
        expert_ids = torch.arange(experts, device=device)
        self.offs = torch.searchsorted(expert_of_row, expert_ids, right=True, out_int32=True)
        if padded_rows is None:
            self.rows = choices
            self.row_of_choice = torch.where(self.kept, flat_row, 0)
            self.choice_of_row = choice_ids.new_zeros(2 * choices).scatter_(0, target, choice_ids)[:choices]
            self.live = None
        else:
            start = torch.searchsorted(expert_of_row, expert_ids, right=False)
            slot = flat_row - start.index_select(0, flat_expert)
            # A device-side assert, not a host read: too small an M must not silently mix two experts' rows.
            torch._assert_async(torch.where(self.kept, slot < padded_rows, True).all(),
                                "max_rows_per_expert is smaller than an expert's kept rows")
            padded = flat_expert * padded_rows + slot
            self.rows = experts * padded_rows
            padded_target = torch.where(self.kept, padded, self.rows + choice_ids)
            self.row_of_choice = torch.where(self.kept, padded, 0)
            self.choice_of_row = choice_ids.new_zeros(self.rows + choices).scatter_(
                0, padded_target, choice_ids)[:self.rows]
            self.live = torch.zeros(self.rows + choices, dtype=torch.bool, device=device).scatter_(
                0, padded_target, True)[:self.rows]
            self.packed_row_of_row = torch.where(self.kept, flat_row, 0).index_select(0, self.choice_of_row)
        self.token_of_row = self.choice_of_row // top_k
        self.w_row = weight.reshape(-1).index_select(0, self.choice_of_row).to(cdtype)
        if self.live is not None:
            self.w_row = torch.where(self.live, self.w_row, 0)  # padding rows add nothing to the weight gradients
        self.rows_of_tokens = torch.where(self.kept, self.row_of_choice, -1).to(torch.int32).view(tokens, top_k)

    def rows_times(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Row ``r`` of expert ``e``: ``a[r] @ b[e]``. a: ``[rows, K]``; b: ``[E, K, N]`` -> ``[rows, N]``."""
        if self.padded_rows is None:
            return torch._grouped_mm(a, b, offs=self.offs)
        out = torch.bmm(a.view(self.experts, self.padded_rows, a.shape[1]), b)
        return out.view(self.rows, b.shape[2])

    def per_expert_outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``sum over expert e's rows r of a[r]^T b[r]``. a: ``[rows, K1]``; b: ``[rows, K2]`` -> ``[E, K1, K2]``
        (zero for an expert with no rows)."""
        if self.padded_rows is None:
            return torch._grouped_mm(a.t(), b, offs=self.offs)
        shape = (self.experts, self.padded_rows)
        return torch.bmm(a.view(*shape, a.shape[1]).transpose(1, 2), b.view(*shape, b.shape[1]))


def to_device_without_waiting(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU tensor on ``device``, copied from pinned memory: a copy from pageable memory would wait
    for everything queued on the stream (a host synchronisation)."""
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


class PackedRows:
    """Rows already packed by expert. Either the host knows each expert's count (``counts``: one int per
    expert; :mod:`flashdmoe.backward.ep_backward` reads them once per eager backward), and the grouped
    GEMMs run as ``torch._grouped_mm`` where it runs without a host synchronisation
    (:func:`grouped_mm_supported`), else as one ``torch.mm`` per expert with rows (slicing by host counts
    costs no synchronisation). Or only the device knows them (``counts`` None, ``offs``: each expert's end
    row, int32 on the device; a backward captured in a CUDA graph, over ``rows`` rows sized for a bound):
    then ``torch._grouped_mm`` must run, and the rows past ``offs[-1]`` are left alone
    (``live_rows``, the element-wise kernel's bound), their outputs unspecified."""

    def __init__(self, counts: Sequence[int] | None, dtype: torch.dtype, device: torch.device, hidden: int,
                 intermediate: int, *, offs: torch.Tensor | None = None, rows: int | None = None) -> None:
        self.padded_rows = None
        if counts is None:
            why = grouped_mm_supported(dtype, device, hidden, intermediate)
            if offs is None or rows is None or why:
                raise ValueError("PackedRows without host counts needs offs and rows, and torch._grouped_mm: "
                                 + (why or "offs or rows is missing"))
            self.counts, self.experts, self.rows, self.grouped = None, offs.numel(), rows, True
            self.offs, self.live_rows = offs, offs[-1:]
            return
        self.counts = [int(c) for c in counts]
        if any(c < 0 for c in self.counts):
            raise ValueError(f"counts={self.counts}: expected non-negative row counts")
        self.experts = len(self.counts)
        self.starts, at = [], 0
        for c in self.counts:
            self.starts.append(at)
            at += c
        self.rows = at
        self.live_rows = None
        self.grouped = not grouped_mm_supported(dtype, device, hidden, intermediate)
        self.offs = to_device_without_waiting(
            torch.tensor([s + c for s, c in zip(self.starts, self.counts)], dtype=torch.int32), device)

    def _spans(self):
        return [(e, s, s + c) for e, (s, c) in enumerate(zip(self.starts, self.counts)) if c]

    def rows_times(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Row ``r`` of expert ``e``: ``a[r] @ b[e]``. a: ``[rows, K]``; b: ``[E, K, N]`` -> ``[rows, N]``."""
        if self.grouped:
            return torch._grouped_mm(a, b, offs=self.offs)
        out = a.new_empty(self.rows, b.shape[2])
        for e, start, end in self._spans():
            torch.mm(a[start:end], b[e], out=out[start:end])
        return out

    def per_expert_outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``sum over expert e's rows r of a[r]^T b[r]``. a: ``[rows, K1]``; b: ``[rows, K2]`` -> ``[E, K1, K2]``
        (zero for an expert with no rows)."""
        if self.grouped:
            return torch._grouped_mm(a.t(), b, offs=self.offs)
        out = a.new_zeros(self.experts, a.shape[1], b.shape[1])
        for e, start, end in self._spans():
            torch.mm(a[start:end].t(), b[start:end], out=out[e])
        return out


def packed_row_grads(x_rows: torch.Tensor, dy_rows: torch.Tensor, w_row: torch.Tensor,
                     counts: Sequence[int] | None, w1: torch.Tensor, w2: torch.Tensor, *, activation: str,
                     need_dw1: bool = True, need_dw2: bool = True, elementwise: str = "auto",
                     offs: torch.Tensor | None = None):
    """The expert half of the backward on rows already packed by expert (an expert owner's rows of a team):
    ``pre`` recomputed, then :func:`expert_backward`'s steps up to (not including) the router and the
    per-token sums.

    x_rows, dy_rows: ``[rows, H]`` (16-bit or float32), expert ``e``'s rows at ``[sum(counts[:e]),
    sum(counts[:e+1]))``; w_row: ``[rows]`` float32, each row's combine weight; counts: each expert's row
    count (host ints, ``len(counts) = E``), or None with ``offs`` ``[E]`` int32 on the device, each expert's
    end row (:class:`PackedRows`: the rows past ``offs[-1]`` are left alone and their outputs unspecified);
    w1 ``[E, H, I or 2I]``, w2 ``[E, I, H]``.

    Returns ``(dweight_row [rows] float32, dx_rows [rows, H] x's dtype, dw1 like w1 or None, dw2 like w2 or
    None)``: each row's combine-weight gradient ``<g, act(pre)>`` and dx share ``(w g act'(pre)) W1^T``.
    """
    dtype, device = x_rows.dtype, x_rows.device
    hidden, intermediate = x_rows.shape[1], w2.shape[1]
    layout = PackedRows(counts, dtype, device, hidden, intermediate, offs=offs, rows=x_rows.shape[0])
    if layout.experts != w1.shape[0] or x_rows.shape[0] != layout.rows or dy_rows.shape != x_rows.shape \
            or w_row.shape != (layout.rows,):
        raise ValueError(f"packed_row_grads: x_rows {list(x_rows.shape)}, dy_rows {list(dy_rows.shape)}, "
                         f"w_row {list(w_row.shape)} do not match counts (E={layout.experts}, {layout.rows} rows) "
                         f"and w1 {list(w1.shape)}")
    if layout.rows == 0:
        dw1 = torch.zeros_like(w1) if need_dw1 else None
        dw2 = torch.zeros_like(w2) if need_dw2 else None
        return (x_rows.new_zeros(0, dtype=torch.float32), x_rows.new_zeros(0, hidden), dw1, dw2)
    kernels = _elementwise_kernels(elementwise, dtype, device, hidden, intermediate)
    stream = torch.cuda.current_stream(device).cuda_stream if kernels is not None else None
    w1, w2 = w1.contiguous(), w2.contiguous()
    pre = layout.rows_times(x_rows, w1)
    w = w_row.to(torch.float32 if kernels is not None else compute_dtype(dtype)).contiguous()
    dweight_row, dx_rows, dw1, dw2 = _row_step(layout, x_rows, dy_rows, w, pre, w1, w2, activation, kernels, stream,
                                               True, True, need_dw1, need_dw2)
    return dweight_row.to(torch.float32), dx_rows, dw1, dw2

def elementwise_kernels_supported(dtype: torch.dtype, device: torch.device, hidden: int, intermediate: int) -> str:
    """'' when the extension's element-wise backward kernels can run this backward, else why not."""
    if device.type != "cuda":
        return f"the element-wise kernels run on CUDA devices, not {device.type}"
    if dtype not in _KERNEL_DTYPES:
        return f"the element-wise kernels take bfloat16 and float16, not {dtype}"
    if hidden % 8 or intermediate % 8:
        return f"the element-wise kernels need H and I to be multiples of 8 (got H={hidden}, I={intermediate})"
    from flashdmoe.kernel import extension

    return extension.unavailable_reason() or ""


def _elementwise_kernels(choice: str, dtype: torch.dtype, device: torch.device, hidden: int, intermediate: int):
    """The extension module when ``choice`` picks its kernels, else None (``"cuda"`` where they cannot run:
    ValueError)."""
    if choice == "torch":
        return None
    why = elementwise_kernels_supported(dtype, device, hidden, intermediate)
    if why:
        if choice == "cuda":
            raise ValueError(f"elementwise='cuda' cannot run here: {why}")
        return None
    from flashdmoe.kernel import extension

    return extension.loaded()


def _activation_and_derivative(pre: torch.Tensor, activation: str, intermediate: int):
    """``h = act(pre)`` and a function ``dh -> dpre``; all in ``pre``'s (compute) dtype.
    pre: ``[rows, I]`` (``[rows, 2I]`` for swiglu, gate half first)."""
    if activation == "swiglu":
        gate, up = pre[:, :intermediate], pre[:, intermediate:]
        sig = torch.sigmoid(gate)
        silu = gate * sig
        silu_slope = sig * (1 + gate * (1 - sig))
        return silu * up, lambda dh: torch.cat((dh * up * silu_slope, dh * silu), dim=1)
    if activation == "relu":
        return F.relu(pre), lambda dh: torch.where(pre > 0, dh, 0)
    if activation == "silu":
        sig = torch.sigmoid(pre)
        return pre * sig, lambda dh: dh * (sig * (1 + pre * (1 - sig)))
    # exact (erf) gelu: z * Phi(z); derivative Phi(z) + z * phi(z)
    cdf = 0.5 * (1 + torch.erf(pre * (1 / math.sqrt(2))))
    pdf = torch.exp(-0.5 * pre * pre) * (1 / math.sqrt(2 * math.pi))
    return pre * cdf, lambda dh: dh * (cdf + pre * pdf)


def expert_backward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    expert: torch.Tensor,
    weight: torch.Tensor,
    row: torch.Tensor,
    dy: torch.Tensor,
    *,
    activation: str,
    normalize_topk: bool,
    needs: Sequence[bool] = (True, True, True, True),
    gemm: str = "auto",
    max_rows_per_expert: int | None = None,
    elementwise: str = "auto",
    pre: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of the MoE layer on one rank, from what the forward saved. See the module docstring.

    Inputs (``T`` tokens, ``H`` hidden, ``I`` intermediate, ``E`` experts, ``k`` choices per token), all on
    one device:

    x:             ``[T, H]`` bfloat16 / float16 / float32 (float64 accepted: the padded back end).
    router_weight: ``[E, H]``, x's dtype.
    w1:            ``[E, H, I]`` (``[E, H, 2I]`` for swiglu: gate half first, then up half), x's dtype.
    w2:            ``[E, I, H]``, x's dtype.
    expert:        ``[T, k]`` int32 (or int64): the chosen experts, distinct within a token.
    weight:        ``[T, k]`` float32 (any float): the combine weights the forward used (after the top-k
                   renormalisation when ``normalize_topk``).
    row:           ``[T, k]`` int32 (or int64): the choice's row in the packed per-expert buffer of one rank:
                   expert 0's rows first, then expert 1's, ... (rows ``0 .. kept - 1``, no gaps);
                   ``-1``: dropped by capacity (no expert gradient; the choice's probability still sits in
                   the renormalisation's sum, as in :func:`flashdmoe.reference.moe_fixed_routing`).
    dy:            ``[T, H]``, x's dtype: the gradient of the layer's output.

    activation: one of ``relu``, ``gelu`` (exact), ``silu``, ``swiglu``; normalize_topk: as in the forward.
    needs: which of ``(dx, d_router, dw1, dw2)`` to compute (the others come back as None).
    gemm: ``"auto"``, ``"fused"``, ``"grouped_mm"`` or ``"padded_bmm"`` (module docstring).
    max_rows_per_expert: ``M`` of the padded back end (default ``T``); it must bound every expert's kept
    rows (the capacity, when there is one), else a device-side assert fires.
    elementwise: ``"auto"``, ``"cuda"`` or ``"torch"`` (module docstring).
    pre: None (recomputed), or the forward's pre-activations ``[>= kept rows, I or 2I]`` in x's dtype by
    packed row (``row``'s numbering), as the fused kernel saves them: the backward then runs no GEMM1.

    Returns ``(dx [T, H], d_router [E, H], dw1 like w1, dw2 like w2)`` in the inputs' dtype, None where
    ``needs`` says so. ``ValueError`` names the argument that has a wrong shape, dtype or device.
    """
    tokens, hidden, intermediate, experts = _check(x, router_weight, w1, w2, expert, weight, row, dy, activation,
                                                   needs, gemm, max_rows_per_expert, elementwise, pre)
    need_dx, need_router, need_dw1, need_dw2 = needs
    dtype = x.dtype
    if tokens == 0:
        zeros = [x.new_zeros(0, hidden), torch.zeros_like(router_weight), torch.zeros_like(w1), torch.zeros_like(w2)]
        return tuple(z if need else None for z, need in zip(zeros, needs))
    if not any(needs):
        return (None, None, None, None)
    top_k = expert.shape[1]
    if gemm == "fused":
        if pre is None:
            why = "no saved pre-activations"
        elif elementwise == "torch":
            why = "elementwise='torch' asks for the element-wise step in torch ops"
        else:
            why = fused_backward.unsupported(dtype, x.device, tokens, hidden, intermediate, experts, top_k)
        if why:
            raise ValueError(f"gemm='fused' cannot run here: {why}")
        return _fused(x, router_weight, w1, w2, expert, weight, row, dy, pre, activation, normalize_topk, needs)
    if gemm == "auto":
        gemm = choose_gemm(dtype, x.device, tokens, hidden, intermediate, experts, top_k, pre is not None, elementwise)
    if gemm == "fused":
        return _fused(x, router_weight, w1, w2, expert, weight, row, dy, pre, activation, normalize_topk, needs)
    padded_rows = None
    if gemm == "padded_bmm":
        padded_rows = tokens if max_rows_per_expert is None else min(max_rows_per_expert, tokens)
    cdtype = compute_dtype(dtype)
    w1, w2 = w1.contiguous(), w2.contiguous()  # no-ops for parameters; _grouped_mm needs aligned strides
    need_weight_grad = need_dx or need_router  # the combine weights' gradient feeds the router
    need_g = need_weight_grad or need_dw1
    kernels = _elementwise_kernels(elementwise, dtype, x.device, hidden, intermediate) if need_g else None
    expert32 = stream = None
    if kernels is not None:  # once for all the launches below
        expert32 = expert.to(torch.int32).contiguous()
        stream = torch.cuda.current_stream(x.device).cuda_stream
    layout = _Rows(expert, row, weight, experts, padded_rows, kernels, cdtype, expert32, stream)
    token_of_row, w_row = layout.token_of_row, layout.w_row
    x_rows = x.index_select(0, token_of_row)

    if pre is None:
        pre = layout.rows_times(x_rows, w1)
    elif padded_rows is not None:  # the packed rows into the padded layout (padding rows: any row, weight 0)
        pre = pre.index_select(0, layout.packed_row_of_row)
    else:
        pre = pre[:layout.rows]
    dy_rows = dy.index_select(0, token_of_row)
    dweight_row, dx_rows, dw1, dw2 = _row_step(layout, x_rows, dy_rows, w_row, pre, w1, w2, activation, kernels, stream,
                                               need_weight_grad, need_dx, need_dw1, need_dw2)
    dx = d_router = None
    if need_weight_grad and kernels is not None:
        dx, d_router = _router_and_dx(kernels, x, router_weight, expert32, layout.rows_of_tokens, dweight_row, dx_rows,
                                      normalize_topk, need_router, need_dx, stream)
    elif need_weight_grad:
        kept = layout.kept.view(tokens, top_k)
        dweight = torch.where(kept, dweight_row.index_select(0, layout.row_of_choice).view(tokens, top_k), 0)
        x_compute = x.to(cdtype)
        logits = x_compute @ router_weight.to(cdtype).t()
        dlogits = _router_logit_grad(logits, expert.long(), dweight.to(cdtype), normalize_topk)
        if need_router:
            d_router = (dlogits.t() @ x_compute).to(router_weight.dtype)
        if need_dx:
            dx_router = dlogits @ router_weight.to(cdtype)
            # where, not a multiply: rows past the packed ones are uninitialised (0 * NaN is NaN)
            per_choice = dx_rows.index_select(0, layout.row_of_choice).view(tokens, top_k, hidden)
            dx = (torch.where(kept[:, :, None], per_choice, 0).to(cdtype).sum(dim=1) + dx_router).to(dtype)
    return dx, d_router, dw1, dw2


def _row_step(layout, x_rows, dy_rows, w_row, pre, w1, w2, activation, kernels, stream, need_weight_grad, need_dx,
              need_dw1, need_dw2):
    """Everything between the row gathers and the router: ``g``, the element-wise step and the three GEMMs
    after it, on rows packed by expert (``layout``: ``rows``, ``rows_times``, ``per_expert_outer``).
    ``w_row [rows]``: each row's combine weight (float32 with ``kernels``, else the compute dtype).
    Returns ``(dweight_row [rows] (float32 with kernels, else the compute dtype) or None, dx_rows [rows, H] or None, dw1, dw2)``."""
    dtype, device = x_rows.dtype, x_rows.device
    cdtype = compute_dtype(dtype)
    intermediate = w2.shape[1]
    need_g = need_weight_grad or need_dw1
    dw1 = dw2 = dweight_row = dx_rows = None
    if kernels is not None:
        g = layout.rows_times(dy_rows, w2.transpose(1, 2))
        hw, dpre = torch.empty(layout.rows, intermediate, dtype=dtype, device=device), torch.empty_like(pre)
        dweight_row = torch.empty(layout.rows, dtype=torch.float32, device=device)
        live = layout.live_rows  # rows sized for a bound: the device's end row
        kernels.activation_grad(DTYPE_CODES[dtype], ACTIVATION_CODES[activation], pre.data_ptr(), g.data_ptr(),
                                w_row.data_ptr(), hw.data_ptr(), dpre.data_ptr(), dweight_row.data_ptr(),
                                layout.rows, intermediate, stream, 0 if live is None else live.data_ptr())
        del g, pre
        if need_dw2:
            dw2 = layout.per_expert_outer(hw, dy_rows)
        if need_dw1:
            dw1 = layout.per_expert_outer(x_rows, dpre)
        if need_dx:
            dx_rows = layout.rows_times(dpre, w1.transpose(1, 2))
    else:
        pre = pre.to(cdtype)
        h, dpre_of = _activation_and_derivative(pre, activation, intermediate)
        if need_dw2:
            dw2 = layout.per_expert_outer((h * w_row[:, None]).to(dtype), dy_rows)
        if need_g:
            g = layout.rows_times(dy_rows, w2.transpose(1, 2)).to(cdtype)
            dpre = dpre_of(g * w_row[:, None]).to(dtype) if need_dx or need_dw1 else None
            if need_dw1:
                dw1 = layout.per_expert_outer(x_rows, dpre)
            if need_dx:
                dx_rows = layout.rows_times(dpre, w1.transpose(1, 2))
            if need_weight_grad:
                dweight_row = (g * h).sum(dim=1)
    return dweight_row, dx_rows, dw1, dw2


def _router_logit_grad(logits, expert, dweight, normalize_topk):
    """``dlogits [T, E]`` (logits' dtype) from ``dweight [T, k]``, the gradient of the combine weights.

    The probabilities are recomputed as the reference does (``softmax`` of ``logits = x @ router_weight^T``
    in the compute dtype). Renormalised weights ``w_j = p_j / S`` (``S`` = the sum of all ``k`` chosen ``p``, dropped ones
    included) give ``dp_j = (dweight_j - sum_i dweight_i w_i) / S``; softmax gives
    ``dlogits = p * (dP - sum_e p_e dP_e)`` with ``dP`` the ``dp`` scattered to the chosen experts.
    """
    probs = torch.softmax(logits, dim=-1)
    chosen = probs.gather(1, expert)
    if normalize_topk:
        total = chosen.sum(dim=1, keepdim=True)
        dchosen = (dweight - (dweight * (chosen / total)).sum(dim=1, keepdim=True)) / total
    else:
        dchosen = dweight
    dprobs = torch.zeros_like(probs).scatter_(1, expert, dchosen)  # a token's experts are distinct
    return probs * (dprobs - (chosen * dchosen).sum(dim=1, keepdim=True))


def _router_and_dx(kernels, x, router_weight, expert32, rows_of_tokens, dweight_row, dx_rows, normalize_topk,
                   need_router, need_dx, stream):
    """The router's gradient and dx from the combine weights' gradient by packed row (``dweight_row``) and
    each kept row's dx (``dx_rows``), with the extension's kernels: tensor-core GEMMs on the 16-bit ``x``
    and ``router_weight`` with float32 results (the logits' products exact as in float32), ``dlogits``
    (one kernel) rounded once to the storage format for the two gradient GEMMs, then one kernel summing
    each token's rows in choice order with the router's term. Returns ``(dx, d_router)``."""
    tokens, top_k = expert32.shape
    experts = router_weight.shape[0]
    dtype = x.dtype
    logits = torch.mm(x, router_weight.t(), out_dtype=torch.float32)
    dlogits = torch.empty(tokens, experts, dtype=dtype, device=x.device)
    kernels.router_grad(DTYPE_CODES[dtype], logits.data_ptr(), expert32.data_ptr(), rows_of_tokens.data_ptr(),
                        dweight_row.data_ptr(), dlogits.data_ptr(), tokens, top_k, experts, normalize_topk, stream)
    d_router = torch.mm(dlogits.t(), x, out_dtype=torch.float32).to(router_weight.dtype) if need_router else None
    dx = None
    if need_dx:
        dx_router = torch.mm(dlogits, router_weight, out_dtype=torch.float32)
        dx = torch.empty_like(x)
        kernels.combine_grad(DTYPE_CODES[dtype], dx_rows.data_ptr(), rows_of_tokens.data_ptr(), dx_router.data_ptr(),
                             dx.data_ptr(), tokens, top_k, x.shape[1], stream)
    return dx, d_router


def _fused(x, router_weight, w1, w2, expert, weight, row, dy, pre, activation, normalize_topk, needs):
    """``gemm="fused"``: the expert GEMMs in one launch (:mod:`flashdmoe.backward.fused_backward`), then the router's
    gradient and the sum of a token's rows (:func:`_router_and_dx`)."""
    from flashdmoe.kernel import extension

    need_dx, need_router, need_dw1, need_dw2 = needs
    kernels = extension.loaded()
    expert32 = expert.to(torch.int32).contiguous()
    grads = fused_backward.launch(
        x.contiguous(), dy.contiguous(), w1.contiguous(), w2.contiguous(), pre.contiguous(), expert32,
        row.to(torch.int32).contiguous(), weight.to(torch.float32).contiguous(), activation=activation,
        need_dx=need_dx or need_router, need_dw1=need_dw1, need_dw2=need_dw2)
    dx = d_router = None
    if need_dx or need_router:
        stream = torch.cuda.current_stream(x.device).cuda_stream
        dx, d_router = _router_and_dx(kernels, x, router_weight, expert32, grads.row_of_choice, grads.dweight_row,
                                      grads.dx_rows, normalize_topk, need_router, need_dx, stream)
    return dx, d_router, grads.dw1, grads.dw2
