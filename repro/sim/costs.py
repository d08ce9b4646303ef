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

import numba
import numpy as np

from repro.counting import count_rows_at
from repro.errors import ConfigError
from repro.sim.hardware import Backend, Hardware, Phase, interpolate
from repro.sim.shapes import ModelShape, RoutingMap
from repro.sim.traffic import BatchTraffic

A2A_BACKENDS = ("nccl", "deepep_normal", "deepep_low_latency", "deepep_auto")
SEG_KEYS = ("pairs_prefill", "pairs_decode", "kv_read", "tokens", "samples")  # CostModel.block's seg, in price_arrays' order
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
        self._compiled = self._compiled_inputs()

    def _compiled_inputs(self) -> dict | None:
        """What `price` hands the compiled kernels: the constants as float64 (every integer in them is exact), the
        tables, the backends' phases; None where `price` must fall back to `block` (a measured table whose sizes
        repeat: np.interp's tie rule is not reproduced)."""
        s, hw, d, tp = self.shape, self.hw, self.devices, self.mode == "tp"
        c = np.zeros(_C_COUNT)
        c[_C_BYTES_EL], c[_C_HIDDEN], c[_C_FLOOR] = self.bytes_el, s.hidden_size, hw.kernel_floor
        c[_C_GEMM_FLOPS], c[_C_MEM_BW], c[_C_ATTN_FLOPS] = hw.gemm_flops, hw.memory_bandwidth, hw.attention_flops
        c[_C_PAIR_PREFILL] = s.attention_flops_per_pair(False)
        c[_C_PAIR_DECODE] = s.attention_flops_per_pair(True)
        c[_C_KV_BYTES], c[_C_TP_KV_SPLIT] = self.kv_bytes, self.tp_kv_split if tp else 1
        c[_C_ATTN_PARAMS] = self.attn_params // d if tp else self.attn_params
        c[_C_EXPERT_PARAMS], c[_C_SHARED_PARAMS] = self.expert_params, self.shared_params
        c[_C_DENSE_PARAMS] = self.dense_params // d if tp else self.dense_params
        c[_C_HEAD_PARAMS] = self.head_params // d if tp else self.head_params
        c[_C_GATE_PARAMS], c[_C_FIRST_DENSE], c[_C_LAYER_WEIGHT] = self.gate_params, s.first_dense_layers, self.map.layer_weight
        c[_C_TILE], c[_C_COLL_LATENCY], c[_C_DEVICES] = hw.gemm_tile_tokens, hw.collective_latency, d
        c[_C_COLL_BW] = hw.collective_nvlink if d <= hw.devices_per_node else hw.collective_rdma
        if any(float(v) != v or abs(v) >= 2**53 for v in (self.attn_params, self.expert_params, self.shared_params,
                                                          self.dense_params, self.gate_params, self.head_params)):
            return None
        names = ("deepep_normal", "deepep_low_latency") if self.backend == "deepep_auto" else (self.backend, self.backend)
        tables = [self.expert_table, self.gate_table]
        phase_params = np.zeros((2, 2, 4))
        phase_bytes = np.zeros((2, 2))
        measured = []
        for b, name in enumerate(names):
            backend = hw.backends[name]
            phase_bytes[b] = backend.bytes_per_token(s.hidden_size)
            for direction, phase in enumerate((backend.dispatch, backend.combine)):
                phase_params[b, direction] = (phase.latency, phase.peer_half_bytes, phase.nvlink_bandwidth,
                                              phase.rdma_bandwidth)
                measured.append(_NO_TABLE if phase.measured is None else np.ascontiguousarray(phase.measured, np.float64))
                tables.append(phase.measured)
        if any(t is not None and not np.all(np.diff(np.asarray(t)[:, 0]) > 0) for t in tables):
            return None
        node = np.arange(d) // hw.devices_per_node
        expert_table = _NO_TABLE if self.expert_table is None else np.ascontiguousarray(self.expert_table, np.float64)
        return {
            "c": c, "kinds": np.array([_BACKEND_KIND[names[0]], 3 + _BACKEND_KIND[names[1]]], dtype=np.int64),
            "expert_table": expert_table, "slot_seconds": _slot_seconds_table(_SLOT_SECONDS, c, expert_table),
            "gate_table": _NO_TABLE if self.gate_table is None else np.ascontiguousarray(self.gate_table, np.float64),
            "phase_params": phase_params, "phase_bytes": phase_bytes, "measured": measured,
            "node": node.astype(np.int64), "one_node": bool(node.max() == 0), "nodes": d // hw.devices_per_node,
        }

    def price(self, seg: dict, traffic: BatchTraffic, tokens_KD: np.ndarray | None, slice_KLD: np.ndarray | None,
              has_prefill_K: np.ndarray) -> dict:
        """`block`, bit for bit, in compiled code (same arguments and result). Falls back to `block` where the
        kernels do not reproduce it (see `_compiled_inputs`) and to raise its errors."""
        seg5 = np.stack([np.asarray(seg[key], dtype=np.float64) for key in SEG_KEYS])
        priced = self.price_arrays(seg5, traffic, slice_KLD, has_prefill_K)
        if priced is None:
            return self.block(seg, traffic, tokens_KD, slice_KLD, has_prefill_K)
        return dict(zip(("total", "dense", "head", "moe"), priced, strict=True))

    def price_arrays(self, seg5: np.ndarray, traffic: BatchTraffic, slice_KLD: np.ndarray | None,
                     has_prefill_K: np.ndarray) -> tuple | None:
        """`price` for the engine: seg5 float64[5, K, R] the seg entries in SEG_KEYS order (DP: tokens are
        tokens_KD). Returns (total, dense, head, moe), or None where `block` must price the block instead."""
        inputs = self._compiled
        node_copies = traffic.node_copies
        if inputs is None or (node_copies is not None and node_copies.shape[3] != inputs["nodes"]):
            return None
        num_k, num_layers = traffic.slot_tokens.shape[:2]
        if node_copies is None:
            node_copies = np.zeros(traffic.copies.shape[:3] + (0,), dtype=np.int64)
        kinds = inputs["kinds"]
        if self.backend == "deepep_auto":
            kinds_K = np.where(np.asarray(has_prefill_K, dtype=bool), kinds[0], kinds[1])
        else:
            kinds_K = np.full(num_k, kinds[0], dtype=np.int64)
        total, dense, head = np.empty(num_k), np.empty(num_k), np.empty(num_k)
        moe = np.empty((num_k, num_layers, len(COMPONENTS)))
        slices = np.ascontiguousarray(slice_KLD, dtype=np.int64) if self.mode == "tp" else _NO_SLICES
        m = inputs["measured"]
        ok = _price_all(self.mode == "tp", np.ascontiguousarray(seg5, dtype=np.float64), slices,
                        np.ascontiguousarray(traffic.slot_tokens, dtype=np.int64), traffic.activations, traffic.copies,
                        node_copies, kinds_K, inputs["node"], inputs["one_node"], self.hw.devices_per_node,
                        inputs["phase_params"], inputs["phase_bytes"], m[0], m[1], m[2], m[3], inputs["c"],
                        inputs["expert_table"], inputs["slot_seconds"], inputs["gate_table"], total, dense, head, moe)
        return (total, dense, head, moe) if ok else None

    def count_and_price(self, rows_N: np.ndarray, group_N: np.ndarray, home_NL: np.ndarray, experts_RLk: np.ndarray,
                        slot_table_LDE: np.ndarray, device_tables: tuple[np.ndarray, np.ndarray], slots_per_device: int,
                        devices_per_node: int, seg5: np.ndarray, slice_KLD: np.ndarray | None, has_prefill_K: np.ndarray,
                        counted: tuple | None = None) -> tuple | None:
        """The engine's block in one compiled call: `traffic.stream_traffic` then `price_arrays`, iteration by
        iteration (the same integers, the same floats). rows_N, group_N int64[N] and home_NL int[N, L] as
        stream_traffic takes them (group_N in [0, K)), seg5 and slice_KLD as price_arrays. Returns (total
        float64[K], moe float64[K, L, C], stats int64[K, 3] as stream_traffic's), or None where the caller must
        take the two-step path (which prices with `block` or raises the error). counted: (counts int32[C, L, W],
        stats int64[C, 3], slots int64[S], homes int64[S], stream int64[...], and per prompt to count first:
        start, length, home, slot int64[S']): whole prompts kept by the engine and added to iteration 0 (see
        `_count_price`; W = 2 D + M + P with M = 0 in one node)."""
        inputs = self._compiled
        num_devices = slot_table_LDE.shape[1]
        num_nodes = -(-num_devices // devices_per_node)
        if inputs is None or (num_nodes > 1 and num_nodes != inputs["nodes"]) or num_devices != self.devices:
            return None
        num_k, num_layers = len(has_prefill_K), slot_table_LDE.shape[0]
        kinds = inputs["kinds"]
        if self.backend == "deepep_auto":
            kinds_K = np.where(np.asarray(has_prefill_K, dtype=bool), kinds[0], kinds[1])
        else:
            kinds_K = np.full(num_k, kinds[0], dtype=np.int64)
        total = np.empty(num_k)
        moe = np.empty((num_k, num_layers, len(COMPONENTS)))
        stats = np.zeros((num_k, 3), dtype=np.int64)
        slices = np.ascontiguousarray(slice_KLD, dtype=np.int64) if self.mode == "tp" else \
            np.zeros((num_k, 0, 0), dtype=np.int64)
        m = inputs["measured"]
        if counted is None:
            counted = (_NO_COUNTS, _NO_COUNT_STATS, _NO_HITS, _NO_HITS, _NO_HITS, _NO_HITS, _NO_HITS, _NO_HITS,
                       _NO_HITS)
        status = _count_price(rows_N, group_N, home_NL, experts_RLk, slot_table_LDE, device_tables[0], device_tables[1],
                              num_devices * slots_per_device, devices_per_node, num_nodes, self.mode == "tp", np.ascontiguousarray(seg5, np.float64),
                              slices, kinds_K, inputs["node"], inputs["one_node"], self.hw.devices_per_node,
                              inputs["phase_params"], inputs["phase_bytes"], m[0], m[1], m[2], m[3], inputs["c"],
                              inputs["expert_table"], inputs["slot_seconds"], inputs["gate_table"], *counted, total,
                              moe, stats)
        return (total, moe, stats) if status == 0 else None

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


# ---- the compiled pricing of one block (the engine's hot path) ---------------------------------------------------
#
# `CostModel.price` computes what `CostModel.block` computes, bit for bit, in one compiled call instead of ~60 numpy
# calls on small arrays (the simulator priced ~7k blocks of a few iterations per second of light load, almost all of
# it numpy call overhead). Every float operation is written in `block`'s order: elementwise expressions as numpy
# evaluates them left to right, maxima in any order (exact), and the two float sums numpy takes over a contiguous
# axis (a rank's slots in `experts`, the MoE layers in the total) with numpy's own pairwise summation
# (`_pairwise_sum`). tests/test_sim_speed.py checks `price` against `block` and whole runs against the old engine.

_BACKEND_KIND = {"nccl": 0, "deepep_normal": 1, "deepep_low_latency": 2}
_NO_TABLE = np.zeros((0, 2))
_NO_SLICES = np.zeros((0, 0, 0), dtype=np.int64)
_NO_COUNTS = np.zeros((0, 0, 0), dtype=np.int32)
_NO_COUNT_STATS = np.zeros((0, 3), dtype=np.int64)
_NO_HITS = np.zeros(0, dtype=np.int64)
_SLOT_SECONDS = 4096  # per-slot expert seconds looked up below this many tokens (32 KiB per CostModel)
# indices into the float64 constants vector `CostModel._consts` (all integers in it are exact in float64)
(_C_BYTES_EL, _C_HIDDEN, _C_FLOOR, _C_GEMM_FLOPS, _C_MEM_BW, _C_ATTN_FLOPS, _C_PAIR_PREFILL, _C_PAIR_DECODE,
 _C_KV_BYTES, _C_TP_KV_SPLIT, _C_ATTN_PARAMS, _C_EXPERT_PARAMS, _C_SHARED_PARAMS, _C_DENSE_PARAMS, _C_GATE_PARAMS,
 _C_HEAD_PARAMS, _C_FIRST_DENSE, _C_LAYER_WEIGHT, _C_TILE, _C_COLL_LATENCY, _C_COLL_BW, _C_DEVICES,
 _C_COUNT) = range(23)


@numba.njit(cache=True, nogil=True, inline="always")
def _pairwise_block(a, lo, n):  # pragma: no cover (compiled)
    """numpy's pairwise_sum of float64 for n <= 128 (8 accumulators, combined as a tree, then the tail)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            res += a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - (n % 8):
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@numba.njit(cache=True, nogil=True)
def _pairwise_sum(a, lo, n):  # pragma: no cover (compiled)
    """numpy's float64 add.reduce over a contiguous run a[lo:lo + n]: 0.0 + pairwise_sum (numpy's loops: blocks of
    up to 128 summed by `_pairwise_block`, longer runs split in two at a multiple of 8 and the halves added). The
    split is walked with an explicit stack (a recursive compiled function does not survive numba's cache)."""
    if n <= 128:
        return 0.0 + _pairwise_block(a, lo, n)
    seg_lo = np.empty(128, dtype=np.int64)
    seg_n = np.empty(128, dtype=np.int64)
    seg_joined = np.zeros(128, dtype=np.bool_)
    values = np.empty(128)
    top, vtop = 1, 0
    seg_lo[0], seg_n[0] = lo, n
    while top > 0:
        t = top - 1
        if seg_n[t] <= 128:
            values[vtop] = _pairwise_block(a, seg_lo[t], seg_n[t])
            vtop += 1
            top -= 1
        elif seg_joined[t]:
            values[vtop - 2] = values[vtop - 2] + values[vtop - 1]
            vtop -= 1
            top -= 1
        else:
            half = seg_n[t] // 2
            half -= half % 8
            seg_joined[t] = True
            seg_lo[t + 1], seg_n[t + 1], seg_joined[t + 1] = seg_lo[t] + half, seg_n[t] - half, False  # right, after
            seg_lo[t + 2], seg_n[t + 2], seg_joined[t + 2] = seg_lo[t], half, False  # left, first
            top += 2
    return 0.0 + values[0]


@numba.njit(cache=True, nogil=True, inline="always")
def _interpolate(table, x):  # pragma: no cover (compiled)
    """hardware.interpolate at one point (np.interp's rule; the table's sizes strictly increase, see `price`)."""
    n = table.shape[0]
    last = table[n - 1, 0]
    if x > last:
        slope = (table[n - 1, 1] - table[n - 2, 1]) / max(last - table[n - 2, 0], 1e-30)
        return table[n - 1, 1] + (x - last) * slope
    if x < table[0, 0]:
        return table[0, 1]
    lo, hi = 0, n - 1  # the last j with table[j, 0] <= x
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if table[mid, 0] <= x:
            lo = mid
        else:
            hi = mid
    j = hi if table[hi, 0] <= x else lo
    if j == n - 1 or table[j, 0] == x:
        return table[j, 1]
    slope = (table[j + 1, 1] - table[j, 1]) / (table[j + 1, 0] - table[j, 0])
    y = slope * (x - table[j, 0]) + table[j, 1]
    if np.isnan(y):
        y = slope * (x - table[j + 1, 0]) + table[j + 1, 1]
        if np.isnan(y) and table[j, 1] == table[j + 1, 1]:
            y = table[j, 1]
    return y


@numba.njit(cache=True, nogil=True, inline="always")
def _gemm1(tokens, params, c):  # pragma: no cover (compiled)
    """CostModel._gemm at one point."""
    if params == 0.0:
        return 0.0
    weights = params * c[_C_BYTES_EL] if tokens > 0 else 0.0
    flops = (2.0 * params) * tokens
    moved = weights + ((2.0 * tokens) * c[_C_HIDDEN]) * c[_C_BYTES_EL]
    seconds = max(flops / c[_C_GEMM_FLOPS], moved / c[_C_MEM_BW])
    return max(seconds, c[_C_FLOOR]) if tokens > 0 else 0.0


@numba.njit(cache=True, nogil=True, inline="always")
def _gate1(tokens, c, gate_table):  # pragma: no cover (compiled)
    """CostModel.gate at one point."""
    if gate_table.shape[0] == 0:
        return _gemm1(tokens, c[_C_GATE_PARAMS], c)
    return _interpolate(gate_table, tokens) if tokens > 0 else 0.0


@numba.njit(cache=True, nogil=True, inline="always")
def _flat_loads(m, node, out):  # pragma: no cover (compiled)
    """_flat_load for one (iteration, layer): out int64[2 levels, 4, D] (send, recv, send_peers, recv_peers) of the
    count matrix m[S, D] split by node[D] into NVLink (same node, off-diagonal) and RDMA (across nodes)."""
    num = m.shape[0]
    for r in range(num):  # rank r as sender (row r) and as receiver (column r), accumulated in registers
        send_nv = send_rd = recv_nv = recv_rd = 0
        speers_nv = speers_rd = rpeers_nv = rpeers_rd = 0
        for o in range(num):
            if o == r:
                continue
            v = m[r, o]
            w = m[o, r]
            if node[r] == node[o]:
                send_nv += v
                speers_nv += v > 0
                recv_nv += w
                rpeers_nv += w > 0
            else:
                send_rd += v
                speers_rd += v > 0
                recv_rd += w
                rpeers_rd += w > 0
        out[0, 0, r], out[0, 1, r], out[0, 2, r], out[0, 3, r] = send_nv, recv_nv, speers_nv, rpeers_nv
        out[1, 0, r], out[1, 1, r], out[1, 2, r], out[1, 3, r] = send_rd, recv_rd, speers_rd, rpeers_rd


@numba.njit(cache=True, nogil=True, inline="always")
def _normal_loads(copies, node_copies, dpn, out):  # pragma: no cover (compiled)
    """_deepep_normal_load across nodes for one (iteration, layer): out int64[2 levels, 4, D] (send, recv,
    send_peers, recv_peers) per level, NVLink forwarding then RDMA."""
    num = copies.shape[0]
    nodes = num // dpn
    out[:] = 0
    for lf in range(dpn):
        for md in range(nodes):
            for ld in range(dpn):
                if lf == ld:
                    continue
                flow = 0
                for ms in range(nodes):
                    flow += copies[ms * dpn + lf, md * dpn + ld]
                out[0, 0, md * dpn + lf] += flow
                out[0, 1, md * dpn + ld] += flow
                out[0, 2, md * dpn + lf] += flow > 0
                out[0, 3, md * dpn + ld] += flow > 0
    for s in range(num):
        for m in range(nodes):
            if s // dpn == m:
                continue
            v = node_copies[s, m]
            out[1, 0, s] += v
            out[1, 2, s] += v > 0
            out[1, 1, m * dpn + s % dpn] += v
            out[1, 3, m * dpn + s % dpn] += v > 0


@numba.njit(cache=True, nogil=True, inline="always")
def _loads_seconds(loads, bytes_per_token, params, measured):  # pragma: no cover (compiled)
    """phase_seconds from explicit per-rank loads[levels, 4, D] (see _normal_loads); NaN flags a missing rdma."""
    levels, _, num = loads.shape
    if measured.shape[0] > 0:
        busiest = 0
        for r in range(num):
            total = 0
            for v in range(levels):
                total += max(loads[v, 0, r], loads[v, 1, r])
            busiest = max(busiest, total)
        return _interpolate(measured, busiest * bytes_per_token)
    time = 0.0
    for v in range(levels):
        busiest = 0.0
        for r in range(num):
            busiest = max(busiest, max(loads[v, 0, r] * bytes_per_token + loads[v, 2, r] * params[1],
                                       loads[v, 1, r] * bytes_per_token + loads[v, 3, r] * params[1]))
        bandwidth = params[2 + v]
        if bandwidth > 0:
            time = max(time, busiest / bandwidth)
        elif busiest > 0:
            return np.nan
    return params[0] + time


@numba.njit(cache=True, nogil=True)
def _a2a_block(activations, copies, node_copies, kinds_K, node, one_node, dpn, phase_params, phase_bytes,
               measured_0d, measured_0c, measured_1d, measured_1c, dispatch_KL, combine_KL):  # pragma: no cover
    """Dispatch and combine seconds per (iteration, layer); kinds_K[k] the backend kind of iteration k (0 nccl,
    1 deepep_normal, 2 deepep_low_latency) plus 3 where deepep_auto picked its low-latency backend (the second
    of the two priced, phase_params[1]). node[D] each rank's node (hardware's devices_per_node), one_node when all
    share one (then there is no rdma level). Returns False where a rank sends across nodes without rdma
    bandwidth (`block` raises there)."""
    num_k, num_layers, num = copies.shape[0], copies.shape[1], copies.shape[2]
    loads = np.zeros((2, 4, num), dtype=np.int64)
    levels = 1 if one_node else 2
    for k in range(num_k):
        kind = kinds_K[k] % 3
        b = kinds_K[k] // 3
        md = measured_0d if b == 0 else measured_1d
        mc = measured_0c if b == 0 else measured_1c
        for layer in range(num_layers):
            if kind == 1 and node_copies.shape[3] > 0:
                _normal_loads(copies[k, layer], node_copies[k, layer], dpn, loads)
                used = loads
            else:
                _flat_loads(activations[k, layer] if kind == 2 else copies[k, layer], node, loads)
                used = loads[:levels]
            d = _loads_seconds(used, phase_bytes[b, 0], phase_params[b, 0], md)
            c = _loads_seconds(used, phase_bytes[b, 1], phase_params[b, 1], mc)
            if np.isnan(d) or np.isnan(c):
                return False
            dispatch_KL[k, layer] = d
            combine_KL[k, layer] = c
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _slot_seconds(n, c, expert_table):  # pragma: no cover (compiled)
    """CostModel.experts' per-slot seconds for n tokens (before the rank's sum)."""
    if expert_table.shape[0] > 0:
        return _interpolate(expert_table, n) if n > 0 else 0.0
    padded = np.ceil(n / c[_C_TILE]) * c[_C_TILE]
    flops = (2.0 * c[_C_EXPERT_PARAMS]) * padded
    weights = c[_C_EXPERT_PARAMS] * c[_C_BYTES_EL] if n > 0 else 0.0
    moved = weights + ((2.0 * n) * c[_C_HIDDEN]) * c[_C_BYTES_EL]
    return max(flops / c[_C_GEMM_FLOPS], moved / c[_C_MEM_BW])


@numba.njit(cache=True, nogil=True)
def _slot_seconds_table(count, c, expert_table):  # pragma: no cover (compiled)
    """float64[count]: _slot_seconds(n) for n < count (what `_price_block` looks up)."""
    out = np.empty(count)
    for n in range(count):
        out[n] = _slot_seconds(float(n), c, expert_table)
    return out


@numba.njit(cache=True, nogil=True, inline="always")
def _attention1(pairs_prefill, pairs_decode, kv_read, tokens, tp, c):  # pragma: no cover (compiled)
    """CostModel.attention at one (iteration, attention rank)."""
    flops = pairs_prefill * c[_C_PAIR_PREFILL] + pairs_decode * c[_C_PAIR_DECODE]
    moved = (kv_read + tokens) * c[_C_KV_BYTES]
    if tp:
        flops, moved = flops / c[_C_DEVICES], moved / c[_C_TP_KV_SPLIT]
    proj = _gemm1(tokens, c[_C_ATTN_PARAMS], c)
    core = max(flops / c[_C_ATTN_FLOPS], moved / c[_C_MEM_BW])
    core = max(core, c[_C_FLOOR]) if tokens > 0 else 0.0
    return core + proj


@numba.njit(cache=True, nogil=True)
def _price_block(tp, seg5, slice_KLD, slot_tokens, c, expert_table, slot_table, gate_table, dispatch_KL, combine_KL,
                 total_K, dense_K, head_K, moe_KLC):  # pragma: no cover (compiled)
    """CostModel.block's compute and totals for K iterations, given the all-to-all seconds (see `price`);
    slot_table: `_slot_seconds_table`, the per-slot seconds of small token counts."""
    pairs_prefill, pairs_decode, kv_read, tokens, samples = seg5[0], seg5[1], seg5[2], seg5[3], seg5[4]
    num_k, num_layers, num_slots = slot_tokens.shape
    num = int(c[_C_DEVICES])
    shared = np.empty(num)
    spd = num_slots // num
    per_slot = np.empty(num_slots)
    routed = np.empty(num)
    moe_time = np.empty(num_layers)
    groups = tokens.shape[1]
    attn = np.empty(groups)
    for k in range(num_k):
        for r in range(groups):
            attn[r] = _attention1(pairs_prefill[k, r], pairs_decode[k, r], kv_read[k, r], tokens[k, r], tp, c)
        attention = attn.max()
        if tp:
            total_tokens = tokens[k, 0]
            half = 0.0
            if num > 1:
                message = (total_tokens * c[_C_HIDDEN]) * c[_C_BYTES_EL]
                half = c[_C_COLL_LATENCY] + ((num - 1) / num) * message / c[_C_COLL_BW]
            mlp = _gemm1(total_tokens, c[_C_DENSE_PARAMS], c)
            dense = c[_C_FIRST_DENSE] * ((attention + mlp) + 4 * half)
            head = _gemm1(samples[k, 0], c[_C_HEAD_PARAMS], c)
            gate_part = 0.0
            tp_part = 2 * half
        else:
            gate_part = -np.inf
            dense = -np.inf
            head = -np.inf
            for r in range(groups):
                gate_part = max(gate_part, attn[r] + _gate1(tokens[k, r], c, gate_table))
                dense = max(dense, attn[r] + _gemm1(tokens[k, r], c[_C_DENSE_PARAMS], c))
                head = max(head, _gemm1(samples[k, r], c[_C_HEAD_PARAMS], c))
            gate_part = gate_part - attention
            dense = c[_C_FIRST_DENSE] * dense
            tp_part = 0.0
            for d in range(num):
                shared[d] = _gemm1(tokens[k, d], c[_C_SHARED_PARAMS], c)
        for layer in range(num_layers):
            for p in range(num_slots):
                n = slot_tokens[k, layer, p]
                per_slot[p] = slot_table[n] if n < slot_table.shape[0] else _slot_seconds(float(n), c, expert_table)
            for d in range(num):
                # _pairwise_sum's own first branch, inlined: a call per rank and layer cost half this loop
                seconds = 0.0 + _pairwise_block(per_slot, d * spd, spd) if spd <= 128 else _pairwise_sum(per_slot, d * spd, spd)
                routed[d] = max(seconds, c[_C_FLOOR]) if seconds > 0 else 0.0
            experts = -np.inf
            if tp:
                gate_part = -np.inf
                for d in range(num):
                    t = float(slice_KLD[k, layer, d])
                    gate_part = max(gate_part, _gate1(t, c, gate_table))
                    experts = max(experts, routed[d] + _gemm1(t, c[_C_SHARED_PARAMS], c))
            else:
                for d in range(num):
                    experts = max(experts, routed[d] + shared[d])
            row = moe_KLC[k, layer]
            row[0] = attention
            row[1] = gate_part
            row[2] = dispatch_KL[k, layer]
            row[3] = experts
            row[4] = combine_KL[k, layer]
            row[5] = tp_part
            moe_time[layer] = 0.0 + row[0] + row[1] + row[2] + row[3] + row[4] + row[5]
        total_K[k] = (dense + c[_C_LAYER_WEIGHT] * _pairwise_sum(moe_time, 0, num_layers)) + head
        dense_K[k] = dense
        head_K[k] = head


@numba.njit(cache=True, nogil=True)
def _price_all(tp, seg5, slice_KLD, slot_tokens, activations, copies, node_copies, kinds_K, node, one_node, dpn,
               phase_params, phase_bytes, measured_0d, measured_0c, measured_1d, measured_1c, c, expert_table,
               slot_table, gate_table, total_K, dense_K, head_K, moe_KLC):  # pragma: no cover (compiled)
    """`_a2a_block` then `_price_block` in one call; False where `_a2a_block` is."""
    num_k, num_layers = slot_tokens.shape[0], slot_tokens.shape[1]
    dispatch = np.empty((num_k, num_layers))
    combine = np.empty((num_k, num_layers))
    if not _a2a_block(activations, copies, node_copies, kinds_K, node, one_node, dpn, phase_params, phase_bytes,
                      measured_0d, measured_0c, measured_1d, measured_1c, dispatch, combine):
        return False
    _price_block(tp, seg5, slice_KLD, slot_tokens, c, expert_table, slot_table, gate_table, dispatch, combine, total_K,
                 dense_K, head_K, moe_KLC)
    return True


@numba.njit(cache=True, nogil=True)
def _count_prompts(stream, miss_start, miss_len, miss_home, miss_slot, experts_RLk, slot_table_LDE, device_table_LDE,
                   device_bits_LDE, num_slots, devices_per_node, num_nodes, counted_CLW,
                   counted_C3):  # pragma: no cover (compiled)
    """Count whole prompts into the engine's kept counts: prompt i is stream[miss_start[i] : + miss_len[i]] living
    on miss_home[i]; its counts go to counted_CLW[miss_slot[i]] (per layer: activations and copies to each device,
    node copies, slot tokens) and counted_C3 (stats). False for a bad row."""
    num_layers, num_devices = slot_table_LDE.shape[0], slot_table_LDE.shape[1]
    width_nodes = num_nodes if num_nodes > 1 else 0
    activations = np.zeros((1, num_layers, num_devices, num_devices), dtype=np.int64)
    copies = np.zeros((1, num_layers, num_devices, num_devices), dtype=np.int64)
    node_copies = np.zeros((1, num_layers, num_devices, width_nodes), dtype=np.int64)
    slot_tokens = np.zeros((1, num_layers, num_slots), dtype=np.int64)
    stats = np.zeros((1, 3), dtype=np.int64)
    home = np.empty((miss_len.max() if miss_len.shape[0] else 0, num_layers), dtype=np.int64)
    for i in range(miss_slot.shape[0]):
        q, s, slot = miss_len[i], miss_home[i], miss_slot[i]
        stats[:] = 0
        home[:q] = s
        if count_rows_at(np.arange(q), stream[miss_start[i] : miss_start[i] + q], np.zeros(q, dtype=np.int64),
                         home, experts_RLk, slot_table_LDE, device_table_LDE, device_bits_LDE, devices_per_node,
                         activations, copies, node_copies, slot_tokens, stats) >= 0:
            return False
        for layer in range(num_layers):  # a prompt lives on one rank: only row s of the tables, zeroed after
            for d in range(num_devices):
                counted_CLW[slot, layer, d] = activations[0, layer, s, d]
                counted_CLW[slot, layer, num_devices + d] = copies[0, layer, s, d]
                activations[0, layer, s, d] = 0
                copies[0, layer, s, d] = 0
            for m in range(width_nodes):
                counted_CLW[slot, layer, 2 * num_devices + m] = node_copies[0, layer, s, m]
                node_copies[0, layer, s, m] = 0
            for p in range(num_slots):
                counted_CLW[slot, layer, 2 * num_devices + width_nodes + p] = slot_tokens[0, layer, p]
                slot_tokens[0, layer, p] = 0
        for j in range(3):
            counted_C3[slot, j] = stats[0, j]
    return True


@numba.njit(cache=True, nogil=True)
def _count_price(rows_N, group_N, home_NL, experts_RLk, slot_table_LDE, device_table_LDE, device_bits_LDE,
                 num_slots, devices_per_node, num_nodes, tp, seg5, slice_KLD, kinds_K, node, one_node, dpn, phase_params,
                 phase_bytes, measured_0d, measured_0c, measured_1d, measured_1c, c, expert_table, slot_table,
                 gate_table, counted_CLW, counted_C3, hit_slot_S, hit_home_S, stream, miss_start, miss_len,
                 miss_home, miss_slot, total_K, moe_KLC, stats_K3):  # pragma: no cover (compiled)
    """Count and price a block iteration by iteration: each iteration's rows counted (`count_rows_at`) into one
    iteration's tables, which are then priced (`_a2a_block`, `_price_block`) while they are in cache, so the block's
    [K, L, D, D] tables are never built. Iteration 0 also gets the counts of prompts counted before (not in rows_N):
    counted_CLW[hit_slot_S[i]] (per layer: activations and copies to each device, node copies, slot tokens of a
    prompt living on hit_home_S[i]) and counted_C3 (its stats), the prompts named by miss_* counted there first
    (`_count_prompts`). Returns 0, 1 for a bad row, 2 where `_a2a_block` declines."""
    num_k = total_K.shape[0]
    num_layers, num_devices = slot_table_LDE.shape[0], slot_table_LDE.shape[1]
    if not _count_prompts(stream, miss_start, miss_len, miss_home, miss_slot, experts_RLk, slot_table_LDE,
                          device_table_LDE, device_bits_LDE, num_slots, devices_per_node, num_nodes, counted_CLW,
                          counted_C3):
        return 1
    # the rows of each iteration, in batch order (a stable counting sort by iteration)
    num_rows = rows_N.shape[0]
    starts = np.zeros(num_k + 1, dtype=np.int64)
    for n in range(num_rows):
        starts[group_N[n] + 1] += 1
    for k in range(num_k):
        starts[k + 1] += starts[k]
    order = np.empty(num_rows, dtype=np.int64)
    fill = starts[:num_k].copy()
    for n in range(num_rows):
        order[fill[group_N[n]]] = n
        fill[group_N[n]] += 1
    zero_group = np.zeros(num_rows, dtype=np.int64)
    activations = np.zeros((1, num_layers, num_devices, num_devices), dtype=np.int64)
    copies = np.zeros((1, num_layers, num_devices, num_devices), dtype=np.int64)
    node_copies = np.zeros((1, num_layers, num_devices, num_nodes if num_nodes > 1 else 0), dtype=np.int64)
    slot_tokens = np.zeros((1, num_layers, num_slots), dtype=np.int64)
    dispatch = np.empty((1, num_layers))
    combine = np.empty((1, num_layers))
    dense = np.empty(1)
    head = np.empty(1)
    width_nodes = node_copies.shape[3]
    for k in range(num_k):
        activations[:] = 0
        copies[:] = 0
        node_copies[:] = 0
        slot_tokens[:] = 0
        if k == 0:
            for i in range(hit_slot_S.shape[0]):
                slot, s = hit_slot_S[i], hit_home_S[i]
                for layer in range(num_layers):
                    for d in range(num_devices):
                        activations[0, layer, s, d] += counted_CLW[slot, layer, d]
                        copies[0, layer, s, d] += counted_CLW[slot, layer, num_devices + d]
                    for m in range(width_nodes):
                        node_copies[0, layer, s, m] += counted_CLW[slot, layer, 2 * num_devices + m]
                    for p in range(num_slots):
                        slot_tokens[0, layer, p] += counted_CLW[slot, layer, 2 * num_devices + width_nodes + p]
                for j in range(3):
                    stats_K3[0, j] += counted_C3[slot, j]
        if count_rows_at(order[starts[k] : starts[k + 1]], rows_N, zero_group, home_NL, experts_RLk, slot_table_LDE,
                         device_table_LDE, device_bits_LDE, devices_per_node, activations, copies, node_copies,
                         slot_tokens, stats_K3[k : k + 1]) >= 0:
            return 1
        if not _a2a_block(activations, copies, node_copies, kinds_K[k : k + 1], node, one_node, dpn, phase_params,
                          phase_bytes, measured_0d, measured_0c, measured_1d, measured_1c, dispatch, combine):
            return 2
        _price_block(tp, seg5[:, k : k + 1], slice_KLD[k : k + 1], slot_tokens, c, expert_table, slot_table,
                     gate_table, dispatch, combine, total_K[k : k + 1], dense, head, moe_KLC[k : k + 1])
    return 0
