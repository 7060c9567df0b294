"""Ray's control plane is closed: token authentication on and every listening socket on 127.0.0.1, for
the embedded Ray of ``flashdmoe run`` (ray_actors.embedded) and for README's ``ray start`` /
``ray job submit`` recipe. Clients without the token are refused (GCS, dashboard REST, ``ray job
submit``); the same call with the token succeeds.

Each cluster here is started in a process of its own, in a clean environment (no token variables, an
empty HOME), as a user's shell would: the settings tests/conftest.py makes for the rest of the suite
would hide what ray_actors.embedded and the README do by themselves.
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
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ray_jobs import submit_when_agent_up

REPO = Path(__file__).resolve().parents[1]
#: The `ray` command of this interpreter's Ray (another one on PATH may be another version).
RAY = str(Path(sys.executable).with_name("ray")) if Path(sys.executable).with_name("ray").exists() else shutil.which("ray")
AUTH_REFUSED = "Authentication token is missing or incorrect"

# A driver that starts the embedded Ray as `flashdmoe run` does, runs a task (so a worker listens too),
# prints what it started and waits for a line on stdin before shutting Ray down.
EMBEDDED_DRIVER = """
import json, os, sys
import ray
from ray_actors.embedded import start_embedded_ray
start_embedded_ray(num_cpus=1)
ray.get(ray.remote(lambda: 1).remote())
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "mode": os.environ.get("RAY_AUTH_MODE")}), flush=True)
sys.stdin.readline()
ray.shutdown()
"""

# A client: connect to the GCS at argv[1] and ask for the cluster's resources.
GCS_CLIENT = """
import sys
import ray
ray.init(address=sys.argv[1])
print("resources", ray.cluster_resources())
"""


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment without Ray's auth, address and single-node settings, with ``home``."""
    dropped = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
               "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"}
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env


# -- listening sockets of a process tree, from /proc ------------------------------------------------


