"""Training steps of an NVSHMEM team's layer (P processes on one GPU under MPS): the backward on the
device exchange (``flashdmoe.backward.ep_backward``, what users get) beside the torch-ops backward
(``flashdmoe.parallel.ep_peer``, forced with ``backward="torch"``) in the same run, and how far their gradients
are apart. Prints one table row per (P, shape); the medians are per rank, the table shows rank 0's and
the slowest rank's backward.

    python scripts/team_backward_bench.py [--ranks 2,4] [--repeats 10] [--json out.json] [--device-only]
        [--peer-transport p2p|nvshmem|auto] [--ranks-per-node N]

``--device-only`` times the device exchange alone (no torch-ops run, no speed-up column): for comparing
builds of the device path back to back on one machine. ``--peer-transport nvshmem`` makes every peer an
NVSHMEM peer (the NVSHMEM kernel build; forward and backward exchange by puts, as across nodes);
``--ranks-per-node 2`` lays the ranks out as nodes of 2 (stores within a node, puts across: a team over
several nodes, emulated on one GPU; with ``--peer-transport auto``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from flashdmoe.parallel.mps import MpsDaemon
from flashdmoe.ranks.launcher import run_ranks
from flashdmoe.ranks.problem import Problem

SCENARIO = "flashdmoe.bench.rank_scenarios:timed_training_steps"


def shapes(world_size: int) -> list[tuple[str, Problem]]:
    per_rank = {2: 4096, 4: 2048}.get(world_size, 1024)
    tokens = (per_rank,) * world_size
    return [
        ("H2048 I1024 E16 k2 gelu", Problem(tokens, 2048, 1024, 16, 2, "gelu", True, None, seed=31)),
        ("H2048 I768 E32 k8 swiglu", Problem(tokens, 2048, 768, 32, 8, "swiglu", True, None, seed=32)),
    ]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    norm = float(b.norm())
    return float((a - b).norm()) / norm if norm else float((a - b).abs().max())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--device-only", action="store_true", help="skip the torch-ops backward")
    parser.add_argument("--peer-transport", choices=("p2p", "nvshmem", "auto"), default="p2p")
    parser.add_argument("--ranks-per-node", type=int, default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also print rank 0's torch-profiler tables of one device-exchange step")
    args = parser.parse_args(argv)
    rows, failed = [], False
    daemon = MpsDaemon().start()
    try:
        for world_size in [int(p) for p in args.ranks.split(",")]:
            for name, problem in shapes(world_size):
                results = {}
                paths = ("auto",) if args.device_only else ("auto", "torch")
                for path in paths:
                    nvshmem = args.peer_transport == "nvshmem" or args.ranks_per_node is not None
                    team = {**problem.team_kwargs(), "peer_transport": args.peer_transport}
                    if args.ranks_per_node is not None:
                        team["ranks_per_node"] = args.ranks_per_node
                    result = run_ranks(SCENARIO, world_size, mps=daemon, timeout_s=600,
                                       env={"FLASHDMOE_KERNEL_BUILD": "nvshmem"} if nvshmem else {}, team=team,
                                       params={"problem": problem.to_dict(), "backward": path,
                                               "profile": bool(args.profile and path == "auto"),
                                               "repeats": args.repeats if path == "auto" else max(3, args.repeats // 3)})
                    if not result.ok:
                        print(result.summary(), file=sys.stderr)
                        failed = True
                        break
                    results[path] = result
                if len(results) != len(paths):
                    continue
                device = results["auto"].ranks
                torch_path = results["torch"].ranks if "torch" in results else None
                if args.profile:
                    print(f"== P={world_size} {name}: rank 0, one step, by self CPU time\n{device[0].info['profile']}")
                    print(f"== by self CUDA time\n{device[0].info['profile_cuda']}", flush=True)
                nan = float("nan")
                diff = nan if torch_path is None else max(
                    relative(d.tensors[g], t.tensors[g]) for d, t in zip(device, torch_path)
                    for g in ("dx", "d_router", "dw1", "dw2"))
                row = {"P": world_size, "shape": name, "tokens_per_rank": problem.tokens[0],
                       "peer_transport": args.peer_transport, "ranks_per_node": args.ranks_per_node,
                       "forward_ms": device[0].info["forward_ms"],
                       "backward_ms": device[0].info["backward_ms"],
                       "backward_ms_slowest": max(r.info["backward_ms"] for r in device),
                       "torch_backward_ms": nan if torch_path is None else torch_path[0].info["backward_ms"],
                       "torch_backward_ms_slowest": nan if torch_path is None else max(
                           r.info["backward_ms"] for r in torch_path),
                       "max_grad_difference": diff}
                row["speedup"] = row["torch_backward_ms_slowest"] / row["backward_ms_slowest"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        daemon.stop()
    print("\n| P | T per rank | shape | forward ms | backward ms (device exchange) | backward ms (torch ops) | "
          "speed-up | largest relative gradient difference |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['tokens_per_rank']} | {r['shape']} | {r['forward_ms']:.3f} | "
              f"{r['backward_ms']:.3f} (slowest rank {r['backward_ms_slowest']:.3f}) | "
              f"{r['torch_backward_ms']:.3f} (slowest {r['torch_backward_ms_slowest']:.3f}) | "
              f"{r['speedup']:.1f}x | {r['max_grad_difference']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
