"""Several ranks as separate processes on one GPU, under CUDA MPS (DESIGN.md §4): the harness behind the
multi-process tests and the ``expert-parallel`` benchmark's MPS rows.

Parent side (:func:`run_ranks`; it never touches CUDA itself, so it may run before or beside other GPU
work): it starts an MPS control daemon (:class:`flashdmoe.mps.MpsDaemon`) unless given one or told not
to, writes one JSON spec per rank into a fresh temporary directory and starts ``P`` children::

    python -m flashdmoe.multiprocess <workdir>/rank<r>.spec.json

each with ``MpsDaemon.client_env(100 // P)`` (so the ranks' persistent kernels fit on the GPU at once).
It then waits for them with a timeout, kills the ones still running when the time is up (or a while after
another rank failed), and collects every rank's results.

Child side (:func:`main`): loads the CUDA extension, then rank 0 makes the NVSHMEM unique id
(:meth:`flashdmoe.team.Team.make_unique_id`: only a process with nvshmem can) and publishes it as
``<workdir>/uid.bin`` by an atomic rename; the other ranks poll for that file (bounded wait, then a clear
error; they stop early when rank 0 reports a failure). Every rank joins the team
(:meth:`Team.nvshmem <flashdmoe.team.Team.nvshmem>`), meets the others at a barrier, runs the named
scenario and writes ``rank<r>.pt`` (``torch.save`` of CPU tensors) and ``rank<r>.status.json`` (``"ok"``
with the scenario's JSON info, or the exception's type, message and traceback). ``rank<r>.phase.json``
always holds the step the rank is in, so a hang is reported with where it hung.

Scenarios (``SCENARIOS``, or ``"package.module:function"`` for one defined elsewhere):

* ``forward_backward``: seeded inputs (:class:`Problem`), ``flashdmoe.moe(..., team=team, backend="cuda")``
  and ``loss.backward()`` on a seeded ``dy``; returns y, dx, d_router, dw1, dw2 and the forward's
  ``cuda_backend.last_traffic``.
* ``timeout``: ``cuda_backend.debug.silent_rank`` and a short watchdog; returns the exception each rank saw,
  whether the team is marked failed, and what a further call raised.
* ``bench``: timed forwards (CUDA events, :func:`flashdmoe.bench.timing.measure`) inside
  ``cuda_backend.deferred_status_checks()``; returns the per-run samples and the traffic of one checked run.
* ``nccl_bench``: no NVSHMEM; the unfused baseline of the ``multi-gpu`` benchmark over ``torch.distributed``
  (NCCL on ``cuda:<device>``, or gloo on the CPU), timed like ``bench`` and checked against the reference.
* ``selftest``: no NVSHMEM and no GPU; exercises the harness itself (unique-id exchange, errors, hangs,
  crashes) so it can be tested on a CPU machine.

:class:`Problem` makes every input from a seed, piece by piece (tokens from one stream over all ranks,
each expert from its own stream), so the parent can rebuild exactly what the children used, and the same
total problem split over different ``P`` holds the same tokens and experts.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashdmoe import reference
from flashdmoe.team import MAX_RANKS, UNIQUE_ID_BYTES

__all__ = [
    "Problem",
    "RankContext",
    "RankInputs",
    "RankOutcome",
    "RanksFailed",
    "RunResult",
    "SCENARIOS",
    "ScenarioOutput",
    "expected_traffic",
    "main",
    "near_tie_rows",
    "nvshmem_unavailable_reason",
    "reference_results",
    "resolve_scenario",
    "run_ranks",
    "split_tokens",
]

SPEC_VERSION = 1
#: Set in every child's environment (DESIGN.md §4: NVLink multicast stays off).
NVLS_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Tokens whose k-th and (k+1)-th router log-probabilities are closer than this are redrawn by
#: :class:`Problem` (a near-tie may legitimately route differently under another fp32 summation order).
DEFAULT_NEAR_TIE_GAP = 1e-3
_MAX_REDRAWS = 100

UID_FILE = "uid.bin"
LOG_TAIL_LINES = 40


# ------------------------------------------------------------------------------------------------------------
# Seeded problems


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
        """Keyword arguments of :meth:`flashdmoe.team.Team.nvshmem` / ``emulated`` for this problem
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


