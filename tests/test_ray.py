"""The Ray executor (``ray_actors``) on a real local Ray cluster bound to 127.0.0.1, CPU workers over gloo.

Covers: distributed forward + backward through :class:`MoECluster` equal to
``reference.moe_expert_parallel``; a worker killed between steps and one crashing inside a step, both
recovered and reported; a ``KernelTimeout`` on one rank: every team closed, a new one bootstrapped, the
step retried; configs refused before any actor starts; a cluster that cannot place the ranks: exit 2 with
the cause, within the placement timeout; ``flashdmoe.job.run_job`` on Ray: the results schema and plot;
``ray job submit`` of ``flashdmoe run`` end to end against a ``ray start`` cluster; the GPU actors'
scheduling options (fractional ``num_gpus``, MPS environment) on a Ray with a declared GPU.

Tolerance for float32 on gloo: max |got - want| <= 1e-5 + 1e-5 * |want| elementwise (only summation order
differs from the reference, e.g. the router gradient is all-reduced across ranks).

GPU tests (``gpu`` marker, run on the H200): one worker on the fused kernel; two workers sharing the GPU
under MPS (an NVSHMEM team of two) against the float64 oracle (``flashdmoe.job.verification``), through
:class:`MoECluster` and ``run_job``; a rank made silent inside the kernel: every rank raises
``KernelTimeout`` naming a peer, and the cluster recovers with a new team.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
import torch

from flashdmoe import cli
from flashdmoe.config import MoEConfig, make_weights
from flashdmoe.job import WorkerFault, run_job, tolerance_for
from flashdmoe.job.data import StepInputs
from flashdmoe.job.verification import compare, verify_step
from mps_checks import started_daemon
from job_checks import check_results_schema
from ray_jobs import submit_when_agent_up
from ray_checks import check_against_reference as _check_against_reference
from ray_actors import cluster as ray_cluster
from ray_actors import worker
from ray_actors.cluster import MoECluster

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
#: The `ray` command of this Python's Ray (a dependency), also where the environment is not activated.
RAY = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
def _config(**changes) -> MoEConfig:
    values = dict(hidden=16, ffn=24, experts=6, top_k=2, tokens_per_rank=12, activation="gelu",
                  normalize_topk=True, capacity_factor=None, dtype="float32", world_size=2, seed=3, steps=3)
    values.update(changes)
    return MoEConfig.from_dict(values)


class TestEmbeddedRay:
    """One embedded Ray (127.0.0.1, 4 CPUs) shared by these tests; clusters reuse it."""

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def local_ray(cls):
        python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4,
                 runtime_env={"env_vars": {"PYTHONPATH": python_path}})
        yield
        ray.shutdown()

    def test_forward_backward_match_reference_three_workers(self):
        config = _config(experts=6, world_size=3, activation="swiglu", capacity_factor=1.0, normalize_topk=False)
        with MoECluster(config, workers=3) as cluster:
            assert cluster.backend == "reference" and cluster.transport == "gloo" and len(cluster.actors) == 3
            assert len({info["node_id"] for info in cluster.workers()}) == 1  # STRICT_PACK
            _check_against_reference(cluster, tokens=[9, 0, 23], seed=1)  # uneven, one rank empty
            _check_against_reference(cluster, tokens=[5, 17, 2], seed=2)
            for step in (0, 1):
                record = cluster.step(step)
                assert record["step"] == step and record["attempts"] == 1 and len(record["ranks"]) == 3
                assert all(entry["latency_ms"] > 0 for entry in record["ranks"])
                assert record["latency_ms"] == max(entry["latency_ms"] for entry in record["ranks"])
                assert record["bytes_sent"] == sum(entry["bytes_sent"] for entry in record["ranks"]) > 0
            peaks, largest = cluster.peak_memory_bytes()
            assert len(peaks) == 3 and largest == max(peaks) > 0
            assert cluster.faults == []

    def test_worker_killed_between_steps_is_recovered(self):
        with MoECluster(_config(), max_retries=1) as cluster:
            cluster.step(0)
            old_pids = {info["pid"] for info in cluster.node_infos}
            ray.kill(cluster.actors[1], no_restart=True)
            record = cluster.step(1)
            assert record["attempts"] == 2
            assert len(cluster.faults) == 1
            fault = cluster.faults[0]
            assert fault["kind"] == "worker_died" and fault["ranks"] == [1] and fault["recovered"] is True
            assert fault["step"] == 1 and fault["recovery_s"] > 0
            assert not old_pids & {info["pid"] for info in cluster.node_infos}  # every worker replaced
            _check_against_reference(cluster, tokens=[7, 11], seed=5)  # the new team computes correctly

    def test_crash_inside_a_step_is_recovered_and_reported(self, tmp_path):
        with MoECluster(_config(steps=3)) as cluster:
            results = run_job(cluster, verify=True, output_dir=tmp_path, progress=False,
                              crash={"step": 1, "rank": 0, "at": "after_forward"})
        assert results["retries"] == 1
        assert [record["attempts"] for record in results["steps"]] == [1, 2, 1]
        fault = results["faults"][0]
        assert fault["kind"] == "worker_died" and fault["ranks"] == [0] and fault["step"] == 1
        assert fault["recovered"] is True and fault["generation"] == 2
        assert all(worker["generation"] == 2 for worker in results["workers"])  # the team that finished
        assert results["verification"]["passed"] is True
        on_disk = json.loads((tmp_path / "results.json").read_text())
        check_results_schema(on_disk, executor="ray", steps=3, world_size=2)
        assert on_disk["faults"] == results["faults"]

    def test_kernel_timeout_on_one_rank_closes_every_team_and_recovers(self):
        """Rank 0 raises KernelTimeout (as the watchdog would); rank 1, inside the exchange with it, fails on
        the collective's timeout. Every worker closes its team, a new team starts on new actors, the step is
        retried, and the new team computes correctly."""
        with MoECluster(_config(), max_retries=1, collective_timeout_s=10) as cluster:
            assert cluster.generation == 1
            old_pids = {info["pid"] for info in cluster.node_infos}
            old_team = cluster.node_infos[0]["team_id"]
            record = cluster.step(0, crash={"rank": 0, "at": "kernel_timeout"})
            assert record["attempts"] == 2 and len(record["ranks"]) == 2
            assert len(cluster.faults) == 1
            fault = cluster.faults[0]
            assert fault["kind"] == "kernel_timeout" and fault["ranks"] == [0] and fault["recovered"] is True
            assert fault["teams_closed"] is True and fault["generation"] == 2 and cluster.generation == 2
            reports = {report["rank"]: report for report in fault["reports"]}
            assert set(reports) == {0, 1}
            assert reports[0]["error"] == "KernelTimeout" and "injected by the test" in reports[0]["message"]
            assert reports[1]["error"] != "KernelTimeout"  # its collective gave up on rank 0
            assert not old_pids & {info["pid"] for info in cluster.node_infos}
            assert all(info["generation"] == 2 for info in cluster.node_infos)
            assert cluster.node_infos[0]["team_id"] != old_team  # a new rendezvous (port)
            assert ray.get([w.fault_reports.remote() for w in cluster.actors]) == [[], []]
            _check_against_reference(cluster, tokens=[6, 13], seed=8)

    def test_retries_are_bounded(self):
        with MoECluster(_config(), max_retries=0) as cluster:
            with pytest.raises(WorkerFault, match="died"):
                cluster.step(0, crash={"rank": 1, "at": "before_forward"})
            assert cluster.faults[0]["recovered"] is False

    def test_bad_configs_are_refused_before_any_actor_starts(self, monkeypatch):
        class NoActors:
            def options(self, **_):
                raise AssertionError("an actor was started")

        monkeypatch.setattr(ray_cluster, "RemoteMoEWorker", NoActors())
        with pytest.raises(ValueError, match="experts"):
            MoECluster(_config(), workers=4)  # 6 experts over 4 workers
        with pytest.raises(ValueError, match="top_k"):
            MoECluster(dict(_config().to_dict(), top_k=7))
        with pytest.raises(ray_cluster.ClusterTooSmall, match="one CPU per worker"):
            MoECluster(_config(experts=12), workers=6)  # this Ray has 4 CPUs
        with pytest.raises(ray_cluster.ClusterTooSmall, match="the Ray cluster has 0 GPUs"):
            MoECluster(_config(dtype="bfloat16"), backend="cuda")
        with pytest.raises(ValueError, match="placement_timeout_s"):
            MoECluster(_config(), placement_timeout_s=0)
        with pytest.raises(ValueError, match="collective_timeout_s=30: expected at most the bound on a call, 5s"):
            MoECluster(_config(step_timeout_s=5), collective_timeout_s=30)  # gloo must give up before the bound
        with pytest.raises(ValueError, match="backend"):
            MoECluster(_config(), backend="tpu")
        with pytest.raises(ValueError, match="max_tokens"):
            MoECluster(_config(), max_tokens=5)  # fewer than tokens_per_rank=12
        with pytest.raises(ValueError, match="gpus_per_worker"):
            MoECluster(_config(), gpus_per_worker=1.5)
        with pytest.raises(ValueError, match="mps_pipe_dir"):
            MoECluster(_config(), gpus_per_worker=0.5, mps_pipe_dir="")
        with pytest.raises(ValueError, match="dtype='float32'"):  # the fused kernel runs bf16 / fp16
            MoECluster(_config(), backend="cuda")

    def test_bad_batches_raise_value_error(self):
        with MoECluster(_config()) as cluster:
            with pytest.raises(ValueError, match=r"xs\[1\]"):
                cluster.forward([torch.randn(3, 16), torch.randn(3, 15)])
            with pytest.raises(ValueError, match="2 tensors"):
                cluster.forward([torch.randn(3, 16)])
            with pytest.raises(RuntimeError, match="preceding"):
                cluster.backward([torch.randn(3, 16), torch.randn(3, 16)])
            with pytest.raises(ValueError, match="silence.*cuda backend"):
                cluster.step(0, silence={"rank": 1, "timeout_ms": 100})
            with pytest.raises(ValueError, match="crash"):
                cluster.step(0, crash={"rank": 2, "at": "kernel_timeout"})
            assert cluster.faults == [] and cluster.generation == 1

    def test_run_with_more_workers_than_the_cluster_has_cpus_exits_2(self, tmp_path, capsys):
        """`flashdmoe run --workers 8` on this 4-CPU Ray (joined, as under `ray job submit`)."""
        output = tmp_path / "out"
        assert cli.main(["run", "--config", str(TINY), "--workers", "8", "--no-progress",
                         "--output", str(output)]) == 2
        error = capsys.readouterr().err
        assert "error: the cluster cannot host the run: workers=8: the Ray cluster has 4 CPUs" in error, error
        assert "Traceback" not in error and not output.exists()
        assert ray.is_initialized()  # the caller's Ray is left running

    def test_run_whose_ranks_cannot_be_placed_exits_2_within_the_timeout(self, tmp_path, capsys):
        """Enough CPUs in all, but another actor holds 3 of the 4: the placement group stays pending, and
        `flashdmoe run` gives up after --placement-timeout with exit 2 and the cause, leaving nothing behind."""

        @ray.remote(num_cpus=3)
        class Holder:
            def ready(self) -> bool:
                return True

        holder = Holder.remote()
        ray.get(holder.ready.remote())
        output = tmp_path / "out"
        try:
            started = time.monotonic()
            assert cli.main(["run", "--config", str(TINY), "--placement-timeout", "3", "--no-progress",
                             "--output", str(output)]) == 2
            elapsed = time.monotonic() - started
        finally:
            ray.kill(holder)
        error = capsys.readouterr().err
        assert "error: the cluster cannot host the run: could not place 2 workers x {'CPU': 1.0} on one node " \
               "within 3s" in error, error
        assert re.search(r"has 4 CPU, 0 GPU in all and [01] CPU, 0 GPU free", error), error
        assert "Traceback" not in error and not output.exists()
        assert elapsed < 60
        assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


def test_gpu_worker_environment():
    trio = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    assert worker.gpu_env_vars(1.0) == trio
    assert worker.gpu_env_vars(0.5, mps_pipe_dir="/tmp/pipe", mps_log_dir=Path("/tmp/log")) == {
        **trio, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/pipe",
        "CUDA_MPS_LOG_DIRECTORY": "/tmp/log"}
    assert worker.gpu_env_vars(1.0, mps_pipe_dir="/tmp/pipe") == {**trio, "CUDA_MPS_PIPE_DIRECTORY": "/tmp/pipe"}
    # across nodes the workers run the kernel build that reaches the other nodes' ranks by NVSHMEM puts
    assert worker.gpu_env_vars(1.0, nodes=2) == {**trio, "FLASHDMOE_KERNEL_BUILD": "nvshmem"}
    assert "FLASHDMOE_KERNEL_BUILD" not in worker.gpu_env_vars(1.0, nodes=1)
    shares = (1.0, 0.5, 1 / 3, 0.29, 0.25, 0.125, 0.001)
    assert [worker.mps_share_percentage(share) for share in shares] == [100, 50, 33, 29, 25, 12, 1]
    for share in (0, -0.5, 1.01, True, "0.5"):
        with pytest.raises(ValueError, match="gpus_per_worker"):
            worker.gpu_env_vars(share)
    with pytest.raises(ValueError, match="mps_log_dir"):
        worker.gpu_env_vars(0.5, mps_log_dir="")


class _StopBootstrap(Exception):
    """Raised by the fake actor below once the driver starts bootstrapping the team."""


class _FakeActor:
    """Stands in for a GPU MoEWorker actor: records its options; the bootstrap call stops the test there."""

    def __init__(self, options: dict) -> None:
        self.options = options

    def __getattr__(self, method: str):
        class Method:
            @staticmethod
            def remote(*_):
                if method in ("ping", "teardown"):
                    return ray.put(None)
                raise _StopBootstrap(method)

        return Method


def test_fractional_gpu_workers_are_scheduled_with_their_mps_share(monkeypatch):
    """``gpus_per_worker=0.5`` on a Ray that declares one GPU (no GPU is needed to schedule): two bundles
    of 0.5 GPU in one STRICT_PACK group, actors with ``num_gpus=0.5`` whose runtime_env carries
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50``, the MPS directories (the pipe one from this process's
    environment, the log one given) and the multicast-off variables; rank 0 is asked for the unique id."""
    calls = []

    class Recorder:
        def options(self, **options):
            calls.append(options)

            class Handle:
                @staticmethod
                def remote():
                    return _FakeActor(options)

            return Handle

    monkeypatch.setattr(ray_cluster, "RemoteMoEWorker", Recorder())
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/flashdmoe-test-mps/pipe")
    config = _config(dtype="bfloat16", world_size=2)
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2, num_gpus=1)
    try:
        with pytest.raises(_StopBootstrap, match="make_unique_id"):
            MoECluster(config, backend="cuda", gpus_per_worker=0.5, mps_log_dir="/tmp/flashdmoe-test-mps/log")
        assert len(calls) == 2
        for rank, options in enumerate(calls):
            assert options["num_gpus"] == 0.5 and options["num_cpus"] == 0 and options["max_restarts"] == 0
            assert options["scheduling_strategy"].placement_group_bundle_index == rank
            assert options["runtime_env"] == {"env_vars": {
                "NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/flashdmoe-test-mps/pipe",
                "CUDA_MPS_LOG_DIRECTORY": "/tmp/flashdmoe-test-mps/log"}}
        bundles = {tuple(sorted(bundle.items())) for group in ray.util.placement_group_table().values()
                   for bundle in group["bundles"].values()}
        assert bundles == {(("GPU", 0.5),)}
        with pytest.raises(ValueError, match="max_tokens"):  # below tokens_per_rank
            MoECluster(config, backend="cuda", max_tokens=3)
    finally:
        ray.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    """``ray start --head`` on 127.0.0.1 with the job server; yields the dashboard address, the environment
    and Ray's temp folder. Started with ``--block`` in its own session so stopping it stops exactly this
    cluster's processes."""
    dashboard_port = _free_port()
    env = dict(os.environ)  # token authentication and loopback addresses: tests/conftest.py
    # Ray's unix socket paths must stay under 107 bytes: pytest's tmp_path is too deep
    ray_temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    command = [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={_free_port()}",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
               "--num-cpus=4", "--num-gpus=0", f"--temp-dir={ray_temp}", "--disable-usage-stats",
               # not the fixed default 52365, which another Ray on this machine may hold (no job agent then)
               f"--dashboard-agent-listen-port={_free_port()}"]
    log = open(tmp_path / "ray_start.log", "w")
    head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # the job server answers once the dashboard is up
            probe = subprocess.run([RAY, "job", "list", "--address", address], env=env,
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                break
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start did not come up: {(tmp_path / 'ray_start.log').read_text()[-3000:]}")
            time.sleep(2)
        yield address, env, ray_temp
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()
        shutil.rmtree(ray_temp, ignore_errors=True)


def test_ray_job_submit_end_to_end(ray_head, tmp_path):
    address, env, ray_temp = ray_head
    # the job's working dir: only what the driver and workers import, and the config
    working_dir = tmp_path / "job"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(REPO / "flashdmoe", working_dir / "flashdmoe", ignore=ignore)
    shutil.copytree(REPO / "ray_actors", working_dir / "ray_actors", ignore=ignore)
    (working_dir / "configs").mkdir()
    shutil.copy(REPO / "configs" / "tiny.yaml", working_dir / "configs" / "tiny.yaml")
    output = tmp_path / "results"
    command = [RAY, "job", "submit", "--address", address, "--working-dir", str(working_dir), "--",
               sys.executable, "-m", "flashdmoe", "run", "--config", "configs/tiny.yaml", "--address", "auto",
               "--verify", "--no-progress", "--output", str(output)]
    submitted, logs = submit_when_agent_up(command, env, ray_temp)
    assert submitted.returncode == 0, logs[-4000:]
    assert "succeeded" in logs, logs[-4000:]
    flat = " ".join(logs.split())
    assert "FlashDMoE run: backend reference, transport gloo, 2 rank(s) on Ray" in flat, logs[-4000:]
    assert "verification PASSED (step 0)" in flat, logs[-4000:]
    results = json.loads((output / "results.json").read_text())
    check_results_schema(results, executor="ray", steps=3, world_size=2)
    assert results["retries"] == 0 and results["verification"]["passed"] is True


@pytest.mark.gpu
def test_cuda_backend_one_worker_matches_reference(tmp_path):
    """The GPU path: one worker with one GPU runs the fused kernel on a single-rank team."""
    config = _config(hidden=256, ffn=512, experts=8, top_k=2, tokens_per_rank=300, dtype="bfloat16", world_size=1)
    with MoECluster(config, workers=1, backend="cuda") as cluster:
        results = run_job(cluster, verify=True, output_dir=tmp_path, progress=False)
    assert results["run"]["backend"] == "cuda" and results["run"]["transport"] == "single"
    assert results["workers"][0]["gpu_ids"] and results["workers"][0]["device_name"]
    assert results["verification"]["passed"], results["verification"]
    check_results_schema(results, executor="ray", steps=3, world_size=1)


@pytest.fixture(scope="module")
def mps_daemon():
    """The CUDA MPS control daemon (docs/design.md §6), module-scoped, so several ranks share one GPU as full
    NVSHMEM PEs. Its pipe/log directories go into this process's environment before any test here starts
    Ray (the embedded Ray's workers inherit them) and are also handed to the actors explicitly."""
    from flashdmoe.parallel.mps import mps_available

    reason = mps_available()
    if reason:  # a GPU machine without MPS cannot run what these tests check: a failure, not a skip
        pytest.fail(f"CUDA MPS is unavailable: {reason}")
    daemon = started_daemon()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(daemon.pipe_dir))
        patch.setenv("CUDA_MPS_LOG_DIRECTORY", str(daemon.log_dir))
        try:
            yield daemon
        finally:
            daemon.stop()


