"""The served model's layer structure, and saved plans read back for serving.

An engine indexes routing by *model* layer (SGLang's `--init-expert-location` has one row per hidden layer,
dense ones included; both engines return routed experts as [tokens, num_hidden_layers, top_k]), while a plan
has one row per MoE layer it was fitted on. `ModelLayout` says which model layers are MoE layers; a
`SavedPlan` says which model layer each plan row is.

Where a layout comes from, most direct first: the model's own HF `config.json` (what the engines read), a
simulator shape (conf/sim/shape/<name>.yaml), or a finished job's config.yaml (its `sim.shape`, or a synthetic
routing model's layer range).

Serving a plan on a real model (`served_model_layout`, `plan_routing`, `check_serving`): the model's layout comes
from its config.json (--model-config, the local model folder, or the Hugging Face cache) or a known hub id's
simulator shape, never from the job, and the plan must match it in experts, top-k and MoE layers. A plan fitted
on synthetic routing (model.kind synthetic / tiny / replay, or a trace whose meta `source` says so) or on token
ids of another tokenizer than the model's is refused unless the caller explicitly allows it.

Legend: L plan rows (MoE layers the plan covers), E logical experts, P physical slots per layer, D EP ranks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from repro.errors import ConfigError, ReproError
from repro.parallel import ParallelConfig
from repro.systems.base import Placement, Plan

CONF_SHAPES = Path(__file__).resolve().parents[2] / "conf" / "sim" / "shape"
# hub ids (lower case) whose shape the suite knows (conf/sim/shape), for when no config.json is at hand
KNOWN_MODELS = {
    "deepseek-ai/deepseek-v2-lite": "deepseek_v2_lite", "deepseek-ai/deepseek-v2-lite-chat": "deepseek_v2_lite",
    "deepseek-ai/deepseek-v3": "deepseek_v3", "deepseek-ai/deepseek-v3-base": "deepseek_v3",
    "deepseek-ai/deepseek-v3-0324": "deepseek_v3",
    "mistralai/mixtral-8x7b-v0.1": "mixtral_8x7b", "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral_8x7b",
    "allenai/olmoe-1b-7b-0924": "olmoe_1b_7b", "allenai/olmoe-1b-7b-0924-instruct": "olmoe_1b_7b",
    "qwen/qwen3-30b-a3b": "qwen3_30b_a3b", "qwen/qwen3-30b-a3b-base": "qwen3_30b_a3b",
    "moonshotai/moonlight-16b-a3b": "moonlight_16b_a3b", "moonshotai/moonlight-16b-a3b-instruct": "moonlight_16b_a3b",
}
# routing that no real model produced: a plan fitted on it says nothing about serving a real model
SYNTHETIC_SOURCES = ("synthetic", "tiny_model", "replay", "random_init")
# the suite's named tokenizers (repro.workloads.tokenizers) and words in the names of the models that use them
TOKENIZER_FAMILIES = {"mixtral": ("mixtral", "mistral"), "qwen": ("qwen",), "olmoe": ("olmoe", "olmo")}


@dataclass(frozen=True)
class ModelLayout:
    """num_hidden_layers model layers; moe_layer_ids the ones with a router (ascending); num_experts routed
    experts per MoE layer; top_k experts per token (None when unknown)."""

    name: str
    num_hidden_layers: int
    moe_layer_ids: tuple[int, ...]
    num_experts: int
    top_k: int | None = None

    def __post_init__(self) -> None:
        ids = np.asarray(self.moe_layer_ids, dtype=np.int64)
        if self.num_hidden_layers < 1 or self.num_experts < 1 or len(ids) == 0:
            raise ConfigError(
                f"model {self.name!r} needs num_hidden_layers >= 1, num_experts >= 1 and at least one MoE layer, "
                f"got {self.num_hidden_layers}, {self.num_experts} and {len(ids)}."
            )
        if ids.min() < 0 or ids.max() >= self.num_hidden_layers or np.any(np.diff(ids) <= 0):
            raise ConfigError(
                f"model {self.name!r}: MoE layer ids must be ascending and inside 0..{self.num_hidden_layers - 1}, "
                f"got {list(self.moe_layer_ids)}."
            )

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(set(range(self.num_hidden_layers)) - set(self.moe_layer_ids)))

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelLayout:
        """Read a Hugging Face `config.json` (DeepSeek-V2/V3, Qwen2/3-MoE, Mixtral, OLMoE families)."""
        path = Path(path)
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the model config {path} ({e}); pass the model's config.json.") from e
        if not isinstance(config, dict):
            raise ConfigError(f"{path} is not a JSON object; pass the model's config.json.")
        if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
            config = config["text_config"]  # multimodal wrappers keep the language model's sizes here
        num_layers = config.get("num_hidden_layers")
        experts = next((config[k] for k in ("n_routed_experts", "num_local_experts", "num_experts") if config.get(k)), None)
        if not isinstance(num_layers, int) or not isinstance(experts, int):
            raise ConfigError(
                f"{path} has no integer num_hidden_layers and n_routed_experts / num_local_experts / num_experts; "
                "it is not the config of a supported MoE model."
            )
        layers = np.arange(num_layers)
        if "n_routed_experts" in config:  # DeepSeek: dense first_k_dense_replace layers, then every moe_layer_freq-th
            moe = (layers >= int(config.get("first_k_dense_replace", 0))) & (layers % int(config.get("moe_layer_freq", 1)) == 0)
        elif "decoder_sparse_step" in config or "mlp_only_layers" in config:  # Qwen2-MoE / Qwen3-MoE
            step = int(config.get("decoder_sparse_step", 1) or 1)
            moe = ((layers + 1) % step == 0) & ~np.isin(layers, list(config.get("mlp_only_layers") or []))
        else:  # Mixtral, OLMoE: every layer routes
            moe = np.ones(num_layers, dtype=bool)
        top_k = config.get("num_experts_per_tok")
        return cls(
            str(config.get("_name_or_path") or config.get("model_type") or path.parent.name),
            num_layers, tuple(int(x) for x in layers[moe]), experts, int(top_k) if isinstance(top_k, int) else None,
        )

    @classmethod
    def from_shape(cls, shape: dict | str) -> ModelLayout:
        """A simulator shape (a dict, or the name of conf/sim/shape/<name>.yaml): dense layers first."""
        if isinstance(shape, str):
            path = CONF_SHAPES / f"{shape}.yaml"
            if not path.is_file():
                known = sorted(p.stem for p in CONF_SHAPES.glob("*.yaml"))
                raise ConfigError(f"unknown model shape {shape!r}; choose one of {known} or pass --model-config.")
            shape = yaml.safe_load(path.read_text())
        try:
            first, total = int(shape["first_dense_layers"]), int(shape["num_hidden_layers"])
            return cls(str(shape.get("name", "")), total, tuple(range(first, total)), int(shape["num_experts"]),
                       int(shape["top_k"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"model shape {shape.get('name', '?')!r} misses or garbles {e}; see conf/sim/shape/.") from e


def layout_from_job(config: dict) -> ModelLayout | None:
    """The layout a finished job's config implies: its sim shape, else a synthetic routing model's layers."""
    if (config.get("sim") or {}).get("shape"):
        return ModelLayout.from_shape(config["sim"]["shape"])
    model = config.get("model") or {}
    if model.get("kind") == "synthetic":
        first, count = int(model.get("first_layer", 0)), int(model["num_layers"])
        return ModelLayout(str(model.get("name", "synthetic")), first + count, tuple(range(first, first + count)),
                           int(model["num_experts"]), int(model["top_k"]))
    return None


def parse_layer_ids(text: str) -> tuple[int, ...]:
    """'1-26' or '0,7,15' or '1-3,9' -> ascending model layer ids."""
    ids: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            ids.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError as e:
        raise ConfigError(f"layer ids {text!r} are not a list like '0,7,15' or a range like '1-26'.") from e
    return tuple(ids)


@dataclass
class SavedPlan:
    """A plan read back from disk: the plan, the model layer of each plan row, the served model's layout."""

    plan: Plan
    layer_ids: tuple[int, ...]
    layout: ModelLayout
    source: Path
    job_config: dict | None = None

    @property
    def placement(self) -> Placement:
        return self.plan.placement


