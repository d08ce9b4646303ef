"""SGLang: a plan as `--init-expert-location` JSON, SGLang's own rules for it, the launch command, and a check
that the server really uses it.

    python -m repro.engines.sglang export  runs/paper_dp/<job> --out placement.json [--model-config config.json]
    python -m repro.engines.sglang check   placement.json --model-config config.json --ep-size 8
    python -m repro.engines.sglang launch  runs/<job> --out placement.json --model-path deepseek-ai/DeepSeek-V2-Lite
    python -m repro.engines.sglang served  placement.json --dump expert_distribution_recorder_*.pt

Format A of `--init-expert-location` (sglang/srt/eplb/expert_location.py, `init_by_mapping`): a JSON object
whose ONLY key is "physical_to_logical_map" (the dict is unpacked into keyword arguments: any other key is a
TypeError at start-up), an int[num_hidden_layers][P] array: one row per model layer, dense layers included;
P = experts + `--ep-num-redundant-experts`, divisible by the EP size; slot p lives on EP rank p // (P / ep);
every logical expert must appear in every row (SGLang does not check this: a missing expert leaves an empty
replica list and the static dispatch map divides by zero). The flag takes a path only when it ends in ".json"
(or ".pt"); any other string is parsed as inline JSON.

The pitfall. Some SGLang MoE paths never consult the expert-location metadata (the default
`--moe-a2a-backend none` path with `--ep-size` 1, several fused/quantised runners, older builds), so a server
can start with `--init-expert-location` and still serve the trivial placement. Routed-expert ids SGLang
returns are *physical* slots (captured after the logical -> physical remap), so a capture mapped back with
the wrong table silently scrambles the trace. Two checks, both loud: `compare_served_map` compares the map
a recorder dump says the server used (`last_physical_to_logical_map`, exact); `placement_evidence` tells from
returned physical ids alone, against a reference popularity, whether they follow the plan or the trivial map.

`launch` serves the plan on a real model, so it reads that model's shape (its config.json, or a known hub id)
and refuses a plan of another shape, or one fitted on synthetic routing or another tokenizer's ids unless
--allow-synthetic-plan / --allow-tokenizer-mismatch (repro.engines.layout.check_serving).

Legend: Lh model (hidden) layers, L MoE layers, E logical experts, P physical slots, D EP ranks, N tokens,
k experts per token.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

from repro import cli
from repro.engines.layout import ModelLayout, SavedPlan, check_serving, load_plan, parse_layer_ids, served_model_layout
from repro.errors import ConfigError, ReproError, TraceError

LOCATION_KEY = "physical_to_logical_map"
PITFALL = (
    "the SGLang server is NOT serving the placement of --init-expert-location ({detail}); some MoE paths ignore "
    "the flag: launch with --moe-a2a-backend deepep and --ep-dispatch-algorithm static (python -m "
    "repro.engines.sglang launch prints the full command) and re-check before trusting any capture or benchmark."
)


def location_rows(saved: SavedPlan) -> np.ndarray:
    """int64[Lh, P] the `--init-expert-location` rows of a plan: plan rows at their model layers, every other
    layer (dense, or MoE but not covered by the plan) trivial: slot p holds expert p % E."""
    placement = saved.placement
    rows = np.tile(np.arange(placement.num_slots) % placement.num_experts, (saved.layout.num_hidden_layers, 1))
    rows[list(saved.layer_ids)] = placement.physical_to_logical
    return rows


def check_location(
    data, layout: ModelLayout, ep_size: int, num_redundant_experts: int | None = None, where: str = "the placement"
) -> np.ndarray:
    """int64[Lh, P] the checked map of `data` (the parsed JSON), or a ConfigError naming the first rule broken.

    SGLang's rules (module docstring), with the model's `layout` and the server's `ep_size` and
    `--ep-num-redundant-experts` (None: any P >= E).
    """
    if not isinstance(data, dict) or LOCATION_KEY not in data:
        raise ConfigError(f"{where} must be a JSON object with the key {LOCATION_KEY!r} (SGLang format A).")
    extra = sorted(set(data) - {LOCATION_KEY})
    if extra:
        raise ConfigError(
            f"{where} has extra key(s) {extra}; SGLang unpacks the object into keyword arguments and fails on them."
        )
    raw = data[LOCATION_KEY]
    try:
        rows = np.asarray(raw)
    except ValueError as e:
        raise ConfigError(f"{where}: {LOCATION_KEY} is not a rectangular array ({e}).") from e
    if rows.ndim != 2 or rows.dtype.kind not in "iu":
        raise ConfigError(
            f"{where}: {LOCATION_KEY} must be a rectangular list of integer rows, got an array of shape {rows.shape} "
            f"and dtype {rows.dtype}."
        )
    num_layers, num_slots = rows.shape
    if num_layers != layout.num_hidden_layers:
        raise ConfigError(
            f"{where} has {num_layers} rows but {layout.name!r} has num_hidden_layers={layout.num_hidden_layers}; "
            "SGLang needs one row per model layer, dense layers included."
        )
    if num_redundant_experts is not None and num_slots != layout.num_experts + num_redundant_experts:
        raise ConfigError(
            f"{where} has {num_slots} slots per layer; with {layout.num_experts} experts and "
            f"--ep-num-redundant-experts {num_redundant_experts} SGLang expects {layout.num_experts + num_redundant_experts}."
        )
    if num_slots < layout.num_experts:
        raise ConfigError(f"{where} has {num_slots} slots per layer, fewer than the model's {layout.num_experts} experts.")
    if num_slots % ep_size:
        raise ConfigError(f"{where} has {num_slots} slots per layer, not divisible by --ep-size {ep_size}.")
    rows = rows.astype(np.int64)
    if rows.min() < 0 or rows.max() >= layout.num_experts:
        bad = int(rows.min() if rows.min() < 0 else rows.max())
        raise ConfigError(f"{where} names expert {bad}, outside 0..{layout.num_experts - 1} of {layout.name!r}.")
    present = np.zeros((num_layers, layout.num_experts), dtype=bool)
    present[np.repeat(np.arange(num_layers), num_slots), rows.ravel()] = True
    if not present.all():
        layer, expert = np.argwhere(~present)[0]
        raise ConfigError(f"{where}: expert {expert} has no slot in layer {layer}; every expert needs one in every row.")
    return rows


def read_location(path: str | Path, layout: ModelLayout, ep_size: int, num_redundant_experts: int | None = None) -> np.ndarray:
    """int64[Lh, P] the checked map of a `--init-expert-location` JSON file."""
    path = Path(path)
    if path.suffix != ".json":
        raise ConfigError(f"{path} does not end in .json; SGLang would parse the path itself as inline JSON.")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path} as JSON ({e}); export it again with python -m repro.engines.sglang export.") from e
    return check_location(data, layout, ep_size, num_redundant_experts, where=str(path))


def export_location(saved: SavedPlan, out: str | Path, overwrite: bool = False) -> np.ndarray:
    """Write the plan's `--init-expert-location` JSON to `out` (atomically, after SGLang's checks; an existing file
    only with overwrite=True); returns it."""
    out = Path(out)
    if out.suffix != ".json":
        raise ConfigError(f"--out {out} must end in .json: SGLang reads the flag as a file path only then.")
    rows = location_rows(saved)
    check_location({LOCATION_KEY: rows.tolist()}, saved.layout, saved.placement.num_devices,
                   saved.placement.num_slots - saved.placement.num_experts)
    cli.write_text_output(out, json.dumps({LOCATION_KEY: rows.tolist()}, separators=(",", ":")), overwrite=overwrite)
    return rows


def launch_command(
    model_path: str, location: str | Path, ep_size: int, attention: str, num_redundant_experts: int = 0,
    port: int = 30000, extra: list[str] | None = None,
) -> list[str]:
    """argv of `python -m sglang.launch_server` serving `location` (SGLang 0.5.23 flag names).

    DeepEP forces ep_size == tp_size, so TP = EP; Attention-DP uses --attn-dp-size (older releases spell it
    `--dp-size D --enable-dp-attention`). Static dispatch keeps tokens on a local replica when there is one. The
    radix (prefix) cache is off: bench_serving sends the same prompts at every rate (after warm-up requests drawn
    from them), so it would serve later rates' prefills from cache, which neither the simulator nor a stream of new
    prompts gets.
    """
    argv = [
        "python", "-m", "sglang.launch_server", "--model-path", model_path, "--port", str(port),
        "--tp-size", str(ep_size), "--ep-size", str(ep_size),
    ]
    if attention == "dp":
        argv += ["--attn-dp-size", str(ep_size)]
    argv += [
        "--moe-a2a-backend", "deepep", "--ep-dispatch-algorithm", "static",
        "--init-expert-location", str(Path(location).resolve()),
        "--ep-num-redundant-experts", str(num_redundant_experts),
        "--enable-return-routed-experts", "--disable-radix-cache",
    ]
    return argv + list(extra or [])


def compare_served_map(served_rows: np.ndarray, expected_rows: np.ndarray) -> list[int]:
    """Model layers whose served map differs from the exported one; served_rows / expected_rows int[Lh, P]."""
    served_rows, expected_rows = np.asarray(served_rows), np.asarray(expected_rows)
    if served_rows.shape != expected_rows.shape:
        raise ConfigError(
            f"the server's map has shape {served_rows.shape} but the exported one {expected_rows.shape}; "
            "the server runs another model or another --ep-num-redundant-experts."
        )
    return [int(x) for x in np.flatnonzero((served_rows != expected_rows).any(axis=1))]


def placement_evidence(physical_NLk: np.ndarray, plan_rows_LP: np.ndarray, reference_LE: np.ndarray) -> dict:
    """Which map do physical expert ids returned by a server follow: the plan's or the trivial one?

    physical_NLk int[N, L, k] routed physical slots of the plan's MoE layers (-1 = padding); plan_rows_LP
    int[L, P] the plan's rows for those layers; reference_LE float[L, E] expert popularity of the same model on
    similar text (e.g. the profile trace the plan was fitted on). Each hypothesis maps slots to logical experts
    (plan: plan_rows[l, p]; trivial: p % E); the one whose per-layer histogram is closer (total variation,
    averaged over layers) to the reference wins if the gap exceeds 3x the sampling noise. verdict: "plan",
    "trivial", "inconclusive" or "indistinguishable" (the plan is the trivial placement).
    """
    physical = np.asarray(physical_NLk, dtype=np.int64)
    rows = np.asarray(plan_rows_LP, dtype=np.int64)
    reference = np.asarray(reference_LE, dtype=np.float64)
    num_layers, num_slots = rows.shape
    num_experts = reference.shape[1]
    if physical.ndim != 3 or physical.shape[1] != num_layers or reference.shape[0] != num_layers:
        raise TraceError(
            f"physical ids of shape {physical.shape}, plan rows {rows.shape} and reference {reference.shape} "
            "disagree on the number of MoE layers."
        )
    trivial = np.arange(num_slots) % num_experts
    valid = physical >= 0
    if physical.size and physical.max() >= num_slots:
        raise TraceError(f"the server returned physical slot {int(physical.max())}, beyond the plan's {num_slots} slots.")
    reference = reference / np.maximum(reference.sum(axis=1, keepdims=True), 1e-30)
    layer_of = np.broadcast_to(np.arange(num_layers)[None, :, None], physical.shape)[valid]
    slots = physical[valid]

    def distance(logical: np.ndarray) -> float:
        counts = np.zeros((num_layers, num_experts))
        np.add.at(counts, (layer_of, logical), 1.0)
        share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
        return float(0.5 * np.abs(share - reference).sum(axis=1).mean())

    tv_plan, tv_trivial = distance(rows[layer_of, slots]), distance(trivial[slots])
    per_layer = max(len(slots) / max(num_layers, 1), 1.0)
    noise = float(np.sqrt(num_experts / per_layer))  # TV of an empirical histogram scales like sqrt(E / n)
    if np.array_equal(rows, np.broadcast_to(trivial, rows.shape)):
        verdict = "indistinguishable"
    elif tv_plan + 3 * noise < tv_trivial:
        verdict = "plan"
    elif tv_trivial + 3 * noise < tv_plan:
        verdict = "trivial"
    else:
        verdict = "inconclusive"
    return {"verdict": verdict, "tv_plan": tv_plan, "tv_trivial": tv_trivial, "noise": noise, "activations": int(len(slots))}


def shout(message: str) -> None:
    """Print a message so that nobody scrolls past it."""
    bar = "!" * 100
    print(f"\n{bar}\n!! {message}\n{bar}\n", file=sys.stderr)


# ---- CLI -----------------------------------------------------------------------------------------------------


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-config", type=cli.existing_file, help="the served model's HF config.json (what SGLang reads)")
    p.add_argument("--shape", help="a simulator shape name (conf/sim/shape), when the config.json is not at hand")
    p.add_argument("--layer-ids", help="model layer of each plan row, e.g. 0,7,15 or 1-26 (default: from the job)")
    p.add_argument("--ep-size", type=cli.positive, help="EP degree (default: the job's parallel.devices)")


def _layout(args) -> ModelLayout | None:
    if args.model_config and args.shape:
        raise ConfigError("pass --model-config or --shape, not both.")
    if args.model_config:
        return ModelLayout.from_hf_config(args.model_config)
    return ModelLayout.from_shape(args.shape) if args.shape else None


def load_saved(args) -> SavedPlan:
    """The plan of a CLI invocation (plan dir, layout and layer options)."""
    layer_ids = parse_layer_ids(args.layer_ids) if args.layer_ids else None
    return load_plan(args.plan, ep_size=args.ep_size, layout=_layout(args), layer_ids=layer_ids)


def _serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-synthetic-plan", action="store_true",
                   help="serve a plan fitted on synthetic / tiny-model / replayed routing anyway (warned loudly)")
    p.add_argument("--allow-tokenizer-mismatch", action="store_true",
                   help="serve a plan fitted on another tokenizer's token ids anyway (warned loudly)")


def load_for_serving(args, model_path: str) -> SavedPlan:
    """The plan of a CLI invocation that serves it on the real model at `model_path`: the model's own layout
    (repro.engines.layout.served_model_layout), the plan checked against it (check_serving), warnings shouted."""
    layer_ids = parse_layer_ids(args.layer_ids) if args.layer_ids else None
    layout = served_model_layout(model_path, args.model_config, args.shape)
    saved = load_plan(args.plan, ep_size=args.ep_size, layout=layout, layer_ids=layer_ids)
    for warning in check_serving(saved, model_path, explicit_layer_ids=layer_ids is not None,
                                 allow_synthetic=args.allow_synthetic_plan,
                                 allow_other_tokenizer=args.allow_tokenizer_mismatch):
        shout(warning)
    return saved


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m repro.engines.sglang", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="write a plan's --init-expert-location JSON")
    export.add_argument("plan", type=cli.existing_path, help="a job directory under runs/ or its plan/ folder")
    cli.add_output(export, "--out", help="JSON file to write (must end in .json)")
    _layout_args(export)
    launch = sub.add_parser("launch", help="export, then print the sglang.launch_server command for it")
    launch.add_argument("plan", type=cli.existing_path)
    cli.add_output(launch, "--out", help="JSON file to write (must end in .json)")
    launch.add_argument("--model-path", required=True, help="--model-path for SGLang (HF id or local folder)")
    launch.add_argument("--port", type=cli.port, default=30000)
    launch.add_argument("--attention", choices=["dp", "tp"], help="default: the job's parallel.attention")
    _layout_args(launch)
    _serving_args(launch)
    check = sub.add_parser("check", help="apply SGLang's rules to an --init-expert-location JSON")
    check.add_argument("location", type=cli.existing_file)
    check.add_argument("--num-redundant-experts", type=cli.count, help="the server's --ep-num-redundant-experts")
    _layout_args(check)
    served = sub.add_parser("served", help="compare the map a recorder dump says the server used with the JSON")
    served.add_argument("location", type=cli.existing_file)
    served.add_argument("--dump", type=cli.existing_file, nargs="+", required=True,
                        help="per_pass / per_token recorder .pt files")
    _layout_args(served)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("export", "launch"):
            saved = load_for_serving(args, args.model_path) if args.command == "launch" else load_saved(args)
            rows = export_location(saved, args.out, overwrite=args.overwrite)
            placement = saved.placement
            print(
                f"wrote {args.out}: {rows.shape[0]} layers x {rows.shape[1]} slots ({len(saved.layer_ids)} from the "
                f"plan, {saved.layout.num_hidden_layers - len(saved.layer_ids)} trivial), EP {placement.num_devices}, "
                f"{placement.num_slots - placement.num_experts} redundant slots"
            )
            uncovered = sorted(set(saved.layout.moe_layer_ids) - set(saved.layer_ids))
            if uncovered:
                print(f"note: MoE layers {uncovered} are not in the plan and keep the trivial placement.", file=sys.stderr)
            if args.command == "launch":
                attention = args.attention or saved.plan.parallel.attention
                argv_ = launch_command(args.model_path, args.out, placement.num_devices, attention,
                                       placement.num_slots - placement.num_experts, args.port)
                print(shlex.join(argv_))
        elif args.command == "check":
            layout = _layout(args)
            if layout is None or args.ep_size is None:
                raise ConfigError("check needs the model (--model-config or --shape) and --ep-size.")
            rows = read_location(args.location, layout, args.ep_size, args.num_redundant_experts)
            print(f"{args.location}: valid for {layout.name!r} at EP {args.ep_size} ({rows.shape[0]} x {rows.shape[1]}).")
        else:
            from repro.engines.payloads import read_served_map

            layout = _layout(args)
            if layout is None or args.ep_size is None:
                raise ConfigError("served needs the model (--model-config or --shape) and --ep-size.")
            expected = read_location(args.location, layout, args.ep_size)
            served_rows = read_served_map(args.dump)
            wrong = compare_served_map(served_rows, expected)
            if wrong:
                shout(PITFALL.format(detail=f"{len(wrong)} layers differ, first {wrong[:5]}"))
                return 3
            print(f"the server serves {args.location} on every one of its {len(expected)} layers.")
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
