"""Model-based routing: exact HF router capture for every family, and the cached tiny Mixtral."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from repro.errors import ConfigError, DataUnavailableError, WorkloadError
from repro.routing import hf_capture, tiny_model
from repro.routing.hf_capture import capture_routing, load_hf_model, moe_routers, route_with_hf_model
from repro.routing.tiny_model import (
    VocabMap,
    build_vocab_map,
    cache_key,
    check_tiny_config,
    route_with_tiny_model,
)
from repro.workloads.request import Request

VOCAB = 97
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
MLA = dict(
    num_key_value_heads=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    moe_intermediate_size=32,
)
# config class -> (kwargs, expected MoE layers, expected dense layers)
FAMILIES = {
    "MixtralConfig": (dict(num_local_experts=4, num_experts_per_tok=2), (0, 1, 2), ()),
    "Qwen2MoeConfig": (
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            mlp_only_layers=[1],
        ),
        (0, 2),
        (1,),
    ),
    "Qwen3MoeConfig": (
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0], head_dim=8),
        (1, 2),
        (0,),
    ),
    "OlmoeConfig": (dict(num_experts=4, num_experts_per_tok=2, eos_token_id=None, pad_token_id=0), (0, 1, 2), ()),
    "DeepseekV2Config": (
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=1,
            **MLA,
        ),
        (1, 2),
        (0,),
    ),
    "DeepseekV3Config": (dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, **MLA), (1, 2), (0,)),
}
# GPT-OSS keeps its router at mlp.router; a sliding window shorter than the longest request checks padding
FAMILIES["GptOssConfig"] = (
    dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=16),
    (0, 1, 2),
    (),
)
# families whose choice is top-k of the returned logits (softmax, when applied, is monotonic)
SOFTMAX_TOPK = ("MixtralConfig", "Qwen2MoeConfig", "Qwen3MoeConfig", "OlmoeConfig", "GptOssConfig")


def make_requests(lengths, seed=0, vocab=VOCAB) -> list[Request]:
    rng = np.random.default_rng(seed)
    # id 0 is the padding id of some configs: its zero embedding gives all-equal router logits (ties)
    return [
        Request(id=f"r{i}", dataset="unit", label=f"c{i % 2}", token_ids=rng.integers(1, vocab, n).astype(np.int32))
        for i, n in enumerate(lengths)
    ]


def build(family: str, seed: int = 0):
    kwargs, _, _ = FAMILIES[family]
    model = load_hf_model({"from_config": {"config_class": family, "kwargs": {**COMMON, **kwargs}}}, seed=seed)
    if family == "DeepseekV3Config":
        # a large correction bias makes the bias-aware, group-limited choice differ from topk(logits)
        gen = torch.Generator().manual_seed(seed)
        for _, router in moe_routers(model):
            router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=gen))
    return model


def capture(model, requests, **kw):
    return capture_routing(model, requests, model_name="m", tokenizer="tok", vocab_size=VOCAB, dataset="unit", **kw)


def reference_selection(family: str, model, logits_TE: np.ndarray, router) -> np.ndarray:
    """bool[T, E] experts each token must use, recomputed from the router's logits by the family's rule."""
    num_experts, top_k = router.num_experts, router.top_k
    if family in SOFTMAX_TOPK:
        choice_TE = logits_TE  # softmax is monotonic: top-k of probabilities = top-k of logits
    elif family == "DeepseekV2Config":
        scores = np.exp(logits_TE - logits_TE.max(1, keepdims=True))
        scores /= scores.sum(1, keepdims=True)
        groups = scores.reshape(len(scores), router.num_group, -1)
        best_groups = np.argsort(-groups.max(-1), axis=1)[:, : router.topk_group]
        keep = np.zeros(groups.shape[:2], bool)
        np.put_along_axis(keep, best_groups, True, axis=1)
        choice_TE = np.where(np.repeat(keep, num_experts // router.num_group, axis=1), scores, -np.inf)
    else:  # DeepSeek-V3: sigmoid + correction bias, groups ranked by the sum of their two best experts
        scores = 1 / (1 + np.exp(-logits_TE)) + router.e_score_correction_bias.numpy()
        groups = scores.reshape(len(scores), router.num_group, -1)
        group_score = np.sort(groups, axis=-1)[..., -2:].sum(-1)
        best_groups = np.argsort(-group_score, axis=1)[:, : router.topk_group]
        keep = np.zeros(groups.shape[:2], bool)
        np.put_along_axis(keep, best_groups, True, axis=1)
        choice_TE = np.where(np.repeat(keep, num_experts // router.num_group, axis=1), scores, -np.inf)
    chosen = np.zeros(logits_TE.shape, bool)
    np.put_along_axis(chosen, np.argsort(-choice_TE, axis=1)[:, :top_k], True, axis=1)
    return chosen


def as_mask(experts_Tk: np.ndarray, num_experts: int) -> np.ndarray:
    mask = np.zeros((len(experts_Tk), num_experts), bool)
    np.put_along_axis(mask, experts_Tk.astype(np.int64), True, axis=1)
    return mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_capture_records_each_family_routers_exact_choice(family):
    model = build(family)
    requests = make_requests([5, 17, 1, 30, 9])
    trace = capture(model, requests, batch_tokens=64)  # several requests per padded batch
    _, moe_layers, dense_layers = FAMILIES[family]
    routers = moe_routers(model)
    assert trace.meta.layer_ids == moe_layers and trace.meta.dense_layers == dense_layers
    assert [layer for layer, _ in routers] == list(moe_layers)
    assert trace.meta.num_experts == routers[0][1].num_experts and trace.meta.top_k == 2
    np.testing.assert_array_equal(trace.token_ids, np.concatenate([r.token_ids for r in requests]))
    np.testing.assert_array_equal(trace.lengths(), [5, 17, 1, 30, 9])
    np.testing.assert_array_equal(trace.prefill_len, trace.lengths())
    assert trace.request_ids == tuple(r.id for r in requests)
    for r, request in enumerate(requests):
        with torch.inference_mode():
            out = model(input_ids=torch.as_tensor(request.token_ids, dtype=torch.long)[None], output_router_logits=True)
        rows = slice(trace.offsets[r], trace.offsets[r + 1])
        for slot, (logits, (_, router)) in enumerate(zip(out.router_logits, routers, strict=True)):
            want = reference_selection(family, model, logits.float().numpy(), router)
            np.testing.assert_array_equal(as_mask(trace.experts[rows, slot], router.num_experts), want)
    w = trace.weights.astype(np.float32)
    assert np.all(np.diff(w, axis=-1) <= 0), "each token's experts are stored by descending gate weight"
    if family in ("MixtralConfig", "OlmoeConfig") and getattr(model.config, "norm_topk_prob", True):
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=2e-3)


def test_deepseek_v3_capture_differs_from_plain_topk_of_logits():
    """The hook records the bias-aware group-limited choice; recomputing topk(logits) would be wrong."""
    model = build("DeepseekV3Config")
    requests = make_requests([40, 40])
    trace = capture(model, requests)
    with torch.inference_mode():
        ids = torch.as_tensor(np.stack([r.token_ids for r in requests]), dtype=torch.long)
        logits = model(input_ids=ids, output_router_logits=True).router_logits[0].numpy()
    plain = np.argsort(-logits, axis=1)[:, :2]
    recorded = trace.experts[:, 0]
    differs = (as_mask(plain, 8) != as_mask(recorded, 8)).any(1)
    assert differs.mean() > 0.2


def test_batched_capture_equals_one_request_at_a_time():
    model = build("MixtralConfig")
    requests = make_requests([3, 50, 8, 8, 21, 1, 13], seed=3)
    alone = capture(model, requests, batch_tokens=1)
    batched = capture(model, requests, batch_tokens=10_000)
    np.testing.assert_array_equal(alone.experts, batched.experts)
    np.testing.assert_allclose(alone.weights.astype(np.float32), batched.weights.astype(np.float32), atol=2e-3)


def test_batches_respect_token_budget_and_cover_every_request():
    lengths = np.array([5, 30, 1, 12, 12, 40])
    groups = hf_capture._batches(lengths, batch_tokens=36)
    flat = np.concatenate(groups)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * lengths[g].max() <= 36
    # longest first: 40 > 36 goes alone, 30 alone (2 x 30 > 36), 3 x 12 = 36 fits, then the last one
    assert [g.tolist() for g in groups] == [[5], [1], [3, 4, 0], [2]]


def test_generation_appends_greedy_tokens_and_routes_them():
    model = build("MixtralConfig")
    model.generation_config.eos_token_id = None  # random model: never stop early
    requests = make_requests([4, 11, 7], seed=5)
    trace = capture(model, requests, batch_tokens=40, max_new_tokens=3)
    np.testing.assert_array_equal(trace.prefill_len, [4, 11, 7])
    np.testing.assert_array_equal(trace.lengths(), [7, 14, 10])
    assert trace.meta.extra["generated_tokens"] == 9
    for r, request in enumerate(requests):
        ids = torch.as_tensor(request.token_ids, dtype=torch.long)[None]
        with torch.inference_mode():
            greedy = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)[0].numpy()
        np.testing.assert_array_equal(trace.token_ids[trace.offsets[r] : trace.offsets[r + 1]], greedy)
    # routing of the generated tokens is the routing of the full sequence
    full = [
        Request(id=q.id, dataset="unit", label="", token_ids=trace.token_ids[a:b])
        for q, a, b in zip(requests, trace.offsets[:-1], trace.offsets[1:], strict=True)
    ]
    np.testing.assert_array_equal(capture(model, full).experts, trace.experts)


def test_restricted_vocabulary_maps_ids_and_never_generates_unk():
    model = build("MixtralConfig")
    model.generation_config.eos_token_id = None
    vocab = VocabMap(real_ids=np.arange(VOCAB - 1, dtype=np.int64) * 3, real_vocab_size=3 * VOCAB)  # model id 96 = UNK
    # force the UNK logit to win so generation would pick it unless suppressed
    with torch.no_grad():
        model.lm_head.weight[vocab.unk_id] = 100 * model.lm_head.weight.abs().max()
    requests = [Request(id="a", dataset="unit", label="", token_ids=np.array([0, 3, 7, 288], np.int32))]
    trace = capture_routing(
        model,
        requests,
        model_name="m",
        tokenizer="tok",
        vocab_size=3 * VOCAB,
        dataset="unit",
        input_ids_of=vocab.to_model,
        real_ids_of=vocab.to_real,
        max_new_tokens=2,
    )
    np.testing.assert_array_equal(trace.token_ids[:4], [0, 3, 7, 288])  # real ids kept, 7 went through UNK
    assert np.all(trace.token_ids[4:] % 3 == 0) and len(trace.token_ids) == 6
    routed_as = capture(model, [Request(id="a", dataset="unit", label="", token_ids=np.array([0, 1, 96, 96]))])
    np.testing.assert_array_equal(trace.experts[:4], routed_as.experts)


def test_generation_skips_model_rows_beyond_the_tokenizer_vocabulary():
    """Checkpoints often pad the embedding past the tokenizer; those rows have no text and are never emitted."""
    model = build("MixtralConfig")
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.lm_head.weight[95] = 100 * model.lm_head.weight.abs().max()  # would win every greedy step
    requests = make_requests([4, 6], vocab=90)
    trace = capture_routing(
        model, requests, model_name="m", tokenizer="tok", vocab_size=90, dataset="unit", max_new_tokens=2
    )
    assert trace.num_tokens == 14 and trace.token_ids.max() < 90


def test_dense_model_and_bad_inputs_raise_clear_errors(monkeypatch):
    dense = load_hf_model({"from_config": {"config_class": "LlamaConfig", "kwargs": {**COMMON}}}, seed=0)
    with pytest.raises(ConfigError, match="no MoE router"):
        moe_routers(dense)
    model = build("MixtralConfig")
    with pytest.raises(WorkloadError, match="no requests"):
        capture(model, [])
    with pytest.raises(WorkloadError, match="outside 0..96"):
        capture(model, [Request(id="x", dataset="unit", label="", token_ids=np.array([1, VOCAB]))])
    with pytest.raises(WorkloadError, match="no tokens"):
        capture(model, [Request(id="x", dataset="unit", label="", token_ids=np.array([], np.int32))])
    with pytest.raises(ConfigError, match="model's vocabulary"):
        capture_routing(
            model, make_requests([3], vocab=300), model_name="m", tokenizer="tok", vocab_size=300, dataset="unit"
        )
    with pytest.raises(ConfigError, match="not a transformers config class"):
        load_hf_model({"from_config": {"config_class": "NoSuchConfig"}}, seed=0)
    with pytest.raises(ConfigError, match="unknown keys"):
        route_with_hf_model(
            {"kind": "hf", "chekpoint": "x"},
            [],
            [],
            cache_dir=None,
            seed=0,
            dataset="d",
            tokenizer="t",
            vocab_size=VOCAB,
        )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataUnavailableError, match="HF_TOKEN.*tiny_mixtral"):
        load_hf_model({"checkpoint": "no-such-org/no-such-moe-model"}, seed=0)


def test_route_with_hf_model_from_config_and_local_checkpoint(tmp_path):
    kwargs = {**COMMON, **FAMILIES["Qwen2MoeConfig"][0]}
    cfg = {
        "kind": "hf",
        "name": "qwen-tiny",
        "dtype": "float32",
        "batch_tokens": 64,
        "from_config": {"config_class": "Qwen2MoeConfig", "kwargs": kwargs},
    }
    requests = make_requests([6, 9])
    args = dict(cache_dir=tmp_path, seed=1, dataset="unit", tokenizer="tok", vocab_size=VOCAB)
    trace = route_with_hf_model(cfg, requests, [], **args)
    assert (trace.meta.model, trace.meta.source, trace.meta.layer_ids) == ("qwen-tiny", "hf_capture", (0, 2))
    # the same weights saved as a local checkpoint route identically
    load_hf_model(cfg, seed=1).save_pretrained(tmp_path / "ckpt")
    local = route_with_hf_model({"kind": "hf", "checkpoint": str(tmp_path / "ckpt")}, requests, [], **args)
    np.testing.assert_array_equal(local.experts, trace.experts)
    assert local.meta.model == str(tmp_path / "ckpt")


# ---------------------------------------------------------------------------------------------- tiny model

TINY = dict(
    num_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_experts=4,
    top_k=2,
    num_attention_heads=2,
    vocab_top=64,
    seq_len=32,
    batch_size=4,
    max_steps=40,  # ~3 s; no time budget, so the run is step-limited and reproducible
    lr=3e-3,
)


def patterned_requests(count: int, seed: int, vocab: int = 1000) -> list[Request]:
    """Arithmetic runs (step 1 or 7 by class) over ~100 ids: next tokens are learnable, some ids are rare."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        step = 1 if i % 2 else 7
        start = int(rng.integers(0, 100))
        n = int(rng.integers(20, 50))
        out.append(
            Request(
                id=f"q{seed}-{i}",
                dataset="unit",
                label=str(step),
                token_ids=((start + step * np.arange(n)) % 100 * 9).astype(np.int32),
            )
        )
    return out


