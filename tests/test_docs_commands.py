"""Every command in README.md and docs/*.md stays true: the fenced ```bash blocks are extracted and each line is
either run (the cheap ones: --help, Hydra's --cfg, `make -n`), config-checked (every job of a `repro.run` /
`repro.tune` command composed and passed through check_config, as the app does before running), flag-checked
(the module's --help lists every --flag the command uses) or marked as too slow or needing what CI lacks, with
the reason. A new command in the docs fails test_every_documented_command_is_classified until it gets a row
here, and a row whose command left the docs fails too, so the table and the docs move together. Every
`python -m <module>` named anywhere in the prose must name an importable module, and every --flag of an inline
`python -m ...` span must still be defined by that module.
"""

import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from repro.config_schema import check_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# command (as written, comment stripped) -> how it is checked: "run", "config", "flags", "make -n", or "skip: why"
COMMANDS = {
    "make setup && make reproduce": "make -n",
    "make test": "make -n",
    "python -m repro.run experiment=smoke logger=none": "config",
    "python -m repro.run -m system=ep,semmoe parallel.devices=2,4 parallel.attention=dp,tp logger=none": "config",
    "python -m repro.run --help": "run",
    "python -m repro.run -m system=ep parallel.devices=2,4,8 parallel.attention=dp,tp": "config",
    "python -m repro.run trace=path/to/trace_dir system=ep": "config",
    "python -m repro.run system=semmoe evaluate_split=validate": "config",
    "python -m repro.tune -m": "config",
    "python -m repro.tune --config-name tune_serving experiment=serve_dp_arena": "config",
    "python -m repro.traces.import routing.parquet --out traces/mine": "flags",
    "python -m repro.run -m hydra/launcher=submitit_slurm ...": "skip: needs the submitit plugin and a SLURM cluster",
    "python -m repro.affinity.count_job -m trace=traces/day 'shard=range(0,24)' out_dir=parts "
    "hydra/launcher=submitit_slurm": "skip: needs a sharded trace, the submitit plugin and a SLURM cluster",
    "python -m repro.affinity.partial merge --trace traces/day --out tables.npz parts/*.npz": "flags",
    "python -m repro.run --cfg job parallel.devices=4 logger=none": "run",
    "python -m repro.run -m experiment=drift logger=none": "config",
    "python -m repro.run -m experiment=drift seed=100 workload=drift_abrupt,drift_stationary,drift_periodic "
    "name=drift_validate": "config",
    "python -m repro.run -m experiment=drift workload=drift_abrupt,drift_stationary seed=0 "
    "drift.serving.window_costs=false name=drift_short": "config",
    "python -m repro.drift.report runs/drift": "flags",
    "python -m repro.run -m experiment=drift drift=gradual workload=drift_periodic seed=0,1,2 "
    "name=drift_gradual": "config",
    "python -m repro.run -m experiment=drift workload=drift_abrupt seed=0 model.domain_strength=1.5 "
    "name=drift_sensitivity": "config",
    "python -m repro.run -m experiment=drift workload=drift_abrupt seed=0 drift.window_steps=null "
    "name=drift_sensitivity": "config",
    "python -m repro.traces.import routing.csv --out traces/served --arrival-col arrival_time": "flags",
    "python -m repro.sim.validation": "flags",
    "python -m bench --only migration": "flags",
    "python -m repro.engines.replacement runs/<job_a> runs/<job_b> --out replacements/ --model-config config.json":
        "flags",
}


