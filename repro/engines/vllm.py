"""vLLM: a plan's placement installed as a custom EPLB policy through the `vllm.general_plugins` entry point.

    python -m repro.engines.vllm export runs/paper_dp/<job> --out placement.json [--model-config config.json]
    python -m repro.engines.vllm launch runs/<job> --out placement.json --model Qwen/Qwen3-30B-A3B
    # prints: SEMMOE_VLLM_PLACEMENT=/abs/placement.json vllm serve ... --enable-eplb --eplb-config '{"policy": "semmoe", ...}'

Supported vLLM: exactly SUPPORTED_VLLM (0.33.0); the hooks below are internals that move between releases.
vLLM has no flag or file for an initial expert placement (unlike SGLang's `--init-expert-location`), but its EPLB
asks a policy for the map every `step_interval` forward steps and moves the expert weights to match
(`rearrange_expert_weights_inplace`). The plugin registers policy "semmoe", whose `rebalance_experts` ignores
the measured load and returns the plan's map, so the first rearrangement (after step_interval / 4 steps: vLLM
starts the counter at 3/4 of the interval) installs the plan and later ones find nothing to move. Warm the
server up with a few requests before measuring; `"use_async": false` (async EPLB accepts only the default
policy).

What `register()` patches (vLLM 0.33.0): `vllm.distributed.eplb.policy.EPLB_POLICIES["semmoe"]` (the dict
`EplbState` indexes with `eplb_config.policy`), and the pydantic `Literal["default"]` of `EPLBConfig.policy`
(`vllm.config.parallel.EPLBPolicyOption`), rebuilt so `--eplb-config '{"policy": "semmoe"}'` validates.
vLLM calls every installed general plugin in each of its processes; without $SEMMOE_VLLM_PLACEMENT the plugin
does nothing (and imports nothing), so installing this package never changes a vLLM that does not ask for it.

vLLM's maps cover MoE layers only (`EplbModelState.physical_to_logical_map` [num_moe_layers, P]), unlike
SGLang's all-layer rows; slot p lives on EP rank p // (P / ep_size) in both. MoE layers the plan does not cover
get vLLM's own initial map: [0 .. E-1] then expert i % E for redundant slot E + i.

`launch` checks the plan against the served model's shape and refuses a plan fitted on synthetic routing or on
another tokenizer's ids unless told otherwise (repro.engines.layout.check_serving, as `sglang launch`).

Legend: Lm MoE layers of the model, E logical experts, P physical slots, D EP ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import numpy as np

from repro import cli
from repro.engines.layout import SavedPlan
from repro.errors import ConfigError, ReproError

SUPPORTED_VLLM = "0.33.0"
POLICY_NAME = "semmoe"
ENV_PLACEMENT = "SEMMOE_VLLM_PLACEMENT"
ENV_ANY_VERSION = "SEMMOE_VLLM_ANY_VERSION"  # "1": run on another vLLM release at your own risk
FORMAT = "semmoe-vllm-placement/1"


def placement_rows(saved: SavedPlan) -> np.ndarray:
    """int64[Lm, P] the plan as vLLM's MoE-layer map (uncovered MoE layers: vLLM's initial map)."""
    placement, layout = saved.placement, saved.layout
    initial = np.arange(placement.num_slots) % placement.num_experts
    rows = np.tile(initial, (len(layout.moe_layer_ids), 1))
    index = {layer: i for i, layer in enumerate(layout.moe_layer_ids)}
    rows[[index[layer] for layer in saved.layer_ids]] = placement.physical_to_logical
    return rows


def check_placement(data, where: str = "the placement") -> dict:
    """The checked placement document: format, int[Lm, P] map, every expert in every row, P divisible by D."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{where} is not a Sem-MoE vLLM placement (format {FORMAT!r}); export one with "
                          "python -m repro.engines.vllm export.")
    try:
        rows = np.asarray(data["physical_to_logical_map"])
        num_experts, ep_size = int(data["num_logical_experts"]), int(data["ep_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{where} misses or garbles {e}; export it again.") from e
    if rows.ndim != 2 or rows.dtype.kind not in "iu" or rows.size == 0:
        raise ConfigError(f"{where}: physical_to_logical_map must be a non-empty rectangular list of integer rows.")
    if rows.shape[1] % ep_size or rows.shape[1] < num_experts:
        raise ConfigError(f"{where}: {rows.shape[1]} slots per layer do not fit {num_experts} experts on {ep_size} ranks.")
    present = np.zeros((rows.shape[0], num_experts), dtype=bool)
    if rows.min() < 0 or rows.max() >= num_experts:
        raise ConfigError(f"{where} names expert ids outside 0..{num_experts - 1}.")
    present[np.repeat(np.arange(rows.shape[0]), rows.shape[1]), rows.ravel()] = True
    if not present.all():
        layer, expert = np.argwhere(~present)[0]
        raise ConfigError(f"{where}: expert {expert} has no slot in MoE layer {layer}.")
    return dict(data, physical_to_logical_map=rows.astype(np.int64))


def placement_document(saved: SavedPlan) -> dict:
    """The plan's checked vLLM placement document (what `export_placement` writes)."""
    rows = placement_rows(saved)
    document = {
        "format": FORMAT, "vllm": SUPPORTED_VLLM, "model": saved.layout.name,
        "moe_layer_ids": list(saved.layout.moe_layer_ids), "num_logical_experts": saved.placement.num_experts,
        "ep_size": saved.placement.num_devices, "physical_to_logical_map": rows.tolist(),
    }
    check_placement(document)
    return document


def expert_to_ep_rank(saved: SavedPlan) -> tuple[list[int] | None, str]:
    """(the plan as vLLM's proposed static placement file's list, or None, and why not): `{"expert_to_ep_rank":
    [rank of expert e]}` (vLLM issue #34297, PR #34811, open as of 2026-12) holds one rank per logical expert for
    every MoE layer and no replicas, so only a plan whose every MoE layer of the model (uncovered ones: vLLM's
    initial map) puts each expert on the same rank, once, fits it."""
    placement = saved.placement
    if placement.is_replicated:
        return None, (f"the plan has {placement.num_slots - placement.num_experts} redundant slots per layer; "
                      "expert_to_ep_rank has no replicas")
    rows = placement_rows(saved)  # [Lm, P], P = E
    rank_of_expert = np.empty_like(rows)
    rank_of_expert[np.arange(len(rows))[:, None], rows] = np.arange(rows.shape[1]) // placement.slots_per_device
    if np.any(rank_of_expert != rank_of_expert[0]):
        layer = int(np.argmax(np.any(rank_of_expert != rank_of_expert[0], axis=1)))
        return None, (f"MoE layer {saved.layout.moe_layer_ids[layer]} places experts on other ranks than MoE layer "
                      f"{saved.layout.moe_layer_ids[0]}; expert_to_ep_rank is one map for every layer")
    return rank_of_expert[0].tolist(), ""


def export_placement(saved: SavedPlan, out: str | Path, overwrite: bool = False) -> dict:
    """Write the plan's vLLM placement JSON to `out` atomically (an existing file only with overwrite=True);
    returns the document."""
    document = placement_document(saved)
    cli.write_text_output(out, json.dumps(document, separators=(",", ":")), overwrite=overwrite)
    return document


def read_placement(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the placement {path} ({e}); set ${ENV_PLACEMENT} to an exported file.") from e
    return check_placement(data, where=str(path))


def policy_map(document: dict, weight_shape: tuple[int, int], num_replicas: int, num_ranks: int) -> np.ndarray:
    """int64[Lm, P] what the policy returns, after checking vLLM asks for the map that was exported.

    weight_shape: (MoE layers, logical experts) of vLLM's load statistics; num_replicas: its physical slots P;
    num_ranks: its EP size.
    """
    rows = document["physical_to_logical_map"]
    wanted = (weight_shape[0], num_replicas, weight_shape[1], num_ranks)
    have = (rows.shape[0], rows.shape[1], document["num_logical_experts"], document["ep_size"])
    if wanted != have:
        raise ConfigError(
            f"vLLM asks for {wanted[0]} MoE layers x {wanted[1]} slots of {wanted[2]} experts on {wanted[3]} ranks but "
            f"${ENV_PLACEMENT} holds {have[0]} x {have[1]} of {have[2]} on {have[3]}; export the plan for this model, "
            "EP size and num_redundant_experts."
        )
    return rows


def launch_command(model: str, placement: str | Path, ep_size: int, attention: str, num_redundant_experts: int = 0,
                   port: int = 8000, step_interval: int = 64) -> list[str]:
    """argv (env assignment first) of `vllm serve` installing `placement` via the plugin (vLLM 0.33.0 flags).

    Attention-DP: --data-parallel-size D with TP 1; Attention-TP: --tensor-parallel-size D. EP size = TP x DP.
    Prefix caching is off: bench_serving sends the same prompts at every rate (after warm-up requests drawn from
    them), so a prefix cache would serve later rates' prefills from cache, which neither the simulator nor a
    stream of new prompts gets.
    """
    parallel = ["--data-parallel-size", str(ep_size), "--tensor-parallel-size", "1"] if attention == "dp" else \
        ["--tensor-parallel-size", str(ep_size)]
    eplb = {"policy": POLICY_NAME, "num_redundant_experts": num_redundant_experts, "step_interval": step_interval,
            "use_async": False}
    return [
        f"{ENV_PLACEMENT}={Path(placement).resolve()}", "vllm", "serve", model, "--port", str(port), *parallel,
        "--enable-expert-parallel", "--enable-eplb", "--eplb-config", json.dumps(eplb),
        "--enable-return-routed-experts", "--no-enable-prefix-caching",
    ]


_REGISTERED: dict = {}


def register() -> None:
    """The `vllm.general_plugins` entry point: install policy "semmoe" when $SEMMOE_VLLM_PLACEMENT is set.

    Raises ConfigError (vLLM start-up stops with its sentence) on another vLLM release or a bad placement file.
    """
    path = os.environ.get(ENV_PLACEMENT)
    if not path or _REGISTERED.get("path") == path:
        return
    import vllm

    version = getattr(vllm, "__version__", "?")
    if version != SUPPORTED_VLLM and os.environ.get(ENV_ANY_VERSION) != "1":
        raise ConfigError(
            f"the Sem-MoE placement plugin supports vLLM {SUPPORTED_VLLM}, found {version}; pip install "
            f"vllm=={SUPPORTED_VLLM} (or set {ENV_ANY_VERSION}=1 to try anyway)."
        )
    document = read_placement(path)
    import torch
    from vllm.distributed.eplb.policy import EPLB_POLICIES
    from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy

    class SemMoEEplbPolicy(AbstractEplbPolicy):
        """Returns the exported Sem-MoE map whatever the measured load."""

        @classmethod
        def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                              old_global_expert_indices=None):
            rows = policy_map(document, tuple(weight.shape), int(num_replicas), int(num_ranks))
            return torch.as_tensor(rows, dtype=torch.int64, device=weight.device)

    EPLB_POLICIES[POLICY_NAME] = SemMoEEplbPolicy
    _allow_policy_name(POLICY_NAME)
    _REGISTERED["path"] = path


def _allow_policy_name(name: str) -> None:
    """Add `name` to EPLBConfig.policy's Literal and rebuild the pydantic validators that embed it."""
    from typing import Literal, get_args

    import pydantic.dataclasses
    import vllm.config.parallel as parallel_config

    options = tuple(get_args(parallel_config.EPLBPolicyOption))
    if name in options:
        return
    widened = Literal[options + (name,)]
    parallel_config.EPLBPolicyOption = widened
    eplb_config = parallel_config.EPLBConfig
    eplb_config.__annotations__["policy"] = widened
    eplb_config.__pydantic_fields__["policy"].annotation = widened
    # ParallelConfig embeds EPLBConfig's schema as it was when ParallelConfig was built: rebuild it too
    for cls in (eplb_config, getattr(parallel_config, "ParallelConfig", None)):
        if cls is not None and hasattr(cls, "__pydantic_fields__"):
            pydantic.dataclasses.rebuild_dataclass(cls, force=True)


# ---- CLI -----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from repro.engines.sglang import _layout_args, _serving_args

    p = cli.ArgumentParser(prog="python -m repro.engines.vllm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("export", "launch"):
        cmd = sub.add_parser(name)
        cmd.add_argument("plan", type=cli.existing_path, help="a job directory under runs/ or its plan/ folder")
        cli.add_output(cmd, "--out", help="placement JSON to write")
        _layout_args(cmd)
        if name == "launch":
            cmd.add_argument("--model", required=True, help="model for `vllm serve` (HF id or local folder)")
            cmd.add_argument("--port", type=cli.port, default=8000)
            cmd.add_argument("--attention", choices=["dp", "tp"], help="default: the job's parallel.attention")
            cmd.add_argument("--step-interval", type=cli.positive, default=64, help="EPLB step_interval")
            _serving_args(cmd)
    return p


def main(argv: list[str] | None = None) -> int:
    from repro.engines.sglang import load_for_serving, load_saved

    args = build_parser().parse_args(argv)
    try:
        saved = load_for_serving(args, args.model) if args.command == "launch" else load_saved(args)
        document = export_placement(saved, args.out, overwrite=args.overwrite)
    except ReproError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = document["physical_to_logical_map"]
    print(f"wrote {args.out}: {len(rows)} MoE layers x {len(rows[0])} slots, EP {document['ep_size']}")
    if args.command == "launch":
        placement = saved.placement
        argv_ = launch_command(args.model, args.out, placement.num_devices, args.attention or saved.plan.parallel.attention,
                               placement.num_slots - placement.num_experts, args.port, args.step_interval)
        print(shlex.join(argv_))
    return 0


if __name__ == "__main__":
    sys.exit(main())
