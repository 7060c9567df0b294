"""Bad input, bad output locations and unreachable clusters on the command line: each refused with exit status 2
and its cause before any Ray process, worker or tensor exists, never a traceback; results written whole or not
at all (exit status 3 when they cannot be, the table printed first); steps kept as the run goes; Ctrl-C
honoured while waiting for a cluster. Real subprocesses where the exit status is the point."""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from flashdmoe import cli
from flashdmoe.bench.registry import get_suite
from flashdmoe.config import MoEConfig
from flashdmoe.job import InProcessRanks, preflight, run_job
from flashdmoe.job import results as schema
from flashdmoe.outputs import OutputWriteError, check_output_dir, write_files

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
TINY_VALUES = yaml.safe_load(TINY.read_text())
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(*arguments: str, cwd: Path = REPO, timeout: float = 120, preexec_fn=None,
            environment: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="160",
               RAY_AUTH_MODE="disabled", **(environment or {}))
    return subprocess.run([sys.executable, "-m", "flashdmoe", *arguments], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=preexec_fn)


def refused(result: subprocess.CompletedProcess, *texts: str) -> None:
    """Exit status 2, every text in stderr, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    flat = " ".join(result.stderr.split())
    for text in texts:
        assert text in flat, (text, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr


def write_config(path: Path, **changes) -> Path:
    path.write_text(yaml.safe_dump({**TINY_VALUES, **changes}))
    return path


def drop_root_file_powers() -> None:
    """``preexec_fn``: a root child loses CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so mode bits bind it as
    they bind any user (CI containers run as root)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: the exec'd root keeps only the rest
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def limit_file_size(limit: int):
    """``preexec_fn``: no file may grow past ``limit`` bytes (a full disk, for the files being written)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.fixture
def no_ray_start(monkeypatch):
    """Fails the test if anything tries to start or join Ray."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "init", refuse)


# -- config files ------------------------------------------------------------------------------------


def test_config_that_is_not_a_readable_utf8_file(tmp_path):
    refused(run_cli("run", "--in-process", "--config", str(tmp_path), "--output", str(tmp_path / "out")),
            f"error: {tmp_path}: is a directory; expected a YAML config file")
    refused(run_cli("run", "--config", str(tmp_path / "absent.yaml")),
            f"error: {tmp_path / 'absent.yaml'}: no such file")

    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(TINY.read_bytes() + "# café\n".encode("latin-1"))
    refused(run_cli("run", "--in-process", "--config", str(latin1), "--output", str(tmp_path / "out")),
            f"error: {latin1}: not UTF-8 text (byte 0xe9 on line")

    locked = tmp_path / "locked.yaml"
    locked.write_text(TINY.read_text())
    locked.chmod(0)
    refused(run_cli("run", "--in-process", "--config", str(locked), "--output", str(tmp_path / "out"),
                    preexec_fn=drop_root_file_powers), f"error: {locked}: cannot be read: Permission denied")
    assert not (tmp_path / "out").exists()


def test_duplicate_key_is_refused_naming_key_and_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(TINY.read_text() + "top_k: 1\n")
    first = next(number for number, line in enumerate(TINY.read_text().splitlines(), 1) if line.startswith("top_k:"))
    last = TINY.read_text().count("\n") + 1
    refused(run_cli("run", "--config", str(path), "--output", str(tmp_path / "out")),
            f"error: {path}: duplicate key 'top_k' on line {last} (first given on line {first})")


def test_capacity_factor_too_large_to_hold(tmp_path):
    path = tmp_path / "capacity.yaml"
    path.write_text(TINY.read_text().replace("capacity_factor: null", "capacity_factor: 1.0e+300"))
    refused(run_cli("run", "--in-process", "--config", str(path), "--output", str(tmp_path / "out")),
            f"error: {path}: capacity_factor=1e+300: keeps ceil(c * T * k / E) = ceil(1e+300 * 64 * 2 / 8)",
            "a factor >= E / k = 4 already keeps every choice")


# -- sizes against memory ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [["--in-process"], []], ids=["in-process", "ray"])
def test_giant_sizes_are_refused_before_anything_is_allocated(mode, tmp_path):
    path = write_config(tmp_path / "giant.yaml", hidden=10**9)
    started = time.monotonic()
    result = run_cli("run", *mode, "--config", str(path), "--output", str(tmp_path / "out"), timeout=60)
    # of host memory, or of GPU memory where an in-process run would use a GPU
    refused(result, "error: the config needs at least", "is available (hidden=1000000000,",
            "lower hidden, ffn, experts or tokens_per_rank")
    assert time.monotonic() - started < 30  # a size check, not an allocation that ran out of memory
    assert not (tmp_path / "out").exists()


