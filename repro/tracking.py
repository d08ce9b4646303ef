"""W&B tracking of a job, as the field uses it: one run per job, from its start to its end.

`JobRun(config, out_dir)` is the run of one job (repro.run, repro.exec): it starts when the job starts (before
routing and training), carries tags (experiment, system, attention mode, EP degree, routing model and source), a
job_type ("evaluate", "serve-sim", "exec"; "tune" / "report" for those tools) and a group (the experiment name, so
a sweep is one group), is named after the job folder, and writes its offline files under the job folder
(<out_dir>/wandb/offline-run-*, which `make wandb-sync` uploads). `on_progress` (a plain callable, no W&B import
where it is called) logs the tiny model's loss curve and the capture's throughput; `log_results` logs the summary,
the per-layer and simulator tables and the plan (an artifact of type "plan"); leaving the `with` block finishes
the run, with exit code 1 when the job raised.

What is the record and what a W&B failure does:
- metrics.json and the job's result files are the record; W&B mirrors them and is never read back.
- A W&B failure fails the job with one ReproError sentence, and it comes before anything is published (results
  are logged from the staging folder, before repro.run publishes it): a run finished with exit code 0 means the
  job's results are in its folder, and a job that failed has its run marked failed. Only closing the run after
  publishing may fail without failing the job (its results are complete then): that is a warning.
- logger=none, logger.mode=disabled or WANDB_MODE=disabled: nothing starts and wandb is never imported.
- A job whose folder already holds metrics.json of the same config is probably a resume that will be skipped, so
  its run starts only once the job turns out to need work (its first progress event, or `start()` after the
  traces are built): reruns of a sweep do not fill the project with empty runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from repro.errors import ReproError

log = logging.getLogger("repro.tracking")

# the `logger` config group's keys and values (repro.config_schema composes check_logger)
LOGGER_NAMES, LOGGER_MODES = ("none", "wandb"), ("offline", "online", "disabled")


def check_logger(logger: dict) -> None:
    """The logger group's config check: known keys (conf/logger/*.yaml), a known logger and W&B mode."""
    from repro.config_values import check_table, option_keys, text, top_keys

    check_table("logger", logger, {"name": text(LOGGER_NAMES), "project": text(), "mode": text(LOGGER_MODES)},
                top_keys(option_keys("logger")))


DEFAULT_PROJECT = "semmoe-repro"  # conf/logger/wandb.yaml's project, for tools without a Hydra config
MAX_TAG = 64  # W&B's limit on a tag's length
MAX_ARTIFACT_NAME = 128  # W&B's limit on an artifact's name
FIX_ME = "fix W&B (offline mode needs no account) or rerun with logger=none or WANDB_MODE=disabled to run without it"


def tracking_wanted(logger: dict | None) -> bool:
    """True when the logger config asks for W&B and neither it nor WANDB_MODE disables it."""
    logger = logger or {}
    return (
        logger.get("name") == "wandb"
        and logger.get("mode") != "disabled"
        and os.environ.get("WANDB_MODE") != "disabled"
    )


def job_type_of(config: dict) -> str:
    """What the job does: "exec" (runs its plan on real ranks), "serve-sim" (the serving simulator) or "evaluate"."""
    if config.get("exec"):
        return "exec"
    if config.get("sim"):
        return "serve-sim"
    return "evaluate"


def _tag(key: str, value) -> str:
    return f"{key}={value}"[:MAX_TAG]


def job_tags(config: dict) -> list[str]:
    """Tags a job's config fixes before any routing: experiment, system, attention mode, EP degree, routing model."""
    parallel = config.get("parallel") or {}
    tags = [
        _tag("experiment", config.get("name")),
        _tag("system", (config.get("system") or {}).get("name")),
        _tag("attention", parallel.get("attention")),
        _tag("ep", parallel.get("devices")),
        _tag("split", config.get("evaluate_split", "evaluate")),
    ]
    if config.get("trace"):  # an imported trace: its model and source are known once it is read (add_routing)
        tags.append(_tag("routing", "trace"))
    else:
        model = config.get("model") or {}
        tags += [_tag("model", model.get("name")), _tag("routing", model.get("kind"))]
    return tags