def _find_plan_dir(path: Path) -> tuple[Path, dict | None]:
    """(plan directory, job config or None) of a job directory or a plan directory."""
    if (path / "plan" / "physical_to_logical.npy").is_file():
        plan_dir = path / "plan"
    elif (path / "physical_to_logical.npy").is_file():
        plan_dir = path
    else:
        raise ConfigError(
            f"{path} holds no saved plan (plan/physical_to_logical.npy or physical_to_logical.npy); pass a job "
            "directory under runs/ or its plan/ folder."
        )
    config_file = plan_dir.parent / "config.yaml"
    config = None
    if config_file.is_file():
        try:
            config = yaml.safe_load(config_file.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{config_file} is not valid YAML ({e}); re-run the job or pass the plan/ folder.") from e
    return plan_dir, config if isinstance(config, dict) else None


def read_plan(path: str | Path, ep_size: int | None = None) -> tuple[Plan, dict | None, Path]:
    """(plan, job config or None, plan directory) saved under `path` (a job directory or its plan/ folder).

    ep_size: EP degree, needed when no job config.yaml sits beside the plan (else it must agree with it). A
    Sem-MoE plan comes back as a SemMoEPlan with its online tables, a signature plan as a SignaturePlan (decode rule).
    """
    from repro.systems.semmoe.system import SemMoEPlan
    from repro.systems.signature import SignaturePlan

    plan_dir, config = _find_plan_dir(Path(path))
    try:
        p2l = np.load(plan_dir / "physical_to_logical.npy", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{plan_dir / 'physical_to_logical.npy'} is unreadable ({e}); re-run the job.") from e
    if p2l.ndim != 2 or not np.issubdtype(p2l.dtype, np.integer) or p2l.size == 0 or p2l.min() < 0:
        raise ConfigError(f"{plan_dir / 'physical_to_logical.npy'} is not a non-negative int[layers, slots] array.")
    num_experts = int(p2l.max()) + 1  # every expert holds a slot in every layer, so the largest id is E - 1
    if config and isinstance(config.get("parallel"), dict):
        parallel = ParallelConfig.from_config(config["parallel"])
        if ep_size is not None and ep_size != parallel.devices:
            raise ConfigError(f"--ep-size {ep_size} disagrees with the job's parallel.devices={parallel.devices}.")
    elif ep_size is None:
        raise ConfigError(f"{plan_dir} has no job config.yaml beside it; pass the EP degree with --ep-size.")
    else:
        parallel = ParallelConfig(devices=int(ep_size), tokens_per_step=max(4096, int(ep_size)))
    model_experts = ((config or {}).get("model") or {}).get("num_experts")
    if model_experts is not None and int(model_experts) != num_experts:
        raise ConfigError(f"{plan_dir} places {num_experts} experts but its job's model has {model_experts}.")
    if (plan_dir / "semmoe.json").is_file():
        return SemMoEPlan.load(plan_dir, parallel, num_experts), config, plan_dir
    if (plan_dir / "signature.json").is_file():
        return SignaturePlan.load(plan_dir, parallel, num_experts), config, plan_dir
    info = json.loads((plan_dir / "plan_info.json").read_text()) if (plan_dir / "plan_info.json").is_file() else {}
    return Plan(Placement.load(plan_dir, parallel.devices, num_experts), parallel, info), config, plan_dir


def load_plan(
    path: str | Path,
    *,
    ep_size: int | None = None,
    layout: ModelLayout | None = None,
    layer_ids: tuple[int, ...] | None = None,
) -> SavedPlan:
    """`read_plan`, then the model it is served on, checked against the plan.

    layout: the served model (default: the job config's, see `layout_from_job`). layer_ids: model layer of each
    plan row (default: the job's synthetic layers, else the layout's MoE layers when their count matches).
    """
    plan, config, plan_dir = read_plan(path, ep_size)
    p2l = plan.placement.physical_to_logical
    num_experts = plan.placement.num_experts
    layout = layout or (layout_from_job(config) if config else None)
    if layout is None:
        raise ConfigError(
            f"cannot tell which model {plan_dir} is served on; pass --model-config <config.json> or --shape <name>."
        )
    if layout.num_experts != num_experts:
        raise ConfigError(
            f"the plan places {num_experts} experts per layer but model {layout.name!r} has {layout.num_experts}; "
            "the plan was fitted for another model."
        )
    if layer_ids is None:
        job_layout = layout_from_job(config) if config else None
        traced = plan_routing(config).layer_ids if config and config.get("trace") else None
        if job_layout is not None and len(job_layout.moe_layer_ids) == p2l.shape[0]:
            layer_ids = job_layout.moe_layer_ids
        elif traced is not None and len(traced) == p2l.shape[0]:  # a trace names the model layer of each row
            layer_ids = traced
        elif len(layout.moe_layer_ids) == p2l.shape[0]:
            layer_ids = layout.moe_layer_ids
        else:
            raise ConfigError(
                f"the plan has {p2l.shape[0]} layers and model {layout.name!r} {len(layout.moe_layer_ids)} MoE layers; "
                "say which model layer each plan row is with --layer-ids (e.g. 0,7,15)."
            )
    if len(layer_ids) != p2l.shape[0]:
        raise ConfigError(f"--layer-ids names {len(layer_ids)} layers but the plan has {p2l.shape[0]}.")
    dense = sorted(set(layer_ids) - set(layout.moe_layer_ids))
    if dense:
        raise ConfigError(
            f"plan rows map to model layer(s) {dense}, which are not MoE layers of {layout.name!r} "
            f"(MoE layers: {_span(layout.moe_layer_ids)}); the plan was fitted for another model."
        )
    return SavedPlan(plan, tuple(int(x) for x in layer_ids), layout, plan_dir, config)


def _span(ids) -> str:
    ids = list(ids)
    return f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))


