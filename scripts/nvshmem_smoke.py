#!/usr/bin/env python3
"""Smoke test of flashdmoe_nvshmem, the NVSHMEM device-API transport module, on one Hopper GPU.

    python scripts/nvshmem_smoke.py [--ranks 2] [--words 4096] [--timeout 90]

What it proves, in order (each step is printed; the first failing one says why):
1. the module builds (relocatable device code, libnvshmem_device, the nvidia-nvshmem wheel's host library);
   built here once, before any rank starts (ranks only import it);
2. CUDA MPS starts, and P rank processes share the GPU under it (NVSHMEM needs MPS for several PEs/GPU);
3. each rank joins a Team.nvshmem (nvshmem4py, unique-id bootstrap), then registers the module's device state
   with that NVSHMEM instance (init_device_state: one more, reference-counted, initialisation with the team's
   unique id; the device must see the host's PE and PE count), released when the team closes;
4. each rank's kernel reads nvshmem_my_pe / n_pes on the device, puts a patterned payload to the next PE with
   nvshmemx_putmem_signal_nbi_warp, waits (bounded) for its own signal and checks the previous PE's payload,
   twice (the signal carries the round number: no reset between rounds).
Exit code 0 when every rank passes every round. Does not build flashdmoe_cuda. Needs nvshmem4py, the
nvidia-nvshmem-cu13 wheel (or FLASHDMOE_NVSHMEM_HOME) and nvidia-cuda-mps-control.
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


def child(args) -> int:
    import torch

    from flashdmoe import nvshmem_transport
    from flashdmoe.ranks.child import publish_uid, wait_for_uid
    from flashdmoe.team import Team

    workdir = Path(args.workdir)
    step = "making / waiting for the unique id"
    try:
        if args.rank == 0:
            uid = Team.make_unique_id()
            publish_uid(workdir, uid)
        else:
            uid = wait_for_uid(workdir, timeout_s=60)
        step = "joining Team.nvshmem (nvshmem4py init, collective)"
        team = Team.nvshmem(uid, args.rank, args.ranks, max_tokens=32, hidden=64, top_k=1, local_experts=1,
                            dtype=torch.bfloat16, device=torch.device("cuda", 0))
        try:
            step = "binding flashdmoe_nvshmem's device state and running the smoke kernel"
            results = nvshmem_transport.run_smoke(team, words=args.words, runs=2, timeout_ms=10_000)
        finally:
            team.close()
        print("RESULT " + json.dumps({"rank": args.rank, "rounds": [vars(r) for r in results]}), flush=True)
        return 0
    except Exception as error:  # reported to the parent with the step it failed in
        print("RESULT " + json.dumps({"rank": args.rank, "error": f"{type(error).__name__}: {error}", "step": step}),
              flush=True)
        return 1


def parent(args) -> int:
    from flashdmoe import extension
    from flashdmoe.mps import MpsDaemon, mps_available

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
                                   str(args.ranks), "--words", str(args.words), "--workdir", workdir],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(args.ranks)]
        print("[3/4] ranks join Team.nvshmem and bind the module's device state", flush=True)
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
        if not lines:
            failures += 1
            print(f"  rank {rank}: FAIL (exit {proc.returncode}, no result); its output:\n    "
                  + "\n    ".join(out.splitlines()[-25:]))
            continue
        result = json.loads(lines[-1][len("RESULT "):])
        if "error" in result:
            failures += 1
            print(f"  rank {rank}: FAIL while {result['step']}: {result['error']}")
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
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 2 <= args.ranks <= 8:
        parser.error(f"--ranks={args.ranks}: expected 2..8")
    if args.words < 1:
        parser.error(f"--words={args.words}: expected a positive count")
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