def test_memory_needs_of_a_small_config_by_hand():
    config = MoEConfig(hidden=4, ffn=6, experts=4, top_k=2, tokens_per_rank=5, world_size=2, dtype="bfloat16",
                       activation="swiglu")
    router, expert = 4 * 4, 4 * 12 + 6 * 4  # E*H; H*2I + I*H
    weights = router + 4 * expert
    needs = preflight.memory_needs(config, verify=True)
    assert needs.weights == weights * 2
    assert needs.rank_step == (2 * (router + 2 * expert) + 4 * 5 * 4 + 10 * 12) * 2
    assert needs.all_ranks_step == (2 * weights + 2 * (4 * 5 * 4 + 10 * 12)) * 2
    assert needs.verification == (2 * weights + 4 * 2 * 5 * 4) * 2 + (2 * weights + 3 * 2 * 5 * 4 + 2 * 10 * 18) * 8
    assert preflight.memory_needs(config, verify=False).verification == 0


def test_memory_needs_are_a_lower_bound_of_what_an_in_process_run_holds():
    """The step's estimate never exceeds what its tensors occupy: weights and gradients alone already do."""
    config = MoEConfig.from_yaml(TINY)
    with InProcessRanks(config, backend="reference", device="cpu") as ranks:
        held = sum(tensor.numel() * tensor.element_size() for tensor in ranks._parameters())
        assert preflight.memory_needs(config, verify=False).weights == held
        assert preflight.memory_needs(config, verify=False).all_ranks_step >= 2 * held


def test_memory_check_refuses_and_advises(monkeypatch):
    config = MoEConfig.from_yaml(TINY)
    needs = preflight.memory_needs(config, verify=True)
    monkeypatch.setattr(preflight, "available_host_memory", lambda: needs.weights + needs.verification)
    preflight.check_memory(config, verify=True, in_process=True, device=torch.device("cpu"))  # just fits
    monkeypatch.setattr(preflight, "available_host_memory", lambda: needs.all_ranks_step)
    with pytest.raises(ValueError) as raised:
        preflight.check_memory(config, verify=True, in_process=True, device=torch.device("cpu"))
    assert "of host memory (weights 0.0 GiB, float64 verification" in str(raised.value)
    assert "pass --no-verify (the float64 check alone needs" in str(raised.value)  # without it the run fits
    preflight.check_memory(config, verify=False, in_process=True, device=torch.device("cpu"))
    # Workers of an embedded Ray on this machine's CPUs count too; a remote cluster's do not.
    monkeypatch.setattr(preflight, "available_host_memory", lambda: needs.verification)
    with pytest.raises(ValueError, match="2 workers' weights, gradients and activations"):
        preflight.check_memory(config, verify=True, in_process=False, local_ray=True)
    preflight.check_memory(config, verify=True, in_process=False, local_ray=False)


def test_available_host_memory_is_plausible():
    available = preflight.available_host_memory()
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert available is not None and 0 < available <= total


# -- devices -----------------------------------------------------------------------------------------


def test_bad_device_is_refused(tmp_path):
    base = ["run", "--in-process", "--config", str(TINY), "--output", str(tmp_path / "out")]
    refused(run_cli(*base, "--device", "bogus"),
            "error: --device='bogus': not a device; expected cpu, cuda or cuda:INDEX")
    refused(run_cli(*base, "--device", "meta"), "error: --device='meta': expected cpu, cuda or cuda:INDEX")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        refused(run_cli(*base, "--device", f"cuda:{count}"), f"torch sees {count} CUDA device(s)")
    else:
        refused(run_cli(*base, "--device", "cuda"), "error: --device='cuda': no CUDA device is visible to torch here")
    assert not (tmp_path / "out").exists()


# -- the cluster's address ---------------------------------------------------------------------------


def test_address_where_nothing_listens_fails_at_once(tmp_path):
    started = time.monotonic()
    result = run_cli("run", "--config", str(TINY), "--address", "127.0.0.1:1", "--output", str(tmp_path / "out"),
                     timeout=60)
    refused(result, "error: --address 127.0.0.1:1: nothing answers there (Connection refused)")
    assert time.monotonic() - started < 30
    assert not (tmp_path / "out").exists()


