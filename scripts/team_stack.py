"""A stack of team forwards as a model's layers make them: does the host queue layer n + 1 while the GPU
runs layer n?

An emulated team of ``--ranks`` ranks runs ``--layers`` MoE layers (each its own weights) one after the
other on one stream, eagerly, as inference would. Printed per tree: the wall time of a step (the layers
issued back to back, then ``flashdmoe.synchronize()``), the same layers replayed from one CUDA graph (the
GPU's own time for them: no host work between layers), and the host time per layer call (measured with the
GPU held busy by a ``torch.cuda._sleep``, so nothing can wait for it, unless the call itself waits for an
earlier launch). If the host never waits, the eager step is about the larger of the GPU's time and the
host's; if it waits for each layer's launch, it is about their sum.

``--train`` makes each step a training step instead: the layers' forwards with gradients, a loss, and
``loss.backward()`` (a team's backward is not capturable: no replay). Printed: the eager step, and the
GPU's time for it (the sum of its kernels' times by the profiler: the step with no gaps between kernels).
The backward needs the last forward's counts on the host, so it starts by waiting for the forwards; after
that, if the host waits for each layer's backward before queueing the next, the step is about the host's
time plus the GPU's, else about the larger of the two.

``--tree DIR`` imports flashdmoe from another copy of the repository (an A/B of two commits on one
machine: scripts/host_ab.sh runs it once per tree).

    python scripts/team_stack.py [--tree DIR] [--ranks 4] [--layers 16] [--tokens 8] [--steps 20] [--train]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8, help="tokens per rank")
    parser.add_argument("--shape", default="1024/512/32/4", help="H/I/E/k (swiglu)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", action="store_true", help="forward + backward steps (no graph replay)")
    parser.add_argument("--host-profile", action="store_true",
                        help="with --train: also print the host's top operators (self CPU time) in one step")
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    import torch

    import flashdmoe
    from flashdmoe.parallel.team import Team

    H, I, E, k = (int(v) for v in args.shape.split("/"))
    P, L, T = args.ranks, args.layers, args.tokens
    print(f"tree {args.tree}; emulated team of {P} ranks, {L} layers, {T} tokens per rank, H={H} I={I} E={E} "
          f"k={k} swiglu, seed {args.seed}{', training steps' if args.train else ''}")
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    bf16 = torch.bfloat16

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(bf16)

    layers = []
    for _ in range(L):
        router = randn(E, H, scale=H ** -0.5)
        w1 = randn(E, H, 2 * I, scale=H ** -0.5)
        w2 = randn(E, I, H, scale=I ** -0.5)
        layers.append((router, list(w1.split(E // P)), list(w2.split(E // P))))
    xs = [randn(T, H) for _ in range(P)]
    team = Team.emulated(P, max_tokens=T, hidden=H, top_k=k, local_experts=E // P, dtype=bf16)

    def step(inputs):
        hidden = inputs
        for router, w1s, w2s in layers:
            # the layer's output feeds the next, as in a model: residual add, then RMS norm (keeps the scale)
            ys = flashdmoe.moe_expert_parallel(hidden, router, w1s, w2s, top_k=k, activation="swiglu", team=team)
            hidden = [torch.nn.functional.rms_norm(h + y, (H,)) for h, y in zip(hidden, ys)]
        return hidden

    if args.train:
        train(args, step, layers, xs, team)
        return
    with torch.no_grad():
        for _ in range(3):
            step(xs)
        flashdmoe.synchronize()
        walls = []
        for _ in range(args.steps):
            start = time.perf_counter()
            out = step(xs)
            flashdmoe.synchronize()
            walls.append(time.perf_counter() - start)
        eager_out = [o.clone() for o in out]

        hosts = []
        for _ in range(5):
            torch.cuda._sleep(200_000_000)  # ~0.1 s: the GPU busy well past the layer calls
            start = time.perf_counter()
            step(xs)
            hosts.append((time.perf_counter() - start) / L)
            flashdmoe.synchronize()

        static = [x.clone() for x in xs]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = step(static)
        graph.replay()
        flashdmoe.synchronize()
        same = all(torch.equal(a, b) for a, b in zip(graph_out, eager_out))
        replays = []
        for _ in range(args.steps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            replays.append(start.elapsed_time(end) / 1e3)
        flashdmoe.synchronize()
    team.close()
    eager, replay, host = (statistics.median(v) for v in (walls, replays, hosts))
    print("| eager step ms | graph replay ms | host µs per layer call | eager / replay | replay bitwise eager |")
    print(f"| {eager * 1e3:.3f} | {replay * 1e3:.3f} | {host * 1e6:.1f} | {eager / replay:.2f} | {same} |")


def train(args, step, layers, xs, team) -> None:
    """--train: forward + backward steps; see the module's docstring."""
    import torch

    import flashdmoe

    leaves = [t.requires_grad_() for router, w1s, w2s in layers for t in (router, *w1s, *w2s)]
    dys = [torch.randn_like(x) for x in xs]

    def train_step():
        for t in leaves:
            t.grad = None
        out = step(xs)
        sum((o.float() * dy.float()).sum() for o, dy in zip(out, dys)).backward()

    for _ in range(3):
        train_step()
    flashdmoe.synchronize()
    walls, gpus = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        train_step()
        flashdmoe.synchronize()
        walls.append(time.perf_counter() - start)
    for _ in range(3):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            train_step()
            flashdmoe.synchronize()
        gpus.append(sum(event.self_device_time_total for event in profile.key_averages()) / 1e6)
    if args.host_profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            train_step()
            flashdmoe.synchronize()
        print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))
    grads = [t.grad.clone() for t in leaves]
    train_step()
    flashdmoe.synchronize()
    same = all(torch.equal(a, t.grad) for a, t in zip(grads, leaves))
    team.close()
    eager, gpu = statistics.median(walls), statistics.median(gpus)
    print("| eager training step ms | kernels' time per step ms | eager / kernels | repeat bitwise |")
    print(f"| {eager * 1e3:.3f} | {gpu * 1e3:.3f} | {eager / gpu:.2f} | {same} |")


if __name__ == "__main__":
    main()
