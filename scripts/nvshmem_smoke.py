#!/usr/bin/env python3
"""Smoke test of flashdmoe_nvshmem, the NVSHMEM device-API transport module, on one Hopper GPU.

    python scripts/nvshmem_smoke.py [--ranks 2] [--words 4096] [--timeout 90] [--stop-after STEP]

What it proves, in order (each step is printed; the first failing one says why):
1. the module builds (relocatable device code, libnvshmem_device, the nvidia-nvshmem wheel's host library);
   built here once, before any rank starts (ranks only import it);
2. CUDA MPS starts, and P rank processes share the GPU under it (NVSHMEM needs MPS for several PEs/GPU);
3. each rank joins a Team.nvshmem (nvshmem4py, unique-id bootstrap: step "join"), registers the module's device
   state with that NVSHMEM instance (step "init": nvshmemi_init_thread once more, which with the host library
   initialised only registers and fills the module's state), checks it with a one-thread kernel that must
   see the host's PE and PE count (step "pes"), and releases it when the team closes;
4. (step "smoke") each rank's kernel reads nvshmem_my_pe / n_pes on the device, puts a patterned payload to the
   next PE with nvshmemx_putmem_signal_nbi_warp, waits (bounded) for its own signal and checks the previous PE's payload,
   twice (the signal carries the round number: no reset between rounds).
Exit code 0 when every rank passes every round. Does not build flashdmoe_cuda. Needs nvshmem4py, the
nvidia-nvshmem-cu13 wheel (or FLASHDMOE_NVSHMEM_HOME) and nvidia-cuda-mps-control.

Bisecting a fault: every rank prints each step before it starts it, and a failing rank's whole output is shown;
--stop-after (or FLASHDMOE_NVSHMEM_SMOKE_STOP_AFTER) = join | init | pes | smoke runs the steps up to that one,
then closes the team. A rank whose CUDA context holds a sticky error (an illegal address) leaves without
NVSHMEM's finalize, which would exit the process in its barrier before saying anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


# Steps of a rank, in order; FLASHDMOE_NVSHMEM_SMOKE_STOP_AFTER (or --stop-after) names the last one to run.
STEPS = {
    "join": "joining Team.nvshmem (nvshmem4py init, collective)",
    "init": "registering flashdmoe_nvshmem's device state (nvshmemi_init_thread with the host library initialised)",
    "pes": "checking the device state (one-thread kernel reads nvshmem_my_pe / n_pes)",
    "smoke": "running the smoke kernel (put-with-signal to the next PE, 2 rounds)",
}
STOP_ENV = "FLASHDMOE_NVSHMEM_SMOKE_STOP_AFTER"


def say(rank: int, text: str) -> None:
    print(f"[rank {rank}] {text}", flush=True)


def child(args) -> int:
    import torch

    from flashdmoe.parallel import nvshmem_transport
    from flashdmoe.ranks.child import publish_uid, wait_for_uid
    from flashdmoe.parallel.team import Team

    workdir = Path(args.workdir)
    device = torch.device("cuda", 0)
    team = None
    step = "making / waiting for the unique id"
    try:
        say(args.rank, f"step: {step}")
        if args.rank == 0:
            uid = Team.make_unique_id()
            publish_uid(workdir, uid)
        else:
            uid = wait_for_uid(workdir, timeout_s=60)
        results = []
        for name, step in STEPS.items():
            say(args.rank, f"step {name}: {step}")
            if name == "join":
                team = Team.nvshmem(uid, args.rank, args.ranks, max_tokens=32, hidden=64, top_k=1,
                                    local_experts=1, dtype=torch.bfloat16, device=device)
            elif name == "init":
                module = nvshmem_transport.bound_module(team, verify=False)
            elif name == "pes":
                device_view = tuple(module.device_pes())
                host_view = (module.host_my_pe(), module.host_n_pes())
                say(args.rank, f"device sees PE {device_view[0]} of {device_view[1]}, host {host_view[0]} of {host_view[1]}")
                if device_view != host_view:
                    raise RuntimeError(f"the module's device state is not the team's: device sees PE {device_view}, "
                                       f"host {host_view}")
            else:
                results = nvshmem_transport.run_smoke(team, words=args.words, runs=2, timeout_ms=10_000)
            say(args.rank, f"step {name}: done")
            if name == args.stop_after:
                break
        step = "closing the team (finalize)"
        say(args.rank, f"step: {step}")
        closing, team = team, None
        closing.close()
        print("RESULT " + json.dumps({"rank": args.rank, "stopped_after": args.stop_after,
                                      "rounds": [vars(r) for r in results]}), flush=True)
        return 0
    except Exception as error:  # reported to the parent with the step it failed in, before any cleanup
        print("RESULT " + json.dumps({"rank": args.rank, "error": f"{type(error).__name__}: {error}", "step": step}),
              flush=True)
        if team is not None:
            if not nvshmem_transport.cuda_context_usable(device):
                # A sticky CUDA error: NVSHMEM's finalize would exit(-1) in its barrier; the peers time out.
                say(args.rank, "CUDA context unusable after the error: leaving without NVSHMEM finalize")
                sys.stdout.flush()
                os._exit(1)
            team.close()
        return 1


def parent(args) -> int:
    from flashdmoe.kernel import extension
    from flashdmoe.parallel.mps import MpsDaemon, mps_available

    print(f"[1/4] building flashdmoe_nvshmem (sm_90a) ...", flush=True)
    started = time.monotonic()
    try:
        so_path = extension.build_nvshmem(arch="sm_90a")  # arch given: no CUDA context in this process (MPS)
    except extension.BuildError as error:
        print(f"FAIL: the transport module does not build: {error}")
        return 1
    print(f"      {so_path} ({time.monotonic() - started:.1f} s)")
    reason = mps_available()
    if reason:
        print(f"FAIL: MPS is needed for {args.ranks} PEs on one GPU: {reason}")
        return 1
    print(f"[2/4] starting MPS, {args.ranks} rank processes", flush=True)
    with MpsDaemon() as mps, tempfile.TemporaryDirectory(prefix="nvshmem-smoke-") as workdir:
        env = mps.client_env(max(1, 100 // args.ranks))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        procs = [subprocess.Popen([sys.executable, __file__, "--child", "--rank", str(rank), "--ranks",
                                   str(args.ranks), "--words", str(args.words), "--workdir", workdir,
                                   "--stop-after", args.stop_after],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(args.ranks)]
        print(f"[3/4] ranks join Team.nvshmem and bind the module's device state (steps up to {args.stop_after!r})",
              flush=True)
        deadline = time.monotonic() + args.timeout
        outputs = []
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                out += f"\n(rank {rank} killed after the {args.timeout:.0f} s timeout: a hang)"
            outputs.append(out)
        if any(proc.returncode != 0 for proc in procs):
            print(mps.log_tail(20))
    print("[4/4] results (put-with-signal to the next PE, bounded wait, payload check; 2 rounds)")
    failures = 0
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        result = json.loads(lines[-1][len("RESULT "):]) if lines else None
        if result is None or "error" in result or proc.returncode != 0:
            failures += 1
            what = (f"while {result['step']}: {result['error']}" if result and "error" in result
                    else f"exit {proc.returncode}" + ("" if result else ", no result"))
            # Everything the rank printed: its step lines say how far it got, NVSHMEM's own errors follow.
            print(f"  rank {rank}: FAIL {what}; its full output:\n    " + "\n    ".join(out.splitlines()))
            continue
        if result["stopped_after"] != "smoke":
            print(f"  rank {rank}: ok, stopped after step {result['stopped_after']!r} ({STOP_ENV})")
            continue
        for number, r in enumerate(result["rounds"], start=1):
            problems = []
            if r["my_pe"] != rank or r["n_pes"] != args.ranks:
                problems.append(f"device sees PE {r['my_pe']} of {r['n_pes']} (expected {rank} of {args.ranks}): "
                                "the module's device state is not the team's")
            if not r["arrived"]:
                problems.append("the previous PE's signal never arrived (timeout)")
            elif r["mismatches"]:
                problems.append(f"{r['mismatches']} of {args.words} payload words differ")
            failures += bool(problems)
            path = "p2p path to next PE" if r["next_is_p2p"] else "no p2p path (remote transport)"
            print(f"  rank {rank} round {number}: {'ok' if not problems else 'FAIL'} - PE {r['my_pe']}/{r['n_pes']}, "
                  f"{path}, waited {r['wait_ns'] / 1e3:.1f} us" + ("".join(f"; {p}" for p in problems)))
    print("PASS" if failures == 0 else f"FAIL ({failures} problem(s))")
    return 0 if failures == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="rank processes on GPU 0 (2..8)")
    parser.add_argument("--words", type=int, default=4096, help="32-bit words each PE puts")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds before hung ranks are killed")
    parser.add_argument("--stop-after", choices=list(STEPS), default=os.environ.get(STOP_ENV) or "smoke",
                        help=f"last rank step to run (default: ${STOP_ENV}, else smoke): join, init (register "
                             "the device state), pes (check it with a kernel), smoke")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 2 <= args.ranks <= 8:
        parser.error(f"--ranks={args.ranks}: expected 2..8")
    if args.stop_after not in STEPS:  # a default from the environment skips argparse's choices
        parser.error(f"{STOP_ENV}={args.stop_after!r}: expected one of {', '.join(STEPS)}")
    if args.words < 1:
        parser.error(f"--words={args.words}: expected a positive count")
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
