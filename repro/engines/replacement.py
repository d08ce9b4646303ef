"""Re-placements in the engines' formats: each change of plan as the files SGLang and vLLM read, with the list of
expert copies it makes (issue 34, item 6).

    python -m repro.engines.replacement runs/<job_a> runs/<job_b> [runs/<job_c> ...] --out replacements/ \
        [--model-config config.json | --shape deepseek_v2_lite] [--layer-ids 1-26] [--ep-size 8] [--devices-per-node 8]

Plans are given in serving order; step k (plan k-1 -> plan k) gets its own folder `step_<k>/` holding:
  sglang_init_expert_location.json  plan k as SGLang's `--init-expert-location` (format A, every model layer;
                                    repro.engines.sglang's rules checked)
  vllm_placement.json               plan k for the suite's vLLM EPLB policy plugin (repro.engines.vllm)
  vllm_initial_expert_map.json      plan k as one physical-to-logical list per MoE layer of the model (vLLM PR #49572's
                                    `eplb_config.initial_expert_map_path`, open as of 2026-12: vLLM moves the loaded
                                    weights to it with its own EPLB transfer before serving)
  vllm_expert_to_ep_rank.json       {"expert_to_ep_rank": [rank of each expert]} (vLLM issue #34297 / PR #34811's
                                    proposed --expert-placement-file), only when plan k fits it: one map for every
                                    MoE layer, no replicas; manifest.json says why when it is left out
  moved_experts.csv                 one row per expert copy: plan_layer, model_layer, expert, from_device, to_device,
                                    link (local | nvlink | rdma), by repro.sim.migration_cost.expert_copies (a copy
                                    comes from a holder on the receiver's node when there is one; nodes of
                                    --devices-per-node ranks, default the new plan's parallel.devices_per_node)
  manifest.json                     the two plans, copies per layer and per link, files written and left out
The folder appears whole or not at all (written aside, then renamed); an existing non-empty --out is replaced only
with --overwrite and only when it holds this command's output (a manifest.json per step).

Legend: L plan layers, E experts, D devices (EP ranks), M expert copies.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import numpy as np

from repro import cli
from repro.atomic import atomic_dir
from repro.engines import sglang, vllm
from repro.engines.layout import SavedPlan
from repro.errors import ConfigError
from repro.sim.migration_cost import LINKS, expert_copies

MOVES_HEADER = ("plan_layer", "model_layer", "expert", "from_device", "to_device", "link")


def check_same_deployment(old: SavedPlan, new: SavedPlan) -> None:
    """One ConfigError unless `new` can replace `old` on the same servers: same model layout, plan layers, EP size
    and slots per layer."""
    a, b = old.placement, new.placement
    if old.layout != new.layout or old.layer_ids != new.layer_ids:
        raise ConfigError(f"{new.source} is for model {new.layout.name!r} layers {list(new.layer_ids)[:4]}..., "
                          f"{old.source} for {old.layout.name!r} layers {list(old.layer_ids)[:4]}...; a re-placement "
                          "keeps the served model and the plan's layers.")
    if (a.num_devices, a.num_slots) != (b.num_devices, b.num_slots):
        raise ConfigError(f"{new.source} places {b.num_slots} slots on {b.num_devices} ranks but {old.source} "
                          f"{a.num_slots} on {a.num_devices}; a re-placement keeps the EP size and redundant slots.")


def node_size(new: SavedPlan, devices_per_node: int | None) -> int:
    """Ranks per node: `devices_per_node`, else the new plan's parallel.devices_per_node (at most the EP size)."""
    return min(devices_per_node or new.plan.parallel.devices_per_node, new.placement.num_devices)


def moved_experts(old: SavedPlan, new: SavedPlan, devices_per_node: int | None = None) -> np.ndarray:
    """int64[M, 5] (plan layer, expert, from_device, to_device, link) of going from `old` to `new`
    (migration_cost.expert_copies on nodes of `node_size` ranks)."""
    check_same_deployment(old, new)
    return expert_copies(old.placement, new.placement, node_size(new, devices_per_node))


