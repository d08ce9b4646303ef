"""The simulator's fast path (issue 33 item 1) gives the numbers of the straightforward one, bit for bit.

The engine counts and prices a block in compiled code (`CostModel.count_and_price`: `counting.count_rows_at` and the
kernels behind `CostModel.price`); the reference is the engine's pricing as it was before (gathered rows,
`traffic.batch_traffic`, numpy `CostModel.block`), kept verbatim in bench/sim_reference.py. Whole runs are compared field by field with exact
equality over prefill-heavy and decode-heavy traffic, Attention-DP and Attention-TP, light and saturated load, both
schedules, replicated experts, one node and two (DeepEP normal kernels across nodes), and measured all-to-all tables.

Legend: R requests, L MoE layers, k experts per token, E experts, D devices, K iterations in a block.
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from bench.sim_reference import ReferenceEngine
from repro.parallel import ParallelConfig
from repro.sim import ModelShape, load_hardware
from repro.sim.costs import A2A_BACKENDS, CostModel
from repro.sim.engine import Engine, EngineConfig
from repro.sim.shapes import RoutingMap
from repro.sim.simulate import build_requests
from repro.sim.traffic import BatchTraffic, dispatch_slots
from repro.systems.base import Placement, Plan
from repro.systems.ep import contiguous_placement
from repro.traces import TraceMeta, make_trace

ROOT = Path(__file__).resolve().parents[1]


def load_yaml(*parts) -> dict:
    return OmegaConf.to_container(OmegaConf.load(ROOT.joinpath("conf", *parts)), resolve=True)


class ScatterPlan(Plan):
    """TP token scheduler that hands each layer's tokens to ranks in a layer-dependent order (homes vary by layer)."""

    def shuffle_tokens(self, token_ids, layer, prev_experts):
        perm = np.argsort((np.asarray(token_ids, np.int64) * 7919 + layer * 31) % 101, kind="stable")
        return perm, np.bincount(np.arange(len(perm)) % self.parallel.devices, minlength=self.parallel.devices)


def random_trace(rng, num_requests, prompt, output, num_layers, num_experts, top_k):
    """Prompts of `prompt` = (lo, hi) tokens and `output` generated tokens (captured decode routing)."""
    prompts = rng.integers(prompt[0], prompt[1] + 1, num_requests)
    outputs = rng.integers(output[0], output[1] + 1, num_requests)
    lengths = prompts + outputs
    n = int(lengths.sum())
    # skewed routing (a few hot experts), k distinct per token
    scores = rng.random((n, num_layers, num_experts)) * np.linspace(1.0, 3.0, num_experts)
    experts = np.argsort(-scores, axis=2)[:, :, :top_k].astype(np.int16)
    meta = TraceMeta(model="toy", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(num_layers)),
                     vocab_size=500)
    return make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, 500, n), experts,
                      prefill_len=prompts)


def replicated_placement(rng, num_layers, num_experts, devices):
    """Every expert once plus `devices` hot experts a second time, one extra slot per device."""
    spd = num_experts // devices + 1
    rows = []
    for _ in range(num_layers):
        base = rng.permutation(num_experts).reshape(devices, -1)
        extra = rng.choice(num_experts, devices, replace=False)[:, None]
        rows.append(np.concatenate([base, extra], axis=1).ravel())
    return Placement(np.stack(rows), devices, num_experts), spd


