"""The unfused expert-parallel baseline: one rank's MoE forward through host-launched collectives.

Router, per-expert counts exchanged first (``all_to_all_single``), the routed rows dispatched with
``all_to_all_single``, the local experts as two ``torch._grouped_mm`` calls, the results sent back with
``all_to_all_single`` and the weighted sum at the source. Over ``torch.distributed``: NCCL on GPUs, gloo on
CPUs (where the experts can run through :func:`flashdmoe.reference.expert_ffn` instead).
"""

from __future__ import annotations

import torch

from flashdmoe import reference
from flashdmoe.bench import baselines


def all_to_all_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    activation: str = "gelu",
    normalize_topk: bool = True,
    group=None,
    experts: str = "grouped_mm",
    traffic: dict | None = None,
) -> torch.Tensor:
    """This rank's MoE output through host-launched collectives (the unfused expert-parallel baseline).

    Collective over ``group`` (every rank calls it). Dropless; the router as
    :func:`flashdmoe.bench.baselines.route_top_k` (fp32; ``torch.topk`` decides ties).

    Args:
        x: ``[T, H]`` this rank's tokens (T may differ per rank, 0 allowed); bfloat16/float16/float32.
        router_weight: ``[E, H]`` replicated, x's dtype.
        w1: ``[L, H, I]`` (``[L, H, 2I]`` for swiglu) this rank's experts ``[rank L, (rank + 1) L)``,
            ``E = L * world_size``; w2: ``[L, I, H]``. For ``experts="grouped_mm"`` on CUDA: bfloat16.
        experts: ``"grouped_mm"`` (two ``torch._grouped_mm`` calls) or ``"reference"``
            (:func:`flashdmoe.reference.expert_ffn` per local expert, for CPU checks).
        traffic: if given, filled with ``rows_routed_remote``, ``dispatch_bytes``, ``combine_bytes``
            (rows to / results for other ranks, in bytes) and ``count_bytes`` (the count messages).

    Returns: ``y [T, H]`` in x's dtype.
    """
    import torch.distributed as dist

    if experts not in ("grouped_mm", "reference"):
        raise ValueError(f"experts={experts!r}: expected 'grouped_mm' or 'reference'")
    if x.dim() != 2 or router_weight.dim() != 2 or router_weight.shape[1] != x.shape[1]:
        raise ValueError(f"x.shape={tuple(x.shape)}, router_weight.shape={tuple(router_weight.shape)}: "
                         "expected [T, H] and [E, H]")
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens, hidden = x.shape
    num_experts, local = router_weight.shape[0], w1.shape[0]
    if local * world_size != num_experts:
        raise ValueError(f"w1.shape={tuple(w1.shape)}: expected {num_experts // max(world_size, 1)} local "
                         f"experts (E={num_experts} over {world_size} ranks)")
    if w2.dim() != 3 or w2.shape[0] != local or w2.shape[2] != hidden:
        raise ValueError(f"w2.shape={tuple(w2.shape)}: expected [{local}, I, {hidden}]")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: expected 1 <= top_k <= E ({num_experts})")
    device = x.device

    # Gate: choices ordered by global expert (so by destination rank, then local expert), then token.
    routing = baselines.route_top_k(x, router_weight, top_k, normalize_topk)
    sorted_experts, order = torch.sort(routing.experts.reshape(-1), stable=True)
    token_of_row = order // top_k
    rows = x.index_select(0, token_of_row)  # [T k, H]
    send_counts = torch.bincount(sorted_experts, minlength=num_experts)  # int64 [E]

    # Counts first (L per destination), then one copy of all counts to the host for the splits.
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    host = torch.cat([send_counts, recv_counts]).cpu()
    input_splits = host[:num_experts].view(world_size, local).sum(1).tolist()
    recv_host = host[num_experts:].view(world_size, local)  # [source rank, local expert]
    output_splits = recv_host.sum(1).tolist()

    # Dispatch: received rows are [source][local expert][row].
    received = rows.new_empty((sum(output_splits), hidden))
    dist.all_to_all_single(received, rows, output_splits, input_splits, group=group)

    # Experts: regroup by local expert (stable: source order within an expert), compute, put back.
    per_expert = recv_host.sum(0)  # [L]
    if received.shape[0]:
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=device).repeat(world_size), recv_counts.view(-1).to(device),
            output_size=received.shape[0])
        by_expert = torch.argsort(expert_of_row, stable=True)
        grouped = received.index_select(0, by_expert)
        if experts == "grouped_mm":
            if not baselines.grouped_mm_available():
                raise baselines.BaselineUnavailable(f"torch {torch.__version__} has no torch._grouped_mm")
            offsets = torch.cumsum(per_expert, 0).to(device=device, dtype=torch.int32)
            hidden_rows = baselines.activate(torch._grouped_mm(grouped, w1, offs=offsets), activation)
            outputs = torch._grouped_mm(hidden_rows, w2, offs=offsets).to(x.dtype)
        else:
            pieces = [reference.expert_ffn(piece, w1[e], w2[e], activation).to(x.dtype)
                      for e, piece in enumerate(grouped.split(per_expert.tolist()))]
            outputs = torch.cat(pieces)
        results = torch.empty_like(outputs).index_copy_(0, by_expert, outputs)
    else:
        results = received

    # Combine: results travel back to their sources, which form the weighted sum.
    returned = rows.new_empty((tokens * top_k, hidden))
    dist.all_to_all_single(returned, results.contiguous(), input_splits, output_splits, group=group)
    row_weights = routing.weights.reshape(-1).index_select(0, order)
    y = baselines.scatter_combine(tokens, token_of_row, returned, row_weights, x.dtype)
    if traffic is not None:
        row_bytes = hidden * x.element_size()
        remote_rows = tokens * top_k - input_splits[rank]
        traffic.update({
            "rank": rank, "rows_routed_remote": int(remote_rows), "dispatch_bytes": int(remote_rows * row_bytes),
            "combine_bytes": int((sum(output_splits) - output_splits[rank]) * row_bytes),
            "count_bytes": int((world_size - 1) * local * send_counts.element_size()),
        })
    return y