def test_build_vocab_map_hand_computed():
    tokens = np.array([5, 5, 5, 2, 2, 9, 9, 0])  # counts: 5:3, 2:2, 9:2, 0:1
    vocab = build_vocab_map(tokens, vocab_top=3, real_vocab_size=10)
    np.testing.assert_array_equal(vocab.real_ids, [5, 2, 9])  # tie 2 vs 9 -> smaller id first
    assert (vocab.unk_id, vocab.model_vocab_size) == (3, 4)
    np.testing.assert_array_equal(vocab.to_model([9, 0, 5, 7]), [2, 3, 0, 3])
    np.testing.assert_array_equal(vocab.to_real([0, 1, 2, 3]), [5, 2, 9, -1])
    assert build_vocab_map(tokens, vocab_top=100, real_vocab_size=10).model_vocab_size == 5  # only seen ids


def test_tiny_config_and_cache_key_checks():
    with pytest.raises(ConfigError, match="unknown keys"):
        check_tiny_config({"num_layer": 2})
    with pytest.raises(ConfigError, match="top_k=9 exceeds"):
        check_tiny_config({"top_k": 9, "num_experts": 8})
    with pytest.raises(ConfigError, match="not divisible"):
        check_tiny_config({"hidden_size": 30, "num_attention_heads": 4})
    for bad in (0, -1, float("nan"), "10", True):
        with pytest.raises(ConfigError, match="train_seconds"):
            check_tiny_config({"train_seconds": bad})
    assert check_tiny_config({})["train_seconds"] is None, "no time budget unless asked for"
    assert check_tiny_config({"train_seconds": 60})["train_seconds"] == 60
    cfg = check_tiny_config(TINY)
    tokens, lengths = np.arange(10), np.array([4, 6])
    key = cache_key(cfg, seed=0, tokenizer="t", vocab_size=10, tokens=tokens, lengths=lengths)
    assert key == cache_key(
        {**cfg, "capture_batch_tokens": 7, "name": "x", "train_seconds": 60},
        seed=0,
        tokenizer="t",
        vocab_size=10,
        tokens=tokens,
        lengths=lengths,
    )  # capture settings do not retrain; a budget does not either (a model it cuts short is never cached)
    for changed in (
        dict(cfg=dict(cfg, lr=1e-2)),
        dict(seed=1),
        dict(lengths=np.array([5, 5])),
        dict(tokens=np.arange(1, 11)),
    ):
        args = {**dict(cfg=cfg, seed=0, tokenizer="t", vocab_size=10, tokens=tokens, lengths=lengths), **changed}
        assert cache_key(args.pop("cfg"), **args) != key


