"""Exact accounting (repro.eval): hand-computed cases in both attention modes, replicas, properties, contracts.

Legend: N tokens, L MoE layers, k experts per token, D devices, E experts.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import repro.eval.accounting as accounting
from repro.errors import ConfigError, ReproError, TraceError
from repro.eval import PER_LAYER_COLUMNS, account, evaluate, home_devices
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan, even_counts
from repro.systems.ep import VanillaEP, contiguous_placement
from repro.traces import TraceMeta, make_trace, read_trace, write_trace

BYTES = 10  # bytes per token in the hand-computed cases


def tiny_trace(experts_NLk, lengths, num_experts):
    experts_NLk = np.asarray(experts_NLk)
    n, num_layers, top_k = experts_NLk.shape
    meta = TraceMeta(model="toy", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(3, 3 + num_layers)),
                     vocab_size=100)
    return make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), np.arange(n) % 100, experts_NLk)


# 3 tokens, 2 layers, top-2 over 4 experts; contiguous EP on 2 devices: experts {0,1} on device 0, {2,3} on 1
HAND_EXPERTS = [
    [[0, 1], [0, 2]],  # t0
    [[2, 3], [1, 3]],  # t1
    [[0, 3], [2, 3]],  # t2
]


def test_dp_hand_computed():
    trace = tiny_trace(HAND_EXPERTS, lengths=[2, 1], num_experts=4)
    plan = Plan(contiguous_placement(2, 4, 2), ParallelConfig(devices=2, attention="dp", tokens_per_step=2,
                                                             bytes_per_token=BYTES, devices_per_node=1))
    # round robin: request 0 (t0, t1) -> rank 0, request 1 (t2) -> rank 1
    np.testing.assert_array_equal(home_devices(plan, trace), [[0, 0], [0, 0], [1, 1]])
    result = evaluate(plan, trace)
    # layer 0: t0 local x2; t1 (home 0) both experts on device 1 -> 2 remote activations, ONE copy 0->1;
    #          t2 (home 1) expert 0 remote (copy 1->0), expert 3 local.  local 3 of 6.
    # layer 1: t0 expert 0 local, expert 2 remote (copy 0->1); t1 expert 1 local, expert 3 remote (copy 0->1);
    #          t2 both local.  local 4 of 6.
    np.testing.assert_array_equal(result.traffic, [[[0, 10], [10, 0]], [[0, 20], [0, 0]]])
    np.testing.assert_array_equal(result.expert_load, [[3, 3], [2, 4]])
    np.testing.assert_array_equal(result.token_load, [[2, 1], [2, 1]])
    rows = result.per_layer
    assert list(rows.columns) == list(PER_LAYER_COLUMNS)
    np.testing.assert_allclose(rows["lar"], [3 / 6, 4 / 6])
    assert rows["layer"].tolist() == [0, 1] and rows["layer_id"].tolist() == [3, 4]
    assert rows["local_activations"].tolist() == [3, 4]
    assert rows["remote_activations"].tolist() == [3, 2]
    assert rows["remote_token_copies"].tolist() == [2, 2]
    assert rows["dispatch_bytes"].tolist() == [20, 20] == rows["combine_bytes"].tolist()
    np.testing.assert_allclose(rows["expert_load_imbalance_max_mean"], [1.0, 4 / 3])
    np.testing.assert_allclose(rows["expert_load_imbalance_max_median"], [1.0, 4 / 3])
    np.testing.assert_allclose(rows["token_imbalance_max_mean"], [4 / 3, 4 / 3])
    s = result.summary
    assert s["lar"] == pytest.approx(7 / 12)
    assert (s["local_activations"], s["remote_activations"], s["total_activations"]) == (7, 5, 12)
    assert (s["dispatch_bytes"], s["combine_bytes"], s["a2a_bytes"]) == (40, 40, 80)
    assert s["dispatch_bytes_inter_node"] == 40  # one device per node: every remote byte crosses nodes
    assert s["node_local_activation_rate"] == pytest.approx(7 / 12)  # ... and node-local is device-local
    assert s["remote_token_copies"] == 4
    assert s["expert_load_imbalance_max_mean"] == pytest.approx(7 / 6)
    assert s["expert_load_imbalance_max_mean_worst"] == pytest.approx(4 / 3)
    assert s["token_imbalance_max_mean"] == pytest.approx(4 / 3)
    assert (s["num_tokens"], s["num_layers"], s["devices"], s["attention"]) == (3, 2, 2, "dp")


class ReversingTP(Plan):
    """Reverses the token order at odd layers and records what the evaluator passed it."""

    uses_true_routing = True

    def reset(self):
        super().reset()
        self.calls = []

    def shuffle_tokens(self, token_ids, layer, prev_experts, current_experts=None):
        self.calls.append((len(token_ids), layer, None if prev_experts is None else prev_experts.copy(),
                           current_experts.copy()))
        order = np.arange(len(token_ids))
        return (order[::-1] if layer % 2 else order), even_counts(len(token_ids), self.parallel.devices)


def test_tp_hand_computed_and_scheduler_inputs():
    trace = tiny_trace(HAND_EXPERTS, lengths=[2, 1], num_experts=4)
    plan = ReversingTP(contiguous_placement(2, 4, 2),
                       ParallelConfig(devices=2, attention="tp", tokens_per_step=2, bytes_per_token=BYTES))
    # steps [t0, t1] and [t2] (last step shorter: slices [1, 0]).
    # layer 0 identity: t0->0, t1->1, t2->0.  layer 1 reversed: t1->0, t0->1, t2->0.
    np.testing.assert_array_equal(home_devices(plan, trace), [[0, 1], [1, 0], [0, 0]])
    result = evaluate(plan, trace)
    # layer 0: t0 local x2; t1 (home 1) local x2; t2 (home 0) expert 0 local, expert 3 remote (copy 0->1). 5/6.
    # layer 1: t0 (home 1) expert 0 remote (copy 1->0), expert 2 local; t1 (home 0) expert 1 local, expert 3
    #          remote (copy 0->1); t2 (home 0) experts 2, 3 both on device 1 -> one copy 0->1.  2/6.
    np.testing.assert_array_equal(result.traffic, [[[0, 10], [0, 0]], [[0, 20], [10, 0]]])
    np.testing.assert_allclose(result.per_layer["lar"], [5 / 6, 2 / 6])
    assert result.summary["lar"] == pytest.approx(7 / 12)
    assert result.summary["remote_activations"] == 5 and result.summary["remote_token_copies"] == 4
    np.testing.assert_array_equal(result.expert_load, [[3, 3], [2, 4]])
    np.testing.assert_array_equal(result.token_load, [[2, 1], [2, 1]])
    # each step and layer asked once, with true routing of the previous layer and (oracle) of this one
    experts = np.asarray(HAND_EXPERTS)
    assert [(t, layer) for t, layer, _, _ in plan.calls] == [(2, 0), (2, 1), (1, 0), (1, 1)]
    assert plan.calls[0][2] is None
    np.testing.assert_array_equal(plan.calls[1][2], experts[0:2, 0:1])
    np.testing.assert_array_equal(plan.calls[3][2], experts[2:3, 0:1])
    np.testing.assert_array_equal(plan.calls[1][3], experts[0:2, 1])


def test_tp_history_window_is_clipped_to_history_layers():
    rng = np.random.default_rng(1)
    trace = tiny_trace(rng.integers(0, 4, (5, 4, 1)), lengths=[5], num_experts=4)
    plan = ReversingTP(contiguous_placement(4, 4, 2), ParallelConfig(devices=2, attention="tp", tokens_per_step=8))
    home_devices(plan, trace, history=2)
    shapes = [None if prev is None else prev.shape for _, _, prev, _ in plan.calls]
    assert shapes == [None, (5, 1, 1), (5, 2, 1), (5, 2, 1)]
    np.testing.assert_array_equal(plan.calls[3][2], trace.experts[:, 1:3])
    home_devices(plan, trace, history=0)
    assert all(prev is None for _, _, prev, _ in plan.calls)


def test_replicated_placement_uses_static_dispatch():
    # 2 devices x 2 slots over 2 experts: device 0 holds {0, 1}, device 1 holds {0, 0} (a replica of expert 0)
    placement = Placement(np.array([[0, 1, 0, 0]]), num_devices=2, num_experts=2)
    trace = tiny_trace([[[0, 1]], [[0, 1]], [[1, 0]]], lengths=[1, 2], num_experts=2)
    plan = Plan(placement, ParallelConfig(devices=2, attention="dp", tokens_per_step=2, bytes_per_token=BYTES))
    result = evaluate(plan, trace)
    # t0 on device 0: both local.  t1, t2 on device 1: expert 0 served by the local replica, expert 1 remote
    # on device 0 (one copy each).  A first-replica rule would have sent expert 0 of t1, t2 to device 0.
    assert result.summary["lar"] == pytest.approx(4 / 6)
    np.testing.assert_array_equal(result.traffic, [[[0, 0], [20, 0]]])
    np.testing.assert_array_equal(result.expert_load, [[4, 2]])
    assert result.summary["num_slots"] == 4


def test_account_dedups_copies_per_destination_with_source_dependent_dispatch():
    # 1 layer, 3 devices, 3 experts; source 0 sends every expert to device 1, source 2 keeps expert 2 at home
    dispatch_LDE = np.array([[[1, 1, 1], [0, 1, 2], [0, 1, 2]]])
    experts_NLk = np.array([[[0, 1, 2]], [[0, 1, 2]], [[0, 2, 2]]])
    home_NL = np.array([[0], [2], [1]])
    counts = account(home_NL, experts_NLk, dispatch_LDE, bytes_per_token=1, num_devices=3)
    # t0 (home 0): 3 activations on device 1, one copy 0->1.  t1 (home 2): devices 0, 1, 2 -> copies 2->0, 2->1,
    # one local.  t2 (home 1): expert 0 on 0 (copy 1->0), expert 2 twice on 2 (ONE copy 1->2).
    np.testing.assert_array_equal(counts.activations[0], [[0, 3, 0], [1, 0, 2], [1, 1, 1]])
    np.testing.assert_array_equal(counts.traffic[0], [[0, 1, 0], [1, 0, 1], [1, 1, 0]])
    np.testing.assert_array_equal(counts.token_load, [[1, 1, 1]])
    assert counts.local_activations.tolist() == [1] and counts.remote_token_copies.tolist() == [5]


@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_vanilla_ep_lar_is_one_over_devices_on_uniform_routing(attention):
    rng = np.random.default_rng(0)
    n, num_experts, devices = 20_000, 16, 4
    experts = np.argsort(rng.random((n, 3, num_experts)), axis=2)[:, :, :4]  # distinct top-4, uniform
    trace = tiny_trace(experts, lengths=np.full(100, n // 100), num_experts=num_experts)
    plan = VanillaEP().fit(trace, ParallelConfig(devices=devices, attention=attention, tokens_per_step=512), rng)
    s = evaluate(plan, trace).summary
    assert s["lar"] == pytest.approx(1 / devices, abs=0.01)
    # 4 distinct experts over 4 devices holding 4 each: expected distinct remote devices per token, exactly
    p_device_untouched = np.prod([(12 - i) / (16 - i) for i in range(4)])
    expected_copies = 3 * (1 - p_device_untouched)
    assert s["remote_token_copies"] / (n * 3) == pytest.approx(expected_copies, rel=0.02)
    assert s["token_imbalance_max_mean"] == pytest.approx(1.0)


def naive_counts(home_NL, experts_NLk, dispatch_LDE, num_devices):
    """Reference: the definition, one token at a time."""
    n, num_layers, _ = experts_NLk.shape
    activations = np.zeros((num_layers, num_devices, num_devices), dtype=np.int64)
    copies = np.zeros_like(activations)
    for t in range(n):
        for layer in range(num_layers):
            src = home_NL[t, layer]
            dests = [dispatch_LDE[layer, src, e] for e in experts_NLk[t, layer]]
            for d in dests:
                activations[layer, src, d] += 1
            for d in set(dests):
                copies[layer, src, d] += 1
    return activations, copies


@st.composite
def routing_cases(draw):
    n = draw(st.integers(1, 300))
    num_layers = draw(st.integers(1, 3))
    top_k = draw(st.integers(1, 4))
    devices = draw(st.integers(1, 5))
    num_experts = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    home = rng.integers(0, devices, (n, num_layers))
    experts = rng.integers(0, num_experts, (n, num_layers, top_k)).astype(np.int16)
    dispatch = rng.integers(0, devices, (num_layers, devices, num_experts))
    return home, experts, dispatch, devices


@settings(max_examples=60, deadline=None)
@given(routing_cases(), st.integers(1, 9))
def test_account_properties_match_definition(case, bytes_per_token):
    home, experts, dispatch, devices = case
    counts = account(home, experts, dispatch, bytes_per_token, devices)
    activations, copies = naive_counts(home, experts, dispatch, devices)
    np.testing.assert_array_equal(counts.activations, activations)
    np.testing.assert_array_equal(counts.token_copies, copies)
    n, num_layers, top_k = experts.shape
    # local + remote = total = N k per layer
    np.testing.assert_array_equal(counts.local_activations + counts.remote_activations, counts.total_activations)
    assert counts.total_activations.tolist() == [n * top_k] * num_layers
    # traffic rows = what each device sends, columns = what it receives (its combine sends), byte totals agree
    sends = np.zeros((num_layers, devices), dtype=np.int64)
    receives = np.zeros((num_layers, devices), dtype=np.int64)
    for layer in range(num_layers):
        for t in range(n):
            remote = {int(dispatch[layer, home[t, layer], e]) for e in experts[t, layer]} - {home[t, layer]}
            sends[layer, home[t, layer]] += len(remote) * bytes_per_token
            for d in remote:
                receives[layer, d] += bytes_per_token
    np.testing.assert_array_equal(counts.traffic.sum(axis=2), sends)
    np.testing.assert_array_equal(counts.traffic.sum(axis=1), receives)
    combine = counts.traffic.transpose(0, 2, 1)  # the mirror: the destination returns each copy to its source
    assert combine.sum() == counts.traffic.sum() == counts.remote_token_copies.sum() * bytes_per_token
    assert np.all(np.diagonal(counts.traffic, axis1=1, axis2=2) == 0)
    np.testing.assert_array_equal(counts.token_load, np.stack([np.bincount(home[:, i], minlength=devices)
                                                               for i in range(num_layers)]))
    np.testing.assert_array_equal(counts.expert_load.sum(axis=1), [n * top_k] * num_layers)


def test_account_is_independent_of_chunking(monkeypatch):
    rng = np.random.default_rng(3)
    home = rng.integers(0, 4, (1000, 2))
    experts = rng.integers(0, 8, (1000, 2, 3))
    dispatch = rng.integers(0, 4, (2, 4, 8))
    whole = account(home, experts, dispatch, 1, 4)
    monkeypatch.setattr(accounting, "CHUNK_EVENTS", 1)  # 16-token chunks, the last one partial
    chunked = account(home, experts, dispatch, 1, 4)
    np.testing.assert_array_equal(whole.activations, chunked.activations)
    np.testing.assert_array_equal(whole.token_copies, chunked.token_copies)


def test_memory_mapped_trace_gives_the_same_result(tmp_path):
    rng = np.random.default_rng(4)
    experts = np.argsort(rng.random((400, 2, 8)), axis=2)[:, :, :2]  # two distinct experts per token-layer
    trace = tiny_trace(experts, lengths=[100] * 4, num_experts=8)
    mapped = read_trace(write_trace(trace, tmp_path / "t"))
    for attention in ("dp", "tp"):
        plan = VanillaEP().fit(trace, ParallelConfig(devices=4, attention=attention, tokens_per_step=64), rng)
        a, b = evaluate(plan, trace), evaluate(plan, mapped)
        assert a.summary == b.summary
        np.testing.assert_array_equal(a.traffic, b.traffic)


def test_plan_info_scalars_are_reported():
    trace = tiny_trace(HAND_EXPERTS, lengths=[2, 1], num_experts=4)
    plan = Plan(contiguous_placement(2, 4, 2), ParallelConfig(devices=2, tokens_per_step=2),
                info={"solver": "optimal", "moved": np.float32(0.5), "table": [1, 2]})
    s = evaluate(plan, trace).summary
    assert s["plan_solver"] == "optimal" and s["plan_moved"] == 0.5 and "plan_table" not in s


class BadDP(Plan):
    def __init__(self, ranks, **kw):
        super().__init__(contiguous_placement(2, 4, 2), ParallelConfig(devices=2, tokens_per_step=2))
        self.bad_ranks = ranks

    def assign_requests(self, token_ids, offsets, prefill_len):
        return self.bad_ranks


class BadTP(Plan):
    def __init__(self, perm, counts):
        super().__init__(contiguous_placement(2, 4, 2), ParallelConfig(devices=2, attention="tp", tokens_per_step=3))
        self.bad = (np.asarray(perm), np.asarray(counts))

    def shuffle_tokens(self, token_ids, layer, prev_experts):
        return self.bad


@pytest.mark.parametrize(
    "plan, message",
    [
        (BadDP(np.array([0])), r"BadDP\.assign_requests returned .* shape \(2,\)"),
        (BadDP(np.array([0.0, 1.0])), r"BadDP\.assign_requests returned float64"),
        (BadDP(np.array([0, 2])), r"BadDP\.assign_requests sent request 1 to rank 2"),
        (BadTP([0, 0, 1], [2, 1]), r"BadTP\.shuffle_tokens .* repeats or misses"),
        (BadTP([0, 1, 3], [2, 1]), r"BadTP\.shuffle_tokens .* repeats or misses"),
        (BadTP([0, 1], [1, 1]), r"BadTP\.shuffle_tokens .* permutation of int64 \(2,\)"),
        (BadTP([2, 1, 0], [3, 0]), r"BadTP\.shuffle_tokens .* slice sizes \[3, 0\]"),
        (BadTP([2, 1, 0], [1, 1]), r"BadTP\.shuffle_tokens .* slice sizes \[1, 1\]"),
        (BadTP([2, 1, 0], [1, 1, 1]), r"BadTP\.shuffle_tokens .* 2 integer slice sizes"),
    ],
)
def test_plan_contract_violations_raise(plan, message):
    trace = tiny_trace(HAND_EXPERTS, lengths=[2, 1], num_experts=4)
    with pytest.raises(ReproError, match=message):
        evaluate(plan, trace)


def test_mismatched_inputs_raise_one_clear_error():
    trace = tiny_trace(HAND_EXPERTS, lengths=[2, 1], num_experts=4)
    parallel = ParallelConfig(devices=2, tokens_per_step=2)
    with pytest.raises(ConfigError, match="fitted for 3 MoE layers but the trace has 2"):
        evaluate(Plan(contiguous_placement(3, 4, 2), parallel), trace)
    with pytest.raises(ConfigError, match="places 8 experts per layer"):
        evaluate(Plan(contiguous_placement(2, 8, 2), parallel), trace)
    with pytest.raises(ConfigError, match="history must be an integer >= 0"):
        evaluate(Plan(contiguous_placement(2, 4, 2), parallel), trace, history=-1)
    home, dispatch = np.zeros((3, 2), dtype=np.int64), np.zeros((2, 2, 4), dtype=np.int64)
    with pytest.raises(TraceError, match="expert id 9 at token 1, layer 0"):
        account(home, np.where(np.arange(3)[:, None, None] == 1, 9, 0) + np.zeros((3, 2, 2), int), dispatch, 1, 2)
    with pytest.raises(ReproError, match="home names devices outside 0..1"):
        account(home + 2, np.zeros((3, 2, 2), int), dispatch, 1, 2)
    with pytest.raises(ConfigError, match="dispatch_device must be"):
        account(home, np.zeros((3, 2, 2), int), dispatch[:1], 1, 2)
    with pytest.raises(ConfigError, match="bytes_per_token"):
        account(home, np.zeros((3, 2, 2), int), dispatch, 0, 2)


def test_inter_node_rdma_bytes_count_one_copy_per_token_and_remote_node():
    # 4 devices as 2 nodes x 2, experts e on device e (contiguous EP, E = 4), one request of 2 tokens on rank 0.
    # t0 -> experts 2, 3 (both on node 1): 2 device copies cross nodes, but one RDMA copy to node 1.
    # t1 -> experts 1, 2: device 1 is on node 0 (intra-node copy), device 2 on node 1 (one RDMA copy).
    trace = tiny_trace([[[2, 3]], [[1, 2]]], lengths=[2], num_experts=4)
    parallel = ParallelConfig(devices=4, attention="dp", tokens_per_step=4, bytes_per_token=BYTES, devices_per_node=2)
    s = evaluate(Plan(contiguous_placement(1, 4, 4), parallel), trace).summary
    assert s["dispatch_bytes_inter_node"] == 3 * BYTES and s["dispatch_bytes_intra_node"] == 1 * BYTES
    assert s["dispatch_bytes_inter_node_rdma"] == 2 * BYTES
    assert s["node_local_activation_rate"] == pytest.approx(1 / 4)  # only t1's expert 1 stays on node 0
    one_node = ParallelConfig(devices=4, attention="dp", tokens_per_step=4, bytes_per_token=BYTES, devices_per_node=4)
    s = evaluate(Plan(contiguous_placement(1, 4, 4), one_node), trace).summary
    assert s["dispatch_bytes_inter_node"] == s["dispatch_bytes_inter_node_rdma"] == 0


@pytest.mark.parametrize("count", ["account", "served_activations"])
def test_an_expert_id_outside_the_placement_names_its_token_and_layer(count, monkeypatch):
    """The compiled loop finds the bad row; the sentence names the trace's token (chunks of 16 tokens here)."""
    monkeypatch.setattr(accounting, "CHUNK_EVENTS", 16 * 2)
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 4, (40, 2, 2)).astype(np.int16)
    experts[37, 1, 0] = 9
    home = np.zeros((40, 2), dtype=np.int64)
    dispatch = np.zeros((2, 2, 4), dtype=np.int64)
    args = (home, experts, dispatch, 8, 2) if count == "account" else (home, experts, dispatch, 2)
    with pytest.raises(TraceError, match=r"expert id 9 at token 37, layer 1 is outside the placement's 0\.\.3"):
        getattr(accounting, count)(*args)
