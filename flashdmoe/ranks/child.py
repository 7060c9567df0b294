"""One rank process: ``python -m flashdmoe.ranks <workdir>/rank<r>.spec.json`` (started by
:func:`flashdmoe.ranks.launcher.run_ranks`).

With an NVSHMEM team (the spec's ``nvshmem``): the rank loads the CUDA extension, then rank 0 makes the
unique id (:meth:`flashdmoe.parallel.team.Team.make_unique_id`: only a process with nvshmem can) and publishes it in
the run directory by an atomic rename; the other ranks poll for it (bounded wait, then a clear error; they
stop early when rank 0 reports a failure). Every rank joins the team (:meth:`Team.nvshmem
<flashdmoe.parallel.team.Team.nvshmem>`) and meets the others at a barrier. Without a team the ids are random bytes
handed over the same way (so the hand-over itself is tested on a CPU machine).

Then the rank calls its scenario, a function ``(RankContext) -> ScenarioOutput | dict`` named
``"package.module:function"`` by the spec, and writes its results or its exception into the run directory
(:mod:`flashdmoe.ranks.workdir`). Scenarios are found by that dotted name only, so one may live in any
package that the rank can import.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashdmoe.ranks.problem import DTYPES
from flashdmoe.ranks.workdir import SPEC_VERSION, UID_FILE, RankFiles, read_json, write_bytes, write_json
from flashdmoe.parallel.team import UNIQUE_ID_BYTES

__all__ = [
    "MULTICAST_OFF_ENV",
    "RankContext",
    "ScenarioOutput",
    "error_info",
    "main",
    "publish_uid",
    "resolve_scenario",
    "run_rank",
    "synchronize",
    "wait_for_uid",
]

#: In every rank's environment: NVLink multicast (NVLS) stays off for NVSHMEM, NCCL and torch.
MULTICAST_OFF_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@dataclass
class RankContext:
    """What a scenario function receives in a rank process.

    rank / world_size: this process's rank of ``P``; params: the scenario's JSON parameters; team: the
    :class:`flashdmoe.parallel.team.Team` (``None`` when the run has no NVSHMEM team); device: the CUDA device
    (``None`` without a team); workdir: the run directory; spec: the whole spec; uid: the unique id rank 0
    published.
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

    def enter_phase(self, text: str) -> None:
        """Record the step this rank is in (shown if the rank hangs or fails)."""
        self.current_phase = text
        write_json(RankFiles(self.workdir, self.rank).phase, {"phase": text, "time": time.time()})


@dataclass
class ScenarioOutput:
    """A scenario's results: tensors (moved to the CPU and ``torch.save``-d) and JSON-able info."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def synchronize(device: torch.device | None) -> None:
    """Wait for this rank's GPU work and raise what its fused launches reported (scenarios also run on the
    CPU, with a stand-in team in tests)."""
    if device is not None and device.type == "cuda":
        import flashdmoe

        flashdmoe.synchronize(device)


def error_info(error: BaseException) -> dict[str, str]:
    """An exception as JSON: its type, the type's module and its message."""
    return {"type": type(error).__name__, "module": type(error).__module__, "message": str(error)}


def publish_uid(workdir: Path, data: bytes) -> None:
    """Rank 0: hand the unique id to the other ranks (atomic: a reader sees the whole id or no file)."""
    write_bytes(workdir / UID_FILE, data)


def wait_for_uid(workdir: Path, timeout_s: float, poll_s: float = 0.05) -> bytes:
    """Ranks 1..: the id rank 0 published. Raises RuntimeError when rank 0 finished without one, and
    TimeoutError (naming rank 0's last phase) after ``timeout_s``."""
    path = workdir / UID_FILE
    rank0 = RankFiles(workdir, 0)
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists():
            data = path.read_bytes()
            if len(data) != UNIQUE_ID_BYTES:
                raise RuntimeError(f"{path} holds {len(data)} bytes; expected a {UNIQUE_ID_BYTES}-byte unique id")
            return data
        if rank0.status.exists():
            status = read_json(rank0.status)
            why = (f"{status.get('error_type')}: {status.get('error_message')}" if isinstance(status, dict)
                   else "its status file is unreadable")
            raise RuntimeError(f"rank 0 finished without publishing the unique id ({why})")
        if time.monotonic() >= deadline:
            phase = read_json(rank0.phase) or {}
            raise TimeoutError(
                f"no unique id from rank 0 at {path} after {timeout_s:g} s "
                f"(rank 0's last phase: {phase.get('phase', 'unknown: it never started')!r})"
            )
        time.sleep(poll_s)


