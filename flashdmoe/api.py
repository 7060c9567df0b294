"""``flashdmoe.moe``: the public MoE function and its backend choice (docs/design.md §2)."""

from __future__ import annotations

import functools
import importlib
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from flashdmoe import validation, weight_checks
from flashdmoe.errors import BackendUnavailable
from flashdmoe.validation import validate_moe_inputs
from flashdmoe.weight_checks import check_finite_weights

__all__ = ["BACKENDS", "CUDA_DTYPES", "cuda_unavailable_reason", "moe", "moe_expert_parallel", "resolve_backend"]

#: Accepted values of ``backend``.
BACKENDS: tuple[str, ...] = ("auto", "reference", "cuda")

#: Dtypes the fused kernel is designed for (fp32 as TF32 on tensor cores); float64 is reference-only.
#: What a given build runs is ``flashdmoe.cuda_backend.DTYPE_CODES``'s keys, checked at dispatch.
CUDA_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def _team_world_size(team: Any) -> int:
    if team is None:
        return 1
    world_size = getattr(team, "world_size", None)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"team: expected None or a flashdmoe.Team with an integer world_size >= 1, got {team!r}")
    return world_size


_validated: dict = {}
_VALIDATED_LIMIT = 1024


def _validate(x, router_weight, w1, w2, *, top_k, activation, capacity_factor, world_size):
    """:func:`validate_moe_inputs`, remembered per call signature for tensors off the CPU.

    The checks read only shapes, dtypes, devices and layouts, so a signature that passed once passes
    again; CPU tensors are also scanned for NaN (a cheap host read there, a device synchronisation on a
    GPU), so they are checked every call. Types are part of the key: ``top_k=True`` equals ``1`` but is
    refused.
    """
    if x.device.type == "cpu":
        return validate_moe_inputs(x, router_weight, w1, w2, top_k=top_k, activation=activation,
                                   capacity_factor=capacity_factor, world_size=world_size)
    try:
        key = (x.shape, router_weight.shape, w1.shape, w2.shape, x.dtype, router_weight.dtype, w1.dtype, w2.dtype,
               x.device, router_weight.device, w1.device, w2.device, x.is_contiguous(), router_weight.is_contiguous(),
               w1.is_contiguous(), w2.is_contiguous(), top_k, type(top_k), activation, capacity_factor,
               type(capacity_factor), world_size, type(world_size))
        sizes = _validated.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: the full checks say why
        key, sizes = None, None
    if sizes is None:
        sizes = validate_moe_inputs(x, router_weight, w1, w2, top_k=top_k, activation=activation,
                                    capacity_factor=capacity_factor, world_size=world_size)
        if key is not None:
            if len(_validated) >= _VALIDATED_LIMIT:
                _validated.clear()
            _validated[key] = sizes
    return sizes


class _Call:
    """A call of :func:`moe` on the fused kernel, one rank, remembered under its arguments
    (:data:`_remembered`): everything the checks and the launch plan derived from it, valid while the
    weights it saw are alive, :mod:`flashdmoe.weight_checks` has forgotten nothing since and the debug
    knobs are the plan's."""

    __slots__ = ("top_k", "capacity_factor", "plan", "backend", "epoch", "refs", "storages", "scan_input")

    def __init__(self, top_k, capacity_factor, plan, backend, epoch, weights, scan_input) -> None:
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.plan = plan
        self.backend = backend  # the flashdmoe.cuda_backend module
        self.epoch = epoch
        self.refs = tuple(weakref.ref(w) for w in weights)
        self.storages = tuple(StorageWeakRef(w.untyped_storage()) for w in weights)
        self.scan_input = scan_input  # CPU x (fake-extension runs only): its NaN scan runs every call

    def holds(self, router_weight, w1, w2) -> bool:
        """The weights seen then are these objects, or their storages are still alive (so the addresses
        compared on a hit are not recycled ones)."""
        refs = self.refs
        if refs[0]() is router_weight and refs[1]() is w1 and refs[2]() is w2:
            return True
        return not any(storage.expired() for storage in self.storages)


