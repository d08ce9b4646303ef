"""What one engine iteration costs: all-to-all backends over link levels, and roofline compute.

All-to-all (per MoE layer and direction). From the exact copy counts of `traffic.batch_traffic`, each link level
(NVLink inside a node, RDMA across nodes) gets per-rank bytes sent and received and the number of peers each
rank talks to; a level's time is the busiest rank's max(sent, received) over the level's effective bandwidth
with the message-size ramp M / (M + P x M_half) (P messages of mean size M / P reach half the bandwidth at M_half
each), i.e. (bytes + P x M_half) / bandwidth. Levels run concurrently: time = latency + max over levels.
  nccl                a flat all-to-all of per-rank-deduplicated token copies (the evaluator's rule).
  deepep_normal       DeepEP's normal kernels: copies deduplicated per rank inside a node; across nodes a token
                      crosses RDMA once per destination node (to the GPU with its own local index) and is then
                      forwarded over NVLink (DeepEP `internode.cu`).
  deepep_low_latency  DeepEP's low-latency kernels: one message per (token, expert) activation, no dedup, each
                      straight to its rank (NVLink inside a node, RDMA across).
  deepep_auto         SGLang's `--deepep-mode auto`: low-latency for iterations without prefill tokens, normal
                      otherwise (one mode per iteration for all ranks).
A measured table (busiest rank's remote bytes -> seconds) replaces the formula for its backend and direction.

Compute (roofline, per rank): time = max(FLOPs / achievable FLOP/s, bytes / achievable HBM bandwidth, kernel
floor), the floor applying to each modelled kernel that has work (launch, ramp-up and tail of a small kernel).
Routed experts: per physical slot, its token count padded to the grouped-GEMM tile, weights read once if it has
a token; a rank's expert time is the sum over its slots (stragglers show); a measured table replaces it (and the
gate's roofline) where the profile has one for the shape. Attention: prefill by FLOPs (causal
pairs), decode by KV bytes read; projections as GEMMs. Shared experts, dense layers, gate and LM head likewise.

Legend: K iterations in a block, L MoE layers, D devices (ranks), M nodes, P physical slots, S segments (a
request's tokens in one iteration), N token rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from repro.errors import ConfigError
from repro.sim.hardware import Backend, Hardware, Phase, interpolate
from repro.sim.shapes import ModelShape, RoutingMap
from repro.sim.traffic import BatchTraffic

A2A_BACKENDS = ("nccl", "deepep_normal", "deepep_low_latency", "deepep_auto")
COMPONENTS = ("attention", "gate", "dispatch", "experts", "combine", "tp_collectives")


@dataclass(frozen=True)
class LevelLoad:
    """Per-rank load on the two link levels, in token copies (multiply by bytes per token).

    send/recv: int64[K, L, D] copies a rank sends / receives on the level; send_peers/recv_peers: int64[K, L, D]
    how many distinct ranks it sends to / receives from. nvlink and rdma each hold one such tuple; rdma is None in
    one node.
    """

    nvlink: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    rdma: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None


def _level(matrix_KLSD: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    active = matrix_KLSD > 0
    return (matrix_KLSD.sum(axis=3), matrix_KLSD.sum(axis=2), np.count_nonzero(active, axis=3),
            np.count_nonzero(active, axis=2))


def _flat_load(matrix_KLSD: np.ndarray, same_node_SD: np.ndarray) -> LevelLoad:
    """Split a flat off-diagonal source x destination count matrix into the two link levels."""
    nvlink = matrix_KLSD * (same_node_SD & ~np.eye(matrix_KLSD.shape[-1], dtype=bool))
    rdma = None if same_node_SD.all() else _level(matrix_KLSD * ~same_node_SD)
    return LevelLoad(_level(nvlink), rdma)


def _deepep_normal_load(traffic: BatchTraffic, devices_per_node: int) -> LevelLoad:
    """Link-level load of DeepEP's normal kernels (NVLink forwarding after one RDMA hop per destination node)."""
    copies = traffic.copies
    num_groups, num_layers, num_devices, _ = copies.shape
    same_node = _same_node(num_devices, devices_per_node)
    if traffic.node_copies is None:
        return _flat_load(copies, same_node)
    num_nodes = num_devices // devices_per_node
    # forwarder f = (node of d, local index of s) hands copies to d over NVLink unless f == d
    flow = copies.reshape(num_groups, num_layers, num_nodes, devices_per_node, num_nodes, devices_per_node).sum(axis=2)
    flow = flow * ~np.eye(devices_per_node, dtype=bool)[:, None, :]  # [K, L, lf, M, ld], zero where lf == ld
    send = flow.sum(axis=4).transpose(0, 1, 3, 2).reshape(num_groups, num_layers, num_devices)
    recv = flow.sum(axis=2).reshape(num_groups, num_layers, num_devices)
    send_peers = (flow > 0).sum(axis=4).transpose(0, 1, 3, 2).reshape(num_groups, num_layers, num_devices)
    recv_peers = (flow > 0).sum(axis=2).reshape(num_groups, num_layers, num_devices)
    # RDMA: s sends one copy per remote destination node to the forwarder with s's local index there
    node_of = np.arange(num_devices) // devices_per_node
    remote = traffic.node_copies * (node_of[:, None] != np.arange(num_nodes)[None, :])  # [K, L, S, M]
    by_source = remote.reshape(num_groups, num_layers, num_nodes, devices_per_node, num_nodes)  # [K, L, Ms, ls, M]
    rdma_recv = by_source.sum(axis=2).transpose(0, 1, 3, 2).reshape(num_groups, num_layers, num_devices)
    rdma_recv_peers = (by_source > 0).sum(axis=2).transpose(0, 1, 3, 2).reshape(num_groups, num_layers, num_devices)
    rdma = (remote.sum(axis=3), rdma_recv, (remote > 0).sum(axis=3), rdma_recv_peers)
    return LevelLoad((send, recv, send_peers, recv_peers), rdma)


