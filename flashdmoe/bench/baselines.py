"""Unfused PyTorch MoE forward passes the fused kernel is measured against.

Every baseline computes the docs/design.md §2 contract, dropless:
``y[t] = sum_j w[t,j] * act(x[t] @ W1_e) @ W2_e`` with the router in fp32. Signature of each:
``f(x, router_weight, w1, w2, *, top_k, activation, normalize_topk) -> y``.

Shapes and dtypes (T tokens, H hidden, I ffn, E experts, k = top_k):
    x [T, H], router_weight [E, H], w1 [E, H, I] (``[E, H, 2I]`` for swiglu, gate half first),
    w2 [E, I, H], all in one dtype (float32, bfloat16 or float16); y [T, H] in x's dtype.

Ties in the top-k are not forced to the lower index here (torch.topk decides); the benchmark
excludes near-tie tokens from its correctness comparison.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "gelu", "silu", "swiglu")


class BaselineUnavailable(RuntimeError):
    """A baseline cannot run on this device/dtype/torch build; the message says why."""


class TopKRouting(NamedTuple):
    """experts [T, k] int64 chosen experts; weights [T, k] float32 combine weights."""

    experts: torch.Tensor
    weights: torch.Tensor


# Whether this torch has aten::mm.dtype (fp16/bf16 in, fp32 out) on CUDA; learnt on first use.
_mm_out_dtype_works: bool | None = None


def router_logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """``x @ router_weight.T`` with fp32 accumulation and fp32 output: [T, H] x [E, H] -> [T, E] float32."""
    global _mm_out_dtype_works
    # mm with out_dtype has no derivative: under autograd the baseline upcasts as a user would.
    differentiable = torch.is_grad_enabled() and (x.requires_grad or router_weight.requires_grad)
    if (x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and _mm_out_dtype_works is not False
            and not differentiable):
        try:
            # One tensor-core GEMM writing fp32 directly, no fp32 copy of x.
            logits = torch.mm(x, router_weight.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _mm_out_dtype_works = False
        else:
            _mm_out_dtype_works = True
            return logits
    return torch.mm(x.float(), router_weight.float().t())


def route_top_k(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize_topk: bool
) -> TopKRouting:
    """Softmax router in fp32 and top-k choice of experts for every token of x [T, H]."""
    probabilities = torch.softmax(router_logits(x, router_weight), dim=-1)
    weights, experts = torch.topk(probabilities, top_k, dim=-1)
    if normalize_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopKRouting(experts=experts, weights=weights)


def activate(hidden: torch.Tensor, activation: str) -> torch.Tensor:
    """Apply the expert activation to GEMM1's output [n, I] (or [n, 2I] for swiglu) -> [n, I]."""
    if activation == "relu":
        return F.relu(hidden)
    if activation == "gelu":
        return F.gelu(hidden, approximate="none")
    if activation == "silu":
        return F.silu(hidden)
    if activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)
        return F.silu(gate) * up
    raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")


def _check_arguments(
    x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
    top_k: int, activation: str,
) -> None:
    if x.dim() != 2:
        raise ValueError(f"x.shape={tuple(x.shape)}: expected [T, H]")
    tokens, hidden = x.shape
    experts = router_weight.shape[0]
    if router_weight.shape != (experts, hidden):
        raise ValueError(f"router_weight.shape={tuple(router_weight.shape)}: expected [E, {hidden}]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    if w2.dim() != 3 or w2.shape[0] != experts or w2.shape[2] != hidden:
        raise ValueError(f"w2.shape={tuple(w2.shape)}: expected [{experts}, I, {hidden}]")
    ffn = w2.shape[1]
    w1_cols = 2 * ffn if activation == "swiglu" else ffn
    if w1.shape != (experts, hidden, w1_cols):
        raise ValueError(
            f"w1.shape={tuple(w1.shape)}: expected [{experts}, {hidden}, {w1_cols}] "
            f"for activation={activation!r}"
        )
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k}: expected 1 <= top_k <= E ({experts})")


