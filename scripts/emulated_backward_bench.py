"""Training steps of an emulated team (``Team.emulated(P)``, every rank on one GPU) through
``flashdmoe.moe_expert_parallel``: the backward on the device exchange (``ep_backward.emulated_backward``,
what users get) beside the torch-ops backward (``FLASHDMOE_TEAM_BACKWARD=torch``: each rank's one-rank
backward against all shards) in the same run, and how far their gradients are apart. CUDA-event medians of
forward, backward and the step, per shape and P, and the host's time in the backward call (where it is
as long as the backward's GPU time, the step is host-bound). With ``--graph`` the exchange's whole step
(forward and backward) is also captured in one CUDA graph and its replays timed, and their gradients
compared with the eager step's bit for bit; ``--no-torch`` leaves out the torch-ops backward.

    python scripts/emulated_backward_bench.py [--ranks 2,4,8] [--repeats 10] [--seed 0] [--graph] [--no-torch]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashdmoe
from flashdmoe import cuda_backend
from flashdmoe.parallel.team import Team

SHAPES = [("H2048 I1024 E16 k2 gelu", 2048, 1024, 16, 2, "gelu"),
          ("H2048 I768 E32 k8 swiglu", 2048, 768, 32, 8, "swiglu")]
TOKENS = {2: 4096, 4: 2048, 8: 1024}  # per rank: 8192 tokens in all


def problem(P, T, H, I, E, k, activation, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cols = 2 * I if activation == "swiglu" else I
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)  # noqa: E731
    xs = [rnd(T, H) for _ in range(P)]
    router = rnd(E, H, scale=H ** -0.5)
    w1s = [rnd(E // P, H, cols, scale=H ** -0.5) for _ in range(P)]
    w2s = [rnd(E // P, I, H, scale=I ** -0.5) for _ in range(P)]
    dys = [rnd(T, H) for _ in range(P)]
    return xs, router, w1s, w2s, dys


def step_times(team, tensors, k, activation, repeats):
    xs, router, w1s, w2s, dys = tensors
    leaves = [t.detach().clone().requires_grad_() for t in (router, *xs, *w1s, *w2s)]
    P = len(xs)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(repeats + 2)]
    host = []
    for marks in events:
        for leaf in leaves:
            leaf.grad = None
        marks[0].record()
        ys = flashdmoe.moe_expert_parallel(leaves[1:1 + P], leaves[0], leaves[1 + P:1 + 2 * P], leaves[1 + 2 * P:],
                                           top_k=k, activation=activation, team=team)
        marks[1].record()
        started = time.perf_counter()
        torch.autograd.backward(ys, dys)
        host.append((time.perf_counter() - started) * 1e3)
        marks[2].record()
    torch.cuda.synchronize()
    flashdmoe.check_errors()
    timed = events[2:]  # two warm-ups
    fwd = statistics.median(a.elapsed_time(b) for a, b, _ in timed)
    bwd = statistics.median(b.elapsed_time(c) for _, b, c in timed)
    step = statistics.median(a.elapsed_time(c) for a, _, c in timed)
    return (fwd, bwd, step, statistics.median(host[2:])), [leaf.grad.float() for leaf in leaves]


def graph_step_time(team, tensors, k, activation, repeats):
    """The exchange's step captured in one CUDA graph (after two eager steps) and replayed: the CUDA-event
    median of a replay, and the last replay's gradients."""
    xs, router, w1s, w2s, dys = tensors
    leaves = [t.detach().clone().requires_grad_() for t in (router, *xs, *w1s, *w2s)]
    P = len(xs)

    def step():
        ys = flashdmoe.moe_expert_parallel(leaves[1:1 + P], leaves[0], leaves[1 + P:1 + 2 * P], leaves[1 + 2 * P:],
                                           top_k=k, activation=activation, team=team)
        torch.autograd.backward(ys, dys)

    for _ in range(2):
        step()
    flashdmoe.synchronize()  # a team's last launch is checked before a capture
    for leaf in leaves:
        leaf.grad = None  # the captured backward's gradients come from the graph's pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(repeats + 2)]
    for marks in events:
        marks[0].record()
        graph.replay()
        marks[1].record()
    torch.cuda.synchronize()
    flashdmoe.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events[2:]), [leaf.grad.float() for leaf in leaves]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--graph", action="store_true", help="also time the exchange's step replayed from a CUDA graph")
    parser.add_argument("--no-torch", action="store_true", help="leave out the torch-ops backward")
    args = parser.parse_args()
    print(f"seed {args.seed}; {torch.cuda.get_device_name()}; bf16; ms are CUDA-event medians of {args.repeats}")
    rows, graph_rows = [], []
    for P in (int(p) for p in args.ranks.split(",")):
        for name, H, I, E, k, activation in SHAPES:
            T = TOKENS.get(P, 1024)
            tensors = problem(P, T, H, I, E, k, activation, args.seed)
            team = Team.emulated(P, max_tokens=T, hidden=H, top_k=k, local_experts=E // P, dtype=torch.bfloat16)
            previous = cuda_backend.debug.team_backward
            torch_ops, replay = (float("nan"),) * 4, None
            try:
                exchange, grads = step_times(team, tensors, k, activation, args.repeats)
                reference = grads
                if args.graph:
                    replay = graph_step_time(team, tensors, k, activation, args.repeats)
                if not args.no_torch:
                    cuda_backend.debug.team_backward = "torch"
                    torch_ops, reference = step_times(team, tensors, k, activation, args.repeats)
            finally:
                cuda_backend.debug.team_backward = previous
                team.close()
            # relative to each leaf's largest gradient element (both paths round to bf16 once)
            apart = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(grads, reference))
            rows.append((P, name, T, *exchange, *torch_ops, apart))
            if replay is not None:
                same = all(torch.equal(a, b) for a, b in zip(grads, replay[1]))
                graph_rows.append((P, name, T, exchange[2], replay[0], same))
    print("| P | shape | tokens per rank | exchange fwd / bwd / step | its bwd host | torch-ops fwd / bwd / step "
          "| its bwd host | bwd speed-up | grads apart (rel. max) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for P, name, T, f, b, s, h, tf, tb, ts, th, apart in rows:
        print(f"| {P} | {name} | {T} | {f:.3f} / {b:.3f} / {s:.3f} | {h:.3f} | {tf:.3f} / {tb:.3f} / {ts:.3f} "
              f"| {th:.3f} | {tb / b:.2f}x | {apart:.1e} |")

    if graph_rows:
        print("\n| P | shape | tokens per rank | eager step (ms) | graph replay (ms) | replay / eager | grads |")
        print("|---|---|---|---|---|---|---|")
        for P, name, T, eager, replayed, same in graph_rows:
            print(f"| {P} | {name} | {T} | {eager:.3f} | {replayed:.3f} | {replayed / eager:.2f} | "
                  f"{'bitwise the eager step' if same else 'DIFFER from the eager step'} |")


if __name__ == "__main__":
    main()