def test_tiny_model_trains_caches_and_reproduces(tmp_path, monkeypatch):
    train, evaluate = patterned_requests(40, seed=0), patterned_requests(6, seed=1)
    args = dict(seed=0, dataset="unit", tokenizer="tok", vocab_size=1000)
    first = route_with_tiny_model(TINY, evaluate, train, cache_dir=tmp_path / "a", **args)
    extra = first.meta.extra
    assert (first.meta.source, first.meta.model, first.meta.vocab_size) == ("tiny_model", "tiny_mixtral", 1000)
    assert first.meta.layer_ids == (0, 1) and first.experts.shape == (first.num_tokens, 2, 2)
    np.testing.assert_array_equal(first.token_ids, np.concatenate([r.token_ids for r in evaluate]))
    assert (extra["steps"], extra["stopped_by"], extra["cache_hit"]) == (40, "max_steps", False), extra
    assert extra["eval_loss_after"] < extra["eval_loss_before"] - 0.5, "training lowered the held-out loss"
    assert extra["final_loss"] < extra["first_loss"]
    assert extra["model_vocab_size"] == 65 and 0.5 < extra["vocab_coverage"] < 1.0  # 100 ids seen, 64 kept
    entries = list((tmp_path / "a").iterdir())
    assert [p.name for p in entries] == [f"tiny_{extra['cache_key'][:16]}"]
    assert sorted(p.name for p in entries[0].iterdir()) == ["config.json", "model.safetensors", "vocab_map.npy"]
    assert extra["model_cached"] and "warnings" not in extra

    # second call: no training (it would raise), same routing, capture settings may differ
    def no_training(*a, **k):
        raise AssertionError("the cached model should have been reused")

    monkeypatch.setattr(tiny_model, "train_tiny_model", no_training)
    again = route_with_tiny_model(
        {**TINY, "capture_batch_tokens": 50}, evaluate, train, cache_dir=tmp_path / "a", **args
    )
    assert again.meta.extra["cache_hit"] and again.meta.extra["steps"] == 40
    np.testing.assert_array_equal(again.experts, first.experts)
    np.testing.assert_array_equal(again.weights, first.weights)
    monkeypatch.undo()

    # a fresh cache with the same config and seed trains the same weights (step-limited run)
    fresh = route_with_tiny_model(TINY, evaluate, train, cache_dir=tmp_path / "b", **args)
    assert not fresh.meta.extra["cache_hit"]
    np.testing.assert_array_equal(fresh.experts, first.experts)
    np.testing.assert_array_equal(fresh.weights, first.weights)


