"""The Ray executor across nodes, on a multi-node Ray cluster started on this machine
(``ray.cluster_utils.Cluster``: a head that runs no rank plus worker "nodes", every one a raylet of its
own on 127.0.0.1, with the token authentication tests/conftest.py switches on), CPU workers over gloo.

Covers: a 2-node x 2-rank team placed node-major on distinct nodes as its STRICT_SPREAD placement group
says (ranks, local ranks, node ids and addresses recorded), its forward + backward equal to
``reference.moe_expert_parallel``, the gloo store listening on the rendezvous address only; a node
removed in the middle of a step: the team replaced on the spare node and the step retried; the same
without a spare: :class:`NoNewTeam` after the placement timeout (not twice that), naming the lost node;
too few or too small nodes refused before any actor starts (and the placement plan on its own); GPU ranks across nodes scheduled into one
bundle per node, with rank 0 asked for a unique id bound to its node's interface (fake actors: no GPU
here); the interface lookup behind the binding.

Not covered here: real hosts (every node here is 127.0.0.1), and an NVSHMEM team across nodes, which needs
GPUs on several hosts (docs/deploy.md, "Ray across nodes").
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from flashdmoe.config import MoEConfig
from ray_actors import cluster as ray_cluster
from ray_actors.cluster import MoECluster, NoNewTeam
from ray_actors.netif import interface_addresses, interface_of
from ray_actors.placement import Placement
from ray_checks import check_against_reference

REPO = Path(__file__).resolve().parents[1]
CPUS_PER_NODE = 2
GPUS_PER_NODE = 2  # declared only, for the scheduling test with fake actors

# Node deaths are noticed within a few seconds (Ray's defaults allow ~30 s for a silent node); a node
# removed here also tells the GCS itself as it shuts down.
_FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                       "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}


def _config(**changes) -> MoEConfig:
    values = dict(hidden=16, ffn=24, experts=8, top_k=2, tokens_per_rank=12, activation="gelu",
                  normalize_topk=True, capacity_factor=None, dtype="float32", world_size=4, nodes=2, seed=3,
                  steps=2, step_timeout_s=30)
    values.update(changes)
    return MoEConfig.from_dict(values)


class LocalNodes:
    """A head (0 CPUs: it never runs a rank) and worker nodes of ``CPUS_PER_NODE`` CPUs each."""

    def __init__(self) -> None:
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=0, include_dashboard=False, _system_config=_FAST_HEALTH_CHECKS))
        # Cluster records its address in /tmp/ray/ray_current_cluster, where a plain ray.init() or
        # --address auto of any other process on this machine would find it: everything here is explicit
        address_file = Path(ray._common.utils.get_ray_address_file(None))
        if address_file.is_file() and address_file.read_text().strip() == self.cluster.address:
            address_file.unlink()
        self.resize(3)
        python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        ray.init(address=self.cluster.address, runtime_env={"env_vars": {"PYTHONPATH": python_path}})

    def resize(self, count: int) -> None:
        """Exactly ``count`` worker nodes, every one alive."""
        while len(self.cluster.worker_nodes) < count:
            self.cluster.add_node(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE)
        while len(self.cluster.worker_nodes) > count:
            self.cluster.remove_node(next(iter(self.cluster.worker_nodes)))
        self.cluster.wait_for_nodes()

    def remove(self, node_id: str) -> None:
        (node,) = [node for node in self.cluster.worker_nodes if node.node_id == node_id]
        self.cluster.remove_node(node)

    def worker_node_ids(self) -> set[str]:
        return {node.node_id for node in self.cluster.worker_nodes}

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def nodes():
    local = LocalNodes()
    try:
        yield local
    finally:
        local.shutdown()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (this network namespace, IPv4 and IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host (little-endian) order
                found.add(str(ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))))
    return found


def _check_node_major(cluster: MoECluster, worker_nodes: set[str]) -> list[str]:
    """Ranks sit where the placement group put their node's bundle: rank r on bundle r // G, as local rank
    r % G, on distinct worker nodes; returns the node id of each node index."""
    placement = cluster.placement
    table = ray.util.placement_group_table(cluster._placement_group)
    assert table["strategy"] == "STRICT_SPREAD" and table["state"] == "CREATED"
    assert list(table["bundles"].values()) == [{"CPU": float(placement.ranks_per_node)}] * placement.nodes
    bundle_nodes = [table["bundles_to_node_id"][index] for index in range(placement.nodes)]
    assert len(set(bundle_nodes)) == placement.nodes and set(bundle_nodes) <= worker_nodes
    workers = cluster.workers()
    assert [info["rank"] for info in workers] == list(range(cluster.world_size))
    for info in workers:
        rank = info["rank"]
        assert info["local_rank"] == rank % placement.ranks_per_node
        assert info["node_id"] == bundle_nodes[rank // placement.ranks_per_node], (rank, info["node_id"])
        assert info["node_ip"] == "127.0.0.1"  # every node of this cluster is on loopback
    assert len({info["team_id"] for info in workers}) == 1
    return bundle_nodes


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_nodes_of_two_ranks_are_node_major_and_match_the_reference(nodes, seed):
    nodes.resize(3)
    with MoECluster(_config()) as cluster:
        assert cluster.backend == "reference" and cluster.transport == "gloo"
        assert (cluster.placement.nodes, cluster.placement.ranks_per_node) == (2, 2)
        _check_node_major(cluster, nodes.worker_node_ids())
        # the store listens on the rendezvous address (rank 0's node address) only, not on every interface
        team_id = cluster.workers()[0]["team_id"]
        host, port = team_id.removeprefix("gloo-").rsplit(":", 1)
        assert _listening_addresses(int(port)) == {host}, team_id
        check_against_reference(cluster, tokens=[7, 0, 12, 5], seed=seed)  # uneven, one rank empty
        record = cluster.step(0)
        assert record["attempts"] == 1 and [entry["rank"] for entry in record["ranks"]] == [0, 1, 2, 3]
        assert all(entry["bytes_sent"] > 0 for entry in record["ranks"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_node_lost_mid_step_is_replaced_by_the_spare_node(nodes, seed):
    nodes.resize(3)
    with MoECluster(_config(), placement_timeout_s=60) as cluster:
        before = _check_node_major(cluster, nodes.worker_node_ids())
        lost = before[1]  # ranks 2 and 3
        # rank 3 stalls before its forward, so the step is still running (its peers wait for it in the
        # exchange) when its node, with rank 2, goes away
        timer = threading.Timer(2.0, nodes.remove, args=(lost,))
        timer.start()
        try:
            record = cluster.step(0, crash={"rank": 3, "at": "stall", "seconds": 120})
        finally:
            timer.join()
        assert record["attempts"] == 2
        (fault,) = cluster.faults
        assert fault["kind"] == "worker_died" and fault["ranks"] == [2, 3] and fault["recovered"] is True
        assert f"lost: node {lost[:12]} (127.0.0.1) with rank(s) [2, 3]" in fault["error"], fault["error"]
        assert cluster.generation == 2
        after = _check_node_major(cluster, nodes.worker_node_ids())
        assert lost not in after and before[0] in after  # the spare took the lost node's place
        check_against_reference(cluster, tokens=[5, 9, 0, 12], seed=seed)  # the new team computes correctly


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_node_lost_without_a_spare_fails_after_the_placement_timeout(nodes):
    nodes.resize(2)
    placement_timeout_s = 4.0
    with MoECluster(_config(), placement_timeout_s=placement_timeout_s, max_retries=2) as cluster:
        lost = _check_node_major(cluster, nodes.worker_node_ids())[1]
        cluster.step(0)
        nodes.remove(lost)
        started = time.monotonic()
        with pytest.raises(NoNewTeam) as raised:
            cluster.step(1)
        elapsed = time.monotonic() - started
        message = str(raised.value)
        assert raised.value.kind == "worker_died" and raised.value.ranks == [2, 3]
        assert message.startswith("no new team after rank(s) [2, 3] died during step"), message
        assert f"lost: node {lost[:12]} (127.0.0.1) with rank(s) [2, 3]" in message, message
        assert (f"could not place 4 workers x {{'CPU': 1.0}} on 2 distinct nodes, 2 per node within "
                f"{placement_timeout_s:g}s (STRICT_SPREAD placement group still pending)") in message, message
        # one wait for the placement, not one per retry
        assert placement_timeout_s <= elapsed < 2 * placement_timeout_s + 10, elapsed
        (fault,) = cluster.faults
        assert fault["recovered"] is False and fault["kind"] == "worker_died"
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


def test_too_few_or_too_small_nodes_are_refused_before_any_actor_starts(nodes, monkeypatch):
    class NoActors:
        def options(self, **_):
            raise AssertionError("an actor was started")

    monkeypatch.setattr(ray_cluster, "RemoteMoEWorker", NoActors())
    nodes.resize(3)  # 6 CPUs in all: enough for 6 ranks, but not on 6 nodes, nor 3 on one node
    with pytest.raises(ray_cluster.ClusterTooSmall) as raised:
        MoECluster(_config(world_size=6, nodes=6, experts=12))
    assert str(raised.value) == ("nodes=6: 6 workers x {'CPU': 1.0}, 1 per node, need 6 distinct nodes with 1 CPU, "
                                 "0 GPU each; the Ray cluster has 3 such node(s) of 4 alive")  # 4: with the head
    with pytest.raises(ray_cluster.ClusterTooSmall, match="need 2 distinct nodes with 3 CPU, 0 GPU each; the Ray "
                                                          "cluster has 0 such node"):
        MoECluster(_config(world_size=6, nodes=2, experts=12))
    with pytest.raises(ValueError, match="workers=6: nodes=4: expected a divisor of world_size=6"):
        MoECluster(_config(experts=12, nodes=4), workers=6)
    with pytest.raises(ValueError, match=r"^nodes=3: expected a divisor of world_size=4"):
        MoECluster(_config(), nodes=3)
    with pytest.raises(ValueError, match="nodes=0: expected an integer >= 1"):
        MoECluster(_config(), nodes=0)
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


class _StopBootstrap(Exception):
    """Raised by the fake actor below once the driver starts bootstrapping the team."""


def test_gpu_ranks_across_nodes_get_one_bundle_per_node(nodes, monkeypatch):
    """4 GPU ranks over 2 nodes (GPUs declared, none present): one STRICT_SPREAD group of two
    ``{"GPU": 2}`` bundles on distinct nodes, ranks 0-1 in bundle 0 and 2-3 in bundle 1, each actor
    ``num_gpus=1``; rank 0 is asked for a unique id that carries its node's address."""
    calls, bootstrap = [], []

    class FakeActor:
        def __getattr__(self, method: str):
            class Method:
                @staticmethod
                def remote(*args):
                    if method in ("ping", "teardown"):
                        return ray.put(None)
                    bootstrap.append((method, args))
                    raise _StopBootstrap(method)

            return Method

    class Recorder:
        def options(self, **options):
            calls.append(options)

            class Handle:
                @staticmethod
                def remote():
                    return FakeActor()

            return Handle

    monkeypatch.setattr(ray_cluster, "RemoteMoEWorker", Recorder())
    nodes.resize(2)
    with pytest.raises(_StopBootstrap, match="make_unique_id"):
        MoECluster(_config(dtype="bfloat16"), backend="cuda")
    assert [options["scheduling_strategy"].placement_group_bundle_index for options in calls] == [0, 0, 1, 1]
    assert all(options["num_gpus"] == 1 and options["num_cpus"] == 0 for options in calls)
    assert bootstrap == [("make_unique_id", ("bfloat16", True))]
    groups = list(ray.util.placement_group_table().values())
    assert any(group["strategy"] == "STRICT_SPREAD"
               and list(group["bundles"].values()) == [{"GPU": 2.0}, {"GPU": 2.0}] for group in groups), groups
    assert all(group["state"] == "REMOVED" for group in groups)


