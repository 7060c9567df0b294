"""The fused CUDA backend: one persistent kernel launch per forward (plus a memset of its sync words).

Forward runs ``csrc/`` through the ``flashdmoe_cuda`` extension, for one rank, for the ``P`` virtual
ranks of an emulated team (one launch), or for this process's rank of an NVSHMEM team. Backward is
unfused for now: it recomputes the layer with torch ops on the routing the forward saved
(:func:`flashdmoe.reference.moe_fixed_routing`; across processes
:func:`flashdmoe.ep_peer.expert_parallel_backward`), so gradients match the reference semantics.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

from typing import Any

import torch

from flashdmoe import reference
from flashdmoe.errors import KernelTimeout
# Expert GEMM variants (name -> id), the default, and the one fp32 inputs run on whatever
# debug.expert_variant says: the table in flashdmoe/expert_variants.py.
from flashdmoe.expert_variants import DEFAULT_EXPERT_VARIANT, EXPERT_VARIANTS, FP32_EXPERT_VARIANT, variant_id
from flashdmoe.team import mps_thread_percentage

ACTIVATION_CODES = {"relu": 0, "gelu": 1, "silu": 2, "swiglu": 3}
# float32 runs the tensor cores in TF32 (one rank; teams carry bf16 / fp16), on FP32_EXPERT_VARIANT.
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# Phase ids written by the kernel's watchdog (csrc/moe/params.cuh, enum Phase).
PHASE_NAMES = {
    1: "grid barrier after the gate",
    2: "grid barrier after the per-expert offsets",
    3: "grid barrier after dispatch",
    4: "expert GEMM2 tile waiting for its GEMM1 row tile",
    5: "grid barrier before the combine",
    6: "wait for a peer's per-expert row counts",
    7: "expert GEMM1 tile waiting for a peer's dispatched rows",
    8: "combine waiting for a peer's expert results",
    9: "expert tile pipeline (a TMA stage that never filled or was never released)",
}

DEFAULT_TIMEOUT_MS = 10_000


@dataclass
class DebugKnobs:
    """Test-only switches. ``withhold_phase`` makes block 0 skip that grid barrier (forces the watchdog);
    ``poison_outputs`` fills outputs with NaN before the launch so unwritten elements show."""

    withhold_phase: int = 0
    poison_outputs: bool = False
    # This rank publishes none of its signals (counts, rows ready, results done): its peers must time out.
    silent_rank: int = -1
    # 0: the whole resident grid; else at most this many blocks (tests of small grids).
    max_blocks: int = 0
    timeout_ms: int | None = None
    # Small batches split each gate tile's K slabs over several blocks (E <= 256 only). Off by default
    # (FLASHDMOE_GATE_SPLIT=1 turns it on): with the TMA-fed gate it saved only ~3 us on the 128-token
    # shape, and it misrouted with E >= 512 (now refused there); the records in docs/benchmarks.md ran
    # without it.
    gate_split: bool = os.environ.get("FLASHDMOE_GATE_SPLIT", "0") == "1"
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
def _check_shapes(ext, T, H, I, E, k, world_size=1):
    """The kernel's shape rules: '' or the violated constraint; asked once per shape, not every forward."""
    return ext.check_shapes(T, H, I, E, k, world_size)


@functools.lru_cache(maxsize=256)
def _workspace_layout(ext, T, H, I, E, k, dtype_code, world_size=1, stream_rows=0):
    """One rank's workspace layout (byte offsets) for a shape the rules accept; once per shape."""
    return ext.workspace_layout(T, H, I, E, k, dtype_code, world_size, stream_rows or T * k)


def timeout_ns() -> int:
    ms = debug.timeout_ms if debug.timeout_ms is not None else int(os.environ.get("FLASHDMOE_TIMEOUT_MS", DEFAULT_TIMEOUT_MS))
    return int(ms) * 1_000_000


PHASE_CLOCK_NAMES = ("gate", "offsets", "dispatch", "experts", "combine")
last_phase_ms: dict[str, float] = {}  # per-phase breakdown of the most recently checked launch (first rank)


@dataclass
class _RankStatus:
    """One rank's status bytes (error word .. traffic counters), copied to the host after a launch."""

    rank: int
    status: torch.Tensor
    offsets: tuple[int, int, int, int]  # status flags, phase clock, clock slots, traffic (from the error word)
    routing: "FusedRouting"
    local_experts: int
    row_bytes: int


