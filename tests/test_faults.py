"""Fault injection on the Ray executor: a real local Ray on 127.0.0.1, CPU workers over gloo.

Each fault has its expected outcome asserted, a time bound, and a check that no process is left behind:

- a worker killed (SIGKILL) in the middle of a step: ``worker_died``, noticed before the bound on a step,
  the team replaced, the step retried and verified;
- a worker stopped (SIGSTOP) in the middle of a step, i.e. hung: ``timeout`` naming that rank, noticed
  within the bound (``step_timeout_s``; the other rank's gloo collective gives up first), the stopped
  process killed, the step retried and verified; the same through ``flashdmoe run`` with the worker
  stopped from outside, reported in the table and ``results.json``;
- a slow worker (the ``stall`` test hook): one slower than the bound is a hang like the above, one within
  it is not a fault;
- retries spent on a hang: ``WorkerFault`` within the bound, and the hung worker killed at close;
- an interrupt (SIGINT) while a worker hangs, during startup and in the middle of a run: the driver stops
  promptly (``flashdmoe run`` exits 130) and Ray's processes are gone; also one whose KeyboardInterrupt
  Python drops (raised in an at-fork callback while ray.init forks the raylet; flashdmoe.interrupts);
- an address where nothing listens: exit 2 within seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray

from flashdmoe import cli
from flashdmoe.config import MoEConfig
from flashdmoe.job import ClusterUnreachable, WorkerFault
from flashdmoe.job.verification import verify_step
from job_checks import check_results_schema
from ray_actors import cluster as ray_cluster
from ray_actors.cluster import MoECluster, default_step_timeout_s

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"

#: The bound on a step under test (the config's step_timeout_s); gloo's collectives give up after 3/4 of it.
STEP_TIMEOUT_S = 8.0
#: What a recovery may add to the bound: killing the team, placing and starting a new one (2 CPU cores).
RECOVERY_S = 60.0

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _config(**changes) -> MoEConfig:
    return MoEConfig.from_yaml(TINY).replace(step_timeout_s=STEP_TIMEOUT_S, **changes)


# -- processes -----------------------------------------------------------------------------------------------


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state letter, command line) of every process of this machine."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                stat = file.read()
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                cmdline = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited meanwhile
            continue
        # the command name in parentheses may hold spaces: the fields after its last ")" are fixed
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        table[int(entry)] = (int(ppid), state, cmdline)
    return table


def _descendants(root: int, table: dict[int, tuple[int, str, str]]) -> set[int]:
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def _running(pids) -> set[int]:
    """Those of ``pids`` still running (a zombie has exited: only its parent has not collected it yet)."""
    table = _processes()
    return {pid for pid in pids if pid in table and table[pid][1] != "Z"}


def _session_processes(temp_dir: str) -> set[int]:
    """Running processes of the Ray session under ``temp_dir`` (GCS, raylet, agents name it on their
    command lines)."""
    return {pid for pid, (_, state, cmdline) in _processes().items() if temp_dir in cmdline and state != "Z"}


def _assert_all_gone(pids, what: str, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := _running(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    table = _processes()
    assert not left, f"{what}: still running after {within_s:g}s: " + "; ".join(
        f"{pid} {table[pid][2][:120]!r}" for pid in sorted(left) if pid in table)


def _short_temp_dir() -> str:
    # Ray's unix socket paths must stay under 107 bytes: pytest's tmp_path is too deep
    return tempfile.mkdtemp(prefix="rayf", dir="/tmp")


def _fault(cluster: MoECluster, kind: str, ranks: list[int]) -> dict:
    """The cluster's one fault so far, checked to be a recovered ``kind`` on ``ranks``."""
    assert len(cluster.faults) == 1, cluster.faults
    fault = cluster.faults[0]
    assert fault["kind"] == kind and fault["ranks"] == ranks, fault
    assert fault["recovered"] is True and fault["generation"] == cluster.generation == 2, fault
    return fault


def _assert_hang_reports(fault: dict, hung: int, peer_may_finish: bool = False) -> None:
    """Rank ``hung`` never answered; the other's gloo collective gave up on it first (or, with
    ``peer_may_finish``, the other finished: the hung rank was stopped after its last exchange)."""
    reports = {report["rank"]: report for report in fault["reports"]}
    assert reports[hung]["error"] == "stuck", reports
    if peer_may_finish and set(reports) == {hung}:
        return
    assert set(reports) == {0, 1}, fault["reports"]
    other = reports[1 - hung]
    assert other["error"] == "CollectiveFailed" and "gloo collective failed" in other["message"], reports


