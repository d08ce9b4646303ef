"""Sem-MoE's expert-load post-pass (issue 17 item 2): `balance_expert_load` and system.params.expert_load_cap."""

import numpy as np
import pytest
from test_honesty import fitted, requests_rerouted, routed_trace
from test_run import compose, synthetic_trace_dir

from repro.errors import ConfigError
from repro.systems.semmoe import SemMoE
from repro.systems.semmoe.cocluster import balance_expert_load
from repro.traces import read_trace, select_requests, split_trace

FAST = {"n_steps": 1, "n_starts": 1, "polish_kicks": 0}  # the solver's search beyond the paper is not under test


def device_loads(expert_device, expert_load, num_devices):
    """float[L, D] expert load per device."""
    return np.stack([np.bincount(d, weights=w, minlength=num_devices) for d, w in zip(expert_device, expert_load, strict=True)])


def random_instance(seed, num_layers=5, num_experts=16, num_devices=4):
    rng = np.random.default_rng(seed)
    expert_device = np.stack([rng.permutation(np.arange(num_experts) % num_devices) for _ in range(num_layers)])
    expert_load = rng.pareto(1.5, (num_layers, num_experts)) * 100  # heavy-tailed: some experts very hot
    gain = rng.random((num_layers, num_devices, num_experts)) * expert_load[:, None, :]
    return expert_device, expert_load, gain


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [1.0, 1.1, 1.3])
def test_the_pass_never_raises_the_busiest_device_and_keeps_e_over_d(seed, cap):
    expert_device, expert_load, gain = random_instance(seed)
    out, swaps = balance_expert_load(expert_device, expert_load, gain, cap)
    before = device_loads(expert_device, expert_load, 4).max(axis=1)
    after = device_loads(out, expert_load, 4)
    assert np.all(after.max(axis=1) <= before + 1e-9)
    assert np.all(np.stack([np.bincount(d, minlength=4) for d in out]) == 4)
    # a layer above the cap whose busiest device kept its load had no swap that lowers it; with the heavy tail
    # some layer must have moved
    assert swaps > 0 and np.any(after.max(axis=1) < before - 1e-9)


@pytest.mark.parametrize("cap", [None, 0, 0.0])
def test_the_pass_is_a_no_op_when_the_cap_is_off(cap):
    expert_device, expert_load, gain = random_instance(0)
    out, swaps = balance_expert_load(expert_device, expert_load, gain, cap)
    np.testing.assert_array_equal(out, expert_device)
    assert swaps == 0 and out is not expert_device


def test_the_pass_stops_at_the_cap_and_picks_the_cheapest_swap():
    # 2 devices, 4 experts: device 0 holds experts 0 (load 6) and 1 (load 4), device 1 holds 2 (load 1) and 3 (1)
    expert_device = np.array([[0, 0, 1, 1]])
    expert_load = np.array([[6.0, 4.0, 1.0, 1.0]])
    # swapping 1 <-> 2 or 1 <-> 3 both bring the loads to 7 / 5; only 1 <-> 3 keeps all local mass
    gain = np.zeros((1, 2, 4))
    gain[0, 0, [0, 1]] = 5.0
    gain[0, 1, 2] = 3.0
    gain[0, 1, 1] = 4.0  # device 1's units use expert 1 too: moving it there gains
    out, swaps = balance_expert_load(expert_device, expert_load, gain, 1.2)
    np.testing.assert_array_equal(out, [[0, 1, 1, 0]])  # loads 7 / 5: max/mean 1.17 <= 1.2, one swap
    assert swaps == 1
    # already within the cap: nothing moves
    out, swaps = balance_expert_load(out, expert_load, gain, 1.2)
    assert swaps == 0