@dataclass
class _Launch:
    ranks: list[_RankStatus]
    team: Any = None


_last_traffic_source: list[_RankStatus] = []


def traffic_report() -> list[dict]:
    """Bytes each rank of the last checked launch wrote into its peers, against what was routed remote.

    One dict per rank this process drove: ``rank``, ``dispatch_bytes`` (token rows written into peers'
    receive buffers), ``combine_bytes`` (result rows written into peers' combine buffers),
    ``rows_routed_remote`` (kept choices whose expert lives on another rank) and ``payload_efficiency``
    (``dispatch_bytes / (rows_routed_remote * H * element size)``; 1.0 means no byte beyond the routed
    rows; ``None`` when nothing was routed remote). Computed on request (it reduces the routing on the GPU).
    """
    report = []
    for entry in _last_traffic_source:
        raw = entry.status.numpy().tobytes()
        traffic_at = entry.offsets[3]
        dispatch = int.from_bytes(raw[traffic_at:traffic_at + 8], "little")
        combine = int.from_bytes(raw[traffic_at + 8:traffic_at + 16], "little")
        routing = entry.routing
        owner = routing.expert.long() // entry.local_experts
        remote = int(((routing.row >= 0) & (owner != entry.rank)).sum().item())
        payload = remote * entry.row_bytes
        report.append({
            "rank": entry.rank, "dispatch_bytes": dispatch, "combine_bytes": combine,
            "rows_routed_remote": remote,
            "payload_efficiency": (dispatch / payload) if payload else None,
        })
    return report


def __getattr__(name: str):
    if name == "last_traffic":
        return traffic_report()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_launch(launch: _Launch) -> None:
    """Decode every rank's status bytes (already on the host). Raises KernelTimeout / ValueError."""
    global _last_traffic_source
    failures, nonfinite = [], []
    for index, entry in enumerate(launch.ranks):
        flags_at, clock_at, slots, _ = entry.offsets
        raw = entry.status.numpy().tobytes()
        error = int.from_bytes(raw[0:8], "little")
        flags = int.from_bytes(raw[flags_at:flags_at + 4], "little")
        clock = [int.from_bytes(raw[clock_at + 8 * i:clock_at + 8 * i + 8], "little") for i in range(slots)]
        if index == 0 and not error and all(clock):
            last_phase_ms.clear()
            last_phase_ms.update({n: (clock[i + 1] - clock[i]) / 1e6 for i, n in enumerate(PHASE_CLOCK_NAMES)})
        if error:
            kind, phase, peer, block = error & 0xFF, (error >> 8) & 0xFF, (error >> 16) & 0xFFFF, error >> 32
            what = PHASE_NAMES.get(phase, f"phase {phase}")
            if kind == 1:
                failures.append(f"rank {entry.rank} timed out in the {what} (waiting on rank {peer}; first seen by "
                                f"block {block})")
            else:
                failures.append(f"rank {entry.rank} reported error word {error:#x}")
        if flags & 1:
            nonfinite.append(entry.rank)
    _last_traffic_source = list(launch.ranks)
    if failures:
        message = "flashdmoe kernel: " + "; ".join(failures) + (
            f"; timeout {timeout_ns() // 1_000_000} ms (FLASHDMOE_TIMEOUT_MS)")
        if launch.team is not None and getattr(launch.team, "transport", "single") != "single":
            launch.team.mark_failed(message)
        raise KernelTimeout(message) if any("timed out" in f for f in failures) else RuntimeError(message)
    if nonfinite:
        where = "" if len(launch.ranks) == 1 else f" (rank {', '.join(map(str, nonfinite))})"
        raise ValueError(f"x or router_weight{where}: expected finite values, the router logits contain NaN or Inf")


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
            for launch in pending:
                _check_launch(launch)


def _empty_outputs(x: torch.Tensor, top_k: int, experts: int):
    T = x.shape[0]
    device = x.device
    y = torch.empty_like(x)
    expert = torch.empty((T, top_k), dtype=torch.int32, device=device)
    weight = torch.empty((T, top_k), dtype=torch.float32, device=device)
    row = torch.empty((T, top_k), dtype=torch.int32, device=device)
    counts = torch.empty((experts,), dtype=torch.int32, device=device)
    if debug.poison_outputs:
        y.fill_(float("nan"))
        weight.fill_(float("nan"))
        for t in (expert, row, counts):
            t.fill_(-7)
    return y, FusedRouting(expert, weight, row, counts)


