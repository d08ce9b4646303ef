"""Model shapes for the simulator (conf/sim/shape/*.yaml) and how a routing trace maps onto one.

A shape gives every size that costs time or memory: hidden size, layers (dense and MoE), routed and shared
experts, top-k, expert and dense MLP widths, vocabulary, attention (MLA or GQA) and dtype. Routing comes from a
trace; `routing_map` checks that the trace's experts, top-k and MoE layers are the shape's, or, with the explicit
mapping "trace", simulates the trace's MoE layers and experts with the shape's sizes (stated in every result).

Legend: H hidden size, I expert (or MLP) intermediate size, E routed experts, k experts per token, L MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from repro.errors import ConfigError, TraceError
from repro.traces import RoutingTrace

ATTENTION_KINDS = ("mla", "gqa")
ROUTING_MAPS = ("strict", "trace")
_SHAPE_FIELDS = (
    "name", "hidden_size", "num_hidden_layers", "first_dense_layers", "num_experts", "top_k",
    "num_shared_experts", "moe_intermediate_size", "shared_intermediate_size", "intermediate_size", "vocab_size",
    "dtype_bytes", "attention",
)
_ATTENTION_FIELDS = {
    "mla": ("num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    "gqa": ("num_heads", "num_kv_heads", "head_dim"),
}


@dataclass(frozen=True)
class ModelShape:
    """Sizes of one MoE transformer (see conf/sim/shape/*.yaml for the sources of each number)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    first_dense_layers: int
    num_experts: int
    top_k: int
    num_shared_experts: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    attention: dict

    @classmethod
    def from_config(cls, shape: dict) -> ModelShape:
        """Validate a shape dict (one clear ConfigError per missing or bad field)."""
        name = shape.get("name", "<unnamed>") if isinstance(shape, dict) else "<not a dict>"
        if not isinstance(shape, dict):
            raise ConfigError(f"sim shape must be a mapping of model sizes, got {type(shape).__name__}.")
        missing = [f for f in _SHAPE_FIELDS if f not in shape]
        if missing:
            raise ConfigError(f"model shape {name!r} misses field(s) {missing}; see conf/sim/shape/deepseek_v2_lite.yaml.")
        attention = dict(shape["attention"] or {})
        kind = attention.get("kind")
        if kind not in ATTENTION_KINDS:
            raise ConfigError(f"model shape {name!r}: attention.kind must be one of {ATTENTION_KINDS}, got {kind!r}.")
        missing = [f for f in _ATTENTION_FIELDS[kind] if f not in attention]
        if missing:
            raise ConfigError(f"model shape {name!r}: {kind} attention misses field(s) {missing}.")
        values = {f: shape[f] for f in _SHAPE_FIELDS}
        values["attention"] = attention
        out = cls(**values)
        positive = ("hidden_size", "num_hidden_layers", "num_experts", "top_k", "moe_intermediate_size", "vocab_size",
                    "dtype_bytes")
        for field in positive:
            if not isinstance(getattr(out, field), int) or getattr(out, field) < 1:
                raise ConfigError(f"model shape {name!r}: {field} must be an integer >= 1, got {getattr(out, field)!r}.")
        if not 0 <= out.first_dense_layers < out.num_hidden_layers:
            raise ConfigError(
                f"model shape {name!r}: first_dense_layers={out.first_dense_layers} must lie in "
                f"0..{out.num_hidden_layers - 1} (at least one MoE layer)."
            )
        if out.top_k > out.num_experts:
            raise ConfigError(f"model shape {name!r}: top_k={out.top_k} exceeds num_experts={out.num_experts}.")
        return out

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_dense_layers

    def attention_params(self) -> int:
        """Weights of one attention block (projections in and out)."""
        a, h = self.attention, self.hidden_size
        if a["kind"] == "gqa":
            return h * (a["num_heads"] + 2 * a["num_kv_heads"]) * a["head_dim"] + a["num_heads"] * a["head_dim"] * h
        qk = a["qk_nope_head_dim"] + a["qk_rope_head_dim"]
        q = h * a["num_heads"] * qk if not a["q_lora_rank"] else h * a["q_lora_rank"] + a["q_lora_rank"] * a["num_heads"] * qk
        kv_a = h * (a["kv_lora_rank"] + a["qk_rope_head_dim"])
        kv_b = a["kv_lora_rank"] * a["num_heads"] * (a["qk_nope_head_dim"] + a["v_head_dim"])
        return q + kv_a + kv_b + a["num_heads"] * a["v_head_dim"] * h

    def kv_bytes_per_token_layer(self) -> int:
        """KV-cache bytes one token adds per layer (MLA caches the compressed latent plus the rope key)."""
        a = self.attention
        if a["kind"] == "gqa":
            return 2 * a["num_kv_heads"] * a["head_dim"] * self.dtype_bytes
        return (a["kv_lora_rank"] + a["qk_rope_head_dim"]) * self.dtype_bytes

    def attention_flops_per_pair(self, decode: bool) -> int:
        """FLOPs of one (query, key) pair summed over heads: QK^T plus PV.

        MLA prefill runs the decompressed (MHA) form, MLA decode the absorbed form over the latent (as SGLang).
        """
        a = self.attention
        if a["kind"] == "gqa":
            return 4 * a["num_heads"] * a["head_dim"]
        if decode:
            return 2 * a["num_heads"] * (2 * a["kv_lora_rank"] + a["qk_rope_head_dim"])
        return 2 * a["num_heads"] * (a["qk_nope_head_dim"] + a["qk_rope_head_dim"] + a["v_head_dim"])

    def weight_bytes_per_rank(self, devices: int, attention_replicated: bool) -> int:
        """Weights one EP rank holds: routed experts split over the ranks; attention, dense MLP, shared experts,
        embeddings and LM head replicated (Attention-DP) or split over the ranks (Attention-TP)."""
        h = self.hidden_size
        experts = self.num_moe_layers * self.num_experts * 3 * h * self.moe_intermediate_size // devices
        shared = self.num_moe_layers * 3 * h * self.shared_intermediate_size
        dense = self.first_dense_layers * 3 * h * self.intermediate_size
        rest = self.num_hidden_layers * self.attention_params() + shared + dense + 2 * self.vocab_size * h
        return (experts + (rest if attention_replicated else rest // devices)) * self.dtype_bytes


@dataclass(frozen=True)
class RoutingMap:
    """How the trace's MoE layers and experts stand for the shape's (`routing_map`).

    layer_weight: shape MoE layers each simulated trace layer stands for (1.0 when strict).
    expert_intermediate: intermediate size of one simulated expert (the shape's, or scaled by k_shape / k_trace so
        a token's active expert FLOPs equal the shape's under the "trace" mapping).
    """

    mode: str
    num_layers: int
    num_experts: int
    top_k: int
    layer_weight: float
    expert_intermediate: int
    description: str


def routing_map(shape: ModelShape, trace: RoutingTrace, mode: str = "strict") -> RoutingMap:
    """Check the trace against the shape; "strict" demands equal experts, top-k and MoE layers."""
    if mode not in ROUTING_MAPS:
        raise ConfigError(f"sim.routing_map must be one of {ROUTING_MAPS}, got {mode!r}.")
    meta = trace.meta
    same = (meta.num_experts, meta.top_k, meta.num_layers) == (shape.num_experts, shape.top_k, shape.num_moe_layers)
    if mode == "strict" and not same:
        raise TraceError(
            f"the trace routes {meta.num_layers} MoE layers x {meta.num_experts} experts top-{meta.top_k} but shape "
            f"{shape.name!r} has {shape.num_moe_layers} x {shape.num_experts} top-{shape.top_k}; use a trace of that "
            "model or set sim.routing_map=trace to simulate the trace's experts with the shape's sizes."
        )
    if same:
        return RoutingMap("strict", meta.num_layers, meta.num_experts, meta.top_k, 1.0, shape.moe_intermediate_size,
                          f"trace routing of {meta.model} matches shape {shape.name}")
    intermediate = max(1, round(shape.moe_intermediate_size * shape.top_k / meta.top_k))
    weight = shape.num_moe_layers / meta.num_layers
    return RoutingMap(
        "trace", meta.num_layers, meta.num_experts, meta.top_k, weight, intermediate,
        f"trace routing of {meta.model} ({meta.num_layers} MoE layers x {meta.num_experts} experts top-{meta.top_k}) "
        f"mapped onto shape {shape.name} ({shape.num_moe_layers} x {shape.num_experts} top-{shape.top_k}): each "
        f"trace layer stands for {weight:.3g} layers, experts of width {intermediate} keep the active FLOPs per token",
    )