def artifact_name(*parts: str) -> str:
    """A W&B artifact name from parts (only letters, digits, "-", "_" and "."; at most 128 characters, the tail
    replaced by a digest of the whole when longer, so two long job folders never share a name)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts))
    if len(name) > MAX_ARTIFACT_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        name = f"{name[:MAX_ARTIFACT_NAME - 13]}-{digest}"
    return name


def _finished_config(out_dir: Path, config: dict) -> bool:
    """True when out_dir/metrics.json holds this config (the job is probably skipped as finished; repro.run decides
    once it has the traces' digests)."""
    try:
        return json.loads((out_dir / "metrics.json").read_text()).get("config") == config
    except (OSError, ValueError, AttributeError):
        return False


def _scalars(values: dict, prefix: str = "") -> dict:
    """The numbers, strings and booleans of values (W&B summary material), keys prefixed."""
    return {f"{prefix}{k}": v for k, v in values.items() if isinstance(v, int | float | str | bool)}


class JobRun:
    """One job's W&B run, or nothing when tracking is off (then every method does nothing and imports nothing).

    Use as `with JobRun(config, out_dir) as tracking:`; the run starts on entering (unless a resume is likely, see
    the module docstring) and is finished on leaving, exit code 1 when the block raised.
    """

    def __init__(self, config: dict, out_dir: Path, job_type: str | None = None, enabled: bool = True):
        """enabled=False: no run whatever the config says (e.g. torchrun ranks other than 0)."""
        self.config = config
        self.out_dir = Path(out_dir)
        self.job_type = job_type or job_type_of(config)
        self.wanted = enabled and tracking_wanted(config.get("logger"))
        self.run = None
        self._wandb = None

    # ---- lifetime -----------------------------------------------------------------------------------------------

    def __enter__(self) -> JobRun:
        if self.wanted and not _finished_config(self.out_dir, self.config):
            self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=0 if exc_type is None else 1)
        except Exception as e:  # noqa: BLE001  any W&B failure here; never hide the job's own exception
            if exc_type is not None:
                log.warning("W&B could not mark its run of %s failed (%s)", self.out_dir, e)
                return
            log.warning(
                "the job's results are published in %s, but W&B could not finish its run (%s: %s); its offline "
                "run folder may be incomplete", self.out_dir, type(e).__name__, e,
            )
        finally:
            self.run = None

    def start(self) -> None:
        """Start the W&B run (once; a no-op when tracking is off or it has started)."""
        if not self.wanted or self.run is not None:
            return
        logger = self.config["logger"]
        with self._errors("start a run"):
            import wandb

            self._wandb = wandb
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=logger.get("project", DEFAULT_PROJECT),
                mode=logger.get("mode", "offline"),
                job_type=self.job_type,
                group=self.config.get("name"),
                name=self.out_dir.name,
                tags=job_tags(self.config),
                dir=str(self.out_dir),
                config=self.config,
                settings=wandb.Settings(silent=True),
                reinit="finish_previous",  # a Hydra multirun runs its jobs one after another in one process
            )
            # each phase's curve is drawn against its own step (training steps, capture batches)
            for phase in ("train", "capture", "generate"):
                self.run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")

    # ---- what a job logs ------------------------------------------------------------------------------------------

    @property
    def on_progress(self) -> Callable[[dict], None] | None:
        """The callable routing producers report progress to (None when tracking is off, so they skip the work)."""
        return self._progress if self.wanted else None

    def _progress(self, event: dict) -> None:
        """Log one progress event {"phase": "train" | "capture" | "generate", "step": int, ...numbers}."""
        self.start()  # a likely resume that does need to train or capture gets its run now
        phase = event.get("phase", "progress")
        with self._errors(f"log {phase} progress"):
            self.run.log({f"{phase}/{k}": v for k, v in event.items() if k != "phase"})

    def add_routing(self, trace) -> None:
        """Tag the run with the evaluated trace's model and source and summarise how its routing was made (the tiny
        model's training stats, cache hits): known only once the traces are built."""
        if self.run is None:
            return
        meta = trace.meta
        with self._errors("tag the run with its routing"):
            known = {"model": meta.model, "routing": meta.source, "dataset": meta.dataset}
            tags = [_tag(key, value) for key, value in known.items() if value]  # an imported trace may lack some
            self.run.tags = tuple(dict.fromkeys([*self.run.tags, *tags]))
            self.run.summary.update(_scalars(meta.extra, prefix="routing/"))

    def log_results(self, summary: dict, per_layer=None, tables: dict | None = None,
                    files_dir: Path | None = None) -> None:
        """Log a job's results before they are published: summary scalars and warnings, per-layer and simulator
        tables (DataFrames), the exec_*.csv tables and the plan/ folder (an artifact of type "plan") found in
        files_dir (the staging folder)."""
        if self.run is None:
            return
        import pandas as pd

        wandb, files_dir = self._wandb, Path(files_dir or self.out_dir)
        with self._errors("log the job's results"):
            self.run.summary.update(_scalars(summary))
            if summary.get("warnings"):
                self.run.summary["warnings"] = list(summary["warnings"])
                self.run.tags = (*self.run.tags, "has-warnings")
            named = dict(tables or {})
            if per_layer is not None:
                named = {"per_layer": per_layer, **named}
            for table in ("exec_per_layer", "exec_per_rank"):  # written by repro.exec when the job executed its plan
                if (files_dir / f"{table}.csv").exists():
                    named[table] = pd.read_csv(files_dir / f"{table}.csv")
            for name, frame in named.items():
                self.run.log({name: wandb.Table(dataframe=frame)})
            if (files_dir / "plan").is_dir():
                plan = wandb.Artifact(
                    artifact_name("plan", str(self.config.get("name")), self.out_dir.name),
                    type="plan",
                    description=f"the {summary.get('system')} plan of job {self.out_dir.name}",
                    metadata=_scalars({k: summary.get(k) for k in ("system", "kind", "devices", "lar", "model",
                                                                     "dataset")}),
                )
                plan.add_dir(str(files_dir / "plan"))
                self.run.log_artifact(plan)

    # ---- errors -------------------------------------------------------------------------------------------------

    def _errors(self, what: str):
        return _wandb_errors(what, self.out_dir)