def test_placement_plans_node_major_bundles():
    one = Placement(4, 1, {"GPU": 0.5})
    assert (one.strategy, one.bundles(), [one.bundle_index(rank) for rank in range(4)]) == (
        "STRICT_PACK", [{"GPU": 0.5}] * 4, [0, 1, 2, 3])
    assert [one.local_rank(rank) for rank in range(4)] == [0, 1, 2, 3]
    spread = Placement(6, 3, {"GPU": 1})
    assert (spread.strategy, spread.ranks_per_node, spread.bundles()) == ("STRICT_SPREAD", 2, [{"GPU": 2.0}] * 3)
    assert [spread.bundle_index(rank) for rank in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [spread.local_rank(rank) for rank in range(6)] == [0, 1, 0, 1, 0, 1]
    assert spread.describe() == "6 workers x {'GPU': 1.0} on 3 distinct nodes, 2 per node"

    def node(gpus: float, alive: bool = True) -> dict:
        return {"Alive": alive, "Resources": {"CPU": 8.0, "GPU": gpus}}

    spread.check_fits([node(2), node(8), node(2), node(0)])
    with pytest.raises(ray_cluster.ClusterTooSmall, match=r"need 3 distinct nodes with 0 CPU, 2 GPU each; the Ray "
                                                          r"cluster has 2 such node\(s\) of 3 alive"):
        spread.check_fits([node(2), node(8), node(2, alive=False), node(1)])  # a dead node does not count
    one.check_fits([node(2)])
    with pytest.raises(ray_cluster.ClusterTooSmall, match=r"must share one node \(STRICT_PACK\), which needs 0 CPU, "
                                                          r"2 GPU on one node; the Ray cluster's largest of 2 node"):
        one.check_fits([node(1), node(1)])
    with pytest.raises(ValueError, match="nodes=4: expected a divisor of world_size=6"):
        Placement(6, 4, {"CPU": 1})
    with pytest.raises(ValueError, match="nodes=0: expected an integer >= 1"):
        Placement(6, 0, {"CPU": 1})


def test_interface_of_finds_the_interface_holding_an_address():
    addresses = interface_addresses()
    assert ("lo", ipaddress.ip_address("127.0.0.1")) in addresses
    assert interface_of("127.0.0.1") == "lo"
    for _, address in addresses:  # every address maps back to an interface holding it
        assert (interface_of(str(address)), address) in addresses
    with pytest.raises(ValueError, match="address=203.0.113.7: no interface of this machine holds it"):
        interface_of("203.0.113.7")  # TEST-NET-3: never assigned
    with pytest.raises(ValueError, match="not an IP address"):
        interface_of("node-1")
