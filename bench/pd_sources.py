"""Prefill/decode-disaggregated serving on the suite's routing sources (issue 27 item 3): one placement for both
pools against separate prefill and decode placements, at equal device count, per decode rule.

    python -m bench.pd_sources [--sources tiny_gen32 synthetic_deepseek_v2_lite] [--devices 8] [--seed 0]
        [--split evaluate] [--rate 400] [--out FILE.json]

Each pool has `--devices` ranks (Attention-DP, EP over the pool): the prefill pool runs DeepEP normal kernels, the
decode pool DeepEP low-latency kernels, the KV cache crosses the H200 profile's RDMA. Systems are fitted on the
profile split; requests of --split arrive as a Poisson stream at --rate per second on the DeepSeek-V2-Lite shape
(the trace's layers and experts mapped onto it, routing_map=trace). Sources that route prompts only are measured on
the prompt-tail proxy (`prompt_tail_as_decode`), marked "proxy".
  one placement   both pools use the prefill plan (vanilla EP), decode rank by that plan (round-robin);
  separate        the decode pool uses the decode plan (system=signature at its default), decode rank by its rule;
  + rule          the separate placements with plan_live (signature match under a capacity over the requests
                  decoding now) / round_robin / least_loaded decode ranks instead.
TTFT and TPOT are means over the requests; goodput counts requests within TTFT <= 1 s and TPOT <= 50 ms.

Legend: D ranks per pool.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.signature_sources import DECODE_SHARE, SOURCES, job_config
from repro import cli
from repro.eval.decode_phase import prompt_tail_as_decode
from repro.parallel import ParallelConfig
from repro.sim import ModelShape, load_hardware
from repro.sim.costs import CostModel
from repro.sim.disaggregated import kv_link, pd_metrics, run_disaggregated
from repro.sim.engine import EngineConfig
from repro.sim.shapes import routing_map
from repro.sim.simulate import build_requests, kv_capacity
from repro.systems import make_system

CONF = Path(__file__).resolve().parents[1] / "conf"
TTFT_SLO_S, TPOT_SLO_S = 1.0, 0.05


def measure(source: str, devices: int, seed: int, split: str, rate: float) -> list[dict]:
    import yaml

    from repro.run import build_traces

    config = job_config(source, devices, seed, split)
    profile, evaluation = build_traces(config)
    proxy = bool(np.all(evaluation.prefill_len == evaluation.lengths()))
    if proxy:
        profile, evaluation = (prompt_tail_as_decode(t, DECODE_SHARE) for t in (profile, evaluation))
    parallel = ParallelConfig(devices=devices, attention="dp", tokens_per_step=64)
    shape = ModelShape.from_config(yaml.safe_load((CONF / "sim" / "shape" / "deepseek_v2_lite.yaml").read_text()))
    hw = load_hardware(dict(config["hardware"], nodes=1, devices_per_node=devices))
    mapping = routing_map(shape, evaluation, "trace")
    costs = {backend: CostModel(shape, hw, mapping, devices, "dp", backend)
             for backend in ("deepep_normal", "deepep_low_latency")}
    engine = EngineConfig(8192, 256, "mixed", kv_capacity(shape, hw, devices, "dp"), 64, 0.0, 2)
    rng = np.random.default_rng(seed)
    requests, _, _ = build_requests(evaluation, np.arange(evaluation.num_requests), 1, "captured", rng, rng)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, evaluation.num_requests))
    plans = {"ep": make_system("ep").fit(profile, parallel, np.random.default_rng(seed)),
             "signature": make_system("signature").fit(profile, parallel, np.random.default_rng(seed))}
    variants = {"one placement (ep)": ("ep", "plan"), "separate (signature)": ("signature", "plan"),
                "separate, plan_live": ("signature", "plan_live"),
                "separate, round_robin": ("signature", "round_robin"),
                "separate, least_loaded": ("signature", "least_loaded")}
    rows = []
    for variant, (decode_system, rule) in variants.items():
        result = run_disaggregated(plans["ep"], costs["deepep_normal"], engine, plans[decode_system],
                                   costs["deepep_low_latency"], engine, requests, arrivals, kv_link(shape, hw, "rdma"),
                                   decode_rule=rule)
        rows.append({"source": source, "proxy": proxy, "seed": seed, "split": split, "devices_per_pool": devices,
                     "rate_per_s": rate, "variant": variant, **pd_metrics(result, TTFT_SLO_S, TPOT_SLO_S)})
    return rows


COLUMNS = ("prefill_ttft_mean_s", "decode_tpot_mean_s", "decode_tpot_p90_s", "decode_tokens_per_s",
           "goodput_requests_per_s", "decode_lar", "kv_transfer_mean_s")


def table(rows: list[dict]) -> str:
    lines = ["| source | variant | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for row in rows:
        label = row["source"] + (" (proxy)" if row["proxy"] else "")
        cells = [f"{row.get(c, float('nan')) * (1e3 if c.endswith('_s') and not c.endswith('per_s') else 1):.4g}"
                 for c in COLUMNS]
        lines.append(f"| {label} | {row['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n(seconds columns in ms)"


def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(prog="python -m bench.pd_sources", description=__doc__.splitlines()[0])
    p.add_argument("--sources", nargs="+", default=["tiny_gen32", "synthetic_deepseek_v2_lite"], choices=list(SOURCES))
    p.add_argument("--devices", type=cli.positive, default=8)
    p.add_argument("--seed", type=cli.seed, default=0)
    p.add_argument("--split", default="evaluate", choices=["validate", "evaluate"])
    p.add_argument("--rate", type=cli.rate, default=400.0)
    cli.add_output(p, "--out", required=False, help="JSON file of every row (written atomically)")
    args = p.parse_args(argv)
    rows = [row for source in args.sources for row in measure(source, args.devices, args.seed, args.split, args.rate)]
    if args.out:  # claimed while parsing (never an existing file without --overwrite): written after the work
        cli.write_text_output(args.out, json.dumps(rows, indent=1), overwrite=args.overwrite)
    print(table(rows))


if __name__ == "__main__":
    main()
