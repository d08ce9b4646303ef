"""The engine's Attention-DP steps between two Python events, compiled (issue 33 item 1).

`Engine.run` keeps the event loop (arrivals, the plan's request scheduler, any other event a caller queues); an
engine step (commit the block that ended, form the next batch, count and price it, schedule its end) runs here, and
so do the steps after it as long as each ends before the next queued event and within the horizon: most blocks never
return to Python. Each function mirrors the Engine method of the same name (`_form`, `_start`, `_commit`,
`_finish`, `_cost_block`; read those first: they are the definition) statement for statement, with the same
integer and float operations in the same order, so a run gives the Python loop's numbers bit for bit
(tests/test_sim_speed.py compares both with the reference pricing of bench/sim_reference.py).

Why: a block's own Python work (forming the batch over the ranks, a dozen small numpy calls to account its
iterations, the commit) cost ~250 us per block on this machine, more than counting and pricing it; the rate sweep of
`python -m bench --only sim` runs ~2 blocks per request.

State (all owned by the Engine, changed in place): per request r < R of the run int64 rank / pos / gen /
wait_next, bool decoding, float64 first_token / finish; per rank g < G int64 running, kv_used, backlog (prompt
tokens not yet prefilled), dec_count (decoding requests), wait_head / wait_tail / wait_size (a FIFO linked through
wait_next), pf_len and pf[G, max_running] (requests in prefill, in admission order); the block in flight: fl_dec
int64[R], fl_seg int64[2, G x (max_running + 1)] (request, tokens), fl int64[3] (decode requests, segments,
iterations executed). Memory: ~65 bytes of state per request (its stream id included) + 4 x G bytes of prompt-cache
keys per request stream; per block, the rows' homes int64[N, L] (N <= G x max_batched_tokens) beside the counting
tables (freed when the block is priced).

Legend: R requests, G attention ranks (= D), K iterations in a block, N token rows, L MoE layers, C cost components,
D devices, E experts, P physical slots, S segments.
"""

from __future__ import annotations

import numba
import numpy as np

from repro.sim.costs import _count_price, _pairwise_sum

# acc int64 slots: what RunResult sums (written back when the run returns) and the events handled here
ACC_ITERATIONS, ACC_BLOCKS, ACC_PREFILL_ITERATIONS, ACC_LOCAL, ACC_TOTAL, ACC_REMOTE, ACC_TOKENS = range(7)
ACC_WINDOW_PREFILL_TOKENS, ACC_EVENTS = 7, 8
ACC_SIZE = 9
# accf float64 slots
ACCF_BUSY, ACCF_LAST_DT = 0, 1
# return values of `serve`
IDLE, BUSY, A2A_ERROR, BAD_ROW = 0, 1, 2, 3


@numba.njit(cache=True, nogil=True)
def _block_rows(stream, stream_start, prompt_len, pos, dec, dec_group, seg_r, seg_q, seg_g, seg_rows, num_k, groups):
    """A block's token rows and attention sums (the engine's rule, in `_cost_block`'s former numpy form, float
    operations in its order): rows int64[N] compact rows (decode rows iteration-major, then the rows of the prefill
    segments with seg_rows set), group int64[N] iteration, home int64[N] attention group, seg5 float64[5, K, G]
    (costs.SEG_KEYS), tokens int64[K] (every segment's).
    """  # pragma: no cover (compiled)
    num_dec = dec.shape[0]
    num_rows = num_dec * num_k
    for j in range(seg_r.shape[0]):
        if seg_rows[j]:
            num_rows += seg_q[j]
    rows = np.empty(num_rows, dtype=np.int64)
    group = np.empty(num_rows, dtype=np.int64)
    home = np.empty(num_rows, dtype=np.int64)
    for i in range(num_k):
        for b in range(num_dec):
            r = dec[b]
            rows[i * num_dec + b] = stream[stream_start[r] + pos[r] + i]
            group[i * num_dec + b] = i
            home[i * num_dec + b] = dec_group[b]
    count = np.zeros(groups)
    base_pairs = np.zeros(groups)
    for b in range(num_dec):
        count[dec_group[b]] += 1.0
        base_pairs[dec_group[b]] += float(pos[dec[b]] + 1)
    seg5 = np.zeros((5, num_k, groups))
    tokens = np.full(num_k, num_dec, dtype=np.int64)
    for i in range(num_k):
        for g in range(groups):
            seg5[1, i, g] = base_pairs[g] + float(i) * count[g]
            seg5[2, i, g] = (base_pairs[g] - count[g]) + float(i) * count[g]
            seg5[3, i, g] = count[g]
            seg5[4, i, g] = count[g]
    n = num_dec * num_k
    for j in range(seg_r.shape[0]):
        r, q, g = seg_r[j], seg_q[j], seg_g[j]
        ctx = pos[r]
        start = stream_start[r] + ctx
        if seg_rows[j]:
            for t in range(q):
                rows[n + t] = stream[start + t]
                group[n + t] = 0
                home[n + t] = g
            n += q
        seg5[0, 0, g] += q * ctx + q * (q + 1) / 2
        seg5[2, 0, g] += ctx
        seg5[3, 0, g] += q
        seg5[4, 0, g] += 1.0 if ctx + q == prompt_len[r] else 0.0
        tokens[0] += q
    return rows, group, home, seg5, tokens


