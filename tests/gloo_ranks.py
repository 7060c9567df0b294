"""Real multi-process runs over a gloo group on 127.0.0.1, shared by the CPU expert-parallel tests: spawn
``world_size`` processes that join one group and each call ``run(rank, world_size, *args)``; a rank's
traceback is written to the run's folder and raised in the parent, so a failure names its rank."""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, error_dir: str, timeout_s: float, run: Callable,
               args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        run(rank, world_size, *args)
    except BaseException:
        with open(os.path.join(error_dir, f"rank{rank}.txt"), "w") as handle:
            handle.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn(run: Callable, world_size: int, error_dir, *args, timeout_s: float = 60.0) -> None:
    """Run ``run(rank, world_size, *args)`` (a module-level function: the children import it) in
    ``world_size`` gloo ranks; ``AssertionError`` with every failed rank's traceback."""
    try:
        mp.spawn(_rank_main, args=(world_size, free_port(), str(error_dir), timeout_s, run, args),
                 nprocs=world_size, join=True)
    except mp.ProcessRaisedException as error:
        details = "\n".join(report.read_text() for report in sorted(error_dir.glob("rank*.txt")))
        raise AssertionError(f"a rank failed:\n{details or error}") from None


def case_inputs(case: dict, world_size: int):
    """Seeded inputs of every rank: xs, dys ``[T_r, H]``, router ``[E, H]``, w1s/w2s shards (random normal).
    case: ``seed``, ``tokens`` (per rank), ``hidden``, ``ffn``, ``local_experts``, ``activation``,
    ``dtype``; ``zero_router`` (optional) makes every probability tie."""
    generator = torch.Generator().manual_seed(case["seed"])
    hidden, ffn, local, dtype = case["hidden"], case["ffn"], case["local_experts"], case["dtype"]
    experts = local * world_size
    w1_cols = 2 * ffn if case["activation"] == "swiglu" else ffn

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) * scale).to(dtype)

    router = randn(experts, hidden, scale=hidden ** -0.5)
    if case.get("zero_router"):
        router = torch.zeros_like(router)
    w1s = [randn(local, hidden, w1_cols, scale=hidden ** -0.5) for _ in range(world_size)]
    w2s = [randn(local, ffn, hidden, scale=ffn ** -0.5) for _ in range(world_size)]
    xs = [randn(tokens, hidden) for tokens in case["tokens"]]
    dys = [randn(tokens, hidden) for tokens in case["tokens"]]
    return xs, dys, router, w1s, w2s