def _bf16_config(**changes) -> MoEConfig:
    return _config(**{**dict(hidden=256, ffn=512, experts=8, top_k=2, tokens_per_rank=300, dtype="bfloat16",
                             world_size=2), **changes})


def _mps_cluster(daemon, config: MoEConfig, **options) -> MoECluster:
    """Two ranks with num_gpus=0.5 on the one GPU under ``daemon``; a hang surfaces within 240 s."""
    return MoECluster(config, workers=2, backend="cuda", gpus_per_worker=0.5, mps_pipe_dir=daemon.pipe_dir,
                      mps_log_dir=daemon.log_dir, call_timeout_s=240, **options)


def _check_relative(cluster: MoECluster, tokens: list[int], seed: int) -> dict:
    """Random batches (``tokens[r]`` rows on rank r) and output gradients through the cluster, checked by the
    main job's verification (float64 oracle, the dtype's cuda tolerance). Returns the record."""
    config = cluster.config
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(count, config.hidden, generator=generator).to(config.torch_dtype) for count in tokens]
    dys = [torch.randn(count, config.hidden, generator=generator).to(config.torch_dtype) for count in tokens]
    got = cluster.forward_backward(xs, dys)
    router, w1, w2 = make_weights(config)
    local, world = config.local_experts, config.world_size
    inputs = StepInputs(xs=xs, output_grads=dys, router_weight=router,
                        w1s=[w1[r * local:(r + 1) * local] for r in range(world)],
                        w2s=[w2[r * local:(r + 1) * local] for r in range(world)])
    record = compare(config, cluster.backend, inputs, got)
    assert record["tolerance"] == tolerance_for(config, "cuda")
    assert record["passed"], record
    return record


