"""The parent of a multi-process run: :func:`run_ranks` starts ``P`` rank processes, waits for them and
collects what each did.

It never touches CUDA itself, so it may run before or beside other GPU work. Unless given a daemon or told
not to, it starts a CUDA MPS control daemon (:class:`flashdmoe.parallel.mps.MpsDaemon`) so that several ranks share
one GPU, each with ``100 // P`` percent of its SMs (so every rank's persistent kernel is resident at once);
with ``one_gpu_per_rank`` it runs one process per GPU without MPS. It writes one spec per rank into a fresh
run directory (:mod:`flashdmoe.ranks.workdir`) and starts::

    python -m flashdmoe.ranks <workdir>/rank<r>.spec.json

(:mod:`flashdmoe.ranks.child`). It then waits with a timeout, kills the ranks still running when the time is
up (or a while after another rank failed, or after every rank wrote its results) and returns a
:class:`RunResult`: per rank a :class:`RankOutcome` (ok, error, hung or crashed, with the phase it was in).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashdmoe.ranks.child import MULTICAST_OFF_ENV
from flashdmoe.ranks.problem import DTYPES, Problem
from flashdmoe.ranks.scenarios import SCENARIOS
from flashdmoe.ranks.workdir import SPEC_VERSION, RankFiles, read_json
from flashdmoe.parallel.team import MAX_RANKS

__all__ = ["RankOutcome", "RanksFailed", "RunResult", "nvshmem_unavailable_reason", "run_ranks", "scenario_target"]

#: ``python -m`` this package runs one rank (its ``__main__``).
CHILD_MODULE = "flashdmoe.ranks"
LOG_TAIL_LINES = 40
TEAM_SIZES = ("max_tokens", "hidden", "top_k", "local_experts", "dtype")


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
    """Why a rank process cannot use NVSHMEM (``import nvshmem.core`` of the nvshmem4py package fails), or
    None. Checked in a subprocess so this process loads nothing."""
    command = [python or sys.executable, "-c", "import nvshmem.core"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot check for nvshmem4py: {error}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"nvshmem4py is not importable ({last})"
    return None


def scenario_target(scenario: str | Callable) -> tuple[str, str]:
    """``(name, "package.module:function")`` of a scenario given as a :data:`SCENARIOS` name, as
    ``"package.module:function"``, or as a function defined at the top level of an importable module."""
    if callable(scenario):
        module = getattr(scenario, "__module__", None)
        qualname = getattr(scenario, "__qualname__", "")
        if not module or module == "__main__" or not qualname.isidentifier():
            raise ValueError(f"scenario={scenario!r}: expected a function defined at the top level of an "
                             "importable module (the rank processes import it by name)")
        return qualname, f"{module}:{qualname}"
    if isinstance(scenario, str):
        if scenario in SCENARIOS:
            function = SCENARIOS[scenario]
            return scenario, f"{function.__module__}:{function.__qualname__}"
        module, colon, attribute = scenario.partition(":")
        if module and colon and attribute:
            return scenario, scenario
    raise ValueError(f"scenario={scenario!r}: expected one of {sorted(SCENARIOS)}, 'package.module:function' "
                     "or such a function")


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])  # <root>/flashdmoe/ranks/launcher.py


def _child_env(mps_daemon, world_size: int, extra: Mapping[str, str] | None) -> dict[str, str]:
    if mps_daemon is not None:
        env = dict(mps_daemon.client_env(100 // world_size))
    else:
        env = dict(os.environ)
    env.update(MULTICAST_OFF_ENV)
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


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")


def _positive_seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: expected a number of seconds > 0")
    return float(value)


@dataclass(frozen=True)
class _Limits:
    """How long a run may take (see :func:`run_ranks`)."""

    timeout_s: float
    failure_grace_s: float
    teardown_grace_s: float


def _team_sizes(params: Mapping[str, Any], team: Mapping[str, Any] | None, world_size: int) -> dict[str, Any]:
    if team is None:
        if "problem" not in params:
            raise ValueError("team: required (Team.nvshmem sizes) when params has no 'problem'")
        problem = Problem.from_dict(params["problem"])
        if problem.world_size != world_size:
            raise ValueError(f"params['problem']: tokens for {problem.world_size} ranks, but world_size={world_size}")
        team = problem.team_kwargs()
    team = dict(team)
    missing = set(TEAM_SIZES) - set(team)
    if missing:
        raise ValueError(f"team: missing {sorted(missing)}")
    if team["dtype"] not in DTYPES:
        raise ValueError(f"team['dtype']={team['dtype']!r}: expected one of {tuple(DTYPES)}")
    return team


def run_ranks(
    scenario: str | Callable,
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
        scenario: a name in :data:`~flashdmoe.ranks.scenarios.SCENARIOS`, ``"package.module:function"``,
            or such a function (called in each rank with a :class:`~flashdmoe.ranks.child.RankContext`,
            returning a :class:`~flashdmoe.ranks.child.ScenarioOutput` or a dict of JSON-able info).
        world_size: ``P`` processes, 1 to ``MAX_RANKS``.
        params: JSON-able scenario parameters.
        team: sizes for :meth:`Team.nvshmem <flashdmoe.parallel.team.Team.nvshmem>` (``max_tokens``, ``hidden``,
            ``top_k``, ``local_experts``, ``dtype`` by name); default: ``Problem(**params["problem"]).team_kwargs()``.
        nvshmem: False runs the scenario with no team (and no GPU set-up): ``selftest``.
        mps: True starts (and stops) an MPS daemon for this run; an :class:`~flashdmoe.parallel.mps.MpsDaemon`
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
    name, function = scenario_target(scenario)
    _require_int("world_size", world_size, 1)
    if world_size > MAX_RANKS:
        raise ValueError(f"world_size={world_size}: expected at most {MAX_RANKS}")
    limits = _Limits(_positive_seconds("timeout_s", timeout_s), _positive_seconds("failure_grace_s", failure_grace_s),
                     _positive_seconds("teardown_grace_s", teardown_grace_s))
    uid_timeout_s = _positive_seconds("uid_timeout_s", uid_timeout_s)
    _require_int("device", device, 0)
    if not isinstance(one_gpu_per_rank, bool):
        raise ValueError(f"one_gpu_per_rank={one_gpu_per_rank!r}: expected True or False")
    if one_gpu_per_rank and not (mps is False or mps is None):
        raise ValueError("mps: one_gpu_per_rank=True runs one process per GPU without MPS; pass mps=False")
    if not (mps is True or mps is False or mps is None or hasattr(mps, "client_env")):
        raise ValueError(f"mps={mps!r}: expected True, False/None or a started flashdmoe.parallel.mps.MpsDaemon")
    params = dict(params or {})
    try:
        json.dumps(params)
    except (TypeError, ValueError) as error:
        raise ValueError(f"params: expected JSON-able values ({error})") from None
    team_sizes = _team_sizes(params, team, world_size) if nvshmem else None

    own_dir = workdir is None
    root = Path(tempfile.mkdtemp(prefix="flashdmoe-ranks-")) if own_dir else Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    specs = [{
        "version": SPEC_VERSION, "scenario": name, "function": function, "rank": rank, "world_size": world_size,
        "workdir": str(root), "nvshmem": bool(nvshmem), "team": team_sizes, "params": params,
        "device": device + rank if one_gpu_per_rank else device, "uid_timeout_s": uid_timeout_s,
    } for rank in range(world_size)]
    try:
        with contextlib.ExitStack() as stack:
            if mps is True:
                from flashdmoe.parallel.mps import MpsDaemon

                daemon = stack.enter_context(MpsDaemon())
            elif mps is False or mps is None:
                daemon = None
            else:
                daemon = mps
            outcomes, elapsed = _launch_and_join(specs, root, _child_env(daemon, world_size, env),
                                                 python or sys.executable, limits)
            result = RunResult(name, world_size, outcomes, elapsed, daemon is not None)
            if not result.ok and daemon is not None and hasattr(daemon, "log_tail"):
                result.mps_log = daemon.log_tail()
            return result
    finally:
        if own_dir and not keep_workdir:
            shutil.rmtree(root, ignore_errors=True)


def _first_failed_rank(codes: list[int | None], statuses: list[Any]) -> int | None:
    for rank, (code, status) in enumerate(zip(codes, statuses)):
        if code not in (None, 0) or (status is not None and status.get("status") != "ok"):
            return rank
    return None


def _launch_and_join(specs: list[dict[str, Any]], root: Path, child_env: dict[str, str], python: str,
                     limits: _Limits) -> tuple[list[RankOutcome], float]:
    """Start one process per spec, wait within ``limits`` (killing the stragglers), collect the outcomes."""
    files = [RankFiles(root, spec["rank"]) for spec in specs]
    processes: list[subprocess.Popen] = []
    logs = []
    started = time.monotonic()
    kill_reasons: dict[int, str] = {}
    try:
        for spec, rank_files in zip(specs, files):
            rank_files.spec.write_text(json.dumps(spec, indent=1))
            log = rank_files.log.open("wb")
            logs.append(log)
            processes.append(subprocess.Popen(
                [python, "-m", CHILD_MODULE, str(rank_files.spec)],
                env=child_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            ))
        deadline = started + limits.timeout_s
        first_failure: tuple[int, float] | None = None
        all_reported_at: float | None = None
        while True:
            codes = [process.poll() for process in processes]
            if all(code is not None for code in codes):
                break
            now = time.monotonic()
            statuses = [read_json(rank_files.status) for rank_files in files]
            if first_failure is None:
                failed = _first_failed_rank(codes, statuses)
                if failed is not None:
                    first_failure = (failed, now)
            if all_reported_at is None and all(status is not None for status in statuses):
                all_reported_at = now
            reason = None
            if now >= deadline:
                reason = f"still running when the {limits.timeout_s:g} s timeout expired"
            elif first_failure is not None and now - first_failure[1] >= limits.failure_grace_s:
                reason = f"still running {limits.failure_grace_s:g} s after rank {first_failure[0]} failed"
            elif all_reported_at is not None and now - all_reported_at >= limits.teardown_grace_s:
                reason = f"still running {limits.teardown_grace_s:g} s after every rank wrote its results"
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
    outcomes = [_collect(rank_files, processes[rank].returncode, kill_reasons.get(rank))
                for rank, rank_files in enumerate(files)]
    return outcomes, elapsed


def _collect(files: RankFiles, returncode: int | None, kill_reason: str | None) -> RankOutcome:
    status = read_json(files.status)
    phase = (read_json(files.phase) or {}).get("phase")
    outcome = RankOutcome(rank=files.rank, status="ok", returncode=returncode, phase=phase,
                          kill_reason=kill_reason, log_tail=_tail(files.log))
    if status is not None:
        outcome.info = status.get("info") or {}
        if status.get("status") != "ok":
            outcome.status = "error"
            outcome.error_type = status.get("error_type")
            outcome.error_message = status.get("error_message")
            outcome.traceback = status.get("traceback")
            outcome.phase = status.get("phase") or phase
        if files.tensors.exists():
            outcome.tensors = torch.load(files.tensors, map_location="cpu", weights_only=True)
    teardown = read_json(files.teardown)
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