def _assert_verified(cluster: MoECluster) -> None:
    """The new team computes step 0 correctly (float64 oracle, flashdmoe.reference) and steps normally."""
    verification = verify_step(cluster, 0)
    assert verification["passed"], verification
    assert cluster.step(2)["attempts"] == 1


def test_step_bound_defaults_and_bad_values(monkeypatch):
    """The bound on a step: derived from the layer's size unless the config sets it; on cuda at least twice
    the kernel's watchdog. Bad values are refused naming the field."""
    monkeypatch.delenv("FLASHDMOE_TIMEOUT_MS", raising=False)  # the watchdog's default, 10 s
    tiny = MoEConfig.from_yaml(TINY)
    assert tiny.step_timeout_s is None
    assert 20 < default_step_timeout_s(tiny, "reference") < 20.1  # well under a minute
    big = MoEConfig.from_yaml(REPO / "configs" / "h200x8.yaml")
    assert 20 < default_step_timeout_s(big, "cuda") < 22  # ~0.8 TFLOP a step at an assumed 1 TFLOP/s
    assert default_step_timeout_s(big, "reference") > 600  # a CPU step of that layer takes minutes
    monkeypatch.setenv("FLASHDMOE_TIMEOUT_MS", "30000")
    assert 60 < default_step_timeout_s(tiny, "cuda") < 61
    with pytest.raises(ValueError, match="backend='tpu'"):
        default_step_timeout_s(tiny, "tpu")
    assert tiny.replace(step_timeout_s=5).step_timeout_s == 5.0
    for bad in (0, -1.5, float("nan"), float("inf"), 10**400, True, "5"):
        with pytest.raises(ValueError, match="step_timeout_s="):
            tiny.replace(step_timeout_s=bad)
    with pytest.raises(ValueError, match="collective_timeout_s=30: expected at most call_timeout_s=10"):
        MoECluster(tiny, call_timeout_s=10, collective_timeout_s=30)
    with pytest.raises(ValueError, match="startup_timeout_s"):
        MoECluster(tiny, startup_timeout_s=0)
    assert not ray.is_initialized()  # all refused before Ray starts
    assert ray_cluster._host_and_port("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert ray_cluster._host_and_port("ray://head.example:10001") == ("head.example", 10001)
    assert ray_cluster._host_and_port("[::1]:6379") == ("::1", 6379)
    assert ray_cluster._host_and_port("head-without-port") is None


class TestFaultsOnEmbeddedRay:
    """One embedded Ray (127.0.0.1, 4 CPUs, its own temp dir) shared by these tests."""

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def local_ray(cls):
        temp_dir = _short_temp_dir()
        python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4,
                 _temp_dir=temp_dir, runtime_env={"env_vars": {"PYTHONPATH": python_path}})
        session = _session_processes(temp_dir)
        assert session, "no process of the Ray session found by its temp dir"
        try:
            yield
        finally:
            table = _processes()
            spawned = set().union(session, *(_descendants(pid, table) for pid in session))
            ray.shutdown()
            _assert_all_gone(spawned | _session_processes(temp_dir), "the test session's Ray processes")
            shutil.rmtree(temp_dir, ignore_errors=True)

    @pytest.mark.timeout(180)
    def test_worker_killed_mid_step_is_retried(self):
        with MoECluster(_config()) as cluster:
            assert cluster.call_timeout_s == STEP_TIMEOUT_S and cluster.collective_timeout_s == 0.75 * STEP_TIMEOUT_S
            cluster.step(0)
            victim = cluster.node_infos[1]["pid"]
            # rank 1 sleeps inside step 1 (its peer waits in the exchange) and is killed from outside meanwhile
            killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
            killer.start()
            try:
                started = time.monotonic()
                record = cluster.step(1, crash={"rank": 1, "at": "stall", "seconds": 120})
                elapsed = time.monotonic() - started
            finally:
                killer.cancel()
            assert record["attempts"] == 2 and record["step"] == 1
            fault = _fault(cluster, "worker_died", [1])
            assert fault["call"] == "step" and fault["step"] == 1 and fault["attempt"] == 0
            assert elapsed - fault["recovery_s"] < STEP_TIMEOUT_S  # the death is noticed, not the bound
            assert victim not in {info["pid"] for info in cluster.node_infos}
            _assert_verified(cluster)
        _assert_all_gone([victim], "the killed worker")

    @pytest.mark.timeout(180)
    def test_stopped_worker_is_detected_within_the_bound_and_retried(self):
        with MoECluster(_config()) as cluster:
            cluster.step(0)
            old_pids = [info["pid"] for info in cluster.node_infos]
            started = time.monotonic()
            record = cluster.step(1, crash={"rank": 1, "at": "stop"})  # SIGSTOP after its forward
            elapsed = time.monotonic() - started
            assert record["attempts"] == 2
            fault = _fault(cluster, "timeout", [1])
            assert fault["call"] == "step" and fault["step"] == 1 and fault["teams_closed"] is None
            assert "stopped answering" in fault["error"] and f"within {STEP_TIMEOUT_S:g}s" in fault["error"]
            _assert_hang_reports(fault, hung=1)
            detected = elapsed - fault["recovery_s"]
            assert STEP_TIMEOUT_S <= detected < STEP_TIMEOUT_S + 5, detected
            # the stopped process is killed with its team (by pid: it cannot act on Ray's request)
            _assert_all_gone(old_pids, "the hung team's workers", within_s=5)
            _assert_verified(cluster)

    @pytest.mark.timeout(180)
    def test_slow_worker_past_the_bound_is_retried_and_one_within_it_is_not(self):
        with MoECluster(_config()) as cluster:
            record = cluster.step(0, crash={"rank": 0, "at": "stall", "seconds": 1.0})
            assert record["attempts"] == 1 and cluster.faults == []
            old_pids = [info["pid"] for info in cluster.node_infos]
            started = time.monotonic()
            record = cluster.step(1, crash={"rank": 0, "at": "stall", "seconds": 3 * STEP_TIMEOUT_S})
            elapsed = time.monotonic() - started
            assert record["attempts"] == 2
            fault = _fault(cluster, "timeout", [0])
            _assert_hang_reports(fault, hung=0)
            assert STEP_TIMEOUT_S <= elapsed - fault["recovery_s"] < STEP_TIMEOUT_S + 5
            assert elapsed < 3 * STEP_TIMEOUT_S  # not waited out
            _assert_all_gone(old_pids, "the slow team's workers", within_s=5)
            _assert_verified(cluster)

    @pytest.mark.timeout(120)
    def test_hang_with_no_retries_left_fails_within_the_bound(self):
        cluster = MoECluster(_config(), max_retries=0)
        try:
            pids = [info["pid"] for info in cluster.node_infos]
            started = time.monotonic()
            with pytest.raises(WorkerFault, match=r"rank\(s\) \[1\] stopped answering during step") as raised:
                cluster.step(0, crash={"rank": 1, "at": "stall", "seconds": 120})
            assert STEP_TIMEOUT_S <= time.monotonic() - started < STEP_TIMEOUT_S + 5
            assert raised.value.kind == "timeout" and raised.value.ranks == [1]
            assert len(cluster.faults) == 1 and cluster.faults[0]["recovered"] is False
        finally:
            started = time.monotonic()
            cluster.close()  # the hung rank is still busy: killed, not asked to leave its team
            assert time.monotonic() - started < 10
        _assert_all_gone(pids, "the workers after close")

    @pytest.mark.timeout(120)
    def test_interrupt_while_a_worker_hangs_stops_promptly(self):
        main = threading.main_thread().ident
        with pytest.raises(KeyboardInterrupt):
            with MoECluster(_config()) as cluster:
                pids = [info["pid"] for info in cluster.node_infos]
                cluster.step(0)
                # Ctrl-C while the driver waits on a step that rank 1 will never finish (stopped)
                interrupt = threading.Timer(2.0, signal.pthread_kill, (main, signal.SIGINT))
                interrupt.start()
                try:
                    started = time.monotonic()
                    cluster.step(1, crash={"rank": 1, "at": "stop"})
                finally:
                    interrupt.cancel()
                    interrupted = time.monotonic() - started
        closed = time.monotonic() - started - interrupted
        assert interrupted < STEP_TIMEOUT_S and closed < 10, (interrupted, closed)
        _assert_all_gone(pids, "the workers after the interrupt", within_s=5)


