"""The `exec` config group's own check (conf/exec/default.yaml), beside its group and without torch, so that
repro.config_schema composes it without importing the executor: ExecConfig, the table of its fields' types and
ranges, and every rule that needs no device. What needs one (the kernel backend on this machine) is
repro.exec.trace_mode.check_exec_config's, which the job runs before any routing."""

from __future__ import annotations

from dataclasses import dataclass, fields

from repro.config_values import FLAG, check_table, integer, number, text
from repro.errors import ConfigError, check_known_keys

EXEC_MODES = ("trace", "model")
DIST_BACKENDS = ("gloo", "nccl")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
KERNEL_BACKENDS = ("auto", "triton", "torch")  # repro.kernels.BACKENDS, which imports torch (tests/test_configs.py)
MODEL_LOGIT_ATOL = 1e-4  # fp32 logits of the distributed tiny model vs the single-process transformers model
DEFAULT_ATOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-1}


@dataclass(frozen=True)
class ExecConfig:
    """The `exec` config group (conf/exec/default.yaml documents each field)."""

    mode: str = "trace"  # trace: random layers with the trace's routing replayed; model: the tiny model end to end
    world_size: int | None = None  # None: the plan's device count (any other value is an error)
    backend: str = "gloo"
    kernel_backend: str = "auto"
    hidden_size: int = 256
    intermediate_size: int = 512
    dtype: str = "float32"
    max_tokens: int = 2048
    timeout_s: float = 300.0
    atol: float | None = None  # None: DEFAULT_ATOL of the dtype
    barrier_timing: bool = False  # CommRecord.barrier: collective seconds without the wait for late ranks

    @classmethod
    def from_config(cls, config: dict) -> ExecConfig:
        check_known_keys("exec", config, [f.name for f in fields(cls)])
        return cls(**config)

    @property
    def tolerance(self) -> float:
        return DEFAULT_ATOL[self.dtype] if self.atol is None else float(self.atol)


EXEC_TABLE = {  # ExecConfig's fields: types and ranges; choices and cross-field rules are check_exec_fields'
    "mode": text(),
    "world_size": integer(1, null=True),
    "backend": text(),
    "kernel_backend": text(),
    "hidden_size": integer(1),
    "intermediate_size": integer(1),
    "dtype": text(),
    "max_tokens": integer(1),
    "timeout_s": number(0, low_open=True),
    "barrier_timing": FLAG,
    "atol": number(0, low_open=True, null=True),
}


def check_exec_table(exec_cfg: dict) -> None:
    """The job config's exec group: every key known, every value of its type and range (one ConfigError sentence)."""
    check_table("exec", exec_cfg, EXEC_TABLE, [f.name for f in fields(ExecConfig)])


def check_exec_fields(exec_cfg: ExecConfig | dict, parallel, world_size: int | None = None) -> ExecConfig:
    """The ExecConfig of `exec_cfg`, or one ConfigError sentence for a choice or combination that cannot run
    anywhere (the device-dependent rules are check_exec_config's).

    parallel: the job's ParallelConfig; world_size: the ranks that will run (None: exec.world_size, else the
    plan's devices).
    """
    if isinstance(exec_cfg, dict):
        exec_cfg = ExecConfig.from_config(exec_cfg)
    if exec_cfg.mode not in EXEC_MODES:
        raise ConfigError(f"exec.mode must be one of {EXEC_MODES}, got {exec_cfg.mode!r}.")
    if exec_cfg.backend not in DIST_BACKENDS:
        raise ConfigError(f"exec.backend must be one of {DIST_BACKENDS}, got {exec_cfg.backend!r}.")
    if exec_cfg.kernel_backend not in KERNEL_BACKENDS:
        raise ConfigError(f"exec kernel backend must be one of {KERNEL_BACKENDS}, got {exec_cfg.kernel_backend!r}.")
    if exec_cfg.dtype not in DTYPE_NAMES:
        raise ConfigError(f"exec.dtype must be one of {sorted(DTYPE_NAMES)}, got {exec_cfg.dtype!r}.")
    if exec_cfg.dtype == "bfloat16" and exec_cfg.backend != "nccl":
        raise ConfigError(
            "exec.dtype=bfloat16 runs on GPUs only (exec.backend=nccl); use float32 or float16 with gloo on the CPU."
        )
    for name in ("hidden_size", "intermediate_size", "max_tokens"):
        if int(getattr(exec_cfg, name)) < 1:
            raise ConfigError(f"exec.{name} must be >= 1, got {getattr(exec_cfg, name)}.")
    requested = world_size if world_size is not None else exec_cfg.world_size
    if requested is not None and requested != parallel.devices:
        raise ConfigError(
            f"the exec world size is {requested} but the plan places experts on {parallel.devices} devices; run "
            f"{parallel.devices} ranks (exec.world_size=null) or fit the plan with parallel.devices={requested}."
        )
    return exec_cfg
