"""The flashdmoe CLI end to end (subprocess): `flashdmoe run` through a real embedded Ray on 127.0.0.1
(gloo workers), `flashdmoe run --in-process` and the runner behind it, argument handling, info, bench, build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flashdmoe import api, cli, reference, runner
from flashdmoe.config import MoEConfig

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


def run_cli(*arguments: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    # RAY_ADDRESS unset: a Ray run must start its own embedded Ray, not join one from the environment
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    environment.update(PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="160",
                       RAY_AUTH_MODE="disabled")
    return subprocess.run([sys.executable, "-m", "flashdmoe", *arguments], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=timeout)


# -- end to end, as a user runs it ---------------------------------------------------------------


def test_info_prints_a_readable_table():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    for text in ("flashdmoe info", "torch", torch.__version__, "CUDA available", "nvcc", "nvshmem4py",
                 "CUDA extension", "ray"):
        assert text in result.stdout, (text, result.stdout)
    if not torch.cuda.is_available():
        assert "none visible" in result.stdout


def test_info_json_matches_this_machine():
    result = run_cli("info", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["torch"] == torch.__version__
    assert info["cuda_available"] is torch.cuda.is_available()
    assert len(info["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert set(info["nvshmem"]) >= {"nvshmem4py", "nvidia_nvshmem", "core_importable", "lib_dir"}
    assert isinstance(info["extension"]["available"], bool)
    if not info["extension"]["available"]:
        assert info["extension"]["reason"]
    assert info["ray"] is not None


def test_run_tiny_config_on_ray_prints_table_and_writes_json(tmp_path):
    """The main job as a user runs it: an embedded Ray on 127.0.0.1, one gloo worker per rank, verified."""
    output = tmp_path / "out"
    # The subprocess timeout is the hang guard; no wall-clock assertion (a 2-core CI machine under load
    # once took 154 s for what usually takes under a minute).
    result = run_cli("run", "--config", str(TINY), "--output", str(output), "--no-progress", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    config = MoEConfig.from_yaml(TINY)
    for text in (f"FlashDMoE Ray run: backend gloo, {config.world_size} workers", "forward ms", "backward ms",
                 "tokens/s", "retries: 0", "verification PASSED",
                 f"results written to {output / 'results.json'} and {output / 'latency.png'}"):
        assert text in " ".join(result.stdout.split()), (text, result.stdout)  # rich wraps long lines
    rank_rows = [line.strip("│ ").split()[0] for line in result.stdout.splitlines() if line.startswith("│")]
    assert rank_rows == [str(rank) for rank in range(config.world_size)], result.stdout

    results = json.loads((output / "results.json").read_text())
    assert results["config"] == yaml.safe_load(TINY.read_text())
    assert results["world_size"] == config.world_size == 2 and results["backend"] == "gloo"
    assert len({worker["pid"] for worker in results["workers"]}) == 2  # one process per rank
    assert [step["step"] for step in results["steps"]] == list(range(config.steps))
    for step in results["steps"]:
        assert step["attempts"] == 1 and len(step["latency_ms"]) == config.world_size
        assert all(latency > 0 for latency in step["latency_ms"]) and sum(step["bytes_sent"]) > 0
    verification = results["verification"]
    assert verification["passed"] is True
    assert 0 < verification["max_rel_err"] <= verification["tolerance"] == runner.tolerance_for("float32", "reference")
    assert results["retries"] == 0 and results["faults"] == []
    assert (output / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_in_process_tiny_config_prints_table_and_writes_json(tmp_path):
    output = tmp_path / "out"
    result = run_cli("run", "--in-process", "--config", str(TINY), "--output", str(output))
    assert result.returncode == 0, result.stdout + result.stderr
    config = MoEConfig.from_yaml(TINY)
    for text in ("flashdmoe run", "fwd ms", "bwd ms", "tokens/s", "max err", "verification passed",
                 f"results written to {output / 'results.json'}"):
        assert text in result.stdout, (text, result.stdout)
    table_rows = [line for line in result.stdout.splitlines() if line.strip().startswith("│")]
    assert len(table_rows) == config.steps

    results = json.loads((output / "results.json").read_text())
    assert results["config"] == yaml.safe_load(TINY.read_text())
    assert results["run"]["world_size"] == config.world_size == 2
    assert results["run"]["backend"] == "reference"
    assert [step["step"] for step in results["steps"]] == list(range(config.steps))
    for step in results["steps"]:
        assert step["forward_ms"] > 0 and step["backward_ms"] > 0 and step["tokens_per_s"] > 0
        assert step["tokens"] == config.tokens_per_rank * config.world_size
        assert set(step["errors"]) == {"y", "dx", "d_router_weight", "d_w1", "d_w2"}
        assert step["passed"] is True and step["max_error"] <= results["verification"]["tolerance"]
    verification = results["verification"]
    assert verification["enabled"] is True and verification["passed"] is True
    assert verification["tolerance"] == runner.tolerance_for("float32", "reference")
    assert results["metrics"]["forward_ms_median"] > 0
    assert results["metrics"]["steps_in_median"] == config.steps - 1
    assert results["environment"]["torch"] == torch.__version__


def test_run_bad_config_exits_2_naming_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.read_text() + "expert_count: 3\n")
    result = run_cli("run", "--config", str(bad), "--output", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "unknown key(s) expert_count" in result.stderr
    assert not (tmp_path / "out").exists()


# -- CLI paths in process (fast) -----------------------------------------------------------------


@pytest.fixture
def no_ray_start(monkeypatch):
    """Fails the test if anything tries to start or join Ray."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.mark.parametrize("workers, message", [
    ("3", "--workers=3: experts=8: expected a multiple of world_size=3"),
    ("0", "--workers=0: world_size=0: expected an integer >= 1"),
    ("-2", "--workers=-2: world_size=-2: expected an integer >= 1"),
])
@pytest.mark.parametrize("mode", [[], ["--in-process"]], ids=["ray", "in-process"])
def test_run_refuses_bad_workers_before_ray_starts(workers, message, mode, tmp_path, capsys, no_ray_start):
    arguments = ["run", "--config", str(TINY), "--workers", workers, "--output", str(tmp_path / "out"), *mode]
    assert cli.main(arguments) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_run_refuses_options_of_the_other_mode(tmp_path, capsys, no_ray_start):
    base = ["run", "--config", str(TINY), "--output", str(tmp_path / "out")]
    for extra, message in ((["--in-process", "--address", "auto"], "--address='auto': applies to runs on Ray"),
                           (["--in-process", "--max-retries", "1"], "--max-retries=1: applies to runs on Ray"),
                           (["--in-process", "--mps-pipe-dir", "/tmp/p"],
                            "--mps-pipe-dir='/tmp/p': applies to runs on Ray"),
                           (["--device", "cpu"], "--device='cpu': applies to --in-process runs only")):
        assert cli.main(base + extra) == 2, extra
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _fake_run_job(calls: list, passed: bool | None):
    def fake(config, **options):
        calls.append((config, options))
        return {"verification": None if passed is None else {"passed": passed}}

    return fake


