"""``ray job submit`` against a cluster that has just started (tests/test_ray.py, tests/test_ray_auth.py).

The job server answers before the node's job agent is up, and until then Ray refuses a submission with
"No available agent to submit job, please try again later". :func:`submit_when_agent_up` retries such
refusals, and when it gives up, the result carries the tail of the dashboard agent's log, which says
why the agent never came (a port it could not bind, an import that failed, or only slowness)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

# On a 2-core CI machine the agent once took more than 90 s to come up while no other test ran; alone,
# the same test's agent was up within 20 s.
AGENT_WAIT_S = 240
NO_AGENT = "No available agent to submit job"


def agent_log_tail(ray_temp: Path, chars: int = 3000) -> str:
    """The last ``chars`` characters of every dashboard agent log of the sessions under ``ray_temp``."""
    tails = []
    for path in sorted(Path(ray_temp).glob("session_*/logs/dashboard_agent*")):
        tails.append(f"--- {path.name} ---\n{path.read_text(errors='replace')[-chars:]}")
    return "\n".join(tails) or f"(no dashboard agent log under {ray_temp})"


def submit_when_agent_up(command: list[str], env: dict[str, str], ray_temp: Path,
                         wait_s: float = AGENT_WAIT_S) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``command`` (a ``ray job submit``) until Ray stops refusing it for want of a job agent, for at
    most ``wait_s`` seconds. Returns the last run and its output (stdout + stderr); if the agent never
    came, the output ends with the agent's log."""
    deadline = time.monotonic() + wait_s
    while True:
        submitted = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        logs = submitted.stdout + submitted.stderr
        if NO_AGENT not in logs:
            return submitted, logs
        if time.monotonic() > deadline:
            return submitted, f"{logs}\nno job agent after {wait_s:.0f} s; its log:\n{agent_log_tail(ray_temp)}"
        time.sleep(3)
