"""The fused CUDA backend: one persistent kernel launch per forward, whose last block writes the status
words into pinned host memory and resets the workspace's sync words for the next launch.

Forward runs ``csrc/`` through the ``flashdmoe_cuda`` extension, for one rank, for the ``P`` virtual
ranks of an emulated team (one launch), or for this process's rank of an NVSHMEM team. A forward never
waits for the GPU: each launch returns a :class:`flashdmoe.kernel.launch_report.LaunchReport`
(:func:`flashdmoe.last_report`) whose status is checked later, at the points
:mod:`flashdmoe.kernel.status_checks` lists. Nothing in a forward reads device memory from the host, so a
single-rank forward and an emulated team's forward can be captured in a CUDA graph.

Per call the host does: the cached plan of the launch (shape rules, workspace layout and the parsed
launch options, once per shape and options), output allocation (``y`` and one routing block), the pooled
workspace (:mod:`flashdmoe.kernel.workspace_pool`), one extension call with the addresses (one CUDA call: the
kernel itself marks its status slot complete, no event is recorded), and the report's bookkeeping.
:func:`flashdmoe.moe` remembers whole call signatures and goes straight to :func:`launch_one` for one
rank (:mod:`flashdmoe.api`).

Backward: grouped GEMMs and element-wise kernels on the GPU from the routing the forward saved (and, one
rank, its pre-activations) (:func:`flashdmoe.backward.expert_backward.expert_backward`, one rank and emulated
teams); across processes the same GPU steps with the rows moved by the device
(:func:`flashdmoe.backward.ep_backward.team_backward`) where every peer has a load/store pointer, else
:func:`flashdmoe.parallel.ep_peer.expert_parallel_backward` (torch ops over peer-memory exchanges).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flashdmoe import reference
from flashdmoe.kernel import extension, status_checks
from flashdmoe.backward.expert_backward import expert_backward, packed_rows
# Expert GEMM variants (name -> id), the default, the choice per shape, and the one fp32 inputs run on
# whatever debug.expert_variant says: the table in flashdmoe/kernel/expert_variants.py.
from flashdmoe.kernel.expert_variants import (DEFAULT_EXPERT_VARIANT, EXPERT_VARIANTS, FP32_EXPERT_VARIANT,
                                              choose_variant, variant_id)
from flashdmoe.kernel.kernel_codes import ACTIVATION_CODES, DTYPE_CODES
from flashdmoe.kernel.launch_knobs import DEFAULT_TIMEOUT_MS, DebugKnobs, debug, timeout_ms  # noqa: F401 (re-exported)
from flashdmoe.kernel.launch_report import LaunchShape
from flashdmoe.parallel.team import mps_thread_percentage
from flashdmoe.kernel.workspace_pool import GraphSyncBlocks, WorkspacePool, captured_sync_words, graph_sync



class FusedRouting:
    """Routing the forward kernel produced, in one allocation; the typed views are made when first read
    (a forward needs only their addresses).

    expert: [T, k] int32 chosen experts; weight: [T, k] float32 combine weights;
    row: [T, k] int32 row in the packed expert buffers (-1 = dropped by capacity);
    counts: [E] int32 choices routed to each expert before capacity.
    """

    __slots__ = ("block", "tokens", "top_k", "experts", "_views")

    def __init__(self, block: torch.Tensor, tokens: int, top_k: int, experts: int) -> None:
        self.block = block  # int32 [3 * T * k + E]: expert, weight (float32 bits), row, counts
        self.tokens = tokens
        self.top_k = top_k
        self.experts = experts
        self._views: dict[str, torch.Tensor] = {}

    @classmethod
    def empty(cls, tokens: int, top_k: int, experts: int, device) -> "FusedRouting":
        block = torch.empty((3 * tokens * top_k + experts,), dtype=torch.int32, device=device)
        return cls(block, tokens, top_k, experts)

    def addresses(self) -> tuple[int, int, int, int]:
        """Device addresses of expert, weight, row and counts."""
        base, size = self.block.data_ptr(), 4 * self.tokens * self.top_k
        return base, base + size, base + 2 * size, base + 3 * size

    def _view(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            n = self.tokens * self.top_k
            if name == "counts":
                view = self.block[3 * n:]
            else:
                index = ("expert", "weight", "row").index(name)
                view = self.block[index * n:(index + 1) * n].view(self.tokens, self.top_k)
                if name == "weight":
                    view = view.view(torch.float32)
            self._views[name] = view
        return view

    @property
    def expert(self) -> torch.Tensor:
        return self._view("expert")

    @property
    def weight(self) -> torch.Tensor:
        return self._view("weight")

    @property
    def row(self) -> torch.Tensor:
        return self._view("row")

    @property
    def counts(self) -> torch.Tensor:
        return self._view("counts")

    @property
    def keep(self) -> torch.Tensor:
        return self.row >= 0


def _extension():
    """The built flashdmoe_cuda module (:func:`flashdmoe.kernel.extension.loaded`)."""
    return extension.loaded()


@functools.lru_cache(maxsize=256)
def _check_shapes(ext, T, H, I, E, k, world_size=1):
    """The kernel's shape rules: '' or the violated constraint; asked once per shape, not every forward."""
    return ext.check_shapes(T, H, I, E, k, world_size)