CASES = {
    # name: (hardware, devices, attention, backend, schedule, prompt, output, rate per s, replicated)
    "dp_prefill_heavy_light": ("h200", 8, "dp", "deepep_auto", "mixed", (150, 400), (1, 3), 50.0, False),
    "dp_decode_heavy_saturated": ("h200", 8, "dp", "nccl", "mixed", (4, 20), (40, 90), 1e6, False),
    "dp_prefill_first_replicated": ("h200", 8, "dp", "deepep_low_latency", "prefill_first", (20, 120), (5, 40), 2e3, True),
    "dp_two_nodes_normal": ("h100_2x8_ib", 16, "dp", "deepep_normal", "mixed", (30, 200), (5, 30), 1e6, False),
    "dp_two_nodes_auto": ("h100_2x8_ib", 16, "dp", "deepep_auto", "mixed", (10, 60), (10, 60), 300.0, True),
    "dp_measured_a2a": ("cpu_vm_4ranks", 4, "dp", "nccl", "mixed", (10, 100), (5, 40), 20.0, False),
    "tp_prefill_heavy_saturated": ("h200", 8, "tp", "deepep_auto", "mixed", (150, 400), (1, 3), 1e6, False),
    "tp_decode_heavy_light": ("h200", 8, "tp", "nccl", "mixed", (4, 20), (40, 90), 30.0, True),
    "tp_two_nodes": ("h100_2x8_ib", 16, "tp", "deepep_normal", "prefill_first", (20, 80), (10, 40), 1e6, False),
}
SHAPE = ModelShape.from_config(load_yaml("sim", "shape", "deepseek_v2_lite.yaml"))


