"""What every figure module shares: the atomic PNG writer, the markdown table format, one seaborn theme and
the axis labels (with units) of the metric columns.

A leaf module (it imports no other repro.figures module), so report.py, paper.py, replication.py and diff.py can
all build on it without importing one another in a circle.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from repro.atomic import atomic_write  # noqa: E402

sns.set_theme(style="whitegrid", context="paper")  # one look for every figure module

# a summary / per-layer column as an axis: (label with its unit, factor from the stored unit to the shown one)
METRIC_AXES = {
    "lar": ("local activation rate (LAR)", 1.0),
    "lar_achieved": ("achieved local activation rate", 1.0),
    "node_local_activation_rate": ("node-local activation rate", 1.0),
    "dispatch_bytes": ("dispatch bytes (MiB)", 2.0**-20),
    "a2a_bytes": ("all-to-all bytes, dispatch + combine (MiB)", 2.0**-20),
    "expert_load_imbalance_max_mean": ("expert load, max / mean", 1.0),
    "token_imbalance_max_mean": ("tokens per device, max / mean", 1.0),
}
FRACTIONS = {"lar", "lar_achieved", "node_local_activation_rate"}  # drawn on a fixed [0, 1] axis


def metric_axis(metric: str) -> tuple[str, float]:
    """(axis label with unit, scale factor) of a metric column; unknown columns get their name in words."""
    return METRIC_AXES.get(metric, (metric.replace("_", " "), 1.0))


def save_png(fig, path: Path) -> Path:
    """Write `fig` as a PNG at `path` atomically (a kill never leaves a truncated figure linked from the report)
    and close it, also on failure. The format is explicit: the temporary name's suffix is not .png."""
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight"))
    finally:
        plt.close(fig)
    return Path(path)


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub markdown table; floats with 4 decimals."""
    def cell(v):
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)