def _same_node(num_devices: int, devices_per_node: int) -> np.ndarray:
    node = np.arange(num_devices) // devices_per_node
    return node[:, None] == node[None, :]


def level_loads(traffic: BatchTraffic, backend: str, devices_per_node: int) -> LevelLoad:
    """The per-rank link-level load of one backend's dispatch (combine mirrors it) for a counted block."""
    same_node = _same_node(traffic.copies.shape[-1], devices_per_node)
    if backend == "nccl":
        return _flat_load(traffic.copies, same_node)
    if backend == "deepep_low_latency":
        return _flat_load(traffic.activations, same_node)
    if backend == "deepep_normal":
        return _deepep_normal_load(traffic, devices_per_node)
    raise ConfigError(f"unknown all-to-all backend {backend!r}; choose one of {A2A_BACKENDS}.")


def phase_seconds(load: LevelLoad, phase: Phase, bytes_per_token: int) -> np.ndarray:
    """float64[K, L] seconds of one direction: latency + max over levels of the busiest rank's ramped transfer."""
    levels = [(load.nvlink, phase.nvlink_bandwidth)] + ([(load.rdma, phase.rdma_bandwidth)] if load.rdma else [])
    if phase.measured is not None:
        busiest = sum(np.maximum(level[0], level[1]) for level, _ in levels).max(axis=2)
        return interpolate(phase.measured, busiest * float(bytes_per_token))
    times = []
    for (send, recv, send_peers, recv_peers), bandwidth in levels:
        ramped = np.maximum(send * float(bytes_per_token) + send_peers * phase.peer_half_bytes,
                            recv * float(bytes_per_token) + recv_peers * phase.peer_half_bytes)
        busiest = ramped.max(axis=2)
        if bandwidth > 0:
            times.append(busiest / bandwidth)
        elif np.any(busiest > 0):
            raise ConfigError("a backend's rdma_gbps is 0 but the placement sends tokens across nodes; set it.")
    return phase.latency + (np.maximum.reduce(times) if times else 0.0)