def run_both(name, num_requests=60, rates=(1.0,), make_plan=None, until=float("inf"), change_mode=None):
    """Runs of the engine and of the reference engine on case `name`; make_plan(placement, parallel) replaces the
    case's plan (e.g. one that reads the engine's load), `until` is the runs' horizon; change_mode ("sync" or
    "async"): the placement is replaced twice during each run (slots permuted per layer)."""
    hardware, devices, attention, backend, schedule, prompt, output, rate, replicated = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    num_layers, num_experts, top_k = 4, 32, 4
    trace = random_trace(rng, num_requests, prompt, output, num_layers, num_experts, top_k)
    hw = load_hardware(load_yaml("hardware", f"{hardware}.yaml"))
    if replicated:
        placement, _ = replicated_placement(rng, num_layers, num_experts, devices)
    else:
        placement = contiguous_placement(num_layers, num_experts, devices)
    parallel = ParallelConfig(devices=devices, attention=attention, devices_per_node=hw.devices_per_node)
    plan = (ScatterPlan if attention == "tp" else Plan)(placement, parallel) if make_plan is None \
        else make_plan(placement, parallel)
    mapping = RoutingMap("trace", num_layers, num_experts, top_k, SHAPE.num_moe_layers / num_layers,
                         SHAPE.moe_intermediate_size * SHAPE.top_k // top_k, "test")
    cost = CostModel(SHAPE, hw, mapping, devices, attention, backend)
    requests, _, _ = build_requests(trace, np.arange(num_requests), 1, "captured", rng, rng)
    config = EngineConfig(512, 16, schedule, 100_000, 64, 1e-5, 2)
    pattern = np.sort(rng.exponential(1.0 / rate, num_requests).cumsum())
    changes = ()
    if change_mode is not None:
        from repro.sim.plan_changes import priced_changes

        p2l = placement.physical_to_logical
        moved = [Placement(np.stack([row[rng.permutation(len(row))] for row in p2l]), devices, num_experts)
                 for _ in range(2)]
        span = float(np.sort(rng.exponential(1.0 / rate, num_requests).cumsum())[-1])
        changes = priced_changes(plan, [(0.3 * span, moved[0]), (0.6 * span, moved[1])], SHAPE, hw, change_mode,
                                 bandwidth_share=0.5 if change_mode == "async" else 1.0)
    runs = []
    for engine_type in (Engine, ReferenceEngine):
        engine = engine_type(plan, requests, cost, dispatch_slots(placement), config)
        for scale in rates:  # several runs of one engine (as a rate sweep does): the later ones reuse counted prompts
            arrivals = pattern / scale
            window = (float(arrivals[num_requests // 4]), float(arrivals[-1]) + 0.05)
            runs.append(engine.run(arrivals[: num_requests - int(5 * (scale - 1))], until=until, window=window,
                                   changes=changes))
    return runs[: len(rates)], runs[len(rates) :]


def assert_same_run(fast, reference, finished=True):
    assert fast.window_iterations.sum() > 0 and (np.isfinite(fast.finish).all() or not finished)
    for field in dataclasses.fields(reference):
        got, want = getattr(fast, field.name), getattr(reference, field.name)
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True), field.name
        else:
            assert type(got) is type(want) and got == want, field.name


@pytest.mark.parametrize("name", sorted(CASES))
def test_fast_engine_equals_the_reference_bit_for_bit(name):
    (fast,), (reference,) = run_both(name)
    assert_same_run(fast, reference)


@pytest.mark.parametrize("name", ["dp_prefill_heavy_light", "dp_two_nodes_normal", "dp_prefill_first_replicated"])
def test_later_runs_of_an_engine_reuse_counted_prompts_and_stay_equal(name):
    """Three runs of one engine at three rates (the later ones find most prompts counted, on the same ranks or not)."""
    fast, reference = run_both(name, rates=(1.0, 1.7, 3.0))
    for got, want in zip(fast, reference, strict=True):
        assert_same_run(got, want)


def test_the_cases_cover_what_they_claim():
    """Prefill-heavy and decode-heavy, light and saturated, as named (the reference's own counts)."""
    light = run_both("dp_prefill_heavy_light")[1][0]
    saturated = run_both("dp_decode_heavy_saturated")[1][0]
    assert light.tokens / light.iterations < 0.3 * 512  # few tokens per iteration
    assert saturated.tokens / saturated.iterations > 40  # most of the 60 requests decode together
    assert light.prefill_iterations > 0.3 * light.iterations
    assert saturated.prefill_iterations < 0.2 * saturated.iterations


@pytest.mark.parametrize("hardware", ["h200", "h100_2x8_ib", "cpu_vm_4ranks"])
@pytest.mark.parametrize("attention", ["dp", "tp"])
def test_price_equals_block_on_random_blocks(hardware, attention):
    """CostModel.price against CostModel.block on random count tables, every backend, every iteration mix, with
    the profile's measured tables and with expert-GEMM and gate tables put in."""
    rng = np.random.default_rng(7)
    hw = load_hardware(load_yaml("hardware", f"{hardware}.yaml"))
    tables = hw.measured_expert_gemm.get("exec_cpu"), hw.measured_gate.get("exec_cpu")
    devices, num_layers, num_experts = hw.num_devices, 5, 64
    nodes = devices // hw.devices_per_node
    for backend in A2A_BACKENDS:
        for spd in (8, 9, 130 // devices + 1):
            mapping = RoutingMap("trace", num_layers, num_experts, 6, 27 / 5, 1408, "test")
            cost = CostModel(SHAPE, hw, mapping, devices, attention, backend)
            if tables[0] is not None and spd == 9:
                cost.expert_table, cost.gate_table = tables
                cost._compiled = cost._compiled_inputs()
            assert cost._compiled is not None
            for _ in range(3):
                k, scale = int(rng.integers(1, 5)), int(10 ** rng.integers(0, 4))
                activations = rng.integers(0, scale + 1, (k, num_layers, devices, devices))
                activations *= rng.random(activations.shape) < 0.6
                copies = np.minimum(activations, rng.integers(0, scale + 1, activations.shape))
                node_copies = rng.integers(0, scale + 1, (k, num_layers, devices, nodes)) if nodes > 1 else None
                slot_tokens = rng.integers(0, 3 * scale + 1, (k, num_layers, devices * spd))
                slot_tokens *= rng.random(slot_tokens.shape) < 0.7
                traffic = BatchTraffic(activations, copies, node_copies, slot_tokens)
                groups = devices if attention == "dp" else 1
                tokens = rng.integers(0, 3000, (k, groups)).astype(float) * (rng.random((k, groups)) < 0.8)
                seg = {"pairs_prefill": rng.random((k, groups)) * 1e6 * (tokens > 0),
                       "pairs_decode": rng.random((k, groups)) * 1e4, "kv_read": tokens * 7.0, "tokens": tokens,
                       "samples": rng.integers(0, 5, (k, groups)).astype(float)}
                slices = rng.integers(0, 3000, (k, num_layers, devices)) if attention == "tp" else None
                has_prefill = rng.random(k) < 0.5
                tokens_KD = tokens if attention == "dp" else None
                want = cost.block(seg, traffic, tokens_KD, slices, has_prefill)
                got = cost.price(seg, traffic, tokens_KD, slices, has_prefill)
                for key in want:
                    assert np.array_equal(got[key], want[key]), (backend, spd, key)


@pytest.mark.parametrize("devices,devices_per_node,rows,groups,crowded", [
    (4, 4, 40, 3, 0),  # few rows: each activation straight to its slot, a token-layer's devices in byte lanes
    (8, 4, 60, 3, 0),  # the same across two nodes (node copies per token-layer)
    (8, 4, 1400, 200, 1200),  # few rows per (group, home) but 1,200 on one: counts past a byte's 255 there
    (16, 8, 40, 2, 0),  # few rows, D > 8: 4-bit lanes
    (8, 8, 3000, 2, 0),  # many rows, D <= 8: per-expert counts and byte-lane copies
    (8, 4, 3000, 1, 0),  # the same across two nodes
    (16, 8, 4000, 1, 0),  # per-expert counts, copies by bit set (D > 8)
    (80, 8, 300, 2, 0),  # past 64 devices: bit sets of several words
    (8, 8, 25000, 3, 0),  # more rows than one gathered chunk
])
def test_stream_traffic_equals_batch_traffic(devices, devices_per_node, rows, groups, crowded):
    """traffic.stream_traffic (the engine's counting: rows read in place, any subset order) against batch_traffic on
    the gathered rows: the same tables, and the engine's stats (activations, local ones, remote copies). crowded:
    rows put on group 0, home 0 in every layer."""
    from repro.sim.traffic import batch_traffic, device_tables, stream_traffic

    rng = np.random.default_rng(devices + rows)
    num_layers, top_k = 3, 4
    placement, spd = replicated_placement(rng, num_layers, 2 * devices, devices)
    slots = dispatch_slots(placement)
    experts = np.argsort(rng.random((5000, num_layers, 2 * devices)), axis=2)[:, :, :top_k].astype(np.int16)
    rows_N = rng.integers(0, 5000, rows)
    group_N = rng.integers(0, groups, rows)
    home_NL = rng.integers(0, devices, (rows, num_layers))
    group_N[:crowded] = 0
    home_NL[:crowded] = 0
    got, stats = stream_traffic(rows_N, group_N, home_NL, experts, slots, device_tables(slots, spd), spd, groups,
                                devices_per_node)
    want = batch_traffic(group_N, home_NL, experts[rows_N], slots, spd, groups, devices_per_node)
    for name in ("activations", "copies", "node_copies", "slot_tokens"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None and b is None) or np.array_equal(a, b), name
    diagonal = np.arange(devices)
    np.testing.assert_array_equal(stats[:, 0], want.activations.sum(axis=(1, 2, 3)))
    np.testing.assert_array_equal(stats[:, 1], want.activations[:, :, diagonal, diagonal].sum(axis=(1, 2)))
    np.testing.assert_array_equal(stats[:, 2], want.copies.sum(axis=(1, 2, 3)) - want.copies[:, :, diagonal, diagonal].sum(axis=(1, 2)))


def test_stream_traffic_names_the_first_bad_row():
    from repro.errors import ConfigError
    from repro.sim.traffic import device_tables, stream_traffic

    slots = dispatch_slots(contiguous_placement(2, 8, 2))
    experts = np.zeros((10, 2, 2), dtype=np.int16)
    experts[:, :, 1] = 1
    experts[7, 1, 0] = 8  # row 7's second layer names expert 8 of 8
    home = np.zeros((5, 2), dtype=np.int64)
    home[4, 0] = 2  # batch row 4 lives on device 2 of 2
    for rows, bad in ((np.array([0, 1, 7, 2, 3]), 2), (np.array([0, 1, 2, 3, 4]), 4)):
        with pytest.raises(ConfigError, match=f"token row {bad} "):
            stream_traffic(rows, np.zeros(5, dtype=np.int64), home, experts, slots, device_tables(slots, 4), 4, 1, 2)


def test_declined_blocks_take_the_two_step_path(monkeypatch):
    """Where the compiled kernels decline (here: every block), the engine counts with stream_traffic and prices with
    CostModel.block: the same run as the reference."""
    monkeypatch.setattr(CostModel, "_compiled_inputs", lambda self: None)
    (fast,), (reference,) = run_both("dp_two_nodes_auto", num_requests=30, rates=(1.0,))
    assert np.array_equal(fast.finish, reference.finish) and np.array_equal(fast.moe_seconds, reference.moe_seconds)
    assert fast.remote_copies == reference.remote_copies and fast.local_activations == reference.local_activations


def test_a_bad_expert_id_raises_the_reference_error():
    """A prompt naming an expert outside the placement: the engine raises what the reference raises, and keeps
    no counts for it."""
    from repro.errors import ConfigError

    rng = np.random.default_rng(3)
    trace = random_trace(rng, 6, (5, 9), (2, 3), 2, 8, 2)
    hw = load_hardware(load_yaml("hardware", "h200.yaml"))
    placement = contiguous_placement(2, 8, 8)
    plan = Plan(placement, ParallelConfig(devices=8, attention="dp"))
    cost = CostModel(SHAPE, hw, RoutingMap("trace", 2, 8, 2, 13.0, 1408, "test"), 8, "dp", "nccl")
    requests, _, _ = build_requests(trace, np.arange(6), 1, "captured", rng, rng)
    experts = requests.experts.copy()
    experts[7, 1, 0] = 8  # row 7: in the first or second request (7 to 12 rows each)
    requests = dataclasses.replace(requests, experts=experts)
    messages, engines = [], []
    for engine_type in (Engine, ReferenceEngine):
        engines.append(engine_type(plan, requests, cost, dispatch_slots(placement),
                                   EngineConfig(512, 16, "mixed", 10_000, 64, 0.0, 2)))
        with pytest.raises(ConfigError, match="outside the placement") as error:
            engines[-1].run(np.zeros(6))
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    assert not engines[0]._prompt_cache["index"]  # the block failed: none of its prompts is kept


@pytest.fixture
def compiled_calls(monkeypatch):
    """How often the engine's compiled steps (repro/sim/engine_loop.serve) ran."""
    from repro.sim import engine_loop

    calls = {"serve": 0}
    serve = engine_loop.serve

    def counted(*args):
        calls["serve"] += 1
        return serve(*args)

    monkeypatch.setattr(engine_loop, "serve", counted)
    return calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_dp_runs_take_the_compiled_steps(name, compiled_calls):
    """The equality tests above compare the compiled steps (Attention-DP) and the Python ones (Attention-TP)."""
    run_both(name, num_requests=20)
    assert (compiled_calls["serve"] > 0) == (CASES[name][2] == "dp")


@pytest.mark.parametrize("rule", ["shortest_queue", "minimum_tokens", "wait"])
@pytest.mark.parametrize("name", ["dp_prefill_heavy_light", "dp_decode_heavy_saturated", "dp_prefill_first_replicated"])
def test_a_plan_that_reads_the_engine_load_sees_the_same_engine(name, rule, compiled_calls):
    """A load-reading plan (system=shortest_queue, minimum_tokens, least_wait) gets the live RankLoad at each arrival:
    the compiled steps must leave the engine in the state the Python steps leave it at every arrival."""
    from repro.systems.dp_balance import LoadBalancedPlan

    def make_plan(placement, parallel):
        return LoadBalancedPlan(placement, parallel, rule, decode_tokens=1.0)

    fast, reference = run_both(name, rates=(1.0, 2.0), make_plan=make_plan)
    assert compiled_calls["serve"] > 0
    for got, want in zip(fast, reference, strict=True):
        assert_same_run(got, want)
    assert len(np.unique(fast[0].rank)) > 1


@pytest.mark.parametrize("name", ["dp_prefill_heavy_light", "dp_decode_heavy_saturated", "tp_decode_heavy_light"])
def test_a_horizon_stops_both_engines_at_the_same_state(name):
    """Runs cut by `until` (unfinished requests keep NaN times): the same partial run."""
    (full,), _ = run_both(name)
    until = float(np.nanquantile(full.finish, 0.5))
    (fast,), (reference,) = run_both(name, until=until)
    assert np.isnan(fast.finish).any()
    assert_same_run(fast, reference, finished=False)


def test_the_decode_pool_of_a_disaggregated_run_equals_the_reference(compiled_calls):
    """DecodeEngine (requests enter decoding prefilled) takes the compiled steps; prefill and decode pools give the
    reference pricing's times and costs."""
    from bench.sim_reference import reference_pricing
    from repro.sim.disaggregated import kv_link, run_disaggregated

    rng = np.random.default_rng(11)
    num_requests, num_layers, num_experts, top_k = 40, 4, 32, 4
    trace = random_trace(rng, num_requests, (20, 120), (5, 40), num_layers, num_experts, top_k)
    hw = load_hardware(load_yaml("hardware", "h200.yaml"))
    placement = contiguous_placement(num_layers, num_experts, 8)
    plan = Plan(placement, ParallelConfig(devices=8, attention="dp"))
    mapping = RoutingMap("trace", num_layers, num_experts, top_k, 6.5, 1408, "test")
    prefill_cost = CostModel(SHAPE, hw, mapping, 8, "dp", "deepep_normal")
    decode_cost = CostModel(SHAPE, hw, mapping, 8, "dp", "deepep_low_latency")
    requests, _, _ = build_requests(trace, np.arange(num_requests), 1, "captured", rng, rng)
    config = EngineConfig(512, 16, "mixed", 100_000, 64, 1e-5, 2)
    arrivals = np.sort(rng.random(num_requests)) * 0.05
    link = kv_link(SHAPE, hw, "rdma")
    fast = run_disaggregated(plan, prefill_cost, config, plan, decode_cost, config, requests, arrivals, link)
    assert compiled_calls["serve"] > 0
    with reference_pricing():
        reference = run_disaggregated(plan, prefill_cost, config, plan, decode_cost, config, requests, arrivals, link)
    for field in ("first_token", "kv_arrival", "finish"):
        assert np.array_equal(getattr(fast, field), getattr(reference, field), equal_nan=True), field
    assert_same_run(fast.prefill, reference.prefill)
    for field in dataclasses.fields(reference.decode):  # the decode pool's window is empty: compare every field
        got, want = getattr(fast.decode, field.name), getattr(reference.decode, field.name)
        assert (np.array_equal(got, want, equal_nan=True) if isinstance(want, np.ndarray) else got == want), field.name


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", ["dp_prefill_heavy_light", "dp_decode_heavy_saturated", "dp_two_nodes_auto",
                                  "tp_decode_heavy_light"])
def test_plan_changes_during_a_run_give_the_reference_run(name, mode, compiled_calls):
    """A placement replaced twice during each of two runs of an engine (repro/sim/plan_changes.py): a synchronous
    stall, or an asynchronous migration pricing iterations on shared links, then new dispatch tables; the compiled
    steps stop at each change and take the new tables and cost model."""
    fast, reference = run_both(name, rates=(1.0, 1.5), change_mode=mode)
    assert (compiled_calls["serve"] > 0) == (CASES[name][2] == "dp")
    for got, want in zip(fast, reference, strict=True):
        assert len(want.changes) == 2
        assert_same_run(got, want)