def _team_kind(team) -> str:
    return "single" if team is None else getattr(team, "transport", "single")


def _check_dtype(x: torch.Tensor, name: str = "x") -> None:
    if x.dtype not in DTYPE_CODES:
        raise ValueError(
            f"{name}: the cuda backend takes bfloat16, float16 or float32 (as TF32), got {x.dtype}; use "
            "backend='reference' for float64"
        )


def run_forward(xs, router_weight, w1s, w2s, *, top_k, activation, normalize_topk, capacity_factor, team=None):
    """Launch the fused kernel for the ranks this process drives.

    xs: list of ``[T_r, H]`` (one per rank driven here: ``P`` for an emulated team, else one); w1s / w2s:
    each rank's experts ``[L, H, I or 2I]`` / ``[L, I, H]``; router_weight ``[E, H]``. All bf16 or fp16 (fp32 for one rank),
    contiguous, on one CUDA device. Returns a list of ``(y [T_r, H], FusedRouting)``.
    """
    kind = _team_kind(team)
    if kind != "single":
        team.require_usable()
    for i, x in enumerate(xs):
        _check_dtype(x, "x" if len(xs) == 1 else f"xs[{i}]")
    ext = _extension()
    H = router_weight.shape[1]
    E = router_weight.shape[0]
    I = w2s[0].shape[1]
    P = 1 if kind == "single" else team.world_size
    L = E // P
    dtype_code = DTYPE_CODES[xs[0].dtype]
    for i, x in enumerate(xs):
        shape_error = _check_shapes(ext, x.shape[0], H, I, E, top_k, P)
        if shape_error:
            raise ValueError(f"shapes unsupported by the fused kernel: {shape_error} (backend='reference' covers them)")
    if kind == "single":
        ranks = [0]
        stream_rows = xs[0].shape[0] * top_k
        buffers = [None]
    elif kind == "emulated":
        ranks = list(range(P))
        stream_rows = team.plan.stream_rows
        buffers = team.buffers
    else:
        ranks = [team.rank]
        stream_rows = team.plan.stream_rows
        buffers = team.buffers
    if kind != "single":
        for rank, x in zip(ranks, xs):
            team.plan.check_batch(x.shape[0], H, top_k, L, x.dtype, rank=rank)

    outputs = [_empty_outputs(x, top_k, E) for x in xs]
    if kind == "single" and xs[0].shape[0] == 0:
        outputs[0][1].counts.zero_()
        return outputs

    rank_args, workspaces = [], []
    for rank, x, w1, w2, buf, (y, routing) in zip(ranks, xs, w1s, w2s, buffers, outputs):
        T = x.shape[0]
        layout = _workspace_layout(ext, T, H, I, E, top_k, dtype_code, P, stream_rows)
        workspace = torch.empty((layout["total_bytes"],), dtype=torch.uint8, device=x.device)
        workspaces.append((workspace, layout))
        cap = reference.expert_capacity(T, top_k, E, capacity_factor)
        rank_args.append({
            "x": x.data_ptr(), "w1": w1.data_ptr(), "w2": w2.data_ptr(), "y": y.data_ptr(),
            "topk_expert": routing.expert.data_ptr(), "topk_weight": routing.weight.data_ptr(),
            "topk_row": routing.row.data_ptr(), "expert_counts": routing.counts.data_ptr(),
            "workspace": workspace.data_ptr(), "workspace_bytes": layout["total_bytes"],
            "tokens": T, "capacity": T if cap is None else cap, "rank": rank,
            "silent": rank == debug.silent_rank,
            "peer_recv": [] if buf is None else buf.peer_recv,
            "peer_comb": [] if buf is None else buf.peer_comb,
            "peer_signals": [] if buf is None else buf.peer_signals,
        })
    percent = mps_thread_percentage() if kind == "nvshmem" else None
    shared = {
        "router": router_weight.data_ptr(), "hidden": H, "ffn": I, "experts": E, "top_k": top_k,
        "world_size": P, "stream_rows": stream_rows, "dtype": dtype_code,
        "activation": ACTIVATION_CODES[activation], "normalize_topk": bool(normalize_topk),
        "sequence": 1 if kind == "single" else team.next_sequence(),
        "timeout_ns": timeout_ns(), "debug_withhold_phase": int(debug.withhold_phase),
        "expert_variant": variant_id(FP32_EXPERT_VARIANT if xs[0].dtype == torch.float32 else debug.expert_variant),
        "max_blocks": int(debug.max_blocks), "gate_split": bool(debug.gate_split),
        "grid_percent": 100 if percent is None else percent,
    }
    try:
        info = ext.forward(shared=shared, ranks=rank_args,
                           stream=torch.cuda.current_stream(xs[0].device).cuda_stream)
    except Exception as error:
        if kind != "single":
            team.mark_failed(f"launch failed: {error}")
        raise
    global last_launch
    last_launch = dict(info)

    # One device-to-host copy of each rank's status bytes (no extra kernels: a forward is one launch).
    statuses = []
    for rank, x, (workspace, layout), (y, routing) in zip(ranks, xs, workspaces, outputs):
        err_at = layout["error_word"]
        end = layout["traffic"] + 16
        status = workspace[err_at:end]
        offsets = (layout["status_flags"] - err_at, layout["phase_clock"] - err_at, layout["phase_clock_slots"],
                   layout["traffic"] - err_at)
        statuses.append((rank, status, offsets, routing, x.element_size() * H))
    if _deferred is not None:
        _deferred.append(_Launch([_RankStatus(r, st.to("cpu", non_blocking=True), off, rt, L, rb)
                                  for r, st, off, rt, rb in statuses], team))
    else:
        _check_launch(_Launch([_RankStatus(r, st.cpu(), off, rt, L, rb) for r, st, off, rt, rb in statuses], team))
    return outputs