def expected_traffic(problem: Problem) -> list[dict[str, int]]:
    """Per rank, from the reference routing: ``rows_routed_remote`` (this rank's kept choices whose expert
    lives on another rank), ``rows_computed_remote`` (kept choices of other ranks' tokens computed by this
    rank's experts) and the byte counts those rows make in the problem's dtype (``dispatch_bytes``,
    ``combine_bytes``) when only routed rows travel."""
    inputs = problem.all_inputs()
    router = inputs[0].router_weight.float()
    element = torch.empty((), dtype=problem.torch_dtype).element_size()
    row_bytes = problem.hidden * element
    owner_rows = [[0] * problem.world_size for _ in range(problem.world_size)]  # [src][dst]
    for src, i in enumerate(inputs):
        routing = reference.route(i.x.float(), router, problem.top_k, problem.normalize_topk)
        capacity = reference.expert_capacity(i.x.shape[0], problem.top_k, problem.experts, problem.capacity_factor)
        keep = reference.keep_mask(routing.experts, problem.experts, capacity)
        owners = routing.experts[keep] // problem.local_experts
        for dst in range(problem.world_size):
            owner_rows[src][dst] = int((owners == dst).sum())
    out = []
    for rank in range(problem.world_size):
        sent = sum(owner_rows[rank][dst] for dst in range(problem.world_size) if dst != rank)
        computed = sum(owner_rows[src][rank] for src in range(problem.world_size) if src != rank)
        out.append({"rank": rank, "rows_routed_remote": sent, "rows_computed_remote": computed,
                    "dispatch_bytes": sent * row_bytes, "combine_bytes": computed * row_bytes})
    return out


# ------------------------------------------------------------------------------------------------------------
# Child side


@dataclass
class RankContext:
    """What a scenario function receives in a child process.

    rank / world_size: this process's rank of ``P``; params: the scenario's JSON parameters; team: the
    :class:`flashdmoe.team.Team` (``None`` when the run has no NVSHMEM team); device: the CUDA device
    (``None`` without a team); workdir: the run's directory; spec: the whole spec.
    """

    rank: int
    world_size: int
    params: dict[str, Any]
    team: Any
    device: torch.device | None
    workdir: Path
    spec: dict[str, Any]
    uid: bytes = b""
    current_phase: str = ""

    def phase(self, text: str) -> None:
        """Record the step this rank is in (shown if the rank hangs or fails)."""
        self.current_phase = text
        _write_json(self.workdir / f"rank{self.rank}.phase.json", {"phase": text, "time": time.time()})


@dataclass
class ScenarioOutput:
    """A scenario's results: tensors (moved to the CPU and ``torch.save``-d) and JSON-able info."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_jsonable))
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return repr(value)


def _error_info(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "module": type(error).__module__, "message": str(error)}


def _publish_uid(workdir: Path, data: bytes) -> None:
    tmp = workdir / f".{UID_FILE}.{os.getpid()}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, workdir / UID_FILE)  # atomic: a reader sees the whole id or no file


def _wait_for_uid(workdir: Path, timeout_s: float, poll_s: float = 0.05) -> bytes:
    path = workdir / UID_FILE
    rank0_status = workdir / "rank0.status.json"
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists():
            data = path.read_bytes()
            if len(data) != UNIQUE_ID_BYTES:
                raise RuntimeError(f"{path} holds {len(data)} bytes; expected a {UNIQUE_ID_BYTES}-byte unique id")
            return data
        if rank0_status.exists():
            try:
                status = json.loads(rank0_status.read_text())
                why = f"{status.get('error_type')}: {status.get('error_message')}"
            except (OSError, ValueError):
                why = "its status file is unreadable"
            raise RuntimeError(f"rank 0 finished without publishing the unique id ({why})")
        if time.monotonic() >= deadline:
            phase = _read_json(workdir / "rank0.phase.json") or {}
            raise TimeoutError(
                f"no unique id from rank 0 at {path} after {timeout_s:g} s "
                f"(rank 0's last phase: {phase.get('phase', 'unknown: it never started')!r})"
            )
        time.sleep(poll_s)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def resolve_scenario(name: str) -> Callable[[RankContext], Any]:
    """A registered scenario name, or ``"package.module:function"``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"scenario={name!r}: expected one of {sorted(SCENARIOS)} or 'module:function'")
    if name in SCENARIOS:
        return SCENARIOS[name]
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        function = getattr(importlib.import_module(module_name), attribute, None)
        if callable(function):
            return function
    raise ValueError(f"scenario={name!r}: expected one of {sorted(SCENARIOS)} or an importable 'module:function'")