def fenced_commands(text: str) -> list[str]:
    """The command lines of every ```bash block (trailing `  # comment` removed, blank lines dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            command = re.sub(r"\s+#\s.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def documented() -> dict[str, str]:
    """{command: the doc it is in}."""
    return {c: d.name for d in DOCS for c in fenced_commands(d.read_text(encoding="utf-8"))}


def test_every_documented_command_is_classified():
    found = documented()
    assert sorted(set(found) - set(COMMANDS)) == [], "add these commands to COMMANDS with how to check them"
    assert sorted(set(COMMANDS) - set(found)) == [], "these COMMANDS rows left the docs: remove them"


def test_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    for page in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{page.name}" in readme, f"README does not link docs/{page.name}"


def test_every_relative_link_resolves():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            assert (doc.parent / target).exists(), f"{doc.name} links {target}, which does not exist"


def test_every_python_module_named_in_the_docs_exists():
    text = "\n".join(d.read_text(encoding="utf-8") for d in DOCS)
    modules = sorted(set(re.findall(r"python -m ([A-Za-z_][\w.]*)", text)))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    assert missing == [], f"the docs name modules that do not exist: {missing}"


def command_rows(kind: str) -> list[str]:
    return [c for c, how in COMMANDS.items() if how == kind]


def run(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", command_rows("run"))
def test_cheap_command_runs(command):
    res = run([sys.executable, *command.split()[1:]])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("command", command_rows("make -n"))
def test_make_targets_exist(command):
    for target in re.findall(r"make (\S+)", command):
        res = run(["make", "-n", target])
        assert res.returncode == 0, f"make -n {target}: {res.stderr[-500:]}"


def sweep(overrides: list[str], multirun: bool, sweeper_params: dict) -> list[list[str]]:
    """Every job's override list, as Hydra's basic sweeper expands comma lists (and the config's sweep params)."""
    if not multirun:
        return [overrides]
    axes = [[o] for o in overrides if "," not in o]
    for o in overrides:
        if "," in o:
            key, values = o.split("=", 1)
            axes.append([f"{key}={v}" for v in values.split(",")])
    for key, values in sweeper_params.items():
        if not any(o.split("=", 1)[0] == key for o in overrides):
            axes.append([f"{key}={v}" for v in str(values).split(",")])
    return [list(job) for job in itertools.product(*axes)]


@pytest.mark.parametrize("command", command_rows("config"))
def test_documented_config_is_valid(command):
    words = command.split()
    config_name, rest = {"repro.run": "config", "repro.tune": "tune"}[words[2]], words[3:]
    if "--config-name" in rest:  # another primary config of the same app (conf/tune_serving.yaml)
        at = rest.index("--config-name")
        config_name, rest = rest[at + 1], rest[:at] + rest[at + 2 :]
    multirun = "-m" in rest
    overrides = [w for w in rest if w != "-m" and w != "logger=none"] + ["logger=none"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        first = [o.split(",")[0] for o in overrides]  # the base config a multirun starts from
        base = compose(config_name, overrides=first, return_hydra_config=True)
        params = base.hydra.sweeper.params
        params = OmegaConf.to_container(params, resolve=False) if params else {}
        jobs = sweep(overrides, multirun, params)
        for job in jobs:
            check_config(OmegaConf.to_container(compose(config_name, overrides=job), resolve=True))
    assert jobs


@pytest.mark.parametrize("command", command_rows("flags"))
def test_documented_flags_exist(command):
    words = command.split()
    module, rest = words[2], words[3:]
    subcommand = [rest[0]] if rest and re.fullmatch(r"[a-z]+", rest[0]) and not Path(ROOT / rest[0]).exists() else []
    res = run([sys.executable, "-m", module, *subcommand, "--help"])
    assert res.returncode == 0, res.stderr[-2000:]
    for flag in re.findall(r"(?<!\S)(--[\w-]+)", command):
        assert flag in res.stdout, f"{module} {' '.join(subcommand)} --help does not list {flag}"


HYDRA_FLAGS = {"--cfg", "--help", "--multirun", "--info", "--resolve", "--package"}


def test_every_flag_of_an_inline_command_is_in_its_module():
    """The `python -m MODULE ... --flag` spans of the prose (not run: they need inputs): every --flag is still
    defined by the module (its source, or its package's for a package run with -m)."""
    text = "\n".join(d.read_text(encoding="utf-8") for d in DOCS)
    stale = []
    for span in re.findall(r"`(python -m [^`]+)`", text):
        spec = importlib.util.find_spec(span.split()[2])
        assert spec is not None, f"no module {span.split()[2]} (in `{span}`)"
        origin = Path(spec.origin)
        files = list(origin.parent.rglob("*.py")) if origin.name in ("__init__.py", "__main__.py") else [origin]
        source = "\n".join(f.read_text(encoding="utf-8") for f in files)
        flags = [f for f in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", span) if f not in HYDRA_FLAGS]
        stale += [f"{f} in `{span}`" for f in flags if f not in source]
    assert stale == []