def test_the_pass_keeps_swaps_inside_allowed_groups():
    expert_device, expert_load, gain = random_instance(3, num_experts=16, num_devices=4)
    node = np.array([0, 0, 1, 1])
    out, _ = balance_expert_load(expert_device, expert_load, gain, 1.0, node[:, None] == node[None, :])
    np.testing.assert_array_equal(node[out], node[expert_device])  # every expert stays on its node


def test_bad_caps_are_refused():
    expert_device, expert_load, gain = random_instance(0)
    with pytest.raises(ConfigError, match="expert_load_cap must be null / 0 \\(off\\) or a max/mean"):
        balance_expert_load(expert_device, expert_load, gain, 0.9)
    with pytest.raises(ConfigError, match="expert_load_cap"):
        SemMoE(expert_load_cap=-1)


@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_semmoe_with_a_cap_balances_the_profile_and_without_is_unchanged(attention):
    profile, evaluation = split_trace(routed_trace(), 0.3, np.random.default_rng(0))
    plain = fitted("semmoe", profile, 4, attention, **FAST)
    off = fitted("semmoe", profile, 4, attention, expert_load_cap=None, **FAST)
    np.testing.assert_array_equal(off.placement.physical_to_logical, plain.placement.physical_to_logical)
    assert "expert_load_swaps" not in off.info
    capped = fitted("semmoe", profile, 4, attention, expert_load_cap=1.0, **FAST)
    info = capped.info
    assert info["expert_load_cap"] == 1.0 and info["expert_load_swaps"] > 0
    assert info["profile_expert_load_max_mean_after"] < info["profile_expert_load_max_mean_before"]


@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_the_capped_placement_reads_the_profile_split_only(tmp_path, attention):
    """Through the app (the honesty pattern of tests/test_honesty.py): changing the routing of the validate and
    evaluate splits leaves the capped placement unchanged, changing the profile's moves it (positive control)."""
    from repro.run import build_traces, fit_and_evaluate, request_split

    trace_dir = synthetic_trace_dir(tmp_path / "t")
    overrides = [f"trace={trace_dir}", f"parallel.attention={attention}", "parallel.tokens_per_step=256",
                 "logger=none", "system=semmoe", "system.params.expert_load_cap=1.0",
                 *(f"system.params.{key}={value}" for key, value in FAST.items())]
    trace = read_trace(trace_dir, mmap=False)
    config = compose(*overrides)
    split = request_split(config, trace.num_requests)

    def placement(routing):
        profile, evaluation = build_traces(config)
        if routing is not None:
            profile, evaluation = select_requests(routing, split.profile), select_requests(routing, split.evaluate)
        _, _, plan = fit_and_evaluate(config, profile, evaluation)
        assert plan.info["expert_load_cap"] == 1.0
        return plan.placement.physical_to_logical

    base = placement(None)
    np.testing.assert_array_equal(placement(requests_rerouted(trace, np.concatenate([split.validate, split.evaluate]))), base)
    assert not np.array_equal(placement(requests_rerouted(trace, split.profile)), base)


def test_the_cap_is_semmoes_configured_default_and_the_paper_placement_stays_selectable():
    """conf/system/semmoe.yaml sets expert_load_cap (chosen on validate, see its comment); the class default and
    system=semmoe_paper place experts as the paper does, and semmoe_paper refuses a cap."""
    from omegaconf import OmegaConf

    from repro.systems import make_system

    params = OmegaConf.to_container(OmegaConf.load("conf/system/semmoe.yaml"))["params"]
    assert params["expert_load_cap"] >= 1.0 and SemMoE(**params).expert_load_cap == params["expert_load_cap"]
    assert SemMoE().expert_load_cap is None
    paper = OmegaConf.to_container(OmegaConf.load("conf/system/semmoe_paper.yaml"))["params"]
    assert make_system("semmoe_paper", **{**params, **paper}).expert_load_cap is None
    with pytest.raises(ConfigError, match="semmoe_paper places experts as the paper does"):
        make_system("semmoe_paper", expert_load_cap=1.05)