@functools.lru_cache(maxsize=256)
def _workspace_layout(ext, T, H, I, E, k, dtype_code, world_size=1, stream_rows=0):
    """One rank's workspace layout (byte offsets) for a shape the rules accept; once per shape."""
    return ext.workspace_layout(T, H, I, E, k, dtype_code, world_size, stream_rows or T * k)


_pool = WorkspacePool()


def release_workspaces() -> None:
    """Drop the pooled workspaces (one per device and stream, each as large as its largest launch)."""
    _pool.release()


def workspace_bytes_held() -> int:
    return _pool.held_bytes()


def _current_stream_handle(device_index: int) -> int:
    """The raw ``cudaStream_t`` of the device's current stream (without a torch.cuda.Stream per call).
    Asked at every launch: the user may switch streams (``torch.cuda.stream``) between calls."""
    return torch._C._cuda_getCurrentRawStream(device_index)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _stand_in_stream() -> int | None:
    """The current stream as launch_one asks for it, or ``None`` inside a capture: what the host module asks
    a launcher without the kernel module's C entry (the CPU stand-in of the tests) before a launch."""
    return None if torch.cuda.is_current_stream_capturing() else _current_stream_handle(None)


def _current_device() -> int:
    """The current CUDA device (CUDA is initialised once a CUDA tensor exists)."""
    return torch._C._cuda_getDevice()


def _team_kind(team) -> str:
    return "single" if team is None else getattr(team, "transport", "single")


def _check_dtype(x: torch.Tensor, name: str = "x") -> None:
    if x.dtype not in DTYPE_CODES:
        raise ValueError(
            f"{name}: the cuda backend takes bfloat16, float16 or float32 (as TF32), got {x.dtype}; use "
            "backend='reference' for float64"
        )


class _Plan:
    """A launch prepared once per (ranks' token counts, shapes, options, debug knobs) and team."""

    __slots__ = ("launch", "prepared", "stride", "sync_bytes", "workspace_bytes", "shape", "skip", "top_k", "experts",
                 "routing_words", "routing_stride", "generation", "native")

    def __init__(self, launch, prepared, stride: int, sync_bytes: int, shape: LaunchShape, skip: bool, top_k: int,
                 experts: int) -> None:
        self.launch = launch  # the extension's launch function (the one that prepared it)
        self.prepared = prepared
        self.stride = stride  # bytes between consecutive ranks' workspaces
        self.sync_bytes = sync_bytes  # leading bytes of each rank's workspace that must be zero at a launch
        self.workspace_bytes = stride * len(shape.ranks)
        self.shape = shape
        self.skip = skip  # one rank with no tokens: nothing to launch
        self.top_k = top_k
        self.experts = experts
        self.routing_words = 3 * shape.tokens[0] * top_k + experts  # one rank's FusedRouting block
        self.routing_stride = 4 * shape.tokens[0] * top_k  # bytes between its expert, weight, row, counts
        self.generation = debug.generation  # the debug knobs it was made under
        self.native = None  # one rank: the host module's plan (status_checks.launch_native), where it applies

    def routing(self, block: torch.Tensor) -> "FusedRouting":
        """One rank's routing outputs in ``block`` (a launch's, as the host module returns it)."""
        return FusedRouting(block, self.shape.tokens[0], self.top_k, self.experts)


_single_plans: dict = {}
_PLAN_CACHE_LIMIT = 512