@numba.njit(cache=True, nogil=True)
def experts_in_range(experts_RLk, num_experts):  # pragma: no cover (compiled)
    """True when every expert id lies in [0, num_experts) (the compiled steps then never meet a bad row)."""
    flat = experts_RLk.ravel()
    for i in range(flat.shape[0]):
        if flat[i] < 0 or flat[i] >= num_experts:
            return False
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _admissible(g, wait_head, wait_size, running, kv_used, prompt_len, output_len, max_running, kv_capacity):
    """Engine._admissible."""  # pragma: no cover (compiled)
    if wait_size[g] == 0 or running[g] >= max_running:
        return False
    r = wait_head[g]
    return kv_used[g] + prompt_len[r] + output_len[r] <= kv_capacity


@numba.njit(cache=True, nogil=True, inline="always")
def _pop_waiting(g, wait_head, wait_tail, wait_size, wait_next):  # pragma: no cover (compiled)
    r = wait_head[g]
    wait_head[g] = wait_next[r]
    wait_size[g] -= 1
    if wait_size[g] == 0:
        wait_head[g] = -1
        wait_tail[g] = -1
    return r


@numba.njit(cache=True, nogil=True)
def _form(prompt_len, output_len, rank, pos, gen, decoding, running, kv_used, wait_head, wait_tail, wait_size,
          wait_next, pf, pf_len, max_batched, max_running, kv_capacity, prefill_first, prefilled_admission, fl_dec,
          fl_seg, fl):  # pragma: no cover (compiled)
    """Engine._form into the in-flight buffers: fl_dec[:fl[0]] decode requests (ascending), fl_seg[:, :fl[1]]
    prefill segments (request, tokens). prefilled_admission: DecodeEngine._form's admission first (requests enter
    decoding, their prompt already in the KV cache)."""
    groups = running.shape[0]
    if prefilled_admission:
        for g in range(groups):
            while _admissible(g, wait_head, wait_size, running, kv_used, prompt_len, output_len, max_running,
                              kv_capacity):
                r = _pop_waiting(g, wait_head, wait_tail, wait_size, wait_next)
                running[g] += 1
                kv_used[g] += prompt_len[r] + output_len[r]
                pos[r] = prompt_len[r]
                gen[r] = 1
                decoding[r] = True
    num_dec = 0
    n_dec = np.zeros(groups, dtype=np.int64)
    for r in range(decoding.shape[0]):
        if decoding[r]:
            fl_dec[num_dec] = r
            num_dec += 1
            n_dec[rank[r]] += 1
    stalled = np.zeros(groups, dtype=np.bool_)
    any_stalled = False
    num_seg = 0
    for g in range(groups):
        if prefill_first:
            if not (pf_len[g] > 0 or _admissible(g, wait_head, wait_size, running, kv_used, prompt_len, output_len,
                                                 max_running, kv_capacity)):
                continue
            stalled[g] = n_dec[g] > 0
            any_stalled = any_stalled or stalled[g]
            budget = max_batched
        else:
            budget = max_batched - n_dec[g]
        for i in range(pf_len[g]):
            if budget <= 0:
                break
            r = pf[g, i]
            q = min(prompt_len[r] - pos[r], budget)
            fl_seg[0, num_seg] = r
            fl_seg[1, num_seg] = q
            num_seg += 1
            budget -= q
        while budget > 0 and _admissible(g, wait_head, wait_size, running, kv_used, prompt_len, output_len,
                                         max_running, kv_capacity):
            r = _pop_waiting(g, wait_head, wait_tail, wait_size, wait_next)
            pf[g, pf_len[g]] = r
            pf_len[g] += 1
            running[g] += 1
            kv_used[g] += prompt_len[r] + output_len[r]
            q = min(prompt_len[r], budget)
            fl_seg[0, num_seg] = r
            fl_seg[1, num_seg] = q
            num_seg += 1
            budget -= q
    if any_stalled:
        kept = 0
        for b in range(num_dec):
            if not stalled[rank[fl_dec[b]]]:
                fl_dec[kept] = fl_dec[b]
                kept += 1
        num_dec = kept
    fl[0] = num_dec
    fl[1] = num_seg