def _run_child(spec: dict[str, Any]) -> int:
    """Everything a child does; returns its exit code (results and errors go to files in the workdir)."""
    rank, world_size = spec["rank"], spec["world_size"]
    workdir = Path(spec["workdir"])
    context = RankContext(rank, world_size, dict(spec.get("params") or {}), None, None, workdir, spec)
    context.phase("starting")
    team = None
    code = 0
    try:
        for name, value in NVLS_ENV.items():
            os.environ.setdefault(name, value)
        scenario = resolve_scenario(spec["scenario"])
        uid_timeout_s = float(spec.get("uid_timeout_s", 120.0))
        if spec.get("nvshmem", True):
            from flashdmoe import extension
            from flashdmoe.team import Team

            context.device = torch.device("cuda", int(spec.get("device", 0)))
            torch.cuda.set_device(context.device)
            # Before the team: a rank that builds or loads the extension must not keep peers spinning
            # inside the collective init, nor inside the first kernel's watchdog.
            context.phase("loading the CUDA extension")
            extension.load()
            if rank == 0:
                context.phase("making the unique id")
                uid = Team.make_unique_id()
                _publish_uid(workdir, uid)
            else:
                context.phase("waiting for rank 0's unique id")
                uid = _wait_for_uid(workdir, uid_timeout_s)
            context.uid = uid
            sizes = dict(spec["team"])
            sizes["dtype"] = DTYPES[sizes["dtype"]]
            context.phase("joining the NVSHMEM team (collective)")
            team = Team.nvshmem(uid, rank, world_size, device=context.device, **sizes)
            context.team = team
            context.phase("barrier after joining the team")
            team.barrier()
            _synchronize(context.device)
        else:
            if rank == 0:
                context.uid = os.urandom(UNIQUE_ID_BYTES)
                _publish_uid(workdir, context.uid)
            else:
                context.phase("waiting for rank 0's unique id")
                context.uid = _wait_for_uid(workdir, uid_timeout_s)
        context.phase(f"scenario {spec['scenario']}")
        output = scenario(context)
        if isinstance(output, dict):
            output = ScenarioOutput(info=output)
        if not isinstance(output, ScenarioOutput):
            raise TypeError(f"scenario {spec['scenario']!r} returned {type(output).__name__}; "
                            "expected ScenarioOutput or a dict")
        context.phase("writing results")
        tensors = {name: t.detach().cpu() for name, t in output.tensors.items()}
        tmp = workdir / f".rank{rank}.pt.tmp"
        torch.save(tensors, tmp)
        os.replace(tmp, workdir / f"rank{rank}.pt")
        _write_json(workdir / f"rank{rank}.status.json", {"rank": rank, "status": "ok", "info": output.info})
    except BaseException as error:  # reported to the parent, whatever it was
        code = 1
        _write_json(workdir / f"rank{rank}.status.json", {
            "rank": rank, "status": "error", "error_type": type(error).__name__,
            "error_module": type(error).__module__, "error_message": str(error),
            "traceback": traceback.format_exc(), "phase": context.current_phase,
        })
    if team is not None:
        context.phase("closing the team")
        try:
            team.close()
        except BaseException as error:
            code = code or 3
            _write_json(workdir / f"rank{rank}.teardown.json", _error_info(error) | {"traceback": traceback.format_exc()})
    context.phase("exiting")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flashdmoe.multiprocess SPEC.json``: run one rank as the spec says (see the module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m flashdmoe.multiprocess SPEC.json (written by flashdmoe.multiprocess.run_ranks)",
              file=sys.stderr)
        return 2
    try:
        spec = json.loads(Path(argv[0]).read_text())
        if spec.get("version") != SPEC_VERSION:
            raise ValueError(f"spec version {spec.get('version')!r}: expected {SPEC_VERSION}")
        for key in ("rank", "world_size", "workdir", "scenario"):
            if key not in spec:
                raise ValueError(f"spec: missing {key!r}")
    except (OSError, ValueError) as error:
        print(f"flashdmoe.multiprocess: bad spec {argv[0]}: {error}", file=sys.stderr)
        return 2
    return _run_child(spec)


# ------------------------------------------------------------------------------------------------------------
# Scenarios


def _moe_call(problem: Problem, context: RankContext, x, router, w1, w2):
    import flashdmoe

    return flashdmoe.moe(x, router, w1, w2, team=context.team, backend="cuda", **problem.moe_kwargs())