@pytest.mark.gpu
def test_cuda_two_workers_share_one_gpu_under_mps(mps_daemon):
    """Two ranks with num_gpus=0.5 on the one GPU (MPS, 50% of the SMs each), an NVSHMEM team of two:
    forward and backward of every rank against the reference (uneven batches, an empty rank, the seeded
    step that --verify checks); the kernel's traffic counters."""
    config = _bf16_config()
    with _mps_cluster(mps_daemon, config) as cluster:
        assert cluster.backend == "cuda" and cluster.generation == 1
        infos = cluster.node_infos
        assert len({info["node_id"] for info in infos}) == 1 and len({info["pid"] for info in infos}) == 2
        assert infos[0]["gpu_ids"] == infos[1]["gpu_ids"] and len(infos[0]["gpu_ids"]) == 1  # one GPU, shared
        for rank, info in enumerate(infos):
            assert info["mps"] == {"pipe_dir": str(mps_daemon.pipe_dir), "log_dir": str(mps_daemon.log_dir),
                                   "thread_percentage": "50"}, info["mps"]
            assert info["team"]["transport"] == "nvshmem" and info["team"]["rank"] == rank
            assert info["team"]["world_size"] == 2 and info["team"]["max_tokens"] == config.tokens_per_rank
        _check_relative(cluster, tokens=[300, 300], seed=11)
        _check_relative(cluster, tokens=[173, 0], seed=12)  # uneven, one rank without tokens
        _check_relative(cluster, tokens=[1, 299], seed=13)
        verification = verify_step(cluster, 0)  # what --verify runs
        assert verification["passed"], verification
        assert verification["tolerance"] == tolerance_for(config, "cuda")
        with pytest.raises(ValueError, match=r"xs\[1\].*max_tokens=300"):
            cluster.forward([torch.randn(3, 256), torch.randn(301, 256)])
        for step in range(3):
            record = cluster.step(step)
            assert record["attempts"] == 1
            for entry in record["ranks"]:
                assert entry["bytes_sent"] > 0 and entry["traffic_source"] == "kernel", record
                # one GPU: every peer has a peer pointer, so peer_transport="auto" sends nothing by NVSHMEM puts
                assert entry["nvshmem_bytes"] == 0, record
                # only routed rows travel
                assert entry["payload_efficiency"] == pytest.approx(1.0, abs=1e-9), record
        assert cluster.faults == []


