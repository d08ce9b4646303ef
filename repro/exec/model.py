"""The suite's tiny Mixtral, run end to end over real multi-process expert parallelism.

A hand-written forward of a transformers `MixtralForCausalLM` (read it top to bottom: embedding, then per
layer RMSNorm -> rotary causal attention -> residual -> RMSNorm -> router -> MoE -> residual, then the final
norm and the LM head), in three forms that must give the same logits:

- `forward`: single process, every expert local (checked against the transformers model itself).
- `dp_forward`: Attention-DP. This rank runs attention with replicated weights on the requests the plan
  assigned to it, and every MoE layer through `ep_moe_forward` (experts where the plan's placement puts them).
- `tp_forward`: Attention-TP. Every rank holds all tokens and 1/D of the attention heads, so each rank's
  o_proj output is a partial sum. Before each MoE layer, per step of `tokens_per_step` tokens in trace order,
  the plan's permutation feeds `shuffled_reduce_scatter` (summing the partials: it replaces the all-reduce);
  the residual add, post-attention norm, router and `ep_moe_forward` run on this rank's slice; the layer
  output (residual included) comes back to every rank with `shuffled_all_gather`. Each slice's routing is
  all-gathered too, since the next layers' shuffles read it as routing history.

`run_model` launches either over `world_size` processes, compares the logits with the transformers model,
the routing with the trace, and the bytes each rank sent in dispatch / combine with the evaluator's exact
prediction (`repro.eval.accounting`).

Requests are independent sequences: positions restart at 0 in every request and attention never crosses a
request boundary (one attention call per request; the projections run over all tokens at once).

Legend: T tokens, R requests, H hidden size, V model vocabulary, n attention heads, n_kv key/value heads,
d head dim, E experts per layer, k experts per token, I expert intermediate size, L MoE layers (every Mixtral
decoder layer is one), D ranks, S tokens in one TP step, t tokens in this rank's slice of a step.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

from repro.errors import ConfigError, ReproError
from repro.exec.launch import launch, worker_device
from repro.exec.moe import (
    COLLECTIVES,
    CommRecord,
    LocalExperts,
    build_local_experts,
    ep_moe_forward,
    resolve_kernel_backend,
    shuffled_all_gather,
    shuffled_reduce_scatter,
)
from repro.kernels.gating import topk_softmax
from repro.systems.base import Placement, Plan
from repro.traces import RoutingTrace

if TYPE_CHECKING:
    from repro.routing.tiny_model import VocabMap


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer: attention projections (nn.Linear layout: [out, in]), norms, router and experts."""

    input_norm_H: torch.Tensor
    q_proj_nd_H: torch.Tensor  # [n * d, H]
    k_proj_nkvd_H: torch.Tensor  # [n_kv * d, H]
    v_proj_nkvd_H: torch.Tensor  # [n_kv * d, H]
    o_proj_H_nd: torch.Tensor  # [H, n * d]
    post_norm_H: torch.Tensor
    router_EH: torch.Tensor
    w13_E2IH: torch.Tensor  # rows [:I] gate, [I:] up
    w2_EHI: torch.Tensor