# ---- serving a plan on a real model --------------------------------------------------------------------------


def _hf_cache_config(repo_id: str) -> Path | None:
    """config.json of hub model `repo_id` in the local Hugging Face cache (the snapshot refs/main names), or None."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    folder = Path(hub) / ("models--" + repo_id.replace("/", "--"))
    ref = folder / "refs" / "main"
    if ref.is_file():
        config = folder / "snapshots" / ref.read_text().strip() / "config.json"
        if config.is_file():
            return config
    found = sorted(folder.glob("snapshots/*/config.json"))
    return found[0] if found else None


def served_model_layout(model_path: str, model_config: str | Path | None = None, shape: str | None = None) -> ModelLayout:
    """The layout of the model an engine serves from `model_path` (HF id or local folder).

    Most direct first: --model-config (its config.json), --shape (a simulator shape), <model_path>/config.json,
    the Hugging Face cache's config.json of a hub id, the shape of a hub id in KNOWN_MODELS. None of them: a
    ConfigError, since a plan cannot be checked against a model whose shape is unknown.
    """
    if model_config and shape:
        raise ConfigError("pass --model-config or --shape, not both.")
    if model_config:
        return ModelLayout.from_hf_config(model_config)
    if shape:
        return ModelLayout.from_shape(shape)
    local = Path(model_path) / "config.json"
    if local.is_file():
        return ModelLayout.from_hf_config(local)
    cached = _hf_cache_config(model_path) if model_path.count("/") == 1 and not Path(model_path).exists() else None
    if cached is not None:
        return ModelLayout.from_hf_config(cached)
    if model_path.lower().rstrip("/") in KNOWN_MODELS:
        return ModelLayout.from_shape(KNOWN_MODELS[model_path.lower().rstrip("/")])
    raise ConfigError(
        f"cannot tell the shape of model {model_path!r} (no config.json in that folder or the Hugging Face cache, "
        f"and not a known hub id); pass --model-config <its config.json> or --shape <name in conf/sim/shape>."
    )


@dataclass(frozen=True)
class PlanRouting:
    """What a plan was fitted on: the routing's source (trace meta `source` spelling; None: unknown), the
    tokenizer of its token ids, the model, top-k and model layer ids (None when unknown), and where this was read."""

    source: str | None
    tokenizer: str | None
    model: str | None
    top_k: int | None
    layer_ids: tuple[int, ...] | None
    where: str

    @property
    def synthetic(self) -> bool:
        return self.source in SYNTHETIC_SOURCES


MODEL_KIND_SOURCES = {"tiny": "tiny_model", "synthetic": "synthetic", "replay": "replay", "hf": "hf_capture"}


def plan_routing(config: dict | None) -> PlanRouting:
    """The routing a finished job's plan was fitted on, from its config.yaml: the profile trace's meta.json for a
    trace= job (profile_trace, else trace), else the routing model (model.kind; an hf model built from_config has
    random weights)."""
    if not config:
        return PlanRouting(None, None, None, None, None, "no job config.yaml beside the plan")
    if config.get("trace"):
        from repro.traces import TraceMeta

        path = Path(config.get("profile_trace") or config["trace"]) / "meta.json"
        try:
            meta = TraceMeta.from_json(json.loads(path.read_text()), where=str(path))
        except (OSError, ValueError, ReproError) as e:
            return PlanRouting(None, None, None, None, None, f"the job's trace {path} is unreadable ({e})")
        return PlanRouting(meta.source or None, meta.tokenizer or None, meta.model, meta.top_k, meta.layer_ids,
                           f"trace {path.parent}")
    model = config.get("model") or {}
    kind = model.get("kind")
    source = MODEL_KIND_SOURCES.get(kind, kind)
    if kind == "hf" and model.get("from_config"):
        source = "random_init"
    top_k = model.get("top_k")
    return PlanRouting(source, model.get("tokenizer") or None, model.get("checkpoint") or model.get("name"),
                       int(top_k) if isinstance(top_k, int) else None, None, f"job model.kind={kind}")


def tokenizer_matches(tokenizer: str, model_path: str, model_name: str = "") -> bool:
    """Whether token ids of `tokenizer` ("hf:<repo or folder>" or a suite name such as "mixtral") are the ids the
    model served from `model_path` (config name `model_name`) reads: same repo or folder name, or a named
    tokenizer of the model's family."""
    names = {Path(x.rstrip("/")).name.casefold() for x in (model_path, model_name) if x}
    if tokenizer.startswith("hf:"):
        path = tokenizer[3:].rstrip("/")
        if Path(path).exists() and Path(model_path).exists():
            return Path(path).resolve() == Path(model_path).resolve()
        return Path(path).name.casefold() in names
    words = TOKENIZER_FAMILIES.get(tokenizer, (tokenizer,))
    return any(word in name for word in words for name in names)