@pytest.mark.gpu
def test_cuda_two_workers_under_mps_run_job(mps_daemon, tmp_path):
    """The main job (`flashdmoe run --gpus-per-worker 0.5 --verify`) on two ranks sharing the GPU."""
    with _mps_cluster(mps_daemon, _bf16_config()) as cluster:
        results = run_job(cluster, verify=True, output_dir=tmp_path, progress=False)
    assert results["run"]["backend"] == "cuda" and results["run"]["transport"] == "nvshmem"
    assert results["retries"] == 0
    assert len({info["node_id"] for info in results["workers"]}) == 1
    assert all(info["mps"]["thread_percentage"] == "50" for info in results["workers"])
    assert results["verification"]["passed"], results["verification"]
    check_results_schema(json.loads((tmp_path / "results.json").read_text()), executor="ray", steps=3, world_size=2)
    for entry in results["metrics"]["per_rank"]:
        assert entry["bytes_sent_per_step"] > 0 and entry["payload_efficiency"] == pytest.approx(1.0)


#: How a KernelTimeout names the peer a rank waited on (flashdmoe.cuda_backend: "... (waiting on rank 1; ...").
_WAITED_ON = re.compile(r"waiting on (?:rank|peer)\s*(\d+)", re.IGNORECASE)


@pytest.mark.gpu
def test_silent_rank_times_out_on_every_rank_then_recovers(mps_daemon):
    """Rank 1 publishes none of its signals for one step: every rank raises KernelTimeout (no hang)
    naming a peer it waited on; every worker closes its team, a new team with a new unique id is
    bootstrapped on new actors, and the retried step and a verification pass."""
    config = _bf16_config()
    silent = 1
    with _mps_cluster(mps_daemon, config, max_retries=1) as cluster:
        old_pids = {info["pid"] for info in cluster.node_infos}
        old_team = cluster.node_infos[0]["team_id"]
        assert old_team.startswith("nvshmem-")
        started = time.monotonic()
        record = cluster.step(0, silence={"rank": silent, "timeout_ms": 2000})
        assert time.monotonic() - started < 200
        assert record["attempts"] == 2, record
        assert len(cluster.faults) == 1, cluster.faults
        fault = cluster.faults[0]
        assert fault["kind"] == "kernel_timeout" and fault["ranks"] == [0, 1], fault
        assert fault["recovered"] is True and fault["teams_closed"] is True, fault
        assert fault["generation"] == 2 == cluster.generation
        reports = {report["rank"]: report for report in fault["reports"]}
        assert set(reports) == {0, 1}, fault["reports"]
        for rank, report in reports.items():
            assert report["error"] == "KernelTimeout", report
            waited_on = {int(number) for number in _WAITED_ON.findall(report["message"])}
            # two ranks: each waits on the other (signals to oneself are not published through the team)
            assert waited_on == {1 - rank}, f"rank {rank}'s KernelTimeout should name peer {1 - rank}: {report!r}"
        assert not old_pids & {info["pid"] for info in cluster.node_infos}  # new actors
        assert {info["team_id"] for info in cluster.node_infos} == {cluster.node_infos[0]["team_id"]} != {old_team}
        assert all(info["team"]["transport"] == "nvshmem" for info in cluster.node_infos)
        verification = verify_step(cluster, 1)
        assert verification["passed"], verification
        record = cluster.step(2)
        assert record["attempts"] == 1 and len(cluster.faults) == 1
