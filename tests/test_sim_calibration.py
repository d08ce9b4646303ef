"""The all-to-all model against published measurements (../shared/reference/simulators.md), within 15 %.

- NCCL all-to-all on 8 x H100 (APEX+ `profile/comm/H100-SXM-80GB/alltoall.csv`, nccl-tests sizes = the whole
  per-rank buffer, split evenly over the 8 ranks, one share staying local): every size from 1 KiB to 256 MiB.
- DeepEP normal kernels on H800 (DeepEP docs/legacy.md): bottleneck bandwidths of EP8 (NVLink) and EP16/32/64
  (RDMA), counted the way DeepEP's tests count them (received copies including the rank's own for NVLink;
  copies per destination node including its own node for RDMA), on DeepEP's test routing (4096 tokens per rank,
  hidden 7168, top-8 of 256 experts, node-limited to min(nodes, 4) groups, FP8 dispatch, BF16 combine).
- DeepEP low-latency kernels on H800: latencies of EP8 to EP256 (128 tokens per rank, top-8, FP8 dispatch with
  a 16-byte header per message, BF16 combine).
The routing is pushed through the same counting (`batch_traffic`) and pricing (`a2a_seconds`) the engine uses.

Legend: T tokens per rank, D ranks, E experts, k experts per token, M nodes.
"""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from repro.sim.costs import LevelLoad, a2a_seconds, phase_seconds
from repro.sim.hardware import load_hardware
from repro.sim.traffic import batch_traffic, dispatch_slots
from repro.systems.ep import contiguous_placement

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.15
HIDDEN = 7168
FP8_DISPATCH_BYTES = int(HIDDEN * (1 + 4 / 128))  # DeepEP tests: fp8 values + one fp32 scale per 128
BF16_BYTES = 2 * HIDDEN

# APEX+ H100-SXM-80GB alltoall.csv, 8 GPUs, dtype half (256 MiB from the float rows): size KiB -> time us
NCCL_H100_8 = {1: 15, 16: 15, 64: 15, 256: 15, 512: 15, 1024: 18, 2048: 22, 4096: 26, 8192: 41, 16384: 69,
               32768: 121, 65536: 216, 131072: 401, 262144: 797}
# DeepEP docs/legacy.md (H800, CX7 400 Gb/s): EP -> (dispatch GB/s, combine GB/s)
DEEPEP_NORMAL = {8: (153, 158), 16: (43, 43), 32: (58, 57), 64: (51, 50)}
DEEPEP_LOW_LATENCY_US = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369),
                         256: (194, 360)}


def profile(name: str, nodes: int | None = None):
    cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "hardware" / f"{name}.yaml"), resolve=True)
    if nodes is not None:
        cfg["nodes"] = nodes
    return load_hardware(cfg)


def uniform_load(size_bytes: float, devices: int) -> LevelLoad:
    """Every rank sends size/devices bytes to each other rank (nccl-tests alltoall), all on NVLink."""
    share = size_bytes / devices
    per_rank = np.full((1, 1, devices), share * (devices - 1))
    peers = np.full((1, 1, devices), devices - 1)
    zero = np.zeros((1, 1, devices))
    return LevelLoad((per_rank, per_rank, peers, peers), (zero, zero, zero, zero))


def deepep_routing(rng, tokens: int, devices: int, num_experts: int = 256, top_k: int = 8, devices_per_node: int = 8):
    """int16[D * T, 1, k] DeepEP's test routing: |N(0,1)| + 1 scores, top-k within the min(M, 4) best node groups."""
    nodes = max(1, devices // devices_per_node)
    scores = np.abs(rng.standard_normal((devices * tokens, num_experts))) + 1
    if nodes > 1:
        group_scores = scores.reshape(len(scores), nodes, -1).max(axis=2)
        keep = np.argsort(-group_scores, axis=1)[:, : min(nodes, 4)]
        mask = np.zeros((len(scores), nodes), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        scores = np.where(np.repeat(mask, num_experts // nodes, axis=1), scores, 0.0)
    return np.argsort(-scores, axis=1)[:, :top_k].astype(np.int16)[:, None, :]


def count(experts, devices: int, tokens: int, num_experts: int = 256, devices_per_node: int = 8):
    placement = contiguous_placement(1, num_experts, devices)
    home = np.repeat(np.arange(devices), tokens)[:, None]
    return batch_traffic(np.zeros(len(home), dtype=np.int64), home, experts, dispatch_slots(placement),
                         placement.slots_per_device, 1, devices_per_node)


@pytest.mark.parametrize("size_kib", sorted(NCCL_H100_8))
def test_nccl_h100_curve(size_kib):
    phase = profile("h100").backends["nccl"].dispatch
    seconds = float(phase_seconds(uniform_load(size_kib * 1024, 8), phase, 1)[0, 0])
    measured = NCCL_H100_8[size_kib] * 1e-6
    assert abs(seconds / measured - 1) <= TOLERANCE, (size_kib, seconds * 1e6, measured * 1e6)


@pytest.mark.parametrize("devices", sorted(DEEPEP_NORMAL))
def test_deepep_normal_bandwidths(devices):
    rng = np.random.default_rng(devices)
    tokens = 1024  # per rank; DeepEP uses 4096, bandwidths are per byte and the routing is i.i.d. per token
    hw = profile("h800_deepep", nodes=max(1, devices // 8))
    backend = hw.backends["deepep_normal"]
    experts = deepep_routing(rng, tokens, devices)
    traffic = count(experts, devices, tokens)
    bpt = {"dispatch": FP8_DISPATCH_BYTES, "combine": BF16_BYTES}
    deepep_test = replace(backend, dispatch_bytes_per_element=1 + 4 / 128, combine_bytes_per_element=2.0,
                          token_header_bytes=0)
    dispatch_s, combine_s = (float(t[0, 0]) for t in a2a_seconds(traffic, deepep_test, HIDDEN, 8))
    if devices == 8:  # NVLink: received copies per rank, the rank's own included
        counted = traffic.copies[0, 0].sum(axis=0).mean()
    else:  # RDMA: copies per destination node, the own node included
        counted = traffic.node_copies[0, 0].sum(axis=1).mean()
    published = DEEPEP_NORMAL[devices]
    for seconds, bytes_per_token, expected in ((dispatch_s, bpt["dispatch"], published[0]),
                                               (combine_s, bpt["combine"], published[1])):
        bandwidth = counted * bytes_per_token / seconds / 1e9
        assert abs(bandwidth / expected - 1) <= TOLERANCE, (devices, bandwidth, expected)


@pytest.mark.parametrize("devices", sorted(DEEPEP_LOW_LATENCY_US))
def test_deepep_low_latency_latencies(devices):
    rng = np.random.default_rng(devices)
    tokens = 128
    hw = profile("h800_deepep", nodes=max(1, devices // 8))
    backend = hw.backends["deepep_low_latency"]
    # the low-latency test routes each token to its top-8 of random scores over 256 experts (no node limit)
    experts = np.argsort(-rng.random((devices * tokens, 256)), axis=1)[:, :8].astype(np.int16)[:, None, :]
    traffic = count(experts, devices, tokens)
    dispatch_s, combine_s = (float(t[0, 0]) for t in a2a_seconds(traffic, backend, HIDDEN, 8))
    for seconds, expected in zip((dispatch_s, combine_s), DEEPEP_LOW_LATENCY_US[devices], strict=True):
        assert abs(seconds / (expected * 1e-6) - 1) <= TOLERANCE, (devices, seconds * 1e6, expected)
