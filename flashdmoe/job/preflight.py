"""Checks ``flashdmoe run`` makes before it starts a worker or allocates a tensor: the memory the run will
need against the memory there is (:func:`check_memory`), and that the Ray cluster it is to join answers
(:func:`check_ray_address`). Each raises ``ValueError`` naming the cause (the CLI's exit status 2).

Memory needs are lower bounds computed from the config (weights, gradients, tokens, the activations kept
for the backward, the float64 verification), so a run that is refused could not have fitted; a run that
passes may still need more than estimated.
"""

from __future__ import annotations

import math
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdmoe.config import MoEConfig

__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "MemoryNeeds", "available_host_memory", "check_memory", "check_ray_address",
           "memory_needs", "ranks_per_gpu"]

#: How long ``flashdmoe run --address`` waits for the cluster to answer before giving up.
DEFAULT_CONNECT_TIMEOUT_S = 5.0

_GIB = 2**30


@dataclass(frozen=True)
class MemoryNeeds:
    """Bytes a run needs at least (see :func:`memory_needs`).

    Attributes:
        rank_step: one rank's step where each rank holds its own copy of the router (a Ray worker):
            weights and their gradients, its tokens, outputs and their gradients, the pre-activations
            kept for the backward.
        all_ranks_step: every rank's step in one process (``--in-process``; the router held once).
        weights: every rank's weights in the config's dtype, router once (what in-process ranks keep
            while the verification runs).
        verification: the driver's float64 check of step 0 (:mod:`flashdmoe.job.verification`): the step's
            inputs and the ranks' outputs and gradients in the config's dtype, the whole layer's weights,
            gradients, tokens and activations in float64. ``0`` without verification.
    """

    rank_step: int
    all_ranks_step: int
    weights: int
    verification: int


def memory_needs(config: MoEConfig, *, verify: bool) -> MemoryNeeds:
    """Lower bounds of the memory a run of ``config`` needs (Python integers: no overflow, however large)."""
    size = torch.empty((), dtype=config.torch_dtype).element_size()
    hidden, ffn, experts, world = config.hidden, config.ffn, config.experts, config.world_size
    tokens, chosen = config.tokens_per_rank, config.tokens_per_rank * config.top_k
    router = experts * hidden
    expert_weights = hidden * config.w1_cols + ffn * hidden
    weights = router + experts * expert_weights  # elements, router once
    rank_step = (2 * (router + config.local_experts * expert_weights) + 4 * tokens * hidden
                 + chosen * config.w1_cols) * size
    all_ranks_step = (2 * weights + world * (4 * tokens * hidden + chosen * config.w1_cols)) * size
    verification = 0
    if verify:
        in_dtype = (2 * weights + 4 * world * tokens * hidden) * size  # inputs and what the ranks returned
        float64 = (2 * weights + 3 * world * tokens * hidden + world * chosen * (config.w1_cols + ffn)) * 8
        verification = in_dtype + float64
    return MemoryNeeds(rank_step=rank_step, all_ranks_step=all_ranks_step, weights=weights * size,
                       verification=verification)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_available() -> int | None:
    """What this process's memory cgroup (v2, else v1) still allows, page cache counted as free."""
    for limit_file, usage_file, stat_file, inactive_key in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat",
             "inactive_file"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
             "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file")):
        limit, usage = _read_int(Path(limit_file)), _read_int(Path(usage_file))
        if limit is None or usage is None or limit >= 2**60:  # "max", or v1's "no limit"
            continue
        inactive = 0
        try:
            for line in Path(stat_file).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_key and value.strip().isdigit():
                    inactive = int(value)
        except OSError:
            pass
        return max(0, limit - max(0, usage - inactive))
    return None


