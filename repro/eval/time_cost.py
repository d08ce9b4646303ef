"""Critical-path time of a plan on a trace: per MoE layer, the busiest rank's dispatch, expert compute and combine.

LAR is a means; a layer finishes when its busiest rank finishes its remote sends and receives (the all-to-all)
and its expert work (the rows of its grouped GEMMs, and the weights of every expert its batch reads). This module
prices that with the serving simulator's own cost model: `moe_layer_seconds` hands a counted batch
(`repro.sim.traffic.batch_traffic`) to `repro.sim.costs.CostModel.block`, the function the simulator prices each
of its iterations with, and keeps the MoE components (dispatch, experts, combine). The evaluator, the simulator and
any system that wants to optimise time thus share one pricing.

The evaluated trace is served as a sequence of steps (`time_estimate`), as continuous batching serves a stream
in steady state: in Attention-DP a step holds the tokens that arrive in one window of D x `step_tokens`
consecutive trace tokens (trace order = arrival order), each on its request's rank, so a step pays for the
imbalance of what arrived in it (the busiest rank sets the layer's pace) but no backlog carries over from step to
step: below capacity each iteration serves what arrived during it. (Until issue 32 each rank worked through its
whole queue, `step_tokens` per step, which charged round robin for a whole-split token imbalance that continuous
batching, admitting new requests every iteration, does not show.) In Attention-TP a step is `step_tokens`
consecutive trace tokens (the steps `home_devices` reshuffles), split into the reduce-scatter's slices. A step's layer takes the busiest
rank's time for each component (as in the simulator); the estimate is the sum over steps and MoE layers. It is a
makespan of serving the trace as a batch, not a latency under load (that is what repro.sim measures).

Legend: N tokens, L MoE layers, k experts per token, E experts, D devices, K steps, P physical slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from repro.errors import ConfigError
from repro.systems.base import Plan
from repro.traces import RoutingTrace

if TYPE_CHECKING:  # repro.sim is imported where a time is priced, so the plain evaluator does not depend on it
    from repro.sim.costs import CostModel
    from repro.sim.traffic import BatchTraffic

# the shape used when a job configures no simulator: sizes of a real fine-grained MoE (the paper's DeepSeek class)
DEFAULT_SHAPE = "deepseek_v2_lite"
SHAPE_DIR = Path(__file__).resolve().parents[2] / "conf" / "sim" / "shape"
# steps priced in one batch_traffic call: keeps its [K, L, 2, D, D] histogram small
STEPS_PER_BLOCK = 64
PARTS = ("dispatch", "experts", "combine")


@dataclass(frozen=True)
class TimeModel:
    """What pricing a plan's batches needs: the simulator's CostModel for the plan's deployment, the physical slot
    serving each (layer, home device, expert) (int32[L, D, E], `dispatch_slots`), slots per device, devices per
    node, tokens per step, and a description of the sizes priced (for the summary)."""

    cost: CostModel
    slot_table: np.ndarray
    slots_per_device: int
    devices_per_node: int
    step_tokens: int
    description: dict


def load_shape(name: str) -> dict:
    """The model shape conf/sim/shape/<name>.yaml as a dict (the simulator's sizes)."""
    from omegaconf import OmegaConf

    path = SHAPE_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in SHAPE_DIR.glob("*.yaml"))
        raise ConfigError(f"there is no model shape {name!r} in {SHAPE_DIR}; choose one of {known}.")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def time_model(plan: Plan, trace: RoutingTrace, hardware: dict, shape: dict, *, backend: str = "nccl",
               step_tokens: int | None = None) -> TimeModel:
    """A TimeModel pricing `plan` on `trace` with the simulator's cost model.

    hardware: a conf/hardware/*.yaml profile dict, priced on the plan's topology (parallel.devices over
    parallel.devices_per_node); shape: a conf/sim/shape/*.yaml dict (`load_shape`). The trace's
    MoE layers and experts are priced with the shape's sizes (the simulator's routing_map "trace" when they
    differ, stated in the description). backend: an all-to-all backend of repro.sim.costs (nccl: the evaluator's
    per-rank deduplicated copies). step_tokens: tokens per rank per step in Attention-DP, per step in
    Attention-TP; default parallel.tokens_per_step.
    """
    from repro.sim.costs import CostModel
    from repro.sim.hardware import load_hardware
    from repro.sim.shapes import ModelShape, routing_map
    from repro.sim.traffic import dispatch_slots

    parallel = plan.parallel
    if not isinstance(hardware, dict):
        raise ConfigError(f"hardware must be a mapping (a conf/hardware/*.yaml profile), got {type(hardware).__name__}.")
    # the job's topology (parallel.devices over parallel.devices_per_node) with the profile's GPU and link speeds,
    # so an EP degree beyond the profile's node count is still priced (its RDMA numbers apply across nodes)
    hw = load_hardware(dict(hardware, nodes=parallel.num_nodes, devices_per_node=parallel.devices_per_node))
    model = ModelShape.from_config(shape)
    mapping = routing_map(model, trace, "trace")
    step = parallel.tokens_per_step if step_tokens is None else step_tokens
    if not isinstance(step, int | np.integer) or step < parallel.devices:
        raise ConfigError(f"the time estimate's step_tokens must be an integer >= parallel.devices, got {step!r}.")
    cost = CostModel(model, hw, mapping, parallel.devices, parallel.attention, backend)
    description = {"time_estimate_hardware": f"{hw.name} ({hw.nodes} x {hw.devices_per_node})",
                   "time_estimate_shape": model.name,
                   "time_estimate_backend": backend, "time_estimate_step_tokens": int(step),
                   "time_estimate_routing_map": mapping.description}
    return TimeModel(cost, dispatch_slots(plan.placement), plan.placement.slots_per_device, parallel.devices_per_node,
                     int(step), description)


