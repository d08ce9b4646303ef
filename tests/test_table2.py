"""Table 2 protocol: fixed-length inputs packed from real prompts (workload.input_len), the reductions both ways
the paper's numbers read, and the table built from finished jobs under a runs folder."""

import json

import numpy as np
import pandas as pd
import pytest

from repro.errors import ConfigError, ReproError, WorkloadError
from repro.figures.jobs import read_jobs
from repro.figures.table2 import main, paper_reductions, reductions, table2_frame, table2_section
from repro.workloads import load_tokenizer, load_workload
from repro.workloads.config import check_workload
from repro.workloads.registry import pack_prompts

# ---------------------------------------------------------------- packing prompts into fixed-length inputs


def test_pack_prompts_by_hand():
    # used lengths (cut at 6) 3 5 2 6 1 4, starts at 0 3 8 10 16 17, total 21
    lens = np.array([3, 5, 2, 9, 1, 4])
    assert pack_prompts(lens, 6, None) == [(0, 2), (2, 4)]  # 3+5 cut to 6; 2+9 cut to 6; 1+4 < 6 dropped
    assert pack_prompts(lens, 6, 1) == [(0, 2)]
    assert pack_prompts(np.array([6, 6, 7]), 6, None) == [(0, 1), (1, 2), (2, 3)]  # one prompt fills a request
    assert pack_prompts(np.array([1, 1, 1, 1]), 2, None) == [(0, 2), (2, 4)]
    with pytest.raises(WorkloadError, match="only 2 requests of input_len=6.*num_requests=3"):
        pack_prompts(lens, 6, 3)


@pytest.fixture(scope="module")
def sharegpt_path(tmp_path_factory) -> str:
    words = ["expert", "router", "token", "layer", "device", "prompt", "cluster", "shard"]
    rng = np.random.default_rng(0)
    records = [{"id": f"r{i}", "topic": f"t{i % 5}", "conversations": [
        {"from": "human", "value": f"q{i} " + " ".join(rng.choice(words, size=int(rng.integers(2, 30))))}]}
        for i in range(200)]
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    return str(path)


def test_input_len_requests_are_consecutive_prompts_cut_to_length(sharegpt_path):
    tok = load_tokenizer("mixtral")
    kwargs = dict(path=sharegpt_path, label_field="topic", num_requests=20, seed=3, input_len=48, output_len=7)
    workload = load_workload("sharegpt", **kwargs)
    by_text = {}
    records = json.loads(open(sharegpt_path, encoding="utf-8").read())
    for record in records:
        by_text[record["conversations"][0]["value"]] = record
    used = []
    for request in workload.requests:
        members = request.text.split("\n\n")  # the prompts that made the request, in order
        assert len(request.token_ids) == 48 and request.token_ids.dtype == np.int32 and request.output_len == 7
        expected = np.concatenate([tok.encode(text) for text in members])
        assert len(expected) >= 48 and np.array_equal(request.token_ids, expected[:48])
        assert len(expected) - len(tok.encode(members[-1])) < 48  # the last prompt is the one that is cut
        first = by_text[members[0]]
        assert request.label == first["topic"]  # the first prompt's class label
        assert request.id == first["id"] + (f"+{len(members) - 1}" if len(members) > 1 else "")
        used += members
    assert len(used) == len(set(used))  # no prompt text serves twice (profile and evaluated requests share none)
    assert max(len(r.text.split("\n\n")) for r in workload.requests) > 2  # short prompts really are concatenated
    again = load_workload("sharegpt", **kwargs)
    assert [r.id for r in again.requests] == [r.id for r in workload.requests]
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(again.requests, workload.requests, strict=True))
    assert workload.config["input_len"] == 48


def test_input_len_bad_values_and_short_supply(sharegpt_path):
    for bad in (0, -4, True, 2.5, "256"):
        with pytest.raises(ConfigError, match="input_len must be null .* or an integer >= 1"):
            load_workload("sharegpt", path=sharegpt_path, input_len=bad)
    with pytest.raises(WorkloadError, match="requests of input_len=4096 tokens can be packed"):
        load_workload("sharegpt", path=sharegpt_path, input_len=4096, num_requests=10)
    check_workload("workload", {"name": "mmlu", "input_len": 512})
    check_workload("workload", {"name": "mmlu", "input_len": None})
    with pytest.raises(ConfigError, match="workload.input_len"):
        check_workload("workload", {"name": "mmlu", "input_len": 0})


# ---------------------------------------------------------------- reductions, both readings