@pytest.mark.parametrize("backend, ray_backend", [("auto", "auto"), ("reference", "gloo"), ("cuda", "cuda")])
def test_run_hands_its_arguments_to_the_ray_driver(backend, ray_backend, monkeypatch, tmp_path):
    from ray_actors import driver

    calls = []
    monkeypatch.setattr(driver, "run_job", _fake_run_job(calls, passed=True))
    assert cli.main(["run", "--config", str(TINY), "--address", "auto", "--workers", "4", "--backend", backend,
                     "--output", str(tmp_path), "--no-progress", "--gpus-per-worker", "0.5"]) == 0
    config, options = calls[0]
    assert config == MoEConfig.from_yaml(TINY).replace(world_size=4)
    assert options == dict(address="auto", workers=4, verify=True, output_dir=tmp_path, progress=False,
                           backend=ray_backend, gpus_per_worker=0.5)
    assert cli.main(["run", "--config", str(TINY), "--no-verify"]) == 0
    config, options = calls[1]
    assert config == MoEConfig.from_yaml(TINY)
    assert options == dict(address=None, workers=None, verify=False, output_dir=Path("results"), progress=True,
                           backend="auto")


def test_run_hands_the_mps_options_to_the_ray_driver(monkeypatch, tmp_path):
    from ray_actors import driver

    calls = []
    monkeypatch.setattr(driver, "run_job", _fake_run_job(calls, passed=True))
    assert cli.main(["run", "--config", str(TINY), "--backend", "cuda", "--gpus-per-worker", "0.25",
                     "--mps-pipe-dir", "/tmp/mps/pipe", "--mps-log-dir", "/tmp/mps/log", "--output", str(tmp_path),
                     "--no-progress"]) == 0
    _, options = calls[0]
    assert options == dict(address=None, workers=None, verify=True, output_dir=tmp_path, progress=False,
                           backend="cuda", gpus_per_worker=0.25, mps_pipe_dir="/tmp/mps/pipe",
                           mps_log_dir="/tmp/mps/log")