def time_model_from_config(config: dict, plan: Plan, trace: RoutingTrace) -> TimeModel:
    """The job's TimeModel: config["hardware"], and the simulator's shape and backend when config has a `sim`
    group, else DEFAULT_SHAPE and nccl."""
    sim = config.get("sim") or {}
    shape = sim.get("shape") or load_shape(DEFAULT_SHAPE)
    return time_model(plan, trace, config["hardware"], shape, backend=sim.get("backend", "nccl"))


def moe_layer_seconds(cost: CostModel, traffic: BatchTraffic, tokens_KD: np.ndarray | None,
                      slice_KLD: np.ndarray | None, has_prefill_K: np.ndarray) -> dict[str, np.ndarray]:
    """{"dispatch", "experts", "combine"}: float64[K, L] critical-path seconds of each MoE layer of K batches.

    The simulator's pricing itself (CostModel.block, see repro.sim.costs): traffic from batch_traffic; tokens_KD
    int[K, D] tokens on each rank (Attention-DP, else None); slice_KLD int[K, L, D] reduce-scatter slices
    (Attention-TP, else None); has_prefill_K bool[K]. The attention inputs are zero: only the MoE part is kept.
    Seconds are per trace layer (CostModel.map.layer_weight, the shape layers one stands for, is not applied).
    """
    from repro.sim.costs import COMPONENTS

    num_k = traffic.slot_tokens.shape[0]
    ranks = cost.devices if cost.mode == "dp" else 1
    tokens = tokens_KD if cost.mode == "dp" else slice_KLD[:, 0].sum(axis=1, keepdims=True)
    zeros = np.zeros((num_k, ranks))
    seg = {"pairs_prefill": zeros, "pairs_decode": zeros, "kv_read": zeros, "samples": zeros,
           "tokens": np.asarray(tokens, dtype=np.float64)}
    moe = cost.block(seg, traffic, tokens_KD, slice_KLD, np.asarray(has_prefill_K, dtype=bool))["moe"]
    return {part: moe[:, :, COMPONENTS.index(part)] for part in PARTS}


def dp_steps(num_tokens: int, step_tokens: int, devices: int) -> np.ndarray:
    """int64[N] step of each token: the window of devices x step_tokens consecutive trace tokens it arrives in
    (each token is then served on its request's rank in that step)."""
    return np.arange(num_tokens, dtype=np.int64) // (step_tokens * devices)


def time_estimate(model: TimeModel, home_NL: np.ndarray, experts_NLk: np.ndarray, attention: str) -> dict[str, np.ndarray]:
    """{"dispatch", "experts", "combine"}: float64[L] seconds summed over the steps of serving the trace, and
    "steps": int, the number of steps. home_NL int[N, L] as `home_devices` returns it; experts_NLk int[N, L, k]
    (a memory-mapped trace array is read one block of steps at a time).
    """
    from repro.sim.traffic import batch_traffic

    num_tokens, num_layers = home_NL.shape
    devices = model.cost.devices
    if attention == "dp":
        step_N = dp_steps(num_tokens, model.step_tokens, devices)
    else:
        step_N = np.arange(num_tokens, dtype=np.int64) // model.step_tokens
    num_steps = int(step_N.max()) + 1 if num_tokens else 0
    order = np.argsort(step_N, kind="stable")
    bounds = np.searchsorted(step_N[order], np.arange(0, num_steps + STEPS_PER_BLOCK, STEPS_PER_BLOCK))
    totals = {part: np.zeros(num_layers) for part in PARTS}
    for first, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=False)):
        if start >= stop:
            continue
        rows = np.sort(order[start:stop])  # trace order inside the block: memmap reads stay sequential
        group = step_N[rows] - first * STEPS_PER_BLOCK
        num_k = int(group.max()) + 1
        home = np.asarray(home_NL[rows])
        traffic = batch_traffic(group, home, np.asarray(experts_NLk[rows]), model.slot_table,
                                model.slots_per_device, num_k, model.devices_per_node)
        tokens_KD = slices = None
        if attention == "dp":
            tokens_KD = np.bincount(group * devices + home[:, 0], minlength=num_k * devices).reshape(num_k, devices)
        else:
            key = (group[:, None] * num_layers + np.arange(num_layers)) * devices + home
            slices = np.bincount(key.ravel(), minlength=num_k * num_layers * devices).reshape(num_k, num_layers, devices)
        seconds = moe_layer_seconds(model.cost, traffic, tokens_KD, slices, np.ones(num_k, dtype=bool))
        for part in PARTS:
            totals[part] += seconds[part].sum(axis=0)
    return {**totals, "steps": num_steps}
