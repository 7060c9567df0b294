"""The NVSHMEM device-API transport (docs/design.md, "Transport"): the per-team transport option and the
``flashdmoe_nvshmem`` module bound to the NVSHMEM instance a :meth:`Team.nvshmem
<flashdmoe.parallel.team.Team.nvshmem>` started.

A team reaches a peer either through a *peer pointer* (NVLink or the same GPU: plain stores, the ``p2p``
transport) or through NVSHMEM's device API (puts with signals over whatever NVSHMEM's transports reach,
InfiniBand included: the ``nvshmem`` transport). ``peer_transport="auto"`` takes p2p wherever a peer pointer
exists and nvshmem elsewhere; ``"p2p"`` / ``"nvshmem"`` force one for every peer.

The module's device state is bound once per team (``init_device_state``, collective): NVSHMEM's host library
is initialised by nvshmem4py, and the module registers its own device state with that instance through one
more NVSHMEM initialisation with the team's unique id, finalized when the team closes (docs/design.md §8).
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Sequence

import torch

__all__ = ["PEER_TRANSPORTS", "SmokeResult", "bound_module", "cuda_context_usable", "kernel_build_problem",
           "kernel_peer_table", "release", "require_unbound",
           "parse_peer_transport", "resolve_peer_transports", "run_smoke"]

# Per-team option values; "auto" resolves per peer to one of the other two.
PEER_TRANSPORTS = ("auto", "p2p", "nvshmem")


def parse_peer_transport(value) -> str:
    """``value`` as a valid ``peer_transport`` option (case-insensitive); ``ValueError`` naming it otherwise."""
    if not isinstance(value, str) or value.strip().lower() not in PEER_TRANSPORTS:
        raise ValueError(f"peer_transport={value!r}: expected one of {PEER_TRANSPORTS}")
    return value.strip().lower()


def resolve_peer_transports(option: str, has_peer_pointer: Sequence[bool], rank: int,
                            nvshmem_available: str | None = None) -> list[str]:
    """The transport (``"p2p"`` or ``"nvshmem"``) to each peer of ``rank``; the rank itself is always
    ``"p2p"`` (its own buffers). ``has_peer_pointer[q]``: whether ``get_peer_tensor`` gave a pointer to q.
    ``nvshmem_available``: ``None`` when the transport module can be used, else why not.

    Raises ``ValueError`` for a forced ``"p2p"`` with a peer that has no pointer, and for a peer that needs
    nvshmem (forced, or auto without a pointer) when the transport module is unavailable.
    """
    option = parse_peer_transport(option)
    if not 0 <= rank < len(has_peer_pointer):
        raise ValueError(f"rank={rank!r}: expected an integer in [0, {len(has_peer_pointer)})")
    chosen = []
    for peer, pointer in enumerate(has_peer_pointer):
        if peer == rank:
            chosen.append("p2p")
        elif option == "p2p" and not pointer:
            raise ValueError(f"peer_transport='p2p': rank {rank} has no peer pointer to rank {peer} "
                             "(no NVLink / same-GPU path); use 'auto' or 'nvshmem'")
        elif option == "nvshmem" or (option == "auto" and not pointer):
            chosen.append("nvshmem")
        else:
            chosen.append("p2p")
    if "nvshmem" in chosen and nvshmem_available is not None:
        needing = [peer for peer, kind in enumerate(chosen) if kind == "nvshmem"]
        raise ValueError(f"peer_transport={option!r}: rank {rank} needs the NVSHMEM transport for ranks {needing}, "
                         f"which is unavailable: {nvshmem_available}")
    return chosen


def kernel_build_problem() -> str | None:
    """Why this process's kernel cannot publish through NVSHMEM (it imports the main build), or ``None``."""
    from flashdmoe.kernel import extension

    build = extension.kernel_build()
    if build == "nvshmem":
        return None
    return (f"this process runs the {build!r} kernel build (peer-pointer stores only); set "
            "FLASHDMOE_KERNEL_BUILD=nvshmem before the extension is first loaded")


def kernel_peer_table(rank: int, own: tuple[int, int, int], mapped: Sequence[tuple[int, int, int] | None],
                      transports: Sequence[str], region_bytes: int) -> tuple[list[int], list[int], list[int]]:
    """The peer table the kernel gets (recv, comb and signal addresses per peer).

    ``own``: this rank's (recv, comb, signals) addresses; ``mapped[q]``: q's buffers as this rank maps them
    (``None`` without a load/store path); ``transports[q]``: from :func:`resolve_peer_transports`;
    ``region_bytes``: one source's region of recv / comb (``stream_rows * H * element size``).
    A p2p peer gets its mapping. An NVSHMEM peer q gets this rank's own signal words (the kernel's mark
    of an NVSHMEM peer) and staging addresses in this rank's own buffers, placed so that the kernel's
    stores into "q's recv region [rank]" land in own comb region [q] and into "q's comb region [rank]" in
    own recv region [q] (csrc/nvshmem/nvshmem_transport.cuh says why those regions are free).
    """
    recv, comb, signals = [], [], []
    for peer, kind in enumerate(transports):
        if peer == rank:
            entry = own
        elif kind == "p2p":
            if mapped[peer] is None:
                raise ValueError(f"transports[{peer}]='p2p' but rank {rank} has no mapping of rank {peer}'s buffers")
            entry = mapped[peer]
        elif kind == "nvshmem":
            shift = (peer - rank) * region_bytes
            entry = (own[1] + shift, own[0] + shift, own[2])
        else:
            raise ValueError(f"transports[{peer}]={kind!r}: expected 'p2p' or 'nvshmem'")
        recv.append(entry[0])
        comb.append(entry[1])
        signals.append(entry[2])
    return recv, comb, signals