@numba.njit(cache=True, nogil=True)
def _finish(r, now, prompt_len, output_len, rank, decoding, running, kv_used, dec_count,
            finish):  # pragma: no cover (compiled)
    """Engine._finish of one request."""
    finish[r] = now
    g = rank[r]
    if decoding[r]:
        dec_count[g] -= 1
    decoding[r] = False
    running[g] -= 1
    kv_used[g] -= prompt_len[r] + output_len[r]


@numba.njit(cache=True, nogil=True)
def _commit(now, prompt_len, output_len, rank, pos, gen, decoding, running, kv_used, backlog, dec_count, pf, pf_len,
            first_token, finish, fl_dec, fl_seg, fl):  # pragma: no cover (compiled)
    """Engine._commit of the block in flight."""
    executed = fl[2]
    for b in range(fl[0]):
        r = fl_dec[b]
        pos[r] += executed
        gen[r] += executed
    for b in range(fl[0]):
        r = fl_dec[b]
        if gen[r] == output_len[r]:
            _finish(r, now, prompt_len, output_len, rank, decoding, running, kv_used, dec_count, finish)
    for j in range(fl[1]):
        r, q = fl_seg[0, j], fl_seg[1, j]
        g = rank[r]
        pos[r] += q
        backlog[g] -= q
        if pos[r] == prompt_len[r]:
            i = 0
            while pf[g, i] != r:
                i += 1
            for m in range(i, pf_len[g] - 1):
                pf[g, m] = pf[g, m + 1]
            pf_len[g] -= 1
            first_token[r] = now
            gen[r] = 1
            if output_len[r] == 1:
                _finish(r, now, prompt_len, output_len, rank, decoding, running, kv_used, dec_count, finish)
            else:
                decoding[r] = True
                dec_count[g] += 1


