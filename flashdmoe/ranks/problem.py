"""Seeded expert-parallel problems: every input of every rank made from one seed, piece by piece.

:class:`Problem` draws the tokens from one stream over all ranks and each expert from its own stream, so a
rank process builds exactly its own share, the parent rebuilds what every rank used, and the same total
problem split over a different number of ranks holds the same tokens and experts. Tokens too close to a
routing tie are redrawn (another summation order may route them differently).

:func:`reference_results` and :func:`expected_traffic` are what the ranks of a problem must return, from
:mod:`flashdmoe.reference`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flashdmoe import numerics, reference
from flashdmoe.parallel.team import MAX_RANKS

__all__ = [
    "DEFAULT_NEAR_TIE_GAP",
    "DTYPES",
    "Problem",
    "RankInputs",
    "expected_relay_traffic",
    "expected_traffic",
    "near_tie_rows",
    "reference_results",
    "split_tokens",
]

#: The problem dtypes, by the name a JSON spec carries.
DTYPES = {name: p.dtype for name, p in numerics.DTYPES.items() if p.kernel}
#: Tokens whose k-th and (k+1)-th router log-probabilities are closer than this are redrawn by
#: :class:`Problem` (a near-tie may legitimately route differently under another fp32 summation order).
DEFAULT_NEAR_TIE_GAP = 1e-3
_MAX_REDRAWS = 100


def split_tokens(total: int, world_size: int) -> list[int]:
    """``total`` tokens split over ``world_size`` ranks as evenly as possible (the first ranks get the
    remainder), e.g. ``split_tokens(10, 4) == [3, 3, 2, 2]``."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total={total!r}: expected an integer >= 0")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected an integer >= 1")
    base, extra = divmod(total, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def _generator(seed: int, *tags: object) -> torch.Generator:
    """A CPU generator seeded from ``(seed, *tags)`` (stable across processes and Python versions)."""
    text = "/".join(str(part) for part in (seed, *tags))
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(value)


def near_tie_rows(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, gap: float) -> torch.Tensor:
    """bool ``[T]``: rows of x ``[T, H]`` whose k-th and (k+1)-th router probabilities (fp32, as
    :func:`flashdmoe.reference.router_probs`) are within ``gap`` in log. All False when ``k == E``."""
    experts = router_weight.shape[0]
    if top_k >= experts or x.shape[0] == 0 or gap <= 0:
        return torch.zeros(x.shape[0], dtype=torch.bool)
    probs = reference.router_probs(x, router_weight)
    largest = torch.topk(probs.double(), top_k + 1, dim=-1).values
    return (torch.log(largest[:, top_k - 1]) - torch.log(largest[:, top_k])) < gap


@dataclass(frozen=True)
class RankInputs:
    """One rank's inputs, on the CPU in the problem's dtype.

    x ``[T_r, H]``; router_weight ``[E, H]`` (replicated); w1 ``[L, H, I or 2I]`` and w2 ``[L, I, H]``
    (this rank's experts ``[r * L, (r + 1) * L)``); dy ``[T_r, H]`` (the output gradient).
    """

    x: torch.Tensor
    router_weight: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    dy: torch.Tensor

    def to(self, device) -> "RankInputs":
        return RankInputs(*(t.to(device) for t in (self.x, self.router_weight, self.w1, self.w2, self.dy)))


def _int_field(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")


@dataclass(frozen=True)
class Problem:
    """An expert-parallel MoE problem made entirely from ``seed`` (JSON-able: :meth:`to_dict`).

    tokens: ``T_r`` per rank (its length is ``P``; 0 allowed); hidden ``H``; ffn ``I``; experts ``E``
    (a multiple of ``P``); top_k ``k``; activation, normalize_topk, capacity_factor as in
    :func:`flashdmoe.moe`; dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``.
    router_skew: ``(expert, scale)`` pairs: that router row is multiplied by ``scale`` (``> 1`` makes the
    expert win more often: skewed routing). near_tie_gap: tokens closer than this to a routing tie
    (log-probability gap between the k-th and (k+1)-th choice) are redrawn; ``0`` keeps them.

    Values: x ~ N(0, 1); router ~ N(0, 1/H); w1 ~ N(0, 1/H); w2 ~ N(0, 1/I); dy ~ N(0, 1); drawn in
    float32 on the CPU and rounded to ``dtype``.
    """

    tokens: tuple[int, ...]
    hidden: int
    ffn: int
    experts: int
    top_k: int
    activation: str = "gelu"
    normalize_topk: bool = True
    capacity_factor: float | None = None
    dtype: str = "bfloat16"
    seed: int = 0
    router_skew: tuple[tuple[int, float], ...] = ()
    near_tie_gap: float = DEFAULT_NEAR_TIE_GAP

    def __post_init__(self) -> None:
        tokens = self.tokens
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) or not 1 <= len(tokens) <= MAX_RANKS:
            raise ValueError(f"tokens={tokens!r}: expected a list of 1 to {MAX_RANKS} token counts, one per rank")
        for rank, count in enumerate(tokens):
            _int_field(f"tokens[{rank}]", count, 0)
        object.__setattr__(self, "tokens", tuple(tokens))
        for name in ("hidden", "ffn", "experts", "top_k"):
            _int_field(name, getattr(self, name), 1)
        _int_field("seed", self.seed, 0)
        if self.experts % len(tokens):
            raise ValueError(
                f"experts={self.experts}: expected a multiple of the number of ranks P={len(tokens)} (len(tokens))"
            )
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k}: expected 1 <= top_k <= experts ({self.experts})")
        if self.activation not in reference.ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: expected one of {reference.ACTIVATIONS}")
        if not isinstance(self.normalize_topk, bool):
            raise ValueError(f"normalize_topk={self.normalize_topk!r}: expected True or False")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf)
                               or cf <= 0):
            raise ValueError(f"capacity_factor={cf!r}: expected None or a finite number > 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {tuple(DTYPES)}")
        skew = []
        for item in self.router_skew:
            if not isinstance(item, Sequence) or len(item) != 2:
                raise ValueError(f"router_skew item {item!r}: expected an (expert, scale) pair")
            expert, scale = item
            if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < self.experts:
                raise ValueError(f"router_skew expert {expert!r}: expected an integer in [0, {self.experts})")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
                raise ValueError(f"router_skew scale {scale!r} (expert {expert}): expected a finite number > 0")
            skew.append((int(expert), float(scale)))
        object.__setattr__(self, "router_skew", tuple(skew))
        gap = self.near_tie_gap
        if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not math.isfinite(gap) or gap < 0:
            raise ValueError(f"near_tie_gap={gap!r}: expected a finite number >= 0")

    # ---- sizes ----
    @property
    def world_size(self) -> int:
        return len(self.tokens)

    @property
    def local_experts(self) -> int:
        return self.experts // self.world_size

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def w1_columns(self) -> int:
        return 2 * self.ffn if self.activation == "swiglu" else self.ffn

    def offsets(self) -> list[int]:
        """First row of each rank's tokens in the concatenation of all ranks' tokens."""
        out, start = [], 0
        for count in self.tokens:
            out.append(start)
            start += count
        return out

    def team_kwargs(self, max_tokens: int | None = None) -> dict[str, Any]:
        """Keyword arguments of :meth:`flashdmoe.parallel.team.Team.nvshmem` / ``emulated`` for this problem
        (``max_tokens`` defaults to the largest ``T_r``, at least 1); dtype given by name."""
        return {"max_tokens": max(1, max(self.tokens)) if max_tokens is None else max_tokens,
                "hidden": self.hidden, "top_k": self.top_k, "local_experts": self.local_experts,
                "dtype": self.dtype}

    def moe_kwargs(self) -> dict[str, Any]:
        return {"top_k": self.top_k, "activation": self.activation, "normalize_topk": self.normalize_topk,
                "capacity_factor": self.capacity_factor}

    # ---- JSON ----
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tokens"] = list(self.tokens)
        out["router_skew"] = [list(item) for item in self.router_skew]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Problem":
        if not isinstance(data, Mapping):
            raise ValueError(f"problem={data!r}: expected a mapping of Problem fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"problem: unknown fields {unknown}; expected some of {sorted(known)}")
        values = dict(data)
        values["tokens"] = tuple(values.get("tokens", ()))
        values["router_skew"] = tuple(tuple(item) for item in values.get("router_skew", ()))
        return cls(**values)

    def replace(self, **changes) -> "Problem":
        return dataclasses.replace(self, **changes)

    # ---- values ----
    def router_weight(self) -> torch.Tensor:
        """``[E, H]`` in the problem's dtype, skew applied."""
        router = torch.randn(self.experts, self.hidden, generator=_generator(self.seed, "router"))
        router /= math.sqrt(self.hidden)
        for expert, scale in self.router_skew:
            router[expert] *= scale
        return router.to(self.torch_dtype)

    def expert_weights(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global experts ``[first, first + count)``: w1 ``[count, H, I or 2I]``, w2 ``[count, I, H]``."""
        if not 0 <= first <= first + count <= self.experts:
            raise ValueError(f"experts [{first}, {first + count}): expected a range inside [0, {self.experts})")
        w1s, w2s = [], []
        for expert in range(first, first + count):
            generator = _generator(self.seed, "expert", expert)
            w1s.append(torch.randn(self.hidden, self.w1_columns, generator=generator) / math.sqrt(self.hidden))
            w2s.append(torch.randn(self.ffn, self.hidden, generator=generator) / math.sqrt(self.ffn))
        dtype = self.torch_dtype
        if not w1s:
            return (torch.empty(0, self.hidden, self.w1_columns, dtype=dtype),
                    torch.empty(0, self.ffn, self.hidden, dtype=dtype))
        return torch.stack(w1s).to(dtype), torch.stack(w2s).to(dtype)

    def shard(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s experts: w1 ``[L, H, .]``, w2 ``[L, I, H]``."""
        self._check_rank(rank)
        return self.expert_weights(rank * self.local_experts, self.local_experts)

    def all_tokens(self) -> torch.Tensor:
        """``[sum T_r, H]``: every rank's tokens, concatenated in rank order, near-ties redrawn."""
        total = self.total_tokens
        dtype = self.torch_dtype
        x = torch.randn(total, self.hidden, generator=_generator(self.seed, "x")).to(dtype)
        if self.near_tie_gap > 0 and total and self.top_k < self.experts:
            router = self.router_weight()
            redraw = _generator(self.seed, "x-redraw")
            for _ in range(_MAX_REDRAWS):
                ties = near_tie_rows(x, router, self.top_k, self.near_tie_gap)
                count = int(ties.sum())
                if count == 0:
                    break
                x[ties] = torch.randn(count, self.hidden, generator=redraw).to(dtype)
            else:
                raise RuntimeError(f"could not draw tokens without near-ties in {_MAX_REDRAWS} rounds; "
                                   f"lower near_tie_gap={self.near_tie_gap}")
        return x

    def all_output_grads(self) -> torch.Tensor:
        """``[sum T_r, H]``: every rank's output gradient ``dy``, concatenated in rank order."""
        return torch.randn(self.total_tokens, self.hidden, generator=_generator(self.seed, "dy")).to(self.torch_dtype)

    def rank_inputs(self, rank: int) -> RankInputs:
        self._check_rank(rank)
        start, count = self.offsets()[rank], self.tokens[rank]
        w1, w2 = self.shard(rank)
        return RankInputs(
            x=self.all_tokens()[start:start + count].contiguous(),
            router_weight=self.router_weight(),
            w1=w1, w2=w2,
            dy=self.all_output_grads()[start:start + count].contiguous(),
        )

    def all_inputs(self) -> list[RankInputs]:
        """Every rank's :class:`RankInputs` (made once; the same values :meth:`rank_inputs` gives)."""
        x, dy, router = self.all_tokens(), self.all_output_grads(), self.router_weight()
        out = []
        for rank, (start, count) in enumerate(zip(self.offsets(), self.tokens)):
            w1, w2 = self.shard(rank)
            out.append(RankInputs(x[start:start + count].contiguous(), router, w1, w2,
                                  dy[start:start + count].contiguous()))
        return out

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r}: expected an integer in [0, {self.world_size})")


def reference_results(problem: Problem) -> list[dict[str, torch.Tensor]]:
    """What every rank of ``forward_backward`` must return, from :func:`flashdmoe.reference.moe_expert_parallel`
    on the CPU in float32 (inputs are the problem's dtype-rounded values).

    One dict per rank: y ``[T_r, H]``, dx ``[T_r, H]``, d_router ``[E, H]`` (the gradient of the sum over
    ranks of ``<dy_r, y_r>``: the same on every rank), dw1 ``[L, H, .]``, dw2 ``[L, I, H]``; float32; plus
    experts ``[T_r, k]`` int64 and keep ``[T_r, k]`` bool (the routing).
    """
    inputs = problem.all_inputs()
    xs = [i.x.float().requires_grad_() for i in inputs]
    router = inputs[0].router_weight.float().requires_grad_()
    w1s = [i.w1.float().requires_grad_() for i in inputs]
    w2s = [i.w2.float().requires_grad_() for i in inputs]
    ys = reference.moe_expert_parallel(xs, router, w1s, w2s, **problem.moe_kwargs())
    loss = sum((y * i.dy.float()).sum() for y, i in zip(ys, inputs))
    loss.backward()
    out = []
    for rank, (x, y, w1, w2) in enumerate(zip(xs, ys, w1s, w2s)):
        routing = reference.route(x.detach(), router.detach(), problem.top_k, problem.normalize_topk)
        capacity = reference.expert_capacity(x.shape[0], problem.top_k, problem.experts, problem.capacity_factor)
        keep = reference.keep_mask(routing.experts, problem.experts, capacity)
        out.append({
            "y": y.detach(), "dx": x.grad.detach(), "d_router": router.grad.detach(),
            "dw1": w1.grad.detach(), "dw2": w2.grad.detach(), "experts": routing.experts, "keep": keep,
        })
    return out


def _kept_owners(problem: Problem) -> list[torch.Tensor]:
    """Per source rank, from the reference routing: ``[T, k]`` the owner rank of each choice, -1 where
    capacity dropped it."""
    inputs = problem.all_inputs()
    router = inputs[0].router_weight.float()
    owners = []
    for i in inputs:
        routing = reference.route(i.x.float(), router, problem.top_k, problem.normalize_topk)
        capacity = reference.expert_capacity(i.x.shape[0], problem.top_k, problem.experts, problem.capacity_factor)
        keep = reference.keep_mask(routing.experts, problem.experts, capacity)
        owners.append(torch.where(keep, routing.experts // problem.local_experts, -1))
    return owners


def _row_bytes(problem: Problem) -> int:
    return problem.hidden * torch.empty((), dtype=problem.torch_dtype).element_size()


def expected_traffic(problem: Problem, ranks_per_node: int | None = None) -> list[dict[str, int]]:
    """Per rank, from the reference routing: ``rows_routed_remote`` (this rank's kept choices whose expert
    lives on another rank), ``rows_computed_remote`` (kept choices of other ranks' tokens computed by this
    rank's experts) and the byte counts those rows make in the problem's dtype (``dispatch_bytes``,
    ``combine_bytes``) when only routed rows travel. With ``ranks_per_node`` (node-major ranks), also
    ``nvshmem_dispatch_bytes`` / ``nvshmem_combine_bytes``: the part of those to or from other nodes."""
    row_bytes = _row_bytes(problem)
    owner_rows = [[0] * problem.world_size for _ in range(problem.world_size)]  # [src][dst]
    for src, owners in enumerate(_kept_owners(problem)):
        for dst in range(problem.world_size):
            owner_rows[src][dst] = int((owners == dst).sum())
    out = []
    for rank in range(problem.world_size):
        sent = sum(owner_rows[rank][dst] for dst in range(problem.world_size) if dst != rank)
        computed = sum(owner_rows[src][rank] for src in range(problem.world_size) if src != rank)
        entry = {"rank": rank, "rows_routed_remote": sent, "rows_computed_remote": computed,
                 "dispatch_bytes": sent * row_bytes, "combine_bytes": computed * row_bytes}
        if ranks_per_node is not None:
            node = rank // ranks_per_node
            entry["nvshmem_dispatch_bytes"] = row_bytes * sum(
                owner_rows[rank][dst] for dst in range(problem.world_size) if dst // ranks_per_node != node)
            entry["nvshmem_combine_bytes"] = row_bytes * sum(
                owner_rows[src][rank] for src in range(problem.world_size) if src // ranks_per_node != node)
        out.append(entry)
    return out


def expected_relay_traffic(problem: Problem, ranks_per_node: int) -> list[dict[str, int]]:
    """Per rank, the forward's dispatch bytes under the hierarchical exchange (``Team.nvshmem(...,
    exchange="hierarchical")``, node-major ranks): ``batch_rows`` (its tokens' rows sent to other nodes:
    one per token and other node its kept choices reach), ``nvshmem_dispatch_bytes`` (those batches: a
    16-byte header, ``top_k`` 8-byte records and the row per batch row) and ``dispatch_bytes`` (the batches,
    its rows stored to the other owners on its node, and the rows it stored there as a relay)."""
    row_bytes = _row_bytes(problem)
    P, G = problem.world_size, ranks_per_node
    batch_rows = [0] * P
    batch_bytes = [0] * P
    stored = [0] * P  # rows a rank stores into other ranks' buffers on its own node
    for src, owners in enumerate(_kept_owners(problem)):
        node = src // G
        for t in range(owners.shape[0]):
            kept = [int(q) for q in owners[t] if q >= 0]
            stored[src] += sum(1 for q in kept if q // G == node and q != src)
            for b in sorted({q // G for q in kept} - {node}):
                relay = b * G + src % G
                batch_rows[src] += 1
                batch_bytes[src] += problem.top_k * 8 + row_bytes
                stored[relay] += sum(1 for q in kept if q // G == b and q != relay)
    out = []
    nodes = P // G
    for rank in range(P):
        headers = 16 * (nodes - 1)  # one per other node, an empty batch's too
        nvshmem = batch_bytes[rank] + headers
        out.append({"rank": rank, "batch_rows": batch_rows[rank], "nvshmem_dispatch_bytes": nvshmem,
                    "dispatch_bytes": nvshmem + stored[rank] * row_bytes})
    return out
