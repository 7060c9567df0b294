"""The flashdmoe CLI end to end (subprocess): `flashdmoe run` through a real embedded Ray on 127.0.0.1
(gloo workers) and `flashdmoe run --in-process`, both writing the one results schema; argument handling and
exit statuses; the in-process executor and the float64 verification behind `run`; info, bench, build."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flashdmoe import api, cli, job, numerics, reference
from flashdmoe.config import MoEConfig
from flashdmoe.job import RESULTS_FILENAME, InProcessRanks, run_job, tolerance_for, verification
from flashdmoe.job.data import StepOutputs, seeded_inputs
from flashdmoe.job.results import forward_flops
from job_checks import check_results_schema

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


def run_cli(*arguments: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    # RAY_ADDRESS unset: a Ray run must start its own embedded Ray, not join one from the environment
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    environment.update(PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="160")
    return subprocess.run([sys.executable, "-m", "flashdmoe", *arguments], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=timeout)


# -- end to end, as a user runs it ---------------------------------------------------------------


def test_info_prints_a_readable_table():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    for text in ("flashdmoe info", "torch", torch.__version__, "CUDA available", "nvcc", "nvshmem4py",
                 "CUDA extension", "kernel build", "ray"):
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
    assert info["extension"]["kernel_build"] in ("main", "nvshmem")  # FLASHDMOE_KERNEL_BUILD (main unless set)
    assert info["extension"]["nvshmem_build"]  # "buildable", or why not
    assert info["ray"] is not None


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines


def test_run_tiny_config_on_ray_prints_table_and_writes_json(tmp_path):
    """The main job as a user runs it: an embedded Ray on 127.0.0.1, one gloo worker per rank, verified."""
    output = tmp_path / "out"
    # The subprocess timeout is the hang guard; no wall-clock assertion (a 2-core CI machine under load
    # once took 154 s for what usually takes under a minute).
    result = run_cli("run", "--config", str(TINY), "--output", str(output), "--no-progress", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    config = MoEConfig.from_yaml(TINY)
    for text in (f"FlashDMoE run: backend reference, transport gloo, {config.world_size} rank(s) on Ray",
                 "forward ms", "backward ms", "tokens/s", "KiB sent/step", "peak MiB", "retries: 0",
                 "verification PASSED (step 0)",
                 f"results written to {output / 'results.json'} and {output / 'latency.png'}"):
        assert text in _flat(result.stdout), (text, result.stdout)

    results = json.loads((output / "results.json").read_text())
    check_results_schema(results, executor="ray", steps=config.steps, world_size=2)
    assert results["config"] == yaml.safe_load(TINY.read_text())
    assert results["run"]["backend"] == "reference" and results["run"]["transport"] == "gloo"
    assert len({worker["pid"] for worker in results["workers"]}) == 2  # one process per rank
    for step in results["steps"]:
        assert step["attempts"] == 1 and step["bytes_sent"] > 0
        assert all(entry["latency_ms"] > 0 and entry["traffic_source"] == "gloo" for entry in step["ranks"])
        assert all(entry["nvshmem_bytes"] is None for entry in step["ranks"])  # gloo: no kernel counters
    verification = results["verification"]
    assert verification["passed"] is True
    assert 0 < verification["max_rel_err"] <= verification["tolerance"] == tolerance_for(config, "reference")
    assert results["retries"] == 0 and results["faults"] == []


def test_run_in_process_tiny_config_prints_table_and_writes_json(tmp_path):
    output = tmp_path / "out"
    result = run_cli("run", "--in-process", "--config", str(TINY), "--output", str(output))
    assert result.returncode == 0, result.stdout + result.stderr
    config = MoEConfig.from_yaml(TINY)
    for text in ("FlashDMoE run: backend reference, transport emulated, 2 rank(s) in this process", "forward ms",
                 "backward ms", "tokens/s", "verification PASSED (step 0)",
                 f"results written to {output / 'results.json'} and {output / 'latency.png'}"):
        assert text in _flat(result.stdout), (text, result.stdout)
    assert "peak MiB" not in result.stdout  # no per-rank table: the ranks share one process and one clock
    step_rows = [line for line in result.stdout.splitlines() if line.strip().startswith("│")]
    assert len(step_rows) == config.steps

    results = json.loads((output / "results.json").read_text())
    check_results_schema(results, executor="in-process", steps=config.steps, world_size=2)
    assert results["config"] == yaml.safe_load(TINY.read_text())
    assert results["run"]["backend"] == "reference" and results["run"]["transport"] == "emulated"
    for step in results["steps"]:
        assert step["forward_ms"] > 0 and step["backward_ms"] > 0 and step["bytes_sent"] is None
        assert all(entry["latency_ms"] is None for entry in step["ranks"])
    verification = results["verification"]
    assert verification["enabled"] is True and verification["passed"] is True
    assert verification["tolerance"] == tolerance_for(config, "reference")
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
                           (["--in-process", "--placement-timeout", "5"],
                            "--placement-timeout=5.0: applies to runs on Ray"),
                           (["--device", "cpu"], "--device='cpu': applies to --in-process runs only")):
        assert cli.main(base + extra) == 2, extra
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


class _FakeCluster:
    """Stands in for ray_actors.cluster.MoECluster: records how it was opened and closed."""

    opened: list = []

    def __init__(self, config, address=None, **options):
        self.config = config
        self.closed = False
        _FakeCluster.opened.append((self, address, options))

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.closed = True


def _fake_ray(monkeypatch, run_job=None):
    """MoECluster, run_job and the check that the cluster answers replaced; returns the list of (cluster,
    address, options) opened and the list of (ranks, run_job options) run."""
    from flashdmoe.job import preflight
    from ray_actors import cluster

    opened, runs = [], []
    monkeypatch.setattr(_FakeCluster, "opened", opened)
    monkeypatch.setattr(cluster, "MoECluster", _FakeCluster)
    monkeypatch.setattr(preflight, "check_ray_address", lambda address, **options: None)

    def fake_run_job(ranks, **options):
        runs.append((ranks, options))
        return {"verification": {"enabled": True, "passed": True}}

    monkeypatch.setattr(job, "run_job", run_job or fake_run_job)
    return opened, runs


@pytest.mark.parametrize("backend", ["auto", "reference", "cuda"])
def test_run_opens_ray_ranks_with_its_arguments(backend, monkeypatch, tmp_path):
    from flashdmoe.job import preflight

    opened, runs = _fake_ray(monkeypatch)
    checks = []
    monkeypatch.setattr(preflight, "check_ray_address",
                        lambda address, *, timeout_s, notice: checks.append((address, timeout_s)))
    assert cli.main(["run", "--config", str(TINY), "--address", "auto", "--workers", "4", "--backend", backend,
                     "--output", str(tmp_path), "--no-progress", "--gpus-per-worker", "0.5",
                     "--placement-timeout", "7", "--connect-timeout", "9"]) == 0
    ranks, address, options = opened[0]
    assert ranks.config == MoEConfig.from_yaml(TINY).replace(world_size=4) and address == "auto"
    # the address is checked once, here within --connect-timeout: the cluster does not probe it again
    assert checks == [("auto", 9.0)]
    assert options == dict(backend=backend, gpus_per_worker=0.5, placement_timeout_s=7.0, check_address=False)
    assert runs[0][0] is ranks and ranks.closed
    assert set(runs[0][1]) == {"verify", "output_dir", "progress", "console", "on_step"}
    assert runs[0][1]["verify"] is True and runs[0][1]["output_dir"] == tmp_path and runs[0][1]["progress"] is False

    monkeypatch.chdir(tmp_path)  # the default --output, results/, lands there
    assert cli.main(["run", "--config", str(TINY), "--no-verify", "--backend", backend, "--max-retries", "3",
                     "--mps-pipe-dir", "/tmp/mps/pipe", "--mps-log-dir", "/tmp/mps/log"]) == 0
    ranks, address, options = opened[1]
    assert ranks.config == MoEConfig.from_yaml(TINY) and address is None
    assert options == dict(backend=backend, max_retries=3, mps_pipe_dir="/tmp/mps/pipe", mps_log_dir="/tmp/mps/log",
                           check_address=False)
    assert checks[1] == (None, preflight.DEFAULT_CONNECT_TIMEOUT_S)
    assert runs[1][1]["verify"] is False and runs[1][1]["output_dir"] == Path("results") and runs[1][1]["progress"]


def test_run_on_ray_exit_status(monkeypatch, capsys, tmp_path):
    from flashdmoe.job import ClusterTooSmall, WorkerFault

    monkeypatch.chdir(tmp_path)  # the default --output, results/, lands there

    def failed_verification(ranks, **options):
        return {"verification": {"enabled": True, "passed": False}}

    _fake_ray(monkeypatch, failed_verification)
    assert cli.main(["run", "--config", str(TINY)]) == 1

    def broken_team(ranks, **options):
        raise WorkerFault("worker_died", [1], "rank(s) [1] died during step: gone")

    _fake_ray(monkeypatch, broken_team)
    assert cli.main(["run", "--config", str(TINY)]) == 1
    assert "the run failed (worker_died on rank(s) [1])" in capsys.readouterr().err

    class TooSmall(_FakeCluster):
        def __init__(self, config, address=None, **options):
            raise ClusterTooSmall("workers=2: the Ray cluster has 1 CPUs")

    from ray_actors import cluster

    monkeypatch.setattr(cluster, "MoECluster", TooSmall)
    assert cli.main(["run", "--config", str(TINY)]) == 2
    assert "error: the cluster cannot host the run: workers=2: the Ray cluster has 1 CPUs" in capsys.readouterr().err


def test_run_without_ray_points_to_in_process(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "ray_actors.cluster", raising=False)
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
    assert "verification FAILED (step 0)" in _flat(capsys.readouterr().out)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["verification"]["passed"] is False
    assert results["verification"]["tensors"]["y"]["max_rel_err"] == pytest.approx(0.01, rel=1e-3)


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
    from flashdmoe.kernel import extension

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


def test_build_nvshmem_builds_the_transport_module(monkeypatch, capsys, tmp_path):
    from flashdmoe.kernel import extension

    calls = []
    monkeypatch.setattr(extension, "build", lambda **kw: calls.append(("main", kw)) or tmp_path / "main.so")
    monkeypatch.setattr(extension, "build_nvshmem", lambda **kw: calls.append(("nvshmem", kw)) or tmp_path / "nv.so")
    assert cli.main(["build", "--nvshmem", "--verbose"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "nv.so")
    assert calls == [("nvshmem", {"arch": None, "force": False, "verbose": True})]


def test_build_host_builds_the_host_module(monkeypatch, capsys, tmp_path):
    from flashdmoe.kernel import extension, host_queue

    module = type("Module", (), {"__file__": str(tmp_path / "flashdmoe_host.so")})
    monkeypatch.setattr(host_queue, "module", lambda: module)
    monkeypatch.setattr(extension, "build", lambda **kw: pytest.fail("the kernel is not built"))
    assert cli.main(["build", "--host"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "flashdmoe_host.so")

    def failing():
        raise extension.BuildError("c++: not found")

    monkeypatch.setattr(host_queue, "module", failing)
    assert cli.main(["build", "--host"]) == 1
    assert "build failed: c++: not found" in capsys.readouterr().err


# -- the in-process executor and the verification -------------------------------------------------


IN_PROCESS_CASES = [
    dict(world_size=1, activation="swiglu", capacity_factor=0.75),
    dict(world_size=2, activation="relu", normalize_topk=False, top_k=1),
    dict(world_size=4, activation="silu", capacity_factor=0.5, top_k=3),
    dict(world_size=2, dtype="bfloat16"),
    dict(world_size=2, tokens_per_rank=0),
]


@pytest.mark.parametrize("options", IN_PROCESS_CASES, ids=[str(i) for i in range(len(IN_PROCESS_CASES))])
def test_in_process_run_verifies_outputs_and_gradients(options, tmp_path):
    config = MoEConfig(**{"hidden": 16, "ffn": 24, "experts": 8, "top_k": 2, "tokens_per_rank": 21, "steps": 2,
                          "seed": 11, **options})
    with InProcessRanks(config) as ranks:
        results = run_job(ranks, output_dir=tmp_path, progress=False)
    verification = results["verification"]
    assert verification["passed"] is True, verification
    assert len(results["steps"]) == 2
    if config.tokens_per_rank:
        check_results_schema(results, executor="in-process", steps=2, world_size=config.world_size)
    if config.capacity_factor is not None and config.tokens_per_rank:
        assert all(step["dropped"] > 0 for step in results["steps"])
    if config.tokens_per_rank and config.dtype == "float32":
        # A real comparison happened: float32 runs differ from the float64 oracle by rounding only.
        assert 0 < verification["max_rel_err"] <= verification["tolerance"]
        assert "float64" in verification["oracle"]
    on_disk = json.loads((tmp_path / RESULTS_FILENAME).read_text())
    assert on_disk["config"] == config.to_dict() and on_disk["verification"] == verification


def test_in_process_single_rank_detects_a_wrong_backend(monkeypatch):
    real = api.moe

    def wrong_router_gradient(x, router_weight, *args, **kwargs):
        # Same forward values, but the router gradient is lost: only the gradient check can see it.
        return real(x, router_weight.detach(), *args, **kwargs)

    monkeypatch.setattr(api, "moe", wrong_router_gradient)
    config = MoEConfig(hidden=16, ffn=16, experts=4, top_k=2, tokens_per_rank=12, steps=1)
    with InProcessRanks(config) as ranks:
        results = run_job(ranks, progress=False)
    tensors = results["verification"]["tensors"]
    assert tensors["y"]["max_rel_err"] < 1e-5 and tensors["d_router_weight"]["max_rel_err"] == pytest.approx(1.0)
    assert results["verification"]["passed"] is False
    check_results_schema(results, executor="in-process", steps=1, world_size=1, written=False)


def test_in_process_run_without_verification(tmp_path):
    config = MoEConfig(hidden=8, ffn=8, experts=2, top_k=1, tokens_per_rank=5, steps=1)
    with InProcessRanks(config) as ranks:
        results = run_job(ranks, verify=False, output_dir=tmp_path, progress=False)
    check_results_schema(results, executor="in-process", steps=1, world_size=1)
    assert results["verification"]["enabled"] is False
    assert results["steps"][0]["ranks"][0]["latency_ms"] > 0  # one rank: the step's time is that rank's


def test_in_process_ranks_refuse_what_they_cannot_run():
    from flashdmoe.errors import BackendUnavailable

    config = MoEConfig(hidden=8, ffn=8, experts=2, top_k=1, tokens_per_rank=5, world_size=2)
    with pytest.raises(BackendUnavailable, match="world_size=2"):
        InProcessRanks(config, backend="cuda")
    with pytest.raises(ValueError, match="backend='fast'"):
        InProcessRanks(config, backend="fast")
    with pytest.raises(ValueError, match="crash=.*Ray executor"):
        InProcessRanks(config).step(0, crash={"rank": 0, "at": "before_forward"})


def _verification_config(**changes) -> MoEConfig:
    return MoEConfig(**{"hidden": 16, "ffn": 24, "experts": 6, "top_k": 2, "tokens_per_rank": 17, "world_size": 3,
                        "capacity_factor": 0.75, "seed": 5, **changes})


def test_oracle_is_the_expert_parallel_layer_in_float64():
    """The oracle (per rank, full weights, fixed routing) equals the expert-parallel reference run on the same
    values in float64, capacity drops included."""
    config = _verification_config()
    inputs = seeded_inputs(config, step=4)
    want = verification.oracle(config, inputs)
    xs = [x.double().requires_grad_() for x in inputs.xs]
    router = inputs.router_weight.double().requires_grad_()
    w1s = [w.double().requires_grad_() for w in inputs.w1s]
    w2s = [w.double().requires_grad_() for w in inputs.w2s]
    ys, auxes = reference.moe_expert_parallel(xs, router, w1s, w2s, top_k=config.top_k, activation=config.activation,
                                              normalize_topk=config.normalize_topk,
                                              capacity_factor=config.capacity_factor, return_aux=True)
    assert sum(int(aux.dropped) for aux in auxes) > 0
    torch.autograd.backward(ys, [dy.double() for dy in inputs.output_grads])
    pairs = [*zip(want.ys, ys), *zip(want.dxs, [x.grad for x in xs]), (want.d_router_weight, router.grad),
             *zip(want.d_w1s, [w.grad for w in w1s]), *zip(want.d_w2s, [w.grad for w in w2s])]
    for got, expected in pairs:
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-12)


def _as_system_outputs(config: MoEConfig, outputs: StepOutputs) -> StepOutputs:
    cast = lambda tensors: [tensor.to(config.torch_dtype) for tensor in tensors]  # noqa: E731
    return StepOutputs(ys=cast(outputs.ys), dxs=cast(outputs.dxs),
                       d_router_weight=outputs.d_router_weight.to(config.torch_dtype),
                       d_w1s=cast(outputs.d_w1s), d_w2s=cast(outputs.d_w2s))


@pytest.mark.parametrize("tensor, rank", [("y", 2), ("dx", 0), ("d_router_weight", None), ("d_w1", 1), ("d_w2", 2)])
def test_verification_names_the_tensor_and_rank_that_is_off(tensor, rank):
    config = _verification_config()
    inputs = seeded_inputs(config, step=0)
    exact = _as_system_outputs(config, verification.oracle(config, inputs))
    record = verification.compare(config, "reference", inputs, exact, step=0)
    # the oracle rounded to float32 once: at most u/2 relative
    assert record["passed"] is True and record["max_rel_err"] <= numerics.rounding_tolerance(torch.float32, 1)

    field = {"y": "ys", "dx": "dxs", "d_w1": "d_w1s", "d_w2": "d_w2s"}.get(tensor)
    if field is None:
        wrong = dataclasses.replace(exact, d_router_weight=exact.d_router_weight * 1.02)
    else:
        tensors = list(getattr(exact, field))
        tensors[rank] = tensors[rank] * 1.02
        wrong = dataclasses.replace(exact, **{field: tensors})
    record = verification.compare(config, "reference", inputs, wrong, step=0)
    assert record["passed"] is False and record["tolerance"] == tolerance_for(config, "reference")
    assert record["tensors"][tensor]["max_rel_err"] == pytest.approx(0.02, rel=1e-3)
    assert record["tensors"][tensor]["worst_rank"] == rank
    assert all(entry["max_rel_err"] < 1e-6 for name, entry in record["tensors"].items() if name != tensor)


def test_verification_fails_on_non_finite_values():
    config = _verification_config()
    inputs = seeded_inputs(config, step=0)
    exact = _as_system_outputs(config, verification.oracle(config, inputs))
    ys = list(exact.ys)
    ys[1] = ys[1].clone()
    ys[1][3, 4] = float("nan")
    record = verification.compare(config, "reference", inputs, dataclasses.replace(exact, ys=ys))
    assert record["passed"] is False and math.isnan(record["max_rel_err"])
    assert record["tensors"]["y"]["worst_rank"] == 1


def test_forward_flops_formula():
    config = MoEConfig(hidden=4, ffn=6, experts=8, top_k=2, tokens_per_rank=1)
    assert forward_flops(config, 10) == 2 * 10 * 2 * 4 * 6 * 2 + 2 * 10 * 4 * 8
    assert forward_flops(config.replace(activation="swiglu"), 10) == 2 * 10 * 2 * 4 * 6 * 3 + 2 * 10 * 4 * 8


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_in_process_run_on_cuda(world_size, tmp_path):
    # H and I are multiples of 64 so that a one-rank run can take the fused kernel when it is built.
    config = MoEConfig(hidden=256, ffn=512, experts=8, top_k=2, tokens_per_rank=300, dtype="bfloat16",
                       world_size=world_size, steps=2)
    with InProcessRanks(config) as ranks:
        results = run_job(ranks, output_dir=tmp_path, progress=False)
    assert all(worker["device"].startswith("cuda") for worker in results["workers"])
    assert results["verification"]["passed"] is True, results["verification"]
    check_results_schema(results, executor="in-process", steps=2, world_size=world_size)


def test_info_says_where_the_host_module_is_built(monkeypatch, tmp_path):
    from flashdmoe.kernel import host_queue

    monkeypatch.setattr(host_queue, "build_dir", lambda: tmp_path)
    assert cli._host_module_state() == "not built yet (flashdmoe build --host)"
    (tmp_path / "flashdmoe_host.so").write_bytes(b"")
    assert cli._host_module_state() == str(tmp_path / "flashdmoe_host.so")
    assert cli.collect_info()["extension"]["host_module"] == str(tmp_path / "flashdmoe_host.so")