# -- the command line --------------------------------------------------------------------------------------


def _long_config(tmp_path: Path, steps: int) -> Path:
    path = tmp_path / "long.yaml"
    values = _config().to_dict()
    values["steps"] = steps
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in values.items()))
    return path


class _Run:
    """``flashdmoe run`` in a subprocess with its own Ray temp dir; records every process it spawns."""

    def __init__(self, tmp_path: Path, config: Path, *extra: str, prelude: str = "") -> None:
        """``prelude``: Python run in the ``flashdmoe run`` process before the command (fault injection)."""
        self.temp_dir = _short_temp_dir()
        self.output = tmp_path / "out"
        self.log = tmp_path / "run.log"
        env = dict(os.environ, RAY_TMPDIR=self.temp_dir, PYTHONPATH=os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")]))
        env.pop("RAY_ADDRESS", None)
        self.stdout = tmp_path / "run.out"
        command = ["-c", f"{prelude}\nimport sys\nfrom flashdmoe.cli import main\nsys.exit(main(sys.argv[1:]))"] \
            if prelude else ["-m", "flashdmoe"]
        # the child writes through its own copies of the descriptors: this process keeps none open
        with open(self.stdout, "w") as out, open(self.log, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, *command, "run", "--config", str(config), "--no-progress", "--output",
                 str(self.output), *extra], cwd=REPO, env=env, stdout=out, stderr=err)
        self.spawned: set[int] = set()

    def _children(self) -> dict[int, str]:
        table = _processes()
        found = _descendants(self.process.pid, table)
        self.spawned |= found
        return {pid: table[pid][2] for pid in found if table[pid][1] != "Z"}

    def wait_for(self, predicate, what: str, within_s: float = 120.0) -> dict[int, str]:
        """Poll the run's processes until ``predicate(children)`` holds; the children then."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            children = self._children()
            if predicate(children):
                return children
            assert self.process.poll() is None, f"the run ended before {what}: {self.text()}"
            time.sleep(0.1)
        pytest.fail(f"no {what} within {within_s:g}s: {self.text()}")

    def workers(self, children: dict[int, str], busy: bool = False) -> list[int]:
        title = "ray::MoEWorker.step" if busy else "ray::MoEWorker"
        return sorted(pid for pid, cmdline in children.items() if cmdline.startswith(title))

    def finish(self, within_s: float) -> int:
        """The run's exit status, waited for at most ``within_s`` (recording the processes it spawns meanwhile)."""
        deadline = time.monotonic() + within_s
        while self.process.poll() is None and time.monotonic() < deadline:
            self._children()
            time.sleep(0.1)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"flashdmoe run still running after {within_s:g}s: {self.text()}")
        return self.process.returncode

    def text(self) -> str:
        """The run's exit status (or that it still runs) and the tails of its output."""
        code = self.process.poll()
        status = "still running" if code is None else f"exit status {code}"
        return (f"\n{status}\nstdout:\n{self.stdout.read_text()[-3000:]}\n"
                f"stderr:\n{self.log.read_text()[-3000:]}")

    def assert_nothing_left(self) -> None:
        _assert_all_gone(self.spawned | _session_processes(self.temp_dir), "flashdmoe run's processes")
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.mark.timeout(120)
def test_cli_interrupt_during_startup_exits_130(tmp_path):
    run = _Run(tmp_path, TINY)
    try:
        run.wait_for(lambda children: any("gcs_server" in cmdline for cmdline in children.values()),
                     "Ray process")
        time.sleep(0.5)
        run.process.send_signal(signal.SIGINT)
        started = time.monotonic()
        assert run.finish(within_s=60) == 130, run.text()
        assert time.monotonic() - started < 30
        assert "interrupted" in run.log.read_text() and "Traceback" not in run.log.read_text(), run.text()
        assert not (run.output / "results.json").exists()
    finally:
        if run.process.poll() is None:
            run.process.kill()
        run.assert_nothing_left()