@pytest.fixture
def silent_port():
    """A port whose accept queue is full: connection attempts get no answer at all (dropped SYNs)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # fills the queue
            with socket.socket() as check:
                check.settimeout(0.5)
                try:
                    check.connect(("127.0.0.1", port))
                    pytest.skip("this kernel accepts past a full listen queue; no silent port to test against")
                except (TimeoutError, socket.timeout):
                    pass
            yield port


def test_address_that_does_not_answer_fails_within_the_connect_timeout(silent_port, tmp_path):
    started = time.monotonic()
    result = run_cli("run", "--config", str(TINY), "--address", f"127.0.0.1:{silent_port}", "--connect-timeout", "1.5",
                     "--output", str(tmp_path / "out"), timeout=60)
    elapsed = time.monotonic() - started
    refused(result, f"waiting up to 1.5 s for 127.0.0.1:{silent_port} to answer",
            f"error: --address 127.0.0.1:{silent_port}: no answer within 1.5 s (--connect-timeout)")
    assert 1.5 <= elapsed < 30


def test_ctrl_c_while_waiting_for_a_cluster(silent_port, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled")
    process = subprocess.Popen([sys.executable, "-m", "flashdmoe", "run", "--config", str(TINY), "--address",
                                f"127.0.0.1:{silent_port}", "--connect-timeout", "120", "--output", str(tmp_path)],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        waiting = process.stderr.readline()
        assert "waiting up to 120 s" in waiting and "Ctrl-C stops" in waiting, waiting
        interrupted = time.monotonic()
        process.send_signal(signal.SIGINT)
        returncode = process.wait(timeout=20)
        assert time.monotonic() - interrupted < 15
        rest = process.stderr.read()
        assert returncode == 130 and rest.strip() == "interrupted", (returncode, rest)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()


def test_address_auto_without_a_cluster(monkeypatch, tmp_path, capsys, no_ray_start):
    from ray._private import services

    # No cluster on this node, whatever else runs on the machine: Ray's own lookup finds nothing.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset())
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    assert cli.main(["run", "--config", str(TINY), "--address", "auto", "--output", str(tmp_path / "out")]) == 2
    assert "error: --address auto: no Ray cluster found on this node" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arguments, message", [
    (["--address", "http://127.0.0.1:8265"], "--address 'http://127.0.0.1:8265': expected auto, HOST:PORT or "
                                             "ray://HOST:PORT (an http:// address is the dashboard's"),
    (["--address", "127.0.0.1"], "--address '127.0.0.1': expected auto, HOST:PORT or ray://HOST:PORT"),
    (["--connect-timeout", "0"], "--connect-timeout=0.0: expected a number of seconds > 0"),
    (["--connect-timeout", "nan"], "--connect-timeout=nan: expected a number of seconds > 0"),
    (["--placement-timeout", "-1"], "--placement-timeout=-1.0: expected a number of seconds > 0"),
    (["--in-process", "--connect-timeout", "3"], "--connect-timeout=3.0: applies to runs on Ray"),
])
def test_bad_cluster_options(arguments, message, tmp_path, capsys, no_ray_start):
    assert cli.main(["run", "--config", str(TINY), "--output", str(tmp_path / "out"), *arguments]) == 2
    assert f"error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_address_whose_host_does_not_resolve(monkeypatch):
    def no_such_host(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)  # no DNS server involved
    with pytest.raises(ValueError, match="^--address host.invalid:6379: the host 'host.invalid' does not resolve "
                                         r"\(Name or service not known\)$"):
        preflight.check_ray_address("host.invalid:6379")


def test_ray_address_from_the_environment_is_checked_too(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ValueError, match="^RAY_ADDRESS 127.0.0.1:1: nothing answers there"):
        preflight.check_ray_address(None)
    with pytest.raises(ValueError, match="^RAY_ADDRESS 127.0.0.1:1: nothing answers there"):
        preflight.check_ray_address("auto")
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert preflight.check_ray_address(None) is None and preflight.check_ray_address("local") is None
    with pytest.raises(ValueError, match="^--address ray://127.0.0.1:1: nothing answers there"):
        preflight.check_ray_address("ray://127.0.0.1:1")


def test_address_check_tells_a_ray_cluster_from_a_web_server():
    import http.server
    import threading

    import ray

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{web.server_address[1]}"
        with pytest.raises(ValueError, match=f"^--address {address}: something answers there, but not a Ray cluster"):
            preflight.check_ray_address(address)
    finally:
        web.shutdown()
        web.server_close()
    assert not ray.is_initialized()
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=1)
    try:
        gcs = ray.get_runtime_context().gcs_address
        assert preflight.check_ray_address(gcs) == gcs  # a real GCS passes
    finally:
        ray.shutdown()


# -- the output location, before the run ------------------------------------------------------------


@pytest.mark.parametrize("mode", [["--in-process"], []], ids=["in-process", "ray"])
def test_output_that_cannot_be_a_directory(mode, tmp_path, capsys, no_ray_start):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    base = ["run", *mode, "--config", str(TINY)]
    assert cli.main([*base, "--output", str(a_file)]) == 2
    assert f"error: --output {a_file}: exists and is not a directory" in capsys.readouterr().err
    assert cli.main([*base, "--output", str(a_file / "sub" / "dir")]) == 2
    assert f"error: --output {a_file / 'sub' / 'dir'}: cannot be created: {a_file} is a file, not a directory" in \
        capsys.readouterr().err
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    assert cli.main([*base, "--output", str(link / "out")]) == 2
    assert f"error: --output {link / 'out'}: {link} is a broken symbolic link" in capsys.readouterr().err
    assert a_file.read_text() == "not a directory\n"


def test_unwritable_output_is_refused_in_a_real_run(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        for output in (locked, locked / "new"):
            result = run_cli("run", "--config", str(TINY), "--output", str(output), preexec_fn=drop_root_file_powers)
            refused(result, f"error: --output {output}: {locked} is not writable by this user")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(stat.S_IRWXU)


def test_output_without_free_space(tmp_path):
    with pytest.raises(ValueError, match="has .* bytes free; at least .* are needed"):
        check_output_dir(tmp_path, min_free_bytes=2**62)
    assert check_output_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()  # checked, not created


def test_bench_output_that_is_a_file(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    result = run_cli("bench", "--device", "cpu", "--quick", "--output", str(a_file))
    refused(result, f"flashdmoe bench: --output {a_file}: exists and is not a directory")
    result = run_cli("bench", "--device", "cpu", "--quick", "--output", str(a_file / "sub"))
    refused(result, f"--output {a_file / 'sub'}: cannot be created: {a_file} is a file")
    assert a_file.read_text() == "x"


# -- writing results: whole or not at all ------------------------------------------------------------


def leftovers(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.endswith(".tmp"))


def test_write_files_replaces_all_or_none(tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.png"
    first.write_text("old first\n")
    second.write_text("old second\n")

    def disk_full(handle):
        handle.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OutputWriteError) as raised:
        write_files({first: lambda handle: handle.write(b"new first\n"), second: disk_full})
    assert str(raised.value) == f"cannot write {second}: No space left on device"
    assert raised.value.path == second and raised.value.error.errno == errno.ENOSPC
    assert first.read_text() == "old first\n" and second.read_text() == "old second\n"
    assert leftovers(tmp_path) == []

    third = tmp_path / "sub" / "third"
    assert write_files({first: lambda handle: handle.write(b"new first\n"),
                        third: lambda handle: handle.write(b"3")}) == [first, third]
    assert first.read_text() == "new first\n" and (tmp_path / "sub" / "third").read_text() == "3"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(first.stat().st_mode) == 0o666 & ~umask  # like any file this user makes
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "sub") == []


def test_disk_full_after_the_run_prints_the_table_and_exits_3(tmp_path):
    """A size-limited file stands in for a full disk: results.json and latency.png do not fit, steps.jsonl does."""
    output = tmp_path / "out"
    output.mkdir()
    (output / "results.json").write_text('{"from": "an earlier run"}\n')
    result = run_cli("run", "--in-process", "--config", str(TINY), "--output", str(output), "--no-progress",
                     preexec_fn=limit_file_size(8192))
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "verification PASSED (step 0)" in result.stdout and "results written" not in result.stdout
    flat = " ".join(result.stderr.split())
    assert f"error: the run finished but its results could not be written: cannot write {output / 'latency.png'}: " \
           "File too large; nothing was left half-written (the table above has the results; " \
           f"{output / 'steps.jsonl'} has every step)" in flat, result.stderr
    assert "Traceback" not in result.stderr
    assert (output / "results.json").read_text() == '{"from": "an earlier run"}\n'
    assert not (output / "latency.png").exists() and leftovers(output) == []
    lines = [json.loads(line) for line in (output / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(TINY_VALUES["steps"]))
    assert all(list(line) == list(schema.STEP_LINE_FIELDS) for line in lines)


def test_disk_full_during_the_run_keeps_whole_lines(tmp_path):
    output = tmp_path / "out"
    result = run_cli("run", "--in-process", "--config", str(TINY), "--output", str(output), "--no-progress",
                     preexec_fn=limit_file_size(1500))  # about one and a half step lines
    assert result.returncode == 3, (result.stdout, result.stderr)
    flat = " ".join(result.stderr.split())
    assert f"warning: {output / 'steps.jsonl'}: cannot append step 1 (File too large)" in flat, result.stderr
    assert "has every step" not in flat and "verification PASSED" in result.stdout
    text = (output / "steps.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == [0]
    assert sorted(path.name for path in output.iterdir()) == ["steps.jsonl"]


def test_steps_jsonl_matches_results_json(tmp_path):
    output = tmp_path / "out"
    (output).mkdir()
    (output / "steps.jsonl").write_text('{"from": "an earlier run"}\n')
    config = MoEConfig.from_yaml(TINY)
    with InProcessRanks(config) as ranks, schema.StepLog(output) as log:
        results = run_job(ranks, output_dir=output, progress=False, on_step=log.append)
    lines = [json.loads(line) for line in (output / "steps.jsonl").read_text().splitlines()]
    assert len({line.pop("run_started") for line in lines}) == 1  # one run; the earlier run's line is gone
    assert lines == json.loads(json.dumps(results["steps"]))
    assert (output / "latency.png").read_bytes()[:8] == PNG_MAGIC and leftovers(output) == []


def test_ctrl_c_mid_run_keeps_the_finished_steps(tmp_path):
    config = write_config(tmp_path / "long.yaml", steps=100_000)
    output = tmp_path / "out"
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO))
    process = subprocess.Popen([sys.executable, "-m", "flashdmoe", "run", "--in-process", "--config", str(config),
                                "--output", str(output), "--no-progress", "--no-verify"], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            log = output / "steps.jsonl"
            if log.exists() and log.read_text().count("\n") >= 3:
                break
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 130
        assert process.stderr.read().strip().endswith("interrupted")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()
    lines = (output / "steps.jsonl").read_text().splitlines()
    assert len(lines) >= 3
    assert [json.loads(line)["step"] for line in lines] == list(range(len(lines)))
    assert sorted(path.name for path in output.iterdir()) == ["steps.jsonl"]


# -- bench ---------------------------------------------------------------------------------------------


def test_bench_on_the_cpu_runs_the_quick_shapes_unless_told():
    from rich.console import Console

    from flashdmoe.bench import cli as bench_cli

    parser = bench_cli.configure_parser(argparse.ArgumentParser())
    suite = get_suite("single-gpu")
    console = Console(file=open(os.devnull, "w"), stderr=False)
    default = bench_cli.options_from_args(parser.parse_args(["--device", "cpu"]), console)
    assert default.shapes == list(suite.quick_shapes) and default.max_input_sets == bench_cli.QUICK_MAX_INPUT_SETS
    full = bench_cli.options_from_args(parser.parse_args(["--device", "cpu", "--full"]), console)
    assert full.shapes == list(suite.default_shapes)
    own = bench_cli.options_from_args(parser.parse_args(["--device", "cpu", "--configs", "24,32,64,4,2"]), console)
    assert len(own.shapes) == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--quick", "--full"])
    console.file.close()


def test_bench_with_default_options_on_a_cpu_says_it_runs_the_quick_shapes(tmp_path):
    on_cpu = ["--device", "cpu"] if torch.cuda.is_available() else []  # no option at all where there is no GPU
    result = run_cli("bench", *on_cpu, "--repeats", "2", "--warmup", "0", "--output", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "flashdmoe bench: on the CPU the suite runs its quick shapes (a smoke test of the pipeline, not a " \
           "measurement); --full runs the full-size shapes" in " ".join(result.stderr.split())
    assert "flashdmoe bench --suite single-gpu" in result.stdout  # the table, on stdout
    report = json.loads((tmp_path / "single-gpu.json").read_text())
    assert [config["shape"] for config in report["configs"]] == [shape.to_dict() for shape in
                                                                 get_suite("single-gpu").quick_shapes]
    assert any(note.startswith("on the CPU the suite runs its quick shapes") for note in report["settings"]["notes"])
    assert "on the CPU the suite runs its quick shapes" in (tmp_path / "single-gpu.md").read_text()
    assert leftovers(tmp_path) == []


def test_bench_reports_that_cannot_be_written_exit_3_after_the_table(tmp_path):
    (tmp_path / "single-gpu.json").write_text("earlier\n")
    result = run_cli("bench", "--device", "cpu", "--quick", "--repeats", "2", "--warmup", "0", "--output",
                     str(tmp_path), preexec_fn=limit_file_size(4096), timeout=300)
    assert result.returncode == 3, result.stderr
    assert "flashdmoe bench --suite single-gpu" in result.stdout  # the table came first
    assert "the reports could not be written: cannot write" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
    assert (tmp_path / "single-gpu.json").read_text() == "earlier\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["single-gpu.json"]
