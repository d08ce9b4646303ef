"""Migration bytes and stall arithmetic (repro/sim/migration_cost.py) against cases worked out by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from repro.errors import ConfigError
from repro.sim.hardware import load_hardware
from repro.sim.migration_cost import copy_routes, expert_weight_bytes, price_migration
from repro.sim.shapes import ModelShape
from repro.systems.base import Placement
from repro.systems.migration import experts_received

ROOT = Path(__file__).resolve().parents[1]
# 3 x 1024 x 512 weights x 2 bytes = 3,145,728 bytes per expert
SHAPE = ModelShape.from_config({
    "name": "tiny", "hidden_size": 1024, "num_hidden_layers": 2, "first_dense_layers": 0, "num_experts": 4,
    "top_k": 2, "num_shared_experts": 0, "moe_intermediate_size": 512, "shared_intermediate_size": 0,
    "intermediate_size": 0, "vocab_size": 10, "dtype_bytes": 2,
    "attention": {"kind": "gqa", "num_heads": 1, "num_kv_heads": 1, "head_dim": 8},
})
EXPERT_BYTES = 3_145_728


def hardware(nodes: int = 2, devices_per_node: int = 2):
    """h200's profile on 2 nodes x 2 GPUs with round link numbers: 10 us latency, 100 GB/s NVLink, 10 GB/s RDMA."""
    profile = yaml.safe_load((ROOT / "conf" / "hardware" / "h200.yaml").read_text())
    profile.update(name="migration_test", nodes=nodes, devices_per_node=devices_per_node)
    profile["collective"] = {"latency_us": 10, "nvlink_gbps": 100, "rdma_gbps": 10}
    return load_hardware(profile)


def placement(rows, num_devices=4, num_experts=4):
    return Placement(np.array(rows), num_devices, num_experts)


def test_expert_bytes_are_gate_up_down_times_weight_bytes():
    assert expert_weight_bytes(SHAPE) == EXPERT_BYTES
    assert expert_weight_bytes(SHAPE, bytes_per_weight=1) == EXPERT_BYTES / 2
    with pytest.raises(ConfigError, match="bytes per expert weight"):
        expert_weight_bytes(SHAPE, bytes_per_weight=0)


def test_a_swap_inside_a_node_and_one_across_nodes_priced_by_hand():
    # layer 0 swaps experts 0 and 1 between devices 0 and 1 (node 0): two NVLink copies;
    # layer 1 swaps experts 0 and 2 between devices 0 (node 0) and 2 (node 1): two RDMA copies
    old = placement([[0, 1, 2, 3], [0, 1, 2, 3]])
    new = placement([[1, 0, 2, 3], [2, 1, 0, 3]])
    routes = copy_routes(old, new, devices_per_node=2)
    assert routes.received_nvlink.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert routes.received_rdma.tolist() == [[0, 0, 0, 0], [1, 0, 1, 0]]
    assert routes.sent_nvlink.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert routes.sent_rdma.tolist() == [[0, 0, 0, 0], [1, 0, 1, 0]]
    assert np.array_equal(routes.received, experts_received(old, new))

    sync = price_migration(old, new, SHAPE, hardware(), "sync")
    layer0 = 10e-6 + EXPERT_BYTES / 100e9  # 41.45728 us
    layer1 = 10e-6 + EXPERT_BYTES / 10e9  # 324.5728 us
    assert sync.layer_seconds == pytest.approx([layer0, layer1], rel=1e-12)
    assert sync.stall_s == sync.duration_s == pytest.approx(366.03008e-6, rel=1e-12)
    assert sync.a2a_slowdown == 1.0 and sync.experts_moved == 4
    assert sync.bytes_received.sum() == sync.bytes_sent.sum() == 4 * EXPERT_BYTES
    assert int(sync.copies_rdma.sum()) == 2

    with_host = price_migration(old, new, SHAPE, hardware(), "sync", host_seconds=0.5, layer_overhead_s=0.003)
    assert with_host.stall_s == pytest.approx(0.5 + 2 * 0.003 + 366.03008e-6, rel=1e-12)

    # async at a quarter of the links: each layer's transfer x 4 beyond its latency; all-to-all x 4/3 meanwhile
    lazy = price_migration(old, new, SHAPE, hardware(), "async", bandwidth_share=0.25)
    assert lazy.layer_seconds == pytest.approx([10e-6 + 4 * 31.45728e-6, 10e-6 + 4 * 314.5728e-6], rel=1e-12)
    assert lazy.stall_s == 0.0
    assert lazy.duration_s == pytest.approx(1404.12032e-6, rel=1e-12)
    assert lazy.a2a_slowdown == pytest.approx(4 / 3)
    # the per-layer overhead is host time: the bandwidth share does not stretch it
    lazy_overhead = price_migration(old, new, SHAPE, hardware(), "async", bandwidth_share=0.25, layer_overhead_s=0.003)
    assert lazy_overhead.duration_s == pytest.approx(1404.12032e-6 + 2 * 0.003, rel=1e-12)


def test_a_copy_comes_from_the_receivers_node_when_a_replica_lives_there():
    # 2 experts, one slot per device, so each expert has two replicas; devices 0,1 = node 0, devices 2,3 = node 1
    old = placement([[0, 1, 0, 1]], num_experts=2)
    new = placement([[0, 0, 1, 1]], num_experts=2)
    routes = copy_routes(old, new, devices_per_node=2)
    # device 1 needs expert 0: old holders 0 and 2, device 0 is on its node; device 2 needs expert 1: holders 1, 3
    assert routes.received_nvlink.tolist() == [[0, 1, 1, 0]] and routes.received_rdma.sum() == 0
    assert routes.sent_nvlink.tolist() == [[1, 0, 0, 1]]

    old = placement([[0, 0, 1, 1]], num_experts=2)  # each expert on one node only: both copies cross nodes
    new = placement([[0, 1, 0, 1]], num_experts=2)
    routes = copy_routes(old, new, devices_per_node=2)
    assert routes.received_rdma.tolist() == [[0, 1, 1, 0]] and routes.received_nvlink.sum() == 0
    assert routes.sent_rdma.tolist() == [[1, 0, 1, 0]]  # lowest-id holders: device 2 sends expert 1, device 0 expert 0