def scatter_combine(
    tokens: int, token_of_row: torch.Tensor, row_outputs: torch.Tensor, row_weights: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """y[t] = sum over rows r of token t of weight[r] * out[r], accumulated in fp32, cast to dtype."""
    combined = torch.zeros(
        tokens, row_outputs.shape[1], device=row_outputs.device, dtype=torch.float32
    )
    combined.index_add_(0, token_of_row, row_outputs.float() * row_weights.unsqueeze(1))
    return combined.to(dtype)


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_mm_pipeline(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    activation: str,
    normalize_topk: bool = True,
) -> torch.Tensor:
    """Router, sort choices by expert, two ``torch._grouped_mm`` calls, weighted scatter back.

    The docs/design.md §12 baseline. On CUDA ``torch._grouped_mm`` wants bf16 and 16-byte aligned strides;
    pass weights through ``prepare_grouped_mm_weights`` once (outside any timed region) to get a
    layout it accepts.
    """
    _check_arguments(x, router_weight, w1, w2, top_k, activation)
    if not grouped_mm_available():
        raise BaselineUnavailable(f"torch {torch.__version__} has no torch._grouped_mm")
    tokens = x.shape[0]
    routing = route_top_k(x, router_weight, top_k, normalize_topk)
    sorted_experts, order = torch.sort(routing.experts.reshape(-1))
    token_of_row = order // top_k
    rows = x.index_select(0, token_of_row)
    # offs[e] = end row of expert e's group = choices with expert <= e (int32, as torch._grouped_mm
    # requires). searchsorted instead of bincount + cumsum: CUDA bincount synchronises with the host.
    expert_ids = torch.arange(router_weight.shape[0], device=x.device, dtype=sorted_experts.dtype)
    offsets = torch.searchsorted(sorted_experts, expert_ids, right=True, out_int32=True)
    hidden = activate(torch._grouped_mm(rows, w1, offs=offsets), activation)
    row_outputs = torch._grouped_mm(hidden, w2, offs=offsets)
    row_weights = routing.weights.reshape(-1).index_select(0, order)
    return scatter_combine(tokens, token_of_row, row_outputs, row_weights, x.dtype)


def _column_major(weight: torch.Tensor) -> torch.Tensor:
    """Same values, each [K, N] matrix stored column-major (stride of the last dim != 1)."""
    return weight.transpose(-2, -1).contiguous().transpose(-2, -1)


GROUPED_MM_LAYOUTS = {"row-major": lambda weight: weight.contiguous(), "column-major": _column_major}
LAYOUT_TRIAL_RUNS = 3


def prepare_grouped_mm_weights(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    activation: str,
    normalize_topk: bool = True,
    layouts: tuple[str, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, str, dict[str, str]]:
    """Pick the weight layout ``torch._grouped_mm`` runs fastest here, by running the pipeline on x.

    Every layout in ``layouts`` (default: all of GROUPED_MM_LAYOUTS) is tried; when several are tried
    on CUDA the fastest over ``LAYOUT_TRIAL_RUNS`` runs wins, so the baseline is torch at its best
    (on CPU the first that works).
    Returns (w1 [E, H, I or 2I], w2 [E, I, H] with the inputs' values, layout name,
    {layout: "ms" or "error: ..."} for every layout tried).
    Raises BaselineUnavailable with every layout's error when none works.
    """
    if not grouped_mm_available():
        raise BaselineUnavailable(f"torch {torch.__version__} has no torch._grouped_mm")
    arguments = {"top_k": top_k, "activation": activation, "normalize_topk": normalize_topk}
    candidates = layouts or tuple(GROUPED_MM_LAYOUTS)
    time_trials = x.is_cuda and len(candidates) > 1
    outcomes: dict[str, str] = {}
    best: tuple[float, str, torch.Tensor, torch.Tensor] | None = None
    for layout_name in candidates:
        convert = GROUPED_MM_LAYOUTS[layout_name]
        w1_laid_out, w2_laid_out = convert(w1), convert(w2)
        try:
            milliseconds = _trial_milliseconds(
                x, router_weight, w1_laid_out, w2_laid_out, arguments, timed=time_trials
            )
        except (RuntimeError, TypeError, NotImplementedError) as error:
            outcomes[layout_name] = f"error: {type(error).__name__}: {_first_line(error)}"
            continue
        outcomes[layout_name] = f"{milliseconds:.3f} ms" if time_trials else "works (not timed)"
        if best is None or milliseconds < best[0]:
            best = (milliseconds, layout_name, w1_laid_out, w2_laid_out)
        if not time_trials:
            break  # nothing to compare: the first layout that works is the one
    if best is None:
        raise BaselineUnavailable(
            "torch._grouped_mm failed; " + "; ".join(f"{k} weights: {v}" for k, v in outcomes.items())
        )
    _, layout_name, w1_laid_out, w2_laid_out = best
    return w1_laid_out, w2_laid_out, layout_name, outcomes


def _trial_milliseconds(x, router_weight, w1, w2, arguments, *, timed: bool) -> float:
    """Run the pipeline once (a failure raises here); if ``timed`` (CUDA only) time a few more runs."""
    grouped_mm_pipeline(x, router_weight, w1, w2, **arguments)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)  # surface asynchronous launch errors inside the caller's try
    if not timed:
        return 0.0
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(LAYOUT_TRIAL_RUNS):
        grouped_mm_pipeline(x, router_weight, w1, w2, **arguments)
    end.record()
    torch.cuda.synchronize(x.device)
    return start.elapsed_time(end) / LAYOUT_TRIAL_RUNS


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)


def per_expert_loop(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    activation: str,
    normalize_topk: bool = True,
) -> torch.Tensor:
    """The same routing, then a Python loop over experts with two matmuls each (docs/design.md §12)."""
    _check_arguments(x, router_weight, w1, w2, top_k, activation)
    tokens = x.shape[0]
    routing = route_top_k(x, router_weight, top_k, normalize_topk)
    combined = torch.zeros(tokens, x.shape[1], device=x.device, dtype=torch.float32)
    for expert in range(router_weight.shape[0]):
        token_index, choice_index = torch.nonzero(routing.experts == expert, as_tuple=True)
        if token_index.numel() == 0:
            continue
        hidden = activate(x.index_select(0, token_index) @ w1[expert], activation)
        expert_output = hidden @ w2[expert]
        weights = routing.weights[token_index, choice_index]
        combined.index_add_(0, token_index, expert_output.float() * weights.unsqueeze(1))
    return combined.to(x.dtype)