def _make_plan(ext, kind, team, tokens, H, I, E, top_k, dtype, activation, normalize_topk, capacity_factor) -> _Plan:
    """Check the launch against the kernel's rules and the team's buffers, and parse its options."""
    P = 1 if kind == "single" else team.world_size
    L = E // P
    dtype_code = DTYPE_CODES[dtype]
    for T in tokens:
        shape_error = _check_shapes(ext, T, H, I, E, top_k, P)
        if shape_error:
            raise ValueError(f"shapes unsupported by the fused kernel: {shape_error} (backend='reference' covers them)")
    if kind == "single":
        ranks, stream_rows, buffers = (0,), tokens[0] * top_k, [None]
    else:
        ranks = tuple(range(P)) if kind == "emulated" else (team.rank,)
        stream_rows, buffers = team.plan.stream_rows, team.buffers
        for rank, T in zip(ranks, tokens):
            team.plan.check_batch(T, H, top_k, L, dtype, rank=rank)
    layouts = [_workspace_layout(ext, T, H, I, E, top_k, dtype_code, P, stream_rows) for T in tokens]
    stride = -(-max(layout["total_bytes"] for layout in layouts) // 256) * 256
    sync_bytes = max(layout["sync_bytes"] for layout in layouts)
    percent = mps_thread_percentage() if kind == "nvshmem" else None
    if dtype == torch.float32:
        variant = variant_id(FP32_EXPERT_VARIANT)
    elif debug.expert_variant is not None:
        variant = variant_id(debug.expert_variant)
    else:  # each launch's rank gets an equal share of the grid (and of the MPS share of the SMs)
        blocks = max(1, _multiprocessors(_current_device()) * (100 if percent is None else percent) // 100 // len(ranks))
        variant = variant_id(choose_variant(max(tokens), H, I, E, top_k, activation, blocks, P))
    timeout = timeout_ms()
    shared = {
        "hidden": H, "ffn": I, "experts": E, "top_k": top_k, "world_size": P, "stream_rows": stream_rows,
        "dtype": dtype_code, "activation": ACTIVATION_CODES[activation], "normalize_topk": bool(normalize_topk),
        "timeout_ns": timeout * 1_000_000, "debug_withhold_phase": int(debug.withhold_phase),
        "expert_variant": variant, "max_blocks": int(debug.max_blocks),
        "gate_split": True if debug.gate_split is None else bool(debug.gate_split),
        "small_tile_epilogue": bool(debug.small_tile_epilogue),
        "grid_percent": 100 if percent is None else percent,
    }
    rank_args = []
    for i, (rank, T, buf) in enumerate(zip(ranks, tokens, buffers)):
        cap = reference.expert_capacity(T, top_k, E, capacity_factor)
        rank_args.append({
            "workspace_bytes": stride, "tokens": T, "capacity": T if cap is None else cap, "rank": rank,
            "silent": rank == debug.silent_rank,
            "peer_recv": [] if buf is None else buf.peer_recv,
            "peer_comb": [] if buf is None else buf.peer_comb,
            "peer_signals": [] if buf is None else buf.peer_signals,
        })
        if kind != "single":  # the rank's forwards are counted on the device (Team.device_words)
            rank_args[-1]["team_words"] = team.device_words.data_ptr() + 8 * i
        relay = team.relay_args if kind == "nvshmem" else None
        if relay is not None:  # the hierarchical exchange's batches
            rank_args[-1]["relay"] = relay
    prepared = ext.prepare_forward(shared, rank_args)
    shape = LaunchShape(ranks=ranks, tokens=tokens, local_experts=L,
                        row_bytes=H * torch.empty((), dtype=dtype).element_size(), timeout_ms=timeout)
    plan = _Plan(ext.launch, prepared, stride, sync_bytes, shape, kind == "single" and tokens[0] == 0, top_k, E)
    if kind == "single" and not plan.skip and not debug.poison_outputs:
        plan.native = status_checks.native_plan(ext, prepared, _pool.table, plan.routing_words, plan.routing_stride,
                                                stride, sync_bytes, _stand_in_stream)
    return plan


def _plan(ext, kind, team, xs, router_weight, w2s, top_k, activation, normalize_topk, capacity_factor) -> _Plan:
    tokens = (xs[0].shape[0],) if len(xs) == 1 else tuple(x.shape[0] for x in xs)
    E, H = router_weight.shape
    I = w2s[0].shape[1]
    key = (tokens, H, I, E, top_k, xs[0].dtype, activation, normalize_topk, capacity_factor, debug.generation)
    cache = _single_plans if kind == "single" else team.launch_plans
    plan = cache.get(key)
    if plan is None:
        plan = _make_plan(ext, kind, team, tokens, H, I, E, top_k, xs[0].dtype, activation, normalize_topk,
                          capacity_factor)
        if xs[0].is_cuda and not torch.cuda.is_current_stream_capturing():
            graph_sync.reserve(xs[0].device)  # for graphs captured later (see workspace_pool)
        if len(cache) >= _PLAN_CACHE_LIMIT:
            cache.clear()
        cache[key] = plan
    return plan


class _Captured(NamedTuple):
    """A captured launch's memory from the graph's private pool, alive until the launch is recorded."""

    workspace: torch.Tensor
    sync: int                 # the ranks' zero sync words (captured_sync_words)
    sync_stride: int
    held: torch.Tensor | None  # the sync words' tensor where no kept block was left


def _captured_workspace(plan: _Plan, device, ranks: int = 1) -> _Captured:
    """A captured launch's workspace and its ranks' zero sync words (a block the graph keeps, or zeroed
    inside the capture: :func:`captured_sync_words`)."""
    sync_stride = GraphSyncBlocks.block_bytes(plan.sync_bytes)
    sync, held = captured_sync_words(device, sync_stride * ranks)
    return _Captured(torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=device), sync, sync_stride, held)


def _poison(y: torch.Tensor, routing: FusedRouting) -> None:
    y.fill_(float("nan"))
    routing.weight.fill_(float("nan"))
    for t in (routing.expert, routing.row, routing.counts):
        t.fill_(-7)


def _empty_outputs(x: torch.Tensor, top_k: int, experts: int):
    y = torch.empty_like(x)
    routing = FusedRouting.empty(x.shape[0], top_k, experts, x.device)
    if debug.poison_outputs:
        _poison(y, routing)
    return y, routing


def single_plan(x, router_weight, w2, *, top_k, activation, normalize_topk, capacity_factor) -> _Plan:
    """The prepared one-rank launch of these shapes and options (cached; :func:`launch_one` runs it).

    Raises ``ValueError`` for a dtype or shapes the kernel does not take."""
    _check_dtype(x)
    return _plan(extension.loaded(), "single", None, [x], router_weight, [w2], top_k, activation, normalize_topk,
                 capacity_factor)


def single_addresses(plan: _Plan, router: int, x: int, w1: int, w2: int, y: int, routing_block: int, pre: int,
                     workspace: int, sync: int) -> list[int]:
    """The address list a one-rank launch of ``plan`` takes, in the extension's order: the router, then
    x, w1, w2, y, the routing block's expert, weight, row and counts parts, the saved pre-activations (0:
    none), the workspace and the sync words (0: they lead the workspace)."""
    size = plan.routing_stride
    return [router, x, w1, w2, y, routing_block, routing_block + size, routing_block + 2 * size,
            routing_block + 3 * size, pre, workspace, sync]


def launch_one(plan: _Plan, x, router_weight, w1, w2, saved_pre=None, weight_addresses=None):
    """Launch ``plan`` (:func:`single_plan`) for one rank, no team; does not wait. Returns
    ``(y, FusedRouting)``; the inputs are those :func:`fused_forward` takes, already checked against the
    plan by the caller (``weight_addresses``: the weights' ``data_ptr()`` when the caller has read them).
    Launches on ``x``'s device and that device's current stream (asked per call: the user may switch
    streams or devices between calls)."""
    if plan.native is not None:
        # The common case in one C++ call (flashdmoe.kernel.host_queue), which also asks for the current
        # device and stream; None: the path below runs it.
        launched = status_checks.launch_native(plan.native, plan, x, router_weight, w1, w2, saved_pre)
        if launched is not None:
            return launched[0], plan.routing(launched[1])
    index = x.device.index
    if index != _current_device():
        with torch.cuda.device(index):
            return launch_one(plan, x, router_weight, w1, w2, saved_pre, weight_addresses)
    capturing = torch.cuda.is_current_stream_capturing()
    status_checks.before_launch(index, None, capturing)  # may raise an earlier launch's error
    y = torch.empty_like(x)
    routing = FusedRouting(torch.empty(plan.routing_words, dtype=torch.int32, device=x.device),
                           x.shape[0], plan.top_k, plan.experts)
    if debug.poison_outputs:
        _poison(y, routing)
    if plan.skip:
        routing.counts.zero_()
        if status_checks.sync_checks() and not capturing:
            status_checks.settle_through()  # debug mode: what this call queued (a weight scan) raises here
        return y, routing
    handle = _current_stream_handle(index)
    sync = 0  # the sync words lead the workspace
    if capturing:  # from the graph's pool, alive until the launch is recorded (see workspace_pool)
        captured = _captured_workspace(plan, x.device)
        workspace, sync = captured.workspace.data_ptr(), captured.sync
    else:
        workspace = _pool.address(x.device, index, handle, plan.stride, plan.sync_bytes)
    router_address, w1_address, w2_address = weight_addresses or (router_weight.data_ptr(), w1.data_ptr(),
                                                                  w2.data_ptr())
    addresses = single_addresses(plan, router_address, x.data_ptr(), w1_address, w2_address, y.data_ptr(),
                                 routing.block.data_ptr(), 0 if saved_pre is None else saved_pre.data_ptr(),
                                 workspace, sync)
    status_checks.record_launch(status_checks.claim_slot(index, capturing), plan.launch,
                                (plan.prepared, addresses, 1, handle), plan.shape, index, capturing, routing=(routing,))
    return y, routing


def run_forward(xs, router_weight, w1s, w2s, *, top_k, activation, normalize_topk, capacity_factor, team=None,
                saved_pre=None):
    """Launch the fused kernel for the ranks this process drives; does not wait for it.

    xs: list of ``[T_r, H]`` (one per rank driven here: ``P`` for an emulated team, else one); w1s / w2s:
    each rank's experts ``[L, H, I or 2I]`` / ``[L, I, H]``; router_weight ``[E, H]``. All bf16 or fp16
    (fp32 for one rank), contiguous, on one CUDA device. Returns a list of ``(y [T_r, H], FusedRouting)``;
    the launch's report is :func:`flashdmoe.last_report`. saved_pre (one rank only): None, or a
    contiguous ``[T * k, I or 2I]`` tensor of x's dtype the kernel writes GEMM1's pre-activations into, by
    packed row (the routing's ``row``; rows past the kept ones are left as they are).

    Raises ``ValueError`` for shapes the kernel or the team's buffers do not take, and the errors of
    earlier launches checked now (see :mod:`flashdmoe.kernel.status_checks`).
    """
    index = xs[0].device.index
    if index != _current_device():
        with torch.cuda.device(index):
            return _run_forward(xs, router_weight, w1s, w2s, top_k=top_k, activation=activation,
                                normalize_topk=normalize_topk, capacity_factor=capacity_factor, team=team,
                                saved_pre=saved_pre)
    return _run_forward(xs, router_weight, w1s, w2s, top_k=top_k, activation=activation,
                        normalize_topk=normalize_topk, capacity_factor=capacity_factor, team=team, saved_pre=saved_pre)


def _run_forward(xs, router_weight, w1s, w2s, *, top_k, activation, normalize_topk, capacity_factor, team,
                 saved_pre):
    kind = _team_kind(team)
    x0 = xs[0]
    device = x0.device
    capturing = torch.cuda.is_current_stream_capturing()
    if kind != "single":
        team.require_usable()
    # An NVSHMEM rank that raised an earlier launch's error instead of launching would leave its peers
    # waiting for this forward's signals: unless the team itself failed, launch first, then raise.
    deferred = None
    handle = _current_stream_handle(device.index)
    try:
        status_checks.before_launch(device.index, None if kind == "single" else team, capturing, handle)
    except Exception as error:
        if kind != "nvshmem" or team.failed:
            raise
        deferred = error
    for i, x in enumerate(xs):
        if x.dtype not in DTYPE_CODES:
            _check_dtype(x, "x" if len(xs) == 1 else f"xs[{i}]")
    ext = extension.loaded()
    plan = _plan(ext, kind, team, xs, router_weight, w2s, top_k, activation, normalize_topk, capacity_factor)
    E = router_weight.shape[0]
    outputs = [_empty_outputs(x, top_k, E) for x in xs]
    if plan.skip:
        outputs[0][1].counts.zero_()
        if status_checks.sync_checks() and not capturing:
            status_checks.settle_through()
        return outputs

    sync, sync_stride = 0, 0  # the sync words lead each rank's share of the workspace
    if capturing:
        captured = _captured_workspace(plan, device, len(xs))
        base, sync, sync_stride = captured.workspace.data_ptr(), captured.sync, captured.sync_stride
    else:
        base = _pool.address(device, device.index, handle, plan.stride, plan.sync_bytes, len(xs))
    stride = plan.stride
    addresses = [router_weight.data_ptr()]
    pre_address = 0 if saved_pre is None else saved_pre.data_ptr()
    for i, (x, w1, w2, (y, routing)) in enumerate(zip(xs, w1s, w2s, outputs)):
        addresses += (x.data_ptr(), w1.data_ptr(), w2.data_ptr(), y.data_ptr(), *routing.addresses(), pre_address,
                      base + i * stride, sync and sync + i * sync_stride)
    # The slot first: claiming it may raise an earlier launch's error.
    try:
        slot = status_checks.claim_slot(device.index, capturing, len(xs))
    except Exception as error:
        if kind != "nvshmem" or team.failed:
            raise
        deferred = deferred or error
        slot = status_checks.claim_slot(device.index, capturing, len(xs))  # the launch that raised gave its back
    # A team's sequence number is counted on the device (its prepared ranks' team_words): the kernel
    # takes count + 1 and stores it back, so a CUDA graph's replays advance it as eager launches do.
    sequence = 1 if kind == "single" else 0
    team = None if kind == "single" else team
    failed = None if team is None else lambda error: team.mark_failed(f"launch failed: {error}")
    status_checks.record_launch(slot, ext.launch, (plan.prepared, addresses, sequence, handle), plan.shape,
                                device.index, capturing, team=team, routing=tuple(r for _, r in outputs), failed=failed,
                                stream=handle)
    if deferred is not None:
        raise deferred
    return outputs


def fused_forward(x, router_weight, w1, w2, *, top_k, activation, normalize_topk, capacity_factor, saved_pre=None):
    """Run the fused kernel on one rank. x: [T, H]; router_weight: [E, H]; w1: [E, H, I or 2I]; w2: [E, I, H];
    all bf16, fp16 or fp32 (TF32 tensor cores), contiguous, on one CUDA device. Returns (y [T, H] dtype of x,
    FusedRouting). saved_pre: see :func:`run_forward`."""
    _check_dtype(x)
    if saved_pre is not None:
        want = (x.shape[0] * top_k, w1.shape[2])
        if tuple(saved_pre.shape) != want or saved_pre.dtype != x.dtype or saved_pre.device != x.device \
                or not saved_pre.is_contiguous():
            raise ValueError(f"saved_pre: expected a contiguous {list(want)} {x.dtype} tensor on {x.device}, got "
                             f"{list(saved_pre.shape)} {saved_pre.dtype} on {saved_pre.device}")
    plan = single_plan(x, router_weight, w2, top_k=top_k, activation=activation, normalize_topk=normalize_topk,
                       capacity_factor=capacity_factor)
    return launch_one(plan, x, router_weight, w1, w2, saved_pre)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _FusedMoE(torch.autograd.Function):
    """One rank (no team): forward on the kernel, which also saves GEMM1's pre-activations (16-bit inputs,
    when a gradient is wanted); backward in grouped GEMMs on the saved routing and pre-activations
    (:func:`flashdmoe.backward.expert_backward.expert_backward`)."""

    @staticmethod
    def forward(ctx, x, router_weight, w1, w2, top_k, activation, normalize_topk, capacity_factor, routing_out):
        # float32 runs TF32 tensor cores: its saved pre-activations would fall short of the float32
        # backward's accuracy, so it recomputes them in float32.
        saved_pre = None
        if any(ctx.needs_input_grad[:4]) and x.dtype in (torch.bfloat16, torch.float16):
            saved_pre = torch.empty(x.shape[0] * top_k, w1.shape[2], dtype=x.dtype, device=x.device)
        y, routing = fused_forward(
            x, router_weight, w1, w2, top_k=top_k, activation=activation, normalize_topk=normalize_topk,
            capacity_factor=capacity_factor, saved_pre=saved_pre,
        )
        ctx.save_for_backward(x, router_weight, w1, w2, routing.expert, routing.weight, routing.row, saved_pre)
        capacity = reference.expert_capacity(x.shape[0], top_k, router_weight.shape[0], capacity_factor)
        ctx.options = (activation, normalize_topk, capacity)
        routing_out.append(routing)
        return y

    @staticmethod
    def backward(ctx, dy):
        # The forward's error, if its launch has finished by now (never waits: the backward stays
        # capturable); a launch still running is checked at the next call, and its routing is only read
        # within bounds meanwhile (expert_backward).
        if not torch.cuda.is_current_stream_capturing():
            status_checks.check_errors()
        x, router_weight, w1, w2, expert, weight, row, saved_pre = ctx.saved_tensors
        activation, normalize_topk, capacity = ctx.options
        grads = expert_backward(x, router_weight, w1, w2, expert, weight, row, dy.contiguous(), activation=activation,
                                normalize_topk=normalize_topk, needs=tuple(ctx.needs_input_grad[:4]),
                                max_rows_per_expert=capacity, pre=saved_pre)
        return tuple(grads) + (None,) * 5


def _accumulate(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    if part is None:
        return total
    return part.float() if total is None else total + part.float()


class _FusedMoEEmulated(torch.autograd.Function):
    """P virtual ranks in one launch. Inputs after the options: router_weight, xs (P), w1s (P), w2s (P);
    outputs: ys (P). Backward: on the device exchange (:func:`flashdmoe.backward.ep_backward.emulated_backward`:
    every rank's rows to the owners and back by the exchange kernel, all ranks in each launch), else
    (``ep_backward.unsupported``, or ``FLASHDMOE_TEAM_BACKWARD=torch``) each rank's gradients against the
    concatenated experts (the emulated team holds every shard in this process) by
    :func:`flashdmoe.backward.expert_backward.expert_backward`, summed over ranks in rank order."""

    @staticmethod
    def forward(ctx, team, options, routing_out, router_weight, *tensors):
        from flashdmoe.backward import ep_backward

        P = team.world_size
        xs, w1s, w2s = tensors[:P], tensors[P:2 * P], tensors[2 * P:]
        results = run_forward(list(xs), router_weight, list(w1s), list(w2s), team=team, **options)
        ctx.forward_report = team.unchecked_launch  # this launch's (an older one's if it launched nothing)
        routing_out.extend(routing for _, routing in results)
        ctx.counts = None
        if any(ctx.needs_input_grad[3:]) and debug.team_backward != "torch" and not ep_backward.unsupported(team, xs[0]):
            ctx.counts = [ep_backward.ForwardCounts(team, routing, local=r) for r, (_, routing) in enumerate(results)]
        ctx.world_size = P
        ctx.team = team
        ctx.options = (options["activation"], options["normalize_topk"], options["top_k"], options["capacity_factor"])
        ctx.save_for_backward(router_weight, *tensors, *[r.expert for _, r in results],
                              *[r.weight for _, r in results], *[r.row for _, r in results])
        return tuple(y for y, _ in results)

    @staticmethod
    def backward(ctx, *dys):
        # The saved routing is only meaningful if the launch succeeded: check it first (waits for it).
        _before_team_backward(ctx)
        P = ctx.world_size
        saved = ctx.saved_tensors
        router_weight, tensors = saved[0], saved[1:1 + 3 * P]
        experts, weights, rows = saved[1 + 3 * P:1 + 4 * P], saved[1 + 4 * P:1 + 5 * P], saved[1 + 5 * P:]
        activation, normalize_topk, top_k, capacity_factor = ctx.options
        needs = ctx.needs_input_grad[3:]
        xs, w1s, w2s = tensors[:P], tensors[P:2 * P], tensors[2 * P:]
        need_w1, need_w2 = any(needs[1 + P:1 + 2 * P]), any(needs[1 + 2 * P:])
        if ctx.counts is not None:
            from flashdmoe.backward import ep_backward

            # every rank takes part in every exchange, an unused output with a zero gradient
            full = [dy if dy is not None else torch.zeros_like(x) for dy, x in zip(dys, xs)]
            dxs, d_router, dw1s, dw2s = ep_backward.emulated_backward(
                ctx.team, list(xs), router_weight, list(w1s), list(w2s), list(experts), list(weights), list(rows),
                full, ctx.counts, activation=activation, normalize_topk=normalize_topk,
                needs=(any(needs[1:1 + P]), needs[0], need_w1, need_w2))
            out = [g if need else None for g, need in zip([d_router, *dxs, *dw1s, *dw2s], needs)]
            return (None, None, None, *out)
        w1_all, w2_all = torch.cat(w1s), torch.cat(w2s)
        E = w1_all.shape[0]
        d_router = d_w1 = d_w2 = None
        dxs = [None] * P
        for r in range(P):
            if dys[r] is None:
                continue
            T = xs[r].shape[0]
            packed = packed_rows(experts[r], rows[r] >= 0, E)  # owners' stream rows -> one rank's
            dx, dr, dw1, dw2 = expert_backward(
                xs[r], router_weight, w1_all, w2_all, experts[r], weights[r], packed, dys[r].contiguous(),
                activation=activation, normalize_topk=normalize_topk, needs=(needs[1 + r], needs[0], need_w1, need_w2),
                max_rows_per_expert=reference.expert_capacity(T, top_k, E, capacity_factor))
            dxs[r] = dx
            # in rank order, in float32: the sum over ranks rounds once, at the end
            d_router, d_w1, d_w2 = (_accumulate(total, part) for total, part in ((d_router, dr), (d_w1, dw1), (d_w2, dw2)))
        shards = [w.shape[0] for w in w1s]
        d_router = None if d_router is None else d_router.to(router_weight.dtype)
        dw1s = [None] * P if d_w1 is None else list(d_w1.to(w1_all.dtype).split(shards))
        dw2s = [None] * P if d_w2 is None else list(d_w2.to(w2_all.dtype).split(shards))
        out = [g if need else None for g, need in zip([d_router, *dxs, *dw1s, *dw2s], needs)]
        return (None, None, None, *out)


class _FusedMoETeam(torch.autograd.Function):
    """This process's rank of a multi-process team: forward on the kernel; backward a collective, on the GPU
    with the rows moved by the device (:func:`flashdmoe.backward.ep_backward.team_backward`: stores to peers with a
    load/store pointer, NVSHMEM puts to the others), else (``ep_backward.unsupported``, or forced) torch ops
    over peer-memory exchanges (:func:`flashdmoe.parallel.ep_peer.expert_parallel_backward`)."""

    @staticmethod
    def forward(ctx, team, options, routing_out, x, router_weight, w1, w2):
        from flashdmoe.backward import ep_backward

        (y, routing), = run_forward([x], router_weight, [w1], [w2], team=team, **options)
        ctx.forward_report = team.unchecked_launch  # this launch's (an older one's if it launched nothing)
        routing_out.append(routing)
        ctx.counts = None
        if any(ctx.needs_input_grad[3:]) and debug.team_backward != "torch" and not ep_backward.unsupported(team, x):
            ctx.counts = ep_backward.ForwardCounts(team, routing)
        ctx.team = team
        ctx.options = (options["activation"], options["normalize_topk"])
        ctx.save_for_backward(x, router_weight, w1, w2, routing.expert, routing.row, routing.weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        from flashdmoe.backward import ep_backward
        from flashdmoe.parallel import ep_peer

        # A collective on a team whose forward timed out could wait forever: check the forward first, so
        # every rank raises KernelTimeout here instead. The torch-ops path's team barriers have no
        # watchdog, so it also waits for the team's last launch, whatever the stream.
        on_device = ctx.counts is not None and debug.team_backward != "torch"
        if on_device:
            _before_team_backward(ctx)
        else:
            status_checks.settle_team(ctx.team)
        ctx.team.require_usable()
        x, router_weight, w1, w2, expert, row, weight = ctx.saved_tensors
        activation, normalize_topk = ctx.options
        if on_device:
            grads = ep_backward.team_backward(
                ctx.team, x, router_weight, w1, w2, expert, weight, row, dy.contiguous(), ctx.counts,
                activation=activation, normalize_topk=normalize_topk, needs=tuple(ctx.needs_input_grad[3:7]))
            return (None, None, None, *grads)
        grads = ep_peer.expert_parallel_backward(
            ctx.team, x, router_weight, w1, w2, expert.long(), row >= 0, dy.contiguous(), activation=activation,
            normalize_topk=normalize_topk, needs_input_grad=tuple(ctx.needs_input_grad[3:7]),
        )
        return (None, None, None, *grads)


def _before_team_backward(ctx) -> None:
    """Check the forward a team's backward differentiates; wait for the team's last launch only if it ran
    on another stream than the backward's (the current one of the team's device): on the same stream the
    device stops the backward's exchange after a failed launch (status_checks.before_backward)."""
    team = ctx.team
    capturing = torch.cuda.is_current_stream_capturing()
    stream = None if capturing else _current_stream_handle(team.device_words.device.index)
    status_checks.before_backward(team, ctx.forward_report, stream, capturing=capturing)


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
    if kind == "single":
        if _needs_grad(x, router_weight, w1, w2):
            routing_out: list[FusedRouting] = []
            y = _FusedMoE.apply(x, router_weight, w1, w2, top_k, activation, normalize_topk, capacity_factor,
                                routing_out)
            routing = routing_out[0]
        else:  # no autograd node to build: the launch alone
            y, routing = fused_forward(x, router_weight, w1, w2, top_k=top_k, activation=activation,
                                       normalize_topk=normalize_topk, capacity_factor=capacity_factor)
    elif kind == "nvshmem":
        options = dict(top_k=top_k, activation=activation, normalize_topk=normalize_topk,
                       capacity_factor=capacity_factor)
        routing_out = []
        y = _FusedMoETeam.apply(team, options, routing_out, x, router_weight, w1, w2)
        routing = routing_out[0]
    else:
        raise ValueError(
            f"team: a {kind!r} team holds every rank in this process; call "
            "flashdmoe.moe_expert_parallel(xs, router_weight, w1s, w2s, ..., team=team) instead"
        )
    if not return_aux:
        return y
    return y, _aux(x, router_weight, top_k, routing.counts, routing.row)


def moe_emulated(xs, router_weight, w1s, w2s, *, top_k, activation="gelu", normalize_topk=True,
                 capacity_factor=None, return_aux=False, team):
    """flashdmoe.moe_expert_parallel on an emulated team: every rank in one launch. Returns the list of
    ``y_r`` (plus the list of per-rank MoEAux when ``return_aux``)."""
    options = dict(top_k=top_k, activation=activation, normalize_topk=normalize_topk,
                   capacity_factor=capacity_factor)
    if _needs_grad(router_weight, *xs, *w1s, *w2s):
        routing_out: list[FusedRouting] = []
        ys = list(_FusedMoEEmulated.apply(team, options, routing_out, router_weight, *xs, *w1s, *w2s))
    else:
        results = run_forward(list(xs), router_weight, list(w1s), list(w2s), team=team, **options)
        ys, routing_out = [y for y, _ in results], [r for _, r in results]
    if not return_aux:
        return ys
    return ys, [_aux(x, router_weight, top_k, r.counts, r.row) for x, r in zip(xs, routing_out)]