def test_training_and_capture_run_torchs_deterministic_kernels_on_one_thread(tmp_path, monkeypatch):
    # at the real size, CPU kernels without it made two trainings of one seed differ (issue: same seed, same numbers)
    seen = []
    real_train, real_capture = tiny_model.train_tiny_model, tiny_model.capture_routing

    def spy(real):
        def wrapped(*a, **k):
            seen.append((torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()))
            return real(*a, **k)
        return wrapped

    monkeypatch.setattr(tiny_model, "train_tiny_model", spy(real_train))
    monkeypatch.setattr(tiny_model, "capture_routing", spy(real_capture))
    before = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    trace = route_with_tiny_model(TINY, patterned_requests(4, seed=1), patterned_requests(10, seed=0),
                                  cache_dir=tmp_path, seed=0, dataset="unit", tokenizer="tok", vocab_size=1000)
    # one thread too: a GEMM's sums depend on the thread count (tests/test_seed_exact.py)
    assert seen == [(True, 1), (True, 1)] and (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()) == before
    assert (trace.meta.extra["device"], trace.meta.extra["torch_threads"]) == ("cpu", 1)


def test_an_explicit_time_budget_stops_training_warns_and_caches_nothing(tmp_path, caplog):
    cfg = {**TINY, "train_seconds": 0.5, "max_steps": 10**6}
    trace = route_with_tiny_model(
        cfg,
        patterned_requests(2, seed=1),
        patterned_requests(10, seed=0),
        cache_dir=tmp_path,
        seed=0,
        dataset="unit",
        tokenizer="tok",
        vocab_size=1000,
    )
    extra = trace.meta.extra
    assert extra["stopped_by"] == "train_seconds" and 1 <= extra["steps"] < 10**6
    assert extra["model_cached"] is False and not extra["cache_hit"]
    assert len(extra["warnings"]) == 1 and f"after {extra['steps']} of max_steps=1000000" in extra["warnings"][0]
    assert extra["warnings"][0] in caplog.text, "the cut is said in the log too"
    assert not any(tmp_path.iterdir()), "a model the budget cut short is never cached"


