"""Late decode binding for the router's PD mode (vLLM 0.33.0, NIXL pull connector): the two legs' bodies, and the
decode rank chosen from the prefill reply's observed routing by a signature plan's `assign_decode`.

Protocol (vLLM's `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`): the prefill leg is the client's
body with `max_tokens` 1 (and `max_completion_tokens` 1 when present), `stream` false, `stream_options`,
`min_tokens` and `min_completion_tokens` dropped, and `kv_transfer_params` {"do_remote_decode": true, ...}; the
prefill server keeps the prompt's KV blocks for its lease (kv_lease_duration, 30 s by default) and answers with
`kv_transfer_params` (remote_engine_id, remote_block_ids, remote_host, remote_port, ...) and, launched with
--enable-return-routed-experts, `choices[0].routed_experts` (base64 .npy int[prompt tokens, model layers, top_k],
logical ids). The decode leg is the client's body unchanged but for those `kv_transfer_params`; the decode server
pulls the KV over NIXL.

Legend: n prompt tokens, Lh model layers, L plan (MoE) layers, k top-k, D decode ranks.
"""

from __future__ import annotations

import threading

import numpy as np

from repro.engines.layout import SavedPlan
from repro.engines.payloads import decode_vllm, moe_columns
from repro.errors import ConfigError, TraceError

PD_PATHS = ("/v1/completions", "/v1/chat/completions")
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")  # vLLM's toy proxy: not supported on the prefill
KV_LEASE_S = 30.0  # vLLM's default kv_lease_duration


def prefill_body(body: dict) -> dict:
    """The prefill leg's body: the client's, generating one token, not streamed, its KV kept for a remote decode."""
    leg = {key: value for key, value in body.items() if key not in DROPPED}
    leg.update(kv_transfer_params=dict(PREFILL_KV), stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    return leg


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    """The decode leg's body: the client's, with the prefill reply's kv_transfer_params."""
    return {**body, "kv_transfer_params": kv_transfer_params}


class DecodeChooser:
    """Prefill reply -> decode rank, with a saved signature plan's decode rule (safe across threads)."""

    def __init__(self, saved: SavedPlan):
        from repro.systems.signature import SignaturePlan

        if not isinstance(saved.plan, SignaturePlan):
            raise ConfigError(
                f"the decode plan {saved.source} was not saved by system=signature or signature_eldr (no "
                "signature.json); fit one with either system."
            )
        self.plan = saved.plan
        self.layer_ids, self.layout = saved.layer_ids, saved.layout
        self.num_ranks = saved.plan.parallel.devices
        self._lock = threading.Lock()
        saved.plan.reset()

    def experts(self, reply) -> np.ndarray:
        """int64[n, L, k] logical experts of the prompt from a prefill reply (TraceError: one sentence why not)."""
        choices = reply.get("choices") if isinstance(reply, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        if choice.get("routed_experts") is None:
            raise TraceError("the prefill reply has no choices[0].routed_experts; launch the prefill server with "
                             "--enable-return-routed-experts.")
        routed = moe_columns(decode_vllm(choice["routed_experts"]), self.layer_ids, self.layout.num_hidden_layers)
        if self.layout.top_k is not None and routed.shape[2] != self.layout.top_k:
            raise TraceError(f"the prefill server routes top-{routed.shape[2]}; the decode plan's model routes "
                             f"top-{self.layout.top_k}.")
        if routed.size and (routed.min() < 0 or routed.max() >= self.plan.placement.num_experts):
            raise TraceError(f"the prefill reply names experts outside 0..{self.plan.placement.num_experts - 1}; "
                             "the prefill server runs another model.")
        return routed

    def choose(self, experts_nLk: np.ndarray) -> int:
        """The decode rank of one request whose prompt routed to experts_nLk (the plan's counts advance by one)."""
        offsets = np.array([0, len(experts_nLk)])
        with self._lock:
            return int(self.plan.assign_decode(experts_nLk, offsets, np.zeros(1, dtype=np.int64))[0])
