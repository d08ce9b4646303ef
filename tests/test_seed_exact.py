"""Seed-exact tiny model (issue 18): weights independent of machine speed, cache entries that say how they were
made and are refused when they differ from the config, safe concurrent writers, an unwritable cache found early."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from repro.errors import ConfigError
from repro.routing import ROUTING_CACHE_VERSION, tiny_model
from repro.routing.tiny_model import check_tiny_config, load_or_train
from repro.workloads.request import Request

# a micro model: 6 steps of training take well under a second
MICRO = dict(
    num_layers=1,
    hidden_size=16,
    intermediate_size=16,
    num_experts=4,
    top_k=2,
    num_attention_heads=2,
    vocab_top=32,
    seq_len=16,
    batch_size=2,
    max_steps=6,
    lr=3e-3,
)
VOCAB = 200
ARGS = dict(seed=0, tokenizer="tok", vocab_size=VOCAB)


def train_requests() -> list[Request]:
    rng = np.random.default_rng(0)
    return [
        Request(id=f"t{i}", dataset="unit", label="", token_ids=rng.integers(0, VOCAB, 40).astype(np.int32))
        for i in range(6)
    ]


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(cache dir, entry path, model, vocab, record) of one micro model trained to max_steps."""
    cache = tmp_path_factory.mktemp("cache")
    model, vocab, record, hit = load_or_train(check_tiny_config(MICRO), train_requests(), cache_dir=cache, **ARGS)
    assert not hit
    (entry,) = cache.iterdir()
    return cache, entry, model, vocab, record


def test_a_slowed_clock_trains_the_same_weights(trained, tmp_path, monkeypatch):
    _, entry, model, _, record = trained
    # every clock read is one hour later: to a time budget this machine looks ~10^7 times slower
    clock = itertools.count(0.0, 3600.0)
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    slow, _, slow_record, hit = load_or_train(check_tiny_config(MICRO), train_requests(), cache_dir=tmp_path, **ARGS)
    assert not hit and slow_record["stats"]["seconds"] >= 3600 * MICRO["max_steps"], "the slowed clock was read"
    assert (slow_record["stats"]["steps"], slow_record["stats"]["stopped_by"]) == (MICRO["max_steps"], "max_steps")
    assert same_weights(slow, model)
    assert (tmp_path / entry.name / "model.safetensors").read_bytes() == (entry / "model.safetensors").read_bytes()
    assert slow_record["stats"]["final_loss"] == record["stats"]["final_loss"]

    # the same clock trips an explicit budget: that model is used once, warned about, and not cached
    budget = tmp_path / "budget"
    cut, _, cut_record, _ = load_or_train(
        check_tiny_config({**MICRO, "train_seconds": 60}), train_requests(), cache_dir=budget, **ARGS
    )
    assert cut_record["stats"]["stopped_by"] == "train_seconds" and cut_record["stats"]["steps"] < MICRO["max_steps"]
    assert "not cached" in cut_record["warnings"][0] and not same_weights(cut, model)
    assert not budget.exists() or not any(budget.iterdir())


def test_the_thread_count_does_not_change_the_weights(trained, tmp_path):
    """Multi-threaded GEMMs split their sums by the thread count: without one fixed training thread, this micro
    model's weights differed between 1 and 4 threads (measured 2026-12-02), under one cache key."""
    _, _, model, _, _ = trained
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        other, _, _, hit = load_or_train(check_tiny_config(MICRO), train_requests(), cache_dir=tmp_path, **ARGS)
        assert torch.get_num_threads() == 4, "the caller's thread count is restored"
    finally:
        torch.set_num_threads(previous)
    assert not hit and same_weights(other, model)


def test_a_cache_entry_records_how_it_was_made(trained):
    _, entry, _, _, record = trained
    written = json.loads((entry / "config.json").read_text())
    assert written["train_config"] == {k: check_tiny_config(MICRO)[k] for k in tiny_model.TRAIN_KEYS}
    assert "train_seconds" not in written["train_config"], "a budget does not change a full run's weights"
    assert (written["seed"], written["tokenizer"], written["vocab_size"]) == (0, "tok", VOCAB)
    assert written["stats"]["steps"] == MICRO["max_steps"] and written["stats"]["stopped_by"] == "max_steps"
    assert written["versions"]["torch"] == torch.__version__ and len(written["data_digest"]) == 64
    assert written["cache_key"].startswith(entry.name.removeprefix("tiny_"))


def _tamper(name):
    def set_lr(r):
        r["train_config"]["lr"] = 0.1

    def cut_short(r):
        r["stats"].update(steps=2, stopped_by="train_seconds")

    def other_seed(r):
        r["seed"] = 7

    def other_data(r):
        r["data_digest"] = "0" * 64

    def old_version(r):
        r["cache_version"] = 1

    return {"lr": set_lr, "cut_short": cut_short, "seed": other_seed, "data": other_data, "version": old_version}[name]


