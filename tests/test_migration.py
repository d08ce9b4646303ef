"""Expert moves between placements and the minimum-move device relabelling (repro/systems/migration.py)."""

import itertools

import numpy as np
import pytest

from repro.errors import ConfigError
from repro.systems.base import Placement
from repro.systems.migration import experts_received, min_move_permutation, relabel_devices


def _random_placement(rng, layers=2, experts=8, devices=4, redundant=0):
    rows = []
    for _ in range(layers):
        extra = rng.integers(0, experts, size=redundant * devices)
        rows.append(rng.permutation(np.concatenate([np.arange(experts), extra])))
    return Placement(np.array(rows), devices, experts)


def test_moves_hand_computed():
    old = Placement(np.array([[0, 1, 2, 3]]), 2, 4)  # device 0: {0, 1}, device 1: {2, 3}
    new = Placement(np.array([[2, 1, 0, 3]]), 2, 4)  # device 0: {2, 1}, device 1: {0, 3}
    assert experts_received(old, new).tolist() == [[1, 1]]
    assert experts_received(old, old).sum() == 0
    swapped = Placement(np.array([[2, 3, 1, 0]]), 2, 4)  # the two groups trade devices: 4 moves, 0 after relabel
    assert experts_received(old, swapped).sum() == 4
    perm = min_move_permutation(old, swapped)
    assert perm.tolist() == [1, 0]
    assert experts_received(old, relabel_devices(swapped, perm)).sum() == 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("per_layer", [False, True])
def test_min_move_equals_brute_force(seed, per_layer):
    rng = np.random.default_rng(seed)
    redundant = seed % 2
    old, new = _random_placement(rng, redundant=redundant), _random_placement(rng, redundant=redundant)
    devices = old.num_devices
    perms = [np.array(p) for p in itertools.permutations(range(devices))]

    def moved(perm):
        return experts_received(old, relabel_devices(new, perm)).sum(axis=1)  # [L]

    if per_layer:
        best = np.min([moved(np.tile(p, (old.num_layers, 1))) for p in perms], axis=0)
        found = moved(min_move_permutation(old, new, per_layer=True))
        assert found.tolist() == best.tolist()
    else:
        best = min(moved(p).sum() for p in perms)
        assert moved(min_move_permutation(old, new)).sum() == best


def test_relabel_keeps_grouping_and_refuses_non_permutation():
    rng = np.random.default_rng(0)
    placement = _random_placement(rng)
    relabelled = relabel_devices(placement, np.array([2, 0, 3, 1]))
    # device perm[b] of the relabelled placement holds what device b held
    before, after = placement.replicas(), relabelled.replicas()
    assert np.array_equal(after[:, :, [2, 0, 3, 1]], before)
    with pytest.raises(ConfigError, match="permutation"):
        relabel_devices(placement, np.array([0, 0, 1, 2]))
    with pytest.raises(ConfigError, match="different shapes"):
        experts_received(placement, _random_placement(rng, devices=2))
