"""The NVSHMEM transport's Python side (flashdmoe.parallel.nvshmem_transport): the per-team ``peer_transport`` option
and its resolution per peer (CPU), and the transport module's smoke run on the GPU (``gpu``: 2 and 4 rank
processes under MPS through scripts/nvshmem_smoke.py; fails, not skips, without nvshmem4py or MPS there).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flashdmoe.parallel import nvshmem_transport as nt

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("P2P", "p2p"), (" nvshmem ", "nvshmem")])
def test_peer_transport_option_is_parsed(value, expected):
    assert nt.parse_peer_transport(value) == expected


@pytest.mark.parametrize("value", ["nvlink", "", None, 1, "p2p,nvshmem"])
def test_bad_peer_transport_option_names_the_argument(value):
    with pytest.raises(ValueError, match=r"peer_transport=.*expected one of \('auto', 'p2p', 'nvshmem'\)"):
        nt.parse_peer_transport(value)


def test_auto_takes_p2p_where_a_pointer_exists_else_nvshmem():
    pointers = [True, True, False, False]
    assert nt.resolve_peer_transports("auto", pointers, rank=1) == ["p2p", "p2p", "nvshmem", "nvshmem"]
    assert nt.resolve_peer_transports("auto", [True] * 4, rank=0) == ["p2p"] * 4
    # The rank's own buffers are always addressed directly, even when nvshmem is forced.
    assert nt.resolve_peer_transports("nvshmem", [True] * 3, rank=2) == ["nvshmem", "nvshmem", "p2p"]
    assert nt.resolve_peer_transports("p2p", [True, True], rank=0) == ["p2p", "p2p"]


def test_forced_p2p_without_a_pointer_and_missing_module_are_refused():
    with pytest.raises(ValueError, match=r"peer_transport='p2p': rank 0 has no peer pointer to rank 2"):
        nt.resolve_peer_transports("p2p", [True, True, False], rank=0)
    with pytest.raises(ValueError, match=r"needs the NVSHMEM transport for ranks \[1\].*unavailable: no nvcc"):
        nt.resolve_peer_transports("auto", [True, False], rank=0, nvshmem_available="no nvcc")
    # Every peer on p2p: an unavailable transport module does not matter.
    assert nt.resolve_peer_transports("auto", [True, True], rank=1, nvshmem_available="no nvcc") == ["p2p", "p2p"]
    with pytest.raises(ValueError, match=r"rank=3"):
        nt.resolve_peer_transports("auto", [True, True], rank=3)


def test_an_emulated_node_layout_puts_other_nodes_on_nvshmem():
    from flashdmoe.parallel.team import same_node

    # 6 ranks as 3 nodes of 2: rank 3's node is {2, 3}
    pointers = [same_node(3, q, 2) for q in range(6)]
    assert pointers == [False, False, True, True, False, False]
    assert nt.resolve_peer_transports("auto", pointers, rank=3) == ["nvshmem", "nvshmem", "p2p", "p2p", "nvshmem",
                                                                   "nvshmem"]
    assert all(same_node(0, q, None) for q in range(8))  # no layout: the topology decides


def test_ranks_per_node_is_checked_before_nvshmem_starts():
    import torch

    from flashdmoe.parallel.team import Team

    with pytest.raises(ValueError, match=r"ranks_per_node=0: expected an integer >= 1"):
        Team.nvshmem(bytes(128), 0, 2, max_tokens=8, hidden=64, top_k=1, local_experts=1, dtype=torch.bfloat16,
                     device="cuda:0", ranks_per_node=0)


def test_expected_traffic_splits_the_rows_by_node():
    from flashdmoe.ranks.problem import Problem, expected_traffic

    problem = Problem((33, 65, 0, 129), 64, 64, 8, 2, "swiglu", False, seed=43)
    flat = expected_traffic(problem)
    nodes = expected_traffic(problem, ranks_per_node=2)
    same = expected_traffic(problem, ranks_per_node=4)  # one node: nothing crosses
    for f, n, one in zip(flat, nodes, same):
        assert {k: n[k] for k in f} == f
        assert 0 <= n["nvshmem_dispatch_bytes"] <= n["dispatch_bytes"]
        assert one["nvshmem_dispatch_bytes"] == one["nvshmem_combine_bytes"] == 0
    assert nodes[2]["nvshmem_dispatch_bytes"] == 0  # no tokens
    # every row leaving node 0 arrives at node 1
    assert sum(n["nvshmem_dispatch_bytes"] for n in nodes) == sum(n["nvshmem_combine_bytes"] for n in nodes) > 0


def test_smoke_needs_an_nvshmem_team():
    class EmulatedTeam:
        transport = "emulated"

    with pytest.raises(ValueError, match="team: expected a Team.nvshmem team"):
        nt.run_smoke(EmulatedTeam())


def test_smoke_result_passes_only_with_the_payload_intact():
    good = nt.SmokeResult(my_pe=0, n_pes=2, next_is_p2p=True, arrived=True, mismatches=0, wait_ns=10)
    assert good.ok
    assert not nt.SmokeResult(**{**vars(good), "mismatches": 3}).ok
    assert not nt.SmokeResult(**{**vars(good), "arrived": False}).ok


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 4])
def test_smoke_script_passes_under_mps(ranks):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "nvshmem_smoke.py"), "--ranks", str(ranks)],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("PASS"), (
        f"scripts/nvshmem_smoke.py --ranks {ranks} failed (exit {result.returncode}):\n{result.stdout}\n{result.stderr}")
    assert result.stdout.count(" ok - PE ") == 2 * ranks  # every rank, both rounds


def test_kernel_peer_table_maps_p2p_peers_and_stages_nvshmem_peers_in_own_buffers():
    own = (0x10000, 0x20000, 0x30000)  # recv, comb, signals of rank 1
    mapped = [(0x1000, 0x2000, 0x3000), own, None]
    region = 0x100
    recv, comb, signals = nt.kernel_peer_table(1, own, mapped, ["p2p", "p2p", "nvshmem"], region)
    assert (recv[0], comb[0], signals[0]) == mapped[0]
    assert (recv[1], comb[1], signals[1]) == own
    # The kernel writes "peer 2's recv region [1]" = recv[2] + 1 * region: own comb region [2]; and
    # "peer 2's comb region [1]" = own recv region [2]. Own signal words mark the peer as an NVSHMEM one.
    assert recv[2] + 1 * region == own[1] + 2 * region
    assert comb[2] + 1 * region == own[0] + 2 * region
    assert signals[2] == own[2]
    # Rank 2 staging for peer 0 sits below its own address by two regions and lands in region 0.
    recv, comb, _ = nt.kernel_peer_table(2, own, [None, None, own], ["nvshmem", "nvshmem", "p2p"], region)
    assert recv[0] + 2 * region == own[1] and comb[1] + 2 * region == own[0] + region
    with pytest.raises(ValueError, match=r"transports\[0\]='p2p' but rank 2 has no mapping"):
        nt.kernel_peer_table(2, own, [None, None, own], ["p2p", "nvshmem", "p2p"], region)
    with pytest.raises(ValueError, match=r"transports\[0\]='tcp'"):
        nt.kernel_peer_table(2, own, [None, None, own], ["tcp", "nvshmem", "p2p"], region)


def test_kernel_build_is_read_from_the_environment(monkeypatch):
    from flashdmoe.kernel import extension

    monkeypatch.delenv("FLASHDMOE_KERNEL_BUILD", raising=False)
    assert extension.kernel_build() == "main"
    assert "FLASHDMOE_KERNEL_BUILD=nvshmem" in nt.kernel_build_problem()
    monkeypatch.setenv("FLASHDMOE_KERNEL_BUILD", "NVSHMEM")
    assert extension.kernel_build() == "nvshmem" and nt.kernel_build_problem() is None
    monkeypatch.setenv("FLASHDMOE_KERNEL_BUILD", "ib")
    with pytest.raises(ValueError, match=r"FLASHDMOE_KERNEL_BUILD='ib': expected one of \('main', 'nvshmem'\)"):
        extension.kernel_build()


def test_the_module_binds_to_one_open_team_and_is_released_at_close(monkeypatch):
    class FakeTeam:
        unique_id, rank, world_size = bytes(128), 1, 2

    class FakeModule:
        def __init__(self):
            self.calls = []

        def init_device_state(self, uid, rank, nranks):
            self.calls.append(("init", uid, rank, nranks))

        def finalize_device_state(self):
            self.calls.append(("finalize",))

    from flashdmoe.kernel import extension

    module = FakeModule()
    monkeypatch.setattr(extension, "load_nvshmem", lambda: module)
    monkeypatch.setattr(nt, "_bound", None)
    monkeypatch.setattr(nt, "_bound_team", None)
    first, second = FakeTeam(), FakeTeam()
    assert nt.bound_module(first) is module and nt.bound_module(first) is module  # bound once per team
    assert module.calls == [("init", bytes(128), 1, 2)]
    with pytest.raises(RuntimeError, match="one NVSHMEM team at a time"):
        nt.bound_module(second)
    with pytest.raises(RuntimeError, match="one NVSHMEM team at a time"):
        nt.require_unbound()
    nt.release(second)  # not the bound team: nothing
    nt.release(first)
    assert module.calls[-1] == ("finalize",) and nt._bound is None
    nt.require_unbound()
    assert nt.bound_module(second) is module and len(module.calls) == 3  # a new team binds again
    nt.release(second)