def _synchronize(device: torch.device | None) -> None:
    """Wait for this rank's GPU work (scenarios also run on the CPU with a stand-in team in tests)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _traffic_now() -> list[dict[str, Any]]:
    from flashdmoe import cuda_backend

    return copy.deepcopy(list(getattr(cuda_backend, "last_traffic", None) or []))


def scenario_forward_backward(context: RankContext) -> ScenarioOutput:
    """params: ``problem`` (:meth:`Problem.to_dict`), ``iterations`` (default 2: forward + backward
    repeated, checking that signals work back to back and that y is bitwise repeatable).

    Returns tensors y ``[T_r, H]``, dx ``[T_r, H]``, d_router ``[E, H]``, dw1 ``[L, H, .]``, dw2 ``[L, I, H]``
    (the problem's dtype; y of the first iteration, gradients of the last) and info ``traffic`` (the
    first forward's ``cuda_backend.last_traffic``), ``repeat_identical`` (every iteration's y equal to
    the first bit for bit), ``grads_repeat_identical``, ``missing_grads`` (leaves whose ``.grad`` stayed
    None; filled with zeros in the tensors).
    """
    problem = Problem.from_dict(context.params["problem"])
    iterations = int(context.params.get("iterations", 2))
    if iterations < 1:
        raise ValueError(f"iterations={iterations}: expected >= 1")
    inputs = problem.rank_inputs(context.rank).to(context.device)
    names = ("dx", "d_router", "dw1", "dw2")
    first_y = first_grads = traffic = None
    repeat_identical = grads_identical = True
    missing: list[str] = []
    for iteration in range(iterations):
        leaves = [t.detach().clone().requires_grad_()
                  for t in (inputs.x, inputs.router_weight, inputs.w1, inputs.w2)]
        context.phase(f"forward {iteration}")
        y = _moe_call(problem, context, *leaves)
        if iteration == 0:
            traffic = _traffic_now()
        loss = (y.float() * inputs.dy.float()).sum()
        context.phase(f"backward {iteration}")
        loss.backward()
        _synchronize(context.device)
        grads = []
        for name, leaf in zip(names, leaves):
            if leaf.grad is None:
                if name not in missing:
                    missing.append(name)
                grads.append(torch.zeros_like(leaf))
            else:
                grads.append(leaf.grad.detach())
        y = y.detach()
        if iteration == 0:
            first_y, first_grads = y, grads
        else:
            repeat_identical &= torch.equal(first_y, y)
            grads_identical &= all(torch.equal(a, b) for a, b in zip(first_grads, grads))
    tensors = {"y": first_y} | dict(zip(names, grads))
    return ScenarioOutput(tensors, {
        "traffic": traffic, "iterations": iterations, "repeat_identical": bool(repeat_identical),
        "grads_repeat_identical": bool(grads_identical), "missing_grads": missing,
    })


def scenario_timeout(context: RankContext) -> ScenarioOutput:
    """params: ``problem``, ``silent_rank`` (its signals are never published), ``timeout_ms`` (default 2000).

    Returns info ``error`` (type/module/message of what the forward raised; type None if nothing),
    ``elapsed_s`` (of that forward), ``team_failed`` (``team.failed`` afterwards) and ``second_call_error``
    (what a further forward on the same team raised: it must be ``TeamFailed``).
    """
    from flashdmoe import cuda_backend

    problem = Problem.from_dict(context.params["problem"])
    silent_rank = int(context.params["silent_rank"])
    timeout_ms = int(context.params.get("timeout_ms", 2000))
    inputs = problem.rank_inputs(context.rank).to(context.device)
    args = (inputs.x, inputs.router_weight, inputs.w1, inputs.w2)
    knobs = cuda_backend.debug
    saved = (getattr(knobs, "silent_rank", -1), knobs.timeout_ms)
    knobs.silent_rank = silent_rank
    knobs.timeout_ms = timeout_ms
    error = second = {"type": None, "module": None, "message": None}
    try:
        started = time.monotonic()
        try:
            with torch.no_grad():
                _moe_call(problem, context, *args)
            _synchronize(context.device)
        except Exception as caught:
            error = _error_info(caught)
        elapsed = time.monotonic() - started
        team_failed = bool(context.team.failed)
        knobs.silent_rank = -1
        try:
            with torch.no_grad():
                _moe_call(problem, context, *args)
            _synchronize(context.device)
        except Exception as caught:
            second = _error_info(caught)
    finally:
        knobs.silent_rank, knobs.timeout_ms = saved
    return ScenarioOutput(info={"error": error, "elapsed_s": elapsed, "team_failed": team_failed,
                                "second_call_error": second, "silent_rank": silent_rank,
                                "timeout_ms": timeout_ms})


def scenario_bench(context: RankContext) -> ScenarioOutput:
    """params: ``problem``; ``warmup`` (default 5) and ``repeats`` (default 20) forwards; ``input_sets``
    (None: enough to exceed twice the L2 cache with all ranks' inputs, at most ``max_input_sets``,
    default 16; set ``s`` uses seed ``problem.seed + s``); ``return_output`` (default True).

    Every rank runs the same number of forwards (they are collective). Returns info ``samples_ms`` (one
    CUDA-event time per timed forward, in order), ``median_ms``/``p10_ms``/``p90_ms``, ``input_sets``,
    ``traffic`` (``last_traffic`` of the checked forward on set 0), and tensor ``y`` of set 0.
    """
    from flashdmoe import cuda_backend
    from flashdmoe.bench.timing import cache_bytes, input_sets_for_cache, measure

    problem = Problem.from_dict(context.params["problem"])
    warmup = int(context.params.get("warmup", 5))
    repeats = int(context.params.get("repeats", 20))
    sets = context.params.get("input_sets")
    if sets is None:
        element = torch.empty((), dtype=problem.torch_dtype).element_size()
        set_bytes = element * (2 * problem.total_tokens * problem.hidden + problem.experts * problem.hidden
                               + problem.experts * (problem.hidden * problem.w1_columns + problem.ffn * problem.hidden))
        sets = input_sets_for_cache(set_bytes, cache_bytes(context.device),
                                    limit=int(context.params.get("max_input_sets", 16)))
    prepared = []
    for index in range(int(sets)):
        inputs = problem.replace(seed=problem.seed + index).rank_inputs(context.rank).to(context.device)
        prepared.append((inputs.x, inputs.router_weight, inputs.w1, inputs.w2))
    with torch.no_grad():
        context.phase("checked forward on set 0")
        y = _moe_call(problem, context, *prepared[0])
        _synchronize(context.device)
        traffic = _traffic_now()
        runs = [lambda args=args: _moe_call(problem, context, *args) for args in prepared]
        context.team.barrier()
        _synchronize(context.device)
        context.phase("timed forwards")
        with cuda_backend.deferred_status_checks():
            stats = measure(runs, device=context.device, warmup=warmup, repeats=repeats)
    tensors = {"y": y} if context.params.get("return_output", True) else {}
    return ScenarioOutput(tensors, {
        "samples_ms": list(stats.samples_ms), "median_ms": stats.median_ms, "p10_ms": stats.p10_ms,
        "p90_ms": stats.p90_ms, "input_sets": int(sets), "traffic": traffic,
    })


def scenario_nccl_bench(context: RankContext) -> ScenarioOutput:
    """The unfused expert-parallel baseline (:func:`flashdmoe.bench.multi_gpu.all_to_all_moe`: counts, rows
    and results through ``torch.distributed.all_to_all_single``, experts by ``torch._grouped_mm``), timed
    like ``bench``. Runs with ``nvshmem=False`` (no team).

    params: ``problem``; ``backend`` (``"nccl"``, default, on ``cuda:<spec device>``; ``"gloo"`` on the CPU);
    ``experts`` (``"grouped_mm"``, default, or ``"reference"``); ``warmup`` (5), ``repeats`` (20),
    ``input_sets``/``max_input_sets`` as ``bench``; ``check`` (default True: this rank's output against
    :func:`flashdmoe.reference.moe`, info ``check``); ``return_output`` (default False: tensor ``y`` of set 0);
    ``pg_timeout_s`` (the process group's timeout, default 300). The process group meets through a
    ``file://`` store in the run's directory.

    Returns info ``samples_ms``, ``median_ms``/``p10_ms``/``p90_ms``, ``input_sets``, ``traffic`` (one dict:
    rows_routed_remote, dispatch_bytes, combine_bytes, count_bytes of the checked forward), ``check``,
    ``backend``, ``device``.
    """
    import datetime

    import torch.distributed as dist

    from flashdmoe.bench.multi_gpu import all_to_all_moe, rank_reference_check
    from flashdmoe.bench.timing import cache_bytes, input_sets_for_cache, measure

    params = context.params
    problem = Problem.from_dict(params["problem"])
    backend = params.get("backend", "nccl")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r}: expected 'nccl' or 'gloo'")
    experts = params.get("experts", "grouped_mm")
    if backend == "nccl":
        device = context.device or torch.device("cuda", int(context.spec.get("device", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    warmup = int(params.get("warmup", 5))
    repeats = int(params.get("repeats", 20))
    context.phase(f"joining the {backend} process group (collective)")
    store = context.workdir / f"{backend}_rendezvous"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=context.rank,
                            world_size=context.world_size,
                            timeout=datetime.timedelta(seconds=float(params.get("pg_timeout_s", 300))))
    try:
        sets = params.get("input_sets")
        if sets is None:
            element = torch.empty((), dtype=problem.torch_dtype).element_size()
            set_bytes = element * (2 * problem.total_tokens * problem.hidden + problem.experts * problem.hidden
                                   + problem.experts * (problem.hidden * problem.w1_columns
                                                        + problem.ffn * problem.hidden))
            sets = input_sets_for_cache(set_bytes, cache_bytes(device), limit=int(params.get("max_input_sets", 16)))
        prepared = []
        for index in range(int(sets)):
            inputs = problem.replace(seed=problem.seed + index).rank_inputs(context.rank).to(device)
            prepared.append((inputs.x, inputs.router_weight, inputs.w1, inputs.w2))
        kwargs = {"top_k": problem.top_k, "activation": problem.activation,
                  "normalize_topk": problem.normalize_topk, "experts": experts}
        barrier = (lambda: dist.barrier(device_ids=[device.index])) if backend == "nccl" else dist.barrier
        with torch.no_grad():
            context.phase("checked forward on set 0")
            traffic: dict[str, Any] = {}
            y = all_to_all_moe(*prepared[0], traffic=traffic, **kwargs)
            _synchronize(device)
            runs = [lambda args=args: all_to_all_moe(*args, **kwargs) for args in prepared]
            barrier()
            _synchronize(device)
            context.phase("timed forwards")
            stats = measure(runs, device=device, warmup=warmup, repeats=repeats)
            barrier()
        info = {"samples_ms": list(stats.samples_ms), "median_ms": stats.median_ms, "p10_ms": stats.p10_ms,
                "p90_ms": stats.p90_ms, "input_sets": int(sets), "traffic": [traffic], "backend": backend,
                "device": str(device)}
        if params.get("check", True):
            context.phase("checking against the reference")
            info["check"] = rank_reference_check(problem, context.rank, y, device)
    finally:
        dist.destroy_process_group()
    return ScenarioOutput({"y": y} if params.get("return_output", False) else {}, info)


def scenario_selftest(context: RankContext) -> ScenarioOutput:
    """The harness itself, without NVSHMEM or a GPU. params: ``actions`` {rank: "ok" | "raise" | "hang" |
    "exit"} (default "ok"); "hang" sleeps ``hang_s`` (default 3600). Returns tensor ``rank`` and info
    ``uid`` (the hex of the id rank 0 published), ``pid``."""
    actions = {int(rank): action for rank, action in (context.params.get("actions") or {}).items()}
    action = actions.get(context.rank, "ok")
    if action == "raise":
        raise ValueError(f"selftest: rank {context.rank} raises as asked")
    if action == "hang":
        context.phase("selftest: hanging as asked")
        time.sleep(float(context.params.get("hang_s", 3600)))
    if action == "exit":
        os._exit(7)
    return ScenarioOutput({"rank": torch.tensor([context.rank])},
                          {"uid": context.uid.hex(), "pid": os.getpid()})


SCENARIOS: dict[str, Callable[[RankContext], Any]] = {
    "forward_backward": scenario_forward_backward,
    "timeout": scenario_timeout,
    "bench": scenario_bench,
    "nccl_bench": scenario_nccl_bench,
    "selftest": scenario_selftest,
}


# ------------------------------------------------------------------------------------------------------------
# Parent side


@dataclass
class RankOutcome:
    """What one rank did.

    status: ``"ok"``; ``"error"`` (the scenario or set-up raised, or closing the team failed: see
    ``error_type``/``error_message``); ``"hung"`` (killed while still running; ``phase`` says where);
    ``"crashed"`` (exited with no status, e.g. a signal). tensors / info: the scenario's results (present
    whenever the rank wrote them, even if it hung afterwards in teardown).
    """

    rank: int
    status: str
    returncode: int | None
    phase: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    kill_reason: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def describe(self) -> str:
        if self.status == "ok":
            return f"rank {self.rank}: ok"
        if self.status == "hung":
            return f"rank {self.rank}: hung in phase {self.phase!r} ({self.kill_reason}; killed)"
        if self.status == "crashed":
            return f"rank {self.rank}: crashed with exit code {self.returncode} in phase {self.phase!r}"
        return f"rank {self.rank}: {self.error_type}: {self.error_message} (phase {self.phase!r})"


class RanksFailed(RuntimeError):
    """Some rank of a :func:`run_ranks` run failed, crashed or hung; the message says which and where."""

    def __init__(self, message: str, result: "RunResult") -> None:
        super().__init__(message)
        self.result = result


@dataclass
class RunResult:
    """All ranks of one :func:`run_ranks` run (``ranks[r]`` is rank ``r``)."""

    scenario: str
    world_size: int
    ranks: list[RankOutcome]
    elapsed_s: float
    mps: bool
    mps_log: str = ""

    @property
    def ok(self) -> bool:
        return all(rank.ok for rank in self.ranks)

    @property
    def hung_ranks(self) -> list[int]:
        return [rank.rank for rank in self.ranks if rank.status == "hung"]

    @property
    def failed_ranks(self) -> list[int]:
        return [rank.rank for rank in self.ranks if not rank.ok]

    def summary(self, log_lines: int = 15) -> str:
        lines = [f"{self.scenario} on {self.world_size} processes{' under MPS' if self.mps else ''}: "
                 f"{'ok' if self.ok else 'failed'} after {self.elapsed_s:.1f} s"]
        if self.hung_ranks:
            lines.append(f"hung ranks: {self.hung_ranks}")
        for rank in self.ranks:
            lines.append("  " + rank.describe())
        for rank in self.ranks:
            if not rank.ok:
                if rank.traceback:
                    lines.append(f"--- rank {rank.rank} traceback\n{rank.traceback.rstrip()}")
                if rank.log_tail:
                    tail = "\n".join(rank.log_tail.splitlines()[-log_lines:])
                    lines.append(f"--- rank {rank.rank} output (last lines)\n{tail}")
        if not self.ok and self.mps_log:
            lines.append(self.mps_log)
        return "\n".join(lines)

    def check(self) -> "RunResult":
        """Raise :class:`RanksFailed` unless every rank is ok; returns self."""
        if not self.ok:
            raise RanksFailed(self.summary(), self)
        return self


@functools.lru_cache(maxsize=4)
def nvshmem_unavailable_reason(python: str | None = None) -> str | None:
    """Why a child process cannot use NVSHMEM (``import nvshmem.core`` fails), or None. Checked in a
    subprocess so this process loads nothing."""
    command = [python or sys.executable, "-c", "import nvshmem.core"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot check for nvshmem4py: {error}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"nvshmem4py is not importable ({last})"
    return None


def _package_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def _child_env(mps_daemon, world_size: int, extra: Mapping[str, str] | None) -> dict[str, str]:
    if mps_daemon is not None:
        env = dict(mps_daemon.client_env(100 // world_size))
    else:
        env = dict(os.environ)
    env.update(NVLS_ENV)
    root = _package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update({str(k): str(v) for k, v in extra.items()})
    return env


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _positive_seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: expected a number of seconds > 0")
    return float(value)


def run_ranks(
    scenario: str,
    world_size: int,
    *,
    params: Mapping[str, Any] | None = None,
    team: Mapping[str, Any] | None = None,
    nvshmem: bool = True,
    mps: Any = True,
    timeout_s: float = 300.0,
    uid_timeout_s: float = 120.0,
    failure_grace_s: float = 30.0,
    teardown_grace_s: float = 60.0,
    device: int = 0,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    workdir: str | os.PathLike | None = None,
    keep_workdir: bool = False,
    one_gpu_per_rank: bool = False,
) -> RunResult:
    """Run ``scenario`` on ``world_size`` rank processes and collect their results (see the module doc).

    Args:
        scenario: a name in :data:`SCENARIOS` or ``"package.module:function"`` (called with a
            :class:`RankContext`, returning :class:`ScenarioOutput` or a dict of JSON-able info).
        world_size: ``P`` processes, 1 to ``MAX_RANKS``.
        params: JSON-able scenario parameters.
        team: sizes for :meth:`Team.nvshmem <flashdmoe.team.Team.nvshmem>` (``max_tokens``, ``hidden``,
            ``top_k``, ``local_experts``, ``dtype`` by name); default: ``Problem(**params["problem"]).team_kwargs()``.
        nvshmem: False runs the scenario with no team (and no GPU set-up): ``selftest``.
        mps: True starts (and stops) an MPS daemon for this run; an :class:`~flashdmoe.mps.MpsDaemon`
            already started is used as is; False/None runs without MPS (one GPU per process, or CPU only).
        timeout_s: the whole run's limit; ranks still running then are killed and reported as hung.
        uid_timeout_s: how long ranks 1.. wait for rank 0's unique id.
        failure_grace_s: after one rank failed, how long the others may go on before they are killed.
        teardown_grace_s: after every rank wrote its results, how long they may take to exit.
        device: the CUDA device index every rank uses.
        env: extra environment variables for the children.
        python: interpreter for the children (default: this one).
        workdir: where the specs and results go (default: a fresh temporary directory, removed afterwards
            unless ``keep_workdir``).
        one_gpu_per_rank: rank ``r`` uses CUDA device ``device + r`` (one process per GPU, all GPUs stay
            visible so peers can map each other's memory); needs ``mps=False``.

    Returns: :class:`RunResult` (call ``.check()`` to raise :class:`RanksFailed` on any failure).
    """
    if not isinstance(scenario, str) or not (scenario in SCENARIOS or ":" in scenario):
        raise ValueError(f"scenario={scenario!r}: expected one of {sorted(SCENARIOS)} or 'module:function'")
    _int_field("world_size", world_size, 1)
    if world_size > MAX_RANKS:
        raise ValueError(f"world_size={world_size}: expected at most {MAX_RANKS}")
    timeout_s = _positive_seconds("timeout_s", timeout_s)
    uid_timeout_s = _positive_seconds("uid_timeout_s", uid_timeout_s)
    failure_grace_s = _positive_seconds("failure_grace_s", failure_grace_s)
    teardown_grace_s = _positive_seconds("teardown_grace_s", teardown_grace_s)
    _int_field("device", device, 0)
    if not isinstance(one_gpu_per_rank, bool):
        raise ValueError(f"one_gpu_per_rank={one_gpu_per_rank!r}: expected True or False")
    if one_gpu_per_rank and not (mps is False or mps is None):
        raise ValueError("mps: one_gpu_per_rank=True runs one process per GPU without MPS; pass mps=False")
    if not (mps is True or mps is False or mps is None or hasattr(mps, "client_env")):
        raise ValueError(f"mps={mps!r}: expected True, False/None or a started flashdmoe.mps.MpsDaemon")
    params = dict(params or {})
    try:
        json.dumps(params)
    except (TypeError, ValueError) as error:
        raise ValueError(f"params: expected JSON-able values ({error})") from None
    if nvshmem:
        if team is None:
            if "problem" not in params:
                raise ValueError("team: required (Team.nvshmem sizes) when params has no 'problem'")
            problem = Problem.from_dict(params["problem"])
            if problem.world_size != world_size:
                raise ValueError(f"params['problem']: tokens for {problem.world_size} ranks, but world_size={world_size}")
            team = problem.team_kwargs()
        team = dict(team)
        missing = {"max_tokens", "hidden", "top_k", "local_experts", "dtype"} - set(team)
        if missing:
            raise ValueError(f"team: missing {sorted(missing)}")
        if team["dtype"] not in DTYPES:
            raise ValueError(f"team['dtype']={team['dtype']!r}: expected one of {tuple(DTYPES)}")

    own_dir = workdir is None
    root = Path(tempfile.mkdtemp(prefix="flashdmoe-ranks-")) if own_dir else Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.ExitStack() as stack:
            if mps is True:
                from flashdmoe.mps import MpsDaemon

                daemon = stack.enter_context(MpsDaemon())
            elif mps is False or mps is None:
                daemon = None
            else:
                daemon = mps
            result = _launch_and_join(
                scenario, world_size, params, team if nvshmem else None, bool(nvshmem), daemon, root,
                timeout_s, uid_timeout_s, failure_grace_s, teardown_grace_s, device, env, python,
                one_gpu_per_rank=one_gpu_per_rank,
            )
            if not result.ok and daemon is not None and hasattr(daemon, "log_tail"):
                result.mps_log = daemon.log_tail()
            return result
    finally:
        if own_dir and not keep_workdir:
            shutil.rmtree(root, ignore_errors=True)


def _launch_and_join(scenario, world_size, params, team, nvshmem, daemon, root: Path, timeout_s, uid_timeout_s,
                     failure_grace_s, teardown_grace_s, device, extra_env, python, *,
                     one_gpu_per_rank: bool = False) -> RunResult:
    child_env = _child_env(daemon, world_size, extra_env)
    python = python or sys.executable
    processes: list[subprocess.Popen] = []
    logs = []
    started = time.monotonic()
    kill_reasons: dict[int, str] = {}
    try:
        for rank in range(world_size):
            spec = {
                "version": SPEC_VERSION, "scenario": scenario, "rank": rank, "world_size": world_size,
                "workdir": str(root), "nvshmem": nvshmem, "team": team, "params": params,
                "device": device + rank if one_gpu_per_rank else device,
                "uid_timeout_s": uid_timeout_s,
            }
            spec_path = root / f"rank{rank}.spec.json"
            spec_path.write_text(json.dumps(spec, indent=1))
            log = (root / f"rank{rank}.log").open("wb")
            logs.append(log)
            processes.append(subprocess.Popen(
                [python, "-m", "flashdmoe.multiprocess", str(spec_path)],
                env=child_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            ))
        deadline = started + timeout_s
        first_failure: tuple[int, float] | None = None
        all_reported_at: float | None = None
        while True:
            codes = [process.poll() for process in processes]
            if all(code is not None for code in codes):
                break
            now = time.monotonic()
            statuses = [_read_json(root / f"rank{rank}.status.json") for rank in range(world_size)]
            if first_failure is None:
                for rank, (code, status) in enumerate(zip(codes, statuses)):
                    if (code not in (None, 0)) or (status is not None and status.get("status") != "ok"):
                        first_failure = (rank, now)
                        break
            if all_reported_at is None and all(status is not None for status in statuses):
                all_reported_at = now
            reason = None
            if now >= deadline:
                reason = f"still running when the {timeout_s:g} s timeout expired"
            elif first_failure is not None and now - first_failure[1] >= failure_grace_s:
                reason = f"still running {failure_grace_s:g} s after rank {first_failure[0]} failed"
            elif all_reported_at is not None and now - all_reported_at >= teardown_grace_s:
                reason = f"still running {teardown_grace_s:g} s after every rank wrote its results"
            if reason is not None:
                for rank, process in enumerate(processes):
                    if process.poll() is None:
                        kill_reasons[rank] = reason
                        process.kill()
                break
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:  # an exception in this loop: leave no orphans behind
                process.kill()
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
        for log in logs:
            log.close()
    elapsed = time.monotonic() - started
    outcomes = [_collect(root, rank, processes[rank].returncode, kill_reasons.get(rank)) for rank in range(world_size)]
    return RunResult(scenario, world_size, outcomes, elapsed, daemon is not None)


def _collect(root: Path, rank: int, returncode: int | None, kill_reason: str | None) -> RankOutcome:
    status = _read_json(root / f"rank{rank}.status.json")
    phase = (_read_json(root / f"rank{rank}.phase.json") or {}).get("phase")
    outcome = RankOutcome(rank=rank, status="ok", returncode=returncode, phase=phase,
                          kill_reason=kill_reason, log_tail=_tail(root / f"rank{rank}.log"))
    if status is not None:
        outcome.info = status.get("info") or {}
        if status.get("status") != "ok":
            outcome.status = "error"
            outcome.error_type = status.get("error_type")
            outcome.error_message = status.get("error_message")
            outcome.traceback = status.get("traceback")
            outcome.phase = status.get("phase") or phase
        tensors_path = root / f"rank{rank}.pt"
        if tensors_path.exists():
            outcome.tensors = torch.load(tensors_path, map_location="cpu", weights_only=True)
    teardown = _read_json(root / f"rank{rank}.teardown.json")
    if kill_reason is not None:
        outcome.status = "hung"
    elif status is None:
        outcome.status = "crashed"
    elif outcome.status == "ok" and teardown is not None:
        outcome.status = "error"
        outcome.error_type = teardown.get("type")
        outcome.error_message = f"closing the team failed: {teardown.get('message')}"
        outcome.traceback = teardown.get("traceback")
    elif outcome.status == "ok" and returncode != 0:
        outcome.status = "crashed"
    return outcome


if __name__ == "__main__":
    # Run through the imported module (not this __main__ copy), so scenario code that imports
    # flashdmoe.multiprocess sees the same classes.
    # os._exit after flushing: no interpreter teardown (atexit hooks of NVSHMEM or CUDA libraries) after
    # the team was closed; the results are already on disk.
    from flashdmoe.multiprocess import main as _main

    _code = _main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
