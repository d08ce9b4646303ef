"""One MoE layer on one device through the Triton kernels: gating -> permute -> grouped GEMM -> unpermute.

    weights_Tk, ids_Tk = topk_softmax(router_logits_TE, k, renormalize)            # repro.kernels.gating
    gather=False:  x_sorted, offsets, position = permute(x_TH, ids_Tk, E)           # rows copied by expert
                   y_sorted = fused_experts(x_sorted, offsets, w13, w2)
    gather=True:   offsets, position = permute_positions(ids_Tk, E)                # bookkeeping only
                   y_sorted = fused_experts_gathered(x_TH, sorted_slots(position), k, offsets, w13, w2)
    out_TH = unpermute(y_sorted, position, weights_Tk)                              # fp32 weighted combine

Both forms equal repro.kernels.grouped_gemm.moe_reference (same roundings); gather=True (the default, vLLM
fused_moe's sorted_token_ids) writes no permuted copy of x. validate=False is the hot path: no step reads a
device value on the host, so nothing waits for the GPU and a CUDA graph can capture the layer (buffers are
sized T * k, an upper bound of the routed rows).
Legend: T tokens, H hidden, E experts, k experts per token, I expert intermediate size.
"""

from __future__ import annotations

import torch

from repro.kernels.dispatch import permute, permute_positions, sorted_slots, unpermute
from repro.kernels.gating import topk_softmax
from repro.kernels.grouped_gemm import TileConfig, fused_experts, fused_experts_gathered


def fused_moe(
    x_TH: torch.Tensor,
    topk_ids_Tk: torch.Tensor,
    topk_weights_Tk: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    *,
    gather: bool = True,
    backend: str = "auto",
    validate: bool = True,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """out_TH (x's dtype) = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) (ids < 0 skipped), as moe_reference.

    x_TH float [T, H]; topk_ids_Tk int [T, k]; topk_weights_Tk float [T, k]; w13_E2IH [E, 2I, H]; w2_EHI
    [E, H, I]. gather: read rows through sorted slot ids (True) or through a permuted copy (False).
    """
    num_experts = w2_EHI.shape[0]
    if gather:
        offsets_E1, position_Tk = permute_positions(topk_ids_Tk, num_experts, backend=backend, validate=validate)
        y_sorted_MH = fused_experts_gathered(x_TH, sorted_slots(position_Tk), topk_ids_Tk.shape[1], offsets_E1,
                                             w13_E2IH, w2_EHI, backend=backend, validate=validate, config=config)
    else:
        x_sorted_MH, offsets_E1, position_Tk = permute(x_TH, topk_ids_Tk, num_experts, backend=backend,
                                                       validate=validate)
        y_sorted_MH = fused_experts(x_sorted_MH, offsets_E1, w13_E2IH, w2_EHI, backend=backend, validate=validate,
                                    config=config)
    return unpermute(y_sorted_MH, position_Tk, topk_weights_Tk, backend=backend, validate=validate)


def moe_layer(
    x_TH: torch.Tensor,
    router_logits_TE: torch.Tensor,
    top_k: int,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    *,
    renormalize: bool = True,
    gather: bool = True,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """out_TH: softmax top-k routing of router_logits_TE float [T, E], then `fused_moe`."""
    weights_Tk, ids_Tk = topk_softmax(router_logits_TE, top_k, renormalize, backend=backend)
    return fused_moe(x_TH, ids_Tk, weights_Tk, w13_E2IH, w2_EHI, gather=gather, backend=backend, validate=validate)
