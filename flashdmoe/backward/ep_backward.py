"""The backward of a multi-process team's layer on the GPU, its rows moved by the device.

:func:`team_backward` is what the fused backend's autograd runs on every rank of an NVSHMEM team. It is
a collective: every rank calls it for every backward, in the same order. A peer with a load/store
pointer (NVLink, or the same GPU under MPS) gets plain stores; a peer reached by NVSHMEM puts (another
node, or ``peer_transport="nvshmem"``; the NVSHMEM kernel build) gets the same data staged in this rank's
symmetric memory (the team's ``stage`` buffer, :attr:`BufferPlan.stage_bytes
<flashdmoe.parallel.team.BufferPlan.stage_bytes>`) and put, at the same places, before the same flags
(``csrc/nvshmem/ep_rows_puts.cuh``). Per rank ``r`` (``docs/design.md`` §5):

1. **Rows to the owners** (one launch of ``csrc/backward/ep_rows.cuh``): each kept choice ``(t, j)`` of
   ``r`` writes ``x[t]`` into its expert owner's ``recv`` buffer, ``dy[t]`` into the owner's ``comb`` buffer
   and its combine weight into the owner's row words, at the row's place in the owner's *packed* order
   (local expert 0's rows of every source in rank order, then expert 1's, ...). The owner knows how many
   rows each source sends for each of its experts from the forward (:class:`ForwardCounts`: the forward
   kernel leaves them in its count words, copied behind it to the host, or on the device in a capture), so
   it lays out the packed order (:func:`host_owner_layout`; :func:`owner_layout` on the device in a
   capture) and its launch first writes each source's part of it into the source's place words, then lets
   the sources write. Each destination gets a flag with the backward's sequence number (the rank's count
   of backward exchanges, kept by the kernel in its signal words); the launch ends when every source's
   flag arrived.
2. **The owner's experts** on the rows as they lie: recompute ``pre`` and run
   :func:`flashdmoe.backward.expert_backward.packed_row_grads` (grouped GEMMs, the element-wise kernel): ``dw1``,
   ``dw2`` of ``r``'s experts, and per received row ``dx_row`` and the combine weight's gradient. The
   host queues this behind step 1 without waiting for it.
3. **Gradients back** (the same kernel, other direction): each received row's ``dx_row`` into its source's
   ``comb`` region ``[r]`` at the same stream row, its weight gradient into the source's row word.
4. **The source's tokens**: the router's logit gradient (``router_grad`` kernel) and ``dx`` = a token's
   ``dx_row`` in choice order plus the router's term (``combine_grad``), both reading the rows where
   step 3 wrote them.
5. **The router's gradient** (the same kernel, third direction): each rank's float32 share of
   ``d_router`` into every peer's ``comb`` region, then every rank sums the ``P`` shares in rank order
   (bitwise the same on every rank) and rounds once. A share larger than one ``comb`` region goes
   through :meth:`flashdmoe.parallel.ep_peer.PeerExchange.all_reduce_sum` instead.

Before writing into a peer's staging, a launch waits for that peer's "free" flag of the same sequence
(raised by the peer's own launch of that direction, once its stream has finished reading the region).
Every wait is bounded: a silent or stuck rank makes the waiting ranks' launches stop (a stopped launch
publishes nothing further, so its peers stop too; it leaves its error in the rank's abort words, and the
backward's later launches stop at once with it; it also marks the rank failed in its team words, so
that every later launch of the rank on the stream, forward or exchange, runs nothing and reports
``TeamFailed``), and every rank raises :class:`flashdmoe.KernelTimeout` (naming the phase and the peer)
with the team marked failed, at the next check (a later forward's poll of finished launches,
:func:`flashdmoe.check_errors`, :func:`flashdmoe.synchronize`, ``Team.barrier``, a launch on another
stream); nothing waits forever.

Host waits (eager): for the forward this backward differentiates (its check, and its counts:
:meth:`ForwardCounts.host`, which size step 2 exactly), which in a model's backward finished long before;
not for the team's last launch (the previous layer's exchange:
:func:`flashdmoe.kernel.status_checks.before_backward`), and none inside the backward.

CUDA graphs: inside a capture nothing is read on the host. Step 2 covers the team's bound, ``P *
stream_rows`` rows per owner (the received-row table is -1 past the rows received), its grouped GEMMs
take their end rows on the device and the element-wise kernel stops at the last one; the exchange's
sequence numbers are the kernel's, so replays and eager steps interleave. bfloat16 only (float16's
grouped GEMMs loop over host counts).

Memory held per rank: nothing between forward and backward beyond what autograd saves (``x``, the
weights, the routing) and the forward's ``P * L`` counts (on the device, and in pinned host memory for an
eager forward); the backward's staging is the team's ``recv`` / ``comb`` buffers and signal words.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from flashdmoe.kernel import status_checks
from flashdmoe.parallel.ep_peer import PeerExchange
from flashdmoe.backward.expert_backward import grouped_mm_supported, packed_row_grads, to_device_without_waiting
from flashdmoe.kernel.kernel_codes import DTYPE_CODES
from flashdmoe.kernel.launch_knobs import debug, timeout_ms
from flashdmoe.kernel.launch_report import LaunchReport, LaunchShape, status_layout
from flashdmoe.kernel.workspace_pool import WorkspacePool, captured_sync_words

__all__ = ["ForwardCounts", "OwnerLayout", "emulated_backward", "exchange_traffic", "forward_count_words",
           "host_owner_layout", "owner_layout", "team_backward", "unsupported"]

_pool = WorkspacePool()
TO_OWNERS, BACK_TO_SOURCES, SUM_OVER_RANKS = 0, 1, 2
# Every direction's arguments start from these (the fields a direction does not read stay null / zero).
_UNUSED = {"tokens": 0, "x": 0, "dy": 0, "expert": 0, "row": 0, "weight": 0, "place": 0, "rows": 0, "received": 0,
           "dx_rows": 0, "dweight_row": 0}


def unsupported(team, x: torch.Tensor) -> str:
    """'' when :func:`team_backward` (a process of an NVSHMEM team) or :func:`emulated_backward` (an
    emulated team) runs this team's backward, else why not."""
    transport = getattr(team, "transport", None)
    if transport not in ("nvshmem", "emulated"):
        return "the device exchange is for NVSHMEM and emulated teams"
    if x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16):
        return f"the device exchange takes bfloat16 / float16 on CUDA, not {x.dtype} on {x.device.type}"
    if transport == "emulated":
        from flashdmoe.kernel import extension

        return extension.unavailable_reason() or ""
    own = team.buffers[0]
    puts = _put_peers(team)
    missing = [q for q, address in enumerate(own.mapped_signals) if address is None and q not in puts]
    missing += [q for q, address in enumerate(own.mapped_recv) if address is None and q not in missing + puts]
    if missing or len(own.mapped_signals) != team.world_size:
        return f"ranks {sorted(missing)} have no load/store pointer from rank {team.rank} and no NVSHMEM transport"
    from flashdmoe.kernel import extension

    if puts:
        if extension.kernel_build() != "nvshmem":
            return (f"ranks {puts} are reached by NVSHMEM puts, which the {extension.kernel_build()!r} kernel build "
                    "cannot do (FLASHDMOE_KERNEL_BUILD=nvshmem)")
        if own.stage is None:
            return f"ranks {puts} are reached by NVSHMEM puts but the team holds no stage buffer for them"
    return extension.unavailable_reason() or ""


