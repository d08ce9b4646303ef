"""One error family for every input boundary.

Each error carries one sentence that says what is wrong, where, and what to do. Entry points
(`python -m repro.run`, the importers) print that sentence instead of a traceback.
"""


class ReproError(Exception):
    """Base class: a user-facing problem with an input, a config or the environment."""


class TraceError(ReproError):
    """A routing trace on disk or in memory is malformed or inconsistent."""


class ConfigError(ReproError):
    """A configuration value or combination is invalid (parallel degrees, unknown names, ranges)."""


class WorkloadError(ReproError):
    """A workload cannot be loaded or is empty after filtering."""


class DataUnavailableError(ReproError):
    """Data or weights need the network or a token that this machine does not have."""


class SolverError(ReproError):
    """An optimisation solver failed or timed out without a feasible answer."""


def check_known_keys(group: str, config: dict, known) -> None:
    """Raise ConfigError naming the keys of config group `group` that are not in `known` (a typo is never ignored)."""
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise ConfigError(f"{group} has no key(s) {unknown}; its keys are {sorted(known)}.")