@contextmanager
def _wandb_errors(what: str, where: Path, consequence: str = "nothing was published") -> Iterator[None]:
    """Turn any exception W&B raises into one ReproError sentence (ReproErrors pass through unchanged)."""
    try:
        yield
    except ReproError:
        raise
    except Exception as e:
        raise ReproError(
            f"W&B could not {what} for {where} ({type(e).__name__}: {e}); {consequence}; {FIX_ME}."
        ) from e


def log_report_figures(figures_dir: Path | str, runs_dir: Path | str = "runs", *, project: str | None = None) -> bool:
    """Log the report in figures_dir to one W&B run of job_type "report": every PNG as an image keyed by its path
    (e.g. "smoke/lar_per_layer"), verdict.csv (when there) as the table "verdict", and the whole folder (REPORT.md,
    REPORT.html, PNGs) as an artifact of type "report". The run's files go under runs_dir/wandb, where `make wandb-sync` finds them; the mode is WANDB_MODE
    (default offline). Returns False, importing nothing, when WANDB_MODE=disabled or figures_dir has no PNG.
    """
    figures_dir, runs_dir = Path(figures_dir), Path(runs_dir)
    mode = os.environ.get("WANDB_MODE", "offline")
    pngs = sorted(figures_dir.rglob("*.png"))
    if mode == "disabled" or not pngs:
        return False
    with _wandb_errors("log the report's figures", figures_dir, "the report itself is written"):
        import pandas as pd
        import wandb

        runs_dir.mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            mode=mode,
            job_type="report",
            group="report",
            name=f"report-{figures_dir.resolve().name}",
            tags=["report"],
            dir=str(runs_dir),
            settings=wandb.Settings(silent=True),
            reinit="finish_previous",
        )
        try:
            run.log({str(p.relative_to(figures_dir).with_suffix("").as_posix()): wandb.Image(str(p)) for p in pngs})
            if (figures_dir / "verdict.csv").is_file():  # the reproduction verdict (repro.figures.verdict) as a table
                run.log({"verdict": wandb.Table(dataframe=pd.read_csv(figures_dir / "verdict.csv", keep_default_na=False))})
            report = wandb.Artifact(artifact_name("report", figures_dir.resolve().name), type="report")
            report.add_dir(str(figures_dir))
            run.log_artifact(report)
        except BaseException:
            run.finish(exit_code=1)
            raise
        run.finish()
    return True