def _put_peers(team) -> list[int]:
    """The peers this rank's team reaches by NVSHMEM puts (``team.peer_transports``)."""
    return [q for q, kind in enumerate(getattr(team, "peer_transports", None) or ()) if kind == "nvshmem"]


def _exchange_peers(team, local: int = 0) -> dict:
    """The exchange's peer table of the rank held in ``team.buffers[local]``: a peer's mapped buffers, or
    for a peer reached by puts this rank's own addresses (its own signal words are the kernel's mark of
    such a peer, as in the forward's table)."""
    own = team.buffers[local]
    puts = set(_put_peers(team))
    mine = (own.recv.data_ptr(), own.comb.data_ptr(), own.signals.data_ptr())
    table = {"peer_recv": [], "peer_comb": [], "peer_signals": []}
    for q in range(team.world_size):
        entry = mine if q in puts else (own.mapped_recv[q], own.mapped_comb[q], own.mapped_signals[q])
        for key, address in zip(table, entry):
            table[key].append(int(address))
    if puts:
        table.update(stage=own.stage.data_ptr(), stage_rows=team.plan.stage_rows)
    return table


class OwnerLayout(NamedTuple):
    """Where an owner's received rows lie and where they came from, all int32 on one device.

    received ``[rows]``: each packed row's staging row in its source's stream, ``source * stream_rows +
    stream row``, or -1 past the rows received; offs ``[L]``: each local expert's end row in the packed
    order (the grouped GEMMs' offsets); place ``[P, L]``: source ``q``'s rows for local expert ``l`` go to
    packed row ``place[q, l] +`` their stream row; from_rows ``[P]``: rows each source sent."""

    received: torch.Tensor
    offs: torch.Tensor
    place: torch.Tensor
    from_rows: torch.Tensor


