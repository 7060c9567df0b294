"""The unfused backward of the fused kernel across NVSHMEM ranks: the expert-parallel layer recomputed with
torch ops on the forward's fixed routing, its rows exchanged by writes into peers' symmetric memory. The
fused backend takes it only where :mod:`flashdmoe.backward.ep_backward` (the GPU backward with the rows moved by a
kernel) does not run: a peer reachable only by NVSHMEM puts, or ``FLASHDMOE_TEAM_BACKWARD=torch``.

:class:`PeerExchange` implements the exchange of :mod:`flashdmoe.parallel.ep_exchange` over a
:meth:`flashdmoe.parallel.team.Team.nvshmem` team (one process per rank):

* **Staging** is the team's symmetric ``recv`` buffer followed by its ``comb`` buffer (uint8, each
  ``P * stream_rows * H * elt`` bytes, ``elt`` the token dtype's size). Each buffer is ``P`` equal regions;
  region ``s`` of rank ``q``'s buffers holds what source ``s`` sent ``q``: a message's bytes fill region
  ``s`` of ``recv`` first and continue in region ``s`` of ``comb``. So one message may hold
  ``2 * stream_rows * H * elt`` bytes: ``stream_rows`` rows of the token dtype (the dispatched rows) and
  also ``stream_rows`` float32 rows (results and gradients travel in float32, like the reference computes).
  A message that does not fit raises ``ValueError`` naming the sizes.
* **Writes** go straight into the peers' memory through torch views of the peer addresses
  (``nvshmem.core.get_peer_tensor``): ordinary device copies on the current stream (NVLink / same-GPU
  load-store), no NVSHMEM RMA calls.
* **Ordering**: every exchange starts and ends with ``team.barrier()`` (``nvshmem barrier_all`` on the
  current stream): the start orders the writes after every rank's earlier kernels (a forward still reading
  its ``recv``/``comb``), the end orders every rank's reads before anyone's next writes or kernel. The
  backward therefore overwrites ``recv`` and ``comb``; nothing of the forward may live there.
* ``all_to_all``: each rank writes its message for ``q`` into ``q``'s region ``[rank]``, barrier, reads its
  own regions ``0..P-1``, barrier. ``all_reduce_sum``: each rank writes its tensor into every peer's region
  ``[rank]``, barrier, everyone sums regions ``0..P-1`` in rank order (float32 accumulation for 16-bit
  dtypes), barrier -- the same bits on every rank, run after run. A tensor larger than one message is
  reduced in chunks.

:func:`expert_parallel_backward` is the collective the fused backend's ``backward`` calls on every rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from flashdmoe import reference
from flashdmoe.parallel.ep_exchange import (
    TrafficCounter,
    agree_on_layer,
    check_fixed_routing,
    moe_over_exchange,
    row_bytes,
)
from flashdmoe.validation import ACTIVATIONS, validate_moe_inputs

__all__ = ["PeerExchange", "expert_parallel_backward"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_LAYER_FIELDS = ("hidden", "ffn", "experts", "top_k", "local_experts", "activation", "normalize_topk", "dtype")
# One int64 per field plus the status word: the agreement message every rank sends every rank.
_AGREEMENT_BYTES = 8 * (len(_LAYER_FIELDS) + 1)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (writes through it change ``tensor``)."""
    return tensor.reshape(-1).view(torch.uint8)


def _check_splits(name: str, splits, world_size: int) -> list[int]:
    splits = list(splits)
    if len(splits) != world_size or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in splits):
        raise ValueError(f"{name}={splits!r}: expected {world_size} integers >= 0 (one per rank)")
    return splits