#: Remembered calls: the host module's ``CallCache`` (csrc/host/call_cache.h, made with the first fused
#: call, so the reference backend never builds it). A hit compares x's shape, dtype, device and
#: contiguity, each weight's address, version counter, shape, strides and dtype, and the six options
#: by type and value (``top_k=True`` equals ``1`` but is refused): everything a check or the launch
#: plan reads. A weight's address also fixes its device (CUDA's unified address space).
_remembered = None
_CALLS_LIMIT = 1024


def _remember_call(given, x, router_weight, w1, w2, top_k, activation, normalize_topk, capacity_factor,
                   epoch) -> None:
    """Remember a call that passed every check (before its launch: a shape the kernel refuses raises
    here, and is not remembered); ``given``: its six options as the caller passed them."""
    global _remembered
    cuda_backend = _module("flashdmoe.cuda_backend")
    plan = cuda_backend.single_plan(x, router_weight, w2, top_k=top_k, activation=activation,
                                    normalize_topk=normalize_topk, capacity_factor=capacity_factor)
    if _remembered is None:
        _remembered = _module("flashdmoe.kernel.host_queue").module().CallCache(
            _CALLS_LIMIT, weight_checks._epoch, _module("flashdmoe.kernel.status_checks"), validation)
    call = _Call(top_k, capacity_factor, plan, cuda_backend, epoch, (router_weight, w1, w2), x.device.type == "cpu")
    _remembered.remember(call, x, router_weight, w1, w2, *given)


def forget_calls() -> None:
    """Drop every remembered call (they are re-derived at the next call)."""
    if _remembered is not None:
        _remembered.clear()


def remembered_call(x, router_weight, w1, w2, top_k, activation="gelu", normalize_topk=True, capacity_factor=None,
                    backend="auto", return_aux=False):
    """The remembered call these arguments would take (its ``plan`` is the prepared launch), or ``None``;
    nothing is checked. For measurements and tests."""
    if _remembered is None:
        return None
    return _remembered.find(x, router_weight, w1, w2, top_k, activation, normalize_topk, capacity_factor, backend,
                            return_aux)


def remembered_calls() -> int:
    """How many calls are remembered."""
    return 0 if _remembered is None else _remembered.size()


def _as_float(capacity_factor):
    """A validated capacity factor as ``float`` (NumPy scalars included), or ``None``."""
    return capacity_factor if capacity_factor is None or type(capacity_factor) is float else float(capacity_factor)


def cuda_unavailable_reason(x: torch.Tensor) -> str | None:
    """Why the fused CUDA backend cannot run on ``x`` here, or ``None`` if it can.

    Args:
        x: ``[T, H]`` input tokens (only its device and dtype are looked at).
    """
    if not x.is_cuda:
        return f"tensors are on {x.device.type}; the fused kernel needs CUDA tensors"
    try:
        cuda_backend = _module("flashdmoe.cuda_backend")
    except ImportError as error:
        return f"flashdmoe.cuda_backend cannot be imported: {error}"
    supported = getattr(cuda_backend, "DTYPE_CODES", CUDA_DTYPES)
    if x.dtype not in supported:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in supported)
        return f"dtype {x.dtype} is not supported by the fused kernel (it runs {names})"
    try:
        extension = _module("flashdmoe.kernel.extension")
    except ImportError as error:
        return f"flashdmoe.kernel.extension cannot be imported: {error}"
    if not extension.available():
        return extension.unavailable_reason() or "the CUDA extension is not available"
    try:  # the forward's launch path (C++ against this torch; built on first use)
        _module("flashdmoe.kernel.host_queue").module()
    except extension.BuildError as error:
        return str(error)
    return None


@functools.lru_cache(maxsize=None)
def _module(name: str):
    """A module imported once (this runs on every forward; a failed import is retried)."""
    return importlib.import_module(name)