#: In the ``flashdmoe run`` process: the KeyboardInterrupt of a Ctrl-C that arrives while ray.init forks the
#: raylet, raised where Python's SIGINT handler would raise it then (the fork's first Python code, an at-fork
#: callback, whose exceptions Python drops).
_INTERRUPT_IN_RAYLET_FORK = """
import os, sys

_fired = []

def _interrupt_in_raylet_fork():
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "start_ray_process":
        frame = frame.f_back
    if frame is not None and frame.f_locals.get("process_type") == "raylet" and not _fired:
        _fired.append(True)
        print("injected: KeyboardInterrupt in the raylet's fork", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

os.register_at_fork(after_in_parent=_interrupt_in_raylet_fork)
"""


@pytest.mark.timeout(120)
def test_cli_interrupt_dropped_in_an_at_fork_callback_still_exits_130(tmp_path):
    """A Ctrl-C whose KeyboardInterrupt Python drops (it landed in an at-fork callback of one of ray.init's
    process starts) still stops the run: without flashdmoe.interrupts the run carried on and exited 0."""
    run = _Run(tmp_path, TINY, prelude=_INTERRUPT_IN_RAYLET_FORK)
    try:
        started = time.monotonic()
        assert run.finish(within_s=60) == 130, run.text()
        assert time.monotonic() - started < 30, run.text()
        log = run.log.read_text()
        assert "injected: KeyboardInterrupt in the raylet's fork" in log, run.text()
        assert "interrupted" in log and "Traceback" not in log and "Exception ignored" not in log, run.text()
        assert not (run.output / "results.json").exists()
    finally:
        if run.process.poll() is None:
            run.process.kill()
        run.assert_nothing_left()