class PeerExchange:
    """The exchange of :mod:`flashdmoe.parallel.ep_exchange` by writes into peers' memory (see the module docstring).

    Args:
        rank: this rank, ``0 <= rank < world_size``.
        world_size: ``P``.
        staging: ``P`` lists, ``staging[q]`` = rank ``q``'s staging buffers as this rank addresses them
            (``staging[rank]`` its own): 1-D uint8 tensors, the same number and the same sizes for every
            ``q`` (symmetric), each ``P`` equal regions (a remainder of ``size % P`` bytes is unused).
            Empty lists are allowed when ``P == 1``.
        barrier: called with no arguments; returns once every rank called it (ordered against the
            copies already issued on every side: ``team.barrier`` on the current CUDA stream, or a
            ``threading.Barrier``'s ``wait`` for in-process tests on CPU tensors).
        traffic: if given, accumulates the bytes ``all_to_all`` moved to and from other ranks.

    Attributes:
        region_bytes: bytes of one region of each staging buffer; ``capacity_bytes``: their sum, the largest
            message one rank may send another in one exchange.
    """

    def __init__(self, rank: int, world_size: int, staging: Sequence[Sequence[torch.Tensor]],
                 barrier: Callable[[], object], *, traffic: TrafficCounter | None = None) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: expected an integer >= 1")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r}: expected an integer in [0, {world_size})")
        if len(staging) != world_size:
            raise ValueError(f"staging: {len(staging)} entries; expected one list of buffers per rank ({world_size})")
        staging = [list(buffers) for buffers in staging]
        sizes = [t.numel() for t in staging[rank]]
        for q, buffers in enumerate(staging):
            if [t.numel() for t in buffers] != sizes:
                raise ValueError(f"staging[{q}]: buffer sizes {[t.numel() for t in buffers]}; expected {sizes} "
                                 "like this rank's own (symmetric buffers)")
            for t in buffers:
                if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
                    raise ValueError(f"staging[{q}]: expected contiguous 1-D uint8 tensors, got "
                                     f"{t.dtype} of shape {list(t.shape)}")
        if world_size > 1 and not sizes:
            raise ValueError("staging: no buffers; a team of several ranks needs at least one")
        self.rank = rank
        self.world_size = world_size
        self.staging = staging
        self.barrier = barrier
        self.traffic = traffic
        self.device = staging[rank][0].device if staging[rank] else torch.device("cpu")
        self.region_bytes = [size // world_size for size in sizes]
        self.capacity_bytes = sum(self.region_bytes)

    # ---- building from a team ----
    @classmethod
    def from_team(cls, team, *, traffic: TrafficCounter | None = None) -> PeerExchange:
        """The exchange of this process's rank of ``team`` (a ``Team.nvshmem`` team, or ``Team.single()``).

        Staging = the rank's symmetric ``recv`` then ``comb`` buffer; peers' buffers are reached through
        ``nvshmem.core.get_peer_tensor`` (views built once per team and cached).
        """
        for attribute in ("transport", "rank", "world_size", "buffers", "barrier", "require_usable"):
            if not hasattr(team, attribute):
                raise ValueError(f"team: {type(team).__name__} has no {attribute!r}; expected a "
                                 "flashdmoe.parallel.team.Team")
        team.require_usable()
        if team.transport == "single":
            return cls(0, 1, [[]], team.barrier, traffic=traffic)
        if team.transport != "nvshmem":
            raise ValueError(f"team: transport {team.transport!r}; the peer exchange runs one process per rank "
                             "(Team.nvshmem) or a single rank (Team.single)")
        own = team.buffers[0]
        cached = _STAGING_CACHE.get(team)
        if cached is None or cached[0] != own.recv.data_ptr():
            staging = []
            for q in range(team.world_size):
                if q == team.rank:
                    staging.append([own.recv, own.comb])
                    continue
                expected = [own.mapped_recv[q], own.mapped_comb[q]]
                if None in expected:
                    raise RuntimeError(
                        f"rank {team.rank}: rank {q} is reached by NVSHMEM puts only (no load/store mapping of "
                        "its buffers, as across nodes); the torch-ops backward needs every peer mapped (NVLink "
                        "or the same GPU). The device exchange (flashdmoe.backward.ep_backward, the NVSHMEM kernel "
                        "build, bf16/fp16) reaches such peers")
                views = [_peer_tensor(own.recv, q), _peer_tensor(own.comb, q)]
                if any(v is None for v in views) or [v.data_ptr() for v in views] != expected:
                    raise RuntimeError(
                        f"rank {team.rank}: the peer views of rank {q}'s recv/comb are at "
                        f"{[None if v is None else hex(v.data_ptr()) for v in views]}, but the team holds "
                        f"{[hex(a) for a in expected]}")
                staging.append([v.reshape(-1).view(torch.uint8) for v in views])
            cached = (own.recv.data_ptr(), staging)
            _STAGING_CACHE[team] = cached
        return cls(team.rank, team.world_size, cached[1], team.barrier, traffic=traffic)

    # ---- staging layout: a message from `source` lives in region `source` of recv, then of comb ----
    def _pieces(self, source: int, nbytes: int):
        """(buffer index, start byte, length) of the pieces of a message of ``nbytes`` from ``source``."""
        pieces, done = [], 0
        for index, region in enumerate(self.region_bytes):
            if done >= nbytes:
                break
            take = min(region, nbytes - done)
            pieces.append((index, source * region, take))
            done += take
        return pieces

    def _check_fits(self, what: str, nbytes: int, peer: int) -> None:
        if nbytes > self.capacity_bytes:
            raise ValueError(
                f"{what}: a message of {nbytes} bytes between rank {self.rank} and rank {peer} does not fit "
                f"the staging area ({self.capacity_bytes} bytes per (source, destination) pair: regions of "
                f"{self.region_bytes} bytes of the team's recv/comb buffers); make the team with a larger "
                "max_tokens")

    def _write(self, peer: int, data: torch.Tensor) -> None:
        """Copy the bytes ``data`` into ``peer``'s regions ``[self.rank]``."""
        done = 0
        for index, start, length in self._pieces(self.rank, data.numel()):
            self.staging[peer][index][start:start + length].copy_(data[done:done + length])
            done += length

    def _read(self, source: int, out: torch.Tensor) -> None:
        """Copy what ``source`` wrote into this rank's regions ``[source]`` into the bytes ``out``."""
        done = 0
        for index, start, length in self._pieces(source, out.numel()):
            out[done:done + length].copy_(self.staging[self.rank][index][start:start + length])
            done += length

    # ---- the two collectives ----
    def all_to_all(self, tensor: torch.Tensor, output_splits, input_splits) -> torch.Tensor:
        """Rows of ``tensor [sum(input_splits), ...]`` (any dtype) to every rank; returns
        ``[sum(output_splits), ...]`` in ``tensor``'s dtype, the rows from rank 0 first.

        ``output_splits[s]`` must be what rank ``s`` passes as ``input_splits[this rank]``.
        """
        rank, world_size = self.rank, self.world_size
        input_splits = _check_splits("input_splits", input_splits, world_size)
        output_splits = _check_splits("output_splits", output_splits, world_size)
        if tensor.dim() < 1 or tensor.shape[0] != sum(input_splits):
            raise ValueError(f"tensor: shape {list(tensor.shape)}; expected {sum(input_splits)} rows "
                             f"(sum of input_splits={input_splits})")
        if input_splits[rank] != output_splits[rank]:
            raise ValueError(f"input_splits[{rank}]={input_splits[rank]} (rows this rank sends itself) differs "
                             f"from output_splits[{rank}]={output_splits[rank]}")
        tensor = tensor.contiguous()
        size = row_bytes(tensor)
        for q in range(world_size):
            if q != rank:
                self._check_fits("all_to_all", input_splits[q] * size, q)
                self._check_fits("all_to_all", output_splits[q] * size, q)
        output = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        sent, received = _as_bytes(tensor), _as_bytes(output)
        in_offsets = [size * sum(input_splits[:q]) for q in range(world_size)]
        out_offsets = [size * sum(output_splits[:q]) for q in range(world_size)]

        own_bytes = size * input_splits[rank]
        received[out_offsets[rank]:out_offsets[rank] + own_bytes].copy_(
            sent[in_offsets[rank]:in_offsets[rank] + own_bytes])
        if world_size > 1:
            self.barrier()
            for step in range(1, world_size):  # rank r writes to r+1 first: spread over the links
                q = (rank + step) % world_size
                self._write(q, sent[in_offsets[q]:in_offsets[q] + size * input_splits[q]])
            self.barrier()
            for step in range(1, world_size):
                s = (rank + step) % world_size
                self._read(s, received[out_offsets[s]:out_offsets[s] + size * output_splits[s]])
            self.barrier()
        if self.traffic is not None:
            self.traffic.bytes_sent += size * (sum(input_splits) - input_splits[rank])
            self.traffic.bytes_received += size * (sum(output_splits) - output_splits[rank])
        return output

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``tensor`` (same shape and dtype on every rank), in rank order 0..P-1
        (float32 accumulation for 16-bit floats); a new tensor of ``tensor``'s shape and dtype, bitwise
        the same on every rank."""
        tensor = tensor.contiguous()
        accumulate = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype
        flat = tensor.reshape(-1)
        if self.world_size == 1:
            return tensor.clone()
        per_chunk = self.capacity_bytes // tensor.element_size()
        if per_chunk == 0:
            self._check_fits("all_reduce_sum", tensor.element_size(), (self.rank + 1) % self.world_size)
        total = torch.empty(flat.numel(), dtype=accumulate, device=tensor.device)
        for start in range(0, flat.numel(), per_chunk):
            part = flat[start:start + per_chunk]
            self.barrier()
            for step in range(1, self.world_size):
                self._write((self.rank + step) % self.world_size, _as_bytes(part))
            self.barrier()
            acc = None
            for source in range(self.world_size):  # fixed order: the same bits on every rank
                if source == self.rank:
                    piece = part
                else:
                    piece = torch.empty_like(part)
                    self._read(source, _as_bytes(piece))
                acc = piece.to(accumulate, copy=True) if acc is None else acc.add_(piece.to(accumulate))
            total[start:start + part.numel()] = acc
            self.barrier()
        return total.to(tensor.dtype).view(tensor.shape)


#: team -> (own recv address, staging views); weak so a dropped team frees its views.
_STAGING_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _peer_tensor(tensor: torch.Tensor, peer: int):
    """``tensor``'s symmetric counterpart on ``peer`` as this process addresses it (None: no load/store path)."""
    import nvshmem.core

    return nvshmem.core.get_peer_tensor(tensor, peer)


# ----------------------------------------------------------------------------------------------------------
# The backward
# ----------------------------------------------------------------------------------------------------------


def _check_static_capacity(exchange: PeerExchange, plan, x_dtype: torch.dtype, hidden: int, local_experts: int,
                           world_size: int) -> None:
    """Raise ``ValueError`` (on every rank alike: only team-wide quantities enter) if the largest message
    the backward can send one peer does not fit the staging area."""
    if world_size == 1:
        return
    compute_size = torch.empty((), dtype=reference.compute_dtype(x_dtype)).element_size()
    element = max(torch.empty((), dtype=x_dtype).element_size(), compute_size)
    messages = {
        "the layer check": _AGREEMENT_BYTES,
        "the per-expert row counts": 8 * local_experts,
        # at most min(k, L) of a token's k distinct choices go to one rank
        "the rows, results or gradients of one rank pair": plan.stream_rows * hidden * element,
    }
    for what, nbytes in messages.items():
        if nbytes > exchange.capacity_bytes:
            raise ValueError(
                f"team: {what} may need {nbytes} bytes per rank pair, but the staging area (the team's recv "
                f"and comb regions) holds {exchange.capacity_bytes}; make the team with a larger max_tokens")


def expert_parallel_backward(team, x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor,
                             w2: torch.Tensor, expert: torch.Tensor, keep: torch.Tensor, dy: torch.Tensor, *,
                             activation: str, normalize_topk: bool,
                             needs_input_grad: Sequence[bool] = (True, True, True, True),
                             traffic: TrafficCounter | None = None):
    """Gradients of the expert-parallel MoE layer on a fixed routing; a collective over ``team``.

    Every rank of ``team`` calls it, in the same order relative to its other collectives. With
    ``y_r = moe(x_r)`` on the fixed routing -- combine weights ``softmax(x_r @ router_weight.T)`` gathered
    at ``expert`` (renormalised over the ``k`` choices when ``normalize_topk``), dropped choices
    (``keep`` False) contributing 0 -- it differentiates ``sum over ranks r of <dy_r, y_r>``. Semantics of
    :func:`flashdmoe.reference.moe_fixed_routing` with all experts on one rank.

    Args:
        team: a :meth:`flashdmoe.parallel.team.Team.nvshmem` team (this process's rank), or ``Team.single()``.
            Its ``recv`` and ``comb`` buffers are overwritten (staging).
        x: ``[T, H]`` this rank's tokens, ``T <= team.plan.max_tokens`` (0 allowed); float (bf16/fp16 on
            the GPU), contiguous.
        router_weight: ``[E, H]`` the replicated router, ``x``'s dtype and device.
        w1: ``[L, H, I]`` (``[L, H, 2I]`` for swiglu), w2: ``[L, I, H]``: this rank's experts
            ``[rank * L, (rank + 1) * L)``, ``E = L * P``; ``x``'s dtype and device.
        expert: ``[T, k]`` int32 or int64, the chosen global experts (distinct per row, in ``[0, E)``).
        keep: ``[T, k]`` bool, False where the capacity limit dropped the choice.
        dy: ``[T, H]`` the gradient of this rank's output, any float dtype, ``x``'s device.
        activation: ``"relu"``, ``"gelu"``, ``"silu"`` or ``"swiglu"``.
        normalize_topk: whether the combine weights were renormalised over the ``k`` choices.
        needs_input_grad: four bools, which of ``(dx, d_router, dw1, dw2)`` to return.
        traffic: if given, accumulates the bytes moved to and from other ranks.

    Returns:
        ``(dx [T, H] x.dtype, d_router [E, H] router_weight.dtype, dw1 w1's shape/dtype, dw2 w2's
        shape/dtype)``, ``None`` where not requested. ``d_router`` is the sum over all ranks, summed in rank
        order: bitwise the same on every rank. ``dw1``/``dw2`` are this rank's shard gradients.

    Raises:
        ValueError: bad input naming the argument -- raised on *every* rank (each rank's checks are shared
            before any row moves), as are different layers on different ranks or messages too large for the
            team's buffers.
        flashdmoe.parallel.team.TeamFailed: the team failed or was closed earlier. An error in the middle of the
            exchanges marks the team failed (ranks may be out of step).
        RuntimeError: a peer is reached by NVSHMEM puts only (no mapping, as across nodes); raised before
            any exchange, on every rank of such a team.
    """
    exchange = PeerExchange.from_team(team, traffic=traffic)
    world_size, rank = exchange.world_size, exchange.rank

    error, values, sizes, needs = None, None, None, None
    try:
        if not isinstance(normalize_topk, bool):
            raise ValueError(f"normalize_topk={normalize_topk!r}: expected True or False")
        needs = tuple(needs_input_grad) if isinstance(needs_input_grad, (tuple, list)) else None
        if needs is None or len(needs) != 4 or not all(isinstance(n, bool) for n in needs):
            raise ValueError(f"needs_input_grad={needs_input_grad!r}: expected four bools "
                             "(dx, d_router, dw1, dw2)")
        if not isinstance(expert, torch.Tensor) or expert.dim() != 2:
            raise ValueError(f"expert: expected a [T, k] tensor, got "
                             f"{list(expert.shape) if isinstance(expert, torch.Tensor) else type(expert).__name__}")
        top_k = expert.shape[1]
        sizes = validate_moe_inputs(x, router_weight, w1, w2, top_k=max(top_k, 1), activation=activation,
                                    capacity_factor=None, world_size=world_size)
        expert = check_fixed_routing(expert, keep, sizes.tokens, None, sizes.experts, x.device)
        if not isinstance(dy, torch.Tensor) or tuple(dy.shape) != (sizes.tokens, sizes.hidden) \
                or not dy.is_floating_point() or dy.device != x.device:
            raise ValueError(f"dy: expected a float tensor [T={sizes.tokens}, H={sizes.hidden}] on {x.device}, got "
                             + (f"{dy.dtype} {list(dy.shape)} on {dy.device}" if isinstance(dy, torch.Tensor)
                                else type(dy).__name__))
        plan = team.plan
        if world_size > 1:
            if sizes.tokens > plan.max_tokens:
                raise ValueError(f"x (rank {rank}): {sizes.tokens} tokens, but the team's buffers were sized for "
                                 f"max_tokens={plan.max_tokens} per rank")
            for name, got, want in (("x: hidden", sizes.hidden, plan.hidden), ("expert: top_k", top_k, plan.top_k),
                                    ("w1: local experts", sizes.local_experts, plan.local_experts)):
                if got != want:
                    raise ValueError(f"{name} is {got} (rank {rank}), but the team's buffers were sized for {want}")
        values = [sizes.hidden, sizes.ffn, sizes.experts, top_k, sizes.local_experts,
                  ACTIVATIONS.index(activation), int(normalize_topk), _DTYPES.index(x.dtype)]
    except ValueError as caught:
        error = caught
    agree_on_layer(exchange, error, _LAYER_FIELDS, values)
    _check_static_capacity(exchange, team.plan, x.dtype, sizes.hidden, sizes.local_experts, world_size)

    try:
        return _backward(exchange, x, router_weight, w1, w2, expert, keep, dy, activation=activation,
                         normalize_topk=normalize_topk, needs=needs)
    except BaseException as caught:
        # The ranks may now be out of step (barriers issued by some and not others): never reuse the team.
        if hasattr(team, "mark_failed") and world_size > 1:
            team.mark_failed(f"expert_parallel_backward raised on rank {rank}: {caught!r}")
        raise


def _backward(exchange: PeerExchange, x, router_weight, w1, w2, expert, keep, dy, *, activation: str,
              normalize_topk: bool, needs: tuple[bool, bool, bool, bool]):
    """Recompute the layer on the fixed routing with a graph and differentiate ``<dy, y>``."""
    compute_dtype = reference.compute_dtype(x.dtype)
    with torch.enable_grad():
        x_leaf = x.detach().requires_grad_(needs[0])
        # float32 router leaf: every rank's contribution is summed unrounded, rounded once at the end
        router_leaf = router_weight.detach().to(compute_dtype).requires_grad_(needs[1])
        w1_leaf = w1.detach().requires_grad_(needs[2])
        w2_leaf = w2.detach().requires_grad_(needs[3])
        y, _, _, anchor = moe_over_exchange(
            exchange, x_leaf, router_leaf, w1_leaf, w2_leaf, top_k=expert.shape[1], activation=activation,
            normalize_topk=normalize_topk, experts=expert, keep=keep)
        leaves = (x_leaf, router_leaf, w1_leaf, w2_leaf)
        wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        # The anchor makes every rank run every collective of the backward (the row-gradient exchange and
        # the router all-reduce) whatever it needs itself.
        grads = list(torch.autograd.grad([y], [anchor] + wanted, grad_outputs=[dy.to(y.dtype)],
                                         allow_unused=True))[1:]
    results = []
    for leaf, need, like in zip(leaves, needs, (x, router_weight, w1, w2)):
        if not need:
            results.append(None)
            continue
        grad = grads.pop(0)
        grad = torch.zeros_like(leaf) if grad is None else grad
        results.append(grad.to(like.dtype))
    return tuple(results)