def check_serving(saved: SavedPlan, model_path: str, *, explicit_layer_ids: bool = False, allow_synthetic: bool = False,
                  allow_other_tokenizer: bool = False) -> list[str]:
    """Warnings for serving `saved` on the real model at `model_path`, or a ConfigError (one sentence) when it
    must not be: its top-k or whole-model layout differs from the served model's (`saved.layout`, which
    load_plan already matched in experts and plan-row layers), it was fitted on synthetic routing (unless
    allow_synthetic) or on token ids of another tokenizer (unless allow_other_tokenizer). The allowed cases and
    the unknowable ones come back as warnings, for the caller to print loudly."""
    layout, routing, where = saved.layout, plan_routing(saved.job_config), saved.source
    if routing.top_k is not None and layout.top_k is not None and routing.top_k != layout.top_k:
        raise ConfigError(
            f"the plan in {where} was fitted on top-{routing.top_k} routing ({routing.where}) but {model_path} routes "
            f"each token to {layout.top_k} experts; fit the plan on this model's routing."
        )
    job_layout = layout_from_job(saved.job_config) if saved.job_config else None
    if job_layout is not None and not explicit_layer_ids and (
            job_layout.num_hidden_layers, job_layout.moe_layer_ids) != (layout.num_hidden_layers, layout.moe_layer_ids):
        raise ConfigError(
            f"the plan in {where} was fitted for a model of {job_layout.num_hidden_layers} layers with MoE layers "
            f"{_span(job_layout.moe_layer_ids)} but {model_path} has {layout.num_hidden_layers} with MoE layers "
            f"{_span(layout.moe_layer_ids)}; fit the plan for this model (or map its rows with --layer-ids)."
        )
    warnings = []
    if routing.source is None:
        warnings.append(f"cannot tell what routing the plan in {where} was fitted on ({routing.where}); make sure it "
                        f"is routing of {model_path} itself before trusting any measurement.")
    elif routing.synthetic:
        message = (f"the plan in {where} was fitted on {routing.source} routing ({routing.where}), not on routing of "
                   f"{model_path}, so serving it measures an arbitrary placement")
        if not allow_synthetic:
            raise ConfigError(message + "; capture real routing (python -m repro.engines.capture) and fit on it with "
                              "repro.run trace=<it>, or pass --allow-synthetic-plan.")
        warnings.append(message + " (served anyway: --allow-synthetic-plan).")
    if not routing.tokenizer:
        warnings.append(f"cannot tell which tokenizer the plan in {where} was fitted with ({routing.where}); its token "
                        f"tables are meaningful only with {model_path}'s own.")
    elif not tokenizer_matches(routing.tokenizer, model_path, layout.name):
        message = (f"the plan in {where} was fitted on token ids of tokenizer {routing.tokenizer!r} but {model_path} "
                   "reads its own tokenizer's ids, so the plan's token tables score other tokens")
        if not allow_other_tokenizer:
            raise ConfigError(message + f"; fit it on a workload tokenized with tokenizer=hf:{model_path}, or pass "
                              "--allow-tokenizer-mismatch.")
        warnings.append(message + " (served anyway: --allow-tokenizer-mismatch).")
    return warnings