@dataclass(frozen=True)
class MixtralWeights:
    """Every weight and shape constant the forward needs, detached from the transformers module."""

    embed_VH: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm_H: torch.Tensor
    lm_head_VH: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    top_k: int
    rms_eps: float
    rope_theta: float
    sliding_window: int | None

    @property
    def num_experts(self) -> int:
        return self.layers[0].router_EH.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed_VH.shape[1]

    def config(self) -> dict:
        """The scalar constants, JSON-serialisable (with `tensors()` they rebuild the weights)."""
        return {
            "num_layers": len(self.layers),
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "top_k": self.top_k,
            "rms_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window,
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor dict (safetensors-ready)."""
        out = {"embed_VH": self.embed_VH, "norm_H": self.norm_H, "lm_head_VH": self.lm_head_VH}
        for i, layer in enumerate(self.layers):
            out.update({f"layers.{i}.{name}": t for name, t in vars(layer).items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], config: dict) -> MixtralWeights:
        """Inverse of (`tensors()`, `config()`)."""
        names = LayerWeights.__dataclass_fields__
        layers = tuple(
            LayerWeights(**{name: tensors[f"layers.{i}.{name}"] for name in names}) for i in range(config["num_layers"])
        )
        scalars = {key: value for key, value in config.items() if key != "num_layers"}
        return cls(tensors["embed_VH"], layers, tensors["norm_H"], tensors["lm_head_VH"], **scalars)


def weights_of(model) -> MixtralWeights:
    """The weights of a transformers `MixtralForCausalLM` (fp32 copies), refusing what `forward` does not do."""
    config = model.config
    if type(model).__name__ != "MixtralForCausalLM":
        raise ConfigError(f"repro.exec.model runs MixtralForCausalLM only, got {type(model).__name__}.")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or config.hidden_act != "silu":
        raise ConfigError(
            f"repro.exec.model implements plain RoPE and SiLU experts; this model has rope_type="
            f"{rope.get('rope_type')!r}, hidden_act={config.hidden_act!r}."
        )

    def f32(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", torch.float32).contiguous()

    layers = tuple(
        LayerWeights(
            input_norm_H=f32(layer.input_layernorm.weight),
            q_proj_nd_H=f32(layer.self_attn.q_proj.weight),
            k_proj_nkvd_H=f32(layer.self_attn.k_proj.weight),
            v_proj_nkvd_H=f32(layer.self_attn.v_proj.weight),
            o_proj_H_nd=f32(layer.self_attn.o_proj.weight),
            post_norm_H=f32(layer.post_attention_layernorm.weight),
            router_EH=f32(layer.mlp.gate.weight),
            w13_E2IH=f32(layer.mlp.experts.gate_up_proj),
            w2_EHI=f32(layer.mlp.experts.down_proj),
        )
        for layer in model.model.layers
    )
    return MixtralWeights(
        embed_VH=f32(model.model.embed_tokens.weight),
        layers=layers,
        norm_H=f32(model.model.norm.weight),
        lm_head_VH=f32(model.lm_head.weight),
        num_heads=int(config.num_attention_heads),
        num_kv_heads=int(config.num_key_value_heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
        top_k=int(config.num_experts_per_tok),
        rms_eps=float(config.rms_norm_eps),
        rope_theta=float(rope.get("rope_theta", 1e6)),
        sliding_window=None if config.sliding_window is None else int(config.sliding_window),
    )


# ---------------------------------------------------------------------------------------------------------
# Building blocks (pure functions)
# ---------------------------------------------------------------------------------------------------------


def rms_norm(x_TH: torch.Tensor, weight_H: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, over H."""
    return weight_H * (x_TH * torch.rsqrt(x_TH.pow(2).mean(-1, keepdim=True) + eps))


def positions_of(offsets_R1: torch.Tensor) -> torch.Tensor:
    """int64[T] position of each token inside its own request (offsets int64[R+1])."""
    lengths_R = offsets_R1[1:] - offsets_R1[:-1]
    return torch.arange(int(offsets_R1[-1]), device=offsets_R1.device) - torch.repeat_interleave(offsets_R1[:-1], lengths_R)


def rotate(x_nTd: torch.Tensor, positions_T: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as transformers' Mixtral applies it: the two halves of d rotate by position * theta^(-2i/d)."""
    d = x_nTd.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x_nTd.device) / d))
    angle_Td = torch.cat([positions_T[:, None].float() * inv_freq] * 2, dim=-1)
    half = d // 2
    rotated_nTd = torch.cat([-x_nTd[..., half:], x_nTd[..., :half]], dim=-1)
    return x_nTd * angle_Td.cos() + rotated_nTd * angle_Td.sin()


