"""Decode placement by prefill signature on the suite's routing sources (issue 17 item 5): decode-phase LAR, token
balance, expert weights read and MoE time per decode step, with the source's prefill-to-decode signature
correlation beside them.

    python -m bench.signature_sources [--sources synthetic_deepseek_v2_lite replay_olmoe tiny_gen32]
        [--devices 8] [--seeds 0 1 2] [--fit-seeds ...] [--split evaluate] [--out FILE.json]

Sources that route prompts only (the synthetic presets, OLMoE replay) are measured on a proxy: the last
DECODE_SHARE of each prompt plays the generated tokens (`prompt_tail_as_decode`), marked "proxy" in the table.
The tiny model generates greedily (model.max_new_tokens) and is measured on its real generated tokens.
Systems are fitted on the profile split and measured on --split (validate to choose, evaluate to report).

Legend: D devices (EP degree), R requests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from repro import cli
from repro.eval.decode_phase import decode_phase_metrics, prompt_tail_as_decode
from repro.eval.time_cost import DEFAULT_SHAPE, load_shape, time_model
from repro.parallel import ParallelConfig
from repro.systems import Plan, make_system
from repro.systems.signature import request_signatures, signature_correlation

DECODE_SHARE = 0.25
SOURCES = {  # name -> config overrides
    "synthetic_deepseek_v2_lite": ["model=synthetic_deepseek_v2_lite"],
    "replay_olmoe": ["model=replay_olmoe"],
    "tiny_gen32": ["model=tiny_mixtral", "model.max_new_tokens=32"],
}
VARIANTS = {  # name -> (system, params); coplace_only keeps each decode on its prefill rank (round-robin)
    "ep": ("ep", {}),
    "default": ("signature", {}),  # system=signature as configured (placement=signature_time since issue 27)
    "signature_vanilla": ("signature", {"placement": "vanilla", "match": "experts"}),
    "coplace_only": ("signature", {"placement": "signature"}),
    "signature": ("signature", {"placement": "signature"}),
    "signature_exact": ("signature", {"placement": "signature_exact"}),
    "signature_slack8": ("signature", {"placement": "signature", "capacity_slack": 8}),
    "signature_eldr": ("signature_eldr", {"placement": "signature"}),
    "signature_match_experts": ("signature", {"placement": "signature", "match": "experts"}),
    "eldr_vanilla": ("signature_eldr", {"placement": "vanilla", "match": "experts"}),
    # decode placement for time (issue 27): swaps that shorten the profile's decode step from EP or the co-placement
    "time": ("signature", {"placement": "time", "match": "experts"}),
    "signature_time": ("signature", {"placement": "signature_time"}),
    "signature_time_eldr": ("signature_eldr", {"placement": "signature_time"}),
}
COLUMNS = ("decode_lar", "decode_token_imbalance_max_mean", "decode_step_token_imbalance_max_mean",
           "decode_expert_load_imbalance_max_mean", "decode_batch_distinct_experts_max",
           "decode_device_distinct_experts_max", "decode_moe_seconds_per_step")


def job_config(source: str, devices: int, seed: int, split: str) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf"
    overrides = [*SOURCES[source], f"seed={seed}", f"parallel.devices={devices}", "parallel.attention=dp",
                 "logger=none", f"evaluate_split={split}"]
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def measure(source: str, devices: int, seed: int, split: str, fit_seeds: list[int] | None = None,
            variants: list[str] | None = None, batch_requests: int | None = None) -> list[dict]:
    """One row per variant and fit seed: decode-phase metrics of the variant on `source` (seed, split) at EP `devices`.
    fit_seeds: seeds of the systems' rng (k-means start, placement swaps); default [seed]. They vary the fit alone
    where a new config seed is costly (the tiny model retrains for every seed)."""
    from repro.run import build_traces

    config = job_config(source, devices, seed, split)
    profile, evaluation = build_traces(config)
    proxy = bool(np.all(evaluation.prefill_len == evaluation.lengths()))
    if proxy:
        profile, evaluation = (prompt_tail_as_decode(t, DECODE_SHARE) for t in (profile, evaluation))
    prefill_sig, decode_sig = request_signatures(evaluation, "prefill"), request_signatures(evaluation, "decode")
    correlation = signature_correlation(prefill_sig, decode_sig)
    specific = signature_correlation(prefill_sig, decode_sig, centred=True)
    parallel = ParallelConfig.from_config(config["parallel"])
    shape = load_shape(DEFAULT_SHAPE)
    rows = []
    for fit_seed in fit_seeds or [seed]:
        for variant, (system, params) in VARIANTS.items():
            if variants and variant not in variants:
                continue
            plan = make_system(system, **params).fit(profile, parallel, np.random.default_rng(fit_seed))
            if variant == "coplace_only":
                plan = Plan(plan.placement, plan.parallel)
            metrics = decode_phase_metrics(plan, evaluation, batch_requests=batch_requests,
                                           time_model=time_model(plan, evaluation, config["hardware"], shape))
            rows.append({"source": source, "proxy": proxy, "seed": seed, "fit_seed": fit_seed, "split": split,
                         "devices": devices, "variant": variant, "decode_batch_requests": batch_requests, "signature_correlation": correlation,
                         "signature_correlation_centred": specific,
                         "eval_requests": evaluation.num_requests, **metrics})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: mean (and std over seeds and fit seeds) of every column per source and variant."""
    lines = ["| source | corr | centred corr | variant | " + " | ".join(c.removeprefix("decode_") for c in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 4) + "|"]
    keys = dict.fromkeys((r["source"], r["variant"]) for r in rows)
    for source, variant in keys:
        group = [r for r in rows if r["source"] == source and r["variant"] == variant]
        corr = np.mean([r["signature_correlation"] for r in group])
        specific = np.mean([r["signature_correlation_centred"] for r in group])
        label = source + (" (proxy)" if group[0]["proxy"] else "")

        def cell(c, group=group):
            values = np.array([r[c] for r in group], dtype=float)
            scale = 1e6 if c.endswith("seconds_per_step") else 1.0  # microseconds
            return f"{values.mean() * scale:.3f}" + (f" ± {values.std() * scale:.3f}" if len(values) > 1 else "")

        lines.append(f"| {label} | {corr:.3f} | {specific:.3f} | {variant} | " + " | ".join(cell(c) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = cli.ArgumentParser(prog="python -m bench.signature_sources", description=__doc__.splitlines()[0])
    p.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    p.add_argument("--devices", type=cli.positive, default=8)
    p.add_argument("--seeds", type=cli.seed, nargs="+", default=[0, 1, 2])
    p.add_argument("--fit-seeds", type=cli.seed, nargs="+", help="rng seeds of the fits (default: each config seed)")
    p.add_argument("--split", default="evaluate", choices=["validate", "evaluate"])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="measure only these (default: all)")
    p.add_argument("--decode-batch", type=cli.positive, help="decode in waves of this many requests (default: one static "
                   "batch of every evaluated request, whose size grows with the split)")
    cli.add_output(p, "--out", required=False, help="JSON file of every row (written atomically)")
    args = p.parse_args(argv)
    rows = [row for source in args.sources for seed in args.seeds
            for row in measure(source, args.devices, seed, args.split, args.fit_seeds, args.variants,
                               args.decode_batch)]
    if args.out:  # claimed while parsing (never an existing file without --overwrite): written after the work
        cli.write_text_output(args.out, json.dumps(rows, indent=1), overwrite=args.overwrite)
    print(table(rows))


if __name__ == "__main__":
    main()
