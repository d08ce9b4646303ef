"""repro.counting.count_rows, the compiled loop under `account` and `batch_traffic`, against the definition
counted one activation at a time in Python."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.counting import count_rows
from repro.errors import ConfigError
from repro.sim.traffic import batch_traffic


def naive(group, home, experts, slot_table, slots_per_device, num_groups, devices_per_node):
    """Every count of `BatchTraffic` from its definition."""
    num_layers, num_devices, _ = slot_table.shape
    num_nodes = -(-num_devices // devices_per_node)
    activations = np.zeros((num_groups, num_layers, num_devices, num_devices), dtype=np.int64)
    copies = np.zeros_like(activations)
    node_copies = np.zeros((num_groups, num_layers, num_devices, num_nodes), dtype=np.int64)
    slot_tokens = np.zeros((num_groups, num_layers, num_devices * slots_per_device), dtype=np.int64)
    for n in range(len(group)):
        g = group[n]
        for layer in range(num_layers):
            s = home[n, layer]
            slots = [int(slot_table[layer, s, e]) for e in experts[n, layer]]
            for slot in slots:
                slot_tokens[g, layer, slot] += 1
                activations[g, layer, s, slot // slots_per_device] += 1
            for d in {slot // slots_per_device for slot in slots}:
                copies[g, layer, s, d] += 1
            for m in {slot // slots_per_device // devices_per_node for slot in slots}:
                node_copies[g, layer, s, m] += 1
    return activations, copies, node_copies, slot_tokens


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 3, 8, 64, 70, 130]), st.integers(1, 3), st.integers(1, 5))
def test_batch_traffic_matches_the_definition(seed, devices, slots_per_device, top_k):
    """Device counts past 64 exercise the multi-word bit set of reached devices."""
    rng = np.random.default_rng(seed)
    num_layers, num_experts, num_groups, n = 2, 9, 3, int(rng.integers(1, 60))
    devices_per_node = int(rng.choice([d for d in (1, 2, 4, 8, devices) if devices % d == 0]))
    slot_table = rng.integers(0, devices * slots_per_device, (num_layers, devices, num_experts))
    home = rng.integers(0, devices, (n, num_layers))
    experts = rng.integers(0, num_experts, (n, num_layers, top_k)).astype(np.int16)
    group = rng.integers(0, num_groups, n)
    traffic = batch_traffic(group, home, experts, slot_table, slots_per_device, num_groups, devices_per_node)
    activations, copies, node_copies, slot_tokens = naive(group, home, experts, slot_table, slots_per_device,
                                                          num_groups, devices_per_node)
    np.testing.assert_array_equal(traffic.activations, activations)
    np.testing.assert_array_equal(traffic.copies, copies)
    np.testing.assert_array_equal(traffic.slot_tokens, slot_tokens)
    if devices_per_node < devices:
        np.testing.assert_array_equal(traffic.node_copies, node_copies)
    else:
        assert traffic.node_copies is None


def test_broadcast_homes_count_like_materialised_ones():
    rng = np.random.default_rng(1)
    experts = rng.integers(0, 16, (200, 4, 2)).astype(np.int16)
    home_N = rng.integers(0, 4, 200)
    slot_table = np.arange(16)[None, None, :].repeat(4, axis=1).repeat(4, axis=0) // 4 * 4 + rng.integers(0, 4, (4, 4, 16))
    group = np.zeros(200, dtype=np.int64)
    view = batch_traffic(group, np.broadcast_to(home_N[:, None], (200, 4)), experts, slot_table, 4, 1, 2)
    full = batch_traffic(group, np.repeat(home_N[:, None], 4, axis=1), experts, slot_table, 4, 1, 2)
    for a, b in zip(view, full, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", ["expert", "home"])
def test_out_of_range_rows_are_reported_not_read(bad):
    experts = np.zeros((5, 2, 2), dtype=np.int16)
    home = np.zeros((5, 2), dtype=np.int64)
    if bad == "expert":
        experts[3, 1, 1] = 8
    else:
        home[3, 0] = -1
    tables = (np.zeros((1, 2, 2, 2), dtype=np.int64), np.zeros((1, 2, 2, 2), dtype=np.int64),
              np.zeros((1, 2, 2, 0), dtype=np.int64), np.zeros((1, 2, 2), dtype=np.int64))
    slot_table = np.zeros((2, 2, 8), dtype=np.int64)
    assert count_rows(np.zeros(5, dtype=np.int64), home, experts, slot_table, slot_table, 1, *tables) == 3
    with pytest.raises(ConfigError, match="token row 3"):
        batch_traffic(np.zeros(5, dtype=np.int64), home, experts, slot_table, 1, 1, 2)