def resolve_backend(x: torch.Tensor, backend: str, team: Any = None) -> str:
    """The backend :func:`moe` will run: ``"reference"`` or ``"cuda"``.

    ``"auto"`` picks ``"cuda"`` when ``x`` is a CUDA tensor of a kernel dtype and the extension
    is built, else ``"reference"``.

    Raises:
        ValueError: unknown ``backend``, or a multi-rank ``team`` on the reference backend.
        BackendUnavailable: ``backend="cuda"`` cannot run here; the message says why.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    world_size = _team_world_size(team)
    if backend == "cuda":
        reason = cuda_unavailable_reason(x)
        if reason is not None:
            raise BackendUnavailable(f"backend='cuda' is unavailable: {reason}")
        return "cuda"
    if backend == "auto" and cuda_unavailable_reason(x) is None:
        return "cuda"
    if world_size > 1:
        raise ValueError(
            f"team: world_size={world_size} needs the fused CUDA backend; the reference backend runs one "
            "rank per call. For a multi-rank reference use "
            "flashdmoe.reference.moe_expert_parallel(xs, router_weight, w1s, w2s, ...)"
        )
    return "reference"


def moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    activation: str = "gelu",
    normalize_topk: bool = True,
    capacity_factor: float | None = None,
    team: Any = None,
    backend: str = "auto",
    return_aux: bool = False,
):
    """Mixture-of-Experts layer: gate, dispatch, expert FFN, combine (docs/design.md §2).

    Args:
        x: ``[T, H]`` tokens on this rank (float32, bfloat16, float16; float64 on the reference).
        router_weight: ``[E, H]`` router in ``nn.Linear`` layout, same dtype/device, replicated on ranks.
        w1: ``[L, H, I]`` (``[L, H, 2I]`` for swiglu, gate half first) this rank's experts.
        w2: ``[L, I, H]`` this rank's experts.
        top_k: experts per token, ``1 <= top_k <= E``.
        activation: ``relu``, ``gelu`` (exact erf), ``silu`` or ``swiglu``.
        normalize_topk: divide the top-k probabilities by their sum.
        capacity_factor: ``None`` (dropless) or ``c > 0``: each (source rank, expert) keeps
            ``ceil(c * T * k / E)`` rows in token order; dropped choices contribute zero.
        team: ``None`` (one rank), ``Team.single()``, or this process's rank of a ``Team.nvshmem``
            team (``L * team.world_size == E``; collective: every rank calls ``moe`` -- and backward --
            the same number of times). Emulated teams go through :func:`moe_expert_parallel`.
        backend: ``"auto"``, ``"reference"`` or ``"cuda"`` (see :func:`resolve_backend`).
        return_aux: also return :class:`flashdmoe.reference.MoEAux` (per-expert counts ``[E]``
            int64, dropped choices, Switch load-balancing loss).

    Returns:
        ``y [T, H]`` in ``x``'s dtype, or ``(y, aux)`` when ``return_aux``. Differentiable with
        respect to ``x``, ``router_weight``, ``w1`` and ``w2``.

    Raises:
        ValueError: bad input, naming the argument (see :func:`flashdmoe.validation.validate_moe_inputs`;
            checked once per call signature, :data:`_remembered`); NaN / Inf in ``router_weight``, ``w1`` or
            ``w2``, scanned the first time each version of a weight is used (:mod:`flashdmoe.weight_checks`):
            at the call on the reference backend, later on the fused one (as below).
        BackendUnavailable: ``backend="cuda"`` cannot run here.
        KernelTimeout: a fused kernel's watchdog fired. The fused forward does not wait for its kernel,
            so this (and ``ValueError`` for NaN / Inf in ``x``, ``router_weight`` or a new weight) is
            raised by a later call: see :func:`flashdmoe.check_errors` for exactly when.
    """
    rememberable = team is None and not torch.compiler.is_compiling()
    if rememberable and _remembered is not None:
        # A call seen before passed every check below and has its launch prepared: go straight to it, in
        # C++ where nothing else is needed (then y comes back), else here with the remembered call.
        call = _remembered.launch(x, router_weight, w1, w2, top_k, activation, normalize_topk, capacity_factor,
                                  backend, return_aux)
        if type(call) is torch.Tensor:
            return call
        if (call is not None and call.epoch == weight_checks._epoch.value
                and call.plan.generation == call.backend.debug.generation and call.holds(router_weight, w1, w2)):
            # The launch (or the autograd node around it), nothing else.
            cuda_backend = call.backend
            if call.scan_input:
                validation.check_finite_input(x)
            if torch.is_grad_enabled() and (x.requires_grad or router_weight.requires_grad or w1.requires_grad
                                            or w2.requires_grad):
                return cuda_backend.moe_cuda(x, router_weight, w1, w2, top_k=call.top_k, activation=activation,
                                             normalize_topk=normalize_topk, capacity_factor=call.capacity_factor,
                                             return_aux=return_aux)
            y, routing = cuda_backend.launch_one(call.plan, x, router_weight, w1, w2)
            if not return_aux:
                return y
            return y, cuda_backend._aux(x, router_weight, call.top_k, routing.counts, routing.row)
    given = (top_k, activation, normalize_topk, capacity_factor, backend, return_aux)  # the remembered call's key
    world_size = _team_world_size(team)
    if not isinstance(normalize_topk, bool):
        raise ValueError(f"normalize_topk={normalize_topk!r}: expected True or False")
    if not isinstance(return_aux, bool):
        raise ValueError(f"return_aux={return_aux!r}: expected True or False")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    top_k = _validate(x, router_weight, w1, w2, top_k=top_k, activation=activation, capacity_factor=capacity_factor,
                      world_size=world_size).top_k  # an int from here on, whatever integer type was given
    capacity_factor = _as_float(capacity_factor)
    chosen = resolve_backend(x, backend, team)
    epoch = weight_checks._epoch.value
    # Fused forwards queue the scan of new weights and do not wait for it; the reference waits anyway.
    remembered = check_finite_weights((("router_weight", router_weight), ("w1", w1), ("w2", w2)),
                                      asynchronous=chosen == "cuda")
    if rememberable and remembered and chosen == "cuda":
        _remember_call(given, x, router_weight, w1, w2, top_k, activation, normalize_topk, capacity_factor, epoch)
    if torch.compiler.is_compiling() and getattr(team, "transport", "single") == "single":
        # Under torch.compile one rank is the registered op (CPU: the reference; CUDA: the kernel), which
        # traces without a graph break; eager calls keep the direct path below (less host work per call).
        from flashdmoe import ops

        return ops.moe(x, router_weight, w1, w2, top_k=top_k, activation=activation, normalize_topk=normalize_topk,
                       capacity_factor=capacity_factor, return_aux=return_aux)
    if chosen == "cuda":
        cuda_backend = _module("flashdmoe.cuda_backend")
        return cuda_backend.moe_cuda(x, router_weight, w1, w2, top_k=top_k, activation=activation,
                                     normalize_topk=normalize_topk, capacity_factor=capacity_factor,
                                     return_aux=return_aux, team=team)
    from flashdmoe import reference

    return reference.moe(x, router_weight, w1, w2, top_k=top_k, activation=activation,
                         normalize_topk=normalize_topk, capacity_factor=capacity_factor,
                         return_aux=return_aux)


def moe_expert_parallel(
    xs,
    router_weight: torch.Tensor,
    w1s,
    w2s,
    *,
    top_k: int,
    activation: str = "gelu",
    normalize_topk: bool = True,
    capacity_factor: float | None = None,
    team: Any = None,
    backend: str = "auto",
    return_aux: bool = False,
):
    """All ``P`` ranks of an expert-parallel MoE driven from one process (docs/design.md §6).

    Args:
        xs: ``P`` tensors ``[T_r, H]`` (``T_r`` may differ between ranks, 0 included), one dtype.
        router_weight: ``[E, H]``, replicated.
        w1s: ``P`` shards ``[L, H, I]`` (``[L, H, 2I]`` for swiglu); rank ``r`` owns experts
            ``[r * L, (r + 1) * L)``, ``E = P * L``.
        w2s: ``P`` shards ``[L, I, H]``.
        top_k, activation, normalize_topk, capacity_factor: as :func:`moe` (capacity per (source rank,
            expert) pair).
        team: a ``Team.emulated(P, ...)`` (every rank in one kernel launch on this GPU), or ``None`` for
            the reference.
        backend: ``"auto"`` (the kernel when ``team`` is given), ``"cuda"`` or ``"reference"``.
        return_aux: also return the list of per-rank :class:`flashdmoe.reference.MoEAux`.

    Returns:
        The list of ``y_r [T_r, H]`` in the input dtype (plus the aux list). Differentiable with respect
        to ``xs``, ``router_weight``, ``w1s`` and ``w2s``.
    """
    if not isinstance(xs, (list, tuple)) or not isinstance(w1s, (list, tuple)) or not isinstance(w2s, (list, tuple)):
        raise ValueError("xs, w1s, w2s: expected lists of tensors, one per rank")
    world_size = len(xs)
    if world_size == 0 or len(w1s) != world_size or len(w2s) != world_size:
        raise ValueError(f"xs, w1s, w2s: got {len(xs)}, {len(w1s)} and {len(w2s)} tensors; expected P >= 1 of each")
    if team is not None and _team_world_size(team) != world_size:
        raise ValueError(f"team: world_size {team.world_size} but {world_size} token batches were given")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    for rank in range(world_size):
        if not isinstance(xs[rank], torch.Tensor):
            raise ValueError(f"xs[{rank}]: expected a torch.Tensor, got {type(xs[rank]).__name__}")
        sizes = _validate(xs[rank], router_weight, w1s[rank], w2s[rank], top_k=top_k, activation=activation,
                          capacity_factor=capacity_factor, world_size=world_size)
        if xs[rank].dtype != xs[0].dtype or xs[rank].device != xs[0].device:
            raise ValueError(f"xs[{rank}]: {xs[rank].dtype} on {xs[rank].device}; expected {xs[0].dtype} on "
                             f"{xs[0].device} like xs[0]")
    top_k, capacity_factor = sizes.top_k, _as_float(capacity_factor)
    use_kernel = backend == "cuda" or (backend == "auto" and team is not None)
    if use_kernel:
        if team is None or getattr(team, "transport", None) != "emulated":
            raise ValueError("team: the kernel path of moe_expert_parallel needs a flashdmoe.Team.emulated(P, ...)")
        reason = cuda_unavailable_reason(xs[0])
        if reason is not None:
            raise BackendUnavailable(f"backend='cuda' is unavailable: {reason}")
    check_finite_weights([("router_weight", router_weight)]
                         + [(f"w1s[{rank}]", w1s[rank]) for rank in range(world_size)]
                         + [(f"w2s[{rank}]", w2s[rank]) for rank in range(world_size)], asynchronous=use_kernel)
    if use_kernel:
        from flashdmoe import cuda_backend

        return cuda_backend.moe_emulated(list(xs), router_weight, list(w1s), list(w2s), top_k=top_k,
                                         activation=activation, normalize_topk=normalize_topk,
                                         capacity_factor=capacity_factor, return_aux=return_aux, team=team)
    from flashdmoe import reference

    return reference.moe_expert_parallel(xs, router_weight, w1s, w2s, top_k=top_k, activation=activation,
                                         normalize_topk=normalize_topk, capacity_factor=capacity_factor,
                                         return_aux=return_aux)