def _clipped_counts(counts: torch.Tensor, stream_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts, within)`` int64 ``[P, L]``: the counts kept inside each source's stream (a failed forward may
    leave any value in the count words: never index past a stream) and where each (source, local expert)
    run starts in its source's stream (the source orders its rows by local expert)."""
    counts = counts.to(torch.int64).clamp(0, stream_rows)
    within = torch.cumsum(counts, 1) - counts
    return torch.minimum(counts, (stream_rows - within).clamp(min=0)), within


def owner_layout(counts: torch.Tensor, stream_rows: int, rows: int | None = None) -> OwnerLayout:
    """An owner's packed order from its counts: local expert 0's rows of every source in rank order, then
    expert 1's, ...; within a source its stream order.

    counts: ``[P, L]`` int: rows source ``q`` sent for local expert ``l`` (in its stream to this owner, source
    ``q``'s rows are ordered by local expert from stream row 0, the forward's numbering). Torch ops where
    the counts are, nothing read back (so device counts give a layout inside a CUDA-graph capture): ``rows``
    sizes the received-row table, the rows received or a bound such as ``P * stream_rows`` (rows past those
    received are -1); ``None`` counts them (a read of the counts). An eager backward, whose counts are on
    the host, takes :func:`host_owner_layout` instead (the same tables, fewer launches)."""
    P, L = counts.shape
    counts, within = _clipped_counts(counts, stream_rows)
    per_expert = counts.sum(0)
    offs = torch.cumsum(per_expert, 0)
    before = torch.cumsum(counts, 0) - counts                           # rows of sources < q for expert l
    place = (offs - per_expert)[None, :] + before - within
    # the P * L runs in packed order ((l, q): expert-major), each a span of consecutive stream rows
    sizes = counts.t().reshape(-1)
    span_end = torch.cumsum(sizes, 0)
    stream_start = (torch.arange(P, device=counts.device)[:, None] * stream_rows + within).t().reshape(-1)
    if rows is None:
        rows = int(span_end[-1])
    packed = torch.arange(rows, device=counts.device)
    span = torch.searchsorted(span_end, packed, right=True)            # the first run ending past the row
    shift = stream_start - (span_end - sizes)
    received = torch.where(span < P * L, shift[span.clamp(max=P * L - 1)] + packed, -1)
    return OwnerLayout(received.to(torch.int32), offs.to(torch.int32), place.to(torch.int32),
                       counts.sum(1).to(torch.int32))


