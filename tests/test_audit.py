"""Issue 18's bad-input audit of the config / CLI boundary, kept as a test: each bad value gets one ConfigError
sentence that names the key (checked on the composed config, as the app composes it), refused before anything
runs; a few cases end to end through `python -m repro.run` / `repro.tune` (exit 2, one `error:` line, nothing
written). The last section holds issue 28's cases (a 299-case audit's remaining ones): spoiled traces, sweeps over
systems with a system-specific key, partial merge and shards combine outputs, the router's malformed clients, NaN
in metrics.json, unwritable or file --out, deep JSONL, orphaned streams, leftovers of killed or failed jobs, a
degenerate trace, and byte-identical metrics.json across two runs. The section after it holds issue 35's (a
76-case audit's, and what the entry-point fuzzer of tests/test_entry_points.py found): outputs replaced without
--overwrite or over an input, partial counts checked by the digest of every byte they counted, hostile JSONL,
tracebacks of trust / validation / cpu_check / hf_export, workload keys a trace= job ignored, one config per job
folder, refused configs leaving folders, process trees outliving a SIGKILL at any level, a killed writer's
temporaries, the router's command line on the shared kinds, a client's rank with one upstream per rank, and a
partial merge on a stale digest cache (the cache's own cases: test_traces_digest.py).

The audit's other rows live beside the code they test:
- data loss: importer --out, concurrent trace writers and readers, SIGTERM temp files, bad weights and meta.json
  types (test_safety_traces.py); staged job outputs killed at every rename, trace job-folder digests, strict
  metrics.json, torchrun world size (test_safety_jobs.py); tiny-model cache races and cache-dir writability
  (test_seed_exact.py); no orphan ranks after SIGKILL/SIGTERM of repro.exec (test_exec_kill.py); atomic figures,
  corrupt metrics.json skipped, figures.diff on different traces (test_figures_robust.py);
- seed exactness under a slowed clock and refused mismatching cache entries (test_seed_exact.py);
- router: oversize ids, deep JSON, 413 / 408 / slow headers, --port (test_engines_router.py);
- engines: plan/model shape, synthetic plans and tokenizers (test_engines_sglang.py, test_engines_vllm.py,
  test_engines_bench_serving.py); W&B (test_tracking.py); figures a reviewer accepts (test_figures_style.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_run import synthetic_trace_dir

from repro.config_schema import check_config
from repro.errors import ConfigError, TraceError

ROOT = Path(__file__).resolve().parents[1]


def composed(*overrides, config_name: str = "config") -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name, overrides=["logger=none", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


# (config, overrides, what the sentence must contain): one row per case of the audit
BAD_VALUES = [
    ("config", ["parallel.devices=abc"], "parallel.devices must be an integer >= 1, got 'abc'"),
    ("config", ["parallel.devices=2.5"], "parallel.devices must be an integer >= 1, got 2.5."),
    ("config", ["parallel.devices=4.0"], "parallel.devices must be an integer >= 1, got 4.0; write 4"),
    ("config", ["parallel.devices=0"], "parallel.devices must be an integer >= 1, got 0"),
    ("config", ["parallel.attention=xp"], "parallel.attention must be one of ['dp', 'tp']"),
    ("config", ["profile_fraction=abc"], "profile_fraction must be a number in (0, 1), got 'abc'"),
    ("config", ["profile_fraction=1.5"], "profile_fraction must be a number in (0, 1)"),
    ("config", ["validate_fraction=0.8"], "leave no requests to evaluate"),
    ("config", ["seed=abc"], "seed must be an integer in [0, 4294967295]"),
    # issue 28: a seed numpy takes but torch cannot (a training job died in `Overflow when unpacking long long`)
    ("config", ["seed=100000000000000000000000"], "seed must be an integer in [0, 4294967295], got 100000000000000000000000"),
    # issue 28: a trace's requests are already cut: input_len was ignored without a word
    ("config", ["trace=/x", "workload.input_len=256"], "workload.input_len=256 cannot apply to trace=/x"),
    ("config", ["history=-1"], "history must be an integer >= 0, got -1."),
    # issue 35: a count beyond int64 passed the check and overflowed inside the simulator (a job folder was left)
    ("config", ["sim=default", "sim.seeds=100000000000000000000000"],
     "sim.seeds must be an integer >= 1, got 100000000000000000000000, beyond the largest 64-bit integer"),
    ("config", ["sim=default", "sim.seeds=1e23"], "sim.seeds must be an integer >= 1, got 1e+23."),
    ("config", ["workload.num_requests=100000000000000000000000"], "beyond the largest 64-bit integer"),
    ("config", ["hardware.nodes=abc"], "hardware.nodes must be an integer >= 1, got 'abc'"),
    ("config", ["hardware.gpu.hbm_gbps=-1"], "gpu.hbm_gbps must be a positive number"),
    ("config", ["+exec=default", "exec.timeout_s=-1"], "exec.timeout_s must be a number > 0, got -1"),
    ("config", ["+exec=default", "exec.max_tokens=abc"], "exec.max_tokens must be an integer >= 1"),
    ("config", ["+exec=default", "exec.kernel_backend=cuda"], "exec kernel backend must be one of ('auto', 'triton'"),
    ("config", ["+workload.x=1"], "workload has no key(s) ['x']"),
    ("config", ["workload.num_requests=abc"], "workload.num_requests must be an integer >= 1 or null"),
    ("config", ["+nosuchkey=1"], "the config has no key(s) ['nosuchkey']"),
    ("config", ["+hardware.x=1"], "hardware has no key(s) ['x']"),
    ("config", ["+hardware.gpu.x=1"], "hardware has no key 'gpu.x'"),
    ("config", ["+parallel.devics=4"], "parallel has no key(s) ['devics']"),
    ("config", ["+model.foo=1"], "unknown keys ['foo']"),
    ("config", ["model.num_layers=abc"], "model.num_layers='abc' must be a positive integer"),
    ("config", ["logger=wandb", "logger.mode=xx"], "logger.mode must be one of"),
    ("config", ["system=semmoe", "system.params.lookback=2.5"], "system.params.lookback must be an integer, got 2.5"),
    ("config", ["system=semmoe", "system.params.theta=abc"], "system.params.theta must be a number, got 'abc'"),
    # a parameter only some systems take (a multirun over systems passes it to all with ++)
    ("config", ["system=ep", "++system.params.replicas_per_device=2"],
     "system 'ep' has no parameter(s) ['replicas_per_device']; only eplb, semmoe_hottest, semmoe_replicated take"),
    ("config", ["+system.params.thta=0.3"], "no system takes 'thta'"),
    ("config", ["sim=default", "sim.rates=abc"], "sim.rates must be a list, got 'abc'"),
    ("config", ["sim=default", "sim.rates=[10,-1]"], "sim.rates[...] must be a number > 0, got -1"),
    ("config", ["sim=default", "sim.slo.attainment=abc"], "sim.slo.attainment must be a number in (0, 1]"),
    # the objective list grows (offline_tokens_per_s came after capacity_rps): the row pins the key and the refusal
    ("tune", ["tune.objective=nope"], "tune.objective must be one of ['lar', "),
    ("tune", ["+tune.constraints.nope=1"], "tune.constraints.nope is not a metric"),
    ("tune", ["tune.constraints.token_imbalance_max_mean=abc"], "tune.constraints.token_imbalance_max_mean must be a number > 0"),
    ("tune", ["tune.space.tp={system.params.theta:[]}"], "tune.space.tp.system.params.theta must be a non-empty list"),
]


@pytest.mark.parametrize("config_name, overrides, message", BAD_VALUES, ids=[" ".join(r[1]) for r in BAD_VALUES])
def test_bad_value_is_one_sentence_naming_the_key(config_name, overrides, message):
    config = composed(*overrides, config_name=config_name)
    with pytest.raises(ConfigError) as error:
        check_config(config)
    sentence = str(error.value)
    assert message in sentence
    assert "\n" not in sentence and sentence.endswith(".")


@pytest.mark.parametrize("config_name", ["config", "tune"])
def test_the_shipped_defaults_pass(config_name):
    """Positive control: the rows above fail because of their override, not because the check refuses everything."""
    check_config(composed(config_name=config_name))


def test_meta_value_types_are_one_sentence(tmp_path):
    """meta.json value types: a string where an integer belongs is a TraceError naming the field, not a traceback."""
    from repro.traces import read_trace

    trace_dir = synthetic_trace_dir(tmp_path / "t")
    meta = json.loads((trace_dir / "meta.json").read_text())
    (trace_dir / "meta.json").write_text(json.dumps(dict(meta, num_experts="16")))
    with pytest.raises(TraceError, match="num_experts"):
        read_trace(trace_dir)


# ---- end to end: exit code 2, one `error:` line, no traceback, nothing written ------------------------------


def run_module(module: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(cwd / "cache"), HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", module, *args, "logger=none"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def assert_one_error_line(res: subprocess.CompletedProcess, fragment: str) -> None:
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr


RESULT_FILES = ("metrics.json", "per_layer.csv", "plan", "tuned.json", "candidates.csv", "multirun.yaml")


def written_results(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name in RESULT_FILES)


@pytest.mark.parametrize("override, fragment", [
    ("parallel.devices=abc", "parallel.devices must be an integer"),
    ("+hardware.x=1", "hardware has no key(s) ['x']"),
])
def test_run_refuses_a_bad_value_with_one_line(tmp_path, override, fragment):
    trace = synthetic_trace_dir(tmp_path / "trace")
    res = run_module("repro.run", f"trace={trace}", override, f"hydra.run.dir={tmp_path / 'job'}", cwd=tmp_path)
    assert_one_error_line(res, fragment)
    assert written_results(tmp_path) == []


def test_a_multirun_is_checked_before_its_first_job(tmp_path):
    """eplb (first in the sweep) takes replicas_per_device, ep does not: the sweep stops before eplb runs."""
    trace = synthetic_trace_dir(tmp_path / "trace")
    res = run_module("repro.run", "-m", f"trace={trace}", "system=eplb,ep", "++system.params.replicas_per_device=2",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert_one_error_line(res, "system 'ep' has no parameter(s) ['replicas_per_device']")
    assert "error: sweep job [" in res.stderr
    assert not (tmp_path / "sweep").exists()


def test_tune_refuses_an_unknown_constraint_before_any_candidate(tmp_path):
    trace = synthetic_trace_dir(tmp_path / "trace")
    res = run_module("repro.tune", f"trace={trace}", "+tune.constraints.nope=1", f"hydra.run.dir={tmp_path / 'job'}",
                     cwd=tmp_path)
    assert_one_error_line(res, "tune.constraints.nope is not a metric")
    assert written_results(tmp_path) == []


@pytest.mark.parametrize("devices", ["abc", 2.5, 4.0, True])
def test_parallel_config_built_in_code_refuses_a_non_integer(devices):
    """The same refusal where code builds a ParallelConfig itself (engines, benches), not only through the app."""
    from repro.parallel import ParallelConfig

    with pytest.raises(ConfigError, match=r"parallel\.devices must be an integer, got"):
        ParallelConfig(devices=devices)


# ---- issue 28: the audit's remaining cases ---------------------------------------------------------------------


def test_a_sweep_over_systems_takes_a_key_only_they_have(tmp_path):
    """`-m system=A,B system.params.KEY=V` with a key both take (not the base config's default system ep) runs."""
    trace = synthetic_trace_dir(tmp_path / "trace")
    res = run_module("repro.run", "-m", f"trace={trace}", "system=semmoe_replicated,semmoe_hottest",
                     "system.params.replicas_per_device=2", "parallel.devices=2", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                     cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    configs = [json.loads(p.read_text())["config"] for p in (tmp_path / "sweep").rglob("metrics.json")]
    assert sorted(c["system"]["name"] for c in configs) == ["semmoe_hottest", "semmoe_replicated"]
    assert all(c["system"]["params"]["replicas_per_device"] == 2 for c in configs)


def test_a_sweep_with_a_system_lacking_the_key_stops_before_any_job(tmp_path):
    trace = synthetic_trace_dir(tmp_path / "trace")
    res = run_module("repro.run", "-m", f"trace={trace}", "system=eplb,ep", "system.params.replicas_per_device=2",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert_one_error_line(res, "system 'ep' has no parameter(s) ['replicas_per_device']")
    assert not (tmp_path / "sweep").exists()


def rewrite_trace(trace_dir: Path, meta=None, requests=None, weights=None) -> Path:
    """Edit a written trace in place as a user's editor or exporter would (meta.json, requests.json, weights.npy)."""
    import numpy as np

    if meta is not None:
        (trace_dir / "meta.json").write_text(json.dumps(meta(json.loads((trace_dir / "meta.json").read_text()))))
    if requests is not None:
        (trace_dir / "requests.json").write_text(json.dumps(requests(json.loads((trace_dir / "requests.json").read_text()))))
    if weights is not None:
        np.save(trace_dir / "weights.npy", weights(np.load(trace_dir / "experts.npy").shape))
    return trace_dir


def _negated_weights(shape):
    import numpy as np

    return -np.full(shape, 0.5, dtype=np.float16)


# (case, how the trace is spoiled, what the sentence says)
BAD_TRACES = [
    ("meta num_layers disagrees with layer_ids", dict(meta=lambda m: dict(m, num_layers=5)), "says num_layers=5 but layer_ids lists 2"),
    ("duplicated request ids", dict(requests=lambda r: dict(r, id=[r["id"][0], *r["id"][:-1]])), "appears twice in requests.json"),
    ("negated gate weights", dict(weights=_negated_weights), "gate weights must be >= 0"),
]


@pytest.mark.parametrize("case, spoil, message", BAD_TRACES, ids=[r[0] for r in BAD_TRACES])
def test_a_spoiled_trace_is_one_sentence(tmp_path, case, spoil, message):
    from repro.traces import read_trace

    trace_dir = rewrite_trace(synthetic_trace_dir(tmp_path / "t"), **spoil)
    with pytest.raises(TraceError) as error:
        read_trace(trace_dir)
    assert message in str(error.value) and "\n" not in str(error.value)


def run_cli(module: str, *args, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(cwd / "cache"))
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_clean_refusal(res: subprocess.CompletedProcess, fragment: str) -> None:
    """A nonzero exit, one `error:` sentence holding `fragment`, no traceback."""
    assert res.returncode != 0, res.stdout[-1000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr


@pytest.fixture
def counted(tmp_path):
    """A plain trace, its one partial count table, and the part of another capture of the same requests and tokens
    (same meta.json, requests.json and offsets, other experts)."""
    import shutil

    import numpy as np

    trace = synthetic_trace_dir(tmp_path / "trace")
    other = tmp_path / "other_capture"
    shutil.copytree(trace, other)
    np.save(other / "experts.npy", ((np.load(trace / "experts.npy") + 1) % 16).astype(np.int16))
    for source, part in ((trace, "p0.npz"), (other, "foreign.npz")):
        res = run_cli("repro.affinity.partial", "count", "--trace", source, "--shard", 0, "--out", tmp_path / part, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
    return tmp_path, trace


def test_partial_merge_never_replaces_an_existing_file(counted):
    tmp_path, trace = counted
    csv = tmp_path / "routing.csv"
    csv.write_text("request,position,layer,expert\n")
    for out, extra, fragment in ((csv, [], "ending in .npz"), (csv, ["--overwrite"], "ending in .npz"),
                                 (tmp_path / "p0.npz", ["--overwrite"], "is one of this command's inputs"),
                                 (tmp_path / "foreign.npz", [], "exists; pass --overwrite")):
        before = out.read_bytes()
        res = run_cli("repro.affinity.partial", "merge", "--trace", trace, "--out", out, *extra, tmp_path / "p0.npz",
                      cwd=tmp_path)
        assert_clean_refusal(res, fragment)
        assert out.read_bytes() == before


def test_partial_merge_refuses_a_part_of_another_capture_and_a_truncated_part(counted):
    tmp_path, trace = counted
    res = run_cli("repro.affinity.partial", "merge", "--trace", trace, "--out", tmp_path / "m.npz", tmp_path / "foreign.npz",
                  cwd=tmp_path)
    assert_clean_refusal(res, "counted on another trace")
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes((tmp_path / "p0.npz").read_bytes()[:300])
    res = run_cli("repro.affinity.partial", "merge", "--trace", trace, "--out", tmp_path / "m.npz", truncated, cwd=tmp_path)
    assert_clean_refusal(res, "is not a count table")
    assert not (tmp_path / "m.npz").exists()


def test_shards_combine_keeps_an_existing_manifest(tmp_path):
    a, b = synthetic_trace_dir(tmp_path / "a"), synthetic_trace_dir(tmp_path / "b")
    assert run_cli("repro.traces.shards", "combine", tmp_path / "day", a, cwd=tmp_path).returncode == 0
    before = (tmp_path / "day" / "shards.json").read_bytes()
    res = run_cli("repro.traces.shards", "combine", tmp_path / "day", b, cwd=tmp_path)
    assert_clean_refusal(res, "exists; pass --overwrite")
    assert (tmp_path / "day" / "shards.json").read_bytes() == before
    assert run_cli("repro.traces.shards", "combine", tmp_path / "day", b, "--overwrite", cwd=tmp_path).returncode == 0
    assert (tmp_path / "day" / "shards.json").read_bytes() != before


def test_router_answers_malformed_clients_400_with_one_log_line(caplog):
    """A client-set rank outside the plan, an undecodable gzip body, Content-Length: -5 and a 200 KB header each get
    400 and one log line, no traceback; nothing reaches the upstream."""
    import logging

    from test_engines_capture import serve_in_thread
    from test_engines_router import _raw_exchange, call, fake_upstream, semmoe_plan

    from repro.engines import router as router_mod
    from repro.engines.router import SemanticRouter, build_app
    from repro.workloads import load_tokenizer

    log: list = []
    upstream_url, stop_upstream = serve_in_thread(fake_upstream(log))
    router = SemanticRouter(semmoe_plan(), load_tokenizer("mixtral"))
    url, stop_router = serve_in_thread(build_app(router, [upstream_url]), **router_mod.server_options(5))
    try:
        caplog.set_level(logging.INFO, logger="aiohttp.server")
        for rank in ("99", "abc", "-1"):
            status, _, raw = call(url, "/v1/completions", {"prompt": "hi"}, headers={"X-Data-Parallel-Rank": rank})
            assert status == 400 and b"is not a DP rank of this plan (0..3)" in raw
        assert call(url, "/v1/completions", {"prompt": "hi"}, headers={"X-Data-Parallel-Rank": "3"})[0] == 200
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        for request in (head + b"Content-Encoding: gzip\r\nContent-Length: 10\r\n\r\n0123456789",
                        head + b"Content-Length: -5\r\n\r\n",
                        head + b"X-Big: " + b"a" * 200_000 + b"\r\nContent-Length: 2\r\n\r\n{}"):
            assert _raw_exchange(url, [request], wait=0.2).split(b"\r\n")[0].endswith(b"400 Bad Request")
        assert len(log) == 1  # only the valid rank-3 request went upstream
        # a valid gzip body goes upstream decoded, without its Content-Encoding (it went labelled gzip: 500)
        import gzip

        body = gzip.compress(json.dumps({"prompt": "hello", "id": "g"}).encode())
        reply = _raw_exchange(url, [head + b"Content-Type: application/json\r\nContent-Encoding: gzip\r\n"
                                    + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body], wait=0.2)
        assert reply.split(b"\r\n")[0].endswith(b"200 OK") and log[-1] == "g"
        records = [r for r in caplog.records if r.name == "aiohttp.server"]
        assert records and all(r.exc_info is None and r.getMessage().startswith("router: refused") for r in records)
    finally:
        stop_router()
        stop_upstream()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_clients_rank_goes_to_that_ranks_upstream(engine):
    """Issue 35: with one upstream per DP rank, a client's valid rank header picks that rank's server (it went to rank 0's),
    unscored and without the header (the URL says it); a rank outside the plan, or two different ranks, get 400
    and one sentence, and reach no upstream."""
    from multidict import MultiDict
    from test_engines_capture import serve_in_thread
    from test_engines_router import DEVICES, call, fake_upstream, semmoe_plan

    from repro.engines import router as router_mod
    from repro.engines.router import SemanticRouter, build_app
    from repro.workloads import load_tokenizer

    tokenizer = load_tokenizer("mixtral")
    logs = [[] for _ in range(DEVICES)]
    servers = [serve_in_thread(fake_upstream(log)) for log in logs]
    router = SemanticRouter(semmoe_plan(), tokenizer)
    router_url, stop_router = serve_in_thread(build_app(router, [u for u, _ in servers], engine))
    try:
        for i, rank in enumerate([3, 1, 3, 0, 2]):
            status, headers, raw = call(router_url, "/v1/completions", {"prompt": "hello", "id": i},
                                        headers={"X-Data-Parallel-Rank": str(rank)})
            assert status == 200 and logs[rank] and logs[rank][-1] == i, (rank, logs)
            assert headers[router_mod.RANK_HEADERS[engine]] == str(rank)  # the reply names the rank it ran on
            assert all(k.lower() != "x-data-parallel-rank" for k, _ in json.loads(raw)["raw_headers"])
        assert sum(map(len, logs)) == 5
        for sent in (["4"], ["99"], ["1", "2"]):
            status, _, raw = call(router_url, "/v1/completions", {"prompt": "hello"},
                                  headers=MultiDict(("X-Data-Parallel-Rank", v) for v in sent))
            message = json.loads(raw)["error"]["message"]
            assert status == 400 and message.count(". ") == 0 and "x-data-parallel-rank" in message.lower(), message
        assert sum(map(len, logs)) == 5  # nothing refused went upstream
        metrics = call(router_url, "/metrics", method="GET")[2].decode()
        assert 'semmoe_router_unscored_requests_total{reason="client_rank"} 5.0' in metrics
    finally:
        stop_router()
        for _, stop in servers:
            stop()


@pytest.mark.parametrize("args, fragment", [
    (["--upstream", "not-a-url"], "argument --upstream: must be an http(s) URL with a host"),
    (["--upstream", "http://127.0.0.1:9", "--max-body-mb", "nan"], "argument --max-body-mb: must be a finite number > 0"),
    # issue 35: the router's options on repro.cli's kinds (they were plain argparse: 'ftp://', a port of 0 in a URL,
    # an EP size of 0, an infinite lease or timeout, a --plan that is a file went on to the plan reader or the socket)
    (["--upstream", "ftp://127.0.0.1:9"], "argument --upstream: must be an http(s) URL with a host"),
    (["--upstream", "http://127.0.0.1:9", "http://127.0.0.1:70000"], "got 'http://127.0.0.1:70000'"),
    (["--prefill", "http://p:1", "--decode", "d"], "argument --decode: must be an http(s) URL with a host"),
    (["--upstream", "http://127.0.0.1:9", "--ep-size", "0"], "argument --ep-size: must be an integer >= 1"),
    (["--upstream", "http://127.0.0.1:9", "--kv-lease", "inf"], "argument --kv-lease: must be a finite number > 0"),
    (["--upstream", "http://127.0.0.1:9", "--timeout", "-1"], "argument --timeout: must be a finite number > 0"),
    (["--upstream", "http://127.0.0.1:9", "--port", "0"], "argument --port: must be an integer in [1, 65535]"),
    (["--upstream", "http://127.0.0.1:9", "--max-running-requests", "1.5"], "argument --max-running-requests"),
    (["--upstream", "http://127.0.0.1:9", "--plan", "config.yaml"], "argument --plan: must be an existing folder"),
    (["--upstream", "http://127.0.0.1:9", "--plan", "missing"], "argument --plan: must be an existing folder"),
    (["--prefill", "http://p:1", "--decode", "http://d:1", "--decode-plan", "missing"], "argument --decode-plan"),
    (["--upstream", "http://u:1", "--prefill", "http://p:1"], "not both or neither"),
])
def test_router_refuses_a_bad_command_line_at_start(tmp_path, capsys, monkeypatch, args, fragment):
    """One `error:` sentence naming the option, exit code 2, before the plan is read or a port opened."""
    from test_engines_router import NUM_EXPERTS, router_exit, semmoe_plan, write_job

    from repro.engines import router as router_mod

    job = write_job(tmp_path / "job", semmoe_plan(), model={"name": "toy", "num_experts": NUM_EXPERTS})
    (tmp_path / "config.yaml").write_text("x: 1\n")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    monkeypatch.setattr(router_mod, "make_router", lambda args: pytest.fail("the plan was read"))
    assert router_exit(["--plan", str(job), "--tokenizer", "mixtral", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and fragment in err[0], err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_figures_and_diff_skip_a_metrics_json_holding_nan_and_refuse_a_file_as_out(tmp_path, capsys):
    from test_figures_robust import write_job

    from repro.figures.__main__ import main as figures_main
    from repro.figures.diff import main as diff_main

    write_job(tmp_path / "a", "paper_dp", "ep", lar=0.5)
    write_job(tmp_path / "b", "paper_dp", "ep", lar=0.6)
    for side in ("a", "b"):
        job = write_job(tmp_path / side, "paper_dp", "semmoe", lar=0.7)
        if side == "b":  # a hand-edited file: json reads NaN, the suite never writes it
            (job / "metrics.json").write_text((job / "metrics.json").read_text().replace("0.7", "NaN"))
    assert diff_main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    assert "holds NaN, which the suite never writes" in printed and "removed" not in printed
    assert figures_main(["--runs", str(tmp_path / "b"), "--out", str(tmp_path / "fig")]) == 0
    assert "holds NaN" in (tmp_path / "fig" / "REPORT.md").read_text()
    capsys.readouterr()
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    for call in (lambda: figures_main(["--runs", str(tmp_path / "a"), "--out", str(a_file)]),
                 lambda: diff_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(a_file)]),
                 lambda: figures_main(["--runs", str(tmp_path / "a"), "--out", str(a_file / "sub")])):
        assert call() == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "a_file" in err
        assert a_file.read_text() == "keep me"


def test_engine_export_to_an_unwritable_place_is_one_sentence(tmp_path, capsys):
    from test_engines_sglang import toy_job

    from repro.engines import sglang

    job, _ = toy_job(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as stop:  # refused while parsing, before the plan is read (root ignores chmod)
        sglang.main(["export", str(job), "--out", str(blocker / "location.json")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out") and "lies under the file" in err and "\n" not in err


@pytest.mark.parametrize("depth", [10_000, 100_000])
def test_import_refuses_a_deeply_nested_jsonl_row_quickly(tmp_path, depth):
    """pyarrow's JSON parser segfaulted at 50,000-100,000 levels and ran > 400 s at 10,000: refused before it."""
    import time

    rows = [json.dumps({"request_id": "r0", "position": 0, "layer": 0, "token": 5, "experts": [1, 2],
                        "note": "[[[[ {{ brackets in a string do not count"})]
    rows.append('{"request_id": "r1", "position": 0, "layer": 0, "token": 5, "experts": ' + "[" * depth + "]" * depth + "}")
    table = tmp_path / "routing.jsonl"
    table.write_text("\n".join(rows) + "\n")
    started = time.perf_counter()
    res = run_cli("repro.traces.import", table, "--out", tmp_path / "trace", cwd=tmp_path)
    assert_clean_refusal(res, "nests a value more than 32 levels deep (line 2)")
    assert time.perf_counter() - started < 60 and not (tmp_path / "trace").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routing.jsonl"]


def test_two_runs_of_one_config_write_byte_identical_metrics(tmp_path):
    """Wall-clock seconds go to timings.json, so `cmp a/metrics.json b/metrics.json` compares two runs."""
    trace = synthetic_trace_dir(tmp_path / "trace")
    for run in ("a", "b"):
        res = run_module("repro.run", f"trace={trace}", "system=ep", "parallel.devices=2",
                         f"hydra.run.dir={tmp_path / run}", cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "a" / "metrics.json").read_bytes() == (tmp_path / "b" / "metrics.json").read_bytes()
    timings = json.loads((tmp_path / "a" / "timings.json").read_text())
    assert {"fit_seconds", "eval_seconds"} <= set(timings)


def test_wall_clock_keys_are_timings_and_modelled_times_stay_in_the_summary():
    from repro.run import split_timings

    summary = {"lar": 0.5, "fit_seconds": 1.0, "sim_wall_s": 2.0, "sim_events_per_wall_s": 3.0, "sim_cpu_s": 1.0,
               "exec_dispatch_seconds": 0.1, "exec_launch_wall_seconds": 4.0, "plan_solver_seconds": 0.2,
               "a2a_seconds_est": 0.3, "time_estimate_dispatch_s": 0.1, "decode_moe_seconds_per_step": 0.01,
               "ttft_p99_s_lightest": 0.5}
    kept, timings = split_timings(summary)
    assert sorted(kept) == ["a2a_seconds_est", "decode_moe_seconds_per_step", "lar", "time_estimate_dispatch_s",
                            "ttft_p99_s_lightest"]
    assert set(timings) == set(summary) - set(kept)


def test_sigkill_of_side_by_sides_process_group_leaves_no_stream_running(tmp_path):
    """`kill -9 -- -PGID` of make reproduce's group: each stream's guard sees its parent gone and stops its stream."""
    import signal
    import time

    from test_side_by_side import alive

    pids = {name: tmp_path / f"{name}.pid" for name in ("bg", "fg")}
    driver = subprocess.Popen(
        [sys.executable, "-m", "repro.side_by_side", "--log", str(tmp_path / "bg.log"),
         "--background", f"sleep 60 & echo $! > {pids['bg']}; wait", "--foreground", f"sleep 60 & echo $! > {pids['fg']}; wait"],
        cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.perf_counter() + 20
    while not all(p.exists() and p.read_text().strip() for p in pids.values()) and time.perf_counter() < deadline:
        time.sleep(0.05)
    sleepers = [int(p.read_text()) for p in pids.values()]
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    deadline = time.perf_counter() + 10
    while any(alive(pid) for pid in sleepers) and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in sleepers)


def test_a_killed_writers_hidden_temporary_is_removed_by_the_next_import(tmp_path):
    """SIGKILL mid-write leaves `.trace.<host>-<pid>-*` beside --out; the next import of that path removes it."""
    import signal
    import time

    out = tmp_path / "trace"
    writer = subprocess.Popen([sys.executable, "-c", (
        "import time, pathlib, sys\nfrom repro.atomic import atomic_dir\n"
        "def fill(tmp):\n    (tmp / 'experts.npy').write_bytes(b'x' * 1000)\n    print('writing', flush=True)\n"
        "    time.sleep(60)\n"
        f"atomic_dir(pathlib.Path({str(out)!r}), fill)\n")], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".trace.")]
    assert len(leftovers) == 1
    rows = [json.dumps({"request_id": f"r{r}", "position": i, "layer": layer, "token_id": 3 + i, "experts": [layer, 2 + i]})
            for r in range(2) for i in range(3) for layer in range(2)]
    (tmp_path / "routing.jsonl").write_text("\n".join(rows) + "\n")
    started = time.perf_counter()
    res = run_cli("repro.traces.import", tmp_path / "routing.jsonl", "--out", out, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert time.perf_counter() - started < 60
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routing.jsonl", "trace"]


def test_a_job_that_fails_before_writing_leaves_no_folder(tmp_path):
    res = run_module("repro.run", f"trace={tmp_path / 'missing'}", f"hydra.run.dir={tmp_path / 'runs' / 'job'}",
                     cwd=tmp_path)
    assert_one_error_line(res, "is not a trace directory")
    assert not (tmp_path / "runs" / "job").exists()


def test_a_degenerate_but_valid_trace_runs_with_its_undefined_ratio_null(tmp_path):
    """All tokens on 4 of 16 experts at EP 8: max/median expert load is undefined (median 0); it was refused with a
    message that blamed the input."""
    import numpy as np

    from repro.traces import TraceMeta, make_trace, write_trace

    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 40, 60)
    tokens = rng.integers(0, 50, int(lengths.sum()))
    experts = np.stack([tokens % 4, (tokens + 1) % 4], axis=1)[:, None, :].repeat(2, axis=1)
    meta = TraceMeta(model="imported", num_experts=16, top_k=2, layer_ids=(3, 4), vocab_size=50, dataset="x")
    trace = write_trace(make_trace(meta, np.concatenate([[0], np.cumsum(lengths)]), tokens, experts), tmp_path / "t")
    res = run_module("repro.run", f"trace={trace}", "parallel.devices=8", f"hydra.run.dir={tmp_path / 'job'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((tmp_path / "job" / "metrics.json").read_text())["summary"]
    assert summary["expert_load_imbalance_max_median"] is None and summary["expert_load_imbalance_max_mean"] > 1
    assert any("undefined (the median load is 0" in w for w in summary["warnings"])


def test_json_depth_counts_brackets_outside_strings_only(tmp_path):
    from repro.traces.tabular import check_json_depth

    flat = json.dumps({"request_id": "r0", "token": 1, "experts": [[1, 2]], "note": "[" * 100 + '\\" {' * 50})
    path = tmp_path / "ok.jsonl"
    path.write_text((flat + "\n") * 3)
    check_json_depth(path)  # 150 brackets on a line, all inside a string: not nesting
    path.write_text((flat + "\n") * 2 + '{"a": ' + "[" * 40 + "]" * 40 + "}\n")
    with pytest.raises(TraceError, match=r"more than 32 levels deep \(line 3\)"):
        check_json_depth(path)


# ---- issue 35: the second audit's cases ------------------------------------------------------------------------


def test_partial_count_never_replaces_an_existing_table_without_overwrite(counted):
    """`count --out X.npz` replaced any existing .npz and had no --overwrite."""
    tmp_path, trace = counted
    before = (tmp_path / "foreign.npz").read_bytes()
    res = run_cli("repro.affinity.partial", "count", "--trace", trace, "--shard", 0, "--out", tmp_path / "foreign.npz",
                  cwd=tmp_path)
    assert res.returncode == 2
    assert_clean_refusal(res, "exists; pass --overwrite")
    assert (tmp_path / "foreign.npz").read_bytes() == before
    res = run_cli("repro.affinity.partial", "count", "--trace", trace, "--shard", 0, "--out", tmp_path / "foreign.npz",
                  "--overwrite", cwd=tmp_path)
    assert res.returncode == 0 and (tmp_path / "foreign.npz").read_bytes() != before


def test_partial_merge_refuses_a_part_of_a_capture_differing_in_one_token_past_the_old_sample(tmp_path):
    """Identity was a sample (256 blocks of 4 KiB): a capture differing in one request passed once experts.npy
    exceeded 1 MiB. The part now carries the digest of every byte it counted."""
    import shutil

    import numpy as np

    from repro.affinity.partial import count_shard, merge_tables
    from repro.traces import TraceMeta, make_trace, write_trace

    rng = np.random.default_rng(0)
    lengths = rng.integers(200, 400, 1200)  # ~360k tokens x 2 layers x 2 experts x 2 bytes: > 1 MiB of routing
    tokens = rng.integers(0, 50, int(lengths.sum()))
    experts = rng.integers(0, 16, (len(tokens), 2, 2)).astype(np.int16)
    experts[:, :, 1] = (experts[:, :, 0] + 1) % 16
    meta = TraceMeta(model="imported", num_experts=16, top_k=2, layer_ids=(3, 4), vocab_size=50, dataset="x")
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    trace = write_trace(make_trace(meta, offsets, tokens, experts), tmp_path / "trace")
    assert (trace / "experts.npy").stat().st_size > 256 * 4096
    other = tmp_path / "other"
    shutil.copytree(trace, other)
    changed = experts.copy()
    changed[offsets[500] + 7, 1] = (changed[offsets[500] + 7, 1] + 2) % 16  # one token of one request
    write_trace(make_trace(meta, offsets, tokens, changed), other, if_exists="replace")
    count_shard(other, 0, tmp_path / "foreign.npz")
    with pytest.raises(TraceError, match=r"counted on another trace .* \(the routing of shard 0 differs"):
        merge_tables(trace, [tmp_path / "foreign.npz"])
    count_shard(trace, 0, tmp_path / "own.npz")
    merge_tables(trace, [tmp_path / "own.npz"])  # its own part merges


def test_partial_merge_refuses_a_part_of_a_trace_edited_since_even_with_its_mtime_set_back(counted):
    """Item 3: the digest is cached beside the trace for every later process (count jobs, the merge), keyed by the
    state of its files; a trace edited after its count (in place, same size, mtime set back) is hashed again and
    the part refused, never merged on the stale cache."""
    from test_traces_digest import edit_in_place

    from repro.traces.digest import DIGEST_CACHE

    tmp_path, trace = counted
    assert (trace / DIGEST_CACHE).exists()  # written by the count job's process
    res = run_cli("repro.affinity.partial", "merge", "--trace", trace, "--out", tmp_path / "m.npz", tmp_path / "p0.npz",
                  cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    edit_in_place(trace / "experts.npy", keep_mtime=True)
    res = run_cli("repro.affinity.partial", "merge", "--trace", trace, "--out", tmp_path / "m2.npz", tmp_path / "p0.npz",
                  cwd=tmp_path)
    assert_clean_refusal(res, "the routing of shard 0 differs in some token")
    assert not (tmp_path / "m2.npz").exists()


@pytest.mark.parametrize("field, value, fragment", [
    ("expert", 99, "holds expert 99, outside 0..15"),
    ("count", -3, "holds a count of -3"),
    ("layer", 2, "holds layer 2, outside 0..1"),
])
def test_partial_merge_refuses_a_cell_that_cannot_come_from_the_trace(counted, field, value, fragment):
    import numpy as np

    from repro.affinity.partial import FIELDS, load_table, merge_tables

    tmp_path, trace = counted
    table = load_table(tmp_path / "p0.npz")
    table[field] = table[field].copy()
    table[field][0] = value
    with open(tmp_path / "edited.npz", "wb") as f:
        np.savez(f, **{name: table[name] for name in FIELDS})
    with pytest.raises(TraceError, match=fragment):
        merge_tables(trace, [tmp_path / "edited.npz"])


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_engine_export_never_replaces_an_existing_file_or_its_own_model_config(tmp_path, capsys, engine):
    """`export --out` replaced an existing file, even the --model-config it had just read."""
    import importlib

    from test_engines_sglang import toy_job

    module = importlib.import_module(f"repro.engines.{engine}")
    job, _ = toy_job(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 4, "n_routed_experts": 8, "first_k_dense_replace": 1}))
    existing = tmp_path / "placement.json"
    existing.write_text("keep me")
    for out, extra, fragment in ((config, ["--overwrite"], "is one of this command's inputs"),
                                 (existing, [], "exists; pass --overwrite")):
        with pytest.raises(SystemExit) as stop:
            module.main(["export", str(job), "--out", str(out), "--model-config", str(config), *extra])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --out") and fragment in err and "\n" not in err
    assert existing.read_text() == "keep me" and json.loads(config.read_text())["num_hidden_layers"] == 4
    assert module.main(["export", str(job), "--out", str(existing), "--model-config", str(config), "--overwrite"]) == 0
    assert existing.read_text() != "keep me"


def _validation_row(**changes) -> dict:
    row = {"id": "r", "kind": "nccl_alltoall", "profile": "h100", "ranks": 8, "size_bytes": 1024, "measured": 15,
           "unit": "us", "in_sample": True, "source": "s", "setting": "x"}
    return {**row, **changes}


@pytest.mark.parametrize("changes, fragment", [
    ({"measured": float("nan")}, "measured must be a finite positive number, got nan"),
    ({"size_bytes": -1024}, "size_bytes must be a finite positive number, got -1024"),
    ({"ranks": 0}, "ranks must be a positive integer, got 0"),
    ({"profile": "h999"}, "profile 'h999' is not one of conf/hardware/*.yaml"),
])
def test_validation_refuses_a_row_it_cannot_price_in_one_line(tmp_path, capsys, changes, fragment):
    """A row with `measured: .nan` or a negative size was priced; a refused table was printed as a traceback."""
    import yaml

    from repro.sim import validation

    table = tmp_path / "table.yaml"
    table.write_text(yaml.safe_dump({"rows": [_validation_row(**changes)]}))
    assert validation.main(["--table", str(table)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and fragment in err and "\n" not in err
    table.write_text(yaml.safe_dump({"rows": [_validation_row()]}))  # positive control: the same row, unspoiled
    assert validation.main(["--table", str(table)]) == 0


def test_trust_refuses_a_missing_or_empty_exec_file_and_a_file_as_out(tmp_path, capsys):
    """A mistyped --exec, or a JSON without `results`, dropped the executor band and exited 0; a non-JSON --exec and
    an existing file as --out were tracebacks."""
    from repro.sim import trust

    no_results, not_json, a_file = tmp_path / "empty.json", tmp_path / "junk.json", tmp_path / "a_file"
    no_results.write_text(json.dumps({"name": "cost_model"}))
    not_json.write_text("{not json")
    a_file.write_text("keep me")
    for argv, fragment in ((["--exec", str(tmp_path / "typo.json")], "must be an existing file"),
                           (["--exec", str(a_file), "--out", str(a_file)], "is one of this command's inputs"),
                           (["--out", str(a_file)], "is a file; name a folder")):
        with pytest.raises(SystemExit) as stop:
            trust.main([*argv, "--out", str(tmp_path / "out")] if "--out" not in argv else argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and fragment in err and "\n" not in err, err
    for path, fragment in ((no_results, "holds no bench.bench_cost_model `results`"),
                           (not_json, "is not a readable bench.bench_cost_model result")):
        with pytest.raises(ConfigError, match=fragment):
            trust.exec_errors(path, required=True)
    assert a_file.read_text() == "keep me" and not (tmp_path / "out").exists()


def test_cpu_check_refuses_a_file_as_out_before_calibrating(tmp_path, capsys, monkeypatch):
    """`bench.cpu_check --out <a file>` ran the whole calibration, wrote its profiles, then failed with a traceback."""
    from bench import cpu_check

    def no_calibration(*args, **kwargs):
        raise AssertionError("the calibration started")

    monkeypatch.setattr(cpu_check, "calibrate", no_calibration)
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    code = cpu_check.main(["--out", str(a_file), "--hardware-dir", str(tmp_path / "hw"),
                           "--measured-dir", str(tmp_path / "hw" / "measured"), "--quick"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --out") and "lies under the file" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and a_file.read_text() == "keep me"


def test_hf_export_refuses_an_out_it_cannot_write_before_loading_anything(tmp_path):
    """`hf_export --out` somewhere unwritable was a traceback."""
    trace = synthetic_trace_dir(tmp_path / "trace")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    res = run_cli("repro.engines.hf_export", "--trace", trace, "--out", a_file / "ckpt", cwd=tmp_path)
    assert res.returncode == 2
    assert_clean_refusal(res, "lies under the file")


@pytest.mark.parametrize("case", ["escaped backslash before a closing quote", "gzip-compressed"])
def test_import_refuses_deep_nesting_hidden_by_an_escape_or_compression(tmp_path, case):
    """`"r1\\\\"` (a string ending in an escaped backslash) hid the nesting after it from the depth check, and 10,000
    levels then segfaulted the importer (leaving a hidden temp folder); a .gz file skipped the check entirely."""
    import gzip

    deep = "[" * 10_000 + "]" * 10_000
    row = '{"request_id": "r1\\\\", "position": 0, "layer": 0, "token": 5, "experts": ' + deep + "}"
    text = json.dumps({"request_id": "r0", "position": 0, "layer": 0, "token": 5, "experts": [1, 2]}) + "\n" + row + "\n"
    if case == "gzip-compressed":
        table = tmp_path / "routing.jsonl.gz"
        table.write_bytes(gzip.compress(text.replace('"r1\\\\"', '"r1"').encode()))
        extra = ["--format", "jsonl"]
    else:
        table = tmp_path / "routing.jsonl"
        table.write_text(text)
        extra = []
    res = run_cli("repro.traces.import", table, "--out", tmp_path / "trace", *extra, cwd=tmp_path)
    assert_clean_refusal(res, "nests a value more than 32 levels deep (line 2)")
    assert sorted(p.name for p in tmp_path.iterdir()) == [table.name]


def test_json_depth_reads_escapes_by_the_parity_of_their_backslashes(tmp_path):
    from repro.traces.tabular import check_json_depth

    path = tmp_path / "t.jsonl"
    for string, deep_is_in_a_string in (('"a\\\\"', False), ('"a\\\\\\"', True), ('"a\\\\\\\\"', False)):
        # "a\\" ends its string; "a\\\" does not (the third backslash escapes the quote); "a\\\\" ends it again
        path.write_text('{"x": ' + string + ', "y": ' + "[" * 40 + "]" * 40 + "}\n")
        if deep_is_in_a_string:
            check_json_depth(path)
        else:
            with pytest.raises(TraceError, match="more than 32 levels deep"):
                check_json_depth(path)
    # a malformed line (an unclosed string) does not hide the next line's nesting
    path.write_text('{"x": "unclosed}\n{"y": ' + "[" * 40 + "]" * 40 + "}\n")
    with pytest.raises(TraceError, match=r"\(line 2\)"):
        check_json_depth(path)


@pytest.mark.parametrize("module, overrides", [
    ("repro.run", ["+no_such_key=1", "logger=none"]),
    ("repro.tune", ["+tune.constraints.nope=1", "logger=none"]),
    ("repro.run", ["experiment=exec", "parallel.devices=0", "logger=none"]),
    ("repro.affinity.count_job", ["trace=/x", "shard=-1"]),
    ("repro.affinity.count_job", ["trace=/x", "+no_such_key=1"]),  # an unknown key was ignored
])
def test_a_refused_config_leaves_no_folder_at_all(tmp_path, module, overrides):
    """repro.tune and the count job kept the job folder of a refused config (and repro.run its empty parents): the
    config is now checked before Hydra creates anything."""
    env = dict(os.environ, WANDB_MODE="disabled", REPRO_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", module, *overrides], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert_one_error_line(res, "")
    assert list(tmp_path.iterdir()) == []


def test_a_job_that_crashes_after_it_started_says_why_in_its_log(tmp_path):
    """A job that failed after it started left run.log at 0 bytes: the Hydra apps' mains now log any failure that is
    not a refused input (those remove the folder) with its traceback, through Hydra's file handler on the root."""
    import logging

    from repro.run import log_failure

    handler = logging.FileHandler(tmp_path / "run.log")
    logging.getLogger().addHandler(handler)
    try:
        try:
            raise RuntimeError("the executor lost rank 3")
        except RuntimeError:
            log_failure("repro.run")
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    text = (tmp_path / "run.log").read_text()
    assert "repro.run failed" in text and "RuntimeError: the executor lost rank 3" in text and "Traceback" in text


@pytest.mark.parametrize("override", ["workload.num_requests=50", "workload.max_prompt_len=64", "workload=arena_hard",
                                      "++workload.label_field=subject"])
def test_a_trace_job_refuses_every_workload_setting_of_the_command_line(override):
    """With trace=, workload.num_requests, workload.max_prompt_len and workload=arena_hard were ignored without a
    word (issue 35 item 4; the rule behind input_len)."""
    overrides = ["trace=/x", override]
    with pytest.raises(ConfigError) as error:
        check_config(composed(*overrides), overrides=overrides)
    key = override.lstrip("+").split("=")[0]
    assert f"{override.lstrip('+')} cannot apply to trace=/x" in str(error.value) and key in str(error.value)
    check_config(composed(override), overrides=[override])  # the same setting routes a workload: it applies


@pytest.mark.parametrize("overrides", [["experiment=exec", "trace=/x"],
                                       ["experiment=paper_table2", "trace=/x", "workload.input_len=null"]])
def test_an_experiments_own_workload_settings_pass_with_trace(overrides):
    """Positive control: exec sets workload.num_requests for the workload it routes; trace= replaces that workload
    (the experiments' sweeps run on traces so), and only the user's own workload settings are refused; dropping a
    setting (=null, as the input_len refusal asks) is not one."""
    check_config(composed(*overrides), overrides=overrides)


def test_run_refuses_a_workload_setting_with_trace_before_creating_anything(tmp_path):
    trace = synthetic_trace_dir(tmp_path / "trace")
    res = run_module("repro.run", f"trace={trace}", "workload.num_requests=50", f"hydra.run.dir={tmp_path / 'job'}",
                     cwd=tmp_path)
    assert_one_error_line(res, "workload.num_requests=50 cannot apply to trace=")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace"]


def test_a_second_config_into_a_finished_job_folder_is_refused(tmp_path):
    """Two different configs with the same hydra.run.dir both exited 0, the later replacing the other's results."""
    trace = synthetic_trace_dir(tmp_path / "trace")
    job = tmp_path / "job"
    res = run_module("repro.run", f"trace={trace}", "system=ep", "parallel.devices=2", f"hydra.run.dir={job}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    before = (job / "metrics.json").read_bytes()
    res = run_module("repro.run", f"trace={trace}", "system=eplb", "parallel.devices=2", f"hydra.run.dir={job}", cwd=tmp_path)
    assert_one_error_line(res, "holds the finished results of another config (it differs in system.name)")
    assert (job / "metrics.json").read_bytes() == before and not (job / ".job-claim.json").exists()
    res = run_module("repro.run", f"trace={trace}", "system=ep", "parallel.devices=2", f"hydra.run.dir={job}", cwd=tmp_path)
    assert res.returncode == 0 and "already finished" in res.stdout + res.stderr  # the same config resumes


def test_a_job_folder_in_use_by_a_live_run_is_refused_and_a_dead_runs_claim_is_taken_over(tmp_path):
    """Concurrent runs into one folder could both "succeed"; the second is now refused while the first holds it."""
    from repro.run import CLAIM, job_claim

    job, config = tmp_path / "job", {"system": {"name": "ep"}}
    with job_claim(job, config):
        with pytest.raises(ConfigError, match=r"is in use by another run \(pid \d+"):
            # a second process is simulated by a claim of another live pid (our parent's)
            (job / CLAIM).write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": os.getppid()}))
            with job_claim(job, {"system": {"name": "eplb"}}):
                pass
    assert json.loads((job / CLAIM).read_text())["pid"] == os.getppid()  # the first run leaves the other's claim
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (job / CLAIM).write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": int(dead.stdout)}))
    with job_claim(job, config):  # its process is gone: the claim is taken over
        assert json.loads((job / CLAIM).read_text())["pid"] == os.getpid()
    assert not (job / CLAIM).exists()


def test_diff_lists_a_job_unreadable_in_b_as_unreadable_not_as_only_in_a(tmp_path, capsys):
    """figures.diff listed a job whose metric is NaN in B as "only in A", as if B had never run it."""
    from test_figures_robust import write_job

    from repro.figures.diff import main as diff_main

    for side in ("a", "b"):
        write_job(tmp_path / side, "paper_dp", "ep", lar=0.5)
        job = write_job(tmp_path / side, "paper_dp", "semmoe", lar=0.7)
        if side == "b":
            (job / "metrics.json").write_text((job / "metrics.json").read_text().replace("0.7", "NaN"))
    write_job(tmp_path / "a", "paper_dp", "eplb", lar=0.6)  # really only in A
    assert diff_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "unreadable in B (1):" in printed and "only in A (1):" in printed
    unreadable = printed.split("unreadable in B (1):")[1]
    assert "semmoe" in unreadable.splitlines()[1] and "eplb" in printed.split("only in A (1):")[1].splitlines()[1]
    assert "## Jobs unreadable in B (1)" in (tmp_path / "out" / "diff.md").read_text()


@pytest.mark.parametrize("victim", ["guard", "stream shell", "side_by_side"])
def test_sigkill_of_one_stream_process_ends_both_streams(tmp_path, victim):
    """SIGKILL of one side_by_side guard left that guard's stream running under init; SIGKILL of a stream's shell
    left its children. side_by_side now stops a stream's whole process group even when its leader is gone; SIGKILL
    of side_by_side alone (item 6: each level) is seen by both guards, which stop their streams."""
    import signal
    import time

    from test_side_by_side import alive

    pids = {name: tmp_path / f"{name}.pid" for name in ("bg", "fg")}
    driver = subprocess.Popen(
        [sys.executable, "-m", "repro.side_by_side", "--log", str(tmp_path / "bg.log"),
         "--background", f"sleep 60 & echo $! > {pids['bg']}; wait", "--foreground", f"sleep 60 & echo $! > {pids['fg']}; wait"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.perf_counter() + 20
    while not all(p.exists() and p.read_text().strip() for p in pids.values()) and time.perf_counter() < deadline:
        time.sleep(0.05)
    sleepers = [int(p.read_text()) for p in pids.values()]
    guard = os.getpgid(sleepers[1])  # the foreground guard leads its stream's group
    shell = int(subprocess.run(["ps", "-o", "ppid=", "-p", str(sleepers[1])], capture_output=True, text=True).stdout)
    os.kill({"guard": guard, "stream shell": shell, "side_by_side": driver.pid}[victim], signal.SIGKILL)
    assert driver.wait(timeout=40) != 0
    deadline = time.perf_counter() + 10
    while any(alive(pid) for pid in sleepers) and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in sleepers)


SERVE_WITH_FAKE_ENGINE = """
import sys
from repro.engines import bench_serving as b
pids = sys.argv[1]
# an engine with a child of its own (as SGLang's schedulers, vLLM's engine cores), which it stops on SIGTERM as the
# real ones do; a router that only sleeps. Each writes "role pid" lines.
engine = ["sh", "-c", f"sleep 60 & child=$!; trap 'kill $child; exit 143' TERM; echo engine_child $child >> {pids}; "
                      f"echo engine $$ >> {pids}; wait"]
router = ["sh", "-c", f"echo router $$ >> {pids}; exec sleep 60"]
b.serve_commands = lambda args: (engine, {}, router)
b._wait_healthy = lambda *args: None
sys.exit(b.main(["serve", "--plan", ".", "--model-path", "m"]))
"""


@pytest.mark.parametrize("victim", ["serve", "engine", "router", "engine_child"])
def test_sigkill_in_bench_serving_serve_ends_the_whole_tree(tmp_path, victim):
    """SIGKILL of `bench_serving serve` left the engine and the router running under init; a killed engine left the
    router running, and (item 6) its own children: they stayed in serve's process group, and serve stopped only the
    engine's pid. The children die with serve (PR_SET_PDEATHSIG); each leads a process group that serve stops as a
    whole (repro.proctree.stop_group) when either child ends."""
    import signal
    import time

    from test_side_by_side import alive

    pids, err = tmp_path / "pids", tmp_path / "stderr"
    # stderr to a file, not a pipe: an orphan holding the pipe would make reading it wait for the orphan's end
    with open(err, "w") as stderr:
        serve = subprocess.Popen([sys.executable, "-c", SERVE_WITH_FAKE_ENGINE, str(pids)], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.perf_counter() + 30
    while (not pids.exists() or len(pids.read_text().splitlines()) < 3) and time.perf_counter() < deadline:
        time.sleep(0.05)
    tree = {role: int(pid) for role, pid in (line.split() for line in pids.read_text().splitlines())}
    os.kill(serve.pid if victim == "serve" else tree[victim], signal.SIGKILL)
    status = serve.wait(timeout=60)
    if victim != "serve":
        died = "router" if victim == "router" else "engine"
        assert status == 1 and f"error: the {died} exited with status" in err.read_text()
    deadline = time.perf_counter() + 10
    while any(alive(pid) for pid in tree.values()) and time.perf_counter() < deadline:
        time.sleep(0.05)
    assert not [role for role, pid in tree.items() if alive(pid)], f"left running after SIGKILL of {victim}"


def test_a_killed_writers_temporary_is_removed_by_the_next_write_into_its_folder(tmp_path):
    """A killed import's hidden temp folder was removed only by a later import to the same --out; any write into
    that folder now removes it (a live writer's temporary is kept)."""
    import socket

    from repro.atomic import atomic_write_text

    host = socket.gethostname()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    killed = tmp_path / f".trace.{host}-{dead}-abc123"
    killed.mkdir()
    (killed / "experts.npy").write_bytes(b"x")
    live = tmp_path / f".other.{host}-{os.getpid()}-def456"
    live.write_text("in progress")
    atomic_write_text(tmp_path / "unrelated.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "unrelated.json"]


def test_capture_never_replaces_an_existing_trace_without_overwrite(tmp_path, capsys):
    """`repro.engines.capture --out` replaced an existing (expensively captured) trace without a word."""
    from repro.engines import capture

    trace = synthetic_trace_dir(tmp_path / "trace")
    before = (trace / "experts.npy").read_bytes()
    code = capture.main(["recorder", str(tmp_path / "dump.pt"), "--shape", "deepseek_v2_lite", "--out", str(trace)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "already holds a routing trace; pass --overwrite" in err and "\n" not in err
    assert (trace / "experts.npy").read_bytes() == before


def test_a_real_serving_sweep_never_replaces_an_earlier_one_without_overwrite(tmp_path, capsys):
    """`bench_serving sweep --out` replaced an earlier sweep's results (a real engine's measurements) silently."""
    from repro.engines import bench_serving

    out = tmp_path / "o"
    out.mkdir()
    (out / "real_per_rate.csv").write_text("rate\n40\n")
    code = bench_serving.main(["sweep", "--url", "http://127.0.0.1:9", "--rates", "1", "--out", str(out),
                               "--model", "m", "workload=mmlu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "real_per_rate.csv exists; pass --overwrite" in err and "\n" not in err
    assert (out / "real_per_rate.csv").read_text() == "rate\n40\n" and sorted(p.name for p in out.iterdir()) == [
        "real_per_rate.csv"]


def test_a_sweep_on_a_trace_refuses_a_workload_setting_of_the_command_line(tmp_path):
    """A workload value swept on the command line is the user's and is refused before the first job (an
    experiment's own sweeper params, e.g. paper_dp's workload=mmlu, are not: test_run's sweeps on traces run them)."""
    trace = synthetic_trace_dir(tmp_path / "trace")
    res = run_module("repro.run", "-m", f"trace={trace}", "workload.num_requests=50,100",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert_one_error_line(res, "workload.num_requests=50,100 cannot apply to trace=")
    assert not (tmp_path / "sweep").exists()