def test_quoted_reading_reproduces_the_papers_percentages():
    paper = paper_reductions().set_index(["model", "input"])
    quoted = {("DeepSeek-V2-Lite", 256): 0.1221, ("DeepSeek-V2-Lite", 512): 0.1060, ("DeepSeek-V2-Lite", 1024): 0.1889,
              ("Qwen3-30B-A3B", 256): 0.1716, ("Qwen3-30B-A3B", 512): 0.2490}
    for key, value in quoted.items():  # R5 as printed; worse baseline / Sem-MoE - 1
        assert paper.at[key, "ttft_p99_quoted"] == pytest.approx(value, abs=2e-4)
    # the paper prints 3.80 % for Qwen3 at 1024, but its raw values give 107.73 / 103.69 - 1 = 3.90 %
    assert paper.at[("Qwen3-30B-A3B", 1024), "ttft_p99_quoted"] == pytest.approx(0.0390, abs=1e-4)
    vs_best = [0.066, 0.038, 0.094, 0.131, 0.177, 0.034]  # reference/paper.md's note on R5
    assert paper["ttft_p99_vs_best"].round(3).tolist() == vs_best
    assert (paper["e2e_p50_vs_best"] < 0.012).all()  # "E2E latency gains are <= 1.1 %"


def test_reductions_vectorised_by_hand():
    quoted, vs_best = reductions(np.array([[10.0, 8.0], [5.0, 6.0]]), np.array([5.0, 6.0]))
    assert quoted.tolist() == [1.0, 0.0] and vs_best.tolist() == [pytest.approx(0.375), pytest.approx(-0.2)]


# ---------------------------------------------------------------- the table from runs/


def write_job(runs, experiment, shape, system, input_len, *, per_seed=None, requests=None):
    """A finished job folder as repro.run writes it (metrics.json last), with sim_per_rate.csv and optionally
    sim_requests.csv."""
    job = runs / experiment / f"+serve_model={shape},system={system},workload.input_len={input_len}"
    job.mkdir(parents=True)
    config = {"name": experiment, "parallel": {"devices": 8, "attention": "tp"}, "seed": 0,
              "workload": {"name": "mmlu", "input_len": input_len}, "model": {"name": f"synthetic_{shape}"},
              "system": {"name": system}, "sim": {"rates": [1]}}
    rows = [{"rate": 1.0, "seed": s, "ttft_p99_s": t, "e2e_p50_s": e, "num_requests": 300, "unfinished": 0}
            for s, (t, e) in enumerate(per_seed or [(0.1, 1.0)])]
    pd.DataFrame(rows).to_csv(job / "sim_per_rate.csv", index=False)
    if requests is not None:
        requests.to_csv(job / "sim_requests.csv", index=False)
    summary = {"system": system, "kind": "system", "sim_shape": shape, "lar": 0.5}
    (job / "metrics.json").write_text(json.dumps({"summary": summary, "config": config}))
    return job


def test_table_from_per_seed_statistics(tmp_path):
    runs = tmp_path / "runs"
    seeds = {"ep": [(0.100, 1.00), (0.110, 1.02)], "moetuner": [(0.090, 0.99), (0.120, 1.01)],
             "semmoe": [(0.080, 0.98), (0.100, 1.00)]}
    for system, values in seeds.items():
        write_job(runs, "paper_table2", "deepseek_v2_lite", system, 512, per_seed=values)
    write_job(runs, "paper_table2", "deepseek_v2_lite", "ep", 256)  # a point without MoETuner and Sem-MoE
    write_job(runs, "other", "deepseek_v2_lite", "ep", 512, per_seed=[(9.0, 9.0)])  # another experiment: ignored
    frame = table2_frame(read_jobs(runs)[0]).set_index("input")
    row = frame.loc[512]
    assert row["ttft_p99_ep_ms"] == pytest.approx(105.0) and row["ttft_p99_semmoe_ms"] == pytest.approx(90.0)
    assert row["ttft_p99_quoted"] == pytest.approx(105 / 90 - 1)  # worse baseline: ep 105 vs moetuner 105 -> 105
    assert row["ttft_p99_vs_best"] == pytest.approx(1 - 90 / 105)
    # per seed: seed 0 best 0.090 -> 1 - 0.08 / 0.09; seed 1 best 0.110 -> 1 - 0.1 / 0.11
    assert row["ttft_p99_vs_best_seed_min"] == pytest.approx(1 - 0.10 / 0.11)
    assert row["ttft_p99_vs_best_seed_max"] == pytest.approx(1 - 0.08 / 0.09)
    assert row["paper_ttft_p99_semmoe_ms"] == 88.69 and row["model"] == "DeepSeek-V2-Lite"
    assert row["requests_per_system"] == 600 and row["source"].startswith("mean over seeds")
    assert frame.loc[256, "missing"] == "moetuner,semmoe" and np.isnan(frame.loc[256, "ttft_p99_quoted"])
    assert "ttft_p99_vs_best_seed_min" in frame and np.isnan(frame.loc[256, "ttft_p99_vs_best_seed_min"])
    lines = table2_section(read_jobs(runs)[0], tmp_path / "figures")
    text = "\n".join(lines)
    assert "**Missing jobs**" in text and "DeepSeek-V2-Lite 256: moetuner,semmoe" in text
    assert "| DeepSeek-V2-Lite | 512 | 105.00 / 105.00 / 90.00 | 98.10 / 92.17 / 88.69 |" in text
    assert "+16.7 %" in text and "+14.3 % [+9.1, +11.1]" in text
    written = pd.read_csv(tmp_path / "figures" / "table2.csv")
    assert len(written) == 2