_bound: types.ModuleType | None = None
_bound_team: weakref.ref | None = None  # the team whose NVSHMEM instance the module is bound to
_bind_lock = threading.Lock()


def require_unbound() -> None:
    """Refuse a second NVSHMEM team while the module is bound to another, still open, team: the module has
    one device state, registered with one NVSHMEM initialisation (released by :func:`release`)."""
    if _bound is not None:
        raise RuntimeError("flashdmoe_nvshmem is bound to another NVSHMEM team of this process: a process joins "
                           "one NVSHMEM team at a time (close the other team first)")


def release(team) -> None:
    """Team close: the finalize matching the module's initialisation for ``team`` (before nvshmem4py's own
    finalize). Nothing when the module is not bound to ``team``."""
    global _bound, _bound_team
    with _bind_lock:
        if _bound is not None and _bound_team is not None and _bound_team() is team:
            module, _bound, _bound_team = _bound, None, None
            module.finalize_device_state()


def bound_module(team, *, verify: bool = True) -> types.ModuleType:
    """``flashdmoe_nvshmem`` (built on first use) with its device state bound to the NVSHMEM instance of
    ``team`` (a :meth:`Team.nvshmem <flashdmoe.parallel.team.Team.nvshmem>` team: NVSHMEM initialised). Raises
    ``BackendUnavailable`` when the module cannot be built or imported, ``RuntimeError`` when NVSHMEM is
    not initialised or the module is bound to another team (see :func:`require_unbound`). Collective: the
    binding is one more NVSHMEM initialisation with the team's unique id (docs/design.md §8), so every
    rank of the team calls it; :func:`release` undoes it when the team closes. ``verify=False`` skips the
    kernel that checks the binding (the device must see the host's PE and PE count): for bisecting a fault
    with scripts/nvshmem_smoke.py, which then runs that check as a step of its own."""
    global _bound, _bound_team
    with _bind_lock:
        if _bound is None:
            from flashdmoe.kernel import extension

            module = extension.load_nvshmem()
            if verify:
                module.init_device_state(bytes(team.unique_id), team.rank, team.world_size)
            else:
                module.init_device_state(bytes(team.unique_id), team.rank, team.world_size, check=False)
            _bound, _bound_team = module, weakref.ref(team)
        elif _bound_team is None or _bound_team() is not team:
            require_unbound()
        return _bound


class SmokeResult(types.SimpleNamespace):
    """One PE's smoke run: ``my_pe``, ``n_pes`` (the device API's view), ``next_is_p2p`` (a load/store
    path to the next PE), ``arrived`` (its signal came before the deadline), ``mismatches`` (32-bit words
    of the received payload that differ), ``wait_ns``."""

    @property
    def ok(self) -> bool:
        return bool(self.arrived) and self.mismatches == 0


def run_smoke(team, *, words: int = 4096, runs: int = 2, timeout_ms: int = 10_000) -> list[SmokeResult]:
    """On an NVSHMEM ``team`` (every rank calls it: collective): ``runs`` rounds of the smoke kernel, each a
    put-with-signal of ``words`` 32-bit words to the next PE and a bounded wait for the previous PE's,
    with the signal carrying the round's number (no reset between rounds, as the kernel's flags).
    Returns each round's :class:`SmokeResult` for this rank."""
    if getattr(team, "transport", None) != "nvshmem":
        raise ValueError(f"team: expected a Team.nvshmem team, got {team!r}")
    for name, value in (("words", words), ("runs", runs), ("timeout_ms", timeout_ms)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    import nvshmem.core as nvshmem

    module = bound_module(team)
    device = team.device
    stream = torch.cuda.current_stream(device)
    send = nvshmem.tensor((words,), dtype=torch.int32)
    recv = nvshmem.tensor((words,), dtype=torch.int32)
    signal = nvshmem.tensor((1,), dtype=torch.int64)
    try:
        signal.zero_()
        recv.zero_()
        torch.cuda.synchronize(device)
        nvshmem.barrier_all(stream)  # every PE's signal is zero before anyone puts
        torch.cuda.synchronize(device)
        results = []
        for sequence in range(1, runs + 1):
            out = torch.zeros(module.SMOKE_SLOTS, dtype=torch.int64, device=device)
            module.smoke(send.data_ptr(), recv.data_ptr(), words, signal.data_ptr(), sequence,
                         timeout_ms * 1_000_000, out.data_ptr(), stream.cuda_stream)
            torch.cuda.synchronize(device)
            my_pe, n_pes, next_is_p2p, arrived, mismatches, wait_ns = out.tolist()
            results.append(SmokeResult(my_pe=my_pe, n_pes=n_pes, next_is_p2p=bool(next_is_p2p),
                                       arrived=bool(arrived), mismatches=mismatches, wait_ns=wait_ns))
            # The next round overwrites send/recv: everyone has checked this round's payload first.
            nvshmem.barrier_all(stream)
            torch.cuda.synchronize(device)
    except BaseException:
        # After a device fault the context is unusable and NVSHMEM's free (a barrier) would exit the process
        # before this error is seen: leave the buffers to the dead context.
        if cuda_context_usable(device):
            _free_tensors(nvshmem, (send, recv, signal))
        raise
    _free_tensors(nvshmem, (send, recv, signal))
    return results


def _free_tensors(nvshmem, tensors) -> None:
    for t in tensors:
        nvshmem.free_tensor(t)


def cuda_context_usable(device) -> bool:
    """False when ``device``'s CUDA context holds a sticky error (an illegal address, a trap): every later
    CUDA call, NVSHMEM's collectives included, fails, and NVSHMEM then exits the process."""
    try:
        torch.cuda.synchronize(device)
        return True
    except RuntimeError:
        return False