@pytest.mark.timeout(180)
def test_cli_interrupt_mid_run_exits_130(tmp_path):
    run = _Run(tmp_path, _long_config(tmp_path, steps=100_000))
    try:
        run.wait_for(lambda children: run.workers(children, busy=True), "worker running a step")
        time.sleep(1.0)
        run.process.send_signal(signal.SIGINT)
        started = time.monotonic()
        assert run.finish(within_s=60) == 130, run.text()
        assert time.monotonic() - started < 30
        assert "interrupted" in run.log.read_text() and "Traceback" not in run.log.read_text(), run.text()
    finally:
        if run.process.poll() is None:
            run.process.kill()
        run.assert_nothing_left()


@pytest.mark.timeout(240)
def test_cli_worker_stopped_from_outside_is_retried_and_reported(tmp_path):
    """The hang as an operator meets it: ``kill -STOP`` on one worker of a running ``flashdmoe run``. The run
    notices within the bound, replaces the team, finishes every step, verifies, and reports the fault."""
    steps = 500
    run = _Run(tmp_path, _long_config(tmp_path, steps=steps))
    try:
        children = run.wait_for(lambda children: run.workers(children, busy=True), "worker running a step")
        stopped = run.workers(children)[0]
        os.kill(stopped, signal.SIGSTOP)
        assert run.finish(within_s=STEP_TIMEOUT_S + RECOVERY_S + 120) == 0, run.text()
        results = json.loads((run.output / "results.json").read_text())
        check_results_schema(results, executor="ray", steps=steps, world_size=2)
        assert results["retries"] == 1 and len(results["faults"]) == 1, results["faults"]
        fault = results["faults"][0]
        assert fault["kind"] == "timeout" and fault["call"] == "step" and len(fault["ranks"]) == 1, fault
        assert fault["recovered"] is True and fault["generation"] == 2
        _assert_hang_reports(fault, hung=fault["ranks"][0], peer_may_finish=True)  # stopped at any moment
        assert [record["attempts"] for record in results["steps"]].count(2) == 1
        assert results["verification"]["passed"] is True
        assert stopped not in {worker["pid"] for worker in results["workers"]}
        table = " ".join(run.stdout.read_text().split())
        assert f"step {fault['step']} (step): timeout on rank(s) {fault['ranks']}, recovered in" in table, run.text()
        assert f"rank {fault['ranks'][0]}: stuck: did not finish step within {STEP_TIMEOUT_S:g}s" in table, run.text()
    finally:
        if run.process.poll() is None:
            run.process.kill()
        run.assert_nothing_left()


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # released on return: nothing listens there


@pytest.mark.timeout(60)
def test_cli_unreachable_address_exits_2_at_once(tmp_path, capsys):
    assert not ray.is_initialized()
    port = _closed_port()
    started = time.monotonic()
    assert cli.main(["run", "--config", str(TINY), "--address", f"127.0.0.1:{port}", "--no-progress",
                     "--output", str(tmp_path / "out")]) == 2
    assert time.monotonic() - started < 15
    error = capsys.readouterr().err
    # the CLI's own check of --address answers before the cluster's probe would
    assert f"error: --address 127.0.0.1:{port}: nothing answers there" in error, error
    assert "Traceback" not in error and not ray.is_initialized() and not (tmp_path / "out").exists()


@pytest.mark.timeout(60)
def test_cluster_probes_the_address_it_is_given():
    # the Python API's own check (flashdmoe run checks --address first and turns this one off)
    assert not ray.is_initialized()
    port = _closed_port()
    started = time.monotonic()
    with pytest.raises(ClusterUnreachable, match=f"address='127.0.0.1:{port}': nothing answers at 127.0.0.1:{port} "
                                                 "within 2s"):
        MoECluster(TINY, address=f"127.0.0.1:{port}", connect_timeout_s=2)
    assert time.monotonic() - started < 15 and not ray.is_initialized()
