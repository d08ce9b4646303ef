"""The serving simulator's pricing as it was before the compiled fast path (issue 33 item 1), kept as the reference
the fast path is measured and tested against: `ReferenceEngine` (tests/test_sim_speed.py compares whole runs bit for
bit) and `reference_pricing()` (every Engine, subclasses included, prices the old way inside the block; bench_sim
and bench_disaggregated time both in one process).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from repro.sim.engine import Engine
from repro.sim.traffic import batch_traffic


def reference_cost_block(self, dec, segments, num_k):
    """Engine._cost_block as it was before the compiled path (gathered rows, traffic.batch_traffic, CostModel.block):
    the straightforward reference, kept verbatim."""
    req, groups = self.req, self.groups
    arange_k = np.arange(num_k)
    # decode rows: request b's input at iteration i is stream position pos[b] + i
    dec_group = self.rank[dec] if self.dp else np.zeros(len(dec), dtype=np.int64)
    dec_pos = self.pos[dec]
    rows = [req.stream[(req.stream_start[dec] + dec_pos)[None, :] + arange_k[:, None]].ravel()]
    row_group = [np.repeat(arange_k, len(dec))]
    row_home = [np.tile(dec_group, num_k)]
    count = np.bincount(dec_group, minlength=groups).astype(np.float64)
    base_pairs = np.bincount(dec_group, weights=dec_pos + 1, minlength=groups)
    seg = {
        "pairs_decode": base_pairs[None, :] + arange_k[:, None] * count[None, :],
        "kv_read": (base_pairs - count)[None, :] + arange_k[:, None] * count[None, :],
        "pairs_prefill": np.zeros((num_k, groups)),
        "tokens": np.tile(count, (num_k, 1)),
        "samples": np.tile(count, (num_k, 1)),
    }
    for r, q in segments:
        g = int(self.rank[r]) if self.dp else 0
        ctx = int(self.pos[r])
        start = req.stream_start[r] + ctx
        rows.append(req.stream[start : start + q])
        row_group.append(np.zeros(q, dtype=np.int64))
        row_home.append(np.full(q, g, dtype=np.int64))
        seg["pairs_prefill"][0, g] += q * ctx + q * (q + 1) / 2
        seg["kv_read"][0, g] += ctx
        seg["tokens"][0, g] += q
        seg["samples"][0, g] += ctx + q == req.prompt_len[r]
    rows_N = np.concatenate(rows)
    group_N = np.concatenate(row_group)
    experts_NLk = req.experts[rows_N]
    num_layers = experts_NLk.shape[1]
    slices = None
    if self.dp:
        home_N = np.concatenate(row_home)
        home_NL = np.broadcast_to(home_N[:, None], (len(home_N), num_layers))
        tokens_KD = seg["tokens"]
    else:
        home_NL, slices = self._tp_homes(rows_N, group_N, experts_NLk, num_k)
        tokens_KD = None
    traffic = batch_traffic(group_N, home_NL, experts_NLk, self.slot_table, self.spd, num_k, self.dpn)
    has_prefill = np.zeros(num_k, dtype=bool)
    has_prefill[0] = bool(segments)
    priced = self.cost.block(seg, traffic, tokens_KD, slices, has_prefill)
    activations = traffic.activations
    local = np.trace(activations, axis1=2, axis2=3).sum(axis=1)
    copies = traffic.copies.sum(axis=(1, 2, 3)) - np.trace(traffic.copies, axis1=2, axis2=3).sum(axis=1)
    stats = {
        "local_activations": local,
        "total_activations": activations.sum(axis=(1, 2, 3)),
        "remote_copies": copies,
        "tokens": np.bincount(group_N, minlength=num_k),
    }
    return priced["total"] + self.cfg.iteration_overhead, priced["moe"], stats


class ReferenceEngine(Engine):
    """The engine with the reference pricing."""

    _cost_block = reference_cost_block


@contextmanager
def reference_pricing():
    """Inside the block, Engine._cost_block (and so every subclass that does not override it) is the reference."""
    saved = Engine._cost_block
    Engine._cost_block = reference_cost_block
    try:
        yield
    finally:
        Engine._cost_block = saved