last_launch: dict = {}  # grid / blocks_per_sm / smem_bytes of the most recent launch


def fused_forward(x, router_weight, w1, w2, *, top_k, activation, normalize_topk, capacity_factor):
    """Run the fused kernel on one rank. x: [T, H]; router_weight: [E, H]; w1: [E, H, I or 2I]; w2: [E, I, H];
    all bf16, fp16 or fp32 (TF32 tensor cores), contiguous, on one CUDA device. Returns (y [T, H] dtype of x, FusedRouting)."""
    _check_dtype(x)
    return run_forward([x], router_weight, [w1], [w2], top_k=top_k, activation=activation,
                       normalize_topk=normalize_topk, capacity_factor=capacity_factor)[0]


def _fixed_routing_grads(inputs, expert, keep, dy, activation, normalize_topk):
    """Gradients of <dy, moe_fixed_routing(*inputs, expert, keep)> for the inputs that require grad."""
    with torch.enable_grad():
        y = reference.moe_fixed_routing(*inputs, expert.long(), keep, activation=activation,
                                        normalize_topk=normalize_topk)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(y, wanted, dy)) if wanted else iter(())
    return [next(grads) if t.requires_grad else None for t in inputs]


class _FusedMoE(torch.autograd.Function):
    """One rank (no team): forward on the kernel, backward unfused on the saved routing."""

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
        grads = _fixed_routing_grads(inputs, expert, row >= 0, dy, activation, normalize_topk)
        return tuple(grads) + (None,) * 5