def step_files(old: SavedPlan, new: SavedPlan, devices_per_node: int | None = None) -> dict[str, str]:
    """{file name: text} of one re-placement's folder (module docstring)."""
    copies = moved_experts(old, new, devices_per_node)
    location = sglang.location_rows(new)
    placement = new.placement
    sglang.check_location({sglang.LOCATION_KEY: location.tolist()}, new.layout, placement.num_devices,
                          placement.num_slots - placement.num_experts)
    files = {
        "sglang_init_expert_location.json": json.dumps({sglang.LOCATION_KEY: location.tolist()}, separators=(",", ":")),
        "vllm_placement.json": json.dumps(vllm.placement_document(new), separators=(",", ":")),
        "vllm_initial_expert_map.json": json.dumps(vllm.placement_rows(new).tolist(), separators=(",", ":")),
    }
    left_out = {}
    ranks, why = vllm.expert_to_ep_rank(new)
    if ranks is None:
        left_out["vllm_expert_to_ep_rank.json"] = why
    else:
        files["vllm_expert_to_ep_rank.json"] = json.dumps({"expert_to_ep_rank": ranks})
    table = io.StringIO()
    table.write(",".join(MOVES_HEADER) + "\n")
    for layer, expert, source, target, link in copies.tolist():
        table.write(f"{layer},{new.layer_ids[layer]},{expert},{source},{target},{LINKS[link]}\n")
    files["moved_experts.csv"] = table.getvalue()
    per_layer = np.bincount(copies[:, 0], minlength=placement.num_layers)
    manifest = {
        "from": str(old.source), "to": str(new.source), "model": new.layout.name, "ep_size": placement.num_devices,
        "devices_per_node": node_size(new, devices_per_node),
        "experts_moved": int(len(copies)),
        "experts_moved_by_link": {name: int(np.sum(copies[:, 4] == i)) for i, name in enumerate(LINKS)},
        "experts_moved_per_plan_layer": per_layer.tolist(),
        "files": sorted([*files, "manifest.json"]), "left_out": left_out,
    }
    files["manifest.json"] = json.dumps(manifest, indent=1)
    return files


def write_replacements(plans: list[SavedPlan], out: str | Path, overwrite: bool = False,
                       devices_per_node: int | None = None) -> list[dict]:
    """Write step_<k>/ for every consecutive pair of `plans` into the folder `out`, atomically; returns the
    manifests. Every step is built (and checked) before anything is written."""
    if len(plans) < 2:
        raise ConfigError("a re-placement needs at least two plans: the one served and the one replacing it.")
    steps = [step_files(old, new, devices_per_node) for old, new in zip(plans, plans[1:], strict=False)]
    out = Path(out)
    if out.is_dir() and any(out.iterdir()):
        ours = all(child.is_dir() and (child / "manifest.json").is_file() for child in out.iterdir())
        if not (overwrite and ours):
            raise ConfigError(f"--out {out} exists and is not empty; pass --overwrite to replace an earlier re-placement "
                              "export, or choose a new folder." if ours else
                              f"--out {out} holds files this command did not write; choose a new folder.")

    def fill(folder: Path) -> None:
        width = len(str(len(steps)))
        for k, files in enumerate(steps, start=1):
            step = folder / f"step_{k:0{width}d}"
            step.mkdir()
            for name, text in files.items():
                (step / name).write_text(text, encoding="utf-8")

    try:
        atomic_dir(out, fill, replace=True)
    except OSError as e:
        raise cli.OutputError(f"cannot write --out {out} ({e.strerror or e}); choose a writable folder.") from None
    return [json.loads(files["manifest.json"]) for files in steps]


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m repro.engines.replacement", description=__doc__.splitlines()[0])
    p.add_argument("plans", type=cli.existing_path, nargs="+",
                   help="job directories under runs/ (or their plan/ folders) in serving order, at least two")
    cli.add_output(p, "--out", what="dir", help="folder to write step_<k>/ into")
    sglang._layout_args(p)
    p.add_argument("--devices-per-node", type=cli.positive,
                   help="EP ranks per node, which decides NVLink or RDMA per copy (default: the job's parallel.devices_per_node)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def work() -> None:
        plans = [sglang.load_saved(argparse.Namespace(**{**vars(args), "plan": plan})) for plan in args.plans]
        if args.devices_per_node and plans[-1].placement.num_devices % min(args.devices_per_node, plans[-1].placement.num_devices):
            raise ConfigError(f"--devices-per-node {args.devices_per_node} does not divide the "
                              f"{plans[-1].placement.num_devices} EP ranks.")
        for k, manifest in enumerate(write_replacements(plans, args.out, args.overwrite, args.devices_per_node), start=1):
            links = ", ".join(f"{n} {name}" for name, n in manifest["experts_moved_by_link"].items())
            left = f"; left out {sorted(manifest['left_out'])}" if manifest["left_out"] else ""
            print(f"step {k}: {manifest['experts_moved']} expert copies ({links}){left}")
        print(f"wrote {args.out}")

    return cli.run(work)


if __name__ == "__main__":
    sys.exit(main())
