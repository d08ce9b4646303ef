import json

import numpy as np
import pytest

from repro.errors import TraceError
from repro.traces import (
    TraceMeta,
    concat_traces,
    make_trace,
    read_trace,
    select_requests,
    split_indices,
    split_trace,
    trace_digest,
    write_trace,
)


def small_trace(num_requests=10, num_experts=8, top_k=2, layers=3, seed=0, weights=True):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 20, num_requests)
    n = int(lengths.sum())
    experts = np.argsort(rng.random((n, layers, num_experts)), axis=2)[:, :, :top_k]
    meta = TraceMeta(model="toy", num_experts=num_experts, top_k=top_k, layer_ids=tuple(range(1, layers + 1)),
                     vocab_size=100, dataset="toy")
    return make_trace(
        meta,
        np.concatenate([[0], np.cumsum(lengths)]),
        rng.integers(0, 100, n),
        experts,
        prefill_len=lengths - rng.integers(0, 1, num_requests),
        request_labels=[f"c{i % 3}" for i in range(num_requests)],
        weights=rng.random((n, layers, top_k)) if weights else None,
    )


def assert_same(a, b):
    assert a.meta == b.meta
    for name in ("offsets", "token_ids", "experts", "prefill_len"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert (a.request_ids, a.request_datasets, a.request_labels) == (b.request_ids, b.request_datasets, b.request_labels)
    if a.weights is None:
        assert b.weights is None
    else:
        np.testing.assert_array_equal(a.weights, b.weights)


@pytest.mark.parametrize("weights", [True, False])
def test_round_trip(tmp_path, weights):
    t = small_trace(weights=weights)
    write_trace(t, tmp_path / "t")
    back = read_trace(tmp_path / "t")
    assert isinstance(back.experts, np.memmap)
    assert_same(t, back)
    # overwriting replaces atomically and leaves no temp dirs behind
    write_trace(small_trace(seed=1, weights=weights), tmp_path / "t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_split_is_by_request_seeded_and_complete():
    t = small_trace(num_requests=50)
    prof, ev = split_trace(t, 0.2, np.random.default_rng(3))
    assert prof.num_requests == 10 and ev.num_requests == 40
    assert sorted(prof.request_ids + ev.request_ids, key=int) == list(t.request_ids)
    prof2, _ = split_trace(t, 0.2, np.random.default_rng(3))
    assert_same(prof, prof2)
    # each request's tokens travel with it
    r = int(prof.request_ids[0])
    np.testing.assert_array_equal(prof.experts[: prof.lengths()[0]], t.experts[t.offsets[r]: t.offsets[r + 1]])


def test_select_and_concat_invert_a_split():
    t = small_trace(num_requests=12)
    parts = [select_requests(t, range(0, 5)), select_requests(t, range(5, 12))]
    assert_same(concat_traces(parts), t)


def test_prompt_mask_and_request_of_token():
    t = small_trace(num_requests=4)
    assert t.prompt_mask().sum() == t.prefill_len.sum()
    np.testing.assert_array_equal(np.bincount(t.request_of_token(), minlength=4), t.lengths())


# ---- one test per validation error -------------------------------------------------------------------------


def test_rejects_expert_id_out_of_range():
    t = small_trace()
    with pytest.raises(TraceError, match="expert id 8 is outside 0..7"):
        make_trace(t.meta, t.offsets, t.token_ids, np.where(t.experts == 0, 8, t.experts))


def test_rejects_non_monotonic_offsets():
    t = small_trace()
    off = t.offsets.copy()
    off[3], off[4] = off[4], off[3]
    with pytest.raises(TraceError, match="not monotonic"):
        make_trace(t.meta, off, t.token_ids, t.experts)


def test_rejects_shape_mismatch_with_meta():
    t = small_trace()
    with pytest.raises(TraceError, match="experts has shape"):
        make_trace(t.meta, t.offsets, t.token_ids, t.experts[:, :2])


def test_rejects_token_count_mismatch():
    t = small_trace()
    with pytest.raises(TraceError, match="token_ids has shape"):
        make_trace(t.meta, t.offsets, t.token_ids[:-1], t.experts)


def test_rejects_token_id_beyond_vocab():
    t = small_trace()
    with pytest.raises(TraceError, match="token id 100 is outside"):
        make_trace(t.meta, t.offsets, np.full_like(t.token_ids, 100), t.experts)


def test_rejects_prefill_longer_than_request():
    t = small_trace()
    with pytest.raises(TraceError, match="prefill_len"):
        make_trace(t.meta, t.offsets, t.token_ids, t.experts, prefill_len=t.lengths() + 1)


def test_rejects_truncated_array_file(tmp_path):
    write_trace(small_trace(), tmp_path / "t")
    f = tmp_path / "t" / "experts.npy"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(TraceError, match="truncated or corrupted"):
        read_trace(tmp_path / "t")


def test_rejects_corrupted_meta(tmp_path):
    write_trace(small_trace(), tmp_path / "t")
    (tmp_path / "t" / "meta.json").write_text('{"model": ')
    with pytest.raises(TraceError, match="meta.json is truncated or corrupted"):
        read_trace(tmp_path / "t")


def test_rejects_meta_inconsistent_with_arrays(tmp_path):
    write_trace(small_trace(), tmp_path / "t")
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    meta["top_k"] = 3
    (tmp_path / "t" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TraceError, match="experts has shape"):
        read_trace(tmp_path / "t")


def test_rejects_missing_file_and_pickled_array(tmp_path):
    write_trace(small_trace(), tmp_path / "t")
    (tmp_path / "t" / "offsets.npy").unlink()
    with pytest.raises(TraceError, match="missing offsets.npy"):
        read_trace(tmp_path / "t")
    np.save(tmp_path / "t" / "offsets.npy", np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(TraceError, match="truncated or corrupted"):
        read_trace(tmp_path / "t")


def test_rejects_wrong_dtype_on_disk(tmp_path):
    write_trace(small_trace(), tmp_path / "t")
    np.save(tmp_path / "t" / "experts.npy", np.load(tmp_path / "t" / "experts.npy").astype(np.int64))
    with pytest.raises(TraceError, match="dtype int64"):
        read_trace(tmp_path / "t")


def test_failed_write_leaves_nothing(tmp_path):
    t = small_trace()
    bad = t.__class__(**{**t.__dict__, "prefill_len": t.prefill_len[:-1]})
    with pytest.raises(TraceError):
        write_trace(bad, tmp_path / "t")
    assert list(tmp_path.iterdir()) == []


def test_split_rejects_bad_fraction():
    with pytest.raises(TraceError, match="profile_fraction"):
        split_trace(small_trace(), 1.5)


def test_three_way_split_is_disjoint_complete_and_keeps_the_profile():
    split = split_indices(100, 0.2, np.random.default_rng(5), validate_fraction=0.1)
    assert (len(split.profile), len(split.validate), len(split.evaluate)) == (20, 10, 70)
    assert sorted(np.concatenate(split).tolist()) == list(range(100))
    # the profile part (what routing models train on) does not move when the validate share changes
    two_way = split_indices(100, 0.2, np.random.default_rng(5))
    np.testing.assert_array_equal(two_way.profile, split.profile)
    assert len(two_way.validate) == 0
    with pytest.raises(TraceError, match="validate_fraction"):
        split_indices(100, 0.5, validate_fraction=0.5)
    with pytest.raises(TraceError, match="empty"):
        split_indices(5, 0.2, validate_fraction=0.05)


def test_a_token_listing_one_expert_twice_is_rejected():
    t = small_trace()
    experts = np.array(t.experts)
    experts[7, 1] = [3, 3]
    with pytest.raises(TraceError, match="token 7 lists expert 3 twice at MoE layer index 1"):
        make_trace(t.meta, t.offsets, t.token_ids, experts, prefill_len=t.prefill_len)


def test_digest_changes_with_routing_only():
    t = small_trace()
    assert trace_digest(t) == trace_digest(select_requests(t, range(t.num_requests)))
    experts = np.array(t.experts)
    experts[0, 0] = experts[0, 0][::-1]
    changed = make_trace(t.meta, t.offsets, t.token_ids, experts, prefill_len=t.prefill_len,
                         request_labels=t.request_labels, weights=t.weights)
    assert trace_digest(changed) != trace_digest(t)