def test_table_pools_per_request_latencies_over_seeds(tmp_path):
    runs = tmp_path / "runs"
    rng = np.random.default_rng(0)
    pooled = {}
    for scale, system in ((1.0, "ep"), (1.1, "moetuner"), (0.9, "semmoe")):
        ttft = rng.gamma(4.0, 0.01, size=(2, 400)) * scale
        e2e = 1 + ttft
        table = pd.DataFrame({"rate": np.repeat([1.0, 4.0], 400), "seed": np.tile(np.repeat([0, 1], 200), 2),
                              "ttft_s": ttft.ravel(), "e2e_s": e2e.ravel(), "in_window": True})
        table.loc[5, "in_window"] = False  # a warm-up request: left out
        write_job(runs, "paper_table2", "qwen3_30b_a3b", system, 1024, requests=table)
        kept = table[(table["rate"] == 1.0) & table["in_window"]]
        pooled[system] = (np.percentile(kept["ttft_s"], 99), np.median(kept["e2e_s"]))
    row = table2_frame(read_jobs(runs)[0]).iloc[0]
    for system, (ttft, e2e) in pooled.items():
        assert row[f"ttft_p99_{system}_ms"] == pytest.approx(ttft * 1e3)
        assert row[f"e2e_p50_{system}_ms"] == pytest.approx(e2e * 1e3)
    assert row["requests_per_system"] == 399 and row["source"].startswith("per-request")
    assert row["model"] == "Qwen3-30B-A3B" and row["paper_ttft_p99_ep_ms"] == 107.73
    assert row["ttft_p99_quoted"] == pytest.approx(pooled["moetuner"][0] / pooled["semmoe"][0] - 1)


def test_table_refuses_ambiguous_jobs_and_says_when_there_are_none(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_job(runs, "paper_table2", "deepseek_v2_lite", "ep", 512)
    assert main(["--runs", str(runs), "--out", str(tmp_path / "f"), "--experiment", "absent"]) == 2
    assert "no finished job of experiment absent" in capsys.readouterr().err
    assert not (tmp_path / "f" / "table2.csv").exists()
    twin = write_job(tmp_path / "other_runs", "paper_table2", "deepseek_v2_lite", "ep", 512)
    twin.rename(runs / "paper_table2" / "seed=1,+serve_model=deepseek_v2_lite,system=ep,workload.input_len=512")
    with pytest.raises(ReproError, match="several jobs for one model, input length and system"):
        table2_frame(read_jobs(runs)[0])
    assert main(["--runs", str(runs), "--out", str(tmp_path / "f")]) == 2


def test_a_row_whose_jobs_do_not_all_keep_requests_compares_per_seed_statistics(tmp_path):
    runs = tmp_path / "runs"
    requests = pd.DataFrame({"rate": 1.0, "seed": [0, 0, 1, 1], "ttft_s": [0.5, 0.5, 0.5, 0.5], "e2e_s": 2.0})
    for system in ("ep", "moetuner"):
        write_job(runs, "paper_table2", "deepseek_v2_lite", system, 256, per_seed=[(0.10, 1.0), (0.10, 1.0)])
    # Sem-MoE's per-request file would give 500 ms; its per-seed statistics say 80 ms: the row must use the latter
    write_job(runs, "paper_table2", "deepseek_v2_lite", "semmoe", 256, per_seed=[(0.08, 1.0), (0.08, 1.0)],
              requests=requests)
    row = table2_frame(read_jobs(runs)[0]).iloc[0]
    assert row["ttft_p99_semmoe_ms"] == pytest.approx(80.0) and row["source"].startswith("mean over seeds")
    assert row["ttft_p99_vs_best"] == pytest.approx(0.2)