def attention(
    h_TH: torch.Tensor,
    layer: LayerWeights,
    weights: MixtralWeights,
    offsets_R1: torch.Tensor,
    heads: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Causal self-attention of each request over itself, through the heads [h0, h1) only.

    h_TH: the normed hidden states of whole requests (offsets int64[R+1] into T). heads: (h0, h1) query heads
    (their key/value heads follow; None = all). Returns float32[T, H]: the o_proj output of those heads, i.e.
    the full attention output when heads is None, and one rank's partial sum under Attention-TP.
    """
    n, n_kv, d = weights.num_heads, weights.num_kv_heads, weights.head_dim
    h0, h1 = heads if heads is not None else (0, n)
    group = n // n_kv  # query heads per key/value head (GQA)
    kv0, kv1 = h0 // group, h1 // group
    num_tokens = h_TH.shape[0]
    q_nTd = (h_TH @ layer.q_proj_nd_H[h0 * d : h1 * d].T).view(num_tokens, h1 - h0, d).transpose(0, 1)
    k_nTd = (h_TH @ layer.k_proj_nkvd_H[kv0 * d : kv1 * d].T).view(num_tokens, kv1 - kv0, d).transpose(0, 1)
    v_nTd = (h_TH @ layer.v_proj_nkvd_H[kv0 * d : kv1 * d].T).view(num_tokens, kv1 - kv0, d).transpose(0, 1)
    positions_T = positions_of(offsets_R1)
    q_nTd = rotate(q_nTd, positions_T, weights.rope_theta)
    k_nTd = rotate(k_nTd, positions_T, weights.rope_theta).repeat_interleave(group, dim=0)
    v_nTd = v_nTd.repeat_interleave(group, dim=0)
    out_nTd = torch.empty_like(q_nTd)
    bounds = offsets_R1.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        out_nTd[:, start:stop] = F.scaled_dot_product_attention(
            q_nTd[:, start:stop], k_nTd[:, start:stop], v_nTd[:, start:stop],
            attn_mask=_causal_mask(stop - start, weights.sliding_window, h_TH.device),
        )
    return out_nTd.transpose(0, 1).reshape(num_tokens, (h1 - h0) * d) @ layer.o_proj_H_nd[:, h0 * d : h1 * d].T


def _causal_mask(length: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """bool[S, S]: query i sees key j <= i (and i - j < sliding_window when the model has one)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    visible = j <= i
    return visible & (i - j < sliding_window) if sliding_window is not None else visible


def route(h_TH: torch.Tensor, layer: LayerWeights, top_k: int, *, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's router: softmax over E, top-k, renormalised. Returns (weights float32[T, k], ids int64[T, k])."""
    return topk_softmax(h_TH @ layer.router_EH.T, top_k, True, backend=resolve_kernel_backend(backend, h_TH.device))


def experts_local(h_TH: torch.Tensor, ids_Tk: torch.Tensor, weights_Tk: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
    """Single-process MoE: out[t] = sum_j w[t, j] * expert_{ids[t, j]}(h[t]), one SwiGLU per expert used."""
    out_TH = torch.zeros_like(h_TH)
    intermediate = layer.w2_EHI.shape[2]
    for expert in torch.unique(ids_Tk).tolist():
        token_T, slot_T = torch.nonzero(ids_Tk == expert, as_tuple=True)
        x = h_TH[token_T]
        gate_up = x @ layer.w13_E2IH[expert].T
        y = (F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]) @ layer.w2_EHI[expert].T
        out_TH.index_add_(0, token_T, y * weights_Tk[token_T, slot_T, None])
    return out_TH


def lm_head(x_TH: torch.Tensor, weights: MixtralWeights) -> torch.Tensor:
    """float32[T, V] logits from the last layer's output."""
    return rms_norm(x_TH, weights.norm_H, weights.rms_eps) @ weights.lm_head_VH.T


MoeFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def forward(
    weights: MixtralWeights,
    model_ids_T: torch.Tensor,
    offsets_R1: torch.Tensor,
    *,
    moe: MoeFn | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of whole requests (model ids int64[T], offsets int64[R+1]) with every attention head local.

    moe(layer, h_TH, ids_Tk, weights_Tk) -> y_TH runs the experts of one MoE layer: `experts_local` when
    None (the single-process model), `ep_moe_forward` under Attention-DP.
    Returns (logits float32[T, V], experts int64[T, L, k] each layer's routing, descending gate weight).
    """
    x_TH = weights.embed_VH[model_ids_T]
    experts = []
    for index, layer in enumerate(weights.layers):
        x_TH = x_TH + attention(rms_norm(x_TH, layer.input_norm_H, weights.rms_eps), layer, weights, offsets_R1)
        h_TH = rms_norm(x_TH, layer.post_norm_H, weights.rms_eps)
        w_Tk, ids_Tk = route(h_TH, layer, weights.top_k, backend=backend)
        y_TH = experts_local(h_TH, ids_Tk, w_Tk, layer) if moe is None else moe(index, h_TH, ids_Tk, w_Tk)
        x_TH = x_TH + y_TH
        experts.append(ids_Tk)
    return lm_head(x_TH, weights), torch.stack(experts, dim=1)


# ---------------------------------------------------------------------------------------------------------
# Distributed forwards: one call per rank, inside an initialised process group
# ---------------------------------------------------------------------------------------------------------


def local_experts_of(weights: MixtralWeights, placement: Placement, rank: int) -> list[LocalExperts]:
    """This rank's physical expert slots of every layer (placement.physical_to_logical int[L, P])."""
    return [
        build_local_experts(placement.physical_to_logical[index], rank, placement.num_devices, layer.w13_E2IH, layer.w2_EHI)
        for index, layer in enumerate(weights.layers)
    ]


def dp_forward(
    weights: MixtralWeights,
    model_ids_T: torch.Tensor,
    offsets_R1: torch.Tensor,
    placement: Placement,
    rank: int,
    *,
    group=None,
    record: CommRecord | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention-DP: this rank's requests (model ids int64[T], offsets int64[R+1]; T = 0 is fine) with
    replicated attention and expert-parallel MoE layers.

    Returns (logits float32[T, V], experts int64[T, L, k]) of this rank's tokens.
    """
    local = local_experts_of(weights, placement, rank)
    dispatch_LDE = torch.as_tensor(placement.dispatch_device(), device=model_ids_T.device)

    def moe(index: int, h_TH: torch.Tensor, ids_Tk: torch.Tensor, w_Tk: torch.Tensor) -> torch.Tensor:
        return ep_moe_forward(
            h_TH, ids_Tk, w_Tk, dispatch_LDE[index, rank], local[index], weights.num_experts, group,
            layer=index, record=record, backend=backend,
        )

    return forward(weights, model_ids_T, offsets_R1, moe=moe, backend=backend)


def tp_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """(h0, h1) the query heads of `rank` under Attention-TP; ConfigError unless the heads split evenly."""
    if num_heads % world_size or num_kv_heads % world_size:
        raise ConfigError(
            f"Attention-TP splits the model's {num_heads} attention heads ({num_kv_heads} key/value heads) over "
            f"{world_size} ranks and needs both divisible by it; use a world size that divides {num_heads} and "
            f"{num_kv_heads}, or attention=dp."
        )
    per_rank = num_heads // world_size
    return rank * per_rank, (rank + 1) * per_rank


def tp_forward(
    weights: MixtralWeights,
    model_ids_T: torch.Tensor,
    offsets_R1: torch.Tensor,
    token_ids_T: np.ndarray,
    plan: Plan,
    rank: int,
    world_size: int,
    *,
    history: int = 2,
    group=None,
    record: CommRecord | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention-TP over all T tokens (model ids int64[T], offsets int64[R+1]) on every rank.

    token_ids_T int[T]: the trace's (real tokenizer) ids the plan's shuffle reads. Tokens go through the
    reduce-scatter in steps of plan.parallel.tokens_per_step in order, and before MoE layer l each step is
    ordered by plan.shuffle_tokens(step ids, l, this run's routing of the min(l, history) previous layers),
    exactly as `repro.eval.accounting.home_devices` asks it. Returns (hidden float32[T, H], the last layer's
    output, and experts int64[T, L, k]), the same on every rank: `lm_head` of the rows a rank reports gives
    their logits (the LM head need not run T x V on every rank).
    """
    h0, h1 = tp_heads(weights.num_heads, weights.num_kv_heads, rank, world_size)
    local = local_experts_of(weights, plan.placement, rank)
    dispatch_LDE = torch.as_tensor(plan.placement.dispatch_device(), device=model_ids_T.device)
    num_tokens, step = len(model_ids_T), plan.parallel.tokens_per_step
    token_ids_T = np.asarray(token_ids_T)
    experts_TLk = torch.empty(num_tokens, len(weights.layers), weights.top_k, dtype=torch.int64, device=model_ids_T.device)
    plan.reset()
    x_TH = weights.embed_VH[model_ids_T]
    for index, layer in enumerate(weights.layers):
        h_TH = rms_norm(x_TH, layer.input_norm_H, weights.rms_eps)
        partial_TH = attention(h_TH, layer, weights, offsets_R1, heads=(h0, h1))
        out_TH = torch.empty_like(x_TH)
        first = max(0, index - history)
        for start in range(0, num_tokens, step):
            stop = min(start + step, num_tokens)
            prev = experts_TLk[start:stop, first:index].cpu().numpy().astype(np.int16) if index > first else None
            permutation, counts = plan.shuffle_tokens(token_ids_T[start:stop], index, prev)
            permutation_S = torch.as_tensor(np.asarray(permutation), dtype=torch.int64, device=x_TH.device)
            counts_D = torch.as_tensor(np.asarray(counts), dtype=torch.int64)
            bounds = [0, *np.cumsum(counts_D.tolist())]
            mine_t = start + permutation_S[bounds[rank] : bounds[rank + 1]]
            # the reduce-scatter sums the heads' partial outputs; the residual joins on the slice
            x_tH = x_TH[mine_t] + shuffled_reduce_scatter(
                partial_TH[start:stop], permutation_S, counts_D, group, layer=index, record=record
            )
            h_tH = rms_norm(x_tH, layer.post_norm_H, weights.rms_eps)
            w_tk, ids_tk = route(h_tH, layer, weights.top_k, backend=backend)
            x_tH = x_tH + ep_moe_forward(
                h_tH, ids_tk, w_tk, dispatch_LDE[index, rank], local[index], weights.num_experts, group,
                layer=index, record=record, backend=backend,
            )
            out_TH[start:stop] = shuffled_all_gather(x_tH, permutation_S, counts_D, group, layer=index, record=record)
            experts_TLk[start:stop, index] = all_gather_rows(ids_tk, permutation_S, counts_D, group)
        x_TH = out_TH
    return x_TH, experts_TLk


def all_gather_rows(rows_tk: torch.Tensor, permutation_S: torch.Tensor, counts_D: torch.Tensor, group=None) -> torch.Tensor:
    """Every rank's slice rows back in step order: out[permutation[j]] = row j of the concatenated slices.

    rows_tk [t, k]: this rank's rows (t = counts_D[rank]); returns [S, k] on every rank. For small integer
    tensors (routing ids), so plain padded all_gather.
    """
    width = int(counts_D.max())
    padded = rows_tk.new_zeros(width, rows_tk.shape[1])
    padded[: len(rows_tk)] = rows_tk
    gathered = [torch.empty_like(padded) for _ in range(len(counts_D))]
    dist.all_gather(gathered, padded, group=group)
    concatenated = torch.cat([g[: int(c)] for g, c in zip(gathered, counts_D.tolist(), strict=True)])
    out = torch.empty_like(concatenated)
    out[permutation_S] = concatenated
    return out


# ---------------------------------------------------------------------------------------------------------
# End to end: launch the ranks, then check logits, routing and bytes against the references
# ---------------------------------------------------------------------------------------------------------


def run_model(
    plan: Plan,
    trace: RoutingTrace,
    model,
    vocab: VocabMap | None = None,
    *,
    world_size: int | None = None,
    attention: str | None = None,
    backend: str = "gloo",
    kernel_backend: str = "auto",
    history: int = 2,
    timeout_s: float = 300.0,
) -> dict:
    """Run `model` (a MixtralForCausalLM) over every request of `trace` on world_size ranks and check it.

    trace: routing captured from this model (token ids are real tokenizer ids; `vocab` maps them to model ids,
    None when they are model ids already). world_size and attention default to plan.parallel's and must agree
    with it (the evaluator's prediction reads plan.parallel). backend: "gloo" or "nccl" (process group);
    kernel_backend: the repro.kernels backend; history: routing layers the TP shuffle sees (home_devices').

    Returns a JSON-serialisable summary: max_logit_error (max |distributed - transformers| over all logits)
    and max_logit (max |transformers logit|, for scale); routing_match (every token-layer's k ids equal the
    trace's, in order) and routing_mismatches; dispatch_bytes / combine_bytes int[D][L] each rank sent to other
    ranks, expected_dispatch_bytes / expected_combine_bytes the evaluator's exact prediction
    (account(home_devices(plan, trace)) at hidden x 4 bytes per token) and bytes_match; collective_seconds
    {collective: [seconds per rank]} and forward_seconds [per rank]; plus the run's shape.
    """
    # the evaluator (and pandas behind it) is the driver's alone: spawned ranks import this module
    from repro.eval.accounting import account, home_devices, read_only

    world_size = plan.parallel.devices if world_size is None else int(world_size)
    attention = plan.parallel.attention if attention is None else attention
    if world_size != plan.parallel.devices or attention != plan.parallel.attention:
        raise ConfigError(
            f"run_model got world_size={world_size}, attention={attention!r} but the plan was built for "
            f"{plan.parallel.devices} devices with attention={plan.parallel.attention!r}; fit the plan with the "
            "parallel config the run uses."
        )
    weights = weights_of(model)
    if (trace.num_layers, trace.meta.num_experts, trace.meta.top_k) != (
        len(weights.layers), weights.num_experts, weights.top_k
    ):
        raise ConfigError(
            f"the trace routes {trace.num_layers} layers x {trace.meta.num_experts} experts (top-{trace.meta.top_k}) "
            f"but the model has {len(weights.layers)} x {weights.num_experts} (top-{weights.top_k}); capture the "
            "trace from this model."
        )
    if attention == "tp":
        tp_heads(weights.num_heads, weights.num_kv_heads, 0, world_size)
    model_ids_N = _model_ids(trace, vocab, weights.embed_VH.shape[0])
    # the evaluator's prediction first: it also checks that plan and trace fit, before any rank starts
    expected_LDD = account(
        home_devices(plan, trace, history=history),
        trace.experts,
        plan.placement.dispatch_device(),
        weights.hidden_size * 4,  # fp32 hidden states, as the ranks send them
        world_size,
    ).traffic
    offsets = np.asarray(trace.offsets, dtype=np.int64)
    request_rank_R = None
    if attention == "dp":
        plan.reset()
        request_rank_R = np.asarray(
            plan.assign_requests(read_only(trace.token_ids), read_only(offsets), read_only(trace.prefill_len)),
            dtype=np.int64,
        )

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="repro_exec_model_") as out_dir:
        results = launch(
            _model_worker,
            world_size,
            backend=backend,
            timeout_s=timeout_s,
            weights_file=_save_weights(weights, Path(out_dir)),
            weights_config=weights.config(),
            # DP ranks need only the placement; TP ranks run the plan's token shuffle themselves
            placement=plan.placement,
            plan=plan if attention == "tp" else None,
            attention=attention,
            model_ids_N=model_ids_N,
            offsets_R1=offsets,
            token_ids_N=np.asarray(trace.token_ids),
            request_rank_R=request_rank_R,
            history=history,
            kernel_backend=kernel_backend,
            out_dir=out_dir,
        )
        wall = time.perf_counter() - started
        logits_NV, experts_NLk = _collect_outputs(Path(out_dir), world_size, trace.num_tokens, weights)
    max_error = max_logit = 0.0
    for start, reference_SV in reference_logits(model, model_ids_N, offsets):
        error = np.abs(logits_NV[start : start + len(reference_SV)] - reference_SV).max()
        max_error, max_logit = max(max_error, float(error)), max(max_logit, float(np.abs(reference_SV).max()))
    routing_equal = experts_NLk == np.asarray(trace.experts, dtype=np.int64)

    measured = {name: np.zeros((world_size, trace.num_layers), dtype=np.int64) for name in ("dispatch", "combine")}
    records = [CommRecord.from_json(result["comm"]) for result in results]
    for rank, record in enumerate(records):
        for name in measured:
            measured[name][rank] = record.bytes_per_layer(name, trace.num_layers)
    ran = {name for record in records for _, name in record.seconds}
    seconds = {name: [record.total_seconds(name) for record in records] for name in COLLECTIVES if name in ran}
    expected_dispatch = expected_LDD.sum(axis=2).T  # [D, L]: what source rank s sends
    expected_combine = expected_LDD.sum(axis=1).T  # combine sends each copy back from its destination
    return {
        "attention": attention,
        "world_size": world_size,
        "backend": backend,
        "kernel_backend": kernel_backend,
        "num_requests": trace.num_requests,
        "num_tokens": trace.num_tokens,
        "num_layers": trace.num_layers,
        "max_logit_error": max_error,
        "max_logit": max_logit,
        "routing_match": bool(routing_equal.all()),
        "routing_mismatches": int((~routing_equal.all(axis=2)).sum()),
        "dispatch_bytes": measured["dispatch"].tolist(),
        "combine_bytes": measured["combine"].tolist(),
        "expected_dispatch_bytes": expected_dispatch.tolist(),
        "expected_combine_bytes": expected_combine.tolist(),
        "bytes_match": bool(
            np.array_equal(measured["dispatch"], expected_dispatch)
            and np.array_equal(measured["combine"], expected_combine)
        ),
        "collective_seconds": seconds,
        "forward_seconds": [result["forward_seconds"] for result in results],
        "wall_seconds": wall,
    }


def load_tiny_model(trace: RoutingTrace, *, cache_dir: str | Path):
    """(MixtralForCausalLM in eval mode, VocabMap) of the suite's tiny model that routed `trace`.

    The trace's meta.extra["cache_key"] (written by tiny_model.route_with_tiny_model) names the cache entry
    `load_or_train` wrote under cache_dir, whose config.json holds the training config the architecture
    follows, so neither the training requests nor the model config need to be rebuilt.
    """
    from transformers import MixtralForCausalLM

    from repro.routing.tiny_model import VocabMap, check_tiny_config, tiny_mixtral_config

    key = trace.meta.extra.get("cache_key") if trace.meta.source == "tiny_model" else None
    if not key:
        raise ConfigError(
            f"exec mode model runs the tiny model, but this trace came from {trace.meta.source!r} without a tiny-model "
            "cache key; route the workload with model=tiny_mixtral."
        )
    entry = Path(cache_dir) / f"tiny_{key[:16]}"
    files = [entry / "model.safetensors", entry / "vocab_map.npy", entry / "config.json"]
    if not all(f.is_file() for f in files):
        raise ConfigError(f"the tiny model that routed this trace is not cached at {entry}; rerun the routing to retrain it.")
    record = json.loads(files[2].read_text())
    if record.get("cache_key") != key:
        raise ConfigError(f"the cache entry {entry} holds model {record.get('cache_key')!r}, not the trace's {key!r}.")
    vocab = VocabMap(np.load(files[1], allow_pickle=False).astype(np.int64), int(record["vocab_size"]))
    model = MixtralForCausalLM(tiny_mixtral_config(check_tiny_config(record["train_config"]), vocab.model_vocab_size))
    safetensors.torch.load_model(model, files[0], strict=True)
    return model.eval(), vocab


def reference_logits(model, model_ids_N: np.ndarray, offsets_R1: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(start, logits float32[S_r, V]) of each request r from the transformers model itself, run on its own
    (model ids int[N], offsets int[R+1]); one request at a time, so N x V floats are never held twice."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start, stop in zip(offsets_R1[:-1].tolist(), offsets_R1[1:].tolist(), strict=True):
            ids = torch.as_tensor(model_ids_N[start:stop], device=device)[None]
            yield start, model(input_ids=ids, use_cache=False).logits[0].float().cpu().numpy()


def _model_ids(trace: RoutingTrace, vocab: VocabMap | None, model_vocab: int) -> np.ndarray:
    ids = vocab.to_model(trace.token_ids) if vocab is not None else np.asarray(trace.token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= model_vocab):
        raise ConfigError(
            f"trace token id {int(ids.max())} is outside the model's vocabulary of {model_vocab}; pass the model's "
            "VocabMap (tiny_model.load_or_train returns it) or a trace captured from this model."
        )
    return ids


def _save_weights(weights: MixtralWeights, directory: Path) -> str:
    """Weights go to the ranks as one safetensors file (no pickle of 10^7 floats through the spawn pipe)."""
    path = directory / "weights.safetensors"
    safetensors.torch.save_file(weights.tensors(), str(path))
    return str(path)


def _model_worker(
    rank: int,
    world_size: int,
    *,
    weights_file: str,
    weights_config: dict,
    placement: Placement,
    plan: Plan | None,
    attention: str,
    model_ids_N: np.ndarray,
    offsets_R1: np.ndarray,
    token_ids_N: np.ndarray,
    request_rank_R: np.ndarray | None,
    history: int,
    kernel_backend: str,
    out_dir: str,
) -> dict:
    """One rank of `run_model`: run the forward, write logits / routing / token index as .npy, return timings."""
    device = worker_device(dist.get_backend(), rank)
    weights = MixtralWeights.from_tensors(safetensors.torch.load_file(weights_file, device=str(device)), weights_config)
    record = CommRecord()
    if attention == "dp":
        mine_R = np.flatnonzero(request_rank_R == rank)
        lengths_R = offsets_R1[mine_R + 1] - offsets_R1[mine_R]
        local_offsets_R1 = np.concatenate([[0], np.cumsum(lengths_R)])
        token_index = np.repeat(offsets_R1[mine_R] - local_offsets_R1[:-1], lengths_R) + np.arange(lengths_R.sum())
        dist.barrier()
        started = time.perf_counter()
        logits_TV, experts_TLk = dp_forward(
            weights, torch.as_tensor(model_ids_N[token_index], device=device),
            torch.as_tensor(local_offsets_R1, device=device), placement, rank, record=record, backend=kernel_backend,
        )
    else:
        dist.barrier()
        started = time.perf_counter()
        hidden_NH, experts_NLk = tp_forward(
            weights, torch.as_tensor(model_ids_N, device=device), torch.as_tensor(offsets_R1, device=device),
            token_ids_N, plan, rank, world_size, history=history, record=record, backend=kernel_backend,
        )
        # every rank holds every token's output; each reports an even share of the tokens
        token_index = np.array_split(np.arange(len(model_ids_N)), world_size)[rank]
        logits_TV, experts_TLk = lm_head(hidden_NH[token_index], weights), experts_NLk[token_index]
    seconds = time.perf_counter() - started
    out = Path(out_dir)
    np.save(out / f"logits_{rank}.npy", logits_TV.cpu().numpy(), allow_pickle=False)
    np.save(out / f"experts_{rank}.npy", experts_TLk.cpu().numpy(), allow_pickle=False)
    np.save(out / f"tokens_{rank}.npy", token_index, allow_pickle=False)
    return {"rank": rank, "forward_seconds": seconds, "comm": record.to_json()}


def _collect_outputs(out_dir: Path, world_size: int, num_tokens: int, weights: MixtralWeights):
    """(logits float32[N, V], experts int64[N, L, k]) assembled from the ranks' files (every token once)."""
    logits_NV = np.empty((num_tokens, weights.embed_VH.shape[0]), dtype=np.float32)
    experts_NLk = np.empty((num_tokens, len(weights.layers), weights.top_k), dtype=np.int64)
    seen = np.zeros(num_tokens, dtype=np.int64)
    for rank in range(world_size):
        index = np.load(out_dir / f"tokens_{rank}.npy", allow_pickle=False)
        logits_NV[index] = np.load(out_dir / f"logits_{rank}.npy", allow_pickle=False)
        experts_NLk[index] = np.load(out_dir / f"experts_{rank}.npy", allow_pickle=False)
        seen[index] += 1
    if np.any(seen != 1):
        raise ReproError(f"the ranks returned {int((seen == 0).sum())} tokens never and {int((seen > 1).sum())} "
                         "twice; the request assignment and the ranks disagree.")
    return logits_NV, experts_NLk