def test_the_busiest_sender_sets_the_layer_time():
    # one node of 4; expert 0 lives on device 0 only and three devices need it: device 0 sends three copies
    # 2 slots per device: old {0,1} {2,3} {1,2} {3,1}, new {0,1} {0,3} {0,2} {0,1}
    old = Placement(np.array([[0, 1, 2, 3, 1, 2, 3, 1]]), 4, 4)
    new = Placement(np.array([[0, 1, 0, 3, 0, 2, 0, 1]]), 4, 4)
    routes = copy_routes(old, new, devices_per_node=4)
    assert routes.sent_nvlink.tolist() == [[3, 0, 0, 0]]
    assert routes.received_nvlink.tolist() == [[0, 1, 1, 1]]
    cost = price_migration(old, new, SHAPE, hardware(nodes=1, devices_per_node=4), "sync")
    assert cost.layer_seconds == pytest.approx([10e-6 + 3 * EXPERT_BYTES / 100e9], rel=1e-12)


def test_an_extra_replica_of_an_expert_a_device_holds_is_a_local_copy():
    old = Placement(np.array([[0, 1, 2, 3, 1, 2, 3, 1]]), 4, 4)  # device 0 holds {0, 1}
    new = Placement(np.array([[0, 0, 2, 3, 1, 2, 3, 1]]), 4, 4)  # device 0 holds {0, 0}
    routes = copy_routes(old, new, devices_per_node=2)
    assert routes.received_local.tolist() == [[1, 0, 0, 0]] and routes.experts_moved == 1
    assert routes.received_nvlink.sum() == routes.received_rdma.sum() == 0
    assert price_migration(old, new, SHAPE, hardware(), "sync").stall_s == 0.0


def test_no_change_costs_nothing():
    same = placement([[0, 1, 2, 3], [3, 2, 1, 0]])
    for mode, share in (("sync", 1.0), ("async", 0.5)):
        cost = price_migration(same, same, SHAPE, hardware(), mode, bandwidth_share=share, host_seconds=1.0)
        assert cost.stall_s == cost.duration_s == 0.0 and cost.a2a_slowdown == 1.0 and cost.experts_moved == 0


@pytest.mark.parametrize("mode, share, host, message", [
    ("lazy", 0.5, 0.0, "mode must be one of"),
    ("async", 1.0, 0.0, "strictly between 0 and 1"),
    ("async", 0.0, 0.0, "strictly between 0 and 1"),
    ("async", float("nan"), 0.0, "strictly between 0 and 1"),
    ("sync", 1.0, -1.0, "host_seconds must be a finite number >= 0"),
    ("sync", 1.0, float("inf"), "host_seconds must be a finite number >= 0"),
])
def test_bad_settings_are_one_sentence(mode, share, host, message):
    same = placement([[0, 1, 2, 3]])
    with pytest.raises(ConfigError, match=message):
        price_migration(same, same, SHAPE, hardware(), mode, bandwidth_share=share, host_seconds=host)


def test_placements_of_different_shapes_are_refused():
    with pytest.raises(ConfigError, match="different shapes"):
        copy_routes(placement([[0, 1, 2, 3]]), placement([[0, 1, 2, 3], [0, 1, 2, 3]]), devices_per_node=2)


def test_expert_copies_list_each_copy_with_its_source_and_link():
    from repro.sim.migration_cost import LINKS, expert_copies

    old = placement([[0, 1, 2, 3], [0, 1, 2, 3]])
    new = placement([[1, 0, 2, 3], [2, 1, 0, 3]])
    copies = expert_copies(old, new, devices_per_node=2)
    # (layer, expert, from, to, link): layer 0 swaps 0 <-> 1 inside node 0, layer 1 swaps 0 <-> 2 across nodes
    assert copies.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 0, 1], [1, 0, 0, 2, 2], [1, 2, 2, 0, 2]]
    assert [LINKS[i] for i in copies[:, 4]] == ["nvlink", "nvlink", "rdma", "rdma"]
    assert len(expert_copies(old, old, devices_per_node=2)) == 0
    with pytest.raises(ConfigError, match="devices_per_node must be an integer >= 1 that divides"):
        expert_copies(old, new, devices_per_node=3)


def test_outputs_have_the_shapes_the_docstrings_give():
    rng = np.random.default_rng(0)
    old = Placement(np.stack([rng.permutation(8) for _ in range(3)]), 4, 8)
    new = Placement(np.stack([rng.permutation(8) for _ in range(3)]), 4, 8)
    cost = price_migration(old, new, SHAPE, hardware(), "async", bandwidth_share=0.5)
    for field in ("copies_received", "copies_rdma", "bytes_received", "bytes_sent"):
        assert getattr(cost, field).shape == (3, 4), field
    assert cost.layer_seconds.shape == (3,)
    assert cost.copies_received.sum() == experts_received(old, new).sum() == cost.experts_moved
    assert np.isclose(cost.bytes_received.sum(), cost.bytes_sent.sum())  # no local copies here: every copy is sent
    assert set(cost.summary()) >= {"mode", "experts_moved", "bytes_moved", "stall_s", "duration_s", "a2a_slowdown"}