def available_host_memory() -> int | None:
    """Bytes of RAM this process can still get: the kernel's MemAvailable, lowered to the cgroup's limit
    where one is set (a container); ``None`` where neither can be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            available = None
    cgroup = _cgroup_available()
    if cgroup is not None:
        available = cgroup if available is None else min(available, cgroup)
    return available


def _gib(value: int) -> str:
    return f"{value / _GIB:,.1f} GiB"


def _refuse(config: MoEConfig, what: str, need: int, have: int, parts: list[tuple[str, int]], verify: bool,
            needs: MemoryNeeds) -> None:
    if need <= have:
        return
    shown = ", ".join(f"{name} {_gib(value)}" for name, value in parts if value)
    advice = "lower hidden, ffn, experts or tokens_per_rank"
    if verify and needs.verification and need - needs.verification <= have:
        advice = f"pass --no-verify (the float64 check alone needs {_gib(needs.verification)}) or " + advice
    raise ValueError(f"the config needs at least {_gib(need)} of {what} ({shown}) but {_gib(have)} is available "
                     f"(hidden={config.hidden}, ffn={config.ffn}, experts={config.experts}, "
                     f"tokens_per_rank={config.tokens_per_rank}, world_size={config.world_size}, "
                     f"dtype={config.dtype}); {advice}")


def check_memory(config: MoEConfig, *, verify: bool, in_process: bool, device: torch.device | None = None,
                 local_ray: bool = False, gpu_workers: bool = False, ranks_per_gpu: int = 1) -> MemoryNeeds:
    """Refuse a run whose memory needs (:func:`memory_needs`) exceed what this machine has.

    Args:
        config: the run.
        verify: the float64 verification runs (in this process, on the CPU).
        in_process: every rank runs in this process, on ``device`` (``cpu`` or ``cuda[:i]``).
        device: the in-process ranks' device.
        local_ray: the Ray workers run on this machine (an embedded Ray).
        gpu_workers: those workers run on GPUs (else on the CPU, in this machine's RAM).
        ranks_per_gpu: workers sharing one GPU (``1 / --gpus-per-worker``).

    Raises:
        ValueError: naming the memory needed, its parts, what is available, and what to change.
    """
    needs = memory_needs(config, verify=verify)
    host = available_host_memory()
    if in_process and device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        _refuse(config, f"memory on {device}", needs.all_ranks_step, free,
                [("weights, gradients and activations of a step", needs.all_ranks_step)], verify, needs)
        if host is not None:
            _refuse(config, "host memory", needs.verification, host,
                    [("float64 verification", needs.verification)], verify, needs)
        return needs
    if in_process:
        need = max(needs.all_ranks_step, needs.weights + needs.verification)
        if need == needs.all_ranks_step:
            parts = [("weights, gradients and activations of a step", needs.all_ranks_step)]
        else:  # the in-process ranks keep their weights while the float64 check runs
            parts = [("weights", needs.weights), ("float64 verification", needs.verification)]
        if host is not None:
            _refuse(config, "host memory", need, host, parts, verify, needs)
        return needs
    host_parts = [("float64 verification", needs.verification)]
    if local_ray and gpu_workers and torch.cuda.is_available():
        smallest = min(torch.cuda.get_device_properties(index).total_memory
                       for index in range(torch.cuda.device_count()))
        need = needs.rank_step * max(1, ranks_per_gpu)
        _refuse(config, "memory on each GPU", need, smallest,
                [(f"{max(1, ranks_per_gpu)} rank(s)' weights, gradients and activations", need)], verify, needs)
    elif local_ray:
        host_parts.insert(0, (f"{config.world_size} workers' weights, gradients and activations",
                              config.world_size * needs.rank_step))
    if host is not None:
        _refuse(config, "host memory", sum(value for _, value in host_parts), host, host_parts, verify, needs)
    return needs


# -- the Ray cluster's address --------------------------------------------------------------------


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``HOST:PORT`` or ``ray://HOST:PORT`` (IPv6 hosts in brackets), else ``None``."""
    rest = address.removeprefix("ray://")
    if "://" in rest or "/" in rest:
        return None
    host, separator, port = rest.rpartition(":")
    host = host.strip("[]")
    if not separator or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _auto_address() -> str:
    """The address ``ray.init(address="auto")`` would join, found the way Ray finds it; raises ConnectionError
    when there is none."""
    from ray._private import services  # Ray's own lookup: RAY_ADDRESS, then the cluster `ray start` recorded

    return services.canonicalize_bootstrap_address("auto")


#: Seconds the address check waits silently before saying what it is waiting for.
_QUIET_WAIT_S = 0.5

#: An HTTP/2 client's first bytes: the connection preface and an empty SETTINGS frame. Every gRPC server (the
#: GCS, the Ray Client server) answers with a SETTINGS frame of its own; a web server or anything else does not.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_HTTP2_SETTINGS = 4


class _NotGrpc(Exception):
    """Something answered at the address, but not a gRPC server."""


def _greet(connection: socket.socket) -> None:
    """Raise :class:`_NotGrpc` unless the peer answers an HTTP/2 preface with a SETTINGS frame."""
    connection.sendall(_HTTP2_HELLO)
    header = b""
    while len(header) < 9:
        chunk = connection.recv(9 - len(header))
        if not chunk:
            break
        header += chunk
    if len(header) < 9 or header[3] != _HTTP2_SETTINGS:
        raise _NotGrpc(header[:40])


def _probe(host: str, port: int, timeout_s: float, notice: Callable[[str], None] | None) -> BaseException | None:
    """``None`` if a gRPC server answers at ``host:port`` within ``timeout_s`` (a TCP connection only, where
    Ray uses TLS), else the error. Name resolution runs in the same bounded thread; the caller's thread waits
    interruptibly (Ctrl-C works)."""
    outcome: dict[str, BaseException | None] = {}
    tls = os.environ.get("RAY_USE_TLS", "").lower() in ("1", "true")

    def connect() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as connection:
                if not tls:
                    _greet(connection)
            outcome["error"] = None
        except BaseException as error:  # reported to the waiting thread
            outcome["error"] = error

    thread = threading.Thread(target=connect, name="flashdmoe-address-probe", daemon=True)
    thread.start()
    thread.join(min(timeout_s, _QUIET_WAIT_S))
    if thread.is_alive():
        if notice is not None:
            notice(f"waiting up to {timeout_s:g} s for {host}:{port} to answer (--connect-timeout; Ctrl-C stops)")
        thread.join(timeout_s - _QUIET_WAIT_S)
    if "error" not in outcome:
        return TimeoutError(f"no answer within {timeout_s:g} s")
    return outcome["error"]


def check_ray_address(address: str | None, *, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                      notice: Callable[[str], None] | None = None) -> str | None:
    """Check that the Ray cluster a run will join answers, within ``timeout_s``.

    ``address`` is ``--address``: ``None`` or ``"local"`` (an embedded Ray, unless ``RAY_ADDRESS`` names a
    cluster, as inside ``ray job submit``), ``"auto"`` (the cluster Ray finds: ``RAY_ADDRESS``, else the
    one ``ray start`` recorded on this node), ``HOST:PORT`` (the GCS) or ``ray://HOST:PORT`` (Ray Client).
    ``notice`` is told what the check waits for when the answer does not come at once.

    Returns:
        The ``host:port`` checked, or ``None`` when the run starts its own Ray.

    Raises:
        ValueError: naming the address and the cause: malformed, no cluster found for ``auto``, a host that
            does not resolve, nothing answering within ``timeout_s``, or something that is not a gRPC server
            (a web server, the dashboard's port).
    """
    option = "--address" if address is not None else "RAY_ADDRESS"
    environment = os.environ.get("RAY_ADDRESS") or None
    if address in (None, "auto") and environment is not None:
        address, option = environment, "RAY_ADDRESS"  # Ray's rule: the variable wins over None and "auto"
    if address is None or address == "local":
        return None
    if address == "auto":
        try:
            found = _auto_address()
        except ConnectionError:
            raise ValueError("--address auto: no Ray cluster found on this node (RAY_ADDRESS is not set and no "
                             "`ray start` cluster is running here); start one with `ray start --head`, name one "
                             "with --address HOST:PORT, or drop --address to run on an embedded Ray") from None
        except (ImportError, AttributeError):
            return None  # Ray's lookup moved: ray.init says what it finds
        target = _host_port(found or "")
        if target is None:
            return None
    else:
        target = _host_port(address)
        if target is None:
            if option == "RAY_ADDRESS":
                return None  # a form this check does not know; Ray may
            hint = " (an http:// address is the dashboard's, for `ray job submit`)" if "://" in address else ""
            raise ValueError(f"--address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT{hint}")
    host, port = target
    shown = f"{option} {address}" if address != "auto" else f"--address auto ({host}:{port})"
    error = _probe(host, port, timeout_s, notice)
    if error is None:
        return f"{host}:{port}"
    if isinstance(error, socket.gaierror):
        raise ValueError(f"{shown}: the host {host!r} does not resolve ({error.strerror})")
    if isinstance(error, _NotGrpc):
        which = " (8265 is the dashboard's port, for `ray job submit`)" if port == 8265 else ""
        raise ValueError(f"{shown}: something answers there, but not a Ray cluster (no gRPC server){which}; give "
                         "the cluster's GCS address (port 6379 by default, as `ray start --head` prints it)")
    if isinstance(error, (TimeoutError, socket.timeout)):
        reason = f"no answer within {timeout_s:g} s (--connect-timeout)"
    elif isinstance(error, OSError):
        reason = f"nothing answers there ({error.strerror or error})"
    else:
        reason = f"cannot connect ({type(error).__name__}: {error})"
    raise ValueError(f"{shown}: {reason}; start the cluster (`ray start --head --port {port}`) or check the "
                     "address")


def ranks_per_gpu(gpus_per_worker: float | None) -> int:
    """Workers sharing one GPU at ``--gpus-per-worker`` (default 1)."""
    return 1 if not gpus_per_worker else max(1, math.floor(1 / gpus_per_worker + 1e-9))