@pytest.mark.parametrize(
    "tamper, says",
    [
        ("lr", "train_config.lr=0.1 where this job has 0.003"),
        ("cut_short", "2 training steps (stopped by 'train_seconds') where this job trains max_steps=6"),
        ("seed", "seed=7 where this job has 0"),
        ("data", "data_digest='000"),
        ("version", f"cache_version=1 where this job has {ROUTING_CACHE_VERSION}"),
    ],
)
def test_a_job_refuses_an_entry_that_differs_from_its_config(trained, tmp_path, monkeypatch, tamper, says):
    _, entry, model, _, _ = trained
    copy = tmp_path / entry.name
    shutil.copytree(entry, copy)
    record = json.loads((copy / "config.json").read_text())
    _tamper(tamper)(record)
    (copy / "config.json").write_text(json.dumps(record))
    monkeypatch.setattr(tiny_model, "train_tiny_model", lambda *a, **k: pytest.fail("refused entries do not retrain"))
    with pytest.raises(ConfigError) as refused:
        load_or_train(check_tiny_config(MICRO), train_requests(), cache_dir=tmp_path, **ARGS)
    message = str(refused.value)
    assert says in message and str(copy) in message and "delete that directory" in message
    assert message.count(". ") == 0 and "\n" not in message, "one sentence"
    assert sorted(p.name for p in copy.iterdir()) == sorted(tiny_model.ENTRY_FILES), "the refused entry is kept"


def test_an_intact_copy_loads_and_broken_entries_are_refused(trained, tmp_path, monkeypatch):
    _, entry, model, _, _ = trained
    copy = tmp_path / entry.name
    shutil.copytree(entry, copy)
    monkeypatch.setattr(tiny_model, "train_tiny_model", lambda *a, **k: pytest.fail("a cache hit does not train"))
    loaded, _, _, hit = load_or_train(check_tiny_config(MICRO), train_requests(), cache_dir=tmp_path, **ARGS)
    assert hit and same_weights(loaded, model)
    # a budget does not change which full model a config means: the entry is reused
    _, _, _, hit = load_or_train(
        check_tiny_config({**MICRO, "train_seconds": 5}), train_requests(), cache_dir=tmp_path, **ARGS
    )
    assert hit

    (copy / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is unreadable .*delete that directory"):
        load_or_train(check_tiny_config(MICRO), train_requests(), cache_dir=tmp_path, **ARGS)
    (copy / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"lacks \['model.safetensors'\].*delete that directory"):
        load_or_train(check_tiny_config(MICRO), train_requests(), cache_dir=tmp_path, **ARGS)
    assert (copy / "config.json").read_text() == "{not json", "nothing the suite did not write whole is touched"


def test_an_unwritable_cache_dir_is_found_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_model, "train_tiny_model", lambda *a, **k: pytest.fail("trained before the check"))
    (tmp_path / "file").write_text("x")
    for unwritable in (tmp_path / "file" / "cache", tmp_path / "file"):
        with pytest.raises(ConfigError, match=f"cache_dir {unwritable} is not writable .*set cache_dir="):
            load_or_train(check_tiny_config(MICRO), train_requests(), cache_dir=unwritable, **ARGS)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_writer_that_loses_the_race_keeps_the_first_entry(trained, tmp_path, monkeypatch):
    """The entry appears while this process writes its own: the first one stays, whole, and nothing is raised."""
    _, entry, model, vocab, record = trained
    target = tmp_path / entry.name
    real_save = safetensors.torch.save_model

    def first_writer_finishes_meanwhile(*a, **k):
        if not target.exists():
            shutil.copytree(entry, target)
            (target / "config.json").write_text(json.dumps({**record, "writer": "first"}))
        return real_save(*a, **k)

    monkeypatch.setattr(safetensors.torch, "save_model", first_writer_finishes_meanwhile)
    assert tiny_model._write_entry(target, model, vocab, {**record, "writer": "second"}) is False
    assert json.loads((target / "config.json").read_text())["writer"] == "first"
    assert [p.name for p in tmp_path.iterdir()] == [entry.name], "the loser's temporary directory is gone"


def _write_after_barrier(barrier, target: str, model, vocab, record, writer: int) -> None:
    barrier.wait()
    published = tiny_model._write_entry(Path(target), model, vocab, {**record, "writer": writer})
    raise SystemExit(10 if published else 11)


def test_concurrent_writers_of_one_entry_leave_one_intact_entry(trained, tmp_path, monkeypatch):
    _, entry, model, vocab, record = trained
    target = tmp_path / entry.name
    ctx = multiprocessing.get_context("fork")  # the children inherit the model; they only serialise it
    barrier = ctx.Barrier(3)
    writers = [
        ctx.Process(target=_write_after_barrier, args=(barrier, str(target), model, vocab, record, i)) for i in range(3)
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    codes = sorted(w.exitcode for w in writers)
    assert codes == [10, 11, 11], f"one writer publishes, the others reuse it without an error: {codes}"
    assert [p.name for p in tmp_path.iterdir()] == [entry.name], "no temporary directory is left"
    assert json.loads((target / "config.json").read_text())["writer"] in (0, 1, 2)
    monkeypatch.setattr(tiny_model, "train_tiny_model", lambda *a, **k: pytest.fail("the entry is whole"))
    loaded, _, _, hit = load_or_train(check_tiny_config(MICRO), train_requests(), cache_dir=tmp_path, **ARGS)
    assert hit and same_weights(loaded, model)