def a2a_seconds(traffic: BatchTraffic, backend: Backend, hidden_size: int, devices_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """(dispatch float64[K, L], combine float64[K, L]) seconds of one backend for a counted block."""
    load = level_loads(traffic, backend.name, devices_per_node)
    dispatch_bytes, combine_bytes = backend.bytes_per_token(hidden_size)
    return phase_seconds(load, backend.dispatch, dispatch_bytes), phase_seconds(load, backend.combine, combine_bytes)


def ring_seconds(message_bytes: np.ndarray, devices: int, hardware: Hardware) -> np.ndarray:
    """A ring reduce-scatter or all-gather of `message_bytes` (the full buffer) over `devices` ranks."""
    if devices == 1:
        return np.zeros_like(message_bytes, dtype=np.float64)
    bandwidth = hardware.collective_nvlink if devices <= hardware.devices_per_node else hardware.collective_rdma
    return hardware.collective_latency + (devices - 1) / devices * message_bytes / bandwidth


def roofline(flops: np.ndarray, bytes_moved: np.ndarray, flop_rate: float, byte_rate: float) -> np.ndarray:
    return np.maximum(flops / flop_rate, bytes_moved / byte_rate)


def floored(seconds: np.ndarray, has_work: np.ndarray, floor: float) -> np.ndarray:
    """A kernel with work takes at least `floor`; one without work is not launched."""
    return np.where(has_work, np.maximum(seconds, floor), 0.0)


class CostModel:
    """Shape x hardware constants, and the cost of one block of iterations (see `block`)."""

    def __init__(self, shape: ModelShape, hardware: Hardware, mapping: RoutingMap, devices: int, attention_mode: str,
                 backend: str):
        if backend not in A2A_BACKENDS:
            raise ConfigError(f"sim.backend must be one of {A2A_BACKENDS}, got {backend!r}.")
        self.shape, self.hw, self.map = shape, hardware, mapping
        self.devices, self.mode, self.backend = devices, attention_mode, backend
        h, b = shape.hidden_size, shape.dtype_bytes
        self.attn_params = shape.attention_params()
        self.kv_bytes = shape.kv_bytes_per_token_layer()
        self.expert_params = 3 * h * mapping.expert_intermediate
        self.shared_params = 3 * h * shape.shared_intermediate_size
        self.dense_params = 3 * h * shape.intermediate_size
        self.gate_params = h * mapping.num_experts
        self.head_params = h * shape.vocab_size
        self.expert_table = hardware.measured_expert_gemm.get(shape.name)
        self.gate_table = hardware.measured_gate.get(shape.name)
        if attention_mode == "tp":
            a = shape.attention
            # heads split over the TP ranks; GQA KV heads too (down to one per rank), MLA's latent is read whole
            self.tp_kv_split = min(devices, a["num_kv_heads"]) if a["kind"] == "gqa" else 1
        self.bytes_el = b

    def _gemm(self, tokens: np.ndarray, params: int) -> np.ndarray:
        """A dense GEMM over `tokens` rows with `params` weights (weights read once when there is a row)."""
        if params == 0:
            return np.zeros(tokens.shape)
        flops = 2.0 * params * tokens
        moved = (tokens > 0) * params * self.bytes_el + 2.0 * tokens * self.shape.hidden_size * self.bytes_el
        return floored(roofline(flops, moved, self.hw.gemm_flops, self.hw.memory_bandwidth), tokens > 0,
                       self.hw.kernel_floor)

    def gate(self, tokens: np.ndarray) -> np.ndarray:
        """Seconds of the router (gate GEMM + top-k softmax) over `tokens` rows on one rank (any shape): the
        measured table of this shape where the profile has one (on a CPU the top-k costs more than the GEMM's
        roofline), else the GEMM's roofline."""
        if self.gate_table is None:
            return self._gemm(tokens, self.gate_params)
        tokens = np.asarray(tokens, dtype=np.float64)
        return np.where(tokens > 0, interpolate(self.gate_table, tokens), 0.0)

    def experts(self, slot_tokens_KLP: np.ndarray) -> np.ndarray:
        """float64[K, L, D] routed grouped-GEMM seconds per rank (sum over its slots)."""
        n = slot_tokens_KLP.astype(np.float64)
        if self.expert_table is not None:
            per_slot = np.where(n > 0, interpolate(self.expert_table, n), 0.0)
        else:
            tile = self.hw.gemm_tile_tokens
            padded = np.ceil(n / tile) * tile
            flops = 2.0 * self.expert_params * padded
            moved = (n > 0) * self.expert_params * self.bytes_el + 2.0 * n * self.shape.hidden_size * self.bytes_el
            per_slot = roofline(flops, moved, self.hw.gemm_flops, self.hw.memory_bandwidth)
        k, layers, slots = per_slot.shape
        per_rank = per_slot.reshape(k, layers, self.devices, slots // self.devices).sum(axis=3)
        return floored(per_rank, per_rank > 0, self.hw.kernel_floor)

    def attention(self, pairs_prefill, pairs_decode, kv_read, tokens) -> np.ndarray:
        """Seconds of one attention block per (iteration, rank) from summed causal pairs, KV tokens read, tokens."""
        s = self.shape
        flops = pairs_prefill * s.attention_flops_per_pair(False) + pairs_decode * s.attention_flops_per_pair(True)
        moved = (kv_read + tokens) * self.kv_bytes
        if self.mode == "tp":
            flops, moved = flops / self.devices, moved / self.tp_kv_split
            proj = self._gemm(tokens, self.attn_params // self.devices)
        else:
            proj = self._gemm(tokens, self.attn_params)
        core = floored(roofline(flops, moved, self.hw.attention_flops, self.hw.memory_bandwidth), tokens > 0,
                       self.hw.kernel_floor)
        return core + proj

    def block(self, seg: dict, traffic: BatchTraffic, tokens_KD: np.ndarray, slice_KLD: np.ndarray | None,
              has_prefill_K: np.ndarray) -> dict:
        """Cost of K iterations.

        seg: per-(iteration, attention rank) sums float64[K, R]: pairs_prefill, pairs_decode, kv_read, tokens,
            samples (R = D ranks in DP, 1 group in TP).
        tokens_KD: int[K, D] tokens living on each rank before the MoE layers (DP: its batch; TP: unused).
        slice_KLD: int[K, L, D] TP reduce-scatter slice sizes per layer (None in DP).
        has_prefill_K: bool[K] whether an iteration holds prefill tokens (deepep_auto picks the mode from it).
        Returns {"total": float64[K], "dense": float64[K], "head": float64[K], "moe": float64[K, L, C]} with the
        MoE-layer components in COMPONENTS order (seconds on the critical path).
        """
        s, hw, d = self.shape, self.hw, self.devices
        attn_KR = self.attention(seg["pairs_prefill"], seg["pairs_decode"], seg["kv_read"], seg["tokens"])
        num_k, num_layers = traffic.slot_tokens.shape[:2]
        moe = np.zeros((num_k, num_layers, len(COMPONENTS)))
        dispatch, combine = self._a2a(traffic, has_prefill_K)
        routed_KLD = self.experts(traffic.slot_tokens)
        if self.mode == "dp":
            gate_KD = self.gate(tokens_KD)
            attention = attn_KR.max(axis=1)
            moe[:, :, 0] = attention[:, None]
            moe[:, :, 1] = ((attn_KR + gate_KD).max(axis=1) - attention)[:, None]
            moe[:, :, 3] = (routed_KLD + self._gemm(tokens_KD, self.shared_params)[:, None, :]).max(axis=2)
            dense = s.first_dense_layers * (attn_KR + self._gemm(tokens_KD, self.dense_params)).max(axis=1)
            head = self._gemm(seg["samples"], self.head_params).max(axis=1)
        else:
            total_tokens = seg["tokens"][:, 0]
            half = ring_seconds(total_tokens * s.hidden_size * self.bytes_el, d, hw)  # one reduce-scatter or all-gather
            attention = attn_KR[:, 0]
            moe[:, :, 0] = attention[:, None]
            moe[:, :, 1] = self.gate(slice_KLD).max(axis=2)
            moe[:, :, 3] = (routed_KLD + self._gemm(slice_KLD, self.shared_params)).max(axis=2)
            moe[:, :, 5] = (2 * half)[:, None]  # reduce-scatter into the slices, all-gather back for attention
            mlp = self._gemm(total_tokens, self.dense_params // d)
            dense = s.first_dense_layers * (attention + mlp + 4 * half)  # two all-reduces per dense layer
            head = self._gemm(seg["samples"][:, 0], self.head_params // d)
        moe[:, :, 2], moe[:, :, 4] = dispatch, combine
        moe_time = moe.sum(axis=2)
        total = dense + self.map.layer_weight * moe_time.sum(axis=1) + head
        return {"total": total, "dense": dense, "head": head, "moe": moe}

    def _a2a(self, traffic: BatchTraffic, has_prefill_K: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hidden, dpn = self.shape.hidden_size, self.hw.devices_per_node
        if self.backend != "deepep_auto":
            return a2a_seconds(traffic, self.hw.backends[self.backend], hidden, dpn)
        if has_prefill_K.all() or not has_prefill_K.any():
            mode = "deepep_normal" if has_prefill_K.all() else "deepep_low_latency"
            return a2a_seconds(traffic, self.hw.backends[mode], hidden, dpn)
        normal = a2a_seconds(traffic, self.hw.backends["deepep_normal"], hidden, dpn)
        low = a2a_seconds(traffic, self.hw.backends["deepep_low_latency"], hidden, dpn)
        pick = has_prefill_K[:, None]
        return np.where(pick, normal[0], low[0]), np.where(pick, normal[1], low[1])