def host_owner_layout(counts: torch.Tensor, stream_rows: int,
                      device: torch.device | None = None) -> tuple[OwnerLayout, list[int]]:
    """:func:`owner_layout` of counts on the host (CPU ``[P, L]``), over the rows received, with each local
    expert's count as host ints: the ``P * L`` numbers laid out in numpy (a torch op on a tensor this small
    costs more than its work, and an eager backward is often host-bound), then one copy to ``device``
    (default CPU) that does not wait for the stream, and the received-row table expanded there."""
    P, L = counts.shape
    counts = np.clip(counts.numpy().astype(np.int64), 0, stream_rows)
    within = np.cumsum(counts, axis=1) - counts                       # start of (q, l) in q's stream
    counts = np.minimum(counts, np.clip(stream_rows - within, 0, None))
    per_expert = counts.sum(axis=0)
    offs = np.cumsum(per_expert)
    before = np.cumsum(counts, axis=0) - counts                       # rows of sources < q for expert l
    place = (offs - per_expert)[None, :] + before - within
    sizes = counts.T.reshape(-1)                                      # (l, q) order
    starts = (np.arange(P, dtype=np.int64)[:, None] * stream_rows + within).T.reshape(-1)
    total = int(sizes.sum())
    device = torch.device("cpu") if device is None else device
    table = to_device_without_waiting(torch.from_numpy(np.concatenate(
        [starts - (np.cumsum(sizes) - sizes), sizes, offs, place.reshape(-1), counts.sum(axis=1)])), device)
    shift, run_sizes, small = table.split([P * L, P * L, L + P * L + P])
    small = small.to(torch.int32)
    received = torch.repeat_interleave(shift, run_sizes, output_size=total) + torch.arange(total, device=device)
    layout = OwnerLayout(received.to(torch.int32), small[:L], small[L:L + P * L].view(P, L), small[L + P * L:])
    return layout, [int(c) for c in per_expert]


def sent_runs(expert: torch.Tensor, row: torch.Tensor, world_size: int, local_experts: int) -> torch.Tensor:
    """``[2, P * L]`` int32 (``expert``'s device), computed there without waiting: for each (owner, local
    expert), the first row of this rank's run to it in the stage (its kept choices in owner-major, then
    expert order, as each owner's stream) and the run's rows. expert, row ``[T, k]``: the forward's routing
    (row -1: dropped)."""
    E = world_size * local_experts
    kept = (row.reshape(-1) >= 0).to(torch.int32)
    counts = torch.zeros(E, dtype=torch.int32, device=expert.device)
    counts.index_add_(0, expert.reshape(-1).long().clamp(0, E - 1), kept)
    return torch.stack([torch.cumsum(counts, 0, dtype=torch.int32) - counts, counts])


def exchange_traffic(team) -> dict[str, int] | None:
    """Bytes the team's last backward exchange sent this rank's peers, summed over its launches:
    ``dispatch_bytes`` (rows, weights to the owners), ``combine_bytes`` (dx rows and weight gradients back,
    the router's share), and the parts of each that went by NVSHMEM puts. ``None`` before a backward.
    Waits for those launches."""
    reports = getattr(team, "backward_reports", None)
    if not reports:
        return None
    keys = ("dispatch_bytes", "combine_bytes", "nvshmem_dispatch_bytes", "nvshmem_combine_bytes")
    total = dict.fromkeys(keys, 0)
    for report in reports:
        for status in report.statuses:
            for key in keys:
                total[key] += getattr(status, key)
    return total


def forward_count_words(team, routing, local: int = 0) -> torch.Tensor:
    """``[P, L]`` int32 on the team's device, as the forward that produced ``routing`` (its ``expert`` and
    ``row`` ``[T, k]``) left them: rows source ``q`` sent this rank for local expert ``l``. A team's forward
    kernel writes every source's count words, its own included; a one-rank team's launch publishes none,
    so there they are counted from the routing (kept choices: ``row >= 0``). ``local``: which of the
    buffers this process holds (an emulated team's rank; 0 for a process of a team)."""
    plan = team.plan
    P, L = plan.world_size, plan.local_experts
    if P > 1:
        return team.buffers[local].signals[:P * L].view(P, L)
    expert, row = routing.expert.reshape(-1).long(), routing.row.reshape(-1)
    words = torch.zeros(1, L, dtype=torch.int32, device=expert.device)
    words[0].scatter_add_(0, expert.clamp(0, L - 1), (row >= 0).to(torch.int32))
    return words


