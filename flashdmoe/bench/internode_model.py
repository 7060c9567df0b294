"""A cost model of the forward (and a training step) across nodes: bytes per rank and predicted latency for
N nodes of G GPUs.

Not a measurement: no multi-node machine has run the kernel. The model takes the routing as uniform (each
token picks a uniformly random set of ``k`` distinct experts; E experts spread evenly, ``E / P`` per rank,
ranks node-major) and counts, per rank and per direction (dispatch out, results back: the same bytes):

* **direct puts** (the kernel's ``exchange="direct"``, docs/design.md §8): one row of ``H`` elements per kept
  choice whose expert is on another rank, straight to that rank. Of a token's ``k`` choices,
  ``k (G - 1) / P`` land on another rank of its node (NVLink) and ``k (N - 1) / N`` on another node
  (InfiniBand, one NIC per GPU, rail-optimised).
* **hierarchical** (DeepEP's internode layout): a token sends one row per *distinct* remote node its
  choices hit, to the rank with the same local index there, which forwards it over NVLink to the ranks
  that own the chosen experts; results come back the same way, summed per node first. A remote node is
  hit with probability ``1 - C(E - E/N, k) / C(E, k)``.
* **relayed rows** (the kernel's ``exchange="hierarchical"`` as built): the hierarchical dispatch, then
  the direct puts' way back (one result row per remote choice).

Time per direction is the slower of the two links, ``max(NVLink bytes / NVLink bandwidth, IB bytes / IB
bandwidth)`` (a rank drives both at once); a forward pays it twice (dispatch, combine). The compute is an
input (the single-GPU kernel's measured time: each rank computes about ``T k`` rows whatever ``P``). The
predicted forward is bounded by ``compute + communication`` (nothing overlapped) and
``max(compute, communication)`` (all of it overlapped); the kernel overlaps little across ranks today
(docs/perf-notes.md), so the first is the one to expect. Latency per message and the NVSHMEM proxy's
overheads are not in the model.

A **training step** (:func:`predict_step`) adds the backward's exchange (docs/design.md §5), direct puts:
``x`` and ``dy`` rows to the owners (two rows per remote choice), the ``dx`` rows back (one), each with a
4-byte weight word, and the router's float32 share, ``E * H * 4`` bytes to every other rank (``G - 1`` of
them over NVLink, ``P - G`` over InfiniBand); the backward's compute is an input too (measured: about
twice the forward's).

    python -m flashdmoe.bench.internode_model [--compute-ms 0.60] [--step] [--shapes T/H/E/k,...] [configs ...]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

__all__ = ["NVLINK_GBPS", "IB_GBPS", "RankTraffic", "Prediction", "StepPrediction", "rank_traffic", "predict",
           "predict_step", "main"]

#: H200 NVLink 4: 900 GB/s per GPU, both directions together.
NVLINK_GBPS = 450.0
#: One 400 Gb/s InfiniBand NIC per GPU (DGX / HGX H200, rail-optimised).
IB_GBPS = 50.0


@dataclass(frozen=True)
class RankTraffic:
    """Expected rows one rank sends per direction per forward (dispatch; the combine returns as many)."""

    nvlink_rows: float  # to other ranks of its node (direct), or also rows forwarded for other nodes (hierarchical)
    ib_rows: float      # to other nodes


@dataclass(frozen=True)
class Prediction:
    nodes: int
    ranks: int
    direct: RankTraffic
    hierarchical: RankTraffic
    direct_comm_ms: float        # dispatch + combine
    hierarchical_comm_ms: float
    compute_ms: float

    @property
    def relayed_comm_ms(self) -> float:
        """The built hierarchical exchange: relayed rows out, direct results back."""
        return (self.direct_comm_ms + self.hierarchical_comm_ms) / 2

    def bounds(self, layout: str) -> tuple[float, float]:
        """(all overlapped, nothing overlapped) forward ms for ``layout`` "direct", "hierarchical" or
        "relayed"."""
        comm = {"direct": self.direct_comm_ms, "hierarchical": self.hierarchical_comm_ms,
                "relayed": self.relayed_comm_ms}[layout]
        return max(self.compute_ms, comm), self.compute_ms + comm


def node_hit_probability(experts: int, top_k: int, nodes: int) -> float:
    """Probability that a token's ``top_k`` distinct experts include one of a given node's ``E / N``."""
    if nodes <= 1:
        return 1.0
    return 1.0 - math.comb(experts - experts // nodes, top_k) / math.comb(experts, top_k)


def rank_traffic(tokens: int, experts: int, top_k: int, nodes: int, gpus_per_node: int = 8) -> tuple[RankTraffic, RankTraffic]:
    """(direct, hierarchical) rows per rank per direction for ``tokens`` tokens on that rank."""
    ranks = nodes * gpus_per_node
    if experts % ranks:
        raise ValueError(f"experts={experts} must be a multiple of the {ranks} ranks of {nodes} nodes x {gpus_per_node}")
    same_node = tokens * top_k * (gpus_per_node - 1) / ranks
    other_nodes = tokens * top_k * (nodes - 1) / nodes
    direct = RankTraffic(same_node, other_nodes)
    # One row per distinct remote node; there the rail peer forwards it to each owning rank but itself.
    deduplicated = tokens * (nodes - 1) * node_hit_probability(experts, top_k, nodes)
    forwarded = other_nodes * (gpus_per_node - 1) / gpus_per_node
    hierarchical = RankTraffic(same_node + forwarded, deduplicated)
    return direct, hierarchical


def _comm_ms(traffic: RankTraffic, row_bytes: int, nvlink_gbps: float, ib_gbps: float) -> float:
    one_way = max(traffic.nvlink_rows * row_bytes / (nvlink_gbps * 1e9), traffic.ib_rows * row_bytes / (ib_gbps * 1e9))
    return 2 * one_way * 1e3


def predict(tokens: int, hidden: int, experts: int, top_k: int, nodes: int, compute_ms: float, *,
            element_bytes: int = 2, gpus_per_node: int = 8, nvlink_gbps: float = NVLINK_GBPS,
            ib_gbps: float = IB_GBPS) -> Prediction:
    direct, hierarchical = rank_traffic(tokens, experts, top_k, nodes, gpus_per_node)
    row_bytes = hidden * element_bytes
    return Prediction(nodes, nodes * gpus_per_node, direct, hierarchical,
                      _comm_ms(direct, row_bytes, nvlink_gbps, ib_gbps),
                      _comm_ms(hierarchical, row_bytes, nvlink_gbps, ib_gbps), compute_ms)


@dataclass(frozen=True)
class StepPrediction:
    """One training step per rank with direct puts: the forward's and the backward's exchange (ms each) and
    the measured compute they come on top of (or hide under)."""

    nodes: int
    ranks: int
    forward_comm_ms: float
    backward_comm_ms: float
    share_ms: float  # of backward_comm_ms: the router's share to every other rank
    compute_ms: float  # forward + backward compute of one rank

    @property
    def comm_ms(self) -> float:
        return self.forward_comm_ms + self.backward_comm_ms

    def bounds(self) -> tuple[float, float]:
        """(all overlapped, nothing overlapped) step ms."""
        return max(self.compute_ms, self.comm_ms), self.compute_ms + self.comm_ms


def predict_step(tokens: int, hidden: int, experts: int, top_k: int, nodes: int, forward_ms: float,
                 backward_ms: float, *, element_bytes: int = 2, gpus_per_node: int = 8,
                 nvlink_gbps: float = NVLINK_GBPS, ib_gbps: float = IB_GBPS) -> StepPrediction:
    """A training step's exchange with direct puts (the backward's rows, dx rows and router share) beside
    ``forward_ms + backward_ms`` of compute (one rank's, measured on one GPU)."""
    direct, _ = rank_traffic(tokens, experts, top_k, nodes, gpus_per_node)
    row_bytes = hidden * element_bytes
    one_way = _comm_ms(direct, row_bytes, nvlink_gbps, ib_gbps) / 2
    words = RankTraffic(direct.nvlink_rows * 4 / row_bytes, direct.ib_rows * 4 / row_bytes)  # weight words
    word_ms = _comm_ms(words, row_bytes, nvlink_gbps, ib_gbps) / 2
    share = experts * hidden * 4
    share_ms = max((gpus_per_node - 1) * share / (nvlink_gbps * 1e9),
                   (nodes - 1) * gpus_per_node * share / (ib_gbps * 1e9)) * 1e3
    backward = 3 * one_way + 2 * word_ms + share_ms  # x and dy out, dx back; a weight word each way
    return StepPrediction(nodes, nodes * gpus_per_node, 2 * one_way, backward, share_ms, forward_ms + backward_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="layer configs (YAML); their world_size is ignored")
    parser.add_argument("--shapes", default="", help="more layers as T/H/E/k[/compute ms] (tokens per rank, hidden, experts, top-k; compute "
                        "defaults to --compute-ms)")
    parser.add_argument("--compute-ms", type=float, default=0.60,
                        help="one rank's compute per forward (default: the 8192-token 2048/2048/k=2 kernel on the "
                             "H200 without its row copy, docs/design.md section 8)")
    parser.add_argument("--nodes", default="1,2,4,8")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--step", action="store_true",
                        help="a training step with direct puts instead of the forward (backward compute: "
                             "--backward-ms, default 2x the forward's)")
    parser.add_argument("--backward-ms", type=float, default=None)
    args = parser.parse_args(argv)
    if args.step:
        _print_steps(args)
        return
    print("| config | nodes | ranks | rows out per rank: NVLink / IB, direct | hierarchical | comm ms direct | "
          "comm ms hierarchical | forward ms direct (overlapped .. serial) | hierarchical | relayed rows, "
          "direct results (built) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, tokens, hidden, experts, top_k, compute_ms in _layers(args):
        for nodes in (int(n) for n in args.nodes.split(",")):
            if experts % (nodes * args.gpus_per_node):
                print(f"| {name} | {nodes} | {nodes * args.gpus_per_node} | E = {experts}: not placeable | | | | | | |")
                continue
            p = predict(tokens, hidden, experts, top_k, nodes, compute_ms, gpus_per_node=args.gpus_per_node)
            (low, high), (hier_low, hier_high) = p.bounds("direct"), p.bounds("hierarchical")
            relay_low, relay_high = p.bounds("relayed")
            print(f"| {name} | {nodes} | {p.ranks} | {p.direct.nvlink_rows:,.0f} / {p.direct.ib_rows:,.0f} | "
                  f"{p.hierarchical.nvlink_rows:,.0f} / {p.hierarchical.ib_rows:,.0f} | {p.direct_comm_ms:.3f} | "
                  f"{p.hierarchical_comm_ms:.3f} | {low:.2f} .. {high:.2f} | {hier_low:.2f} .. {hier_high:.2f} | "
                  f"{relay_low:.2f} .. {relay_high:.2f} |")

def _layers(args) -> list[tuple]:
    from flashdmoe.config import MoEConfig

    layers = []
    for path in args.configs:
        config = MoEConfig.from_yaml(path)
        layers.append((path, config.tokens_per_rank, config.hidden, config.experts, config.top_k, args.compute_ms))
    for spec in filter(None, args.shapes.split(",")):
        fields = spec.split("/")
        tokens, hidden, experts, top_k = map(int, fields[:4])
        layers.append((spec, tokens, hidden, experts, top_k, float(fields[4]) if len(fields) > 4 else args.compute_ms))
    return layers


def _print_steps(args) -> None:
    print("| config | nodes | ranks | forward exchange ms | backward exchange ms (of it the router's share) | "
          "compute ms (fwd + bwd) | step ms (overlapped .. serial) |")
    print("|---|---|---|---|---|---|---|")
    for name, tokens, hidden, experts, top_k, compute_ms in _layers(args):
        backward_ms = 2 * compute_ms if args.backward_ms is None else args.backward_ms
        for nodes in (int(n) for n in args.nodes.split(",")):
            if experts % (nodes * args.gpus_per_node):
                print(f"| {name} | {nodes} | {nodes * args.gpus_per_node} | E = {experts}: not placeable | | | |")
                continue
            s = predict_step(tokens, hidden, experts, top_k, nodes, compute_ms, backward_ms,
                             gpus_per_node=args.gpus_per_node)
            low, high = s.bounds()
            print(f"| {name} | {nodes} | {s.ranks} | {s.forward_comm_ms:.3f} | {s.backward_comm_ms:.3f} "
                  f"({s.share_ms:.3f}) | {s.compute_ms:.2f} | {low:.2f} .. {high:.2f} |")


if __name__ == "__main__":
    main()