def test_tiny_model_rejects_bad_training_data(tmp_path):
    args = dict(cache_dir=tmp_path, seed=0, dataset="unit", tokenizer="tok", vocab_size=50)
    evaluate = make_requests([3], vocab=50)
    with pytest.raises(WorkloadError, match="needs training requests"):
        route_with_tiny_model(TINY, evaluate, [], **args)
    with pytest.raises(WorkloadError, match="training token id 55 is outside 0..49"):
        bad = Request(id="b", dataset="unit", label="", token_ids=np.array([1, 2, 55], np.int32))
        route_with_tiny_model(TINY, evaluate, [bad], **args)
    assert not any(tmp_path.iterdir()), "nothing is cached for a rejected input"


def test_conf_model_yamls_match_the_code(tmp_path):
    from pathlib import Path

    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf" / "model"
    tiny = OmegaConf.to_container(OmegaConf.load(conf / "tiny_mixtral.yaml"))
    assert check_tiny_config(tiny) == {**tiny_model.TINY_DEFAULTS, **tiny} and tiny == tiny_model.TINY_DEFAULTS
    hf = OmegaConf.to_container(OmegaConf.load(conf / "hf.yaml"))
    assert hf == hf_capture.HF_DEFAULTS | {"dtype": "bfloat16", "tokenizer": "hf:${model.checkpoint}"} and hf["kind"] == "hf"