def resolve_scenario(target: str) -> Callable[[RankContext], Any]:
    """The function named ``"package.module:function"``."""
    module_name, colon, attribute = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not (module_name and colon and attribute):
        raise ValueError(f"scenario function {target!r}: expected 'package.module:function'")
    function = getattr(importlib.import_module(module_name), attribute, None)
    if not callable(function):
        raise ValueError(f"scenario function {target!r}: {module_name} has no function {attribute!r}")
    return function


def _join_team(context: RankContext, spec: dict[str, Any], uid_timeout_s: float):
    from flashdmoe.kernel import extension
    from flashdmoe.parallel.team import Team

    context.device = torch.device("cuda", int(spec.get("device", 0)))
    torch.cuda.set_device(context.device)
    # Before the team: a rank that builds or loads the extension must not keep peers spinning inside the
    # collective init, nor inside the first kernel's watchdog.
    context.enter_phase("loading the CUDA extension")
    extension.load()
    if context.rank == 0:
        context.enter_phase("making the unique id")
        context.uid = Team.make_unique_id()
        publish_uid(context.workdir, context.uid)
    else:
        context.enter_phase("waiting for rank 0's unique id")
        context.uid = wait_for_uid(context.workdir, uid_timeout_s)
    sizes = dict(spec["team"])
    sizes["dtype"] = DTYPES[sizes["dtype"]]
    context.enter_phase("joining the NVSHMEM team (collective)")
    context.team = Team.nvshmem(context.uid, context.rank, context.world_size, device=context.device, **sizes)
    context.enter_phase("barrier after joining the team")
    context.team.barrier()
    synchronize(context.device)


def run_rank(spec: dict[str, Any]) -> int:
    """Everything a rank does; returns its exit code (results and errors go to the run directory)."""
    rank, world_size = spec["rank"], spec["world_size"]
    workdir = Path(spec["workdir"])
    files = RankFiles(workdir, rank)
    context = RankContext(rank, world_size, dict(spec.get("params") or {}), None, None, workdir, spec)
    context.enter_phase("starting")
    code = 0
    try:
        for name, value in MULTICAST_OFF_ENV.items():
            os.environ.setdefault(name, value)
        scenario = resolve_scenario(spec["function"])
        uid_timeout_s = float(spec.get("uid_timeout_s", 120.0))
        if spec.get("nvshmem", True):
            _join_team(context, spec, uid_timeout_s)
        elif rank == 0:
            context.uid = os.urandom(UNIQUE_ID_BYTES)
            publish_uid(workdir, context.uid)
        else:
            context.enter_phase("waiting for rank 0's unique id")
            context.uid = wait_for_uid(workdir, uid_timeout_s)
        context.enter_phase(f"scenario {spec['scenario']}")
        output = scenario(context)
        if isinstance(output, dict):
            output = ScenarioOutput(info=output)
        if not isinstance(output, ScenarioOutput):
            raise TypeError(f"scenario {spec['scenario']!r} returned {type(output).__name__}; "
                            "expected ScenarioOutput or a dict")
        context.enter_phase("writing results")
        tensors = {name: t.detach().cpu() for name, t in output.tensors.items()}
        tmp = workdir / f".{files.tensors.name}.tmp"
        torch.save(tensors, tmp)
        os.replace(tmp, files.tensors)
        write_json(files.status, {"rank": rank, "status": "ok", "info": output.info})
    except BaseException as error:  # reported to the parent, whatever it was
        code = 1
        write_json(files.status, {
            "rank": rank, "status": "error", "error_type": type(error).__name__,
            "error_module": type(error).__module__, "error_message": str(error),
            "traceback": traceback.format_exc(), "phase": context.current_phase,
        })
    if context.team is not None:
        context.enter_phase("closing the team")
        try:
            context.team.close()
        except BaseException as error:
            code = code or 3
            write_json(files.teardown, error_info(error) | {"traceback": traceback.format_exc()})
    context.enter_phase("exiting")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flashdmoe.ranks SPEC.json``: run one rank as the spec says (see the module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m flashdmoe.ranks SPEC.json (written by flashdmoe.ranks.launcher.run_ranks)",
              file=sys.stderr)
        return 2
    try:
        spec = json.loads(Path(argv[0]).read_text())
        if not isinstance(spec, dict):
            raise ValueError(f"expected a JSON object, not {type(spec).__name__}")
        if spec.get("version") != SPEC_VERSION:
            raise ValueError(f"spec version {spec.get('version')!r}: expected {SPEC_VERSION}")
        for key in ("rank", "world_size", "workdir", "scenario", "function"):
            if key not in spec:
                raise ValueError(f"spec: missing {key!r}")
    except (OSError, ValueError) as error:
        print(f"flashdmoe.ranks: bad spec {argv[0]}: {error}", file=sys.stderr)
        return 2
    return run_rank(spec)