@numba.njit(cache=True, nogil=True)
def _cost_block(num_k, overhead, prompt_len, stream_start, stream, stream_id, experts, rank, pos, fl_dec, fl_seg, fl,
                groups, slot_table, device_table, device_bits, num_slots, plan_dpn, num_nodes, kinds, node, one_node,
                hw_dpn, phase_params, phase_bytes, m0, m1, m2, m3, c, expert_table, slot_seconds, gate_table,
                cache_key, cache_meta, cache_counts, cache_stats):  # pragma: no cover (compiled)
    """Engine._cost_block (Attention-DP, the compiled pricing) with Engine._counted_prompts' cache: cache_key
    int32[streams, G] per (request stream, rank) -2 unseen, -1 seen once, else the slot of its kept counts in
    cache_counts int32[capacity, L, W] / cache_stats int64[capacity, 3]; cache_meta int64[2] (kept, capacity).
    Returns (status of costs._count_price, total float64[K] with the overhead, moe float64[K, L, C], stats int64[K,
    3], tokens int64[K])."""
    num_dec, num_seg = fl[0], fl[1]
    dec = fl_dec[:num_dec]
    dec_group = np.empty(num_dec, dtype=np.int64)
    for b in range(num_dec):
        dec_group[b] = rank[dec[b]]
    seg_r = fl_seg[0, :num_seg].copy()
    seg_q = fl_seg[1, :num_seg].copy()
    seg_g = np.empty(num_seg, dtype=np.int64)
    for j in range(num_seg):
        seg_g[j] = rank[seg_r[j]]
    rows_needed = np.ones(num_seg, dtype=np.bool_)
    hit_slot = np.empty(num_seg, dtype=np.int64)
    hit_home = np.empty(num_seg, dtype=np.int64)
    miss = np.empty((4, num_seg), dtype=np.int64)  # start, length, home, slot of prompts counted first
    hits = 0
    misses = 0
    for j in range(num_seg):
        r, q, g = seg_r[j], seg_q[j], seg_g[j]
        if pos[r] != 0 or q != prompt_len[r]:
            continue
        key = cache_key[stream_id[r], g]
        if key < 0:
            if key == -2:  # kept from its second sighting on: a single run pays nothing
                cache_key[stream_id[r], g] = -1
                continue
            if cache_meta[0] >= cache_meta[1]:
                continue
            key = cache_meta[0]
            cache_meta[0] += 1
            cache_key[stream_id[r], g] = key
            miss[0, misses], miss[1, misses], miss[2, misses], miss[3, misses] = stream_start[r], q, g, key
            misses += 1
        hit_slot[hits] = key
        hit_home[hits] = g
        hits += 1
        rows_needed[j] = False
    rows_N, group_N, home_N, seg5, tokens_K = _block_rows(stream, stream_start, prompt_len, pos, dec, dec_group, seg_r,
                                                          seg_q, seg_g, rows_needed, num_k, groups)
    num_layers = experts.shape[1]
    home_NL = np.empty((rows_N.shape[0], num_layers), dtype=np.int64)
    for n in range(rows_N.shape[0]):
        home_NL[n, :] = home_N[n]
    kinds_K = np.full(num_k, kinds[1], dtype=np.int64)  # CostModel.count_and_price: deepep_auto by prefill
    if num_seg > 0:
        kinds_K[0] = kinds[0]
    total = np.empty(num_k)
    moe = np.empty((num_k, num_layers, 6))
    stats = np.zeros((num_k, 3), dtype=np.int64)
    status = _count_price(rows_N, group_N, home_NL, experts, slot_table, device_table, device_bits, num_slots,
                          plan_dpn, num_nodes, False, seg5, np.zeros((num_k, 0, 0), dtype=np.int64), kinds_K, node,
                          one_node, hw_dpn, phase_params, phase_bytes, m0, m1, m2, m3, c, expert_table, slot_seconds,
                          gate_table, cache_counts, cache_stats, hit_slot[:hits], hit_home[:hits], stream,
                          miss[0, :misses].copy(), miss[1, :misses].copy(), miss[2, :misses].copy(),
                          miss[3, :misses].copy(), total, moe, stats)
    for i in range(num_k):
        total[i] = total[i] + overhead
    return status, total, moe, stats, tokens_K


