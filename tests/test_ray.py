"""The Ray path (``ray_actors``) on a real local Ray cluster bound to 127.0.0.1, CPU workers over gloo.

Covers: distributed forward + backward through :class:`MoECluster` equal to
``reference.moe_expert_parallel``; a worker killed between steps and one crashing inside a step, both
recovered and reported; configs refused before any actor starts; ``run_job``'s results JSON and plot;
``ray job submit`` of ``python -m ray_actors.driver`` end to end against a ``ray start`` cluster.

Tolerance for float32 on gloo: max |got - want| <= 1e-5 + 1e-5 * |want| elementwise (only summation order
differs from the reference, e.g. the router gradient is all-reduced across ranks).
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
import time
from pathlib import Path

import pytest
import ray
import torch

from flashdmoe import reference
from flashdmoe.config import MoEConfig, make_weights
from ray_actors import driver
from ray_actors.driver import MoECluster, run_job

REPO = Path(__file__).resolve().parents[1]
ATOL = RTOL = 1e-5

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _config(**changes) -> MoEConfig:
    values = dict(hidden=16, ffn=24, experts=6, top_k=2, tokens_per_rank=12, activation="gelu",
                  normalize_topk=True, capacity_factor=None, dtype="float32", world_size=2, seed=3, steps=3)
    values.update(changes)
    return MoEConfig.from_dict(values)


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if want.numel():
        error = (got.double() - want.double()).abs()
        assert bool((error <= ATOL + RTOL * want.double().abs()).all()), f"{name}: max abs error {error.max():.3e}"


def _check_against_reference(cluster: MoECluster, tokens: list[int], seed: int) -> None:
    """Random batches (``tokens[r]`` rows on rank r) and output gradients through the cluster vs the reference."""
    config = cluster.config
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.randn(count, config.hidden, generator=generator) for count in tokens]
    dys = [torch.randn(count, config.hidden, generator=generator) for count in tokens]
    ys = cluster.forward(xs)
    dxs, grads = cluster.backward(dys)

    router, w1, w2 = make_weights(config)
    local = config.local_experts
    ref_xs = [x.clone().requires_grad_() for x in xs]
    ref_router = router.clone().requires_grad_()
    ref_w1s = [w1[r * local:(r + 1) * local].clone().requires_grad_() for r in range(config.world_size)]
    ref_w2s = [w2[r * local:(r + 1) * local].clone().requires_grad_() for r in range(config.world_size)]
    want = reference.moe_expert_parallel(ref_xs, ref_router, ref_w1s, ref_w2s, top_k=config.top_k,
                                         activation=config.activation, normalize_topk=config.normalize_topk,
                                         capacity_factor=config.capacity_factor)
    torch.autograd.backward(want, dys)
    for rank in range(config.world_size):
        _assert_close(f"y[{rank}]", ys[rank], want[rank].detach())
        _assert_close(f"dx[{rank}]", dxs[rank], ref_xs[rank].grad)
        _assert_close(f"dw1[{rank}]", grads["w1"][rank], ref_w1s[rank].grad)
        _assert_close(f"dw2[{rank}]", grads["w2"][rank], ref_w2s[rank].grad)
    _assert_close("d router_weight", grads["router_weight"], ref_router.grad)


class TestEmbeddedRay:
    """One embedded Ray (127.0.0.1, 4 CPUs) shared by these tests; clusters reuse it."""

    @pytest.fixture(scope="class", autouse=True)
    def local_ray(self):
        python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4,
                 runtime_env={"env_vars": {"PYTHONPATH": python_path}})
        yield
        ray.shutdown()

    def test_forward_backward_match_reference_three_workers(self):
        config = _config(experts=6, world_size=3, activation="swiglu", capacity_factor=1.0, normalize_topk=False)
        with MoECluster(config, workers=3) as cluster:
            assert cluster.backend == "gloo" and len(cluster.workers) == 3
            assert len({info["node_id"] for info in cluster.node_infos}) == 1  # STRICT_PACK
            _check_against_reference(cluster, tokens=[9, 0, 23], seed=1)  # uneven, one rank empty
            _check_against_reference(cluster, tokens=[5, 17, 2], seed=2)
            record = cluster.step()
            assert record["step"] == 0 and record["attempts"] == 1 and len(record["latency_ms"]) == 3
            assert all(latency > 0 for latency in record["latency_ms"])
            assert sum(record["bytes_sent"]) > 0
            bench = cluster.benchmark(steps=2, warmup=1)
            assert [r["step"] for r in bench["steps"]] == [2, 3]
            assert bench["metrics"]["latency_ms_median"] > 0 and len(bench["metrics"]["per_rank"]) == 3
            assert cluster.faults == []

    def test_worker_killed_between_steps_is_recovered(self):
        with MoECluster(_config(), max_retries=1) as cluster:
            cluster.step(0)
            old_pids = {info["pid"] for info in cluster.node_infos}
            ray.kill(cluster.workers[1], no_restart=True)
            record = cluster.step(1)
            assert record["attempts"] == 2
            assert len(cluster.faults) == 1
            fault = cluster.faults[0]
            assert fault["kind"] == "worker_died" and fault["ranks"] == [1] and fault["recovered"] is True
            assert fault["step"] == 1 and fault["recovery_s"] > 0
            assert not old_pids & {info["pid"] for info in cluster.node_infos}  # every worker replaced
            _check_against_reference(cluster, tokens=[7, 11], seed=5)  # the new team computes correctly

    def test_crash_inside_a_step_is_recovered_and_reported(self, tmp_path):
        results = run_job(_config(steps=3), verify=True, output_dir=tmp_path, progress=False,
                          inject_crash={"step": 1, "rank": 0, "at": "after_forward"})
        assert results["retries"] == 1
        assert [record["attempts"] for record in results["steps"]] == [1, 2, 1]
        assert results["faults"][0]["kind"] == "worker_died" and results["faults"][0]["ranks"] == [0]
        assert results["verification"]["passed"] is True
        _check_results_schema(json.loads((tmp_path / "results.json").read_text()), steps=3, world_size=2)
        assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def test_retries_are_bounded(self):
        with MoECluster(_config(), max_retries=0) as cluster:
            with pytest.raises(driver.WorkerFault, match="died"):
                cluster.step(0, crash={"rank": 1, "at": "before_forward"})
            assert cluster.faults[0]["recovered"] is False

    def test_bad_configs_are_refused_before_any_actor_starts(self, monkeypatch):
        class NoActors:
            def options(self, **_):
                raise AssertionError("an actor was started")

        monkeypatch.setattr(driver, "RemoteMoEWorker", NoActors())
        with pytest.raises(ValueError, match="experts"):
            MoECluster(_config(), workers=4)  # 6 experts over 4 workers
        with pytest.raises(ValueError, match="top_k"):
            MoECluster(dict(_config().to_dict(), top_k=7))
        with pytest.raises(ValueError, match="one CPU per worker"):
            MoECluster(_config(experts=12), workers=6)  # this Ray has 4 CPUs
        with pytest.raises(ValueError, match="backend"):
            MoECluster(_config(), backend="tpu")

    def test_bad_batches_raise_value_error(self):
        with MoECluster(_config()) as cluster:
            with pytest.raises(ValueError, match=r"xs\[1\]"):
                cluster.forward([torch.randn(3, 16), torch.randn(3, 15)])
            with pytest.raises(ValueError, match="2 tensors"):
                cluster.forward([torch.randn(3, 16)])
            with pytest.raises(RuntimeError, match="preceding"):
                cluster.backward([torch.randn(3, 16), torch.randn(3, 16)])


def _check_results_schema(results: dict, *, steps: int, world_size: int) -> None:
    """results.json as documented in ray_actors.driver.run_job."""
    assert {"config", "world_size", "backend", "workers", "steps", "metrics", "verification", "retries", "faults",
            "wall_s", "created", "output", "plot"} <= set(results)
    MoEConfig.from_dict(results["config"])  # round-trips
    assert results["world_size"] == world_size and results["backend"] in ("gloo", "cuda")
    assert len(results["steps"]) == steps
    for index, record in enumerate(results["steps"]):
        assert record["step"] == index and record["attempts"] >= 1
        for key in ("latency_ms", "forward_ms", "backward_ms", "bytes_sent", "dropped"):
            assert len(record[key]) == world_size, key
        assert all(isinstance(value, float) and value > 0 for value in record["latency_ms"])
    metrics = results["metrics"]
    assert metrics["latency_ms_median"] > 0 and metrics["tokens_per_s"] > 0 and metrics["tflops"] > 0
    assert [entry["rank"] for entry in metrics["per_rank"]] == list(range(world_size))
    for entry in metrics["per_rank"]:
        assert entry["peak_memory_bytes"] > 0 and entry["bytes_sent_per_step"] >= 0
    verification = results["verification"]
    assert set(verification) >= {"max_abs_err", "max_rel_err", "passed", "tolerance"}
    assert 0 <= verification["max_rel_err"] <= verification["tolerance"]
    assert isinstance(results["retries"], int) and results["retries"] == sum(f["recovered"] for f in results["faults"])


def test_cli_refuses_a_bad_config_without_starting_ray(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("hidden: 8\nffn: 8\nexperts: 3\ntop_k: 1\ntokens_per_rank: 4\nworld_size: 2\n")
    assert driver.main(["--config", str(path), "--output", str(tmp_path / "out")]) == 2
    assert "experts=3" in capsys.readouterr().err
    assert not ray.is_initialized()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    """``ray start --head`` on 127.0.0.1 with the job server; yields the dashboard address. Started with
    ``--block`` in its own session so stopping it stops exactly this cluster's processes."""
    if shutil.which("ray") is None:
        pytest.skip("the `ray` command is not installed")
    dashboard_port = _free_port()
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    # Ray's unix socket paths must stay under 107 bytes: pytest's tmp_path is too deep
    ray_temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    command = ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={_free_port()}",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
               "--num-cpus=4", "--num-gpus=0", f"--temp-dir={ray_temp}", "--disable-usage-stats"]
    log = open(tmp_path / "ray_start.log", "w")
    head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 120
        while True:  # the job server answers once the dashboard is up
            probe = subprocess.run(["ray", "job", "list", "--address", address], env=env,
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                break
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start did not come up: {(tmp_path / 'ray_start.log').read_text()[-3000:]}")
            time.sleep(2)
        yield address, env
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
    address, env = ray_head
    # the job's working dir: only what the driver and workers import, and the config
    working_dir = tmp_path / "job"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(REPO / "flashdmoe", working_dir / "flashdmoe", ignore=ignore)
    shutil.copytree(REPO / "ray_actors", working_dir / "ray_actors", ignore=ignore)
    (working_dir / "configs").mkdir()
    shutil.copy(REPO / "configs" / "tiny.yaml", working_dir / "configs" / "tiny.yaml")
    output = tmp_path / "results"
    command = ["ray", "job", "submit", "--address", address, "--working-dir", str(working_dir), "--",
               sys.executable, "-m", "flashdmoe", "run", "--config", "configs/tiny.yaml", "--address", "auto",
               "--verify", "--no-progress", "--output", str(output)]
    deadline = time.monotonic() + 90
    while True:
        submitted = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        logs = submitted.stdout + submitted.stderr
        # The job server answers before the node's job agent is up; Ray asks to try again later.
        if "No available agent to submit job" not in logs or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert submitted.returncode == 0, logs[-4000:]
    assert "succeeded" in logs, logs[-4000:]
    assert "FlashDMoE Ray run: backend gloo, 2 workers" in logs and "verification PASSED" in logs, logs[-4000:]
    results = json.loads((output / "results.json").read_text())
    _check_results_schema(results, steps=3, world_size=2)
    assert results["retries"] == 0


@pytest.mark.gpu
def test_cuda_backend_one_worker_matches_reference(tmp_path):
    """The GPU path: one worker with one GPU runs the fused kernel on a single-rank team."""
    config = _config(hidden=256, ffn=512, experts=8, top_k=2, tokens_per_rank=300, dtype="bfloat16", world_size=1)
    results = run_job(config, workers=1, backend="cuda", verify=True, output_dir=tmp_path, progress=False)
    assert results["backend"] == "cuda" and results["workers"][0]["gpu_ids"]
    assert results["verification"]["passed"], results["verification"]
    _check_results_schema(results, steps=3, world_size=1)


@pytest.fixture
def mps_daemon(monkeypatch):
    """The CUDA MPS control daemon (DESIGN.md §4), so several ranks share one GPU as full NVSHMEM PEs.
    Ray's workers inherit the pipe/log directories from this process's environment."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("nvidia-cuda-mps-control is not installed")
    pipe_dir = tempfile.mkdtemp(prefix="mps-pipe", dir="/tmp")
    log_dir = tempfile.mkdtemp(prefix="mps-log", dir="/tmp")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", log_dir)
    subprocess.run([control, "-d"], env=os.environ.copy(), check=True, timeout=60)
    try:
        yield
    finally:
        subprocess.run([control], input="quit\n", text=True, env=os.environ.copy(), timeout=60)
        shutil.rmtree(pipe_dir, ignore_errors=True)
        shutil.rmtree(log_dir, ignore_errors=True)


@pytest.mark.gpu
def test_cuda_backend_two_workers_share_one_gpu_under_mps(mps_daemon, tmp_path):
    """Two ranks with num_gpus=0.5 on one GPU (MPS), an NVSHMEM team of two, against the reference."""
    if not driver._nvshmem_team_available():
        pytest.skip("flashdmoe.team.Team has no nvshmem()/make_unique_id() in this build")
    config = _config(hidden=256, ffn=512, experts=8, top_k=2, tokens_per_rank=300, dtype="bfloat16", world_size=2)
    results = run_job(config, workers=2, backend="cuda", gpus_per_worker=0.5, verify=True, output_dir=tmp_path,
                      progress=False)
    assert results["backend"] == "cuda"
    assert len({info["node_id"] for info in results["workers"]}) == 1
    assert results["verification"]["passed"], results["verification"]
    _check_results_schema(results, steps=3, world_size=2)