class _FusedMoEEmulated(torch.autograd.Function):
    """P virtual ranks in one launch. Inputs after the options: router_weight, xs (P), w1s (P), w2s (P);
    outputs: ys (P). Backward recomputes each rank on its saved routing against the concatenated experts
    (the emulated team holds every shard in this process)."""

    @staticmethod
    def forward(ctx, team, options, routing_out, router_weight, *tensors):
        P = team.world_size
        xs, w1s, w2s = tensors[:P], tensors[P:2 * P], tensors[2 * P:]
        results = run_forward(list(xs), router_weight, list(w1s), list(w2s), team=team, **options)
        routing_out.extend(routing for _, routing in results)
        ctx.world_size = P
        ctx.options = (options["activation"], options["normalize_topk"])
        ctx.save_for_backward(router_weight, *tensors, *[r.expert for _, r in results], *[r.row for _, r in results])
        return tuple(y for y, _ in results)

    @staticmethod
    def backward(ctx, *dys):
        P = ctx.world_size
        saved = ctx.saved_tensors
        router_weight, tensors = saved[0], saved[1:1 + 3 * P]
        experts, rows = saved[1 + 3 * P:1 + 4 * P], saved[1 + 4 * P:]
        activation, normalize_topk = ctx.options
        needs = ctx.needs_input_grad[3:]
        router = router_weight.detach().requires_grad_(needs[0])
        leaves = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs[1:])]
        xs, w1s, w2s = leaves[:P], leaves[P:2 * P], leaves[2 * P:]
        with torch.enable_grad():
            w1_all, w2_all = torch.cat(w1s), torch.cat(w2s)
            total = None
            for r in range(P):
                if dys[r] is None:
                    continue
                y = reference.moe_fixed_routing(xs[r], router, w1_all, w2_all, experts[r].long(), rows[r] >= 0,
                                                activation=activation, normalize_topk=normalize_topk)
                term = (y.float() * dys[r].float()).sum()
                total = term if total is None else total + term
            wanted = [t for t in [router, *leaves] if t.requires_grad]
            if total is None or not wanted:
                grads = [None] * len(wanted)
            else:
                grads = list(torch.autograd.grad(total, wanted, allow_unused=True))
        it = iter(grads)
        out = [next(it) if t.requires_grad else None for t in [router, *leaves]]
        out = [g if g is None else g.to(t.dtype) for g, t in zip(out, [router, *leaves])]
        return (None, None, None, *out)


class _FusedMoETeam(torch.autograd.Function):
    """This process's rank of a multi-process team: forward on the kernel; backward unfused across ranks
    (:func:`flashdmoe.ep_peer.expert_parallel_backward`, collective)."""

    @staticmethod
    def forward(ctx, team, options, routing_out, x, router_weight, w1, w2):
        (y, routing), = run_forward([x], router_weight, [w1], [w2], team=team, **options)
        routing_out.append(routing)
        ctx.team = team
        ctx.options = (options["activation"], options["normalize_topk"])
        ctx.save_for_backward(x, router_weight, w1, w2, routing.expert, routing.row)
        return y

    @staticmethod
    def backward(ctx, dy):
        from flashdmoe import ep_peer

        x, router_weight, w1, w2, expert, row = ctx.saved_tensors
        activation, normalize_topk = ctx.options
        grads = ep_peer.expert_parallel_backward(
            ctx.team, x, router_weight, w1, w2, expert.long(), row >= 0, dy.contiguous(), activation=activation,
            normalize_topk=normalize_topk, needs_input_grad=tuple(ctx.needs_input_grad[3:7]),
        )
        return (None, None, None, *grads)


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
    """flashdmoe.moe on the fused kernel: one rank, or this process's rank of an NVSHMEM team.
    Shapes and semantics as flashdmoe.moe."""
    kind = _team_kind(team)
    routing_out: list[FusedRouting] = []
    if kind == "single":
        y = _FusedMoE.apply(x, router_weight, w1, w2, top_k, activation, normalize_topk, capacity_factor,
                            routing_out)
    elif kind == "nvshmem":
        options = dict(top_k=top_k, activation=activation, normalize_topk=normalize_topk,
                       capacity_factor=capacity_factor)
        y = _FusedMoETeam.apply(team, options, routing_out, x, router_weight, w1, w2)
    else:
        raise ValueError(
            f"team: a {kind!r} team holds every rank in this process; call "
            "flashdmoe.moe_expert_parallel(xs, router_weight, w1s, w2s, ..., team=team) instead"
        )
    if not return_aux:
        return y
    routing = routing_out[0]
    return y, _aux(x, router_weight, top_k, routing.counts, routing.row)


def moe_emulated(xs, router_weight, w1s, w2s, *, top_k, activation="gelu", normalize_topk=True,
                 capacity_factor=None, return_aux=False, team):
    """flashdmoe.moe_expert_parallel on an emulated team: every rank in one launch. Returns the list of
    ``y_r`` (plus the list of per-rank MoEAux when ``return_aux``)."""
    options = dict(top_k=top_k, activation=activation, normalize_topk=normalize_topk,
                   capacity_factor=capacity_factor)
    routing_out: list[FusedRouting] = []
    ys = list(_FusedMoEEmulated.apply(team, options, routing_out, router_weight, *xs, *w1s, *w2s))
    if not return_aux:
        return ys
    return ys, [_aux(x, router_weight, top_k, r.counts, r.row) for x, r in zip(xs, routing_out)]
