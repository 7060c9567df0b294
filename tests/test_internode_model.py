"""The inter-node cost model (flashdmoe.bench.internode_model): its counts against hand arithmetic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from flashdmoe.bench import internode_model as model

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_node_hit_probability_counts_distinct_experts():
    # 2 of 32 experts, 16 per node: the other node is missed only if both picks are among this node's 16
    assert model.node_hit_probability(32, 2, 2) == pytest.approx(1 - math.comb(16, 2) / math.comb(32, 2))
    assert model.node_hit_probability(128, 2, 1) == 1.0
    # k = 1: a node is hit with probability 1 / N
    assert model.node_hit_probability(64, 1, 4) == pytest.approx(0.25)


def test_one_node_sends_nothing_over_infiniband():
    direct, hierarchical = model.rank_traffic(8192, 32, 2, 1)
    assert direct.ib_rows == hierarchical.ib_rows == 0
    assert direct.nvlink_rows == pytest.approx(8192 * 2 * 7 / 8)  # 7 of 8 ranks are others


def test_direct_rows_split_by_where_the_expert_lives():
    direct, _ = model.rank_traffic(8192, 128, 2, 2)
    assert direct.ib_rows == pytest.approx(8192 * 2 / 2)       # half the experts are on the other node
    assert direct.nvlink_rows == pytest.approx(8192 * 2 * 7 / 16)


@pytest.mark.parametrize("experts,top_k,nodes", [(128, 2, 2), (128, 2, 8), (256, 8, 4), (64, 1, 4)])
def test_hierarchy_never_sends_more_over_infiniband(experts, top_k, nodes):
    direct, hierarchical = model.rank_traffic(4096, experts, top_k, nodes)
    assert hierarchical.ib_rows <= direct.ib_rows + 1e-9
    if top_k == 1:  # nothing to deduplicate
        assert hierarchical.ib_rows == pytest.approx(direct.ib_rows)


def test_comm_time_is_the_slower_link_both_ways():
    p = model.predict(8192, 2048, 32, 2, 1, compute_ms=0.5)
    assert p.direct_comm_ms == pytest.approx(2 * 8192 * 2 * 7 / 8 * 2048 * 2 / (model.NVLINK_GBPS * 1e9) * 1e3)
    assert p.bounds("direct") == (pytest.approx(0.5), pytest.approx(0.5 + p.direct_comm_ms))
    p2 = model.predict(8192, 2048, 128, 2, 2, compute_ms=0.5)
    ib_ms = 2 * 8192 * 2048 * 2 / (model.IB_GBPS * 1e9) * 1e3
    assert p2.direct_comm_ms == pytest.approx(ib_ms)
    assert p2.bounds("direct")[0] == pytest.approx(ib_ms)  # communication-bound


@pytest.mark.parametrize("experts,top_k,nodes", [(128, 2, 2), (256, 8, 2), (256, 8, 8)])
def test_relayed_rows_cost_half_way_between_direct_and_hierarchical(experts, top_k, nodes):
    """The built hierarchical exchange relays the rows and returns results directly: one direction each."""
    p = model.predict(8192, 2048, experts, top_k, nodes, compute_ms=0.5)
    assert p.relayed_comm_ms == pytest.approx((p.direct_comm_ms + p.hierarchical_comm_ms) / 2)
    assert p.hierarchical_comm_ms <= p.relayed_comm_ms <= p.direct_comm_ms
    assert p.bounds("relayed") == (pytest.approx(max(0.5, p.relayed_comm_ms)), pytest.approx(0.5 + p.relayed_comm_ms))


def test_unplaceable_experts_are_refused():
    with pytest.raises(ValueError, match="experts=32 must be a multiple of the 64 ranks"):
        model.rank_traffic(8192, 32, 2, 8)


def test_cli_prints_a_row_per_layer_and_node_count(capsys):
    model.main([str(CONFIGS / "paper.yaml"), "--shapes", "8192/7168/256/8/13.25", "--nodes", "1,2,8"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert len(lines) == 6
    assert "not placeable" in lines[2]  # 32 experts on 64 ranks
    assert lines[0].split("|")[8].strip() == "0.60 .. 0.86"  # docs/design.md section 8, 1 node


def test_training_step_adds_three_row_directions_and_the_router_share():
    # paper layer on 2 nodes x 8: half of a rank's 16384 choices cross InfiniBand, 4 KiB a row
    forward = model.predict(8192, 2048, 32, 2, 2, 0.6)
    step = model.predict_step(8192, 2048, 32, 2, 2, 0.6, 1.2)
    one_way_ib = 8192 * 4096 / 50e9 * 1e3  # ms: the IB side is the slower one
    assert step.forward_comm_ms == pytest.approx(forward.direct_comm_ms) == pytest.approx(2 * one_way_ib)
    words_ib = 8192 * 4 / 50e9 * 1e3
    share_ib = 8 * 32 * 2048 * 4 / 50e9 * 1e3  # the 8 ranks of the other node, E*H float32 each
    assert step.share_ms == pytest.approx(share_ib)
    assert step.backward_comm_ms == pytest.approx(3 * one_way_ib + 2 * words_ib + share_ib)
    assert step.compute_ms == pytest.approx(1.8)
    assert step.bounds() == (pytest.approx(max(1.8, step.comm_ms)), pytest.approx(1.8 + step.comm_ms))


def test_training_step_on_one_node_pays_only_nvlink():
    step = model.predict_step(8192, 2048, 128, 2, 1, 0.6, 1.2)
    nvlink_rows = 8192 * 2 * 7 / 8
    assert step.forward_comm_ms == pytest.approx(2 * nvlink_rows * 4096 / 450e9 * 1e3)
    assert step.share_ms == pytest.approx(7 * 128 * 2048 * 4 / 450e9 * 1e3)


def test_step_table_prints_one_row_per_node_count(capsys):
    model.main([str(CONFIGS / "paper.yaml"), "--step", "--nodes", "1,2", "--compute-ms", "0.6"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 3 and "backward exchange ms" in rows[0]
    assert rows[2].split("|")[6].strip() == "1.80"  # 0.6 forward + 2 x 0.6 backward by default