@numba.njit(cache=True, nogil=True)
def serve(commit_first, start, now, next_event, until, window_lo, window_hi,
          prompt_len, output_len, stream_start, stream, stream_id, experts,
          rank, pos, gen, decoding, first_token, finish, wait_next,
          running, kv_used, backlog, dec_count, wait_head, wait_tail, wait_size, pf, pf_len,
          fl_dec, fl_seg, fl, acc, accf, moe_sum, window_moe, window_iterations, window_seconds, window_tokens,
          cfg_i, overhead,
          slot_table, device_table, device_bits, num_slots, plan_dpn, num_nodes, kinds, node, one_node, hw_dpn,
          phase_params, phase_bytes, m0, m1, m2, m3, c, expert_table, slot_seconds, gate_table,
          cache_key, cache_meta, cache_counts, cache_stats, end_out):  # pragma: no cover (compiled)
    """The STEP_END at `now` (commit_first: commit the block in flight; start False: only that) and the steps after
    it while each ends before next_event (the next queued event's time, +inf if none; an event at the same time comes
    first: it has the lower priority or was queued earlier) and at or before `until`. Returns IDLE (nothing to run or
    not started), BUSY (a block in flight ending at end_out[0]: Engine.run queues its
    STEP_END), A2A_ERROR or BAD_ROW (costs._count_price declined; the engine raises). cfg_i int64[6]: max batched
    tokens, max running requests, KV capacity, max block iterations, 1 for prefill_first, 1 for DecodeEngine's
    prefilled admission."""
    max_batched, max_running, kv_capacity, max_block = cfg_i[0], cfg_i[1], cfg_i[2], cfg_i[3]
    prefill_first = cfg_i[4] == 1
    prefilled_admission = cfg_i[5] == 1
    groups = running.shape[0]
    if commit_first:
        _commit(now, prompt_len, output_len, rank, pos, gen, decoding, running, kv_used, backlog, dec_count, pf, pf_len,
                first_token, finish, fl_dec, fl_seg, fl)
    if not start:  # a plan change begins at this boundary (Engine.run)
        return IDLE
    while True:
        # Engine._start
        _form(prompt_len, output_len, rank, pos, gen, decoding, running, kv_used, wait_head, wait_tail, wait_size,
              wait_next, pf, pf_len, max_batched, max_running, kv_capacity, prefill_first, prefilled_admission, fl_dec,
              fl_seg, fl)
        num_dec, num_seg = fl[0], fl[1]
        if num_dec == 0 and num_seg == 0:
            return IDLE
        num_k = 1
        if num_seg == 0:
            room = output_len[fl_dec[0]] - gen[fl_dec[0]]
            for b in range(1, num_dec):
                room = min(room, output_len[fl_dec[b]] - gen[fl_dec[b]])
            num_k = min(room, max_block)
            if np.isfinite(next_event):
                estimate = (next_event - now) / accf[ACCF_LAST_DT] * 1.25 + 1
                bound = estimate if estimate > 1 else 1.0  # Python's max(1, estimate), then min(num_k, bound)
                if bound < num_k:
                    num_k = int(bound)
        status, total, moe, stats, tokens = _cost_block(
            num_k, overhead, prompt_len, stream_start, stream, stream_id, experts, rank, pos, fl_dec, fl_seg, fl,
            groups, slot_table, device_table, device_bits, num_slots, plan_dpn, num_nodes, kinds, node, one_node,
            hw_dpn, phase_params, phase_bytes, m0, m1, m2, m3, c, expert_table, slot_seconds, gate_table, cache_key,
            cache_meta, cache_counts, cache_stats)
        if status == 1:
            return BAD_ROW
        if status == 2:
            return A2A_ERROR
        ends = np.empty(num_k)
        end = now
        for i in range(num_k):
            end = end + total[i]
            ends[i] = end
        executed = num_k
        if np.isfinite(next_event):
            before = 0  # np.searchsorted(ends, next_event, "left"): ends are non-decreasing
            while before < num_k and ends[before] < next_event:
                before += 1
            executed = min(before + 1, num_k)
        accf[ACCF_LAST_DT] = total[executed - 1]
        acc[ACC_ITERATIONS] += executed
        acc[ACC_BLOCKS] += 1
        acc[ACC_PREFILL_ITERATIONS] += 1 if num_seg > 0 else 0
        accf[ACCF_BUSY] += _pairwise_sum(total, 0, executed)
        # numpy's sum over axis 0 adds the rows in order, then the engine adds that sum
        block_moe = moe[0].copy()
        for i in range(1, executed):
            block_moe += moe[i]
        moe_sum += block_moe
        for i in range(executed):
            acc[ACC_TOTAL] += stats[i, 0]
            acc[ACC_LOCAL] += stats[i, 1]
            acc[ACC_REMOTE] += stats[i, 2]
            acc[ACC_TOKENS] += tokens[i]
        inside = np.empty(executed, dtype=np.int64)
        count = 0
        for i in range(executed):
            start = now if i == 0 else ends[i - 1]
            if start >= window_lo and start < window_hi:
                inside[count] = i
                count += 1
        if count > 0:
            phase = 0 if num_seg > 0 else 1  # a block with prefill segments is one iteration
            window_block = moe[inside[0]].copy()
            selected = np.empty(count)
            selected[0] = total[inside[0]]
            tokens_in = tokens[inside[0]]
            for i in range(1, count):
                window_block += moe[inside[i]]
                selected[i] = total[inside[i]]
                tokens_in += tokens[inside[i]]
            window_moe[phase] += window_block
            window_iterations[phase] += count
            window_seconds[phase] += _pairwise_sum(selected, 0, count)
            window_tokens[phase] += tokens_in
            for j in range(num_seg):
                acc[ACC_WINDOW_PREFILL_TOKENS] += fl_seg[1, j]
        fl[2] = executed
        end = ends[executed - 1]
        end_out[0] = end
        if not end < next_event or end > until:  # Engine.run pops the next event first, or stops at the horizon
            return BUSY
        acc[ACC_EVENTS] += 1  # this STEP_END, popped here instead of from the queue
        now = end
        _commit(now, prompt_len, output_len, rank, pos, gen, decoding, running, kv_used, backlog, dec_count, pf, pf_len,
                first_token, finish, fl_dec, fl_seg, fl)
