"""An embedded Ray that only this machine, and only callers holding its token, can use.

:func:`start_embedded_ray` is what ``flashdmoe run`` (and :class:`ray_actors.cluster.MoECluster` without an
address) starts. Two things are switched on, both Ray's own mechanisms (Ray >= 2.52; docs/deploy.md):

* **Token authentication**: every gRPC call to the GCS, raylets and workers, and every dashboard /
  job-server request, must carry the cluster's token. Ray >= 2.59 turns it on for clusters ``ray.init()``
  starts unless ``RAY_AUTH_MODE`` says otherwise (``RAY_AUTH_MODE=disabled`` is the opt-out, and is
  respected, with a warning here); the mode must be in the environment before Ray is imported, as Ray
  reads it once. The token comes from ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``, else
  ``~/.ray/auth_token``, where ``ray.init()`` writes a new random one when none exists; ``ray
  get-auth-token`` prints it. The processes the cluster starts inherit the mode and the token source.
* **Loopback addresses**: ``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough, because Ray
  replaces a loopback node address by the machine's routable one, and its servers then listen on that
  (or on every interface). Ray keeps 127.0.0.1 only where multi-node clusters are switched off
  (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the default on macOS and Windows), which this module does for
  the duration of ``ray.init``: the GCS, raylet, dashboard agent, runtime-env agent and every worker then
  listen on 127.0.0.1 only. Joining other clusters later in the process is unaffected.

A ``ray.init`` that stops part-way (interrupted, or a process that does not come up) can leave processes
that ``ray.shutdown`` does not know of: the node is only recorded once every process has started, a process
whose start was interrupted is never recorded, and what it started in turn (the raylet's agents) outlives
it. :func:`start_embedded_ray` then shuts Ray down and kills whatever is left of what the call started.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import ray
from ray._private import ray_constants

__all__ = ["AUTH_MODE_ENV", "SINGLE_NODE_ENV", "loopback_node", "start_embedded_ray"]

logger = logging.getLogger(__name__)

#: Ray's authentication switch: ``token`` or ``disabled``.
AUTH_MODE_ENV = "RAY_AUTH_MODE"
#: Ray's multi-node switch; ``0`` keeps a node's address on loopback.
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """Around a ``ray.init`` that starts a node: keep its address 127.0.0.1.

    Ray reads the switch into a module constant at import, so the constant is set too (and both are put
    back afterwards); the processes started inside inherit the environment variable.
    """
    saved_env, saved_constant = os.environ.get(SINGLE_NODE_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[SINGLE_NODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_constant
        if saved_env is None:
            os.environ.pop(SINGLE_NODE_ENV, None)
        else:
            os.environ[SINGLE_NODE_ENV] = saved_env


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of this machine's processes; empty without /proc."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                stat = file.read()
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                cmdline = file.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        # the command name in parentheses may hold spaces: the fields after its last ")" are fixed
        table[int(entry)] = (int(stat[stat.rindex(")") + 2:].split()[1]), cmdline)
    return table


def _started_ray_processes(children_before: set[int]) -> dict[int, str]:
    """pid -> command line of Ray's processes started by this process since ``children_before`` (its
    children then), with all their descendants (agents, workers: retitled, they no longer name Ray's files)."""
    table = _process_table()
    ray_dir = os.path.dirname(os.path.abspath(ray.__file__))
    found = {pid for pid, (ppid, cmdline) in table.items()
             if ppid == os.getpid() and pid not in children_before and ray_dir in cmdline}
    frontier = found
    while frontier:
        frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return {pid: table[pid][1] for pid in found}


def _stop_failed_start(children_before: set[int]) -> None:
    """After a ``ray.init`` that raised: ``ray.shutdown()``, then kill whatever it left of what ``ray.init``
    started, including the processes that had already lost their parent."""
    started = _started_ray_processes(children_before)  # before the shutdown orphans the raylet's agents
    try:
        ray.shutdown()
    except Exception as error:  # the error of ray.init is the one to report
        logger.debug("ray.shutdown after a failed ray.init: %s", error)
    table = _process_table()
    left = {pid for pid, cmdline in started.items() if pid in table and table[pid][1] == cmdline}
    stopped: set[int] = set()
    # stopped before any is killed, so that none starts another meanwhile
    while new := (left | set(_started_ray_processes(children_before))) - stopped:
        for pid in new:
            with contextlib.suppress(OSError):  # exited meanwhile
                os.kill(pid, signal.SIGSTOP)
        stopped |= new
        left = set()
    for pid in stopped:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if stopped:
        logger.debug("killed %d process(es) left by an embedded Ray that did not start", len(stopped))


def start_embedded_ray(**init_options: Any) -> None:
    """``ray.init`` a new single-node cluster on 127.0.0.1 with token authentication, no dashboard.

    ``init_options`` go to ``ray.init`` (``num_cpus``, ``runtime_env``, ``logging_level``...). When
    ``ray.init`` raises (``KeyboardInterrupt`` included), Ray is shut down and every process it started is
    gone before the exception propagates.
    """
    children_before = {pid for pid, (ppid, _) in _process_table().items() if ppid == os.getpid()}
    try:
        with loopback_node():
            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, **init_options)
    except BaseException:
        _stop_failed_start(children_before)
        raise
    # ray.init leaves the mode it started the cluster with in the environment
    if os.environ.get(AUTH_MODE_ENV, "").lower() != "token":
        logger.warning("the embedded Ray runs without token authentication (%s=%s): any local user can "
                       "run code in it", AUTH_MODE_ENV, os.environ.get(AUTH_MODE_ENV))
    address = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(address).is_loopback:
        logger.warning("this Ray (%s) put the embedded cluster on %s, not on loopback: other hosts can reach "
                       "it", ray.__version__, address)