def process_tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as handle:
                    todo.extend(int(child) for child in handle.read().split())
        except OSError:  # exited meanwhile
            continue
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for descriptor in descriptors:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{descriptor}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def listening_addresses(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by ``pids`` (IPv4 and IPv6)."""
    inodes = set().union(*(_socket_inodes(pid) for pid in pids))
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as handle:
            next(handle)
            for line in handle:
                fields = line.split()
                if fields[3] != "0A" or int(fields[9]) not in inodes:  # 0A: LISTEN
                    continue
                host, port = fields[1].split(":")
                raw = bytes.fromhex(host)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    return address == "::1" or address.removeprefix("::ffff:").startswith("127.")


def test_listening_addresses_sees_a_wildcard_socket():
    """The /proc reader itself: a socket on every interface is reported as such."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        found = listening_addresses([os.getpid()])
    assert ("0.0.0.0", port) in found and not is_loopback("0.0.0.0")


def stop_session(process: subprocess.Popen, grace_s: float = 60) -> None:
    """Wait for ``process`` (started in a session of its own); then kill what is left of its group."""
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def gcs_clients(gcs: str, envs: dict[str, dict[str, str]]) -> dict[str, subprocess.CompletedProcess]:
    """Run GCS_CLIENT against ``gcs`` once per environment, concurrently (a refused client retries ~20 s)."""
    started = {name: subprocess.Popen([sys.executable, "-c", GCS_CLIENT, gcs], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for name, env in envs.items()}
    results = {}
    for name, process in started.items():
        try:
            output, _ = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, output)
    return results


# -- the embedded Ray of `flashdmoe run` ------------------------------------------------------------


def test_embedded_ray_is_on_loopback_and_refuses_clients_without_the_token(tmp_path):
    home = tmp_path / "home"
    driver = subprocess.Popen([sys.executable, "-c", EMBEDDED_DRIVER], env=clean_env(home), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        line = driver.stdout.readline()
        assert line, f"the embedded Ray did not start:\n{driver.stderr.read()[-4000:]}"
        started = json.loads(line)
        host, port = started["gcs"].rsplit(":", 1)
        assert host == "127.0.0.1" and started["mode"] == "token", started
        token_file = home / ".ray" / "auth_token"
        assert token_file.is_file() and len(token_file.read_text()) >= 32, "ray.init() made the token"

        sockets = listening_addresses(process_tree(driver.pid))
        assert ("127.0.0.1", int(port)) in sockets or ("::ffff:127.0.0.1", int(port)) in sockets, sockets
        assert len(sockets) >= 4, sockets  # GCS, raylet, agents, workers
        assert all(is_loopback(address) for address, _ in sockets), sorted(sockets)

        # the clients stay on loopback too, or they would look for the cluster at the routable address
        single = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        results = gcs_clients(started["gcs"], {
            "no token": clean_env(tmp_path / "stranger", **single),
            "wrong token": clean_env(tmp_path / "stranger", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64, **single),
            "the token": clean_env(tmp_path / "stranger", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token_file.read_text(),
                                   **single),
        })
        for refused in ("no token", "wrong token"):
            result = results[refused]
            assert result.returncode != 0 and AUTH_REFUSED in result.stdout, (refused, result.stdout[-3000:])
        assert results["the token"].returncode == 0, results["the token"].stdout[-3000:]
        assert "'CPU': 1.0" in results["the token"].stdout
    finally:
        if driver.poll() is None:
            driver.stdin.write("done\n")
            driver.stdin.close()
        stop_session(driver)


# -- README: `ray start` and `ray job submit` with the token ----------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never through a proxy


def _get(url: str, token: str | None = None) -> int:
    """HTTP status of GET ``url`` (with ``Authorization: Bearer token`` if given); 0 if nothing answers."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with _DIRECT.open(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError):
        return 0


@pytest.fixture
def readme_head(tmp_path):
    """README's recipe: `ray get-auth-token --generate`, then `ray start --head` on 127.0.0.1 with
    RAY_AUTH_MODE=token and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (here with --block, in a session of its
    own, so that stopping it stops exactly this cluster). Yields (dashboard URL, the user's environment,
    the token, the head process, Ray's temp folder)."""
    home = tmp_path / "home"
    env = clean_env(home, RAY_AUTH_MODE="token", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    generated = subprocess.run([RAY, "get-auth-token", "--generate"], env=env, capture_output=True, text=True,
                               timeout=120)
    assert generated.returncode == 0, generated.stderr
    token = (home / ".ray" / "auth_token").read_text()
    assert generated.stdout == token
    dashboard = f"http://127.0.0.1:{_free_port()}"
    ray_temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # unix socket paths must stay short
    command = [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={_free_port()}",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={dashboard.rsplit(':', 1)[1]}", "--num-cpus=1", "--num-gpus=0",
               f"--temp-dir={ray_temp}", "--disable-usage-stats",
               # not the fixed default 52365, which another Ray on this machine may hold (no job agent then)
               f"--dashboard-agent-listen-port={_free_port()}"]
    log_path = tmp_path / "ray_start.log"
    with log_path.open("w") as log:
        head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while _get(f"{dashboard}/api/jobs/", token) != 200:
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield dashboard, env, token, head, ray_temp
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        stop_session(head)
        shutil.rmtree(ray_temp, ignore_errors=True)


def test_readme_ray_start_refuses_unauthenticated_clients(readme_head, tmp_path):
    dashboard, env, token, head, ray_temp = readme_head
    sockets = listening_addresses(process_tree(head.pid))
    assert len(sockets) >= 4 and all(is_loopback(address) for address, _ in sockets), sorted(sockets)

    # the job server's REST API (what `ray job submit` and the dashboard use)
    assert _get(f"{dashboard}/api/jobs/") == 401
    assert _get(f"{dashboard}/api/jobs/", "0" * 64) == 403
    assert _get(f"{dashboard}/api/jobs/", token) == 200

    submit = [RAY, "job", "submit", "--address", dashboard, "--", sys.executable, "-c", "print('ran ' + 'here')"]
    stranger = clean_env(tmp_path / "stranger")  # no token anywhere
    refused = subprocess.run(submit, env=stranger, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "Unauthorized: Missing authentication token" in refused.stderr, refused.stderr
    guessed = subprocess.run(submit, env=dict(stranger, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64),
                             capture_output=True, text=True, timeout=120)
    assert guessed.returncode != 0 and "Forbidden: Invalid authentication token" in guessed.stderr, guessed.stderr

    accepted, logs = submit_when_agent_up(submit, env, ray_temp)
    assert accepted.returncode == 0 and "ran here" in logs and "succeeded" in logs, logs[-3000:]