def test_run_on_ray_exit_status(monkeypatch, capsys):
    from ray_actors import driver

    monkeypatch.setattr(driver, "run_job", _fake_run_job([], passed=False))
    assert cli.main(["run", "--config", str(TINY)]) == 1

    def broken_team(config, **options):
        raise driver.WorkerFault("worker_died", [1], "rank(s) [1] died during step: gone")

    monkeypatch.setattr(driver, "run_job", broken_team)
    assert cli.main(["run", "--config", str(TINY)]) == 1
    assert "the run failed (worker_died on rank(s) [1])" in capsys.readouterr().err


def test_run_without_ray_points_to_in_process(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "ray_actors.driver", raising=False)
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail, as on a machine without Ray
    assert cli.main(["run", "--config", str(TINY)]) == 2
    error = capsys.readouterr().err
    assert "the Ray run cannot start" in error and "--in-process" in error


def test_run_missing_config_file(tmp_path, capsys):
    assert cli.main(["run", "--config", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err


def test_run_cuda_backend_without_cuda_says_why(tmp_path, capsys):
    single = tmp_path / "single.yaml"
    single.write_text(yaml.safe_dump({**yaml.safe_load(TINY.read_text()), "world_size": 1, "steps": 1}))
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["run", "--in-process", "--config", str(single), "--backend", "cuda",
                     "--output", str(tmp_path)]) == 2
    assert "backend='cuda' is unavailable" in capsys.readouterr().err


def test_run_exits_1_when_verification_fails(tmp_path, monkeypatch, capsys):
    real = reference.moe_expert_parallel

    def off_by_one_percent(*args, **kwargs):
        ys, auxes = real(*args, **kwargs)
        return [y * 1.01 for y in ys], auxes

    monkeypatch.setattr(reference, "moe_expert_parallel", off_by_one_percent)
    assert cli.main(["run", "--in-process", "--config", str(TINY), "--output", str(tmp_path), "--no-progress"]) == 1
    output = capsys.readouterr().out
    assert "verification FAILED" in output and "NO" in output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["verification"]["passed"] is False
    assert results["steps"][0]["errors"]["y"] == pytest.approx(0.01, rel=1e-3)


def test_bench_subcommand_delegates_to_flashdmoe_bench():
    import flashdmoe.bench

    args = cli.build_parser().parse_args(["bench", "--suite", "single-gpu", "--quick"])
    assert args.handler is flashdmoe.bench.run
    assert args.suite == "single-gpu" and args.quick is True


def test_bench_unavailable_is_reported_not_fatal(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashdmoe.bench", None)  # makes `import flashdmoe.bench` fail
    assert cli.main(["bench", "--suite", "single-gpu"]) == 2
    assert "flashdmoe bench is unavailable" in capsys.readouterr().err
    assert cli.main(["info", "--json"]) == 0  # the other commands still work


def test_build_prints_the_extension_path(monkeypatch, capsys, tmp_path):
    from flashdmoe import extension

    calls = []

    def fake_build(arch=None, force=False, verbose=False):
        calls.append((arch, force, verbose))
        return tmp_path / "flashdmoe_cuda.so"

    monkeypatch.setattr(extension, "build", fake_build)
    assert cli.main(["build", "--force", "--arch", "sm_90a"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "flashdmoe_cuda.so")
    assert calls == [("sm_90a", True, False)]

    def failing_build(arch=None, force=False, verbose=False):
        raise extension.BuildError("nvcc: not found")

    monkeypatch.setattr(extension, "build", failing_build)
    assert cli.main(["build"]) == 1
    assert "build failed: nvcc: not found" in capsys.readouterr().err


# -- the runner ----------------------------------------------------------------------------------


RUNNER_CASES = [
    dict(world_size=1, activation="swiglu", capacity_factor=0.75),
    dict(world_size=2, activation="relu", normalize_topk=False, top_k=1),
    dict(world_size=4, activation="silu", capacity_factor=0.5, top_k=3),
    dict(world_size=2, dtype="bfloat16"),
    dict(world_size=2, tokens_per_rank=0),
]


@pytest.mark.parametrize("options", RUNNER_CASES, ids=[str(i) for i in range(len(RUNNER_CASES))])
def test_run_in_process_verifies_outputs_and_gradients(options, tmp_path):
    config = MoEConfig(**{"hidden": 16, "ffn": 24, "experts": 8, "top_k": 2, "tokens_per_rank": 21, "steps": 2,
                          "seed": 11, **options})
    results = runner.run_in_process(config, tmp_path, progress=False)
    assert results["verification"]["passed"] is True, results["steps"]
    assert len(results["steps"]) == 2
    if config.capacity_factor is not None and config.tokens_per_rank:
        assert all(step["dropped_choices"] > 0 for step in results["steps"])
    if config.tokens_per_rank and config.dtype == "float32":
        # A real comparison happened: float32 runs differ from the float64 oracle by rounding only.
        assert 0 < results["verification"]["max_error"] <= results["verification"]["tolerance"]
        assert "float64" in results["verification"]["oracle"]
    on_disk = json.loads((tmp_path / runner.RESULTS_FILENAME).read_text())
    assert on_disk["config"] == config.to_dict() and on_disk["verification"] == results["verification"]


def test_run_in_process_single_rank_detects_a_wrong_backend(monkeypatch, tmp_path):
    real = api.moe

    def wrong_router_gradient(x, router_weight, *args, **kwargs):
        # Same forward values, but the router gradient is lost: only the gradient check can see it.
        return real(x, router_weight.detach(), *args, **kwargs)

    monkeypatch.setattr(api, "moe", wrong_router_gradient)
    config = MoEConfig(hidden=16, ffn=16, experts=4, top_k=2, tokens_per_rank=12, steps=1)
    results = runner.run_in_process(config, None, progress=False)
    errors = results["steps"][0]["errors"]
    assert errors["y"] < 1e-5 and errors["d_router_weight"] == pytest.approx(1.0)
    assert results["verification"]["passed"] is False
    assert "output" not in results


def test_run_in_process_without_verification(tmp_path):
    config = MoEConfig(hidden=8, ffn=8, experts=2, top_k=1, tokens_per_rank=5, steps=1)
    results = runner.run_in_process(config, tmp_path, verify=False, progress=False)
    assert results["verification"]["enabled"] is False and results["steps"][0]["passed"] is None
    assert results["metrics"]["steps_in_median"] == 1


def test_run_in_process_rejects_cuda_for_several_ranks():
    from flashdmoe.errors import BackendUnavailable

    config = MoEConfig(hidden=8, ffn=8, experts=2, top_k=1, tokens_per_rank=5, world_size=2)
    with pytest.raises(BackendUnavailable, match="world_size=2"):
        runner.run_in_process(config, None, backend="cuda", progress=False)
    with pytest.raises(ValueError, match="backend='fast'"):
        runner.run_in_process(config, None, backend="fast", progress=False)


def test_forward_flops_formula():
    config = MoEConfig(hidden=4, ffn=6, experts=8, top_k=2, tokens_per_rank=1)
    assert runner.forward_flops(config, 10) == 2 * 10 * 2 * 4 * 6 * 2 + 2 * 10 * 4 * 8
    assert runner.forward_flops(config.replace(activation="swiglu"), 10) == 2 * 10 * 2 * 4 * 6 * 3 + 2 * 10 * 4 * 8


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_run_in_process_on_cuda(world_size, tmp_path):
    # H and I are multiples of 64 so that a one-rank run can take the fused kernel when it is built.
    config = MoEConfig(hidden=256, ffn=512, experts=8, top_k=2, tokens_per_rank=300, dtype="bfloat16",
                       world_size=world_size, steps=2)
    results = runner.run_in_process(config, tmp_path, progress=False)
    assert results["run"]["device"].startswith("cuda")
    assert results["verification"]["passed"] is True, results["steps"]
    assert all(step["forward_ms"] > 0 for step in results["steps"])