class ForwardCounts:
    """One forward's counts as an owner, ``[P, L]`` int32, rows source ``q`` sent this rank for local expert
    ``l``, copied from the count words the forward kernel leaves (every source's, its own included; the next
    forward on the team overwrites them). For a forward run eagerly, a copy on its way to the host, queued
    behind it (:meth:`host` waits only for that copy, so a backward that runs after the forward has finished,
    every layer's but the last, does not wait). For a forward captured in a CUDA graph, ``device``: a copy
    on the device, from which its backward lays out the owner's rows for the team's bound."""

    def __init__(self, team, routing, local: int = 0) -> None:
        words = forward_count_words(team, routing, local)
        self.device = self._host = self._done = None
        if torch.cuda.is_current_stream_capturing():
            self.device = words.clone()
        else:
            self._host = torch.empty(words.shape, dtype=torch.int32, pin_memory=True)
            self._host.copy_(words, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def host(self) -> torch.Tensor | None:
        """The counts on the host (waits for their copy), or None for a forward captured in a graph."""
        if self._done is None:
            return None
        self._done.synchronize()
        return self._host


def _launch(ext, team, rank_args: list[dict], device: torch.device, what_tokens: tuple[int, ...],
            capturing: bool = False) -> LaunchReport:
    """One launch of the row exchange on the current stream for the ranks this process drives (one, or an
    emulated team's every rank), recorded like a forward's (its error surfaces where a forward's does;
    :func:`status_checks.settle` waits for it). ``capturing``: inside a CUDA-graph capture."""
    index = device.index
    status_checks.before_launch(index, None, capturing)
    stream = torch._C._cuda_getCurrentRawStream(index)
    sync_bytes = ext.ep_rows_sync_bytes()
    stride = -(-sync_bytes // 256) * 256
    held = None  # a captured launch's own sync words, alive until it is launched
    if capturing:  # kept by the graph, or zeroed inside it (see workspace_pool)
        sync, held = captured_sync_words(device, stride * len(rank_args))
    else:
        sync = _pool.address(device, index, stream, stride, sync_bytes, len(rank_args))
    status_bytes = status_layout().bytes

    def start(status: int):
        for i, args in enumerate(rank_args):
            args["sync"] = sync + i * stride
            args["status_host"] = status + i * status_bytes
        return ext.ep_rows(rank_args[0] if len(rank_args) == 1 else rank_args, stream)

    plan = team.plan
    shape = LaunchShape(tuple(args["rank"] for args in rank_args), what_tokens, plan.local_experts,
                        plan.hidden * plan.element_bytes, timeout_ms())
    return status_checks.record_launch(status_checks.claim_slot(index, capturing, len(rank_args)), start, (), shape,
                                       index, capturing, team=team, forward=False, stream=stream)


class _Local(NamedTuple):
    """One rank this process drives in a backward (a process of a team drives one, an emulated team all):
    ``local`` indexes ``team.buffers``; its tokens' ``x`` / ``dy`` ``[T, H]``, its routing ``expert`` / ``row``
    (int32) and ``weight`` (float32) ``[T, k]``, its experts' ``w1`` / ``w2`` and its forward's counts."""

    local: int
    rank: int
    x: torch.Tensor
    dy: torch.Tensor
    expert: torch.Tensor
    row: torch.Tensor
    weight: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    counts: "ForwardCounts"


def team_backward(team, x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  expert: torch.Tensor, weight: torch.Tensor, row: torch.Tensor, dy: torch.Tensor,
                  counts: ForwardCounts, *, activation: str, normalize_topk: bool, needs=(True, True, True, True)):
    """Gradients of this rank's share of the team's layer from its forward's routing; a collective.

    x ``[T, H]`` (16-bit), router_weight ``[E, H]``, w1 ``[L, H, I or 2I]``, w2 ``[L, I, H]`` (this rank's
    experts), all x's dtype and device; expert, row ``[T, k]`` int32 and weight ``[T, k]`` float32: the
    forward's routing (global expert, stream row to its owner or -1 where dropped, combine weight); dy
    ``[T, H]``; counts: the same forward's :class:`ForwardCounts`. needs: which of ``(dx, d_router, dw1,
    dw2)`` to return (every rank still runs every step: its peers need its rows).

    Returns ``(dx [T, H], d_router [E, H], dw1, dw2)`` in the inputs' dtypes (None where not needed);
    ``d_router`` is the sum over ranks, the same bits on every rank. Nothing here waits for the GPU (but
    for the forward's counts): a peer that never sends surfaces as ``KernelTimeout`` (team marked failed)
    at the team's next use, :func:`flashdmoe.check_errors` or :func:`flashdmoe.synchronize`.
    """
    local = _Local(0, team.rank, x, dy, expert, row, weight, w1, w2, counts)
    (dx,), d_router, (dw1,), (dw2,) = _backward(team, [local], router_weight, activation=activation,
                                                normalize_topk=normalize_topk, needs=needs)
    return dx, d_router, dw1, dw2


def emulated_backward(team, xs, router_weight: torch.Tensor, w1s, w2s, experts, weights, rows, dys, counts, *,
                      activation: str, normalize_topk: bool, needs=(True, True, True, True)):
    """Every rank's gradients of an emulated team's layer (:meth:`flashdmoe.Team.emulated`), by the same
    steps as :func:`team_backward`, each of the exchange's launches running all ``P`` ranks side by side
    (their flags waited for within the launch, with the same sequence numbers and watchdog).

    Per rank ``r`` (lists of ``P``): xs[r], dys[r] ``[T_r, H]``; w1s[r], w2s[r] its experts; experts[r],
    rows[r] ``[T_r, k]`` int32 and weights[r] float32: its forward's routing; counts[r]: its
    :class:`ForwardCounts` (``local=r``). Returns ``(dxs, d_router, dw1s, dw2s)``: lists of ``P`` (None
    where ``needs`` says so), ``d_router`` the sum over ranks in rank order."""
    locals_ = [_Local(r, r, xs[r], dys[r], experts[r], rows[r], weights[r], w1s[r], w2s[r], counts[r])
               for r in range(team.world_size)]
    return _backward(team, locals_, router_weight, activation=activation, normalize_topk=normalize_topk, needs=needs)


def _backward(team, locals_: list[_Local], router_weight: torch.Tensor, *, activation: str, normalize_topk: bool,
              needs) -> tuple[list, torch.Tensor | None, list, list]:
    """The steps of :func:`team_backward` for the ranks this process drives; returns lists over them."""
    from flashdmoe.kernel import extension

    ext = extension.loaded()
    plan, P = team.plan, team.world_size
    L, S, H = plan.local_experts, plan.stream_rows, plan.hidden
    E = router_weight.shape[0]
    device, dtype = locals_[0].x.device, locals_[0].x.dtype
    need_dx, need_router, need_dw1, need_dw2 = needs
    staged = P * S
    capturing = torch.cuda.is_current_stream_capturing()
    # (the sequence number is the kernel's: each rank counts its backward exchanges in its signal words)
    common_all = {"world_size": P, "local_experts": L, "stream_rows": S, "hidden": H,
                  "element_bytes": plan.element_bytes, "timeout_ns": timeout_ms() * 1_000_000,
                  "debug_withhold_phase": int(debug.withhold_phase), "grid_percent": _grid_percent()}
    ranks = []
    for loc in locals_:
        own = team.buffers[loc.local]
        peers = _exchange_peers(team, loc.local)
        tokens, top_k = loc.expert.shape
        host = None if capturing else loc.counts.host()
        if host is not None:  # eager: the rows received, laid out from the host counts
            layout, per_expert = host_owner_layout(host, S, device)
            rows = int(layout.received.numel())
        else:  # captured: the team's bound, laid out on the device
            _check_device_layout(loc.counts, dtype, device, H, loc.w2.shape[1])
            rows, per_expert = staged, None
            layout = owner_layout(loc.counts.device, S, rows)
        ranks.append({
            "loc": loc, "tokens": tokens, "top_k": top_k, "puts": "stage" in peers,
            "common": {**common_all, "rank": loc.rank, "silent": loc.rank == debug.silent_rank,
                       "team_words": team.device_words.data_ptr() + 8 * loc.local, **peers},
            "recv": own.recv[:staged * H * plan.element_bytes].view(dtype).view(staged, H),
            "comb": own.comb[:staged * H * plan.element_bytes].view(dtype).view(staged, H),
            "row_words": own.signals[plan.backward_word("row_word", 0, 0):plan.backward_word("row_word", P, 0)],
            # each rank's packed order from its forward's counts: no wait for the launches
            "layout": layout, "rows": rows, "per_expert": per_expert,
            "expert32": loc.expert.to(torch.int32).contiguous(), "row32": loc.row.to(torch.int32).contiguous(),
            "dy16": loc.dy.to(dtype).contiguous(), "xc": loc.x.contiguous(),
            "weight32": loc.weight.to(torch.float32).contiguous(),
        })

    # 1. rows and weights to the owners, in each owner's packed order
    out_args = []
    for r in ranks:
        args = {**r["common"], **_UNUSED, "direction": TO_OWNERS, "tokens": r["tokens"], "top_k": r["top_k"],
                "x": r["xc"].data_ptr(), "dy": r["dy16"].data_ptr(), "expert": r["expert32"].data_ptr(),
                "row": r["row32"].data_ptr(), "weight": r["weight32"].data_ptr(),
                "place": r["layout"].place.data_ptr()}
        if r["puts"]:
            r["sent"] = sent_runs(r["expert32"], r["row32"], P, L)
            args["sent"] = r["sent"].data_ptr()
        out_args.append(args)
    reports = [_launch(ext, team, out_args, device, tuple(r["tokens"] for r in ranks), capturing)]

    # 2. each rank's experts on the rows it received, as they lie
    for r in ranks:
        n = r["rows"]
        r["dweight_row"], r["dx_rows"], r["dw1"], r["dw2"] = packed_row_grads(
            r["recv"][:n], r["comb"][:n], r["row_words"][:n].view(torch.float32), r["per_expert"],
            r["loc"].w1, r["loc"].w2, activation=activation, need_dw1=need_dw1, need_dw2=need_dw2,
            offs=r["layout"].offs)

    # 3. each received row's dx share and weight gradient back to its source
    back_args = []
    for r in ranks:
        back_args.append({**r["common"], **_UNUSED, "direction": BACK_TO_SOURCES, "top_k": r["top_k"],
                          "rows": r["rows"], "received": r["layout"].received.data_ptr(),
                          "dx_rows": r["dx_rows"].data_ptr() if r["dx_rows"].numel() else 0,
                          "dweight_row": r["dweight_row"].data_ptr() if r["dweight_row"].numel() else 0,
                          "from_rows": r["layout"].from_rows.data_ptr()})
    back = _launch(ext, team, back_args, device, tuple(r["rows"] for r in ranks), capturing)
    reports.append(back)

    # 4. each rank's tokens: the router's gradient and dx (stream-ordered after step 3's launch, which ends
    # once every owner's rows are here)
    shares, dxs = [], []
    for r in ranks:
        dx, share = _tokens_grads(ext, r, router_weight, P, L, S, E, H, dtype, device, normalize_topk, need_dx)
        dxs.append(dx)
        shares.append(share)
    # 5. d_router summed over the ranks; every rank joins, whatever it needs itself
    d_router = _sum_over_ranks(ext, team, ranks, shares, back, device, reports, capturing)
    team.backward_reports = tuple(reports)
    return (dxs, d_router.to(router_weight.dtype) if need_router else None,
            [r["dw1"] if need_dw1 else None for r in ranks], [r["dw2"] if need_dw2 else None for r in ranks])


def _tokens_grads(ext, r: dict, router_weight, P, L, S, E, H, dtype, device, normalize_topk, need_dx):
    """One rank's dx (its tokens' dx rows, where step 3 left them in its comb regions, summed in choice order,
    plus the router's term) and its float32 share of d_router."""
    tokens, top_k = r["tokens"], r["top_k"]
    expert32, row32, xc = r["expert32"], r["row32"], r["xc"]
    if not tokens:
        return (xc.new_zeros(0, H) if need_dx else None), torch.zeros(E, H, dtype=torch.float32, device=device)
    owner = expert32.long().div(L, rounding_mode="floor").clamp(0, P - 1)
    staged_row = torch.where(row32 >= 0, (owner * S + row32.long()).to(torch.int32), -1).contiguous()
    stream = torch.cuda.current_stream(device).cuda_stream
    logits = torch.mm(xc, router_weight.t(), out_dtype=torch.float32)
    dlogits = torch.empty(tokens, E, dtype=dtype, device=device)
    weight_grads = r["row_words"].view(torch.float32)
    ext.router_grad(DTYPE_CODES[dtype], logits.data_ptr(), expert32.data_ptr(), staged_row.data_ptr(),
                    weight_grads.data_ptr(), dlogits.data_ptr(), tokens, top_k, E, normalize_topk, stream)
    share = torch.mm(dlogits.t(), xc, out_dtype=torch.float32)
    dx = None
    if need_dx:
        dx_router = torch.mm(dlogits, router_weight, out_dtype=torch.float32)
        dx = torch.empty_like(xc)
        ext.combine_grad(DTYPE_CODES[dtype], r["comb"].data_ptr(), staged_row.data_ptr(), dx_router.data_ptr(),
                         dx.data_ptr(), tokens, top_k, H, stream)
    return dx, share


def _sum_over_ranks(ext, team, ranks: list[dict], shares: list[torch.Tensor], back: LaunchReport,
                    device: torch.device, reports: list, capturing: bool) -> torch.Tensor:
    """The sum over the team's ranks of each rank's float32 share in rank order (the same bits on every
    rank): the exchange's third direction, staged in the peers' ``comb`` regions, where it fits one region.
    Else an emulated team (every share here) adds them in rank order, and a process of a team uses
    :meth:`PeerExchange.all_reduce_sum` (host-launched copies between team barriers, which wait without a
    watchdog: the step before is checked first, so a rank that timed out raises instead of leaving its
    peers in a barrier)."""
    plan = team.plan
    shares = [share.contiguous() for share in shares]
    n = shares[0].numel()
    if n % 4 == 0 and n * 4 <= plan.stream_rows * plan.hidden * plan.element_bytes:
        totals = [torch.empty_like(share) for share in shares]
        args = [{**r["common"], **_UNUSED, "direction": SUM_OVER_RANKS, "top_k": 1, "n": n,
                 "share": share.data_ptr(), "sum": total.data_ptr()}
                for r, share, total in zip(ranks, shares, totals)]
        reports.append(_launch(ext, team, args, device, tuple(0 for _ in ranks), capturing))
        return totals[0]
    if len(ranks) == team.world_size:  # every rank here: the sum in rank order
        total = shares[0].clone()
        for share in shares[1:]:
            total += share
        return total
    if _put_peers(team):
        raise ValueError(
            f"d_router: {n} floats do not fit one comb region ({plan.stream_rows * plan.hidden * plan.element_bytes} "
            "bytes, or n is not a multiple of 4), and a team with NVSHMEM peers has no other way to sum them; "
            "make the team with a larger max_tokens")
    if capturing:
        raise RuntimeError(
            f"d_router: {n} floats do not fit one comb region, and the host-launched sum that takes them instead "
            "cannot be captured in a CUDA graph; make the team with a larger max_tokens")
    status_checks.settle(back)
    return PeerExchange.from_team(team).all_reduce_sum(shares[0])


def _check_device_layout(counts: ForwardCounts, dtype: torch.dtype, device: torch.device, hidden: int,
                         intermediate: int) -> None:
    """Raise unless a backward can lay out its rows for the team's bound on the device (inside a capture):
    the forward's counts copied on the device, and grouped GEMMs that read their offsets there."""
    if counts.device is None:
        raise RuntimeError("a team's backward inside a CUDA-graph capture needs its forward's counts on the device: "
                           "capture the forward together with its backward")
    why = grouped_mm_supported(dtype, device, hidden, intermediate)
    if why:
        raise RuntimeError(f"a team's backward inside a CUDA-graph capture needs grouped GEMMs that read their "
                           f"offsets on the device, and {why}")


def _grid_percent() -> int:
    from flashdmoe.parallel.team import mps_thread_percentage

    percent = mps_thread_percentage()
    return 100 if percent is None else int(percent)
